//! A communicator's device scratch memory: one allocation, made on first use, that the
//! collectives which need room of their own (the reductions: received blocks before they are
//! combined) reuse call after call. Calls on one stream are ordered by the stream; a call on
//! another stream first waits for an event recorded after the previous user's last step, so
//! two streams never use it at once. A call that needs more grows it: a new allocation, the
//! outgrown one kept until the communicator is destroyed — never a host wait for a stream while
//! a call enqueues, and no free while the job runs: CUDA's free may wait for the whole device,
//! whose streams may wait for copies the proxy has yet to issue (the direct path's hazard,
//! `link/hostmap.rs`). Freed with the communicator, once the last user passed.

use std::time::{Duration, Instant};

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, EventHandle, StreamHandle};

use crate::error::Result;

/// The scratch of one communicator (held under its mutex while a call enqueues).
#[derive(Default)]
pub(crate) struct Scratch {
    held: Option<Held>,
    /// Outgrown allocations, freed with the rest by [`Scratch::release`].
    retired: Vec<Held>,
}

struct Held {
    ptr: DevicePtr,
    len: usize,
    /// Recorded on `last` after the last call's final step.
    done: EventHandle,
    last: StreamHandle,
}

impl Scratch {
    /// At least `len` bytes of device memory usable on `stream` until [`Scratch::used`] is
    /// called: allocated (or grown) on first need, ordered after the previous user where that
    /// was another stream.
    pub(crate) fn take<A: DeviceAdaptor>(
        &mut self,
        a: &A,
        len: usize,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        if let Some(h) = &self.held {
            if h.len >= len {
                if h.last != stream {
                    a.stream_wait_event(stream, h.done)?;
                }
                return Ok(h.ptr);
            }
        }
        // Growing: a new allocation (no ordering needed: no call used it); the old one is kept
        // for the release (see the module doc).
        let ptr = a.mem_alloc(len)?;
        let done = match a.event_create(false) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: just allocated, never used.
                let _ = unsafe { a.mem_free(ptr) };
                return Err(e.into());
            }
        };
        let old = self.held.replace(Held {
            ptr,
            len,
            done,
            last: stream,
        });
        self.retired.extend(old);
        Ok(ptr)
    }

    /// The call that took the scratch on `stream` enqueued its last step that touches it.
    pub(crate) fn used<A: DeviceAdaptor>(&mut self, a: &A, stream: StreamHandle) -> Result<()> {
        if let Some(h) = &mut self.held {
            a.event_record(h.done, stream)?;
            h.last = stream;
        }
        Ok(())
    }

    /// Frees the memory once the last user's stream passed it, waiting at most `timeout`;
    /// past it (a stream held by something that never comes) the memory is left allocated
    /// rather than freed under a stream that may still write it.
    pub(crate) fn release<A: DeviceAdaptor>(&mut self, a: &A, timeout: Duration) {
        let t0 = Instant::now();
        for h in self.retired.drain(..).chain(self.held.take()) {
            Self::free_when_passed(a, h, t0, timeout);
        }
    }

    fn free_when_passed<A: DeviceAdaptor>(a: &A, h: Held, t0: Instant, timeout: Duration) {
        while !a.event_query(h.done).unwrap_or(true) {
            if t0.elapsed() > timeout {
                tracing::warn!(
                    "a stream has not passed the communicator's last reduction after {timeout:?}: \
                     its {} bytes of scratch memory stay allocated",
                    h.len
                );
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let _ = a.event_destroy(h.done);
        // SAFETY: ours, and every stream that used it passed its last use.
        let _ = unsafe { a.mem_free(h.ptr) };
    }
}
