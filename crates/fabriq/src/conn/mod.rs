//! Connection management: the out-of-band handshake over TCP, the QP cache, and the
//! connection pool.
//!
//! What it owns:
//! - **Handshake** ([`wire`] for the messages, sans-IO; `handshake` for the blocking driver):
//!   a versioned hello carrying everything the channel needs to start (provider, device, QP
//!   endpoint, receive-ring geometry, initial credits, eager threshold, rendezvous chunk size,
//!   worker id, auth token), exchanged over a TCP control stream, then both QPs driven to RTS.
//! - **No RNR, ever**: a QP is handed to the caller in INIT inside a [`PendingConn`] so it can
//!   post its receive ring before [`PendingConn::finish`] moves it to RTR. A side only learns the
//!   peer's QP (and so can only send to it) after the peer's receives are posted:
//!
//!   ```text
//!   client                                        server
//!   QP INIT ── Hello{client QP} ───────────────▶  read hello, QP INIT
//!   caller may post receives now                  caller posts receives   (accept_pending)
//!     (connect_pending_early)                     RTR → RTS               (finish)
//!   read ack ◀──────────── HelloAck{server QP} ──
//!   caller posts receives, if not yet (connect_pending)
//!   RTR → RTS              (finish)
//!   ─── Ready ─────────────────────────────────▶  read Ready → Established
//!   Established: may send at once                 may send at once
//!   ```
//! - **QP cache** ([`QpCache`]): QPs of released connections go back to RESET and are reused,
//!   so a connect that hits the cache skips QP creation.
//! - **Control-stream reuse**: after a handshake the TCP control stream stays open (client: in
//!   an idle set per peer address; server: polled by the [`Listener`]), so the next connect to
//!   that peer skips the TCP handshake too.
//! - **Connection pool** ([`ConnPool`]): one shared, refcounted connection per (peer address,
//!   worker), so connections grow with peers, not with threads × peers.
//!
//! What it does not do: post sends, size rings, or poll completions — the channel does, with
//! the [`Hello`]s this module hands over. See `docs/arch/conn.md`.

mod control;
mod greeting;
mod handshake;
mod manager;
mod pool;
mod qp_cache;
mod region_cache;
mod stream;
#[cfg(test)]
mod tests;
pub mod wire;

use std::net::SocketAddr;
use std::time::Duration;

use fabriq_verbs::{AccessFlags, PostError, QpCaps, VerbsError};

pub use control::{ControlEvent, ControlStream, HangupProbe, QpLease};
pub use manager::{
    ConnManager, ConnStats, Established, Incoming, Listener, ListenerCloser, PendingConn, Role,
};
pub use pool::{ConnPool, ConnPoolStats, PeerKey};
pub use qp_cache::QpCache;
pub use region_cache::RegionCache;
pub use wire::{
    DecodeError, Hello, LocalHello, PeerHello, Reject, RejectCode, RingGeometry, VERSION,
};

/// Errors of the connection manager. Errors caused by one peer concern that handshake only:
/// the [`Listener`] and [`ConnManager`] stay usable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnError {
    /// The verbs layer refused a QP creation or transition.
    #[error("verbs: {0}")]
    Verbs(#[from] VerbsError),
    /// Posting receives (in a prepare callback) failed.
    #[error("posting receives: {0}")]
    Post(#[from] PostError),
    /// Nothing listens at the address.
    #[error("connection to {addr} refused")]
    Refused {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A step of the handshake did not finish in time.
    #[error("timed out after {after:?} during {phase} (peer {})", fmt_peer(peer))]
    Timeout {
        /// The peer, once known.
        peer: Option<SocketAddr>,
        /// The step: `"tcp connect"`, `"hello"`, `"hello-ack"`, `"ready"`, `"accept"`.
        phase: &'static str,
        /// The time allowed.
        after: Duration,
    },
    /// The peer speaks another handshake version.
    #[error("handshake version mismatch: local {local}, peer {peer}")]
    VersionMismatch {
        /// Ours.
        local: u16,
        /// Theirs.
        peer: u16,
    },
    /// The peer uses another provider; QPs of different providers cannot connect.
    #[error("provider mismatch: local {local:?}, peer {peer:?}")]
    ProviderMismatch {
        /// Ours.
        local: String,
        /// Theirs.
        peer: String,
    },
    /// The peer closed the control stream before the handshake finished.
    #[error("peer {peer} closed the connection during {phase}")]
    PeerClosed {
        /// The peer.
        peer: SocketAddr,
        /// The step.
        phase: &'static str,
    },
    /// The peer sent bytes that are not a valid handshake message.
    #[error("malformed handshake message from {peer}: {source}")]
    Malformed {
        /// The peer.
        peer: SocketAddr,
        /// What was wrong.
        #[source]
        source: DecodeError,
    },
    /// The peer sent a valid message out of order.
    #[error("unexpected {got} from {peer} during {phase}")]
    Unexpected {
        /// The peer.
        peer: SocketAddr,
        /// The step.
        phase: &'static str,
        /// The message received.
        got: &'static str,
    },
    /// The peer refused the handshake.
    #[error("peer {peer} rejected the handshake ({code:?}): {reason}")]
    Rejected {
        /// The peer.
        peer: SocketAddr,
        /// Why.
        code: RejectCode,
        /// The peer's detail.
        reason: String,
    },
    /// An operating-system error on the control stream or listener.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The peer's auth token does not match ours.
    #[error("peer {peer} failed authentication")]
    AuthFailed {
        /// The peer.
        peer: SocketAddr,
    },
    /// The peer asked for a worker this manager is not.
    #[error("peer asked for worker {requested}, this is worker {local}")]
    WrongWorker {
        /// The worker asked for.
        requested: u32,
        /// This manager's worker.
        local: u32,
    },
    /// Server side: a peer's handshake turned away because the endpoint keeps as many
    /// connections as it may (`Config::max_connections`); the peer was told `Unavailable`.
    #[error("rejected {peer}: this endpoint keeps {max} connections (max_connections)")]
    AtCapacity {
        /// The peer.
        peer: SocketAddr,
        /// The bound.
        max: u32,
    },
    /// The listener was closed.
    #[error("listener closed")]
    Closed,
    /// The configuration is inconsistent.
    #[error("invalid connection configuration: {0}")]
    InvalidConfig(String),
}

fn fmt_peer(peer: &Option<SocketAddr>) -> String {
    peer.map_or_else(|| "unknown".to_string(), |p| p.to_string())
}

impl ConnError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        ConnError::Io {
            context: context.into(),
            source,
        }
    }
}

/// The busy-poll budget of a handshake wait on a host of at least [`HANDSHAKE_SPIN_MIN_CPUS`]
/// CPUs (see [`default_handshake_spin`]).
pub const DEFAULT_HANDSHAKE_SPIN: Duration = Duration::from_micros(50);

/// The fewest CPUs on which the default handshake spins.
pub const HANDSHAKE_SPIN_MIN_CPUS: usize = 2;

/// The default of [`ConnConfig::handshake_spin`] (and of an unset
/// `Config::handshake_spin_us`): [`DEFAULT_HANDSHAKE_SPIN`] on a host of at least
/// [`HANDSHAKE_SPIN_MIN_CPUS`] CPUs, else zero: on one CPU a spinning thread holds the core the
/// thread it waits for needs. On a quiet 2-vCPU host a 50 µs spin halved cached connects
/// through `Endpoint` on shm0 and left tcp0 within its noise (`docs/BENCHMARKS.md`,
/// "Connection set-up"); runs on a 2-core host loaded by other work had measured it slower.
pub fn default_handshake_spin() -> Duration {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus >= HANDSHAKE_SPIN_MIN_CPUS {
        DEFAULT_HANDSHAKE_SPIN
    } else {
        Duration::ZERO
    }
}

/// Configuration of a [`ConnManager`]: the handshake's parameters and this side's announcement.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ConnConfig {
    /// Time allowed for each handshake (connect, or one accepted peer). Default 5 s.
    pub handshake_timeout: Duration,
    /// Busy-poll budget of each wait on a control stream during a handshake (the client's
    /// wait for the hello-ack, the server's for a hello and for Ready, the listener's poll for
    /// the next peer): the socket is polled without blocking for this long, then the wait
    /// sleeps in the kernel until the message or the deadline. Spinning saves the thread
    /// wake-up at each hop of the exchange (tens of microseconds on a loaded host) at the cost
    /// of a busy core while it lasts. On a local (Unix) control stream, whose writer wakes the
    /// reader in about a microsecond, only the client's wait for the hello-ack spins, and only
    /// on a thread pinned to one CPU (`docs/arch/conn.md`, "Waiting on the control stream").
    /// Zero: never spin (block at once); at most `handshake_timeout`. Default:
    /// [`default_handshake_spin`] (50 µs on a host of 2 or more CPUs, else zero).
    pub handshake_spin: Duration,
    /// Remote-access rights granted to the peer on each QP. Default READ | WRITE | ATOMIC.
    pub access: AccessFlags,
    /// Work-queue sizes of every QP. `max_recv_wr` must hold the receive ring unless an SRQ is
    /// used.
    pub qp_caps: QpCaps,
    /// Signal every send (`sq_sig_all`). Default false (selective signaling).
    pub sq_sig_all: bool,
    /// Most QPs kept in RESET for reuse. Default 64.
    pub qp_cache_capacity: usize,
    /// Keep control streams open after a handshake and reuse them. Default true.
    pub reuse_control_streams: bool,
    /// With `reuse_control_streams`: the listener also takes control streams on a Unix socket
    /// of its own (abstract namespace, random name) and names it in its hello-ack; a client
    /// that reached a listener of this host over TCP opens its later control streams there
    /// (see `conn::stream`). Default true.
    pub local_control_streams: bool,
    /// Most idle control streams kept per peer address (client side). Default 4.
    pub max_idle_streams_per_peer: usize,
    /// Most control streams a [`Listener`] keeps open for further handshakes (server side);
    /// beyond it the oldest is closed. Default 1024.
    pub max_kept_streams: usize,
    /// This side's worker id.
    pub worker_id: u32,
    /// The receive ring this side posts on each connection.
    pub ring: RingGeometry,
    /// Credits granted to the peer at start (≤ `ring.slots`).
    pub initial_credits: u32,
    /// Largest payload sent eagerly. Default 4 KiB.
    pub eager_threshold: u32,
    /// Rendezvous READ chunk size. Default 64 KiB.
    pub rndv_chunk_size: u32,
    /// Data messages of one stream this side lets its peer have unconsumed before the peer's
    /// sender waits (the connection uses the smaller of both sides'). 4 ..= 65 536, default 64.
    pub stream_window: u32,
    /// Authentication token sent in the hello and required from peers when non-empty.
    pub auth_token: Vec<u8>,
    /// RNR retry count set at RTS (0..=7, 7 = forever); `None` keeps the verbs default. A
    /// channel whose receives are always posted before the peer may send can set 0, so that
    /// any RNR is a hard error instead of a silent stall.
    pub rnr_retry: Option<u8>,
}

impl Default for ConnConfig {
    fn default() -> Self {
        ConnConfig {
            handshake_timeout: Duration::from_secs(5),
            handshake_spin: default_handshake_spin(),
            access: AccessFlags::LOCAL_WRITE
                | AccessFlags::REMOTE_READ
                | AccessFlags::REMOTE_WRITE
                | AccessFlags::REMOTE_ATOMIC,
            qp_caps: QpCaps::default(),
            sq_sig_all: false,
            qp_cache_capacity: 64,
            reuse_control_streams: true,
            local_control_streams: true,
            max_idle_streams_per_peer: 4,
            max_kept_streams: 1024,
            worker_id: 0,
            ring: RingGeometry {
                slots: 64,
                slot_size: 4096 + 64,
            },
            initial_credits: 64,
            eager_threshold: 4096,
            stream_window: crate::channel::wire::STREAM_WINDOW as u32,
            rndv_chunk_size: 64 * 1024,
            auth_token: Vec::new(),
            rnr_retry: None,
        }
    }
}

impl ConnConfig {
    /// Check the invariants the handshake relies on. `has_srq`: receives come from an SRQ, so
    /// the QP's own receive queue need not hold the ring.
    pub fn validate(&self, has_srq: bool) -> Result<(), ConnError> {
        let bad = |m: String| Err(ConnError::InvalidConfig(m));
        if self.ring.slots == 0 || self.ring.slot_size == 0 {
            return bad("ring needs at least one slot of at least one byte".into());
        }
        if self.initial_credits > self.ring.slots {
            return bad(format!(
                "initial_credits {} exceed ring slots {}",
                self.initial_credits, self.ring.slots
            ));
        }
        if !has_srq && self.qp_caps.max_recv_wr < self.ring.slots {
            return bad(format!(
                "qp max_recv_wr {} cannot hold the ring of {} slots",
                self.qp_caps.max_recv_wr, self.ring.slots
            ));
        }
        if self.rndv_chunk_size == 0 {
            return bad("rndv_chunk_size is zero".into());
        }
        if !wire::STREAM_WINDOW_RANGE.contains(&self.stream_window) {
            return bad(format!(
                "stream_window {} outside {:?}",
                self.stream_window,
                wire::STREAM_WINDOW_RANGE
            ));
        }
        if self.auth_token.len() > wire::MAX_TOKEN_LEN {
            return bad(format!(
                "auth token of {} bytes exceeds {}",
                self.auth_token.len(),
                wire::MAX_TOKEN_LEN
            ));
        }
        if self.rnr_retry.is_some_and(|n| n > 7) {
            return bad("rnr_retry must be in 0..=7".into());
        }
        if self.handshake_timeout.is_zero() {
            return bad("handshake_timeout is zero".into());
        }
        if self.handshake_spin > self.handshake_timeout {
            return bad(format!(
                "handshake_spin {:?} exceeds handshake_timeout {:?}",
                self.handshake_spin, self.handshake_timeout
            ));
        }
        self.access.validate()?;
        Ok(())
    }
}
