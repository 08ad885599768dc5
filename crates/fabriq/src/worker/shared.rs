//! State shared between a worker thread and the application threads: the worker's inbox and
//! wake-up (a lock-free queue plus an eventfd written only when the worker sleeps), and each
//! channel's delivery queue and send window. Only the worker mutates protocol state; these are
//! the hand-off points.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_queue::SegQueue;
use parking_lot::{Condvar, Mutex};

use super::Command;
use crate::channel::ChannelError;
use crate::message::Message;

/// How long a receiving thread polls its delivery queue before sleeping on the condvar.
const RECV_SPIN: Duration = Duration::from_micros(20);

/// The worker's side of the hand-off: inbox and wake-up.
pub(crate) struct WorkerShared {
    pub(crate) id: usize,
    inbox: SegQueue<Command>,
    /// True while the worker is (about to be) asleep in epoll.
    sleeping: AtomicBool,
    wake_fd: OwnedFd,
    /// Wake-ups written (for tests and stats).
    pub(crate) wakeups: AtomicU64,
}

impl WorkerShared {
    pub(crate) fn new(id: usize) -> std::io::Result<WorkerShared> {
        let wake_fd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )?;
        Ok(WorkerShared {
            id,
            inbox: SegQueue::new(),
            sleeping: AtomicBool::new(false),
            wake_fd,
            wakeups: AtomicU64::new(0),
        })
    }

    /// Hand a command to the worker, waking it if it sleeps.
    pub(crate) fn submit(&self, cmd: Command) {
        self.inbox.push(cmd);
        // Pairs with the fence in `prepare_sleep`: either the worker sees the command, or we
        // see it sleeping and wake it.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.wake();
        }
    }

    /// Write the eventfd.
    pub(crate) fn wake(&self) {
        self.wakeups.fetch_add(1, Ordering::Relaxed);
        let _ = rustix::io::write(&self.wake_fd, &1u64.to_ne_bytes());
    }

    pub(crate) fn pop(&self) -> Option<Command> {
        self.inbox.pop()
    }

    /// Announce sleep; false if work arrived meanwhile (then don't sleep).
    pub(crate) fn prepare_sleep(&self) -> bool {
        self.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !self.inbox.is_empty() {
            self.sleeping.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    pub(crate) fn woke(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.wake_fd, &mut buf);
    }

    pub(crate) fn wake_fd(&self) -> &OwnedFd {
        &self.wake_fd
    }
}

/// Why a channel stopped.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    Closed,
    PeerGone,
    Error(String),
}

impl Failure {
    pub(crate) fn to_error(&self) -> ChannelError {
        match self {
            Failure::Closed => ChannelError::Closed,
            Failure::PeerGone => ChannelError::PeerGone,
            Failure::Error(s) => ChannelError::Failed(s.clone()),
        }
    }
}

struct Rx {
    queue: VecDeque<Message>,
    failure: Option<Failure>,
}

/// One channel's hand-off state.
pub(crate) struct ChannelShared {
    pub(crate) id: u32,
    pub(crate) worker: Arc<WorkerShared>,
    rx: Mutex<Rx>,
    rx_cv: Condvar,
    pub(crate) rx_notify: tokio::sync::Notify,
    /// Messages accepted from this handle (or by the worker for RPC) and not yet completed.
    pub(crate) outstanding: AtomicU64,
    /// Most outstanding messages before `send` blocks.
    pub(crate) window: u64,
    tx_lock: Mutex<()>,
    tx_cv: Condvar,
    pub(crate) tx_notify: tokio::sync::Notify,
    failed: AtomicBool,
    /// Messages the application consumed whose credits the worker has not yet taken; a
    /// `Released` command is sent only when this leaves zero, so a stream of receives costs
    /// one inbox push per batch, not per message.
    pub(crate) released: AtomicU64,
}

impl ChannelShared {
    pub(crate) fn new(id: u32, worker: Arc<WorkerShared>, window: u64) -> ChannelShared {
        ChannelShared {
            id,
            worker,
            rx: Mutex::new(Rx {
                queue: VecDeque::new(),
                failure: None,
            }),
            rx_cv: Condvar::new(),
            rx_notify: tokio::sync::Notify::new(),
            outstanding: AtomicU64::new(0),
            window,
            tx_lock: Mutex::new(()),
            tx_cv: Condvar::new(),
            tx_notify: tokio::sync::Notify::new(),
            failed: AtomicBool::new(false),
            released: AtomicU64::new(0),
        }
    }

    /// Worker: a message for the application.
    pub(crate) fn deliver(&self, m: Message) {
        self.rx.lock().queue.push_back(m);
        self.rx_cv.notify_one();
        self.rx_notify.notify_one();
    }

    /// Worker: the channel stopped.
    pub(crate) fn fail(&self, f: Failure) {
        {
            let mut rx = self.rx.lock();
            if rx.failure.is_none() {
                rx.failure = Some(f);
            }
        }
        self.failed.store(true, Ordering::SeqCst);
        self.rx_cv.notify_all();
        self.rx_notify.notify_waiters();
        self.rx_notify.notify_one();
        self.send_progress(0);
    }

    pub(crate) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    pub(crate) fn failure(&self) -> Option<Failure> {
        self.rx.lock().failure.clone()
    }

    /// Worker: `n` sends completed.
    pub(crate) fn send_progress(&self, n: u64) {
        if n > 0 {
            self.outstanding.fetch_sub(n, Ordering::AcqRel);
        }
        let _g = self.tx_lock.lock();
        self.tx_cv.notify_all();
        drop(_g);
        self.tx_notify.notify_waiters();
    }

    /// Application: reserve a send slot, or `WouldBlock`.
    pub(crate) fn try_reserve(&self) -> Result<(), ChannelError> {
        if let Some(f) = self.failure_if_failed() {
            return Err(f.to_error());
        }
        let mut cur = self.outstanding.load(Ordering::Acquire);
        loop {
            if cur >= self.window {
                return Err(ChannelError::WouldBlock);
            }
            match self.outstanding.compare_exchange_weak(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(v) => cur = v,
            }
        }
    }

    /// Application: reserve, waiting up to `timeout` for room.
    pub(crate) fn reserve(&self, timeout: Option<Duration>) -> Result<(), ChannelError> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            match self.try_reserve() {
                Err(ChannelError::WouldBlock) => {}
                other => return other,
            }
            let mut g = self.tx_lock.lock();
            if self.outstanding.load(Ordering::Acquire) < self.window || self.is_failed() {
                continue;
            }
            match deadline {
                Some(d) => {
                    if self.tx_cv.wait_until(&mut g, d).timed_out() {
                        return Err(ChannelError::Timeout);
                    }
                }
                None => {
                    // A bounded wait guards against a missed notification.
                    self.tx_cv.wait_for(&mut g, Duration::from_millis(100));
                }
            }
        }
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
        let mut rx = self.rx.lock();
        if let Some(m) = rx.queue.pop_front() {
            return Ok(Some(m));
        }
        match &rx.failure {
            Some(f) => Err(f.to_error()),
            None => Ok(None),
        }
    }

    /// Application: take a delivered message, waiting up to `timeout` (`None`: forever).
    pub(crate) fn take(&self, timeout: Option<Duration>) -> Result<Message, ChannelError> {
        let start = std::time::Instant::now();
        let deadline = timeout.map(|t| start + t);
        // Spin briefly before sleeping: a reply usually arrives within microseconds, and a
        // condvar wake-up costs more than that.
        let mut spins = 0u32;
        while start.elapsed() < RECV_SPIN {
            if let Some(m) = self.try_take()? {
                return Ok(m);
            }
            spins += 1;
            if spins % 64 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let mut rx = self.rx.lock();
        loop {
            if let Some(m) = rx.queue.pop_front() {
                return Ok(m);
            }
            if let Some(f) = &rx.failure {
                return Err(f.to_error());
            }
            match deadline {
                Some(d) => {
                    if self.rx_cv.wait_until(&mut rx, d).timed_out() && rx.queue.is_empty() {
                        if let Some(f) = &rx.failure {
                            return Err(f.to_error());
                        }
                        return Err(ChannelError::Timeout);
                    }
                }
                None => self.rx_cv.wait(&mut rx),
            }
        }
    }
}
