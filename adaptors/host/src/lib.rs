//! `flagcx-host`: a real flagcx-rs vendor whose "device" memory is shareable host memory.
//!
//! It is how CPU worker processes (say, a KV-cache server) join a job next to GPU ranks, and how
//! CI exercises every layer end to end without a GPU. Nothing here is a mock:
//!
//! - device memory is a `memfd` mapped shared, so IPC handles really map the same pages in
//!   another process — by fd ([`DeviceAdaptor::ipc_export_fd`]) or by a 64-byte handle that
//!   names the exporter's descriptor, opened through `/proc/<pid>/fd` and checked by inode;
//! - each stream is a worker thread that runs its operations asynchronously and in order;
//!   events, host functions and stream wait/write value operations keep stream order;
//! - it presents several devices (`FLAGCX_HOST_DEVICES`, default 8) so that several ranks on one
//!   machine look like a node; all of them share the host's memory, so peers can always reach
//!   each other.

// tidy: long file: the host vendor's one implementation of the DeviceAdaptor contract, which Rust keeps in one impl block.

#![deny(unsafe_op_in_unsafe_fn)]

mod cma;
mod copy;
mod freesync;
mod ipcrule;
mod memory;
mod stream;

pub use copy::{COPY_THREADS_DEFAULT_MAX, COPY_THREAD_PREFIX, STREAMING_MIN_ENV};
pub use freesync::{FREE_SYNC_ENV, FREE_WAITED_OUT, FREE_WAIT_MAX};
pub use ipcrule::IPC_AS_CUDA_ENV;

use flagcx_adaptor::tracking::HandleMap;
use std::cell::Cell;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use flagcx_adaptor::hostmem::{self, HostMemHandle};
use flagcx_adaptor::reduce::{self, DataType, ReduceStep};
use flagcx_adaptor::{
    AdaptorError, Capabilities, CaptureMode, DeviceAdaptor, DeviceProperties, DevicePtr,
    EventHandle, HostFn, IpcFdHandle, IpcMemHandle, Result, StreamHandle, Vendor, WaitCondition,
};

use memory::{dup_cloexec, map_opened, registry, RangeKind};
pub use stream::QUEUES_ENV;
use stream::{EventState, HostStream, Op, SharedQueue};

/// Environment variable: how many host devices to present (default [`DEFAULT_DEVICES`]).
pub const DEVICES_ENV: &str = "FLAGCX_HOST_DEVICES";
/// Host devices presented when [`DEVICES_ENV`] is unset.
pub const DEFAULT_DEVICES: usize = 8;
const VENDOR: Vendor = Vendor::Host;

thread_local! {
    static CAPTURE_MODE: Cell<CaptureMode> = const { Cell::new(CaptureMode::Global) };
}

/// Stream and event ids are process-unique, so a handle from one adaptor is never mistaken for
/// another's.
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(0x4000);

/// One host device. Cheap to clone; clones share streams and events.
#[derive(Clone)]
pub struct HostAdaptor {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    device: usize,
    count: usize,
    total_memory: u64,
    streams: Mutex<HandleMap<Arc<HostStream>>>,
    events: Mutex<HandleMap<Arc<EventState>>>,
    /// [`QUEUES_ENV`]'s shared queues, taken in turn by new streams (none: a worker each).
    queues: (Vec<SharedQueue>, AtomicU64),
}

impl Drop for Inner {
    fn drop(&mut self) {
        let streams: Vec<_> = self
            .streams
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .collect();
        // All closed first: on a shared queue one stream's ops may wait behind another's.
        for (_, s) in &streams {
            s.close(true);
        }
        for (_, s) in streams {
            s.join(true);
        }
    }
}

impl std::fmt::Debug for HostAdaptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostAdaptor")
            .field("device", &self.inner.device)
            .field("count", &self.inner.count)
            .finish()
    }
}

/// Every `FLAGCX_*` variable the host vendor reads, checked when a device opens: a malformed
/// value is an error naming the variable, not a silent fall back to the default (the
/// settings themselves are read lazily, where they are used). Blank counts as unset.
fn check_env(var: impl Fn(&str) -> Option<String>) -> Result<()> {
    let bad = |name: &str, v: &str, what: &str| {
        Err(AdaptorError::invalid(
            "HostAdaptor::open",
            format!("{name}={v:?} is not {what}"),
        ))
    };
    let count = |v: &str| v.trim().parse::<usize>().ok();
    for (name, what, ok) in [
        (
            stream::QUEUES_ENV,
            "a number of queues (0: a worker per stream)",
            &(|v: &str| count(v).is_some()) as &dyn Fn(&str) -> bool,
        ),
        (
            copy::COPY_THREADS_ENV,
            "a number of copy threads",
            &|v: &str| count(v).is_some(),
        ),
        (
            stream::INLINE_MAX_ENV,
            "a byte count (optionally with K, M or G)",
            &|v: &str| copy::parse_size(v.trim()).is_some(),
        ),
        (
            copy::STREAMING_MIN_ENV,
            "a byte count (optionally with K, M or G) or off",
            &|v: &str| v.trim().eq_ignore_ascii_case("off") || copy::parse_size(v.trim()).is_some(),
        ),
        (freesync::FREE_SYNC_ENV, "0 or 1", &|v: &str| {
            matches!(v.trim(), "0" | "1")
        }),
        (ipcrule::IPC_AS_CUDA_ENV, "0 or 1", &|v: &str| {
            matches!(v.trim(), "0" | "1")
        }),
        (
            flagcx_adaptor::spin::JOB_CPUS_ENV,
            "a CPU count ≥ 1",
            &|v: &str| count(v).is_some_and(|n| n >= 1),
        ),
        ("FLAGCX_NRANKS", "a rank count ≥ 1", &|v: &str| {
            count(v).is_some_and(|n| n >= 1)
        }),
    ] {
        if let Some(v) = var(name).filter(|v| !v.trim().is_empty()) {
            if !ok(&v) {
                return bad(name, &v, what);
            }
        }
    }
    Ok(())
}

impl HostAdaptor {
    /// Opens host device `device`, presenting as many devices as `FLAGCX_HOST_DEVICES` says.
    pub fn open(device: usize) -> Result<Self> {
        check_env(|name| std::env::var(name).ok())?;
        let count = match std::env::var(DEVICES_ENV) {
            Err(_) => DEFAULT_DEVICES,
            Ok(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n >= 1)
                .ok_or_else(|| {
                    AdaptorError::invalid(
                        "HostAdaptor::open",
                        format!("{DEVICES_ENV}={v:?} is not a device count ≥ 1"),
                    )
                })?,
        };
        Self::with_devices(device, count)
    }

    /// Opens host device `device` of `count` presented devices.
    pub fn with_devices(device: usize, count: usize) -> Result<Self> {
        AdaptorError::check_device(VENDOR, device, count)?;
        let queues = SharedQueue::from_env(device).map_err(|source| AdaptorError::Os {
            op: "spawn shared queue worker",
            source,
        })?;
        let inner = Arc::new(Inner {
            device,
            count,
            total_memory: memory::physical_memory(),
            streams: Mutex::default(),
            events: Mutex::default(),
            queues: (queues, AtomicU64::new(0)),
        });
        freesync::open(&inner);
        Ok(HostAdaptor { inner })
    }

    fn stream(&self, s: StreamHandle) -> Result<Arc<HostStream>> {
        let _call = freesync::call();
        self.inner
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&s.0)
            .cloned()
            .ok_or(AdaptorError::InvalidHandle {
                kind: "stream",
                value: s.0,
            })
    }

    fn event(&self, e: EventHandle) -> Result<Arc<EventState>> {
        let _call = freesync::call();
        self.inner
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&e.0)
            .cloned()
            .ok_or(AdaptorError::InvalidHandle {
                kind: "event",
                value: e.0,
            })
    }

    /// What a free holds: nothing, or with [`FREE_SYNC_ENV`] the process-wide lock, once every
    /// stream of the device (of every adaptor of the process open on it) is idle.
    fn free_sync(&self, op: &str) -> Option<std::sync::RwLockWriteGuard<'static, ()>> {
        let device = self.inner.device;
        freesync::free(op, || {
            freesync::opened(device).iter().all(|inner| {
                let streams = inner.streams.lock().unwrap_or_else(|e| e.into_inner());
                streams.values().all(|s| s.idle())
            })
        })
    }

    fn push(&self, op: &'static str, s: &HostStream, work: Op) -> Result<()> {
        if s.push(work) {
            Ok(())
        } else {
            Err(AdaptorError::StreamFault {
                vendor: VENDOR,
                op,
                reason: "stream is shutting down".into(),
            })
        }
    }

    fn check_device_index(&self, index: usize) -> Result<()> {
        AdaptorError::check_device(VENDOR, index, self.inner.count)
    }

    fn alloc_device(&self, op: &'static str, size: usize) -> Result<DevicePtr> {
        if size == 0 {
            return Err(AdaptorError::invalid(op, "zero-byte allocation"));
        }
        if size as u64 > self.inner.total_memory {
            return Err(AdaptorError::OutOfMemory {
                vendor: VENDOR,
                device: self.inner.device,
                requested: size,
                code: None,
            });
        }
        let _call = freesync::call();
        let fd = memory::memfd(size)?;
        let base = memory::map_shared(&fd, size).map_err(|e| match e {
            AdaptorError::Os { ref source, .. } if source.raw_os_error() == Some(libc::ENOMEM) => {
                AdaptorError::OutOfMemory {
                    vendor: VENDOR,
                    device: self.inner.device,
                    requested: size,
                    code: Some(libc::ENOMEM as i64),
                }
            }
            other => other,
        })?;
        let kind = RangeKind::Device {
            device: self.inner.device,
            fd,
        };
        registry().insert(op, base, size, kind)?;
        Ok(DevicePtr(base))
    }

    /// Validates a stream memory operation's address: device-visible, aligned, in bounds.
    fn check_value_addr(&self, op: &'static str, addr: DevicePtr, wide: bool) -> Result<()> {
        let width = if wide { 8 } else { 4 };
        if addr.0 % width != 0 {
            return Err(AdaptorError::invalid(
                op,
                format!("{addr} is not {width}-byte aligned"),
            ));
        }
        memory::check_local(&registry(), op, addr.0, width as usize)
    }

    fn enqueue_value_op(&self, op: &'static str, stream: StreamHandle, work: Op) -> Result<()> {
        let s = self.stream(stream)?;
        self.push(op, &s, work)
    }
}

/// The error of a call that finds its stream (or its event's) behind a failed copy.
fn broken(op: &'static str, why: &str) -> AdaptorError {
    AdaptorError::StreamFault {
        vendor: VENDOR,
        op,
        reason: format!("a copy of this stream failed: {why}"),
    }
}

/// Opens another process's registered memory (`cma`): a synthetic range standing for it, once
/// one byte of it was read, so that a process gone or a refusal shows here, with its errno.
fn open_remote(op: &'static str, p: cma::ProcMemHandle) -> Result<DevicePtr> {
    let mut probe = 0u8;
    // SAFETY: `probe` is one byte of this process, alive across the call.
    unsafe {
        cma::copy(
            cma::Way::Read,
            p.pid,
            &mut probe as *mut u8 as u64,
            p.addr,
            1,
        )?
    };
    let base = cma::reserve(p.size);
    let kind = RangeKind::Remote {
        pid: p.pid,
        addr: p.addr,
    };
    registry().insert(op, base, p.size, kind)?;
    Ok(DevicePtr(base))
}

/// Encodes a byte-form handle naming descriptor `fd` of this process.
/// The handle of allocation `fd` of `size` bytes, mapped at `base` here.
fn encode_handle(fd: &OwnedFd, size: usize, base: u64) -> Result<IpcMemHandle> {
    Ok(HostMemHandle::of_fd(fd, size)?.at(base).encode())
}

impl DeviceAdaptor for HostAdaptor {
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
        self.check_device_index(index)?;
        Ok(DeviceProperties {
            vendor: VENDOR,
            index,
            name: format!("host device {index}"),
            pci_bus_id: None,
            total_memory: self.inner.total_memory,
        })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            ipc_bytes: true,
            ipc_fd: true,
            host_register: true,
            peer_access: true,
            host_functions: true,
            stream_mem_ops: true,
            stream_mem_ops_64: true,
            capture_mode: true,
            host_addressable: true,
            sized_copy: true,
            host_gates: false,
            host_pin: true, // bookkeeping only (see `host_pin`)
            // Ranks are threads of different processes on the same cores; the lower-copier
            // default of one-device pairs stays (measured on 2 cores against Open MPI).
            concurrent_processes: false,
            reduce_types: flagcx_adaptor::reduce::ALL_TYPES,
            ..Capabilities::default()
        }
    }

    fn mem_alloc(&self, size: usize) -> Result<DevicePtr> {
        self.alloc_device("mem_alloc", size)
    }

    fn mem_alloc_shareable(&self, size: usize) -> Result<DevicePtr> {
        // Every host-vendor allocation is a memfd, exportable in both forms.
        self.alloc_device("mem_alloc_shareable", size)
    }

    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        let _free = self.free_sync("mem_free");
        let me = self.inner.device;
        let r = registry().remove_if(
            "mem_free",
            ptr.0,
            |k| matches!(k, RangeKind::Device { device, .. } if *device == me),
        )?;
        // SAFETY: the range was our mapping; the caller guarantees no work still uses it.
        unsafe { memory::unmap(ptr.0, r.0) };
        Ok(())
    }

    fn mem_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        let reg = registry();
        match reg.find(ptr.0) {
            Some((base, len, _)) if ptr.0 != 0 => Ok((DevicePtr(base), len)),
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
        let base = memory::map_anonymous(size)?;
        registry().insert("host_alloc", base, size, RangeKind::Pinned)?;
        Ok(base as *mut u8)
    }

    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()> {
        let _free = self.free_sync("host_free");
        let r =
            registry().remove_if("host_free", ptr as u64, |k| matches!(k, RangeKind::Pinned))?;
        // SAFETY: our anonymous mapping; the caller guarantees it is unused.
        unsafe { memory::unmap(ptr as u64, r.0) };
        Ok(())
    }

    unsafe fn host_register(&self, ptr: *mut u8, size: usize) -> Result<DevicePtr> {
        if ptr.is_null() || size == 0 {
            return Err(AdaptorError::invalid(
                "host_register",
                "null pointer or zero size",
            ));
        }
        registry().insert("host_register", ptr as u64, size, RangeKind::Registered)?;
        Ok(DevicePtr(ptr as u64))
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        let _free = self.free_sync("host_unregister");
        registry().remove_if("host_unregister", ptr as u64, |k| {
            matches!(k, RangeKind::Registered)
        })?;
        Ok(())
    }

    /// Its device memory is host memory already, so pinning only records the range, as
    /// registration does (a range pinned twice is refused; staging rings and the direct path's
    /// mappings are pinned through here, which keeps those paths' bookkeeping and failure
    /// handling exercised on the host vendor).
    unsafe fn host_pin(&self, ptr: *mut u8, size: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.host_register(ptr, size) }.map(|_| ())
    }

    unsafe fn host_unpin(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.host_unregister(ptr) }
    }

    unsafe fn memcpy_h2d_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "memcpy_h2d_async";
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(AdaptorError::invalid(OP, "null host source"));
        }
        memory::check_local(&registry(), OP, dst.0, n)?;
        let src = src as u64;
        self.push(OP, &s, Op::Copy { dst: dst.0, src, n })
    }

    unsafe fn memcpy_d2h_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "memcpy_d2h_async";
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(AdaptorError::invalid(OP, "null host destination"));
        }
        memory::check_local(&registry(), OP, src.0, n)?;
        let dst = dst as u64;
        self.push(OP, &s, Op::Copy { dst, src: src.0, n })
    }

    unsafe fn memcpy_d2d_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "memcpy_d2d_async";
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        // Another process's registered memory on one side: the kernel copies (`cma`).
        let (to, from) = {
            let reg = registry();
            (
                memory::remote_at(&reg, OP, dst.0, n)?,
                memory::remote_at(&reg, OP, src.0, n)?,
            )
        };
        let work = match (to, from) {
            (None, None) => Op::Copy {
                dst: dst.0,
                src: src.0,
                n,
            },
            (Some((pid, remote)), None) => Op::Remote {
                way: cma::Way::Write,
                pid,
                local: src.0,
                remote,
                n,
            },
            (None, Some((pid, remote))) => Op::Remote {
                way: cma::Way::Read,
                pid,
                local: dst.0,
                remote,
                n,
            },
            (Some(_), Some(_)) => {
                return Err(AdaptorError::invalid(
                    OP,
                    "both ends are other processes' registered memory",
                ))
            }
        };
        self.push(OP, &s, work)
    }

    unsafe fn memcpy_sized_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len_at: DevicePtr,
        cap: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "memcpy_sized_async";
        let s = self.stream(stream)?;
        self.check_value_addr(OP, len_at, true)?;
        if cap > 0 {
            let reg = registry();
            memory::check_local(&reg, OP, dst.0, cap)?;
            memory::check_local(&reg, OP, src.0, cap)?;
        }
        self.push(
            OP,
            &s,
            Op::SizedCopy {
                dst: dst.0,
                src: src.0,
                len_at: len_at.0,
                cap,
            },
        )
    }

    unsafe fn memset_async(
        &self,
        dst: DevicePtr,
        value: u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "memset_async";
        let s = self.stream(stream)?;
        if n == 0 {
            return Ok(());
        }
        memory::check_local(&registry(), OP, dst.0, n)?;
        self.push(
            OP,
            &s,
            Op::Memset {
                dst: dst.0,
                value,
                n,
            },
        )
    }

    unsafe fn reduce_async(
        &self,
        dst: DevicePtr,
        a: DevicePtr,
        b: DevicePtr,
        count: usize,
        dtype: DataType,
        step: ReduceStep,
        stream: StreamHandle,
    ) -> Result<()> {
        const OP: &str = "reduce_async";
        let s = self.stream(stream)?;
        let caps = self.capabilities().reduce_types;
        let bytes = reduce::check_operands(Vendor::Host, caps, dst, a, b, count, dtype, step)?;
        if bytes == 0 {
            return Ok(());
        }
        {
            let reg = registry();
            memory::check_local(&reg, OP, dst.0, bytes)?;
            memory::check_local(&reg, OP, a.0, bytes)?;
            if matches!(step, ReduceStep::Combine(_)) {
                memory::check_local(&reg, OP, b.0, bytes)?;
            }
        }
        self.push(
            OP,
            &s,
            Op::Reduce {
                dst: dst.0,
                a: a.0,
                b: b.0,
                count,
                dtype,
                step,
            },
        )
    }

    fn stream_create(&self) -> Result<StreamHandle> {
        let id = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        let (queues, turn) = &self.inner.queues;
        let name = format!("flagcx-host-stream-{id:x}");
        let s = HostStream::create(name, queues, turn).map_err(|source| AdaptorError::Os {
            op: "spawn stream worker",
            source,
        })?;
        self.inner
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, Arc::new(s));
        Ok(StreamHandle(id))
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        let s = self
            .inner
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&stream.0)
            .ok_or(AdaptorError::InvalidHandle {
                kind: "stream",
                value: stream.0,
            })?;
        // Enqueued work still completes, as on a GPU; the worker exits when its queue drains.
        s.close(false);
        Ok(())
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        let s = self.stream(stream)?;
        match s.synchronize() {
            None => match s.broken() {
                None => Ok(()),
                Some(why) => Err(broken("stream_synchronize", why)),
            },
            Some(reason) => Err(AdaptorError::StreamFault {
                vendor: VENDOR,
                op: "stream_synchronize",
                reason,
            }),
        }
    }

    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        // Without cloning the stream's Arc: this is on every post's latency path.
        let streams = self.inner.streams.lock().unwrap_or_else(|e| e.into_inner());
        match streams.get(&stream.0) {
            Some(s) => match s.broken() {
                None => Ok(s.idle()),
                Some(why) => Err(broken("stream_query", why)),
            },
            None => Err(AdaptorError::InvalidHandle {
                kind: "stream",
                value: stream.0,
            }),
        }
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        let s = self.stream(stream)?;
        let ev = self.event(event)?;
        let gen = ev.last_recorded();
        if gen == 0 {
            return Ok(()); // never recorded: nothing to wait for
        }
        self.push("stream_wait_event", &s, Op::WaitEvent { event: ev, gen })
    }

    fn event_create(&self, timing: bool) -> Result<EventHandle> {
        let id = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        self.inner
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, Arc::new(EventState::new(timing)));
        Ok(EventHandle(id))
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.inner
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&event.0)
            .map(|_| ())
            .ok_or(AdaptorError::InvalidHandle {
                kind: "event",
                value: event.0,
            })
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        let s = self.stream(stream)?;
        let ev = self.event(event)?;
        let gen = ev.begin_record();
        self.push("event_record", &s, Op::Record { event: ev, gen })
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        self.event(event)?
            .outcome()
            .map_err(|why| broken("event_query", &why))
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let ev = self.event(event)?;
        ev.wait(ev.last_recorded());
        ev.outcome()
            .map(drop)
            .map_err(|why| broken("event_synchronize", &why))
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32> {
        const OP: &str = "event_elapsed_ms";
        let (s, e) = (self.event(start)?, self.event(end)?);
        if !s.timing || !e.timing {
            return Err(AdaptorError::invalid(
                OP,
                "events were created without timing",
            ));
        }
        match (s.completed_at(), e.completed_at()) {
            (Some(a), Some(b)) => Ok(b.saturating_duration_since(a).as_secs_f32() * 1e3),
            _ => Err(AdaptorError::invalid(
                OP,
                "both events must be recorded and complete",
            )),
        }
    }

    fn ipc_get_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        const OP: &str = "ipc_get_handle";
        let reg = registry();
        match reg.find(ptr.0) {
            Some((base, len, kind)) if ptr.0 != 0 => match kind {
                RangeKind::Device { fd, .. } | RangeKind::IpcOpened { fd, .. } => {
                    encode_handle(fd, len, base)
                }
                // The user's own memory, private to this process: peers copy through the
                // kernel (`cma`), by process and address.
                RangeKind::Registered => {
                    cma::allow_peers();
                    Ok(cma::ProcMemHandle {
                        pid: std::process::id(),
                        addr: base,
                        size: len,
                    }
                    .encode())
                }
                _ => Err(AdaptorError::invalid(
                    OP,
                    format!("{ptr} is not device memory"),
                )),
            },
            _ => Err(AdaptorError::InvalidHandle {
                kind: "device pointer",
                value: ptr.0,
            }),
        }
    }

    fn ipc_open_handle(&self, handle: &IpcMemHandle) -> Result<DevicePtr> {
        const OP: &str = "ipc_open_handle";
        if let Some(p) = cma::ProcMemHandle::decode(OP, handle)? {
            return open_remote(OP, p);
        }
        let d = HostMemHandle::decode(OP, handle)?;
        ipcrule::check(OP, &registry(), &d)?;
        let fd = d.open(OP)?;
        map_opened(OP, fd, d.size, Some(d))
    }

    fn ipc_export_fd(&self, ptr: DevicePtr) -> Result<IpcFdHandle> {
        const OP: &str = "ipc_export_fd";
        let reg = registry();
        match reg.find(ptr.0) {
            Some((_, len, kind)) if ptr.0 != 0 => match kind {
                RangeKind::Device { fd, .. } | RangeKind::IpcOpened { fd, .. } => Ok(IpcFdHandle {
                    vendor: VENDOR,
                    fd: dup_cloexec(OP, fd)?,
                    size: len,
                }),
                _ => Err(AdaptorError::invalid(
                    OP,
                    format!("{ptr} is not device memory"),
                )),
            },
            _ => Err(AdaptorError::InvalidHandle {
                kind: "device pointer",
                value: ptr.0,
            }),
        }
    }

    fn ipc_import_fd(&self, handle: &IpcFdHandle) -> Result<DevicePtr> {
        const OP: &str = "ipc_import_fd";
        if handle.vendor != VENDOR {
            return Err(AdaptorError::invalid(
                OP,
                format!(
                    "a {} handle cannot be imported by the host vendor",
                    handle.vendor
                ),
            ));
        }
        if handle.size == 0 {
            return Err(AdaptorError::invalid(OP, "zero-size handle"));
        }
        let fd = dup_cloexec(OP, &handle.fd)?;
        let have = hostmem::fd_size(&fd)?;
        if have < handle.size {
            return Err(AdaptorError::invalid(
                OP,
                format!(
                    "the descriptor holds {have} bytes, the handle claims {}",
                    handle.size
                ),
            ));
        }
        map_opened(OP, fd, handle.size, None)
    }

    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        let _free = self.free_sync("ipc_close");
        let (len, kind) = registry().remove_if("ipc_close", ptr.0, |k| {
            matches!(k, RangeKind::IpcOpened { .. } | RangeKind::Remote { .. })
        })?;
        if let RangeKind::IpcOpened { .. } = kind {
            // SAFETY: our mapping of the peer's memory; the caller guarantees it is unused.
            unsafe { memory::unmap(ptr.0, len) };
        }
        Ok(())
    }

    fn can_access_peer(&self, peer: usize) -> Result<bool> {
        self.check_device_index(peer)?;
        Ok(true) // every host device is the same physical memory
    }

    fn enable_peer_access(&self, peer: usize) -> Result<()> {
        self.check_device_index(peer)
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        Ok(CAPTURE_MODE.with(|m| m.replace(mode)))
    }

    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        let s = self.stream(stream)?;
        self.push("launch_host_func", &s, Op::HostFn(f))
    }

    unsafe fn stream_wait_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
        cond: WaitCondition,
    ) -> Result<()> {
        const OP: &str = "stream_wait_value32";
        self.check_value_addr(OP, addr, false)?;
        let work = Op::WaitValue {
            addr: addr.0,
            value: value as u64,
            wide: false,
            cond,
        };
        self.enqueue_value_op(OP, stream, work)
    }

    unsafe fn stream_wait_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
        cond: WaitCondition,
    ) -> Result<()> {
        const OP: &str = "stream_wait_value64";
        self.check_value_addr(OP, addr, true)?;
        let work = Op::WaitValue {
            addr: addr.0,
            value,
            wide: true,
            cond,
        };
        self.enqueue_value_op(OP, stream, work)
    }

    unsafe fn stream_write_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<()> {
        const OP: &str = "stream_write_value32";
        self.check_value_addr(OP, addr, false)?;
        let work = Op::WriteValue {
            addr: addr.0,
            value: value as u64,
            wide: false,
        };
        self.enqueue_value_op(OP, stream, work)
    }

    unsafe fn host_write_value32(&self, host: *mut u32, value: u32) {
        // SAFETY: the caller guarantees an aligned live word.
        unsafe { &*(host as *const std::sync::atomic::AtomicU32) }
            .store(value, std::sync::atomic::Ordering::Release);
        stream::ring_doorbell();
    }

    unsafe fn stream_write_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()> {
        const OP: &str = "stream_write_value64";
        self.check_value_addr(OP, addr, true)?;
        let work = Op::WriteValue {
            addr: addr.0,
            value,
            wide: true,
        };
        self.enqueue_value_op(OP, stream, work)
    }
}

#[cfg(test)]
mod env_tests {
    use super::check_env;

    #[test]
    fn malformed_settings_are_errors_naming_the_variable() {
        let with = |name: &'static str, value: &'static str| {
            check_env(move |n| (n == name).then(|| value.to_string()))
        };
        for (name, value) in [
            ("FLAGCX_HOST_QUEUES", "two"),
            ("FLAGCX_HOST_COPY_THREADS", "-1"),
            ("FLAGCX_HOST_INLINE_MAX", "64Q"),
            ("FLAGCX_HOST_COPY_NT_MIN", "sometimes"),
            ("FLAGCX_HOST_FREE_SYNC", "yes"),
            ("FLAGCX_JOB_CPUS", "0"),
            ("FLAGCX_NRANKS", "x"),
        ] {
            let e = with(name, value).expect_err(name).to_string();
            assert!(e.contains(name) && e.contains(value), "{e}");
        }
        for (name, value) in [
            ("FLAGCX_HOST_QUEUES", "2"),
            ("FLAGCX_HOST_INLINE_MAX", "64K"),
            ("FLAGCX_HOST_COPY_NT_MIN", "off"),
            ("FLAGCX_HOST_FREE_SYNC", "1"),
            ("FLAGCX_JOB_CPUS", " 4 "),
            ("FLAGCX_NRANKS", ""),
        ] {
            assert!(with(name, value).is_ok(), "{name}={value}");
        }
    }
}
