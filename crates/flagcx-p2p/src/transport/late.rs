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

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, Vendor};

use super::remote_failure;
use crate::channel::{Channel, Counter, LateWord, SendStatus};
use crate::config::HostDirect;
use crate::engine::{Engine, Protocol};
use crate::error::{CommError, Result};
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
pub(crate) const STAND_IN_FRESH: usize = 16;

/// How long a post waits at most for the peer to unmap such an allocation.
pub(crate) const STAND_IN_WAIT: Duration = Duration::from_secs(5);

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
pub(crate) fn finished_counter(sender: bool) -> Counter {
    match sender {
        true => Counter::SendPosted,
        false => Counter::RecvPosted,
    }
}

/// The status and `k + 1` a `Done` word carries.
pub(crate) fn done_word(k: u64, status: SendStatus) -> u64 {
    (k + 1) << 8 | status.word()
}

/// One device-to-device copy on a stream: `(dst, src, bytes)`.
type StreamCopy = (DevicePtr, DevicePtr, usize);

/// What one message's side does on its stream, decided by its claim.
pub(crate) enum Part {
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

/// Ends the one wait this side's stream makes for message `k` (each word only moves forward):
/// the second side's for `Ready` (its copy then runs), the first side's for `Done` (as failed).
pub(crate) fn release_own(ch: &Channel, k: u64, second: bool) {
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
