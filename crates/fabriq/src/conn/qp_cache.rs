//! The QP cache: queue pairs of released connections, reset and kept for the next connect.
//!
//! Creating a QP is the dearest step of a connect on most providers (a NIC allocates queues and
//! doorbells; a software provider maps rings or sets up sockets). A released QP is moved to
//! RESET, which empties its work queues and forgets the peer, and kept here; the next connect
//! takes it and goes RESET → INIT → RTR → RTS without creating anything. Bounded: beyond
//! `capacity` a released QP is dropped (destroyed).
//!
//! Every QP in one cache was created by one [`super::ConnManager`] with the same CQs and caps,
//! so any of them fits any connection of that manager.

use std::sync::atomic::{AtomicU64, Ordering};

use fabriq_verbs::{QpAttr, QpState, QueuePair};
use parking_lot::Mutex;

/// A bounded stack of QPs in RESET. Thread-safe.
#[derive(Debug)]
pub struct QpCache {
    qps: Mutex<Vec<QueuePair>>,
    capacity: usize,
    hits: AtomicU64,
    misses: AtomicU64,
    dropped: AtomicU64,
}

impl QpCache {
    /// An empty cache holding at most `capacity` QPs.
    pub fn new(capacity: usize) -> QpCache {
        QpCache {
            qps: Mutex::new(Vec::new()),
            capacity,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    /// A cached QP in RESET (a hit), or `None` (a miss: the caller creates one).
    pub fn take(&self) -> Option<QueuePair> {
        let qp = self.qps.lock().pop();
        match &qp {
            Some(_) => self.hits.fetch_add(1, Ordering::Relaxed),
            None => self.misses.fetch_add(1, Ordering::Relaxed),
        };
        qp
    }

    /// Reset `qp` and keep it; returns false if it was dropped instead (cache full, or the reset
    /// failed). The caller must hold the only handle: every clone of the QP must be gone, and
    /// its completions drained from the CQ, since the QP number will serve another connection.
    pub fn put(&self, qp: QueuePair) -> bool {
        if self.capacity == 0 {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        if qp.state() != QpState::Reset {
            if let Err(err) = qp.modify(&QpAttr::reset()) {
                tracing::debug!(qp = qp.qp_num().0, %err, "QP reset failed; destroying it");
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return false;
            }
        }
        let mut qps = self.qps.lock();
        if qps.len() >= self.capacity {
            drop(qps);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        qps.push(qp);
        true
    }

    /// Count a QP its owner destroyed instead of offering it (see [`QpCache::dropped`]).
    pub(crate) fn count_dropped(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// QPs held now.
    pub fn len(&self) -> usize {
        self.qps.lock().len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Most QPs held.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Takes that found a QP.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Takes that found none.
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }

    /// Released QPs destroyed instead of kept.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Destroy every cached QP.
    pub fn clear(&self) {
        self.qps.lock().clear();
    }
}
