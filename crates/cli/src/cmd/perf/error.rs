//! Errors of `fabriq perf`: one enum for everything that can stop a run, so the user reads
//! what went wrong (server unreachable, peer protocol error, failed completion, stall) instead
//! of a panic. Variants that wrap a cause print only their own context; the cause chain is
//! printed by `main` (or joined by [`chain`] where the message leaves the process).

use std::time::Duration;

use fabriq_verbs::{PostError, VerbsError, WcOpcode, WcStatus};

/// Result alias for the perf tool.
pub type Result<T, E = PerfError> = std::result::Result<T, E>;

/// Why a benchmark run stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PerfError {
    /// The control connection could not be opened.
    #[error("cannot reach perf server at {addr}")]
    Unreachable {
        /// The address tried.
        addr: String,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// An address that does not resolve.
    #[error("bad server address {addr:?}: {reason}")]
    BadAddress {
        /// As given.
        addr: String,
        /// Why.
        reason: String,
    },
    /// The control connection failed mid-run.
    #[error("control connection: {context}")]
    Control {
        /// What was being done.
        context: &'static str,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// The peer closed the control connection.
    #[error("the peer closed the control connection {0}")]
    PeerClosed(&'static str),
    /// A malformed or unexpected control message.
    #[error("control protocol: {0}")]
    Protocol(String),
    /// The server refused or failed the run.
    #[error("server: {0}")]
    Server(String),
    /// A verbs call failed.
    #[error("{context}")]
    Verbs {
        /// What was being done.
        context: String,
        /// The verbs error.
        #[source]
        source: VerbsError,
    },
    /// A work completion with an error status.
    #[error(
        "{opcode:?} completion (wr_id {wr_id}) failed with {status:?} (vendor error {vendor_err})"
    )]
    Completion {
        /// Which operation.
        opcode: WcOpcode,
        /// Its status.
        status: WcStatus,
        /// Its id.
        wr_id: u64,
        /// Provider detail.
        vendor_err: u32,
    },
    /// The QP entered the error state (the peer died or the transport failed).
    #[error("the queue pair went to the error state (peer gone or transport failure)")]
    QpError,
    /// Nothing happened for too long: the peer stalled or died.
    #[error("no progress for {0:?} while {1}; is the peer alive?")]
    Stalled(Duration, &'static str),
    /// The combination of options cannot be run.
    #[error("{0}")]
    Unsupported(String),
    /// CPU pinning failed.
    #[error("cannot pin to CPU {cpu}: {reason}")]
    Affinity {
        /// The CPU asked for.
        cpu: usize,
        /// Why.
        reason: String,
    },
    /// The local server child process failed.
    #[error("local server process: {0}")]
    LocalServer(String),
    /// A middleware channel call failed (`--layer channel|rpc`).
    #[error("{context}")]
    Channel {
        /// What was being done.
        context: String,
        /// The channel error.
        #[source]
        source: fabriq::ChannelError,
    },
    /// A middleware RPC call failed (`--layer rpc`).
    #[error("{context}")]
    Rpc {
        /// What was being done.
        context: String,
        /// The RPC error.
        #[source]
        source: fabriq::RpcError,
    },
    /// A socket error on the plain TCP baseline's data connection.
    #[error("tcp baseline: {context}")]
    Baseline {
        /// What was being done.
        context: &'static str,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
}

/// An error with its causes, `outer: inner: innermost` (for messages that leave the process).
pub fn chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        out.push_str(": ");
        out.push_str(&e.to_string());
        cur = e.source();
    }
    out
}

/// Attach a description to a verbs error.
pub trait VerbsContext<T> {
    /// `context` says what was being done.
    fn verbs(self, context: impl Into<String>) -> Result<T>;
}

impl<T> VerbsContext<T> for std::result::Result<T, VerbsError> {
    fn verbs(self, context: impl Into<String>) -> Result<T> {
        self.map_err(|source| PerfError::Verbs {
            context: context.into(),
            source,
        })
    }
}

impl<T> VerbsContext<T> for std::result::Result<T, PostError> {
    fn verbs(self, context: impl Into<String>) -> Result<T> {
        self.map_err(|e| PerfError::Verbs {
            context: context.into(),
            source: e.source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_joins_every_cause_once() {
        let e = PerfError::Verbs {
            context: "open device x".into(),
            source: VerbsError::NoDevice("x".into()),
        };
        assert_eq!(e.to_string(), "open device x");
        assert_eq!(chain(&e), "open device x: no RDMA device \"x\"");
    }
}
