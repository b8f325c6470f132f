//! `flagcx._flagcx`: the Python extension module under the `flagcx` package.
//!
//! One [`PyComm`] is one `flagcx::Comm` over the device this process opened, with a stream of
//! its own. Every call imports its buffers through DLPack ([`dlpack`]), enqueues the operation
//! and returns a [`Work`] (or waits for it: the default). Buffers in host memory that the
//! rank's device cannot name (a numpy array beside an OpenCL or CUDA rank, or any numpy array
//! beside a host-vendor rank whose "device" memory is shareable memfd memory) travel through
//! staging buffers of device memory ([`stage`]), copied in and out on the operation's stream;
//! device buffers and buffers from [`PyComm::empty`] are used in place.
//!
//! Waiting releases the GIL and wakes every 100 ms to let Python run its signal handlers: ^C
//! aborts the communicator (every rank's pending work fails) and raises `KeyboardInterrupt`.

mod dlpack;
mod errors;
mod memory;
mod stage;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use flagcx::p2p::{Config, RankEnv, UniqueId};
use flagcx::{
    Adaptor, Collective, Comm, DataType, DeviceAdaptor, DevicePtr, ReduceOp, Request, Stream,
    StreamHandle, Vendor,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use dlpack::Imported;
use errors::{comm_err, invalid};
use stage::{Pool, Resolved, Use};

/// Locks, ignoring poison (every guarded update here is a single push, take or insert).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long a wait sleeps between looks at Python's signal handlers.
const SIGNAL_TURN: Duration = Duration::from_millis(100);

/// What one rank holds: the communicator, its stream, the streams adopted from callers, the
/// staging pool, and operations whose `Work` was dropped before they finished.
struct Inner {
    // Field order is drop order: the communicator before the streams it may have joined.
    comm: Comm<Adaptor>,
    own: Stream<Adaptor>,
    adopted: Mutex<HashMap<u64, StreamHandle>>,
    pool: Pool,
    orphans: Mutex<Vec<Pending>>,
    /// Per posting thread, whether a group is open (posts in it do not wait).
    /// Per thread with a group open: the staging of its calls, copied back at `group_end`
    /// (the group's operations are enqueued only then).
    groups: Mutex<HashMap<std::thread::ThreadId, Vec<Arc<Mutex<Late>>>>>,
}

impl Inner {
    fn adaptor(&self) -> &Adaptor {
        self.comm.adaptor()
    }

    /// The stream an operation runs on: ours, or a caller's native stream (GPU vendors).
    fn stream(&self, native: Option<u64>) -> PyResult<StreamHandle> {
        let Some(native) = native else {
            return Ok(self.own.handle());
        };
        if !matches!(self.adaptor().vendor(), Vendor::Cuda | Vendor::Hip) {
            return Err(invalid(format!(
                "stream=: a {} rank runs operations on its own stream; pass no stream",
                self.adaptor().vendor().name()
            )));
        }
        let mut adopted = lock(&self.adopted);
        if let Some(h) = adopted.get(&native) {
            return Ok(*h);
        }
        // SAFETY: the caller passes a live stream of this process's runtime on this device
        // (documented on every call taking `stream=`); it is released at close.
        let h = unsafe { self.adaptor().stream_adopt(native) }.map_err(|e| comm_err(e.into()))?;
        adopted.insert(native, h);
        Ok(h)
    }

    fn in_group(&self) -> bool {
        lock(&self.groups).contains_key(&std::thread::current().id())
    }

    /// Drops the orphans that finished (their buffers' owners get them back).
    fn sweep(&self) {
        let mut o = lock(&self.orphans);
        if !o.is_empty() {
            o.retain(|p| !p.is_done());
        }
    }
}

/// Drops a reference to a rank's state without the GIL where it is the last one: tearing the
/// communicator down joins its progress thread, which may be logging through Python and need
/// the GIL meanwhile.
fn release(inner: Arc<Inner>) {
    if Arc::strong_count(&inner) > 1 {
        return;
    }
    let mut inner = Some(inner);
    let _ = Python::try_attach(|py| {
        let i = inner.take();
        py.detach(move || drop(i));
    });
    // The interpreter is gone or going: no Python thread can hold the GIL against us.
    drop(inner);
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Operations nobody waited for still use their buffers: let them finish (or fail on
        // the communicator's timeout) before the buffers' owners get them back. No abort: a
        // peer may still be finishing an operation with this rank that ours saw complete.
        for p in std::mem::take(&mut *lock(&self.orphans)) {
            let _ = p.settle(Duration::from_secs(5));
        }
        let a = self.comm.adaptor().clone();
        for (_, h) in lock(&self.adopted).drain() {
            let _ = a.stream_release(h);
        }
    }
}

/// An enqueued operation: what tells it finished, and everything it uses until then.
struct Pending {
    ops: Ops,
    /// Staging copies back to the caller's buffers (enqueued behind the operation).
    staged: Option<Arc<Mutex<Late>>>,
    /// The imported buffers (their producers' memory stays alive while these live).
    _held: Vec<Imported>,
}

enum Ops {
    Requests(Vec<Request>),
    Collective(Collective),
}

impl Pending {
    fn is_done(&self) -> bool {
        let ops = match &self.ops {
            Ops::Requests(r) => r.iter().all(Request::is_done),
            Ops::Collective(c) => c.is_done(),
        };
        ops && self.staged.as_ref().map_or(true, |l| lock(l).is_done())
    }

    /// Waits up to `t` for every part to finish without taking results.
    fn settle(&self, t: Duration) -> bool {
        let deadline = std::time::Instant::now() + t;
        let left = || deadline.saturating_duration_since(std::time::Instant::now());
        let ops = match &self.ops {
            Ops::Requests(r) => r.iter().all(|r| r.settle(left())),
            Ops::Collective(c) => c.settle(left()),
        };
        ops && self
            .staged
            .as_ref()
            .map_or(true, |l| lock(l).settle(left()))
    }

    /// The results (after `settle` said done): bytes of a single request, else `None`.
    fn finish(self, pool: &Pool) -> flagcx::p2p::Result<Option<usize>> {
        let result = match self.ops {
            Ops::Requests(mut r) if r.len() == 1 => r.pop().map(Request::wait).transpose(),
            Ops::Requests(r) => {
                let mut first = None;
                for q in r {
                    if let Err(e) = q.wait() {
                        first.get_or_insert(e);
                    }
                }
                first.map_or(Ok(None), Err)
            }
            Ops::Collective(c) => c.wait().map(|()| None),
        };
        if let Some(l) = self.staged {
            let late = std::mem::replace(&mut *lock(&l), Late::Taken);
            late.finish(pool)?;
        }
        result
    }
}

/// A call's staging copies back: enqueued with the call, or (inside a group, whose
/// operations are enqueued at its end) at `group_end`.
enum Late {
    /// In a group not ended yet: what to copy back, on which stream.
    Waiting(stage::Staging, StreamHandle),
    /// Enqueued.
    Ready(stage::Outbound),
    /// The group failed or its copies could not be enqueued.
    Failed(flagcx::p2p::CommError),
    /// Finished.
    Taken,
}

impl Late {
    fn is_done(&self) -> bool {
        match self {
            Late::Waiting(..) => false,
            Late::Ready(o) => o.is_done(),
            Late::Failed(_) | Late::Taken => true,
        }
    }

    fn settle(&self, t: Duration) -> bool {
        match self {
            Late::Ready(o) => o.settle(t),
            other => other.is_done(),
        }
    }

    /// The group ended: enqueue the copies back (or give the staging up where it failed).
    fn enqueue(&mut self, pool: &Pool, group: &flagcx::p2p::Result<()>) {
        if let Late::Waiting(staging, stream) = std::mem::replace(self, Late::Taken) {
            *self = match group {
                Ok(()) => match staging.copy_back(pool, stream) {
                    Ok(Some(o)) => Late::Ready(o),
                    Ok(None) => Late::Taken,
                    Err(e) => Late::Failed(e),
                },
                Err(e) => {
                    staging.abandon(pool, stream);
                    Late::Failed(e.clone())
                }
            };
        }
    }

    fn finish(self, pool: &Pool) -> flagcx::p2p::Result<()> {
        match self {
            Late::Ready(o) => o.finish(pool),
            Late::Failed(e) => Err(e),
            Late::Taken => Ok(()),
            Late::Waiting(staging, stream) => {
                staging.abandon(pool, stream);
                Err(flagcx::p2p::CommError::InvalidArgument(
                    "the call's group never ended (call group_end)".into(),
                ))
            }
        }
    }
}

/// An operation in flight (`async_op=True`), or a finished one.
///
/// `wait()` blocks until it finished (GIL released; ^C aborts the communicator) and raises its
/// failure. A `Work` dropped unfinished hands its operation to the communicator, which keeps
/// the buffers alive until it finishes.
#[pyclass(module = "flagcx._flagcx", name = "Work")]
pub struct Work {
    /// `None` only while dropping.
    inner: Option<Arc<Inner>>,
    pending: Mutex<Option<Pending>>,
    /// The outcome, once a waiter took it.
    result: Mutex<Option<flagcx::p2p::Result<Option<usize>>>>,
}

#[pymethods]
impl Work {
    /// Blocks until the operation finished and returns the bytes it received (receives) or
    /// `None`; raises the operation's failure. Waiting again returns the same result.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<usize>> {
        if let Some(r) = lock(&self.result).clone() {
            return r.map_err(comm_err);
        }
        let limit = timeout.map(Duration::from_secs_f64);
        let t0 = std::time::Instant::now();
        loop {
            let turn = limit
                .map_or(SIGNAL_TURN, |l| l.saturating_sub(t0.elapsed()))
                .min(SIGNAL_TURN);
            // The lock is taken without the GIL: another thread (a completion thread of the
            // torch backend) may hold it while it waits, and needs the GIL to return.
            let settled = py.detach(|| {
                lock(&self.pending)
                    .as_ref()
                    .map_or(true, |p| p.settle(turn))
            });
            if settled {
                break;
            }
            if let Err(e) = py.check_signals() {
                if let Some(i) = &self.inner {
                    i.comm.abort();
                }
                return Err(e);
            }
            if limit.is_some_and(|l| t0.elapsed() >= l) {
                return Err(errors::timeout(format!(
                    "Work.wait: not finished after {:.3} s (the operation goes on)",
                    t0.elapsed().as_secs_f64()
                )));
            }
        }
        // Taking, finishing and storing under the lock: a second waiter sees the stored
        // outcome, the failure included.
        py.detach(|| {
            let mut pending = lock(&self.pending);
            if let Some(p) = pending.take() {
                let r = match &self.inner {
                    Some(i) => p.finish(&i.pool),
                    None => Ok(None),
                };
                *lock(&self.result) = Some(r);
            }
            drop(pending);
            lock(&self.result).clone().unwrap_or(Ok(None))
        })
        .map_err(comm_err)
    }

    /// True once the operation finished (successfully or not); never blocks.
    fn is_completed(&self) -> bool {
        // A waiter holding the lock has not finished yet (and may need the GIL to let go).
        match self.pending.try_lock() {
            Ok(p) => p.as_ref().map_or(true, Pending::is_done),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                p.into_inner().as_ref().map_or(true, Pending::is_done)
            }
            Err(std::sync::TryLockError::WouldBlock) => false,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<flagcx.Work {}>",
            if self.is_completed() {
                "completed"
            } else {
                "pending"
            }
        )
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        let inner = self.inner.take();
        let Some(inner) = inner else { return };
        if let Some(p) = lock(&self.pending).take() {
            if p.is_done() {
                let _ = p.finish(&inner.pool);
            } else {
                lock(&inner.orphans).push(p);
            }
        }
        release(inner);
    }
}

/// A job's identity as text (`fx1-…`): make one on one rank ([`unique_id`]) and hand it to
/// the others (a torch `Store`, an environment variable, a file).
#[pyfunction]
fn unique_id() -> PyResult<String> {
    UniqueId::random().map(|u| u.to_string()).map_err(comm_err)
}

/// `<version> (vendors: host, cuda, opencl)`.
#[pyfunction]
fn version() -> String {
    flagcx::version_line()
}

/// The vendors this build can open (GPUs first).
#[pyfunction]
fn vendors() -> Vec<&'static str> {
    Adaptor::compiled_vendors()
        .iter()
        .map(|v| v.name())
        .collect()
}

/// How many devices `vendor` (`"host"`, `"cuda"`, `"opencl"`) has here; raises
/// `Unavailable` with the reason where its runtime or device is missing.
#[pyfunction]
fn device_count(py: Python<'_>, vendor: &str) -> PyResult<usize> {
    let v: Vendor = vendor
        .parse()
        .map_err(|e: flagcx::AdaptorError| invalid(e.to_string()))?;
    py.detach(|| Adaptor::open(v, 0).and_then(|a| a.device_count()))
        .map_err(|e| comm_err(e.into()))
}

/// A communicator: this process as one rank of a job.
#[pyclass(module = "flagcx._flagcx", name = "Comm")]
pub struct PyComm {
    inner: Mutex<Option<Arc<Inner>>>,
    rank: usize,
    nranks: usize,
    vendor: Vendor,
    device: usize,
}

fn open_adaptor(vendor: Option<&str>, device: Option<usize>) -> PyResult<Adaptor> {
    let r = match vendor {
        None if device.is_none() => Adaptor::from_env(),
        None => Adaptor::detect(device.unwrap_or(0)),
        Some(v) => {
            let v: Vendor = v
                .parse()
                .map_err(|e: flagcx::AdaptorError| invalid(e.to_string()))?;
            Adaptor::open(v, device.unwrap_or(0))
        }
    };
    r.map_err(|e| comm_err(e.into()))
}

impl PyComm {
    fn build(
        py: Python<'_>,
        adaptor: Adaptor,
        rank: usize,
        nranks: usize,
        id: UniqueId,
    ) -> PyResult<Self> {
        let config = Config::from_env().map_err(comm_err)?;
        let (vendor, device) = (adaptor.vendor(), adaptor.device());
        let inner = py
            .detach(move || -> flagcx::p2p::Result<Inner> {
                let own = Stream::new(&adaptor)?;
                let comm = Comm::init(adaptor.clone(), rank, nranks, &id, config)?;
                Ok(Inner {
                    pool: Pool::new(adaptor),
                    comm,
                    own,
                    adopted: Mutex::default(),
                    orphans: Mutex::default(),
                    groups: Mutex::default(),
                })
            })
            .map_err(comm_err)?;
        Ok(PyComm {
            inner: Mutex::new(Some(Arc::new(inner))),
            rank,
            nranks,
            vendor,
            device,
        })
    }

    fn inner(&self) -> PyResult<Arc<Inner>> {
        lock(&self.inner)
            .clone()
            .ok_or_else(|| errors::aborted("the communicator is closed"))
    }
}

/// A buffer argument: imported and resolved to a device pointer.
struct Arg {
    imported: Imported,
    resolved: Resolved,
}

/// What an operation's call needs to run: its stream, imported buffers and staging.
struct Call {
    inner: Arc<Inner>,
    stream: StreamHandle,
    native: Option<u64>,
    args: Vec<Imported>,
    staging: stage::Staging,
}

impl Call {
    fn new(inner: Arc<Inner>, stream: Option<u64>) -> PyResult<Self> {
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
    fn arg(&mut self, obj: &Bound<'_, PyAny>, what: &str, how: Use) -> PyResult<Arg> {
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
    fn keep(&mut self, a: Arg) -> DevicePtr {
        self.args.push(a.imported);
        a.resolved.ptr
    }

    /// After the operation was enqueued: staging copies back, and the `Work`.
    fn finish(mut self, py: Python<'_>, ops: Ops, wait: bool) -> PyResult<Py<PyAny>> {
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
            let out = staging
                .copy_back(&self.inner.pool, self.stream)
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

    /// Releases the staging taken so far (the call failed before enqueueing).
    fn abandon(self) {
        self.staging.abandon(&self.inner.pool, self.stream);
    }
}

/// Runs `post` (which enqueues the operation), finishing or abandoning `call`.
fn run(
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
            call.abandon();
            Err(comm_err(e))
        }
    }
}

fn reduce_op(op: &str) -> PyResult<ReduceOp> {
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

fn data_type(a: &Arg, what: &str) -> PyResult<DataType> {
    a.imported.element.data_type().ok_or_else(|| {
        errors::unsupported(format!(
            "{what}: flagcx cannot reduce {} elements (int8/16-bit floats/32- and 64-bit \
             integers and floats can)",
            a.imported.element.name()
        ))
    })
}

fn same_type(a: &Arg, b: &Arg) -> PyResult<()> {
    if a.imported.element != b.imported.element {
        return Err(PyTypeError::new_err(format!(
            "the input holds {} elements and the output {}",
            a.imported.element.name(),
            b.imported.element.name()
        )));
    }
    Ok(())
}

fn expect_bytes(a: &Arg, what: &str, bytes: usize) -> PyResult<()> {
    if a.imported.bytes() != bytes {
        return Err(invalid(format!(
            "{what} holds {} bytes; this call needs {bytes}",
            a.imported.bytes()
        )));
    }
    Ok(())
}

#[pymethods]
impl PyComm {
    /// Joins job `unique_id` (from [`unique_id`]) as `rank` of `nranks`, on the device of
    /// `vendor` (`"host"`, `"cuda"`, `"opencl"`; default: `FLAGCX_VENDOR`, else the first
    /// with a device) numbered `device` (default: `FLAGCX_DEVICE`, else the local rank's).
    /// Every rank of the job calls it; it returns once all have.
    #[new]
    #[pyo3(signature = (rank, nranks, unique_id, vendor=None, device=None))]
    fn new(
        py: Python<'_>,
        rank: usize,
        nranks: usize,
        unique_id: &str,
        vendor: Option<&str>,
        device: Option<usize>,
    ) -> PyResult<Self> {
        let id: UniqueId = unique_id.parse().map_err(comm_err)?;
        if rank >= nranks {
            return Err(invalid(format!(
                "rank {rank} is out of range for {nranks} ranks"
            )));
        }
        let adaptor = open_adaptor(vendor, device)?;
        Self::build(py, adaptor, rank, nranks, id)
    }

    /// Joins the job that the launcher's environment describes (`flagcx-run`, `torchrun`,
    /// `mpirun`, `srun`).
    #[staticmethod]
    #[pyo3(signature = (vendor=None, device=None))]
    fn from_env(py: Python<'_>, vendor: Option<&str>, device: Option<usize>) -> PyResult<Self> {
        let env = RankEnv::from_env().map_err(comm_err)?;
        let adaptor = open_adaptor(vendor, device)?;
        Self::build(py, adaptor, env.rank, env.nranks, env.id)
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    #[getter]
    fn nranks(&self) -> usize {
        self.nranks
    }

    /// The vendor of this rank's device (`"host"`, `"cuda"`, …).
    #[getter]
    fn vendor(&self) -> &'static str {
        self.vendor.name()
    }

    /// The device number this rank opened.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// The native handle of the communicator's own stream (a `CUstream` on CUDA ranks, for
    /// `torch.cuda.ExternalStream`; an opaque number elsewhere).
    #[getter]
    fn stream(&self) -> PyResult<u64> {
        Ok(self.inner()?.own.handle().0)
    }

    /// The transport to `peer` (`"ipc"`, `"staged"`, `"net"`), `None` for this rank.
    fn transport(&self, peer: usize) -> PyResult<Option<&'static str>> {
        Ok(self.inner()?.comm.transport(peer).map(|t| match t {
            flagcx::TransportKind::Ipc => "ipc",
            flagcx::TransportKind::Staged => "staged",
            flagcx::TransportKind::Net => "net",
        }))
    }

    /// A zeroed buffer of `nbytes` bytes of this rank's device memory that operations use in
    /// place (no staging copies): an object with `__dlpack__`, so `numpy.from_dlpack(buf)`
    /// (host-vendor ranks: the memory is host memory) or `torch.from_dlpack(buf)` views it.
    /// It stays allocated while any view of it lives.
    fn empty(&self, py: Python<'_>, nbytes: usize) -> PyResult<memory::Memory> {
        let inner = self.inner()?;
        py.detach(|| memory::Memory::new(inner.adaptor(), &inner.own, nbytes))
            .map_err(comm_err)
    }

    /// Sends the whole of `buf` to `peer`.
    ///
    /// `stream`: a native stream of this rank's GPU runtime to order the call on (CUDA:
    /// `torch.cuda.current_stream().cuda_stream`); default the communicator's own stream.
    /// `async_op=True` returns a `Work` instead of waiting.
    #[pyo3(signature = (buf, peer, *, stream=None, async_op=false))]
    fn send(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        peer: usize,
        stream: Option<u64>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        self.p2p(py, buf, peer, stream, async_op, true)
    }

    /// Receives into `buf` from `peer` (the sender may send fewer bytes, never more); returns
    /// the bytes received (or a `Work` whose `wait()` does). Keywords as [`PyComm::send`].
    #[pyo3(signature = (buf, peer, *, stream=None, async_op=false))]
    fn recv(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        peer: usize,
        stream: Option<u64>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        self.p2p(py, buf, peer, stream, async_op, false)
    }

    /// All-reduce: every rank's `input` combined element by element with `op` (`"sum"`,
    /// `"prod"`, `"max"`, `"min"`, `"avg"`) into every rank's `output` (default: `input`,
    /// in place). Every rank gets the same bits.
    #[pyo3(signature = (input, op="sum", output=None, *, stream=None, async_op=false))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        op: &str,
        output: Option<&Bound<'_, PyAny>>,
        stream: Option<u64>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let op = reduce_op(op)?;
        let mut call = Call::new(self.inner()?, stream)?;
        let (send, recv, count, dtype) = {
            let send = call.arg(
                input,
                "input",
                if output.is_none() {
                    Use::InOut
                } else {
                    Use::In
                },
            )?;
            let dtype = data_type(&send, "input")?;
            let count = send.imported.count;
            let recv = match output {
                Some(o) => {
                    let r = call.arg(o, "output", Use::Out)?;
                    same_type(&send, &r)?;
                    expect_bytes(&r, "output", send.imported.bytes())?;
                    Some(r)
                }
                None => None,
            };
            let s = call.keep(send);
            let r = recv.map_or(s, |r| call.keep(r));
            (s, r, count, dtype)
        };
        run(py, call, !async_op, move |c, st| {
            // SAFETY: both ranges are held by the call until the operation finished.
            unsafe { c.all_reduce_raw(send, recv, count, dtype, op, st) }.map(Ops::Collective)
        })
    }

    /// Reduce: every rank's `input` combined with `op` into `output` on `root` (default:
    /// `input`, in place); other ranks' `output` is not used.
    #[pyo3(signature = (input, root, op="sum", output=None, *, stream=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        root: usize,
        op: &str,
        output: Option<&Bound<'_, PyAny>>,
        stream: Option<u64>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let op = reduce_op(op)?;
        let mut call = Call::new(self.inner()?, stream)?;
        let me = self.rank == root;
        let send = call.arg(
            input,
            "input",
            if me && output.is_none() {
                Use::InOut
            } else {
                Use::In
            },
        )?;
        let dtype = data_type(&send, "input")?;
        let count = send.imported.count;
        let recv = match output {
            Some(o) if me => {
                let r = call.arg(o, "output", Use::Out)?;
                same_type(&send, &r)?;
                expect_bytes(&r, "output", send.imported.bytes())?;
                Some(r)
            }
            _ => None,
        };
        let s = call.keep(send);
        let r = match recv {
            Some(r) => call.keep(r),
            None if me => s,
            None => DevicePtr::NULL,
        };
        run(py, call, !async_op, move |c, st| {
            // SAFETY: as in all_reduce.
            unsafe { c.reduce_raw(s, r, count, dtype, op, root, st) }.map(Ops::Collective)
        })
    }

    /// Reduce-scatter: the ranks' `input` (`nranks` blocks of `output`'s size) combined with
    /// `op`; rank `q` receives block `q` of the result in `output`.
    #[pyo3(signature = (input, output, op="sum", *, stream=None, async_op=false))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
        op: &str,
        stream: Option<u64>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let op = reduce_op(op)?;
        let n = self.nranks;
        let mut call = Call::new(self.inner()?, stream)?;
        let send = call.arg(input, "input", Use::In)?;
        let recv = call.arg(output, "output", Use::Out)?;
        same_type(&send, &recv)?;
        let dtype = data_type(&send, "input")?;
        let count = recv.imported.count;
        expect_bytes(&send, "input", recv.imported.bytes() * n)?;
        let (s, r) = (call.keep(send), call.keep(recv));
        run(py, call, !async_op, move |c, st| {
            // SAFETY: as in all_reduce.
            unsafe { c.reduce_scatter_raw(s, r, count, dtype, op, st) }.map(Ops::Collective)
        })
    }

    /// Broadcast: `root`'s `input` arrives in every rank's `output` (default: `input`, in
    /// place); other ranks' `input` is not read.
    #[pyo3(signature = (input, root, output=None, *, stream=None, async_op=false))]
    fn broadcast(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        root: usize,
        output: Option<&Bound<'_, PyAny>>,
        stream: Option<u64>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let mut call = Call::new(self.inner()?, stream)?;
        let me = self.rank == root;
        let send = call.arg(
            input,
            "input",
            if output.is_none() && !me {
                Use::Out
            } else {
                Use::In
            },
        )?;
        let bytes = send.imported.bytes();
        let recv = match output {
            Some(o) => {
                let r = call.arg(o, "output", Use::Out)?;
                expect_bytes(&r, "output", bytes)?;
                Some(r)
            }
            None => None,
        };
        let s = call.keep(send);
        let r = recv.map_or(s, |r| call.keep(r));
        run(py, call, !async_op, move |c, st| {
            // SAFETY: as in all_reduce.
            unsafe { c.broadcast_raw(s, r, bytes, root, st) }.map(Ops::Collective)
        })
    }

    /// All-gather: every rank's `input` lands in block `rank` of every rank's `output`
    /// (`nranks` times `input`'s size).
    #[pyo3(signature = (input, output, *, stream=None, async_op=false))]
    fn all_gather(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
        stream: Option<u64>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let n = self.nranks;
        let mut call = Call::new(self.inner()?, stream)?;
        let send = call.arg(input, "input", Use::In)?;
        let recv = call.arg(output, "output", Use::Out)?;
        let bytes = send.imported.bytes();
        expect_bytes(&recv, "output", bytes * n)?;
        let (s, r) = (call.keep(send), call.keep(recv));
        run(py, call, !async_op, move |c, st| {
            // SAFETY: as in all_reduce.
            unsafe { c.all_gather_raw(s, r, bytes, st) }.map(Ops::Collective)
        })
    }

    /// Gather: every rank's `input` lands in block `rank` of `root`'s `output` (`nranks`
    /// times `input`'s size; other ranks pass `None`).
    #[pyo3(signature = (input, output, root, *, stream=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: Option<&Bound<'_, PyAny>>,
        root: usize,
        stream: Option<u64>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let n = self.nranks;
        let mut call = Call::new(self.inner()?, stream)?;
        let send = call.arg(input, "input", Use::In)?;
        let bytes = send.imported.bytes();
        let recv = match output {
            Some(o) if self.rank == root => {
                let r = call.arg(o, "output", Use::Out)?;
                expect_bytes(&r, "output", bytes * n)?;
                Some(r)
            }
            None if self.rank == root => return Err(invalid("the root's output is required")),
            _ => None,
        };
        let s = call.keep(send);
        let r = recv.map_or(DevicePtr::NULL, |r| call.keep(r));
        run(py, call, !async_op, move |c, st| {
            // SAFETY: as in all_reduce.
            unsafe { c.gather_raw(s, r, bytes, root, st) }.map(Ops::Collective)
        })
    }

    /// Scatter: block `q` of `root`'s `input` (`nranks` times `output`'s size; other ranks
    /// pass `None`) lands in rank `q`'s `output`.
    #[pyo3(signature = (input, output, root, *, stream=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn scatter(
        &self,
        py: Python<'_>,
        input: Option<&Bound<'_, PyAny>>,
        output: &Bound<'_, PyAny>,
        root: usize,
        stream: Option<u64>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let n = self.nranks;
        let mut call = Call::new(self.inner()?, stream)?;
        let recv = call.arg(output, "output", Use::Out)?;
        let bytes = recv.imported.bytes();
        let send = match input {
            Some(i) if self.rank == root => {
                let s = call.arg(i, "input", Use::In)?;
                expect_bytes(&s, "input", bytes * n)?;
                Some(s)
            }
            None if self.rank == root => return Err(invalid("the root's input is required")),
            _ => None,
        };
        let r = call.keep(recv);
        let s = send.map_or(DevicePtr::NULL, |s| call.keep(s));
        run(py, call, !async_op, move |c, st| {
            // SAFETY: as in all_reduce.
            unsafe { c.scatter_raw(s, r, bytes, root, st) }.map(Ops::Collective)
        })
    }

    /// All-to-all: block `q` of `input` goes to rank `q`, block `p` of `output` comes from
    /// rank `p` (`input` and `output` of equal size, `nranks` blocks). With `input_splits`
    /// and `output_splits` (elements per rank) the blocks' sizes vary; they lie back to back.
    #[pyo3(signature = (input, output, input_splits=None, output_splits=None, *, stream=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn all_to_all(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
        input_splits: Option<Vec<usize>>,
        output_splits: Option<Vec<usize>>,
        stream: Option<u64>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let n = self.nranks;
        let mut call = Call::new(self.inner()?, stream)?;
        let send = call.arg(input, "input", Use::In)?;
        // Splits may leave part of the output unwritten.
        let varied = input_splits.is_some() || output_splits.is_some();
        let recv = call.arg(output, "output", if varied { Use::InOut } else { Use::Out })?;
        let size = send.imported.element.size();
        if input_splits.is_none() && output_splits.is_none() {
            let total = send.imported.bytes();
            expect_bytes(&recv, "output", total)?;
            if total % n != 0 {
                return Err(invalid(format!(
                    "input: {total} bytes do not split into {n} equal blocks"
                )));
            }
            let (s, r) = (call.keep(send), call.keep(recv));
            return run(py, call, !async_op, move |c, st| {
                // SAFETY: as in all_reduce.
                unsafe { c.all_to_all_raw(s, r, total / n, st) }.map(Ops::Collective)
            });
        }
        same_type(&send, &recv)?;
        let even = |total: usize| vec![total / n.max(1); n];
        let sc = input_splits.unwrap_or_else(|| even(send.imported.count));
        let rc = output_splits.unwrap_or_else(|| even(recv.imported.count));
        let layout =
            |what: &str, counts: &[usize], a: &Arg| -> PyResult<(Vec<usize>, Vec<usize>)> {
                if counts.len() != n {
                    return Err(invalid(format!(
                        "{what}: {} splits for {n} ranks",
                        counts.len()
                    )));
                }
                let bytes: Vec<usize> = counts.iter().map(|c| c * size).collect();
                let displs: Vec<usize> = bytes
                    .iter()
                    .scan(0, |at, b| {
                        let d = *at;
                        *at += b;
                        Some(d)
                    })
                    .collect();
                let total: usize = bytes.iter().sum();
                if total > a.imported.bytes() {
                    return Err(invalid(format!(
                        "{what}: the splits need {total} bytes, the buffer has {}",
                        a.imported.bytes()
                    )));
                }
                Ok((bytes, displs))
            };
        let (sb, sd) = layout("input_splits", &sc, &send)?;
        let (rb, rd) = layout("output_splits", &rc, &recv)?;
        let (s, r) = (call.keep(send), call.keep(recv));
        run(py, call, !async_op, move |c, st| {
            // SAFETY: as in all_reduce; the layouts were checked against the buffers.
            unsafe { c.all_to_allv_raw(s, &sb, &sd, r, &rb, &rd, st) }.map(Ops::Collective)
        })
    }

    /// Returns once every rank called it (or a `Work` with `async_op=True`).
    #[pyo3(signature = (*, stream=None, async_op=false))]
    fn barrier(&self, py: Python<'_>, stream: Option<u64>, async_op: bool) -> PyResult<Py<PyAny>> {
        let call = Call::new(self.inner()?, stream)?;
        run(py, call, !async_op, |c, st| {
            c.barrier_async(st).map(Ops::Collective)
        })
    }

    /// Starts a group: operations this thread posts until `group_end` progress together
    /// (the way to post a send and a receive that pair with each other). Calls in a group
    /// do not wait; each returns a `Work`. Prefer `with comm.group():`.
    fn group_begin(&self) -> PyResult<()> {
        let inner = self.inner()?;
        inner.comm.group_begin().map_err(comm_err)?;
        lock(&inner.groups)
            .entry(std::thread::current().id())
            .or_default();
        Ok(())
    }

    /// `with comm.group(): ...` — `group_begin` on entry, `group_end` on exit.
    fn group(slf: Py<Self>) -> Group {
        Group { comm: slf }
    }

    /// Ends this thread's group: its operations are enqueued together.
    fn group_end(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner()?;
        let late = lock(&inner.groups)
            .remove(&std::thread::current().id())
            .unwrap_or_default();
        py.detach(|| {
            let r = inner.comm.group_end();
            for l in &late {
                lock(l).enqueue(&inner.pool, &r);
            }
            r
        })
        .map_err(comm_err)
    }

    /// Aborts: every pending and later operation of this communicator fails (`Aborted`), and
    /// the peers' operations with this rank fail too. Safe from any thread (a watchdog).
    fn abort(&self) -> PyResult<()> {
        if let Some(i) = lock(&self.inner).as_ref() {
            i.comm.abort();
        }
        Ok(())
    }

    /// The communicator's first asynchronous failure (a lost peer, a timeout, a remote or
    /// runtime failure) as an exception object, without raising it; `None` while there is
    /// none.
    fn async_error(&self) -> PyResult<Option<PyErr>> {
        Ok(self.inner()?.comm.async_error().map(comm_err))
    }

    /// Frees everything: waits (up to 5 s each) for operations whose `Work` was dropped,
    /// then tears the communicator down. Calls after it raise `Aborted`. Idempotent.
    fn close(&self, py: Python<'_>) {
        let inner = lock(&self.inner).take();
        if let Some(inner) = inner {
            py.detach(move || {
                for p in std::mem::take(&mut *lock(&inner.orphans)) {
                    let _ = p.settle(Duration::from_secs(5));
                }
                drop(inner);
            });
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!(
            "<flagcx.Comm rank {} of {} on {} device {}>",
            self.rank,
            self.nranks,
            self.vendor.name(),
            self.device
        )
    }
}

impl PyComm {
    fn p2p(
        &self,
        py: Python<'_>,
        buf: &Bound<'_, PyAny>,
        peer: usize,
        stream: Option<u64>,
        async_op: bool,
        send: bool,
    ) -> PyResult<Py<PyAny>> {
        let mut call = Call::new(self.inner()?, stream)?;
        let a = call.arg(buf, "buf", if send { Use::In } else { Use::InOut })?;
        let bytes = a.imported.bytes();
        let p = call.keep(a);
        run(py, call, !async_op, move |c, st| {
            // SAFETY: the range is held by the call until the operation finished.
            let r = unsafe {
                if send {
                    c.send_raw(p, bytes, peer, st)
                } else {
                    c.recv_raw(p, bytes, peer, st)
                }
            };
            r.map(|r| Ops::Requests(vec![r]))
        })
    }
}

impl Drop for PyComm {
    fn drop(&mut self) {
        // Tearing down joins the progress thread, which may be logging through Python:
        // release the GIL meanwhile.
        if let Some(inner) = lock(&self.inner).take() {
            release(inner);
        }
    }
}

/// A group as a context manager (`Comm.group()`).
#[pyclass(module = "flagcx._flagcx", name = "Group")]
pub struct Group {
    comm: Py<PyComm>,
}

#[pymethods]
impl Group {
    fn __enter__(&self, py: Python<'_>) -> PyResult<()> {
        self.comm.borrow(py).group_begin()
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.comm.borrow(py).group_end(py)?;
        Ok(false)
    }
}

static LOG_RESET: std::sync::OnceLock<pyo3_log::ResetHandle> = std::sync::OnceLock::new();

/// Makes the library's logs follow Python's logging levels again after they changed (levels
/// are cached per logger).
#[pyfunction]
fn reset_logging() {
    if let Some(h) = LOG_RESET.get() {
        h.reset();
    }
}

/// The extension module.
#[pymodule]
fn _flagcx(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Library logs go to Python's `logging` (loggers `flagcx_p2p.setup`, …). Records below
    // info are not even formed unless `FLAGCX_DEBUG` asks for them (some sit on hot paths);
    // Python's levels are cached per logger: `flagcx.reset_logging()` after changing them.
    let level = match std::env::var("FLAGCX_DEBUG")
        .as_deref()
        .map(str::to_ascii_lowercase)
    {
        Ok(l) if l == "trace" => log::LevelFilter::Trace,
        Ok(l) if l == "debug" => log::LevelFilter::Debug,
        _ => log::LevelFilter::Info,
    };
    if let Ok(handle) = pyo3_log::Logger::new(m.py(), pyo3_log::Caching::LoggersAndLevels)
        .map(|l| l.filter(level))
        .and_then(|l| {
            l.install()
                .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))
        })
    {
        let _ = LOG_RESET.set(handle);
    }
    m.add_class::<PyComm>()?;
    m.add_class::<Work>()?;
    m.add_class::<Group>()?;
    m.add_class::<memory::Memory>()?;
    m.add_function(wrap_pyfunction!(unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(vendors, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(reset_logging, m)?)?;
    errors::register(m)?;
    Ok(())
}
