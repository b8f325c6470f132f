//! The posting side of [`crate::transport::eager`]: what the API thread does for it.

use crate::channel::{Counter, SendDesc};
use crate::comm::{Comm, Request, State};
use crate::error::{CommError, Result};
use crate::link::eager::*;
use crate::link::ipc::poll_peer_for;
use crate::op::{Declined, Dir, Inbox};
use crate::shared::Path;
use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{DeviceAdaptor, DevicePtr, StreamHandle};
use std::sync::atomic::Ordering;
use std::time::Duration;

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
        stream: StreamHandle,
    ) -> Result<Option<Request>> {
        let Some(link) = self.eager.get(peer).and_then(|l| l.as_ref()) else {
            return Ok(None);
        };
        let r = match dir {
            Dir::Send => {
                let r = self.eager_send(link, ptr, bytes, peer, stream);
                if r.is_none() && link.fits(dir, bytes) {
                    self.shared.declined(Declined::PairBusy);
                }
                r
            }
            Dir::Recv => {
                if link.recv_max == 0 {
                    return Ok(None);
                }
                let k = lock(&self.shared.inbox).next[peer][Dir::Recv as usize];
                // Wait without the lock for a message that may well come eagerly: only where
                // any message this receive can take fits the eager slots.
                let spin = if link.fits(Dir::Recv, bytes) {
                    self.config.spin.unwrap_or_default()
                } else {
                    Duration::ZERO
                };
                let mut polls = 0u32;
                let found = poll_peer_for(
                    spin,
                    || link.recv_budget(spin, k),
                    || match link.probe(k, &mut polls) {
                        Arrival::Eager(sd) => Some(Some(sd)),
                        Arrival::Other => Some(None),
                        Arrival::NotYet => None,
                    },
                );
                match found {
                    Some((Some(sd), waited)) => {
                        link.note_wait(waited);
                        let r = self.eager_take(link, k, &sd, ptr, bytes, peer, stream);
                        if r.is_none() {
                            self.shared.declined(Declined::PairBusy);
                        }
                        r
                    }
                    Some((None, _)) => {
                        self.shared.declined(Declined::OtherPath);
                        None
                    }
                    None => {
                        if !spin.is_zero() {
                            self.shared.declined(Declined::WaitedOut);
                        }
                        None
                    }
                }
            }
        };
        Ok(r.map(|r| self.eager_request(r)))
    }

    /// A request already finished by this thread's eager move, counted in the path statistics
    /// (or the communicator's errors).
    pub(crate) fn eager_request(&self, r: Result<usize>) -> Request {
        self.eager_counted(&r);
        Request {
            state: State::Done(r),
            seq: 0,
            spin: Duration::ZERO,
        }
    }

    /// Counts a finished eager move: its bytes on the eager path, or its failure.
    pub(crate) fn eager_counted(&self, r: &Result<usize>) {
        match r {
            Ok(n) => {
                self.shared.path_bytes[Path::Eager as usize]
                    .fetch_add(*n as u64, Ordering::Relaxed);
            }
            Err(e) => self.shared.record_error(e),
        }
    }

    /// Whether message `index` of `peer` and `dir` is free for the posting thread: nothing of
    /// the pair and direction with the proxy, the pair not lost, and `index` the next number.
    fn eager_free(&self, inbox: &Inbox, peer: usize, dir: Dir, index: u64) -> bool {
        let d = dir as usize;
        inbox.next[peer][d] == index
            && self.shared.pending[peer][d].load(Ordering::Acquire) == 0
            && !self.shared.lost[peer].load(Ordering::Acquire)
    }

    /// Sends `bytes` at `ptr` into the peer's next eager slot (the caller checked that the
    /// stream is idle). `None`: not taken (too big, the pair not free, the window full).
    pub(crate) fn eager_send(
        &self,
        link: &EagerLink,
        ptr: DevicePtr,
        bytes: usize,
        peer: usize,
        stream: StreamHandle,
    ) -> Option<Result<usize>> {
        if link.send_max == 0 || bytes > link.send_max {
            return None;
        }
        let taken = |inbox: &Inbox| {
            let k = inbox.next[peer][Dir::Send as usize];
            (self.eager_free(inbox, peer, Dir::Send, k)
                && link.window_open(k)
                && link.out.load(Counter::RecvFault) == 0)
                .then_some(k)
        };
        let publish = |src: *const u8| {
            let mut inbox = lock(&self.shared.inbox);
            let k = taken(&inbox)?;
            // SAFETY: `src` holds `bytes` readable bytes: the bounce buffer, or the caller's
            // buffer in host-addressable device memory (checked by `post` to lie in one
            // allocation; its stream is idle, so earlier work on it has finished writing it);
            // `bytes <= send_max <= ` the slot size; message `k` is ours under the lock, with
            // every earlier send finished (answered) and its slot free.
            unsafe { link.out.post_eager(k, src, bytes) };
            inbox.next[peer][Dir::Send as usize] = k + 1;
            Some(())
        };
        if link.addressable || bytes == 0 {
            return publish(ptr.0 as *const u8).map(|()| Ok(bytes));
        }
        // Device memory the CPU cannot read: the runtime copies it to the host first, outside
        // the inbox lock (nothing is copied where the pair is not free now). The peer's
        // receive keeps waiting while the copy runs (`EagerLink::recv_budget`).
        let k = taken(&lock(&self.shared.inbox))?;
        link.out.store(Counter::Issued, k + 1);
        let sent = lock(&self.bounce).with(&self.adaptor, bytes, |b| {
            // SAFETY: `ptr..ptr+bytes` lies in one allocation of this adaptor (checked by
            // `post`), and the stream is idle, so earlier work on it has finished writing it;
            // `b` holds `bytes`; synchronized here.
            unsafe {
                self.adaptor
                    .memcpy_d2h_async(b.as_mut_ptr(), ptr, bytes, stream)?
            };
            self.adaptor.stream_synchronize(stream)?;
            Ok::<_, CommError>(publish(b.as_ptr()))
        });
        match sent {
            Ok(Some(())) => Some(Ok(bytes)),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// Takes eager message `k` of `peer` (described by `sd`) into `ptr` (`bytes`; the caller
    /// checked that the stream is idle). `None`: the pair is not free for this thread.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn eager_take(
        &self,
        link: &EagerLink,
        k: u64,
        sd: &SendDesc,
        ptr: DevicePtr,
        bytes: usize,
        peer: usize,
        stream: StreamHandle,
    ) -> Option<Result<usize>> {
        let take = |dst: DevicePtr| {
            let mut inbox = lock(&self.shared.inbox);
            if !self.eager_free(&inbox, peer, Dir::Recv, k) || link.inc.load(Counter::SendFault) > k
            {
                return None;
            }
            let r = receive_eager(&link.inc, k, sd, dst, bytes, peer);
            inbox.next[peer][Dir::Recv as usize] = k + 1;
            drop(inbox);
            if matches!(r, Err(CommError::Protocol(_))) {
                self.shared.mark_lost(peer);
            }
            Some(r)
        };
        if link.addressable {
            return take(ptr);
        }
        // Device memory the CPU cannot write: through the bounce buffer, copied in by the
        // runtime once the slot is free again and the inbox lock released.
        let n = (sd.size as usize).min(bytes);
        lock(&self.bounce).with(&self.adaptor, n, |b| {
            take(host_ptr(b)).map(|r| match r {
                // The stream is idle, so nothing earlier still uses the buffer.
                Ok(n) if n > 0 => {
                    copy_in(&self.adaptor, ptr, &b[..n], stream, link.shares_device).map(|()| n)
                }
                r => r,
            })
        })
    }
}
