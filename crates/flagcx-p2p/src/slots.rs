//! Small all-reduces between host-addressable ranks of one machine, through two slots in each
//! pair's channel (`slot`) instead of eager messages.
//!
//! Call `n` (this communicator's `n`-th all-reduce that takes this path; every rank numbers
//! them alike, since the choice depends only on the call's arguments and the job) writes this
//! rank's block into slot `n % 2` of the channel to every peer — its signature (type, operator,
//! count) and data, then the word `n + 1` with release ordering — then waits for every peer's
//! word `n + 1` in the channels from them and combines the blocks straight out of the slots,
//! in rank order `((x0 ∘ x1) ∘ x2) ∘ …` as the direct algorithm does, so the bits are the
//! same. There is no acknowledgement: a rank writes slot `n % 2` again at call `n + 2` only
//! after it finished call `n + 1`, which needed every peer's block of `n + 1`, which each peer
//! wrote only after it finished reading call `n`. On two host ranks that is one cache line
//! each way for an 8-byte all-reduce, where two eager messages (the block, and the half that
//! carries the signature check) took four or more.
//!
//! A peer whose signature differs fails the call on both sides (each sees the other's); a peer
//! that never writes (it died, or took another path for a different count) is waited for up
//! to `FLAGCX_TIMEOUT_MS` (as long as it lives where that is unset: a rank may reach the call
//! minutes after the others), the communicator's abort or the peer's death (its process gone,
//! checked every 100 ms); past a millisecond the wait naps between polls.
//! Calls run on the posting thread where the stream is idle, else as a host function on it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flagcx_adaptor::reduce::{DataType, ReduceOp, ReduceStep};

use crate::channel::{Channel, REDUCE_SLOTS_AT, REDUCE_SLOT_BYTES, REDUCE_SLOT_DATA};
use crate::config::Config;
use crate::error::{CommError, Result};
use crate::peer::PeerInfo;

/// The largest block (bytes) an all-reduce moves through the slots.
pub(crate) const SLOTS_MAX: usize = REDUCE_SLOT_DATA;

/// How long a wait spins before it naps between polls (a peer still computing).
const SPIN: Duration = Duration::from_millis(1);

/// How often a wait asks whether its peers' processes still live.
const LIVENESS: Duration = Duration::from_millis(100);

/// One communicator's slot links.
pub(crate) struct Slots {
    /// Per rank: (the channel this rank sends through, the one it receives through); `None`
    /// for this rank.
    links: Vec<Option<(Arc<Channel>, Arc<Channel>)>>,
    rank: usize,
    /// Calls handed out (the next call's number).
    next: AtomicU64,
    /// Calls this rank finished (a call starts once the one before it finished here).
    done: AtomicU64,
    /// `FLAGCX_TIMEOUT_MS`: without it a call waits as long as its peers live.
    timeout: Option<Duration>,
    /// Every rank's process (all on this machine), to notice a peer that died while this rank
    /// waits: no operation of the engine is in flight then to see its socket close.
    pids: Vec<u32>,
}

/// What ends a call's waits besides its timeout: the communicator's abort, and each peer's
/// pair retired (`crate::shared::Shared`'s flags).
pub(crate) struct Stop<'a> {
    pub(crate) aborted: &'a AtomicBool,
    pub(crate) lost: &'a [AtomicBool],
}

/// One call's arguments.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call {
    pub(crate) n: u64,
    pub(crate) send: u64,
    pub(crate) recv: u64,
    pub(crate) count: usize,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
}

impl Call {
    /// The word that names (type, operator, count) in a slot.
    fn signature(&self) -> u64 {
        (self.dtype as u64) | (self.op as u64) << 8 | (self.count as u64) << 16
    }
}

impl Slots {
    /// The links of `rank`, from the channels of each peer, where a job of these ranks can take
    /// the path: every rank's memory host addressable and every rank on this machine (what
    /// every rank knows alike), and every peer's channels there.
    pub(crate) fn new(
        rank: usize,
        channels: Vec<Option<(Arc<Channel>, Arc<Channel>)>>,
        infos: &[PeerInfo],
        config: &Config,
    ) -> Option<Slots> {
        let whole = channels
            .iter()
            .enumerate()
            .all(|(q, c)| (q == rank) == c.is_none())
            && config.reduce_slots
            && infos.len() > 1
            && infos
                .iter()
                .all(|i| i.caps.host_addressable && i.host_id == infos[0].host_id);
        whole.then(|| Slots {
            links: channels,
            rank,
            next: AtomicU64::new(0),
            done: AtomicU64::new(0),
            timeout: config.timeout,
            pids: infos.iter().map(|i| i.pid).collect(),
        })
    }

    /// The next call's number.
    pub(crate) fn take_number(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Runs call `c` to its end.
    ///
    /// # Safety
    /// `c.send` and `c.recv` are host addresses of `count` elements, readable and writable
    /// until the call returns; `recv` equals `send` or is disjoint from it.
    pub(crate) unsafe fn run(&self, c: &Call, stop: &Stop) -> Result<()> {
        let bytes = c.count * c.dtype.size();
        debug_assert!(bytes <= SLOTS_MAX);
        let mut w = Wait::new(self, c.n, stop);
        // Calls posted on two streams may run out of order: call n waits for n - 1 here.
        while self.done.load(Ordering::Acquire) < c.n {
            w.poll(None)?;
        }
        let sig = c.signature();
        for (out, _) in self.links.iter().flatten() {
            let (word, sig_word, data) = slot(out, c.n);
            sig_word.store(sig, Ordering::Relaxed);
            // SAFETY: `bytes <= REDUCE_SLOT_DATA`; the slot is this rank's to write (see the
            // module docs); `send` holds `bytes` readable bytes (contract).
            unsafe { std::ptr::copy_nonoverlapping(c.send as *const u8, data, bytes) };
            word.store(c.n + 1, Ordering::Release);
        }
        // This rank's own block, as it wrote it (its send buffer may be the result).
        let Some((first_out, _)) = self.links.iter().flatten().next() else {
            return Err(CommError::InvalidArgument(
                "an all-reduce through the reduction slots needs a peer".into(),
            ));
        };
        let mine = slot(first_out, c.n).2 as *const u8;
        // Every peer's block: where it lies, once its word says call n.
        let mut blocks: Vec<*const u8> = Vec::with_capacity(self.links.len());
        for (q, link) in self.links.iter().enumerate() {
            let Some((_, inc)) = link else {
                blocks.push(mine);
                continue;
            };
            let (word, sig_word, data) = slot(inc, c.n);
            let mut w = Wait::new(self, c.n, stop);
            while word.load(Ordering::Acquire) != c.n + 1 {
                w.poll(Some(q))?;
            }
            let theirs = sig_word.load(Ordering::Relaxed);
            if theirs != sig {
                return Err(CommError::InvalidArgument(format!(
                    "rank {q} passed a different all-reduce ({}) than rank {} ({}): ranks must \
                     pass the same count, type and operator",
                    describe(theirs),
                    self.rank,
                    describe(sig)
                )));
            }
            blocks.push(data as *const u8);
        }
        let combine = ReduceStep::combining(c.op);
        let dst = c.recv as *mut u8;
        for (k, &b) in blocks.iter().enumerate().skip(1) {
            let a = if k == 1 { blocks[0] } else { dst as *const u8 };
            // SAFETY: `dst` holds `count` elements (contract); `a` and `b` are slots of
            // `bytes <= REDUCE_SLOT_DATA` bytes that nobody writes before this call ends, or
            // `dst` itself (equal, which the reduction allows).
            unsafe { flagcx_adaptor::reduce::reduce_raw(dst, a, b, c.count, c.dtype, combine) };
        }
        if let Some(step) = ReduceStep::finishing(c.op, self.links.len()) {
            // SAFETY: as above; an average reads only `a`.
            unsafe { flagcx_adaptor::reduce::reduce_raw(dst, dst, dst, c.count, c.dtype, step) };
        }
        self.done.store(c.n + 1, Ordering::Release);
        Ok(())
    }
}

/// One wait of a call: spinning, then napping; failing at the timeout, an abort or a peer's
/// death.
struct Wait<'a> {
    slots: &'a Slots,
    stop: &'a Stop<'a>,
    call: u64,
    t0: Instant,
    checked: Instant,
    polls: u32,
}

impl<'a> Wait<'a> {
    fn new(slots: &'a Slots, call: u64, stop: &'a Stop<'a>) -> Self {
        let now = Instant::now();
        Wait {
            slots,
            stop,
            call,
            t0: now,
            checked: now,
            polls: 0,
        }
    }

    /// One pause between polls, waiting for `peer` (`None`: this rank's previous call).
    fn poll(&mut self, peer: Option<usize>) -> Result<()> {
        self.polls = self.polls.wrapping_add(1);
        if self.polls % 64 != 0 {
            flagcx_adaptor::spin::relax_on_peer(self.polls);
            return Ok(());
        }
        if self.stop.aborted.load(Ordering::Acquire) {
            return Err(CommError::Aborted);
        }
        let waited = self.t0.elapsed();
        if let Some(t) = self.slots.timeout.filter(|t| waited > *t) {
            return Err(CommError::Timeout {
                ms: t.as_millis() as u64,
                peer,
                what: match peer {
                    Some(q) => format!(
                        "all-reduce {} through the reduction slots: rank {q}'s block never came",
                        self.call
                    ),
                    None => format!(
                        "all-reduce {} through the reduction slots: this rank's call before it \
                         never finished",
                        self.call
                    ),
                },
            });
        }
        if let Some(q) = peer {
            if self.checked.elapsed() >= LIVENESS {
                self.checked = Instant::now();
                let lost = self
                    .stop
                    .lost
                    .get(q)
                    .is_some_and(|l| l.load(Ordering::Acquire));
                if lost || !alive(self.slots.pids[q]) {
                    return Err(CommError::PeerLost {
                        peer: q,
                        reason: format!(
                            "its process is gone (all-reduce {} through the reduction slots)",
                            self.call
                        ),
                    });
                }
            }
        }
        if waited > SPIN {
            std::thread::sleep(Duration::from_micros(20));
        } else {
            flagcx_adaptor::spin::relax_on_peer(self.polls);
        }
        Ok(())
    }
}

/// Whether process `pid` of this machine still runs (a zombie does not).
fn alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return true;
    };
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let exists = unsafe { libc::kill(p, 0) } == 0
        || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists
        && std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
            // The state follows the command name's closing parenthesis.
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
                .map_or(true, |state| state != 'Z' && state != 'X')
        })
}

/// Reduction slot `call % 2` of `ch`: its published word (the call's number + 1 once the slot
/// holds that call's block), its signature word and its data (`REDUCE_SLOT_DATA` bytes). The
/// sender writes the signature and data, then publishes with release ordering; the receiver
/// reads them after an acquire load that saw its call.
fn slot(ch: &Channel, call: u64) -> (&AtomicU64, &AtomicU64, *mut u8) {
    let at = REDUCE_SLOTS_AT + (call % 2) as usize * REDUCE_SLOT_BYTES;
    // SAFETY: both slots lie between the control page and the receive descriptors, inside the
    // mapping, which outlives `ch`; the head's two words are 8-byte aligned (the mapping is
    // page aligned, the stride a multiple of 64), and every access to them is atomic.
    unsafe {
        let p = ch.segment().as_ptr().add(at);
        (
            &*(p as *const AtomicU64),
            &*(p.add(8) as *const AtomicU64),
            p.add(16),
        )
    }
}

/// A signature word in words.
fn describe(sig: u64) -> String {
    let dtype = DataType::ALL
        .get((sig & 0xff) as usize)
        .map_or("an unknown type".to_string(), |d| d.to_string());
    let op = ReduceOp::ALL
        .get((sig >> 8 & 0xff) as usize)
        .map_or("an unknown operator".to_string(), |o| o.to_string());
    format!("{} elements of {dtype}, {op}", sig >> 16)
}
