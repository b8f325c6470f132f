//! Configuration from the environment, parsed strictly: a malformed value is an error naming the
//! variable, never a silent default.

use std::time::Duration;

use crate::bootstrap::UniqueId;
use crate::error::{CommError, Result};

/// How a caller's stream waits for the operations posted on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamJoin {
    /// Stream memory operations where the vendor has them, else gates, else host functions.
    Auto,
    /// A stream wait-value on the communicator's completion word (fast trigger).
    MemOp,
    /// A gate the progress thread opens when the operation finished
    /// ([`flagcx_adaptor::DeviceAdaptor::stream_gate`]; OpenCL's user events): no runtime
    /// thread in between. Refused where the vendor has none.
    Gate,
    /// A host function that blocks the stream until the operation finished (slow trigger).
    HostFn,
    /// No join: later work on the stream is *not* ordered after the operation; callers order
    /// it themselves with [`crate::Request::wait`]. Useful where the stream is synchronized on
    /// the host anyway, and where a stream parked on a wait would cost GPU time-slicing (two
    /// processes on one GPU without MPS).
    None,
}

impl StreamJoin {
    /// The join a communicator on a vendor with `caps` makes: `Auto` resolved to `MemOp`,
    /// `Gate` or `HostFn` in that order of preference; the others as configured (setup refuses
    /// `MemOp` and `Gate` where the vendor cannot).
    pub fn resolve(self, caps: &flagcx_adaptor::Capabilities) -> StreamJoin {
        match self {
            StreamJoin::Auto if caps.stream_mem_ops && caps.host_register => StreamJoin::MemOp,
            StreamJoin::Auto if caps.host_gates => StreamJoin::Gate,
            StreamJoin::Auto => StreamJoin::HostFn,
            other => other,
        }
    }
}

/// Which rank of an IPC pair issues the copy for each direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpcCopier {
    /// `Lower` when both ranks use the same device, else `Sender`.
    Auto,
    /// The sender writes into the receiver's buffer (push), each direction by its own sender.
    Sender,
    /// The lower rank of the pair copies both ways: it pushes its sends and pulls its
    /// receives from the other rank's buffer. Two processes on one GPU without MPS are
    /// time-sliced, and every switch between their contexts costs ~150 µs on an H200; with
    /// one copier only its context touches the GPU for the pair's traffic.
    Lower,
}

impl IpcCopier {
    /// Wire code (all-gathered with the peer info).
    pub fn code(self) -> u8 {
        match self {
            IpcCopier::Auto => 0,
            IpcCopier::Sender => 1,
            IpcCopier::Lower => 2,
        }
    }

    /// Inverse of [`IpcCopier::code`].
    pub fn from_code(c: u8) -> Option<Self> {
        [IpcCopier::Auto, IpcCopier::Sender, IpcCopier::Lower]
            .into_iter()
            .find(|x| x.code() == c)
    }
}

/// Whether a heterogeneous pair copies straight into / out of a host-vendor rank's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostDirect {
    /// Direct for a pair of different vendors where one rank is the host vendor (unless
    /// `FLAGCX_P2P_DISABLE` is set): the other rank maps the host rank's buffers and copies
    /// device↔host in one step instead of two through the staging ring.
    Auto,
    /// Direct for every staged pair where a rank is the host vendor, `FLAGCX_P2P_DISABLE` or
    /// not (two host ranks: the lower one copies). For tests and comparisons.
    On,
    /// Never: staged pairs always go through the ring.
    Off,
}

impl HostDirect {
    /// Wire code (all-gathered with the peer info).
    pub fn code(self) -> u8 {
        match self {
            HostDirect::Auto => 0,
            HostDirect::On => 1,
            HostDirect::Off => 2,
        }
    }

    /// Inverse of [`HostDirect::code`].
    pub fn from_code(c: u8) -> Option<Self> {
        [HostDirect::Auto, HostDirect::On, HostDirect::Off]
            .into_iter()
            .find(|x| x.code() == c)
    }
}

/// Tunables of a communicator. [`Config::from_env`] reads them from `FLAGCX_*` variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// How long bootstrap waits for all ranks (`FLAGCX_BOOTSTRAP_TIMEOUT_MS`, default 30 s).
    pub bootstrap_timeout: Duration,
    /// Force the staged transport for every pair (`FLAGCX_P2P_DISABLE=1`).
    pub p2p_disable: bool,
    /// Bytes of shared host memory per staged channel (`FLAGCX_P2P_BUFFSIZE`, default 32 MiB).
    pub buffsize: usize,
    /// Bytes per staged ring slot, the largest chunk (`FLAGCX_P2P_CHUNKSIZE`; default a quarter
    /// of the ring, at most 8 MiB). A message moves in chunks of about `1/split` of its size,
    /// 64 KiB to a slot.
    pub chunksize: usize,
    /// Chunks a staged message is cut into while each fits a slot (`FLAGCX_P2P_SPLIT`, default 8,
    /// 1–64): more chunks overlap the two sides' copies sooner; each costs a hand-over per side.
    pub split: usize,
    /// Fail an operation that makes no progress for this long (`FLAGCX_TIMEOUT_MS`; unset or 0:
    /// never). The pair is then unusable: its later operations fail at once. A progress thread
    /// blocked inside a vendor call this long (at least 250 ms) with operations in flight fails
    /// the whole communicator, as [`crate::Comm::abort`] would, with `Timeout`; a port proxy
    /// blocked that long with channels open fails its channels (`crate::port`).
    pub timeout: Option<Duration>,
    /// How callers' streams wait for operations
    /// (`FLAGCX_STREAM_JOIN=auto|memop|gate|hostfn|none`).
    pub join: StreamJoin,
    /// How often the proxy checks, while it has work, whether peers hung up
    /// (`FLAGCX_HEALTH_INTERVAL_MS`, default 10 ms): a dead peer is noticed within this.
    pub health_interval: Duration,
    /// Which rank of an IPC pair copies (`FLAGCX_P2P_IPC_COPIER=auto|sender|lower`, default
    /// auto). Ranks that disagree fall back to `sender` for their pair.
    pub ipc_copier: IpcCopier,
    /// How long a waiting thread (a [`crate::Request`] wait, the proxy between operations)
    /// spins before it sleeps (`FLAGCX_SPIN_US`). `None`: decided at [`crate::Comm::init`] by
    /// [`flagcx_adaptor::spin::default_spin`] (50 µs; spinners yield between polls below 8
    /// cores).
    pub spin: Option<Duration>,
    /// Direct copies for pairs with a host-vendor rank (`FLAGCX_P2P_HOST_DIRECT=auto|on|off`,
    /// default auto). Both ranks must allow it.
    pub host_direct: HostDirect,
    /// Stream-ordered small messages (`FLAGCX_P2P_STREAM=auto|on|off`, default auto): `on`
    /// wherever both ranks' runtimes can (64-bit stream memory operations, host registration,
    /// sized copies); `auto` and `off` never, until the path is measured with one rank per GPU
    /// (the same three choices as [`HostDirect`]; see `docs/architecture.md`). Either rank's
    /// `off` wins.
    pub streamed: HostDirect,
    /// How this rank enqueues its stream-ordered messages (`FLAGCX_P2P_STREAM_KERNEL=auto|on|off`,
    /// default auto): `auto` as the vendor's one operation per call (one kernel on CUDA) where
    /// the pair is on two devices and as separate stream operations where it shares one (two
    /// processes' spinning kernels take a GPU time slice each); `on` as one operation always
    /// (for checking that path on one GPU: ~2 ms per message there); `off` never. Only this
    /// rank's enqueueing changes: the pair's protocol is the same.
    pub stream_kernel: HostDirect,
    /// Late copies on IPC pairs (`FLAGCX_P2P_LATE_COPY=auto|on|off`, default auto): every
    /// message of the pair is copied by the stream of whichever rank posts it second, behind a
    /// wait for the first one's stream, which waits for that copy — no proxy copy and no join,
    /// so nothing waits behind work of its own process (see `transport::late`). `auto` takes it
    /// for every pair of two CUDA ranks (no proxy copy that the driver can hold behind a
    /// client's pageable copy on the legacy stream) and where either rank found its
    /// streams sharing one work queue ([`crate::Comm::streams_share_queue`]); `on` wherever
    /// both ranks' runtimes can (64-bit
    /// stream memory operations, host registration). Either rank's `off` wins.
    pub late_copy: HostDirect,
    /// Late copies: whether this rank names a new allocation at a freed one's addresses to its
    /// peer only once the peer unmapped the freed one, carrying the message through a stand-in
    /// meanwhile (`FLAGCX_P2P_LATE_NAMING=on|off`, default off; see `link::named`). Off until
    /// its wrong data with FlagCX's torch plugin on CUDA is understood (docs/reliability.md,
    /// "Late copies and freed buffers").
    pub late_naming: bool,
    /// Where a staged pair's ring lives (`FLAGCX_P2P_DEVICE_RING=auto|on|off`, default auto):
    /// `auto` in device memory where one rank maps the other's fd exports (a CUDA rank's memory
    /// imported by an OpenCL rank on NVIDIA's platform; see `link::devring`), placed by
    /// the exporter on the importer's GPU (the same GPU, or a peer its copies reach), for
    /// messages from 4 MiB; in shared host memory otherwise, and where setup fails; `on`
    /// also between ranks of one vendor that export and import fds, whatever their devices
    /// (what tests the protocol on the host vendor); `off` never. All ranks must agree.
    pub device_ring: HostDirect,
    /// Most bytes of host-vendor peers' memory a rank keeps mapped (and registered with its
    /// runtime) for direct copies (`FLAGCX_P2P_HOST_MAP_MAX`, default 16 GiB). Past it, buffers
    /// not yet mapped go through the ring. Mappings last as long as the communicator (a freed
    /// buffer's pages stay alive until then).
    pub host_map_max: usize,
    /// Bytes of a mapped host-vendor buffer registered with the runtime at a time
    /// (`FLAGCX_P2P_HOST_PIN_PIECE`, default 8 MiB): between pieces the rank's other driver
    /// calls get through, where one registration of a large buffer held them for its whole
    /// length (~0.5 ms per MiB on an H200 machine). Direct copies split at piece boundaries.
    /// On the H200, a CUDA + host broadcast's first 8 B iterations after 1 GiB buffers
    /// appeared averaged 0.42 / 1.8 / 11.9 ms with 2 / 8 / 32 MiB pieces (73 ms in one piece),
    /// and `sendrecv` at 1 GiB moved 43.9 / 47.7 / 50.0 GB/s.
    pub host_pin_piece: usize,
    /// Largest message sent eagerly through shared host memory (`FLAGCX_P2P_EAGER_MAX`, default
    /// 32 KiB, at most 64 KiB; 0 turns it off): between two ranks whose device memory the CPU
    /// addresses (host vendor on both sides), and on every staged pair. Such a send, posted
    /// on an idle stream, is copied into the receiver's channel by the calling thread (by the
    /// CPU, or by the runtime's blocking copy where device memory is not host addressable) and
    /// complete on return — in a group, at [`crate::Comm::group_end`]; the receiver copies it
    /// out on its own thread. The receiver's setting sizes its channel's eager slots (64 per
    /// direction); the smaller of the two settings applies.
    pub eager_max: usize,
    /// Whether the posting thread moves an IPC operation itself (`FLAGCX_P2P_IPC_CALLER=on|off`,
    /// default on). Outside a group, while nothing earlier of its pair and direction is with
    /// the proxy, the copier issues the copy on the caller's stream as soon as the peer's
    /// descriptor is there, and the other rank publishes its descriptor (on an idle stream);
    /// each waits up to the spin time for the peer (plus up to 2 ms while the copy of the
    /// message runs), then hands the rest to the proxy from where it stands.
    pub ipc_caller: bool,
    /// Whether a thread waiting for an operation ([`crate::Request::wait`]) runs the engine's
    /// passes itself where this rank's copies are CPU copies (host-addressable device memory:
    /// the host vendor), instead of sleeping while the proxy thread does them, for operations
    /// of 2 MiB or more (`comm::HELP_MIN_BYTES`, where the measurements are)
    /// (`FLAGCX_P2P_WAITER_PROGRESS=auto|on|off`). `None` (auto, the default): where this
    /// machine's ranks do not outnumber its cores — measured on 2 cores, it cuts a 2-rank
    /// blocking 64 KiB exchange by a third, but costs 4 ranks 5–7%, which then compete for
    /// the cores among themselves. The proxy thread naps while waiters drive. Ranks of other
    /// vendors never drive: their vendor calls may block, which only the proxy may do
    /// (`crate::guard`).
    pub waiter_progress: Option<bool>,
    /// How long a small message's post waits for the operation its stream is held behind by
    /// this communicator's last join (`FLAGCX_P2P_REJOIN_US`, default 1000, 0: never), so that
    /// it goes eagerly instead of following that operation through the proxy. At a gate
    /// (OpenCL streams): messages up to 1 KiB, once per gate, so behind a peer that does not
    /// answer only the first post waits. Behind a stream memory wait: messages up to 1 KiB, or
    /// any eager size where the CPU copies eager messages (the host vendor), at most once per
    /// ten such waits while the joins pile up.
    pub rejoin_wait: Duration,
    /// Each rank prints where its operations spent their time when its communicator is
    /// destroyed (`FLAGCX_PROFILE` set to anything, default off).
    pub profile: bool,
    /// The network transport stages every message through pinned host buffers, even where
    /// device memory is host addressable or UCX takes it as it is
    /// (`FLAGCX_NET_STAGING=auto|always`, default auto: only where neither holds). For
    /// testing the staging path.
    pub net_staging: bool,
    /// The reductions' algorithm, forced (`FLAGCX_REDUCE_ALGO=auto|ring|direct|scatter`, default auto:
    /// [`crate::reduction::choose`] decides from the ranks, count and type). Must be set alike
    /// on every rank.
    pub reduce_algo: Option<Algorithm>,
    /// Whether a reduction's first message to and from each peer carries the call's type and
    /// operator, so that ranks that disagree fail (`FLAGCX_REDUCE_CHECK`, default on; costs
    /// one more message per peer and call: 0.2–0.3 µs on two host ranks' 8 B all-reduce, see
    /// `crate::reduction`). Must be set alike on every rank.
    pub reduce_check: bool,
    /// Small all-reduces of a job whose ranks are all host addressable and on one machine go
    /// through two slots in each pair's channel (`FLAGCX_REDUCE_SLOTS`, default on; the same
    /// on every rank): one cache line each way for the smallest, with the call's signature
    /// checked for free (`crate::reduction` module docs, `slots`). Off: eager messages.
    pub reduce_slots: bool,
    /// The reductions' ring slice in bytes, forced (`FLAGCX_REDUCE_SLICE`, default: from the
    /// job's vendors and the call, [`crate::reduction::ring_slice`], which also caps it so the
    /// scratch stays within [`crate::reduction::DEVICE_SCRATCH_BYTES`]). Must be set alike on
    /// every rank.
    pub reduce_slice: Option<usize>,
}

/// Defaults, documented in the README's environment table.
pub const DEFAULT_BUFFSIZE: usize = 32 << 20;
/// Default staged slot (largest chunk) size: a quarter of the ring, at most this.
pub const DEFAULT_CHUNKSIZE: usize = 8 << 20;
/// Default [`Config::split`].
pub const DEFAULT_SPLIT: usize = 8;
/// Default [`Config::host_map_max`].
pub const DEFAULT_HOST_MAP_MAX: usize = 16 << 30;
/// Default [`Config::host_pin_piece`].
pub const DEFAULT_HOST_PIN_PIECE: usize = 8 << 20;
/// Default [`Config::rejoin_wait`]: about three proxied small messages of two contexts taking
/// turns on one GPU (225–340 µs each on an H200).
pub const DEFAULT_REJOIN_WAIT: Duration = Duration::from_millis(1);
/// Default [`Config::eager_max`].
pub const DEFAULT_EAGER_MAX: usize = 32 << 10;
/// Largest allowed [`Config::eager_max`].
pub const MAX_EAGER_MAX: usize = 64 << 10;

impl Default for Config {
    fn default() -> Self {
        Config {
            bootstrap_timeout: Duration::from_secs(30),
            p2p_disable: false,
            buffsize: DEFAULT_BUFFSIZE,
            chunksize: DEFAULT_CHUNKSIZE,
            split: DEFAULT_SPLIT,
            timeout: None,
            join: StreamJoin::Auto,
            health_interval: Duration::from_millis(10),
            ipc_copier: IpcCopier::Auto,
            spin: None,
            host_direct: HostDirect::Auto,
            streamed: HostDirect::Auto,
            stream_kernel: HostDirect::Auto,
            late_copy: HostDirect::Auto,
            late_naming: false,
            device_ring: HostDirect::Auto,
            host_map_max: DEFAULT_HOST_MAP_MAX,
            host_pin_piece: DEFAULT_HOST_PIN_PIECE,
            eager_max: DEFAULT_EAGER_MAX,
            ipc_caller: true,
            waiter_progress: None,
            rejoin_wait: DEFAULT_REJOIN_WAIT,
            profile: false,
            net_staging: false,
            reduce_algo: None,
            reduce_slice: None,
            reduce_check: true,
            reduce_slots: true,
        }
    }
}

/// Parses a byte size: a number with an optional K/M/G suffix (powers of two).
pub fn parse_size(name: &str, v: &str) -> Result<usize> {
    let t = v.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1usize << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    num.trim()
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| CommError::config(name, v, "expected a byte count like 4194304, 512K or 4M"))
}

fn parse_bool(name: &str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(CommError::config(
            name,
            v,
            "expected 0/1, true/false, yes/no or on/off",
        )),
    }
}

/// `on`/`1` or `off`/`0` (case-insensitive, surrounding blanks ignored): the switches that
/// take exactly those words.
fn parse_on_off(name: &str, v: &str) -> Result<bool> {
    parse_choice(
        name,
        v,
        &[("on", true), ("1", true), ("off", false), ("0", false)],
        "expected on or off",
    )
}

/// One of the named `choices` (case-insensitive, surrounding blanks ignored).
fn parse_choice<T: Copy>(name: &str, v: &str, choices: &[(&str, T)], expected: &str) -> Result<T> {
    let key = v.trim().to_ascii_lowercase();
    choices
        .iter()
        .find(|(k, _)| *k == key)
        .map(|&(_, t)| t)
        .ok_or_else(|| CommError::config(name, v, expected))
}

fn parse_usize(name: &str, v: &str) -> Result<usize> {
    v.trim()
        .parse()
        .map_err(|_| CommError::config(name, v, "expected a non-negative integer"))
}

impl Config {
    /// Reads `FLAGCX_*` variables over the defaults.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`Config::from_env`], reading variables through `lookup` (blank values count as
    /// unset).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let var = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let mut c = Config::default();
        if let Some(v) = var("FLAGCX_BOOTSTRAP_TIMEOUT_MS") {
            c.bootstrap_timeout =
                Duration::from_millis(parse_usize("FLAGCX_BOOTSTRAP_TIMEOUT_MS", &v)? as u64);
        }
        if let Some(v) = var("FLAGCX_P2P_DISABLE") {
            c.p2p_disable = parse_bool("FLAGCX_P2P_DISABLE", &v)?;
        }
        if let Some(v) = var("FLAGCX_P2P_BUFFSIZE") {
            c.buffsize = parse_size("FLAGCX_P2P_BUFFSIZE", &v)?;
        }
        c.chunksize = match var("FLAGCX_P2P_CHUNKSIZE") {
            Some(v) => parse_size("FLAGCX_P2P_CHUNKSIZE", &v)?,
            None => (c.buffsize / 4 / 64 * 64).clamp(64, DEFAULT_CHUNKSIZE),
        };
        if let Some(v) = var("FLAGCX_P2P_SPLIT") {
            c.split = parse_usize("FLAGCX_P2P_SPLIT", &v)?;
        }
        if let Some(v) = var("FLAGCX_TIMEOUT_MS") {
            let ms = parse_usize("FLAGCX_TIMEOUT_MS", &v)? as u64;
            c.timeout = (ms > 0).then(|| Duration::from_millis(ms));
        }
        if let Some(v) = var("FLAGCX_STREAM_JOIN") {
            c.join = parse_choice(
                "FLAGCX_STREAM_JOIN",
                &v,
                &[
                    ("auto", StreamJoin::Auto),
                    ("memop", StreamJoin::MemOp),
                    ("gate", StreamJoin::Gate),
                    ("hostfn", StreamJoin::HostFn),
                    ("none", StreamJoin::None),
                ],
                "expected auto, memop, gate, hostfn or none",
            )?;
        }
        if let Some(v) = var("FLAGCX_P2P_IPC_COPIER") {
            c.ipc_copier = parse_choice(
                "FLAGCX_P2P_IPC_COPIER",
                &v,
                &[
                    ("auto", IpcCopier::Auto),
                    ("sender", IpcCopier::Sender),
                    ("lower", IpcCopier::Lower),
                ],
                "expected auto, sender or lower",
            )?;
        }
        if let Some(v) = var("FLAGCX_P2P_HOST_DIRECT") {
            c.host_direct = parse_choice(
                "FLAGCX_P2P_HOST_DIRECT",
                &v,
                &[
                    ("auto", HostDirect::Auto),
                    ("on", HostDirect::On),
                    ("1", HostDirect::On),
                    ("off", HostDirect::Off),
                    ("0", HostDirect::Off),
                ],
                "expected auto, on or off",
            )?;
        }
        let choices = [
            ("auto", HostDirect::Auto),
            ("on", HostDirect::On),
            ("off", HostDirect::Off),
        ];
        let what = "expected auto, on or off";
        if let Some(v) = var("FLAGCX_P2P_STREAM") {
            c.streamed = parse_choice("FLAGCX_P2P_STREAM", &v, &choices, what)?;
        }
        if let Some(v) = var("FLAGCX_P2P_STREAM_KERNEL") {
            c.stream_kernel = parse_choice("FLAGCX_P2P_STREAM_KERNEL", &v, &choices, what)?;
        }
        if let Some(v) = var("FLAGCX_P2P_LATE_COPY") {
            c.late_copy = parse_choice("FLAGCX_P2P_LATE_COPY", &v, &choices, what)?;
        }
        if let Some(v) = var("FLAGCX_P2P_LATE_NAMING") {
            c.late_naming = parse_on_off("FLAGCX_P2P_LATE_NAMING", &v)?;
        }
        if let Some(v) = var("FLAGCX_P2P_DEVICE_RING") {
            c.device_ring = parse_choice("FLAGCX_P2P_DEVICE_RING", &v, &choices, what)?;
        }
        if let Some(v) = var("FLAGCX_P2P_HOST_MAP_MAX") {
            c.host_map_max = parse_size("FLAGCX_P2P_HOST_MAP_MAX", &v)?;
        }
        if let Some(v) = var("FLAGCX_P2P_HOST_PIN_PIECE") {
            c.host_pin_piece = parse_size("FLAGCX_P2P_HOST_PIN_PIECE", &v)?;
            if c.host_pin_piece == 0 {
                return Err(CommError::config(
                    "FLAGCX_P2P_HOST_PIN_PIECE",
                    &v,
                    "expected a byte count above 0",
                ));
            }
        }
        c.profile = var("FLAGCX_PROFILE").is_some();
        if let Some(v) = var("FLAGCX_REDUCE_ALGO") {
            c.reduce_algo = parse_choice(
                "FLAGCX_REDUCE_ALGO",
                &v,
                &[
                    ("auto", None),
                    ("ring", Some(Algorithm::Ring)),
                    ("direct", Some(Algorithm::Direct)),
                    ("scatter", Some(Algorithm::Scatter)),
                ],
                "expected auto, ring, direct or scatter",
            )?;
        }
        if let Some(v) = var("FLAGCX_REDUCE_CHECK") {
            c.reduce_check = parse_bool("FLAGCX_REDUCE_CHECK", &v)?;
        }
        if let Some(v) = var("FLAGCX_REDUCE_SLICE") {
            c.reduce_slice = Some(parse_size("FLAGCX_REDUCE_SLICE", &v)?)
                .filter(|&s| s > 0)
                .map(Some)
                .ok_or_else(|| {
                    CommError::config("FLAGCX_REDUCE_SLICE", &v, "expected a byte count above 0")
                })?;
        }
        if let Some(v) = var("FLAGCX_REDUCE_SLOTS") {
            c.reduce_slots = parse_bool("FLAGCX_REDUCE_SLOTS", &v)?;
        }
        if let Some(v) = var("FLAGCX_NET_STAGING") {
            c.net_staging = parse_choice(
                "FLAGCX_NET_STAGING",
                &v,
                &[("auto", false), ("always", true)],
                "expected auto or always",
            )?;
        }
        if let Some(v) = var("FLAGCX_P2P_IPC_CALLER") {
            c.ipc_caller = parse_on_off("FLAGCX_P2P_IPC_CALLER", &v)?;
        }
        if let Some(v) = var("FLAGCX_P2P_WAITER_PROGRESS") {
            c.waiter_progress = parse_choice(
                "FLAGCX_P2P_WAITER_PROGRESS",
                &v,
                &[
                    ("auto", None),
                    ("on", Some(true)),
                    ("1", Some(true)),
                    ("off", Some(false)),
                    ("0", Some(false)),
                ],
                "expected auto, on or off",
            )?;
        }
        if let Some(v) = var("FLAGCX_P2P_REJOIN_US") {
            let us = parse_usize("FLAGCX_P2P_REJOIN_US", &v)? as u64;
            if us > 10_000_000 {
                return Err(CommError::config(
                    "FLAGCX_P2P_REJOIN_US",
                    &v,
                    "at most 10000000 (10 s)",
                ));
            }
            c.rejoin_wait = Duration::from_micros(us);
        }
        if let Some(v) = var("FLAGCX_P2P_EAGER_MAX") {
            c.eager_max = parse_size("FLAGCX_P2P_EAGER_MAX", &v)?;
        }
        if let Some(v) = var(flagcx_adaptor::spin::SPIN_ENV) {
            let spin = flagcx_adaptor::spin::parse_spin(&v)
                .map_err(|why| CommError::config("FLAGCX_SPIN_US", &v, why))?;
            c.spin = Some(spin);
        }
        if let Some(v) = var("FLAGCX_HEALTH_INTERVAL_MS") {
            let ms = parse_usize("FLAGCX_HEALTH_INTERVAL_MS", &v)? as u64;
            if ms == 0 || ms > 2000 {
                return Err(CommError::config(
                    "FLAGCX_HEALTH_INTERVAL_MS",
                    &v,
                    "must be between 1 and 2000",
                ));
            }
            c.health_interval = Duration::from_millis(ms);
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks the staged ring geometry and the eager limit.
    pub fn validate(&self) -> Result<()> {
        if self.eager_max > MAX_EAGER_MAX {
            return Err(CommError::config(
                "FLAGCX_P2P_EAGER_MAX",
                &self.eager_max.to_string(),
                format!("must be at most {MAX_EAGER_MAX} bytes (64K)"),
            ));
        }
        if self.chunksize == 0 || self.chunksize % 64 != 0 {
            return Err(CommError::config(
                "FLAGCX_P2P_CHUNKSIZE",
                &self.chunksize.to_string(),
                "must be a non-zero multiple of 64",
            ));
        }
        if !(1..=64).contains(&self.split) {
            return Err(CommError::config(
                "FLAGCX_P2P_SPLIT",
                &self.split.to_string(),
                "must be between 1 and 64 chunks",
            ));
        }
        if self.buffsize < 2 * self.chunksize || self.buffsize / self.chunksize > 1024 {
            return Err(CommError::config(
                "FLAGCX_P2P_BUFFSIZE",
                &self.buffsize.to_string(),
                format!(
                    "must hold between 2 and 1024 chunks of {} bytes",
                    self.chunksize
                ),
            ));
        }
        Ok(())
    }

    /// Slots in a staged ring.
    pub fn slots(&self) -> usize {
        self.buffsize / self.chunksize
    }
}

/// Where this process sits in the job: rank, size, local rank, and the job's id.
#[derive(Debug, Clone)]
pub struct RankEnv {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub nranks: usize,
    /// Rank among the processes of this node (picks the device by default).
    pub local_rank: usize,
    /// The job's id.
    pub id: UniqueId,
    /// Which launcher's variables were used (`flagcx`, `torchrun`, `openmpi`, `slurm`).
    pub source: &'static str,
}

/// The launchers whose variables place a process in a job, in the order [`RankEnv`] reads
/// them: each one's rank, size and local-rank variables, and its name.
const LAUNCHERS: [(&str, &str, &str, &str); 4] = [
    (
        "FLAGCX_RANK",
        "FLAGCX_NRANKS",
        "FLAGCX_LOCAL_RANK",
        "flagcx",
    ),
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun"),
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "openmpi",
    ),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "slurm"),
];

impl RankEnv {
    /// Reads the rank from `FLAGCX_RANK`/`FLAGCX_NRANKS`/`FLAGCX_UNIQUE_ID` (as `flagcx-run`
    /// sets them), else torchrun's `RANK`/`WORLD_SIZE`/`LOCAL_RANK`, else Open MPI's
    /// `OMPI_COMM_WORLD_*`, else Slurm's `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID` (srun).
    /// Without `FLAGCX_UNIQUE_ID` the id is derived from the launcher's
    /// job identifier (see [`UniqueId::derived`]).
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok().filter(|v| !v.trim().is_empty()))
    }

    /// Whether a launcher put this process in a job: the rank and size variables of
    /// `flagcx-run`, torchrun, Open MPI or Slurm (those [`RankEnv::from_env`] reads) are set.
    /// Programs that start their own ranks when run alone (`flagcx-perf`, the examples) ask
    /// this, so that `mpirun -np 2 flagcx-perf` is one job of two ranks, not two jobs.
    pub fn launched() -> bool {
        Self::launched_by(|name| std::env::var(name).ok())
    }

    /// [`RankEnv::launched`] over any variable lookup.
    pub fn launched_by(var: impl Fn(&str) -> Option<String>) -> bool {
        let set = |n: &str| var(n).is_some_and(|v| !v.trim().is_empty());
        LAUNCHERS.iter().any(|&(r, n, _, _)| set(r) && set(n))
    }

    /// [`RankEnv::from_env`] over any variable lookup (tests pass a map).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let var = |n: &str| var(n).filter(|v| !v.trim().is_empty());
        let get = |n: &str| var(n).map(|v| parse_usize(n, &v)).transpose();
        let mut found = None;
        for &(rank_var, size_var, local_var, source) in &LAUNCHERS {
            if let (Some(r), Some(n)) = (get(rank_var)?, get(size_var)?) {
                found = Some((r, n, get(local_var)?.unwrap_or(r), source));
                break;
            }
        }
        let Some((rank, nranks, local, source)) = found else {
            return Err(CommError::Bootstrap(
                "no rank in the environment: set FLAGCX_RANK, FLAGCX_NRANKS and \
                 FLAGCX_UNIQUE_ID (flagcx-run does), or run under torchrun or mpirun"
                    .into(),
            ));
        };
        if nranks == 0 || rank >= nranks {
            return Err(CommError::config(
                "rank",
                &rank.to_string(),
                format!("not in 0..{nranks}"),
            ));
        }
        let id = match var("FLAGCX_UNIQUE_ID") {
            Some(v) => v.parse()?,
            None => {
                let job = match source {
                    "torchrun" => var("TORCHELASTIC_RUN_ID").or_else(|| {
                        Some(format!("{}:{}", var("MASTER_ADDR")?, var("MASTER_PORT")?))
                    }),
                    "openmpi" => var("OMPI_MCA_orte_ess_jobid").or_else(|| var("PMIX_NAMESPACE")),
                    "slurm" => var("SLURM_JOB_ID")
                        .map(|j| format!("{j}.{}", var("SLURM_STEP_ID").unwrap_or_default())),
                    _ => None,
                }
                .ok_or_else(|| {
                    CommError::Bootstrap(format!(
                        "FLAGCX_UNIQUE_ID is not set and no {source} job identifier was found"
                    ))
                })?;
                UniqueId::derived(&format!("{source}:{job}"))
            }
        };
        let id = match (id.root(), root_from(&var, source)?) {
            (None, Some(root)) => id.with_root(root),
            _ => id,
        };
        Ok(RankEnv {
            rank,
            nranks,
            local_rank: local,
            id,
            source,
        })
    }
}

/// The root address for a job over several hosts: `FLAGCX_ROOT_ADDR` (`host:port`), or with
/// `FLAGCX_BOOTSTRAP=tcp` under torchrun `MASTER_ADDR` and `MASTER_PORT` + 1 (torch's own
/// store listens on `MASTER_PORT`). `None`: the job stays on one host (abstract sockets).
fn root_from(
    var: &dyn Fn(&str) -> Option<String>,
    source: &str,
) -> Result<Option<std::net::SocketAddr>> {
    let resolve = |name: &str, v: &str| {
        use std::net::ToSocketAddrs;
        v.trim()
            .to_socket_addrs()
            .map_err(|e| CommError::config(name, v, format!("cannot resolve it: {e}")))?
            .next()
            .ok_or_else(|| CommError::config(name, v, "resolves to no address"))
            .map(Some)
    };
    if let Some(v) = var("FLAGCX_ROOT_ADDR") {
        return resolve("FLAGCX_ROOT_ADDR", &v);
    }
    match var("FLAGCX_BOOTSTRAP").as_deref().map(str::trim) {
        None | Some("unix") => Ok(None),
        Some("tcp") => {
            let (Some(a), Some(p), "torchrun") = (var("MASTER_ADDR"), var("MASTER_PORT"), source)
            else {
                return Err(CommError::config(
                    "FLAGCX_BOOTSTRAP",
                    "tcp",
                    "needs FLAGCX_ROOT_ADDR=host:port (or torchrun's MASTER_ADDR and MASTER_PORT)",
                ));
            };
            let port = parse_usize("MASTER_PORT", &p)?
                .checked_add(1)
                .filter(|&p| p <= u16::MAX as usize)
                .ok_or_else(|| CommError::config("MASTER_PORT", &p, "no port above it"))?;
            resolve("MASTER_ADDR", &format!("{a}:{port}"))
        }
        Some(other) => Err(CommError::config(
            "FLAGCX_BOOTSTRAP",
            other,
            "expected unix or tcp",
        )),
    }
}

/// How a reduction moves its data (see `crate::reduction`); `FLAGCX_REDUCE_ALGO` forces one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Reduce-scatter around the ring, then all-gather (or gather to the root).
    Ring,
    /// Every block to every rank that needs it at once, combined in rank order.
    Direct,
    /// Each rank's segment from every rank at once, combined in rank order on its owner, then
    /// every combined segment to every rank (or to the root) at once: two dependent exchanges
    /// instead of the ring's `2(n − 1)`, and the ring's traffic.
    Scatter,
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "ring" => Ok(Algorithm::Ring),
            "direct" => Ok(Algorithm::Direct),
            "scatter" => Ok(Algorithm::Scatter),
            _ => Err(format!("expected ring, direct or scatter, got {s:?}")),
        }
    }
}

#[cfg(test)]
mod tests;
