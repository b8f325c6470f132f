//! The HIP runtime functions this adaptor calls, declared with `c_int` results.
//!
//! hip-sys models `hipError_t` as a Rust enum; a code it does not list (a newer runtime, a
//! vendor extension) would be undefined behaviour the moment it is returned. Declaring the
//! functions here with plain integers keeps every code representable. hip-sys still links
//! `libamdhip64` and provides struct layouts. Only symbols present since HIP 5.2 are used
//! (`hipLaunchHostFunc` is missing there, so host functions use `hipStreamAddCallback`).

#![allow(non_snake_case, missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};

pub use hip_sys::hiprt::{
    hipIpcMemHandle_t, hipMemAccessDesc, hipMemAllocationProp, hipMemGenericAllocationHandle_t,
};

pub type HipError = c_int;
pub type Stream = *mut c_void;
pub type Event = *mut c_void;
pub type Callback = unsafe extern "C" fn(stream: Stream, status: c_int, user: *mut c_void);

pub const SUCCESS: HipError = 0;
pub const ERROR_OUT_OF_MEMORY: HipError = 2;
pub const ERROR_NO_DEVICE: HipError = 100;
pub const ERROR_NOT_READY: HipError = 600;
pub const ERROR_PEER_ACCESS_ALREADY_ENABLED: HipError = 704;

pub const HOST_MALLOC_PORTABLE: c_uint = 1;
pub const HOST_MALLOC_MAPPED: c_uint = 2;
pub const HOST_REGISTER_PORTABLE: c_uint = 1;
pub const HOST_REGISTER_MAPPED: c_uint = 2;
pub const STREAM_NON_BLOCKING: c_uint = 1;
pub const EVENT_DISABLE_TIMING: c_uint = 2;
pub const IPC_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
pub const WAIT_GEQ: c_uint = 0;
pub const WAIT_EQ: c_uint = 1;
pub const WAIT_AND: c_uint = 2;
pub const WAIT_NOR: c_uint = 3;
pub const CAPTURE_GLOBAL: c_int = 0;
pub const CAPTURE_THREAD_LOCAL: c_int = 1;
pub const CAPTURE_RELAXED: c_int = 2;
pub const HANDLE_TYPE_POSIX_FD: c_int = 1;
pub const GRANULARITY_MINIMUM: c_int = 0;

#[link(name = "amdhip64")]
extern "C" {
    pub fn hipGetErrorName(e: HipError) -> *const c_char;
    pub fn hipGetDeviceCount(count: *mut c_int) -> HipError;
    pub fn hipSetDevice(dev: c_int) -> HipError;
    pub fn hipDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> HipError;
    pub fn hipDeviceTotalMem(bytes: *mut usize, dev: c_int) -> HipError;
    pub fn hipDeviceGetPCIBusId(bus: *mut c_char, len: c_int, dev: c_int) -> HipError;
    pub fn hipMalloc(p: *mut *mut c_void, size: usize) -> HipError;
    pub fn hipFree(p: *mut c_void) -> HipError;
    pub fn hipHostMalloc(p: *mut *mut c_void, size: usize, flags: c_uint) -> HipError;
    pub fn hipHostFree(p: *mut c_void) -> HipError;
    pub fn hipHostRegister(p: *mut c_void, size: usize, flags: c_uint) -> HipError;
    pub fn hipHostUnregister(p: *mut c_void) -> HipError;
    pub fn hipHostGetDevicePointer(d: *mut *mut c_void, h: *mut c_void, flags: c_uint) -> HipError;
    pub fn hipMemGetAddressRange(
        base: *mut *mut c_void,
        size: *mut usize,
        p: *mut c_void,
    ) -> HipError;
    pub fn hipMemcpyHtoDAsync(d: *mut c_void, h: *mut c_void, n: usize, s: Stream) -> HipError;
    pub fn hipMemcpyDtoHAsync(h: *mut c_void, d: *mut c_void, n: usize, s: Stream) -> HipError;
    pub fn hipMemcpyDtoDAsync(d: *mut c_void, src: *mut c_void, n: usize, s: Stream) -> HipError;
    pub fn hipMemsetD8Async(d: *mut c_void, v: u8, n: usize, s: Stream) -> HipError;
    pub fn hipStreamCreateWithFlags(s: *mut Stream, flags: c_uint) -> HipError;
    pub fn hipStreamDestroy(s: Stream) -> HipError;
    pub fn hipStreamSynchronize(s: Stream) -> HipError;
    pub fn hipStreamQuery(s: Stream) -> HipError;
    pub fn hipStreamWaitEvent(s: Stream, e: Event, flags: c_uint) -> HipError;
    pub fn hipStreamAddCallback(
        s: Stream,
        cb: Callback,
        user: *mut c_void,
        flags: c_uint,
    ) -> HipError;
    pub fn hipEventCreateWithFlags(e: *mut Event, flags: c_uint) -> HipError;
    pub fn hipEventDestroy(e: Event) -> HipError;
    pub fn hipEventRecord(e: Event, s: Stream) -> HipError;
    pub fn hipEventQuery(e: Event) -> HipError;
    pub fn hipEventSynchronize(e: Event) -> HipError;
    pub fn hipEventElapsedTime(ms: *mut f32, a: Event, b: Event) -> HipError;
    pub fn hipIpcGetMemHandle(h: *mut hipIpcMemHandle_t, p: *mut c_void) -> HipError;
    pub fn hipIpcOpenMemHandle(
        p: *mut *mut c_void,
        h: hipIpcMemHandle_t,
        flags: c_uint,
    ) -> HipError;
    pub fn hipIpcCloseMemHandle(p: *mut c_void) -> HipError;
    pub fn hipDeviceCanAccessPeer(can: *mut c_int, dev: c_int, peer: c_int) -> HipError;
    pub fn hipDeviceEnablePeerAccess(peer: c_int, flags: c_uint) -> HipError;
    pub fn hipThreadExchangeStreamCaptureMode(mode: *mut c_int) -> HipError;
    pub fn hipStreamWaitValue32(
        s: Stream,
        p: *mut c_void,
        v: u32,
        flags: c_uint,
        mask: u32,
    ) -> HipError;
    pub fn hipStreamWaitValue64(
        s: Stream,
        p: *mut c_void,
        v: u64,
        flags: c_uint,
        mask: u64,
    ) -> HipError;
    pub fn hipStreamWriteValue32(s: Stream, p: *mut c_void, v: u32, flags: c_uint) -> HipError;
    pub fn hipStreamWriteValue64(s: Stream, p: *mut c_void, v: u64, flags: c_uint) -> HipError;
    pub fn hipMemGetAllocationGranularity(
        g: *mut usize,
        prop: *const hipMemAllocationProp,
        option: c_int,
    ) -> HipError;
    pub fn hipMemCreate(
        h: *mut hipMemGenericAllocationHandle_t,
        size: usize,
        prop: *const hipMemAllocationProp,
        flags: c_ulonglong,
    ) -> HipError;
    pub fn hipMemRelease(h: hipMemGenericAllocationHandle_t) -> HipError;
    pub fn hipMemAddressReserve(
        p: *mut *mut c_void,
        size: usize,
        align: usize,
        addr: *mut c_void,
        flags: c_ulonglong,
    ) -> HipError;
    pub fn hipMemAddressFree(p: *mut c_void, size: usize) -> HipError;
    pub fn hipMemMap(
        p: *mut c_void,
        size: usize,
        offset: usize,
        h: hipMemGenericAllocationHandle_t,
        flags: c_ulonglong,
    ) -> HipError;
    pub fn hipMemUnmap(p: *mut c_void, size: usize) -> HipError;
    pub fn hipMemSetAccess(
        p: *mut c_void,
        size: usize,
        desc: *const hipMemAccessDesc,
        count: usize,
    ) -> HipError;
    pub fn hipMemExportToShareableHandle(
        out: *mut c_void,
        h: hipMemGenericAllocationHandle_t,
        ty: c_int,
        flags: c_ulonglong,
    ) -> HipError;
    pub fn hipMemImportFromShareableHandle(
        h: *mut hipMemGenericAllocationHandle_t,
        os: *mut c_void,
        ty: c_int,
    ) -> HipError;
}
