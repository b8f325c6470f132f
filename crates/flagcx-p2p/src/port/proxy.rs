//! The port proxy: one thread per communicator that polls every port channel's FIFO, executes
//! its triggers in order on the channel's stream, and poisons channels whose peer is gone.
//!
//! It is its own thread rather than a duty of the point-to-point engine: a kernel's trigger
//! must be picked up within microseconds even while the engine waits on a copy or a peer, and
//! the thread binds to the device's NUMA node (the control blocks it polls are host memory the
//! device writes over the bus).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flagcx_adaptor::{DeviceAdaptor, DevicePtr};

use super::{
    unpack_trigger, Channel, PortStatus, ACTIVE_WINDOW, FLUSHED_OFF, OP_FLUSH, OP_PUT,
    OP_PUT_WITH_SIGNAL, OP_SIGNAL, TAIL_OFF, TRIGGERS_OFF, TRIGGER_BYTES,
};
use crate::engine::{hung_up, lock};
use crate::error::{CommError, Result};

/// How often a channel's peer is checked for death.
const HEALTH_EVERY: Duration = Duration::from_millis(1);
/// How long the idle proxy sleeps between polls.
const NAP: Duration = Duration::from_micros(200);
/// Triggers taken from one FIFO before the next is looked at.
const BATCH: usize = 64;

enum Cmd<A: DeviceAdaptor> {
    Add(Arc<Channel<A>>, Option<Vec<usize>>),
    Remove(u64, Sender<Result<()>>),
}

/// The handle to a communicator's port proxy thread.
pub(crate) struct PortProxy<A: DeviceAdaptor> {
    tx: Mutex<Option<Sender<Cmd<A>>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    rank: usize,
    ids: AtomicU64,
}

impl<A: DeviceAdaptor> PortProxy<A> {
    pub fn new(rank: usize) -> Self {
        PortProxy {
            tx: Mutex::new(None),
            thread: Mutex::new(None),
            rank,
            ids: AtomicU64::new(1),
        }
    }

    pub fn next_id(&self) -> u64 {
        self.ids.fetch_add(1, Ordering::Relaxed)
    }

    fn send(&self, cmd: Cmd<A>) -> Result<()> {
        let mut tx = lock(&self.tx);
        if tx.is_none() {
            let (t, rx) = mpsc::channel();
            let h = std::thread::Builder::new()
                .name(format!("flagcx-port-{}", self.rank))
                .spawn(move || run(rx))
                .map_err(|e| CommError::io("spawn port proxy thread", e))?;
            *tx = Some(t);
            *lock(&self.thread) = Some(h);
        }
        let sent = tx.as_ref().map(|t| t.send(cmd).is_ok()).unwrap_or(false);
        if let Some(h) = lock(&self.thread).as_ref() {
            h.thread().unpark();
        }
        if sent {
            Ok(())
        } else {
            Err(CommError::Protocol("the port proxy thread is gone".into()))
        }
    }

    /// Hands a channel to the thread; `cpus` is where the thread should run (the first
    /// channel's device's NUMA node).
    pub fn add(&self, ch: Arc<Channel<A>>, cpus: Option<Vec<usize>>) -> Result<()> {
        self.send(Cmd::Add(ch, cpus))
    }

    /// Takes a channel back: the thread stops polling it and waits for its stream.
    pub fn remove(&self, id: u64) -> Result<()> {
        let (t, rx) = mpsc::channel();
        self.send(Cmd::Remove(id, t))?;
        rx.recv_timeout(Duration::from_secs(30)).map_err(|_| {
            CommError::Protocol("the port proxy did not release the channel in 30 s".into())
        })?
    }
}

impl<A: DeviceAdaptor> Drop for PortProxy<A> {
    fn drop(&mut self) {
        // Every channel holds the proxy, so none is left: closing the sender ends the thread.
        lock(&self.tx).take();
        if let Some(h) = lock(&self.thread).take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

/// A channel as the thread sees it.
struct Active<A: DeviceAdaptor> {
    ch: Arc<Channel<A>>,
    tail: u64,
    signals: u64,
    failed: bool,
    checked: Instant,
}

fn run<A: DeviceAdaptor>(rx: Receiver<Cmd<A>>) {
    let mut chans: Vec<Active<A>> = Vec::new();
    let mut last_work = Instant::now();
    let mut bound = false;
    loop {
        loop {
            match rx.try_recv() {
                Ok(cmd) => handle(cmd, &mut chans, &mut bound),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        let mut work = false;
        let now = Instant::now();
        for a in chans.iter_mut() {
            work |= a.step();
            if now.duration_since(a.checked) >= HEALTH_EVERY {
                a.checked = now;
                a.check_health();
            }
        }
        if work {
            last_work = Instant::now();
        }
        if !chans.is_empty() && last_work.elapsed() < ACTIVE_WINDOW {
            flagcx_adaptor::spin::relax();
            continue;
        }
        match rx.recv_timeout(NAP) {
            Ok(cmd) => {
                handle(cmd, &mut chans, &mut bound);
                last_work = Instant::now();
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

fn handle<A: DeviceAdaptor>(cmd: Cmd<A>, chans: &mut Vec<Active<A>>, bound: &mut bool) {
    match cmd {
        Cmd::Add(ch, cpus) => {
            if let (false, Some(cpus)) = (*bound, cpus) {
                *bound = crate::numa::bind_current_thread(&cpus);
            }
            chans.push(Active {
                ch,
                tail: 0,
                signals: 0,
                failed: false,
                checked: Instant::now(),
            });
        }
        Cmd::Remove(id, reply) => {
            let r = match chans.iter().position(|a| a.ch.id == id) {
                Some(i) => {
                    let mut a = chans.swap_remove(i);
                    // Triggers already in the FIFO were asked for before the close (a
                    // kernel's last signal): they still run (at most a ring's worth: device
                    // code still writing triggers now breaks close's contract).
                    for _ in 0..=a.ch.depth / BATCH + 1 {
                        if !a.step() {
                            break;
                        }
                    }
                    a.ch.adaptor
                        .stream_synchronize(a.ch.stream)
                        .map_err(CommError::from)
                }
                None => Ok(()),
            };
            let _ = reply.send(r);
        }
    }
}

impl<A: DeviceAdaptor> Active<A> {
    /// Takes and executes the triggers that are ready; whether there were any.
    fn step(&mut self) -> bool {
        if self.failed {
            return false;
        }
        let mut n = 0;
        while n < BATCH {
            let Some(w) = self.take() else { break };
            if let Err((code, e)) = self.execute(w, self.tail) {
                self.failed = true;
                self.ch.poison(code, e);
                return true;
            }
            n += 1;
        }
        if n > 0 {
            self.ch.triggers_done.fetch_add(n as u64, Ordering::Relaxed);
        }
        n > 0
    }

    /// The next trigger's first three words, if its slot is marked valid; frees the slot.
    fn take(&mut self) -> Option<[u64; 3]> {
        let c = &self.ch.control;
        let slot = TRIGGERS_OFF + (self.tail % self.ch.depth as u64) * TRIGGER_BYTES as u64;
        if c.word(slot + 24).load(Ordering::Acquire) != self.tail + 1 {
            return None;
        }
        let w = [0, 8, 16].map(|o| c.word(slot + o).load(Ordering::Relaxed));
        self.tail += 1;
        // The slot's contents are copied: the device may reuse it.
        c.word(TAIL_OFF).store(self.tail, Ordering::Release);
        Some(w)
    }

    fn execute(
        &mut self,
        w: [u64; 3],
        seq: u64,
    ) -> std::result::Result<(), (PortStatus, CommError)> {
        let ch = &*self.ch;
        let (op, sb, db, size) = unpack_trigger(w[2]);
        let vendor = |e: flagcx_adaptor::AdaptorError| (PortStatus::DeviceError, e.into());
        match op {
            OP_PUT | OP_PUT_WITH_SIGNAL => {
                let src = range(&ch.local, sb, w[0], size, "source")?;
                let dst = range(&ch.remote, db, w[1], size, "destination")?;
                if size > 0 {
                    // SAFETY: both ranges were checked against the registered buffers (ours
                    // live while the channel names them; the peer's stay mapped until close).
                    unsafe {
                        ch.adaptor
                            .memcpy_d2d_async(dst, src, size as usize, ch.stream)
                            .map_err(vendor)?
                    };
                    ch.bytes_put.fetch_add(size, Ordering::Relaxed);
                }
                if op == OP_PUT_WITH_SIGNAL {
                    self.signal()?;
                }
            }
            OP_SIGNAL => self.signal()?,
            OP_FLUSH => {
                // SAFETY: `flushed` is an aligned word of our registered control block.
                unsafe {
                    ch.adaptor
                        .stream_write_value64(
                            ch.stream,
                            DevicePtr(ch.control.device.0 + FLUSHED_OFF),
                            seq,
                        )
                        .map_err(vendor)?
                };
            }
            _ => {
                return Err((
                    PortStatus::BadTrigger,
                    CommError::InvalidArgument(format!("port trigger {seq}: unknown op {op}")),
                ))
            }
        }
        Ok(())
    }

    fn signal(&mut self) -> std::result::Result<(), (PortStatus, CommError)> {
        self.signals += 1;
        // SAFETY: the peer's flag is an aligned device word mapped until close.
        unsafe {
            self.ch
                .adaptor
                .stream_write_value64(self.ch.stream, self.ch.peer_flag, self.signals)
        }
        .map_err(|e| (PortStatus::DeviceError, e.into()))
    }

    /// Poisons the channel if its peer died or the communicator was aborted.
    fn check_health(&mut self) {
        if self.failed {
            return;
        }
        let ch = &*self.ch;
        let peer = ch.peer;
        if ch.shared.aborted.load(Ordering::Acquire) {
            self.failed = true;
            ch.poison(PortStatus::Closed, CommError::Aborted);
            return;
        }
        let lost = ch.shared.lost[peer].load(Ordering::Acquire)
            || ch.boot.peer_fd(peer).is_some_and(hung_up);
        if lost {
            self.failed = true;
            ch.poison(
                PortStatus::PeerLost,
                CommError::PeerLost {
                    peer,
                    reason: "the process exited or closed its communicator (port channel)".into(),
                },
            );
        }
    }
}

/// `(address, len)` of `size` bytes at `off` in buffer `i` of `bufs`, checked.
fn range(
    bufs: &[(DevicePtr, usize)],
    i: usize,
    off: u64,
    size: u64,
    what: &str,
) -> std::result::Result<DevicePtr, (PortStatus, CommError)> {
    match bufs.get(i) {
        Some(&(p, len)) if off.checked_add(size).is_some_and(|e| e <= len as u64) => {
            Ok(DevicePtr(p.0 + off))
        }
        Some(&(_, len)) => Err((
            PortStatus::BadTrigger,
            CommError::InvalidArgument(format!(
                "port trigger: {size} bytes at offset {off} of {what} buffer {i} run past its \
                 {len} bytes"
            )),
        )),
        None => Err((
            PortStatus::BadTrigger,
            CommError::InvalidArgument(format!(
                "port trigger names {what} buffer {i}, but the channel has {}",
                bufs.len()
            )),
        )),
    }
}
