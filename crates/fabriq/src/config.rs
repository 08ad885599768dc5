//! Endpoint configuration: one documented format, set from code, from a TOML file, or from
//! `FABRIQ_*` environment variables (which override the file).
//!
//! ```toml
//! # fabriq.toml — every key optional; the values shown are the defaults
//! device = "auto"            # "auto" (an active RDMA NIC, else shm0 for peers on this host and
//!                             #  tcp0 for the others), or a device name
//! workers = 1                # run-to-completion workers (one CQ, one thread each)
//! progress = "thread"        # who drives the workers: "thread" (a worker thread busy-polls,
//!                            # then sleeps) or "caller" (application threads poll in send,
//!                            # recv and calls; the worker thread only serves while none does)
//! pin_workers = false        # pin worker i to CPU i
//! idle_spin_us = 50          # busy-poll this long after the last work, then sleep
//! rpc_timeout_ms = 5000      # default deadline of Rpc::call_default, and of a handler's
//!                            # waits (recv, send, one-sided; the shorter deadline counts)
//! remote_timeout_ms = 5000   # deadline of each one-sided operation (RemoteRegion::with_timeout
//!                            # sets one region's); past it: Timeout, the outcome unknown
//! handshake_timeout_ms = 5000
//! # handshake_spin_us = 50   # each handshake wait on the control stream busy-polls this long,
//!                            # then sleeps (0: never spin); unset: 50 on a host of 2 or more
//!                            # CPUs, else 0
//! link_speed_gbps = 0        # picks thresholds: 25 → 2K/32K, 100 → 4K/64K, 200 → 8K/128K; 0 = device's
//! rx_slots = 16              # receive ring per channel (the peer's credits); slots hold the
//!                            # eager threshold + headers
//! sq_depth = 128
//! signal_every = 16          # one SEND in this many asks for a completion (1: every SEND);
//!                            # at most half of sq_depth is used
//! max_queued = 64            # messages queued for credit before send blocks
//! max_message_len = 4294967296
//! # eager_max = 4096         # override the profile's eager threshold
//! # pool_max_bytes = 1073741824  # most bytes one thread's memory pool registers (unset: no
//!                            # bound); a message or reply past it fails with a pool error
//! pool_idle_bytes = 8388608  # entirely free memory each thread's pool keeps registered for
//!                            # reuse; beyond it, freed slabs are deregistered
//! pool_reclaim_ms = 1000     # a worker quiet this long takes back what other threads freed
//!                            # into its pool, trims it to pool_idle_bytes and lets go of the
//!                            # large buffers it kept if none was reused (0: only on free)
//! # chunk_size = 65536       # override the profile's READ chunk
//! reads_in_flight = 16       # RDMA READs of one rendezvous pull in flight
//! rnr_retry = 7              # QP RNR retries (the credit scheme never needs one; 0 makes any
//!                            # RNR a hard error)
//! auth_token = ""            # sent in the connection hello; when set, peers must present it
//! qp_cache_size = 64         # QPs of closed channels kept (reset) per worker for reuse
//! reuse_control_streams = true  # keep a closed connection's TCP control stream for the next connect
//! local_control_streams = true  # with reuse: to a peer on this host, control streams after the
//!                            # first go over a Unix socket (cheaper than loopback TCP)
//! share_connections = true   # channels to one peer share one connection per worker (false: a
//!                            # connection per channel, e.g. to give a flow its own credits)
//! stream_window = 64         # data of one channel the peer may hold unconsumed before its
//!                            # sender waits, in units (a message counts one per MiB it started,
//!                            # half the window at most), and RPC calls of one channel out at
//!                            # once (4..=65536; a connection uses the smaller side's)
//! max_streams = 4096         # channels a peer may have open at once on one connection it
//!                            # made to this endpoint; more are refused (1..=1048576)
//! max_connections = 4096     # connections peers made to this endpoint it keeps at once (each
//!                            # holds a receive ring); a handshake past it is rejected
//!                            # (Unavailable) (1..=1048576)
//! ack_delay_us = 50          # a received message is acknowledged at the latest this long after
//!                            # delivery when no frame going back carries the ack (1..=10000000)
//! close_linger_ms = 5000     # a connection whose last channel closed keeps going this long at
//!                            # most for what it still has to deliver (0: close at once)
//!
//! [device_options]           # provider options for a named device (tcp0, udp0: progress, …);
//! # progress = "thread"      # default for tcp devices, and udp ones on more than one CPU:
//!                            # progress = "busy" (pollers read the sockets: lowest latency);
//!                            # "thread" leaves them to the provider's thread (more bandwidth
//!                            # for large streams on few cores)
//! ```
//!
//! Environment: `FABRIQ_DEVICE`, `FABRIQ_WORKERS`, `FABRIQ_PROGRESS`, `FABRIQ_PIN_WORKERS`, `FABRIQ_IDLE_SPIN_US`,
//! `FABRIQ_RPC_TIMEOUT_MS`, `FABRIQ_REMOTE_TIMEOUT_MS`, `FABRIQ_HANDSHAKE_TIMEOUT_MS`, `FABRIQ_HANDSHAKE_SPIN_US`, `FABRIQ_LINK_SPEED_GBPS`,
//! `FABRIQ_RX_SLOTS`, `FABRIQ_SQ_DEPTH`, `FABRIQ_SIGNAL_EVERY`, `FABRIQ_MAX_QUEUED`, `FABRIQ_MAX_MESSAGE_LEN`,
//! `FABRIQ_EAGER_MAX`, `FABRIQ_POOL_MAX_BYTES`, `FABRIQ_POOL_IDLE_BYTES`, `FABRIQ_POOL_RECLAIM_MS`, `FABRIQ_CHUNK_SIZE`, `FABRIQ_READS_IN_FLIGHT`, `FABRIQ_RNR_RETRY`,
//! `FABRIQ_AUTH_TOKEN`, `FABRIQ_QP_CACHE_SIZE`, `FABRIQ_REUSE_CONTROL_STREAMS`, `FABRIQ_LOCAL_CONTROL_STREAMS`,
//! `FABRIQ_SHARE_CONNECTIONS`, `FABRIQ_STREAM_WINDOW`, `FABRIQ_MAX_STREAMS`, `FABRIQ_MAX_CONNECTIONS`, `FABRIQ_ACK_DELAY_US`, `FABRIQ_CLOSE_LINGER_MS`, `FABRIQ_DEVICE_OPTIONS` (`key=value,key=value`); `FABRIQ_CONFIG` names a
//! TOML file read by [`Config::from_env`].

use std::path::Path;
use std::time::Duration;

use crate::channel::proto::ChannelConfig;
use crate::channel::wire::HEADER_LEN;
use crate::channel::Thresholds;

/// Errors reading a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown keys.
    #[error("parsing configuration: {0}")]
    Toml(#[from] toml::de::Error),
    /// An environment variable holds no valid value.
    #[error("environment variable {name}={value:?}: {why}")]
    Env {
        /// Variable.
        name: String,
        /// Value.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// Values that do not fit together.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Who drives a worker's event loop (its progress pass: inbox, CQ, timers, channels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Progress {
    /// A worker thread per worker busy-polls while work arrives and sleeps on the CQ's event fd
    /// when idle; application threads hand work over and progress the worker themselves only
    /// when it is free.
    #[default]
    Thread,
    /// Application threads drive their worker: `send` posts directly, blocking `recv`,
    /// `Rpc::call` and one-sided operations poll the CQ themselves (busy-poll budget
    /// `idle_spin_us`, then sleep on the CQ event fd). RPC handlers run on whichever thread
    /// progresses. The worker thread is only a back-stop that serves the endpoint (handlers,
    /// async tasks, peer hang-ups) while no application thread has called in for a few
    /// milliseconds.
    Caller,
}

impl std::str::FromStr for Progress {
    type Err = String;
    fn from_str(s: &str) -> Result<Progress, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "thread" => Ok(Progress::Thread),
            "caller" => Ok(Progress::Caller),
            other => Err(format!("{other:?} is neither \"thread\" nor \"caller\"")),
        }
    }
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Progress::Thread => "thread",
            Progress::Caller => "caller",
        })
    }
}

/// Endpoint configuration. See the [module docs](self) for the file format.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `auto`, or a device name (`shm0`, `tcp0`, …). `auto` takes an RDMA device whose port
    /// is up; without one, the endpoint runs two devices: `shm0` for peers on this host (the
    /// peer's address is one of this host's) and `tcp0` for the others, behind one listening
    /// address. That `tcp0` accepts its data connections on every interface (as UCX's tcp
    /// transport does) unless `FABRIQ_TCP_BIND` names an address; a connection is accepted only
    /// with the hello of a QP the handshake announced.
    pub device: String,
    /// Workers (one CQ and one thread each).
    pub workers: usize,
    /// Who drives the workers.
    pub progress: Progress,
    /// Pin worker `i` to CPU `i`.
    pub pin_workers: bool,
    /// Busy-poll budget after the last piece of work, microseconds. Where the endpoint was
    /// built with one CPU allowed, its threads share that CPU and yield it at every round of
    /// the spin instead of holding it.
    pub idle_spin_us: u64,
    /// Default RPC deadline, milliseconds; also how long a handler's wait without a deadline
    /// of its own (`recv`, a back-pressured `send`, a one-sided operation) may take before it
    /// ends with `Timeout`.
    pub rpc_timeout_ms: u64,
    /// Deadline of each one-sided operation of a [`crate::RemoteRegion`], milliseconds (unless
    /// the region sets its own): an operation not complete by then ends with `Timeout`, its
    /// outcome unknown (it may still take effect at the owner).
    pub remote_timeout_ms: u64,
    /// Connection handshake timeout, milliseconds.
    pub handshake_timeout_ms: u64,
    /// Busy-poll budget of each wait on a control stream during a connection handshake
    /// (hello-ack, hello, Ready, the listener's wait for the next peer), microseconds; then the
    /// wait sleeps. On a same-host (Unix) control stream only a pinned thread's wait for the
    /// hello-ack spins ([`crate::conn::ConnConfig::handshake_spin`]). 0: never spin. `None`:
    /// [`crate::conn::default_handshake_spin`] (50 µs on a host of 2 or more CPUs, else 0).
    pub handshake_spin_us: Option<u64>,
    /// Link speed for the threshold profile (0: ask the device).
    pub link_speed_gbps: u32,
    /// Receive slots per channel.
    pub rx_slots: u32,
    /// Send-queue depth used by the channel protocol.
    pub sq_depth: u32,
    /// One SEND in this many is signaled (selective signaling; 1: all).
    pub signal_every: u32,
    /// Messages queued waiting for credit before `send` blocks.
    pub max_queued: u32,
    /// Largest message, RPC header included: a longer one is refused where it is offered
    /// (`send`, `try_send`, `send_buf`, `Rpc::call`: [`crate::ChannelError::MessageTooLarge`]),
    /// a handler's longer reply reaches its caller as `RpcError::Handler("too large")`, and a
    /// peer's longer message fails the connection (a protocol error: the ends do not exchange
    /// their limits).
    pub max_message_len: u64,
    /// Eager threshold override.
    pub eager_max: Option<u32>,
    /// Most bytes each thread's memory pool registers, slabs and large buffers
    /// (`FABRIQ_POOL_MAX_BYTES`, at least 2 MiB; unset: no bound). Memory kept for reuse (idle
    /// slabs, cached large buffers) gives way first; an allocation still past it fails with
    /// [`crate::mempool::PoolError`]: a send says so, an RPC reply that finds no room answers
    /// its caller `RpcError::Handler("no memory")`, a rendezvous pull waits for memory — and a
    /// message above the bound itself fails its connection with
    /// [`crate::ChannelError::MessageTooLarge`].
    pub pool_max_bytes: Option<u64>,
    /// Entirely free memory each thread's pool keeps registered for reuse; freed slabs beyond
    /// it are deregistered (`FABRIQ_POOL_IDLE_BYTES`, default 8 MiB).
    pub pool_idle_bytes: u64,
    /// A worker that has slept this long reclaims idle buffer memory: it takes back what
    /// other threads freed into its pool (a pool does that by itself only when its thread next
    /// allocates), trims the pool to `pool_idle_bytes`, and deregisters the large buffers it
    /// kept for reuse if none was reused since its last reclaim (`FABRIQ_POOL_RECLAIM_MS`,
    /// default 1000; 0: memory goes back only as it is freed). A worker that holds no more
    /// than the mark sleeps without this timer.
    pub pool_reclaim_ms: u64,
    /// READ chunk override.
    pub chunk_size: Option<u32>,
    /// READs in flight per channel.
    pub reads_in_flight: u32,
    /// RNR retry count of every QP (0..=7, 7 = forever).
    pub rnr_retry: u8,
    /// Provider options for opening a named device (see [`Config::device_config`]).
    pub device_options: std::collections::BTreeMap<String, String>,
    /// Connection auth token (empty: none). Sent in the hello; when set, a peer must present
    /// the same token, else both sides fail the handshake.
    pub auth_token: String,
    /// QPs of closed channels kept per worker (in RESET) for the next connect.
    pub qp_cache_size: usize,
    /// Keep a closed connection's TCP control stream open for the next connect to that peer.
    pub reuse_control_streams: bool,
    /// With `reuse_control_streams`: a peer on this host is reached over TCP once, and its
    /// later (kept) control streams go over the Unix socket its listener names in the
    /// handshake — a loopback write there costs about a quarter of a TCP one
    /// (`FABRIQ_LOCAL_CONTROL_STREAMS`, default true; `docs/arch/conn.md`).
    pub local_control_streams: bool,
    /// Channels to one peer share one connection per worker (the connection pool). `false`:
    /// every `connect` sets up a connection of its own (its own receive ring and credits).
    pub share_connections: bool,
    /// Data of one channel (stream) the peer's sender may have here unconsumed by the
    /// application before it waits, in units: a message counts one per MiB it started, half
    /// the window at most (`FABRIQ_STREAM_WINDOW`, 4 ..= 65 536, default 64): a reader that
    /// stops holds back only its own channel, by at most this many MiB or two messages. Also the
    /// RPC calls of one channel out at once (more wait for replies). Announced in the hello;
    /// a connection uses the smaller of the two sides'; a peer past it breaks the protocol.
    pub stream_window: u32,
    /// Channels (streams) a peer may have open at once on one connection it made to this
    /// endpoint (`FABRIQ_MAX_STREAMS`, 1 ..= 1 048 576, default 4096), counting those not yet
    /// accepted and those the application here still holds: a stream past it is refused (the
    /// opener's channel fails with [`crate::ChannelError::StreamRefused`]), so a peer cannot
    /// make this side keep streams without bound.
    pub max_streams: u32,
    /// Connections peers made to this endpoint that it keeps at once, over all its listeners
    /// (`FABRIQ_MAX_CONNECTIONS`, 1 ..= 1 048 576, default 4096): each holds a QP and a
    /// registered receive ring (`rx_slots` × the slot size) until it closed and the
    /// application dropped its channels. A handshake past it is rejected with
    /// `RejectCode::Unavailable`, so peers cannot make this side pin memory without bound.
    pub max_connections: u32,
    /// Longest a delivered message waits for its acknowledgement when no frame going back
    /// carries it (a lone ack goes then), microseconds (1 ..= 10 000 000, default 50). Acks also
    /// go at once every quarter ring of deliveries.
    pub ack_delay_us: u64,
    /// When the connecting side's last channel on a connection closes, what was sent on it
    /// still arrives: the connection waits until every message is acknowledged (a rendezvous
    /// one pulled by the peer) and every one-sided operation is done, at most this long,
    /// milliseconds (`FABRIQ_CLOSE_LINGER_MS`, 0 ..= 3 600 000, default 5000; 0 closes at
    /// once and drops what is still on its way). When the endpoint's last handle goes, every
    /// connection (accepted ones too) delivers what is on its way the same way before the
    /// workers stop.
    pub close_linger_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            device: "auto".into(),
            workers: 1,
            progress: Progress::Thread,
            pin_workers: false,
            idle_spin_us: 50,
            rpc_timeout_ms: 5000,
            remote_timeout_ms: 5000,
            handshake_timeout_ms: 5000,
            handshake_spin_us: None,
            link_speed_gbps: 0,
            rx_slots: 16,
            sq_depth: 128,
            signal_every: 16,
            max_queued: 64,
            max_message_len: 4 << 30,
            eager_max: None,
            pool_max_bytes: None,
            pool_idle_bytes: 8 << 20,
            pool_reclaim_ms: 1000,
            chunk_size: None,
            reads_in_flight: 16,
            rnr_retry: 7,
            device_options: std::collections::BTreeMap::new(),
            auth_token: String::new(),
            qp_cache_size: 64,
            reuse_control_streams: true,
            local_control_streams: true,
            share_connections: true,
            stream_window: crate::channel::wire::STREAM_WINDOW as u32,
            max_streams: 4096,
            max_connections: 4096,
            ack_delay_us: 50,
            close_linger_ms: 5000,
        }
    }
}

impl Config {
    /// Parse TOML text.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text)?;
        c.validate()?;
        Ok(c)
    }

    /// Read a TOML file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Config, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Config::from_toml_str(&text)
    }

    /// Defaults, then the file named by `FABRIQ_CONFIG` if set, then `FABRIQ_*` variables.
    pub fn from_env() -> Result<Config, ConfigError> {
        let base = match std::env::var("FABRIQ_CONFIG") {
            Ok(path) if !path.is_empty() => Config::from_file(path)?,
            _ => Config::default(),
        };
        base.with_env_vars(|k| std::env::var(k).ok())
    }

    /// Apply `FABRIQ_*` overrides looked up through `get` (testable without touching the
    /// process environment).
    pub fn with_env_vars(
        mut self,
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        fn parse<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, ConfigError>
        where
            T::Err: std::fmt::Display,
        {
            v.trim().parse::<T>().map_err(|e| ConfigError::Env {
                name: name.into(),
                value: v.into(),
                why: e.to_string(),
            })
        }
        fn parse_bool(name: &str, v: &str) -> Result<bool, ConfigError> {
            match v.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => Ok(true),
                "0" | "false" | "no" | "off" => Ok(false),
                _ => Err(ConfigError::Env {
                    name: name.into(),
                    value: v.into(),
                    why: "expected true/false".into(),
                }),
            }
        }
        macro_rules! var {
            ($name:literal, $field:expr, $conv:expr) => {
                if let Some(v) = get($name) {
                    $field = $conv($name, &v)?;
                }
            };
        }
        if let Some(v) = get("FABRIQ_DEVICE") {
            self.device = v;
        }
        var!("FABRIQ_WORKERS", self.workers, parse);
        var!("FABRIQ_PROGRESS", self.progress, parse);
        var!("FABRIQ_PIN_WORKERS", self.pin_workers, parse_bool);
        var!("FABRIQ_IDLE_SPIN_US", self.idle_spin_us, parse);
        var!("FABRIQ_RPC_TIMEOUT_MS", self.rpc_timeout_ms, parse);
        var!("FABRIQ_REMOTE_TIMEOUT_MS", self.remote_timeout_ms, parse);
        var!(
            "FABRIQ_HANDSHAKE_TIMEOUT_MS",
            self.handshake_timeout_ms,
            parse
        );
        if let Some(v) = get("FABRIQ_HANDSHAKE_SPIN_US") {
            self.handshake_spin_us = Some(parse("FABRIQ_HANDSHAKE_SPIN_US", &v)?);
        }
        var!("FABRIQ_LINK_SPEED_GBPS", self.link_speed_gbps, parse);
        var!("FABRIQ_RX_SLOTS", self.rx_slots, parse);
        var!("FABRIQ_SQ_DEPTH", self.sq_depth, parse);
        var!("FABRIQ_SIGNAL_EVERY", self.signal_every, parse);
        var!("FABRIQ_MAX_QUEUED", self.max_queued, parse);
        var!("FABRIQ_MAX_MESSAGE_LEN", self.max_message_len, parse);
        var!("FABRIQ_READS_IN_FLIGHT", self.reads_in_flight, parse);
        var!("FABRIQ_RNR_RETRY", self.rnr_retry, parse);
        var!("FABRIQ_QP_CACHE_SIZE", self.qp_cache_size, parse);
        var!(
            "FABRIQ_REUSE_CONTROL_STREAMS",
            self.reuse_control_streams,
            parse_bool
        );
        var!(
            "FABRIQ_LOCAL_CONTROL_STREAMS",
            self.local_control_streams,
            parse_bool
        );
        var!(
            "FABRIQ_SHARE_CONNECTIONS",
            self.share_connections,
            parse_bool
        );
        var!("FABRIQ_STREAM_WINDOW", self.stream_window, parse);
        var!("FABRIQ_MAX_STREAMS", self.max_streams, parse);
        var!("FABRIQ_MAX_CONNECTIONS", self.max_connections, parse);
        var!("FABRIQ_ACK_DELAY_US", self.ack_delay_us, parse);
        var!("FABRIQ_CLOSE_LINGER_MS", self.close_linger_ms, parse);
        var!("FABRIQ_POOL_IDLE_BYTES", self.pool_idle_bytes, parse);
        var!("FABRIQ_POOL_RECLAIM_MS", self.pool_reclaim_ms, parse);
        if let Some(v) = get("FABRIQ_AUTH_TOKEN") {
            self.auth_token = v;
        }
        if let Some(v) = get("FABRIQ_EAGER_MAX") {
            self.eager_max = Some(parse("FABRIQ_EAGER_MAX", &v)?);
        }
        if let Some(v) = get("FABRIQ_POOL_MAX_BYTES") {
            self.pool_max_bytes = Some(parse("FABRIQ_POOL_MAX_BYTES", &v)?);
        }
        if let Some(v) = get("FABRIQ_DEVICE_OPTIONS") {
            for pair in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let Some((k, val)) = pair.split_once('=') else {
                    return Err(ConfigError::Env {
                        name: "FABRIQ_DEVICE_OPTIONS".into(),
                        value: v.clone(),
                        why: format!("{pair:?} is not key=value"),
                    });
                };
                self.device_options
                    .insert(k.trim().to_string(), val.trim().to_string());
            }
        }
        if let Some(v) = get("FABRIQ_CHUNK_SIZE") {
            self.chunk_size = Some(parse("FABRIQ_CHUNK_SIZE", &v)?);
        }
        self.validate()?;
        Ok(self)
    }

    /// Check ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.into()));
        if self.workers == 0 || self.workers > 256 {
            return bad("workers must be in 1..=256");
        }
        if self.rnr_retry > 7 {
            return bad("rnr_retry must be in 0..=7");
        }
        if self.device.is_empty() {
            return bad("device is empty");
        }
        if self.handshake_spin() > self.handshake_timeout() {
            return bad("handshake_spin_us exceeds handshake_timeout_ms");
        }
        if self.auth_token.len() > crate::conn::wire::MAX_TOKEN_LEN {
            return bad("auth_token is longer than 1024 bytes");
        }
        if !crate::conn::wire::STREAM_WINDOW_RANGE.contains(&self.stream_window) {
            return bad("stream_window must be in 4..=65536");
        }
        if !(1..=1 << 20).contains(&self.max_streams) {
            return bad("max_streams must be in 1..=1048576");
        }
        if !(1..=1 << 20).contains(&self.max_connections) {
            return bad("max_connections must be in 1..=1048576");
        }
        if self.pool_max_bytes.is_some_and(|b| b < 2 << 20) {
            return bad("pool_max_bytes must be at least 2 MiB (one slab)");
        }
        if !(1..=10_000_000).contains(&self.ack_delay_us) {
            return bad("ack_delay_us must be in 1..=10000000");
        }
        if self.close_linger_ms > 3_600_000 {
            return bad("close_linger_ms must be in 0..=3600000");
        }
        if self.pool_reclaim_ms > 3_600_000 {
            return bad("pool_reclaim_ms must be in 0..=3600000");
        }
        self.channel_config(0)
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))
    }

    /// Provider options to open `device` with: `progress = busy` for a device of a socket
    /// provider (`tcp`; `udp` where the calling thread may run on more than one CPU), so that a
    /// worker (or a caller-mode application thread) polling the CQ reads the sockets itself
    /// instead of waiting for the provider's progress thread to wake up (which stays as the
    /// fall-back while nobody polls); then `device_options` on top.
    ///
    /// On one CPU busy progress paid on tcp (channel 8 B one-way 12.6 µs against 34 µs) but not
    /// on udp (86 µs against 67 µs: a datagram waits there for the right poller's turn on the
    /// CPU, where the woken progress thread runs at once), so a udp device keeps its thread
    /// there (`docs/BENCHMARKS.md`, 2026-12-03, ninth round).
    pub fn device_config(&self, device: &str) -> fabriq_verbs::DeviceConfig {
        let mut cfg = fabriq_verbs::DeviceConfig::default();
        let provider = fabriq_verbs::devices()
            .unwrap_or_default()
            .into_iter()
            .find(|d| d.name == device)
            .map(|d| d.provider);
        if busy_progress_pays(provider.as_deref()) {
            cfg.options.insert("progress".into(), "busy".into());
        }
        cfg.options.extend(
            self.device_options
                .iter()
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        cfg
    }

    /// The RPC default deadline.
    pub fn rpc_timeout(&self) -> Duration {
        Duration::from_millis(self.rpc_timeout_ms)
    }

    /// The deadline of a one-sided operation.
    pub fn remote_timeout(&self) -> Duration {
        Duration::from_millis(self.remote_timeout_ms)
    }

    /// The handshake timeout.
    pub fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.handshake_timeout_ms.max(1))
    }

    /// The handshake's busy-poll budget per wait: `handshake_spin_us`, or when unset
    /// [`crate::conn::default_handshake_spin`] (50 µs on a host of 2 or more CPUs, else 0).
    pub fn handshake_spin(&self) -> Duration {
        self.handshake_spin_us
            .map_or_else(crate::conn::default_handshake_spin, Duration::from_micros)
    }

    /// The idle spin budget.
    pub fn idle_spin(&self) -> Duration {
        Duration::from_micros(self.idle_spin_us)
    }

    /// Thresholds for a device of `device_gbps` (used when `link_speed_gbps` is 0).
    pub fn thresholds(&self, device_gbps: u32) -> Thresholds {
        let speed = if self.link_speed_gbps > 0 {
            self.link_speed_gbps
        } else {
            device_gbps
        };
        let mut t = Thresholds::for_link_speed(speed);
        if let Some(e) = self.eager_max {
            t.eager_max = e;
        }
        if let Some(c) = self.chunk_size {
            t.chunk_size = c;
        }
        t.reads_in_flight = self.reads_in_flight;
        t
    }

    /// The channel protocol settings for a device of `device_gbps`. A receive slot holds the
    /// eager threshold in force at set-up plus the headers, and no more: the ring is the largest
    /// per-channel cost (it is registered, and on `shm0` mapped by the peer too), and a slot
    /// stride of exactly the eager size keeps every page of it useful. A threshold raised on a
    /// live channel above the slot sends the larger messages by rendezvous (the core caps eager
    /// sends by the peer's slot size).
    pub fn channel_config(&self, device_gbps: u32) -> ChannelConfig {
        let thresholds = self.thresholds(device_gbps);
        let eager_room = thresholds.eager_max.max(256);
        ChannelConfig {
            rx_slots: self.rx_slots,
            rx_slot_size: eager_room.saturating_add(HEADER_LEN as u32),
            sq_depth: self.sq_depth,
            thresholds,
            ack_delay: Duration::from_micros(self.ack_delay_us),
            max_queued: self.max_queued,
            max_pulls: 4,
            max_message_len: self.max_message_len,
            signal_every: self.signal_every,
        }
    }
}

/// Whether a device of `provider` is best opened with `progress = busy` from this thread (see
/// [`Config::device_config`]).
pub fn busy_progress_pays(provider: Option<&str>) -> bool {
    match provider {
        Some("tcp") => true,
        Some("udp") => !fabriq_verbs::one_cpu_here(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_round_trip_and_unknown_keys_refused() {
        let c = Config::from_toml_str("device = \"tcp0\"\nworkers = 2\neager_max = 1024\n")
            .expect("valid");
        assert_eq!(c.device, "tcp0");
        assert_eq!(c.workers, 2);
        assert_eq!(c.thresholds(100).eager_max, 1024);
        assert_eq!(c.progress, Progress::Thread);
        let c = Config::from_toml_str("progress = \"caller\"\n").expect("valid");
        assert_eq!(c.progress, Progress::Caller);
        assert!(Config::from_toml_str("progress = \"sometimes\"").is_err());
        let c = Config::from_toml_str("device = \"tcp0\"\nworkers = 2\neager_max = 1024\n")
            .expect("valid");
        let text = toml::to_string(&c).expect("serialises");
        assert_eq!(Config::from_toml_str(&text).expect("parses"), c);
        assert!(matches!(
            Config::from_toml_str("wokers = 2"),
            Err(ConfigError::Toml(_))
        ));
    }

    #[test]
    fn env_overrides_and_rejects_garbage() {
        let c = Config::default()
            .with_env_vars(|k| match k {
                "FABRIQ_WORKERS" => Some("3".into()),
                "FABRIQ_LINK_SPEED_GBPS" => Some("25".into()),
                "FABRIQ_PIN_WORKERS" => Some("yes".into()),
                "FABRIQ_PROGRESS" => Some("Caller".into()),
                "FABRIQ_SHARE_CONNECTIONS" => Some("false".into()),
                "FABRIQ_STREAM_WINDOW" => Some("256".into()),
                "FABRIQ_MAX_STREAMS" => Some("16".into()),
                "FABRIQ_MAX_CONNECTIONS" => Some("8".into()),
                "FABRIQ_POOL_MAX_BYTES" => Some("16777216".into()),
                "FABRIQ_REMOTE_TIMEOUT_MS" => Some("250".into()),
                "FABRIQ_POOL_IDLE_BYTES" => Some("0".into()),
                "FABRIQ_POOL_RECLAIM_MS" => Some("20".into()),
                _ => None,
            })
            .expect("valid");
        assert_eq!(c.workers, 3);
        assert_eq!(c.remote_timeout(), Duration::from_millis(250));
        assert_eq!(c.stream_window, 256);
        assert_eq!((c.max_streams, c.max_connections), (16, 8));
        assert_eq!(c.pool_max_bytes, Some(16 << 20));
        assert_eq!((c.pool_idle_bytes, c.pool_reclaim_ms), (0, 20));
        let err = Config::default()
            .with_env_vars(|k| (k == "FABRIQ_POOL_RECLAIM_MS").then(|| "3600001".into()))
            .and_then(|c| c.validate().map(|()| c));
        assert!(err.is_err(), "a reclaim period past an hour");
        let small = Config {
            pool_max_bytes: Some(1 << 20),
            ..Config::default()
        };
        assert!(small.validate().is_err(), "a pool bound below one slab");
        for var in ["FABRIQ_MAX_STREAMS", "FABRIQ_MAX_CONNECTIONS"] {
            for m in ["0", "1048577"] {
                let err = Config::default()
                    .with_env_vars(|k| (k == var).then(|| m.into()))
                    .and_then(|c| c.validate().map(|()| c));
                assert!(err.is_err(), "{var}={m}");
            }
        }
        for w in ["3", "65537"] {
            let err = Config::default()
                .with_env_vars(|k| (k == "FABRIQ_STREAM_WINDOW").then(|| w.into()))
                .and_then(|c| c.validate().map(|()| c));
            assert!(err.is_err(), "stream window {w}");
        }
        assert!(!c.share_connections && Config::default().share_connections);
        assert!(c.pin_workers);
        assert_eq!(c.progress, Progress::Caller);
        let err =
            Config::default().with_env_vars(|k| (k == "FABRIQ_PROGRESS").then(|| "both".into()));
        assert!(matches!(err, Err(ConfigError::Env { .. })));
        assert_eq!(c.thresholds(100).eager_max, 2048);
        let err =
            Config::default().with_env_vars(|k| (k == "FABRIQ_RX_SLOTS").then(|| "lots".into()));
        assert!(matches!(err, Err(ConfigError::Env { .. })));
        let c = Config::default()
            .with_env_vars(|k| {
                (k == "FABRIQ_DEVICE_OPTIONS").then(|| "progress=thread, a = b".into())
            })
            .expect("valid");
        assert_eq!(
            c.device_options.get("progress").map(String::as_str),
            Some("thread")
        );
        assert_eq!(c.device_options.get("a").map(String::as_str), Some("b"));
        assert_eq!(
            c.device_config("tcp0")
                .options
                .get("progress")
                .map(String::as_str),
            Some("thread")
        );
        assert_eq!(
            Config::default()
                .device_config("tcp0")
                .options
                .get("progress")
                .map(String::as_str),
            Some("busy")
        );
        let several_cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) > 1;
        assert_eq!(
            Config::default()
                .device_config("udp0")
                .options
                .get("progress")
                .map(String::as_str),
            several_cpus.then_some("busy")
        );
        // On one CPU udp keeps its progress thread (tcp does not).
        let pinned = std::thread::spawn(|| {
            let core = core_affinity::get_core_ids().and_then(|ids| ids.first().copied());
            let pinned = core.is_some_and(core_affinity::set_for_current);
            let udp = Config::default().device_config("udp0").options;
            let tcp = Config::default().device_config("tcp0").options;
            (
                pinned,
                udp.get("progress").cloned(),
                tcp.get("progress").cloned(),
            )
        })
        .join()
        .expect("pinned thread");
        if pinned.0 {
            assert_eq!(pinned.1, None);
            assert_eq!(pinned.2.as_deref(), Some("busy"));
        } else {
            println!("SKIP (part): this thread cannot be pinned to one CPU");
        }
        assert!(Config::default().device_config("shm0").options.is_empty());
        let err = Config::default()
            .with_env_vars(|k| (k == "FABRIQ_DEVICE_OPTIONS").then(|| "progress".into()));
        assert!(matches!(err, Err(ConfigError::Env { .. })));
        let c = Config::from_toml_str("[device_options]\nprogress = \"thread\"\n").expect("toml");
        assert_eq!(
            c.device_options.get("progress").map(String::as_str),
            Some("thread")
        );
        let err = Config::default().with_env_vars(|k| (k == "FABRIQ_WORKERS").then(|| "0".into()));
        assert!(matches!(err, Err(ConfigError::Invalid(_))));
    }

    #[test]
    fn the_close_linger_is_set_by_file_or_env_and_bounded() {
        assert_eq!(Config::default().close_linger_ms, 5000);
        let c = Config::from_toml_str("close_linger_ms = 0\n").expect("valid");
        assert_eq!(c.close_linger_ms, 0);
        let c = Config::default()
            .with_env_vars(|k| (k == "FABRIQ_CLOSE_LINGER_MS").then(|| "250".into()))
            .expect("valid");
        assert_eq!(c.close_linger_ms, 250);
        for bad in ["3600001", "-1", "soon"] {
            let err = Config::default()
                .with_env_vars(|k| (k == "FABRIQ_CLOSE_LINGER_MS").then(|| bad.into()));
            assert!(
                matches!(err, Err(ConfigError::Invalid(_) | ConfigError::Env { .. })),
                "close linger {bad}"
            );
        }
    }

    #[test]
    fn the_ack_delay_is_set_by_file_or_env_and_reaches_the_channel() {
        assert_eq!(
            Config::default().channel_config(0).ack_delay,
            Duration::from_micros(50)
        );
        let c = Config::from_toml_str("ack_delay_us = 200\n").expect("valid");
        assert_eq!(c.channel_config(0).ack_delay, Duration::from_micros(200));
        let c = Config::default()
            .with_env_vars(|k| (k == "FABRIQ_ACK_DELAY_US").then(|| "1000".into()))
            .expect("valid");
        assert_eq!(c.channel_config(100).ack_delay, Duration::from_millis(1));
        for bad in ["0", "10000001"] {
            let err = Config::default()
                .with_env_vars(|k| (k == "FABRIQ_ACK_DELAY_US").then(|| bad.into()));
            assert!(
                matches!(err, Err(ConfigError::Invalid(_))),
                "ack delay {bad}"
            );
        }
    }

    #[test]
    fn handshake_spin_is_explicit_or_follows_the_cpu_count() {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let auto = if cpus >= crate::conn::HANDSHAKE_SPIN_MIN_CPUS {
            crate::conn::DEFAULT_HANDSHAKE_SPIN
        } else {
            Duration::ZERO
        };
        assert_eq!(Config::default().handshake_spin(), auto);
        assert_eq!(crate::conn::ConnConfig::default().handshake_spin, auto);
        let c = Config::from_toml_str("handshake_spin_us = 0\n").expect("valid");
        assert_eq!(c.handshake_spin(), Duration::ZERO);
        let c = Config::default()
            .with_env_vars(|k| (k == "FABRIQ_HANDSHAKE_SPIN_US").then(|| "120".into()))
            .expect("valid");
        assert_eq!(c.handshake_spin(), Duration::from_micros(120));
        // Longer than the whole handshake is refused.
        let c = Config {
            handshake_timeout_ms: 1,
            handshake_spin_us: Some(1001),
            ..Config::default()
        };
        assert!(matches!(c.validate(), Err(ConfigError::Invalid(_))));
    }
}
