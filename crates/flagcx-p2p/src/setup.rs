//! Setting up a communicator's pairs: which transport and who copies (from both ranks'
//! [`PeerInfo`]), and the channels they share.

use std::sync::Arc;

use flagcx_adaptor::DeviceAdaptor;

use crate::bootstrap::Bootstrap;
use crate::channel::{Channel, Geometry};
use crate::config::{Config, MAX_EAGER_MAX};
use crate::error::{CommError, Result};
use crate::peer::{choose_transport, direct_copier, receiver_copies, PeerInfo, TransportKind};
use crate::shm::ShmSegment;
use crate::transport::{PeerConn, Roles};
use crate::wire::{Reader, Tag, Writer};

/// Who does what on each pair, chosen from both ranks' [`PeerInfo`] alone, so both sides
/// of a pair agree without asking each other. Indexed by peer (`None` at this rank).
pub(crate) struct Pairing {
    /// The transport of each pair.
    pub(crate) transports: Vec<Option<TransportKind>>,
    /// Per staged pair: the rank that copies straight into and out of the host-vendor rank's
    /// buffers (`None`: no direct path).
    pub(crate) direct: Vec<Option<usize>>,
    /// Per pair: who copies, in the engine's terms.
    pub(crate) roles: Vec<Roles>,
    /// Per IPC pair: the rank that issues the copies both ways (`None`: each sender).
    pub(crate) copiers: Vec<Option<usize>>,
}

impl Pairing {
    /// The choices of `rank` in a job whose ranks are `infos`; logged at `info`.
    pub(crate) fn choose(rank: usize, infos: &[PeerInfo]) -> Self {
        let nranks = infos.len();
        let mut transports = vec![None; nranks];
        for q in (0..nranks).filter(|&q| q != rank) {
            let (t, why) = choose_transport(&infos[rank], &infos[q]);
            tracing::info!(
                rank,
                peer = q,
                transport = %t,
                "rank {rank} ({} {}) ↔ rank {q} ({} {}): {t} ({why})",
                infos[rank].vendor,
                infos[rank].device,
                infos[q].vendor,
                infos[q].device
            );
            transports[q] = Some(t);
        }
        let direct: Vec<Option<usize>> = (0..nranks)
            .map(|q| (q != rank).then(|| direct_copier(&infos[rank], &infos[q]))?)
            .collect();
        let roles: Vec<Roles> = (0..nranks)
            .map(|q| match (transports[q], direct[q]) {
                (Some(TransportKind::Ipc), _) => Roles {
                    peer_pulls: receiver_copies(&infos[rank], &infos[q]),
                    we_pull: receiver_copies(&infos[q], &infos[rank]),
                    ..Roles::default()
                },
                // The direct copier pushes its sends and pulls the host rank's.
                (Some(TransportKind::Staged), Some(c)) => Roles {
                    peer_pulls: c == q,
                    we_pull: c == rank,
                    maps_peer: c == rank,
                    peer_maps: c == q,
                },
                _ => Roles::default(),
            })
            .collect();
        for (q, c) in direct.iter().enumerate() {
            if let Some(c) = c {
                tracing::info!(
                    rank,
                    peer = q,
                    "rank {rank} ↔ rank {q}: rank {c} copies directly into and out of the host \
                     rank's buffers once they are mapped (the staging ring until then)"
                );
            }
        }
        let copiers: Vec<Option<usize>> = roles
            .iter()
            .enumerate()
            .map(|(q, r)| match transports[q] {
                Some(TransportKind::Ipc) if r.peer_pulls || r.we_pull => {
                    Some(if r.we_pull { rank } else { q })
                }
                _ => None,
            })
            .collect();
        for (q, copier) in copiers.iter().enumerate() {
            if let Some(copier) = copier {
                tracing::info!(
                    rank,
                    peer = q,
                    "rank {rank} ↔ rank {q}: rank {copier} issues the IPC copies both ways"
                );
            }
        }
        Pairing {
            transports,
            direct,
            roles,
            copiers,
        }
    }
}

/// Creates this rank's incoming channels, swaps descriptors with every peer, and maps the
/// outgoing ones. Staged rings are pinned for the adaptor's copy engine (`host_pin`).
pub(crate) fn connect_channels<A: DeviceAdaptor>(
    adaptor: &A,
    boot: &Bootstrap,
    transports: &[Option<TransportKind>],
    roles: &[Roles],
    lanes: &[bool],
    config: &Config,
) -> Result<Vec<Option<PeerConn>>> {
    // The channel a rank creates for peer `q`'s sends; its eager slots are sized by the
    // creating (receiving) rank's setting.
    let geometry = |q: usize| {
        let eager = if lanes[q] { config.eager_max } else { 0 };
        match transports[q] {
            Some(TransportKind::Staged) => Geometry {
                slots: config.slots(),
                chunk: config.chunksize,
                split: config.split,
                eager,
            },
            _ => Geometry {
                slots: 0,
                chunk: 0,
                split: 0,
                eager,
            },
        }
    };
    let mut incoming = Vec::new();
    for (q, t) in transports.iter().enumerate() {
        let Some(t) = *t else {
            incoming.push(None);
            continue;
        };
        let geo = geometry(q);
        if t == TransportKind::Net {
            // Nothing is shared with a rank on another host; the pair's channels stay local
            // and carry only its fault counters.
            incoming.push(Some(ch_local()?));
            continue;
        }
        let ch = Channel::create(geo)?;
        let desc = Writer::new()
            .u8(matches!(t, TransportKind::Staged) as u8)
            .u64(geo.slots as u64)
            .u64(geo.chunk as u64)
            .u64(geo.split as u64)
            .u64(geo.eager as u64)
            .u64(geo.len() as u64)
            .finish();
        boot.send(q, Tag::Connect, &desc, &[ch.segment().fd()])?;
        incoming.push(Some(ch));
    }
    let mut peers: Vec<Option<PeerConn>> = Vec::new();
    for (q, inc) in incoming.into_iter().enumerate() {
        let Some(inc) = inc else {
            peers.push(None);
            continue;
        };
        if transports[q] == Some(TransportKind::Net) {
            let out = Arc::new(ch_local()?);
            peers.push(Some(PeerConn::new(
                q,
                TransportKind::Net,
                out,
                Arc::new(inc),
                false,
            )));
            continue;
        }
        match connect_one(adaptor, boot, q, transports, inc, &geometry, lanes[q]) {
            Ok(conn) => peers.push(Some(conn.with_roles(roles[q]))),
            Err(e) => {
                // Undo the rings already registered for earlier peers before the channels go.
                for conn in peers.iter().flatten().filter(|c| c.registered) {
                    for ch in [&conn.out, &conn.inc] {
                        // SAFETY: no copy was ever issued on these rings.
                        let _ = unsafe { adaptor.host_unpin(ch.ring().0) };
                    }
                }
                return Err(e);
            }
        }
    }
    Ok(peers)
}

/// A channel for a pair on two hosts: nothing in it is shared.
fn ch_local() -> Result<Channel> {
    Channel::create(Geometry {
        slots: 0,
        chunk: 0,
        split: 0,
        eager: 0,
    })
}

/// Receives peer `q`'s channel for this rank's sends, checks it agrees with ours, maps it and
/// registers both rings of a staged pair.
pub(crate) fn connect_one<A: DeviceAdaptor>(
    adaptor: &A,
    boot: &Bootstrap,
    q: usize,
    transports: &[Option<TransportKind>],
    inc: Channel,
    geometry: &dyn Fn(usize) -> Geometry,
    lane: bool,
) -> Result<PeerConn> {
    let t = transports[q].expect("a transport for every peer");
    let (payload, mut fds) = boot.recv(q, Tag::Connect)?;
    let mut r = Reader::new(&payload, "connect");
    let staged = r.u8()? == 1;
    let geo = Geometry {
        slots: r.u64()? as usize,
        chunk: r.u64()? as usize,
        split: r.u64()? as usize,
        eager: r.u64()? as usize,
    };
    let len = r.u64()? as usize;
    r.end()?;
    let want = geometry(q);
    // The receiver sizes the eager slots by its own FLAGCX_P2P_EAGER_MAX; any size within the
    // bounds works for the sender (it sends eagerly up to the smaller of the two settings).
    let eager_ok = geo.eager == 0 || (lane && geo.eager <= MAX_EAGER_MAX);
    if staged != matches!(t, TransportKind::Staged)
        || (geo.slots, geo.chunk, geo.split) != (want.slots, want.chunk, want.split)
        || !eager_ok
        || len != geo.len()
        || fds.len() != 1
    {
        return Err(CommError::Protocol(format!(
            "rank {q} set up a different channel (staged {staged}, {geo:?}, {} fds) \
             than this rank expects ({want:?}); do all ranks use the same FLAGCX_P2P_* settings?",
            fds.len()
        )));
    }
    let out = Arc::new(Channel::open(ShmSegment::open(fds.remove(0), len)?, geo)?);
    let inc = Arc::new(inc);
    // Rings are pinned for the copy engine where the runtime can (CUDA and HIP register them,
    // OpenCL wraps them in a `USE_HOST_PTR` buffer): pageable staging runs at a fraction of
    // the bus.
    let registered = staged && adaptor.capabilities().host_pin;
    if registered {
        let (p, n) = out.ring();
        // SAFETY: the ring lies in a mapping the channel owns; the engine (or the error path of
        // `connect_channels`) unpins it before the channel is unmapped.
        unsafe { adaptor.host_pin(p, n) }?;
        let (p2, n2) = inc.ring();
        // SAFETY: as above.
        if let Err(e) = unsafe { adaptor.host_pin(p2, n2) } {
            // SAFETY: pinned just above and unused.
            let _ = unsafe { adaptor.host_unpin(p) };
            return Err(e.into());
        }
    }
    Ok(PeerConn::new(q, t, out, inc, registered))
}
