//! Another runtime's device memory as a buffer (`cl_khr_external_memory_opaque_fd`).
//!
//! NVIDIA's platform maps a CUDA VMM allocation exported as a POSIX fd (what the CUDA adaptor's
//! `mem_alloc_shareable` + `ipc_export_fd` give), across processes: measured on one H100 with
//! `benches/probes/ocl_cuda_extmem.c` (no flagcx code), each runtime reads the other's bytes
//! and copies between the import and a buffer of its own run at 1.2–1.5 TB/s, against 55 GB/s
//! for the pinned host copies a staging ring costs. That is what lets a CUDA rank and an
//! OpenCL rank on one GPU exchange through device memory (the p2p layer's device ring).
//!
//! The extension asks that an imported object be acquired before use and released after; the
//! entry points are platform extensions, so they are looked up through the ICD loader's
//! `clGetExtensionFunctionAddressForPlatform`, and skipped where a platform has none.

use std::ffi::{c_char, c_void, CStr};

use cl3::types::{cl_command_queue, cl_context, cl_device_id, cl_event, cl_int, cl_mem, cl_uint};

/// `CL_EXTERNAL_MEMORY_HANDLE_OPAQUE_FD_KHR`.
const HANDLE_OPAQUE_FD: u64 = 0x2060;
/// `CL_MEM_DEVICE_HANDLE_LIST_KHR` and its terminator.
const DEVICE_HANDLE_LIST: u64 = 0x2051;
const DEVICE_HANDLE_LIST_END: u64 = 0;
/// `CL_DEVICE_PLATFORM`.
const DEVICE_PLATFORM: u32 = 0x1031;
/// The extension that names the handle type.
const EXTENSION: &str = "cl_khr_external_memory_opaque_fd";

/// `clEnqueueAcquireExternalMemObjectsKHR` and `clEnqueueReleaseExternalMemObjectsKHR`.
type AcquireFn = unsafe extern "C" fn(
    cl_command_queue,
    cl_uint,
    *const cl_mem,
    cl_uint,
    *const cl_event,
    *mut cl_event,
) -> cl_int;
type LookupFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// Whether `dev` imports opaque fds.
pub(crate) fn supported(dev: cl_device_id) -> bool {
    cl3::device::get_device_data(dev, cl3::device::CL_DEVICE_EXTENSIONS)
        .map(|b| {
            String::from_utf8_lossy(&b)
                .split_whitespace()
                .any(|e| e == EXTENSION)
        })
        .unwrap_or(false)
}

/// Creates a buffer over the `size` bytes that `fd` exports, for `dev` only; the caller keeps
/// `fd` (the import does not take it over).
///
/// # Safety
/// `context` and `dev` are live and `dev` belongs to `context`.
pub(crate) unsafe fn import(
    context: cl_context,
    dev: cl_device_id,
    fd: i32,
    size: usize,
) -> Result<cl_mem, cl_int> {
    let props = [
        HANDLE_OPAQUE_FD,
        fd as u64,
        DEVICE_HANDLE_LIST,
        dev as u64,
        DEVICE_HANDLE_LIST_END,
        0,
    ];
    // SAFETY: a zero-terminated property list of the extension's keys; no host pointer.
    let mem = unsafe {
        cl3::memory::create_buffer_with_properties(
            context,
            props.as_ptr(),
            cl3::memory::CL_MEM_READ_WRITE,
            size,
            std::ptr::null_mut(),
        )
    }?;
    // SAFETY: a live buffer of this context.
    if let Err(e) = unsafe { ownership(context, dev, mem, "clEnqueueAcquireExternalMemObjectsKHR") }
    {
        // SAFETY: ours, unused.
        let _ = unsafe { cl3::memory::release_mem_object(mem) };
        return Err(e);
    }
    Ok(mem)
}

/// Gives an imported buffer back to its exporter (the extension's release) and drops it.
///
/// # Safety
/// `mem` came from [`import`] with the same `context` and `dev`, and no command uses it.
pub(crate) unsafe fn release(
    context: cl_context,
    dev: cl_device_id,
    mem: cl_mem,
) -> Result<(), cl_int> {
    // SAFETY: as the caller promises.
    let given = unsafe { ownership(context, dev, mem, "clEnqueueReleaseExternalMemObjectsKHR") };
    // SAFETY: as above; released once.
    let dropped = unsafe { cl3::memory::release_mem_object(mem) };
    given.and(dropped)
}

/// Enqueues the extension's acquire or release (`name`) of `mem` on a queue of its own and
/// waits for it; nothing where the platform has no such entry point.
///
/// # Safety
/// `mem` is a live buffer of `context`, which `dev` belongs to.
unsafe fn ownership(
    context: cl_context,
    dev: cl_device_id,
    mem: cl_mem,
    name: &str,
) -> Result<(), cl_int> {
    let Some(f) = entry(dev, name) else {
        return Ok(());
    };
    // SAFETY: the device belongs to the context.
    #[allow(deprecated)]
    let q = unsafe { cl3::command_queue::create_command_queue(context, dev, 0) }?;
    let mut ev: cl_event = std::ptr::null_mut();
    // SAFETY: the extension's signature; one live buffer, no wait list.
    let rc = unsafe { f(q, 1, &mem, 0, std::ptr::null(), &mut ev) };
    let finished = if rc == 0 {
        cl3::command_queue::finish(q)
    } else {
        Err(rc)
    };
    if !ev.is_null() {
        // SAFETY: the event the call returned, ours to drop.
        let _ = unsafe { cl3::event::release_event(ev) };
    }
    // SAFETY: our queue, finished (or failed) above.
    let _ = unsafe { cl3::command_queue::release_command_queue(q) };
    finished
}

/// The platform extension function `name` of `dev`'s platform, through the ICD loader.
fn entry(dev: cl_device_id, name: &str) -> Option<AcquireFn> {
    let platform = cl3::device::get_device_data(dev, DEVICE_PLATFORM).ok()?;
    let platform = usize::from_ne_bytes(platform.get(..8)?.try_into().ok()?) as *mut c_void;
    let lookup = loader_symbol(c"clGetExtensionFunctionAddressForPlatform")?;
    // SAFETY: the loader's own entry point, of the standard signature.
    let lookup: LookupFn = unsafe { std::mem::transmute::<*mut c_void, LookupFn>(lookup) };
    let name = std::ffi::CString::new(name).ok()?;
    // SAFETY: a live platform id and a NUL-terminated name.
    let f = unsafe { lookup(platform, name.as_ptr()) };
    // SAFETY: the platform returns the named function, of the extension's signature, or null.
    (!f.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, AcquireFn>(f) })
}

/// `symbol` of the ICD loader that cl3 already loaded (never loads another copy).
fn loader_symbol(symbol: &CStr) -> Option<*mut c_void> {
    for lib in [c"libOpenCL.so.1", c"libOpenCL.so"] {
        // SAFETY: NOLOAD only looks up a library already in the process.
        let h = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if h.is_null() {
            continue;
        }
        // SAFETY: a live handle and a NUL-terminated name.
        let f = unsafe { libc::dlsym(h, symbol.as_ptr()) };
        // SAFETY: drops the reference NOLOAD took; the library stays loaded by cl3.
        unsafe { libc::dlclose(h) };
        if !f.is_null() {
            return Some(f);
        }
    }
    None
}
