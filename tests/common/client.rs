//! The way real clients use a communicator (torch's process groups, FlagCX's torch plugin,
//! any NCCL-style caller), as one job scenario: the client owns a compute stream `T` and hands
//! the library its own stream `S`; before each call it records an event on `T` and makes `S`
//! wait for it, after the call it records an event on `S` and makes `T` wait, and it reads the
//! result on `T`. Nothing synchronizes the host with `S`. Buffers are carved out of one large
//! allocation at offsets (as a caching allocator hands out tensors), and the allocation is
//! freed and allocated again between rounds.
//!
//! Every input is written on `T` just before the call and every output filled with a
//! sentinel there, so a call that reads its input or writes its output outside the window the
//! events give it is caught: a stale input shows as the previous round's bytes, an early
//! write as the sentinel.

use flagcx::{Adaptor, Comm, DeviceAdaptor, DeviceBuffer, DevicePtr, Event, Stream};

/// The operations a client issues, each checked on every rank.
#[derive(Debug, Clone, Copy)]
enum Op {
    SendRecv,
    Broadcast,
    AllGather,
    AllToAll,
    Gather,
    Scatter,
}

const OPS: [Op; 6] = [
    Op::SendRecv,
    Op::Broadcast,
    Op::AllGather,
    Op::AllToAll,
    Op::Gather,
    Op::Scatter,
];

/// The byte `i` of the block rank `src` contributes for rank `dst` in call `tag`.
fn byte(src: usize, dst: usize, tag: u64, i: usize) -> u8 {
    let x = (src as u64 + 1)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((dst as u64 + 7).wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(tag.wrapping_mul(0x94D0_49BB_1331_11EB))
        .wrapping_add(i as u64);
    (x ^ (x >> 29) ^ (x >> 47)) as u8
}

fn block(src: usize, dst: usize, tag: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| byte(src, dst, tag, i)).collect()
}

/// The scenario: every operation, at several offsets in one allocation, over three
/// allocations of it; panics on the first wrong byte with what was expected.
pub fn client(adaptor: &Adaptor, comm: &Comm<Adaptor>, s: &Stream<Adaptor>) {
    client_with(adaptor, adaptor, comm, s)
}

/// [`client`] with the segments allocated through `alloc`, another adaptor than the
/// communicator's `adaptor` over the same device (memory the communicator's runtime did not
/// hand out: the memory of a pool it has no IPC handle for).
pub fn client_with<A: DeviceAdaptor + Clone>(
    alloc: &Adaptor,
    adaptor: &A,
    comm: &Comm<A>,
    s: &Stream<A>,
) {
    let (me, n) = (comm.rank(), comm.nranks());
    let t = Stream::new(adaptor).expect("the client's stream");
    let before = Event::new(adaptor, false).expect("event");
    let after = Event::new(adaptor, false).expect("event");
    // Small blocks take the eager and stream-ordered paths, large ones the rendezvous paths.
    let lens = [4100usize, (1 << 20) + 12];
    let room = 2 * n * lens[1] + 8192;
    // An odd offset (buffers need not be aligned), one past a megabyte, one deep inside.
    let offsets = [0usize, (3 << 20) + 517, 6 << 20];
    let seg_len = offsets[2] + room;
    let mut checked = 0usize;
    for round in 0..3u64 {
        // A new allocation each round, where the allocator may hand back the same addresses.
        let seg = DeviceBuffer::new(alloc, seg_len).expect("the segment");
        for (k, &off) in offsets.iter().enumerate() {
            for &len in &lens {
                for (o, &op) in OPS.iter().enumerate() {
                    let tag = (round * 100 + k as u64 * 10 + o as u64) * 4 + (len > 4100) as u64;
                    let input = DevicePtr(seg.ptr().0 + off as u64);
                    let output = DevicePtr(input.0 + (n * len) as u64 + 4096);
                    let root = (tag as usize) % n;
                    call(
                        adaptor,
                        comm,
                        s,
                        &t,
                        (&before, &after),
                        (op, tag, root),
                        (input, output, len),
                    );
                    checked += 1;
                }
            }
        }
        // A client frees a tensor once the streams that used it passed it.
        t.synchronize().expect("T");
        s.synchronize().expect("S");
        drop(seg);
    }
    println!("client pattern: rank {me} of {n}: {checked} calls, every byte right");
}

/// A collective's requests, to be waited for once `T` passed the call.
fn done(c: flagcx::p2p::Collective) -> Vec<flagcx::Request> {
    c.into_requests()
}

/// One call of the client's pattern, checked on `T`.
fn call<A: DeviceAdaptor + Clone>(
    a: &A,
    comm: &Comm<A>,
    s: &Stream<A>,
    t: &Stream<A>,
    (before, after): (&Event<A>, &Event<A>),
    (op, tag, root): (Op, u64, usize),
    (input, output, len): (DevicePtr, DevicePtr, usize),
) {
    let (me, n) = (comm.rank(), comm.nranks());
    // What this rank puts in its input: block q for rank q (one block for send/recv and the
    // rooted one-to-many calls, which send block 0).
    let send: Vec<u8> = (0..n).flat_map(|q| block(me, q, tag, len)).collect();
    let (out_len, expected): (usize, Option<Vec<u8>>) = match op {
        Op::SendRecv => (len, Some(block((me + n - 1) % n, 0, tag, len))),
        Op::Broadcast => (len, Some(block(root, 0, tag, len))),
        Op::AllGather => (
            n * len,
            Some((0..n).flat_map(|q| block(q, 0, tag, len)).collect()),
        ),
        Op::AllToAll => (
            n * len,
            Some((0..n).flat_map(|q| block(q, me, tag, len)).collect()),
        ),
        Op::Gather => (
            n * len,
            (me == root).then(|| (0..n).flat_map(|q| block(q, 0, tag, len)).collect()),
        ),
        Op::Scatter => (len, Some(block(root, me, tag, len))),
    };
    let sentinel = 0xEE;
    let h = s.handle();
    if std::env::var_os("FLAGCX_TEST_VERBOSE").is_some() {
        eprintln!("rank {me}: {op:?} of {len} B (tag {tag}, root {root}) at {input}");
    }
    // SAFETY: `send` lives until `t` is synchronized below; both regions lie inside the
    // segment the caller holds until both streams passed every call.
    unsafe {
        a.memcpy_h2d_async(input, send.as_ptr(), send.len(), t.handle())
            .expect("write the input on T");
        a.memset_async(output, sentinel, out_len, t.handle())
            .expect("fill the output on T");
    }
    before.record(t).expect("record on T");
    s.wait_event(before).expect("S waits for T");
    // SAFETY: as above; nothing touches the regions until `t` passes `after`.
    let posted = unsafe {
        match op {
            Op::SendRecv => comm.group(|| {
                Ok(vec![
                    comm.send_raw(input, len, (me + 1) % n, h)?,
                    comm.recv_raw(output, len, (me + n - 1) % n, h)?,
                ])
            }),
            Op::Broadcast => comm.broadcast_raw(input, output, len, root, h).map(done),
            Op::AllGather => comm.all_gather_raw(input, output, len, h).map(done),
            Op::AllToAll => comm.all_to_all_raw(input, output, len, h).map(done),
            Op::Gather => comm.gather_raw(input, output, len, root, h).map(done),
            Op::Scatter => comm.scatter_raw(input, output, len, root, h).map(done),
        }
    }
    .unwrap_or_else(|e| panic!("rank {me}: {op:?} of {len} B (tag {tag}): {e}"));
    after.record(s).expect("record on S");
    t.wait_event(after).expect("T waits for S");
    let mut got = vec![0u8; out_len];
    // SAFETY: `got` lives past the synchronize below.
    unsafe {
        a.memcpy_d2h_async(got.as_mut_ptr(), output, out_len, t.handle())
            .expect("read on T");
    }
    t.synchronize().expect("T");
    // The call's own failure, if any, comes with its requests (already complete on the stream).
    for r in posted {
        r.wait()
            .unwrap_or_else(|e| panic!("rank {me}: {op:?} of {len} B (tag {tag}): {e}"));
    }
    if let Some(want) = expected {
        if let Some(i) = (0..out_len).find(|&i| got[i] != want[i]) {
            let wrong = (0..out_len).filter(|&i| got[i] != want[i]).count();
            panic!(
                "rank {me}: {op:?} of {len} B (tag {tag}, root {root}): {wrong} of {out_len} \
                 bytes wrong, first at {i}: {:#04x}, want {:#04x} (sentinel {sentinel:#04x})",
                got[i], want[i]
            );
        }
    }
}
