//! What one rank holds between calls ([`Inner`]), shared by the `Comm` and its `Work`s.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flagcx::{Adaptor, Comm, DeviceAdaptor, Stream, StreamHandle, Vendor};
use pyo3::prelude::*;

use crate::errors::{comm_err, invalid};
use crate::lock;
use crate::pending::{Late, Pending};
use crate::stage::Pool;

/// What one rank holds: the communicator, its stream, the streams adopted from callers, the
/// staging pool, and operations whose `Work` was dropped before they finished.
pub(crate) struct Inner {
    // Field order is drop order: the communicator before the streams it may have joined.
    pub(crate) comm: Comm<Adaptor>,
    pub(crate) own: Stream<Adaptor>,
    pub(crate) adopted: Mutex<HashMap<u64, StreamHandle>>,
    pub(crate) pool: Pool,
    pub(crate) orphans: Mutex<Vec<Pending>>,
    /// Per thread with a group open (posts in it do not wait): the staging of its calls, copied back at `group_end`
    /// (the group's operations are enqueued only then).
    pub(crate) groups: Mutex<HashMap<std::thread::ThreadId, Vec<Arc<Mutex<Late>>>>>,
}

impl Inner {
    pub(crate) fn adaptor(&self) -> &Adaptor {
        self.comm.adaptor()
    }

    /// The stream an operation runs on: ours, or a caller's native stream (GPU vendors).
    pub(crate) fn stream(&self, native: Option<u64>) -> PyResult<StreamHandle> {
        let Some(native) = native else {
            return Ok(self.own.handle());
        };
        if !matches!(self.adaptor().vendor(), Vendor::Cuda | Vendor::Hip) {
            return Err(invalid(format!(
                "stream=: a {} rank runs operations on its own stream; pass no stream",
                self.adaptor().vendor().name()
            )));
        }
        let mut adopted = lock(&self.adopted);
        if let Some(h) = adopted.get(&native) {
            return Ok(*h);
        }
        // SAFETY: the caller passes a live stream of this process's runtime on this device
        // (documented on every call taking `stream=`); it is released at close.
        let h = unsafe { self.adaptor().stream_adopt(native) }.map_err(|e| comm_err(e.into()))?;
        adopted.insert(native, h);
        Ok(h)
    }

    pub(crate) fn in_group(&self) -> bool {
        lock(&self.groups).contains_key(&std::thread::current().id())
    }

    /// Drops the orphans that finished (their buffers' owners get them back).
    pub(crate) fn sweep(&self) {
        let mut o = lock(&self.orphans);
        if !o.is_empty() {
            o.retain(|p| !p.is_done());
        }
    }
}

/// Drops a reference to a rank's state without the GIL where it is the last one: tearing the
/// communicator down joins its progress thread, which may be logging through Python and need
/// the GIL meanwhile.
pub(crate) fn release(inner: Arc<Inner>) {
    if Arc::strong_count(&inner) > 1 {
        return;
    }
    let mut inner = Some(inner);
    let _ = Python::try_attach(|py| {
        let i = inner.take();
        py.detach(move || drop(i));
    });
    // The interpreter is gone or going: no Python thread can hold the GIL against us.
    drop(inner);
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Operations nobody waited for still use their buffers: let them finish (or fail on
        // the communicator's timeout) before the buffers' owners get them back. No abort: a
        // peer may still be finishing an operation with this rank that ours saw complete.
        for p in std::mem::take(&mut *lock(&self.orphans)) {
            let _ = p.settle(Duration::from_secs(5));
        }
        let a = self.comm.adaptor().clone();
        for (_, h) in lock(&self.adopted).drain() {
            let _ = a.stream_release(h);
        }
    }
}
