//! The `udp0` context: the virtual-path sockets, the epoll set and the progress thread.
//!
//! Owns: one UDP socket per virtual path (socket `k` is VP `k`'s source port), the QP table
//! (`qpn → Weak<UdpQp>`), the clock edge (std `Instant` ↔ `fabriq_mpath::Instant`) and what the
//! progress thread does when it wakes: read datagrams, pump the QPs they touched, run the QPs'
//! timers once the earliest deadline a pump announced is due (a wake-up costs nothing per idle
//! QP). The epoll set, wake-ups, the timerfd and the thread's loop are [`crate::soft::poller`]'s.
//! Does not own any protocol decision: datagrams go to the QP named in their header
//! ([`super::wire`]), which feeds its mpath connection.
//!
//! System calls are batched ([`super::sys`]): a QP's pump hands over every datagram it produced
//! at once, sent per socket with `sendmmsg` (optionally as UDP GSO messages), and the thread reads
//! each ready socket with `recvmmsg` (optionally with UDP GRO).
//!
//! With `progress = "busy"` the sockets sit in an epoll set of their own, which the thread's set
//! watches as one one-shot fd, and polling a CQ of the context reads them too (one `epoll_wait`
//! with a zero timeout, then the ready sockets) and runs due timers: a spinning poller sees a
//! completion without waiting for the thread to be scheduled. While a poller polls
//! ([`BusyGrace`]) the thread leaves the sockets to it and is not woken per datagram; it takes
//! them back once the poller stops polling or arms its CQ to sleep. Reading is serialised (the
//! thread and the pollers take turns on one receive state), so datagrams are handed to their QPs
//! by one reader at a time.

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::event::epoll;

use super::qp::UdpQp;
use super::sys::{self, RecvBatch, TxBatch};
use super::wire::{Header, Kind};
use super::{Options, DEVICE};
use crate::soft::cq::ProgressHook;
use crate::soft::poller::{self, BusyGrace, Poller, ProgressMode, SleepTimer, BUSY_GRACE};
use crate::soft::qp_table::{Deadline, QpTable};
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
/// Busy mode: the token of the sockets' own epoll set in the thread's set (socket tokens are
/// path indices, below 1024; the poller reserves `u64::MAX` and `u64::MAX - 1`).
const TOKEN_SOCKETS: u64 = u64::MAX - 2;

/// What reading the sockets needs, owned by whoever reads (the thread or a busy poller).
struct RxState {
    rx: RecvBatch,
    /// Sockets found ready, by path index.
    ready: Vec<usize>,
    /// QPs fed by the datagrams read, to pump once the batch is read.
    touched: Vec<Arc<UdpQp>>,
    /// Reads so far: the socket read first turns with it.
    rounds: usize,
}

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
    /// Busy mode: the sockets' own epoll set (watched by the thread's set under
    /// [`TOKEN_SOCKETS`], one-shot; read by CQ pollers).
    socket_set: Option<OwnedFd>,
    rx_state: Mutex<RxState>,
    /// Busy mode: when a CQ poller last drove the context.
    grace: BusyGrace,
    /// The earliest QP deadline announced since the QPs' timers were last looked at (on the
    /// poller's clock): the thread sleeps until it, and the thread and busy pollers look at
    /// the QPs' timers only once it is due.
    timer_deadline: Deadline,
    /// QPs looked at by timer rounds (statistics and tests).
    pub timer_looks: AtomicU64,
    /// Busy mode: some QP's messages wait for ACKs ([`Engine::sender_blocked`]).
    blocked: AtomicBool,
    /// Busy mode: the thread left the sockets to an active poller (its one-shot registration
    /// of the socket set is not re-armed until the poller goes quiet).
    deferred: AtomicBool,
}

/// System-call counters of a context (relaxed atomics: statistics only).
#[derive(Default)]
struct Counters {
    tx_calls: AtomicU64,
    tx_datagrams: AtomicU64,
    tx_dropped: AtomicU64,
    rx_calls: AtomicU64,
    rx_datagrams: AtomicU64,
    rx_polled: AtomicU64,
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
    /// Of those, datagrams a CQ poller read (`progress = "busy"`) rather than the thread.
    pub rx_polled: u64,
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
        let epoll_err = |e| VerbsError::io("udp0: epoll add", e);
        let socket_set = match opts.progress {
            ProgressMode::Thread => {
                for (k, s) in sockets.iter().enumerate() {
                    poller
                        .add(s, k as u64, epoll::EventFlags::IN)
                        .map_err(epoll_err)?;
                }
                None
            }
            ProgressMode::Busy => {
                let set = epoll::create(epoll::CreateFlags::CLOEXEC)
                    .map_err(|e| VerbsError::io("udp0: epoll_create", e))?;
                for (k, s) in sockets.iter().enumerate() {
                    epoll::add(
                        &set,
                        s,
                        epoll::EventData::new_u64(k as u64),
                        epoll::EventFlags::IN,
                    )
                    .map_err(epoll_err)?;
                }
                poller
                    .add(&set, TOKEN_SOCKETS, Self::SOCKET_SET_FLAGS)
                    .map_err(epoll_err)?;
                Some(set)
            }
        };
        let slot_len = if opts.gro {
            MAX_DATAGRAM
        } else {
            // The largest datagram a peer with the same MSS sends, with room to spare.
            (usize::from(opts.mpath.mss) + 512).clamp(2048, MAX_DATAGRAM)
        };
        let first_qpn = (rand::random::<u32>() & 0x00ff_ffff).max(1);
        let engine = Arc::new_cyclic(|weak| Engine {
            device,
            opts,
            local_addr,
            ports,
            weak_self: weak.clone(),
            sockets,
            grace: BusyGrace::new(poller.epoch()),
            poller: poller.clone(),
            qps: QpTable::new(first_qpn),
            counters: Counters::default(),
            socket_set,
            rx_state: Mutex::new(RxState {
                rx: RecvBatch::new(slot_len),
                ready: Vec::new(),
                touched: Vec::new(),
                rounds: 0,
            }),
            deferred: AtomicBool::new(false),
            blocked: AtomicBool::new(false),
            timer_deadline: Deadline::default(),
            timer_looks: AtomicU64::new(0),
        });
        poller::spawn_progress_thread(
            format!("fabriq-udp0-{}", local_addr.port()),
            Arc::downgrade(&engine),
            poller,
            |engine: &Engine, now| {
                // Timers are the thread's too while a poller polls: it may poll another queue
                // for a while (a pacing or burst timer must not wait for its next poll).
                let t = engine.next_timeout(now);
                if engine.resume_deferred(now) {
                    t.min(BUSY_GRACE)
                } else {
                    t
                }
            },
            |engine: &Engine, events| engine.thread_round(events),
        )?;
        Ok(engine)
    }

    /// Busy mode: how the thread's set watches the sockets' set.
    const SOCKET_SET_FLAGS: epoll::EventFlags =
        epoll::EventFlags::IN.union(epoll::EventFlags::ONESHOT);

    /// What the progress thread does when it wakes: read the ready sockets (in busy mode, unless
    /// a poller reads them now), pump the QPs they fed, run due timers.
    fn thread_round(&self, events: &[epoll::Event]) {
        let mut ready = false;
        let mut set_ready = false;
        for ev in events {
            match ev.data.u64() {
                TOKEN_SOCKETS => set_ready = true,
                _ => ready = true,
            }
        }
        let poller_active =
            self.opts.progress == ProgressMode::Busy && self.grace.active(Instant::now());
        if set_ready && poller_active && !self.blocked.load(Ordering::Relaxed) {
            // The poller reads them; look again when it goes quiet. (The receive state is not
            // even looked at: the poller holds it most of the time.)
            self.deferred.store(true, Ordering::Relaxed);
            set_ready = false;
        }
        if ready || set_ready {
            // Cleared before reading: a pump that still finds its messages waiting sets it
            // again.
            self.blocked.store(false, Ordering::Relaxed);
            let mut st = self.rx_state.lock();
            st.ready.extend(
                events
                    .iter()
                    .map(|ev| ev.data.u64())
                    .filter(|&k| k != TOKEN_SOCKETS)
                    .map(|k| k as usize),
            );
            if set_ready {
                self.collect_ready(&mut st);
            }
            self.read_ready(&mut st, false);
        }
        self.run_due_timers(Instant::now());
        if set_ready {
            self.arm_socket_set();
        }
    }

    /// Busy mode: the thread watches the sockets' set again (level-triggered inside, so what is
    /// still unread fires at once).
    fn arm_socket_set(&self) {
        if let Some(set) = &self.socket_set {
            if let Err(e) = self
                .poller
                .modify(set, TOKEN_SOCKETS, Self::SOCKET_SET_FLAGS)
            {
                tracing::warn!(%e, "udp0: epoll modify failed");
            }
        }
    }

    /// Busy mode, thread side: once no poller polls, take the sockets back. True while a
    /// poller is active (the thread then re-checks every [`BUSY_GRACE`]).
    fn resume_deferred(&self, now: Instant) -> bool {
        if self.opts.progress != ProgressMode::Busy {
            return false;
        }
        if self.grace.active(now) && !self.blocked.load(Ordering::Relaxed) {
            return true;
        }
        if self.deferred.swap(false, Ordering::Relaxed) {
            self.arm_socket_set();
        }
        false
    }

    /// Busy mode: a QP's messages wait for ACKs (its window is closed). The thread reads the
    /// sockets then even while a poller polls: the poller may be polling another queue, and
    /// the ACKs must not wait for its return.
    pub fn sender_blocked(&self) {
        if self.opts.progress == ProgressMode::Busy
            && !self.blocked.swap(true, Ordering::Relaxed)
            && self.deferred.load(Ordering::Relaxed)
        {
            self.poller.wake();
        }
    }

    /// Busy mode: add the sockets the sockets' set finds ready (without waiting) to `ready`.
    fn collect_ready(&self, st: &mut RxState) {
        let Some(set) = &self.socket_set else {
            return;
        };
        let zero = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut events = [const { MaybeUninit::<epoll::Event>::uninit() }; 64];
        match epoll::wait(set, &mut events, Some(&zero)) {
            Ok((ready, _)) => st
                .ready
                .extend(ready.iter().map(|ev| ev.data.u64() as usize)),
            Err(e) => tracing::trace!(%e, "udp0: epoll_wait on the sockets failed"),
        }
    }

    /// Read the sockets in `st.ready` and pump the QPs their datagrams fed.
    fn read_ready(&self, st: &mut RxState, polled: bool) {
        if st.ready.is_empty() {
            return;
        }
        st.rounds = st.rounds.wrapping_add(1);
        let RxState {
            rx,
            ready,
            touched,
            rounds,
            ..
        } = st;
        let datagrams = self.drain(ready, *rounds, rx, touched);
        if polled {
            self.counters
                .rx_polled
                .fetch_add(datagrams, Ordering::Relaxed);
        }
        let now = Instant::now();
        for qp in touched.drain(..) {
            qp.pump_now(now);
        }
    }

    /// Busy mode, poller side: read what the sockets hold and run due timers, if no one else
    /// reads now. `stays`: the poller keeps polling, so the thread leaves the sockets to it.
    fn drive_pass(&self, stays: bool) {
        let now = Instant::now();
        if stays {
            self.grace.note(now);
        }
        let Some(mut st) = self.rx_state.try_lock() else {
            return;
        };
        self.collect_ready(&mut st);
        self.read_ready(&mut st, true);
        drop(st);
        self.run_due_timers(now);
    }

    /// How long the thread may sleep: until the earliest announced QP deadline, at most
    /// [`MAX_SLEEP`].
    fn next_timeout(&self, now: Instant) -> Duration {
        let due = self.timer_deadline.get();
        Duration::from_nanos(due.saturating_sub(self.poller.nanos(now))).min(MAX_SLEEP)
    }

    /// Run the QP timers that are due, if the earliest announced deadline is
    /// ([`QpTable::run_due_timers`]: O(1) until then, however many QPs the context has).
    fn run_due_timers(&self, now: Instant) {
        let nanos = |t| self.poller.nanos(t);
        self.qps.run_due_timers(
            now,
            nanos(now),
            &self.timer_deadline,
            nanos,
            &self.timer_looks,
        );
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
            rx_polled: c.rx_polled.load(Ordering::Relaxed),
        }
    }

    /// A QP's timers may fire at `deadline`: the thread wakes by then, and it or a busy
    /// poller looks at the QPs' timers then. Every path that may bring a QP's deadline forward
    /// ends in a pump, which announces it here.
    pub fn note_deadline(&self, deadline: Option<Instant>) {
        let Some(d) = deadline else { return };
        self.timer_deadline.announce(self.poller.nanos(d));
        self.poller.note_deadline(Some(d));
    }

    /// Read what the ready sockets hold and hand each datagram to its QP. The sockets take
    /// turns, one `recvmmsg` each, starting from a different one every wake-up: datagrams that
    /// arrived together on different virtual paths reach mpath interleaved, as they arrived,
    /// rather than one path's after another's in a fixed order.
    /// Returns the number of datagrams handed over.
    fn drain(
        &self,
        ready: &mut Vec<usize>,
        start: usize,
        rx: &mut RecvBatch,
        touched: &mut Vec<Arc<UdpQp>>,
    ) -> u64 {
        if ready.is_empty() {
            return 0;
        }
        let len = ready.len();
        ready.rotate_left(start % len);
        let mut last: Option<Arc<UdpQp>> = None;
        let mut datagrams = 0u64;
        for _ in 0..RECV_CALLS {
            ready.retain(|&k| {
                let (calls, n) = self.recv_once(k, rx, &mut last, touched);
                datagrams += n;
                calls == sys::BATCH
            });
            if ready.is_empty() {
                break;
            }
        }
        ready.clear();
        datagrams
    }

    /// One `recvmmsg` on socket `k`, each datagram handed to its QP; returns how many receives
    /// the call returned (0: nothing queued or an error) and how many datagrams they held.
    fn recv_once(
        &self,
        k: usize,
        rx: &mut RecvBatch,
        last: &mut Option<Arc<UdpQp>>,
        touched: &mut Vec<Arc<UdpQp>>,
    ) -> (usize, u64) {
        let Some(sock) = self.sockets.get(k) else {
            return (0, 0);
        };
        let n = match rx.recv(sock) {
            Ok(n) => n,
            Err(e) => {
                // ICMP errors (port unreachable) surface here; the peer's mpath timeout
                // decides whether it is gone.
                tracing::trace!(%e, "udp0: receive error");
                return (0, 0);
            }
        };
        if n == 0 {
            return (0, 0);
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
        (n, datagrams)
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

impl ProgressHook for Engine {
    fn drive(&self, stays: bool) {
        self.drive_pass(stays);
    }

    /// The poller goes to sleep on the CQ's event: its grace ends now, and the thread is woken
    /// if it left the sockets to it, so that it takes them back at once.
    fn poller_leaving(&self) {
        if self.opts.progress == ProgressMode::Busy
            && self.grace.end()
            && self.deferred.load(Ordering::Relaxed)
        {
            self.poller.wake();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.poller.stop();
    }
}
