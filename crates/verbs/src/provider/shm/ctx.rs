//! An opened `shm0` context: its segment, allocators, the registries of its live objects, and
//! the service thread's handle.
//!
//! Ownership: every provider object (PD, MR, CQ, QP, SRQ) holds an `Arc<CtxCore>`; the service
//! thread holds only `Arc<CtxShared>` and weak references to objects. When the last object goes,
//! `CtxCore` drops, stops the thread, and the segment is unmapped once nothing maps it.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::Mutex;

use super::cq::CqShared;
use super::qp::QpInner;
use super::segment::{Heap, IndexAlloc, Segment, MAX_CQ, MAX_MR, MAX_QP, MAX_SRQ};
use super::{service, sys};
use crate::{DeviceInfo, Result, VerbsError};

/// How late the service thread may run a backlog retry before `schedule` wakes it.
const TIMER_SLACK_NS: u64 = 1_000_000;

/// Epoll tag of the doorbell.
pub(crate) const DOORBELL_TAG: u64 = u64::MAX;

/// State shared by the objects of a context and its service thread.
pub(crate) struct CtxShared {
    pub(crate) seg: Arc<Segment>,
    pub(crate) device: DeviceInfo,
    pub(crate) boot_id: String,
    /// The address of this context's QPs in their endpoints (`boot/pid/fd/nonce`), made once.
    pub(crate) qp_address: String,
    pub(crate) heap: Mutex<Heap>,
    pub(crate) mr_ids: Mutex<IndexAlloc>,
    pub(crate) qp_ids: Mutex<IndexAlloc>,
    pub(crate) cq_ids: Mutex<IndexAlloc>,
    pub(crate) srq_ids: Mutex<IndexAlloc>,
    pub(crate) qps: Mutex<HashMap<u32, Weak<QpInner>>>,
    pub(crate) cqs: Mutex<HashMap<u32, Weak<CqShared>>>,
    /// Backlog retry deadlines.
    pub(crate) timers: Mutex<Vec<(Instant, Weak<QpInner>)>>,
    /// The earliest deadline in `timers`, in nanoseconds since `epoch` (`u64::MAX`: none).
    /// Written under the `timers` lock; read without it by CQ polls, as a hint only.
    next_timer: AtomicU64,
    /// When the service thread will wake by itself, in nanoseconds since `epoch`: `u64::MAX`
    /// while it sleeps without a timeout, 0 while it is awake (it looks at `timers` again
    /// before sleeping). Accessed under the `timers` lock.
    svc_wake_at: AtomicU64,
    epoch: Instant,
    /// Peer processes whose death we watch (pidfds in `epoll`), by pid, with the segments of
    /// theirs this context has attached (kept mapped while the peer lives).
    pub(crate) watched: Mutex<HashMap<i32, Watched>>,
    pub(crate) epoll: OwnedFd,
    pub(crate) shutdown: AtomicBool,
    pub(crate) next_pd: AtomicU32,
}

impl CtxShared {
    /// Retry `qp`'s backlog at `at`. The service thread is woken only if it would otherwise
    /// run the retry more than `TIMER_SLACK_NS` (1 ms) late (its `epoll_wait` timeout counts in
    /// milliseconds anyway); a busy poller runs it on time (see `run_due_timers`). An RNR
    /// storm thus costs no system call and no thread wake-up per retry.
    pub(crate) fn schedule(&self, at: Instant, qp: Weak<QpInner>) {
        let kick = {
            let mut timers = self.timers.lock();
            timers.push((at, qp));
            let at = self.since_epoch(at);
            if at < self.next_timer.load(Ordering::Relaxed) {
                self.next_timer.store(at, Ordering::Relaxed);
            }
            let wake = self.svc_wake_at.load(Ordering::Relaxed);
            wake != 0 && at.saturating_add(TIMER_SLACK_NS) < wake
        };
        if kick {
            self.seg.kick();
        }
    }

    /// The service thread's `epoll_wait` timeout for the earliest deadline, in milliseconds
    /// rounded up (-1: none); records when it will wake.
    pub(crate) fn service_sleep_ms(&self) -> i32 {
        let timers = self.timers.lock();
        let ms = match timers.iter().map(|(at, _)| *at).min() {
            None => -1,
            Some(next) => {
                let d = next.saturating_duration_since(Instant::now());
                i32::try_from(d.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
            }
        };
        let wake = if ms < 0 {
            u64::MAX
        } else {
            let at = Instant::now() + std::time::Duration::from_millis(ms as u64);
            self.since_epoch(at).max(1)
        };
        self.svc_wake_at.store(wake, Ordering::Relaxed);
        ms
    }

    /// The service thread woke up (it reads `timers` again before sleeping).
    pub(crate) fn service_awake(&self) {
        let _timers = self.timers.lock();
        self.svc_wake_at.store(0, Ordering::Relaxed);
    }

    fn since_epoch(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX - 1)
    }

    /// True when a backlog retry is due (one load; the clock is read only while one is
    /// pending). A hint: the service thread runs every retry at its deadline regardless.
    #[inline]
    pub(crate) fn timer_due(&self) -> bool {
        let next = self.next_timer.load(Ordering::Relaxed);
        next != u64::MAX && self.since_epoch(Instant::now()) >= next
    }

    /// Retry the backlogs whose deadline has passed: on the service thread at its wake-ups,
    /// and from an empty CQ poll — a busy-polling application then retries an RNR'd send
    /// at the RNR timer (microseconds) instead of waiting for the service thread, whose
    /// `epoll_wait` counts in milliseconds.
    pub(crate) fn run_due_timers(&self) {
        let now = Instant::now();
        let due: Vec<_> = {
            let mut timers = self.timers.lock();
            let mut due = Vec::new();
            let mut next = u64::MAX;
            timers.retain(|(at, qp)| {
                if *at <= now {
                    due.push(qp.clone());
                    false
                } else {
                    next = next.min(self.since_epoch(*at));
                    true
                }
            });
            self.next_timer.store(next, Ordering::Relaxed);
            due
        };
        let mut seen: Vec<*const QpInner> = Vec::new();
        for w in due {
            let ptr = w.as_ptr();
            if seen.contains(&ptr) {
                continue;
            }
            seen.push(ptr);
            if let Some(qp) = w.upgrade() {
                qp.progress();
            }
        }
    }

    /// Watch the owner of `seg` for death, unless it is this process (the owner of this
    /// context's own segment: no system call to tell, and a QP's RTR comes here every time),
    /// and keep `seg` mapped while the owner lives: a later connect to a QP of that segment
    /// finds the mapping instead of attaching again (`pidfd_getfd`, a 64 GiB `mmap`, and a
    /// `munmap` with its TLB shootdown when the last QP to it goes). A peer process with
    /// several contexts has several segments, all kept (up to [`KEPT_PER_PEER`]).
    pub(crate) fn watch(&self, seg: &Arc<Segment>) {
        if seg.pid == self.seg.pid {
            return;
        }
        let mut w = self.watched.lock();
        if let Some(watched) = w.get_mut(&seg.pid) {
            watched.keep(seg);
            return;
        }
        if let Some(pidfd) = seg.pidfd() {
            match sys::epoll_add(self.epoll.as_fd(), pidfd, seg.pid as u64) {
                Ok(()) => {
                    w.insert(
                        seg.pid,
                        Watched {
                            watch: seg.clone(),
                            more: Vec::new(),
                        },
                    );
                }
                Err(err) => tracing::warn!(%err, pid = seg.pid, "shm: cannot watch peer process"),
            }
        }
    }
}

/// Segments of one peer process kept beside the one whose pidfd is watched.
pub(crate) const KEPT_PER_PEER: usize = 16;

/// A watched peer process: the segment whose pidfd sits in the context's epoll, and the
/// peer's other segments this context attached.
pub(crate) struct Watched {
    pub(crate) watch: Arc<Segment>,
    more: Vec<Arc<Segment>>,
}

impl Watched {
    /// Keep `seg` mapped too. Beyond [`KEPT_PER_PEER`] the oldest segment no QP uses any more
    /// is let go (a peer that opens and closes contexts does not pin their memory here).
    fn keep(&mut self, seg: &Arc<Segment>) {
        if Arc::ptr_eq(&self.watch, seg) || self.more.iter().any(|s| Arc::ptr_eq(s, seg)) {
            return;
        }
        if self.more.len() >= KEPT_PER_PEER {
            if let Some(i) = self.more.iter().position(|s| Arc::strong_count(s) == 1) {
                self.more.remove(i);
            } else {
                return;
            }
        }
        self.more.push(seg.clone());
    }

    /// Segments kept (the watched one included).
    #[cfg(test)]
    fn kept(&self) -> usize {
        1 + self.more.len()
    }
}

/// The context proper: shared state plus the service thread, stopped on drop.
pub(crate) struct CtxCore {
    pub(crate) shared: Arc<CtxShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl CtxCore {
    /// Open a new context: segment, doorbell, epoll, service thread.
    pub(crate) fn open(device: DeviceInfo) -> Result<Arc<CtxCore>> {
        let seg = Segment::create()?;
        let epoll = sys::epoll_create().map_err(|e| VerbsError::io("epoll_create", e))?;
        sys::epoll_add(epoll.as_fd(), seg.doorbell(), DOORBELL_TAG)
            .map_err(|e| VerbsError::io("watch doorbell", e))?;
        let boot_id = sys::boot_id();
        let qp_address = format!(
            "{}/{}/{}/{:016x}",
            boot_id,
            seg.pid,
            std::os::fd::AsRawFd::as_raw_fd(&seg.memfd()),
            seg.nonce
        );
        let shared = Arc::new(CtxShared {
            seg,
            device,
            boot_id,
            qp_address,
            heap: Mutex::new(Heap::new()),
            mr_ids: Mutex::new(IndexAlloc::new(MAX_MR)),
            qp_ids: Mutex::new(IndexAlloc::new(MAX_QP)),
            cq_ids: Mutex::new(IndexAlloc::new(MAX_CQ)),
            srq_ids: Mutex::new(IndexAlloc::new(MAX_SRQ)),
            qps: Mutex::new(HashMap::new()),
            cqs: Mutex::new(HashMap::new()),
            timers: Mutex::new(Vec::new()),
            next_timer: AtomicU64::new(u64::MAX),
            svc_wake_at: AtomicU64::new(0),
            epoch: Instant::now(),
            watched: Mutex::new(HashMap::new()),
            epoll,
            shutdown: AtomicBool::new(false),
            next_pd: AtomicU32::new(1),
        });
        let for_thread = shared.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("fabriq-shm-svc".into())
            .spawn(move || service::run(for_thread, tx))
            .map_err(|e| VerbsError::io("spawn shm service thread", e))?;
        // The context is usable by peers only once its liveness word is held.
        let _ = rx.recv();
        Ok(Arc::new(CtxCore {
            shared,
            thread: Mutex::new(Some(thread)),
        }))
    }
}

impl Drop for CtxCore {
    fn drop(&mut self) {
        self.shared
            .shutdown
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.shared.seg.kick();
        if let Some(t) = self.thread.lock().take() {
            // The last object may be dropped by the service thread itself (it briefly holds
            // objects it upgraded); it then exits on its own.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every segment of a peer process is kept once (the bug this guards against: only the
    /// first was, so connects to a peer's second context attached and unmapped its segment
    /// every time), up to a bound; beyond it only segments no QP uses are let go.
    #[test]
    fn a_peer_processes_segments_are_all_kept_up_to_a_bound() {
        let seg = || Segment::create().expect("segment");
        let mut w = Watched {
            watch: seg(),
            more: Vec::new(),
        };
        let second = seg();
        w.keep(&second);
        w.keep(&second);
        w.keep(&w.watch.clone());
        assert_eq!(w.kept(), 2, "each segment once");
        // Fill up with segments that QPs still use (held here).
        let used: Vec<_> = (1..KEPT_PER_PEER).map(|_| seg()).collect();
        for s in &used {
            w.keep(s);
        }
        assert_eq!(w.kept(), 1 + KEPT_PER_PEER);
        // Full: a new one replaces the oldest unused one (`second` once dropped here), never
        // a used one.
        let extra = seg();
        w.keep(&extra);
        assert!(
            w.more.iter().any(|s| Arc::ptr_eq(s, &second)),
            "second is in use"
        );
        assert!(
            !w.more.iter().any(|s| Arc::ptr_eq(s, &extra)),
            "nothing to let go"
        );
        drop(second);
        w.keep(&extra);
        assert!(w.more.iter().any(|s| Arc::ptr_eq(s, &extra)));
        assert_eq!(w.kept(), 1 + KEPT_PER_PEER);
        assert!(used
            .iter()
            .all(|u| w.more.iter().any(|s| Arc::ptr_eq(s, u))));
    }
}
