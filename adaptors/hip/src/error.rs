//! HIP results turned into typed errors that keep the runtime's code and name.

use std::ffi::CStr;

use flagcx_adaptor::{AdaptorError, Result, Vendor};

use crate::ffi::{self, HipError};

/// The runtime's symbolic name for `e` (`hipErrorInvalidValue`).
pub(crate) fn error_name(e: HipError) -> String {
    // SAFETY: hipGetErrorName returns a static string (or null) for any integer code.
    let p = unsafe { ffi::hipGetErrorName(e) };
    if p.is_null() {
        format!("hipError {e}")
    } else {
        // SAFETY: NUL-terminated static string from the runtime.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// An [`AdaptorError::Vendor`] naming `op`.
pub(crate) fn vendor_error(op: &'static str, e: HipError) -> AdaptorError {
    AdaptorError::Vendor {
        vendor: Vendor::Hip,
        op,
        code: e as i64,
        name: error_name(e),
    }
}

/// Runs runtime call `op` with the calling thread marked as inside it (a stall guard watching
/// the thread names the call: `flagcx_adaptor::incall`), then [`check`]s its result.
pub(crate) fn call(op: &'static str, f: impl FnOnce() -> HipError) -> Result<()> {
    let _in = flagcx_adaptor::incall::enter(op);
    check(op, f())
}

/// `Ok` for `hipSuccess`, else an [`AdaptorError::Vendor`] naming `op`.
pub(crate) fn check(op: &'static str, e: HipError) -> Result<()> {
    if e == ffi::SUCCESS {
        Ok(())
    } else {
        Err(vendor_error(op, e))
    }
}
