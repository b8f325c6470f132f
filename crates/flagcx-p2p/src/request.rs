//! The handle of one posted operation: done at posting (the eager path), or a slot the proxy
//! fills, which a waiter also leaves on the communicator's verdict (`crate::guard`).

use std::sync::Arc;
use std::time::Duration;

use crate::error::{CommError, Result};
use crate::op::Slot;

/// A handle to one posted operation.
#[derive(Debug)]
pub struct Request {
    pub(crate) state: State,
    pub(crate) seq: u64,
    pub(crate) spin: Duration,
}

/// Where a request's result is.
#[derive(Debug)]
pub(crate) enum State {
    /// Finished while it was posted (the eager path): nothing shared, nothing to wait for.
    Done(Result<usize>),
    /// With the proxy, which fills the slot.
    Pending(Arc<Slot>),
}

impl Request {
    /// Blocks until the operation finished; returns the bytes moved (for a receive: the bytes
    /// the sender sent, at most the buffer's size).
    pub fn wait(self) -> Result<usize> {
        match self.state {
            State::Done(r) => r,
            State::Pending(slot) => slot
                .wait(None, self.spin)
                .unwrap_or(Err(CommError::Aborted)),
        }
    }

    /// Like [`Request::wait`], giving up after `timeout` (the operation continues).
    pub fn wait_timeout(self, timeout: Duration) -> Result<usize> {
        let seq = self.seq;
        match self.state {
            State::Done(r) => r,
            State::Pending(slot) => slot.wait(Some(timeout), self.spin).unwrap_or_else(|| {
                Err(CommError::Timeout {
                    ms: timeout.as_millis() as u64,
                    peer: None,
                    what: if seq == 0 {
                        "an operation of a group (Request::wait_timeout)".into()
                    } else {
                        format!("operation {seq} (Request::wait_timeout)")
                    },
                })
            }),
        }
    }

    /// Waits up to `timeout` for the operation to finish without taking its result (a later
    /// [`Request::wait`] returns it at once); whether it finished. A caller that must stay
    /// responsive — a Python thread that looks at its signal handlers between turns — waits in
    /// such turns, spinning as [`Request::wait`] does.
    pub fn settle(&self, timeout: Duration) -> bool {
        match &self.state {
            State::Done(_) => true,
            State::Pending(slot) => slot.settle(Some(timeout), self.spin),
        }
    }

    /// True once the operation finished.
    pub fn is_done(&self) -> bool {
        match &self.state {
            State::Done(_) => true,
            State::Pending(slot) => slot.settled(),
        }
    }
}
