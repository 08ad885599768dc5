//! The `udp0` context: the virtual-path sockets, the epoll set and the progress thread.
//!
//! Owns: one UDP socket per virtual path (socket `k` is VP `k`'s source port), the QP table
//! (`qpn → Weak<UdpQp>`), the clock edge (std `Instant` ↔ `fabriq_mpath::Instant`) and the
//! thread that reads datagrams and runs timers. Does not own any protocol decision: datagrams go
//! to the QP named in their header ([`super::wire`]), which feeds its mpath connection.

use std::io::IoSlice;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use rustix::event::epoll;
use rustix::fd::OwnedFd;

use super::qp::UdpQp;
use super::sys::recv_with_tos;
use super::wire::{Header, Kind};
use super::Options;
use crate::soft::qp_table::QpTable;
use crate::{DeviceInfo, Result, VerbsError};

const TOKEN_WAKE: u64 = u64::MAX;
const TOKEN_TIMER: u64 = u64::MAX - 1;
/// Longest sleep of the progress thread when no timer is armed.
const MAX_SLEEP: Duration = Duration::from_millis(500);
/// Datagrams read from one socket per readiness event (epoll is level-triggered).
const RECV_BUDGET: usize = 256;
/// Largest datagram accepted.
const MAX_DATAGRAM: usize = 65_536;
/// Socket buffer size asked for (the kernel may cap it).
const SOCKET_BUFFER: usize = 8 << 20;

struct Poller {
    epoll: OwnedFd,
    wake: OwnedFd,
    /// Armed with the next deadline: epoll's own timeout has millisecond resolution, too coarse
    /// for mpath's pacing and burst timers.
    timer: OwnedFd,
    stop: AtomicBool,
    /// Nanoseconds since `epoch` the thread sleeps until (u64::MAX while computing; 0 awake).
    sleep_until_ns: AtomicU64,
}

impl Poller {
    fn wake(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }
}

/// The context of device `udp0`.
pub(crate) struct Engine {
    pub device: DeviceInfo,
    pub opts: Options,
    /// Address of socket 0 (what endpoints advertise).
    pub local_addr: SocketAddr,
    /// The local port of every virtual-path socket, by VP index.
    pub ports: Vec<u16>,
    weak_self: Weak<Engine>,
    sockets: Vec<UdpSocket>,
    poller: Arc<Poller>,
    epoch: Instant,
    qps: QpTable<UdpQp>,
}

fn io_err(what: &'static str) -> impl FnOnce(std::io::Error) -> VerbsError {
    move |e| VerbsError::io(what, e)
}

fn open_socket(addr: SocketAddr) -> Result<UdpSocket> {
    let s =
        UdpSocket::bind(addr).map_err(|e| VerbsError::io("udp0: bind a virtual-path socket", e))?;
    // Receives are non-blocking per call (MSG_DONTWAIT); sends block when the socket buffer is
    // full, which paces a sender to its link instead of dropping locally.
    if rustix::net::sockopt::set_socket_recv_buffer_size_force(&s, SOCKET_BUFFER).is_err() {
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&s, SOCKET_BUFFER);
    }
    if rustix::net::sockopt::set_socket_send_buffer_size_force(&s, SOCKET_BUFFER).is_err() {
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(&s, SOCKET_BUFFER);
    }
    if addr.is_ipv4() {
        // ECT(0) on everything sent; CE read back on receive.
        rustix::net::sockopt::set_ip_tos(&s, 0x02)
            .map_err(|e| VerbsError::io("udp0: set IP_TOS", e))?;
        rustix::net::sockopt::set_ip_recvtos(&s, true)
            .map_err(|e| VerbsError::io("udp0: set IP_RECVTOS", e))?;
    }
    Ok(s)
}

impl Engine {
    pub fn start(device: DeviceInfo, opts: Options) -> Result<Arc<Engine>> {
        let mut sockets = Vec::with_capacity(usize::from(opts.paths));
        for k in 0..opts.paths {
            let mut addr = opts.bind;
            if opts.bind.port() != 0 {
                let port = opts.bind.port().checked_add(k).ok_or_else(|| {
                    VerbsError::InvalidArgument(format!(
                        "udp0: ports {}+{} exceed 65535",
                        opts.bind.port(),
                        opts.paths
                    ))
                })?;
                addr.set_port(port);
            }
            sockets.push(open_socket(addr)?);
        }
        let mut ports = Vec::with_capacity(sockets.len());
        for s in &sockets {
            ports.push(
                s.local_addr()
                    .map_err(io_err("udp0: local address"))?
                    .port(),
            );
        }
        let mut local_addr = opts.bind;
        local_addr.set_port(ports.first().copied().unwrap_or(0));
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC)
            .map_err(|e| VerbsError::io("udp0: epoll_create", e))?;
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )
        .map_err(|e| VerbsError::io("udp0: eventfd", e))?;
        epoll::add(
            &ep,
            &wake,
            epoll::EventData::new_u64(TOKEN_WAKE),
            epoll::EventFlags::IN,
        )
        .map_err(|e| VerbsError::io("udp0: epoll add", e))?;
        for (k, s) in sockets.iter().enumerate() {
            epoll::add(
                &ep,
                s,
                epoll::EventData::new_u64(k as u64),
                epoll::EventFlags::IN,
            )
            .map_err(|e| VerbsError::io("udp0: epoll add", e))?;
        }
        let timer = rustix::time::timerfd_create(
            rustix::time::TimerfdClockId::Monotonic,
            rustix::time::TimerfdFlags::NONBLOCK | rustix::time::TimerfdFlags::CLOEXEC,
        )
        .map_err(|e| VerbsError::io("udp0: timerfd_create", e))?;
        epoll::add(
            &ep,
            &timer,
            epoll::EventData::new_u64(TOKEN_TIMER),
            epoll::EventFlags::IN,
        )
        .map_err(|e| VerbsError::io("udp0: epoll add", e))?;
        let poller = Arc::new(Poller {
            epoll: ep,
            wake,
            timer,
            stop: AtomicBool::new(false),
            sleep_until_ns: AtomicU64::new(0),
        });
        let first_qpn = (rand::random::<u32>() & 0x00ff_ffff).max(1);
        let engine = Arc::new_cyclic(|weak| Engine {
            device,
            opts,
            local_addr,
            ports,
            weak_self: weak.clone(),
            sockets,
            poller: poller.clone(),
            epoch: Instant::now(),
            qps: QpTable::new(first_qpn),
        });
        let weak = Arc::downgrade(&engine);
        std::thread::Builder::new()
            .name(format!("fabriq-udp0-{}", local_addr.port()))
            .spawn(move || progress_thread(weak, poller))
            .map_err(|e| VerbsError::io("udp0: spawn progress thread", e))?;
        Ok(engine)
    }

    pub fn self_arc(&self) -> Result<Arc<Engine>> {
        self.weak_self
            .upgrade()
            .ok_or_else(|| VerbsError::InvalidArgument("udp0 context is closing".into()))
    }

    /// The mpath clock: nanoseconds since this context started.
    pub fn mpath_now(&self, now: Instant) -> fabriq_mpath::Instant {
        fabriq_mpath::Instant::from_nanos(
            u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX),
        )
    }

    /// The std instant of an mpath deadline.
    pub fn std_instant(&self, t: fabriq_mpath::Instant) -> Instant {
        self.epoch + Duration::from_nanos(t.as_nanos())
    }

    /// A fresh QP number (24 bits, never 0, unique in this context).
    pub fn alloc_qpn(&self) -> u32 {
        self.qps.alloc_qpn()
    }

    pub fn add_qp(&self, qpn: u32, qp: &Arc<UdpQp>) {
        self.qps.insert(qpn, qp);
    }

    pub fn remove_qp(&self, qpn: u32) {
        self.qps.remove(qpn);
    }

    fn qp(&self, qpn: u32) -> Option<Arc<UdpQp>> {
        self.qps.get(qpn)
    }

    fn all_qps(&self) -> Vec<Arc<UdpQp>> {
        self.qps.all()
    }

    /// Send `header ‖ body` from the socket of virtual path `path` to `to`. A full or failing
    /// socket drops the datagram: mpath's loss recovery resends it.
    pub fn send(&self, path: u16, to: SocketAddr, header: &Header, body: &[u8]) {
        let Some(sock) = self
            .sockets
            .get(usize::from(path) % self.sockets.len().max(1))
        else {
            return;
        };
        let h = header.encode();
        let iov = [IoSlice::new(&h), IoSlice::new(body)];
        let addr = rustix::net::SocketAddrAny::from(to);
        loop {
            match rustix::net::sendmsg_addr(
                sock,
                &addr,
                &iov,
                &mut rustix::net::SendAncillaryBuffer::default(),
                rustix::net::SendFlags::empty(),
            ) {
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::trace!(%e, %to, "udp0: datagram not sent");
                    return;
                }
                Ok(_) => return,
            }
        }
    }

    /// Make sure the progress thread wakes by `deadline`.
    pub fn note_deadline(&self, deadline: Option<Instant>) {
        let Some(d) = deadline else { return };
        let ns =
            u64::try_from(d.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX);
        if ns < self.poller.sleep_until_ns.load(Ordering::Acquire) {
            self.poller.wake();
        }
    }

    fn next_timeout(&self, now: Instant) -> Duration {
        let mut next = now + MAX_SLEEP;
        for qp in self.all_qps() {
            if let Some(t) = qp.poll_timeout() {
                next = next.min(t);
            }
        }
        next.saturating_duration_since(now)
    }

    fn run_timers(&self, now: Instant) {
        for qp in self.all_qps() {
            if qp.poll_timeout().is_some_and(|t| t <= now) {
                qp.on_timer(now);
            }
        }
    }

    /// Read what socket `k` holds and hand each datagram to its QP; QPs that got input answer
    /// once the batch is read.
    fn drain_socket(&self, k: usize, buf: &mut [u8], touched: &mut Vec<Arc<UdpQp>>) {
        let Some(sock) = self.sockets.get(k) else {
            return;
        };
        let mut last: Option<Arc<UdpQp>> = None;
        for _ in 0..RECV_BUDGET {
            let got = match recv_with_tos(sock, buf) {
                Ok(Some(g)) => g,
                Ok(None) => break,
                Err(e) => {
                    // ICMP errors (port unreachable) surface here; the peer's mpath timeout
                    // decides whether it is gone.
                    tracing::trace!(%e, "udp0: receive error");
                    continue;
                }
            };
            let Some(dgram) = buf.get(..got.len) else {
                continue;
            };
            let Some((h, body)) = Header::decode(dgram) else {
                tracing::debug!(from = %got.from, "udp0: foreign datagram dropped");
                continue;
            };
            let qp = match &last {
                Some(q) if q.qp_num_raw() == h.dst_qpn => q.clone(),
                _ => match self.qp(h.dst_qpn) {
                    Some(q) => q,
                    None => {
                        tracing::debug!(qpn = h.dst_qpn, "udp0: datagram for an unknown QP");
                        continue;
                    }
                },
            };
            let now = Instant::now();
            match h.kind {
                Kind::Mpath => {
                    if qp.handle_datagram(now, &h, got.from, got.ce, body)
                        && !touched.iter().any(|t| Arc::ptr_eq(t, &qp))
                    {
                        touched.push(qp.clone());
                    }
                }
                Kind::Close => qp.handle_close(&h, got.from),
            }
            last = Some(qp);
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.poller.stop.store(true, Ordering::Release);
        self.poller.wake();
    }
}

fn progress_thread(engine: Weak<Engine>, poller: Arc<Poller>) {
    let mut events: Vec<epoll::Event> = Vec::with_capacity(64);
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut touched: Vec<Arc<UdpQp>> = Vec::new();
    loop {
        if poller.stop.load(Ordering::Acquire) {
            return;
        }
        poller.sleep_until_ns.store(u64::MAX, Ordering::Release);
        let (timeout, epoch) = {
            let Some(engine) = engine.upgrade() else {
                return;
            };
            (engine.next_timeout(Instant::now()), engine.epoch)
        };
        let until = Instant::now() + timeout;
        poller.sleep_until_ns.store(
            u64::try_from(until.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX),
            Ordering::Release,
        );
        // A zero relative value would disarm the timer: 1 ns means "now".
        let timeout = timeout.max(Duration::from_nanos(1));
        let spec = rustix::time::Itimerspec {
            it_interval: rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: rustix::time::Timespec {
                tv_sec: timeout.as_secs() as i64,
                tv_nsec: i64::from(timeout.subsec_nanos()),
            },
        };
        if let Err(e) = rustix::time::timerfd_settime(
            &poller.timer,
            rustix::time::TimerfdTimerFlags::empty(),
            &spec,
        ) {
            tracing::warn!(%e, "udp0: timerfd_settime failed; progress thread stops");
            return;
        }
        events.clear();
        match epoll::wait(
            &poller.epoll,
            rustix::buffer::spare_capacity(&mut events),
            None,
        ) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                tracing::warn!(%e, "udp0: epoll_wait failed; progress thread stops");
                return;
            }
        }
        poller.sleep_until_ns.store(0, Ordering::Release);
        if poller.stop.load(Ordering::Acquire) {
            return;
        }
        let Some(engine) = engine.upgrade() else {
            return;
        };
        for ev in &events {
            match ev.data.u64() {
                TOKEN_WAKE => {
                    let mut b = [0u8; 8];
                    let _ = rustix::io::read(&poller.wake, &mut b);
                }
                TOKEN_TIMER => {
                    let mut b = [0u8; 8];
                    let _ = rustix::io::read(&poller.timer, &mut b);
                }
                k => engine.drain_socket(k as usize, &mut buf, &mut touched),
            }
        }
        let now = Instant::now();
        for qp in touched.drain(..) {
            qp.pump_now(now);
        }
        engine.run_timers(now);
    }
}
