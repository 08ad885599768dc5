//! Run-to-completion workers (ARCHITECTURE.md "Threads").
//!
//! A worker thread owns a completion queue, a memory pool and the channels adopted onto it;
//! nothing else touches their protocol state. A completion is polled, fed to its channel's core,
//! and whatever follows — delivery to the application, an RPC handler and its reply, credit
//! returns, rendezvous READs — happens on this thread before the next completion, with no lock
//! and no hand-off. Other threads reach a worker only through its inbox ([`shared`]): a
//! lock-free queue plus an eventfd written only while the worker sleeps.
//!
//! Polling is hybrid: the worker busy-polls while work arrives; after `idle_spin` without work
//! it arms the CQ, re-polls (a completion racing the arm is not lost), and sleeps in epoll on the
//! CQ's event fd, its inbox eventfd and the channels' control streams (whose hang-up means the
//! peer is gone), with a timeout at the earliest deadline of its timer heap. An idle endpoint
//! costs no CPU.
//!
//! Not here: protocol decisions (`channel::proto`), connection set-up (`endpoint`), the
//! application-facing handles (`handle`, `rpc`, `remote`).

mod buffers;
pub(crate) mod shared;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::io::Read;
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use fabriq_verbs::{
    CompletionQueue, RemoteAddr, SendFlags, SendWr, WcOpcode, WorkCompletion, WrOpcode,
};
use parking_lot::RwLock;
use rustix::event::epoll;
use tokio::sync::oneshot;

use crate::channel::driver::{BufferSource, ChannelDriver, CoreEvent};
use crate::channel::proto::{Instant, Received, TraceInfo};
use crate::channel::{ChannelError, TraceFlags};
use crate::mempool::{MemPool, PoolBuf};
use crate::message::{Message, Payload};
use crate::rpc::wire as rpcwire;
use crate::rpc::{Handler, RpcError};
use buffers::Buffers;
use shared::{ChannelShared, Failure, WorkerShared};

/// RPC handlers shared by every worker of an endpoint, by method id.
pub(crate) type Handlers = RwLock<HashMap<u32, (String, Handler)>>;

/// One-sided operations a worker posts for a [`crate::RemoteRegion`].
#[derive(Debug)]
pub(crate) enum OneSidedOp {
    Write {
        remote: RemoteAddr,
        data: Vec<u8>,
    },
    Read {
        remote: RemoteAddr,
        len: u32,
    },
    CompareSwap {
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        remote: RemoteAddr,
        add: u64,
    },
}

/// Reply of a one-sided operation: the bytes read, or the original 8-byte word of an atomic.
pub(crate) type OneSidedReply = oneshot::Sender<Result<Vec<u8>, ChannelError>>;

/// A request to a worker.
pub(crate) enum Command {
    Adopt(Box<Adopt>),
    Send {
        chan: u32,
        data: Vec<u8>,
        trace: TraceInfo,
    },
    Released {
        chan: u32,
    },
    Call {
        chan: u32,
        method: u32,
        body: Vec<u8>,
        deadline: Instant,
        reply: oneshot::Sender<Result<Vec<u8>, RpcError>>,
    },
    OneSided {
        chan: u32,
        op: OneSidedOp,
        reply: OneSidedReply,
    },
    SetThresholds {
        chan: u32,
        thresholds: crate::channel::Thresholds,
    },
    Stats {
        chan: u32,
        reply: oneshot::Sender<crate::channel::ChannelStats>,
    },
    Close {
        chan: u32,
    },
    Shutdown,
}

/// A connected channel handed to a worker.
pub(crate) struct Adopt {
    pub(crate) driver: ChannelDriver,
    pub(crate) shared: Arc<ChannelShared>,
    pub(crate) control: Option<TcpStream>,
}

const WR_ONE_SIDED: u64 = 0x10;
/// One-sided operations in flight per channel; the QP's send queue has this much room beyond
/// what the channel protocol uses.
pub(crate) const ONE_SIDED_DEPTH: u32 = 32;
const EPOLL_WAKE: u64 = 0;
const EPOLL_CQ: u64 = 1;
const EPOLL_CONTROL: u64 = 1 << 40;
const MAX_ORPHANS: usize = 1 << 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    Channel(u32),
    Call(u32, u64),
}

struct OneSidedPending {
    buf: PoolBuf,
    op_len: usize,
    reply: OneSidedReply,
}

struct ChanState {
    driver: ChannelDriver,
    shared: Arc<ChannelShared>,
    backlog: VecDeque<(PoolBuf, TraceInfo)>,
    calls: HashMap<u64, oneshot::Sender<Result<Vec<u8>, RpcError>>>,
    one_sided_queue: VecDeque<(OneSidedOp, OneSidedReply)>,
    one_sided: HashMap<u64, OneSidedPending>,
    control: Option<TcpStream>,
    timer_at: Option<Instant>,
    failed: bool,
}

/// The current time on the host's monotonic clock (shared by processes of one host, so trace
/// timestamps compare across them).
pub(crate) fn now() -> Instant {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    Instant::from_nanos((ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64)
}

/// Settings of a worker thread.
#[derive(Debug, Clone)]
pub(crate) struct WorkerConfig {
    pub(crate) idle_spin: Duration,
    pub(crate) pin_cpu: Option<usize>,
    pub(crate) pool: crate::mempool::PoolConfig,
}

/// The thread side of a worker.
pub(crate) struct Worker {
    shared: Arc<WorkerShared>,
    cq: CompletionQueue,
    pool: Buffers,
    channels: HashMap<u32, ChanState>,
    dirty: Vec<u32>,
    timers: BinaryHeap<Reverse<(Instant, Timer)>>,
    handlers: Arc<Handlers>,
    epoll: std::os::fd::OwnedFd,
    idle_spin: Duration,
    orphans: HashMap<u32, Vec<WorkCompletion>>,
    next_call: u64,
    next_one_sided: u64,
    has_cq_events: bool,
}

/// Start a worker thread. Returns once the thread has created its pool.
pub(crate) fn spawn(
    shared: Arc<WorkerShared>,
    cq: CompletionQueue,
    pd: fabriq_verbs::ProtectionDomain,
    handlers: Arc<Handlers>,
    cfg: WorkerConfig,
) -> Result<std::thread::JoinHandle<()>, ChannelError> {
    let (tx, rx) = std::sync::mpsc::channel::<Result<(), ChannelError>>();
    let name = format!("fabriq-worker-{}", shared.id);
    let handle = std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            if let Some(cpu) = cfg.pin_cpu {
                let ids = core_affinity::get_core_ids().unwrap_or_default();
                if let Some(id) = ids.get(cpu % ids.len().max(1)) {
                    core_affinity::set_for_current(*id);
                }
            }
            let worker = match Worker::new(shared, cq, &pd, handlers, &cfg) {
                Ok(w) => {
                    let _ = tx.send(Ok(()));
                    w
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            worker.run();
        })
        .map_err(|e| ChannelError::Verbs(fabriq_verbs::VerbsError::io("spawn worker", e)))?;
    match rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ChannelError::Failed("worker thread died at start".into())),
    }
}

impl Worker {
    fn new(
        shared: Arc<WorkerShared>,
        cq: CompletionQueue,
        pd: &fabriq_verbs::ProtectionDomain,
        handlers: Arc<Handlers>,
        cfg: &WorkerConfig,
    ) -> Result<Worker, ChannelError> {
        let pool = MemPool::new(pd, cfg.pool.clone())
            .map_err(|e| ChannelError::Failed(format!("memory pool: {e}")))?;
        let io = |what: &str, e: rustix::io::Errno| {
            ChannelError::Verbs(fabriq_verbs::VerbsError::io(what.to_string(), e))
        };
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|e| io("epoll_create", e))?;
        epoll::add(
            &ep,
            shared.wake_fd(),
            epoll::EventData::new_u64(EPOLL_WAKE),
            epoll::EventFlags::IN,
        )
        .map_err(|e| io("epoll add eventfd", e))?;
        let mut has_cq_events = false;
        if let Some(fd) = cq.event_fd() {
            epoll::add(
                &ep,
                fd,
                epoll::EventData::new_u64(EPOLL_CQ),
                epoll::EventFlags::IN,
            )
            .map_err(|e| io("epoll add CQ", e))?;
            has_cq_events = true;
        }
        Ok(Worker {
            shared,
            cq,
            pool: Buffers::new(pool),
            channels: HashMap::new(),
            dirty: Vec::new(),
            timers: BinaryHeap::new(),
            handlers,
            epoll: ep,
            idle_spin: cfg.idle_spin,
            orphans: HashMap::new(),
            next_call: 1,
            next_one_sided: 1,
            has_cq_events,
        })
    }

    fn run(mut self) {
        let mut wcs = vec![WorkCompletion::EMPTY; 64];
        let mut idle_since: Option<std::time::Instant> = None;
        let mut loops: u64 = 0;
        loop {
            loops = loops.wrapping_add(1);
            let mut work = 0usize;
            while let Some(cmd) = self.shared.pop() {
                work += 1;
                if !self.command(cmd) {
                    self.shutdown();
                    return;
                }
            }
            work += self.poll_cq(&mut wcs);
            work += self.fire_timers();
            self.pump_dirty();
            if work > 0 {
                idle_since = None;
                continue;
            }
            if loops % 1024 == 0 {
                self.wait_events(Some(Duration::ZERO));
            }
            let since = *idle_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() < self.idle_spin {
                std::hint::spin_loop();
                if loops % 128 == 0 {
                    std::thread::yield_now();
                }
                continue;
            }
            self.sleep(&mut wcs);
            idle_since = None;
        }
    }

    fn poll_cq(&mut self, wcs: &mut [WorkCompletion]) -> usize {
        let n = match self.cq.poll(wcs) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(%e, "completion queue failed");
                let ids: Vec<u32> = self.channels.keys().copied().collect();
                for id in ids {
                    self.fail_channel(id, Failure::Error(format!("completion queue: {e}")));
                }
                return 0;
            }
        };
        let now = now();
        for wc in wcs.iter().take(n) {
            self.completion(now, wc);
        }
        n
    }

    fn completion(&mut self, now: Instant, wc: &WorkCompletion) {
        let id = wc.qp_num.0;
        let Some(st) = self.channels.get_mut(&id) else {
            // A completion for a channel being adopted: kept until it arrives.
            let list = self.orphans.entry(id).or_default();
            if list.len() < MAX_ORPHANS {
                list.push(*wc);
            }
            return;
        };
        if wc.wr_id >> 56 == WR_ONE_SIDED {
            if let Some(p) = st.one_sided.remove(&(wc.wr_id & ((1 << 56) - 1))) {
                let result = if wc.status.is_success() {
                    Ok(p.buf.get(..p.op_len).unwrap_or(&[]).to_vec())
                } else {
                    Err(ChannelError::Completion {
                        opcode: wc.opcode,
                        status: wc.status,
                    })
                };
                let _ = p.reply.send(result);
            }
        } else {
            st.driver.handle_completion(now, wc);
        }
        self.mark_dirty(id);
    }

    fn mark_dirty(&mut self, id: u32) {
        if !self.dirty.contains(&id) {
            self.dirty.push(id);
        }
    }

    /// Handle a command; false on shutdown.
    fn command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Adopt(a) => {
                let Adopt {
                    driver,
                    shared,
                    control,
                } = *a;
                let id = driver.qp().qp_num().0;
                if let Some(c) = &control {
                    let _ = c.set_nonblocking(true);
                    let _ = epoll::add(
                        &self.epoll,
                        c.as_fd(),
                        epoll::EventData::new_u64(EPOLL_CONTROL | u64::from(id)),
                        epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
                    );
                }
                self.channels.insert(
                    id,
                    ChanState {
                        driver,
                        shared,
                        backlog: VecDeque::new(),
                        calls: HashMap::new(),
                        one_sided_queue: VecDeque::new(),
                        one_sided: HashMap::new(),
                        control,
                        timer_at: None,
                        failed: false,
                    },
                );
                if let Some(list) = self.orphans.remove(&id) {
                    let now = now();
                    for wc in list {
                        self.completion(now, &wc);
                    }
                }
                self.mark_dirty(id);
            }
            Command::Send { chan, data, trace } => {
                let Some(st) = self.channels.get_mut(&chan) else {
                    return true;
                };
                if st.failed {
                    st.shared.send_progress(1);
                    return true;
                }
                match alloc_filled(&mut self.pool, &[&data]) {
                    Ok(buf) => st.backlog.push_back((buf, trace)),
                    Err(e) => {
                        tracing::warn!(%e, "no memory for a send");
                        st.shared.send_progress(1);
                    }
                }
                self.mark_dirty(chan);
            }
            Command::Released { chan } => {
                if let Some(st) = self.channels.get_mut(&chan) {
                    let n = st
                        .shared
                        .released
                        .swap(0, std::sync::atomic::Ordering::AcqRel);
                    st.driver.core_mut().handle_released(n);
                    self.mark_dirty(chan);
                }
            }
            Command::Call {
                chan,
                method,
                body,
                deadline,
                reply,
            } => {
                let Some(st) = self.channels.get_mut(&chan) else {
                    let _ = reply.send(Err(RpcError::PeerGone));
                    return true;
                };
                if st.failed {
                    let _ = reply.send(Err(RpcError::PeerGone));
                    return true;
                }
                let call_id = self.next_call;
                self.next_call += 1;
                let head = rpcwire::encode_request_header(call_id, method);
                match alloc_filled(&mut self.pool, &[&head, &body]) {
                    Ok(buf) => {
                        st.shared
                            .outstanding
                            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                        st.backlog.push_back((
                            buf,
                            TraceInfo {
                                trace_id: call_id,
                                flags: TraceFlags(TraceFlags::RPC_REQUEST),
                            },
                        ));
                        st.calls.insert(call_id, reply);
                        self.timers
                            .push(Reverse((deadline, Timer::Call(chan, call_id))));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(RpcError::Channel(ChannelError::Failed(format!(
                            "no memory for the request: {e}"
                        )))));
                    }
                }
                self.mark_dirty(chan);
            }
            Command::OneSided { chan, op, reply } => {
                match self.channels.get_mut(&chan) {
                    Some(st) if !st.failed => st.one_sided_queue.push_back((op, reply)),
                    Some(st) => {
                        let err = st
                            .shared
                            .failure()
                            .map_or(ChannelError::Closed, |f| f.to_error());
                        let _ = reply.send(Err(err));
                    }
                    None => {
                        let _ = reply.send(Err(ChannelError::Closed));
                    }
                }
                self.mark_dirty(chan);
            }
            Command::SetThresholds { chan, thresholds } => {
                if let Some(st) = self.channels.get_mut(&chan) {
                    if let Err(e) = st.driver.core_mut().set_thresholds(thresholds) {
                        tracing::warn!(%e, "thresholds refused");
                    }
                }
            }
            Command::Stats { chan, reply } => {
                if let Some(st) = self.channels.get(&chan) {
                    let _ = reply.send(st.driver.core().stats());
                }
            }
            Command::Close { chan } => {
                self.fail_channel(chan, Failure::Closed);
                if let Some(st) = self.channels.remove(&chan) {
                    if let Some(c) = &st.control {
                        let _ = epoll::delete(&self.epoll, c.as_fd());
                    }
                    let _ = st.driver.qp().modify(&fabriq_verbs::QpAttr::error());
                }
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn shutdown(&mut self) {
        let ids: Vec<u32> = self.channels.keys().copied().collect();
        for id in ids {
            self.fail_channel(id, Failure::Closed);
        }
        self.channels.clear();
    }

    fn fail_channel(&mut self, id: u32, why: Failure) {
        let Some(st) = self.channels.get_mut(&id) else {
            return;
        };
        if st.failed {
            return;
        }
        st.failed = true;
        let call_err = || match &why {
            Failure::Error(s) => RpcError::Channel(ChannelError::Failed(s.clone())),
            _ => RpcError::PeerGone,
        };
        for (_, reply) in st.calls.drain() {
            let _ = reply.send(Err(call_err()));
        }
        for (_, p) in st.one_sided.drain() {
            let _ = p.reply.send(Err(why.to_error()));
        }
        for (_, reply) in st.one_sided_queue.drain(..) {
            let _ = reply.send(Err(why.to_error()));
        }
        st.backlog.clear();
        if let Some(c) = st.control.take() {
            let _ = epoll::delete(&self.epoll, c.as_fd());
        }
        st.shared.fail(why);
        if !st.driver.core().is_failed() {
            st.driver.core_mut().handle_fatal(ChannelError::Closed);
        }
    }

    fn fire_timers(&mut self) -> usize {
        let Some(Reverse((first, _))) = self.timers.peek() else {
            return 0;
        };
        let now = now();
        if *first > now {
            return 0;
        }
        let mut fired = 0;
        while let Some(Reverse((t, timer))) = self.timers.peek().copied() {
            if t > now {
                break;
            }
            self.timers.pop();
            fired += 1;
            match timer {
                Timer::Channel(id) => {
                    if let Some(st) = self.channels.get_mut(&id) {
                        if st.timer_at == Some(t) {
                            st.timer_at = None;
                        }
                        st.driver.core_mut().handle_timeout(now);
                        self.mark_dirty(id);
                    }
                }
                Timer::Call(id, call) => {
                    if let Some(st) = self.channels.get_mut(&id) {
                        if let Some(reply) = st.calls.remove(&call) {
                            let _ = reply.send(Err(RpcError::Timeout));
                        }
                    }
                }
            }
        }
        fired
    }

    fn pump_dirty(&mut self) {
        while let Some(id) = self.dirty.pop() {
            self.pump_channel(id);
        }
    }

    fn pump_channel(&mut self, id: u32) {
        let now = now();
        let Worker {
            channels,
            pool,
            handlers,
            timers,
            next_one_sided,
            ..
        } = self;
        let Some(st) = channels.get_mut(&id) else {
            return;
        };
        let mut newly_failed = None;
        for _round in 0..64 {
            let mut progress = 0usize;
            // Backlog into the core, in order.
            while let Some((buf, trace)) = st.backlog.pop_front() {
                match st.driver.send(buf, trace) {
                    Ok(_) => progress += 1,
                    Err((ChannelError::WouldBlock, buf)) => {
                        st.backlog.push_front((buf, trace));
                        break;
                    }
                    Err((e, _)) => {
                        tracing::warn!(%e, "message refused by the channel");
                        st.shared.send_progress(1);
                    }
                }
            }
            progress += post_one_sided(st, pool, next_one_sided);
            progress += st.driver.pump(now, pool);
            while let Some(ev) = st.driver.poll_event() {
                progress += 1;
                match ev {
                    CoreEvent::Received {
                        seq,
                        trace,
                        payload,
                    } => on_received(st, pool, handlers, seq, trace, payload),
                    CoreEvent::SendComplete { payload, .. } => {
                        pool.recycle(payload);
                        st.shared.send_progress(1);
                    }
                    CoreEvent::Writable => st.shared.send_progress(0),
                    CoreEvent::Error(e) => {
                        let why = match &e {
                            ChannelError::Completion {
                                status:
                                    fabriq_verbs::WcStatus::RetryExceeded
                                    | fabriq_verbs::WcStatus::WrFlushed
                                    | fabriq_verbs::WcStatus::RnrRetryExceeded,
                                ..
                            } => Failure::PeerGone,
                            ChannelError::Closed => Failure::Closed,
                            other => Failure::Error(other.to_string()),
                        };
                        newly_failed = Some(why);
                    }
                }
            }
            if progress == 0 || newly_failed.is_some() {
                break;
            }
        }
        // Arm the core's timer.
        if let Some(t) = st.driver.core().poll_timeout() {
            if st.timer_at.map_or(true, |cur| t < cur) {
                st.timer_at = Some(t);
                timers.push(Reverse((t, Timer::Channel(id))));
            }
        }
        if let Some(why) = newly_failed {
            self.fail_channel(id, why);
        }
    }

    fn wait_events(&mut self, timeout: Option<Duration>) {
        let mut events: Vec<epoll::Event> = Vec::with_capacity(16);
        let ts = timeout.map(|d| rustix::time::Timespec {
            tv_sec: d.as_secs() as i64,
            tv_nsec: i64::from(d.subsec_nanos()),
        });
        let n = match epoll::wait(
            &self.epoll,
            rustix::buffer::spare_capacity(&mut events),
            ts.as_ref(),
        ) {
            Ok(n) => n,
            Err(_) => return,
        };
        let _ = n;
        for ev in &events {
            let key = ev.data.u64();
            if key & EPOLL_CONTROL != 0 {
                let id = (key & 0xFFFF_FFFF) as u32;
                self.check_control(id);
            }
        }
    }

    /// A control stream became readable: EOF or an error means the peer is gone.
    fn check_control(&mut self, id: u32) {
        let Some(st) = self.channels.get_mut(&id) else {
            return;
        };
        let Some(c) = st.control.as_mut() else {
            return;
        };
        let mut buf = [0u8; 64];
        let gone = match c.read(&mut buf) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
            Err(_) => true,
        };
        if gone {
            self.fail_channel(id, Failure::PeerGone);
        }
    }

    fn sleep(&mut self, wcs: &mut [WorkCompletion]) {
        if !self.shared.prepare_sleep() {
            return;
        }
        let armed = self.has_cq_events && self.cq.req_notify(false).is_ok();
        // Re-poll after arming: a completion that raced the arm is handled now.
        if self.poll_cq(wcs) > 0 {
            self.shared.woke();
            return;
        }
        let mut timeout = self
            .timers
            .peek()
            .map(|Reverse((t, _))| t.saturating_duration_since(now()));
        if !armed {
            // No CQ events: wake now and then to poll.
            timeout = Some(timeout.map_or(Duration::from_millis(1), |t| {
                t.min(Duration::from_millis(1))
            }));
        }
        self.wait_events(timeout);
        self.shared.woke();
        if armed {
            let _ = self.cq.ack_events();
        }
    }
}

/// A pool buffer holding the concatenation of `parts`.
fn alloc_filled(
    pool: &mut impl BufferSource,
    parts: &[&[u8]],
) -> Result<PoolBuf, crate::mempool::PoolError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut buf = pool.alloc_any(len.max(1))?;
    buf.set_len(len);
    let mut at = 0;
    for p in parts {
        if let Some(dst) = buf.get_mut(at..at + p.len()) {
            dst.copy_from_slice(p);
        }
        at += p.len();
    }
    Ok(buf)
}

fn into_payload(payload: Received<PoolBuf>) -> Payload {
    match payload {
        Received::Eager(v) => Payload::Vec(v),
        Received::Rendezvous { mut buf, len } => {
            buf.set_len(usize::try_from(len).unwrap_or(0).min(buf.capacity()));
            Payload::Pool(buf)
        }
    }
}

fn on_received(
    st: &mut ChanState,
    pool: &mut Buffers,
    handlers: &Handlers,
    seq: u64,
    trace: crate::channel::TraceHeader,
    payload: Received<PoolBuf>,
) {
    let payload = into_payload(payload);
    let recycle = match &payload {
        Payload::Pool(b) if b.is_large() => Some(Arc::clone(pool.returned())),
        _ => None,
    };
    let bytes: &[u8] = match &payload {
        Payload::Vec(v) => v,
        Payload::Pool(b) => b,
    };
    if trace.flags.contains(TraceFlags::RPC_REQUEST) {
        // Run the handler here, to completion, and reply inline.
        st.driver.core_mut().handle_released(1);
        let (call_id, method, body) = match rpcwire::decode_request(bytes) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(%e, "malformed RPC request dropped");
                return;
            }
        };
        let handler = handlers.read().get(&method).map(|(_, h)| Arc::clone(h));
        let (status, reply) = match handler {
            Some(h) => match h(body) {
                Ok(r) => (rpcwire::Status::Ok, r),
                Err(e) => (rpcwire::Status::HandlerError, e.into_bytes()),
            },
            None => (
                rpcwire::Status::UnknownMethod,
                format!("method {method:#010x}").into_bytes(),
            ),
        };
        let head = rpcwire::encode_response_header(call_id, status);
        match alloc_filled(pool, &[&head, &reply]) {
            Ok(buf) => {
                st.shared
                    .outstanding
                    .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                st.backlog.push_back((
                    buf,
                    TraceInfo {
                        trace_id: trace.trace_id,
                        flags: TraceFlags(TraceFlags::RPC_RESPONSE),
                    },
                ));
            }
            Err(e) => tracing::warn!(%e, "no memory for an RPC reply"),
        }
        if let (Payload::Pool(b), Some(_)) = (payload, recycle) {
            pool.recycle(b);
        }
    } else if trace.flags.contains(TraceFlags::RPC_RESPONSE) {
        st.driver.core_mut().handle_released(1);
        match rpcwire::decode_response(bytes) {
            Ok((call_id, status, body)) => {
                if let Some(reply) = st.calls.remove(&call_id) {
                    let r = match status {
                        rpcwire::Status::Ok => Ok(body.to_vec()),
                        rpcwire::Status::UnknownMethod => Err(RpcError::UnknownMethod(
                            String::from_utf8_lossy(body).into_owned(),
                        )),
                        rpcwire::Status::HandlerError => Err(RpcError::Handler(
                            String::from_utf8_lossy(body).into_owned(),
                        )),
                    };
                    let _ = reply.send(r);
                }
            }
            Err(e) => tracing::warn!(%e, "malformed RPC response dropped"),
        }
    } else {
        st.shared.deliver(Message {
            payload,
            trace,
            seq,
            recycle,
        });
    }
}

fn post_one_sided(st: &mut ChanState, pool: &mut Buffers, next: &mut u64) -> usize {
    let mut posted = 0;
    while (st.one_sided.len() as u32) < ONE_SIDED_DEPTH {
        let Some((op, reply)) = st.one_sided_queue.pop_front() else {
            break;
        };
        let (len, op_len) = match &op {
            OneSidedOp::Write { data, .. } => (data.len(), 0),
            OneSidedOp::Read { len, .. } => (*len as usize, *len as usize),
            OneSidedOp::CompareSwap { .. } | OneSidedOp::FetchAdd { .. } => (8, 8),
        };
        let mut buf = match pool.alloc_any(len.max(8)) {
            Ok(b) => b,
            Err(e) => {
                let _ = reply.send(Err(ChannelError::Failed(format!("no memory: {e}"))));
                continue;
            }
        };
        buf.set_len(len);
        let opcode = match &op {
            OneSidedOp::Write { remote, data } => {
                buf.copy_from_slice(data);
                WrOpcode::Write { remote: *remote }
            }
            OneSidedOp::Read { remote, .. } => WrOpcode::Read { remote: *remote },
            OneSidedOp::CompareSwap {
                remote,
                compare,
                swap,
            } => WrOpcode::AtomicCmpSwp {
                remote: *remote,
                compare: *compare,
                swap: *swap,
            },
            OneSidedOp::FetchAdd { remote, add } => WrOpcode::AtomicFetchAdd {
                remote: *remote,
                add: *add,
            },
        };
        let token = *next;
        *next += 1;
        let wr_id = (WR_ONE_SIDED << 56) | token;
        let sge = buf.sge();
        let sges = [sge];
        let list: &[fabriq_verbs::Sge] = if len == 0 { &[] } else { &sges };
        match st
            .driver
            .qp()
            .post_send(&[SendWr::new(wr_id, list, opcode).with_flags(SendFlags::SIGNALED)])
        {
            Ok(()) => {
                st.one_sided
                    .insert(token, OneSidedPending { buf, op_len, reply });
                posted += 1;
            }
            Err(e) => {
                let _ = reply.send(Err(ChannelError::Verbs(e.source)));
            }
        }
    }
    posted
}

/// Opcode check used by tests of completions.
#[allow(dead_code)]
pub(crate) fn is_one_sided_opcode(op: WcOpcode) -> bool {
    matches!(
        op,
        WcOpcode::RdmaWrite | WcOpcode::RdmaRead | WcOpcode::CompSwap | WcOpcode::FetchAdd
    )
}
