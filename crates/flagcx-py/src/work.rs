//! The Python handle of an enqueued operation ([`Work`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;

use crate::errors::{self, comm_err};
use crate::inner::{release, Inner};
use crate::pending::Pending;
use crate::{lock, SIGNAL_TURN};

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
