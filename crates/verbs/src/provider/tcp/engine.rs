//! The progress engine of one `tcp0` context: the listener, the QP table, the connections no QP
//! owns (accepted ones that have not yet said which QP they are for, used ones kept for reuse:
//! [`super::held`]), and what the progress thread does with a ready fd.
//!
//! QPs own their connections once attached; a connection changes hands (engine → QP → engine)
//! by an `epoll_ctl` MOD of its token (it leaves the epoll set only while it waits, unread, for
//! its QP's RTR); a clean kept connection is watched only for the peer closing (see
//! [`super::held`]), and the QP that takes it at RTR reads it. The epoll set, wake-ups and the
//! thread's loop are [`crate::soft::poller`]'s; the thread holds only a `Weak` to the engine, so
//! dropping the last handle of a context stops it.
//!
//! Data connections (a QP's and held ones) are watched level-triggered in one set: the thread's
//! own in thread progress mode; in busy mode a set of their own, which the thread's set watches
//! one-shot and a busy CQ poll asks with one zero-timeout `epoll_wait`, so that a poll reads
//! only the sockets that have something, however many connections the context serves.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::event::epoll;

use super::data_conn::DataConn;
use super::held::{Held, Owner, Step, ACCEPTED_REUSE, HELLO_TIMEOUT};
use super::qp::{HelloIds, Lock, TcpQp};
use super::{Options, DEVICE};
use crate::soft::cq::ProgressHook;
use crate::soft::poller::{self, BusyGrace, Poller, SleepTimer};
pub(crate) use crate::soft::poller::{ProgressMode, BUSY_GRACE};
use crate::soft::qp_table::{Deadline, QpTable};
use crate::{DeviceInfo, Result, VerbsError};

const TOKEN_LISTENER: u64 = 1;
const TOKEN_PENDING: u64 = 1 << 62;
const TOKEN_QP: u64 = 1 << 61;
/// Busy mode: the token of the data connections' own epoll set in the thread's set (the poller
/// reserves `u64::MAX` and `u64::MAX - 1`).
const TOKEN_CONNS: u64 = u64::MAX - 2;
/// Ready connections taken per `epoll_wait` of the connections' set.
const READY_BATCH: usize = 64;
/// Longest the thread sleeps without looking at timers.
const MAX_SLEEP: Duration = Duration::from_secs(1);
/// Accepted connections that have not sent their HELLO yet, at most.
const MAX_PENDING: usize = 1024;
/// Used connections kept for reuse, at most (each end counts its own).
const MAX_KEPT: usize = 1024;

/// The connections no QP owns (see [`super::held`]), by token id.
#[derive(Default)]
struct HeldConns {
    by_id: HashMap<u64, Held>,
    /// The id of the connection each QP opened and keeps (one per QP: its next RTR takes it or
    /// closes it).
    opened: HashMap<u32, u64>,
    /// Accepting end: the id of the used connection each QP at the other end opened, by that
    /// QP's listener and number (the connection of its next use; one each, the latest).
    by_opener: HashMap<(SocketAddr, u32), u64>,
    /// Accepting end: the openers (listener, QP number) towards which a QP of this context
    /// reached RTR without taking their kept connection (none was kept yet — another QP of
    /// this context may still use it, or the last use's BYE is on the way), each until a
    /// deadline. Such a connection stays watched for input once kept: the HELLO the opener
    /// writes on it must reach the waiting QP.
    awaited: HashMap<(SocketAddr, u32), Instant>,
    /// How many of them are accepted connections not used yet.
    fresh: usize,
    /// No deadline comes before this one (the table is looked through only from then on).
    earliest: Option<Instant>,
}

impl HeldConns {
    /// Keep `held` under `id`; returns a connection its QP kept before, which it replaces,
    /// and the id of a connection from the same opener that it displaces from `by_opener`
    /// (kept, but no RTR looks for it any more: it must be watched for input).
    fn insert(&mut self, id: u64, held: Held) -> (Option<Held>, Option<u64>) {
        self.fresh += usize::from(held.is_fresh());
        let d = held.deadline();
        self.earliest = Some(self.earliest.map_or(d, |e| e.min(d)));
        let replaced = match held.owner {
            Owner::Opened { qpn, .. } => self.opened.insert(qpn, id),
            Owner::Accepted { .. } => None,
        };
        let displaced = held.opener().and_then(|k| self.by_opener.insert(k, id));
        self.by_id.insert(id, held);
        (replaced.and_then(|old| self.remove(old)), displaced)
    }

    fn remove(&mut self, id: u64) -> Option<Held> {
        let held = self.by_id.remove(&id)?;
        self.fresh -= usize::from(held.is_fresh());
        if let Owner::Opened { qpn, .. } = held.owner {
            if self.opened.get(&qpn) == Some(&id) {
                self.opened.remove(&qpn);
            }
        }
        if let Some(k) = held.opener() {
            if self.by_opener.get(&k) == Some(&id) {
                self.by_opener.remove(&k);
            }
        }
        Some(held)
    }

    /// Used connections kept.
    fn kept(&self) -> usize {
        self.by_id.len() - self.fresh
    }

    /// A QP reached RTR towards `opener` without its kept connection: watch that connection
    /// for input until `deadline` (see `awaited`).
    fn await_opener(&mut self, opener: (SocketAddr, u32), deadline: Instant) {
        if self.awaited.len() >= MAX_KEPT {
            // Bounded: the oldest wait gives way (it is about to expire, or served).
            if let Some(k) = self
                .awaited
                .iter()
                .min_by_key(|(_, d)| **d)
                .map(|(k, _)| *k)
            {
                self.awaited.remove(&k);
            }
        }
        self.awaited.insert(opener, deadline);
        self.earliest = Some(self.earliest.map_or(deadline, |e| e.min(deadline)));
    }
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
    pub qps: QpTable<TcpQp>,
    held: Mutex<HeldConns>,
    next_held: AtomicU64,
    /// Data connections opened to a peer's listener, and those of them that were used
    /// connections sent a new HELLO instead.
    pub conns_opened: AtomicU64,
    pub conns_reused: AtomicU64,
    /// Kept connections on which a QP found the peer's HELLO at its RTR (so wrote none).
    pub hellos_found: AtomicU64,
    /// Kept connections a QP took at RTR with no HELLO written or found: an accepting QP (it
    /// owes one until it writes), or an opening QP whose peer's endpoint named the connection.
    pub hellos_spared: AtomicU64,
    /// QP socket reads a busy CQ poll made (one per ready connection it read).
    pub polled_reads: AtomicU64,
    /// QPs whose timers the thread or a poller looked at (all of them, each time the earliest
    /// announced deadline came due).
    pub timer_looks: AtomicU64,
    /// Busy mode: the data connections' own epoll set (watched by the thread's set under
    /// [`TOKEN_CONNS`], one-shot; asked by CQ pollers). `None` in thread mode: the connections
    /// are in the thread's set.
    conn_set: Option<OwnedFd>,
    /// Busy mode: when a CQ poller last drove the context.
    grace: BusyGrace,
    /// Busy mode: the thread left the connections to an active poller (its one-shot watch of
    /// their set is re-armed when the poller goes quiet).
    deferred: AtomicBool,
    /// Busy mode: the QPs that held back an ACK for a poller's next post (some may have sent
    /// it since), and whether there are any (set and cleared under the list's lock).
    held_acks: Mutex<Vec<u32>>,
    acks_held: AtomicBool,
    /// The earliest QP deadline announced since the QPs' timers were last looked at (on the
    /// poller's clock): the thread sleeps until it, and the thread and busy pollers look at the
    /// QPs' timers only once it is due.
    timer_deadline: Deadline,
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
        let poller = Poller::new(DEVICE, SleepTimer::Epoll)?;
        poller
            .add(&listener, TOKEN_LISTENER, epoll::EventFlags::IN)
            .map_err(|e| VerbsError::io("tcp0: epoll add", e))?;
        let conn_set = match opts.mode {
            ProgressMode::Thread => None,
            ProgressMode::Busy => {
                let set = epoll::create(epoll::CreateFlags::CLOEXEC)
                    .map_err(|e| VerbsError::io("tcp0: epoll_create", e))?;
                poller
                    .add(&set, TOKEN_CONNS, Self::CONN_SET_FLAGS)
                    .map_err(|e| VerbsError::io("tcp0: epoll add", e))?;
                Some(set)
            }
        };
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
            held: Mutex::new(HeldConns::default()),
            next_held: AtomicU64::new(0),
            conns_opened: AtomicU64::new(0),
            conns_reused: AtomicU64::new(0),
            hellos_found: AtomicU64::new(0),
            hellos_spared: AtomicU64::new(0),
            polled_reads: AtomicU64::new(0),
            timer_looks: AtomicU64::new(0),
            conn_set,
            grace: BusyGrace::new(poller.epoch()),
            deferred: AtomicBool::new(false),
            held_acks: Mutex::new(Vec::new()),
            acks_held: AtomicBool::new(false),
            timer_deadline: Deadline::default(),
        });
        poller::spawn_progress_thread(
            format!("fabriq-tcp0-{}", local_addr.port()),
            Arc::downgrade(&engine),
            poller,
            |engine: &Engine, now| {
                let t = engine.next_timeout(now);
                if engine.resume_deferred(now) {
                    t.min(BUSY_GRACE)
                } else {
                    t
                }
            },
            |engine: &Engine, events| {
                for ev in events {
                    engine.handle_event(ev.data.u64(), ev.flags);
                }
                engine.run_timers(Instant::now());
            },
        )?;
        Ok(engine)
    }

    /// Busy mode: how the thread's set watches the connections' set (one event per arming:
    /// the thread re-arms it only after reading the connections itself, so it does not wake
    /// for every message a busy poller consumes).
    const CONN_SET_FLAGS: epoll::EventFlags =
        epoll::EventFlags::IN.union(epoll::EventFlags::ONESHOT);

    /// Watch a data connection under `token` (in the connections' set).
    fn watch(&self, fd: impl AsFd, token: u64, flags: epoll::EventFlags) -> rustix::io::Result<()> {
        match &self.conn_set {
            Some(set) => epoll::add(set, fd, epoll::EventData::new_u64(token), flags),
            None => self.poller.add(fd, token, flags),
        }
    }

    /// Change the token or interest of a watched data connection.
    fn rewatch(
        &self,
        fd: impl AsFd,
        token: u64,
        flags: epoll::EventFlags,
    ) -> rustix::io::Result<()> {
        match &self.conn_set {
            Some(set) => epoll::modify(set, fd, epoll::EventData::new_u64(token), flags),
            None => self.poller.modify(fd, token, flags),
        }
    }

    /// Stop watching a data connection (errors ignored: it may be closed already).
    fn stop_watching(&self, fd: impl AsFd) {
        match &self.conn_set {
            Some(set) => {
                let _ = epoll::delete(set, fd);
            }
            None => self.poller.delete(fd),
        }
    }

    /// A QP connection's interest: input and the peer closing, and output room when `out` (a
    /// write would block). Level-triggered in either set.
    fn conn_flags(out: bool) -> epoll::EventFlags {
        let flags = epoll::EventFlags::IN | epoll::EventFlags::RDHUP;
        match out {
            true => flags | epoll::EventFlags::OUT,
            false => flags,
        }
    }

    /// Watch a QP's connection for input; `watched`: the epoll set has it already (under the
    /// token it had while the engine held it).
    pub fn register_conn(&self, qpn: u32, stream: &TcpStream, watched: bool) -> Result<()> {
        let (token, flags) = (TOKEN_QP | u64::from(qpn), Self::conn_flags(false));
        if watched {
            self.rewatch(stream, token, flags)
        } else {
            self.watch(stream, token, flags)
        }
        .map_err(|e| VerbsError::io("tcp0: epoll add connection", e))
    }

    /// Stop watching a connection (it waits, unread, for its QP's RTR).
    pub fn unwatch(&self, stream: &TcpStream) {
        self.stop_watching(stream);
    }

    /// Watch a QP's connection for output room too when `out` (a write would block), or no
    /// longer.
    pub fn set_out_interest(&self, qpn: u32, stream: &TcpStream, out: bool) {
        if let Err(e) = self.rewatch(stream, TOKEN_QP | u64::from(qpn), Self::conn_flags(out)) {
            tracing::warn!(qp = qpn, %e, "epoll modify failed");
        }
    }

    pub(super) fn poller_active(&self, now: Instant) -> bool {
        self.grace.active(now)
    }

    /// Busy mode, thread side: once no poller runs, send held ACKs and take the connections
    /// back. Returns true while a poller is active (the thread then re-checks every
    /// [`BUSY_GRACE`]).
    fn resume_deferred(&self, now: Instant) -> bool {
        if self.mode != ProgressMode::Busy {
            return false;
        }
        if self.poller_active(now) {
            return true;
        }
        self.flush_held_acks(now, true);
        if self.deferred.swap(false, Ordering::Relaxed) {
            // Level-triggered inside: what is still unread fires at once.
            self.arm_conn_set();
        }
        false
    }

    /// Busy mode: the thread watches the connections' set again.
    fn arm_conn_set(&self) {
        if let Some(set) = &self.conn_set {
            if let Err(e) = self.poller.modify(set, TOKEN_CONNS, Self::CONN_SET_FLAGS) {
                tracing::warn!(%e, "tcp0: epoll modify failed");
            }
        }
    }

    /// A QP's timers may fire at `deadline`: make sure they are looked at then (by the
    /// thread, which this wakes if it sleeps longer, or a busy poller). Every change that can
    /// bring a QP's deadline forward announces it here (a QP's `transmit` does, after every
    /// post, input batch, timer and transition).
    pub fn note_deadline(&self, deadline: Option<Instant>) {
        let Some(d) = deadline else { return };
        self.timer_deadline.announce(self.poller.nanos(d));
        self.poller.note_deadline(Some(d));
    }

    /// How long the thread may sleep: until the earliest announced deadline, the held
    /// connections' next one, or [`MAX_SLEEP`].
    fn next_timeout(&self, now: Instant) -> Duration {
        let now_ns = self.poller.nanos(now);
        let qps = Duration::from_nanos(self.timer_deadline.get().saturating_sub(now_ns));
        let held = self
            .held
            .lock()
            .earliest
            .map_or(MAX_SLEEP, |e| e.saturating_duration_since(now));
        qps.min(held).min(MAX_SLEEP)
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

    /// QP `qpn` holds back an ACK (busy mode): a poller sends it with the QP's next post, or
    /// after `ACK_HOLD`; the thread by `deadline` if no poller comes back.
    pub(super) fn ack_held(&self, qpn: u32, deadline: Instant) {
        {
            let mut list = self.held_acks.lock();
            list.push(qpn);
            self.acks_held.store(true, Ordering::Relaxed);
        }
        self.poller.note_deadline(Some(deadline));
    }

    /// Send the ACKs held back that waited long enough (all of them with `force`).
    fn flush_held_acks(&self, now: Instant, force: bool) {
        thread_local! {
            static SCRATCH: std::cell::RefCell<Vec<u32>> =
                const { std::cell::RefCell::new(Vec::new()) };
        }
        if !self.acks_held.load(Ordering::Relaxed) {
            return;
        }
        SCRATCH.with(|scratch| {
            let Ok(mut mine) = scratch.try_borrow_mut() else {
                return;
            };
            // Taken out: a QP's lock is never taken under the list's (a QP adds to the list
            // under its own).
            std::mem::swap(&mut *self.held_acks.lock(), &mut *mine);
            mine.sort_unstable();
            mine.dedup();
            mine.retain(|&qpn| {
                self.qps
                    .get(qpn)
                    .is_some_and(|qp| qp.flush_held_ack(now, force))
            });
            let mut list = self.held_acks.lock();
            list.append(&mut mine);
            self.acks_held.store(!list.is_empty(), Ordering::Relaxed);
        });
    }

    pub(super) fn prune_held(&self, now: Instant) {
        let mut held = self.held.lock();
        if !held.earliest.is_some_and(|e| e <= now) {
            return;
        }
        let expired: Vec<u64> = held
            .by_id
            .iter()
            .filter(|(_, h)| h.deadline() <= now)
            .map(|(id, _)| *id)
            .collect();
        held.awaited.retain(|_, d| *d > now);
        held.earliest = held
            .by_id
            .values()
            .map(Held::deadline)
            .chain(held.awaited.values().copied())
            .filter(|&d| d > now)
            .min();
        for id in expired {
            if let Some(h) = held.remove(id) {
                if h.is_fresh() {
                    tracing::warn!(peer = ?h.stream.peer_addr().ok(), "tcp0: no HELLO in time; closed");
                }
                self.stop_watching(&*h.stream);
            }
        }
    }

    fn run_timers(&self, now: Instant) {
        self.prune_held(now);
        self.run_due_timers(now);
    }

    /// What the progress thread does with a ready fd of its set.
    fn handle_event(&self, token: u64, flags: epoll::EventFlags) {
        match token {
            TOKEN_LISTENER => self.accept_all(),
            TOKEN_CONNS => self.thread_reads_conns(),
            t => {
                self.conn_event(t, flags, Lock::Wait);
            }
        }
    }

    /// A data connection is ready: a held one is read by the engine, a QP's by its QP (`lock`:
    /// how its reader is taken; a busy poller skips a QP someone else reads, and the
    /// level-triggered set reports it again). Returns whether a QP's input was read.
    fn conn_event(&self, token: u64, flags: epoll::EventFlags, lock: Lock) -> bool {
        if token & TOKEN_PENDING != 0 {
            self.read_held(token & 0xffff_ffff);
            return false;
        }
        if token & TOKEN_QP == 0 {
            return false;
        }
        let Some(qp) = self.qps.get((token & 0xffff_ffff) as u32) else {
            return false;
        };
        if flags.contains(epoll::EventFlags::OUT) {
            qp.flush_out();
        }
        let input = flags.intersects(
            epoll::EventFlags::IN
                | epoll::EventFlags::RDHUP
                | epoll::EventFlags::HUP
                | epoll::EventFlags::ERR,
        );
        if input {
            qp.drive_rx(lock);
        }
        input
    }

    /// Busy mode, thread side: the connections' set has ready connections. Read them and
    /// watch the set again; while a poller is active, read only the held ones and leave the
    /// set to the poller (the thread looks again when it goes quiet).
    fn thread_reads_conns(&self) {
        if self.poller_active(Instant::now()) {
            // The connections no QP owns are still the thread's: a HELLO read now is a
            // connect that does not wait for the poller's next pass (or, if the poller goes
            // to sleep meanwhile, for the thread's next wake-up).
            self.read_ready_conns(Lock::Wait, false);
            self.deferred.store(true, Ordering::Relaxed);
            return;
        }
        self.read_ready_conns(Lock::Wait, true);
        self.arm_conn_set();
    }

    /// Busy mode: handle what the connections' set reports ready now (without waiting); with
    /// `qps` false, only the connections no QP owns. Returns the QP connections read.
    fn read_ready_conns(&self, lock: Lock, qps: bool) -> u64 {
        let Some(set) = &self.conn_set else {
            return 0;
        };
        let zero = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut events = [const { MaybeUninit::<epoll::Event>::uninit() }; READY_BATCH];
        let mut reads = 0;
        // Level-triggered: what a full batch leaves is reported at the next look.
        match epoll::wait(set, &mut events, Some(&zero)) {
            Ok((ready, _)) => {
                for ev in ready.iter() {
                    let token = ev.data.u64();
                    if qps || token & TOKEN_PENDING != 0 {
                        reads += u64::from(self.conn_event(token, ev.flags, lock));
                    }
                }
            }
            Err(e) => tracing::trace!(%e, "tcp0: epoll_wait on the connections failed"),
        }
        reads
    }

    fn accept_all(&self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if self.held.lock().fresh >= MAX_PENDING {
                        tracing::warn!(%peer, "tcp0: too many connections without HELLO; refused");
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    self.hold(Held::accepted(
                        Arc::new(DataConn::accepted(stream, peer)),
                        Instant::now(),
                    ));
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

    /// Watch a connection no QP owns: register it under a token of its own (it may be
    /// registered under its QP's token until now) and keep it.
    pub(super) fn hold(&self, mut held: Held) {
        let mut conns = self.held.lock();
        if !held.is_fresh() && conns.kept() >= MAX_KEPT {
            let _ = held.stream.shutdown(Shutdown::Both);
            return;
        }
        let id = self.next_held.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff;
        let token = TOKEN_PENDING | id;
        held.quiet = may_be_quiet(&held, &conns.awaited);
        let flags = held_flags(held.quiet);
        let watched = if held.is_fresh() {
            self.watch(&*held.stream, token, flags)
        } else {
            self.rewatch(&*held.stream, token, flags)
                .or_else(|_| self.watch(&*held.stream, token, flags))
        };
        if let Err(e) = watched {
            tracing::warn!(%e, "tcp0: cannot watch a connection; closed");
            let _ = held.stream.shutdown(Shutdown::Both);
            return;
        }
        let (replaced, displaced) = conns.insert(id, held);
        if let Some(old) = replaced {
            self.stop_watching(&*old.stream);
            let _ = old.stream.shutdown(Shutdown::Both);
        }
        if let Some(old_id) = displaced {
            if let Some(old) = conns.by_id.get_mut(&old_id).filter(|h| h.quiet) {
                old.quiet = false;
                let _ = self.rewatch(&*old.stream, TOKEN_PENDING | old_id, held_flags(false));
            }
        }
    }

    /// Wake-ups of the progress thread written so far.
    #[cfg(test)]
    pub(super) fn thread_wakes(&self) -> u64 {
        self.poller.wakes()
    }

    /// Kept connections not watched for input (each waits for a QP's RTR).
    #[cfg(test)]
    pub(super) fn quiet_conns(&self) -> usize {
        self.held.lock().by_id.values().filter(|h| h.quiet).count()
    }

    /// A QP lets go of its connection after sending a BYE on it (see [`super::held`]).
    pub fn keep_released(&self, stream: Arc<DataConn>, owner: Owner, bye_read: bool) {
        self.hold(Held::released(stream, owner, bye_read, Instant::now()));
    }

    /// The clean connection QP `qpn` opened to the listener at `peer` before, if it kept one,
    /// for its next use, with the HELLO the peer's QP wrote on it if it reached RTR first; one
    /// to another listener, not clean, or carrying anything else is closed (so is any, with
    /// `peer` `None`). `named`: the opening end's address of the connection that the peer's
    /// QP says (in its endpoint, read after its RTR) it took without a HELLO; a clean
    /// connection of that name is taken without reading it.
    pub fn take_opened(
        &self,
        peer: Option<SocketAddr>,
        qpn: u32,
        named: Option<SocketAddr>,
    ) -> Option<Kept> {
        let mut conns = self.held.lock();
        let id = *conns.opened.get(&qpn)?;
        let mut h = conns.remove(id)?;
        drop(conns);
        if peer.is_some_and(|peer| h.owner == (Owner::Opened { peer, qpn })) {
            // The peer's QP took it for this use, clean — every frame of the last use read up
            // to the peer's BYE — and wrote nothing since but, maybe, the HELLO it owes in
            // front of its first request, which this QP's reader skips as the use's first
            // frame: nothing to read for (one system call less on the connect's path).
            if named.is_some() && h.is_clean() && h.stream.opener() == named {
                return Some(Kept::new(h.stream, None));
            }
            // Not watched for input: the peer's BYE or HELLO may be there unread.
            match h.read() {
                Step::Wait if h.is_clean() => return Some(Kept::new(h.stream, None)),
                Step::Hello { dst_qpn, ids } if dst_qpn == qpn => {
                    return Some(Kept::new(h.stream, Some(ids)))
                }
                _ => {}
            }
        }
        self.stop_watching(&*h.stream);
        let _ = h.stream.shutdown(Shutdown::Both);
        None
    }

    /// Accepting end, QP `me` reaching RTR towards QP `opener` at the listener `peer`: the
    /// connection that QP opened to this context and used last, kept for its next use, with
    /// the HELLO it wrote on it if it reached RTR first. A HELLO there for another QP of this
    /// context goes to that QP. `None` (and the peer's HELLO is awaited as on a new
    /// connection) when there is none, or it has been idle too long for this end to start
    /// the use ([`ACCEPTED_REUSE`]).
    pub fn take_accepted(&self, peer: SocketAddr, opener: u32, me: u32) -> Option<Kept> {
        let mut guard = self.held.lock();
        let conns = &mut *guard;
        let now = Instant::now();
        let key = (peer, opener);
        let Some(id) = conns.by_opener.get(&key).copied() else {
            // Still another QP's here, or its BYE on the way: the HELLO written on it once it
            // is kept must be read.
            conns.await_opener(key, now + HELLO_TIMEOUT);
            return None;
        };
        let h = conns.by_id.get_mut(&id)?;
        let step = h.read();
        let ours = h.is_clean() && h.idle_for(now) < ACCEPTED_REUSE;
        if matches!(step, Step::Wait) && !ours {
            // Not this end's to start (the last use's frames still draining, part of the
            // peer's HELLO here, or idle too long): watched for input, as a new connection
            // is, and the progress thread hands the peer's HELLO over when it comes.
            if h.quiet {
                h.quiet = false;
                // Level-triggered: what came after the read is reported at once.
                if self
                    .rewatch(&*h.stream, TOKEN_PENDING | id, held_flags(false))
                    .is_err()
                {
                    if let Some(h) = conns.remove(id) {
                        let _ = h.stream.shutdown(Shutdown::Both);
                    }
                }
            }
            // Once clean, it stays watched until the peer's HELLO comes.
            conns.await_opener(key, now + HELLO_TIMEOUT);
            return None;
        }
        let h = conns.remove(id)?;
        drop(guard);
        match step {
            Step::Wait => Some(Kept::new(h.stream, None)),
            Step::Hello { dst_qpn, ids } if dst_qpn == me => Some(Kept::new(h.stream, Some(ids))),
            step => {
                self.settle(step, h);
                None
            }
        }
    }

    /// Accepting end: a QP connected to the QP `opener` at the listener `peer` took a
    /// connection from it; none of its is awaited any more (see `HeldConns::awaited`).
    pub fn opener_served(&self, peer: SocketAddr, opener: u32) {
        self.held.lock().awaited.remove(&(peer, opener));
    }

    fn read_held(&self, id: u64) {
        let mut guard = self.held.lock();
        let conns = &mut *guard;
        let Some(h) = conns.by_id.get_mut(&id) else {
            return;
        };
        let mut step = h.read();
        if matches!(step, Step::Wait) {
            // Clean now, and found by the RTR that wants it: nothing to watch for until then.
            let found = match h.owner {
                Owner::Opened { qpn, .. } => conns.opened.get(&qpn) == Some(&id),
                Owner::Accepted { opener } => {
                    opener.is_some_and(|k| conns.by_opener.get(&k) == Some(&id))
                }
            };
            if found
                && may_be_quiet(h, &conns.awaited)
                && !h.quiet
                && self
                    .rewatch(&*h.stream, TOKEN_PENDING | id, held_flags(true))
                    .is_ok()
            {
                h.quiet = true;
                // A HELLO that came after the read is read now.
                step = h.read();
            }
            if matches!(step, Step::Wait) {
                return;
            }
        }
        if let (Step::Hello { dst_qpn, ids }, Owner::Opened { .. }) = (&step, h.owner) {
            // The peer's QP reached RTR first: its HELLO waits here for this end's QP, which
            // takes the connection at its RTR. Nothing else is read until then.
            h.keep_hello(*dst_qpn, *ids);
            if !h.quiet
                && self
                    .rewatch(&*h.stream, TOKEN_PENDING | id, held_flags(true))
                    .is_ok()
            {
                h.quiet = true;
            }
            return;
        }
        let Some(h) = conns.remove(id) else { return };
        drop(guard);
        self.settle(step, h);
    }

    /// Carry out what reading a connection the engine held came to (it is out of the table).
    fn settle(&self, step: Step, h: Held) {
        match step {
            Step::Wait => {}
            // Still in the epoll set: its QP takes it over under its own token (or closes it).
            Step::Hello { dst_qpn, ids } => match self.qps.get(dst_qpn) {
                Some(qp) => qp.accept_incoming(ids, h.stream),
                None => tracing::warn!(
                    peer = ?h.stream.peer_addr().ok(),
                    dst_qpn,
                    "tcp0: HELLO for an unknown QP; closed"
                ),
            },
            Step::Close(Some(what)) => {
                self.stop_watching(&*h.stream);
                tracing::warn!(peer = ?h.stream.peer_addr().ok(), %what, "tcp0: connection closed")
            }
            Step::Close(None) => self.stop_watching(&*h.stream),
        }
    }
}

/// A kept connection a QP takes at RTR, and the peer's HELLO if it was on it.
pub(super) struct Kept {
    pub stream: Arc<DataConn>,
    pub hello: Option<HelloIds>,
}

impl Kept {
    fn new(stream: Arc<DataConn>, hello: Option<HelloIds>) -> Kept {
        Kept { stream, hello }
    }
}

/// Whether `held` may be watched only for the peer closing: clean, found by the RTR that wants
/// it, and no QP here waits already for the HELLO its opener writes on it (`awaited`).
fn may_be_quiet(held: &Held, awaited: &HashMap<(SocketAddr, u32), Instant>) -> bool {
    held.may_be_quiet() && !held.opener().is_some_and(|k| awaited.contains_key(&k))
}

/// The epoll interest of a held connection: input and the peer closing, or (`quiet`) only the
/// peer closing.
fn held_flags(quiet: bool) -> epoll::EventFlags {
    match quiet {
        true => epoll::EventFlags::RDHUP,
        false => epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
    }
}

impl Engine {
    /// One busy-mode pass: read the connections the set reports ready, send the ACKs held
    /// back long enough, and run the QP timers that are due. `stays`: the poller keeps
    /// polling, so the thread leaves the connections to it for [`BUSY_GRACE`].
    fn drive_pass(&self, stays: bool) {
        let now = Instant::now();
        if stays {
            self.grace.note(now);
        }
        let reads = self.read_ready_conns(Lock::Try, true);
        if reads > 0 {
            self.polled_reads.fetch_add(reads, Ordering::Relaxed);
        }
        self.flush_held_acks(now, false);
        self.run_due_timers(now);
    }
}

impl ProgressHook for Engine {
    fn drive(&self, stays: bool) {
        self.drive_pass(stays);
    }

    /// The poller goes to sleep on the CQ's event: end its grace at once, send the ACKs held
    /// back for its next post, and wake the thread if it left the connections to the poller,
    /// instead of leaving them for [`BUSY_GRACE`]. Otherwise the thread is not woken: it still
    /// watches the connections' set. (A deferral after the look below ends at the thread's
    /// next timeout computation, which finds the grace ended.)
    fn poller_leaving(&self) {
        if self.mode != ProgressMode::Busy || !self.grace.end() {
            return;
        }
        // What this poller held back for its next post goes now, from its own thread.
        self.flush_held_acks(Instant::now(), true);
        if self.deferred.load(Ordering::Relaxed) {
            self.poller.wake();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.poller.stop();
    }
}
