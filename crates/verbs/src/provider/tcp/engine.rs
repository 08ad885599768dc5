//! The progress engine of one `tcp0` context: the listener, the epoll set, the progress thread,
//! the QP table, and connections that have not yet said which QP they are for.
//!
//! Owns the fds and the thread; QPs own their connections once attached. The thread holds only
//! a `Weak` to the engine (plus the fds it waits on), so dropping the last handle of a context
//! stops it.

use std::collections::HashMap;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::event::epoll;

use super::qp::{Lock, TcpQp};
use super::Options;
use crate::soft::cq::ProgressHook;
use crate::soft::qp_table::QpTable;
use crate::soft::wire::{self, Frame};
use crate::{DeviceInfo, Result, VerbsError};

/// Who drives progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// The context's progress thread alone (epoll); polling a CQ costs one atomic load when
    /// it is empty.
    Thread,
    /// Polling a CQ also reads the context's sockets and runs due timers, so a spinning poller
    /// sees completions without a thread wake-up. The thread remains as a fallback.
    Busy,
}

const TOKEN_WAKE: u64 = 0;
const TOKEN_LISTENER: u64 = 1;
const TOKEN_PENDING: u64 = 1 << 62;
const TOKEN_QP: u64 = 1 << 61;
/// Longest the thread sleeps without looking at timers.
const MAX_SLEEP: Duration = Duration::from_secs(1);
/// Busy mode: a poller that drove progress this recently is active, and the thread leaves
/// the sockets to it (re-checking at this period).
pub(crate) const BUSY_GRACE: Duration = Duration::from_millis(1);
/// Accepted connections that have not sent their HELLO yet, at most.
const MAX_PENDING: usize = 1024;
/// An accepted connection must send its HELLO within this time.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
const HELLO_LEN: usize = wire::HEADER_LEN + 8;

/// The fds the progress thread waits on; shared with the engine.
struct Poller {
    epoll: OwnedFd,
    wake: OwnedFd,
    stop: AtomicBool,
    /// Microseconds since `epoch` until which the thread sleeps.
    sleep_until_us: AtomicU64,
    epoch: Instant,
}

impl Poller {
    fn wake(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }
}

struct PendingConn {
    accepted_at: Instant,
    stream: TcpStream,
    buf: [u8; HELLO_LEN],
    got: usize,
}

/// The context of device `tcp0` (it is the provider's `ContextOps`).
pub(crate) struct Engine {
    pub device: DeviceInfo,
    pub mode: ProgressMode,
    pub local_addr: SocketAddr,
    pub opts: Options,
    pub weak_self: Weak<Engine>,
    listener: TcpListener,
    poller: Arc<Poller>,
    qps: QpTable<TcpQp>,
    pending: Mutex<HashMap<u64, PendingConn>>,
    next_pending: AtomicU64,
    /// Busy mode: microseconds since the poller epoch of the last `drive` (0: never).
    last_drive_us: AtomicU64,
    /// Busy mode: QPs whose readiness the thread left to an active poller; their one-shot
    /// registrations are re-armed when the poller goes quiet.
    deferred: Mutex<Vec<u32>>,
}

impl Engine {
    /// Bind the listener and start the progress thread.
    pub fn start(device: DeviceInfo, opts: Options) -> Result<Arc<Engine>> {
        let listener = TcpListener::bind(opts.bind)
            .map_err(|e| VerbsError::io(format!("tcp0: bind {}", opts.bind), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| VerbsError::io("tcp0: listener non-blocking", e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| VerbsError::io("tcp0: listener address", e))?;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC)
            .map_err(|e| VerbsError::io("tcp0: epoll_create", e))?;
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )
        .map_err(|e| VerbsError::io("tcp0: eventfd", e))?;
        epoll::add(
            &ep,
            &wake,
            epoll::EventData::new_u64(TOKEN_WAKE),
            epoll::EventFlags::IN,
        )
        .map_err(|e| VerbsError::io("tcp0: epoll add", e))?;
        epoll::add(
            &ep,
            &listener,
            epoll::EventData::new_u64(TOKEN_LISTENER),
            epoll::EventFlags::IN,
        )
        .map_err(|e| VerbsError::io("tcp0: epoll add", e))?;
        let poller = Arc::new(Poller {
            epoll: ep,
            wake,
            stop: AtomicBool::new(false),
            sleep_until_us: AtomicU64::new(0),
            epoch: Instant::now(),
        });
        let first_qpn = (rand::random::<u32>() & 0x00ff_ffff).max(1);
        let engine = Arc::new_cyclic(|weak| Engine {
            device,
            mode: opts.mode,
            local_addr,
            opts,
            weak_self: weak.clone(),
            listener,
            poller: poller.clone(),
            qps: QpTable::new(first_qpn),
            pending: Mutex::new(HashMap::new()),
            next_pending: AtomicU64::new(0),
            last_drive_us: AtomicU64::new(0),
            deferred: Mutex::new(Vec::new()),
        });
        let weak = Arc::downgrade(&engine);
        std::thread::Builder::new()
            .name(format!("fabriq-tcp0-{}", local_addr.port()))
            .spawn(move || progress_thread(weak, poller))
            .map_err(|e| VerbsError::io("tcp0: spawn progress thread", e))?;
        Ok(engine)
    }

    pub fn self_arc(&self) -> Result<Arc<Engine>> {
        self.weak_self
            .upgrade()
            .ok_or_else(|| VerbsError::InvalidArgument("tcp0 context is closing".into()))
    }

    /// A fresh QP number (24 bits, never 0, unique in this context).
    pub fn alloc_qpn(&self) -> u32 {
        self.qps.alloc_qpn()
    }

    pub fn add_qp(&self, qpn: u32, qp: &Arc<TcpQp>) {
        self.qps.insert(qpn, qp);
    }

    pub fn remove_qp(&self, qpn: u32) {
        self.qps.remove(qpn);
    }

    fn qp(&self, qpn: u32) -> Option<Arc<TcpQp>> {
        self.qps.get(qpn)
    }

    fn all_qps(&self) -> Vec<Arc<TcpQp>> {
        self.qps.all()
    }

    fn conn_flags(&self, out: bool) -> epoll::EventFlags {
        let mut flags = epoll::EventFlags::IN | epoll::EventFlags::RDHUP;
        if out {
            flags |= epoll::EventFlags::OUT;
        }
        if self.mode == ProgressMode::Busy {
            // One event per arming: the thread re-arms only when it handled the socket
            // itself, so it does not wake for every message a busy poller consumes.
            flags |= epoll::EventFlags::ONESHOT;
        }
        flags
    }

    /// Watch a QP's connection for input.
    pub fn register_conn(&self, qpn: u32, stream: &TcpStream) -> Result<()> {
        epoll::add(
            &self.poller.epoll,
            stream,
            epoll::EventData::new_u64(TOKEN_QP | u64::from(qpn)),
            self.conn_flags(false),
        )
        .map_err(|e| VerbsError::io("tcp0: epoll add connection", e))
    }

    /// (Re-)arm a QP's connection, watching for output room too when `out` (a write would
    /// block).
    pub fn set_out_interest(&self, qpn: u32, stream: &TcpStream, out: bool) {
        if let Err(e) = epoll::modify(
            &self.poller.epoll,
            stream,
            epoll::EventData::new_u64(TOKEN_QP | u64::from(qpn)),
            self.conn_flags(out),
        ) {
            tracing::warn!(qp = qpn, %e, "epoll modify failed");
        }
    }

    fn now_us(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.poller.epoch).as_micros() as u64
    }

    fn poller_active(&self, now: Instant) -> bool {
        let last = self.last_drive_us.load(Ordering::Relaxed);
        last != 0 && self.now_us(now).saturating_sub(last) < BUSY_GRACE.as_micros() as u64
    }

    /// Busy mode, thread side: once no poller runs, send held ACKs and take deferred sockets
    /// back. Returns true while a poller is active (the thread then re-checks every
    /// [`BUSY_GRACE`]).
    fn resume_deferred(&self, now: Instant) -> bool {
        if self.mode != ProgressMode::Busy {
            return false;
        }
        if self.poller_active(now) {
            return true;
        }
        for qp in self.all_qps() {
            qp.flush_held_ack(now, true);
        }
        let qpns = std::mem::take(&mut *self.deferred.lock());
        for qpn in qpns {
            if let Some(qp) = self.qp(qpn) {
                qp.rearm();
                qp.drive_rx(Lock::Wait);
            }
        }
        false
    }

    /// Make sure the thread wakes by `deadline`.
    pub fn note_deadline(&self, deadline: Option<Instant>) {
        let Some(d) = deadline else { return };
        let us = d.saturating_duration_since(self.poller.epoch).as_micros() as u64;
        if us < self.poller.sleep_until_us.load(Ordering::Acquire) {
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

    fn prune_pending(&self, now: Instant) {
        let mut pending = self.pending.lock();
        if pending.is_empty() {
            return;
        }
        pending.retain(|_, p| {
            let keep = now.saturating_duration_since(p.accepted_at) < HELLO_TIMEOUT;
            if !keep {
                tracing::warn!(peer = ?p.stream.peer_addr().ok(), "tcp0: no HELLO in time; closed");
                let _ = epoll::delete(&self.poller.epoll, &p.stream);
            }
            keep
        });
    }

    fn run_timers(&self, now: Instant) {
        self.prune_pending(now);
        for qp in self.all_qps() {
            if qp.poll_timeout().is_some_and(|t| t <= now) {
                qp.on_timer(now);
            }
        }
    }

    fn handle_event(&self, token: u64, flags: epoll::EventFlags) {
        match token {
            TOKEN_WAKE => {
                let mut buf = [0u8; 8];
                let _ = rustix::io::read(&self.poller.wake, &mut buf);
            }
            TOKEN_LISTENER => self.accept_all(),
            t if t & TOKEN_PENDING != 0 => self.read_hello(t),
            t if t & TOKEN_QP != 0 => {
                let qpn = (t & 0xffff_ffff) as u32;
                if let Some(qp) = self.qp(qpn) {
                    if flags.contains(epoll::EventFlags::OUT) {
                        qp.flush_out();
                    }
                    if self.mode == ProgressMode::Busy && self.poller_active(Instant::now()) {
                        // The poller reads this socket; look again when it goes quiet.
                        self.deferred.lock().push(qpn);
                        return;
                    }
                    if flags.intersects(
                        epoll::EventFlags::IN
                            | epoll::EventFlags::RDHUP
                            | epoll::EventFlags::HUP
                            | epoll::EventFlags::ERR,
                    ) {
                        qp.drive_rx(Lock::Wait);
                    }
                    if self.mode == ProgressMode::Busy {
                        qp.rearm();
                    }
                }
            }
            _ => {}
        }
    }

    fn accept_all(&self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    let mut pending = self.pending.lock();
                    if pending.len() >= MAX_PENDING {
                        tracing::warn!(%peer, "tcp0: too many connections without HELLO; refused");
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let id = self.next_pending.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff;
                    if let Err(e) = epoll::add(
                        &self.poller.epoll,
                        &stream,
                        epoll::EventData::new_u64(TOKEN_PENDING | id),
                        epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
                    ) {
                        tracing::warn!(%peer, %e, "tcp0: cannot watch accepted connection");
                        continue;
                    }
                    pending.insert(
                        id,
                        PendingConn {
                            accepted_at: Instant::now(),
                            stream,
                            buf: [0; HELLO_LEN],
                            got: 0,
                        },
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of fds or memory: the connection stays in the backlog and the
                    // listener stays readable; back off briefly instead of spinning.
                    tracing::warn!(%e, "tcp0: accept failed");
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
        }
    }

    fn read_hello(&self, token: u64) {
        let id = token & 0xffff_ffff;
        let mut pending = self.pending.lock();
        let Some(p) = pending.get_mut(&id) else {
            return;
        };
        let hello = loop {
            let Some(dst) = p.buf.get_mut(p.got..) else {
                break None;
            };
            match (&p.stream).read(dst) {
                Ok(0) => break None,
                Ok(n) => {
                    p.got += n;
                    if p.got == HELLO_LEN {
                        break Some(match wire::decode(&p.buf, 0) {
                            Ok(Some((
                                Frame::Hello {
                                    dst_qpn,
                                    src_qpn,
                                    version,
                                },
                                _,
                            ))) if version == wire::PROTOCOL_VERSION => Ok((dst_qpn, src_qpn)),
                            other => Err(format!("{other:?}")),
                        });
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break None,
            }
        };
        let Some(p) = pending.remove(&id) else { return };
        drop(pending);
        let _ = epoll::delete(&self.poller.epoll, &p.stream);
        let peer = p.stream.peer_addr().ok();
        match hello {
            Some(Ok((dst_qpn, src_qpn))) => match self.qp(dst_qpn) {
                Some(qp) => qp.accept_incoming(src_qpn, p.stream),
                None => {
                    tracing::warn!(?peer, dst_qpn, "tcp0: HELLO for an unknown QP; closed")
                }
            },
            Some(Err(what)) => {
                tracing::warn!(?peer, %what, "tcp0: bad HELLO on a new connection; closed")
            }
            None => {}
        }
    }
}

impl ProgressHook for Engine {
    fn drive(&self) {
        thread_local! {
            static SCRATCH: std::cell::RefCell<Vec<Arc<TcpQp>>> =
                const { std::cell::RefCell::new(Vec::new()) };
        }
        SCRATCH.with(|scratch| {
            let Ok(mut qps) = scratch.try_borrow_mut() else {
                return;
            };
            // Upgrade under the read lock, work without it: dropping the last handle of a QP
            // here takes the write lock.
            self.qps.extend_live(&mut qps);
            let now = Instant::now();
            self.last_drive_us
                .store(self.now_us(now).max(1), Ordering::Relaxed);
            for qp in qps.iter() {
                qp.drive_rx(Lock::Try);
                qp.flush_held_ack(now, false);
                if qp.poll_timeout().is_some_and(|t| t <= now) {
                    qp.on_timer(now);
                }
            }
            qps.clear();
        });
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.poller.stop.store(true, Ordering::Release);
        self.poller.wake();
    }
}

fn progress_thread(engine: Weak<Engine>, poller: Arc<Poller>) {
    let mut events: Vec<epoll::Event> = Vec::with_capacity(256);
    loop {
        if poller.stop.load(Ordering::Acquire) {
            return;
        }
        // While the timeout is being computed, a new deadline must wake us (see note_deadline).
        poller.sleep_until_us.store(u64::MAX, Ordering::Release);
        let timeout = {
            let Some(engine) = engine.upgrade() else {
                return;
            };
            let now = Instant::now();
            let t = engine.next_timeout(now);
            if engine.resume_deferred(now) {
                t.min(BUSY_GRACE)
            } else {
                t
            }
        };
        let until = Instant::now() + timeout;
        poller.sleep_until_us.store(
            until.saturating_duration_since(poller.epoch).as_micros() as u64,
            Ordering::Release,
        );
        let ts = rustix::event::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        events.clear();
        match epoll::wait(
            &poller.epoll,
            rustix::buffer::spare_capacity(&mut events),
            Some(&ts),
        ) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                tracing::warn!(%e, "tcp0: epoll_wait failed; progress thread stops");
                return;
            }
        }
        poller.sleep_until_us.store(0, Ordering::Release);
        if poller.stop.load(Ordering::Acquire) {
            return;
        }
        let Some(engine) = engine.upgrade() else {
            return;
        };
        for ev in &events {
            engine.handle_event(ev.data.u64(), ev.flags);
        }
        engine.run_timers(Instant::now());
    }
}
