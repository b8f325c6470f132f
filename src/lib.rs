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

#[cfg(not(any(
    feature = "host",
    feature = "cuda",
    feature = "hip",
    feature = "opencl"
)))]
compile_error!("enable at least one vendor feature of `flagcx` (host, cuda, hip, opencl)");

pub use flagcx_adaptor as adaptor;
pub use flagcx_adaptor::reduce::{DataType, ReduceOp, ReduceStep};
pub use flagcx_adaptor::slot_steps_in_order;
pub use flagcx_adaptor::{
    AdaptorError, Capabilities, CaptureMode, DeviceAdaptor, DeviceBuffer, DeviceProperties,
    DevicePtr, Event, EventHandle, HostFn, IpcFdHandle, IpcMapping, IpcMemHandle, PinnedBuffer,
    Result, SlotInbox, SlotStep, Stream, StreamHandle, Vendor, WaitCondition,
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

/// The OpenCL vendor (feature `opencl`).
#[cfg(feature = "opencl")]
pub use flagcx_opencl as opencl;

/// Point-to-point communication between processes (`flagcx-p2p`).
pub use flagcx_p2p as p2p;
pub use flagcx_p2p::{Collective, Comm, CommError, PathStats, Request, TransportKind};

mod dispatch;
pub use dispatch::Adaptor;

/// The vendors compiled into this build (its cargo features), in detection order.
pub const COMPILED_VENDORS: &[Vendor] = &[
    #[cfg(feature = "cuda")]
    Vendor::Cuda,
    #[cfg(feature = "hip")]
    Vendor::Hip,
    #[cfg(feature = "opencl")]
    Vendor::OpenCl,
    #[cfg(feature = "host")]
    Vendor::Host,
];

/// `<version> (vendors: host, cuda, …)`: what the command-line tools print for `--version`.
pub fn version_line() -> String {
    let vendors: Vec<&str> = COMPILED_VENDORS.iter().map(|v| v.name()).collect();
    format!(
        "{} (vendors: {})",
        env!("CARGO_PKG_VERSION"),
        vendors.join(", ")
    )
}

/// Sets up `tracing` output on stderr from `FLAGCX_DEBUG` (`info`, `debug`, `warn`, or any
/// `tracing` filter; default `warn`). Binaries and examples call it once at start.
pub fn init_logging() {
    let filter = std::env::var("FLAGCX_DEBUG").unwrap_or_else(|_| "warn".into());
    let filter = match filter.to_ascii_lowercase().as_str() {
        "info" | "debug" | "trace" | "warn" | "error" => {
            format!("flagcx={filter},flagcx_p2p={filter}")
        }
        _ => filter,
    };
    // Colours only on a terminal and without NO_COLOR (no-color.org): piped through
    // `flagcx-run` or into a file, escape codes would be noise in every line.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").map_or(true, |v| v.is_empty());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .try_init();
}
