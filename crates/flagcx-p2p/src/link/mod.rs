//! What a pair of ranks keeps per transport, below the engine and `Comm` that hold it: the
//! pair's connection ([`PeerConn`]: channels, queues of [`Step`]s, ring cursors), each step's
//! [`Phase`], and every transport's own state (eager links, IPC caller links, stream-ordered
//! links, the network's endpoints, device rings, the direct path's mapped buffers) with the
//! helpers that need neither. The protocols that move bytes — the posting threads' `impl Comm`
//! and the engine's `impl Engine` sides — are [`crate::transport`]'s, one module per transport.

pub(crate) mod devring;
pub(crate) mod eager;
pub(crate) mod hostmap;
pub(crate) mod ipc;
pub(crate) mod named;
pub(crate) mod net;
pub(crate) mod staged;
pub(crate) mod streamed;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, EventHandle, IpcMemHandle};

use crate::channel::{Channel, Counter, RecvDesc, SendDesc, SendStatus, Span, RETIRED};
use crate::error::{CommError, Result};
use crate::op::{Dir, Op, Resume};
use crate::peer::TransportKind;
use crate::shared::{Path, Shared};
use net::NetPhase;
use staged::Cursor;

/// Who copies on a pair (see [`crate::peer::receiver_copies`] and
/// [`crate::peer::direct_copier`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Roles {
    /// The peer pulls what this rank sends (it is the pair's copier).
    pub peer_pulls: bool,
    /// This rank pulls what the peer sends (this rank is the pair's copier).
    pub we_pull: bool,
    /// Staged pair, direct path: this rank maps the peer's buffers and copies.
    pub maps_peer: bool,
    /// Staged pair, direct path: the peer maps this rank's buffers, so receives announce them.
    pub peer_maps: bool,
}

/// Both directions of the link to one peer.
pub(crate) struct PeerConn {
    pub peer: usize,
    pub transport: TransportKind,
    /// This rank → peer (created by the peer); shared with the API side's eager path.
    pub out: Arc<Channel>,
    /// Peer → this rank (created here); shared with the API side's eager path.
    pub inc: Arc<Channel>,
    /// Whether both rings were pinned for the adaptor (`host_pin`; unpinned at teardown).
    pub registered: bool,
    /// Staged pairs: the ring in device memory both ranks map, where they have one; messages
    /// from `devring::MIN_BYTES` use its slots, smaller ones the host ring's.
    pub(crate) dev_ring: Option<devring::DevRing>,
    /// Who copies.
    pub roles: Roles,
    pub(crate) sends: VecDeque<Step>,
    pub(crate) recvs: VecDeque<Step>,
    /// Staged pairs: where each direction stands in its ring.
    pub(crate) send_ring: Cursor,
    pub(crate) recv_ring: Cursor,
    pub(crate) lost: Option<String>,
    /// Both ranks use one physical device ([`crate::peer::PeerInfo::shares_device`]).
    pub shares_device: bool,
    /// Late-copy pairs: the records of the peer's freed ring (`link::named`) this rank read,
    /// and how many of them it told the peer it acted on.
    pub(crate) freed_seen: u64,
    pub(crate) freed_told: u64,
}

impl PeerConn {
    pub fn new(
        peer: usize,
        transport: TransportKind,
        out: Arc<Channel>,
        inc: Arc<Channel>,
        registered: bool,
    ) -> Self {
        PeerConn {
            shares_device: false,
            freed_seen: 0,
            freed_told: 0,
            peer,
            transport,
            out,
            inc,
            registered,
            dev_ring: None,
            roles: Roles::default(),
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            send_ring: Cursor::default(),
            recv_ring: Cursor::default(),
            lost: None,
        }
    }

    /// Unpins the host rings and releases the device ring; once, at teardown or where setup
    /// fails.
    ///
    /// # Safety
    /// No copy of this rank's may still use either (its streams idle, or none ever issued),
    /// and nothing may use them afterwards.
    pub(crate) unsafe fn release_rings<A: DeviceAdaptor>(&self, adaptor: &A) {
        if self.registered {
            for ch in [&self.out, &self.inc] {
                // SAFETY: as the caller promises.
                let _ = unsafe { adaptor.host_unpin(ch.ring().0) };
            }
        }
        if let Some(r) = &self.dev_ring {
            // SAFETY: as above.
            unsafe { r.release(adaptor) };
        }
    }

    /// Sets who copies on this pair.
    pub fn with_roles(mut self, roles: Roles) -> Self {
        self.roles = roles;
        self
    }

    pub(crate) fn idle(&self) -> bool {
        self.sends.is_empty() && self.recvs.is_empty()
    }

    /// Whether the peer's message `index` waits in this rank's eager slot: published as an
    /// eager message, with nothing failed on this side's receive direction. Its sender was done
    /// with it when it posted it, so it is this rank's to take even after the peer closed or
    /// exited.
    pub(crate) fn eager_waiting(&self, index: u64) -> bool {
        self.inc.load(Counter::RecvFault) == 0
            && self.inc.load(Counter::SendPosted) > index
            && self
                .inc
                .read_send_desc(index)
                .is_ok_and(|sd| sd.status == SendStatus::Eager)
    }

    /// Retires the pair: its later operations fail, and the eager path stays off it.
    pub(crate) fn retire(&mut self, shared: &Shared, reason: String) {
        self.lost = Some(reason);
        shared.mark_lost(self.peer);
    }
}

/// One operation in progress.
pub(crate) struct Step {
    pub(crate) op: Op,
    pub(crate) index: u64,
    pub(crate) phase: Phase,
    /// The path the bytes take (decided per message on a direct-capable staged pair).
    pub(crate) path: Path,
    /// When the step last made progress (for `FLAGCX_TIMEOUT_MS`).
    pub(crate) progressed: Instant,
    /// When it was admitted, and when it matched its peer (a send saw the receive
    /// descriptor; a receive announced itself) — for `FLAGCX_PROFILE`.
    pub(crate) admitted: Instant,
    pub(crate) matched: Option<Instant>,
}

pub(crate) enum Phase {
    /// Sender: waiting for the matching receive descriptor.
    AwaitRecvDesc,
    /// Sender (IPC): the copy into the receiver's memory is in flight.
    Copying(EventHandle),
    /// Sender (IPC, the receiver pulls): waiting for the caller's stream, then offering the
    /// source buffer.
    Offer,
    /// Sender (IPC, the receiver pulls): waiting for the receiver's verdict after its copy.
    AwaitVerdict,
    /// Receiver: waiting to announce the receive (start event, descriptor window).
    Announce,
    /// Receiver: waiting for the sender's answer.
    AwaitSendDesc,
    /// Receiver (IPC, pulling): waiting for the sender's offer.
    AwaitOffer,
    /// Receiver (IPC, pulling): the copy out of the sender's memory is in flight.
    Pulling { ev: EventHandle, size: usize },
    /// Sender (IPC, the receiver pulls, no IPC handle for the buffer): the copy of the
    /// caller's buffer into its stand-in is in flight ([`crate::standin`]).
    ToStandIn(EventHandle),
    /// Receiver (IPC, the sender pushed into the stand-in): the copy of the `size` bytes from
    /// the stand-in into the caller's buffer is in flight ([`crate::standin`]).
    FromStandIn { ev: EventHandle, size: usize },
    /// Staged, either side: `total` bytes in chunks, `issued` of them issued so far.
    Chunks {
        total: usize,
        issued: usize,
        started: bool,
    },
    /// Net (a pair on two hosts), either side.
    Net(net::NetPhase),
    /// Stream-ordered ([`streamed`]), either side: the caller's stream carries the message,
    /// and writes the word that says it is done (a send's status word, a receive's taken
    /// word). A receive announces itself first.
    Streamed { announced: bool },
    /// Late copy ([`late`](crate::transport::late)), either side: the streams carry the message; `second`: this side
    /// posted second (its stream copies it).
    Late { second: bool },
}

impl Phase {
    /// The phase an operation starts in when the engine admits it: where a posting thread
    /// began it (`op.resume`, taken for a network request), the phase that follows; else the
    /// transport's first (a network pair's own, or the descriptor handshake's by who copies).
    /// A resume the pair's transport cannot have is a protocol error, never a panic.
    pub(crate) fn first(op: &mut Op, transport: TransportKind, roles: Roles) -> Result<Phase> {
        if transport == TransportKind::Net {
            // A net pair's phases are its own; a posting thread may have its UCX request
            // under way.
            return Ok(match op.resume.take() {
                Some(Resume::Net(req)) => Phase::Net(NetPhase::Wire { req, buf: None }),
                _ => Phase::Net(NetPhase::Start),
            });
        }
        let refused = |what: &str| {
            CommError::Protocol(format!(
                "operation {} with rank {} resumed as {what} on a {transport:?} pair",
                op.index, op.peer
            ))
        };
        Ok(
            match (&op.resume, op.dir, roles.peer_pulls, roles.we_pull) {
                (Some(Resume::Pushed(ev)), ..) => Phase::Copying(*ev),
                (Some(Resume::Pulled { ev, size }), ..) => Phase::Pulling {
                    ev: *ev,
                    size: *size,
                },
                (Some(Resume::Published), Dir::Send, ..) => Phase::AwaitVerdict,
                (Some(Resume::Published), Dir::Recv, ..) => Phase::AwaitSendDesc,
                (Some(Resume::Streamed), dir, ..) => Phase::Streamed {
                    announced: dir == Dir::Send,
                },
                (Some(Resume::Late { second, .. }), ..) => Phase::Late { second: *second },
                (Some(Resume::Failed(_)), ..) => {
                    return Err(refused("failed (the engine fails those first)"))
                }
                (Some(Resume::Net(_)), ..) => {
                    return Err(refused(
                        "a network request (only pairs on two hosts make one)",
                    ))
                }
                (None, Dir::Send, true, _) => Phase::Offer,
                (None, Dir::Send, false, _) => Phase::AwaitRecvDesc,
                (None, Dir::Recv, _, true) => Phase::AwaitOffer,
                (None, Dir::Recv, _, false) => Phase::Announce,
            },
        )
    }

    /// What a step in this phase waits for, in words (for [`CommError::Timeout`]).
    pub(crate) fn waiting_for(&self) -> String {
        match self {
            Phase::AwaitRecvDesc => "waiting for the peer to post the matching receive".into(),
            Phase::Copying(_) => "waiting for the copy into the peer's buffer".into(),
            Phase::Offer => "waiting for earlier work on the caller's stream".into(),
            Phase::AwaitVerdict => "waiting for the peer to copy the message out".into(),
            Phase::Announce => {
                "waiting for earlier work on the caller's stream or a free descriptor".into()
            }
            Phase::AwaitSendDesc => "waiting for the peer's send (or its data)".into(),
            Phase::AwaitOffer => "waiting for the peer to post the matching send".into(),
            Phase::Pulling { .. } => "waiting for the copy out of the peer's buffer".into(),
            Phase::ToStandIn(_) => "waiting for the copy of the buffer into its stand-in".into(),
            Phase::FromStandIn { .. } => "waiting for the copy out of the buffer's stand-in".into(),
            Phase::Chunks { total, issued, .. } => {
                format!("waiting for the peer's side of the staged chunks ({issued} of {total} bytes issued)")
            }
            Phase::Net(n) => n.waiting_for(),
            Phase::Streamed { .. } => {
                "waiting for the caller's stream to pass the stream-ordered message (the peer's \
                 side of it, or a free slot)"
                    .into()
            }
            Phase::Late { second: false } => {
                "waiting for the peer to post the message and its stream to copy it".into()
            }
            Phase::Late { second: true } => {
                "waiting for the peer's stream to reach the message, then for this rank's copy"
                    .into()
            }
        }
    }
}

/// What one pass over a step achieved.
pub(crate) enum Progress {
    /// Nothing moved. `on_peer`: the step waits for the peer (its descriptor, answer, data or
    /// free slots) rather than for work of ours in flight — only such a step fails when the
    /// peer is gone; one finishing its own copies of data the peer already handed over must
    /// be allowed to finish.
    Idle {
        on_peer: bool,
    },
    Moved,
    Done(Result<usize>),
}

/// A buffer as a descriptor names it for the peer: the IPC handle of the allocation holding it
/// (`None`: not exported), its offset in that allocation, where the allocation lies here, and
/// the runtime's identifier of it where it was asked for (`DeviceAdaptor::mem_buffer_id`: a new
/// allocation at a freed one's addresses might have the same handle bytes; only late naming asks,
/// `Comm::late_export`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Exported {
    pub(crate) handle: Option<IpcMemHandle>,
    pub(crate) offset: u64,
    pub(crate) span: Span,
    pub(crate) buffer_id: Option<u64>,
}

/// What a peer needs to reach the buffer at `ptr` (the receiver's for a push, the sender's for
/// a pull). An IPC pair cannot do without it (the failure is the operation's); on the direct
/// path a buffer that cannot be exported (not host-vendor device memory) just takes the ring:
/// no handle. A zero-byte buffer is never exported (it may have no allocation).
pub(crate) fn export<A: DeviceAdaptor>(
    a: &A,
    ptr: DevicePtr,
    bytes: usize,
    transport: TransportKind,
) -> Result<Exported> {
    if bytes == 0 {
        return Ok(Exported::default());
    }
    let exported = a.mem_get_range(ptr).and_then(|(base, len)| {
        Ok(Exported {
            handle: Some(a.ipc_get_handle(base)?),
            offset: ptr.0 - base.0,
            span: Span {
                base: base.0,
                len: len as u64,
            },
            buffer_id: None,
        })
    });
    match exported {
        Ok(x) => Ok(x),
        Err(e) if transport == TransportKind::Ipc => Err(e.into()),
        Err(_) => Ok(Exported::default()),
    }
}

/// Whether the caller's stream passed the point where the operation was posted.
///
/// The proxy's copy streams are shared by every peer, so they never wait on a caller's start
/// event on the device: with iterations enqueued back to back, a later operation's start
/// depends on an earlier one to another peer, and a device-side wait queued ahead of that
/// earlier operation's copies would stall both for good. The proxy polls instead.
/// `watermark` is the engine's: every operation up to it finished. An operation may start once
/// its start event completed, or the operation it waits for instead (`Op::after`) finished.
pub(crate) fn started<A: DeviceAdaptor>(a: &A, watermark: u64, op: &crate::op::Op) -> Result<bool> {
    if op.after > watermark {
        return Ok(false);
    }
    match op.start {
        None => Ok(true),
        Some(e) => Ok(a.event_query(e)?),
    }
}

pub(crate) fn remote_failure(peer: usize, fault: u64) -> CommError {
    let reason = if fault == RETIRED {
        "it retired the pair (an operation with this rank timed out there, or it aborted)"
    } else {
        "its side of the operation failed (a runtime error)"
    };
    CommError::RemoteFailure {
        peer,
        reason: reason.into(),
    }
}

/// A pushing sender's decision on receive descriptor `desc` where no copy is needed (the
/// receive is too small, or there is nothing to send): it answers, and this is the result.
pub(crate) fn push_without_copy(
    out: &Channel,
    index: u64,
    bytes: usize,
    desc: &RecvDesc,
    peer: usize,
) -> Option<Result<usize>> {
    if bytes as u64 > desc.size {
        answer(out, index, bytes, SendStatus::SizeMismatch);
        return Some(Err(CommError::SizeMismatch {
            peer,
            send_bytes: bytes,
            recv_bytes: desc.size as usize,
        }));
    }
    if bytes == 0 {
        answer(out, index, 0, SendStatus::Ok);
        return Some(Ok(0));
    }
    None
}

/// A pulling receiver's decision on offer `offer` where no copy is needed (the sender failed,
/// the receive is too small, or nothing was sent): it gives its verdict, and this is the result.
pub(crate) fn pull_without_copy(
    inc: &Channel,
    index: u64,
    bytes: usize,
    offer: &SendDesc,
    peer: usize,
) -> Option<Result<usize>> {
    let r = match send_failure(peer, offer, bytes, true) {
        Some(e) => Err(e),
        None if offer.size == 0 => Ok(0),
        None => return None,
    };
    give_verdict(inc, index, bytes);
    Some(r)
}

/// An offering sender's result, from the pulling receiver's verdict (its buffer size).
pub(crate) fn verdict_result(bytes: usize, verdict: &RecvDesc, peer: usize) -> Result<usize> {
    if bytes as u64 > verdict.size {
        return Err(CommError::SizeMismatch {
            peer,
            send_bytes: bytes,
            recv_bytes: verdict.size as usize,
        });
    }
    Ok(bytes)
}

/// Publishes the sender's answer for descriptor `index`.
pub(crate) fn answer(out: &Channel, index: u64, bytes: usize, status: SendStatus) {
    out.write_send_desc(
        index,
        &SendDesc {
            size: bytes as u64,
            status,
            handle: None,
            offset: 0,
            span: Span::default(),
        },
    );
    out.store(Counter::SendPosted, index + 1);
}

/// The pulling receiver's verdict on message `index`, published once its copy finished (or
/// it refused): its buffer size, from which the sender tells success from a size mismatch.
pub(crate) fn give_verdict(inc: &Channel, index: u64, recv_bytes: usize) {
    let d = RecvDesc {
        size: recv_bytes as u64,
        handle: None,
        offset: 0,
        span: Span::default(),
        chunks: false,
    };
    inc.write_recv_desc(index, &d);
    inc.store(Counter::RecvPosted, index + 1);
    inc.store(Counter::RecvDone, index + 1);
}

/// Why a receive of `bytes` cannot take the sender's descriptor `sd`, if it cannot. A pushing
/// sender checks sizes itself and reports a mismatch in the status; a pulling receiver sees the
/// sender's size in the offer and is the one to find it too large.
pub(crate) fn send_failure(
    peer: usize,
    sd: &SendDesc,
    bytes: usize,
    pulling: bool,
) -> Option<CommError> {
    match sd.status {
        SendStatus::Ok | SendStatus::Delivered if sd.size as usize <= bytes => None,
        SendStatus::Ok if pulling => Some(CommError::SizeMismatch {
            peer,
            send_bytes: sd.size as usize,
            recv_bytes: bytes,
        }),
        SendStatus::Ok | SendStatus::Delivered => Some(CommError::Protocol(format!(
            "rank {peer} sent {} bytes into a {bytes}-byte receive",
            sd.size
        ))),
        SendStatus::SizeMismatch => Some(CommError::SizeMismatch {
            peer,
            send_bytes: sd.size as usize,
            recv_bytes: bytes,
        }),
        SendStatus::SenderFailed => Some(CommError::RemoteFailure {
            peer,
            reason: "the sender's copy could not be issued".into(),
        }),
        // An eager descriptor is taken out of its slot before this is asked.
        SendStatus::Eager => Some(CommError::Protocol(format!(
            "rank {peer}: an eager descriptor where an answer was expected"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{Slot, Verdict};

    fn op(dir: Dir, resume: Option<Resume>) -> Op {
        Op {
            seq: 1,
            dir,
            peer: 1,
            index: 7,
            ptr: DevicePtr(0),
            bytes: 8,
            start: None,
            after: 0,
            slot: Arc::new(Slot::new(None, Arc::new(Verdict::default()))),
            keep: None,
            posted: None,
            resume,
            stand_in: None,
        }
    }

    /// An admitted operation starts where its posting thread left it, else in its transport's
    /// first phase by who copies; a resume its pair cannot have is an error, not a panic.
    #[test]
    fn operations_start_in_the_phase_their_pair_and_resume_say() {
        let ipc = TransportKind::Ipc;
        let roles = |peer_pulls, we_pull| Roles {
            peer_pulls,
            we_pull,
            ..Default::default()
        };
        let first = |dir, resume, r| Phase::first(&mut op(dir, resume), ipc, r);
        let sends = [(false, Phase::AwaitRecvDesc), (true, Phase::Offer)];
        for (peer_pulls, want) in sends {
            let got = first(Dir::Send, None, roles(peer_pulls, false)).expect("a phase");
            assert_eq!(got.waiting_for(), want.waiting_for());
        }
        let recvs = [(false, Phase::Announce), (true, Phase::AwaitOffer)];
        for (we_pull, want) in recvs {
            let got = first(Dir::Recv, None, roles(false, we_pull)).expect("a phase");
            assert_eq!(got.waiting_for(), want.waiting_for());
        }
        let published = first(Dir::Recv, Some(Resume::Published), roles(false, false));
        assert!(matches!(published, Ok(Phase::AwaitSendDesc)));
        let late = Some(Resume::Late {
            second: true,
            mapping: None,
        });
        assert!(matches!(
            first(Dir::Send, late, roles(false, false)),
            Ok(Phase::Late { second: true })
        ));
        let failed = Some(Resume::Failed(Box::new(CommError::Aborted)));
        match first(Dir::Send, failed, roles(false, false)) {
            Err(CommError::Protocol(m)) => assert!(m.contains("operation 7 with rank 1"), "{m}"),
            other => panic!("a failed resume must be refused: {:?}", other.map(|_| ())),
        }
        let mut net = op(Dir::Recv, None);
        let started = Phase::first(&mut net, TransportKind::Net, roles(false, false));
        assert!(matches!(started, Ok(Phase::Net(NetPhase::Start))));
    }
}
