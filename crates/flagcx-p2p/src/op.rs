//! What the API side hands the engine: operations ([`Op`]), where their results land
//! ([`Slot`]), the inbox that numbers them per pair and direction ([`Inbox`]), and how far a
//! posting thread got with one it began itself ([`Resume`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flagcx_adaptor::quiet::QuietCondvar;
use flagcx_adaptor::tracking::lock;
use flagcx_adaptor::{DevicePtr, EventHandle};

use crate::error::{CommError, Result};

/// Send or receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    Send,
    Recv,
}

/// Work a waiting thread can do for its operation instead of sleeping: the network
/// transport's (driving UCX, which moves the bytes, while the engine only watches for the
/// end), or the engine's own passes where this rank's copies are CPU copies
/// ([`crate::drive`]).
pub(crate) trait Help: Send + Sync {
    /// One step; whether anything moved.
    fn step(&self) -> bool;
    /// Between two steps; `polls` counts the steps since the last that moved.
    fn pause(&self, _polls: u32) {
        flagcx_adaptor::spin::relax()
    }
}

/// A [`Help`] a slot's waiters share.
#[derive(Clone)]
pub(crate) struct Helper(pub Arc<dyn Help>);

impl std::fmt::Debug for Helper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Helper")
    }
}

/// How long a waiter with a [`Helper`] keeps working while nothing moves.
const HELP_IDLE_MAX: Duration = Duration::from_millis(100);

/// How often a sleeping waiter looks at the [`Verdict`].
pub(crate) const VERDICT_POLL: Duration = Duration::from_millis(20);

/// The communicator-wide outcome every pending request takes once given: set by an abort or
/// by the guard, read by waiters without the engine. The first one given stays.
#[derive(Debug, Default)]
pub(crate) struct Verdict {
    given: AtomicBool,
    error: Mutex<Option<CommError>>,
}

impl Verdict {
    /// Gives `e` to every request still waiting, unless a verdict was given already.
    pub fn give(&self, e: CommError) {
        let mut g = lock(&self.error);
        if g.is_none() {
            *g = Some(e);
            self.given.store(true, Ordering::Release);
        }
    }

    /// The verdict, once given.
    pub fn get(&self) -> Option<CommError> {
        if !self.given.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.error).clone()
    }

    /// Whether one was given.
    pub fn given(&self) -> bool {
        self.given.load(Ordering::Acquire)
    }
}

/// Where one operation's result lands; shared by the proxy and the [`crate::Request`].
#[derive(Debug, Default)]
pub(crate) struct Slot {
    result: Mutex<Option<Result<usize>>>,
    /// Notified on completion, only where a waiter sleeps (a completion without one is a
    /// store, not a system call).
    cv: QuietCondvar,
    /// Set once `result` is filled, for waiters that spin before sleeping.
    done: AtomicBool,
    /// What a waiter does between polls once its spin is over, instead of sleeping.
    help: Option<Helper>,
    /// The communicator's verdict (an abort, the stall guard): taken by waiters while the
    /// engine, which fills `result`, is blocked (`crate::guard`).
    verdict: Option<Arc<Verdict>>,
    /// The operation belongs to a call whose failure fails the communicator (a reduction's
    /// steps: see [`Slot::make_fatal`]).
    fatal: AtomicBool,
}

impl Slot {
    /// A slot whose waiters make progress with `help` rather than sleep, and take `verdict`
    /// once it is given.
    pub fn new(help: Option<Helper>, verdict: Arc<Verdict>) -> Self {
        Slot {
            help,
            verdict: Some(verdict),
            ..Slot::default()
        }
    }

    pub fn complete(&self, r: Result<usize>) {
        let mut g = lock(&self.result);
        *g = Some(r);
        self.done.store(true, Ordering::SeqCst);
        drop(g);
        self.cv.notify_all();
    }

    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Marks the operation as one whose size failure fails the communicator (the engine
    /// aborts it when it fails the operation with `SizeMismatch`); returns that failure if it
    /// had happened already, which the caller then acts on. (The mark and the engine's completion are each a store then a
    /// load, both sequentially consistent: one side or both see the other.)
    pub fn make_fatal(&self) -> Option<CommError> {
        self.fatal.store(true, Ordering::SeqCst);
        if !self.done.load(Ordering::SeqCst) {
            return None;
        }
        match &*lock(&self.result) {
            Some(Err(e)) if e.is_disagreement() => Some(e.clone()),
            _ => None,
        }
    }

    /// Whether [`Slot::make_fatal`] marked it.
    pub fn is_fatal(&self) -> bool {
        self.fatal.load(Ordering::SeqCst)
    }

    /// Done, or a verdict was given: a wait returns at once.
    pub fn settled(&self) -> bool {
        self.is_done() || self.verdict.as_ref().is_some_and(|v| v.given())
    }

    /// Waits for the result, up to `timeout` if given, spinning for up to `spin` first; takes
    /// it (`None`: the timeout passed).
    pub fn wait(&self, timeout: Option<Duration>, spin: Duration) -> Option<Result<usize>> {
        if !self.settle(timeout, spin) {
            return None;
        }
        if let Some(r) = lock(&self.result).take() {
            return Some(r);
        }
        self.verdict.as_ref().and_then(|v| v.get()).map(Err)
    }

    /// Waits until the result is in or a verdict was given, up to `timeout` if given,
    /// spinning for up to `spin` first, without taking the result (a posting thread waits so
    /// for the operations it hands over where they must finish before its call returns:
    /// `Comm::posts_wait`); whether it settled.
    pub fn settle(&self, timeout: Option<Duration>, spin: Duration) -> bool {
        if self.is_done() {
            // Finished already (an eager operation of a group): no clock, no spin.
            return true;
        }
        let t0 = Instant::now();
        let spin = timeout.map_or(spin, |t| spin.min(t));
        let deadline = timeout.map(|t| t0 + t);
        if let (Some(Helper(help)), false) = (&self.help, spin.is_zero()) {
            // As MPI libraries do: the waiter works for its operation (a peer's reply may
            // take milliseconds to come: sleeping through them and waking cost 15% at 16 MiB
            // over TCP); after `HELP_IDLE_MAX` with nothing moving the peer is late, not busy,
            // and it sleeps like any waiter while the engine carries on.
            let (mut moved, mut polls) = (Instant::now(), 0u32);
            while !self.settled()
                && !deadline.is_some_and(|d| Instant::now() >= d)
                && moved.elapsed() < HELP_IDLE_MAX
            {
                if help.step() {
                    // Straight on, as the proxy does: the next step often follows at once,
                    // and a yield here can cost a whole round of other threads.
                    moved = Instant::now();
                    polls = 0;
                    continue;
                }
                help.pause(polls);
                polls = polls.wrapping_add(1);
            }
        }
        while !spin.is_zero() && !self.is_done() && t0.elapsed() < spin {
            flagcx_adaptor::spin::relax();
        }
        let mut g = lock(&self.result);
        loop {
            if g.is_some() || self.verdict.as_ref().is_some_and(|v| v.given()) {
                return true;
            }
            // Sleeps in short turns where a verdict may come: its giver does not know this
            // slot, and the engine that does may be blocked.
            let turn = self.verdict.as_ref().map(|_| VERDICT_POLL);
            let left = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) => Some(left),
                    None => return false,
                },
                None => None,
            };
            g = match left.into_iter().chain(turn).min() {
                None => self.cv.wait(g),
                Some(t) => self.cv.wait_timeout(g, t).0,
            };
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
    /// Instead of a start event: the operation may start once every operation up to this one
    /// finished (0: no such wait). Set where the caller's stream held nothing but this
    /// communicator's closed gate for that operation (see `Comm::behind_own_gate`).
    pub after: u64,
    pub slot: Arc<Slot>,
    /// Keeps a safe API caller's buffer alive until the operation finishes.
    pub keep: Option<crate::kept::Keep>,
    /// When the API thread posted it, where `FLAGCX_PROFILE` is on (a clock read per
    /// operation is a tenth of a small collective's time on some VMs otherwise).
    pub posted: Option<Instant>,
    /// Where the proxy takes over an operation the posting thread began itself (IPC pairs,
    /// see `Comm::try_caller_ipc`); `None`: from the start.
    pub resume: Option<Resume>,
    /// IPC pairs, where this side names its buffer to the peer and the runtime has no handle
    /// for it (pool memory): the exportable buffer that stands in for it
    /// (`crate::standin`).
    pub stand_in: Option<crate::standin::StandIn>,
}

impl Op {
    /// Ends the operation's hold on its stand-in (`crate::standin`): back to the pool
    /// where the operation succeeded (nobody touches it any more), else kept aside.
    pub(crate) fn settle_stand_in(&mut self, ok: bool) {
        if let (true, Some(s)) = (ok, self.stand_in.as_mut()) {
            s.done();
        }
    }
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
    /// for a failure of its own. Boxed: every operation carries a `Resume`, and an error
    /// inline made each one 48 bytes larger to move around.
    Failed(Box<CommError>),
    /// A pair on two hosts: its UCX request (a send, or a probed receive) is under way.
    Net(crate::ucx::NetReq),
    /// Stream-ordered (`transport::streamed`): enqueued on the caller's stream at submission,
    /// which writes a word when it is done with it (no event).
    Streamed,
    /// Late copy (`transport::late`): claimed and enqueued at submission. `second`: this side
    /// posted second (its stream copies, or its posting thread settled a size mismatch);
    /// `mapping`: the peer's allocation its copy goes through, counted busy in the IPC cache
    /// (`IpcCache::open_busy`) until the copy is done (taken once returned).
    Late {
        second: bool,
        mapping: Option<Box<flagcx_adaptor::IpcMemHandle>>,
    },
}

/// Where a posting thread handed an IPC operation to the proxy: the index of its counter in
/// [`crate::shared::Shared::caller_handoffs`].
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

/// Why a small message of a pair with eager slots went to the proxy instead: the index of its
/// counter in [`crate::shared::Shared::eager_declined`] (printed by `FLAGCX_PROFILE=1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Declined {
    /// The caller's stream had work pending at posting.
    StreamBusy = 0,
    /// The pair and direction had an operation with the proxy, or the peer's slots were full.
    PairBusy = 1,
    /// A receive waited out its budget (`EagerLink::recv_budget`) before the message came.
    WaitedOut = 2,
    /// A receive found the peer's message sent through the proxy's protocol.
    OtherPath = 3,
}

impl Resume {
    /// The counter of a hand-over that resumes at `r`.
    pub fn handoff(r: &Option<Resume>) -> Handoff {
        match r {
            None | Some(Resume::Streamed | Resume::Late { .. }) => Handoff::Fresh,
            Some(Resume::Pushed(_)) => Handoff::Pushed,
            Some(Resume::Pulled { .. }) => Handoff::Pulled,
            Some(Resume::Published | Resume::Net(_)) => Handoff::Published,
            Some(Resume::Failed(_)) => Handoff::Failed,
        }
    }
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
