//! The transports: how an operation's bytes move between a pair of ranks.
//!
//! The [engine](crate::engine) admits operations and drives each pair's queue of [`Step`]s in
//! posting order; the steps' protocols live here, one module per transport:
//!
//! | module | protocol | posting side (API thread) | progress side (engine) |
//! |---|---|---|---|
//! | [`rendezvous`] | the descriptor handshake every non-eager message runs: receive announced, send answered (push), or send offered, verdict given (pull) | — | `Engine::progress_send`/`progress_recv`: the [`Phase`] machine, handing the copy to one of the modules below |
//! | [`ipc`] | same vendor: one device copy into the receiver's exported buffer (push) or out of the sender's (pull, one copier per pair); the IPC mapping cache | `Comm::try_caller_ipc`: the posting thread moves the message itself | `Engine::issue_ipc_copy`/`issue_ipc_pull` |
//! | [`staged`] | different vendors: device→host into ring slots, host→device out of them, pipelined | — | `Engine::pump`: both directions, one loop |
//! | [`devring`] | staged pairs where one runtime maps the other's fd export (CUDA memory in NVIDIA's OpenCL), placed on the importer's GPU: the ring's slots in device memory, copied device→device, for messages from 4 MiB | — | `Engine::pump`, with [`crate::link::devring::DevRing::slot`] for the slot |
//! | [`direct`] | a staged pair with a host-vendor rank: one copy straight into or out of its mapped buffer ([`hostmap`]) | — | `Engine::direct_push`/`direct_pull` |
//! | [`eager`] | host-addressable and staged pairs: small messages through the channel's eager slots, copied by the CPU or by a blocking runtime copy via a bounce buffer | `Comm::try_eager` | `Engine::take_eager` |
//! | [`streamed`] | pairs of CUDA or host-vendor ranks (`FLAGCX_P2P_STREAM=on`): small messages as stream operations on the callers' streams — wait for a free slot, copy in, write the status word; wait for it, sized copy out | `Comm::enqueue_streamed` (at submission) | `Engine::progress_streamed`: announces receives, publishes `send_posted` / `recv_done` behind the streams |
//! | [`late`] | IPC pairs where a process's streams share one work queue (`FLAGCX_P2P_LATE_COPY`): each message is claimed by both posting threads; the first's stream marks its place and waits, the second's waits for that mark, copies and writes `Done` | `Comm::enqueue_late` (at submission) | `Engine::progress_late`: follows `Done`, publishes what finished |
//! | [`net`] | pairs on different hosts: one UCX tagged message per message, staged through pinned host memory where device memory is not host addressable | — | `Engine::progress_net` |
//!
//! The engine drives these through [`crate::engine::Protocol`]: [`protocols`] is the registry
//! it is handed at setup, and it names none of them. Which transport a pair uses is chosen once
//! at setup ([`crate::peer::choose_transport`]); a new protocol is a module here implementing
//! `Protocol`, its state in [`crate::link`], its phases in [`Phase`], a line in the registry
//! and one in that choice.

pub(crate) mod direct;
pub(crate) mod eager;
pub(crate) mod ipc;
pub(crate) mod late;
pub(crate) mod net;
pub(crate) mod rendezvous;
pub(crate) mod staged;
pub(crate) mod streamed;

// The pairs' state and the protocols' shared vocabulary, for the modules below (`super::…`).
use crate::link::*;

/// The registry: the protocols the engine drives steps through, in the order it asks them
/// (`engine::Protocol`). The late-copy and stream-ordered ones claim their phases, the network
/// its pairs, and the rendezvous every other step (handing its copy to IPC, the staging ring or
/// the direct path). Late copies come before stream-ordered ones: where an operation is failed
/// without its peer, the late waits are ended first (`Engine::release_all`).
pub(crate) fn protocols<A: flagcx_adaptor::DeviceAdaptor>(
) -> Vec<&'static dyn crate::engine::Protocol<A>> {
    vec![
        &late::Late,
        &streamed::Streamed,
        &net::Net,
        &rendezvous::Rendezvous,
    ]
}
