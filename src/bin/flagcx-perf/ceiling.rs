//! The ceiling each row is measured against: the vendor's bare copy of the row's size in the
//! same traffic pattern, and the slowest rank's, since a pair runs at its slower side.

use std::time::Instant;

use flagcx::{Adaptor, Comm, DeviceAdaptor, DeviceBuffer, PinnedBuffer, Stream, TransportKind};

use crate::{Error, Opts};

/// The largest of every rank's `secs`.
pub(crate) fn slowest(
    comm: &Comm<Adaptor>,
    stream: &Stream<Adaptor>,
    secs: f64,
) -> Result<f64, Error> {
    let all = crate::all_gather_bytes(comm, stream, &secs.to_le_bytes())?;
    Ok(all
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
        .fold(0.0, f64::max))
}

/// The vendor's bare copy for `size` bytes, in seconds: device to device for IPC pairs; for
/// staged ones device→host and host→device with pinned host memory (pinned with
/// [`DeviceAdaptor::host_pin`] where the vendor pins ranges rather than allocating pinned
/// memory, as the staging ring is) — both directions at once for sendrecv and pairs (the
/// traffic pattern, and what a rank that copies both ways has to do), the slower one alone
/// for pingpong. Pairs on two hosts get the staged ceiling (see below).
pub(crate) fn ceiling(
    a: &Adaptor,
    stream: &Stream<Adaptor>,
    kind: TransportKind,
    size: usize,
    o: &Opts,
) -> Result<f64, Error> {
    let iters = o.iters.max(5);
    let other = Stream::new(a)?;
    let time = |f: &dyn Fn() -> flagcx::Result<()>| -> Result<f64, Error> {
        let sync = || -> flagcx::Result<()> {
            stream.synchronize()?;
            other.synchronize()
        };
        f()?;
        sync()?;
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        sync()?;
        Ok(t.elapsed().as_secs_f64() / iters as f64)
    };
    let (s1, s2) = (stream.handle(), other.handle());
    let src = DeviceBuffer::new(a, size)?;
    let dst = DeviceBuffer::new(a, size)?;
    let secs = match kind {
        TransportKind::Ipc => {
            // SAFETY: both buffers hold `size` bytes and outlive the synchronize in `time`.
            let d2d = || unsafe { a.memcpy_d2d_async(dst.ptr(), src.ptr(), size, s1) };
            time(&d2d)?
        }
        // A pair on two hosts: the network bounds it, measured next to `ucx_perftest` in the
        // same run by `cargo xtask bench --net`; the column here is what the message costs in
        // host memory at least (out of the device and into it), as for a staged pair.
        TransportKind::Staged | TransportKind::Net => {
            let hosts = [PinnedBuffer::new(a, size)?, PinnedBuffer::new(a, size)?];
            let (out, inn) = (hosts[0].as_ptr(), hosts[1].as_ptr());
            let caps = a.capabilities();
            let pin = caps.host_pin && !caps.host_register;
            if pin {
                // SAFETY: the buffers stay allocated until after the unpins below.
                unsafe {
                    a.host_pin(out, size)?;
                    a.host_pin(inn, size)?;
                }
            }
            // SAFETY: every buffer holds `size` bytes and outlives the synchronize in `time`.
            let d2h = || unsafe { a.memcpy_d2h_async(out, src.ptr(), size, s1) };
            // SAFETY: as above.
            let h2d = || unsafe { a.memcpy_h2d_async(dst.ptr(), inn, size, s2) };
            let secs = if o.test == "pingpong" {
                time(&d2h)?.max(time(&h2d)?)
            } else {
                time(&|| d2h().and_then(|()| h2d()))?
            };
            if pin {
                // SAFETY: every copy was synchronized in `time`.
                unsafe {
                    a.host_unpin(out)?;
                    a.host_unpin(inn)?;
                }
            }
            secs
        }
    };
    Ok(secs)
}
