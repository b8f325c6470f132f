//! Buffers from Python through DLPack (the unversioned protocol every producer speaks: numpy ≥
//! 1.22, torch, CuPy, JAX).
//!
//! The structs are DLPack's `dlpack.h` (v0.8 layout, which `__dlpack__()` without
//! `max_version` returns). A consumer takes the `"dltensor"` capsule, renames it
//! `"used_dltensor"` so the capsule's destructor leaves the tensor alone, and calls the tensor's
//! deleter once it no longer needs the memory — here when the operation that uses it completed
//! ([`Imported`]'s `Drop`). The spec lets a deleter run on any thread without the GIL.

use std::ffi::{c_void, CStr};
use std::ptr::NonNull;

use flagcx::DataType;
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyTuple};

/// `DLDeviceType` values this package meets.
pub const CPU: i32 = 1;
/// `kDLCUDA`.
pub const CUDA: i32 = 2;
/// `kDLCUDAHost` (pinned host memory: the CPU reads it as any host memory).
pub const CUDA_HOST: i32 = 3;
/// `kDLROCM`.
pub const ROCM: i32 = 10;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// An element type as DLPack names it, and ours where it is one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Element {
    /// `DLDataTypeCode`: 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool.
    pub code: u8,
    /// Bits per element.
    pub bits: u8,
}

impl Element {
    /// The reduction type of this element, if there is one.
    pub fn data_type(self) -> Option<DataType> {
        Some(match (self.code, self.bits) {
            (0, 8) => DataType::I8,
            (1, 8) => DataType::U8,
            (0, 32) => DataType::I32,
            (1, 32) => DataType::U32,
            (0, 64) => DataType::I64,
            (1, 64) => DataType::U64,
            (2, 16) => DataType::F16,
            (2, 32) => DataType::F32,
            (2, 64) => DataType::F64,
            (4, 16) => DataType::BF16,
            _ => return None,
        })
    }

    /// Bytes per element (a bool is one byte, as every producer stores it).
    pub fn size(self) -> usize {
        usize::from(self.bits).div_ceil(8)
    }

    /// `int32`, `bfloat16`, `complex64`, …: for messages.
    pub fn name(self) -> String {
        let kind = match self.code {
            0 => "int",
            1 => "uint",
            2 => "float",
            4 => "bfloat",
            5 => "complex",
            6 => return "bool".into(),
            _ => "opaque",
        };
        format!("{kind}{}", self.bits)
    }
}

/// A buffer imported through DLPack, kept alive (and the producer's memory with it) until
/// this value is dropped.
pub struct Imported {
    tensor: NonNull<DlManagedTensor>,
    /// The first byte (`data + byte_offset`).
    pub addr: u64,
    /// Elements (the product of the shape).
    pub count: usize,
    /// The element type.
    pub element: Element,
    /// `DLDeviceType` and device number.
    pub device: (i32, i32),
}

// SAFETY: the tensor is owned by this value alone once imported (the capsule was renamed), and
// DLPack lets its deleter run on any thread.
unsafe impl Send for Imported {}
// SAFETY: shared access only reads the copied-out fields.
unsafe impl Sync for Imported {}

impl Imported {
    /// Bytes the buffer spans.
    pub fn bytes(&self) -> usize {
        self.count * self.element.size()
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        // SAFETY: the tensor is live (owned by us since the import) and its deleter is called
        // exactly once, here.
        unsafe {
            if let Some(d) = (*self.tensor.as_ptr()).deleter {
                d(self.tensor.as_ptr());
            }
        }
    }
}

/// `obj.__dlpack_device__()`: (`DLDeviceType`, device number).
pub fn device_of(obj: &Bound<'_, PyAny>) -> PyResult<(i32, i32)> {
    if !obj.hasattr("__dlpack__")? {
        return Err(PyTypeError::new_err(format!(
            "a {} is not a buffer flagcx can use: pass a numpy array, a torch tensor or any \
             object with __dlpack__ (bytes-like objects: numpy.frombuffer first)",
            obj.get_type().name()?
        )));
    }
    let dev = obj.call_method0("__dlpack_device__")?;
    let t = dev.cast::<PyTuple>()?;
    Ok((t.get_item(0)?.extract()?, t.get_item(1)?.extract()?))
}

/// Imports `obj` through `__dlpack__`, passing `stream` where the buffer is on a GPU (the
/// stream the operation runs on: the producer orders its pending work before it).
/// Refuses non-contiguous buffers and vector (`lanes > 1`) types; read-only buffers are
/// refused by their producers (numpy raises `BufferError`), which is re-raised with the
/// argument's name.
pub fn import(obj: &Bound<'_, PyAny>, what: &str, stream: Option<u64>) -> PyResult<Imported> {
    let py = obj.py();
    let capsule = match stream {
        Some(s) => {
            let kw = pyo3::types::PyDict::new(py);
            kw.set_item("stream", s)?;
            obj.call_method("__dlpack__", (), Some(&kw))
        }
        None => obj.call_method0("__dlpack__"),
    }
    .map_err(|e| {
        if e.is_instance_of::<PyBufferError>(py) || e.is_instance_of::<PyTypeError>(py) {
            PyValueError::new_err(format!("{what}: cannot use this buffer: {e}"))
        } else {
            e
        }
    })?;
    let imported = from_capsule(capsule.cast::<PyCapsule>()?, what)?;
    if stream.is_none() && !matches!(imported.device.0, CPU | CUDA_HOST) {
        return Err(PyValueError::new_err(format!(
            "{what}: __dlpack_device__ said host memory, the tensor says device type {} ({})",
            imported.device.0, imported.device.1
        )));
    }
    Ok(imported)
}

/// Takes the tensor of a `"dltensor"` capsule (one from `__dlpack__`, or passed by a caller
/// that made it, e.g. `torch.utils.dlpack.to_dlpack`: then no stream handshake happened,
/// and the caller orders the producer's work itself).
pub fn from_capsule(capsule: &Bound<'_, PyCapsule>, what: &str) -> PyResult<Imported> {
    let py = capsule.py();
    const NAME: &CStr = c"dltensor";
    let raw = capsule
        .pointer_checked(Some(NAME))
        .map_err(|_| PyValueError::new_err(format!("{what}: __dlpack__ gave a used capsule")))?;
    // Take ownership: the renamed capsule's destructor no longer deletes the tensor.
    // SAFETY: a live capsule object; the name is a static C string.
    if unsafe { pyo3::ffi::PyCapsule_SetName(capsule.as_ptr(), c"used_dltensor".as_ptr()) } != 0 {
        return Err(PyErr::fetch(py));
    }
    let tensor = raw.cast::<DlManagedTensor>();
    // From here `imported` owns the tensor, so every early return below calls its deleter.
    // SAFETY: a DLPack capsule named "dltensor" points to a live DLManagedTensor.
    let t = unsafe { &(*tensor.as_ptr()).dl_tensor };
    let mut imported = Imported {
        tensor,
        addr: 0,
        count: 0,
        element: Element {
            code: t.dtype.code,
            bits: t.dtype.bits,
        },
        device: (t.device.device_type, t.device.device_id),
    };
    if t.dtype.lanes != 1 || t.dtype.bits % 8 != 0 || t.dtype.bits == 0 {
        return Err(PyValueError::new_err(format!(
            "{what}: element type code {} of {} bits × {} lanes is not a scalar of whole bytes",
            t.dtype.code, t.dtype.bits, t.dtype.lanes
        )));
    }
    let ndim = usize::try_from(t.ndim)
        .map_err(|_| PyValueError::new_err(format!("{what}: negative ndim {}", t.ndim)))?;
    let shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: DLPack: `shape` holds `ndim` values.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let strides: Option<&[i64]> = (ndim > 0 && !t.strides.is_null()).then(|| {
        // SAFETY: DLPack: non-null `strides` holds `ndim` values (in elements).
        unsafe { std::slice::from_raw_parts(t.strides, ndim) }
    });
    let mut count: usize = 1;
    for &d in shape {
        let d = usize::try_from(d)
            .map_err(|_| PyValueError::new_err(format!("{what}: negative dimension {d}")))?;
        count = count
            .checked_mul(d)
            .ok_or_else(|| PyValueError::new_err(format!("{what}: the shape overflows")))?;
    }
    if let Some(strides) = strides {
        if !is_c_contiguous(shape, strides) {
            return Err(PyValueError::new_err(format!(
                "{what}: the buffer is not contiguous (shape {shape:?}, strides {strides:?} \
                 elements); pass a contiguous copy (.contiguous(), numpy.ascontiguousarray)"
            )));
        }
    }
    imported.count = count;
    imported.addr = (t.data as u64)
        .checked_add(t.byte_offset)
        .ok_or_else(|| PyValueError::new_err(format!("{what}: the address overflows")))?;
    Ok(imported)
}

/// Whether `strides` (in elements) lay `shape` out row-major without gaps. Dimensions of
/// extent 1 may carry any stride (torch gives them odd ones); an empty tensor is contiguous.
fn is_c_contiguous(shape: &[i64], strides: &[i64]) -> bool {
    if shape.contains(&0) {
        return true;
    }
    let mut expect: i64 = 1;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && s != expect {
            return false;
        }
        expect = expect.saturating_mul(d);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguity() {
        assert!(is_c_contiguous(&[2, 3], &[3, 1]));
        assert!(!is_c_contiguous(&[2, 3], &[1, 2]), "column-major");
        assert!(!is_c_contiguous(&[2, 3], &[6, 2]), "every other element");
        assert!(
            is_c_contiguous(&[1, 3], &[99, 1]),
            "extent-1 strides are free"
        );
        assert!(is_c_contiguous(&[0, 3], &[5, 7]), "empty");
        assert!(is_c_contiguous(&[], &[]), "a scalar");
    }

    #[test]
    fn element_types() {
        let e = |code, bits| Element { code, bits };
        assert_eq!(e(2, 32).data_type(), Some(DataType::F32));
        assert_eq!(e(4, 16).data_type(), Some(DataType::BF16));
        assert_eq!(e(1, 64).data_type(), Some(DataType::U64));
        assert_eq!(e(6, 8).data_type(), None, "bool moves but does not reduce");
        assert_eq!(e(5, 64).data_type(), None, "complex");
        assert_eq!(e(6, 8).size(), 1);
        assert_eq!(e(5, 128).name(), "complex128");
    }
}
