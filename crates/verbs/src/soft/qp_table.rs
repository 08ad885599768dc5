//! A context's table of live QPs by number: allocation of fresh 24-bit QP numbers and lookup
//! of the QP an incoming frame names. Entries are weak, so dropping the last handle of a QP
//! ends it; the table never keeps a QP alive. Also the timer round over the table
//! ([`TimedQp`]): every QP is looked at only once the earliest deadline announced to a
//! [`Deadline`] is due, so a context's idle QPs cost its progress nothing per wake-up.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

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
}

/// A QP with timers the context's progress thread runs.
pub trait TimedQp {
    /// The QP's earliest deadline.
    fn poll_timeout(&self) -> Option<Instant>;
    /// Deadlines up to `now` are due.
    fn on_timer(&self, now: Instant);
}

impl<Q: TimedQp> QpTable<Q> {
    /// Run the timers due by `now` (`now_ns` on `deadline`'s clock) if `deadline` is: every
    /// live QP is looked at then and the next deadline learnt (lowered meanwhile by every
    /// announcement); the QPs looked at are added to `looks`. O(1) until a deadline is due,
    /// however many QPs the table has. The QPs are upgraded under the table's read lock and
    /// looked at without it (dropping the last handle of a QP takes the write lock). A call
    /// from inside a round's timer work (on the same thread) does nothing: the outer round
    /// holds QP locks that a nested look would take again. Returns the QPs looked at (0 when
    /// nothing was due).
    pub fn run_due_timers(
        &self,
        now: Instant,
        now_ns: u64,
        deadline: &Deadline,
        nanos: impl Fn(Instant) -> u64,
        looks: &AtomicU64,
    ) -> usize {
        thread_local! {
            static IN_ROUND: Cell<bool> = const { Cell::new(false) };
        }
        if !deadline.is_due(now_ns) || IN_ROUND.with(Cell::get) {
            return 0;
        }
        IN_ROUND.with(|r| r.set(true));
        struct Leave;
        impl Drop for Leave {
            fn drop(&mut self) {
                IN_ROUND.with(|r| r.set(false));
            }
        }
        let _leave = Leave;
        // Reset before the look: a deadline announced from here on is kept, and every QP is
        // looked at after it. (A round is rare: the allocation is not worth keeping.)
        deadline.reset();
        let mut qps = Vec::new();
        self.extend_live(&mut qps);
        let looked = qps.len();
        for qp in qps {
            match qp.poll_timeout() {
                Some(t) if t <= now => qp.on_timer(now),
                Some(t) => deadline.announce(nanos(t)),
                None => {}
            }
        }
        looks.fetch_add(looked as u64, Ordering::Relaxed);
        looked
    }
}

/// The earliest deadline announced for a table's QPs since their timers were last looked at
/// (nanoseconds on the context's clock; none: `u64::MAX`). Whoever may bring a QP's deadline
/// forward announces it; the round that finds it due looks at every QP and learns the next.
#[derive(Debug)]
pub struct Deadline(AtomicU64);

impl Default for Deadline {
    fn default() -> Deadline {
        Deadline(AtomicU64::new(u64::MAX))
    }
}

impl Deadline {
    /// A deadline at `ns` (kept if earlier than the one known).
    pub fn announce(&self, ns: u64) {
        if ns < self.0.load(Ordering::Relaxed) {
            self.0.fetch_min(ns, Ordering::AcqRel);
        }
    }

    /// The earliest deadline known (`u64::MAX`: none).
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// Whether the earliest deadline known is at or before `now_ns`.
    pub fn is_due(&self, now_ns: u64) -> bool {
        now_ns >= self.get()
    }

    fn reset(&self) {
        self.0.store(u64::MAX, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;
    use std::time::Duration;

    /// A QP with one deadline, counting its timer calls.
    struct Q {
        at: Mutex<Option<Instant>>,
        fired: AtomicU32,
    }

    impl TimedQp for Q {
        fn poll_timeout(&self) -> Option<Instant> {
            *self.at.lock()
        }
        fn on_timer(&self, _now: Instant) {
            self.fired.fetch_add(1, Ordering::Relaxed);
            *self.at.lock() = None;
        }
    }

    #[test]
    fn only_a_due_deadline_makes_a_round_and_the_round_learns_the_next() {
        let t0 = Instant::now();
        let ns = |t: Instant| t.saturating_duration_since(t0).as_nanos() as u64;
        let table = QpTable::new(1);
        let qps: Vec<Arc<Q>> = [Some(10), Some(30), None]
            .into_iter()
            .map(|ms| {
                Arc::new(Q {
                    at: Mutex::new(ms.map(|ms| t0 + Duration::from_millis(ms))),
                    fired: AtomicU32::new(0),
                })
            })
            .collect();
        for (i, q) in qps.iter().enumerate() {
            table.insert(i as u32 + 1, q);
        }
        let deadline = Deadline::default();
        let looks = AtomicU64::new(0);
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Nothing announced: no round, however late.
        assert_eq!(
            table.run_due_timers(at(50), ns(at(50)), &deadline, ns, &looks),
            0
        );
        deadline.announce(ns(at(10)));
        deadline.announce(ns(at(30)));
        assert_eq!(deadline.get(), ns(at(10)));
        assert_eq!(
            table.run_due_timers(at(5), ns(at(5)), &deadline, ns, &looks),
            0,
            "not due yet"
        );
        assert_eq!(
            table.run_due_timers(at(10), ns(at(10)), &deadline, ns, &looks),
            3
        );
        let fired: Vec<u32> = qps
            .iter()
            .map(|q| q.fired.load(Ordering::Relaxed))
            .collect();
        assert_eq!(fired, [1, 0, 0]);
        assert_eq!(deadline.get(), ns(at(30)), "the next deadline, learnt");
        assert!(
            qps.iter().all(|q| Arc::strong_count(q) == 1),
            "no QP kept alive by the round"
        );
        assert_eq!(
            table.run_due_timers(at(30), ns(at(30)), &deadline, ns, &looks),
            3
        );
        assert_eq!(qps[1].fired.load(Ordering::Relaxed), 1);
        assert_eq!(deadline.get(), u64::MAX, "none left");
        assert_eq!(looks.load(Ordering::Relaxed), 6, "two rounds of three");
    }
}
