//! `flagcx-cuda`: the flagcx-rs adaptor contract on NVIDIA GPUs, through cudarc's driver API.
//!
//! `libcuda` is loaded at run time, so this crate builds and links on machines without CUDA;
//! there [`CudaAdaptor::open`] returns [`AdaptorError::Unavailable`] instead of panicking (cudarc
//! itself panics on first use without the library, so presence is checked first).
//!
//! - Contexts: the device's primary context, made current on whichever thread calls in, so the
//!   progress thread of `flagcx-p2p` can drive the device without setup of its own.
//! - Memory exported through byte-form IPC comes from plain `cuMemAlloc`: stream-ordered pool
//!   allocations cannot be exported with `cuIpcGetMemHandle`. File-descriptor handles need VMM
//!   allocations (`cuMemCreate` with POSIX-fd handles), which
//!   [`DeviceAdaptor::mem_alloc_shareable`] makes, rounded up to the allocation granularity.
//! - Stream memory operations are probed at open time with the `_v2` calls themselves: the old
//!   `CAN_USE_STREAM_MEM_OPS_V1` attribute reads 0 on GPUs where the calls work.
//!
//! Tracking, validation and the shape of every operation are the shared GPU core's
//! ([`flagcx_adaptor::gpu`], also under HIP); this crate is the driver's raw calls
//! ([`CudaDriver`]) and its error names.
//!
//! [`AdaptorError::Unavailable`]: flagcx_adaptor::AdaptorError::Unavailable
//! [`DeviceAdaptor::mem_alloc_shareable`]: flagcx_adaptor::DeviceAdaptor::mem_alloc_shareable

#![deny(unsafe_op_in_unsafe_fn)]

mod driver;
mod error;
pub mod kernel;
mod probe;
mod sized;

pub use driver::CudaDriver;

/// One CUDA device: the shared GPU core over [`CudaDriver`]. Cheap to clone; clones share the
/// primary context and all tracking. Open it with `CudaAdaptor::open(device)`.
pub type CudaAdaptor = flagcx_adaptor::gpu::GpuAdaptor<CudaDriver>;
