//! The worker's time: one clock reading per progress pass, and a time that never runs back.
//!
//! A pass reads the clock at most once, when it first needs it ([`PassClock::get`]); or it runs
//! on a reading its caller took moments before ([`PassClock::begin_at`]: a spinning waiter
//! reads the clock every few rounds anyway, and handing that reading in keeps a clock read —
//! tens of nanoseconds — off the path of the completion the pass finds). Such a reading is a
//! little old: the pass sees a time "at least this late", so a timer fires a moment later and
//! an ack deadline falls a moment earlier. Readings older than one already used are raised to
//! it, so the worker's time is monotonic whatever its callers hand in.

use std::cell::Cell;
use std::sync::OnceLock;

use crate::channel::proto::Instant;

/// Where the worker's time comes from.
enum Source {
    /// The CPU counter, anchored to `CLOCK_MONOTONIC` per thread ([`Anchor`]).
    Counter(quanta::Clock),
    /// `CLOCK_MONOTONIC` itself (`FABRIQ_CLOCK=monotonic`).
    Monotonic,
}

static SOURCE: OnceLock<Source> = OnceLock::new();

/// How long a thread extrapolates from one `CLOCK_MONOTONIC` reading before it reads it again.
/// The counter's rate and `CLOCK_MONOTONIC`'s differ by the calibration's error and by NTP's
/// slewing of `CLOCK_MONOTONIC` (up to 500 parts per million): over this span that is at most
/// 50 µs, and a `clock_gettime` per thread every 100 ms costs nothing.
const REANCHOR_NS: u64 = 100_000_000;

thread_local! {
    static ANCHOR: Cell<Anchor> = const { Cell::new(Anchor::UNSET) };
}

fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64
}

/// One thread's tie of the counter to `CLOCK_MONOTONIC`: a counter value and the
/// `CLOCK_MONOTONIC` time read beside it, renewed every [`REANCHOR_NS`], and the latest time
/// handed out, so that a renewal that finds the extrapolation ran ahead never runs the thread's
/// time back (it stands still instead, for at most the drift of one span).
#[derive(Debug, Clone, Copy)]
struct Anchor {
    raw: u64,
    mono_ns: u64,
    last: u64,
}

impl Anchor {
    const UNSET: Anchor = Anchor {
        raw: 0,
        mono_ns: 0,
        last: 0,
    };

    /// The time at counter value `raw`: `elapsed(from, to)` scales a counter difference to
    /// nanoseconds; `monotonic` reads `CLOCK_MONOTONIC` (only when the anchor is unset or old).
    fn time(
        &mut self,
        raw: u64,
        elapsed: impl Fn(u64, u64) -> u64,
        monotonic: impl FnOnce() -> u64,
    ) -> u64 {
        let since = elapsed(self.raw, raw);
        let t = if self.mono_ns == 0 || since >= REANCHOR_NS {
            self.raw = raw;
            self.mono_ns = monotonic();
            self.mono_ns
        } else {
            self.mono_ns + since
        };
        self.last = self.last.max(t);
        self.last
    }
}

/// The worker's time: nanoseconds of `CLOCK_MONOTONIC`, read through the CPU's time-stamp
/// counter where quanta finds an invariant one (calibrated once per process, under a
/// millisecond; a read then costs under half of `clock_gettime`'s, which the message path
/// pays twice per message: once per pass, once per send for the trace header's timestamp).
/// Elsewhere quanta reads `CLOCK_MONOTONIC` itself. Each thread extrapolates from a
/// `CLOCK_MONOTONIC` reading it renews every 100 ms, so the time stays within tens of
/// microseconds of `CLOCK_MONOTONIC` however long the process runs — the trace header's
/// timestamps compare across the processes of a host — and never runs back within a thread.
/// `FABRIQ_CLOCK=monotonic` reads `CLOCK_MONOTONIC` on every call instead (no calibration,
/// whose length varies from run to run: `bench/instructions.sh` counts with it).
pub(crate) fn now() -> Instant {
    let source = SOURCE.get_or_init(|| {
        if std::env::var("FABRIQ_CLOCK").is_ok_and(|v| v == "monotonic") {
            return Source::Monotonic;
        }
        Source::Counter(quanta::Clock::new())
    });
    match source {
        Source::Counter(clock) => {
            let raw = clock.raw();
            let t = ANCHOR.with(|a| {
                let mut anchor = a.get();
                let t = anchor.time(raw, |from, to| clock.delta_as_nanos(from, to), monotonic_ns);
                a.set(anchor);
                t
            });
            Instant::from_nanos(t)
        }
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
        std::thread::sleep(std::time::Duration::from_millis(50));
        let before = super::monotonic_ns();
        let t1 = super::now().as_nanos();
        let after = super::monotonic_ns();
        assert!(
            t1 + 1_000_000 >= before && t1 <= after + 1_000_000,
            "after 50 ms: {t1} not within a millisecond of [{before}, {after}]"
        );
    }

    /// A counter whose rate is 1% off `CLOCK_MONOTONIC`'s (far worse than any calibration or
    /// NTP slew) still reads within 1% of one renewal span of it after ten minutes, and the
    /// time it hands out never runs back.
    #[test]
    fn a_drifting_counter_stays_near_monotonic_time_and_never_runs_back() {
        for rate_ppm in [1_010_000u64, 990_000] {
            let mut anchor = super::Anchor::UNSET;
            // The counter ticks once per true nanosecond; scaled, it reads rate_ppm / 1e6 of it.
            let elapsed = |from: u64, to: u64| (to.saturating_sub(from)) * rate_ppm / 1_000_000;
            let mut last = 0;
            let mut true_ns = 1_000_000_000u64;
            let mut worst = 0;
            while true_ns < 601_000_000_000 {
                let t = anchor.time(true_ns, elapsed, || true_ns);
                assert!(t >= last, "ran back from {last} to {t}");
                last = t;
                worst = worst.max(t.abs_diff(true_ns));
                true_ns += 7_000_000;
            }
            assert!(
                worst <= super::REANCHOR_NS / 100 + 7_000_000 / 100,
                "rate {rate_ppm} ppm: {worst} ns from CLOCK_MONOTONIC"
            );
        }
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
