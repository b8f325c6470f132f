//! Eager: small messages through the channel's eager slots in shared host memory, one per send
//! descriptor — between host-addressable ranks (the host vendor) and on every staged pair.
//!
//! Outside a group the posting thread copies a send into the peer's slot, or a receive out of
//! it ([`Comm::try_eager`]); a receive with the engine takes an eager message there
//! ([`Engine::take_eager`]). Where this rank's device memory is host addressable the CPU
//! copies; where not, the message goes through a host bounce buffer and the rank's runtime
//! copies between it and the device buffer, synchronously (on the caller's idle stream, or the
//! engine's eager stream): one blocking copy per side instead of the ring's descriptor
//! handshake, proxy hops and stream joins.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, StreamHandle};

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
    /// This rank's device memory is host addressable: the CPU copies (else the runtime, through
    /// a bounce buffer).
    pub(crate) addressable: bool,
}

/// Largest eager message of a pair where neither side's device memory is host addressable
/// (two runtimes copy, each through a bounce buffer). On the H200, two CUDA ranks forced
/// staged took 441–466 µs per 32 KiB round trip eagerly against 63–79 µs through the ring;
/// where one side is the host vendor eager wins to 32 KiB (CUDA↔host 32–34 µs against 38–42
/// µs direct), so there the eager limit alone applies.
pub(crate) const STAGED_EAGER_MAX: usize = 8 << 10;

/// The bounce buffer's size: the largest eager message ([`crate::config::Config::eager_max`]
/// is at most 64 KiB).
const BOUNCE_BYTES: usize = crate::config::MAX_EAGER_MAX;

/// Pinned host memory for the eager messages of a rank whose device memory is not host
/// addressable (its runtime copies to and from pinned memory faster than pageable), made on
/// first use; a fresh vector where the vendor has none.
#[derive(Default)]
pub(crate) enum Bounce {
    #[default]
    Untried,
    Pinned(*mut u8),
    Unavailable,
}

// SAFETY: the pointer is a host allocation owned by this value; every use is under the lock
// (or the engine's `&mut self`) that holds the value.
unsafe impl Send for Bounce {}

impl Bounce {
    /// Runs `f` on `n` bytes of the pinned buffer, or of a fresh vector.
    pub(crate) fn with<A: DeviceAdaptor, R>(
        &mut self,
        adaptor: &A,
        n: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> R {
        if let Bounce::Untried = self {
            *self = adaptor
                .host_alloc(BOUNCE_BYTES)
                .map_or(Bounce::Unavailable, Bounce::Pinned);
        }
        match *self {
            Bounce::Pinned(p) if n <= BOUNCE_BYTES => {
                // SAFETY: `n <= BOUNCE_BYTES` bytes of our live allocation, used by one
                // caller at a time (the holder's exclusive borrow).
                f(unsafe { std::slice::from_raw_parts_mut(p, n) })
            }
            _ => f(&mut vec![0; n]),
        }
    }

    /// Frees the pinned buffer (no copy uses it any more: every use is synchronous).
    pub(crate) fn release<A: DeviceAdaptor>(&mut self, adaptor: &A) {
        if let Bounce::Pinned(p) = std::mem::replace(self, Bounce::Unavailable) {
            // SAFETY: our allocation; every copy that used it was waited for.
            let _ = unsafe { adaptor.host_free(p) };
        }
    }
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
        let (dst, cap) = (step.op.ptr, step.op.bytes);
        let r = if self.adaptor.capabilities().host_addressable {
            receive_eager(&conn.inc, step.index, sd, dst, cap, p)
        } else {
            let stream = match self.eager_stream {
                Some(s) => s,
                None => *self.eager_stream.insert(self.adaptor.stream_create()?),
            };
            let (a, inc, index) = (&self.adaptor, &conn.inc, step.index);
            self.eager_bounce.with(a, (sd.size as usize).min(cap), |b| {
                match receive_eager(inc, index, sd, host_ptr(b), cap, p) {
                    Ok(n) if n > 0 => copy_in(a, dst, &b[..n], stream).map(|()| n),
                    r => r,
                }
            })
        };
        match r {
            Err(e @ CommError::Protocol(_)) => Err(e),
            r => Ok(Progress::Done(r)),
        }
    }
}

/// Copies `data` into device memory at `dst` on `stream` and waits for it.
///
/// The caller guarantees `dst` holds `data.len()` bytes of device memory of `a` that no
/// earlier work on `stream` or elsewhere still uses (a receive's buffer whose stream passed
/// the posting point, or is idle).
fn copy_in<A: DeviceAdaptor>(
    a: &A,
    dst: DevicePtr,
    data: &[u8],
    stream: StreamHandle,
) -> Result<()> {
    // SAFETY: the caller's guarantee for `dst`; `data` outlives the synchronous copy.
    unsafe { a.memcpy_h2d_async(dst, data.as_ptr(), data.len(), stream)? };
    a.stream_synchronize(stream)?;
    Ok(())
}

/// A host buffer's address in the form [`receive_eager`] takes.
fn host_ptr(b: &mut [u8]) -> DevicePtr {
    DevicePtr(b.as_mut_ptr() as u64)
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
        // SAFETY: `dst` is a CPU address of `cap >= sd.size` writable bytes (a message too big
        // is refused above): the caller's buffer in host-addressable device memory, whose
        // earlier stream work has completed, or a bounce buffer of at least `cap` bytes.
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
        stream: StreamHandle,
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
                let taken = |inbox: &Inbox| {
                    let k = inbox.next[peer][d];
                    let window_open = k < link.freed.load(Ordering::Relaxed) + DESC_RING || {
                        let done = link.out.load(Counter::RecvDone);
                        link.freed.store(done, Ordering::Relaxed);
                        k < done + DESC_RING
                    };
                    (free(inbox, k) && window_open && link.out.load(Counter::RecvFault) == 0)
                        .then_some(k)
                };
                // Device memory the CPU cannot read: the runtime copies it to the host first,
                // outside the lock (where the pair is not free now, nothing is copied).
                let publish = |src: *const u8| {
                    let mut inbox = lock(&self.shared.inbox);
                    let k = taken(&inbox)?;
                    // SAFETY: `src` holds `bytes` readable bytes: the bounce buffer, or the
                    // caller's buffer in host-addressable device memory (checked by `post` to
                    // lie in one allocation; its stream is idle, so earlier work on it has
                    // finished writing it); `bytes <= send_max <= ` the slot size; message
                    // `k` is ours under the lock, with every earlier send finished (answered)
                    // and its slot free.
                    unsafe { link.out.post_eager(k, src, bytes) };
                    inbox.next[peer][d] = k + 1;
                    Some(())
                };
                if link.addressable || bytes == 0 {
                    if publish(ptr.0 as *const u8).is_none() {
                        return Ok(None);
                    }
                    Ok(bytes)
                } else {
                    // Device memory the CPU cannot read: the runtime copies it to the host
                    // first, outside the inbox lock (nothing is copied where the pair is not
                    // free now).
                    if taken(&lock(&self.shared.inbox)).is_none() {
                        return Ok(None);
                    }
                    let sent = lock(&self.bounce).with(&self.adaptor, bytes, |b| {
                        // SAFETY: `ptr..ptr+bytes` lies in one allocation of this adaptor
                        // (checked by `post`), and the stream is idle, so earlier work on it
                        // has finished writing it; `b` holds `bytes`; synchronized here.
                        unsafe {
                            self.adaptor
                                .memcpy_d2h_async(b.as_mut_ptr(), ptr, bytes, stream)?
                        };
                        self.adaptor.stream_synchronize(stream)?;
                        Ok::<_, CommError>(publish(b.as_ptr()))
                    })?;
                    if sent.is_none() {
                        return Ok(None);
                    }
                    Ok(bytes)
                }
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
                // Takes message `k` into `dst` (`None`: the pair is not free for this thread).
                let take = |dst: DevicePtr| {
                    let mut inbox = lock(&self.shared.inbox);
                    if !free(&inbox, k) || link.inc.load(Counter::SendFault) > k {
                        return None;
                    }
                    let r = receive_eager(&link.inc, k, &sd, dst, bytes, peer);
                    inbox.next[peer][d] = k + 1;
                    drop(inbox);
                    if matches!(r, Err(CommError::Protocol(_))) {
                        self.shared.mark_lost(peer);
                    }
                    Some(r)
                };
                let taken = if link.addressable {
                    take(ptr)
                } else {
                    // Device memory the CPU cannot write: through the bounce buffer, copied in
                    // by the runtime once the slot is free again and the inbox lock released.
                    let n = (sd.size as usize).min(bytes);
                    lock(&self.bounce).with(&self.adaptor, n, |b| {
                        take(host_ptr(b)).map(|r| match r {
                            // The stream is idle, so nothing earlier still uses the buffer.
                            Ok(n) if n > 0 => {
                                copy_in(&self.adaptor, ptr, &b[..n], stream).map(|()| n)
                            }
                            r => r,
                        })
                    })
                };
                let Some(r) = taken else {
                    return Ok(None);
                };
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
