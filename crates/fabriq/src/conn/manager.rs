//! The connection manager: QP creation and reuse, the client and server sides of the
//! handshake, and the listener that multiplexes new and reused control streams.
//!
//! Threads: everything here is blocking and meant for a control thread (or the worker itself
//! at set-up); a [`ConnManager`] is `Send + Sync` and cheap to clone. The data path never
//! enters this module.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixListener;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabriq_verbs::{
    AccessFlags, CompletionQueue, MemoryRegion, ProtectionDomain, QpAttr, QpEndpoint, QpInitAttr,
    QpState, QueuePair, SharedReceiveQueue,
};
use parking_lot::Mutex;

use super::control::{ControlStream, Home, QpLease};
use super::greeting::{Greeted, Greeting};
use super::handshake::{check_peer_hello, reject_code_for, rejected, send_reject, Step};
use super::qp_cache::QpCache;
use super::region_cache::RegionCache;
use super::stream::{self, LocalConnect, Stream};
use super::wire::{Hello, Message, RejectCode, VERSION};
use super::{ConnConfig, ConnError};

/// Which side of the handshake this end was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Connected out.
    Client,
    /// Accepted.
    Server,
}

/// Counters of a [`ConnManager`] (cumulative, except `qps_cached`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ConnStats {
    /// Handshakes completed as client.
    pub connects: u64,
    /// Handshakes completed as server.
    pub accepts: u64,
    /// Handshakes that failed (either side).
    pub failed: u64,
    /// QPs created.
    pub qps_created: u64,
    /// Connects that took a QP from the cache.
    pub qp_cache_hits: u64,
    /// Connects that had to create a QP.
    pub qp_cache_misses: u64,
    /// QPs in the cache now.
    pub qps_cached: u64,
    /// Released QPs destroyed instead of cached (cache full or reset failed).
    pub qps_dropped: u64,
    /// Control streams opened (client side), TCP or local.
    pub streams_opened: u64,
    /// Of `streams_opened`, those opened on a peer's local socket (a listener of this host
    /// whose name its hello-ack gave).
    pub local_streams_opened: u64,
    /// Handshakes that reused an idle control stream (client side).
    pub stream_reuses: u64,
    /// Channel regions (receive rings, send-header slots) taken from the region cache.
    pub region_cache_hits: u64,
    /// Channel regions that had to be registered.
    pub region_cache_misses: u64,
}

impl std::ops::AddAssign for ConnStats {
    /// Sum the counters of several managers (e.g. the workers of one endpoint).
    fn add_assign(&mut self, o: ConnStats) {
        self.connects += o.connects;
        self.accepts += o.accepts;
        self.failed += o.failed;
        self.qps_created += o.qps_created;
        self.qp_cache_hits += o.qp_cache_hits;
        self.qp_cache_misses += o.qp_cache_misses;
        self.qps_cached += o.qps_cached;
        self.qps_dropped += o.qps_dropped;
        self.streams_opened += o.streams_opened;
        self.local_streams_opened += o.local_streams_opened;
        self.stream_reuses += o.stream_reuses;
        self.region_cache_hits += o.region_cache_hits;
        self.region_cache_misses += o.region_cache_misses;
    }
}

struct Inner {
    pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    srq: Option<SharedReceiveQueue>,
    cfg: ConnConfig,
    provider: String,
    device: String,
    qp_cache: QpCache,
    region_cache: RegionCache,
    idle_streams: Mutex<HashMap<SocketAddr, Vec<Stream>>>,
    /// What this side knows of the local control sockets of the listeners it connected to
    /// (see `conn::stream`), by their address.
    local_controls: Mutex<HashMap<SocketAddr, LocalControl>>,
    connects: AtomicU64,
    accepts: AtomicU64,
    failed: AtomicU64,
    qps_created: AtomicU64,
    streams_opened: AtomicU64,
    local_streams_opened: AtomicU64,
    stream_reuses: AtomicU64,
}

/// A listener's local control socket, as a client knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LocalControl {
    /// A listener of this host that named this socket: later streams open there.
    At(String),
    /// A listener elsewhere: its name is not looked at again.
    NotHere,
    /// This name refused a connect (no listener under it here: the listener closed, or it is
    /// in another network namespace behind a forwarded port). Streams go over TCP, and are
    /// kept, until the listener names another socket.
    Refused(String),
}

/// Creates, connects and recycles the QPs of one worker (one PD, one pair of CQs).
/// Cheap to clone; clones share the QP cache and idle control streams.
#[derive(Clone)]
pub struct ConnManager {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ConnManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnManager")
            .field("provider", &self.inner.provider)
            .field("device", &self.inner.device)
            .field("worker_id", &self.inner.cfg.worker_id)
            .finish()
    }
}

/// A connection whose handshake is done: the QP is at RTS, and both sides had their receives
/// posted before either could send.
#[derive(Debug)]
pub struct Established {
    /// The QP, at RTS.
    pub qp: QueuePair,
    /// What this side announced.
    pub local: Hello,
    /// What the peer announced: size send credits from `peer.initial_credits`, eager messages
    /// from `peer.ring.slot_size`.
    pub peer: Hello,
    /// The peer's control address.
    pub peer_addr: SocketAddr,
    /// Which side this end was.
    pub role: Role,
    /// True when the QP came from the QP cache.
    pub reused_qp: bool,
}

/// A handshake half done: the peer's hello is known and the QP is in INIT. Post the receive
/// ring on [`PendingConn::qp`] now, then call [`PendingConn::finish`]; the peer cannot learn
/// this QP's address (client) or send to it (server) before `finish`.
///
/// Dropping it abandons the handshake: the peer is told, and the QP goes back to the cache.
pub struct PendingConn {
    mgr: ConnManager,
    qp: Option<QueuePair>,
    stream: Option<Stream>,
    peer_addr: SocketAddr,
    local: Hello,
    peer: Hello,
    role: Role,
    reused_qp: bool,
    home: Option<Arc<ListenerHome>>,
}

impl std::fmt::Debug for PendingConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingConn")
            .field("qp", &self.qp)
            .field("peer_addr", &self.peer_addr)
            .field("role", &self.role)
            .finish()
    }
}

impl ConnManager {
    /// A manager creating QPs in `pd` on one CQ for sends and receives.
    pub fn new(
        pd: &ProtectionDomain,
        cq: &CompletionQueue,
        cfg: ConnConfig,
    ) -> Result<ConnManager, ConnError> {
        Self::with_queues(pd, cq, cq, None, cfg)
    }

    /// A manager with separate send and receive CQs and, optionally, an SRQ every QP draws
    /// its receives from.
    pub fn with_queues(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: Option<&SharedReceiveQueue>,
        cfg: ConnConfig,
    ) -> Result<ConnManager, ConnError> {
        cfg.validate(srq.is_some())?;
        let device = pd.context().device();
        Ok(ConnManager {
            inner: Arc::new(Inner {
                pd: pd.clone(),
                send_cq: send_cq.clone(),
                recv_cq: recv_cq.clone(),
                srq: srq.cloned(),
                provider: device.provider.clone(),
                device: device.name.clone(),
                qp_cache: QpCache::new(cfg.qp_cache_capacity),
                // A connection's channel has two regions (ring, header slots).
                region_cache: RegionCache::new(cfg.qp_cache_capacity.saturating_mul(2)),
                cfg,
                idle_streams: Mutex::new(HashMap::new()),
                local_controls: Mutex::new(HashMap::new()),
                connects: AtomicU64::new(0),
                accepts: AtomicU64::new(0),
                failed: AtomicU64::new(0),
                qps_created: AtomicU64::new(0),
                streams_opened: AtomicU64::new(0),
                local_streams_opened: AtomicU64::new(0),
                stream_reuses: AtomicU64::new(0),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ConnConfig {
        &self.inner.cfg
    }

    /// The provider name every peer must match.
    pub fn provider(&self) -> &str {
        &self.inner.provider
    }

    /// The protection domain QPs are created in.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// The QP cache.
    pub fn qp_cache(&self) -> &QpCache {
        &self.inner.qp_cache
    }

    /// The region cache (the channel regions of released connections).
    pub fn region_cache(&self) -> &RegionCache {
        &self.inner.region_cache
    }

    /// A registered region of `len` bytes with `access` in this manager's PD: a cached one of
    /// a released connection, else a new registration.
    pub fn region(&self, len: usize, access: AccessFlags) -> fabriq_verbs::Result<MemoryRegion> {
        match self.inner.region_cache.take(len, access) {
            Some(mr) => Ok(mr),
            None => self.inner.pd.alloc_mr(len, access),
        }
    }

    /// Counters.
    pub fn stats(&self) -> ConnStats {
        let i = &self.inner;
        ConnStats {
            connects: i.connects.load(Ordering::Relaxed),
            accepts: i.accepts.load(Ordering::Relaxed),
            failed: i.failed.load(Ordering::Relaxed),
            qps_created: i.qps_created.load(Ordering::Relaxed),
            qp_cache_hits: i.qp_cache.hits(),
            qp_cache_misses: i.qp_cache.misses(),
            qps_cached: i.qp_cache.len() as u64,
            qps_dropped: i.qp_cache.dropped(),
            streams_opened: i.streams_opened.load(Ordering::Relaxed),
            local_streams_opened: i.local_streams_opened.load(Ordering::Relaxed),
            stream_reuses: i.stream_reuses.load(Ordering::Relaxed),
            region_cache_hits: i.region_cache.hits(),
            region_cache_misses: i.region_cache.misses(),
        }
    }

    /// Create `n` QPs into the cache ahead of time (up to its capacity), so the first
    /// connects are warm. Returns how many were added.
    pub fn prewarm(&self, n: usize) -> Result<usize, ConnError> {
        let mut added = 0;
        for _ in 0..n {
            let qp = self.create_qp()?;
            if !self.inner.qp_cache.put(qp) {
                break;
            }
            added += 1;
        }
        Ok(added)
    }

    fn create_qp(&self) -> Result<QueuePair, ConnError> {
        let i = &self.inner;
        let init = QpInitAttr {
            send_cq: &i.send_cq,
            recv_cq: &i.recv_cq,
            srq: i.srq.as_ref(),
            caps: i.cfg.qp_caps,
            sq_sig_all: i.cfg.sq_sig_all,
        };
        let qp = i.pd.create_qp(&init)?;
        i.qps_created.fetch_add(1, Ordering::Relaxed);
        Ok(qp)
    }

    /// A QP in INIT: from the cache if one is there, else new. Second value: reused.
    fn obtain_qp(&self) -> Result<(QueuePair, bool), ConnError> {
        let access = self.inner.cfg.access;
        if let Some(qp) = self.inner.qp_cache.take() {
            match qp.modify(&QpAttr::init(access)) {
                Ok(()) => return Ok((qp, true)),
                Err(err) => {
                    tracing::debug!(qp = qp.qp_num().0, %err, "cached QP unusable; creating one")
                }
            }
        }
        let qp = self.create_qp()?;
        qp.modify(&QpAttr::init(access))?;
        Ok((qp, false))
    }

    fn local_hello(&self, qp: &QueuePair, target_worker: Option<u32>) -> Hello {
        let c = &self.inner.cfg;
        Hello {
            version: VERSION,
            provider: self.inner.provider.clone(),
            device: self.inner.device.clone(),
            endpoint: qp.endpoint(),
            ring: c.ring,
            initial_credits: c.initial_credits,
            eager_threshold: c.eager_threshold,
            rndv_chunk_size: c.rndv_chunk_size,
            worker_id: c.worker_id,
            target_worker,
            stream_window: c.stream_window,
            auth_token: c.auth_token.clone(),
            local_control: String::new(),
        }
    }

    /// A lease on `qp` (a QP of this manager): [`QpLease::drain`] and [`QpLease::release`]
    /// give it back to the cache when the connection on it ends.
    pub fn lease(&self, qp: QueuePair) -> QpLease {
        QpLease::new(self.clone(), qp)
    }

    /// Give a connection's QP back for reuse (RESET, then cached or destroyed). Call it once
    /// the connection is closed, its QP drained of completions, and no clone of the QP is left.
    pub fn release(&self, est: Established) {
        self.release_qp(est.qp);
    }

    /// [`ConnManager::release`] for a bare QP of this manager; true if it was cached.
    pub fn release_qp(&self, qp: QueuePair) -> bool {
        self.inner.qp_cache.put(qp)
    }

    /// Listen for peers on `addr` (port 0: an ephemeral port, see [`Listener::local_addr`]).
    pub fn listen(&self, addr: impl ToSocketAddrs) -> Result<Listener, ConnError> {
        let tcp = TcpListener::bind(addr).map_err(|e| ConnError::io("bind listener", e))?;
        // Non-blocking, so a connection that vanishes between poll and accept cannot block the
        // accepting thread. Accepted streams are blocking (Linux does not inherit O_NONBLOCK).
        tcp.set_nonblocking(true)
            .map_err(|e| ConnError::io("listener non-blocking", e))?;
        let local = tcp
            .local_addr()
            .map_err(|e| ConnError::io("listener address", e))?;
        let (wake_tx, wake_rx) =
            UnixStream::pair().map_err(|e| ConnError::io("listener wake-up pair", e))?;
        wake_tx
            .set_nonblocking(true)
            .and_then(|()| wake_rx.set_nonblocking(true))
            .map_err(|e| ConnError::io("listener wake-up pair", e))?;
        // Peers of this host open their later (kept) control streams on a local socket, which
        // is only worth having where streams are kept.
        let cfg = &self.inner.cfg;
        let (unix, local_name) = match cfg.reuse_control_streams && cfg.local_control_streams {
            true => stream::bind_local().map_or((None, String::new()), |(l, n)| (Some(l), n)),
            false => (None, String::new()),
        };
        Ok(Listener {
            mgr: self.clone(),
            tcp,
            unix,
            local,
            home: Arc::new(ListenerHome {
                returned: Mutex::new(Vec::new()),
                wake_tx,
                wake_rx,
                closed: AtomicBool::new(false),
                local_name,
            }),
            idle: Mutex::new(Vec::new()),
            greetings: Mutex::new(Vec::new()),
            admitted: Vec::new(),
            last_tcp: AtomicBool::new(true),
        })
    }

    /// Connect to the listener at `addr` and finish at once (no receives posted: for peers
    /// that only use one-sided operations, or tests). See [`ConnManager::connect_with`].
    pub fn connect(&self, addr: SocketAddr, timeout: Duration) -> Result<Established, ConnError> {
        self.connect_pending(addr, None, timeout)?.finish()
    }

    /// Connect, calling `prepare` with the QP in INIT and the peer's hello to post receives
    /// before the QP goes to RTR; `target_worker` asks the peer for one of its workers.
    pub fn connect_with(
        &self,
        addr: SocketAddr,
        target_worker: Option<u32>,
        timeout: Duration,
        prepare: impl FnOnce(&QueuePair, &Hello) -> Result<(), ConnError>,
    ) -> Result<Established, ConnError> {
        let pending = self.connect_pending(addr, target_worker, timeout)?;
        prepare(pending.qp(), pending.peer())?;
        pending.finish()
    }

    /// The first half of a connect: TCP (or a reused control stream), QP in INIT, hello sent,
    /// the server's hello received and checked. The server's QP is at RTS with its receives
    /// posted when this returns. `timeout` bounds the whole call.
    pub fn connect_pending(
        &self,
        addr: SocketAddr,
        target_worker: Option<u32>,
        timeout: Duration,
    ) -> Result<PendingConn, ConnError> {
        self.connect_pending_early(addr, target_worker, timeout, |_| ())
            .map(|(pending, ())| pending)
    }

    /// [`ConnManager::connect_pending`], running `early` with the QP (in INIT) once the hello
    /// has left and before the wait for the hello-ack: what the caller can set up without the
    /// peer's hello — its receive ring, posted — is then done while the server works, off the
    /// connect's path (the wait busy-polls or sleeps otherwise). What `early` returns comes
    /// back beside the [`PendingConn`]; on an error it is dropped before the QP goes back to
    /// the cache, so it may hold a clone of the QP. `early` runs at most once (not at all when
    /// no hello could be sent).
    pub fn connect_pending_early<T>(
        &self,
        addr: SocketAddr,
        target_worker: Option<u32>,
        timeout: Duration,
        early: impl FnOnce(&QueuePair) -> T,
    ) -> Result<(PendingConn, T), ConnError> {
        let result = self.connect_pending_inner(addr, target_worker, timeout, early);
        if result.is_err() {
            self.inner.failed.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    fn connect_pending_inner<T>(
        &self,
        addr: SocketAddr,
        target_worker: Option<u32>,
        timeout: Duration,
        early: impl FnOnce(&QueuePair) -> T,
    ) -> Result<(PendingConn, T), ConnError> {
        let deadline = Instant::now() + timeout;
        let (qp, reused_qp) = self.obtain_qp()?;
        let hello = Message::Hello(self.local_hello(&qp, target_worker));
        let mut early = Some(early);
        let mut prepared: Option<T> = None;
        let outcome = (|| loop {
            let (mut stream, from_idle) = match self.take_idle_stream(addr) {
                Some(s) => (s, true),
                None => (self.open_stream(addr, deadline, timeout)?, false),
            };
            let local = stream.is_local();
            let step = |phase| Step {
                peer: addr,
                phase,
                deadline,
                allowed: timeout,
                spin: self.ack_spin(local),
            };
            let mut stray = false;
            let reply = step("hello")
                .write_msg(&mut stream, &hello)
                .map(|()| {
                    // Once the hello is out, while the server works on it.
                    if let Some(f) = early.take() {
                        prepared = Some(f(&qp));
                    }
                })
                .and_then(|()| loop {
                    let ack = step("hello-ack");
                    let read = match stray {
                        true => ack.read_more_frames(&mut stream, from_idle),
                        false => ack.read_frames(&mut stream, from_idle),
                    };
                    let msgs = match read {
                        Ok(Some(msgs)) => msgs,
                        other => break other.map(|_| None),
                    };
                    // A reused stream may still hold the peer's Close of the previous
                    // connection.
                    let mut msgs = msgs.into_iter().skip_while(|m| *m == Message::Close);
                    let Some(reply) = msgs.next() else {
                        stray = true;
                        continue;
                    };
                    // The server sends nothing more until this side's Ready or Close.
                    break match msgs.next() {
                        None => Ok(Some(reply)),
                        Some(Message::Close) => Err(ConnError::PeerClosed {
                            peer: addr,
                            phase: "hello-ack",
                        }),
                        Some(other) => Err(ConnError::Unexpected {
                            peer: addr,
                            phase: "hello-ack",
                            got: other.name(),
                        }),
                    };
                });
            match reply {
                Ok(Some(msg)) => {
                    if from_idle {
                        self.inner.stream_reuses.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok((stream, msg));
                }
                // An idle stream the server had let go of: open a fresh one.
                Ok(None) => continue,
                Err(ConnError::PeerClosed { .. }) if from_idle => continue,
                Err(e) => {
                    // Tell a peer we cannot understand (other version, garbage) why we leave.
                    if let Some(code) = reject_code_for(&e) {
                        send_reject(&mut stream, code, &self.inner.provider, &e.to_string());
                    }
                    return Err(e);
                }
            }
        })();
        let Message::Hello(local) = hello else {
            unreachable!("the hello sent is a Hello");
        };
        let (mut stream, msg, prepared) = match (outcome, prepared) {
            (Ok((stream, msg)), Some(prepared)) => (stream, msg, prepared),
            (Ok(_), None) => unreachable!("a hello-ack follows a hello written"),
            (Err(e), prepared) => {
                drop(prepared);
                self.release_qp(qp);
                return Err(e);
            }
        };
        let checked = match msg {
            Message::HelloAck(peer) => check_peer_hello(
                addr,
                &self.inner.provider,
                &self.inner.cfg.auth_token,
                &peer,
            )
            .map(|()| peer),
            Message::Reject(r) => Err(rejected(addr, &self.inner.provider, r)),
            other => Err(ConnError::Unexpected {
                peer: addr,
                phase: "hello-ack",
                got: other.name(),
            }),
        };
        match checked {
            Ok(peer) => {
                self.learn_local_control(addr, &stream, &peer);
                let pending = PendingConn {
                    mgr: self.clone(),
                    qp: Some(qp),
                    stream: Some(stream),
                    peer_addr: addr,
                    local,
                    peer,
                    role: Role::Client,
                    reused_qp,
                    home: None,
                };
                Ok((pending, prepared))
            }
            Err(e) => {
                if let Some(code) = reject_code_for(&e) {
                    send_reject(&mut stream, code, &self.inner.provider, &e.to_string());
                }
                drop(prepared);
                self.release_qp(qp);
                Err(e)
            }
        }
    }

    /// A new control stream to the listener at `addr`: on its local socket when it is a
    /// listener of this host whose name this side learnt, else over TCP.
    fn open_stream(
        &self,
        addr: SocketAddr,
        deadline: Instant,
        allowed: Duration,
    ) -> Result<Stream, ConnError> {
        let known = match self.inner.local_controls.lock().get(&addr) {
            Some(LocalControl::At(name)) => Some(name.clone()),
            _ => None,
        };
        if let Some(name) = known {
            match stream::connect_local(&name) {
                Ok(s) => {
                    self.inner.streams_opened.fetch_add(1, Ordering::Relaxed);
                    self.inner
                        .local_streams_opened
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(Stream::Local(s));
                }
                // Nobody listens under that name here (a new listener on `addr`, found over
                // TCP, names another).
                Err(LocalConnect::Gone) => {
                    let mut known = self.inner.local_controls.lock();
                    if known.get(&addr) == Some(&LocalControl::At(name.clone())) {
                        known.insert(addr, LocalControl::Refused(name));
                    }
                }
                Err(LocalConnect::Busy) => {}
            }
        }
        self.tcp_connect(addr, deadline, allowed).map(Stream::Tcp)
    }

    /// Remember the local control socket a peer of this host named in its hello-ack, for the
    /// control streams opened to it later. Only where streams are reused, and only for a peer
    /// reached at one of this host's addresses: an abstract socket name means something only
    /// in this host's network namespace, and the peer's own (random) name is all that is used.
    fn learn_local_control(&self, addr: SocketAddr, stream: &Stream, peer: &Hello) {
        let cfg = &self.inner.cfg;
        if !cfg.reuse_control_streams || !cfg.local_control_streams || stream.is_local() {
            return;
        }
        let name = &peer.local_control;
        if name.is_empty() || name.len() > super::wire::MAX_LOCAL_CONTROL_LEN {
            return;
        }
        let mut known = self.inner.local_controls.lock();
        match known.get(&addr) {
            Some(LocalControl::NotHere) => {}
            Some(LocalControl::At(n) | LocalControl::Refused(n)) if n == name => {}
            _ => {
                // Binding a socket to the address tells (once per peer address).
                let entry = match crate::endpoint::is_this_host(addr.ip()) {
                    true => LocalControl::At(name.clone()),
                    false => LocalControl::NotHere,
                };
                known.insert(addr, entry);
            }
        }
    }

    /// How long a wait on a control stream busy-polls: `handshake_spin`, but never on a local
    /// stream, whose writer wakes the waiting thread in about a microsecond (spinning there
    /// only held a core the peer's thread needed: `docs/arch/conn.md`).
    pub(crate) fn spin_for(&self, local: bool) -> Duration {
        match local {
            true => Duration::ZERO,
            false => self.inner.cfg.handshake_spin,
        }
    }

    /// How long the connecting side's wait for the hello-ack busy-polls: as
    /// [`ConnManager::spin_for`], except that a thread pinned to one CPU spins on a local
    /// stream too. Such a thread has its core to itself by the application's choice, so its
    /// spin takes no core from the listener's thread, and the hello-ack then costs neither a
    /// wake-up of this thread nor, in the listener's write, the cross-CPU signal of one: cached
    /// shm0 connects between two processes pinned to their own CPUs took 57–82 µs instead of
    /// 72–107 µs (p50, six alternating runs of `fabriq perf -t connect_lat`; `docs/arch/conn.md`,
    /// "Waiting on the control stream"). Unpinned, spinning there measured no better (two
    /// processes) or worse (one process): the woken listener thread may need this very core.
    pub(crate) fn ack_spin(&self, local: bool) -> Duration {
        match local && runs_on_one_cpu() {
            true => self.inner.cfg.handshake_spin,
            false => self.spin_for(local),
        }
    }

    fn tcp_connect(
        &self,
        addr: SocketAddr,
        deadline: Instant,
        allowed: Duration,
    ) -> Result<TcpStream, ConnError> {
        let left = deadline.saturating_duration_since(Instant::now());
        let timeout_err = || ConnError::Timeout {
            peer: Some(addr),
            phase: "tcp connect",
            after: allowed,
        };
        if left.is_zero() {
            return Err(timeout_err());
        }
        let stream = TcpStream::connect_timeout(&addr, left).map_err(|e| match e.kind() {
            ErrorKind::ConnectionRefused => ConnError::Refused { addr, source: e },
            ErrorKind::TimedOut | ErrorKind::WouldBlock => timeout_err(),
            _ => ConnError::io(format!("connect to {addr}"), e),
        })?;
        stream.set_nodelay(true).ok();
        // Control streams are non-blocking: every wait on them polls, bounded by its deadline.
        stream
            .set_nonblocking(true)
            .map_err(|e| ConnError::io("control stream non-blocking", e))?;
        self.inner.streams_opened.fetch_add(1, Ordering::Relaxed);
        Ok(stream)
    }

    fn take_idle_stream(&self, addr: SocketAddr) -> Option<Stream> {
        if !self.inner.cfg.reuse_control_streams {
            return None;
        }
        self.inner.idle_streams.lock().get_mut(&addr)?.pop()
    }

    pub(super) fn put_idle_stream(&self, addr: SocketAddr, stream: Stream) {
        if !self.inner.cfg.reuse_control_streams {
            return;
        }
        // A TCP stream to a peer with a local socket is not kept: the next connect opens a
        // local one (the peer's listener sees this one close and drops it).
        if !stream.is_local()
            && matches!(
                self.inner.local_controls.lock().get(&addr),
                Some(LocalControl::At(_))
            )
        {
            return;
        }
        let mut idle = self.inner.idle_streams.lock();
        let list = idle.entry(addr).or_default();
        if list.len() < self.inner.cfg.max_idle_streams_per_peer {
            list.push(stream);
        }
    }

    /// Close every idle control stream (client side).
    pub fn close_idle_streams(&self) {
        self.inner.idle_streams.lock().clear();
    }

    /// Server side, second step: take an [`Incoming`] peer (possibly read by another worker's
    /// listener) onto this manager: a QP in INIT for it, ready for receives to be posted.
    pub fn accept_incoming(&self, incoming: Incoming) -> Result<PendingConn, ConnError> {
        let Incoming {
            mut stream,
            peer_addr,
            hello,
            home,
        } = incoming;
        let mine = self.inner.cfg.worker_id;
        if let Some(want) = hello.target_worker.filter(|&w| w != mine) {
            let e = ConnError::WrongWorker {
                requested: want,
                local: mine,
            };
            send_reject(
                &mut stream,
                RejectCode::Unavailable,
                &self.inner.provider,
                &e.to_string(),
            );
            self.inner.failed.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        let (qp, reused_qp) = match self.obtain_qp() {
            Ok(v) => v,
            Err(e) => {
                send_reject(
                    &mut stream,
                    RejectCode::Internal,
                    &self.inner.provider,
                    &e.to_string(),
                );
                self.inner.failed.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
        };
        let mut local = self.local_hello(&qp, None);
        if let Some(h) = &home {
            local.local_control.clone_from(&h.local_name);
        }
        Ok(PendingConn {
            mgr: self.clone(),
            qp: Some(qp),
            stream: Some(stream),
            peer_addr,
            local,
            peer: hello,
            role: Role::Server,
            reused_qp,
            home,
        })
    }
}

/// The control stream a finish that keeps it must return.
fn with_stream(
    (est, control): (Established, Option<ControlStream>),
) -> Result<(Established, ControlStream), ConnError> {
    match control {
        Some(c) => Ok((est, c)),
        None => Err(ConnError::InvalidConfig(
            "control stream missing after the handshake".into(),
        )),
    }
}

impl PendingConn {
    /// The QP, in INIT: post receives on it now.
    pub fn qp(&self) -> &QueuePair {
        self.qp
            .as_ref()
            .expect("PendingConn invariant: the QP is present until finish or drop")
    }

    /// The peer's hello.
    pub fn peer(&self) -> &Hello {
        &self.peer
    }

    /// This side's hello.
    pub fn local(&self) -> &Hello {
        &self.local
    }

    /// The peer's control address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// Which side this is.
    pub fn role(&self) -> Role {
        self.role
    }

    /// True when the QP came from the QP cache.
    pub fn reused_qp(&self) -> bool {
        self.reused_qp
    }

    /// Finish the handshake: QP to RTR and RTS, then (client) send Ready, or (server) send the
    /// hello-ack and wait for Ready. On return both sides may send.
    pub fn finish(mut self) -> Result<Established, ConnError> {
        self.finish_counted(false, true).map(|(est, _)| est)
    }

    /// [`PendingConn::finish`], keeping the control stream: it becomes the connection's
    /// liveness signal, and goes back for reuse (after telling the peer) when dropped.
    pub fn finish_owned(mut self) -> Result<(Established, ControlStream), ConnError> {
        self.finish_counted(true, true).and_then(with_stream)
    }

    /// [`PendingConn::finish_owned`], except that the accepting side does not wait for the
    /// peer's `Ready`: it returns once its hello-ack is sent. The peer's receive ring is then
    /// not known to be posted, so the caller must not send on the QP before the peer's `Ready`
    /// arrives on the control stream ([`ControlStream::take_ready`]) or a message from the peer
    /// completes (the peer posts its ring before either) — `ChannelDriver::await_peer`. This
    /// saves the accepting side half a round trip and a thread wake-up; the checks the peer
    /// makes of the hello-ack are made here already (same provider, same auth token), so a
    /// peer that still gives up afterwards only closes the control stream. Connecting side:
    /// the same as `finish_owned`.
    pub fn finish_accepting(mut self) -> Result<(Established, ControlStream), ConnError> {
        let complete = self.role == Role::Client;
        self.finish_counted(true, complete).and_then(with_stream)
    }

    /// [`PendingConn::finish_owned`], except that the connecting side does not write its
    /// `Ready` here: the returned control stream owes it, and [`ControlStream::send_ready`]
    /// writes it — the thread that adopts the connection, which may be another than this one
    /// (a worker that is awake anyway), so the write leaves the connect's path. Until it is
    /// written the peer holds its sends ([`PendingConn::finish_accepting`]); a message this
    /// side sends first tells the peer as much. The receive ring must be posted before this is
    /// called, as for every finish. Accepting side: the same as `finish_owned`.
    pub fn finish_connecting(mut self) -> Result<(Established, ControlStream), ConnError> {
        let complete = self.role == Role::Server;
        self.finish_counted(true, complete).and_then(with_stream)
    }

    /// Refuse the peer after its hello was read (e.g. its ring geometry does not suit this
    /// side): it receives `Reject { code, reason }`, and the QP goes back to the cache.
    pub fn reject(mut self, code: RejectCode, reason: &str) {
        if let Some(mut stream) = self.stream.take() {
            send_reject(&mut stream, code, &self.mgr.inner.provider, reason);
        }
        self.mgr.inner.failed.fetch_add(1, Ordering::Relaxed);
        // Drop returns the QP.
    }

    /// `complete`: the handshake's last step happens here (connecting side: `Ready` written;
    /// accepting side: `Ready` read), else it is left to the owner of the control stream.
    fn finish_counted(
        &mut self,
        keep_stream: bool,
        complete: bool,
    ) -> Result<(Established, Option<ControlStream>), ConnError> {
        let mgr = self.mgr.clone();
        let result = self.finish_inner(keep_stream, complete);
        match &result {
            Ok(_) => {
                let counter = match self.role {
                    Role::Client => &mgr.inner.connects,
                    Role::Server => &mgr.inner.accepts,
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                mgr.inner.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    fn finish_inner(
        &mut self,
        keep_stream: bool,
        complete: bool,
    ) -> Result<(Established, Option<ControlStream>), ConnError> {
        let (Some(qp), Some(mut stream)) = (self.qp.take(), self.stream.take()) else {
            unreachable!("PendingConn invariant: finish runs once");
        };
        let mgr = self.mgr.clone();
        let cfg = &mgr.inner.cfg;
        let spin = mgr.spin_for(stream.is_local());
        let step = |phase| Step::new(self.peer_addr, phase, cfg.handshake_timeout, spin);
        let mut run = |stream: &mut Stream| -> Result<(), ConnError> {
            if qp.state() == QpState::Reset {
                qp.modify(&QpAttr::init(cfg.access))?;
            }
            let remote = reached_at(&self.peer.endpoint, self.peer_addr);
            // The server reaches RTR first, and the client's RTR is given the endpoint the
            // hello-ack carries, read after it (below).
            let rtr = match self.role {
                Role::Server => QpAttr::rtr(remote).before_peer(),
                Role::Client => QpAttr::rtr(remote),
            };
            qp.modify(&rtr)?;
            let rts = match cfg.rnr_retry {
                Some(n) => QpAttr::rts().with_rnr_retry(n),
                None => QpAttr::rts(),
            };
            qp.modify(&rts)?;
            match self.role {
                Role::Client if complete => step("ready").write_msg(stream, &Message::Ready),
                Role::Client => Ok(()), // owed by the control stream
                Role::Server => {
                    // The endpoint read after RTR tells the peer what the RTR settled (a tcp
                    // QP names the kept data connection it took, so the peer takes it without
                    // a greeting on it).
                    self.local.endpoint = qp.endpoint();
                    step("hello-ack").write_msg(stream, &Message::HelloAck(self.local.clone()))?;
                    if !complete {
                        return Ok(());
                    }
                    match step("ready").read_msg(stream, false)? {
                        Some(Message::Ready) => Ok(()),
                        Some(Message::Reject(r)) => {
                            Err(rejected(self.peer_addr, &mgr.inner.provider, r))
                        }
                        Some(other) => Err(ConnError::Unexpected {
                            peer: self.peer_addr,
                            phase: "ready",
                            got: other.name(),
                        }),
                        None => Err(ConnError::PeerClosed {
                            peer: self.peer_addr,
                            phase: "ready",
                        }),
                    }
                }
            }
        };
        match run(&mut stream) {
            Ok(()) => {
                let mut control = None;
                match (self.role, keep_stream) {
                    (Role::Client, false) => mgr.put_idle_stream(self.peer_addr, stream),
                    (Role::Client, true) => {
                        let mut c = ControlStream::new(
                            stream,
                            self.peer_addr,
                            Home::Client(mgr.clone()),
                            cfg.reuse_control_streams,
                        );
                        c.owe_ready(!complete);
                        control = Some(c);
                    }
                    (Role::Server, false) => {
                        if let Some(home) = self.home.take() {
                            if cfg.reuse_control_streams {
                                home.give_back(stream, self.peer_addr);
                            }
                        }
                    }
                    (Role::Server, true) => {
                        control = Some(ControlStream::new(
                            stream,
                            self.peer_addr,
                            Home::Server(self.home.take()),
                            cfg.reuse_control_streams,
                        ))
                    }
                }
                let est = Established {
                    qp,
                    local: self.local.clone(),
                    peer: self.peer.clone(),
                    peer_addr: self.peer_addr,
                    role: self.role,
                    reused_qp: self.reused_qp,
                };
                Ok((est, control))
            }
            Err(e) => {
                if let Some(code) = reject_code_for(&e) {
                    send_reject(&mut stream, code, &mgr.inner.provider, &e.to_string());
                }
                if matches!(qp.state(), QpState::Reset | QpState::Init) {
                    mgr.release_qp(qp);
                } else {
                    // Past RTR the peer may already have sent to it: a completion of this
                    // failed connection could still surface on the CQ, so it is not reused.
                    mgr.inner.qp_cache.count_dropped();
                }
                Err(e)
            }
        }
    }
}

impl Drop for PendingConn {
    fn drop(&mut self) {
        if let Some(mut stream) = self.stream.take() {
            send_reject(
                &mut stream,
                RejectCode::Internal,
                &self.mgr.inner.provider,
                "handshake abandoned",
            );
        }
        if let Some(qp) = self.qp.take() {
            self.mgr.release_qp(qp);
        }
    }
}

/// Where a server-side control stream goes back after a handshake, to be polled for the next.
pub(super) struct ListenerHome {
    returned: Mutex<Vec<(Stream, SocketAddr)>>,
    wake_tx: UnixStream,
    wake_rx: UnixStream,
    closed: AtomicBool,
    /// The listener's local control socket (empty: none), named in its hello-acks.
    local_name: String,
}

impl ListenerHome {
    pub(super) fn give_back(&self, stream: Stream, peer: SocketAddr) {
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        self.returned.lock().push((stream, peer));
        self.wake();
    }

    fn wake(&self) {
        // A full pipe already holds a pending wake-up; nothing else can go wrong that matters.
        let _ = (&self.wake_tx).write(&[1]);
    }

    fn drain_wake(&self) {
        let mut buf = [0u8; 64];
        while matches!((&self.wake_rx).read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// A peer whose hello was read and checked, not yet given a QP. Route it to the worker it
/// asks for ([`Incoming::peer`]`.target_worker`) and call that worker's
/// [`ConnManager::accept_incoming`].
pub struct Incoming {
    stream: Stream,
    peer_addr: SocketAddr,
    hello: Hello,
    home: Option<Arc<ListenerHome>>,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("peer_addr", &self.peer_addr)
            .field("worker_id", &self.hello.worker_id)
            .field("target_worker", &self.hello.target_worker)
            .finish()
    }
}

impl Incoming {
    /// The peer's hello.
    pub fn peer(&self) -> &Hello {
        &self.hello
    }

    /// The peer's control address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// Refuse the peer with a reason it will see in its error.
    pub fn reject(mut self, code: RejectCode, reason: &str) {
        send_reject(&mut self.stream, code, &self.hello.provider, reason);
    }
}

/// Stops a [`Listener`] from another thread: a blocked accept returns [`ConnError::Closed`].
#[derive(Clone)]
pub struct ListenerCloser {
    home: Arc<ListenerHome>,
}

impl std::fmt::Debug for ListenerCloser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerCloser").finish_non_exhaustive()
    }
}

impl ListenerCloser {
    /// Close the listener.
    pub fn close(&self) {
        self.home.closed.store(true, Ordering::Release);
        self.home.wake();
    }
}

/// Peers whose hello has not all arrived that a listener keeps at once; one more ends the
/// oldest (each would end at its handshake deadline anyway).
pub(crate) const MAX_GREETINGS: usize = 256;

/// What a listener read where it expected a hello.
enum HelloRead {
    Hello(Box<Hello>),
    /// A `Close` of the previous connection on a kept stream; the hello may follow.
    Close,
}

/// What became of a stream whose hello a listener read ([`Listener::greet`]).
enum Greet {
    /// A checked hello.
    Found(Box<Incoming>),
    /// Not all there yet: kept with the listener's greetings.
    Waiting,
    /// A kept stream that held only its last connection's `Close` (or `Ready`, `Nudge`): back
    /// to the idle streams, to wait for its next hello.
    Idle(Stream, SocketAddr),
    /// A kept stream its peer let go.
    Gone,
}

/// Accepts peers: new TCP connections and further handshakes on control streams kept open
/// from earlier ones. Accepts are serialised; run them on one control thread.
pub struct Listener {
    mgr: ConnManager,
    tcp: TcpListener,
    /// The local control socket peers of this host open their later control streams on
    /// (`conn::stream`); none where streams are not reused or none could be bound.
    unix: Option<UnixListener>,
    local: SocketAddr,
    home: Arc<ListenerHome>,
    /// Streams waiting for their next hello; only touched by the accepting thread.
    idle: Mutex<Vec<(Stream, SocketAddr)>>,
    /// Streams whose hello has not all arrived (`conn::greeting`), oldest first; only touched
    /// by the accepting thread.
    greetings: Mutex<Vec<Greeting>>,
    /// Providers admitted besides the manager's own (an endpoint on several devices routes
    /// each `Incoming` to the manager of its provider).
    admitted: Vec<String>,
    /// The last peer came over TCP: the next wait starts with a spin.
    last_tcp: AtomicBool,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.home.closed.store(true, Ordering::Release);
    }
}

impl Listener {
    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The manager accepted peers get their QPs from.
    pub fn manager(&self) -> &ConnManager {
        &self.mgr
    }

    /// Admit hellos of `provider` too (besides the manager's own): the caller routes each such
    /// [`Incoming`] to a manager of that provider ([`Incoming::peer`] names it).
    pub fn admit_provider(&mut self, provider: &str) {
        if provider != self.mgr.inner.provider && !self.admitted.iter().any(|p| p == provider) {
            self.admitted.push(provider.to_string());
        }
    }

    /// A handle that closes this listener from another thread.
    pub fn closer(&self) -> ListenerCloser {
        ListenerCloser {
            home: Arc::clone(&self.home),
        }
    }

    /// Accept one peer and finish its handshake without posting receives (see
    /// [`Listener::accept_with`]). Blocks until a peer arrives or the listener is closed.
    pub fn accept(&self) -> Result<Established, ConnError> {
        self.accept_pending(None)?.finish()
    }

    /// Accept one peer, calling `prepare` with its QP in INIT to post receives before the QP
    /// goes to RTR and the peer learns its address.
    pub fn accept_with(
        &self,
        timeout: Option<Duration>,
        prepare: impl FnOnce(&QueuePair, &Hello) -> Result<(), ConnError>,
    ) -> Result<Established, ConnError> {
        let pending = self.accept_pending(timeout)?;
        prepare(pending.qp(), pending.peer())?;
        pending.finish()
    }

    /// Accept one peer onto this listener's manager, up to its QP in INIT.
    pub fn accept_pending(&self, timeout: Option<Duration>) -> Result<PendingConn, ConnError> {
        let incoming = self.next_incoming(timeout)?;
        self.mgr.accept_incoming(incoming)
    }

    /// Wait up to `timeout` (`None`: forever) for the next peer's hello, on a new connection or
    /// a kept control stream, and check it. A peer that fails the checks is answered with a
    /// rejection and reported as the error; the listener stays usable.
    pub fn next_incoming(&self, timeout: Option<Duration>) -> Result<Incoming, ConnError> {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};

        let deadline = timeout.map(|t| Instant::now() + t);
        // Hybrid wait: poll without blocking for `handshake_spin` after entry and after each
        // event (a stream given back, a `Close` skipped), then sleep in `poll`. A hello that
        // follows soon after (a reconnect, the next peer of a burst) is read without waking
        // this thread. Only events of TCP streams start the spin: a local stream's writer
        // wakes this thread in about a microsecond, and a spinning listener holds a core the
        // peer of the handshake needs (`docs/arch/conn.md`, "Waiting on the control stream").
        let spin = self.mgr.inner.cfg.handshake_spin;
        let now = Instant::now();
        let mut spin_until = match self.last_tcp.load(Ordering::Relaxed) {
            true => now + spin,
            false => now,
        };
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut idle = self.idle.lock();
        let mut greetings = self.greetings.lock();
        loop {
            if self.home.closed.load(Ordering::Acquire) {
                return Err(ConnError::Closed);
            }
            // A peer that did not finish its hello in time.
            if let Some(i) = greetings.iter().position(|g| g.deadline <= Instant::now()) {
                return Err(self.give_up(greetings.remove(i)));
            }
            {
                let mut returned = self.home.returned.lock();
                if returned.iter().any(|(s, _)| !s.is_local()) {
                    spin_until = Instant::now() + spin;
                }
                idle.append(&mut returned);
            }
            let max_kept = self.mgr.inner.cfg.max_kept_streams;
            if idle.len() > max_kept {
                // Close the oldest; their clients reconnect transparently on next use.
                let excess = idle.len() - max_kept;
                idle.drain(..excess);
            }
            let left = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ConnError::Timeout {
                            peer: None,
                            phase: "accept",
                            after: timeout.unwrap_or_default(),
                        });
                    }
                    Some(Timespec {
                        tv_sec: left.as_secs() as i64,
                        tv_nsec: i64::from(left.subsec_nanos()),
                    })
                }
                None => None,
            };
            // Wake for the first greeting's deadline too.
            let left = match greetings.iter().map(|g| g.deadline).min() {
                Some(d) => {
                    let to_greeting = d.saturating_duration_since(Instant::now());
                    let ts = Timespec {
                        tv_sec: to_greeting.as_secs() as i64,
                        tv_nsec: i64::from(to_greeting.subsec_nanos()),
                    };
                    Some(left.map_or(ts, |l| l.min(ts)))
                }
                None => left,
            };
            let spinning = Instant::now() < spin_until;
            let wait = if spinning { Some(&zero) } else { left.as_ref() };
            // Poll set: the TCP listener, the wake-up socket, the local listener if any, the
            // kept streams, then the new peers' streams.
            let base = 2 + usize::from(self.unix.is_some());
            let ready: Vec<bool> = {
                let mut fds = Vec::with_capacity(base + idle.len() + greetings.len());
                fds.push(PollFd::new(&self.tcp, PollFlags::IN));
                fds.push(PollFd::new(&self.home.wake_rx, PollFlags::IN));
                if let Some(u) = &self.unix {
                    fds.push(PollFd::new(u, PollFlags::IN));
                }
                for (s, _) in idle.iter() {
                    fds.push(PollFd::new(s, PollFlags::IN));
                }
                for g in greetings.iter() {
                    fds.push(PollFd::new(&g.stream, PollFlags::IN));
                }
                match poll(&mut fds, wait) {
                    Ok(_) => {}
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Err(ConnError::io("poll listener", e.into())),
                }
                fds.iter().map(|f| !f.revents().is_empty()).collect()
            };
            if !ready.contains(&true) {
                if spinning {
                    super::handshake::spin_pause();
                }
                continue;
            }
            // A peer of this host opening a control stream on the local socket.
            if base == 3 && ready.get(2).copied().unwrap_or(false) {
                if let Some(found) = self.accept_local(&mut greetings)? {
                    return Ok(found);
                }
                continue;
            }
            // A stream with more of a hello that was not all there (or closed).
            let kept = base + idle.len();
            if let Some(i) = ready.iter().skip(kept).position(|&r| r) {
                let g = greetings.remove(i);
                match self.greet(g, &mut greetings)? {
                    Greet::Found(found) => return Ok(*found),
                    Greet::Idle(stream, peer) => idle.push((stream, peer)),
                    Greet::Waiting | Greet::Gone => {}
                }
                continue;
            }
            if ready.get(1).copied().unwrap_or(false) {
                // The streams given back are taken at the top of the loop.
                self.home.drain_wake();
            }
            // A kept stream with a new hello (or closed by its peer).
            if let Some(i) = ready.iter().skip(base).take(idle.len()).position(|&r| r) {
                let (stream, peer) = idle.remove(i);
                let tcp = !stream.is_local();
                let deadline = Instant::now() + self.mgr.inner.cfg.handshake_timeout;
                match self.greet(Greeting::kept(stream, peer, deadline), &mut greetings)? {
                    Greet::Found(found) => return Ok(*found),
                    Greet::Gone => {} // the peer let the stream go
                    // The peer's Close of the previous connection (its next hello may follow),
                    // or part of a hello.
                    waiting => {
                        if tcp {
                            spin_until = Instant::now() + spin;
                        }
                        if let Greet::Idle(stream, peer) = waiting {
                            idle.push((stream, peer));
                        }
                    }
                }
                continue;
            }
            if ready.first().copied().unwrap_or(false) {
                let (stream, peer) = match self.tcp.accept() {
                    Ok(v) => v,
                    Err(e)
                        if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock) =>
                    {
                        continue
                    }
                    Err(e) => return Err(ConnError::io("accept", e)),
                };
                // Control streams are non-blocking (Linux does not pass the listener's flag on).
                stream
                    .set_nonblocking(true)
                    .map_err(|e| ConnError::io("accepted stream non-blocking", e))?;
                stream.set_nodelay(true).ok();
                let deadline = Instant::now() + self.mgr.inner.cfg.handshake_timeout;
                let g = Greeting::new(Stream::Tcp(stream), peer, deadline);
                match self.greet(g, &mut greetings)? {
                    Greet::Found(found) => return Ok(*found),
                    // Its hello is on the way: wait for it as for a kept stream's.
                    _ => spin_until = Instant::now() + spin,
                }
            }
        }
    }

    /// Read what a peer sent where its hello is due, and check it when all of it is there;
    /// one not all there yet waits in `greetings` to be read when more comes (the oldest go
    /// when there are more than [`MAX_GREETINGS`]).
    fn greet(&self, mut g: Greeting, greetings: &mut Vec<Greeting>) -> Result<Greet, ConnError> {
        let step = Step::new(
            g.peer,
            "hello",
            self.mgr.inner.cfg.handshake_timeout,
            Duration::ZERO,
        );
        let msgs = match g.pull(&step) {
            Ok(Greeted::Frames(msgs)) => msgs,
            Ok(Greeted::Waiting) => {
                if greetings.len() >= MAX_GREETINGS {
                    self.give_up(greetings.remove(0));
                }
                greetings.push(g);
                return Ok(Greet::Waiting);
            }
            Ok(Greeted::Closed) if g.kept => return Ok(Greet::Gone),
            Ok(Greeted::Closed) => {
                return Err(ConnError::PeerClosed {
                    peer: g.peer,
                    phase: "hello",
                })
            }
            Err(e) => {
                self.refuse(&mut g.stream, g.peer, &e);
                return Err(e);
            }
        };
        match self.check_hello(&mut g.stream, g.peer, msgs, g.kept)? {
            HelloRead::Hello(hello) => Ok(Greet::Found(Box::new(
                self.incoming(g.stream, g.peer, *hello),
            ))),
            HelloRead::Close if g.kept => Ok(Greet::Idle(g.stream, g.peer)),
            HelloRead::Close => Err(ConnError::PeerClosed {
                peer: g.peer,
                phase: "hello",
            }),
        }
    }

    /// End a greeting whose hello did not come in time (or that made room for a newer one):
    /// counted as a failed handshake; the error says how long it had.
    fn give_up(&self, mut g: Greeting) -> ConnError {
        let allowed = self.mgr.inner.cfg.handshake_timeout;
        let err = ConnError::Timeout {
            peer: Some(g.peer),
            phase: "hello",
            after: allowed.saturating_sub(g.deadline.saturating_duration_since(Instant::now())),
        };
        self.refuse(&mut g.stream, g.peer, &err);
        err
    }

    /// Accept a stream on the local socket and read its hello; `None` when there was none to
    /// accept after all, or its hello is not all there yet (see [`Listener::greet`]).
    fn accept_local(&self, greetings: &mut Vec<Greeting>) -> Result<Option<Incoming>, ConnError> {
        let Some(unix) = &self.unix else {
            return Ok(None);
        };
        let stream = match unix.accept() {
            Ok((s, _)) => s,
            Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock) => {
                return Ok(None)
            }
            Err(e) => return Err(ConnError::io("accept local", e)),
        };
        stream
            .set_nonblocking(true)
            .map_err(|e| ConnError::io("accepted stream non-blocking", e))?;
        let peer = stream::local_peer(self.local);
        let deadline = Instant::now() + self.mgr.inner.cfg.handshake_timeout;
        match self.greet(
            Greeting::new(Stream::Local(stream), peer, deadline),
            greetings,
        )? {
            Greet::Found(found) => Ok(Some(*found)),
            _ => Ok(None),
        }
    }

    fn incoming(&self, stream: Stream, peer_addr: SocketAddr, hello: Hello) -> Incoming {
        self.last_tcp.store(!stream.is_local(), Ordering::Relaxed);
        Incoming {
            stream,
            peer_addr,
            hello,
            home: Some(Arc::clone(&self.home)),
        }
    }

    /// Check the frames a peer sent where its hello was due (`eof_ok`: on a kept stream).
    fn check_hello(
        &self,
        stream: &mut Stream,
        peer: SocketAddr,
        msgs: Vec<Message>,
        eof_ok: bool,
    ) -> Result<HelloRead, ConnError> {
        let inner = &self.mgr.inner;
        // A kept stream may still hold the `Close` of the connection it carried, or its
        // `Ready` or a `Nudge`, when that connection ended before its worker read them
        // (`PendingConn::finish_accepting`, `ControlStream::nudge`).
        let mut msgs = msgs.into_iter().skip_while(|m| {
            eof_ok && matches!(m, Message::Close | Message::Ready | Message::Nudge)
        });
        let unexpected = |got: &Message| ConnError::Unexpected {
            peer,
            phase: "hello",
            got: got.name(),
        };
        let result = match msgs.next() {
            None => return Ok(HelloRead::Close),
            // A client sends nothing more until the hello-ack.
            Some(Message::Hello(h)) => match msgs.next() {
                Some(other) => Err(unexpected(&other)),
                None => {
                    let provider = match self.admitted.iter().find(|p| **p == h.provider) {
                        Some(p) => p.as_str(),
                        None => inner.provider.as_str(),
                    };
                    check_peer_hello(peer, provider, &inner.cfg.auth_token, &h).map(|()| h)
                }
            },
            Some(other) => Err(unexpected(&other)),
        };
        result
            .map(|h| HelloRead::Hello(Box::new(h)))
            .inspect_err(|e| self.refuse(stream, peer, e))
    }

    /// A peer's hello failed: counted, and the peer told why where it should hear it.
    fn refuse(&self, stream: &mut Stream, peer: SocketAddr, e: &ConnError) {
        let inner = &self.mgr.inner;
        inner.failed.fetch_add(1, Ordering::Relaxed);
        if let Some(code) = reject_code_for(e) {
            send_reject(stream, code, &inner.provider, &e.to_string());
        }
        tracing::debug!(%peer, err = %e, "handshake refused");
    }
}

/// The peer's QP endpoint as this side reaches it: an address that names no host
/// (`0.0.0.0:port`, `[::]:port`: a provider listening on every interface of its host) is the
/// host the peer's control stream came from, at that port. Any other address is used as given.
pub(crate) fn reached_at(endpoint: &QpEndpoint, control_peer: SocketAddr) -> QpEndpoint {
    match endpoint.address.parse::<SocketAddr>() {
        Ok(a) if a.ip().is_unspecified() => {
            let mut e = endpoint.clone();
            e.address = SocketAddr::new(control_peer.ip(), a.port()).to_string();
            e
        }
        _ => endpoint.clone(),
    }
}

/// True when the calling thread may run on one CPU only (its affinity mask has one CPU).
pub(crate) fn runs_on_one_cpu() -> bool {
    rustix::thread::sched_getaffinity(None).is_ok_and(|set| set.count() == 1)
}

#[cfg(test)]
mod reach_tests {
    use super::reached_at;
    use fabriq_verbs::QpEndpoint;

    fn ep(address: &str) -> QpEndpoint {
        QpEndpoint {
            provider: "tcp".into(),
            device: "tcp0".into(),
            address: address.into(),
            qp_num: fabriq_verbs::QpNum(7),
            psn: 0,
            lid: 0,
            gid: [0; 16],
            mtu: 4096,
            extra: Default::default(),
        }
    }

    #[test]
    fn an_endpoint_on_every_interface_is_reached_where_its_control_stream_came_from() {
        let peer = "10.250.77.2:41000".parse().unwrap();
        assert_eq!(
            reached_at(&ep("0.0.0.0:5000"), peer).address,
            "10.250.77.2:5000"
        );
        let v6 = "[fd00::2]:41000".parse().unwrap();
        assert_eq!(reached_at(&ep("[::]:5000"), v6).address, "[fd00::2]:5000");
        // A named host, or an address that is not a socket address, is used as given.
        assert_eq!(
            reached_at(&ep("127.0.0.1:5000"), peer).address,
            "127.0.0.1:5000"
        );
        assert_eq!(
            reached_at(&ep("pid:42/seg:7"), peer).address,
            "pid:42/seg:7"
        );
    }
}
