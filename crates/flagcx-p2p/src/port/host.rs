//! The device side of a port channel, for vendors whose device memory is host memory (the
//! host vendor): the same protocol as `include/flagcx/device.cuh`, run by a thread. Tests
//! drive the FIFO through it, and CPU workers can use it as GPU kernels use the header.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{
    pack_trigger, PortRaw, PortStatus, HEAD_OFF, OP_FLUSH, OP_PUT, OP_PUT_VALUE,
    OP_PUT_VALUE_WITH_SIGNAL, OP_PUT_WITH_SIGNAL, OP_SIGNAL, POISON, TABLE_OFF, TRIGGER_BYTES,
};

/// Why a device-side call of a port channel failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PortFailure {
    /// The channel is poisoned; its status says why (see [`super::PortChannel::check`]).
    #[error("port channel failed: {0:?}")]
    Failed(PortStatus),
    /// This rank's flag holds the poison value (the peer's proxy failed, or ours).
    #[error("port channel poisoned")]
    Poisoned,
    /// A field does not fit a trigger (buffer index ≥ 1024 or size ≥ 1 TiB), or a value put's
    /// offset is not a multiple of 8.
    #[error("trigger field out of range")]
    OutOfRange,
    /// Nothing happened within the port's timeout (the ring stayed full, or the awaited
    /// signal or flush did not come). A put or signal that timed out on a full ring holds a
    /// reserved slot it never filled: the channel takes no further triggers (close it).
    #[error("timed out")]
    Timeout,
}

/// A thread's handle on a port channel's device side. Several may drive one channel (slots
/// are reserved atomically); each counts the signals it waited for itself.
#[derive(Debug)]
pub struct HostPort {
    raw: PortRaw,
    expected: u64,
    timeout: Duration,
}

// SAFETY: every access goes through atomics on memory the channel keeps alive (`new`'s
// contract), so the handle may move between threads.
unsafe impl Send for HostPort {}

impl HostPort {
    /// Wraps a channel's raw handle; every blocking call gives up after `timeout`.
    ///
    /// # Safety
    /// `raw` comes from [`super::PortChannel::raw`] of a channel on a host-addressable vendor
    /// (its device addresses are this process's memory), and the channel stays open while this
    /// handle is used.
    pub unsafe fn new(raw: PortRaw, timeout: Duration) -> Self {
        HostPort {
            raw,
            expected: 0,
            timeout,
        }
    }

    fn word(&self, addr: u64) -> &AtomicU64 {
        // SAFETY: `new`'s contract: a live, aligned word of the channel.
        unsafe { &*(addr as *const AtomicU64) }
    }

    fn status(&self) -> Result<(), PortFailure> {
        match self.word(self.raw.status).load(Ordering::Acquire) {
            0 => Ok(()),
            w => Err(PortFailure::Failed(PortStatus::from_word(w))),
        }
    }

    /// Spins until `done` holds, the channel fails, or the timeout passes.
    fn until(
        &self,
        mut done: impl FnMut() -> Result<bool, PortFailure>,
    ) -> Result<(), PortFailure> {
        let start = Instant::now();
        loop {
            if done()? {
                return Ok(());
            }
            self.status()?;
            if start.elapsed() > self.timeout {
                return Err(PortFailure::Timeout);
            }
            flagcx_adaptor::spin::relax();
        }
    }

    /// Reserves a slot, waits for room, writes the trigger, marks it valid; its sequence
    /// number.
    fn push(&self, src_off: u64, dst_off: u64, packed: u64) -> Result<u64, PortFailure> {
        let slot = self.word(self.raw.head).fetch_add(1, Ordering::AcqRel);
        let depth = u64::from(self.raw.depth);
        let tail = self.word(self.raw.tail);
        self.until(|| Ok(slot.wrapping_sub(tail.load(Ordering::Acquire)) < depth))?;
        let at = self.raw.triggers + (slot % depth) * TRIGGER_BYTES as u64;
        self.word(at).store(src_off, Ordering::Relaxed);
        self.word(at + 8).store(dst_off, Ordering::Relaxed);
        self.word(at + 16).store(packed, Ordering::Relaxed);
        self.word(at + 24).store(slot + 1, Ordering::Release);
        Ok(slot + 1)
    }

    fn trigger(
        &self,
        op: u64,
        dst: (usize, u64),
        src: (usize, u64),
        size: u64,
    ) -> Result<u64, PortFailure> {
        let packed = pack_trigger(op, src.0, dst.0, size).ok_or(PortFailure::OutOfRange)?;
        self.push(src.1, dst.1, packed)
    }

    /// The 8 bytes a put of `size` bytes from `src` to `dst` would copy, read now, where the
    /// channel's buffer table says the put can travel as a value put (as `device.cuh` does):
    /// 8 bytes between 8-byte-aligned addresses, inside the source buffer.
    fn inline_value(&self, dst: (usize, u64), src: (usize, u64), size: u64) -> Option<u64> {
        if size != 8 || (src.1 | dst.1) % 8 != 0 {
            return None;
        }
        let table = self.raw.head - HEAD_OFF + TABLE_OFF;
        let at = |i: u64| self.word(table + 8 * i).load(Ordering::Relaxed);
        let (n, m) = (at(0), at(1));
        let (s, d) = (src.0 as u64, dst.0 as u64);
        if s >= n || d >= m {
            return None;
        }
        let (base, len, ok) = (at(2 + 2 * s), at(3 + 2 * s), at(2 + 2 * n + d));
        if ok == 0 || base % 8 != 0 || len < 8 || src.1 > len - 8 {
            return None;
        }
        // SAFETY: an aligned word inside this rank's registered buffer `src.0` (checked against
        // its length above), which the channel keeps alive (`new`'s contract); read as the
        // proxy's copy would read it.
        let word = unsafe { std::ptr::read_volatile((base + src.1) as *const u64) };
        Some(u64::from_le(word))
    }

    /// Asks for `size` bytes from (`src` buffer, offset) of this rank to (`dst` buffer,
    /// offset) of the peer. Returns once the trigger is in the FIFO. Eight bytes between
    /// aligned addresses go as a value put (read now; see [`Self::put_value`]).
    pub fn put(&self, dst: (usize, u64), src: (usize, u64), size: u64) -> Result<(), PortFailure> {
        match self.inline_value(dst, src, size) {
            Some(v) => self.value_trigger(OP_PUT_VALUE, dst, v),
            None => self.trigger(OP_PUT, dst, src, size).map(drop),
        }
    }

    /// Asks for one signal to the peer after everything earlier in the FIFO.
    pub fn signal(&self) -> Result<(), PortFailure> {
        self.trigger(OP_SIGNAL, (0, 0), (0, 0), 0).map(drop)
    }

    /// [`Self::put`], then [`Self::signal`], in one trigger.
    pub fn put_with_signal(
        &self,
        dst: (usize, u64),
        src: (usize, u64),
        size: u64,
    ) -> Result<(), PortFailure> {
        match self.inline_value(dst, src, size) {
            Some(v) => self.value_trigger(OP_PUT_VALUE_WITH_SIGNAL, dst, v),
            None => self.trigger(OP_PUT_WITH_SIGNAL, dst, src, size).map(drop),
        }
    }

    /// Asks for the 8 bytes of `value` (little-endian) to be written at (`dst` buffer, offset)
    /// of the peer; the offset must be a multiple of 8. The value travels in the trigger, so
    /// no source buffer is read: on an IPC pair of a GPU vendor the proxy writes it with one
    /// stream operation instead of a copy.
    pub fn put_value(&self, dst: (usize, u64), value: u64) -> Result<(), PortFailure> {
        self.value_trigger(OP_PUT_VALUE, dst, value)
    }

    /// [`Self::put_value`], then [`Self::signal`], in one trigger.
    pub fn put_value_with_signal(&self, dst: (usize, u64), value: u64) -> Result<(), PortFailure> {
        self.value_trigger(OP_PUT_VALUE_WITH_SIGNAL, dst, value)
    }

    fn value_trigger(&self, op: u64, dst: (usize, u64), value: u64) -> Result<(), PortFailure> {
        if dst.1 % 8 != 0 {
            return Err(PortFailure::OutOfRange);
        }
        let packed = pack_trigger(op, 0, dst.0, 8).ok_or(PortFailure::OutOfRange)?;
        self.push(value, dst.1, packed).map(drop)
    }

    /// Returns once everything earlier in the FIFO completed (puts landed at the peer).
    pub fn flush(&self) -> Result<(), PortFailure> {
        let seq = self.trigger(OP_FLUSH, (0, 0), (0, 0), 0)?;
        let flushed = self.word(self.raw.flushed);
        self.until(|| Ok(flushed.load(Ordering::Acquire) >= seq))
    }

    /// Waits for the peer's next signal (the data it put before it has landed here).
    pub fn wait(&mut self) -> Result<(), PortFailure> {
        let want = self.expected + 1;
        let flag = self.word(self.raw.flag);
        self.until(|| match flag.load(Ordering::Acquire) {
            POISON => Err(PortFailure::Poisoned),
            v => Ok(v >= want),
        })?;
        self.expected = want;
        Ok(())
    }

    /// Signals received so far (the flag's value).
    pub fn signals(&self) -> u64 {
        self.word(self.raw.flag).load(Ordering::Acquire)
    }
}
