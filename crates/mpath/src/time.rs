//! Virtual time for the sans-IO core.
//!
//! Owns [`Instant`], a point in time counted in nanoseconds from an arbitrary zero
//! chosen by the driver. The core never reads a clock: the simulator starts at zero,
//! the UDP driver converts `std::time::Instant` at its edge. Spans are
//! [`std::time::Duration`]. Nanoseconds because the simulator models 100 Gb/s links,
//! where one 1 KiB packet lasts about 82 ns on the wire.

use std::fmt;
use std::ops::{Add, AddAssign, Sub};
use std::time::Duration;

/// A point in time: nanoseconds since an arbitrary zero chosen by the driver.
///
/// Arithmetic saturates instead of overflowing: `u64` nanoseconds cover 584 years.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(u64);

impl Instant {
    /// The zero point.
    pub const ZERO: Instant = Instant(0);

    /// The instant `nanos` nanoseconds after zero.
    pub const fn from_nanos(nanos: u64) -> Self {
        Instant(nanos)
    }

    /// The instant `micros` microseconds after zero.
    pub const fn from_micros(micros: u64) -> Self {
        Instant(micros.saturating_mul(1_000))
    }

    /// Nanoseconds since zero.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time elapsed from `earlier` to `self`, or zero when `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// `self + d`, saturating at the far end of time.
    pub fn saturating_add(self, d: Duration) -> Instant {
        Instant(self.0.saturating_add(duration_nanos(d)))
    }
}

/// A duration in whole nanoseconds, saturating at `u64::MAX`.
pub(crate) fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, rhs: Duration) -> Instant {
        self.saturating_add(rhs)
    }
}

impl AddAssign<Duration> for Instant {
    fn add_assign(&mut self, rhs: Duration) {
        *self = *self + rhs;
    }
}

impl Sub<Duration> for Instant {
    type Output = Instant;
    /// Saturating at zero.
    fn sub(self, rhs: Duration) -> Instant {
        Instant(self.0.saturating_sub(duration_nanos(rhs)))
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;
    /// Saturating: an `rhs` later than `self` yields zero.
    fn sub(self, rhs: Instant) -> Duration {
        self.saturating_duration_since(rhs)
    }
}

impl fmt::Debug for Instant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Instant({}.{:09}s)",
            self.0 / 1_000_000_000,
            self.0 % 1_000_000_000
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates() {
        let a = Instant::from_nanos(1_500);
        assert_eq!((a + Duration::from_nanos(500)).as_nanos(), 2_000);
        assert_eq!(a - Instant::from_nanos(2_000), Duration::ZERO);
        assert_eq!(Instant::from_nanos(2_000) - a, Duration::from_nanos(500));
        let end = Instant::from_nanos(u64::MAX) + Duration::from_secs(1);
        assert_eq!(end.as_nanos(), u64::MAX);
        assert_eq!(Instant::from_micros(3).as_nanos(), 3_000);
    }
}
