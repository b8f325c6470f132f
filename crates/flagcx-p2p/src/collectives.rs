//! Data-movement collectives over point-to-point: broadcast, gather, scatter, all-gather,
//! all-to-all(v), barrier — with NCCL's meaning, on raw device pointers and a stream.
//!
//! Each collective posts its sends and receives to the other ranks as one group (so every pair
//! uses whatever transport it has — IPC, staged, direct — and a job of CUDA, OpenCL and host
//! ranks runs them unchanged) and then copies the rank's own block on the stream itself;
//! nothing of a rank's own data goes through a transport. The copy is enqueued after the
//! posts, never before: a copy already queued would make the stream busy when the transfers
//! are posted, and each would then wait for a start event (on one GPU shared by two processes,
//! a context switch of ~150 µs per hop). It is enqueued before the stream is made to wait for
//! the transfers, though, so it runs beside them: on a host rank the copy is a CPU memcpy of a
//! whole block, which took as long as the transfers when it ran after them (CUDA + host
//! all-gather). No transfer reads what the copy writes. Like point-to-point, a call enqueues
//! and returns: the stream sees the result when it reaches that point; the returned
//! [`Collective`] also lets the host wait.
//!
//! Algorithms: broadcast is direct (the root sends to every rank at once) up to four ranks
//! and a binomial tree beyond (the root's outgoing bandwidth would otherwise bound it: a tree
//! moves `log2(n)` copies through any one rank instead of `n - 1`); the others are direct —
//! every pair's block moves once, all pairs in flight together.
//!
//! All sizes here are bytes; the C ABI turns element counts into bytes.

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, EventHandle, StreamHandle};

use crate::comm::{Comm, Request};
use crate::error::{CommError, Result};
use crate::link::eager::Move;
use crate::op::Dir;
use flagcx_adaptor::tracking::lock;

/// One message of a collective: peer, send (else receive), buffer, bytes.
pub(crate) type Block = (usize, bool, DevicePtr, usize);

/// How long a host rank's small collective waits in its posting thread for a peer's block
/// before handing the receive to the proxy (`Comm::eager_blocks`), where a point-to-point
/// receive waits the spin time. Every rank makes the same call, so the block is on its way; a
/// receive handed over leaves a join on the stream, and every later call enqueued behind it
/// then goes to the proxy too. Eight host ranks on 16 cores, 1 KiB, five runs of 10 000 calls
/// enqueued back to back: all-to-all and all-gather 4.6–8.7 µs per call in every run with this
/// wait, against 7.5–100 µs (mostly 30–100: receives that waited out the spin time while a
/// peer's thread was off its core) without it; each call waited for, all-to-all 4.6–5.1 µs
/// against 4.6–11.4.
const COLLECTIVE_RECV_WAIT: std::time::Duration = std::time::Duration::from_millis(5);

/// The operations of one collective call.
#[derive(Default)]
#[must_use = "a collective's failure is only seen by waiting for it (or through Comm::async_error)"]
pub struct Collective {
    requests: Vec<Request>,
    /// The rank's own block, copied on the stream: an event recorded after the copy.
    local: Option<LocalCopy>,
    /// A reduction posted inside a group: enqueued at the group's end, which leaves here the
    /// collective that tracks it, or the error that kept it from being enqueued.
    deferred: Option<Deferred>,
}

/// Where a group's end leaves a reduction posted inside the group ([`Collective::deferred`]).
pub(crate) type Deferred = std::sync::Arc<std::sync::Mutex<Option<Result<Collective>>>>;

/// The event after a collective's local copy, with its adaptor's calls.
struct LocalCopy {
    query: Box<dyn Fn() -> Result<bool> + Send + Sync>,
    wait: Box<dyn Fn() -> Result<()> + Send + Sync>,
    /// Destroys the event (allowed while the stream has yet to pass it).
    release: Box<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collective")
            .field("requests", &self.requests)
            .field("local_copy", &self.local.is_some())
            .field("deferred", &self.deferred.is_some())
            .finish()
    }
}

impl Collective {
    /// A reduction posted inside a group, tracked through `cell` once the group's end fills
    /// it: until then it is not done, and waiting for it is an error (the group must end
    /// first, as NCCL's calls in a group complete only after `ncclGroupEnd`).
    pub(crate) fn deferred(cell: Deferred) -> Collective {
        Collective {
            requests: Vec::new(),
            local: None,
            deferred: Some(cell),
        }
    }

    /// Marks every request's operation as fatal to the communicator on failure
    /// ([`crate::op::Slot::make_fatal`]); the first size failure of one that had failed
    /// already.
    pub(crate) fn make_fatal(&self) -> Option<CommError> {
        let mut failed = None;
        for r in &self.requests {
            let e = match &r.state {
                crate::request::State::Done(Err(e)) if e.is_disagreement() => Some(e.clone()),
                crate::request::State::Done(_) => None,
                crate::request::State::Pending(slot) => slot.make_fatal(),
            };
            failed = failed.or(e);
        }
        failed
    }

    /// Blocks until every operation of the call finished, the local copy included; the first
    /// failure is the result.
    pub fn wait(mut self) -> Result<()> {
        let mut first = None;
        for r in std::mem::take(&mut self.requests) {
            if let Err(e) = r.wait() {
                first.get_or_insert(e);
            }
        }
        if let Some(l) = &self.local {
            if let Err(e) = (l.wait)() {
                first.get_or_insert(e);
            }
        }
        if let Some(cell) = self.deferred.take() {
            let r = match lock(&cell).take() {
                Some(Ok(c)) => c.wait(),
                Some(Err(e)) => Err(e),
                None => Err(CommError::InvalidArgument(
                    "a reduction posted inside a group was waited for before the group ended \
                     (end the group first)"
                        .into(),
                )),
            };
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Waits up to `timeout` for every operation of the call (the local copy included)
    /// without taking results, as [`Request::settle`]; whether all finished.
    pub fn settle(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let left = || deadline.saturating_duration_since(std::time::Instant::now());
        if !self.requests.iter().all(|r| r.settle(left())) {
            return false;
        }
        if let Some(cell) = &self.deferred {
            // Filled once by the group's end, never locked there again: holding it while the
            // reduction settles blocks nobody.
            match &*lock(cell) {
                Some(Ok(c)) if !c.settle(left()) => return false,
                Some(_) => {}
                None => return false,
            }
        }
        let Some(l) = &self.local else {
            return true;
        };
        let mut polls = 0u32;
        while !(l.query)().unwrap_or(true) {
            if left().is_zero() {
                return false;
            }
            if polls < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
            polls += 1;
        }
        true
    }

    /// True once every operation finished, the local copy included.
    pub fn is_done(&self) -> bool {
        self.requests.iter().all(Request::is_done)
            && self
                .local
                .as_ref()
                .map_or(true, |l| (l.query)().unwrap_or(true))
            && self
                .deferred
                .as_ref()
                .map_or(true, |cell| match &*lock(cell) {
                    Some(Ok(c)) => c.is_done(),
                    Some(Err(_)) => true,
                    None => false,
                })
    }

    /// Takes over `other`'s requests (a call made of several groups); its local copy is
    /// ordered on the stream before whatever `self` tracks last.
    pub(crate) fn absorb(&mut self, mut other: Collective) {
        self.requests.append(&mut other.requests);
        if other.deferred.is_some() {
            self.deferred = other.deferred.take();
        }
    }

    /// The point-to-point requests the call posted (none for a one-rank job); the local copy
    /// is ordered on the stream.
    pub fn into_requests(mut self) -> Vec<Request> {
        let mut requests = std::mem::take(&mut self.requests);
        if let Some(cell) = self.deferred.take() {
            if let Some(Ok(c)) = lock(&cell).take() {
                requests.extend(c.into_requests());
            }
        }
        requests
    }
}

impl Drop for Collective {
    fn drop(&mut self) {
        if let Some(l) = self.local.take() {
            (l.release)();
        }
    }
}

/// `base + i * block`, checked.
fn at(base: DevicePtr, i: usize, block: usize) -> Result<DevicePtr> {
    i.checked_mul(block)
        .and_then(|off| base.0.checked_add(off as u64))
        .map(DevicePtr)
        .ok_or_else(|| CommError::InvalidArgument("buffer offset overflows".into()))
}

impl<A: DeviceAdaptor> Comm<A> {
    fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.nranks() {
            return Err(CommError::InvalidArgument(format!(
                "root {root} is out of range (the job has {} ranks)",
                self.nranks()
            )));
        }
        Ok(())
    }

    /// Copies `bytes` from `src` to `dst` on `stream` (nothing when they are the same: in
    /// place) and records an event after it into `c`, for [`Collective::wait`].
    ///
    /// # Safety
    /// Both ranges are device memory of this adaptor, valid until the stream passes the copy.
    unsafe fn local_copy(
        &self,
        c: &mut Collective,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        if bytes == 0 || dst == src {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        unsafe { self.adaptor().memcpy_d2d_async(dst, src, bytes, stream) }?;
        self.track_stream_end(c, stream)
    }

    /// Records an event at the current end of `stream` into `c`, so [`Collective::wait`] and
    /// [`Collective::is_done`] cover the work the call enqueued on the stream itself (a local
    /// copy, a reduction step).
    pub(crate) fn track_stream_end(&self, c: &mut Collective, stream: StreamHandle) -> Result<()> {
        let a = self.adaptor().clone();
        // Where the CPU copies (host-addressable memory), a copy enqueued on an idle stream ran
        // before the call returned: a stream with nothing left has nothing to wait for, and
        // an event made, recorded, waited for and destroyed per call was a tenth of a small
        // all-to-all's time on two host ranks.
        if a.capabilities().host_addressable && a.stream_query(stream)? {
            return Ok(());
        }
        let ev: EventHandle = a.event_create(false)?;
        if let Err(e) = a.event_record(ev, stream) {
            let _ = a.event_destroy(ev);
            return Err(e.into());
        }
        if let Some(earlier) = c.local.take() {
            (earlier.release)();
        }
        let (q, w, r) = (a.clone(), a.clone(), a);
        c.local = Some(LocalCopy {
            query: Box::new(move || Ok(q.event_query(ev)?)),
            wait: Box::new(move || Ok(w.event_synchronize(ev)?)),
            release: Box::new(move || {
                let _ = r.event_destroy(ev);
            }),
        });
        Ok(())
    }

    /// Posts `ops` (peer, send?, pointer, bytes) as one group, then enqueues the local copy
    /// `local` (destination, source, bytes), if any, before the stream is made to wait for the
    /// group: the copy runs beside the transfers, not after them (on a host rank, a CPU copy
    /// of a whole block took as long as the transfers). A call small enough for the pairs'
    /// eager slots is moved by this thread first ([`Comm::eager_blocks`]).
    ///
    /// # Safety
    /// As [`Comm::send_raw`] and [`Comm::recv_raw`] for every operation, and as
    /// [`Comm::local_copy`] for `local`.
    pub(crate) unsafe fn post_group(
        &self,
        ops: &[Block],
        stream: StreamHandle,
        local: Option<(DevicePtr, DevicePtr, usize)>,
    ) -> Result<Collective> {
        // SAFETY: the caller's contract.
        unsafe {
            self.post_group_beside(ops, stream, |c| match local {
                Some((dst, src, n)) => self.local_copy(c, dst, src, n, stream).map(|()| true),
                None => Ok(false),
            })
        }
    }

    /// [`Comm::post_group`] with any work beside the transfers: `beside` enqueues it on
    /// `stream` after the group is handed over and before the stream waits for the group
    /// (where the proxy moves the messages, it runs while they move; where they are on the
    /// stream itself, after them). It must touch no byte the group's messages read or write,
    /// and returns whether it enqueued anything.
    ///
    /// # Safety
    /// As [`Comm::send_raw`] and [`Comm::recv_raw`] for every operation; `beside`'s work
    /// touches nothing the messages do.
    pub(crate) unsafe fn post_group_beside(
        &self,
        ops: &[Block],
        stream: StreamHandle,
        beside: impl FnOnce(&mut Collective) -> Result<bool>,
    ) -> Result<Collective> {
        let mut c = Collective::default();
        if ops.is_empty() {
            beside(&mut c)?;
            return Ok(c);
        }
        // SAFETY: the caller's contract.
        let rest = unsafe { self.eager_blocks(ops, stream, &mut c) }?;
        let (ops, tried) = match &rest {
            Some(rest) => (&rest[..], true),
            None => (ops, false),
        };
        if ops.is_empty() {
            beside(&mut c)?;
            return Ok(c);
        }
        self.group_begin()?;
        let posted = ops
            .iter()
            .map(|&(peer, send, ptr, bytes)| {
                // SAFETY: the caller's contract.
                unsafe {
                    if send {
                        self.send_raw(ptr, bytes, peer, stream)
                    } else {
                        self.recv_raw(ptr, bytes, peer, stream)
                    }
                }
            })
            .collect::<Result<Vec<_>>>();
        let ok = posted.is_ok();
        // What was posted is handed over even where a later post failed, as `Comm::group` does.
        let submitted = self.group_end_then(!tried, || if ok { beside(&mut c) } else { Ok(false) });
        c.requests.extend(posted?);
        submitted?;
        Ok(c)
    }

    /// The posting thread moves a small call's messages itself, through the pairs' eager
    /// slots ([`Comm::eager_moves`], as `group_end` does for a group's), without the request,
    /// result slot and buffer lookup each operation of a group carries: on two host ranks
    /// those were a third of a 1 KiB all-to-all's time. `None`: not tried — a message too
    /// large for its pair's slots, a pair without them, the stream busy, a group open — and
    /// every message goes to a group. Otherwise the messages left for the proxy (a peer's not
    /// there within its budget, a full window), in order; a move that failed is a finished
    /// request of `c`.
    ///
    /// # Safety
    /// As [`Comm::post_group`].
    unsafe fn eager_blocks(
        &self,
        ops: &[Block],
        stream: StreamHandle,
        c: &mut Collective,
    ) -> Result<Option<Vec<Block>>> {
        let spin = self.config.spin.unwrap_or_default();
        let moves = ops.iter().map(|&(peer, send, ptr, bytes)| Move {
            peer,
            dir: if send { Dir::Send } else { Dir::Recv },
            ptr,
            bytes,
            stream,
            unordered: true,
        });
        if self.is_aborted()
            || lock(&self.group).contains_key(&crate::posting::thread_number())
            || !moves
                .clone()
                .all(|m| self.eager_eligible(&m, spin).is_some())
            || !self.adaptor().stream_query(stream)?
        {
            return Ok(None);
        }
        // Every buffer checked as a post checks it, before anything moves; consecutive blocks
        // of one allocation need one lookup.
        let mut known: Option<std::ops::Range<u64>> = None;
        for &(_, _, ptr, bytes) in ops {
            let end = ptr.0.saturating_add(bytes as u64);
            if bytes > 0
                && known
                    .as_ref()
                    .is_some_and(|r| r.start <= ptr.0 && end <= r.end)
            {
                continue;
            }
            known = self.check_buffer(ptr, bytes)?.or(known);
        }
        let rest = self.with_group_scratch(|s| {
            s.known_idle(stream);
            s.moves.extend(moves);
            // Not where spinning is off (`FLAGCX_SPIN_US=0`).
            let patience = if self.adaptor().capabilities().host_addressable && !spin.is_zero() {
                COLLECTIVE_RECV_WAIT
            } else {
                std::time::Duration::ZERO
            };
            self.eager_moves(s, patience);
            let mut rest = Vec::new();
            for (&op, done) in ops.iter().zip(s.done.drain(..)) {
                match done {
                    Some(r) => {
                        if r.is_err() {
                            c.requests.push(self.eager_request(r));
                        } else {
                            self.eager_counted(&r);
                        }
                    }
                    None => rest.push(op),
                }
            }
            rest
        });
        Ok(Some(rest))
    }

    /// Broadcast: `bytes` at the root's `send` arrive in every rank's `recv` (in place when
    /// the root passes `send == recv`; other ranks' `send` is not read).
    ///
    /// # Safety
    /// The ranges are device memory of this adaptor, valid until the stream passes the call;
    /// the root's `send` is not modified meanwhile.
    pub unsafe fn broadcast_raw(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        bytes: usize,
        root: usize,
        stream: StreamHandle,
    ) -> Result<Collective> {
        self.check_root(root)?;
        let (me, n) = (self.rank(), self.nranks());
        if n <= 4 {
            let ops: Vec<_> = if me == root {
                (0..n)
                    .filter(|&q| q != me)
                    .map(|q| (q, true, send, bytes))
                    .collect()
            } else {
                vec![(root, false, recv, bytes)]
            };
            // SAFETY: the caller's contract.
            return unsafe {
                self.post_group(&ops, stream, (me == root).then_some((recv, send, bytes)))
            };
        }
        // Binomial tree on ranks relative to the root: receive from the parent, then send to
        // the children (the sends are ordered after the receive by the stream).
        let rel = (me + n - root) % n;
        let abs = |r: usize| (r + root) % n;
        let mut requests = Vec::new();
        // The root sends from its own buffer (its copy into `recv` comes after the posts).
        let data = if me == root {
            send
        } else {
            // The parent: `rel` with its lowest set bit cleared.
            let parent = abs(rel & (rel - 1));
            // A small block is taken the way a collective's are (`eager_blocks`); else, or
            // where it did not come in time, as a point-to-point receive (which may also go
            // the posting thread's IPC path). The children's sends follow it on the stream.
            let one = [(parent, false, recv, bytes)];
            let mut c = Collective::default();
            // SAFETY: the caller's contract.
            let rest = unsafe { self.eager_blocks(&one, stream, &mut c) }?;
            requests.extend(c.into_requests());
            if rest.map_or(true, |r| !r.is_empty()) {
                // SAFETY: the caller's contract.
                requests.push(unsafe { self.recv_raw(recv, bytes, parent, stream) }?);
            }
            recv
        };
        let lowest = if rel == 0 {
            n.next_power_of_two()
        } else {
            rel & rel.wrapping_neg()
        };
        let children: Vec<_> = std::iter::successors(Some(1usize), |m| Some(m << 1))
            .take_while(|&m| m < lowest)
            .map(|m| rel + m)
            .filter(|&c| c < n)
            .map(|c| (abs(c), true, data, bytes))
            .collect();
        // SAFETY: the caller's contract.
        let local = (me == root).then_some((recv, send, bytes));
        // SAFETY: the caller's contract.
        let mut c = unsafe { self.post_group(&children, stream, local) }?;
        requests.append(&mut c.requests);
        c.requests = requests;
        Ok(c)
    }

    /// Gather: every rank's `bytes` at `send` arrive at the root's `recv`, rank `q`'s at
    /// offset `q * bytes` (in place when the root's `send == recv + root * bytes`). `recv`
    /// is only used on the root.
    ///
    /// # Safety
    /// As [`Comm::broadcast_raw`]; the root's `recv` holds `nranks * bytes`.
    pub unsafe fn gather_raw(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        bytes: usize,
        root: usize,
        stream: StreamHandle,
    ) -> Result<Collective> {
        // SAFETY: the caller's contract.
        unsafe { self.rooted(root, false, recv, send, bytes, stream) }
    }

    /// Scatter: block `q` (`bytes` at `send + q * bytes`) of the root arrives at rank `q`'s
    /// `recv` (in place when the root's `recv == send + root * bytes`). `send` is only read
    /// on the root.
    ///
    /// # Safety
    /// As [`Comm::broadcast_raw`]; the root's `send` holds `nranks * bytes`.
    pub unsafe fn scatter_raw(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        bytes: usize,
        root: usize,
        stream: StreamHandle,
    ) -> Result<Collective> {
        // SAFETY: the caller's contract.
        unsafe { self.rooted(root, true, send, recv, bytes, stream) }
    }

    /// Gather (`root_sends` false) or scatter (true): the root exchanges block `q` of
    /// `root_buf` (`nranks` blocks of `bytes`) with rank `q`'s `own` buffer, and copies its own
    /// block locally.
    ///
    /// # Safety
    /// As [`Comm::gather_raw`] and [`Comm::scatter_raw`].
    unsafe fn rooted(
        &self,
        root: usize,
        root_sends: bool,
        root_buf: DevicePtr,
        own: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<Collective> {
        self.check_root(root)?;
        let (me, n) = (self.rank(), self.nranks());
        let (ops, local) = if me == root {
            let ops = (0..n)
                .filter(|&q| q != me)
                .map(|q| Ok((q, root_sends, at(root_buf, q, bytes)?, bytes)))
                .collect::<Result<Vec<_>>>()?;
            let mine = at(root_buf, me, bytes)?;
            // (destination, source, bytes)
            let local = match root_sends {
                true => (own, mine, bytes),
                false => (mine, own, bytes),
            };
            (ops, Some(local))
        } else {
            (vec![(root, !root_sends, own, bytes)], None)
        };
        // SAFETY: the caller's contract.
        unsafe { self.post_group(&ops, stream, local) }
    }

    /// All-gather: every rank's `bytes` at `send` arrive in every rank's `recv` at offset
    /// `rank * bytes` (in place when `send == recv + rank * bytes`).
    ///
    /// # Safety
    /// As [`Comm::broadcast_raw`]; `recv` holds `nranks * bytes`.
    pub unsafe fn all_gather_raw(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<Collective> {
        let (me, n) = (self.rank(), self.nranks());
        let mut ops = Vec::new();
        for q in (0..n).filter(|&q| q != me) {
            ops.push((q, true, send, bytes));
            ops.push((q, false, at(recv, q, bytes)?, bytes));
        }
        let local = Some((at(recv, me, bytes)?, send, bytes));
        // SAFETY: the caller's contract.
        unsafe { self.post_group(&ops, stream, local) }
    }

    /// All-to-all: block `q` of `send` (`bytes` at `send + q * bytes`) arrives at rank `q`'s
    /// `recv + rank * bytes`. `send` and `recv` must not overlap.
    ///
    /// # Safety
    /// As [`Comm::broadcast_raw`]; both hold `nranks * bytes`.
    pub unsafe fn all_to_all_raw(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> Result<Collective> {
        // Every block of `bytes` at `q * bytes`, on both sides.
        let sent = |q| Ok((at(send, q, bytes)?, bytes));
        let received = |q| Ok((at(recv, q, bytes)?, bytes));
        // SAFETY: the caller's contract.
        unsafe { self.exchange_blocks(send == recv && bytes > 0, stream, sent, received) }
    }

    /// All-to-all with per-peer sizes: `send_bytes[q]` at `send + send_displs[q]` go to rank
    /// `q`, which receives them at `recv + recv_displs[me]` with room for `recv_bytes[me]`.
    /// A sender larger than its receive fails on both sides (as point-to-point). `send` and
    /// `recv` must not overlap.
    ///
    /// # Safety
    /// As [`Comm::broadcast_raw`] for every block named.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_to_allv_raw(
        &self,
        send: DevicePtr,
        send_bytes: &[usize],
        send_displs: &[usize],
        recv: DevicePtr,
        recv_bytes: &[usize],
        recv_displs: &[usize],
        stream: StreamHandle,
    ) -> Result<Collective> {
        let n = self.nranks();
        for (name, v) in [
            ("send counts", send_bytes),
            ("send displacements", send_displs),
            ("receive counts", recv_bytes),
            ("receive displacements", recv_displs),
        ] {
            if v.len() != n {
                return Err(CommError::InvalidArgument(format!(
                    "{name}: {} entries for {n} ranks",
                    v.len()
                )));
            }
        }
        let off = |base: DevicePtr, d: usize| {
            base.0
                .checked_add(d as u64)
                .map(DevicePtr)
                .ok_or_else(|| CommError::InvalidArgument("displacement overflows".into()))
        };
        let in_place = send == recv && send_bytes.iter().any(|&b| b > 0);
        // SAFETY: the caller's contract.
        unsafe {
            self.exchange_blocks(
                in_place,
                stream,
                |q| Ok((off(send, send_displs[q])?, send_bytes[q])),
                |q| Ok((off(recv, recv_displs[q])?, recv_bytes[q])),
            )
        }
    }

    /// All-to-all of the blocks `sent(q)` and `received(q)` give (address, bytes) for each rank
    /// `q`, refused where the call is `in_place`: [`Comm::all_to_allv_raw`] once its arguments
    /// are checked, and [`Comm::all_to_all_raw`] without building per-rank lists per call.
    ///
    /// # Safety
    /// As [`Comm::all_to_allv_raw`].
    unsafe fn exchange_blocks(
        &self,
        in_place: bool,
        stream: StreamHandle,
        sent: impl Fn(usize) -> Result<(DevicePtr, usize)>,
        received: impl Fn(usize) -> Result<(DevicePtr, usize)>,
    ) -> Result<Collective> {
        let (me, n) = (self.rank(), self.nranks());
        if in_place {
            return Err(CommError::InvalidArgument(
                "in-place all-to-all is not supported: use distinct send and receive buffers"
                    .into(),
            ));
        }
        let mut ops = Vec::with_capacity(2 * n);
        for q in (0..n).filter(|&q| q != me) {
            let ((src, sb), (dst, rb)) = (sent(q)?, received(q)?);
            ops.push((q, true, src, sb));
            ops.push((q, false, dst, rb));
        }
        let ((src, sb), (dst, rb)) = (sent(me)?, received(me)?);
        if sb > rb {
            return Err(CommError::SizeMismatch {
                peer: me,
                send_bytes: sb,
                recv_bytes: rb,
            });
        }
        // SAFETY: the caller's contract.
        unsafe { self.post_group(&ops, stream, Some((dst, src, sb))) }
    }

    /// Returns once every rank reached it (a zero-byte exchange with every other rank); the
    /// stream is ordered after it too.
    pub fn barrier(&self, stream: StreamHandle) -> Result<()> {
        self.barrier_async(stream)?.wait()
    }

    /// [`Comm::barrier`] without the wait: the returned [`Collective`] finishes once every
    /// rank reached it (for callers that wait in turns, such as the Python binding).
    pub fn barrier_async(&self, stream: StreamHandle) -> Result<Collective> {
        let (me, n) = (self.rank(), self.nranks());
        let ops: Vec<_> = (0..n)
            .filter(|&q| q != me)
            .flat_map(|q| {
                [
                    (q, true, DevicePtr::NULL, 0),
                    (q, false, DevicePtr::NULL, 0),
                ]
            })
            .collect();
        // SAFETY: zero bytes move; no memory is touched.
        unsafe { self.post_group(&ops, stream, None) }
    }
}
