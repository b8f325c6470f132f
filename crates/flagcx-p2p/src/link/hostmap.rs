//! The direct path's mappings: a copier rank's view of its host-vendor peers' buffers.
//!
//! A host-vendor rank's device memory is a memfd, so a rank of another vendor can map the very
//! same pages and copy device↔host straight into or out of them: one copy at the copy engine's
//! full rate, instead of a device↔ring copy plus a ring↔buffer `memcpy` on the host rank (which
//! bounds the staged path at host-memcpy speed).
//!
//! Mapping is cheap; registering the mapping with the copier's runtime (page-locking it so its
//! copy engine reaches it asynchronously) is not — about 0.5 ms per MiB on an H200 machine. So
//! registration runs on a helper thread, and until a buffer is registered its messages go
//! through the ring: the first use of a large buffer never stalls the proxy, and buffers that
//! are reused (KV-cache pools, benchmark buffers) soon take the direct path. A runtime without
//! registration copies to plain host memory; there a mapping is ready at once.
//!
//! The helper registers a mapping in pieces ([`Config::host_pin_piece`], 8 MiB by default),
//! pausing 200 µs between them: CUDA holds a lock while it registers, so one registration of a
//! 1 GiB buffer (~0.5 s) stalled every other driver call of the rank — its eager copies, its
//! ring copies — for that long; in pieces registered back to back they still waited (the
//! helper took the lock again at once), while the pause lets them through. A direct copy is
//! split at piece boundaries ([`pieces`]), as no runtime promises to take one copy across two
//! registrations.
//!
//! Mappings are cached per allocation (its memfd's identity) up to [`Config::host_map_max`]
//! bytes and released when the communicator is destroyed; past the budget, new buffers stay on
//! the ring path. Nothing is unregistered while the communicator runs: on an H200, dropping a
//! registration mid-run (even on a helper thread) hung the job — the runtime call waits for the
//! device context, whose callers' streams wait for operations only the proxy finishes. So a
//! mapping of a buffer its owner freed keeps those pages until teardown (bounded by the budget).
//!
//! [`Config::host_map_max`]: crate::Config::host_map_max
//! [`Config::host_pin_piece`]: crate::Config::host_pin_piece

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use flagcx_adaptor::hostmem::{self, HostMemHandle};
use flagcx_adaptor::{DeviceAdaptor, IpcMemHandle};

const PENDING: u8 = 0;
const READY: u8 = 1;
const FAILED: u8 = 2;

/// The helper's pause between two pieces of one registration.
const PIECE_PAUSE: std::time::Duration = std::time::Duration::from_micros(200);

/// One mapped allocation of a peer.
struct Entry {
    handle: HostMemHandle,
    base: u64,
    /// Mapped bytes: the allocation rounded up to whole pages.
    len: usize,
    /// Set by whoever finishes preparing the mapping (the helper thread when registering).
    state: Arc<AtomicU8>,
    /// How many leading pieces the helper registered (all of them once READY).
    pinned: Arc<AtomicUsize>,
}

/// A registration for the helper thread (it takes ~0.5 ms/MiB, too long for the proxy): the
/// mapping's range and where to report.
struct Job {
    base: u64,
    len: usize,
    piece: usize,
    state: Arc<AtomicU8>,
    pinned: Arc<AtomicUsize>,
}

/// The copier's cache of mapped peer allocations.
pub(crate) struct HostMaps<A: DeviceAdaptor> {
    adaptor: A,
    rank: usize,
    register: bool,
    max: usize,
    /// Bytes per registration (whole pages); `usize::MAX` where nothing is registered.
    piece: usize,
    mapped: usize,
    entries: HashMap<(u64, u64), Entry>,
    jobs: Option<Sender<Job>>,
    helper: Option<JoinHandle<()>>,
    /// Whether "the budget is spent" was logged (once per communicator).
    over_budget_logged: bool,
}

impl<A: DeviceAdaptor> HostMaps<A> {
    /// An empty cache for `rank`'s proxy; registers mappings iff the runtime can, `piece`
    /// bytes (rounded up to whole pages) at a time.
    pub fn new(adaptor: A, rank: usize, max: usize, piece: usize) -> Self {
        let register = adaptor.capabilities().host_pin;
        let piece = if register {
            // At most 1 TiB a piece: rounding up cannot overflow whatever the setting says.
            piece.clamp(1, 1 << 40).next_multiple_of(page_size())
        } else {
            usize::MAX
        };
        HostMaps {
            adaptor,
            rank,
            register,
            max,
            piece,
            mapped: 0,
            entries: HashMap::new(),
            jobs: None,
            helper: None,
            over_budget_logged: false,
        }
    }

    /// The host address and length of the peer allocation behind `handle` if it is mapped and
    /// ready for direct copies; otherwise starts preparing it (when there is room) and returns
    /// `None`: this message goes through the ring.
    pub fn lookup(&mut self, handle: &IpcMemHandle) -> Option<(u64, usize)> {
        const OP: &str = "direct map";
        let h = match HostMemHandle::decode(OP, handle) {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!(rank = self.rank, "not mappable: {e}");
                return None;
            }
        };
        if let Some(e) = self.entries.get(&(h.ino, h.dev)) {
            return (e.state.load(Ordering::Acquire) == READY && e.handle.size >= h.size)
                .then_some((e.base, e.handle.size));
        }
        // A size no mapping can have (rounding up would overflow) is over any budget.
        let len = h
            .size
            .checked_next_multiple_of(page_size())
            .unwrap_or(usize::MAX);
        if self.mapped.saturating_add(len) > self.max {
            if !self.over_budget_logged {
                self.over_budget_logged = true;
                tracing::info!(
                    rank = self.rank,
                    "FLAGCX_P2P_HOST_MAP_MAX ({} bytes) reached: buffers not yet mapped go \
                     through the staging ring",
                    self.max
                );
            }
            return None;
        }
        let base = match h.open(OP).and_then(|fd| hostmem::map_shared(&fd, len)) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(rank = self.rank, "cannot map a peer buffer: {e}");
                return None;
            }
        };
        let state = Arc::new(AtomicU8::new(if self.register { PENDING } else { READY }));
        let pinned = Arc::new(AtomicUsize::new(0));
        if self.register {
            let job = Job {
                base,
                len,
                piece: self.piece,
                state: state.clone(),
                pinned: pinned.clone(),
            };
            if self.helper().and_then(|tx| tx.send(job).ok()).is_none() {
                state.store(FAILED, Ordering::Release);
            }
        }
        self.mapped += len;
        self.entries.insert(
            (h.ino, h.dev),
            Entry {
                handle: h,
                base,
                len,
                state: state.clone(),
                pinned,
            },
        );
        // Registering: this message takes the ring even if the helper is already done, so a
        // buffer's first message behaves the same however the threads are scheduled.
        (!self.register).then_some((base, h.size))
    }

    /// The registration thread's queue, started on first use.
    fn helper(&mut self) -> Option<&Sender<Job>> {
        if self.jobs.is_none() {
            let (tx, rx) = channel::<Job>();
            let adaptor = self.adaptor.clone();
            let rank = self.rank;
            let spawned = std::thread::Builder::new()
                .name(format!("flagcx-hostmap-{rank}"))
                .spawn(move || {
                    for job in rx {
                        register(&adaptor, rank, job);
                    }
                });
            match spawned {
                Ok(h) => {
                    self.helper = Some(h);
                    self.jobs = Some(tx);
                }
                Err(e) => {
                    tracing::info!(rank, "no registration thread ({e}): direct path off");
                    return None;
                }
            }
        }
        self.jobs.as_ref()
    }

    /// Stops the helper and drops every mapping. Runs at teardown only: the caller has drained
    /// its streams and every operation has finished, so the runtime may wait for the device
    /// context here (unregistering does) without waiting on the proxy.
    pub fn close(&mut self) {
        self.jobs = None;
        if let Some(h) = self.helper.take() {
            let _ = h.join();
        }
        for (_, e) in self.entries.drain() {
            self.mapped -= e.len;
            for i in 0..e.pinned.load(Ordering::Acquire) {
                let at = e.base + (i * self.piece) as u64;
                // SAFETY: a piece the helper (which has exited) registered on this mapping; no
                // copy uses it any more (see above).
                let _ = unsafe { self.adaptor.host_unpin(at as *mut u8) };
            }
            // SAFETY: a mapping made by `lookup`, unused, its registration (if any) undone.
            unsafe { hostmem::unmap(e.base, e.len) };
        }
    }

    /// Bytes per registration: direct copies are split at these boundaries of a mapping
    /// ([`pieces`]).
    pub fn piece(&self) -> usize {
        self.piece
    }

    /// Bytes mapped now.
    #[cfg(test)]
    fn mapped(&self) -> usize {
        self.mapped
    }
}

/// The helper's work: registers one mapping, piece by piece (other driver calls of the rank
/// get through in between), and reports the outcome.
fn register<A: DeviceAdaptor>(adaptor: &A, rank: usize, job: Job) {
    for (off, len) in pieces(0, job.len, job.piece) {
        // SAFETY: `base+off..base+off+len` lies in a live shared mapping owned by the cache,
        // which unmaps it only in `close`, after this thread has exited; the pieces are
        // disjoint, so none is registered twice.
        if let Err(e) = unsafe { adaptor.host_pin((job.base + off) as *mut u8, len) } {
            tracing::info!(
                rank,
                "registering a peer buffer for direct copies failed ({e}); it stays on the \
                 staging ring"
            );
            job.state.store(FAILED, Ordering::Release);
            return;
        }
        let done = job.pinned.fetch_add(1, Ordering::AcqRel) + 1;
        if (done as u64) * (job.piece as u64) < job.len as u64 {
            // Let the driver calls that queued behind this piece through before the next one
            // (otherwise this thread takes the runtime's lock again at once).
            std::thread::sleep(PIECE_PAUSE);
        }
    }
    job.state.store(READY, Ordering::Release);
}

/// Splits `bytes` bytes at offset `off` of a mapping into the parts that each lie in one
/// `piece`-byte registration: `(offset, length)` pairs in order, none for zero bytes.
pub(crate) fn pieces(off: u64, bytes: usize, piece: usize) -> impl Iterator<Item = (u64, usize)> {
    let end = off.saturating_add(bytes as u64);
    let piece = piece.max(1) as u64;
    let mut at = off;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let next = (at / piece)
            .saturating_add(1)
            .saturating_mul(piece)
            .min(end);
        let part = (at, (next - at) as usize);
        at = next;
        Some(part)
    })
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

impl<A: DeviceAdaptor> Drop for HostMaps<A> {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flagcx_adaptor::testing::{FaultOp, FaultyAdaptor};
    use flagcx_host::HostAdaptor;
    use std::time::{Duration, Instant};

    fn ready_within(m: &mut HostMaps<HostAdaptor>, h: &IpcMemHandle) -> u64 {
        let t0 = Instant::now();
        loop {
            if let Some((b, _)) = m.lookup(h) {
                return b;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "never became ready");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_buffer_is_ring_first_then_direct_and_maps_the_same_pages() {
        let a = HostAdaptor::open(0).unwrap();
        let s = [a.stream_create().unwrap(), a.stream_create().unwrap()];
        let buf = a.mem_alloc(10_000).unwrap();
        let h = a.ipc_get_handle(buf).unwrap();
        let mut m = HostMaps::new(a.clone(), 0, 1 << 30, 1 << 20);
        // The host vendor registers, so the first lookup only starts the work.
        assert_eq!(m.lookup(&h), None);
        let base = ready_within(&mut m, &h);
        assert_eq!(m.mapped(), 12_288, "whole pages");
        // SAFETY: `buf` holds 10 000 bytes; `base` maps the same memfd.
        unsafe {
            a.memcpy_h2d_async(buf, [7u8; 16].as_ptr(), 16, s[0])
                .unwrap();
            a.stream_synchronize(s[0]).unwrap();
            assert_eq!(
                std::slice::from_raw_parts(base as *const u8, 16),
                &[7u8; 16]
            );
        }
        // Another vendor's handle or garbage: never mapped.
        let mut other = h;
        other.vendor = flagcx_adaptor::Vendor::Cuda;
        assert_eq!(m.lookup(&other), None);
        m.close();
        assert_eq!(m.mapped(), 0);
        // SAFETY: no copy is in flight.
        unsafe { a.mem_free(buf).unwrap() };
    }

    #[test]
    fn the_budget_holds() {
        let a = HostAdaptor::open(0).unwrap();
        let mut m = HostMaps::new(a.clone(), 0, 3 * 4096, 1 << 20);
        let b1 = a.mem_alloc(8192).unwrap();
        let h1 = a.ipc_get_handle(b1).unwrap();
        ready_within(&mut m, &h1);
        let b2 = a.mem_alloc(8192).unwrap();
        let h2 = a.ipc_get_handle(b2).unwrap();
        // No room while b1 lives: b2 stays on the ring, repeatedly.
        for _ in 0..3 {
            assert_eq!(m.lookup(&h2), None);
        }
        assert_eq!(m.mapped(), 8192);
        m.close();
        assert_eq!(m.mapped(), 0);
        // SAFETY: no copy is in flight.
        unsafe {
            a.mem_free(b1).unwrap();
            a.mem_free(b2).unwrap();
        }
    }

    #[test]
    fn copies_split_at_registration_boundaries() {
        let split = |off, bytes, piece| pieces(off, bytes, piece).collect::<Vec<_>>();
        assert_eq!(split(0, 0, 4096), vec![]);
        assert_eq!(split(100, 10, 4096), vec![(100, 10)]);
        assert_eq!(split(4000, 200, 4096), vec![(4000, 96), (4096, 104)]);
        assert_eq!(split(0, 8192, 4096), vec![(0, 4096), (4096, 4096)]);
        assert_eq!(
            split(4095, 8194, 4096),
            vec![(4095, 1), (4096, 4096), (8192, 4096), (12288, 1)]
        );
        assert_eq!(split(7, 1 << 20, usize::MAX), vec![(7, 1 << 20)]);
    }

    #[test]
    fn a_buffer_is_registered_in_pieces_and_all_are_undone() {
        let a = HostAdaptor::open(0).unwrap();
        let buf = a.mem_alloc(5 * 4096 + 10).unwrap();
        let h = a.ipc_get_handle(buf).unwrap();
        assert_eq!(
            HostMaps::new(a.clone(), 0, 1 << 30, usize::MAX).piece(),
            1 << 40,
            "no overflow"
        );
        let mut m = HostMaps::new(a.clone(), 0, 1 << 30, 5000);
        assert_eq!(m.piece(), 8192, "whole pages");
        let base = ready_within(&mut m, &h);
        let e = m.entries.values().next().unwrap();
        assert_eq!(
            e.pinned.load(Ordering::Acquire),
            3,
            "24 KiB + 4 KiB in 8 KiB pieces"
        );
        // Each piece is its own registration: pinning inside one again is refused.
        // SAFETY: the mapping is live (the cache holds it).
        assert!(unsafe { a.host_pin((base + 8192) as *mut u8, 4096) }.is_err());
        m.close();
        assert_eq!(m.mapped(), 0);

        // The second piece fails: the buffer stays on the ring, the first piece is undone.
        let faulty = FaultyAdaptor::new(a.clone(), FaultOp::Register, 1);
        let mut m = HostMaps::new(faulty, 0, 1 << 30, 5000);
        assert_eq!(m.lookup(&h), None);
        let e = m.entries.values().next().unwrap().state.clone();
        let t0 = Instant::now();
        while e.load(Ordering::Acquire) == PENDING {
            assert!(t0.elapsed() < Duration::from_secs(10), "never finished");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(e.load(Ordering::Acquire), FAILED);
        assert_eq!(
            m.entries
                .values()
                .next()
                .unwrap()
                .pinned
                .load(Ordering::Acquire),
            1
        );
        for _ in 0..3 {
            assert_eq!(m.lookup(&h), None, "a failed buffer never goes direct");
        }
        m.close();
        // SAFETY: no copy is in flight.
        unsafe { a.mem_free(buf).unwrap() };
    }
}
