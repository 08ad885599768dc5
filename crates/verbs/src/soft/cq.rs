//! [`SoftCq`]: a bounded, thread-safe completion queue with overflow detection and an event fd.
//!
//! Owns: the queued completions, the overflow flag, the arm state and the eventfd. Producers are
//! progress engines (any thread), the consumer is the poller. A poll on an empty queue reads one
//! atomic and takes no lock. Overflow is sticky and never silent: once a completion could not be
//! queued, every `poll` answers [`VerbsError::CqOverflow`] (the queue is in error, as
//! `IBV_EVENT_CQ_ERR` puts it).
//!
//! A provider that progresses from the polling thread (busy-poll mode) installs a
//! [`ProgressHook`]; `poll` calls it before looking at the queue.
//!
//! Waking: the eventfd is what `epoll`-based consumers watch (one consumer per CQ, the
//! `ibv_get_cq_event` model). [`CqOps::wait_event`] does not rely on it alone: several threads
//! may block on one CQ (`CompletionQueue::poll_blocking` from many threads), and one eventfd
//! write consumed by the first waiter's `ack_events` must not leave the others asleep while
//! completions are queued. A waiter therefore sleeps on a condition variable and wakes when the
//! eventfd holds an unconsumed event, or when completions are queued and the arm was already
//! used up (by a completion whose event another waiter may have consumed). A producer disarms
//! and writes the eventfd under the waiters' lock, so a waiter never sees the arm used up
//! without the event written. The queue length, the arm word and the sleeper count are
//! `SeqCst`: a producer stores the length and then reads the arm / sleepers, a consumer stores
//! the arm / sleepers and then reads the length, and one of the two must see the other.

use std::any::Any;
use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::provider::CqOps;
use crate::{Result, VerbsError, WorkCompletion};

/// Something a poller may drive before polling (a provider's progress engine).
pub trait ProgressHook: Send + Sync + 'static {
    /// Make progress without blocking. `stays`: the poller keeps polling; false for a poller
    /// that has armed the CQ and is about to sleep (the re-poll of poll → arm → poll → wait),
    /// which must not count as a poller that stays.
    fn drive(&self, stays: bool);
    /// A poller armed the CQ to sleep on its event: whatever the engine left to pollers it must
    /// take back now.
    fn poller_leaving(&self) {}
}

const UNARMED: u8 = 0;
const ARMED_SOLICITED: u8 = 1;
const ARMED_ALL: u8 = 2;

/// A software completion queue: a cheap handle (clones are the same queue), so a provider can
/// take it out of a [`crate::CompletionQueue`] with `as_any().downcast_ref::<SoftCq>()`.
#[derive(Clone)]
pub struct SoftCq {
    inner: Arc<CqInner>,
}

impl std::ops::Deref for SoftCq {
    type Target = CqInner;
    fn deref(&self) -> &CqInner {
        &self.inner
    }
}

/// The shared state behind a [`SoftCq`].
pub struct CqInner {
    capacity: u32,
    /// Number of queued completions; read without the lock by `poll` (fast path).
    len: AtomicUsize,
    queue: Mutex<VecDeque<WorkCompletion>>,
    overflowed: AtomicBool,
    armed: AtomicU8,
    event: OwnedFd,
    hook: OnceLock<Weak<dyn ProgressHook>>,
    /// Threads inside `wait_event`.
    sleepers: AtomicUsize,
    sleep_lock: Mutex<()>,
    sleep_cv: Condvar,
}

impl std::fmt::Debug for CqInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftCq")
            .field("capacity", &self.capacity)
            .field("len", &self.len.load(Ordering::Relaxed))
            .field("overflowed", &self.overflowed.load(Ordering::Relaxed))
            .finish()
    }
}

impl std::fmt::Debug for SoftCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl SoftCq {
    /// A queue holding `capacity` completions.
    pub fn new(capacity: u32) -> Result<SoftCq> {
        use rustix::event::{eventfd, EventfdFlags};
        let event = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)
            .map_err(|e| VerbsError::io("create CQ eventfd", e))?;
        Ok(SoftCq {
            inner: Arc::new(CqInner {
                capacity,
                len: AtomicUsize::new(0),
                queue: Mutex::new(VecDeque::with_capacity(capacity.min(4096) as usize)),
                overflowed: AtomicBool::new(false),
                armed: AtomicU8::new(UNARMED),
                event,
                hook: OnceLock::new(),
                sleepers: AtomicUsize::new(0),
                sleep_lock: Mutex::new(()),
                sleep_cv: Condvar::new(),
            }),
        })
    }
}

impl CqInner {
    /// Install the progress hook `poll` drives (once; later calls are ignored).
    pub fn set_progress_hook(&self, hook: Weak<dyn ProgressHook>) {
        let _ = self.hook.set(hook);
    }

    /// Queue a completion. `solicited` marks a completion that fires a solicited-only arm (error
    /// completions always do). Returns false, and puts the queue in error, on overflow.
    pub fn push(&self, wc: WorkCompletion, solicited: bool) -> bool {
        let ok = {
            let mut q = self.queue.lock();
            if q.len() >= self.capacity as usize || self.overflowed.load(Ordering::Relaxed) {
                self.overflowed.store(true, Ordering::Release);
                false
            } else {
                q.push_back(wc);
                self.len.store(q.len(), Ordering::SeqCst);
                true
            }
        };
        if !ok {
            tracing::warn!(
                capacity = self.capacity,
                wr_id = wc.wr_id,
                "completion queue overflow"
            );
        }
        self.notify(solicited || !wc.status.is_success() || !ok);
        self.wake_sleepers();
        ok
    }

    fn notify(&self, solicited: bool) {
        let armed = self.armed.load(Ordering::SeqCst);
        if armed == UNARMED || (armed == ARMED_SOLICITED && !solicited) {
            return;
        }
        // Disarm and write under `sleep_lock`: a thread in `wait_event` that finds the CQ
        // disarmed with completions queued then also finds the event on the fd.
        let _guard = self.sleep_lock.lock();
        if self
            .armed
            .compare_exchange(armed, UNARMED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            // A full counter (never in practice) only means the fd is already readable.
            let _ = rustix::io::write(&self.event, &1u64.to_ne_bytes());
        }
    }

    /// Wake the threads blocked in `wait_event`, if any (after the queue or the eventfd
    /// changed).
    fn wake_sleepers(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.sleep_lock.lock();
            self.sleep_cv.notify_all();
        }
    }

    /// Whether a thread in `wait_event` (holding `sleep_lock`) may stop waiting: the queue
    /// overflowed, completions are queued and the arm is used up (its event fired, perhaps
    /// consumed by another waiter; a solicited-only arm stays until a solicited completion), or
    /// an event is unconsumed.
    fn waiter_ready(&self) -> Result<bool> {
        if self.overflowed.load(Ordering::SeqCst) {
            return Ok(true);
        }
        if self.len.load(Ordering::SeqCst) > 0 && self.armed.load(Ordering::SeqCst) == UNARMED {
            return Ok(true);
        }
        crate::provider::wait_readable(self.event.as_fd(), Some(Duration::ZERO))
    }

    /// Queued completions.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::SeqCst)
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True once a completion was lost.
    pub fn is_overflowed(&self) -> bool {
        self.overflowed.load(Ordering::Acquire)
    }

    /// Poll without driving the progress hook.
    pub fn poll_queue(&self, wc: &mut [WorkCompletion]) -> Result<usize> {
        if self.overflowed.load(Ordering::Acquire) {
            return Err(VerbsError::CqOverflow {
                capacity: self.capacity,
            });
        }
        if wc.is_empty() || self.len.load(Ordering::SeqCst) == 0 {
            return Ok(0);
        }
        let mut q = self.queue.lock();
        let n = wc.len().min(q.len());
        for (slot, c) in wc.iter_mut().zip(q.drain(..n)) {
            *slot = c;
        }
        self.len.store(q.len(), Ordering::SeqCst);
        Ok(n)
    }
}

impl CqOps for SoftCq {
    fn capacity(&self) -> u32 {
        self.capacity
    }

    #[inline]
    fn poll(&self, wc: &mut [WorkCompletion]) -> Result<usize> {
        // Drive progress only when the queue alone cannot fill the caller's array: queued
        // completions are returned without a system call.
        if self.len.load(Ordering::SeqCst) < wc.len() {
            if let Some(hook) = self.hook.get().and_then(Weak::upgrade) {
                hook.drive(self.armed.load(Ordering::Relaxed) == UNARMED);
            }
        }
        self.poll_queue(wc)
    }

    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        let want = if solicited_only {
            ARMED_SOLICITED
        } else {
            ARMED_ALL
        };
        // Arming for all completions widens an existing solicited-only arm, never narrows it.
        self.armed.fetch_max(want, Ordering::SeqCst);
        if let Some(hook) = self.hook.get().and_then(Weak::upgrade) {
            hook.poller_leaving();
        }
        Ok(())
    }

    fn wait_event(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut guard = self.sleep_lock.lock();
        // Announce the sleeper before the first check: a producer that queues after the check
        // sees the count and takes `sleep_lock` to notify, so the wake-up cannot fall between
        // the check and the wait.
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let ready = loop {
            match self.waiter_ready() {
                Ok(false) => {}
                done => break done,
            }
            match deadline {
                Some(d) => {
                    if self.sleep_cv.wait_until(&mut guard, d).timed_out() {
                        break self.waiter_ready();
                    }
                }
                None => self.sleep_cv.wait(&mut guard),
            }
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        ready
    }

    fn event_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.event.as_fd())
    }

    fn ack_events(&self) -> Result<u32> {
        let mut buf = [0u8; 8];
        match rustix::io::read(&self.event, &mut buf) {
            Ok(8) => Ok(u32::try_from(u64::from_ne_bytes(buf)).unwrap_or(u32::MAX)),
            Ok(_) => Ok(0),
            Err(rustix::io::Errno::AGAIN) => Ok(0),
            Err(e) => Err(VerbsError::io("read CQ eventfd", e)),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{QpNum, WcOpcode, WcStatus};

    fn wc(id: u64) -> WorkCompletion {
        WorkCompletion {
            wr_id: id,
            qp_num: QpNum(1),
            ..WorkCompletion::EMPTY
        }
    }

    #[test]
    fn fifo_and_partial_polls() {
        let cq = SoftCq::new(8).unwrap();
        for i in 0..5 {
            assert!(cq.push(wc(i), false));
        }
        let mut out = [WorkCompletion::EMPTY; 3];
        assert_eq!(cq.poll(&mut out).unwrap(), 3);
        assert_eq!(out.map(|w| w.wr_id), [0, 1, 2]);
        assert_eq!(cq.poll(&mut out).unwrap(), 2);
        assert_eq!([out[0].wr_id, out[1].wr_id], [3, 4]);
        assert_eq!(cq.poll(&mut out).unwrap(), 0);
    }

    #[test]
    fn overflow_is_reported_and_sticky() {
        let cq = SoftCq::new(2).unwrap();
        assert!(cq.push(wc(1), false));
        assert!(cq.push(wc(2), false));
        assert!(!cq.push(wc(3), false));
        let mut out = [WorkCompletion::EMPTY; 4];
        for _ in 0..2 {
            assert!(matches!(
                cq.poll(&mut out),
                Err(VerbsError::CqOverflow { capacity: 2 })
            ));
        }
    }

    #[test]
    fn armed_cq_signals_its_event_fd_once() {
        let cq = SoftCq::new(4).unwrap();
        cq.push(wc(1), false);
        // Not armed: no event.
        assert_eq!(cq.ack_events().unwrap(), 0);
        cq.req_notify(false).unwrap();
        cq.push(wc(2), false);
        cq.push(wc(3), false);
        assert!(cq.wait_event(Some(Duration::from_secs(5))).unwrap());
        assert_eq!(cq.ack_events().unwrap(), 1);
        assert_eq!(cq.ack_events().unwrap(), 0);
    }

    #[test]
    fn solicited_only_arm_ignores_unsolicited_successes() {
        let cq = SoftCq::new(8).unwrap();
        cq.req_notify(true).unwrap();
        cq.push(wc(1), false);
        assert_eq!(cq.ack_events().unwrap(), 0);
        cq.push(wc(2), true);
        assert_eq!(cq.ack_events().unwrap(), 1);
        cq.req_notify(true).unwrap();
        let mut err = wc(3);
        err.status = WcStatus::WrFlushed;
        err.opcode = WcOpcode::Recv;
        cq.push(err, false);
        assert_eq!(cq.ack_events().unwrap(), 1);
    }

    /// Two threads armed and waiting: the first completion's event is consumed by one of them
    /// (`ack_events`), and a second completion arrives while the CQ is no longer armed. The
    /// other waiter still wakes for it instead of sleeping with a completion queued.
    #[test]
    fn a_waiter_wakes_for_a_completion_whose_event_another_waiter_consumed() {
        let cq = SoftCq::new(8).unwrap();
        cq.req_notify(false).unwrap();
        let waiter = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                let woke = cq.wait_event(Some(Duration::from_secs(20))).unwrap();
                (woke, std::time::Instant::now() < deadline)
            })
        };
        assert!(cq.push(wc(1), false));
        // The other waiter: takes the event and the first completion.
        assert!(cq.wait_event(Some(Duration::from_secs(20))).unwrap());
        cq.ack_events().unwrap();
        let mut out = [WorkCompletion::EMPTY; 1];
        assert_eq!(cq.poll(&mut out).unwrap(), 1);
        // Not armed any more: no event for this one.
        assert!(cq.push(wc(2), false));
        assert_eq!(waiter.join().unwrap(), (true, true));
        assert_eq!(cq.poll(&mut out).unwrap(), 1);
        assert_eq!(out[0].wr_id, 2);
    }

    #[test]
    fn concurrent_producer_and_consumer_lose_nothing() {
        let cq = SoftCq::new(64).unwrap();
        let p = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                let mut i = 0;
                while i < 10_000u64 {
                    if cq.len() < 60 {
                        assert!(cq.push(wc(i), false));
                        i += 1;
                    } else {
                        std::thread::yield_now();
                    }
                }
            })
        };
        let mut next = 0u64;
        let mut out = [WorkCompletion::EMPTY; 16];
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while next < 10_000 {
            assert!(std::time::Instant::now() < deadline, "consumer starved");
            let n = cq.poll(&mut out).unwrap();
            for w in &out[..n] {
                assert_eq!(w.wr_id, next);
                next += 1;
            }
            if n == 0 {
                std::thread::yield_now();
            }
        }
        p.join().unwrap();
    }
}
