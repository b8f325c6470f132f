//! Safe owners on top of the raw [`DeviceAdaptor`] calls: each frees what it holds on drop.
//!
//! Data movement through these types is synchronous with respect to the borrowed host slices
//! (the stream is synchronized before the call returns), which is what makes it safe; the
//! asynchronous, zero-wait paths are the `unsafe` trait methods.

use crate::adaptor::DeviceAdaptor;
use crate::error::{AdaptorError, Result};
use crate::types::{CaptureMode, DevicePtr, EventHandle, IpcFdHandle, IpcMemHandle, StreamHandle};

/// A stream that is destroyed on drop.
#[derive(Debug)]
pub struct Stream<A: DeviceAdaptor> {
    adaptor: A,
    handle: StreamHandle,
}

impl<A: DeviceAdaptor> Stream<A> {
    /// Creates a stream on `adaptor`'s device.
    pub fn new(adaptor: &A) -> Result<Self> {
        let handle = adaptor.stream_create()?;
        Ok(Stream {
            adaptor: adaptor.clone(),
            handle,
        })
    }

    /// The raw handle, for the `unsafe` adaptor calls.
    pub fn handle(&self) -> StreamHandle {
        self.handle
    }

    /// Blocks until all work on the stream has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.adaptor.stream_synchronize(self.handle)
    }

    /// True when all work on the stream has completed.
    pub fn query(&self) -> Result<bool> {
        self.adaptor.stream_query(self.handle)
    }

    /// Makes later work on this stream wait for `event`'s last recording.
    pub fn wait_event(&self, event: &Event<A>) -> Result<()> {
        self.adaptor.stream_wait_event(self.handle, event.handle)
    }
}

impl<A: DeviceAdaptor> Drop for Stream<A> {
    fn drop(&mut self) {
        // A destroy failure leaves nothing to undo; work already enqueued still completes.
        let _ = self.adaptor.stream_destroy(self.handle);
    }
}

/// An event that is destroyed on drop.
#[derive(Debug)]
pub struct Event<A: DeviceAdaptor> {
    adaptor: A,
    handle: EventHandle,
}

impl<A: DeviceAdaptor> Event<A> {
    /// Creates an event; `timing` enables [`Event::elapsed_ms_since`].
    pub fn new(adaptor: &A, timing: bool) -> Result<Self> {
        let handle = adaptor.event_create(timing)?;
        Ok(Event {
            adaptor: adaptor.clone(),
            handle,
        })
    }

    /// The raw handle.
    pub fn handle(&self) -> EventHandle {
        self.handle
    }

    /// Records the event at the end of `stream`.
    pub fn record(&self, stream: &Stream<A>) -> Result<()> {
        self.adaptor.event_record(self.handle, stream.handle)
    }

    /// True when the last recording has completed.
    pub fn query(&self) -> Result<bool> {
        self.adaptor.event_query(self.handle)
    }

    /// Blocks until the last recording has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.adaptor.event_synchronize(self.handle)
    }

    /// Milliseconds from `start`'s recording to this one's.
    pub fn elapsed_ms_since(&self, start: &Event<A>) -> Result<f32> {
        self.adaptor.event_elapsed_ms(start.handle, self.handle)
    }
}

impl<A: DeviceAdaptor> Drop for Event<A> {
    fn drop(&mut self) {
        let _ = self.adaptor.event_destroy(self.handle);
    }
}

/// Device memory freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer<A: DeviceAdaptor> {
    adaptor: A,
    ptr: DevicePtr,
    len: usize,
}

impl<A: DeviceAdaptor> DeviceBuffer<A> {
    /// Allocates `len` bytes with [`DeviceAdaptor::mem_alloc`].
    pub fn new(adaptor: &A, len: usize) -> Result<Self> {
        let ptr = adaptor.mem_alloc(len)?;
        Ok(DeviceBuffer {
            adaptor: adaptor.clone(),
            ptr,
            len,
        })
    }

    /// Allocates `len` bytes with [`DeviceAdaptor::mem_alloc_shareable`] (fd-exportable).
    pub fn new_shareable(adaptor: &A, len: usize) -> Result<Self> {
        let ptr = adaptor.mem_alloc_shareable(len)?;
        Ok(DeviceBuffer {
            adaptor: adaptor.clone(),
            ptr,
            len,
        })
    }

    /// The device address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Length in bytes, as requested.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no bytes (never, since zero-size allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `data` into the buffer at `offset` and waits for it on `stream`.
    pub fn write(&self, offset: usize, data: &[u8], stream: &Stream<A>) -> Result<()> {
        self.check("DeviceBuffer::write", offset, data.len())?;
        // SAFETY: the range was bounds-checked against this live allocation, and `data` stays
        // borrowed until the stream is synchronized below.
        unsafe {
            self.adaptor.memcpy_h2d_async(
                DevicePtr(self.ptr.0 + offset as u64),
                data.as_ptr(),
                data.len(),
                stream.handle,
            )?;
        }
        stream.synchronize()
    }

    /// Copies `out.len()` bytes from the buffer at `offset` into `out`, waiting on `stream`.
    pub fn read(&self, offset: usize, out: &mut [u8], stream: &Stream<A>) -> Result<()> {
        self.check("DeviceBuffer::read", offset, out.len())?;
        // SAFETY: as in `write`; `out` is exclusively borrowed until the synchronize.
        unsafe {
            self.adaptor.memcpy_d2h_async(
                out.as_mut_ptr(),
                DevicePtr(self.ptr.0 + offset as u64),
                out.len(),
                stream.handle,
            )?;
        }
        stream.synchronize()
    }

    /// Fills the whole buffer with `value`, waiting on `stream`.
    pub fn fill(&self, value: u8, stream: &Stream<A>) -> Result<()> {
        // SAFETY: the whole live allocation, synchronized before returning.
        unsafe {
            self.adaptor
                .memset_async(self.ptr, value, self.len, stream.handle)?;
        }
        stream.synchronize()
    }

    /// Exports the buffer as a byte-form IPC handle.
    pub fn ipc_handle(&self) -> Result<IpcMemHandle> {
        self.adaptor.ipc_get_handle(self.ptr)
    }

    /// Exports the buffer as a file-descriptor IPC handle.
    pub fn ipc_fd(&self) -> Result<IpcFdHandle> {
        self.adaptor.ipc_export_fd(self.ptr)
    }

    fn check(&self, op: &'static str, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(AdaptorError::invalid(
                op,
                format!(
                    "{n} bytes at offset {offset} exceed the {}-byte buffer",
                    self.len
                ),
            )),
        }
    }
}

impl<A: DeviceAdaptor> Drop for DeviceBuffer<A> {
    fn drop(&mut self) {
        // SAFETY: every safe operation on this buffer synchronized its stream, so nothing
        // enqueued through the safe API still uses it. Users of the unsafe API took on that duty.
        let _ = unsafe { self.adaptor.mem_free(self.ptr) };
    }
}

/// Page-locked host memory freed on drop.
#[derive(Debug)]
pub struct PinnedBuffer<A: DeviceAdaptor> {
    adaptor: A,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer exclusively owns its allocation; the raw pointer is only an address.
unsafe impl<A: DeviceAdaptor> Send for PinnedBuffer<A> {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl<A: DeviceAdaptor> Sync for PinnedBuffer<A> {}

impl<A: DeviceAdaptor> PinnedBuffer<A> {
    /// Allocates `len` bytes with [`DeviceAdaptor::host_alloc`].
    pub fn new(adaptor: &A, len: usize) -> Result<Self> {
        let ptr = adaptor.host_alloc(len)?;
        Ok(PinnedBuffer {
            adaptor: adaptor.clone(),
            ptr,
            len,
        })
    }

    /// The host address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<A: DeviceAdaptor> Drop for PinnedBuffer<A> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from host_alloc; the safe API never leaves work in flight on it.
        let _ = unsafe { self.adaptor.host_free(self.ptr) };
    }
}

/// Memory of another process opened through an IPC handle; closed on drop.
#[derive(Debug)]
pub struct IpcMapping<A: DeviceAdaptor> {
    adaptor: A,
    ptr: DevicePtr,
}

impl<A: DeviceAdaptor> IpcMapping<A> {
    /// Opens a byte-form handle.
    pub fn open(adaptor: &A, handle: &IpcMemHandle) -> Result<Self> {
        let ptr = adaptor.ipc_open_handle(handle)?;
        Ok(IpcMapping {
            adaptor: adaptor.clone(),
            ptr,
        })
    }

    /// Imports a file-descriptor handle.
    pub fn import_fd(adaptor: &A, handle: &IpcFdHandle) -> Result<Self> {
        let ptr = adaptor.ipc_import_fd(handle)?;
        Ok(IpcMapping {
            adaptor: adaptor.clone(),
            ptr,
        })
    }

    /// The mapping's base address in this process.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
}

impl<A: DeviceAdaptor> Drop for IpcMapping<A> {
    fn drop(&mut self) {
        // SAFETY: callers that enqueue async work on the mapping keep it alive until that work
        // completes (the transports synchronize before dropping their mappings).
        let _ = unsafe { self.adaptor.ipc_close(self.ptr) };
    }
}

/// Relaxes the calling thread's stream-capture mode for its lifetime, then restores it.
///
/// Allocation and host registration are refused while another thread captures a graph in the
/// default (global) mode; wrap them in this guard.
#[derive(Debug)]
pub struct CaptureModeGuard<'a, A: DeviceAdaptor> {
    adaptor: &'a A,
    previous: Option<CaptureMode>,
}

impl<'a, A: DeviceAdaptor> CaptureModeGuard<'a, A> {
    /// Switches to [`CaptureMode::Relaxed`]. On a vendor without capture modes this is a no-op.
    pub fn relaxed(adaptor: &'a A) -> Result<Self> {
        let previous = match adaptor.exchange_capture_mode(CaptureMode::Relaxed) {
            Ok(prev) => Some(prev),
            Err(e) if e.is_unsupported() => None,
            Err(e) => return Err(e),
        };
        Ok(CaptureModeGuard { adaptor, previous })
    }
}

impl<A: DeviceAdaptor> Drop for CaptureModeGuard<'_, A> {
    fn drop(&mut self) {
        if let Some(prev) = self.previous {
            let _ = self.adaptor.exchange_capture_mode(prev);
        }
    }
}
