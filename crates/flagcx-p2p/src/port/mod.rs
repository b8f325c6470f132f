//! Device-initiated transfers: port channels.
//!
//! A kernel that has just computed a tile should not have to end, return to the host and be
//! followed by a `send`. A *port channel* lets device code (or any thread of a host-addressable
//! vendor) ask for transfers itself: it writes *triggers* into a FIFO that a proxy thread of
//! this rank polls; the proxy executes each trigger on the pair's transport and tells the
//! device what landed through flag words.
//!
//! One channel is one pair of ranks, created by both together
//! ([`Comm::port_channel`](crate::comm::Comm::port_channel)), each naming buffers it registered
//! ([`Comm::register`](crate::comm::Comm::register)); each rank's FIFO carries its triggers to
//! the peer. A trigger names a source buffer of this rank and a destination buffer of the peer
//! by their index in the lists the two ranks passed. Operations:
//!
//! | op | value | what the proxy does |
//! |---|---|---|
//! | `put` | 1 | copies `size` bytes from (src buffer, src offset) here to (dst buffer, dst offset) at the peer |
//! | `signal` | 2 | after everything earlier in this FIFO, adds one to the peer's flag word |
//! | `put_with_signal` | 3 | both, in that order |
//! | `flush` | 4 | after everything earlier in this FIFO completed, writes the trigger's sequence number into `flushed` |
//! | `put_value` | 5 | writes the trigger's 64-bit value (in place of the source offset) to (dst buffer, dst offset) at the peer; the address must be 8-byte aligned |
//! | `put_value_with_signal` | 6 | both, in that order |
//!
//! How a put travels depends on the pair ([`PortChannel::is_staged`]):
//!
//! - **IPC pairs** (same vendor, IPC handles): the peer's buffers and flag are mapped here; a
//!   put is one device-to-device copy on the proxy's stream, a signal a stream write into the
//!   peer's flag. A value put is a stream write of the value, batched with its signal's
//!   ([`DeviceAdaptor::stream_write_values64`]): on an H200 the proxy issues that in 2.7 µs,
//!   where a copy and a write take 8.5 µs (`benches/probes/port_floor.c`).
//! - **Staged pairs** on one node (different vendors, or `FLAGCX_P2P_DISABLE`): through a
//!   [`lane`] of shared host memory per direction: this rank's stream copies each chunk out
//!   and marks it valid; the peer's proxy has its stream copy it in, count the signal in its
//!   own flag and free the slot. A flush then means "the sources may be reused"; a signal
//!   still follows the data into the peer's buffer.
//! - Pairs on different hosts: `Unsupported`.
//!
//! # Memory layout
//!
//! The *control block* is host memory registered with the vendor (device-visible); the
//! *device words* are device memory (on an IPC pair the flag is mapped by the peer):
//!
//! | where | offset | word | written by | read by |
//! |---|---|---|---|---|
//! | control | 0 | `tail`: triggers the proxy took (a slot below it may be reused) | proxy | device |
//! | control | 64 | `flushed`: sequence number of the last completed flush | proxy's stream | device |
//! | control | 128 | `status`: 0 while healthy, else a [`PortStatus`] code | proxy | device |
//! | control | 4096 + 32·i | trigger slot `i` of `depth` (below) | device | proxy |
//! | device | 0 | `flag`: signals received from the peer, [`POISON`] on failure | peer's proxy stream (IPC), this proxy's inbound stream (staged) | device |
//! | device | 128 | `head`: slots reserved (device atomics) | device | device |
//! | device | 256 | the buffer table ([`buffer_table`]) | this rank, at creation | device |
//!
//! A trigger is four little-endian 64-bit words: `src_offset` (a value put's value),
//! `dst_offset`, `size | op << 40 | src_buffer << 44 | dst_buffer << 54` (a value put: size 8,
//! source buffer 0), and `seq` — the slot's sequence
//! number plus one, written last (after a system-scope fence), which marks the slot valid. Slot
//! `s` lives at index `s % depth`; the proxy takes slot `tail` once its `seq` reads `tail + 1`,
//! so slots are never cleared. The device reserves a slot with an atomic add on `head` and
//! waits while `slot - tail >= depth`.
//!
//! # Failures
//!
//! Nothing a kernel waits on may stay unwritten forever. When the proxy meets a bad trigger
//! (unknown buffer, range past its end), a vendor error, the peer's death or the
//! communicator's abort, it *poisons* the channel: writes the code into `status` and
//! [`POISON`] into this rank's flag (and, unless the peer is gone, into the peer's flag too —
//! on a staged pair through its lane's `poison` word, which the peer's proxy turns into
//! [`POISON`] in its flag — so its kernels stop waiting for signals that will not come). Device-side waits check both and
//! return the code. A poisoned channel stays failed; [`PortChannel::check`] reports why.
//! A proxy blocked inside a vendor call for `FLAGCX_TIMEOUT_MS` has its channels failed by a
//! guard thread (status `DeviceError`, `Timeout` from [`PortChannel::check`]; `proxy.rs`).
//! A peer that hangs without dying is not detected by the proxy (there is no operation to
//! time out): the application releases its kernels with [`PortChannel::poison`].
//!
//! The device side for users' kernels is `include/flagcx/device.cuh` (CUDA and HIP), and
//! [`host::HostPort`] for host-addressable vendors (the host vendor's "kernels" are threads).

pub mod host;
pub mod lane;
mod open;
mod proxy;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, IpcMemHandle, StreamHandle};

use crate::bootstrap::Bootstrap;
use crate::error::{CommError, Result};
use crate::shared::Shared;
use crate::wire::{Reader, Tag, Writer};

pub(crate) use proxy::PortProxy;

/// Bytes of one trigger slot.
pub const TRIGGER_BYTES: usize = 32;
/// Trigger operation: copy bytes to the peer.
pub const OP_PUT: u64 = 1;
/// Trigger operation: add one to the peer's flag after everything earlier.
pub const OP_SIGNAL: u64 = 2;
/// Trigger operation: a put, then a signal.
pub const OP_PUT_WITH_SIGNAL: u64 = 3;
/// Trigger operation: report when everything earlier completed.
pub const OP_FLUSH: u64 = 4;
/// Trigger operation: write the trigger's 64-bit value (carried where a put has its source
/// offset) into the peer's buffer, at an 8-byte-aligned address.
pub const OP_PUT_VALUE: u64 = 5;
/// Trigger operation: a value put, then a signal.
pub const OP_PUT_VALUE_WITH_SIGNAL: u64 = 6;
/// The flag value that means "this channel failed; stop waiting".
pub const POISON: u64 = u64::MAX;
/// Most buffers one side of a channel may name (10 bits of a trigger).
pub const MAX_BUFFERS: usize = 1 << 10;
/// Largest single put, in bytes (40 bits of a trigger).
pub const MAX_PUT_BYTES: u64 = (1 << 40) - 1;
/// Most trigger slots of one FIFO.
pub const MAX_DEPTH: usize = 1 << 16;

/// Offsets in the control block.
pub(crate) const TAIL_OFF: u64 = 0;
pub(crate) const FLUSHED_OFF: u64 = 64;
pub(crate) const STATUS_OFF: u64 = 128;
pub(crate) const TRIGGERS_OFF: u64 = 4096;
/// Offsets in the device words.
pub(crate) const FLAG_OFF: u64 = 0;
/// Where `head` is in the device words ([`PortRaw::head`] is the words' address plus this).
pub const HEAD_OFF: u64 = 128;
/// Where the buffer table starts in the device words (see [`buffer_table`]).
pub const TABLE_OFF: u64 = 256;
/// Bytes of the largest buffer table: two counts, (address, length) per buffer of this rank,
/// one word per buffer of the peer.
const TABLE_BYTES: usize = 16 + 16 * MAX_BUFFERS + 8 * MAX_BUFFERS;
const DEVICE_WORDS: usize = TABLE_OFF as usize + TABLE_BYTES;
// `include/flagcx/device.cuh` finds the table at `head + kTableFromHead` (128).
const _: () = assert!(TABLE_OFF - HEAD_OFF == 128);
const PAGE: usize = 4096;

/// Why a channel failed, as written into its `status` word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum PortStatus {
    /// Healthy.
    Running = 0,
    /// The peer died or closed its communicator.
    PeerLost = 1,
    /// A trigger named an unknown operation or buffer, or a range past a buffer's end.
    BadTrigger = 2,
    /// The vendor runtime failed a copy or a flag write.
    DeviceError = 3,
    /// The channel was closed, poisoned by the application, or its communicator aborted.
    Closed = 4,
}

impl PortStatus {
    /// The status for a raw word (unknown codes read as [`PortStatus::DeviceError`]).
    pub fn from_word(w: u64) -> Self {
        match w {
            0 => PortStatus::Running,
            1 => PortStatus::PeerLost,
            2 => PortStatus::BadTrigger,
            4 => PortStatus::Closed,
            _ => PortStatus::DeviceError,
        }
    }
}

/// What device code needs to drive a channel: device-visible addresses (see the module's
/// layout table) and the FIFO's depth. The same layout as `flagcx::PortChannelHandle` in
/// `include/flagcx/device.cuh`; pass it to a kernel by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRaw {
    /// The first trigger slot.
    pub triggers: u64,
    /// The reservation counter (device memory).
    pub head: u64,
    /// Triggers the proxy took.
    pub tail: u64,
    /// Sequence number of the last completed flush.
    pub flushed: u64,
    /// 0 while healthy, else a [`PortStatus`] code.
    pub status: u64,
    /// This rank's flag: signals received from the peer (device memory).
    pub flag: u64,
    /// Trigger slots in the FIFO.
    pub depth: u32,
    /// Zero.
    pub reserved: u32,
}

const _: () = assert!(std::mem::size_of::<PortRaw>() == 56);

/// The buffer table device code reads at [`TABLE_OFF`] of the device words, as little-endian
/// words: the number of this rank's buffers `n`, the number of the peer's `m`, then for each of
/// ours its address and length, then for each of the peer's 1 where an 8-byte value put into
/// it is possible (its address, as this rank's proxy writes it, is 8-byte aligned; always on a
/// staged pair) and 0 where not. With it a put of 8 bytes between aligned addresses is sent as
/// a value put: the device reads the 8 bytes itself, and the proxy writes them with a stream
/// write instead of a copy.
pub fn buffer_table(
    local: &[(DevicePtr, usize)],
    remote: &[(DevicePtr, usize)],
    staged: bool,
) -> Vec<u8> {
    let mut words = vec![local.len() as u64, remote.len() as u64];
    for &(p, len) in local {
        words.extend([p.0, len as u64]);
    }
    words.extend(
        remote
            .iter()
            .map(|&(p, _)| u64::from(staged || p.0 % 8 == 0)),
    );
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Packs a trigger's third word; `None` when a field does not fit.
pub fn pack_trigger(op: u64, src_buffer: usize, dst_buffer: usize, size: u64) -> Option<u64> {
    (op < 16 && src_buffer < MAX_BUFFERS && dst_buffer < MAX_BUFFERS && size <= MAX_PUT_BYTES)
        .then_some(size | op << 40 | (src_buffer as u64) << 44 | (dst_buffer as u64) << 54)
}

/// Unpacks a trigger's third word: operation, source buffer, destination buffer, size.
pub fn unpack_trigger(w: u64) -> (u64, usize, usize, u64) {
    (
        (w >> 40) & 0xf,
        ((w >> 44) & 0x3ff) as usize,
        (w >> 54) as usize,
        w & MAX_PUT_BYTES,
    )
}

/// A buffer of this rank made reachable by port channels: its IPC identity, computed once.
/// Cheap to clone; channels keep a clone while they live.
#[derive(Debug, Clone)]
pub struct Registered {
    inner: Arc<RegInner>,
}

#[derive(Debug)]
struct RegInner {
    ptr: DevicePtr,
    len: usize,
    /// Its IPC handle, where the vendor has IPC handles (IPC pairs need it; staged pairs
    /// name the buffer by index only).
    handle: Option<IpcMemHandle>,
    /// `ptr`'s offset in the allocation `handle` names.
    offset: u64,
}

impl Registered {
    /// The buffer's address.
    pub fn ptr(&self) -> DevicePtr {
        self.inner.ptr
    }

    /// The buffer's length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the buffer is empty (never: registration refuses zero bytes).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
}

/// Host memory registered with the vendor: the control block of one channel.
pub(crate) struct ControlBlock {
    pub host: *mut u8,
    pub len: usize,
    pub device: DevicePtr,
}

// SAFETY: the block is a private mapping owned by its channel; every access after creation is
// through atomics (`word`), so sharing the pointer between the channel's owner and the proxy
// thread is sound.
unsafe impl Send for ControlBlock {}
// SAFETY: as above.
unsafe impl Sync for ControlBlock {}

impl ControlBlock {
    fn new<A: DeviceAdaptor>(adaptor: &A, depth: usize) -> Result<Self> {
        let len = (TRIGGERS_OFF as usize + depth * TRIGGER_BYTES).div_ceil(PAGE) * PAGE;
        let host = crate::watermark::anon_pages(len, "mmap port control block")?;
        // SAFETY: the mapping stays until `release`, which unregisters it first.
        match unsafe { adaptor.host_register(host, len) } {
            Ok(device) => Ok(ControlBlock { host, len, device }),
            Err(e) => {
                // SAFETY: our mapping, not yet shared with anyone.
                unsafe { libc::munmap(host.cast(), len) };
                Err(e.into())
            }
        }
    }

    /// The 64-bit word at byte `off` (8-aligned, inside the block).
    pub fn word(&self, off: u64) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && (off as usize) + 8 <= self.len);
        // SAFETY: in bounds and aligned (callers pass the layout's offsets, and slot offsets
        // below `len` by construction); the mapping lives as long as `self`; all accesses are
        // atomic.
        unsafe { &*(self.host.add(off as usize) as *const AtomicU64) }
    }

    fn release<A: DeviceAdaptor>(&mut self, adaptor: &A) {
        // SAFETY: the proxy dropped the channel and its stream was synchronized; device code
        // may no longer use the block (the contract of closing a channel).
        unsafe {
            let _ = adaptor.host_unregister(self.host);
            libc::munmap(self.host.cast(), self.len);
        }
    }
}

/// Everything one channel owns, shared by the [`PortChannel`] and the proxy thread.
pub(crate) struct Channel<A: DeviceAdaptor> {
    pub adaptor: A,
    pub id: u64,
    pub peer: usize,
    pub depth: usize,
    pub control: ControlBlock,
    /// Flag and head (device memory).
    pub words: DevicePtr,
    /// Puts, signals and flushes, in FIFO order.
    pub stream: StreamHandle,
    /// Poison writes, which must not queue behind the FIFO's work.
    pub ctl: StreamHandle,
    /// This rank's buffers: (address, length).
    pub local: Vec<(DevicePtr, usize)>,
    /// The peer's buffers as mapped here: (address, length); on a staged pair the addresses
    /// are null (only the lengths are known, to check triggers).
    pub remote: Vec<(DevicePtr, usize)>,
    /// The peer's flag as mapped here (null on a staged pair).
    pub peer_flag: DevicePtr,
    /// The lanes of a staged pair ([`lane`]); `None` on an IPC pair.
    pub staged: Option<lane::StagedLink>,
    /// The first failure (kept for [`PortChannel::check`]).
    pub error: Mutex<Option<CommError>>,
    /// Triggers executed and bytes put.
    pub triggers_done: AtomicU64,
    pub bytes_put: AtomicU64,
    pub boot: Arc<Bootstrap>,
    pub shared: Arc<Shared>,
}

impl<A: DeviceAdaptor> Channel<A> {
    /// The device-visible view of the channel.
    fn raw(&self) -> PortRaw {
        let c = self.control.device.0;
        PortRaw {
            triggers: c + TRIGGERS_OFF,
            head: self.words.0 + HEAD_OFF,
            tail: c + TAIL_OFF,
            flushed: c + FLUSHED_OFF,
            status: c + STATUS_OFF,
            flag: self.words.0 + FLAG_OFF,
            depth: self.depth as u32,
            reserved: 0,
        }
    }

    /// Marks the channel failed with `code` and releases every waiter: this rank's flag and
    /// (unless the peer is gone) the peer's are set to [`POISON`]. The first failure wins.
    pub fn poison(&self, code: PortStatus, why: CommError) {
        if self.mark_failed(code, why) {
            self.release_waiters(code);
        }
    }

    /// The part of [`Self::poison`] that makes no vendor call, so that a thread may do it while
    /// the proxy is blocked inside one: keeps `why` for [`PortChannel::check`], writes `code`
    /// into the status word every device-side wait checks, and (a staged pair, unless the peer
    /// is gone) tells the peer through its lane's poison word. Whether this was the first
    /// failure.
    pub fn mark_failed(&self, code: PortStatus, why: CommError) -> bool {
        {
            // The error is in place before anything a waiter sees says "failed".
            let mut first = flagcx_adaptor::tracking::lock(&self.error);
            if first.is_some() {
                return false;
            }
            tracing::warn!(peer = self.peer, ?code, "port channel failed: {why}");
            *first = Some(why);
        }
        self.control
            .word(STATUS_OFF)
            .store(code as u64, Ordering::Release);
        if let (Some(link), false) = (&self.staged, code == PortStatus::PeerLost) {
            // The peer's proxy reads it and releases its own flag.
            link.out.poison(code as u64);
        }
        true
    }

    /// The status word: what device-side waits see.
    pub fn status(&self) -> PortStatus {
        PortStatus::from_word(self.control.word(STATUS_OFF).load(Ordering::Acquire))
    }

    /// The part of [`Self::poison`] that takes vendor calls: [`POISON`] into this rank's flag,
    /// and on an IPC pair into the peer's (unless the peer is gone).
    pub fn release_waiters(&self, code: PortStatus) {
        self.release_flag();
        if code != PortStatus::PeerLost && self.staged.is_none() {
            // SAFETY: the peer's flag is a live device word mapped until close, 8-byte aligned.
            unsafe {
                let _ = self
                    .adaptor
                    .stream_write_value64(self.ctl, self.peer_flag, POISON);
            }
        }
    }

    /// Writes [`POISON`] into this rank's flag: at once (the control stream) and, on a staged
    /// pair, also behind the inbound stream's queued signal counts, which would otherwise
    /// overwrite it.
    pub fn release_flag(&self) {
        let flag = DevicePtr(self.words.0 + FLAG_OFF);
        // SAFETY: our flag is a live, aligned device word of this channel.
        unsafe {
            let _ = self.adaptor.stream_write_value64(self.ctl, flag, POISON);
            if let Some(link) = &self.staged {
                let _ = self.adaptor.stream_write_value64(link.stream, flag, POISON);
            }
        }
    }
}

/// One end of a port channel (see the [module documentation](self)). Close it with
/// [`PortChannel::close`] on both ranks once no kernel uses it.
pub struct PortChannel<A: DeviceAdaptor> {
    ch: Arc<Channel<A>>,
    proxy: Arc<PortProxy<A>>,
    /// The registrations the channel names (kept alive while it lives).
    _buffers: Vec<Registered>,
    /// Allocations of the peer mapped here (closed at release).
    opened: Vec<DevicePtr>,
    done: bool,
}

impl<A: DeviceAdaptor> std::fmt::Debug for PortChannel<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortChannel")
            .field("peer", &self.ch.peer)
            .field("depth", &self.ch.depth)
            .field("raw", &self.ch.raw())
            .finish()
    }
}

impl<A: DeviceAdaptor> PortChannel<A> {
    /// The handle device code drives the channel with.
    pub fn raw(&self) -> PortRaw {
        self.ch.raw()
    }

    /// The peer rank.
    pub fn peer(&self) -> usize {
        self.ch.peer
    }

    /// Whether puts go through shared-memory lanes (a staged pair, [`lane`]) rather than one
    /// copy into the peer's mapped buffer (an IPC pair).
    pub fn is_staged(&self) -> bool {
        self.ch.staged.is_some()
    }

    /// The peer's registered buffer `i` as mapped in this process (an IPC pair: where a put
    /// into it copies to); `None` on a staged pair, or past the buffers the peer named. For a
    /// ceiling measured beside the puts: copies issued to it from the host.
    pub fn peer_buffer(&self, i: usize) -> Option<DevicePtr> {
        match self.ch.remote.get(i) {
            Some(&(p, _)) if self.ch.staged.is_none() => Some(p),
            _ => None,
        }
    }

    /// Triggers the proxy executed, and bytes it put.
    pub fn stats(&self) -> (u64, u64) {
        (
            self.ch.triggers_done.load(Ordering::Relaxed),
            self.ch.bytes_put.load(Ordering::Relaxed),
        )
    }

    /// `Ok` while the channel is healthy; else why it failed.
    pub fn check(&self) -> Result<()> {
        match flagcx_adaptor::tracking::lock(&self.ch.error).as_ref() {
            None => Ok(()),
            Some(e) => Err(e.clone()),
        }
    }

    /// Fails the channel on purpose (status [`PortStatus::Closed`]), releasing every kernel
    /// waiting on it on both ranks: what an application does when it gives up on a peer that
    /// hangs without dying.
    pub fn poison(&self) {
        self.ch.poison(PortStatus::Closed, CommError::Aborted);
    }

    /// Stops the channel and releases its memory. Both ranks call it (in the same order
    /// as their other channels with this peer), after every kernel using the channel ended.
    /// Returns the channel's failure if it had one.
    pub fn close(mut self) -> Result<()> {
        self.shutdown(true)
    }

    fn shutdown(&mut self, handshake: bool) -> Result<()> {
        if std::mem::replace(&mut self.done, true) {
            return Ok(());
        }
        let ch = &self.ch;
        if let Err(e) = self.proxy.remove(ch.id) {
            // The proxy may still use the channel's streams and mappings: leave them.
            tracing::warn!(peer = ch.peer, "port channel left allocated: {e}");
            return Err(e);
        }
        let mut first = None;
        if let Err(e) = ch.adaptor.stream_synchronize(ch.ctl) {
            first.get_or_insert(e.into());
        }
        let status = ch.status();
        // The peer must stop writing into our flag (and lanes) before they are freed: say
        // goodbye with the count of chunks we published, and wait for its goodbye. A peer
        // known dead writes nothing more.
        let published = ch
            .staged
            .as_ref()
            .map_or(0, |l| l.published.load(Ordering::Acquire));
        let mut peer_published = None;
        let peer_done = status == PortStatus::PeerLost
            || (handshake
                && ch
                    .boot
                    .send(
                        ch.peer,
                        Tag::Port,
                        Writer::new()
                            .u8(FRAME_CLOSE)
                            .u64(published)
                            .finish()
                            .as_slice(),
                        &[],
                    )
                    .and_then(|()| ch.boot.recv(ch.peer, Tag::Port))
                    .and_then(|(b, _)| {
                        let mut r = Reader::new(&b, "port channel close");
                        if r.u8()? != FRAME_CLOSE {
                            return Err(CommError::Protocol(
                                "port channel close: the peer sent something else (channels \
                                 must be created and closed in the same order on both ranks)"
                                    .into(),
                            ));
                        }
                        peer_published = Some(r.u64()?);
                        r.end()
                    })
                    .map_err(|e| {
                        first.get_or_insert(e);
                    })
                    .is_ok());
        if ch.staged.is_some() {
            // Whatever the peer published before its goodbye lands before the lanes go.
            if let Err(e) = self.proxy.retire(ch.id, peer_published) {
                tracing::warn!(peer = ch.peer, "port channel left allocated: {e}");
                return Err(e);
            }
        }
        for &base in &self.opened {
            // SAFETY: the proxy no longer issues work on this channel and its streams are
            // synchronized, so nothing uses the mapping.
            let _ = unsafe { ch.adaptor.ipc_close(base) };
        }
        let _ = ch.adaptor.stream_destroy(ch.stream);
        let _ = ch.adaptor.stream_destroy(ch.ctl);
        if let Some(l) = &ch.staged {
            let _ = ch.adaptor.stream_destroy(l.stream);
        }
        if peer_done {
            // SAFETY: the peer no longer writes the flag, and our device code no longer uses
            // the words (close's contract).
            let _ = unsafe { ch.adaptor.mem_free(ch.words) };
        } else {
            tracing::warn!(
                peer = ch.peer,
                "port channel dropped without the peer's goodbye: its flag word stays allocated"
            );
        }
        // SAFETY: the `Arc` is only shared with the proxy, which dropped its clone in `remove`.
        if let Some(c) = Arc::get_mut(&mut self.ch) {
            c.control.release(&c.adaptor);
            if let Some(l) = &c.staged {
                // SAFETY: the proxy synchronized the streams that used the lanes (`retire`).
                unsafe {
                    l.out.release(&c.adaptor);
                    l.inb.release(&c.adaptor);
                }
            }
        }
        let channel_error = flagcx_adaptor::tracking::lock(&self.ch.error).clone();
        match (first, channel_error) {
            (_, Some(e)) if status != PortStatus::Running => Err(e),
            (Some(e), _) => Err(e),
            _ => Ok(()),
        }
    }
}

impl<A: DeviceAdaptor> Drop for PortChannel<A> {
    fn drop(&mut self) {
        let _ = self.shutdown(false);
    }
}

const FRAME_HELLO: u8 = 1;
const FRAME_CLOSE: u8 = 2;
/// Instead of a hello: this rank could not make its side (the reason follows).
const FRAME_REFUSED: u8 = 3;

/// How long the proxy keeps polling after the last trigger before it naps.
pub(crate) const ACTIVE_WINDOW: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_words_round_trip_and_refuse_what_does_not_fit() {
        let w = pack_trigger(OP_PUT_WITH_SIGNAL, 1023, 7, MAX_PUT_BYTES).unwrap();
        assert_eq!(
            unpack_trigger(w),
            (OP_PUT_WITH_SIGNAL, 1023, 7, MAX_PUT_BYTES)
        );
        let w = pack_trigger(OP_FLUSH, 0, 1023, 0).unwrap();
        assert_eq!(unpack_trigger(w), (OP_FLUSH, 0, 1023, 0));
        assert_eq!(pack_trigger(OP_PUT, MAX_BUFFERS, 0, 1), None);
        assert_eq!(pack_trigger(OP_PUT, 0, MAX_BUFFERS, 1), None);
        assert_eq!(pack_trigger(OP_PUT, 0, 0, MAX_PUT_BYTES + 1), None);
        assert_eq!(pack_trigger(16, 0, 0, 1), None);
    }

    #[test]
    fn unknown_status_words_read_as_device_errors() {
        assert_eq!(PortStatus::from_word(0), PortStatus::Running);
        assert_eq!(PortStatus::from_word(1), PortStatus::PeerLost);
        assert_eq!(PortStatus::from_word(2), PortStatus::BadTrigger);
        assert_eq!(PortStatus::from_word(4), PortStatus::Closed);
        assert_eq!(PortStatus::from_word(99), PortStatus::DeviceError);
    }
}
