//! The library's errors as Python exceptions: one class per kind, all under `FlagcxError`.

use flagcx::{AdaptorError, CommError};
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

create_exception!(
    flagcx,
    FlagcxError,
    PyRuntimeError,
    "Base class of every error flagcx raises."
);
create_exception!(
    flagcx,
    PeerLost,
    FlagcxError,
    "A peer rank died or closed its communicator."
);
create_exception!(
    flagcx,
    RemoteFailure,
    FlagcxError,
    "A peer's side of the operation failed (its runtime returned an error)."
);
create_exception!(
    flagcx,
    Timeout,
    FlagcxError,
    "An operation made no progress for FLAGCX_TIMEOUT_MS, or a wait's limit passed."
);
create_exception!(
    flagcx,
    Aborted,
    FlagcxError,
    "The communicator was aborted or closed."
);
create_exception!(
    flagcx,
    SizeMismatch,
    FlagcxError,
    "The sender's message is larger than the receiver's buffer."
);
create_exception!(
    flagcx,
    InvalidArgument,
    FlagcxError,
    "An argument the call cannot accept."
);
create_exception!(
    flagcx,
    Unsupported,
    FlagcxError,
    "What was asked is not supported by this rank's device, a peer's, or flagcx."
);
create_exception!(
    flagcx,
    Unavailable,
    FlagcxError,
    "The vendor's runtime or device is not present on this machine."
);
create_exception!(
    flagcx,
    BootstrapError,
    FlagcxError,
    "The job could not form (a rank did not come, a bad unique id, a refused peer)."
);
create_exception!(
    flagcx,
    ConfigError,
    FlagcxError,
    "A FLAGCX_* environment variable is malformed."
);
create_exception!(
    flagcx,
    DeviceError,
    FlagcxError,
    "The device runtime failed; the message keeps the vendor's error name and code."
);
create_exception!(
    flagcx,
    OutOfMemory,
    FlagcxError,
    "A device allocation failed."
);
create_exception!(
    flagcx,
    ProtocolError,
    FlagcxError,
    "A peer sent bytes that do not decode, or the network layer failed."
);

/// The exception for a communicator error.
pub fn comm_err(e: CommError) -> PyErr {
    let msg = e.to_string();
    match &e {
        CommError::PeerLost { .. } => PeerLost::new_err(msg),
        CommError::RemoteFailure { .. } => RemoteFailure::new_err(msg),
        CommError::Timeout { .. } => Timeout::new_err(msg),
        CommError::Aborted => Aborted::new_err(msg),
        CommError::SizeMismatch { .. } => SizeMismatch::new_err(msg),
        CommError::InvalidArgument(_) => InvalidArgument::new_err(msg),
        CommError::Bootstrap(_) | CommError::Io { .. } => BootstrapError::new_err(msg),
        CommError::Config { .. } => ConfigError::new_err(msg),
        CommError::Protocol(_) | CommError::Net(_) => ProtocolError::new_err(msg),
        CommError::Adaptor(a) => match a {
            AdaptorError::Unsupported { .. } => Unsupported::new_err(msg),
            AdaptorError::Unavailable { .. } => Unavailable::new_err(msg),
            AdaptorError::InvalidArgument { .. }
            | AdaptorError::InvalidHandle { .. }
            | AdaptorError::InvalidDevice { .. } => InvalidArgument::new_err(msg),
            AdaptorError::OutOfMemory { .. } => OutOfMemory::new_err(msg),
            _ => DeviceError::new_err(msg),
        },
        _ => FlagcxError::new_err(msg),
    }
}

/// `InvalidArgument` with this message.
pub fn invalid(msg: impl Into<String>) -> PyErr {
    InvalidArgument::new_err(msg.into())
}

/// `Unsupported` with this message.
pub fn unsupported(msg: impl Into<String>) -> PyErr {
    Unsupported::new_err(msg.into())
}

/// `Timeout` with this message.
pub fn timeout(msg: impl Into<String>) -> PyErr {
    Timeout::new_err(msg.into())
}

/// `Aborted` with this message.
pub fn aborted(msg: impl Into<String>) -> PyErr {
    Aborted::new_err(msg.into())
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("FlagcxError", py.get_type::<FlagcxError>())?;
    m.add("PeerLost", py.get_type::<PeerLost>())?;
    m.add("RemoteFailure", py.get_type::<RemoteFailure>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("Aborted", py.get_type::<Aborted>())?;
    m.add("SizeMismatch", py.get_type::<SizeMismatch>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("Unsupported", py.get_type::<Unsupported>())?;
    m.add("Unavailable", py.get_type::<Unavailable>())?;
    m.add("BootstrapError", py.get_type::<BootstrapError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("OutOfMemory", py.get_type::<OutOfMemory>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    Ok(())
}
