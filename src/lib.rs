//! `flagcx`: cross-vendor intra-node communication — the facade.
//!
//! Pick vendors with cargo features (`host`, the default, plus `cuda`, `hip`, …). Each compiled-in
//! vendor crate is re-exported under its short name, and [`Adaptor`] is an enum over them that
//! implements [`DeviceAdaptor`] by static dispatch (a `match`, no `dyn`), so one binary can run
//! on whichever vendor the machine has:
//!
//! ```
//! use flagcx::{Adaptor, DeviceAdaptor};
//! // Honours FLAGCX_VENDOR / FLAGCX_DEVICE, else picks the first vendor with a device.
//! let adaptor = Adaptor::from_env().expect("a vendor");
//! println!("running on {} device {}", adaptor.vendor(), adaptor.device());
//! ```
//!
//! The dispatch is written with a small local macro rather than the `enum_dispatch` crate:
//! `enum_dispatch` needs the trait and the enum in one crate, and the trait lives in
//! `flagcx-adaptor` so that a vendor crate can be embedded without this facade.

#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(not(any(feature = "host", feature = "cuda", feature = "hip")))]
compile_error!("enable at least one vendor feature of `flagcx` (host, cuda, hip)");

pub use flagcx_adaptor as adaptor;
pub use flagcx_adaptor::{
    AdaptorError, Capabilities, CaptureMode, DeviceAdaptor, DeviceBuffer, DeviceProperties,
    DevicePtr, Event, EventHandle, HostFn, IpcFdHandle, IpcMapping, IpcMemHandle, PinnedBuffer,
    Result, Stream, StreamHandle, Vendor, WaitCondition,
};

/// The host vendor (feature `host`).
#[cfg(feature = "host")]
pub use flagcx_host as host;

/// The CUDA vendor (feature `cuda`).
#[cfg(feature = "cuda")]
pub use flagcx_cuda as cuda;

/// The HIP vendor (feature `hip`).
#[cfg(feature = "hip")]
pub use flagcx_hip as hip;

mod dispatch;
pub use dispatch::Adaptor;
