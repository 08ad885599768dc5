//! State shared between whoever drives a worker and the application threads.
//!
//! * The worker state ([`super::Worker`]: CQ, channels, timers) sits behind one lock. Its loop
//!   body, [`super::Worker::progress`], is run by the worker thread and by application threads
//!   alike: an application thread that waits takes the lock when it is free and progresses the
//!   worker itself (in [`Progress::Caller`] mode it is the only one that does, apart from a
//!   back-stop thread that serves the endpoint while no application thread calls in).
//! * The inbox (a lock-free queue plus an eventfd written only while someone sleeps in the
//!   worker's epoll) carries what cannot be done at once: a send while another thread holds the
//!   lock (thread mode), commands from inside a handler, adoption of new channels.
//! * Each channel's delivery queue and send window ([`ChannelShared`]). Blocking waits of every
//!   kind go through [`WorkerShared::wait_for`]: progress if possible, spin for the idle budget,
//!   then sleep — in the worker's epoll (caller mode, one thread at a time) or on the worker's
//!   park condvar, which every progress pass that did work notifies.

use std::cell::Cell;
use std::os::fd::OwnedFd;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant as StdInstant};

use crossbeam_queue::SegQueue;
use parking_lot::{Condvar, Mutex, MutexGuard};
use rustix::event::epoll;

use super::buffers::Buffers;
use super::delivery::DeliveryQueue;
use super::{Command, Worker};
use crate::channel::proto::Instant;
use crate::channel::ChannelError;
use crate::config::Progress;
use crate::message::Message;
use crate::rpc::RpcError;

/// Longest a parked waiter sleeps before it looks again (guards against a missed notification;
/// in caller mode it also lets a parked waiter take over polling from one that left).
const PARK_CAP_THREAD: Duration = Duration::from_millis(100);
const PARK_CAP_CALLER: Duration = Duration::from_millis(1);
/// Caller mode: how long no application thread must have called in before the back-stop thread
/// starts progressing the worker.
pub(crate) const BACKSTOP_GRACE: Duration = Duration::from_millis(10);
/// Caller mode: how soon the back-stop looks again at a readable control stream it could not
/// handle because an application thread held the worker.
const CONTROL_RETRY: Duration = Duration::from_micros(200);
/// Caller mode: how often the back-stop looks whether the thread asleep in the worker's epoll
/// (which reads the control streams meanwhile) left.
const POLLER_RECHECK: Duration = Duration::from_millis(1);

/// Caller mode: how often the back-stop progresses the worker while a connection of it closes
/// (lingers for its peer's acknowledgements) and application threads call in, or did within
/// the grace — the thread that closed it may not call in again for a while: every
/// `LINGER_POLL` at first, twice as long after each pass that found nothing, up to
/// `LINGER_POLL_MAX` (a peer that never acknowledges costs ≈ 1 000 wake-ups a second for the
/// linger, not 10 000).
pub(crate) const LINGER_POLL: Duration = Duration::from_micros(100);
const LINGER_POLL_MAX: Duration = Duration::from_millis(1);
/// Payload bytes in flight per channel before `send` waits (see `outstanding_bytes`).
pub(crate) const WINDOW_BYTES: u64 = 16 << 20;
/// One outstanding message in `ChannelShared::sends` (its low 32 bits).
const OUTSTANDING: u64 = 1;
/// One unconsumed unit in `ChannelShared::sends` (its high 32 bits).
const UNCONSUMED: u64 = 1 << 32;
/// Payload bytes one unit of the stream window stands for: a data message counts a unit per
/// MiB it started (one at least, half the window at most), so a reader that stops holds at
/// most a window of MiB — or two messages of any size — and not a window of messages of up to
/// `max_message_len` each.
pub(crate) const WINDOW_UNIT: u64 = 1 << 20;

/// Units of the stream window `stream_window` that a data message of `len` payload bytes
/// counts. At most half the window: a sender that waits then has more than half the window
/// unconsumed — over the quarter after which the reader reports — so the report that lets it
/// go comes once the reader consumed what it sent.
#[inline]
pub(crate) fn window_units(len: u64, stream_window: u64) -> u64 {
    if len <= WINDOW_UNIT {
        1
    } else {
        (1 + (len - 1) / WINDOW_UNIT).min(stream_window / 2)
    }
}
/// Messages of at most this many payload bytes are not counted in
/// `ChannelShared::outstanding_bytes` (the message window bounds what they hold).
const UNCOUNTED_BYTES: u64 = 4096;

/// The bytes a message of `len` counts in `ChannelShared::outstanding_bytes`.
fn counted_bytes(len: u64) -> u64 {
    if len > UNCOUNTED_BYTES {
        len
    } else {
        0
    }
}

/// Spin rounds between clock reads in [`WorkerShared::wait_for`].
const CLOCK_EVERY: u32 = 16;

thread_local! {
    /// Worker states this thread holds (a handler running in a pass holds its worker's).
    static STATES_HELD: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// True while this thread holds some worker's state.
pub(crate) fn holds_a_state() -> bool {
    STATES_HELD.with(|n| n.get() > 0)
}

/// A token unique to the calling thread for the life of the process.
fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TOKEN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }
    TOKEN.with(|t| {
        let v = t.get();
        if v != 0 {
            return v;
        }
        let v = NEXT.fetch_add(1, Ordering::Relaxed);
        t.set(v);
        v
    })
}

/// What the back-stop thread last saw of the application's calls (caller mode).
#[derive(Debug, Default)]
pub(crate) struct QuietWatch {
    /// The count of calls that had entered.
    entered: u64,
    /// A call was inside.
    busy: bool,
    /// Since when nothing changed (`None`: no call ever seen).
    since: Option<StdInstant>,
}

/// The worker state, locked; remembers the holding thread so that a re-entrant call (a handler
/// running under the lock that sends on a channel of the same worker) is detected instead of
/// deadlocking.
pub(crate) struct StateGuard<'a> {
    guard: MutexGuard<'a, Worker>,
    holder: &'a AtomicU64,
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = Worker;
    fn deref(&self) -> &Worker {
        &self.guard
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut Worker {
        &mut self.guard
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        self.holder.store(0, Ordering::Release);
        STATES_HELD.with(|n| n.set(n.get().saturating_sub(1)));
    }
}

/// What a thread waiting on a worker ([`WorkerShared::wait_reading`]) waits for, so that the
/// pass that gives it can end there ([`super::Handoff`]).
#[derive(Clone, Copy)]
pub(crate) enum Awaited<'a> {
    /// Anything: plain passes.
    Progress,
    /// The next message of a stream (`ChannelShared::id`): handed into the slot.
    Message(u64, &'a Cell<Option<Message>>),
    /// The reply of an RPC call (its id), which comes through the call's oneshot.
    Reply(u64),
}

/// A non-blocking eventfd in epoll set `ep` under the key `EPOLL_WAKE`: writing it wakes a
/// thread waiting there.
fn wake_eventfd(ep: &OwnedFd) -> std::io::Result<OwnedFd> {
    let fd = rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )?;
    epoll::add(
        ep,
        &fd,
        epoll::EventData::new_u64(super::EPOLL_WAKE),
        epoll::EventFlags::IN,
    )?;
    Ok(fd)
}

/// The back-stop's next poll period while a connection lingers: back to [`LINGER_POLL`] after
/// a pass that did work, else twice `period`, at most `LINGER_POLL_MAX`.
fn next_linger_poll(period: Duration, worked: bool) -> Duration {
    if worked {
        LINGER_POLL
    } else {
        (period * 2).min(LINGER_POLL_MAX)
    }
}

/// The worker's shared side.
pub(crate) struct WorkerShared {
    pub(crate) id: usize,
    inbox: SegQueue<Command>,
    /// Where the next message is expected (`Worker::next_rx`): an address to prefetch, never
    /// dereferenced.
    next_rx: AtomicUsize,
    /// True while someone is (about to be) asleep in the worker's epoll.
    sleeping: AtomicBool,
    /// While a thread sleeps in the worker's epoll: until when, on the worker's clock
    /// (nanoseconds; `u64::MAX`: no timeout); 0 otherwise. A thread that arms an earlier timer
    /// meanwhile wakes it (`Worker::nudge_sleeper`).
    pub(crate) sleep_until_ns: AtomicU64,
    wake_fd: OwnedFd,
    /// Wake-ups written (for tests and stats).
    pub(crate) wakeups: AtomicU64,
    /// The worker's epoll set: its CQ event fd, `wake_fd`, the channels' control streams.
    pub(crate) epoll: OwnedFd,
    /// The control streams alone, for the caller-mode back-stop while application threads call
    /// in ([`WorkerShared::watch_control`]): it must not take the CQ's or the inbox's wake-ups
    /// from a thread asleep in `epoll` (one waiter is woken per event).
    pub(crate) control_epoll: OwnedFd,
    /// In `control_epoll` (key `EPOLL_WAKE`): written when a connection starts to linger in
    /// caller mode ([`WorkerShared::set_lingering`]), so that a back-stop waiting there starts
    /// seeing the close through.
    backstop_fd: OwnedFd,
    /// A connection of this worker is closing: it lingers until the peer acknowledged what it
    /// sent (`ConnState::closing`). Written by the holder of the worker's lock.
    lingering: AtomicBool,
    state: OnceLock<Mutex<Worker>>,
    buffers: OnceLock<Arc<Buffers>>,
    /// The worker's CQ, for a spinning waiter's look without the state's lock.
    cq: OnceLock<fabriq_verbs::CompletionQueue>,
    holder: AtomicU64,
    caller_mode: AtomicBool,
    idle_spin_ns: AtomicU64,
    /// How long a handler's wait without a deadline of its own may take (the endpoint's RPC
    /// deadline): see [`WorkerShared::handler_wait`].
    handler_wait_ns: AtomicU64,
    /// The endpoint was built where the process may use one CPU only: a spinning waiter steps
    /// aside at every round (what it waits for runs only then).
    one_cpu: AtomicBool,
    /// A thread is in the epoll sleep of [`WorkerShared::poll_sleep`].
    poller: AtomicBool,
    /// An application thread spins in [`WorkerShared::wait_for`].
    spinner: AtomicBool,
    parked: AtomicUsize,
    park: Mutex<u64>,
    park_cv: Condvar,
    /// Application calls (caller mode) that entered, wrapping: the back-stop thread tells a
    /// quiet application by the count standing still (and no caller spinning). Bumped by a
    /// load and a store, not a locked add: callers racing may lose a bump, but the count
    /// still moves, which is all the back-stop looks at.
    entered: AtomicU64,
    /// Application tasks asleep on an async wait's notification (`super::async_wait`): in
    /// caller mode the back-stop progresses the worker while there are any.
    async_sleepers: AtomicU32,
    /// Set once the worker processed `Shutdown`.
    pub(crate) stopped: AtomicBool,
    /// RPC call ids, unique per worker.
    next_call: AtomicU64,
    /// Parking pairs asymmetric barriers (`super::barrier`): the notifier's is free.
    asymmetric: bool,
}

impl WorkerShared {
    pub(crate) fn new(id: usize) -> std::io::Result<WorkerShared> {
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let control_epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let wake_fd = wake_eventfd(&ep)?;
        let backstop_fd = wake_eventfd(&control_epoll)?;
        Ok(WorkerShared {
            id,
            inbox: SegQueue::new(),
            next_rx: AtomicUsize::new(0),
            sleeping: AtomicBool::new(false),
            sleep_until_ns: AtomicU64::new(0),
            wake_fd,
            wakeups: AtomicU64::new(0),
            epoll: ep,
            control_epoll,
            backstop_fd,
            lingering: AtomicBool::new(false),
            state: OnceLock::new(),
            buffers: OnceLock::new(),
            cq: OnceLock::new(),
            holder: AtomicU64::new(0),
            caller_mode: AtomicBool::new(false),
            idle_spin_ns: AtomicU64::new(50_000),
            handler_wait_ns: AtomicU64::new(5_000_000_000),
            one_cpu: AtomicBool::new(false),
            poller: AtomicBool::new(false),
            spinner: AtomicBool::new(false),
            parked: AtomicUsize::new(0),
            async_sleepers: AtomicU32::new(0),
            park: Mutex::new(0),
            park_cv: Condvar::new(),
            entered: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
            next_call: AtomicU64::new(1),
            asymmetric: super::barrier::asymmetric(),
        })
    }

    /// Install the worker state (once, at start).
    pub(crate) fn install(
        &self,
        worker: Worker,
        buffers: Arc<Buffers>,
        cq: fabriq_verbs::CompletionQueue,
        progress: Progress,
        idle_spin: Duration,
        handler_wait: Duration,
    ) {
        // The CQ read its CPUs when it was created, on the thread that builds the endpoint:
        // the worker thread inherits them (and `pin_workers` pins within them).
        self.one_cpu.store(cq.one_cpu(), Ordering::Relaxed);
        let _ = self.cq.set(cq);
        self.caller_mode
            .store(progress == Progress::Caller, Ordering::Relaxed);
        self.idle_spin_ns.store(
            u64::try_from(idle_spin.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.handler_wait_ns.store(
            u64::try_from(handler_wait.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        let _ = self.buffers.set(buffers);
        let _ = self.state.set(Mutex::new(worker));
    }

    /// True in [`Progress::Caller`] mode.
    pub(crate) fn is_caller_mode(&self) -> bool {
        self.caller_mode.load(Ordering::Relaxed)
    }

    /// True when the endpoint was built where the process may use one CPU only.
    pub(crate) fn one_cpu(&self) -> bool {
        self.one_cpu.load(Ordering::Relaxed)
    }

    pub(crate) fn idle_spin(&self) -> Duration {
        Duration::from_nanos(self.idle_spin_ns.load(Ordering::Relaxed))
    }

    /// The deadline of a wait that has none of its own (`recv`, a back-pressured `send`, a
    /// one-sided operation) when a handler makes it: `None` for any other thread. A handler
    /// holds its own worker; the worker it waits on may be held by a handler that waits for
    /// it in turn, and a wait without end there would hold both workers for ever. Bounded by
    /// the endpoint's RPC deadline (`Config::rpc_timeout_ms`), the wait ends with `Timeout`.
    pub(crate) fn handler_deadline(&self) -> Option<StdInstant> {
        holds_a_state().then(|| {
            StdInstant::now() + Duration::from_nanos(self.handler_wait_ns.load(Ordering::Relaxed))
        })
    }

    /// The worker's buffers (for sends prepared on application threads).
    pub(crate) fn buffers(&self) -> Option<&Arc<Buffers>> {
        self.buffers.get()
    }

    /// A fresh RPC call id.
    pub(crate) fn next_call_id(&self) -> u64 {
        self.next_call.fetch_add(1, Ordering::Relaxed)
    }

    /// The state if it is free now.
    pub(crate) fn try_lock_state(&self) -> Option<StateGuard<'_>> {
        let guard = self.state.get()?.try_lock()?;
        Some(self.held(guard))
    }

    fn held<'a>(&'a self, guard: MutexGuard<'a, Worker>) -> StateGuard<'a> {
        self.holder.store(thread_token(), Ordering::Release);
        STATES_HELD.with(|n| n.set(n.get() + 1));
        StateGuard {
            guard,
            holder: &self.holder,
        }
    }

    /// This thread holds the state: it runs a pass of this worker (a handler of its).
    pub(crate) fn held_here(&self) -> bool {
        self.holder.load(Ordering::Acquire) == thread_token()
    }

    /// The state, waiting for it; `None` when this thread already holds it (a handler calling
    /// back into its own worker) or the worker is not started. A thread that holds another
    /// worker's state (a handler of that worker) does not wait: it gets this one only if it is
    /// free at once, else `None` — two handlers of two workers, each waiting for the other's
    /// state, would wait for ever (test
    /// `handlers_of_two_workers_sending_on_each_others_channels_do_not_deadlock`).
    pub(crate) fn lock_state(&self) -> Option<StateGuard<'_>> {
        if self.holder.load(Ordering::Acquire) == thread_token() {
            return None;
        }
        if holds_a_state() {
            return self.try_lock_state();
        }
        let guard = self.state.get()?.lock();
        Some(self.held(guard))
    }

    /// False only when a progress pass would certainly find nothing new to start with: the
    /// CQ has nothing to poll and the inbox is empty (a look without the lock). What a pass
    /// also does — timers, reposts left for later, control streams — waits for the next pass.
    fn may_have_work(&self) -> bool {
        !self.inbox.is_empty() || self.cq.get().map_or(true, |cq| cq.may_have_completions())
    }

    /// The worker (holding its state): where the next message is expected, after a pass. A
    /// store only when it moved (the line stays shared with the spinning threads otherwise).
    pub(crate) fn publish_next_rx(&self, addr: usize) {
        if self.next_rx.load(Ordering::Relaxed) != addr {
            self.next_rx.store(addr, Ordering::Relaxed);
        }
    }

    /// A waiting thread about to run a pass: start fetching the receive slot the next message
    /// is expected in, so that the pass finds it in this core's cache when it reads the
    /// message — the line's transfer from the writer's core overlaps taking the state, the
    /// inbox and the CQ poll instead of following them. The wait loop calls it before each
    /// pass it runs — the round that saw a completion, and the few that run a pass anyway
    /// (after work, every 64th) — so at most once per 64 idle rounds without one; an idle
    /// round does not pull the line away from the core about to write it. Cross-core one-way
    /// channel latency on shm0 about 2% lower in caller mode, builds with aligned code side by
    /// side (`docs/BENCHMARKS.md`, "2026-12-04, fourth round"). The thread-mode loop does not
    /// call it: it measured no gain there (0.990, 1.000), and would read the CQ twice a round.
    fn prefetch_next_rx(&self) {
        let addr = self.next_rx.load(Ordering::Relaxed);
        if addr != 0 {
            fabriq_verbs::hint::prefetch_read(addr);
        }
    }

    /// Hand a command to the worker, waking it if it sleeps.
    pub(crate) fn submit(&self, cmd: Command) {
        self.inbox.push(cmd);
        // Pairs with the fence in `prepare_sleep`: either the sleeper sees the command, or we
        // see it sleeping and wake it.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.wake();
        }
        // A parked caller-mode waiter may be the only one who will progress.
        if self.is_caller_mode() {
            self.notify_parked();
        }
    }

    /// Nobody sleeps in the worker's epoll: a command submitted now is taken by a thread
    /// that is progressing the worker or about to (see `submit`).
    pub(crate) fn is_awake(&self) -> bool {
        !self.sleeping.load(Ordering::SeqCst)
    }

    /// Write the eventfd.
    pub(crate) fn wake(&self) {
        self.wakeups.fetch_add(1, Ordering::Relaxed);
        let _ = rustix::io::write(&self.wake_fd, &1u64.to_ne_bytes());
    }

    /// The next queued command. An empty inbox is told by two loads (a pop of an empty
    /// `SegQueue` pays a full fence); a command being pushed meanwhile is seen by the next pass.
    pub(crate) fn pop(&self) -> Option<Command> {
        if self.inbox.is_empty() {
            return None;
        }
        self.inbox.pop()
    }

    /// Announce sleep; false if work arrived meanwhile (then don't sleep).
    fn prepare_sleep(&self) -> bool {
        self.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !self.inbox.is_empty() {
            self.sleeping.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    fn woke(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.wake_fd, &mut buf);
    }

    /// Wake threads parked in [`WorkerShared::wait_for`]: called after any progress that did
    /// work.
    pub(crate) fn notify_parked(&self) {
        // Pairs with the heavy barrier of a thread parking in `wait_for`: either it sees this
        // thread's work, or this sees it parked.
        super::barrier::light(self.asymmetric);
        if self.parked.load(Ordering::SeqCst) > 0 {
            let mut epoch = self.park.lock();
            *epoch = epoch.wrapping_add(1);
            self.park_cv.notify_all();
        }
    }

    /// [`WorkerShared::try_progress_at`] by a thread that waits to read stream `reader`:
    /// with the work done, the message of that stream the pass handed to it
    /// ([`super::Handoff`]).
    pub(crate) fn try_progress_reading(
        &self,
        recent: Option<Instant>,
        reader: u64,
    ) -> Option<(usize, Option<Message>)> {
        let mut g = self.try_lock_state()?;
        let (n, m) = g.progress_reading(self, recent, reader);
        drop(g);
        if n > 0 {
            self.notify_parked();
        }
        Some((n, m))
    }

    /// [`WorkerShared::try_progress_at`] by a thread that waits for the reply of RPC call
    /// `call`: the pass that sends it ends there ([`super::Handoff`]).
    pub(crate) fn try_progress_calling(&self, recent: Option<Instant>, call: u64) -> Option<usize> {
        let mut g = self.try_lock_state()?;
        let n = g.progress_calling(self, recent, call);
        drop(g);
        if n > 0 {
            self.notify_parked();
        }
        Some(n)
    }

    /// One progress pass if the state is free: `Some(work done)`, `None` if someone else holds
    /// it.
    pub(crate) fn try_progress(&self) -> Option<usize> {
        self.try_progress_at(None)
    }

    /// [`WorkerShared::try_progress`] on a clock read moments ago ([`Worker::progress_at`]).
    pub(crate) fn try_progress_at(&self, recent: Option<Instant>) -> Option<usize> {
        let mut g = self.try_lock_state()?;
        let n = g.progress_at(self, recent);
        drop(g);
        if n > 0 {
            self.notify_parked();
        }
        Some(n)
    }

    /// [`WorkerShared::try_progress`] with the due timers fired first
    /// ([`Worker::progress_after_sleep`]; an idle pass looks at them only every 64th round).
    pub(crate) fn try_progress_with_timers(&self) -> Option<usize> {
        let mut g = self.try_lock_state()?;
        let n = g.progress_after_sleep(self);
        drop(g);
        if n > 0 {
            self.notify_parked();
        }
        Some(n)
    }

    /// An application task goes to sleep on an async wait's notification
    /// (`super::async_wait::AsyncSleep`). In caller mode the first wakes the back-stop, which
    /// then progresses the worker ([`WorkerShared::callers_quiet`]).
    pub(crate) fn async_sleep_begin(&self) {
        let before = self.async_sleepers.fetch_add(1, Ordering::AcqRel);
        if before == 0 && self.is_caller_mode() {
            self.nudge_backstop();
        }
    }

    /// The task of [`WorkerShared::async_sleep_begin`] woke.
    pub(crate) fn async_sleep_end(&self) {
        self.async_sleepers.fetch_sub(1, Ordering::AcqRel);
    }

    /// Note that an application thread called in (caller mode: the back-stop thread stays out
    /// of the way while calls come; a caller that waits is the spinner or sleeps as the poller,
    /// which keeps it away too).
    pub(crate) fn enter_caller(&self) {
        // Not counted: thread mode, and calls from a handler on the thread that progresses.
        if !self.is_caller_mode() || self.holder.load(Ordering::Acquire) == thread_token() {
            return;
        }
        let n = self.entered.load(Ordering::Relaxed);
        self.entered.store(n.wrapping_add(1), Ordering::Relaxed);
    }

    /// True when no application thread has called in for `BACKSTOP_GRACE` of the back-stop's
    /// watch (`watch` remembers what it saw) and none spins waiting; otherwise how long to wait
    /// before asking again.
    pub(crate) fn callers_quiet(&self, watch: &mut QuietWatch) -> Result<(), Duration> {
        if self.spinner.load(Ordering::Acquire) {
            watch.busy = true;
            return Err(BACKSTOP_GRACE);
        }
        if self.async_sleepers.load(Ordering::Acquire) > 0 {
            // A task sleeps on its notification: nobody else moves the worker for it.
            return Ok(());
        }
        let entered = self.entered.load(Ordering::Relaxed);
        if entered != watch.entered || watch.busy {
            // A call came and went: quiet from now on, as far as the watch can tell.
            watch.entered = entered;
            watch.busy = false;
            watch.since = Some(StdInstant::now());
            return Err(BACKSTOP_GRACE);
        }
        let quiet = watch.since.map_or(BACKSTOP_GRACE, |s| s.elapsed());
        if quiet >= BACKSTOP_GRACE {
            Ok(())
        } else {
            Err(BACKSTOP_GRACE - quiet)
        }
    }

    /// Caller mode, back-stop, while application threads call in: wait up to `wait` for a
    /// control stream to turn readable — a peer's `Ready`, `Close` or hang-up, which no pass
    /// of an application thread looks for (they read control streams only when they sleep, or
    /// every 1024th idle pass) — and handle it if the worker is free. A peer that closes a
    /// connection and at once connects again on the kept stream waits for this: its hello
    /// reaches the listener only once this side let the stream go, which took up to two
    /// back-stop graces (10–20 ms) before (`docs/BENCHMARKS.md`, "2026-12-04, fifth round").
    pub(crate) fn watch_control(&self, wait: Duration) {
        if self.poller.load(Ordering::Acquire) {
            // A thread asleep in the worker's own set (the poller) reads them: this one would
            // only add a wake-up and a contended lock per event. Look again soon, in case it
            // leaves.
            std::thread::sleep(POLLER_RECHECK.min(wait));
            return;
        }
        let mut keys = super::epoll_wait(&self.control_epoll, Some(wait));
        if let Some(i) = keys.iter().position(|&k| k == super::EPOLL_WAKE) {
            // A connection started to linger (the caller sees to it), or a command waits that
            // a thread holding another worker's state could not wait to apply
            // (`direct_or_submit`): take it once the worker is free, looking again shortly
            // (the nudge written anew) while it is not.
            keys.swap_remove(i);
            let mut buf = [0u8; 8];
            let _ = rustix::io::read(&self.backstop_fd, &mut buf);
            if !self.inbox.is_empty() && self.try_progress().is_none() {
                self.nudge_backstop();
                std::thread::sleep(CONTROL_RETRY.min(wait));
            }
        }
        if keys.is_empty() {
            return;
        }
        match self.try_lock_state() {
            Some(mut g) => {
                if g.handle_epoll(&keys) {
                    // A peer's close waits for this side to read what it sent: a whole pass,
                    // timers included (`Worker::nudge_peer`).
                    g.progress_after_sleep(self);
                }
                drop(g);
                self.notify_parked();
            }
            // The stream stays readable: look again shortly, without spinning on it.
            None => std::thread::sleep(CONTROL_RETRY.min(wait)),
        }
    }

    /// The worker (holding its lock): whether a connection of it lingers. When one starts to
    /// in caller mode, the back-stop is nudged: it progresses the worker every `LINGER_POLL`
    /// until none does ([`WorkerShared::watch_lingering`]).
    pub(crate) fn set_lingering(&self, on: bool) {
        if self.lingering.load(Ordering::Relaxed) == on {
            return;
        }
        self.lingering.store(on, Ordering::Release);
        if on && self.is_caller_mode() {
            self.nudge_backstop();
        }
    }

    /// Caller mode: wake the back-stop from its watch of the control streams (a connection
    /// started to linger, or a command waits in the inbox that no thread may take soon).
    pub(crate) fn nudge_backstop(&self) {
        let _ = rustix::io::write(&self.backstop_fd, &1u64.to_ne_bytes());
    }

    /// A connection of this worker lingers (as the passes last published).
    #[cfg(test)]
    pub(crate) fn is_lingering(&self) -> bool {
        self.lingering.load(Ordering::Acquire)
    }

    /// Caller mode, back-stop, while application threads call in (or did within the grace):
    /// see a lingering connection's close through. The thread that dropped the last handle
    /// started the close, but the peer's acknowledgements come later, and that thread may
    /// not call in again for a while: without this, the connection would close — and its QP
    /// go back to the cache — only once the back-stop's grace ran out (10 ms and more).
    /// `period` is the current poll period ([`LINGER_POLL`] to start with). False (nothing
    /// done) when no connection lingers.
    pub(crate) fn watch_lingering(&self, wait: Duration, period: &mut Duration) -> bool {
        if !self.lingering.load(Ordering::Acquire) {
            *period = LINGER_POLL;
            return false;
        }
        // (An epoll wait would last a whole millisecond: its timeout counts milliseconds.)
        self.watch_control(Duration::ZERO);
        if self.lingering.load(Ordering::Acquire) {
            // The timers fire in this pass (an idle pass looks at them only every 64th round):
            // the closing connection's nudges of its peer are due on them.
            let worked = self.try_progress_with_timers().is_some_and(|n| n > 0);
            *period = next_linger_poll(*period, worked);
        }
        std::thread::sleep((*period).min(wait));
        true
    }

    /// Try to become the one thread that sleeps in the worker's epoll.
    pub(crate) fn try_become_poller(&self) -> bool {
        self.poller
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    pub(crate) fn release_poller(&self) {
        self.poller.store(false, Ordering::Release);
        self.notify_parked();
    }

    /// One sleep of the worker: announce it, arm the CQ, re-poll (a completion racing the arm
    /// is handled now), check `ready` (under the lock, after the re-poll), sleep in epoll until
    /// an event, the next timer or `deadline`, then handle what woke it. The caller must hold the
    /// poller role (or be the worker thread in thread mode). Returns what `ready` produced.
    pub(crate) fn poll_sleep<T>(
        &self,
        deadline: Option<StdInstant>,
        ready: &mut impl FnMut() -> Option<T>,
    ) -> Option<T> {
        let (armed, timeout) = {
            let mut g = self.lock_state()?;
            if !self.prepare_sleep() {
                let n = g.progress(self);
                drop(g);
                if n > 0 {
                    self.notify_parked();
                }
                return None;
            }
            let armed = g.arm_cq();
            g.arm_reclaim();
            let n = g.progress(self);
            if n > 0 {
                self.woke();
                drop(g);
                self.notify_parked();
                return None;
            }
            if let Some(v) = ready() {
                self.woke();
                return Some(v);
            }
            // The sleep ends at the earliest of: the next timer, the caller's deadline, the
            // 1 ms poll of a CQ without events. `until` is that end itself, on the worker's
            // clock: a thread that files a timer compares it with exactly the deadline the
            // sleeper already sleeps toward, so only a timer that is really earlier wakes it.
            let now = super::now();
            let mut end = g.next_deadline().map(|t| {
                let ns = t.as_nanos().max(now.as_nanos());
                (ns, Duration::from_nanos(ns - now.as_nanos()))
            });
            let mut bound = |d: Duration| {
                if end.map_or(true, |(_, t)| d < t) {
                    let ns = now
                        .as_nanos()
                        .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
                    end = Some((ns, d));
                }
            };
            if let Some(d) = deadline {
                bound(d.saturating_duration_since(StdInstant::now()));
            }
            if !armed {
                // No CQ events: wake now and then to poll.
                bound(Duration::from_millis(1));
            }
            let (until, timeout) = match end {
                Some((ns, d)) => (ns.max(1), Some(d)),
                None => (u64::MAX, None),
            };
            self.sleep_until_ns.store(until, Ordering::Relaxed);
            (armed, timeout)
        };
        let keys = super::epoll_wait(&self.epoll, timeout);
        self.sleep_until_ns.store(0, Ordering::Relaxed);
        if let Some(mut g) = self.lock_state() {
            self.woke();
            g.handle_epoll(&keys);
            if armed {
                g.ack_cq_events();
            }
            g.progress_after_sleep(self);
        } else {
            self.woke();
        }
        self.notify_parked();
        None
    }

    /// Wait until `ready` produces a value or `deadline` passes (`None`). One waiting thread at a
    /// time is the spinner: it progresses the worker whenever it can, spins for the idle budget
    /// after the last work, and then — in caller mode — sleeps in the worker's epoll (thread
    /// mode: parks; the worker thread polls). Every other waiter parks on the worker's condvar,
    /// which every pass that did work notifies, and takes the spinner role when it is free: on
    /// few cores, many spinning threads would only steal time from the one that progresses.
    pub(crate) fn wait_for<T>(
        &self,
        deadline: Option<StdInstant>,
        ready: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        self.wait_reading(deadline, Awaited::Progress, ready)
    }

    /// One pass by a waiting thread, one that may hand it what it waits for (see [`Awaited`]).
    fn progress_waiting(&self, recent: Option<Instant>, awaited: Awaited<'_>) -> Option<usize> {
        match awaited {
            Awaited::Message(stream, slot) => {
                // A message handed earlier and not yet read keeps its place: this pass
                // delivers through the queue (the wait loop reads the slot before every pass,
                // so it is empty).
                match slot.take() {
                    None => {
                        let (n, m) = self.try_progress_reading(recent, stream)?;
                        slot.set(m);
                        Some(n)
                    }
                    held => {
                        slot.set(held);
                        self.try_progress_at(recent)
                    }
                }
            }
            Awaited::Reply(call) => self.try_progress_calling(recent, call),
            Awaited::Progress => self.try_progress_at(recent),
        }
    }

    /// [`WorkerShared::wait_for`] by a thread whose passes may end as soon as they give it
    /// what it waits for ([`Awaited`]; a handed message lands in the slot, which `ready` must
    /// look at).
    pub(crate) fn wait_reading<T>(
        &self,
        deadline: Option<StdInstant>,
        awaited: Awaited<'_>,
        mut ready: impl FnMut() -> Option<T>,
    ) -> Option<T> {
        self.enter_caller();
        let budget = self.idle_spin();
        let caller_mode = self.is_caller_mode();
        let one_cpu = self.one_cpu();
        let mut spinner = self.take_spinner();
        // The spin rounds run on the worker's clock, so that the pass of a round can use the
        // round's reading (`try_progress_at`).
        let mut now = super::now();
        let mut last_work = now;
        let spin_deadline =
            deadline.map(|d| now.saturating_add(d.saturating_duration_since(StdInstant::now())));
        let mut spins = 0u32;
        let mut after_work = false;
        loop {
            if let Some(v) = ready() {
                return Some(v);
            }
            if spinner.is_some() {
                spins = spins.wrapping_add(1);
                // The clock is read every few rounds only: a round is well under a microsecond.
                if spins % CLOCK_EVERY == 0 {
                    now = super::now();
                    if spin_deadline.is_some_and(|d| now >= d) {
                        return None;
                    }
                }
                // While nothing arrives, most rounds only look at the CQ and the inbox (no lock,
                // no pass): the round that sees a completion is short, so it is found sooner.
                // Every 64th round and the one after work run a whole pass (timers, reposts).
                if !after_work
                    && spins % 64 != 0
                    && now.saturating_duration_since(last_work) < budget
                    && !self.may_have_work()
                {
                    if one_cpu {
                        std::thread::yield_now();
                    }
                    continue;
                }
                // The slot the next message lands in starts coming over while the pass takes
                // the state and polls the CQ.
                self.prefetch_next_rx();
                // A round right after one that did work (handlers may have run for a while)
                // lets its pass read the clock itself.
                let reading = (!after_work).then_some(now);
                after_work = false;
                if let Some(n) = self.progress_waiting(reading, awaited) {
                    if n > 0 {
                        last_work = now;
                        after_work = true;
                        continue;
                    }
                }
                if now.saturating_duration_since(last_work) < budget {
                    if one_cpu || spins % 256 == 0 {
                        std::thread::yield_now();
                        // Away for a while, maybe: the next pass runs on a fresh reading.
                        now = super::now();
                    } else {
                        std::hint::spin_loop();
                    }
                    continue;
                }
            } else if self.progress_waiting(None, awaited).is_some_and(|n| n > 0) {
                continue;
            }
            if deadline.is_some_and(|d| StdInstant::now() >= d) {
                return None;
            }
            if caller_mode && spinner.is_some() && self.try_become_poller() {
                let got = self.poll_sleep(deadline, &mut ready);
                self.release_poller();
                if got.is_some() {
                    return got;
                }
                now = super::now();
                last_work = now;
                continue;
            }
            // Park until a progress pass did work (or the cap, or the deadline). A spinner gives
            // its role up while parked.
            drop(spinner.take());
            self.parked.fetch_add(1, Ordering::SeqCst);
            let mut epoch = self.park.lock();
            let seen = *epoch;
            // Pairs with `notify_parked`: the parker pays for the ordering (see `barrier`).
            super::barrier::heavy(self.asymmetric);
            if let Some(v) = ready() {
                drop(epoch);
                self.parked.fetch_sub(1, Ordering::SeqCst);
                return Some(v);
            }
            let cap = if caller_mode {
                PARK_CAP_CALLER
            } else {
                PARK_CAP_THREAD
            };
            let mut until = StdInstant::now() + cap;
            if let Some(d) = deadline {
                until = until.min(d);
            }
            while *epoch == seen {
                if self.park_cv.wait_until(&mut epoch, until).timed_out() {
                    break;
                }
            }
            drop(epoch);
            self.parked.fetch_sub(1, Ordering::SeqCst);
            // Back from a park: take the spinner role if it is free, and spin again only after
            // new work.
            spinner = self.take_spinner();
            now = super::now();
            last_work =
                Instant::from_nanos(now.as_nanos().saturating_sub(budget.as_nanos() as u64));
        }
    }

    /// The spinner role of [`WorkerShared::wait_for`], if free.
    fn take_spinner(&self) -> Option<SpinnerGuard<'_>> {
        self.spinner
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| SpinnerGuard { shared: self })
    }

    /// True when a thread holds the spinner role.
    pub(crate) fn has_spinner(&self) -> bool {
        self.spinner.load(Ordering::Acquire)
    }
}

/// Holds the spinner role; giving it up wakes parked waiters so that one can take it.
struct SpinnerGuard<'a> {
    shared: &'a WorkerShared,
}

impl Drop for SpinnerGuard<'_> {
    fn drop(&mut self) {
        self.shared.spinner.store(false, Ordering::Release);
        self.shared.notify_parked();
    }
}

/// Why a channel stopped.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    Closed,
    PeerGone,
    /// The peer broke the protocol (what it did).
    Protocol(String),
    /// The peer refused the stream (`STREAM_REFUSED`).
    Refused,
    /// A message arrived that this end can never hold: above what its pool may register
    /// (`Config::pool_max_bytes`).
    TooLarge {
        len: u64,
        max: u64,
    },
    Error(String),
}

impl Failure {
    pub(crate) fn to_error(&self) -> ChannelError {
        match self {
            Failure::Closed => ChannelError::Closed,
            Failure::PeerGone => ChannelError::PeerGone,
            Failure::Protocol(s) => ChannelError::Protocol(s.clone()),
            Failure::Refused => ChannelError::StreamRefused,
            &Failure::TooLarge { len, max } => ChannelError::MessageTooLarge { len, max },
            Failure::Error(s) => ChannelError::Failed(s.clone()),
        }
    }

    /// What an RPC call on the stopped channel returns: `PeerGone` for a peer that went,
    /// the channel's error otherwise (`StreamRefused` for a refused stream).
    pub(crate) fn to_rpc_error(&self) -> RpcError {
        match self.to_error() {
            ChannelError::PeerGone => RpcError::PeerGone,
            e => RpcError::Channel(e),
        }
    }
}

/// One channel's (stream's) hand-off state.
pub(crate) struct ChannelShared {
    /// The stream's key on its worker (`worker::streams::StreamKey`).
    pub(crate) id: u64,
    pub(crate) worker: Arc<WorkerShared>,
    /// Largest message the connection's channel core takes (`Config::max_message_len`): a
    /// longer one is refused here, with [`ChannelError::MessageTooLarge`], before it is
    /// accepted — the core would drop it.
    pub(crate) max_len: u64,
    /// Delivered messages in order (the worker pushes, readers pop; waiters that poll look at
    /// it with one load).
    rx: DeliveryQueue,
    /// Why the stream stopped, once it did (`failed` is set after it).
    failure: Mutex<Option<Failure>>,
    pub(crate) rx_notify: tokio::sync::Notify,
    /// Async receivers waiting on `rx_notify` (a delivery notifies only when there are some).
    pub(crate) rx_async_waiters: AtomicUsize,
    /// Two counts in one word, so that a reservation is one atomic step: in the low 32 bits
    /// the messages accepted from this handle (or by the worker for RPC) and not yet completed
    /// (`OUTSTANDING`); in the high 32 bits the window units ([`window_units`]) of the data
    /// messages sent on this stream that the peer's application has not consumed, as far as
    /// its reports tell (`UNCONSUMED`): `send` blocks at the stream window, so a peer that
    /// stops reading this stream stops only this stream.
    sends: AtomicU64,
    /// Most outstanding (accepted, not yet acknowledged) messages before `send` blocks. Set to
    /// the channel's `max_queued` when the worker adopts it: messages the peer acknowledged
    /// but its application has not read hold the peer's receive slots (at most its ring), so
    /// with nobody reading a sender holds at most ring + `max_queued` messages.
    window: AtomicU64,
    /// Payload bytes of the outstanding messages above [`UNCOUNTED_BYTES`]: `send` blocks
    /// beyond [`WINDOW_BYTES`] (one message of any size is always let through), so a stream of
    /// large messages keeps a few in flight — enough to pipeline the peer's pulls — instead of
    /// `window` of them. Smaller messages are bounded by the window alone (`window` of them
    /// hold little), and skip the atomic steps.
    outstanding_bytes: AtomicU64,
    /// The connection's stream window (negotiated in the handshake): `send` waits while the
    /// unconsumed count of `sends` is at it, and the worker fails a connection whose peer
    /// leaves more than that waiting here. Set once (atomic for tests that ignore it).
    stream_window: AtomicU64,
    /// Consumed window units after which the worker is told (a quarter of the window): a
    /// report goes out then even if the stream sends nothing.
    pub(crate) report_every: u64,
    pub(crate) tx_notify: tokio::sync::Notify,
    /// Async senders waiting on `tx_notify` (it is only notified when there are some).
    pub(crate) tx_async_waiters: AtomicUsize,
    failed: AtomicBool,
    /// How many of the window units the application consumed (`DeliveryQueue::taken`) the
    /// worker has counted into stream window reports: it takes the rest whenever it sends a message
    /// of the stream (the count rides on it), and is told (`Released`) only when a report's
    /// worth (`report_every`) built up, so a stream of receives costs no worker call and no
    /// locked instruction per message. Written by the holder of the worker's lock only.
    reported: AtomicU64,
    /// The application asked the worker for a report (`Released`) that it has not taken yet.
    report_asked: AtomicBool,
    /// Window units of the messages handed straight to a reading thread (`super::Handoff`),
    /// which never went through `rx`: with `rx`'s count of reads, what the application
    /// consumed. Written by the holder of the worker's lock only.
    handed: AtomicU64,
    /// RPC replies of this stream's calls that ended the pass of the thread waiting for them
    /// (`super::Handoff`). Written by the holder of the worker's lock only.
    replies_handed: AtomicU64,
}

impl ChannelShared {
    pub(crate) fn new(
        id: u64,
        worker: Arc<WorkerShared>,
        window: u64,
        stream_window: u32,
        max_len: u64,
    ) -> ChannelShared {
        let stream_window = u64::from(stream_window.max(4));
        ChannelShared {
            id,
            worker,
            max_len,
            rx: DeliveryQueue::new(stream_window),
            failure: Mutex::new(None),
            rx_notify: tokio::sync::Notify::new(),
            rx_async_waiters: AtomicUsize::new(0),
            sends: AtomicU64::new(0),
            window: AtomicU64::new(window),
            outstanding_bytes: AtomicU64::new(0),
            stream_window: AtomicU64::new(stream_window),
            report_every: (stream_window / 4).max(1),
            tx_notify: tokio::sync::Notify::new(),
            tx_async_waiters: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            reported: AtomicU64::new(0),
            report_asked: AtomicBool::new(false),
            handed: AtomicU64::new(0),
            replies_handed: AtomicU64::new(0),
        }
    }

    /// Worker: a message for the application (blocking waiters are woken by the progress pass
    /// that delivered it). Returns the window units of the messages that now wait.
    pub(crate) fn deliver(&self, m: Message) -> u64 {
        let waiting = self.rx.push(m);
        // Pairs with `recv_async`'s count-then-look, whose look takes the queue's lock: either
        // its look comes after this push (it sees the message), or its count happened before
        // its look's unlock, which this push's lock came after (this sees it waiting). The
        // lock orders the two without a fence on every delivery.
        if self.rx_async_waiters.load(Ordering::Acquire) > 0 {
            self.rx_notify.notify_one();
        }
        waiting
    }

    /// The connection's stream window: window units ([`window_units`]) of data messages either
    /// end may hold unconsumed.
    pub(crate) fn stream_window(&self) -> u64 {
        self.stream_window.load(Ordering::Relaxed)
    }

    /// The window units of a data message of `len` payload bytes on this stream.
    pub(crate) fn window_units(&self, len: u64) -> u64 {
        if len <= WINDOW_UNIT {
            1
        } else {
            window_units(len, self.stream_window())
        }
    }

    /// Let this end send past the stream window, as a peer that ignores it would.
    #[cfg(test)]
    pub(crate) fn ignore_stream_window(&self) {
        self.stream_window
            .store(u64::from(u32::MAX >> 1), Ordering::Relaxed);
    }

    /// Worker: the stream closed here; drop what the application never read. Returns how many
    /// messages that was (their receive slots' credits go back to the peer).
    pub(crate) fn discard(&self) -> u64 {
        self.rx.clear()
    }

    /// Worker: the channel stopped.
    pub(crate) fn fail(&self, f: Failure) {
        {
            let mut failure = self.failure.lock();
            if failure.is_none() {
                *failure = Some(f);
            }
        }
        self.failed.store(true, Ordering::SeqCst);
        self.rx_notify.notify_waiters();
        self.rx_notify.notify_one();
        self.tx_notify.notify_waiters();
        self.worker.notify_parked();
    }

    pub(crate) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    pub(crate) fn failure(&self) -> Option<Failure> {
        self.failure.lock().clone()
    }

    /// Worker: the consumed messages not yet counted into a report (a plain load when there are
    /// none, the common case of a stream that sends as often as it reads).
    pub(crate) fn take_released(&self) -> u64 {
        // Whatever this finds, an ask made before it is answered (an ask made on a stale
        // `reported` may find nothing left to take: it must not stay set, or the reader would
        // never ask again).
        if self.report_asked.load(Ordering::Acquire) {
            self.report_asked.store(false, Ordering::Release);
        }
        let taken = self.consumed();
        // Only the holder of the worker's lock writes `reported`.
        let reported = self.reported.load(Ordering::Relaxed);
        if taken == reported {
            return 0;
        }
        self.reported.store(taken, Ordering::Release);
        taken.wrapping_sub(reported)
    }

    /// Window units the application consumed: read from the delivery queue or handed over.
    fn consumed(&self) -> u64 {
        self.rx
            .taken()
            .wrapping_add(self.handed.load(Ordering::Acquire))
    }

    /// Worker: no delivered message waits to be read (one that arrives now may be handed
    /// straight to a reading thread without passing one).
    pub(crate) fn nothing_waiting(&self) -> bool {
        self.rx.is_empty()
    }

    /// Window units of the messages handed straight to a reading thread so far.
    #[cfg(test)]
    pub(crate) fn handed_count(&self) -> u64 {
        self.handed.load(Ordering::Acquire)
    }

    /// Worker (holding its lock): a message of `units` was handed straight to a reading
    /// thread.
    pub(crate) fn count_handed(&self, units: u64) {
        let n = self.handed.load(Ordering::Relaxed);
        self.handed.store(n.wrapping_add(units), Ordering::Release);
    }

    /// RPC replies that ended the pass of the thread waiting for them.
    #[cfg(test)]
    pub(crate) fn replies_handed_count(&self) -> u64 {
        self.replies_handed.load(Ordering::Acquire)
    }

    /// Worker (holding its lock): the reply of the call the thread running the pass waits for
    /// went to it, and the pass ends.
    pub(crate) fn count_reply_handed(&self) {
        let n = self.replies_handed.load(Ordering::Relaxed);
        self.replies_handed
            .store(n.wrapping_add(1), Ordering::Release);
    }

    /// Application, after a read: true when a report's worth of consumed messages built up
    /// that the worker has not taken, and nobody asked it to yet (this call now has).
    pub(crate) fn report_due(&self) -> bool {
        let unreported = self
            .consumed()
            .wrapping_sub(self.reported.load(Ordering::Acquire));
        unreported >= self.report_every
            && !self.report_asked.load(Ordering::Acquire)
            && !self.report_asked.swap(true, Ordering::AcqRel)
    }

    /// Worker: the window, once the channel's settings are known.
    pub(crate) fn set_window(&self, messages: u64) {
        // Below 2^31: the outstanding count of `sends` never reaches its neighbour's bits.
        self.window.store(
            messages.clamp(1, u64::from(u32::MAX >> 1)),
            Ordering::Relaxed,
        );
    }

    /// Worker: `n` sends of `bytes` payload bytes completed (or room opened: 0, 0). `bytes`
    /// is one message's length when `n` is 1 (only a large one was counted).
    pub(crate) fn send_progress(&self, n: u64, bytes: u64) {
        if n > 0 {
            self.sends.fetch_sub(n * OUTSTANDING, Ordering::AcqRel);
            let counted = counted_bytes(bytes);
            if counted > 0 {
                self.outstanding_bytes.fetch_sub(counted, Ordering::AcqRel);
            }
        }
        if self.tx_async_waiters.load(Ordering::SeqCst) > 0 {
            self.tx_notify.notify_waiters();
        }
    }

    /// Worker: the peer's application consumed `n` more messages of this stream (a count from
    /// the peer: never below zero, whatever it says).
    pub(crate) fn peer_consumed(&self, n: u64) {
        let _ = self
            .sends
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                let unconsumed = (v / UNCONSUMED).saturating_sub(n);
                Some(unconsumed * UNCONSUMED + v % UNCONSUMED)
            });
        if self.tx_async_waiters.load(Ordering::SeqCst) > 0 {
            self.tx_notify.notify_waiters();
        }
    }

    /// A reserved message of `bytes` that never left: its reservation ends.
    pub(crate) fn cancel_reservation(&self, bytes: u64) {
        self.peer_consumed(self.window_units(bytes));
        self.send_progress(1, bytes);
    }

    /// Worker: a message of `bytes` it queued itself (RPC request or reply) counts in the window.
    pub(crate) fn count_in(&self, bytes: u64) {
        self.sends.fetch_add(OUTSTANDING, Ordering::AcqRel);
        let counted = counted_bytes(bytes);
        if counted > 0 {
            self.outstanding_bytes.fetch_add(counted, Ordering::AcqRel);
        }
    }

    /// Application: reserve a send slot for `len` payload bytes, or `WouldBlock`.
    pub(crate) fn try_reserve(&self, len: usize) -> Result<(), ChannelError> {
        if let Some(f) = self.failure_if_failed() {
            return Err(f.to_error());
        }
        if len as u64 > self.max_len {
            return Err(ChannelError::MessageTooLarge {
                len: len as u64,
                max: self.max_len,
            });
        }
        let counted = counted_bytes(len as u64);
        if counted > 0 {
            let bytes = self.outstanding_bytes.load(Ordering::Acquire);
            if bytes > 0 && bytes.saturating_add(counted) > WINDOW_BYTES {
                return Err(ChannelError::WouldBlock);
            }
        }
        let window = self.window.load(Ordering::Relaxed);
        let stream_window = self.stream_window();
        let units = window_units(len as u64, stream_window);
        let mut cur = self.sends.load(Ordering::Acquire);
        loop {
            if cur % UNCONSUMED >= window || cur / UNCONSUMED + units > stream_window {
                return Err(ChannelError::WouldBlock);
            }
            match self.sends.compare_exchange_weak(
                cur,
                cur + OUTSTANDING + units * UNCONSUMED,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    // Racing reservations may overshoot the byte bound by a message each: it
                    // is a soft bound.
                    if counted > 0 {
                        self.outstanding_bytes.fetch_add(counted, Ordering::AcqRel);
                    }
                    return Ok(());
                }
                Err(v) => cur = v,
            }
        }
    }

    /// Application: reserve room for `len` bytes, waiting up to `timeout` (progressing the
    /// worker meanwhile where it can).
    pub(crate) fn reserve(
        &self,
        len: usize,
        timeout: Option<Duration>,
    ) -> Result<(), ChannelError> {
        match self.try_reserve(len) {
            Err(ChannelError::WouldBlock) => {}
            other => return other,
        }
        if self.worker.held_here() {
            // A handler of this worker: room comes with acknowledgements this worker reads
            // only after it returns.
            return Err(ChannelError::WouldDeadlock);
        }
        let deadline = match timeout {
            Some(t) => Some(StdInstant::now() + t),
            None => self.worker.handler_deadline(),
        };
        self.worker
            .wait_for(deadline, || match self.try_reserve(len) {
                Err(ChannelError::WouldBlock) => None,
                other => Some(other),
            })
            .unwrap_or(Err(ChannelError::Timeout))
    }

    fn failure_if_failed(&self) -> Option<Failure> {
        if self.is_failed() {
            self.failure()
        } else {
            None
        }
    }

    /// Application: take a delivered message without waiting.
    pub(crate) fn try_take(&self) -> Result<Option<Message>, ChannelError> {
        // An empty queue is told by one load, without its lock.
        if let Some(m) = self.rx.pop() {
            return Ok(Some(m));
        }
        if !self.is_failed() {
            return Ok(None);
        }
        // Stopped: what was delivered before the failure is still read first.
        if let Some(m) = self.rx.pop() {
            return Ok(Some(m));
        }
        Err(self.failure().unwrap_or(Failure::Closed).to_error())
    }

    /// [`ChannelShared::try_take`] that looks at the queue under its lock (for a waiter that
    /// counted itself in `rx_async_waiters` just before: see [`ChannelShared::deliver`]).
    pub(crate) fn try_take_locked(&self) -> Result<Option<Message>, ChannelError> {
        if let Some(m) = self.rx.pop_locked() {
            return Ok(Some(m));
        }
        self.try_take()
    }

    /// Application: take a delivered message, waiting up to `timeout` (`None`: forever).
    pub(crate) fn take(&self, timeout: Option<Duration>) -> Result<Message, ChannelError> {
        if let Some(m) = self.try_take()? {
            return Ok(m);
        }
        // A message already in the CQ is taken with one pass and no clock read (handed over
        // by the pass, when nothing waited before it).
        if let Some((n, handed)) = self.worker.try_progress_reading(None, self.id) {
            if let Some(m) = handed {
                return Ok(m);
            }
            if n > 0 {
                if let Some(m) = self.try_take()? {
                    return Ok(m);
                }
            }
        }
        if self.worker.held_here() {
            // A handler of this worker: nothing more arrives before it returns.
            return Err(ChannelError::WouldDeadlock);
        }
        let deadline = match timeout {
            Some(t) => Some(StdInstant::now() + t),
            None => self.worker.handler_deadline(),
        };
        let handed = Cell::new(None);
        self.worker
            .wait_reading(
                deadline,
                Awaited::Message(self.id, &handed),
                || match handed.take() {
                    Some(m) => Some(Ok(m)),
                    None => self.try_take().transpose(),
                },
            )
            .unwrap_or(Err(ChannelError::Timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lingering connection whose peer stays silent is polled less and less often (at most
    /// every millisecond), and as often as at first again once a pass finds work.
    #[test]
    fn the_linger_poll_backs_off_while_nothing_comes() {
        let mut p = LINGER_POLL;
        let mut seen = vec![p];
        for _ in 0..8 {
            p = next_linger_poll(p, false);
            seen.push(p);
        }
        assert_eq!(seen[1], LINGER_POLL * 2);
        assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{seen:?}");
        assert_eq!(p, LINGER_POLL_MAX);
        assert_eq!(next_linger_poll(p, true), LINGER_POLL);
    }
    use crate::channel::proto::EagerBytes;
    use crate::channel::TraceHeader;
    use crate::message::Payload;

    fn channel(window: u64, stream_window: u32) -> ChannelShared {
        let worker = Arc::new(WorkerShared::new(0).expect("worker"));
        ChannelShared::new(1, worker, window, stream_window, u64::MAX)
    }

    fn deliver(ch: &ChannelShared, seq: u64) {
        ch.deliver(Message {
            payload: Payload::Eager(EagerBytes::from_slice(&seq.to_le_bytes())),
            trace: TraceHeader::default(),
            seq,
            recycle: None,
        });
    }

    fn read(ch: &ChannelShared, n: u64) {
        for _ in 0..n {
            assert!(ch.try_take().expect("take").is_some());
        }
    }

    /// The reader asks for a report once a quarter window is consumed and not taken; an ask
    /// made on a stale count (the worker took the count, with the message it sent, between
    /// the reader's look and its ask) finds nothing left, and must still be cleared, or the
    /// reader would never ask again and a peer that only sends would stop at the window.
    #[test]
    fn a_report_ask_is_cleared_even_when_the_count_was_already_taken() {
        let ch = channel(64, 16); // a report every 4 messages
        for seq in 1..=12 {
            deliver(&ch, seq);
        }
        read(&ch, 3);
        assert!(!ch.report_due(), "3 < a quarter window");
        read(&ch, 1);
        assert!(ch.report_due(), "4 consumed: ask");
        assert!(!ch.report_due(), "asked already");
        assert_eq!(ch.take_released(), 4);
        // The worker took the next count with a message of its own; then an ask based on the
        // count before that lands.
        read(&ch, 4);
        assert_eq!(ch.take_released(), 4);
        ch.report_asked.store(true, Ordering::Release);
        assert_eq!(ch.take_released(), 0, "nothing left to take");
        read(&ch, 4);
        assert!(
            ch.report_due(),
            "the reader asks again after the next quarter window"
        );
        assert_eq!(ch.take_released(), 4);
    }

    /// One word holds the outstanding and unconsumed counts: the send window and the stream
    /// window each stop `try_reserve`, completions and the peer's reports open them, and a
    /// peer reporting more than was sent does not reach into the outstanding count.
    #[test]
    fn reservations_stop_at_either_window_and_reports_never_underflow() {
        let ch = channel(3, 4); // window of 3 messages, stream window of 4
        for _ in 0..3 {
            ch.try_reserve(8).expect("reserve");
        }
        assert!(matches!(ch.try_reserve(8), Err(ChannelError::WouldBlock)));
        ch.send_progress(1, 8);
        ch.try_reserve(8)
            .expect("a completion opens the send window");
        assert!(matches!(ch.try_reserve(8), Err(ChannelError::WouldBlock)));
        // 4 unconsumed: the stream window; 3 outstanding after two completions.
        ch.send_progress(1, 8);
        ch.send_progress(1, 8);
        assert!(
            matches!(ch.try_reserve(8), Err(ChannelError::WouldBlock)),
            "the peer consumed none of 4"
        );
        ch.peer_consumed(1_000_000);
        assert_eq!(ch.sends.load(Ordering::Acquire) / UNCONSUMED, 0);
        assert_eq!(ch.sends.load(Ordering::Acquire) % UNCONSUMED, 1);
        ch.try_reserve(8).expect("reports open the stream window");
        ch.try_reserve(8).expect("two outstanding of three");
        assert!(matches!(ch.try_reserve(8), Err(ChannelError::WouldBlock)));
    }

    /// Only messages above `UNCOUNTED_BYTES` count in the byte bound, which lets one large
    /// message through and holds the next beyond `WINDOW_BYTES`.
    #[test]
    fn the_byte_bound_counts_large_messages_only() {
        let ch = channel(64, 64);
        let big = (WINDOW_BYTES / 2 + 1) as usize;
        ch.try_reserve(8).expect("small");
        assert_eq!(ch.outstanding_bytes.load(Ordering::Acquire), 0);
        ch.try_reserve(big).expect("the first large message");
        assert!(matches!(ch.try_reserve(big), Err(ChannelError::WouldBlock)));
        ch.try_reserve(8).expect("small ones still go");
        ch.send_progress(1, big as u64);
        assert_eq!(ch.outstanding_bytes.load(Ordering::Acquire), 0);
        ch.try_reserve(big).expect("room again");
    }
}
