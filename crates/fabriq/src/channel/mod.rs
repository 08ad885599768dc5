//! Channels: reliable, ordered, message-boundary-preserving pipes between two endpoints.
//!
//! `wire` is the frame format, `proto` the sans-IO protocol core (eager, rendezvous, seq-ack,
//! credits), `outbuf` what a message to send is held in (a pool buffer, or a small payload in
//! place), `driver` the code that binds a core to a real `QueuePair` and its registered
//! memory. The public, thread-safe handle applications use is [`crate::Channel`].

pub mod driver;
pub mod outbuf;
pub mod proto;
mod window;
pub mod wire;

#[cfg(test)]
pub(crate) mod harness;
#[cfg(test)]
mod tests;

use fabriq_verbs::{VerbsError, WcOpcode, WcStatus};

pub use proto::{ChannelConfig, ChannelStats, PeerGeometry, Thresholds};
pub use wire::{DecodeError, TraceFlags, TraceHeader};

/// Errors of the channel layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChannelError {
    /// No credit and the send queue is full: an expected outcome, retry after progress.
    #[error("channel send queue full (back-pressure)")]
    WouldBlock,
    /// The channel was closed or failed earlier.
    #[error("channel closed")]
    Closed,
    /// The peer went away (its process ended or the connection broke).
    #[error("peer gone")]
    PeerGone,
    /// Nothing arrived before the deadline.
    #[error("timed out")]
    Timeout,
    /// A wait that only the caller's own worker could end, asked for by a handler running that
    /// worker's pass: a receive on a channel of that worker with nothing delivered, a send
    /// there without room, a one-sided operation there. The worker reads, acknowledges and
    /// completes only after the handler returns, so the wait could never end. Nothing was
    /// sent. From a handler use `try_recv` / `try_send`, or serve the method with
    /// `serve_deferred` and do the work elsewhere.
    #[error(
        "a handler waited on a channel of its own worker (nothing sent; it would wait for ever)"
    )]
    WouldDeadlock,
    /// A message above the configured limit.
    #[error("message of {len} bytes exceeds the {max}-byte limit")]
    MessageTooLarge {
        /// Bytes offered.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// A payload that must be in registered memory is not.
    #[error("payload is not in registered memory")]
    NotRegistered,
    /// A configuration value out of range.
    #[error("invalid channel configuration: {0}")]
    InvalidConfig(String),
    /// A work request failed.
    #[error("{opcode:?} work request completed with {status:?}")]
    Completion {
        /// What failed.
        opcode: WcOpcode,
        /// How.
        status: WcStatus,
    },
    /// A malformed frame from the peer.
    #[error("malformed frame from peer: {0}")]
    Decode(#[from] DecodeError),
    /// Connection set-up failed (bad address, refused, malformed or incompatible hello).
    #[error("handshake failed: {0}")]
    Handshake(String),
    /// The connection manager failed to set the channel up (refused, timed out, version,
    /// provider or auth-token mismatch, rejected by the peer, peer gone mid-handshake).
    #[error("connection set-up: {0}")]
    Connect(#[from] crate::conn::ConnError),
    /// A one-sided access outside the remote region, or a misaligned atomic.
    #[error("access at {offset}+{len} outside the {region_len}-byte region or misaligned")]
    OutOfBounds {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Region length.
        region_len: u64,
    },
    /// The memory pool refused an allocation.
    #[error(transparent)]
    Pool(#[from] crate::mempool::PoolError),
    /// The channel failed earlier for this reason.
    #[error("channel failed: {0}")]
    Failed(String),
    /// The peer broke the protocol.
    #[error("protocol violation by peer: {0}")]
    Protocol(String),
    /// The peer refused the channel: it has as many open on the connection as it allows
    /// (its `Config::max_streams`). Close channels to it, or connect again later.
    #[error("the peer refused the channel: it has as many open on this connection as it allows")]
    StreamRefused,
    /// The verbs layer refused a call.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
}

impl ChannelError {
    /// True for back-pressure, which callers retry.
    pub fn is_would_block(&self) -> bool {
        matches!(self, ChannelError::WouldBlock)
    }
}
