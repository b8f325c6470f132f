//! Staging: host buffers that the rank's device cannot name travel through device memory.
//!
//! Beside a host-vendor rank, a host buffer (a numpy array, a torch CPU tensor) is registered
//! with the rank for the call and used in place ([`Place::Registered`]): peers reach it through
//! its IPC handle, the kernel copying between the two processes' pages (`flagcx-host`'s
//! `cma`), so it moves with one copy as the rank's own memory does. Where registration is
//! refused (the range overlaps another call's buffer in flight), it is staged as below.
//!
//! A numpy array beside an OpenCL or CUDA rank lives in pageable host memory the runtime's
//! operations cannot use. Such a buffer gets a staging buffer from the communicator's [`Pool`]: its contents are copied in on the
//! operation's stream before the operation (unless the operation overwrites all of it), and
//! copied back after it where the operation writes it. An event recorded behind the copies
//! back says when they ran ([`Outbound`]).
//!
//! On device ranks the copies go through pinned host memory (a bounce buffer from the same pool):
//! a runtime copy between device memory and pageable memory (a numpy array) is synchronous
//! on CUDA — the calling thread waits until the stream reaches it — and a copy back enqueued
//! behind an operation would hold the calling thread until the operation ends, while the
//! operation may need runtime calls of this rank's progress thread that wait for the calling
//! thread's copy (found on an H100: the progress thread stalled inside a runtime call). So the
//! caller's bytes go into the bounce buffer by a plain memcpy before the operation, the
//! stream copies device ↔ pinned asynchronously, and the last memcpy into the caller's buffer
//! runs when the operation is waited for ([`Outbound::finish`]).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use flagcx::adaptor::hostmem::HostMemHandle;
use flagcx::{
    Adaptor, DeviceAdaptor, DeviceBuffer, DevicePtr, Event, PinnedBuffer, StreamHandle, Vendor,
};
use pyo3::PyResult;

use crate::dlpack::Imported;
use crate::errors::comm_err;
use crate::lock;

/// Staging buffers kept for reuse (at most this many; the largest are kept).
const POOL_KEEP: usize = 8;
/// The smallest staging buffer (smaller requests round up, so small messages share sizes).
const MIN_STAGE: usize = 4096;

/// How an operation uses a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// Read only.
    In,
    /// Written whole (a collective's output): nothing to copy in.
    Out,
    /// Read, or written only in part (a receive may be short; in-place operations read it).
    InOut,
}

/// A communicator's staging buffers.
pub struct Pool {
    adaptor: Adaptor,
    free: FreeList<DeviceBuffer<Adaptor>>,
    /// Pinned bounce buffers (device ranks only; see the module doc).
    pinned: FreeList<PinnedBuffer<Adaptor>>,
}

/// Buffers kept for reuse: a request gets the smallest that holds it, else a new one of the
/// next power of two (at least [`MIN_STAGE`]); at most [`POOL_KEEP`] stay, the largest.
struct FreeList<B> {
    bufs: Mutex<Vec<B>>,
    size: fn(&B) -> usize,
}

impl<B> FreeList<B> {
    fn new(size: fn(&B) -> usize) -> Self {
        FreeList {
            bufs: Mutex::default(),
            size,
        }
    }

    fn take(
        &self,
        bytes: usize,
        alloc: impl FnOnce(usize) -> flagcx::Result<B>,
    ) -> flagcx::Result<B> {
        {
            let mut free = lock(&self.bufs);
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, b)| (self.size)(b) >= bytes)
                .min_by_key(|(_, b)| (self.size)(b))
                .map(|(i, _)| i);
            if let Some(i) = best {
                return Ok(free.swap_remove(i));
            }
        }
        alloc(
            bytes
                .max(MIN_STAGE)
                .checked_next_power_of_two()
                .unwrap_or(bytes),
        )
    }

    fn give(&self, bufs: impl IntoIterator<Item = B>) {
        let mut free = lock(&self.bufs);
        free.extend(bufs);
        if free.len() > POOL_KEEP {
            free.sort_by_key(|b| std::cmp::Reverse((self.size)(b)));
            free.truncate(POOL_KEEP);
        }
    }
}

impl Pool {
    /// An empty pool over `adaptor`'s device.
    pub fn new(adaptor: Adaptor) -> Self {
        Pool {
            adaptor,
            free: FreeList::new(DeviceBuffer::len),
            pinned: FreeList::new(|b: &PinnedBuffer<Adaptor>| b.as_slice().len()),
        }
    }

    /// Whether host buffers bounce through pinned memory: on every device runtime (CUDA's
    /// and HIP's copies to and from pageable memory block the calling thread; an OpenCL
    /// implementation may do the same), not on the host vendor, whose copies are memcpys.
    fn bounces(&self) -> bool {
        self.adaptor.vendor() != Vendor::Host
    }

    /// The adaptor whose device memory the pool hands out.
    pub fn adaptor(&self) -> &Adaptor {
        &self.adaptor
    }

    fn take(&self, bytes: usize) -> flagcx::Result<DeviceBuffer<Adaptor>> {
        self.free
            .take(bytes, |len| DeviceBuffer::new(&self.adaptor, len))
    }

    fn give(&self, bufs: impl IntoIterator<Item = DeviceBuffer<Adaptor>>) {
        self.free.give(bufs)
    }

    fn take_pinned(&self, bytes: usize) -> flagcx::Result<PinnedBuffer<Adaptor>> {
        self.pinned
            .take(bytes, |len| PinnedBuffer::new(&self.adaptor, len))
    }

    fn give_pinned(&self, bufs: impl IntoIterator<Item = PinnedBuffer<Adaptor>>) {
        self.pinned.give(bufs)
    }

    /// Registers `bytes` of host memory at `addr` with a host-vendor rank for one call, so
    /// the operation uses it in place; `None` where the rank is another vendor's or the range
    /// overlaps one registered already (another call's buffer in flight: that call stages).
    fn register(&self, addr: u64, bytes: usize) -> Option<Registration> {
        if self.adaptor.vendor() != Vendor::Host {
            return None;
        }
        let ptr = addr as *mut u8;
        // SAFETY: the call holds the caller's buffer (`bytes` at `addr`) alive until its
        // operation finished, and the registration is dropped by then.
        match unsafe { self.adaptor.host_register(ptr, bytes) } {
            Ok(_) => Some(Registration {
                adaptor: self.adaptor.clone(),
                ptr,
            }),
            Err(e) => {
                tracing::debug!("staging a host buffer that cannot be registered: {e}");
                None
            }
        }
    }
}

/// Where an operation finds a buffer.
#[derive(Debug, Clone, Copy)]
pub struct Resolved {
    /// The pointer the operation uses: the buffer itself, or its staging.
    pub ptr: DevicePtr,
}

struct Entry {
    place: Place,
    user: u64,
    bytes: usize,
    back: bool,
}

/// Where an entry's operation finds the caller's buffer.
enum Place {
    /// In a staging buffer of device memory.
    Staged {
        buf: DeviceBuffer<Adaptor>,
        /// The pinned bounce buffer between `buf` and the caller's memory (device ranks).
        bounce: Option<PinnedBuffer<Adaptor>>,
    },
    /// In place: the caller's host memory registered with a host-vendor rank, which peers
    /// reach through its IPC handle (the kernel copies between the processes' pages).
    /// The registration ends when the entry is dropped.
    Registered { _registration: Registration },
}

impl Place {
    /// Where the operation finds byte 0 of the caller's buffer.
    fn ptr(&self, user: u64) -> DevicePtr {
        match self {
            Place::Staged { buf, .. } => buf.ptr(),
            Place::Registered { .. } => DevicePtr(user),
        }
    }
}

/// Host memory registered with a host-vendor rank for one call; unregistered when dropped
/// (once the call's operation finished, or the call was abandoned after its stream passed).
struct Registration {
    adaptor: Adaptor,
    ptr: *mut u8,
}

// SAFETY: the pointer is only handed back to the adaptor, which is thread-safe.
unsafe impl Send for Registration {}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: registered by `Pool::register`; nothing of this call uses it any more.
        if let Err(e) = unsafe { self.adaptor.host_unregister(self.ptr) } {
            tracing::warn!("unregistering a call's host buffer: {e}");
        }
    }
}

/// One call's staging.
#[derive(Default)]
pub struct Staging {
    entries: Vec<Entry>,
}

impl Staging {
    /// Whether nothing was staged.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Where the operation finds `imp`, used as `how`. `on_device`: the buffer is this rank's
    /// device memory (used in place). A buffer inside one staged earlier in the call (an
    /// in-place reduce-scatter's output) shares its staging.
    pub fn resolve(
        &mut self,
        pool: &Pool,
        imp: &Imported,
        on_device: bool,
        how: Use,
        stream: StreamHandle,
    ) -> PyResult<Resolved> {
        let bytes = imp.bytes();
        let here = Resolved {
            ptr: DevicePtr(imp.addr),
        };
        if on_device || bytes == 0 || shareable(pool.adaptor(), imp.addr, bytes) {
            return Ok(here);
        }
        for e in &mut self.entries {
            if imp.addr >= e.user && imp.addr + bytes as u64 <= e.user + e.bytes as u64 {
                e.back |= how != Use::In;
                return Ok(Resolved {
                    ptr: DevicePtr(e.place.ptr(e.user).0 + (imp.addr - e.user)),
                });
            }
        }
        if let Some(r) = pool.register(imp.addr, bytes) {
            self.entries.push(Entry {
                place: Place::Registered { _registration: r },
                user: imp.addr,
                bytes,
                back: false,
            });
            return Ok(here);
        }
        let buf = pool.take(bytes).map_err(|e| comm_err(e.into()))?;
        let bounce = if pool.bounces() {
            Some(pool.take_pinned(bytes).map_err(|e| comm_err(e.into()))?)
        } else {
            None
        };
        if how != Use::Out {
            let src = match &bounce {
                Some(b) => {
                    // SAFETY: `imp` keeps `bytes` of host memory at `addr` alive (the call
                    // holds it) and nothing writes it during the call; the bounce buffer holds
                    // at least `bytes` and is this call's alone.
                    unsafe {
                        std::ptr::copy_nonoverlapping(imp.addr as *const u8, b.as_ptr(), bytes)
                    };
                    b.as_ptr() as *const u8
                }
                None => imp.addr as *const u8,
            };
            // SAFETY: `src` (the caller's memory, held by the call, or the bounce buffer, held
            // by the staging) stays alive until the operation finished; the staging buffer
            // holds at least `bytes`.
            unsafe {
                pool.adaptor()
                    .memcpy_h2d_async(buf.ptr(), src, bytes, stream)
            }
            .map_err(|e| comm_err(e.into()))?;
        }
        let ptr = buf.ptr();
        self.entries.push(Entry {
            place: Place::Staged { buf, bounce },
            user: imp.addr,
            bytes,
            back: how != Use::In,
        });
        Ok(Resolved { ptr })
    }

    /// After the operation was enqueued: copies back what it wrote, and the event that says
    /// when those copies (and so the operation) are done. `None` where nothing was staged.
    pub fn copy_back(
        mut self,
        pool: &Pool,
        stream: StreamHandle,
    ) -> flagcx::p2p::Result<Option<Outbound>> {
        if self.entries.is_empty() {
            return Ok(None);
        }
        let a = pool.adaptor();
        let entries = std::mem::take(&mut self.entries);
        for e in entries.iter().filter(|e| e.back) {
            let Place::Staged { buf, bounce } = &e.place else {
                continue;
            };
            let dst = bounce.as_ref().map_or(e.user as *mut u8, |b| b.as_ptr());
            // SAFETY: the caller's buffer outlives the returned `Outbound` (the call holds
            // its producer's reference), a bounce buffer lives in it, and nothing else writes
            // either until the event passed.
            unsafe { a.memcpy_d2h_async(dst, buf.ptr(), e.bytes, stream) }?;
        }
        // Registrations alone need no event: they end once the operation finished, which
        // the call's own requests say (`Pending::finish` waits for them first).
        let event = if entries
            .iter()
            .any(|e| matches!(e.place, Place::Staged { .. }))
        {
            let event = Event::new(a, false)?;
            a.event_record(event.handle(), stream)?;
            Some(event)
        } else {
            None
        };
        Ok(Some(Outbound { event, entries }))
    }

    /// The call failed before enqueueing: the staging buffers go back to the pool (copies in
    /// that were enqueued only read the caller's buffers, which the stream finishes first).
    pub fn abandon(mut self, pool: &Pool, stream: StreamHandle) {
        if self.entries.is_empty() {
            return;
        }
        // The copies in may still run; the buffers are reused only after they did.
        let _ = pool.adaptor().stream_synchronize(stream);
        give_back(pool, std::mem::take(&mut self.entries));
    }
}

/// Returns entries' buffers (device and bounce) to the pool; registrations end.
fn give_back(pool: &Pool, entries: Vec<Entry>) {
    let mut pinned = Vec::new();
    pool.give(entries.into_iter().filter_map(|e| match e.place {
        Place::Staged { buf, bounce } => {
            pinned.extend(bounce);
            Some(buf)
        }
        Place::Registered { .. } => None,
    }));
    pool.give_pinned(pinned);
}

/// Whether `bytes` at `addr` are memory of this host-vendor rank that a peer process can map
/// (device memory from the adaptor, whose handle names a memfd): then no staging is needed.
/// Host memory registered for another call in flight is not: its registration ends with that
/// call.
fn shareable(a: &Adaptor, addr: u64, bytes: usize) -> bool {
    a.vendor() == Vendor::Host
        && a.mem_get_range(DevicePtr(addr)).is_ok_and(|(base, len)| {
            addr + bytes as u64 <= base.0 + len as u64
                && a.ipc_get_handle(base)
                    .is_ok_and(|h| HostMemHandle::decode("shareable", &h).is_ok())
        })
}

/// The staging of an enqueued operation: done when `event` completed (no event: nothing was
/// staged, only registered).
pub struct Outbound {
    event: Option<Event<Adaptor>>,
    entries: Vec<Entry>,
}

impl Outbound {
    /// True once the copies back ran.
    pub fn is_done(&self) -> bool {
        self.event
            .as_ref()
            .map_or(true, |e| e.query().unwrap_or(true))
    }

    /// Waits up to `t` for the copies back.
    pub fn settle(&self, t: Duration) -> bool {
        let t0 = Instant::now();
        let mut polls = 0u32;
        loop {
            if self.is_done() {
                return true;
            }
            if t0.elapsed() >= t {
                return false;
            }
            // Short turns first: the copies back follow the operation by microseconds.
            if polls < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
            polls += 1;
        }
    }

    /// Completes the copies back (a bounce buffer's bytes into the caller's buffer) and hands
    /// the staging buffers back; call after `settle` said done.
    pub fn finish(self, pool: &Pool) -> flagcx::p2p::Result<()> {
        if let Some(e) = &self.event {
            e.synchronize()?;
        }
        for e in self.entries.iter().filter(|e| e.back) {
            if let Place::Staged {
                bounce: Some(b), ..
            } = &e.place
            {
                // SAFETY: the stream's copy into the bounce buffer ran (the event passed); the
                // caller's buffer of `bytes` is alive (the call holds it) and written by
                // nothing else until this returns.
                unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), e.user as *mut u8, e.bytes) };
            }
        }
        give_back(pool, self.entries);
        Ok(())
    }
}
