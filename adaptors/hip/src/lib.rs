//! `flagcx-hip`: the flagcx-rs adaptor contract on AMD GPUs, through HIP.
//!
//! Built with `hip-sys` against `libamdhip64` (Debian: `apt-get install libamdhip64-dev hipcc`).
//! On a machine without an AMD GPU, [`HipAdaptor::open`] returns
//! [`AdaptorError::Unavailable`] with the runtime's reason (`hipErrorNoDevice`), so the
//! conformance suite reports every case as skipped.
//!
//! Mapping of the contract: devices are selected with `hipSetDevice` on whichever thread calls
//! in; byte-form IPC uses `hipIpcGetMemHandle` on `hipMalloc` memory; fd-form IPC uses the VMM
//! calls (`hipMemCreate` with POSIX-fd handles) where the runtime reports an allocation
//! granularity; host functions use `hipStreamAddCallback` (HIP 5.2 lacks `hipLaunchHostFunc`);
//! stream memory operations are probed at open time.
//!
//! Tracking, validation and the shape of every operation are the shared GPU core's
//! ([`flagcx_adaptor::gpu`], also under CUDA); this crate is the runtime's raw calls
//! ([`HipDriver`], declared in `ffi.rs`) and its error names (`error.rs`).
//!
//! [`AdaptorError::Unavailable`]: flagcx_adaptor::AdaptorError::Unavailable

#![deny(unsafe_op_in_unsafe_fn)]

mod driver;
mod error;
mod ffi;

pub use driver::HipDriver;

/// One HIP device: the shared GPU core over [`HipDriver`]. Cheap to clone; clones share all
/// tracking. Open it with `HipAdaptor::open(device)`.
pub type HipAdaptor = flagcx_adaptor::gpu::GpuAdaptor<HipDriver>;
