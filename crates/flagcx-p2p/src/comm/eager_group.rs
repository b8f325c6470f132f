//! A group's eager moves: the posting thread moves a group's small messages through the
//! pairs' eager slots itself at its end — for `group_end` ([`Comm::group_eager`], on the
//! group's operations) and for a small collective ([`crate::collectives`], on its blocks
//! before any operation is made for them) — and hands only the rest to the proxy.

use std::time::{Duration, Instant};

use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{DeviceAdaptor, StreamHandle};

use crate::comm::Comm;
use crate::error::Result;
use crate::link::eager::group::*;
use crate::link::eager::{Arrival, EagerLink};
use crate::op::{Declined, Dir, Op};

impl<A: DeviceAdaptor> Comm<A> {
    /// The pair's eager link where `m` may take it: its stream idle at posting, and the message
    /// small enough for the pair's slots (a receive only where it may wait: a spin time).
    pub(crate) fn eager_eligible(&self, m: &Move, spin: Duration) -> Option<&EagerLink> {
        let link = self.eager.get(m.peer)?.as_ref()?;
        let fits = link.fits(m.dir, m.bytes) && (m.dir == Dir::Send || !spin.is_zero());
        (m.unordered && fits).then_some(link)
    }

    /// Runs `f` on the communicator's group bookkeeping, reset for this job's ranks. The
    /// vectors are kept between groups (allocating them per call showed in small collectives'
    /// profiles); a group ending on another thread meanwhile gets its own.
    pub(crate) fn with_group_scratch<R>(&self, f: impl FnOnce(&mut GroupScratch) -> R) -> R {
        let mut kept = self.group_scratch.try_lock().ok();
        let mut own = GroupScratch::default();
        let scratch = kept.as_deref_mut().unwrap_or(&mut own);
        scratch.reset(self.nranks());
        f(scratch)
    }

    /// A group's eager moves, at its end: the operations [`Comm::eager_moves`] moves are
    /// completed here; the rest is returned for the proxy, in order.
    pub(crate) fn group_eager(&self, mut ops: Vec<(Op, StreamHandle)>) -> Vec<(Op, StreamHandle)> {
        let spin = self.config.spin.unwrap_or_default();
        if !ops
            .iter()
            .any(|(op, s)| self.eager_eligible(&Move::of(op, *s), spin).is_some())
        {
            return ops;
        }
        self.with_group_scratch(|s| {
            s.moves.extend(ops.iter().map(|(op, st)| Move::of(op, *st)));
            self.eager_moves(s, Duration::ZERO);
            let mut done = s.done.drain(..);
            ops.retain_mut(|(op, _)| match done.next().flatten() {
                Some(r) => {
                    self.eager_finish(op, r);
                    false
                }
                None => true,
            });
            ops
        })
    }

    /// Moves what it can of `s.moves` (one group's messages, in posting order) through the
    /// pairs' eager slots: every small send whose pair and direction is free goes into the
    /// peer's slots, then the receives wait together, up to the spin time (or the pair's
    /// budget, [`EagerLink::recv_budget`], or `patience` where that is longer; not past an
    /// abort), for eager messages to take. With `patience`, a send whose peer has yet to free
    /// a slot of its window waits for one as long. `s.done[i]` is move
    /// `i`'s result where it was made, `None` where the proxy is to make it: behind a message
    /// left to the proxy, the later ones of its pair and direction are left too.
    ///
    /// Without `patience` sends never wait (a full window leaves the send), and every send is
    /// published before any receive waits, so ranks whose groups send to each other do not
    /// wait on each other for longer than the spin time. Only messages whose stream was idle at posting and still
    /// is move: the move is done before the caller returns, as outside a group.
    pub(crate) fn eager_moves(&self, s: &mut GroupScratch, patience: Duration) {
        let spin = self.config.spin.unwrap_or_default();
        let GroupScratch {
            moves,
            done,
            idle,
            handed,
            busy,
            receives,
        } = s;
        done.clear();
        done.resize_with(moves.len(), || None);
        // Streams idle now: work enqueued on one since the posts comes first.
        // (A group has a stream or two: a list beats a hash map, whose hashing showed in the
        // profile of small all-to-alls.)
        let mut is_idle = |s: StreamHandle| match idle.iter().find(|(h, _)| *h == s.0) {
            Some(&(_, i)) => i,
            None => {
                let i = self.adaptor.stream_query(s).unwrap_or(false);
                idle.push((s.0, i));
                i
            }
        };
        // Pairs and directions with a message left to the proxy (`handed`): the rest of
        // theirs follow it.
        for (i, m) in moves.iter().enumerate() {
            let key = (m.peer, m.dir as usize);
            let link = match self.eager_eligible(m, spin) {
                Some(link) if !handed.contains(key) && is_idle(m.stream) => link,
                _ => {
                    handed.insert(key);
                    continue;
                }
            };
            if m.dir == Dir::Recv {
                receives.push(i);
                continue;
            }
            let mut sent = self.eager_send(link, m.ptr, m.bytes, m.peer, m.stream);
            // A peer behind by a whole window is waited for, with `patience`, rather than
            // handed the rest of this pair's messages through the proxy. (The clock is read
            // only then: a send that went reads none.)
            if sent.is_none() && !patience.is_zero() {
                let t0 = Instant::now();
                while sent.is_none()
                    && !link.window_open(lock(&self.shared.inbox).next[m.peer][Dir::Send as usize])
                    && t0.elapsed() < patience
                    && !self.is_aborted()
                {
                    flagcx_adaptor::spin::relax_on_peer(0);
                    sent = self.eager_send(link, m.ptr, m.bytes, m.peer, m.stream);
                }
            }
            match sent {
                Some(r) => done[i] = Some(r),
                None => {
                    self.shared.declined(Declined::PairBusy);
                    handed.insert(key);
                }
            }
        }
        // The receives, polled in turn; each peer's next one only (later ones are numbered
        // after it).
        // The clock starts at the first receive not there yet, and is read every 16th sweep: a
        // group whose messages are all there reads none (a read costs ~0.1 µs on some VMs).
        let mut t0: Option<Instant> = None;
        let waited = |t0: Option<Instant>| t0.map_or(Duration::ZERO, |t| t.elapsed());
        let (mut polls, mut sweeps) = (0u32, 0u32);
        // The longest any receive still waiting may wait (`EagerLink::recv_budget`).
        let mut limit = spin.max(patience);
        loop {
            busy.fill(false);
            let mut left = false;
            for &i in receives.iter() {
                let m = &moves[i];
                if done[i].is_some() || handed.contains((m.peer, Dir::Recv as usize)) {
                    continue;
                }
                if std::mem::replace(&mut busy[m.peer], true) {
                    left = true;
                    continue;
                }
                let Some(link) = self.eager_eligible(m, spin) else {
                    continue; // it was eligible above, and nothing it depends on changed
                };
                let k = lock(&self.shared.inbox).next[m.peer][Dir::Recv as usize];
                let taken = match link.probe(k, &mut polls) {
                    Arrival::Eager(sd) => {
                        link.note_wait(waited(t0));
                        self.eager_take(link, k, &sd, m.ptr, m.bytes, m.peer, m.stream)
                    }
                    Arrival::Other => {
                        self.shared.declined(Declined::OtherPath);
                        handed.insert((m.peer, Dir::Recv as usize));
                        continue;
                    }
                    Arrival::NotYet => {
                        left = true;
                        limit = limit.max(link.recv_budget(spin, k));
                        continue;
                    }
                };
                match taken {
                    Some(r) => done[i] = Some(r),
                    None => {
                        self.shared.declined(Declined::PairBusy);
                        handed.insert((m.peer, Dir::Recv as usize));
                    }
                }
            }
            sweeps = sweeps.wrapping_add(1);
            let out_of_time = |t0: &mut Option<Instant>| {
                t0.get_or_insert_with(Instant::now).elapsed() >= limit || self.is_aborted()
            };
            if !left || sweeps % 16 == 1 && out_of_time(&mut t0) {
                break;
            }
            flagcx_adaptor::spin::relax_on_peer(polls);
        }
        // Each peer's first receive still waiting waited out its budget.
        for &i in receives.iter() {
            if done[i].is_none() && handed.insert((moves[i].peer, Dir::Recv as usize)) {
                self.shared.declined(Declined::WaitedOut);
            }
        }
    }

    /// Completes a group's operation this thread moved eagerly (the caller drops it).
    fn eager_finish(&self, op: &mut Op, r: Result<usize>) {
        self.eager_counted(&r);
        op.slot.complete(r);
        op.keep = None;
    }
}
