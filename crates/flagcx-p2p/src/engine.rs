//! The engine: one progress thread per communicator (the proxy) that moves the bytes.
//!
//! The API thread only records a start event on the caller's stream and hands the operation
//! over ([`crate::op`]). The engine admits it to its pair's queue and drives it through its
//! transport's steps ([`crate::transport`]), issuing the copies on its own streams (one for sends, one for receives, so a
//! bidirectional exchange overlaps), records an event per step and polls it, and publishes
//! progress through the channels' monotonic counters. Per peer and direction operations run in
//! posting order; different peers and directions progress independently. When an operation
//! finishes, the communicator's completion watermark advances; callers' streams wait on it
//! (stream memory operations, or a host function where the vendor lacks them).
//!
//! Who runs the engine's passes — the proxy thread, which spins while work is in flight and
//! parks when idle, and, where this rank's copies are CPU copies, threads waiting for an
//! operation (`FLAGCX_P2P_WAITER_PROGRESS`) — is [`crate::drive`].

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{DeviceAdaptor, EventHandle, StreamHandle};

use crate::bootstrap::{hung_up, Bootstrap};
use crate::channel::{Counter, RETIRED};
use crate::error::{CommError, Result};
use crate::link::hostmap::HostMaps;
use crate::link::net::SharedNet;
use crate::link::{PeerConn, Phase, Progress, Step};
use crate::op::{Dir, Handoff, Op, Resume};
use crate::peer::TransportKind;
use crate::profile::Profile;
use crate::shared::{recycle_event, Path, Shared};

/// What the engine drives a pair's steps through: one per protocol of `transport/`, listed in
/// its registry (`transport::protocols`) and handed to [`Engine::new`], so the engine names
/// none of them. For each step at the front of a queue the engine asks the protocols in order
/// which one [`drives`](Protocol::drives) it and gives it the pass; where a step leaves its
/// queue unfinished (a local failure, a lost peer, a timeout, teardown) every protocol settles
/// what it holds of it.
pub(crate) trait Protocol<A: DeviceAdaptor>: Send + Sync {
    /// Whether it moves `step` (its pair's path and its phase say).
    fn drives(&self, step: &Step) -> bool;
    /// One pass over `step`, the front of peer `p`'s queue in its direction.
    fn step(&self, e: &mut Engine<A>, p: usize, step: &mut Step) -> Result<Progress>;
    /// `step` fails mid-flight: settle its work on the engine's streams and its requests
    /// (called for every protocol; each acts only on what is its own).
    fn abandon(&self, _e: &mut Engine<A>, _p: usize, _step: &mut Step) {}
    /// Before operations are failed without their peer, first for all of them at once: end
    /// the waits `op`'s caller stream makes on the peer (streams sharing one queue may pass one
    /// only after another's release).
    fn unblock(&self, _e: &Engine<A>, _op: &Op) {}
    /// Then, for each: let `op`'s caller stream pass it (its copy may use the caller's buffer).
    fn release(&self, _e: &Engine<A>, _op: &mut Op) {}
}

/// The proxy thread's state.
pub(crate) struct Engine<A: DeviceAdaptor> {
    /// The protocols it drives steps through, in the order they are asked (see [`Protocol`]).
    protocols: Vec<&'static dyn Protocol<A>>,
    pub adaptor: A,
    pub shared: Arc<Shared>,
    pub boot: Arc<Bootstrap>,
    pub peers: Vec<Option<PeerConn>>,
    pub send_stream: StreamHandle,
    pub recv_stream: StreamHandle,
    pub(crate) timeout: Option<Duration>,
    pub(crate) health_interval: Duration,
    pub(crate) spin: Duration,
    pub(crate) profile: Option<Profile>,
    pub(crate) free_events: Vec<EventHandle>,
    /// Mapped buffers of host-vendor peers (only when this rank is a direct copier).
    pub(crate) host_maps: Option<HostMaps<A>>,
    pub(crate) finished: BTreeSet<u64>,
    pub(crate) watermark: u64,
    /// The network transport's state, where a peer is on another host.
    pub(crate) net: Option<SharedNet>,
    /// Where eager messages are copied into device memory that is not host addressable
    /// (made at setup with the bounce buffer, see [`crate::link::eager::Bounce`]; kept
    /// apart so such a copy never waits behind ring chunks).
    pub(crate) eager_stream: Option<StreamHandle>,
    /// Its pinned bounce buffer.
    pub(crate) eager_bounce: crate::link::eager::Bounce,
    /// Buffers finished operations held the last reference to, freed at rest.
    pub(crate) kept: crate::kept::Kept,
    /// The last count of hand-overs seen (`Shared::posted`).
    pub(crate) seen_posted: u64,
    pub(crate) last_health: Instant,
    /// Torn down: passes do nothing (a waiter may still hold the engine).
    pub(crate) down: bool,
    /// See [`crate::drive::Pass::waits_here`].
    pub(crate) waits_here: bool,
}

impl<A: DeviceAdaptor> Engine<A> {
    /// An engine over `peers` that drives their steps through `protocols` (the transports'
    /// registry, which setup hands over so that this module names none of them).
    #[allow(clippy::too_many_arguments)] // what setup built, each part once
    pub fn new(
        protocols: Vec<&'static dyn Protocol<A>>,
        adaptor: A,
        shared: Arc<Shared>,
        boot: Arc<Bootstrap>,
        peers: Vec<Option<PeerConn>>,
        net: Option<SharedNet>,
        config: &crate::config::Config,
        bounces: bool,
    ) -> Result<Self> {
        let send_stream = adaptor.stream_create()?;
        let recv_stream = adaptor.stream_create()?;
        // Eager receives into device memory the CPU cannot write: their stream and bounce
        // buffer now, not at the first message (`Bounce`'s docs say why).
        let eager_stream = bounces.then(|| adaptor.stream_create()).transpose()?;
        let eager_bounce = crate::link::eager::Bounce::made_if(bounces, &adaptor);
        let host_maps = peers.iter().flatten().any(|c| c.roles.maps_peer).then(|| {
            HostMaps::new(
                adaptor.clone(),
                boot.rank(),
                config.host_map_max,
                config.host_pin_piece,
            )
        });
        Ok(Engine {
            protocols,
            adaptor,
            shared,
            boot,
            peers,
            send_stream,
            recv_stream,
            timeout: config.timeout,
            health_interval: config.health_interval,
            spin: config.spin.unwrap_or_default(),
            profile: config.profile.then(Profile::default),
            free_events: Vec::new(),
            host_maps,
            finished: BTreeSet::new(),
            watermark: 0,
            net,
            eager_stream,
            eager_bounce,
            kept: Default::default(),
            seen_posted: 0,
            last_health: Instant::now(),
            down: false,
            waits_here: false,
        })
    }

    /// With nothing in flight, closes a few IPC mappings: stale ones (allocations the peers
    /// freed; not while another communicator of the process joins streams, see
    /// `ipccache::joining_elsewhere`) and those past the cache's bound; whether it did.
    ///
    /// Closing a mapping may wait for the whole device context, including callers' streams
    /// that wait for this communicator's operations, so the cache is trimmed only here: nothing
    /// in flight, and callers held off handing over new operations (`Shared::trimming`) for the
    /// few least recently used mappings closed per pass (~45 µs each on an H200). It is checked
    /// in every pass without work, spinning or not: with the default spin the engine rarely
    /// reaches its parking branch while traffic flows. The cache grows past its bound while
    /// traffic never pauses. Seen on an H200: closing between operations hung, and closing at
    /// idle while a caller posted the next operation stalled it. Posting threads' own copies
    /// (`IpcCache::caller_copies`) hold it off too. Buffers whose last reference a finished
    /// operation held are freed here as well, under the same conditions (`crate::kept`).
    pub(crate) fn trim_at_rest(&mut self) -> bool {
        self.note_freed(true);
        // Stale mappings only while no other communicator of the process joins streams;
        // mappings past the bound whatever the others do, as before stale ones were known
        // (a bounded cache is worth that rare close; see architecture.md, "Stale mappings").
        let stale = !crate::ipccache::joining_elsewhere(self.shared.joining.is_some());
        let (close, free) = (
            lock(&self.shared.ipc).to_trim(stale, 8),
            self.kept.due(stale),
        );
        if (close == 0 && !free) || !self.streams_idle() {
            return false;
        }
        let quiet = {
            let inbox = lock(&self.shared.inbox);
            // Late-copy posts between numbering and handing over have streams waiting already.
            let quiet =
                inbox.ops.is_empty() && self.shared.late_posting.load(Ordering::Acquire) == 0;
            self.shared.trimming.store(quiet, Ordering::Release);
            quiet
        };
        if quiet {
            self.trim_ipc_cache(stale, 8);
            self.kept.release();
            self.shared.trimming.store(false, Ordering::Release);
        }
        quiet
    }

    /// Late-copy pairs: marks stale the mappings of allocations each peer said it freed (its
    /// freed ring, `link::named`), and tells the peer once none of them is mapped here any
    /// more (closed at rest by [`Engine::trim_at_rest`], or never opened); it then names its
    /// new allocations at those addresses again. Every pass for new records (a peer may be
    /// waiting: one load per peer where nothing is new); with `recheck` (at rest, where stale
    /// mappings are closed) also for records read before whose mappings were still open.
    pub(crate) fn note_freed(&mut self, recheck: bool) {
        for conn in self.peers.iter_mut().flatten() {
            let published = conn.inc.load(Counter::Freed);
            if published == conn.freed_told || (published == conn.freed_seen && !recheck) {
                continue;
            }
            let mut ipc = lock(&self.shared.ipc);
            for n in conn.freed_seen..published {
                let span = conn.inc.freed(n);
                tracing::debug!(
                    "rank {} freed allocation {:#x} ({} bytes), record {n}: its mappings \
                     here are stale",
                    conn.peer,
                    span.base,
                    span.len
                );
                ipc.mark_freed(conn.peer, span);
            }
            conn.freed_seen = published;
            if !ipc.maps_stale(conn.peer) {
                tracing::debug!(
                    "told rank {} it is unmapped up to record {published}",
                    conn.peer
                );
                conn.inc.store(Counter::Unmapped, published);
                conn.freed_told = published;
            }
        }
    }

    pub(crate) fn admit(&mut self, mut op: Op) {
        let peer = op.peer;
        let Some(conn) = self.peers.get_mut(peer).and_then(|c| c.as_mut()) else {
            let e = CommError::InvalidArgument(format!("no connection to rank {peer}"));
            return self.finish(op, Err(e));
        };
        // A receive from a lost rank still takes what it sent before it went: on another host
        // it looks for it (`transport::net`); here, a message waiting in an eager slot.
        let left_behind = op.dir == Dir::Recv
            && (conn.transport == TransportKind::Net || conn.eager_waiting(op.index));
        if let Some(reason) = conn.lost.clone().filter(|_| !left_behind) {
            self.release(&mut op);
            return self.finish(op, Err(CommError::PeerLost { peer, reason }));
        }
        if let Some(Resume::Failed(_)) = &op.resume {
            let Some(Resume::Failed(e)) = op.resume.take() else {
                unreachable!("matched above")
            };
            fail_locally(conn, &self.shared, op.dir, op.index, &e);
            return self.finish(op, Err(*e));
        }
        let index = op.index;
        let phase = match Phase::first(&mut op, conn.transport, conn.roles) {
            Ok(p) => p,
            Err(e) => {
                fail_locally(conn, &self.shared, op.dir, index, &e);
                return self.finish(op, Err(e));
            }
        };
        let path = match conn.transport {
            TransportKind::Ipc => Path::Ipc,
            TransportKind::Staged => Path::Staged,
            TransportKind::Net => Path::Net,
        };
        let step = Step {
            op,
            index,
            phase,
            path,
            progressed: Instant::now(),
            admitted: Instant::now(),
            matched: None,
        };
        match step.op.dir {
            Dir::Send => conn.sends.push_back(step),
            Dir::Recv => conn.recvs.push_back(step),
        }
    }

    fn finish(&mut self, mut op: Op, r: Result<usize>) {
        op.settle_stand_in(r.is_ok());
        if let Err(e) = &r {
            self.shared.record_error(e);
            tracing::debug!(seq = op.seq, peer = op.peer, "operation failed: {e}");
        }
        // The start event has served its purpose.
        if let Some(start) = op.start {
            recycle_event(&self.adaptor, &self.shared, start);
        }
        // A posting thread's copy the operation still held (it failed or timed out first).
        if let Some(Resume::Pushed(ev) | Resume::Pulled { ev, .. }) = op.resume {
            self.caller_copy_over(ev);
        }
        // Before the request completes: a caller that waited for it may post the next message
        // eagerly, which needs this one to be off the books.
        if let Some(p) = self.shared.pending.get(op.peer) {
            p[op.dir as usize].fetch_sub(1, Ordering::AcqRel);
        }
        let failed = r.as_ref().err().cloned();
        op.slot.complete(r);
        crate::guard::after_failure(&self.shared, &op.slot, failed, op.peer);
        self.kept.take(op.keep, op.bytes);
        self.finished.insert(op.seq);
        let mut w = self.watermark;
        while self.finished.remove(&(w + 1)) {
            w += 1;
        }
        if w != self.watermark {
            self.watermark = w;
            self.shared.publish_watermark(&self.adaptor, w);
        }
    }

    /// A copy's event completed: back to the pool it came from. A posting thread's copy (see
    /// [`Resume`]) no longer holds its IPC mapping open.
    pub(crate) fn copy_done(&mut self, op: &mut Op, ev: EventHandle) {
        match op.resume.take() {
            Some(Resume::Pushed(_) | Resume::Pulled { .. }) => self.caller_copy_over(ev),
            _ => self.free_events.push(ev),
        }
    }

    /// Settles the event of a posting thread's copy whose operation ends: the copy no longer
    /// counts in `caller_copies` once its event completed. One that has not (the operation
    /// failed or timed out around it) keeps counting, so no mapping is ever closed under it;
    /// that only stops trimming.
    pub(crate) fn caller_copy_over(&mut self, ev: EventHandle) {
        if self.adaptor.event_query(ev).unwrap_or(false) {
            lock(&self.shared.ipc).caller_copies -= 1;
        }
        recycle_event(&self.adaptor, &self.shared, ev);
    }

    pub(crate) fn event(&mut self) -> Result<EventHandle> {
        match self.free_events.pop() {
            Some(e) => Ok(e),
            None => Ok(self.adaptor.event_create(false)?),
        }
    }

    /// Enqueues `copy` on `stream` and records an event that completes with the copy. The
    /// caller checked that the operation's caller stream passed its start (see `started`).
    pub(crate) fn enqueue(
        &mut self,
        stream: StreamHandle,
        copy: impl FnOnce(&A) -> flagcx_adaptor::Result<()>,
    ) -> Result<EventHandle> {
        copy(&self.adaptor)?;
        let ev = self.event()?;
        self.adaptor.event_record(ev, stream)?;
        Ok(ev)
    }

    /// Advances the front send and front receive of one peer; true if anything moved.
    pub(crate) fn progress_peer(&mut self, p: usize) -> bool {
        let mut moved = false;
        for dir in [Dir::Send, Dir::Recv] {
            loop {
                let Some(conn) = self.peers[p].as_mut() else {
                    return moved;
                };
                let q = match dir {
                    Dir::Send => &mut conn.sends,
                    Dir::Recv => &mut conn.recvs,
                };
                let Some(mut step) = q.pop_front() else { break };
                let lost = conn.lost.clone();
                let r = match self.protocols.iter().copied().find(|pr| pr.drives(&step)) {
                    Some(pr) => pr.step(self, p, &mut step),
                    None => Err(CommError::Protocol(format!(
                        "no protocol drives a {dir:?} step with rank {p} ({})",
                        step.phase.waiting_for()
                    ))),
                };
                let r = match r {
                    Ok(pr) => pr,
                    Err(e) => {
                        // A local failure mid-message: tell the peer (so its side fails instead
                        // of waiting), settle our own in-flight copies, and retire the pair —
                        // its counters no longer agree with the peer's.
                        self.abandon(p, &mut step);
                        if let Some(c) = self.peers[p].as_mut() {
                            fail_locally(c, &self.shared, dir, step.index, &e);
                        }
                        Progress::Done(Err(e))
                    }
                };
                match r {
                    Progress::Done(res) => {
                        moved = true;
                        if let Ok(n) = res {
                            self.shared.path_bytes[step.path as usize]
                                .fetch_add(n as u64, Ordering::Relaxed);
                        }
                        if let (Some(pr), true, Some(posted)) =
                            (self.profile.as_mut(), res.is_ok(), step.op.posted)
                        {
                            pr.add(dir, posted, step.admitted, step.matched);
                        }
                        self.finish(step.op, res);
                    }
                    Progress::Moved => {
                        moved = true;
                        step.progressed = Instant::now();
                        self.requeue_front(p, dir, step);
                        break;
                    }
                    Progress::Idle { on_peer } => {
                        self.waits_here |= !on_peer;
                        let stalled = self.timeout.filter(|t| step.progressed.elapsed() > *t);
                        match (lost.filter(|_| on_peer), stalled) {
                            (Some(reason), _) => {
                                moved = true;
                                self.abandon(p, &mut step);
                                let e = CommError::PeerLost { peer: p, reason };
                                self.finish(step.op, Err(e));
                            }
                            (None, Some(t)) => {
                                moved = true;
                                self.abandon(p, &mut step);
                                // The pair's shared state is now out of step: retire it.
                                let what = format!(
                                    "{} of {} bytes with rank {p} made no progress: {}",
                                    match step.op.dir {
                                        Dir::Send => "send",
                                        Dir::Recv => "receive",
                                    },
                                    step.op.bytes,
                                    step.phase.waiting_for()
                                );
                                if let Some(c) = self.peers[p].as_mut() {
                                    let why = format!("an operation timed out ({what})");
                                    retire_both_ways(c, &self.shared, why);
                                }
                                let e = CommError::Timeout {
                                    ms: t.as_millis() as u64,
                                    peer: Some(p),
                                    what,
                                };
                                self.finish(step.op, Err(e));
                            }
                            (None, None) => {
                                self.requeue_front(p, dir, step);
                                break;
                            }
                        }
                    }
                }
            }
        }
        moved
    }

    /// `step` leaves its queue unfinished: its caller's stream is let go (see
    /// [`Engine::release`]) and every protocol settles what it holds of it.
    fn abandon(&mut self, p: usize, step: &mut Step) {
        self.release(&mut step.op);
        self.settle(p, step);
    }

    /// Every protocol settles what it holds of `step` (`Protocol::abandon`).
    fn settle(&mut self, p: usize, step: &mut Step) {
        for i in 0..self.protocols.len() {
            let pr = self.protocols[i];
            pr.abandon(self, p, step);
        }
    }

    /// `op` is failed without its peer: every protocol ends its caller stream's waits, then
    /// lets the stream pass it.
    fn release(&self, op: &mut Op) {
        self.release_all(std::slice::from_mut(op));
    }

    /// [`Engine::release`] for several operations at once: every wait of theirs ends before any
    /// is waited for.
    fn release_all(&self, ops: &mut [Op]) {
        for pr in &self.protocols {
            ops.iter().for_each(|op| pr.unblock(self, op));
        }
        for pr in &self.protocols {
            ops.iter_mut().for_each(|op| pr.release(self, op));
        }
    }

    pub(crate) fn requeue_front(&mut self, p: usize, dir: Dir, step: Step) {
        if let Some(conn) = self.peers[p].as_mut() {
            match dir {
                Dir::Send => conn.sends.push_front(step),
                Dir::Recv => conn.recvs.push_front(step),
            }
        }
    }

    pub(crate) fn streams_idle(&self) -> bool {
        [self.send_stream, self.recv_stream]
            .iter()
            .all(|&s| self.adaptor.stream_query(s).unwrap_or(false))
    }

    /// Marks peers whose bootstrap socket hung up; their stuck operations then fail.
    pub(crate) fn check_peers(&mut self) {
        for conn in self.peers.iter_mut().flatten() {
            if conn.lost.is_some() || conn.idle() {
                continue;
            }
            if self.boot.peer_fd(conn.peer).is_some_and(hung_up) {
                tracing::warn!(peer = conn.peer, "peer hung up");
                let why = "the process exited or closed its communicator".into();
                conn.retire(&self.shared, why);
            }
        }
    }

    /// Fails what is left and releases the engine's resources; later passes do nothing.
    pub(crate) fn teardown(&mut self) {
        self.down = true;
        if let Some(p) = self.profile.as_mut() {
            p.ipc_opens = lock(&self.shared.ipc).opens;
            p.report(self.boot.rank());
            crate::profile::report_declined(self.boot.rank(), &self.shared.eager_declined);
            let n = |h: Handoff| self.shared.caller_handoffs[h as usize].load(Ordering::Relaxed);
            eprintln!(
                "flagcx profile rank {}: {} IPC operations finished by their posting thread; \
                 handed to the proxy: {} before the peer's descriptor came, {} while the copy \
                 ran ({} pushes, {} pulls), {} before the peer answered, {} failed",
                self.boot.rank(),
                self.shared.caller_ops.load(Ordering::Relaxed),
                n(Handoff::Fresh),
                n(Handoff::Pushed) + n(Handoff::Pulled),
                n(Handoff::Pushed),
                n(Handoff::Pulled),
                n(Handoff::Published),
                n(Handoff::Failed)
            );
        }
        let aborted = self.shared.aborted.load(Ordering::Acquire);
        if aborted {
            tracing::warn!("communicator aborted: failing every pending operation");
            // Peers fail what they have with this rank at once instead of waiting for it.
            for conn in self.peers.iter_mut().flatten() {
                retire_both_ways(conn, &self.shared, "this rank aborted".into());
            }
        }
        let mut steps = Vec::new();
        for conn in self.peers.iter_mut().flatten() {
            steps.extend(conn.sends.drain(..).chain(conn.recvs.drain(..)));
        }
        let mut left = Vec::new();
        for mut s in steps {
            self.settle(s.op.peer, &mut s);
            left.push(s.op);
        }
        left.extend(std::mem::take(&mut lock(&self.shared.inbox).ops));
        // No caller's stream may wait for good on a message that will never come.
        self.release_all(&mut left);
        let _ = self.adaptor.stream_synchronize(self.send_stream);
        let _ = self.adaptor.stream_synchronize(self.recv_stream);
        // What an abort or the stall guard told waiters already (`Aborted` at shutdown).
        let why = self.shared.verdict.get().unwrap_or(CommError::Aborted);
        for mut op in left {
            if let (Some(Resume::Net(mut req)), Some(net)) = (op.resume.take(), &self.net) {
                lock(net).cancel(&mut req);
            }
            // A copy a posting thread issued on its stream may still use a mapping, which
            // closes below: let it finish first (`finish` then settles its event).
            if let Some(Resume::Pushed(ev) | Resume::Pulled { ev, .. }) = op.resume {
                let _ = self.adaptor.event_synchronize(ev);
            }
            self.finish(op, Err(why.clone()));
        }
        self.flush_ipc_cache();
        // Every operation finished above, its streams released.
        self.kept.release();
        if let Some(m) = self.host_maps.as_mut() {
            // Both streams were synchronized above: no copy touches the mappings.
            m.close();
        }
        let spares = std::mem::take(&mut *lock(&self.shared.spare_events));
        for e in self.free_events.drain(..).chain(spares) {
            let _ = self.adaptor.event_destroy(e);
        }
        for conn in self.peers.iter_mut().flatten() {
            for e in conn
                .send_ring
                .chunks
                .drain(..)
                .chain(conn.recv_ring.chunks.drain(..))
            {
                let _ = self.adaptor.event_destroy(e);
            }
            // SAFETY: both proxy streams are idle, so no copy uses the rings.
            unsafe { conn.release_rings(&self.adaptor) };
        }
        if let Some(net) = self.net.take() {
            let lost: Vec<bool> = self
                .peers
                .iter()
                .map(|c| c.as_ref().is_some_and(|c| c.lost.is_some()))
                .collect();
            lock(&net).close(&self.adaptor, aborted, &lost);
        }
        let _ = self.adaptor.stream_destroy(self.send_stream);
        let _ = self.adaptor.stream_destroy(self.recv_stream);
        if let Some(s) = self.eager_stream.take() {
            let _ = self.adaptor.stream_destroy(s);
        }
        self.eager_bounce.release(&self.adaptor);
    }

    /// Closes every IPC mapping at teardown (none where a late copy that did not pass its
    /// release may still copy through one).
    pub(crate) fn flush_ipc_cache(&mut self) {
        if self.shared.late_kept.load(Ordering::Acquire) {
            return;
        }
        let _ = self.adaptor.stream_synchronize(self.send_stream);
        let _ = self.adaptor.stream_synchronize(self.recv_stream);
        // SAFETY: both proxy streams are idle and no caller is left that could copy (the
        // communicator is being destroyed, and each caller's copy was waited for before its
        // operation finished), so no copy uses a mapping.
        unsafe { lock(&self.shared.ipc).close_all(&self.adaptor) };
    }

    /// Closes [`crate::ipccache::IpcCache::to_trim`]`(stale, n)` mappings: stale ones first, then the least
    /// recently used (the caller checked that both proxy streams are idle and held off new
    /// posts).
    pub(crate) fn trim_ipc_cache(&mut self, stale: bool, n: usize) {
        let t0 = Instant::now();
        // Held throughout: a posting thread cannot take a mapping while it closes.
        let mut cache = lock(&self.shared.ipc);
        let n = cache.to_trim(stale, n);
        let victims = cache.victims(n);
        let closed = victims.len() as u64;
        // SAFETY: both proxy streams are idle, no posting thread's copy is in flight
        // (`caller_copies`, checked under this lock) and new posts are held off, so no copy
        // uses them and no stream waits for this communicator.
        unsafe { cache.close(&self.adaptor, &victims) };
        if let Some(p) = self.profile.as_mut() {
            p.ipc_closes += closed;
            p.ipc_close_secs += t0.elapsed().as_secs_f64();
        }
    }
}

/// Retires the pair in both directions and tells the peer through the channels' fault
/// counters ([`RETIRED`]): whatever it has not started yet fails there with `RemoteFailure`
/// instead of moving bytes into or out of this rank's buffers — the peer may only be stopped,
/// and continue later.
fn retire_both_ways(conn: &mut PeerConn, shared: &Shared, why: String) {
    conn.out.store(Counter::SendFault, RETIRED);
    conn.inc.store(Counter::RecvFault, RETIRED);
    conn.retire(shared, why);
}

/// A local failure (`e`) of message `index` mid-protocol: tells the peer, so its side fails
/// instead of waiting, and retires the pair — its counters no longer agree with the peer's.
fn fail_locally(conn: &mut PeerConn, shared: &Shared, dir: Dir, index: u64, e: &CommError) {
    let (ch, counter) = match dir {
        Dir::Send => (&conn.out, Counter::SendFault),
        Dir::Recv => (&conn.inc, Counter::RecvFault),
    };
    ch.store(counter, index + 1);
    conn.retire(shared, format!("a local {dir:?} failed: {e}"));
}
