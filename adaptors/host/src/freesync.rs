//! `FLAGCX_HOST_FREE_SYNC=1`: frees that behave as CUDA's, so that CPU-only runs catch code
//! that frees memory while a stream waits for a communicator.
//!
//! On CUDA every driver call takes one process-wide reader-writer lock, and a
//! device-synchronizing call (`cuMemFree`, `cuMemFreeHost`, `cuMemHostUnregister`,
//! `cuIpcCloseMemHandle`) keeps it as a writer while it waits for every stream of the device
//! (docs/reliability.md, "CUDA's process-wide lock and a held stream"). A free while a stream
//! waits on a word that a progress thread writes once its copy is done therefore stops both:
//! the progress thread's next call waits for the lock. The host vendor normally frees at once;
//! with this variable set, every call that enqueues work or looks up a stream or event takes
//! the lock as a reader, and a free takes it as a writer and waits until every stream of the
//! device is idle (of every adaptor of the process open on it, as a CUDA process has one
//! context per device). Host writes of a stream word take no lock, as CUDA's are plain stores.
//!
//! Where CUDA would wait for good, the free gives up after [`FREE_WAIT_MAX`] with a warning on
//! stderr and frees anyway, so a test run ends: the communicator's stall guard
//! (`FLAGCX_TIMEOUT_MS`) has reported the stall by then.

use std::sync::{Arc, Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};
use std::time::{Duration, Instant};

/// Environment variable: `1` makes frees wait for every stream under a process-wide lock.
pub const FREE_SYNC_ENV: &str = "FLAGCX_HOST_FREE_SYNC";

/// How long an emulated free waits for the streams at most.
pub const FREE_WAIT_MAX: Duration = Duration::from_secs(60);

/// Part of the warning an emulated free prints on stderr when it waited out
/// [`FREE_WAIT_MAX`]: a free CUDA would never return from (tests look for it in ranks' logs).
pub const FREE_WAITED_OUT: &str = "CUDA would wait for good";

static LOCK: RwLock<()> = RwLock::new(());

/// Every adaptor opened in this process while the emulation is on (their shared state), so a
/// free can wait for the streams of all of them on its device.
static OPENED: Mutex<Vec<Weak<crate::Inner>>> = Mutex::new(Vec::new());

/// Records a newly opened adaptor (nothing while the emulation is off).
pub(crate) fn open(inner: &Arc<crate::Inner>) {
    if on() {
        let mut all = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(inner));
    }
}

/// The adaptors of this process open on `device` now.
pub(crate) fn opened(device: usize) -> Vec<Arc<crate::Inner>> {
    let all = OPENED.lock().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .filter_map(Weak::upgrade)
        .filter(|i| i.device == device)
        .collect()
}

fn on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var(FREE_SYNC_ENV).is_ok_and(|v| v.trim() == "1"))
}

/// Held for the start of a call that a free would hold up (none while the emulation is off).
pub(crate) fn call() -> Option<RwLockReadGuard<'static, ()>> {
    on().then(|| LOCK.read().unwrap_or_else(|e| e.into_inner()))
}

/// Held by a free (none while the emulation is off): the lock as a writer, taken once every
/// earlier holder let go, then `idle` polled until it says every stream is idle or
/// [`FREE_WAIT_MAX`] passed. `op` names the free in the warning.
pub(crate) fn free(op: &str, idle: impl Fn() -> bool) -> Option<RwLockWriteGuard<'static, ()>> {
    if !on() {
        return None;
    }
    let guard = LOCK.write().unwrap_or_else(|e| e.into_inner());
    let t0 = Instant::now();
    while !idle() {
        if t0.elapsed() >= FREE_WAIT_MAX {
            eprintln!(
                "flagcx-host: {op} waited {} s for a stream that does not finish \
                 ({FREE_SYNC_ENV}=1; {FREE_WAITED_OUT}) and frees anyway",
                FREE_WAIT_MAX.as_secs()
            );
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Some(guard)
}
