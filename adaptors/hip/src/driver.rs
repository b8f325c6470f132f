//! The HIP runtime's raw calls behind [`Driver`].

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use flagcx_adaptor::gpu::{run_host_fn, CopyKind, Driver, DriverInfo};
use flagcx_adaptor::{
    AdaptorError, Capabilities, CaptureMode, DeviceProperties, Result, Vendor, WaitCondition,
    IPC_HANDLE_BYTES,
};

use crate::error::{call, error_name, vendor_error};
use crate::ffi;

/// One HIP device and the runtime calls on it.
pub struct HipDriver {
    device: c_int,
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
        vendor: Vendor::Hip,
        reason,
    }
}

/// Runs a boxed host function handed to `hipStreamAddCallback`.
unsafe extern "C" fn host_fn_trampoline(_s: ffi::Stream, _status: c_int, user: *mut c_void) {
    // SAFETY: `user` is what `launch_host_func` passed; the runtime calls this exactly once.
    unsafe { run_host_fn(user) }
}

fn wait_flags(cond: WaitCondition) -> u32 {
    match cond {
        WaitCondition::Geq => ffi::WAIT_GEQ,
        WaitCondition::Eq => ffi::WAIT_EQ,
        WaitCondition::And => ffi::WAIT_AND,
        WaitCondition::Nor => ffi::WAIT_NOR,
    }
}

/// `Ok(true)` for success, `Ok(false)` for "not ready", else the error.
/// The query runs as a marked runtime call (`flagcx_adaptor::incall`), so a stall inside it is
/// named by the stall guard.
fn ready(op: &'static str, f: impl FnOnce() -> ffi::HipError) -> Result<bool> {
    let r = {
        let _in = flagcx_adaptor::incall::enter(op);
        f()
    };
    match r {
        ffi::SUCCESS => Ok(true),
        ffi::ERROR_NOT_READY => Ok(false),
        r => Err(vendor_error(op, r)),
    }
}

fn ptr(p: u64) -> *mut c_void {
    p as *mut c_void
}

// SAFETY: each method makes the runtime calls its contract names, with the runtime's semantics
// (asynchronous, stream-ordered copies and value operations; `hipStreamAddCallback` calls the
// trampoline once per successful launch).
unsafe impl Driver for HipDriver {
    const VENDOR: Vendor = Vendor::Hip;
    const OUT_OF_MEMORY: i64 = ffi::ERROR_OUT_OF_MEMORY as i64;

    fn open(device: usize) -> Result<(Self, DriverInfo)> {
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
        AdaptorError::check_device(Vendor::Hip, device, count)?;
        let driver = HipDriver {
            device: device as c_int,
        };
        driver.bind()?;
        let granularity = vmm_granularity(driver.device).unwrap_or(0);
        let (ops32, ops64) = probe_stream_mem_ops();
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
            // No kernel for HIP yet (hiprtc or a code object would carry it).
            sized_copy: false,
            host_gates: false,
            // ROCm has no MPS; processes on one GPU share it through its hardware queues, not
            // measured here (no AMD GPU).
            concurrent_processes: false,
            ipc_fd_foreign: false,
            // No reduction kernels yet: every type is `Unsupported`.
            reduce_types: 0,
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
        // SAFETY: a device index validated at open.
        call("hipSetDevice", || unsafe { ffi::hipSetDevice(self.device) })
    }

    fn properties(&self, index: usize) -> Result<DeviceProperties> {
        let mut name = [0 as c_char; 256];
        let mut bus = [0 as c_char; 64];
        let mut total = 0usize;
        let d = index as c_int;
        // SAFETY: valid out-pointers and lengths.
        unsafe {
            call("hipDeviceGetName", || {
                ffi::hipDeviceGetName(name.as_mut_ptr(), name.len() as c_int, d)
            })?;
            call("hipDeviceTotalMem", || {
                ffi::hipDeviceTotalMem(&mut total, d)
            })?;
            call("hipDeviceGetPCIBusId", || {
                ffi::hipDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, d)
            })?;
        }
        // SAFETY: the runtime NUL-terminates both within their lengths.
        let (name, bus) = unsafe { (CStr::from_ptr(name.as_ptr()), CStr::from_ptr(bus.as_ptr())) };
        Ok(DeviceProperties {
            vendor: Vendor::Hip,
            index,
            name: name.to_string_lossy().into_owned(),
            pci_bus_id: Some(bus.to_string_lossy().to_ascii_lowercase()),
            total_memory: total as u64,
        })
    }

    fn mem_alloc(&self, size: usize) -> Result<u64> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        call("hipMalloc", || unsafe { ffi::hipMalloc(&mut p, size) })?;
        Ok(p as u64)
    }

    unsafe fn mem_free(&self, p: u64) -> Result<()> {
        // SAFETY: per the contract, a live allocation no work uses.
        call("hipFree", || unsafe { ffi::hipFree(ptr(p)) })
    }

    fn mem_range(&self, p: u64) -> Result<(u64, usize)> {
        let mut base: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: valid out-pointers; the runtime validates the address.
        call("hipMemGetAddressRange", || unsafe {
            ffi::hipMemGetAddressRange(&mut base, &mut size, ptr(p))
        })?;
        Ok((base as u64, size))
    }

    fn host_alloc(&self, size: usize) -> Result<*mut u8> {
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = ffi::HOST_MALLOC_MAPPED | ffi::HOST_MALLOC_PORTABLE;
        // SAFETY: valid out-pointer.
        call("hipHostMalloc", || unsafe {
            ffi::hipHostMalloc(&mut p, size, flags)
        })?;
        Ok(p.cast())
    }

    unsafe fn host_free(&self, p: *mut u8) -> Result<()> {
        // SAFETY: per the contract.
        call("hipHostFree", || unsafe { ffi::hipHostFree(p.cast()) })
    }

    unsafe fn host_register(&self, p: *mut u8, size: usize) -> Result<u64> {
        let flags = ffi::HOST_REGISTER_MAPPED | ffi::HOST_REGISTER_PORTABLE;
        // SAFETY: the caller guarantees the range is a live mapping.
        call("hipHostRegister", || unsafe {
            ffi::hipHostRegister(p.cast(), size, flags)
        })?;
        let mut dev: *mut c_void = std::ptr::null_mut();
        // SAFETY: registered with the mapped flag just above.
        let r = unsafe { ffi::hipHostGetDevicePointer(&mut dev, p.cast(), 0) };
        if let Err(e) = call("hipHostGetDevicePointer", || r) {
            // SAFETY: undo the registration above.
            unsafe { ffi::hipHostUnregister(p.cast()) };
            return Err(e);
        }
        Ok(dev as u64)
    }

    unsafe fn host_unregister(&self, p: *mut u8) -> Result<()> {
        // SAFETY: per the contract.
        call("hipHostUnregister", || unsafe {
            ffi::hipHostUnregister(p.cast())
        })
    }

    fn vmm_create(&self, size: usize, device: usize) -> Result<u64> {
        let prop = vmm_prop(device as c_int);
        let mut h: ffi::hipMemGenericAllocationHandle_t = std::ptr::null_mut();
        // SAFETY: valid property struct and out-pointer.
        call("hipMemCreate", || unsafe {
            ffi::hipMemCreate(&mut h, size, &prop, 0)
        })?;
        Ok(h as u64)
    }

    unsafe fn vmm_map(&self, handle: u64, size: usize) -> Result<u64> {
        use hip_sys::hiprt::{hipMemAccessFlags, hipMemLocationType};
        let mut p: *mut c_void = std::ptr::null_mut();
        let h = handle as ffi::hipMemGenericAllocationHandle_t;
        // SAFETY: valid out-pointer; size is a granularity multiple.
        call("hipMemAddressReserve", || unsafe {
            ffi::hipMemAddressReserve(&mut p, size, 0, std::ptr::null_mut(), 0)
        })?;
        // SAFETY: maps the whole handle (per the contract, at least `size` bytes) into the
        // range just reserved.
        let mapped = call("hipMemMap", || unsafe { ffi::hipMemMap(p, size, 0, h, 0) });
        let was_mapped = mapped.is_ok();
        let access = mapped.and_then(|()| {
            // SAFETY: zeroed POD descriptor (0 is a valid variant of each enum), then filled.
            let mut desc: ffi::hipMemAccessDesc = unsafe { std::mem::zeroed() };
            desc.location.type_ = hipMemLocationType::hipMemLocationTypeDevice;
            desc.location.id = self.device;
            desc.flags = hipMemAccessFlags::hipMemAccessFlagsProtReadWrite;
            // SAFETY: one valid descriptor for the mapped range.
            call("hipMemSetAccess", || unsafe {
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

    unsafe fn vmm_unmap(&self, p: u64, size: usize, handle: u64) -> Result<()> {
        // SAFETY: per the contract, our mapping and handle, unused.
        unsafe {
            call("hipMemUnmap", || ffi::hipMemUnmap(ptr(p), size))?;
            call("hipMemAddressFree", || ffi::hipMemAddressFree(ptr(p), size))?;
            call("hipMemRelease", || {
                ffi::hipMemRelease(handle as ffi::hipMemGenericAllocationHandle_t)
            })
        }
    }

    unsafe fn vmm_release(&self, handle: u64) -> Result<()> {
        // SAFETY: per the contract, a live handle that is not mapped.
        call("hipMemRelease", || unsafe {
            ffi::hipMemRelease(handle as ffi::hipMemGenericAllocationHandle_t)
        })
    }

    unsafe fn vmm_export_fd(&self, handle: u64) -> Result<OwnedFd> {
        let mut fd: c_int = -1;
        // SAFETY: for POSIX-fd handles the out-parameter is an int; a live handle.
        call("hipMemExportToShareableHandle", || unsafe {
            ffi::hipMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast(),
                handle as ffi::hipMemGenericAllocationHandle_t,
                ffi::HANDLE_TYPE_POSIX_FD,
                0,
            )
        })?;
        // SAFETY: a new descriptor that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn vmm_import_fd(&self, fd: BorrowedFd<'_>) -> Result<u64> {
        let mut h: ffi::hipMemGenericAllocationHandle_t = std::ptr::null_mut();
        // SAFETY: for POSIX-fd handles the OS handle is the fd value; the runtime does not take
        // ownership of it.
        call("hipMemImportFromShareableHandle", || unsafe {
            ffi::hipMemImportFromShareableHandle(
                &mut h,
                fd.as_raw_fd() as usize as *mut c_void,
                ffi::HANDLE_TYPE_POSIX_FD,
            )
        })?;
        Ok(h as u64)
    }

    unsafe fn memcpy(
        &self,
        kind: CopyKind,
        dst: u64,
        src: u64,
        n: usize,
        stream: u64,
    ) -> Result<()> {
        let s = stream as ffi::Stream;
        // SAFETY: the caller guarantees both ranges for the copy's lifetime and a live stream.
        unsafe {
            match kind {
                CopyKind::HostToDevice => call("hipMemcpyHtoDAsync", || {
                    ffi::hipMemcpyHtoDAsync(ptr(dst), ptr(src), n, s)
                }),
                CopyKind::DeviceToHost => call("hipMemcpyDtoHAsync", || {
                    ffi::hipMemcpyDtoHAsync(ptr(dst), ptr(src), n, s)
                }),
                CopyKind::DeviceToDevice => call("hipMemcpyDtoDAsync", || {
                    ffi::hipMemcpyDtoDAsync(ptr(dst), ptr(src), n, s)
                }),
            }
        }
    }

    unsafe fn memset(&self, dst: u64, value: u8, n: usize, stream: u64) -> Result<()> {
        // SAFETY: the caller guarantees the range and a live stream.
        call("hipMemsetD8Async", || unsafe {
            ffi::hipMemsetD8Async(ptr(dst), value, n, stream as ffi::Stream)
        })
    }

    fn stream_create(&self) -> Result<u64> {
        let mut s: ffi::Stream = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        call("hipStreamCreateWithFlags", || unsafe {
            ffi::hipStreamCreateWithFlags(&mut s, ffi::STREAM_NON_BLOCKING)
        })?;
        Ok(s as u64)
    }

    unsafe fn stream_destroy(&self, stream: u64) -> Result<()> {
        // SAFETY: a live stream of ours (contract).
        call("hipStreamDestroy", || unsafe {
            ffi::hipStreamDestroy(stream as ffi::Stream)
        })
    }

    unsafe fn stream_synchronize(&self, stream: u64) -> Result<()> {
        // SAFETY: a live stream (contract).
        call("hipStreamSynchronize", || unsafe {
            ffi::hipStreamSynchronize(stream as ffi::Stream)
        })
    }

    unsafe fn stream_query(&self, stream: u64) -> Result<bool> {
        // SAFETY: a live stream (contract).
        ready("hipStreamQuery", || unsafe {
            ffi::hipStreamQuery(stream as ffi::Stream)
        })
    }

    unsafe fn stream_wait_event(&self, stream: u64, event: u64) -> Result<()> {
        // SAFETY: live stream and event (contract).
        call("hipStreamWaitEvent", || unsafe {
            ffi::hipStreamWaitEvent(stream as ffi::Stream, event as ffi::Event, 0)
        })
    }

    fn event_create(&self, timing: bool) -> Result<u64> {
        let mut e: ffi::Event = std::ptr::null_mut();
        let flags = if timing { 0 } else { ffi::EVENT_DISABLE_TIMING };
        // SAFETY: valid out-pointer.
        call("hipEventCreateWithFlags", || unsafe {
            ffi::hipEventCreateWithFlags(&mut e, flags)
        })?;
        Ok(e as u64)
    }

    unsafe fn event_destroy(&self, event: u64) -> Result<()> {
        // SAFETY: a live event of ours (contract).
        call("hipEventDestroy", || unsafe {
            ffi::hipEventDestroy(event as ffi::Event)
        })
    }

    unsafe fn event_record(&self, event: u64, stream: u64) -> Result<()> {
        // SAFETY: live event and stream (contract).
        call("hipEventRecord", || unsafe {
            ffi::hipEventRecord(event as ffi::Event, stream as ffi::Stream)
        })
    }

    unsafe fn event_query(&self, event: u64) -> Result<bool> {
        // SAFETY: a live event (contract).
        ready("hipEventQuery", || unsafe {
            ffi::hipEventQuery(event as ffi::Event)
        })
    }

    unsafe fn event_synchronize(&self, event: u64) -> Result<()> {
        // SAFETY: a live event (contract).
        call("hipEventSynchronize", || unsafe {
            ffi::hipEventSynchronize(event as ffi::Event)
        })
    }

    unsafe fn event_elapsed_ms(&self, start: u64, end: u64) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: live events (contract) and a valid out-pointer.
        call("hipEventElapsedTime", || unsafe {
            ffi::hipEventElapsedTime(&mut ms, start as ffi::Event, end as ffi::Event)
        })?;
        Ok(ms)
    }

    unsafe fn ipc_get_handle(&self, base: u64) -> Result<[u8; IPC_HANDLE_BYTES]> {
        // SAFETY: zeroed POD out-parameter.
        let mut h: ffi::hipIpcMemHandle_t = unsafe { std::mem::zeroed() };
        // SAFETY: `base` is a live hipMalloc allocation (contract).
        call("hipIpcGetMemHandle", || unsafe {
            ffi::hipIpcGetMemHandle(&mut h, ptr(base))
        })?;
        let mut bytes = [0u8; IPC_HANDLE_BYTES];
        for (b, c) in bytes.iter_mut().zip(h.reserved.iter()) {
            *b = *c as u8;
        }
        Ok(bytes)
    }

    fn ipc_open_handle(&self, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<u64> {
        // SAFETY: zeroed POD handle, filled from the bytes.
        let mut h: ffi::hipIpcMemHandle_t = unsafe { std::mem::zeroed() };
        for (c, b) in h.reserved.iter_mut().zip(handle.iter()) {
            *c = *b as c_char;
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the runtime validates the handle.
        call("hipIpcOpenMemHandle", || unsafe {
            ffi::hipIpcOpenMemHandle(&mut p, h, ffi::IPC_LAZY_ENABLE_PEER_ACCESS)
        })?;
        Ok(p as u64)
    }

    unsafe fn ipc_close_handle(&self, p: u64) -> Result<()> {
        // SAFETY: opened by us, unused (contract).
        call("hipIpcCloseMemHandle", || unsafe {
            ffi::hipIpcCloseMemHandle(ptr(p))
        })
    }

    fn can_access_peer(&self, peer: usize) -> Result<bool> {
        let mut can = 0;
        // SAFETY: valid out-pointer and range-checked devices.
        call("hipDeviceCanAccessPeer", || unsafe {
            ffi::hipDeviceCanAccessPeer(&mut can, self.device, peer as c_int)
        })?;
        Ok(can != 0)
    }

    fn enable_peer_access(&self, peer: usize) -> Result<()> {
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
        call("hipThreadExchangeStreamCaptureMode", || unsafe {
            ffi::hipThreadExchangeStreamCaptureMode(&mut m)
        })?;
        Ok(match m {
            ffi::CAPTURE_GLOBAL => CaptureMode::Global,
            ffi::CAPTURE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            _ => CaptureMode::Relaxed,
        })
    }

    unsafe fn launch_host_func(&self, stream: u64, user: *mut c_void) -> Result<()> {
        // SAFETY: a live stream; the runtime calls the trampoline once per successful launch.
        call("hipStreamAddCallback", || unsafe {
            ffi::hipStreamAddCallback(stream as ffi::Stream, host_fn_trampoline, user, 0)
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
        let (s, f) = (stream as ffi::Stream, wait_flags(cond));
        // SAFETY: the caller guarantees the address; the stream is live.
        unsafe {
            if wide {
                call("hipStreamWaitValue64", || {
                    ffi::hipStreamWaitValue64(s, ptr(addr), value, f, u64::MAX)
                })
            } else {
                call("hipStreamWaitValue32", || {
                    ffi::hipStreamWaitValue32(s, ptr(addr), value as u32, f, u32::MAX)
                })
            }
        }
    }

    unsafe fn write_value(&self, stream: u64, addr: u64, value: u64, wide: bool) -> Result<()> {
        let s = stream as ffi::Stream;
        // SAFETY: as above.
        unsafe {
            if wide {
                call("hipStreamWriteValue64", || {
                    ffi::hipStreamWriteValue64(s, ptr(addr), value, 0)
                })
            } else {
                call("hipStreamWriteValue32", || {
                    ffi::hipStreamWriteValue32(s, ptr(addr), value as u32, 0)
                })
            }
        }
    }
}
