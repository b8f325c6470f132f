//! [`Memory`]: device memory of the rank's adaptor, handed to Python through DLPack, which
//! operations use in place.

use std::ffi::c_void;
use std::sync::Arc;

use flagcx::{Adaptor, DeviceAdaptor, DeviceBuffer, Stream, Vendor};
use pyo3::prelude::*;

use crate::errors::unsupported;

/// Device memory of this rank (`Comm.empty`), viewable through DLPack (`numpy.from_dlpack`,
/// `torch.from_dlpack`) as `nbytes` bytes (`uint8`). The memory stays allocated while this
/// object or any view lives.
#[pyclass(module = "flagcx._flagcx", name = "Memory", frozen)]
pub struct Memory {
    buf: Arc<DeviceBuffer<Adaptor>>,
    device: (i32, i32),
}

impl Memory {
    /// `nbytes` zeroed bytes of `a`'s device memory.
    pub fn new(a: &Adaptor, stream: &Stream<Adaptor>, nbytes: usize) -> flagcx::p2p::Result<Self> {
        let device = match a.vendor() {
            Vendor::Host => (crate::dlpack::CPU, 0),
            Vendor::Cuda => (crate::dlpack::CUDA, a.device() as i32),
            Vendor::Hip => (crate::dlpack::ROCM, a.device() as i32),
            // OpenCL buffers have no address a consumer could use.
            v => {
                return Err(flagcx::AdaptorError::Unsupported {
                    vendor: v,
                    op: "Comm.empty (its memory has no address other libraries can use; pass \
                         host buffers, which are staged)",
                }
                .into())
            }
        };
        let buf = DeviceBuffer::new(a, nbytes.max(1))?;
        buf.fill(0, stream)?;
        Ok(Memory {
            buf: Arc::new(buf),
            device,
        })
    }
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device_type: i32,
    device_id: i32,
    ndim: i32,
    code: u8,
    bits: u8,
    lanes: u16,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManaged {
    tensor: DlTensor,
    ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManaged)>,
}

/// DLPack 1.x's `DLManagedTensorVersioned` (what a consumer asking with `max_version >= (1,
/// 0)` takes: it carries the flags, whose clear read-only bit lets numpy write the array).
#[repr(C)]
struct DlManagedVersioned {
    major: u32,
    minor: u32,
    ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedVersioned)>,
    flags: u64,
    tensor: DlTensor,
}

unsafe extern "C" fn delete_versioned(m: *mut DlManagedVersioned) {
    if m.is_null() {
        return;
    }
    // SAFETY: as in `delete`.
    unsafe {
        drop(Box::from_raw((*m).ctx.cast::<Ctx>()));
        drop(Box::from_raw(m));
    }
}

unsafe extern "C" fn capsule_destructor_versioned(cap: *mut pyo3::ffi::PyObject) {
    // SAFETY: as in `capsule_destructor`.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(cap, c"dltensor_versioned".as_ptr()) == 1 {
            let m = pyo3::ffi::PyCapsule_GetPointer(cap, c"dltensor_versioned".as_ptr());
            delete_versioned(m.cast());
        }
    }
}

/// What a handed-out tensor owns: the memory and the shape array it points to.
struct Ctx {
    _buf: Arc<DeviceBuffer<Adaptor>>,
    shape: [i64; 1],
}

unsafe extern "C" fn delete(m: *mut DlManaged) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its context were leaked from boxes in `__dlpack__`; DLPack calls the
    // deleter once.
    unsafe {
        drop(Box::from_raw((*m).ctx.cast::<Ctx>()));
        drop(Box::from_raw(m));
    }
}

/// The capsule's destructor: deletes a tensor nobody consumed (a consumer renames the
/// capsule to `used_dltensor` and calls the deleter itself).
unsafe extern "C" fn capsule_destructor(cap: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the capsule; the name check tells an unconsumed one.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(cap, c"dltensor".as_ptr()) == 1 {
            let m = pyo3::ffi::PyCapsule_GetPointer(cap, c"dltensor".as_ptr());
            delete(m.cast());
        }
    }
}

#[pymethods]
impl Memory {
    /// Bytes of the allocation.
    #[getter]
    fn nbytes(&self) -> usize {
        self.buf.len()
    }

    /// The address of the first byte.
    #[getter]
    fn ptr(&self) -> u64 {
        self.buf.ptr().0
    }

    /// DLPack: `(device type, device number)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        self.device
    }

    /// DLPack: a capsule of a one-dimensional, writable `uint8` tensor over the whole
    /// allocation (versioned where `max_version` allows, else the unversioned form). The memory was zeroed and synchronized
    /// at allocation, so `stream` needs no ordering.
    #[pyo3(signature = (stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Py<PyAny>>,
        max_version: Option<Py<PyAny>>,
        dl_device: Option<Py<PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = (stream, dl_device);
        if copy == Some(true) {
            return Err(unsupported(
                "Memory.__dlpack__(copy=True): flagcx memory is shared, not copied",
            ));
        }
        let versioned = match max_version {
            Some(v) => v.bind(py).get_item(0)?.extract::<u32>()? >= 1,
            None => false,
        };
        let mut ctx = Box::new(Ctx {
            _buf: self.buf.clone(),
            shape: [self.buf.len() as i64],
        });
        let tensor = DlTensor {
            data: self.buf.ptr().0 as *mut c_void,
            device_type: self.device.0,
            device_id: self.device.1,
            ndim: 1,
            code: 1,
            bits: 8,
            lanes: 1,
            shape: ctx.shape.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        let ctx = Box::into_raw(ctx).cast();
        // SAFETY: valid pointers and static names; on failure the tensor is deleted here.
        unsafe {
            let cap = if versioned {
                let m = Box::into_raw(Box::new(DlManagedVersioned {
                    major: 1,
                    minor: 0,
                    ctx,
                    deleter: Some(delete_versioned),
                    flags: 0,
                    tensor,
                }));
                let cap = pyo3::ffi::PyCapsule_New(
                    m.cast(),
                    c"dltensor_versioned".as_ptr(),
                    Some(capsule_destructor_versioned),
                );
                if cap.is_null() {
                    delete_versioned(m);
                }
                cap
            } else {
                let m = Box::into_raw(Box::new(DlManaged {
                    tensor,
                    ctx,
                    deleter: Some(delete),
                }));
                let cap = pyo3::ffi::PyCapsule_New(
                    m.cast(),
                    c"dltensor".as_ptr(),
                    Some(capsule_destructor),
                );
                if cap.is_null() {
                    delete(m);
                }
                cap
            };
            if cap.is_null() {
                return Err(PyErr::fetch(py));
            }
            Ok(Bound::from_owned_ptr(py, cap).unbind())
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<flagcx.Memory {} bytes at {:#x}>",
            self.buf.len(),
            self.buf.ptr().0
        )
    }
}
