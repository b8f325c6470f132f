//! A reduction's plan: the steps of one call on one rank — exchanges, reduction steps, local
//! copies — as a pure function of its [`Shape`] (see the parent module for the algorithms and
//! the order they combine in), and the scratch a plan reaches.
//!
//! A plan is written as a serial list, each step after the one before, and then [`overlap`]
//! moves each run of local steps that touches nothing the next exchange touches beside that
//! exchange: they are enqueued after its messages are handed over and before the stream waits
//! for them, so a slice is combined while the next one moves. The ring lays its buffers out so
//! that this is so for its long runs (consecutive slices in different buffers).

use flagcx_adaptor::reduce::{DataType, ReduceOp, ReduceStep};

use super::{segment, Algorithm, Kind};

/// The buffers a plan names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Buf {
    Send,
    Recv,
    Scratch,
}

/// A byte offset in one of the buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct At(pub(crate) Buf, pub(crate) usize);

/// One message of an exchange: (peer, send?, where, bytes).
pub(crate) type Msg = (usize, bool, At, usize);

/// One step of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// One group of messages, and the local steps that run while they move (see [`overlap`]):
    /// none of them touches a byte the messages read or write.
    Exchange { msgs: Vec<Msg>, beside: Vec<Step> },
    /// A reduction step over `count` elements.
    Reduce {
        dst: At,
        a: At,
        b: At,
        count: usize,
        step: ReduceStep,
    },
    /// A local copy.
    Copy { dst: At, src: At, bytes: usize },
}

/// Everything a plan depends on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) kind: Kind,
    pub(crate) rank: usize,
    pub(crate) nranks: usize,
    pub(crate) count: usize,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
    pub(crate) algo: Algorithm,
    pub(crate) in_place: bool,
    /// The ring's slice in bytes ([`super::ring_slice`]).
    pub(crate) slice: usize,
}

impl Shape {
    fn combine(&self) -> ReduceStep {
        ReduceStep::combining(self.op)
    }

    fn finish(&self) -> Option<ReduceStep> {
        ReduceStep::finishing(self.op, self.nranks)
    }

    /// Segment `j` of the data: (first element, elements) in the send buffer's numbering.
    pub(crate) fn segment(&self, j: usize) -> (usize, usize) {
        match self.kind {
            Kind::ReduceScatter => (j * self.count, self.count),
            _ => segment(self.count, self.nranks, j),
        }
    }
}

/// The plan of one call (`count > 0`).
pub(crate) fn plan(sh: &Shape) -> Vec<Step> {
    let sz = sh.dtype.size();
    if sh.nranks == 1 {
        // Nothing to combine: the data is the result (an average of one is itself).
        let bytes = sh.count * sz;
        return match (sh.kind, sh.in_place) {
            (_, true) => vec![],
            _ => vec![Step::Copy {
                dst: At(Buf::Recv, 0),
                src: At(Buf::Send, 0),
                bytes,
            }],
        };
    }
    let serial = match sh.algo {
        Algorithm::Direct => direct(sh),
        Algorithm::Scatter if sh.kind == Kind::ReduceScatter => direct(sh),
        Algorithm::Scatter => scatter(sh),
        Algorithm::Ring => ring(sh),
    };
    overlap(serial, sh)
}

/// A plan's serial steps with each run of local steps that ends right before an exchange, as
/// far back as its steps touch nothing the exchange's messages touch, moved beside that
/// exchange. Their order among themselves is kept, and the exchange's sends read what they
/// would have read after them (the steps write none of it).
fn overlap(serial: Vec<Step>, sh: &Shape) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::with_capacity(serial.len());
    for step in serial {
        let Step::Exchange { msgs, beside } = step else {
            out.push(step);
            continue;
        };
        let mut from = out.len();
        while from > 0 && apart(&out[from - 1], &msgs, sh) {
            from -= 1;
        }
        let mut moved = out.split_off(from);
        moved.extend(beside);
        out.push(Step::Exchange {
            msgs,
            beside: moved,
        });
    }
    out
}

/// A byte range of one memory: the scratch, the user's buffers (the send buffer, and the
/// receive buffer where the call is in place), or the receive buffer.
type Span = (u8, std::ops::Range<usize>);

/// Where `at` lies for `len` bytes; in place, the receive buffer is the send buffer at the
/// rank's offset (reduce-scatter) or at 0.
fn span(sh: &Shape, at: At, len: usize) -> Span {
    let (mem, off) = match (at.0, sh.in_place) {
        (Buf::Scratch, _) => (0, at.1),
        (Buf::Send, _) => (1, at.1),
        (Buf::Recv, true) => match sh.kind {
            Kind::ReduceScatter => (1, at.1 + sh.rank * sh.count * sh.dtype.size()),
            _ => (1, at.1),
        },
        (Buf::Recv, false) => (2, at.1),
    };
    (mem, off..off + len)
}

fn meet(x: &Span, y: &Span) -> bool {
    x.0 == y.0 && x.1.start < y.1.end && y.1.start < x.1.end
}

/// Whether the local step `step` touches no byte that `msgs` read (sends) or write (receives),
/// and writes nothing they read: then it may run while they move. An exchange is never apart.
fn apart(step: &Step, msgs: &[Msg], sh: &Shape) -> bool {
    let sz = sh.dtype.size();
    let (reads, writes): (Vec<Span>, Span) = match *step {
        Step::Exchange { .. } => return false,
        Step::Reduce {
            dst, a, b, count, ..
        } => (
            vec![span(sh, a, count * sz), span(sh, b, count * sz)],
            span(sh, dst, count * sz),
        ),
        Step::Copy { dst, src, bytes } => (vec![span(sh, src, bytes)], span(sh, dst, bytes)),
    };
    msgs.iter().all(|&(_, send, at, bytes)| {
        let m = span(sh, at, bytes);
        !meet(&m, &writes) && (send || !reads.iter().any(|r| meet(&m, r)))
    })
}

fn direct(sh: &Shape) -> Vec<Step> {
    let (r, n, sz) = (sh.rank, sh.nranks, sh.dtype.size());
    // A rank's block: the whole data, or (reduce-scatter) one rank's part of it.
    let count = sh.count;
    let bytes = count * sz;
    let slot = |q: usize| At(Buf::Scratch, if q < r { q } else { q - 1 } * bytes);
    // Where rank q's contribution to this rank's result starts in q's send buffer.
    let mine_in = |q: usize| match sh.kind {
        Kind::ReduceScatter => At(Buf::Send, q * bytes),
        _ => At(Buf::Send, 0),
    };
    let mut steps = Vec::new();
    let gets = match sh.kind {
        Kind::Reduce { root } => r == root,
        _ => true,
    };
    let mut ex = Vec::new();
    for q in (0..n).filter(|&q| q != r) {
        let sends = match sh.kind {
            Kind::Reduce { root } => q == root,
            _ => true,
        };
        if sends {
            ex.push((q, true, mine_in(q), bytes));
        }
        if gets {
            ex.push((q, false, slot(q), bytes));
        }
    }
    steps.push(exchange(ex));
    if !gets {
        return steps;
    }
    // In place, this rank's own block is the result buffer.
    let own = mine_in(r);
    let aside = At(Buf::Scratch, (n - 1) * bytes);
    combine_in_rank_order(
        sh,
        &mut steps,
        (At(Buf::Recv, 0), count),
        own,
        sh.in_place,
        aside,
        slot,
    );
    steps
}

/// Combines the ranks' pieces of `count` elements into `out` in rank order,
/// `((x0 ∘ x1) ∘ x2) ∘ …`, then averages where the operator does: `x(q)` is this rank's own
/// piece `own` for `q == rank`, else `slot(q)`. Where the own piece lies at `out` (`at_out`:
/// in place), the chain's first step overwrites it, which from rank 2 on is before it is used:
/// it is copied to `aside` first.
fn combine_in_rank_order(
    sh: &Shape,
    steps: &mut Vec<Step>,
    (out, count): (At, usize),
    mut own: At,
    at_out: bool,
    aside: At,
    slot: impl Fn(usize) -> At,
) {
    let r = sh.rank;
    if at_out && r >= 2 {
        steps.push(Step::Copy {
            dst: aside,
            src: own,
            bytes: count * sh.dtype.size(),
        });
        own = aside;
    }
    let x = |q: usize| if q == r { own } else { slot(q) };
    for k in 1..sh.nranks {
        steps.push(Step::Reduce {
            dst: out,
            a: if k == 1 { x(0) } else { out },
            b: x(k),
            count,
            step: sh.combine(),
        });
    }
    if let Some(f) = sh.finish() {
        steps.push(Step::Reduce {
            dst: out,
            a: out,
            b: out,
            count,
            step: f,
        });
    }
}

/// The scatter algorithm of an all-reduce or reduce: segment `q` of every rank's data to rank
/// `q`, combined there in rank order, then every combined segment to every rank (all-reduce)
/// or to the root (reduce).
fn scatter(sh: &Shape) -> Vec<Step> {
    let (r, n, sz) = (sh.rank, sh.nranks, sh.dtype.size());
    let seg = |j: usize| sh.segment(j);
    let len = seg(r).1;
    let bytes = len * sz;
    let slot_bytes = seg(0).1 * sz;
    // Scratch: the other ranks' pieces of this rank's segment, then room for the own piece
    // copied aside (in place) and for a reduce's combined segment off the root.
    let slot = |q: usize| At(Buf::Scratch, if q < r { q } else { q - 1 } * slot_bytes);
    let spare = |k: usize| At(Buf::Scratch, (n - 1 + k) * slot_bytes);
    let in_send = |j: usize| At(Buf::Send, seg(j).0 * sz);
    let in_recv = |j: usize| At(Buf::Recv, seg(j).0 * sz);
    let root = match sh.kind {
        Kind::Reduce { root } => Some(root),
        _ => None,
    };
    let fin = match root {
        Some(root) if root != r => spare(1),
        _ => in_recv(r),
    };
    let mut steps = Vec::new();
    let mut ex = Vec::new();
    for q in (0..n).filter(|&q| q != r) {
        if seg(q).1 > 0 {
            ex.push((q, true, in_send(q), seg(q).1 * sz));
        }
        if len > 0 {
            ex.push((q, false, slot(q), bytes));
        }
    }
    if !ex.is_empty() {
        steps.push(exchange(ex));
    }
    if len > 0 {
        // In place (off a reduce's other ranks) the own piece is the result's place.
        let at_out = sh.in_place && fin == in_recv(r);
        combine_in_rank_order(
            sh,
            &mut steps,
            (fin, len),
            in_send(r),
            at_out,
            spare(0),
            slot,
        );
    }
    let mut ex = Vec::new();
    for q in (0..n).filter(|&q| q != r) {
        let (to_q, from_q) = match root {
            None => (true, true),
            Some(root) => (q == root, r == root),
        };
        if to_q && len > 0 {
            ex.push((q, true, fin, bytes));
        }
        if from_q && seg(q).1 > 0 {
            ex.push((q, false, in_recv(q), seg(q).1 * sz));
        }
    }
    if !ex.is_empty() {
        steps.push(exchange(ex));
    }
    steps
}

fn exchange(msgs: Vec<Msg>) -> Step {
    Step::Exchange {
        msgs,
        beside: Vec::new(),
    }
}

/// The ring's buffers per pass: one on two ranks (a pass is one step: the received slice is
/// combined straight into its place), else two (step `s` receives into one while the slice
/// combined in the other at step `s − 1` is sent on).
pub(crate) fn ring_buffers(nranks: usize) -> usize {
    if nranks == 2 {
        1
    } else {
        2
    }
}

fn ring(sh: &Shape) -> Vec<Step> {
    let (r, n, sz) = (sh.rank, sh.nranks, sh.dtype.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let seg = |j: usize| sh.segment(j % n);
    let chunk = (sh.slice / sz).max(1);
    let longest = (0..n).map(|j| seg(j).1).max().unwrap_or(0);
    let rounds = longest.div_ceil(chunk);
    // Consecutive passes take turns between two lanes of buffers, so that one pass's slice is
    // combined while the next one's moves ([`overlap`]).
    let per = ring_buffers(n);
    let buf = |round: usize, s: usize| At(Buf::Scratch, ((round % 2) * per + s % per) * chunk * sz);
    // Modulo n without underflow: ranks and steps are below n.
    let back = |k: usize| (r + 2 * n - k) % n;
    // Pass `round`'s slice of segment j: (first element, elements).
    let part = |round: usize, j: usize| {
        let (first, len) = seg(j);
        let from = (round * chunk).min(len);
        (first + from, (len - from).min(chunk))
    };
    let in_send = |round: usize, j: usize| At(Buf::Send, part(round, j).0 * sz);
    let in_recv = |round: usize, j: usize| At(Buf::Recv, part(round, j).0 * sz);
    // Where pass `round` leaves this rank's combined slice.
    let fin = |round: usize| match sh.kind {
        Kind::AllReduce => in_recv(round, r),
        Kind::ReduceScatter => At(Buf::Recv, (part(round, r).0 - seg(r).0) * sz),
        Kind::Reduce { root } if root == r => in_recv(round, r),
        Kind::Reduce { .. } => buf(round, n - 2),
    };
    // Step `s` of pass `round`: its exchange, its combining, and after the last its average.
    let ring_step = |round: usize, s: usize, steps: &mut Vec<Step>, extra: Vec<Msg>| {
        let (sj, rj) = (back(s + 1), back(s + 2));
        let (out, got) = (part(round, sj).1, part(round, rj).1);
        let src = if s == 0 {
            in_send(round, sj)
        } else {
            buf(round, s - 1)
        };
        let mut ex = Vec::new();
        if out > 0 {
            ex.push((next, true, src, out * sz));
        }
        if got > 0 {
            ex.push((prev, false, buf(round, s), got * sz));
        }
        ex.extend(extra);
        if !ex.is_empty() {
            steps.push(exchange(ex));
        }
        if got > 0 {
            steps.push(Step::Reduce {
                dst: if s == n - 2 {
                    fin(round)
                } else {
                    buf(round, s)
                },
                a: buf(round, s),
                b: in_send(round, rj),
                count: got,
                step: sh.combine(),
            });
        }
        if let (Some(f), true, true) = (sh.finish(), s == n - 2, part(round, r).1 > 0) {
            steps.push(Step::Reduce {
                dst: fin(round),
                a: fin(round),
                b: fin(round),
                count: part(round, r).1,
                step: f,
            });
        }
    };
    // Two ranks' all-reduce sends each combined slice back two passes later, with that pass's
    // exchange (no exchange of its own; by then the slice is combined and its buffer's turn is
    // over); more ranks' all-gather moves whole segments at the end (`n − 1` exchanges).
    let gather_slices = n == 2 && sh.kind == Kind::AllReduce;
    let gather = |round: usize| -> Vec<Msg> {
        let (mine, theirs) = (part(round, r), part(round, back(1)));
        let mut ex = Vec::new();
        if mine.1 > 0 {
            ex.push((next, true, fin(round), mine.1 * sz));
        }
        if theirs.1 > 0 {
            ex.push((prev, false, in_recv(round, back(1)), theirs.1 * sz));
        }
        ex
    };
    let mut steps = Vec::new();
    // Passes go in pairs, one step of each in turn (the pair's lanes differ), so that a
    // step's combining of one pass runs while the other pass's next step moves.
    for pair in (0..rounds).step_by(2) {
        let pass = pair..(pair + 2).min(rounds);
        for s in 0..n - 1 {
            for round in pass.clone() {
                let extra = match round.checked_sub(2) {
                    Some(old) if gather_slices => gather(old),
                    _ => Vec::new(),
                };
                ring_step(round, s, &mut steps, extra);
            }
        }
        if let Kind::Reduce { root } = sh.kind {
            for round in pass {
                let ex: Vec<_> = if r == root {
                    (0..n)
                        .filter(|&q| q != r && part(round, q).1 > 0)
                        .map(|q| (q, false, in_recv(round, q), part(round, q).1 * sz))
                        .collect()
                } else if part(round, r).1 > 0 {
                    vec![(root, true, fin(round), part(round, r).1 * sz)]
                } else {
                    vec![]
                };
                if !ex.is_empty() {
                    steps.push(exchange(ex));
                }
            }
        }
    }
    if gather_slices {
        for round in rounds.saturating_sub(2)..rounds {
            let ex = gather(round);
            if !ex.is_empty() {
                steps.push(exchange(ex));
            }
        }
    } else if sh.kind == Kind::AllReduce {
        // All-reduce: the all-gather moves whole segments from receive buffer to receive
        // buffer once every slice is combined: n − 1 dependent exchanges instead of n − 1 per
        // slice (each exchange costs a hand-off between the ranks' streams, ~45 µs between two
        // CUDA ranks on one H100, which 4 MiB slices of a 128 MiB all-reduce paid 32 times).
        let whole = |j: usize| At(Buf::Recv, seg(j).0 * sz);
        for s in 0..n - 1 {
            let (sj, rj) = (back(s), back(s + 1));
            let mut ex = Vec::new();
            if seg(sj).1 > 0 {
                ex.push((next, true, whole(sj), seg(sj).1 * sz));
            }
            if seg(rj).1 > 0 {
                ex.push((prev, false, whole(rj), seg(rj).1 * sz));
            }
            if !ex.is_empty() {
                steps.push(exchange(ex));
            }
        }
    }
    steps
}

/// The scratch bytes `steps` reach (0 where none names the scratch); `sz` is the element size.
pub(crate) fn scratch_extent(steps: &[Step], sz: usize) -> usize {
    let end = |at: At, len: usize| if at.0 == Buf::Scratch { at.1 + len } else { 0 };
    steps
        .iter()
        .map(|s| match s {
            Step::Exchange { msgs, beside } => msgs
                .iter()
                .map(|&(_, _, at, b)| end(at, b))
                .max()
                .unwrap_or(0)
                .max(scratch_extent(beside, sz)),
            &Step::Reduce {
                dst, a, b, count, ..
            } => [dst, a, b]
                .iter()
                .map(|&x| end(x, count * sz))
                .max()
                .unwrap_or(0),
            &Step::Copy { dst, src, bytes } => end(dst, bytes).max(end(src, bytes)),
        })
        .max()
        .unwrap_or(0)
}
