//! Enqueued operations ([`Pending`]): what tells each finished, and what it holds until then
//! (its Python handle is [`crate::work::Work`]; a communicator keeps the ones whose handle
//! was dropped, `crate::inner`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use flagcx::{Collective, Request, StreamHandle};

use crate::dlpack::Imported;
use crate::lock;
use crate::stage::{self, Pool};

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
