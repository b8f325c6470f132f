//! What ranks tell each other at setup, and how a pair picks its transport.

use flagcx_adaptor::{Capabilities, DeviceAdaptor, Vendor};

use crate::config::{Config, HostDirect, IpcCopier};
use crate::error::{CommError, Result};
use crate::wire::{Reader, Writer};

/// One rank's description, all-gathered at setup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// The rank.
    pub rank: usize,
    /// Its vendor.
    pub vendor: Vendor,
    /// Its device index within the vendor.
    pub device: usize,
    /// The device's PCI bus id, if it has one.
    pub pci_bus_id: Option<String>,
    /// Identifies the machine (hostname + boot id): IPC only works within one.
    pub host_id: String,
    /// Its process id.
    pub pid: u32,
    /// Its adaptor's capabilities.
    pub caps: Capabilities,
    /// Whether it forces the staged transport.
    pub p2p_disable: bool,
    /// Its `FLAGCX_P2P_IPC_COPIER` setting.
    pub ipc_copier: IpcCopier,
    /// Its `FLAGCX_P2P_HOST_DIRECT` setting.
    pub host_direct: HostDirect,
    /// Its `FLAGCX_P2P_STREAM` setting.
    pub streamed: HostDirect,
    /// Its `FLAGCX_P2P_LATE_COPY` setting.
    pub late_copy: HostDirect,
    /// Whether its streams share one work queue (see `join::waits_hold_other_streams`); set
    /// by setup before the all-gather.
    pub shares_queue: bool,
}

/// How many capability bits the peer information carries (`caps_bits`).
const CAP_BITS: u32 = 14;

fn caps_bits(c: &Capabilities) -> u32 {
    [
        c.ipc_bytes,
        c.ipc_fd,
        c.host_register,
        c.peer_access,
        c.host_functions,
        c.stream_mem_ops,
        c.stream_mem_ops_64,
        c.capture_mode,
        c.host_addressable,
        c.host_pin,
        c.sized_copy,
        c.host_gates,
        c.concurrent_processes,
        c.ipc_fd_foreign,
    ]
    .iter()
    .enumerate()
    .fold(0, |acc, (i, &b)| acc | ((b as u32) << i))
}

fn bits_caps(b: u32) -> Capabilities {
    let f = |i: u32| b & (1 << i) != 0;
    Capabilities {
        ipc_bytes: f(0),
        ipc_fd: f(1),
        host_register: f(2),
        peer_access: f(3),
        host_functions: f(4),
        stream_mem_ops: f(5),
        stream_mem_ops_64: f(6),
        capture_mode: f(7),
        host_addressable: f(8),
        host_pin: f(9),
        sized_copy: f(10),
        host_gates: f(11),
        concurrent_processes: f(12),
        ipc_fd_foreign: f(13),
        // Carried beside the bits (`PeerInfo::encode`).
        reduce_types: 0,
    }
}

pub use crate::bootstrap::host_id;

impl PeerInfo {
    /// This process's description.
    pub fn local<A: DeviceAdaptor>(rank: usize, adaptor: &A, config: &Config) -> Result<Self> {
        let props = adaptor.properties(adaptor.device())?;
        Ok(PeerInfo {
            rank,
            vendor: adaptor.vendor(),
            device: adaptor.device(),
            pci_bus_id: props.pci_bus_id,
            host_id: host_id(),
            pid: std::process::id(),
            caps: adaptor.capabilities(),
            p2p_disable: config.p2p_disable,
            ipc_copier: config.ipc_copier,
            host_direct: config.host_direct,
            streamed: config.streamed,
            late_copy: config.late_copy,
            shares_queue: false,
        })
    }

    /// Encodes for the all-gather.
    pub fn encode(&self) -> Vec<u8> {
        Writer::new()
            .u32(self.rank as u32)
            .u8(self.vendor.code())
            .u32(self.device as u32)
            .str(self.pci_bus_id.as_deref().unwrap_or(""))
            .str(&self.host_id)
            .u32(self.pid)
            .u32(caps_bits(&self.caps))
            .u32(u32::from(self.caps.reduce_types))
            .u8(self.p2p_disable as u8)
            .u8(self.ipc_copier.code())
            .u8(self.host_direct.code())
            .u8(self.streamed.code())
            .u8(self.late_copy.code())
            .u8(self.shares_queue as u8)
            .finish()
    }

    /// Decodes [`PeerInfo::encode`]'s output; garbage is a protocol error.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = Reader::new(b, "peer info");
        let rank = r.u32()? as usize;
        let code = r.u8()?;
        let vendor = Vendor::from_code(code)
            .ok_or_else(|| CommError::Protocol(format!("peer info: unknown vendor code {code}")))?;
        let device = r.u32()? as usize;
        let bus = r.str()?;
        let host_id = r.str()?;
        let pid = r.u32()?;
        let bits = r.u32()?;
        if bits >> CAP_BITS != 0 {
            return Err(CommError::Protocol(format!(
                "peer info: unknown capability bits {bits:#x}"
            )));
        }
        let mut caps = bits_caps(bits);
        let types = r.u32()?;
        caps.reduce_types = u16::try_from(types)
            .ok()
            .filter(|t| t & !flagcx_adaptor::reduce::ALL_TYPES == 0)
            .ok_or_else(|| {
                CommError::Protocol(format!("peer info: unknown reduction types {types:#x}"))
            })?;
        let p2p_disable = match r.u8()? {
            0 => false,
            1 => true,
            x => return Err(CommError::Protocol(format!("peer info: flag {x}"))),
        };
        let code = r.u8()?;
        let ipc_copier = IpcCopier::from_code(code).ok_or_else(|| {
            CommError::Protocol(format!("peer info: unknown IPC copier code {code}"))
        })?;
        let code = r.u8()?;
        let host_direct = HostDirect::from_code(code).ok_or_else(|| {
            CommError::Protocol(format!("peer info: unknown host-direct code {code}"))
        })?;
        let code = r.u8()?;
        let streamed = HostDirect::from_code(code).ok_or_else(|| {
            CommError::Protocol(format!("peer info: unknown stream-order code {code}"))
        })?;
        let code = r.u8()?;
        let late_copy = HostDirect::from_code(code).ok_or_else(|| {
            CommError::Protocol(format!("peer info: unknown late-copy code {code}"))
        })?;
        let shares_queue = match r.u8()? {
            0 => false,
            1 => true,
            x => return Err(CommError::Protocol(format!("peer info: flag {x}"))),
        };
        r.end()?;
        Ok(PeerInfo {
            rank,
            vendor,
            device,
            pci_bus_id: (!bus.is_empty()).then_some(bus),
            host_id,
            pid,
            caps,
            p2p_disable,
            ipc_copier,
            host_direct,
            streamed,
            late_copy,
            shares_queue,
        })
    }

    /// Whether the two ranks use one physical device, whatever their vendors (a CUDA rank and
    /// an OpenCL rank on one GPU): the same PCI bus id on one host, or, where either has none,
    /// the same vendor's same device index.
    pub fn shares_device(&self, other: &PeerInfo) -> bool {
        self.host_id == other.host_id
            && match (&self.pci_bus_id, &other.pci_bus_id) {
                (Some(a), Some(b)) => a == b,
                _ => self.vendor == other.vendor && self.device == other.device,
            }
    }

    /// Whether the two ranks share a device that runs one process's work at a time (time
    /// slices of milliseconds between processes): [`Self::shares_device`], unless both ranks'
    /// runtimes run several processes' work at once (`Capabilities::concurrent_processes`).
    pub fn time_slices_with(&self, other: &PeerInfo) -> bool {
        self.shares_device(other) && !self.runs_at_once_with(other)
    }

    /// Whether both ranks' runtimes run several processes' work on one device at once.
    fn runs_at_once_with(&self, other: &PeerInfo) -> bool {
        self.caps.concurrent_processes && other.caps.concurrent_processes
    }

    fn same_device(&self, other: &PeerInfo) -> bool {
        self.vendor == other.vendor
            && self.host_id == other.host_id
            && match (&self.pci_bus_id, &other.pci_bus_id) {
                (Some(a), Some(b)) => a == b,
                _ => self.device == other.device,
            }
    }
}

/// For an IPC pair, whether the receiver of `sender → receiver` issues the copy itself (pulls
/// from the sender's buffer) instead of the sender pushing into its buffer. Both ranks compute
/// it from the same all-gathered facts, so they agree without talking.
pub fn receiver_copies(sender: &PeerInfo, receiver: &PeerInfo) -> bool {
    let resolve = |c: IpcCopier| match c {
        IpcCopier::Auto if sender.same_device(receiver) && !sender.runs_at_once_with(receiver) => {
            IpcCopier::Lower
        }
        IpcCopier::Auto => IpcCopier::Sender,
        c => c,
    };
    let (a, b) = (resolve(sender.ipc_copier), resolve(receiver.ipc_copier));
    a == IpcCopier::Lower && b == IpcCopier::Lower && receiver.rank < sender.rank
}

/// For a staged pair, the rank that copies straight into and out of the other's memory (the
/// direct path), if the pair takes it: the other rank must be the host vendor (its device memory
/// is a memfd any process can map) on the same machine, and both ranks must allow it. A device
/// rank beside a host rank copies; of two host ranks (only with `FLAGCX_P2P_HOST_DIRECT=on`),
/// the lower. Symmetric, so both ranks agree without talking.
pub fn direct_copier(a: &PeerInfo, b: &PeerInfo) -> Option<usize> {
    if choose_transport(a, b).0 != TransportKind::Staged || a.host_id != b.host_id {
        return None;
    }
    let allows = |x: &PeerInfo| match x.host_direct {
        HostDirect::Off => false,
        HostDirect::On => true,
        HostDirect::Auto => a.vendor != b.vendor && !a.p2p_disable && !b.p2p_disable,
    };
    if !(allows(a) && allows(b)) {
        return None;
    }
    match (a.vendor == Vendor::Host, b.vendor == Vendor::Host) {
        (true, true) => Some(a.rank.min(b.rank)),
        (true, false) => Some(b.rank),
        (false, true) => Some(a.rank),
        (false, false) => None,
    }
}

/// How a pair of ranks moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// The sender's copy engine writes into memory the receiver exported: one copy.
    Ipc,
    /// Through a ring of chunks in shared host memory: device→host, host→device, pipelined.
    Staged,
    /// Over the network (UCX): the ranks are on different hosts.
    Net,
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::Ipc => "ipc",
            TransportKind::Staged => "staged",
            TransportKind::Net => "net",
        })
    }
}

/// The transport for a pair, with the reason; symmetric, so both ranks agree without talking.
pub fn choose_transport(a: &PeerInfo, b: &PeerInfo) -> (TransportKind, &'static str) {
    if a.host_id != b.host_id {
        (TransportKind::Net, "different hosts")
    } else if a.p2p_disable || b.p2p_disable {
        (TransportKind::Staged, "FLAGCX_P2P_DISABLE is set")
    } else if a.vendor != b.vendor {
        (TransportKind::Staged, "different vendors")
    } else if !(a.caps.ipc_bytes && b.caps.ipc_bytes) {
        (TransportKind::Staged, "the vendor has no IPC handles")
    } else {
        (TransportKind::Ipc, "same vendor with IPC handles")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(rank: usize, vendor: Vendor) -> PeerInfo {
        PeerInfo {
            rank,
            vendor,
            device: 0,
            pci_bus_id: Some("0000:3b:00.0".into()),
            host_id: "h/1".into(),
            pid: 42,
            caps: Capabilities {
                ipc_bytes: true,
                stream_mem_ops: true,
                ..Default::default()
            },
            p2p_disable: false,
            ipc_copier: IpcCopier::Auto,
            host_direct: HostDirect::Auto,
            streamed: HostDirect::Auto,
            late_copy: HostDirect::Off,
            shares_queue: true,
        }
    }

    #[test]
    fn peer_info_round_trips_and_rejects_garbage() {
        let p = info(3, Vendor::Cuda);
        let b = p.encode();
        assert_eq!(PeerInfo::decode(&b).unwrap(), p);
        for cut in 0..b.len() {
            assert!(PeerInfo::decode(&b[..cut]).is_err());
        }
        let mut extra = b.clone();
        extra.push(0);
        assert!(PeerInfo::decode(&extra).is_err());
    }

    #[test]
    fn unknown_capability_bits_are_refused() {
        // The fuzz target insists that whatever decodes re-encodes to the same bytes; bits the
        // encoder never sets used to decode silently and broke that.
        let mut p = info(1, Vendor::Host);
        p.host_id = String::new();
        p.pci_bus_id = None;
        let mut b = p.encode();
        // The capability bits, then the reduction types, then six one-byte settings.
        let caps_at = b.len() - 14;
        let mut unknown = b.clone();
        unknown[caps_at + 1] |= 0x80; // bit 15: past CAP_BITS
        assert!(PeerInfo::decode(&unknown).is_err());
        // A reduction type bit past the last type.
        b[caps_at + 5] |= 0x04; // bit 10 of the types
        assert!(PeerInfo::decode(&b).is_err());
    }

    #[test]
    fn exactly_the_lower_rank_copies_when_both_agree() {
        let (mut a, mut b) = (info(0, Vendor::Cuda), info(1, Vendor::Cuda));
        // Same device, auto: rank 0 pushes to 1 and pulls from 1.
        assert!(receiver_copies(&b, &a));
        assert!(!receiver_copies(&a, &b));
        // Different devices, auto: each sender pushes.
        b.pci_bus_id = Some("0000:3c:00.0".into());
        assert!(!receiver_copies(&b, &a) && !receiver_copies(&a, &b));
        // Forced on: lower rank copies whatever the devices.
        a.ipc_copier = IpcCopier::Lower;
        b.ipc_copier = IpcCopier::Lower;
        assert!(receiver_copies(&b, &a) && !receiver_copies(&a, &b));
        // Disagreement falls back to the sender for both directions.
        b.ipc_copier = IpcCopier::Sender;
        assert!(!receiver_copies(&b, &a) && !receiver_copies(&a, &b));
        // Without bus ids the device index decides.
        let (mut c, mut d) = (info(2, Vendor::Host), info(5, Vendor::Host));
        c.pci_bus_id = None;
        d.pci_bus_id = None;
        assert!(receiver_copies(&d, &c));
        d.device = 3;
        assert!(!receiver_copies(&d, &c));
    }

    #[test]
    fn a_device_that_runs_processes_at_once_lets_each_sender_copy() {
        let (a, mut b) = (info(0, Vendor::Cuda), info(1, Vendor::Cuda));
        let mut a = a;
        assert!(a.time_slices_with(&b) && receiver_copies(&b, &a));
        // Only one side under MPS (cannot happen on one device, but must stay symmetric).
        a.caps.concurrent_processes = true;
        assert!(a.time_slices_with(&b) && b.time_slices_with(&a));
        assert!(receiver_copies(&b, &a) && !receiver_copies(&a, &b));
        // Both: the pair shares the device without time slices, and each sender copies.
        b.caps.concurrent_processes = true;
        assert!(a.shares_device(&b) && !a.time_slices_with(&b) && !b.time_slices_with(&a));
        assert!(!receiver_copies(&b, &a) && !receiver_copies(&a, &b));
        // An explicit choice still wins.
        a.ipc_copier = IpcCopier::Lower;
        b.ipc_copier = IpcCopier::Lower;
        assert!(receiver_copies(&b, &a));
        // The bit travels.
        assert_eq!(PeerInfo::decode(&b.encode()).unwrap(), b);
    }

    #[test]
    fn ranks_of_two_vendors_on_one_gpu_share_it() {
        let (c, o) = (info(0, Vendor::Cuda), info(1, Vendor::OpenCl));
        assert!(c.shares_device(&o) && o.shares_device(&c), "one bus id");
        let mut other = o.clone();
        other.pci_bus_id = Some("0000:3c:00.0".into());
        assert!(!c.shares_device(&other), "two GPUs");
        let mut far = o.clone();
        far.host_id = "h/2".into();
        assert!(!c.shares_device(&far), "another host");
        // Without bus ids only the same vendor's device index can tell.
        let (mut h0, mut h1) = (info(2, Vendor::Host), info(3, Vendor::Host));
        h0.pci_bus_id = None;
        h1.pci_bus_id = None;
        assert!(h0.shares_device(&h1));
        h1.device = 1;
        assert!(!h0.shares_device(&h1));
        let mut nobus = o.clone();
        nobus.pci_bus_id = None;
        assert!(!c.shares_device(&nobus), "PoCL's CPU device has no bus id");
    }

    #[test]
    fn the_device_rank_copies_directly_beside_a_host_rank() {
        let (c, h) = (info(0, Vendor::Cuda), info(1, Vendor::Host));
        assert_eq!(direct_copier(&c, &h), Some(0));
        assert_eq!(direct_copier(&h, &c), Some(0));
        // Neither side a host rank: no direct path.
        assert_eq!(direct_copier(&c, &info(1, Vendor::OpenCl)), None);
        // Either side saying off wins; so does P2P_DISABLE under auto.
        for f in [
            |p: &mut PeerInfo| p.host_direct = HostDirect::Off,
            |p: &mut PeerInfo| p.p2p_disable = true,
        ] {
            let mut h2 = h.clone();
            f(&mut h2);
            assert_eq!(direct_copier(&c, &h2), None);
            assert_eq!(direct_copier(&h2, &c), None);
        }
        // Different machines: nothing to map.
        let mut far = h.clone();
        far.host_id = "other/2".into();
        assert_eq!(direct_copier(&c, &far), None);
        // Two host ranks go IPC unless staged is forced; forced and `on`, the lower copies.
        let (mut a, mut b) = (info(3, Vendor::Host), info(2, Vendor::Host));
        assert_eq!(direct_copier(&a, &b), None, "an IPC pair");
        a.p2p_disable = true;
        assert_eq!(direct_copier(&a, &b), None, "auto needs different vendors");
        a.host_direct = HostDirect::On;
        b.host_direct = HostDirect::On;
        assert_eq!(direct_copier(&a, &b), Some(2));
        assert_eq!(direct_copier(&b, &a), Some(2));
    }

    #[test]
    fn transport_choice_is_symmetric() {
        let (c, h) = (info(0, Vendor::Cuda), info(1, Vendor::Host));
        assert_eq!(choose_transport(&c, &h).0, TransportKind::Staged);
        assert_eq!(choose_transport(&h, &c).0, TransportKind::Staged);
        assert_eq!(
            choose_transport(&c, &info(1, Vendor::Cuda)).0,
            TransportKind::Ipc
        );
        let mut off = info(1, Vendor::Cuda);
        off.p2p_disable = true;
        assert_eq!(choose_transport(&c, &off).0, TransportKind::Staged);
        assert_eq!(choose_transport(&off, &c).0, TransportKind::Staged);
    }
}
