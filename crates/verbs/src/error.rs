//! Errors of the verbs layer: one enum, [`VerbsError`], for every fallible verbs call.
//!
//! Work completions are *not* errors: a posted request that fails on the wire ends in a
//! [`crate::WorkCompletion`] with a non-success [`crate::WcStatus`]. `VerbsError` is for calls that
//! are refused synchronously (bad arguments, wrong QP state, queue full, unsupported operation).

use crate::qp::QpState;

/// Result alias for the verbs layer.
pub type Result<T, E = VerbsError> = std::result::Result<T, E>;

/// An error returned synchronously by a verbs call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// No device of that name, or no device at all on this host.
    #[error("no RDMA device {0:?}")]
    NoDevice(String),
    /// The provider does not implement this operation (see [`crate::DeviceAttr`] capabilities).
    #[error("operation not supported by provider {provider}: {what}")]
    Unsupported {
        /// Provider name.
        provider: &'static str,
        /// What was asked for.
        what: String,
    },
    /// An argument is out of range or inconsistent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A QP state transition that the RC state machine does not allow.
    #[error("illegal QP state transition {from:?} -> {to:?}")]
    IllegalTransition {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// Posting in a state that does not accept this kind of work request.
    #[error("QP in state {state:?} does not accept {what}")]
    WrongState {
        /// Current state.
        state: QpState,
        /// `"send"` or `"recv"`.
        what: &'static str,
    },
    /// The send or receive queue is full: an expected back-pressure outcome; retry after polling.
    #[error("work queue full")]
    QueueFull,
    /// The completion queue overflowed: completions were lost and the CQ is now in error.
    #[error("completion queue overflow: more than {capacity} completions outstanding")]
    CqOverflow {
        /// The CQ capacity.
        capacity: u32,
    },
    /// A limit of the device (max_qp_wr, max_sge, max_inline, max_mr_size, ...) was exceeded.
    #[error("device limit exceeded: {0}")]
    LimitExceeded(String),
    /// The peer could not be reached or went away during connection set-up.
    #[error("connection to peer failed: {0}")]
    Connect(String),
    /// A malformed endpoint, frame or message from a peer.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// An operating-system error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl VerbsError {
    /// Wrap an OS error with what was being done.
    pub fn io(context: impl Into<String>, source: impl Into<std::io::Error>) -> Self {
        VerbsError::Io {
            context: context.into(),
            source: source.into(),
        }
    }

    /// Shorthand for [`VerbsError::Unsupported`].
    pub fn unsupported(provider: &'static str, what: impl Into<String>) -> Self {
        VerbsError::Unsupported {
            provider,
            what: what.into(),
        }
    }
}
