//! [`Endpoint`]: opens the device, starts the workers, and sets channels up — `connect(addr)` on
//! one side, `listen(addr)` + [`Listener::accept`] on the other.
//!
//! Set-up is out of band over TCP and ordered so that no side can ever send into a receive queue
//! that is not posted yet (no RNR from the first message on):
//!
//! ```text
//! client                                          server
//! QP INIT ── hello{QP endpoint, ring geometry} ─▶ QP INIT, post receive ring, RTR → RTS
//! post receive ring, RTR → RTS  ◀── hello ──────
//! ─── ready ───────────────────────────────────▶ adopt channel on a worker (may send now)
//! adopt channel on a worker (may send now)
//! ```
//!
//! The TCP stream stays open as the channel's control stream: its hang-up tells the worker the
//! peer is gone. The handshake is versioned (`fabriq.version` in the hello) and every field read
//! from the peer is range-checked.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use fabriq_verbs::{
    oob, AccessFlags, CompletionQueue, Context, ProtectionDomain, QpAttr, QpCaps, QpEndpoint,
    QpInitAttr,
};
use parking_lot::Mutex;

use crate::channel::driver::ChannelDriver;
use crate::channel::proto::ChannelConfig;
use crate::channel::{ChannelError, PeerGeometry};
use crate::config::Config;
use crate::handle::Channel;
use crate::remote::ExposedRegion;
use crate::worker::shared::{ChannelShared, WorkerShared};
use crate::worker::{self, Adopt, Command, Handlers, WorkerConfig, ONE_SIDED_DEPTH};

const HELLO_VERSION: &str = "1";
const READY: u8 = 0xA5;
const ACCESS: AccessFlags = AccessFlags::all();

struct WorkerRef {
    shared: Arc<WorkerShared>,
    cq: CompletionQueue,
}

struct Inner {
    config: Config,
    ctx: Context,
    pd: ProtectionDomain,
    device_gbps: u32,
    workers: Vec<WorkerRef>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    handlers: Arc<Handlers>,
    next_worker: AtomicUsize,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for w in &self.workers {
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
            .field("device", &self.inner.ctx.device().name)
            .field("workers", &self.inner.workers.len())
            .finish()
    }
}

/// Resolve `auto` to a device: a real RDMA device (provider `rdma-core`) whose port is up, else
/// `shm0` (same host) when the provider opens, else `tcp0`.
fn open_device(name: &str) -> Result<Context, ChannelError> {
    if name != "auto" {
        return Ok(Context::open(name)?);
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
                return Ok(c)
            }
            Ok(_) => tracing::debug!(device = %nic.name, "port not active, skipped by auto"),
            Err(e) => tracing::debug!(device = %nic.name, %e, "cannot open, skipped by auto"),
        }
    }
    match Context::open("shm0") {
        Ok(c) => Ok(c),
        Err(e) => {
            tracing::debug!(%e, "shm0 unavailable, trying tcp0");
            Ok(Context::open("tcp0")?)
        }
    }
}

impl Endpoint {
    /// Open the device and start the workers.
    pub fn new(config: Config) -> Result<Endpoint, ChannelError> {
        config
            .validate()
            .map_err(|e| ChannelError::InvalidConfig(e.to_string()))?;
        let ctx = open_device(&config.device)?;
        let pd = ctx.alloc_pd()?;
        let attr = ctx.query_device();
        let device_gbps = ctx.query_port(1).map(|p| p.speed_gbps).unwrap_or(0);
        let handlers: Arc<Handlers> = Arc::default();
        let cqe = attr.max_cqe.min(16 * 1024);
        let mut workers = Vec::with_capacity(config.workers);
        let mut threads = Vec::with_capacity(config.workers);
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
            };
            let t = worker::spawn(
                Arc::clone(&shared),
                cq.clone(),
                pd.clone(),
                Arc::clone(&handlers),
                wcfg,
            )?;
            threads.push(t);
            workers.push(WorkerRef { shared, cq });
        }
        Ok(Endpoint {
            inner: Arc::new(Inner {
                config,
                ctx,
                pd,
                device_gbps,
                workers,
                threads: Mutex::new(threads),
                handlers,
                next_worker: AtomicUsize::new(0),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The device name in use.
    pub fn device(&self) -> &str {
        &self.inner.ctx.device().name
    }

    /// Wake-ups written to sleeping workers so far (a measure of idle hand-offs).
    pub fn worker_wakeups(&self) -> u64 {
        self.inner
            .workers
            .iter()
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
            (method.to_string(), Arc::new(handler)),
        );
    }

    /// Expose `len` bytes of registered memory for peers' one-sided access.
    pub fn expose(&self, len: usize) -> Result<ExposedRegion, ChannelError> {
        let mr = self.inner.pd.alloc_mr(len, ACCESS)?;
        Ok(ExposedRegion::new(mr))
    }

    fn channel_config(&self) -> ChannelConfig {
        self.inner.config.channel_config(self.inner.device_gbps)
    }

    fn pick_worker(&self) -> &WorkerRef {
        let i = self.inner.next_worker.fetch_add(1, Ordering::Relaxed) % self.inner.workers.len();
        &self.inner.workers[i]
    }

    fn create_qp(
        &self,
        w: &WorkerRef,
        cfg: &ChannelConfig,
    ) -> Result<fabriq_verbs::QueuePair, ChannelError> {
        let attr = self.inner.ctx.query_device();
        let mut init = QpInitAttr::new(&w.cq);
        init.caps = QpCaps {
            max_send_wr: (cfg.sq_depth + ONE_SIDED_DEPTH).min(attr.max_qp_wr),
            max_recv_wr: cfg.rx_slots.min(attr.max_qp_wr),
            max_send_sge: 2.min(attr.max_sge),
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        if init.caps.max_recv_wr < cfg.rx_slots || init.caps.max_send_wr < cfg.sq_depth {
            return Err(ChannelError::InvalidConfig(format!(
                "device allows {} work requests per queue, the channel needs {}",
                attr.max_qp_wr,
                cfg.rx_slots.max(cfg.sq_depth)
            )));
        }
        let qp = self.inner.pd.create_qp(&init)?;
        qp.modify(&QpAttr::init(ACCESS))?;
        Ok(qp)
    }

    /// INIT → RTR → RTS towards the peer's QP.
    fn connect_qp(
        &self,
        qp: &fabriq_verbs::QueuePair,
        remote: &QpEndpoint,
    ) -> Result<(), ChannelError> {
        qp.modify(&QpAttr::rtr(remote.clone()))?;
        qp.modify(&QpAttr::rts().with_rnr_retry(self.inner.config.rnr_retry))?;
        Ok(())
    }

    fn hello(qp: &fabriq_verbs::QueuePair, cfg: &ChannelConfig) -> QpEndpoint {
        let mut ep = qp.endpoint();
        ep.extra
            .insert("fabriq.version".into(), HELLO_VERSION.into());
        ep.extra
            .insert("fabriq.rx_slots".into(), cfg.rx_slots.to_string());
        ep.extra
            .insert("fabriq.rx_slot_size".into(), cfg.rx_slot_size.to_string());
        ep
    }

    fn peer_geometry(peer: &QpEndpoint) -> Result<PeerGeometry, ChannelError> {
        let field = |k: &str| -> Result<u32, ChannelError> {
            peer.extra
                .get(k)
                .and_then(|v| v.parse::<u32>().ok())
                .ok_or_else(|| ChannelError::Handshake(format!("peer hello lacks a valid {k}")))
        };
        match peer.extra.get("fabriq.version").map(String::as_str) {
            Some(HELLO_VERSION) => {}
            other => {
                return Err(ChannelError::Handshake(format!(
                    "peer speaks handshake version {other:?}, we speak {HELLO_VERSION}"
                )))
            }
        }
        let geo = PeerGeometry {
            rx_slots: field("fabriq.rx_slots")?,
            rx_slot_size: field("fabriq.rx_slot_size")?,
        };
        if !(4..=1 << 16).contains(&geo.rx_slots) || !(64..=1 << 24).contains(&geo.rx_slot_size) {
            return Err(ChannelError::Handshake(format!(
                "peer ring geometry {geo:?} out of range"
            )));
        }
        Ok(geo)
    }

    fn adopt(
        &self,
        w: &WorkerRef,
        driver: ChannelDriver,
        stream: TcpStream,
        peer: SocketAddr,
        cfg: &ChannelConfig,
    ) -> Channel {
        let id = driver.qp().qp_num().0;
        let window = u64::from(cfg.max_queued) + u64::from(cfg.rx_slots);
        let shared = Arc::new(ChannelShared::new(id, Arc::clone(&w.shared), window));
        w.shared.submit(Command::Adopt(Box::new(Adopt {
            driver,
            shared: Arc::clone(&shared),
            control: Some(stream),
        })));
        Channel::new(shared, self.clone(), peer, cfg.thresholds.eager_max)
    }

    /// Connect to a listening endpoint.
    pub fn connect(&self, addr: impl ToSocketAddrs) -> Result<Channel, ChannelError> {
        let timeout = self.inner.config.handshake_timeout();
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| ChannelError::Handshake(format!("resolve: {e}")))?
            .collect();
        let mut last = None;
        let mut stream = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, timeout) {
                Ok(s) => {
                    stream = Some((s, *a));
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let Some((mut stream, peer)) = stream else {
            return Err(ChannelError::Handshake(format!(
                "connect {addrs:?}: {}",
                last.map_or_else(|| "no address".into(), |e| e.to_string())
            )));
        };
        stream.set_nodelay(true).ok();
        stream.set_read_timeout(Some(timeout)).ok();
        stream.set_write_timeout(Some(timeout)).ok();
        let w = self.pick_worker();
        let cfg = self.channel_config();
        let qp = self.create_qp(w, &cfg)?;
        oob::write_endpoint(&mut stream, &Self::hello(&qp, &cfg))?;
        let remote = oob::read_endpoint(&mut stream)?;
        let geo = Self::peer_geometry(&remote)?;
        let mut driver = ChannelDriver::new(&self.inner.pd, qp.clone(), cfg.clone(), geo)?;
        driver.post_ready(worker::now())?;
        self.connect_qp(&qp, &remote)?;
        stream
            .write_all(&[READY])
            .map_err(|e| ChannelError::Handshake(format!("send ready: {e}")))?;
        stream.set_read_timeout(None).ok();
        Ok(self.adopt(w, driver, stream, peer, &cfg))
    }

    /// Server half of the handshake on an accepted stream.
    fn accept_stream(
        &self,
        mut stream: TcpStream,
        peer: SocketAddr,
    ) -> Result<Channel, ChannelError> {
        let timeout = self.inner.config.handshake_timeout();
        stream.set_nodelay(true).ok();
        stream.set_read_timeout(Some(timeout)).ok();
        stream.set_write_timeout(Some(timeout)).ok();
        let remote = oob::read_endpoint(&mut stream)?;
        let geo = Self::peer_geometry(&remote)?;
        let w = self.pick_worker();
        let cfg = self.channel_config();
        let qp = self.create_qp(w, &cfg)?;
        let mut driver = ChannelDriver::new(&self.inner.pd, qp.clone(), cfg.clone(), geo)?;
        driver.post_ready(worker::now())?;
        self.connect_qp(&qp, &remote)?;
        oob::write_endpoint(&mut stream, &Self::hello(&qp, &cfg))?;
        let mut ready = [0u8; 1];
        stream
            .read_exact(&mut ready)
            .map_err(|e| ChannelError::Handshake(format!("waiting for ready: {e}")))?;
        if ready[0] != READY {
            return Err(ChannelError::Handshake("bad ready byte".into()));
        }
        stream.set_read_timeout(None).ok();
        Ok(self.adopt(w, driver, stream, peer, &cfg))
    }

    /// Listen for channels on `addr` (port 0: any free port).
    pub fn listen(&self, addr: impl ToSocketAddrs) -> Result<Listener, ChannelError> {
        let l =
            TcpListener::bind(addr).map_err(|e| ChannelError::Handshake(format!("bind: {e}")))?;
        let local = l
            .local_addr()
            .map_err(|e| ChannelError::Handshake(format!("local_addr: {e}")))?;
        let (tx, rx) = std::sync::mpsc::channel::<Channel>();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        // The acceptor holds a weak reference: a listener does not keep the endpoint alive.
        let weak = Arc::downgrade(&self.inner);
        let thread = std::thread::Builder::new()
            .name("fabriq-acceptor".into())
            .spawn(move || {
                for conn in l.incoming() {
                    if stop2.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = conn else { continue };
                    let Some(inner) = weak.upgrade() else { break };
                    let ep = Endpoint { inner };
                    let peer = stream
                        .peer_addr()
                        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
                    match ep.accept_stream(stream, peer) {
                        Ok(ch) => {
                            if tx.send(ch).is_err() {
                                break;
                            }
                        }
                        Err(e) => tracing::warn!(%e, %peer, "handshake failed"),
                    }
                }
            })
            .map_err(|e| ChannelError::Handshake(format!("spawn acceptor: {e}")))?;
        Ok(Listener {
            local,
            rx: Mutex::new(rx),
            stop,
            thread: Some(thread),
        })
    }
}

/// Accepts channels connected to a listening address.
pub struct Listener {
    local: SocketAddr,
    rx: Mutex<std::sync::mpsc::Receiver<Channel>>,
    stop: Arc<AtomicBool>,
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

    /// Wait for the next channel.
    pub fn accept(&self) -> Result<Channel, ChannelError> {
        self.rx.lock().recv().map_err(|_| ChannelError::Closed)
    }

    /// Wait at most `timeout` for the next channel.
    pub fn accept_timeout(&self, timeout: Duration) -> Result<Channel, ChannelError> {
        self.rx.lock().recv_timeout(timeout).map_err(|e| match e {
            std::sync::mpsc::RecvTimeoutError::Timeout => ChannelError::Timeout,
            std::sync::mpsc::RecvTimeoutError::Disconnected => ChannelError::Closed,
        })
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Unblock the acceptor's accept().
        let mut wake = self.local;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
