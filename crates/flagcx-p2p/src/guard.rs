//! The stall guard: `FLAGCX_TIMEOUT_MS` for a progress thread that stopped taking steps.
//!
//! The engine checks the timeout of every step itself, so it cannot see its own stall: while it
//! is blocked inside a vendor call (on CUDA, behind another thread's `cudaFree`, which holds the
//! driver's process-wide lock while it waits for a stream that waits for this communicator:
//! `docs/reliability.md`), nothing would time out. Beside an engine with a timeout runs this
//! thread. The engine bumps [`Shared::beats`] once per pass of its loop; the guard looks every
//! quarter of the timeout (at most every 100 ms). When operations are in flight and no pass
//! ended for the timeout, it fails the communicator from outside, with no vendor call that
//! could block behind the same lock:
//! - [`Shared::first_error`] and every waiting request get a `Timeout` that says so
//!   (the [`crate::op::Verdict`]: waiters look at it between sleeps, so they return even though the
//!   engine, which fills their slots, does not);
//! - the communicator is aborted (later posts fail with `Aborted`);
//! - callers' streams are released as [`crate::Comm::abort`] releases them: the watermark word
//!   is written from the host.
//!
//! A pass of the engine's loop never waits by design (its longest sleep is the 100 ms park of
//! an idle engine), so the guard's window is the timeout but never less than
//! [`MIN_WINDOW`]: no false alarm for a timeout shorter than an idle park.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flagcx_adaptor::DeviceAdaptor;

use flagcx_adaptor::tracking::lock;

use crate::error::{CommError, Result};
use crate::shared::Shared;

/// The shortest stall the guard reports: longer than the engine's idle park (100 ms).
pub(crate) const MIN_WINDOW: Duration = Duration::from_millis(250);

/// The guard's thread, and the flag it raises when it fails the communicator.
pub(crate) struct Guard {
    handle: JoinHandle<()>,
    fired: Arc<AtomicBool>,
}

impl Guard {
    /// Starts the guard of `shared`'s engine: after `timeout` (at least [`MIN_WINDOW`]) without
    /// a pass of the engine's loop while operations are in flight, it fails every operation
    /// numbered below `next_seq`'s value.
    pub fn start<A: DeviceAdaptor>(
        adaptor: A,
        shared: Arc<Shared>,
        next_seq: Arc<AtomicU64>,
        timeout: Duration,
        rank: usize,
    ) -> Result<Guard> {
        let fired = Arc::new(AtomicBool::new(false));
        let flag = fired.clone();
        let handle = std::thread::Builder::new()
            .name(format!("flagcx-guard-{rank}"))
            .spawn(move || {
                if let Some(e) = watch(&shared, timeout.max(MIN_WINDOW), rank) {
                    flag.store(true, Ordering::Release);
                    tracing::warn!("{e}");
                    shared.record_error(&e);
                    shared.verdict.give(e);
                    shared.aborted.store(true, Ordering::Release);
                    let issued = next_seq.load(Ordering::Acquire).saturating_sub(1);
                    shared.release_through(&adaptor, issued);
                    shared.wake();
                }
            })
            .map_err(|e| CommError::io("spawn stall guard thread", e))?;
        Ok(Guard { handle, fired })
    }

    /// Whether the guard found the engine stalled (and failed the communicator).
    pub fn fired(&self) -> bool {
        self.fired.load(Ordering::Acquire)
    }

    /// Stops the guard (after [`Shared::shutdown`] is set) and waits for its thread, which
    /// makes no call that blocks.
    pub fn stop(self) {
        self.handle.thread().unpark();
        let _ = self.handle.join();
    }
}

/// Watches the engine until shutdown or abort (`None`), or until it stalled for `window` with
/// operations in flight: the error to fail them with.
fn watch(shared: &Shared, window: Duration, rank: usize) -> Option<CommError> {
    let mut stall = Stall::new(window, shared.beats.load(Ordering::Relaxed));
    let mut last = Instant::now();
    loop {
        std::thread::park_timeout(stall.tick);
        let now = Instant::now();
        let slept = now.duration_since(last);
        last = now;
        if shared.shutdown.load(Ordering::Acquire) || shared.aborted.load(Ordering::Acquire) {
            return None;
        }
        let beats = shared.beats.load(Ordering::Relaxed);
        let busy = shared
            .pending
            .iter()
            .flatten()
            .any(|p| p.load(Ordering::Acquire) > 0);
        if let Some(stalled) = stall.look(beats, busy, slept) {
            let blocked = shared.blocked_in.load(Ordering::Relaxed);
            // Name the call where the proxy knows it is in one; else say what it may be.
            let (peer, wher) = match (BlockedIn::describe(blocked), shared.in_call.current()) {
                (Some(w), _) => (Some((blocked >> 8) as usize), w),
                (None, Some((call, long))) => (
                    None,
                    format!(
                        "inside the runtime call {call} for {} ms (it waits for something \
                         outside this library: on CUDA typically another thread's synchronous \
                         copy, cudaFree or cudaHostUnregister while a stream waits for this \
                         communicator)",
                        long.as_millis()
                    ),
                ),
                (None, None) => (
                    None,
                    "in none of its own waits and in no runtime call the adaptor marks: off \
                     the CPU (stopped or starved), or inside an unmarked runtime call"
                        .to_string(),
                ),
            };
            return Some(CommError::Timeout {
                ms: window.as_millis() as u64,
                peer,
                what: format!(
                    "rank {rank}'s progress thread took no step for {} ms with operations in \
                     flight, {wher}; the communicator is aborted and its streams released",
                    stalled.as_millis()
                ),
            });
        }
    }
}

/// The first failure kept for `Comm::async_error` (here, beside the other ways a
/// communicator fails, to keep `engine.rs` short).
impl Shared {
    /// Keeps the first asynchronous failure of any operation (for
    /// [`crate::Comm::async_error`]); the caller's own errors (a size mismatch, an abort) are
    /// not kept.
    pub fn record_error(&self, e: &CommError) {
        if e.is_async_failure() {
            self.record_fatal(e);
        }
    }

    /// What ends a reduction-slots call's waits besides its timeout (`crate::slots`): this
    /// communicator's abort flag and its peers' lost flags.
    pub(crate) fn slots_stop(&self) -> crate::slots::Stop<'_> {
        crate::slots::Stop {
            aborted: &self.aborted,
            lost: &self.lost,
        }
    }

    /// Records `e` for `Comm::async_error` whatever its kind (it failed the communicator).
    pub fn record_fatal(&self, e: &CommError) {
        let mut first = lock(&self.first_error);
        if first.is_none() {
            *first = Some(e.clone());
        }
    }
}

/// After the engine completed an operation with rank `peer` that `failed`: a reduction's
/// message (`slot` marked fatal) that failed for a disagreement, or whose peer failed it for
/// one and retired the pair, fails the communicator ([`fail_communicator`]). A lost or stopped
/// peer, a timeout or an abort reach every rank by their own paths, each naming its cause.
pub(crate) fn after_failure(
    shared: &Shared,
    slot: &crate::op::Slot,
    failed: Option<CommError>,
    peer: usize,
) {
    if let Some(e) = failed.filter(|e| e.is_disagreement() && slot.is_fatal()) {
        fail_communicator(
            shared,
            e,
            &format!("a reduction's message with rank {peer}"),
        );
    }
}

/// A reduction's message failed its size (its ranks disagreed on the call), or its peer
/// failed it for that, or a call through the reduction slots failed (`what` says which): the
/// rest of the call would reduce what never arrived and hand it on, so the communicator fails
/// as an abort fails it — every pending operation, every pair (the peers' operations with this
/// rank fail at once, and theirs with others through their own reductions), `async_error`.
/// Called by the engine (`Engine::finish`) and by a slots call run as a host function.
pub(crate) fn fail_communicator(shared: &Shared, e: CommError, what: &str) {
    if shared.aborted.swap(true, Ordering::AcqRel) {
        return;
    }
    tracing::warn!(
        "{what} failed ({e}): failing the communicator so that no rank finishes the call on \
         data that never came"
    );
    shared.record_fatal(&e);
    shared.verdict.give(e);
    shared.wake();
}

/// The guard's judgement, one look at a time.
///
/// The stall is the time the guard itself saw pass, each look counting for at most two ticks: a
/// process that was stopped (`SIGSTOP`) or starved of CPU wakes its guard late, and the engine,
/// stopped along with it, must get its turn before that time counts against it.
pub(crate) struct Stall {
    window: Duration,
    /// How long the watcher sleeps between looks.
    pub(crate) tick: Duration,
    seen: u64,
    stalled: Duration,
}

impl Stall {
    /// A judge of a thread that stalls for `window`; `beats` is its pass count now.
    pub(crate) fn new(window: Duration, beats: u64) -> Self {
        Stall {
            window,
            tick: (window / 4).min(Duration::from_millis(100)),
            seen: beats,
            stalled: Duration::ZERO,
        }
    }

    /// One look, `slept` after the last: the engine's pass count and whether operations are in
    /// flight. The stall so far once it reached the window.
    pub(crate) fn look(&mut self, beats: u64, busy: bool, slept: Duration) -> Option<Duration> {
        if beats != self.seen || !busy {
            self.seen = beats;
            self.stalled = Duration::ZERO;
            return None;
        }
        self.stalled += slept.min(2 * self.tick);
        (self.stalled >= self.window).then_some(self.stalled)
    }
}

/// Waits for `h` to end, up to `limit` (the timeout; [`MIN_WINDOW`] at least); whether it did.
pub(crate) fn joined_within(h: JoinHandle<()>, limit: Option<Duration>) -> bool {
    let limit = limit.unwrap_or_default().max(MIN_WINDOW);
    let t0 = Instant::now();
    while !h.is_finished() {
        if t0.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let _ = h.join();
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{Slot, Verdict};

    #[test]
    fn a_verdict_ends_a_wait_the_engine_never_completes() {
        let verdict = Arc::new(Verdict::default());
        let slot = Arc::new(Slot::new(None, verdict.clone()));
        let waiter = {
            let slot = slot.clone();
            std::thread::spawn(move || slot.wait(None, Duration::ZERO))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!slot.settled());
        let t = Instant::now();
        verdict.give(CommError::Aborted);
        assert!(slot.settled() && !slot.is_done());
        let r = waiter.join().expect("waiter");
        assert!(matches!(r, Some(Err(CommError::Aborted))), "{r:?}");
        // Woken by the verdict, not by a timeout (there is none): a generous bound that only
        // a hang misses, not a loaded machine.
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn a_result_beats_a_later_verdict_and_the_first_verdict_stays() {
        let verdict = Arc::new(Verdict::default());
        let slot = Slot::new(None, verdict.clone());
        slot.complete(Ok(8));
        verdict.give(CommError::Aborted);
        verdict.give(CommError::InvalidArgument("second".into()));
        assert!(matches!(verdict.get(), Some(CommError::Aborted)));
        assert!(matches!(slot.wait(None, Duration::ZERO), Some(Ok(8))));
    }

    #[test]
    fn the_guard_counts_only_time_it_saw_pass_with_work_and_no_step() {
        let ms = Duration::from_millis;
        let mut s = Stall::new(ms(300), 7);
        assert_eq!(s.tick, ms(75));
        // Steps taken, or nothing in flight: never a stall.
        for beats in 8..100 {
            assert_eq!(s.look(beats, true, ms(75)), None);
        }
        for _ in 0..100 {
            assert_eq!(s.look(99, false, ms(75)), None);
        }
        // A process stopped for ten seconds wakes its guard late: one look counts two ticks.
        assert_eq!(s.look(99, true, Duration::from_secs(10)), None);
        // The engine's first pass after the stop clears it.
        assert_eq!(s.look(100, true, ms(75)), None);
        // Work in flight and no pass: the window fills tick by tick.
        assert_eq!(s.look(100, true, ms(75)), None);
        assert_eq!(s.look(100, true, ms(75)), None);
        assert_eq!(s.look(100, true, ms(75)), None);
        assert_eq!(s.look(100, true, ms(80)), Some(ms(305)));
        // The tick is at most 100 ms.
        assert_eq!(Stall::new(Duration::from_secs(30), 0).tick, ms(100));
    }

    #[test]
    fn a_deadline_shorter_than_a_poll_still_holds() {
        let slot = Slot::new(None, Arc::new(Verdict::default()));
        let t = Instant::now();
        assert!(slot
            .wait(Some(Duration::from_millis(5)), Duration::ZERO)
            .is_none());
        // The deadline, not the poll, ended the wait: at least the deadline passed, and the
        // wait did not sleep on towards anything longer (generous, for a loaded machine).
        assert!(t.elapsed() >= Duration::from_millis(5), "{:?}", t.elapsed());
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }
}

/// A runtime call the proxy makes that may wait for long, named for the stall guard's message
/// (`Shared::blocked_in`: the code in the low byte, the peer above it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum BlockedIn {
    /// `stream_synchronize` of the proxy's copy stream after an operation with the peer failed
    /// (`Engine::abandon_chunks`): its copies touch the caller's buffer, so they must end
    /// first.
    AbandonChunks = 1,
}

impl BlockedIn {
    /// Records that the proxy enters this call for `peer`, until the guard drops.
    pub(crate) fn mark(self, shared: &Shared, peer: usize) -> Unmark<'_> {
        shared
            .blocked_in
            .store(self as u64 | ((peer as u64) << 8), Ordering::Relaxed);
        Unmark(shared)
    }

    /// What a stored value names, in words.
    pub(crate) fn describe(v: u64) -> Option<String> {
        let peer = v >> 8;
        match v & 0xff {
            1 => Some(format!(
                "inside the runtime's stream synchronize of its copy stream, after an operation \
                 with rank {peer} failed: a copy or wait on that stream has not ended"
            )),
            _ => None,
        }
    }
}

/// Clears [`Shared::blocked_in`] when dropped.
pub(crate) struct Unmark<'a>(&'a Shared);

impl Drop for Unmark<'_> {
    fn drop(&mut self) {
        self.0.blocked_in.store(0, Ordering::Relaxed);
    }
}
