//! Port channels of staged pairs: puts through a *lane* of shared host memory.
//!
//! Where the two ranks cannot map each other's buffers (different vendors, or
//! `FLAGCX_P2P_DISABLE`), a put cannot be one copy into the peer. Each rank then creates one
//! lane for the triggers of its FIFO: a ring of [`SLOTS`] data slots (of [`SLOT_ENV`] bytes
//! each, [`DEFAULT_SLOT_BYTES`] by default; the sender's choice, announced in its hello), a
//! descriptor per slot and two control words, in a memfd segment both ranks map and register
//! with their runtimes. Both proxies only *enqueue*; their streams do the hand-over:
//!
//! - **the sender's proxy**, for each chunk of a put (and once for a signal): waits for a free
//!   slot (`credit` ≥ chunk − [`SLOTS`] + 1), writes the descriptor's fields, enqueues a
//!   device→host copy of the chunk into the slot and a stream write of the descriptor's `seq`
//!   behind it, so the descriptor becomes valid when the data is there;
//! - **the receiver's proxy** polls the next descriptor's `seq`; for a valid one it enqueues a
//!   host→device copy into its registered buffer, a stream write of its own flag (the count of
//!   signals received) if the descriptor carries a signal, and a stream write of `credit`.
//!
//! Lane layout (bytes from the segment's start; every word 64-bit little-endian):
//!
//! | offset | word | written by | read by |
//! |---|---|---|---|
//! | 0 | `credit`: descriptors the receiver finished (their slots are free) | receiver's stream | sender's proxy |
//! | 64 | `poison`: 0, or the sender's [`super::PortStatus`] once its channel failed | sender's proxy | receiver's proxy |
//! | 4096 + 32·i | descriptor `i`: `dst_offset`, `len \| dst_buffer << 40 \| signal << 63`, 0, `seq` (chunk number + 1, written last) | sender | receiver |
//! | 8192 + i·slot | slot `i`'s data | sender's stream | receiver's stream |
//!
//! A flush on a staged pair completes when everything earlier left this rank's buffers (their
//! device→host copies are done): the source may be reused. A signal still means "the data of
//! every earlier put is in the peer's buffer": the peer's stream writes the flag after its
//! copies.

use std::sync::atomic::{AtomicU64, Ordering};

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, StreamHandle};
use std::os::fd::OwnedFd;

use crate::error::{CommError, Result};
use crate::shm::ShmSegment;

/// Data slots per lane.
pub const SLOTS: usize = 8;
/// Bytes per data slot (the largest chunk of a staged put) unless [`SLOT_ENV`] says otherwise.
pub const DEFAULT_SLOT_BYTES: usize = 1 << 20;
/// The variable that sets this rank's slot size: a size (`2M`, `512K`, bytes), a multiple of
/// 64 from 4 KiB to 64 MiB.
pub const SLOT_ENV: &str = "FLAGCX_PORT_LANE_SLOT";
const MIN_SLOT: usize = 4 << 10;
const MAX_SLOT: usize = 64 << 20;
const CREDIT_OFF: usize = 0;
const POISON_OFF: usize = 64;
const DESC_OFF: usize = 4096;
const DESC_BYTES: usize = 32;
const DATA_OFF: usize = 8192;
const SIGNAL_BIT: u64 = 1 << 63;
const LEN_MASK: u64 = (1 << 40) - 1;

const _: () = assert!(DESC_OFF + SLOTS * DESC_BYTES <= DATA_OFF);
const _: () = assert!(MAX_SLOT as u64 <= LEN_MASK);

/// Bytes of a lane's segment with slots of `slot` bytes.
pub fn lane_bytes(slot: usize) -> usize {
    DATA_OFF + SLOTS * slot
}

/// Checks a slot size (this rank's setting, or the size a peer announced).
pub(crate) fn check_slot(slot: usize) -> Result<usize> {
    if (MIN_SLOT..=MAX_SLOT).contains(&slot) && slot % 64 == 0 {
        Ok(slot)
    } else {
        Err(CommError::config(
            SLOT_ENV,
            &slot.to_string(),
            "must be a multiple of 64 from 4 KiB to 64 MiB",
        ))
    }
}

/// This rank's slot size: [`SLOT_ENV`], else [`DEFAULT_SLOT_BYTES`].
pub(crate) fn slot_from_env() -> Result<usize> {
    match std::env::var(SLOT_ENV) {
        Ok(v) if !v.trim().is_empty() => check_slot(crate::config::parse_size(SLOT_ENV, &v)?),
        _ => Ok(DEFAULT_SLOT_BYTES),
    }
}

/// One lane, mapped and registered here.
pub(crate) struct Lane {
    seg: ShmSegment,
    /// The device-visible address of the segment's first byte.
    device: DevicePtr,
    /// Bytes per slot.
    slot: usize,
}

/// A chunk as a descriptor describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Desc {
    pub dst_buffer: usize,
    pub dst_offset: u64,
    pub len: usize,
    pub signal: bool,
}

impl Lane {
    /// Creates this rank's lane with slots of `slot` bytes and registers it.
    pub fn create<A: DeviceAdaptor>(a: &A, peer: usize, slot: usize) -> Result<Lane> {
        let seg = ShmSegment::create(&format!("flagcx-port-lane-{peer}"), lane_bytes(slot))?;
        Self::register(a, seg, slot)
    }

    /// Maps and registers the peer's lane, received as a descriptor, with the slot size the
    /// peer announced (checked).
    pub fn open<A: DeviceAdaptor>(a: &A, fd: OwnedFd, slot: usize) -> Result<Lane> {
        let slot = check_slot(slot)?;
        Self::register(a, ShmSegment::open(fd, lane_bytes(slot))?, slot)
    }

    fn register<A: DeviceAdaptor>(a: &A, seg: ShmSegment, slot: usize) -> Result<Lane> {
        // SAFETY: the mapping lives in the returned lane, which unregisters it in `release`
        // before the segment is dropped.
        let device = unsafe { a.host_register(seg.as_ptr(), seg.len())? };
        Ok(Lane { seg, device, slot })
    }

    /// Bytes per slot: the largest chunk.
    pub fn slot_bytes(&self) -> usize {
        self.slot
    }

    /// The segment, to send its descriptor to the peer.
    pub fn segment(&self) -> &ShmSegment {
        &self.seg
    }

    fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= DATA_OFF);
        // SAFETY: an aligned word inside the mapping (offsets come from the layout above),
        // which lives as long as `self`; every access to the control words and descriptors
        // is atomic.
        unsafe { &*(self.seg.as_ptr().add(off) as *const AtomicU64) }
    }

    fn desc_off(k: u64) -> usize {
        DESC_OFF + (k % SLOTS as u64) as usize * DESC_BYTES
    }

    /// The host address of the slot of chunk `k`.
    pub fn slot(&self, k: u64) -> *mut u8 {
        // SAFETY: in bounds: DATA_OFF + (k % SLOTS) * slot + slot <= lane_bytes(slot).
        unsafe {
            self.seg
                .as_ptr()
                .add(DATA_OFF + (k % SLOTS as u64) as usize * self.slot)
        }
    }

    /// Descriptors the receiver finished.
    pub fn credit(&self) -> u64 {
        self.word(CREDIT_OFF).load(Ordering::Acquire)
    }

    /// The sender's failure code (0 while healthy).
    pub fn poisoned(&self) -> u64 {
        self.word(POISON_OFF).load(Ordering::Acquire)
    }

    /// Tells the receiver this side failed with `code` (nonzero).
    pub fn poison(&self, code: u64) {
        self.word(POISON_OFF).store(code, Ordering::Release);
    }

    /// Sender: writes chunk `k`'s descriptor fields, then enqueues on `stream` the copy of its
    /// data into the slot and the write of its `seq` that makes it valid. The slot must be free
    /// (`k - credit() < SLOTS`).
    ///
    /// # Safety
    /// `src..src+len` is device memory of `a` that stays valid until the copy completes on
    /// `stream`; `len ≤` [`Self::slot_bytes`].
    pub unsafe fn publish<A: DeviceAdaptor>(
        &self,
        a: &A,
        stream: StreamHandle,
        k: u64,
        src: DevicePtr,
        d: Desc,
    ) -> Result<()> {
        debug_assert!(d.len <= self.slot && k.saturating_sub(self.credit()) < SLOTS as u64);
        self.describe(k, d);
        if d.len > 0 {
            // SAFETY: the slot is free (caller) and `len` fits it; the source is the
            // caller's.
            unsafe { a.memcpy_d2h_async(self.slot(k), src, d.len, stream)? };
        }
        self.mark(a, stream, k)
    }

    /// Sender: as [`Self::publish`] for a value put: the value's 8 bytes are stored into the
    /// free slot from here (nothing in flight touches a slot the receiver credited), so the
    /// stream only writes the `seq` that makes the chunk valid, in order behind earlier chunks.
    pub fn publish_value<A: DeviceAdaptor>(
        &self,
        a: &A,
        stream: StreamHandle,
        k: u64,
        value: u64,
        d: Desc,
    ) -> Result<()> {
        debug_assert!(d.len == 8 && k.saturating_sub(self.credit()) < SLOTS as u64);
        let slot = self.slot(k);
        // SAFETY: slots start at 8192 + i·slot with slot a multiple of 64, so the word is
        // aligned and inside the mapped segment; the slot is free (the caller checked credit).
        unsafe { (*(slot as *const AtomicU64)).store(value.to_le(), Ordering::Relaxed) };
        self.describe(k, d);
        // The receiver's copy engine reads the slot once it sees the `seq` our stream writes
        // after this call: the value must be out of this CPU's store buffer before the runtime
        // is told to write it (a full fence, not only the runtime's own doorbell ordering).
        std::sync::atomic::fence(Ordering::SeqCst);
        self.mark(a, stream, k)
    }

    /// Writes chunk `k`'s descriptor fields (not yet valid).
    fn describe(&self, k: u64, d: Desc) {
        let off = Self::desc_off(k);
        let mut w1 = d.len as u64 | (d.dst_buffer as u64) << 40;
        if d.signal {
            w1 |= SIGNAL_BIT;
        }
        self.word(off).store(d.dst_offset, Ordering::Relaxed);
        self.word(off + 8).store(w1, Ordering::Release);
    }

    /// Enqueues the write of chunk `k`'s `seq`, which makes its descriptor valid.
    fn mark<A: DeviceAdaptor>(&self, a: &A, stream: StreamHandle, k: u64) -> Result<()> {
        let off = Self::desc_off(k);
        // SAFETY: an aligned word of the registered segment, which stays registered until the
        // channel's streams are synchronized at close.
        unsafe {
            a.stream_write_value64(stream, DevicePtr(self.device.0 + off as u64 + 24), k + 1)?
        };
        Ok(())
    }

    /// Receiver: chunk `k`'s descriptor once the sender's stream made it valid.
    pub fn ready(&self, k: u64) -> Option<std::result::Result<Desc, CommError>> {
        let off = Self::desc_off(k);
        if self.word(off + 24).load(Ordering::Acquire) != k + 1 {
            return None;
        }
        let dst_offset = self.word(off).load(Ordering::Relaxed);
        let w1 = self.word(off + 8).load(Ordering::Relaxed);
        let len = (w1 & LEN_MASK) as usize;
        if len > self.slot {
            return Some(Err(CommError::Protocol(format!(
                "port lane chunk {k}: {len} bytes in a {}-byte slot",
                self.slot
            ))));
        }
        Some(Ok(Desc {
            dst_buffer: ((w1 >> 40) & 0x3ff) as usize,
            dst_offset,
            len,
            signal: w1 & SIGNAL_BIT != 0,
        }))
    }

    /// Receiver: enqueues on `stream` the copy of chunk `k` into `dst`, then the write of
    /// `credit` that frees its slot.
    ///
    /// # Safety
    /// `dst..dst+len` is device memory of `a` that stays valid until the copy completes; the
    /// chunk is valid (`ready(k)`).
    pub unsafe fn consume<A: DeviceAdaptor>(
        &self,
        a: &A,
        stream: StreamHandle,
        k: u64,
        dst: DevicePtr,
        len: usize,
        flag: Option<(DevicePtr, u64)>,
    ) -> Result<()> {
        if len > 0 {
            // SAFETY: the slot holds the chunk until we credit it, below, after the copy.
            unsafe { a.memcpy_h2d_async(dst, self.slot(k), len, stream)? };
        }
        if let Some((addr, value)) = flag {
            // SAFETY: the caller's flag word (device memory of `a`, aligned, live).
            unsafe { a.stream_write_value64(stream, addr, value)? };
        }
        // SAFETY: as in `publish`.
        unsafe {
            a.stream_write_value64(stream, DevicePtr(self.device.0 + CREDIT_OFF as u64), k + 1)
        }?;
        Ok(())
    }

    /// Unregisters the lane; it is unmapped when dropped.
    ///
    /// # Safety
    /// No enqueued operation of `a` still uses the lane.
    pub unsafe fn release<A: DeviceAdaptor>(&self, a: &A) {
        // SAFETY: the caller's contract.
        let _ = unsafe { a.host_unregister(self.seg.as_ptr()) };
    }
}

/// The staged side of a channel: the two lanes and the stream of inbound copies.
pub(crate) struct StagedLink {
    /// Ours: the triggers of our FIFO go out through it.
    pub out: Lane,
    /// The peer's: its puts come in through it.
    pub inb: Lane,
    /// Inbound copies, flag and credit writes (beside the FIFO's outbound stream).
    pub stream: StreamHandle,
    /// Chunks published on `out` (the proxy's count; the peer waits for them at close).
    pub published: AtomicU64,
}

/// A put (or signal) of a staged channel whose chunks are not all published yet.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pending {
    pub src: DevicePtr,
    /// A value put's value: published from here instead of copied from `src`.
    pub value: Option<u64>,
    pub dst_buffer: usize,
    pub dst_offset: u64,
    pub left: u64,
    pub signal: bool,
}

impl Pending {
    /// The next chunk in slots of `slot` bytes: its source, its descriptor, and whether it is
    /// the last.
    pub fn next(&self, slot: usize) -> (DevicePtr, Desc, bool) {
        let len = self.left.min(slot as u64);
        let last = len == self.left;
        (
            self.src,
            Desc {
                dst_buffer: self.dst_buffer,
                dst_offset: self.dst_offset,
                len: len as usize,
                signal: self.signal && last,
            },
            last,
        )
    }

    /// Moves past a published chunk of `len` bytes.
    pub fn advance(&mut self, len: usize) {
        self.src = DevicePtr(self.src.0 + len as u64);
        self.dst_offset += len as u64;
        self.left -= len as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_put_splits_into_slot_sized_chunks_and_signals_with_the_last() {
        let mut p = Pending {
            src: DevicePtr(1000),
            value: None,
            dst_buffer: 3,
            dst_offset: 10,
            left: 2 * DEFAULT_SLOT_BYTES as u64 + 5,
            signal: true,
        };
        let mut seen = Vec::new();
        loop {
            let (src, d, last) = p.next(DEFAULT_SLOT_BYTES);
            seen.push((src.0, d));
            p.advance(d.len);
            if last {
                break;
            }
        }
        let s = DEFAULT_SLOT_BYTES as u64;
        assert_eq!(seen.len(), 3);
        assert_eq!(
            (seen[0].0, seen[0].1.len, seen[0].1.signal),
            (1000, DEFAULT_SLOT_BYTES, false)
        );
        assert_eq!((seen[1].0, seen[1].1.dst_offset), (1000 + s, 10 + s));
        assert_eq!(
            (seen[2].1.len, seen[2].1.signal, seen[2].1.dst_offset),
            (5, true, 10 + 2 * s)
        );
        assert_eq!(p.left, 0);
        // A signal alone is one empty chunk carrying the signal.
        let p = Pending { left: 0, ..p };
        let (_, d, last) = p.next(DEFAULT_SLOT_BYTES);
        assert!(last && d.signal && d.len == 0);
    }

    #[test]
    fn slot_sizes_are_checked() {
        assert_eq!(check_slot(1 << 20).unwrap(), 1 << 20);
        assert_eq!(check_slot(4 << 10).unwrap(), 4 << 10);
        for bad in [0, 100, 2048, (64 << 20) + 64, 1 << 30] {
            assert!(check_slot(bad).is_err(), "{bad}");
        }
        assert_eq!(lane_bytes(1 << 20), 8192 + 8 * (1 << 20));
    }
}
