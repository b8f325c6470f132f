//! The plans, run by a simulator of the ranks (host memory, message queues per directed pair):
//! every rank's result is the reference combined in the order the module docs promise, every
//! rank of a call ends with the same bits, and no plan deadlocks or reads what it never wrote.

use std::collections::{HashMap, VecDeque};

use flagcx_adaptor::reduce::{reduce_slices, DataType, ReduceOp, ReduceStep};

use super::{
    choose, plan, ring_slice, scratch_extent, Algorithm, At, Buf, Kind, Shape, Step,
    DEVICE_SCRATCH_BYTES, MIXED_SLICE_BYTES, SCRATCH_BYTES,
};

/// A rank's buffers.
struct Mem {
    send: Vec<u8>,
    recv: Vec<u8>,
    scratch: Vec<u8>,
}

impl Mem {
    fn buf(&mut self, b: Buf, in_place: Option<usize>) -> &mut Vec<u8> {
        match (b, in_place) {
            // In place, `recv` is a view of `send` at an offset: the simulator keeps one
            // buffer and shifts offsets (see `resolve`).
            (Buf::Recv, Some(_)) | (Buf::Send, _) => &mut self.send,
            (Buf::Recv, None) => &mut self.recv,
            (Buf::Scratch, _) => &mut self.scratch,
        }
    }
}

/// Where `at` lies: (buffer, byte offset), with `recv` redirected into `send` in place.
fn resolve(at: At, in_place: Option<usize>) -> (Buf, usize) {
    match (at.0, in_place) {
        (Buf::Recv, Some(shift)) => (Buf::Send, at.1 + shift),
        _ => (at.0, at.1),
    }
}

fn read(m: &mut Mem, at: At, len: usize, ip: Option<usize>) -> Vec<u8> {
    let (b, off) = resolve(at, ip);
    m.buf(b, ip)[off..off + len].to_vec()
}

fn write(m: &mut Mem, at: At, data: &[u8], ip: Option<usize>) {
    let (b, off) = resolve(at, ip);
    m.buf(b, ip)[off..off + data.len()].copy_from_slice(data);
}

/// The scratch bytes a plan reaches (at most [`DEVICE_SCRATCH_BYTES`], asserted).
fn scratch_needed(steps: &[Step], sz: usize) -> usize {
    let need = scratch_extent(steps, sz);
    assert!(
        need <= DEVICE_SCRATCH_BYTES,
        "a plan reaches {need} bytes of scratch"
    );
    need
}

/// Runs one local step on a rank's memory.
fn run_local(m: &mut Mem, step: &Step, dtype: DataType, ip: Option<usize>) {
    let sz = dtype.size();
    match *step {
        Step::Reduce {
            dst,
            a,
            b,
            count,
            step,
        } => {
            let x = read(m, a, count * sz, ip);
            let y = read(m, b, count * sz, ip);
            let mut out = vec![0u8; count * sz];
            reduce_slices(&mut out, &x, &y, dtype, step);
            write(m, dst, &out, ip);
        }
        Step::Copy { dst, src, bytes } => {
            let x = read(m, src, bytes, ip);
            write(m, dst, &x, ip);
        }
        Step::Exchange { .. } => panic!("an exchange beside an exchange"),
    }
}

/// Runs every rank's plan to the end; returns each rank's memory. The local steps beside an
/// exchange run before its sends are read (`beside_first`) or after its receives landed: a
/// step that touched the messages' bytes would make the two differ.
fn simulate(
    shapes: &[Shape],
    mut mems: Vec<Mem>,
    in_place: &[Option<usize>],
    beside_first: bool,
) -> Vec<Mem> {
    let n = shapes.len();
    let plans: Vec<Vec<Step>> = shapes.iter().map(plan).collect();
    let mut pc = vec![0usize; n];
    let mut sent = vec![false; n];
    let mut queues: HashMap<(usize, usize), VecDeque<Vec<u8>>> = HashMap::new();
    loop {
        let mut moved = false;
        for r in 0..n {
            while pc[r] < plans[r].len() {
                let dtype = shapes[r].dtype;
                let ip = in_place[r];
                match &plans[r][pc[r]] {
                    Step::Exchange { msgs, beside } => {
                        if !sent[r] {
                            if beside_first {
                                beside
                                    .iter()
                                    .for_each(|l| run_local(&mut mems[r], l, dtype, ip));
                            }
                            for &(q, s, at, bytes) in msgs {
                                if s {
                                    let data = read(&mut mems[r], at, bytes, ip);
                                    queues.entry((r, q)).or_default().push_back(data);
                                }
                            }
                            sent[r] = true;
                        }
                        // A pair's messages match in the order they were posted.
                        let mut nth: HashMap<usize, usize> = HashMap::new();
                        let ready = msgs.iter().filter(|e| !e.1).all(|&(q, _, _, bytes)| {
                            let i = *nth.entry(q).and_modify(|i| *i += 1).or_insert(0);
                            queues.get(&(q, r)).and_then(|v| v.get(i)).is_some_and(|m| {
                                assert_eq!(m.len(), bytes, "rank {r}: size from {q}");
                                true
                            })
                        });
                        if !ready {
                            break;
                        }
                        for &(q, s, at, _) in msgs {
                            if !s {
                                let m = queues.get_mut(&(q, r)).unwrap().pop_front().unwrap();
                                write(&mut mems[r], at, &m, ip);
                            }
                        }
                        if !beside_first {
                            beside
                                .iter()
                                .for_each(|l| run_local(&mut mems[r], l, dtype, ip));
                        }
                        sent[r] = false;
                    }
                    local => run_local(&mut mems[r], local, dtype, ip),
                }
                pc[r] += 1;
                moved = true;
            }
        }
        if (0..n).all(|r| pc[r] == plans[r].len()) {
            break;
        }
        assert!(moved, "the plans deadlocked at steps {pc:?}");
    }
    assert!(
        queues.values().all(VecDeque::is_empty),
        "messages sent and never received"
    );
    mems
}

/// Deterministic operands: rank `r`'s bytes, with some NaN-prone bit patterns for floats.
fn operand(r: usize, len: usize, seed: u64) -> Vec<u8> {
    let mut x = (r as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Combines `count` elements of `inputs` in `order` with `op`, then averages: the reference.
fn reference(
    inputs: &[Vec<u8>],
    range: std::ops::Range<usize>,
    order: &[usize],
    dtype: DataType,
    op: ReduceOp,
) -> Vec<u8> {
    let sz = dtype.size();
    let bytes = range.start * sz..range.end * sz;
    let combine = ReduceStep::Combine(if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    });
    let mut acc = inputs[order[0]][bytes.clone()].to_vec();
    for &q in &order[1..] {
        let mut out = vec![0u8; acc.len()];
        reduce_slices(&mut out, &acc, &inputs[q][bytes.clone()], dtype, combine);
        acc = out;
    }
    if op == ReduceOp::Avg && inputs.len() > 1 {
        let mut out = vec![0u8; acc.len()];
        let n = inputs.len() as u32;
        reduce_slices(&mut out, &acc, &[], dtype, ReduceStep::Average { n });
        acc = out;
    }
    acc
}

/// One call on `n` simulated ranks, checked against the reference in the algorithm's order.
#[allow(clippy::too_many_arguments)]
fn check(
    kind: Kind,
    n: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    algo: Algorithm,
    ip: bool,
    slice: usize,
) {
    let sz = dtype.size();
    let (send_elems, recv_elems) = match kind {
        Kind::ReduceScatter => (n * count, count),
        _ => (count, count),
    };
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|r| operand(r, send_elems * sz, count as u64 * 31 + n as u64))
        .collect();
    let shapes: Vec<Shape> = (0..n)
        .map(|rank| Shape {
            kind,
            rank,
            nranks: n,
            count,
            dtype,
            op,
            algo,
            in_place: ip
                && match kind {
                    Kind::Reduce { root } => rank == root,
                    _ => true,
                },
            slice,
        })
        .collect();
    let in_place: Vec<Option<usize>> = shapes
        .iter()
        .map(|s| {
            s.in_place.then_some(match kind {
                Kind::ReduceScatter => s.rank * count * sz,
                _ => 0,
            })
        })
        .collect();
    for beside_first in [false, true] {
        let mems = (0..n)
            .map(|r| Mem {
                send: inputs[r].clone(),
                recv: vec![0xEE; recv_elems * sz],
                scratch: vec![0xDD; scratch_needed(&plan(&shapes[r]), sz)],
            })
            .collect();
        let mems = simulate(&shapes, mems, &in_place, beside_first);
        let what = format!(
            "{kind:?} n={n} count={count} {dtype} {op} {algo:?} in_place={ip} slice={slice} \
             beside_first={beside_first}"
        );
        compare(&shapes, &inputs, mems, &in_place, algo, &what);
    }
}

/// Every rank's result in `mems` against the reference in the algorithm's order.
fn compare(
    shapes: &[Shape],
    inputs: &[Vec<u8>],
    mut mems: Vec<Mem>,
    in_place: &[Option<usize>],
    algo: Algorithm,
    what: &str,
) {
    let (n, kind, count, dtype, op) = (
        shapes.len(),
        shapes[0].kind,
        shapes[0].count,
        shapes[0].dtype,
        shapes[0].op,
    );
    let sz = dtype.size();
    let recv_elems = count;
    // The order segment j is combined in, and the elements it covers.
    let order = |j: usize| -> Vec<usize> {
        match algo {
            Algorithm::Direct | Algorithm::Scatter => (0..n).collect(),
            Algorithm::Ring => (1..=n).map(|k| (j + k) % n).collect(),
        }
    };
    for r in 0..n {
        let got: Vec<u8> = {
            let len = recv_elems * sz;
            match in_place[r] {
                Some(shift) => mems[r].send[shift..shift + len].to_vec(),
                None => std::mem::take(&mut mems[r].recv),
            }
        };
        let wants_result = match kind {
            Kind::Reduce { root } => r == root,
            _ => true,
        };
        if !wants_result {
            continue;
        }
        let want: Vec<u8> = match kind {
            Kind::ReduceScatter => {
                reference(inputs, r * count..(r + 1) * count, &order(r), dtype, op)
            }
            _ => {
                let sh = &shapes[r];
                let mut all = Vec::new();
                for j in 0..n {
                    let (first, len) = sh.segment(j);
                    let o = if algo != Algorithm::Ring || n == 1 {
                        order(0)
                    } else {
                        order(j)
                    };
                    all.extend(reference(inputs, first..first + len, &o, dtype, op));
                }
                all
            }
        };
        if n == 1 {
            // Nothing is combined: the input itself.
            assert_eq!(got, inputs[0][..recv_elems * sz], "{what}");
            continue;
        }
        assert!(got == want, "{what}: rank {r} differs from the reference");
    }
}

#[test]
fn every_plan_gives_the_reference_on_every_rank() {
    for n in 1..=5 {
        for count in [1usize, 2, 7, 13, 64] {
            for algo in [Algorithm::Ring, Algorithm::Direct, Algorithm::Scatter] {
                for ip in [false, true] {
                    for (dtype, op) in [
                        (DataType::F32, ReduceOp::Sum),
                        (DataType::BF16, ReduceOp::Avg),
                        (DataType::I8, ReduceOp::Prod),
                        (DataType::F64, ReduceOp::Max),
                        (DataType::U32, ReduceOp::Avg),
                    ] {
                        for kind in [
                            Kind::AllReduce,
                            Kind::ReduceScatter,
                            Kind::Reduce { root: 0 },
                            Kind::Reduce { root: n - 1 },
                        ] {
                            // The host slice (one pass at these counts), and slices of a few
                            // elements: many passes, the last one short.
                            for slice in [ring_slice(n, 0, 0, None), 8, 24] {
                                check(kind, n, count, dtype, op, algo, ip, slice);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Segments longer than a slice move in several ring passes.
#[test]
fn the_ring_slices_long_segments() {
    let count = 3 * (SCRATCH_BYTES / 2) / 4 + 5;
    for kind in [Kind::AllReduce, Kind::Reduce { root: 1 }] {
        check(
            kind,
            2,
            2 * count,
            DataType::F32,
            ReduceOp::Sum,
            Algorithm::Ring,
            false,
            ring_slice(2, 0, 4 * count, None),
        );
    }
    check(
        Kind::ReduceScatter,
        3,
        count,
        DataType::I32,
        ReduceOp::Min,
        Algorithm::Ring,
        true,
        ring_slice(3, 0, 4 * count, None),
    );
}

/// A 128 MiB float32 all-reduce's plan on rank 0 of `nranks`, `gpus` of them CUDA or HIP
/// ranks.
fn big_all_reduce(nranks: usize, gpus: usize) -> Vec<Step> {
    let count = 32 << 20;
    plan(&Shape {
        kind: Kind::AllReduce,
        rank: 0,
        nranks,
        count,
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        algo: Algorithm::Ring,
        in_place: false,
        slice: ring_slice(nranks, gpus, 4 * count.div_ceil(nranks), None),
    })
}

/// The exchanges a 128 MiB float32 all-reduce's plan makes, and its scratch: jobs of GPU ranks
/// take one pass of the whole segment (two exchanges on two ranks); mixed ones 16 MiB slices,
/// others 4 MiB, in two lanes of buffers (on two ranks the all-gather rides on later passes'
/// exchanges).
#[test]
fn device_rings_take_few_dependent_steps() {
    let exchanges = |nranks: usize, gpus: usize| {
        let steps = big_all_reduce(nranks, gpus);
        let n = steps
            .iter()
            .filter(|s| matches!(s, Step::Exchange { .. }))
            .count();
        (n, scratch_extent(&steps, 4))
    };
    assert_eq!(exchanges(2, 0), (16 + 2, SCRATCH_BYTES));
    assert_eq!(exchanges(2, 2), (1 + 1, DEVICE_SCRATCH_BYTES));
    assert_eq!(exchanges(2, 1), (4 + 2, 2 * MIXED_SLICE_BYTES));
    // Four ranks: 32 MiB segments in one 32 MiB pass, two buffers; three steps each way.
    assert_eq!(exchanges(4, 4), (3 + 3, DEVICE_SCRATCH_BYTES));
    // Four host ranks: 2 MiB slices, two lanes of two buffers.
    assert_eq!(exchanges(4, 0), (16 * 3 + 3, SCRATCH_BYTES));
    assert_eq!(exchanges(4, 1), (2 * 3 + 3, 4 * MIXED_SLICE_BYTES));
}

/// Where a ring takes several passes, each slice is combined while the next one moves: every
/// reduction step but the last pass's last (and its average) is beside an exchange, and no
/// exchange's messages touch what runs beside them (the simulator checks the results).
#[test]
fn long_rings_combine_while_the_next_slice_moves() {
    for nranks in [2, 3, 4] {
        let steps = big_all_reduce(nranks, 0);
        let alone = steps
            .iter()
            .filter(|s| !matches!(s, Step::Exchange { .. }))
            .count();
        let beside: usize = steps
            .iter()
            .map(|s| match s {
                Step::Exchange { beside, .. } => beside.len(),
                _ => 0,
            })
            .sum();
        let most = if nranks == 2 { 0 } else { 1 };
        assert!(
            alone <= most && beside > 0,
            "{nranks} ranks: {alone} local steps alone, {beside} beside exchanges"
        );
    }
}

#[test]
fn the_choice_depends_only_on_its_inputs() {
    assert_eq!(choose(2, 16, DataType::F32, None), Algorithm::Direct);
    assert_eq!(choose(2, 1 << 20, DataType::F32, None), Algorithm::Ring);
    // Past the direct algorithm's blocks, three ranks and more scatter while the blocks fit
    // and their segments are large.
    assert_eq!(choose(4, 1 << 15, DataType::F32, None), Algorithm::Ring);
    assert_eq!(
        choose(4, (1 << 15) + 1, DataType::F32, None),
        Algorithm::Scatter
    );
    assert_eq!(choose(3, 1 << 15, DataType::F32, None), Algorithm::Scatter);
    assert_eq!(choose(4, 1 << 19, DataType::F32, None), Algorithm::Scatter);
    assert_eq!(
        choose(4, (1 << 19) + 1, DataType::F32, None),
        Algorithm::Ring
    );
    assert_eq!(
        choose(2, 16, DataType::F32, Some(Algorithm::Scatter)),
        Algorithm::Scatter
    );
    assert_eq!(choose(8, 1 << 14, DataType::F32, None), Algorithm::Direct);
    assert_eq!(
        choose(8, (1 << 14) + 1, DataType::F32, None),
        Algorithm::Ring
    );
    assert_eq!(choose(8, 1 << 17, DataType::F32, None), Algorithm::Scatter);
    assert_eq!(
        choose(8, (1 << 18) + 1, DataType::F32, None),
        Algorithm::Ring
    );
    // Forced direct where the blocks do not fit the scratch: the ring.
    let big = SCRATCH_BYTES;
    assert_eq!(
        choose(2, big, DataType::I8, Some(Algorithm::Direct)),
        Algorithm::Ring
    );
    assert_eq!(
        choose(2, 16, DataType::I8, Some(Algorithm::Ring)),
        Algorithm::Ring
    );
}

/// A forced slice is taken as it is, except that a call's scratch stays within
/// [`DEVICE_SCRATCH_BYTES`]: one pass of a pass's buffers, or two lanes of them.
#[test]
fn forced_slices_keep_the_scratch_bounded() {
    let mib = 1 << 20;
    assert_eq!(ring_slice(2, 0, 9 * mib, Some(mib)), mib);
    assert_eq!(ring_slice(3, 2, 9 * mib, Some(mib)), mib);
    // One pass of 40 MiB fits on two ranks (one buffer), not from three (two).
    assert_eq!(ring_slice(2, 0, 40 * mib, Some(40 * mib)), 40 * mib);
    assert_eq!(ring_slice(3, 0, 40 * mib, Some(40 * mib)), 16 * mib);
    assert_eq!(ring_slice(2, 0, 1 << 30, Some(1 << 30)), 32 * mib);
    for (n, longest, forced) in [(2, 1 << 30, 1 << 30), (5, 100 * mib, 48 * mib)] {
        let slice = ring_slice(n, 0, longest, Some(forced));
        let lanes = if longest <= slice { 1 } else { 2 };
        assert!(lanes * super::plan::ring_buffers(n) * slice <= DEVICE_SCRATCH_BYTES);
    }
}
