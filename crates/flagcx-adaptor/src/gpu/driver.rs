//! The raw calls a GPU runtime provides to the core ([`Driver`]).

use std::ffi::c_void;
use std::os::fd::{BorrowedFd, OwnedFd};

use crate::{
    Capabilities, CaptureMode, DeviceProperties, HostFn, Result, Vendor, WaitCondition,
    IPC_HANDLE_BYTES,
};

/// What [`Driver::open`] found out about the device.
#[derive(Debug, Clone, Copy)]
pub struct DriverInfo {
    /// Devices the runtime sees.
    pub count: usize,
    /// What the device can do (probed by the driver).
    pub caps: Capabilities,
    /// VMM allocation granularity for fd-shareable memory (0: no fd-form IPC).
    pub granularity: usize,
}

/// The direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// Host memory to device memory.
    HostToDevice,
    /// Device memory to host memory.
    DeviceToHost,
    /// Device memory to device memory (this device's, or a peer's mapping).
    DeviceToDevice,
}

/// The raw calls of one GPU runtime, bound to one device.
///
/// Pointers and handles are plain integers (device addresses, the runtime's stream, event and
/// VMM handles cast to `u64`). Every method makes the calls its name says and nothing more;
/// failures are [`crate::AdaptorError::Vendor`] errors keeping the runtime's code and name.
///
/// # Safety
///
/// Implementors promise that each method does exactly what its documentation says, with the
/// runtime's documented semantics (in particular: copies and value operations are asynchronous
/// and ordered on the given stream; a host function launched successfully is called exactly
/// once). Callers ([`super::GpuAdaptor`]) promise that every handle they pass was created by this
/// driver and is still live, and that addresses satisfy each method's contract.
pub unsafe trait Driver: Send + Sync + Sized + 'static {
    /// The vendor this runtime is.
    const VENDOR: Vendor;
    /// The runtime's out-of-memory code (its failures of allocations become
    /// [`crate::AdaptorError::OutOfMemory`]).
    const OUT_OF_MEMORY: i64;

    /// Opens device `device`: loads and initializes the runtime, selects the device on this
    /// thread and probes what it can do. [`crate::AdaptorError::Unavailable`] when there is no
    /// runtime or no device.
    fn open(device: usize) -> Result<(Self, DriverInfo)>;
    /// Makes this device current on the calling thread.
    fn bind(&self) -> Result<()>;
    /// Name, PCI bus id and memory of device `index` (range-checked by the caller).
    fn properties(&self, index: usize) -> Result<DeviceProperties>;

    /// Allocates `size > 0` bytes of device memory with a byte-form IPC handle.
    fn mem_alloc(&self, size: usize) -> Result<u64>;
    /// Frees an allocation of [`Driver::mem_alloc`].
    ///
    /// # Safety
    /// A live allocation no work still uses.
    unsafe fn mem_free(&self, ptr: u64) -> Result<()>;
    /// Base and length of the allocation holding `ptr`, as the runtime knows it.
    fn mem_range(&self, ptr: u64) -> Result<(u64, usize)>;
    /// The runtime's identifier of the allocation holding `ptr`, unique in the process for its
    /// life (`DeviceAdaptor::mem_buffer_id`); `None` where the runtime has none.
    fn buffer_id(&self, _ptr: u64) -> Result<Option<u64>> {
        Ok(None)
    }
    /// Allocates `size > 0` bytes of pinned host memory mapped for the device.
    fn host_alloc(&self, size: usize) -> Result<*mut u8>;
    /// Frees pinned host memory of [`Driver::host_alloc`].
    ///
    /// # Safety
    /// A live allocation no work still uses.
    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()>;
    /// Page-locks and maps `size` bytes at `ptr` for the device, returning its device address.
    /// Undoes the registration itself when the address cannot be had.
    ///
    /// # Safety
    /// `ptr..ptr+size` is a live mapping of this process for as long as it stays registered.
    unsafe fn host_register(&self, ptr: *mut u8, size: usize) -> Result<u64>;
    /// Undoes [`Driver::host_register`].
    ///
    /// # Safety
    /// Registered by this driver; no work still uses it.
    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()>;

    /// Creates a VMM allocation of `size` bytes (a granularity multiple) on device `device`
    /// (this driver's own, or a peer), exportable as a file descriptor; returns its handle.
    fn vmm_create(&self, size: usize, device: usize) -> Result<u64>;
    /// Reserves an address range of `size` bytes, maps `handle` there and grants this device
    /// read-write access; undoes its own steps on failure.
    ///
    /// # Safety
    /// `handle` is a live VMM handle of at least `size` bytes.
    unsafe fn vmm_map(&self, handle: u64, size: usize) -> Result<u64>;
    /// Unmaps and frees the range of [`Driver::vmm_map`], then releases `handle`.
    ///
    /// # Safety
    /// A live mapping no work still uses.
    unsafe fn vmm_unmap(&self, ptr: u64, size: usize, handle: u64) -> Result<()>;
    /// Releases a VMM handle that is not mapped.
    ///
    /// # Safety
    /// A live handle, not mapped.
    unsafe fn vmm_release(&self, handle: u64) -> Result<()>;
    /// Exports a VMM handle as a new file descriptor.
    ///
    /// # Safety
    /// A live handle.
    unsafe fn vmm_export_fd(&self, handle: u64) -> Result<OwnedFd>;
    /// Imports a VMM handle from a file descriptor (which the runtime does not take).
    fn vmm_import_fd(&self, fd: BorrowedFd<'_>) -> Result<u64>;

    /// Enqueues a copy of `n > 0` bytes on `stream`.
    ///
    /// # Safety
    /// Both ranges are valid for the copy's whole lifetime; `stream` is live.
    unsafe fn memcpy(
        &self,
        kind: CopyKind,
        dst: u64,
        src: u64,
        n: usize,
        stream: u64,
    ) -> Result<()>;
    /// Enqueues setting `n > 0` bytes at `dst` to `value` on `stream`.
    ///
    /// # Safety
    /// The range is valid until the operation completes; `stream` is live.
    unsafe fn memset(&self, dst: u64, value: u8, n: usize, stream: u64) -> Result<()>;

    /// Creates a stream that does not synchronize with the legacy default stream.
    fn stream_create(&self) -> Result<u64>;
    /// Destroys a stream (queued work still runs).
    ///
    /// # Safety
    /// A live stream of this driver.
    unsafe fn stream_destroy(&self, stream: u64) -> Result<()>;
    /// Waits for everything queued on `stream`.
    ///
    /// # Safety
    /// A live stream.
    unsafe fn stream_synchronize(&self, stream: u64) -> Result<()>;
    /// Whether everything queued on `stream` has completed.
    ///
    /// # Safety
    /// A live stream.
    unsafe fn stream_query(&self, stream: u64) -> Result<bool>;
    /// Makes later work on `stream` wait for the last recording of `event`.
    ///
    /// # Safety
    /// Live stream and event.
    unsafe fn stream_wait_event(&self, stream: u64, event: u64) -> Result<()>;

    /// Creates an event, with timing when `timing`.
    fn event_create(&self, timing: bool) -> Result<u64>;
    /// Destroys an event.
    ///
    /// # Safety
    /// A live event of this driver.
    unsafe fn event_destroy(&self, event: u64) -> Result<()>;
    /// Records `event` on `stream`.
    ///
    /// # Safety
    /// Live event and stream.
    unsafe fn event_record(&self, event: u64, stream: u64) -> Result<()>;
    /// Whether the last recording of `event` completed.
    ///
    /// # Safety
    /// A live event.
    unsafe fn event_query(&self, event: u64) -> Result<bool>;
    /// Waits for the last recording of `event`.
    ///
    /// # Safety
    /// A live event.
    unsafe fn event_synchronize(&self, event: u64) -> Result<()>;
    /// Milliseconds between two completed timing events.
    ///
    /// # Safety
    /// Live events.
    unsafe fn event_elapsed_ms(&self, start: u64, end: u64) -> Result<f32>;

    /// The byte-form IPC handle of the allocation at `base`.
    ///
    /// # Safety
    /// `base` is a live allocation of [`Driver::mem_alloc`].
    unsafe fn ipc_get_handle(&self, base: u64) -> Result<[u8; IPC_HANDLE_BYTES]>;
    /// Maps another process's allocation from its byte-form handle (lazily enabling peer
    /// access); returns its base here.
    fn ipc_open_handle(&self, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<u64>;
    /// Unmaps what [`Driver::ipc_open_handle`] mapped.
    ///
    /// # Safety
    /// A live mapping no work still uses.
    unsafe fn ipc_close_handle(&self, ptr: u64) -> Result<()>;

    /// Whether this device can access device `peer`'s memory directly (`peer` range-checked,
    /// not this device).
    fn can_access_peer(&self, peer: usize) -> Result<bool>;
    /// Enables access to device `peer`'s memory (already enabled is success).
    fn enable_peer_access(&self, peer: usize) -> Result<()>;
    /// Releases what [`Driver::enable_peer_access`] retained, at teardown.
    ///
    /// # Safety
    /// Only at teardown, once per peer enabled.
    unsafe fn release_peer(&self, _peer: usize) {}

    /// Sets the calling thread's stream capture mode and returns the previous one.
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode>;
    /// Enqueues on `stream` a call of [`run_host_fn`]`(user)` in stream order.
    ///
    /// # Safety
    /// `stream` is live; `user` came from [`super::GpuAdaptor`]'s boxing of a [`HostFn`]. On success
    /// the runtime must call `run_host_fn(user)` exactly once; on failure never.
    unsafe fn launch_host_func(&self, stream: u64, user: *mut c_void) -> Result<()>;
    /// Enqueues a wait on `stream` until the 32-bit (64-bit when `wide`) word at `addr`
    /// satisfies `cond` against `value`.
    ///
    /// # Safety
    /// `stream` is live; `addr` is a device-visible, aligned word that stays valid until the
    /// wait completes.
    unsafe fn wait_value(
        &self,
        stream: u64,
        addr: u64,
        value: u64,
        wide: bool,
        cond: WaitCondition,
    ) -> Result<()>;
    /// Enqueues a write of `value` into the 32-bit (64-bit when `wide`) word at `addr`.
    ///
    /// # Safety
    /// As for [`Driver::wait_value`].
    unsafe fn write_value(&self, stream: u64, addr: u64, value: u64, wide: bool) -> Result<()>;
    /// Enqueues the 64-bit writes `(addr, value)` of `writes` in order; one call each unless
    /// the runtime batches them.
    ///
    /// # Safety
    /// As for [`Driver::wait_value`], for every address.
    unsafe fn write_values(&self, stream: u64, writes: &[(u64, u64)]) -> Result<()> {
        for &(addr, value) in writes {
            // SAFETY: forwarded contract.
            unsafe { self.write_value(stream, addr, value, true)? };
        }
        Ok(())
    }

    /// Enqueues the copy of [`crate::DeviceAdaptor::memcpy_sized_async`]: `n` = the word at
    /// `len_at` when the stream reaches it, copied if `n <= cap`. Unsupported unless the
    /// vendor can run it (a kernel).
    ///
    /// # Safety
    /// As for [`crate::DeviceAdaptor::memcpy_sized_async`]; the context is current.
    unsafe fn sized_copy(
        &self,
        stream: u64,
        dst: u64,
        src: u64,
        len_at: u64,
        cap: usize,
    ) -> Result<()> {
        let _ = (stream, dst, src, len_at, cap);
        Err(crate::AdaptorError::Unsupported {
            vendor: Self::VENDOR,
            op: "memcpy_sized_async",
        })
    }

    /// Enqueues one reduction step as the vendor's kernel (the core checked the operands:
    /// device memory of this context, `count > 0`, a type the vendor claims; `b` equals `a`
    /// for an averaging step); `Unsupported` (the default) where it has none.
    ///
    /// # Safety
    /// As for [`crate::DeviceAdaptor::reduce_async`]; the context is current.
    #[allow(clippy::too_many_arguments)]
    unsafe fn reduce(
        &self,
        stream: u64,
        dst: u64,
        a: u64,
        b: u64,
        count: usize,
        dtype: crate::reduce::DataType,
        step: crate::reduce::ReduceStep,
    ) -> Result<()> {
        let _ = (stream, dst, a, b, count, dtype, step);
        Err(crate::AdaptorError::Unsupported {
            vendor: Self::VENDOR,
            op: "reduce_async",
        })
    }

    /// Enqueues [`crate::DeviceAdaptor::stream_slot_steps`]'s steps as the vendor's own
    /// operation (a kernel); `Unsupported` (the default) before anything is enqueued where it
    /// has none, and the core then enqueues them as separate stream operations.
    ///
    /// # Safety
    /// As for [`crate::DeviceAdaptor::stream_slot_steps`]; the context is current.
    unsafe fn slot_steps(&self, stream: u64, steps: &[crate::SlotStep]) -> Result<()> {
        let _ = (stream, steps);
        Err(crate::AdaptorError::Unsupported {
            vendor: Self::VENDOR,
            op: "stream_slot_steps",
        })
    }

    /// Releases the device (its context) after everything else was released, at teardown.
    ///
    /// # Safety
    /// Once, last.
    unsafe fn close(&self) {}
}

/// Runs the [`HostFn`] behind `user` (boxed by `GpuAdaptor::launch_host_func`); what a
/// runtime's host-function callback calls. A panic is contained: it must not unwind into the
/// runtime.
///
/// # Safety
/// `user` is the pointer a [`Driver::launch_host_func`] call received, called exactly once.
pub unsafe fn run_host_fn(user: *mut c_void) {
    // SAFETY: per the contract, the Box<HostFn> leaked by launch_host_func, taken back once.
    let f = unsafe { Box::from_raw(user as *mut HostFn) };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        eprintln!("flagcx: a host function panicked; the panic was contained");
    }
}
