//! The conformance suite every vendor crate runs (feature `conformance`).
//!
//! A vendor proves itself by instantiating [`conformance_tests!`](crate::conformance_tests) in
//! an integration test with an expression that opens its adaptor:
//!
//! ```ignore
//! flagcx_adaptor::conformance_tests!(flagcx_host::HostAdaptor::open(0));
//! ```
//!
//! Each case is one `#[test]`. When opening the adaptor returns
//! [`AdaptorError::Unavailable`] (no runtime, no device), the
//! test prints `skipped: <reason>` and appends a line to the file named by `FLAGCX_SKIP_LOG`,
//! which `cargo xtask test` reads to report skips: a vendor without a device never counts as a
//! pass. Any other failure to open the adaptor fails the test.
//!
//! The two-process IPC cases re-run the test binary as a child (an `#[ignore]`d test selected
//! with `--exact`), hand it a handle — as bytes in its environment, or as an inherited file
//! descriptor — and check data in both directions.

// tidy: long file: one function per conformance case, every case of the contract in one place so a vendor author reads them side by side.

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{
    AdaptorError, CaptureMode, CaptureModeGuard, DeviceAdaptor, DeviceBuffer, DevicePtr, Event,
    IpcFdHandle, IpcMapping, IpcMemHandle, PinnedBuffer, Result, Stream, StreamHandle, Vendor,
    WaitCondition,
};

/// Environment variable naming the file where skipped tests are logged.
pub const SKIP_LOG_ENV: &str = "FLAGCX_SKIP_LOG";
/// Environment variable listing capabilities the adaptor must report (comma-separated field
/// names of [`crate::Capabilities`]), for runs on a machine whose hardware is known.
pub const EXPECT_CAPS_ENV: &str = "FLAGCX_EXPECT_CAPS";
mod reduce;
mod slots;
pub use reduce::{
    reduction_operands_are_checked, reductions_match_the_host_reference,
    reductions_past_2_pow_31_elements,
};
pub use slots::slot_steps_move_messages;

const CHILD_ROLE_ENV: &str = "FLAGCX_CONFORMANCE_CHILD";
const CHILD_HANDLE_ENV: &str = "FLAGCX_CONFORMANCE_HANDLE";
const CHILD_FD_ENV: &str = "FLAGCX_CONFORMANCE_FD";
const CHILD_SIZE_ENV: &str = "FLAGCX_CONFORMANCE_SIZE";
const CHILD_FD_SIZE_ENV: &str = "FLAGCX_CONFORMANCE_FD_SIZE";
const IPC_BYTES: usize = (1 << 20) + 37;

/// The cases that hold one of their streams on a value (or a host function) which the case
/// itself releases later, making runtime calls in between. They run alone: CUDA takes one
/// process-wide lock for every call, and a device-synchronizing call on another test thread
/// (`cuMemFree`, `cuMemFreeHost`, `cuMemHostUnregister`) keeps it while it waits for every
/// stream of the device — the held one included — so the releasing thread's next call
/// (`cuStreamQuery`, `cuLaunchKernel`, `cuStreamWriteValue64`) waits for ever. Seen on an H200
/// (2026-12-03, stacks in docs/reliability.md): 5 of 15 parallel runs of the CUDA suite hung
/// so, with `cuMemFreeHost` holding the lock. Users of one device from many threads meet the
/// same rule; the engine keeps it for its own frees (`Engine::trim_at_rest`).
const HOLDS_A_STREAM: &[&str] = &[
    "host_functions",
    "large_copies_keep_stream_order",
    "events_follow_earlier_work",
    "stream_gates",
    "stream_memory_ops",
    "sized_copies_read_their_length_late",
    "slot_steps_move_messages",
];

/// Shared by every case of this process; taken exclusively by the cases of `HOLDS_A_STREAM`.
static CASES: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Runs one case: opens the adaptor, skips visibly if the vendor is unavailable. Cases in
/// `HOLDS_A_STREAM` (a private list: host functions, stream memory operations and sized
/// copies) run with no other case of the process beside them.
pub fn run_case<A: DeviceAdaptor>(test: &str, open: impl FnOnce() -> Result<A>, case: fn(&A)) {
    // A case that panicked poisoned the lock; it only orders cases, so carry on.
    let _turn = if HOLDS_A_STREAM.contains(&test) {
        Err(CASES.write().unwrap_or_else(|p| p.into_inner()))
    } else {
        Ok(CASES.read().unwrap_or_else(|p| p.into_inner()))
    };
    match open() {
        Ok(adaptor) => case(&adaptor),
        Err(e @ AdaptorError::Unavailable { .. }) => report_skip(test, &e),
        Err(e) => panic!("opening the adaptor failed (not an 'unavailable' error): {e}"),
    }
}

/// Reports that `test` is skipped because of `err` (normally [`AdaptorError::Unavailable`]):
/// prints `skipped: <reason>` and appends a line to the `FLAGCX_SKIP_LOG` file.
pub fn report_skip(test: &str, err: &AdaptorError) {
    let (vendor, reason) = match err {
        AdaptorError::Unavailable { vendor, reason } => (vendor.name(), reason.clone()),
        other => ("?", other.to_string()),
    };
    report_skip_reason(test, vendor, &reason);
}

/// Reports that `test` could not check its claim on `vendor` for `reason` (a case that does
/// not apply to this vendor or placement): prints `skipped: <reason>` and appends a line to
/// the `FLAGCX_SKIP_LOG` file, so the run counts it like any other skip.
pub fn report_skip_reason(test: &str, vendor: &str, reason: &str) {
    println!("skipped: {reason}");
    eprintln!("skipped: {test}: {reason}");
    if let Some(path) = std::env::var_os(SKIP_LOG_ENV) {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            // One write per line: parallel tests append to the same file.
            let _ = f.write_all(format!("{vendor}\t{test}\t{reason}\n").as_bytes());
        }
    }
}

fn pattern(i: usize, seed: u8) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8)
}

fn filled(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| pattern(i, seed)).collect()
}

fn first_mismatch(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

fn assert_same(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = first_mismatch(got, want) {
        panic!("{what}: byte {i} is {:#x}, expected {:#x}", got[i], want[i]);
    }
}

fn assert_err<T: std::fmt::Debug>(what: &str, r: Result<T>) -> AdaptorError {
    match r {
        Ok(v) => panic!("{what}: expected an error, got Ok({v:?})"),
        Err(e) => e,
    }
}

/// Device count, index and properties are consistent; an out-of-range device is typed.
pub fn device_properties<A: DeviceAdaptor>(a: &A) {
    let count = a.device_count().expect("device_count");
    assert!(count >= 1, "an opened adaptor reports {count} devices");
    assert!(a.device() < count);
    let p = a.properties(a.device()).expect("properties");
    assert_eq!(p.vendor, a.vendor());
    assert_eq!(p.index, a.device());
    assert!(!p.name.is_empty());
    assert!(p.total_memory > 0);
    let e = assert_err("properties(count)", a.properties(count));
    assert!(
        matches!(e, AdaptorError::InvalidDevice { index, .. } if index == count),
        "{e}"
    );
    // On a known machine the run can insist on capabilities, so that "unsupported, and
    // correctly reported as such" cannot pass where the feature must work (the GPU bundle sets
    // this for CUDA on the H200).
    if let Ok(list) = std::env::var(EXPECT_CAPS_ENV) {
        let c = a.capabilities();
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let have = match name {
                "ipc_bytes" => c.ipc_bytes,
                "ipc_fd" => c.ipc_fd,
                "host_register" => c.host_register,
                "peer_access" => c.peer_access,
                "host_functions" => c.host_functions,
                "stream_mem_ops" => c.stream_mem_ops,
                "stream_mem_ops_64" => c.stream_mem_ops_64,
                "capture_mode" => c.capture_mode,
                "host_addressable" => c.host_addressable,
                "host_pin" => c.host_pin,
                "sized_copy" => c.sized_copy,
                "host_gates" => c.host_gates,
                "concurrent_processes" => c.concurrent_processes,
                "ipc_fd_foreign" => c.ipc_fd_foreign,
                other => panic!("{EXPECT_CAPS_ENV}: unknown capability {other}"),
            };
            assert!(
                have,
                "{} lacks expected capability {name}: {c:?}",
                a.vendor()
            );
        }
        println!("capabilities as expected: {c:?}");
    }
}

/// Host→device→device→host round trips of odd sizes at odd offsets, plus memset.
pub fn memory_round_trip_odd_sizes<A: DeviceAdaptor>(a: &A) {
    let s = Stream::new(a).expect("stream");
    for &n in &[1usize, 3, 7, 63, 4095, 4097, 65_537, (1 << 20) + 13] {
        let src = filled(n, n as u8);
        let d1 = DeviceBuffer::new(a, n + 5).expect("alloc d1");
        let d2 = DeviceBuffer::new(a, n + 11).expect("alloc d2");
        d1.write(5, &src, &s).expect("h2d");
        // SAFETY: both ranges lie inside live allocations; synchronized before they drop.
        unsafe {
            a.memcpy_d2d_async(
                d2.ptr().checked_add(11).unwrap(),
                d1.ptr().checked_add(5).unwrap(),
                n,
                s.handle(),
            )
            .expect("d2d");
        }
        let mut out = vec![0u8; n];
        d2.read(11, &mut out, &s).expect("d2h");
        assert_same(&format!("round trip of {n} bytes"), &out, &src);

        d2.fill(0xA5, &s).expect("memset");
        let mut all = vec![0u8; n + 11];
        d2.read(0, &mut all, &s).expect("d2h after memset");
        assert!(all.iter().all(|&b| b == 0xA5), "memset of {n} bytes");
    }
    // Zero-byte copies and memsets are accepted and do nothing.
    let d = DeviceBuffer::new(a, 16).expect("alloc");
    d.write(16, &[], &s).expect("zero-byte write at the end");
    // SAFETY: zero-byte operations touch no memory.
    unsafe {
        a.memcpy_d2d_async(d.ptr(), d.ptr(), 0, s.handle())
            .expect("zero-byte d2d");
        a.memset_async(d.ptr(), 1, 0, s.handle())
            .expect("zero-byte memset");
    }
    s.synchronize().expect("sync");
}

/// Shareable memory on a chosen device (`mem_alloc_shareable_on`): on this adaptor's own
/// device it holds what this adaptor's stream copies in and reads back; a device index out of
/// range is refused with a typed error; on each other device of the vendor the allocation
/// either works the same way (the copies crossing to that device) or is refused with a typed
/// error — never memory that returns other bytes.
pub fn shareable_on_a_chosen_device<A: DeviceAdaptor>(a: &A) {
    let s = Stream::new(a).expect("stream");
    let n = (1 << 20) + 4097;
    let round_trip = |p: DevicePtr, seed: u8, what: &str| {
        let src = filled(n, seed);
        let mut out = vec![0u8; n];
        // SAFETY: `p` holds at least `n` bytes (allocated so just before); the host buffers
        // outlive the synchronization that ends each copy.
        unsafe {
            a.memcpy_h2d_async(p, src.as_ptr(), n, s.handle())
                .expect("h2d");
            a.memcpy_d2h_async(out.as_mut_ptr(), p, n, s.handle())
                .expect("d2h");
        }
        s.synchronize().expect("sync");
        assert_same(what, &out, &src);
    };
    let own = a
        .mem_alloc_shareable_on(n, a.device())
        .expect("shareable memory on this adaptor's own device");
    round_trip(own, 7, "shareable memory on the own device");
    // SAFETY: the copies above completed.
    unsafe { a.mem_free(own) }.expect("free");
    let count = a.device_count().expect("device count");
    let e = assert_err("a device out of range", a.mem_alloc_shareable_on(n, count));
    assert!(
        matches!(
            e,
            AdaptorError::InvalidDevice { .. }
                | AdaptorError::InvalidArgument { .. }
                | AdaptorError::Unsupported { .. }
        ),
        "{e:?}"
    );
    if count < 2 {
        let why = "one device: no other device to place shareable memory on";
        report_skip_reason(
            "conformance::shareable_on_a_chosen_device (other devices)",
            a.vendor().name(),
            why,
        );
    }
    for d in (0..count).filter(|&d| d != a.device()) {
        match a.mem_alloc_shareable_on(n, d) {
            Ok(p) => {
                round_trip(
                    p,
                    d as u8,
                    &format!("shareable memory placed on device {d}"),
                );
                // SAFETY: as above.
                unsafe { a.mem_free(p) }.expect("free");
            }
            Err(e) => assert!(
                matches!(
                    e,
                    AdaptorError::Unsupported { .. }
                        | AdaptorError::Vendor { .. }
                        | AdaptorError::OutOfMemory { .. }
                ),
                "placing memory on device {d}: {e:?}"
            ),
        }
    }
}

/// Copies through pinned host memory in both directions.
pub fn pinned_host_copies<A: DeviceAdaptor>(a: &A) {
    let s = Stream::new(a).expect("stream");
    let n = 3 * 4096 + 1;
    let mut pinned = PinnedBuffer::new(a, n).expect("host_alloc");
    pinned.as_mut_slice().copy_from_slice(&filled(n, 9));
    let d = DeviceBuffer::new(a, n).expect("alloc");
    // SAFETY: pinned and device ranges are live until the synchronize below.
    unsafe {
        a.memcpy_h2d_async(d.ptr(), pinned.as_ptr(), n, s.handle())
            .expect("pinned h2d");
        a.memset_async(d.ptr(), 0x11, 1, s.handle())
            .expect("memset");
        a.memcpy_d2h_async(pinned.as_ptr(), d.ptr(), n, s.handle())
            .expect("pinned d2h");
    }
    s.synchronize().expect("sync");
    let mut want = filled(n, 9);
    want[0] = 0x11;
    assert_same("pinned round trip", pinned.as_slice(), &want);
}

/// Zero and huge sizes give typed errors.
pub fn zero_and_huge_sizes<A: DeviceAdaptor>(a: &A) {
    let e = assert_err("mem_alloc(0)", a.mem_alloc(0));
    assert!(matches!(e, AdaptorError::InvalidArgument { .. }), "{e}");
    let e = assert_err("host_alloc(0)", a.host_alloc(0));
    assert!(matches!(e, AdaptorError::InvalidArgument { .. }), "{e}");
    let huge = 1usize << 62;
    let e = assert_err("mem_alloc(2^62)", a.mem_alloc(huge));
    assert!(
        matches!(
            e,
            AdaptorError::OutOfMemory { .. }
                | AdaptorError::InvalidArgument { .. }
                | AdaptorError::Vendor { .. }
        ),
        "{e}"
    );
    let e = assert_err("mem_alloc_shareable(2^62)", a.mem_alloc_shareable(huge));
    assert!(!matches!(e, AdaptorError::Unavailable { .. }), "{e}");
    // The adaptor still works after refusing.
    let d = DeviceBuffer::new(a, 8).expect("alloc after refusals");
    let s = Stream::new(a).expect("stream");
    d.write(0, &[1; 8], &s).expect("write");
}

/// A fill of a buffer past one gibibyte, and one straddling the gibibyte at an odd offset,
/// write every byte they cover and none past (NVIDIA's OpenCL broke its context on a fill
/// reaching past 2 GiB; the OpenCL adaptor fills past the first gibibyte with its own kernel).
/// Skipped (counted) where the device has less than 2 GiB or refuses the buffer.
pub fn fills_past_one_gibibyte<A: DeviceAdaptor>(a: &A) {
    const TEST: &str = "fills_past_one_gibibyte";
    const GIB: usize = 1 << 30;
    let len = GIB + 8192;
    let vendor = a.vendor().name();
    let room = a.properties(a.device()).map_or(0, |p| p.total_memory);
    if room < 2 * GIB as u64 {
        report_skip_reason(TEST, vendor, "less than 2 GiB of device memory");
        return;
    }
    let d = match DeviceBuffer::new(a, len) {
        Ok(d) => d,
        Err(e) => {
            report_skip_reason(TEST, vendor, &format!("a 1 GiB + 8 KiB buffer: {e}"));
            return;
        }
    };
    let s = Stream::new(a).expect("stream");
    d.fill(7, &s).expect("fill of 1 GiB + 8 KiB");
    let (from, n) = (GIB - 3, 4099);
    // SAFETY: `from..from + n` lies inside `d`, which outlives the synchronizing reads below.
    unsafe { a.memset_async(DevicePtr(d.ptr().0 + from as u64), 9, n, s.handle()) }
        .expect("fill straddling the gibibyte");
    let window = GIB - 4096..len;
    let mut got = vec![0u8; window.len()];
    d.read(window.start, &mut got, &s).expect("read");
    let want: Vec<u8> = window
        .clone()
        .map(|p| if (from..from + n).contains(&p) { 9 } else { 7 })
        .collect();
    assert_same("bytes around the gibibyte and to the end", &got, &want);
    let mut head = [0u8; 64];
    d.read(0, &mut head, &s).expect("read the start");
    assert_eq!(head, [7u8; 64], "the first bytes");
}

/// Null and foreign pointers and handles are refused with typed errors, never a crash.
pub fn null_and_foreign_pointers<A: DeviceAdaptor>(a: &A) {
    let foreign = DevicePtr(0x7eed_0000_1000);
    let s = Stream::new(a).expect("stream");
    let caps = a.capabilities();
    // A refusal is `InvalidArgument` or `InvalidHandle` — typed, before any driver call —
    // or `Unsupported` where the vendor lacks the operation altogether.
    let rejected = |what: &str, r: Result<()>, unsupported_ok: bool| {
        let e = assert_err(what, r);
        assert!(
            matches!(
                e,
                AdaptorError::InvalidArgument { .. } | AdaptorError::InvalidHandle { .. }
            ) || (unsupported_ok && e.is_unsupported()),
            "{what}: expected InvalidArgument or InvalidHandle, got {e:?}"
        );
    };
    // SAFETY: every call below must be rejected by the adaptor before it touches memory.
    unsafe {
        rejected("mem_free(NULL)", a.mem_free(DevicePtr::NULL), false);
        rejected("mem_free(foreign)", a.mem_free(foreign), false);
        rejected("host_free(null)", a.host_free(std::ptr::null_mut()), false);
        rejected(
            "host_unregister(never registered)",
            a.host_unregister(0x1000 as *mut u8),
            !caps.host_register,
        );
        rejected(
            "ipc_close(foreign)",
            a.ipc_close(foreign),
            !caps.ipc_bytes && !caps.ipc_fd,
        );
        let d = DeviceBuffer::new(a, 64).expect("alloc");
        rejected(
            "h2d from null",
            a.memcpy_h2d_async(d.ptr(), std::ptr::null(), 8, s.handle()),
            false,
        );
        rejected(
            "d2h into null",
            a.memcpy_d2h_async(std::ptr::null_mut(), d.ptr(), 8, s.handle()),
            false,
        );
        rejected(
            "d2d to NULL",
            a.memcpy_d2d_async(DevicePtr::NULL, d.ptr(), 8, s.handle()),
            false,
        );
        rejected(
            "memset NULL",
            a.memset_async(DevicePtr::NULL, 0, 8, s.handle()),
            false,
        );
    }
    rejected(
        "mem_get_range(NULL)",
        a.mem_get_range(DevicePtr::NULL).map(|_| ()),
        false,
    );
    rejected(
        "mem_get_range(foreign)",
        a.mem_get_range(foreign).map(|_| ()),
        false,
    );
    let bogus = IpcMemHandle {
        vendor: a.vendor(),
        bytes: [0x5a; crate::IPC_HANDLE_BYTES],
    };
    assert_err("ipc_open_handle(garbage)", a.ipc_open_handle(&bogus));
    let other = if a.vendor() == Vendor::Host {
        Vendor::Cuda
    } else {
        Vendor::Host
    };
    let e = assert_err(
        "ipc_open_handle(other vendor)",
        a.ipc_open_handle(&IpcMemHandle {
            vendor: other,
            ..bogus
        }),
    );
    assert!(
        matches!(
            e,
            AdaptorError::InvalidArgument { .. } | AdaptorError::Unsupported { .. }
        ),
        "{e}"
    );
    s.synchronize()
        .expect("the stream survives refused operations");
}

/// `mem_buffer_id`: where the runtime has identifiers, an allocation gives the same one at
/// every offset, another live allocation a different one, and an allocation made after the
/// first was freed (often at its addresses) a new one. Where it has none, every allocation
/// says `None`.
pub fn buffer_ids_tell_allocations_apart<A: DeviceAdaptor>(a: &A) {
    const LEN: usize = 1 << 20;
    let id = |b: &DeviceBuffer<A>, off: usize| {
        a.mem_buffer_id(b.ptr().checked_add(off).expect("inside"))
            .expect("buffer id")
    };
    let x = DeviceBuffer::new(a, LEN).expect("alloc");
    let y = DeviceBuffer::new(a, LEN).expect("alloc");
    let (xid, yid) = (id(&x, 0), id(&y, 0));
    let Some(first) = xid else {
        assert_eq!(yid, None, "identifiers for some allocations only");
        println!("buffer ids: the runtime has none");
        return;
    };
    assert_eq!(id(&x, 4097), xid, "the same allocation at another offset");
    assert!(
        yid.is_some() && yid != xid,
        "two live allocations: {xid:?}, {yid:?}"
    );
    let at = x.ptr();
    drop(x);
    let z = DeviceBuffer::new(a, LEN).expect("alloc");
    let zid = id(&z, 0);
    assert!(
        zid.is_some() && zid != xid && zid != yid,
        "an allocation after a free: {zid:?} against {first} and {yid:?}"
    );
    println!(
        "buffer ids: {first}, {yid:?}, then {zid:?} ({} address)",
        if z.ptr() == at {
            "the freed one's"
        } else {
            "another"
        }
    );
}

/// The range query finds the allocation containing an interior pointer.
pub fn allocation_range<A: DeviceAdaptor>(a: &A) {
    let d = DeviceBuffer::new(a, 10_000).expect("alloc");
    let (base, size) = a
        .mem_get_range(d.ptr().checked_add(4321).unwrap())
        .expect("range");
    assert_eq!(base, d.ptr());
    assert!(size >= 10_000, "range size {size}");
}

/// Stream and event handles that were never created, or were destroyed, are typed errors.
pub fn invalid_handles<A: DeviceAdaptor>(a: &A) {
    let s = a.stream_create().expect("stream");
    a.stream_destroy(s).expect("destroy");
    let e = assert_err("synchronize destroyed stream", a.stream_synchronize(s));
    assert!(matches!(e, AdaptorError::InvalidHandle { .. }), "{e}");
    assert_err("destroy twice", a.stream_destroy(s));
    let ev = a.event_create(false).expect("event");
    a.event_destroy(ev).expect("destroy event");
    let e = assert_err("query destroyed event", a.event_query(ev));
    assert!(matches!(e, AdaptorError::InvalidHandle { .. }), "{e}");
    let e = assert_err(
        "query made-up stream",
        a.stream_query(StreamHandle(0xdead_beef_0000)),
    );
    assert!(matches!(e, AdaptorError::InvalidHandle { .. }), "{e}");
}

/// Many queued operations on one stream complete in order.
pub fn stream_ordering_many_ops<A: DeviceAdaptor>(a: &A) {
    const OPS: usize = 512;
    let s = Stream::new(a).expect("stream");
    let scratch = DeviceBuffer::new(a, 4096).expect("scratch");
    let out = DeviceBuffer::new(a, OPS).expect("out");
    for i in 0..OPS {
        // SAFETY: both buffers outlive the synchronize below.
        unsafe {
            // Each memset overwrites the scratch page; only in-order execution copies value i
            // into slot i.
            a.memset_async(scratch.ptr(), i as u8, 4096, s.handle())
                .expect("memset");
            a.memcpy_d2d_async(
                out.ptr().checked_add(i).unwrap(),
                scratch.ptr().checked_add(i % 4096).unwrap(),
                1,
                s.handle(),
            )
            .expect("d2d");
        }
    }
    s.synchronize().expect("sync");
    assert!(s.query().expect("query"), "synchronized stream is idle");
    let mut host = vec![0u8; OPS];
    out.read(0, &mut host, &s).expect("read");
    for (i, &b) in host.iter().enumerate() {
        assert_eq!(b, i as u8, "slot {i}: stream ran out of order");
    }
}

/// Copies of several MiB, in every direction, are each one step of their stream: they start
/// only once everything before them finished and everything after them sees all their bytes
/// — also where a runtime cuts one copy into parts that run at once (OpenCL on CPU devices).
/// A host function holds the stream and then rewrites the source, so a copy that started
/// early reads old bytes; a host function behind the copies checks the result as it runs.
pub fn large_copies_keep_stream_order<A: DeviceAdaptor>(a: &A) {
    const N: usize = (9 << 20) + 4099;
    if !a.capabilities().host_functions {
        report_skip_reason(
            "large_copies_keep_stream_order",
            a.vendor().name(),
            "no host functions to hold the stream with",
        );
        return;
    }
    let pattern = |i: usize| (i as u8).wrapping_mul(7) ^ (i >> 12) as u8;
    let s = Stream::new(a).expect("stream");
    let mut src = PinnedBuffer::new(a, N).expect("pinned source");
    let mut dst = PinnedBuffer::new(a, N).expect("pinned destination");
    src.as_mut_slice().fill(0xEE);
    dst.as_mut_slice().fill(0);
    let (from, into) = (src.as_ptr() as usize, dst.as_ptr() as usize);
    let d1 = DeviceBuffer::new(a, N).expect("alloc");
    let d2 = DeviceBuffer::new(a, N).expect("alloc");
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    a.launch_host_func(
        s.handle(),
        Box::new(move || {
            let _ = rx.recv_timeout(Duration::from_secs(10));
            // SAFETY: the source outlives the stream synchronize below, and no copy reads it
            // before this function returns (what the case checks).
            let src = unsafe { std::slice::from_raw_parts_mut(from as *mut u8, N) };
            for (i, b) in src.iter_mut().enumerate() {
                *b = pattern(i);
            }
        }),
    )
    .expect("launch the holding host function");
    // SAFETY: every buffer outlives the synchronize below.
    unsafe {
        a.memcpy_h2d_async(d1.ptr(), from as *const u8, N, s.handle())
            .expect("h2d");
        a.memcpy_d2d_async(d2.ptr(), d1.ptr(), N, s.handle())
            .expect("d2d");
        a.memcpy_d2h_async(into as *mut u8, d2.ptr(), N, s.handle())
            .expect("d2h");
    }
    let wrong_then = Arc::new(AtomicU64::new(u64::MAX));
    let w = wrong_then.clone();
    a.launch_host_func(
        s.handle(),
        Box::new(move || {
            // SAFETY: the destination outlives the stream synchronize below; stream order
            // makes the copies complete before this runs.
            let dst = unsafe { std::slice::from_raw_parts(into as *const u8, N) };
            let wrong = dst
                .iter()
                .enumerate()
                .filter(|&(i, &b)| b != pattern(i))
                .count();
            w.store(wrong as u64, Ordering::SeqCst);
        }),
    )
    .expect("launch the checking host function");
    std::thread::sleep(Duration::from_millis(30));
    tx.send(()).expect("release the stream");
    s.synchronize().expect("sync");
    assert_eq!(
        wrong_then.load(Ordering::SeqCst),
        0,
        "bytes not (yet) copied when the next host function ran: a copy ran outside its \
         place in the stream"
    );
    let wrong = (0..N).filter(|&i| dst.as_slice()[i] != pattern(i)).count();
    assert_eq!(wrong, 0, "wrong bytes after the stream finished");
}

/// Events record, complete, time, and order work across streams.
pub fn events<A: DeviceAdaptor>(a: &A) {
    let s1 = Stream::new(a).expect("stream 1");
    let s2 = Stream::new(a).expect("stream 2");
    let start = Event::new(a, true).expect("event");
    let end = Event::new(a, true).expect("event");
    assert!(
        start.query().expect("query"),
        "an unrecorded event is complete"
    );
    let n = 16 << 20;
    let big = DeviceBuffer::new(a, n).expect("alloc");
    let copy = DeviceBuffer::new(a, n).expect("alloc");
    let t0 = std::time::Instant::now();
    start.record(&s1).expect("record");
    // SAFETY: buffers outlive the synchronizes below.
    unsafe {
        for v in 1..=4u8 {
            a.memset_async(big.ptr(), v, n, s1.handle())
                .expect("memset");
        }
    }
    end.record(&s1).expect("record");
    // s2 must see all of s1's memsets before its copy.
    s2.wait_event(&end).expect("wait event");
    // SAFETY: as above.
    unsafe {
        a.memcpy_d2d_async(copy.ptr(), big.ptr(), n, s2.handle())
            .expect("d2d");
    }
    s2.synchronize().expect("sync s2");
    end.synchronize().expect("event sync");
    assert!(end.query().expect("query"));
    let ms = end.elapsed_ms_since(&start).expect("elapsed");
    let wall_ms = t0.elapsed().as_secs_f32() * 1e3;
    // 64 MiB of memsets take time on any device, and no more than the host saw pass.
    assert!(
        ms > 0.0 && ms <= wall_ms * 1.05 + 0.5,
        "elapsed {ms} ms between the events, {wall_ms} ms on the host around them"
    );
    let back = start.elapsed_ms_since(&end);
    assert!(
        back.as_ref().map_or(true, |b| *b <= 0.0),
        "the start event came after the end event: {back:?}"
    );
    let mut tail = vec![0u8; 4096];
    copy.read(n - 4096, &mut tail, &s2).expect("read");
    assert!(
        tail.iter().all(|&b| b == 4),
        "s2 ran before the event it waited on"
    );
}

/// A vendor claiming `host_addressable` means it: once a stream finished writing a buffer the
/// CPU reads those bytes at the device address, and CPU writes there are what the stream copies
/// out next. Vendors without it have nothing to check.
pub fn host_addressable_memory<A: DeviceAdaptor>(a: &A) {
    let s = Stream::new(a).expect("stream");
    let n = 10_000usize;
    let d = DeviceBuffer::new(a, n).expect("alloc");
    let readable = cpu_readable(d.ptr().0);
    if !a.capabilities().host_addressable {
        // Not claimed: the CPU must not be told it may read it. A pointer into a readable
        // mapping of this process would make the claim possible and hide a bug in the
        // vendor's capabilities.
        assert!(
            !readable,
            "device pointer {} lies in a readable mapping of this process, but \
             host_addressable is not claimed",
            d.ptr()
        );
        return;
    }
    assert!(
        readable,
        "host_addressable memory at {} is not in a readable mapping",
        d.ptr()
    );
    let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    d.write(0, &data, &s).expect("write");
    s.synchronize().expect("sync");
    // SAFETY: the capability says the device address is ordinary memory of this process, `n`
    // bytes long, and the stream that wrote it has finished.
    let seen = unsafe { std::slice::from_raw_parts(d.ptr().0 as *const u8, n) }.to_vec();
    assert_eq!(seen, data, "the CPU reads what the stream wrote");
    // SAFETY: as above; nothing else touches the buffer now.
    unsafe { std::ptr::write_bytes(d.ptr().0 as *mut u8, 0x5A, n) };
    let mut back = vec![0u8; n];
    d.read(0, &mut back, &s).expect("read");
    assert!(
        back.iter().all(|&b| b == 0x5A),
        "the stream copies what the CPU wrote"
    );
}

/// Spins until `cond` holds (the stream got somewhere), failing after 10 s.
fn await_word(what: &str, cond: impl Fn() -> bool) {
    let t = std::time::Instant::now();
    while !cond() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{what}: never happened"
        );
        std::thread::yield_now();
    }
}

/// Watches a word the stream writes after a wait, for 50 ms: it must keep `held` and the
/// stream must not report idle. A correct wait passes however slow the machine; a broken
/// one is caught as soon as the stream runs past it within the watch.
fn watch_blocked<T: PartialEq + std::fmt::Debug>(
    what: &str,
    word: impl Fn() -> T,
    held: T,
    idle: impl Fn() -> bool,
) {
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_millis(50) {
        assert_eq!(word(), held, "{what} did not hold the stream");
        assert!(!idle(), "{what}: a blocked stream reports idle");
        std::thread::yield_now();
    }
}

/// Whether `addr` lies in a mapping of this process that the CPU may read
/// (`/proc/self/maps`, `r` permission).
fn cpu_readable(addr: u64) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    maps.lines().any(|l| {
        let mut f = l.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            return false;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            return false;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            return false;
        };
        (lo..hi).contains(&addr) && perms.starts_with('r')
    })
}

/// Host functions run in stream order, or are honestly unsupported.
pub fn host_functions<A: DeviceAdaptor>(a: &A) {
    let s = Stream::new(a).expect("stream");
    if !a.capabilities().host_functions {
        let e = assert_err(
            "launch_host_func",
            a.launch_host_func(s.handle(), Box::new(|| {})),
        );
        assert!(e.is_unsupported(), "{e}");
        return;
    }
    let d = DeviceBuffer::new(a, 4).expect("alloc");
    let mut pinned = PinnedBuffer::new(a, 4).expect("pinned");
    pinned.as_mut_slice().fill(0);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let addr = pinned.as_ptr() as usize;
    for round in 1..=3u8 {
        // SAFETY: buffers outlive the synchronize below.
        unsafe {
            a.memset_async(d.ptr(), round, 4, s.handle())
                .expect("memset");
            a.memcpy_d2h_async(addr as *mut u8, d.ptr(), 4, s.handle())
                .expect("d2h");
        }
        let seen = seen.clone();
        a.launch_host_func(
            s.handle(),
            Box::new(move || {
                // SAFETY: the pinned buffer outlives the stream synchronize; stream order makes
                // the copy above complete before this runs.
                let v = unsafe { std::ptr::read_volatile(addr as *const u8) };
                seen.lock().unwrap().push(v);
            }),
        )
        .expect("launch_host_func");
    }
    s.synchronize().expect("sync");
    assert_eq!(*seen.lock().unwrap(), vec![1, 2, 3]);
    // Launching never waits for the function, even on an idle stream whose function blocks
    // (OpenCL may run a callback at once on the registering thread).
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let t = std::time::Instant::now();
    a.launch_host_func(
        s.handle(),
        Box::new(move || {
            let _ = rx.recv_timeout(Duration::from_secs(5));
        }),
    )
    .expect("launch a blocking host function");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "launch_host_func blocked until its function ran"
    );
    tx.send(()).expect("release");
    s.synchronize()
        .expect("sync after the blocking host function");
    // A stream is busy while its work runs, and idle only once that work finished, with its
    // effects visible to whoever saw it idle (callers skip ordering work on idle streams).
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f = finished.clone();
    a.launch_host_func(
        s.handle(),
        Box::new(move || {
            let _ = rx.recv_timeout(Duration::from_secs(5));
            f.store(true, std::sync::atomic::Ordering::SeqCst);
        }),
    )
    .expect("launch a blocking host function");
    assert!(
        !a.stream_query(s.handle()).expect("stream_query"),
        "stream_query said idle while a host function blocked the stream"
    );
    tx.send(()).expect("release");
    let t = std::time::Instant::now();
    while !a.stream_query(s.handle()).expect("stream_query") {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the stream never went idle"
        );
        std::thread::yield_now();
    }
    assert!(
        finished.load(std::sync::atomic::Ordering::SeqCst),
        "stream_query said idle before its host function finished"
    );
}

/// An event stands for everything enqueued before its recording, however the vendor records
/// it: recorded behind a host function that blocks, an event (with or without timing) stays
/// incomplete and a second stream waiting on it waits, until the function returns; recorded
/// again once the stream is idle, or on a stream that never had work, it completes.
pub fn events_follow_earlier_work<A: DeviceAdaptor>(a: &A) {
    if !a.capabilities().host_functions {
        // Nothing can hold a stream at a known point from the host: a counted skip.
        report_skip_reason(
            "events_follow_earlier_work",
            a.vendor().name(),
            "the vendor has no host functions to hold a stream at a known point",
        );
        return;
    }
    let fresh = Stream::new(a).expect("stream");
    let never = Event::new(a, false).expect("event");
    never
        .record(&fresh)
        .expect("record on a stream that never had work");
    await_word(
        "an event on a stream that never had work completing",
        || never.query().expect("query"),
    );
    for timing in [false, true] {
        let s = Stream::new(a).expect("stream");
        let s2 = Stream::new(a).expect("stream 2");
        let d = DeviceBuffer::new(a, 4).expect("alloc");
        let ev = Event::new(a, timing).expect("event");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        a.launch_host_func(
            s.handle(),
            Box::new(move || {
                let _ = rx.recv_timeout(Duration::from_secs(5));
            }),
        )
        .expect("launch a blocking host function");
        ev.record(&s).expect("record behind it");
        s2.wait_event(&ev).expect("wait event");
        // SAFETY: `d` outlives the synchronize below.
        unsafe { a.memset_async(d.ptr(), 9, 4, s2.handle()) }.expect("memset");
        watch_blocked(
            &format!("an event (timing {timing}) behind a blocking host function"),
            || ev.query().expect("query"),
            false,
            || a.stream_query(s2.handle()).expect("stream_query"),
        );
        tx.send(()).expect("release");
        ev.synchronize().expect("event sync");
        s2.synchronize().expect("sync s2");
        let mut got = [0u8; 4];
        d.read(0, &mut got, &s2).expect("read");
        assert_eq!(
            got, [9; 4],
            "the waiting stream ran its work once the event completed"
        );
        ev.record(&s).expect("record on the idle stream");
        await_word(
            &format!("an event (timing {timing}) recorded on an idle stream completing"),
            || ev.query().expect("query"),
        );
    }
}

/// Gates hold their stream until opened, from another thread too, and open once; or they are
/// honestly unsupported.
pub fn stream_gates<A: DeviceAdaptor>(a: &A) {
    let s = Stream::new(a).expect("stream");
    if !a.capabilities().host_gates {
        let e = assert_err("stream_gate", a.stream_gate(s.handle()));
        assert!(e.is_unsupported(), "{e}");
        let e = assert_err("gate_open", a.gate_open(crate::GateHandle(1)));
        assert!(e.is_unsupported(), "{e}");
        assert!(
            !a.gate_is_last(crate::GateHandle(1)).expect("gate_is_last"),
            "no gate is last where there are none"
        );
        return;
    }
    let d = DeviceBuffer::new(a, 8).expect("alloc");
    d.write(0, &[1; 8], &s).expect("write");
    s.synchronize().expect("sync");
    let last = |g| a.gate_is_last(g).expect("gate_is_last");
    let first = a.stream_gate(s.handle()).expect("stream_gate");
    assert!(last(first), "a gate just made is its stream's last work");
    let second = a
        .stream_gate(s.handle())
        .expect("a second gate behind the first");
    assert!(
        !last(first),
        "a gate with a second one behind it is not last"
    );
    assert!(last(second), "the second gate is last");
    let waiting = Event::new(a, false).expect("event");
    waiting.record(&s).expect("record behind the second gate");
    assert!(
        last(second),
        "recording an event enqueues nothing behind a gate"
    );
    // SAFETY: `d` outlives the synchronize below.
    unsafe { a.memset_async(d.ptr(), 7, 8, s.handle()) }.expect("memset behind the gates");
    assert!(!last(second), "a gate with work behind it is not last");
    let behind = Event::new(a, false).expect("event");
    behind.record(&s).expect("record");
    watch_blocked(
        "a closed gate",
        || behind.query().expect("query"),
        false,
        || a.stream_query(s.handle()).expect("stream_query"),
    );
    a.gate_open(first).expect("open the first gate");
    watch_blocked(
        "the second gate, with the first open",
        || behind.query().expect("query"),
        false,
        || a.stream_query(s.handle()).expect("stream_query"),
    );
    assert!(!last(first), "an opened gate is not last");
    let e = assert_err("opening a gate twice", a.gate_open(first));
    assert!(
        matches!(e, AdaptorError::InvalidArgument { .. }),
        "opening a gate twice: {e}"
    );
    // Opened from another thread, as a progress thread opens them.
    std::thread::scope(|t| {
        t.spawn(|| a.gate_open(second).expect("open from another thread"));
    });
    s.synchronize().expect("sync past both gates");
    let mut got = [0u8; 8];
    d.read(0, &mut got, &s).expect("read");
    assert_eq!(
        got, [7; 8],
        "the work behind the gates ran once they opened"
    );
}

/// Registers a shared (memfd) mapping; the device writes through its alias and a second
/// mapping of the same memory sees the bytes.
pub fn host_register_shared_mapping<A: DeviceAdaptor>(a: &A) {
    let len = 1 << 20;
    let map = SharedMapping::new(len);
    if !a.capabilities().host_register {
        // SAFETY: refused before touching memory.
        let e = assert_err("host_register", unsafe { a.host_register(map.ptr, len) });
        assert!(e.is_unsupported(), "{e}");
        return;
    }
    let s = Stream::new(a).expect("stream");
    // SAFETY: `map` stays mapped until after unregister below.
    let alias = unsafe { a.host_register(map.ptr, len) }.expect("host_register");
    // SAFETY: as above; double registration must be refused.
    let again = unsafe { a.host_register(map.ptr, len) };
    assert_err("registering twice", again);
    let src = filled(len, 77);
    let d = DeviceBuffer::new(a, len).expect("alloc");
    d.write(0, &src, &s).expect("write");
    // SAFETY: alias covers the registered mapping, synchronized below.
    unsafe {
        a.memcpy_d2d_async(alias, d.ptr(), len, s.handle())
            .expect("d2d into registered memory");
    }
    s.synchronize().expect("sync");
    assert_same("second mapping", map.second_view(), &src);
    // SAFETY: no work uses the alias any more.
    unsafe { a.host_unregister(map.ptr) }.expect("unregister");
    // SAFETY: refused: already unregistered.
    assert_err("unregister twice", unsafe { a.host_unregister(map.ptr) });
}

/// Pinning a shared (memfd) mapping: raw-pointer copies into and out of it are right (what a
/// staging ring does), bytes written by the host before a copy are the ones copied, a second
/// pin and a stray unpin are refused; or pinning is honestly unsupported.
pub fn host_pin_shared_mapping<A: DeviceAdaptor>(a: &A) {
    let len = 1 << 20;
    let map = SharedMapping::new(len);
    if !a.capabilities().host_pin {
        // SAFETY: refused before touching memory.
        let e = assert_err("host_pin", unsafe { a.host_pin(map.ptr, len) });
        assert!(e.is_unsupported(), "{e}");
        return;
    }
    let s = Stream::new(a).expect("stream");
    // SAFETY: `map` stays mapped until after the unpin below.
    unsafe { a.host_pin(map.ptr, len) }.expect("host_pin");
    // SAFETY: as above; pinning twice must be refused.
    assert_err("pinning twice", unsafe { a.host_pin(map.ptr, len) });
    let d = DeviceBuffer::new(a, len).expect("alloc");
    for round in 0..3u8 {
        // The host writes the first half through the mapping, the device copies it in from the
        // pinned range and back out into the second half; a second mapping sees it there.
        let want = filled(len / 2, 31 + round);
        // SAFETY: the first half of our live mapping; no copy is in flight.
        unsafe { std::ptr::copy_nonoverlapping(want.as_ptr(), map.ptr, len / 2) };
        // SAFETY: both ranges lie in the pinned mapping and the buffer, synchronized below.
        unsafe {
            a.memcpy_h2d_async(d.ptr(), map.ptr, len / 2, s.handle())
                .expect("h2d from pinned memory");
            a.memcpy_d2h_async(map.ptr.add(len / 2), d.ptr(), len / 2, s.handle())
                .expect("d2h into pinned memory");
        }
        s.synchronize().expect("sync");
        assert_same("pinned round trip", &map.second_view()[len / 2..], &want);
    }
    // SAFETY: no copy uses the range any more.
    unsafe { a.host_unpin(map.ptr) }.expect("unpin");
    // SAFETY: refused: already unpinned.
    assert_err("unpin twice", unsafe { a.host_unpin(map.ptr) });
}

/// Stream wait/write value operations really block and release the stream, or are honestly
/// unsupported.
pub fn stream_memory_ops<A: DeviceAdaptor>(a: &A) {
    let caps = a.capabilities();
    let map = SharedMapping::new(4096);
    let s = Stream::new(a).expect("stream");
    let registered = caps.host_register;
    let alias = if registered {
        // SAFETY: `map` outlives the unregister at the end.
        unsafe { a.host_register(map.ptr, 4096) }.expect("host_register")
    } else {
        DevicePtr(map.ptr as u64)
    };
    let flag32 = alias;
    let done32 = alias.checked_add(8).unwrap();
    let flag64 = alias.checked_add(16).unwrap();
    let done64 = alias.checked_add(24).unwrap();
    // SAFETY: offsets are inside the page, aligned, and the page outlives the stream.
    let (f32h, d32h, f64h, d64h) = unsafe {
        (
            &*(map.ptr as *const AtomicU32),
            &*(map.ptr.add(8) as *const AtomicU32),
            &*(map.ptr.add(16) as *const AtomicU64),
            &*(map.ptr.add(24) as *const AtomicU64),
        )
    };
    if !caps.stream_mem_ops {
        // SAFETY: refused before touching memory.
        unsafe {
            let e = assert_err(
                "wait_value32",
                a.stream_wait_value32(s.handle(), flag32, 1, WaitCondition::Geq),
            );
            assert!(e.is_unsupported(), "{e}");
            let e = assert_err(
                "write_value32",
                a.stream_write_value32(s.handle(), done32, 1),
            );
            assert!(e.is_unsupported(), "{e}");
        }
    } else {
        // SAFETY: see above.
        unsafe {
            // The first write says the stream reached the wait; the second may only follow
            // once the flag allows it.
            a.stream_write_value32(s.handle(), done32, 1)
                .expect("write_value32");
            a.stream_wait_value32(s.handle(), flag32, 5, WaitCondition::Geq)
                .expect("wait_value32");
            a.stream_write_value32(s.handle(), done32, 7)
                .expect("write_value32");
        }
        // 1, or 7 already if the wait does not block (caught just below).
        await_word("the stream reaching its wait", || {
            d32h.load(Ordering::Acquire) != 0
        });
        // From here a correct wait holds the stream however long we look (no timing can make
        // this fail); a wait that does not block shows itself within the watch.
        watch_blocked(
            "the 32-bit wait",
            || d32h.load(Ordering::Acquire),
            1,
            || s.query().expect("query"),
        );
        f32h.store(4, Ordering::Release);
        watch_blocked(
            "a flag below the value",
            || d32h.load(Ordering::Acquire),
            1,
            || s.query().expect("query"),
        );
        // The host side of the protocol: the adaptor's own write wakes emulated waits at once.
        // SAFETY: the flag word is aligned and lives in `map`.
        unsafe { a.host_write_value32(map.ptr as *mut u32, 5) };
        s.synchronize().expect("sync");
        assert_eq!(d32h.load(Ordering::Acquire), 7);
        // SAFETY: misaligned addresses are refused before use.
        let e = assert_err("misaligned wait", unsafe {
            a.stream_wait_value32(
                s.handle(),
                alias.checked_add(2).unwrap(),
                1,
                WaitCondition::Eq,
            )
        });
        assert!(matches!(e, AdaptorError::InvalidArgument { .. }), "{e}");
    }
    if !caps.stream_mem_ops_64 {
        // SAFETY: refused before touching memory.
        let e = assert_err("wait_value64", unsafe {
            a.stream_wait_value64(s.handle(), flag64, 1, WaitCondition::Geq)
        });
        assert!(e.is_unsupported(), "{e}");
    } else {
        // SAFETY: see above.
        unsafe {
            a.stream_write_value64(s.handle(), done64, 1)
                .expect("write_value64");
            a.stream_wait_value64(s.handle(), flag64, 1 << 40, WaitCondition::Eq)
                .expect("wait_value64");
            a.stream_write_value64(s.handle(), done64, 1 << 41)
                .expect("write_value64");
        }
        await_word("the stream reaching its 64-bit wait", || {
            d64h.load(Ordering::Acquire) != 0
        });
        watch_blocked(
            "the 64-bit wait",
            || d64h.load(Ordering::Acquire),
            1,
            || s.query().expect("query"),
        );
        f64h.store(1 << 40, Ordering::Release);
        s.synchronize().expect("sync");
        assert_eq!(d64h.load(Ordering::Acquire), 1 << 41);
    }
    if registered {
        // SAFETY: the stream is idle.
        unsafe { a.host_unregister(map.ptr) }.expect("unregister");
    }
}

/// Batched 64-bit value writes into device memory (`stream_write_values64`): every word lands
/// in stream order, more of them than CUDA's driver takes in one batch, nothing around them
/// changes, a misaligned address is refused, and vendors without 64-bit value writes say
/// `Unsupported`.
pub fn stream_value_writes_in_device_memory<A: DeviceAdaptor>(a: &A) {
    let s = Stream::new(a).expect("stream");
    let words = 300usize;
    let n = 8 * (words + 2);
    let d = DeviceBuffer::new(a, n).expect("alloc");
    let at = |i: usize| DevicePtr(d.ptr().0 + 8 * (i as u64 + 1));
    let writes: Vec<(DevicePtr, u64)> = (0..words)
        .map(|i| {
            (
                at(i),
                0x0101_0101_0101_0101u64.wrapping_mul(i as u64 + 1) ^ (i as u64) << 40,
            )
        })
        .collect();
    // SAFETY: every address lies in `d`, which outlives the synchronize below.
    unsafe { a.memset_async(d.ptr(), 0xEE, n, s.handle()) }.expect("memset");
    if !a.capabilities().stream_mem_ops_64 {
        // SAFETY: refused before touching memory.
        let e = assert_err("write_values64", unsafe {
            a.stream_write_values64(s.handle(), &writes)
        });
        assert!(e.is_unsupported(), "{e}");
        return;
    }
    // SAFETY: as above; a later copy on the same stream reads the words back in order.
    unsafe {
        a.stream_write_values64(s.handle(), &[]).expect("no writes");
        a.stream_write_values64(s.handle(), &writes)
            .expect("write_values64");
    }
    let mut got = vec![0u8; n];
    // SAFETY: `got` holds `n` bytes and outlives the synchronize.
    unsafe { a.memcpy_d2h_async(got.as_mut_ptr(), d.ptr(), n, s.handle()) }.expect("d2h");
    s.synchronize().expect("sync");
    let mut want = vec![0xEEu8; n];
    for (i, &(_, v)) in writes.iter().enumerate() {
        want[8 * (i + 1)..8 * (i + 2)].copy_from_slice(&v.to_ne_bytes());
    }
    assert_same("batched value writes", &got, &want);
    // SAFETY: misaligned addresses are refused before use.
    let e = assert_err("misaligned write_values64", unsafe {
        a.stream_write_values64(s.handle(), &[(DevicePtr(d.ptr().0 + 4), 1)])
    });
    assert!(matches!(e, AdaptorError::InvalidArgument { .. }), "{e}");
    s.synchronize().expect("sync");
}

/// Copies whose length is read when the stream reaches them (`memcpy_sized_async`), from
/// registered host memory (the stream-ordered protocol's slots) where the vendor registers it,
/// else from device memory: a length written after the copy was enqueued — released by a
/// stream wait another stream satisfies — is the one used, at odd offsets and sizes on both
/// sides of 16-byte words; a length past the capacity copies nothing; zero copies nothing; a
/// misaligned length word is refused; vendors without the capability say `Unsupported`.
pub fn sized_copies_read_their_length_late<A: DeviceAdaptor>(a: &A) {
    let caps = a.capabilities();
    let cap = 8192usize;
    let dst = DeviceBuffer::new(a, cap + 64).expect("alloc");
    let s = Stream::new(a).expect("stream");
    let s2 = Stream::new(a).expect("stream");
    let map = SharedMapping::new(4 * 4096);
    let registered = caps.host_register;
    let dev = (!registered).then(|| DeviceBuffer::new(a, cap + 4096).expect("alloc"));
    let words = match &dev {
        // SAFETY: `map` outlives the unregister at the end.
        None => unsafe { a.host_register(map.ptr, map.len) }.expect("host_register"),
        Some(d) => d.ptr(),
    };
    let src = words.checked_add(4096).unwrap();
    let (len_at, flag) = (words, words.checked_add(64).unwrap());
    if !caps.sized_copy {
        // SAFETY: refused before touching memory.
        let e = assert_err("memcpy_sized_async", unsafe {
            a.memcpy_sized_async(dst.ptr(), src, len_at, cap, s.handle())
        });
        assert!(e.is_unsupported(), "{e}");
    } else {
        assert!(
            caps.stream_mem_ops_64,
            "sized copies are checked behind stream waits"
        );
        let data = filled(cap + 16, 91);
        if registered {
            // SAFETY: the registered mapping holds 3 pages past the first; nothing runs on it.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), map.ptr.add(4096), cap + 16) };
        } else {
            // SAFETY: `src` holds `cap + 4096 - 4096` ≥ `cap + 16` bytes; synchronized below.
            unsafe { a.memcpy_h2d_async(src, data.as_ptr(), cap + 16, s.handle()) }.expect("h2d");
        }
        // (destination offset, source offset, length): words, a ragged tail, bytes only.
        for (round, &(doff, soff, n)) in [(0, 0, 4096), (0, 16, 4109), (3, 5, 777), (16, 0, 1)]
            .iter()
            .enumerate()
        {
            dst.fill(0xEE, &s).expect("fill");
            let value = |v: u64| (round as u64 + 1) << 32 | v;
            // SAFETY: every address lies in live allocations or the registered mapping, all
            // synchronized below; `doff + cap` and `soff + cap` fit both.
            unsafe { a.stream_write_value64(s.handle(), len_at, 0) }.expect("len");
            s.synchronize().expect("sync");
            // SAFETY: as above.
            unsafe {
                a.stream_wait_value64(s.handle(), flag, value(1), WaitCondition::Geq)
                    .expect("wait");
                a.memcpy_sized_async(
                    DevicePtr(dst.ptr().0 + doff),
                    DevicePtr(src.0 + soff),
                    len_at,
                    cap - 16,
                    s.handle(),
                )
                .expect("sized copy");
            }
            // The length lands after the copy was enqueued, behind its stream's wait.
            std::thread::sleep(std::time::Duration::from_millis(2));
            // SAFETY: as above.
            unsafe {
                a.stream_write_value64(s2.handle(), len_at, n as u64)
                    .expect("len");
                a.stream_write_value64(s2.handle(), flag, value(1))
                    .expect("flag");
            }
            s2.synchronize().expect("sync");
            s.synchronize().expect("sync");
            let mut got = vec![0u8; cap + 64];
            dst.read(0, &mut got, &s).expect("read");
            let mut want = vec![0xEEu8; cap + 64];
            want[doff as usize..doff as usize + n]
                .copy_from_slice(&data[soff as usize..soff as usize + n]);
            assert_same(&format!("sized copy of {n} bytes"), &got, &want);
        }
        // Past the capacity, and zero: nothing moves.
        for n in [cap as u64 + 1, u64::MAX, 0] {
            dst.fill(0x11, &s).expect("fill");
            // SAFETY: as above.
            unsafe {
                a.stream_write_value64(s.handle(), len_at, n).expect("len");
                a.memcpy_sized_async(dst.ptr(), src, len_at, cap, s.handle())
                    .expect("sized copy");
            }
            let mut got = vec![0u8; cap + 64];
            dst.read(0, &mut got, &s).expect("read");
            assert_same(
                &format!("a length of {n} in a {cap}-byte capacity"),
                &got,
                &vec![0x11; cap + 64],
            );
        }
        // SAFETY: refused before use.
        let e = assert_err("misaligned length word", unsafe {
            a.memcpy_sized_async(dst.ptr(), src, DevicePtr(len_at.0 + 4), cap, s.handle())
        });
        assert!(matches!(e, AdaptorError::InvalidArgument { .. }), "{e}");
        s.synchronize().expect("sync");
    }
    if registered {
        // SAFETY: registered above; every stream that used it is synchronized.
        unsafe { a.host_unregister(map.ptr) }.expect("unregister");
    }
}

/// Peer access queries and enabling; already-enabled is success; bad peers are typed.
pub fn peer_access<A: DeviceAdaptor>(a: &A) {
    let count = a.device_count().expect("count");
    let e = assert_err("can_access_peer(count)", a.can_access_peer(count));
    assert!(matches!(e, AdaptorError::InvalidDevice { .. }), "{e}");
    if !a.capabilities().peer_access {
        let e = assert_err("enable_peer_access", a.enable_peer_access(0));
        assert!(e.is_unsupported(), "{e}");
        return;
    }
    for peer in (0..count).filter(|&p| p != a.device()) {
        if a.can_access_peer(peer).expect("can_access_peer") {
            a.enable_peer_access(peer).expect("enable");
            a.enable_peer_access(peer).expect("enable again is success");
        }
    }
}

/// The capture-mode guard relaxes the mode and restores it.
pub fn capture_mode_guard<A: DeviceAdaptor>(a: &A) {
    if !a.capabilities().capture_mode {
        let e = assert_err(
            "exchange_capture_mode",
            a.exchange_capture_mode(CaptureMode::Relaxed),
        );
        assert!(e.is_unsupported(), "{e}");
        let _guard = CaptureModeGuard::relaxed(a).expect("guard is a no-op when unsupported");
        return;
    }
    let before = a
        .exchange_capture_mode(CaptureMode::ThreadLocal)
        .expect("exchange");
    {
        let _guard = CaptureModeGuard::relaxed(a).expect("guard");
        let inside = a.exchange_capture_mode(CaptureMode::Relaxed).expect("peek");
        assert_eq!(inside, CaptureMode::Relaxed);
        let _d = DeviceBuffer::new(a, 4096).expect("alloc under the guard");
    }
    let after = a.exchange_capture_mode(before).expect("restore");
    assert_eq!(after, CaptureMode::ThreadLocal, "guard restored the mode");
}

/// The file-descriptor IPC path works within one process too where supported: export, import,
/// see the same bytes.
pub fn ipc_fd_same_process<A: DeviceAdaptor>(a: &A) {
    let s = Stream::new(a).expect("stream");
    let d = match DeviceBuffer::new_shareable(a, 4096) {
        Ok(d) => d,
        Err(e) => panic!("mem_alloc_shareable: {e}"),
    };
    if !a.capabilities().ipc_fd {
        let e = assert_err("ipc_export_fd", d.ipc_fd());
        assert!(e.is_unsupported(), "{e}");
        return;
    }
    let h = d.ipc_fd().expect("export fd");
    assert_eq!(h.vendor, a.vendor());
    assert!(h.size >= 4096);
    // Some vendors refuse to import their own export into the same process; the two-process
    // case is authoritative. Where it works, the bytes must match; where it does not, the
    // refusal is a typed error and the check is reported skipped.
    match IpcMapping::import_fd(a, &h) {
        Err(e) => {
            assert!(
                matches!(
                    e,
                    AdaptorError::Vendor { .. }
                        | AdaptorError::Unsupported { .. }
                        | AdaptorError::InvalidArgument { .. }
                ),
                "a refused same-process import is a typed vendor error: {e:?}"
            );
            report_skip_reason(
                "conformance::ipc_fd_same_process",
                a.vendor().name(),
                &format!(
                    "same-process fd import refused ({e}); ipc_two_processes covers fd handles"
                ),
            );
        }
        Ok(m) => {
            d.write(0, &filled(4096, 3), &s).expect("write");
            let view = DeviceBuffer::new(a, 4096).expect("alloc");
            // SAFETY: mapping and buffer live until the read below synchronizes.
            unsafe {
                a.memcpy_d2d_async(view.ptr(), m.ptr(), 4096, s.handle())
                    .expect("d2d from import");
            }
            let mut out = vec![0u8; 4096];
            view.read(0, &mut out, &s).expect("read");
            assert_same("same-process fd import", &out, &filled(4096, 3));
        }
    }
}

/// Another runtime's fd exports ([`crate::Capabilities::ipc_fd_foreign`]): an adaptor without
/// the capability refuses a handle from another vendor with a typed error and maps nothing;
/// one with it still refuses a zero-byte export. (A real cross-runtime import needs two
/// runtimes on one device: the facade's `opencl_maps_a_cuda_export` checks that.)
pub fn ipc_fd_foreign<A: DeviceAdaptor>(a: &A) {
    let other = if a.vendor() == Vendor::Host {
        Vendor::Cuda
    } else {
        Vendor::Host
    };
    let len = 1 << 20;
    // SAFETY: plain syscalls on a fresh descriptor; results are checked.
    let fd = unsafe {
        let fd = libc::memfd_create(c"flagcx-foreign".as_ptr(), libc::MFD_CLOEXEC);
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        let fd = OwnedFd::from_raw_fd(fd);
        assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
        fd
    };
    let typed = |e: &AdaptorError| {
        matches!(
            e,
            AdaptorError::Unsupported { .. }
                | AdaptorError::InvalidArgument { .. }
                | AdaptorError::Vendor { .. }
        )
    };
    let zero = IpcFdHandle {
        vendor: other,
        fd: fd.try_clone().expect("dup"),
        size: 0,
    };
    let e = assert_err(
        "ipc_import_fd of a zero-byte export",
        a.ipc_import_fd(&zero),
    );
    assert!(typed(&e), "{e:?}");
    if a.capabilities().ipc_fd_foreign {
        return;
    }
    let h = IpcFdHandle {
        vendor: other,
        fd,
        size: len,
    };
    let e = assert_err(
        "ipc_import_fd of another vendor's handle",
        a.ipc_import_fd(&h),
    );
    assert!(typed(&e), "{e:?}");
}

/// The IPC forms the two-process case exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpcForm {
    /// Byte-form handle, sent in the child's environment.
    Bytes,
    /// File-descriptor handle, inherited by the child.
    Fd,
}

/// Parent side of the two-process IPC case: exports a buffer, lets a child process (this test
/// binary, running `child_test`) check it and write it back, then checks the child's bytes.
pub fn ipc_two_process<A: DeviceAdaptor>(a: &A, form: IpcForm, child_test: &str) {
    let caps = a.capabilities();
    let s = Stream::new(a).expect("stream");
    let supported = match form {
        IpcForm::Bytes => caps.ipc_bytes,
        IpcForm::Fd => caps.ipc_fd,
    };
    let d = match form {
        IpcForm::Bytes => DeviceBuffer::new(a, IPC_BYTES),
        IpcForm::Fd => DeviceBuffer::new_shareable(a, IPC_BYTES),
    }
    .expect("alloc");
    if !supported {
        let e = match form {
            IpcForm::Bytes => assert_err("ipc_get_handle", d.ipc_handle()),
            IpcForm::Fd => assert_err("ipc_export_fd", d.ipc_fd()),
        };
        assert!(e.is_unsupported(), "{e}");
        return;
    }
    d.write(0, &filled(IPC_BYTES, 1), &s).expect("write");
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args([
        "--exact",
        child_test,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_SIZE_ENV, IPC_BYTES.to_string())
    .env_remove(SKIP_LOG_ENV);
    let mut inherited: Option<OwnedFd> = None;
    match form {
        IpcForm::Bytes => {
            let h = d.ipc_handle().expect("ipc_get_handle");
            cmd.env(CHILD_ROLE_ENV, "bytes")
                .env(CHILD_HANDLE_ENV, hex(&h.to_wire()));
        }
        IpcForm::Fd => {
            let h = d.ipc_fd().expect("ipc_export_fd");
            // SAFETY: F_DUPFD returns a new descriptor without FD_CLOEXEC, so the child inherits
            // it; we own it and close it after spawning.
            let raw = unsafe { libc::fcntl(h.fd.as_raw_fd(), libc::F_DUPFD, 3) };
            assert!(raw >= 0, "dup: {}", std::io::Error::last_os_error());
            // SAFETY: `raw` is a fresh descriptor we own.
            inherited = Some(unsafe { OwnedFd::from_raw_fd(raw) });
            // The exporter's size (possibly rounded up to a granularity) travels with the fd.
            cmd.env(CHILD_ROLE_ENV, "fd")
                .env(CHILD_FD_ENV, raw.to_string())
                .env(CHILD_FD_SIZE_ENV, h.size.to_string());
        }
    }
    let out = cmd.output().expect("spawn child");
    drop(inherited);
    let log = format!(
        "child stdout:\n{}\nchild stderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed: {}\n{log}", out.status);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the child did not run its test\n{log}"
    );
    let mut back = vec![0u8; IPC_BYTES];
    d.read(0, &mut back, &s).expect("read back");
    assert_same("bytes written by the child", &back, &filled(IPC_BYTES, 2));
}

/// Child side of [`ipc_two_process`]; does nothing unless run by it.
pub fn ipc_child<A: DeviceAdaptor>(a: &A) {
    let Ok(role) = std::env::var(CHILD_ROLE_ENV) else {
        return;
    };
    let size: usize = std::env::var(CHILD_SIZE_ENV)
        .expect("size")
        .parse()
        .expect("size");
    let s = Stream::new(a).expect("stream");
    let mapping = match role.as_str() {
        "bytes" => {
            let wire = unhex(&std::env::var(CHILD_HANDLE_ENV).expect("handle"));
            let h = IpcMemHandle::from_wire(&wire).expect("decode handle");
            let first = IpcMapping::open(a, &h).expect("ipc_open_handle in the child");
            // A second open of the same handle (two communicators of one process reaching one
            // peer buffer) is a mapping of its own (CUDA returns the same pointer and counts
            // the opens): reading through it works, and closing it leaves the first usable.
            let second = IpcMapping::open(a, &h).expect("a second ipc_open_handle");
            parents_bytes_through(a, &second, size, &s, "a second open");
            drop(second);
            first
        }
        "fd" => {
            let raw: i32 = std::env::var(CHILD_FD_ENV)
                .expect("fd")
                .parse()
                .expect("fd");
            // SAFETY: the parent made this descriptor for us and passed its number.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            let mapped: usize = std::env::var(CHILD_FD_SIZE_ENV)
                .expect("fd size")
                .parse()
                .expect("fd size");
            assert!(mapped >= size, "the export is smaller than the buffer");
            let h = IpcFdHandle {
                vendor: a.vendor(),
                fd,
                size: mapped,
            };
            IpcMapping::import_fd(a, &h).expect("ipc_import_fd in the child")
        }
        other => panic!("unknown child role {other}"),
    };
    let local = parents_bytes_through(a, &mapping, size, &s, "the child's mapping");
    local.write(0, &filled(size, 2), &s).expect("write");
    // SAFETY: as above.
    unsafe {
        a.memcpy_d2d_async(mapping.ptr(), local.ptr(), size, s.handle())
            .expect("d2d into the parent's memory");
    }
    s.synchronize().expect("sync");
}

/// Copies the `size` bytes of the parent's buffer through `mapping` into a new buffer of the
/// child and checks they are the parent's (`how`: the mapping, for the message); the buffer.
fn parents_bytes_through<A: DeviceAdaptor>(
    a: &A,
    mapping: &IpcMapping<A>,
    size: usize,
    s: &Stream<A>,
    how: &str,
) -> DeviceBuffer<A> {
    let local = DeviceBuffer::new(a, size).expect("alloc");
    // SAFETY: the mapping and buffer stay alive until the read below synchronizes the stream.
    unsafe {
        a.memcpy_d2d_async(local.ptr(), mapping.ptr(), size, s.handle())
            .unwrap_or_else(|e| panic!("d2d through {how}: {e}"));
    }
    let mut got = vec![0u8; size];
    local.read(0, &mut got, s).expect("read");
    assert_same(
        &format!("parent's bytes through {how}"),
        &got,
        &filled(size, 1),
    );
    local
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

/// A memfd mapping mapped twice, to show that writes through one view land in shared memory.
struct SharedMapping {
    ptr: *mut u8,
    second: *mut u8,
    len: usize,
}

impl SharedMapping {
    fn new(len: usize) -> Self {
        // SAFETY: plain syscalls on a fresh descriptor; results are checked.
        unsafe {
            let fd = libc::memfd_create(c"flagcx-conformance".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
            let fd = OwnedFd::from_raw_fd(fd);
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
            let map = |_: ()| {
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                );
                assert_ne!(p, libc::MAP_FAILED, "mmap");
                p as *mut u8
            };
            SharedMapping {
                ptr: map(()),
                second: map(()),
                len,
            }
        }
    }

    fn second_view(&self) -> &[u8] {
        // SAFETY: a live mapping of `len` bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.second, self.len) }
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: both mappings were made by `new` with `len` bytes.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
            libc::munmap(self.second.cast(), self.len);
        }
    }
}

/// Instantiates the whole conformance suite for one adaptor, as a module `conformance` of
/// `#[test]`s. `$open` is an expression of type `Result<A, AdaptorError>` evaluated per test.
#[macro_export]
macro_rules! conformance_tests {
    ($open:expr) => {
        mod conformance {
            #[allow(unused_imports)]
            use super::*;
            use $crate::conformance as c;

            fn child_test_name() -> &'static str {
                let full = concat!(module_path!(), "::ipc_child");
                // libtest names tests without the crate name.
                full.split_once("::").map(|(_, rest)| rest).unwrap_or(full)
            }

            $crate::conformance_tests!(@cases $open;
                device_properties, memory_round_trip_odd_sizes, pinned_host_copies,
                zero_and_huge_sizes, fills_past_one_gibibyte, null_and_foreign_pointers, allocation_range,
                buffer_ids_tell_allocations_apart,
                invalid_handles, stream_ordering_many_ops, large_copies_keep_stream_order, events, host_functions, events_follow_earlier_work, stream_gates,
                host_addressable_memory, host_register_shared_mapping, host_pin_shared_mapping,
                stream_memory_ops, stream_value_writes_in_device_memory,
                sized_copies_read_their_length_late, slot_steps_move_messages, peer_access,
                capture_mode_guard, ipc_fd_same_process, ipc_fd_foreign, shareable_on_a_chosen_device,
                reductions_match_the_host_reference, reduction_operands_are_checked,
                reductions_past_2_pow_31_elements);

            #[test]
            fn ipc_bytes_two_process() {
                c::run_case("ipc_bytes_two_process", || $open, |a| {
                    c::ipc_two_process(a, c::IpcForm::Bytes, child_test_name())
                });
            }

            #[test]
            fn ipc_fd_two_process() {
                c::run_case("ipc_fd_two_process", || $open, |a| {
                    c::ipc_two_process(a, c::IpcForm::Fd, child_test_name())
                });
            }

            #[test]
            #[ignore = "the child half of the two-process IPC cases; they start it"]
            fn ipc_child() {
                c::run_case("ipc_child", || $open, c::ipc_child);
            }
        }
    };
    (@cases $open:expr; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                c::run_case(stringify!($case), || $open, c::$case);
            }
        )*
    };
}
