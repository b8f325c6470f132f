//! The GPU core's events: [`marks`](super::marks) where the runtime has 64-bit stream writes and
//! host registration (`FLAGCX_GPU_EVENTS=auto`, the default), the runtime's own events for
//! timing and where it has not (or with `FLAGCX_GPU_EVENTS=driver`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::marks::{Marks, Pending, Slab, MARK_TAG, SLAB_WORDS};
use super::{Driver, DriverInfo, GpuAdaptor};
use crate::tracking::lock;
use crate::{AdaptorError, Result, WaitCondition};

/// The variable choosing how the GPU core makes events without timing.
pub(crate) const EVENTS_ENV: &str = "FLAGCX_GPU_EVENTS";

/// How often a wait for a mark (and, across the table, a query of a pending one) asks the
/// runtime whether the recording stream failed.
const FAULT_CHECK: Duration = Duration::from_millis(100);

/// The mark table this device gets, if any: `auto` (or unset) takes marks where the runtime
/// has 64-bit stream writes and host registration; `driver` never.
pub(super) fn marks_for(info: &DriverInfo, var: Option<&str>) -> Result<Option<Mutex<Marks>>> {
    let want = match var.map(str::trim) {
        None | Some("" | "auto") => true,
        Some("driver") => false,
        Some(other) => {
            return Err(AdaptorError::invalid(
                EVENTS_ENV,
                format!("{other:?} is not one of auto, driver"),
            ))
        }
    };
    let able = info.caps.stream_mem_ops_64 && info.caps.host_register;
    Ok((want && able).then(Mutex::default))
}

/// Whether event handle `e` names a mark (the runtime's handles never carry the tag).
pub(super) fn is_mark(e: u64) -> bool {
    e & MARK_TAG == MARK_TAG
}

const SLAB_BYTES: usize = SLAB_WORDS * 8;

fn slab_layout() -> std::alloc::Layout {
    // 4096-byte alignment: registration works on whole pages.
    std::alloc::Layout::from_size_align(SLAB_BYTES, 4096).expect("a valid constant layout")
}

impl<D: Driver> GpuAdaptor<D> {
    fn marks(&self) -> &Mutex<Marks> {
        self.inner
            .marks
            .as_ref()
            .expect("a mark handle exists only where the table does")
    }

    /// A new slab: zeroed, page-aligned host memory registered with the runtime.
    fn grow(&self) -> Result<Slab> {
        let layout = slab_layout();
        // SAFETY: a non-zero size.
        let host = unsafe { std::alloc::alloc_zeroed(layout) };
        if host.is_null() {
            return Err(AdaptorError::invalid(
                "event_create",
                "no host memory for event words",
            ));
        }
        // SAFETY: `host` is a live allocation of SLAB_BYTES, freed only after unregistering
        // (`release_slabs`) or right below on failure.
        match unsafe { self.bound().and_then(|d| d.host_register(host, SLAB_BYTES)) } {
            Ok(device) => Ok(Slab {
                host: host.cast(),
                device,
            }),
            Err(e) => {
                // SAFETY: allocated above with this layout, never registered.
                unsafe { std::alloc::dealloc(host, layout) };
                Err(e)
            }
        }
    }

    /// The mark table, locked, with a free word: where none is, a slab is registered first
    /// with the lock released (`cuMemHostRegister` waits while another thread copies into
    /// pageable memory, and queries must not wait behind it).
    fn with_free_word(&self) -> Result<std::sync::MutexGuard<'_, Marks>> {
        let mut m = lock(self.marks());
        if m.full() {
            drop(m);
            let slab = self.grow()?;
            m = lock(self.marks());
            m.add_slab(slab);
        }
        Ok(m)
    }

    /// Registers the first slab (at open, on the opening thread), so that later events
    /// rarely register memory; a failure is left for the first event to meet.
    pub(super) fn prepare_marks(&self) {
        if self.inner.marks.is_some() {
            // The guard goes at once; an error is left for the first event to meet again.
            drop(self.with_free_word());
        }
    }

    /// A mark without a recording.
    pub(super) fn mark_create(&self) -> Result<u64> {
        self.with_free_word()?.create()
    }

    /// Records mark `e` on stream `s` (both live): one 64-bit stream write, enqueued with
    /// the table unlocked (see [`Marks::begin_record`]).
    pub(super) fn mark_record(&self, e: u64, s: u64) -> Result<()> {
        let d = self.bound()?;
        let p = self.with_free_word()?.begin_record(e, s)?;
        // SAFETY: `p.device` is a word of a registered slab, which stays registered until
        // teardown; `s` is live.
        let r = unsafe { d.write_value(s, p.device, p.gen, true) };
        lock(self.marks()).finish_record(e, p, r.is_ok());
        r
    }

    /// Forgets mark `e` (its word is reused once its last write landed).
    pub(super) fn mark_destroy(&self, e: u64) {
        lock(self.marks()).destroy(e);
    }

    /// Whether mark `e`'s last recording completed: a load, and no runtime call but, at most
    /// every [`FAULT_CHECK`] while marks are pending, a query of the recording stream, whose
    /// failure (a faulted context, which never writes the word) is returned.
    pub(super) fn mark_query(&self, e: u64) -> Result<bool> {
        let (pending, due) = {
            let mut m = lock(self.marks());
            let p = m.pending(e);
            let due = p.is_some() && m.fault_check_due(FAULT_CHECK);
            (p, due)
        };
        if let (Some(p), true) = (pending, due) {
            self.check_stream(p)?;
        }
        Ok(pending.is_none())
    }

    /// Makes live stream `s` wait for mark `e`'s last recording (nothing if it completed).
    pub(super) fn mark_wait_on(&self, s: u64, e: u64) -> Result<()> {
        let Some(p) = lock(self.marks()).pending(e) else {
            return Ok(());
        };
        // SAFETY: the word is registered until teardown; `s` is live.
        unsafe {
            self.bound()?
                .wait_value(s, p.device, p.gen, true, WaitCondition::Geq)
        }
    }

    /// Waits on the host for mark `e`'s last recording: spinning briefly, then sleeping in
    /// growing naps (up to 1 ms); every [`FAULT_CHECK`] it asks the runtime whether the
    /// recording stream failed (a faulted context never writes the word).
    pub(super) fn mark_synchronize(&self, e: u64) -> Result<()> {
        let Some(p) = lock(self.marks()).pending(e) else {
            return Ok(());
        };
        let t0 = Instant::now();
        let mut checked = t0;
        let mut nap = Duration::from_micros(2);
        loop {
            if lock(self.marks()).landed(e, p) {
                return Ok(());
            }
            if checked.elapsed() >= FAULT_CHECK {
                checked = Instant::now();
                self.check_stream(p)?;
            }
            if t0.elapsed() < Duration::from_micros(50) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
    }

    /// The context's failure, while the recording stream is still ours: asked of the core's
    /// fault probe, a stream nothing is enqueued on (a faulted context fails every query with
    /// its sticky error), not of the recording stream, whose query can wait inside the driver
    /// while another thread enqueues on it with its queue full — two CUDA ranks on one GPU
    /// with `FLAGCX_P2P_LATE_COPY=off`: the posting thread enqueued an all-reduce's steps
    /// waiting for room, the progress thread that would have let the device through sat in
    /// this query, and a 128 MiB all-reduce stopped in one run of two (H100, 2026-12-07).
    fn check_stream(&self, p: Pending) -> Result<()> {
        let live = self.inner.streams.check(p.stream).is_ok()
            || self.inner.adopted.check(p.stream).is_ok();
        if live {
            let s = self.inner.fault_probe.unwrap_or(p.stream);
            // SAFETY: a live stream (checked just now), or the core's own, live until drop.
            unsafe { self.bound()?.stream_query(s)? };
        }
        Ok(())
    }

    /// Releases the slabs at teardown (after the streams that write them are gone).
    pub(super) fn release_slabs(marks: &Mutex<Marks>, d: &D) {
        for slab in lock(marks).drain_slabs() {
            // SAFETY: registered by `grow`; the streams are destroyed, so once unregistering
            // (which waits for the device's outstanding work) returns nothing writes the slab.
            unsafe {
                if d.host_unregister(slab.host.cast()).is_ok() {
                    std::alloc::dealloc(slab.host.cast(), slab_layout());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Capabilities;

    fn info(ops64: bool, reg: bool) -> DriverInfo {
        DriverInfo {
            caps: Capabilities {
                stream_mem_ops_64: ops64,
                host_register: reg,
                ..Capabilities::default()
            },
            count: 1,
            granularity: 0,
        }
    }

    #[test]
    fn marks_only_where_the_runtime_writes_64_bit_words_and_registers_host_memory() {
        assert!(marks_for(&info(true, true), None).unwrap().is_some());
        assert!(marks_for(&info(true, true), Some("auto"))
            .unwrap()
            .is_some());
        assert!(marks_for(&info(true, true), Some("driver"))
            .unwrap()
            .is_none());
        assert!(marks_for(&info(false, true), None).unwrap().is_none());
        assert!(marks_for(&info(true, false), None).unwrap().is_none());
        let e = marks_for(&info(true, true), Some("mark")).err().unwrap();
        assert!(e.to_string().contains(EVENTS_ENV), "{e}");
    }

    #[test]
    fn runtime_handles_are_never_marks() {
        assert!(!is_mark(0x7f3a_1234_5600));
        assert!(is_mark(MARK_TAG | 1));
    }
}
