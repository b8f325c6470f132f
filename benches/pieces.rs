//! Criterion benches of the pieces, in one process (`cargo bench --bench pieces`):
//! the shared-memory counter hand-off between two threads, the proxy's step turnaround (a
//! zero-byte exchange between two ranks living in one process), event polling, and host-vendor
//! copies. Whole-job numbers come from `flagcx-perf`.

// criterion_group!/criterion_main! generate undocumented items.
#![allow(missing_docs)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flagcx::host::HostAdaptor;
use flagcx::p2p::channel::{Channel, Counter, Geometry};
use flagcx::p2p::shm::ShmSegment;
use flagcx::p2p::{Comm, Config, UniqueId};
use flagcx::{DeviceAdaptor, DeviceBuffer, Event, Stream};

/// One round trip of a counter between two threads through a channel mapped twice.
fn ring_handoff(c: &mut Criterion) {
    let geo = Geometry {
        slots: 2,
        chunk: 4096,
        split: 8,
        eager: 0,
    };
    let a = Channel::create(geo).unwrap();
    let fd = a.segment().fd().try_clone_to_owned().unwrap();
    let b = Channel::open(ShmSegment::open(fd, geo.len()).unwrap(), geo).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let echo = thread::spawn(move || {
        let mut seen = 0;
        while !s2.load(Ordering::Relaxed) {
            let t = b.load(Counter::Tail);
            if t != seen {
                seen = t;
                b.store(Counter::Head, t);
            }
            std::hint::spin_loop();
        }
    });
    let mut n = 0u64;
    c.bench_function("shm counter hand-off round trip", |bench| {
        bench.iter(|| {
            n += 1;
            a.store(Counter::Tail, n);
            while a.load(Counter::Head) != n {
                std::hint::spin_loop();
            }
        })
    });
    stop.store(true, Ordering::Relaxed);
    echo.join().unwrap();
}

/// A zero-byte exchange between two ranks of one process: bootstrap-free proxy turnaround.
fn proxy_turnaround(c: &mut Criterion) {
    let id = UniqueId::random().unwrap();
    let id2 = id.clone();
    let config = Config::default();
    let peer_cfg = config.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let peer = thread::spawn(move || {
        let a = HostAdaptor::with_devices(1, 2).unwrap();
        let comm = Comm::init(a.clone(), 1, 2, &id2, peer_cfg).unwrap();
        let s = Stream::new(&a).unwrap();
        let b = DeviceBuffer::new(&a, 1).unwrap();
        while !s2.load(Ordering::Relaxed) {
            // SAFETY: zero bytes move; `b` outlives the waits.
            let r = unsafe { comm.recv_raw(b.ptr(), 0, 0, s.handle()) }.unwrap();
            if r.wait().is_err() {
                break;
            }
            // SAFETY: as above.
            let q = unsafe { comm.send_raw(b.ptr(), 0, 0, s.handle()) }.unwrap();
            if q.wait().is_err() {
                break;
            }
        }
    });
    let a = HostAdaptor::with_devices(0, 2).unwrap();
    let comm = Comm::init(a.clone(), 0, 2, &id, config).unwrap();
    let s = Stream::new(&a).unwrap();
    let b = DeviceBuffer::new(&a, 1).unwrap();
    c.bench_function("proxy zero-byte round trip (2 ranks, 1 process)", |bench| {
        bench.iter(|| {
            // SAFETY: zero bytes move; `b` outlives the waits.
            unsafe {
                comm.send_raw(b.ptr(), 0, 1, s.handle())
                    .unwrap()
                    .wait()
                    .unwrap();
                comm.recv_raw(b.ptr(), 0, 1, s.handle())
                    .unwrap()
                    .wait()
                    .unwrap();
            }
        })
    });
    stop.store(true, Ordering::Relaxed);
    // One more exchange releases the peer from its last wait; then both sides drop.
    // SAFETY: as above.
    unsafe {
        let _ = comm.send_raw(b.ptr(), 0, 1, s.handle()).map(|r| r.wait());
        let _ = comm.recv_raw(b.ptr(), 0, 1, s.handle()).map(|r| r.wait());
    }
    drop(comm);
    peer.join().unwrap();
}

fn event_polling(c: &mut Criterion) {
    let a = HostAdaptor::open(0).unwrap();
    let s = Stream::new(&a).unwrap();
    let e = Event::new(&a, false).unwrap();
    e.record(&s).unwrap();
    e.synchronize().unwrap();
    c.bench_function("event query (completed)", |bench| {
        bench.iter(|| e.query().unwrap())
    });
}

fn host_copies(c: &mut Criterion) {
    let a = HostAdaptor::open(0).unwrap();
    let s = Stream::new(&a).unwrap();
    let mut g = c.benchmark_group("host vendor d2d copy + synchronize");
    for size in [4usize << 10, 64 << 10, 1 << 20, 16 << 20] {
        let src = DeviceBuffer::new(&a, size).unwrap();
        let dst = DeviceBuffer::new(&a, size).unwrap();
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |bench, &n| {
            bench.iter(|| {
                // SAFETY: both buffers hold `n` bytes and outlive the synchronize.
                unsafe {
                    a.memcpy_d2d_async(dst.ptr(), src.ptr(), n, s.handle())
                        .unwrap()
                };
                s.synchronize().unwrap();
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    ring_handoff,
    proxy_turnaround,
    event_polling,
    host_copies
);
criterion_main!(benches);
