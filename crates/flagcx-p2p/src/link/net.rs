//! The network transport's state (`NetState`: the UCX worker and endpoints, shared by the engine
//! and the posting threads) and a message's phases; posting and progress are
//! [`crate::transport::net`]'s.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flagcx_adaptor::{DeviceAdaptor, EventHandle, Vendor};

use super::{Phase, Step};
use crate::bootstrap::Bootstrap;
use crate::error::{CommError, Result};
use crate::op::{Dir, Resume};
use crate::peer::TransportKind;
use crate::ucx::{
    Endpoint, NetReq, Status, Ucx, Worker, ERR_TRUNCATED, MEMORY_TYPE_CUDA, MEMORY_TYPE_HOST,
    MEMORY_TYPE_ROCM,
};
use crate::wire::Tag;

/// Where a net step stands.
pub(crate) enum NetPhase {
    /// Waiting for the caller's stream to pass the posting point.
    Start,
    /// Receiver: waiting for the message to arrive (or be announced), to learn its size.
    Probe,
    /// Receiver: the message is larger than the buffer; UCX drains it into `scratch` (it
    /// cannot be left in UCX), then the receive fails without touching the caller's buffer.
    Discard {
        req: NetReq,
        /// Where UCX writes; held until the request is over.
        _scratch: Vec<u8>,
        len: usize,
    },
    /// Sender, staged: the device→host copy into `buf` runs.
    ToHost { ev: EventHandle, buf: Bounce },
    /// UCX moves the message (`buf`: the staging buffer, if any).
    Wire { req: NetReq, buf: Option<Bounce> },
    /// Receiver, staged: the host→device copy of `len` bytes out of `buf` runs.
    FromHost {
        ev: EventHandle,
        buf: Bounce,
        len: usize,
    },
}

impl NetPhase {
    pub(crate) fn waiting_for(&self) -> String {
        match self {
            NetPhase::Start => "waiting for earlier work on the caller's stream".into(),
            NetPhase::Probe => "waiting for the peer's message".into(),
            NetPhase::Discard { .. } => "waiting for an oversized message to drain".into(),
            NetPhase::ToHost { .. } => "waiting for the copy into the staging buffer".into(),
            NetPhase::Wire { .. } => {
                "waiting for the network (the peer's matching operation)".into()
            }
            NetPhase::FromHost { .. } => "waiting for the copy out of the staging buffer".into(),
        }
    }
}

/// A pinned host buffer for staging (`host_alloc`).
pub(crate) struct Bounce {
    pub(crate) ptr: *mut u8,
    cap: usize,
}

// SAFETY: host memory owned by the engine thread's state; moved with it.
unsafe impl Send for Bounce {}

/// The network side, shared by the engine and posting threads (which move a message
/// themselves where they can: [`Comm::try_caller_net`](crate::comm::Comm::try_caller_net)); UCX is called under its lock.
pub(crate) type SharedNet = Arc<Mutex<NetState>>;

/// This rank's network side: one UCX worker, an endpoint per peer on another host.
pub(crate) struct NetState {
    pub(crate) worker: Worker,
    pub(crate) eps: Vec<Option<Endpoint>>,
    pub(crate) failed: Vec<Arc<AtomicI32>>,
    /// The UCX memory type in which the caller's buffers go to UCX as they are; `None`: they
    /// are staged through host buffers (UCX cannot take them, or staging is forced).
    direct: Option<u64>,
    /// Staging buffers not in use.
    pool: Vec<Bounce>,
    /// This rank, and the receives it keeps posted for its peers' goodbyes ([`Worker::goodbye`]).
    rank: usize,
    farewells: Vec<NetReq>,
}

impl NetState {
    /// Loads UCX and connects to every peer whose pair is [`TransportKind::Net`]; `None` where
    /// there is none (UCX is then never loaded).
    pub(crate) fn connect<A: DeviceAdaptor>(
        adaptor: &A,
        boot: &Bootstrap,
        transports: &[Option<TransportKind>],
        force_staging: bool,
    ) -> Result<Option<SharedNet>> {
        let peers: Vec<usize> = (0..transports.len())
            .filter(|&q| transports[q] == Some(TransportKind::Net))
            .collect();
        if peers.is_empty() {
            return Ok(None);
        }
        let worker = Worker::new(Ucx::load()?)?;
        let addr = worker.address()?;
        // Addresses are small (a few hundred bytes): sending to every peer before reading any
        // cannot block on a peer doing the same.
        for &q in &peers {
            boot.send(q, Tag::NetAddress, &addr, &[])?;
        }
        let failed: Vec<Arc<AtomicI32>> = (0..transports.len()).map(|_| Arc::default()).collect();
        let mut eps: Vec<Option<Endpoint>> = (0..transports.len()).map(|_| None).collect();
        for &q in &peers {
            let (a, _) = boot.recv(q, Tag::NetAddress)?;
            match worker.connect(&a, failed[q].clone()) {
                Ok(ep) => eps[q] = Some(ep),
                Err(e) => {
                    for ep in eps.iter_mut().filter_map(Option::take) {
                        worker.close(ep, true);
                    }
                    return Err(e);
                }
            }
        }
        let direct = direct_memory(
            adaptor.vendor(),
            adaptor.capabilities().host_addressable,
            // Where UCX cannot say, it is taken to move host memory only.
            worker.memory_types().unwrap_or(1 << MEMORY_TYPE_HOST),
            force_staging,
        );
        tracing::info!(
            rank = boot.rank(),
            staged = direct.is_none(),
            "network transport (UCX) to ranks {peers:?}"
        );
        let (rank, pool, farewells) = (boot.rank(), Vec::new(), worker.await_goodbyes(&peers));
        Ok(Some(Arc::new(Mutex::new(NetState {
            worker,
            eps,
            failed,
            direct,
            pool,
            rank,
            farewells,
        }))))
    }

    /// One UCX progress call with nothing of this rank in flight: takes a departing peer's
    /// goodbye ([`Worker::goodbye`]) within the idle proxy's nap instead of its 2 s deadline.
    pub(crate) fn idle_progress(&self) {
        self.worker.progress();
    }

    /// Whether messages are staged through host buffers.
    pub(crate) fn stage(&self) -> bool {
        self.direct.is_none()
    }

    /// Where and as what memory type UCX reads or writes `n` bytes of the caller's unstaged
    /// buffer at `ptr`: the buffer itself, or for a zero-byte message a static host byte (UCX
    /// may hold the address; it touches no byte of it).
    pub(crate) fn ucx_buf(&self, ptr: flagcx_adaptor::DevicePtr, n: usize) -> (*mut u8, u64) {
        static EMPTY: u8 = 0;
        if n == 0 {
            (&EMPTY as *const u8 as *mut u8, MEMORY_TYPE_HOST)
        } else {
            (ptr.0 as *mut u8, self.direct.unwrap_or(MEMORY_TYPE_HOST))
        }
    }

    /// Cancels a request a posting thread handed over, which will not run.
    pub(crate) fn cancel(&mut self, req: &mut NetReq) {
        self.worker.cancel(req);
    }

    pub(crate) fn bounce<A: DeviceAdaptor>(&mut self, adaptor: &A, n: usize) -> Result<Bounce> {
        if let Some(i) = self
            .pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.cap >= n)
            .min_by_key(|(_, b)| b.cap)
            .map(|(i, _)| i)
        {
            return Ok(self.pool.swap_remove(i));
        }
        let cap = n.max(64 << 10).next_power_of_two();
        Ok(Bounce {
            ptr: adaptor.host_alloc(cap)?,
            cap,
        })
    }

    /// Starts a request on staging buffer `buf` (`start` gets this state and the buffer's
    /// address): the buffer then travels with the request, or goes back on failure.
    pub(crate) fn on_bounce<A: DeviceAdaptor>(
        &mut self,
        adaptor: &A,
        buf: Bounce,
        start: impl FnOnce(&NetState, *mut u8) -> Result<NetReq>,
    ) -> Result<NetPhase> {
        match start(self, buf.ptr) {
            Ok(req) => Ok(NetPhase::Wire {
                req,
                buf: Some(buf),
            }),
            Err(e) => {
                self.give_back(adaptor, buf);
                Err(e)
            }
        }
    }

    pub(crate) fn give_back<A: DeviceAdaptor>(&mut self, adaptor: &A, b: Bounce) {
        if self.pool.len() < 16 {
            self.pool.push(b);
        } else {
            // SAFETY: from `host_alloc`; its copy and its UCX request are over.
            let _ = unsafe { adaptor.host_free(b.ptr) };
        }
    }

    /// Cancels what `step` holds of UCX and gives its staging buffer back. The caller has
    /// synchronized the engine's streams (no staging copy runs).
    pub(crate) fn abandon<A: DeviceAdaptor>(&mut self, adaptor: &A, step: &mut Step) {
        let Phase::Net(phase) = std::mem::replace(&mut step.phase, Phase::Net(NetPhase::Start))
        else {
            return;
        };
        match phase {
            NetPhase::Start | NetPhase::Probe => {}
            NetPhase::Discard { mut req, .. } => self.worker.cancel(&mut req),
            NetPhase::ToHost { buf, .. } | NetPhase::FromHost { buf, .. } => {
                self.give_back(adaptor, buf)
            }
            NetPhase::Wire { mut req, buf } => {
                self.worker.cancel(&mut req);
                if let Some(b) = buf {
                    self.give_back(adaptor, b);
                }
            }
        }
    }

    /// Says goodbye to every peer still there ([`Worker::goodbye`]: a send completes once its
    /// buffer may be reused, which for a small message is before it left this host), closes
    /// every endpoint (flushing what was sent) — neither where `force` — and frees the staging
    /// buffers; the worker goes with `self`.
    /// `lost`: the pairs retired (peer gone, or an operation timed out): not flushed.
    pub(crate) fn close<A: DeviceAdaptor>(&mut self, adaptor: &A, force: bool, lost: &[bool]) {
        let failed = &self.failed;
        let gone = |q: usize| failed[q].load(Ordering::Acquire) != 0 || lost.get(q) == Some(&true);
        let to: Vec<_> = (self.eps.iter().enumerate())
            .filter_map(|(q, ep)| ep.as_ref().filter(|_| !force && !gone(q)))
            .collect();
        self.worker.goodbye(&to, self.rank, &mut self.farewells);
        for (q, ep) in self.eps.iter_mut().enumerate() {
            if let Some(ep) = ep.take() {
                self.worker.close(ep, force || gone(q));
            }
        }
        for b in self.pool.drain(..) {
            // SAFETY: from `host_alloc`, unused.
            let _ = unsafe { adaptor.host_free(b.ptr) };
        }
    }
}

/// A failed UCX request as the operation reports it: a truncated receive is a size mismatch
/// (`len`: the message's length as UCX reported it), anything else a network failure.
pub(crate) fn failure(
    worker: &Worker,
    dir: Dir,
    p: usize,
    s: Status,
    len: usize,
    bytes: usize,
) -> CommError {
    match dir {
        Dir::Recv if s == ERR_TRUNCATED => CommError::SizeMismatch {
            peer: p,
            send_bytes: len.max(bytes + 1),
            recv_bytes: bytes,
        },
        _ => CommError::Net(format!(
            "{} with rank {p}: {}",
            match dir {
                Dir::Send => "send",
                Dir::Recv => "receive",
            },
            worker.describe(s)
        )),
    }
}

/// What a posting thread achieved with a net message.
pub(crate) enum Caller {
    Done(Result<usize>),
    /// Not finished within the spin time: the engine goes on from here.
    HandOff(Option<Resume>),
}

/// How a rank's device memory goes to UCX: `Some(t)` as it is, as UCX memory type `t`; `None`
/// staged through pinned host buffers. Host-addressable memory is host memory; CUDA and HIP
/// memory go as they are where UCX moves their memory type itself (`ucx_types`, bit `t` for
/// type `t`: [`Worker::memory_types`]); OpenCL buffers, which have no address UCX could use,
/// are always staged, as is everything with `force_staging`.
pub(crate) fn direct_memory(
    vendor: Vendor,
    host_addressable: bool,
    ucx_types: u64,
    force_staging: bool,
) -> Option<u64> {
    if force_staging {
        return None;
    }
    if host_addressable {
        return Some(MEMORY_TYPE_HOST);
    }
    let t = match vendor {
        Vendor::Cuda => MEMORY_TYPE_CUDA,
        Vendor::Hip => MEMORY_TYPE_ROCM,
        _ => return None,
    };
    (ucx_types & (1 << t) != 0).then_some(t)
}

/// Polls of UCX between two reads of the clock on a posting thread.
pub(crate) const CLOCK_EVERY: u32 = 8;

/// Longest a posting thread moves one message while its bytes flow.
pub(crate) const CALLER_MAX: Duration = Duration::from_millis(2);

/// Between polls of UCX on a posting thread: a CPU pause, and a yield every 16 polls. Each
/// poll is already a few system calls (UCX reads its sockets), so yielding after every one, as
/// `spin::relax` does below 8 cores, cost ~1.5 µs of an 8 B message on 2 cores; never yielding
/// would keep a rank's other threads off a small machine for the whole spin.
pub(crate) fn pause(polls: u32) -> u32 {
    if polls % 16 == 15 {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
    polls.wrapping_add(1)
}

/// A waiter's step on a net pair: a round of UCX progress (another thread at it counts too).
pub(crate) struct NetHelp(pub(crate) SharedNet);

impl crate::op::Help for NetHelp {
    fn step(&self) -> bool {
        self.0.try_lock().map_or(true, |n| n.worker.progress())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST_ONLY: u64 = 1 << MEMORY_TYPE_HOST;
    const WITH_CUDA: u64 = HOST_ONLY | 1 << MEMORY_TYPE_CUDA;
    const WITH_ROCM: u64 = HOST_ONLY | 1 << MEMORY_TYPE_ROCM;

    #[test]
    fn device_memory_goes_to_ucx_only_where_it_moves_that_type() {
        // Host-addressable memory is host memory for any UCX.
        assert_eq!(
            direct_memory(Vendor::Host, true, HOST_ONLY, false),
            Some(MEMORY_TYPE_HOST)
        );
        // Debian's UCX: GPU memory is staged.
        assert_eq!(direct_memory(Vendor::Cuda, false, HOST_ONLY, false), None);
        assert_eq!(direct_memory(Vendor::Hip, false, HOST_ONLY, false), None);
        // A CUDA-enabled UCX takes CUDA memory, not ROCm memory, and the other way round.
        assert_eq!(
            direct_memory(Vendor::Cuda, false, WITH_CUDA, false),
            Some(MEMORY_TYPE_CUDA)
        );
        assert_eq!(direct_memory(Vendor::Hip, false, WITH_CUDA, false), None);
        assert_eq!(
            direct_memory(Vendor::Hip, false, WITH_ROCM, false),
            Some(MEMORY_TYPE_ROCM)
        );
        // OpenCL buffers have no address for UCX; forcing stages everything.
        assert_eq!(direct_memory(Vendor::OpenCl, false, u64::MAX, false), None);
        assert_eq!(direct_memory(Vendor::Cuda, false, WITH_CUDA, true), None);
        assert_eq!(direct_memory(Vendor::Host, true, HOST_ONLY, true), None);
    }
}
