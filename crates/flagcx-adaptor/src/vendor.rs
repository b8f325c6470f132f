//! The device runtime families (`Vendor`): the lowest type of the contract, which errors and
//! handles name.

use std::fmt;

/// A device runtime family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Vendor {
    /// The host vendor: "device" memory is shareable host memory (crate `flagcx-host`).
    Host,
    /// NVIDIA CUDA (crate `flagcx-cuda`).
    Cuda,
    /// AMD HIP (crate `flagcx-hip`).
    Hip,
    /// OpenCL (crate `flagcx-opencl`).
    OpenCl,
}

impl Vendor {
    /// Every vendor the contract knows, in a stable order.
    pub const ALL: [Vendor; 4] = [Vendor::Host, Vendor::Cuda, Vendor::Hip, Vendor::OpenCl];

    /// The lower-case name used in `FLAGCX_VENDOR`, logs and the CLI.
    pub fn name(self) -> &'static str {
        match self {
            Vendor::Host => "host",
            Vendor::Cuda => "cuda",
            Vendor::Hip => "hip",
            Vendor::OpenCl => "opencl",
        }
    }

    /// A stable one-byte code for wire formats.
    pub fn code(self) -> u8 {
        match self {
            Vendor::Host => 1,
            Vendor::Cuda => 2,
            Vendor::Hip => 3,
            Vendor::OpenCl => 4,
        }
    }

    /// The vendor for a [`Vendor::code`], if any.
    pub fn from_code(code: u8) -> Option<Vendor> {
        Vendor::ALL.into_iter().find(|v| v.code() == code)
    }
}

impl fmt::Display for Vendor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
