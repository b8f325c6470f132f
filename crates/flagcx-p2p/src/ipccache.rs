//! The IPC mapping cache: peer allocations this rank maps for IPC copies, shared by the proxy
//! and the posting threads; stale mappings (allocations the peer freed) and those past the
//! bound are closed only at rest.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, IpcMemHandle};

use crate::channel::{RecvDesc, SendDesc, Span};
use crate::error::{CommError, Result};

/// Peer allocations the proxy keeps open for IPC copies; past it, the least recently used are
/// closed, a few per pass while nothing is in flight (see `Engine::trim_at_rest`).
pub(crate) const IPC_CACHE_MAX: usize = 256;

/// Live communicators of this process whose callers' streams wait for their peers: they join
/// their operations (every `FLAGCX_STREAM_JOIN` but `none`), or have late or stream-ordered
/// pairs, whose streams wait on the peers' words.
static JOINING: AtomicUsize = AtomicUsize::new(0);

/// Counts its communicator in [`JOINING`] while it lives (held by `Shared`).
pub(crate) struct Joining(());

impl Joining {
    pub(crate) fn new() -> Self {
        JOINING.fetch_add(1, Ordering::AcqRel);
        Joining(())
    }
}

impl Drop for Joining {
    fn drop(&mut self) {
        JOINING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Whether a communicator of this process other than one (which joins streams where `mine`)
/// joins streams. Closing a mapping may wait for every stream of the process, and a stream
/// joined to another communicator's operation may wait for a peer whose progress waits, across
/// processes, for this one (seen on an H100 with two communicators per rank: each rank's
/// proxy closed a stale mapping at rest while the other communicator's stream waited, and
/// both stalled until the 30 s timeout). There stale mappings are not closed for being stale
/// (only past the cache's bound, as before).
pub(crate) fn joining_elsewhere(mine: bool) -> bool {
    JOINING.load(Ordering::Acquire) > usize::from(mine)
}

/// One open mapping of a peer's allocation.
#[derive(Clone, Copy)]
struct Mapping {
    /// Where it is mapped here.
    base: DevicePtr,
    /// The rank that exported it, and where the allocation lies in that rank's process.
    peer: usize,
    span: Span,
    /// A later allocation of the same peer overlapped it: the peer freed this one. Closed at
    /// rest ([`Engine::trim_at_rest`](crate::engine::Engine::trim_at_rest)), before the least recently used.
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
    /// Whether the log said why a refused open failed (once per communicator).
    refusal_told: bool,
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
    /// How many mappings the engine may close while idle (none while a posting thread's copy
    /// is in flight): those past the bound, and with `stale` every stale one, up to `n`.
    pub(crate) fn to_trim(&self, stale: bool, n: usize) -> usize {
        if self.caller_copies > 0 {
            return 0;
        }
        let past = self.map.len().saturating_sub(IPC_CACHE_MAX);
        let stale = match stale {
            true => self.map.values().filter(|(m, _)| m.stale).count(),
            false => 0,
        };
        past.max(stale).min(n)
    }

    /// The keys of `peer`'s mappings that overlap `span`.
    fn overlapped(&self, peer: usize, span: &Span) -> Vec<[u8; IpcMemHandle::WIRE_LEN]> {
        self.map
            .iter()
            .filter(|(_, (m, _))| m.peer == peer && m.span.overlaps(span))
            .map(|(k, _)| *k)
            .collect()
    }

    /// Marks the mappings of `keys` stale: their peer freed those allocations.
    fn mark_stale(&mut self, keys: &[[u8; IpcMemHandle::WIRE_LEN]]) {
        for k in keys {
            if let Some((m, _)) = self.map.get_mut(k) {
                m.stale = true;
            }
        }
    }

    /// The mappings to close now, at most `n` of them (see [`Self::to_trim`]): stale ones first,
    /// then the least recently used.
    pub(crate) fn victims(&self, n: usize) -> Vec<[u8; IpcMemHandle::WIRE_LEN]> {
        let mut victims: Vec<_> = self
            .map
            .iter()
            .filter(|(_, (m, _))| m.stale)
            .map(|(k, _)| *k)
            .take(n)
            .collect();
        if victims.len() < n {
            let stale = victims.len();
            // The least recently used of the rest (stale ones are never in use).
            let rest: HashMap<_, _> = self
                .map
                .iter()
                .filter(|(_, (m, _))| !m.stale)
                .map(|(k, v)| (*k, ((), v.1)))
                .collect();
            victims.extend(lru_victims(&rest, 0, n - stale));
        }
        victims
    }

    /// Marks `peer`'s mappings that overlap `span` stale: the peer freed the allocation there
    /// (it said so in the pair's freed ring, `link::named`), to close at rest.
    pub(crate) fn mark_freed(&mut self, peer: usize, span: Span) {
        let keys = self.overlapped(peer, &span);
        self.mark_stale(&keys);
    }

    /// Whether a stale mapping of `peer`'s is still open.
    pub(crate) fn maps_stale(&self, peer: usize) -> bool {
        self.map.values().any(|(m, _)| m.peer == peer && m.stale)
    }

    /// Closes every mapping (teardown).
    ///
    /// # Safety
    /// No copy may use any of them any more: the proxy's streams are idle and no posting
    /// thread is left that could copy.
    pub(crate) unsafe fn close_all<A: DeviceAdaptor>(&mut self, adaptor: &A) {
        for (_, (m, _)) in self.map.drain() {
            // SAFETY: the caller's contract.
            let _ = unsafe { adaptor.ipc_close(m.base) };
        }
    }

    /// Closes the mappings of `keys`.
    ///
    /// # Safety
    /// No copy uses any of them, and closing cannot wait for a stream that waits for this
    /// communicator (see [`IpcCache::open`] and [`Engine::trim_at_rest`](crate::engine::Engine::trim_at_rest)).
    pub(crate) unsafe fn close<A: DeviceAdaptor>(
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
    /// and allocating buffers between messages) and no communicator of the process joins
    /// callers' streams (none counted in [`JOINING`]), they are closed at once and the open is
    /// tried again; otherwise the refusal is the operation's failure: closing a mapping may wait
    /// for the whole device context, which with joins includes streams waiting for the very
    /// operation that needs the new mapping (seen on an H100: the ring hung). A mapping a counted late
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
        let stale = self.overlapped(theirs.peer, &theirs.span);
        let base = match adaptor.ipc_open_handle(&handle).map_err(CommError::from) {
            Err(e) if !stale.is_empty() && already_mapped(&e) && !joining_elsewhere(false) => {
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
            Err(e) if !stale.is_empty() && already_mapped(&e) => {
                if !self.refusal_told {
                    self.refusal_told = true;
                    tracing::warn!(
                        peer = theirs.peer,
                        "{e}: the runtime refused to map rank {}'s new buffer beside this \
                         rank's mapping of a buffer it freed, which cannot be closed while \
                         callers' streams may wait for a communicator of this process; the \
                         operation fails. Keep buffers alive across operations (allocate once, \
                         reuse), or with FLAGCX_STREAM_JOIN=none in every communicator of the \
                         process the stale mapping is closed and the open retried",
                        theirs.peer
                    );
                }
                return Err(e);
            }
            r => r?,
        };
        self.mark_stale(&stale);
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

#[cfg(test)]
mod tests {
    use super::*;

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

    /// What the engine may close at rest: mappings past the bound always, stale ones too where
    /// allowed, at most `n`; nothing while a posting thread's copy is in flight.
    #[test]
    fn at_rest_the_bound_always_counts_and_stale_mappings_where_allowed() {
        let a = flagcx_host::HostAdaptor::open(0).expect("host adaptor");
        let mut c = IpcCache::default();
        for i in 0..(IPC_CACHE_MAX as u64 + 4) {
            let p = a.mem_alloc(64).expect("alloc");
            let theirs = Theirs {
                peer: 1,
                handle: Some(a.ipc_get_handle(p).expect("handle")),
                span: Span {
                    base: 0x1000 * (i + 1),
                    len: 0x1000,
                },
            };
            c.open(&a, theirs).expect("open");
        }
        assert_eq!(
            (c.to_trim(false, 8), c.to_trim(true, 8)),
            (4, 4),
            "four past the bound"
        );
        // Six later allocations of peer 1 overlap six mapped ones: those are stale.
        for i in 0..6u64 {
            let p = a.mem_alloc(64).expect("alloc");
            let theirs = Theirs {
                peer: 1,
                handle: Some(a.ipc_get_handle(p).expect("handle")),
                span: Span {
                    base: 0x1000 * (i + 1) + 0x800,
                    len: 0x100,
                },
            };
            c.open(&a, theirs).expect("open");
        }
        assert_eq!(c.to_trim(false, 100), 10, "past the bound only");
        assert_eq!(c.to_trim(true, 100), 10, "the stale ones are among them");
        assert_eq!(c.to_trim(true, 3), 3, "at most n");
        c.caller_copies += 1;
        assert_eq!(c.to_trim(true, 8), 0, "a posting thread's copy in flight");
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
    /// closed at once only if no communicator of the process joins streams (`JOINING`), and a
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
            // A communicator that joins streams lives in this process (or none does).
            let _joining = (!close_in_flight).then(Joining::new);
            let mut c = IpcCache::default();
            let old = at(1, 0x10_0000, 0x2000);
            let other_peer = at(2, 0x10_0000, 0x2000);
            let beside = at(1, 0x10_2000, 0x1000);
            for t in [old, other_peer, beside] {
                c.open(&a, t).expect("open");
            }
            assert_eq!(c.to_trim(true, 8), 0, "no overlap within one peer yet");
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
            assert_eq!(c.to_trim(true, 8), 1, "a stale mapping to close at rest");
            assert_eq!(c.to_trim(false, 8), 0, "within the bound, stale ones wait");
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
                    assert!(c.refusal_told, "the log says why, once");
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
}
