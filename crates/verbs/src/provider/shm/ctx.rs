//! An opened `shm0` context: its segment, allocators, the registries of its live objects, and
//! the service thread's handle.
//!
//! Ownership: every provider object (PD, MR, CQ, QP, SRQ) holds an `Arc<CtxCore>`; the service
//! thread holds only `Arc<CtxShared>` and weak references to objects. When the last object goes,
//! `CtxCore` drops, stops the thread, and the segment is unmapped once nothing maps it.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::Mutex;

use super::cq::CqShared;
use super::qp::QpInner;
use super::segment::{Heap, IndexAlloc, Segment, MAX_CQ, MAX_MR, MAX_QP, MAX_SRQ};
use super::{service, sys};
use crate::{DeviceInfo, Result, VerbsError};

/// Epoll tag of the doorbell.
pub(crate) const DOORBELL_TAG: u64 = u64::MAX;

/// State shared by the objects of a context and its service thread.
pub(crate) struct CtxShared {
    pub(crate) seg: Arc<Segment>,
    pub(crate) device: DeviceInfo,
    pub(crate) boot_id: String,
    pub(crate) heap: Mutex<Heap>,
    pub(crate) mr_ids: Mutex<IndexAlloc>,
    pub(crate) qp_ids: Mutex<IndexAlloc>,
    pub(crate) cq_ids: Mutex<IndexAlloc>,
    pub(crate) srq_ids: Mutex<IndexAlloc>,
    pub(crate) qps: Mutex<HashMap<u32, Weak<QpInner>>>,
    pub(crate) cqs: Mutex<HashMap<u32, Weak<CqShared>>>,
    /// Backlog retry deadlines.
    pub(crate) timers: Mutex<Vec<(Instant, Weak<QpInner>)>>,
    /// Peer processes whose death we watch (pidfds in `epoll`), by pid.
    pub(crate) watched: Mutex<HashMap<i32, Arc<Segment>>>,
    pub(crate) epoll: OwnedFd,
    pub(crate) shutdown: AtomicBool,
    pub(crate) next_pd: AtomicU32,
}

impl CtxShared {
    /// Retry `qp`'s backlog at `at` (wakes the service thread).
    pub(crate) fn schedule(&self, at: Instant, qp: Weak<QpInner>) {
        self.timers.lock().push((at, qp));
        self.seg.kick();
    }

    /// Watch the owner of `seg` for death, unless it is this process.
    pub(crate) fn watch(&self, seg: &Arc<Segment>) {
        if seg.same_process() {
            return;
        }
        let mut w = self.watched.lock();
        if w.contains_key(&seg.pid) {
            return;
        }
        if let Some(pidfd) = seg.pidfd() {
            match sys::epoll_add(self.epoll.as_fd(), pidfd, seg.pid as u64) {
                Ok(()) => {
                    w.insert(seg.pid, seg.clone());
                }
                Err(err) => tracing::warn!(%err, pid = seg.pid, "shm: cannot watch peer process"),
            }
        }
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
        let shared = Arc::new(CtxShared {
            seg,
            device,
            boot_id: sys::boot_id(),
            heap: Mutex::new(Heap::new()),
            mr_ids: Mutex::new(IndexAlloc::new(MAX_MR)),
            qp_ids: Mutex::new(IndexAlloc::new(MAX_QP)),
            cq_ids: Mutex::new(IndexAlloc::new(MAX_CQ)),
            srq_ids: Mutex::new(IndexAlloc::new(MAX_SRQ)),
            qps: Mutex::new(HashMap::new()),
            cqs: Mutex::new(HashMap::new()),
            timers: Mutex::new(Vec::new()),
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
