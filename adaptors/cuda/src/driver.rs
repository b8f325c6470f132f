//! The CUDA driver API's raw calls behind [`Driver`].

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Mutex;

use cudarc::driver::sys::{self, CUresult};
use flagcx_adaptor::gpu::{run_host_fn, CopyKind, Driver, DriverInfo};
use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{
    AdaptorError, Capabilities, CaptureMode, DeviceProperties, Result, SlotStep, Vendor,
    WaitCondition, IPC_HANDLE_BYTES,
};

use crate::error::{call, error_name, vendor_error};
use crate::probe::{has_symbol, mps_client, probe_stream_mem_ops};
use crate::sized::{raw_step, RawStep, MAX_STEPS};

/// A CUDA context handle. The driver API is thread-safe and a context may be made current on
/// any thread, so the raw pointer may be shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ctx(sys::CUcontext);
// SAFETY: see the type's documentation; the pointer is only passed back to the driver.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

/// One CUDA device's primary context and the driver calls on it.
pub struct CudaDriver {
    cu_device: sys::CUdevice,
    ctx: Ctx,
    /// Primary contexts of peers we enabled access to, retained until teardown.
    peers: Mutex<HashMap<usize, sys::CUdevice>>,
    /// The sized-copy kernel, loaded by the process's first open of the device.
    sized: Option<&'static crate::sized::SizedKernel>,
    /// Device-to-device copies on the SMs (`FLAGCX_CUDA_COPY_KERNEL`), if asked for.
    copies: Option<crate::sized::KernelCopies>,
}

fn unavailable(reason: impl Into<String>) -> AdaptorError {
    AdaptorError::Unavailable {
        vendor: Vendor::Cuda,
        reason: reason.into(),
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

/// Runs a boxed host function handed to `cuLaunchHostFunc`.
unsafe extern "C" fn host_fn_trampoline(user: *mut c_void) {
    // SAFETY: `user` is what `launch_host_func` passed; the driver calls this exactly once.
    unsafe { run_host_fn(user) }
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

/// `Ok(true)` for success, `Ok(false)` for "not ready", else the error.
/// The query runs as a marked runtime call (`flagcx_adaptor::incall`), so a stall inside it is
/// named by the stall guard.
fn ready(op: &'static str, f: impl FnOnce() -> CUresult) -> Result<bool> {
    let r = {
        let _in = flagcx_adaptor::incall::enter(op);
        f()
    };
    match r {
        CUresult::CUDA_SUCCESS => Ok(true),
        CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => Err(vendor_error(op, r)),
    }
}

// SAFETY: each method makes the driver calls its contract names, with the driver's semantics
// (asynchronous, stream-ordered copies and value operations; `cuLaunchHostFunc` calls the
// trampoline once per successful launch).
unsafe impl Driver for CudaDriver {
    const VENDOR: Vendor = Vendor::Cuda;
    const OUT_OF_MEMORY: i64 = CUresult::CUDA_ERROR_OUT_OF_MEMORY as u32 as i64;

    fn open(device: usize) -> Result<(Self, DriverInfo)> {
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
                error_name(r),
                r as u32
            )));
        }
        let mut n = 0;
        // SAFETY: valid out-pointer.
        call("cuDeviceGetCount", || unsafe {
            sys::cuDeviceGetCount(&mut n)
        })?;
        let count = n.max(0) as usize;
        if count == 0 {
            return Err(unavailable("the driver reports no CUDA devices"));
        }
        AdaptorError::check_device(Vendor::Cuda, device, count)?;
        let mut cu_device = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the device index was range-checked.
        unsafe {
            call("cuDeviceGet", || {
                sys::cuDeviceGet(&mut cu_device, device as i32)
            })?;
            call("cuDevicePrimaryCtxRetain", || {
                sys::cuDevicePrimaryCtxRetain(&mut ctx, cu_device)
            })?;
            call("cuCtxSetCurrent", || sys::cuCtxSetCurrent(ctx))?;
        }
        let granularity = vmm_granularity(cu_device).unwrap_or(0);
        let (ops32, ops64) = probe_stream_mem_ops();
        // Without it (a driver too old for the PTX) the capability is off and callers keep
        // their other paths.
        let sized = crate::sized::SizedKernel::for_device(cu_device).ok();
        let copies = match crate::sized::KernelCopies::from_env(sized, cu_device) {
            Ok(c) => c,
            Err(e) => {
                // SAFETY: the retain above, which no handle of ours holds yet.
                unsafe { sys::cuDevicePrimaryCtxRelease_v2(cu_device) };
                return Err(e);
            }
        };
        let caps = Capabilities {
            ipc_bytes: true,
            ipc_fd: granularity > 0,
            host_register: true,
            host_pin: true,
            peer_access: true,
            host_functions: true,
            stream_mem_ops: ops32,
            stream_mem_ops_64: ops64,
            capture_mode: true,
            host_addressable: false,
            sized_copy: sized.is_some(),
            host_gates: false,
            concurrent_processes: mps_client(cu_device),
            ipc_fd_foreign: false,
            // Every type, where `kernels/reduce.ptx` loaded.
            reduce_types: if sized.is_some_and(|k| k.reduce.is_some()) {
                flagcx_adaptor::reduce::ALL_TYPES
            } else {
                0
            },
        };
        let driver = CudaDriver {
            cu_device,
            ctx: Ctx(ctx),
            peers: Mutex::default(),
            sized,
            copies,
        };
        Ok((
            driver,
            DriverInfo {
                count,
                caps,
                granularity,
            },
        ))
    }

    fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained until `close`.
        call("cuCtxSetCurrent", || unsafe {
            sys::cuCtxSetCurrent(self.ctx.0)
        })
    }

    fn properties(&self, index: usize) -> Result<DeviceProperties> {
        let mut dev = 0;
        let mut name = [0 as std::ffi::c_char; 256];
        let mut bus = [0 as std::ffi::c_char; 64];
        let mut total = 0usize;
        // SAFETY: valid out-pointers and buffer lengths.
        unsafe {
            call("cuDeviceGet", || sys::cuDeviceGet(&mut dev, index as i32))?;
            call("cuDeviceGetName", || {
                sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev)
            })?;
            call("cuDeviceTotalMem", || {
                sys::cuDeviceTotalMem_v2(&mut total, dev)
            })?;
            call("cuDeviceGetPCIBusId", || {
                sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev)
            })?;
        }
        // SAFETY: the driver NUL-terminates both strings within the given lengths.
        let (name, bus) = unsafe { (CStr::from_ptr(name.as_ptr()), CStr::from_ptr(bus.as_ptr())) };
        Ok(DeviceProperties {
            vendor: Vendor::Cuda,
            index,
            name: name.to_string_lossy().into_owned(),
            pci_bus_id: Some(bus.to_string_lossy().to_ascii_lowercase()),
            total_memory: total as u64,
        })
    }

    fn mem_alloc(&self, size: usize) -> Result<u64> {
        let mut p = 0;
        // SAFETY: valid out-pointer.
        call("cuMemAlloc", || unsafe { sys::cuMemAlloc_v2(&mut p, size) })?;
        Ok(p)
    }

    unsafe fn mem_free(&self, ptr: u64) -> Result<()> {
        // SAFETY: per the contract, a live allocation no work uses.
        call("cuMemFree", || unsafe { sys::cuMemFree_v2(ptr) })
    }

    fn mem_range(&self, ptr: u64) -> Result<(u64, usize)> {
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers; the driver validates the address.
        call("cuMemGetAddressRange", || unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        Ok((base, size))
    }

    fn buffer_id(&self, ptr: u64) -> Result<Option<u64>> {
        let mut id = 0u64;
        // SAFETY: a valid out-pointer of the attribute's type (unsigned long long); the driver
        // validates the address.
        call("cuPointerGetAttribute", || unsafe {
            sys::cuPointerGetAttribute(
                (&mut id as *mut u64).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                ptr,
            )
        })?;
        Ok(Some(id))
    }

    fn host_alloc(&self, size: usize) -> Result<*mut u8> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: valid out-pointer.
        call("cuMemHostAlloc", || unsafe {
            sys::cuMemHostAlloc(&mut p, size, flags)
        })?;
        Ok(p.cast())
    }

    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: per the contract.
        call("cuMemFreeHost", || unsafe {
            sys::cuMemFreeHost(ptr.cast())
        })
    }

    unsafe fn host_register(&self, ptr: *mut u8, size: usize) -> Result<u64> {
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller guarantees the range is a live mapping.
        call("cuMemHostRegister", || unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), size, flags)
        })?;
        let mut dev = 0u64;
        // SAFETY: `ptr` was registered with DEVICEMAP just above.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr.cast(), 0) };
        if let Err(e) = call("cuMemHostGetDevicePointer", || r) {
            // SAFETY: undo the registration made above.
            unsafe { sys::cuMemHostUnregister(ptr.cast()) };
            return Err(e);
        }
        Ok(dev)
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: per the contract.
        call("cuMemHostUnregister", || unsafe {
            sys::cuMemHostUnregister(ptr.cast())
        })
    }

    fn vmm_create(&self, size: usize, device: usize) -> Result<u64> {
        let prop = vmm_prop(device as sys::CUdevice);
        let mut handle = 0u64;
        // SAFETY: valid property struct and out-pointer.
        call("cuMemCreate", || unsafe {
            sys::cuMemCreate(&mut handle, size, &prop, 0)
        })?;
        Ok(handle)
    }

    unsafe fn vmm_map(&self, handle: u64, size: usize) -> Result<u64> {
        let mut ptr = 0;
        // SAFETY: valid out-pointer; size is a granularity multiple.
        call("cuMemAddressReserve", || unsafe {
            sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0)
        })?;
        // SAFETY: maps the whole handle (per the contract, at least `size` bytes) into the
        // range just reserved.
        let mapped = call("cuMemMap", || unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        });
        let was_mapped = mapped.is_ok();
        let access = mapped.and_then(|()| {
            // SAFETY: zeroed POD descriptor, then filled in.
            let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            desc.location.id = self.cu_device;
            desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            // SAFETY: one valid descriptor for the mapped range.
            call("cuMemSetAccess", || unsafe {
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

    unsafe fn vmm_unmap(&self, ptr: u64, size: usize, handle: u64) -> Result<()> {
        // SAFETY: per the contract, our mapping and handle, unused.
        unsafe {
            call("cuMemUnmap", || sys::cuMemUnmap(ptr, size))?;
            call("cuMemAddressFree", || sys::cuMemAddressFree(ptr, size))?;
            call("cuMemRelease", || sys::cuMemRelease(handle))
        }
    }

    unsafe fn vmm_release(&self, handle: u64) -> Result<()> {
        // SAFETY: per the contract, a live handle that is not mapped.
        call("cuMemRelease", || unsafe { sys::cuMemRelease(handle) })
    }

    unsafe fn vmm_export_fd(&self, handle: u64) -> Result<OwnedFd> {
        let mut fd: std::ffi::c_int = -1;
        let ty = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for POSIX-fd handles the out-parameter is an int; a live handle.
        call("cuMemExportToShareableHandle", || unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                handle,
                ty,
                0,
            )
        })?;
        // SAFETY: the driver returned a new descriptor that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn vmm_import_fd(&self, fd: BorrowedFd<'_>) -> Result<u64> {
        let mut h = 0u64;
        let ty = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for POSIX-fd handles the OS handle argument is the fd value itself; the
        // driver duplicates what it needs and does not take ownership.
        call("cuMemImportFromShareableHandle", || unsafe {
            sys::cuMemImportFromShareableHandle(&mut h, fd.as_raw_fd() as usize as *mut c_void, ty)
        })?;
        Ok(h)
    }

    unsafe fn memcpy(
        &self,
        kind: CopyKind,
        dst: u64,
        src: u64,
        n: usize,
        stream: u64,
    ) -> Result<()> {
        let s = stream as sys::CUstream;
        // SAFETY: the caller guarantees both ranges for the copy's lifetime and a live stream.
        unsafe {
            match kind {
                CopyKind::HostToDevice => call("cuMemcpyHtoDAsync", || {
                    sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, n, s)
                }),
                CopyKind::DeviceToHost => call("cuMemcpyDtoHAsync", || {
                    sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, n, s)
                }),
                CopyKind::DeviceToDevice => match &self.copies {
                    Some(k) if k.try_copy(dst, src, n, stream)? => Ok(()),
                    _ => call("cuMemcpyDtoDAsync", || {
                        sys::cuMemcpyDtoDAsync_v2(dst, src, n, s)
                    }),
                },
            }
        }
    }

    unsafe fn memset(&self, dst: u64, value: u8, n: usize, stream: u64) -> Result<()> {
        // SAFETY: the caller guarantees the range and a live stream.
        call("cuMemsetD8Async", || unsafe {
            sys::cuMemsetD8Async(dst, value, n, stream as sys::CUstream)
        })
    }

    fn stream_create(&self) -> Result<u64> {
        let mut s: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer.
        call("cuStreamCreate", || unsafe {
            sys::cuStreamCreate(&mut s, flags)
        })?;
        Ok(s as u64)
    }

    unsafe fn stream_destroy(&self, stream: u64) -> Result<()> {
        // SAFETY: a live stream of ours (contract).
        call("cuStreamDestroy", || unsafe {
            sys::cuStreamDestroy_v2(stream as sys::CUstream)
        })
    }

    unsafe fn stream_synchronize(&self, stream: u64) -> Result<()> {
        // SAFETY: a live stream (contract).
        call("cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(stream as sys::CUstream)
        })
    }

    unsafe fn stream_query(&self, stream: u64) -> Result<bool> {
        // SAFETY: a live stream (contract).
        ready("cuStreamQuery", || unsafe {
            sys::cuStreamQuery(stream as sys::CUstream)
        })
    }

    unsafe fn stream_wait_event(&self, stream: u64, event: u64) -> Result<()> {
        // SAFETY: live stream and event (contract).
        call("cuStreamWaitEvent", || unsafe {
            sys::cuStreamWaitEvent(stream as sys::CUstream, event as sys::CUevent, 0)
        })
    }

    fn event_create(&self, timing: bool) -> Result<u64> {
        let mut e: sys::CUevent = std::ptr::null_mut();
        let flags = if timing {
            0
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        };
        // SAFETY: valid out-pointer.
        call("cuEventCreate", || unsafe {
            sys::cuEventCreate(&mut e, flags)
        })?;
        Ok(e as u64)
    }

    unsafe fn event_destroy(&self, event: u64) -> Result<()> {
        // SAFETY: a live event of ours (contract).
        call("cuEventDestroy", || unsafe {
            sys::cuEventDestroy_v2(event as sys::CUevent)
        })
    }

    unsafe fn event_record(&self, event: u64, stream: u64) -> Result<()> {
        // SAFETY: live event and stream (contract).
        call("cuEventRecord", || unsafe {
            sys::cuEventRecord(event as sys::CUevent, stream as sys::CUstream)
        })
    }

    unsafe fn event_query(&self, event: u64) -> Result<bool> {
        // SAFETY: a live event (contract).
        ready("cuEventQuery", || unsafe {
            sys::cuEventQuery(event as sys::CUevent)
        })
    }

    unsafe fn event_synchronize(&self, event: u64) -> Result<()> {
        // SAFETY: a live event (contract).
        call("cuEventSynchronize", || unsafe {
            sys::cuEventSynchronize(event as sys::CUevent)
        })
    }

    unsafe fn event_elapsed_ms(&self, start: u64, end: u64) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: live events (contract) and a valid out-pointer.
        call("cuEventElapsedTime", || unsafe {
            sys::cuEventElapsedTime(&mut ms, start as sys::CUevent, end as sys::CUevent)
        })?;
        Ok(ms)
    }

    unsafe fn ipc_get_handle(&self, base: u64) -> Result<[u8; IPC_HANDLE_BYTES]> {
        // SAFETY: a zeroed POD handle as out-parameter.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `base` is a live cuMemAlloc allocation (contract).
        call("cuIpcGetMemHandle", || unsafe {
            sys::cuIpcGetMemHandle(&mut h, base)
        })?;
        let mut bytes = [0u8; IPC_HANDLE_BYTES];
        for (b, c) in bytes.iter_mut().zip(h.reserved.iter()) {
            *b = *c as u8;
        }
        Ok(bytes)
    }

    fn ipc_open_handle(&self, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<u64> {
        // SAFETY: a zeroed POD handle, filled from the bytes.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (c, b) in h.reserved.iter_mut().zip(handle.iter()) {
            *c = *b as std::ffi::c_char;
        }
        let mut p = 0u64;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: valid out-pointer; the driver validates the handle.
        call("cuIpcOpenMemHandle", || unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut p, h, flags)
        })?;
        Ok(p)
    }

    unsafe fn ipc_close_handle(&self, ptr: u64) -> Result<()> {
        // SAFETY: opened by us, unused (contract).
        call("cuIpcCloseMemHandle", || unsafe {
            sys::cuIpcCloseMemHandle(ptr)
        })
    }

    fn can_access_peer(&self, peer: usize) -> Result<bool> {
        let mut pdev = 0;
        let mut can = 0;
        // SAFETY: valid out-pointers and a range-checked device.
        unsafe {
            call("cuDeviceGet", || sys::cuDeviceGet(&mut pdev, peer as i32))?;
            call("cuDeviceCanAccessPeer", || {
                sys::cuDeviceCanAccessPeer(&mut can, self.cu_device, pdev)
            })?;
        }
        Ok(can != 0)
    }

    fn enable_peer_access(&self, peer: usize) -> Result<()> {
        let mut pdev = 0;
        let mut pctx = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the retained context is released on error or by
        // `release_peer` at teardown.
        unsafe {
            call("cuDeviceGet", || sys::cuDeviceGet(&mut pdev, peer as i32))?;
            call("cuDevicePrimaryCtxRetain", || {
                sys::cuDevicePrimaryCtxRetain(&mut pctx, pdev)
            })?;
            match sys::cuCtxEnablePeerAccess(pctx, 0) {
                CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                r => {
                    sys::cuDevicePrimaryCtxRelease_v2(pdev);
                    return Err(vendor_error("cuCtxEnablePeerAccess", r));
                }
            }
        }
        lock(&self.peers).insert(peer, pdev);
        Ok(())
    }

    unsafe fn release_peer(&self, peer: usize) {
        if let Some(pdev) = lock(&self.peers).remove(&peer) {
            // SAFETY: retained by `enable_peer_access`, released once.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(pdev) };
        }
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        use sys::CUstreamCaptureMode as M;
        let mut m = match mode {
            CaptureMode::Global => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => M::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: valid in/out pointer.
        call("cuThreadExchangeStreamCaptureMode", || unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut m)
        })?;
        Ok(match m {
            M::CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
            M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            _ => CaptureMode::Relaxed,
        })
    }

    unsafe fn launch_host_func(&self, stream: u64, user: *mut c_void) -> Result<()> {
        // SAFETY: a live stream; the driver calls the trampoline once per successful launch.
        call("cuLaunchHostFunc", || unsafe {
            sys::cuLaunchHostFunc(stream as sys::CUstream, Some(host_fn_trampoline), user)
        })
    }

    unsafe fn wait_value(
        &self,
        stream: u64,
        addr: u64,
        value: u64,
        wide: bool,
        cond: WaitCondition,
    ) -> Result<()> {
        let (s, f) = (stream as sys::CUstream, wait_flags(cond));
        // SAFETY: the caller guarantees the address; the stream is live.
        unsafe {
            if wide {
                call("cuStreamWaitValue64", || {
                    sys::cuStreamWaitValue64_v2(s, addr, value, f)
                })
            } else {
                call("cuStreamWaitValue32", || {
                    sys::cuStreamWaitValue32_v2(s, addr, value as u32, f)
                })
            }
        }
    }

    unsafe fn write_value(&self, stream: u64, addr: u64, value: u64, wide: bool) -> Result<()> {
        let s = stream as sys::CUstream;
        // SAFETY: as above.
        unsafe {
            if wide {
                call("cuStreamWriteValue64", || {
                    sys::cuStreamWriteValue64_v2(s, addr, value, 0)
                })
            } else {
                call("cuStreamWriteValue32", || {
                    sys::cuStreamWriteValue32_v2(s, addr, value as u32, 0)
                })
            }
        }
    }

    unsafe fn write_values(&self, stream: u64, writes: &[(u64, u64)]) -> Result<()> {
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st as Write;
        use sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 as Value;
        let s = stream as sys::CUstream;
        // Batches of 64: on the H200 (driver 580) 64 operations a call worked and 256 were
        // refused with CUDA_ERROR_INVALID_VALUE; the driver documents no limit.
        for chunk in writes.chunks(64) {
            let mut ops: Vec<sys::CUstreamBatchMemOpParams> = chunk
                .iter()
                .map(|&(address, value64)| sys::CUstreamBatchMemOpParams {
                    writeValue: Write {
                        operation: sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64,
                        address,
                        __bindgen_anon_1: Value { value64 },
                        // Each write fences earlier ones (the v2 API has no other mode).
                        flags: 0,
                        alias: 0,
                    },
                })
                .collect();
            // SAFETY: `ops` holds `chunk.len()` (≤ 64) initialized write operations; the
            // addresses are the caller's (as for `write_value`).
            call("cuStreamBatchMemOp", || unsafe {
                sys::cuStreamBatchMemOp_v2(s, ops.len() as u32, ops.as_mut_ptr(), 0)
            })?;
        }
        Ok(())
    }

    unsafe fn sized_copy(
        &self,
        stream: u64,
        dst: u64,
        src: u64,
        len_at: u64,
        cap: usize,
    ) -> Result<()> {
        match self.sized {
            // SAFETY: forwarded contract; the core bound the context.
            Some(k) => unsafe { k.launch(dst, src, len_at, cap, stream) },
            None => Err(AdaptorError::Unsupported {
                vendor: Vendor::Cuda,
                op: "memcpy_sized_async",
            }),
        }
    }

    unsafe fn reduce(
        &self,
        stream: u64,
        dst: u64,
        a: u64,
        b: u64,
        count: usize,
        dtype: flagcx_adaptor::DataType,
        step: flagcx_adaptor::ReduceStep,
    ) -> Result<()> {
        match self.sized {
            // SAFETY: forwarded contract; the core checked the operands and bound the context.
            Some(k) => unsafe { k.launch_reduce(stream, dst, a, b, count, dtype, step) },
            None => Err(AdaptorError::Unsupported {
                vendor: Vendor::Cuda,
                op: "reduce_async",
            }),
        }
    }

    unsafe fn slot_steps(&self, stream: u64, steps: &[SlotStep]) -> Result<()> {
        let Some(k) = self.sized else {
            return Err(AdaptorError::Unsupported {
                vendor: Vendor::Cuda,
                op: "stream_slot_steps",
            });
        };
        let raw: Vec<RawStep> = steps.iter().map(raw_step).collect();
        for chunk in raw.chunks(MAX_STEPS) {
            // SAFETY: forwarded contract (each step encodes the caller's addresses); the core
            // bound the context.
            unsafe { k.launch_steps(chunk, stream) }?;
        }
        Ok(())
    }

    unsafe fn close(&self) {
        // SAFETY: retained in `open`, released once at teardown.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.cu_device) };
    }
}
