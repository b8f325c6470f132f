//! Where every thread of a rank is, printed once the rank has run for a while: for hangs seen
//! only on hosts without a debugger (the GPU hosts). `FLAGCX_TEST_STACKS=<ms>` arms it in a
//! rank of a multi-process test; after `<ms>` a watchdog thread asks each other thread of the
//! process, one at a time, for its backtrace (a signal whose handler captures the interrupted
//! thread's frames) and prints them to stderr with the thread's id and name, then does nothing
//! more. A rank that finished earlier prints nothing.
//!
//! Capturing a backtrace in a signal handler allocates, which is not async-signal-safe: a
//! thread interrupted inside the allocator could stop for good. It is a diagnostic for a rank
//! that is stuck already, never armed by default.

use std::backtrace::Backtrace;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The signal the watchdog sends; tests use no other handler for it.
const SIGNAL: libc::c_int = libc::SIGUSR2;

/// The frames the handler captured, for the watchdog to print.
static CAPTURED: Mutex<Option<Backtrace>> = Mutex::new(None);
/// Set by the handler once it stored its frames (or gave up).
static DONE: AtomicBool = AtomicBool::new(false);

extern "C" fn capture(_: libc::c_int) {
    let bt = Backtrace::force_capture();
    // `try_lock`: the watchdog holds the lock only while it takes the value out, between
    // signals, so this never waits; if it somehow fails the frames are dropped.
    if let Ok(mut slot) = CAPTURED.try_lock() {
        *slot = Some(bt);
    }
    DONE.store(true, Ordering::Release);
}

/// Arms the watchdog where `FLAGCX_TEST_STACKS` holds a delay in milliseconds.
pub fn arm_from_env() {
    let Some(ms) = std::env::var("FLAGCX_TEST_STACKS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    else {
        return;
    };
    // SAFETY: a zeroed sigaction with a plain handler (no SA_SIGINFO) and an empty mask is a
    // valid argument; `capture` has the handler's signature.
    let installed = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = capture as extern "C" fn(libc::c_int) as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(SIGNAL, &sa, std::ptr::null_mut()) == 0
    };
    if !installed {
        eprintln!("FLAGCX_TEST_STACKS: cannot install the handler; no stacks");
        return;
    }
    let _ = std::thread::Builder::new()
        .name("test-stacks".into())
        .spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            dump();
        });
}

/// Prints every other thread's backtrace.
fn dump() {
    // SAFETY: plain system calls without pointers.
    let (pid, me) = unsafe {
        (
            libc::getpid(),
            libc::syscall(libc::SYS_gettid) as libc::pid_t,
        )
    };
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    let mut out = format!("==== stacks of pid {pid} after FLAGCX_TEST_STACKS\n");
    for tid in tasks
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<libc::pid_t>().ok())
        .filter(|&t| t != me)
    {
        let name =
            std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap_or_default();
        DONE.store(false, Ordering::Release);
        // SAFETY: signals thread `tid` of this process, whose handler is installed.
        if unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, SIGNAL) } != 0 {
            continue;
        }
        let t0 = Instant::now();
        while !DONE.load(Ordering::Acquire) && t0.elapsed() < Duration::from_millis(500) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let bt = CAPTURED.lock().map(|mut s| s.take()).unwrap_or(None);
        match bt {
            Some(bt) => out += &format!("== thread {tid} ({})\n{bt}\n", name.trim()),
            None => out += &format!("== thread {tid} ({}): no answer\n", name.trim()),
        }
    }
    eprintln!("{out}==== end of stacks");
}
