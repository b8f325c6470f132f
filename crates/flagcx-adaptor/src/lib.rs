//! The vendor-neutral contract between flagcx-rs and a device runtime.
//!
//! A vendor (CUDA, HIP, the host vendor, …) is one crate that implements [`DeviceAdaptor`] for
//! one device of its runtime. Everything above this crate — the bootstrap, the shared-memory
//! ring, the proxy thread, the transports — speaks only this trait, so a new vendor is one crate
//! and never a change elsewhere.
//!
//! Design choices, and why:
//! - **Vendor-neutral handles.** Device pointers, streams and events are plain integers
//!   ([`DevicePtr`], [`StreamHandle`], [`EventHandle`]) and IPC handles are fixed-size bytes
//!   ([`IpcMemHandle`]) or a file descriptor ([`IpcFdHandle`]). They travel between processes and
//!   let the facade dispatch over vendors with a plain enum, with no associated types to unify.
//! - **Validated handles.** Every adaptor checks stream and event handles against the ones it
//!   created, so a stale or foreign handle is an [`AdaptorError::InvalidHandle`], not a crash.
//! - **Unsafe where memory is touched.** Operations that read or write through raw addresses are
//!   `unsafe fn` with a `# Safety` contract; the safe RAII layer in [`raii`] sits on top.
//! - **Capabilities are queried.** [`Capabilities`] says what works; an operation a vendor lacks
//!   returns [`AdaptorError::Unsupported`] and never panics.

#![deny(unsafe_op_in_unsafe_fn)]

mod adaptor;
mod error;
pub mod gpu;
pub mod hostmem;
pub mod incall;
pub mod quiet;
pub mod raii;
pub mod reduce;
pub mod spin;
pub mod tracking;
mod types;
mod vendor;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "conformance")]
pub mod testing;

pub use adaptor::{slot_steps_in_order, DeviceAdaptor, HostFn};
pub use error::{clone_io_error, AdaptorError, Result};
pub use raii::{CaptureModeGuard, DeviceBuffer, Event, IpcMapping, PinnedBuffer, Stream};
pub use reduce::{DataType, ReduceOp, ReduceStep};
pub use types::{
    Capabilities, CaptureMode, DeviceProperties, DevicePtr, EventHandle, GateHandle, IpcFdHandle,
    IpcMemHandle, SlotInbox, SlotStep, StreamHandle, Vendor, WaitCondition, IPC_HANDLE_BYTES,
};
