//! The IPC path's per-pair state for posting threads (`CallerLink`, `Msg`) and its polling
//! helpers; the copies themselves are [`crate::transport::ipc`]'s.

use std::sync::Arc;
use std::time::Duration;

use flagcx_adaptor::DevicePtr;

use crate::channel::{Channel, Counter};
use crate::error::Result;
use crate::op::{Dir, Resume};
use crate::peer::TransportKind;

/// The API side's handle on an IPC pair, for operations the posting thread moves itself
/// ([`crate::Config::ipc_caller`]).
pub(crate) struct CallerLink {
    /// This rank → peer.
    pub(crate) out: Arc<Channel>,
    /// Peer → this rank.
    pub(crate) inc: Arc<Channel>,
    /// This rank copies what it sends into the peer's buffer (else the peer pulls it).
    pub(crate) push: bool,
    /// This rank copies what it receives out of the peer's buffer (else the peer pushes it).
    pub(crate) pull: bool,
}

/// One message a posting thread moves: its direction, number, buffer and peer.
#[derive(Clone, Copy)]
pub(crate) struct Msg {
    pub(crate) dir: Dir,
    pub(crate) k: u64,
    pub(crate) ptr: DevicePtr,
    pub(crate) bytes: usize,
    pub(crate) peer: usize,
}

impl CallerLink {
    /// The channel carrying messages of `dir`, and the counters through which the peer
    /// answers there (its descriptor or answer, and its failure).
    pub(crate) fn lane(&self, dir: Dir) -> (&Channel, Counter, Counter) {
        match dir {
            Dir::Send => (&self.out, Counter::RecvPosted, Counter::RecvFault),
            Dir::Recv => (&self.inc, Counter::SendPosted, Counter::SendFault),
        }
    }
}

/// What became of an IPC operation the posting thread took on.
pub(crate) enum Caller {
    /// Finished.
    Done(Result<usize>),
    /// The proxy goes on from here (`None`: from the start).
    HandOff(Option<Resume>),
}

/// How much longer than the spin time a posting thread waits for a copy that is already
/// running (its own, or the peer's copy of its message, see [`Counter::Issued`]) before
/// handing the operation to the proxy. A hand-over costs the pair a stream wait on the device
/// and a round through both proxies (~20 µs per hop on one H200); waiting for a running copy
/// is bounded by its size (1 GiB: 0.5 ms on an H200).
pub(crate) const RUNNING_COPY_WAIT: Duration = Duration::from_millis(2);

/// Polls `ready` until it gives a value, for up to `budget()` (at least once; `spin` zero:
/// exactly once), reading the clock and the budget every 64 polls (they cost more than a poll
/// of shared memory). Between polls: [`flagcx_adaptor::spin::relax`], for waits that this
/// process's own threads (proxy, stream workers) may have to serve.
pub(crate) fn poll_for<T>(
    spin: Duration,
    budget: impl Fn() -> Duration,
    ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    poll_with(spin, budget, ready, |_| flagcx_adaptor::spin::relax()).map(|(v, _)| v)
}

/// [`poll_for`] for a store only the peer's process makes (an eager message): between polls
/// [`flagcx_adaptor::spin::relax_on_peer`], which yields the core less often. With the value,
/// about how long it waited: the time at the last clock read, so zero when it came within the
/// first 64 polls (no clock read beyond the start's on that path, which is latency's).
pub(crate) fn poll_peer_for<T>(
    spin: Duration,
    budget: impl Fn() -> Duration,
    ready: impl FnMut() -> Option<T>,
) -> Option<(T, Duration)> {
    poll_with(spin, budget, ready, flagcx_adaptor::spin::relax_on_peer)
}

/// The clock starts at the first poll that finds nothing: a value already there costs none.
fn poll_with<T>(
    spin: Duration,
    budget: impl Fn() -> Duration,
    mut ready: impl FnMut() -> Option<T>,
    relax: impl Fn(u32),
) -> Option<(T, Duration)> {
    let mut t0: Option<std::time::Instant> = None;
    let mut waited = Duration::ZERO;
    let mut polls = 0u32;
    loop {
        if let Some(v) = ready() {
            return Some((v, waited));
        }
        polls = polls.wrapping_add(1);
        if spin.is_zero() {
            return None;
        }
        let t0 = *t0.get_or_insert_with(std::time::Instant::now);
        if polls % 64 == 0 {
            waited = t0.elapsed();
            if waited >= budget() {
                return None;
            }
        }
        relax(polls);
    }
}

/// The wait budget beside a copy that `running` says is under way: the spin time, plus
/// [`RUNNING_COPY_WAIT`] while it runs (spinning at all only where the spin time allows it).
pub(crate) fn running_copy_budget(spin: Duration, running: bool) -> Duration {
    if running && !spin.is_zero() {
        spin + RUNNING_COPY_WAIT
    } else {
        spin
    }
}

/// Per peer and direction (`Dir as usize`): whether this rank names its buffer to the peer,
/// which copies — a send the peer pulls, a receive the peer pushes into (IPC pairs only).
pub(crate) fn names_buffer(peers: &[Option<super::PeerConn>]) -> Vec<[bool; 2]> {
    let names = |c: &super::PeerConn| [c.roles.peer_pulls, !c.roles.we_pull];
    let ipc = |c: &&super::PeerConn| c.transport == TransportKind::Ipc;
    peers
        .iter()
        .map(|c| c.as_ref().filter(ipc).map_or([false; 2], names))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::time::{Duration, Instant};

    #[test]
    pub(crate) fn without_spinning_a_poll_looks_exactly_once() {
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
    pub(crate) fn a_poll_returns_what_arrives_and_gives_up_after_its_budget() {
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
    pub(crate) fn only_a_running_copy_extends_the_wait_and_only_where_spinning_is_allowed() {
        let spin = Duration::from_micros(50);
        assert_eq!(running_copy_budget(spin, false), spin);
        assert_eq!(running_copy_budget(spin, true), spin + RUNNING_COPY_WAIT);
        assert_eq!(running_copy_budget(Duration::ZERO, true), Duration::ZERO);
    }
}
