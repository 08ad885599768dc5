//! The `udp0` context: the virtual-path sockets, the epoll set and the progress thread.
//!
//! Owns: one UDP socket per virtual path (socket `k` is VP `k`'s source port), the QP table
//! (`qpn → Weak<UdpQp>`), the clock edge (std `Instant` ↔ `fabriq_mpath::Instant`) and what the
//! progress thread does when it wakes: read datagrams, pump the QPs they touched, run timers.
//! The epoll set, wake-ups, the timerfd and the thread's loop are [`crate::soft::poller`]'s.
//! Does not own any protocol decision: datagrams go to the QP named in their header
//! ([`super::wire`]), which feeds its mpath connection.
//!
//! System calls are batched ([`super::sys`]): a QP's pump hands over every datagram it produced
//! at once, sent per socket with `sendmmsg` (optionally as UDP GSO messages), and the thread reads
//! each ready socket with `recvmmsg` (optionally with UDP GRO).

use std::io::IoSlice;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use rustix::event::epoll;

use super::qp::UdpQp;
use super::sys::{self, RecvBatch, TxBatch};
use super::wire::{Header, Kind};
use super::{Options, DEVICE};
use crate::soft::poller::{self, Poller, SleepTimer};
use crate::soft::qp_table::QpTable;
use crate::{DeviceInfo, Result, VerbsError};

/// Longest sleep of the progress thread when no timer is armed.
const MAX_SLEEP: Duration = Duration::from_millis(500);
/// `recvmmsg` calls on one socket per wake-up (epoll is level-triggered), each of up to
/// [`sys::BATCH`] datagrams.
const RECV_CALLS: usize = 4;
/// Largest datagram accepted (and receive slot size with GRO).
const MAX_DATAGRAM: usize = 65_536;
/// Socket buffer size asked for (the kernel may cap it).
const SOCKET_BUFFER: usize = 8 << 20;

/// The context of device `udp0`.
pub(crate) struct Engine {
    pub device: DeviceInfo,
    pub opts: Options,
    /// Address of socket 0 (what endpoints advertise).
    pub local_addr: SocketAddr,
    /// The local port of every virtual-path socket, by VP index.
    pub ports: Vec<u16>,
    pub weak_self: Weak<Engine>,
    sockets: Vec<UdpSocket>,
    poller: Arc<Poller>,
    pub qps: QpTable<UdpQp>,
    counters: Counters,
}

/// System-call counters of a context (relaxed atomics: statistics only).
#[derive(Default)]
struct Counters {
    tx_calls: AtomicU64,
    tx_datagrams: AtomicU64,
    tx_dropped: AtomicU64,
    rx_calls: AtomicU64,
    rx_datagrams: AtomicU64,
}

/// What a `udp0` context's sockets did: system calls and datagrams, both directions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SocketStats {
    /// `sendmmsg` calls (plus single sends of CLOSE datagrams).
    pub tx_calls: u64,
    /// Datagrams the kernel accepted.
    pub tx_datagrams: u64,
    /// Datagrams dropped on a send error (mpath resends them).
    pub tx_dropped: u64,
    /// `recvmmsg` calls that returned data.
    pub rx_calls: u64,
    /// Datagrams received (GRO receives counted per datagram).
    pub rx_datagrams: u64,
}

fn io_err(what: &'static str) -> impl FnOnce(std::io::Error) -> VerbsError {
    move |e| VerbsError::io(what, e)
}

fn open_socket(addr: SocketAddr, gro: bool) -> Result<UdpSocket> {
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
    if gro {
        sys::enable_gro(&s).map_err(|e| VerbsError::io("udp0: set UDP_GRO", e))?;
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
            sockets.push(open_socket(addr, opts.gro)?);
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
        // epoll's own timeout has millisecond resolution, too coarse for mpath's pacing and
        // burst timers: the thread sleeps on a timerfd.
        let poller = Poller::new(DEVICE, SleepTimer::Timerfd)?;
        for (k, s) in sockets.iter().enumerate() {
            poller
                .add(s, k as u64, epoll::EventFlags::IN)
                .map_err(|e| VerbsError::io("udp0: epoll add", e))?;
        }
        let first_qpn = (rand::random::<u32>() & 0x00ff_ffff).max(1);
        let engine = Arc::new_cyclic(|weak| Engine {
            device,
            opts,
            local_addr,
            ports,
            weak_self: weak.clone(),
            sockets,
            poller: poller.clone(),
            qps: QpTable::new(first_qpn),
            counters: Counters::default(),
        });
        let slot_len = if engine.opts.gro {
            MAX_DATAGRAM
        } else {
            // The largest datagram a peer with the same MSS sends, with room to spare.
            (usize::from(engine.opts.mpath.mss) + 512).clamp(2048, MAX_DATAGRAM)
        };
        let mut rx = RecvBatch::new(slot_len);
        let mut ready: Vec<usize> = Vec::new();
        let mut wakeups = 0usize;
        let mut touched: Vec<Arc<UdpQp>> = Vec::new();
        poller::spawn_progress_thread(
            format!("fabriq-udp0-{}", local_addr.port()),
            Arc::downgrade(&engine),
            poller,
            |engine: &Engine, now| engine.qps.next_timeout(now, MAX_SLEEP),
            move |engine: &Engine, events| {
                ready.extend(events.iter().map(|ev| ev.data.u64() as usize));
                wakeups = wakeups.wrapping_add(1);
                engine.drain(&mut ready, wakeups, &mut rx, &mut touched);
                let now = Instant::now();
                for qp in touched.drain(..) {
                    qp.pump_now(now);
                }
                engine.qps.run_timers(now);
            },
        )?;
        Ok(engine)
    }

    /// The mpath clock: nanoseconds since this context's poller started.
    pub fn mpath_now(&self, now: Instant) -> fabriq_mpath::Instant {
        fabriq_mpath::Instant::from_nanos(self.poller.nanos(now))
    }

    /// The std instant of an mpath deadline.
    pub fn std_instant(&self, t: fabriq_mpath::Instant) -> Instant {
        self.poller.epoch() + Duration::from_nanos(t.as_nanos())
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
                    self.counters.tx_dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Ok(_) => {
                    self.counters.tx_calls.fetch_add(1, Ordering::Relaxed);
                    self.counters.tx_datagrams.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
    }

    /// Send and empty `batch`: per socket, in the order produced, with as few `sendmmsg` calls
    /// as the batch allows (GSO messages where the device options ask for them).
    pub fn send_batch(&self, batch: &mut TxBatch) {
        if batch.is_empty() {
            return;
        }
        let n = self.sockets.len().max(1);
        let gso = self.opts.gso_segments;
        // Sockets go in the order the pump first used them, not by index: a fixed order would
        // make the peer find some virtual paths' datagrams first after every batch, and ACK
        // clocking would hand those paths the window first, every time.
        batch.for_each_socket(|sock_index, buf, run| {
            let Some(sock) = self.sockets.get(usize::from(sock_index) % n) else {
                return;
            };
            let out = sys::send_batch(sock, buf, run, gso);
            let c = &self.counters;
            c.tx_calls.fetch_add(out.calls, Ordering::Relaxed);
            c.tx_datagrams.fetch_add(out.sent, Ordering::Relaxed);
            c.tx_dropped.fetch_add(out.dropped, Ordering::Relaxed);
        });
        batch.clear();
    }

    /// The socket counters so far.
    pub fn socket_stats(&self) -> SocketStats {
        let c = &self.counters;
        SocketStats {
            tx_calls: c.tx_calls.load(Ordering::Relaxed),
            tx_datagrams: c.tx_datagrams.load(Ordering::Relaxed),
            tx_dropped: c.tx_dropped.load(Ordering::Relaxed),
            rx_calls: c.rx_calls.load(Ordering::Relaxed),
            rx_datagrams: c.rx_datagrams.load(Ordering::Relaxed),
        }
    }

    /// Make sure the progress thread wakes by `deadline`.
    pub fn note_deadline(&self, deadline: Option<Instant>) {
        self.poller.note_deadline(deadline);
    }

    /// Read what the ready sockets hold and hand each datagram to its QP. The sockets take
    /// turns, one `recvmmsg` each, starting from a different one every wake-up: datagrams that
    /// arrived together on different virtual paths reach mpath interleaved, as they arrived,
    /// rather than one path's after another's in a fixed order.
    fn drain(
        &self,
        ready: &mut Vec<usize>,
        start: usize,
        rx: &mut RecvBatch,
        touched: &mut Vec<Arc<UdpQp>>,
    ) {
        if ready.is_empty() {
            return;
        }
        let len = ready.len();
        ready.rotate_left(start % len);
        let mut last: Option<Arc<UdpQp>> = None;
        for _ in 0..RECV_CALLS {
            ready.retain(|&k| self.recv_once(k, rx, &mut last, touched) == sys::BATCH);
            if ready.is_empty() {
                break;
            }
        }
        ready.clear();
    }

    /// One `recvmmsg` on socket `k`, each datagram handed to its QP; returns how many the call
    /// returned (0: nothing queued or an error).
    fn recv_once(
        &self,
        k: usize,
        rx: &mut RecvBatch,
        last: &mut Option<Arc<UdpQp>>,
        touched: &mut Vec<Arc<UdpQp>>,
    ) -> usize {
        let Some(sock) = self.sockets.get(k) else {
            return 0;
        };
        let n = match rx.recv(sock) {
            Ok(n) => n,
            Err(e) => {
                // ICMP errors (port unreachable) surface here; the peer's mpath timeout
                // decides whether it is gone.
                tracing::trace!(%e, "udp0: receive error");
                return 0;
            }
        };
        if n == 0 {
            return 0;
        }
        self.counters.rx_calls.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let mut datagrams = 0u64;
        for got in &rx.got {
            let Some(bytes) = rx.bytes(got) else {
                continue;
            };
            // A GRO receive holds several datagrams of one sender, each `segment` long.
            let step = if got.segment == 0 {
                bytes.len().max(1)
            } else {
                got.segment
            };
            for dgram in bytes.chunks(step) {
                datagrams += 1;
                self.deliver(now, dgram, got.from, got.ce, last, touched);
            }
        }
        self.counters
            .rx_datagrams
            .fetch_add(datagrams, Ordering::Relaxed);
        n
    }

    /// Hand one datagram to the QP its header names.
    fn deliver(
        &self,
        now: Instant,
        dgram: &[u8],
        from: SocketAddr,
        ce: bool,
        last: &mut Option<Arc<UdpQp>>,
        touched: &mut Vec<Arc<UdpQp>>,
    ) {
        let Some((h, body)) = Header::decode(dgram) else {
            tracing::debug!(%from, "udp0: foreign datagram dropped");
            return;
        };
        let qp = match last.as_ref() {
            Some(q) if q.qp_num_raw() == h.dst_qpn => q.clone(),
            _ => match self.qps.get(h.dst_qpn) {
                Some(q) => q,
                None => {
                    tracing::debug!(qpn = h.dst_qpn, "udp0: datagram for an unknown QP");
                    return;
                }
            },
        };
        match h.kind {
            Kind::Mpath => {
                if qp.handle_datagram(now, &h, from, ce, body)
                    && !touched.iter().any(|t| Arc::ptr_eq(t, &qp))
                {
                    touched.push(qp.clone());
                }
            }
            Kind::Close => qp.handle_close(&h, from),
        }
        *last = Some(qp);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.poller.stop();
    }
}
