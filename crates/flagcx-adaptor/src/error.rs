//! Typed errors shared by every vendor: each keeps the vendor's own code and name.

use crate::vendor::Vendor;

/// Result of an adaptor operation.
pub type Result<T, E = AdaptorError> = std::result::Result<T, E>;

/// Why an adaptor operation failed.
///
/// Vendor failures keep the runtime's numeric code and symbolic name (`CUDA_ERROR_INVALID_VALUE`,
/// `hipErrorNoDevice`, …) so that a log line can be matched against the vendor's documentation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdaptorError {
    /// The vendor runtime returned an error code.
    #[error("{vendor} {op} failed: {name} ({code})")]
    Vendor {
        /// Which vendor runtime failed.
        vendor: Vendor,
        /// The operation that failed, e.g. `cuMemAlloc`.
        op: &'static str,
        /// The runtime's numeric error code.
        code: i64,
        /// The runtime's symbolic name for `code`.
        name: String,
    },
    /// The vendor has no such operation (see [`crate::Capabilities`]).
    #[error("{vendor} does not support {op}")]
    Unsupported {
        /// The vendor asked.
        vendor: Vendor,
        /// The operation it lacks.
        op: &'static str,
    },
    /// The vendor runtime or its device is not present on this machine.
    #[error("{vendor} is unavailable: {reason}")]
    Unavailable {
        /// The vendor asked.
        vendor: Vendor,
        /// Why, in words (e.g. "libcuda.so.1 not found").
        reason: String,
    },
    /// A device index outside `0..count`.
    #[error("invalid {vendor} device {index}: {count} device(s) present")]
    InvalidDevice {
        /// The vendor asked.
        vendor: Vendor,
        /// The index given.
        index: usize,
        /// How many devices there are.
        count: usize,
    },
    /// An argument the operation cannot accept (null pointer, zero size, bad alignment, …).
    #[error("invalid argument to {op}: {reason}")]
    InvalidArgument {
        /// The operation called.
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A stream, event or memory handle this adaptor did not create, or already destroyed.
    #[error("invalid {kind} handle {value:#x}")]
    InvalidHandle {
        /// `"stream"`, `"event"`, `"device pointer"`, …
        kind: &'static str,
        /// The handle's raw value.
        value: u64,
    },
    /// An allocation larger than the device can hold.
    #[error("{vendor} device {device} is out of memory allocating {requested} bytes")]
    OutOfMemory {
        /// The vendor asked.
        vendor: Vendor,
        /// The device index.
        device: usize,
        /// Bytes requested.
        requested: usize,
        /// The vendor's own code for the failure, where the runtime gave one.
        code: Option<i64>,
    },
    /// Work on a stream failed after it was enqueued (e.g. a host function panicked).
    #[error("{vendor} stream fault in {op}: {reason}")]
    StreamFault {
        /// The vendor.
        vendor: Vendor,
        /// The operation that faulted.
        op: &'static str,
        /// What happened.
        reason: String,
    },
    /// A system call made on the vendor's behalf failed.
    #[error("{op}: {source}")]
    Os {
        /// The system call or step, e.g. `memfd_create`.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// A copy of an OS error: the same errno where there is one, else the same kind and text.
pub fn clone_io_error(e: &std::io::Error) -> std::io::Error {
    match e.raw_os_error() {
        Some(code) => std::io::Error::from_raw_os_error(code),
        None => std::io::Error::new(e.kind(), e.to_string()),
    }
}

/// Errors are values a communicator keeps (its first failure) and hands to every caller that
/// asks, so they clone; an OS error is copied by [`clone_io_error`].
impl Clone for AdaptorError {
    fn clone(&self) -> Self {
        use AdaptorError::*;
        match self {
            Vendor {
                vendor,
                op,
                code,
                name,
            } => Vendor {
                vendor: *vendor,
                op,
                code: *code,
                name: name.clone(),
            },
            Unsupported { vendor, op } => Unsupported {
                vendor: *vendor,
                op,
            },
            Unavailable { vendor, reason } => Unavailable {
                vendor: *vendor,
                reason: reason.clone(),
            },
            InvalidDevice {
                vendor,
                index,
                count,
            } => InvalidDevice {
                vendor: *vendor,
                index: *index,
                count: *count,
            },
            InvalidArgument { op, reason } => InvalidArgument {
                op,
                reason: reason.clone(),
            },
            InvalidHandle { kind, value } => InvalidHandle {
                kind,
                value: *value,
            },
            OutOfMemory {
                vendor,
                device,
                requested,
                code,
            } => OutOfMemory {
                vendor: *vendor,
                device: *device,
                requested: *requested,
                code: *code,
            },
            StreamFault { vendor, op, reason } => StreamFault {
                vendor: *vendor,
                op,
                reason: reason.clone(),
            },
            Os { op, source } => Os {
                op,
                source: clone_io_error(source),
            },
        }
    }
}

impl AdaptorError {
    /// Shorthand for [`AdaptorError::InvalidArgument`].
    pub fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        AdaptorError::InvalidArgument {
            op,
            reason: reason.into(),
        }
    }

    /// Shorthand for [`AdaptorError::Os`] from `errno`.
    pub fn last_os(op: &'static str) -> Self {
        AdaptorError::Os {
            op,
            source: std::io::Error::last_os_error(),
        }
    }

    /// `Ok` when `index` names one of `count` devices, else [`AdaptorError::InvalidDevice`].
    pub fn check_device(vendor: Vendor, index: usize, count: usize) -> Result<()> {
        if index < count {
            Ok(())
        } else {
            Err(AdaptorError::InvalidDevice {
                vendor,
                index,
                count,
            })
        }
    }

    /// True when the error says the operation is not supported by the vendor.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, AdaptorError::Unsupported { .. })
    }

    /// True when the error says the vendor or its device is absent from this machine.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, AdaptorError::Unavailable { .. })
    }
}
