//! The posting side of [`crate::transport::ipc`]: what the API thread does for it.

use crate::channel::{Counter, RecvDesc, SendDesc, SendStatus};
use crate::comm::{Comm, State};
use crate::error::Result;
use crate::ipccache::Theirs;
use crate::link::ipc::*;
use crate::link::{
    answer, export, give_verdict, pull_without_copy, push_without_copy, send_failure,
    verdict_result,
};
use crate::op::{Dir, Resume};
use crate::peer::TransportKind;
use crate::shared::{recycle_event, Path};
use crate::Request;
use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{DeviceAdaptor, DevicePtr, EventHandle, StreamHandle};
use std::sync::atomic::Ordering;
use std::time::Duration;

impl<A: DeviceAdaptor> Comm<A> {
    /// The posting thread's IPC path (the caller checked the pair has one and the post is
    /// outside a group): while nothing earlier of the pair and direction is with the proxy,
    /// this thread takes the message. Where this rank copies, it waits (up to the spin time)
    /// for the peer's descriptor and issues the copy on the caller's stream itself, so the
    /// stream orders it with no event and no wait on the proxy; where the peer copies, it
    /// publishes its own descriptor (idle streams only: the peer's copy engine may touch the
    /// buffer at once) and waits for the peer's answer. Whatever is not finished within the
    /// spin time goes to the proxy from where it stands. `None`: not taken (`start` and `keep`
    /// stay the caller's), post normally.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn try_caller_ipc(
        &self,
        dir: Dir,
        ptr: DevicePtr,
        bytes: usize,
        peer: usize,
        stream: StreamHandle,
        start: Option<EventHandle>,
        keep: &mut Option<crate::kept::Keep>,
    ) -> Result<Option<Request>> {
        let Some(link) = self.caller.get(peer).and_then(|l| l.as_ref()) else {
            return Ok(None);
        };
        let copies = match dir {
            Dir::Send => link.push,
            Dir::Recv => link.pull,
        };
        if !copies && start.is_some() {
            return Ok(None);
        }
        let Some(k) = self.caller_reserve(peer, dir) else {
            return Ok(None);
        };
        let spin = self.config.spin.unwrap_or_default();
        let idle = start.is_none();
        let m = Msg {
            dir,
            k,
            ptr,
            bytes,
            peer,
        };
        let outcome = match copies {
            true => self.caller_copies(link, m, stream, idle, spin),
            false => self.caller_publish(link, m, spin),
        }
        .unwrap_or_else(|e| Caller::HandOff(Some(Resume::Failed(Box::new(e)))));
        let (resume, start) = match outcome {
            Caller::Done(r) => {
                if let Some(start) = start {
                    recycle_event(&self.adaptor, &self.shared, start);
                }
                return Ok(Some(self.caller_finished(&m, Path::Ipc, r, keep)));
            }
            // A copy on the caller's stream needs no start: the stream orders it.
            Caller::HandOff(Some(r @ (Resume::Pushed(_) | Resume::Pulled { .. }))) => {
                if let Some(start) = start {
                    recycle_event(&self.adaptor, &self.shared, start);
                }
                (Some(r), None)
            }
            Caller::HandOff(r) => (r, start),
        };
        self.shared.caller_handoffs[Resume::handoff(&resume) as usize]
            .fetch_add(1, Ordering::Relaxed);
        // The stream waits for the operation, unless it carries the copy itself (or the
        // operation failed before anything of it was under way).
        let join = !matches!(
            resume,
            Some(Resume::Pushed(_) | Resume::Pulled { .. } | Resume::Failed(_))
        );
        let (seq, slot) =
            self.caller_hand_over(&m, start, resume, self.slot(m.peer, m.bytes), keep);
        if join {
            self.join_stream(stream, seq, false, true)?;
        }
        Ok(Some(Request {
            state: State::Pending(slot),
            seq,
            spin,
        }))
    }

    /// This rank copies: once the peer described its side of message `k` (the receiver its
    /// buffer, or the sender its offer), the one copy goes on the caller's stream — into the
    /// peer's buffer for a send, out of it for a receive.
    pub(crate) fn caller_copies(
        &self,
        link: &CallerLink,
        m: Msg,
        stream: StreamHandle,
        idle: bool,
        spin: Duration,
    ) -> Result<Caller> {
        let Msg {
            dir,
            k,
            ptr,
            bytes,
            peer,
        } = m;
        let (ch, theirs, their_fault) = link.lane(dir);
        let seen = poll_for(
            spin,
            || spin,
            || (ch.load(theirs) > k || ch.load(their_fault) > k).then_some(()),
        );
        // The proxy reports a failure on the peer's side (and takes an eager message).
        if seen.is_none() || ch.load(their_fault) > k {
            return Ok(Caller::HandOff(None));
        }
        // The peer's buffer (its allocation's handle and the offset in it), and the bytes.
        let (theirs, offset, n) = match dir {
            Dir::Send => {
                let desc = ch.read_recv_desc(k)?;
                if let Some(r) = push_without_copy(ch, k, bytes, &desc, peer) {
                    return Ok(Caller::Done(r));
                }
                (Theirs::recv(peer, &desc), desc.offset, bytes)
            }
            Dir::Recv => {
                let offer = ch.read_send_desc(k)?;
                if offer.status == SendStatus::Eager {
                    return Ok(Caller::HandOff(None));
                }
                if let Some(r) = pull_without_copy(ch, k, bytes, &offer, peer) {
                    return Ok(Caller::Done(r));
                }
                (
                    Theirs::send(peer, &offer),
                    offer.offset,
                    offer.size as usize,
                )
            }
        };
        let push = dir == Dir::Send;
        let ev = self
            .caller_copy(stream, theirs, offset, ptr, n, push)
            .inspect_err(|_| {
                if push {
                    answer(ch, k, bytes, SendStatus::SenderFailed);
                }
            })?;
        if idle {
            ch.store(Counter::Issued, k + 1);
        }
        if !self.copy_finished(ev, running_copy_budget(spin, idle)) {
            return Ok(Caller::HandOff(Some(match dir {
                Dir::Send => Resume::Pushed(ev),
                Dir::Recv => Resume::Pulled { ev, size: n },
            })));
        }
        match dir {
            Dir::Send => answer(ch, k, bytes, SendStatus::Ok),
            Dir::Recv => give_verdict(ch, k, bytes),
        }
        Ok(Caller::Done(Ok(n)))
    }

    /// The peer copies: publish this side's descriptor (the receive buffer, or the offered
    /// send buffer), then wait for the peer's answer (or verdict).
    pub(crate) fn caller_publish(
        &self,
        link: &CallerLink,
        m: Msg,
        spin: Duration,
    ) -> Result<Caller> {
        let Msg {
            dir,
            k,
            ptr,
            bytes,
            peer,
        } = m;
        let (ch, theirs, their_fault) = link.lane(dir);
        if !ch.window_open(k) {
            return Ok(Caller::HandOff(None));
        }
        let e = export(&self.adaptor, ptr, bytes, TransportKind::Ipc)?;
        match dir {
            Dir::Send => {
                let sd = SendDesc {
                    size: bytes as u64,
                    status: SendStatus::Ok,
                    handle: e.handle,
                    offset: e.offset,
                    span: e.span,
                };
                ch.write_send_desc(k, &sd);
                ch.store(Counter::SendPosted, k + 1);
            }
            Dir::Recv => {
                let rd = RecvDesc {
                    size: bytes as u64,
                    handle: e.handle,
                    offset: e.offset,
                    span: e.span,
                    chunks: false,
                };
                ch.write_recv_desc(k, &rd);
                ch.store(Counter::RecvPosted, k + 1);
            }
        }
        // Past the spin time, only while the peer's copy of this message runs.
        let budget = || running_copy_budget(spin, ch.load(Counter::Issued) > k);
        let seen = poll_for(spin, budget, || {
            (ch.load(theirs) > k || ch.load(their_fault) > k).then_some(())
        });
        if seen.is_none() || ch.load(their_fault) > k {
            return Ok(Caller::HandOff(Some(Resume::Published)));
        }
        Ok(match dir {
            Dir::Send => Caller::Done(verdict_result(bytes, &ch.read_recv_desc(k)?, peer)),
            Dir::Recv => {
                let sd = ch.read_send_desc(k)?;
                if sd.status == SendStatus::Eager {
                    // The proxy takes it out of its slot.
                    return Ok(Caller::HandOff(Some(Resume::Published)));
                }
                let failed = send_failure(peer, &sd, bytes, false);
                ch.store(Counter::RecvDone, k + 1);
                Caller::Done(failed.map_or(Ok(sd.size as usize), Err))
            }
        })
    }

    /// Issues an IPC operation's copy on the caller's stream: `n` bytes between `ptr` and the
    /// peer's buffer at `offset` of the allocation behind `handle` (`push`: into the peer's).
    /// Returns the event that completes with it; until that is seen, the copy counts in
    /// [`crate::ipccache::IpcCache::caller_copies`], so its mapping stays open.
    pub(crate) fn caller_copy(
        &self,
        stream: StreamHandle,
        theirs: Theirs,
        offset: u64,
        ptr: DevicePtr,
        n: usize,
        push: bool,
    ) -> Result<EventHandle> {
        let ev = self.spare_event()?;
        // The mapping is opened and counted busy under the cache's lock, and the copy issued
        // with it released: an enqueue blocks while the caller's stream's queue is full, until
        // the device passes waits that only the proxy can release, and the proxy takes this
        // lock to open its own mappings.
        let opened = {
            let mut cache = lock(&self.shared.ipc);
            let base = cache.open(&self.adaptor, theirs);
            if base.is_ok() {
                cache.caller_copies += 1;
            }
            base
        };
        let issued = opened.and_then(|base| {
            let theirs = DevicePtr(base.0 + offset);
            let (dst, src) = if push { (theirs, ptr) } else { (ptr, theirs) };
            // SAFETY: the peer's buffer lies at `offset` of its allocation, which it described
            // for this message (a receive of at least `n` bytes, or an offer of `n`) and keeps
            // until this side answers, mapped while `caller_copies` counts this copy;
            // `ptr..ptr+n` was checked to lie in one allocation of this adaptor (for a pull, `n`
            // is at most the receive's size), valid until the operation finishes; the stream
            // orders the copy after the caller's earlier work on the buffer.
            unsafe { self.adaptor.memcpy_d2d_async(dst, src, n, stream) }.map_err(|e| {
                lock(&self.shared.ipc).caller_copies -= 1;
                e.into()
            })
        });
        if let Err(e) = issued {
            recycle_event(&self.adaptor, &self.shared, ev);
            return Err(e);
        }
        if let Err(e) = self.adaptor.event_record(ev, stream) {
            // Queued but untracked: let it finish before the proxy copies the same bytes again.
            let _ = self.adaptor.stream_synchronize(stream);
            lock(&self.shared.ipc).caller_copies -= 1;
            recycle_event(&self.adaptor, &self.shared, ev);
            return Err(e.into());
        }
        Ok(ev)
    }

    /// Whether the caller's copy (event `ev`) completes within `budget`; if so, its mapping
    /// is free to close again and the event back in the pool.
    pub(crate) fn copy_finished(&self, ev: EventHandle, budget: Duration) -> bool {
        // An error is the proxy's to report: it queries the event again.
        let done = poll_for(
            budget,
            || budget,
            || match self.adaptor.event_query(ev) {
                Ok(false) => None,
                Ok(true) => Some(true),
                Err(_) => Some(false),
            },
        );
        if done != Some(true) {
            return false;
        }
        lock(&self.shared.ipc).caller_copies -= 1;
        recycle_event(&self.adaptor, &self.shared, ev);
        true
    }
}

impl<A: DeviceAdaptor> Comm<A> {
    /// The stand-in (`crate::standin`) a message needs (`None`: none): this rank names its buffer to the peer in
    /// `dir` and the runtime has no IPC handle for the memory at `ptr`.
    pub(crate) fn stand_in_for(
        &self,
        peer: usize,
        dir: Dir,
        ptr: DevicePtr,
        bytes: usize,
    ) -> Result<Option<crate::standin::StandIn>> {
        let names = self.names_buffer.get(peer).is_some_and(|n| n[dir as usize]);
        if !names || bytes == 0 {
            return Ok(None);
        }
        match export(&self.adaptor, ptr, bytes, TransportKind::Ipc) {
            Ok(_) => Ok(None),
            Err(e) => {
                tracing::debug!(
                    "rank {}: {bytes} bytes at {ptr} have no IPC handle ({e}); a stand-in carries them",
                    self.rank
                );
                crate::standin::take(&self.stand_ins, &self.adaptor, bytes).map(Some)
            }
        }
    }
}
