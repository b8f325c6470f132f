//! IPC: same-vendor pairs, one device copy between the two ranks' buffers.
//!
//! The copier (each sender by default; one rank per pair with `FLAGCX_P2P_IPC_COPIER`) opens
//! the peer's allocation from its byte-form handle once ([`IpcCache`]) and copies straight into
//! the receiver's buffer (push) or out of the sender's (pull). Outside a group the posting
//! thread moves a message itself where nothing earlier of its pair is in flight
//! ([`Comm::try_caller_ipc`], `FLAGCX_P2P_IPC_CALLER`); what it does not finish within its
//! spin time goes to the engine from where it stands ([`Resume`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, EventHandle, IpcMemHandle, StreamHandle};

use super::{
    answer, export, give_verdict, pull_without_copy, push_without_copy, send_failure,
    verdict_result, Path, Step,
};
use crate::channel::{Channel, Counter, RecvDesc, SendDesc, SendStatus, Span};
use crate::comm::{Comm, State};
use crate::engine::{lock, recycle_event, Dir, Engine, Resume};
use crate::error::{CommError, Result};
use crate::peer::TransportKind;
use crate::Request;

/// Peer allocations the proxy keeps open for IPC copies; past it, the least recently used are
/// closed, a few per pass while nothing is in flight (see the idle branch of `Engine::run`).
pub(crate) const IPC_CACHE_MAX: usize = 256;

/// One open mapping of a peer's allocation.
#[derive(Clone, Copy)]
pub(crate) struct Mapping {
    /// Where it is mapped here.
    base: DevicePtr,
    /// The rank that exported it, and where the allocation lies in that rank's process.
    peer: usize,
    span: Span,
    /// A later allocation of the same peer overlapped it: the peer freed this one. Closed at
    /// rest ([`Engine::trim_at_rest`]), before the least recently used.
    stale: bool,
}

/// A peer's allocation that a copy reaches through the cache: its rank, handle and span (as
/// its descriptor named them).
#[derive(Clone, Copy)]
pub(crate) struct Theirs {
    pub(crate) peer: usize,
    pub(crate) handle: Option<IpcMemHandle>,
    pub(crate) span: Span,
}

impl Theirs {
    /// The allocation a receive descriptor names.
    pub(crate) fn recv(peer: usize, d: &RecvDesc) -> Self {
        Theirs {
            peer,
            handle: d.handle,
            span: d.span,
        }
    }

    /// The allocation a send descriptor (an offer) names.
    pub(crate) fn send(peer: usize, d: &SendDesc) -> Self {
        Theirs {
            peer,
            handle: d.handle,
            span: d.span,
        }
    }
}

/// Open peer allocations (IPC mappings) and when each was last used.
#[derive(Default)]
pub(crate) struct IpcCache {
    map: HashMap<[u8; IpcMemHandle::WIRE_LEN], (Mapping, u64)>,
    uses: u64,
    /// No caller's stream ever waits for this communicator (`FLAGCX_STREAM_JOIN=none`), so a
    /// mapping may be closed while operations are in flight: closing one may wait for the
    /// whole device context, which with joins includes streams waiting for the very operation
    /// that needs the new mapping (seen on an H100: the ring hung).
    close_in_flight: bool,
    /// Copies that posting threads issued on their own streams through a mapping of this cache
    /// and whose completion nobody has seen yet: while there are any, no mapping is closed
    /// (the proxy's streams being idle says nothing about the callers' streams).
    pub caller_copies: usize,
    /// Handles opened (cache misses), for `FLAGCX_PROFILE`.
    pub opens: u64,
    /// Mappings closed while running (past the bound, or stale), for [`crate::Comm::stats`].
    pub closes: u64,
    /// Late copies (`transport::late`) in flight through each mapping: those are never closed
    /// when a stale mapping must go (see [`IpcCache::open_busy`]).
    busy: HashMap<[u8; IpcMemHandle::WIRE_LEN], u32>,
}

/// Whether `e` is the runtime refusing to map memory this process has mapped already (CUDA's
/// `CUDA_ERROR_ALREADY_MAPPED`, HIP's `hipErrorAlreadyMapped`): a peer freed an allocation we
/// keep mapped and reused its memory for the one behind the new handle.
fn already_mapped(e: &CommError) -> bool {
    matches!(e, CommError::Adaptor(flagcx_adaptor::AdaptorError::Vendor { name, .. })
        if name.to_ascii_lowercase().contains("already_mapped")
            || name.to_ascii_lowercase().contains("alreadymapped"))
}

impl IpcCache {
    /// An empty cache; `close_in_flight`: see [`IpcCache::close_in_flight`].
    pub(crate) fn new(close_in_flight: bool) -> Self {
        IpcCache {
            close_in_flight,
            ..IpcCache::default()
        }
    }

    /// Whether the cache holds more mappings than its bound or stale ones, with no posting
    /// thread's copy in flight (then the engine may trim it while idle).
    pub(crate) fn wants_trim(&self) -> bool {
        self.caller_copies == 0
            && (self.map.len() > IPC_CACHE_MAX || self.map.values().any(|(m, _)| m.stale))
    }

    /// The keys of `theirs.peer`'s mappings that overlap `theirs`.
    fn overlapped(&self, theirs: &Theirs) -> Vec<[u8; IpcMemHandle::WIRE_LEN]> {
        self.map
            .iter()
            .filter(|(_, (m, _))| m.peer == theirs.peer && m.span.overlaps(&theirs.span))
            .map(|(k, _)| *k)
            .collect()
    }

    /// Closes the mappings of `keys`.
    ///
    /// # Safety
    /// No copy uses any of them, and closing cannot wait for a stream that waits for this
    /// communicator (see [`IpcCache::close_in_flight`] and [`Engine::trim_at_rest`]).
    unsafe fn close<A: DeviceAdaptor>(
        &mut self,
        adaptor: &A,
        keys: &[[u8; IpcMemHandle::WIRE_LEN]],
    ) {
        for k in keys {
            if let Some((m, _)) = self.map.remove(k) {
                // SAFETY: the caller's contract.
                let _ = unsafe { adaptor.ipc_close(m.base) };
                self.closes += 1;
            }
        }
    }

    /// Maps the peer's allocation behind `theirs.handle`, or reuses an earlier mapping of it.
    ///
    /// Mappings of the same peer whose allocations overlap the new one are stale: the peer
    /// freed them (two of its live allocations never overlap), so no copy can be using one (a
    /// peer frees a buffer only once its operations are done, and those end after this rank's
    /// copies through it). They are marked and closed at rest. Where the runtime refuses the
    /// new mapping beside them (CUDA's `CUDA_ERROR_ALREADY_MAPPED`, seen with threads freeing
    /// and allocating buffers between messages) and no caller's stream waits for this
    /// communicator ([`IpcCache::close_in_flight`]), they are closed at once and the open is
    /// tried again; otherwise the refusal is the operation's failure. A mapping a counted late
    /// copy holds is never closed here.
    pub fn open<A: DeviceAdaptor>(&mut self, adaptor: &A, theirs: Theirs) -> Result<DevicePtr> {
        let handle = theirs
            .handle
            .ok_or_else(|| CommError::Protocol("IPC descriptor without a handle".into()))?;
        let key = handle.to_wire();
        self.uses += 1;
        if let Some(e) = self.map.get_mut(&key) {
            e.1 = self.uses;
            return Ok(e.0.base);
        }
        let stale = self.overlapped(&theirs);
        let base = match adaptor.ipc_open_handle(&handle).map_err(CommError::from) {
            Err(e) if self.close_in_flight && !stale.is_empty() && already_mapped(&e) => {
                let idle: Vec<_> = stale
                    .iter()
                    .filter(|k| !self.busy.contains_key(*k))
                    .copied()
                    .collect();
                tracing::debug!(n = idle.len(), "{e}: closing the stale IPC mappings");
                // SAFETY: stale (see above), held by no late copy (`busy`), and no stream
                // waits for this communicator.
                unsafe { self.close(adaptor, &idle) };
                adaptor.ipc_open_handle(&handle)?
            }
            r => r?,
        };
        for k in &stale {
            if let Some((m, _)) = self.map.get_mut(k) {
                m.stale = true;
            }
        }
        self.opens += 1;
        let m = Mapping {
            base,
            peer: theirs.peer,
            span: theirs.span,
            stale: false,
        };
        self.map.insert(key, (m, self.uses));
        Ok(base)
    }

    /// [`IpcCache::open`] for a late copy, counted busy until [`IpcCache::done_busy`]. Where the
    /// runtime says the memory is mapped already and `all_tracked` (every copy through this
    /// cache is a counted late copy), the mappings no copy is using are closed — the stale one
    /// among them belonged to an allocation the peer freed, which it could only do once our
    /// copies through it were done — and the open is tried once more.
    pub fn open_busy<A: DeviceAdaptor>(
        &mut self,
        adaptor: &A,
        theirs: Theirs,
        all_tracked: bool,
    ) -> Result<DevicePtr> {
        let b = match self.open(adaptor, theirs) {
            Err(e) if all_tracked && already_mapped(&e) => {
                let idle: Vec<_> = self
                    .map
                    .keys()
                    .filter(|k| self.busy.get(*k).map_or(true, |n| *n == 0))
                    .copied()
                    .collect();
                tracing::debug!(n = idle.len(), "{e}: closing the idle IPC mappings, once");
                // SAFETY: no late copy uses them (`busy`), and every copy through this cache is
                // one (`all_tracked`).
                unsafe { self.close(adaptor, &idle) };
                self.open(adaptor, theirs)?
            }
            r => r?,
        };
        if let Some(h) = theirs.handle {
            *self.busy.entry(h.to_wire()).or_default() += 1;
        }
        self.caller_copies += 1;
        Ok(b)
    }

    /// Ends a late copy counted by [`IpcCache::open_busy`] through `handle`'s mapping.
    pub fn done_busy(&mut self, handle: &IpcMemHandle) {
        let key = handle.to_wire();
        if let Some(n) = self.busy.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.busy.remove(&key);
            }
        }
        self.caller_copies -= 1;
    }
}

/// The keys of up to `n` entries of `cache` (values: `(_, last use)`) to drop so that it holds
/// at most `max`, least recently used first.
pub(crate) fn lru_victims<K: Copy, V>(
    cache: &HashMap<K, (V, u64)>,
    max: usize,
    n: usize,
) -> Vec<K> {
    let excess = cache.len().saturating_sub(max).min(n);
    let mut by_age: Vec<(u64, K)> = cache.iter().map(|(k, v)| (v.1, *k)).collect();
    by_age.sort_unstable_by_key(|&(used, _)| used);
    by_age.into_iter().take(excess).map(|(_, k)| k).collect()
}

/// The API side's handle on an IPC pair, for operations the posting thread moves itself
/// ([`crate::Config::ipc_caller`]).
pub(crate) struct CallerLink {
    /// This rank → peer.
    pub(crate) out: Arc<Channel>,
    /// Peer → this rank.
    pub(crate) inc: Arc<Channel>,
    /// This rank copies what it sends into the peer's buffer (else the peer pulls it).
    pub(crate) push: bool,
    /// This rank copies what it receives out of the peer's buffer (else the peer pushes it).
    pub(crate) pull: bool,
}

/// One message a posting thread moves: its direction, number, buffer and peer.
#[derive(Clone, Copy)]
pub(crate) struct Msg {
    pub(crate) dir: Dir,
    pub(crate) k: u64,
    pub(crate) ptr: DevicePtr,
    pub(crate) bytes: usize,
    pub(crate) peer: usize,
}

impl CallerLink {
    /// The channel carrying messages of `dir`, and the counters through which the peer
    /// answers there (its descriptor or answer, and its failure).
    pub(crate) fn lane(&self, dir: Dir) -> (&Channel, Counter, Counter) {
        match dir {
            Dir::Send => (&self.out, Counter::RecvPosted, Counter::RecvFault),
            Dir::Recv => (&self.inc, Counter::SendPosted, Counter::SendFault),
        }
    }
}

/// What became of an IPC operation the posting thread took on.
pub(crate) enum Caller {
    /// Finished.
    Done(Result<usize>),
    /// The proxy goes on from here (`None`: from the start).
    HandOff(Option<Resume>),
}

/// How much longer than the spin time a posting thread waits for a copy that is already
/// running (its own, or the peer's copy of its message, see [`Counter::Issued`]) before
/// handing the operation to the proxy. A hand-over costs the pair a stream wait on the device
/// and a round through both proxies (~20 µs per hop on one H200); waiting for a running copy
/// is bounded by its size (1 GiB: 0.5 ms on an H200).
pub(crate) const RUNNING_COPY_WAIT: Duration = Duration::from_millis(2);

/// Polls `ready` until it gives a value, for up to `budget()` (at least once; `spin` zero:
/// exactly once), reading the clock and the budget every 64 polls (they cost more than a poll
/// of shared memory). Between polls: [`flagcx_adaptor::spin::relax`], for waits that this
/// process's own threads (proxy, stream workers) may have to serve.
pub(crate) fn poll_for<T>(
    spin: Duration,
    budget: impl Fn() -> Duration,
    ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    poll_with(spin, budget, ready, |_| flagcx_adaptor::spin::relax()).map(|(v, _)| v)
}

/// [`poll_for`] for a store only the peer's process makes (an eager message): between polls
/// [`flagcx_adaptor::spin::relax_on_peer`], which yields the core less often. With the value,
/// about how long it waited: the time at the last clock read, so zero when it came within the
/// first 64 polls (no clock read beyond the start's on that path, which is latency's).
pub(crate) fn poll_peer_for<T>(
    spin: Duration,
    budget: impl Fn() -> Duration,
    ready: impl FnMut() -> Option<T>,
) -> Option<(T, Duration)> {
    poll_with(spin, budget, ready, flagcx_adaptor::spin::relax_on_peer)
}

/// The clock starts at the first poll that finds nothing: a value already there costs none.
fn poll_with<T>(
    spin: Duration,
    budget: impl Fn() -> Duration,
    mut ready: impl FnMut() -> Option<T>,
    relax: impl Fn(u32),
) -> Option<(T, Duration)> {
    let mut t0: Option<std::time::Instant> = None;
    let mut waited = Duration::ZERO;
    let mut polls = 0u32;
    loop {
        if let Some(v) = ready() {
            return Some((v, waited));
        }
        polls = polls.wrapping_add(1);
        if spin.is_zero() {
            return None;
        }
        let t0 = *t0.get_or_insert_with(std::time::Instant::now);
        if polls % 64 == 0 {
            waited = t0.elapsed();
            if waited >= budget() {
                return None;
            }
        }
        relax(polls);
    }
}

/// The wait budget beside a copy that `running` says is under way: the spin time, plus
/// [`RUNNING_COPY_WAIT`] while it runs (spinning at all only where the spin time allows it).
pub(crate) fn running_copy_budget(spin: Duration, running: bool) -> Duration {
    if running && !spin.is_zero() {
        spin + RUNNING_COPY_WAIT
    } else {
        spin
    }
}

impl<A: DeviceAdaptor> Engine<A> {
    /// Maps the peer's allocation, or reuses an earlier mapping of it.
    pub(crate) fn open_ipc(&mut self, theirs: Theirs) -> Result<DevicePtr> {
        lock(&self.shared.ipc).open(&self.adaptor, theirs)
    }

    /// Opens (or reuses) the receiver's allocation and enqueues the one copy into it.
    pub(crate) fn issue_ipc_copy(&mut self, step: &Step, desc: &RecvDesc) -> Result<EventHandle> {
        let base = self.open_ipc(Theirs::recv(step.op.peer, desc))?;
        let dst = DevicePtr(base.0 + desc.offset);
        let (src, n, stream) = (step.op.ptr, step.op.bytes, self.send_stream);
        self.enqueue(stream, |a| {
            // SAFETY: `dst..dst+n` lies in the receiver's buffer (it announced `desc.size >= n`
            // at `offset` of that allocation, which it keeps until we answer); `src` is the
            // caller's buffer, valid until the operation completes.
            unsafe { a.memcpy_d2d_async(dst, src, n, stream) }
        })
    }

    /// Opens (or reuses) the sender's allocation and enqueues the one copy out of it into the
    /// caller's receive buffer.
    pub(crate) fn issue_ipc_pull(&mut self, step: &Step, offer: &SendDesc) -> Result<EventHandle> {
        let base = self.open_ipc(Theirs::send(step.op.peer, offer))?;
        let src = DevicePtr(base.0 + offer.offset);
        let (dst, n, stream) = (step.op.ptr, offer.size as usize, self.recv_stream);
        self.enqueue(stream, |a| {
            // SAFETY: `src..src+n` lies in the sender's buffer (it offered `n` bytes at `offset`
            // of that allocation and keeps them until our verdict); the destination is the
            // caller's buffer with `n <= bytes` (checked by the caller), valid until the
            // operation completes.
            unsafe { a.memcpy_d2d_async(dst, src, n, stream) }
        })
    }

    pub(crate) fn flush_ipc_cache(&mut self) {
        // A late copy that did not pass its release may still copy through a mapping.
        if self.shared.late_kept.load(Ordering::Acquire) {
            return;
        }
        let _ = self.adaptor.stream_synchronize(self.send_stream);
        let _ = self.adaptor.stream_synchronize(self.recv_stream);
        for (_, (m, _)) in lock(&self.shared.ipc).map.drain() {
            // SAFETY: both proxy streams are idle and no caller is left that could copy (the
            // communicator is being destroyed, and each caller's copy was waited for before
            // its operation finished), so no copy uses the mapping.
            let _ = unsafe { self.adaptor.ipc_close(m.base) };
        }
    }

    /// Closes up to `n` mappings: stale ones first, then the least recently used beyond the
    /// bound (the caller checked that both proxy streams are idle and held off new posts).
    pub(crate) fn trim_ipc_cache(&mut self, n: usize) {
        let t0 = Instant::now();
        // Held throughout: a posting thread cannot take a mapping while it closes.
        let mut cache = lock(&self.shared.ipc);
        if cache.caller_copies > 0 {
            return;
        }
        let mut victims: Vec<_> = cache
            .map
            .iter()
            .filter(|(_, (m, _))| m.stale)
            .map(|(k, _)| *k)
            .take(n)
            .collect();
        if victims.is_empty() {
            victims = lru_victims(&cache.map, IPC_CACHE_MAX, n);
        }
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
        keep: &mut Option<Box<dyn std::any::Any + Send>>,
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
        let (seq, slot) = self.caller_hand_over(&m, start, resume, self.slot(m.peer), keep);
        if join {
            self.join_stream(stream, seq, false)?;
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
    /// [`IpcCache::caller_copies`], so its mapping stays open.
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
        let issued = {
            let mut cache = lock(&self.shared.ipc);
            let issued = cache.open(&self.adaptor, theirs).and_then(|base| {
                let theirs = DevicePtr(base.0 + offset);
                let (dst, src) = if push { (theirs, ptr) } else { (ptr, theirs) };
                // SAFETY: the peer's buffer lies at `offset` of its allocation, which it
                // described for this message (a receive of at least `n` bytes, or an offer of
                // `n`) and keeps until this side answers; `ptr..ptr+n` was checked to lie in
                // one allocation of this adaptor (for a pull, `n` is at most the receive's
                // size), valid until the operation finishes; the stream orders the copy after
                // the caller's earlier work on the buffer.
                unsafe { self.adaptor.memcpy_d2d_async(dst, src, n, stream) }?;
                Ok(())
            });
            if issued.is_ok() {
                cache.caller_copies += 1;
            }
            issued
        };
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::time::{Duration, Instant};

    #[test]
    pub(crate) fn ipc_cache_trims_least_recently_used_beyond_the_bound() {
        // Key i last used at (i * 7) % 10: ages 0, 7, 4, 1, 8, 5, 2, 9, 6, 3.
        let cache: std::collections::HashMap<u32, ((), u64)> =
            (0..10).map(|i| (i, ((), (i as u64 * 7) % 10))).collect();
        assert!(lru_victims(&cache, 10, 8).is_empty(), "within the bound");
        assert_eq!(lru_victims(&cache, 7, 8), vec![0, 3, 6], "the three oldest");
        assert_eq!(
            lru_victims(&cache, 2, 4),
            vec![0, 3, 6, 9],
            "at most n per pass"
        );
    }

    #[test]
    pub(crate) fn without_spinning_a_poll_looks_exactly_once() {
        let looks = Cell::new(0);
        let got: Option<()> = poll_for(
            Duration::ZERO,
            || Duration::from_secs(1),
            || {
                looks.set(looks.get() + 1);
                None
            },
        );
        assert_eq!((got, looks.get()), (None, 1));
    }

    #[test]
    pub(crate) fn a_poll_returns_what_arrives_and_gives_up_after_its_budget() {
        let looks = Cell::new(0);
        let spin = Duration::from_millis(5);
        // A budget no loaded machine exhausts before the 1000th look: the value arrives and
        // is returned, whatever the timing.
        let got = poll_for(
            spin,
            || Duration::from_secs(3600),
            || {
                looks.set(looks.get() + 1);
                (looks.get() == 1000).then_some(7)
            },
        );
        assert_eq!(got, Some(7));
        assert_eq!(looks.get(), 1000, "it stopped looking once the value came");
        let t0 = Instant::now();
        let budget = Duration::from_millis(20);
        assert_eq!(poll_for(spin, || budget, || None::<()>), None);
        assert!(t0.elapsed() >= budget, "gave up early: {:?}", t0.elapsed());
    }

    /// A late copy's open that the runtime refuses as mapped already closes the mappings no
    /// copy is using and succeeds on its second try; a busy mapping stays; where not every copy
    /// is counted (`all_tracked` false) nothing is closed and the error is the caller's.
    #[test]
    fn an_already_mapped_open_closes_the_idle_mappings_once() {
        use flagcx_adaptor::testing::{FaultOp, FaultyAdaptor};
        let host = flagcx_host::HostAdaptor::open(0).expect("host adaptor");
        let a = FaultyAdaptor::new(host, FaultOp::IpcOpenMapped, usize::MAX >> 2);
        let handle = |n: usize| {
            let p = a.mem_alloc(n).expect("alloc");
            Some(a.ipc_get_handle(p).expect("handle"))
        };
        let (h1, h2, h3, h4) = (handle(64), handle(128), handle(256), handle(512));
        let theirs = |handle| Theirs {
            peer: 1,
            handle,
            span: Span::default(),
        };
        let (h1, h2, h3, h4) = (theirs(h1), theirs(h2), theirs(h3), theirs(h4));
        let mut c = IpcCache::default();
        c.open_busy(&a, h1, true).expect("first open");
        c.done_busy(&h1.handle.unwrap());
        c.open_busy(&a, h2, true).expect("second open");
        assert_eq!((c.map.len(), c.caller_copies), (2, 1));
        // h1 idle, h2 busy: the refused open of h3 closes h1 only, then maps h3.
        a.arm(0);
        c.open_busy(&a, h3, true)
            .expect("open after closing the idle mappings");
        assert!(a.fired());
        assert_eq!(c.closes, 1);
        assert!(
            c.map.contains_key(&h2.handle.unwrap().to_wire()),
            "the busy mapping stays"
        );
        assert!(
            !c.map.contains_key(&h1.handle.unwrap().to_wire()),
            "the idle one went"
        );
        assert_eq!(c.caller_copies, 2);
        // Not every copy counted: the refusal is returned, nothing closed.
        a.arm(0);
        let e = c.open_busy(&a, h4, false).unwrap_err();
        assert!(already_mapped(&e), "{e}");
        assert_eq!((c.closes, c.map.len()), (1, 2));
        c.done_busy(&h2.handle.unwrap());
        c.done_busy(&h3.handle.unwrap());
        assert_eq!(c.caller_copies, 0);
        assert!(c.busy.is_empty());
    }

    /// A new allocation of a peer that overlaps one the cache maps (the peer freed that one and
    /// reused its addresses) marks the old mapping stale, to close at rest; overlaps with another
    /// peer's allocations do not. Where the runtime refuses the new mapping, the stale ones are
    /// closed at once only if no stream waits for the communicator (`close_in_flight`), and a
    /// mapping a late copy holds never is.
    #[test]
    fn a_peers_new_allocation_makes_the_mappings_it_overlaps_stale() {
        use flagcx_adaptor::testing::{FaultOp, FaultyAdaptor};
        let host = flagcx_host::HostAdaptor::open(0).expect("host adaptor");
        let a = FaultyAdaptor::new(host, FaultOp::IpcOpenMapped, usize::MAX >> 2);
        let at = |peer: usize, base: u64, len: u64| {
            let p = a.mem_alloc(len.max(64) as usize).expect("alloc");
            Theirs {
                peer,
                handle: Some(a.ipc_get_handle(p).expect("handle")),
                span: Span { base, len },
            }
        };
        let key = |t: &Theirs| t.handle.unwrap().to_wire();
        let stale = |c: &IpcCache, t: &Theirs| c.map.get(&key(t)).map(|(m, _)| m.stale);
        for close_in_flight in [false, true] {
            let mut c = IpcCache::new(close_in_flight);
            let old = at(1, 0x10_0000, 0x2000);
            let other_peer = at(2, 0x10_0000, 0x2000);
            let beside = at(1, 0x10_2000, 0x1000);
            for t in [old, other_peer, beside] {
                c.open(&a, t).expect("open");
            }
            assert!(!c.wants_trim(), "no overlap within one peer yet");
            let base = c.open(&a, old).expect("again");
            assert_eq!((c.opens, c.map[&key(&old)].0.base), (3, base), "a hit");
            // Peer 1 freed `old` and allocated across its end: mapped beside the stale one.
            let new = at(1, 0x10_1000, 0x800);
            c.open(&a, new).expect("open the new allocation");
            assert_eq!((c.map.len(), c.closes, c.opens), (4, 0, 4));
            assert_eq!(stale(&c, &old), Some(true));
            for t in [other_peer, beside, new] {
                assert_eq!(stale(&c, &t), Some(false));
            }
            assert!(c.wants_trim(), "a stale mapping to close at rest");
            // The runtime refuses the next one (it overlaps `new`, which a late copy holds,
            // and `old` again).
            c.open_busy(&a, new, false).expect("busy");
            let newer = at(1, 0x10_1400, 0x100);
            a.arm(0);
            let r = c.open(&a, newer);
            assert!(a.fired());
            match close_in_flight {
                false => {
                    assert!(already_mapped(&r.unwrap_err()), "the refusal is the op's");
                    assert_eq!(c.closes, 0);
                }
                true => {
                    r.expect("opened after closing the stale mappings");
                    assert_eq!(c.closes, 1, "`old` closed, `new` kept");
                    assert_eq!(stale(&c, &old), None);
                    assert_eq!(stale(&c, &new), Some(true));
                }
            }
            c.done_busy(&new.handle.unwrap());
        }
    }

    #[test]
    pub(crate) fn only_a_running_copy_extends_the_wait_and_only_where_spinning_is_allowed() {
        let spin = Duration::from_micros(50);
        assert_eq!(running_copy_budget(spin, false), spin);
        assert_eq!(running_copy_budget(spin, true), spin + RUNNING_COPY_WAIT);
        assert_eq!(running_copy_budget(Duration::ZERO, true), Duration::ZERO);
    }
}
