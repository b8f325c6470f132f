//! The descriptor handshake every message other than an eager one runs, on both sides.
//!
//! Push (the sender copies): the receiver announces its buffer ([`Phase::Announce`]), the
//! sender matches it ([`Phase::AwaitRecvDesc`]), copies and answers. Pull (the receiver copies,
//! [`crate::transport::Roles`]): the sender offers its buffer ([`Phase::Offer`]), the receiver
//! copies out of it ([`Phase::AwaitOffer`]) and gives its verdict. The copy itself is the
//! transport's: [`super::ipc`], [`super::direct`], or the ring of [`super::staged`].

use std::time::Instant;

use flagcx_adaptor::DeviceAdaptor;

use super::{
    answer, export, give_verdict, pull_without_copy, push_without_copy, remote_failure,
    send_failure, started, verdict_result, Phase, Progress, Step,
};
use crate::channel::{Counter, RecvDesc, SendDesc, SendStatus, Span};
use crate::engine::{Engine, Protocol};
use crate::error::{CommError, Result};
use crate::op::Dir;
use crate::peer::TransportKind;
use crate::shared::Path;

impl<A: DeviceAdaptor> Engine<A> {
    pub(crate) fn progress_send(&mut self, p: usize, step: &mut Step) -> Result<Progress> {
        let conn = self.peers[p].as_mut().expect("checked by caller");
        match step.phase {
            Phase::AwaitRecvDesc => {
                let fault = conn.out.load(Counter::RecvFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                if conn.out.load(Counter::RecvPosted) <= step.index {
                    return Ok(Progress::Idle { on_peer: true });
                }
                let desc = conn.out.read_recv_desc(step.index)?;
                step.matched = Some(Instant::now());
                let bytes = step.op.bytes;
                if let Some(r) = push_without_copy(&conn.out, step.index, bytes, &desc, p) {
                    return Ok(Progress::Done(r));
                }
                // Every copy below reads the caller's buffer, so it is issued only once the
                // caller's stream passed the posting point (see `started`).
                if !started(&self.adaptor, self.watermark, &step.op)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                // The transport's one copy into the receiver's buffer, or none (the ring).
                let issued = match conn.transport {
                    TransportKind::Ipc => self.issue_ipc_copy(step, &desc).map(Some),
                    TransportKind::Staged => self.direct_push(p, step, &desc),
                    TransportKind::Net => Err(net_in_rendezvous(p)),
                };
                let conn = self.peers[p].as_mut().expect("present");
                match issued {
                    Ok(Some(ev)) => {
                        step.phase = Phase::Copying(ev);
                        Ok(Progress::Moved)
                    }
                    Ok(None) => {
                        answer(&conn.out, step.index, bytes, SendStatus::Ok);
                        step.phase = Phase::Chunks {
                            total: bytes,
                            issued: 0,
                            started: false,
                        };
                        Ok(Progress::Moved)
                    }
                    Err(e) => {
                        answer(&conn.out, step.index, bytes, SendStatus::SenderFailed);
                        Err(e)
                    }
                }
            }
            Phase::Copying(ev) => {
                if !self.adaptor.event_query(ev)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                self.copy_done(&mut step.op, ev);
                let conn = self.peers[p].as_mut().expect("present");
                let status = match step.path {
                    Path::Direct => SendStatus::Delivered,
                    _ => SendStatus::Ok,
                };
                answer(&conn.out, step.index, step.op.bytes, status);
                Ok(Progress::Done(Ok(step.op.bytes)))
            }
            Phase::Offer => {
                let fault = conn.out.load(Counter::RecvFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                // Sends to a peer run one at a time and each waits for the verdict, but eager
                // sends before this one may still sit unread in their slots.
                if !conn.out.window_open(step.index) {
                    return Ok(Progress::Idle { on_peer: true });
                }
                let bytes = step.op.bytes;
                // The receiver's copy engine reads straight from the buffer, so it may only be
                // offered once earlier work on the caller's stream is done.
                if bytes > 0 && !started(&self.adaptor, self.watermark, &step.op)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                // Memory without an IPC handle is offered through its stand-in, filled first.
                let ptr = match step.op.stand_in.as_mut() {
                    Some(s) if !s.filled => {
                        let (dst, src, stream) = (s.ptr, step.op.ptr, self.send_stream);
                        let ev = self.enqueue(stream, |a| {
                            // SAFETY: the stand-in holds at least `bytes` and is this
                            // operation's alone; the caller's buffer is valid until the
                            // operation completes and its stream passed the posting point.
                            unsafe { a.memcpy_d2d_async(dst, src, bytes, stream) }
                        })?;
                        step.phase = Phase::ToStandIn(ev);
                        return Ok(Progress::Moved);
                    }
                    Some(s) => s.expose(),
                    None => step.op.ptr,
                };
                let e = export(&self.adaptor, ptr, bytes, conn.transport)?;
                let sd = SendDesc {
                    size: bytes as u64,
                    status: SendStatus::Ok,
                    handle: e.handle,
                    offset: e.offset,
                    span: e.span,
                };
                conn.out.write_send_desc(step.index, &sd);
                conn.out.store(Counter::SendPosted, step.index + 1);
                step.matched = Some(Instant::now());
                step.phase = Phase::AwaitVerdict;
                Ok(Progress::Moved)
            }
            Phase::AwaitVerdict => {
                let fault = conn.out.load(Counter::RecvFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                if conn.out.load(Counter::RecvPosted) <= step.index {
                    return Ok(Progress::Idle { on_peer: true });
                }
                let verdict = conn.out.read_recv_desc(step.index)?;
                let bytes = step.op.bytes;
                if let Err(e) = verdict_result(bytes, &verdict, p) {
                    return Ok(Progress::Done(Err(e)));
                }
                if verdict.chunks && conn.transport == TransportKind::Staged {
                    // The receiver did not pull (our buffer is not mapped there yet).
                    step.phase = Phase::Chunks {
                        total: bytes,
                        issued: 0,
                        started: false,
                    };
                    return Ok(Progress::Moved);
                }
                if conn.transport == TransportKind::Staged {
                    step.path = Path::Direct;
                }
                Ok(Progress::Done(Ok(bytes)))
            }
            Phase::ToStandIn(ev) => {
                if !self.adaptor.event_query(ev)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                self.copy_done(&mut step.op, ev);
                if let Some(s) = step.op.stand_in.as_mut() {
                    s.filled = true;
                }
                step.phase = Phase::Offer;
                Ok(Progress::Moved)
            }
            Phase::Chunks { .. } => self.pump(p, Dir::Send, step),
            Phase::Net(_) => Err(net_in_rendezvous(p)),
            Phase::Announce
            | Phase::AwaitSendDesc
            | Phase::AwaitOffer
            | Phase::Pulling { .. }
            | Phase::FromStandIn { .. }
            | Phase::Streamed { .. }
            | Phase::Late { .. } => Err(not_mine(p, Dir::Send, &step.phase)),
        }
    }

    pub(crate) fn progress_recv(&mut self, p: usize, step: &mut Step) -> Result<Progress> {
        let conn = self.peers[p].as_mut().expect("checked by caller");
        match step.phase {
            Phase::Announce => {
                // The descriptor window: the sender reuses send descriptor slots only after we
                // finished the receive 64 back, which in-order completion guarantees here.
                if !conn.inc.window_open(step.index) {
                    return Ok(Progress::Idle { on_peer: false });
                }
                let bytes = step.op.bytes;
                let ipc = conn.transport == TransportKind::Ipc;
                let mut desc = RecvDesc {
                    size: bytes as u64,
                    handle: None,
                    offset: 0,
                    span: Span::default(),
                    chunks: false,
                };
                if bytes > 0 && (ipc || conn.roles.peer_maps) {
                    // The sender's copy engine may write straight into the buffer, so it may
                    // only be announced once earlier work on the caller's stream is done.
                    if !started(&self.adaptor, self.watermark, &step.op)? {
                        return Ok(Progress::Idle { on_peer: false });
                    }
                    // Memory without an IPC handle is announced through its stand-in.
                    let ptr = step
                        .op
                        .stand_in
                        .as_mut()
                        .map_or(step.op.ptr, |s| s.expose());
                    let e = export(&self.adaptor, ptr, bytes, conn.transport)?;
                    (desc.handle, desc.offset, desc.span) = (e.handle, e.offset, e.span);
                }
                let conn = self.peers[p].as_mut().expect("present");
                conn.inc.write_recv_desc(step.index, &desc);
                conn.inc.store(Counter::RecvPosted, step.index + 1);
                step.matched = Some(Instant::now());
                step.phase = Phase::AwaitSendDesc;
                Ok(Progress::Moved)
            }
            Phase::AwaitSendDesc => {
                let fault = conn.inc.load(Counter::SendFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                if conn.inc.load(Counter::SendPosted) <= step.index {
                    return Ok(Progress::Idle { on_peer: true });
                }
                let sd = conn.inc.read_send_desc(step.index)?;
                if sd.status == SendStatus::Eager {
                    return self.take_eager(p, step, &sd);
                }
                let bytes = step.op.bytes;
                let failed = send_failure(p, &sd, bytes, false);
                let size = sd.size as usize;
                if sd.status == SendStatus::Delivered {
                    step.path = Path::Direct;
                }
                if failed.is_some()
                    || conn.transport == TransportKind::Ipc
                    || sd.status == SendStatus::Delivered
                    || size == 0
                {
                    conn.inc.store(Counter::RecvDone, step.index + 1);
                    if let (None, Some(s)) = (&failed, step.op.stand_in.as_ref()) {
                        if size > 0 && conn.transport == TransportKind::Ipc {
                            // The data is in the stand-in: one copy more, into the buffer.
                            let (dst, src, stream) = (step.op.ptr, s.ptr, self.recv_stream);
                            let ev = self.enqueue(stream, |a| {
                                // SAFETY: the sender wrote `size <= bytes` bytes into the
                                // stand-in and answered; the caller's buffer holds `bytes`
                                // and is valid until the operation completes.
                                unsafe { a.memcpy_d2d_async(dst, src, size, stream) }
                            })?;
                            step.phase = Phase::FromStandIn { ev, size };
                            return Ok(Progress::Moved);
                        }
                    }
                    return Ok(Progress::Done(failed.map_or(Ok(size), Err)));
                }
                step.phase = Phase::Chunks {
                    total: size,
                    issued: 0,
                    started: false,
                };
                Ok(Progress::Moved)
            }
            Phase::AwaitOffer => {
                let fault = conn.inc.load(Counter::SendFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                if conn.inc.load(Counter::SendPosted) <= step.index {
                    return Ok(Progress::Idle { on_peer: true });
                }
                let offer = conn.inc.read_send_desc(step.index)?;
                step.matched = Some(Instant::now());
                if offer.status == SendStatus::Eager {
                    return self.take_eager(p, step, &offer);
                }
                let bytes = step.op.bytes;
                if let Some(r) = pull_without_copy(&conn.inc, step.index, bytes, &offer, p) {
                    return Ok(Progress::Done(r));
                }
                // Every copy below writes the caller's buffer: see `started`.
                if !started(&self.adaptor, self.watermark, &step.op)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                // The transport's one copy out of the sender's buffer, or none (the ring).
                let issued = match conn.transport {
                    TransportKind::Ipc => Some(self.issue_ipc_pull(step, &offer)?),
                    TransportKind::Staged => self.direct_pull(step, &offer)?,
                    TransportKind::Net => return Err(net_in_rendezvous(p)),
                };
                let Some(ev) = issued else {
                    // Not mapped (yet): ask for the data through the ring.
                    let conn = self.peers[p].as_mut().expect("present");
                    let d = RecvDesc {
                        size: bytes as u64,
                        handle: None,
                        offset: 0,
                        span: Span::default(),
                        chunks: true,
                    };
                    conn.inc.write_recv_desc(step.index, &d);
                    conn.inc.store(Counter::RecvPosted, step.index + 1);
                    step.phase = Phase::Chunks {
                        total: offer.size as usize,
                        issued: 0,
                        started: false,
                    };
                    return Ok(Progress::Moved);
                };
                step.phase = Phase::Pulling {
                    ev,
                    size: offer.size as usize,
                };
                Ok(Progress::Moved)
            }
            Phase::Pulling { ev, size } => {
                if !self.adaptor.event_query(ev)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                self.copy_done(&mut step.op, ev);
                let conn = self.peers[p].as_mut().expect("present");
                give_verdict(&conn.inc, step.index, step.op.bytes);
                Ok(Progress::Done(Ok(size)))
            }
            Phase::FromStandIn { ev, size } => {
                if !self.adaptor.event_query(ev)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                self.copy_done(&mut step.op, ev);
                Ok(Progress::Done(Ok(size)))
            }
            Phase::Chunks { .. } => self.pump(p, Dir::Recv, step),
            Phase::Net(_) => Err(net_in_rendezvous(p)),
            Phase::AwaitRecvDesc
            | Phase::Copying(_)
            | Phase::Offer
            | Phase::AwaitVerdict
            | Phase::ToStandIn(_)
            | Phase::Streamed { .. }
            | Phase::Late { .. } => Err(not_mine(p, Dir::Recv, &step.phase)),
        }
    }
}

/// A step the rendezvous cannot be driving (the other direction's phase, or another
/// protocol's): a bug of ours, failed as such rather than a panic.
fn not_mine(p: usize, dir: Dir, phase: &Phase) -> CommError {
    CommError::Protocol(format!(
        "the rendezvous got a {dir:?} step with rank {p} ({})",
        phase.waiting_for()
    ))
}

/// The descriptor handshake as the engine drives it: every step on a pair on one host that
/// neither the stream-ordered nor the late-copy protocol claims, handing the copy to IPC, the
/// staging ring or the direct path by the pair's transport.
pub(crate) struct Rendezvous;

impl<A: DeviceAdaptor> Protocol<A> for Rendezvous {
    fn drives(&self, step: &Step) -> bool {
        step.path != Path::Net && !matches!(step.phase, Phase::Streamed { .. } | Phase::Late { .. })
    }

    fn step(&self, e: &mut Engine<A>, p: usize, step: &mut Step) -> Result<Progress> {
        match step.op.dir {
            Dir::Send => e.progress_send(p, step),
            Dir::Recv => e.progress_recv(p, step),
        }
    }

    /// The staging ring's chunk copies of the step's direction (on any step: none is left
    /// behind a step that is not the rendezvous's).
    fn abandon(&self, e: &mut Engine<A>, p: usize, step: &mut Step) {
        e.abandon_chunks(p, step.op.dir);
    }
}

/// A pair on two hosts never runs the descriptor handshake (the engine hands its steps to
/// [`super::net`]); reaching it here is a bug reported as an error, not a panic.
fn net_in_rendezvous(p: usize) -> crate::error::CommError {
    crate::error::CommError::Protocol(format!(
        "a message with rank {p} (another host) reached the shared-memory handshake"
    ))
}
