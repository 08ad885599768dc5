//! [`Endpoint`]: opens the device, starts the workers, and sets channels up — `connect(addr)` on
//! one side, `listen(addr)` + [`Listener::accept`] on the other.
//!
//! Set-up runs on the connection manager ([`crate::conn`]), one [`ConnManager`] per worker (the
//! worker's PD and CQ, its QP cache, its idle control streams). The versioned hello carries the
//! receive-ring geometry, initial credits, eager threshold, READ chunk size, worker id and the
//! auth token of [`Config`]; a mismatch is a typed [`ConnError`] on both sides. The order makes
//! RNR impossible from the first message on: each side posts its receive ring between the
//! manager's `*_pending` and `finish`, i.e. before the peer can learn it may send:
//!
//! ```text
//! client                                           server (acceptor thread)
//! QP INIT (cache or new) ── Hello ───────────────▶ check version, provider, token
//!                                                  QP INIT on the routed worker, post ring
//!                                                  RTR → RTS
//! check hello-ack ◀──────────────── HelloAck ────  adopt, hand to accept (sends held)
//! post ring, RTR → RTS ── Ready ─────────────────▶ worker reads Ready: held sends go
//! adopt on the worker (may send now)
//! ```
//!
//! The accepting side does not wait for the Ready (`PendingConn::finish_accepting`): its
//! driver holds sends until the Ready or the client's first message arrives
//! (`ChannelDriver::await_peer`), and a client silent past the handshake timeout fails the
//! channel. Adoption runs on the thread that finished the handshake when the worker's state is
//! free.
//!
//! That sets up a *connection*; channels are streams on it (`worker::streams`). Each worker keeps
//! a [`ConnPool`]: one connection per peer address, shared by every channel this endpoint opens
//! to that peer on that worker, so connections grow with peers × workers, not with channels or
//! threads. A pooled connection is live unless its worker marked it failed or the peer's
//! `Close` or hang-up waits in its control stream, which the worker reads only when it gets round
//! to it ([`crate::conn::HangupProbe`], one non-blocking system call); a dead one is replaced by
//! a new connection. A connect that finds a live pooled connection costs no round trip: it names a new
//! stream and sends `STREAM_OPEN` in order before the stream's first message; on the other side
//! the worker hands the stream to [`Listener::accept`].
//!
//! The TCP control stream stays with the connection: the worker polls it, and its hang-up (or
//! the peer's `Close`) fails every channel on it with `PeerGone`. When the last channel of a
//! connection closes on the connecting side, the worker drains the QP and gives it back to the
//! worker's QP cache, and the control stream goes back to the client's idle set or the server's
//! listener; the next connect to that peer reuses both.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use fabriq_verbs::{AccessFlags, Context, ProtectionDomain, QpCaps};
use parking_lot::Mutex;

use crate::channel::driver::{ChannelDriver, INLINE_MAX, REGION_ACCESS};
use crate::channel::proto::ChannelConfig;
use crate::channel::{ChannelError, PeerGeometry};
use crate::config::Config;
use crate::conn::{
    ConnConfig, ConnError, ConnManager, ConnPool, ConnPoolStats, ConnStats, Hello, Incoming,
    ListenerCloser, PeerKey, PendingConn, RejectCode, RingGeometry,
};
use crate::handle::Channel;
use crate::remote::ExposedRegion;
use crate::worker::guard::GuardStats;
use crate::worker::shared::{ChannelShared, WorkerShared};
use crate::worker::streams::{stream_key, AcceptSender, Accepted, ConnHandle, FIRST_STREAM};
use crate::worker::MemoryStats;
use crate::worker::{
    self, direct_or_submit, Adopt, Command, EndpointShared, WorkerConfig, ONE_SIDED_DEPTH,
};

const ACCESS: AccessFlags = AccessFlags::all();

struct WorkerRef {
    shared: Arc<WorkerShared>,
    /// The device's protection domain (rings and exposed regions of this worker's
    /// connections are registered in it) and link speed (which picks the thresholds).
    pd: ProtectionDomain,
    device_gbps: u32,
    /// The worker's connection manager: QPs on the worker's CQ, its QP cache, its idle
    /// control streams.
    conn: ConnManager,
    /// Connections this endpoint opened from this worker, by peer address.
    pool: ConnPool<ConnHandle>,
}

/// One device of an endpoint and the workers on it. A named device is the only fabric;
/// `auto` without an active RDMA NIC opens two, `shm0` for peers on this host and `tcp0` for
/// the others.
struct Fabric {
    ctx: Context,
    provider: String,
    workers: Vec<WorkerRef>,
}

struct Inner {
    config: Config,
    /// The first is the primary: same-host peers, `Endpoint::device`, `Endpoint::expose`'s
    /// allocation.
    fabrics: Vec<Fabric>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// The RPC handlers and the refusal counters, shared with the workers.
    common: Arc<EndpointShared>,
    next_worker: AtomicUsize,
    /// Peer addresses already classified as this host's or not (`is_this_host` costs a socket),
    /// so a connect that finds a pooled connection pays no system call.
    this_host: Mutex<rustc_hash::FxHashMap<std::net::IpAddr, bool>>,
    /// Connections peers made to this endpoint that it keeps (`Config::max_connections`).
    accepted: Arc<AtomicUsize>,
}

impl Inner {
    fn workers(&self) -> impl Iterator<Item = &WorkerRef> {
        self.fabrics.iter().flat_map(|f| f.workers.iter())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for w in self.workers() {
            w.shared.submit(Command::Shutdown);
        }
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
}

/// The middleware's entry point: a device, its workers, and the RPC handlers they serve.
/// Cheap to clone; workers stop when the last clone (and every channel) is dropped.
#[derive(Clone)]
pub struct Endpoint {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("devices", &self.devices())
            .field("workers", &self.inner.config.workers)
            .finish()
    }
}

/// The devices of an endpoint: the named one, or for `auto` a real RDMA device (provider
/// `rdma-core`) whose port is up, else `shm0` for peers on this host plus `tcp0` for the others
/// (only `tcp0` where `shm0` does not open).
fn open_devices(name: &str, config: &Config) -> Result<Vec<Context>, ChannelError> {
    if name != "auto" {
        return Ok(vec![Context::open_with(name, &config.device_config(name))?]);
    }
    let nics = fabriq_verbs::devices()
        .unwrap_or_default()
        .into_iter()
        .filter(|d| d.provider == "rdma-core");
    for nic in nics {
        match Context::open(&nic.name) {
            Ok(c)
                if c.query_port(1)
                    .is_ok_and(|p| p.state == fabriq_verbs::PortState::Active) =>
            {
                return Ok(vec![c])
            }
            Ok(_) => tracing::debug!(device = %nic.name, "port not active, skipped by auto"),
            Err(e) => tracing::debug!(device = %nic.name, %e, "cannot open, skipped by auto"),
        }
    }
    // tcp0 serves the peers on other hosts: unless told where to bind, its data listener
    // takes every interface, and its QPs advertise no host (`0.0.0.0:port`), which the
    // handshake resolves to the address each peer's control stream came from.
    let mut tcp_cfg = config.device_config("tcp0");
    if tcp_cfg.bind_addr.is_none() && std::env::var_os("FABRIQ_TCP_BIND").is_none() {
        tcp_cfg.bind_addr = Some(SocketAddr::from(([0, 0, 0, 0], 0)));
    }
    let shm = Context::open_with("shm0", &config.device_config("shm0"));
    let tcp = Context::open_with("tcp0", &tcp_cfg);
    match (shm, tcp) {
        (Ok(shm), Ok(tcp)) => Ok(vec![shm, tcp]),
        (Err(e), Ok(tcp)) => {
            tracing::debug!(%e, "shm0 unavailable: tcp0 for every peer");
            Ok(vec![tcp])
        }
        (Ok(shm), Err(e)) => {
            tracing::warn!(%e, "tcp0 unavailable: auto reaches only peers on this host (shm0)");
            Ok(vec![shm])
        }
        (Err(_), Err(e)) => Err(e.into()),
    }
}

/// Whether a pooled connection may take a new channel. One that failed, or whose peer ended
/// it (its `Close` or hang-up is in the control stream, whether or not the worker has read it
/// yet), is replaced: a peer that left and a new endpoint on its address get a new connection,
/// never the dead one (whose channels would only fail, unseen by the new endpoint). So is one
/// whose peer refused a stream (it keeps as many of the connection's streams as it allows): its
/// channels go on, new ones get a connection of their own.
fn pool_usable(conn: &ConnHandle) -> bool {
    !conn.is_failed() && !conn.refuses_streams()
}

/// True when `ip` is an address of this host (loopback, unspecified, or one of its interfaces):
/// binding a socket to it succeeds only then. Nothing is sent.
pub(crate) fn is_this_host(ip: std::net::IpAddr) -> bool {
    ip.is_loopback()
        || ip.is_unspecified()
        || std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

impl Endpoint {
    /// Open the device and start the workers.
    pub fn new(config: Config) -> Result<Endpoint, ChannelError> {
        config
            .validate()
            .map_err(|e| ChannelError::InvalidConfig(e.to_string()))?;
        let common: Arc<EndpointShared> = Arc::default();
        let mut fabrics = Vec::new();
        let mut threads = Vec::new();
        for ctx in open_devices(&config.device, &config)? {
            let workers = Self::start_workers(&config, &ctx, &common, &mut threads)?;
            let provider = ctx.device().provider.clone();
            fabrics.push(Fabric {
                ctx,
                provider,
                workers,
            });
        }
        Ok(Endpoint {
            inner: Arc::new(Inner {
                config,
                fabrics,
                threads: Mutex::new(threads),
                common,
                next_worker: AtomicUsize::new(0),
                this_host: Mutex::new(Default::default()),
                accepted: Arc::new(AtomicUsize::new(0)),
            }),
        })
    }

    /// The workers of one device, each with its CQ, connection manager and pool.
    fn start_workers(
        config: &Config,
        ctx: &Context,
        common: &Arc<EndpointShared>,
        threads: &mut Vec<JoinHandle<()>>,
    ) -> Result<Vec<WorkerRef>, ChannelError> {
        let pd = ctx.alloc_pd()?;
        let attr = ctx.query_device();
        let device_gbps = ctx.query_port(1).map(|p| p.speed_gbps).unwrap_or(0);
        let cqe = attr.max_cqe.min(16 * 1024);
        let mut workers = Vec::with_capacity(config.workers);
        let chunk = config.thresholds(device_gbps).chunk_size as usize;
        for i in 0..config.workers {
            let cq = ctx.create_cq(cqe)?;
            let shared =
                Arc::new(WorkerShared::new(i).map_err(|e| {
                    ChannelError::Verbs(fabriq_verbs::VerbsError::io("eventfd", e))
                })?);
            let wcfg = WorkerConfig {
                idle_spin: config.idle_spin(),
                pin_cpu: config.pin_workers.then_some(i),
                pool: crate::mempool::PoolConfig {
                    max_registered_bytes: config.pool_max_bytes.map(|b| b as usize),
                    max_idle_bytes: usize::try_from(config.pool_idle_bytes).unwrap_or(usize::MAX),
                    ..crate::mempool::PoolConfig::default().with_chunk_size(chunk)
                },
                progress: config.progress,
                close_linger: Duration::from_millis(config.close_linger_ms),
                handler_wait: config.rpc_timeout(),
                reclaim_after: Duration::from_millis(config.pool_reclaim_ms),
            };
            let t = worker::spawn(
                Arc::clone(&shared),
                cq.clone(),
                pd.clone(),
                Arc::clone(common),
                wcfg,
            )?;
            threads.push(t);
            let conn_cfg =
                Self::conn_config(config, &config.channel_config(device_gbps), &attr, i)?;
            let conn = ConnManager::new(&pd, &cq, conn_cfg)?;
            workers.push(WorkerRef {
                shared,
                pd: pd.clone(),
                device_gbps,
                conn,
                pool: ConnPool::new(),
            });
        }
        Ok(workers)
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The device name in use: the only one, or with `auto` the one for peers on this host
    /// ([`Endpoint::devices`] lists all).
    pub fn device(&self) -> &str {
        &self.inner.fabrics[0].ctx.device().name
    }

    /// Every device this endpoint uses: one, or with `auto` (no RDMA NIC) `shm0` for peers on
    /// this host and `tcp0` for the others.
    pub fn devices(&self) -> Vec<String> {
        self.inner
            .fabrics
            .iter()
            .map(|f| f.ctx.device().name.clone())
            .collect()
    }

    /// The device a channel's connection runs on.
    pub(crate) fn device_of(&self, worker: &Arc<WorkerShared>) -> &str {
        self.inner
            .fabrics
            .iter()
            .find(|f| f.workers.iter().any(|w| Arc::ptr_eq(&w.shared, worker)))
            .map_or("", |f| f.ctx.device().name.as_str())
    }

    /// Wake-ups written to sleeping workers so far (a measure of idle hand-offs).
    pub fn worker_wakeups(&self) -> u64 {
        self.inner
            .workers()
            .map(|w| w.shared.wakeups.load(Ordering::Relaxed))
            .sum()
    }

    /// The memory the endpoint's buffer pools hold registered, summed over its workers and the
    /// threads that allocate for them, and what the workers' idle reclaim gave back
    /// (`Config::pool_reclaim_ms`).
    pub fn memory_stats(&self) -> MemoryStats {
        self.inner
            .workers()
            .filter_map(|w| w.shared.buffers())
            .map(|b| b.memory_stats())
            .fold(MemoryStats::default(), |a, b| MemoryStats {
                registered_bytes: a.registered_bytes + b.registered_bytes,
                cached_large_bytes: a.cached_large_bytes + b.cached_large_bytes,
                reclaims: a.reclaims + b.reclaims,
                reclaimed_bytes: a.reclaimed_bytes + b.reclaimed_bytes,
            })
    }

    /// `handler` serves `method` from now on (in place of the one before, if any).
    fn register(&self, method: &str, handler: crate::rpc::Served) {
        self.inner.common.handlers.write().insert(
            crate::rpc::wire::method_id(method),
            (method.to_string(), handler),
        );
    }

    /// Register an RPC handler for `method`; requests on any channel of this endpoint reach it,
    /// on the worker that received them.
    pub fn serve<F>(&self, method: &str, handler: F)
    where
        F: Fn(&[u8]) -> Result<Vec<u8>, String> + Send + Sync + 'static,
    {
        self.register(method, crate::rpc::Served::Inline(Arc::new(handler)));
    }

    /// Register an RPC handler for `method` that replies later: it runs on the worker that
    /// received the request, as [`Endpoint::serve`]'s do, gets the request body and a
    /// [`crate::rpc::Responder`], and returns at once; the reply goes out when the responder
    /// is used, from any thread. For handlers that would otherwise wait — a nested call to
    /// another service ([`crate::Rpc::call_async`] on a runtime, then
    /// [`crate::rpc::Responder::reply`]), I/O — without holding their worker's other channels
    /// up.
    pub fn serve_deferred<F>(&self, method: &str, handler: F)
    where
        F: Fn(&[u8], crate::rpc::Responder) + Send + Sync + 'static,
    {
        self.register(method, crate::rpc::Served::Deferred(Arc::new(handler)));
    }

    /// Register an async RPC handler for `method`: each request's future runs on `runtime`
    /// (the worker that received the request only starts it), and its output is the reply —
    /// `Err(text)` reaches the caller as [`crate::RpcError::Handler`]. A deferred handler
    /// ([`Endpoint::serve_deferred`]) whose work is a future: it may await other calls
    /// ([`crate::Rpc::call_async`]), timers or I/O without holding any worker up.
    pub fn serve_async<F, Fut>(&self, method: &str, runtime: tokio::runtime::Handle, handler: F)
    where
        F: Fn(Vec<u8>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Vec<u8>, String>> + Send + 'static,
    {
        self.serve_deferred(method, move |req, responder| {
            let work = handler(req.to_vec());
            runtime.spawn(async move {
                // A reply that cannot be queued (no pool memory, endpoint stopped) leaves the
                // caller to its deadline, or to `PeerGone`.
                let _ = match work.await {
                    Ok(body) => responder.reply(&body),
                    Err(e) => responder.fail(&e),
                };
            });
        });
    }

    /// Expose `len` bytes of registered memory for peers' one-sided access. With several
    /// devices (`auto`) the memory is allocated on the primary one and registered on the others
    /// too: give each peer [`ExposedRegion::descriptor_for`] its channel.
    pub fn expose(&self, len: usize) -> Result<ExposedRegion, ChannelError> {
        let fabrics = &self.inner.fabrics;
        let mr = fabrics[0].workers[0].pd.alloc_mr(len, ACCESS)?;
        let mut region = ExposedRegion::new(mr, &fabrics[0].workers[0].pd);
        for f in fabrics.iter().skip(1) {
            region.register_on(&f.workers[0].pd, ACCESS)?;
        }
        Ok(region)
    }

    fn channel_config(&self, w: &WorkerRef) -> ChannelConfig {
        self.inner.config.channel_config(w.device_gbps)
    }

    fn pick_worker(&self, fabric: usize) -> &WorkerRef {
        let workers = &self.inner.fabrics[fabric].workers;
        let i = self.inner.next_worker.fetch_add(1, Ordering::Relaxed) % workers.len();
        &workers[i]
    }

    /// The fabric for a peer at `addr`: the primary one for a peer on this host, the last one
    /// (tcp0 with `auto`) for the others.
    fn fabric_for(&self, addr: SocketAddr) -> usize {
        let n = self.inner.fabrics.len();
        if n == 1 {
            return 0;
        }
        let ip = addr.ip();
        let local = *self
            .inner
            .this_host
            .lock()
            .entry(ip)
            .or_insert_with(|| is_this_host(ip));
        if local {
            0
        } else {
            n - 1
        }
    }

    /// The connection manager of worker `w`: the worker's PD and CQ, its QP cache, and this
    /// endpoint's announcement (ring geometry, credits, thresholds, auth token).
    fn conn_config(
        config: &Config,
        cfg: &ChannelConfig,
        attr: &fabriq_verbs::DeviceAttr,
        worker: usize,
    ) -> Result<ConnConfig, ChannelError> {
        let caps = QpCaps {
            max_send_wr: (cfg.sq_depth + ONE_SIDED_DEPTH).min(attr.max_qp_wr),
            max_recv_wr: cfg.rx_slots.min(attr.max_qp_wr),
            max_send_sge: 2.min(attr.max_sge),
            max_recv_sge: 1,
            // Small sends (headers + a small payload) go inline: copied at post time, so the
            // device reads no gather list (`ChannelDriver` decides per send).
            max_inline_data: INLINE_MAX.min(attr.max_inline_data),
        };
        if caps.max_recv_wr < cfg.rx_slots || caps.max_send_wr < cfg.sq_depth {
            return Err(ChannelError::InvalidConfig(format!(
                "device allows {} work requests per queue, the channel needs {}",
                attr.max_qp_wr,
                cfg.rx_slots.max(cfg.sq_depth)
            )));
        }
        Ok(ConnConfig {
            handshake_timeout: config.handshake_timeout(),
            handshake_spin: config.handshake_spin(),
            access: ACCESS,
            qp_caps: caps,
            sq_sig_all: false,
            qp_cache_capacity: config.qp_cache_size,
            reuse_control_streams: config.reuse_control_streams,
            local_control_streams: config.local_control_streams,
            worker_id: u32::try_from(worker).unwrap_or(u32::MAX),
            ring: RingGeometry {
                slots: cfg.rx_slots,
                slot_size: cfg.rx_slot_size,
            },
            initial_credits: cfg.rx_slots,
            eager_threshold: cfg.thresholds.eager_max,
            rndv_chunk_size: cfg.thresholds.chunk_size,
            stream_window: config.stream_window,
            auth_token: config.auth_token.as_bytes().to_vec(),
            rnr_retry: Some(config.rnr_retry),
            ..ConnConfig::default()
        })
    }

    /// The peer's receive ring as the channel core sees it: the credits it grants (at most its
    /// slots) and its slot size, range-checked.
    fn peer_geometry(peer: &Hello) -> Result<PeerGeometry, ChannelError> {
        let geo = PeerGeometry {
            rx_slots: peer.initial_credits.min(peer.ring.slots),
            rx_slot_size: peer.ring.slot_size,
        };
        if !(4..=1 << 16).contains(&geo.rx_slots) || !(64..=1 << 24).contains(&geo.rx_slot_size) {
            return Err(ChannelError::Handshake(format!(
                "peer ring geometry {geo:?} out of range"
            )));
        }
        Ok(geo)
    }

    /// A channel driver for `qp` (in INIT) with its receive ring posted, for a peer of ring
    /// geometry `geo`. The ring and header slots are a released connection's when the region
    /// cache has them (no registration, no fresh pages), else new ones.
    fn ready_driver(
        w: &WorkerRef,
        cfg: &ChannelConfig,
        qp: &fabriq_verbs::QueuePair,
        geo: PeerGeometry,
    ) -> Result<ChannelDriver, ChannelError> {
        let [rx, tx] = ChannelDriver::region_sizes(cfg);
        let ring = w.conn.region(rx, REGION_ACCESS)?;
        let heads = w.conn.region(tx, REGION_ACCESS)?;
        let mut driver = ChannelDriver::with_regions(qp.clone(), cfg.clone(), geo, [ring, heads])?;
        driver.post_ready(worker::now())?;
        Ok(driver)
    }

    /// Connecting side, while the hello is on its way: the driver and its posted ring, made
    /// with this side's own ring geometry in place of the peer's (set from the hello-ack, in
    /// [`Endpoint::finish_pending`]).
    fn early_driver(
        &self,
        w: &WorkerRef,
        qp: &fabriq_verbs::QueuePair,
    ) -> Result<ChannelDriver, ChannelError> {
        let cfg = self.channel_config(w);
        Self::ready_driver(w, &cfg, qp, cfg.ring_geometry())
    }

    /// Second half of either side: the peer's hello is known and the QP is in INIT. Post the
    /// receive ring (or, connecting side, take `early`: the driver posted while the hello-ack
    /// was on its way), then let the handshake finish (no RNR: the peer learns it may send
    /// only after this), and hand the connection to the worker with its control stream and
    /// QP lease. `accept`: the accepting side's queue for the streams the peer will open.
    fn finish_pending(
        &self,
        w: &WorkerRef,
        pending: PendingConn,
        accept: Option<(AcceptSender, worker::Admission)>,
        early: Option<Result<ChannelDriver, ChannelError>>,
    ) -> Result<Adopted, ChannelError> {
        let (accept, admission) = accept.unzip();
        let geo = match Self::peer_geometry(pending.peer()) {
            Ok(g) => g,
            Err(e) => {
                drop(early);
                pending.reject(RejectCode::Unavailable, &e.to_string());
                return Err(e);
            }
        };
        let driver = match early {
            Some(made) => made.and_then(|mut d| d.set_peer(geo).map(|()| d)),
            None => Self::ready_driver(w, &self.channel_config(w), pending.qp(), geo),
        };
        let mut driver = match driver {
            Ok(d) => d,
            Err(e) => {
                pending.reject(RejectCode::Internal, &e.to_string());
                return Err(e);
            }
        };
        // Accepting side: the channel is handed out once the hello-ack is sent; its sends wait
        // in the driver for the peer's Ready (or first message).
        let accepting = accept.is_some();
        // Connecting side: the `Ready` is written by the thread that adopts the connection.
        let (est, mut control) = if accepting {
            pending.finish_accepting()?
        } else {
            pending.finish_connecting()?
        };
        // Connecting side, pooled connections: the pool asks it whether the peer ended the
        // connection before handing the connection out again (the worker reads the control
        // stream only when it gets round to it). It shares the stream's socket while the
        // connection lives.
        let hangup = if accepting || !self.inner.config.share_connections {
            None
        } else {
            control.hangup_probe()
        };
        if accepting {
            driver.await_peer();
        }
        let stream_window = crate::conn::wire::negotiated_stream_window(&est.local, &est.peer);
        let adopt_local = control.is_local();
        let lease = w.conn.lease(est.qp);
        let conn = driver.qp().qp_num().0;
        let peer = control.peer_addr();
        let failed = Arc::new(AtomicBool::new(false));
        let refusing = Arc::new(AtomicBool::new(false));
        // The configuration the driver was made with (an early one's may be a little older).
        let (eager_max, max_queued, max_len) = {
            let cfg = driver.core().config();
            (
                cfg.thresholds.eager_max,
                cfg.max_queued,
                cfg.max_message_len,
            )
        };
        // The stream the handshake opened exists on the worker from the adoption on, on both
        // sides: the peer may send on it as soon as its side is ready, and a message for a
        // stream the worker does not know is dropped. Accepting side: it goes to the listener
        // from here, so handshakes are accepted in the order they finished; connecting side:
        // the first channel opened on the connection takes it.
        let first = Arc::new(ChannelShared::new(
            stream_key(conn, FIRST_STREAM),
            Arc::clone(&w.shared),
            u64::from(max_queued),
            stream_window,
            max_len,
        ));
        // Thread mode, worker awake (progressing, or spinning for its idle budget) and no
        // thread of the handshake busy-polling (a local control stream, or a zero
        // `handshake_spin`): the worker adopts the connection — and, connecting side, writes
        // the `Ready` — on its own core, off the connect's path; it takes its inbox within a
        // pass, and no wake-up is written. Where the handshake's threads spin (TCP with a
        // spin budget: the listener goes on spinning after a TCP peer) they hold the cores,
        // and the queued adoption waited for one: cold shm0 connects took 124–129 µs
        // instead of 88–94 µs (`docs/BENCHMARKS.md`). Otherwise adopted on this thread when
        // the worker's state is free (waking a sleeping worker costs a context switch on the
        // connect's path on a host with few cores), else queued for the thread that holds it.
        // Either way the adoption precedes anything the new channel's owner hands to the
        // worker later (the inbox is drained first), and completions of the new QP that the
        // worker polls before it are kept for it (`Worker::adopt`, orphans).
        let spinning = !w.conn.spin_for(adopt_local).is_zero();
        let adopt = Box::new(Adopt {
            driver,
            control: Some(control),
            lease: Some(lease),
            accept: accept.clone(),
            failed: Arc::clone(&failed),
            refusing: Arc::clone(&refusing),
            peer,
            eager_max,
            stream_window,
            max_streams: self.inner.config.max_streams,
            admission,
            first_stream: Some(Arc::clone(&first)),
            ready_within: self.inner.config.handshake_timeout(),
        });
        if !spinning && !w.shared.is_caller_mode() && w.shared.is_awake() {
            w.shared.submit(Command::Adopt(adopt));
        } else {
            worker::direct_or_submit(&w.shared, adopt, |g, a| g.adopt(*a), Command::Adopt);
        }
        let first = match accept {
            Some(tx) => {
                // A listener that is gone drops the `Accepted`, which closes the stream.
                let _ = tx.send(Accepted::new(first, peer, eager_max));
                None
            }
            None => Some(first),
        };
        Ok(Adopted {
            conn,
            failed,
            refusing,
            hangup,
            eager_max,
            stream_window,
            first,
        })
    }

    /// A new connection to `addr` from worker `w` (the full handshake).
    fn new_connection(&self, w: &WorkerRef, addr: SocketAddr) -> Result<ConnHandle, ChannelError> {
        let timeout = self.inner.config.handshake_timeout();
        // The receive ring is posted while the server answers the hello.
        let (pending, early) = w
            .conn
            .connect_pending_early(addr, None, timeout, |qp| self.early_driver(w, qp))?;
        let a = self.finish_pending(w, pending, None, Some(early))?;
        Ok(ConnHandle::new(
            Arc::clone(&w.shared),
            a.conn,
            addr,
            a.eager_max,
            a.stream_window,
            a.failed,
            a.first,
        )
        .with_hangup_probe(a.hangup)
        .with_refusals(a.refusing))
    }

    /// The pooled connection to `addr` of worker `w`, connecting if there is none live (or
    /// none [`pool_usable`]).
    fn pooled_connection(
        &self,
        w: &WorkerRef,
        addr: SocketAddr,
    ) -> Result<Arc<ConnHandle>, ChannelError> {
        if !self.inner.config.share_connections {
            return self.new_connection(w, addr).map(Arc::new);
        }
        let key = PeerKey { addr, worker: None };
        w.pool
            .get_usable_or_connect(key, pool_usable, || self.new_connection(w, addr))
    }

    /// Open a stream on `conn`: no round trip, its `STREAM_OPEN` precedes its first message.
    fn open_stream(&self, w: &WorkerRef, conn: Arc<ConnHandle>) -> Channel {
        let (stream, first) = conn.next_stream();
        let (peer, eager_max) = (conn.peer, conn.eager_max);
        if first {
            // The handshake's stream: on the worker since the adoption.
            if let Some(shared) = conn.take_first() {
                return Channel::new(shared, self.clone(), peer, eager_max, Some(conn));
            }
        }
        let cfg = self.channel_config(w);
        let shared = Arc::new(ChannelShared::new(
            stream_key(conn.conn, stream),
            Arc::clone(&w.shared),
            u64::from(cfg.max_queued),
            conn.stream_window,
            cfg.max_message_len,
        ));
        let id = conn.conn;
        direct_or_submit(
            &w.shared,
            Arc::clone(&shared),
            |g, shared| g.enqueue_open(id, stream, shared, !first),
            |shared| Command::OpenStream {
                conn: id,
                stream,
                shared,
                announce: !first,
            },
        );
        Channel::new(shared, self.clone(), peer, eager_max, Some(conn))
    }

    /// [`Endpoint::connect`] from async code, on a tokio runtime. The address is resolved as
    /// tokio resolves one (`tokio::net::lookup_host`: at once for an address, on the blocking
    /// pool for a name). A connect the connection pool answers opens its stream on the task's
    /// thread (no blocking work, no hand-off); one that sets a connection up runs the handshake
    /// (blocking socket work, up to `Config::handshake_timeout_ms`) on the runtime's blocking
    /// pool (`tokio::task::spawn_blocking`), not on the task's thread. Panics outside a tokio
    /// runtime, as `spawn_blocking` does.
    pub async fn connect_async(
        &self,
        addr: impl tokio::net::ToSocketAddrs,
    ) -> Result<Channel, ChannelError> {
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr)
            .await
            .map_err(|e| ChannelError::Handshake(format!("resolve: {e}")))?
            .collect();
        if let Some(ch) = self.try_connect_pooled(&addrs) {
            return Ok(ch);
        }
        let ep = self.clone();
        tokio::task::spawn_blocking(move || ep.connect(&addrs[..]))
            .await
            .map_err(|e| ChannelError::Handshake(format!("connect task: {e}")))?
    }

    /// The connect of [`Endpoint::connect`] where the connection pool answers it without
    /// waiting: the first address, its device's next worker, and that worker's usable pooled
    /// connection to it (`ConnPool::try_get_usable`); `None` where a connect would set one up
    /// or wait for one being set up. The worker's turn passes only with an answer, so that the
    /// `connect` that follows a `None` sets up on the worker looked at (else, with several
    /// workers, it would go on setting up on others and every look would miss).
    fn try_connect_pooled(&self, addrs: &[SocketAddr]) -> Option<Channel> {
        if !self.inner.config.share_connections {
            return None;
        }
        let &a = addrs.first()?;
        let workers = &self.inner.fabrics[self.fabric_for(a)].workers;
        let next = self.inner.next_worker.load(Ordering::Relaxed);
        let w = &workers[next % workers.len()];
        let key = PeerKey {
            addr: a,
            worker: None,
        };
        let conn = w.pool.try_get_usable(key, pool_usable)?;
        self.inner.next_worker.fetch_add(1, Ordering::Relaxed);
        Some(self.open_stream(w, conn))
    }

    /// Connect to a listening endpoint: a new channel on this endpoint's pooled connection to
    /// that peer (one per worker), set up first if there is none. Errors of the set-up are
    /// [`ChannelError::Connect`] with the connection manager's typed [`ConnError`] (refused,
    /// timeout, version, provider or auth-token mismatch, rejected, peer closed mid-handshake).
    pub fn connect(&self, addr: impl ToSocketAddrs) -> Result<Channel, ChannelError> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| ChannelError::Handshake(format!("resolve: {e}")))?
            .collect();
        let mut refused = None;
        for a in addrs {
            // The device for this peer first; a peer that runs only another one (a listener
            // on a named device) says so in its reject, and the others are tried.
            let first = self.fabric_for(a);
            let n = self.inner.fabrics.len();
            let mut order: Vec<usize> = vec![first];
            order.extend((0..n).filter(|&f| f != first));
            for (tried, f) in order.into_iter().enumerate() {
                let w = self.pick_worker(f);
                match self.pooled_connection(w, a) {
                    Ok(conn) => return Ok(self.open_stream(w, conn)),
                    Err(ChannelError::Connect(e @ ConnError::Refused { .. })) => {
                        refused = Some(e);
                        break;
                    }
                    Err(ChannelError::Connect(ConnError::ProviderMismatch { .. }))
                        if tried + 1 < n => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Err(refused.map_or_else(
            || ChannelError::Handshake("address resolves to nothing".into()),
            ChannelError::Connect,
        ))
    }

    /// Server side, after the listener read and checked a peer's hello: route it to the worker
    /// it asked for (else the next one), and finish there.
    fn accept_incoming(
        &self,
        incoming: Incoming,
        accept: AcceptSender,
    ) -> Result<(), ChannelError> {
        // The listener admits a hello of any of this endpoint's providers; the connection
        // goes to that provider's workers.
        let fabric = self
            .inner
            .fabrics
            .iter()
            .position(|f| f.provider == incoming.peer().provider)
            .unwrap_or(0);
        let workers = &self.inner.fabrics[fabric].workers;
        let w = match incoming.peer().target_worker {
            // An unknown worker is refused by the manager (`WrongWorker`).
            Some(t) => workers.get(t as usize).unwrap_or(&workers[0]),
            None => self.pick_worker(fabric),
        };
        let max = self.inner.config.max_connections;
        let Some(admission) = worker::Admission::take(&self.inner.accepted, max as usize) else {
            let peer = incoming.peer_addr();
            self.inner.common.guard.connection_rejected();
            tracing::warn!(%peer, max, "handshake rejected: at capacity (max_connections)");
            incoming.reject(
                RejectCode::Unavailable,
                &format!("at capacity: {max} connections"),
            );
            return Err(ChannelError::Connect(ConnError::AtCapacity { peer, max }));
        };
        let pending = w.conn.accept_incoming(incoming)?;
        self.finish_pending(w, pending, Some((accept, admission)), None)
            .map(|_| ())
    }

    /// Counters of the connection pools of every worker: connects served by a live shared
    /// connection (hits), connects that set one up (misses), live pooled connections.
    pub fn pool_stats(&self) -> ConnPoolStats {
        let mut total = ConnPoolStats::default();
        for w in self.inner.workers() {
            let s = w.pool.stats();
            total.hits += s.hits;
            total.misses += s.misses;
            total.live += s.live;
        }
        total
    }

    /// Counters of the connection managers of every worker: connects, accepts, failures, QP
    /// cache hits and misses, QPs created and cached, control streams opened and reused.
    pub fn conn_stats(&self) -> ConnStats {
        let mut total = ConnStats::default();
        for w in self.inner.workers() {
            total += w.conn.stats();
        }
        total
    }

    /// What this endpoint refused or cut off to bound what its peers can make it hold:
    /// handshakes rejected at `Config::max_connections`, streams refused past
    /// `Config::max_streams`, connections failed for a protocol violation, RPC replies without
    /// pool memory. Counted from the endpoint's start; each is also logged at `warn`.
    pub fn guard_stats(&self) -> GuardStats {
        self.inner.common.guard.stats()
    }

    /// Listen for channels on `addr` (port 0: any free port). Handshakes run on an acceptor
    /// thread; new TCP connections and control streams kept from closed channels are both
    /// served.
    pub fn listen(&self, addr: impl ToSocketAddrs) -> Result<Listener, ChannelError> {
        let fabrics = &self.inner.fabrics;
        let mut l = fabrics[0].workers[0].conn.listen(addr)?;
        for f in fabrics.iter().skip(1) {
            l.admit_provider(&f.provider);
        }
        let local = l.local_addr();
        let closer = l.closer();
        let (tx, rx) = std::sync::mpsc::channel::<Accepted>();
        let notify = Arc::new(tokio::sync::Notify::new());
        let tx = AcceptSender::new(tx, Arc::clone(&notify));
        let (fail_tx, fail_rx) = std::sync::mpsc::sync_channel::<ConnError>(FAILURES_KEPT);
        let record = move |e: ConnError| {
            tracing::warn!(%e, "handshake failed");
            let _ = fail_tx.try_send(e);
        };
        // The acceptor holds a weak reference: a listener does not keep the endpoint alive.
        let weak = Arc::downgrade(&self.inner);
        let thread = std::thread::Builder::new()
            .name("fabriq-acceptor".into())
            .spawn(move || loop {
                let incoming = match l.next_incoming(None) {
                    Ok(i) => i,
                    Err(ConnError::Closed) => break,
                    Err(e @ ConnError::Io { .. }) => {
                        // The listening socket itself (e.g. out of descriptors): back off.
                        record(e);
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    }
                    Err(e) => {
                        record(e);
                        continue;
                    }
                };
                let Some(inner) = weak.upgrade() else { break };
                let ep = Endpoint { inner };
                match ep.accept_incoming(incoming, tx.clone()) {
                    Ok(()) => {}
                    Err(ChannelError::Connect(e)) => record(e),
                    Err(e) => tracing::warn!(%e, "channel set-up failed"),
                }
            })
            .map_err(|e| ChannelError::Handshake(format!("spawn acceptor: {e}")))?;
        Ok(Listener {
            local,
            endpoint: Arc::downgrade(&self.inner),
            rx: Mutex::new(rx),
            notify,
            failures: Mutex::new(fail_rx),
            closer,
            thread: Some(thread),
        })
    }
}

/// Handshake failures a [`Listener`] keeps for [`Listener::next_failure`]; older ones are
/// dropped (logged only) while the queue is full.
const FAILURES_KEPT: usize = 64;

/// What [`Endpoint::finish_pending`] handed to the worker.
struct Adopted {
    conn: u32,
    failed: Arc<AtomicBool>,
    /// Connecting side: set when the peer refused a stream (see `ConnHandle`).
    refusing: Arc<AtomicBool>,
    /// Connecting side: tells whether the peer ended the connection (see `ConnHandle`).
    hangup: Option<crate::conn::HangupProbe>,
    eager_max: u32,
    /// The stream window both sides agreed on.
    stream_window: u32,
    /// Connecting side: the handshake's stream, registered on the worker, for the first channel.
    first: Option<Arc<ChannelShared>>,
}

/// Accepts channels connected to a listening address: every channel a peer opens, whether on a
/// new connection or on one it already has with this endpoint.
pub struct Listener {
    local: SocketAddr,
    endpoint: Weak<Inner>,
    rx: Mutex<std::sync::mpsc::Receiver<Accepted>>,
    /// Notified with every channel queued in `rx` and when a sender goes (`AcceptSender`).
    notify: Arc<tokio::sync::Notify>,
    failures: Mutex<std::sync::mpsc::Receiver<ConnError>>,
    closer: ListenerCloser,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("local", &self.local)
            .finish()
    }
}

impl Listener {
    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn channel(&self, a: Accepted) -> Result<Channel, ChannelError> {
        let inner = self.endpoint.upgrade().ok_or(ChannelError::Closed)?;
        let (peer, eager_max) = (a.peer, a.eager_max);
        let shared = a.take().ok_or(ChannelError::Closed)?;
        Ok(Channel::new(
            shared,
            Endpoint { inner },
            peer,
            eager_max,
            None,
        ))
    }

    /// Wait for the next channel. Peers whose handshake fails are not returned here; see
    /// [`Listener::next_failure`].
    pub fn accept(&self) -> Result<Channel, ChannelError> {
        let a = self.rx.lock().recv().map_err(|_| ChannelError::Closed)?;
        self.channel(a)
    }

    /// Wait at most `timeout` for the next channel.
    pub fn accept_timeout(&self, timeout: Duration) -> Result<Channel, ChannelError> {
        let a = self.rx.lock().recv_timeout(timeout).map_err(|e| match e {
            std::sync::mpsc::RecvTimeoutError::Timeout => ChannelError::Timeout,
            std::sync::mpsc::RecvTimeoutError::Disconnected => ChannelError::Closed,
        })?;
        self.channel(a)
    }

    /// [`Listener::accept`] from async code: awaits the next channel without holding a thread.
    pub async fn accept_async(&self) -> Result<Channel, ChannelError> {
        use std::sync::mpsc::TryRecvError;
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the look: a channel queued after it wakes this wait.
            notified.as_mut().enable();
            match self.rx.lock().try_recv() {
                Ok(a) => return self.channel(a),
                Err(TryRecvError::Disconnected) => return Err(ChannelError::Closed),
                Err(TryRecvError::Empty) => {}
            }
            notified.await;
        }
    }

    /// Wait at most `timeout` for the next handshake that failed on this side (auth token or
    /// version mismatch, malformed hello, peer gone mid-way, ...): the server's view of a
    /// refused peer. The most recent failures are kept; `None` if none came in time.
    pub fn next_failure(&self, timeout: Duration) -> Option<ConnError> {
        self.failures.lock().recv_timeout(timeout).ok()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.closer.close();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests;
