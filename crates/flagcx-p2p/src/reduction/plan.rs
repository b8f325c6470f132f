//! A reduction's plan: the steps of one call on one rank — exchanges, reduction steps, local
//! copies — as a pure function of its [`Shape`] (see the parent module for the algorithms and
//! the order they combine in), and the scratch a plan reaches.

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

/// One step of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// One group: (peer, send?, where, bytes).
    Exchange(Vec<(usize, bool, At, usize)>),
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
    match sh.algo {
        Algorithm::Direct => direct(sh),
        Algorithm::Ring => ring(sh),
    }
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
    steps.push(Step::Exchange(ex));
    if !gets {
        return steps;
    }
    // In place, this rank's own block is the result buffer, which the chain's first step
    // overwrites: from rank 2 on, the block is needed after that, so it is copied aside.
    let mut own = mine_in(r);
    if sh.in_place && r >= 2 {
        let aside = At(Buf::Scratch, (n - 1) * bytes);
        steps.push(Step::Copy {
            dst: aside,
            src: own,
            bytes,
        });
        own = aside;
    }
    let x = |q: usize| if q == r { own } else { slot(q) };
    let out = At(Buf::Recv, 0);
    for k in 1..n {
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
    steps
}

fn ring(sh: &Shape) -> Vec<Step> {
    let (r, n, sz) = (sh.rank, sh.nranks, sh.dtype.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let seg = |j: usize| sh.segment(j % n);
    let chunk = (sh.slice / sz).max(1);
    let longest = (0..n).map(|j| seg(j).1).max().unwrap_or(0);
    let rounds = longest.div_ceil(chunk);
    // Two ranks use only the first (one ring step per slice).
    let bufs = [At(Buf::Scratch, 0), At(Buf::Scratch, chunk * sz)];
    // Modulo n without underflow: ranks and steps are below n.
    let back = |k: usize| (r + 2 * n - k) % n;
    let mut steps = Vec::new();
    for round in 0..rounds {
        // This round's slice of segment j: (first element, elements).
        let part = |j: usize| {
            let (first, len) = seg(j);
            let from = (round * chunk).min(len);
            (first + from, (len - from).min(chunk))
        };
        let in_send = |j: usize| At(Buf::Send, part(j).0 * sz);
        let in_recv = |j: usize| At(Buf::Recv, part(j).0 * sz);
        let fin = match sh.kind {
            Kind::AllReduce => in_recv(r),
            Kind::ReduceScatter => At(Buf::Recv, (part(r).0 - seg(r).0) * sz),
            Kind::Reduce { root } if root == r => in_recv(r),
            Kind::Reduce { .. } => bufs[(n - 2) % 2],
        };
        for s in 0..n - 1 {
            let (sj, rj) = (back(s + 1), back(s + 2));
            let src = if s == 0 {
                in_send(sj)
            } else {
                bufs[(s - 1) % 2]
            };
            let mut ex = Vec::new();
            if part(sj).1 > 0 {
                ex.push((next, true, src, part(sj).1 * sz));
            }
            if part(rj).1 > 0 {
                ex.push((prev, false, bufs[s % 2], part(rj).1 * sz));
            }
            if !ex.is_empty() {
                steps.push(Step::Exchange(ex));
            }
            if part(rj).1 > 0 {
                steps.push(Step::Reduce {
                    dst: if s == n - 2 { fin } else { bufs[s % 2] },
                    a: bufs[s % 2],
                    b: in_send(rj),
                    count: part(rj).1,
                    step: sh.combine(),
                });
            }
        }
        if let (Some(f), true) = (sh.finish(), part(r).1 > 0) {
            steps.push(Step::Reduce {
                dst: fin,
                a: fin,
                b: fin,
                count: part(r).1,
                step: f,
            });
        }
        if let Kind::Reduce { root } = sh.kind {
            let ex: Vec<_> = if r == root {
                (0..n)
                    .filter(|&q| q != r && part(q).1 > 0)
                    .map(|q| (q, false, in_recv(q), part(q).1 * sz))
                    .collect()
            } else if part(r).1 > 0 {
                vec![(root, true, fin, part(r).1 * sz)]
            } else {
                vec![]
            };
            if !ex.is_empty() {
                steps.push(Step::Exchange(ex));
            }
        }
    }
    // All-reduce: the all-gather moves whole segments from receive buffer to receive buffer,
    // once every slice is combined: n − 1 dependent exchanges instead of n − 1 per slice (each
    // exchange costs a hand-off between the ranks' streams, ~45 µs between two CUDA ranks on
    // one H100, which 4 MiB slices of a 128 MiB all-reduce paid 32 times).
    if sh.kind == Kind::AllReduce {
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
                steps.push(Step::Exchange(ex));
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
            Step::Exchange(ex) => ex
                .iter()
                .map(|&(_, _, at, b)| end(at, b))
                .max()
                .unwrap_or(0),
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
