//! Late copies: IPC pairs whose every message is copied by the stream of the rank that posts
//! it second, so no stream ever waits for work its own process has yet to enqueue.
//!
//! On the proxy path a caller's stream waits (a join) for a copy the proxy issues once the
//! peer posts. Where a process's streams share one work queue (CUDA with
//! `CUDA_DEVICE_MAX_CONNECTIONS=1`, the host vendor with `FLAGCX_HOST_QUEUES=1`) that copy
//! queues behind the join and neither moves. Here each side of message `k` publishes its
//! descriptor and claims the message ([`Channel::claim`]); the first to claim only marks its
//! stream's place and waits, the second has both descriptors and copies:
//!
//! | side | posting thread | stream |
//! |---|---|---|
//! | first | descriptor (size, IPC handle, offset), claim | write `Ready = k + 1` … wait until `Done ≥ (k + 1) << 8`, write `Passed = k + 1` |
//! | second | descriptor, claim, read the first's descriptor, store both byte counts | wait until `Ready ≥ k + 1` → the one copy (push or pull) → write `Done = (k + 1) << 8 \| status`, `Copied = k + 1` |
//!
//! Every wait is on the other process's stream, which wrote (or will write) that word ahead
//! of any wait of its own in the same call: a call's streams take all their `Ready` writes
//! first, then their copies, then their waits for `Done`, so two ranks' groups never wait on
//! each other in a circle. The words live in message `k`'s receive descriptor
//! ([`LateWord`]), registered with both runtimes; a size mismatch is settled by the second
//! side's posting thread (it writes `Done` with the status at once, and nothing is copied).
//!
//! The engine only follows: a message is done on either side once the word only its own stream
//! writes last landed (`Passed`, `Copied`); then each side's
//! engine publishes that it finished `k` (the sender in `send_posted`, the receiver in
//! `recv_posted`). A side posts message `k` only once both engines finished `k − 64`, so a
//! descriptor slot, and its words, are never reused early; past 64 messages ahead of its peer
//! in one direction, a post waits (for the peer, its loss, an abort or `FLAGCX_TIMEOUT_MS`).
//! Where the peer is lost or the pair retired, each engine writes the one word its own stream
//! waits on (`Done` for the first side, `Ready` for the second), so no stream hangs and no
//! side takes the other's release for its own completion.
//!
//! `FLAGCX_P2P_LATE_COPY`: `auto` (the default) takes this path for every pair of two CUDA
//! ranks and wherever a rank of the pair found its streams sharing one queue at
//! setup; such a pair has no eager slots, stream-ordered messages or posting-thread copies
//! (every message of it must take the same path on both sides).
//!
//! Why every CUDA pair: a proxy's copy is a runtime call made while the caller's stream waits
//! for it, and the CUDA driver holds such calls behind other threads of the process. With a
//! copy into pageable memory pending on the legacy default stream (torch's current stream
//! unless a program sets one: `loss.item()`, `tensor.cpu()`), `cuMemcpyDtoDAsync` and
//! `cuLaunchKernel` on any other stream block until that copy ends — which waits for the
//! caller's stream, which waits for the proxy (`benches/probes/pageable_calls.c`,
//! `PROBE_T=legacy`: blocked > 1.5 s, returned 0.8 ms after the release; on a stream of the
//! program's own they return in 0.35 ms). Two CUDA ranks training with DDP on one H100
//! stopped that way in their first broadcast. Under MPS, a client's streams share fewer
//! hardware queues, and a proxy copy queued behind a caller stream's join held the Rust
//! client pattern (it finished with `CUDA_DEVICE_MAX_CONNECTIONS=32`). Here every runtime
//! call of a message is made by a posting thread at submission, and no stream waits for work
//! its own process has yet to enqueue, so neither can happen.
//!
//! What the default costs, measured against `FLAGCX_P2P_LATE_COPY=off` in the same call (one
//! H100, two CUDA ranks, `9b32e6c`; `gpu75/run.sh`, `run2.sh`): under MPS sendrecv 27–48 µs
//! against 40–47 µs from 8 B to 2 MiB, all-reduce of 128 MiB 1443–1451 µs against
//! 1884–1926 µs, but ping-pong 37–44 µs against 27–29 µs (each hop is a stream wait on the
//! other process's word); without MPS, where the two processes time-slice the GPU and every
//! such wait waits for a context switch, ping-pong takes 296–331 µs against 23–28 µs, while
//! sendrecv (28–48 µs against 33–45 µs) and all-reduce stay level. One rank per GPU, and MPS,
//! have no time slicing; correct data and no stall under torch's default stream come first.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, StreamHandle, Vendor, WaitCondition};

use super::{export, remote_failure};
use crate::channel::{Channel, Counter, LateWord, RecvDesc, SendDesc, SendStatus, DESC_RING};
use crate::comm::Comm;
use crate::config::HostDirect;
use crate::engine::{Engine, Protocol};
use crate::error::{CommError, Result};
use crate::ipccache::Theirs;
use crate::link::streamed::StreamLink;
use crate::link::Exported;
use crate::op::{Dir, Op, Resume};
use crate::peer::{PeerInfo, TransportKind};
use crate::transport::Progress;
use flagcx_adaptor::tracking::lock;

/// How long a release waits for this rank's stream to finish a copy it let go.
const RELEASE_WAIT: Duration = Duration::from_millis(100);

/// Stand-ins one post allocates or takes at most where each lies at the addresses of an
/// allocation this rank freed that the peer may still map (`Comm::late_stand_in`). Those go
/// back to the pool, so each fills one such hole for good: the next fresh allocation lies
/// elsewhere.
const STAND_IN_FRESH: usize = 16;

/// How long a post waits at most for the peer to unmap such an allocation.
const STAND_IN_WAIT: Duration = Duration::from_secs(5);

/// Whether the pair of `me` and `peer` copies late (both ranks compute the same answer from
/// the all-gathered peer information).
pub(crate) fn allowed(me: &PeerInfo, peer: &PeerInfo, transport: Option<TransportKind>) -> bool {
    let able = |x: &PeerInfo| x.caps.stream_mem_ops_64 && x.caps.host_register;
    // HIP pairs stay out of this default: the driver behaviour it answers was measured on
    // CUDA, and the late path has never run on an AMD GPU (`FLAGCX_P2P_LATE_COPY=on` takes
    // it where HIP's stream memory operations are there); measure it there first.
    let cuda = |x: &PeerInfo| x.vendor == Vendor::Cuda;
    let wanted = match (me.late_copy, peer.late_copy) {
        (HostDirect::Off, _) | (_, HostDirect::Off) => false,
        (HostDirect::On, _) | (_, HostDirect::On) => true,
        _ => me.shares_queue || peer.shares_queue || (cuda(me) && cuda(peer)),
    };
    transport == Some(TransportKind::Ipc) && wanted && able(me) && able(peer)
}

/// The counter through which a side publishes that its engine finished a message.
fn finished_counter(sender: bool) -> Counter {
    match sender {
        true => Counter::SendPosted,
        false => Counter::RecvPosted,
    }
}

/// The status and `k + 1` a `Done` word carries.
fn done_word(k: u64, status: SendStatus) -> u64 {
    (k + 1) << 8 | status.word()
}

/// One device-to-device copy on a stream: `(dst, src, bytes)`.
type StreamCopy = (DevicePtr, DevicePtr, usize);

/// What one message's side does on its stream, decided by its claim.
enum Part {
    /// It claimed first: write `Ready`, later wait for `Done`. Where its buffer has no IPC
    /// handle (pool memory) the peer copies to or from a stand-in (`crate::standin`) instead:
    /// `fill` copies the buffer into it before `Ready` (a receive's too, so that bytes past a
    /// shorter message come back unchanged), `drain` copies it back after `Done` (receives).
    First {
        fill: Option<StreamCopy>,
        drain: Option<StreamCopy>,
    },
    /// It claimed second: wait for the first's `Ready`, copy `n` bytes, write `Done`.
    Second {
        src: DevicePtr,
        dst: DevicePtr,
        n: usize,
    },
    /// Settled by the posting thread (a size mismatch): nothing on the stream.
    Settled,
}

impl<A: DeviceAdaptor> Comm<A> {
    /// The late-copy link with `peer`, if the pair copies late.
    pub(crate) fn late_link(&self, peer: usize) -> Option<&StreamLink> {
        self.late.get(peer).and_then(|l| l.as_ref())
    }

    /// Whether every IPC pair of this rank copies late, so every copy through the IPC cache is
    /// a counted late copy (see `IpcCache::open_busy`).
    fn ipc_only_late(&self) -> bool {
        (0..self.nranks)
            .all(|q| self.transports[q] != Some(TransportKind::Ipc) || self.late_link(q).is_some())
    }

    /// Claims and enqueues the late-copy operations `ops` (numbered, in number order per pair
    /// and direction), setting each one's resume: [`Resume::Late`], or [`Resume::Failed`] where
    /// its side could not be enqueued (then no stream waits on it). The caller holds
    /// `Comm::late_order` so that claims go in number order.
    pub(crate) fn enqueue_late(&self, ops: &mut [(Op, StreamHandle)]) {
        let mut parts = Vec::with_capacity(ops.len());
        // Every buffer is named first: a post that waits for a peer to unmap an allocation
        // (`late_stand_in`) holds no claim meanwhile, so no peer's stream waits for it.
        let names: Vec<Result<Exported>> =
            ops.iter_mut().map(|(op, _)| self.late_name(op)).collect();
        for ((op, _), name) in ops.iter_mut().zip(names) {
            match name.and_then(|e| self.claim_late(op, e)) {
                Ok(part) => parts.push(Some(part)),
                Err(e) => {
                    op.resume = Some(Resume::Failed(Box::new(e)));
                    parts.push(None);
                }
            }
        }
        let mut streams: Vec<StreamHandle> = ops.iter().map(|(_, s)| *s).collect();
        streams.sort_unstable_by_key(|s| s.0);
        streams.dedup();
        for stream in streams {
            let mine: Vec<usize> = (0..ops.len())
                .filter(|&i| ops[i].1 == stream && parts[i].is_some())
                .collect();
            // SAFETY: `post` checked the buffers, which their operations keep alive until the
            // engine saw their `Done`; the words are registered for the pair's lifetime.
            let r = unsafe { self.enqueue_late_stream(ops, &parts, &mine, stream) };
            if let Err(e) = r {
                for &i in &mine {
                    let (op, _) = &mut ops[i];
                    self.settle_late(op, matches!(parts[i], Some(Part::Second { .. })));
                    op.resume = Some(Resume::Failed(Box::new(e.duplicate())));
                }
            }
        }
    }

    /// [`export`] for a late pair, with the runtime's identifier of the allocation where the
    /// pair names by it (`StreamLink::naming`; one more runtime call per message).
    fn late_export(&self, link: &StreamLink, ptr: DevicePtr, bytes: usize) -> Result<Exported> {
        let mut e = export(&self.adaptor, ptr, bytes, TransportKind::Ipc)?;
        if link.naming && e.handle.is_some() {
            e.buffer_id = self
                .adaptor
                .mem_buffer_id(DevicePtr(e.span.base))
                .ok()
                .flatten();
        }
        Ok(e)
    }

    /// The late-copy link with `op`'s peer.
    fn late_link_of(&self, op: &Op) -> Result<&StreamLink> {
        self.late_link(op.peer)
            .ok_or_else(|| CommError::Protocol(format!("no late-copy link with rank {}", op.peer)))
    }

    /// The buffer `op`'s descriptor will name to the peer: its own, or a stand-in where the
    /// runtime has no handle for it or the peer may still map a freed allocation at its
    /// addresses (`link::named`). A side that turns out second copies with its own buffer and
    /// never names it, so its stand-in goes back unused when the operation ends.
    fn late_name(&self, op: &mut Op) -> Result<Exported> {
        let link = self.late_link_of(op)?;
        let bytes = op.bytes;
        let e = match self.late_export(link, op.ptr, bytes) {
            Ok(e) if link.may_name(&e) => e,
            Err(err) if bytes == 0 => return Err(err),
            r => {
                let why = match r {
                    Ok(_) => "the peer may still map a freed allocation at their addresses".into(),
                    Err(err) => format!("they have no IPC handle ({err})"),
                };
                tracing::debug!(
                    "rank {}: {bytes} bytes at {}: {why}; a stand-in carries them",
                    self.rank,
                    op.ptr
                );
                self.late_stand_in(op, link, bytes)?
            }
        };
        Ok(e)
    }

    /// One operation's claim, its buffer named as `e` ([`Comm::late_name`]): waits for its
    /// descriptor slot, publishes its descriptor, claims the message and, second, reads the
    /// peer's and decides the copy.
    fn claim_late(&self, op: &mut Op, e: Exported) -> Result<Part> {
        let link = self.late_link_of(op)?;
        let (sender, k, bytes) = (op.dir == Dir::Send, op.index, op.bytes);
        let ch = link.channel(op.dir);
        self.late_window(ch, k, sender, op.peer)?;
        // A peer that retired the pair (or failed this message) may be gone with its
        // allocations: its descriptor is not to be opened.
        let fault = ch.load(match sender {
            true => Counter::RecvFault,
            false => Counter::SendFault,
        });
        if fault > k {
            return Err(remote_failure(op.peer, fault));
        }
        match sender {
            true => ch.write_send_desc(
                k,
                &SendDesc {
                    size: bytes as u64,
                    status: SendStatus::Ok,
                    handle: e.handle,
                    offset: e.offset,
                    span: e.span,
                },
            ),
            false => ch.write_recv_desc(
                k,
                &RecvDesc {
                    size: bytes as u64,
                    handle: e.handle,
                    offset: e.offset,
                    span: e.span,
                    chunks: false,
                },
            ),
        }
        let first = ch.claim(k, sender);
        tracing::debug!(
            "rank {}: late {:?} {k} with rank {}: {} bytes at {} named as offset {:#x} of \
             allocation {:#x} ({} bytes{}), claimed {}",
            self.rank,
            op.dir,
            op.peer,
            bytes,
            op.ptr,
            e.offset,
            e.span.base,
            e.span.len,
            if op.stand_in.is_some() {
                ", a stand-in"
            } else {
                ""
            },
            if first { "first" } else { "second" }
        );
        if first {
            op.resume = Some(Resume::Late {
                second: false,
                mapping: None,
            });
            let Some(stand_in) = op.stand_in.as_mut() else {
                return Ok(Part::First {
                    fill: None,
                    drain: None,
                });
            };
            let s = stand_in.expose();
            return Ok(Part::First {
                fill: Some((s, op.ptr, bytes)),
                drain: (!sender).then_some((op.ptr, s, bytes)),
            });
        }
        // Second: the peer's descriptor was published before its claim, which we saw.
        let (send, recv, theirs) = match sender {
            true => {
                let d = ch.read_recv_desc(k)?;
                (
                    bytes,
                    d.size as usize,
                    (Theirs::recv(op.peer, &d), d.offset),
                )
            }
            false => {
                let d = ch.read_send_desc(k)?;
                (
                    d.size as usize,
                    bytes,
                    (Theirs::send(op.peer, &d), d.offset),
                )
            }
        };
        ch.late_word(k, LateWord::SendBytes)
            .store(send as u64, Ordering::Relaxed);
        ch.late_word(k, LateWord::RecvBytes)
            .store(recv as u64, Ordering::Relaxed);
        if send > recv {
            let done = done_word(k, SendStatus::SizeMismatch);
            ch.late_word(k, LateWord::Done)
                .store(done, Ordering::Release);
            ch.late_word(k, LateWord::Copied)
                .store(k + 1, Ordering::Release);
            op.resume = Some(Resume::Late {
                second: true,
                mapping: None,
            });
            return Ok(Part::Settled);
        }
        let peer_buf = match send {
            0 => DevicePtr(0),
            _ => {
                // Counted busy under the cache's lock: no mapping closes while the copy may
                // run. On failure the first side learns it from `Done` (its stream passes).
                let all_late = self.ipc_only_late();
                let opened = lock(&self.shared.ipc).open_busy(&self.adaptor, theirs.0, all_late);
                let base = opened.inspect_err(|_| {
                    let done = done_word(k, SendStatus::SenderFailed);
                    ch.late_word(k, LateWord::Done)
                        .store(done, Ordering::Release);
                })?;
                DevicePtr(base.0 + theirs.1)
            }
        };
        op.resume = Some(Resume::Late {
            second: true,
            mapping: theirs.0.handle.filter(|_| send > 0).map(Box::new),
        });
        let (src, dst) = match sender {
            true => (op.ptr, peer_buf),
            false => (peer_buf, op.ptr),
        };
        Ok(Part::Second { src, dst, n: send })
    }

    /// A stand-in for `op`'s `bytes` (its own, or one of the pool) that the peer may map, as
    /// `op.stand_in`, exported. A fresh allocation may lie at the addresses of one this rank
    /// freed and the peer still maps (until it unmaps it at rest and says so, `link::named`):
    /// then another is taken, up to [`STAND_IN_FRESH`] of them, and those tried are looked at
    /// again while the peer gets to rest, up to [`STAND_IN_WAIT`] (or `FLAGCX_TIMEOUT_MS` if
    /// shorter). Meanwhile this posting thread steps out of `Shared::late_posting`, so that
    /// this rank's engine may close mappings too: it has enqueued nothing for this post yet.
    /// Those not taken go back to the pool.
    fn late_stand_in(&self, op: &mut Op, link: &StreamLink, bytes: usize) -> Result<Exported> {
        let mut tried: Vec<(crate::standin::StandIn, Exported)> = Vec::new();
        let wait = self
            .config
            .timeout
            .map_or(STAND_IN_WAIT, |t| t.min(STAND_IN_WAIT));
        let t0 = Instant::now();
        loop {
            if let Some(i) = tried.iter().position(|(_, e)| link.may_name(e)) {
                let (s, e) = tried.swap_remove(i);
                op.stand_in = Some(s);
                return Ok(e);
            }
            if tried.len() < STAND_IN_FRESH {
                let s = match op.stand_in.take() {
                    Some(s) => s,
                    None => crate::standin::take(&self.stand_ins, &self.adaptor, bytes)?,
                };
                let e = self.late_export(link, s.ptr, bytes)?;
                tried.push((s, e));
                continue;
            }
            if t0.elapsed() > wait {
                return Err(CommError::Timeout {
                    ms: wait.as_millis() as u64,
                    peer: Some(op.peer),
                    what: format!(
                        "a post of {bytes} bytes waited for rank {} to unmap allocations this \
                         rank freed: its buffer and {STAND_IN_FRESH} stand-ins lie at their \
                         addresses, and the peer unmaps them only once nothing is in flight",
                        op.peer
                    ),
                });
            }
            self.shared.late_posting.fetch_sub(1, Ordering::AcqRel);
            std::thread::sleep(Duration::from_micros(200));
            // Back in only while the engine is not closing mappings (see `trim_at_rest`).
            let _inbox = self.inbox_for_handover(|| false);
            self.shared.late_posting.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Waits until descriptor slot `k` (and its words) may be written: both engines finished
    /// message `k − 64`. Ends early, with an error, if the peer is lost, the communicator is
    /// aborted or the operation timeout passes.
    fn late_window(&self, ch: &Channel, k: u64, sender: bool, peer: usize) -> Result<()> {
        let open = || {
            ch.load(finished_counter(sender)) + DESC_RING > k
                && ch.load(finished_counter(!sender)) + DESC_RING > k
        };
        let t0 = Instant::now();
        while !open() {
            if self.is_aborted() {
                return Err(CommError::Aborted);
            }
            if self.shared.lost[peer].load(Ordering::Acquire) {
                return Err(CommError::PeerLost {
                    peer,
                    reason: "the pair was retired while a late-copy post waited for its slot"
                        .into(),
                });
            }
            if let Some(t) = self.config.timeout.filter(|t| t0.elapsed() > *t) {
                return Err(CommError::Timeout {
                    ms: t.as_millis() as u64,
                    peer: Some(peer),
                    what: format!(
                        "a post to rank {peer} waited for message {} of the pair to finish \
                         (more than {DESC_RING} messages ahead of the peer)",
                        k - DESC_RING
                    ),
                });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        Ok(())
    }

    /// Enqueues the parts `mine` (indices into `ops`) on `stream`: every `Ready` write, then
    /// every copy, then every wait for `Done`.
    ///
    /// # Safety
    /// Each buffer is device memory of this adaptor (or, for a second side's copy, the peer's
    /// mapped allocation), valid until its operation's `Done` lands.
    unsafe fn enqueue_late_stream(
        &self,
        ops: &[(Op, StreamHandle)],
        parts: &[Option<Part>],
        mine: &[usize],
        stream: StreamHandle,
    ) -> Result<()> {
        let a = &self.adaptor;
        let word = |i: usize, w: LateWord| {
            let op = &ops[i].0;
            let link = self.late_link(op.peer).expect("claimed through it");
            link.device_word(op.dir, op.index, w)
        };
        for &i in mine {
            if let Some(Part::First { fill, .. }) = parts[i] {
                let k = ops[i].0.index;
                // SAFETY: the caller's buffer and the operation's stand-in, both `n` bytes or
                // more and kept until `Done`; a registered word of the pair's channel.
                unsafe {
                    if let Some((dst, src, n)) = fill {
                        a.memcpy_d2d_async(dst, src, n, stream)?;
                    }
                    a.stream_write_value64(stream, word(i, LateWord::Ready), k + 1)?;
                }
            }
        }
        for &i in mine {
            if let Some(Part::Second { src, dst, n }) = parts[i] {
                let k = ops[i].0.index;
                // SAFETY: registered words; `src` and `dst` hold `n` bytes (the forwarded
                // contract, and the peer's descriptor for its side, kept until `Done`).
                unsafe {
                    a.stream_wait_value64(
                        stream,
                        word(i, LateWord::Ready),
                        k + 1,
                        WaitCondition::Geq,
                    )?;
                    if n > 0 {
                        a.memcpy_d2d_async(dst, src, n, stream)?;
                    }
                    a.stream_write_values64(
                        stream,
                        &[
                            (word(i, LateWord::Done), done_word(k, SendStatus::Ok)),
                            (word(i, LateWord::Copied), k + 1),
                        ],
                    )?;
                }
            }
        }
        for &i in mine {
            if let Some(Part::First { drain, .. }) = parts[i] {
                let k = ops[i].0.index;
                // SAFETY: registered words of the pair's channel; the stand-in and the
                // caller's buffer as for `fill`.
                unsafe {
                    a.stream_wait_value64(
                        stream,
                        word(i, LateWord::Done),
                        done_word(k, SendStatus::Ok),
                        WaitCondition::Geq,
                    )?;
                    if let Some((dst, src, n)) = drain {
                        a.memcpy_d2d_async(dst, src, n, stream)?;
                    }
                    a.stream_write_value64(stream, word(i, LateWord::Passed), k + 1)?;
                }
            }
        }
        Ok(())
    }

    /// After a failure to enqueue `op`'s side: writes the word its own stream may wait on, so
    /// that it does not for good (the operation fails and retires the pair, whose peer then
    /// writes its own). What part of it went in is left to its stream: its copy, if any, keeps
    /// the mapping's count.
    fn settle_late(&self, op: &Op, second: bool) {
        if let Some(link) = self.late_link(op.peer) {
            release_own(link.channel(op.dir), op.index, second);
        }
    }
}

/// Ends the one wait this side's stream makes for message `k` (each word only moves forward):
/// the second side's for `Ready` (its copy then runs), the first side's for `Done` (as failed).
fn release_own(ch: &Channel, k: u64, second: bool) {
    match second {
        true => ch
            .late_word(k, LateWord::Ready)
            .fetch_max(k + 1, Ordering::AcqRel),
        false => ch
            .late_word(k, LateWord::Done)
            .fetch_max(done_word(k, SendStatus::SenderFailed), Ordering::AcqRel),
    };
}

impl<A: DeviceAdaptor> Engine<A> {
    /// One pass over a late-copy step (see the module docs).
    pub(crate) fn progress_late(&mut self, p: usize, op: &mut Op) -> Result<Progress> {
        let Some(Resume::Late { second, .. }) = op.resume else {
            unreachable!("only late-copy steps")
        };
        let conn = self.peers[p].as_mut().expect("checked by caller");
        let (k, sender) = (op.index, op.dir == Dir::Send);
        let ch = match op.dir {
            Dir::Send => &conn.out,
            Dir::Recv => &conn.inc,
        };
        let word = |w: LateWord| ch.late_word(k, w).load(Ordering::Acquire);
        // The last word this side's stream writes for the message.
        let last = word(match second {
            true => LateWord::Copied,
            false => LateWord::Passed,
        });
        if last <= k {
            let fault = ch.load(match sender {
                true => Counter::RecvFault,
                false => Counter::SendFault,
            });
            // Once the peer's word this side's stream waits for landed, only our stream is left.
            let on_peer = match second {
                true => word(LateWord::Ready) <= k,
                false => word(LateWord::Done) >> 8 <= k,
            };
            if fault > k && on_peer {
                return Err(remote_failure(p, fault));
            }
            return Ok(Progress::Idle { on_peer });
        }
        let done = word(LateWord::Done);
        let send = word(LateWord::SendBytes) as usize;
        let recv = word(LateWord::RecvBytes) as usize;
        let r = match SendStatus::from_word(done & 0xFF)? {
            SendStatus::Ok => Ok(send),
            SendStatus::SizeMismatch => Err(CommError::SizeMismatch {
                peer: p,
                send_bytes: send,
                recv_bytes: recv,
            }),
            // Released here because the pair is gone (its words were written for it).
            _ if conn.lost.is_some() => Err(CommError::PeerLost {
                peer: p,
                reason: conn.lost.clone().unwrap_or_default(),
            }),
            _ => Err(CommError::RemoteFailure {
                peer: p,
                reason: "its side of the message could not be enqueued".into(),
            }),
        };
        if let Some(Resume::Late { mapping, .. }) = op.resume.as_mut() {
            if let Some(h) = mapping.take() {
                lock(&self.shared.ipc).done_busy(&h);
            }
        }
        ch.store(finished_counter(sender), k + 1);
        Ok(Progress::Done(r))
    }

    /// Ends the wait of `op`'s stream on the peer's word, if it is a late copy (first, for
    /// every operation being failed at once, before [`Engine::release_late`] waits for each:
    /// streams sharing one queue may pass one only after another's release).
    pub(crate) fn unblock_late(&self, op: &Op) {
        let Some(Resume::Late { second, .. }) = op.resume else {
            return;
        };
        if let Some(conn) = self.peers.get(op.peer).and_then(|c| c.as_ref()) {
            let ch = match op.dir {
                Dir::Send => &conn.out,
                Dir::Recv => &conn.inc,
            };
            release_own(ch, op.index, second);
        }
    }

    /// Before a late-copy operation is failed without its peer (lost, timed out, torn down):
    /// ends its stream's wait (and those of the pair's other pending operations) and lets the
    /// stream pass the message (up to [`RELEASE_WAIT`]): its copy may use the caller's buffer
    /// and the peer's mapping, and its last write is to the pair's words, which go with the
    /// communicator. A stream still held by other work after that keeps all three for good.
    pub(crate) fn release_late(&self, op: &mut Op) {
        let Some(Resume::Late { second, .. }) = op.resume else {
            return;
        };
        let Some(conn) = self.peers.get(op.peer).and_then(|c| c.as_ref()) else {
            return;
        };
        // The pair is done for: every stream waiting on it is let go first, since where
        // streams share one queue this one may pass only after another does.
        for s in conn.sends.iter().chain(&conn.recvs) {
            self.unblock_late(&s.op);
        }
        self.unblock_late(op);
        let ch = match op.dir {
            Dir::Send => &conn.out,
            Dir::Recv => &conn.inc,
        };
        let k = op.index;
        let mapping = match op.resume.as_mut() {
            Some(Resume::Late { mapping, .. }) => mapping.take(),
            _ => None,
        };
        let last = match second {
            true => LateWord::Copied,
            false => LateWord::Passed,
        };
        let t0 = Instant::now();
        while ch.late_word(k, last).load(Ordering::Acquire) <= k {
            if t0.elapsed() > RELEASE_WAIT {
                tracing::warn!(
                    peer = op.peer,
                    "a released late copy's stream has not passed it; its buffer, the peer \
                     mapping it copies through and the pair's words are kept for good"
                );
                std::mem::forget(op.keep.take());
                // The words stay mapped (these references are never dropped) and registered.
                std::mem::forget((conn.out.clone(), conn.inc.clone()));
                self.shared.late_kept.store(true, Ordering::Release);
                return;
            }
            std::thread::yield_now();
        }
        if let Some(h) = mapping {
            lock(&self.shared.ipc).done_busy(&h);
        }
    }
}

/// Late copies as the engine follows them: steps in [`Phase::Late`](crate::link::Phase::Late).
pub(crate) struct Late;

impl<A: DeviceAdaptor> Protocol<A> for Late {
    fn drives(&self, step: &crate::link::Step) -> bool {
        matches!(step.phase, crate::link::Phase::Late { .. })
    }

    fn step(&self, e: &mut Engine<A>, p: usize, step: &mut crate::link::Step) -> Result<Progress> {
        e.progress_late(p, &mut step.op)
    }

    fn unblock(&self, e: &Engine<A>, op: &Op) {
        e.unblock_late(op);
    }

    fn release(&self, e: &Engine<A>, op: &mut Op) {
        e.release_late(op);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::IpcCopier;
    use flagcx_adaptor::Capabilities;

    fn info(vendor: Vendor, late_copy: HostDirect, shares_queue: bool) -> PeerInfo {
        PeerInfo {
            rank: 0,
            vendor,
            device: 0,
            pci_bus_id: None,
            host_id: "h/1".into(),
            pid: 42,
            caps: Capabilities {
                stream_mem_ops_64: true,
                host_register: true,
                ..Default::default()
            },
            p2p_disable: false,
            ipc_copier: IpcCopier::Auto,
            host_direct: HostDirect::Auto,
            streamed: HostDirect::Auto,
            late_copy,
            shares_queue,
        }
    }

    #[test]
    fn cuda_pairs_copy_late_by_default_and_off_wins() {
        let ipc = Some(TransportKind::Ipc);
        let auto = |v| info(v, HostDirect::Auto, false);
        let cuda = auto(Vendor::Cuda);
        assert!(allowed(&cuda, &cuda, ipc), "CUDA pair, auto");
        assert!(!allowed(
            &cuda,
            &info(Vendor::Cuda, HostDirect::Off, false),
            ipc
        ));
        assert!(!allowed(&cuda, &cuda, Some(TransportKind::Staged)));
        // Not measured on an AMD GPU: HIP pairs copy late only when asked.
        let hip = auto(Vendor::Hip);
        assert!(!allowed(&hip, &hip, ipc));
        assert!(allowed(
            &hip,
            &info(Vendor::Hip, HostDirect::On, false),
            ipc
        ));
        // Host ranks keep their posting-thread copies unless a queue is shared or it is forced.
        let host = auto(Vendor::Host);
        assert!(!allowed(&host, &host, ipc));
        assert!(allowed(
            &host,
            &info(Vendor::Host, HostDirect::Auto, true),
            ipc
        ));
        assert!(allowed(
            &host,
            &info(Vendor::Host, HostDirect::On, false),
            ipc
        ));
        // A runtime that cannot write and wait on registered words never copies late.
        let mut weak = auto(Vendor::Cuda);
        weak.caps.stream_mem_ops_64 = false;
        assert!(!allowed(&weak, &auto(Vendor::Cuda), ipc));
    }
}
