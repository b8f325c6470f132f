//! The ceiling each row is measured against: the vendor's bare copy of the row's size in the
//! same traffic pattern, and the slowest rank's, since a pair runs at its slower side.

use std::time::Instant;

use flagcx::{
    Adaptor, Comm, DeviceAdaptor, DeviceBuffer, DevicePtr, IpcMapping, IpcMemHandle, PinnedBuffer,
    Stream, TransportKind,
};

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

/// Whether ranks `a` and `b` use two physical devices.
fn two_devices(comm: &Comm<Adaptor>, a: usize, b: usize) -> bool {
    matches!((comm.peer_info(a), comm.peer_info(b)), (Some(x), Some(y)) if !x.shares_device(y))
}

/// The header's line where this process's streams share one work queue: that every pair
/// copies late (nothing waits), or that posts of the other pairs' operations wait for them
/// (`Comm::posts_wait`), which the times below include.
pub(crate) fn queue_note(comm: &Comm<Adaptor>) -> Option<&'static str> {
    match (comm.streams_share_queue(), comm.posts_wait()) {
        (false, _) => None,
        (true, false) => Some(
            "# note: this process's streams share one work queue (CUDA: \
             CUDA_DEVICE_MAX_CONNECTIONS=1); every pair copies late, which no stream of this \
             process waits behind (README, \"Environment\")",
        ),
        (true, true) => Some(
            "# note: this process's streams share one work queue (CUDA: \
             CUDA_DEVICE_MAX_CONNECTIONS=1); posts of operations the proxy copies return once \
             those finished, pairs that copy late enqueue and return (README, \"Environment\")",
        ),
    }
}

/// Where an IPC pair's two ranks are, as the header and the JSON rows name it.
pub(crate) fn placement(comm: &Comm<Adaptor>, me: usize, next: usize) -> &'static str {
    let shared_at_once = || {
        let (a, b) = (comm.peer_info(me), comm.peer_info(next));
        a.zip(b).is_some_and(|(a, b)| !a.time_slices_with(b))
    };
    if two_devices(comm, me, next) {
        "two devices"
    } else if shared_at_once() {
        "one device, shared at once (MPS)"
    } else {
        "one device"
    }
}

/// The next rank's buffer of `len` bytes, mapped here through IPC, where this rank and the
/// next are an IPC pair on two devices: the ceiling of such a pair is a copy from this
/// device into that one (a peer copy), not a copy within one device.
pub(crate) struct PeerTarget {
    /// The next rank's buffer, mapped (closed first: see [`PeerTarget::unmap`]).
    map: Option<IpcMapping<Adaptor>>,
    /// This rank's, which the previous rank may have mapped.
    mine: Option<DeviceBuffer<Adaptor>>,
}

impl PeerTarget {
    /// Every rank calls it, whatever its pairs (the handles are all-gathered): a rank exports
    /// a buffer where the previous rank will map it, and maps the next rank's, where the two
    /// are an IPC pair on two devices (both sides see the same facts, so they agree).
    pub(crate) fn new(
        comm: &Comm<Adaptor>,
        stream: &Stream<Adaptor>,
        a: &Adaptor,
        len: usize,
        next: usize,
    ) -> Result<PeerTarget, Error> {
        let me = comm.rank();
        let n = comm.nranks();
        let prev = (me + n - 1) % n;
        let peer_pair =
            |q: usize| comm.transport(q) == Some(TransportKind::Ipc) && two_devices(comm, me, q);
        // Only where some rank of the ring has such a pair do the ranks exchange handles (all
        // of them see the same placements): the exchange's small buffers are otherwise
        // allocated, exported and freed for nothing — and on an H200 a later IPC open of a
        // benchmark buffer then failed with CUDA_ERROR_ALREADY_MAPPED.
        if !(0..n).any(|r| two_devices(comm, r, (r + 1) % n)) {
            return Ok(PeerTarget {
                map: None,
                mine: None,
            });
        }
        let mine = match peer_pair(prev) {
            true => Some(DeviceBuffer::new(a, len.max(1))?),
            false => None,
        };
        let wire = match &mine {
            Some(b) => a.ipc_get_handle(b.ptr())?.to_wire(),
            None => [0u8; IpcMemHandle::WIRE_LEN],
        };
        let all = crate::all_gather_bytes(comm, stream, &wire)?;
        let mut t = PeerTarget { map: None, mine };
        if peer_pair(next) {
            let at = next * IpcMemHandle::WIRE_LEN;
            let h = IpcMemHandle::from_wire(&all[at..at + IpcMemHandle::WIRE_LEN])?;
            t.map = Some(IpcMapping::open(a, &h)?);
        }
        Ok(t)
    }

    /// The next rank's buffer, where this pair is measured against a peer copy.
    pub(crate) fn target(&self) -> Option<&Self> {
        self.map.as_ref().map(|_| self)
    }

    fn ptr(&self) -> DevicePtr {
        self.map.as_ref().map_or(DevicePtr(0), IpcMapping::ptr)
    }

    /// Closes the mapping of the next rank's buffer and returns this rank's: free it only after
    /// every rank has closed its mapping (a barrier), since the previous rank maps it.
    pub(crate) fn unmap(self) -> Option<DeviceBuffer<Adaptor>> {
        drop(self.map);
        self.mine
    }
}

/// The vendor's bare copy for `size` bytes, in seconds: device to device for IPC pairs (into
/// the next rank's buffer on its device where `peer` is given: a peer copy); for
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
    peer: Option<&PeerTarget>,
) -> Result<f64, Error> {
    let iters = o.iters.max(5);
    let other = Stream::new(a)?;
    let time = |f: &dyn Fn() -> flagcx::Result<()>| {
        timed(iters as usize, f, &|| {
            stream.synchronize()?;
            other.synchronize()
        })
    };
    let (s1, s2) = (stream.handle(), other.handle());
    let src = DeviceBuffer::new(a, size)?;
    let dst = DeviceBuffer::new(a, size)?;
    // Every copy reads written memory, as a transfer does: a buffer never written can read
    // as the kernel's one zero page (PoCL's fresh buffers and host pages do), which no cache
    // miss slows — on the 2-core machine a 128 MiB PoCL copy out of a never-written buffer
    // ran at 11.0–15.7 GB/s against 9.4–10.7 out of a written one.
    src.fill(0x5A, stream)?;
    let secs = match kind {
        TransportKind::Ipc => {
            let to = peer.map_or(dst.ptr(), |t| t.ptr());
            // SAFETY: both buffers hold `size` bytes (the peer's holds the sweep's largest) and
            // outlive the synchronize in `time`.
            let d2d = || unsafe { a.memcpy_d2d_async(to, src.ptr(), size, s1) };
            time(&d2d)?
        }
        // A pair on two hosts: the network bounds it, measured next to `ucx_perftest` in the
        // same run by `cargo xtask bench --net`; the column here is what the message costs in
        // host memory at least (out of the device and into it), as for a staged pair.
        TransportKind::Staged | TransportKind::Net => {
            let mut hosts = [PinnedBuffer::new(a, size)?, PinnedBuffer::new(a, size)?];
            // What the host→device copy reads is written memory too (see `src` above).
            hosts[1].as_mut_slice().fill(0xA5);
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

/// A reduction row's other bound, in seconds: this rank's own reduction steps of what a ring
/// combines on each rank — `(n − 1) / n` of the row's `size` bytes, as one combining step
/// (`dst = a ∘ b`, reading two buffers and writing a third) on `stream`. Where it exceeds
/// the pair's transfers, the rank's device bounds the all-reduce, not the transport.
pub(crate) fn reduce_time(
    a: &Adaptor,
    stream: &Stream<Adaptor>,
    size: usize,
    n: usize,
    red: crate::collective::Red,
    iters: usize,
) -> Result<f64, Error> {
    let count = size / n * (n - 1) / red.dtype.size();
    let bytes = (count * red.dtype.size()).max(1);
    let bufs = [
        DeviceBuffer::new(a, bytes)?,
        DeviceBuffer::new(a, bytes)?,
        DeviceBuffer::new(a, bytes)?,
    ];
    // Written memory, as in `ceiling` (a never-written buffer can read as the zero page).
    for (i, b) in bufs.iter().enumerate() {
        b.fill(0x31 + i as u8, stream)?;
    }
    let step = flagcx::ReduceStep::combining(red.op);
    // SAFETY: the three buffers hold `count` elements each and outlive the synchronize below.
    let one = || unsafe {
        a.reduce_async(
            bufs[2].ptr(),
            bufs[0].ptr(),
            bufs[1].ptr(),
            count,
            red.dtype,
            step,
            stream.handle(),
        )
    };
    timed(iters.max(3), &one, &|| stream.synchronize())
}

/// Seconds per call of `f`, over `iters` calls after one untimed, each batch closed by `sync`.
fn timed(
    iters: usize,
    f: &dyn Fn() -> flagcx::Result<()>,
    sync: &dyn Fn() -> flagcx::Result<()>,
) -> Result<f64, Error> {
    f()?;
    sync()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    sync()?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}
