//! Port channels (device-initiated transfers) on the host vendor, whose "kernels" are threads
//! driving the FIFO through `HostPort` exactly as `include/flagcx/device.cuh` does on a GPU:
//! ping-pong with wrap-around, a ring kept full, many connections with random puts checked
//! byte for byte, bad triggers, a peer killed while the other waits on its flag — on IPC pairs
//! and on staged pairs (`FLAGCX_P2P_DISABLE=1`, puts through shared-memory lanes).
//!
//! Each test starts ranks of this binary's ignored `port_worker` directly (a rank may die on
//! purpose), with the scenario in `FLAGCX_TEST_SCENARIO`; workers print `port ok …` lines.

use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flagcx::p2p::bootstrap::UniqueId;
use flagcx::p2p::port::host::{HostPort, PortFailure};
use flagcx::p2p::port::{PortChannel, PortStatus, Registered};
use flagcx::{Adaptor, Comm, CommError, DeviceBuffer};

const LIMIT: Duration = Duration::from_secs(20);

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Fills `out` with the bytes of message `tag` from `src` to `dst`.
fn fill(out: &mut [u8], src: usize, dst: usize, tag: u64) {
    let seed = splitmix(((src as u64) << 40) ^ ((dst as u64) << 20) ^ tag);
    for (j, chunk) in out.chunks_mut(8).enumerate() {
        let w = splitmix(seed ^ j as u64).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// A host-vendor buffer and its registration.
struct Buf {
    mem: DeviceBuffer<Adaptor>,
    reg: Registered,
}

impl Buf {
    fn new(comm: &Comm<Adaptor>, len: usize) -> Buf {
        let mem = DeviceBuffer::new(comm.adaptor(), len).expect("alloc");
        let reg = comm.register(mem.ptr(), len).expect("register");
        Buf { mem, reg }
    }

    /// The buffer's bytes. The host vendor's device memory is this process's memory; callers
    /// touch a range only while no transfer uses it (the protocol's signals order that).
    #[allow(clippy::mut_from_ref)]
    fn bytes(&self) -> &mut [u8] {
        // SAFETY: see above; the allocation lives as long as `self`.
        unsafe { std::slice::from_raw_parts_mut(self.mem.ptr().0 as *mut u8, self.mem.len()) }
    }
}

fn port(ch: &PortChannel<Adaptor>) -> HostPort {
    // SAFETY: a host-vendor channel, open while the port is used.
    unsafe { HostPort::new(ch.raw(), LIMIT) }
}

/// A random (offset, size) inside `len` bytes: some empty, some tiny, some large.
fn span(r: u64, len: usize) -> (u64, u64) {
    let size = match r % 6 {
        0 => 0,
        1 => (r >> 8) % 16 + 1,
        _ => (r >> 8) % len as u64,
    };
    let off = (r >> 32) % (len as u64 - size + 1);
    (off, size)
}

/// Alternating turns on one channel: each turn, one side puts a random span with a signal
/// and waits for the other's acknowledgement; the other checks every byte, then signals.
/// Every 16 turns the sender also flushes; every seventh turn puts an 8-byte value instead.
fn pingpong(me: usize, peer: usize, ch: &PortChannel<Adaptor>, src: &Buf, dst: &Buf, turns: u64) {
    let mut p = port(ch);
    let len = src.mem.len().min(dst.mem.len());
    for t in 0..turns {
        let r = splitmix(t ^ ((me.min(peer) as u64) << 48) ^ ((me.max(peer) as u64) << 56));
        let (off, size) = if t % 7 == 5 {
            // Eight aligned bytes: `HostPort` sends them as a value put (the buffer table).
            (((r >> 20) % (len as u64 / 8)) * 8, 8)
        } else {
            span(r, len)
        };
        let sender = if t % 2 == 0 {
            me.min(peer)
        } else {
            me.max(peer)
        };
        if t % 7 == 3 {
            // A value put: the word travels in the trigger, to an aligned offset.
            let at = ((r >> 20) % (len as u64 / 8)) * 8;
            let value = splitmix(r ^ 0x7a1e);
            if sender == me {
                p.put_value_with_signal((1, at), value).expect("value put");
                p.wait().expect("acknowledgement");
            } else {
                p.wait().expect("signal");
                let got = &dst.bytes()[at as usize..at as usize + 8];
                assert_eq!(
                    got,
                    value.to_le_bytes(),
                    "turn {t}: the value at {at} from rank {peer} differs"
                );
                p.signal().expect("ack");
            }
            continue;
        }
        if sender == me {
            fill(
                &mut src.bytes()[off as usize..(off + size) as usize],
                me,
                peer,
                t,
            );
            p.put_with_signal((1, off), (0, off), size).expect("put");
            if t % 16 == 0 {
                p.flush().expect("flush");
            }
            p.wait().expect("acknowledgement");
        } else {
            p.wait().expect("signal");
            let got = &dst.bytes()[off as usize..(off + size) as usize];
            let mut want = vec![0; size as usize];
            fill(&mut want, peer, me, t);
            assert!(
                got == want,
                "turn {t}: {size} bytes at {off} from rank {peer} differ"
            );
            p.signal().expect("ack");
        }
    }
}

/// No lane segment of a port channel is still mapped in this process: a closed channel's
/// memory is released when `close` returns (its proxy no longer holds it).
fn assert_no_lanes(what: &str) {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
    let left: Vec<&str> = maps
        .lines()
        .filter(|l| l.contains("flagcx-port-lane"))
        .collect();
    assert!(left.is_empty(), "{what}: lanes still mapped: {left:?}");
}

fn ok(me: usize, what: &str) {
    println!("port ok: rank {me}: {what}");
}

#[test]
#[ignore = "one rank of a port job; the tests below start it"]
fn port_worker() {
    let Ok(scenario) = std::env::var("FLAGCX_TEST_SCENARIO") else {
        return;
    };
    flagcx::init_logging();
    if scenario == "stalled_proxy" {
        stalled_proxy();
        return;
    }
    let adaptor = Adaptor::from_env().expect("adaptor");
    let comm = Comm::from_env(adaptor).expect("comm");
    let (me, n) = (comm.rank(), comm.nranks());
    match scenario.as_str() {
        "quiet" => {
            // Open and idle for over three times FLAGCX_TIMEOUT_MS (the job sets 300 ms): an
            // idle proxy still takes its steps, so its stall guard must not fail the channel.
            let peer = 1 - me;
            let (src, dst) = (Buf::new(&comm, 4096), Buf::new(&comm, 4096));
            let ch = comm
                .port_channel(peer, &[&src.reg, &dst.reg], 4)
                .expect("channel");
            std::thread::sleep(Duration::from_secs(1));
            assert!(
                ch.check().is_ok(),
                "an idle channel failed: {:?}",
                ch.check()
            );
            pingpong(me, peer, &ch, &src, &dst, 100);
            ch.check().expect("healthy after traffic");
            ch.close().expect("close");
            ok(
                me,
                "an idle channel outlived the timeout, then carried 100 turns",
            );
        }
        "pingpong" => {
            let peer = 1 - me;
            let (src, dst) = (Buf::new(&comm, 64 << 10), Buf::new(&comm, 64 << 10));
            // Depth 3: slots wrap every three triggers, at a place that is no power of two.
            let ch = comm
                .port_channel(peer, &[&src.reg, &dst.reg], 3)
                .expect("channel");
            // The buffer table device code reads: our two buffers, the peer's two, both
            // aligned.
            let table = ch.raw().head - flagcx::p2p::port::HEAD_OFF + flagcx::p2p::port::TABLE_OFF;
            // SAFETY: host-vendor device words are this process's memory, live while the
            // channel is; the table has 2 + 2·2 + 2 words.
            let words: Vec<u64> = (0..8)
                .map(|i| unsafe { std::ptr::read((table + 8 * i) as *const u64) })
                .collect();
            let want = [
                2,
                2,
                src.mem.ptr().0,
                src.mem.len() as u64,
                dst.mem.ptr().0,
                dst.mem.len() as u64,
                1,
                1,
            ];
            assert_eq!(words, want, "buffer table");
            let t0 = Instant::now();
            pingpong(me, peer, &ch, &src, &dst, 3000);
            let (triggers, bytes) = ch.stats();
            assert!(triggers >= 3000, "{triggers} triggers executed");
            // A channel naming a buffer keeps it registered.
            let again = comm.register(src.mem.ptr(), 8).expect("register");
            comm.deregister(again).expect("an unused registration ends");
            let err = comm.deregister(src.reg.clone()).unwrap_err();
            assert!(matches!(err, CommError::InvalidArgument(_)), "{err}");
            ch.close().expect("close");
            ok(
                me,
                &format!(
                    "3000 turns in {:?} ({triggers} triggers, {bytes} bytes put)",
                    t0.elapsed()
                ),
            );
        }
        "full_ring" => {
            // Depth 1: every trigger waits for the proxy to take the one before.
            let peer = 1 - me;
            let (src, dst) = (Buf::new(&comm, 40_000), Buf::new(&comm, 40_000));
            let ch = comm
                .port_channel(peer, &[&src.reg, &dst.reg], 1)
                .expect("channel");
            let mut p = port(&ch);
            if me == 0 {
                fill(src.bytes(), 0, 1, 7);
                for i in 0..5000u64 {
                    p.put((1, i * 8), (0, i * 8), 8).expect("put");
                }
                p.signal().expect("signal");
                p.flush().expect("flush");
                let r = p.wait();
                assert!(
                    r.is_ok(),
                    "done: {r:?}, flag {} stats {:?}",
                    p.signals(),
                    ch.stats()
                );
            } else {
                p.wait().expect("signal");
                let mut want = vec![0; 40_000];
                fill(&mut want, 0, 1, 7);
                assert!(dst.bytes() == want.as_slice(), "5000 puts through one slot");
                // The channel is closed right after: the signal still goes out.
                p.signal().expect("done");
            }
            ch.close().expect("close");
            ok(me, "5000 puts through a one-slot ring");
        }
        "many" => {
            // Every pair at once, one thread per channel.
            let mut chans = Vec::new();
            for q in (0..n).filter(|&q| q != me) {
                let (src, dst) = (Buf::new(&comm, 256 << 10), Buf::new(&comm, 256 << 10));
                let ch = comm
                    .port_channel(q, &[&src.reg, &dst.reg], 8)
                    .expect("channel");
                chans.push((q, Arc::new(ch), Arc::new(src), Arc::new(dst)));
            }
            std::thread::scope(|s| {
                for (q, ch, src, dst) in &chans {
                    s.spawn(move || pingpong(me, *q, ch, src, dst, 400));
                }
            });
            for (_, ch, _, _) in chans {
                Arc::into_inner(ch)
                    .expect("sole owner")
                    .close()
                    .expect("close");
            }
            assert_no_lanes("after closing every channel");
            ok(me, &format!("400 turns with each of {} peers", n - 1));
        }
        "bad_trigger" => {
            let peer = 1 - me;
            let b = Buf::new(&comm, 4096);
            let ch = comm.port_channel(peer, &[&b.reg], 4).expect("channel");
            let mut p = port(&ch);
            if me == 0 {
                if std::env::var_os("FLAGCX_P2P_DISABLE").is_some() {
                    // A value put past the end of the peer's buffer.
                    p.put_value((0, 4096), 7)
                        .expect("the trigger itself is well formed");
                } else {
                    // Buffer 3 does not exist at the peer.
                    p.put((3, 0), (0, 0), 16)
                        .expect("the trigger itself is well formed");
                }
                assert_eq!(p.flush(), Err(PortFailure::Failed(PortStatus::BadTrigger)));
                assert!(matches!(ch.check(), Err(CommError::InvalidArgument(_))));
                assert!(matches!(ch.close(), Err(CommError::InvalidArgument(_))));
            } else {
                // The failing side poisons our flag too: the wait ends.
                assert_eq!(p.wait(), Err(PortFailure::Poisoned));
                // Our FIFO still drains (depth 4, ten puts): a kernel that goes on triggering
                // is not stuck on a full ring, and its flush completes.
                for _ in 0..10 {
                    p.put((0, 0), (0, 0), 16)
                        .expect("a put after the peer failed");
                }
                p.flush().expect("a flush after the peer failed");
                // Too large to encode: refused before it reaches the FIFO.
                assert_eq!(p.put((0, 0), (0, 0), 1 << 41), Err(PortFailure::OutOfRange));
                // A value put to an unaligned offset: refused the same way.
                assert_eq!(p.put_value((0, 4), 1), Err(PortFailure::OutOfRange));
                ch.close().expect("close (this side did nothing wrong)");
            }
            ok(me, "bad trigger poisoned both sides");
        }
        "killed" => {
            let peer = 1 - me;
            let b = Buf::new(&comm, 4096);
            let ch = comm.port_channel(peer, &[&b.reg], 4).expect("channel");
            let mut p = port(&ch);
            if me == 1 {
                p.signal().expect("signal");
                std::thread::sleep(Duration::from_millis(200));
                // SAFETY: dying on purpose.
                unsafe { libc::raise(libc::SIGKILL) };
            }
            p.wait().expect("the first signal");
            let t0 = Instant::now();
            let e = p.wait().unwrap_err();
            let waited = t0.elapsed();
            assert!(
                matches!(
                    e,
                    PortFailure::Poisoned | PortFailure::Failed(PortStatus::PeerLost)
                ),
                "{e:?}"
            );
            assert!(waited < Duration::from_secs(2), "released after {waited:?}");
            assert!(matches!(
                ch.check(),
                Err(CommError::PeerLost { peer: 1, .. })
            ));
            assert!(matches!(ch.close(), Err(CommError::PeerLost { .. })));
            ok(
                me,
                &format!("a killed peer released the wait after {waited:?}"),
            );
        }
        "refused" => {
            let b = Buf::new(&comm, 64);
            let e = comm.port_channel(me, &[&b.reg], 4).unwrap_err();
            assert!(matches!(e, CommError::InvalidArgument(_)), "{e}");
            let e = comm.port_channel(1 - me, &[&b.reg], 0).unwrap_err();
            assert!(matches!(e, CommError::InvalidArgument(_)), "{e}");
            // The pair still works after refusals: nothing was half exchanged.
            let ch = comm.port_channel(1 - me, &[&b.reg], 4).expect("channel");
            ch.close().expect("close");
            ok(
                me,
                "bad arguments refused on both sides, then a channel made",
            );
        }
        "big" => {
            // Puts larger than a staged lane (8 slots of 1 MiB): chunks wait for credits.
            let peer = 1 - me;
            let len = (9 << 20) + 4097;
            let (src, dst) = (Buf::new(&comm, len), Buf::new(&comm, len));
            let ch = comm
                .port_channel(peer, &[&src.reg, &dst.reg], 4)
                .expect("channel");
            let staged = std::env::var("FLAGCX_P2P_DISABLE").is_ok_and(|v| v == "1");
            assert_eq!(
                ch.is_staged(),
                staged,
                "the pair's kind decides the channel's"
            );
            let mut p = port(&ch);
            for round in 0..3u64 {
                let size = len as u64 - round * 1_000_003;
                if (round % 2 == 0) == (me == 0) {
                    fill(&mut src.bytes()[..size as usize], me, peer, round);
                    p.put_with_signal((1, 0), (0, 0), size).expect("put");
                    p.wait().expect("acknowledgement");
                } else {
                    p.wait().expect("signal");
                    let mut want = vec![0; size as usize];
                    fill(&mut want, peer, me, round);
                    let got = &dst.bytes()[..size as usize];
                    if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
                        panic!("round {round}: byte {i} of {size} differs");
                    }
                    p.signal().expect("ack");
                }
            }
            let (_, bytes) = ch.stats();
            ch.close().expect("close");
            assert_no_lanes("after close");
            ok(
                me,
                &format!("large puts, {bytes} bytes put (staged: {staged})"),
            );
        }
        "one_refuses" => {
            // Rank 1 cannot make its side (a depth of 0, or its bad FLAGCX_PORT_LANE_SLOT):
            // rank 0 hears why instead of waiting, and the next channel works on both.
            let b = Buf::new(&comm, 4096);
            let depth = if me == 1 && std::env::var("FLAGCX_PORT_LANE_SLOT").is_err() {
                0
            } else {
                4
            };
            let e = comm.port_channel(1 - me, &[&b.reg], depth).unwrap_err();
            if me == 1 {
                assert!(
                    matches!(e, CommError::InvalidArgument(_) | CommError::Config { .. }),
                    "{e}"
                );
                std::env::remove_var("FLAGCX_PORT_LANE_SLOT");
            } else {
                assert!(matches!(e, CommError::RemoteFailure { peer: 1, .. }), "{e}");
            }
            let ch = comm
                .port_channel(1 - me, &[&b.reg], 4)
                .expect("the next channel");
            let mut p = port(&ch);
            if me == 0 {
                p.signal().expect("signal");
            } else {
                p.wait().expect("the signal");
            }
            ch.close().expect("close");
            ok(
                me,
                &format!("one side refused ({e}), then a channel worked"),
            );
        }
        "bad_slot" => {
            let b = Buf::new(&comm, 64);
            let e = comm.port_channel(1 - me, &[&b.reg], 4).unwrap_err();
            assert!(e.to_string().contains("FLAGCX_PORT_LANE_SLOT"), "{e}");
            ok(me, &format!("a bad slot size refused: {e}"));
        }
        other => panic!("unknown scenario {other}"),
    }
}

/// Rank 0's port proxy blocks for [`STALL`] inside the copy of its first put (a vendor call that
/// hangs, as CUDA's do behind a lock another thread holds). With `FLAGCX_TIMEOUT_MS=300` the
/// proxy's guard fails the channel long before the call returns: rank 0's flush returns the
/// failure and `check` says `Timeout`; rank 1's wait for the put's signal ends poisoned — on a
/// staged pair at once (through the lane), on an IPC pair once rank 0's proxy is back and
/// writes the flag (the put it was inside may land first, with its signal). Both then close.
fn stalled_proxy() {
    use flagcx_adaptor::testing::{FaultOp, FaultyAdaptor};
    const STALL: Duration = Duration::from_secs(3);
    let staged = std::env::var("FLAGCX_P2P_DISABLE").is_ok_and(|v| v == "1");
    // A staged put is a copy out into the lane; an IPC put one copy into the peer's buffer.
    let op = if staged {
        FaultOp::CopyD2H
    } else {
        FaultOp::CopyD2D
    };
    let inner = Adaptor::from_env().expect("adaptor");
    let a = FaultyAdaptor::stalling(inner, op, usize::MAX >> 1, STALL);
    let comm = Comm::from_env(a.clone()).expect("comm");
    let me = comm.rank();
    let mem = DeviceBuffer::new(&a, 4096).expect("alloc");
    let reg = comm.register(mem.ptr(), 4096).expect("register");
    let ch = comm.port_channel(1 - me, &[&reg], 4).expect("channel");
    assert_eq!(ch.is_staged(), staged);
    // The peer's buffer as mapped here: only on an IPC pair, only for a buffer it named.
    assert_eq!(ch.peer_buffer(0).is_some(), !staged);
    assert!(ch.peer_buffer(1).is_none());
    // SAFETY: a host-vendor channel, open while the port is used.
    let mut p = unsafe { HostPort::new(ch.raw(), LIMIT) };
    if me == 0 {
        a.arm(0);
        let t0 = Instant::now();
        p.put_with_signal((0, 0), (0, 0), 64).expect("put");
        let e = p.flush().unwrap_err();
        let failed_after = t0.elapsed();
        assert!(a.fired(), "the put's copy was not the stalled call");
        assert_eq!(e, PortFailure::Failed(PortStatus::DeviceError));
        assert!(
            failed_after < STALL / 2,
            "the flush failed only after {failed_after:?}"
        );
        assert!(
            matches!(ch.check(), Err(CommError::Timeout { .. })),
            "{:?}",
            ch.check()
        );
        // Closing waits for the proxy to come back from the call, then reports the failure.
        let closed = ch.close();
        assert!(
            matches!(closed, Err(CommError::Timeout { .. })),
            "{closed:?}"
        );
        ok(
            me,
            &format!(
                "a proxy blocked in a vendor call failed the flush after {failed_after:?} \
                 (staged: {staged})"
            ),
        );
    } else {
        let t0 = Instant::now();
        let mut signals = 0;
        let e = loop {
            match p.wait() {
                Ok(()) => signals += 1,
                Err(e) => break e,
            }
        };
        let waited = t0.elapsed();
        assert_eq!(e, PortFailure::Poisoned);
        assert!(signals <= 1, "{signals} signals from one put");
        if staged {
            assert!(waited < STALL / 2, "released only after {waited:?}");
        }
        ch.close().expect("close (this side did nothing wrong)");
        ok(
            me,
            &format!("the wait ended poisoned after {waited:?}, {signals} signal(s) first"),
        );
    }
}

fn spawn(rank: usize, n: usize, id: &str, scenario: &str, env: &[(&str, &str)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().expect("exe"));
    cmd.args(["--exact", "port_worker", "--ignored", "--nocapture"])
        .env("FLAGCX_TEST_SCENARIO", scenario)
        .env("FLAGCX_RANK", rank.to_string())
        .env("FLAGCX_NRANKS", n.to_string())
        .env("FLAGCX_LOCAL_RANK", rank.to_string())
        .env("FLAGCX_UNIQUE_ID", id)
        .env("FLAGCX_VENDOR", "host")
        .env_remove("FLAGCX_SKIP_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // `NAME@r` sets NAME for rank r only.
    for (k, v) in env {
        match k.split_once('@') {
            Some((name, r)) if r == rank.to_string() => {
                cmd.env(name, v);
            }
            Some(_) => {}
            None => {
                cmd.env(k, v);
            }
        }
    }
    cmd.spawn().expect("spawn rank")
}

/// Runs `n` ranks; their outputs, each within a minute (a hung rank is killed and fails).
fn job(n: usize, scenario: &str, env: &[(&str, &str)]) -> Vec<Output> {
    let id = UniqueId::random().expect("id").to_string();
    let ranks: Vec<Child> = (0..n).map(|r| spawn(r, n, &id, scenario, env)).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    ranks
        .into_iter()
        .map(|mut c| {
            while c.try_wait().expect("wait").is_none() {
                if Instant::now() > deadline {
                    let _ = c.kill();
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            c.wait_with_output().expect("output")
        })
        .collect()
}

fn text(o: &Output) -> String {
    format!(
        "{}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Every rank in `ranks` succeeded and printed its `port ok` line.
fn assert_ok(outs: &[Output], ranks: &[usize]) {
    for (r, o) in outs.iter().enumerate().filter(|(_, o)| !o.status.success()) {
        eprintln!("rank {r} failed:\n{}", text(o));
    }
    for &r in ranks {
        let t = text(&outs[r]);
        assert!(
            outs[r].status.success() && t.contains(&format!("port ok: rank {r}:")),
            "rank {r}:\n{t}"
        );
        for l in t.lines().filter(|l| l.starts_with("port ok")) {
            println!("{l}");
        }
    }
}

#[test]
fn pingpong_wraps_a_three_slot_ring() {
    assert_ok(&job(2, "pingpong", &[]), &[0, 1]);
}

#[test]
fn a_one_slot_ring_stays_full_and_loses_nothing() {
    assert_ok(&job(2, "full_ring", &[]), &[0, 1]);
}

#[test]
fn four_ranks_drive_every_pair_at_once() {
    assert_ok(&job(4, "many", &[]), &[0, 1, 2, 3]);
}

#[test]
fn a_bad_trigger_poisons_both_sides() {
    assert_ok(&job(2, "bad_trigger", &[]), &[0, 1]);
}

/// Rank 1 kills itself while rank 0 waits for its signal; rank 0 is released.
fn killed_job(env: &[(&str, &str)]) {
    let outs = job(2, "killed", env);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&outs[1].status),
        Some(libc::SIGKILL),
        "rank 1 was to die:\n{}",
        text(&outs[1])
    );
    assert_ok(&outs, &[0]);
}

#[test]
fn a_killed_peer_releases_the_waiting_side() {
    killed_job(&[]);
}

#[test]
fn bad_arguments_are_refused_on_both_sides() {
    assert_ok(&job(2, "refused", &[]), &[0, 1]);
    // One rank alone refuses: the other is told, not left waiting.
    assert_ok(&job(2, "one_refuses", &[]), &[0, 1]);
    let env = [STAGED[0], ("FLAGCX_PORT_LANE_SLOT@1", "100")];
    assert_ok(&job(2, "one_refuses", &env), &[0, 1]);
}

/// The same scenarios where the pair is staged (`FLAGCX_P2P_DISABLE=1`): puts go through the
/// lanes of shared host memory instead of one copy into the peer.
const STAGED: &[(&str, &str)] = &[("FLAGCX_P2P_DISABLE", "1")];

#[test]
fn staged_pairs_pingpong_through_their_lanes() {
    assert_ok(&job(2, "pingpong", STAGED), &[0, 1]);
    assert_ok(&job(2, "full_ring", STAGED), &[0, 1]);
}

#[test]
fn staged_puts_larger_than_the_lane_wait_for_credits() {
    assert_ok(&job(2, "big", STAGED), &[0, 1]);
    assert_ok(&job(2, "big", &[]), &[0, 1]);
}

/// Each rank chooses its own lane's slot size (`FLAGCX_PORT_LANE_SLOT`) and announces it: 4 KiB
/// slots (2 300 chunks per large put) against the default, and 64 KiB slots for the random
/// ping-pong; a slot size out of range is refused before anything is exchanged.
#[test]
fn staged_lanes_take_each_senders_slot_size() {
    let env = [STAGED[0], ("FLAGCX_PORT_LANE_SLOT@0", "4K")];
    assert_ok(&job(2, "big", &env), &[0, 1]);
    let env = [STAGED[0], ("FLAGCX_PORT_LANE_SLOT", "64K")];
    assert_ok(&job(2, "pingpong", &env), &[0, 1]);
    let env = [STAGED[0], ("FLAGCX_PORT_LANE_SLOT", "100")];
    assert_ok(&job(2, "bad_slot", &env), &[0, 1]);
}

#[test]
fn staged_pairs_drive_every_pair_at_once() {
    assert_ok(&job(4, "many", STAGED), &[0, 1, 2, 3]);
}

/// `FLAGCX_TIMEOUT_MS` covers a port proxy blocked inside a vendor call ([`stalled_proxy`]).
#[test]
fn a_proxy_blocked_in_a_vendor_call_fails_its_channels() {
    let timeout = ("FLAGCX_TIMEOUT_MS", "300");
    assert_ok(&job(2, "stalled_proxy", &[timeout]), &[0, 1]);
    assert_ok(&job(2, "stalled_proxy", &[timeout, STAGED[0]]), &[0, 1]);
    // No false alarm: a proxy with open channels and nothing to do is not stalled.
    assert_ok(&job(2, "quiet", &[timeout]), &[0, 1]);
    assert_ok(&job(2, "quiet", &[timeout, STAGED[0]]), &[0, 1]);
}

#[test]
fn staged_pairs_fail_like_ipc_pairs() {
    assert_ok(&job(2, "bad_trigger", STAGED), &[0, 1]);
    killed_job(STAGED);
}
