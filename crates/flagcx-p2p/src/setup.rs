//! Setting up a communicator: [`Comm::init`] (the bootstrap, the exchange of every rank's
//! [`PeerInfo`], the engine and its proxy thread), and its pairs — which transport and who
//! copies (from both ranks' [`PeerInfo`]), and the channels they share.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use flagcx_adaptor::quiet::QuietCondvar;
use flagcx_adaptor::tracking::HandleMap;
use flagcx_adaptor::{DeviceAdaptor, Vendor};

use crate::bootstrap::{Bootstrap, UniqueId};
use crate::channel::{Channel, ConnectMsg, Geometry};
use crate::comm::Comm;
use crate::config::{Config, HostDirect, StreamJoin, MAX_EAGER_MAX};
use crate::engine::Engine;
use crate::error::{CommError, Result};
use crate::guard::Guard;
use crate::link::devring::{self, DevRing};
use crate::link::eager::{Bounce, EagerLink, STAGED_EAGER_MAX};
use crate::link::ipc::CallerLink;
use crate::link::net::NetState;
use crate::link::streamed::{self, StreamLink};
use crate::link::{PeerConn, Roles};
use crate::op::Inbox;
use crate::peer::{choose_transport, direct_copier, receiver_copies, PeerInfo, TransportKind};
use crate::shared::{Shared, WatermarkWord};
use crate::shm::ShmSegment;
use crate::slots::Slots;
use crate::transport::late;
use crate::watermark::WatermarkPage;
use crate::wire::Tag;

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
        crate::numa::log_cpus(rank, nranks);
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
                if !infos[rank].time_slices_with(&infos[q]) && infos[rank].shares_device(&infos[q])
                {
                    tracing::warn!(
                        rank,
                        peer = q,
                        "rank {rank} ↔ rank {q}: FLAGCX_P2P_IPC_COPIER=lower on a GPU shared \
                         under MPS: on an H200 this stalled within a few hundred calls (the \
                         copier's proxy blocked in the driver); `auto` has each sender copy"
                    );
                }
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
/// outgoing ones. Staged rings are pinned for the adaptor's copy engine (`host_pin`); pairs
/// with a device ring (`rings`: the exporting rank and its vendor) offer, map and settle it
/// ([`devring`]).
pub(crate) fn connect_channels<A: DeviceAdaptor>(
    adaptor: &A,
    boot: &Bootstrap,
    transports: &[Option<TransportKind>],
    roles: &[Roles],
    lanes: &[bool],
    rings: &[Option<devring::Plan>],
    config: &Config,
) -> Result<Vec<Option<PeerConn>>> {
    let half = config.slots() * config.chunksize;
    let mut offers = Offers {
        adaptor,
        rings: transports.iter().map(|_| None).collect(),
    };
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
        // 0: no device ring; 1: offered (its fd follows the channel's); 2: none could be made.
        let (ring, ring_fd) = match &rings[q] {
            Some(p) if p.exporter == boot.rank() => {
                match devring::offer(adaptor, half, p.near.as_deref()) {
                    Ok((r, fd)) => {
                        offers.rings[q] = Some(r);
                        (1, Some(fd))
                    }
                    Err(why) => {
                        tracing::info!(
                            peer = q,
                            "no device ring for rank {q} ({why}): staging through host memory"
                        );
                        (2, None)
                    }
                }
            }
            _ => (0, None),
        };
        let desc = ConnectMsg {
            staged: matches!(t, TransportKind::Staged),
            geo,
            len: geo.len() as u64,
            offered: ring,
            ring_len: 2 * half as u64,
        }
        .encode();
        let mut fds = vec![ch.segment().fd()];
        fds.extend(ring_fd.as_ref().map(|f| f.as_fd()));
        boot.send(q, Tag::Connect, &desc, &fds)?;
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
        let ring = rings[q]
            .as_ref()
            .filter(|p| p.exporter == q)
            .map(|p| (p.vendor, half));
        match connect_one(adaptor, boot, q, transports, inc, &geometry, lanes[q], ring) {
            Ok(conn) => peers.push(Some(conn.with_roles(roles[q]))),
            Err(e) => {
                undo_rings(adaptor, &peers);
                return Err(e);
            }
        }
    }
    // The offers this rank made: kept where the peer mapped them.
    for q in 0..offers.rings.len() {
        let Some(ring) = offers.rings[q].take() else {
            continue;
        };
        match devring::settle(adaptor, boot, q, ring) {
            Ok(r) => {
                peers[q]
                    .as_mut()
                    .expect("a channel for every offer")
                    .dev_ring = r
            }
            Err(e) => {
                undo_rings(adaptor, &peers);
                return Err(e);
            }
        }
    }
    Ok(peers)
}

/// Device rings this rank offered and has not settled yet: freed where setup stops first
/// (whichever step fails), since the peer can no longer use them.
struct Offers<'a, A: DeviceAdaptor> {
    adaptor: &'a A,
    rings: Vec<Option<DevRing>>,
}

impl<A: DeviceAdaptor> Drop for Offers<'_, A> {
    fn drop(&mut self) {
        for r in self.rings.iter().flatten() {
            // SAFETY: not settled, so this rank issued no copy on it; dropped with the failed
            // setup, so nothing uses it afterwards.
            unsafe { r.release(self.adaptor) };
        }
    }
}

/// Releases what `connect_channels` pinned or mapped before a later step failed.
fn undo_rings<A: DeviceAdaptor>(adaptor: &A, peers: &[Option<PeerConn>]) {
    for conn in peers.iter().flatten() {
        // SAFETY: no copy was ever issued on these rings, and the channels go with the error.
        unsafe { conn.release_rings(adaptor) };
    }
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
/// registers both rings of a staged pair; where `q` exports a device ring (`ring`: its
/// vendor and the bytes of one direction), maps that too ([`devring::accept`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn connect_one<A: DeviceAdaptor>(
    adaptor: &A,
    boot: &Bootstrap,
    q: usize,
    transports: &[Option<TransportKind>],
    inc: Channel,
    geometry: &dyn Fn(usize) -> Geometry,
    lane: bool,
    ring: Option<(Vendor, usize)>,
) -> Result<PeerConn> {
    let t = transports[q].expect("a transport for every peer");
    let (payload, mut fds) = boot.recv(q, Tag::Connect)?;
    let ConnectMsg {
        staged,
        geo,
        len,
        offered,
        ring_len,
    } = ConnectMsg::decode(&payload)?;
    let (len, ring_len) = (len as usize, ring_len as usize);
    let want = geometry(q);
    // The receiver sizes the eager slots by its own FLAGCX_P2P_EAGER_MAX; any size within the
    // bounds works for the sender (it sends eagerly up to the smaller of the two settings).
    let eager_ok = geo.eager == 0 || (lane && geo.eager <= MAX_EAGER_MAX);
    if staged != matches!(t, TransportKind::Staged)
        || (geo.slots, geo.chunk, geo.split) != (want.slots, want.chunk, want.split)
        || !eager_ok
        || len != geo.len()
        || fds.len() != 1 + (offered == 1) as usize
        || offered > 2
        || (offered != 0) != ring.is_some()
    {
        return Err(CommError::Protocol(format!(
            "rank {q} set up a different channel (staged {staged}, {geo:?}, {} fds, device \
             ring {offered}) than this rank expects ({want:?}, device ring {}); do all ranks \
             use the same FLAGCX_P2P_* settings?",
            fds.len(),
            ring.is_some()
        )));
    }
    let ring_fd = (offered == 1).then(|| fds.pop()).flatten();
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
    let mut conn = PeerConn::new(q, t, out, inc, registered);
    if let (Some((vendor, half)), Some(fd)) = (ring, ring_fd) {
        let handle = flagcx_adaptor::IpcFdHandle {
            vendor,
            fd,
            size: ring_len,
        };
        match devring::accept(adaptor, boot, q, handle, half) {
            Ok(r) => conn.dev_ring = r,
            Err(e) => {
                // SAFETY: no copy was issued on these rings.
                unsafe { conn.release_rings(adaptor) };
                return Err(e);
            }
        }
    }
    Ok(conn)
}

impl<A: DeviceAdaptor> Comm<A> {
    /// Joins job `id` as `rank` of `nranks`.
    pub fn init(
        adaptor: A,
        rank: usize,
        nranks: usize,
        id: &UniqueId,
        config: Config,
    ) -> Result<Self> {
        config.validate()?;
        let mut config = config;
        config
            .spin
            .get_or_insert_with(|| flagcx_adaptor::spin::default_spin(nranks));
        let caps = adaptor.capabilities();
        if config.join == StreamJoin::MemOp && !(caps.stream_mem_ops && caps.host_register) {
            return Err(CommError::config(
                "FLAGCX_STREAM_JOIN",
                "memop",
                format!(
                    "{} has no stream memory operations on registered memory",
                    adaptor.vendor()
                ),
            ));
        }
        if config.join == StreamJoin::Gate && !caps.host_gates {
            return Err(CommError::config(
                "FLAGCX_STREAM_JOIN",
                "gate",
                format!("{} has no stream gates", adaptor.vendor()),
            ));
        }
        let boot = Arc::new(Bootstrap::connect(
            rank,
            nranks,
            id,
            config.bootstrap_timeout,
        )?);
        let mut me = PeerInfo::local(rank, &adaptor, &config)?;
        // Checked before the all-gather, so that each pair knows whether either rank's streams
        // share one work queue (then, by default, it copies late: `transport::late`).
        let join = config.join.resolve(&caps);
        me.shares_queue =
            nranks > 1 && join != StreamJoin::None && crate::join::shares_queue(&adaptor, join);
        let infos = boot
            .all_gather(Tag::PeerInfo, &me.encode())?
            .iter()
            .map(|b| PeerInfo::decode(b))
            .collect::<Result<Vec<_>>>()?;
        for (q, info) in infos.iter().enumerate() {
            if info.rank != q {
                return Err(CommError::Protocol(format!(
                    "rank {q} claims to be rank {}",
                    info.rank
                )));
            }
        }
        let Pairing {
            transports,
            direct,
            roles,
            copiers,
        } = Pairing::choose(rank, &infos);
        let page = WatermarkPage::new(&adaptor)?;
        let late: Vec<bool> = (0..nranks)
            .map(|q| q != rank && late::allowed(&infos[rank], &infos[q], transports[q]))
            .collect();
        // Pairs that copy late wait on nothing of their own process: only the others can stall.
        let exposed: Vec<Option<TransportKind>> = (0..nranks)
            .map(|q| transports[q].filter(|_| !late[q]))
            .collect();
        let streams_share_queue =
            me.shares_queue && proxy_joins(&transports, join, caps.host_addressable);
        // Where the pairs that do not copy late join streams to their proxy's copies, those
        // copies would queue behind the joins: their posts wait for them instead.
        let posts_wait = me.shares_queue && proxy_joins(&exposed, join, caps.host_addressable);
        if posts_wait {
            tracing::warn!(
                "rank {rank}: this process's streams share one work queue (CUDA: \
                 CUDA_DEVICE_MAX_CONNECTIONS=1), where a caller's stream waiting for a copy of \
                 the proxy would hold that copy up: operations of pairs the proxy copies for \
                 (staged, direct, a GPU rank's network pairs, IPC with \
                 FLAGCX_P2P_LATE_COPY=off) finish before the call that posts them returns, as \
                 blocking MPI calls do, so sends and receives that depend on each other across \
                 ranks belong in one group. IPC pairs that copy \
                 late (by default here) and stream-ordered messages are not affected; more \
                 queues (CUDA's default of 8) keep every post enqueue-and-return"
            );
        }
        let ordered: Vec<bool> = (0..nranks)
            .map(|q| {
                q != rank
                    && !late[q]
                    && streamed::allowed(&infos[rank], &infos[q], transports[q], &roles[q])
            })
            .collect();
        // Where streams wait for peers (joins; late and stream-ordered pairs' words), closing
        // an IPC mapping waits for rest (`ipccache::Joining`; a late pair's close hung an H100).
        let streams_wait =
            join != StreamJoin::None || late.contains(&true) || ordered.contains(&true);
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox {
                ops: Vec::new(),
                next: vec![[0; 2]; nranks],
            }),
            pending: (0..nranks).map(|_| Default::default()).collect(),
            lost: (0..nranks).map(|_| AtomicBool::new(false)).collect(),
            reserved: (0..nranks).map(|_| Default::default()).collect(),
            ipc: Mutex::default(),
            trimming: AtomicBool::new(false),
            late_posting: AtomicUsize::new(0),
            posted: AtomicU64::new(0),
            spare_events: Mutex::new(Vec::new()),
            shutdown: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            released: AtomicU64::new(0),
            watermark: Mutex::new(0),
            watermark_cv: QuietCondvar::new(),
            gates: Mutex::default(),
            joins_held: AtomicU64::new(0),
            watermark_word: WatermarkWord::new(page.host),
            thread: Mutex::new(None),
            first_error: Mutex::new(None),
            busy_polls: AtomicU64::new(0),
            path_bytes: Default::default(),
            caller_ops: AtomicU64::new(0),
            caller_handoffs: Default::default(),
            eager_declined: Default::default(),
            beats: AtomicU64::new(0),
            blocked_in: AtomicU64::new(0),
            in_call: flagcx_adaptor::incall::CallSlot::new(),
            helped_us: Default::default(),
            waiter_moves: Default::default(),
            epoch: std::time::Instant::now(),
            verdict: Default::default(),
            late_kept: AtomicBool::new(false),
            joining: streams_wait.then(crate::ipccache::Joining::new),
        });
        // Eager slots: small messages through shared host memory, copied by the CPU where a
        // rank's device memory is host addressable and by its runtime (a blocking copy on the
        // caller's idle stream) where not. Every staged pair has them; IPC pairs only between
        // host-addressable ranks (others do better with one device copy).
        // Stream-ordered pairs carry their small messages in the eager slots too.
        let lanes: Vec<bool> = (0..nranks)
            .map(|q| {
                q != rank
                    && !late[q]
                    && (ordered[q] || eager_lane(&infos[rank], &infos[q], transports[q]))
            })
            .collect();
        let rings: Vec<Option<devring::Plan>> = (0..nranks)
            .map(|q| {
                let ring = config.device_ring;
                (q != rank)
                    .then(|| devring::Plan::of(&infos[rank], &infos[q], transports[q], ring))?
            })
            .collect();
        let mut peers = connect_channels(
            &adaptor,
            &boot,
            &transports,
            &roles,
            &lanes,
            &rings,
            &config,
        )?;
        let device_rings: Vec<bool> = (0..nranks)
            .map(|q| peers[q].as_ref().is_some_and(|c| c.dev_ring.is_some()))
            .collect();
        let mut sliced = vec![false; nranks];
        for c in peers.iter_mut().flatten() {
            c.shares_device = infos[rank].shares_device(&infos[c.peer]);
            sliced[c.peer] = infos[rank].time_slices_with(&infos[c.peer]);
        }
        // A kernel that spins for its peer holds a time-sliced device from that peer for a
        // whole slice (2.25 ms per exchange on an H200); under MPS both run at once.
        let fused = |q: usize| match config.stream_kernel {
            HostDirect::Auto => !sliced[q],
            HostDirect::On => true,
            HostDirect::Off => false,
        };
        let mut streamed: Vec<Option<StreamLink>> = Vec::with_capacity(nranks);
        for (q, c) in peers.iter().enumerate() {
            streamed.push(match (c, ordered[q]) {
                (Some(c), true) => match StreamLink::register(&adaptor, &c.out, &c.inc, fused(q)) {
                    Ok(l) => Some(l),
                    Err(e) => {
                        undo_streamed(&adaptor, &streamed, &peers);
                        return Err(e);
                    }
                },
                _ => None,
            });
        }
        let mut late_links: Vec<Option<StreamLink>> = Vec::with_capacity(nranks);
        for (q, c) in peers.iter().enumerate() {
            late_links.push(match (c, late[q]) {
                (Some(c), true) => match StreamLink::register(&adaptor, &c.out, &c.inc, false) {
                    Ok(mut l) => {
                        l.naming = config.late_naming;
                        Some(l)
                    }
                    Err(e) => {
                        undo_streamed(&adaptor, &streamed, &peers);
                        undo_links(&adaptor, &late_links);
                        return Err(e);
                    }
                },
                _ => None,
            });
        }
        let inboxes: Vec<bool> = (0..nranks)
            .map(|q| {
                q != rank
                    && ordered[q]
                    && streamed::wants_inbox(&infos[rank], &infos[q], transports[q])
            })
            .collect();
        if let Err(e) = StreamLink::connect_inboxes(&adaptor, &boot, &mut streamed, &inboxes) {
            undo_streamed(&adaptor, &streamed, &peers);
            undo_links(&adaptor, &late_links);
            return Err(e);
        }
        let eager: Vec<Option<EagerLink>> = peers
            .iter()
            .map(|c| {
                let c = c.as_ref().filter(|c| !ordered[c.peer])?;
                // Where both sides copy with their runtimes, two blocking copies lose to the
                // ring's pipeline above a few KiB (both ranks derive the same cap).
                let cap = match caps.host_addressable || infos[c.peer].caps.host_addressable {
                    true => usize::MAX,
                    false => STAGED_EAGER_MAX,
                };
                let (send_max, recv_max) = (
                    c.out.geometry().eager.min(config.eager_max).min(cap),
                    c.inc.geometry().eager.min(cap),
                );
                (send_max > 0 || recv_max > 0).then(|| EagerLink {
                    out: c.out.clone(),
                    inc: c.inc.clone(),
                    send_max,
                    recv_max,
                    freed: AtomicU64::new(0),
                    addressable: caps.host_addressable,
                    shares_device: c.shares_device,
                    waited_ns: AtomicU64::new(0),
                })
            })
            .collect();
        let pairs = peers
            .iter()
            .map(|c| c.as_ref().map(|c| (c.out.clone(), c.inc.clone())));
        let reduce_slots = Slots::new(rank, pairs.collect(), &infos, &config).map(Arc::new);
        let caller = peers
            .iter()
            .map(|c| {
                let c = c.as_ref()?;
                let ipc = c.transport == TransportKind::Ipc && !ordered[c.peer] && !late[c.peer];
                (config.ipc_caller && ipc).then(|| CallerLink {
                    out: c.out.clone(),
                    inc: c.inc.clone(),
                    push: !c.roles.peer_pulls,
                    pull: c.roles.we_pull,
                })
            })
            .collect();
        let names_buffer = crate::link::ipc::names_buffer(&peers);
        let net = NetState::connect(&adaptor, &boot, &transports, config.net_staging)?;
        // Eager messages of device memory the CPU cannot reach go through pinned bounce
        // buffers (the posting threads' and the proxy's), made now.
        let bounces = !caps.host_addressable && eager.iter().any(Option::is_some);
        let proxy = Engine::new(
            crate::transport::protocols(),
            adaptor.clone(),
            shared.clone(),
            boot.clone(),
            peers,
            net.clone(),
            &config,
            bounces,
        )?;
        let here = transports
            .iter()
            .filter(|t| **t != Some(TransportKind::Net))
            .count();
        let helps = caps.host_addressable
            && config
                .waiter_progress
                .unwrap_or(here <= flagcx_adaptor::spin::cores_from_env());
        let (handle, help) = crate::drive::start(proxy, &adaptor, rank, helps)?;
        let next_seq = Arc::new(AtomicU64::new(1));
        let guard = match config.timeout {
            Some(t) => {
                match Guard::start(adaptor.clone(), shared.clone(), next_seq.clone(), t, rank) {
                    Ok(g) => Some(g),
                    Err(e) => {
                        shared.shutdown.store(true, Ordering::Release);
                        shared.wake();
                        let _ = handle.join();
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        let bounce = Mutex::new(Bounce::made_if(bounces, &adaptor));
        Ok(Comm {
            adaptor,
            rank,
            nranks,
            infos,
            transports,
            copiers,
            direct,
            eager,
            reduce_slots,
            caller,
            streamed,
            late: late_links,
            late_order: Mutex::new(()),
            shared,
            proxy: Some(handle),
            help,
            next_seq,
            guard,
            group: Mutex::default(),
            group_scratch: Mutex::default(),
            joined: Mutex::new(HandleMap::default()),
            posting: Default::default(),
            page,
            streams_share_queue,
            device_rings,
            posts_wait,
            config,
            _boot: boot,
            net,
            ports: Default::default(),
            bounce,
            scratch: Default::default(),
            names_buffer,
            stand_ins: Default::default(),
            deferred: Default::default(),
        })
    }
}

/// Whether callers' streams may wait for copies this rank's proxy issues: pairs through IPC
/// or a staging ring, network pairs where this rank's device memory is not host addressable
/// (the proxy stages it through host memory on its own stream), and streams that join at all
/// (`join` resolved; any kind of join is a wait in the stream's queue).
fn proxy_joins(transports: &[Option<TransportKind>], join: StreamJoin, addressable: bool) -> bool {
    join != StreamJoin::None
        && transports.iter().any(|t| match t {
            Some(TransportKind::Ipc | TransportKind::Staged) => true,
            Some(TransportKind::Net) => !addressable,
            _ => false,
        })
}

/// Whether the pair of `me` and `peer` (joined by `transport`) gets eager slots.
fn eager_lane(me: &PeerInfo, peer: &PeerInfo, transport: Option<TransportKind>) -> bool {
    match transport {
        Some(TransportKind::Staged) => true,
        Some(TransportKind::Ipc) => me.caps.host_addressable && peer.caps.host_addressable,
        _ => false,
    }
}

/// Releases the registrations of late-copy links made before a later setup step failed.
fn undo_links<A: DeviceAdaptor>(adaptor: &A, links: &[Option<StreamLink>]) {
    links.iter().flatten().for_each(|l| l.release(adaptor));
}

/// Undoes what setup registered for stream-ordered links and rings before the channels go.
fn undo_streamed<A: DeviceAdaptor>(
    adaptor: &A,
    streamed: &[Option<StreamLink>],
    peers: &[Option<PeerConn>],
) {
    streamed.iter().flatten().for_each(|l| l.release(adaptor));
    for conn in peers.iter().flatten() {
        // SAFETY: no copy was ever issued on these rings, and the channels go with the error.
        unsafe { conn.release_rings(adaptor) };
    }
}

#[cfg(test)]
mod tests {
    use super::{proxy_joins, StreamJoin, TransportKind};

    #[test]
    fn proxy_joins_count_staged_network_pairs_only_where_memory_is_staged() {
        let (ipc, staged, net) = (
            Some(TransportKind::Ipc),
            Some(TransportKind::Staged),
            Some(TransportKind::Net),
        );
        for join in [StreamJoin::MemOp, StreamJoin::Gate, StreamJoin::HostFn] {
            assert!(proxy_joins(&[None, ipc], join, true));
            assert!(proxy_joins(&[staged, None], join, true));
            // A network pair's proxy copies only where it stages device memory.
            assert!(proxy_joins(&[None, net], join, false));
            assert!(!proxy_joins(&[None, net], join, true));
            assert!(!proxy_joins(&[None, None], join, false));
        }
        // Streams that make no join wait for nothing.
        assert!(!proxy_joins(&[ipc, staged, net], StreamJoin::None, false));
    }
}
