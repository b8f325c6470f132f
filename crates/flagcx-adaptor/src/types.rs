//! Vendor-neutral handle and descriptor types: plain data that can cross process boundaries.

use std::fmt;
use std::os::fd::OwnedFd;
use std::str::FromStr;

use crate::error::AdaptorError;
pub use crate::vendor::Vendor;

// `Vendor` itself lives in `crate::vendor` (below the error type, which names it); parsing
// one returns an `AdaptorError`, so it is implemented here.
impl FromStr for Vendor {
    type Err = AdaptorError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        Vendor::ALL
            .into_iter()
            .find(|v| v.name() == t)
            .ok_or_else(|| {
                AdaptorError::invalid(
                    "Vendor::from_str",
                    format!("unknown vendor {s:?}; expected one of host, cuda, hip, opencl"),
                )
            })
    }
}

/// An address in a device's address space (or a device-visible alias of host memory).
///
/// It is a plain integer so that it can be logged, compared and sent to a peer; dereferencing it
/// is only meaningful to the adaptor that produced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null device pointer.
    pub const NULL: DevicePtr = DevicePtr(0);

    /// True for the null pointer.
    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// This pointer advanced by `bytes`, or `None` on overflow.
    pub fn checked_add(self, bytes: usize) -> Option<DevicePtr> {
        self.0.checked_add(bytes as u64).map(DevicePtr)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// An in-order queue of device work, as created by [`crate::DeviceAdaptor::stream_create`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamHandle(pub u64);

/// A marker recorded into a stream, as created by [`crate::DeviceAdaptor::event_create`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventHandle(pub u64);

/// A point of a stream that later work waits at until the host opens it, from any thread: made
/// by [`crate::DeviceAdaptor::stream_gate`], opened once by [`crate::DeviceAdaptor::gate_open`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GateHandle(pub u64);

/// Size of the opaque byte form of an IPC memory handle (CUDA's and HIP's are 64 bytes).
pub const IPC_HANDLE_BYTES: usize = 64;

/// The byte form of an IPC memory handle: opaque, fixed-size, safe to send over any channel.
///
/// It names a whole allocation; [`crate::DeviceAdaptor::ipc_open_handle`] in another process maps
/// that allocation and returns its base there.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcMemHandle {
    /// The vendor that exported it; only that vendor can open it.
    pub vendor: Vendor,
    /// The vendor's opaque handle bytes.
    pub bytes: [u8; IPC_HANDLE_BYTES],
}

impl IpcMemHandle {
    /// Length of [`IpcMemHandle::to_wire`].
    pub const WIRE_LEN: usize = IPC_HANDLE_BYTES + 1;

    /// Encodes as one vendor byte followed by the handle bytes.
    pub fn to_wire(&self) -> [u8; Self::WIRE_LEN] {
        let mut out = [0u8; Self::WIRE_LEN];
        out[0] = self.vendor.code();
        out[1..].copy_from_slice(&self.bytes);
        out
    }

    /// Decodes [`IpcMemHandle::to_wire`]'s output, checking length and vendor code.
    pub fn from_wire(wire: &[u8]) -> Result<Self, AdaptorError> {
        if wire.len() != Self::WIRE_LEN {
            return Err(AdaptorError::invalid(
                "IpcMemHandle::from_wire",
                format!("expected {} bytes, got {}", Self::WIRE_LEN, wire.len()),
            ));
        }
        let vendor = Vendor::from_code(wire[0]).ok_or_else(|| {
            AdaptorError::invalid(
                "IpcMemHandle::from_wire",
                format!("unknown vendor code {}", wire[0]),
            )
        })?;
        let mut bytes = [0u8; IPC_HANDLE_BYTES];
        bytes.copy_from_slice(&wire[1..]);
        Ok(IpcMemHandle { vendor, bytes })
    }
}

impl fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcMemHandle({}, ", self.vendor)?;
        for b in &self.bytes[..16] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…)")
    }
}

/// The file-descriptor form of an IPC memory handle.
///
/// POSIX-fd handles (CUDA VMM, memfd) cannot be sent as bytes: the fd must travel over a
/// Unix-domain socket (`SCM_RIGHTS`) or be inherited. Dropping it closes the descriptor.
#[derive(Debug)]
pub struct IpcFdHandle {
    /// The vendor that exported it.
    pub vendor: Vendor,
    /// The shareable descriptor.
    pub fd: OwnedFd,
    /// Bytes that the descriptor maps (the allocation's size).
    pub size: usize,
}

/// Properties of one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceProperties {
    /// Which vendor.
    pub vendor: Vendor,
    /// Device index within the vendor.
    pub index: usize,
    /// Marketing or runtime name.
    pub name: String,
    /// PCI bus id (`0000:3b:00.0`), where the device has one.
    pub pci_bus_id: Option<String>,
    /// Total device memory in bytes.
    pub total_memory: u64,
}

/// What a vendor adaptor can do. Callers check these instead of assuming.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// [`crate::DeviceAdaptor::ipc_get_handle`] / `ipc_open_handle` work (byte-form handles).
    pub ipc_bytes: bool,
    /// [`crate::DeviceAdaptor::ipc_export_fd`] / `ipc_import_fd` work (fd-form handles).
    pub ipc_fd: bool,
    /// [`crate::DeviceAdaptor::host_register`] works.
    pub host_register: bool,
    /// [`crate::DeviceAdaptor::host_pin`] works: host memory can be made fast to copy to and
    /// from (page-locked for the copy engine), even where no device alias can be promised.
    pub host_pin: bool,
    /// Peer access between devices of this vendor can be queried and enabled.
    pub peer_access: bool,
    /// [`crate::DeviceAdaptor::launch_host_func`] works.
    pub host_functions: bool,
    /// [`crate::DeviceAdaptor::stream_gate`] / `gate_open` work: a stream waits at a point
    /// the host opens directly, with no runtime thread or host function in between (OpenCL's
    /// user events). What a vendor without stream memory operations joins streams with.
    pub host_gates: bool,
    /// 32-bit stream wait/write value operations work.
    pub stream_mem_ops: bool,
    /// 64-bit stream wait/write value operations work.
    pub stream_mem_ops_64: bool,
    /// [`crate::DeviceAdaptor::exchange_capture_mode`] is meaningful.
    pub capture_mode: bool,
    /// Device pointers are addresses of this process's ordinary, coherent memory: once the
    /// stream work touching a buffer has completed, the CPU may read and write it directly
    /// (the host vendor). Lets small messages skip copy launches entirely.
    pub host_addressable: bool,
    /// [`crate::DeviceAdaptor::memcpy_sized_async`] works: a copy whose length the stream reads
    /// from memory when it reaches it (a kernel on GPUs), so a receiver can enqueue the copy
    /// of a message whose size it learns only when the message arrives.
    pub sized_copy: bool,
    /// Work that several processes enqueue on one device runs side by side instead of in
    /// time slices of the whole device (NVIDIA's MPS). Two ranks sharing such a device may
    /// each copy their own messages, and a kernel that spins for its peer does not hold the
    /// device from it.
    pub concurrent_processes: bool,
    /// [`crate::DeviceAdaptor::ipc_import_fd`] also maps fd-form exports of *another*
    /// runtime's memory on the same physical device (OpenCL's
    /// `cl_khr_external_memory_opaque_fd`: NVIDIA's platform maps what CUDA's
    /// `mem_alloc_shareable` + `ipc_export_fd` export). Which runtimes' fds it takes is the
    /// driver's affair, so callers try the import and fall back where it fails.
    pub ipc_fd_foreign: bool,
    /// The element types [`crate::DeviceAdaptor::reduce_async`] reduces exactly, as a mask of
    /// [`crate::DataType::bit`] (0: no reductions). A type missing here is `Unsupported`,
    /// never a different result.
    pub reduce_types: u16,
}

/// One side of a small message through a slot both ends reach, as
/// [`crate::DeviceAdaptor::stream_slot_steps`] runs it on a stream. Every address is
/// device-visible (device memory, an IPC mapping, or registered host memory's device alias);
/// the words are 8-byte aligned, and waits compare as [`WaitCondition::Geq`] does (wrap-safe).
#[derive(Debug, Clone, Copy)]
pub enum SlotStep {
    /// The sending side: wait until the word at `wait.0` reaches `wait.1` (the slot is free;
    /// `None`: no wait), copy `len` bytes from `src` into the slot, then write each of
    /// `writes` in order, each visible to the peer before the next (a size word, then the
    /// status word the receiving side waits for). Once the last write is visible the put
    /// reads `src` no more (an inbox's copy included), so a sender may complete on that word.
    Put {
        /// The free-slot wait, if any.
        wait: Option<(DevicePtr, u64)>,
        /// The message's bytes, device memory of this adaptor.
        src: DevicePtr,
        /// How many bytes the message has (at most the slot's size).
        len: usize,
        /// The slot as this process maps it (where a vendor copies into it from the host side).
        slot_host: *mut u8,
        /// The slot as the device reaches it.
        slot: DevicePtr,
        /// Written after the bytes, in order.
        writes: [(DevicePtr, u64); 2],
        /// Where the vendor may put the message a second time: its bytes and then its words
        /// before the writes.
        inbox: Option<SlotInbox>,
    },
    /// The receiving side: wait until the word at `wait.0` reaches `wait.1`, then copy as
    /// [`crate::DeviceAdaptor::memcpy_sized_async`] does: `n` = the word at `len_at`, read after
    /// the wait, and `n` bytes from `slot` to `dst` if `n <= cap`, none otherwise; then write
    /// `done`, if any, visible only after the copied bytes (so a taker may complete on it).
    Take {
        /// The message-is-there wait.
        wait: (DevicePtr, u64),
        /// The slot.
        slot: DevicePtr,
        /// The word holding the message's length.
        len_at: DevicePtr,
        /// Where the bytes go, device memory of this adaptor.
        dst: DevicePtr,
        /// At most this many bytes are taken.
        cap: usize,
        /// Where the vendor may look first for the message (and take it from).
        inbox: Option<SlotInbox>,
        /// Written after the copy (also after copying nothing): word and value.
        done: Option<(DevicePtr, u64)>,
    },
}

/// A second home for a [`SlotStep`]'s message, in memory its taker polls cheaply (the
/// receiving device's own memory, which the putting side reaches by IPC over the GPUs' link,
/// where every poll of host memory would be a bus round trip). A vendor that runs steps as one
/// kernel copies the bytes there too before any word (every read of the source comes before
/// the slot's status word), and writes the inbox's length and then status word before the
/// slot's words (so a take from the inbox may finish before the slot's words land); its takes poll the inbox's status word and, now and then, the slot's, and take
/// from whichever shows the message first (the slot's words are how a message is failed or
/// released without its putter). A vendor that runs steps in order ignores inboxes: every put
/// writes the slot, so every take is answered there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotInbox {
    /// The inbox's copy of the slot (as large).
    pub slot: DevicePtr,
    /// Its length word.
    pub len_at: DevicePtr,
    /// Its status word (the put's last value of `writes` lands here too).
    pub status: DevicePtr,
}

/// The thread's stream-capture mode (CUDA graph capture semantics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureMode {
    /// Potentially unsafe calls are refused while any thread captures.
    Global,
    /// Refused while this thread captures.
    ThreadLocal,
    /// Never refused: what allocation and registration need while another thread captures.
    Relaxed,
}

/// When a stream wait-value operation releases the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitCondition {
    /// `(value_at_addr - value)` as a signed integer is ≥ 0: wrap-safe "reached" for counters.
    Geq,
    /// `value_at_addr == value`.
    Eq,
    /// `(value_at_addr & value) != 0`.
    And,
    /// `!(value_at_addr | value) != 0`.
    Nor,
}

impl WaitCondition {
    /// Whether `current` satisfies the condition against `value` (32-bit semantics).
    pub fn holds32(self, current: u32, value: u32) -> bool {
        match self {
            WaitCondition::Geq => (current.wrapping_sub(value) as i32) >= 0,
            WaitCondition::Eq => current == value,
            WaitCondition::And => current & value != 0,
            WaitCondition::Nor => !(current | value) != 0,
        }
    }

    /// Whether `current` satisfies the condition against `value` (64-bit semantics).
    pub fn holds64(self, current: u64, value: u64) -> bool {
        match self {
            WaitCondition::Geq => (current.wrapping_sub(value) as i64) >= 0,
            WaitCondition::Eq => current == value,
            WaitCondition::And => current & value != 0,
            WaitCondition::Nor => !(current | value) != 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendor_names_round_trip() {
        for v in Vendor::ALL {
            assert_eq!(v.name().parse::<Vendor>().unwrap(), v);
            assert_eq!(Vendor::from_code(v.code()), Some(v));
        }
        assert!("nvidia".parse::<Vendor>().is_err());
        assert_eq!(Vendor::from_code(0), None);
    }

    #[test]
    fn ipc_handle_wire_round_trip_and_rejects_garbage() {
        let mut bytes = [0u8; IPC_HANDLE_BYTES];
        bytes.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let h = IpcMemHandle {
            vendor: Vendor::Cuda,
            bytes,
        };
        assert_eq!(IpcMemHandle::from_wire(&h.to_wire()).unwrap(), h);
        assert!(IpcMemHandle::from_wire(&h.to_wire()[..10]).is_err());
        let mut bad = h.to_wire();
        bad[0] = 99;
        assert!(IpcMemHandle::from_wire(&bad).is_err());
    }

    #[test]
    fn wait_conditions_are_wrap_safe() {
        assert!(WaitCondition::Geq.holds32(5, 5));
        assert!(WaitCondition::Geq.holds32(1, u32::MAX)); // wrapped past
        assert!(!WaitCondition::Geq.holds32(4, 5));
        assert!(WaitCondition::Geq.holds64(0, u64::MAX));
        assert!(WaitCondition::And.holds32(0b110, 0b010));
        assert!(!WaitCondition::And.holds32(0b100, 0b010));
        assert!(WaitCondition::Nor.holds32(0, 0));
        assert!(!WaitCondition::Nor.holds32(u32::MAX, 0));
        assert!(WaitCondition::Eq.holds64(7, 7));
    }
}
