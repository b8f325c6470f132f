//! Test-only adaptor wrappers (feature `conformance`).
//!
//! [`FaultyAdaptor`] wraps any adaptor and makes one chosen kind of call fail, once, after a
//! number of successes — the way a real runtime fails mid-transfer (an ECC error, a lost
//! device), or block in it for a while ([`FaultyAdaptor::stalling`]). Tests use it to prove
//! that failures surface as errors on both sides of a transfer and never as silent
//! corruption, and that a thread stuck in the runtime does not hold callers' streams.

use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use crate::{
    AdaptorError, Capabilities, CaptureMode, DeviceAdaptor, DeviceProperties, DevicePtr,
    EventHandle, GateHandle, HostFn, IpcFdHandle, IpcMemHandle, Result, StreamHandle, Vendor,
    WaitCondition,
};

/// Which calls a [`FaultyAdaptor`] fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    /// `memcpy_h2d_async`.
    CopyH2D,
    /// `memcpy_d2h_async`.
    CopyD2H,
    /// `memcpy_d2d_async`.
    CopyD2D,
    /// `host_register`.
    Register,
    /// `event_query`: the runtime fails to say whether an event completed.
    EventQuery,
    /// `stream_write_value32/64` and `stream_write_values64`: a stream memory write fails to
    /// enqueue (eager value writes, stream-ordered messages, port channels).
    StreamWrite,
    /// `stream_wait_value32/64`: a stream memory wait fails to enqueue (how callers' streams
    /// join operations on vendors that have them).
    StreamWait,
    /// `ipc_open_handle`, failing as CUDA's does where this process maps the memory already
    /// (`CUDA_ERROR_ALREADY_MAPPED`: a peer reused memory of an allocation it freed).
    IpcOpenMapped,
    /// `mem_alloc_shareable_on`: no shareable memory where it was asked for (a device ring's
    /// offer).
    AllocShareable,
    /// `ipc_import_fd`: the export cannot be mapped here (another driver's fd).
    IpcImportFd,
    /// `reduce_async`: a reduction step fails to enqueue (a kernel launch refused).
    Reduce,
    /// Not a failing call: the adaptor claims no reduction types at all
    /// (`Capabilities::reduce_types` is 0), as a vendor without reduction kernels does.
    NoReduce,
    /// Not a failing call: `ipc_get_handle` refuses memory that was not allocated through
    /// this wrapper, as CUDA refuses `cudaMallocAsync` pool memory (`CUDA_ERROR_INVALID_VALUE`)
    /// — allocate a client's buffers through the wrapped adaptor to model such memory.
    ForeignNoHandle,
    /// Not a failing call ([`FaultyAdaptor::slow_at_gates`]): streams join at gates, emulated
    /// with host functions that block until opened (the capabilities claim `host_gates` and no
    /// stream memory operations, as OpenCL's), and every reduction step and device-to-device
    /// copy first waits on its stream — the step for the stall, the copy for a sixth of it. A
    /// gate is last on its stream while it is closed and nothing but events was enqueued
    /// through the wrapper behind it.
    SlowAtGates,
}

impl std::str::FromStr for FaultOp {
    type Err = AdaptorError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "h2d" => Ok(FaultOp::CopyH2D),
            "d2h" => Ok(FaultOp::CopyD2H),
            "d2d" => Ok(FaultOp::CopyD2D),
            "register" => Ok(FaultOp::Register),
            "event_query" => Ok(FaultOp::EventQuery),
            "stream_write" => Ok(FaultOp::StreamWrite),
            "stream_wait" => Ok(FaultOp::StreamWait),
            "ipc_open_mapped" => Ok(FaultOp::IpcOpenMapped),
            "alloc_shareable" => Ok(FaultOp::AllocShareable),
            "ipc_import_fd" => Ok(FaultOp::IpcImportFd),
            "reduce" => Ok(FaultOp::Reduce),
            "no_reduce" => Ok(FaultOp::NoReduce),
            "foreign_no_handle" => Ok(FaultOp::ForeignNoHandle),
            "slow_at_gates" => Ok(FaultOp::SlowAtGates),
            _ => Err(AdaptorError::invalid(
                "FaultOp",
                format!(
                    "{s:?}: expected h2d, d2h, d2d, register, event_query, stream_write, \
                     stream_wait, ipc_open_mapped, alloc_shareable, ipc_import_fd, reduce, \
                     no_reduce, foreign_no_handle or slow_at_gates"
                ),
            )),
        }
    }
}

/// The vendor code an injected failure carries.
pub const INJECTED_CODE: i64 = -999;

/// An adaptor whose `op` calls fail once after `after` successes; everything else passes through.
#[derive(Debug, Clone)]
pub struct FaultyAdaptor<A: DeviceAdaptor> {
    inner: A,
    op: FaultOp,
    left: Arc<AtomicIsize>,
    /// Where set, the chosen call blocks this long and then succeeds instead of failing: a
    /// runtime call that hangs (CUDA's, behind a lock another thread holds).
    stall: Option<std::time::Duration>,
    /// Bases of the allocations made through this wrapper (and its clones), for
    /// [`FaultOp::ForeignNoHandle`].
    own: Arc<std::sync::Mutex<std::collections::HashSet<u64>>>,
    /// The emulated gates of [`FaultOp::SlowAtGates`] (shared by clones).
    gates: Arc<Gates>,
}

/// Gates emulated with host functions ([`FaultOp::SlowAtGates`]).
#[derive(Debug, Default)]
struct Gates {
    state: std::sync::Mutex<GateState>,
    opened: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    next: u64,
    open: std::collections::HashSet<u64>,
    /// Per gate: its stream and that stream's count of enqueued commands right after it.
    at: std::collections::HashMap<u64, (u64, u64)>,
    /// Per stream: the commands enqueued through the wrapper.
    enqueued: std::collections::HashMap<u64, u64>,
}

/// How long an emulated gate's host function waits to be opened at most: a test that never
/// opens one fails with its stream released instead of hanging.
const GATE_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(60);

impl Gates {
    /// Counts a command enqueued on `stream`; returns the count.
    fn enqueued(&self, stream: StreamHandle) -> u64 {
        let mut st = crate::tracking::lock(&self.state);
        let c = st.enqueued.entry(stream.0).or_default();
        *c += 1;
        *c
    }

    /// Blocks (a host function on the gate's stream) until gate `id` is opened.
    fn wait_open(&self, id: u64) {
        let t0 = std::time::Instant::now();
        let mut st = crate::tracking::lock(&self.state);
        while !st.open.contains(&id) && t0.elapsed() < GATE_WAIT_MAX {
            st = match self.opened.wait_timeout(st, GATE_WAIT_MAX) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

impl<A: DeviceAdaptor> FaultyAdaptor<A> {
    /// Wraps `inner`; the `after + 1`-th `op` call fails.
    pub fn new(inner: A, op: FaultOp, after: usize) -> Self {
        FaultyAdaptor {
            inner,
            op,
            left: Arc::new(AtomicIsize::new(after as isize)),
            stall: None,
            own: Arc::default(),
            gates: Arc::default(),
        }
    }

    /// Wraps `inner` with [`FaultOp::SlowAtGates`]: streams join at emulated gates, and each
    /// reduction step waits `stall` on its stream before it runs (each device-to-device copy a
    /// sixth of it) — work beside a message that is still running when the message is done.
    pub fn slow_at_gates(inner: A, stall: std::time::Duration) -> Self {
        FaultyAdaptor {
            stall: Some(stall),
            ..FaultyAdaptor::new(inner, FaultOp::SlowAtGates, 0)
        }
    }

    /// Whether this wrapper emulates gates.
    fn gated(&self) -> bool {
        self.op == FaultOp::SlowAtGates
    }

    /// Counts a command enqueued on `stream` (for [`DeviceAdaptor::gate_is_last`]).
    fn enqueue(&self, stream: StreamHandle) {
        if self.gated() {
            self.gates.enqueued(stream);
        }
    }

    /// Where gated, makes `stream` wait `d` before its next command.
    fn delay(&self, stream: StreamHandle, d: std::time::Duration) -> Result<()> {
        if self.gated() {
            self.inner
                .launch_host_func(stream, Box::new(move || std::thread::sleep(d)))?;
        }
        Ok(())
    }

    /// Wraps `inner`; the `after + 1`-th `op` call blocks for `stall` and then goes through.
    /// [`FaultyAdaptor::fired`] is true from the moment it starts blocking.
    pub fn stalling(inner: A, op: FaultOp, after: usize, stall: std::time::Duration) -> Self {
        FaultyAdaptor {
            stall: Some(stall),
            ..FaultyAdaptor::new(inner, op, after)
        }
    }

    /// Re-arms the fault: the `after + 1`-th `op` call from now fails (shared by clones).
    pub fn arm(&self, after: usize) {
        self.left.store(after as isize, Ordering::Release);
    }

    /// Whether the fault has fired.
    pub fn fired(&self) -> bool {
        self.left.load(Ordering::Acquire) < 0
    }

    /// Notes an allocation made through the wrapper.
    fn owned(&self, r: Result<DevicePtr>) -> Result<DevicePtr> {
        if let Ok(p) = r {
            crate::tracking::lock(&self.own).insert(p.0);
        }
        r
    }

    fn check(&self, op: FaultOp, name: &'static str) -> Result<()> {
        if op == self.op && self.left.fetch_sub(1, Ordering::AcqRel) == 0 {
            if let Some(d) = self.stall {
                // A stalled call is marked as a GPU adaptor marks its driver calls, so a stall
                // guard watching this thread names it.
                let _in = crate::incall::enter(name);
                std::thread::sleep(d);
                return Ok(());
            }
            return Err(AdaptorError::Vendor {
                vendor: self.inner.vendor(),
                op: name,
                code: INJECTED_CODE,
                name: match op {
                    FaultOp::IpcOpenMapped => "CUDA_ERROR_ALREADY_MAPPED",
                    _ => "INJECTED_FAULT",
                }
                .into(),
            });
        }
        Ok(())
    }
}

impl<A: DeviceAdaptor> DeviceAdaptor for FaultyAdaptor<A> {
    fn vendor(&self) -> Vendor {
        self.inner.vendor()
    }
    fn device(&self) -> usize {
        self.inner.device()
    }
    fn device_count(&self) -> Result<usize> {
        self.inner.device_count()
    }
    fn properties(&self, index: usize) -> Result<DeviceProperties> {
        self.inner.properties(index)
    }
    fn capabilities(&self) -> Capabilities {
        let mut c = self.inner.capabilities();
        if self.op == FaultOp::NoReduce {
            c.reduce_types = 0;
        }
        if self.gated() {
            c.host_gates = true;
            c.stream_mem_ops = false;
            c.stream_mem_ops_64 = false;
        }
        c
    }
    fn mem_alloc(&self, size: usize) -> Result<DevicePtr> {
        self.owned(self.inner.mem_alloc(size))
    }
    fn mem_alloc_shareable(&self, size: usize) -> Result<DevicePtr> {
        self.owned(self.inner.mem_alloc_shareable(size))
    }
    fn mem_alloc_shareable_on(&self, size: usize, device: usize) -> Result<DevicePtr> {
        self.check(FaultOp::AllocShareable, "mem_alloc_shareable_on")?;
        self.owned(self.inner.mem_alloc_shareable_on(size, device))
    }
    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.mem_free(ptr) }
    }
    fn mem_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        self.inner.mem_get_range(ptr)
    }
    fn mem_buffer_id(&self, ptr: DevicePtr) -> Result<Option<u64>> {
        self.inner.mem_buffer_id(ptr)
    }
    fn host_alloc(&self, size: usize) -> Result<*mut u8> {
        self.inner.host_alloc(size)
    }
    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.host_free(ptr) }
    }
    unsafe fn host_register(&self, ptr: *mut u8, size: usize) -> Result<DevicePtr> {
        self.check(FaultOp::Register, "host_register")?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.host_register(ptr, size) }
    }
    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.host_unregister(ptr) }
    }
    unsafe fn host_pin(&self, ptr: *mut u8, size: usize) -> Result<()> {
        // Pinning is how the p2p layer registers rings and mapped buffers: the same fault.
        self.check(FaultOp::Register, "host_pin")?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.host_pin(ptr, size) }
    }
    unsafe fn host_unpin(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.host_unpin(ptr) }
    }
    unsafe fn memcpy_h2d_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.enqueue(stream);
        self.check(FaultOp::CopyH2D, "memcpy_h2d_async")?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.memcpy_h2d_async(dst, src, n, stream) }
    }
    unsafe fn memcpy_d2h_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.enqueue(stream);
        self.check(FaultOp::CopyD2H, "memcpy_d2h_async")?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.memcpy_d2h_async(dst, src, n, stream) }
    }
    unsafe fn memcpy_d2d_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.enqueue(stream);
        if let Some(d) = self.stall.filter(|_| self.gated()) {
            self.delay(stream, d / 6)?;
        }
        self.check(FaultOp::CopyD2D, "memcpy_d2d_async")?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.memcpy_d2d_async(dst, src, n, stream) }
    }
    unsafe fn memcpy_sized_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len_at: DevicePtr,
        cap: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.enqueue(stream);
        self.check(FaultOp::CopyH2D, "memcpy_sized_async")?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.memcpy_sized_async(dst, src, len_at, cap, stream) }
    }
    unsafe fn memset_async(
        &self,
        dst: DevicePtr,
        value: u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        self.enqueue(stream);
        // SAFETY: forwarded contract.
        unsafe { self.inner.memset_async(dst, value, n, stream) }
    }
    unsafe fn reduce_async(
        &self,
        dst: DevicePtr,
        a_: DevicePtr,
        b: DevicePtr,
        count: usize,
        dtype: crate::reduce::DataType,
        step: crate::reduce::ReduceStep,
        stream: StreamHandle,
    ) -> Result<()> {
        self.enqueue(stream);
        if let Some(d) = self.stall.filter(|_| self.gated()) {
            self.delay(stream, d)?;
        }
        if self.op == FaultOp::NoReduce {
            return Err(AdaptorError::Unsupported {
                vendor: self.inner.vendor(),
                op: "reduce_async",
            });
        }
        self.check(FaultOp::Reduce, "reduce_async")?;
        // SAFETY: forwarded contract.
        unsafe {
            self.inner
                .reduce_async(dst, a_, b, count, dtype, step, stream)
        }
    }
    fn stream_create(&self) -> Result<StreamHandle> {
        self.inner.stream_create()
    }
    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        self.inner.stream_destroy(stream)
    }
    unsafe fn stream_adopt(&self, native: u64) -> Result<StreamHandle> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.stream_adopt(native) }
    }
    fn stream_release(&self, stream: StreamHandle) -> Result<()> {
        self.enqueue(stream);
        self.inner.stream_release(stream)
    }
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        self.inner.stream_synchronize(stream)
    }
    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        self.inner.stream_query(stream)
    }
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.enqueue(stream);
        self.inner.stream_wait_event(stream, event)
    }
    fn event_create(&self, timing: bool) -> Result<EventHandle> {
        self.inner.event_create(timing)
    }
    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.inner.event_destroy(event)
    }
    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        // Not counted: where streams have gates an event enqueues nothing behind them
        // (`gate_is_last`).
        self.inner.event_record(event, stream)
    }
    fn event_query(&self, event: EventHandle) -> Result<bool> {
        self.check(FaultOp::EventQuery, "event_query")?;
        self.inner.event_query(event)
    }
    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        self.inner.event_synchronize(event)
    }
    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32> {
        self.inner.event_elapsed_ms(start, end)
    }
    fn ipc_get_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        if self.op == FaultOp::ForeignNoHandle {
            let (base, _) = self.inner.mem_get_range(ptr)?;
            if !crate::tracking::lock(&self.own).contains(&base.0) {
                return Err(AdaptorError::Vendor {
                    vendor: self.inner.vendor(),
                    op: "ipc_get_handle",
                    code: INJECTED_CODE,
                    name: "CUDA_ERROR_INVALID_VALUE".into(),
                });
            }
        }
        self.inner.ipc_get_handle(ptr)
    }
    fn ipc_open_handle(&self, handle: &IpcMemHandle) -> Result<DevicePtr> {
        self.check(FaultOp::IpcOpenMapped, "ipc_open_handle")?;
        self.inner.ipc_open_handle(handle)
    }
    fn ipc_export_fd(&self, ptr: DevicePtr) -> Result<IpcFdHandle> {
        self.inner.ipc_export_fd(ptr)
    }
    fn ipc_import_fd(&self, handle: &IpcFdHandle) -> Result<DevicePtr> {
        self.check(FaultOp::IpcImportFd, "ipc_import_fd")?;
        self.inner.ipc_import_fd(handle)
    }
    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.inner.ipc_close(ptr) }
    }
    fn can_access_peer(&self, peer: usize) -> Result<bool> {
        self.inner.can_access_peer(peer)
    }
    fn enable_peer_access(&self, peer: usize) -> Result<()> {
        self.inner.enable_peer_access(peer)
    }
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        self.inner.exchange_capture_mode(mode)
    }
    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        self.enqueue(stream);
        self.inner.launch_host_func(stream, f)
    }
    fn stream_gate(&self, stream: StreamHandle) -> Result<GateHandle> {
        if !self.gated() {
            return self.inner.stream_gate(stream);
        }
        let id = {
            let mut st = crate::tracking::lock(&self.gates.state);
            st.next += 1;
            st.next
        };
        let gates = self.gates.clone();
        self.inner
            .launch_host_func(stream, Box::new(move || gates.wait_open(id)))?;
        let c = self.gates.enqueued(stream);
        crate::tracking::lock(&self.gates.state)
            .at
            .insert(id, (stream.0, c));
        Ok(GateHandle(id))
    }
    fn gate_open(&self, gate: GateHandle) -> Result<()> {
        if !self.gated() {
            return self.inner.gate_open(gate);
        }
        crate::tracking::lock(&self.gates.state).open.insert(gate.0);
        self.gates.opened.notify_all();
        Ok(())
    }
    fn gate_is_last(&self, gate: GateHandle) -> Result<bool> {
        if !self.gated() {
            return self.inner.gate_is_last(gate);
        }
        let st = crate::tracking::lock(&self.gates.state);
        Ok(match st.at.get(&gate.0) {
            Some(&(stream, c)) => {
                !st.open.contains(&gate.0) && st.enqueued.get(&stream) == Some(&c)
            }
            None => false,
        })
    }
    unsafe fn stream_wait_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
        cond: WaitCondition,
    ) -> Result<()> {
        self.enqueue(stream);
        self.check(FaultOp::StreamWait, "stream_wait_value32")?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.stream_wait_value32(stream, addr, value, cond) }
    }
    unsafe fn stream_wait_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
        cond: WaitCondition,
    ) -> Result<()> {
        self.enqueue(stream);
        self.check(FaultOp::StreamWait, "stream_wait_value64")?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.stream_wait_value64(stream, addr, value, cond) }
    }
    unsafe fn stream_write_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<()> {
        self.enqueue(stream);
        self.check(FaultOp::StreamWrite, "stream_write_value32")?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.stream_write_value32(stream, addr, value) }
    }
    unsafe fn host_write_value32(&self, host: *mut u32, value: u32) {
        // SAFETY: forwarded contract.
        unsafe { self.inner.host_write_value32(host, value) }
    }
    unsafe fn stream_write_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()> {
        self.enqueue(stream);
        self.check(FaultOp::StreamWrite, "stream_write_value64")?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.stream_write_value64(stream, addr, value) }
    }
    unsafe fn stream_write_values64(
        &self,
        stream: StreamHandle,
        writes: &[(DevicePtr, u64)],
    ) -> Result<()> {
        self.enqueue(stream);
        self.check(FaultOp::StreamWrite, "stream_write_values64")?;
        // SAFETY: forwarded contract.
        unsafe { self.inner.stream_write_values64(stream, writes) }
    }
    unsafe fn stream_slot_steps(
        &self,
        stream: StreamHandle,
        steps: &[crate::SlotStep],
    ) -> Result<()> {
        self.enqueue(stream);
        // The faults of the operations a call stands for: waits, a put's copy and writes.
        const OP: &str = "stream_slot_steps";
        for step in steps {
            match step {
                crate::SlotStep::Put { wait, len, .. } => {
                    if wait.is_some() {
                        self.check(FaultOp::StreamWait, OP)?;
                    }
                    if *len > 0 {
                        self.check(FaultOp::CopyD2H, OP)?;
                    }
                    self.check(FaultOp::StreamWrite, OP)?;
                }
                crate::SlotStep::Take { .. } => self.check(FaultOp::StreamWait, OP)?,
            }
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.stream_slot_steps(stream, steps) }
    }
}
