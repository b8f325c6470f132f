//! Reductions checked bit for bit on every rank against a host reference that combines the
//! ranks' inputs in the order the chosen algorithm promises (`flagcx::p2p::reduction`).
//! Every rank can compute every rank's input (a function of rank, call and element), so the
//! reference needs no communication.

use flagcx::p2p::reduction::{choose, reference, Algorithm};
use flagcx::{Adaptor, Comm, DataType, DeviceBuffer, DevicePtr, ReduceOp, Stream};

/// Which reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    AllReduce,
    ReduceScatter,
    Reduce(usize),
}

/// Rank `r`'s input bytes for call `tag`: `elems` elements of `dtype`. Mostly small values
/// (so sums and products mean something), with every special bit pattern mixed in.
pub fn input(r: usize, tag: u64, elems: usize, dtype: DataType) -> Vec<u8> {
    let sz = dtype.size();
    let mut x = (r as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ tag.wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut out = Vec::with_capacity(elems * sz);
    for i in 0..elems {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bits: u64 = match (i % 11, dtype) {
            // Raw bits: NaNs, infinities, denormals, extremes, whatever comes.
            (0, _) => x,
            (_, DataType::F32) => f32::to_bits((x % 2001) as f32 / 8.0 - 125.0) as u64,
            (_, DataType::F64) => f64::to_bits((x % 2001) as f64 / 8.0 - 125.0),
            (_, DataType::F16) => {
                half::f16::from_f32((x % 201) as f32 / 4.0 - 25.0).to_bits() as u64
            }
            (_, DataType::BF16) => {
                half::bf16::from_f32((x % 201) as f32 / 4.0 - 25.0).to_bits() as u64
            }
            _ => x % 7,
        };
        out.extend_from_slice(&bits.to_le_bytes()[..sz]);
    }
    out
}

/// What `me` must hold after the call (`None`: nothing, a non-root of reduce). `count` is the
/// call's count (reduce-scatter: per rank).
pub fn expected(
    kind: Kind,
    me: usize,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    algo: Algorithm,
    inputs: &[Vec<u8>],
) -> Option<Vec<u8>> {
    match kind {
        Kind::Reduce(root) if root != me => None,
        Kind::ReduceScatter => Some(reference(inputs, me, Some(count), dtype, op, algo)),
        _ => Some(reference(inputs, me, None, dtype, op, algo)),
    }
}

/// Every type × op × kind on small and odd counts, in place and out of place at unaligned
/// addresses, and one large all-reduce and reduce-scatter per type (through several of the
/// ring's slices where `big` makes a segment longer than one); each result checked bit for
/// bit on every rank; a type some rank cannot reduce must be refused with `Unsupported` on
/// every rank. Returns the number of calls checked.
pub fn reductions(
    adaptor: &Adaptor,
    comm: &Comm<Adaptor>,
    s: &Stream<Adaptor>,
    big: usize,
) -> usize {
    let (me, n) = (comm.rank(), comm.nranks());
    let forced = comm.config().reduce_algo;
    let mut calls = 0;
    let mut refused = 0;
    let mut tag = 0u64;
    let mut run = |kind: Kind,
                   count: usize,
                   dtype: DataType,
                   op: ReduceOp,
                   in_place: bool,
                   shift: usize| {
        tag += 1;
        let sz = dtype.size();
        let send_elems = if kind == Kind::ReduceScatter {
            n * count
        } else {
            count
        };
        let inputs: Vec<Vec<u8>> = (0..n).map(|r| input(r, tag, send_elems, dtype)).collect();
        let buf = DeviceBuffer::new(adaptor, 2 * send_elems * sz + 64 + shift).expect("alloc");
        let send = DevicePtr(buf.ptr().0 + shift as u64);
        let recv_off = shift + send_elems * sz + 32;
        let recv = match (kind, in_place) {
            (Kind::ReduceScatter, true) => DevicePtr(send.0 + (me * count * sz) as u64),
            (_, true) => send,
            (Kind::Reduce(root), false) if root != me => DevicePtr(0),
            _ => DevicePtr(buf.ptr().0 + recv_off as u64),
        };
        buf.write(shift, &inputs[me], s).expect("write the input");
        let h = s.handle();
        // SAFETY: both ranges lie in `buf`, which outlives the wait below.
        let c = unsafe {
            match kind {
                Kind::AllReduce => comm.all_reduce_raw(send, recv, count, dtype, op, h),
                Kind::ReduceScatter => comm.reduce_scatter_raw(send, recv, count, dtype, op, h),
                Kind::Reduce(root) => comm.reduce_raw(send, recv, count, dtype, op, root, h),
            }
        };
        let what = format!("rank {me}: {kind:?} of {count} {dtype} {op} (in place {in_place}, +{shift} B, tag {tag})");
        // A type some rank's vendor cannot reduce exactly is refused on every rank.
        let able = (0..n).all(|q| {
            comm.peer_info(q)
                .is_some_and(|p| p.caps.reduce_types & dtype.bit() != 0)
        });
        if !able {
            match c {
                Err(flagcx::CommError::Adaptor(flagcx::AdaptorError::Unsupported { .. })) => {
                    refused += 1;
                    return;
                }
                other => {
                    panic!("{what}: a rank cannot reduce {dtype}, yet the call gave {other:?}")
                }
            }
        }
        c.and_then(|c| c.wait())
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let algo = choose(n, count, dtype, forced);
        if let Some(want) = expected(kind, me, count, dtype, op, algo, &inputs) {
            let mut got = vec![0u8; want.len()];
            let at = (recv.0 - buf.ptr().0) as usize;
            buf.read(at, &mut got, s).expect("read the result");
            if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                panic!(
                    "{what} ({algo:?}): byte {i} is {:#04x}, want {:#04x}",
                    got[i], want[i]
                );
            }
        }
        calls += 1;
    };
    let kinds = [
        Kind::AllReduce,
        Kind::ReduceScatter,
        Kind::Reduce(0),
        Kind::Reduce(n - 1),
    ];
    for dtype in DataType::ALL {
        for op in ReduceOp::ALL {
            for (i, kind) in kinds.into_iter().enumerate() {
                let count = [1, 7, 4099][i % 3];
                run(
                    kind,
                    count,
                    dtype,
                    op,
                    i % 2 == 1,
                    usize::from(dtype.size() > 1),
                );
            }
        }
        // The ring with odd counts and several slices (where `big` allows).
        let count = (big / dtype.size()).max(1) + 3;
        run(Kind::AllReduce, count, dtype, ReduceOp::Sum, false, 0);
        run(
            Kind::ReduceScatter,
            count / n + 1,
            dtype,
            ReduceOp::Max,
            true,
            0,
        );
    }
    // Count 0 is a no-op everywhere.
    for kind in kinds {
        run(kind, 0, DataType::F32, ReduceOp::Sum, false, 0);
    }
    calls += in_a_group(adaptor, comm, s);
    calls += several_in_a_group(adaptor, comm, s);
    calls += behind_a_busy_stream(adaptor, comm, s);
    if refused > 0 {
        println!(
            "reductions: rank {me}: {refused} calls refused (a type some rank's vendor cannot \
             reduce exactly)"
        );
    }
    calls
}

/// Small all-reduces posted while the stream is still busy (a host function that sleeps
/// 20 ms, where the vendor has them), back to back and waited for only at the end: each runs
/// when the stream reaches it (on host ranks, through the reduction slots as a host
/// function), every result right on every rank.
fn behind_a_busy_stream(adaptor: &Adaptor, comm: &Comm<Adaptor>, s: &Stream<Adaptor>) -> usize {
    use flagcx::DeviceAdaptor;
    let (me, n) = (comm.rank(), comm.nranks());
    if !adaptor.capabilities().host_functions {
        return 0;
    }
    let counts = [1usize, 100, 1000];
    let bufs: Vec<DeviceBuffer<Adaptor>> = counts
        .iter()
        .map(|&c| DeviceBuffer::new(adaptor, c * 4).expect("alloc"))
        .collect();
    for (b, &c) in bufs.iter().zip(&counts) {
        let mine: Vec<u8> = (0..c)
            .flat_map(|i| ((i * (me + 1)) as i32).to_le_bytes())
            .collect();
        b.write(0, &mine, s).expect("fill");
    }
    s.synchronize().expect("synchronize");
    adaptor
        .launch_host_func(
            s.handle(),
            Box::new(|| std::thread::sleep(std::time::Duration::from_millis(20))),
        )
        .expect("launch_host_func");
    let posted: Vec<_> = bufs
        .iter()
        .zip(&counts)
        .map(|(b, &c)| {
            // SAFETY: the buffer outlives the waits below.
            unsafe {
                comm.all_reduce_raw(
                    b.ptr(),
                    b.ptr(),
                    c,
                    DataType::I32,
                    ReduceOp::Sum,
                    s.handle(),
                )
            }
            .unwrap_or_else(|e| panic!("rank {me}: an all-reduce behind a busy stream: {e}"))
        })
        .collect();
    for c in posted {
        c.wait()
            .unwrap_or_else(|e| panic!("rank {me}: an all-reduce behind a busy stream: {e}"));
    }
    let tri = (n * (n + 1) / 2) as i32;
    for (b, &c) in bufs.iter().zip(&counts) {
        let mut got = vec![0u8; c * 4];
        b.read(0, &mut got, s).expect("read");
        for i in 0..c {
            let v = i32::from_le_bytes(got[4 * i..4 * i + 4].try_into().expect("4 bytes"));
            assert_eq!(
                v,
                i as i32 * tri,
                "rank {me}: all-reduce of {c} behind a busy stream, element {i}"
            );
        }
    }
    counts.len()
}

/// A ring exchange and an int32 all-reduce posted in one group (the reduction runs at the
/// group's end, after the exchange): both results right on every rank.
fn in_a_group(adaptor: &Adaptor, comm: &Comm<Adaptor>, s: &Stream<Adaptor>) -> usize {
    let (me, n) = (comm.rank(), comm.nranks());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let (len, count) = (4099usize, 1000usize);
    let out = DeviceBuffer::new(adaptor, len).expect("alloc");
    let back = DeviceBuffer::new(adaptor, len).expect("alloc");
    let sums = DeviceBuffer::new(adaptor, count * 4).expect("alloc");
    let pattern = |r: usize| -> Vec<u8> { (0..len).map(|i| (i * 7 + r * 31) as u8).collect() };
    out.write(0, &pattern(me), s).expect("fill");
    let mine: Vec<u8> = (0..count)
        .flat_map(|i| ((i * (me + 1)) as i32).to_le_bytes())
        .collect();
    sums.write(0, &mine, s).expect("fill");
    let h = s.handle();
    let reqs = comm
        .group(|| {
            // SAFETY: the buffers outlive the synchronize below.
            unsafe {
                let a = comm.send_raw(out.ptr(), len, next, h)?;
                let b = comm.recv_raw(back.ptr(), len, prev, h)?;
                let c = comm.all_reduce_raw(
                    sums.ptr(),
                    sums.ptr(),
                    count,
                    DataType::I32,
                    ReduceOp::Sum,
                    h,
                )?;
                Ok((a, b, c))
            }
        })
        .unwrap_or_else(|e| panic!("rank {me}: a group with an all-reduce: {e}"));
    reqs.0.wait().expect("send");
    reqs.1.wait().expect("recv");
    s.synchronize().expect("synchronize");
    let mut got = vec![0u8; len];
    back.read(0, &mut got, s).expect("read");
    assert!(got == pattern(prev), "rank {me}: the group's receive");
    let mut got = vec![0u8; count * 4];
    sums.read(0, &mut got, s).expect("read");
    let tri = (n * (n + 1) / 2) as i32;
    for i in 0..count {
        let v = i32::from_le_bytes(got[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        assert_eq!(
            v,
            i as i32 * tri,
            "rank {me}: the group's all-reduce, element {i}"
        );
    }
    1
}

/// Several all-reduces in one group (torch's `all_reduce_coalesced` and coalescing manager post
/// them so), of 1, 2, 3, 1000 and 100000 float32 elements (direct and ring), and 2 again:
/// every one right on every rank.
fn several_in_a_group(adaptor: &Adaptor, comm: &Comm<Adaptor>, s: &Stream<Adaptor>) -> usize {
    let (me, n) = (comm.rank(), comm.nranks());
    let counts = [1usize, 2, 3, 1000, 100_000, 2];
    let bufs: Vec<DeviceBuffer<Adaptor>> = counts
        .iter()
        .map(|&c| DeviceBuffer::new(adaptor, c * 4).expect("alloc"))
        .collect();
    for (k, (b, &c)) in bufs.iter().zip(&counts).enumerate() {
        let v: Vec<u8> = (0..c)
            .flat_map(|i| ((me + 1) as f32 * (k * 10 + i % 7) as f32).to_le_bytes())
            .collect();
        b.write(0, &v, s).expect("fill");
    }
    let h = s.handle();
    let reqs = comm
        .group(|| {
            bufs.iter()
                .zip(&counts)
                .map(|(b, &c)| {
                    // SAFETY: the buffers outlive the synchronize below.
                    unsafe {
                        comm.all_reduce_raw(b.ptr(), b.ptr(), c, DataType::F32, ReduceOp::Sum, h)
                    }
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .unwrap_or_else(|e| panic!("rank {me}: a group of all-reduces: {e}"));
    for r in reqs {
        // Enqueued at the group's end: done only once that ran (the collective used to come
        // back empty, done at once, and a caller waiting on it read untouched buffers).
        r.wait().expect("all-reduce");
    }
    s.synchronize().expect("synchronize");
    let tri = (n * (n + 1) / 2) as f32;
    for (k, (b, &c)) in bufs.iter().zip(&counts).enumerate() {
        let mut got = vec![0u8; c * 4];
        b.read(0, &mut got, s).expect("read");
        for i in 0..c {
            let v = f32::from_le_bytes(got[4 * i..4 * i + 4].try_into().expect("4 bytes"));
            assert_eq!(
                v,
                tri * (k * 10 + i % 7) as f32,
                "rank {me}: all-reduce {k} of the group ({c} elements), element {i}"
            );
        }
    }
    // Inside its group a reduction is not done, and waiting for it there is an error.
    let early = comm
        .group(|| {
            // SAFETY: the buffer outlives the synchronize after it.
            let c = unsafe {
                comm.all_reduce_raw(
                    bufs[0].ptr(),
                    bufs[0].ptr(),
                    1,
                    DataType::F32,
                    ReduceOp::Sum,
                    h,
                )
            }?;
            assert!(
                !c.is_done(),
                "rank {me}: a grouped all-reduce done before its group ended"
            );
            Ok(c.wait())
        })
        .expect("a group of one all-reduce");
    assert!(
        matches!(early, Err(flagcx::p2p::CommError::InvalidArgument(_))),
        "rank {me}: waiting inside the group: {early:?}"
    );
    s.synchronize().expect("synchronize");
    counts.len()
}
