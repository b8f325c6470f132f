//! A stream-ordered pair's state (`StreamLink`: the channels' registered heads and the inbox) and
//! which pairs take the path; enqueuing and progress are [`crate::transport::streamed`]'s.

use std::sync::{Arc, Mutex};

use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{DeviceAdaptor, DevicePtr, SlotInbox, SlotStep};

use super::named::Named;
use super::Roles;
use crate::channel::{Channel, Counter, SendStatus, DESC_RING};
use crate::config::HostDirect;
use crate::error::Result;
use crate::op::Dir;
use crate::peer::{PeerInfo, TransportKind};

/// The largest stream-ordered message: small messages are what needs no host; above this the
/// handshake's single copy wins anyway.
pub(crate) const STREAMED_MAX: usize = 32 << 10;

/// How long a release waits for the stream to pass the released operation.
pub(crate) const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

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
    pub(crate) fused: bool,
    /// Late-copy pairs: the allocations this rank named to the peer (see `link::named`).
    named: Mutex<Named>,
    /// Late-copy pairs: whether [`StreamLink::may_name`] consults `named`
    /// (`Config::late_naming`); else every buffer is named as it is.
    pub(crate) naming: bool,
}

impl StreamLink {
    /// Late-copy pairs: whether the buffer `e` exports may be named to the peer for this
    /// message, or it must take a stand-in (see `link::named`). Without a handle there is
    /// nothing to map.
    pub(crate) fn may_name(&self, e: &super::Exported) -> bool {
        let Some(h) = e.handle.as_ref().filter(|_| self.naming) else {
            return true;
        };
        let unmapped = self.out.load(Counter::Unmapped);
        lock(&self.named).name(e.span, h, e.buffer_id, unmapped, |n, s| {
            tracing::debug!(
                "freed allocation {:#x} ({} bytes) published as record {n} (the peer unmapped \
                 {unmapped})",
                s.base,
                s.len
            );
            self.out.publish_freed(n, s)
        })
    }

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
            named: Mutex::default(),
            naming: false,
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
