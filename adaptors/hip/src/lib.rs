//! `flagcx-hip`: the flagcx-rs adaptor contract on AMD GPUs, through HIP.
//!
//! Built with `hip-sys` against `libamdhip64` (Debian: `apt-get install libamdhip64-dev hipcc`).
//! On a machine without an AMD GPU, [`HipAdaptor::open`] returns
//! [`AdaptorError::Unavailable`] with the runtime's reason (`hipErrorNoDevice`), so the
//! conformance suite reports every case as skipped.
//!
//! Mapping of the contract: devices are selected with `hipSetDevice` on whichever thread calls
//! in; byte-form IPC uses `hipIpcGetMemHandle` on `hipMalloc` memory; fd-form IPC uses the VMM
//! calls (`hipMemCreate` with POSIX-fd handles) where the runtime reports an allocation
//! granularity; host functions use `hipStreamAddCallback` (HIP 5.2 lacks `hipLaunchHostFunc`);
//! stream memory operations are probed at open time. Every handle is tracked, as in the other
//! vendors, so stale or foreign handles are typed errors before they reach the runtime.

// tidy: long file: the whole DeviceAdaptor over one FFI; what it shares with the CUDA crate moves into a common driver core.

#![deny(unsafe_op_in_unsafe_fn)]

mod ffi;

use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use flagcx_adaptor::tracking::{lock, HandleSet, RangeMap};
use flagcx_adaptor::{
    AdaptorError, Capabilities, CaptureMode, DeviceAdaptor, DeviceProperties, DevicePtr,
    EventHandle, HostFn, IpcFdHandle, IpcMemHandle, Result, StreamHandle, Vendor, WaitCondition,
    IPC_HANDLE_BYTES,
};

use ffi::HipError;

const VENDOR: Vendor = Vendor::Hip;

fn error_name(e: HipError) -> String {
    // SAFETY: hipGetErrorName returns a static string (or null) for any integer code.
    let p = unsafe { ffi::hipGetErrorName(e) };
    if p.is_null() {
        format!("hipError {e}")
    } else {
        // SAFETY: NUL-terminated static string from the runtime.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn vendor_error(op: &'static str, e: HipError) -> AdaptorError {
    AdaptorError::Vendor {
        vendor: VENDOR,
        op,
        code: e as i64,
        name: error_name(e),
    }
}

fn check(op: &'static str, e: HipError) -> Result<()> {
    if e == ffi::SUCCESS {
        Ok(())
    } else {
        Err(vendor_error(op, e))
    }
}

#[derive(Debug, Clone, Copy)]
enum Mem {
    /// `hipMalloc` memory; its IPC handle is cached once exported (dropped with the allocation).
    Plain {
        handle: Option<[u8; IPC_HANDLE_BYTES]>,
    },
    Vmm {
        handle: u64,
    },
    IpcLegacy,
    IpcVmm {
        handle: u64,
    },
}

/// One HIP device. Cheap to clone; clones share all tracking.
#[derive(Clone)]
pub struct HipAdaptor {
    inner: Arc<Inner>,
}

struct Inner {
    device: usize,
    count: usize,
    caps: Capabilities,
    granularity: usize,
    streams: HandleSet,
    /// Streams the application created and lent us (`stream_adopt`): never destroyed here.
    adopted: HandleSet,
    events: HandleSet,
    mem: Mutex<RangeMap<Mem>>,
    pinned: Mutex<HashSet<u64>>,
    registered: Mutex<HashSet<u64>>,
}

impl std::fmt::Debug for HipAdaptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipAdaptor")
            .field("device", &self.inner.device)
            .field("caps", &self.inner.caps)
            .finish()
    }
}

fn vmm_prop(dev: c_int) -> ffi::hipMemAllocationProp {
    use hip_sys::hiprt::{hipMemAllocationHandleType, hipMemAllocationType, hipMemLocationType};
    // SAFETY: every field of the struct is valid when zeroed (each enum has a 0 variant).
    let mut prop: ffi::hipMemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = hipMemAllocationType::hipMemAllocationTypePinned;
    prop.requestedHandleType = hipMemAllocationHandleType::hipMemHandleTypePosixFileDescriptor;
    prop.location.type_ = hipMemLocationType::hipMemLocationTypeDevice;
    prop.location.id = dev;
    prop
}

fn vmm_granularity(dev: c_int) -> Option<usize> {
    let prop = vmm_prop(dev);
    let mut g = 0usize;
    // SAFETY: valid property struct and out-pointer.
    let r = unsafe { ffi::hipMemGetAllocationGranularity(&mut g, &prop, ffi::GRANULARITY_MINIMUM) };
    (r == ffi::SUCCESS && g > 0).then_some(g)
}

/// Tries the stream write/wait value calls on a mapped host word.
fn probe_stream_mem_ops() -> (bool, bool) {
    let mut host: *mut c_void = std::ptr::null_mut();
    let mut dev: *mut c_void = std::ptr::null_mut();
    let mut s: ffi::Stream = std::ptr::null_mut();
    // SAFETY: valid out-pointers; the probe only touches the 16 bytes it allocated and frees
    // everything before returning.
    unsafe {
        let flags = ffi::HOST_MALLOC_MAPPED | ffi::HOST_MALLOC_PORTABLE;
        if ffi::hipHostMalloc(&mut host, 16, flags) != ffi::SUCCESS {
            return (false, false);
        }
        std::ptr::write_bytes(host as *mut u8, 0, 16);
        let ok = ffi::hipHostGetDevicePointer(&mut dev, host, 0) == ffi::SUCCESS
            && ffi::hipStreamCreateWithFlags(&mut s, ffi::STREAM_NON_BLOCKING) == ffi::SUCCESS;
        let (mut r32, mut r64) = (false, false);
        if ok {
            let d64 = (dev as *mut u8).add(8).cast();
            r32 = ffi::hipStreamWriteValue32(s, dev, 0x5a5a, 0) == ffi::SUCCESS
                && ffi::hipStreamWaitValue32(s, dev, 0x5a5a, ffi::WAIT_GEQ, u32::MAX)
                    == ffi::SUCCESS;
            r64 = ffi::hipStreamWriteValue64(s, d64, 1 << 40, 0) == ffi::SUCCESS
                && ffi::hipStreamWaitValue64(s, d64, 1 << 40, ffi::WAIT_GEQ, u64::MAX)
                    == ffi::SUCCESS;
            let synced = ffi::hipStreamSynchronize(s) == ffi::SUCCESS;
            r32 &= synced && std::ptr::read_volatile(host as *const u32) == 0x5a5a;
            r64 &= synced && std::ptr::read_volatile((host as *const u64).add(1)) == 1 << 40;
        }
        if !s.is_null() {
            ffi::hipStreamDestroy(s);
        }
        ffi::hipHostFree(host);
        (r32, r64)
    }
}

fn unavailable(reason: String) -> AdaptorError {
    AdaptorError::Unavailable {
        vendor: VENDOR,
        reason,
    }
}

impl HipAdaptor {
    /// Opens HIP device `device`.
    ///
    /// Returns [`AdaptorError::Unavailable`] when the runtime finds no device.
    pub fn open(device: usize) -> Result<Self> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        let r = unsafe { ffi::hipGetDeviceCount(&mut n) };
        if r != ffi::SUCCESS {
            return Err(unavailable(format!(
                "hipGetDeviceCount failed: {} ({r})",
                error_name(r)
            )));
        }
        let count = n.max(0) as usize;
        if count == 0 {
            return Err(unavailable(format!(
                "the HIP runtime reports no devices ({})",
                error_name(ffi::ERROR_NO_DEVICE)
            )));
        }
        AdaptorError::check_device(VENDOR, device, count)?;
        // SAFETY: range-checked device index.
        check("hipSetDevice", unsafe {
            ffi::hipSetDevice(device as c_int)
        })?;
        let granularity = vmm_granularity(device as c_int).unwrap_or(0);
        let (ops32, ops64) = probe_stream_mem_ops();
        Ok(HipAdaptor {
            inner: Arc::new(Inner {
                device,
                count,
                caps: Capabilities {
                    ipc_bytes: true,
                    ipc_fd: granularity > 0,
                    host_register: true,
                    peer_access: true,
                    host_functions: true,
                    stream_mem_ops: ops32,
                    stream_mem_ops_64: ops64,
                    capture_mode: true,
                    host_addressable: false,
                },
                granularity,
                streams: HandleSet::new("stream"),
                adopted: HandleSet::new("adopted stream"),
                events: HandleSet::new("event"),
                mem: Mutex::default(),
                pinned: Mutex::default(),
                registered: Mutex::default(),
            }),
        })
    }

    fn bind(&self) -> Result<()> {
        // SAFETY: a device index validated at open.
        check("hipSetDevice", unsafe {
            ffi::hipSetDevice(self.inner.device as c_int)
        })
    }

    fn stream(&self, s: StreamHandle) -> Result<ffi::Stream> {
        if self.inner.adopted.check(s.0).is_err() {
            self.inner.streams.check(s.0)?;
        }
        Ok(s.0 as ffi::Stream)
    }

    fn event(&self, e: EventHandle) -> Result<ffi::Event> {
        self.inner.events.check(e.0)?;
        Ok(e.0 as ffi::Event)
    }

    fn oom_or(&self, op: &'static str, r: HipError, requested: usize) -> AdaptorError {
        if r == ffi::ERROR_OUT_OF_MEMORY {
            AdaptorError::OutOfMemory {
                vendor: VENDOR,
                device: self.inner.device,
                requested,
                code: Some(r as i64),
            }
        } else {
            vendor_error(op, r)
        }
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        AdaptorError::check_device(VENDOR, peer, self.inner.count)
    }

    fn map_vmm(&self, handle: u64, size: usize) -> Result<u64> {
        use hip_sys::hiprt::{hipMemAccessFlags, hipMemLocationType};
        let mut p: *mut c_void = std::ptr::null_mut();
        let h = handle as ffi::hipMemGenericAllocationHandle_t;
        // SAFETY: valid out-pointer; size is a granularity multiple.
        check("hipMemAddressReserve", unsafe {
            ffi::hipMemAddressReserve(&mut p, size, 0, std::ptr::null_mut(), 0)
        })?;
        // SAFETY: maps the whole handle into the range just reserved.
        let mapped = check("hipMemMap", unsafe { ffi::hipMemMap(p, size, 0, h, 0) });
        let was_mapped = mapped.is_ok();
        let access = mapped.and_then(|()| {
            // SAFETY: zeroed POD descriptor (0 is a valid variant of each enum), then filled.
            let mut desc: ffi::hipMemAccessDesc = unsafe { std::mem::zeroed() };
            desc.location.type_ = hipMemLocationType::hipMemLocationTypeDevice;
            desc.location.id = self.inner.device as c_int;
            desc.flags = hipMemAccessFlags::hipMemAccessFlagsProtReadWrite;
            // SAFETY: one valid descriptor for the mapped range.
            check("hipMemSetAccess", unsafe {
                ffi::hipMemSetAccess(p, size, &desc, 1)
            })
        });
        if let Err(e) = access {
            // SAFETY: undoing what succeeded above, on a range nobody has seen.
            unsafe {
                if was_mapped {
                    ffi::hipMemUnmap(p, size);
                }
                ffi::hipMemAddressFree(p, size);
            }
            return Err(e);
        }
        Ok(p as u64)
    }

    /// # Safety
    /// No work may still use the range.
    unsafe fn unmap_vmm(&self, ptr: u64, size: usize, handle: u64) -> Result<()> {
        let p = ptr as *mut c_void;
        // SAFETY: forwarded contract; range and handle are ours.
        unsafe {
            check("hipMemUnmap", ffi::hipMemUnmap(p, size))?;
            check("hipMemAddressFree", ffi::hipMemAddressFree(p, size))?;
            check(
                "hipMemRelease",
                ffi::hipMemRelease(handle as ffi::hipMemGenericAllocationHandle_t),
            )
        }
    }

    fn value_op(&self, op: &'static str, addr: DevicePtr, wide: bool) -> Result<()> {
        let ok = if wide {
            self.inner.caps.stream_mem_ops_64
        } else {
            self.inner.caps.stream_mem_ops
        };
        if !ok {
            return Err(AdaptorError::Unsupported { vendor: VENDOR, op });
        }
        let width = if wide { 8 } else { 4 };
        if addr.is_null() || addr.0 % width != 0 {
            return Err(AdaptorError::invalid(
                op,
                format!("{addr} is null or not {width}-byte aligned"),
            ));
        }
        Ok(())
    }

    /// Validates a stream and the pointers of a copy; `None` when there is nothing to do.
    fn copy_args(
        &self,
        op: &'static str,
        stream: StreamHandle,
        n: usize,
        ptrs: &[u64],
    ) -> Result<Option<ffi::Stream>> {
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(None);
        }
        if ptrs.contains(&0) {
            return Err(AdaptorError::invalid(op, "null pointer"));
        }
        self.bind()?;
        Ok(Some(s))
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: no clone remains to enqueue work; each tracked handle is released once.
        unsafe {
            ffi::hipSetDevice(self.device as c_int);
            for s in self.streams.drain() {
                ffi::hipStreamDestroy(s as ffi::Stream);
            }
            for e in self.events.drain() {
                ffi::hipEventDestroy(e as ffi::Event);
            }
            for (base, len, kind) in lock(&self.mem).drain() {
                let p = base as *mut c_void;
                match kind {
                    Mem::Plain { .. } => {
                        ffi::hipFree(p);
                    }
                    Mem::IpcLegacy => {
                        ffi::hipIpcCloseMemHandle(p);
                    }
                    Mem::Vmm { handle } | Mem::IpcVmm { handle } => {
                        ffi::hipMemUnmap(p, len);
                        ffi::hipMemAddressFree(p, len);
                        ffi::hipMemRelease(handle as ffi::hipMemGenericAllocationHandle_t);
                    }
                }
            }
            for p in lock(&self.pinned).drain() {
                ffi::hipHostFree(p as *mut c_void);
            }
            for p in lock(&self.registered).drain() {
                ffi::hipHostUnregister(p as *mut c_void);
            }
        }
    }
}

unsafe extern "C" fn host_fn_trampoline(_s: ffi::Stream, _status: c_int, user: *mut c_void) {
    // SAFETY: `user` is the Box<HostFn> leaked by launch_host_func; called exactly once.
    let f = unsafe { Box::from_raw(user as *mut HostFn) };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        eprintln!("flagcx-hip: a host function panicked; the panic was contained");
    }
}

fn wait_flags(cond: WaitCondition) -> u32 {
    match cond {
        WaitCondition::Geq => ffi::WAIT_GEQ,
        WaitCondition::Eq => ffi::WAIT_EQ,
        WaitCondition::And => ffi::WAIT_AND,
        WaitCondition::Nor => ffi::WAIT_NOR,
    }
}

impl DeviceAdaptor for HipAdaptor {
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
        let mut name = [0 as c_char; 256];
        let mut bus = [0 as c_char; 64];
        let mut total = 0usize;
        let d = index as c_int;
        // SAFETY: valid out-pointers and lengths.
        unsafe {
            check(
                "hipDeviceGetName",
                ffi::hipDeviceGetName(name.as_mut_ptr(), name.len() as c_int, d),
            )?;
            check("hipDeviceTotalMem", ffi::hipDeviceTotalMem(&mut total, d))?;
            check(
                "hipDeviceGetPCIBusId",
                ffi::hipDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, d),
            )?;
        }
        // SAFETY: the runtime NUL-terminates both within their lengths.
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
        const OP: &str = "hipMalloc";
        if size == 0 {
            return Err(AdaptorError::invalid(OP, "zero-byte allocation"));
        }
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let r = unsafe { ffi::hipMalloc(&mut p, size) };
        if r != ffi::SUCCESS {
            return Err(self.oom_or(OP, r, size));
        }
        lock(&self.inner.mem).insert(OP, p as u64, size, Mem::Plain { handle: None })?;
        Ok(DevicePtr(p as u64))
    }

    fn mem_alloc_shareable(&self, size: usize) -> Result<DevicePtr> {
        const OP: &str = "hipMemCreate";
        if size == 0 {
            return Err(AdaptorError::invalid(OP, "zero-byte allocation"));
        }
        let g = self.inner.granularity;
        if g == 0 {
            return self.mem_alloc(size);
        }
        let padded = size
            .checked_next_multiple_of(g)
            .ok_or_else(|| AdaptorError::invalid(OP, format!("{size} bytes is too large")))?;
        self.bind()?;
        let prop = vmm_prop(self.inner.device as c_int);
        let mut h: ffi::hipMemGenericAllocationHandle_t = std::ptr::null_mut();
        // SAFETY: valid property struct and out-pointer.
        let r = unsafe { ffi::hipMemCreate(&mut h, padded, &prop, 0) };
        if r != ffi::SUCCESS {
            return Err(self.oom_or(OP, r, size));
        }
        let ptr = match self.map_vmm(h as u64, padded) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the handle is not mapped.
                unsafe { ffi::hipMemRelease(h) };
                return Err(e);
            }
        };
        lock(&self.inner.mem).insert(OP, ptr, padded, Mem::Vmm { handle: h as u64 })?;
        Ok(DevicePtr(ptr))
    }

    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        let (len, kind) = lock(&self.inner.mem).remove_if("mem_free", ptr.0, |k| {
            matches!(k, Mem::Plain { .. } | Mem::Vmm { .. })
        })?;
        self.bind()?;
        match kind {
            // SAFETY: our allocation; the caller guarantees it is unused.
            Mem::Plain { .. } => check("hipFree", unsafe { ffi::hipFree(ptr.0 as *mut c_void) }),
            // SAFETY: as above.
            Mem::Vmm { handle } => unsafe { self.unmap_vmm(ptr.0, len, handle) },
            _ => unreachable!("filtered by remove_if"),
        }
    }

    fn mem_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        const OP: &str = "hipMemGetAddressRange";
        if ptr.is_null() {
            return Err(AdaptorError::invalid(OP, "null device pointer"));
        }
        if let Some((base, len, _)) = lock(&self.inner.mem).find(ptr.0) {
            return Ok((DevicePtr(base), len));
        }
        self.bind()?;
        let mut base: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: valid out-pointers; the runtime validates the address.
        check(OP, unsafe {
            ffi::hipMemGetAddressRange(&mut base, &mut size, ptr.0 as *mut c_void)
        })
        .map_err(|e| not_device_memory(e, ptr))?;
        Ok((DevicePtr(base as u64), size))
    }

    fn host_alloc(&self, size: usize) -> Result<*mut u8> {
        const OP: &str = "hipHostMalloc";
        if size == 0 {
            return Err(AdaptorError::invalid(OP, "zero-byte allocation"));
        }
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = ffi::HOST_MALLOC_MAPPED | ffi::HOST_MALLOC_PORTABLE;
        // SAFETY: valid out-pointer.
        let r = unsafe { ffi::hipHostMalloc(&mut p, size, flags) };
        if r != ffi::SUCCESS {
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
        check("hipHostFree", unsafe { ffi::hipHostFree(ptr.cast()) })
    }

    unsafe fn host_register(&self, ptr: *mut u8, size: usize) -> Result<DevicePtr> {
        const OP: &str = "hipHostRegister";
        if ptr.is_null() || size == 0 {
            return Err(AdaptorError::invalid(OP, "null pointer or zero size"));
        }
        self.bind()?;
        let flags = ffi::HOST_REGISTER_MAPPED | ffi::HOST_REGISTER_PORTABLE;
        // SAFETY: the caller guarantees the range is a live mapping.
        check(OP, unsafe { ffi::hipHostRegister(ptr.cast(), size, flags) })?;
        let mut dev: *mut c_void = std::ptr::null_mut();
        // SAFETY: registered with the mapped flag just above.
        let r = unsafe { ffi::hipHostGetDevicePointer(&mut dev, ptr.cast(), 0) };
        if let Err(e) = check("hipHostGetDevicePointer", r) {
            // SAFETY: undo the registration above.
            unsafe { ffi::hipHostUnregister(ptr.cast()) };
            return Err(e);
        }
        lock(&self.inner.registered).insert(ptr as u64);
        Ok(DevicePtr(dev as u64))
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        if !lock(&self.inner.registered).remove(&(ptr as u64)) {
            return Err(AdaptorError::invalid(
                "hipHostUnregister",
                format!("{ptr:p} was not registered by this adaptor"),
            ));
        }
        self.bind()?;
        // SAFETY: registered by us; the caller guarantees it is unused.
        check("hipHostUnregister", unsafe {
            ffi::hipHostUnregister(ptr.cast())
        })
    }

    unsafe fn memcpy_h2d_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "hipMemcpyHtoDAsync";
        let Some(s) = self.copy_args(OP, stream, n, &[dst.0, src as u64])? else {
            return Ok(());
        };
        // SAFETY: the caller guarantees both ranges for the copy's lifetime.
        check(OP, unsafe {
            ffi::hipMemcpyHtoDAsync(dst.0 as *mut c_void, src as *mut c_void, n, s)
        })
    }

    unsafe fn memcpy_d2h_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "hipMemcpyDtoHAsync";
        let Some(s) = self.copy_args(OP, stream, n, &[dst as u64, src.0])? else {
            return Ok(());
        };
        // SAFETY: as above.
        check(OP, unsafe {
            ffi::hipMemcpyDtoHAsync(dst.cast(), src.0 as *mut c_void, n, s)
        })
    }

    unsafe fn memcpy_d2d_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "hipMemcpyDtoDAsync";
        let Some(s) = self.copy_args(OP, stream, n, &[dst.0, src.0])? else {
            return Ok(());
        };
        // SAFETY: as above.
        check(OP, unsafe {
            ffi::hipMemcpyDtoDAsync(dst.0 as *mut c_void, src.0 as *mut c_void, n, s)
        })
    }

    unsafe fn memset_async(
        &self,
        dst: DevicePtr,
        value: u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "hipMemsetD8Async";
        let Some(s) = self.copy_args(OP, stream, n, &[dst.0])? else {
            return Ok(());
        };
        // SAFETY: the caller guarantees the range.
        check(OP, unsafe {
            ffi::hipMemsetD8Async(dst.0 as *mut c_void, value, n, s)
        })
    }

    fn stream_create(&self) -> Result<StreamHandle> {
        self.bind()?;
        let mut s: ffi::Stream = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("hipStreamCreateWithFlags", unsafe {
            ffi::hipStreamCreateWithFlags(&mut s, ffi::STREAM_NON_BLOCKING)
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
        // SAFETY: a live stream of ours, now untracked.
        check("hipStreamDestroy", unsafe {
            ffi::hipStreamDestroy(stream.0 as ffi::Stream)
        })
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: a live stream.
        check("hipStreamSynchronize", unsafe {
            ffi::hipStreamSynchronize(s)
        })
    }

    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: a live stream.
        match unsafe { ffi::hipStreamQuery(s) } {
            ffi::SUCCESS => Ok(true),
            ffi::ERROR_NOT_READY => Ok(false),
            r => Err(vendor_error("hipStreamQuery", r)),
        }
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        let s = self.stream(stream)?;
        let e = self.event(event)?;
        self.bind()?;
        // SAFETY: live stream and event.
        check("hipStreamWaitEvent", unsafe {
            ffi::hipStreamWaitEvent(s, e, 0)
        })
    }

    fn event_create(&self, timing: bool) -> Result<EventHandle> {
        self.bind()?;
        let mut e: ffi::Event = std::ptr::null_mut();
        let flags = if timing { 0 } else { ffi::EVENT_DISABLE_TIMING };
        // SAFETY: valid out-pointer.
        check("hipEventCreateWithFlags", unsafe {
            ffi::hipEventCreateWithFlags(&mut e, flags)
        })?;
        self.inner.events.insert(e as u64);
        Ok(EventHandle(e as u64))
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.inner.events.remove(event.0)?;
        self.bind()?;
        // SAFETY: a live event of ours, now untracked.
        check("hipEventDestroy", unsafe {
            ffi::hipEventDestroy(event.0 as ffi::Event)
        })
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        let e = self.event(event)?;
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: live event and stream.
        check("hipEventRecord", unsafe { ffi::hipEventRecord(e, s) })
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        let e = self.event(event)?;
        self.bind()?;
        // SAFETY: a live event.
        match unsafe { ffi::hipEventQuery(e) } {
            ffi::SUCCESS => Ok(true),
            ffi::ERROR_NOT_READY => Ok(false),
            r => Err(vendor_error("hipEventQuery", r)),
        }
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let e = self.event(event)?;
        self.bind()?;
        // SAFETY: a live event.
        check("hipEventSynchronize", unsafe {
            ffi::hipEventSynchronize(e)
        })
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32> {
        let (a, b) = (self.event(start)?, self.event(end)?);
        self.bind()?;
        let mut ms = 0f32;
        // SAFETY: live events and a valid out-pointer.
        check("hipEventElapsedTime", unsafe {
            ffi::hipEventElapsedTime(&mut ms, a, b)
        })?;
        Ok(ms)
    }

    fn ipc_get_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        const OP: &str = "hipIpcGetMemHandle";
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
                    format!("{ptr} is not a hipMalloc allocation"),
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
        // SAFETY: zeroed POD out-parameter.
        let mut h: ffi::hipIpcMemHandle_t = unsafe { std::mem::zeroed() };
        // SAFETY: `base` is a live hipMalloc allocation.
        check(OP, unsafe {
            ffi::hipIpcGetMemHandle(&mut h, base as *mut c_void)
        })?;
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
        const OP: &str = "hipIpcOpenMemHandle";
        if handle.vendor != VENDOR {
            return Err(AdaptorError::invalid(
                OP,
                format!("a {} handle cannot be opened by HIP", handle.vendor),
            ));
        }
        self.bind()?;
        // SAFETY: zeroed POD handle, filled from the bytes.
        let mut h: ffi::hipIpcMemHandle_t = unsafe { std::mem::zeroed() };
        for (c, b) in h.reserved.iter_mut().zip(handle.bytes.iter()) {
            *c = *b as c_char;
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the runtime validates the handle.
        check(OP, unsafe {
            ffi::hipIpcOpenMemHandle(&mut p, h, ffi::IPC_LAZY_ENABLE_PEER_ACCESS)
        })?;
        let mut base: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: `p` was just mapped.
        let r = unsafe { ffi::hipMemGetAddressRange(&mut base, &mut size, p) };
        let tracked = check("hipMemGetAddressRange", r)
            .and_then(|()| lock(&self.inner.mem).insert(OP, p as u64, size.max(1), Mem::IpcLegacy));
        if let Err(e) = tracked {
            // SAFETY: undo the open; nothing saw the mapping.
            unsafe { ffi::hipIpcCloseMemHandle(p) };
            return Err(e);
        }
        Ok(DevicePtr(p as u64))
    }

    fn ipc_export_fd(&self, ptr: DevicePtr) -> Result<IpcFdHandle> {
        const OP: &str = "hipMemExportToShareableHandle";
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
        let mut fd: c_int = -1;
        // SAFETY: for POSIX-fd handles the out-parameter is an int.
        check(OP, unsafe {
            ffi::hipMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast(),
                handle as ffi::hipMemGenericAllocationHandle_t,
                ffi::HANDLE_TYPE_POSIX_FD,
                0,
            )
        })?;
        // SAFETY: a new descriptor that we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(IpcFdHandle {
            vendor: VENDOR,
            fd,
            size: len,
        })
    }

    fn ipc_import_fd(&self, handle: &IpcFdHandle) -> Result<DevicePtr> {
        const OP: &str = "hipMemImportFromShareableHandle";
        if !self.inner.caps.ipc_fd {
            return Err(AdaptorError::Unsupported {
                vendor: VENDOR,
                op: OP,
            });
        }
        if handle.vendor != VENDOR {
            return Err(AdaptorError::invalid(
                OP,
                format!("a {} handle cannot be imported by HIP", handle.vendor),
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
        let mut h: ffi::hipMemGenericAllocationHandle_t = std::ptr::null_mut();
        // SAFETY: for POSIX-fd handles the OS handle is the fd value; the runtime does not take
        // ownership of it.
        check(OP, unsafe {
            ffi::hipMemImportFromShareableHandle(
                &mut h,
                handle.fd.as_raw_fd() as usize as *mut c_void,
                ffi::HANDLE_TYPE_POSIX_FD,
            )
        })?;
        let ptr = match self.map_vmm(h as u64, handle.size) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the imported handle is not mapped.
                unsafe { ffi::hipMemRelease(h) };
                return Err(e);
            }
        };
        lock(&self.inner.mem).insert(OP, ptr, handle.size, Mem::IpcVmm { handle: h as u64 })?;
        Ok(DevicePtr(ptr))
    }

    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        let (len, kind) = lock(&self.inner.mem).remove_if("ipc_close", ptr.0, |k| {
            matches!(k, Mem::IpcLegacy | Mem::IpcVmm { .. })
        })?;
        self.bind()?;
        match kind {
            // SAFETY: opened by us; the caller guarantees it is unused.
            Mem::IpcLegacy => check("hipIpcCloseMemHandle", unsafe {
                ffi::hipIpcCloseMemHandle(ptr.0 as *mut c_void)
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
        let mut can = 0;
        // SAFETY: valid out-pointer and range-checked devices.
        check("hipDeviceCanAccessPeer", unsafe {
            ffi::hipDeviceCanAccessPeer(&mut can, self.inner.device as c_int, peer as c_int)
        })?;
        Ok(can != 0)
    }

    fn enable_peer_access(&self, peer: usize) -> Result<()> {
        self.check_peer(peer)?;
        if peer == self.inner.device {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: range-checked peer with this device current.
        match unsafe { ffi::hipDeviceEnablePeerAccess(peer as c_int, 0) } {
            ffi::SUCCESS | ffi::ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            r => Err(vendor_error("hipDeviceEnablePeerAccess", r)),
        }
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        let mut m = match mode {
            CaptureMode::Global => ffi::CAPTURE_GLOBAL,
            CaptureMode::ThreadLocal => ffi::CAPTURE_THREAD_LOCAL,
            CaptureMode::Relaxed => ffi::CAPTURE_RELAXED,
        };
        // SAFETY: valid in/out pointer.
        check("hipThreadExchangeStreamCaptureMode", unsafe {
            ffi::hipThreadExchangeStreamCaptureMode(&mut m)
        })?;
        Ok(match m {
            ffi::CAPTURE_GLOBAL => CaptureMode::Global,
            ffi::CAPTURE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            _ => CaptureMode::Relaxed,
        })
    }

    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        let s = self.stream(stream)?;
        self.bind()?;
        let user = Box::into_raw(Box::new(f));
        // SAFETY: the trampoline takes the box back exactly once when the runtime calls it.
        let r = unsafe { ffi::hipStreamAddCallback(s, host_fn_trampoline, user.cast(), 0) };
        if r != ffi::SUCCESS {
            // SAFETY: the launch failed, so the trampoline will never run.
            drop(unsafe { Box::from_raw(user) });
            return Err(vendor_error("hipStreamAddCallback", r));
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
        const OP: &str = "hipStreamWaitValue32";
        self.value_op(OP, addr, false)?;
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: the caller guarantees the address; the stream is live.
        check(OP, unsafe {
            ffi::hipStreamWaitValue32(s, addr.0 as *mut c_void, value, wait_flags(cond), u32::MAX)
        })
    }

    unsafe fn stream_wait_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
        cond: WaitCondition,
    ) -> Result<()> {
        const OP: &str = "hipStreamWaitValue64";
        self.value_op(OP, addr, true)?;
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: as above.
        check(OP, unsafe {
            ffi::hipStreamWaitValue64(s, addr.0 as *mut c_void, value, wait_flags(cond), u64::MAX)
        })
    }

    unsafe fn stream_write_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<()> {
        const OP: &str = "hipStreamWriteValue32";
        self.value_op(OP, addr, false)?;
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: as above.
        check(OP, unsafe {
            ffi::hipStreamWriteValue32(s, addr.0 as *mut c_void, value, 0)
        })
    }

    unsafe fn stream_write_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()> {
        const OP: &str = "hipStreamWriteValue64";
        self.value_op(OP, addr, true)?;
        let s = self.stream(stream)?;
        self.bind()?;
        // SAFETY: as above.
        check(OP, unsafe {
            ffi::hipStreamWriteValue64(s, addr.0 as *mut c_void, value, 0)
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
