//! What an endpoint refused or cut off to bound what its peers can make it hold: counters its
//! workers, responders and accepting side bump when a limit or a protocol rule stopped a peer,
//! read by [`crate::Endpoint::guard_stats`]. Each event is also logged at `warn`; the counters
//! let an operator see how often without reading logs.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of an endpoint's refusals, from its start ([`crate::Endpoint::guard_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GuardStats {
    /// Handshakes rejected because the endpoint kept `Config::max_connections` connections
    /// from peers (the peer was told `Unavailable`).
    pub connections_rejected: u64,
    /// Streams a peer opened past `Config::max_streams` on one connection, refused.
    pub streams_refused: u64,
    /// Connections failed because the peer broke the protocol: a stream sent past its window,
    /// more calls out than the call window, a malformed or impossible frame.
    pub protocol_violations: u64,
    /// RPC replies the server had no pool memory for (`Config::pool_max_bytes`): their callers
    /// were answered with [`crate::rpc::NO_MEMORY`].
    pub replies_without_memory: u64,
}

/// An endpoint's counters, shared by its workers (`super::EndpointShared`): bumped on any
/// thread, read on any. Rare events: relaxed adds.
///
/// Not in a worker's shared side: that struct is on the message path, and growing it —
/// even by whole cache lines, every field keeping its neighbours — made the 8 B one-way
/// latency 4–8% slower (`bench/ab.sh`, 0 of 15 rounds faster).
#[derive(Debug, Default)]
pub(crate) struct GuardCounters {
    connections_rejected: AtomicU64,
    streams_refused: AtomicU64,
    protocol_violations: AtomicU64,
    replies_without_memory: AtomicU64,
}

impl GuardCounters {
    pub(crate) fn connection_rejected(&self) {
        self.connections_rejected.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn stream_refused(&self) {
        self.streams_refused.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn protocol_violation(&self) {
        self.protocol_violations.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn reply_without_memory(&self) {
        self.replies_without_memory.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> GuardStats {
        GuardStats {
            connections_rejected: self.connections_rejected.load(Ordering::Relaxed),
            streams_refused: self.streams_refused.load(Ordering::Relaxed),
            protocol_violations: self.protocol_violations.load(Ordering::Relaxed),
            replies_without_memory: self.replies_without_memory.load(Ordering::Relaxed),
        }
    }
}
