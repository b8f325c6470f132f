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
    /// The sender's message is larger than the receiver's buffer; raised on both sides, except
    /// for an eager message (see [`crate::Config::eager_max`]), whose send was complete when
    /// posted: then only the receive fails.
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
    /// An operation made no progress for `ms` milliseconds (`FLAGCX_TIMEOUT_MS`, or the
    /// limit given to [`crate::Request::wait_timeout`]).
    #[error("timed out after {ms} ms: {what}")]
    Timeout {
        /// The limit.
        ms: u64,
        /// The rank it waited for, where one operation's peer is known.
        peer: Option<usize>,
        /// What was waited for, in words (names the peer).
        what: String,
    },
    /// The network library (UCX) failed an operation with a pair on another host; keeps its
    /// status in words and number.
    #[error("network: {0}")]
    Net(String),
    /// The communicator was aborted or shut down.
    #[error("communicator aborted")]
    Aborted,
}

impl Clone for CommError {
    fn clone(&self) -> Self {
        use CommError::*;
        match self {
            Adaptor(e) => Adaptor(e.clone()),
            Io { op, source } => Io {
                op,
                source: flagcx_adaptor::clone_io_error(source),
            },
            Bootstrap(s) => Bootstrap(s.clone()),
            Config {
                name,
                value,
                reason,
            } => Config {
                name: name.clone(),
                value: value.clone(),
                reason: reason.clone(),
            },
            Protocol(s) => Protocol(s.clone()),
            InvalidArgument(s) => InvalidArgument(s.clone()),
            SizeMismatch {
                peer,
                send_bytes,
                recv_bytes,
            } => SizeMismatch {
                peer: *peer,
                send_bytes: *send_bytes,
                recv_bytes: *recv_bytes,
            },
            PeerLost { peer, reason } => PeerLost {
                peer: *peer,
                reason: reason.clone(),
            },
            RemoteFailure { peer, reason } => RemoteFailure {
                peer: *peer,
                reason: reason.clone(),
            },
            Timeout { ms, peer, what } => Timeout {
                ms: *ms,
                peer: *peer,
                what: what.clone(),
            },
            Net(s) => Net(s.clone()),
            Aborted => Aborted,
        }
    }
}

impl CommError {
    /// The same failure for a second operation it fails: vendor errors keep their type and
    /// code; the rest keep their text as a protocol error.
    pub(crate) fn duplicate(&self) -> CommError {
        match self {
            CommError::Adaptor(e) => CommError::Adaptor(e.clone()),
            e => CommError::Protocol(e.to_string()),
        }
    }

    /// True for failures that leave a pair (or the communicator) unusable and that a
    /// watchdog should act on: a lost peer, a timeout, a remote or vendor failure, an OS or
    /// protocol error. A size mismatch, a bad argument or an abort the caller asked for are
    /// the caller's own and are not.
    pub fn is_async_failure(&self) -> bool {
        matches!(
            self,
            CommError::Adaptor(_)
                | CommError::Io { .. }
                | CommError::Protocol(_)
                | CommError::PeerLost { .. }
                | CommError::RemoteFailure { .. }
                | CommError::Timeout { .. }
                | CommError::Net(_)
        )
    }

    /// A message's size failure (its two ends disagreed on the call), or the peer retiring the
    /// pair over one: what fails a reduction's communicator (`crate::guard::after_failure`).
    pub(crate) fn is_disagreement(&self) -> bool {
        matches!(
            self,
            CommError::SizeMismatch { .. } | CommError::RemoteFailure { .. }
        )
    }

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
