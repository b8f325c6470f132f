//! `libflagcx`: the C interface of flagcx-rs, compatible with FlagCX's `flagcx.h` (API 0.13)
//! for the communicator, point-to-point, the device function table and registration; the
//! header is `include/flagcx.h` (every function documented there).
//!
//! Every exported function:
//! - checks its pointers and handles and returns a `flagcxResult_t`; it never unwinds into C
//!   (a panic becomes `flagcxInternalError`) and never aborts the process;
//! - records what went wrong for `flagcxGetLastError` — per thread, and per communicator for
//!   calls that take one.
//!
//! Device work goes to one process-wide [`Adaptor`] per device of one vendor (`FLAGCX_VENDOR`,
//! else the first compiled-in vendor with a device), shared by the device table and every
//! communicator, so streams made through the table are streams of the communicator's adaptor.

// tidy: long file: one C entry point per function of the header, each a few checked lines.

#![allow(non_camel_case_types, non_snake_case)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard, OnceLock};

use flagcx_rs::p2p::{Config, UniqueId};
use flagcx_rs::{
    Adaptor, AdaptorError, Collective, Comm, CommError, DataType, DeviceAdaptor, DevicePtr,
    EventHandle, IpcMemHandle, ReduceOp, Request, StreamHandle, Vendor,
};

mod device;
mod port;
mod unsupported;
pub use device::*;
pub use port::*;
pub use unsupported::*;

/// `flagcxResult_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum flagcxResult_t {
    /// Success.
    flagcxSuccess = 0,
    /// The device runtime failed.
    flagcxUnhandledDeviceError = 1,
    /// A system call, socket or shared memory failed.
    flagcxSystemError = 2,
    /// A bug in flagcx-rs.
    flagcxInternalError = 3,
    /// A bad pointer, count, rank or handle.
    flagcxInvalidArgument = 4,
    /// A call out of order, mismatched sizes, an aborted communicator.
    flagcxInvalidUsage = 5,
    /// A peer failed, timed out or went away.
    flagcxRemoteError = 6,
    /// Not finished yet.
    flagcxInProgress = 7,
    /// An underlying communication library failed.
    flagcxUnhandledCCLError = 8,
    /// Not implemented on this build or vendor.
    flagcxNotSupported = 9,
    /// The number of codes.
    flagcxNumResults = 10,
}

use flagcxResult_t::*;

/// `flagcxDataType_t` (C enums are `int`).
pub type flagcxDataType_t = c_int;
/// `flagcxRedOp_t`.
pub type flagcxRedOp_t = c_int;
/// `flagcxMemcpyType_t`: host to device 0, device to host 1, device to device 2.
pub type flagcxMemcpyType_t = c_int;
/// `flagcxMemType_t`: host (pinned) 0, device 1, managed 2.
pub type flagcxMemType_t = c_int;
/// `flagcxEventType_t`: default 0, timing disabled 1.
pub type flagcxEventType_t = c_int;
/// `flagcxMemAllocator_t`: CCL 0, SHMEM 1.
pub type flagcxMemAllocator_t = c_int;

/// Bytes of `FLAGCX_UNIQUE_ID_BYTES`.
pub const FLAGCX_UNIQUE_ID_BYTES: usize = 256;

/// `flagcxUniqueId`: the job id as NUL-terminated text (`fx1-<name>-<secret>`), padded.
#[repr(C)]
pub struct flagcxUniqueId {
    /// The bytes.
    pub internal: [c_char; FLAGCX_UNIQUE_ID_BYTES],
}

/// A communicator behind `flagcxComm_t`.
pub struct flagcxComm {
    pub(crate) comm: Comm<Adaptor>,
    /// A stream for calls given a NULL stream.
    default_stream: StreamHandle,
    /// Requests not seen finished yet (for `flagcxCommFinalize`).
    pending: Mutex<Vec<Request>>,
    /// Open `flagcxGroupStart`s per thread: only a thread's outermost pair opens and submits
    /// its group (groups are per thread, as NCCL's are).
    depth: Mutex<HashMap<std::thread::ThreadId, usize>>,
    last_error: Mutex<CString>,
    homo: bool,
}

/// `flagcxStream_t`'s target: the native stream first, as FlagCX's plugins read it.
#[repr(C)]
pub struct flagcxStream {
    /// The vendor's own stream handle (`CUstream`, `hipStream_t`; the adaptor's handle for
    /// vendors without one).
    pub base: *mut c_void,
    handle: StreamHandle,
    device: usize,
    kind: StreamKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamKind {
    /// Made by `streamCreate`: destroyed by `streamDestroy`.
    Owned,
    /// A wrapper of a stream this library already knows: `streamFree` drops the wrapper.
    Wrapped,
    /// A native stream of the application, adopted by the adaptor: `streamFree` releases it.
    Adopted,
}

/// `flagcxEvent_t`'s target.
#[repr(C)]
pub struct flagcxEvent {
    /// The adaptor's event handle.
    pub base: *mut c_void,
    handle: EventHandle,
    device: usize,
}

/// `flagcxIpcMemHandle_t`'s target: the handle's wire bytes, copied between processes as
/// `ipcMemHandleCreate`'s size says.
#[repr(C)]
pub struct flagcxIpcMemHandle {
    bytes: [u8; IpcMemHandle::WIRE_LEN],
}

// ---- errors ----------------------------------------------------------------------------------

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn cstring(s: &str) -> CString {
    CString::new(s.replace('\0', " ")).unwrap_or_default()
}

/// A failure: its code and what to say.
pub(crate) struct Failure(pub(crate) flagcxResult_t, pub(crate) String);

impl From<CommError> for Failure {
    fn from(e: CommError) -> Self {
        let code = match &e {
            CommError::Adaptor(a) => return Failure::from(a.clone()),
            CommError::Io { .. } | CommError::Bootstrap(_) | CommError::Net(_) => flagcxSystemError,
            CommError::Config { .. } | CommError::InvalidArgument(_) => flagcxInvalidArgument,
            CommError::SizeMismatch { .. } | CommError::Aborted => flagcxInvalidUsage,
            CommError::Protocol(_)
            | CommError::PeerLost { .. }
            | CommError::RemoteFailure { .. }
            | CommError::Timeout { .. } => flagcxRemoteError,
            _ => flagcxInternalError,
        };
        Failure(code, e.to_string())
    }
}

impl From<AdaptorError> for Failure {
    fn from(e: AdaptorError) -> Self {
        let code = match &e {
            AdaptorError::Unsupported { .. } => flagcxNotSupported,
            AdaptorError::InvalidArgument { .. }
            | AdaptorError::InvalidHandle { .. }
            | AdaptorError::InvalidDevice { .. } => flagcxInvalidArgument,
            AdaptorError::Os { .. } => flagcxSystemError,
            _ => flagcxUnhandledDeviceError,
        };
        Failure(code, e.to_string())
    }
}

impl From<Failure> for CommError {
    fn from(f: Failure) -> Self {
        CommError::InvalidArgument(f.1)
    }
}

pub(crate) fn invalid(what: impl Into<String>) -> Failure {
    Failure(flagcxInvalidArgument, what.into())
}

pub(crate) type R<T = ()> = Result<T, Failure>;

/// Runs an entry point's body: records a failure for `flagcxGetLastError` (the thread's, and
/// `comm`'s where given) and turns a panic into `flagcxInternalError`.
pub(crate) fn guard(comm: Option<*const flagcxComm>, body: impl FnOnce() -> R) -> flagcxResult_t {
    let r = catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        Err(Failure(
            flagcxInternalError,
            "panic inside libflagcx".into(),
        ))
    });
    match r {
        Ok(()) => flagcxSuccess,
        Err(Failure(code, msg)) => {
            let text = cstring(&msg);
            if let Some(c) = comm.filter(|c| !c.is_null()) {
                // SAFETY: a non-null communicator pointer the caller passed, checked by the
                // body before use; a stale one is the caller's contract violation.
                *lock(unsafe { &(*c).last_error }) = text.clone();
            }
            LAST_ERROR.with(|l| *l.borrow_mut() = text);
            code
        }
    }
}

/// The communicator behind `comm`, or an `InvalidArgument` failure for NULL.
///
/// # Safety
/// `comm` is NULL or a live communicator from `flagcxCommInitRank`.
pub(crate) unsafe fn comm_ref<'a>(comm: *const flagcxComm) -> R<&'a flagcxComm> {
    // SAFETY: the caller's contract.
    unsafe { comm.as_ref() }.ok_or_else(|| invalid("NULL communicator"))
}

/// Writes `v` through `out`, or fails for NULL.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, v: T, what: &str) -> R {
    if out.is_null() {
        return Err(invalid(format!("NULL {what}")));
    }
    // SAFETY: non-null, and valid by the caller's contract.
    unsafe { out.write(v) };
    Ok(())
}

// ---- the process-wide device state -----------------------------------------------------------

struct Devices {
    vendor: Vendor,
    /// The device a thread uses until it calls `setDevice`.
    default_device: usize,
    open: HashMap<usize, Adaptor>,
    /// Per device, the internal stream of synchronous calls and the streams made through the
    /// table (for `deviceSynchronize`).
    sync_stream: HashMap<usize, StreamHandle>,
    streams: HashMap<usize, Vec<StreamHandle>>,
}

fn devices() -> R<MutexGuard<'static, Devices>> {
    static DEVICES: OnceLock<Result<Mutex<Devices>, String>> = OnceLock::new();
    let d = DEVICES.get_or_init(|| {
        // FLAGCX_VENDOR (else detection) and FLAGCX_DEVICE / the local rank, as in Rust.
        let first = Adaptor::from_env().map_err(|e| e.to_string())?;
        let (vendor, device) = (first.vendor(), first.device());
        Ok(Mutex::new(Devices {
            vendor,
            default_device: device,
            open: HashMap::from([(device, first)]),
            sync_stream: HashMap::new(),
            streams: HashMap::new(),
        }))
    });
    match d {
        Ok(m) => Ok(lock(m)),
        Err(e) => Err(Failure(
            flagcxUnhandledDeviceError,
            format!("no device: {e}"),
        )),
    }
}

thread_local! {
    static CURRENT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The calling thread's current device.
pub(crate) fn current_device() -> R<usize> {
    let default = devices()?.default_device;
    Ok(CURRENT.with(|c| c.get()).unwrap_or(default))
}

pub(crate) fn set_current_device(d: usize) {
    CURRENT.with(|c| c.set(Some(d)));
}

/// The adaptor of device `d`, opened on first use.
pub(crate) fn adaptor_for(d: usize) -> R<Adaptor> {
    let mut devs = devices()?;
    if let Some(a) = devs.open.get(&d) {
        return Ok(a.clone());
    }
    let a = Adaptor::open(devs.vendor, d)?;
    devs.open.insert(d, a.clone());
    Ok(a)
}

/// The current device's adaptor.
pub(crate) fn adaptor() -> R<(usize, Adaptor)> {
    let d = current_device()?;
    Ok((d, adaptor_for(d)?))
}

/// The device's stream for calls given no stream.
pub(crate) fn sync_stream(d: usize, a: &Adaptor) -> R<StreamHandle> {
    let mut devs = devices()?;
    if let Some(s) = devs.sync_stream.get(&d) {
        return Ok(*s);
    }
    let s = a.stream_create()?;
    devs.sync_stream.insert(d, s);
    Ok(s)
}

pub(crate) fn track_stream(d: usize, s: StreamHandle, add: bool) -> R {
    let mut devs = devices()?;
    let list = devs.streams.entry(d).or_default();
    if add {
        list.push(s);
    } else {
        list.retain(|x| *x != s);
    }
    Ok(())
}

pub(crate) fn device_streams(d: usize) -> R<Vec<StreamHandle>> {
    let devs = devices()?;
    let mut v = devs.streams.get(&d).cloned().unwrap_or_default();
    v.extend(devs.sync_stream.get(&d));
    Ok(v)
}

pub(crate) fn known_stream(d: usize, raw: u64) -> R<bool> {
    let devs = devices()?;
    Ok(devs
        .streams
        .get(&d)
        .is_some_and(|v| v.iter().any(|s| s.0 == raw))
        || devs.sync_stream.get(&d).is_some_and(|s| s.0 == raw))
}

/// The stream a call uses: the given one (checked to belong to `device`), or, for NULL, the
/// device's internal stream and `true` (the call must finish before returning).
///
/// # Safety
/// `stream` is NULL or a live `flagcxStream_t`.
pub(crate) unsafe fn stream_or_sync(
    stream: *const flagcxStream,
    device: usize,
    a: &Adaptor,
) -> R<(StreamHandle, bool)> {
    // SAFETY: the caller's contract.
    match unsafe { stream.as_ref() } {
        Some(s) if s.device != device => Err(invalid(format!(
            "the stream belongs to device {}, the call to device {device}",
            s.device
        ))),
        Some(s) => Ok((s.handle, false)),
        None => Ok((sync_stream(device, a)?, true)),
    }
}

// ---- data types, version, ids ------------------------------------------------------------------

/// Bytes of one element of `dtype` (0 for an unknown type).
#[no_mangle]
pub extern "C" fn getFlagcxDataTypeSize(dtype: flagcxDataType_t) -> usize {
    match dtype {
        0 | 1 => 1,
        6 | 9 => 2,
        2 | 3 | 7 => 4,
        4 | 5 | 8 => 8,
        _ => 0,
    }
}

/// The API version, `major * 10000 + minor * 100 + patch`: 1300 for FlagCX's 0.13.
///
/// # Safety
/// `version` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn flagcxGetVersion(version: *mut c_int) -> flagcxResult_t {
    // SAFETY: the caller's contract.
    guard(None, || unsafe { put(version, 1300, "version pointer") })
}

/// Makes a new job id.
///
/// # Safety
/// `unique_id` is NULL or points to a writable `flagcxUniqueId`.
#[no_mangle]
pub unsafe extern "C" fn flagcxGetUniqueId(unique_id: *mut flagcxUniqueId) -> flagcxResult_t {
    guard(None, || {
        if unique_id.is_null() {
            return Err(invalid("NULL unique id"));
        }
        let text = UniqueId::random()?.to_string();
        let mut bytes = [0 as c_char; FLAGCX_UNIQUE_ID_BYTES];
        for (b, c) in bytes.iter_mut().zip(text.bytes()) {
            *b = c as c_char;
        }
        // SAFETY: checked non-null; the caller's contract for the rest.
        unsafe { (*unique_id).internal = bytes };
        Ok(())
    })
}

/// The id's text (up to its NUL).
fn unique_id_text(id: &flagcxUniqueId) -> R<String> {
    let bytes: Vec<u8> = id
        .internal
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8(bytes).map_err(|_| invalid("the unique id is not one flagcxGetUniqueId made"))
}

// ---- communicators ---------------------------------------------------------------------------

/// Joins job `comm_id` as `rank` of `nranks`.
///
/// # Safety
/// `comm` is NULL or writable; `comm_id` is NULL or a readable `flagcxUniqueId`.
#[no_mangle]
pub unsafe extern "C" fn flagcxCommInitRank(
    comm: *mut *mut flagcxComm,
    nranks: c_int,
    comm_id: *const flagcxUniqueId,
    rank: c_int,
) -> flagcxResult_t {
    // FLAGCX_DEBUG reaches C programs too: the library's log goes to stderr once asked for
    // (a logger the application installed first is kept).
    if std::env::var_os("FLAGCX_DEBUG").is_some() {
        flagcx_rs::init_logging();
    }
    guard(None, || {
        if comm.is_null() {
            return Err(invalid("NULL communicator pointer"));
        }
        // SAFETY: the caller's contract.
        let id = unsafe { comm_id.as_ref() }.ok_or_else(|| invalid("NULL unique id"))?;
        if nranks < 1 || rank < 0 || rank >= nranks {
            return Err(invalid(format!("rank {rank} of {nranks} ranks")));
        }
        let id: UniqueId = unique_id_text(id)?.parse()?;
        let (_, a) = adaptor()?;
        let config = Config::from_env()?;
        let c = Comm::init(a.clone(), rank as usize, nranks as usize, &id, config)?;
        let homo = (0..c.nranks())
            .filter(|&q| q != c.rank())
            .all(|q| c.peer_info(q).is_some_and(|p| p.vendor == a.vendor()));
        let default_stream = a.stream_create()?;
        let boxed = Box::new(flagcxComm {
            comm: c,
            default_stream,
            pending: Mutex::new(Vec::new()),
            depth: Mutex::default(),
            last_error: Mutex::new(CString::default()),
            homo,
        });
        // SAFETY: checked non-null; writable by the caller's contract.
        unsafe { comm.write(Box::into_raw(boxed)) };
        Ok(())
    })
}

/// Waits for every operation this rank issued on `comm`; returns the first failure.
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn flagcxCommFinalize(comm: *mut flagcxComm) -> flagcxResult_t {
    guard(Some(comm), || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm) }?;
        let pending = std::mem::take(&mut *lock(&c.pending));
        let mut first = None;
        for r in pending {
            if let Err(e) = r.wait() {
                first.get_or_insert(e);
            }
        }
        c.comm.adaptor().stream_synchronize(c.default_stream)?;
        first.map_or(Ok(()), |e| Err(e.into()))
    })
}

/// Frees the communicator.
///
/// # Safety
/// `comm` is NULL or a live communicator, not used again afterwards.
#[no_mangle]
pub unsafe extern "C" fn flagcxCommDestroy(comm: *mut flagcxComm) -> flagcxResult_t {
    guard(None, || {
        if comm.is_null() {
            return Err(invalid("NULL communicator"));
        }
        // SAFETY: made by `Box::into_raw` in flagcxCommInitRank; the caller gives it up.
        let c = unsafe { Box::from_raw(comm) };
        let stream = c.default_stream;
        let a = c.comm.adaptor().clone();
        drop(c);
        let _ = a.stream_destroy(stream);
        Ok(())
    })
}

/// Aborts and frees the communicator.
///
/// # Safety
/// As [`flagcxCommDestroy`].
#[no_mangle]
pub unsafe extern "C" fn flagcxCommAbort(comm: *mut flagcxComm) -> flagcxResult_t {
    if !comm.is_null() {
        // SAFETY: the caller's contract.
        let _ = catch_unwind(AssertUnwindSafe(|| unsafe { (*comm).comm.abort() }));
    }
    // SAFETY: forwarded contract.
    unsafe { flagcxCommDestroy(comm) }
}

/// The first asynchronous failure, or success; never waits.
///
/// # Safety
/// `comm` is NULL or live; `async_error` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn flagcxCommGetAsyncError(
    comm: *mut flagcxComm,
    async_error: *mut flagcxResult_t,
) -> flagcxResult_t {
    guard(Some(comm), || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm) }?;
        let code = match c.comm.async_error() {
            None => flagcxSuccess,
            Some(e) => {
                let f = Failure::from(e);
                *lock(&c.last_error) = cstring(&f.1);
                f.0
            }
        };
        // SAFETY: the caller's contract.
        unsafe { put(async_error, code, "result pointer") }
    })
}

macro_rules! comm_query {
    ($(#[$doc:meta])* $name:ident, $what:literal, |$c:ident| $value:expr) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `comm` is NULL or a live communicator; `out` is NULL or writable.
        #[no_mangle]
        pub unsafe extern "C" fn $name(comm: *const flagcxComm, out: *mut c_int) -> flagcxResult_t {
            guard(Some(comm), || {
                // SAFETY: the caller's contract.
                let $c = unsafe { comm_ref(comm) }?;
                // SAFETY: the caller's contract.
                unsafe { put(out, $value as c_int, $what) }
            })
        }
    };
}

comm_query!(
    /// Ranks in the job.
    flagcxCommCount, "count pointer", |c| c.comm.nranks()
);
comm_query!(
    /// This rank.
    flagcxCommUserRank, "rank pointer", |c| c.comm.rank()
);
comm_query!(
    /// The device this rank uses.
    flagcxCommGetDeviceNumber, "device pointer", |c| c.comm.adaptor().device()
);
comm_query!(
    /// 1 when every rank uses the same vendor, else 0.
    flagcxIsHomoComm, "result pointer", |c| c.homo
);

/// A static description of a result code.
#[no_mangle]
pub extern "C" fn flagcxGetErrorString(result: c_int) -> *const c_char {
    // An int, not the enum: C may pass any value.
    let s: &'static CStr = match result {
        0 => c"no error",
        1 => c"unhandled device runtime error (see flagcxGetLastError)",
        2 => c"system error (a system call, socket or shared memory failed)",
        3 => c"internal error (a bug in flagcx-rs)",
        4 => c"invalid argument",
        5 => c"invalid usage",
        6 => c"remote error (a peer failed, timed out or went away)",
        7 => c"operation in progress",
        8 => c"unhandled communication library error",
        9 => c"not supported",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

/// What the last failed call said: `comm`'s, or with NULL the calling thread's. The text
/// stays valid until the next failure recorded there.
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn flagcxGetLastError(comm: *mut flagcxComm) -> *const c_char {
    // SAFETY: the caller's contract.
    match unsafe { comm.as_ref() } {
        // The CString lives in the communicator until it is replaced or freed.
        Some(c) => lock(&c.last_error).as_ptr(),
        None => LAST_ERROR.with(|l| l.borrow().as_ptr()),
    }
}

// ---- groups, send, receive, barrier ------------------------------------------------------------

/// Opens a group (they nest; the outermost pair counts).
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn flagcxGroupStart(comm: *mut flagcxComm) -> flagcxResult_t {
    guard(Some(comm), || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm) }?;
        let mut depths = lock(&c.depth);
        let depth = depths.entry(std::thread::current().id()).or_insert(0);
        if *depth == 0 {
            c.comm.group_begin()?;
        }
        *depth += 1;
        Ok(())
    })
}

/// Closes a group; the outermost end enqueues its operations.
///
/// # Safety
/// `comm` is NULL or a live communicator.
#[no_mangle]
pub unsafe extern "C" fn flagcxGroupEnd(comm: *mut flagcxComm) -> flagcxResult_t {
    guard(Some(comm), || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm) }?;
        let mut depths = lock(&c.depth);
        let me = std::thread::current().id();
        match depths.get(&me).copied().unwrap_or(0) {
            0 => Err(Failure(
                flagcxInvalidUsage,
                "flagcxGroupEnd without flagcxGroupStart on this thread".into(),
            )),
            1 => {
                depths.remove(&me);
                Ok(c.comm.group_end()?)
            }
            d => {
                depths.insert(me, d - 1);
                Ok(())
            }
        }
    })
}

enum Dir {
    Send,
    Recv,
}

/// Posts one send or receive of `count` elements.
///
/// # Safety
/// `comm` and `stream` are NULL or live; the buffer holds `count` elements of `dtype` and
/// stays valid until the stream passes the operation.
unsafe fn post(
    dir: Dir,
    buf: *const c_void,
    count: usize,
    dtype: flagcxDataType_t,
    peer: c_int,
    comm: *mut flagcxComm,
    stream: *const flagcxStream,
) -> flagcxResult_t {
    guard(Some(comm), || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm) }?;
        let bytes = byte_count(count, dtype)?;
        if peer < 0 {
            return Err(invalid(format!("peer {peer}")));
        }
        // SAFETY: the caller's contract.
        let s = unsafe { coll_stream(c, stream) }?;
        let ptr = DevicePtr(buf as u64);
        // SAFETY: the caller keeps the buffer valid until the stream passes the operation
        // (the C API's contract, as NCCL's).
        let r = unsafe {
            match dir {
                Dir::Send => c.comm.send_raw(ptr, bytes, peer as usize, s),
                Dir::Recv => c.comm.recv_raw(ptr, bytes, peer as usize, s),
            }
        }?;
        c.track([r]);
        Ok(())
    })
}

/// Sends `count` elements to `peer`, ordered on `stream`.
///
/// # Safety
/// `comm` and `stream` are NULL or live; the buffer holds `count` elements of `datatype` and
/// stays valid until the stream passes the operation.
#[no_mangle]
pub unsafe extern "C" fn flagcxSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: flagcxDataType_t,
    peer: c_int,
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    // SAFETY: forwarded contract.
    unsafe { post(Dir::Send, sendbuff, count, datatype, peer, comm, stream) }
}

/// Receives `count` elements from `peer`, ordered on `stream`.
///
/// # Safety
/// `comm` and `stream` are NULL or live; the buffer holds `count` elements of `datatype` and
/// stays valid until the stream passes the operation.
#[no_mangle]
pub unsafe extern "C" fn flagcxRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: flagcxDataType_t,
    peer: c_int,
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    // SAFETY: forwarded contract.
    unsafe { post(Dir::Recv, recvbuff, count, datatype, peer, comm, stream) }
}

/// Returns once every rank reached it: a zero-byte exchange with every other rank.
///
/// # Safety
/// `comm` and `stream` are NULL or live.
#[no_mangle]
pub unsafe extern "C" fn flagcxBarrier(
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    guard(Some(comm), || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm) }?;
        // SAFETY: the caller's contract.
        let s = unsafe { coll_stream(c, stream) }?;
        Ok(c.comm.barrier(s)?)
    })
}

// ---- collectives ---------------------------------------------------------------------------------

/// Bytes of `count` elements of `dtype`, checked.
fn byte_count(count: usize, dtype: flagcxDataType_t) -> R<usize> {
    let size = getFlagcxDataTypeSize(dtype);
    if size == 0 {
        return Err(invalid(format!("unknown data type {dtype}")));
    }
    count
        .checked_mul(size)
        .ok_or_else(|| invalid(format!("{count} elements of {size} bytes overflow")))
}

impl flagcxComm {
    /// Keeps `requests` for `flagcxCommFinalize`, dropping the ones already finished.
    fn track(&self, requests: impl IntoIterator<Item = Request>) {
        let mut pending = lock(&self.pending);
        pending.retain(|r| !r.is_done());
        pending.extend(requests);
    }
}

/// The stream an operation of `c` runs on (the communicator's own for NULL), checked to be
/// of the communicator's device.
///
/// # Safety
/// `stream` is NULL or live.
unsafe fn coll_stream(c: &flagcxComm, stream: *const flagcxStream) -> R<StreamHandle> {
    // SAFETY: the caller's contract.
    match unsafe { stream.as_ref() } {
        Some(s) if s.device != c.comm.adaptor().device() => Err(invalid(format!(
            "the stream belongs to device {}, the communicator to {}",
            s.device,
            c.comm.adaptor().device()
        ))),
        Some(s) => Ok(s.handle),
        None => Ok(c.default_stream),
    }
}

/// Runs one collective: `f` posts it; its requests join the communicator's pending ones.
///
/// # Safety
/// `comm` and `stream` are NULL or live.
unsafe fn collective(
    comm: *mut flagcxComm,
    stream: *const flagcxStream,
    f: impl FnOnce(&flagcxComm, StreamHandle) -> Result<Collective, CommError>,
) -> flagcxResult_t {
    guard(Some(comm), || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm) }?;
        // SAFETY: the caller's contract.
        let s = unsafe { coll_stream(c, stream) }?;
        let done = f(c, s)?;
        c.track(done.into_requests());
        Ok(())
    })
}

fn dp<T>(p: *const T) -> DevicePtr {
    DevicePtr(p as u64)
}

/// Broadcast: `count` elements of the root's `sendbuff` into every rank's `recvbuff` (in
/// place when the root passes `sendbuff == recvbuff`).
///
/// # Safety
/// `comm` and `stream` are NULL or live; the buffers hold `count` elements and stay valid
/// until the stream passes the call.
#[no_mangle]
pub unsafe extern "C" fn flagcxBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: flagcxDataType_t,
    root: c_int,
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    // SAFETY: forwarded contract.
    unsafe {
        collective(comm, stream, |c, s| {
            let bytes = byte_count(count, datatype).map_err(CommError::from)?;
            c.comm
                .broadcast_raw(dp(sendbuff), dp(recvbuff), bytes, rank_arg(root)?, s)
        })
    }
}

/// Gather: every rank's `count` elements into the root's `recvbuff` at `rank * count` (in
/// place when `sendbuff == recvbuff + rank * count`; `recvbuff` may be NULL off the root).
///
/// # Safety
/// As [`flagcxBroadcast`]; the root's `recvbuff` holds `nranks * count` elements.
#[no_mangle]
pub unsafe extern "C" fn flagcxGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: flagcxDataType_t,
    root: c_int,
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    // SAFETY: forwarded contract.
    unsafe {
        collective(comm, stream, |c, s| {
            let bytes = byte_count(count, datatype).map_err(CommError::from)?;
            c.comm
                .gather_raw(dp(sendbuff), dp(recvbuff), bytes, rank_arg(root)?, s)
        })
    }
}

/// Scatter: block `q` of the root's `sendbuff` (`count` elements at `q * count`) into rank
/// `q`'s `recvbuff` (in place when `recvbuff == sendbuff + rank * count`; `sendbuff` may be
/// NULL off the root).
///
/// # Safety
/// As [`flagcxBroadcast`]; the root's `sendbuff` holds `nranks * count` elements.
#[no_mangle]
pub unsafe extern "C" fn flagcxScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: flagcxDataType_t,
    root: c_int,
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    // SAFETY: forwarded contract.
    unsafe {
        collective(comm, stream, |c, s| {
            let bytes = byte_count(count, datatype).map_err(CommError::from)?;
            c.comm
                .scatter_raw(dp(sendbuff), dp(recvbuff), bytes, rank_arg(root)?, s)
        })
    }
}

/// The element type and operator of a reduction, checked.
fn reduction_args(
    datatype: flagcxDataType_t,
    op: flagcxRedOp_t,
) -> Result<(DataType, ReduceOp), CommError> {
    let t = DataType::from_flagcx(datatype)
        .ok_or_else(|| CommError::InvalidArgument(format!("unknown data type {datatype}")))?;
    let o = ReduceOp::from_flagcx(op).ok_or_else(|| {
        CommError::InvalidArgument(format!(
            "reduction operator {op} is not one of sum, prod, max, min, avg (0-4)"
        ))
    })?;
    Ok((t, o))
}

/// All-reduce: every rank's `count` elements at `sendbuff`, combined element by element with
/// `op`, into every rank's `recvbuff` (in place when `sendbuff == recvbuff`); every rank gets
/// the same bits. A type some rank's vendor cannot reduce is `flagcxNotSupported` on every
/// rank.
///
/// # Safety
/// As [`flagcxBroadcast`]; both buffers hold `count` elements.
#[no_mangle]
pub unsafe extern "C" fn flagcxAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: flagcxDataType_t,
    op: flagcxRedOp_t,
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    // SAFETY: forwarded contract.
    unsafe {
        collective(comm, stream, |c, s| {
            let (t, o) = reduction_args(datatype, op)?;
            c.comm
                .all_reduce_raw(dp(sendbuff), dp(recvbuff), count, t, o, s)
        })
    }
}

/// Reduce-scatter: the ranks' `nranks * recvcount` elements at `sendbuff` combined with `op`;
/// rank `q` receives elements `q * recvcount ..` of the result in `recvbuff` (in place when
/// `recvbuff == sendbuff + rank * recvcount`).
///
/// # Safety
/// As [`flagcxBroadcast`]; `sendbuff` holds `nranks * recvcount` elements, `recvbuff`
/// `recvcount`.
#[no_mangle]
pub unsafe extern "C" fn flagcxReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: flagcxDataType_t,
    op: flagcxRedOp_t,
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    // SAFETY: forwarded contract.
    unsafe {
        collective(comm, stream, |c, s| {
            let (t, o) = reduction_args(datatype, op)?;
            c.comm
                .reduce_scatter_raw(dp(sendbuff), dp(recvbuff), recvcount, t, o, s)
        })
    }
}

/// Reduce: every rank's `count` elements combined with `op` into the root's `recvbuff` (in
/// place when the root passes `sendbuff == recvbuff`; `recvbuff` may be NULL off the root).
///
/// # Safety
/// As [`flagcxBroadcast`]; both buffers hold `count` elements (`recvbuff` on the root).
#[no_mangle]
pub unsafe extern "C" fn flagcxReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: flagcxDataType_t,
    op: flagcxRedOp_t,
    root: c_int,
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    // SAFETY: forwarded contract.
    unsafe {
        collective(comm, stream, |c, s| {
            let (t, o) = reduction_args(datatype, op)?;
            let root = usize::try_from(root)
                .map_err(|_| CommError::InvalidArgument(format!("root {root}")))?;
            c.comm
                .reduce_raw(dp(sendbuff), dp(recvbuff), count, t, o, root, s)
        })
    }
}

/// All-gather: every rank's `sendcount` elements into every rank's `recvbuff` at
/// `rank * sendcount` (in place when `sendbuff == recvbuff + rank * sendcount`).
///
/// # Safety
/// As [`flagcxBroadcast`]; `recvbuff` holds `nranks * sendcount` elements.
#[no_mangle]
pub unsafe extern "C" fn flagcxAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: flagcxDataType_t,
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    // SAFETY: forwarded contract.
    unsafe {
        collective(comm, stream, |c, s| {
            let bytes = byte_count(sendcount, datatype).map_err(CommError::from)?;
            c.comm.all_gather_raw(dp(sendbuff), dp(recvbuff), bytes, s)
        })
    }
}

/// All-to-all: block `q` of `sendbuff` (`count` elements at `q * count`) into rank `q`'s
/// `recvbuff` at `rank * count`. The buffers must be distinct (in place: InvalidArgument).
///
/// # Safety
/// As [`flagcxBroadcast`]; both hold `nranks * count` elements.
#[no_mangle]
pub unsafe extern "C" fn flagcxAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: flagcxDataType_t,
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    // SAFETY: forwarded contract.
    unsafe {
        collective(comm, stream, |c, s| {
            let bytes = byte_count(count, datatype).map_err(CommError::from)?;
            c.comm.all_to_all_raw(dp(sendbuff), dp(recvbuff), bytes, s)
        })
    }
}

/// All-to-all with per-peer counts and displacements (elements): `sendcounts[q]` elements
/// at `sendbuff + sdispls[q]` go to rank `q`, which receives `recvcounts[me]` at
/// `recvbuff + rdispls[me]`.
///
/// # Safety
/// As [`flagcxBroadcast`]; the four arrays hold `nranks` entries each.
#[no_mangle]
pub unsafe extern "C" fn flagcxAlltoAllv(
    sendbuff: *const c_void,
    sendcounts: *mut usize,
    sdispls: *mut usize,
    recvbuff: *mut c_void,
    recvcounts: *mut usize,
    rdispls: *mut usize,
    datatype: flagcxDataType_t,
    comm: *mut flagcxComm,
    stream: *mut flagcxStream,
) -> flagcxResult_t {
    // SAFETY: forwarded contract.
    unsafe {
        collective(comm, stream, |c, s| {
            let n = c.comm.nranks();
            let arr = |p: *mut usize, what: &str| -> Result<Vec<usize>, CommError> {
                if p.is_null() {
                    return Err(CommError::InvalidArgument(format!("NULL {what}")));
                }
                // SAFETY: the caller's contract: `nranks` entries.
                let v = std::slice::from_raw_parts(p, n);
                v.iter()
                    .map(|&x| byte_count(x, datatype).map_err(CommError::from))
                    .collect()
            };
            let (sc, sd) = (
                arr(sendcounts, "send counts")?,
                arr(sdispls, "send displacements")?,
            );
            let (rc, rd) = (
                arr(recvcounts, "receive counts")?,
                arr(rdispls, "receive displacements")?,
            );
            c.comm
                .all_to_allv_raw(dp(sendbuff), &sc, &sd, dp(recvbuff), &rc, &rd, s)
        })
    }
}

/// A rank argument as an index.
fn rank_arg(r: c_int) -> Result<usize, CommError> {
    usize::try_from(r).map_err(|_| CommError::InvalidArgument(format!("root {r}")))
}

// ---- memory for communication ------------------------------------------------------------------

/// Device memory on the current device.
///
/// # Safety
/// `ptr` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn flagcxMemAlloc(
    ptr: *mut *mut c_void,
    size: usize,
    allocator: flagcxMemAllocator_t,
) -> flagcxResult_t {
    guard(None, || {
        let (_, a) = adaptor()?;
        let p = match allocator {
            0 => a.mem_alloc(size)?,
            1 => a.mem_alloc_shareable(size)?,
            other => return Err(invalid(format!("unknown allocator {other}"))),
        };
        // SAFETY: the caller's contract.
        unsafe { put(ptr, p.0 as *mut c_void, "pointer") }
    })
}

/// Frees what [`flagcxMemAlloc`] returned.
///
/// # Safety
/// `ptr` came from `flagcxMemAlloc` and no work uses it any more.
#[no_mangle]
pub unsafe extern "C" fn flagcxMemFree(
    ptr: *mut c_void,
    allocator: flagcxMemAllocator_t,
) -> flagcxResult_t {
    guard(None, || {
        if !(0..=1).contains(&allocator) {
            return Err(invalid(format!("unknown allocator {allocator}")));
        }
        let (_, a) = adaptor()?;
        // SAFETY: the caller's contract; the adaptor refuses pointers it did not hand out.
        Ok(unsafe { a.mem_free(DevicePtr(ptr as u64)) }?)
    })
}

/// A registration: the buffer it names (checked to be memory of the communicator's device),
/// and its port-channel identity where the vendor can export it (see `flagcxPortChannelCreate`).
pub(crate) struct Registration {
    ptr: u64,
    size: usize,
    pub(crate) port: Option<flagcx_rs::p2p::Registered>,
}

/// Registers a buffer: checks it is device memory of `comm`'s device, whole, and returns a
/// handle. (Transfers need no registration; this is the hint FlagCX allows.)
///
/// # Safety
/// `comm` is NULL or live; `handle` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn flagcxCommRegister(
    comm: *const flagcxComm,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
    allocator: flagcxMemAllocator_t,
) -> flagcxResult_t {
    guard(Some(comm), || {
        // SAFETY: the caller's contract.
        let c = unsafe { comm_ref(comm) }?;
        if !(0..=1).contains(&allocator) {
            return Err(invalid(format!("unknown allocator {allocator}")));
        }
        let ptr = DevicePtr(buff as u64);
        let (base, len) = c.comm.adaptor().mem_get_range(ptr)?;
        if ptr.0 - base.0 + size as u64 > len as u64 {
            return Err(invalid(format!(
                "{size} bytes at {ptr} run past the end of its {len}-byte allocation"
            )));
        }
        // Port channels need the buffer's IPC identity; vendors without one still register.
        let port = c.comm.register(ptr, size).ok();
        let reg = Box::into_raw(Box::new(Registration {
            ptr: ptr.0,
            size,
            port,
        }));
        // SAFETY: the caller's contract.
        unsafe { put(handle, reg.cast::<c_void>(), "handle pointer") }.inspect_err(|_| {
            // SAFETY: just made, never shared.
            drop(unsafe { Box::from_raw(reg) });
        })
    })
}

/// Releases a registration.
///
/// # Safety
/// `handle` came from [`flagcxCommRegister`] and is not used again.
#[no_mangle]
pub unsafe extern "C" fn flagcxCommDeregister(
    comm: *const flagcxComm,
    handle: *mut c_void,
    allocator: flagcxMemAllocator_t,
) -> flagcxResult_t {
    guard(Some(comm), || {
        // SAFETY: the caller's contract.
        unsafe { comm_ref(comm) }?;
        if handle.is_null() {
            return Err(invalid("NULL registration handle"));
        }
        let _ = allocator;
        // SAFETY: made by `Box::into_raw` in flagcxCommRegister; the caller gives it up.
        let reg = unsafe { Box::from_raw(handle.cast::<Registration>()) };
        let _ = (reg.ptr, reg.size);
        Ok(())
    })
}
