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
//! Mappings are cached per allocation (its memfd's identity) up to [`Config::host_map_max`]
//! bytes and released when the communicator is destroyed; past the budget, new buffers stay on
//! the ring path. Nothing is unregistered while the communicator runs: on an H200, dropping a
//! registration mid-run (even on a helper thread) hung the job — the runtime call waits for the
//! device context, whose callers' streams wait for operations only the proxy finishes. So a
//! mapping of a buffer its owner freed keeps those pages until teardown (bounded by the budget).
//!
//! [`Config::host_map_max`]: crate::Config::host_map_max

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use flagcx_adaptor::hostmem::{self, HostMemHandle};
use flagcx_adaptor::{DeviceAdaptor, IpcMemHandle};

const PENDING: u8 = 0;
const READY: u8 = 1;
const FAILED: u8 = 2;

/// One mapped allocation of a peer.
struct Entry {
    handle: HostMemHandle,
    base: u64,
    /// Mapped bytes: the allocation rounded up to whole pages.
    len: usize,
    /// Set by whoever finishes preparing the mapping (the helper thread when registering).
    state: Arc<AtomicU8>,
    /// Whether the mapping is (to be) registered with the runtime.
    registers: bool,
}

/// Work for the helper thread: runtime calls that may block (registration takes ~0.5 ms/MiB;
/// unregistering may wait for the whole device context, including callers' streams that wait
/// for operations only the proxy finishes — so the proxy thread itself must never make them).
enum Job {
    /// Register `base..base+len` and report in `state`.
    Register {
        base: u64,
        len: usize,
        state: Arc<AtomicU8>,
    },
    /// Unregister (if `registered`) and unmap `base..base+len`.
    Release {
        base: u64,
        len: usize,
        registered: bool,
    },
}

/// The copier's cache of mapped peer allocations.
pub(crate) struct HostMaps<A: DeviceAdaptor> {
    adaptor: A,
    rank: usize,
    register: bool,
    max: usize,
    mapped: usize,
    entries: HashMap<(u64, u64), Entry>,
    jobs: Option<Sender<Job>>,
    helper: Option<JoinHandle<()>>,
    /// Whether "the budget is spent" was logged (once per communicator).
    over_budget_logged: bool,
}

impl<A: DeviceAdaptor> HostMaps<A> {
    /// An empty cache for `rank`'s proxy; registers mappings iff the runtime can.
    pub fn new(adaptor: A, rank: usize, max: usize) -> Self {
        let register = adaptor.capabilities().host_register;
        HostMaps {
            adaptor,
            rank,
            register,
            max,
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
        let len = h.size.next_multiple_of(page_size());
        if self.mapped + len > self.max {
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
        if self.register {
            let job = Job::Register {
                base,
                len,
                state: state.clone(),
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
                registers: self.register,
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
                        run_job(&adaptor, rank, job);
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

    /// Forgets a mapping that no copy uses any more; the helper (if this cache registers)
    /// undoes its registration and unmaps it, in order after any earlier job.
    fn release(&mut self, e: Entry) {
        self.mapped -= e.len;
        let job = Job::Release {
            base: e.base,
            len: e.len,
            registered: e.registers && e.state.load(Ordering::Acquire) == READY,
        };
        match self.jobs.as_ref() {
            Some(tx) => {
                if let Err(std::sync::mpsc::SendError(job)) = tx.send(job) {
                    run_job(&self.adaptor, self.rank, job);
                }
            }
            None => run_job(&self.adaptor, self.rank, job),
        }
    }

    /// Drops every mapping and stops the helper. The caller has drained its streams and every
    /// operation has finished (so waiting on the runtime cannot deadlock here).
    pub fn close(&mut self) {
        let all: Vec<Entry> = self.entries.drain().map(|(_, e)| e).collect();
        for e in all {
            self.release(e);
        }
        self.jobs = None;
        if let Some(h) = self.helper.take() {
            let _ = h.join();
        }
    }

    /// Bytes mapped now.
    #[cfg(test)]
    fn mapped(&self) -> usize {
        self.mapped
    }
}

/// Runs one helper job (on the helper thread, or inline where there is none).
fn run_job<A: DeviceAdaptor>(adaptor: &A, rank: usize, job: Job) {
    match job {
        Job::Register { base, len, state } => {
            // SAFETY: `base..base+len` is a live shared mapping owned by the cache, which
            // releases it only through a later job on this same queue.
            let r = unsafe { adaptor.host_register(base as *mut u8, len) };
            let s = match r {
                Ok(_) => READY,
                Err(e) => {
                    tracing::info!(
                        rank,
                        "registering a peer buffer for direct copies failed ({e}); it stays on \
                         the staging ring"
                    );
                    FAILED
                }
            };
            state.store(s, Ordering::Release);
        }
        Job::Release {
            base,
            len,
            registered,
        } => {
            if registered {
                // SAFETY: registered by an earlier job on this mapping; the cache forgot it
                // only when no copy could use it any more.
                let _ = unsafe { adaptor.host_unregister(base as *mut u8) };
            }
            // SAFETY: a mapping made by `lookup`, unused (as above), its registration undone.
            unsafe { hostmem::unmap(base, len) };
        }
    }
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
        let mut m = HostMaps::new(a.clone(), 0, 1 << 30);
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
        let mut m = HostMaps::new(a.clone(), 0, 3 * 4096);
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
}
