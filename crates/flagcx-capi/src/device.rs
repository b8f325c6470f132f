//! `struct flagcxDeviceHandle`: the device function table of FlagCX's header, on the current
//! device's adaptor. A NULL stream means the synchronous form: the call finishes before it
//! returns (on the device's internal stream).

use std::ffi::{c_char, c_int, c_void};

use flagcx_rs::{DeviceAdaptor, DevicePtr, IpcMemHandle, StreamHandle, Vendor};

use crate::*;

/// The table, in FlagCX's field order.
#[repr(C)]
pub struct flagcxDeviceHandle {
    /// Waits for all work of the current device (every stream made through the table).
    pub deviceSynchronize: unsafe extern "C" fn() -> flagcxResult_t,
    /// Copies bytes in the given direction.
    pub deviceMemcpy: unsafe extern "C" fn(
        *mut c_void,
        *mut c_void,
        usize,
        flagcxMemcpyType_t,
        *mut flagcxStream,
    ) -> flagcxResult_t,
    /// Sets bytes of device or host memory.
    pub deviceMemset: unsafe extern "C" fn(
        *mut c_void,
        c_int,
        usize,
        flagcxMemType_t,
        *mut flagcxStream,
    ) -> flagcxResult_t,
    /// Allocates device or pinned host memory.
    pub deviceMalloc: unsafe extern "C" fn(
        *mut *mut c_void,
        usize,
        flagcxMemType_t,
        *mut flagcxStream,
    ) -> flagcxResult_t,
    /// Frees what `deviceMalloc` returned.
    pub deviceFree:
        unsafe extern "C" fn(*mut c_void, flagcxMemType_t, *mut flagcxStream) -> flagcxResult_t,
    /// Sets the calling thread's device.
    pub setDevice: unsafe extern "C" fn(c_int) -> flagcxResult_t,
    /// The calling thread's device.
    pub getDevice: unsafe extern "C" fn(*mut c_int) -> flagcxResult_t,
    /// How many devices there are.
    pub getDeviceCount: unsafe extern "C" fn(*mut c_int) -> flagcxResult_t,
    /// The vendor's name.
    pub getVendor: unsafe extern "C" fn(*mut c_char) -> flagcxResult_t,
    /// The device address of pinned host memory.
    pub hostGetDevicePointer: unsafe extern "C" fn(*mut *mut c_void, *mut c_void) -> flagcxResult_t,
    /// Creates a stream.
    pub streamCreate: unsafe extern "C" fn(*mut *mut flagcxStream) -> flagcxResult_t,
    /// Destroys a stream `streamCreate` made.
    pub streamDestroy: unsafe extern "C" fn(*mut flagcxStream) -> flagcxResult_t,
    /// Wraps a native stream without owning it.
    pub streamCopy: unsafe extern "C" fn(*mut *mut flagcxStream, *mut c_void) -> flagcxResult_t,
    /// Forgets a wrapper.
    pub streamFree: unsafe extern "C" fn(*mut flagcxStream) -> flagcxResult_t,
    /// Waits for a stream.
    pub streamSynchronize: unsafe extern "C" fn(*mut flagcxStream) -> flagcxResult_t,
    /// Success when idle, in progress otherwise.
    pub streamQuery: unsafe extern "C" fn(*mut flagcxStream) -> flagcxResult_t,
    /// Orders a stream after an event.
    pub streamWaitEvent:
        unsafe extern "C" fn(*mut flagcxStream, *mut flagcxEvent) -> flagcxResult_t,
    /// Creates an event.
    pub eventCreate:
        unsafe extern "C" fn(*mut *mut flagcxEvent, flagcxEventType_t) -> flagcxResult_t,
    /// Destroys an event.
    pub eventDestroy: unsafe extern "C" fn(*mut flagcxEvent) -> flagcxResult_t,
    /// Records an event on a stream.
    pub eventRecord: unsafe extern "C" fn(*mut flagcxEvent, *mut flagcxStream) -> flagcxResult_t,
    /// Waits for an event.
    pub eventSynchronize: unsafe extern "C" fn(*mut flagcxEvent) -> flagcxResult_t,
    /// Success when complete, in progress otherwise.
    pub eventQuery: unsafe extern "C" fn(*mut flagcxEvent) -> flagcxResult_t,
    /// Milliseconds between two recordings.
    pub eventElapsedTime:
        unsafe extern "C" fn(*mut f32, *mut flagcxEvent, *mut flagcxEvent) -> flagcxResult_t,
    /// Allocates an IPC handle and says its size.
    pub ipcMemHandleCreate:
        unsafe extern "C" fn(*mut *mut flagcxIpcMemHandle, *mut usize) -> flagcxResult_t,
    /// Fills a handle for an allocation.
    pub ipcMemHandleGet:
        unsafe extern "C" fn(*mut flagcxIpcMemHandle, *mut c_void) -> flagcxResult_t,
    /// Maps another process's allocation.
    pub ipcMemHandleOpen:
        unsafe extern "C" fn(*mut flagcxIpcMemHandle, *mut *mut c_void) -> flagcxResult_t,
    /// Unmaps it.
    pub ipcMemHandleClose: unsafe extern "C" fn(*mut c_void) -> flagcxResult_t,
    /// Frees a handle.
    pub ipcMemHandleFree: unsafe extern "C" fn(*mut flagcxIpcMemHandle) -> flagcxResult_t,
}

/// Allocates the table.
///
/// # Safety
/// `handle` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn flagcxDeviceHandleInit(
    handle: *mut *mut flagcxDeviceHandle,
) -> flagcxResult_t {
    guard(None, || {
        let table = Box::into_raw(Box::new(flagcxDeviceHandle {
            deviceSynchronize: device_synchronize,
            deviceMemcpy: device_memcpy,
            deviceMemset: device_memset,
            deviceMalloc: device_malloc,
            deviceFree: device_free,
            setDevice: set_device,
            getDevice: get_device,
            getDeviceCount: get_device_count,
            getVendor: get_vendor,
            hostGetDevicePointer: host_get_device_pointer,
            streamCreate: stream_create,
            streamDestroy: stream_destroy,
            streamCopy: stream_copy,
            streamFree: stream_free,
            streamSynchronize: stream_synchronize,
            streamQuery: stream_query,
            streamWaitEvent: stream_wait_event,
            eventCreate: event_create,
            eventDestroy: event_destroy,
            eventRecord: event_record,
            eventSynchronize: event_synchronize,
            eventQuery: event_query,
            eventElapsedTime: event_elapsed_time,
            ipcMemHandleCreate: ipc_handle_create,
            ipcMemHandleGet: ipc_handle_get,
            ipcMemHandleOpen: ipc_handle_open,
            ipcMemHandleClose: ipc_handle_close,
            ipcMemHandleFree: ipc_handle_free,
        }));
        // SAFETY: the caller's contract.
        unsafe { put(handle, table, "table pointer") }.inspect_err(|_| {
            // SAFETY: just made, never shared.
            drop(unsafe { Box::from_raw(table) });
        })
    })
}

/// Frees the table.
///
/// # Safety
/// `handle` came from [`flagcxDeviceHandleInit`] and is not used again.
#[no_mangle]
pub unsafe extern "C" fn flagcxDeviceHandleFree(handle: *mut flagcxDeviceHandle) -> flagcxResult_t {
    guard(None, || {
        if handle.is_null() {
            return Err(invalid("NULL device table"));
        }
        // SAFETY: made by `Box::into_raw` in flagcxDeviceHandleInit.
        drop(unsafe { Box::from_raw(handle) });
        Ok(())
    })
}

/// `struct flagcxHandlerGroup`.
#[repr(C)]
pub struct flagcxHandlerGroup {
    /// An id to fill with `flagcxGetUniqueId` (or receive from rank 0).
    pub uniqueId: *mut flagcxUniqueId,
    /// NULL until `flagcxCommInitRank` fills it.
    pub comm: *mut flagcxComm,
    /// The device table.
    pub devHandle: *mut flagcxDeviceHandle,
}

/// Allocates a handler group.
///
/// # Safety
/// `handler` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn flagcxHandleInit(handler: *mut *mut flagcxHandlerGroup) -> flagcxResult_t {
    guard(None, || {
        if handler.is_null() {
            return Err(invalid("NULL handler pointer"));
        }
        let mut table = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let r = unsafe { flagcxDeviceHandleInit(&mut table) };
        if r != flagcxResult_t::flagcxSuccess {
            return Err(Failure(r, "device table".into()));
        }
        let id = Box::into_raw(Box::new(flagcxUniqueId {
            internal: [0; FLAGCX_UNIQUE_ID_BYTES],
        }));
        let group = Box::new(flagcxHandlerGroup {
            uniqueId: id,
            comm: std::ptr::null_mut(),
            devHandle: table,
        });
        // SAFETY: checked non-null.
        unsafe { handler.write(Box::into_raw(group)) };
        Ok(())
    })
}

/// Frees a handler group (its id and table; not its communicator).
///
/// # Safety
/// `handler` came from [`flagcxHandleInit`] and is not used again.
#[no_mangle]
pub unsafe extern "C" fn flagcxHandleFree(handler: *mut flagcxHandlerGroup) -> flagcxResult_t {
    guard(None, || {
        if handler.is_null() {
            return Err(invalid("NULL handler"));
        }
        // SAFETY: made by `Box::into_raw` in flagcxHandleInit, with its id and table.
        unsafe {
            let g = Box::from_raw(handler);
            if !g.uniqueId.is_null() {
                drop(Box::from_raw(g.uniqueId));
            }
            if !g.devHandle.is_null() {
                drop(Box::from_raw(g.devHandle));
            }
        }
        Ok(())
    })
}

// ---- the table's functions ---------------------------------------------------------------------

/// # Safety
/// `s` is NULL or a live stream; returns it or an error.
unsafe fn stream_ref<'a>(s: *const flagcxStream) -> R<&'a flagcxStream> {
    // SAFETY: the caller's contract.
    unsafe { s.as_ref() }.ok_or_else(|| invalid("NULL stream"))
}

/// # Safety
/// `e` is NULL or a live event.
unsafe fn event_ref<'a>(e: *const flagcxEvent) -> R<&'a flagcxEvent> {
    // SAFETY: the caller's contract.
    unsafe { e.as_ref() }.ok_or_else(|| invalid("NULL event"))
}

/// `Ok(true)` becomes success, `Ok(false)` in progress.
fn done_or_in_progress(r: flagcx_rs::Result<bool>) -> flagcxResult_t {
    match r {
        Ok(true) => flagcxResult_t::flagcxSuccess,
        Ok(false) => flagcxResult_t::flagcxInProgress,
        Err(e) => guard(None, || Err(e.into())),
    }
}

unsafe extern "C" fn device_synchronize() -> flagcxResult_t {
    guard(None, || {
        let (d, a) = adaptor()?;
        for s in device_streams(d)? {
            a.stream_synchronize(s)?;
        }
        Ok(())
    })
}

unsafe extern "C" fn device_memcpy(
    dst: *mut c_void,
    src: *mut c_void,
    size: usize,
    kind: flagcxMemcpyType_t,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    guard(None, || {
        let (d, a) = adaptor()?;
        // SAFETY: the caller's contract for the stream.
        let (s, sync) = unsafe { stream_or_sync(stream, d, &a) }?;
        // SAFETY: the caller guarantees both buffers hold `size` bytes until the copy is done
        // (at return for a NULL stream); the adaptor checks device pointers.
        unsafe {
            match kind {
                0 => a.memcpy_h2d_async(DevicePtr(dst as u64), src as *const u8, size, s)?,
                1 => a.memcpy_d2h_async(dst as *mut u8, DevicePtr(src as u64), size, s)?,
                2 => a.memcpy_d2d_async(DevicePtr(dst as u64), DevicePtr(src as u64), size, s)?,
                other => return Err(invalid(format!("unknown copy direction {other}"))),
            }
        }
        if sync {
            a.stream_synchronize(s)?;
        }
        Ok(())
    })
}

unsafe extern "C" fn device_memset(
    ptr: *mut c_void,
    value: c_int,
    size: usize,
    kind: flagcxMemType_t,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    guard(None, || match kind {
        0 => {
            if ptr.is_null() && size > 0 {
                return Err(invalid("NULL host pointer"));
            }
            // SAFETY: host memory of `size` bytes by the caller's contract.
            unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), value as u8, size) };
            Ok(())
        }
        1 => {
            let (d, a) = adaptor()?;
            // SAFETY: the caller's contract for the stream.
            let (s, sync) = unsafe { stream_or_sync(stream, d, &a) }?;
            // SAFETY: the adaptor checks the range is device memory it handed out.
            unsafe { a.memset_async(DevicePtr(ptr as u64), value as u8, size, s) }?;
            if sync {
                a.stream_synchronize(s)?;
            }
            Ok(())
        }
        other => Err(Failure(
            flagcxResult_t::flagcxNotSupported,
            format!("deviceMemset on memory type {other}"),
        )),
    })
}

unsafe extern "C" fn device_malloc(
    ptr: *mut *mut c_void,
    size: usize,
    kind: flagcxMemType_t,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    let _ = stream; // allocation is synchronous: usable on any stream once this returns
    guard(None, || {
        let (_, a) = adaptor()?;
        let p = match kind {
            0 => a.host_alloc(size)?.cast::<c_void>(),
            1 => a.mem_alloc(size)?.0 as *mut c_void,
            other => {
                return Err(Failure(
                    flagcxResult_t::flagcxNotSupported,
                    format!("deviceMalloc of memory type {other} (managed memory)"),
                ))
            }
        };
        // SAFETY: the caller's contract.
        unsafe { put(ptr, p, "pointer") }
    })
}

unsafe extern "C" fn device_free(
    ptr: *mut c_void,
    kind: flagcxMemType_t,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    guard(None, || {
        let (d, a) = adaptor()?;
        // SAFETY: the caller's contract.
        if let Some(s) = unsafe { stream.as_ref() } {
            if s.device == d {
                // Work on the stream may still use the memory.
                a.stream_synchronize(s.handle)?;
            }
        }
        // SAFETY: the caller gives the memory up; the adaptor refuses foreign pointers.
        unsafe {
            match kind {
                0 => a.host_free(ptr.cast::<u8>())?,
                1 => a.mem_free(DevicePtr(ptr as u64))?,
                other => return Err(invalid(format!("memory type {other}"))),
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn set_device(dev: c_int) -> flagcxResult_t {
    guard(None, || {
        let (_, a) = adaptor()?;
        let count = a.device_count()?;
        if dev < 0 || dev as usize >= count {
            return Err(invalid(format!("device {dev}: {count} present")));
        }
        adaptor_for(dev as usize)?;
        set_current_device(dev as usize);
        Ok(())
    })
}

unsafe extern "C" fn get_device(dev: *mut c_int) -> flagcxResult_t {
    // SAFETY: the caller's contract.
    guard(None, || unsafe {
        put(dev, current_device()? as c_int, "device pointer")
    })
}

unsafe extern "C" fn get_device_count(count: *mut c_int) -> flagcxResult_t {
    guard(None, || {
        let (_, a) = adaptor()?;
        // SAFETY: the caller's contract.
        unsafe { put(count, a.device_count()? as c_int, "count pointer") }
    })
}

unsafe extern "C" fn get_vendor(vendor: *mut c_char) -> flagcxResult_t {
    guard(None, || {
        if vendor.is_null() {
            return Err(invalid("NULL vendor buffer"));
        }
        let (_, a) = adaptor()?;
        let name = a.vendor().name().as_bytes();
        // SAFETY: FlagCX's callers pass a buffer of at least 128 bytes; names are shorter.
        unsafe {
            std::ptr::copy_nonoverlapping(name.as_ptr().cast::<c_char>(), vendor, name.len());
            vendor.add(name.len()).write(0);
        }
        Ok(())
    })
}

unsafe extern "C" fn host_get_device_pointer(
    device: *mut *mut c_void,
    host: *mut c_void,
) -> flagcxResult_t {
    guard(None, || {
        let (_, a) = adaptor()?;
        match a.vendor() {
            // Unified addressing: pinned, mapped host memory has the same address there.
            Vendor::Cuda | Vendor::Hip => {
                // SAFETY: the caller's contract.
                unsafe { put(device, host, "pointer") }
            }
            v => Err(Failure(
                flagcxResult_t::flagcxNotSupported,
                format!("hostGetDevicePointer on {v}: no unified addressing"),
            )),
        }
    })
}

fn new_stream(handle: StreamHandle, device: usize, kind: StreamKind) -> *mut flagcxStream {
    Box::into_raw(Box::new(flagcxStream {
        base: handle.0 as *mut c_void,
        handle,
        device,
        kind,
    }))
}

unsafe extern "C" fn stream_create(stream: *mut *mut flagcxStream) -> flagcxResult_t {
    guard(None, || {
        if stream.is_null() {
            return Err(invalid("NULL stream pointer"));
        }
        let (d, a) = adaptor()?;
        let h = a.stream_create()?;
        track_stream(d, h, true)?;
        // SAFETY: checked non-null.
        unsafe { stream.write(new_stream(h, d, StreamKind::Owned)) };
        Ok(())
    })
}

unsafe extern "C" fn stream_destroy(stream: *mut flagcxStream) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        let s = unsafe { stream_ref(stream) }?;
        if s.kind != StreamKind::Owned {
            return Err(Failure(
                flagcxResult_t::flagcxInvalidUsage,
                "streamDestroy of a wrapped stream: use streamFree".into(),
            ));
        }
        let a = adaptor_for(s.device)?;
        a.stream_destroy(s.handle)?;
        track_stream(s.device, s.handle, false)?;
        // SAFETY: made by `new_stream`; the caller gives it up.
        drop(unsafe { Box::from_raw(stream) });
        Ok(())
    })
}

unsafe extern "C" fn stream_copy(new: *mut *mut flagcxStream, old: *mut c_void) -> flagcxResult_t {
    guard(None, || {
        if new.is_null() {
            return Err(invalid("NULL stream pointer"));
        }
        let (d, a) = adaptor()?;
        let raw = old as u64;
        let s = if known_stream(d, raw)? {
            new_stream(StreamHandle(raw), d, StreamKind::Wrapped)
        } else {
            // SAFETY: the caller hands us a live native stream of this device that outlives
            // the wrapper (FlagCX's streamCopy contract).
            let h = unsafe { a.stream_adopt(raw) }?;
            new_stream(h, d, StreamKind::Adopted)
        };
        // SAFETY: checked non-null.
        unsafe { new.write(s) };
        Ok(())
    })
}

unsafe extern "C" fn stream_free(stream: *mut flagcxStream) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        let s = unsafe { stream_ref(stream) }?;
        match s.kind {
            StreamKind::Owned => {
                return Err(Failure(
                    flagcxResult_t::flagcxInvalidUsage,
                    "streamFree of a stream streamCreate made: use streamDestroy".into(),
                ))
            }
            StreamKind::Adopted => adaptor_for(s.device)?.stream_release(s.handle)?,
            StreamKind::Wrapped => {}
        }
        // SAFETY: made by `new_stream`; the caller gives it up.
        drop(unsafe { Box::from_raw(stream) });
        Ok(())
    })
}

unsafe extern "C" fn stream_synchronize(stream: *mut flagcxStream) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        let s = unsafe { stream_ref(stream) }?;
        Ok(adaptor_for(s.device)?.stream_synchronize(s.handle)?)
    })
}

unsafe extern "C" fn stream_query(stream: *mut flagcxStream) -> flagcxResult_t {
    // SAFETY: the caller's contract.
    match unsafe { stream_ref(stream) }.and_then(|s| Ok((adaptor_for(s.device)?, s.handle))) {
        Ok((a, h)) => done_or_in_progress(a.stream_query(h)),
        Err(f) => guard(None, || Err(f)),
    }
}

unsafe extern "C" fn stream_wait_event(
    stream: *mut flagcxStream,
    event: *mut flagcxEvent,
) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        let (s, e) = unsafe { (stream_ref(stream)?, event_ref(event)?) };
        Ok(adaptor_for(s.device)?.stream_wait_event(s.handle, e.handle)?)
    })
}

unsafe extern "C" fn event_create(
    event: *mut *mut flagcxEvent,
    kind: flagcxEventType_t,
) -> flagcxResult_t {
    guard(None, || {
        if event.is_null() {
            return Err(invalid("NULL event pointer"));
        }
        let (d, a) = adaptor()?;
        let h = a.event_create(kind == 0)?;
        let e = Box::into_raw(Box::new(flagcxEvent {
            base: h.0 as *mut c_void,
            handle: h,
            device: d,
        }));
        // SAFETY: checked non-null.
        unsafe { event.write(e) };
        Ok(())
    })
}

unsafe extern "C" fn event_destroy(event: *mut flagcxEvent) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        let e = unsafe { event_ref(event) }?;
        adaptor_for(e.device)?.event_destroy(e.handle)?;
        // SAFETY: made with `Box::into_raw` in event_create; the caller gives it up.
        drop(unsafe { Box::from_raw(event) });
        Ok(())
    })
}

unsafe extern "C" fn event_record(
    event: *mut flagcxEvent,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        let (e, s) = unsafe { (event_ref(event)?, stream_ref(stream)?) };
        Ok(adaptor_for(e.device)?.event_record(e.handle, s.handle)?)
    })
}

unsafe extern "C" fn event_synchronize(event: *mut flagcxEvent) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        let e = unsafe { event_ref(event) }?;
        Ok(adaptor_for(e.device)?.event_synchronize(e.handle)?)
    })
}

unsafe extern "C" fn event_query(event: *mut flagcxEvent) -> flagcxResult_t {
    // SAFETY: the caller's contract.
    match unsafe { event_ref(event) }.and_then(|e| Ok((adaptor_for(e.device)?, e.handle))) {
        Ok((a, h)) => done_or_in_progress(a.event_query(h)),
        Err(f) => guard(None, || Err(f)),
    }
}

unsafe extern "C" fn event_elapsed_time(
    ms: *mut f32,
    start: *mut flagcxEvent,
    end: *mut flagcxEvent,
) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        let (s, e) = unsafe { (event_ref(start)?, event_ref(end)?) };
        let v = adaptor_for(s.device)?.event_elapsed_ms(s.handle, e.handle)?;
        // SAFETY: the caller's contract.
        unsafe { put(ms, v, "milliseconds pointer") }
    })
}

unsafe extern "C" fn ipc_handle_create(
    handle: *mut *mut flagcxIpcMemHandle,
    size: *mut usize,
) -> flagcxResult_t {
    guard(None, || {
        if handle.is_null() || size.is_null() {
            return Err(invalid("NULL handle or size pointer"));
        }
        let h = Box::into_raw(Box::new(flagcxIpcMemHandle {
            bytes: [0; IpcMemHandle::WIRE_LEN],
        }));
        // SAFETY: both checked non-null.
        unsafe {
            handle.write(h);
            size.write(IpcMemHandle::WIRE_LEN);
        }
        Ok(())
    })
}

unsafe extern "C" fn ipc_handle_get(
    handle: *mut flagcxIpcMemHandle,
    ptr: *mut c_void,
) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        let h = unsafe { handle.as_mut() }.ok_or_else(|| invalid("NULL IPC handle"))?;
        let (_, a) = adaptor()?;
        h.bytes = a.ipc_get_handle(DevicePtr(ptr as u64))?.to_wire();
        Ok(())
    })
}

unsafe extern "C" fn ipc_handle_open(
    handle: *mut flagcxIpcMemHandle,
    ptr: *mut *mut c_void,
) -> flagcxResult_t {
    guard(None, || {
        // SAFETY: the caller's contract.
        let h = unsafe { handle.as_ref() }.ok_or_else(|| invalid("NULL IPC handle"))?;
        let (_, a) = adaptor()?;
        let p = a.ipc_open_handle(&IpcMemHandle::from_wire(&h.bytes)?)?;
        // SAFETY: the caller's contract.
        unsafe { put(ptr, p.0 as *mut c_void, "pointer") }
    })
}

unsafe extern "C" fn ipc_handle_close(ptr: *mut c_void) -> flagcxResult_t {
    guard(None, || {
        let (_, a) = adaptor()?;
        // SAFETY: the caller gives the mapping up; the adaptor refuses foreign pointers.
        Ok(unsafe { a.ipc_close(DevicePtr(ptr as u64)) }?)
    })
}

unsafe extern "C" fn ipc_handle_free(handle: *mut flagcxIpcMemHandle) -> flagcxResult_t {
    guard(None, || {
        if handle.is_null() {
            return Err(invalid("NULL IPC handle"));
        }
        // SAFETY: made with `Box::into_raw` in ipc_handle_create; the caller gives it up.
        drop(unsafe { Box::from_raw(handle) });
        Ok(())
    })
}
