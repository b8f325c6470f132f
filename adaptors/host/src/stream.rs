//! Host-vendor streams and events: one worker thread per stream runs its operations in order.
//!
//! A stream is a FIFO of [`Op`]s and a thread that drains it; "submitted" and "completed"
//! counters answer query/synchronize. An event is a pair of generation counters: recording bumps
//! the recorded generation and enqueues an op that, when the stream reaches it, marks that
//! generation complete — exactly the "last recording" semantics of CUDA events.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flagcx_adaptor::quiet::QuietCondvar;
use flagcx_adaptor::reduce::{DataType, ReduceStep};
use flagcx_adaptor::{HostFn, WaitCondition};

use crate::cma;
use crate::copy::copy_bytes;

/// One unit of stream work. Addresses are validated by the adaptor before enqueueing.
pub(crate) enum Op {
    Copy {
        dst: u64,
        src: u64,
        n: usize,
    },
    Memset {
        dst: u64,
        value: u8,
        n: usize,
    },
    /// A copy of the length the word at `len_at` holds when the op runs, if at most `cap`.
    SizedCopy {
        dst: u64,
        src: u64,
        len_at: u64,
        cap: usize,
    },
    /// One reduction step (`flagcx_adaptor::reduce::reduce_raw`) over `count` elements.
    Reduce {
        dst: u64,
        a: u64,
        b: u64,
        count: usize,
        dtype: DataType,
        step: ReduceStep,
    },
    HostFn(HostFn),
    Record {
        event: Arc<EventState>,
        gen: u64,
    },
    WaitEvent {
        event: Arc<EventState>,
        gen: u64,
    },
    WaitValue {
        addr: u64,
        value: u64,
        wide: bool,
        cond: WaitCondition,
    },
    WriteValue {
        addr: u64,
        value: u64,
        wide: bool,
    },
    /// A copy between `local` and registered memory of process `pid` (`crate::cma`).
    Remote {
        way: cma::Way,
        pid: u32,
        local: u64,
        remote: u64,
        n: usize,
    },
}

/// Progress shared between a stream's owner and its worker.
#[derive(Default)]
pub(crate) struct Progress {
    state: Mutex<ProgressInner>,
    cv: QuietCondvar,
    /// `submitted - completed`, kept beside them (changed under the lock) so that
    /// [`HostStream::idle`] — polled on every post of a latency-bound caller — reads one
    /// atomic instead of taking the lock. Decremented with release ordering once an op's
    /// effects are done, so a reader that sees 0 (acquire) sees them.
    outstanding: AtomicU64,
    /// Why a copy of this stream failed (a copy through the kernel the kernel refused):
    /// sticky, as a device fault is on a GPU stream. Every event recorded behind it completes
    /// failed and every synchronize fails, so nothing later takes the copy's bytes as landed.
    broken: OnceLock<String>,
}

impl Progress {
    /// Why the stream is broken, if it is.
    pub(crate) fn broken(&self) -> Option<&str> {
        self.broken.get().map(String::as_str)
    }

    /// Runs `op` for this stream: a failed copy breaks it; a recording behind a failure
    /// completes failed.
    fn run(&self, op: Op, stop: &AtomicBool) -> Option<String> {
        if let (Op::Record { event, gen }, Some(why)) = (&op, self.broken()) {
            event.complete_broken(*gen, why);
            return None;
        }
        let remote = matches!(op, Op::Remote { .. });
        let fault = run(op, stop);
        match (remote, fault) {
            (true, Some(why)) => {
                let _ = self.broken.set(why);
                None
            }
            (_, fault) => fault,
        }
    }
}

#[derive(Default)]
struct ProgressInner {
    submitted: u64,
    completed: u64,
    /// The first host function that panicked, reported by synchronize.
    fault: Option<String>,
}

/// An op on its way to a worker, with the stream it belongs to (a shared queue's worker runs
/// several streams' ops).
pub(crate) struct Job {
    op: Op,
    progress: Arc<Progress>,
    stop: Arc<AtomicBool>,
    /// A shared queue's count of jobs sent and not yet run (`None` for a stream's own worker).
    queued: Option<Arc<Mutex<u64>>>,
}

/// The worker's next op, `None` once every sender of its queue is gone. With spinning enabled
/// ([`wait_spin`]) an idle worker polls its queue that long before it sleeps, so a stream fed
/// op after op (a staged transfer's chunk copies) does not pay a wake-up per op.
fn next_op(rx: &Receiver<Job>) -> Option<Job> {
    let spin = wait_spin();
    let t0 = Instant::now();
    loop {
        match rx.try_recv() {
            Ok(op) => return Some(op),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) if !spin.is_zero() && t0.elapsed() < spin => {
                flagcx_adaptor::spin::relax()
            }
            Err(TryRecvError::Empty) => return rx.recv().ok(),
        }
    }
}

/// A live stream: its queue, its counters and its worker.
pub(crate) struct HostStream {
    tx: Mutex<Option<Sender<Job>>>,
    progress: Arc<Progress>,
    shutdown: Arc<AtomicBool>,
    /// The stream's own worker (`None` once joined, or on a shared queue).
    worker: Mutex<Option<JoinHandle<()>>>,
    /// Its ops run on a [`SharedQueue`], whose count of queued jobs this is.
    shared: Option<Arc<Mutex<u64>>>,
}

/// Environment variable: how many work queues this process's streams of one host device share
/// (`0` or unset: a worker per stream). As `CUDA_DEVICE_MAX_CONNECTIONS` does for a CUDA
/// context's streams, streams take the queues in turn, and a queue runs its ops in the order
/// they were enqueued, whichever stream they belong to: an op waiting for a value holds up every
/// later op of its queue. For reproducing on the CPU what a GPU's shared hardware queues do
/// (`git show 7ff18bc:docs/performance.md`, "one hardware queue stalls the proxy").
pub const QUEUES_ENV: &str = "FLAGCX_HOST_QUEUES";

/// One worker thread running, in order, the ops of every stream placed on it.
pub(crate) struct SharedQueue {
    tx: Sender<Job>,
    /// Jobs sent to the worker and not yet run: while it is 0, a push may run a cheap op inline
    /// under this lock, as on a stream of its own (nothing of any stream is ahead of it).
    queued: Arc<Mutex<u64>>,
}

impl SharedQueue {
    /// The shared queues [`QUEUES_ENV`] asks for on host device `device` (`0`, unset or not a
    /// number: none).
    pub fn from_env(device: usize) -> std::io::Result<Vec<Self>> {
        let n = std::env::var(QUEUES_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        (0..n)
            .map(|q| Self::spawn(format!("flagcx-host-queue-{device}.{q}")))
            .collect()
    }

    /// Starts the queue's worker; it exits once the queue and every stream on it are gone.
    fn spawn(name: String) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Job>();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || work(rx))?;
        Ok(SharedQueue {
            tx,
            queued: Arc::default(),
        })
    }
}

/// A worker's loop: runs each job's op and counts it done on the job's stream.
fn work(rx: Receiver<Job>) {
    // Keep back-off naps short (default timer slack is 50 µs).
    // SAFETY: prctl on the calling thread with plain integer arguments.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    while let Some(Job {
        op,
        progress,
        stop,
        queued,
    }) = next_op(&rx)
    {
        let fault = progress.run(op, &stop);
        if let Some(q) = queued {
            *q.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        }
        let mut st = progress.state.lock().unwrap_or_else(|e| e.into_inner());
        st.completed += 1;
        progress.outstanding.fetch_sub(1, Ordering::Release);
        if st.fault.is_none() {
            st.fault = fault;
        }
        progress.cv.notify_all();
    }
}

impl HostStream {
    /// A stream with a worker of its own.
    fn spawn(name: String) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Job>();
        let worker = std::thread::Builder::new()
            .name(name)
            .spawn(move || work(rx))?;
        Ok(HostStream {
            tx: Mutex::new(Some(tx)),
            progress: Arc::default(),
            shutdown: Arc::default(),
            worker: Mutex::new(Some(worker)),
            shared: None,
        })
    }

    /// A new stream: on the next of `queues` in turn (`turn` counts the streams placed), or
    /// with a worker of its own where there are none.
    pub fn create(name: String, queues: &[SharedQueue], turn: &AtomicU64) -> std::io::Result<Self> {
        match queues.len() {
            0 => Self::spawn(name),
            n => Ok(Self::on_queue(
                &queues[turn.fetch_add(1, Ordering::Relaxed) as usize % n],
            )),
        }
    }

    /// A stream whose ops run on `queue`, in order with its other streams' ops.
    fn on_queue(queue: &SharedQueue) -> Self {
        HostStream {
            tx: Mutex::new(Some(queue.tx.clone())),
            progress: Arc::default(),
            shutdown: Arc::default(),
            worker: Mutex::new(None),
            shared: Some(queue.queued.clone()),
        }
    }

    /// Enqueues an op. Returns false if the stream is shutting down.
    ///
    /// Fast path: when the stream is idle and the op is cheap and cannot block (a small copy or
    /// memset, an event record, a value write, a wait that is already satisfied), it runs right
    /// here — so does a copy or memset of any size where the job has fewer than two cores per
    /// rank ([`inline_max`]). Order is kept — nothing is queued ahead of it, and the queue
    /// lock is held so no other op can slip in — and a worker-thread hand-off (a futex wake
    /// and a poll) is saved, which is most of a small message's latency on a busy host.
    pub fn push(&self, op: Op) -> bool {
        self.push_inline_up_to(op, inline_max())
    }

    /// [`HostStream::push`] with the inline limit given (tests drive both paths).
    fn push_inline_up_to(&self, op: Op, inline_limit: usize) -> bool {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = tx.as_ref() else { return false };
        let mut st = self
            .progress
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // On a shared queue the stream being idle says nothing about the ops ahead in the
        // queue: the queue must be empty too, and stays so while its lock is held.
        let queued = self
            .shared
            .as_ref()
            .map(|q| q.lock().unwrap_or_else(|e| e.into_inner()));
        let queue_idle = queued.as_ref().map_or(true, |n| **n == 0);
        if st.completed == st.submitted && queue_idle && inline_ok(&op, inline_limit) {
            // Runs under the progress lock (and the queue's): the worker is idle (its queue is
            // empty) and will not look at this op.
            let fault = self.progress.run(op, &self.shutdown);
            if st.fault.is_none() {
                st.fault = fault;
            }
            return true;
        }
        // Counted before the job is sent (the worker counts it down once run).
        let mut queued = queued;
        if let Some(n) = queued.as_mut() {
            **n += 1;
        }
        st.submitted += 1;
        self.progress.outstanding.fetch_add(1, Ordering::Relaxed);
        drop(st);
        let job = Job {
            op,
            progress: self.progress.clone(),
            stop: self.shutdown.clone(),
            queued: self.shared.clone(),
        };
        let sent = tx.send(job);
        if let (Some(n), true) = (queued.as_mut(), sent.is_err()) {
            **n -= 1;
        }
        drop(queued);
        if sent.is_err() {
            let mut st = self
                .progress
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            st.submitted -= 1;
            self.progress.outstanding.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Why a copy of this stream failed, if one did (sticky: see `Progress::broken`).
    pub fn broken(&self) -> Option<&str> {
        self.progress.broken()
    }

    /// True when every submitted op has completed (an op a concurrent [`HostStream::push`]
    /// runs inline is not counted: that push has not returned).
    pub fn idle(&self) -> bool {
        self.progress.outstanding.load(Ordering::Acquire) == 0
    }

    /// Waits for every op submitted so far; returns the first host-function fault, if any.
    pub fn synchronize(&self) -> Option<String> {
        let mut st = self
            .progress
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let target = st.submitted;
        while st.completed < target {
            st = self.progress.cv.wait(st);
        }
        st.fault.take()
    }

    /// Stops accepting work; the worker finishes what is queued and exits. With `abandon`,
    /// pending value waits give up instead of blocking forever.
    pub fn close(&self, abandon: bool) {
        if abandon {
            self.shutdown.store(true, Ordering::Release);
        }
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    /// Closes and joins the worker (on a shared queue: waits until the stream's ops ran).
    pub fn join(&self, abandon: bool) {
        self.close(abandon);
        match self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(h) if h.thread().id() != std::thread::current().id() => {
                let _ = h.join();
            }
            Some(_) => {}
            None if self.shared.is_some() => {
                self.synchronize();
            }
            None => {}
        }
    }
}

/// Rung whenever this process writes a value a stream wait may watch (stream write-value ops and
/// `host_write_value32`), so waiting workers wake at once instead of at their next poll.
static DOORBELL: (Mutex<u64>, QuietCondvar) = (Mutex::new(0), QuietCondvar::new());

/// Wakes every stream wait-value worker of this process to re-check its word.
pub(crate) fn ring_doorbell() {
    let mut g = DOORBELL.0.lock().unwrap_or_else(|e| e.into_inner());
    *g = g.wrapping_add(1);
    DOORBELL.1.notify_all();
}

/// Overrides the largest copy or memset run inline on an idle stream ([`inline_max`]): a byte
/// count with an optional `K`/`M`/`G` suffix.
pub const INLINE_MAX_ENV: &str = "FLAGCX_HOST_INLINE_MAX";

/// The largest copy or memset run inline where each rank has cores to spare: about what a
/// worker's wake-up costs in copying time, so larger ones are better off beside the caller.
const INLINE_SMALL: usize = 64 << 10;

/// The largest copy or memset run inline on an idle stream ([`inline_max_from`]).
fn inline_max() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        inline_max_from(
            std::env::var(INLINE_MAX_ENV).ok().as_deref(),
            flagcx_adaptor::spin::cores_from_env(),
            flagcx_adaptor::spin::ranks_from_env(),
        )
    })
}

/// The inline limit for `ranks` processes on `cores` (ranks 1: unknown): the variable's size
/// if it parses; else any size where the job has fewer than two cores per rank, and
/// [`INLINE_SMALL`] otherwise.
///
/// With fewer than two cores per rank a worker thread cannot run beside its rank's posting
/// and progress threads: a copy handed to it waits for a core the caller already holds, then
/// pays a wake-up and two context switches. So the caller copies itself, as an MPI library's
/// progressing thread does. Four host ranks on 2 cores, all-to-all, three alternating runs:
/// 267–307 µs against 351–410 µs at 1 MiB (Open MPI 272–392 µs in the same runs), 828–939
/// against 934–1195 µs at 4 MiB. With cores to spare the worker runs in parallel and the
/// caller (the engine, driving other pairs) is not held up for the copy's length.
fn inline_max_from(env: Option<&str>, cores: usize, ranks: usize) -> usize {
    if let Some(n) = env.and_then(|v| crate::copy::parse_size(v.trim())) {
        return n;
    }
    if ranks > 1 && cores < 2 * ranks {
        usize::MAX
    } else {
        INLINE_SMALL
    }
}

/// Whether `op` may run on the posting thread of an idle stream: never blocking, and cheap
/// (or a copy the caller is better off running itself: [`inline_max`]).
fn inline_ok(op: &Op, max: usize) -> bool {
    match op {
        Op::Copy { n, .. } | Op::Memset { n, .. } => *n <= max,
        Op::SizedCopy { cap, .. } => *cap <= max,
        Op::Reduce { count, dtype, .. } => count.saturating_mul(dtype.size()) <= max,
        Op::Record { .. } | Op::WriteValue { .. } => true,
        Op::Remote { n, .. } => *n <= max,
        Op::WaitEvent { event, gen } => event.reached(*gen),
        Op::WaitValue {
            addr,
            value,
            wide,
            cond,
        } => value_holds(*addr, *value, *wide, *cond),
        Op::HostFn(_) => false,
    }
}

fn value_holds(addr: u64, value: u64, wide: bool, cond: WaitCondition) -> bool {
    if wide {
        // SAFETY: the adaptor checked the address (aligned, device-visible, alive) at enqueue.
        let cur = unsafe { &*(addr as *const AtomicU64) }.load(Ordering::Acquire);
        cond.holds64(cur, value)
    } else {
        // SAFETY: as above, 4-byte aligned.
        let cur = unsafe { &*(addr as *const AtomicU32) }.load(Ordering::Acquire);
        cond.holds32(cur, value as u32)
    }
}

/// How long a stream waiting on a value spins before sleeping on the doorbell: `FLAGCX_SPIN_US`
/// if it is valid, else the shared rule for the ranks `flagcx-run` announced
/// ([`flagcx_adaptor::spin::default_spin`]).
fn wait_spin() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        use flagcx_adaptor::spin;
        match spin::spin_from_env() {
            Some(Ok(d)) => d,
            _ => spin::default_spin(spin::ranks_from_env()),
        }
    })
}

/// Runs one op on the worker; returns a fault description if a host function panicked.
fn run(op: Op, stop: &AtomicBool) -> Option<String> {
    match op {
        Op::Copy { dst, src, n } => {
            // SAFETY: the adaptor checked both ranges when the op was enqueued, and the unsafe
            // contract of the copy call keeps them valid until the op completes.
            unsafe { copy_bytes(dst, src, n) }
        }
        Op::Memset { dst, value, n } => {
            // SAFETY: as for Copy.
            unsafe { std::ptr::write_bytes(dst as *mut u8, value, n) }
        }
        Op::SizedCopy {
            dst,
            src,
            len_at,
            cap,
        } => {
            // SAFETY: the adaptor checked that `len_at` is an aligned live word and both
            // `cap`-byte ranges are valid; the caller's contract keeps them so until now.
            let n = unsafe { &*(len_at as *const AtomicU64) }.load(Ordering::Acquire);
            if n <= cap as u64 {
                // SAFETY: `n <= cap`, inside the checked ranges.
                unsafe { copy_bytes(dst, src, n as usize) }
            }
        }
        Op::Reduce {
            dst,
            a,
            b,
            count,
            dtype,
            step,
        } => {
            // SAFETY: the adaptor checked the ranges (inside live allocations, `dst` equal to
            // or disjoint from each input) and the step when the op was enqueued; the caller's
            // contract keeps them valid until the op completes.
            unsafe { crate::copy::reduce_split(dst, a, b, count, dtype, step) }
        }
        Op::HostFn(f) => {
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic".into());
                return Some(format!("host function panicked: {msg}"));
            }
        }
        Op::Record { event, gen } => event.complete(gen),
        Op::WaitEvent { event, gen } => event.wait(gen),
        Op::WaitValue {
            addr,
            value,
            wide,
            cond,
        } => {
            let mut spins = 0u32;
            let t0 = Instant::now();
            let spin = wait_spin();
            while !spin.is_zero() && t0.elapsed() < spin {
                if value_holds(addr, value, wide, cond) {
                    return None;
                }
                flagcx_adaptor::spin::relax();
            }
            loop {
                // Read the doorbell before the word, so a ring between the check and the wait
                // below is not lost.
                let rung = *DOORBELL.0.lock().unwrap_or_else(|e| e.into_inner());
                if value_holds(addr, value, wide, cond) || stop.load(Ordering::Acquire) {
                    break;
                }
                spins = spins.saturating_add(1);
                if spins < 64 {
                    flagcx_adaptor::spin::relax();
                    continue;
                }
                // Writes by other processes (or plain stores) do not ring: poll every 50 µs.
                let g = DOORBELL.0.lock().unwrap_or_else(|e| e.into_inner());
                if *g == rung {
                    let _ = DOORBELL.1.wait_timeout(g, Duration::from_micros(50));
                }
            }
        }
        Op::Remote {
            way,
            pid,
            local,
            remote,
            n,
        } => {
            // SAFETY: the adaptor checked the local range when the op was enqueued and the
            // copy call's contract keeps it valid until now; the kernel checks the remote one.
            if let Err(e) = unsafe { cma::copy(way, pid, local, remote, n) } {
                return Some(e.to_string());
            }
        }
        Op::WriteValue { addr, value, wide } => {
            if wide {
                // SAFETY: as for WaitValue.
                unsafe { &*(addr as *const AtomicU64) }.store(value, Ordering::Release);
            } else {
                // SAFETY: as for WaitValue.
                unsafe { &*(addr as *const AtomicU32) }.store(value as u32, Ordering::Release);
            }
            ring_doorbell();
        }
    }
    None
}

/// An event's generations and the time its last recording completed.
#[derive(Default)]
pub(crate) struct EventState {
    inner: Mutex<EventInner>,
    cv: QuietCondvar,
    pub timing: bool,
}

#[derive(Default)]
struct EventInner {
    recorded: u64,
    completed: u64,
    at: Option<Instant>,
    /// A recording that completed behind a failed copy of its stream, and why.
    broken: Option<(u64, String)>,
}

impl EventState {
    pub fn new(timing: bool) -> Self {
        EventState {
            timing,
            ..Default::default()
        }
    }

    /// Starts a new recording; returns its generation.
    pub fn begin_record(&self) -> u64 {
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        st.recorded += 1;
        st.recorded
    }

    fn complete(&self, gen: u64) {
        self.finish(gen, None)
    }

    /// Completes recording `gen` behind a failed copy of its stream (see `Progress::broken`).
    fn complete_broken(&self, gen: u64, why: &str) {
        self.finish(gen, Some(why))
    }

    fn finish(&self, gen: u64, broken: Option<&str>) {
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if gen > st.completed {
            st.completed = gen;
            st.at = Some(Instant::now());
            if let Some(why) = broken {
                st.broken = Some((gen, why.to_string()));
            }
        }
        self.cv.notify_all();
    }

    /// Whether the last recording completed (`Ok`), or why it completed behind a failed copy
    /// of its stream (`Err`).
    pub fn outcome(&self) -> Result<bool, String> {
        let st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match &st.broken {
            _ if st.completed < st.recorded => Ok(false),
            Some((gen, why)) if *gen == st.recorded => Err(why.clone()),
            _ => Ok(true),
        }
    }

    /// The generation a waiter must see: the last recording at this moment.
    pub fn last_recorded(&self) -> u64 {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .recorded
    }

    /// Whether generation `gen` has completed.
    pub fn reached(&self, gen: u64) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .completed
            >= gen
    }

    /// Blocks until generation `gen` has completed.
    pub fn wait(&self, gen: u64) {
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        while st.completed < gen {
            st = self.cv.wait(st);
        }
    }

    /// When the last recording completed, if it has and it is the last one.
    pub fn completed_at(&self) -> Option<Instant> {
        let st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (st.recorded > 0 && st.completed >= st.recorded)
            .then_some(st.at)
            .flatten()
    }
}

#[cfg(test)]
mod tests;
