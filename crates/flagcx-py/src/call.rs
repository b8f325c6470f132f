//! One call of the API: its buffers imported and resolved ([`Call`]), the operation posted
//! ([`run`]), and the checks the calls share.

use std::sync::{Arc, Mutex};

use flagcx::{Adaptor, Comm, DataType, DeviceAdaptor, DevicePtr, ReduceOp, StreamHandle, Vendor};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::dlpack::{self, Imported};
use crate::errors::{self, comm_err, invalid};
use crate::inner::Inner;
use crate::lock;
use crate::pending::{Late, Ops, Pending};
use crate::stage::{self, Resolved, Use};
use crate::work::Work;

/// A buffer argument: imported and resolved to a device pointer.
pub(crate) struct Arg {
    pub(crate) imported: Imported,
    pub(crate) resolved: Resolved,
}

/// What an operation's call needs to run: its stream, imported buffers and staging.
pub(crate) struct Call {
    pub(crate) inner: Arc<Inner>,
    pub(crate) stream: StreamHandle,
    pub(crate) native: Option<u64>,
    pub(crate) args: Vec<Imported>,
    pub(crate) staging: stage::Staging,
}

impl Call {
    pub(crate) fn new(inner: Arc<Inner>, stream: Option<u64>) -> PyResult<Self> {
        inner.sweep();
        let handle = inner.stream(stream)?;
        // The native stream a GPU producer orders its work before (DLPack: 1 is CUDA's legacy
        // default stream, which 0 means here).
        let native = matches!(inner.adaptor().vendor(), Vendor::Cuda | Vendor::Hip).then_some(
            match handle.0 {
                0 => 1,
                s => s,
            },
        );
        Ok(Call {
            staging: stage::Staging::default(),
            inner,
            stream: handle,
            native,
            args: Vec::new(),
        })
    }

    /// Imports `obj` (argument `what`), used by the operation as `how`.
    pub(crate) fn arg(&mut self, obj: &Bound<'_, PyAny>, what: &str, how: Use) -> PyResult<Arg> {
        // A DLPack capsule itself (the torch backend passes them: no Python-level
        // `__dlpack__` per call), else an object exporting one.
        let capsule = obj.cast::<pyo3::types::PyCapsule>().ok();
        let early = match capsule {
            Some(c) => Some(dlpack::from_capsule(c, what)?),
            None => None,
        };
        let (dev_type, dev_id) = match &early {
            Some(i) => i.device,
            None => dlpack::device_of(obj)?,
        };
        let vendor = self.inner.adaptor().vendor();
        let on_device = match (vendor, dev_type) {
            (_, dlpack::CPU | dlpack::CUDA_HOST) => false,
            (Vendor::Cuda, dlpack::CUDA) | (Vendor::Hip, dlpack::ROCM) => {
                let own = self.inner.adaptor().device();
                if usize::try_from(dev_id).ok() != Some(own) {
                    return Err(invalid(format!(
                        "{what}: the buffer is on device {dev_id}; this rank's communicator \
                         is on device {own}"
                    )));
                }
                true
            }
            _ => {
                return Err(invalid(format!(
                    "{what}: a buffer of DLPack device type {dev_type} cannot be used by a {} \
                     rank (host memory and this rank's own device memory can)",
                    vendor.name()
                )))
            }
        };
        let imported = match early {
            Some(i) => i,
            None => dlpack::import(obj, what, on_device.then_some(self.native).flatten())?,
        };
        let resolved =
            self.staging
                .resolve(&self.inner.pool, &imported, on_device, how, self.stream)?;
        Ok(Arg { imported, resolved })
    }

    /// Keeps an argument's buffer alive until the operation finished; its device pointer.
    pub(crate) fn keep(&mut self, a: Arg) -> DevicePtr {
        self.args.push(a.imported);
        a.resolved.ptr
    }

    /// After the operation was enqueued: staging copies back, and the `Work`.
    pub(crate) fn finish(mut self, py: Python<'_>, ops: Ops, wait: bool) -> PyResult<Py<PyAny>> {
        let staging = std::mem::take(&mut self.staging);
        let staged = if staging.is_empty() {
            None
        } else if self.inner.in_group() {
            let late = Arc::new(Mutex::new(Late::Waiting(staging, self.stream)));
            if let Some(g) = lock(&self.inner.groups).get_mut(&std::thread::current().id()) {
                g.push(late.clone());
            }
            Some(late)
        } else {
            // Without the GIL: a copy into pageable memory may block until the stream
            // reached it (CUDA), which is after the operation.
            let (pool, stream) = (&self.inner.pool, self.stream);
            let out = py
                .detach(|| staging.copy_back(pool, stream))
                .map_err(comm_err)?;
            out.map(|o| Arc::new(Mutex::new(Late::Ready(o))))
        };
        let pending = Pending {
            ops,
            staged,
            _held: std::mem::take(&mut self.args),
        };
        let work = Work {
            inner: Some(self.inner.clone()),
            pending: Mutex::new(Some(pending)),
            result: Mutex::new(None),
        };
        if wait && !self.inner.in_group() {
            return Ok(work.wait(py, None)?.into_pyobject(py)?.into_any().unbind());
        }
        Ok(Py::new(py, work)?.into_any())
    }
}

impl Drop for Call {
    /// A call that failed before its operation was enqueued (a bad later argument, a refused
    /// post): copies into its staging may be in flight, so the staging goes back to the pool
    /// only after the stream ran them (never freed under a running copy).
    fn drop(&mut self) {
        let staging = std::mem::take(&mut self.staging);
        staging.abandon(&self.inner.pool, self.stream);
    }
}

/// Runs `post` (which enqueues the operation), finishing `call` (or dropping it, which gives
/// its staging back).
pub(crate) fn run(
    py: Python<'_>,
    call: Call,
    wait: bool,
    post: impl FnOnce(&Comm<Adaptor>, StreamHandle) -> flagcx::p2p::Result<Ops> + Send,
) -> PyResult<Py<PyAny>> {
    let inner = call.inner.clone();
    let stream = call.stream;
    match py.detach(|| post(&inner.comm, stream)) {
        Ok(ops) => call.finish(py, ops, wait),
        Err(e) => {
            drop(call);
            Err(comm_err(e))
        }
    }
}

pub(crate) fn reduce_op(op: &str) -> PyResult<ReduceOp> {
    Ok(match op.to_ascii_lowercase().as_str() {
        "sum" => ReduceOp::Sum,
        "prod" | "product" => ReduceOp::Prod,
        "max" => ReduceOp::Max,
        "min" => ReduceOp::Min,
        "avg" | "mean" => ReduceOp::Avg,
        other => {
            return Err(errors::unsupported(format!(
                "reduction op {other:?}: flagcx has sum, prod, max, min and avg"
            )))
        }
    })
}

pub(crate) fn data_type(a: &Arg, what: &str) -> PyResult<DataType> {
    a.imported.element.data_type().ok_or_else(|| {
        errors::unsupported(format!(
            "{what}: flagcx cannot reduce {} elements (int8/16-bit floats/32- and 64-bit \
             integers and floats can)",
            a.imported.element.name()
        ))
    })
}

pub(crate) fn same_type(a: &Arg, b: &Arg) -> PyResult<()> {
    if a.imported.element != b.imported.element {
        return Err(PyTypeError::new_err(format!(
            "the input holds {} elements and the output {}",
            a.imported.element.name(),
            b.imported.element.name()
        )));
    }
    Ok(())
}

pub(crate) fn expect_bytes(a: &Arg, what: &str, bytes: usize) -> PyResult<()> {
    if a.imported.bytes() != bytes {
        return Err(invalid(format!(
            "{what} holds {} bytes; this call needs {bytes}",
            a.imported.bytes()
        )));
    }
    Ok(())
}
