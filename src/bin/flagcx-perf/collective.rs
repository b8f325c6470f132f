//! The collectives `flagcx-perf` times: how one is posted, where it reads and writes (out of
//! place, or in place as nccl-tests' second column), and how its result is checked.

use flagcx::p2p::reduction::{choose, reference, Algorithm};
use flagcx::{Adaptor, Comm, DataType, DevicePtr, ReduceOp, StreamHandle};

use super::byte;

/// A reduction's type, operator and forced algorithm (`FLAGCX_REDUCE_ALGO`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Red {
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
    pub(crate) forced: Option<Algorithm>,
}

/// `size` rounded down to what a reduction moves: whole elements, for reducescatter whole
/// elements per rank (other tests: `size` as it is).
pub(crate) fn whole_elements(test: &str, n: usize, size: usize, dtype: DataType) -> usize {
    match test {
        "reducescatter" => size / (n * dtype.size()) * n * dtype.size(),
        t if is_reduction(t) => size / dtype.size() * dtype.size(),
        _ => size,
    }
}

/// Whether `test` is a reduction.
pub(crate) fn is_reduction(test: &str) -> bool {
    matches!(test, "allreduce" | "reducescatter" | "reduce")
}

/// The element count of a reduction of `size` bytes (reducescatter: each rank's count).
fn red_count(test: &str, n: usize, size: usize, dtype: DataType) -> usize {
    match test {
        "reducescatter" => size / n / dtype.size(),
        _ => size / dtype.size(),
    }
}

/// Posts one collective of `size` bytes (rooted at `root` where it has a root) from `send`
/// into `recv`.
///
/// # Safety
/// Both buffers hold at least `size` bytes and stay valid until the collective finished.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run_collective(
    comm: &Comm<Adaptor>,
    test: &str,
    send: DevicePtr,
    recv: DevicePtr,
    size: usize,
    root: usize,
    red: Red,
    h: StreamHandle,
) -> Result<flagcx::Collective, flagcx::CommError> {
    let n = comm.nranks();
    let block = size / n;
    let (t, o) = (red.dtype, red.op);
    let count = red_count(test, n, size, t);
    // SAFETY: the caller's contract covers every block named below.
    unsafe {
        match test {
            "allreduce" => comm.all_reduce_raw(send, recv, count, t, o, h),
            "reducescatter" => comm.reduce_scatter_raw(send, recv, count, t, o, h),
            "reduce" => comm.reduce_raw(send, recv, count, t, o, root, h),
            "broadcast" => comm.broadcast_raw(send, recv, size, root, h),
            "gather" => comm.gather_raw(send, recv, block, root, h),
            "scatter" => comm.scatter_raw(send, recv, block, root, h),
            "allgather" => comm.all_gather_raw(send, recv, block, h),
            "alltoall" => comm.all_to_all_raw(send, recv, block, h),
            _ => {
                let me = comm.rank();
                let displs: Vec<usize> = (0..n).map(|q| q * block).collect();
                let sc: Vec<usize> = (0..n).map(|q| v_count(me, q, n, size)).collect();
                let rc: Vec<usize> = (0..n).map(|q| v_count(q, me, n, size)).collect();
                comm.all_to_allv_raw(send, &sc, &displs, recv, &rc, &displs, h)
            }
        }
    }
}

/// Whether `test` is one of the collectives.
pub(crate) fn is_collective(test: &str) -> bool {
    !matches!(test, "sendrecv" | "pingpong" | "pairs")
}

/// Bytes rank `p` sends rank `q` in `alltoallv` at `size`: seeded, 1–100 % of a block.
fn v_count(p: usize, q: usize, n: usize, size: usize) -> usize {
    let mut x = (p * 1_000_003 + q * 7919 + size) as u64 ^ 0x9E37_79B9_7F4A_7C15;
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    (size / n) * (x % 100 + 1) as usize / 100
}

/// Wrong bytes in rank `me`'s receive buffer after one collective of `size` bytes (rooted at
/// `root`; every rank's send buffer holds `byte(rank, size, i)`).
pub(crate) fn collective_wrong(
    test: &str,
    got: &[u8],
    me: usize,
    n: usize,
    size: usize,
    root: usize,
    red: Red,
) -> usize {
    if is_reduction(test) {
        return reduction_wrong(test, got, me, n, size, root, red);
    }
    let block = size / n;
    let mut wrong = 0;
    let mut expect = |at: usize, want: u8| wrong += usize::from(got[at] != want);
    match test {
        "broadcast" => (0..size).for_each(|i| expect(i, byte(root, size, i))),
        "gather" if me == root => {
            for q in 0..n {
                (0..block).for_each(|i| expect(q * block + i, byte(q, size, i)));
            }
        }
        "gather" => {}
        "scatter" => (0..block).for_each(|i| expect(i, byte(root, size, me * block + i))),
        "allgather" => {
            for q in 0..n {
                (0..block).for_each(|i| expect(q * block + i, byte(q, size, i)));
            }
        }
        "alltoall" => {
            for q in 0..n {
                (0..block).for_each(|i| expect(q * block + i, byte(q, size, me * block + i)));
            }
        }
        _ => {
            for q in 0..n {
                (0..v_count(q, me, n, size))
                    .for_each(|i| expect(q * block + i, byte(q, size, me * block + i)));
            }
        }
    }
    wrong
}

/// Wrong bytes of a reduction's result (every rank's input is `byte(rank, size, i)`): the
/// reference combines the inputs in the order of the algorithm the library chose, so every
/// bit must match.
fn reduction_wrong(
    test: &str,
    got: &[u8],
    me: usize,
    n: usize,
    size: usize,
    root: usize,
    red: Red,
) -> usize {
    let (t, sz) = (red.dtype, red.dtype.size());
    let count = red_count(test, n, size, t);
    if count == 0 || (test == "reduce" && me != root) {
        return 0;
    }
    let algo = choose(n, count, t, red.forced);
    let send_len = if test == "reducescatter" {
        n * count
    } else {
        count
    } * sz;
    let inputs: Vec<Vec<u8>> = (0..n)
        .map(|q| (0..send_len).map(|i| byte(q, size, i)).collect())
        .collect();
    let share = (test == "reducescatter").then_some(count);
    let want = reference(&inputs, me, share, t, red.op, algo);
    want.iter().zip(got).filter(|(w, g)| w != g).count()
}

/// Whether `test` has an in-place form (`--in-place`): the rooted collectives, all-gather and
/// the reductions. All-to-all has none, in flagcx as in NCCL.
pub(crate) fn has_in_place(test: &str) -> bool {
    matches!(
        test,
        "broadcast" | "gather" | "scatter" | "allgather" | "allreduce" | "reducescatter" | "reduce"
    )
}

/// Where rank `me` runs one collective of `size` bytes (rooted at `root`) over its buffers `send` and
/// `recv`: `(send, recv)` as passed to it, the in-place forms where `in_place` (the root's
/// buffers coincide for broadcast, gather and scatter; every rank's block sits in its `recv`
/// for all-gather), and whether the result lands in `send` (an in-place scatter's root).
pub(crate) fn placement(
    test: &str,
    in_place: bool,
    me: usize,
    n: usize,
    size: usize,
    root: usize,
    (send, recv): (DevicePtr, DevicePtr),
) -> (DevicePtr, DevicePtr, bool) {
    let block = (size / n) as u64;
    match (in_place, test, me == root) {
        // The root's own block of a gather sits at its rank's offset in `recv`.
        (true, "broadcast", true) => (recv, recv, false),
        (true, "gather", true) => (DevicePtr(recv.0 + me as u64 * block), recv, false),
        (true, "scatter", true) => (send, DevicePtr(send.0 + me as u64 * block), true),
        (true, "allgather", _) => (DevicePtr(recv.0 + me as u64 * block), recv, false),
        (true, "allreduce", _) | (true, "reduce", true) => (recv, recv, false),
        // Reduce-scatter in place: the input is the whole receive buffer, the result this
        // rank's block of it.
        (true, "reducescatter", _) => (recv, DevicePtr(recv.0 + me as u64 * block), false),
        _ => (send, recv, false),
    }
}

/// How many bytes of input rank `me` provides at its send pointer for one collective of
/// `size` (rooted at `root`): the whole buffer at a broadcast's or scatter's root, one block
/// for gather and all-gather, nothing at the other ranks of a rooted collective.
pub(crate) fn input_bytes(test: &str, me: usize, n: usize, size: usize, root: usize) -> usize {
    match (test, me == root) {
        ("broadcast" | "scatter", true) => size,
        ("broadcast" | "scatter", false) => 0,
        ("gather" | "allgather", _) => size / n,
        _ => size,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_place_pointers_follow_each_collective_s_rule() {
        let (s, r) = (DevicePtr(1 << 20), DevicePtr(2 << 20));
        let at = |t: &str, me| placement(t, true, me, 4, 4000, 0, (s, r));
        assert_eq!(at("broadcast", 0), (r, r, false));
        assert_eq!(
            at("broadcast", 1),
            (s, r, false),
            "only the root's buffers coincide"
        );
        assert_eq!(
            at("gather", 0),
            (r, r, false),
            "the root's block at recv + 0"
        );
        assert_eq!(
            at("scatter", 0),
            (s, s, true),
            "the root's block stays in send"
        );
        assert_eq!(at("allgather", 3), (DevicePtr(r.0 + 3000), r, false));
        assert_eq!(
            placement("allgather", false, 3, 4, 4000, 0, (s, r)),
            (s, r, false)
        );
        assert_eq!(input_bytes("allgather", 2, 4, 4000, 0), 1000);
        assert_eq!(input_bytes("broadcast", 1, 4, 4000, 0), 0);
        // Rooted elsewhere: the root's block sits at its rank's offset.
        let root2 = |t: &str, me| placement(t, true, me, 4, 4000, 2, (s, r));
        assert_eq!(root2("broadcast", 2), (r, r, false));
        assert_eq!(root2("broadcast", 0), (s, r, false));
        assert_eq!(root2("gather", 2), (DevicePtr(r.0 + 2000), r, false));
        assert_eq!(root2("scatter", 2), (s, DevicePtr(s.0 + 2000), true));
        assert_eq!(input_bytes("scatter", 2, 4, 4000, 2), 4000);
        assert_eq!(input_bytes("scatter", 0, 4, 4000, 2), 0);
        assert!(has_in_place("scatter") && !has_in_place("alltoall"));
    }
}
