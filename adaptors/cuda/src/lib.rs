//! `flagcx-cuda`: the flagcx-rs adaptor contract on NVIDIA GPUs, through cudarc's driver API.
//!
//! `libcuda` is loaded at run time, so this crate builds and links on machines without CUDA;
//! there [`CudaAdaptor::open`] returns [`AdaptorError::Unavailable`] instead of panicking (cudarc
//! itself panics on first use without the library, so presence is checked first).
//!
//! - Contexts: the device's primary context, made current on whichever thread calls in, so the
//!   proxy thread of `flagcx-p2p` can drive the device without setup of its own.
//! - Memory exported through byte-form IPC comes from plain `cuMemAlloc`: stream-ordered pool
//!   allocations cannot be exported with `cuIpcGetMemHandle`. File-descriptor handles need VMM
//!   allocations (`cuMemCreate` with POSIX-fd handles), which
//!   [`DeviceAdaptor::mem_alloc_shareable`] makes, rounded up to the allocation granularity.
//! - Stream memory operations are probed at open time with the `_v2` calls themselves: the old
//!   `CAN_USE_STREAM_MEM_OPS_V1` attribute reads 0 on GPUs where the calls work.
//! - Every stream, event and allocation handed out is tracked, so a stale or foreign handle is a
//!   typed error before it reaches the driver.

// tidy: long file: the whole DeviceAdaptor over one FFI; what it shares with the HIP crate moves into a common driver core.

#![deny(unsafe_op_in_unsafe_fn)]

mod error;

use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUresult};
use flagcx_adaptor::tracking::{lock, HandleSet, RangeMap};
use flagcx_adaptor::{
    AdaptorError, Capabilities, CaptureMode, DeviceAdaptor, DeviceProperties, DevicePtr,
    EventHandle, HostFn, IpcFdHandle, IpcMemHandle, Result, StreamHandle, Vendor, WaitCondition,
    IPC_HANDLE_BYTES,
};

use error::check;

const VENDOR: Vendor = Vendor::Cuda;

/// What a tracked device-visible range is, which decides how it is released.
#[derive(Debug, Clone, Copy)]
enum Mem {
    /// `cuMemAlloc`: byte-form IPC exportable. The handle is cached once exported: the
    /// transports export the same buffer for every receive, and an importer caches mappings by
    /// handle bytes. Freeing the allocation drops the cache with it.
    Plain {
        handle: Option<[u8; IPC_HANDLE_BYTES]>,
    },
    /// `cuMemCreate` + reserve + map: fd-form IPC exportable.
    Vmm { handle: u64 },
    /// Opened with `cuIpcOpenMemHandle`.
    IpcLegacy,
    /// Imported with `cuMemImportFromShareableHandle` and mapped here.
    IpcVmm { handle: u64 },
}

/// A CUDA context handle. The driver API is thread-safe and a context may be made current on
/// any thread, so the raw pointer may be shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ctx(sys::CUcontext);
// SAFETY: see the type's documentation; the pointer is only passed back to the driver.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

/// One CUDA device. Cheap to clone; clones share the primary context and all tracking.
#[derive(Clone)]
pub struct CudaAdaptor {
    inner: Arc<Inner>,
}

struct Inner {
    device: usize,
    cu_device: sys::CUdevice,
    count: usize,
    ctx: Ctx,
    caps: Capabilities,
    /// VMM allocation granularity (0 when VMM is unsupported).
    granularity: usize,
    streams: HandleSet,
    /// Streams the application created and lent us (`stream_adopt`): never destroyed here.
    adopted: HandleSet,
    events: HandleSet,
    mem: Mutex<RangeMap<Mem>>,
    pinned: Mutex<HashSet<u64>>,
    registered: Mutex<HashSet<u64>>,
    /// Primary contexts of peers we enabled access to, retained until drop.
    peers: Mutex<HashMap<usize, Ctx>>,
}

impl std::fmt::Debug for CudaAdaptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaAdaptor")
            .field("device", &self.inner.device)
            .field("caps", &self.inner.caps)
            .finish()
    }
}

/// Whether the loaded driver exports `name` (cudarc panics when calling a missing symbol).
fn has_symbol(name: &CStr) -> bool {
    for lib in [c"libcuda.so.1", c"libcuda.so"] {
        // SAFETY: RTLD_NOLOAD only returns a handle to an already-loaded library; dlsym reads a
        // NUL-terminated name; dlclose balances the successful dlopen.
        unsafe {
            let h = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            if !h.is_null() {
                let found = !libc::dlsym(h, name.as_ptr()).is_null();
                libc::dlclose(h);
                return found;
            }
        }
    }
    false
}

fn unavailable(reason: impl Into<String>) -> AdaptorError {
    AdaptorError::Unavailable {
        vendor: VENDOR,
        reason: reason.into(),
    }
}

impl CudaAdaptor {
    /// Opens CUDA device `device` (its primary context).
    ///
    /// Returns [`AdaptorError::Unavailable`] when the driver library is missing, `cuInit`
    /// fails (e.g. `CUDA_ERROR_NO_DEVICE`), or no device is visible.
    pub fn open(device: usize) -> Result<Self> {
        // SAFETY: only attempts to dlopen the driver library.
        if !unsafe { sys::is_culib_present() } {
            return Err(unavailable(
                "libcuda.so.1 (the NVIDIA driver library) was not found",
            ));
        }
        // SAFETY: plain driver calls with valid out-pointers.
        let r = unsafe { sys::cuInit(0) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(unavailable(format!(
                "cuInit failed: {} ({})",
                error::error_name(r),
                r as u32
            )));
        }
        let mut n = 0;
        // SAFETY: valid out-pointer.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
        let count = n.max(0) as usize;
        if count == 0 {
            return Err(unavailable("the driver reports no CUDA devices"));
        }
        AdaptorError::check_device(VENDOR, device, count)?;
        let mut cu_device = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the device index was range-checked.
        unsafe {
            check(
                "cuDeviceGet",
                sys::cuDeviceGet(&mut cu_device, device as i32),
            )?;
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, cu_device),
            )?;
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
        }
        let mut inner = Inner {
            device,
            cu_device,
            count,
            ctx: Ctx(ctx),
            caps: Capabilities::default(),
            granularity: 0,
            streams: HandleSet::new("stream"),
            adopted: HandleSet::new("adopted stream"),
            events: HandleSet::new("event"),
            mem: Mutex::default(),
            pinned: Mutex::default(),
            registered: Mutex::default(),
            peers: Mutex::default(),
        };
        inner.granularity = vmm_granularity(cu_device).unwrap_or(0);
        let (ops32, ops64) = probe_stream_mem_ops();
        inner.caps = Capabilities {
            ipc_bytes: true,
            ipc_fd: inner.granularity > 0,
            host_register: true,
            peer_access: true,
            host_functions: true,
            stream_mem_ops: ops32,
            stream_mem_ops_64: ops64,
            capture_mode: true,
            host_addressable: false,
        };
        Ok(CudaAdaptor {
            inner: Arc::new(inner),
        })
    }

    /// Makes this device's primary context current on the calling thread.
    fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the adaptor's lifetime.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.inner.ctx.0)
        })
    }

    fn stream(&self, s: StreamHandle) -> Result<sys::CUstream> {
        if self.inner.adopted.check(s.0).is_err() {
            self.inner.streams.check(s.0)?;
        }
        Ok(s.0 as sys::CUstream)
    }

    fn event(&self, e: EventHandle) -> Result<sys::CUevent> {
        self.inner.events.check(e.0)?;
        Ok(e.0 as sys::CUevent)
    }

    fn oom_or(&self, op: &'static str, r: CUresult, requested: usize) -> AdaptorError {
        if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            AdaptorError::OutOfMemory {
                vendor: VENDOR,
                device: self.inner.device,
                requested,
                code: Some(r as u32 as i64),
            }
        } else {
            error::vendor_error(op, r)
        }
    }

    /// Reserves an address range for `size` bytes of `handle`, maps it and grants this device
    /// read-write access. Undoes its own steps on failure.
    fn map_vmm(&self, handle: u64, size: usize) -> Result<u64> {
        let mut ptr = 0;
        // SAFETY: valid out-pointer; size is a granularity multiple.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0)
        })?;
        // SAFETY: maps the whole handle into the range just reserved.
        let mapped = check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        });
        let was_mapped = mapped.is_ok();
        let access = mapped.and_then(|()| {
            // SAFETY: zeroed POD descriptor, then filled in.
            let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            desc.location.id = self.inner.cu_device;
            desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            // SAFETY: one valid descriptor for the mapped range.
            check("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(ptr, size, &desc, 1)
            })
        });
        if let Err(e) = access {
            // SAFETY: undoing what succeeded above, on a range nobody has seen.
            unsafe {
                if was_mapped {
                    sys::cuMemUnmap(ptr, size);
                }
                sys::cuMemAddressFree(ptr, size);
            }
            return Err(e);
        }
        Ok(ptr)
    }

    /// Unmaps and releases a VMM mapping made by [`Self::map_vmm`].
    ///
    /// # Safety
    /// No work may still use the range.
    unsafe fn unmap_vmm(&self, ptr: u64, size: usize, handle: u64) -> Result<()> {
        // SAFETY: forwarded contract; the range and handle are ours.
        unsafe {
            check("cuMemUnmap", sys::cuMemUnmap(ptr, size))?;
            check("cuMemAddressFree", sys::cuMemAddressFree(ptr, size))?;
            check("cuMemRelease", sys::cuMemRelease(handle))
        }
    }

    fn check_value_addr(&self, op: &'static str, addr: DevicePtr, width: u64) -> Result<()> {
        if addr.is_null() || addr.0 % width != 0 {
            return Err(AdaptorError::invalid(
                op,
                format!("{addr} is null or not {width}-byte aligned"),
            ));
        }
        Ok(())
    }

    fn mem_ops(&self, op: &'static str, wide: bool) -> Result<()> {
        let ok = if wide {
            self.inner.caps.stream_mem_ops_64
        } else {
            self.inner.caps.stream_mem_ops
        };
        if ok {
            Ok(())
        } else {
            Err(AdaptorError::Unsupported { vendor: VENDOR, op })
        }
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        AdaptorError::check_device(VENDOR, peer, self.inner.count)
    }
}

/// The minimum VMM granularity for POSIX-fd-shareable device memory, if VMM with fd handles
/// is supported.
fn vmm_granularity(dev: sys::CUdevice) -> Option<usize> {
    for name in [
        c"cuMemCreate",
        c"cuMemExportToShareableHandle",
        c"cuMemImportFromShareableHandle",
    ] {
        if !has_symbol(name) {
            return None;
        }
    }
    let attr = |a| {
        let mut v = 0;
        // SAFETY: valid out-pointer and device.
        let r = unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) };
        r == CUresult::CUDA_SUCCESS && v != 0
    };
    use sys::CUdevice_attribute as A;
    if !attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)
        || !attr(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
    {
        return None;
    }
    let prop = vmm_prop(dev);
    let mut g = 0usize;
    // SAFETY: valid property struct and out-pointer.
    let r = unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    };
    (r == CUresult::CUDA_SUCCESS && g > 0).then_some(g)
}

fn vmm_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: a zeroed POD struct is the documented starting point.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop
}

/// Tries the `_v2` stream write/wait calls on a mapped host word; the old attribute lies.
/// Requires the context to be current.
fn probe_stream_mem_ops() -> (bool, bool) {
    for name in [
        c"cuStreamWaitValue32_v2",
        c"cuStreamWriteValue32_v2",
        c"cuStreamWaitValue64_v2",
        c"cuStreamWriteValue64_v2",
    ] {
        if !has_symbol(name) {
            return (false, false);
        }
    }
    let mut host: *mut c_void = std::ptr::null_mut();
    let mut dev = 0u64;
    let mut stream: sys::CUstream = std::ptr::null_mut();
    // SAFETY: every call gets valid out-pointers; the probe only writes to the 16-byte pinned
    // word it allocated, synchronizes, and frees everything before returning.
    unsafe {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        if sys::cuMemHostAlloc(&mut host, 16, flags) != CUresult::CUDA_SUCCESS {
            return (false, false);
        }
        std::ptr::write_bytes(host as *mut u8, 0, 16);
        let ok = sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) == CUresult::CUDA_SUCCESS
            && sys::cuStreamCreate(&mut stream, 1) == CUresult::CUDA_SUCCESS;
        let mut r32 = false;
        let mut r64 = false;
        if ok {
            let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
            r32 = sys::cuStreamWriteValue32_v2(stream, dev, 0x5a5a, 0) == CUresult::CUDA_SUCCESS
                && sys::cuStreamWaitValue32_v2(stream, dev, 0x5a5a, geq) == CUresult::CUDA_SUCCESS;
            r64 = sys::cuStreamWriteValue64_v2(stream, dev + 8, 1 << 40, 0)
                == CUresult::CUDA_SUCCESS
                && sys::cuStreamWaitValue64_v2(stream, dev + 8, 1 << 40, geq)
                    == CUresult::CUDA_SUCCESS;
            let synced = sys::cuStreamSynchronize(stream) == CUresult::CUDA_SUCCESS;
            r32 &= synced && std::ptr::read_volatile(host as *const u32) == 0x5a5a;
            r64 &= synced && std::ptr::read_volatile((host as *const u64).add(1)) == 1 << 40;
        }
        if !stream.is_null() {
            sys::cuStreamDestroy_v2(stream);
        }
        sys::cuMemFreeHost(host);
        (r32, r64)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: the adaptor is going away, so no clone can enqueue more work; every tracked
        // handle is ours and released exactly once. Errors at teardown have no one to go to.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx.0);
            for s in self.streams.drain() {
                sys::cuStreamDestroy_v2(s as sys::CUstream);
            }
            for e in self.events.drain() {
                sys::cuEventDestroy_v2(e as sys::CUevent);
            }
            for (base, len, kind) in lock(&self.mem).drain() {
                match kind {
                    Mem::Plain { .. } => {
                        sys::cuMemFree_v2(base);
                    }
                    Mem::IpcLegacy => {
                        sys::cuIpcCloseMemHandle(base);
                    }
                    Mem::Vmm { handle } | Mem::IpcVmm { handle } => {
                        sys::cuMemUnmap(base, len);
                        sys::cuMemAddressFree(base, len);
                        sys::cuMemRelease(handle);
                    }
                }
            }
            for p in lock(&self.pinned).drain() {
                sys::cuMemFreeHost(p as *mut c_void);
            }
            for p in lock(&self.registered).drain() {
                sys::cuMemHostUnregister(p as *mut c_void);
            }
            for (peer, _) in lock(&self.peers).drain() {
                let mut dev = 0;
                if sys::cuDeviceGet(&mut dev, peer as i32) == CUresult::CUDA_SUCCESS {
                    sys::cuDevicePrimaryCtxRelease_v2(dev);
                }
            }
            sys::cuDevicePrimaryCtxRelease_v2(self.cu_device);
        }
    }
}

/// Runs a boxed [`HostFn`] handed to `cuLaunchHostFunc`.
unsafe extern "C" fn host_fn_trampoline(user: *mut c_void) {
    // SAFETY: `user` is the Box<HostFn> leaked by launch_host_func; the driver calls this
    // exactly once per launch.
    let f = unsafe { Box::from_raw(user as *mut HostFn) };
    // A panic must not unwind into the driver.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        eprintln!("flagcx-cuda: a host function panicked; the panic was contained");
    }
}

fn wait_flags(cond: WaitCondition) -> u32 {
    use sys::CUstreamWaitValue_flags as F;
    (match cond {
        WaitCondition::Geq => F::CU_STREAM_WAIT_VALUE_GEQ,
        WaitCondition::Eq => F::CU_STREAM_WAIT_VALUE_EQ,
        WaitCondition::And => F::CU_STREAM_WAIT_VALUE_AND,
        WaitCondition::Nor => F::CU_STREAM_WAIT_VALUE_NOR,
    }) as u32
}

impl DeviceAdaptor for CudaAdaptor {
    fn vendor(&self) -> Vendor {
        VENDOR
    }

    fn device(&self) -> usize {
        self.inner.device
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.inner.count)
    }

    fn properties(&self, index: usize) -> Result<DeviceProperties> {
        self.check_peer(index)?;
        let mut dev = 0;
        let mut name = [0 as std::ffi::c_char; 256];
        let mut bus = [0 as std::ffi::c_char; 64];
        let mut total = 0usize;
        // SAFETY: valid out-pointers and buffer lengths.
        unsafe {
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, index as i32))?;
            check(
                "cuDeviceGetName",
                sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev),
            )?;
            check(
                "cuDeviceTotalMem",
                sys::cuDeviceTotalMem_v2(&mut total, dev),
            )?;
            check(
                "cuDeviceGetPCIBusId",
                sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev),
            )?;
        }
        // SAFETY: the driver NUL-terminates both strings within the given lengths.
        let (name, bus) = unsafe { (CStr::from_ptr(name.as_ptr()), CStr::from_ptr(bus.as_ptr())) };
        Ok(DeviceProperties {
            vendor: VENDOR,
            index,
            name: name.to_string_lossy().into_owned(),
            pci_bus_id: Some(bus.to_string_lossy().to_ascii_lowercase()),
            total_memory: total as u64,
        })
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.caps
    }

    fn mem_alloc(&self, size: usize) -> Result<DevicePtr> {
        const OP: &str = "cuMemAlloc";
        if size == 0 {
            return Err(AdaptorError::invalid(OP, "zero-byte allocation"));
        }
        self.bind()?;
        let mut p = 0;
        // SAFETY: valid out-pointer.
        let r = unsafe { sys::cuMemAlloc_v2(&mut p, size) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(self.oom_or(OP, r, size));
        }
        lock(&self.inner.mem).insert(OP, p, size, Mem::Plain { handle: None })?;
        Ok(DevicePtr(p))
    }

    fn mem_alloc_shareable(&self, size: usize) -> Result<DevicePtr> {
        const OP: &str = "cuMemCreate";
        if size == 0 {
            return Err(AdaptorError::invalid(OP, "zero-byte allocation"));
        }
        let g = self.inner.granularity;
        if g == 0 {
            // No VMM with fd handles here: plain memory (byte-form IPC still works).
            return self.mem_alloc(size);
        }
        let padded = size
            .checked_next_multiple_of(g)
            .ok_or_else(|| AdaptorError::invalid(OP, format!("{size} bytes is too large")))?;
        self.bind()?;
        let prop = vmm_prop(self.inner.cu_device);
        let mut handle = 0u64;
        // SAFETY: valid property struct and out-pointer.
        let r = unsafe { sys::cuMemCreate(&mut handle, padded, &prop, 0) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(self.oom_or(OP, r, size));
        }
        let ptr = match self.map_vmm(handle, padded) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the handle was created above and is not mapped.
                unsafe { sys::cuMemRelease(handle) };
                return Err(e);
            }
        };
        lock(&self.inner.mem).insert(OP, ptr, padded, Mem::Vmm { handle })?;
        Ok(DevicePtr(ptr))
    }

    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        const OP: &str = "mem_free";
        let (len, kind) = lock(&self.inner.mem).remove_if(OP, ptr.0, |k| {
            matches!(k, Mem::Plain { .. } | Mem::Vmm { .. })
        })?;
        self.bind()?;
        match kind {
            // SAFETY: our allocation; the caller guarantees no work still uses it.
            Mem::Plain { .. } => check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr.0) }),
            // SAFETY: as above.
            Mem::Vmm { handle } => unsafe { self.unmap_vmm(ptr.0, len, handle) },
            _ => unreachable!("filtered by remove_if"),
        }
    }

    fn mem_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        const OP: &str = "cuMemGetAddressRange";
        if ptr.is_null() {
            return Err(AdaptorError::invalid(OP, "null device pointer"));
        }
        if let Some((base, len, _)) = lock(&self.inner.mem).find(ptr.0) {
            return Ok((DevicePtr(base), len));
        }
        self.bind()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers; the driver validates the address.
        check(OP, unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr.0)
        })
        .map_err(|e| not_device_memory(e, ptr))?;
        Ok((DevicePtr(base), size))
    }

    fn host_alloc(&self, size: usize) -> Result<*mut u8> {
        const OP: &str = "cuMemHostAlloc";
        if size == 0 {
            return Err(AdaptorError::invalid(OP, "zero-byte allocation"));
        }
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: valid out-pointer.
        let r = unsafe { sys::cuMemHostAlloc(&mut p, size, flags) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(self.oom_or(OP, r, size));
        }
        lock(&self.inner.pinned).insert(p as u64);
        Ok(p as *mut u8)
    }

    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()> {
        if !lock(&self.inner.pinned).remove(&(ptr as u64)) {
            return Err(AdaptorError::InvalidHandle {
                kind: "pinned host memory",
                value: ptr as u64,
            });
        }
        self.bind()?;
        // SAFETY: our pinned allocation; the caller guarantees it is unused.
        check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(ptr.cast()) })
    }

    unsafe fn host_register(&self, ptr: *mut u8, size: usize) -> Result<DevicePtr> {
        const OP: &str = "cuMemHostRegister";
        if ptr.is_null() || size == 0 {
            return Err(AdaptorError::invalid(OP, "null pointer or zero size"));
        }
        self.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller guarantees the range is a live mapping.
        check(OP, unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), size, flags)
        })?;
        let mut dev = 0u64;
        // SAFETY: `ptr` was registered with DEVICEMAP just above.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr.cast(), 0) };
        if let Err(e) = check("cuMemHostGetDevicePointer", r) {
            // SAFETY: undo the registration made above.
            unsafe { sys::cuMemHostUnregister(ptr.cast()) };
            return Err(e);
        }
        lock(&self.inner.registered).insert(ptr as u64);
        Ok(DevicePtr(dev))
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        if !lock(&self.inner.registered).remove(&(ptr as u64)) {
            return Err(AdaptorError::invalid(
                "cuMemHostUnregister",
                format!("{ptr:p} was not registered by this adaptor"),
            ));
        }
        self.bind()?;
        // SAFETY: registered by us; the caller guarantees no work uses it.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr.cast())
        })
    }

    unsafe fn memcpy_h2d_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "cuMemcpyHtoDAsync";
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        if src.is_null() || dst.is_null() {
            return Err(AdaptorError::invalid(OP, "null pointer"));
        }
        self.bind()?;
        // SAFETY: the caller guarantees both ranges for the copy's lifetime.
        check(OP, unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.0, src.cast(), n, s)
        })
    }

    unsafe fn memcpy_d2h_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "cuMemcpyDtoHAsync";
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        if dst.is_null() || src.is_null() {
            return Err(AdaptorError::invalid(OP, "null pointer"));
        }
        self.bind()?;
        // SAFETY: as above.
        check(OP, unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src.0, n, s)
        })
    }

    unsafe fn memcpy_d2d_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "cuMemcpyDtoDAsync";
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        if dst.is_null() || src.is_null() {
            return Err(AdaptorError::invalid(OP, "null pointer"));
        }
        self.bind()?;
        // SAFETY: as above.
        check(OP, unsafe { sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, n, s) })
    }

    unsafe fn memset_async(
        &self,
        dst: DevicePtr,
        value: u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "cuMemsetD8Async";
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(AdaptorError::invalid(OP, "null pointer"));
        }
        self.bind()?;
        // SAFETY: the caller guarantees the range.
        check(OP, unsafe { sys::cuMemsetD8Async(dst.0, value, n, s) })
    }

    fn stream_create(&self) -> Result<StreamHandle> {
        self.bind()?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, flags)
        })?;
        self.inner.streams.insert(s as u64);
        Ok(StreamHandle(s as u64))
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
        self.bind()?;
        // SAFETY: a live stream of ours, now untracked so it cannot be used again.
        check("cuStreamDestroy", unsafe {
            sys::cuStreamDestroy_v2(stream.0 as sys::CUstream)
        })
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: a live stream.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(s)
        })
    }

    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: a live stream.
        match unsafe { sys::cuStreamQuery(s) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(error::vendor_error("cuStreamQuery", r)),
        }
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        let s = self.stream(stream)?;
        let e = self.event(event)?;
        self.bind()?;
        // SAFETY: live stream and event.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(s, e, 0)
        })
    }

    fn event_create(&self, timing: bool) -> Result<EventHandle> {
        self.bind()?;
        let mut e: sys::CUevent = std::ptr::null_mut();
        let flags = if timing {
            0
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        };
        // SAFETY: valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut e, flags)
        })?;
        self.inner.events.insert(e as u64);
        Ok(EventHandle(e as u64))
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.inner.events.remove(event.0)?;
        self.bind()?;
        // SAFETY: a live event of ours, now untracked.
        check("cuEventDestroy", unsafe {
            sys::cuEventDestroy_v2(event.0 as sys::CUevent)
        })
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        let e = self.event(event)?;
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: live event and stream.
        check("cuEventRecord", unsafe { sys::cuEventRecord(e, s) })
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        let e = self.event(event)?;
        self.bind()?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(e) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(error::vendor_error("cuEventQuery", r)),
        }
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let e = self.event(event)?;
        self.bind()?;
        // SAFETY: a live event.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(e) })
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32> {
        let (s, e) = (self.event(start)?, self.event(end)?);
        self.bind()?;
        let mut ms = 0f32;
        // SAFETY: live events and a valid out-pointer.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime(&mut ms, s, e)
        })?;
        Ok(ms)
    }

    fn ipc_get_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        const OP: &str = "cuIpcGetMemHandle";
        let base = match lock(&self.inner.mem).find(ptr.0) {
            Some((_, _, Mem::Plain { handle: Some(h) })) if !ptr.is_null() => {
                return Ok(IpcMemHandle {
                    vendor: VENDOR,
                    bytes: *h,
                })
            }
            Some((base, _, Mem::Plain { handle: None })) if !ptr.is_null() => base,
            Some(_) if !ptr.is_null() => {
                return Err(AdaptorError::invalid(
                    OP,
                    format!(
                        "{ptr} is not a cuMemAlloc allocation; only those have byte-form handles"
                    ),
                ))
            }
            _ => {
                return Err(AdaptorError::InvalidHandle {
                    kind: "device pointer",
                    value: ptr.0,
                })
            }
        };
        self.bind()?;
        // SAFETY: a zeroed POD handle as out-parameter.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `base` is a live cuMemAlloc allocation.
        check(OP, unsafe { sys::cuIpcGetMemHandle(&mut h, base) })?;
        let mut bytes = [0u8; IPC_HANDLE_BYTES];
        for (b, c) in bytes.iter_mut().zip(h.reserved.iter()) {
            *b = *c as u8;
        }
        if let Some((b, _, Mem::Plain { handle })) = lock(&self.inner.mem).find_mut(base) {
            if b == base {
                *handle = Some(bytes);
            }
        }
        Ok(IpcMemHandle {
            vendor: VENDOR,
            bytes,
        })
    }

    fn ipc_open_handle(&self, handle: &IpcMemHandle) -> Result<DevicePtr> {
        const OP: &str = "cuIpcOpenMemHandle";
        if handle.vendor != VENDOR {
            return Err(AdaptorError::invalid(
                OP,
                format!("a {} handle cannot be opened by CUDA", handle.vendor),
            ));
        }
        self.bind()?;
        // SAFETY: a zeroed POD handle, filled from the bytes.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (c, b) in h.reserved.iter_mut().zip(handle.bytes.iter()) {
            *c = *b as std::ffi::c_char;
        }
        let mut p = 0u64;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: valid out-pointer; the driver validates the handle.
        check(OP, unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, h, flags) })?;
        let mut size = 0usize;
        let mut base = 0u64;
        // SAFETY: `p` was just mapped.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, p) };
        let tracked = check("cuMemGetAddressRange", r)
            .and_then(|()| lock(&self.inner.mem).insert(OP, p, size.max(1), Mem::IpcLegacy));
        if let Err(e) = tracked {
            // SAFETY: undo the open above; nothing saw the mapping.
            unsafe { sys::cuIpcCloseMemHandle(p) };
            return Err(e);
        }
        Ok(DevicePtr(p))
    }

    fn ipc_export_fd(&self, ptr: DevicePtr) -> Result<IpcFdHandle> {
        const OP: &str = "cuMemExportToShareableHandle";
        if !self.inner.caps.ipc_fd {
            return Err(AdaptorError::Unsupported {
                vendor: VENDOR,
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
        self.bind()?;
        let mut fd: std::ffi::c_int = -1;
        let ty = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for POSIX-fd handles the out-parameter is an int.
        check(OP, unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                handle,
                ty,
                0,
            )
        })?;
        // SAFETY: the driver returned a new descriptor that we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(IpcFdHandle {
            vendor: VENDOR,
            fd,
            size: len,
        })
    }

    fn ipc_import_fd(&self, handle: &IpcFdHandle) -> Result<DevicePtr> {
        const OP: &str = "cuMemImportFromShareableHandle";
        if !self.inner.caps.ipc_fd {
            return Err(AdaptorError::Unsupported {
                vendor: VENDOR,
                op: OP,
            });
        }
        if handle.vendor != VENDOR {
            return Err(AdaptorError::invalid(
                OP,
                format!("a {} handle cannot be imported by CUDA", handle.vendor),
            ));
        }
        let g = self.inner.granularity;
        if handle.size == 0 || handle.size % g != 0 {
            return Err(AdaptorError::invalid(
                OP,
                format!(
                    "size {} is not a multiple of the {g}-byte granularity",
                    handle.size
                ),
            ));
        }
        self.bind()?;
        let mut h = 0u64;
        let ty = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for POSIX-fd handles the OS handle argument is the fd value itself; the
        // driver duplicates what it needs and does not take ownership.
        check(OP, unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                handle.fd.as_raw_fd() as usize as *mut c_void,
                ty,
            )
        })?;
        let ptr = match self.map_vmm(h, handle.size) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the imported handle is not mapped.
                unsafe { sys::cuMemRelease(h) };
                return Err(e);
            }
        };
        lock(&self.inner.mem).insert(OP, ptr, handle.size, Mem::IpcVmm { handle: h })?;
        Ok(DevicePtr(ptr))
    }

    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        let (len, kind) = lock(&self.inner.mem).remove_if("ipc_close", ptr.0, |k| {
            matches!(k, Mem::IpcLegacy | Mem::IpcVmm { .. })
        })?;
        self.bind()?;
        match kind {
            // SAFETY: opened by us; the caller guarantees no work uses it.
            Mem::IpcLegacy => check("cuIpcCloseMemHandle", unsafe {
                sys::cuIpcCloseMemHandle(ptr.0)
            }),
            // SAFETY: as above.
            Mem::IpcVmm { handle } => unsafe { self.unmap_vmm(ptr.0, len, handle) },
            _ => unreachable!("filtered by remove_if"),
        }
    }

    fn can_access_peer(&self, peer: usize) -> Result<bool> {
        self.check_peer(peer)?;
        if peer == self.inner.device {
            return Ok(true);
        }
        let mut pdev = 0;
        let mut can = 0;
        // SAFETY: valid out-pointers and range-checked devices.
        unsafe {
            check("cuDeviceGet", sys::cuDeviceGet(&mut pdev, peer as i32))?;
            check(
                "cuDeviceCanAccessPeer",
                sys::cuDeviceCanAccessPeer(&mut can, self.inner.cu_device, pdev),
            )?;
        }
        Ok(can != 0)
    }

    fn enable_peer_access(&self, peer: usize) -> Result<()> {
        self.check_peer(peer)?;
        if peer == self.inner.device || lock(&self.inner.peers).contains_key(&peer) {
            return Ok(());
        }
        self.bind()?;
        let mut pdev = 0;
        let mut pctx = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the retained context is released on error or at drop.
        unsafe {
            check("cuDeviceGet", sys::cuDeviceGet(&mut pdev, peer as i32))?;
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut pctx, pdev),
            )?;
            match sys::cuCtxEnablePeerAccess(pctx, 0) {
                CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                r => {
                    sys::cuDevicePrimaryCtxRelease_v2(pdev);
                    return Err(error::vendor_error("cuCtxEnablePeerAccess", r));
                }
            }
        }
        lock(&self.inner.peers).insert(peer, Ctx(pctx));
        Ok(())
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        use sys::CUstreamCaptureMode as M;
        let mut m = match mode {
            CaptureMode::Global => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => M::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        self.bind()?;
        // SAFETY: valid in/out pointer.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut m)
        })?;
        Ok(match m {
            M::CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
            M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            _ => CaptureMode::Relaxed,
        })
    }

    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        let s = self.stream(stream)?;
        self.bind()?;
        let user = Box::into_raw(Box::new(f));
        // SAFETY: the trampoline takes back the box exactly once when the driver calls it.
        let r = unsafe { sys::cuLaunchHostFunc(s, Some(host_fn_trampoline), user.cast()) };
        if r != CUresult::CUDA_SUCCESS {
            // SAFETY: the launch failed, so the driver will never call the trampoline.
            drop(unsafe { Box::from_raw(user) });
            return Err(error::vendor_error("cuLaunchHostFunc", r));
        }
        Ok(())
    }

    unsafe fn stream_wait_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
        cond: WaitCondition,
    ) -> Result<()> {
        const OP: &str = "cuStreamWaitValue32";
        self.mem_ops(OP, false)?;
        self.check_value_addr(OP, addr, 4)?;
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: the caller guarantees the address; the stream is live.
        check(OP, unsafe {
            sys::cuStreamWaitValue32_v2(s, addr.0, value, wait_flags(cond))
        })
    }

    unsafe fn stream_wait_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
        cond: WaitCondition,
    ) -> Result<()> {
        const OP: &str = "cuStreamWaitValue64";
        self.mem_ops(OP, true)?;
        self.check_value_addr(OP, addr, 8)?;
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: as above.
        check(OP, unsafe {
            sys::cuStreamWaitValue64_v2(s, addr.0, value, wait_flags(cond))
        })
    }

    unsafe fn stream_write_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<()> {
        const OP: &str = "cuStreamWriteValue32";
        self.mem_ops(OP, false)?;
        self.check_value_addr(OP, addr, 4)?;
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: as above.
        check(OP, unsafe {
            sys::cuStreamWriteValue32_v2(s, addr.0, value, 0)
        })
    }

    unsafe fn stream_write_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()> {
        const OP: &str = "cuStreamWriteValue64";
        self.mem_ops(OP, true)?;
        self.check_value_addr(OP, addr, 8)?;
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: as above.
        check(OP, unsafe {
            sys::cuStreamWriteValue64_v2(s, addr.0, value, 0)
        })
    }
}

/// The driver's "no allocation there" for an address range query (invalid value, 1; not
/// found, 500) is a foreign pointer: `InvalidArgument`, with the driver's answer in the reason.
fn not_device_memory(e: AdaptorError, ptr: DevicePtr) -> AdaptorError {
    match e {
        AdaptorError::Vendor { op, code, name, .. } if code == 1 || code == 500 => {
            AdaptorError::invalid(op, format!("{ptr} is not device memory ({name} ({code}))"))
        }
        other => other,
    }
}
