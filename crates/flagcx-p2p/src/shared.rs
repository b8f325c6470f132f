//! What a communicator's threads share: the state between the API side (posting threads) and
//! the progress engine — the inbox, the completion watermark and the gates waiting on it, the
//! IPC mapping cache, the flags an abort, a failure or teardown set, and the counters
//! [`crate::Comm::stats`] reports. Below the engine, the transports and `Comm`, which all
//! hold it, so the stall guard and the joins reach it without naming any of them.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flagcx_adaptor::quiet::QuietCondvar;
use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{DeviceAdaptor, EventHandle, GateHandle};

use crate::error::CommError;
use crate::ipccache::IpcCache;
use crate::op::{Handoff, Inbox, Verdict};
use crate::PathStats;

/// Which path an operation's bytes took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// One copy between the two ranks' device memory.
    Ipc = 0,
    /// Through the staging ring.
    Staged = 1,
    /// A staged pair's direct copy into or out of the host-vendor rank's buffer.
    Direct = 2,
    /// Through the channel's eager slots (small messages between host-addressable ranks).
    Eager = 3,
    /// Over the network (a pair on two hosts).
    Net = 4,
}

/// State shared between the API side and the proxy thread.
pub(crate) struct Shared {
    pub inbox: Mutex<Inbox>,
    /// Per peer and [`Dir`](crate::op::Dir): operations handed to the proxy and not finished yet. The eager
    /// path only runs while its pair and direction has none (they still own channel counters).
    pub pending: Vec<[AtomicU64; 2]>,
    /// Per peer: the pair was retired (a failure, a timeout, the peer hung up); the eager path
    /// leaves it to the proxy, which fails what comes.
    pub lost: Vec<AtomicBool>,
    /// Set (under the inbox lock, with nothing in flight) while the proxy closes IPC mappings,
    /// which may wait for the device context: meanwhile no caller may hand over an operation
    /// and make a stream wait for it.
    pub trimming: AtomicBool,
    /// Posting threads between numbering late-copy operations under the inbox lock and handing
    /// them over: their streams may be given waits for the peers at any moment, so the proxy
    /// does not close mappings meanwhile (one waiting for a peer to unmap an allocation steps
    /// out, `Comm::late_stand_in`).
    pub late_posting: AtomicUsize,
    /// Per peer and [`Dir`](crate::op::Dir): a posting thread is moving the pair's next message itself
    /// (`Comm::try_caller_ipc`). Later operations of that pair and direction wait until it is
    /// done or handed over, so the proxy sees every pair's messages in order.
    pub reserved: Vec<[AtomicBool; 2]>,
    /// Open peer allocations, shared by the proxy and posting threads that issue IPC copies.
    pub ipc: Mutex<IpcCache>,
    /// Bumped after every hand-over into `inbox`, so the proxy can poll it without the lock.
    pub posted: AtomicU64,
    /// Completed start events, recycled by the API side (creating one per operation costs a
    /// runtime call and an allocation on the latency path).
    pub spare_events: Mutex<Vec<EventHandle>>,
    pub shutdown: AtomicBool,
    /// Set by `Comm::abort`: everything pending fails with `Aborted`, nothing new is accepted.
    pub aborted: AtomicBool,
    /// Set by `Comm::abort` to every sequence number handed out: the watermark it published
    /// itself to release callers' streams, which the engine's later publishing never lowers.
    pub released: AtomicU64,
    /// Highest `n` such that every operation with `seq <= n` has finished.
    pub watermark: Mutex<u64>,
    pub watermark_cv: QuietCondvar,
    /// Callers' streams waiting at gates (`StreamJoin::Gate`), with the operation each waits
    /// for: opened by whoever publishes a watermark that reaches it (taken inside `watermark`).
    pub(crate) gates: Mutex<Vec<(u64, GateHandle)>>,
    /// Joins that held a closed gate for longer instead of adding one (`PathStats::joins_held`).
    pub(crate) joins_held: AtomicU64,
    /// The device-visible word callers' streams wait on (low 32 bits of the watermark).
    pub watermark_word: WatermarkWord,
    pub thread: Mutex<Option<std::thread::Thread>>,
    /// The first asynchronous failure ([`CommError::is_async_failure`]) any operation hit:
    /// sticky, for `Comm::async_error` and `Comm::check`.
    pub first_error: Mutex<Option<CommError>>,
    pub busy_polls: AtomicU64,
    /// Bytes moved by finished operations, per [`Path`] (for [`crate::Comm::stats`]).
    pub path_bytes: [AtomicU64; 5],
    /// IPC operations the posting thread finished itself (for [`crate::Comm::stats`]).
    pub caller_ops: AtomicU64,
    /// IPC operations the posting thread handed to the proxy, indexed by [`Handoff`], for
    /// `FLAGCX_PROFILE` and [`crate::PathStats::caller_failures`].
    pub caller_handoffs: [AtomicU64; 5],
    /// Small messages of eager pairs that went to the proxy, by reason
    /// ([`crate::op::Declined`]).
    pub(crate) eager_declined: [AtomicU64; 4],
    /// Passes of the engine's loop, for the stall guard (`crate::guard`); the verdict every
    /// waiting request takes once an abort or the guard gives it.
    pub beats: AtomicU64,
    /// Where the proxy waits inside a runtime call of its own (a [`crate::guard::BlockedIn`] code, 0:
    /// none), with the peer it concerns: the guard names it rather than guess.
    pub blocked_in: AtomicU64,
    /// The runtime call the proxy thread is inside, if any (`flagcx_adaptor::incall`: the GPU
    /// adaptors mark their driver calls), for the stall guard's message.
    pub in_call: Arc<flagcx_adaptor::incall::CallSlot>,
    /// When a thread waiting for an operation last ran an engine pass ([`crate::drive`]), in
    /// µs after `epoch`: while waiters drive, the proxy thread naps.
    pub helped_us: AtomicU64,
    /// Those passes that moved something (`PathStats::waiter_moves`).
    pub waiter_moves: AtomicU64,
    /// What `helped_us` counts from.
    pub epoch: Instant,
    pub verdict: Arc<Verdict>,
    /// A released late copy's stream did not pass it in time: the pair's words stay mapped
    /// and registered for good (see `Engine::release_late`).
    pub late_kept: AtomicBool,
    /// Held while this communicator joins callers' streams (see `ipccache::Joining`).
    pub(crate) joining: Option<crate::ipccache::Joining>,
}

/// The word of the communicator's watermark page that callers' streams wait on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WatermarkWord(*const AtomicU32);

// SAFETY: the word lies in a page the communicator maps before the proxy thread starts and
// unmaps only in `Comm::drop`, after that thread has been joined, so it outlives every
// thread that holds the pointer; it is only ever read or written atomically (or by the
// adaptor's stream operations, which are atomic on the device side).
unsafe impl Send for WatermarkWord {}
// SAFETY: as above: shared access is atomic.
unsafe impl Sync for WatermarkWord {}

impl WatermarkWord {
    /// The word at `page` (the page's first four bytes, aligned).
    pub fn new(page: *mut u8) -> Self {
        WatermarkWord(page as *const AtomicU32)
    }

    /// The word as a plain pointer, for the adaptor's value writes.
    pub fn as_mut_ptr(self) -> *mut u32 {
        self.0 as *mut u32
    }
}

/// Returns an event of the API side to its pool (`Shared::spare_events`) if it completed, else
/// destroys it (allowed while a stream still has to pass it: runtimes release it once it
/// completes).
pub(crate) fn recycle_event<A: DeviceAdaptor>(adaptor: &A, shared: &Shared, ev: EventHandle) {
    let mut spares = lock(&shared.spare_events);
    if spares.len() < 1024 && adaptor.event_query(ev).unwrap_or(false) {
        spares.push(ev);
    } else {
        let _ = adaptor.event_destroy(ev);
    }
}

impl Shared {
    pub fn wake(&self) {
        if let Some(t) = lock(&self.thread).as_ref() {
            t.unpark();
        }
    }

    /// Blocks until the watermark reaches `seq` (host-function fallback and teardown).
    pub fn wait_watermark(&self, seq: u64) {
        let mut w = lock(&self.watermark);
        while *w < seq && !self.shutdown.load(Ordering::Acquire) {
            w = self
                .watermark_cv
                .wait_timeout(w, Duration::from_millis(50))
                .0;
        }
    }

    /// Whether the watermark reaches `seq` within `limit`, sleeping on its condition variable;
    /// `false` once the limit passed, or at once after shutdown or an abort.
    pub fn watermark_within(&self, seq: u64, limit: Duration) -> bool {
        let t0 = Instant::now();
        let mut w = lock(&self.watermark);
        while *w < seq {
            let left = limit.saturating_sub(t0.elapsed());
            if left.is_zero()
                || self.shutdown.load(Ordering::Acquire)
                || self.aborted.load(Ordering::Acquire)
            {
                return false;
            }
            w = self.watermark_cv.wait_timeout(w, left).0;
        }
        true
    }

    /// Records that the pair with `peer` was retired (see [`Shared::lost`]).
    pub fn mark_lost(&self, peer: usize) {
        if let Some(l) = self.lost.get(peer) {
            l.store(true, Ordering::Release);
        }
    }

    /// What [`crate::Comm::stats`] reports.
    pub fn stats(&self) -> PathStats {
        let b = |p: Path| self.path_bytes[p as usize].load(Ordering::Relaxed);
        PathStats {
            ipc_bytes: b(Path::Ipc),
            staged_bytes: b(Path::Staged),
            direct_bytes: b(Path::Direct),
            eager_bytes: b(Path::Eager),
            net_bytes: b(Path::Net),
            caller_ops: self.caller_ops.load(Ordering::Relaxed),
            caller_failures: self.caller_handoffs[Handoff::Failed as usize].load(Ordering::Relaxed),
            ipc_mappings_closed: lock(&self.ipc).closes,
            joins_held: self.joins_held.load(Ordering::Relaxed),
            waiter_moves: self.waiter_moves.load(Ordering::Relaxed),
            overlapping_posts: 0,
            stand_in_bytes: 0,
        }
    }

    /// Publishes the watermark: the device-visible word (through the adaptor, so vendors that
    /// emulate stream waits on the host wake their waiters), then the host-side copy.
    /// Never below what an abort released (`released`).
    pub fn publish_watermark<A: DeviceAdaptor>(&self, adaptor: &A, w: u64) {
        // Under the lock, so an abort's release and the engine's publishing cannot cross.
        let mut g = lock(&self.watermark);
        let w = w.max(self.released.load(Ordering::Acquire));
        // SAFETY: see the type's Send/Sync argument: a live, aligned word.
        unsafe { adaptor.host_write_value32(self.watermark_word.as_mut_ptr(), w as u32) };
        *g = w;
        let mut open: Vec<GateHandle> = Vec::new();
        lock(&self.gates).retain(|&(seq, gate)| {
            let passed = seq <= w;
            if passed {
                open.push(gate);
            }
            !passed
        });
        drop(g);
        for gate in open {
            // Only an unknown gate fails, and every gate here was made and not yet opened.
            let _ = adaptor.gate_open(gate);
        }
        self.watermark_cv.notify_all();
    }
}
