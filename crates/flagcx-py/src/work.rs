//! Enqueued operations ([`Pending`]) and their Python handle ([`Work`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use flagcx::{Collective, Request, StreamHandle};
use pyo3::prelude::*;

use crate::dlpack::Imported;
use crate::errors::{self, comm_err};
use crate::inner::{release, Inner};
use crate::stage::{self, Pool};
use crate::{lock, SIGNAL_TURN};

/// An enqueued operation: what tells it finished, and everything it uses until then.
pub(crate) struct Pending {
    pub(crate) ops: Ops,
    /// Staging copies back to the caller's buffers (enqueued behind the operation).
    pub(crate) staged: Option<Arc<Mutex<Late>>>,
    /// The imported buffers (their producers' memory stays alive while these live).
    pub(crate) _held: Vec<Imported>,
}

pub(crate) enum Ops {
    Requests(Vec<Request>),
    Collective(Collective),
}

impl Pending {
    pub(crate) fn is_done(&self) -> bool {
        let ops = match &self.ops {
            Ops::Requests(r) => r.iter().all(Request::is_done),
            Ops::Collective(c) => c.is_done(),
        };
        ops && self.staged.as_ref().map_or(true, |l| lock(l).is_done())
    }

    /// Waits up to `t` for every part to finish without taking results.
    pub(crate) fn settle(&self, t: Duration) -> bool {
        let deadline = std::time::Instant::now() + t;
        let left = || deadline.saturating_duration_since(std::time::Instant::now());
        let ops = match &self.ops {
            Ops::Requests(r) => r.iter().all(|r| r.settle(left())),
            Ops::Collective(c) => c.settle(left()),
        };
        ops && self
            .staged
            .as_ref()
            .map_or(true, |l| lock(l).settle(left()))
    }

    /// The results (after `settle` said done): bytes of a single request, else `None`.
    pub(crate) fn finish(self, pool: &Pool) -> flagcx::p2p::Result<Option<usize>> {
        let result = match self.ops {
            Ops::Requests(mut r) if r.len() == 1 => r.pop().map(Request::wait).transpose(),
            Ops::Requests(r) => {
                let mut first = None;
                for q in r {
                    if let Err(e) = q.wait() {
                        first.get_or_insert(e);
                    }
                }
                first.map_or(Ok(None), Err)
            }
            Ops::Collective(c) => c.wait().map(|()| None),
        };
        if let Some(l) = self.staged {
            let late = std::mem::replace(&mut *lock(&l), Late::Taken);
            late.finish(pool)?;
        }
        result
    }
}

/// A call's staging copies back: enqueued with the call, or (inside a group, whose
/// operations are enqueued at its end) at `group_end`.
pub(crate) enum Late {
    /// In a group not ended yet: what to copy back, on which stream.
    Waiting(stage::Staging, StreamHandle),
    /// Enqueued.
    Ready(stage::Outbound),
    /// The group failed or its copies could not be enqueued.
    Failed(flagcx::p2p::CommError),
    /// Finished.
    Taken,
}

impl Late {
    pub(crate) fn is_done(&self) -> bool {
        match self {
            Late::Waiting(..) => false,
            Late::Ready(o) => o.is_done(),
            Late::Failed(_) | Late::Taken => true,
        }
    }

    pub(crate) fn settle(&self, t: Duration) -> bool {
        match self {
            Late::Ready(o) => o.settle(t),
            other => other.is_done(),
        }
    }

    /// The group ended: enqueue the copies back (or give the staging up where it failed).
    pub(crate) fn enqueue(&mut self, pool: &Pool, group: &flagcx::p2p::Result<()>) {
        if let Late::Waiting(staging, stream) = std::mem::replace(self, Late::Taken) {
            *self = match group {
                Ok(()) => match staging.copy_back(pool, stream) {
                    Ok(Some(o)) => Late::Ready(o),
                    Ok(None) => Late::Taken,
                    Err(e) => Late::Failed(e),
                },
                Err(e) => {
                    staging.abandon(pool, stream);
                    Late::Failed(e.clone())
                }
            };
        }
    }

    pub(crate) fn finish(self, pool: &Pool) -> flagcx::p2p::Result<()> {
        match self {
            Late::Ready(o) => o.finish(pool),
            Late::Failed(e) => Err(e),
            Late::Taken => Ok(()),
            Late::Waiting(staging, stream) => {
                staging.abandon(pool, stream);
                Err(flagcx::p2p::CommError::InvalidArgument(
                    "the call's group never ended (call group_end)".into(),
                ))
            }
        }
    }
}

/// An operation in flight (`async_op=True`), or a finished one.
///
/// `wait()` blocks until it finished (GIL released; ^C aborts the communicator) and raises its
/// failure. A `Work` dropped unfinished hands its operation to the communicator, which keeps
/// the buffers alive until it finishes.
#[pyclass(module = "flagcx._flagcx", name = "Work")]
pub struct Work {
    /// `None` only while dropping.
    pub(crate) inner: Option<Arc<Inner>>,
    pub(crate) pending: Mutex<Option<Pending>>,
    /// The outcome, once a waiter took it.
    pub(crate) result: Mutex<Option<flagcx::p2p::Result<Option<usize>>>>,
}

#[pymethods]
impl Work {
    /// Blocks until the operation finished and returns the bytes it received (receives) or
    /// `None`; raises the operation's failure. Waiting again returns the same result.
    #[pyo3(signature = (timeout=None))]
    pub(crate) fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<usize>> {
        if let Some(r) = lock(&self.result).clone() {
            return r.map_err(comm_err);
        }
        let limit = timeout.map(Duration::from_secs_f64);
        let t0 = std::time::Instant::now();
        loop {
            let turn = limit
                .map_or(SIGNAL_TURN, |l| l.saturating_sub(t0.elapsed()))
                .min(SIGNAL_TURN);
            // The lock is taken without the GIL: another thread (a completion thread of the
            // torch backend) may hold it while it waits, and needs the GIL to return.
            let settled = py.detach(|| {
                lock(&self.pending)
                    .as_ref()
                    .map_or(true, |p| p.settle(turn))
            });
            if settled {
                break;
            }
            if let Err(e) = py.check_signals() {
                if let Some(i) = &self.inner {
                    i.comm.abort();
                }
                return Err(e);
            }
            if limit.is_some_and(|l| t0.elapsed() >= l) {
                return Err(errors::timeout(format!(
                    "Work.wait: not finished after {:.3} s (the operation goes on)",
                    t0.elapsed().as_secs_f64()
                )));
            }
        }
        // Taking, finishing and storing under the lock: a second waiter sees the stored
        // outcome, the failure included.
        py.detach(|| {
            let mut pending = lock(&self.pending);
            if let Some(p) = pending.take() {
                let r = match &self.inner {
                    Some(i) => p.finish(&i.pool),
                    None => Ok(None),
                };
                *lock(&self.result) = Some(r);
            }
            drop(pending);
            lock(&self.result).clone().unwrap_or(Ok(None))
        })
        .map_err(comm_err)
    }

    /// True once the operation finished (successfully or not) and its results are in the
    /// caller's buffers; never blocks.
    pub(crate) fn is_completed(&self) -> bool {
        // A waiter holding the lock has not finished yet (and may need the GIL to let go).
        let mut pending = match self.pending.try_lock() {
            Ok(p) => p,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        match pending.as_ref() {
            None => true,
            Some(p) if !p.is_done() => false,
            Some(_) => {
                // Done on the stream: the last copies (bounce buffers into the caller's
                // memory) run now, so a caller that only polls reads the result.
                let p = pending.take().expect("checked above");
                let r = match &self.inner {
                    Some(i) => p.finish(&i.pool),
                    None => Ok(None),
                };
                *lock(&self.result) = Some(r);
                true
            }
        }
    }

    pub(crate) fn __repr__(&self) -> String {
        format!(
            "<flagcx.Work {}>",
            if self.is_completed() {
                "completed"
            } else {
                "pending"
            }
        )
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        let inner = self.inner.take();
        let Some(inner) = inner else { return };
        if let Some(p) = lock(&self.pending).take() {
            if p.is_done() {
                let _ = p.finish(&inner.pool);
            } else {
                lock(&inner.orphans).push(p);
            }
        }
        release(inner);
    }
}
