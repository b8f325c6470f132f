//! The eager path's per-pair state and its pieces that name neither the engine nor `Comm`: the
//! eager link, the bounce buffer, value writes and the receive budget. Its posting side
//! (`Comm::try_eager`) and progress side (`Engine::take_eager`) are [`crate::transport::eager`]'s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flagcx_adaptor::{Capabilities, DeviceAdaptor, DevicePtr, StreamHandle};

use super::ipc::RUNNING_COPY_WAIT;
use crate::channel::{Channel, Counter, SendDesc, DESC_RING};
use crate::error::{CommError, Result};
use crate::op::{Declined, Dir};
pub(crate) use group::{GroupScratch, Move};

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
    /// Both ranks use one physical device: small messages are written in with stream value
    /// writes ([`copy_in`]).
    pub(crate) shares_device: bool,
    /// How long this rank's eager receives of the pair recently waited for their message
    /// (nanoseconds, a moving average of the ones that came): see [`EagerLink::recv_budget`].
    pub(crate) waited_ns: AtomicU64,
}

/// The longest a receive waits for an eager message because the pair's recent ones took long
/// to come ([`EagerLink::recv_budget`]).
pub(crate) const ACTIVE_PEER_WAIT: Duration = Duration::from_millis(1);

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
/// addressable (its runtime copies to and from pinned memory faster than pageable); a fresh
/// vector where the vendor has none.
///
/// Made at setup ([`Bounce::made`]), never on a message's path: pinning memory is a slow
/// runtime call (page-locking and mapping it for the device) that the first small message
/// would otherwise pay for.
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
    /// The pinned buffer, allocated now (`Unavailable` where the vendor has no pinned
    /// memory: messages then go through a fresh vector).
    pub(crate) fn made<A: DeviceAdaptor>(adaptor: &A) -> Self {
        adaptor
            .host_alloc(BOUNCE_BYTES)
            .map_or(Bounce::Unavailable, Bounce::Pinned)
    }

    /// [`Bounce::made`] where `wanted`, else untried.
    pub(crate) fn made_if<A: DeviceAdaptor>(wanted: bool, adaptor: &A) -> Self {
        match wanted {
            true => Self::made(adaptor),
            false => Self::default(),
        }
    }

    /// Runs `f` on `n` bytes of the pinned buffer, or of a fresh vector; a buffer that was
    /// never made ([`Bounce::Untried`]: setup found no pair to bounce for) is made first.
    pub(crate) fn with<A: DeviceAdaptor, R>(
        &mut self,
        adaptor: &A,
        n: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> R {
        if let Bounce::Untried = self {
            *self = Bounce::made(adaptor);
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

/// Largest message [`copy_in`] writes with stream value writes.
pub(crate) const VALUE_WRITES_MAX: usize = 512;

/// Copies `data` into device memory at `dst` on `stream` and waits for it.
///
/// Where the peer uses the same physical device (`shared`), a message of up to
/// [`VALUE_WRITES_MAX`] bytes in whole aligned words goes in as the stream's own value writes
/// instead. Measured on one H200 (`benches/probes/ctx_small_copy.c`, no flagcx code): two
/// processes taking turns at host→device copies of up to 16 KiB (and device→device copies of
/// any size up to 64 KiB) took 287–293 µs per round trip — the runtime runs such copies on the
/// engine the two contexts time-slice — against 18 µs for device→host copies and 13.5–14.7 µs
/// for 8 B as a value write; 512 B as 64 value writes in one batch took 98–101 µs there, so
/// up to 512 B value writes win by 3×. With the device to itself, an 8 B value write and an
/// 8 B copy both take 6–7 µs, but each further word adds ~0.7 µs (every write fences the
/// earlier ones), so value writes are used only where the device is shared.
///
/// The caller guarantees `dst` holds `data.len()` bytes of device memory of `a` that no
/// earlier work on `stream` or elsewhere still uses (a receive's buffer whose stream passed
/// the posting point, or is idle).
pub(crate) fn copy_in<A: DeviceAdaptor>(
    a: &A,
    dst: DevicePtr,
    data: &[u8],
    stream: StreamHandle,
    shared: bool,
) -> Result<()> {
    match value_words(a.capabilities(), dst, data.len(), shared) {
        // SAFETY: the caller's guarantee for `dst`; `value_words` checked the words' size and
        // alignment.
        Some(word) => unsafe { write_words(a, dst, data, word, stream)? },
        // SAFETY: the caller's guarantee for `dst`; `data` outlives the synchronous copy.
        None => unsafe { a.memcpy_h2d_async(dst, data.as_ptr(), data.len(), stream)? },
    }
    a.stream_synchronize(stream)?;
    Ok(())
}

/// Enqueues `data` as stream value writes of `word` (8 or 4) bytes each at `dst`.
///
/// # Safety
/// `dst` holds `data.len()` bytes of `a`'s device memory, is `word`-aligned, and `data.len()`
/// is a multiple of `word`.
unsafe fn write_words<A: DeviceAdaptor>(
    a: &A,
    dst: DevicePtr,
    data: &[u8],
    word: usize,
    stream: StreamHandle,
) -> Result<()> {
    let at = |i: usize| DevicePtr(dst.0 + (i * word) as u64);
    if word == 8 {
        // One batch (one driver call where the vendor batches).
        let writes: Vec<(DevicePtr, u64)> = data
            .chunks_exact(8)
            .enumerate()
            .map(|(i, w)| {
                let mut b = [0u8; 8];
                b.copy_from_slice(w);
                (at(i), u64::from_ne_bytes(b))
            })
            .collect();
        // SAFETY: aligned words inside the caller's `dst` range.
        unsafe { a.stream_write_values64(stream, &writes)? };
        return Ok(());
    }
    for (i, w) in data.chunks_exact(4).enumerate() {
        let mut b = [0u8; 4];
        b.copy_from_slice(w);
        // SAFETY: an aligned word inside the caller's `dst` range.
        unsafe { a.stream_write_value32(stream, at(i), u32::from_ne_bytes(b))? };
    }
    Ok(())
}

/// The word size (8 or 4 bytes) in which [`copy_in`] writes `len` bytes at `dst` as stream
/// value writes, or `None` to copy them: only on a shared device, for 1 to
/// [`VALUE_WRITES_MAX`] bytes in whole 8-byte words aligned at `dst` (or up to 64 bytes in
/// 4-byte words), with the vendor's value writes.
fn value_words(caps: Capabilities, dst: DevicePtr, len: usize, shared: bool) -> Option<usize> {
    if !shared || len == 0 || len > VALUE_WRITES_MAX || caps.host_addressable {
        return None;
    }
    if caps.stream_mem_ops_64 && dst.0 % 8 == 0 && len % 8 == 0 {
        Some(8)
    } else if caps.stream_mem_ops && dst.0 % 4 == 0 && len % 4 == 0 && len <= 64 {
        // One call per 4-byte word (no batch for them): ~2 µs each, so only a few.
        Some(4)
    } else {
        None
    }
}

/// A host buffer's address in the form [`receive_eager`] takes.
pub(crate) fn host_ptr(b: &mut [u8]) -> DevicePtr {
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

/// What one look at a receive's next eager slot found.
pub(crate) enum Arrival {
    /// An eager message, described.
    Eager(SendDesc),
    /// A message of the proxy's protocol: the receive is the proxy's.
    Other,
    /// Nothing yet.
    NotYet,
}

impl crate::shared::Shared {
    /// Counts a small message of an eager pair that goes to the proxy, and why.
    pub(crate) fn declined(&self, why: Declined) {
        self.eager_declined[why as usize].fetch_add(1, Ordering::Relaxed);
    }
}

impl EagerLink {
    /// Whether send `k` of this pair has a slot in its window of [`DESC_RING`] messages: by
    /// the peer's `RecvDone` as last read ([`EagerLink::freed`]), read again only where that
    /// says no. Under the inbox lock.
    pub(crate) fn window_open(&self, k: u64) -> bool {
        k < self.freed.load(Ordering::Relaxed) + DESC_RING || {
            let done = self.out.load(Counter::RecvDone);
            self.freed.store(done, Ordering::Relaxed);
            k < done + DESC_RING
        }
    }

    /// Whether a message of `bytes` in direction `dir` fits this pair's eager slots.
    pub(crate) fn fits(&self, dir: Dir, bytes: usize) -> bool {
        match dir {
            Dir::Send => bytes <= self.send_max,
            Dir::Recv => bytes <= self.recv_max,
        }
    }

    /// How long a receive of message `k` waits for it to come eagerly before the proxy takes
    /// it: the spin time, or three times what the pair's recent eager receives waited where
    /// that is longer (up to [`ACTIVE_PEER_WAIT`]: a peer that answers in lockstep, slowly,
    /// is worth waiting for, where a miss would leave every later message of an enqueued
    /// stream in the proxy), and [`RUNNING_COPY_WAIT`] more while the peer's posting thread
    /// copies message `k` out of its device ([`Counter::Issued`]). No wait where the spin
    /// time is zero.
    pub(crate) fn recv_budget(&self, spin: Duration, k: u64) -> Duration {
        if spin.is_zero() {
            return spin;
        }
        let recent = Duration::from_nanos(self.waited_ns.load(Ordering::Relaxed).saturating_mul(3));
        let wait = spin.max(recent.min(ACTIVE_PEER_WAIT));
        if self.inc.load(Counter::Issued) > k {
            wait + RUNNING_COPY_WAIT
        } else {
            wait
        }
    }

    /// Records that an eager receive waited `waited` for its message (a moving average of
    /// eight).
    pub(crate) fn note_wait(&self, waited: Duration) {
        let w = waited.as_nanos().min(u64::MAX as u128) as u64;
        let old = self.waited_ns.load(Ordering::Relaxed);
        self.waited_ns
            .store(old - old / 8 + w / 8, Ordering::Relaxed);
    }

    /// One look at the peer's message `k`: its status word (an eager message publishes it
    /// last: one cache line to fetch), and every 64th look (`polls` counts them) the counters
    /// that show a message of the proxy's protocol: published, or handed to the peer's proxy
    /// ([`Counter::Handshake`]: a pushing sender's proxy publishes nothing before the
    /// receiver's announcement, so a receive left waiting eagerly would wait out its budget).
    pub(crate) fn probe(&self, k: u64, polls: &mut u32) -> Arrival {
        if let Some(sd) = self.inc.eager_arrived(k) {
            return Arrival::Eager(sd);
        }
        *polls = polls.wrapping_add(1);
        // Message `k` is published. An eager one stored its status word before the counter,
        // so this look settles which kind it is.
        if *polls % 64 == 0
            && (self.inc.load(Counter::SendPosted) > k || self.inc.load(Counter::Handshake) > k)
        {
            return match self.inc.eager_arrived(k) {
                Some(sd) => Arrival::Eager(sd),
                None => Arrival::Other,
            };
        }
        Arrival::NotYet
    }
}

#[cfg(test)]
mod tests;

pub(crate) mod group;
