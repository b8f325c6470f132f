//! A condition variable whose notifications cost nothing while nobody sleeps on it.
//!
//! `std::sync::Condvar::notify_all` makes a `futex` system call on Linux whether or not a thread
//! waits. The completion paths of small messages notify on every operation (a request's slot,
//! the watermark, a host-vendor event or stream), almost always with nobody asleep — their
//! waiters spin first — and two host ranks' 1 KiB all-to-all made ~3 such calls per rank per
//! call. [`QuietCondvar`] counts its sleepers and skips the call when there are none.
//!
//! The rule that makes skipping safe: the state a waiter waits for is changed under the same
//! mutex the waiter holds while it checks that state and goes to sleep. A waiter counts itself
//! while it still holds the mutex; a notifier that changed the state under the mutex (and so
//! acquired it after the waiter released it in `wait`, or before the waiter looked) therefore
//! sees the count, or the waiter sees the new state and never sleeps.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, MutexGuard};
use std::time::Duration;

/// A [`Condvar`] that notifies only when a thread sleeps on it (see the module docs for the
/// rule its users follow: the awaited state changes under the waiters' mutex).
#[derive(Debug, Default)]
pub struct QuietCondvar {
    cv: Condvar,
    sleepers: AtomicUsize,
}

impl QuietCondvar {
    /// A condition variable nobody sleeps on.
    pub const fn new() -> Self {
        QuietCondvar {
            cv: Condvar::new(),
            sleepers: AtomicUsize::new(0),
        }
    }

    /// Sleeps until notified (or spuriously woken), releasing `guard` meanwhile; a poisoned
    /// mutex is taken as it is (see [`crate::tracking::lock`]).
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let guard = self.cv.wait(guard).unwrap_or_else(|p| p.into_inner());
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        guard
    }

    /// As [`QuietCondvar::wait`], for at most `timeout`; the flag is true when it timed out.
    pub fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, bool) {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let (guard, t) = self
            .cv
            .wait_timeout(guard, timeout)
            .unwrap_or_else(|p| p.into_inner());
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        (guard, t.timed_out())
    }

    /// Wakes every sleeper, if there is one. Call it after changing the awaited state under the
    /// waiters' mutex (while still holding it, or after releasing it).
    pub fn notify_all(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            self.cv.notify_all();
        }
    }

    /// How many threads sleep on it now (for tests and diagnostics).
    pub fn sleepers(&self) -> usize {
        self.sleepers.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    #[test]
    fn a_sleeper_is_woken_and_no_sleeper_costs_nothing() {
        let pair = Arc::new((Mutex::new(false), QuietCondvar::new()));
        // Nobody sleeps: a notification is a plain load (nothing to observe but no hang).
        pair.1.notify_all();
        assert_eq!(pair.1.sleepers(), 0);
        let p = pair.clone();
        let waiter = std::thread::spawn(move || {
            let mut g = p.0.lock().unwrap();
            while !*g {
                g = p.1.wait(g);
            }
        });
        // Let it fall asleep, then flip the state under the mutex and notify after releasing.
        let t0 = Instant::now();
        while pair.1.sleepers() == 0 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::yield_now();
        }
        assert_eq!(pair.1.sleepers(), 1, "the waiter went to sleep");
        *pair.0.lock().unwrap() = true;
        pair.1.notify_all();
        waiter.join().unwrap();
        assert_eq!(pair.1.sleepers(), 0);
    }

    #[test]
    fn notifications_racing_with_sleepers_are_never_lost() {
        // Many rounds of a waiter that checks and sleeps against a notifier that flips the
        // state at once: a lost wake-up would leave the waiter asleep past the join's timeout.
        for _ in 0..2000 {
            let pair = Arc::new((Mutex::new(false), QuietCondvar::new()));
            let p = pair.clone();
            let waiter = std::thread::spawn(move || {
                let mut g = p.0.lock().unwrap();
                let t0 = Instant::now();
                while !*g {
                    let (ng, _) = p.1.wait_timeout(g, Duration::from_secs(5));
                    g = ng;
                }
                t0.elapsed()
            });
            *pair.0.lock().unwrap() = true;
            pair.1.notify_all();
            let waited = waiter.join().unwrap();
            assert!(
                waited < Duration::from_secs(4),
                "a wake-up was lost ({waited:?})"
            );
        }
    }

    #[test]
    fn a_timed_wait_reports_its_timeout() {
        let m = Mutex::new(());
        let cv = QuietCondvar::new();
        let (_g, timed_out) = cv.wait_timeout(m.lock().unwrap(), Duration::from_millis(5));
        assert!(timed_out);
        assert_eq!(cv.sleepers(), 0);
    }
}
