//! The posting side of [`crate::transport::net`]: what the API thread does for it.

use crate::comm::{Comm, Request, State};
use crate::error::{CommError, Result};
use crate::link::ipc::Msg;
use crate::link::net::*;
use crate::op::{Dir, Resume};
use crate::peer::TransportKind;
use crate::shared::Path;
use crate::ucx::{tag, MEMORY_TYPE_HOST};
use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::DeviceAdaptor;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl<A: DeviceAdaptor> Comm<A> {
    /// The posting thread's path for a pair on two hosts (the caller checked: outside a group,
    /// the caller's stream idle): while nothing earlier of the pair and direction is with the
    /// engine, this thread posts the UCX send, or probes for and receives the message, and
    /// waits up to the spin time for it — a small message then never passes through the
    /// engine thread. What is not done by then is handed to the engine where it stands.
    /// `None`: not taken (staging needed, the pair busy or lost), post normally.
    pub(crate) fn try_caller_net(
        &self,
        dir: Dir,
        ptr: flagcx_adaptor::DevicePtr,
        bytes: usize,
        peer: usize,
        keep: &mut Option<crate::kept::Keep>,
    ) -> Result<Option<Request>> {
        let Some(shared) = self.net.as_ref() else {
            return Ok(None);
        };
        if self.transports.get(peer) != Some(&Some(TransportKind::Net)) || lock(shared).stage() {
            return Ok(None);
        }
        let Some(k) = self.caller_reserve(peer, dir) else {
            return Ok(None);
        };
        let spin = self.config.spin.unwrap_or_default();
        let m = Msg {
            dir,
            k,
            ptr,
            bytes,
            peer,
        };
        let outcome = self
            .caller_net(shared, &m, spin)
            .unwrap_or_else(|e| Caller::HandOff(Some(Resume::Failed(Box::new(e)))));
        let resume = match outcome {
            Caller::Done(r) => return Ok(Some(self.caller_finished(&m, Path::Net, r, keep))),
            Caller::HandOff(r) => r,
        };
        let helped = self.slot(peer, m.bytes);
        let (seq, slot) = self.caller_hand_over(&m, None, resume, helped, keep);
        Ok(Some(Request {
            state: State::Pending(slot),
            seq,
            spin,
        }))
    }

    /// For an operation with `peer`: where it is on another host, a waiter drives UCX (when
    /// the engine is not in it) instead of sleeping.
    pub(crate) fn net_helper(&self, peer: usize) -> Option<crate::op::Helper> {
        if self.transports.get(peer) != Some(&Some(TransportKind::Net)) {
            return None;
        }
        Some(crate::op::Helper(Arc::new(NetHelp(self.net.clone()?))))
    }

    /// Message `m`, moved by this thread for up to `spin` (see `try_caller_net`).
    fn caller_net(&self, shared: &SharedNet, m: &Msg, spin: Duration) -> Result<Caller> {
        let Msg {
            dir,
            k,
            ptr,
            bytes,
            peer,
        } = *m;
        let t0 = Instant::now();
        let mut polls = 0u32;
        let mut req = match dir {
            Dir::Send => {
                let mut net = lock(shared);
                let net = &mut *net;
                let Some(ep) = net.eps[peer].as_ref() else {
                    return Ok(Caller::HandOff(None));
                };
                let (at, mem) = net.ucx_buf(ptr, bytes);
                // SAFETY: the pair is not staged, so the buffer is memory UCX reaches at its
                // device address (host addressable, or of type `mem`), which the caller keeps
                // valid and unmodified until the operation finishes; the request is finished
                // here or handed to the engine, which completes or cancels it.
                unsafe { net.worker.send(ep, at, bytes, tag(self.rank, k), mem) }?
            }
            Dir::Recv => {
                let net = lock(shared);
                net.worker.progress();
                match net.worker.probe(tag(peer, k)) {
                    Some((msg, len)) if len > bytes => {
                        // Here already and too large: drained and refused, buffer untouched.
                        let mut scratch = vec![0u8; len];
                        // SAFETY: `scratch` holds `len` bytes and outlives the request (waited
                        // for right here).
                        let mut req = unsafe {
                            net.worker
                                .recv(scratch.as_mut_ptr(), len, msg, MEMORY_TYPE_HOST)
                        }?;
                        while net.worker.test(&mut req).is_none() {
                            net.worker.progress();
                        }
                        return Ok(Caller::Done(Err(CommError::SizeMismatch {
                            peer,
                            send_bytes: len,
                            recv_bytes: bytes,
                        })));
                    }
                    Some((msg, len)) => {
                        let (at, mem) = net.ucx_buf(ptr, len);
                        // SAFETY: the caller's unstaged buffer of `bytes >= len`, untouched
                        // by anyone else until the operation finishes.
                        unsafe { net.worker.recv(at, len, msg, mem) }?
                    }
                    None => {
                        // Not here yet: post the receive, so UCX lands it in the buffer
                        // directly.
                        let (at, mem) = net.ucx_buf(ptr, bytes);
                        // SAFETY: as above, for `bytes`.
                        unsafe { net.worker.recv_tag(at, bytes, tag(peer, k), mem) }?
                    }
                }
            }
        };
        // Up to the spin time without progress — the peer's side is missing — but while UCX
        // keeps moving this message's bytes, up to 2 ms in all (as the IPC posting path waits
        // for its copy): a hand-over mid-message costs two threads' wake-ups.
        // The clock is read every `CLOCK_EVERY` polls only: a poll is a system call or two
        // (~0.3 µs), and reading the clock twice per poll was 8–9% of an 8 B round trip.
        let mut moved = t0;
        let mut progressed = false;
        loop {
            {
                let net = lock(shared);
                if let Some(r) = net.worker.test(&mut req) {
                    return Ok(Caller::Done(r.map_err(|(s, len)| {
                        failure(&net.worker, dir, peer, s, len, bytes)
                    })));
                }
                progressed |= net.worker.progress();
            }
            if polls % CLOCK_EVERY == CLOCK_EVERY - 1 {
                let now = Instant::now();
                if std::mem::take(&mut progressed) {
                    moved = now;
                }
                if now - moved >= spin || now - t0 >= CALLER_MAX {
                    return Ok(Caller::HandOff(Some(Resume::Net(req))));
                }
            }
            polls = pause(polls);
        }
    }
}
