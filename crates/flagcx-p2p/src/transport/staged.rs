//! Staged: any pair, through a ring of slots in the channel's shared host memory.
//!
//! The sender copies chunks device→host into free slots and publishes `Tail`; the receiver
//! copies published slots host→device into its buffer and publishes `Head`. Copies run on the
//! engine's send and receive streams, several chunks in flight each way.

use flagcx_adaptor::{DeviceAdaptor, DevicePtr};

use super::{devring, remote_failure, Phase, Progress, Step};
use crate::channel::Counter;
use crate::engine::Engine;
use crate::error::Result;
use crate::link::staged::*;
use crate::op::Dir;

impl<A: DeviceAdaptor> Engine<A> {
    /// After a peer is lost mid-message, waits for our own in-flight chunk copies (they touch
    /// the caller's buffer) and forgets them.
    pub(crate) fn abandon_chunks(&mut self, p: usize, dir: Dir) {
        let stream = match dir {
            Dir::Send => self.send_stream,
            Dir::Recv => self.recv_stream,
        };
        let _in = crate::guard::BlockedIn::AbandonChunks.mark(&self.shared, p);
        let _ = self.adaptor.stream_synchronize(stream);
        drop(_in);
        if let Some(conn) = self.peers[p].as_mut() {
            let q = match dir {
                Dir::Send => &mut conn.send_ring.chunks,
                Dir::Recv => &mut conn.recv_ring.chunks,
            };
            self.free_events.extend(q.drain(..));
        }
    }

    /// One pass over a staged message ([`Phase::Chunks`]) in either direction: issues a chunk
    /// copy for every slot that is ready (a send: slots the receiver released; a receive: slots
    /// the sender published), then publishes the chunks whose copies completed, in order.
    /// Chunk sizes come from the channel's geometry, which both sides share.
    pub(crate) fn pump(&mut self, p: usize, dir: Dir, step: &mut Step) -> Result<Progress> {
        let Phase::Chunks {
            total,
            ref mut issued,
            ref mut started,
        } = step.phase
        else {
            unreachable!("called for staged chunks only")
        };
        let conn = self.peers[p].as_mut().expect("checked by caller");
        let (ch, fault, stream) = match dir {
            Dir::Send => (&conn.out, Counter::RecvFault, self.send_stream),
            Dir::Recv => (&conn.inc, Counter::SendFault, self.recv_stream),
        };
        let fault = ch.load(fault);
        if fault > step.index {
            return Err(remote_failure(p, fault));
        }
        // No chunk is in flight before the first: see `started`.
        if !*started {
            if !super::started(&self.adaptor, self.watermark, &step.op)? {
                return Ok(Progress::Idle { on_peer: false });
            }
            *started = true;
        }
        let geo = ch.geometry();
        let cur = match dir {
            Dir::Send => &mut conn.send_ring,
            Dir::Recv => &mut conn.recv_ring,
        };
        // Messages from `devring::MIN_BYTES` through the device ring, if the pair has one (both
        // ranks know the total); smaller ones through the host ring, whose chunk counters
        // the device ring shares.
        let ring = conn
            .dev_ring
            .as_ref()
            .filter(|_| total >= devring::MIN_BYTES);
        // Device rings copy at device speed, where every chunk is pure overhead (an event, a
        // hand-off, and on OpenCL a 5-6 µs command): whole slots. Both ranks know.
        let split = if ring.is_some() { 1 } else { geo.split };
        let mut moved = false;
        while *issued < total {
            let ready = match dir {
                Dir::Send => cur.issued - ch.load(Counter::Head) < geo.slots as u64,
                Dir::Recv => cur.issued < ch.load(Counter::Tail),
            };
            if !ready {
                break;
            }
            let len = chunk_len(total, geo.chunk, split).min(total - *issued);
            let user = DevicePtr(step.op.ptr.0 + *issued as u64);
            // SAFETY: the slot has `geo.chunk >= len` bytes, in the live channel mapping or
            // the pair's device ring (mapped until teardown), ours to fill (the receiver
            // released it: `Head`) or to read (the sender published it: `Tail`); `user` lies
            // in the caller's buffer (`total <= bytes`), which the operation keeps valid until
            // it completes.
            unsafe {
                match (ring, dir) {
                    (Some(r), Dir::Send) => {
                        let slot = r.slot(dir, cur.issued, geo.chunk);
                        self.adaptor.memcpy_d2d_async(slot, user, len, stream)?
                    }
                    (Some(r), Dir::Recv) => {
                        let slot = r.slot(dir, cur.issued, geo.chunk);
                        self.adaptor.memcpy_d2d_async(user, slot, len, stream)?
                    }
                    (None, Dir::Send) => {
                        let slot = ch.slot(cur.issued);
                        self.adaptor.memcpy_d2h_async(slot, user, len, stream)?
                    }
                    (None, Dir::Recv) => {
                        let slot = ch.slot(cur.issued);
                        self.adaptor.memcpy_h2d_async(user, slot, len, stream)?
                    }
                }
            };
            let ev = match self.free_events.pop() {
                Some(e) => e,
                None => self.adaptor.event_create(false)?,
            };
            self.adaptor.event_record(ev, stream)?;
            cur.chunks.push_back(ev);
            cur.issued += 1;
            *issued += len;
            moved = true;
        }
        while let Some(&ev) = cur.chunks.front() {
            if !self.adaptor.event_query(ev)? {
                break;
            }
            cur.chunks.pop_front();
            self.free_events.push(ev);
            cur.done += 1;
            match dir {
                Dir::Send => ch.store(Counter::Tail, cur.done),
                Dir::Recv => ch.store(Counter::Head, cur.done),
            }
            moved = true;
        }
        if *issued == total && cur.chunks.is_empty() {
            if dir == Dir::Recv {
                ch.store(Counter::RecvDone, step.index + 1);
            }
            return Ok(Progress::Done(Ok(total)));
        }
        Ok(if moved {
            Progress::Moved
        } else {
            // Waiting on the peer only when none of our copies is in flight: then a send's
            // ring is full (the receiver must drain it), or a receive copies out every
            // published chunk already.
            Progress::Idle {
                on_peer: cur.chunks.is_empty(),
            }
        })
    }
}
