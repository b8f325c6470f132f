//! Who runs the engine's passes ([`Engine::pass`]): the proxy thread, and — where this rank's
//! copies are CPU copies — any thread waiting for one of the communicator's operations, as MPI
//! libraries make progress inside the waiting call.
//!
//! Where threads outnumber cores (two ranks bound to two cores, each rank's waiting thread
//! and proxy sharing one), every protocol step first waits for the proxy to be scheduled,
//! and the waiter that could take it holds the core doing nothing; where cores are many, the
//! waiter that slept through its spin wakes late. So a waiter runs the passes itself: the engine lives behind a mutex, a waiter tries it
//! between polls of its result ([`crate::op::Slot::wait`]), and while waiters drive — one ran
//! a pass within [`HELPED_NAP`] — the proxy thread naps instead of competing for the core, and
//! posts do not wake it: a waiter's next pass takes their operations. Once no waiter has
//! driven for that long (its operation finished and the caller went on, or nothing moved for
//! a while), the proxy is back within one nap. Waking it as each waiter leaves would cost a
//! wake-up and a context switch per request, since callers wait for several in turn (a
//! collective's). A pass may make vendor calls, and only the proxy may block in one (the
//! stall guard then releases its waiters, `crate::guard`): so only ranks whose device memory
//! the CPU addresses — whose copies are `memcpy`s — let waiters drive, by default where the
//! machine's ranks do not outnumber its cores (`FLAGCX_P2P_WAITER_PROGRESS`; with more,
//! waiters spinning beside other ranks' threads measured 5–7% slower than sleeping ones).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::DeviceAdaptor;

use crate::engine::Engine;
use crate::error::{CommError, Result};
use crate::op::{Help, Helper};
use crate::shared::Shared;

/// How long after a waiter's last pass the proxy thread leaves the engine to waiters: the
/// longest a posted operation waits for the proxy once waiters stopped driving.
pub(crate) const HELPED_NAP: Duration = Duration::from_micros(200);

impl Shared {
    /// Wakes the proxy thread for new work, unless a waiter drove the engine within the last
    /// [`HELPED_NAP`]: that waiter (or the proxy, after its nap) takes it.
    pub fn wake_for_work(&self) {
        if !helped_recently(self) {
            self.wake();
        }
    }
}

/// Whether a waiter ran a pass within the last [`HELPED_NAP`].
pub(crate) fn helped_recently(shared: &Shared) -> bool {
    helped_within(shared).is_some()
}

/// Where a waiter ran a pass within the last [`HELPED_NAP`], how much of it is left.
fn helped_within(shared: &Shared) -> Option<Duration> {
    let at = shared.helped_us.load(Ordering::Acquire);
    if at == 0 {
        // Never helped (every rank whose waiters do not drive): no clock read on the proxy's
        // loop and every post.
        return None;
    }
    let ago = since_epoch_us(shared).saturating_sub(at);
    let nap = HELPED_NAP.as_micros() as u64;
    (ago < nap).then(|| Duration::from_micros(nap - ago))
}

/// Between two polls that moved nothing (`polls` of them so far): `relax` for 2048 polls, then
/// yields, then 20 µs naps once the wait grows long — the proxy's back-off, which waiters that
/// drive share.
fn back_off(polls: u32, relax: impl FnOnce()) {
    match polls {
        0..2048 => relax(),
        2048..4096 => std::thread::yield_now(),
        _ => std::thread::sleep(Duration::from_micros(20)),
    }
}

fn since_epoch_us(shared: &Shared) -> u64 {
    // Never 0, which means "never helped".
    shared.epoch.elapsed().as_micros() as u64 + 1
}

/// Starts the proxy thread (bound to the device's NUMA node) on `engine`; with `helps`, also
/// returns the [`Helper`] that lets waiters run its passes.
pub(crate) fn start<A: DeviceAdaptor>(
    engine: Engine<A>,
    adaptor: &A,
    rank: usize,
    helps: bool,
) -> Result<(JoinHandle<()>, Option<Helper>)> {
    let shared = engine.shared.clone();
    let cell = Arc::new(Mutex::new(engine));
    let help = helps.then(|| {
        Helper(Arc::new(EngineHelp {
            engine: Arc::downgrade(&cell),
            shared: shared.clone(),
            waits_here: AtomicBool::new(false),
        }))
    });
    let cpus = crate::numa::adaptor_cpus(adaptor);
    let thread_shared = shared.clone();
    let handle = std::thread::Builder::new()
        .name(format!("flagcx-proxy-{rank}"))
        .spawn(move || {
            flagcx_adaptor::incall::watch_this_thread(thread_shared.in_call.clone());
            if let Some(c) = cpus {
                crate::numa::bind_current_thread(&c);
            }
            run(cell, thread_shared)
        })
        .map_err(|e| CommError::io("spawn proxy thread", e))?;
    *lock(&shared.thread) = Some(handle.thread().clone());
    Ok((handle, help))
}

/// The proxy thread's body: passes until shutdown, then teardown.
///
/// It spins while work is in flight (spin → yield → 20 µs naps once a wait grows long) and
/// parks when idle, so an idle communicator burns no core; while waiters drive, it naps.
fn run<A: DeviceAdaptor>(cell: Arc<Mutex<Engine<A>>>, shared: Arc<Shared>) {
    // Short naps must stay short: the default 50 µs timer slack would stretch every 20 µs
    // back-off sleep to ~70 µs and show up directly in small-message latency.
    // SAFETY: prctl on the calling thread with plain integer arguments.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    let stopping =
        || shared.shutdown.load(Ordering::Acquire) || shared.aborted.load(Ordering::Acquire);
    let mut spins = 0u32;
    let mut last_moved = Instant::now();
    loop {
        if let Some(left) = helped_within(&shared).filter(|_| !stopping()) {
            // Until the nap since the waiter's last pass is over, not a whole nap more.
            std::thread::park_timeout(left);
            last_moved = Instant::now();
            continue;
        }
        let mut engine = lock(&cell);
        let pass = engine.pass();
        if engine.stopping() {
            engine.teardown();
            return;
        }
        if pass.moved {
            spins = 0;
            last_moved = Instant::now();
            continue;
        }
        if !pass.busy && engine.trim_at_rest() {
            continue;
        }
        let spin = engine.spin;
        drop(engine);
        if !spin.is_zero() && last_moved.elapsed() < spin {
            // Hot for a while after progress, busy or not: the next step or the next
            // operation usually comes within microseconds, and a wake-up costs more.
            flagcx_adaptor::spin::relax();
        } else if pass.busy {
            shared.busy_polls.fetch_add(1, Ordering::Relaxed);
            spins = spins.saturating_add(1);
            back_off(spins, flagcx_adaptor::spin::relax);
        } else {
            std::thread::park_timeout(Duration::from_millis(100));
        }
    }
}

/// What one [`Engine::pass`] saw.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Pass {
    /// Something moved: an operation was admitted, advanced or finished.
    pub moved: bool,
    /// Operations are in flight.
    pub busy: bool,
    /// Some operation waits for work of this process rather than the peer's (a caller's
    /// stream to reach its start, a copy on a stream): threads of this rank need the core.
    pub waits_here: bool,
}

impl<A: DeviceAdaptor> Engine<A> {
    /// One pass over the engine's work: takes new operations in, advances every pair's front
    /// operations, and checks peers' health while busy. Run by the proxy thread and, where
    /// this rank's copies are CPU copies, by threads waiting for an operation
    /// ([`crate::drive`]); a pass after teardown does nothing.
    pub(crate) fn pass(&mut self) -> Pass {
        if self.down {
            return Pass::default();
        }
        self.shared.beats.fetch_add(1, Ordering::Relaxed);
        self.waits_here = false;
        let mut moved = false;
        let posted = self.shared.posted.load(Ordering::Acquire);
        if posted != self.seen_posted {
            self.seen_posted = posted;
            let new_ops = std::mem::take(&mut lock(&self.shared.inbox).ops);
            moved = !new_ops.is_empty();
            for op in new_ops {
                self.admit(op);
            }
        }
        for p in 0..self.peers.len() {
            moved |= self.progress_peer(p);
        }
        self.note_freed(false);
        let busy = self.peers.iter().flatten().any(|c| !c.idle());
        if let (false, Some(Ok(net))) = (busy, self.net.as_ref().map(|n| n.try_lock())) {
            net.idle_progress();
        }
        if busy && self.last_health.elapsed() >= self.health_interval {
            self.check_peers();
            self.last_health = Instant::now();
        }
        Pass {
            moved,
            busy,
            waits_here: self.waits_here,
        }
    }

    /// Shutdown or an abort: the proxy thread tears down after this pass.
    pub(crate) fn stopping(&self) -> bool {
        self.shared.shutdown.load(Ordering::Acquire) || self.shared.aborted.load(Ordering::Acquire)
    }
}

/// A waiter's share of the engine's work: one pass when no other thread is in one.
struct EngineHelp<A: DeviceAdaptor> {
    /// Weak: a request that outlives its communicator must not keep the engine alive.
    engine: Weak<Mutex<Engine<A>>>,
    shared: Arc<Shared>,
    /// The last pass's [`Pass::waits_here`].
    waits_here: AtomicBool,
}

impl<A: DeviceAdaptor> Help for EngineHelp<A> {
    fn step(&self) -> bool {
        let Some(cell) = self.engine.upgrade() else {
            return false;
        };
        // Another thread in a pass (another waiter, or the proxy blocked in a vendor call):
        // nothing this waiter moved.
        let mut engine = match cell.try_lock() {
            Ok(e) => e,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return false,
        };
        // The pass's runtime calls are the progress thread's for the stall guard.
        let watch = flagcx_adaptor::incall::watching(&self.shared.in_call);
        let pass = engine.pass();
        drop(watch);
        if pass.moved {
            self.shared.waiter_moves.fetch_add(1, Ordering::Relaxed);
        }
        self.waits_here.store(pass.waits_here, Ordering::Relaxed);
        self.shared
            .helped_us
            .store(since_epoch_us(&self.shared), Ordering::Release);
        pass.moved
    }

    /// Where the engine waits for a thread of this process (a caller's stream worker that
    /// must reach an operation's start), the waiter yields between passes on a few-core
    /// machine; where it waits only for the peer's stores, it pauses (the proxy naps, so no
    /// thread here needs the core). Backs off as the proxy does while nothing moves.
    fn pause(&self, polls: u32) {
        back_off(polls, || match self.waits_here.load(Ordering::Relaxed) {
            true => flagcx_adaptor::spin::relax(),
            false => flagcx_adaptor::spin::relax_on_peer(polls),
        })
    }
}
