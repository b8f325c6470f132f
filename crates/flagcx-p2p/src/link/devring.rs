//! Device rings: a staged pair's slots in device memory instead of shared host memory.
//!
//! Two runtimes on one GPU still cannot open each other's IPC handles, but some can map the
//! other's memory through a file descriptor: NVIDIA's OpenCL platform imports a CUDA VMM
//! allocation (`cl_khr_external_memory_opaque_fd`,
//! [`flagcx_adaptor::Capabilities::ipc_fd_foreign`]). Then the
//! staged protocol ([`super::staged`]: the same slots, `Tail` and `Head` in the shared channel,
//! the same chunking) runs with each chunk copied device→device into and out of a ring in the
//! exporter's memory — measured 1.2–1.5 TB/s per copy on one H100 against the 55 GB/s of the
//! pinned host copies a host ring costs (`benches/probes/ocl_cuda_extmem.c`).
//!
//! **Setup.** Whether a pair has one is decided from both ranks' [`PeerInfo`] alone
//! ([`exporter`]), so both agree without asking. The exporter allocates one shareable buffer of
//! twice the ring's bytes on the importer's GPU (`mem_alloc_shareable_on`: a runtime imports
//! only memory on its own device, so with the ranks on two GPUs the exporter's copies cross
//! to the importer's GPU and the importer's stay local), exports it (`ipc_export_fd`) and attaches
//! the fd to its channel descriptor; the importer maps it (`ipc_import_fd`) and answers with a
//! [`Tag::DevRing`] verdict. Where the allocation, export or import fails (another driver's
//! fds, no memory), both ranks keep the host ring, which every staged pair has anyway; the
//! reason is logged. The exporter's sends use the first half, the importer's the second.
//!
//! **Teardown.** The exporter frees its allocation and the importer closes its mapping once
//! their streams are idle; the runtimes keep the memory until both have.

use flagcx_adaptor::{DeviceAdaptor, DevicePtr};

use crate::bootstrap::Bootstrap;
use crate::config::HostDirect;
use crate::error::{CommError, Result};
use crate::op::Dir;
use crate::peer::{PeerInfo, TransportKind};
use crate::wire::Tag;

/// The smallest message that goes through a pair's device ring; smaller ones take the host
/// ring, whose chunk counters the device ring shares (a slot of either is free once its
/// chunk index is `slots` behind the receiver's `Head`, whichever ring earlier chunks used).
///
/// Two processes on one GPU pay ~150 µs each time the GPU turns from one's device→device
/// copy to the other's: `benches/probes/ocl_cuda_extmem.c`, 32 KiB copies taking turns,
/// 306–310 µs per round on an H100 and an H200 whether either side, both or neither touches
/// the shared memory, against 32–35 µs for the host ring's D2H and host→device write. So on
/// one GPU the device ring loses below a few MiB (2 MiB pingpong 437 µs against 346 through
/// host memory) and wins above (8 MiB 455 against 636, 512 MiB 92 GB/s against 48). With the
/// ranks on two GPUs no GPU turns between them; the same threshold holds there until measured.
pub(crate) const MIN_BYTES: usize = 4 << 20;

/// A staged pair's ring in device memory, as one rank sees it.
#[derive(Debug)]
pub(crate) struct DevRing {
    /// This rank's address of the allocation (its own, or its mapping of the peer's).
    base: DevicePtr,
    /// Whether this rank allocated it (and frees it) or imported it (and closes it).
    exported: bool,
    /// Bytes of one direction's ring: slots × slot size, as in the host ring.
    half: u64,
}

impl DevRing {
    /// The device address of slot `chunk % slots` of direction `dir` (slots of `slot` bytes,
    /// `half / slot` of them).
    pub(crate) fn slot(&self, dir: Dir, chunk: u64, slot: usize) -> DevicePtr {
        let slots = self.half / slot as u64;
        // The exporter's sends take the first half, the importer's the second.
        let second = (dir == Dir::Send) != self.exported;
        DevicePtr(self.base.0 + second as u64 * self.half + (chunk % slots) * slot as u64)
    }

    /// Frees or closes the ring; once.
    ///
    /// # Safety
    /// No copy of this rank's may still use it (both proxy streams idle), and nothing may use
    /// the ring afterwards.
    pub(crate) unsafe fn release<A: DeviceAdaptor>(&self, adaptor: &A) {
        // SAFETY: as the caller promises; ours to free or close, once.
        let r = unsafe {
            if self.exported {
                adaptor.mem_free(self.base)
            } else {
                adaptor.ipc_close(self.base)
            }
        };
        if let Err(e) = r {
            tracing::warn!("releasing a device ring: {e}");
        }
    }
}

/// Which rank of the pair `a`–`b` exports a device ring for it (`None`: the pair keeps its
/// ring in host memory). Symmetric in its two ranks; `mode` is this rank's
/// `FLAGCX_P2P_DEVICE_RING` (all ranks must agree: the channel descriptors check it).
pub(crate) fn exporter(
    a: &PeerInfo,
    b: &PeerInfo,
    transport: Option<TransportKind>,
    mode: HostDirect,
) -> Option<usize> {
    if transport != Some(TransportKind::Staged) || mode == HostDirect::Off {
        return None;
    }
    // Another runtime imports memory on its own device, so the exporter places the ring on
    // the importer's GPU (`offer`; it fails, and the pair keeps the host ring, where that GPU is
    // not the exporter's to allocate on). The forced mode tests the protocol between ranks of
    // one vendor (the host vendor's memfds), whatever the device.
    let imports = |x: &PeerInfo, y: &PeerInfo| {
        let foreign = x.vendor != y.vendor
            && y.caps.ipc_fd_foreign
            && x.host_id == y.host_id
            && y.pci_bus_id.is_some();
        let same = mode == HostDirect::On && x.vendor == y.vendor && y.caps.ipc_fd;
        x.caps.ipc_fd && (foreign || same)
    };
    let (lo, hi) = if a.rank < b.rank { (a, b) } else { (b, a) };
    if imports(lo, hi) {
        Some(lo.rank)
    } else if imports(hi, lo) {
        Some(hi.rank)
    } else {
        None
    }
}

/// What a pair's device ring needs: which rank exports it, that rank's vendor, and the
/// importer's PCI bus id (the device the ring must live on; `None`: the exporter's own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) exporter: usize,
    pub(crate) vendor: flagcx_adaptor::Vendor,
    pub(crate) near: Option<String>,
}

impl Plan {
    /// The plan for the pair `me`–`peer`, where it has a device ring ([`exporter`]).
    pub(crate) fn of(
        me: &PeerInfo,
        peer: &PeerInfo,
        transport: Option<TransportKind>,
        mode: HostDirect,
    ) -> Option<Plan> {
        let x = exporter(me, peer, transport, mode)?;
        let (exp, imp) = if x == me.rank { (me, peer) } else { (peer, me) };
        Some(Plan {
            exporter: x,
            vendor: exp.vendor,
            near: imp.pci_bus_id.clone(),
        })
    }
}

/// The exporter's offer for one pair: its allocation, on the device whose PCI bus id is
/// `near` (its own where `None`), and the fd to send (`Err` with the reason where it could not
/// make one: then the pair keeps the host ring).
pub(crate) fn offer<A: DeviceAdaptor>(
    adaptor: &A,
    half: usize,
    near: Option<&str>,
) -> std::result::Result<(DevRing, std::os::fd::OwnedFd), String> {
    let device = match near {
        None => adaptor.device(),
        Some(bus) => {
            let count = adaptor.device_count().map_err(|e| e.to_string())?;
            let here = |i: usize| adaptor.properties(i).ok().and_then(|p| p.pci_bus_id);
            (0..count)
                .find(|&i| here(i).as_deref() == Some(bus))
                .ok_or_else(|| format!("the peer's GPU {bus} is not one this process can use"))?
        }
    };
    let base = adaptor
        .mem_alloc_shareable_on(2 * half, device)
        .map_err(|e| {
            format!(
                "allocating {} MiB on device {device}: {e}",
                (2 * half) >> 20
            )
        })?;
    match adaptor.ipc_export_fd(base) {
        Ok(h) => Ok((
            DevRing {
                base,
                exported: true,
                half: half as u64,
            },
            h.fd,
        )),
        Err(e) => {
            // SAFETY: allocated just above, never used.
            let _ = unsafe { adaptor.mem_free(base) };
            Err(format!("exporting it: {e}"))
        }
    }
}

/// The importer's side: maps the exporter's fd (of `size` bytes, from a `vendor` rank), tells
/// it whether that worked, and returns the ring (`None`: the host ring it is).
pub(crate) fn accept<A: DeviceAdaptor>(
    adaptor: &A,
    boot: &Bootstrap,
    q: usize,
    handle: flagcx_adaptor::IpcFdHandle,
    half: usize,
) -> Result<Option<DevRing>> {
    let mapped = if handle.size < 2 * half {
        Err(format!(
            "the export has {} bytes, not {}",
            handle.size,
            2 * half
        ))
    } else {
        adaptor.ipc_import_fd(&handle).map_err(|e| e.to_string())
    };
    boot.send(q, Tag::DevRing, &[mapped.is_ok() as u8], &[])?;
    Ok(match mapped {
        Ok(base) => {
            tracing::info!(
                peer = q,
                "the staging ring with rank {q} is in device memory rank {q} exported"
            );
            Some(DevRing {
                base,
                exported: false,
                half: half as u64,
            })
        }
        Err(why) => {
            tracing::warn!(
                peer = q,
                "rank {q}'s device ring could not be mapped here ({why}); staging through host memory"
            );
            None
        }
    })
}

/// The exporter's side, once every channel is connected: keeps the ring if peer `q` mapped it,
/// frees it otherwise.
pub(crate) fn settle<A: DeviceAdaptor>(
    adaptor: &A,
    boot: &Bootstrap,
    q: usize,
    ring: DevRing,
) -> Result<Option<DevRing>> {
    let verdict = boot.recv(q, Tag::DevRing).map(|(v, _)| v);
    if matches!(verdict.as_deref(), Ok([1])) {
        tracing::info!(
            peer = q,
            "the staging ring with rank {q} is in device memory this rank exported"
        );
        return Ok(Some(ring));
    }
    // SAFETY: the peer did not map it, or is gone, or answered nonsense (then setup fails):
    // no copy was issued on it, and nothing uses it afterwards.
    unsafe { ring.release(adaptor) };
    match verdict?.as_slice() {
        [0] => Ok(None),
        other => Err(CommError::Protocol(format!(
            "rank {q} answered a device ring offer with {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::IpcCopier;
    use flagcx_adaptor::Capabilities;
    use flagcx_adaptor::Vendor;

    fn info(rank: usize, vendor: Vendor, bus: Option<&str>, caps: Capabilities) -> PeerInfo {
        PeerInfo {
            rank,
            vendor,
            device: 0,
            pci_bus_id: bus.map(str::to_string),
            host_id: "h/1".into(),
            pid: 42,
            caps,
            p2p_disable: false,
            ipc_copier: IpcCopier::Auto,
            host_direct: HostDirect::Auto,
            streamed: HostDirect::Auto,
            late_copy: HostDirect::Auto,
            shares_queue: false,
        }
    }

    #[test]
    fn the_exporting_rank_is_agreed_and_needs_an_importer_on_its_device() {
        let cuda = Capabilities {
            ipc_fd: true,
            ..Default::default()
        };
        let ocl = Capabilities {
            ipc_fd_foreign: true,
            ..Default::default()
        };
        let s = Some(TransportKind::Staged);
        let gpu0 = Some("0000:19:00.0");
        let (c, o) = (
            info(1, Vendor::Cuda, gpu0, cuda),
            info(0, Vendor::OpenCl, gpu0, ocl),
        );
        for mode in [HostDirect::Auto, HostDirect::On] {
            assert_eq!(exporter(&c, &o, s, mode), Some(1), "CUDA exports");
            assert_eq!(exporter(&o, &c, s, mode), Some(1), "symmetric");
        }
        assert_eq!(exporter(&c, &o, s, HostDirect::Off), None);
        assert_eq!(
            exporter(&c, &o, Some(TransportKind::Ipc), HostDirect::On),
            None
        );
        // Another GPU: the CUDA rank places the ring there (the plan names that GPU).
        let far = info(0, Vendor::OpenCl, Some("0000:3b:00.0"), ocl);
        assert_eq!(exporter(&c, &far, s, HostDirect::Auto), Some(1));
        let plan = Plan::of(&far, &c, s, HostDirect::Auto).expect("a plan");
        assert_eq!(plan.near.as_deref(), Some("0000:3b:00.0"));
        assert_eq!((plan.exporter, plan.vendor), (1, Vendor::Cuda));
        // An OpenCL platform that imports nothing, or a device with no bus id (a CPU).
        let pocl = info(0, Vendor::OpenCl, gpu0, Capabilities::default());
        assert_eq!(exporter(&c, &pocl, s, HostDirect::Auto), None);
        let cpu = info(0, Vendor::OpenCl, None, ocl);
        assert_eq!(exporter(&c, &cpu, s, HostDirect::Auto), None);
        // Another host: no ring at all.
        let mut away = info(0, Vendor::OpenCl, gpu0, ocl);
        away.host_id = "h/2".into();
        assert_eq!(exporter(&c, &away, s, HostDirect::Auto), None);
        // One vendor: only when forced, and then the lower rank exports.
        let (h0, h1) = (
            info(0, Vendor::Host, None, cuda),
            info(1, Vendor::Host, None, cuda),
        );
        assert_eq!(exporter(&h1, &h0, s, HostDirect::Auto), None);
        assert_eq!(exporter(&h1, &h0, s, HostDirect::On), Some(0));
    }

    #[test]
    fn each_direction_has_its_own_half() {
        let ring = |exported| DevRing {
            base: DevicePtr(1 << 40),
            exported,
            half: 8 * 4096,
        };
        let (x, i) = (ring(true), ring(false));
        for chunk in [0u64, 3, 8, 11] {
            assert_eq!(
                x.slot(Dir::Send, chunk, 4096),
                i.slot(Dir::Recv, chunk, 4096)
            );
            assert_eq!(
                x.slot(Dir::Recv, chunk, 4096),
                i.slot(Dir::Send, chunk, 4096)
            );
        }
        assert_eq!(x.slot(Dir::Send, 9, 4096).0, (1 << 40) + 4096, "wraps");
        assert_eq!(x.slot(Dir::Recv, 0, 4096).0, (1 << 40) + 8 * 4096);
    }
}
