//! `flagcx-opencl`: the flagcx-rs adaptor contract on OpenCL, through `cl3` and the ICD loader.
//!
//! It gives CI a second real runtime (PoCL's CPU device) and so real heterogeneous pairs without
//! a GPU. The contract maps honestly:
//!
//! - **Device memory** is `cl_mem` buffers. OpenCL has no device addresses, so each buffer gets a
//!   range of a synthetic address space (in the non-canonical upper half, so it can never be
//!   mistaken for a host pointer); a [`DevicePtr`] inside it resolves to (buffer, offset).
//! - **Streams** are in-order command queues. A recorded **event** holds the `cl_event` of the
//!   queue's last command at record time (in order, it completes exactly when everything
//!   recorded before it has), so recording enqueues nothing; only events created for timing
//!   get a marker of their own, whose profiling gives elapsed time.
//! - **Host functions** keep stream order with a user event and a barrier on it: the adaptor's
//!   host-function thread polls the queue's last earlier command, runs the function and then
//!   opens the barrier (completion callbacks came 16–25 ms late on NVIDIA's platform). A host
//!   function and the event recorded behind it are thus one command, where they were three
//!   (each command costs 5–6 µs on NVIDIA's platform and ~20 µs on PoCL's before the next can
//!   run: `benches/probes/ocl_join.c`).
//! - **Gates** ([`DeviceAdaptor::stream_gate`]): a barrier on a user event that the caller
//!   sets from any thread ([`DeviceAdaptor::gate_open`]), with no host-function thread in
//!   between: what the p2p layer joins OpenCL streams with, opened by whoever publishes an
//!   operation's completion. Gates still closed when the adaptor goes are opened first.
//! - **Large copies on CPU devices** (module `split`): cut into parts that run at once on
//!   helper queues of their stream, since PoCL copies each command with one worker thread.
//! - **Pinning** ([`DeviceAdaptor::host_pin`]): a `CL_MEM_USE_HOST_PTR` buffer wraps the range
//!   and is never used, which makes NVIDIA's platform pin it, so raw-pointer copies of staging
//!   rings run at pinned speed.
//! - **Another runtime's memory** ([`DeviceAdaptor::ipc_import_fd`], where the device has
//!   `cl_khr_external_memory_opaque_fd`): an fd another runtime exported becomes a buffer here
//!   (NVIDIA's platform maps CUDA's exports; module `extmem`), closed with `ipc_close`.
//! - **Unsupported**, and reported so in [`Capabilities`]: exporting IPC handles (no standard
//!   extension shares buffers between processes), host registration (a `USE_HOST_PTR` buffer is only
//!   coherent at map/unmap, so no device alias can be promised), peer access, stream memory
//!   operations and capture modes.

// tidy: long file: the whole DeviceAdaptor over cl3, with its synthetic address space for buffers.

#![deny(unsafe_op_in_unsafe_fn)]

mod extmem;
mod reduce;
mod split;

use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cl3::types::{cl_command_queue, cl_context, cl_device_id, cl_event, cl_int, cl_mem};
use flagcx_adaptor::tracking::{lock, HandleSet, RangeMap};
use flagcx_adaptor::{
    AdaptorError, Capabilities, CaptureMode, DeviceAdaptor, DeviceProperties, DevicePtr,
    EventHandle, GateHandle, HostFn, IpcFdHandle, IpcMemHandle, Result, StreamHandle, Vendor,
    WaitCondition,
};

const VENDOR: Vendor = Vendor::OpenCl;
/// Synthetic device addresses start here (non-canonical on x86-64 and AArch64).
const VA_BASE: u64 = 0xC100_0000_0000_0000;
/// Gap between buffers, so running off one never lands in the next.
const VA_GUARD: u64 = 1 << 20;
const CL_COMPLETE: cl_int = 0;
/// Where in a buffer the runtime's fill stops and the adaptor's own kernel (64-bit offsets)
/// takes over. On NVIDIA's platform (H100, the GPU bundle's conformance runs of 2026-12-07) a
/// fill reaching past 2 GiB broke the context: one fill of 2 GiB + 5 B ended in -9999, and the
/// same bytes in 1 GiB parts in `CL_INVALID_COMMAND_QUEUE`; every context the process created
/// after either failed with -9999. The runtime keeps the first gibibyte of every buffer (all of
/// every buffer CI's jobs fill, but for the conformance case that crosses it). With the kernel
/// past it, the same H100's OpenCL conformance run passed every case, the 2^31-element
/// reduction and `fills_past_one_gibibyte` among them (2026-12-08, `1285fa9`).
const FILL_RUNTIME_END: usize = 1 << 30;

/// How many of the `n` bytes at offset `off` of a buffer the runtime's fill writes (those
/// below [`FILL_RUNTIME_END`]); the kernel writes the rest.
fn runtime_fill_len(off: usize, n: usize) -> usize {
    FILL_RUNTIME_END.saturating_sub(off).min(n)
}

fn cl_error(op: &'static str, code: cl_int) -> AdaptorError {
    AdaptorError::Vendor {
        vendor: VENDOR,
        op,
        code: code as i64,
        name: cl3::error_codes::error_text(code).to_string(),
    }
}

/// OpenCL object handles are thread-safe by the specification (all but kernel arguments), so the
/// raw pointers may be shared.
#[derive(Debug, Clone, Copy)]
struct Raw<T>(T);
// SAFETY: see the type's documentation.
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Raw<T> {}

/// A gate not yet opened: its user event, the barrier waiting on it, and its stream.
#[derive(Debug)]
struct Gate {
    event: Raw<cl_event>,
    barrier: Raw<cl_event>,
    stream: u64,
}

/// A command queue and the event of the last command enqueued on it (in-order, so that
/// command's completion means the queue is idle), and the queues that run parts of its large
/// copies beside it (module `split`; created on first use).
#[derive(Debug)]
struct Queue {
    q: Raw<cl_command_queue>,
    last: Option<Raw<cl_event>>,
    helpers: Vec<Raw<cl_command_queue>>,
}

impl Queue {
    /// Releases the queue, its last command's reference and its helpers. OpenCL finishes
    /// their enqueued work before freeing them.
    fn release(self) -> std::result::Result<(), cl_int> {
        let _ = cl3::command_queue::flush(self.q.0);
        if let Some(e) = self.last {
            release(e.0);
        }
        for h in self.helpers {
            // SAFETY: untracked now; a helper is released once, here.
            let _ = unsafe { cl3::command_queue::release_command_queue(h.0) };
        }
        // SAFETY: as above.
        unsafe { cl3::command_queue::release_command_queue(self.q.0) }.map(|_| ())
    }
}

/// A pinned host range: the `CL_MEM_USE_HOST_PTR` buffer wrapping it, kept mapped (mapping is
/// what makes NVIDIA's platform page-lock it) through the queue that mapped it. The buffer's
/// contents are never used.
struct Pin {
    mem: Raw<cl_mem>,
    queue: Raw<cl_command_queue>,
    mapped: *mut c_void,
}

// SAFETY: plain OpenCL handles (thread-safe objects) and the address they map, only passed back
// to OpenCL.
unsafe impl Send for Pin {}

impl Pin {
    /// Unmaps and releases everything, waiting for the unmap.
    ///
    /// # Safety
    /// No copy may still use the range.
    unsafe fn release(self) -> std::result::Result<(), cl_int> {
        // SAFETY: our live objects; the mapping was made through this queue.
        unsafe {
            let unmapped = cl3::command_queue::enqueue_unmap_mem_object(
                self.queue.0,
                self.mem.0,
                self.mapped,
                0,
                std::ptr::null(),
            );
            if let Ok(ev) = unmapped {
                release(ev);
            }
            let finished = cl3::command_queue::finish(self.queue.0);
            let _ = cl3::command_queue::release_command_queue(self.queue.0);
            let released = cl3::memory::release_mem_object(self.mem.0);
            unmapped.and(finished).and(released).map(|_| ())
        }
    }
}

/// One OpenCL device. Cheap to clone.
#[derive(Clone)]
pub struct OpenClAdaptor {
    inner: Arc<Inner>,
}

struct Inner {
    device: usize,
    count: usize,
    id: Raw<cl_device_id>,
    context: Raw<cl_context>,
    name: String,
    total_memory: u64,
    max_alloc: u64,
    next_va: AtomicU64,
    buffers: Mutex<RangeMap<Raw<cl_mem>>>,
    /// Whether the device imports other runtimes' fds (`extmem::supported`).
    fd_import: bool,
    /// Whether `stream_synchronize` polls the queue's last command before `clFinish`
    /// (see [`SyncMode`]).
    poll_sync: bool,
    /// How many parts a large copy may be cut into (module `split`).
    copy_parts: usize,
    /// The buffers of `buffers` that are imports (`ipc_import_fd`), by synthetic address.
    imported: Mutex<HashSet<u64>>,
    pinned: Mutex<HashMap<u64, usize>>,
    /// Host ranges made fast to copy ([`DeviceAdaptor::host_pin`]), by start address.
    host_pins: Mutex<HashMap<u64, Pin>>,
    streams: HandleSet,
    queues: Mutex<HashMap<u64, Queue>>,
    events: HandleSet,
    /// The events created for timing: each recording enqueues a marker of its own.
    timed: HandleSet,
    /// Each gate not yet opened (see `stream_gate`).
    gates: Mutex<HashMap<u64, Gate>>,
    /// The `cl_event` of each event's last recording (see `event_record`).
    recorded: Mutex<HashMap<u64, Raw<cl_event>>>,
    next_handle: AtomicU64,
    /// Hands host functions to their thread (see `spawn_host_fn_thread`).
    host_fns: Mutex<std::sync::mpsc::Sender<HostCall>>,
    /// The element types this device reduces exactly (`reduce::claimed_types`).
    reduce_types: u16,
    /// The reduction kernel, built at the first reduction.
    reducer: reduce::Reducer,
}

impl std::fmt::Debug for OpenClAdaptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenClAdaptor")
            .field("device", &self.inner.device)
            .field("name", &self.inner.name)
            .finish()
    }
}

fn unavailable(reason: impl Into<String>) -> AdaptorError {
    AdaptorError::Unavailable {
        vendor: VENDOR,
        reason: reason.into(),
    }
}

/// Every device of every platform, in platform order, discovered once per process.
///
/// Discovery runs under a lock: ICD loaders (ocl-icd) and platforms initialise lazily and are
/// not safe to initialise from several threads at once — concurrent first calls crashed PoCL
/// here (a NULL `strlen` inside the loader).
fn all_devices() -> Result<Vec<cl_device_id>> {
    static DISCOVERY: Mutex<Option<Vec<Raw<cl_device_id>>>> = Mutex::new(None);
    let mut found = lock(&DISCOVERY);
    if let Some(d) = found.as_ref() {
        return Ok(d.iter().map(|r| r.0).collect());
    }
    let devices = discover()?;
    *found = Some(devices.iter().map(|&d| Raw(d)).collect());
    Ok(devices)
}

fn discover() -> Result<Vec<cl_device_id>> {
    if !cl3::is_opencl_runtime_available() {
        return Err(unavailable(
            "libOpenCL.so (the OpenCL ICD loader) was not found; install ocl-icd-libopencl1 \
             and a platform such as pocl-opencl-icd",
        ));
    }
    let platforms = match cl3::platform::get_platform_ids() {
        Ok(p) => p,
        Err(code) => {
            return Err(unavailable(format!(
                "no OpenCL platform ({}); install one, e.g. pocl-opencl-icd",
                cl3::error_codes::error_text(code)
            )))
        }
    };
    let mut devices = Vec::new();
    for p in platforms {
        if let Ok(d) = cl3::device::get_device_ids(p, cl3::device::CL_DEVICE_TYPE_ALL) {
            devices.extend(d);
        }
    }
    if devices.is_empty() {
        return Err(unavailable("the OpenCL platforms report no devices"));
    }
    Ok(devices)
}

fn info_u64(dev: cl_device_id, param: u32) -> Result<u64> {
    let v = cl3::device::get_device_info(dev, param).map_err(|c| cl_error("clGetDeviceInfo", c))?;
    Ok(match v {
        cl3::info_type::InfoType::Ulong(x) => x,
        cl3::info_type::InfoType::Size(x) => x as u64,
        cl3::info_type::InfoType::Uint(x) => x as u64,
        _ => 0,
    })
}

fn info_string(dev: cl_device_id, param: u32) -> Result<String> {
    let v = cl3::device::get_device_info(dev, param).map_err(|c| cl_error("clGetDeviceInfo", c))?;
    Ok(match v {
        cl3::info_type::InfoType::VecUchar(b) => String::from_utf8_lossy(&b)
            .trim_end_matches('\0')
            .trim()
            .to_string(),
        other => format!("{other:?}"),
    })
}

impl OpenClAdaptor {
    /// Opens OpenCL device `device` (counting the devices of all platforms in order).
    pub fn open(device: usize) -> Result<Self> {
        // Platforms initialise device state lazily and not thread-safely (PoCL 3.1 crashed in
        // clGetDeviceInfo when two threads opened at once), so opening is serial.
        static OPEN: Mutex<()> = Mutex::new(());
        let _serial = lock(&OPEN);
        let devices = all_devices()?;
        let count = devices.len();
        let Some(&id) = devices.get(device) else {
            return Err(AdaptorError::InvalidDevice {
                vendor: VENDOR,
                index: device,
                count,
            });
        };
        let context =
            cl3::context::create_context(&[id], std::ptr::null(), None, std::ptr::null_mut())
                .map_err(|c| cl_error("clCreateContext", c))?;
        Ok(OpenClAdaptor {
            inner: Arc::new(Inner {
                device,
                count,
                id: Raw(id),
                context: Raw(context),
                name: info_string(id, cl3::device::CL_DEVICE_NAME)?,
                total_memory: info_u64(id, cl3::device::CL_DEVICE_GLOBAL_MEM_SIZE)?,
                max_alloc: info_u64(id, cl3::device::CL_DEVICE_MAX_MEM_ALLOC_SIZE)?,
                next_va: AtomicU64::new(VA_BASE),
                buffers: Mutex::default(),
                fd_import: extmem::supported(id),
                poll_sync: SyncMode::from_env()?.polls(info_u64(id, cl3::device::CL_DEVICE_TYPE)?),
                copy_parts: split::max_parts(
                    std::env::var("FLAGCX_OPENCL_COPY_PARTS").ok().as_deref(),
                    info_u64(id, cl3::device::CL_DEVICE_TYPE)?,
                    info_u64(id, cl3::device::CL_DEVICE_MAX_COMPUTE_UNITS)?,
                    std::thread::available_parallelism().map_or(1, |n| n.get()),
                )?,
                imported: Mutex::default(),
                pinned: Mutex::default(),
                host_pins: Mutex::default(),
                streams: HandleSet::new("stream"),
                queues: Mutex::default(),
                events: HandleSet::new("event"),
                timed: HandleSet::new("timed event"),
                gates: Mutex::default(),
                recorded: Mutex::default(),
                next_handle: AtomicU64::new(0x10_0000),
                host_fns: Mutex::new(spawn_host_fn_thread()?),
                reduce_types: reduce::claimed_types(id),
                reducer: reduce::Reducer::default(),
            }),
        })
    }

    fn queue(&self, s: StreamHandle) -> Result<cl_command_queue> {
        self.inner.streams.check(s.0)?;
        lock(&self.inner.queues)
            .get(&s.0)
            .map(|q| q.q.0)
            .ok_or(AdaptorError::InvalidHandle {
                kind: "stream",
                value: s.0,
            })
    }

    /// A new reference to the queue's last command, taken under the lock that guards its
    /// release (`None`: nothing was ever enqueued, or the stream is unknown). A failed retain
    /// is an error, never `None`: that would pass for "nothing to wait for".
    fn retain_last(&self, stream: StreamHandle) -> Result<Option<Raw<cl_event>>> {
        let queues = lock(&self.inner.queues);
        let Some(last) = queues.get(&stream.0).and_then(|q| q.last) else {
            return Ok(None);
        };
        // SAFETY: `last` is live: the queue holds a reference, released only under this lock.
        unsafe { cl3::event::retain_event(last.0) }.map_err(|c| cl_error("clRetainEvent", c))?;
        Ok(Some(last))
    }

    /// A user event and a barrier on it, enqueued (and flushed) on `stream`: later work waits
    /// until the event is set. The caller owns the returned references, to the event (which it
    /// sets) and to the barrier (to compare with the queue's last command, see `gate_is_last`).
    fn enqueue_gate(&self, stream: StreamHandle) -> Result<(Raw<cl_event>, Raw<cl_event>)> {
        let q = self.queue(stream)?;
        let gate = cl3::event::create_user_event(self.inner.context.0)
            .map_err(|c| cl_error("clCreateUserEvent", c))?;
        // SAFETY: a live queue; the wait list is the one live user event.
        let barrier = unsafe { cl3::command_queue::enqueue_barrier_with_wait_list(q, 1, &gate) };
        let b = match barrier {
            Ok(b) => b,
            Err(c) => {
                // No command waits on the event: releasing it is all.
                release(gate);
                return Err(cl_error("clEnqueueBarrierWithWaitList", c));
            }
        };
        // The caller's reference is taken before the queue's own one can be released.
        // SAFETY: a live event just returned by the enqueue.
        let kept = unsafe { cl3::event::retain_event(b) };
        self.enqueued("clEnqueueBarrierWithWaitList", stream, Ok(b))?;
        if let Err(c) = kept {
            // The barrier is enqueued, and nothing may wait at a gate no one can open.
            let _ = cl3::event::set_user_event_status(gate, CL_COMPLETE);
            release(gate);
            return Err(cl_error("clRetainEvent", c));
        }
        Ok((Raw(gate), Raw(b)))
    }

    /// Keeps `ev` (from an enqueue on `stream`) as the queue's last command.
    fn enqueued(
        &self,
        op: &'static str,
        stream: StreamHandle,
        r: std::result::Result<cl_event, cl_int>,
    ) -> Result<()> {
        let ev = r.map_err(|c| cl_error(op, c))?;
        match lock(&self.inner.queues).get_mut(&stream.0) {
            Some(q) => {
                if let Some(old) = q.last.replace(Raw(ev)) {
                    release(old.0);
                }
                // Submit now, as a CUDA stream would: polling an event does not flush, and
                // NVIDIA's platform held small (≤ 4 KiB) writes back until something did —
                // ~18 ms per message on an H200 host.
                let _ = cl3::command_queue::flush(q.q.0);
            }
            None => release(ev),
        }
        Ok(())
    }

    /// [`Self::retain_last`], released when dropped.
    fn last_command(&self, stream: StreamHandle) -> Result<Option<Retained>> {
        Ok(self.retain_last(stream)?.map(|e| Retained(e.0)))
    }

    /// The buffer and offset behind `[ptr, ptr+n)`, which must lie inside one buffer.
    fn resolve(&self, op: &'static str, ptr: DevicePtr, n: usize) -> Result<(cl_mem, usize)> {
        let map = lock(&self.inner.buffers);
        let (base, mem) = map.check(op, ptr.0, n)?;
        Ok((mem.0, (ptr.0 - base) as usize))
    }

    /// Gives buffer `mem` of `size` bytes a range of the synthetic address space.
    fn place(&self, op: &'static str, mem: cl_mem, size: usize) -> Result<DevicePtr> {
        let span = (size as u64).next_multiple_of(VA_GUARD) + VA_GUARD;
        let va = self.inner.next_va.fetch_add(span, Ordering::Relaxed);
        lock(&self.inner.buffers).insert(op, va, size, Raw(mem))?;
        Ok(DevicePtr(va))
    }

    fn unsupported<T>(op: &'static str) -> Result<T> {
        Err(AdaptorError::Unsupported { vendor: VENDOR, op })
    }

    fn check_device(&self, index: usize) -> Result<()> {
        AdaptorError::check_device(VENDOR, index, self.inner.count)
    }
}

/// The device's PCI address in CUDA's form (`0000:19:00.0`), from `cl_khr_pci_bus_info` or
/// NVIDIA's attribute query; `None` for devices without one (CPU devices such as PoCL's).
fn pci_bus_id(id: cl_device_id) -> Option<String> {
    let words = |param| -> Option<Vec<u32>> {
        let b = cl3::device::get_device_data(id, param).ok()?;
        Some(
            b.chunks_exact(4)
                .map(|w| u32::from_ne_bytes(w.try_into().expect("4 bytes")))
                .collect(),
        )
    };
    const KHR_BUS_INFO: u32 = 0x410F;
    const NV_BUS: u32 = 0x4008;
    const NV_SLOT: u32 = 0x4009;
    const NV_DOMAIN: u32 = 0x400A;
    let (domain, bus, dev, func) = match words(KHR_BUS_INFO).as_deref() {
        Some([d, b, v, f, ..]) => (*d, *b, *v, *f),
        _ => {
            let bus = *words(NV_BUS)?.first()?;
            let slot = *words(NV_SLOT)?.first()?;
            let domain = words(NV_DOMAIN)
                .and_then(|w| w.first().copied())
                .unwrap_or(0);
            (domain, bus, slot >> 3, slot & 7)
        }
    };
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// Releases an event returned by an enqueue call we do not need to track.
fn release(ev: cl_event) {
    // SAFETY: `ev` is a live event the caller owns one reference to.
    let _ = unsafe { cl3::event::release_event(ev) };
}

/// A wait list for an enqueue: null where it is empty, as OpenCL requires.
fn wait_list(events: &[cl_event]) -> *const cl_event {
    if events.is_empty() {
        std::ptr::null()
    } else {
        events.as_ptr()
    }
}

/// An event reference this value owns (see `OpenClAdaptor::last_command`).
struct Retained(cl_event);

impl Retained {
    /// Whether the command completed (an error where it failed).
    fn complete(&self) -> Result<bool> {
        event_complete(self.0)
    }
}

impl Drop for Retained {
    fn drop(&mut self) {
        release(self.0);
    }
}

/// How long `stream_synchronize` polls before it blocks in `clFinish`: small copies finish
/// well inside it, long ones pay `clFinish`'s wake-up once.
const SYNC_POLL: std::time::Duration = std::time::Duration::from_micros(200);

/// How `stream_synchronize` waits (`FLAGCX_OPENCL_SYNC`): `poll` spins on the queue's last
/// command for up to [`SYNC_POLL`] before `clFinish`, `finish` calls `clFinish` at once;
/// `auto` (the default) polls on GPUs and accelerators and not on CPU devices, whose
/// runtimes (PoCL) run commands on the host's cores, which a poller would take from them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SyncMode {
    Auto,
    Poll,
    Finish,
}

impl SyncMode {
    /// The mode `FLAGCX_OPENCL_SYNC` names; an unknown value is an error naming it.
    fn from_env() -> Result<Self> {
        Self::parse(std::env::var("FLAGCX_OPENCL_SYNC").ok().as_deref())
    }

    fn parse(v: Option<&str>) -> Result<Self> {
        match v.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
            None | Some("" | "auto") => Ok(SyncMode::Auto),
            Some("poll") => Ok(SyncMode::Poll),
            Some("finish") => Ok(SyncMode::Finish),
            Some(_) => Err(AdaptorError::invalid(
                "FLAGCX_OPENCL_SYNC",
                "expected auto, poll or finish",
            )),
        }
    }

    /// Whether a device of `CL_DEVICE_TYPE` bits `kind` polls.
    fn polls(self, kind: u64) -> bool {
        match self {
            SyncMode::Poll => true,
            SyncMode::Finish => false,
            SyncMode::Auto => kind & cl3::device::CL_DEVICE_TYPE_CPU == 0,
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: no clone remains, so nothing can use these objects any more; each is released
        // exactly once.
        unsafe {
            // A gate left closed would hold its queue's finish below for ever.
            for (_, g) in lock(&self.gates).drain() {
                let _ = cl3::event::set_user_event_status(g.event.0, CL_COMPLETE);
                let _ = cl3::event::release_event(g.event.0);
                let _ = cl3::event::release_event(g.barrier.0);
            }
            for (_, q) in lock(&self.queues).drain() {
                let _ = cl3::command_queue::finish(q.q.0);
                let _ = q.release();
            }
            for (_, e) in lock(&self.recorded).drain() {
                let _ = cl3::event::release_event(e.0);
            }
            for (_, _, m) in lock(&self.buffers).drain() {
                let _ = cl3::memory::release_mem_object(m.0);
            }
            for (_, pin) in lock(&self.host_pins).drain() {
                let _ = pin.release();
            }
            for (p, len) in lock(&self.pinned).drain() {
                libc::munmap(p as *mut c_void, len);
            }
            let _ = cl3::context::release_context(self.context.0);
        }
    }
}

/// A host function waiting for its marker: the function, the marker (complete once earlier
/// work on the queue is), and the user event gating later work.
struct HostCall {
    f: HostFn,
    /// The queue's last command before the function (`None`: nothing was enqueued before).
    marker: Option<Raw<cl_event>>,
    gate: Raw<cl_event>,
}

impl HostCall {
    /// Whether the work before the function has finished (a failed command counts: the queue
    /// must not stay blocked).
    fn ready(&self) -> bool {
        self.marker
            .map_or(true, |m| event_complete(m.0).unwrap_or(true))
    }
}

/// Runs one host function, then opens the barrier holding later work on its queue.
fn run_host_call(call: HostCall) {
    let HostCall { f, marker, gate } = call;
    if let Some(m) = marker {
        release(m.0);
    }
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        eprintln!("flagcx-opencl: a host function panicked; the panic was contained");
    }
    let _ = cl3::event::set_user_event_status(gate.0, CL_COMPLETE);
    release(gate.0);
}

/// Starts the thread that runs host functions once their markers complete (one thread per
/// adaptor, as CUDA runs host functions on one driver thread).
///
/// It polls the markers rather than waiting for completion callbacks: NVIDIA's platform
/// delivered those 16–25 ms late on an H200 host, so a stream join (a host function that
/// waits for the communicator) cost that much per message. Polling spins briefly, then
/// yields, then naps 20 µs; the thread blocks on its queue when nothing is pending. The
/// function never runs on the thread that launches it (it may block).
fn spawn_host_fn_thread() -> Result<std::sync::mpsc::Sender<HostCall>> {
    let (tx, rx) = std::sync::mpsc::channel::<HostCall>();
    std::thread::Builder::new()
        .name("flagcx-opencl-hostfn".into())
        .spawn(move || {
            // Naps must stay short (see the p2p engine's run loop).
            // SAFETY: prctl on the calling thread with plain integer arguments.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
            let mut pending: std::collections::VecDeque<HostCall> = Default::default();
            let mut idle = 0u32;
            loop {
                if pending.is_empty() {
                    match rx.recv() {
                        Ok(c) => pending.push_back(c),
                        Err(_) => return,
                    }
                }
                while let Ok(c) = rx.try_recv() {
                    pending.push_back(c);
                }
                // Markers of one queue complete in order, and this scan keeps posting order.
                let mut ran = false;
                let mut i = 0;
                while i < pending.len() {
                    if pending[i].ready() {
                        if let Some(c) = pending.remove(i) {
                            run_host_call(c);
                        }
                        ran = true;
                    } else {
                        i += 1;
                    }
                }
                if ran {
                    idle = 0;
                } else {
                    idle = idle.saturating_add(1);
                    if idle < 64 {
                        std::hint::spin_loop();
                    } else if idle < 256 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(std::time::Duration::from_micros(20));
                    }
                }
            }
        })
        .map_err(|source| AdaptorError::Os {
            op: "spawn host-function thread",
            source,
        })?;
    Ok(tx)
}

impl DeviceAdaptor for OpenClAdaptor {
    fn vendor(&self) -> Vendor {
        VENDOR
    }

    fn device(&self) -> usize {
        self.inner.device
    }

    fn device_count(&self) -> Result<usize> {
        Ok(self.inner.count)
    }

    fn properties(&self, index: usize) -> Result<DeviceProperties> {
        self.check_device(index)?;
        let id = all_devices()?[index];
        let (name, total) = if index == self.inner.device {
            (self.inner.name.clone(), self.inner.total_memory)
        } else {
            (
                info_string(id, cl3::device::CL_DEVICE_NAME)?,
                info_u64(id, cl3::device::CL_DEVICE_GLOBAL_MEM_SIZE)?,
            )
        };
        Ok(DeviceProperties {
            vendor: VENDOR,
            index,
            name,
            pci_bus_id: pci_bus_id(id),
            total_memory: total,
        })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            host_functions: true,
            host_gates: true,
            host_pin: true,
            ipc_fd_foreign: self.inner.fd_import,
            reduce_types: self.inner.reduce_types,
            ..Capabilities::default()
        }
    }

    fn mem_alloc(&self, size: usize) -> Result<DevicePtr> {
        const OP: &str = "clCreateBuffer";
        if size == 0 {
            return Err(AdaptorError::invalid(OP, "zero-byte allocation"));
        }
        if size as u64 > self.inner.max_alloc {
            return Err(AdaptorError::OutOfMemory {
                vendor: VENDOR,
                device: self.inner.device,
                requested: size,
                code: None,
            });
        }
        // SAFETY: plain read-write flags and no host pointer.
        let mem = unsafe {
            cl3::memory::create_buffer(
                self.inner.context.0,
                cl3::memory::CL_MEM_READ_WRITE,
                size,
                std::ptr::null_mut(),
            )
        }
        .map_err(|c| cl_error(OP, c))?;
        self.place(OP, mem, size)
    }

    fn mem_alloc_shareable(&self, size: usize) -> Result<DevicePtr> {
        // No fd-shareable memory in OpenCL: plain buffers (ipc_export_fd says Unsupported).
        self.mem_alloc(size)
    }

    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        if lock(&self.inner.imported).contains(&ptr.0) {
            return Err(AdaptorError::invalid(
                "mem_free",
                format!(
                    "{ptr} is another runtime's memory (ipc_import_fd): close it with ipc_close"
                ),
            ));
        }
        let (_, mem) = lock(&self.inner.buffers).remove_if("mem_free", ptr.0, |_| true)?;
        // SAFETY: our buffer, now untracked; OpenCL keeps it alive for enqueued commands.
        unsafe { cl3::memory::release_mem_object(mem.0) }
            .map_err(|c| cl_error("clReleaseMemObject", c))
    }

    fn mem_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        match lock(&self.inner.buffers).find(ptr.0) {
            Some((base, len, _)) if !ptr.is_null() => Ok((DevicePtr(base), len)),
            _ => Err(AdaptorError::InvalidHandle {
                kind: "device pointer",
                value: ptr.0,
            }),
        }
    }

    fn host_alloc(&self, size: usize) -> Result<*mut u8> {
        if size == 0 {
            return Err(AdaptorError::invalid("host_alloc", "zero-byte allocation"));
        }
        // SAFETY: a fresh anonymous mapping; checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(AdaptorError::last_os("mmap"));
        }
        lock(&self.inner.pinned).insert(p as u64, size);
        Ok(p as *mut u8)
    }

    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()> {
        let len =
            lock(&self.inner.pinned)
                .remove(&(ptr as u64))
                .ok_or(AdaptorError::InvalidHandle {
                    kind: "host memory",
                    value: ptr as u64,
                })?;
        // SAFETY: our mapping of `len` bytes; the caller guarantees it is unused.
        unsafe { libc::munmap(ptr.cast(), len) };
        Ok(())
    }

    unsafe fn host_register(&self, _ptr: *mut u8, _size: usize) -> Result<DevicePtr> {
        Self::unsupported("host_register")
    }

    unsafe fn host_unregister(&self, _ptr: *mut u8) -> Result<()> {
        Self::unsupported("host_unregister")
    }

    /// Wraps the range in a `CL_MEM_USE_HOST_PTR` buffer and maps it (blocking), keeping both
    /// until unpinned: mapping is what makes NVIDIA's platform page-lock the range, after which
    /// reads and writes from raw pointers inside it run at pinned speed (55 GB/s against
    /// 8–16 GB/s pageable on an H200 host, `../shared/probes/ocl_pinned.c`). Coherence is not
    /// at stake: the buffer's own contents are never read or written.
    unsafe fn host_pin(&self, ptr: *mut u8, size: usize) -> Result<()> {
        const OP: &str = "clCreateBuffer(CL_MEM_USE_HOST_PTR)";
        if ptr.is_null() || size == 0 {
            return Err(AdaptorError::invalid(OP, "null pointer or zero size"));
        }
        let mut pins = lock(&self.inner.host_pins);
        if pins.contains_key(&(ptr as u64)) {
            return Err(AdaptorError::invalid(
                OP,
                format!("{ptr:p} is pinned already"),
            ));
        }
        // SAFETY: the caller guarantees `ptr..ptr+size` stays mapped until `host_unpin`, which
        // outlives the buffer (released there, or at teardown).
        let mem = unsafe {
            cl3::memory::create_buffer(
                self.inner.context.0,
                cl3::memory::CL_MEM_READ_WRITE | cl3::memory::CL_MEM_USE_HOST_PTR,
                size,
                ptr.cast(),
            )
        }
        .map_err(|c| cl_error(OP, c))?;
        // SAFETY: the device belongs to the context.
        #[allow(deprecated)]
        let queue = unsafe {
            cl3::command_queue::create_command_queue(self.inner.context.0, self.inner.id.0, 0)
        };
        let queue = match queue {
            Ok(q) => q,
            Err(c) => {
                // SAFETY: created above, never used.
                let _ = unsafe { cl3::memory::release_mem_object(mem) };
                return Err(cl_error("clCreateCommandQueue", c));
            }
        };
        let mut mapped: cl_mem = std::ptr::null_mut();
        // SAFETY: a blocking map of the whole buffer just made; `mapped` receives its address.
        let map = unsafe {
            cl3::command_queue::enqueue_map_buffer(
                queue,
                mem,
                cl3::types::CL_BLOCKING,
                cl3::memory::CL_MAP_READ | cl3::memory::CL_MAP_WRITE,
                0,
                size,
                &mut mapped,
                0,
                std::ptr::null(),
            )
        };
        let pin = Pin {
            mem: Raw(mem),
            queue: Raw(queue),
            mapped: mapped.cast(),
        };
        match map {
            Ok(ev) => release(ev),
            Err(c) => {
                // SAFETY: nothing uses the range through these objects.
                unsafe {
                    let _ = cl3::command_queue::release_command_queue(queue);
                    let _ = cl3::memory::release_mem_object(mem);
                }
                return Err(cl_error("clEnqueueMapBuffer", c));
            }
        }
        pins.insert(ptr as u64, pin);
        Ok(())
    }

    unsafe fn host_unpin(&self, ptr: *mut u8) -> Result<()> {
        let Some(pin) = lock(&self.inner.host_pins).remove(&(ptr as u64)) else {
            return Err(AdaptorError::invalid(
                "host_unpin",
                format!("{ptr:p} was not pinned by this adaptor"),
            ));
        };
        // SAFETY: the caller guarantees no copy uses the range any more.
        unsafe { pin.release() }.map_err(|c| cl_error("clEnqueueUnmapMemObject", c))
    }

    unsafe fn memcpy_h2d_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "clEnqueueWriteBuffer";
        self.queue(stream)?;
        if n == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(AdaptorError::invalid(OP, "null host source"));
        }
        let (mem, off) = self.resolve(OP, dst, n)?;
        self.copy_in_parts(OP, stream, n, &|q, at, len, wait| {
            // SAFETY: non-blocking write from `src + at`, which the caller keeps valid until
            // the queue passes it; `at + len <= n`, a range checked against the buffer; the
            // wait list holds live events.
            unsafe {
                cl3::command_queue::enqueue_write_buffer(
                    q,
                    mem,
                    cl3::types::CL_NON_BLOCKING,
                    off + at,
                    len,
                    src.add(at).cast(),
                    wait.len() as u32,
                    wait_list(wait),
                )
            }
        })
    }

    unsafe fn memcpy_d2h_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "clEnqueueReadBuffer";
        self.queue(stream)?;
        if n == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(AdaptorError::invalid(OP, "null host destination"));
        }
        let (mem, off) = self.resolve(OP, src, n)?;
        self.copy_in_parts(OP, stream, n, &|q, at, len, wait| {
            // SAFETY: as above, into `dst + at`.
            unsafe {
                cl3::command_queue::enqueue_read_buffer(
                    q,
                    mem,
                    cl3::types::CL_NON_BLOCKING,
                    off + at,
                    len,
                    dst.add(at).cast(),
                    wait.len() as u32,
                    wait_list(wait),
                )
            }
        })
    }

    unsafe fn memcpy_d2d_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "clEnqueueCopyBuffer";
        self.queue(stream)?;
        if n == 0 {
            return Ok(());
        }
        let (dmem, doff) = self.resolve(OP, dst, n)?;
        let (smem, soff) = self.resolve(OP, src, n)?;
        self.copy_in_parts(OP, stream, n, &|q, at, len, wait| {
            // SAFETY: both ranges were checked against live buffers (`at + len <= n`); the
            // wait list holds live events.
            unsafe {
                cl3::command_queue::enqueue_copy_buffer(
                    q,
                    smem,
                    dmem,
                    soff + at,
                    doff + at,
                    len,
                    wait.len() as u32,
                    wait_list(wait),
                )
            }
        })
    }

    unsafe fn reduce_async(
        &self,
        dst: DevicePtr,
        a: DevicePtr,
        b: DevicePtr,
        count: usize,
        dtype: flagcx_adaptor::DataType,
        step: flagcx_adaptor::ReduceStep,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "reduce_async";
        let types = self.inner.reduce_types;
        let bytes =
            flagcx_adaptor::reduce::check_operands(VENDOR, types, dst, a, b, count, dtype, step)?;
        let q = self.queue(stream)?;
        if bytes == 0 {
            return Ok(());
        }
        let combine = matches!(step, flagcx_adaptor::ReduceStep::Combine(_));
        let (d, x) = (self.resolve(OP, dst, bytes)?, self.resolve(OP, a, bytes)?);
        let y = if combine {
            self.resolve(OP, b, bytes)?
        } else {
            x
        };
        // SAFETY: the operands were resolved inside live buffers of this context; the caller
        // keeps them valid until the command completes.
        let r = unsafe {
            self.inner.reducer.enqueue(
                self.inner.context.0,
                self.inner.id.0,
                q,
                (d, x, y),
                count,
                dtype,
                step,
            )
        };
        self.enqueued("clEnqueueNDRangeKernel", stream, Ok(r?))
    }

    unsafe fn memset_async(
        &self,
        dst: DevicePtr,
        value: u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "clEnqueueFillBuffer";
        let q = self.queue(stream)?;
        if n == 0 {
            return Ok(());
        }
        let (mem, off) = self.resolve(OP, dst, n)?;
        let head = runtime_fill_len(off, n);
        if head > 0 {
            // SAFETY: a one-byte pattern the runtime copies at enqueue time; `head <= n` and
            // the whole range was checked against a live buffer.
            self.enqueued(OP, stream, unsafe {
                cl3::command_queue::enqueue_fill_buffer(
                    q,
                    mem,
                    (&value as *const u8).cast(),
                    1,
                    off,
                    head,
                    0,
                    std::ptr::null(),
                )
            })?;
        }
        if head < n {
            // SAFETY: as above; the queue is in order, so this follows the part before.
            let r = unsafe {
                self.inner.reducer.enqueue_fill(
                    self.inner.context.0,
                    self.inner.id.0,
                    q,
                    (mem, off + head),
                    n - head,
                    value,
                )
            };
            self.enqueued("clEnqueueNDRangeKernel", stream, Ok(r?))?;
        }
        Ok(())
    }

    fn stream_create(&self) -> Result<StreamHandle> {
        // SAFETY: the device belongs to the context.
        #[allow(deprecated)]
        let q = unsafe {
            cl3::command_queue::create_command_queue(
                self.inner.context.0,
                self.inner.id.0,
                cl3::command_queue::CL_QUEUE_PROFILING_ENABLE,
            )
        }
        .map_err(|c| cl_error("clCreateCommandQueue", c))?;
        let h = self.inner.next_handle.fetch_add(1, Ordering::Relaxed);
        lock(&self.inner.queues).insert(
            h,
            Queue {
                q: Raw(q),
                last: None,
                helpers: Vec::new(),
            },
        );
        self.inner.streams.insert(h);
        Ok(StreamHandle(h))
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        self.inner.streams.remove(stream.0)?;
        let q = lock(&self.inner.queues).remove(&stream.0);
        if let Some(q) = q {
            q.release()
                .map_err(|c| cl_error("clReleaseCommandQueue", c))?;
        }
        Ok(())
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        let q = self.queue(stream)?;
        if self.inner.poll_sync {
            // Commands are flushed as they are enqueued (`enqueued`); in order, the last one's
            // completion means the queue's work is done.
            if let Some(last) = self.last_command(stream)? {
                let t = std::time::Instant::now();
                loop {
                    if last.complete()? {
                        return Ok(());
                    }
                    if t.elapsed() >= SYNC_POLL {
                        break;
                    }
                    std::hint::spin_loop();
                }
            }
        }
        cl3::command_queue::finish(q).map_err(|c| cl_error("clFinish", c))
    }

    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        let q = self.queue(stream)?;
        let _ = cl3::command_queue::flush(q);
        // In order: the last command's completion means everything before it completed.
        match self.last_command(stream)? {
            None => Ok(true),
            Some(last) => last.complete(),
        }
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        let q = self.queue(stream)?;
        self.inner.events.check(event.0)?;
        let Some(ev) = lock(&self.inner.recorded).get(&event.0).copied() else {
            return Ok(()); // never recorded: nothing to wait for
        };
        // SAFETY: a live queue and a live event in the same context.
        self.enqueued("clEnqueueBarrierWithWaitList", stream, unsafe {
            cl3::command_queue::enqueue_barrier_with_wait_list(q, 1, &ev.0)
        })
    }

    fn event_create(&self, timing: bool) -> Result<EventHandle> {
        let h = self.inner.next_handle.fetch_add(1, Ordering::Relaxed);
        self.inner.events.insert(h);
        if timing {
            self.inner.timed.insert(h);
        }
        Ok(EventHandle(h))
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.inner.events.remove(event.0)?;
        let _ = self.inner.timed.remove(event.0);
        if let Some(ev) = lock(&self.inner.recorded).remove(&event.0) {
            release(ev.0);
        }
        Ok(())
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.inner.events.check(event.0)?;
        let q = self.queue(stream)?;
        let m = if self.inner.timed.check(event.0).is_ok() {
            // Timing needs a command of its own at this point: the last one may have finished
            // long ago, and its end would be the wrong time.
            // SAFETY: a live queue; no wait list.
            let m = unsafe {
                cl3::command_queue::enqueue_marker_with_wait_list(q, 0, std::ptr::null())
            }
            .map_err(|c| cl_error("clEnqueueMarkerWithWaitList", c))?;
            // The marker is both the event's recording and the queue's last command.
            // SAFETY: `m` is live; the extra reference is released by `enqueued`'s bookkeeping.
            let retained = unsafe { cl3::event::retain_event(m) }.map(|()| m);
            self.enqueued("clRetainEvent", stream, retained)?;
            Some(Raw(m))
        } else {
            // In order, the last command completes exactly when all work before this point
            // has: the recording needs no command (`None`: the queue never had any).
            self.retain_last(stream)?
        };
        let old = match m {
            Some(m) => lock(&self.inner.recorded).insert(event.0, m),
            None => lock(&self.inner.recorded).remove(&event.0),
        };
        if let Some(old) = old {
            release(old.0);
        }
        Ok(())
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        self.inner.events.check(event.0)?;
        match lock(&self.inner.recorded).get(&event.0) {
            None => Ok(true),
            Some(ev) => event_complete(ev.0),
        }
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        self.inner.events.check(event.0)?;
        let ev = lock(&self.inner.recorded).get(&event.0).copied();
        if let Some(ev) = ev {
            cl3::event::wait_for_events(&[ev.0]).map_err(|c| cl_error("clWaitForEvents", c))?;
        }
        Ok(())
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32> {
        const OP: &str = "clGetEventProfilingInfo";
        self.inner.events.check(start.0)?;
        self.inner.events.check(end.0)?;
        let rec = lock(&self.inner.recorded);
        let (Some(a), Some(b)) = (rec.get(&start.0), rec.get(&end.0)) else {
            return Err(AdaptorError::invalid(OP, "both events must be recorded"));
        };
        let t = |e: cl_event| -> Result<u64> {
            match cl3::event::get_event_profiling_info(e, cl3::event::CL_PROFILING_COMMAND_END) {
                Ok(cl3::info_type::InfoType::Ulong(ns)) => Ok(ns),
                Ok(other) => Err(AdaptorError::invalid(OP, format!("unexpected {other:?}"))),
                Err(c) => Err(cl_error(OP, c)),
            }
        };
        let (ta, tb) = (t(a.0)?, t(b.0)?);
        Ok(tb.saturating_sub(ta) as f32 / 1e6)
    }

    fn ipc_get_handle(&self, _ptr: DevicePtr) -> Result<IpcMemHandle> {
        Self::unsupported("ipc_get_handle")
    }

    fn ipc_open_handle(&self, _handle: &IpcMemHandle) -> Result<DevicePtr> {
        Self::unsupported("ipc_open_handle")
    }

    fn ipc_export_fd(&self, _ptr: DevicePtr) -> Result<IpcFdHandle> {
        Self::unsupported("ipc_export_fd")
    }

    fn ipc_import_fd(&self, handle: &IpcFdHandle) -> Result<DevicePtr> {
        const OP: &str = "clCreateBufferWithProperties";
        if !self.inner.fd_import || handle.vendor == VENDOR {
            // No platform here exports, and this device imports nothing.
            return Self::unsupported("ipc_import_fd");
        }
        if handle.size == 0 {
            return Err(AdaptorError::invalid("ipc_import_fd", "a zero-byte export"));
        }
        let (ctx, dev) = (self.inner.context.0, self.inner.id.0);
        // SAFETY: our live context and its device; the fd stays the caller's.
        let mem = unsafe { extmem::import(ctx, dev, handle.fd.as_raw_fd(), handle.size) }
            .map_err(|c| cl_error(OP, c))?;
        let va = match self.place(OP, mem, handle.size) {
            Ok(va) => va,
            Err(e) => {
                // SAFETY: imported just above, never used.
                let _ = unsafe { extmem::release(ctx, dev, mem) };
                return Err(e);
            }
        };
        lock(&self.inner.imported).insert(va.0);
        Ok(va)
    }

    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        if !lock(&self.inner.imported).remove(&ptr.0) {
            return Err(AdaptorError::InvalidHandle {
                kind: "imported device pointer",
                value: ptr.0,
            });
        }
        let (_, mem) = lock(&self.inner.buffers).remove_if("ipc_close", ptr.0, |_| true)?;
        // SAFETY: our import, now untracked; the caller guarantees no command uses it.
        unsafe { extmem::release(self.inner.context.0, self.inner.id.0, mem.0) }
            .map_err(|c| cl_error("clEnqueueReleaseExternalMemObjectsKHR", c))
    }

    fn can_access_peer(&self, peer: usize) -> Result<bool> {
        self.check_device(peer)?;
        Ok(peer == self.inner.device)
    }

    fn enable_peer_access(&self, _peer: usize) -> Result<()> {
        Self::unsupported("enable_peer_access")
    }

    fn exchange_capture_mode(&self, _mode: CaptureMode) -> Result<CaptureMode> {
        Self::unsupported("exchange_capture_mode")
    }

    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        // The queue's last command completes when earlier work has; the gate's barrier holds
        // later work until the host-function thread opens it.
        let marker = self.retain_last(stream)?;
        let gate = match self.enqueue_gate(stream) {
            Ok((g, barrier)) => {
                release(barrier.0);
                g
            }
            Err(e) => {
                if let Some(m) = marker {
                    release(m.0);
                }
                return Err(e);
            }
        };
        let call = HostCall { f, marker, gate };
        if let Err(std::sync::mpsc::SendError(call)) = lock(&self.inner.host_fns).send(call) {
            // The thread is gone (it never exits while the adaptor lives): open the gate rather
            // than leave the queue blocked, and report it.
            let HostCall { marker, gate, .. } = call;
            let _ = cl3::event::set_user_event_status(gate.0, CL_COMPLETE);
            release(gate.0);
            if let Some(m) = marker {
                release(m.0);
            }
            return Err(AdaptorError::Unsupported {
                vendor: VENDOR,
                op: "launch_host_func (host-function thread gone)",
            });
        }
        Ok(())
    }

    fn stream_gate(&self, stream: StreamHandle) -> Result<GateHandle> {
        let (gate, barrier) = self.enqueue_gate(stream)?;
        let h = self.inner.next_handle.fetch_add(1, Ordering::Relaxed);
        lock(&self.inner.gates).insert(
            h,
            Gate {
                event: gate,
                barrier,
                stream: stream.0,
            },
        );
        Ok(GateHandle(h))
    }

    fn gate_open(&self, gate: GateHandle) -> Result<()> {
        const OP: &str = "clSetUserEventStatus";
        let Some(g) = lock(&self.inner.gates).remove(&gate.0) else {
            return Err(AdaptorError::invalid(
                OP,
                format!("gate {} is not closed", gate.0),
            ));
        };
        let r =
            cl3::event::set_user_event_status(g.event.0, CL_COMPLETE).map_err(|c| cl_error(OP, c));
        release(g.event.0);
        release(g.barrier.0);
        r
    }

    fn gate_is_last(&self, gate: GateHandle) -> Result<bool> {
        // Gates before queues, as nowhere else takes both.
        let gates = lock(&self.inner.gates);
        let Some(g) = gates.get(&gate.0) else {
            return Ok(false);
        };
        let queues = lock(&self.inner.queues);
        // The gate holds a reference to its barrier, so no later command can have its address.
        Ok(queues
            .get(&g.stream)
            .and_then(|q| q.last)
            .is_some_and(|l| l.0 == g.barrier.0))
    }

    unsafe fn stream_wait_value32(
        &self,
        _: StreamHandle,
        _: DevicePtr,
        _: u32,
        _: WaitCondition,
    ) -> Result<()> {
        Self::unsupported("stream_wait_value32")
    }

    unsafe fn stream_wait_value64(
        &self,
        _: StreamHandle,
        _: DevicePtr,
        _: u64,
        _: WaitCondition,
    ) -> Result<()> {
        Self::unsupported("stream_wait_value64")
    }

    unsafe fn stream_write_value32(&self, _: StreamHandle, _: DevicePtr, _: u32) -> Result<()> {
        Self::unsupported("stream_write_value32")
    }

    unsafe fn stream_write_value64(&self, _: StreamHandle, _: DevicePtr, _: u64) -> Result<()> {
        Self::unsupported("stream_write_value64")
    }
}

/// Whether a command's event reached `CL_COMPLETE`; a negative status is the command's error.
fn event_complete(ev: cl_event) -> Result<bool> {
    match cl3::event::get_event_info(ev, cl3::event::CL_EVENT_COMMAND_EXECUTION_STATUS) {
        Ok(cl3::info_type::InfoType::Int(s)) if s == CL_COMPLETE => Ok(true),
        Ok(cl3::info_type::InfoType::Int(s)) if s < 0 => Err(cl_error("command execution", s)),
        Ok(_) => Ok(false),
        Err(c) => Err(cl_error("clGetEventInfo", c)),
    }
}

#[cfg(test)]
mod tests {
    use super::SyncMode;

    #[test]
    fn fills_past_the_first_gibibyte_go_to_the_kernel() {
        use super::{runtime_fill_len, FILL_RUNTIME_END as END};
        assert_eq!(runtime_fill_len(0, 13), 13);
        assert_eq!(runtime_fill_len(END - 8, 8), 8);
        // 2 GiB + 5 B from the start, the fill NVIDIA's platform failed: the first GiB.
        assert_eq!(runtime_fill_len(0, (1 << 31) + 5), END);
        assert_eq!(runtime_fill_len(END - 8, 24), 8);
        assert_eq!(runtime_fill_len(END, 24), 0);
        assert_eq!(runtime_fill_len(3 << 30, 1), 0);
    }

    #[test]
    fn sync_mode_parses_and_polls_only_off_the_cpu() {
        let (cpu, gpu) = (
            cl3::device::CL_DEVICE_TYPE_CPU,
            cl3::device::CL_DEVICE_TYPE_GPU,
        );
        assert_eq!(SyncMode::parse(None).unwrap(), SyncMode::Auto);
        assert_eq!(SyncMode::parse(Some(" Poll ")).unwrap(), SyncMode::Poll);
        assert_eq!(SyncMode::parse(Some("finish")).unwrap(), SyncMode::Finish);
        let e = SyncMode::parse(Some("spin")).unwrap_err().to_string();
        assert!(e.contains("FLAGCX_OPENCL_SYNC"), "{e}");
        assert!(SyncMode::Auto.polls(gpu) && !SyncMode::Auto.polls(cpu));
        assert!(SyncMode::Poll.polls(cpu) && !SyncMode::Finish.polls(gpu));
    }
}
