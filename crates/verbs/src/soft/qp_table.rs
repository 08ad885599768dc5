//! A context's table of live QPs by number: allocation of fresh 24-bit QP numbers and lookup
//! of the QP an incoming frame names. Entries are weak, so dropping the last handle of a QP
//! ends it; the table never keeps a QP alive. Also the timer round the progress thread runs
//! over the table ([`TimedQp`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::RwLock;

/// QPs of one context, by QP number.
pub struct QpTable<Q> {
    qps: RwLock<HashMap<u32, Weak<Q>>>,
    next_qpn: AtomicU32,
}

impl<Q> QpTable<Q> {
    /// An empty table handing out numbers from `first_qpn` on.
    pub fn new(first_qpn: u32) -> QpTable<Q> {
        QpTable {
            qps: RwLock::new(HashMap::new()),
            next_qpn: AtomicU32::new(first_qpn),
        }
    }

    /// A fresh QP number (24 bits, never 0, unique in this table).
    pub fn alloc_qpn(&self) -> u32 {
        let qps = self.qps.read();
        loop {
            let n = self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
            if n != 0 && !qps.contains_key(&n) {
                return n;
            }
        }
    }

    /// Register a QP under its number.
    pub fn insert(&self, qpn: u32, qp: &Arc<Q>) {
        self.qps.write().insert(qpn, Arc::downgrade(qp));
    }

    /// Forget a QP number.
    pub fn remove(&self, qpn: u32) {
        self.qps.write().remove(&qpn);
    }

    /// The live QP with this number.
    pub fn get(&self, qpn: u32) -> Option<Arc<Q>> {
        self.qps.read().get(&qpn).and_then(Weak::upgrade)
    }

    /// Append every live QP to `out`. The handles are upgraded under the read lock and used
    /// without it: dropping the last handle of a QP takes the write lock.
    pub fn extend_live(&self, out: &mut Vec<Arc<Q>>) {
        out.extend(self.qps.read().values().filter_map(Weak::upgrade));
    }

    /// Every live QP.
    pub fn all(&self) -> Vec<Arc<Q>> {
        let mut v = Vec::new();
        self.extend_live(&mut v);
        v
    }
}

/// A QP with timers the context's progress thread runs.
pub trait TimedQp {
    /// The QP's earliest deadline.
    fn poll_timeout(&self) -> Option<Instant>;
    /// Deadlines up to `now` are due.
    fn on_timer(&self, now: Instant);
}

impl<Q: TimedQp> QpTable<Q> {
    /// How long the progress thread may sleep: until the earliest QP deadline, at most
    /// `max_sleep`.
    pub fn next_timeout(&self, now: Instant, max_sleep: Duration) -> Duration {
        let mut next = now + max_sleep;
        for qp in self.all() {
            if let Some(t) = qp.poll_timeout() {
                next = next.min(t);
            }
        }
        next.saturating_duration_since(now)
    }

    /// Run the timers of every QP with a deadline up to `now`.
    pub fn run_timers(&self, now: Instant) {
        for qp in self.all() {
            if qp.poll_timeout().is_some_and(|t| t <= now) {
                qp.on_timer(now);
            }
        }
    }
}
