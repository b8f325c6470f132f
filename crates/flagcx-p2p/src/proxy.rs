//! The proxy: one progress thread per communicator that moves the bytes.
//!
//! The API thread only records a start event on the caller's stream and hands the operation
//! over. The proxy issues the copies on its own streams (one for sends, one for receives, so a
//! bidirectional exchange overlaps), records an event per step and polls it, and publishes
//! progress through the channels' monotonic counters. Per peer and direction operations run in
//! posting order; different peers and directions progress independently. When an operation
//! finishes, the communicator's completion watermark advances; callers' streams wait on it
//! (stream memory operations, or a host function where the vendor lacks them).
//!
//! The thread spins while work is in flight (spin → yield → 20 µs naps once a wait grows long)
//! and parks when idle, so an idle communicator burns no core.

// tidy: long file: the progress engine together with every transport's progress side (IPC, staged, direct, eager); they move into per-transport modules with the engine split.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, EventHandle, IpcMemHandle, StreamHandle};

pub(crate) use flagcx_adaptor::tracking::lock;

use crate::bootstrap::Bootstrap;
use crate::channel::{Channel, Counter, RecvDesc, SendDesc, SendStatus, RETIRED};
use crate::error::{CommError, Result};
use crate::hostmap::HostMaps;
use crate::peer::TransportKind;
use crate::PathStats;

/// Peer allocations the proxy keeps open for IPC copies; past it, the least recently used are
/// closed, a few per pass while nothing is in flight (see the idle branch of `Proxy::run`).
const IPC_CACHE_MAX: usize = 256;

/// Send or receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    Send,
    Recv,
}

/// Where one operation's result lands; shared by the proxy and the [`crate::Request`].
#[derive(Debug, Default)]
pub(crate) struct Slot {
    result: Mutex<Option<Result<usize>>>,
    cv: Condvar,
    /// Set once `result` is filled, for waiters that spin before sleeping.
    done: AtomicBool,
}

impl Slot {
    pub fn complete(&self, r: Result<usize>) {
        *lock(&self.result) = Some(r);
        self.done.store(true, Ordering::Release);
        self.cv.notify_all();
    }

    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Waits for the result, up to `timeout` if given, spinning for up to `spin` first.
    pub fn wait(&self, timeout: Option<Duration>, spin: Duration) -> Option<Result<usize>> {
        let t0 = Instant::now();
        let spin = timeout.map_or(spin, |t| spin.min(t));
        while !spin.is_zero() && !self.is_done() && t0.elapsed() < spin {
            std::hint::spin_loop();
        }
        let deadline = timeout.map(|t| t0 + t);
        let mut g = lock(&self.result);
        loop {
            if let Some(r) = g.take() {
                return Some(r);
            }
            match deadline {
                None => g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let left = d.checked_duration_since(Instant::now())?;
                    g = self
                        .cv
                        .wait_timeout(g, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
    }
}

/// An operation handed to the proxy.
pub(crate) struct Op {
    pub seq: u64,
    pub dir: Dir,
    pub peer: usize,
    /// The message's number on its pair and direction, given at submission (see [`Inbox`]).
    pub index: u64,
    pub ptr: DevicePtr,
    pub bytes: usize,
    /// Recorded on the caller's stream at posting: the operation may start once it completes.
    /// `None` when the stream was already idle at posting (nothing to wait for).
    pub start: Option<EventHandle>,
    pub slot: Arc<Slot>,
    /// Keeps a safe API caller's buffer alive until the operation finishes.
    pub keep: Option<Box<dyn std::any::Any + Send>>,
    /// When the API thread posted it (for `FLAGCX_PROFILE`).
    pub posted: Instant,
    /// Where the proxy takes over an operation the posting thread began itself (IPC pairs,
    /// see `Comm::try_caller_ipc`); `None`: from the start.
    pub resume: Option<Resume>,
}

/// How far the posting thread got with an IPC operation before handing it to the proxy.
#[derive(Debug)]
pub(crate) enum Resume {
    /// It issued the copy into the receiver's buffer on the caller's stream; the event (from
    /// `Shared::spare_events`) completes with it. The proxy answers the receiver then.
    Pushed(EventHandle),
    /// It issued the copy out of the sender's buffer (`size` bytes offered) on the caller's
    /// stream; the proxy gives the verdict once the event completes.
    Pulled { ev: EventHandle, size: usize },
    /// It published the receive announcement, or the send offer; the proxy waits for the
    /// peer's answer, or its verdict.
    Published,
    /// Its side failed (a vendor error): the proxy tells the peer and retires the pair, as
    /// for a failure of its own.
    Failed(CommError),
}

/// Operations on their way to the proxy, and the message numbering they get on the way.
///
/// Both the proxy and the API side's eager path (which completes small messages without the
/// proxy) consume message numbers; numbering under this one lock keeps every pair's and
/// direction's messages in posting order on both paths.
#[derive(Default)]
pub(crate) struct Inbox {
    pub ops: Vec<Op>,
    /// Per peer and [`Dir`]: the next message number.
    pub next: Vec<[u64; 2]>,
}

/// State shared between the API side and the proxy thread.
pub(crate) struct Shared {
    pub inbox: Mutex<Inbox>,
    /// Per peer and [`Dir`]: operations handed to the proxy and not finished yet. The eager
    /// path only runs while its pair and direction has none (they still own channel counters).
    pub pending: Vec<[AtomicU64; 2]>,
    /// Per peer: the pair was retired (a failure, a timeout, the peer hung up); the eager path
    /// leaves it to the proxy, which fails what comes.
    pub lost: Vec<AtomicBool>,
    /// Set (under the inbox lock, with nothing in flight) while the proxy closes IPC mappings,
    /// which may wait for the device context: meanwhile no caller may hand over an operation
    /// and make a stream wait for it.
    pub trimming: AtomicBool,
    /// Per peer and [`Dir`]: a posting thread is moving the pair's next message itself
    /// (`Comm::try_caller_ipc`). Later operations of that pair and direction wait until it is
    /// done or handed over, so the proxy sees every pair's messages in order.
    pub reserved: Vec<[AtomicBool; 2]>,
    /// Open peer allocations, shared by the proxy and posting threads that issue IPC copies.
    pub ipc: Mutex<IpcCache>,
    /// Bumped after every hand-over into `inbox`, so the proxy can poll it without the lock.
    pub posted: AtomicU64,
    /// Completed start events, recycled by the API side (creating one per operation costs a
    /// runtime call and an allocation on the latency path).
    pub spare_events: Mutex<Vec<EventHandle>>,
    pub shutdown: AtomicBool,
    /// Set by `Comm::abort`: everything pending fails with `Aborted`, nothing new is accepted.
    pub aborted: AtomicBool,
    /// Highest `n` such that every operation with `seq <= n` has finished.
    pub watermark: Mutex<u64>,
    pub watermark_cv: Condvar,
    /// The device-visible word callers' streams wait on (low 32 bits of the watermark).
    pub watermark_word: WatermarkWord,
    pub thread: Mutex<Option<std::thread::Thread>>,
    /// The first asynchronous failure ([`CommError::is_async_failure`]) any operation hit:
    /// sticky, for `Comm::async_error` and `Comm::check`.
    pub first_error: Mutex<Option<CommError>>,
    pub busy_polls: AtomicU64,
    /// Bytes moved by finished operations, per [`Path`] (for [`crate::Comm::stats`]).
    pub path_bytes: [AtomicU64; 4],
    /// IPC operations the posting thread finished itself (for [`crate::Comm::stats`]).
    pub caller_ops: AtomicU64,
    /// IPC operations the posting thread handed to the proxy, indexed by [`Handoff`], for
    /// `FLAGCX_PROFILE` and [`crate::PathStats::caller_failures`].
    pub caller_handoffs: [AtomicU64; 5],
}

/// The word of the communicator's watermark page that callers' streams wait on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WatermarkWord(*const AtomicU32);

// SAFETY: the word lies in a page the communicator maps before the proxy thread starts and
// unmaps only in `Comm::drop`, after that thread has been joined, so it outlives every
// thread that holds the pointer; it is only ever read or written atomically (or by the
// adaptor's stream operations, which are atomic on the device side).
unsafe impl Send for WatermarkWord {}
// SAFETY: as above: shared access is atomic.
unsafe impl Sync for WatermarkWord {}

impl WatermarkWord {
    /// The word at `page` (the page's first four bytes, aligned).
    pub fn new(page: *mut u8) -> Self {
        WatermarkWord(page as *const AtomicU32)
    }

    /// The word as a plain pointer, for the adaptor's value writes.
    pub fn as_mut_ptr(self) -> *mut u32 {
        self.0 as *mut u32
    }
}

/// Where a posting thread handed an IPC operation to the proxy: the index of its counter in
/// [`Shared::caller_handoffs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handoff {
    /// Before the peer's descriptor came: the proxy starts from the beginning.
    Fresh = 0,
    /// With its copy into the peer's buffer running.
    Pushed = 1,
    /// With its copy out of the peer's buffer running.
    Pulled = 2,
    /// With its descriptor published, before the peer answered.
    Published = 3,
    /// After its own copy failed.
    Failed = 4,
}

impl Resume {
    /// The counter of a hand-over that resumes at `r`.
    pub fn handoff(r: &Option<Resume>) -> Handoff {
        match r {
            None => Handoff::Fresh,
            Some(Resume::Pushed(_)) => Handoff::Pushed,
            Some(Resume::Pulled { .. }) => Handoff::Pulled,
            Some(Resume::Published) => Handoff::Published,
            Some(Resume::Failed(_)) => Handoff::Failed,
        }
    }
}

impl Shared {
    pub fn wake(&self) {
        if let Some(t) = lock(&self.thread).as_ref() {
            t.unpark();
        }
    }

    /// Blocks until the watermark reaches `seq` (host-function fallback and teardown).
    pub fn wait_watermark(&self, seq: u64) {
        let mut w = lock(&self.watermark);
        while *w < seq && !self.shutdown.load(Ordering::Acquire) {
            w = self
                .watermark_cv
                .wait_timeout(w, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Keeps the first asynchronous failure of any operation (for
    /// [`crate::Comm::async_error`]); the caller's own errors (a size mismatch, an abort) are
    /// not kept.
    pub fn record_error(&self, e: &CommError) {
        if !e.is_async_failure() {
            return;
        }
        let mut first = lock(&self.first_error);
        if first.is_none() {
            *first = Some(e.clone());
        }
    }

    /// Records that the pair with `peer` was retired (see [`Shared::lost`]).
    pub fn mark_lost(&self, peer: usize) {
        if let Some(l) = self.lost.get(peer) {
            l.store(true, Ordering::Release);
        }
    }

    /// What [`crate::Comm::stats`] reports.
    pub fn stats(&self) -> PathStats {
        let b = |p: Path| self.path_bytes[p as usize].load(Ordering::Relaxed);
        PathStats {
            ipc_bytes: b(Path::Ipc),
            staged_bytes: b(Path::Staged),
            direct_bytes: b(Path::Direct),
            eager_bytes: b(Path::Eager),
            caller_ops: self.caller_ops.load(Ordering::Relaxed),
            caller_failures: self.caller_handoffs[Handoff::Failed as usize].load(Ordering::Relaxed),
            ipc_mappings_closed: lock(&self.ipc).closes,
        }
    }

    /// Publishes the watermark: the device-visible word (through the adaptor, so vendors that
    /// emulate stream waits on the host wake their waiters), then the host-side copy.
    fn publish_watermark<A: DeviceAdaptor>(&self, adaptor: &A, w: u64) {
        // SAFETY: see the type's Send/Sync argument: a live, aligned word.
        unsafe { adaptor.host_write_value32(self.watermark_word.as_mut_ptr(), w as u32) };
        *lock(&self.watermark) = w;
        self.watermark_cv.notify_all();
    }
}

/// Open peer allocations (IPC mappings) and when each was last used.
#[derive(Default)]
pub(crate) struct IpcCache {
    map: HashMap<[u8; IpcMemHandle::WIRE_LEN], (DevicePtr, u64)>,
    uses: u64,
    /// Copies that posting threads issued on their own streams through a mapping of this cache
    /// and whose completion nobody has seen yet: while there are any, no mapping is closed
    /// (the proxy's streams being idle says nothing about the callers' streams).
    pub caller_copies: usize,
    /// Handles opened (cache misses), for `FLAGCX_PROFILE`.
    pub opens: u64,
    /// Mappings closed while running (trimming past the bound), for [`crate::Comm::stats`].
    pub closes: u64,
}

impl IpcCache {
    /// Maps the peer's allocation behind `handle`, or reuses an earlier mapping of it.
    pub fn open<A: DeviceAdaptor>(
        &mut self,
        adaptor: &A,
        handle: Option<IpcMemHandle>,
    ) -> Result<DevicePtr> {
        let handle =
            handle.ok_or_else(|| CommError::Protocol("IPC descriptor without a handle".into()))?;
        let key = handle.to_wire();
        self.uses += 1;
        if let Some(e) = self.map.get_mut(&key) {
            e.1 = self.uses;
            return Ok(e.0);
        }
        let b = adaptor.ipc_open_handle(&handle)?;
        self.opens += 1;
        self.map.insert(key, (b, self.uses));
        Ok(b)
    }
}

/// Which path an operation's bytes took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// One copy between the two ranks' device memory.
    Ipc = 0,
    /// Through the staging ring.
    Staged = 1,
    /// A staged pair's direct copy into or out of the host-vendor rank's buffer.
    Direct = 2,
    /// Through the channel's eager slots (small messages between host-addressable ranks).
    Eager = 3,
}

/// Who copies on a pair (see [`crate::peer::receiver_copies`] and
/// [`crate::peer::direct_copier`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Roles {
    /// The peer pulls what this rank sends (it is the pair's copier).
    pub peer_pulls: bool,
    /// This rank pulls what the peer sends (this rank is the pair's copier).
    pub we_pull: bool,
    /// Staged pair, direct path: this rank maps the peer's buffers and copies.
    pub maps_peer: bool,
    /// Staged pair, direct path: the peer maps this rank's buffers, so receives announce them.
    pub peer_maps: bool,
}

/// Both directions of the link to one peer.
pub(crate) struct PeerConn {
    pub peer: usize,
    pub transport: TransportKind,
    /// This rank → peer (created by the peer); shared with the API side's eager path.
    pub out: Arc<Channel>,
    /// Peer → this rank (created here); shared with the API side's eager path.
    pub inc: Arc<Channel>,
    /// Whether both rings were registered with the adaptor (unregistered at teardown).
    pub registered: bool,
    /// Who copies.
    pub roles: Roles,
    sends: VecDeque<Step>,
    recvs: VecDeque<Step>,
    tail_issued: u64,
    tail: u64,
    head_issued: u64,
    head: u64,
    send_chunks: VecDeque<EventHandle>,
    recv_chunks: VecDeque<EventHandle>,
    lost: Option<String>,
}

impl PeerConn {
    pub fn new(
        peer: usize,
        transport: TransportKind,
        out: Arc<Channel>,
        inc: Arc<Channel>,
        registered: bool,
    ) -> Self {
        PeerConn {
            peer,
            transport,
            out,
            inc,
            registered,
            roles: Roles::default(),
            sends: VecDeque::new(),
            recvs: VecDeque::new(),
            tail_issued: 0,
            tail: 0,
            head_issued: 0,
            head: 0,
            send_chunks: VecDeque::new(),
            recv_chunks: VecDeque::new(),
            lost: None,
        }
    }

    /// Sets who copies on this pair.
    pub fn with_roles(mut self, roles: Roles) -> Self {
        self.roles = roles;
        self
    }

    fn idle(&self) -> bool {
        self.sends.is_empty() && self.recvs.is_empty()
    }

    /// Retires the pair: its later operations fail, and the eager path stays off it.
    fn retire(&mut self, shared: &Shared, reason: String) {
        self.lost = Some(reason);
        shared.mark_lost(self.peer);
    }
}

/// One operation in progress.
struct Step {
    op: Op,
    index: u64,
    phase: Phase,
    /// The path the bytes take (decided per message on a direct-capable staged pair).
    path: Path,
    /// When the step last made progress (for `FLAGCX_TIMEOUT_MS`).
    progressed: Instant,
    /// When it was admitted, and when it matched its peer (a send saw the receive
    /// descriptor; a receive announced itself) — for `FLAGCX_PROFILE`.
    admitted: Instant,
    matched: Option<Instant>,
}

/// Where operations spend their time, per direction (`FLAGCX_PROFILE=1` prints it at teardown).
#[derive(Default)]
struct Profile {
    /// Per direction: count, post→admit, admit→matched, matched→done (seconds).
    dirs: [(u64, f64, f64, f64); 2],
    /// IPC handles opened (cache misses).
    ipc_opens: u64,
    /// IPC mappings closed while running (cache trims), and the seconds that took.
    ipc_closes: u64,
    ipc_close_secs: f64,
}

impl Profile {
    fn add(&mut self, dir: Dir, posted: Instant, admitted: Instant, matched: Option<Instant>) {
        let now = Instant::now();
        let m = matched.unwrap_or(now);
        let d = &mut self.dirs[dir as usize];
        d.0 += 1;
        d.1 += admitted.duration_since(posted).as_secs_f64();
        d.2 += m.duration_since(admitted).as_secs_f64();
        d.3 += now.duration_since(m).as_secs_f64();
    }

    fn report(&self, rank: usize) {
        eprintln!(
            "flagcx profile rank {rank}: {} IPC handle opens, {} closed while running ({:.1} ms)",
            self.ipc_opens,
            self.ipc_closes,
            self.ipc_close_secs * 1e3
        );
        for (dir, (n, a, b, c)) in ["send", "recv"].iter().zip(self.dirs) {
            if n == 0 {
                continue;
            }
            let us = |x: f64| x / n as f64 * 1e6;
            let (match_what, rest_what) = if *dir == "send" {
                ("waiting for the receive descriptor", "copy and answer")
            } else {
                (
                    "waiting for the caller's stream, then announcing",
                    "waiting for the sender",
                )
            };
            eprintln!(
                "flagcx profile rank {rank}: {n} {dir}s, mean µs: post→proxy {:.1}, {match_what} {:.1}, {rest_what} {:.1}",
                us(a),
                us(b),
                us(c)
            );
        }
    }
}

enum Phase {
    /// Sender: waiting for the matching receive descriptor.
    AwaitRecvDesc,
    /// Sender (IPC): the copy into the receiver's memory is in flight.
    Copying(EventHandle),
    /// Sender (IPC, the receiver pulls): waiting for the caller's stream, then offering the
    /// source buffer.
    Offer,
    /// Sender (IPC, the receiver pulls): waiting for the receiver's verdict after its copy.
    AwaitVerdict,
    /// Receiver: waiting to announce the receive (start event, descriptor window).
    Announce,
    /// Receiver: waiting for the sender's answer.
    AwaitSendDesc,
    /// Receiver (IPC, pulling): waiting for the sender's offer.
    AwaitOffer,
    /// Receiver (IPC, pulling): the copy out of the sender's memory is in flight.
    Pulling { ev: EventHandle, size: usize },
    /// Staged, either side: `total` bytes in chunks, `issued` of them issued so far.
    Chunks {
        total: usize,
        issued: usize,
        started: bool,
    },
}

impl Phase {
    /// What a step in this phase waits for, in words (for [`CommError::Timeout`]).
    fn waiting_for(&self) -> String {
        match self {
            Phase::AwaitRecvDesc => "waiting for the peer to post the matching receive".into(),
            Phase::Copying(_) => "waiting for the copy into the peer's buffer".into(),
            Phase::Offer => "waiting for earlier work on the caller's stream".into(),
            Phase::AwaitVerdict => "waiting for the peer to copy the message out".into(),
            Phase::Announce => {
                "waiting for earlier work on the caller's stream or a free descriptor".into()
            }
            Phase::AwaitSendDesc => "waiting for the peer's send (or its data)".into(),
            Phase::AwaitOffer => "waiting for the peer to post the matching send".into(),
            Phase::Pulling { .. } => "waiting for the copy out of the peer's buffer".into(),
            Phase::Chunks { total, issued, .. } => {
                format!("waiting for the peer's side of the staged chunks ({issued} of {total} bytes issued)")
            }
        }
    }
}

/// The proxy thread's state.
pub(crate) struct Proxy<A: DeviceAdaptor> {
    pub adaptor: A,
    pub shared: Arc<Shared>,
    pub boot: Arc<Bootstrap>,
    pub peers: Vec<Option<PeerConn>>,
    pub send_stream: StreamHandle,
    pub recv_stream: StreamHandle,
    pub chunk: usize,
    timeout: Option<Duration>,
    health_interval: Duration,
    spin: Duration,
    profile: Option<Profile>,
    free_events: Vec<EventHandle>,
    /// Mapped buffers of host-vendor peers (only when this rank is a direct copier).
    host_maps: Option<HostMaps<A>>,
    finished: BTreeSet<u64>,
    watermark: u64,
}

/// What one pass over a step achieved.
enum Progress {
    /// Nothing moved. `on_peer`: the step waits for the peer (its descriptor, answer, data or
    /// free slots) rather than for work of ours in flight — only such a step fails when the
    /// peer is gone; one finishing its own copies of data the peer already handed over must
    /// be allowed to finish.
    Idle {
        on_peer: bool,
    },
    Moved,
    Done(Result<usize>),
}

impl<A: DeviceAdaptor> Proxy<A> {
    pub fn new(
        adaptor: A,
        shared: Arc<Shared>,
        boot: Arc<Bootstrap>,
        peers: Vec<Option<PeerConn>>,
        config: &crate::config::Config,
    ) -> Result<Self> {
        let send_stream = adaptor.stream_create()?;
        let recv_stream = adaptor.stream_create()?;
        let host_maps = peers
            .iter()
            .flatten()
            .any(|c| c.roles.maps_peer)
            .then(|| HostMaps::new(adaptor.clone(), boot.rank(), config.host_map_max));
        Ok(Proxy {
            adaptor,
            shared,
            boot,
            peers,
            send_stream,
            recv_stream,
            chunk: config.chunksize,
            timeout: config.timeout,
            health_interval: config.health_interval,
            spin: config.spin.unwrap_or_default(),
            profile: config.profile.then(Profile::default),
            free_events: Vec::new(),
            host_maps,
            finished: BTreeSet::new(),
            watermark: 0,
        })
    }

    /// The thread body: runs until shutdown, then fails what is left and cleans up.
    pub fn run(mut self) {
        // Short naps must stay short: the default 50 µs timer slack would stretch every 20 µs
        // back-off sleep to ~70 µs and show up directly in small-message latency.
        // SAFETY: prctl on the calling thread with plain integer arguments.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
        let mut spins = 0u32;
        let mut last_health = Instant::now();
        let mut seen_posted = 0;
        let mut last_moved = Instant::now();
        loop {
            let mut moved = false;
            let posted = self.shared.posted.load(Ordering::Acquire);
            if posted != seen_posted {
                seen_posted = posted;
                let new_ops = std::mem::take(&mut lock(&self.shared.inbox).ops);
                moved = !new_ops.is_empty();
                for op in new_ops {
                    self.admit(op);
                }
            }
            for p in 0..self.peers.len() {
                moved |= self.progress_peer(p);
            }
            let busy = self.peers.iter().flatten().any(|c| !c.idle());
            if busy && last_health.elapsed() >= self.health_interval {
                self.check_peers();
                last_health = Instant::now();
            }
            if self.shared.shutdown.load(Ordering::Acquire)
                || self.shared.aborted.load(Ordering::Acquire)
            {
                break;
            }
            if moved {
                spins = 0;
                last_moved = Instant::now();
            } else if !self.spin.is_zero() && last_moved.elapsed() < self.spin {
                // Hot for a while after progress, busy or not: the next step or the next
                // operation usually comes within microseconds, and a wake-up costs more.
                std::hint::spin_loop();
            } else if busy {
                self.shared.busy_polls.fetch_add(1, Ordering::Relaxed);
                spins = spins.saturating_add(1);
                if spins < 2048 {
                    std::hint::spin_loop();
                } else if spins < 4096 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(20));
                }
            } else {
                // Closing IPC mappings may wait for the whole device context, including
                // callers' streams that wait for this communicator's operations, so the cache
                // is trimmed only here: nothing in flight, and callers held off handing over
                // new operations (`Shared::trimming`) for the few least recently used mappings
                // closed per pass (~45 µs each on an H200). It grows past its bound while
                // traffic never pauses. Seen on an H200: closing between operations hung, and
                // closing at idle while a caller posted the next operation stalled it.
                // Posting threads' own copies (`IpcCache::caller_copies`) hold it off too.
                let over = {
                    let c = lock(&self.shared.ipc);
                    c.map.len() > IPC_CACHE_MAX && c.caller_copies == 0
                };
                if over && self.streams_idle() {
                    let quiet = {
                        let inbox = lock(&self.shared.inbox);
                        let quiet = inbox.ops.is_empty();
                        self.shared.trimming.store(quiet, Ordering::Release);
                        quiet
                    };
                    if quiet {
                        self.trim_ipc_cache(8);
                        self.shared.trimming.store(false, Ordering::Release);
                        continue;
                    }
                }
                std::thread::park_timeout(Duration::from_millis(100));
            }
        }
        self.teardown();
    }

    fn admit(&mut self, mut op: Op) {
        let peer = op.peer;
        let Some(conn) = self.peers.get_mut(peer).and_then(|c| c.as_mut()) else {
            let e = CommError::InvalidArgument(format!("no connection to rank {peer}"));
            return self.finish(op, Err(e));
        };
        if let Some(reason) = conn.lost.clone() {
            return self.finish(op, Err(CommError::PeerLost { peer, reason }));
        }
        if let Some(Resume::Failed(_)) = &op.resume {
            let Some(Resume::Failed(e)) = op.resume.take() else {
                unreachable!("matched above")
            };
            fail_locally(conn, &self.shared, op.dir, op.index, &e);
            return self.finish(op, Err(e));
        }
        let index = op.index;
        let phase = match (
            &op.resume,
            op.dir,
            conn.roles.peer_pulls,
            conn.roles.we_pull,
        ) {
            (Some(Resume::Pushed(ev)), ..) => Phase::Copying(*ev),
            (Some(Resume::Pulled { ev, size }), ..) => Phase::Pulling {
                ev: *ev,
                size: *size,
            },
            (Some(Resume::Published), Dir::Send, ..) => Phase::AwaitVerdict,
            (Some(Resume::Published), Dir::Recv, ..) => Phase::AwaitSendDesc,
            (Some(Resume::Failed(_)), ..) => unreachable!("finished above"),
            (None, Dir::Send, true, _) => Phase::Offer,
            (None, Dir::Send, false, _) => Phase::AwaitRecvDesc,
            (None, Dir::Recv, _, true) => Phase::AwaitOffer,
            (None, Dir::Recv, _, false) => Phase::Announce,
        };
        let path = match conn.transport {
            TransportKind::Ipc => Path::Ipc,
            TransportKind::Staged => Path::Staged,
        };
        let step = Step {
            op,
            index,
            phase,
            path,
            progressed: Instant::now(),
            admitted: Instant::now(),
            matched: None,
        };
        match step.op.dir {
            Dir::Send => conn.sends.push_back(step),
            Dir::Recv => conn.recvs.push_back(step),
        }
    }

    fn finish(&mut self, op: Op, r: Result<usize>) {
        if let Err(e) = &r {
            self.shared.record_error(e);
            tracing::debug!(seq = op.seq, peer = op.peer, "operation failed: {e}");
        }
        // The start event has served its purpose.
        if let Some(start) = op.start {
            recycle_event(&self.adaptor, &self.shared, start);
        }
        // A posting thread's copy the operation still held (it failed or timed out first).
        if let Some(Resume::Pushed(ev) | Resume::Pulled { ev, .. }) = op.resume {
            self.caller_copy_over(ev);
        }
        // Before the request completes: a caller that waited for it may post the next message
        // eagerly, which needs this one to be off the books.
        if let Some(p) = self.shared.pending.get(op.peer) {
            p[op.dir as usize].fetch_sub(1, Ordering::AcqRel);
        }
        op.slot.complete(r);
        drop(op.keep);
        self.finished.insert(op.seq);
        let mut w = self.watermark;
        while self.finished.remove(&(w + 1)) {
            w += 1;
        }
        if w != self.watermark {
            self.watermark = w;
            self.shared.publish_watermark(&self.adaptor, w);
        }
    }

    /// A copy's event completed: back to the pool it came from. A posting thread's copy (see
    /// [`Resume`]) no longer holds its IPC mapping open.
    fn copy_done(&mut self, op: &mut Op, ev: EventHandle) {
        match op.resume.take() {
            Some(Resume::Pushed(_) | Resume::Pulled { .. }) => self.caller_copy_over(ev),
            _ => self.free_events.push(ev),
        }
    }

    /// Settles the event of a posting thread's copy whose operation ends: the copy no longer
    /// counts in `caller_copies` once its event completed. One that has not (the operation
    /// failed or timed out around it) keeps counting, so no mapping is ever closed under it;
    /// that only stops trimming.
    fn caller_copy_over(&mut self, ev: EventHandle) {
        if self.adaptor.event_query(ev).unwrap_or(false) {
            lock(&self.shared.ipc).caller_copies -= 1;
        }
        recycle_event(&self.adaptor, &self.shared, ev);
    }

    fn event(&mut self) -> Result<EventHandle> {
        match self.free_events.pop() {
            Some(e) => Ok(e),
            None => Ok(self.adaptor.event_create(false)?),
        }
    }

    /// Advances the front send and front receive of one peer; true if anything moved.
    fn progress_peer(&mut self, p: usize) -> bool {
        let mut moved = false;
        for dir in [Dir::Send, Dir::Recv] {
            loop {
                let Some(conn) = self.peers[p].as_mut() else {
                    return moved;
                };
                let q = match dir {
                    Dir::Send => &mut conn.sends,
                    Dir::Recv => &mut conn.recvs,
                };
                let Some(mut step) = q.pop_front() else { break };
                let lost = conn.lost.clone();
                let r = match dir {
                    Dir::Send => self.progress_send(p, &mut step),
                    Dir::Recv => self.progress_recv(p, &mut step),
                };
                let r = match r {
                    Ok(pr) => pr,
                    Err(e) => {
                        // A local failure mid-message: tell the peer (so its side fails instead
                        // of waiting), settle our own in-flight copies, and retire the pair —
                        // its counters no longer agree with the peer's.
                        self.abandon_chunks(p, dir);
                        if let Some(c) = self.peers[p].as_mut() {
                            fail_locally(c, &self.shared, dir, step.index, &e);
                        }
                        Progress::Done(Err(e))
                    }
                };
                match r {
                    Progress::Done(res) => {
                        moved = true;
                        if let Ok(n) = res {
                            self.shared.path_bytes[step.path as usize]
                                .fetch_add(n as u64, Ordering::Relaxed);
                        }
                        if let (Some(pr), true) = (self.profile.as_mut(), res.is_ok()) {
                            pr.add(dir, step.op.posted, step.admitted, step.matched);
                        }
                        self.finish(step.op, res);
                    }
                    Progress::Moved => {
                        moved = true;
                        step.progressed = Instant::now();
                        self.requeue_front(p, dir, step);
                        break;
                    }
                    Progress::Idle { on_peer } => {
                        let stalled = self.timeout.filter(|t| step.progressed.elapsed() > *t);
                        match (lost.filter(|_| on_peer), stalled) {
                            (Some(reason), _) => {
                                moved = true;
                                self.abandon_chunks(p, dir);
                                let e = CommError::PeerLost { peer: p, reason };
                                self.finish(step.op, Err(e));
                            }
                            (None, Some(t)) => {
                                moved = true;
                                self.abandon_chunks(p, dir);
                                // The pair's shared state is now out of step: retire it.
                                let what = format!(
                                    "{} of {} bytes with rank {p} made no progress: {}",
                                    match step.op.dir {
                                        Dir::Send => "send",
                                        Dir::Recv => "receive",
                                    },
                                    step.op.bytes,
                                    step.phase.waiting_for()
                                );
                                if let Some(c) = self.peers[p].as_mut() {
                                    let why = format!("an operation timed out ({what})");
                                    retire_both_ways(c, &self.shared, why);
                                }
                                let e = CommError::Timeout {
                                    ms: t.as_millis() as u64,
                                    peer: Some(p),
                                    what,
                                };
                                self.finish(step.op, Err(e));
                            }
                            (None, None) => {
                                self.requeue_front(p, dir, step);
                                break;
                            }
                        }
                    }
                }
            }
        }
        moved
    }

    fn requeue_front(&mut self, p: usize, dir: Dir, step: Step) {
        if let Some(conn) = self.peers[p].as_mut() {
            match dir {
                Dir::Send => conn.sends.push_front(step),
                Dir::Recv => conn.recvs.push_front(step),
            }
        }
    }

    /// After a peer is lost mid-message, waits for our own in-flight chunk copies (they touch
    /// the caller's buffer) and forgets them.
    fn abandon_chunks(&mut self, p: usize, dir: Dir) {
        let stream = match dir {
            Dir::Send => self.send_stream,
            Dir::Recv => self.recv_stream,
        };
        let _ = self.adaptor.stream_synchronize(stream);
        if let Some(conn) = self.peers[p].as_mut() {
            let q = match dir {
                Dir::Send => &mut conn.send_chunks,
                Dir::Recv => &mut conn.recv_chunks,
            };
            self.free_events.extend(q.drain(..));
        }
    }

    fn progress_send(&mut self, p: usize, step: &mut Step) -> Result<Progress> {
        let chunk = self.chunk;
        let conn = self.peers[p].as_mut().expect("checked by caller");
        match step.phase {
            Phase::AwaitRecvDesc => {
                let fault = conn.out.load(Counter::RecvFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                if conn.out.load(Counter::RecvPosted) <= step.index {
                    return Ok(Progress::Idle { on_peer: true });
                }
                let desc = conn.out.read_recv_desc(step.index)?;
                step.matched = Some(Instant::now());
                let bytes = step.op.bytes;
                if let Some(r) = push_without_copy(&conn.out, step.index, bytes, &desc, p) {
                    return Ok(Progress::Done(r));
                }
                match conn.transport {
                    TransportKind::Ipc => {
                        let issued = self.issue_ipc_copy(step, &desc);
                        let conn = self.peers[p].as_mut().expect("present");
                        match issued {
                            Ok(ev) => {
                                step.phase = Phase::Copying(ev);
                                Ok(Progress::Moved)
                            }
                            Err(e) => {
                                answer(&conn.out, step.index, bytes, SendStatus::SenderFailed);
                                Err(e)
                            }
                        }
                    }
                    TransportKind::Staged => {
                        let mapped = match (conn.roles.maps_peer, desc.handle) {
                            (true, Some(h)) => self.map_peer(&h, desc.offset, bytes)?,
                            _ => None,
                        };
                        if let Some(base) = mapped {
                            let dst = (base + desc.offset) as *mut u8;
                            let (src, stream) = (step.op.ptr, self.send_stream);
                            let issued = self.enqueue(stream, step.op.start, |a| {
                                // SAFETY: `dst..dst+bytes` lies in the receiver's buffer (it
                                // announced `desc.size >= bytes` at `offset` of the mapped
                                // allocation and keeps it until we answer); `src` is the
                                // caller's buffer, valid until the operation completes.
                                unsafe { a.memcpy_d2h_async(dst, src, bytes, stream) }
                            });
                            let conn = self.peers[p].as_mut().expect("present");
                            return match issued {
                                Ok(ev) => {
                                    step.path = Path::Direct;
                                    step.phase = Phase::Copying(ev);
                                    Ok(Progress::Moved)
                                }
                                Err(e) => {
                                    answer(&conn.out, step.index, bytes, SendStatus::SenderFailed);
                                    Err(e)
                                }
                            };
                        }
                        let conn = self.peers[p].as_mut().expect("present");
                        answer(&conn.out, step.index, bytes, SendStatus::Ok);
                        step.phase = Phase::Chunks {
                            total: bytes,
                            issued: 0,
                            started: false,
                        };
                        Ok(Progress::Moved)
                    }
                }
            }
            Phase::Copying(ev) => {
                if !self.adaptor.event_query(ev)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                self.copy_done(&mut step.op, ev);
                let conn = self.peers[p].as_mut().expect("present");
                let status = match step.path {
                    Path::Direct => SendStatus::Delivered,
                    _ => SendStatus::Ok,
                };
                answer(&conn.out, step.index, step.op.bytes, status);
                Ok(Progress::Done(Ok(step.op.bytes)))
            }
            Phase::Offer => {
                let fault = conn.out.load(Counter::RecvFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                // Sends to a peer run one at a time and each waits for the verdict, but eager
                // sends before this one may still sit unread in their slots.
                if !conn.out.window_open(step.index) {
                    return Ok(Progress::Idle { on_peer: true });
                }
                let bytes = step.op.bytes;
                let (handle, offset) = if bytes > 0 {
                    // The receiver's copy engine reads straight from the buffer, so it may only
                    // be offered once earlier work on the caller's stream is done.
                    if !started(&self.adaptor, step.op.start)? {
                        return Ok(Progress::Idle { on_peer: false });
                    }
                    match export(&self.adaptor, step.op.ptr, conn.transport)? {
                        Some((h, offset)) => (Some(h), offset),
                        None => (None, 0),
                    }
                } else {
                    (None, 0)
                };
                let sd = SendDesc {
                    size: bytes as u64,
                    status: SendStatus::Ok,
                    handle,
                    offset,
                };
                conn.out.write_send_desc(step.index, &sd);
                conn.out.store(Counter::SendPosted, step.index + 1);
                step.matched = Some(Instant::now());
                step.phase = Phase::AwaitVerdict;
                Ok(Progress::Moved)
            }
            Phase::AwaitVerdict => {
                let fault = conn.out.load(Counter::RecvFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                if conn.out.load(Counter::RecvPosted) <= step.index {
                    return Ok(Progress::Idle { on_peer: true });
                }
                let verdict = conn.out.read_recv_desc(step.index)?;
                let bytes = step.op.bytes;
                if let Err(e) = verdict_result(bytes, &verdict, p) {
                    return Ok(Progress::Done(Err(e)));
                }
                if verdict.chunks && conn.transport == TransportKind::Staged {
                    // The receiver did not pull (our buffer is not mapped there yet).
                    step.phase = Phase::Chunks {
                        total: bytes,
                        issued: 0,
                        started: false,
                    };
                    return Ok(Progress::Moved);
                }
                if conn.transport == TransportKind::Staged {
                    step.path = Path::Direct;
                }
                Ok(Progress::Done(Ok(bytes)))
            }
            Phase::Chunks {
                total,
                ref mut issued,
                ref mut started,
            } => {
                let fault = conn.out.load(Counter::RecvFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                let mut moved = false;
                let slots = conn.out.geometry().slots as u64;
                while *issued < total && conn.tail_issued - conn.out.load(Counter::Head) < slots {
                    if !*started {
                        order_after(&self.adaptor, self.send_stream, step.op.start)?;
                        *started = true;
                    }
                    let len = chunk_len(total, chunk).min(total - *issued);
                    let src = DevicePtr(step.op.ptr.0 + *issued as u64);
                    let dst = conn.out.slot(conn.tail_issued);
                    // SAFETY: `dst` is a slot of `chunk` bytes in the live channel mapping that
                    // the receiver released (head); `src` lies inside the caller's buffer,
                    // which the operation keeps valid until it completes.
                    unsafe {
                        self.adaptor
                            .memcpy_d2h_async(dst, src, len, self.send_stream)?
                    };
                    let ev = match self.free_events.pop() {
                        Some(e) => e,
                        None => self.adaptor.event_create(false)?,
                    };
                    self.adaptor.event_record(ev, self.send_stream)?;
                    conn.send_chunks.push_back(ev);
                    conn.tail_issued += 1;
                    *issued += len;
                    moved = true;
                }
                while let Some(&ev) = conn.send_chunks.front() {
                    if !self.adaptor.event_query(ev)? {
                        break;
                    }
                    conn.send_chunks.pop_front();
                    self.free_events.push(ev);
                    conn.tail += 1;
                    conn.out.store(Counter::Tail, conn.tail);
                    moved = true;
                }
                if *issued == total && conn.send_chunks.is_empty() {
                    return Ok(Progress::Done(Ok(total)));
                }
                Ok(if moved {
                    Progress::Moved
                } else {
                    // Waiting on the peer only when none of our copies is in flight: then the
                    // ring is full and the receiver must drain it.
                    Progress::Idle {
                        on_peer: conn.send_chunks.is_empty(),
                    }
                })
            }
            Phase::Announce | Phase::AwaitSendDesc | Phase::AwaitOffer | Phase::Pulling { .. } => {
                unreachable!("receive phases")
            }
        }
    }

    /// Maps the peer's allocation behind `handle`, or reuses an earlier mapping of it.
    fn open_ipc(&mut self, handle: Option<IpcMemHandle>) -> Result<DevicePtr> {
        lock(&self.shared.ipc).open(&self.adaptor, handle)
    }

    /// Opens (or reuses) the receiver's allocation and enqueues the one copy into it.
    fn issue_ipc_copy(&mut self, step: &Step, desc: &RecvDesc) -> Result<EventHandle> {
        let base = self.open_ipc(desc.handle)?;
        let dst = DevicePtr(base.0 + desc.offset);
        let (src, n, stream) = (step.op.ptr, step.op.bytes, self.send_stream);
        self.enqueue(stream, step.op.start, |a| {
            // SAFETY: `dst..dst+n` lies in the receiver's buffer (it announced `desc.size >= n`
            // at `offset` of that allocation, which it keeps until we answer); `src` is the
            // caller's buffer, valid until the operation completes.
            unsafe { a.memcpy_d2d_async(dst, src, n, stream) }
        })
    }

    /// Opens (or reuses) the sender's allocation and enqueues the one copy out of it into the
    /// caller's receive buffer.
    fn issue_ipc_pull(&mut self, step: &Step, offer: &SendDesc) -> Result<EventHandle> {
        let base = self.open_ipc(offer.handle)?;
        let src = DevicePtr(base.0 + offer.offset);
        let (dst, n, stream) = (step.op.ptr, offer.size as usize, self.recv_stream);
        self.enqueue(stream, step.op.start, |a| {
            // SAFETY: `src..src+n` lies in the sender's buffer (it offered `n` bytes at `offset`
            // of that allocation and keeps them until our verdict); the destination is the
            // caller's buffer with `n <= bytes` (checked by the caller), valid until the
            // operation completes.
            unsafe { a.memcpy_d2d_async(dst, src, n, stream) }
        })
    }

    /// Orders `stream` after the caller's `start`, enqueues `copy` on it and records an event
    /// that completes with the copy.
    fn enqueue(
        &mut self,
        stream: StreamHandle,
        start: Option<EventHandle>,
        copy: impl FnOnce(&A) -> flagcx_adaptor::Result<()>,
    ) -> Result<EventHandle> {
        order_after(&self.adaptor, stream, start)?;
        copy(&self.adaptor)?;
        let ev = self.event()?;
        self.adaptor.event_record(ev, stream)?;
        Ok(ev)
    }

    /// Direct path: the host address of the peer allocation behind `handle` if it is mapped
    /// and ready (see [`HostMaps::lookup`]). A buffer the peer places outside its allocation
    /// (`offset + bytes` past its end) is a protocol error, never a copy.
    fn map_peer(
        &mut self,
        handle: &IpcMemHandle,
        offset: u64,
        bytes: usize,
    ) -> Result<Option<u64>> {
        let Some(maps) = self.host_maps.as_mut() else {
            return Ok(None);
        };
        let Some((base, len)) = maps.lookup(handle) else {
            return Ok(None);
        };
        placed_within(offset, bytes, len)?;
        Ok(Some(base))
    }

    fn streams_idle(&self) -> bool {
        [self.send_stream, self.recv_stream]
            .iter()
            .all(|&s| self.adaptor.stream_query(s).unwrap_or(false))
    }

    fn flush_ipc_cache(&mut self) {
        let _ = self.adaptor.stream_synchronize(self.send_stream);
        let _ = self.adaptor.stream_synchronize(self.recv_stream);
        for (_, (base, _)) in lock(&self.shared.ipc).map.drain() {
            // SAFETY: both proxy streams are idle and no caller is left that could copy (the
            // communicator is being destroyed, and each caller's copy was waited for before
            // its operation finished), so no copy uses the mapping.
            let _ = unsafe { self.adaptor.ipc_close(base) };
        }
    }

    /// Closes up to `n` of the least recently used mappings beyond the bound (the caller
    /// checked that both proxy streams are idle).
    fn trim_ipc_cache(&mut self, n: usize) {
        let t0 = Instant::now();
        // Held throughout: a posting thread cannot take a mapping while it closes.
        let mut cache = lock(&self.shared.ipc);
        if cache.caller_copies > 0 {
            return;
        }
        let victims = lru_victims(&cache.map, IPC_CACHE_MAX, n);
        let closed = victims.len() as u64;
        cache.closes += closed;
        for key in victims {
            if let Some((base, _)) = cache.map.remove(&key) {
                // SAFETY: both proxy streams are idle and no posting thread's copy is in
                // flight (`caller_copies`, checked under this lock), so no copy uses it.
                let _ = unsafe { self.adaptor.ipc_close(base) };
            }
        }
        if let Some(p) = self.profile.as_mut() {
            p.ipc_closes += closed;
            p.ipc_close_secs += t0.elapsed().as_secs_f64();
        }
    }

    fn progress_recv(&mut self, p: usize, step: &mut Step) -> Result<Progress> {
        let chunk = self.chunk;
        let conn = self.peers[p].as_mut().expect("checked by caller");
        match step.phase {
            Phase::Announce => {
                // The descriptor window: the sender reuses send descriptor slots only after we
                // finished the receive 64 back, which in-order completion guarantees here.
                if !conn.inc.window_open(step.index) {
                    return Ok(Progress::Idle { on_peer: false });
                }
                let bytes = step.op.bytes;
                let ipc = conn.transport == TransportKind::Ipc;
                let mut desc = RecvDesc {
                    size: bytes as u64,
                    handle: None,
                    offset: 0,
                    chunks: false,
                };
                if bytes > 0 && (ipc || conn.roles.peer_maps) {
                    // The sender's copy engine may write straight into the buffer, so it may
                    // only be announced once earlier work on the caller's stream is done.
                    if !started(&self.adaptor, step.op.start)? {
                        return Ok(Progress::Idle { on_peer: false });
                    }
                    if let Some((h, offset)) = export(&self.adaptor, step.op.ptr, conn.transport)? {
                        (desc.handle, desc.offset) = (Some(h), offset);
                    }
                }
                let conn = self.peers[p].as_mut().expect("present");
                conn.inc.write_recv_desc(step.index, &desc);
                conn.inc.store(Counter::RecvPosted, step.index + 1);
                step.matched = Some(Instant::now());
                step.phase = Phase::AwaitSendDesc;
                Ok(Progress::Moved)
            }
            Phase::AwaitSendDesc => {
                let fault = conn.inc.load(Counter::SendFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                if conn.inc.load(Counter::SendPosted) <= step.index {
                    return Ok(Progress::Idle { on_peer: true });
                }
                let sd = conn.inc.read_send_desc(step.index)?;
                if sd.status == SendStatus::Eager {
                    return self.take_eager(p, step, &sd);
                }
                let bytes = step.op.bytes;
                let failed = send_failure(p, &sd, bytes, false);
                let size = sd.size as usize;
                if sd.status == SendStatus::Delivered {
                    step.path = Path::Direct;
                }
                if failed.is_some()
                    || conn.transport == TransportKind::Ipc
                    || sd.status == SendStatus::Delivered
                    || size == 0
                {
                    conn.inc.store(Counter::RecvDone, step.index + 1);
                    return Ok(Progress::Done(failed.map_or(Ok(size), Err)));
                }
                step.phase = Phase::Chunks {
                    total: size,
                    issued: 0,
                    started: false,
                };
                Ok(Progress::Moved)
            }
            Phase::AwaitOffer => {
                let fault = conn.inc.load(Counter::SendFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                if conn.inc.load(Counter::SendPosted) <= step.index {
                    return Ok(Progress::Idle { on_peer: true });
                }
                let offer = conn.inc.read_send_desc(step.index)?;
                step.matched = Some(Instant::now());
                if offer.status == SendStatus::Eager {
                    return self.take_eager(p, step, &offer);
                }
                let bytes = step.op.bytes;
                if let Some(r) = pull_without_copy(&conn.inc, step.index, bytes, &offer, p) {
                    return Ok(Progress::Done(r));
                }
                let ev = if conn.transport == TransportKind::Ipc {
                    self.issue_ipc_pull(step, &offer)?
                } else {
                    let size = offer.size as usize;
                    let mapped = match offer.handle {
                        Some(h) => self.map_peer(&h, offer.offset, size)?,
                        None => None,
                    };
                    let Some(base) = mapped else {
                        // Not mapped (yet): ask for the data through the ring.
                        let conn = self.peers[p].as_mut().expect("present");
                        let d = RecvDesc {
                            size: bytes as u64,
                            handle: None,
                            offset: 0,
                            chunks: true,
                        };
                        conn.inc.write_recv_desc(step.index, &d);
                        conn.inc.store(Counter::RecvPosted, step.index + 1);
                        step.phase = Phase::Chunks {
                            total: offer.size as usize,
                            issued: 0,
                            started: false,
                        };
                        return Ok(Progress::Moved);
                    };
                    let src = (base + offer.offset) as *const u8;
                    let (dst, n, stream) = (step.op.ptr, offer.size as usize, self.recv_stream);
                    step.path = Path::Direct;
                    self.enqueue(stream, step.op.start, |a| {
                        // SAFETY: `src..src+n` lies in the sender's mapped buffer (it offered
                        // `n` bytes at `offset` and keeps them until our verdict); `dst` is the
                        // caller's buffer with `n <= bytes`, valid until completion.
                        unsafe { a.memcpy_h2d_async(dst, src, n, stream) }
                    })?
                };
                step.phase = Phase::Pulling {
                    ev,
                    size: offer.size as usize,
                };
                Ok(Progress::Moved)
            }
            Phase::Pulling { ev, size } => {
                if !self.adaptor.event_query(ev)? {
                    return Ok(Progress::Idle { on_peer: false });
                }
                self.copy_done(&mut step.op, ev);
                let conn = self.peers[p].as_mut().expect("present");
                give_verdict(&conn.inc, step.index, step.op.bytes);
                Ok(Progress::Done(Ok(size)))
            }
            Phase::Chunks {
                total,
                ref mut issued,
                ref mut started,
            } => {
                let fault = conn.inc.load(Counter::SendFault);
                if fault > step.index {
                    return Err(remote_failure(p, fault));
                }
                let mut moved = false;
                while *issued < total && conn.head_issued < conn.inc.load(Counter::Tail) {
                    if !*started {
                        order_after(&self.adaptor, self.recv_stream, step.op.start)?;
                        *started = true;
                    }
                    let len = chunk_len(total, chunk).min(total - *issued);
                    let dst = DevicePtr(step.op.ptr.0 + *issued as u64);
                    let src = conn.inc.slot(conn.head_issued);
                    // SAFETY: the slot holds a chunk the sender published (tail); `dst` lies in
                    // the caller's buffer (`total <= bytes`), valid until completion.
                    unsafe {
                        self.adaptor
                            .memcpy_h2d_async(dst, src, len, self.recv_stream)?
                    };
                    let ev = match self.free_events.pop() {
                        Some(e) => e,
                        None => self.adaptor.event_create(false)?,
                    };
                    self.adaptor.event_record(ev, self.recv_stream)?;
                    conn.recv_chunks.push_back(ev);
                    conn.head_issued += 1;
                    *issued += len;
                    moved = true;
                }
                while let Some(&ev) = conn.recv_chunks.front() {
                    if !self.adaptor.event_query(ev)? {
                        break;
                    }
                    conn.recv_chunks.pop_front();
                    self.free_events.push(ev);
                    conn.head += 1;
                    conn.inc.store(Counter::Head, conn.head);
                    moved = true;
                }
                if *issued == total && conn.recv_chunks.is_empty() {
                    conn.inc.store(Counter::RecvDone, step.index + 1);
                    return Ok(Progress::Done(Ok(total)));
                }
                Ok(if moved {
                    Progress::Moved
                } else {
                    // Waiting on the peer only when every published chunk is already being
                    // copied out and none of those copies is still in flight.
                    Progress::Idle {
                        on_peer: conn.recv_chunks.is_empty(),
                    }
                })
            }
            Phase::AwaitRecvDesc | Phase::Copying(_) | Phase::Offer | Phase::AwaitVerdict => {
                unreachable!("send phases")
            }
        }
    }

    /// A receive whose sender sent eagerly (either receive phase): once the caller's stream
    /// passed the posting point, copies the message out of its eager slot.
    fn take_eager(&mut self, p: usize, step: &mut Step, sd: &SendDesc) -> Result<Progress> {
        if !started(&self.adaptor, step.op.start)? {
            return Ok(Progress::Idle { on_peer: false });
        }
        let conn = self.peers[p].as_ref().expect("checked by caller");
        step.path = Path::Eager;
        let r = receive_eager(&conn.inc, step.index, sd, step.op.ptr, step.op.bytes, p);
        match r {
            Err(e @ CommError::Protocol(_)) => Err(e),
            r => Ok(Progress::Done(r)),
        }
    }

    /// Marks peers whose bootstrap socket hung up; their stuck operations then fail.
    fn check_peers(&mut self) {
        for conn in self.peers.iter_mut().flatten() {
            if conn.lost.is_some() || conn.idle() {
                continue;
            }
            let Some(fd) = self.boot.peer_fd(conn.peer) else {
                continue;
            };
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLRDHUP,
                revents: 0,
            };
            // SAFETY: one valid pollfd, zero timeout.
            let n = unsafe { libc::poll(&mut pfd, 1, 0) };
            if n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                tracing::warn!(peer = conn.peer, "peer hung up");
                let why = "the process exited or closed its communicator".into();
                conn.retire(&self.shared, why);
            }
        }
    }

    fn teardown(mut self) {
        if let Some(p) = self.profile.as_mut() {
            p.ipc_opens = lock(&self.shared.ipc).opens;
            p.report(self.boot.rank());
            let n = |h: Handoff| self.shared.caller_handoffs[h as usize].load(Ordering::Relaxed);
            eprintln!(
                "flagcx profile rank {}: {} IPC operations finished by their posting thread; \
                 handed to the proxy: {} before the peer's descriptor came, {} while the copy \
                 ran ({} pushes, {} pulls), {} before the peer answered, {} failed",
                self.boot.rank(),
                self.shared.caller_ops.load(Ordering::Relaxed),
                n(Handoff::Fresh),
                n(Handoff::Pushed) + n(Handoff::Pulled),
                n(Handoff::Pushed),
                n(Handoff::Pulled),
                n(Handoff::Published),
                n(Handoff::Failed)
            );
        }
        let aborted = self.shared.aborted.load(Ordering::Acquire);
        if aborted {
            tracing::warn!("communicator aborted: failing every pending operation");
            // Peers fail what they have with this rank at once instead of waiting for it.
            for conn in self.peers.iter_mut().flatten() {
                retire_both_ways(conn, &self.shared, "this rank aborted".into());
            }
        }
        let mut left = Vec::new();
        for conn in self.peers.iter_mut().flatten() {
            left.extend(
                conn.sends
                    .drain(..)
                    .chain(conn.recvs.drain(..))
                    .map(|s| s.op),
            );
        }
        left.extend(std::mem::take(&mut lock(&self.shared.inbox).ops));
        let _ = self.adaptor.stream_synchronize(self.send_stream);
        let _ = self.adaptor.stream_synchronize(self.recv_stream);
        for op in left {
            // A copy a posting thread issued on its stream may still use a mapping, which
            // closes below: let it finish first (`finish` then settles its event).
            if let Some(Resume::Pushed(ev) | Resume::Pulled { ev, .. }) = op.resume {
                let _ = self.adaptor.event_synchronize(ev);
            }
            self.finish(op, Err(CommError::Aborted));
        }
        self.flush_ipc_cache();
        if let Some(m) = self.host_maps.as_mut() {
            // Both streams were synchronized above: no copy touches the mappings.
            m.close();
        }
        let spares = std::mem::take(&mut *lock(&self.shared.spare_events));
        for e in self.free_events.drain(..).chain(spares) {
            let _ = self.adaptor.event_destroy(e);
        }
        for conn in self.peers.iter_mut().flatten() {
            for e in conn.send_chunks.drain(..).chain(conn.recv_chunks.drain(..)) {
                let _ = self.adaptor.event_destroy(e);
            }
            if conn.registered {
                for ch in [&conn.out, &conn.inc] {
                    // SAFETY: both proxy streams are idle, so no copy uses the ring.
                    let _ = unsafe { self.adaptor.host_unregister(ch.ring().0) };
                }
            }
        }
        let _ = self.adaptor.stream_destroy(self.send_stream);
        let _ = self.adaptor.stream_destroy(self.recv_stream);
    }
}

/// A local failure (`e`) of message `index` mid-protocol: tells the peer, so its side fails
/// instead of waiting, and retires the pair — its counters no longer agree with the peer's.
/// Retires the pair in both directions and tells the peer through the channels' fault
/// counters ([`RETIRED`]): whatever it has not started yet fails there with `RemoteFailure`
/// instead of moving bytes into or out of this rank's buffers — the peer may only be stopped,
/// and continue later.
fn retire_both_ways(conn: &mut PeerConn, shared: &Shared, why: String) {
    conn.out.store(Counter::SendFault, RETIRED);
    conn.inc.store(Counter::RecvFault, RETIRED);
    conn.retire(shared, why);
}

fn fail_locally(conn: &mut PeerConn, shared: &Shared, dir: Dir, index: u64, e: &CommError) {
    let (ch, counter) = match dir {
        Dir::Send => (&conn.out, Counter::SendFault),
        Dir::Recv => (&conn.inc, Counter::RecvFault),
    };
    ch.store(counter, index + 1);
    conn.retire(shared, format!("a local {dir:?} failed: {e}"));
}

/// Returns an event of the API side to its pool (`Shared::spare_events`) if it completed, else
/// destroys it (allowed while a stream still has to pass it: runtimes release it once it
/// completes).
pub(crate) fn recycle_event<A: DeviceAdaptor>(adaptor: &A, shared: &Shared, ev: EventHandle) {
    let mut spares = lock(&shared.spare_events);
    if spares.len() < 1024 && adaptor.event_query(ev).unwrap_or(false) {
        spares.push(ev);
    } else {
        let _ = adaptor.event_destroy(ev);
    }
}

/// Checks that a peer's buffer (`bytes` at `offset`) lies inside its `len`-byte allocation.
fn placed_within(offset: u64, bytes: usize, len: usize) -> Result<()> {
    match offset.checked_add(bytes as u64) {
        Some(end) if end <= len as u64 => Ok(()),
        _ => Err(CommError::Protocol(format!(
            "the peer placed {bytes} bytes at offset {offset} of a {len}-byte allocation"
        ))),
    }
}

/// The chunk size of a `total`-byte staged message over slots of `slot` bytes: about an eighth
/// of the message (so mid-size messages still pipeline their two copies), in 64 KiB steps, at
/// most a slot (so large messages pay the per-chunk cost of events and hand-offs rarely). Both
/// sides derive it from the same total, so their chunk boundaries agree.
pub(crate) fn chunk_len(total: usize, slot: usize) -> usize {
    const STEP: usize = 64 << 10;
    total.div_ceil(8).next_multiple_of(STEP).max(STEP).min(slot)
}

/// Orders later work on `stream` after the caller's `start` event. When the event has already
/// completed (the usual case by the time a peer matched), no device-side wait is enqueued.
fn order_after<A: DeviceAdaptor>(
    a: &A,
    stream: StreamHandle,
    start: Option<EventHandle>,
) -> Result<()> {
    if let Some(start) = start.filter(|_| !started(a, start).unwrap_or(false)) {
        a.stream_wait_event(stream, start)?;
    }
    Ok(())
}

/// The IPC handle of the allocation holding `ptr`, and `ptr`'s offset in it: what a peer needs
/// to reach the buffer (the receiver's for a push, the sender's for a pull). An IPC pair cannot
/// do without it (the failure is the operation's); on the direct path a buffer that cannot be
/// exported (not host-vendor device memory) just takes the ring: `None`.
pub(crate) fn export<A: DeviceAdaptor>(
    a: &A,
    ptr: DevicePtr,
    transport: TransportKind,
) -> Result<Option<(IpcMemHandle, u64)>> {
    let exported = a
        .mem_get_range(ptr)
        .and_then(|(base, _)| Ok((a.ipc_get_handle(base)?, ptr.0 - base.0)));
    match exported {
        Ok(x) => Ok(Some(x)),
        Err(e) if transport == TransportKind::Ipc => Err(e.into()),
        Err(_) => Ok(None),
    }
}

/// The keys of up to `n` entries of `cache` (values: `(_, last use)`) to drop so that it holds
/// at most `max`, least recently used first.
fn lru_victims<K: Copy, V>(cache: &HashMap<K, (V, u64)>, max: usize, n: usize) -> Vec<K> {
    let excess = cache.len().saturating_sub(max).min(n);
    let mut by_age: Vec<(u64, K)> = cache.iter().map(|(k, v)| (v.1, *k)).collect();
    by_age.sort_unstable_by_key(|&(used, _)| used);
    by_age.into_iter().take(excess).map(|(_, k)| k).collect()
}

/// Whether the caller's stream passed the point where the operation was posted.
fn started<A: DeviceAdaptor>(a: &A, start: Option<EventHandle>) -> Result<bool> {
    match start {
        None => Ok(true),
        Some(e) => Ok(a.event_query(e)?),
    }
}

pub(crate) fn remote_failure(peer: usize, fault: u64) -> CommError {
    let reason = if fault == RETIRED {
        "it retired the pair (an operation with this rank timed out there, or it aborted)"
    } else {
        "its side of the operation failed (a runtime error)"
    };
    CommError::RemoteFailure {
        peer,
        reason: reason.into(),
    }
}

/// A pushing sender's decision on receive descriptor `desc` where no copy is needed (the
/// receive is too small, or there is nothing to send): it answers, and this is the result.
pub(crate) fn push_without_copy(
    out: &Channel,
    index: u64,
    bytes: usize,
    desc: &RecvDesc,
    peer: usize,
) -> Option<Result<usize>> {
    if bytes as u64 > desc.size {
        answer(out, index, bytes, SendStatus::SizeMismatch);
        return Some(Err(CommError::SizeMismatch {
            peer,
            send_bytes: bytes,
            recv_bytes: desc.size as usize,
        }));
    }
    if bytes == 0 {
        answer(out, index, 0, SendStatus::Ok);
        return Some(Ok(0));
    }
    None
}

/// A pulling receiver's decision on offer `offer` where no copy is needed (the sender failed,
/// the receive is too small, or nothing was sent): it gives its verdict, and this is the result.
pub(crate) fn pull_without_copy(
    inc: &Channel,
    index: u64,
    bytes: usize,
    offer: &SendDesc,
    peer: usize,
) -> Option<Result<usize>> {
    let r = match send_failure(peer, offer, bytes, true) {
        Some(e) => Err(e),
        None if offer.size == 0 => Ok(0),
        None => return None,
    };
    give_verdict(inc, index, bytes);
    Some(r)
}

/// An offering sender's result, from the pulling receiver's verdict (its buffer size).
pub(crate) fn verdict_result(bytes: usize, verdict: &RecvDesc, peer: usize) -> Result<usize> {
    if bytes as u64 > verdict.size {
        return Err(CommError::SizeMismatch {
            peer,
            send_bytes: bytes,
            recv_bytes: verdict.size as usize,
        });
    }
    Ok(bytes)
}

/// Publishes the sender's answer for descriptor `index`.
pub(crate) fn answer(out: &Channel, index: u64, bytes: usize, status: SendStatus) {
    out.write_send_desc(
        index,
        &SendDesc {
            size: bytes as u64,
            status,
            handle: None,
            offset: 0,
        },
    );
    out.store(Counter::SendPosted, index + 1);
}

/// The pulling receiver's verdict on message `index`, published once its copy finished (or
/// it refused): its buffer size, from which the sender tells success from a size mismatch.
pub(crate) fn give_verdict(inc: &Channel, index: u64, recv_bytes: usize) {
    let d = RecvDesc {
        size: recv_bytes as u64,
        handle: None,
        offset: 0,
        chunks: false,
    };
    inc.write_recv_desc(index, &d);
    inc.store(Counter::RecvPosted, index + 1);
    inc.store(Counter::RecvDone, index + 1);
}

/// Receives eager message `index` of `inc`, described by `sd`, into `dst` (`cap` bytes), and
/// frees its slot. A message larger than `cap` is refused (a size mismatch: the sender was
/// done with it, so only this side fails) and the pair goes on.
pub(crate) fn receive_eager(
    inc: &Channel,
    index: u64,
    sd: &SendDesc,
    dst: DevicePtr,
    cap: usize,
    peer: usize,
) -> Result<usize> {
    let lane = inc.geometry().eager;
    if sd.size as usize > lane {
        return Err(CommError::Protocol(format!(
            "rank {peer} sent an eager message of {} bytes; this channel's eager slots hold {lane}",
            sd.size
        )));
    }
    let r = if sd.size as usize > cap {
        Err(CommError::SizeMismatch {
            peer,
            send_bytes: sd.size as usize,
            recv_bytes: cap,
        })
    } else {
        // SAFETY: a channel has eager slots only where this rank's device memory is host
        // addressable (`Capabilities::host_addressable`), and a message too big for them is
        // refused before copying; so `dst` is a CPU address of `cap >= sd.size` writable bytes:
        // the caller's buffer, whose earlier stream work has completed.
        unsafe { inc.take_eager(index, sd, dst.0 as *mut u8) }
    };
    // Only the slot's release matters to the sender, which was done with the message;
    // `RecvPosted` stays (a later message's announcement or verdict moves it on).
    inc.store(Counter::RecvDone, index + 1);
    r
}

/// Why a receive of `bytes` cannot take the sender's descriptor `sd`, if it cannot. A pushing
/// sender checks sizes itself and reports a mismatch in the status; a pulling receiver sees the
/// sender's size in the offer and is the one to find it too large.
pub(crate) fn send_failure(
    peer: usize,
    sd: &SendDesc,
    bytes: usize,
    pulling: bool,
) -> Option<CommError> {
    match sd.status {
        SendStatus::Ok | SendStatus::Delivered if sd.size as usize <= bytes => None,
        SendStatus::Ok if pulling => Some(CommError::SizeMismatch {
            peer,
            send_bytes: sd.size as usize,
            recv_bytes: bytes,
        }),
        SendStatus::Ok | SendStatus::Delivered => Some(CommError::Protocol(format!(
            "rank {peer} sent {} bytes into a {bytes}-byte receive",
            sd.size
        ))),
        SendStatus::SizeMismatch => Some(CommError::SizeMismatch {
            peer,
            send_bytes: sd.size as usize,
            recv_bytes: bytes,
        }),
        SendStatus::SenderFailed => Some(CommError::RemoteFailure {
            peer,
            reason: "the sender's copy could not be issued".into(),
        }),
        // An eager descriptor is taken out of its slot before this is asked.
        SendStatus::Eager => Some(CommError::Protocol(format!(
            "rank {peer}: an eager descriptor where an answer was expected"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::{chunk_len, lru_victims, placed_within};

    #[test]
    fn ipc_cache_trims_least_recently_used_beyond_the_bound() {
        // Key i last used at (i * 7) % 10: ages 0, 7, 4, 1, 8, 5, 2, 9, 6, 3.
        let cache: std::collections::HashMap<u32, ((), u64)> =
            (0..10).map(|i| (i, ((), (i as u64 * 7) % 10))).collect();
        assert!(lru_victims(&cache, 10, 8).is_empty(), "within the bound");
        assert_eq!(lru_victims(&cache, 7, 8), vec![0, 3, 6], "the three oldest");
        assert_eq!(
            lru_victims(&cache, 2, 4),
            vec![0, 3, 6, 9],
            "at most n per pass"
        );
    }

    #[test]
    fn a_peer_buffer_outside_its_allocation_is_refused() {
        assert!(placed_within(0, 4096, 4096).is_ok());
        assert!(placed_within(4000, 96, 4096).is_ok());
        assert!(placed_within(4000, 97, 4096).is_err());
        assert!(placed_within(u64::MAX, 2, 4096).is_err(), "no overflow");
    }

    #[test]
    fn chunks_are_an_eighth_of_the_message_within_bounds() {
        let (k, m) = (1 << 10, 1 << 20);
        let slot = 4 * m;
        assert_eq!(chunk_len(8, slot), 64 * k, "small messages: one chunk");
        assert_eq!(chunk_len(2 * m, slot), 256 * k);
        assert_eq!(chunk_len(2 * m + 1, slot), 320 * k, "rounded up to 64 KiB");
        assert_eq!(chunk_len(16 * m, slot), 2 * m);
        assert_eq!(chunk_len(1 << 30, slot), slot, "at most a slot");
        // Slots smaller than the 64 KiB step (a tiny FLAGCX_P2P_CHUNKSIZE) still bound it.
        assert_eq!(chunk_len(1 << 30, 4096), 4096);
        for total in [1, 100, 65_537, 3 * m + 5, 1 << 31] {
            let c = chunk_len(total, slot);
            assert!(c > 0 && c <= slot && c % (64 * k) == 0);
            assert!(total.div_ceil(c) <= 8 || c == slot, "{total}: {c}");
        }
    }
}
