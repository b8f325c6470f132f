//! Noticing threads that post on one communicator at once.
//!
//! A join waits for every operation posted before it on the communicator (`Comm`'s "one order
//! per communicator"), so threads that post at once with joined streams can leave two ranks
//! waiting on each other. Nothing here prevents that; it counts posts that overlapped another
//! thread's post ([`crate::PathStats::overlapping_posts`]) and says so once in the log where
//! streams join, so that a job that then stalls points at its cause.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Who is posting on a communicator now.
#[derive(Default)]
pub(crate) struct Posting {
    /// The posting thread's number ([`thread_number`]), 0 while nobody posts.
    owner: AtomicU64,
    /// Posts that began while another thread's post was under way.
    pub(crate) overlaps: AtomicU64,
    /// Whether the log said so already.
    warned: AtomicBool,
}

/// This thread's number: distinct per thread of the process, never 0 (cheaper than a
/// `ThreadId`: one thread-local read).
pub(crate) fn thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static NUMBER: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    NUMBER.with(|n| *n)
}

/// A post under way; ends when dropped.
pub(crate) struct Post<'a> {
    /// The communicator's record, where this post owns it (else another thread's post did).
    owned: Option<&'a Posting>,
}

impl Drop for Post<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.owned {
            p.owner.store(0, Ordering::Release);
        }
    }
}

impl Posting {
    /// A post begins; where another thread's post is under way, it is counted and, the first
    /// time and where `joins` (callers' streams wait for the communicator), logged.
    pub(crate) fn begin(&self, joins: bool) -> Post<'_> {
        let me = thread_number();
        match self
            .owner
            .compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Post { owned: Some(self) },
            // The same thread cannot be inside a post twice (posting does not re-enter).
            Err(_) => {
                self.overlaps.fetch_add(1, Ordering::Relaxed);
                if joins && !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "two threads posted on one communicator at once while callers' streams \
                         join its operations: a join waits for every operation posted before \
                         it, so ranks whose threads interleave differently can wait on each \
                         other; give each thread its own communicator, or set \
                         FLAGCX_STREAM_JOIN=none and wait on the requests (Comm, \"one order \
                         per communicator\")"
                    );
                }
                Post { owned: None }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    /// A post that begins while another thread's is under way is counted; posts one after the
    /// other, from any threads, are not.
    #[test]
    fn posts_that_overlap_another_threads_are_counted() {
        let p = Posting::default();
        drop(p.begin(true));
        drop(p.begin(true));
        assert_eq!(p.overlaps.load(Ordering::Relaxed), 0, "one after the other");
        let (inside, done) = (Barrier::new(2), Barrier::new(2));
        std::thread::scope(|s| {
            s.spawn(|| {
                let _post = p.begin(false);
                inside.wait();
                done.wait();
            });
            inside.wait();
            drop(p.begin(false));
            done.wait();
        });
        assert_eq!(
            p.overlaps.load(Ordering::Relaxed),
            1,
            "during the other thread's post"
        );
        std::thread::scope(|s| {
            s.spawn(|| drop(p.begin(true)));
        });
        drop(p.begin(true));
        assert_eq!(
            p.overlaps.load(Ordering::Relaxed),
            1,
            "the other's post had ended"
        );
        assert!(!p.warned.load(Ordering::Relaxed), "no joins, no warning");
    }
}
