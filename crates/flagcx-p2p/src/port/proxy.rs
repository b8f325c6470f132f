//! The port proxy: one thread per communicator that polls every port channel's FIFO, executes
//! its triggers in order on the channel's stream, and poisons channels whose peer is gone.
//!
//! It is its own thread rather than a duty of the point-to-point engine: a kernel's trigger
//! must be picked up within microseconds even while the engine waits on a copy or a peer, and
//! the thread binds to the device's NUMA node (the control blocks it polls are host memory the
//! device writes over the bus).
//!
//! With `FLAGCX_TIMEOUT_MS` set, a second thread guards it as [`crate::guard`] guards the
//! engine: the proxy counts its passes, and when none ends for the timeout (at least
//! [`MIN_WINDOW`]) while channels are open — the proxy is blocked inside a vendor call — the
//! guard fails every channel from outside with no vendor call of its own
//! ([`Channel::mark_failed`]): the status word that every device-side wait checks, the error
//! [`super::PortChannel::check`] returns, and on a staged pair the peer's lane. Once the proxy
//! returns it stops executing those channels and writes the flags itself.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flagcx_adaptor::{DeviceAdaptor, DevicePtr};

use super::lane::{Pending, SLOTS};
use super::{
    unpack_trigger, Channel, PortStatus, ACTIVE_WINDOW, FLAG_OFF, FLUSHED_OFF, OP_FLUSH, OP_PUT,
    OP_PUT_VALUE, OP_PUT_VALUE_WITH_SIGNAL, OP_PUT_WITH_SIGNAL, OP_SIGNAL, TAIL_OFF, TRIGGERS_OFF,
    TRIGGER_BYTES,
};
use crate::bootstrap::hung_up;
use crate::error::{CommError, Result};
use crate::guard::{Stall, MIN_WINDOW};
use flagcx_adaptor::tracking::lock;

/// How often a channel's peer is checked for death.
const HEALTH_EVERY: Duration = Duration::from_millis(1);
/// How long the idle proxy sleeps between polls.
const NAP: Duration = Duration::from_micros(200);
/// Triggers taken from one FIFO before the next is looked at.
const BATCH: usize = 64;

enum Cmd<A: DeviceAdaptor> {
    Add(Arc<Channel<A>>, Option<Vec<usize>>),
    Remove(u64, Sender<Result<()>>),
    Retire(u64, Option<u64>, Sender<Result<()>>),
}

/// How long a closing channel may wait for its last triggers (or the peer's last chunks).
const CLOSE_LIMIT: Duration = Duration::from_secs(20);

/// What the stall guard watches: the proxy's passes, and every channel handed to the proxy
/// and not yet dropped by it.
struct Watch<A: DeviceAdaptor> {
    beats: AtomicU64,
    chans: Mutex<Vec<Arc<Channel<A>>>>,
    stop: AtomicBool,
}

impl<A: DeviceAdaptor> Watch<A> {
    /// Stops watching channel `id`: the proxy dropped it (before it answers the close, so
    /// that the closing side is the channel's only owner), or it never reached the proxy.
    fn forget(&self, id: u64) {
        lock(&self.chans).retain(|c| c.id != id);
    }
}

/// The handle to a communicator's port proxy thread.
pub(crate) struct PortProxy<A: DeviceAdaptor> {
    tx: Mutex<Option<Sender<Cmd<A>>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    guard: Mutex<Option<JoinHandle<()>>>,
    watch: Arc<Watch<A>>,
    /// `FLAGCX_TIMEOUT_MS`: with it, a guard thread watches the proxy.
    timeout: Option<Duration>,
    rank: usize,
    ids: AtomicU64,
}

impl<A: DeviceAdaptor> PortProxy<A> {
    /// A proxy for `rank`'s channels, started with the first one; guarded where `timeout` is
    /// set.
    pub fn new(rank: usize, timeout: Option<Duration>) -> Self {
        PortProxy {
            tx: Mutex::new(None),
            thread: Mutex::new(None),
            guard: Mutex::new(None),
            watch: Arc::new(Watch {
                beats: AtomicU64::new(0),
                chans: Mutex::new(Vec::new()),
                stop: AtomicBool::new(false),
            }),
            timeout,
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
            let watch = self.watch.clone();
            let h = std::thread::Builder::new()
                .name(format!("flagcx-port-{}", self.rank))
                .spawn(move || run(rx, &watch))
                .map_err(|e| CommError::io("spawn port proxy thread", e))?;
            *tx = Some(t);
            *lock(&self.thread) = Some(h);
            if let Some(timeout) = self.timeout {
                let (watch, rank) = (self.watch.clone(), self.rank);
                let g = std::thread::Builder::new()
                    .name(format!("flagcx-port-guard-{rank}"))
                    .spawn(move || guard(&watch, timeout.max(MIN_WINDOW), rank))
                    .map_err(|e| CommError::io("spawn port guard thread", e))?;
                *lock(&self.guard) = Some(g);
            }
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
        let id = ch.id;
        // Watched from now: a proxy blocked before it takes the channel fails it too.
        lock(&self.watch.chans).push(ch.clone());
        let r = self.send(Cmd::Add(ch, cpus));
        if r.is_err() {
            self.watch.forget(id);
        }
        r
    }

    /// Stops a channel's outbound side: the triggers already in its FIFO run (on a staged
    /// pair, until their last chunk is published), then its stream is synchronized. An IPC
    /// channel is then dropped; a staged one keeps receiving until [`Self::retire`].
    pub fn remove(&self, id: u64) -> Result<()> {
        self.ask(|t| Cmd::Remove(id, t))
    }

    /// Drops a staged channel once `until` chunks of the peer arrived (`None`: at once; the
    /// peer said no goodbye) and its streams are synchronized.
    pub fn retire(&self, id: u64, until: Option<u64>) -> Result<()> {
        self.ask(|t| Cmd::Retire(id, until, t))
    }

    fn ask(&self, cmd: impl FnOnce(Sender<Result<()>>) -> Cmd<A>) -> Result<()> {
        let (t, rx) = mpsc::channel();
        self.send(cmd(t))?;
        rx.recv_timeout(CLOSE_LIMIT + Duration::from_secs(10))
            .map_err(|_| {
                CommError::Protocol("the port proxy did not release the channel in 30 s".into())
            })?
    }
}

impl<A: DeviceAdaptor> Drop for PortProxy<A> {
    fn drop(&mut self) {
        // The guard makes no call that blocks: it ends at its next look.
        self.watch.stop.store(true, Ordering::Release);
        if let Some(g) = lock(&self.guard).take() {
            g.thread().unpark();
            let _ = g.join();
        }
        // Every channel holds the proxy, so none is left: closing the sender ends the thread.
        lock(&self.tx).take();
        if let Some(h) = lock(&self.thread).take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

type Failure = (PortStatus, CommError);
/// A reply to `remove` or `retire`, and what it says.
type Answer = (Sender<Result<()>>, Result<()>);

/// A channel as the thread sees it.
struct Active<A: DeviceAdaptor> {
    ch: Arc<Channel<A>>,
    tail: u64,
    signals: u64,
    failed: bool,
    checked: Instant,
    /// Staged pairs: the put whose chunks are not all published, chunks published, chunks of
    /// the peer consumed, signals received, and whether the peer's side failed.
    pending: Option<Pending>,
    produced: u64,
    consumed: u64,
    received: u64,
    peer_failed: bool,
    /// `remove` asked: reply once the FIFO is drained.
    closing: Option<(Sender<Result<()>>, Instant)>,
    /// The FIFO is no longer read (after `remove`).
    outbound_closed: bool,
    /// `retire` asked: reply once the peer's chunks up to the count arrived.
    retiring: Option<(Option<u64>, Sender<Result<()>>, Instant)>,
}

/// The guard's thread body: until the proxy is dropped, fails every watched channel while
/// the proxy has taken no step for `window` with channels open. It keeps looking after it
/// fired, so a channel added while the proxy is still blocked fails as well.
fn guard<A: DeviceAdaptor>(watch: &Watch<A>, window: Duration, rank: usize) {
    let mut stall = Stall::new(window, watch.beats.load(Ordering::Relaxed));
    let mut last = Instant::now();
    loop {
        std::thread::park_timeout(stall.tick);
        if watch.stop.load(Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        let slept = now.duration_since(last);
        last = now;
        let chans = lock(&watch.chans);
        let beats = watch.beats.load(Ordering::Relaxed);
        let Some(stalled) = stall.look(beats, !chans.is_empty(), slept) else {
            continue;
        };
        for ch in chans.iter() {
            ch.mark_failed(
                PortStatus::DeviceError,
                CommError::Timeout {
                    ms: window.as_millis() as u64,
                    peer: Some(ch.peer),
                    what: format!(
                        "rank {rank}'s port proxy took no step for {} ms with channels open \
                         (blocked inside a vendor call); the channel is failed",
                        stalled.as_millis()
                    ),
                },
            );
        }
    }
}

fn run<A: DeviceAdaptor>(rx: Receiver<Cmd<A>>, watch: &Watch<A>) {
    let mut chans: Vec<Active<A>> = Vec::new();
    let mut last_work = Instant::now();
    let mut bound = false;
    loop {
        watch.beats.fetch_add(1, Ordering::Relaxed);
        loop {
            match rx.try_recv() {
                Ok(cmd) => handle(cmd, &mut chans, &mut bound),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        let mut work = false;
        let now = Instant::now();
        let mut i = 0;
        while i < chans.len() {
            let a = &mut chans[i];
            work |= a.step();
            if now.duration_since(a.checked) >= HEALTH_EVERY {
                a.checked = now;
                a.check_health();
            }
            work |= a.closing.is_some() || a.retiring.is_some();
            let (done, answer) = a.settle();
            if done {
                let gone = chans.swap_remove(i);
                watch.forget(gone.ch.id);
            } else {
                i += 1;
            }
            if let Some((reply, r)) = answer {
                let _ = reply.send(r);
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
                pending: None,
                produced: 0,
                consumed: 0,
                received: 0,
                peer_failed: false,
                closing: None,
                outbound_closed: false,
                retiring: None,
            });
        }
        Cmd::Remove(id, reply) => match chans.iter_mut().find(|a| a.ch.id == id) {
            Some(a) => a.closing = Some((reply, Instant::now())),
            None => {
                let _ = reply.send(Ok(()));
            }
        },
        Cmd::Retire(id, until, reply) => match chans.iter_mut().find(|a| a.ch.id == id) {
            Some(a) => a.retiring = Some((until, reply, Instant::now())),
            None => {
                let _ = reply.send(Ok(()));
            }
        },
    }
}

impl<A: DeviceAdaptor> Active<A> {
    /// Receives the peer's chunks (staged pairs), then takes and executes the triggers that
    /// are ready; whether anything happened.
    fn step(&mut self) -> bool {
        if self.failed {
            return false;
        }
        let status = self.ch.status();
        if status != PortStatus::Running {
            // Failed from outside this thread (the stall guard, or the application's
            // `poison`): execute nothing more, and write the flags the guard could not.
            self.failed = true;
            self.pending = None;
            self.ch.release_waiters(status);
            return true;
        }
        if self.peer_failed {
            return self.discard();
        }
        let mut work = false;
        if self.ch.staged.is_some() {
            match self.receive() {
                Ok(w) => work |= w,
                Err((code, e)) => return self.fail(code, e),
            }
            if self.peer_failed {
                return true;
            }
        }
        if self.outbound_closed {
            return work;
        }
        let mut n = 0;
        loop {
            if self.pending.is_some() {
                match self.push() {
                    Ok(moved) => work |= moved,
                    Err((code, e)) => return self.fail(code, e),
                }
                if self.pending.is_some() {
                    break; // waiting for the peer to free a slot
                }
            }
            if n == BATCH {
                break;
            }
            let Some(w) = self.take() else { break };
            if let Err((code, e)) = self.execute(w, self.tail) {
                return self.fail(code, e);
            }
            n += 1;
        }
        if n > 0 {
            self.ch.triggers_done.fetch_add(n as u64, Ordering::Relaxed);
        }
        work || n > 0
    }

    /// After the peer's side of a staged pair failed (its lane is poisoned, and it no longer
    /// frees slots): takes this FIFO's triggers without executing them, so a kernel that goes
    /// on triggering never waits for a slot forever; flushes still complete (nothing of ours
    /// is in flight any more), while waits for signals see the poisoned flag.
    fn discard(&mut self) -> bool {
        if self.outbound_closed {
            return false;
        }
        let mut n = 0;
        while n < BATCH {
            let Some(w) = self.take() else { break };
            if unpack_trigger(w[2]).0 == OP_FLUSH {
                let flushed = DevicePtr(self.ch.control.device.0 + FLUSHED_OFF);
                // SAFETY: `flushed` is an aligned word of our registered control block.
                let _ = unsafe {
                    self.ch
                        .adaptor
                        .stream_write_value64(self.ch.stream, flushed, self.tail)
                };
            }
            n += 1;
        }
        n > 0
    }

    fn fail(&mut self, code: PortStatus, e: CommError) -> bool {
        self.failed = true;
        self.pending = None;
        self.ch.poison(code, e);
        true
    }

    fn slot(&self) -> u64 {
        TRIGGERS_OFF + (self.tail % self.ch.depth as u64) * TRIGGER_BYTES as u64
    }

    /// Whether the next trigger's slot is marked valid.
    fn trigger_ready(&self) -> bool {
        self.ch
            .control
            .word(self.slot() + 24)
            .load(Ordering::Acquire)
            == self.tail + 1
    }

    /// The next trigger's first three words, if its slot is marked valid; frees the slot.
    fn take(&mut self) -> Option<[u64; 3]> {
        if !self.trigger_ready() {
            return None;
        }
        let c = &self.ch.control;
        let slot = self.slot();
        let w = [0, 8, 16].map(|o| c.word(slot + o).load(Ordering::Relaxed));
        self.tail += 1;
        // The slot's contents are copied: the device may reuse it.
        c.word(TAIL_OFF).store(self.tail, Ordering::Release);
        Some(w)
    }

    fn execute(&mut self, w: [u64; 3], seq: u64) -> std::result::Result<(), Failure> {
        let ch = &*self.ch;
        let (op, sb, db, size) = unpack_trigger(w[2]);
        let vendor = |e: flagcx_adaptor::AdaptorError| (PortStatus::DeviceError, e.into());
        match op {
            OP_PUT | OP_PUT_WITH_SIGNAL => {
                let src = range(&ch.local, sb, w[0], size, "source")?;
                let dst = range(&ch.remote, db, w[1], size, "destination")?;
                let signal = op == OP_PUT_WITH_SIGNAL;
                if ch.staged.is_some() {
                    if size > 0 || signal {
                        self.pending = Some(Pending {
                            src,
                            value: None,
                            dst_buffer: db,
                            dst_offset: w[1],
                            left: size,
                            signal,
                        });
                    }
                    return Ok(());
                }
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
                if signal {
                    self.signal()?;
                }
            }
            OP_PUT_VALUE | OP_PUT_VALUE_WITH_SIGNAL => {
                let dst = range(&ch.remote, db, w[1], 8, "destination")?;
                if size != 8 || w[1] % 8 != 0 || dst.0 % 8 != 0 {
                    return Err((
                        PortStatus::BadTrigger,
                        CommError::InvalidArgument(format!(
                            "port trigger {seq}: a value put of {size} bytes at offset {} of \
                             buffer {db} (8 bytes at an 8-byte-aligned address)",
                            w[1]
                        )),
                    ));
                }
                let signal = op == OP_PUT_VALUE_WITH_SIGNAL;
                if ch.staged.is_some() {
                    self.pending = Some(Pending {
                        src: DevicePtr(0),
                        value: Some(w[0]),
                        dst_buffer: db,
                        dst_offset: w[1],
                        left: 8,
                        signal,
                    });
                    return Ok(());
                }
                if signal {
                    self.signals += 1;
                }
                let writes = [(dst, w[0]), (ch.peer_flag, self.signals)];
                let n = if signal { 2 } else { 1 };
                // SAFETY: `dst` was checked against the peer's registered buffer (mapped until
                // close) and is aligned; the peer's flag is an aligned device word mapped until
                // close.
                unsafe {
                    ch.adaptor
                        .stream_write_values64(ch.stream, &writes[..n])
                        .map_err(vendor)?
                };
                ch.bytes_put.fetch_add(8, Ordering::Relaxed);
            }
            OP_SIGNAL if ch.staged.is_some() => {
                self.pending = Some(Pending {
                    src: DevicePtr(0),
                    value: None,
                    dst_buffer: 0,
                    dst_offset: 0,
                    left: 0,
                    signal: true,
                });
            }
            OP_SIGNAL => self.signal()?,
            OP_FLUSH => {
                // Everything earlier is on the stream (a staged put is taken whole before the
                // next trigger), so the write lands after it.
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

    /// Staged pairs: publishes the pending put's chunks while the peer has free slots;
    /// whether any was published.
    fn push(&mut self) -> std::result::Result<bool, Failure> {
        let ch = &*self.ch;
        let link = ch.staged.as_ref().expect("staged channels only");
        let mut moved = false;
        while let Some(p) = self.pending.as_mut() {
            // (Saturating: a peer's credit is never trusted to be below our count.)
            if self.produced.saturating_sub(link.out.credit()) >= SLOTS as u64 {
                break;
            }
            let (src, d, last) = p.next(link.out.slot_bytes());
            match p.value {
                Some(v) => link
                    .out
                    .publish_value(&ch.adaptor, ch.stream, self.produced, v, d),
                // SAFETY: the slot is free (checked above); the source range was checked
                // against our registered buffer, which lives while the channel names it.
                None => unsafe {
                    link.out
                        .publish(&ch.adaptor, ch.stream, self.produced, src, d)
                },
            }
            .map_err(|e| (PortStatus::DeviceError, e))?;
            self.produced += 1;
            link.published.store(self.produced, Ordering::Release);
            ch.bytes_put.fetch_add(d.len as u64, Ordering::Relaxed);
            p.advance(d.len);
            moved = true;
            if last {
                self.pending = None;
            }
        }
        Ok(moved)
    }

    /// Staged pairs: enqueues the copies of the peer's chunks that arrived, each followed by
    /// its signal (if any) and its credit; notices the peer's failure.
    fn receive(&mut self) -> std::result::Result<bool, Failure> {
        let ch = &*self.ch;
        let link = ch.staged.as_ref().expect("staged channels only");
        if link.inb.poisoned() != 0 {
            // The peer failed: release our waiters as its proxy would on an IPC pair.
            self.peer_failed = true;
            self.pending = None;
            ch.release_flag();
            return Ok(true);
        }
        let mut n = 0;
        while n < BATCH {
            let Some(d) = link.inb.ready(self.consumed) else {
                break;
            };
            let d = d.map_err(|e| (PortStatus::BadTrigger, e))?;
            let dst = range(
                &ch.local,
                d.dst_buffer,
                d.dst_offset,
                d.len as u64,
                "destination",
            )?;
            let flag = if d.signal {
                self.received += 1;
                Some((DevicePtr(ch.words.0 + FLAG_OFF), self.received))
            } else {
                None
            };
            // SAFETY: `dst` was checked against our registered buffer (live while the channel
            // names it); the flag is our channel's device word.
            unsafe {
                link.inb
                    .consume(&ch.adaptor, link.stream, self.consumed, dst, d.len, flag)
            }
            .map_err(|e| (PortStatus::DeviceError, e))?;
            self.consumed += 1;
            n += 1;
        }
        Ok(n > 0)
    }

    /// Answers `remove` and `retire` once their conditions hold: whether the thread drops
    /// the channel now, and the answer to send — after the drop, so that the closing side
    /// finds itself the channel's only owner (and frees its memory).
    fn settle(&mut self) -> (bool, Option<Answer>) {
        let stopped = self.failed || self.peer_failed;
        if let Some((_, since)) = &self.closing {
            let drained = stopped
                || self.outbound_closed
                || (self.pending.is_none() && !self.trigger_ready());
            let late = since.elapsed() > CLOSE_LIMIT;
            if drained || late {
                if !drained {
                    self.fail(
                        PortStatus::Closed,
                        CommError::Timeout {
                            ms: CLOSE_LIMIT.as_millis() as u64,
                            peer: Some(self.ch.peer),
                            what: "port channel close: its last triggers (waiting for the \
                                   peer's free slots)"
                                .into(),
                        },
                    );
                }
                let (reply, _) = self.closing.take().expect("checked");
                self.outbound_closed = true;
                let r = self
                    .ch
                    .adaptor
                    .stream_synchronize(self.ch.stream)
                    .map_err(CommError::from);
                if self.ch.staged.is_none() {
                    return (true, Some((reply, r)));
                }
                let _ = reply.send(r);
            }
        }
        if let Some((until, _, since)) = &self.retiring {
            let arrived = stopped || until.map_or(true, |p| self.consumed >= p);
            if arrived || since.elapsed() > CLOSE_LIMIT {
                let (_, reply, _) = self.retiring.take().expect("checked");
                let link = self.ch.staged.as_ref().expect("staged channels only");
                let mut r = self
                    .ch
                    .adaptor
                    .stream_synchronize(link.stream)
                    .and_then(|()| self.ch.adaptor.stream_synchronize(self.ch.stream))
                    .map_err(CommError::from);
                if !arrived && r.is_ok() {
                    r = Err(CommError::Timeout {
                        ms: CLOSE_LIMIT.as_millis() as u64,
                        peer: Some(self.ch.peer),
                        what: "port channel close: the peer's last puts".into(),
                    });
                }
                return (true, Some((reply, r)));
            }
        }
        (false, None)
    }

    fn signal(&mut self) -> std::result::Result<(), Failure> {
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
            self.fail(PortStatus::Closed, CommError::Aborted);
            return;
        }
        let lost = ch.shared.lost[peer].load(Ordering::Acquire)
            || ch.boot.peer_fd(peer).is_some_and(hung_up);
        if lost {
            self.fail(
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
            Ok(DevicePtr(p.0.wrapping_add(off)))
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
