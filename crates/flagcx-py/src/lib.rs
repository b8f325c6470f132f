//! `flagcx._flagcx`: the Python extension module under the `flagcx` package.
//!
//! One [`PyComm`] is one `flagcx::Comm` over the device this process opened, with a stream of
//! its own. Every call imports its buffers through DLPack (module `dlpack`), enqueues the operation
//! and returns a `Work` (or waits for it: the default). Buffers in host memory that the
//! rank's device cannot name (a numpy array beside an OpenCL or CUDA rank) travel through
//! staging buffers of device memory (module `stage`), copied in and out on the operation's stream;
//! beside a host-vendor rank they are registered for the call and used in place (peers copy
//! through the kernel); device buffers and buffers from `Comm.empty` are used in place.
//!
//! Waiting releases the GIL and wakes every 100 ms to let Python run its signal handlers: ^C
//! aborts the communicator (every rank's pending work fails) and raises `KeyboardInterrupt`.

mod call;
mod dlpack;
mod errors;
mod inner;
mod memory;
mod pending;
mod stage;
mod work;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use flagcx::p2p::{Config, RankEnv, UniqueId};
use flagcx::{Adaptor, Comm, DeviceAdaptor, DevicePtr, Stream, Vendor};
use pyo3::prelude::*;

use call::{data_type, expect_bytes, reduce_op, run, same_type, Arg, Call};
use errors::{comm_err, invalid};
use inner::{release, Inner};
use pending::Ops;
use stage::{Pool, Use};
use work::Work;

/// Locks, ignoring poison (every guarded update here is a single push, take or insert).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long a wait sleeps between looks at Python's signal handlers.
pub(crate) const SIGNAL_TURN: Duration = Duration::from_millis(100);

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
        // FLAGCX_VENDOR, else a GPU (CUDA first, spread over the node's GPUs by local
        // rank), else the host vendor — an OpenCL device only when asked for: on a machine
        // without a GPU, OpenCL is a CPU device (PoCL), a poorer place for host data than
        // the host vendor.
        None if device.is_none() => {
            let asked = std::env::var("FLAGCX_VENDOR").is_ok_and(|v| !v.trim().is_empty());
            if asked || Adaptor::open(Vendor::Cuda, 0).is_ok() {
                Adaptor::from_env()
            } else {
                Adaptor::from_env_for(Some(Vendor::Host))
            }
        }
        None => Adaptor::detect(device.unwrap_or(0)),
        Some(v) => {
            let v: Vendor = v
                .parse()
                .map_err(|e: flagcx::AdaptorError| invalid(e.to_string()))?;
            match device {
                Some(d) => Adaptor::open(v, d),
                // The local rank's device, as `Comm`'s doc says.
                None => Adaptor::from_env_for(Some(v)),
            }
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

#[pymethods]
impl PyComm {
    /// Joins job `unique_id` (from [`unique_id`]) as `rank` of `nranks`, on the device of
    /// `vendor` (`"host"`, `"cuda"`, `"opencl"`; default: `FLAGCX_VENDOR`, else CUDA where
    /// there is a GPU, else the host vendor) numbered `device` (default: `FLAGCX_DEVICE`,
    /// else the local rank's).
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
