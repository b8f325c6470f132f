//! The kernel behind `memcpy_sized_async`: a copy whose length the GPU reads when the stream
//! reaches it. Shipped as PTX (`kernels/sized_copy.ptx`, from `kernels/sized_copy.cu`) and
//! loaded once per context at open, so neither building nor running needs nvcc.

use std::ffi::c_void;

use cudarc::driver::sys;
use flagcx_adaptor::Result;

use crate::error::check;

/// The PTX of `kernels/sized_copy.cu`.
const PTX: &str = concat!(include_str!("../kernels/sized_copy.ptx"), "\0");

/// Threads per block.
const BLOCK: u32 = 256;
/// At most this many blocks: a stream-ordered message is small (a slot), and more blocks only
/// add launch work.
const MAX_GRID: u32 = 32;

/// The loaded module and its one function.
#[derive(Debug)]
pub(crate) struct SizedKernel {
    module: sys::CUmodule,
    func: sys::CUfunction,
}

// SAFETY: module and function handles are driver objects usable from any thread on which
// their context is current; the driver binds the context before every use.
unsafe impl Send for SizedKernel {}
// SAFETY: as above; launches are thread-safe in the driver.
unsafe impl Sync for SizedKernel {}

impl SizedKernel {
    /// Loads the module into the current context.
    pub(crate) fn load() -> Result<Self> {
        let mut module = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and a NUL-terminated PTX image; the caller made the
        // context current.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, PTX.as_ptr().cast())
        })?;
        let mut func = std::ptr::null_mut();
        // SAFETY: valid out-pointer, the module loaded above, a NUL-terminated name.
        let got = check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut func, module, c"flagcx_sized_copy".as_ptr())
        });
        if let Err(e) = got {
            // SAFETY: loaded above, used by nothing.
            unsafe { sys::cuModuleUnload(module) };
            return Err(e);
        }
        Ok(SizedKernel { module, func })
    }

    /// Launches the copy on `stream`.
    ///
    /// # Safety
    /// The contract of `DeviceAdaptor::memcpy_sized_async`; the context is current.
    pub(crate) unsafe fn launch(
        &self,
        dst: u64,
        src: u64,
        len_at: u64,
        cap: usize,
        stream: u64,
    ) -> Result<()> {
        let grid = (cap as u64)
            .div_ceil(BLOCK as u64 * 16)
            .clamp(1, MAX_GRID as u64) as u32;
        let (mut d, mut s, mut l, mut c) = (dst, src, len_at, cap as u64);
        let mut params: [*mut c_void; 4] = [
            (&mut d as *mut u64).cast(),
            (&mut s as *mut u64).cast(),
            (&mut l as *mut u64).cast(),
            (&mut c as *mut u64).cast(),
        ];
        // SAFETY: four pointers to u64 values, matching the kernel's four `.u64` parameters,
        // alive for the call (the driver copies them at launch); the memory the kernel touches
        // is the caller's contract.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.func,
                grid,
                1,
                1,
                BLOCK,
                1,
                1,
                0,
                stream as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Unloads the module.
    ///
    /// # Safety
    /// Once, with the context current and no launch outstanding.
    pub(crate) unsafe fn unload(&self) {
        // SAFETY: the caller's contract.
        unsafe { sys::cuModuleUnload(self.module) };
    }
}
