//! The page callers' streams wait on (the low 32 bits of the completion watermark) and each
//! stream's last join: the data of stream joins, held by `Comm`; making and resolving joins is
//! [`crate::join`]'s.

use std::time::Instant;

use flagcx_adaptor::{DeviceAdaptor, DevicePtr, EventHandle, GateHandle};

use crate::error::{CommError, Result};

/// A page the callers' streams can wait on: the low 32 bits of the completion watermark.
pub(crate) struct WatermarkPage {
    pub(crate) host: *mut u8,
    pub(crate) device: Option<DevicePtr>,
}

// SAFETY: the page is private to its communicator: mapped in `WatermarkPage::new`, unmapped
// once in `release` from `Comm::drop`; the communicator's threads only touch its watermark
// word, atomically (see `WatermarkWord`).
unsafe impl Send for WatermarkPage {}

// SAFETY: as above.
unsafe impl Sync for WatermarkPage {}

/// `len` bytes of fresh private anonymous memory (zeroed, page aligned); `what` names the
/// mapping in the error. Freed with `munmap`.
pub(crate) fn anon_pages(len: usize, what: &'static str) -> Result<*mut u8> {
    // SAFETY: a fresh private anonymous mapping; checked.
    let host = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if host == libc::MAP_FAILED {
        return Err(CommError::io(what, std::io::Error::last_os_error()));
    }
    Ok(host.cast())
}

/// Largest message whose post waits for its stream's gate to go eagerly
/// ([`crate::Config::rejoin_wait`]). Measured on one H200, CUDA<->OpenCL `sendrecv` enqueued
/// back to back, three alternating rounds each: at 8 B–512 B the wait took the worst round from
/// 244–303 µs to 91–100 µs; at 4 KiB, where an eager round trip (copies on both ranks) is
/// slower than the proxy, it made every round slower (405–463 µs against 228–279).
pub(crate) const REJOIN_MAX: usize = 1 << 10;

/// A stream's last join by this communicator.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Joined {
    /// Recorded right after the join: teardown waits for it.
    pub(crate) ev: EventHandle,
    /// The operation the join waits for (and every one before it).
    pub(crate) seq: u64,
    /// The join's gate, where it is one (`StreamJoin::Gate`) and was not open when made.
    pub(crate) gate: Option<GateHandle>,
    /// How many later joins that gate was made to wait for (0: it waits for its first).
    pub(crate) held: u32,
    /// Whether nothing was enqueued on the stream between the posting of the operations it
    /// joins and the join itself (no work beside them, `Comm::submit_then`): then whatever the
    /// stream holds in front of the join is done once the operation is, since the operation
    /// started after it. Only such a gate lets a later post start behind it without a start
    /// event (`Comm::behind_own_gate`).
    pub(crate) clean: bool,
    /// From when a post may wait for this join's operation to go eagerly
    /// (`Comm::idle_or_soon`): a join made while the one before had not passed inherits it,
    /// and a post that waits moves it [`REJOIN_PAUSE_FACTOR`] waits ahead, so that behind a
    /// peer that does not answer posts spend at most about a tenth of their time waiting.
    pub(crate) rejoin_at: Instant,
}

/// How many rejoin waits ([`crate::Config::rejoin_wait`]) a chain of joins lets pass after one
/// before a post waits again (see [`Joined::rejoin_at`]).
pub(crate) const REJOIN_PAUSE_FACTOR: u32 = 10;

impl WatermarkPage {
    pub(crate) fn new<A: DeviceAdaptor>(adaptor: &A) -> Result<Self> {
        let host = anon_pages(4096, "mmap watermark page")?;
        let device =
            if adaptor.capabilities().host_register && adaptor.capabilities().stream_mem_ops {
                // SAFETY: the page stays mapped until `release`, which unregisters it first.
                match unsafe { adaptor.host_register(host, 4096) } {
                    Ok(d) => Some(d),
                    Err(e) => {
                        // SAFETY: our page, not yet shared with anyone.
                        unsafe { libc::munmap(host.cast(), 4096) };
                        return Err(e.into());
                    }
                }
            } else {
                None
            };
        Ok(WatermarkPage { host, device })
    }

    pub(crate) fn release<A: DeviceAdaptor>(&mut self, adaptor: &A) {
        if self.device.take().is_some() {
            // SAFETY: every joined stream passed its last wait; nothing reads the page any more.
            let _ = unsafe { adaptor.host_unregister(self.host) };
        }
        // SAFETY: our mapping of one page.
        unsafe { libc::munmap(self.host.cast(), 4096) };
    }
}
