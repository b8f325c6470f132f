//! Reductions — all-reduce, reduce-scatter, reduce — with NCCL's meaning, over any mix of
//! vendors.
//!
//! A call is a **plan**: a list of steps that depends only on (kind, rank, ranks, count, type,
//! op, algorithm, in place), enqueued in order on the caller's stream. A step is an exchange
//! (one group of sends and receives, through whatever transport each pair has), a reduction
//! step ([`DeviceAdaptor::reduce_async`]: each rank combines what it received on its own
//! device, so no vendor ever reads another's memory) or a local copy. Like every collective,
//! a call enqueues and returns; the stream sees the result when it reaches that point.
//!
//! **Algorithms** ([`choose`], a pure function, so every rank picks the same one;
//! `FLAGCX_REDUCE_ALGO=ring|direct|scatter` forces one, and must then be set alike on every
//! rank):
//! - *direct*, where a rank's block is at most [`DIRECT_MAX_BYTES`] and `ranks × block` fits the
//!   scratch: every rank sends its block to every rank that needs it in one exchange, and each
//!   receiver combines the blocks in rank order `((x0 ∘ x1) ∘ x2) ∘ …` — one round trip;
//!   Where every rank's memory is host addressable and every rank is on one machine, an
//!   all-reduce of up to 4 KiB (`crate::slots::SLOTS_MAX`) moves through two slots in each pair's
//!   channel instead of messages (`slots`; `FLAGCX_REDUCE_SLOTS=0` turns it off): the same
//!   order, so the same bits, and the call's signature rides in the slot;
//! - *scatter*, for larger blocks that fit the scratch (`ranks × block`) on three ranks or
//!   more, whose segments exceed [`SCATTER_MIN_SEGMENT`]: every rank sends segment `j` of its data to rank `j` in one exchange, each rank
//!   combines its segment in rank order, and a second exchange sends every combined segment to
//!   every rank (all-reduce) or to the root (reduce); a reduce-scatter is the direct
//!   algorithm's one exchange. Two dependent exchanges where the ring takes `2(n − 1)`, for
//!   the ring's traffic (four host ranks on 2 cores, 512 KiB: see `docs/performance.md`);
//! - *ring* otherwise: a reduce-scatter around the ring (`n − 1` steps, each rank receiving a
//!   segment from the previous rank and combining it with its own), then for all-reduce an
//!   all-gather around the ring, for reduce a gather to the root. Segment `j` is combined in
//!   the order `x(j+1) ∘ x(j+2) ∘ … ∘ x(j)` (ranks modulo `n`). The reduce-scatter moves each
//!   segment in slices of [`ring_slice`] bytes, one ring pass per slice, and consecutive
//!   passes overlap: a pass's slice is combined while the next pass's slice moves (the plan's
//!   local steps run beside the next exchange, `plan::overlap`). On two ranks an all-reduce
//!   sends each combined slice back with the exchange two passes later; from three, its
//!   all-gather moves whole segments at the end (`n − 1` exchanges).
//!
//! **The same bits on every rank**: a value is combined once, on one rank, in the order above,
//! and then only copied, so every rank ends with identical bits whatever its vendor (every
//! vendor's reduction step follows `flagcx_adaptor::reduce`'s rules bit for bit). An average
//! is a sum followed by one [`ReduceStep::Average`] on the combined value: integers divide
//! truncating toward zero, floats multiply by `1/n` rounded to the element type (applied
//! after the sum, not to each input as NCCL does, so a sum that overflows stays infinite).
//!
//! **Scratch**: [`SCRATCH_BYTES`] of device memory per communicator, allocated at its first
//! reduction and freed with it (`crate::scratch`); calls on different streams take turns. In a
//! job with a CUDA or HIP rank, or with `FLAGCX_REDUCE_SLICE` set, a ring whose slices need
//! more grows it, once, to at most [`DEVICE_SCRATCH_BYTES`] (the 8 MiB kept too until the
//! communicator is destroyed).
//!
//! Inside a group ([`Comm::group_begin`]) a reduction is checked when posted and enqueued at
//! the group's end, after the group's point-to-point operations; its failure is the
//! `group_end`'s.
//!
//! Ranks must pass the same count, type and operator (as NCCL requires). A count that differs
//! fails the messages' sizes (`SizeMismatch`). So does a type or operator that differs with
//! the same byte count: the call's first message to and from each peer goes as two, split at
//! a point the type and operator give ([`split_point`]). Both ends of a message compute it
//! from their own arguments and the halves' total is the same, so where the ends disagree one
//! half is longer than its receive and fails. The split tells all 50 (type, operator) pairs
//! apart in messages above [`SIGNATURE_SPAN`] bytes; in smaller ones, pairs whose signatures
//! differ by a multiple of `bytes − 1` look alike (never two operators on one type, in
//! messages of 6 bytes or more), and a 1-byte message carries none. A rank whose reduction
//! message fails so (or whose peer retired the pair for it) fails its communicator, as an
//! abort does, so the ranks that exchange nothing with the odd one fail too instead of
//! finishing on data that never came (`reductions_whose_ranks_disagree_fail_on_every_rank`).
//! The check costs one more message per peer and call (two host ranks' 8 B all-reduce on
//! the 2-core machine: 0.76 → 1.03 µs, medians of six alternating runs); `FLAGCX_REDUCE_CHECK=0`
//! on every rank turns it off.
//!
//! Out of scope: user-defined and pre-multiplied-sum ops, float8.

use flagcx_adaptor::reduce::{DataType, ReduceOp, ReduceStep};
use flagcx_adaptor::{AdaptorError, DeviceAdaptor, DevicePtr, StreamHandle, Vendor};

use crate::collectives::{Block, Collective};
use crate::comm::Comm;
use crate::error::{CommError, Result};
use flagcx_adaptor::tracking::lock;

/// Device scratch memory per communicator: the ring's two slices (each received segment slice
/// lands in one while the other is sent on), or the direct algorithm's received blocks.
pub const SCRATCH_BYTES: usize = 8 << 20;

/// Messages longer than this carry every (type, operator) pair's signature distinctly.
pub const SIGNATURE_SPAN: usize = DataType::ALL.len() * ReduceOp::ALL.len();

/// Where a reduction's first message of `bytes` splits for (`dtype`, `op`): a point in
/// `1..bytes` that differs between any two of the 50 pairs when `bytes > SIGNATURE_SPAN`
/// (`None` for a message too short to split).
pub fn split_point(dtype: DataType, op: ReduceOp, bytes: usize) -> Option<usize> {
    let sig = 1 + dtype as usize * ReduceOp::ALL.len() + op as usize;
    match bytes {
        0 | 1 => None,
        b if b > SIGNATURE_SPAN => Some(sig),
        b => Some(1 + (sig - 1) % (b - 1)),
    }
}

/// A rank's block (bytes) up to which the direct algorithm is chosen: one exchange beats the
/// ring's `2(n − 1)` dependent steps while the blocks are small enough that sending all of
/// them to every rank costs less than those steps' latencies.
pub const DIRECT_MAX_BYTES: usize = 64 << 10;

/// The most scratch a reduction of a job of GPU ranks (CUDA or HIP) grows to, and the most a
/// forced slice ([`ring_slice`]) may reach.
pub const DEVICE_SCRATCH_BYTES: usize = 64 << 20;

/// The ring slice of jobs that mix GPU ranks (CUDA or HIP) with others: see [`ring_slice`].
pub const MIXED_SLICE_BYTES: usize = 16 << 20;

/// The bytes of each segment one ring pass moves (the same on every rank: it depends only on
/// what every rank knows alike). `gpu_ranks` is how many of the `nranks` ranks' vendors are
/// CUDA or HIP, `longest` the call's longest segment in bytes, and `forced` the slice
/// `FLAGCX_REDUCE_SLICE` sets (which must then be set alike on every rank).
///
/// A call whose segments fit one pass takes one pass; a longer one takes passes in two lanes
/// of buffers, so that one pass is combined while the next one moves (`plan::overlap`). A
/// pass takes one buffer on two ranks and two from three (`plan::ring_buffers`); the scratch
/// a call reaches is at most [`SCRATCH_BYTES`], or [`DEVICE_SCRATCH_BYTES`] in jobs with a
/// GPU rank or a forced slice.
///
/// - *Every rank a GPU rank*: one pass up to [`DEVICE_SCRATCH_BYTES`] a pass's buffers. Two
///   CUDA ranks copy with their own streams (late copies, `transport::late`), so nothing
///   moves while the stream combines, and each pass costs `n − 1` hand-offs between the
///   ranks' streams (~45 µs between two CUDA ranks on one H100, run
///   `2026-12-07-h100-mps-late`: a 128 MiB all-reduce in 4 MiB slices spent 1.45 ms where its
///   memory traffic takes 0.3 ms; in one 64 MiB pass, 0.48 ms).
/// - *GPU ranks beside others*: [`MIXED_SLICE_BYTES`]. The proxy moves these pairs' messages,
///   so passes overlap; the slice keeps a 128 MiB all-reduce to four passes, since each costs
///   the GPU rank's stream a hand-off. Not yet measured on a GPU against other slices
///   (`FLAGCX_REDUCE_SLICE` tries them).
/// - *No GPU rank*: [`SCRATCH_BYTES`] a lane (4 MiB slices on two ranks, 2 MiB from three):
///   a slice is still in the CPU's cache when it is combined (a host rank and a PoCL rank took
///   131–145 ms for a 64 MiB all-reduce in 64 MiB slices against 69–78 ms in 4 MiB slices,
///   the same 2-core VM, before passes overlapped). On 2 cores the overlap gains nothing
///   (the copies and the combining share the CPUs); see `docs/performance.md`.
pub fn ring_slice(nranks: usize, gpu_ranks: usize, longest: usize, forced: Option<usize>) -> usize {
    let per = plan::ring_buffers(nranks);
    // The slice of one pass, and of passes in two lanes, within a budget of scratch.
    let within = |slice: usize, budget: usize| {
        let one = slice.min(budget / per);
        if longest <= one {
            one
        } else {
            slice.min(budget / (2 * per)).max(1)
        }
    };
    match (forced, gpu_ranks) {
        (Some(s), _) => within(s.max(1), DEVICE_SCRATCH_BYTES),
        (None, 0) => within(usize::MAX, SCRATCH_BYTES),
        (None, g) if g == nranks => within(usize::MAX, DEVICE_SCRATCH_BYTES),
        (None, _) => within(MIXED_SLICE_BYTES, DEVICE_SCRATCH_BYTES),
    }
}

pub use crate::config::Algorithm;

/// Which reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    AllReduce,
    /// `count` is the count each rank receives.
    ReduceScatter,
    Reduce {
        root: usize,
    },
}

/// The segment (a rank's share of a block) above which three ranks or more scatter rather than
/// run the ring, where the blocks fit the scratch. Host ranks on 2 cores, all-reduce of float32
/// (`flagcx-perf --blocking`, ring against scatter forced, alternating): 3 ranks, scatter
/// faster from 128 KiB (43 KiB segments; 131 against 178–214 µs); 4 ranks, ring faster at
/// 128 KiB (32 KiB segments; 60–69 against 70–90 µs), scatter from 512 KiB (271–278 against
/// 385–392 µs); 8 ranks, ring faster up to 256 KiB (32 KiB segments; 287–330 against 420–437
/// µs), scatter from 512 KiB (810–826 against 1582–1592 µs). Small segments go eagerly, where
/// the ring's few messages at a time beat `n − 1` at once.
pub const SCATTER_MIN_SEGMENT: usize = 32 << 10;

/// The algorithm for a call: `forced` where given (direct and scatter only where their blocks
/// fit the scratch), else direct for blocks up to [`DIRECT_MAX_BYTES`], scatter on three ranks
/// or more for blocks that fit and whose segments exceed [`SCATTER_MIN_SEGMENT`], else the
/// ring. `count` is the element count of the
/// call (for reduce-scatter, each rank's received count).
pub fn choose(
    nranks: usize,
    count: usize,
    dtype: DataType,
    forced: Option<Algorithm>,
) -> Algorithm {
    let block = count.saturating_mul(dtype.size());
    let fits = nranks.saturating_mul(block) <= SCRATCH_BYTES;
    match forced {
        Some(a @ (Algorithm::Direct | Algorithm::Scatter)) if fits => a,
        Some(_) => Algorithm::Ring,
        None if fits && block <= DIRECT_MAX_BYTES => Algorithm::Direct,
        None if fits && nranks >= 3 && block > nranks.saturating_mul(SCATTER_MIN_SEGMENT) => {
            Algorithm::Scatter
        }
        None => Algorithm::Ring,
    }
}

/// The ranks in the order their contributions to segment `j` are combined: rank order for the
/// direct and scatter algorithms, `j + 1, j + 2, …, j` (modulo the ranks) around the ring.
/// What a reference implementation follows to get the same bits.
pub fn combine_order(algo: Algorithm, nranks: usize, j: usize) -> Vec<usize> {
    match algo {
        Algorithm::Direct | Algorithm::Scatter => (0..nranks).collect(),
        Algorithm::Ring => (1..=nranks).map(|k| (j + k) % nranks).collect(),
    }
}

/// Segment `j` of an all-reduce or reduce of `count` elements over `nranks` ranks: (first
/// element, elements); the first `count % nranks` segments have one element more. (The
/// segments of a reduce-scatter are the ranks' blocks.)
pub fn segment(count: usize, nranks: usize, j: usize) -> (usize, usize) {
    let (base, extra) = (count / nranks, count % nranks);
    (j * base + j.min(extra), base + usize::from(j < extra))
}

/// What a reduction leaves on a rank, computed on the host in the order the library combines
/// (for tests and tools that check results bit for bit): `inputs[q]` is rank `q`'s send
/// buffer; `recvcount` is `Some(c)` for a reduce-scatter (each rank's share, `c` elements) and
/// `None` for an all-reduce or reduce of the whole buffer. The averaging step follows the sum,
/// as on the devices; one rank's result is its input.
pub fn reference(
    inputs: &[Vec<u8>],
    me: usize,
    recvcount: Option<usize>,
    dtype: DataType,
    op: ReduceOp,
    algo: Algorithm,
) -> Vec<u8> {
    use flagcx_adaptor::reduce::reduce_slices;
    let (n, sz) = (inputs.len(), dtype.size());
    let (combine, finish) = (ReduceStep::combining(op), ReduceStep::finishing(op, n));
    let part = |first: usize, len: usize, order: &[usize]| -> Vec<u8> {
        let bytes = first * sz..(first + len) * sz;
        let mut acc = inputs[order[0]][bytes.clone()].to_vec();
        if n == 1 {
            return acc;
        }
        for &q in &order[1..] {
            let mut out = vec![0u8; acc.len()];
            reduce_slices(&mut out, &acc, &inputs[q][bytes.clone()], dtype, combine);
            acc = out;
        }
        if let Some(step) = finish {
            let mut out = vec![0u8; acc.len()];
            reduce_slices(&mut out, &acc, &[], dtype, step);
            acc = out;
        }
        acc
    };
    match recvcount {
        Some(c) => part(me * c, c, &combine_order(algo, n, me)),
        None => {
            let count = inputs[0].len() / sz;
            (0..n)
                .flat_map(|j| {
                    let (first, len) = segment(count, n, j);
                    part(first, len, &combine_order(algo, n, j))
                })
                .collect()
        }
    }
}

impl<A: DeviceAdaptor> Comm<A> {
    /// All-reduce: every rank's `count` elements of `dtype` at `send`, combined with `op`
    /// element by element, arrive in every rank's `recv` (in place when `send == recv`). Every
    /// rank gets the same bits. Enqueued on `stream`; the returned [`Collective`] lets the host
    /// wait. A type that some rank's vendor cannot reduce fails on every rank (`Unsupported`).
    ///
    /// # Safety
    /// `send` and `recv` hold `count` elements of device memory of this adaptor, valid until
    /// the stream passes the call; `send` is not modified meanwhile.
    pub unsafe fn all_reduce_raw(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<Collective> {
        let in_place = send == recv;
        // SAFETY: the caller's contract.
        unsafe {
            self.reduction(
                Kind::AllReduce,
                (send, recv),
                count,
                dtype,
                op,
                in_place,
                stream,
            )
        }
    }

    /// Reduce-scatter: the ranks' `nranks × recvcount` elements at `send` are combined with
    /// `op`, and rank `q` receives elements `q × recvcount ..` of the result in `recv` (in
    /// place when `recv == send + rank × recvcount × size`).
    ///
    /// # Safety
    /// As [`Comm::all_reduce_raw`]; `send` holds `nranks × recvcount` elements, `recv`
    /// `recvcount`.
    pub unsafe fn reduce_scatter_raw(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recvcount: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<Collective> {
        let mine = (self.rank() * recvcount)
            .checked_mul(dtype.size())
            .and_then(|off| send.0.checked_add(off as u64))
            .ok_or_else(|| CommError::InvalidArgument("buffer offset overflows".into()))?;
        let in_place = recv.0 == mine;
        // SAFETY: the caller's contract.
        unsafe {
            self.reduction(
                Kind::ReduceScatter,
                (send, recv),
                recvcount,
                dtype,
                op,
                in_place,
                stream,
            )
        }
    }

    /// Reduce: every rank's `count` elements at `send`, combined with `op`, arrive in the
    /// root's `recv` (in place when the root passes `send == recv`); `recv` is not used on
    /// other ranks and may be null there.
    ///
    /// # Safety
    /// As [`Comm::all_reduce_raw`] (`recv` on the root only).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_raw(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
        stream: StreamHandle,
    ) -> Result<Collective> {
        if root >= self.nranks() {
            return Err(CommError::InvalidArgument(format!(
                "root {root} is out of range (the job has {} ranks)",
                self.nranks()
            )));
        }
        let in_place = self.rank() == root && send == recv;
        // SAFETY: the caller's contract.
        unsafe {
            self.reduction(
                Kind::Reduce { root },
                (send, recv),
                count,
                dtype,
                op,
                in_place,
                stream,
            )
        }
    }

    /// Checks, plans and enqueues one reduction.
    ///
    /// # Safety
    /// As the public calls.
    #[allow(clippy::too_many_arguments)]
    unsafe fn reduction(
        &self,
        kind: Kind,
        (send, recv): (DevicePtr, DevicePtr),
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        in_place: bool,
        stream: StreamHandle,
    ) -> Result<Collective> {
        if let Some(q) =
            (0..self.nranks()).find(|&q| self.infos[q].caps.reduce_types & dtype.bit() == 0)
        {
            let vendor = self.infos[q].vendor;
            tracing::warn!(
                "rank {q} ({vendor}) cannot reduce {dtype}: the reduction fails on every rank"
            );
            return Err(AdaptorError::Unsupported {
                vendor,
                op: "reduce_async",
            }
            .into());
        }
        if count == 0 {
            return Ok(Collective::default());
        }
        let bytes = count
            .checked_mul(dtype.size())
            .and_then(|b| b.checked_mul(self.nranks()))
            .ok_or_else(|| CommError::InvalidArgument(format!("{count} {dtype} overflow")))?
            / self.nranks();
        let send_len = match kind {
            Kind::ReduceScatter => bytes * self.nranks(),
            _ => bytes,
        };
        let gets = !matches!(kind, Kind::Reduce { root } if root != self.rank());
        let overlap = send.0 < recv.0.saturating_add(bytes as u64)
            && recv.0 < send.0.saturating_add(send_len as u64);
        if gets && overlap && !in_place {
            return Err(CommError::InvalidArgument(format!(
                "the receive buffer {recv} overlaps the send buffer {send} without being the \
                 in-place position"
            )));
        }
        if self.in_group() {
            // A reduction is a chain of dependent steps, which cannot join the group's single
            // hand-over: it is enqueued at the group's end, after the group's point-to-point
            // operations (their order on every rank, so ranks agree).
            // The returned collective follows it through a cell the group's end fills.
            let cell = crate::collectives::Deferred::default();
            let fill = cell.clone();
            let post: crate::comm::Deferred<A> = Box::new(move |c: &Comm<A>| {
                // SAFETY: the caller's contract keeps the buffers valid until the stream
                // passes the call, which the group's end enqueues.
                let r =
                    unsafe { c.reduction(kind, (send, recv), count, dtype, op, in_place, stream) };
                let out = r.as_ref().map(|_| ()).map_err(CommError::duplicate);
                *lock(&fill) = Some(r);
                out
            });
            self.defer(post);
            return Ok(Collective::deferred(cell));
        }
        let algo = choose(self.nranks(), count, dtype, self.config.reduce_algo);
        if let Some(s) = self.reduce_slots.as_ref().filter(|_| {
            kind == Kind::AllReduce && algo == Algorithm::Direct && bytes <= crate::slots::SLOTS_MAX
        }) {
            // SAFETY: the caller's contract.
            return unsafe { self.all_reduce_in_slots(s, (send, recv), count, dtype, op, stream) };
        }
        let shape = Shape {
            kind,
            rank: self.rank(),
            nranks: self.nranks(),
            count,
            dtype,
            op,
            algo,
            in_place,
            slice: ring_slice(
                self.nranks(),
                self.infos
                    .iter()
                    .filter(|i| matches!(i.vendor, Vendor::Cuda | Vendor::Hip))
                    .count(),
                match kind {
                    Kind::ReduceScatter => bytes,
                    _ => count.div_ceil(self.nranks()) * dtype.size(),
                },
                self.config.reduce_slice,
            ),
        };
        let steps = plan(&shape);
        // From here on a failure is this rank's alone (the scratch, a post, a reduction step
        // its vendor refused): the other ranks have posted or will post the call's messages
        // and would wait for this rank's. The communicator is aborted, so every peer's side
        // fails at once (its pairs with this rank are retired) instead of waiting out a
        // timeout, as NCCL's communicators are unusable after an error.
        // SAFETY: the caller's contract.
        let posted = unsafe { self.enqueue_plan(&steps, (dtype, op), (send, recv), stream) };
        // Once posted, a failure of any of the call's messages fails the communicator (the
        // engine aborts it), so that no rank goes on with data that never came.
        if let Ok(c) = &posted {
            if let Some(e) = c.make_fatal() {
                self.shared.record_fatal(&e);
                self.abort();
            }
        }
        if posted.is_err() {
            tracing::warn!(
                "rank {}: a reduction failed after its checks; aborting the communicator so no \
                 peer waits for its messages",
                self.rank()
            );
            self.abort();
        }
        posted
    }

    /// Enqueues `steps` on `stream` (the scratch taken for the call where a step names it).
    ///
    /// # Safety
    /// As the public calls.
    unsafe fn enqueue_plan(
        &self,
        steps: &[Step],
        (dtype, op): (DataType, ReduceOp),
        (send, recv): (DevicePtr, DevicePtr),
        stream: StreamHandle,
    ) -> Result<Collective> {
        let extent = scratch_extent(steps, dtype.size());
        let needs_scratch = extent > 0;
        let mut scratch = lock(&self.scratch);
        let scratch_ptr = if needs_scratch {
            // SCRATCH_BYTES, or at once the most a ring's slices take: a communicator grows
            // its scratch at most once (the outgrown allocation is kept until it is destroyed).
            let want = match extent {
                e if e <= SCRATCH_BYTES => SCRATCH_BYTES,
                e => e.max(DEVICE_SCRATCH_BYTES),
            };
            scratch.take(self.adaptor(), want, stream)?
        } else {
            DevicePtr(0)
        };
        let at = |At(buf, off): At| {
            let base = match buf {
                Buf::Send => send,
                Buf::Recv => recv,
                Buf::Scratch => scratch_ptr,
            };
            DevicePtr(base.0 + off as u64)
        };
        let mut c = Collective::default();
        let mut tail = false;
        // Which (peer, direction) pairs carried their first message of the call yet.
        let mut signed = std::collections::HashSet::new();
        for step in steps {
            let Step::Exchange { msgs, beside } = step else {
                // SAFETY: as below.
                unsafe { self.enqueue_local(step, &at, dtype, stream) }?;
                tail = true;
                continue;
            };
            let mut blocks: Vec<Block> = Vec::with_capacity(2 * msgs.len());
            for &(q, s, w, b) in msgs {
                let p = at(w);
                // The call's first message to or from each peer carries its signature in
                // where it splits (see the module doc): the same message on both ends,
                // whatever steps come before it on either.
                let first = self.config.reduce_check && b > 0 && signed.insert((q, s));
                match split_point(dtype, op, b).filter(|_| first) {
                    Some(k) => {
                        blocks.extend([(q, s, p, k), (q, s, DevicePtr(p.0 + k as u64), b - k)])
                    }
                    None => blocks.push((q, s, p, b)),
                }
            }
            // SAFETY: every block lies in the caller's buffers (its contract) or in the
            // scratch, which this call holds until the stream passes it; the plan's steps
            // beside the messages touch none of their bytes (`plan::overlap`).
            c.absorb(unsafe {
                self.post_group_beside(&blocks, stream, |_| {
                    beside
                        .iter()
                        .try_for_each(|l| self.enqueue_local(l, &at, dtype, stream))
                        .map(|()| !beside.is_empty())
                })
            }?);
            tail = !beside.is_empty();
        }
        if needs_scratch {
            scratch.used(self.adaptor(), stream)?;
        }
        if tail {
            self.track_stream_end(&mut c, stream)?;
        }
        Ok(c)
    }

    /// Enqueues one local step (a reduction step or a copy) of a plan on `stream`; `at` turns
    /// its places into pointers.
    ///
    /// # Safety
    /// As the public calls; the step's places lie in the call's buffers or its scratch.
    unsafe fn enqueue_local(
        &self,
        step: &Step,
        at: &impl Fn(At) -> DevicePtr,
        dtype: DataType,
        stream: StreamHandle,
    ) -> Result<()> {
        match *step {
            Step::Reduce {
                dst,
                a,
                b,
                count,
                step,
            } => {
                // SAFETY: the caller's contract.
                unsafe {
                    self.adaptor()
                        .reduce_async(at(dst), at(a), at(b), count, dtype, step, stream)
                }?
            }
            Step::Copy { dst, src, bytes } => {
                // SAFETY: the caller's contract.
                unsafe {
                    self.adaptor()
                        .memcpy_d2d_async(at(dst), at(src), bytes, stream)
                }?
            }
            Step::Exchange { .. } => {
                return Err(CommError::InvalidArgument(
                    "a plan's exchange is not a local step".into(),
                ))
            }
        }
        Ok(())
    }
}

mod plan;
mod slots;

pub(crate) use plan::{plan, scratch_extent, At, Buf, Shape, Step};
#[cfg(test)]
mod tests;
