//! What the loaded driver and this process's place on the device allow, probed once when a
//! device is opened.

use std::ffi::{c_void, CStr};

use cudarc::driver::sys::{self, CUresult};

/// Whether the loaded driver exports `name` (cudarc panics when calling a missing symbol).
pub(crate) fn has_symbol(name: &CStr) -> bool {
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

/// Whether this process is a client of NVIDIA's MPS on `dev`, so that its work and other
/// processes' run on the device at once instead of in time slices. Only MPS clients can make
/// contexts limited to a share of the SMs, which the driver reports as execution-affinity
/// support (checked on an H200 with and without the daemon; git show 7ff18bc:docs/performance.md).
pub(crate) fn mps_client(dev: sys::CUdevice) -> bool {
    if !has_symbol(c"cuDeviceGetExecAffinitySupport") {
        return false;
    }
    let mut supported = 0;
    // SAFETY: a valid out-pointer and device handle.
    let r = unsafe {
        sys::cuDeviceGetExecAffinitySupport(
            &mut supported,
            sys::CUexecAffinityType::CU_EXEC_AFFINITY_TYPE_SM_COUNT,
            dev,
        )
    };
    r == CUresult::CUDA_SUCCESS && supported == 1
}

/// Whether 32- and 64-bit stream memory operations work, tried with the `_v2` write and wait
/// calls on a mapped host word (the old attribute says no where they do). Requires the context
/// to be current.
pub(crate) fn probe_stream_mem_ops() -> (bool, bool) {
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
