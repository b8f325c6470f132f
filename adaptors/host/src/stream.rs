//! Host-vendor streams and events: one worker thread per stream runs its operations in order.
//!
//! A stream is a FIFO of [`Op`]s and a thread that drains it; "submitted" and "completed"
//! counters answer query/synchronize. An event is a pair of generation counters: recording bumps
//! the recorded generation and enqueues an op that, when the stream reaches it, marks that
//! generation complete — exactly the "last recording" semantics of CUDA events.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flagcx_adaptor::{HostFn, WaitCondition};

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
}

/// Progress shared between a stream's owner and its worker.
#[derive(Default)]
pub(crate) struct Progress {
    state: Mutex<ProgressInner>,
    cv: Condvar,
}

#[derive(Default)]
struct ProgressInner {
    submitted: u64,
    completed: u64,
    /// The first host function that panicked, reported by synchronize.
    fault: Option<String>,
}

/// A live stream: its queue, its counters and its worker.
pub(crate) struct HostStream {
    tx: Mutex<Option<Sender<Op>>>,
    progress: Arc<Progress>,
    shutdown: Arc<AtomicBool>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl HostStream {
    pub fn spawn(name: String) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Op>();
        let progress = Arc::new(Progress::default());
        let shutdown = Arc::new(AtomicBool::new(false));
        let (p, stop) = (progress.clone(), shutdown.clone());
        let worker = std::thread::Builder::new().name(name).spawn(move || {
            // Keep back-off naps short (default timer slack is 50 µs).
            // SAFETY: prctl on the calling thread with plain integer arguments.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
            for op in rx {
                let fault = run(op, &stop);
                let mut st = p.state.lock().unwrap_or_else(|e| e.into_inner());
                st.completed += 1;
                if st.fault.is_none() {
                    st.fault = fault;
                }
                p.cv.notify_all();
            }
        })?;
        Ok(HostStream {
            tx: Mutex::new(Some(tx)),
            progress,
            shutdown,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// Enqueues an op. Returns false if the stream is shutting down.
    pub fn push(&self, op: Op) -> bool {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = tx.as_ref() else { return false };
        let mut st = self
            .progress
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        st.submitted += 1;
        drop(st);
        if tx.send(op).is_err() {
            let mut st = self
                .progress
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            st.submitted -= 1;
            return false;
        }
        true
    }

    /// True when every submitted op has completed.
    pub fn idle(&self) -> bool {
        let st = self
            .progress
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        st.completed == st.submitted
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
            st = self.progress.cv.wait(st).unwrap_or_else(|e| e.into_inner());
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

    /// Closes and joins the worker.
    pub fn join(&self, abandon: bool) {
        self.close(abandon);
        if let Some(h) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

/// Runs one op on the worker; returns a fault description if a host function panicked.
fn run(op: Op, stop: &AtomicBool) -> Option<String> {
    match op {
        Op::Copy { dst, src, n } => {
            // SAFETY: the adaptor checked both ranges when the op was enqueued, and the unsafe
            // contract of the copy call keeps them valid until the op completes. `copy` allows
            // overlap (memmove), as a device copy within one buffer may.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) }
        }
        Op::Memset { dst, value, n } => {
            // SAFETY: as for Copy.
            unsafe { std::ptr::write_bytes(dst as *mut u8, value, n) }
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
            loop {
                let ok = if wide {
                    // SAFETY: checked aligned, device-visible and kept alive by the caller.
                    let cur = unsafe { &*(addr as *const AtomicU64) }.load(Ordering::Acquire);
                    cond.holds64(cur, value)
                } else {
                    // SAFETY: as above, 4-byte aligned.
                    let cur = unsafe { &*(addr as *const AtomicU32) }.load(Ordering::Acquire);
                    cond.holds32(cur, value as u32)
                };
                if ok || stop.load(Ordering::Acquire) {
                    break;
                }
                backoff(&mut spins);
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
        }
    }
    None
}

/// Spin briefly, then yield, then sleep: fast hand-offs without burning a core when idle.
pub(crate) fn backoff(spins: &mut u32) {
    *spins = spins.saturating_add(1);
    if *spins < 256 {
        std::hint::spin_loop();
    } else if *spins < 1024 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// An event's generations and the time its last recording completed.
#[derive(Default)]
pub(crate) struct EventState {
    inner: Mutex<EventInner>,
    cv: Condvar,
    pub timing: bool,
}

#[derive(Default)]
struct EventInner {
    recorded: u64,
    completed: u64,
    at: Option<Instant>,
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
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if gen > st.completed {
            st.completed = gen;
            st.at = Some(Instant::now());
        }
        self.cv.notify_all();
    }

    /// The generation a waiter must see: the last recording at this moment.
    pub fn last_recorded(&self) -> u64 {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .recorded
    }

    /// Blocks until generation `gen` has completed.
    pub fn wait(&self, gen: u64) {
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        while st.completed < gen {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// True when the last recording has completed.
    pub fn done(&self) -> bool {
        let st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        st.completed >= st.recorded
    }

    /// When the last recording completed, if it has and it is the last one.
    pub fn completed_at(&self) -> Option<Instant> {
        let st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (st.recorded > 0 && st.completed >= st.recorded)
            .then_some(st.at)
            .flatten()
    }
}
