//! Eager: small messages between ranks whose device memory is host addressable (the host
//! vendor), copied by the CPU through the channel's eager slots, one per send descriptor.
//!
//! Outside a group the posting thread copies a send into the peer's slot, or a receive out of
//! it ([`Comm::try_eager`]); a receive with the engine takes an eager message there
//! ([`Engine::take_eager`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flagcx_adaptor::{DeviceAdaptor, DevicePtr};

use super::ipc::poll_for;
use super::{started, Path, Progress, Step};
use crate::channel::{Channel, Counter, SendDesc, DESC_RING};
use crate::comm::{Comm, Request, State};
use crate::engine::{lock, Dir, Engine, Inbox};
use crate::error::{CommError, Result};

/// The API side's handle on one pair's eager slots (see [`crate::Config::eager_max`]).
pub(crate) struct EagerLink {
    /// This rank → peer.
    pub(crate) out: Arc<Channel>,
    /// Peer → this rank.
    pub(crate) inc: Arc<Channel>,
    /// Largest message this rank sends eagerly to the peer (0: none).
    pub(crate) send_max: usize,
    /// Largest message the peer can send eagerly to this rank (0: none).
    pub(crate) recv_max: usize,
    /// The peer's `RecvDone` as last read: slots below it + 64 are free without reading the
    /// counter again (a cache line the peer writes on every message). Under the inbox lock.
    pub(crate) freed: AtomicU64,
}

impl<A: DeviceAdaptor> Engine<A> {
    /// A receive whose sender sent eagerly (either receive phase): once the caller's stream
    /// passed the posting point, copies the message out of its eager slot.
    pub(crate) fn take_eager(
        &mut self,
        p: usize,
        step: &mut Step,
        sd: &SendDesc,
    ) -> Result<Progress> {
        if !started(&self.adaptor, step.op.start)? {
            return Ok(Progress::Idle { on_peer: false });
        }
        let conn = self.peers[p].as_ref().expect("checked by caller");
        step.path = Path::Eager;
        let r = receive_eager(&conn.inc, step.index, sd, step.op.ptr, step.op.bytes, p);
        match r {
            Err(e @ CommError::Protocol(_)) => Err(e),
            r => Ok(Progress::Done(r)),
        }
    }
}

/// Receives eager message `index` of `inc`, described by `sd`, into `dst` (`cap` bytes), and
/// frees its slot. A message larger than `cap` is refused (a size mismatch: the sender was
/// done with it, so only this side fails) and the pair goes on.
pub(crate) fn receive_eager(
    inc: &Channel,
    index: u64,
    sd: &SendDesc,
    dst: DevicePtr,
    cap: usize,
    peer: usize,
) -> Result<usize> {
    let lane = inc.geometry().eager;
    if sd.size as usize > lane {
        return Err(CommError::Protocol(format!(
            "rank {peer} sent an eager message of {} bytes; this channel's eager slots hold {lane}",
            sd.size
        )));
    }
    let r = if sd.size as usize > cap {
        Err(CommError::SizeMismatch {
            peer,
            send_bytes: sd.size as usize,
            recv_bytes: cap,
        })
    } else {
        // SAFETY: a channel has eager slots only where this rank's device memory is host
        // addressable (`Capabilities::host_addressable`), and a message too big for them is
        // refused before copying; so `dst` is a CPU address of `cap >= sd.size` writable bytes:
        // the caller's buffer, whose earlier stream work has completed.
        unsafe { inc.take_eager(index, sd, dst.0 as *mut u8) }
    };
    // Only the slot's release matters to the sender, which was done with the message;
    // `RecvPosted` stays (a later message's announcement or verdict moves it on).
    inc.store(Counter::RecvDone, index + 1);
    r
}

impl<A: DeviceAdaptor> Comm<A> {
    /// The eager path (the caller checked the pair has one, the post is outside a group and
    /// the stream is idle): a small message, while no earlier operation of its pair and
    /// direction is with the proxy, is moved by this thread. A send copies into the peer's channel; a receive takes
    /// a message already there (waiting up to the spin time for one the size of the eager
    /// slots). `None`: not taken, post normally.
    pub(crate) fn try_eager(
        &self,
        dir: Dir,
        ptr: DevicePtr,
        bytes: usize,
        peer: usize,
    ) -> Result<Option<Request>> {
        let Some(link) = self.eager.get(peer).and_then(|l| l.as_ref()) else {
            return Ok(None);
        };
        let d = dir as usize;
        let max = match dir {
            Dir::Send => link.send_max,
            Dir::Recv => link.recv_max,
        };
        if max == 0 || (dir == Dir::Send && bytes > max) {
            return Ok(None);
        }
        // Whether the pair and direction is free for this thread: nothing of it with the proxy,
        // not retired. Checked (again) under the inbox lock, which numbers messages.
        let free = |inbox: &Inbox, index: u64| {
            inbox.next[peer][d] == index
                && self.shared.pending[peer][d].load(Ordering::Acquire) == 0
                && !self.shared.lost[peer].load(Ordering::Acquire)
        };
        let r = match dir {
            Dir::Send => {
                let mut inbox = lock(&self.shared.inbox);
                let k = inbox.next[peer][d];
                let window_open = k < link.freed.load(Ordering::Relaxed) + DESC_RING || {
                    let done = link.out.load(Counter::RecvDone);
                    link.freed.store(done, Ordering::Relaxed);
                    k < done + DESC_RING
                };
                if !free(&inbox, k) || !window_open || link.out.load(Counter::RecvFault) != 0 {
                    return Ok(None);
                }
                // SAFETY: `ptr..ptr+bytes` was checked to lie in one allocation of this
                // adaptor, whose memory is host addressable (the pair has eager slots only
                // then), and the caller's stream is idle, so earlier work on it has finished
                // writing it; `bytes <= send_max <= ` the slot size; message `k` is ours under
                // the lock, with every earlier send finished (answered) and its slot free.
                unsafe { link.out.post_eager(k, ptr.0 as *const u8, bytes) };
                inbox.next[peer][d] = k + 1;
                Ok(bytes)
            }
            Dir::Recv => {
                let k = lock(&self.shared.inbox).next[peer][d];
                // Wait without the lock for a message that may well come eagerly: only where
                // any message this receive can take fits the eager slots.
                let spin = if bytes <= max {
                    self.config.spin.unwrap_or_default()
                } else {
                    Duration::ZERO
                };
                // Poll the descriptor's status word: an eager message publishes it last (one
                // cache line to fetch); a message of the proxy's protocol shows in `SendPosted`
                // and is left to the proxy.
                let mut polls = 0u32;
                let found = poll_for(
                    spin,
                    || spin,
                    || {
                        if let Some(sd) = link.inc.eager_arrived(k) {
                            return Some(Some(sd));
                        }
                        // The counter costs more than a poll: every 64 polls.
                        polls = polls.wrapping_add(1);
                        // Message `k` is published. An eager one stored its status word before
                        // the counter, so this look settles which kind it is.
                        (polls % 64 == 0 && link.inc.load(Counter::SendPosted) > k)
                            .then(|| link.inc.eager_arrived(k))
                    },
                );
                let Some(Some(sd)) = found else {
                    return Ok(None);
                };
                let mut inbox = lock(&self.shared.inbox);
                if !free(&inbox, k) || link.inc.load(Counter::SendFault) > k {
                    return Ok(None);
                }
                let r = receive_eager(&link.inc, k, &sd, ptr, bytes, peer);
                inbox.next[peer][d] = k + 1;
                if matches!(r, Err(CommError::Protocol(_))) {
                    self.shared.mark_lost(peer);
                }
                r
            }
        };
        match &r {
            Ok(n) => {
                self.shared.path_bytes[Path::Eager as usize]
                    .fetch_add(*n as u64, Ordering::Relaxed);
            }
            Err(e) => self.shared.record_error(e),
        }
        Ok(Some(Request {
            state: State::Done(r),
            seq: 0,
            spin: Duration::ZERO,
        }))
    }
}
