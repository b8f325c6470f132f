//! One core for GPU runtimes shaped like CUDA's driver API (CUDA itself, HIP).
//!
//! Both runtimes offer the same operations over different FFIs: allocations with byte-form IPC
//! handles, VMM allocations with fd handles, pinned and registered host memory, streams,
//! events, peer access, capture modes, host functions and stream value operations. Everything
//! that is not the FFI call itself lives here once: the tracking of every handle handed out
//! (so a stale or foreign one is a typed error before it reaches the runtime), argument
//! validation, the order of multi-step operations and their undo on failure, the IPC handle
//! cache, and teardown. A vendor crate implements [`Driver`] — one raw call per method, with
//! its own error names — and exposes `GpuAdaptor<ItsDriver>` as its adaptor.

// tidy: long file: the whole DeviceAdaptor contract once for every CUDA-shaped runtime, each method's checks beside its call.

use std::collections::HashSet;
use std::ffi::c_void;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};

use crate::tracking::{lock, HandleSet, RangeMap};
use crate::{
    AdaptorError, Capabilities, CaptureMode, DeviceAdaptor, DeviceProperties, DevicePtr,
    EventHandle, HostFn, IpcFdHandle, IpcMemHandle, Result, SlotStep, StreamHandle, Vendor,
    WaitCondition, IPC_HANDLE_BYTES,
};

mod driver;
mod events;
mod marks;

pub use driver::{run_host_fn, CopyKind, Driver, DriverInfo};

/// What a tracked device-visible range is, which decides how it is released.
#[derive(Debug, Clone, Copy)]
enum Mem {
    /// [`Driver::mem_alloc`]: byte-form IPC exportable. The handle is cached once exported: the
    /// transports export the same buffer for every receive, and an importer caches mappings by
    /// handle bytes. Freeing the allocation drops the cache with it.
    Plain {
        handle: Option<[u8; IPC_HANDLE_BYTES]>,
    },
    /// [`Driver::vmm_create`] + [`Driver::vmm_map`]: fd-form IPC exportable.
    Vmm { handle: u64 },
    /// Opened with [`Driver::ipc_open_handle`], `opens` times: the runtime returns the existing
    /// mapping for a handle its context has open and counts the opens, each ended by one close.
    IpcLegacy { opens: u32 },
    /// Imported with [`Driver::vmm_import_fd`] and mapped here.
    IpcVmm { handle: u64 },
}

/// The [`DeviceAdaptor`] of any [`Driver`]. Cheap to clone; clones share the device and all
/// tracking.
pub struct GpuAdaptor<D: Driver> {
    inner: Arc<Core<D>>,
}

impl<D: Driver> Clone for GpuAdaptor<D> {
    fn clone(&self) -> Self {
        GpuAdaptor {
            inner: self.inner.clone(),
        }
    }
}

struct Core<D: Driver> {
    driver: D,
    device: usize,
    info: DriverInfo,
    streams: HandleSet,
    /// Streams the application created and lent us (`stream_adopt`): never destroyed here.
    adopted: HandleSet,
    events: HandleSet,
    /// Events without timing as words the streams write (`events.rs`); `None`: the runtime's.
    marks: Option<Mutex<marks::Marks>>,
    mem: Mutex<RangeMap<Mem>>,
    pinned: Mutex<HashSet<u64>>,
    registered: Mutex<HashSet<u64>>,
    /// Peers whose access we enabled (released at drop).
    peers: Mutex<HashSet<usize>>,
    /// A stream of our own that nothing is ever enqueued on, queried to learn whether the
    /// context faulted while a mark is pending (`events.rs`): a query of the recording stream
    /// itself can wait inside the driver while another thread enqueues on that stream with
    /// its queue full, and the device may be waiting for this very thread. `None` without
    /// marks, or where it could not be made (the recording stream is queried then).
    fault_probe: Option<u64>,
}

impl<D: Driver> std::fmt::Debug for GpuAdaptor<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuAdaptor")
            .field("vendor", &D::VENDOR)
            .field("device", &self.inner.device)
            .field("caps", &self.inner.info.caps)
            .finish()
    }
}

/// A stream value operation's address: not null, `width`-byte aligned.
fn aligned(op: &'static str, addr: DevicePtr, width: u64) -> Result<()> {
    if addr.is_null() || addr.0 % width != 0 {
        return Err(AdaptorError::invalid(
            op,
            format!("{addr} is null or not {width}-byte aligned"),
        ));
    }
    Ok(())
}

impl<D: Driver> GpuAdaptor<D> {
    /// Opens device `device` of the runtime.
    ///
    /// Returns [`AdaptorError::Unavailable`] when the runtime is missing or sees no device,
    /// and [`AdaptorError::InvalidDevice`] for an index past the last device.
    pub fn open(device: usize) -> Result<Self> {
        let (driver, info) = D::open(device)?;
        let marks = events::marks_for(&info, std::env::var(events::EVENTS_ENV).ok().as_deref())?;
        let fault_probe = match &marks {
            Some(_) => driver.bind().and_then(|()| driver.stream_create()).ok(),
            None => None,
        };
        let adaptor = GpuAdaptor {
            inner: Arc::new(Core {
                driver,
                device,
                info,
                streams: HandleSet::new("stream"),
                adopted: HandleSet::new("adopted stream"),
                events: HandleSet::new("event"),
                marks,
                mem: Mutex::default(),
                pinned: Mutex::default(),
                registered: Mutex::default(),
                peers: Mutex::default(),
                fault_probe,
            }),
        };
        adaptor.prepare_marks();
        Ok(adaptor)
    }

    /// The driver, with this device's context current on the calling thread: for a vendor
    /// crate's own extensions (loading and launching kernels) beside the adaptor contract.
    pub fn driver(&self) -> Result<&D> {
        self.bound()
    }

    /// The driver, bound to this device on the calling thread.
    fn bound(&self) -> Result<&D> {
        self.inner.driver.bind()?;
        Ok(&self.inner.driver)
    }

    fn stream(&self, s: StreamHandle) -> Result<u64> {
        if self.inner.adopted.check(s.0).is_err() {
            self.inner.streams.check(s.0)?;
        }
        Ok(s.0)
    }

    fn event(&self, e: EventHandle) -> Result<u64> {
        self.inner.events.check(e.0)?;
        Ok(e.0)
    }

    /// A runtime's out-of-memory failure as [`AdaptorError::OutOfMemory`].
    fn oom(&self, e: AdaptorError, requested: usize) -> AdaptorError {
        match e {
            AdaptorError::Vendor { code, .. } if code == D::OUT_OF_MEMORY => {
                AdaptorError::OutOfMemory {
                    vendor: D::VENDOR,
                    device: self.inner.device,
                    requested,
                    code: Some(code),
                }
            }
            other => other,
        }
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        AdaptorError::check_device(D::VENDOR, peer, self.inner.info.count)
    }

    /// Validates a copy's stream and pointers; `None` when there is nothing to do (`n == 0`).
    fn copy_args(
        &self,
        op: &'static str,
        stream: StreamHandle,
        n: usize,
        ptrs: &[u64],
    ) -> Result<Option<(&D, u64)>> {
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(None);
        }
        if ptrs.contains(&0) {
            return Err(AdaptorError::invalid(op, "null pointer"));
        }
        Ok(Some((self.bound()?, s)))
    }

    /// Validates a stream value operation: the capability for its width, an aligned address.
    fn value_args(
        &self,
        op: &'static str,
        stream: StreamHandle,
        addr: DevicePtr,
        wide: bool,
    ) -> Result<(&D, u64)> {
        let caps = self.inner.info.caps;
        if !(if wide {
            caps.stream_mem_ops_64
        } else {
            caps.stream_mem_ops
        }) {
            return Err(AdaptorError::Unsupported {
                vendor: D::VENDOR,
                op,
            });
        }
        aligned(op, addr, if wide { 8 } else { 4 })?;
        let s = self.stream(stream)?;
        Ok((self.bound()?, s))
    }

    /// Checks an imported fd handle's vendor and size against this device.
    fn fd_import_args(&self, op: &'static str, handle: &IpcFdHandle) -> Result<()> {
        if !self.inner.info.caps.ipc_fd {
            return Err(AdaptorError::Unsupported {
                vendor: D::VENDOR,
                op,
            });
        }
        if handle.vendor != D::VENDOR {
            return Err(AdaptorError::invalid(
                op,
                format!(
                    "a {} handle cannot be imported by {}",
                    handle.vendor,
                    D::VENDOR
                ),
            ));
        }
        let g = self.inner.info.granularity;
        if handle.size == 0 || handle.size % g != 0 {
            return Err(AdaptorError::invalid(
                op,
                format!(
                    "size {} is not a multiple of the {g}-byte granularity",
                    handle.size
                ),
            ));
        }
        Ok(())
    }

    /// Maps VMM `handle` of `size` bytes and tracks it as `kind`; on failure releases the
    /// handle, which nothing else holds yet.
    fn map_and_track(
        &self,
        op: &'static str,
        handle: u64,
        size: usize,
        kind: Mem,
    ) -> Result<DevicePtr> {
        let d = self.bound()?;
        // SAFETY: a live handle of `size` bytes, created or imported just now by the caller.
        let ptr = match unsafe { d.vmm_map(handle, size) } {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the handle is not mapped and nothing else holds it.
                let _ = unsafe { d.vmm_release(handle) };
                return Err(e);
            }
        };
        if let Err(e) = lock(&self.inner.mem).insert(op, ptr, size, kind) {
            // SAFETY: mapped just above; nobody saw the range.
            let _ = unsafe { d.vmm_unmap(ptr, size, handle) };
            return Err(e);
        }
        Ok(DevicePtr(ptr))
    }
}

impl Mem {
    /// Releases a range of this kind (`len` bytes at `base`) that tracking no longer holds.
    ///
    /// # Safety
    /// The range was ours, is untracked now, and no work still uses it.
    unsafe fn release<D: Driver>(self, d: &D, base: u64, len: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe {
            match self {
                Mem::Plain { .. } => d.mem_free(base),
                Mem::IpcLegacy { opens } => (0..opens).try_for_each(|_| d.ipc_close_handle(base)),
                Mem::Vmm { handle } | Mem::IpcVmm { handle } => d.vmm_unmap(base, len, handle),
            }
        }
    }
}

impl<D: Driver> Drop for Core<D> {
    fn drop(&mut self) {
        let d = &self.driver;
        let _ = d.bind();
        // SAFETY: the adaptor is going away, so no clone can enqueue more work; every tracked
        // handle is ours and released exactly once. Errors at teardown have no one to go to.
        unsafe {
            for s in self.streams.drain().into_iter().chain(self.fault_probe) {
                let _ = d.stream_destroy(s);
            }
            for e in self.events.drain() {
                if !events::is_mark(e) {
                    let _ = d.event_destroy(e);
                }
            }
            if let Some(marks) = &self.marks {
                GpuAdaptor::release_slabs(marks, d);
            }
            for (base, len, kind) in lock(&self.mem).drain() {
                let _ = kind.release(d, base, len);
            }
            for p in lock(&self.pinned).drain() {
                let _ = d.host_free(p as *mut u8);
            }
            for p in lock(&self.registered).drain() {
                let _ = d.host_unregister(p as *mut u8);
            }
            for p in lock(&self.peers).drain() {
                d.release_peer(p);
            }
            d.close();
        }
    }
}

impl<D: Driver> GpuAdaptor<D> {
    /// The byte-form handle of memory the application allocated with the runtime (torch's
    /// caching allocator carves tensors out of `cudaMalloc` segments): the runtime names the
    /// allocation holding `ptr` and exports it. Never cached: the application may free the
    /// segment behind our back and get another one at the same address, whose handle differs
    /// (importers key their mappings by handle bytes). Pool (`cudaMallocAsync`) and VMM memory
    /// has no byte-form handle: the runtime's refusal is returned as it is.
    fn ipc_get_foreign_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        let d = self.bound()?;
        let (base, _) = d.mem_range(ptr.0).map_err(|e| not_device_memory(e, ptr))?;
        // SAFETY: the runtime just named `base` as the start of a live allocation of this
        // context; the caller (a transport) holds the buffer inside it for the operation.
        let bytes = unsafe { d.ipc_get_handle(base)? };
        Ok(IpcMemHandle {
            vendor: D::VENDOR,
            bytes,
        })
    }
}

/// The runtime's "no allocation there" for an address range query (invalid value, 1; not
/// found, 500 — the same codes in CUDA and HIP) is a foreign pointer: `InvalidArgument`, with
/// the runtime's answer in the reason.
fn not_device_memory(e: AdaptorError, ptr: DevicePtr) -> AdaptorError {
    match e {
        AdaptorError::Vendor { op, code, name, .. } if code == 1 || code == 500 => {
            AdaptorError::invalid(op, format!("{ptr} is not device memory ({name} ({code}))"))
        }
        other => other,
    }
}

impl<D: Driver> DeviceAdaptor for GpuAdaptor<D> {
    fn vendor(&self) -> Vendor {
        D::VENDOR
    }

    fn device(&self) -> usize {
        self.inner.device
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.inner.info.count)
    }

    fn properties(&self, index: usize) -> Result<DeviceProperties> {
        self.check_peer(index)?;
        self.bound()?.properties(index)
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.info.caps
    }

    fn mem_alloc(&self, size: usize) -> Result<DevicePtr> {
        const OP: &str = "mem_alloc";
        if size == 0 {
            return Err(AdaptorError::invalid(OP, "zero-byte allocation"));
        }
        let d = self.bound()?;
        let p = d.mem_alloc(size).map_err(|e| self.oom(e, size))?;
        if let Err(e) = lock(&self.inner.mem).insert(OP, p, size, Mem::Plain { handle: None }) {
            // SAFETY: allocated just above; nobody saw it.
            let _ = unsafe { d.mem_free(p) };
            return Err(e);
        }
        Ok(DevicePtr(p))
    }

    fn mem_alloc_shareable(&self, size: usize) -> Result<DevicePtr> {
        self.mem_alloc_shareable_on(size, self.inner.device)
    }

    fn mem_alloc_shareable_on(&self, size: usize, device: usize) -> Result<DevicePtr> {
        const OP: &str = "mem_alloc_shareable";
        if size == 0 {
            return Err(AdaptorError::invalid(OP, "zero-byte allocation"));
        }
        self.check_peer(device)?;
        let own = device == self.inner.device;
        let g = self.inner.info.granularity;
        if g == 0 || !(own || self.can_access_peer(device)?) {
            if own {
                // No VMM with fd handles here: plain memory (byte-form IPC still works).
                return self.mem_alloc(size);
            }
            // Without VMM or peer access, this device's copies cannot reach that memory.
            return Err(AdaptorError::Unsupported {
                vendor: D::VENDOR,
                op: "mem_alloc_shareable_on (another device)",
            });
        }
        let padded = size
            .checked_next_multiple_of(g)
            .ok_or_else(|| AdaptorError::invalid(OP, format!("{size} bytes is too large")))?;
        let handle = self
            .bound()?
            .vmm_create(padded, device)
            .map_err(|e| self.oom(e, size))?;
        self.map_and_track(OP, handle, padded, Mem::Vmm { handle })
    }

    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        let (len, kind) = lock(&self.inner.mem).remove_if("mem_free", ptr.0, |k| {
            matches!(k, Mem::Plain { .. } | Mem::Vmm { .. })
        })?;
        let d = self.bound()?;
        // SAFETY: our allocation, untracked now; the caller guarantees no work still uses it.
        unsafe { kind.release(d, ptr.0, len) }
    }

    fn mem_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        if ptr.is_null() {
            return Err(AdaptorError::invalid(
                "mem_get_range",
                "null device pointer",
            ));
        }
        if let Some((base, len, _)) = lock(&self.inner.mem).find(ptr.0) {
            return Ok((DevicePtr(base), len));
        }
        let (base, len) = self
            .bound()?
            .mem_range(ptr.0)
            .map_err(|e| not_device_memory(e, ptr))?;
        Ok((DevicePtr(base), len))
    }

    fn mem_buffer_id(&self, ptr: DevicePtr) -> Result<Option<u64>> {
        if ptr.is_null() {
            return Err(AdaptorError::invalid(
                "mem_buffer_id",
                "null device pointer",
            ));
        }
        self.bound()?.buffer_id(ptr.0)
    }

    fn host_alloc(&self, size: usize) -> Result<*mut u8> {
        if size == 0 {
            return Err(AdaptorError::invalid("host_alloc", "zero-byte allocation"));
        }
        let p = self
            .bound()?
            .host_alloc(size)
            .map_err(|e| self.oom(e, size))?;
        lock(&self.inner.pinned).insert(p as u64);
        Ok(p)
    }

    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()> {
        if !lock(&self.inner.pinned).remove(&(ptr as u64)) {
            return Err(AdaptorError::InvalidHandle {
                kind: "pinned host memory",
                value: ptr as u64,
            });
        }
        // SAFETY: our pinned allocation, untracked now; the caller guarantees it is unused.
        unsafe { self.bound()?.host_free(ptr) }
    }

    unsafe fn host_register(&self, ptr: *mut u8, size: usize) -> Result<DevicePtr> {
        if ptr.is_null() || size == 0 {
            return Err(AdaptorError::invalid(
                "host_register",
                "null pointer or zero size",
            ));
        }
        // SAFETY: the caller guarantees the range is a live mapping while registered.
        let dev = unsafe { self.bound()?.host_register(ptr, size)? };
        lock(&self.inner.registered).insert(ptr as u64);
        Ok(DevicePtr(dev))
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        if !lock(&self.inner.registered).remove(&(ptr as u64)) {
            return Err(AdaptorError::invalid(
                "host_unregister",
                format!("{ptr:p} was not registered by this adaptor"),
            ));
        }
        // SAFETY: registered by us; the caller guarantees no work uses it.
        unsafe { self.bound()?.host_unregister(ptr) }
    }

    unsafe fn host_pin(&self, ptr: *mut u8, size: usize) -> Result<()> {
        // SAFETY: forwarded contract; registration pins and its alias is simply not used.
        unsafe { self.host_register(ptr, size) }.map(|_| ())
    }

    unsafe fn host_unpin(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.host_unregister(ptr) }
    }

    unsafe fn memcpy_h2d_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let Some((d, s)) = self.copy_args("memcpy_h2d_async", stream, n, &[dst.0, src as u64])?
        else {
            return Ok(());
        };
        // SAFETY: the caller guarantees both ranges for the copy's lifetime.
        unsafe { d.memcpy(CopyKind::HostToDevice, dst.0, src as u64, n, s) }
    }

    unsafe fn memcpy_d2h_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let Some((d, s)) = self.copy_args("memcpy_d2h_async", stream, n, &[dst as u64, src.0])?
        else {
            return Ok(());
        };
        // SAFETY: as above.
        unsafe { d.memcpy(CopyKind::DeviceToHost, dst as u64, src.0, n, s) }
    }

    unsafe fn memcpy_sized_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len_at: DevicePtr,
        cap: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "memcpy_sized_async";
        if !self.inner.info.caps.sized_copy {
            return Err(AdaptorError::Unsupported {
                vendor: D::VENDOR,
                op: OP,
            });
        }
        aligned(OP, len_at, 8)?;
        let Some((d, s)) = self.copy_args(OP, stream, cap, &[dst.0, src.0])? else {
            // Nothing can be copied into a zero-byte capacity.
            return Ok(());
        };
        // SAFETY: the caller guarantees both ranges and the word until the copy completes.
        unsafe { d.sized_copy(s, dst.0, src.0, len_at.0, cap) }
    }

    unsafe fn reduce_async(
        &self,
        dst: DevicePtr,
        a: DevicePtr,
        b: DevicePtr,
        count: usize,
        dtype: crate::reduce::DataType,
        step: crate::reduce::ReduceStep,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "reduce_async";
        let types = self.inner.info.caps.reduce_types;
        let bytes = crate::reduce::check_operands(D::VENDOR, types, dst, a, b, count, dtype, step)?;
        let s = self.stream(stream)?;
        if bytes == 0 {
            return Ok(());
        }
        let combine = matches!(step, crate::reduce::ReduceStep::Combine(_));
        // A kernel that touched memory outside this context would kill the context: every
        // operand is checked to lie inside one allocation (ours, an IPC mapping, or the
        // application's) before the launch.
        for p in [dst, a, b].into_iter().take(if combine { 3 } else { 2 }) {
            let (base, len) = self.mem_get_range(p)?;
            if p.0 - base.0 + bytes as u64 > len as u64 {
                return Err(AdaptorError::invalid(
                    OP,
                    format!("{bytes} bytes at {p} run past the end of its {len}-byte allocation"),
                ));
            }
        }
        let d = self.bound()?;
        let b = if combine { b } else { a };
        // SAFETY: the operands were checked above; the caller keeps them valid until the step
        // completes on the stream.
        unsafe { d.reduce(s, dst.0, a.0, b.0, count, dtype, step) }
    }

    unsafe fn memcpy_d2d_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let Some((d, s)) = self.copy_args("memcpy_d2d_async", stream, n, &[dst.0, src.0])? else {
            return Ok(());
        };
        // SAFETY: as above.
        unsafe { d.memcpy(CopyKind::DeviceToDevice, dst.0, src.0, n, s) }
    }

    unsafe fn memset_async(
        &self,
        dst: DevicePtr,
        value: u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let Some((d, s)) = self.copy_args("memset_async", stream, n, &[dst.0])? else {
            return Ok(());
        };
        // SAFETY: the caller guarantees the range.
        unsafe { d.memset(dst.0, value, n, s) }
    }

    fn stream_create(&self) -> Result<StreamHandle> {
        let s = self.bound()?.stream_create()?;
        self.inner.streams.insert(s);
        Ok(StreamHandle(s))
    }

    unsafe fn stream_adopt(&self, native: u64) -> Result<StreamHandle> {
        if self.inner.streams.check(native).is_ok() {
            return Err(AdaptorError::invalid(
                "stream_adopt",
                format!("{native:#x} is a stream of this adaptor already"),
            ));
        }
        // The caller vouches for the handle (see the trait's safety contract).
        self.inner.adopted.insert(native);
        Ok(StreamHandle(native))
    }

    fn stream_release(&self, stream: StreamHandle) -> Result<()> {
        self.inner.adopted.remove(stream.0)
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        self.inner.streams.remove(stream.0)?;
        // SAFETY: a live stream of ours, now untracked so it cannot be used again.
        unsafe { self.bound()?.stream_destroy(stream.0) }
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        let s = self.stream(stream)?;
        // SAFETY: a live stream.
        unsafe { self.bound()?.stream_synchronize(s) }
    }

    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        let s = self.stream(stream)?;
        // SAFETY: a live stream.
        unsafe { self.bound()?.stream_query(s) }
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        let (s, e) = (self.stream(stream)?, self.event(event)?);
        if events::is_mark(e) {
            return self.mark_wait_on(s, e);
        }
        // SAFETY: live stream and event.
        unsafe { self.bound()?.stream_wait_event(s, e) }
    }

    fn event_create(&self, timing: bool) -> Result<EventHandle> {
        let e = if !timing && self.inner.marks.is_some() {
            self.mark_create()?
        } else {
            self.bound()?.event_create(timing)?
        };
        self.inner.events.insert(e);
        Ok(EventHandle(e))
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.inner.events.remove(event.0)?;
        if events::is_mark(event.0) {
            self.mark_destroy(event.0);
            return Ok(());
        }
        // SAFETY: a live event of ours, now untracked.
        unsafe { self.bound()?.event_destroy(event.0) }
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        let (e, s) = (self.event(event)?, self.stream(stream)?);
        if events::is_mark(e) {
            return self.mark_record(e, s);
        }
        // SAFETY: live event and stream.
        unsafe { self.bound()?.event_record(e, s) }
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        let e = self.event(event)?;
        if events::is_mark(e) {
            return self.mark_query(e);
        }
        // SAFETY: a live event.
        unsafe { self.bound()?.event_query(e) }
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let e = self.event(event)?;
        if events::is_mark(e) {
            return self.mark_synchronize(e);
        }
        // SAFETY: a live event.
        unsafe { self.bound()?.event_synchronize(e) }
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32> {
        let (a, b) = (self.event(start)?, self.event(end)?);
        if events::is_mark(a) || events::is_mark(b) {
            return Err(AdaptorError::invalid(
                "event_elapsed_ms",
                "an event created without timing has no time",
            ));
        }
        // SAFETY: live events.
        unsafe { self.bound()?.event_elapsed_ms(a, b) }
    }

    fn ipc_get_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        const OP: &str = "ipc_get_handle";
        let base = match lock(&self.inner.mem).find(ptr.0) {
            Some((_, _, Mem::Plain { handle: Some(h) })) if !ptr.is_null() => {
                return Ok(IpcMemHandle {
                    vendor: D::VENDOR,
                    bytes: *h,
                })
            }
            Some((base, _, Mem::Plain { handle: None })) if !ptr.is_null() => base,
            Some(_) if !ptr.is_null() => {
                return Err(AdaptorError::invalid(
                    OP,
                    format!(
                        "{ptr} is not a mem_alloc allocation; only those have byte-form handles"
                    ),
                ))
            }
            None if !ptr.is_null() => return self.ipc_get_foreign_handle(ptr),
            _ => {
                return Err(AdaptorError::InvalidHandle {
                    kind: "device pointer",
                    value: ptr.0,
                })
            }
        };
        // SAFETY: `base` is a live mem_alloc allocation of ours.
        let bytes = unsafe { self.bound()?.ipc_get_handle(base)? };
        if let Some((b, _, Mem::Plain { handle })) = lock(&self.inner.mem).find_mut(base) {
            if b == base {
                *handle = Some(bytes);
            }
        }
        Ok(IpcMemHandle {
            vendor: D::VENDOR,
            bytes,
        })
    }

    fn ipc_open_handle(&self, handle: &IpcMemHandle) -> Result<DevicePtr> {
        const OP: &str = "ipc_open_handle";
        if handle.vendor != D::VENDOR {
            return Err(AdaptorError::invalid(
                OP,
                format!(
                    "a {} handle cannot be opened by {}",
                    handle.vendor,
                    D::VENDOR
                ),
            ));
        }
        let d = self.bound()?;
        let p = d.ipc_open_handle(&handle.bytes)?;
        let size = d.mem_range(p).map(|(_, size)| size);
        // One lock for the look and the insert: two threads opening one handle at once get
        // one entry counting both.
        let mut mem = lock(&self.inner.mem);
        // The handle was open already (another communicator of this process maps the same peer
        // allocation): the runtime returned the same mapping and counted the open.
        if let Some((base, _, Mem::IpcLegacy { opens })) = mem.find_mut(p) {
            if base == p {
                *opens += 1;
                return Ok(DevicePtr(p));
            }
        }
        let tracked =
            size.and_then(|size| mem.insert(OP, p, size.max(1), Mem::IpcLegacy { opens: 1 }));
        drop(mem);
        if let Err(e) = tracked {
            // SAFETY: opened just above; nothing saw the mapping.
            let _ = unsafe { d.ipc_close_handle(p) };
            return Err(e);
        }
        Ok(DevicePtr(p))
    }

    fn ipc_export_fd(&self, ptr: DevicePtr) -> Result<IpcFdHandle> {
        const OP: &str = "ipc_export_fd";
        if !self.inner.info.caps.ipc_fd {
            return Err(AdaptorError::Unsupported {
                vendor: D::VENDOR,
                op: OP,
            });
        }
        let (handle, len) = match lock(&self.inner.mem).find(ptr.0) {
            Some((_, len, Mem::Vmm { handle })) if !ptr.is_null() => (*handle, len),
            Some(_) if !ptr.is_null() => {
                return Err(AdaptorError::invalid(
                    OP,
                    format!("{ptr} was not allocated with mem_alloc_shareable"),
                ))
            }
            _ => {
                return Err(AdaptorError::InvalidHandle {
                    kind: "device pointer",
                    value: ptr.0,
                })
            }
        };
        // SAFETY: a live VMM handle of ours.
        let fd = unsafe { self.bound()?.vmm_export_fd(handle)? };
        Ok(IpcFdHandle {
            vendor: D::VENDOR,
            fd,
            size: len,
        })
    }

    fn ipc_import_fd(&self, handle: &IpcFdHandle) -> Result<DevicePtr> {
        const OP: &str = "ipc_import_fd";
        self.fd_import_args(OP, handle)?;
        let h = self.bound()?.vmm_import_fd(handle.fd.as_fd())?;
        self.map_and_track(OP, h, handle.size, Mem::IpcVmm { handle: h })
    }

    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        {
            let mut mem = lock(&self.inner.mem);
            if let Some((base, _, Mem::IpcLegacy { opens })) = mem.find_mut(ptr.0) {
                if base == ptr.0 && *opens > 1 {
                    *opens -= 1;
                    drop(mem);
                    // SAFETY: one of our opens of this mapping, which others still hold: the
                    // runtime only drops its count (the caller guarantees no work uses it).
                    return unsafe { self.bound()?.ipc_close_handle(ptr.0) };
                }
            }
        }
        let (len, kind) = lock(&self.inner.mem).remove_if("ipc_close", ptr.0, |k| {
            matches!(k, Mem::IpcLegacy { .. } | Mem::IpcVmm { .. })
        })?;
        let d = self.bound()?;
        // SAFETY: opened by us, untracked now; the caller guarantees no work uses it.
        unsafe { kind.release(d, ptr.0, len) }
    }

    fn can_access_peer(&self, peer: usize) -> Result<bool> {
        self.check_peer(peer)?;
        if peer == self.inner.device {
            return Ok(true);
        }
        self.bound()?.can_access_peer(peer)
    }

    fn enable_peer_access(&self, peer: usize) -> Result<()> {
        self.check_peer(peer)?;
        if peer == self.inner.device || lock(&self.inner.peers).contains(&peer) {
            return Ok(());
        }
        self.bound()?.enable_peer_access(peer)?;
        lock(&self.inner.peers).insert(peer);
        Ok(())
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        self.bound()?.exchange_capture_mode(mode)
    }

    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        let s = self.stream(stream)?;
        let d = self.bound()?;
        let user = Box::into_raw(Box::new(f)).cast::<c_void>();
        // SAFETY: a live stream; on success the runtime calls `run_host_fn(user)` once.
        let r = unsafe { d.launch_host_func(s, user) };
        if r.is_err() {
            // SAFETY: the launch failed, so nothing will ever call `run_host_fn(user)`.
            drop(unsafe { Box::from_raw(user as *mut HostFn) });
        }
        r
    }

    unsafe fn stream_wait_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
        cond: WaitCondition,
    ) -> Result<()> {
        let (d, s) = self.value_args("stream_wait_value32", stream, addr, false)?;
        // SAFETY: the caller guarantees the address; the stream is live.
        unsafe { d.wait_value(s, addr.0, value as u64, false, cond) }
    }

    unsafe fn stream_wait_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
        cond: WaitCondition,
    ) -> Result<()> {
        let (d, s) = self.value_args("stream_wait_value64", stream, addr, true)?;
        // SAFETY: as above.
        unsafe { d.wait_value(s, addr.0, value, true, cond) }
    }

    unsafe fn stream_write_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<()> {
        let (d, s) = self.value_args("stream_write_value32", stream, addr, false)?;
        // SAFETY: as above.
        unsafe { d.write_value(s, addr.0, value as u64, false) }
    }

    unsafe fn stream_write_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()> {
        let (d, s) = self.value_args("stream_write_value64", stream, addr, true)?;
        // SAFETY: as above.
        unsafe { d.write_value(s, addr.0, value, true) }
    }

    unsafe fn stream_write_values64(
        &self,
        stream: StreamHandle,
        writes: &[(DevicePtr, u64)],
    ) -> Result<()> {
        const OP: &str = "stream_write_values64";
        let Some(&(first, _)) = writes.first() else {
            return Ok(());
        };
        // The capability and the stream once; every address before any write is issued.
        let (d, s) = self.value_args(OP, stream, first, true)?;
        let mut raw = Vec::with_capacity(writes.len());
        for &(addr, value) in writes {
            aligned(OP, addr, 8)?;
            raw.push((addr.0, value));
        }
        // SAFETY: as above, for every address.
        unsafe { d.write_values(s, &raw) }
    }

    unsafe fn stream_slot_steps(&self, stream: StreamHandle, steps: &[SlotStep]) -> Result<()> {
        const OP: &str = "stream_slot_steps";
        if steps.is_empty() {
            return Ok(());
        }
        let caps = self.inner.info.caps;
        if !(caps.stream_mem_ops_64 && caps.sized_copy) {
            return Err(AdaptorError::Unsupported {
                vendor: D::VENDOR,
                op: OP,
            });
        }
        // Every address before anything is enqueued.
        for step in steps {
            let (words, ptrs, inbox) = match *step {
                SlotStep::Put {
                    wait,
                    src,
                    len,
                    slot,
                    writes,
                    inbox,
                    ..
                } => (
                    [wait.map(|w| w.0), Some(writes[0].0), Some(writes[1].0)],
                    (len > 0).then_some([src, slot]),
                    inbox,
                ),
                SlotStep::Take {
                    wait,
                    slot,
                    len_at,
                    dst,
                    cap,
                    inbox,
                    done,
                } => (
                    [Some(wait.0), Some(len_at), done.map(|d| d.0)],
                    (cap > 0).then_some([slot, dst]),
                    inbox,
                ),
            };
            let inbox_words = inbox.map(|i| [i.len_at, i.status]);
            for w in words
                .into_iter()
                .flatten()
                .chain(inbox_words.into_iter().flatten())
            {
                aligned(OP, w, 8)?;
                if w.is_null() {
                    // A kernel would write or poll address 0 (a done word of 0 reads as none).
                    return Err(AdaptorError::invalid(OP, "null word"));
                }
            }
            if ptrs.is_some_and(|p| p.iter().any(|p| p.is_null()))
                || inbox.is_some_and(|i| i.slot.is_null())
            {
                return Err(AdaptorError::invalid(OP, "null pointer"));
            }
        }
        let s = self.stream(stream)?;
        let d = self.bound()?;
        // SAFETY: the caller's contract; the context is bound.
        match unsafe { d.slot_steps(s, steps) } {
            Err(AdaptorError::Unsupported { .. }) => {
                // SAFETY: forwarded contract.
                unsafe { crate::slot_steps_in_order(self, stream, steps) }
            }
            r => r,
        }
    }
}
