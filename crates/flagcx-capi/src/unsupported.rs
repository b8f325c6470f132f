//! The functions of FlagCX's header that flagcx-rs does not implement yet: suspending a
//! communicator, window registration and the one-sided (RDMA) calls. Each is exported under
//! FlagCX's name and signature so programs written for FlagCX link, reads none of its
//! arguments (a pointer is never dereferenced, an out-parameter never written) and returns
//! `flagcxNotSupported`, with `flagcxGetLastError(NULL)` naming the call.

use std::ffi::{c_int, c_uint, c_void};

use crate::{
    flagcxComm, flagcxDataType_t, flagcxMemAllocator_t, flagcxResult_t, flagcxStream, guard,
    Failure,
};

/// A window of FlagCX's symmetric and one-sided API (`struct flagcxWindow`, behind
/// `flagcxWindow_t`): opaque, and never made here.
#[repr(C)]
pub struct flagcxWindow {
    _opaque: [u8; 0],
}

/// One entry of `flagcxWaitSignal` (`flagcxWaitSignalDesc_t`): wait for `opCnt` signals from
/// `peer`. FlagCX's layout: 16 bytes, `opCnt` at 0, `peer` at 8.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct flagcxWaitSignalDesc_t {
    /// Signals to wait for from `peer`.
    pub opCnt: u64,
    /// The rank they come from.
    pub peer: c_int,
}

const _: () = assert!(std::mem::size_of::<flagcxWaitSignalDesc_t>() == 16);

/// Exports each function as FlagCX declares it, returning `flagcxNotSupported` and recording
/// for `flagcxGetLastError(NULL)` that `$what` is not implemented. The communicator argument is
/// not looked at either (not even to record its last error): a stale handle stays harmless.
macro_rules! not_supported {
    ($($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*) => $what:literal;)*) => {$(
        $(#[$doc])*
        ///
        #[doc = concat!("Not implemented yet: returns `flagcxNotSupported` (", $what, ").")]
        ///
        /// # Safety
        /// None of the arguments is read, so any values are safe.
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> flagcxResult_t {
            $(let _ = $arg;)*
            guard(None, || Err(Failure(
                flagcxResult_t::flagcxNotSupported,
                concat!(stringify!($name), ": ", $what, " is not implemented in flagcx-rs yet").into(),
            )))
        }
    )*};
}

not_supported! {
    /// Suspends a communicator.
    flagcxCommSuspend(comm: *mut flagcxComm) => "suspending a communicator";
    /// Resumes a suspended communicator.
    flagcxCommResume(comm: *mut flagcxComm) => "resuming a communicator";

    /// Registers `size` bytes at `buff` as a window (`*win` its handle; `win_flags` is
    /// `FLAGCX_WIN_DEFAULT` or `FLAGCX_WIN_COLL_SYMMETRIC`).
    flagcxCommWindowRegister(
        comm: *mut flagcxComm,
        buff: *mut c_void,
        size: usize,
        win: *mut *mut flagcxWindow,
        win_flags: c_int,
        allocator: flagcxMemAllocator_t
    ) => "window registration";
    /// Releases a window `flagcxCommWindowRegister` made.
    flagcxCommWindowDeregister(
        comm: *mut flagcxComm,
        win: *mut flagcxWindow,
        allocator: flagcxMemAllocator_t
    ) => "window registration";
    /// Registers `size` bytes at `buff` with every rank for one-sided reads and writes.
    flagcxOneSideRegister(comm: *mut flagcxComm, buff: *mut c_void, size: usize)
        => "one-sided registration";
    /// Registers the signal buffer of one-sided operations (`ptr_type`: device or host memory).
    flagcxOneSideSignalRegister(
        comm: *const flagcxComm,
        buff: *mut c_void,
        size: usize,
        ptr_type: c_int
    ) => "one-sided registration";
    /// Registers the pinned host staging buffer of one-sided value puts.
    flagcxOneSideStagingRegister(comm: *const flagcxComm, buff: *mut c_void, size: usize)
        => "one-sided registration";
    /// Releases the staging buffer's registration.
    flagcxOneSideStagingDeregister(comm: *const flagcxComm) => "one-sided registration";
    /// Reads `size` bytes of `peer`'s registration into this rank's.
    flagcxGet(
        comm: *mut flagcxComm,
        peer: c_int,
        src_offset: usize,
        dst_offset: usize,
        size: usize,
        src_mr_idx: c_int,
        dst_mr_idx: c_int
    ) => "one-sided get";
    /// Writes `size` bytes of this rank's registration into `peer`'s.
    flagcxPut(
        comm: *mut flagcxComm,
        peer: c_int,
        src_offset: usize,
        dst_offset: usize,
        size: usize,
        src_mr_idx: c_int,
        dst_mr_idx: c_int
    ) => "one-sided put";
    /// `count` puts to `peer` at once, entry `i` from the `i`-th element of each array.
    flagcxBatchPut(
        comm: *mut flagcxComm,
        peer: c_int,
        src_offsets: *const usize,
        dst_offsets: *const usize,
        sizes: *const usize,
        src_mr_idxs: *const c_int,
        dst_mr_idxs: *const c_int,
        count: usize
    ) => "one-sided put";
    /// Writes `count` elements into `peer`'s window, then signals `peer`, ordered on `stream`.
    flagcxPutSignal(
        localbuff: *const c_void,
        count: usize,
        datatype: flagcxDataType_t,
        peer: c_int,
        peer_win: *mut flagcxWindow,
        peer_win_offset: usize,
        flags: c_uint,
        comm: *mut flagcxComm,
        stream: *mut flagcxStream
    ) => "one-sided put with signal";
    /// Signals `peer` without data, ordered on `stream`.
    flagcxSignal(peer: c_int, flags: c_uint, comm: *mut flagcxComm, stream: *mut flagcxStream)
        => "one-sided signal";
    /// Makes `stream` wait for the signals the `n_desc` entries of `signal_descs` describe.
    flagcxWaitSignal(
        n_desc: c_int,
        signal_descs: *const flagcxWaitSignalDesc_t,
        comm: *mut flagcxComm,
        stream: *mut flagcxStream
    ) => "waiting for one-sided signals";
    /// The count of completed one-sided operations of `comm`, in `*count`.
    flagcxReadCounter(comm: *mut flagcxComm, count: *mut u64) => "the one-sided counter";
    /// Waits until `comm`'s count of completed one-sided operations reaches `target`.
    flagcxWaitCounter(comm: *mut flagcxComm, target: u64) => "the one-sided counter";
}
