//! The worker's time: one clock reading per progress pass, and a time that never runs back.
//!
//! A pass reads the clock at most once, when it first needs it ([`PassClock::get`]); or it runs
//! on a reading its caller took moments before ([`PassClock::begin_at`]: a spinning waiter
//! reads the clock every few rounds anyway, and handing that reading in keeps a clock read —
//! tens of nanoseconds — off the path of the completion the pass finds). Such a reading is a
//! little old: the pass sees a time "at least this late", so a timer fires a moment later and
//! an ack deadline falls a moment earlier. Readings older than one already used are raised to
//! it, so the worker's time is monotonic whatever its callers hand in.

use crate::channel::proto::Instant;

/// The clock of the current pass.
#[derive(Debug, Default)]
pub(crate) struct PassClock {
    /// This pass's time, once read or handed in.
    current: Option<Instant>,
    /// The latest time used so far.
    floor: Instant,
}

impl PassClock {
    /// A new pass that reads the clock when it first needs it.
    pub(crate) fn begin(&mut self) {
        self.current = None;
    }

    /// A new pass on `recent` (a reading taken moments ago), or, with `None`, as [`begin`].
    ///
    /// [`begin`]: PassClock::begin
    pub(crate) fn begin_at(&mut self, recent: Option<Instant>) {
        self.current = recent.map(|t| self.advance(t));
    }

    /// This pass's time: `read` is called only on the pass's first use without a reading.
    pub(crate) fn get(&mut self, read: impl FnOnce() -> Instant) -> Instant {
        match self.current {
            Some(t) => t,
            None => {
                let t = self.advance(read());
                self.current = Some(t);
                t
            }
        }
    }

    fn advance(&mut self, t: Instant) -> Instant {
        let t = t.max(self.floor);
        self.floor = t;
        t
    }
}

#[cfg(test)]
mod tests {
    use super::PassClock;
    use crate::channel::proto::Instant;

    fn at(ns: u64) -> Instant {
        Instant::from_nanos(ns)
    }

    #[test]
    fn a_pass_reads_the_clock_once_and_only_when_it_needs_it() {
        let mut c = PassClock::default();
        let mut reads = 0;
        c.begin();
        assert_eq!(reads, 0);
        for _ in 0..3 {
            let t = c.get(|| {
                reads += 1;
                at(100)
            });
            assert_eq!(t, at(100));
        }
        assert_eq!(reads, 1, "one reading per pass");
        c.begin();
        assert_eq!(c.get(|| at(250)), at(250), "the next pass reads again");
    }

    #[test]
    fn a_handed_in_reading_is_used_without_reading_the_clock() {
        let mut c = PassClock::default();
        c.begin_at(Some(at(500)));
        assert_eq!(
            c.get(|| panic!("the pass must use the reading handed in")),
            at(500)
        );
        c.begin_at(None);
        assert_eq!(c.get(|| at(600)), at(600));
    }

    #[test]
    fn time_never_runs_back_whatever_is_handed_in() {
        let mut c = PassClock::default();
        c.begin();
        assert_eq!(c.get(|| at(1_000)), at(1_000));
        // A waiter's reading from before that pass.
        c.begin_at(Some(at(900)));
        assert_eq!(c.get(|| unreachable!()), at(1_000));
        // A clock that (wrongly) ran back.
        c.begin();
        assert_eq!(c.get(|| at(10)), at(1_000));
        c.begin_at(Some(at(2_000)));
        assert_eq!(c.get(|| unreachable!()), at(2_000));
    }
}
