//! The posting side of [`crate::transport::late`]: what the API thread does for it.

use crate::channel::{Channel, Counter, LateWord, RecvDesc, SendDesc, SendStatus, DESC_RING};
use crate::comm::Comm;
use crate::error::{CommError, Result};
use crate::ipccache::Theirs;
use crate::link::streamed::StreamLink;
use crate::link::Exported;
use crate::link::{export, remote_failure};
use crate::op::{Dir, Op, Resume};
use crate::peer::TransportKind;
use crate::transport::late::*;
use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{DeviceAdaptor, DevicePtr, StreamHandle, WaitCondition};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

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
