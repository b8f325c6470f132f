//! A channel: the shared-memory block through which one rank sends to another.
//!
//! The receiver creates it (a memfd) and hands the descriptor to the sender; both map it. It
//! holds monotonic counters, two descriptor rings and, for the staged transport, the data slots:
//!
//! | field | writer | meaning |
//! |---|---|---|
//! | `recv_posted` | receiver | receives announced (descriptor `i` = size, IPC handle, offset); when the receiver pulls, its verdict after the copy (or, on the direct path, "send chunks") |
//! | `recv_done` | receiver | receives finished (send descriptor `i` may be reused) |
//! | `head` | receiver | staged chunks drained from the ring (slots free again) |
//! | `send_posted` | sender | sends answered (descriptor `i` = size, status — `DELIVERED` when the direct path already copied); when the receiver pulls, the offer (size, IPC handle, offset of the source) |
//! | `tail` | sender | staged chunks written into the ring |
//! | `issued` | the IPC copier | the copy of message `i` is running (issued by a posting thread on an idle stream): a hint, see `Comm` |
//! | `send_fault`, `recv_fault` | each side | `i + 1` when that side of message `i` failed (a vendor error): the other side fails the message too instead of waiting |
//! | `claim` | both (late copies) | the last message either side claimed first |
//! | `freed`, `unmapped` | sender, receiver (late copies) | allocations of the sender it freed that the receiver may still map, published in the freed ring of the control page; how many of them the receiver no longer maps (`link::named`) |
//!
//! Between two ranks whose device memory the CPU addresses, the channel also has one eager slot
//! per send descriptor: a small message is copied into slot `i` (up to 240 bytes: into the
//! descriptor itself, behind its status word) and published as send descriptor `i` with status
//! `EAGER`, without waiting for the receive descriptor. The status word of an eager descriptor
//! also carries `i + 1` and is stored last, so a receiver can wait on that one cache line
//! instead of on `send_posted` (which follows). The receiver copies the message out and
//! publishes `recv_done` past `i`; `recv_posted` is left alone (nobody waits for it).
//!
//! After the control page come two reduction slots ([`REDUCE_SLOTS_AT`], `crate::slots`).
//!
//! Every counter only grows; a descriptor is written before its counter is published with
//! release ordering and read after an acquire load, so each ring is a plain SPSC queue.

// tidy: long file: the layout of the shared segment both ranks of a pair map — every offset, counter and descriptor field in one place, so no two users of the segment can overlap.

use std::sync::atomic::{AtomicU64, Ordering};

use flagcx_adaptor::IpcMemHandle;

use crate::error::{CommError, Result};
use crate::shm::ShmSegment;

/// Descriptors per ring: a flow-control window, not a cap on operations in flight (the proxy
/// queues more locally).
pub const DESC_RING: u64 = 64;
const CTRL_BYTES: usize = 4096;
/// The two reduction slots (`crate::slots`) follow the control page: each a 16-byte head and
/// up to [`REDUCE_SLOT_DATA`] bytes of data, [`REDUCE_SLOT_BYTES`] apart.
pub const REDUCE_SLOTS_AT: usize = CTRL_BYTES;
/// The data a reduction slot holds.
pub const REDUCE_SLOT_DATA: usize = 4096;
/// The stride of the reduction slots.
pub const REDUCE_SLOT_BYTES: usize = (16 + REDUCE_SLOT_DATA).next_multiple_of(64);
const REDUCE_SLOTS_END: usize = (CTRL_BYTES + 2 * REDUCE_SLOT_BYTES).next_multiple_of(4096);
/// A descriptor's stride: four cache lines, room for small eager messages inline.
const DESC_BYTES: usize = 256;
/// The fields of a rendezvous descriptor (size, status or offset, handle, offset or mode):
/// its first two lines, all that is read or written of one; the rest of a send descriptor
/// carries only eager data.
pub const RECV_DESC_BYTES: usize = 128;
// A receive descriptor's taken word lies past what the sender reads, inside the descriptor,
// and the late-copy words after it.
const _: () = assert!(RECV_DESC_BYTES + 8 + 8 * LateWord::COUNT <= DESC_BYTES);
/// The fields of a send descriptor (size, status word, handle, span, offset).
pub const SEND_DESC_BYTES: usize = 128;
/// Eager messages up to this size travel inside their descriptor, after the 16-byte head
/// (size, status): the lines the receiver fetches follow the status word it polled, instead of
/// lying in a slot elsewhere.
pub const EAGER_INLINE: usize = DESC_BYTES - 16;
const PAGE: usize = 4096;

/// What a send descriptor says about its message (the word at bytes 8..16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum SendStatus {
    /// The sender's answer: its size; chunks or the copy follow as the transport does them.
    Ok = 0,
    /// The sender's message is larger than the receive buffer.
    SizeMismatch = 1,
    /// The sender failed (a vendor error); no data moved.
    SenderFailed = 2,
    /// Staged pair, direct path: the sender already copied the data into the receive buffer
    /// (which the receiver's descriptor exported); no chunks follow.
    Delivered = 3,
    /// Sender, eager: the data is in the channel's eager slot of the same index (`size`
    /// bytes); the sender is done with the message.
    Eager = 4,
}

impl SendStatus {
    /// The word as stored in the descriptor.
    pub fn word(self) -> u64 {
        self as u64
    }

    /// The status a stored word names; anything else is a protocol error (a corrupt or
    /// hostile peer).
    pub fn from_word(w: u64) -> Result<Self> {
        Ok(match w {
            0 => SendStatus::Ok,
            1 => SendStatus::SizeMismatch,
            2 => SendStatus::SenderFailed,
            3 => SendStatus::Delivered,
            4 => SendStatus::Eager,
            other => return Err(CommError::Protocol(format!("send status {other}"))),
        })
    }
}

/// Counter offsets in the control page, each on its own cache line.
#[derive(Clone, Copy)]
#[repr(usize)]
pub enum Counter {
    /// See the module table.
    RecvPosted = 0,
    /// See the module table.
    RecvDone = 64,
    /// See the module table.
    Head = 128,
    /// See the module table.
    SendPosted = 192,
    /// See the module table.
    Tail = 256,
    /// Sender: `i + 1` when its side of message `i` failed locally (the pair is then retired);
    /// [`RETIRED`] when it retired the pair for another reason (a timeout, an abort).
    SendFault = 320,
    /// Receiver: `i + 1` when its side of message `i` failed locally.
    RecvFault = 384,
    /// The copier of an IPC pair (either side): `i + 1` once its posting thread issued the copy
    /// of message `i` on an idle stream, so the copy is running. A hint for the other side's
    /// posting thread, which then keeps waiting for the answer rather than handing over.
    Issued = 448,
    /// Sender: `i + 1` once its message `i` went to its proxy, for the descriptor handshake. A
    /// hint for the receiver's posting thread, which may be waiting for the message to come
    /// eagerly: it then hands its receive to its proxy at once (which announces it: a pushing
    /// sender waits for that) instead of waiting out its budget.
    Handshake = 512,
    /// Late-copy pairs (`transport::late`): the last message either side claimed first, as
    /// `(i + 1) << 1 | sender`; compare-and-swapped by both posting threads.
    Claim = 576,
    /// Late-copy pairs, sender: how many records of allocations it freed it published in the
    /// freed ring ([`Channel::publish_freed`]; see `link::named`).
    Freed = 640,
    /// Late-copy pairs, receiver: how many of the sender's freed records it has acted on: it
    /// maps none of those allocations any more.
    Unmapped = 704,
}

/// Where the freed ring lies in the control page: [`FREED_RING`] spans of 16 bytes.
const FREED_AT: usize = 1024;
/// Records in the freed ring: the sender publishes record `n` only once the receiver acted on
/// record `n - FREED_RING` ([`Counter::Unmapped`]).
pub const FREED_RING: u64 = 16;
const _: () = assert!(FREED_AT >= Counter::Unmapped as usize + 64);
const _: () = assert!(FREED_AT + 16 * FREED_RING as usize <= CTRL_BYTES);

/// The words a late-copy message (`transport::late`) keeps in its receive descriptor, past
/// the taken word: no eager payload ever lands there, and each use of a descriptor slot stores
/// larger values than the one before (message `i + 64` after `i`), so streams wait with `Geq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LateWord {
    /// `i + 1` once the earlier side's stream reached message `i` (its buffer may be copied).
    Ready = 0,
    /// `(i + 1) << 8 | status` once the later side's stream copied message `i` (status: a
    /// [`SendStatus`]; `Ok`, `SizeMismatch` or `SenderFailed`).
    Done = 1,
    /// The sender's byte count for message `i`, stored by the later side's posting thread
    /// before its stream writes `Done`.
    SendBytes = 2,
    /// The receive buffer's byte count for message `i`, likewise.
    RecvBytes = 3,
    /// `i + 1` once the earlier side's stream passed its wait for `Done` (its last use of the
    /// pair's words for message `i`). Only that stream writes it.
    Passed = 4,
    /// `i + 1` once the later side's stream wrote `Done` (or its posting thread settled the
    /// message). Only that side writes it: a `Done` the other side's engine forces to release
    /// its own stream says nothing about this side's copy.
    Copied = 5,
}

impl LateWord {
    const COUNT: usize = 6;
}

/// The value of a fault counter ([`Counter::SendFault`], [`Counter::RecvFault`]) whose side
/// retired the pair as a whole: every message from then on fails on the other side.
pub const RETIRED: u64 = u64::MAX;

/// Where an exported allocation lies in the address space of the process that exported it.
///
/// Two live allocations of one process never overlap, so a new allocation of a peer that
/// overlaps one this rank still maps shows that the mapped one was freed (and its memory, or
/// its addresses, reused): the mapping is stale, and is closed once that is safe (CUDA may
/// refuse to map the new allocation beside it: `CUDA_ERROR_ALREADY_MAPPED`; see
/// `IpcCache::open`). Zero length: not known.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Span {
    /// The allocation's base address in the exporting process.
    pub base: u64,
    /// Its length in bytes.
    pub len: u64,
}

impl Span {
    /// Whether both spans are known and share at least one byte.
    pub fn overlaps(&self, other: &Span) -> bool {
        self.len > 0
            && other.len > 0
            && self.base < other.base.saturating_add(other.len)
            && other.base < self.base.saturating_add(self.len)
    }
}

/// What a receiver announces for one receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvDesc {
    /// Bytes the receive buffer holds.
    pub size: u64,
    /// For IPC: the handle of the allocation holding the buffer.
    pub handle: Option<IpcMemHandle>,
    /// For IPC: the buffer's offset in that allocation.
    pub offset: u64,
    /// For IPC: where that allocation lies in the receiver's process.
    pub span: Span,
    /// In a pulling receiver's verdict: it did not pull (the direct path's buffer is not
    /// mapped yet), so the sender is to send the data through the staging ring.
    pub chunks: bool,
}

/// What a sender answers for one send (or, when the receiver pulls, offers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendDesc {
    /// Bytes sent.
    pub size: u64,
    /// What the descriptor says.
    pub status: SendStatus,
    /// When the receiver pulls: the handle of the allocation holding the source buffer.
    pub handle: Option<IpcMemHandle>,
    /// When the receiver pulls: the source buffer's offset in that allocation.
    pub offset: u64,
    /// When the receiver pulls: where that allocation lies in the sender's process.
    pub span: Span,
}

/// Offset of descriptor `i` of the ring at `base` (both rings have `DESC_BYTES` descriptors).
fn desc_offset(base: usize, i: u64) -> usize {
    base + (i % DESC_RING) as usize * DESC_BYTES
}

/// Where a descriptor's span lies: after the handle, 8-byte aligned.
const SPAN_AT: usize = (17 + IpcMemHandle::WIRE_LEN).next_multiple_of(8);
// Both descriptors keep their last 8 bytes for a field of their own (offset, mode).
const _: () = assert!(SPAN_AT + 16 <= RECV_DESC_BYTES - 8 && SPAN_AT + 16 <= SEND_DESC_BYTES - 8);

/// Descriptor layout shared by both rings: `a`, `b`, then a flag byte, an optional handle and
/// the exported allocation's span.
fn encode_desc<const N: usize>(
    a: u64,
    b: u64,
    handle: Option<IpcMemHandle>,
    span: Span,
) -> [u8; N] {
    let mut out = [0u8; N];
    out[0..8].copy_from_slice(&a.to_le_bytes());
    out[8..16].copy_from_slice(&b.to_le_bytes());
    if let Some(h) = handle {
        out[16] = 1;
        out[17..17 + IpcMemHandle::WIRE_LEN].copy_from_slice(&h.to_wire());
        out[SPAN_AT..SPAN_AT + 8].copy_from_slice(&span.base.to_le_bytes());
        out[SPAN_AT + 8..SPAN_AT + 16].copy_from_slice(&span.len.to_le_bytes());
    }
    out
}

impl RecvDesc {
    /// Decodes a receive descriptor's bytes as a peer wrote them: a typed error for anything
    /// malformed, never a panic.
    pub fn decode(b: &[u8; RECV_DESC_BYTES]) -> Result<RecvDesc> {
        let (size, offset, handle, span) = decode_desc(b, "receive")?;
        let chunks = match b[RECV_DESC_BYTES - 1] {
            0 => false,
            1 => true,
            x => return Err(CommError::Protocol(format!("receive descriptor mode {x}"))),
        };
        Ok(RecvDesc {
            size,
            handle,
            offset,
            span,
            chunks,
        })
    }
}

impl SendDesc {
    /// Decodes send descriptor `i`'s bytes as a peer wrote them (the status word carries the
    /// message number, checked against `i`): a typed error for anything malformed, never a
    /// panic.
    pub fn decode(b: &[u8; SEND_DESC_BYTES], i: u64) -> Result<SendDesc> {
        let (size, status, handle, span) = decode_desc(b, "send")?;
        if status >> 8 != i.wrapping_add(1) {
            return Err(CommError::Protocol(format!(
                "send descriptor {i} carries message number {}",
                (status >> 8).wrapping_sub(1)
            )));
        }
        let status = SendStatus::from_word(status & 0xFF)?;
        let offset = u64::from_le_bytes(b[SEND_DESC_BYTES - 8..].try_into().expect("8"));
        Ok(SendDesc {
            size,
            status,
            handle,
            offset,
            span,
        })
    }
}

fn decode_desc(b: &[u8], what: &str) -> Result<(u64, u64, Option<IpcMemHandle>, Span)> {
    let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8"));
    let handle = match b[16] {
        0 => None,
        1 => Some(IpcMemHandle::from_wire(
            &b[17..17 + IpcMemHandle::WIRE_LEN],
        )?),
        x => return Err(CommError::Protocol(format!("{what} descriptor flag {x}"))),
    };
    let span = match handle {
        Some(_) => Span {
            base: word(SPAN_AT),
            len: word(SPAN_AT + 8),
        },
        None => Span::default(),
    };
    Ok((word(0), word(8), handle, span))
}

/// The layout of a channel segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Staged slots (0 for IPC channels).
    pub slots: usize,
    /// Bytes per slot.
    pub chunk: usize,
    /// Chunks a staged message is cut into while each fits a slot (0 for IPC channels).
    pub split: usize,
    /// Bytes per eager slot, one per descriptor (0: the channel carries no eager messages).
    pub eager: usize,
}

impl Geometry {
    fn recv_descs(&self) -> usize {
        REDUCE_SLOTS_END
    }
    fn send_descs(&self) -> usize {
        self.recv_descs() + DESC_RING as usize * DESC_BYTES
    }
    fn lane(&self) -> usize {
        (self.send_descs() + DESC_RING as usize * DESC_BYTES).next_multiple_of(PAGE)
    }
    fn ring(&self) -> usize {
        (self.lane() + DESC_RING as usize * self.eager).next_multiple_of(PAGE)
    }
    /// Total bytes of the segment.
    pub fn len(&self) -> usize {
        self.ring() + self.slots * self.chunk
    }
    /// True when the segment has no data slots.
    pub fn is_empty(&self) -> bool {
        self.slots == 0
    }
}

/// The connect frame: how a rank set up the channel it offers a peer (whether staged, its
/// geometry and length, and whether a device ring rides along), which the peer checks against
/// what it expects before mapping anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectMsg {
    /// A staged channel (a ring of slots), not an IPC one.
    pub staged: bool,
    /// The segment's layout.
    pub geo: Geometry,
    /// The segment's length in bytes.
    pub len: u64,
    /// A device ring: 0 none, 1 its descriptor passed with the frame, 2 in the peer's memory.
    pub offered: u8,
    /// The device ring's length.
    pub ring_len: u64,
}

impl ConnectMsg {
    /// The frame payload.
    pub fn encode(&self) -> Vec<u8> {
        crate::wire::Writer::new()
            .u8(self.staged as u8)
            .u64(self.geo.slots as u64)
            .u64(self.geo.chunk as u64)
            .u64(self.geo.split as u64)
            .u64(self.geo.eager as u64)
            .u64(self.len)
            .u8(self.offered)
            .u64(self.ring_len)
            .finish()
    }

    /// Decodes a connect payload: a typed error for anything malformed, never a panic. (The
    /// values are the peer's claims: the receiver compares them with its own.)
    pub fn decode(payload: &[u8]) -> Result<ConnectMsg> {
        let mut r = crate::wire::Reader::new(payload, "connect");
        let staged = match r.u8()? {
            0 => false,
            1 => true,
            x => return Err(CommError::Protocol(format!("connect: channel kind {x}"))),
        };
        let mut word = || -> Result<usize> {
            usize::try_from(r.u64()?)
                .map_err(|_| CommError::Protocol("connect: a size past usize".into()))
        };
        let geo = Geometry {
            slots: word()?,
            chunk: word()?,
            split: word()?,
            eager: word()?,
        };
        let len = r.u64()?;
        let offered = r.u8()?;
        let ring_len = r.u64()?;
        r.end()?;
        Ok(ConnectMsg {
            staged,
            geo,
            len,
            offered,
            ring_len,
        })
    }
}

/// One mapped channel.
#[derive(Debug)]
pub struct Channel {
    seg: ShmSegment,
    geo: Geometry,
    /// Eager messages up to [`EAGER_INLINE`] travel inside their descriptor; off for a
    /// stream-ordered pair (`transport::streamed`), whose receiving stream copies out of the
    /// slot without knowing the size in advance. Both ends set it the same way.
    inline: std::sync::atomic::AtomicBool,
}

// SAFETY: all cross-thread access to the mapping goes through atomics or through descriptor and
// slot bytes whose ownership the counters hand over (see the module docs).
unsafe impl Send for Channel {}
// SAFETY: as above.
unsafe impl Sync for Channel {}

impl Channel {
    /// Creates a channel segment (receiver side).
    pub fn create(geo: Geometry) -> Result<Self> {
        let seg = ShmSegment::create("flagcx-channel", geo.len())?;
        Ok(Channel::of(seg, geo))
    }

    /// Maps a channel segment received from the receiver (sender side).
    pub fn open(seg: ShmSegment, geo: Geometry) -> Result<Self> {
        if seg.len() < geo.len() {
            return Err(CommError::Protocol("channel segment is too small".into()));
        }
        Ok(Channel::of(seg, geo))
    }

    fn of(seg: ShmSegment, geo: Geometry) -> Self {
        Channel {
            seg,
            geo,
            inline: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// Keeps every eager message in its slot, none inside its descriptor (both ends of a
    /// stream-ordered pair call it before any traffic).
    pub fn keep_out_of_descriptors(&self) {
        self.inline.store(false, Ordering::Relaxed);
    }

    /// Eager messages up to this size go inside their descriptor.
    fn inline_max(&self) -> usize {
        match self.inline.load(Ordering::Relaxed) {
            true => EAGER_INLINE,
            false => 0,
        }
    }

    /// Bytes from the segment's start to the staging ring: counters, descriptors and eager
    /// slots — what a stream-ordered pair registers with its runtime.
    pub fn head_len(&self) -> usize {
        self.geo.ring()
    }

    /// Offset of counter `c` in the segment.
    pub fn counter_offset(c: Counter) -> usize {
        c as usize
    }

    /// Offset of send descriptor `i`'s size word.
    pub fn send_size_offset(&self, i: u64) -> usize {
        desc_offset(self.geo.send_descs(), i)
    }

    /// Offset of receive descriptor `i`'s taken word (past the bytes the sender reads): a
    /// stream-ordered take writes `i + 1` there once the message is in the receive buffer.
    pub fn recv_taken_offset(&self, i: u64) -> usize {
        desc_offset(self.geo.recv_descs(), i) + RECV_DESC_BYTES
    }

    /// Offset of late-copy word `w` of message `i` (in its receive descriptor).
    pub fn late_offset(&self, i: u64, w: LateWord) -> usize {
        self.recv_taken_offset(i) + 8 + 8 * w as usize
    }

    /// Late-copy word `w` of message `i`, as an atomic (streams of both ranks write some).
    pub fn late_word(&self, i: u64, w: LateWord) -> &AtomicU64 {
        // SAFETY: `late_offset` lies inside receive descriptor `i % 64` (asserted above), 8-byte
        // aligned in the page-aligned mapping, which outlives `self`.
        unsafe { &*(self.seg.as_ptr().add(self.late_offset(i, w)) as *const AtomicU64) }
    }

    /// Sender: publishes record `n` of the freed ring, an allocation of this rank that it freed
    /// and that the receiver may still map, then [`Counter::Freed`] `= n + 1`. The caller
    /// checked that the receiver acted on record `n - FREED_RING`.
    pub fn publish_freed(&self, n: u64, span: Span) {
        let [base, len] = self.freed_words(n);
        base.store(span.base, Ordering::Relaxed);
        len.store(span.len, Ordering::Relaxed);
        self.store(Counter::Freed, n + 1);
    }

    /// Receiver: record `n` of the freed ring (after seeing [`Counter::Freed`] `> n`).
    pub fn freed(&self, n: u64) -> Span {
        let [base, len] = self.freed_words(n);
        Span {
            base: base.load(Ordering::Relaxed),
            len: len.load(Ordering::Relaxed),
        }
    }

    fn freed_words(&self, n: u64) -> [&AtomicU64; 2] {
        let at = FREED_AT + (n % FREED_RING) as usize * 16;
        // SAFETY: inside the control page (asserted at `FREED_AT`), 8-byte aligned in the
        // page-aligned mapping, which outlives `self`; both ranks access it atomically.
        [at, at + 8].map(|o| unsafe { &*(self.seg.as_ptr().add(o) as *const AtomicU64) })
    }

    /// Late-copy pairs: claims message `i` for this side (`sender`: the sending side) after it
    /// published its descriptor. True when this side came first (its stream then waits for the
    /// peer's copy); false when the peer's claim of `i`, or of a later message, is there (this
    /// side then copies, with the peer's descriptor, published before that claim). Each side
    /// claims its messages once each, in order, so a claim of `i` or later by the peer means it
    /// posted `i` before this side did.
    pub fn claim(&self, i: u64, sender: bool) -> bool {
        let mine = (i + 1) << 1 | sender as u64;
        let word = self.counter(Counter::Claim);
        let mut seen = word.load(Ordering::Acquire);
        loop {
            if seen >> 1 > i {
                return false;
            }
            match word.compare_exchange(seen, mine, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => seen = now,
            }
        }
    }

    /// Receiver: whether the stream-ordered take of message `i` (or of a later message of
    /// the same descriptor slot, which cannot come before it) wrote its taken word.
    pub fn taken(&self, i: u64) -> bool {
        let at = self
            .desc_ptr(self.geo.recv_descs(), i)
            .wrapping_add(RECV_DESC_BYTES);
        // SAFETY: bytes 128..136 of a 256-byte descriptor, 8-byte aligned in the mapping, which
        // outlives `self`; the device writes it, so it is read atomically.
        unsafe { &*(at as *const AtomicU64) }.load(Ordering::Acquire) > i
    }

    /// Offset of send descriptor `i`'s status word, which names the status and `i + 1`.
    pub fn send_status_offset(&self, i: u64) -> usize {
        self.send_size_offset(i) + 8
    }

    /// Offset of eager slot `i`.
    pub fn eager_slot_offset(&self, i: u64) -> usize {
        self.geo.lane() + (i % DESC_RING) as usize * self.geo.eager
    }

    /// The status word that publishes send descriptor `i` with `status`: the status in the low
    /// byte, `i + 1` above it, so every use of a descriptor slot stores a larger word than the
    /// one before (a stream may wait for it with `Geq`).
    pub fn status_word(status: SendStatus, i: u64) -> u64 {
        status.word() | ((i + 1) << 8)
    }

    /// The segment (for its descriptor).
    pub fn segment(&self) -> &ShmSegment {
        &self.seg
    }

    /// The geometry.
    pub fn geometry(&self) -> Geometry {
        self.geo
    }

    fn counter(&self, c: Counter) -> &AtomicU64 {
        // SAFETY: the control page is inside the mapping, 64-byte aligned offsets of a
        // page-aligned mapping; the mapping outlives `self`.
        unsafe { &*(self.seg.as_ptr().add(c as usize) as *const AtomicU64) }
    }

    /// Reads a counter (acquire).
    pub fn load(&self, c: Counter) -> u64 {
        self.counter(c).load(Ordering::Acquire)
    }

    /// Publishes a counter (release).
    pub fn store(&self, c: Counter, v: u64) {
        self.counter(c).store(v, Ordering::Release)
    }

    /// Descriptor `i` of the ring at `base` (both rings have `DESC_BYTES` descriptors).
    fn desc_ptr(&self, base: usize, i: u64) -> *mut u8 {
        // SAFETY: `i % DESC_RING` keeps the offset inside the descriptor area of the mapping.
        unsafe { self.seg.as_ptr().add(desc_offset(base, i)) }
    }

    fn write_desc<const N: usize>(&self, base: usize, i: u64, b: [u8; N]) {
        const { assert!(N <= DESC_BYTES) };
        // SAFETY: the descriptor slot is inside the mapping and owned by the writer until it
        // publishes the counter; `N` is at most its size.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.desc_ptr(base, i), N) }
    }

    fn read_desc<const N: usize>(&self, base: usize, i: u64) -> [u8; N] {
        const { assert!(N <= DESC_BYTES) };
        let mut b = [0u8; N];
        // SAFETY: inside the mapping (`N` is at most the descriptor size); published by the
        // writer's release store, which the caller's acquire load of the counter observed.
        unsafe { std::ptr::copy_nonoverlapping(self.desc_ptr(base, i), b.as_mut_ptr(), N) }
        b
    }

    /// Writes receive descriptor `i` (receiver, before publishing `RecvPosted`).
    pub fn write_recv_desc(&self, i: u64, d: &RecvDesc) {
        let mut b = encode_desc::<RECV_DESC_BYTES>(d.size, d.offset, d.handle, d.span);
        b[RECV_DESC_BYTES - 1] = d.chunks as u8;
        self.write_desc(self.geo.recv_descs(), i, b);
    }

    /// Reads receive descriptor `i` (sender, after seeing `RecvPosted > i`).
    pub fn read_recv_desc(&self, i: u64) -> Result<RecvDesc> {
        RecvDesc::decode(&self.read_desc::<RECV_DESC_BYTES>(self.geo.recv_descs(), i))
    }

    /// Writes send descriptor `i` (sender, before publishing `SendPosted`).
    pub fn write_send_desc(&self, i: u64, d: &SendDesc) {
        let mut b = encode_desc::<SEND_DESC_BYTES>(d.size, d.status.word(), d.handle, d.span);
        b[SEND_DESC_BYTES - 8..].copy_from_slice(&d.offset.to_le_bytes());
        let p = self.desc_ptr(self.geo.send_descs(), i);
        // SAFETY: the descriptor is inside the mapping and the writer's until it publishes
        // the counter. The status word (bytes 8..16) is stored atomically: an eager receiver
        // may be polling it (see `eager_arrived`); every other byte is read only after the
        // counter says the descriptor is complete.
        unsafe {
            std::ptr::copy_nonoverlapping(b.as_ptr(), p, 8);
            std::ptr::copy_nonoverlapping(b[16..].as_ptr(), p.add(16), SEND_DESC_BYTES - 16);
        }
        self.eager_word(i)
            .store(Channel::status_word(d.status, i), Ordering::Release);
    }

    /// Reads send descriptor `i` (receiver, after seeing `SendPosted > i`).
    pub fn read_send_desc(&self, i: u64) -> Result<SendDesc> {
        // An eager descriptor is its first 16 bytes (the rest of the line is its payload).
        let word = self.eager_word(i).load(Ordering::Acquire);
        if word & 0xFF == SendStatus::Eager.word() {
            return self.eager_arrived(i).ok_or_else(|| {
                CommError::Protocol(format!(
                    "eager descriptor {i} carries message number {}",
                    (word >> 8).wrapping_sub(1)
                ))
            });
        }
        SendDesc::decode(
            &self.read_desc::<SEND_DESC_BYTES>(self.geo.send_descs(), i),
            i,
        )
    }

    /// Whether descriptor slot `i` of either ring (and eager slot `i`) may be written: the
    /// receiver finished message `i - 64`, the last one to use it.
    pub fn window_open(&self, i: u64) -> bool {
        i < self.load(Counter::RecvDone) + DESC_RING
    }

    /// Sender: copies `n` bytes at `src` into eager slot `i` and publishes them as send
    /// descriptor `i` (`SendPosted = i + 1`).
    ///
    /// # Safety
    /// `src..src+n` is readable (`src` may be null when `n` is 0) and `n <= geometry().eager`;
    /// the caller owns send index `i`:
    /// every earlier send was answered and [`Channel::window_open`] holds for `i`.
    pub unsafe fn post_eager(&self, i: u64, src: *const u8, n: usize) {
        debug_assert!(n <= self.geo.eager);
        let desc = self.desc_ptr(self.geo.send_descs(), i);
        let dst = if n <= self.inline_max() {
            // SAFETY: a descriptor holds 16 + `EAGER_INLINE` bytes.
            unsafe { desc.add(16) }
        } else {
            self.eager_slot(i)
        };
        if n > 0 {
            // SAFETY: the descriptor and slot `i % DESC_RING` of the lane lie inside the
            // mapping and are the writer's until it publishes the counter (the caller's
            // contract); `src` is readable and `n` fits either place. (A zero-byte message may
            // come with a null `src`, which no copy may be given.)
            unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
        }
        self.write_desc(self.geo.send_descs(), i, (n as u64).to_le_bytes());
        self.eager_word(i).store(
            Channel::status_word(SendStatus::Eager, i),
            Ordering::Release,
        );
        self.store(Counter::SendPosted, i + 1);
    }

    /// Receiver: copies eager message `i` (described by `sd`, which said `SendStatus::Eager`) to
    /// `dst` and returns its size. A size beyond the eager slots is a protocol error.
    ///
    /// # Safety
    /// `dst..dst+sd.size` is writable memory nothing else touches (`dst` may be null when the
    /// size is 0); `sd` was read after the message was published.
    pub unsafe fn take_eager(&self, i: u64, sd: &SendDesc, dst: *mut u8) -> Result<usize> {
        let n = sd.size as usize;
        if n > self.geo.eager {
            return Err(CommError::Protocol(format!(
                "an eager message of {n} bytes in {}-byte slots",
                self.geo.eager
            )));
        }
        let src = if n <= self.inline_max() {
            // SAFETY: as in `post_eager`.
            unsafe { self.desc_ptr(self.geo.send_descs(), i).add(16) }
        } else {
            self.eager_slot(i)
        };
        if n > 0 {
            // SAFETY: `src` lies inside the mapping and holds `n` bytes the sender published
            // before the counter our caller observed; `dst` is writable (the caller's
            // contract; a zero-byte receive may have a null one, never given to a copy).
            unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
        }
        Ok(n)
    }

    /// Receiver: eager message `i`'s descriptor if it has been published (its status word
    /// names message `i`), without touching `SendPosted`.
    pub fn eager_arrived(&self, i: u64) -> Option<SendDesc> {
        if self.eager_word(i).load(Ordering::Acquire) != Channel::status_word(SendStatus::Eager, i)
        {
            return None;
        }
        let head = self.read_desc::<8>(self.geo.send_descs(), i);
        Some(SendDesc {
            size: u64::from_le_bytes(head),
            status: SendStatus::Eager,
            handle: None,
            offset: 0,
            span: Span::default(),
        })
    }

    /// Whether send descriptor `i` has been published, in any form (its status word names
    /// message `i`).
    pub fn published(&self, i: u64) -> bool {
        self.eager_word(i).load(Ordering::Acquire) >> 8 == i + 1
    }

    /// Sender: whether a stream-ordered put wrote send descriptor `i`'s status word (after its
    /// last read of the source: [`flagcx_adaptor::SlotStep::Put`]) — or a later message of
    /// the same descriptor slot did, which waited until message `i` was received. A word the
    /// receiver wrote to fail message `i` does not count.
    pub fn put_landed(&self, i: u64) -> bool {
        let word = self.eager_word(i).load(Ordering::Acquire);
        let n = word >> 8;
        n > i + 1 || (n == i + 1 && word & 0xFF == SendStatus::Eager.word())
    }

    /// Receiver, for a pair that is lost or retired: publishes send descriptor `i` as failed
    /// with a size no receive takes, which releases a stream waiting for it (see
    /// `transport::streamed`) and makes its sized copy copy nothing.
    pub fn poison_send_desc(&self, i: u64) {
        let size = self.desc_ptr(self.geo.send_descs(), i) as *const AtomicU64;
        // SAFETY: the size word is the descriptor's first 8 bytes, 8-byte aligned in the mapping.
        unsafe { &*size }.store(u64::MAX, Ordering::Relaxed);
        self.eager_word(i).store(
            Channel::status_word(SendStatus::SenderFailed, i),
            Ordering::Release,
        );
    }

    /// The status word of send descriptor `i` (bytes 8..16), as an atomic.
    fn eager_word(&self, i: u64) -> &AtomicU64 {
        // SAFETY: descriptors are 256-byte aligned inside the page-aligned mapping, so bytes
        // 8..16 of one are an aligned u64 that outlives `self`; every access to it that can
        // race (the eager status word) is atomic.
        unsafe { &*(self.desc_ptr(self.geo.send_descs(), i).add(8) as *const AtomicU64) }
    }

    fn eager_slot(&self, i: u64) -> *mut u8 {
        // SAFETY: `i % DESC_RING` slots of `eager` bytes each lie inside the lane.
        unsafe { self.seg.as_ptr().add(self.eager_slot_offset(i)) }
    }

    /// The data slots (staged channels): base pointer and total length.
    pub fn ring(&self) -> (*mut u8, usize) {
        // SAFETY: the ring follows the descriptors inside the mapping.
        (
            unsafe { self.seg.as_ptr().add(self.geo.ring()) },
            self.geo.slots * self.geo.chunk,
        )
    }

    /// Host address of slot `chunk % slots`.
    pub fn slot(&self, chunk: u64) -> *mut u8 {
        let (base, _) = self.ring();
        // SAFETY: `chunk % slots` is a valid slot index; slots are `chunk` bytes.
        unsafe { base.add((chunk % self.geo.slots as u64) as usize * self.geo.chunk) }
    }
}

#[cfg(test)]
mod tests;
