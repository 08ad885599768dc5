//! Round-trip-time estimation and the retransmission timeout (RFC 6298 rules).
//!
//! Owns `srtt`/`rttvar`, stored as 32-bit nanosecond counts so that they fit the
//! per-connection state budget (samples above ~4.29 s are clamped). Samples come from
//! the timestamp a data packet carries and its ACK echoes, so retransmissions give
//! unambiguous samples and the sender keeps no per-packet send times.

use std::time::Duration;

/// Smoothed RTT and variance, in nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RttEstimator {
    /// Smoothed RTT (ns); the configured initial RTT until the first sample.
    srtt_ns: u32,
    /// RTT variance (ns).
    rttvar_ns: u32,
    /// Whether a sample has been taken.
    has_sample: bool,
}

fn clamp_ns(d: Duration) -> u32 {
    u32::try_from(d.as_nanos()).unwrap_or(u32::MAX)
}

impl RttEstimator {
    pub(crate) fn new(initial: Duration) -> Self {
        let srtt_ns = clamp_ns(initial).max(1);
        RttEstimator {
            srtt_ns,
            rttvar_ns: srtt_ns / 2,
            has_sample: false,
        }
    }

    /// Feeds one RTT sample.
    pub(crate) fn on_sample(&mut self, sample: Duration) {
        let s = clamp_ns(sample).max(1);
        if !self.has_sample {
            self.srtt_ns = s;
            self.rttvar_ns = s / 2;
            self.has_sample = true;
            return;
        }
        let srtt = u64::from(self.srtt_ns);
        let dev = srtt.abs_diff(u64::from(s));
        self.rttvar_ns = ((3 * u64::from(self.rttvar_ns) + dev) / 4) as u32;
        self.srtt_ns = ((7 * srtt + u64::from(s)) / 8).max(1) as u32;
    }

    /// The smoothed RTT.
    pub(crate) fn srtt(&self) -> Duration {
        Duration::from_nanos(u64::from(self.srtt_ns))
    }

    /// `srtt + 4·rttvar`, clamped to `[min, max]`.
    pub(crate) fn rto(&self, min: Duration, max: Duration) -> Duration {
        let raw = u64::from(self.srtt_ns) + 4 * u64::from(self.rttvar_ns);
        Duration::from_nanos(raw).clamp(min, max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converges_to_steady_samples() {
        let mut r = RttEstimator::new(Duration::from_micros(100));
        assert_eq!(r.srtt(), Duration::from_micros(100));
        for _ in 0..64 {
            r.on_sample(Duration::from_micros(10));
        }
        assert_eq!(r.srtt(), Duration::from_micros(10));
        assert_eq!(
            r.rto(Duration::from_micros(1), Duration::from_secs(1)),
            Duration::from_micros(10)
        );
        assert_eq!(
            r.rto(Duration::from_millis(1), Duration::from_secs(1)),
            Duration::from_millis(1)
        );
    }

    #[test]
    fn huge_samples_clamp() {
        let mut r = RttEstimator::new(Duration::from_micros(100));
        r.on_sample(Duration::from_secs(100));
        assert_eq!(r.srtt().as_nanos(), u128::from(u32::MAX));
    }
}
