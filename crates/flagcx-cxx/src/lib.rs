//! `flagcx::Comm` for C++: the communicator of flagcx-rs behind a cxx bridge.
//!
//! C++ programs include `flagcx/comm.hpp` (in `include/`, installed by `cargo xtask capi`),
//! which wraps the bridge in an RAII class with `send`/`recv` on raw device pointers and
//! native streams, `group` taking a callable, and exceptions (`flagcx::Error`) carrying the
//! error's kind and message. Link `libflagcx_cxx.a`.

use std::collections::HashMap;
use std::sync::Mutex;

use flagcx_rs::p2p::{Config, UniqueId};
use flagcx_rs::{
    Adaptor, Comm, CommError, DataType, DeviceAdaptor, DevicePtr, ReduceOp, Request, StreamHandle,
};

#[cxx::bridge(namespace = "flagcx::ffi")]
mod ffi {
    extern "Rust" {
        /// A communicator (see `flagcx::Comm` in comm.hpp).
        type RustComm;

        /// A fresh job id (text) for [`comm_init`].
        fn unique_id() -> Result<String>;
        /// Joins job `id` as `rank` of `nranks` on the vendor and device the environment
        /// names (`FLAGCX_VENDOR`, `FLAGCX_DEVICE`, else detection and the local rank).
        fn comm_init(nranks: usize, rank: usize, id: &str) -> Result<Box<RustComm>>;
        /// This rank.
        fn rank(self: &RustComm) -> usize;
        /// Ranks in the job.
        fn nranks(self: &RustComm) -> usize;
        /// The vendor's name.
        fn vendor(self: &RustComm) -> String;
        /// The device.
        fn device(self: &RustComm) -> usize;
        /// Sends `bytes` at `ptr` to `peer`, ordered on the native stream `stream` (0: the
        /// communicator's own).
        fn send(
            self: &RustComm,
            ptr: usize,
            bytes: usize,
            peer: usize,
            stream: usize,
        ) -> Result<()>;
        /// Receives into `bytes` at `ptr` from `peer`, ordered like `send`.
        fn recv(
            self: &RustComm,
            ptr: usize,
            bytes: usize,
            peer: usize,
            stream: usize,
        ) -> Result<()>;
        /// A reduction of `count` elements of type `dtype` (FlagCX's numbering) with operator
        /// `op` (sum, prod, max, min, avg: 0-4), ordered on `stream` like `send`: `kind` 0 is
        /// all-reduce, 1 reduce-scatter (`count` per rank), 2 reduce to `root`.
        #[allow(clippy::too_many_arguments)]
        fn reduce(
            self: &RustComm,
            kind: u8,
            send: usize,
            recv: usize,
            count: usize,
            dtype: u8,
            op: u8,
            root: usize,
            stream: usize,
        ) -> Result<()>;
        /// Opens a group.
        fn group_begin(self: &RustComm) -> Result<()>;
        /// Closes the group and enqueues its operations.
        fn group_end(self: &RustComm) -> Result<()>;
        /// Waits for every operation posted so far; the first failure is the error.
        fn wait_all(self: &RustComm) -> Result<()>;
        /// The first asynchronous failure ("" if none), as "Kind|message".
        fn async_error(self: &RustComm) -> String;
        /// Aborts: pending operations fail, waiting streams are released.
        fn abort(self: &RustComm);
        /// Device memory of the communicator's device (`bytes` > 0).
        fn alloc(self: &RustComm, bytes: usize) -> Result<usize>;
        /// Frees what `alloc` returned, once the communicator's stream passed its work.
        fn free(self: &RustComm, ptr: usize) -> Result<()>;
        /// Copies host bytes to device memory, in order on the communicator's stream; returns
        /// when done.
        fn write(self: &RustComm, dst: usize, src: &[u8]) -> Result<()>;
        /// Copies device memory to host bytes, after everything earlier on the communicator's
        /// stream; returns when done.
        fn read(self: &RustComm, src: usize, dst: &mut [u8]) -> Result<()>;
    }
}

/// What the C++ side holds.
pub struct RustComm {
    comm: Comm<Adaptor>,
    /// The stream used when the caller passes none.
    own: StreamHandle,
    /// Native streams adopted on first use (vendors that have them).
    adopted: Mutex<HashMap<usize, StreamHandle>>,
    pending: Mutex<Vec<Request>>,
}

/// An error as the C++ side parses it: `Kind|message`.
#[derive(Debug)]
pub struct Failure(String);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Failure {}

/// The kind of a [`CommError`], as the C++ `flagcx::ErrorKind` names it.
fn kind(e: &CommError) -> &'static str {
    match e {
        CommError::Adaptor(_) => "Device",
        CommError::Io { .. } | CommError::Bootstrap(_) | CommError::Net(_) => "System",
        CommError::Config { .. } | CommError::InvalidArgument(_) => "InvalidArgument",
        CommError::SizeMismatch { .. } => "SizeMismatch",
        CommError::PeerLost { .. } => "PeerLost",
        CommError::RemoteFailure { .. } | CommError::Protocol(_) => "Remote",
        CommError::Timeout { .. } => "Timeout",
        CommError::Aborted => "Aborted",
        _ => "Internal",
    }
}

impl From<CommError> for Failure {
    fn from(e: CommError) -> Self {
        Failure(format!("{}|{e}", kind(&e)))
    }
}

impl From<flagcx_rs::AdaptorError> for Failure {
    fn from(e: flagcx_rs::AdaptorError) -> Self {
        CommError::from(e).into()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn unique_id() -> Result<String, Failure> {
    Ok(UniqueId::random()?.to_string())
}

fn comm_init(nranks: usize, rank: usize, id: &str) -> Result<Box<RustComm>, Failure> {
    // FLAGCX_DEBUG reaches C++ programs too, as it does C ones through libflagcx.
    if std::env::var_os("FLAGCX_DEBUG").is_some() {
        flagcx_rs::init_logging();
    }
    let id: UniqueId = id.parse()?;
    let adaptor = Adaptor::from_env()?;
    let own = adaptor.stream_create()?;
    let comm = Comm::init(adaptor, rank, nranks, &id, Config::from_env()?)?;
    Ok(Box::new(RustComm {
        comm,
        own,
        adopted: Mutex::new(HashMap::new()),
        pending: Mutex::new(Vec::new()),
    }))
}

impl RustComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn nranks(&self) -> usize {
        self.comm.nranks()
    }

    fn vendor(&self) -> String {
        self.comm.adaptor().vendor().name().to_string()
    }

    fn device(&self) -> usize {
        self.comm.adaptor().device()
    }

    /// The adaptor's handle for a native stream (0: our own), adopting it on first use.
    fn stream(&self, native: usize) -> Result<StreamHandle, Failure> {
        if native == 0 {
            return Ok(self.own);
        }
        let mut adopted = lock(&self.adopted);
        if let Some(s) = adopted.get(&native) {
            return Ok(*s);
        }
        // SAFETY: the C++ caller passes a live native stream of this device that outlives
        // the communicator (comm.hpp's contract).
        let s = unsafe { self.comm.adaptor().stream_adopt(native as u64) }?;
        adopted.insert(native, s);
        Ok(s)
    }

    fn post(
        &self,
        send: bool,
        ptr: usize,
        bytes: usize,
        peer: usize,
        stream: usize,
    ) -> Result<(), Failure> {
        let s = self.stream(stream)?;
        let p = DevicePtr(ptr as u64);
        // SAFETY: the C++ caller keeps the buffer valid until the stream passes the
        // operation (comm.hpp's contract, as NCCL's).
        let r = unsafe {
            if send {
                self.comm.send_raw(p, bytes, peer, s)
            } else {
                self.comm.recv_raw(p, bytes, peer, s)
            }
        }?;
        let mut pending = lock(&self.pending);
        pending.retain(|r| !r.is_done());
        pending.push(r);
        Ok(())
    }

    fn send(&self, ptr: usize, bytes: usize, peer: usize, stream: usize) -> Result<(), Failure> {
        self.post(true, ptr, bytes, peer, stream)
    }

    fn recv(&self, ptr: usize, bytes: usize, peer: usize, stream: usize) -> Result<(), Failure> {
        self.post(false, ptr, bytes, peer, stream)
    }

    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        kind: u8,
        send: usize,
        recv: usize,
        count: usize,
        dtype: u8,
        op: u8,
        root: usize,
        stream: usize,
    ) -> Result<(), Failure> {
        let bad = |what: String| Failure::from(CommError::InvalidArgument(what));
        let t = DataType::from_flagcx(i32::from(dtype))
            .ok_or_else(|| bad(format!("unknown data type {dtype}")))?;
        let o = ReduceOp::from_flagcx(i32::from(op))
            .ok_or_else(|| bad(format!("unknown reduction operator {op}")))?;
        let s = self.stream(stream)?;
        let (sp, rp) = (DevicePtr(send as u64), DevicePtr(recv as u64));
        // SAFETY: the C++ caller keeps both buffers valid until the stream passes the call
        // (comm.hpp's contract, as NCCL's).
        let c = unsafe {
            match kind {
                0 => self.comm.all_reduce_raw(sp, rp, count, t, o, s),
                1 => self.comm.reduce_scatter_raw(sp, rp, count, t, o, s),
                2 => self.comm.reduce_raw(sp, rp, count, t, o, root, s),
                _ => return Err(bad(format!("unknown reduction kind {kind}"))),
            }
        }?;
        let mut pending = lock(&self.pending);
        pending.retain(|r| !r.is_done());
        pending.extend(c.into_requests());
        Ok(())
    }

    fn group_begin(&self) -> Result<(), Failure> {
        Ok(self.comm.group_begin()?)
    }

    fn group_end(&self) -> Result<(), Failure> {
        Ok(self.comm.group_end()?)
    }

    fn wait_all(&self) -> Result<(), Failure> {
        let pending = std::mem::take(&mut *lock(&self.pending));
        let mut first = None;
        for r in pending {
            if let Err(e) = r.wait() {
                first.get_or_insert(e);
            }
        }
        self.comm.adaptor().stream_synchronize(self.own)?;
        first.map_or(Ok(()), |e| Err(e.into()))
    }

    fn async_error(&self) -> String {
        self.comm
            .async_error()
            .map_or_else(String::new, |e| Failure::from(e).0)
    }

    fn abort(&self) {
        self.comm.abort();
    }

    fn alloc(&self, bytes: usize) -> Result<usize, Failure> {
        Ok(self.comm.adaptor().mem_alloc(bytes)?.0 as usize)
    }

    fn free(&self, ptr: usize) -> Result<(), Failure> {
        let a = self.comm.adaptor();
        a.stream_synchronize(self.own)?;
        // SAFETY: the stream passed its work; the adaptor refuses pointers it did not hand out.
        Ok(unsafe { a.mem_free(DevicePtr(ptr as u64)) }?)
    }

    fn write(&self, dst: usize, src: &[u8]) -> Result<(), Failure> {
        let a = self.comm.adaptor();
        // SAFETY: `src` lives until the synchronize below; the adaptor checks `dst`.
        unsafe { a.memcpy_h2d_async(DevicePtr(dst as u64), src.as_ptr(), src.len(), self.own) }?;
        Ok(a.stream_synchronize(self.own)?)
    }

    fn read(&self, src: usize, dst: &mut [u8]) -> Result<(), Failure> {
        let a = self.comm.adaptor();
        // SAFETY: `dst` lives until the synchronize below; the adaptor checks `src`.
        unsafe {
            a.memcpy_d2h_async(dst.as_mut_ptr(), DevicePtr(src as u64), dst.len(), self.own)
        }?;
        Ok(a.stream_synchronize(self.own)?)
    }
}

impl Drop for RustComm {
    fn drop(&mut self) {
        let a = self.comm.adaptor().clone();
        for (_, s) in lock(&self.adopted).drain() {
            let _ = a.stream_release(s);
        }
        let _ = a.stream_destroy(self.own);
    }
}
