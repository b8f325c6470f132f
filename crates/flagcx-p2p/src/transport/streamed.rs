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

use std::sync::Arc;

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, SlotInbox, SlotStep, StreamHandle};

use super::{remote_failure, send_failure, Phase, Progress, Roles, Step};
use crate::channel::{Channel, Counter, SendStatus, DESC_RING};
use crate::comm::Comm;
use crate::config::HostDirect;
use crate::engine::Engine;
use crate::error::{CommError, Result};
use crate::op::{Dir, Op, Resume};
use crate::peer::{PeerInfo, TransportKind};
use crate::shared::Path;

/// The largest stream-ordered message: small messages are what needs no host; above this the
/// handshake's single copy wins anyway.
pub(crate) const STREAMED_MAX: usize = 32 << 10;

/// How long a release waits for the stream to pass the released operation.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// What `recv_done` is set to when a lost peer's sender-side waits must end.
const RELEASED: u64 = u64::MAX >> 2;

/// Whether the pair of `me` and `peer` sends its small messages stream-ordered (both ranks
/// compute the same answer from the all-gathered peer information).
pub(crate) fn allowed(
    me: &PeerInfo,
    peer: &PeerInfo,
    transport: Option<TransportKind>,
    roles: &Roles,
) -> bool {
    let able = |x: &PeerInfo| x.caps.stream_mem_ops_64 && x.caps.host_register && x.caps.sized_copy;
    let pair_ok = matches!(
        transport,
        Some(TransportKind::Ipc) | Some(TransportKind::Staged)
    ) && *roles == Roles::default();
    let wanted = match (me.streamed, peer.streamed) {
        (HostDirect::Off, _) | (_, HostDirect::Off) => false,
        (HostDirect::On, _) | (_, HostDirect::On) => true,
        // Not chosen by default until it is measured where it is meant to win (one rank per
        // GPU): on one H200, two ranks sharing the GPU, it loses to the posting threads' paths.
        _ => false,
    };
    pair_ok && wanted && able(me) && able(peer)
}

/// The bytes between two slots of an inbox whose messages are at most `max` bytes.
fn inbox_stride(max: usize) -> usize {
    max.max(1).next_multiple_of(256)
}

/// How large an inbox for messages of at most `max` bytes is: a 64-byte line of words per
/// descriptor (status, then length), then one slot per descriptor.
fn inbox_len(max: usize) -> usize {
    DESC_RING as usize * (64 + inbox_stride(max))
}

/// Message `k`'s place in the inbox at `base`.
fn inbox_at(base: DevicePtr, max: usize, k: u64) -> SlotInbox {
    let i = (k % DESC_RING) as usize;
    let at = |off: usize| DevicePtr(base.0 + off as u64);
    SlotInbox {
        slot: at(DESC_RING as usize * 64 + i * inbox_stride(max)),
        len_at: at(64 * i + 8),
        status: at(64 * i),
    }
}

/// Whether the stream-ordered pair of `me` and `peer` gets inboxes (both ranks compute the
/// same answer): IPC pairs whose devices are not host memory — their takes would
/// otherwise poll host memory across the bus (`slot_pingpong`: 48 µs per round trip with the
/// slots there, 15 µs with them in device memory, on one H200).
pub(crate) fn wants_inbox(
    me: &PeerInfo,
    peer: &PeerInfo,
    transport: Option<TransportKind>,
) -> bool {
    // Pairs sharing a device get them too (they enqueue as separate stream operations by
    // default, which leave inboxes alone, but `FLAGCX_P2P_STREAM_KERNEL=on` is per rank).
    transport == Some(TransportKind::Ipc)
        && !me.caps.host_addressable
        && !peer.caps.host_addressable
}

/// One pair's stream-ordered link: both channels, as the host and this rank's runtime see them.
pub(crate) struct StreamLink {
    pub out: Arc<Channel>,
    pub inc: Arc<Channel>,
    /// The device-visible alias of each channel's registered head.
    out_dev: DevicePtr,
    inc_dev: DevicePtr,
    /// The largest message each way (the channel's eager slot, at most [`STREAMED_MAX`]).
    pub send_max: usize,
    pub recv_max: usize,
    /// This rank's inbox for the pair's messages to it (device memory, see
    /// [`StreamLink::connect_inboxes`]), and the peer's inbox as mapped here for messages to
    /// it; `None` where the pair has none.
    inbox_in: Option<DevicePtr>,
    inbox_out: Option<DevicePtr>,
    /// Whether a call's steps may run as the vendor's one operation (a kernel on CUDA): by
    /// default not where both ranks share a device (`FLAGCX_P2P_STREAM_KERNEL`). Two processes on one GPU take turns at it, and a
    /// kernel that spins for its message holds the GPU for a whole time slice (on one H200,
    /// 2250 µs per 8 B sendrecv, against 180 µs as separate stream operations, which wait
    /// without an SM).
    fused: bool,
}

impl StreamLink {
    /// Registers both channels' heads with `a` (eager data stays out of the descriptors from
    /// now on, on both ends).
    pub(crate) fn register<A: DeviceAdaptor>(
        a: &A,
        out: &Arc<Channel>,
        inc: &Arc<Channel>,
        fused: bool,
    ) -> Result<Self> {
        out.keep_out_of_descriptors();
        inc.keep_out_of_descriptors();
        // SAFETY: the channel's mapping outlives the registration, which `release` undoes
        // before the communicator drops its channels.
        let out_dev = unsafe { a.host_register(out.segment().as_ptr(), out.head_len()) }?;
        // SAFETY: as above.
        let inc_dev = match unsafe { a.host_register(inc.segment().as_ptr(), inc.head_len()) } {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: registered just above, unused.
                let _ = unsafe { a.host_unregister(out.segment().as_ptr()) };
                return Err(e.into());
            }
        };
        Ok(StreamLink {
            out: out.clone(),
            inc: inc.clone(),
            out_dev,
            inc_dev,
            send_max: out.geometry().eager.min(STREAMED_MAX),
            recv_max: inc.geometry().eager.min(STREAMED_MAX),
            fused,
            inbox_in: None,
            inbox_out: None,
        })
    }

    /// Undoes [`StreamLink::register`] and [`StreamLink::connect_inboxes`].
    pub(crate) fn release<A: DeviceAdaptor>(&self, a: &A) {
        if let Some(p) = self.inbox_out {
            // SAFETY: the engine is gone; no stream of this rank puts into it any more.
            let _ = unsafe { a.ipc_close(p) };
        }
        if let Some(p) = self.inbox_in {
            // SAFETY: as above; our takes are done with it.
            let _ = unsafe { a.mem_free(p) };
        }
        for ch in [&self.out, &self.inc] {
            // SAFETY: the engine is gone and released every stream that waited on the words.
            let _ = unsafe { a.host_unregister(ch.segment().as_ptr()) };
        }
    }

    /// Gives the links of the peers in `wants` (see [`wants_inbox`]) their inboxes: each rank
    /// allocates one in its device memory for the messages it receives from such a peer,
    /// zeroed, and sends the peer its IPC handle (an empty frame where it has none); each maps
    /// the peer's. A side that could not make or map one goes without it (its puts write the
    /// slot only, its takes wait on the slot's words), so the pair needs no agreement on it.
    pub(crate) fn connect_inboxes<A: DeviceAdaptor>(
        a: &A,
        boot: &crate::bootstrap::Bootstrap,
        links: &mut [Option<StreamLink>],
        wants: &[bool],
    ) -> Result<()> {
        let peers: Vec<usize> = (0..links.len())
            .filter(|&q| wants[q] && links[q].is_some())
            .collect();
        for &q in &peers {
            let link = links[q].as_mut().expect("filtered above");
            let len = inbox_len(link.recv_max);
            let made = a.mem_alloc(len).and_then(|p| {
                let zeroed = a.stream_create().and_then(|st| {
                    // SAFETY: `p` holds `len` bytes, synchronized before use.
                    let r = unsafe { a.memset_async(p, 0, len, st) }
                        .and_then(|()| a.stream_synchronize(st));
                    let _ = a.stream_destroy(st);
                    r
                });
                match zeroed.and_then(|()| a.ipc_get_handle(p)) {
                    Ok(h) => Ok((p, h)),
                    Err(e) => {
                        // SAFETY: allocated above, used by nothing.
                        let _ = unsafe { a.mem_free(p) };
                        Err(e)
                    }
                }
            });
            let wire = match made {
                Ok((p, h)) => {
                    link.inbox_in = Some(p);
                    h.to_wire().to_vec()
                }
                Err(e) => {
                    tracing::debug!(peer = q, "no stream-ordered inbox: {e}");
                    Vec::new()
                }
            };
            boot.send(q, crate::wire::Tag::Inbox, &wire, &[])?;
        }
        for &q in &peers {
            let (wire, _) = boot.recv(q, crate::wire::Tag::Inbox)?;
            if wire.is_empty() {
                continue;
            }
            let link = links[q].as_mut().expect("filtered above");
            match flagcx_adaptor::IpcMemHandle::from_wire(&wire).and_then(|h| a.ipc_open_handle(&h))
            {
                Ok(p) => link.inbox_out = Some(p),
                Err(e) => tracing::debug!(peer = q, "the peer's stream-ordered inbox: {e}"),
            }
        }
        Ok(())
    }

    /// The channel carrying messages of `dir` (this rank's sends: `out`).
    pub(crate) fn channel(&self, dir: Dir) -> &Channel {
        match dir {
            Dir::Send => &self.out,
            Dir::Recv => &self.inc,
        }
    }

    /// Late-copy word `w` of message `k` in direction `dir`, as this rank's streams reach it.
    pub(crate) fn device_word(&self, dir: Dir, k: u64, w: crate::channel::LateWord) -> DevicePtr {
        let base = match dir {
            Dir::Send => self.out_dev,
            Dir::Recv => self.inc_dev,
        };
        Self::at(base, self.channel(dir).late_offset(k, w))
    }

    /// Whether a message of `bytes` in direction `dir` takes this path.
    pub(crate) fn takes(&self, dir: Dir, bytes: usize) -> bool {
        bytes
            <= match dir {
                Dir::Send => self.send_max,
                Dir::Recv => self.recv_max,
            }
    }

    fn at(base: DevicePtr, offset: usize) -> DevicePtr {
        DevicePtr(base.0 + offset as u64)
    }

    /// Message `k`'s side in direction `dir`, as one step for
    /// [`DeviceAdaptor::stream_slot_steps`] (the table in the module docs).
    pub(crate) fn step(&self, dir: Dir, k: u64, ptr: DevicePtr, bytes: usize) -> SlotStep {
        match dir {
            Dir::Send => {
                let (ch, base) = (&self.out, self.out_dev);
                let wait = (k >= DESC_RING).then(|| {
                    (
                        Self::at(base, Channel::counter_offset(Counter::RecvDone)),
                        k + 1 - DESC_RING,
                    )
                });
                let offset = ch.eager_slot_offset(k);
                SlotStep::Put {
                    wait,
                    src: ptr,
                    len: bytes,
                    slot_host: {
                        // SAFETY: eager slot `k` lies within the channel's mapping.
                        unsafe { ch.segment().as_ptr().add(offset) }
                    },
                    slot: Self::at(base, offset),
                    writes: [
                        (Self::at(base, ch.send_size_offset(k)), bytes as u64),
                        (
                            Self::at(base, ch.send_status_offset(k)),
                            Channel::status_word(SendStatus::Eager, k),
                        ),
                    ],
                    inbox: self.inbox_out.map(|b| inbox_at(b, self.send_max, k)),
                }
            }
            Dir::Recv => {
                let (ch, base) = (&self.inc, self.inc_dev);
                SlotStep::Take {
                    wait: (Self::at(base, ch.send_status_offset(k)), (k + 1) << 8),
                    slot: Self::at(base, ch.eager_slot_offset(k)),
                    len_at: Self::at(base, ch.send_size_offset(k)),
                    dst: ptr,
                    cap: bytes,
                    inbox: self.inbox_in.map(|b| inbox_at(b, self.recv_max, k)),
                    done: Some((Self::at(base, ch.recv_taken_offset(k)), k + 1)),
                }
            }
        }
    }

    /// Ends every wait of message `k`'s side that the peer would have satisfied: a receive's
    /// status word gets a failure status and a size no receive takes; a send's `recv_done`
    /// jumps far ahead, after the pair is marked retired. Only for a pair that is lost or being
    /// given up (the words are the peer's).
    pub(crate) fn release_side(out: &Channel, inc: &Channel, dir: Dir, k: u64) {
        match dir {
            Dir::Send => {
                // The released stream copies into slots the peer may not have read: the pair
                // is retired first, so a peer still running fails those messages instead of
                // taking overwritten ones.
                out.store(Counter::SendFault, crate::channel::RETIRED);
                out.store(Counter::RecvDone, RELEASED);
            }
            Dir::Recv => inc.poison_send_desc(k),
        }
    }
}

impl<A: DeviceAdaptor> Comm<A> {
    /// The stream-ordered link with `peer`, if a message of `bytes` in direction `dir` takes it.
    pub(crate) fn streamed_link(&self, peer: usize, dir: Dir, bytes: usize) -> Option<&StreamLink> {
        self.streamed
            .get(peer)
            .and_then(|l| l.as_ref())
            .filter(|l| l.takes(dir, bytes))
    }

    /// Enqueues the stream-ordered messages `msgs` — (link, direction, number, buffer, bytes)
    /// each — on `stream` in one call of [`DeviceAdaptor::stream_slot_steps`] (one kernel on
    /// CUDA; as separate stream operations where a pair shares its device), or fails (after
    /// which no wait of theirs is left on the stream). No event is recorded: a send is done
    /// once its status word landed, a receive once its taken word did — the posting thread
    /// makes one call, and the engine follows with loads of host memory, no driver calls.
    /// Sends go first in the call: done in order, a receive ahead of them would wait for a
    /// peer whose receive waits the same way (a group that posts its receives first, on both
    /// ranks).
    ///
    /// # Safety
    /// Each buffer is device memory of this adaptor, valid until its operation finishes.
    pub(crate) unsafe fn enqueue_streamed(
        &self,
        msgs: &[(&StreamLink, Dir, u64, DevicePtr, usize)],
        stream: StreamHandle,
    ) -> Result<()> {
        let steps: Vec<SlotStep> = msgs
            .iter()
            .map(|&(link, dir, k, ptr, bytes)| link.step(dir, k, ptr, bytes))
            .collect();
        let a = &self.adaptor;
        // SAFETY: forwarded contract; each link's words and slots are registered and live.
        let r = unsafe {
            match msgs.iter().all(|m| m.0.fused) {
                true => a.stream_slot_steps(stream, &steps),
                false => flagcx_adaptor::slot_steps_in_order(a, stream, &steps),
            }
        };
        match r {
            Ok(()) => Ok(()),
            Err(e) => {
                // Whatever part went in must not wait for good: the pairs are retired by the
                // engine for this failure, so their words are ours to settle.
                for &(link, dir, k, ..) in msgs {
                    StreamLink::release_side(&link.out, &link.inc, dir, k);
                }
                Err(e.into())
            }
        }
    }
}

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
        // Late copies' streams wait on words of the same pair's descriptors.
        self.release_late(op);
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
