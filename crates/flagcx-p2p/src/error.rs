//! Errors of the communication layer.

use flagcx_adaptor::AdaptorError;

/// Result of a communication operation.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// Why a communication operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// The device runtime failed (keeps the vendor's code).
    #[error(transparent)]
    Adaptor(#[from] AdaptorError),
    /// A system call or socket operation failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Bootstrap could not form the job (timeout, refused peer, bad unique id, …).
    #[error("bootstrap: {0}")]
    Bootstrap(String),
    /// A configuration value (usually an environment variable) is malformed.
    #[error("configuration: {name}={value:?}: {reason}")]
    Config {
        /// The variable or setting.
        name: String,
        /// The value given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A peer sent bytes that do not decode.
    #[error("protocol: {0}")]
    Protocol(String),
    /// An argument the operation cannot accept.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The sender's message is larger than the receiver's buffer; raised on both sides.
    #[error(
        "size mismatch with rank {peer}: sender has {send_bytes} bytes, receiver {recv_bytes}"
    )]
    SizeMismatch {
        /// The other rank.
        peer: usize,
        /// Bytes the sender posted.
        send_bytes: usize,
        /// Bytes the receiver posted.
        recv_bytes: usize,
    },
    /// The peer died or closed its communicator.
    #[error("rank {peer} is gone: {reason}")]
    PeerLost {
        /// The lost rank.
        peer: usize,
        /// What was observed.
        reason: String,
    },
    /// The peer's side of the operation failed (its runtime returned an error); no data moved.
    #[error("rank {peer} failed its side of the operation: {reason}")]
    RemoteFailure {
        /// The other rank.
        peer: usize,
        /// What it reported.
        reason: String,
    },
    /// An operation did not complete in time.
    #[error("timed out after {ms} ms: {what}")]
    Timeout {
        /// The limit.
        ms: u64,
        /// What was waited for.
        what: String,
    },
    /// The communicator was aborted or shut down.
    #[error("communicator aborted")]
    Aborted,
}

impl CommError {
    pub(crate) fn io(op: &'static str, source: std::io::Error) -> Self {
        CommError::Io { op, source }
    }

    pub(crate) fn config(name: &str, value: &str, reason: impl Into<String>) -> Self {
        CommError::Config {
            name: name.into(),
            value: value.into(),
            reason: reason.into(),
        }
    }
}
