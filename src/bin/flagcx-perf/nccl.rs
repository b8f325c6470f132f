//! `--vs-nccl`: NCCL, loaded at run time (`libnccl.so.2`), measured right after us on the same
//! buffers, stream, sizes and timing method (every iteration enqueued, one synchronize), its
//! communicator formed through ours (rank 0's unique id travels by our broadcast).
//!
//! NCCL runs only where every rank is a CUDA rank on a GPU of its own (it refuses two ranks on
//! one GPU); elsewhere, or without the library, each row says `n/a` and the header says why.
//! Every rank reaches the same verdict from the same facts (all-gathered peer information and
//! an all-gathered "library loaded" flag), so no rank waits in NCCL for one that never comes.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::time::Instant;

use flagcx::{Adaptor, Comm, DeviceAdaptor, DeviceBuffer, DevicePtr, Stream, Vendor};

use crate::Error;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([c_char; 128]);

type Res = c_int;
type CommT = *mut c_void;
/// `ncclInt8`.
const INT8: c_int = 0;

/// The NCCL entry points used here (signatures from nccl.h).
struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> Res,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Res,
    comm_init_rank: unsafe extern "C" fn(*mut CommT, c_int, UniqueId, c_int) -> Res,
    comm_destroy: unsafe extern "C" fn(CommT) -> Res,
    error_string: unsafe extern "C" fn(Res) -> *const c_char,
    group_start: unsafe extern "C" fn() -> Res,
    group_end: unsafe extern "C" fn() -> Res,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, CommT, *mut c_void) -> Res,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, CommT, *mut c_void) -> Res,
    all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, CommT, *mut c_void) -> Res,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        CommT,
        *mut c_void,
    ) -> Res,
    /// `ncclAllReduce` and `ncclReduceScatter` (same shape: count, type, op).
    all_reduce: RedFn,
    reduce_scatter: RedFn,
    reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        CommT,
        *mut c_void,
    ) -> Res,
}

/// `ncclAllReduce`'s signature (send, recv, count, type, op, comm, stream).
type RedFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    CommT,
    *mut c_void,
) -> Res;

impl Api {
    /// Loads `libnccl.so.2` and resolves every entry point, or says why not.
    fn load() -> Result<(Api, String), String> {
        // SAFETY: dlopen of a library name; the handle is never closed (the functions are used
        // until the process exits).
        let h = unsafe { libc::dlopen(c"libnccl.so.2".as_ptr(), libc::RTLD_NOW) };
        if h.is_null() {
            return Err("libnccl.so.2 not found".into());
        }
        let sym = |name: &CStr| -> Result<*mut c_void, String> {
            // SAFETY: a live handle and a NUL-terminated name.
            let p = unsafe { libc::dlsym(h, name.as_ptr()) };
            if p.is_null() {
                Err(format!("libnccl.so.2 lacks {}", name.to_string_lossy()))
            } else {
                Ok(p)
            }
        };
        // SAFETY: each symbol is the NCCL function of that name, whose C signature the field's
        // type spells (nccl.h, NCCL 2.7 and later).
        let api = unsafe {
            Api {
                get_version: func(sym(c"ncclGetVersion")?),
                get_unique_id: func(sym(c"ncclGetUniqueId")?),
                comm_init_rank: func(sym(c"ncclCommInitRank")?),
                comm_destroy: func(sym(c"ncclCommDestroy")?),
                error_string: func(sym(c"ncclGetErrorString")?),
                group_start: func(sym(c"ncclGroupStart")?),
                group_end: func(sym(c"ncclGroupEnd")?),
                send: func(sym(c"ncclSend")?),
                recv: func(sym(c"ncclRecv")?),
                all_gather: func(sym(c"ncclAllGather")?),
                broadcast: func(sym(c"ncclBroadcast")?),
                all_reduce: func(sym(c"ncclAllReduce")?),
                reduce_scatter: func(sym(c"ncclReduceScatter")?),
                reduce: func(sym(c"ncclReduce")?),
            }
        };
        let mut v = 0;
        // SAFETY: a valid out-pointer.
        unsafe { (api.get_version)(&mut v) };
        let version = format!("NCCL {}.{}.{}", v / 10000, v / 100 % 100, v % 100);
        Ok((api, version))
    }

    fn check(&self, what: &str, r: Res) -> Result<(), Error> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any result code.
        let s = unsafe { CStr::from_ptr((self.error_string)(r)) };
        Err(format!("{what}: {} ({r})", s.to_string_lossy()).into())
    }
}

/// `p` as the function pointer type `F`.
///
/// # Safety
/// `p` is a function whose C signature `F` spells.
unsafe fn func<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size (checked), and the caller vouches for the signature.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

/// A live NCCL communicator over this job's ranks.
pub(crate) struct Nccl {
    api: Api,
    comm: CommT,
    /// The reductions' type and operator, numbered as NCCL numbers them (FlagCX's numbers are
    /// NCCL's), and the type's size.
    red: (c_int, c_int, usize),
    /// "NCCL 2.28.3", for the header.
    pub(crate) version: String,
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: our communicator, destroyed once; no operation is in flight (every timing
        // ends with a synchronize).
        unsafe { (self.api.comm_destroy)(self.comm) };
    }
}

/// Whether `test` has an NCCL counterpart here.
fn supported(test: &str) -> bool {
    matches!(
        test,
        "sendrecv"
            | "pingpong"
            | "pairs"
            | "allgather"
            | "broadcast"
            | "alltoall"
            | "allreduce"
            | "reducescatter"
            | "reduce"
    )
}

impl Nccl {
    /// Forms the NCCL communicator, or says (identically on every rank) why there is none.
    pub(crate) fn open(
        comm: &Comm<Adaptor>,
        stream: &Stream<Adaptor>,
        test: &str,
        red: crate::collective::Red,
    ) -> Result<Result<Nccl, String>, Error> {
        let (me, n) = (comm.rank(), comm.nranks());
        if !supported(test) {
            return Ok(Err(format!("no NCCL counterpart for {test} here")));
        }
        let mine = comm.adaptor().properties(comm.adaptor().device())?;
        let infos: Vec<_> = (0..n)
            .filter(|&q| q != me)
            .filter_map(|q| comm.peer_info(q))
            .collect();
        if comm.adaptor().vendor() != Vendor::Cuda || infos.iter().any(|i| i.vendor != Vendor::Cuda)
        {
            return Ok(Err("NCCL runs CUDA ranks only".into()));
        }
        // Every rank loads the library, and all learn whether all could.
        let loaded = Api::load();
        let flags = crate::all_gather_bytes(comm, stream, &[loaded.is_ok() as u8])?;
        let (api, version) = match loaded {
            Ok(x) if flags.iter().all(|&f| f == 1) => x,
            Ok(_) => return Ok(Err("another rank could not load libnccl.so.2".into())),
            Err(why) => return Ok(Err(why)),
        };
        let mut buses: Vec<Option<String>> = infos.iter().map(|i| i.pci_bus_id.clone()).collect();
        buses.push(mine.pci_bus_id.clone());
        let mut seen = std::collections::BTreeSet::new();
        if let Some(dup) = buses.iter().flatten().find(|b| !seen.insert(b.as_str())) {
            return Ok(Err(format!(
                "{version} refuses two ranks on one GPU ({dup})"
            )));
        }
        let mut id = UniqueId([0; 128]);
        if me == 0 {
            // SAFETY: a valid out-pointer.
            api.check("ncclGetUniqueId", unsafe { (api.get_unique_id)(&mut id) })?;
        }
        let buf = DeviceBuffer::new(comm.adaptor(), 128)?;
        // SAFETY: `UniqueId` is 128 plain bytes.
        let bytes = unsafe { std::mem::transmute::<UniqueId, [u8; 128]>(id) };
        buf.write(0, &bytes, stream)?;
        // SAFETY: 128 bytes in `buf`, which outlives the wait and synchronize.
        let c = unsafe { comm.broadcast_raw(buf.ptr(), buf.ptr(), 128, 0, stream.handle())? };
        c.wait()?;
        stream.synchronize()?;
        let mut got = [0u8; 128];
        buf.read(0, &mut got, stream)?;
        // SAFETY: as above, back into the id.
        let id = unsafe { std::mem::transmute::<[u8; 128], UniqueId>(got) };
        let mut nc: CommT = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; every rank passes the same id and job size.
        let r = unsafe { (api.comm_init_rank)(&mut nc, n as c_int, id, me as c_int) };
        if r != 0 {
            return Ok(Err(api
                .check("ncclCommInitRank", r)
                .unwrap_err()
                .to_string()));
        }
        Ok(Ok(Nccl {
            api,
            comm: nc,
            red: (red.dtype as c_int, red.op as c_int, red.dtype.size()),
            version,
        }))
    }

    /// Seconds per iteration of `test` at `size` bytes, timed as nccl-tests times it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn time(
        &self,
        test: &str,
        me: usize,
        n: usize,
        send: DevicePtr,
        recv: DevicePtr,
        size: usize,
        root: usize,
        stream: &Stream<Adaptor>,
        warmup: usize,
        iters: usize,
    ) -> Result<f64, Error> {
        let s = stream.handle().0 as *mut c_void;
        let (sp, rp) = (send.0 as *const c_void, recv.0 as *mut c_void);
        let a = &self.api;
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let block = size / n;
        let once = || -> Result<(), Error> {
            // SAFETY: for every call below, the buffers hold at least `size` bytes each (for
            // alltoall, `n` blocks) and outlive the synchronize after the loop below; the
            // stream is the caller's live CUDA stream; the communicator is ours.
            unsafe {
                match test {
                    "sendrecv" => {
                        a.check("ncclGroupStart", (a.group_start)())?;
                        a.check(
                            "ncclSend",
                            (a.send)(sp, size, INT8, next as c_int, self.comm, s),
                        )?;
                        a.check(
                            "ncclRecv",
                            (a.recv)(rp, size, INT8, prev as c_int, self.comm, s),
                        )?;
                        a.check("ncclGroupEnd", (a.group_end)())
                    }
                    "pingpong" => {
                        let peer = 1 - me as c_int;
                        if me == 0 {
                            a.check("ncclSend", (a.send)(sp, size, INT8, peer, self.comm, s))?;
                            a.check("ncclRecv", (a.recv)(rp, size, INT8, peer, self.comm, s))
                        } else {
                            a.check("ncclRecv", (a.recv)(rp, size, INT8, peer, self.comm, s))?;
                            a.check("ncclSend", (a.send)(rp, size, INT8, peer, self.comm, s))
                        }
                    }
                    "pairs" | "alltoall" => {
                        // pairs: `size` to and from every peer (as ours: distinct offsets are
                        // not needed for timing); alltoall: one block to and from each.
                        let (bytes, stride) = if test == "pairs" {
                            (size, 0)
                        } else {
                            (block, block)
                        };
                        a.check("ncclGroupStart", (a.group_start)())?;
                        for q in (0..n).filter(|&q| test == "alltoall" || q != me) {
                            let so = sp.cast::<u8>().add(q * stride).cast();
                            let ro = rp.cast::<u8>().add(q * stride).cast();
                            a.check(
                                "ncclSend",
                                (a.send)(so, bytes, INT8, q as c_int, self.comm, s),
                            )?;
                            a.check(
                                "ncclRecv",
                                (a.recv)(ro, bytes, INT8, q as c_int, self.comm, s),
                            )?;
                        }
                        a.check("ncclGroupEnd", (a.group_end)())
                    }
                    "allgather" => a.check(
                        "ncclAllGather",
                        (a.all_gather)(sp, rp, block, INT8, self.comm, s),
                    ),
                    "allreduce" => {
                        let (t, o, sz) = self.red;
                        a.check(
                            "ncclAllReduce",
                            (a.all_reduce)(sp, rp, size / sz, t, o, self.comm, s),
                        )
                    }
                    "reducescatter" => {
                        let (t, o, sz) = self.red;
                        a.check(
                            "ncclReduceScatter",
                            (a.reduce_scatter)(sp, rp, size / n / sz, t, o, self.comm, s),
                        )
                    }
                    "reduce" => {
                        let (t, o, sz) = self.red;
                        a.check(
                            "ncclReduce",
                            (a.reduce)(sp, rp, size / sz, t, o, root as c_int, self.comm, s),
                        )
                    }
                    _ => a.check(
                        "ncclBroadcast",
                        (a.broadcast)(sp, rp, size, INT8, root as c_int, self.comm, s),
                    ),
                }
            }
        };
        for _ in 0..warmup {
            once()?;
        }
        stream.synchronize()?;
        let t = Instant::now();
        for _ in 0..iters {
            once()?;
        }
        stream.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / iters as f64)
    }
}
