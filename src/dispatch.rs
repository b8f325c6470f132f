//! [`Adaptor`]: one enum over the compiled-in vendors, dispatching [`DeviceAdaptor`] statically.

use flagcx_adaptor::{
    AdaptorError, Capabilities, CaptureMode, DeviceAdaptor, DeviceProperties, DevicePtr,
    EventHandle, GateHandle, HostFn, IpcFdHandle, IpcMemHandle, Result, SlotStep, StreamHandle,
    Vendor, WaitCondition,
};

/// Environment variable naming the vendor to use (`host`, `cuda`, `hip`, `opencl`).
pub const VENDOR_ENV: &str = "FLAGCX_VENDOR";
/// Environment variable naming the device index to open (default: the local rank's device, see
/// [`Adaptor::from_env`]).
pub const DEVICE_ENV: &str = "FLAGCX_DEVICE";

/// A device of any compiled-in vendor.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Adaptor {
    /// The host vendor.
    #[cfg(feature = "host")]
    Host(flagcx_host::HostAdaptor),
    /// NVIDIA CUDA.
    #[cfg(feature = "cuda")]
    Cuda(flagcx_cuda::CudaAdaptor),
    /// AMD HIP.
    #[cfg(feature = "hip")]
    Hip(flagcx_hip::HipAdaptor),
    /// OpenCL.
    #[cfg(feature = "opencl")]
    OpenCl(flagcx_opencl::OpenClAdaptor),
}

/// Runs `$body` with `$a` bound to the variant's adaptor, whatever the variant.
macro_rules! each {
    ($self:expr, $a:ident => $body:expr) => {
        match $self {
            #[cfg(feature = "host")]
            Adaptor::Host($a) => $body,
            #[cfg(feature = "cuda")]
            Adaptor::Cuda($a) => $body,
            #[cfg(feature = "hip")]
            Adaptor::Hip($a) => $body,
            #[cfg(feature = "opencl")]
            Adaptor::OpenCl($a) => $body,
        }
    };
}

impl Adaptor {
    /// Vendors compiled into this build, in detection order (GPUs first, host last).
    pub fn compiled_vendors() -> Vec<Vendor> {
        crate::COMPILED_VENDORS.to_vec()
    }

    /// Opens device `device` of `vendor`.
    pub fn open(vendor: Vendor, device: usize) -> Result<Self> {
        match vendor {
            #[cfg(feature = "host")]
            Vendor::Host => flagcx_host::HostAdaptor::open(device).map(Adaptor::Host),
            #[cfg(feature = "cuda")]
            Vendor::Cuda => flagcx_cuda::CudaAdaptor::open(device).map(Adaptor::Cuda),
            #[cfg(feature = "hip")]
            Vendor::Hip => flagcx_hip::HipAdaptor::open(device).map(Adaptor::Hip),
            #[cfg(feature = "opencl")]
            Vendor::OpenCl => flagcx_opencl::OpenClAdaptor::open(device).map(Adaptor::OpenCl),
            other => Err(AdaptorError::Unavailable {
                vendor: other,
                reason: format!(
                    "not compiled in: enable the `{}` feature of the `flagcx` crate",
                    other.name()
                ),
            }),
        }
    }

    /// Opens the vendor named by `FLAGCX_VENDOR`, else the first compiled-in vendor that has
    /// a device (GPUs before the host vendor). The device is `FLAGCX_DEVICE` if set, else the
    /// local rank's (`FLAGCX_LOCAL_RANK`, `LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`,
    /// `SLURM_LOCALID`) device,
    /// modulo the device count, in PCI bus order where every device reports a bus id, else 0 —
    /// so the ranks of a node spread over its devices, and ranks of different vendors count
    /// the same physical GPUs alike.
    pub fn from_env() -> Result<Self> {
        Self::from_env_for(None)
    }

    /// [`Adaptor::from_env`] for `vendor` where given (`FLAGCX_VENDOR` is then not read): the
    /// device is chosen the same way, so a caller that names the vendor still spreads the
    /// ranks of a node over its devices.
    pub fn from_env_for(vendor: Option<Vendor>) -> Result<Self> {
        let index = |name: &str| -> Result<Option<usize>> {
            match std::env::var(name) {
                Err(_) => Ok(None),
                Ok(v) => v.trim().parse().map(Some).map_err(|_| {
                    AdaptorError::invalid(
                        "Adaptor::from_env",
                        format!("{name}={v:?} is not a non-negative integer"),
                    )
                }),
            }
        };
        let explicit = index(DEVICE_ENV)?;
        let open = |device| match (vendor, std::env::var(VENDOR_ENV)) {
            (Some(v), _) => Self::open(v, device),
            (None, Ok(name)) if !name.trim().is_empty() => Self::open(name.parse()?, device),
            _ => Self::detect(device),
        };
        if let Some(d) = explicit {
            return open(d);
        }
        let first = open(0)?;
        let mut local = None;
        for name in [
            "FLAGCX_LOCAL_RANK",
            "LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "SLURM_LOCALID",
        ] {
            if let Some(v) = index(name)? {
                local = Some(v);
                break;
            }
        }
        let count = first.device_count()?;
        let Some(local) = local else {
            return Ok(first);
        };
        // Devices in PCI order where every one has a bus id: a CUDA rank and an OpenCL rank
        // of one node then count the same physical GPUs alike, so different local ranks land
        // on different GPUs whatever each runtime's own numbering.
        let pci: Vec<Option<String>> = (0..count)
            .map(|i| first.properties(i).ok().and_then(|p| p.pci_bus_id))
            .collect();
        match spread_device(local, &pci) {
            0 => Ok(first),
            d => Self::open(first.vendor(), d),
        }
    }

    /// The first compiled-in vendor whose device `device` opens.
    pub fn detect(device: usize) -> Result<Self> {
        let mut reasons = Vec::new();
        for vendor in Self::compiled_vendors() {
            match Self::open(vendor, device) {
                Ok(a) => return Ok(a),
                Err(e) if e.is_unavailable() => reasons.push(e.to_string()),
                Err(e) => return Err(e),
            }
        }
        Err(AdaptorError::Unavailable {
            vendor: Vendor::Host,
            reason: format!("no compiled-in vendor is usable: {}", reasons.join("; ")),
        })
    }
}

impl DeviceAdaptor for Adaptor {
    fn vendor(&self) -> Vendor {
        each!(self, a => a.vendor())
    }
    fn device(&self) -> usize {
        each!(self, a => a.device())
    }
    fn device_count(&self) -> Result<usize> {
        each!(self, a => a.device_count())
    }
    fn properties(&self, index: usize) -> Result<DeviceProperties> {
        each!(self, a => a.properties(index))
    }
    fn capabilities(&self) -> Capabilities {
        each!(self, a => a.capabilities())
    }
    fn mem_alloc(&self, size: usize) -> Result<DevicePtr> {
        each!(self, a => a.mem_alloc(size))
    }
    fn mem_alloc_shareable(&self, size: usize) -> Result<DevicePtr> {
        each!(self, a => a.mem_alloc_shareable(size))
    }
    fn mem_alloc_shareable_on(&self, size: usize, device: usize) -> Result<DevicePtr> {
        each!(self, a => a.mem_alloc_shareable_on(size, device))
    }
    unsafe fn mem_free(&self, ptr: DevicePtr) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.mem_free(ptr) })
    }
    fn mem_get_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, usize)> {
        each!(self, a => a.mem_get_range(ptr))
    }
    fn mem_buffer_id(&self, ptr: DevicePtr) -> Result<Option<u64>> {
        each!(self, a => a.mem_buffer_id(ptr))
    }
    fn host_alloc(&self, size: usize) -> Result<*mut u8> {
        each!(self, a => a.host_alloc(size))
    }
    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.host_free(ptr) })
    }
    unsafe fn host_register(&self, ptr: *mut u8, size: usize) -> Result<DevicePtr> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.host_register(ptr, size) })
    }
    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.host_unregister(ptr) })
    }
    unsafe fn host_pin(&self, ptr: *mut u8, size: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.host_pin(ptr, size) })
    }
    unsafe fn host_unpin(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.host_unpin(ptr) })
    }
    unsafe fn memcpy_h2d_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.memcpy_h2d_async(dst, src, n, stream) })
    }
    unsafe fn memcpy_d2h_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.memcpy_d2h_async(dst, src, n, stream) })
    }
    unsafe fn memcpy_d2d_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.memcpy_d2d_async(dst, src, n, stream) })
    }
    unsafe fn memcpy_sized_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len_at: DevicePtr,
        cap: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.memcpy_sized_async(dst, src, len_at, cap, stream) })
    }
    unsafe fn memset_async(
        &self,
        dst: DevicePtr,
        value: u8,
        n: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.memset_async(dst, value, n, stream) })
    }
    unsafe fn reduce_async(
        &self,
        dst: DevicePtr,
        a_: DevicePtr,
        b: DevicePtr,
        count: usize,
        dtype: flagcx_adaptor::DataType,
        step: flagcx_adaptor::ReduceStep,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.reduce_async(dst, a_, b, count, dtype, step, stream) })
    }
    fn stream_create(&self) -> Result<StreamHandle> {
        each!(self, a => a.stream_create())
    }
    unsafe fn stream_adopt(&self, native: u64) -> Result<StreamHandle> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.stream_adopt(native) })
    }
    fn stream_release(&self, stream: StreamHandle) -> Result<()> {
        each!(self, a => a.stream_release(stream))
    }
    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        each!(self, a => a.stream_destroy(stream))
    }
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        each!(self, a => a.stream_synchronize(stream))
    }
    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        each!(self, a => a.stream_query(stream))
    }
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        each!(self, a => a.stream_wait_event(stream, event))
    }
    fn event_create(&self, timing: bool) -> Result<EventHandle> {
        each!(self, a => a.event_create(timing))
    }
    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        each!(self, a => a.event_destroy(event))
    }
    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        each!(self, a => a.event_record(event, stream))
    }
    fn event_query(&self, event: EventHandle) -> Result<bool> {
        each!(self, a => a.event_query(event))
    }
    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        each!(self, a => a.event_synchronize(event))
    }
    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32> {
        each!(self, a => a.event_elapsed_ms(start, end))
    }
    fn ipc_get_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        each!(self, a => a.ipc_get_handle(ptr))
    }
    fn ipc_open_handle(&self, handle: &IpcMemHandle) -> Result<DevicePtr> {
        each!(self, a => a.ipc_open_handle(handle))
    }
    fn ipc_export_fd(&self, ptr: DevicePtr) -> Result<IpcFdHandle> {
        each!(self, a => a.ipc_export_fd(ptr))
    }
    fn ipc_import_fd(&self, handle: &IpcFdHandle) -> Result<DevicePtr> {
        each!(self, a => a.ipc_import_fd(handle))
    }
    unsafe fn ipc_close(&self, ptr: DevicePtr) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.ipc_close(ptr) })
    }
    fn can_access_peer(&self, peer: usize) -> Result<bool> {
        each!(self, a => a.can_access_peer(peer))
    }
    fn enable_peer_access(&self, peer: usize) -> Result<()> {
        each!(self, a => a.enable_peer_access(peer))
    }
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        each!(self, a => a.exchange_capture_mode(mode))
    }
    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        each!(self, a => a.launch_host_func(stream, f))
    }
    fn stream_gate(&self, stream: StreamHandle) -> Result<GateHandle> {
        each!(self, a => a.stream_gate(stream))
    }
    fn gate_open(&self, gate: GateHandle) -> Result<()> {
        each!(self, a => a.gate_open(gate))
    }
    fn gate_is_last(&self, gate: GateHandle) -> Result<bool> {
        each!(self, a => a.gate_is_last(gate))
    }
    unsafe fn stream_wait_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
        cond: WaitCondition,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.stream_wait_value32(stream, addr, value, cond) })
    }
    unsafe fn stream_wait_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
        cond: WaitCondition,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.stream_wait_value64(stream, addr, value, cond) })
    }
    unsafe fn stream_write_value32(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u32,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.stream_write_value32(stream, addr, value) })
    }
    unsafe fn host_write_value32(&self, host: *mut u32, value: u32) {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.host_write_value32(host, value) })
    }
    unsafe fn stream_write_value64(
        &self,
        stream: StreamHandle,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.stream_write_value64(stream, addr, value) })
    }
    unsafe fn stream_write_values64(
        &self,
        stream: StreamHandle,
        writes: &[(DevicePtr, u64)],
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.stream_write_values64(stream, writes) })
    }
    unsafe fn stream_slot_steps(&self, stream: StreamHandle, steps: &[SlotStep]) -> Result<()> {
        // SAFETY: forwarded contract.
        each!(self, a => unsafe { a.stream_slot_steps(stream, steps) })
    }
}

/// The device of local rank `local` among devices with these PCI bus ids: the `local`-th (modulo
/// the count) in bus order where every device has an id, else in the runtime's order.
fn spread_device(local: usize, pci: &[Option<String>]) -> usize {
    let n = pci.len().max(1);
    let keys: Option<Vec<(u32, u32, u32, u32)>> =
        pci.iter().map(|p| p.as_deref().and_then(pci_key)).collect();
    match keys {
        Some(keys) if !keys.is_empty() => {
            let mut order: Vec<usize> = (0..keys.len()).collect();
            order.sort_by_key(|&i| keys[i]);
            order[local % n]
        }
        _ => local % n,
    }
}

/// `[domain:]bus:device.function` in hex, any case (runtimes print it differently).
fn pci_key(id: &str) -> Option<(u32, u32, u32, u32)> {
    let (rest, function) = id.trim().rsplit_once('.')?;
    let parts: Vec<&str> = rest.split(':').collect();
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    let (domain, bus, device) = match parts.as_slice() {
        [d, b, v] => (hex(d)?, hex(b)?, hex(v)?),
        [b, v] => (0, hex(b)?, hex(v)?),
        _ => return None,
    };
    Some((domain, bus, device, hex(function)?))
}

#[cfg(test)]
mod tests {
    use super::{pci_key, spread_device};

    #[test]
    fn local_ranks_spread_over_devices_in_pci_order() {
        let ids = |v: &[&str]| v.iter().map(|s| Some(s.to_string())).collect::<Vec<_>>();
        // CUDA's fastest-first numbering vs OpenCL's: both map local rank r to the r-th GPU
        // in bus order.
        let cuda = ids(&["0000:BB:00.0", "0000:3B:00.0"]);
        let opencl = ids(&["3b:00.0", "bb:00.0"]);
        for local in 0..4 {
            let a = cuda[spread_device(local, &cuda)]
                .as_deref()
                .and_then(pci_key);
            let b = opencl[spread_device(local, &opencl)]
                .as_deref()
                .and_then(pci_key);
            assert_eq!(a, b, "local rank {local}");
        }
        assert_eq!(spread_device(0, &cuda), 1);
        // Without ids (or one missing) the runtime's order stays.
        assert_eq!(spread_device(3, &[None, None]), 1);
        assert_eq!(spread_device(1, &[Some("0000:3b:00.0".into()), None]), 1);
        assert_eq!(spread_device(5, &[]), 0);
        assert_eq!(pci_key("0001:3B:00.1"), Some((1, 0x3b, 0, 1)));
        assert_eq!(pci_key("garbage"), None);
    }
}
