//! Registered host memory between processes (`host_register` + the byte-form IPC handle): the
//! importer's synthetic range reaches the exporter's private pages through device-to-device
//! copies only, and a copy the kernel refuses fails its stream instead of passing as done.

use std::process::Command;

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, IpcMemHandle, StreamHandle};
use flagcx_host::HostAdaptor;

const CHILD_ENV: &str = "FLAGCX_REGISTERED_TEST_HANDLE";
const LEN: usize = 3 * 4096 + 123;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Copies `n` bytes `dst ← src` on `s` and waits.
fn copy(a: &HostAdaptor, dst: DevicePtr, src: DevicePtr, n: usize, s: StreamHandle) {
    // SAFETY: both ranges are checked by the adaptor; the test keeps them alive until the
    // synchronize below.
    unsafe { a.memcpy_d2d_async(dst, src, n, s) }.expect("memcpy_d2d_async");
    a.stream_synchronize(s).expect("stream_synchronize");
}

#[test]
fn registered_memory_is_reached_through_its_handle_by_copies_only() {
    let a = HostAdaptor::open(0).expect("open");
    let s = a.stream_create().expect("stream");
    let mut user = pattern(LEN, 7);
    // SAFETY: `user` outlives its registration (unregistered below).
    let reg = unsafe { a.host_register(user.as_mut_ptr(), LEN) }.expect("host_register");
    let h = a
        .ipc_get_handle(reg)
        .expect("a registered range has a byte-form handle");
    assert!(a.ipc_export_fd(reg).is_err(), "no fd form: it is no memfd");
    let far = a.ipc_open_handle(&h).expect("ipc_open_handle");
    assert_ne!(far, reg, "a synthetic address, never the exporter's");
    assert_eq!(a.mem_get_range(far).expect("range"), (far, LEN));

    let dev = a.mem_alloc(LEN).expect("mem_alloc");
    copy(&a, dev, DevicePtr(far.0 + 5), LEN - 5, s);
    let mut got = vec![0u8; LEN - 5];
    // SAFETY: `got` holds LEN - 5 bytes; synchronized below.
    unsafe { a.memcpy_d2h_async(got.as_mut_ptr(), dev, LEN - 5, s) }.expect("d2h");
    a.stream_synchronize(s).expect("sync");
    assert_eq!(got[..], pattern(LEN, 7)[5..], "read through the handle");

    let fresh = pattern(LEN, 99);
    // SAFETY: `fresh` holds LEN bytes; synchronized below.
    unsafe { a.memcpy_h2d_async(dev, fresh.as_ptr(), LEN, s) }.expect("h2d");
    copy(&a, far, dev, LEN, s);
    assert_eq!(user, fresh, "written through the handle");

    // Anything but a device-to-device copy is refused on the synthetic range: the CPU
    // cannot touch it.
    // SAFETY: refused before anything runs.
    let refused = unsafe { a.memset_async(far, 0, 8, s) };
    assert!(
        format!("{refused:?}").contains("only device-to-device"),
        "{refused:?}"
    );
    // SAFETY: as above.
    let refused = unsafe { a.memcpy_h2d_async(far, fresh.as_ptr(), 8, s) };
    assert!(refused.is_err(), "{refused:?}");
    // SAFETY: as above.
    let refused = unsafe { a.stream_write_value64(s, far, 1) };
    assert!(refused.is_err(), "{refused:?}");
    // SAFETY: as above.
    let both = unsafe { a.memcpy_d2d_async(far, far, 8, s) };
    assert!(both.is_err(), "{both:?}");

    // SAFETY: no work uses the synthetic range any more.
    unsafe { a.ipc_close(far) }.expect("ipc_close");
    // SAFETY: as above.
    assert!(unsafe { a.ipc_close(far) }.is_err(), "closed twice");
    // SAFETY: synchronized; nothing uses the registration.
    unsafe { a.host_unregister(user.as_mut_ptr()) }.expect("host_unregister");
    // SAFETY: allocated above, unused.
    unsafe { a.mem_free(dev) }.expect("mem_free");
    a.stream_destroy(s).expect("stream_destroy");
}

#[test]
fn a_copy_the_kernel_refuses_fails_its_stream_and_later_events() {
    let a = HostAdaptor::open(0).expect("open");
    let s = a.stream_create().expect("stream");
    let len = 8192;
    let dev = a.mem_alloc(len).expect("mem_alloc");
    // SAFETY: a fresh anonymous mapping, unmapped below while the registration's handle lives.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED);
    // SAFETY: the mapping is live.
    let reg = unsafe { a.host_register(map.cast(), len) }.expect("host_register");
    let h = a.ipc_get_handle(reg).expect("handle");
    let far = a.ipc_open_handle(&h).expect("open");
    // The exporter's memory becomes unreadable under the handle: the kernel refuses the next
    // copy. (Unmapping it instead let another test thread's allocation take the address, which
    // the copy then read.)
    // SAFETY: our mapping; only the kernel's checked copy names it from here on.
    assert_eq!(unsafe { libc::mprotect(map, len, libc::PROT_NONE) }, 0);
    let ev = a.event_create(false).expect("event");
    // SAFETY: `dev` is ours; the remote side is checked by the kernel.
    unsafe { a.memcpy_d2d_async(dev, far, len, s) }.expect("enqueued");
    a.event_record(ev, s).expect("record");
    let e = a
        .stream_synchronize(s)
        .expect_err("the failed copy fails the stream");
    assert!(format!("{e:?}").contains("not mapped"), "{e:?}");
    let e = a
        .event_query(ev)
        .expect_err("the event behind it reports the failure");
    assert!(format!("{e:?}").contains("StreamFault"), "{e:?}");
    assert!(a.event_synchronize(ev).is_err());
    assert!(a.stream_query(s).is_err(), "sticky");
    // An event recorded on a healthy stream is unaffected.
    let other = a.stream_create().expect("stream");
    a.event_record(ev, other).expect("record");
    a.stream_synchronize(other).expect("another stream is fine");
    assert!(a.event_query(ev).expect("query"));
    // SAFETY: nothing uses these any more.
    unsafe {
        a.ipc_close(far).expect("close");
        a.host_unregister(map.cast()).expect("unregister");
        a.mem_free(dev).expect("free");
        libc::munmap(map, len);
    }
}

#[test]
fn another_process_reads_and_writes_registered_memory() {
    let a = HostAdaptor::open(0).expect("open");
    let mut user = pattern(LEN, 1);
    // SAFETY: `user` outlives the registration and the child (waited for below).
    let reg = unsafe { a.host_register(user.as_mut_ptr(), LEN) }.expect("host_register");
    let h = a.ipc_get_handle(reg).expect("handle");
    let out = Command::new(std::env::current_exe().expect("exe"))
        .args(["--exact", "registered_child", "--ignored", "--nocapture"])
        .env(CHILD_ENV, hex(&h.to_wire()))
        .output()
        .expect("spawn the child");
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child failed:\n{log}");
    assert!(log.contains("1 passed"), "the child ran nothing:\n{log}");
    assert_eq!(
        user,
        pattern(LEN, 2),
        "the child's bytes, in this process's private pages"
    );
    // SAFETY: the child is gone.
    unsafe { a.host_unregister(user.as_mut_ptr()) }.expect("unregister");
}

/// The child of `another_process_reads_and_writes_registered_memory`.
#[test]
#[ignore = "run by another_process_reads_and_writes_registered_memory"]
fn registered_child() {
    let Ok(wire) = std::env::var(CHILD_ENV) else {
        return;
    };
    let h = IpcMemHandle::from_wire(&unhex(&wire)).expect("handle");
    let a = HostAdaptor::open(0).expect("open");
    let s = a.stream_create().expect("stream");
    let far = a
        .ipc_open_handle(&h)
        .expect("open the parent's registered memory");
    let dev = a.mem_alloc(LEN).expect("alloc");
    copy(&a, dev, far, LEN, s);
    let mut got = vec![0u8; LEN];
    // SAFETY: `got` holds LEN bytes; synchronized below.
    unsafe { a.memcpy_d2h_async(got.as_mut_ptr(), dev, LEN, s) }.expect("d2h");
    a.stream_synchronize(s).expect("sync");
    assert_eq!(got, pattern(LEN, 1), "the parent's bytes");
    let mine = pattern(LEN, 2);
    // SAFETY: `mine` holds LEN bytes; synchronized by `copy`.
    unsafe { a.memcpy_h2d_async(dev, mine.as_ptr(), LEN, s) }.expect("h2d");
    copy(&a, far, dev, LEN, s);
    // SAFETY: synchronized above.
    unsafe { a.ipc_close(far) }.expect("close");
}
