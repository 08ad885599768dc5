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
use crate::worker::shared::{ChannelShared, WorkerShared};
use crate::worker::streams::{stream_key, Accepted, ConnHandle, FIRST_STREAM};
use crate::worker::{
    self, direct_or_submit, Adopt, Command, Handlers, WorkerConfig, ONE_SIDED_DEPTH,
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
    handlers: Arc<Handlers>,
    next_worker: AtomicUsize,
    /// Peer addresses already classified as this host's or not (`is_this_host` costs a socket),
    /// so a connect that finds a pooled connection pays no system call.
    this_host: Mutex<rustc_hash::FxHashMap<std::net::IpAddr, bool>>,
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
        let handlers: Arc<Handlers> = Arc::default();
        let mut fabrics = Vec::new();
        let mut threads = Vec::new();
        for ctx in open_devices(&config.device, &config)? {
            let workers = Self::start_workers(&config, &ctx, &handlers, &mut threads)?;
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
                handlers,
                next_worker: AtomicUsize::new(0),
                this_host: Mutex::new(Default::default()),
            }),
        })
    }

    /// The workers of one device, each with its CQ, connection manager and pool.
    fn start_workers(
        config: &Config,
        ctx: &Context,
        handlers: &Arc<Handlers>,
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
                pool: crate::mempool::PoolConfig::default().with_chunk_size(chunk),
                progress: config.progress,
                close_linger: Duration::from_millis(config.close_linger_ms),
                handler_wait: config.rpc_timeout(),
            };
            let t = worker::spawn(
                Arc::clone(&shared),
                cq.clone(),
                pd.clone(),
                Arc::clone(handlers),
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

    /// Register an RPC handler for `method`; requests on any channel of this endpoint reach it,
    /// on the worker that received them.
    pub fn serve<F>(&self, method: &str, handler: F)
    where
        F: Fn(&[u8]) -> Result<Vec<u8>, String> + Send + Sync + 'static,
    {
        self.inner.handlers.write().insert(
            crate::rpc::wire::method_id(method),
            (
                method.to_string(),
                crate::rpc::Served::Inline(Arc::new(handler)),
            ),
        );
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
        self.inner.handlers.write().insert(
            crate::rpc::wire::method_id(method),
            (
                method.to_string(),
                crate::rpc::Served::Deferred(Arc::new(handler)),
            ),
        );
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
        accept: Option<std::sync::mpsc::Sender<Accepted>>,
        early: Option<Result<ChannelDriver, ChannelError>>,
    ) -> Result<Adopted, ChannelError> {
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
        // The configuration the driver was made with (an early one's may be a little older).
        let (eager_max, max_queued) = {
            let cfg = driver.core().config();
            (cfg.thresholds.eager_max, cfg.max_queued)
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
            peer,
            eager_max,
            stream_window,
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
        .with_hangup_probe(a.hangup))
    }

    /// The pooled connection to `addr` of worker `w`, connecting if there is none live.
    fn pooled_connection(
        &self,
        w: &WorkerRef,
        addr: SocketAddr,
    ) -> Result<Arc<ConnHandle>, ChannelError> {
        if !self.inner.config.share_connections {
            return self.new_connection(w, addr).map(Arc::new);
        }
        let key = PeerKey { addr, worker: None };
        // A pooled connection that failed, or whose peer ended it (its `Close` or hang-up is
        // in the control stream, whether or not the worker has read it yet), is replaced: a
        // peer that left and a new endpoint on its address get a new connection, never the
        // dead one (whose channels would only fail, unseen by the new endpoint).
        w.pool.get_usable_or_connect(
            key,
            |conn| !conn.is_failed(),
            || self.new_connection(w, addr),
        )
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
        let window = u64::from(self.channel_config(w).max_queued);
        let shared = Arc::new(ChannelShared::new(
            stream_key(conn.conn, stream),
            Arc::clone(&w.shared),
            window,
            conn.stream_window,
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
        accept: std::sync::mpsc::Sender<Accepted>,
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
        let pending = w.conn.accept_incoming(incoming)?;
        self.finish_pending(w, pending, Some(accept), None)
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
mod tests {
    use super::is_this_host;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    #[test]
    fn this_host_is_told_by_binding_not_by_sending() {
        assert!(is_this_host(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        assert!(is_this_host(IpAddr::V4(Ipv4Addr::new(127, 3, 2, 1))));
        assert!(is_this_host(IpAddr::V6(Ipv6Addr::LOCALHOST)));
        assert!(is_this_host(IpAddr::V4(Ipv4Addr::UNSPECIFIED)));
        // TEST-NET addresses (RFC 5737) are never assigned to a host.
        assert!(!is_this_host(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1))));
        assert!(!is_this_host(IpAddr::V4(Ipv4Addr::new(198, 51, 100, 7))));
    }

    #[test]
    fn auto_sends_peers_of_this_host_to_shm_and_the_others_to_tcp() {
        let ep = super::Endpoint::new(crate::Config {
            device: "auto".into(),
            ..crate::Config::default()
        })
        .expect("auto endpoint");
        if ep.devices() != ["shm0", "tcp0"] {
            println!("SKIP: auto opened {:?}", ep.devices());
            return;
        }
        assert_eq!(ep.fabric_for("127.0.0.1:9".parse().unwrap()), 0);
        assert_eq!(ep.fabric_for("[::1]:9".parse().unwrap()), 0);
        assert_eq!(ep.fabric_for("192.0.2.1:9".parse().unwrap()), 1);
        let named = super::Endpoint::new(crate::Config {
            device: "tcp0".into(),
            ..crate::Config::default()
        })
        .expect("tcp0 endpoint");
        assert_eq!(named.devices(), ["tcp0"]);
        assert_eq!(named.fabric_for("192.0.2.1:9".parse().unwrap()), 0);
    }

    /// An endpoint built on a thread confined to one CPU tells its workers so (their spins
    /// and its waiters' step aside at every round), and channels and RPC work there in both
    /// progress modes, with every thread of both ends on that CPU; one built where the
    /// process has more CPUs spins as before.
    #[test]
    fn an_endpoint_built_on_one_cpu_steps_aside_and_still_serves() {
        use crate::{Config, Progress};
        use std::time::Duration;
        const WAIT: Duration = Duration::from_secs(10);
        let Some(core) = core_affinity::get_core_ids().and_then(|ids| ids.last().copied()) else {
            println!("SKIP: the CPUs of this process cannot be read");
            return;
        };
        let one_cpu = |ep: &super::Endpoint| {
            ep.inner.fabrics[0]
                .workers
                .iter()
                .all(|w| w.shared.one_cpu())
        };
        let wide = super::Endpoint::new(Config {
            device: "shm0".into(),
            ..Config::default()
        })
        .expect("endpoint");
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(one_cpu(&wide), cpus <= 1, "{cpus} CPUs");
        drop(wide);
        for progress in [Progress::Thread, Progress::Caller] {
            std::thread::spawn(move || {
                assert!(core_affinity::set_for_current(core), "pin to {core:?}");
                let cfg = Config {
                    device: "shm0".into(),
                    workers: 1,
                    progress,
                    ..Config::default()
                };
                let a = super::Endpoint::new(cfg.clone()).expect("a");
                let b = super::Endpoint::new(cfg).expect("b");
                assert!(one_cpu(&a) && one_cpu(&b), "{progress:?}");
                b.serve("echo", |req| Ok(req.to_vec()));
                let listener = b.listen("127.0.0.1:0").expect("listen");
                let ca = a.connect(listener.local_addr()).expect("connect");
                let cb = listener.accept_timeout(WAIT).expect("accept");
                for i in 0..200u64 {
                    ca.send_timeout(&i.to_le_bytes(), WAIT).expect("send");
                    let m = cb.recv_timeout(WAIT).expect("recv");
                    assert_eq!(m[..], i.to_le_bytes(), "{progress:?} message {i}");
                    cb.send_timeout(&m, WAIT).expect("echo");
                    assert_eq!(ca.recv_timeout(WAIT).expect("reply")[..], m[..]);
                }
                let rpc = crate::Rpc::new(ca);
                for i in 0..200u64 {
                    let reply = rpc.call("echo", &i.to_le_bytes(), WAIT).expect("call");
                    assert_eq!(reply[..], i.to_le_bytes(), "{progress:?} call {i}");
                }
            })
            .join()
            .expect("pinned endpoints");
        }
    }

    /// The configuration of the caller-mode tests: shm0, one worker, caller progress.
    fn caller_mode_config() -> crate::Config {
        crate::Config {
            device: "shm0".into(),
            workers: 1,
            progress: crate::Progress::Caller,
            ..crate::Config::default()
        }
    }

    /// Two endpoints of `cfg` (a client and a server) and a listener of the server.
    fn client_server(cfg: crate::Config) -> (super::Endpoint, super::Endpoint, super::Listener) {
        let a = super::Endpoint::new(cfg.clone()).expect("a");
        let b = super::Endpoint::new(cfg).expect("b");
        let listener = b.listen("127.0.0.1:0").expect("listen");
        (a, b, listener)
    }

    /// Both ends of a channel between two caller-mode endpoints on shm0, one worker each, with
    /// stream window `stream_window` (each end keeps its endpoint alive).
    fn caller_mode_channel(stream_window: u32) -> (crate::Channel, crate::Channel) {
        let (a, _b, listener) = client_server(crate::Config {
            stream_window,
            ..caller_mode_config()
        });
        let ca = a.connect(listener.local_addr()).expect("connect");
        let cb = listener
            .accept_timeout(std::time::Duration::from_secs(10))
            .expect("accept");
        (ca, cb)
    }

    /// A reader in caller mode whose own pass delivers its stream's next message takes it
    /// straight from the pass (no delivery queue); such reads still count as consumed, so a
    /// one-way stream of many windows' worth keeps flowing, and messages stay in order
    /// whichever way each one took.
    #[test]
    fn messages_handed_to_the_reading_thread_count_as_consumed_and_keep_their_order() {
        use std::time::Duration;
        const WAIT: Duration = Duration::from_secs(10);
        let (ca, cb) = caller_mode_channel(8);
        let n = 2_000u64; // 250 stream windows
        let sender = std::thread::spawn(move || {
            for i in 0..n {
                ca.send_timeout(&i.to_le_bytes(), WAIT).expect("send");
            }
            ca
        });
        for i in 0..n {
            let m = cb.recv_timeout(WAIT).expect("recv");
            assert_eq!(m[..], i.to_le_bytes(), "message {i}");
        }
        let _ca = sender.join().expect("sender");
        let handed = cb.shared().handed_count();
        assert!(handed > 0, "no message was handed to the reading thread");
        assert!(handed <= n);
    }

    /// Caller mode, both ends answering what they read (a ping-pong) on a small stream window:
    /// the pass that hands a reader its message leaves the connection's housekeeping (slots to
    /// repost, acks, completions of its sends) to the next pump — the answer's — and the flow
    /// never stalls on what was left: every round trip completes in order, and the readers
    /// took their messages from their own passes.
    #[test]
    fn a_ping_pong_of_handed_messages_keeps_flowing_on_a_small_window() {
        use std::time::Duration;
        const WAIT: Duration = Duration::from_secs(10);
        let (ca, cb) = caller_mode_channel(4);
        let n = 3_000u64;
        let echo = std::thread::spawn(move || {
            for _ in 0..n {
                let m = cb.recv_timeout(WAIT).expect("ping");
                cb.send_timeout(&m, WAIT).expect("pong");
            }
            cb
        });
        for i in 0..n {
            ca.send_timeout(&i.to_le_bytes(), WAIT).expect("send");
            let m = ca.recv_timeout(WAIT).expect("recv");
            assert_eq!(m[..], i.to_le_bytes(), "round trip {i}");
        }
        let cb = echo.join().expect("echo");
        for (side, ch) in [("a", &ca), ("b", &cb)] {
            let handed = ch.shared().handed_count();
            assert!(
                handed > 0,
                "{side}: no message was handed to the reading thread"
            );
        }
        // Nothing left behind: both ends still answer at once.
        ca.send_timeout(b"last", WAIT).expect("send last");
        assert_eq!(&cb.recv_timeout(WAIT).expect("recv last")[..], b"last");
    }

    /// Caller mode: the pass that gives a waiting caller its RPC reply ends there, leaving
    /// the rest of its work (the reply's receive slot, acks, send completions) to the next
    /// pass — the caller's next call or wait. On a receive ring of 8 slots and a stream window
    /// of 4, 3 000 calls in a row from each of two threads keep flowing (a pass that left
    /// slots or credits behind for good would stall them) and every reply is the right one.
    #[test]
    fn calls_whose_reply_ends_the_callers_pass_keep_flowing_on_a_small_ring() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        use std::time::Duration;
        const WAIT: Duration = Duration::from_secs(10);
        let (a, b, listener) = client_server(crate::Config {
            rx_slots: 8,
            stream_window: 4,
            ..caller_mode_config()
        });
        b.serve("echo", |req| Ok(req.to_vec()));
        let ca = a.connect(listener.local_addr()).expect("connect");
        let cb = listener.accept_timeout(WAIT).expect("accept");
        // The server's handlers run in the passes of a thread that calls in.
        let stop = Arc::new(AtomicBool::new(false));
        let server = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match cb.recv_timeout(Duration::from_millis(1)) {
                        Err(crate::ChannelError::Timeout) => {}
                        other => panic!("server: {other:?}"),
                    }
                }
                cb
            })
        };
        let rpc = crate::Rpc::new(ca);
        let callers: Vec<_> = (0..2u64)
            .map(|t| {
                let rpc = rpc.clone();
                std::thread::spawn(move || {
                    for i in 0..3_000u64 {
                        let req = (t << 32 | i).to_le_bytes();
                        let reply = rpc.call("echo", &req, WAIT).expect("call");
                        assert_eq!(reply[..], req, "caller {t}, call {i}");
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().expect("caller");
        }
        let handed = rpc.channel().shared().replies_handed_count();
        assert!(handed > 0, "no reply ended its caller's pass");
        // Nothing left behind: a call still returns at once.
        assert_eq!(
            rpc.call("echo", b"last", WAIT).expect("last call")[..],
            b"last"[..]
        );
        stop.store(true, Ordering::Relaxed);
        let _cb = server.join().expect("server");
    }

    /// QPs of `ep` in use (created, neither cached nor destroyed).
    fn qps_in_use(ep: &super::Endpoint) -> u64 {
        let st = ep.conn_stats();
        st.qps_created
            .saturating_sub(st.qps_dropped)
            .saturating_sub(st.qps_cached)
    }

    /// Caller mode: how long until `ep` has no QP in use, watched from outside (no call into
    /// either endpoint); `None` after a second.
    fn time_until_qps_back(ep: &super::Endpoint) -> Option<std::time::Duration> {
        let t = std::time::Instant::now();
        while qps_in_use(ep) > 0 {
            if t.elapsed() > std::time::Duration::from_secs(1) {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        Some(t.elapsed())
    }

    /// Caller mode: dropping one of two channels that share a connection closes its stream at
    /// once — the `STREAM_CLOSE` leaves from the dropping thread, not when the back-stop next
    /// takes the worker's queue (a grace after the last call) — so the peer's reader learns
    /// within moments. 20 rounds; at most two may take a grace.
    #[test]
    fn a_dropped_channel_closes_its_stream_at_once() {
        use std::time::{Duration, Instant};
        const WAIT: Duration = Duration::from_secs(10);
        let (a, _b, listener) = client_server(caller_mode_config());
        // Kept open throughout: the connection stays, only streams close.
        let _keep = a.connect(listener.local_addr()).expect("connect");
        let _kept = listener.accept_timeout(WAIT).expect("accept");
        let mut slow = Vec::new();
        for round in 0..20 {
            let ca = a.connect(listener.local_addr()).expect("second channel");
            let cb = listener.accept_timeout(WAIT).expect("accept second");
            let t = Instant::now();
            drop(ca);
            assert!(
                matches!(cb.recv_timeout(WAIT), Err(crate::ChannelError::PeerGone)),
                "round {round}: the close reaches the peer"
            );
            let took = t.elapsed();
            if took >= crate::worker::shared::BACKSTOP_GRACE {
                slow.push((round, took));
            }
        }
        assert!(
            slow.len() <= 2,
            "stream closes that waited a grace: {slow:?}"
        );
        assert_eq!(
            a.conn_stats().qps_created,
            1,
            "one connection carried every channel"
        );
    }

    /// Caller mode: a connection closed with a message not yet acknowledged lingers until the
    /// peer acknowledges it; the acknowledgement arrives while nobody calls into the closing
    /// endpoint, and its back-stop takes it (`WorkerShared::watch_lingering`) instead of
    /// leaving it for when its grace runs out. 20 rounds of send, drop, and a reader on the
    /// other side; at most two may take a grace.
    #[test]
    fn a_lingering_close_ends_when_the_peer_acknowledges() {
        use std::time::Duration;
        const WAIT: Duration = Duration::from_secs(10);
        let (a, b, listener) = client_server(caller_mode_config());
        let mut slow = Vec::new();
        for round in 0..20u64 {
            let ca = a.connect(listener.local_addr()).expect("connect");
            let cb = listener.accept_timeout(WAIT).expect("accept");
            ca.send_timeout(&round.to_le_bytes(), WAIT).expect("send");
            drop(ca);
            // The reader reads the message and waits on (its pass acknowledges it).
            let reader = std::thread::spawn(move || {
                let m = cb
                    .recv_timeout(WAIT)
                    .expect("the message sent before the close");
                assert_eq!(m[..], round.to_le_bytes());
                assert!(
                    matches!(cb.recv_timeout(WAIT), Err(crate::ChannelError::PeerGone)),
                    "the close reaches the reader"
                );
            });
            let took = time_until_qps_back(&a).expect("the client's QP never came back");
            if took >= crate::worker::shared::BACKSTOP_GRACE {
                slow.push((round, took));
            }
            reader.join().expect("reader");
            time_until_qps_back(&b).expect("the server's QP never came back");
            // The close ended the linger (published by the pass that retired the
            // connection, moments after its QP went back): the back-stop goes back to its
            // quiet watch.
            let t = std::time::Instant::now();
            while a.inner.workers().any(|w| w.shared.is_lingering()) {
                assert!(
                    t.elapsed() < Duration::from_secs(1),
                    "round {round}: a connection still counted as lingering"
                );
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        assert!(slow.len() <= 2, "closes that waited a grace: {slow:?}");
    }

    /// A caller-mode server of two workers with a channel on each to a thread-mode sink: the
    /// server, the sink, the sink's listener (its accepts give the sink's ends) and the two
    /// channels (the first on one worker, the second on the other).
    fn two_workers_and_a_sink() -> (
        super::Endpoint,
        super::Endpoint,
        super::Listener,
        std::sync::Arc<Vec<crate::Channel>>,
    ) {
        two_workers_and_a_sink_in(crate::Progress::Caller)
    }

    /// [`two_workers_and_a_sink`] with the server in `progress` mode.
    fn two_workers_and_a_sink_in(
        progress: crate::Progress,
    ) -> (
        super::Endpoint,
        super::Endpoint,
        super::Listener,
        std::sync::Arc<Vec<crate::Channel>>,
    ) {
        two_workers_and_a_sink_with(crate::Config {
            progress,
            ..caller_mode_config()
        })
    }

    /// [`two_workers_and_a_sink`] with the server built from `cfg` (two workers).
    fn two_workers_and_a_sink_with(
        cfg: crate::Config,
    ) -> (
        super::Endpoint,
        super::Endpoint,
        super::Listener,
        std::sync::Arc<Vec<crate::Channel>>,
    ) {
        let server = super::Endpoint::new(crate::Config { workers: 2, ..cfg }).expect("server");
        let sink = super::Endpoint::new(crate::Config {
            progress: crate::Progress::Thread,
            ..caller_mode_config()
        })
        .expect("sink");
        let sink_listener = sink.listen("127.0.0.1:0").expect("listen");
        let sink_at = sink_listener.local_addr();
        let out: Vec<crate::Channel> = (0..2)
            .map(|_| server.connect(sink_at).expect("connect to the sink"))
            .collect();
        assert!(
            !std::sync::Arc::ptr_eq(&out[0].shared().worker, &out[1].shared().worker),
            "the two channels share a worker"
        );
        (server, sink, sink_listener, std::sync::Arc::new(out))
    }

    /// A thread-mode client of two workers with an RPC connection from each to `server`
    /// (accepted round the server's workers): the server's listener, the client, and per
    /// connection its `Rpc` and the server's accepted end (whose worker handles its calls).
    fn two_rpc_clients(
        server: &super::Endpoint,
    ) -> (
        super::Listener,
        super::Endpoint,
        Vec<(crate::Rpc, crate::Channel)>,
    ) {
        let listener = server.listen("127.0.0.1:0").expect("listen");
        let client = super::Endpoint::new(crate::Config {
            workers: 2,
            progress: crate::Progress::Thread,
            ..caller_mode_config()
        })
        .expect("client");
        let conns = (0..2)
            .map(|_| {
                let c = client.connect(listener.local_addr()).expect("connect");
                let a = listener
                    .accept_timeout(std::time::Duration::from_secs(5))
                    .expect("accept");
                (crate::Rpc::new(c), a)
            })
            .collect();
        (listener, client, conns)
    }

    /// Caller mode: a handler's send on a channel of another worker whose state is busy at
    /// that moment is queued there, and that worker's back-stop is nudged to take it once the
    /// worker is free (`WorkerShared::nudge_backstop`). Here the state is held by an application
    /// thread that called in moments before and then stops calling: without the nudge the
    /// send waited for the back-stop's grace in some rounds (10–20 ms). Ten rounds; at most
    /// one may take 4 ms or more.
    #[test]
    fn a_send_a_handler_queues_for_a_busy_worker_goes_once_that_worker_is_free() {
        use std::time::{Duration, Instant};
        const WAIT: Duration = Duration::from_secs(5);
        let (server, _sink, sink_listener, out) = two_workers_and_a_sink();
        let (other, mine) = (&out[1].shared().worker, &out[0].shared().worker);
        {
            let out = out.clone();
            server.serve("other", move |_| {
                out[1].send(b"queued").map_err(|e| e.to_string())?;
                Ok(Vec::new())
            });
        }
        // The sink's end of the second channel: the one its first message comes on.
        out[1].send(b"first").expect("send");
        let ends: Vec<_> = (0..2)
            .map(|_| {
                sink_listener
                    .accept_timeout(WAIT)
                    .expect("the sink accepts")
            })
            .collect();
        let end = ends
            .iter()
            .find(|e| e.recv_timeout(Duration::from_millis(500)).is_ok())
            .expect("the first message");
        // Calls the server handles on the first channel's worker.
        let (listener, client, conns) = two_rpc_clients(&server);
        let (rpc, _) = conns
            .iter()
            .find(|(_, a)| std::sync::Arc::ptr_eq(&a.shared().worker, mine))
            .expect("a connection on the first channel's worker");
        let mut slow = Vec::new();
        for round in 0..10 {
            // The application calls in on the other worker, then holds its state while a
            // handler sends on it, then lets go and calls no more.
            out[1].send(b"warm").expect("send");
            assert_eq!(&end.recv_timeout(WAIT).expect("warm")[..], b"warm");
            let held = other.lock_state().expect("the other worker's state");
            rpc.call("other", b"", WAIT).expect("the handler's call");
            let t = Instant::now();
            drop(held);
            assert_eq!(&end.recv_timeout(WAIT).expect("queued")[..], b"queued");
            let took = t.elapsed();
            if took >= Duration::from_millis(4) {
                slow.push((round, took));
            }
        }
        assert!(slow.len() <= 1, "queued sends that waited: {slow:?}");
        drop((conns, client, listener));
    }

    /// Caller mode, two workers whose RPC handlers, running at the same time, each send on a
    /// channel of the other worker: a handler holds its own worker's state, so a sender that
    /// waited for the other worker's state would wait for a handler that waits for its own —
    /// each send is queued instead, and the calls complete.
    #[test]
    fn handlers_of_two_workers_sending_on_each_others_channels_do_not_deadlock() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        use std::time::{Duration, Instant};
        const WAIT: Duration = Duration::from_secs(5);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        // The body runs on a thread of its own: deadlocked workers would never let its
        // endpoints drop.
        std::thread::spawn(move || {
            let (server, sink, sink_listener, out) = two_workers_and_a_sink();
            let arrived = Arc::new(AtomicUsize::new(0));
            {
                let (out, arrived) = (out.clone(), arrived.clone());
                server.serve("cross", move |_| {
                    // Both handlers in at once (bounded: the test reports it otherwise).
                    arrived.fetch_add(1, Ordering::SeqCst);
                    let t = Instant::now();
                    while arrived.load(Ordering::SeqCst) < 2 && t.elapsed() < WAIT / 5 {
                        std::thread::yield_now();
                    }
                    for ch in out.iter() {
                        ch.send(b"across").map_err(|e| e.to_string())?;
                    }
                    Ok(arrived.load(Ordering::SeqCst).to_le_bytes().to_vec())
                });
            }
            // Two connections, accepted on the server's two workers.
            let (listener, client, conns) = two_rpc_clients(&server);
            let (rpcs, accepted): (Vec<_>, Vec<_>) = conns.into_iter().unzip();
            let calls: Vec<_> = rpcs
                .into_iter()
                .map(|rpc| std::thread::spawn(move || rpc.call("cross", b"", WAIT)))
                .collect();
            let results: Vec<_> = calls
                .into_iter()
                .map(|t| t.join().expect("caller"))
                .collect();
            // Every send of both handlers arrived.
            let mut got = 0;
            for _ in 0..2 {
                let ch = sink_listener
                    .accept_timeout(WAIT)
                    .expect("the sink accepts");
                for _ in 0..2 {
                    assert_eq!(
                        &ch.recv_timeout(WAIT).expect("a handler's send")[..],
                        b"across"
                    );
                    got += 1;
                }
            }
            assert_eq!(got, 4);
            let _ = done_tx.send(format!("{:?}", [&results[0], &results[1]]));
            drop((accepted, client, listener, server, sink_listener, sink));
        });
        let got = done_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the calls never returned");
        let both: Result<Vec<u8>, crate::RpcError> = Ok(2usize.to_le_bytes().to_vec());
        let two = format!("{:?}", [&both, &both]);
        assert_eq!(
            got, two,
            "both calls answered, their handlers at the same time"
        );
    }

    /// Nested calls: the server's handlers, on its two workers at the same time, each need the
    /// replies of two calls to a backend — over channels on both workers — before they answer.
    /// A handler that made them with a blocking `call` would hold its worker while the other
    /// handler's calls need that worker's passes (its replies arrive there). Served deferred,
    /// each handler starts its calls on a runtime and returns; the task answers through the
    /// `Responder` when both replies are in.
    #[test]
    fn deferred_handlers_of_two_workers_answer_after_nested_calls_on_each_others_channels() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        use std::time::{Duration, Instant};
        const WAIT: Duration = Duration::from_secs(10);
        let (server, sink, sink_listener, out) = two_workers_and_a_sink();
        sink.serve("inner", |req| {
            let mut r = b"inner:".to_vec();
            r.extend_from_slice(req);
            Ok(r)
        });
        // The sink's ends of the two channels (its listener's accepts) stay open.
        out.iter().for_each(|c| c.send(b"hello").expect("send"));
        let _ends: Vec<_> = (0..2)
            .map(|_| {
                sink_listener
                    .accept_timeout(WAIT)
                    .expect("the sink accepts")
            })
            .collect();
        let backends: Arc<Vec<crate::Rpc>> =
            Arc::new(out.iter().map(|c| crate::Rpc::new(c.clone())).collect());
        let rt = Arc::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime"),
        );
        let arrived = Arc::new(AtomicUsize::new(0));
        {
            let (rt, arrived) = (rt.clone(), arrived.clone());
            server.serve_deferred("outer", move |req, responder| {
                // Both handlers in at once (bounded: the assertions tell it otherwise).
                arrived.fetch_add(1, Ordering::SeqCst);
                let t = Instant::now();
                while arrived.load(Ordering::SeqCst) < 2 && t.elapsed() < WAIT / 5 {
                    std::thread::yield_now();
                }
                let (backends, req) = (backends.clone(), req.to_vec());
                rt.spawn(async move {
                    let mut body = Vec::new();
                    for b in backends.iter() {
                        match b.call_async("inner", &req, WAIT).await {
                            Ok(r) => body.extend_from_slice(&r),
                            Err(e) => return drop(responder.fail(&e.to_string())),
                        }
                        body.push(b'|');
                    }
                    responder.reply(&body).expect("reply");
                });
            });
        }
        let (listener, client, conns) = two_rpc_clients(&server);
        let (rpcs, accepted): (Vec<_>, Vec<_>) = conns.into_iter().unzip();
        let calls: Vec<_> = rpcs
            .into_iter()
            .enumerate()
            .map(|(i, rpc)| {
                std::thread::spawn(move || rpc.call("outer", format!("{i}").as_bytes(), WAIT))
            })
            .collect();
        for (i, t) in calls.into_iter().enumerate() {
            let got = t.join().expect("caller").expect("the outer call");
            assert_eq!(got, format!("inner:{i}|inner:{i}|").into_bytes());
        }
        assert_eq!(
            arrived.load(Ordering::SeqCst),
            2,
            "both handlers ran (at the same time)"
        );
        drop((accepted, client, listener));
    }

    /// The same nested calls made blocking, each on the other worker's channel only (on its
    /// own worker's a blocking call is refused: `RpcError::WouldDeadlock`): each handler holds
    /// its worker while its call needs the other's pass, so at least one call cannot be
    /// answered in time — but every call ends by its deadline (300 ms), and the outer calls
    /// with it. The nested call's deadline used to be kept by its worker's timer only, which
    /// the held worker never fired: both handlers waited for ever (their outer calls until
    /// their own deadline). Server in caller mode and with worker threads.
    #[test]
    fn blocking_nested_calls_of_two_workers_handlers_end_by_their_deadline() {
        for progress in [crate::Progress::Caller, crate::Progress::Thread] {
            blocking_nested_calls_end(progress);
        }
    }

    fn blocking_nested_calls_end(progress: crate::Progress) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        use std::time::{Duration, Instant};
        const WAIT: Duration = Duration::from_secs(10);
        const NESTED: Duration = Duration::from_millis(300);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        // On a thread of its own: held workers would never let its endpoints drop.
        std::thread::spawn(move || {
            let (server, sink, sink_listener, out) = two_workers_and_a_sink_in(progress);
            sink.serve("inner", |req| Ok(req.to_vec()));
            out.iter().for_each(|c| c.send(b"hello").expect("send"));
            let _ends: Vec<_> = (0..2)
                .map(|_| {
                    sink_listener
                        .accept_timeout(WAIT)
                        .expect("the sink accepts")
                })
                .collect();
            let backends: Arc<Vec<crate::Rpc>> =
                Arc::new(out.iter().map(|c| crate::Rpc::new(c.clone())).collect());
            let arrived = Arc::new(AtomicUsize::new(0));
            {
                let arrived = arrived.clone();
                server.serve("outer", move |req| {
                    arrived.fetch_add(1, Ordering::SeqCst);
                    let t = Instant::now();
                    while arrived.load(Ordering::SeqCst) < 2 && t.elapsed() < WAIT / 5 {
                        std::thread::yield_now();
                    }
                    let other = backends
                        .iter()
                        .find(|b| !b.channel().shared().worker.held_here())
                        .expect("a channel on the other worker");
                    other.call("inner", req, NESTED).map_err(|e| e.to_string())
                });
            }
            let (listener, client, conns) = two_rpc_clients(&server);
            let (rpcs, accepted): (Vec<_>, Vec<_>) = conns.into_iter().unzip();
            let calls: Vec<_> = rpcs
                .into_iter()
                .map(|rpc| std::thread::spawn(move || rpc.call("outer", b"x", WAIT)))
                .collect();
            let results: Vec<_> = calls
                .into_iter()
                .map(|t| t.join().expect("caller"))
                .collect();
            let _ = done_tx.send((results, arrived.load(Ordering::SeqCst)));
            drop((accepted, client, listener, server, sink_listener, sink));
        });
        let (results, arrived) = done_rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("{progress:?}: the calls never returned"));
        assert_eq!(arrived, 2, "{progress:?}: both handlers ran");
        let timed_out = crate::RpcError::Timeout.to_string();
        let mut late = 0;
        for r in &results {
            match r {
                Ok(body) => assert_eq!(body, b"x"),
                Err(crate::RpcError::Handler(m)) if *m == timed_out => late += 1,
                Err(e) => panic!("{progress:?}: outer call: {e:?}"),
            }
        }
        assert!(
            late >= 1,
            "{progress:?}: a nested call answered in time both ways: {results:?}"
        );
    }

    /// A handler's waits that have no deadline of their own, on a channel of the *other*
    /// worker, end by the endpoint's RPC deadline (here 300 ms) with `Timeout`: a `recv` for a
    /// message that never comes, and a one-sided read whose completion only that worker can
    /// read while a handler holds it for 1.5 s. Before, the first waited for ever and the
    /// second until the other handler returned. Server in caller mode and with worker threads.
    #[test]
    fn a_handlers_wait_on_another_workers_channel_ends_by_the_rpc_deadline() {
        for progress in [crate::Progress::Caller, crate::Progress::Thread] {
            // On a thread of its own: a handler that never returns would never let the
            // endpoints drop.
            let (done_tx, done_rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let passed = std::panic::catch_unwind(|| handler_waits_end(progress)).is_ok();
                let _ = done_tx.send(passed);
            });
            let passed = done_rx
                .recv_timeout(std::time::Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("{progress:?}: a handler's wait never ended"));
            assert!(passed, "{progress:?}: failed (the panic above)");
        }
    }

    fn handler_waits_end(progress: crate::Progress) {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        use std::time::{Duration, Instant};
        const WAIT: Duration = Duration::from_secs(10);
        const HOLD: Duration = Duration::from_millis(1500);
        let (server, sink, sink_listener, out) = two_workers_and_a_sink_with(crate::Config {
            progress,
            rpc_timeout_ms: 300,
            ..caller_mode_config()
        });
        let region = sink.expose(4096).expect("expose");
        out.iter().for_each(|c| c.send(b"hello").expect("send"));
        let _ends: Vec<_> = (0..2)
            .map(|_| {
                sink_listener
                    .accept_timeout(WAIT)
                    .expect("the sink accepts")
            })
            .collect();
        let remotes: Arc<Vec<crate::RemoteRegion>> = Arc::new(
            out.iter()
                .map(|c| c.remote_region(region.descriptor()))
                .collect(),
        );
        // The sink sends nothing on these channels: a `recv` there waits for what never comes.
        {
            let out = out.clone();
            server.serve("recv_other", move |_| {
                let other = out
                    .iter()
                    .find(|c| !c.shared().worker.held_here())
                    .expect("a channel on the other worker");
                other
                    .recv()
                    .map(|m| m.to_vec())
                    .map_err(|e| format!("{e:?}"))
            });
        }
        let holding = Arc::new(AtomicBool::new(false));
        {
            let (out, holding) = (out.clone(), holding.clone());
            server.serve("hold_or_read", move |_| {
                if out[0].shared().worker.held_here() {
                    // Holds the first channel's worker while the other handler reads.
                    holding.store(true, Ordering::SeqCst);
                    std::thread::sleep(HOLD);
                    holding.store(false, Ordering::SeqCst);
                    return Ok(b"held".to_vec());
                }
                let t = Instant::now();
                while !holding.load(Ordering::SeqCst) && t.elapsed() < WAIT {
                    std::thread::yield_now();
                }
                let t = Instant::now();
                let r = remotes[0].read(0, 8).map_err(|e| format!("{e:?}"));
                let still_held = holding.load(Ordering::SeqCst);
                Ok(format!("{r:?} after {:?}, still held {still_held}", t.elapsed()).into_bytes())
            });
        }
        let (listener, client, conns) = two_rpc_clients(&server);
        let (rpcs, accepted): (Vec<_>, Vec<_>) = conns.into_iter().unzip();
        let got = rpcs[0].call("recv_other", b"", WAIT);
        assert!(
            matches!(&got, Err(crate::RpcError::Handler(m)) if m == "Timeout"),
            "{progress:?}: recv on the other worker's channel: {got:?}"
        );
        let calls: Vec<_> = rpcs
            .into_iter()
            .map(|rpc| std::thread::spawn(move || rpc.call("hold_or_read", b"", WAIT)))
            .collect();
        let results: Vec<String> = calls
            .into_iter()
            .map(|t| {
                let r = t.join().expect("caller").expect("hold_or_read");
                String::from_utf8_lossy(&r).into_owned()
            })
            .collect();
        assert!(
            results.iter().any(|r| r == "held"),
            "{progress:?}: {results:?}"
        );
        assert!(
            results
                .iter()
                .any(|r| r.starts_with("Err(\"Timeout\")") && r.ends_with("still held true")),
            "{progress:?}: the read ended by its deadline, while the other worker was held: \
             {results:?}"
        );
        drop((accepted, client, listener));
    }

    /// Caller mode, a close whose peer's application called in moments ago and then stopped:
    /// the peer's back-stop stays out of the way for its grace, so the `STREAM_CLOSE` would be
    /// read (and acknowledged) — and the closing side's QP come back — only a grace later. The
    /// closing side nudges the peer over the control stream (`Worker::nudge_peer`), and the
    /// peer's back-stop, which watches control streams meanwhile, progresses the worker. 20
    /// rounds of connect, one message read by the peer, drop, on shm0 and on tcp0 (whose data
    /// path may deliver after the nudge: a later one covers it); at most two may take a grace.
    #[test]
    fn a_close_does_not_wait_for_a_quiet_peer_to_call_in() {
        for device in ["shm0", "tcp0"] {
            let cfg = crate::Config {
                device: device.into(),
                ..caller_mode_config()
            };
            close_with_a_quiet_peer(cfg);
        }
    }

    /// Caller mode, tcp0 without QP cache or kept control streams, a close right after the
    /// connect: the data connection of the new QP pair is still being set up when the
    /// `STREAM_CLOSE` is posted, so the first nudge reaches the peer before the message does
    /// and a later one has to follow — from the closing side's timers, which fire in the
    /// passes its back-stop runs while the connection lingers. 20 rounds; at most two may take
    /// a grace.
    #[test]
    fn a_close_right_after_a_new_tcp0_connect_is_nudged_until_acknowledged() {
        use std::time::Duration;
        const WAIT: Duration = Duration::from_secs(10);
        let cfg = crate::Config {
            device: "tcp0".into(),
            qp_cache_size: 0,
            reuse_control_streams: false,
            ..caller_mode_config()
        };
        let (a, b, listener) = client_server(cfg);
        let mut slow = Vec::new();
        for round in 0..20u64 {
            let ca = a.connect(listener.local_addr()).expect("connect");
            let cb = listener.accept_timeout(WAIT).expect("accept");
            drop(ca);
            let took = time_until_qps_back(&a).expect("the client's QP never came back");
            if took >= crate::worker::shared::BACKSTOP_GRACE {
                slow.push((round, took));
            }
            drop(cb);
            time_until_qps_back(&b).expect("the server's QP never came back");
        }
        assert!(
            slow.len() <= 2,
            "closes that waited for the peer's grace: {slow:?}"
        );
    }

    fn close_with_a_quiet_peer(cfg: crate::Config) {
        use std::time::Duration;
        const WAIT: Duration = Duration::from_secs(10);
        let device = cfg.device.clone();
        let (a, b, listener) = client_server(cfg);
        let mut slow = Vec::new();
        for round in 0..20u64 {
            let ca = a.connect(listener.local_addr()).expect("connect");
            let cb = listener.accept_timeout(WAIT).expect("accept");
            ca.send_timeout(&round.to_le_bytes(), WAIT).expect("send");
            // The peer's application calls in, then goes quiet with its channel open.
            assert_eq!(
                cb.recv_timeout(WAIT).expect("the message")[..],
                round.to_le_bytes()
            );
            drop(ca);
            let took = time_until_qps_back(&a).expect("the client's QP never came back");
            if took >= crate::worker::shared::BACKSTOP_GRACE {
                slow.push((round, took));
            }
            assert!(
                matches!(cb.recv_timeout(WAIT), Err(crate::ChannelError::PeerGone)),
                "the close reaches the peer"
            );
            drop(cb);
            time_until_qps_back(&b).expect("the server's QP never came back");
        }
        assert!(
            slow.len() <= 2,
            "{device}: closes that waited for the peer's grace: {slow:?}"
        );
    }

    /// Caller mode, a peer that closes and at once connects again (on the kept control
    /// stream): its hello reaches the listener only once the accepting side has let that
    /// stream go, which needs the peer's `Close` read — and no application thread reads
    /// control streams while it calls in. The back-stop watches them meanwhile
    /// (`WorkerShared::watch_control`); before it did, about a third of such reconnects waited
    /// one or two back-stop graces (10–20 ms; 62 of 200 here). A reconnect that takes a whole
    /// grace is that wait, not load: at most a few may, out of 50.
    #[test]
    fn a_reconnect_right_after_a_close_does_not_wait_for_the_back_stop() {
        use crate::{Config, Progress};
        use std::time::{Duration, Instant};
        const WAIT: Duration = Duration::from_secs(10);
        let cfg = Config {
            device: "shm0".into(),
            progress: Progress::Caller,
            ..Config::default()
        };
        let server = super::Endpoint::new(cfg.clone()).expect("server");
        let client = super::Endpoint::new(cfg).expect("client");
        let listener = server.listen("127.0.0.1:0").expect("listen");
        let rounds = 50;
        let mut slow = Vec::new();
        for i in 0..rounds {
            let t = Instant::now();
            let c = client.connect(listener.local_addr()).expect("connect");
            let s = listener.accept_timeout(WAIT).expect("accept");
            let took = t.elapsed();
            c.send(b"x").expect("send");
            assert_eq!(&s.recv_timeout(WAIT).expect("recv")[..], b"x");
            drop((c, s));
            if took >= crate::worker::shared::BACKSTOP_GRACE {
                slow.push((i, took));
            }
        }
        let stats = client.conn_stats();
        assert!(
            stats.stream_reuses > 0,
            "the reconnects did not reuse the control stream: {stats:?}"
        );
        assert!(
            slow.len() <= 3,
            "{} of {rounds} reconnects took a back-stop grace or more: {slow:?}",
            slow.len()
        );
    }

    /// The peer of a pooled connection went away (its endpoint dropped: the `Close` and the
    /// hang-up of its control stream are in this host's socket) while the connecting side's
    /// worker has not read that stream yet — arranged here by holding every worker of the
    /// client, which a busy worker amounts to: it looks at control streams only every 1024th
    /// idle pass or when it sleeps. A connect to a new endpoint on the same address must not
    /// be handed the dead connection (it once was, and the new endpoint never saw a peer): it
    /// sets up a new one, which the new endpoint accepts.
    #[test]
    fn a_pooled_connection_whose_peer_hung_up_is_not_reused_before_its_worker_noticed() {
        use crate::{ChannelError, Config, Endpoint};
        use std::time::Duration;
        const WAIT: Duration = Duration::from_secs(10);
        let devices = std::env::var("FABRIQ_TEST_DEVICES").unwrap_or_else(|_| "tcp0,shm0".into());
        for device in devices.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            let cfg = Config {
                device: device.into(),
                handshake_timeout_ms: 10_000,
                ..Config::default()
            };
            let Ok(first) = Endpoint::new(cfg.clone()) else {
                eprintln!("skipping {device}: it does not open here");
                continue;
            };
            let client = Endpoint::new(cfg.clone()).expect("client");
            let listener = first.listen("127.0.0.1:0").expect("listen");
            let addr = listener.local_addr();
            let old = client.connect(addr).expect("connect");
            let old_peer = listener.accept_timeout(WAIT).expect("accept");
            old.send(b"first").expect("send");
            assert_eq!(&old_peer.recv_timeout(WAIT).expect("recv")[..], b"first");
            // From here on the client's workers read nothing.
            let held: Vec<_> = client
                .inner
                .workers()
                .map(|w| loop {
                    // (Once this thread holds one worker's state, the next is taken only free.)
                    if let Some(g) = w.shared.try_lock_state() {
                        break g;
                    }
                    std::thread::yield_now();
                })
                .collect();
            drop((listener, old_peer, first));
            let second = Endpoint::new(cfg).expect("second server");
            let listener = match second.listen(addr) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("skipping {device}: {addr} not free again: {e}");
                    continue;
                }
            };
            let new = client.connect(addr).expect("connect again");
            drop(held);
            let new_peer = listener
                .accept_timeout(WAIT)
                .unwrap_or_else(|e| panic!("{device}: the new endpoint saw no peer: {e}"));
            new.send(b"second").expect("send");
            assert_eq!(&new_peer.recv_timeout(WAIT).expect("recv")[..], b"second");
            new_peer.send(b"back").expect("send back");
            assert_eq!(&new.recv_timeout(WAIT).expect("recv back")[..], b"back");
            let pool = client.pool_stats();
            assert_eq!((pool.hits, pool.misses), (0, 2), "{device}: {pool:?}");
            assert_eq!(client.conn_stats().connects, 2, "{device}");
            match old.recv_timeout(WAIT) {
                Err(ChannelError::PeerGone) => {}
                other => panic!("{device}: expected PeerGone on the old channel, got {other:?}"),
            }
        }
    }
}
