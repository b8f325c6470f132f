//! UCX, loaded at run time: the few UCP calls the network transport needs.
//!
//! Why loaded and not linked: a build of flagcx-rs must not need UCX (most jobs never leave one
//! node), and the published Rust crates for UCX are years behind the C API (no `*_nbx` calls).
//! So `libucp.so.0` and `libucs.so.0` are opened with `dlopen` when a job first has a pair on
//! two hosts, and a missing library is an error that says so. The structures below are the
//! UCP 1.13 API's (`ucp/api/ucp.h`); every one starts with a field mask saying which of its
//! fields UCX may read, so later versions of the library accept them unchanged. The offsets
//! were read off Debian's `libucx-dev` 1.13.1 headers and are checked by the size assertions.
//!
//! Thread use: the worker is created in `UCS_THREAD_MODE_SERIALIZED` and every call is made
//! under the network state's lock (`transport::net::SharedNet`), from the engine, a posting
//! thread or a waiting one.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

use libloading::Library;

use crate::error::{CommError, Result};

/// `ucs_status_t`: an enum UCX declares packed, so one signed byte across the ABI.
pub(crate) type Status = i8;
const UCS_OK: Status = 0;
/// `UCS_INPROGRESS`.
const INPROGRESS: Status = 1;
/// `UCS_ERR_MESSAGE_TRUNCATED`.
pub(crate) const ERR_TRUNCATED: Status = -9;
/// `UCS_ERR_LAST`: status pointers are errors from here up to -1.
const ERR_LAST: isize = -100;

const PARAM_FIELD_FEATURES: u64 = 1 << 0;
const FEATURE_TAG: u64 = 1 << 0;
const WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
const THREAD_MODE_SERIALIZED: c_int = 1;
const EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
const EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
const EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
const ERR_HANDLING_MODE_PEER: c_int = 1;
const OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
const OP_ATTR_FLAG_NO_IMM_CMPL: u32 = 1 << 16;
const OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;
/// Bits of a tag that number messages; the sender's rank sits above them.
const INDEX_BITS: u32 = 44;

/// The message number of a rank's goodbye at teardown ([`Worker::goodbye`]): no message gets it.
const GOODBYE: u64 = (1 << INDEX_BITS) - 1;

/// What a goodbye points UCX at: it has zero bytes.
static GOODBYE_BYTE: u8 = 0;

/// The UCX tag of message `index` from rank `sender`.
pub(crate) fn tag(sender: usize, index: u64) -> u64 {
    ((sender as u64) << INDEX_BITS) | (index & ((1 << INDEX_BITS) - 1))
}

/// `UCS_MEMORY_TYPE_HOST`.
pub(crate) const MEMORY_TYPE_HOST: u64 = 0;
/// `UCS_MEMORY_TYPE_CUDA`.
pub(crate) const MEMORY_TYPE_CUDA: u64 = 1;
/// `UCS_MEMORY_TYPE_ROCM`.
pub(crate) const MEMORY_TYPE_ROCM: u64 = 3;
const ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;
const EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;
/// UCP API version this code was written against (`ucp_init_version`).
const API: (c_uint, c_uint) = (1, 13);

/// `ucp_params_t` (80 bytes in 1.13).
#[repr(C)]
struct Params {
    field_mask: u64,
    features: u64,
    rest: [u64; 8],
}

/// `ucp_worker_params_t` (200 bytes in 1.13).
#[repr(C)]
struct WorkerParams {
    field_mask: u64,
    thread_mode: c_int,
    rest: [u8; 188],
}

type ErrHandler = unsafe extern "C" fn(arg: *mut c_void, ep: *mut c_void, status: Status);

/// `ucp_ep_params_t` (104 bytes in 1.13).
#[repr(C)]
struct EpParams {
    field_mask: u64,
    address: *const c_void,
    err_mode: c_int,
    err_handler_cb: Option<ErrHandler>,
    err_handler_arg: *mut c_void,
    rest: [u64; 8],
}

/// `ucp_request_param_t` (72 bytes in 1.13).
#[repr(C)]
struct RequestParam {
    op_attr_mask: u32,
    flags: u32,
    rest: [u64; 8],
}

/// `ucp_context_attr_t` (64 bytes in 1.13: the mask, `request_size`, `thread_mode`,
/// `memory_types`, a 32-byte name).
#[repr(C)]
struct ContextAttr {
    field_mask: u64,
    request_size: usize,
    thread_mode: c_int,
    memory_types: u64,
    name: [c_char; 32],
}

/// `ucp_tag_recv_info_t`.
#[repr(C)]
#[derive(Default)]
struct TagRecvInfo {
    sender_tag: u64,
    length: usize,
}

const _: () = assert!(std::mem::size_of::<Params>() == 80);
const _: () = assert!(std::mem::size_of::<WorkerParams>() == 200);
const _: () = assert!(std::mem::size_of::<EpParams>() == 104);
const _: () = assert!(std::mem::offset_of!(EpParams, err_mode) == 16);
const _: () = assert!(std::mem::offset_of!(EpParams, err_handler_cb) == 24);
const _: () = assert!(std::mem::size_of::<RequestParam>() == 72);
const _: () = assert!(std::mem::size_of::<ContextAttr>() == 64);
const _: () = assert!(std::mem::offset_of!(ContextAttr, memory_types) == 24);

/// The library's entry points.
struct Fns {
    config_read: unsafe extern "C" fn(*const c_char, *const c_char, *mut *mut c_void) -> Status,
    config_release: unsafe extern "C" fn(*mut c_void),
    config_modify: unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> Status,
    init_version: unsafe extern "C" fn(
        c_uint,
        c_uint,
        *const Params,
        *const c_void,
        *mut *mut c_void,
    ) -> Status,
    cleanup: unsafe extern "C" fn(*mut c_void),
    context_query: unsafe extern "C" fn(*mut c_void, *mut ContextAttr) -> Status,
    worker_create:
        unsafe extern "C" fn(*mut c_void, *const WorkerParams, *mut *mut c_void) -> Status,
    worker_destroy: unsafe extern "C" fn(*mut c_void),
    worker_get_address: unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut usize) -> Status,
    worker_release_address: unsafe extern "C" fn(*mut c_void, *mut c_void),
    worker_progress: unsafe extern "C" fn(*mut c_void) -> c_uint,
    ep_create: unsafe extern "C" fn(*mut c_void, *const EpParams, *mut *mut c_void) -> Status,
    ep_close_nbx: unsafe extern "C" fn(*mut c_void, *const RequestParam) -> *mut c_void,
    tag_send_nbx: unsafe extern "C" fn(
        *mut c_void,
        *const c_void,
        usize,
        u64,
        *const RequestParam,
    ) -> *mut c_void,
    tag_send_sync_nbx: unsafe extern "C" fn(
        *mut c_void,
        *const c_void,
        usize,
        u64,
        *const RequestParam,
    ) -> *mut c_void,
    tag_recv_nbx: unsafe extern "C" fn(
        *mut c_void,
        *mut c_void,
        usize,
        u64,
        u64,
        *const RequestParam,
    ) -> *mut c_void,
    tag_probe_nb:
        unsafe extern "C" fn(*mut c_void, u64, u64, c_int, *mut TagRecvInfo) -> *mut c_void,
    tag_msg_recv_nbx: unsafe extern "C" fn(
        *mut c_void,
        *mut c_void,
        usize,
        *mut c_void,
        *const RequestParam,
    ) -> *mut c_void,
    request_check_status: unsafe extern "C" fn(*mut c_void) -> Status,
    tag_recv_request_test: unsafe extern "C" fn(*mut c_void, *mut TagRecvInfo) -> Status,
    request_cancel: unsafe extern "C" fn(*mut c_void, *mut c_void),
    request_free: unsafe extern "C" fn(*mut c_void),
    status_string: unsafe extern "C" fn(Status) -> *const c_char,
}

/// The loaded libraries (kept open while any worker lives).
pub(crate) struct Ucx {
    f: Fns,
    _ucp: Library,
    _ucs: Library,
}

impl Ucx {
    /// Opens `libucp.so.0` and `libucs.so.0`; an error names what is missing.
    pub(crate) fn load() -> Result<Arc<Ucx>> {
        let open = |name: &str| {
            // SAFETY: loading a shared library runs its initializers; UCX's are safe to run in
            // any process (they read the environment and register memory hooks).
            unsafe { Library::new(name) }.map_err(|e| {
                CommError::Bootstrap(format!(
                    "a rank on another host needs the network transport, which needs UCX: \
                     cannot load {name} ({e}); install UCX (Debian: libucx0)"
                ))
            })
        };
        let ucs = open("libucs.so.0")?;
        let ucp = open("libucp.so.0")?;
        macro_rules! sym {
            ($lib:expr, $name:literal) => {{
                // SAFETY: the symbol's type is the one `ucp.h`/`status.h` declare for it.
                let s = unsafe { $lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                    CommError::Bootstrap(format!(
                        "UCX lacks {} ({e}); UCX 1.10 or later is needed",
                        $name
                    ))
                })?;
                *s
            }};
        }
        let f = Fns {
            config_read: sym!(ucp, "ucp_config_read"),
            config_release: sym!(ucp, "ucp_config_release"),
            config_modify: sym!(ucp, "ucp_config_modify"),
            init_version: sym!(ucp, "ucp_init_version"),
            cleanup: sym!(ucp, "ucp_cleanup"),
            context_query: sym!(ucp, "ucp_context_query"),
            worker_create: sym!(ucp, "ucp_worker_create"),
            worker_destroy: sym!(ucp, "ucp_worker_destroy"),
            worker_get_address: sym!(ucp, "ucp_worker_get_address"),
            worker_release_address: sym!(ucp, "ucp_worker_release_address"),
            worker_progress: sym!(ucp, "ucp_worker_progress"),
            ep_create: sym!(ucp, "ucp_ep_create"),
            ep_close_nbx: sym!(ucp, "ucp_ep_close_nbx"),
            tag_send_nbx: sym!(ucp, "ucp_tag_send_nbx"),
            tag_send_sync_nbx: sym!(ucp, "ucp_tag_send_sync_nbx"),
            tag_recv_nbx: sym!(ucp, "ucp_tag_recv_nbx"),
            tag_probe_nb: sym!(ucp, "ucp_tag_probe_nb"),
            tag_msg_recv_nbx: sym!(ucp, "ucp_tag_msg_recv_nbx"),
            request_check_status: sym!(ucp, "ucp_request_check_status"),
            tag_recv_request_test: sym!(ucp, "ucp_tag_recv_request_test"),
            request_cancel: sym!(ucp, "ucp_request_cancel"),
            request_free: sym!(ucp, "ucp_request_free"),
            status_string: sym!(ucs, "ucs_status_string"),
        };
        Ok(Arc::new(Ucx {
            f,
            _ucp: ucp,
            _ucs: ucs,
        }))
    }

    fn name(&self, s: Status) -> String {
        // SAFETY: `ucs_status_string` returns a static NUL-terminated string for any code.
        let p = unsafe { (self.f.status_string)(s) };
        if p.is_null() {
            return format!("UCS status {s}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        let text = unsafe { CStr::from_ptr(p) }.to_string_lossy();
        format!("{text} ({s})")
    }

    fn check(&self, what: &str, s: Status) -> Result<()> {
        if s == UCS_OK {
            Ok(())
        } else {
            Err(CommError::Net(format!("{what}: {}", self.name(s))))
        }
    }
}

/// A UCP context and one worker on it: this rank's network endpoint.
pub(crate) struct Worker {
    ucx: Arc<Ucx>,
    ctx: *mut c_void,
    worker: *mut c_void,
}

// SAFETY: the worker is created in `UCS_THREAD_MODE_SERIALIZED`, which allows calls from any
// thread one at a time; it lives behind a mutex (`transport::net::SharedNet`) and is only
// used under it.
unsafe impl Send for Worker {}

/// The rendezvous threshold to give UCX where the user set none: over TCP (no RDMA device on
/// this host) UCX's default switches to rendezvous at 32 KiB, whose extra round trip made
/// 256 KiB messages 1.2× slower than eager between two namespaces (83–86 µs eager against
/// `ucx_perftest`'s 87–96); where RDMA is present the zero-copy rendezvous is UCX's to choose.
fn rndv_thresh(user_set: bool, rdma: bool) -> Option<&'static std::ffi::CStr> {
    (!user_set && !rdma).then_some(c"512K")
}

/// Whether this host has an RDMA device (`/sys/class/infiniband` lists one).
fn rdma_present() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

impl Worker {
    /// A context with tag matching (UCX reads its `UCX_*` environment, e.g. `UCX_TLS`) and a
    /// worker on it.
    pub(crate) fn new(ucx: Arc<Ucx>) -> Result<Self> {
        let mut config = std::ptr::null_mut();
        // SAFETY: null prefix and file mean the defaults; `config` receives the handle.
        let s = unsafe { (ucx.f.config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
        ucx.check("ucp_config_read", s)?;
        if let Some(t) = rndv_thresh(
            std::env::var_os("UCX_RNDV_THRESH").is_some(),
            rdma_present(),
        ) {
            // SAFETY: a live configuration and two NUL-terminated strings.
            let s = unsafe { (ucx.f.config_modify)(config, c"RNDV_THRESH".as_ptr(), t.as_ptr()) };
            if s != 0 {
                tracing::debug!(
                    status = s,
                    "ucp_config_modify(RNDV_THRESH) refused; UCX's default stays"
                );
            }
        }
        let params = Params {
            field_mask: PARAM_FIELD_FEATURES,
            features: FEATURE_TAG,
            rest: [0; 8],
        };
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `params` is a valid `ucp_params_t` whose mask names only `features`; `config`
        // came from `ucp_config_read`.
        let s = unsafe { (ucx.f.init_version)(API.0, API.1, &params, config, &mut ctx) };
        // SAFETY: the context copied what it needs.
        unsafe { (ucx.f.config_release)(config) };
        ucx.check("ucp_init", s)?;
        let wp = WorkerParams {
            field_mask: WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: THREAD_MODE_SERIALIZED,
            rest: [0; 188],
        };
        let mut worker = std::ptr::null_mut();
        // SAFETY: valid context and parameters.
        let s = unsafe { (ucx.f.worker_create)(ctx, &wp, &mut worker) };
        if let Err(e) = ucx.check("ucp_worker_create", s) {
            // SAFETY: created above, nothing uses it.
            unsafe { (ucx.f.cleanup)(ctx) };
            return Err(e);
        }
        Ok(Worker { ucx, ctx, worker })
    }

    /// The memory types this UCX moves itself (`ucp_context_query`): bit `t` for
    /// `UCS_MEMORY_TYPE` `t`. Debian's build has host memory only; one built `--with-cuda`
    /// adds CUDA's.
    pub(crate) fn memory_types(&self) -> Result<u64> {
        let mut attr = ContextAttr {
            field_mask: ATTR_FIELD_MEMORY_TYPES,
            request_size: 0,
            thread_mode: 0,
            memory_types: 0,
            name: [0; 32],
        };
        // SAFETY: a live context; `attr` is a `ucp_context_attr_t` whose mask asks for the
        // memory types only.
        let s = unsafe { (self.ucx.f.context_query)(self.ctx, &mut attr) };
        self.ucx.check("ucp_context_query", s)?;
        Ok(attr.memory_types)
    }

    /// The worker's address, for peers to connect to.
    pub(crate) fn address(&self) -> Result<Vec<u8>> {
        let mut p = std::ptr::null_mut();
        let mut n = 0usize;
        // SAFETY: valid worker; out-parameters are ours.
        let s = unsafe { (self.ucx.f.worker_get_address)(self.worker, &mut p, &mut n) };
        self.ucx.check("ucp_worker_get_address", s)?;
        // SAFETY: UCX returned `n` readable bytes at `p`, ours until released.
        let v = unsafe { std::slice::from_raw_parts(p as *const u8, n) }.to_vec();
        // SAFETY: `p` came from `ucp_worker_get_address` on this worker.
        unsafe { (self.ucx.f.worker_release_address)(self.worker, p) };
        Ok(v)
    }

    /// An endpoint to the worker at `address`. Its failure (the peer's process or host gone)
    /// fails its operations and is recorded in `failed` (the UCS status, 0 while healthy).
    pub(crate) fn connect(&self, address: &[u8], failed: Arc<AtomicI32>) -> Result<Endpoint> {
        let arg = Arc::into_raw(failed.clone()) as *mut c_void;
        let params = EpParams {
            field_mask: EP_PARAM_FIELD_REMOTE_ADDRESS
                | EP_PARAM_FIELD_ERR_HANDLING_MODE
                | EP_PARAM_FIELD_ERR_HANDLER,
            address: address.as_ptr() as *const c_void,
            err_mode: ERR_HANDLING_MODE_PEER,
            err_handler_cb: Some(on_ep_error),
            err_handler_arg: arg,
            rest: [0; 8],
        };
        let mut ep = std::ptr::null_mut();
        // SAFETY: valid worker; `address` is a worker address a peer sent (UCX validates it);
        // `arg` stays alive as long as the endpoint (released in `Endpoint::close`).
        let s = unsafe { (self.ucx.f.ep_create)(self.worker, &params, &mut ep) };
        if let Err(e) = self.ucx.check("ucp_ep_create", s) {
            // SAFETY: the handler was never installed.
            drop(unsafe { Arc::from_raw(arg as *const AtomicI32) });
            return Err(e);
        }
        Ok(Endpoint { ep, arg, failed })
    }

    /// Makes progress on every operation of the worker; true if anything happened.
    pub(crate) fn progress(&self) -> bool {
        // SAFETY: valid worker, called from one thread at a time.
        unsafe { (self.ucx.f.worker_progress)(self.worker) > 0 }
    }

    /// Starts sending `len` bytes at `buf` (memory of UCX type `mem`) with `tag`.
    ///
    /// # Safety
    /// `buf..buf+len` stays readable until the returned request completes or is cancelled.
    pub(crate) unsafe fn send(
        &self,
        ep: &Endpoint,
        buf: *const u8,
        len: usize,
        tag: u64,
        mem: u64,
    ) -> Result<NetReq> {
        let p = no_imm_param(mem);
        // SAFETY: by the caller's contract; `ep` belongs to this worker.
        let r = unsafe { (self.ucx.f.tag_send_nbx)(ep.ep, buf as *const c_void, len, tag, &p) };
        self.request("ucp_tag_send_nbx", r, len, false)
    }

    /// Posts a receive for each of `peers`' goodbyes at their teardown ([`Worker::goodbye`]):
    /// kept posted, so UCX takes a goodbye in any progress call, whatever this rank is doing.
    pub(crate) fn await_goodbyes(&self, peers: &[usize]) -> Vec<NetReq> {
        let at = &GOODBYE_BYTE as *const u8 as *mut u8;
        (peers.iter())
            .filter_map(|&q| {
                // SAFETY: zero bytes: UCX writes nothing at `at`.
                unsafe { self.recv_tag(at, 0, tag(q, GOODBYE), MEMORY_TYPE_HOST) }.ok()
            })
            .collect()
    }

    /// Says goodbye to every endpoint of `to`, as `rank`, then cancels `farewells` (the
    /// receives [`Worker::await_goodbyes`] posted). A goodbye is a zero-byte synchronous send:
    /// it completes once the peer's UCX took it, and one connection delivers in order, so
    /// everything this rank sent before is out of this host — where closing the connection can
    /// no longer discard it, as it could a small message whose plain send had completed while
    /// it still sat in this host's socket. All go at once; waits up to 2 s for them.
    pub(crate) fn goodbye(&self, to: &[&Endpoint], rank: usize, farewells: &mut Vec<NetReq>) {
        let p = no_imm_param(MEMORY_TYPE_HOST);
        let at = (&GOODBYE_BYTE as *const u8).cast();
        let mut reqs: Vec<NetReq> = (to.iter())
            .filter_map(|ep| {
                // SAFETY: zero bytes at a static byte; every endpoint belongs to this worker.
                let r =
                    unsafe { (self.ucx.f.tag_send_sync_nbx)(ep.ep, at, 0, tag(rank, GOODBYE), &p) };
                self.request("ucp_tag_send_sync_nbx", r, 0, false).ok()
            })
            .collect();
        let t0 = std::time::Instant::now();
        while !reqs.is_empty() && t0.elapsed() < std::time::Duration::from_secs(2) {
            self.progress();
            reqs.retain_mut(|r| self.test(r).is_none());
        }
        if !reqs.is_empty() {
            tracing::warn!(
                "{} network peers did not take this rank's goodbye within 2 s",
                reqs.len()
            );
        }
        // An unanswered goodbye is released, not cancelled: UCX may not cancel a send, and
        // waiting for that per peer would add seconds to this teardown. Its byte is static.
        for r in reqs.iter().filter(|r| !r.req.is_null()) {
            // SAFETY: a live request of this worker, released once and not used again; UCX
            // frees it when it completes (at the latest when its endpoint closes).
            unsafe { (self.ucx.f.request_free)(r.req) };
        }
        for r in farewells.iter_mut() {
            self.cancel(r);
        }
        farewells.clear();
    }

    /// The message with `tag` from a peer that is gone: it may have sent it just before (its
    /// bytes then sit in this host's sockets or in UCX), so the worker gets up to `within` to
    /// bring it in.
    pub(crate) fn probe_within(
        &self,
        tag: u64,
        within: std::time::Duration,
    ) -> Option<(Message, usize)> {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < within {
            self.progress();
            if let Some(m) = self.probe(tag) {
                return Some(m);
            }
        }
        None
    }

    /// The message with exactly `tag`, if it arrived (all of it, or for a large one its
    /// announcement), taken out of UCX's matching, with its length. Knowing the length before
    /// receiving lets a receive refuse a message too large for its buffer without writing a
    /// byte of it there.
    pub(crate) fn probe(&self, tag: u64) -> Option<(Message, usize)> {
        let mut info = TagRecvInfo::default();
        // SAFETY: valid worker; `remove = 1` hands the message to us (received below).
        let m = unsafe { (self.ucx.f.tag_probe_nb)(self.worker, tag, u64::MAX, 1, &mut info) };
        (!m.is_null()).then_some((Message(m), info.length))
    }

    /// Posts a receive of up to `cap` bytes into `buf` for the message with exactly `tag`,
    /// before it arrived: UCX then writes it straight into `buf` (a probed message was first
    /// buffered by UCX, one more copy). A larger message fails it with [`ERR_TRUNCATED`]; UCX
    /// writes none of a one-fragment or rendezvous message then, but may have written the
    /// leading fragments of a larger eager one.
    ///
    /// # Safety
    /// `buf..buf+cap` stays writable and otherwise untouched until the request completes or
    /// is cancelled.
    pub(crate) unsafe fn recv_tag(
        &self,
        buf: *mut u8,
        cap: usize,
        tag: u64,
        mem: u64,
    ) -> Result<NetReq> {
        let p = no_imm_param(mem);
        // SAFETY: by the caller's contract.
        let r = unsafe {
            (self.ucx.f.tag_recv_nbx)(self.worker, buf as *mut c_void, cap, tag, u64::MAX, &p)
        };
        self.request("ucp_tag_recv_nbx", r, cap, true)
    }

    /// Starts receiving the probed message `msg` (`len` bytes) into `buf`.
    ///
    /// # Safety
    /// `buf..buf+len` stays writable and otherwise untouched until the request completes or
    /// is cancelled.
    pub(crate) unsafe fn recv(
        &self,
        buf: *mut u8,
        len: usize,
        msg: Message,
        mem: u64,
    ) -> Result<NetReq> {
        let p = no_imm_param(mem);
        // SAFETY: by the caller's contract; `msg` came from `probe` and is received once.
        let r = unsafe {
            (self.ucx.f.tag_msg_recv_nbx)(self.worker, buf as *mut c_void, len, msg.0, &p)
        };
        self.request("ucp_tag_msg_recv_nbx", r, len, true)
    }

    fn request(&self, what: &str, r: *mut c_void, len: usize, recv: bool) -> Result<NetReq> {
        let v = r as isize;
        if (ERR_LAST..0).contains(&v) {
            return Err(CommError::Net(format!(
                "{what}: {}",
                self.ucx.name(v as Status)
            )));
        }
        // Null: done at once (UCX 1.13 completes small sends immediately even when asked not
        // to); the length is the one asked for, which for a probed receive is the message's.
        Ok(NetReq { req: r, len, recv })
    }

    /// Where `req` stands: `None` while in flight; else the bytes it moved or its failure
    /// (`Err((status, length))`, with [`Worker::describe`] for the words; for a truncated
    /// receive the message's length as UCX reports it). Completed requests are freed.
    pub(crate) fn test(
        &self,
        req: &mut NetReq,
    ) -> Option<std::result::Result<usize, (Status, usize)>> {
        if req.req.is_null() {
            return Some(Ok(req.len));
        }
        let mut info = TagRecvInfo::default();
        // SAFETY: `req` is a live request of this worker.
        let s = unsafe {
            if req.recv {
                (self.ucx.f.tag_recv_request_test)(req.req, &mut info)
            } else {
                (self.ucx.f.request_check_status)(req.req)
            }
        };
        if s == INPROGRESS {
            return None;
        }
        // SAFETY: complete, so UCX no longer touches the buffer; freed once.
        unsafe { (self.ucx.f.request_free)(req.req) };
        req.req = std::ptr::null_mut();
        Some(match (s, req.recv) {
            (UCS_OK, true) => Ok(info.length),
            (UCS_OK, false) => Ok(req.len),
            (s, _) => Err((s, info.length)),
        })
    }

    /// Cancels `req` and waits (progressing the worker) until UCX lets go of its buffer.
    pub(crate) fn cancel(&self, req: &mut NetReq) {
        if req.req.is_null() {
            return;
        }
        // SAFETY: a live request of this worker.
        unsafe { (self.ucx.f.request_cancel)(self.worker, req.req) };
        let t0 = std::time::Instant::now();
        // `test` frees the request once it is over (cancelled or completed).
        while self.test(req).is_none() {
            self.progress();
            if t0.elapsed() > std::time::Duration::from_secs(5) {
                // A send UCX cannot cancel (already on the wire): give up the request, not the
                // thread; its buffer belongs to an operation that failed.
                tracing::warn!("a UCX request did not cancel within 5 s; leaving it");
                req.req = std::ptr::null_mut();
                return;
            }
        }
    }

    /// A status code in words.
    pub(crate) fn describe(&self, s: Status) -> String {
        self.ucx.name(s)
    }

    /// Closes `ep`: flushing first (what was sent reaches the peer even though this process
    /// exits next; up to 2 s), or at once where `force` (an abort, or the peer is gone).
    pub(crate) fn close(&self, ep: Endpoint, force: bool) {
        let p = RequestParam {
            op_attr_mask: OP_ATTR_FIELD_FLAGS,
            flags: if force { EP_CLOSE_FLAG_FORCE } else { 0 },
            rest: [0; 8],
        };
        // SAFETY: a live endpoint of this worker, closed once.
        let r = unsafe { (self.ucx.f.ep_close_nbx)(ep.ep, &p) };
        let v = r as isize;
        let mut closed = true;
        if !r.is_null() && !(ERR_LAST..0).contains(&v) {
            let mut req = NetReq {
                req: r,
                len: 0,
                recv: false,
            };
            let t0 = std::time::Instant::now();
            closed = loop {
                if self.test(&mut req).is_some() {
                    break true;
                }
                if t0.elapsed() > std::time::Duration::from_secs(2) {
                    break false;
                }
                self.progress();
            };
            if !closed {
                // The peer did not take part in the flush (stopped, or wedged): release the
                // request to UCX (destroying the worker asserts on an unreleased one), which
                // finishes the close when the worker goes.
                tracing::warn!("a network endpoint did not flush within 2 s; closing it anyway");
                // SAFETY: a live request of this worker, released once and not used again.
                unsafe { (self.ucx.f.request_free)(req.req) };
            }
        }
        if closed {
            // SAFETY: the endpoint is closed: its error handler can no longer run.
            drop(unsafe { Arc::from_raw(ep.arg as *const AtomicI32) });
        }
        // Otherwise its handler may still run until the worker is destroyed: its argument
        // stays allocated (one small leak per endpoint that failed to close).
        drop(ep.failed);
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: endpoints were closed by their owner; destroyed once, then the context.
        unsafe {
            (self.ucx.f.worker_destroy)(self.worker);
            (self.ucx.f.cleanup)(self.ctx);
        }
    }
}

/// Parameters of a send or receive of memory of UCX type `mem` (said, so UCX does not look the
/// buffer up in its memory-type cache — our host buffers are memfd mappings it has not seen
/// allocated).
fn no_imm_param(mem: u64) -> RequestParam {
    let mut rest = [0u64; 8];
    // `memory_type` (offset 48 = rest[5]).
    rest[5] = mem;
    RequestParam {
        op_attr_mask: OP_ATTR_FIELD_FLAGS | OP_ATTR_FIELD_MEMORY_TYPE,
        flags: OP_ATTR_FLAG_NO_IMM_CMPL,
        rest,
    }
}

/// UCX's endpoint error handler: records the status for the engine.
unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: *mut c_void, status: Status) {
    // SAFETY: `arg` is the `Arc<AtomicI32>` leaked in `Worker::connect`, alive until the
    // endpoint is closed; only borrowed here.
    let failed = unsafe { &*(arg as *const AtomicI32) };
    failed.store(
        if status == 0 { -1 } else { status.into() },
        Ordering::Release,
    );
}

/// One endpoint (to one peer's worker).
pub(crate) struct Endpoint {
    ep: *mut c_void,
    arg: *mut c_void,
    failed: Arc<AtomicI32>,
}

// SAFETY: used only through its worker, under the worker's rules (see `Worker`).
unsafe impl Send for Endpoint {}

/// A probed message, to be received once ([`Worker::recv`]).
pub(crate) struct Message(*mut c_void);

/// A request in flight (or freed: null).
#[derive(Debug)]
pub(crate) struct NetReq {
    req: *mut c_void,
    /// Bytes asked for (what a request done at once moved).
    len: usize,
    recv: bool,
}

// SAFETY: a handle passed back only to its worker, under the network state's lock.
unsafe impl Send for NetReq {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rendezvous_threshold_is_raised_only_over_tcp_and_never_over_the_users_choice() {
        assert_eq!(rndv_thresh(false, false), Some(c"512K"));
        assert_eq!(
            rndv_thresh(true, false),
            None,
            "the user's UCX_RNDV_THRESH stands"
        );
        assert_eq!(rndv_thresh(false, true), None, "RDMA keeps UCX's default");
    }

    #[test]
    fn the_context_says_it_moves_host_memory() {
        let ucx = match Ucx::load() {
            Ok(u) => u,
            Err(e) => {
                flagcx_adaptor::conformance::report_skip_reason(
                    "ucx::tests::the_context_says_it_moves_host_memory",
                    "net",
                    &format!("UCX is not installed ({e})"),
                );
                return;
            }
        };
        let w = Worker::new(ucx).expect("a UCP context and worker");
        let t = w.memory_types().expect("ucp_context_query");
        assert_ne!(t & 1 << MEMORY_TYPE_HOST, 0, "memory types {t:#x}");
        eprintln!("UCX moves memory types {t:#x}");
    }
}
