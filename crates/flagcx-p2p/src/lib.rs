//! `flagcx-p2p`: point-to-point transfers between the processes of one node, on any vendor.
//!
//! Given any [`flagcx_adaptor::DeviceAdaptor`], a [`Comm`] lets N processes send and receive
//! device buffers to each other, including pairs on different vendors:
//!
//! - [`bootstrap`]: ranks meet over abstract Unix sockets (secret + same uid), all-gather their
//!   [`PeerInfo`], pass file descriptors;
//! - [`shm`]: memfd segments, shared by descriptor — nothing in /dev/shm to leak;
//! - [`channel`]: the shared control block and staging ring of one directed pair;
//! - `engine`: the progress thread (the proxy) that drives every pair's operations in order
//!   and publishes completion;
//! - `transport`: one module per protocol, each with its posting and its progress side —
//!   **IPC** (same vendor: one copy straight into or out of the peer's exported buffer),
//!   **staged** (different vendors or `FLAGCX_P2P_DISABLE=1`: device→host into ring slots,
//!   host→device out of them, pipelined), **direct** (a staged pair with a host-vendor rank:
//!   one copy into or out of its mapped buffer), **devring** (a staged pair whose runtimes
//!   share one GPU: the ring in device memory), **eager** (small messages through the
//!   channel's slots, copied by the CPU or through a bounce buffer), **streamed** (small
//!   messages as stream operations on the callers' streams, `FLAGCX_P2P_STREAM`), **late**
//!   (IPC pairs whose streams share one work queue: the copy claimed by the second poster)
//!   and **net** (pairs on different hosts, over UCX); [`TransportKind`] names the pair's
//!   choice (IPC, staged or net), the others are paths within those;
//! - [`collectives`]: broadcast, gather, scatter, all-gather, all-to-all(v), barrier over the
//!   transports; [`reduction`]: all-reduce, reduce-scatter and reduce, each rank combining what
//!   it receives on its own device with `DeviceAdaptor::reduce_async`, so every rank of a
//!   mixed-vendor job ends with the same bits.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use flagcx_adaptor::{DeviceBuffer, Stream};
//! # fn demo<A: flagcx_adaptor::DeviceAdaptor>(adaptor: A) -> flagcx_p2p::Result<()> {
//! let comm = flagcx_p2p::Comm::from_env(adaptor.clone())?; // flagcx-run sets the rank variables
//! let stream = Stream::new(&adaptor)?;
//! let buf = Arc::new(DeviceBuffer::new(&adaptor, 1 << 20)?);
//! let peer = (comm.rank() + 1) % comm.nranks();
//! let from = (comm.rank() + comm.nranks() - 1) % comm.nranks();
//! let out = Arc::new(DeviceBuffer::new(&adaptor, 1 << 20)?);
//! let (s, r) = comm.group(|| Ok((comm.send(&buf, peer, &stream)?, comm.recv(&out, from, &stream)?)))?;
//! s.wait()?;
//! r.wait()?;
//! # Ok(()) }
//! ```

#![deny(unsafe_op_in_unsafe_fn)]

pub mod bootstrap;
pub mod channel;
pub mod collectives;
mod comm;
pub mod config;
mod drive;
mod engine;
mod error;
mod group;
mod guard;
mod ipccache;
mod join;
mod kept;
pub mod launch;
mod link;
mod numa;
mod op;
pub mod peer;
pub mod port;
mod posting;
mod profile;
pub mod reduction;
mod request;
mod scratch;
mod setup;
mod shared;
pub mod shm;
mod slots;
mod standin;
mod transport;
mod ucx;
mod watermark;
pub mod wire;

pub use bootstrap::{Bootstrap, UniqueId};
pub use collectives::Collective;
pub use comm::{Comm, Request};
pub use config::{Config, HostDirect, IpcCopier, RankEnv, StreamJoin};
pub use error::{CommError, Result};
pub use peer::{PeerInfo, TransportKind};
pub use port::{PortChannel, PortRaw, Registered};

/// Bytes a rank's finished operations moved (sent plus received), by path. See
/// [`Comm::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PathStats {
    /// One copy between the two ranks' device memory (same vendor).
    pub ipc_bytes: u64,
    /// Through the staging ring in shared host memory.
    pub staged_bytes: u64,
    /// Staged pairs' direct copies into or out of a host-vendor rank's buffer.
    pub direct_bytes: u64,
    /// Small messages through the channels' eager slots (host-addressable pairs,
    /// [`Config::eager_max`]).
    pub eager_bytes: u64,
    /// Pairs on different hosts: through the network transport (UCX).
    pub net_bytes: u64,
    /// IPC and network operations (sends and receives) that the posting thread finished
    /// itself, without the proxy ([`Config::ipc_caller`] for IPC); their bytes count in
    /// `ipc_bytes` or `net_bytes`.
    pub caller_ops: u64,
    /// IPC operations whose posting thread's own copy failed (a vendor error), handed to the
    /// proxy to tell the peer and retire the pair.
    pub caller_failures: u64,
    /// Peer allocations whose IPC mapping was closed while running: the mapping cache (256
    /// entries) trimmed past its bound, or a mapping of an allocation the peer freed (a new
    /// allocation of that peer overlapped it).
    pub ipc_mappings_closed: u64,
    /// Operations whose caller's stream already waited at this rank's closed gate for an
    /// earlier one: the gate was made to wait for them too, and nothing was enqueued for them
    /// (OpenCL streams enqueued back to back; see `StreamJoin::Gate`).
    pub joins_held: u64,
    /// Engine passes run by threads waiting for an operation that moved something
    /// (`FLAGCX_P2P_WAITER_PROGRESS`, ranks whose copies are CPU copies): the waiter did the
    /// proxy's work.
    pub waiter_moves: u64,
    /// Sends and receives that began while another thread of this process was posting on the
    /// communicator. With joined streams that can leave ranks waiting on each other (see
    /// [`Comm`], "one order per communicator"; the first is logged as a warning).
    pub overlapping_posts: u64,
    /// Device memory the communicator holds as stand-ins: exportable buffers that carry IPC
    /// messages whose own memory has no IPC handle (CUDA's `cudaMallocAsync` pools), reused
    /// and freed with the communicator.
    pub stand_in_bytes: u64,
}
