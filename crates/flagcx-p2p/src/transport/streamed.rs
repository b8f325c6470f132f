//! Stream-ordered small messages: the caller's streams do the handshake, no host thread is on
//! a message's path, and a post only enqueues.
//!
//! A pair whose two ranks both have 64-bit stream memory operations, host registration and
//! sized copies ([`flagcx_adaptor::Capabilities::sized_copy`]) — CUDA and the host vendor —
//! registers the head of both its channels (counters, descriptors, eager slots) with its
//! runtime, so its streams reach them. Message `k` of a direction (a send of at most the
//! channel's eager slot, or a receive of at most that) then is one step of
//! [`DeviceAdaptor::stream_slot_steps`] on the caller's stream (a group's messages on one
//! stream in one call: one kernel on CUDA; separate stream operations where the pair shares a
//! device, see [`StreamLink`]'s `fused`):
//!
//! | side | stream operations |
//! |---|---|
//! | send | wait until `recv_done ≥ k − 63` (slot `k mod 64` free; skipped for the first 64) → copy the bytes into eager slot `k` → write the size word, then the status word `EAGER \| (k + 1) << 8` of send descriptor `k` |
//! | receive | wait until that status word `≥ (k + 1) << 8` → sized copy of at most the buffer's size out of slot `k`, its length read from the size word when the stream gets there → write `k + 1` into receive descriptor `k`'s taken word |
//!
//! The engine only follows: it announces the receive (so a larger send through the handshake
//! sees the receive's size and answers with a mismatch, whose status word — every status word
//! carries `k + 1` — releases the receiving stream, and whose size makes the sized copy copy
//! nothing), and once the stream's word says a message is done (a send's status word, written
//! after the last read of its source; a receive's taken word) it publishes `send_posted`
//! (sender) or reads the descriptor for the result and frees the slot with `recv_done`
//! (receiver). Credits therefore return through the receiver's engine, off the path of any
//! one message: a sender's stream waits only once 64 messages are unread.
//!
//! Both ranks derive the same per-direction limit (the channel's eager slot), so a message
//! and its receive agree on the path whenever sizes allow a match; a receive of more than
//! the limit goes through the engine, which takes an eager message out of its slot as for any
//! eager sender. As on the eager path, a message larger than its receive fails the receive
//! alone (the sender was done). A peer that is lost, or times out, while a stream waits on
//! one of its words has the word written by this rank's engine (a failure status and an
//! impossible size; or `recv_done` far ahead), so no stream hangs, and the operation fails.
//!
//! `FLAGCX_P2P_STREAM=on` takes this path wherever both ranks can; `auto` (the default) and
//! `off` do not yet. It is meant for one rank per GPU, where the kernel and copy-engine
//! floors in the probes promise a few microseconds per hop; no two-GPU host was lent
//! while it was built, and on one H200 (two processes time-sliced on one GPU, which take
//! turns at kernels and device copies, ~140 µs per turn) it measured 185 µs per 8 B sendrecv
//! and 332 µs per 8 B round trip against 40–46 and 31 µs for the posting threads' paths.

use flagcx_adaptor::DeviceAdaptor;

use super::{remote_failure, send_failure, Phase, Progress, Step};
use crate::channel::{Counter, SendStatus};
use crate::engine::{Engine, Protocol};
use crate::error::{CommError, Result};
use crate::link::streamed::*;
use crate::op::{Dir, Op, Resume};
use crate::shared::Path;

impl<A: DeviceAdaptor> Engine<A> {
    /// One pass over a stream-ordered step (see the module docs).
    pub(crate) fn progress_streamed(&mut self, p: usize, step: &mut Step) -> Result<Progress> {
        let conn = self.peers[p].as_mut().expect("checked by caller");
        let Phase::Streamed { announced } = &mut step.phase else {
            unreachable!("only stream-ordered steps")
        };
        let (k, bytes) = (step.index, step.op.bytes);
        step.path = Path::Eager;
        match step.op.dir {
            Dir::Send => {
                let fault = conn.out.load(Counter::RecvFault);
                if fault > k {
                    return Err(remote_failure(p, fault));
                }
                if !conn.out.put_landed(k) {
                    let on_peer = !conn.out.window_open(k);
                    return Ok(Progress::Idle { on_peer });
                }
                conn.out.store(Counter::SendPosted, k + 1);
                Ok(Progress::Done(Ok(bytes)))
            }
            Dir::Recv => {
                if !*announced {
                    if !conn.inc.window_open(k) {
                        return Ok(Progress::Idle { on_peer: false });
                    }
                    let desc = crate::channel::RecvDesc {
                        size: bytes as u64,
                        handle: None,
                        offset: 0,
                        span: crate::channel::Span::default(),
                        chunks: false,
                    };
                    conn.inc.write_recv_desc(k, &desc);
                    conn.inc.store(Counter::RecvPosted, k + 1);
                    *announced = true;
                    return Ok(Progress::Moved);
                }
                let fault = conn.inc.load(Counter::SendFault);
                if fault > k {
                    return Err(remote_failure(p, fault));
                }
                // A take from the inbox may finish before the slot's words it follows land (the
                // putter writes the inbox's first): the descriptor is read once both did.
                let published = conn.inc.published(k);
                if !(published && conn.inc.taken(k)) {
                    // Once the message is in its slot only our own stream is left: a peer
                    // that was done with it and went away does not fail it.
                    return Ok(Progress::Idle {
                        on_peer: !published,
                    });
                }
                let sd = conn.inc.read_send_desc(k)?;
                let size = sd.size as usize;
                let r = match sd.status {
                    SendStatus::Eager if size <= bytes => Ok(size),
                    SendStatus::Eager => Err(CommError::SizeMismatch {
                        peer: p,
                        send_bytes: size,
                        recv_bytes: bytes,
                    }),
                    _ => Err(send_failure(p, &sd, bytes, false).unwrap_or_else(|| {
                        CommError::Protocol(format!(
                            "rank {p} answered a stream-ordered receive of {bytes} bytes \
                             with a {size}-byte send"
                        ))
                    })),
                };
                conn.inc.store(Counter::RecvDone, k + 1);
                Ok(Progress::Done(r))
            }
        }
    }

    /// Before a stream-ordered (or late-copy) operation is failed without its peer (lost, timed out, torn
    /// down): releases the waits its stream may still be in, and lets the stream pass the
    /// operation — its copy touches the caller's buffer, which the operation may be keeping
    /// alive — for up to [`RELEASE_WAIT`]. A stream still held by earlier work of the caller's
    /// after that keeps the buffer: the operation forgets it rather than free it under a copy.
    pub(crate) fn release_streamed(&self, op: &mut Op) {
        let conn = self.peers.get(op.peer).and_then(|c| c.as_ref());
        let (Some(Resume::Streamed), Some(conn)) = (&op.resume, conn) else {
            return;
        };
        StreamLink::release_side(&conn.out, &conn.inc, op.dir, op.index);
        // The stream passed a send once its status word landed (its source read for the last
        // time), a receive once its taken word did (its copy done, or skipped).
        let passed = || match op.dir {
            Dir::Send => conn.out.put_landed(op.index),
            Dir::Recv => conn.inc.taken(op.index),
        };
        let t0 = std::time::Instant::now();
        while !passed() {
            if t0.elapsed() > RELEASE_WAIT {
                tracing::warn!(
                    peer = op.peer,
                    "a released stream-ordered operation's stream has not passed it; its \
                     buffer is kept alive for good"
                );
                std::mem::forget(op.keep.take());
                return;
            }
            std::thread::yield_now();
        }
    }
}

/// Stream-ordered messages as the engine follows them: steps in [`Phase::Streamed`].
pub(crate) struct Streamed;

impl<A: DeviceAdaptor> Protocol<A> for Streamed {
    fn drives(&self, step: &Step) -> bool {
        matches!(step.phase, Phase::Streamed { .. })
    }

    fn step(&self, e: &mut Engine<A>, p: usize, step: &mut Step) -> Result<Progress> {
        e.progress_streamed(p, step)
    }

    fn release(&self, e: &Engine<A>, op: &mut Op) {
        e.release_streamed(op);
    }
}
