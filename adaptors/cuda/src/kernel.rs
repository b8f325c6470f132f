//! Kernels from PTX text, loaded at run time (`cuModuleLoadData`: the driver compiles the PTX
//! for the GPU it finds, so no nvcc is needed to build or run), and launched on an adaptor's
//! streams. Beside the adaptor contract: what device-initiated transfers' example kernels and
//! users' own kernels driving a port channel need from Rust.

use std::ffi::{c_void, CStr, CString};

use cudarc::driver::sys;
use flagcx_adaptor::{AdaptorError, Result, StreamHandle, Vendor};

use crate::error::call;
use crate::CudaAdaptor;

/// A loaded module; unloaded on drop.
pub struct Module {
    adaptor: CudaAdaptor,
    module: sys::CUmodule,
}

// SAFETY: a CUmodule is a driver handle usable from any thread once its context is current
// (every use below binds the adaptor's context first).
unsafe impl Send for Module {}
// SAFETY: as above; the driver serializes its own use of the handle.
unsafe impl Sync for Module {}

/// A kernel of a [`Module`] (valid while the module is).
#[derive(Clone, Copy)]
pub struct Function<'m> {
    func: sys::CUfunction,
    _module: &'m Module,
}

impl Module {
    /// Loads `ptx` (PTX assembly text) into the adaptor's context.
    pub fn load_ptx(adaptor: &CudaAdaptor, ptx: &str) -> Result<Module> {
        let text = CString::new(ptx)
            .map_err(|_| AdaptorError::invalid("cuModuleLoadData", "PTX text contains NUL"))?;
        adaptor.driver()?;
        let mut module = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and a NUL-terminated image; the context is current.
        call("cuModuleLoadData", || unsafe {
            sys::cuModuleLoadData(&mut module, text.as_ptr().cast())
        })?;
        Ok(Module {
            adaptor: adaptor.clone(),
            module,
        })
    }

    /// The kernel named `name` (its mangled name for C++ kernels; `extern "C"` avoids that).
    pub fn function(&self, name: &CStr) -> Result<Function<'_>> {
        self.adaptor.driver()?;
        let mut func = std::ptr::null_mut();
        // SAFETY: valid out-pointer, live module, NUL-terminated name.
        call("cuModuleGetFunction", || unsafe {
            sys::cuModuleGetFunction(&mut func, self.module, name.as_ptr())
        })?;
        Ok(Function {
            func,
            _module: self,
        })
    }

    /// Launches `f` with `grid` × `block` threads on `stream` (a stream of this module's
    /// adaptor).
    ///
    /// # Safety
    /// `params` holds one pointer per kernel parameter, each to a value of exactly the type
    /// the kernel declares; whatever the kernel touches stays valid until it completes.
    pub unsafe fn launch(
        &self,
        f: Function<'_>,
        grid: u32,
        block: u32,
        stream: StreamHandle,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if grid == 0 || block == 0 {
            return Err(AdaptorError::invalid(
                "cuLaunchKernel",
                "empty grid or block",
            ));
        }
        self.adaptor.driver()?;
        // SAFETY: the caller's contract for `params`; the adaptor's stream handles are the
        // driver's CUstream values, and `driver()` made the module's context current.
        unsafe { crate::sized::launch_1d(f.func, grid, block, stream.0, params) }
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.adaptor.driver().is_ok() {
            // SAFETY: our module; kernels launched from it completed (callers synchronize
            // before dropping it, as with any CUDA module).
            unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("vendor", &Vendor::Cuda)
            .finish()
    }
}
