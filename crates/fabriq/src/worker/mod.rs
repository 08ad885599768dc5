//! Run-to-completion workers (ARCHITECTURE.md "Threads").
//!
//! A worker owns a completion queue and the channels adopted onto it. Its loop body,
//! [`Worker::progress`], drains the inbox, polls the CQ, fires timers and pumps every channel
//! that has something to do: a completion is fed to its channel's core, and whatever follows —
//! delivery to the application, an RPC handler and its reply, credit returns, rendezvous READs —
//! happens in the same pass, on the thread that runs it, before the next completion.
//!
//! The state sits behind one lock in [`shared::WorkerShared`], so that pass can be run by more
//! than one thread, never two at once:
//!
//! * [`Progress::Thread`] (default): a worker thread busy-polls while work arrives; after
//!   `idle_spin` without work it arms the CQ, re-polls (a completion racing the arm is not lost)
//!   and sleeps in epoll on the CQ's event fd, its inbox eventfd and the channels' control
//!   streams (whose hang-up means the peer is gone), with a timeout at the earliest timer. An
//!   application thread that waits runs passes itself whenever the lock is free, and a send
//!   posts directly when it is, so an idle worker costs no hand-off.
//! * [`Progress::Caller`]: application threads drive the worker (the UCX / eRPC model). `send`
//!   posts under the lock; blocking `recv`, `Rpc::call` and one-sided operations poll the CQ
//!   themselves for the idle budget, then one of them arms the CQ and sleeps in the worker's
//!   epoll while the others park. The worker thread is only a back-stop: it stays asleep while
//!   application threads call in and progresses the endpoint (RPC handlers of a server that
//!   never calls, async tasks, peer hang-ups) once none has for a few milliseconds.
//!
//! Not here: protocol decisions (`channel::proto`), connection set-up (`endpoint`), the
//! application-facing handles (`handle`, `rpc`, `remote`).

pub(crate) mod async_wait;
mod barrier;
mod buffers;
mod clock;
mod delivery;
pub(crate) mod guard;
pub(crate) mod reply;
pub(crate) mod shared;
pub(crate) mod streams;
mod wheel;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crossbeam_queue::SegQueue;
use fabriq_verbs::{
    CompletionQueue, RemoteAddr, SendFlags, SendWr, WcOpcode, WorkCompletion, WrOpcode,
};
use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use rustix::event::epoll;

use crate::channel::driver::{ChannelDriver, CoreEvent};
use crate::channel::outbuf::{OutBuf, SmallBuf};
use crate::channel::proto::{Instant, Received, TraceInfo};
use crate::channel::{ChannelError, TraceFlags};
use crate::config::Progress;
use crate::conn::{ControlEvent, ControlStream, QpLease};
use crate::mempool::PoolBuf;
use crate::message::{Message, Payload};
use crate::rpc::wire as rpcwire;
use crate::rpc::{Responder, RpcError, Served};
pub(crate) use buffers::Buffers;
pub use buffers::MemoryStats;
use clock::PassClock;
use reply::{Cached, CallResult, OneSidedResult, ReplyTo, SlotReceiver};
use shared::{Awaited, ChannelShared, Failure, WorkerShared};
use streams::{key_conn, key_stream, stream_key, AcceptSender, Accepted, StreamKey};

/// RPC handlers shared by every worker of an endpoint, by method id.
pub(crate) type Handlers = RwLock<HashMap<u32, (String, Served)>>;

/// What the workers of one endpoint share: its RPC handlers and the counters of what it
/// refused its peers.
#[derive(Default)]
pub(crate) struct EndpointShared {
    pub(crate) handlers: Handlers,
    pub(crate) guard: guard::GuardCounters,
}

/// One-sided operations a worker posts for a [`crate::RemoteRegion`]. The local side of a
/// write or a read is a registered buffer the application thread brought (filled, for a
/// write: the worker copies nothing); an atomic's, and a read's the caller brought none for,
/// the worker takes from its pool.
#[derive(Debug)]
pub(crate) enum OneSidedOp {
    /// `buf`'s bytes to `remote`.
    Write {
        remote: RemoteAddr,
        buf: PoolBuf,
    },
    /// `len` bytes of `remote` into `into` (its length set to `len`) or a pool buffer.
    Read {
        remote: RemoteAddr,
        len: u32,
        into: Option<PoolBuf>,
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

/// What a completed one-sided operation hands back.
#[derive(Debug)]
pub(crate) enum OneSidedDone {
    /// Its local buffer: the one the caller brought (written, or read into), an atomic's
    /// original 8-byte word.
    Buf(PoolBuf),
    /// The bytes of a read into a buffer of the worker's, copied out (the buffer stays).
    Bytes(Vec<u8>),
}

/// Reply of a one-sided operation.
pub(crate) type OneSidedReply = ReplyTo<OneSidedResult>;
/// Reply of an RPC call.
pub(crate) type CallReply = ReplyTo<CallResult>;

/// A request to a worker.
///
/// `chan` names a stream ([`StreamKey`]); `conn` a connection (its QP number).
pub(crate) enum Command {
    Adopt(Box<Adopt>),
    /// Open stream `stream` on the (connecting side's) connection `conn`; `announce`: send
    /// `STREAM_OPEN` (every stream but the one the handshake opened).
    OpenStream {
        conn: u32,
        stream: u32,
        shared: Arc<ChannelShared>,
        announce: bool,
    },
    Send {
        chan: StreamKey,
        buf: OutBuf,
        trace: TraceInfo,
    },
    Released {
        chan: StreamKey,
    },
    Call(Box<Call>),
    OneSided {
        chan: StreamKey,
        op: OneSidedOp,
        reply: OneSidedReply,
        deadline: Instant,
    },
    SetThresholds {
        chan: StreamKey,
        thresholds: crate::channel::Thresholds,
    },
    /// The application dropped the stream.
    Close {
        chan: StreamKey,
    },
    /// The connecting side's last user of the connection let go.
    CloseConn {
        conn: u32,
    },
    Shutdown,
}

/// An RPC request ready to go: `buf` holds the RPC header and the body.
pub(crate) struct Call {
    pub(crate) chan: StreamKey,
    pub(crate) call_id: u64,
    pub(crate) buf: OutBuf,
    pub(crate) deadline: Instant,
    pub(crate) reply: CallReply,
}

/// A connection handed to a worker.
pub(crate) struct Adopt {
    pub(crate) driver: ChannelDriver,
    pub(crate) control: Option<ControlStream>,
    /// The QP's way back to the connection manager's cache once the connection closes.
    pub(crate) lease: Option<QpLease>,
    /// Accepting side: where streams the peer opens go (`Listener::accept`). `None` on the
    /// connecting side, which opens the streams.
    pub(crate) accept: Option<AcceptSender>,
    /// Set when the connection fails (read by the connection pool).
    pub(crate) failed: Arc<AtomicBool>,
    /// Connecting side: set when the peer refused a stream (`STREAM_REFUSED`): the pool hands
    /// the connection out no more, and the next connect sets up another.
    pub(crate) refusing: Arc<AtomicBool>,
    pub(crate) peer: SocketAddr,
    pub(crate) eager_max: u32,
    /// The stream window both sides agreed on.
    pub(crate) stream_window: u32,
    /// Accepting side: streams the peer may have open at once (`Config::max_streams`).
    pub(crate) max_streams: u32,
    /// Accepting side: the connection's place among those the endpoint keeps.
    pub(crate) admission: Option<Admission>,
    /// Accepting side, when the driver awaits the peer's `Ready`: how long it may take.
    pub(crate) ready_within: Duration,
    /// Accepting side: the stream the handshake opened (already handed to the listener).
    pub(crate) first_stream: Option<Arc<ChannelShared>>,
}

const WR_ONE_SIDED: u64 = 0x10;
/// One-sided operations in flight per channel; the QP's send queue has this much room beyond
/// what the channel protocol uses.
pub(crate) const ONE_SIDED_DEPTH: u32 = 32;
pub(crate) const EPOLL_WAKE: u64 = 0;
const EPOLL_CQ: u64 = 1;
const EPOLL_CONTROL: u64 = 1 << 40;
const MAX_ORPHANS: usize = 1 << 16;
/// Polls of the CQ that found completions a worker may make between arming its reclaim timer
/// and its firing and still count as quiet (`Timer::Reclaim`): a few messages, not a stream of
/// traffic.
const RECLAIM_QUIET_POLLS: u64 = 16;
/// Longest a closing channel's QP is given to flush before it is destroyed instead of cached.
const RETIRE_DRAIN_LIMIT: Duration = Duration::from_millis(100);
/// A closing connection nudges its peer when it starts to wait for it, again after this long,
/// then at doubling intervals up to `NUDGE_MAX` ([`Worker::nudge_peer`]).
const NUDGE_FIRST: Duration = Duration::from_micros(200);
const NUDGE_MAX: Duration = Duration::from_millis(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    Channel(u32),
    /// The earliest deadline of a connection's RPC calls and one-sided operations
    /// (`ConnState::deadline_at`).
    Deadlines(u32),
    /// A closing connection's linger ends (`ConnState::closing`).
    Linger(u32),
    /// A closing connection nudges its peer again (`ConnState::nudge`).
    Nudge(u32),
    /// An accepted connection's time for the peer's `Ready` ends: the pass it wakes checks
    /// `Worker::awaiting` (a sleeping worker would otherwise not look until something else
    /// woke it).
    ReadyDue,
    /// The idle reclaim of the buffers (`Worker::arm_reclaim`).
    Reclaim,
}

/// A one-sided operation posted to the QP. Its buffer stays until the completion comes, even
/// after its deadline passed (`reply` taken: the caller was told `Timeout`): the device may
/// still read or write it until then.
struct OneSidedPending {
    buf: PoolBuf,
    /// A read into the worker's buffer: its bytes go back, not the buffer.
    copy_out: bool,
    reply: Option<OneSidedReply>,
    deadline: Instant,
}

/// A one-sided operation waiting for room in the send queue.
struct OneSidedQueued {
    op: OneSidedOp,
    reply: OneSidedReply,
    deadline: Instant,
}

/// An RPC call waiting for its response.
struct PendingCall {
    /// `None` once the caller was told `Timeout` while its request was out: the entry stays
    /// until the reply comes, holding the call's place in the stream's window.
    reply: Option<CallReply>,
    deadline: Instant,
    /// The request waits here for room in the window (in `ConnState::waiting_calls`).
    waiting: bool,
}

impl PendingCall {
    fn answer(self, r: Result<Vec<u8>, RpcError>) {
        if let Some(reply) = self.reply {
            let _ = reply.send(r);
        }
    }
}

/// One stream of a connection: an application channel.
struct StreamState {
    shared: Arc<ChannelShared>,
    /// RPC calls waiting for their response on this stream.
    calls: FxHashMap<u64, PendingCall>,
    /// Calls of this end whose request went out and whose reply has not come (timed-out ones
    /// included): at most the stream window (the rest wait in `ConnState::waiting_calls`).
    /// The peer holds this end to the same bound, so the replies it queues for a stream stay
    /// within a window whatever the caller asks.
    calls_out: u32,
    /// Requests of the peer taken in and not yet answered into the core (`offer_to`): a peer
    /// that keeps more than a window of them breaks the protocol.
    serving: u32,
    /// The peer closed the stream: nothing more arrives, nothing more is sent, but the
    /// application may still read what was delivered.
    peer_closed: bool,
    /// Window units of this stream's messages the application consumed, not yet reported to
    /// the peer (a window at most: the peer keeps no more unconsumed). 32 bits, like the
    /// counts above, keep the state of a stream in 56 bytes.
    to_report: u32,
    /// A lone `STREAM_CREDIT` report is queued.
    report_queued: bool,
}

// With its key, a stream's entry in its connection's map fills one cache line: the message
// path reads it on every send and delivery (entries of 72 and 112 bytes measured 1–8% slower
// 8-byte round trips, `docs/BENCHMARKS.md`, 2026-12-05, fifth round).
const _: () = assert!(std::mem::size_of::<StreamState>() <= 56);

impl StreamState {
    fn new(shared: Arc<ChannelShared>) -> StreamState {
        StreamState {
            shared,
            calls: FxHashMap::default(),
            calls_out: 0,
            serving: 0,
            peer_closed: false,
            to_report: 0,
            report_queued: false,
        }
    }
}

/// Accepting side: a connection's place among those its endpoint keeps
/// (`Config::max_connections`), given back when the connection's state goes.
pub(crate) struct Admission(Arc<std::sync::atomic::AtomicUsize>);

impl Admission {
    /// A place among the `max` that `kept` counts, or `None` when all are taken.
    pub(crate) fn take(
        kept: &Arc<std::sync::atomic::AtomicUsize>,
        max: usize,
    ) -> Option<Admission> {
        kept.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()?;
        Some(Admission(Arc::clone(kept)))
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One connection: a QP, its channel core and the streams it carries.
struct ConnState {
    driver: ChannelDriver,
    /// Messages waiting for the core (credits, send window), in order, each with its stream.
    backlog: VecDeque<(OutBuf, TraceInfo)>,
    streams: FxHashMap<u32, StreamState>,
    /// Per stream, the requests held for room in its call window (call id and request), in
    /// order (`StreamState::calls_out`); a stream with none has no entry.
    waiting_calls: FxHashMap<u32, VecDeque<(u64, OutBuf)>>,
    one_sided_queue: VecDeque<OneSidedQueued>,
    one_sided: FxHashMap<u64, OneSidedPending>,
    /// When the worker's `Timer::Deadlines` for this connection fires: the earliest deadline
    /// of its calls and one-sided operations when it was armed. One timer per connection
    /// instead of one per call: a timer filed per call would stay in the wheel until its
    /// deadline, long after the reply — at 500 000 calls a second and 5 s deadlines, millions
    /// of entries.
    deadline_at: Option<Instant>,
    control: Option<ControlStream>,
    lease: Option<QpLease>,
    accept: Option<AcceptSender>,
    failed_flag: Arc<AtomicBool>,
    /// See [`Adopt::refusing`].
    refusing: Arc<AtomicBool>,
    peer: SocketAddr,
    eager_max: u32,
    /// The stream window both sides agreed on (streams the peer opens get it).
    stream_window: u32,
    /// Accepting side: streams the peer may have open at once; more are refused.
    max_streams: u32,
    /// Accepting side: held while this state lives.
    _admission: Option<Admission>,
    timer_at: Option<Instant>,
    failed: Option<Failure>,
    /// The connecting side's last user let go (or the endpoint went) while messages or
    /// one-sided operations were still on their way: the connection stays until they are
    /// acknowledged (or fail), at the latest until this instant, then closes.
    closing: Option<Instant>,
    /// While closing (connecting side): when the next nudge of the peer goes, and how long
    /// after the last one that is (`None`: none went yet). See [`Worker::nudge_peer`].
    nudge: Option<(Instant, Duration)>,
}

/// What became of a message offered to a connection's core.
enum Offered {
    /// The core took it (it is framed and posted as credits allow).
    Queued,
    /// Nothing to send (a stream report already carried by an earlier message), or refused
    /// for good (its reservation was given back).
    Dropped,
    /// Not now (the core's queue is full, or no memory to move it): it goes back to the front
    /// of the backlog.
    Later(OutBuf, TraceInfo),
}

impl ConnState {
    fn is_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Arm the worker's timer for the core's next deadline, unless one at or before it is
    /// armed already.
    fn arm_timer(&mut self, id: u32, timers: &mut wheel::TimerWheel<(Instant, Timer)>) {
        if let Some(t) = self.driver.core().poll_timeout() {
            if self.timer_at.map_or(true, |cur| t < cur) {
                self.timer_at = Some(t);
                timers.insert(t, (t, Timer::Channel(id)));
            }
        }
    }

    /// Arm the worker's timer for a call's or one-sided operation's deadline `t`, unless one
    /// at or before it is armed already.
    fn arm_deadline(
        &mut self,
        id: u32,
        t: Instant,
        timers: &mut wheel::TimerWheel<(Instant, Timer)>,
    ) {
        if self.deadline_at.map_or(true, |cur| t < cur) {
            self.deadline_at = Some(t);
            timers.insert(t, (t, Timer::Deadlines(id)));
        }
    }

    /// End every call and one-sided operation whose deadline is at or before `now` with
    /// `Timeout`, and return the earliest deadline left. A posted operation keeps its buffer
    /// until its completion comes; a queued one is never posted.
    fn expire(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut keep = |d: Instant| next = Some(next.map_or(d, |n| n.min(d)));
        let mut due = Vec::new();
        for (stream, ss) in self.streams.iter_mut() {
            due.extend(
                ss.calls
                    .iter()
                    .filter(|(_, c)| c.reply.is_some() && c.deadline <= now)
                    .map(|(&id, _)| id),
            );
            let mut unsent = false;
            for id in due.drain(..) {
                let Some(c) = ss.calls.get_mut(&id) else {
                    continue;
                };
                if let Some(reply) = c.reply.take() {
                    let _ = reply.send(Err(RpcError::Timeout));
                }
                // A request that never left goes; one that did keeps its place until its
                // reply comes.
                if c.waiting {
                    ss.calls.remove(&id);
                    unsent = true;
                }
            }
            if unsent {
                if let Some(q) = self.waiting_calls.get_mut(stream) {
                    let calls = &ss.calls;
                    q.retain(|(id, _)| calls.contains_key(id));
                    if q.is_empty() {
                        self.waiting_calls.remove(stream);
                    }
                }
            }
            ss.calls
                .values()
                .filter(|c| c.reply.is_some())
                .for_each(|c| keep(c.deadline));
        }
        for p in self.one_sided.values_mut() {
            if p.deadline <= now {
                if let Some(reply) = p.reply.take() {
                    let _ = reply.send(Err(ChannelError::Timeout));
                }
            } else if p.reply.is_some() {
                keep(p.deadline);
            }
        }
        for q in std::mem::take(&mut self.one_sided_queue) {
            if q.deadline <= now {
                let _ = q.reply.send(Err(ChannelError::Timeout));
            } else {
                keep(q.deadline);
                self.one_sided_queue.push_back(q);
            }
        }
        next
    }

    /// A message the peer has: its buffer is recycled, its stream's send window opens.
    fn send_complete(&self, buffers: &Buffers, payload: OutBuf, stream: u32, flags: TraceFlags) {
        let len = payload.len() as u64;
        if let OutBuf::Pool(b) = payload {
            buffers.recycle(b);
        }
        // Stream-control messages are not in the stream's send window.
        if !is_stream_control(flags) {
            if let Some(ss) = self.streams.get(&stream) {
                ss.shared.send_progress(1, len);
            }
        }
    }

    /// Hand one message (in backlog order) to the core. It carries what the application of its
    /// stream consumed since the stream's last report, whether or not the worker was told (it
    /// is told only once a report's worth built up).
    fn offer(&mut self, buffers: &Buffers, buf: OutBuf, trace: TraceInfo) -> Offered {
        let ss = self.streams.get_mut(&trace.stream);
        offer_to(&mut self.driver, ss, buffers, buf, trace)
    }
}

/// [`ConnState::offer`] with the stream's state already looked up (`ss`: `None` for a stream
/// the worker does not know).
fn offer_to(
    driver: &mut ChannelDriver,
    mut ss: Option<&mut StreamState>,
    buffers: &Buffers,
    buf: OutBuf,
    mut trace: TraceInfo,
) -> Offered {
    if let Some(ss) = ss.as_deref_mut() {
        let owed = u64::from(ss.to_report) + ss.shared.take_released();
        // A data message carries the count once half a report's worth built up, not every
        // read: each count it carries costs the peer an atomic step on its send window,
        // and a lag under half a report (an eighth of the window) never holds the peer
        // back (a reader that does not send reports alone at a whole report's worth).
        if is_stream_control(trace.flags) || owed >= (ss.shared.report_every / 2).max(1) {
            ss.to_report = 0;
            trace.stream_credits = trace
                .stream_credits
                .saturating_add(owed.min(u32::MAX.into()) as u32);
        } else {
            ss.to_report = owed.min(u32::MAX.into()) as u32;
        }
        if trace.flags.contains(TraceFlags::STREAM_CREDIT) {
            ss.report_queued = false;
        }
    }
    if trace.flags.contains(TraceFlags::STREAM_CREDIT) && trace.stream_credits == 0 {
        // Already carried by a message before it.
        if let OutBuf::Pool(b) = buf {
            buffers.recycle(b);
        }
        return Offered::Dropped;
    }
    let buf = match buf {
        // Held in place but above the eager limit (thresholds set below SMALL_MAX): it
        // must go from registered memory, by rendezvous.
        OutBuf::Small(s) if s.as_slice().len() as u64 > driver.eager_limit() => {
            match alloc_registered(buffers, &[s.as_slice()]) {
                Ok(b) => OutBuf::Pool(b),
                Err(e) => {
                    tracing::warn!(%e, "no memory to move a small message to the pool");
                    return Offered::Later(OutBuf::Small(s), trace);
                }
            }
        }
        other => other,
    };
    let offered = match driver.send(buf, trace) {
        Ok(_) => Offered::Queued,
        Err((ChannelError::WouldBlock, buf)) => return Offered::Later(buf, trace),
        Err((e, buf)) => {
            tracing::warn!(%e, "message refused by the channel");
            let rpc = trace.flags.0 & (TraceFlags::RPC_REQUEST | TraceFlags::RPC_RESPONSE) != 0;
            match ss.as_deref_mut() {
                Some(_) if is_stream_control(trace.flags) => {}
                // RPC messages count in the send window only.
                Some(ss) if rpc => ss.shared.send_progress(1, buf.len() as u64),
                Some(ss) => ss.shared.cancel_reservation(buf.len() as u64),
                None => {}
            }
            Offered::Dropped
        }
    };
    if trace.flags.contains(TraceFlags::RPC_RESPONSE) {
        if let Some(ss) = ss {
            ss.serving = ss.serving.saturating_sub(1);
        }
    }
    offered
}

impl ConnState {
    /// The accepting side closes a failed connection once every stream on it was dropped; the
    /// connecting side when its last [`streams::ConnHandle`] goes.
    fn retire_now(&self) -> bool {
        self.is_failed()
            && (self.closing.is_some() || (self.accept.is_some() && self.streams.is_empty()))
    }

    /// Nothing this side sent or asked for is still owed by the peer: every message handed to
    /// the connection was acknowledged (a rendezvous one pulled and finished) and no one-sided
    /// operation waits. Stream-control messages count too: their acknowledgement is the last
    /// thing the peer sends on the connection before it learns of its close, and one that came
    /// after the QP was reset could land in it (rdma-core's soft-RoCE driver of Linux 6.1 was
    /// seen to oops on such a packet).
    fn flushed(&self) -> bool {
        self.backlog.is_empty()
            && self.driver.core().outstanding_sends() == 0
            && self.one_sided.is_empty()
            && self.one_sided_queue.is_empty()
    }

    /// Queue an empty stream-control message (`STREAM_OPEN` / `STREAM_CLOSE`) for `stream`.
    fn queue_stream_control(&mut self, pool: &Buffers, stream: u32, flag: u16) {
        match alloc_filled(pool, &[]) {
            Ok(buf) => self.backlog.push_back((
                buf,
                TraceInfo {
                    trace_id: 0,
                    flags: TraceFlags(flag),
                    stream,
                    stream_credits: 0,
                },
            )),
            Err(e) => tracing::warn!(%e, "no memory for a stream control message"),
        }
    }
}

impl Worker {
    /// Entries filed in the timer wheel.
    #[cfg(test)]
    pub(crate) fn timers_filed(&self) -> usize {
        self.timers.len()
    }
}

/// The current time on the host's monotonic clock (shared by processes of one host, so trace
/// timestamps compare across them).
pub(crate) fn now() -> Instant {
    clock::now()
}

/// Settings of a worker.
#[derive(Debug, Clone)]
pub(crate) struct WorkerConfig {
    pub(crate) idle_spin: Duration,
    pub(crate) pin_cpu: Option<usize>,
    pub(crate) pool: crate::mempool::PoolConfig,
    pub(crate) progress: Progress,
    /// Longest a closing connection waits for what it still has to send (`Config::close_linger_ms`).
    pub(crate) close_linger: Duration,
    /// Longest a handler's wait without a deadline of its own may take (`Config::rpc_timeout_ms`;
    /// see [`WorkerShared::handler_deadline`]).
    pub(crate) handler_wait: Duration,
    /// How long after going to sleep the worker reclaims idle buffer memory
    /// (`Config::pool_reclaim_ms`; zero: never from a timer).
    pub(crate) reclaim_after: Duration,
}

/// The worker state: locked by whoever runs a progress pass.
pub(crate) struct Worker {
    /// The worker's own shared half (streams created here point back at it).
    me: Weak<WorkerShared>,
    /// The receive slot of the connection that received last where its next message is
    /// expected (`ChannelDriver::next_rx_addr`), published after each pass for the threads
    /// that wait on the CQ ([`WorkerShared::prefetch_next_rx`]).
    next_rx: usize,
    cq: CompletionQueue,
    buffers: Arc<Buffers>,
    conns: FxHashMap<u32, ConnState>,
    dirty: Vec<u32>,
    timers: wheel::TimerWheel<(Instant, Timer)>,
    /// Timers that fired in this pass (kept to reuse its allocation).
    fired: Vec<(Instant, Timer)>,
    common: Arc<EndpointShared>,
    orphans: FxHashMap<u32, Vec<WorkCompletion>>,
    next_one_sided: u64,
    has_cq_events: bool,
    wcs: Vec<WorkCompletion>,
    loops: u64,
    epoll: OwnedFd,
    /// The control streams alone (`WorkerShared::control_epoll`), which the caller-mode
    /// back-stop watches; `None` in thread mode, where nothing reads that set (no system call
    /// to keep it, at each adoption and close).
    control_epoll: Option<OwnedFd>,
    /// The clock of the current pass, read at most once (see [`PassClock`]).
    clock: PassClock,
    /// Accepted connections whose peer has not confirmed its receive ring yet (their sends
    /// are held, `ChannelDriver::await_peer`), with the time by which it must: their control
    /// streams are read on every pass until then, so the peer's `Ready` releases them at once.
    awaiting: Vec<(u32, Instant)>,
    /// Connections that left receive slots to repost in this pass, and in the one before
    /// (`Worker::post_deferred` posts the latter's at the end of a pass).
    deferred_now: Vec<u32>,
    deferred_before: Vec<u32>,
    /// Longest a connection whose last user let go keeps going for what it still has to send.
    close_linger: Duration,
    /// The endpoint is gone (`Command::Shutdown`): connections still delivering what was sent
    /// before their close finish first (at most their linger), then the worker stops.
    stopping: bool,
    /// Connections lingering (`ConnState::closing` set); whether there are any is published to
    /// `WorkerShared::set_lingering` by the passes.
    lingering: usize,
    /// The thread running this pass waits to read a stream: its next message, when nothing
    /// waits before it, is handed to it here instead of going through the stream's delivery
    /// queue (see [`Handoff`]).
    handoff: Handoff,
    /// See [`WorkerConfig::reclaim_after`].
    reclaim_after: Duration,
    /// `busy_polls` when a `Timer::Reclaim` was armed; `None`: none is.
    reclaim_armed: Option<u64>,
    /// Polls of the CQ that found completions (a quiet worker's reclaim timer finds this
    /// about unchanged).
    busy_polls: u64,
}

/// What the application thread running a pass waits for, and whether the pass gave it: a
/// message handed straight to it, or the reply of its RPC call. Once it has it, the pass ends
/// (see `Worker::pass`).
#[derive(Default)]
pub(crate) struct Handoff {
    /// The stream (`ChannelShared::id`) the thread running the pass reads.
    reader: Option<u64>,
    /// The message handed to it.
    message: Option<Message>,
    /// The RPC call (its id) the thread running the pass waits for.
    call: Option<u64>,
    /// The thread running the pass has what it waits for: `message`, or its call's reply
    /// (sent through the call's oneshot).
    done: bool,
}

impl Handoff {
    /// The thread running the pass has what it waits for.
    fn done(&self) -> bool {
        self.done
    }
}

/// Start a worker: install its state in `shared` and start its thread (the poller in thread
/// mode, the back-stop in caller mode).
pub(crate) fn spawn(
    shared: Arc<WorkerShared>,
    cq: CompletionQueue,
    pd: fabriq_verbs::ProtectionDomain,
    common: Arc<EndpointShared>,
    cfg: WorkerConfig,
) -> Result<std::thread::JoinHandle<()>, ChannelError> {
    let buffers = Arc::new(
        Buffers::new(&pd, cfg.pool.clone())
            .map_err(|e| ChannelError::Failed(format!("memory pool: {e}")))?,
    );
    let mut has_cq_events = false;
    if let Some(fd) = cq.event_fd() {
        epoll::add(
            &shared.epoll,
            fd,
            epoll::EventData::new_u64(EPOLL_CQ),
            epoll::EventFlags::IN,
        )
        .map_err(|e| ChannelError::Verbs(fabriq_verbs::VerbsError::io("epoll add CQ", e)))?;
        has_cq_events = true;
    }
    let epoll = rustix::io::dup(&shared.epoll)
        .map_err(|e| ChannelError::Verbs(fabriq_verbs::VerbsError::io("dup epoll", e)))?;
    let control_epoll = match cfg.progress {
        Progress::Caller => Some(
            rustix::io::dup(&shared.control_epoll)
                .map_err(|e| ChannelError::Verbs(fabriq_verbs::VerbsError::io("dup epoll", e)))?,
        ),
        Progress::Thread => None,
    };
    let cq_peek = cq.clone();
    let worker = Worker {
        me: Arc::downgrade(&shared),
        next_rx: 0,
        epoll,
        control_epoll,
        cq,
        buffers: Arc::clone(&buffers),
        conns: FxHashMap::default(),
        dirty: Vec::new(),
        timers: wheel::TimerWheel::new(now()),
        fired: Vec::new(),
        common,
        orphans: FxHashMap::default(),
        awaiting: Vec::new(),
        deferred_now: Vec::new(),
        deferred_before: Vec::new(),
        next_one_sided: 1,
        close_linger: cfg.close_linger,
        lingering: 0,
        stopping: false,
        has_cq_events,
        wcs: vec![WorkCompletion::EMPTY; 64],
        loops: 0,
        clock: PassClock::default(),
        handoff: Handoff::default(),
        reclaim_after: cfg.reclaim_after,
        reclaim_armed: None,
        busy_polls: 0,
    };
    shared.install(
        worker,
        buffers,
        cq_peek,
        cfg.progress,
        cfg.idle_spin,
        cfg.handler_wait,
    );
    let name = format!("fabriq-worker-{}", shared.id);
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            if let Some(cpu) = cfg.pin_cpu {
                let ids = core_affinity::get_core_ids().unwrap_or_default();
                if let Some(id) = ids.get(cpu % ids.len().max(1)) {
                    core_affinity::set_for_current(*id);
                }
            }
            match cfg.progress {
                Progress::Thread => run_thread(&shared, cfg.idle_spin),
                Progress::Caller => run_backstop(&shared),
            }
        })
        .map_err(|e| ChannelError::Verbs(fabriq_verbs::VerbsError::io("spawn worker", e)))
}

/// Thread mode: busy-poll while work arrives, sleep in epoll after `idle_spin` without work.
/// The spin yields the CPU every 128th round, or at every round where the endpoint was built
/// with one CPU ([`WorkerShared::one_cpu`]): every thread of the process shares it then, and
/// what the worker waits for comes from a thread that runs only when it steps aside — spinning
/// there held the CPU for the rest of the budget while the application's connect or reply
/// waited.
fn run_thread(shared: &WorkerShared, idle_spin: Duration) {
    let every_round = shared.one_cpu();
    let mut idle_since: Option<Instant> = None;
    // The idle round's clock reading, for the next pass (`progress_at`): the pass that finds a
    // completion does not read the clock again.
    let mut recent: Option<Instant> = None;
    let mut spins: u64 = 0;
    loop {
        if shared.stopped.load(Ordering::Acquire) {
            return;
        }
        match shared.try_progress_at(recent.take()) {
            Some(0) => {}
            Some(_) | None => {
                // Work done, or an application thread is progressing right now.
                idle_since = None;
                continue;
            }
        }
        let t = now();
        recent = Some(t);
        let since = *idle_since.get_or_insert(t);
        if t.saturating_duration_since(since) < idle_spin {
            spins = spins.wrapping_add(1);
            if every_round || spins % 128 == 0 {
                // The core may be away for a while: the next pass reads its own clock.
                std::thread::yield_now();
                recent = None;
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        recent = None;
        shared.poll_sleep(None, &mut || None::<()>);
        idle_since = None;
    }
}

/// Caller mode: stay out of the way while application threads call in; once none has for
/// [`shared::BACKSTOP_GRACE`], progress the worker and sleep in its epoll between events.
fn run_backstop(shared: &WorkerShared) {
    let mut watch = shared::QuietWatch::default();
    let mut linger_poll = shared::LINGER_POLL;
    loop {
        if shared.stopped.load(Ordering::Acquire) {
            return;
        }
        if let Err(wait) = shared.callers_quiet(&mut watch) {
            if !shared.watch_lingering(wait, &mut linger_poll) {
                shared.watch_control(wait);
            }
            continue;
        }
        if !shared.try_become_poller() {
            std::thread::sleep(shared::BACKSTOP_GRACE);
            continue;
        }
        // Progress while there is work and nobody else calls in.
        while let Some(n) = shared.try_progress() {
            if n == 0
                || shared.callers_quiet(&mut watch).is_err()
                || shared.stopped.load(Ordering::Acquire)
            {
                break;
            }
        }
        if shared.callers_quiet(&mut watch).is_ok() && !shared.stopped.load(Ordering::Acquire) {
            shared.poll_sleep(None, &mut || None::<()>);
        }
        shared.release_poller();
    }
}

/// Hand `value` to the worker from an application thread: if the worker's lock is free,
/// `direct` applies it after the inbox, followed by one progress pass; otherwise the command
/// `queued` makes of it goes to the inbox, for the thread that holds the lock. In caller mode
/// nobody else may come by soon: unless a waiting thread spins on the worker (and drains the
/// inbox on its next pass), the caller then waits for the lock and runs the pass itself.
pub(crate) fn direct_or_submit<V>(
    w: &WorkerShared,
    value: V,
    direct: impl FnOnce(&mut Worker, V),
    queued: impl FnOnce(V) -> Command,
) {
    direct_or_submit_settled(
        w,
        value,
        |g, v| {
            direct(g, v);
            false
        },
        queued,
    );
}

/// Send `buf` on stream `s` (its room already counted): posted now under the worker's lock, or
/// queued in the worker's inbox. A channel's send and a deferred RPC reply go this way.
#[inline]
pub(crate) fn submit_on_stream(s: &ChannelShared, buf: OutBuf, trace: TraceInfo) {
    let chan = s.id;
    direct_or_submit_settled(
        &s.worker,
        (buf, trace),
        |g, (buf, trace)| g.enqueue_send(chan, buf, trace),
        |(buf, trace)| Command::Send { chan, buf, trace },
    );
}

/// [`direct_or_submit`] where `direct` says whether it left anything for a pass: when it
/// did not (a send that went straight out), the pass is skipped — the next call, the worker
/// thread or a waiter polls the completion queue.
pub(crate) fn direct_or_submit_settled<V>(
    w: &WorkerShared,
    value: V,
    direct: impl FnOnce(&mut Worker, V) -> bool,
    queued: impl FnOnce(V) -> Command,
) {
    w.enter_caller();
    if let Some(mut g) = w.try_lock_state() {
        // Earlier commands of this thread (queued while the state was busy) go first.
        g.drain_inbox(w);
        g.clock.begin();
        if !direct(&mut g, value) {
            // What was just handed in leaves first; the pass (CQ, timers) follows on the same
            // clock.
            g.pump_dirty();
            g.pass(w);
        } else {
            g.nudge_sleeper(w);
        }
        drop(g);
        w.notify_parked();
        return;
    }
    w.submit(queued(value));
    if w.is_caller_mode() && w.try_progress().is_none() && !w.has_spinner() {
        // `None` when this thread holds the lock (a handler): its own pass drains the inbox;
        // or when it holds another worker's (a handler there), and this one is busy: whoever
        // holds it may not pass again, so the back-stop sees the command through.
        match w.lock_state() {
            Some(mut g) => {
                let n = g.progress(w);
                drop(g);
                if n > 0 {
                    w.notify_parked();
                }
            }
            None if shared::holds_a_state() => w.nudge_backstop(),
            None => {}
        }
    }
}

/// A close that the drop of an application handle hands to the worker: in caller mode applied
/// by the dropping thread ([`direct_or_submit`]), since nobody may come by to take a queued
/// one before the back-stop's grace runs out (which then sees a lingering close through,
/// `WorkerShared::watch_lingering`); in thread mode queued for the worker thread.
pub(crate) fn close_on_drop<V>(
    w: &WorkerShared,
    value: V,
    direct: impl FnOnce(&mut Worker, V),
    queued: impl FnOnce(V) -> Command,
) {
    if w.is_caller_mode() {
        direct_or_submit(w, value, direct, queued);
    } else {
        w.submit(queued(value));
    }
}

/// Wait for a worker's reply on `rx`, progressing the worker from this thread: for the whole
/// wait in caller mode, for the idle budget in thread mode (then block on `rx`) — until
/// `deadline` where there is one.
pub(crate) fn wait_reply<T: Cached>(
    w: &WorkerShared,
    rx: SlotReceiver<T>,
    deadline: Option<std::time::Instant>,
) -> Waited<T> {
    wait_awaiting(w, rx, Awaited::Progress, deadline)
}

/// How a wait for a worker's reply ended.
pub(crate) enum Waited<T> {
    Got(T),
    /// The sender was dropped.
    Closed,
    /// The deadline passed first.
    Expired,
}

/// [`wait_reply`] for the reply of RPC call `call`: a pass of this thread that sends it ends
/// there ([`Handoff`]). The call's deadline is kept by the worker's timer wheel; given
/// `deadline`, the wait also ends then by itself. A handler calling out passes it (the caller
/// reads the clock for it only then): it holds its own worker's state, and the worker whose
/// pass would fire the timer may be held by a handler that in turn waits for this one's.
pub(crate) fn wait_call<T: Cached>(
    w: &WorkerShared,
    rx: SlotReceiver<T>,
    call: u64,
    deadline: Option<std::time::Instant>,
) -> Waited<T> {
    wait_awaiting(w, rx, Awaited::Reply(call), deadline)
}

fn wait_awaiting<T: Cached>(
    w: &WorkerShared,
    mut rx: SlotReceiver<T>,
    awaited: Awaited<'_>,
    deadline: Option<std::time::Instant>,
) -> Waited<T> {
    use reply::TryRecvError;
    let mut ready = || match rx.try_recv() {
        Ok(v) => Some(Waited::Got(v)),
        Err(TryRecvError::Empty) => None,
        Err(TryRecvError::Closed) => Some(Waited::Closed),
    };
    // Already there (a one-sided operation on shm completes in the pass that posted it).
    if let Some(v) = ready() {
        return v;
    }
    if w.is_caller_mode() {
        return w
            .wait_reading(deadline, awaited, ready)
            .unwrap_or(Waited::Expired);
    }
    // Thread mode: spin for the idle budget if no other thread spins on this worker, then block
    // on the reply itself (the worker wakes exactly this thread) — except with a deadline of
    // its own (a handler's call: see `wait_call`), which the wait keeps.
    if deadline.is_some() {
        return w
            .wait_reading(deadline, awaited, ready)
            .unwrap_or(Waited::Expired);
    }
    if !w.has_spinner() {
        let spin_until = std::time::Instant::now() + w.idle_spin();
        if let Some(v) = w.wait_reading(Some(spin_until), awaited, &mut ready) {
            return v;
        }
    }
    match rx.blocking_recv() {
        Ok(v) => Waited::Got(v),
        Err(_) => Waited::Closed,
    }
}

/// Wait on the worker's epoll set; the keys of what fired.
fn epoll_wait(ep: &OwnedFd, timeout: Option<Duration>) -> Vec<u64> {
    let mut events: Vec<epoll::Event> = Vec::with_capacity(16);
    let ts = timeout.map(|d| rustix::time::Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: i64::from(d.subsec_nanos()),
    });
    if epoll::wait(ep, rustix::buffer::spare_capacity(&mut events), ts.as_ref()).is_err() {
        return Vec::new();
    }
    events.iter().map(|ev| ev.data.u64()).collect()
}

impl Worker {
    /// One pass of the loop body: inbox, CQ, timers, channels. Returns the work done (0: idle).
    pub(crate) fn progress(&mut self, shared: &WorkerShared) -> usize {
        self.progress_at(shared, None)
    }

    /// [`Worker::progress`] on a clock reading the caller took moments ago (`None`: read one if
    /// the pass needs it); see [`PassClock`].
    pub(crate) fn progress_at(&mut self, shared: &WorkerShared, recent: Option<Instant>) -> usize {
        self.clock.begin_at(recent);
        self.pass(shared)
    }

    /// The pass right after a sleep in the worker's epoll: the timers that ended the sleep fire
    /// in it (an idle pass looks at them only every 64th round).
    pub(crate) fn progress_after_sleep(&mut self, shared: &WorkerShared) -> usize {
        self.clock.begin_at(None);
        let fired = self.fire_timers();
        fired + self.pass(shared)
    }

    /// [`Worker::progress_at`] run by a thread that waits to read stream `reader`: the message
    /// of that stream the pass delivers first, if none waited before it, comes back here.
    pub(crate) fn progress_reading(
        &mut self,
        shared: &WorkerShared,
        recent: Option<Instant>,
        reader: u64,
    ) -> (usize, Option<Message>) {
        self.handoff.reader = Some(reader);
        let n = self.progress_at(shared, recent);
        self.handoff.reader = None;
        self.handoff.done = false;
        (n, self.handoff.message.take())
    }

    /// [`Worker::progress_at`] run by a thread that waits for the reply of RPC call `call`:
    /// the pass that sends it that reply ends there, like one that hands a reader its message.
    pub(crate) fn progress_calling(
        &mut self,
        shared: &WorkerShared,
        recent: Option<Instant>,
        call: u64,
    ) -> usize {
        self.handoff.call = Some(call);
        let n = self.progress_at(shared, recent);
        self.handoff.call = None;
        self.handoff.done = false;
        n
    }

    /// A progress pass on the clock already read (right after a direct operation).
    fn pass(&mut self, shared: &WorkerShared) -> usize {
        if shared.stopped.load(Ordering::Acquire) {
            return 0;
        }
        self.loops = self.loops.wrapping_add(1);
        let mut work = self.drain_inbox(shared);
        if shared.stopped.load(Ordering::Acquire) {
            return work;
        }
        work += self.poll_cq();
        if !self.awaiting.is_empty() {
            self.check_awaiting();
        }
        self.pump_dirty();
        if self.handoff.done() {
            // The thread running the pass has its message or its reply: the rest (timers, the
            // connections left for later) waits for the next pass, soon (see `pump_channel`).
            shared.publish_next_rx(self.next_rx);
            return work;
        }
        // Timers (acks, deadlines: tens of microseconds and up) are looked at on every pass that
        // did work and on every 64th idle one (an idle pass takes well under a microsecond),
        // which keeps clock reads off the spin loop.
        if work > 0 || self.loops % 64 == 0 {
            work += self.fire_timers();
            self.pump_dirty();
        }
        self.post_deferred();
        shared.set_lingering(self.lingering > 0);
        if work == 0 && self.loops % 1024 == 0 {
            // Busy for a while: look at the control streams without sleeping.
            let keys = epoll_wait(&shared.epoll, Some(Duration::ZERO));
            self.handle_epoll(&keys);
        }
        if self.stopping {
            self.stop_when_delivered(shared);
        }
        self.nudge_sleeper(shared);
        shared.publish_next_rx(self.next_rx);
        work
    }

    /// A thread sleeps in the worker's epoll (the worker thread, or a caller-mode back-stop)
    /// until a time this thread's work just moved earlier (a timer armed for a connection it
    /// adopted, an ack due after its send): wake it, so the timer fires on time.
    pub(crate) fn nudge_sleeper(&self, shared: &WorkerShared) {
        let until = shared.sleep_until_ns.load(Ordering::Relaxed);
        if until == 0 {
            return;
        }
        if self
            .timers
            .next_deadline()
            .is_some_and(|t| t.as_nanos() < until)
        {
            shared.wake();
        }
    }

    /// Handle queued commands (before a direct operation, so a thread's earlier commands keep
    /// their order).
    pub(crate) fn drain_inbox(&mut self, shared: &WorkerShared) -> usize {
        let mut work = 0;
        while let Some(cmd) = shared.pop() {
            work += 1;
            if !self.command(cmd) {
                self.stopping = true;
                self.end_all_but_closing();
            }
        }
        if self.stopping {
            self.stop_when_delivered(shared);
        }
        work
    }

    /// Stopping: once no connection is still delivering what was sent before its close, end
    /// the rest and stop the worker.
    fn stop_when_delivered(&mut self, shared: &WorkerShared) {
        if self.conns.values().all(|st| st.closing.is_none()) {
            self.shutdown();
            shared.stopped.store(true, Ordering::Release);
        }
    }

    /// Direct send from an application thread (the inbox drained first). When nothing waits
    /// ahead of it on the connection, the message goes to the core and is posted at once,
    /// without the backlog and the connection's pump; true when that left nothing for a pass
    /// to do (the message is on the wire, the core has no event and no queued message).
    // Inlined into its two callers (a channel's send, an RPC call): out of line, the channel's
    // send path ran ≈ 45 more instructions per message (`bench/instructions.sh`).
    #[inline(always)]
    pub(crate) fn enqueue_send(&mut self, chan: StreamKey, buf: OutBuf, trace: TraceInfo) -> bool {
        let id = key_conn(chan);
        let stream = key_stream(chan);
        let now = self.clock.get(now);
        let Worker {
            conns,
            buffers,
            timers,
            ..
        } = self;
        // One look-up of the connection and one of the stream on the message's path.
        let Some(st) = conns
            .get_mut(&id)
            .filter(|st| st.backlog.is_empty() && st.failed.is_none())
        else {
            self.command_send(chan, buf, trace);
            return false;
        };
        let ConnState {
            streams, driver, ..
        } = &mut *st;
        let Some(ss) = streams.get_mut(&stream).filter(|ss| !ss.peer_closed) else {
            self.command_send(chan, buf, trace);
            return false;
        };
        let trace = TraceInfo { stream, ..trace };
        let offered = offer_to(driver, Some(ss), buffers, buf, trace);
        if let Offered::Later(buf, trace) = offered {
            st.backlog.push_back((buf, trace));
        }
        st.driver.pump(now, &mut &**buffers);
        // The sends the peer acknowledged (a reader that answers left them for here: see
        // `pump_channel`), after this one is out.
        while let Some(CoreEvent::SendComplete {
            payload,
            stream,
            flags,
            ..
        }) = st.driver.poll_send_complete()
        {
            st.send_complete(buffers, payload, stream, flags);
        }
        st.arm_timer(id, timers);
        let settled = st.backlog.is_empty()
            && !st.driver.has_events()
            && st.driver.core().outstanding_queued() == 0;
        if !settled {
            self.mark_dirty(id);
        }
        settled
    }

    /// Messages the application of stream `chan` consumed open the peer's stream window: the
    /// count rides on the stream's next message, or goes alone once a quarter window is owed.
    fn take_released(&mut self, chan: StreamKey) {
        let Some(st) = self.conns.get_mut(&key_conn(chan)) else {
            return;
        };
        let stream = key_stream(chan);
        let Some(ss) = st.streams.get_mut(&stream) else {
            return;
        };
        let owed = u64::from(ss.to_report) + ss.shared.take_released();
        ss.to_report = owed.min(u32::MAX.into()) as u32;
        if owed >= ss.shared.report_every && !ss.report_queued && !ss.peer_closed {
            ss.report_queued = true;
            st.queue_stream_control(&self.buffers, stream, TraceFlags::STREAM_CREDIT);
            self.mark_dirty(key_conn(chan));
        }
    }

    /// Direct release from an application thread that got the lock: the credits go back and
    /// the connection is pumped at once (a credit update the peer waits for leaves now).
    pub(crate) fn release_now(&mut self, chan: StreamKey) {
        self.clock.begin();
        self.take_released(chan);
        self.pump_dirty();
    }

    /// Direct stream open from an application thread (the inbox drained first).
    pub(crate) fn enqueue_open(
        &mut self,
        conn: u32,
        stream: u32,
        shared: Arc<ChannelShared>,
        announce: bool,
    ) {
        self.open_stream(conn, stream, shared, announce);
    }

    /// Direct close of a stream whose last handle an application thread dropped (caller
    /// mode: nobody may come by soon to take a queued close).
    pub(crate) fn enqueue_close(&mut self, chan: StreamKey) {
        self.close_stream(chan);
    }

    /// Direct close of a connection whose last channel an application thread dropped.
    pub(crate) fn enqueue_close_conn(&mut self, conn: u32) {
        self.close_conn(conn);
    }

    /// Direct RPC call from an application thread (the inbox drained first): the call is
    /// registered (its reply, its deadline) and its request goes out as a direct send
    /// ([`Worker::enqueue_send`]); true when that left nothing for a pass to do.
    pub(crate) fn enqueue_call(&mut self, call: Call) -> bool {
        match self.register_call(call) {
            Some((chan, buf, trace)) => self.enqueue_send(chan, buf, trace),
            None => true,
        }
    }

    /// Direct one-sided operation from an application thread.
    pub(crate) fn enqueue_one_sided(
        &mut self,
        chan: StreamKey,
        op: OneSidedOp,
        reply: OneSidedReply,
        deadline: Instant,
    ) {
        self.command_one_sided(chan, op, reply, deadline);
    }

    /// Protocol counters of the connection carrying a stream.
    pub(crate) fn stats(&self, chan: StreamKey) -> Option<crate::channel::ChannelStats> {
        self.conns
            .get(&key_conn(chan))
            .filter(|c| c.streams.contains_key(&key_stream(chan)))
            .map(|c| c.driver.core().stats())
    }

    /// The time of this pass: the clock is read once per pass (a pass takes microseconds; the
    /// protocol's timers are tens of microseconds and up), not per completion and channel.
    fn clock(&mut self) -> Instant {
        self.clock.get(now)
    }

    /// On the way to sleep: if the buffers hold memory a reclaim could give back
    /// ([`Buffers::needs_reclaim`]), reclaim it once the worker has been quiet for
    /// `reclaim_after` — unless a reclaim is armed already. The timer wakes the sleeper; the
    /// next sleep arms it again while there is more to give back (or when the worker was busy
    /// in between, which skips the reclaim), so a worker holding no more than its pool's idle
    /// mark sleeps without a timer.
    pub(crate) fn arm_reclaim(&mut self) {
        if self.reclaim_armed.is_some()
            || self.reclaim_after.is_zero()
            || !self.buffers.needs_reclaim()
        {
            return;
        }
        let at = now().saturating_add(self.reclaim_after);
        self.timers.insert(at, (at, Timer::Reclaim));
        self.reclaim_armed = Some(self.busy_polls);
    }

    /// Arm the CQ before sleeping; false when the CQ has no event fd.
    fn arm_cq(&mut self) -> bool {
        self.has_cq_events && self.cq.req_notify(false).is_ok()
    }

    fn ack_cq_events(&mut self) {
        let _ = self.cq.ack_events();
    }

    /// The earliest timer's deadline.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.timers.next_deadline()
    }

    /// Handle what epoll reported: control streams that became readable. True when a peer
    /// nudged (a whole pass should follow: `Worker::nudge_peer`).
    fn handle_epoll(&mut self, keys: &[u64]) -> bool {
        let mut nudged = false;
        for &key in keys {
            if key & EPOLL_CONTROL != 0 {
                let id = (key & 0xFFFF_FFFF) as u32;
                nudged |= self.check_control(id);
            }
        }
        nudged
    }

    fn poll_cq(&mut self) -> usize {
        let mut wcs = std::mem::take(&mut self.wcs);
        let n = match self.cq.poll(&mut wcs) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(%e, "completion queue failed");
                let ids: Vec<u32> = self.conns.keys().copied().collect();
                for id in ids {
                    self.fail_conn(id, Failure::Error(format!("completion queue: {e}")));
                }
                self.wcs = wcs;
                return 0;
            }
        };
        if n > 0 {
            self.busy_polls = self.busy_polls.wrapping_add(1);
            let now = self.clock();
            for wc in wcs.iter().take(n) {
                self.completion(now, wc);
            }
        }
        self.wcs = wcs;
        n
    }

    fn completion(&mut self, now: Instant, wc: &WorkCompletion) {
        let id = wc.qp_num.0;
        let Some(st) = self.conns.get_mut(&id) else {
            // A completion for a channel being adopted: kept until it arrives.
            let list = self.orphans.entry(id).or_default();
            if list.len() < MAX_ORPHANS {
                list.push(*wc);
            }
            return;
        };
        if wc.wr_id >> 56 == WR_ONE_SIDED {
            if !one_sided_done(st, &self.buffers, wc) {
                return;
            }
        } else {
            st.driver.handle_completion(now, wc);
            self.next_rx = st.driver.next_rx_addr();
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
            Command::Adopt(a) => self.adopt(*a),
            Command::OpenStream {
                conn,
                stream,
                shared,
                announce,
            } => self.open_stream(conn, stream, shared, announce),
            Command::Send { chan, buf, trace } => self.command_send(chan, buf, trace),
            Command::Released { chan } => self.take_released(chan),
            Command::Call(call) => self.command_call(*call),
            Command::OneSided {
                chan,
                op,
                reply,
                deadline,
            } => self.command_one_sided(chan, op, reply, deadline),
            Command::SetThresholds { chan, thresholds } => {
                if let Some(st) = self.conns.get_mut(&key_conn(chan)) {
                    if let Err(e) = st.driver.core_mut().set_thresholds(thresholds) {
                        tracing::warn!(%e, "thresholds refused");
                    }
                }
            }
            Command::Close { chan } => self.close_stream(chan),
            Command::CloseConn { conn } => self.close_conn(conn),
            Command::Shutdown => return false,
        }
        true
    }

    pub(crate) fn adopt(&mut self, a: Adopt) {
        let Adopt {
            driver,
            mut control,
            lease,
            accept,
            failed,
            refusing,
            peer,
            eager_max,
            stream_window,
            max_streams,
            admission,
            first_stream,
            ready_within,
        } = a;
        let id = driver.qp().qp_num().0;
        // A QP comes back from the cache under the same number: an entry of its previous
        // connection (not yet swept) must not time the new one out.
        self.awaiting.retain(|&(other, _)| other != id);
        if driver.awaiting_peer() {
            let due = now().saturating_add(ready_within);
            self.awaiting.push((id, due));
            self.timers.insert(due, (due, Timer::ReadyDue));
        }
        let window = u64::from(driver.core().config().max_queued);
        let mut streams = FxHashMap::default();
        if let Some(shared) = first_stream {
            shared.set_window(window);
            streams.insert(streams::FIRST_STREAM, StreamState::new(shared));
        }
        // Connecting side: the handshake's `Ready`, left to the adopting thread
        // (`PendingConn::finish_connecting`); a peer gone already fails the connection below.
        let ready_sent = control.as_mut().map_or(true, |c| c.send_ready());
        if let Some(c) = &control {
            let _ = c.set_nonblocking(true);
            for ep in std::iter::once(&self.epoll).chain(&self.control_epoll) {
                let _ = epoll::add(
                    ep,
                    c.as_fd(),
                    epoll::EventData::new_u64(EPOLL_CONTROL | u64::from(id)),
                    epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
                );
            }
        }
        self.conns.insert(
            id,
            ConnState {
                driver,
                backlog: VecDeque::new(),
                waiting_calls: FxHashMap::default(),
                streams,
                one_sided_queue: VecDeque::new(),
                one_sided: FxHashMap::default(),
                deadline_at: None,
                control,
                lease,
                accept,
                failed_flag: failed,
                refusing,
                peer,
                eager_max,
                stream_window,
                max_streams,
                _admission: admission,
                timer_at: None,
                failed: None,
                closing: None,
                nudge: None,
            },
        );
        if let Some(list) = self.orphans.remove(&id) {
            let now = now();
            for wc in list {
                self.completion(now, &wc);
            }
        }
        self.mark_dirty(id);
        if !ready_sent {
            self.fail_conn(id, Failure::PeerGone);
        }
    }

    /// Connecting side: a new stream on `conn`; its `STREAM_OPEN` (if `announce`) goes out in
    /// order before anything sent on it.
    fn open_stream(&mut self, conn: u32, stream: u32, shared: Arc<ChannelShared>, announce: bool) {
        let Some(st) = self.conns.get_mut(&conn) else {
            shared.fail(Failure::Closed);
            return;
        };
        if let Some(f) = &st.failed {
            shared.fail(f.clone());
            return;
        }
        shared.set_window(u64::from(st.driver.core().config().max_queued));
        if announce {
            st.queue_stream_control(&self.buffers, stream, TraceFlags::STREAM_OPEN);
        }
        st.streams.insert(stream, StreamState::new(shared));
        self.mark_dirty(conn);
    }

    /// The connecting side's last channel on a connection went. What it sent before still
    /// arrives: the connection stays, unused, until every message is acknowledged and every
    /// one-sided operation done (or the connection fails), at the latest `close_linger`; then
    /// it closes (control `Close`, the QP back to the cache). Like a TCP close, which delivers
    /// what was written before it.
    fn close_conn(&mut self, id: u32) {
        if self.linger(id) {
            return;
        }
        self.fail_conn(id, Failure::Closed);
        if let Some(st) = self.remove_conn(id) {
            self.retire(st);
        }
    }

    /// Take connection `id` out of the worker (its lingering, if it did, ends).
    fn remove_conn(&mut self, id: u32) -> Option<ConnState> {
        let st = self.conns.remove(&id)?;
        if st.closing.is_some() {
            self.lingering -= 1;
        }
        Some(st)
    }

    /// True when connection `id` closes later (`ConnState::closing`): it was closing already,
    /// or it still has something on its way and a linger is configured (then it starts now:
    /// the linger's timer is armed and its pump delivers the rest).
    fn linger(&mut self, id: u32) -> bool {
        let linger = self.close_linger;
        let now = self.clock();
        let Some(st) = self.conns.get_mut(&id) else {
            return false;
        };
        if st.closing.is_some() {
            return true;
        }
        if linger.is_zero() || st.is_failed() || st.flushed() {
            return false;
        }
        let until = now.saturating_add(linger);
        st.closing = Some(until);
        self.lingering += 1;
        self.timers.insert(until, (until, Timer::Linger(id)));
        self.mark_dirty(id);
        true
    }

    /// The application dropped a stream: its calls end, the credits of messages it never read
    /// return to the connection, and the peer learns with `STREAM_CLOSE` (after the stream's
    /// queued messages).
    fn close_stream(&mut self, chan: StreamKey) {
        let conn = key_conn(chan);
        let Some(st) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(ss) = st.streams.remove(&key_stream(chan)) else {
            return;
        };
        for (_, c) in ss.calls {
            c.answer(Err(RpcError::PeerGone));
        }
        st.waiting_calls.remove(&key_stream(chan));
        ss.shared.fail(Failure::Closed);
        // Unread messages already returned their connection credit when they arrived.
        ss.shared.discard();
        if !st.is_failed() && !ss.peer_closed {
            st.queue_stream_control(&self.buffers, key_stream(chan), TraceFlags::STREAM_CLOSE);
        }
        if st.retire_now() {
            if let Some(st) = self.remove_conn(conn) {
                self.retire(st);
            }
            return;
        }
        self.mark_dirty(conn);
    }

    fn command_send(&mut self, chan: StreamKey, buf: OutBuf, mut trace: TraceInfo) {
        let Some(st) = self.conns.get_mut(&key_conn(chan)) else {
            return;
        };
        let Some(ss) = st.streams.get(&key_stream(chan)) else {
            return;
        };
        if st.failed.is_some() || ss.peer_closed {
            ss.shared.send_progress(1, buf.len() as u64);
            return;
        }
        trace.stream = key_stream(chan);
        st.backlog.push_back((buf, trace));
        self.mark_dirty(key_conn(chan));
    }

    fn command_call(&mut self, call: Call) {
        if let Some((chan, buf, trace)) = self.register_call(call) {
            if let Some(st) = self.conns.get_mut(&key_conn(chan)) {
                st.backlog.push_back((buf, trace));
                self.mark_dirty(key_conn(chan));
            }
        }
    }

    /// Keep the reply channel of `call` and arm its deadline; the request to send (its
    /// stream, buffer and trace), or `None`: the stream or its connection is gone (the caller
    /// told `PeerGone`), or the stream has a window of calls out and the request waits for
    /// one of their replies (`release_calls`).
    fn register_call(&mut self, call: Call) -> Option<(StreamKey, OutBuf, TraceInfo)> {
        let Call {
            chan,
            call_id,
            buf,
            deadline,
            reply,
        } = call;
        let Some(st) = self.conns.get_mut(&key_conn(chan)) else {
            let _ = reply.send(Err(RpcError::PeerGone));
            return None;
        };
        let failed = st.is_failed();
        let Some(ss) = st.streams.get_mut(&key_stream(chan)) else {
            let _ = reply.send(Err(RpcError::PeerGone));
            return None;
        };
        if failed || ss.peer_closed {
            // Why the stream stopped, as a call made before it did is told: a stream the peer
            // refused says so, not that the peer went (the call may have been checked before
            // the refusal arrived and queued until after).
            let why = ss.shared.failure();
            let _ = reply.send(Err(why.map_or(RpcError::PeerGone, |f| f.to_rpc_error())));
            return None;
        }
        // At the window the request waits (a reply of the stream lets it go: `release_calls`).
        let waiting = u64::from(ss.calls_out) >= ss.shared.stream_window();
        ss.calls.insert(
            call_id,
            PendingCall {
                reply: Some(reply),
                deadline,
                waiting,
            },
        );
        let out = if waiting {
            st.waiting_calls
                .entry(key_stream(chan))
                .or_default()
                .push_back((call_id, buf));
            None
        } else {
            ss.calls_out += 1;
            ss.shared.count_in(buf.len() as u64);
            Some((chan, buf, request_trace(call_id, key_stream(chan))))
        };
        st.arm_deadline(key_conn(chan), deadline, &mut self.timers);
        out
    }

    // Not inlined into the command dispatch every pass's inbox drain runs.
    #[inline(never)]
    fn command_one_sided(
        &mut self,
        chan: StreamKey,
        op: OneSidedOp,
        reply: OneSidedReply,
        deadline: Instant,
    ) {
        match self.conns.get_mut(&key_conn(chan)) {
            Some(st) if st.failed.is_none() => {
                st.arm_deadline(key_conn(chan), deadline, &mut self.timers);
                let q = OneSidedQueued {
                    op,
                    reply,
                    deadline,
                };
                if st.one_sided_queue.is_empty() && (st.one_sided.len() as u32) < ONE_SIDED_DEPTH {
                    // Nothing waits before it and the send queue has room: posted now, without
                    // a pump of the connection; the pass's poll of the CQ reaps it.
                    post_one(st, &self.buffers, &mut self.next_one_sided, q);
                    return;
                }
                st.one_sided_queue.push_back(q);
            }
            Some(st) => {
                let err = st
                    .failed
                    .as_ref()
                    .map_or(ChannelError::Closed, |f| f.to_error());
                let _ = reply.send(Err(err));
            }
            None => {
                let _ = reply.send(Err(ChannelError::Closed));
            }
        }
        self.mark_dirty(key_conn(chan));
    }

    fn shutdown(&mut self) {
        let ids: Vec<u32> = self.conns.keys().copied().collect();
        for id in ids {
            self.fail_conn(id, Failure::Closed);
        }
        self.conns.clear();
        self.lingering = 0;
    }

    /// The endpoint is gone: a connection with messages or one-sided operations still on their
    /// way (either side's: an accepted one too) closes like one whose last channel went,
    /// delivering them first, at most `close_linger`; every other connection ends now.
    fn end_all_but_closing(&mut self) {
        let ids: Vec<u32> = self.conns.keys().copied().collect();
        for id in ids {
            if !self.linger(id) {
                self.fail_conn(id, Failure::Closed);
                self.remove_conn(id);
            }
        }
    }

    /// A connection failed (or closes): every stream on it, its calls and one-sided operations
    /// end with `why`; the pool stops handing it out. Streams stay until the application drops
    /// them (it may still read what was delivered).
    fn fail_conn(&mut self, id: u32, why: Failure) {
        let Some(st) = self.conns.get_mut(&id) else {
            return;
        };
        if st.failed.is_some() {
            return;
        }
        st.failed = Some(why.clone());
        st.failed_flag.store(true, Ordering::Release);
        if let Failure::Protocol(what) = &why {
            tracing::warn!(conn = id, peer = %st.peer, %what, "the peer broke the protocol");
            self.common.guard.protocol_violation();
        }
        let call_err = || match &why {
            Failure::Error(s) => RpcError::Channel(ChannelError::Failed(s.clone())),
            Failure::Protocol(s) => RpcError::Channel(ChannelError::Protocol(s.clone())),
            Failure::TooLarge { .. } => RpcError::Channel(why.to_error()),
            _ => RpcError::PeerGone,
        };
        for ss in st.streams.values_mut() {
            for (_, c) in ss.calls.drain() {
                c.answer(Err(call_err()));
            }
            ss.shared.fail(why.clone());
        }
        st.waiting_calls.clear();
        // Answered now; their buffers stay until each completes (flushed, at the latest) or the
        // QP is drained (`Worker::retire`): a READ's data may still land in one, a WRITE may
        // still be reading one.
        for p in st.one_sided.values_mut() {
            if let Some(reply) = p.reply.take() {
                let _ = reply.send(Err(why.to_error()));
            }
        }
        for q in st.one_sided_queue.drain(..) {
            let _ = q.reply.send(Err(why.to_error()));
        }
        st.backlog.clear();
        if let Some(c) = st.control.take() {
            for ep in std::iter::once(&self.epoll).chain(&self.control_epoll) {
                let _ = epoll::delete(ep, c.as_fd());
            }
        }
        if !st.driver.core().is_failed() {
            st.driver.core_mut().handle_fatal(ChannelError::Closed);
        }
        if st.retire_now() {
            if let Some(st) = self.remove_conn(id) {
                self.retire(st);
            }
        }
    }

    fn fire_timers(&mut self) -> usize {
        let Some(first) = self.timers.next_deadline() else {
            return 0;
        };
        let now = self.clock();
        if first > now {
            return 0;
        }
        let mut due = std::mem::take(&mut self.fired);
        self.timers.poll(now, |_, entry| due.push(entry));
        let fired = due.len();
        for (t, timer) in due.drain(..) {
            match timer {
                Timer::Channel(id) => {
                    if let Some(st) = self.conns.get_mut(&id) {
                        if st.timer_at == Some(t) {
                            st.timer_at = None;
                        }
                        st.driver.core_mut().handle_timeout(now);
                        self.mark_dirty(id);
                    }
                }
                Timer::ReadyDue => {}
                Timer::Reclaim => {
                    // Only a worker that stayed quiet since it armed the timer reclaims (a few
                    // polls found completions: a lone message, a peer's keepalive):
                    // deregistering costs, and a busy worker's frees come back by themselves.
                    // A busy one arms it again at its next sleep.
                    let armed = self.reclaim_armed.take().unwrap_or(0);
                    if self.busy_polls.wrapping_sub(armed) <= RECLAIM_QUIET_POLLS {
                        self.buffers.reclaim_here();
                    }
                }
                Timer::Nudge(id) => self.nudge_peer(id, now, Some(t)),
                Timer::Linger(id) => {
                    if self.conns.get(&id).is_some_and(|st| st.closing == Some(t)) {
                        tracing::debug!(
                            conn = id,
                            "closing connection: linger over, closed with messages unacknowledged"
                        );
                        // `closing` set: failing it retires it.
                        self.fail_conn(id, Failure::Closed);
                    }
                }
                Timer::Deadlines(id) => {
                    if let Some(st) = self.conns.get_mut(&id) {
                        // A later timer than the one armed last is stale: that one expires.
                        if st.deadline_at == Some(t) {
                            st.deadline_at = None;
                            if let Some(next) = st.expire(now) {
                                st.arm_deadline(id, next, &mut self.timers);
                            }
                        }
                    }
                }
            }
        }
        self.fired = due;
        fired
    }

    fn pump_dirty(&mut self) {
        while let Some(id) = self.dirty.pop() {
            self.pump_channel(id, true);
        }
    }

    /// Post the receive slots that connections left for later in an earlier pass (see
    /// `pump_channel`), unless they left some in this one too (the next pass comes soon: a
    /// reader that just got a message is about to answer it or ask for the next).
    fn post_deferred(&mut self) {
        if self.deferred_before.is_empty() && self.deferred_now.is_empty() {
            return;
        }
        let mut before = std::mem::take(&mut self.deferred_before);
        for id in before.drain(..) {
            if !self.deferred_now.contains(&id) {
                self.pump_channel(id, false);
            }
        }
        self.deferred_before = std::mem::replace(&mut self.deferred_now, before);
    }

    /// Events, backlog, one-sided operations and work requests of connection `id`. With
    /// `defer`, a round that delivered a message leaves the receive slots to repost for a later
    /// pass (their credits stay withheld; the core decides how many may wait).
    fn pump_channel(&mut self, id: u32, defer: bool) {
        let now = self.clock();
        let Worker {
            me,
            conns,
            buffers,
            common,
            timers,
            next_one_sided,
            handoff,
            deferred_now,
            ..
        } = self;
        let Some(st) = conns.get_mut(&id) else {
            return;
        };
        let mut newly_failed = None;
        let mut delivered = false;
        for _round in 0..64 {
            let mut progress = 0usize;
            // Events first: a delivered message reaches its reader before the housekeeping of
            // the round (reposting the slot, acks), which is off the message's path.
            let mut events = 0usize;
            while let Some(ev) = st.driver.poll_event() {
                events += 1;
                match ev {
                    CoreEvent::Received {
                        seq,
                        trace,
                        stream,
                        stream_credits,
                        payload,
                    } => {
                        delivered = true;
                        let msg = Arrival {
                            seq,
                            trace,
                            stream,
                            stream_credits,
                            payload,
                        };
                        if let Err(e) = on_received(st, me, buffers, common, handoff, msg) {
                            // Nothing more of this peer is delivered; the core's `Error`
                            // follows.
                            st.driver.core_mut().handle_violation(e);
                        }
                        if defer && handoff.done() && !st.driver.core().has_deliveries() {
                            // The reader has its message (the caller its reply) and nothing
                            // else arrived: the
                            // completions of sends wait for the next pump (see below).
                            break;
                        }
                    }
                    CoreEvent::SendComplete {
                        payload,
                        stream,
                        flags,
                        ..
                    } => st.send_complete(buffers, payload, stream, flags),
                    CoreEvent::Writable => {
                        for ss in st.streams.values() {
                            ss.shared.send_progress(0, 0);
                        }
                    }
                    CoreEvent::Error(e) => {
                        let why = match &e {
                            ChannelError::Completion { status, .. } if peer_gone(*status) => {
                                Failure::PeerGone
                            }
                            ChannelError::Closed => Failure::Closed,
                            ChannelError::Protocol(what) => Failure::Protocol(what.clone()),
                            &ChannelError::MessageTooLarge { len, max } => {
                                Failure::TooLarge { len, max }
                            }
                            other => Failure::Error(other.to_string()),
                        };
                        newly_failed = Some(why);
                    }
                }
            }
            progress += events;
            // The thread running this pass was handed the message it waits for: it leaves with
            // it now, and the rest of the round (reposts, a due ack, the backlog, the timer)
            // is the next pass's — for a reader that answers, the pump of its send, which
            // posts the answer first.
            if defer && handoff.done() && newly_failed.is_none() {
                if !deferred_now.contains(&id) {
                    deferred_now.push(id);
                }
                return;
            }
            // Backlog into the core, in order; each message carries its stream's window report.
            while let Some((buf, trace)) = st.backlog.pop_front() {
                match st.offer(buffers, buf, trace) {
                    Offered::Queued => progress += 1,
                    Offered::Dropped => {}
                    Offered::Later(buf, trace) => {
                        st.backlog.push_front((buf, trace));
                        break;
                    }
                }
            }
            let backlog_moved = progress > events;
            let one_sided = post_one_sided(st, buffers, next_one_sided);
            progress += one_sided;
            progress += if defer && delivered {
                st.driver.pump_deferring(now, &mut &**buffers)
            } else {
                st.driver.pump(now, &mut &**buffers)
            };
            if newly_failed.is_some() {
                break;
            }
            if progress == 0 {
                // A pump that failed the core (a refused post, a message no memory will ever
                // hold) did nothing else, but left the failure's event: the next round takes
                // it, instead of whichever pump of this connection comes next, if any does.
                if st.driver.core().is_failed() && st.driver.has_events() {
                    continue;
                }
                break;
            }
            // Another round only for what this one may have left: events (a reply's error, a
            // window that opened), a backlog that moved but is not empty (an RPC reply queued
            // by a handler), one-sided operations beyond the depth.
            let again = st.driver.has_events()
                || (backlog_moved && !st.backlog.is_empty())
                || (one_sided > 0 && !st.one_sided_queue.is_empty());
            if !again {
                break;
            }
        }
        st.arm_timer(id, timers);
        let left = st.driver.reposts_pending() > 0;
        let closing = st.closing.is_some();
        let closed = closing && st.flushed();
        let first_nudge = closing && st.nudge.is_none() && st.accept.is_none();
        if let Some(why) = newly_failed {
            self.fail_conn(id, why);
        } else if closed {
            // A closing connection delivered the last of what it had: it closes now
            // (`closing` set: failing it retires it).
            self.fail_conn(id, Failure::Closed);
        } else {
            if left && !self.deferred_now.contains(&id) {
                self.deferred_now.push(id);
            }
            if first_nudge {
                // What the close queued (the streams' `STREAM_CLOSE`) was posted above.
                self.nudge_peer(id, now, None);
            }
        }
    }

    /// A closing connection (connecting side) waits for its peer's acknowledgements: ask the
    /// peer to progress now ([`ControlStream::nudge`]; `due`: `None`), and again from the
    /// timer this arms (`due`: the instant it was armed for), at doubling intervals, while the
    /// connection still waits. A peer in caller mode whose application called in moments ago
    /// and then stopped would otherwise read what this side sent — and acknowledge it — only
    /// when its back-stop's grace runs out (10–20 ms); the nudge comes to its back-stop, which
    /// watches the control streams meanwhile. Later nudges cover a peer that read the first
    /// before the data it was about (the data path and the control stream are not ordered with
    /// each other), and a nudge the socket could not take.
    fn nudge_peer(&mut self, id: u32, now: Instant, due: Option<Instant>) {
        let Some(st) = self.conns.get_mut(&id) else {
            return;
        };
        if st.closing.is_none() || st.is_failed() {
            return;
        }
        let every = match (st.nudge, due) {
            (None, None) => NUDGE_FIRST,
            (Some((at, every)), Some(t)) if at == t => (every * 2).min(NUDGE_MAX),
            // A timer of an earlier connection on this QP, or a first nudge gone already.
            _ => return,
        };
        if let Some(c) = st.control.as_mut() {
            c.nudge();
        }
        let at = now.saturating_add(every);
        st.nudge = Some((at, every));
        self.timers.insert(at, (at, Timer::Nudge(id)));
    }

    /// A control stream became readable: the peer closed its end, or vanished, or its `Ready`
    /// or a nudge came. True for a nudge: the peer's close waits for this side's progress.
    fn check_control(&mut self, id: u32) -> bool {
        let Some(st) = self.conns.get_mut(&id) else {
            return false;
        };
        let Some(c) = st.control.as_mut() else {
            return false;
        };
        let event = c.poll_peer();
        let nudged = c.take_nudge();
        if c.take_ready() {
            st.driver.set_peer_ready();
            self.mark_dirty(id);
        }
        match event {
            ControlEvent::Open => {}
            ControlEvent::PeerClosed | ControlEvent::Gone => self.fail_conn(id, Failure::PeerGone),
        }
        nudged
    }

    /// Accepted connections waiting for the peer's `Ready`: read their control streams (a
    /// non-blocking read each), and fail those whose peer let the handshake's time pass.
    fn check_awaiting(&mut self) {
        let now = self.clock();
        let mut i = 0;
        while let Some(&(id, deadline)) = self.awaiting.get(i) {
            // A connection that is gone or failed has no control stream left: nothing is read.
            self.check_control(id);
            let still = self
                .conns
                .get(&id)
                .is_some_and(|st| !st.is_failed() && st.driver.awaiting_peer());
            if still && now >= deadline {
                self.fail_conn(
                    id,
                    Failure::Error("the peer did not finish the handshake in time".into()),
                );
            }
            if still && now < deadline {
                i += 1;
            } else {
                self.awaiting.swap_remove(i);
            }
        }
    }

    /// A closed connection leaves the worker: its QP is stopped and drained of every completion
    /// it still owes (completions of other QPs polled meanwhile are handled), then goes back to
    /// the connection manager's cache; the driver (ring, buffers in flight) is dropped in
    /// between.
    fn retire(&mut self, st: ConnState) {
        let ConnState {
            driver,
            control,
            lease,
            ..
        } = st;
        if let Some(c) = &control {
            for ep in std::iter::once(&self.epoll).chain(&self.control_epoll) {
                let _ = epoll::delete(ep, c.as_fd());
            }
        }
        drop(control);
        match lease {
            Some(lease) => {
                let mut others = Vec::new();
                let drained = lease.drain(&self.cq, RETIRE_DRAIN_LIMIT, &mut others);
                if drained {
                    // Nothing posted can complete into the ring or header slots any more: they
                    // serve the next connection (the QP's other handles go with the driver).
                    lease.keep_regions(driver.into_regions());
                    lease.release();
                } else {
                    drop(driver);
                }
                let now = now();
                for wc in &others {
                    self.completion(now, wc);
                }
            }
            None => {
                let _ = driver.qp().modify(&fabriq_verbs::QpAttr::error());
            }
        }
    }
}

/// A message's payload made of `parts`: held in place when it is small, else copied into a
/// registered buffer.
pub(crate) fn alloc_filled(
    buffers: &Buffers,
    parts: &[&[u8]],
) -> Result<OutBuf, crate::mempool::PoolError> {
    if let Some(s) = SmallBuf::from_parts(parts) {
        return Ok(OutBuf::Small(s));
    }
    alloc_registered(buffers, parts).map(OutBuf::Pool)
}

/// `parts` copied into one registered buffer.
pub(crate) fn alloc_registered(
    buffers: &Buffers,
    parts: &[&[u8]],
) -> Result<PoolBuf, crate::mempool::PoolError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut buf = buffers.alloc(len.max(1))?;
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

/// A received payload as the application's, with where a large pooled buffer goes back to
/// once read (other threads return those to this worker).
fn into_payload(
    payload: Received<PoolBuf>,
    pool: &Buffers,
) -> (Payload, Option<Arc<SegQueue<PoolBuf>>>) {
    match payload {
        Received::Eager(v) => (Payload::Eager(v), None),
        Received::Rendezvous { mut buf, len } => {
            buf.set_len(usize::try_from(len).unwrap_or(0).min(buf.capacity()));
            let recycle = buf.is_large().then(|| Arc::clone(pool.returned()));
            (Payload::Pool(buf), recycle)
        }
    }
}

/// Requests that waited for room in their stream's call window, as far as it opened now, to
/// the connection's backlog, in order.
fn release_calls(
    ss: &mut StreamState,
    stream: u32,
    waiting_calls: &mut FxHashMap<u32, VecDeque<(u64, OutBuf)>>,
    backlog: &mut VecDeque<(OutBuf, TraceInfo)>,
) {
    let Some(waiting) = waiting_calls.get_mut(&stream) else {
        return;
    };
    let window = ss.shared.stream_window();
    while u64::from(ss.calls_out) < window {
        let Some((call_id, buf)) = waiting.pop_front() else {
            break;
        };
        let Some(call) = ss.calls.get_mut(&call_id) else {
            continue;
        };
        call.waiting = false;
        ss.calls_out += 1;
        ss.shared.count_in(buf.len() as u64);
        backlog.push_back((buf, request_trace(call_id, stream)));
    }
    if waiting.is_empty() {
        waiting_calls.remove(&stream);
    }
}

/// The trace of call `call_id`'s request on `stream`.
fn request_trace(call_id: u64, stream: u32) -> TraceInfo {
    TraceInfo {
        trace_id: call_id,
        flags: TraceFlags(TraceFlags::RPC_REQUEST),
        stream,
        stream_credits: 0,
    }
}

/// `STREAM_OPEN`, `STREAM_CLOSE` or `STREAM_CREDIT`: the worker's own messages of a stream.
fn is_stream_control(flags: TraceFlags) -> bool {
    flags.0 & (TraceFlags::STREAM_OPEN | TraceFlags::STREAM_CLOSE | TraceFlags::STREAM_CREDIT) != 0
}

/// A message the core delivered, with its stream.
struct Arrival {
    seq: u64,
    trace: crate::channel::TraceHeader,
    stream: u32,
    stream_credits: u32,
    payload: Received<PoolBuf>,
}

/// Route a delivered message: stream control, an RPC request (its handler runs here, to
/// completion, and the reply is queued on the same stream), an RPC response, or data for the
/// stream's application queue. `Err`: the peer broke the stream protocol (the connection fails).
fn on_received(
    st: &mut ConnState,
    me: &Weak<WorkerShared>,
    pool: &Buffers,
    common: &Arc<EndpointShared>,
    handoff: &mut Handoff,
    msg: Arrival,
) -> Result<(), String> {
    let Arrival {
        seq,
        trace,
        stream,
        stream_credits,
        payload,
    } = msg;
    let flags = trace.flags;
    let rpc = flags.0 & (TraceFlags::RPC_REQUEST | TraceFlags::RPC_RESPONSE) != 0;
    if !rpc && !is_stream_control(flags) {
        // Data, the common case: one look-up of the stream. The slot's connection credit
        // returns now; the stream's window (reported as the application consumes) is what
        // holds back a sender this reader does not keep up with.
        st.driver.core_mut().handle_released(1);
        let Some(ss) = st.streams.get(&stream) else {
            tracing::debug!(stream, "message for an unknown stream dropped");
            return Ok(());
        };
        // The peer's window report for this stream rides on any of its messages.
        if stream_credits > 0 {
            ss.shared.peer_consumed(u64::from(stream_credits));
        }
        if ss.peer_closed {
            // Its messages were in flight when the stream closed here: dropped.
            tracing::debug!(stream, "message for a closed stream dropped");
            return Ok(());
        }
        let (payload, recycle) = into_payload(payload, pool);
        let m = Message {
            payload,
            trace,
            seq,
            recycle,
        };
        // The thread running this pass waits for this stream, and nothing waits before the
        // message: it is handed over without the delivery queue (its lock, twice).
        if handoff.reader == Some(ss.shared.id)
            && handoff.message.is_none()
            && ss.shared.nothing_waiting()
        {
            ss.shared
                .count_handed(ss.shared.window_units(m.len() as u64));
            handoff.message = Some(m);
            handoff.done = true;
        } else {
            // A sender keeps at most a window of units unconsumed (`try_reserve`), and the
            // application here consumed at least what this end reported: more waiting than
            // that is a peer that ignores the window, which would grow this queue without
            // bound. The connection fails (`ChannelError::Protocol`); the messages delivered
            // can still be read.
            if ss.shared.deliver(m) > ss.shared.stream_window() {
                return Err(format!(
                    "peer sent stream {stream} more than the {} unconsumed units its window allows",
                    ss.shared.stream_window()
                ));
            }
        }
        return Ok(());
    }
    // The peer's window report for this stream rides on any of its messages.
    if stream_credits > 0 {
        if let Some(ss) = st.streams.get(&stream) {
            ss.shared.peer_consumed(u64::from(stream_credits));
        }
    }
    if is_stream_control(flags) {
        st.driver.core_mut().handle_released(1);
        return on_stream_control(st, me, pool, &common.guard, stream, flags);
    }
    // One look-up of the stream for the rest (the core, the backlog and the stream are
    // separate parts of the connection's state).
    let ConnState {
        streams,
        driver,
        backlog,
        waiting_calls,
        ..
    } = st;
    driver.core_mut().handle_released(1);
    let Some(ss) = streams.get_mut(&stream).filter(|ss| !ss.peer_closed) else {
        // For a stream closed here (its messages were in flight) or never opened: dropped
        // (its slot's credit returned above).
        tracing::debug!(stream, "message for a closed stream dropped");
        return Ok(());
    };
    let (payload, recycle) = into_payload(payload, pool);
    let bytes: &[u8] = match &payload {
        Payload::Eager(v) => v,
        Payload::Pool(b) => b,
    };
    if flags.contains(TraceFlags::RPC_REQUEST) {
        // Run the handler here, to completion, and reply inline.
        let (call_id, method, body) = match rpcwire::decode_request(bytes) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(%e, "malformed RPC request dropped");
                return Ok(());
            }
        };
        // A caller keeps at most a window of calls out on a stream (`Worker::register_call`),
        // and this end counts a request as served once its reply went into the core: more
        // than a window here is a peer that ignores the window, whose replies would queue
        // here without bound while it withheld its credits.
        ss.serving += 1;
        if u64::from(ss.serving) > ss.shared.stream_window() {
            return Err(format!(
                "peer has more than the {} calls its window allows waiting on stream {stream}",
                ss.shared.stream_window()
            ));
        }
        let handler = common.handlers.read().get(&method).map(|(_, h)| h.clone());
        // A handler that panics fails its call, not the worker: the panic is caught here, and
        // the worker's other channels, and this one, go on. `AssertUnwindSafe`: nothing of the
        // worker is half-changed while a handler runs (the request is decoded and its slot
        // released before, the reply queued after).
        let (status, reply) = match handler {
            Some(Served::Inline(h)) => {
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(body))) {
                    Ok(Ok(r)) => (rpcwire::Status::Ok, r),
                    Ok(Err(e)) => (rpcwire::Status::HandlerError, e.into_bytes()),
                    Err(panic) => (
                        rpcwire::Status::HandlerError,
                        handler_panicked(method, &panic).into_bytes(),
                    ),
                }
            }
            Some(Served::Deferred(h)) => {
                // The reply goes out when the responder is used (its send takes this state
                // when it is free, or leaves a command for the next pass); a handler that
                // panics drops it, which answers the caller.
                let responder = Responder::new(
                    Arc::clone(&ss.shared),
                    Arc::clone(common),
                    call_id,
                    trace.trace_id,
                );
                if let Err(panic) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(body, responder)))
                {
                    handler_panicked(method, &panic);
                }
                if let (Payload::Pool(b), Some(_)) = (payload, recycle) {
                    pool.recycle(b);
                }
                return Ok(());
            }
            None => (
                rpcwire::Status::UnknownMethod,
                format!("method {method:#010x}").into_bytes(),
            ),
        };
        // Above the largest message, or without pool memory for it, the caller is told so by a
        // reply held in place.
        let max_len = ss.shared.max_len;
        match crate::rpc::reply_buf(pool, &common.guard, call_id, status, &reply, max_len).buf {
            Some(buf) => {
                ss.shared.count_in(buf.len() as u64);
                backlog.push_back((
                    buf,
                    TraceInfo {
                        trace_id: trace.trace_id,
                        flags: TraceFlags(TraceFlags::RPC_RESPONSE),
                        stream,
                        stream_credits: 0,
                    },
                ));
            }
            None => ss.serving -= 1,
        }
        if let (Payload::Pool(b), Some(_)) = (payload, recycle) {
            pool.recycle(b);
        }
    } else if flags.contains(TraceFlags::RPC_RESPONSE) {
        match rpcwire::decode_response(bytes) {
            Ok((call_id, status, body)) => {
                let Some(call) = ss.calls.remove(&call_id) else {
                    return Ok(());
                };
                if call.waiting {
                    return Err(format!(
                        "peer answered call {call_id} on stream {stream}, which was not sent"
                    ));
                }
                // Its place in the window opens: the next waiting request goes.
                ss.calls_out -= 1;
                if !waiting_calls.is_empty() {
                    release_calls(ss, stream, waiting_calls, backlog);
                }
                if let Some(reply) = call.reply {
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
                    if handoff.call == Some(call_id) {
                        ss.shared.count_reply_handed();
                        handoff.done = true;
                    }
                }
            }
            Err(e) => tracing::warn!(%e, "malformed RPC response dropped"),
        }
    }
    Ok(())
}

/// What a caller whose handler panicked is told ([`crate::RpcError::Handler`]), logged too.
fn handler_panicked(method: u32, panic: &Box<dyn std::any::Any + Send>) -> String {
    let what = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message");
    tracing::error!(
        method = format_args!("{method:#010x}"),
        what,
        "RPC handler panicked"
    );
    format!("{}{what}", crate::rpc::HANDLER_PANICKED)
}

/// `STREAM_OPEN` (only the connecting side opens streams: on an accepted connection a new
/// stream goes to the listener, or is refused past `max_streams`), `STREAM_CLOSE` (a close
/// crossing ours is ignored; with `STREAM_REFUSED`, the peer refused the stream) or
/// `STREAM_CREDIT` (its report is already applied).
fn on_stream_control(
    st: &mut ConnState,
    me: &Weak<WorkerShared>,
    pool: &Buffers,
    guard: &guard::GuardCounters,
    stream: u32,
    flags: TraceFlags,
) -> Result<(), String> {
    if flags.contains(TraceFlags::STREAM_CREDIT) {
        return Ok(());
    }
    if flags.contains(TraceFlags::STREAM_CLOSE) {
        // The peer may close the connection next, once it has the acknowledgement of what it
        // sent (`Worker::linger`): that goes at once, not after the ack delay — which in
        // caller mode, should nobody call in here, would be the back-stop's grace.
        st.driver.core_mut().ack_now();
        let refused = flags.contains(TraceFlags::STREAM_REFUSED);
        let why = if refused {
            // The peer keeps as many of this connection's streams as it allows: later
            // channels to it go on another connection.
            st.refusing.store(true, Ordering::Release);
            Failure::Refused
        } else {
            Failure::PeerGone
        };
        if let Some(ss) = st.streams.get_mut(&stream) {
            ss.peer_closed = true;
            for (_, c) in ss.calls.drain() {
                c.answer(Err(why.to_rpc_error()));
            }
            ss.shared.fail(why);
        }
        st.waiting_calls.remove(&stream);
        return Ok(());
    }
    let Some(accept) = &st.accept else {
        return Err(format!(
            "peer opened stream {stream} on a connection it accepted"
        ));
    };
    if st.streams.contains_key(&stream) {
        return Err(format!("peer opened stream {stream} twice"));
    }
    if st.streams.len() >= st.max_streams as usize {
        // Nothing of it is kept: its messages find no stream and are dropped, and the peer,
        // told, never closes it.
        tracing::warn!(
            stream,
            max_streams = st.max_streams,
            "stream refused: the peer has as many open on the connection as allowed"
        );
        guard.stream_refused();
        st.queue_stream_control(
            pool,
            stream,
            TraceFlags::STREAM_CLOSE | TraceFlags::STREAM_REFUSED,
        );
        return Ok(());
    }
    let Some(worker) = me.upgrade() else {
        return Ok(());
    };
    let conn = st.driver.qp().qp_num().0;
    let window = u64::from(st.driver.core().config().max_queued);
    let shared = Arc::new(ChannelShared::new(
        stream_key(conn, stream),
        worker,
        window,
        st.stream_window,
        st.driver.core().config().max_message_len,
    ));
    st.streams
        .insert(stream, StreamState::new(Arc::clone(&shared)));
    // If the listener is gone the `Accepted` is dropped, which closes the stream.
    let _ = accept.send(Accepted::new(shared, st.peer, st.eager_max));
    Ok(())
}

/// The completion of a one-sided operation: its result to the caller, its buffer back. True
/// when the connection wants a pump for it: a queued operation (room in the send queue now), a
/// close waiting for the last one. Kept out of `Worker::completion`, which every message's
/// completion runs through.
#[inline(never)]
fn one_sided_done(st: &mut ConnState, buffers: &Buffers, wc: &WorkCompletion) -> bool {
    if let Some(p) = st.one_sided.remove(&(wc.wr_id & ((1 << 56) - 1))) {
        // No reply: its deadline passed (the caller was told); the buffer goes back now.
        match p.reply {
            Some(reply) if wc.status.is_success() && p.copy_out => {
                let bytes = p.buf.to_vec();
                // A large buffer is in the cache before the caller, woken, asks for another;
                // a pool buffer goes back after the reply.
                let pooled = if p.buf.is_large() {
                    buffers.recycle(p.buf);
                    None
                } else {
                    Some(p.buf)
                };
                let _ = reply.send(Ok(OneSidedDone::Bytes(bytes)));
                drop(pooled);
            }
            Some(reply) if wc.status.is_success() => {
                if let Err(Ok(OneSidedDone::Buf(buf))) = reply.send(Ok(OneSidedDone::Buf(p.buf))) {
                    buffers.recycle(buf);
                }
            }
            Some(reply) => {
                // Flushed or unanswered, the operation ends as the connection does, like the
                // channel's own work requests: with its failure where that is known, else
                // `PeerGone`; an access the peer refused stays this operation's own error.
                let err = if peer_gone(wc.status) {
                    st.failed
                        .as_ref()
                        .map_or(ChannelError::PeerGone, Failure::to_error)
                } else {
                    ChannelError::Completion {
                        opcode: wc.opcode,
                        status: wc.status,
                    }
                };
                let _ = reply.send(Err(err));
                buffers.recycle(p.buf);
            }
            None => buffers.recycle(p.buf),
        }
    }
    !st.one_sided_queue.is_empty() || st.closing.is_some() || st.is_failed()
}

fn post_one_sided(st: &mut ConnState, pool: &Buffers, next: &mut u64) -> usize {
    let mut posted = 0;
    while (st.one_sided.len() as u32) < ONE_SIDED_DEPTH {
        let Some(q) = st.one_sided_queue.pop_front() else {
            break;
        };
        if post_one(st, pool, next, q) {
            posted += 1;
        }
    }
    posted
}

/// Post one one-sided operation (the send queue has room); false when it failed at once (no
/// memory for its buffer, the post refused), its caller told. Not inlined into the command
/// handling every pass runs.
#[inline(never)]
fn post_one(st: &mut ConnState, pool: &Buffers, next: &mut u64, q: OneSidedQueued) -> bool {
    let OneSidedQueued {
        op,
        reply,
        deadline,
    } = q;
    // The local buffer: the caller's, or one from the pool for the result.
    let local = |brought: Option<PoolBuf>, len: usize| match brought {
        Some(b) => Ok(b),
        None => pool.alloc(len.max(8)).map(|mut b| {
            b.set_len(len);
            b
        }),
    };
    let copy_out = matches!(op, OneSidedOp::Read { into: None, .. });
    let (buf, opcode) = match op {
        OneSidedOp::Write { remote, buf } => (Ok(buf), WrOpcode::Write { remote }),
        OneSidedOp::Read { remote, len, into } => {
            (local(into, len as usize), WrOpcode::Read { remote })
        }
        OneSidedOp::CompareSwap {
            remote,
            compare,
            swap,
        } => (
            local(None, 8),
            WrOpcode::AtomicCmpSwp {
                remote,
                compare,
                swap,
            },
        ),
        OneSidedOp::FetchAdd { remote, add } => {
            (local(None, 8), WrOpcode::AtomicFetchAdd { remote, add })
        }
    };
    let buf = match buf {
        Ok(b) => b,
        Err(e) => {
            let _ = reply.send(Err(ChannelError::Failed(format!("no memory: {e}"))));
            return false;
        }
    };
    let token = *next;
    *next += 1;
    let wr_id = (WR_ONE_SIDED << 56) | token;
    let sges = [buf.sge()];
    let list: &[fabriq_verbs::Sge] = if buf.is_empty() { &[] } else { &sges };
    match st
        .driver
        .qp()
        .post_send(&[SendWr::new(wr_id, list, opcode).with_flags(SendFlags::SIGNALED)])
    {
        Ok(()) => {
            st.one_sided.insert(
                token,
                OneSidedPending {
                    buf,
                    copy_out,
                    reply: Some(reply),
                    deadline,
                },
            );
            true
        }
        Err(e) => {
            let _ = reply.send(Err(ChannelError::Verbs(e.source)));
            pool.recycle(buf);
            false
        }
    }
}

/// A completion status that says the peer is gone, or unreachable (the QP's retries ran out,
/// or it failed and flushed the request), rather than that the request itself was refused.
fn peer_gone(status: fabriq_verbs::WcStatus) -> bool {
    matches!(
        status,
        fabriq_verbs::WcStatus::RetryExceeded
            | fabriq_verbs::WcStatus::WrFlushed
            | fabriq_verbs::WcStatus::RnrRetryExceeded
    )
}

/// Opcode check used by tests of completions.
#[allow(dead_code)]
pub(crate) fn is_one_sided_opcode(op: WcOpcode) -> bool {
    matches!(
        op,
        WcOpcode::RdmaWrite | WcOpcode::RdmaRead | WcOpcode::CompSwap | WcOpcode::FetchAdd
    )
}
