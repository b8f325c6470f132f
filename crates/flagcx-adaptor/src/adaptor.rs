//! The [`DeviceAdaptor`] trait: everything flagcx-rs needs from a vendor runtime.

use crate::error::Result;
use crate::reduce::{DataType, ReduceStep};
use crate::types::{
    Capabilities, CaptureMode, DeviceProperties, DevicePtr, EventHandle, GateHandle, IpcFdHandle,
    IpcMemHandle, SlotStep, StreamHandle, Vendor, WaitCondition,
};

/// A host function enqueued on a stream with [`DeviceAdaptor::launch_host_func`].
pub type HostFn = Box<dyn FnOnce() + Send + 'static>;

/// One device of one vendor runtime.
///
/// An adaptor value is bound to one device (chosen when it is opened); it is cheap to clone and
/// every clone drives the same device. All methods may be called from any thread: adaptors make
/// their device current on the calling thread themselves (the proxy thread relies on this).
///
/// Operations that take raw addresses are `unsafe fn`; each states its contract. Everything else
/// validates its arguments and returns a typed [`crate::AdaptorError`] — never a panic.
pub trait DeviceAdaptor: Clone + Send + Sync + 'static {
    // ---- device -------------------------------------------------------------------------------

    /// Which vendor this is.
    fn vendor(&self) -> Vendor;

    /// The device index this adaptor drives.
    fn device(&self) -> usize;

    /// How many devices of this vendor the process can see.
    fn device_count(&self) -> Result<usize>;

    /// Properties of device `index` (any visible device, not only this adaptor's).
    fn properties(&self, index: usize) -> Result<DeviceProperties>;

    /// What this adaptor supports.
    fn capabilities(&self) -> Capabilities;

    // ---- memory -------------------------------------------------------------------------------

    /// Allocates `size` bytes of device memory. `size == 0` is an invalid argument.
    ///
    /// The allocation can be exported in byte form when [`Capabilities::ipc_bytes`] is set.
    fn mem_alloc(&self, size: usize) -> Result<DevicePtr>;

    /// Allocates `size` bytes (possibly rounded up) of device memory that can also be exported in
    /// file-descriptor form ([`Capabilities::ipc_fd`]); [`Self::mem_free`] releases it.
    fn mem_alloc_shareable(&self, size: usize) -> Result<DevicePtr>;

    /// As [`Self::mem_alloc_shareable`], with the memory on device `device` of this vendor:
    /// this adaptor's own, or a peer it can access, which its copies then reach over the
    /// interconnect. What lets a rank place memory that a runtime on another GPU imports
    /// ([`Capabilities::ipc_fd_foreign`]). The default serves only this adaptor's device and
    /// says `Unsupported` for any other.
    fn mem_alloc_shareable_on(&self, size: usize, device: usize) -> Result<DevicePtr> {
        if device == self.device() {
            self.mem_alloc_shareable(size)
        } else {
            Err(crate::AdaptorError::Unsupported {
                vendor: self.vendor(),
                op: "mem_alloc_shareable_on",
            })
        }
    }

    /// Frees an allocation made by [`Self::mem_alloc`] or [`Self::mem_alloc_shareable`].
    ///
    /// # Safety
    /// No enqueued or future operation may still use the allocation.
    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()>;

    /// The base and size of the allocation (device, pinned, registered or IPC-opened) that
    /// contains `ptr`.
    fn mem_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)>;

    /// An identifier of the allocation holding `ptr` that no other allocation of this process
    /// ever has, even at the same address (CUDA's `CU_POINTER_ATTRIBUTE_BUFFER_ID`); `None`
    /// where the runtime has none. Should a new allocation at a freed one's addresses get the
    /// very same IPC handle bytes, this tells them apart. Conformance:
    /// `buffer_ids_tell_allocations_apart`.
    fn mem_buffer_id(&self, _ptr: DevicePtr) -> Result<Option<u64>> {
        Ok(None)
    }

    /// Allocates `size` bytes of page-locked host memory that the device can reach.
    fn host_alloc(&self, size: usize) -> Result<*mut u8>;

    /// Frees memory from [`Self::host_alloc`].
    ///
    /// # Safety
    /// `ptr` came from `host_alloc` of this adaptor and no operation still uses it.
    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()>;

    /// Registers an existing host mapping (e.g. a shared-memory segment) with the device so its
    /// copy engine can reach it; returns the device-visible address of `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+size` is a live mapping that stays mapped until [`Self::host_unregister`].
    unsafe fn host_register(&self, ptr: *mut u8, size: usize) -> Result<DevicePtr>;

    /// Undoes [`Self::host_register`].
    ///
    /// # Safety
    /// No enqueued or future operation may still use the device alias of the range.
    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()>;

    /// Makes an existing host mapping fast for this adaptor's copies to and from raw host
    /// pointers inside it (page-locked for the copy engine), without promising a device alias:
    /// what staging rings need. Runtimes with [`Self::host_register`] register; OpenCL wraps the
    /// range in a `CL_MEM_USE_HOST_PTR` buffer, which NVIDIA's platform pins. Pinning a range
    /// twice is refused. [`crate::AdaptorError::Unsupported`] where there is nothing to gain
    /// ([`crate::Capabilities::host_pin`]).
    ///
    /// # Safety
    /// `ptr..ptr+size` is a live mapping that stays mapped until [`Self::host_unpin`].
    unsafe fn host_pin(&self, ptr: *mut u8, size: usize) -> Result<()>;

    /// Undoes [`Self::host_pin`].
    ///
    /// # Safety
    /// No enqueued or future copy may still use the range.
    unsafe fn host_unpin(&self, ptr: *mut u8) -> Result<()>;

    // ---- copies -------------------------------------------------------------------------------

    /// Enqueues a copy of `n` bytes from host memory to device memory on `stream`.
    ///
    /// # Safety
    /// `src..src+n` stays readable and `dst..dst+n` writable until the copy completes on
    /// `stream`; the ranges do not overlap.
    unsafe fn memcpy_h2d_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()>;

    /// Enqueues a copy of `n` bytes from device memory to host memory on `stream`.
    ///
    /// # Safety
    /// As [`Self::memcpy_h2d_async`], with the roles swapped.
    unsafe fn memcpy_d2h_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()>;

    /// Enqueues a copy of `n` bytes between device addresses (this device, a peer, an
    /// IPC-opened mapping or registered host memory) on `stream`.
    ///
    /// # Safety
    /// Both ranges stay valid until the copy completes on `stream`.
    unsafe fn memcpy_d2d_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()>;

    /// Enqueues a copy from `src` to `dst` whose length is read when `stream` reaches it: the
    /// 64-bit word at `len_at`, `n`, is loaded then, and `n` bytes are copied if `n <= cap`;
    /// nothing is copied otherwise. The receiving side of a message whose sender writes the
    /// length after the data (both in memory this device reaches) enqueues this behind a
    /// stream wait on the sender's flag, and needs no host round trip to learn the size.
    /// Requires [`crate::Capabilities::sized_copy`]; `Unsupported` otherwise (the default).
    ///
    /// # Safety
    /// `src..src+cap` and `dst..dst+cap` are device-visible memory (device memory, a peer's or
    /// an IPC mapping, or registered host memory's device alias) that stays valid until the
    /// copy completes on `stream`, and does not overlap; `len_at` is an 8-byte-aligned
    /// device-visible word valid as long.
    unsafe fn memcpy_sized_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len_at: DevicePtr,
        cap: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let _ = (dst, src, len_at, cap, stream);
        Err(crate::AdaptorError::Unsupported {
            vendor: self.vendor(),
            op: "memcpy_sized_async",
        })
    }

    /// Enqueues one reduction step over `count` elements of `dtype` on `stream`:
    /// `dst[i] = a[i] op b[i]` for [`ReduceStep::Combine`], the averaging step for
    /// [`ReduceStep::Average`] (`b` unused), with the bit-exact rules of [`crate::reduce`]
    /// (16-bit floats combined in f32 and rounded once to nearest even, no FMA, denormals
    /// kept, one canonical NaN, max/min propagating NaN and ordering -0.0 below +0.0).
    /// `dst` may equal `a` or `b`; a partial overlap is `InvalidArgument`. A type missing from
    /// [`crate::Capabilities::reduce_types`] is `Unsupported` (the default, for every type).
    ///
    /// # Safety
    /// `a` and `b` (Combine only) are readable and `dst` writable device memory of this
    /// adaptor for `count * dtype.size()` bytes until the step completes on `stream`.
    #[allow(clippy::too_many_arguments)]
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
        let _ = (dst, a, b, count, dtype, step, stream);
        Err(crate::AdaptorError::Unsupported {
            vendor: self.vendor(),
            op: "reduce_async",
        })
    }

    /// Enqueues filling `n` bytes at `dst` with `value` on `stream`.
    ///
    /// # Safety
    /// `dst..dst+n` stays valid device memory until the operation completes.
    unsafe fn memset_async(
        &self,
        dst: DevicePtr,
        value: u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()>;

    // ---- streams and events -------------------------------------------------------------------

    /// Creates a stream that runs its operations in order, asynchronously to the host.
    fn stream_create(&self) -> Result<StreamHandle>;

    /// Destroys a stream; work already enqueued still completes.
    fn stream_destroy(&self, stream: StreamHandle) -> Result<()>;

    /// Adopts a stream the application created with the vendor's runtime (`native` is its
    /// handle, e.g. a `CUstream` from PyTorch), so operations can be enqueued on it like on
    /// one of ours. The adaptor never destroys it ([`DeviceAdaptor::stream_destroy`] refuses
    /// it); [`DeviceAdaptor::stream_release`] forgets it. Vendors whose streams have no
    /// native form outside the adaptor (host, OpenCL) return `Unsupported`.
    ///
    /// # Safety
    /// `native` must be a live stream of this adaptor's device and context that outlives
    /// its use through the adaptor (until `stream_release`).
    unsafe fn stream_adopt(&self, native: u64) -> Result<StreamHandle> {
        let _ = native;
        Err(crate::AdaptorError::Unsupported {
            vendor: self.vendor(),
            op: "stream_adopt",
        })
    }

    /// Forgets a stream [`DeviceAdaptor::stream_adopt`] adopted, without destroying it.
    fn stream_release(&self, stream: StreamHandle) -> Result<()> {
        let _ = stream;
        Err(crate::AdaptorError::Unsupported {
            vendor: self.vendor(),
            op: "stream_release",
        })
    }

    /// Blocks until everything enqueued on `stream` has completed.
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()>;

    /// True when everything enqueued on `stream` has completed.
    fn stream_query(&self, stream: StreamHandle) -> Result<bool>;

    /// Makes later work on `stream` wait until the last recording of `event` completes.
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()>;

    /// Creates an event; `timing` asks for [`Self::event_elapsed_ms`] support.
    fn event_create(&self, timing: bool) -> Result<EventHandle>;

    /// Destroys an event.
    fn event_destroy(&self, event: EventHandle) -> Result<()>;

    /// Records `event` at the current end of `stream`.
    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()>;

    /// True when the last recording of `event` has completed (or it was never recorded).
    fn event_query(&self, event: EventHandle) -> Result<bool>;

    /// Blocks until the last recording of `event` has completed.
    fn event_synchronize(&self, event: EventHandle) -> Result<()>;

    /// Milliseconds between two completed recordings of timing events.
    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32>;

    // ---- IPC ----------------------------------------------------------------------------------

    /// Exports the allocation containing `ptr` as a byte-form handle.
    fn ipc_get_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle>;

    /// Maps a byte-form handle exported by another process; returns the allocation's base here.
    ///
    /// Opening a handle that is open already gives one more mapping, closed by one more
    /// [`Self::ipc_close`] (the pointer may be the same: CUDA and HIP count the opens of one
    /// context and return the existing mapping).
    fn ipc_open_handle(&self, handle: &IpcMemHandle) -> Result<DevicePtr>;

    /// Exports an allocation from [`Self::mem_alloc_shareable`] as a file descriptor.
    fn ipc_export_fd(&self, ptr: DevicePtr) -> Result<IpcFdHandle>;

    /// Maps a file-descriptor handle exported by another process; returns the base here.
    fn ipc_import_fd(&self, handle: &IpcFdHandle) -> Result<DevicePtr>;

    /// Unmaps memory opened by [`Self::ipc_open_handle`] or [`Self::ipc_import_fd`].
    ///
    /// # Safety
    /// No enqueued or future operation may still use the mapping.
    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()>;

    // ---- peers, capture mode, host functions --------------------------------------------------

    /// Whether this device can access memory of device `peer` directly.
    fn can_access_peer(&self, peer: usize) -> Result<bool>;

    /// Lets this device access device `peer`'s memory; already enabled is success.
    fn enable_peer_access(&self, peer: usize) -> Result<()>;

    /// Sets the calling thread's stream-capture mode, returning the previous one. Prefer the
    /// scoped [`crate::CaptureModeGuard`].
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode>;

    /// Enqueues `f` to run on a host thread once earlier work on `stream` completes; later work
    /// on `stream` waits for it. `f` must not call back into the adaptor's stream operations.
    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()>;

    /// Makes later work on `stream` wait until the returned gate is opened with
    /// [`Self::gate_open`] (from any thread). A gate that is never opened holds its stream for
    /// ever: whoever makes one opens it, on error paths too. Requires
    /// [`crate::Capabilities::host_gates`]; `Unsupported` otherwise (the default).
    fn stream_gate(&self, stream: StreamHandle) -> Result<GateHandle> {
        let _ = stream;
        Err(crate::AdaptorError::Unsupported {
            vendor: self.vendor(),
            op: "stream_gate",
        })
    }

    /// Opens a gate made by [`Self::stream_gate`]: its stream goes on past it. Each gate opens
    /// once; an unknown or already opened gate is an invalid argument.
    fn gate_open(&self, gate: GateHandle) -> Result<()> {
        let _ = gate;
        Err(crate::AdaptorError::Unsupported {
            vendor: self.vendor(),
            op: "gate_open",
        })
    }

    /// Whether `gate` is still closed and the last work enqueued on its stream (recording an
    /// event enqueues nothing where [`crate::Capabilities::host_gates`] holds). Then work enqueued
    /// on the stream afterwards waits for the gate anyway, and whoever opens it may keep it
    /// closed for longer instead of enqueuing a second gate behind it. Vendors with
    /// `host_gates` answer exactly; `false` is always safe, and is the default (an opened or
    /// unknown gate is not last).
    fn gate_is_last(&self, gate: GateHandle) -> Result<bool> {
        let _ = gate;
        Ok(false)
    }

    // ---- stream memory operations -------------------------------------------------------------

    /// Makes `stream` wait until the 32-bit word at `addr` satisfies `cond` against `value`.
    ///
    /// # Safety
    /// `addr` is a 4-byte-aligned device-visible address (device memory or registered host
    /// memory) that stays valid until the wait completes.
    unsafe fn stream_wait_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
        cond: WaitCondition,
    ) -> Result<()>;

    /// 64-bit form of [`Self::stream_wait_value32`] (8-byte alignment).
    ///
    /// # Safety
    /// As [`Self::stream_wait_value32`].
    unsafe fn stream_wait_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
        cond: WaitCondition,
    ) -> Result<()>;

    /// Makes `stream` write the 32-bit `value` to `addr` once earlier work completes.
    ///
    /// # Safety
    /// As [`Self::stream_wait_value32`].
    unsafe fn stream_write_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<()>;

    /// Writes `value` to the 32-bit word at `host` from the host, for stream waits
    /// ([`Self::stream_wait_value32`]) that watch it through a device-visible alias.
    ///
    /// The default is a release store. Vendors that emulate stream waits with host threads
    /// override it to wake those waiters at once instead of at their next poll.
    ///
    /// # Safety
    /// `host` is a live, 4-byte-aligned host address.
    unsafe fn host_write_value32(&self, host: *mut u32, value: u32) {
        // SAFETY: forwarded contract; an aligned live word is a valid AtomicU32.
        unsafe { &*(host as *const std::sync::atomic::AtomicU32) }
            .store(value, std::sync::atomic::Ordering::Release);
    }

    /// 64-bit form of [`Self::stream_write_value32`].
    ///
    /// # Safety
    /// As [`Self::stream_wait_value32`].
    unsafe fn stream_write_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()>;

    /// Makes `stream` write each `(addr, value)` of `writes` as [`Self::stream_write_value64`]
    /// does, in order, once earlier work completes — as one operation where the vendor batches
    /// them (CUDA's `cuStreamBatchMemOp`: one driver call instead of one per word). The values
    /// are taken now, at enqueue. The default issues them one by one.
    ///
    /// # Safety
    /// As [`Self::stream_wait_value64`], for every address.
    unsafe fn stream_write_values64(
        &self,
        stream: StreamHandle,
        writes: &[(DevicePtr, u64)],
    ) -> Result<()> {
        for &(addr, value) in writes {
            // SAFETY: forwarded contract.
            unsafe { self.stream_write_value64(stream, addr, value)? };
        }
        Ok(())
    }

    /// Enqueues the sides of small messages in `steps` on `stream` (see [`SlotStep`]); later
    /// work on `stream` waits for all of them. The steps may run side by side or in order, so
    /// no step may wait for a word that another step of the same call writes. CUDA runs a call
    /// as one kernel (one launch instead of a wait, a copy and a write per step: each stream
    /// operation behind a wait costs a scheduling hop). The default enqueues each step's wait,
    /// copy and writes in order with [`Self::stream_wait_value64`], [`Self::memcpy_d2h_async`]
    /// or [`Self::memcpy_sized_async`], and [`Self::stream_write_values64`]: it needs 64-bit
    /// stream memory operations and sized copies. An error may leave some steps enqueued.
    ///
    /// # Safety
    /// Every address of every step is valid as [`SlotStep`] says (and `slot_host` a live
    /// mapping of the same slot) until the stream passes the call; a put's slot holds `len`
    /// bytes and a take's `cap`, neither overlapping the other buffer.
    unsafe fn stream_slot_steps(&self, stream: StreamHandle, steps: &[SlotStep]) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { slot_steps_in_order(self, stream, steps) }
    }
}

/// The default [`DeviceAdaptor::stream_slot_steps`]: each step's wait, copy and writes as
/// separate stream operations, step after step (for adaptors that override the method but
/// fall back to it, e.g. where a kernel could not be loaded).
///
/// # Safety
/// As [`DeviceAdaptor::stream_slot_steps`].
pub unsafe fn slot_steps_in_order<A: DeviceAdaptor>(
    a: &A,
    stream: StreamHandle,
    steps: &[SlotStep],
) -> Result<()> {
    for step in steps {
        match *step {
            SlotStep::Put {
                wait,
                src,
                len,
                slot_host,
                writes,
                ..
            } => {
                if let Some((at, min)) = wait {
                    // SAFETY: forwarded contract.
                    unsafe { a.stream_wait_value64(stream, at, min, WaitCondition::Geq) }?;
                }
                if len > 0 {
                    // SAFETY: forwarded contract (the slot's host mapping holds `len`).
                    unsafe { a.memcpy_d2h_async(slot_host, src, len, stream) }?;
                }
                // SAFETY: forwarded contract.
                unsafe { a.stream_write_values64(stream, &writes) }?;
            }
            SlotStep::Take {
                wait,
                slot,
                len_at,
                dst,
                cap,
                done,
                ..
            } => {
                // The inbox is not used: the put wrote the slot (see `SlotInbox`).
                // SAFETY: forwarded contract.
                unsafe {
                    a.stream_wait_value64(stream, wait.0, wait.1, WaitCondition::Geq)?;
                    a.memcpy_sized_async(dst, slot, len_at, cap, stream)?;
                    if let Some((at, value)) = done {
                        a.stream_write_value64(stream, at, value)?;
                    }
                }
            }
        }
    }
    Ok(())
}
