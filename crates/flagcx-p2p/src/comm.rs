//! The communicator: point-to-point operations between the ranks of a job.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use flagcx_adaptor::tracking::{lock, HandleMap};
use flagcx_adaptor::{DeviceAdaptor, DeviceBuffer, DevicePtr, EventHandle, Stream, StreamHandle};

use crate::bootstrap::Bootstrap;
use crate::config::{Config, RankEnv};
use crate::error::{CommError, Result};
use crate::guard::Guard;
use crate::link::eager::EagerLink;
use crate::link::ipc::{CallerLink, Msg};
use crate::link::net::SharedNet;
use crate::link::streamed::StreamLink;
use crate::op::{Dir, Inbox, Op, Slot};
use crate::peer::{PeerInfo, TransportKind};
pub use crate::request::Request;
pub(crate) use crate::request::State;
use crate::shared::{Path, Shared};
use crate::watermark::WatermarkPage;
use crate::PathStats;

/// The smallest operation whose waiter runs the engine's passes itself where waiters drive
/// (`Config::waiter_progress`). Below it the copies are short, and on a machine with as many
/// ranks as cores a waiter that drives takes the core the proxy and the stream worker copy on:
/// two host ranks on 2 cores, blocking, waiters driving against not, same run (2026-12-07):
/// all-reduce 64 KiB 55 against 38 µs, 512 KiB 194–205 against 113–127, 1 MiB 270–374 against
/// 302–348, 4 MiB 1414–1501 against 1512–1589, 8 MiB 2590–2669 against 2972–3031; sendrecv
/// 512 KiB 53–56 against 34–39, 1 MiB 209–211 against 148–155, 2 MiB 456–479 against 536–545,
/// 4 MiB 802–842 against 996–1036. A ring all-reduce's messages are half its size on 2 ranks.
pub(crate) const HELP_MIN_BYTES: usize = 2 << 20;

/// Point-to-point communication among the ranks of one job, on one device.
///
/// Operations are ordered on the caller's stream: they start after the work enqueued before
/// them and later work on that stream sees their result. Between a pair of ranks, operations in
/// one direction match in posting order. Post a bidirectional exchange inside a group
/// ([`Comm::group`]); otherwise each send waits on its stream for its receiver, as in NCCL.
///
/// One order per communicator: a stream joined to an operation (`FLAGCX_STREAM_JOIN`, every
/// join but `none`) waits for it and for every operation posted on this communicator before
/// it, on any stream, as NCCL orders a communicator's operations. Ranks must post in orders
/// that complete that way. Threads that post on one communicator at once give each rank an
/// interleaving of its own and can leave two ranks each waiting for the other (until
/// `FLAGCX_TIMEOUT_MS`, an abort or a peer's loss): give each thread its own communicator, as
/// NCCL requires, or join no streams and wait on the requests. Posting itself is thread safe;
/// posts that overlap another thread's are counted ([`PathStats::overlapping_posts`]) and, with
/// joins, the first is logged as a warning.
///
/// Outside a group, where nothing earlier of the pair and direction is in flight, the posting
/// thread moves a message itself where it can: eagerly between host-addressable ranks
/// ([`Config::eager_max`]), and on IPC pairs ([`Config::ipc_caller`]). Such a post may then take
/// up to the spin time (plus up to 2 ms while the message's copy runs) and return a request
/// that is already complete. A group's small messages go eagerly at [`Comm::group_end`], which
/// may likewise wait up to the spin time for the group's eager receives. An eager receive
/// waits longer for a pair whose recent eager messages took longer to come (three times their
/// average, up to 1 ms), and 2 ms more while the sender's runtime copies the message out of
/// its device: a receive that gives up goes to the proxy, and on a stream the caller keeps
/// enqueuing to, every later message of the pair follows it there. On a stream-ordered
/// pair ([`Comm::stream_limit`]) small messages only enqueue stream operations, grouped or not.
///
/// On CUDA, do not call `cudaFree`, `cudaFreeHost` or `cudaHostUnregister` from any thread
/// while a stream of the device waits for an operation of this communicator that has not
/// finished: those calls hold the driver's process-wide lock while they wait for every stream,
/// and the engine needs the driver to finish the operation (`docs/reliability.md`, "CUDA's
/// process-wide lock"). Free after [`Request::wait`] or the stream's synchronize, or with
/// `cudaFreeAsync`.
pub struct Comm<A: DeviceAdaptor> {
    pub(crate) adaptor: A,
    pub(crate) rank: usize,
    pub(crate) nranks: usize,
    pub(crate) infos: Vec<PeerInfo>,
    pub(crate) transports: Vec<Option<TransportKind>>,
    /// Per peer: the rank that issues the IPC copies of the pair (`None`: each sender).
    pub(crate) copiers: Vec<Option<usize>>,
    /// Per staged peer: the rank that copies straight into and out of the host-vendor rank's
    /// buffers (`None`: no direct path).
    pub(crate) direct: Vec<Option<usize>>,
    /// Per peer: the eager slots, where both ranks' device memory is host addressable.
    pub(crate) eager: Vec<Option<EagerLink>>,
    /// Small all-reduces' slots (`crate::slots`), where every rank can take them.
    pub(crate) reduce_slots: Option<Arc<crate::slots::Slots>>,
    /// Per IPC peer (unless `FLAGCX_P2P_IPC_CALLER=off`): its channels, for the posting thread.
    pub(crate) caller: Vec<Option<CallerLink>>,
    /// Per peer whose small messages go stream-ordered (`transport::streamed`).
    pub(crate) streamed: Vec<Option<StreamLink>>,
    /// Per IPC peer whose messages are copied late (`transport::late`): both channels'
    /// registered heads.
    pub(crate) late: Vec<Option<StreamLink>>,
    /// Held while late-copy operations are numbered, claimed and enqueued, so their claims go
    /// in number order (their posts may wait for a descriptor slot: not under the inbox lock).
    pub(crate) late_order: Mutex<()>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) proxy: Option<JoinHandle<()>>,
    /// What a waiter runs instead of sleeping where this rank's copies are CPU copies.
    pub(crate) help: Option<crate::op::Helper>,
    pub(crate) next_seq: Arc<AtomicU64>,
    /// The stall guard, where `FLAGCX_TIMEOUT_MS` is set (`crate::guard`).
    pub(crate) guard: Option<Guard>,
    /// Open groups, one per thread that opened one ([`Comm::group_begin`]), keyed by the
    /// thread's `posting::thread_number`: a thread's posts join its own group only, as NCCL's
    /// groups are per thread.
    pub(crate) group: Mutex<std::collections::HashMap<u64, Vec<(Op, StreamHandle)>>>,
    /// `group_eager`'s bookkeeping, kept between groups.
    pub(crate) group_scratch: Mutex<crate::link::eager::GroupScratch>,
    /// Streams this communicator made wait on its watermark (synchronized before teardown).
    /// Per joined stream, an event of ours recorded right after its last join: teardown waits
    /// on it, so the watermark page outlives every wait on it even if the caller already
    /// destroyed the stream (a destroyed stream still runs what was queued).
    /// Beside it, the operation that last join waits for, and its gate.
    pub(crate) joined: Mutex<HandleMap<crate::watermark::Joined>>,
    /// Who is posting now, to notice threads that post at once (`crate::posting`).
    pub(crate) posting: crate::posting::Posting,
    pub(crate) page: WatermarkPage,
    /// See [`Comm::streams_share_queue`].
    pub(crate) streams_share_queue: bool,
    /// See [`Comm::ring_in_device_memory`].
    pub(crate) device_rings: Vec<bool>,
    /// See [`Comm::posts_wait`].
    pub(crate) posts_wait: bool,
    pub(crate) config: Config,
    pub(crate) _boot: Arc<Bootstrap>,
    /// The network side, where a peer is on another host (shared with the engine).
    pub(crate) net: Option<SharedNet>,
    /// The port proxy, started by the first port channel (`port::PortProxy<A>`; every
    /// channel holds it too). Held as `Any` so that `Comm` names nothing of the port channels,
    /// which are built on it; `port` is the only module that fills or reads it.
    pub(crate) ports: std::sync::OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
    /// The posting threads' pinned bounce buffer for eager messages (see `transport::eager`).
    pub(crate) bounce: Mutex<crate::link::eager::Bounce>,
    /// Device scratch memory of the reductions (`crate::scratch`), made at the first one.
    pub(crate) scratch: Mutex<crate::scratch::Scratch>,
    /// Per peer and direction (`Dir as usize`): this rank names its buffer to the peer, which
    /// copies (IPC pairs), so memory without an IPC handle needs a stand-in.
    pub(crate) names_buffer: Vec<[bool; 2]>,
    /// Exportable buffers standing in for memory without an IPC handle
    /// (`crate::standin`), freed with the communicator.
    pub(crate) stand_ins: Arc<Mutex<crate::standin::StandIns>>,
    /// Per thread with a group open: collectives posted in it that run at its end, after its
    /// point-to-point operations ([`Comm::group_end`]).
    pub(crate) deferred: Mutex<std::collections::HashMap<u64, Vec<Deferred<A>>>>,
}

/// A collective kept for the end of the group it was posted in: it enqueues itself then.
pub(crate) type Deferred<A> = Box<dyn FnOnce(&Comm<A>) -> Result<()> + Send>;

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
    /// where both ranks' device memory is host addressable and on every staged pair, up to the
    /// smaller of the two
    /// ranks' `FLAGCX_P2P_EAGER_MAX`. See [`Config::eager_max`] for when it is taken.
    pub fn eager_limit(&self, peer: usize) -> usize {
        self.eager
            .get(peer)
            .and_then(|l| l.as_ref())
            .map_or(0, |l| l.send_max)
    }

    /// The largest message this rank sends to `peer` stream-ordered (0: none): the pair's
    /// streams then carry it with no host thread on its path (`FLAGCX_P2P_STREAM`; see
    /// `docs/architecture.md`). It is the eager slot of the channel `peer` created, sized by
    /// `peer`'s `FLAGCX_P2P_EAGER_MAX` (at most 32 KiB); receives from `peer` use this rank's.
    pub fn stream_limit(&self, peer: usize) -> usize {
        self.streamed
            .get(peer)
            .and_then(|l| l.as_ref())
            .map_or(0, |l| l.send_max)
    }

    /// Bytes this rank's finished operations moved, by path.
    pub fn stats(&self) -> PathStats {
        PathStats {
            overlapping_posts: self.posting.overlaps.load(Ordering::Relaxed),
            stand_in_bytes: crate::standin::held(&self.stand_ins) as u64,
            ..self.shared.stats()
        }
    }

    /// Whether setup found this process's streams sharing one work queue, where a stream's
    /// wait holds up later work of every other stream (CUDA with `CUDA_DEVICE_MAX_CONNECTIONS=1`,
    /// the host vendor with `FLAGCX_HOST_QUEUES=1`), checked where callers' streams may wait for
    /// copies of this rank's proxy (IPC or staged pairs, any join but `FLAGCX_STREAM_JOIN=none`;
    /// with the kind of wait those joins make). There an
    /// operation the proxy copies while its caller's stream waits for it would stall
    /// (git show 7ff18bc:docs/performance.md, "one hardware queue stalls the proxy"): IPC pairs copy late
    /// ([`Comm::copies_late`]), which nothing stalls, and the other pairs' posts wait for
    /// their operations ([`Comm::posts_wait`]).
    pub fn streams_share_queue(&self) -> bool {
        self.streams_share_queue
    }

    /// Whether the staged pair with `peer` keeps a ring in device memory that both ranks map
    /// (`FLAGCX_P2P_DEVICE_RING`; by default a CUDA and an OpenCL rank on NVIDIA's platform,
    /// the ring on the OpenCL rank's GPU), so its messages from 4 MiB move device→device
    /// instead of through host memory. `false` for every other pair, and for a pair whose
    /// ring could not be placed or mapped at setup (the log says why).
    pub fn ring_in_device_memory(&self, peer: usize) -> bool {
        self.device_rings.get(peer).copied().unwrap_or(false)
    }

    /// Whether a call that posts operations the proxy copies for returns only once they
    /// finished, as a blocking MPI call does, instead of making the caller's stream wait for
    /// them: where this process's streams share one work queue
    /// ([`Comm::streams_share_queue`]) and some pair does not copy late (staged and direct
    /// pairs, network pairs of a rank whose device memory the proxy stages through host
    /// memory, IPC pairs with `FLAGCX_P2P_LATE_COPY=off`), since that stream's wait would hold
    /// the proxy's copy up behind it in the queue. Such a wait ends as [`crate::Request::wait`]
    /// does: the operation's result (taken later by its request), the peer's loss,
    /// `FLAGCX_TIMEOUT_MS` or an abort. Operations that copy late, stream-ordered ones and
    /// those a posting thread moves itself are enqueued and return as everywhere else. Sends
    /// and receives that depend on each other across ranks belong in one group then (as with
    /// NCCL, whose kernels would block the one queue the same way).
    pub fn posts_wait(&self) -> bool {
        self.posts_wait
    }

    /// Whether messages with `peer` are copied late: by the stream of whichever rank posts
    /// second, with no proxy copy and no join (`FLAGCX_P2P_LATE_COPY`; by default for IPC
    /// pairs of two CUDA ranks, and where a rank of the pair found its streams sharing one
    /// work queue).
    pub fn copies_late(&self, peer: usize) -> bool {
        self.late_link(peer).is_some()
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
            Some(buf.clone()),
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
            Some(buf.clone()),
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
    ///
    /// The streams themselves are released here, by writing the watermark word from the host
    /// (on CUDA a plain store, no driver call), so that they pass their waits even while the
    /// progress thread is blocked inside a vendor call (on CUDA: another thread's `cudaFree`
    /// holds the driver's lock while it waits for a stream joined on this communicator; see
    /// `docs/reliability.md`). The data of the operations they waited for is then not there.
    /// Their requests fail with `Aborted` at once too (waiters look at the abort between
    /// sleeps), whether or not the progress thread is back from that call.
    pub fn abort(&self) {
        self.shared.aborted.store(true, Ordering::Release);
        self.shared.verdict.give(CommError::Aborted);
        // Every sequence number handed out so far; a post racing with this call takes a later
        // one, which the engine's final pass (or, at the latest, `Drop`) releases.
        let issued = self.next_seq.load(Ordering::Acquire).saturating_sub(1);
        self.shared.release_through(&self.adaptor, issued);
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

    pub(crate) fn post(
        &self,
        dir: Dir,
        ptr: DevicePtr,
        bytes: usize,
        peer: usize,
        stream: StreamHandle,
        keep: Option<crate::kept::Keep>,
    ) -> Result<Request> {
        if self.is_aborted() {
            return Err(CommError::Aborted);
        }
        let _post = self
            .posting
            .begin(self.config.join != crate::config::StreamJoin::None);
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
        self.check_buffer(ptr, bytes)?;
        // Where the caller's stream has nothing pending, there is nothing to order after: skip
        // the event (on a GPU its record is work in this process's context, which another
        // process on the same GPU would have to wait out).
        // The posting thread's own paths are open to this post where its pair has them and it
        // is not in a group: eager slots, or (IPC) moving the operation itself.
        // A stream-ordered message is enqueued on the stream at submission: no start event,
        // no posting-thread path.
        let ordered =
            self.streamed_link(peer, dir, bytes).is_some() || self.late_link(peer).is_some();
        let me = crate::posting::thread_number();
        let ungrouped = !lock(&self.group).contains_key(&me);
        let link = self.eager.get(peer).and_then(|l| l.as_ref());
        let eager = ungrouped && link.is_some();
        let caller = ungrouped && self.caller.get(peer).is_some_and(|l| l.is_some());
        let net = ungrouped
            && self.net.is_some()
            && self.transports.get(peer) == Some(&Some(TransportKind::Net));
        // A grouped post may go eagerly at `group_end` too (`group_eager`), which needs the
        // stream idle at posting: it waits out a satisfied join as an ungrouped one does.
        let grouped_eager = !ungrouped && link.is_some();
        let fits = (eager || grouped_eager) && link.is_some_and(|l| l.fits(dir, bytes));
        let small = fits && bytes <= crate::watermark::REJOIN_MAX;
        let cpu = fits && link.is_some_and(|l| l.addressable);
        let idle = ordered
            || self.idle_or_soon(stream, eager || grouped_eager || caller || net, small, cpu)?;
        if !idle && fits {
            self.shared.declined(crate::op::Declined::StreamBusy);
        }
        if idle && eager {
            if let Some(r) = self.try_eager(dir, ptr, bytes, peer, stream)? {
                return Ok(r);
            }
        }
        let (start, after) = self.start_of(stream, idle)?;
        let mut keep = keep;
        if net && idle {
            if let Some(r) = self.try_caller_net(dir, ptr, bytes, peer, &mut keep)? {
                return Ok(r);
            }
        }
        let stand_in = match ordered {
            true => None,
            false => self.stand_in_for(peer, dir, ptr, bytes)?,
        };
        if caller && !ordered && after == 0 && stand_in.is_none() {
            if let Some(r) = self.try_caller_ipc(dir, ptr, bytes, peer, stream, start, &mut keep)? {
                return Ok(r);
            }
        }
        let slot = Arc::new(self.slot(peer, bytes));
        let mut op = Op {
            seq: 0, // numbered when submitted: a group's eager moves take none
            dir,
            peer,
            index: 0, // numbered in `submit`
            ptr,
            bytes,
            start,
            after,
            slot: slot.clone(),
            keep,
            posted: self.config.profile.then(std::time::Instant::now),
            resume: None,
            stand_in,
        };
        let mut g = lock(&self.group);
        let seq = match g.get_mut(&me) {
            Some(ops) => {
                ops.push((op, stream));
                0
            }
            None => {
                drop(g);
                op.seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
                let seq = op.seq;
                self.submit(vec![(op, stream)])?;
                seq
            }
        };
        Ok(Request {
            state: State::Pending(slot),
            seq,
            spin: self.config.spin.unwrap_or_default(),
        })
    }

    /// Checks that `bytes` at `ptr` are device memory of this adaptor, wholly inside one
    /// allocation; returns that allocation's address range (`None` for zero bytes, which
    /// touch no memory).
    pub(crate) fn check_buffer(&self, ptr: DevicePtr, bytes: usize) -> Result<Option<Range<u64>>> {
        if bytes == 0 {
            return Ok(None);
        }
        if ptr.is_null() {
            return Err(CommError::InvalidArgument("null buffer".into()));
        }
        let (base, len) = self.adaptor.mem_get_range(ptr).map_err(|e| {
            CommError::InvalidArgument(format!("{ptr} is not memory of this device: {e}"))
        })?;
        if ptr.0 - base.0 + bytes as u64 > len as u64 {
            return Err(CommError::InvalidArgument(format!(
                "{bytes} bytes at {ptr} run past the end of its {len}-byte allocation"
            )));
        }
        Ok(Some(base.0..base.0 + len as u64))
    }

    /// The number of the next message of `peer` and `dir`, reserved for a posting thread to
    /// move itself — only while nothing of that pair and direction is with the engine, the
    /// pair is not lost, and the engine is not trimming mappings (IPC): `None` otherwise.
    pub(crate) fn caller_reserve(&self, peer: usize, dir: Dir) -> Option<u64> {
        let d = dir as usize;
        let mut inbox = lock(&self.shared.inbox);
        let k = inbox.next[peer][d];
        if self.shared.pending[peer][d].load(Ordering::Acquire) != 0
            || self.shared.lost[peer].load(Ordering::Acquire)
            || self.shared.trimming.load(Ordering::Acquire)
        {
            return None;
        }
        inbox.next[peer][d] = k + 1;
        self.shared.pending[peer][d].fetch_add(1, Ordering::AcqRel);
        self.shared.reserved[peer][d].store(true, Ordering::Release);
        Some(k)
    }

    /// A message a posting thread finished itself (`try_caller_ipc`, `try_caller_net`): its
    /// pair and direction are free again, its bytes counted on `path`, its buffer released.
    pub(crate) fn caller_finished(
        &self,
        m: &Msg,
        path: Path,
        r: Result<usize>,
        keep: &mut Option<crate::kept::Keep>,
    ) -> Request {
        let d = m.dir as usize;
        self.shared.pending[m.peer][d].fetch_sub(1, Ordering::AcqRel);
        self.shared.reserved[m.peer][d].store(false, Ordering::Release);
        match &r {
            Ok(n) => {
                self.shared.path_bytes[path as usize].fetch_add(*n as u64, Ordering::Relaxed);
                self.shared.caller_ops.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => self.shared.record_error(e),
        }
        drop(keep.take());
        Request {
            state: State::Done(r),
            seq: 0,
            spin: Duration::ZERO,
        }
    }

    /// Hands message `m`, which a posting thread reserved and began, to the engine at
    /// `resume` (after `start`, if any); returns its sequence number and result slot.
    pub(crate) fn caller_hand_over(
        &self,
        m: &Msg,
        start: Option<EventHandle>,
        resume: Option<crate::op::Resume>,
        slot: Slot,
        keep: &mut Option<crate::kept::Keep>,
    ) -> (u64, Arc<Slot>) {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(slot);
        let op = Op {
            seq,
            dir: m.dir,
            peer: m.peer,
            index: m.k,
            ptr: m.ptr,
            bytes: m.bytes,
            start,
            after: 0,
            slot: slot.clone(),
            keep: keep.take(),
            posted: self.config.profile.then(std::time::Instant::now),
            resume,
            stand_in: None,
        };
        {
            let mut inbox = self.inbox_for_handover(|| false);
            inbox.ops.push(op);
            self.shared.reserved[m.peer][m.dir as usize].store(false, Ordering::Release);
        }
        self.shared.posted.fetch_add(1, Ordering::Release);
        self.shared.wake();
        (seq, slot)
    }

    /// The inbox, once operations may be handed over: not while the proxy closes IPC mappings
    /// (which can wait for the device context: no stream may start waiting for a new operation
    /// until that is done, well under a millisecond), nor while `blocked` holds.
    pub(crate) fn inbox_for_handover(
        &self,
        blocked: impl Fn() -> bool,
    ) -> std::sync::MutexGuard<'_, Inbox> {
        let mut inbox = lock(&self.shared.inbox);
        while self.shared.trimming.load(Ordering::Acquire) || blocked() {
            drop(inbox);
            std::thread::yield_now();
            inbox = lock(&self.shared.inbox);
        }
        inbox
    }
}

impl<A: DeviceAdaptor> Drop for Comm<A> {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.wake();
        let stalled = self.guard.as_ref().is_some_and(|g| g.fired());
        if let Some(g) = self.guard.take() {
            g.stop();
        }
        if let Some(h) = self.proxy.take() {
            if !stalled {
                let _ = h.join();
            } else if !crate::guard::joined_within(h, self.config.timeout) {
                // The stall guard gave up on the progress thread, and it is still inside its
                // vendor call: it is left behind with what it may touch when it comes back
                // (the watermark page, the bounce buffer, the stream-ordered links, the
                // joined streams' events), so that dropping the communicator does not hang.
                let wher = crate::guard::BlockedIn::describe(
                    self.shared.blocked_in.load(Ordering::Relaxed),
                )
                .or_else(|| {
                    self.shared
                        .in_call
                        .current()
                        .map(|(call, long)| format!("inside {call} ({} ms)", long.as_millis()))
                })
                .unwrap_or_else(|| "off the CPU or inside an unmarked runtime call".into());
                tracing::warn!(
                    "rank {}: the progress thread is still {wher}; leaving it and the \
                     communicator's pages behind",
                    self.rank
                );
                // A post that raced with the guard took a number after its release.
                self.shared
                    .release_through(&self.adaptor, self.next_seq.load(Ordering::Relaxed));
                return;
            }
        }
        // Release every stream still waiting on the watermark, then let them pass it before
        // the page goes away.
        self.shared
            .release_through(&self.adaptor, self.next_seq.load(Ordering::Relaxed));
        for (_, j) in lock(&self.joined).drain() {
            let _ = self.adaptor.event_synchronize(j.ev);
            let _ = self.adaptor.event_destroy(j.ev);
        }
        self.page.release(&self.adaptor);
        lock(&self.bounce).release(&self.adaptor);
        let wait = self.config.timeout.unwrap_or(Duration::from_secs(30));
        lock(&self.scratch).release(&self.adaptor, wait);
        crate::standin::release(&self.stand_ins, &self.adaptor);
        for l in self.streamed.iter().flatten() {
            l.release(&self.adaptor);
        }
        // A stream may still reach a late pair's words (`Engine::release_late`): kept then.
        if !self.shared.late_kept.load(Ordering::Acquire) {
            for l in self.late.iter().flatten() {
                l.release(&self.adaptor);
            }
        }
    }
}

impl<A: DeviceAdaptor> Comm<A> {
    /// A fresh result slot for an operation with `peer`: its waiters drive UCX where the pair
    /// is on two hosts, else the engine where this rank's copies are CPU copies
    /// (`crate::drive`), and take the communicator's verdict.
    /// The result slot of an operation of `bytes` with `peer`: its waiter works for it where
    /// the pair is on another host (the network's progress), or where this rank's waiters
    /// drive the engine (`Config::waiter_progress`) and the operation is at least
    /// [`HELP_MIN_BYTES`].
    pub(crate) fn slot(&self, peer: usize, bytes: usize) -> crate::op::Slot {
        let help = self
            .net_helper(peer)
            .or_else(|| self.help.clone().filter(|_| bytes >= HELP_MIN_BYTES));
        crate::op::Slot::new(help, self.shared.verdict.clone())
    }
}

mod eager;
mod eager_group;
mod ipc;
mod late;
mod net;
mod streamed;
