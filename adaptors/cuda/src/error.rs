//! CUDA driver results turned into typed errors that keep the driver's code and name.

use std::ffi::CStr;

use cudarc::driver::sys::{self, CUresult};
use flagcx_adaptor::{AdaptorError, Result, Vendor};

/// `Ok` for `CUDA_SUCCESS`, else an [`AdaptorError::Vendor`] naming `op`.
pub(crate) fn check(op: &'static str, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(vendor_error(op, r))
    }
}

/// Runs driver call `op` with the calling thread marked as inside it (a stall guard watching
/// the thread names the call: `flagcx_adaptor::incall`), then [`check`]s its result.
pub(crate) fn call(op: &'static str, f: impl FnOnce() -> CUresult) -> Result<()> {
    let _in = flagcx_adaptor::incall::enter(op);
    check(op, f())
}

pub(crate) fn vendor_error(op: &'static str, r: CUresult) -> AdaptorError {
    AdaptorError::Vendor {
        vendor: Vendor::Cuda,
        op,
        code: r as u32 as i64,
        name: error_name(r),
    }
}

/// The driver's symbolic name for `r` (`CUDA_ERROR_INVALID_VALUE`).
pub(crate) fn error_name(r: CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string, or fails and leaves null.
    let ok = unsafe { sys::cuGetErrorName(r, &mut p) } == CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: the driver returns a NUL-terminated static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("CUDA error {}", r as u32)
    }
}
