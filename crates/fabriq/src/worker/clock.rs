//! The worker's time: one clock reading per progress pass, and a time that never runs back.
//!
//! A pass reads the clock at most once, when it first needs it ([`PassClock::get`]); or it runs
//! on a reading its caller took moments before ([`PassClock::begin_at`]: a spinning waiter
//! reads the clock every few rounds anyway, and handing that reading in keeps a clock read —
//! tens of nanoseconds — off the path of the completion the pass finds). Such a reading is a
//! little old: the pass sees a time "at least this late", so a timer fires a moment later and
//! an ack deadline falls a moment earlier. Readings older than one already used are raised to
//! it, so the worker's time is monotonic whatever its callers hand in.

use std::sync::OnceLock;

use crate::channel::proto::Instant;

/// Where the worker's time comes from.
enum Source {
    /// The CPU counter, and `CLOCK_MONOTONIC` and the counter at one moment.
    Counter {
        clock: quanta::Clock,
        raw: u64,
        mono_ns: u64,
    },
    /// `CLOCK_MONOTONIC` itself (`FABRIQ_CLOCK=monotonic`).
    Monotonic,
}

static SOURCE: OnceLock<Source> = OnceLock::new();

fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64
}

/// The worker's time: nanoseconds of `CLOCK_MONOTONIC`, read through the CPU's time-stamp
/// counter where quanta finds an invariant one (calibrated once per process, under a
/// millisecond; a read then costs under half of `clock_gettime`'s, which the message path
/// pays twice per message: once per pass, once per send for the trace header's timestamp).
/// Elsewhere quanta reads `CLOCK_MONOTONIC` itself. Anchored to `CLOCK_MONOTONIC` once, it
/// strays from it only by the calibration's error (parts per million): it is this process's
/// monotonic clock, which is all its users — timers, deadlines, the trace header — ask of it.
/// `FABRIQ_CLOCK=monotonic` reads `CLOCK_MONOTONIC` on every call instead (no calibration,
/// whose length varies from run to run: `bench/instructions.sh` counts with it).
pub(crate) fn now() -> Instant {
    let source = SOURCE.get_or_init(|| {
        if std::env::var("FABRIQ_CLOCK").is_ok_and(|v| v == "monotonic") {
            return Source::Monotonic;
        }
        let clock = quanta::Clock::new();
        let raw = clock.raw();
        Source::Counter {
            raw,
            mono_ns: monotonic_ns(),
            clock,
        }
    });
    match source {
        Source::Counter {
            clock,
            raw,
            mono_ns,
        } => Instant::from_nanos(mono_ns.saturating_add(clock.delta_as_nanos(*raw, clock.raw()))),
        Source::Monotonic => Instant::from_nanos(monotonic_ns()),
    }
}

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

    /// The counter-read clock keeps `CLOCK_MONOTONIC`'s time: close to it when read, and moving
    /// with it over a sleep. (A worker never sees it run back: `PassClock` raises a reading
    /// older than one it used.)
    #[test]
    fn the_clock_keeps_monotonic_time() {
        let before = super::monotonic_ns();
        let t0 = super::now().as_nanos();
        let after = super::monotonic_ns();
        assert!(
            t0 + 1_000_000 >= before && t0 <= after + 1_000_000,
            "{t0} not within a millisecond of [{before}, {after}]"
        );
        let m0 = super::monotonic_ns();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let (t1, m1) = (super::now().as_nanos(), super::monotonic_ns());
        let (dt, dm) = (t1 - t0, m1 - m0);
        assert!(
            dt.abs_diff(dm) < 2_000_000,
            "50 ms: the clock moved {dt} ns, CLOCK_MONOTONIC {dm} ns"
        );
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
