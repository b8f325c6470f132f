//! The communicator: point-to-point operations between the ranks of a job.

// tidy: long file: the communicator API together with the posting threads' protocols (eager, IPC); they move into per-transport modules with the engine split.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use flagcx_adaptor::{
    DeviceAdaptor, DeviceBuffer, DevicePtr, EventHandle, Stream, StreamHandle, WaitCondition,
};

use crate::bootstrap::{Bootstrap, UniqueId};
use crate::channel::{Channel, Counter, Geometry, RecvDesc, SendDesc, SendStatus, DESC_RING};
use crate::config::{Config, RankEnv, StreamJoin, MAX_EAGER_MAX};
use crate::error::{CommError, Result};
use crate::peer::{choose_transport, direct_copier, receiver_copies, PeerInfo, TransportKind};
use crate::proxy::{
    answer, export, give_verdict, lock, pull_without_copy, push_without_copy, receive_eager,
    recycle_event, send_failure, verdict_result, Dir, Inbox, IpcCache, Op, Path, PeerConn, Proxy,
    Resume, Roles, Shared, Slot, WatermarkWord,
};
use crate::shm::ShmSegment;
use crate::wire::{Reader, Tag, Writer};
use crate::PathStats;

/// A handle to one posted operation.
#[derive(Debug)]
pub struct Request {
    state: State,
    seq: u64,
    spin: Duration,
}

/// Where a request's result is.
#[derive(Debug)]
enum State {
    /// Finished while it was posted (the eager path): nothing shared, nothing to wait for.
    Done(Result<usize>),
    /// With the proxy, which fills the slot.
    Pending(Arc<Slot>),
}

impl Request {
    /// Blocks until the operation finished; returns the bytes moved (for a receive: the bytes
    /// the sender sent, at most the buffer's size).
    pub fn wait(self) -> Result<usize> {
        match self.state {
            State::Done(r) => r,
            State::Pending(slot) => slot
                .wait(None, self.spin)
                .unwrap_or(Err(CommError::Aborted)),
        }
    }

    /// Like [`Request::wait`], giving up after `timeout` (the operation continues).
    pub fn wait_timeout(self, timeout: Duration) -> Result<usize> {
        let seq = self.seq;
        match self.state {
            State::Done(r) => r,
            State::Pending(slot) => slot.wait(Some(timeout), self.spin).unwrap_or_else(|| {
                Err(CommError::Timeout {
                    ms: timeout.as_millis() as u64,
                    peer: None,
                    what: format!("operation {seq} (Request::wait_timeout)"),
                })
            }),
        }
    }

    /// True once the operation finished.
    pub fn is_done(&self) -> bool {
        match &self.state {
            State::Done(_) => true,
            State::Pending(slot) => slot.is_done(),
        }
    }
}

/// The API side's handle on one pair's eager slots (see [`Config::eager_max`]).
struct EagerLink {
    /// This rank → peer.
    out: Arc<Channel>,
    /// Peer → this rank.
    inc: Arc<Channel>,
    /// Largest message this rank sends eagerly to the peer (0: none).
    send_max: usize,
    /// Largest message the peer can send eagerly to this rank (0: none).
    recv_max: usize,
    /// The peer's `RecvDone` as last read: slots below it + 64 are free without reading the
    /// counter again (a cache line the peer writes on every message). Under the inbox lock.
    freed: AtomicU64,
}

/// The API side's handle on an IPC pair, for operations the posting thread moves itself
/// ([`Config::ipc_caller`]).
struct CallerLink {
    /// This rank → peer.
    out: Arc<Channel>,
    /// Peer → this rank.
    inc: Arc<Channel>,
    /// This rank copies what it sends into the peer's buffer (else the peer pulls it).
    push: bool,
    /// This rank copies what it receives out of the peer's buffer (else the peer pushes it).
    pull: bool,
}

/// One message a posting thread moves: its direction, number, buffer and peer.
#[derive(Clone, Copy)]
struct Msg {
    dir: Dir,
    k: u64,
    ptr: DevicePtr,
    bytes: usize,
    peer: usize,
}

impl CallerLink {
    /// The channel carrying messages of `dir`, and the counters through which the peer
    /// answers there (its descriptor or answer, and its failure).
    fn lane(&self, dir: Dir) -> (&Channel, Counter, Counter) {
        match dir {
            Dir::Send => (&self.out, Counter::RecvPosted, Counter::RecvFault),
            Dir::Recv => (&self.inc, Counter::SendPosted, Counter::SendFault),
        }
    }
}

/// What became of an IPC operation the posting thread took on.
enum Caller {
    /// Finished.
    Done(Result<usize>),
    /// The proxy goes on from here (`None`: from the start).
    HandOff(Option<Resume>),
}

/// A page the callers' streams can wait on: the low 32 bits of the completion watermark.
struct WatermarkPage {
    host: *mut u8,
    device: Option<DevicePtr>,
}

// SAFETY: the page is private to its communicator: mapped in `WatermarkPage::new`, unmapped
// once in `release` from `Comm::drop`; the communicator's threads only touch its watermark
// word, atomically (see `WatermarkWord`).
unsafe impl Send for WatermarkPage {}
// SAFETY: as above.
unsafe impl Sync for WatermarkPage {}

/// Point-to-point communication among the ranks of one job, on one device.
///
/// Operations are ordered on the caller's stream: they start after the work enqueued before
/// them and later work on that stream sees their result. Between a pair of ranks, operations in
/// one direction match in posting order. Post a bidirectional exchange inside a group
/// ([`Comm::group`]); otherwise each send waits on its stream for its receiver, as in NCCL.
///
/// Outside a group, where nothing earlier of the pair and direction is in flight, the posting
/// thread moves a message itself where it can: eagerly between host-addressable ranks
/// ([`Config::eager_max`]), and on IPC pairs ([`Config::ipc_caller`]). Such a post may then take
/// up to the spin time (plus up to 2 ms while the message's copy runs) and return a request
/// that is already complete.
pub struct Comm<A: DeviceAdaptor> {
    adaptor: A,
    rank: usize,
    nranks: usize,
    infos: Vec<PeerInfo>,
    transports: Vec<Option<TransportKind>>,
    /// Per peer: the rank that issues the IPC copies of the pair (`None`: each sender).
    copiers: Vec<Option<usize>>,
    /// Per staged peer: the rank that copies straight into and out of the host-vendor rank's
    /// buffers (`None`: no direct path).
    direct: Vec<Option<usize>>,
    /// Per peer: the eager slots, where both ranks' device memory is host addressable.
    eager: Vec<Option<EagerLink>>,
    /// Per IPC peer (unless `FLAGCX_P2P_IPC_CALLER=off`): its channels, for the posting thread.
    caller: Vec<Option<CallerLink>>,
    shared: Arc<Shared>,
    proxy: Option<JoinHandle<()>>,
    next_seq: AtomicU64,
    group: Mutex<Option<Vec<(Op, StreamHandle)>>>,
    /// Streams this communicator made wait on its watermark (synchronized before teardown).
    /// Per joined stream, an event of ours recorded right after its last join: teardown waits
    /// on it, so the watermark page outlives every wait on it even if the caller already
    /// destroyed the stream (a destroyed stream still runs what was queued).
    /// Beside it, the operation that last join waits for.
    joined: Mutex<HashMap<u64, (EventHandle, u64)>>,
    page: WatermarkPage,
    config: Config,
    _boot: Arc<Bootstrap>,
}

impl<A: DeviceAdaptor> std::fmt::Debug for Comm<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .field("vendor", &self.adaptor.vendor())
            .finish()
    }
}

impl<A: DeviceAdaptor> Comm<A> {
    /// Joins the job described by the environment (`FLAGCX_RANK`/`FLAGCX_NRANKS`/
    /// `FLAGCX_UNIQUE_ID`, torchrun or Open MPI variables) with configuration from `FLAGCX_*`.
    pub fn from_env(adaptor: A) -> Result<Self> {
        let env = RankEnv::from_env()?;
        let config = Config::from_env()?;
        Self::init(adaptor, env.rank, env.nranks, &env.id, config)
    }

    /// Joins job `id` as `rank` of `nranks`.
    pub fn init(
        adaptor: A,
        rank: usize,
        nranks: usize,
        id: &UniqueId,
        config: Config,
    ) -> Result<Self> {
        config.validate()?;
        let mut config = config;
        config
            .spin
            .get_or_insert_with(|| flagcx_adaptor::spin::default_spin(nranks));
        let caps = adaptor.capabilities();
        if config.join == StreamJoin::MemOp && !(caps.stream_mem_ops && caps.host_register) {
            return Err(CommError::config(
                "FLAGCX_STREAM_JOIN",
                "memop",
                format!(
                    "{} has no stream memory operations on registered memory",
                    adaptor.vendor()
                ),
            ));
        }
        let boot = Arc::new(Bootstrap::connect(
            rank,
            nranks,
            id,
            config.bootstrap_timeout,
        )?);
        let me = PeerInfo::local(rank, &adaptor, &config)?;
        let infos = boot
            .all_gather(Tag::PeerInfo, &me.encode())?
            .iter()
            .map(|b| PeerInfo::decode(b))
            .collect::<Result<Vec<_>>>()?;
        for (q, info) in infos.iter().enumerate() {
            if info.rank != q {
                return Err(CommError::Protocol(format!(
                    "rank {q} claims to be rank {}",
                    info.rank
                )));
            }
        }
        let mut transports = vec![None; nranks];
        for q in (0..nranks).filter(|&q| q != rank) {
            let (t, why) = choose_transport(&infos[rank], &infos[q]);
            tracing::info!(
                rank,
                peer = q,
                transport = %t,
                "rank {rank} ({} {}) ↔ rank {q} ({} {}): {t} ({why})",
                infos[rank].vendor,
                infos[rank].device,
                infos[q].vendor,
                infos[q].device
            );
            transports[q] = Some(t);
        }
        let direct: Vec<Option<usize>> = (0..nranks)
            .map(|q| (q != rank).then(|| direct_copier(&infos[rank], &infos[q]))?)
            .collect();
        let roles: Vec<Roles> = (0..nranks)
            .map(|q| match (transports[q], direct[q]) {
                (Some(TransportKind::Ipc), _) => Roles {
                    peer_pulls: receiver_copies(&infos[rank], &infos[q]),
                    we_pull: receiver_copies(&infos[q], &infos[rank]),
                    ..Roles::default()
                },
                // The direct copier pushes its sends and pulls the host rank's.
                (Some(TransportKind::Staged), Some(c)) => Roles {
                    peer_pulls: c == q,
                    we_pull: c == rank,
                    maps_peer: c == rank,
                    peer_maps: c == q,
                },
                _ => Roles::default(),
            })
            .collect();
        for (q, c) in direct.iter().enumerate() {
            if let Some(c) = c {
                tracing::info!(
                    rank,
                    peer = q,
                    "rank {rank} ↔ rank {q}: rank {c} copies directly into and out of the host \
                     rank's buffers once they are mapped (the staging ring until then)"
                );
            }
        }
        let copiers: Vec<Option<usize>> = roles
            .iter()
            .enumerate()
            .map(|(q, r)| match transports[q] {
                Some(TransportKind::Ipc) if r.peer_pulls || r.we_pull => {
                    Some(if r.we_pull { rank } else { q })
                }
                _ => None,
            })
            .collect();
        for (q, copier) in copiers.iter().enumerate() {
            if let Some(copier) = copier {
                tracing::info!(
                    rank,
                    peer = q,
                    "rank {rank} ↔ rank {q}: rank {copier} issues the IPC copies both ways"
                );
            }
        }
        let page = WatermarkPage::new(&adaptor)?;
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox {
                ops: Vec::new(),
                next: vec![[0; 2]; nranks],
            }),
            pending: (0..nranks).map(|_| Default::default()).collect(),
            lost: (0..nranks).map(|_| AtomicBool::new(false)).collect(),
            reserved: (0..nranks).map(|_| Default::default()).collect(),
            ipc: Mutex::new(IpcCache::default()),
            trimming: AtomicBool::new(false),
            posted: AtomicU64::new(0),
            spare_events: Mutex::new(Vec::new()),
            shutdown: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            watermark: Mutex::new(0),
            watermark_cv: Condvar::new(),
            watermark_word: WatermarkWord::new(page.host),
            thread: Mutex::new(None),
            first_error: Mutex::new(None),
            busy_polls: AtomicU64::new(0),
            path_bytes: Default::default(),
            caller_ops: AtomicU64::new(0),
            caller_handoffs: Default::default(),
        });
        // Eager slots where both ranks' device memory is host addressable: the sender's CPU
        // copies into them and the receiver's out of them.
        let lanes: Vec<bool> = (0..nranks)
            .map(|q| {
                q != rank && infos[rank].caps.host_addressable && infos[q].caps.host_addressable
            })
            .collect();
        let peers = connect_channels(&adaptor, &boot, &transports, &roles, &lanes, &config)?;
        let eager = peers
            .iter()
            .map(|c| {
                let c = c.as_ref()?;
                let (send_max, recv_max) = (
                    c.out.geometry().eager.min(config.eager_max),
                    c.inc.geometry().eager,
                );
                (send_max > 0 || recv_max > 0).then(|| EagerLink {
                    out: c.out.clone(),
                    inc: c.inc.clone(),
                    send_max,
                    recv_max,
                    freed: AtomicU64::new(0),
                })
            })
            .collect();
        let caller = peers
            .iter()
            .map(|c| {
                let c = c.as_ref()?;
                (config.ipc_caller && c.transport == TransportKind::Ipc).then(|| CallerLink {
                    out: c.out.clone(),
                    inc: c.inc.clone(),
                    push: !c.roles.peer_pulls,
                    pull: c.roles.we_pull,
                })
            })
            .collect();
        let proxy = Proxy::new(
            adaptor.clone(),
            shared.clone(),
            boot.clone(),
            peers,
            &config,
        )?;
        let handle = std::thread::Builder::new()
            .name(format!("flagcx-proxy-{rank}"))
            .spawn(move || proxy.run())
            .map_err(|e| CommError::io("spawn proxy thread", e))?;
        *lock(&shared.thread) = Some(handle.thread().clone());
        Ok(Comm {
            adaptor,
            rank,
            nranks,
            infos,
            transports,
            copiers,
            direct,
            eager,
            caller,
            shared,
            proxy: Some(handle),
            next_seq: AtomicU64::new(1),
            group: Mutex::new(None),
            joined: Mutex::new(HashMap::new()),
            page,
            config,
            _boot: boot,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn nranks(&self) -> usize {
        self.nranks
    }

    /// The adaptor this communicator drives.
    pub fn adaptor(&self) -> &A {
        &self.adaptor
    }

    /// What rank `peer` said about itself at setup.
    pub fn peer_info(&self, peer: usize) -> Option<&PeerInfo> {
        self.infos.get(peer)
    }

    /// The transport used with `peer` (`None` for this rank itself).
    pub fn transport(&self, peer: usize) -> Option<TransportKind> {
        self.transports.get(peer).copied().flatten()
    }

    /// For an IPC pair whose ranks share one copier (`FLAGCX_P2P_IPC_COPIER`), that rank: it
    /// pushes its sends into `peer` and pulls `peer`'s sends. `None` when each sender copies
    /// (or the pair is staged, or `peer` is this rank).
    pub fn ipc_copier(&self, peer: usize) -> Option<usize> {
        self.copiers.get(peer).copied().flatten()
    }

    /// For a staged pair with a host-vendor rank, the rank that copies straight into and out
    /// of the host rank's buffers (`FLAGCX_P2P_HOST_DIRECT`); `None` when the pair always goes
    /// through the staging ring. A buffer takes the direct path once the copier has it mapped
    /// (and registered with its runtime, which runs in the background): [`Comm::stats`] shows
    /// how many bytes did.
    pub fn direct_copier(&self, peer: usize) -> Option<usize> {
        self.direct.get(peer).copied().flatten()
    }

    /// The largest message this rank sends eagerly to `peer` (0: none): the eager path exists
    /// where both ranks' device memory is host addressable, up to the smaller of the two
    /// ranks' `FLAGCX_P2P_EAGER_MAX`. See [`Config::eager_max`] for when it is taken.
    pub fn eager_limit(&self, peer: usize) -> usize {
        self.eager
            .get(peer)
            .and_then(|l| l.as_ref())
            .map_or(0, |l| l.send_max)
    }

    /// Bytes this rank's finished operations moved, by path.
    pub fn stats(&self) -> PathStats {
        self.shared.stats()
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Sends the whole of `buf` to `peer`, ordered on `stream`. The buffer is kept alive until
    /// the operation finishes.
    pub fn send(
        &self,
        buf: &Arc<DeviceBuffer<A>>,
        peer: usize,
        stream: &Stream<A>,
    ) -> Result<Request> {
        self.post(
            Dir::Send,
            buf.ptr(),
            buf.len(),
            peer,
            stream.handle(),
            Some(Box::new(buf.clone())),
        )
    }

    /// Receives into `buf` from `peer`, ordered on `stream`; the sender may send fewer bytes
    /// (the request says how many), never more.
    pub fn recv(
        &self,
        buf: &Arc<DeviceBuffer<A>>,
        peer: usize,
        stream: &Stream<A>,
    ) -> Result<Request> {
        self.post(
            Dir::Recv,
            buf.ptr(),
            buf.len(),
            peer,
            stream.handle(),
            Some(Box::new(buf.clone())),
        )
    }

    /// Sends `bytes` at `ptr` to `peer`, ordered on `stream`.
    ///
    /// # Safety
    /// `ptr..ptr+bytes` is device memory of this adaptor that stays valid and unmodified until
    /// the operation finishes (its request completes, or `stream` passes it).
    pub unsafe fn send_raw(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        peer: usize,
        stream: StreamHandle,
    ) -> Result<Request> {
        self.post(Dir::Send, ptr, bytes, peer, stream, None)
    }

    /// Receives up to `bytes` into `ptr` from `peer`, ordered on `stream`.
    ///
    /// # Safety
    /// `ptr..ptr+bytes` is device memory of this adaptor, valid until the operation finishes,
    /// that nothing else touches meanwhile.
    pub unsafe fn recv_raw(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        peer: usize,
        stream: StreamHandle,
    ) -> Result<Request> {
        self.post(Dir::Recv, ptr, bytes, peer, stream, None)
    }

    /// Runs `f`, posting its operations together: they progress at once and each stream waits
    /// once for all of them. Use it for exchanges in both directions.
    pub fn group<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.group_begin()?;
        let r = f();
        let submitted = self.group_end();
        let t = r?;
        submitted?;
        Ok(t)
    }

    /// Opens a group explicitly (for callers that cannot pass a closure, like the C ABI's
    /// `flagcxGroupStart`): operations posted until [`Comm::group_end`] progress together.
    /// Groups do not nest.
    pub fn group_begin(&self) -> Result<()> {
        let mut g = lock(&self.group);
        if g.is_some() {
            return Err(CommError::InvalidArgument("groups do not nest".into()));
        }
        *g = Some(Vec::new());
        Ok(())
    }

    /// Closes the group [`Comm::group_begin`] opened and hands its operations over.
    pub fn group_end(&self) -> Result<()> {
        let ops = lock(&self.group)
            .take()
            .ok_or_else(|| CommError::InvalidArgument("no group is open".into()))?;
        self.submit(ops)
    }

    /// The first asynchronous failure of this communicator, without waiting: a lost peer, an
    /// operation that timed out (`FLAGCX_TIMEOUT_MS`), a remote or vendor failure — the
    /// failures [`CommError::is_async_failure`] names, as the operation that hit it reported
    /// it. `None` while every operation so far succeeded or failed only for the caller's own
    /// reasons (a size mismatch, a bad argument, [`Comm::abort`]). Like NCCL's
    /// `ncclCommGetAsyncError`: a watchdog thread polls it and calls [`Comm::abort`]. A peer
    /// that dies while nothing is posted to it is noticed by the next operation on it.
    pub fn async_error(&self) -> Option<CommError> {
        lock(&self.shared.first_error).clone()
    }

    /// `Err` with [`Comm::async_error`]'s failure, if there is one.
    pub fn check(&self) -> Result<()> {
        match self.async_error() {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// Aborts the communicator from any thread: every pending operation fails with
    /// [`CommError::Aborted`], every waiting stream is released, and later posts are refused.
    /// Waiters return within milliseconds (the progress thread notices at once, fails what is
    /// left and advances the watermark); the communicator is unusable afterwards.
    pub fn abort(&self) {
        self.shared.aborted.store(true, Ordering::Release);
        self.shared.wake();
    }

    /// Whether [`Comm::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.shared.aborted.load(Ordering::Acquire)
    }

    /// How many times the proxy polled without progress (a measure of spinning).
    pub fn proxy_busy_polls(&self) -> u64 {
        self.shared.busy_polls.load(Ordering::Relaxed)
    }

    fn post(
        &self,
        dir: Dir,
        ptr: DevicePtr,
        bytes: usize,
        peer: usize,
        stream: StreamHandle,
        keep: Option<Box<dyn std::any::Any + Send>>,
    ) -> Result<Request> {
        if self.is_aborted() {
            return Err(CommError::Aborted);
        }
        if peer >= self.nranks {
            return Err(CommError::InvalidArgument(format!(
                "peer {peer} is out of range (the job has {} ranks)",
                self.nranks
            )));
        }
        if peer == self.rank {
            return Err(CommError::InvalidArgument(format!(
                "rank {peer} cannot send to or receive from itself"
            )));
        }
        if bytes > 0 {
            if ptr.is_null() {
                return Err(CommError::InvalidArgument("null buffer".into()));
            }
            // The buffer must be device memory of this adaptor, wholly inside one allocation.
            let (base, len) = self.adaptor.mem_get_range(ptr).map_err(|e| {
                CommError::InvalidArgument(format!("{ptr} is not memory of this device: {e}"))
            })?;
            if ptr.0 - base.0 + bytes as u64 > len as u64 {
                return Err(CommError::InvalidArgument(format!(
                    "{bytes} bytes at {ptr} run past the end of its {len}-byte allocation"
                )));
            }
        }
        // Where the caller's stream has nothing pending, there is nothing to order after: skip
        // the event (on a GPU its record is work in this process's context, which another
        // process on the same GPU would have to wait out).
        // The posting thread's own paths are open to this post where its pair has them and it
        // is not in a group: eager slots, or (IPC) moving the operation itself.
        let ungrouped = lock(&self.group).is_none();
        let eager = ungrouped && self.eager.get(peer).is_some_and(|l| l.is_some());
        let caller = ungrouped && self.caller.get(peer).is_some_and(|l| l.is_some());
        let idle = self.idle_or_soon(stream, eager || caller)?;
        if idle && eager {
            if let Some(r) = self.try_eager(dir, ptr, bytes, peer)? {
                return Ok(r);
            }
        }
        let start = if idle {
            None
        } else {
            Some(self.start_event(stream)?)
        };
        let mut keep = keep;
        if caller {
            if let Some(r) = self.try_caller_ipc(dir, ptr, bytes, peer, stream, start, &mut keep)? {
                return Ok(r);
            }
        }
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::default());
        let op = Op {
            seq,
            dir,
            peer,
            index: 0, // numbered in `submit`
            ptr,
            bytes,
            start,
            slot: slot.clone(),
            keep,
            posted: std::time::Instant::now(),
            resume: None,
        };
        let mut g = lock(&self.group);
        match g.as_mut() {
            Some(ops) => ops.push((op, stream)),
            None => {
                drop(g);
                self.submit(vec![(op, stream)])?;
            }
        }
        Ok(Request {
            state: State::Pending(slot),
            seq,
            spin: self.config.spin.unwrap_or_default(),
        })
    }

    /// Hands operations to the proxy, then makes each stream wait for its last one.
    fn submit(&self, ops: Vec<(Op, StreamHandle)>) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let mut last: BTreeMap<u64, u64> = BTreeMap::new();
        for (op, s) in &ops {
            let e = last.entry(s.0).or_default();
            *e = (*e).max(op.seq);
        }
        {
            // Behind a message a posting thread is moving itself, the pair's next ones wait
            // until it is done or handed over (well under a millisecond: its spin time).
            let mut inbox = self.inbox_for_handover(|| {
                ops.iter().any(|(op, _)| {
                    self.shared.reserved[op.peer][op.dir as usize].load(Ordering::Acquire)
                })
            });
            for (mut op, _) in ops {
                let d = op.dir as usize;
                op.index = inbox.next[op.peer][d];
                inbox.next[op.peer][d] += 1;
                self.shared.pending[op.peer][d].fetch_add(1, Ordering::AcqRel);
                inbox.ops.push(op);
            }
        }
        self.shared.posted.fetch_add(1, Ordering::Release);
        self.shared.wake();
        for (stream, seq) in last {
            self.join_stream(StreamHandle(stream), seq)?;
        }
        Ok(())
    }

    /// The eager path (the caller checked the pair has one, the post is outside a group and
    /// the stream is idle): a small message, while no earlier operation of its pair and
    /// direction is with the proxy, is moved by this thread. A send copies into the peer's channel; a receive takes
    /// a message already there (waiting up to the spin time for one the size of the eager
    /// slots). `None`: not taken, post normally.
    fn try_eager(
        &self,
        dir: Dir,
        ptr: DevicePtr,
        bytes: usize,
        peer: usize,
    ) -> Result<Option<Request>> {
        let Some(link) = self.eager.get(peer).and_then(|l| l.as_ref()) else {
            return Ok(None);
        };
        let d = dir as usize;
        let max = match dir {
            Dir::Send => link.send_max,
            Dir::Recv => link.recv_max,
        };
        if max == 0 || (dir == Dir::Send && bytes > max) {
            return Ok(None);
        }
        // Whether the pair and direction is free for this thread: nothing of it with the proxy,
        // not retired. Checked (again) under the inbox lock, which numbers messages.
        let free = |inbox: &Inbox, index: u64| {
            inbox.next[peer][d] == index
                && self.shared.pending[peer][d].load(Ordering::Acquire) == 0
                && !self.shared.lost[peer].load(Ordering::Acquire)
        };
        let r = match dir {
            Dir::Send => {
                let mut inbox = lock(&self.shared.inbox);
                let k = inbox.next[peer][d];
                let window_open = k < link.freed.load(Ordering::Relaxed) + DESC_RING || {
                    let done = link.out.load(Counter::RecvDone);
                    link.freed.store(done, Ordering::Relaxed);
                    k < done + DESC_RING
                };
                if !free(&inbox, k) || !window_open || link.out.load(Counter::RecvFault) != 0 {
                    return Ok(None);
                }
                // SAFETY: `ptr..ptr+bytes` was checked to lie in one allocation of this
                // adaptor, whose memory is host addressable (the pair has eager slots only
                // then), and the caller's stream is idle, so earlier work on it has finished
                // writing it; `bytes <= send_max <= ` the slot size; message `k` is ours under
                // the lock, with every earlier send finished (answered) and its slot free.
                unsafe { link.out.post_eager(k, ptr.0 as *const u8, bytes) };
                inbox.next[peer][d] = k + 1;
                Ok(bytes)
            }
            Dir::Recv => {
                let k = lock(&self.shared.inbox).next[peer][d];
                // Wait without the lock for a message that may well come eagerly: only where
                // any message this receive can take fits the eager slots.
                let spin = if bytes <= max {
                    self.config.spin.unwrap_or_default()
                } else {
                    Duration::ZERO
                };
                // Poll the descriptor's status word: an eager message publishes it last (one
                // cache line to fetch); a message of the proxy's protocol shows in `SendPosted`
                // and is left to the proxy.
                let mut polls = 0u32;
                let found = poll_for(
                    spin,
                    || spin,
                    || {
                        if let Some(sd) = link.inc.eager_arrived(k) {
                            return Some(Some(sd));
                        }
                        // The counter costs more than a poll: every 64 polls.
                        polls = polls.wrapping_add(1);
                        // Message `k` is published. An eager one stored its status word before
                        // the counter, so this look settles which kind it is.
                        (polls % 64 == 0 && link.inc.load(Counter::SendPosted) > k)
                            .then(|| link.inc.eager_arrived(k))
                    },
                );
                let Some(Some(sd)) = found else {
                    return Ok(None);
                };
                let mut inbox = lock(&self.shared.inbox);
                if !free(&inbox, k) || link.inc.load(Counter::SendFault) > k {
                    return Ok(None);
                }
                let r = receive_eager(&link.inc, k, &sd, ptr, bytes, peer);
                inbox.next[peer][d] = k + 1;
                if matches!(r, Err(CommError::Protocol(_))) {
                    self.shared.mark_lost(peer);
                }
                r
            }
        };
        match &r {
            Ok(n) => {
                self.shared.path_bytes[Path::Eager as usize]
                    .fetch_add(*n as u64, Ordering::Relaxed);
            }
            Err(e) => self.shared.record_error(e),
        }
        Ok(Some(Request {
            state: State::Done(r),
            seq: 0,
            spin: Duration::ZERO,
        }))
    }

    /// The inbox, once operations may be handed over: not while the proxy closes IPC mappings
    /// (which can wait for the device context: no stream may start waiting for a new operation
    /// until that is done, well under a millisecond), nor while `blocked` holds.
    fn inbox_for_handover(&self, blocked: impl Fn() -> bool) -> std::sync::MutexGuard<'_, Inbox> {
        let mut inbox = lock(&self.shared.inbox);
        while self.shared.trimming.load(Ordering::Acquire) || blocked() {
            drop(inbox);
            std::thread::yield_now();
            inbox = lock(&self.shared.inbox);
        }
        inbox
    }

    /// An event of the API side's pool (`Shared::spare_events`), or a new one.
    fn spare_event(&self) -> Result<EventHandle> {
        let spare = lock(&self.shared.spare_events).pop();
        match spare {
            Some(e) => Ok(e),
            None => Ok(self.adaptor.event_create(false)?),
        }
    }

    /// An event recorded on `stream` now: where an operation may start.
    fn start_event(&self, stream: StreamHandle) -> Result<EventHandle> {
        let start = self.spare_event()?;
        if let Err(e) = self.adaptor.event_record(start, stream) {
            let _ = self.adaptor.event_destroy(start);
            return Err(e.into());
        }
        Ok(start)
    }

    /// The posting thread's IPC path (the caller checked the pair has one and the post is
    /// outside a group): while nothing earlier of the pair and direction is with the proxy,
    /// this thread takes the message. Where this rank copies, it waits (up to the spin time)
    /// for the peer's descriptor and issues the copy on the caller's stream itself, so the
    /// stream orders it with no event and no wait on the proxy; where the peer copies, it
    /// publishes its own descriptor (idle streams only: the peer's copy engine may touch the
    /// buffer at once) and waits for the peer's answer. Whatever is not finished within the
    /// spin time goes to the proxy from where it stands. `None`: not taken (`start` and `keep`
    /// stay the caller's), post normally.
    #[allow(clippy::too_many_arguments)]
    fn try_caller_ipc(
        &self,
        dir: Dir,
        ptr: DevicePtr,
        bytes: usize,
        peer: usize,
        stream: StreamHandle,
        start: Option<EventHandle>,
        keep: &mut Option<Box<dyn std::any::Any + Send>>,
    ) -> Result<Option<Request>> {
        let Some(link) = self.caller.get(peer).and_then(|l| l.as_ref()) else {
            return Ok(None);
        };
        let copies = match dir {
            Dir::Send => link.push,
            Dir::Recv => link.pull,
        };
        if !copies && start.is_some() {
            return Ok(None);
        }
        let d = dir as usize;
        let k = {
            let mut inbox = lock(&self.shared.inbox);
            let k = inbox.next[peer][d];
            if self.shared.pending[peer][d].load(Ordering::Acquire) != 0
                || self.shared.lost[peer].load(Ordering::Acquire)
                || self.shared.trimming.load(Ordering::Acquire)
            {
                return Ok(None);
            }
            inbox.next[peer][d] = k + 1;
            self.shared.pending[peer][d].fetch_add(1, Ordering::AcqRel);
            self.shared.reserved[peer][d].store(true, Ordering::Release);
            k
        };
        let spin = self.config.spin.unwrap_or_default();
        let idle = start.is_none();
        let m = Msg {
            dir,
            k,
            ptr,
            bytes,
            peer,
        };
        let outcome = match copies {
            true => self.caller_copies(link, m, stream, idle, spin),
            false => self.caller_publish(link, m, spin),
        }
        .unwrap_or_else(|e| Caller::HandOff(Some(Resume::Failed(e))));
        let (resume, start) = match outcome {
            Caller::Done(r) => {
                self.shared.pending[peer][d].fetch_sub(1, Ordering::AcqRel);
                self.shared.reserved[peer][d].store(false, Ordering::Release);
                if let Some(start) = start {
                    recycle_event(&self.adaptor, &self.shared, start);
                }
                match &r {
                    Ok(n) => {
                        self.shared.path_bytes[Path::Ipc as usize]
                            .fetch_add(*n as u64, Ordering::Relaxed);
                        self.shared.caller_ops.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => self.shared.record_error(e),
                }
                drop(keep.take());
                return Ok(Some(Request {
                    state: State::Done(r),
                    seq: 0,
                    spin: Duration::ZERO,
                }));
            }
            // A copy on the caller's stream needs no start: the stream orders it.
            Caller::HandOff(Some(r @ (Resume::Pushed(_) | Resume::Pulled { .. }))) => {
                if let Some(start) = start {
                    recycle_event(&self.adaptor, &self.shared, start);
                }
                (Some(r), None)
            }
            Caller::HandOff(r) => (r, start),
        };
        self.shared.caller_handoffs[Resume::handoff(&resume) as usize]
            .fetch_add(1, Ordering::Relaxed);
        // The stream waits for the operation, unless it carries the copy itself (or the
        // operation failed before anything of it was under way).
        let join = !matches!(
            resume,
            Some(Resume::Pushed(_) | Resume::Pulled { .. } | Resume::Failed(_))
        );
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::default());
        let op = Op {
            seq,
            dir,
            peer,
            index: k,
            ptr,
            bytes,
            start,
            slot: slot.clone(),
            keep: keep.take(),
            posted: std::time::Instant::now(),
            resume,
        };
        {
            let mut inbox = self.inbox_for_handover(|| false);
            inbox.ops.push(op);
            self.shared.reserved[peer][d].store(false, Ordering::Release);
        }
        self.shared.posted.fetch_add(1, Ordering::Release);
        self.shared.wake();
        if join {
            self.join_stream(stream, seq)?;
        }
        Ok(Some(Request {
            state: State::Pending(slot),
            seq,
            spin,
        }))
    }

    /// This rank copies: once the peer described its side of message `k` (the receiver its
    /// buffer, or the sender its offer), the one copy goes on the caller's stream — into the
    /// peer's buffer for a send, out of it for a receive.
    fn caller_copies(
        &self,
        link: &CallerLink,
        m: Msg,
        stream: StreamHandle,
        idle: bool,
        spin: Duration,
    ) -> Result<Caller> {
        let Msg {
            dir,
            k,
            ptr,
            bytes,
            peer,
        } = m;
        let (ch, theirs, their_fault) = link.lane(dir);
        let seen = poll_for(
            spin,
            || spin,
            || (ch.load(theirs) > k || ch.load(their_fault) > k).then_some(()),
        );
        // The proxy reports a failure on the peer's side (and takes an eager message).
        if seen.is_none() || ch.load(their_fault) > k {
            return Ok(Caller::HandOff(None));
        }
        // The peer's buffer (its allocation's handle and the offset in it), and the bytes.
        let (handle, offset, n) = match dir {
            Dir::Send => {
                let desc = ch.read_recv_desc(k)?;
                if let Some(r) = push_without_copy(ch, k, bytes, &desc, peer) {
                    return Ok(Caller::Done(r));
                }
                (desc.handle, desc.offset, bytes)
            }
            Dir::Recv => {
                let offer = ch.read_send_desc(k)?;
                if offer.status == SendStatus::Eager {
                    return Ok(Caller::HandOff(None));
                }
                if let Some(r) = pull_without_copy(ch, k, bytes, &offer, peer) {
                    return Ok(Caller::Done(r));
                }
                (offer.handle, offer.offset, offer.size as usize)
            }
        };
        let push = dir == Dir::Send;
        let ev = self
            .caller_copy(stream, handle, offset, ptr, n, push)
            .inspect_err(|_| {
                if push {
                    answer(ch, k, bytes, SendStatus::SenderFailed);
                }
            })?;
        if idle {
            ch.store(Counter::Issued, k + 1);
        }
        if !self.copy_finished(ev, running_copy_budget(spin, idle)) {
            return Ok(Caller::HandOff(Some(match dir {
                Dir::Send => Resume::Pushed(ev),
                Dir::Recv => Resume::Pulled { ev, size: n },
            })));
        }
        match dir {
            Dir::Send => answer(ch, k, bytes, SendStatus::Ok),
            Dir::Recv => give_verdict(ch, k, bytes),
        }
        Ok(Caller::Done(Ok(n)))
    }

    /// The peer copies: publish this side's descriptor (the receive buffer, or the offered
    /// send buffer), then wait for the peer's answer (or verdict).
    fn caller_publish(&self, link: &CallerLink, m: Msg, spin: Duration) -> Result<Caller> {
        let Msg {
            dir,
            k,
            ptr,
            bytes,
            peer,
        } = m;
        let (ch, theirs, their_fault) = link.lane(dir);
        if !ch.window_open(k) {
            return Ok(Caller::HandOff(None));
        }
        let (handle, offset) = match bytes {
            0 => (None, 0),
            _ => export(&self.adaptor, ptr, TransportKind::Ipc)?
                .map_or((None, 0), |(h, offset)| (Some(h), offset)),
        };
        match dir {
            Dir::Send => {
                let sd = SendDesc {
                    size: bytes as u64,
                    status: SendStatus::Ok,
                    handle,
                    offset,
                };
                ch.write_send_desc(k, &sd);
                ch.store(Counter::SendPosted, k + 1);
            }
            Dir::Recv => {
                let rd = RecvDesc {
                    size: bytes as u64,
                    handle,
                    offset,
                    chunks: false,
                };
                ch.write_recv_desc(k, &rd);
                ch.store(Counter::RecvPosted, k + 1);
            }
        }
        // Past the spin time, only while the peer's copy of this message runs.
        let budget = || running_copy_budget(spin, ch.load(Counter::Issued) > k);
        let seen = poll_for(spin, budget, || {
            (ch.load(theirs) > k || ch.load(their_fault) > k).then_some(())
        });
        if seen.is_none() || ch.load(their_fault) > k {
            return Ok(Caller::HandOff(Some(Resume::Published)));
        }
        Ok(match dir {
            Dir::Send => Caller::Done(verdict_result(bytes, &ch.read_recv_desc(k)?, peer)),
            Dir::Recv => {
                let sd = ch.read_send_desc(k)?;
                if sd.status == SendStatus::Eager {
                    // The proxy takes it out of its slot.
                    return Ok(Caller::HandOff(Some(Resume::Published)));
                }
                let failed = send_failure(peer, &sd, bytes, false);
                ch.store(Counter::RecvDone, k + 1);
                Caller::Done(failed.map_or(Ok(sd.size as usize), Err))
            }
        })
    }

    /// Issues an IPC operation's copy on the caller's stream: `n` bytes between `ptr` and the
    /// peer's buffer at `offset` of the allocation behind `handle` (`push`: into the peer's).
    /// Returns the event that completes with it; until that is seen, the copy counts in
    /// [`IpcCache::caller_copies`], so its mapping stays open.
    fn caller_copy(
        &self,
        stream: StreamHandle,
        handle: Option<flagcx_adaptor::IpcMemHandle>,
        offset: u64,
        ptr: DevicePtr,
        n: usize,
        push: bool,
    ) -> Result<EventHandle> {
        let ev = self.spare_event()?;
        let issued = {
            let mut cache = lock(&self.shared.ipc);
            let issued = cache.open(&self.adaptor, handle).and_then(|base| {
                let theirs = DevicePtr(base.0 + offset);
                let (dst, src) = if push { (theirs, ptr) } else { (ptr, theirs) };
                // SAFETY: the peer's buffer lies at `offset` of its allocation, which it
                // described for this message (a receive of at least `n` bytes, or an offer of
                // `n`) and keeps until this side answers; `ptr..ptr+n` was checked to lie in
                // one allocation of this adaptor (for a pull, `n` is at most the receive's
                // size), valid until the operation finishes; the stream orders the copy after
                // the caller's earlier work on the buffer.
                unsafe { self.adaptor.memcpy_d2d_async(dst, src, n, stream) }?;
                Ok(())
            });
            if issued.is_ok() {
                cache.caller_copies += 1;
            }
            issued
        };
        if let Err(e) = issued {
            recycle_event(&self.adaptor, &self.shared, ev);
            return Err(e);
        }
        if let Err(e) = self.adaptor.event_record(ev, stream) {
            // Queued but untracked: let it finish before the proxy copies the same bytes again.
            let _ = self.adaptor.stream_synchronize(stream);
            lock(&self.shared.ipc).caller_copies -= 1;
            recycle_event(&self.adaptor, &self.shared, ev);
            return Err(e.into());
        }
        Ok(ev)
    }

    /// Whether the caller's copy (event `ev`) completes within `budget`; if so, its mapping
    /// is free to close again and the event back in the pool.
    fn copy_finished(&self, ev: EventHandle, budget: Duration) -> bool {
        // An error is the proxy's to report: it queries the event again.
        let done = poll_for(
            budget,
            || budget,
            || match self.adaptor.event_query(ev) {
                Ok(false) => None,
                Ok(true) => Some(true),
                Err(_) => Some(false),
            },
        );
        if done != Some(true) {
            return false;
        }
        lock(&self.shared.ipc).caller_copies -= 1;
        recycle_event(&self.adaptor, &self.shared, ev);
        true
    }

    /// Makes `stream` wait until operation `seq` (and all before it) finished.
    fn join_stream(&self, stream: StreamHandle, seq: u64) -> Result<()> {
        let join = self.config.join;
        if join == StreamJoin::None {
            return Ok(());
        }
        let caps = self.adaptor.capabilities();
        match self.page.device {
            Some(word) if caps.stream_mem_ops && join != StreamJoin::HostFn => {
                // SAFETY: the word lives in the registered watermark page, which outlives every
                // stream wait (Drop releases the waits and waits for each joined stream's
                // last-join event before unmapping).
                unsafe {
                    self.adaptor.stream_wait_value32(
                        stream,
                        word,
                        seq as u32,
                        WaitCondition::Geq,
                    )?
                };
            }
            _ => {
                let shared = self.shared.clone();
                self.adaptor
                    .launch_host_func(stream, Box::new(move || shared.wait_watermark(seq)))?;
            }
        }
        let mut joined = lock(&self.joined);
        let ev = match joined.get(&stream.0) {
            Some(&(e, _)) => e,
            None => self.adaptor.event_create(false)?,
        };
        joined.insert(stream.0, (ev, seq));
        self.adaptor.event_record(ev, stream)?;
        Ok(())
    }

    /// Whether `stream` is idle, waiting up to the spin time when all it may still hold is
    /// this communicator's join of an operation that already finished: a caller that waited
    /// for a request posts its next operation before the stream has passed that (satisfied)
    /// wait, and only an idle stream lets the next message go eagerly. Without this, one
    /// message through the proxy keeps every later one there.
    /// Only waits where the eager path could follow (`eager`).
    fn idle_or_soon(&self, stream: StreamHandle, eager: bool) -> Result<bool> {
        if self.adaptor.stream_query(stream)? {
            return Ok(true);
        }
        let spin = self.config.spin.unwrap_or_default();
        let passed = |seq: u64| *lock(&self.shared.watermark) >= seq;
        let last = lock(&self.joined).get(&stream.0).map(|&(_, seq)| seq);
        match last {
            Some(seq) if eager && !spin.is_zero() && passed(seq) => {}
            _ => return Ok(false),
        }
        let t0 = std::time::Instant::now();
        while t0.elapsed() < spin {
            std::hint::spin_loop();
            if self.adaptor.stream_query(stream)? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// How much longer than the spin time a posting thread waits for a copy that is already
/// running (its own, or the peer's copy of its message, see [`Counter::Issued`]) before
/// handing the operation to the proxy. A hand-over costs the pair a stream wait on the device
/// and a round through both proxies (~20 µs per hop on one H200); waiting for a running copy
/// is bounded by its size (1 GiB: 0.5 ms on an H200).
const RUNNING_COPY_WAIT: Duration = Duration::from_millis(2);

/// Polls `ready` until it gives a value, for up to `budget()` (at least once; `spin` zero:
/// exactly once), reading the clock and the budget every 64 polls (they cost more than a poll
/// of shared memory).
fn poll_for<T>(
    spin: Duration,
    budget: impl Fn() -> Duration,
    mut ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    let t0 = std::time::Instant::now();
    let mut polls = 0u32;
    loop {
        if let Some(v) = ready() {
            return Some(v);
        }
        polls = polls.wrapping_add(1);
        if spin.is_zero() || polls % 64 == 0 && t0.elapsed() >= budget() {
            return None;
        }
        std::hint::spin_loop();
    }
}

/// The wait budget beside a copy that `running` says is under way: the spin time, plus
/// [`RUNNING_COPY_WAIT`] while it runs (spinning at all only where the spin time allows it).
fn running_copy_budget(spin: Duration, running: bool) -> Duration {
    if running && !spin.is_zero() {
        spin + RUNNING_COPY_WAIT
    } else {
        spin
    }
}

impl<A: DeviceAdaptor> Drop for Comm<A> {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.wake();
        if let Some(h) = self.proxy.take() {
            let _ = h.join();
        }
        // Release every stream still waiting on the watermark, then let them pass it before
        // the page goes away.
        let max = self.next_seq.load(Ordering::Relaxed);
        // SAFETY: the page is still mapped and the word aligned.
        unsafe {
            self.adaptor
                .host_write_value32(self.page.host as *mut u32, max as u32)
        };
        {
            *lock(&self.shared.watermark) = max;
            self.shared.watermark_cv.notify_all();
        }
        for (_, (ev, _)) in lock(&self.joined).drain() {
            let _ = self.adaptor.event_synchronize(ev);
            let _ = self.adaptor.event_destroy(ev);
        }
        self.page.release(&self.adaptor);
    }
}

impl WatermarkPage {
    fn new<A: DeviceAdaptor>(adaptor: &A) -> Result<Self> {
        // SAFETY: a fresh private anonymous page; checked.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if host == libc::MAP_FAILED {
            return Err(CommError::io(
                "mmap watermark page",
                std::io::Error::last_os_error(),
            ));
        }
        let host = host as *mut u8;
        let device =
            if adaptor.capabilities().host_register && adaptor.capabilities().stream_mem_ops {
                // SAFETY: the page stays mapped until `release`, which unregisters it first.
                match unsafe { adaptor.host_register(host, 4096) } {
                    Ok(d) => Some(d),
                    Err(e) => {
                        // SAFETY: our page, not yet shared with anyone.
                        unsafe { libc::munmap(host.cast(), 4096) };
                        return Err(e.into());
                    }
                }
            } else {
                None
            };
        Ok(WatermarkPage { host, device })
    }

    fn release<A: DeviceAdaptor>(&mut self, adaptor: &A) {
        if self.device.take().is_some() {
            // SAFETY: every joined stream passed its last wait; nothing reads the page any more.
            let _ = unsafe { adaptor.host_unregister(self.host) };
        }
        // SAFETY: our mapping of one page.
        unsafe { libc::munmap(self.host.cast(), 4096) };
    }
}

/// Creates this rank's incoming channels, swaps descriptors with every peer, and maps the
/// outgoing ones. Staged rings are registered with the adaptor for DMA.
fn connect_channels<A: DeviceAdaptor>(
    adaptor: &A,
    boot: &Bootstrap,
    transports: &[Option<TransportKind>],
    roles: &[Roles],
    lanes: &[bool],
    config: &Config,
) -> Result<Vec<Option<PeerConn>>> {
    // The channel a rank creates for peer `q`'s sends; its eager slots are sized by the
    // creating (receiving) rank's setting.
    let geometry = |q: usize| {
        let eager = if lanes[q] { config.eager_max } else { 0 };
        match transports[q] {
            Some(TransportKind::Staged) => Geometry {
                slots: config.slots(),
                chunk: config.chunksize,
                eager,
            },
            _ => Geometry {
                slots: 0,
                chunk: 0,
                eager,
            },
        }
    };
    let mut incoming = Vec::new();
    for (q, t) in transports.iter().enumerate() {
        let Some(t) = *t else {
            incoming.push(None);
            continue;
        };
        let geo = geometry(q);
        let ch = Channel::create(geo)?;
        let desc = Writer::new()
            .u8(matches!(t, TransportKind::Staged) as u8)
            .u64(geo.slots as u64)
            .u64(geo.chunk as u64)
            .u64(geo.eager as u64)
            .u64(geo.len() as u64)
            .finish();
        boot.send(q, Tag::Connect, &desc, &[ch.segment().fd()])?;
        incoming.push(Some(ch));
    }
    let mut peers: Vec<Option<PeerConn>> = Vec::new();
    for (q, inc) in incoming.into_iter().enumerate() {
        let Some(inc) = inc else {
            peers.push(None);
            continue;
        };
        match connect_one(adaptor, boot, q, transports, inc, &geometry, lanes[q]) {
            Ok(conn) => peers.push(Some(conn.with_roles(roles[q]))),
            Err(e) => {
                // Undo the rings already registered for earlier peers before the channels go.
                for conn in peers.iter().flatten().filter(|c| c.registered) {
                    for ch in [&conn.out, &conn.inc] {
                        // SAFETY: no copy was ever issued on these rings.
                        let _ = unsafe { adaptor.host_unregister(ch.ring().0) };
                    }
                }
                return Err(e);
            }
        }
    }
    Ok(peers)
}

/// Receives peer `q`'s channel for this rank's sends, checks it agrees with ours, maps it and
/// registers both rings of a staged pair.
fn connect_one<A: DeviceAdaptor>(
    adaptor: &A,
    boot: &Bootstrap,
    q: usize,
    transports: &[Option<TransportKind>],
    inc: Channel,
    geometry: &dyn Fn(usize) -> Geometry,
    lane: bool,
) -> Result<PeerConn> {
    let t = transports[q].expect("a transport for every peer");
    let (payload, mut fds) = boot.recv(q, Tag::Connect)?;
    let mut r = Reader::new(&payload, "connect");
    let staged = r.u8()? == 1;
    let geo = Geometry {
        slots: r.u64()? as usize,
        chunk: r.u64()? as usize,
        eager: r.u64()? as usize,
    };
    let len = r.u64()? as usize;
    r.end()?;
    let want = geometry(q);
    // The receiver sizes the eager slots by its own FLAGCX_P2P_EAGER_MAX; any size within the
    // bounds works for the sender (it sends eagerly up to the smaller of the two settings).
    let eager_ok = geo.eager == 0 || (lane && geo.eager <= MAX_EAGER_MAX);
    if staged != matches!(t, TransportKind::Staged)
        || (geo.slots, geo.chunk) != (want.slots, want.chunk)
        || !eager_ok
        || len != geo.len()
        || fds.len() != 1
    {
        return Err(CommError::Protocol(format!(
            "rank {q} set up a different channel (staged {staged}, {geo:?}, {} fds); \
             do all ranks use the same FLAGCX_P2P_* settings?",
            fds.len()
        )));
    }
    let out = Arc::new(Channel::open(ShmSegment::open(fds.remove(0), len)?, geo)?);
    let inc = Arc::new(inc);
    let registered = staged && adaptor.capabilities().host_register;
    if registered {
        let (p, n) = out.ring();
        // SAFETY: the ring lies in a mapping the channel owns; the proxy (or the error path of
        // `connect_channels`) unregisters it before the channel is unmapped.
        unsafe { adaptor.host_register(p, n) }?;
        let (p2, n2) = inc.ring();
        // SAFETY: as above.
        if let Err(e) = unsafe { adaptor.host_register(p2, n2) } {
            // SAFETY: registered just above and unused.
            let _ = unsafe { adaptor.host_unregister(p) };
            return Err(e.into());
        }
    }
    Ok(PeerConn::new(q, t, out, inc, registered))
}

#[cfg(test)]
mod tests {
    use super::{poll_for, running_copy_budget, RUNNING_COPY_WAIT};
    use std::cell::Cell;
    use std::time::{Duration, Instant};

    #[test]
    fn without_spinning_a_poll_looks_exactly_once() {
        let looks = Cell::new(0);
        let got: Option<()> = poll_for(
            Duration::ZERO,
            || Duration::from_secs(1),
            || {
                looks.set(looks.get() + 1);
                None
            },
        );
        assert_eq!((got, looks.get()), (None, 1));
    }

    #[test]
    fn a_poll_returns_what_arrives_and_gives_up_after_its_budget() {
        let looks = Cell::new(0);
        let spin = Duration::from_millis(5);
        // A budget no loaded machine exhausts before the 1000th look: the value arrives and
        // is returned, whatever the timing.
        let got = poll_for(
            spin,
            || Duration::from_secs(3600),
            || {
                looks.set(looks.get() + 1);
                (looks.get() == 1000).then_some(7)
            },
        );
        assert_eq!(got, Some(7));
        assert_eq!(looks.get(), 1000, "it stopped looking once the value came");
        let t0 = Instant::now();
        let budget = Duration::from_millis(20);
        assert_eq!(poll_for(spin, || budget, || None::<()>), None);
        assert!(t0.elapsed() >= budget, "gave up early: {:?}", t0.elapsed());
    }

    #[test]
    fn only_a_running_copy_extends_the_wait_and_only_where_spinning_is_allowed() {
        let spin = Duration::from_micros(50);
        assert_eq!(running_copy_budget(spin, false), spin);
        assert_eq!(running_copy_budget(spin, true), spin + RUNNING_COPY_WAIT);
        assert_eq!(running_copy_budget(Duration::ZERO, true), Duration::ZERO);
    }
}
