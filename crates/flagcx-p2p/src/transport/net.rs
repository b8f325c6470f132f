//! Net: pairs on different hosts, over UCX ([`crate::ucx`]), which picks RDMA, TCP or shared
//! memory by itself (`UCX_TLS` chooses).
//!
//! Every message is one UCX tagged message whose tag is the sender's rank and the message's
//! number in its pair and direction ([`tag`]), and every receive matches exactly one tag: so
//! messages of a pair arrive in posting order whatever UCX does underneath, and zero-byte
//! messages are messages like any other. Device memory the CPU can address (the host vendor)
//! goes to UCX as it is, and so does CUDA or ROCm memory where UCX says it moves that memory
//! type itself (a UCX built `--with-cuda`/`--with-rocm`: [`direct_memory`]); other device
//! memory is staged through pinned host buffers (a device→host copy before the send, a
//! host→device copy after the receive) — `FLAGCX_NET_STAGING=always` forces that path, to
//! test it where nothing needs it.
//!
//! Semantics as on one node, with one difference: a message larger than the receive buffer
//! fails the receive with [`CommError::SizeMismatch`] while the send, whose bytes UCX
//! delivered, completes — as the eager path does on one node. A receive whose message is
//! already here probes its size first and writes nothing of a larger one; one posted before
//! its message lets UCX write straight into the buffer (a copy less), and UCX then writes
//! nothing of a larger one-fragment or rendezvous message but may write the leading fragments
//! of a larger multi-fragment eager one. A lost peer is seen two ways: its bootstrap socket
//! hangs up (the engine's health check), or UCX fails its endpoint; its
//! operations then fail with [`CommError::PeerLost`] — after its last messages were taken in.
//! UCX is called under [`SharedNet`]'s lock: by the engine, by a posting thread moving a
//! message itself ([`Comm::try_caller_net`](crate::comm::Comm::try_caller_net)), and by a thread waiting for a request (it drives
//! UCX instead of sleeping, until 100 ms pass with nothing moving; not with `FLAGCX_SPIN_US=0`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::DeviceAdaptor;

use super::{started, Phase, Progress, Step};
use crate::engine::{Engine, Protocol};
use crate::error::{CommError, Result};
use crate::link::net::*;
use crate::op::Dir;
use crate::shared::Path;
use crate::ucx::{tag, Status, MEMORY_TYPE_HOST};

impl<A: DeviceAdaptor> Engine<A> {
    /// One pass over a step of a pair on another host.
    pub(crate) fn progress_net(&mut self, p: usize, step: &mut Step) -> Result<Progress> {
        let rank = self.boot.rank();
        let Some(shared) = self.net.clone() else {
            return Err(CommError::Protocol(format!(
                "rank {p} is on another host but the network transport is not set up"
            )));
        };
        let mut guard = lock(&shared);
        let net = &mut *guard;
        net.worker.progress();
        let status = net.failed[p].load(Ordering::Acquire);
        let endpoint_failed = || {
            let why = net.worker.describe(status as Status);
            let reason = format!("the network endpoint to it failed: {why}");
            CommError::PeerLost { peer: p, reason }
        };
        let dir = step.op.dir;
        // A peer that leaves right after its last sends closes its endpoint; ours may fail while
        // that message sits in this worker: an unmatched receive still probes, a matched one ends.
        let unmatched = matches!(step.phase, Phase::Net(NetPhase::Start | NetPhase::Probe));
        if status != 0 && !(dir == Dir::Recv && (step.matched.is_some() || unmatched)) {
            return Err(endpoint_failed());
        }
        let Phase::Net(phase) = &mut step.phase else {
            return Err(CommError::Protocol("a net step in another phase".into()));
        };
        let (ptr, bytes) = (step.op.ptr, step.op.bytes);
        let tag = match dir {
            Dir::Send => tag(rank, step.index),
            Dir::Recv => tag(p, step.index),
        };
        match phase {
            NetPhase::Start => {
                if !started(&self.adaptor, self.watermark, &step.op)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                if dir == Dir::Recv {
                    *phase = NetPhase::Probe;
                    return Ok(Progress::Moved);
                }
                let ep = net.eps[p].as_ref().ok_or_else(|| {
                    CommError::Protocol(format!("no network endpoint to rank {p}"))
                })?;
                if !net.stage() || bytes == 0 {
                    let (at, mem) = net.ucx_buf(ptr, bytes);
                    // SAFETY: unstaged device memory is memory UCX reaches at its device
                    // address (host addressable, or of type `mem`); the caller keeps the
                    // buffer valid and unmodified until the operation finishes, and the
                    // request is completed or cancelled before the step goes (`abandon`).
                    let req = unsafe { net.worker.send(ep, at, bytes, tag, mem) }?;
                    *phase = NetPhase::Wire { req, buf: None };
                    return Ok(Progress::Moved);
                }
                let buf = net.bounce(&self.adaptor, bytes)?;
                let ev = match self.free_events.pop() {
                    Some(e) => e,
                    None => self.adaptor.event_create(false)?,
                };
                // SAFETY: `buf` holds `bytes`; the source is the caller's buffer.
                let r = unsafe {
                    self.adaptor
                        .memcpy_d2h_async(buf.ptr, ptr, bytes, self.send_stream)
                }
                .and_then(|()| self.adaptor.event_record(ev, self.send_stream));
                if let Err(e) = r {
                    self.free_events.push(ev);
                    net.give_back(&self.adaptor, buf);
                    return Err(e.into());
                }
                *phase = NetPhase::ToHost { ev, buf };
                Ok(Progress::Moved)
            }
            NetPhase::Probe => {
                let lost = status != 0 || self.peers[p].as_ref().is_some_and(|c| c.lost.is_some());
                let found = match net.worker.probe(tag) {
                    None if lost => net.worker.probe_within(tag, Duration::from_millis(200)),
                    m => m,
                };
                let Some((msg, len)) = found else {
                    if status != 0 {
                        return Err(endpoint_failed());
                    }
                    if lost || net.stage() {
                        return Ok(Progress::Idle { on_peer: true });
                    }
                    // Not here yet: post the receive, so UCX lands it in the buffer directly.
                    let (at, mem) = net.ucx_buf(ptr, bytes);
                    // SAFETY: as below: the caller's unstaged buffer of `bytes`.
                    let req = unsafe { net.worker.recv_tag(at, bytes, tag, mem) }?;
                    *phase = NetPhase::Wire { req, buf: None };
                    return Ok(Progress::Moved);
                };
                step.matched = Some(std::time::Instant::now());
                if len > bytes {
                    let mut scratch = vec![0u8; len];
                    // SAFETY: `scratch` holds `len` bytes and moves with the request (a Vec's
                    // heap buffer does not move with it).
                    let req = unsafe {
                        net.worker
                            .recv(scratch.as_mut_ptr(), len, msg, MEMORY_TYPE_HOST)
                    }?;
                    *phase = NetPhase::Discard {
                        req,
                        _scratch: scratch,
                        len,
                    };
                    return Ok(Progress::Moved);
                }
                if !net.stage() || len == 0 {
                    let (at, mem) = net.ucx_buf(ptr, len);
                    // SAFETY: as for a send: the caller's unstaged buffer of `bytes >= len`,
                    // untouched by anyone else until the operation finishes.
                    let req = unsafe { net.worker.recv(at, len, msg, mem) }?;
                    *phase = NetPhase::Wire { req, buf: None };
                    return Ok(Progress::Moved);
                }
                let buf = net.bounce(&self.adaptor, len)?;
                // SAFETY: `buf` holds `len` bytes and is ours until the request is over.
                *phase = net.on_bounce(&self.adaptor, buf, |n, at| unsafe {
                    n.worker.recv(at, len, msg, MEMORY_TYPE_HOST)
                })?;
                Ok(Progress::Moved)
            }
            NetPhase::Discard { req, len, .. } => {
                let len = *len;
                if net.worker.test(req).is_none() {
                    return Ok(Progress::Idle { on_peer: true });
                }
                *phase = NetPhase::Start;
                Ok(Progress::Done(Err(CommError::SizeMismatch {
                    peer: p,
                    send_bytes: len,
                    recv_bytes: bytes,
                })))
            }
            NetPhase::ToHost { ev, .. } => {
                if !self.adaptor.event_query(*ev)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                let ev = *ev;
                self.free_events.push(ev);
                let NetPhase::ToHost { buf, .. } = std::mem::replace(phase, NetPhase::Start) else {
                    unreachable!("matched above")
                };
                *phase = net.on_bounce(&self.adaptor, buf, |n, at| {
                    let ep = n.eps[p].as_ref().ok_or_else(|| {
                        CommError::Protocol(format!("no network endpoint to rank {p}"))
                    })?;
                    // SAFETY: `buf` holds the message and stays ours until the request is
                    // over.
                    unsafe { n.worker.send(ep, at, bytes, tag, MEMORY_TYPE_HOST) }
                })?;
                Ok(Progress::Moved)
            }
            NetPhase::Wire { req, .. } => {
                let Some(r) = net.worker.test(req) else {
                    return Ok(Progress::Idle { on_peer: true });
                };
                let NetPhase::Wire { buf, .. } = std::mem::replace(phase, NetPhase::Start) else {
                    unreachable!("matched above")
                };
                let n = match r {
                    Ok(n) => n,
                    Err((s, len)) => {
                        if let Some(b) = buf {
                            net.give_back(&self.adaptor, b);
                        }
                        return match failure(&net.worker, dir, p, s, len, bytes) {
                            e @ CommError::SizeMismatch { .. } => Ok(Progress::Done(Err(e))),
                            e => Err(e),
                        };
                    }
                };
                let n = match dir {
                    Dir::Send => bytes,
                    Dir::Recv => n,
                };
                match (dir, buf) {
                    (Dir::Recv, Some(buf)) if n > 0 => {
                        let ev = match self.free_events.pop() {
                            Some(e) => e,
                            None => self.adaptor.event_create(false)?,
                        };
                        // SAFETY: UCX wrote `n <= bytes` bytes into `buf`; the destination is
                        // the caller's buffer of `bytes`.
                        let r = unsafe {
                            self.adaptor
                                .memcpy_h2d_async(ptr, buf.ptr, n, self.recv_stream)
                        }
                        .and_then(|()| self.adaptor.event_record(ev, self.recv_stream));
                        if let Err(e) = r {
                            self.free_events.push(ev);
                            net.give_back(&self.adaptor, buf);
                            return Err(e.into());
                        }
                        *phase = NetPhase::FromHost { ev, buf, len: n };
                        Ok(Progress::Moved)
                    }
                    (_, buf) => {
                        if let Some(b) = buf {
                            net.give_back(&self.adaptor, b);
                        }
                        Ok(Progress::Done(Ok(n)))
                    }
                }
            }
            NetPhase::FromHost { ev, len, .. } => {
                if !self.adaptor.event_query(*ev)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                let (ev, len) = (*ev, *len);
                self.free_events.push(ev);
                let NetPhase::FromHost { buf, .. } = std::mem::replace(phase, NetPhase::Start)
                else {
                    unreachable!("matched above")
                };
                net.give_back(&self.adaptor, buf);
                Ok(Progress::Done(Ok(len)))
            }
        }
    }

    /// A net step that will not finish (failed, timed out, its peer lost, teardown): waits out
    /// its staging copies and cancels its UCX request, so nothing touches its buffers later.
    pub(crate) fn abandon_net(&mut self, step: &mut Step) {
        if !matches!(step.phase, Phase::Net(_)) {
            return;
        }
        let _ = self.adaptor.stream_synchronize(self.send_stream);
        let _ = self.adaptor.stream_synchronize(self.recv_stream);
        if let Some(net) = &self.net {
            lock(net).abandon(&self.adaptor, step);
        }
    }
}

/// UCX tagged messages as the engine drives them: every step of a pair on two hosts.
pub(crate) struct Net;

impl<A: DeviceAdaptor> Protocol<A> for Net {
    fn drives(&self, step: &Step) -> bool {
        step.path == Path::Net && !matches!(step.phase, Phase::Streamed { .. } | Phase::Late { .. })
    }

    fn step(&self, e: &mut Engine<A>, p: usize, step: &mut Step) -> Result<Progress> {
        e.progress_net(p, step)
    }

    fn abandon(&self, e: &mut Engine<A>, _p: usize, step: &mut Step) {
        e.abandon_net(step);
    }
}
