//! Simulated time.
//!
//! Owns the simulator's notion of time: [`Time`], nanoseconds since the start of a run, and
//! the conversions between link parameters (bandwidth, bytes) and durations. It does not own
//! the event queue (see `event_queue`) and never reads a wall clock: a run is a pure function
//! of its scenario and seed.

use std::fmt;
use std::ops::{Add, AddAssign, Sub};

/// A point in simulated time, in nanoseconds from the start of the run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Time(pub u64);

/// One microsecond, in nanoseconds.
pub const NANOS_PER_MICRO: u64 = 1_000;
/// One millisecond, in nanoseconds.
pub const NANOS_PER_MILLI: u64 = 1_000_000;
/// One second, in nanoseconds.
pub const NANOS_PER_SEC: u64 = 1_000_000_000;

impl Time {
    /// The start of every run.
    pub const ZERO: Time = Time(0);
    /// A time later than any event of a run.
    pub const NEVER: Time = Time(u64::MAX);

    /// Builds a time from nanoseconds.
    pub const fn from_nanos(ns: u64) -> Self {
        Time(ns)
    }
    /// Builds a time from microseconds.
    pub const fn from_micros(us: u64) -> Self {
        Time(us * NANOS_PER_MICRO)
    }
    /// Builds a time from milliseconds (fractional values allowed).
    pub fn from_millis_f64(ms: f64) -> Self {
        Time((ms * NANOS_PER_MILLI as f64).round().max(0.0) as u64)
    }
    /// Nanoseconds since the start of the run.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }
    /// Seconds since the start of the run.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / NANOS_PER_SEC as f64
    }
    /// Milliseconds since the start of the run.
    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 / NANOS_PER_MILLI as f64
    }
    /// `self + ns`, saturating at [`Time::NEVER`].
    pub const fn plus_nanos(self, ns: u64) -> Self {
        Time(self.0.saturating_add(ns))
    }
}

impl Add<u64> for Time {
    type Output = Time;
    fn add(self, ns: u64) -> Time {
        self.plus_nanos(ns)
    }
}

impl AddAssign<u64> for Time {
    fn add_assign(&mut self, ns: u64) {
        *self = self.plus_nanos(ns);
    }
}

impl Sub for Time {
    type Output = u64;
    /// Nanoseconds from `rhs` to `self`, zero when `rhs` is later.
    fn sub(self, rhs: Time) -> u64 {
        self.0.saturating_sub(rhs.0)
    }
}

impl fmt::Display for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.3}us", self.0 as f64 / NANOS_PER_MICRO as f64)
    }
}

/// Nanoseconds needed to serialise `bytes` onto a link of `bits_per_sec`, rounded up so that
/// a link never carries more than its bandwidth.
///
/// `bits_per_sec` must be non-zero (scenario validation guarantees it).
pub const fn serialisation_nanos(bytes: u64, bits_per_sec: u64) -> u64 {
    let bits = bytes as u128 * 8 * NANOS_PER_SEC as u128;
    let bps = bits_per_sec as u128;
    bits.div_ceil(bps) as u64
}

/// Bits per second from a rate in Gb/s.
pub fn gbps_to_bps(gbps: f64) -> u64 {
    (gbps * 1e9).round() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialisation_of_a_4k_frame() {
        // 4096 bytes at 40 Gb/s = 819.2 ns, rounded up.
        assert_eq!(serialisation_nanos(4096, 40_000_000_000), 820);
        // 1500 bytes at 100 Gb/s = 120 ns exactly.
        assert_eq!(serialisation_nanos(1500, 100_000_000_000), 120);
        // 1 byte at 1 Gb/s = 8 ns.
        assert_eq!(serialisation_nanos(1, 1_000_000_000), 8);
        assert_eq!(serialisation_nanos(0, 1_000_000_000), 0);
    }

    #[test]
    fn time_arithmetic_saturates() {
        assert_eq!(Time::NEVER + 5, Time::NEVER);
        assert_eq!(Time(3) - Time(5), 0);
        assert_eq!(Time::from_micros(2) - Time(500), 1_500);
        assert_eq!(Time::from_millis_f64(1.5), Time(1_500_000));
    }
}
