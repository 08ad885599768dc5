//! Connection configuration and its validation.
//!
//! Owns [`Config`] (every protocol knob, with the MP-RDMA paper's defaults) and the
//! single-path baseline's [`DcqcnConfig`]. Values are checked once by
//! [`Config::validate`]; the rest of the crate relies on a validated config and never
//! re-checks (a `Connection` built from an invalid config is repaired to the nearest
//! valid value by [`Config::sanitized`], never panics).

use std::time::Duration;

use thiserror::Error;

use crate::frame::DATA_HEADER_LEN;

/// Which transport a connection runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// MP-RDMA: one congestion window sprayed over `num_paths` virtual paths,
    /// ACK clocking per echoed path, out-of-order-aware path selection.
    #[default]
    MultiPath,
    /// Baseline RoCE-like transport: one fixed virtual path, DCQCN rate control,
    /// go-back-N loss recovery.
    SinglePath,
}

/// Parameters of the single-path baseline's DCQCN-style rate control.
///
/// Rates are in bits per second of payload-plus-header bytes on the wire.
#[derive(Clone, Debug, PartialEq)]
pub struct DcqcnConfig {
    /// Line rate: the initial and maximum sending rate (default 100 Gb/s).
    pub line_rate_bps: f64,
    /// Lowest rate the controller will cut to (default 10 Mb/s).
    pub min_rate_bps: f64,
    /// EWMA gain `g` of the congestion estimate alpha (default 1/256).
    pub g: f64,
    /// Period of the alpha decay timer without congestion notifications (default 55 µs).
    pub alpha_timer: Duration,
    /// Period of the rate-increase timer (default 55 µs).
    pub rate_increase_timer: Duration,
    /// Minimum spacing of reactions to congestion notifications, like the notification
    /// point's CNP interval (default 50 µs).
    pub cnp_interval: Duration,
    /// Number of fast-recovery increase steps before additive increase (`F`, default 5).
    pub fast_recovery_steps: u32,
    /// Additive increase step `R_AI` (default 400 Mb/s).
    pub additive_increase_bps: f64,
    /// Hyper increase step `R_HAI` (default 4 Gb/s).
    pub hyper_increase_bps: f64,
    /// Go-back-N window: the most unacknowledged packets in flight (default 1024).
    pub max_inflight_packets: u32,
}

impl Default for DcqcnConfig {
    fn default() -> Self {
        DcqcnConfig {
            line_rate_bps: 100e9,
            min_rate_bps: 10e6,
            g: 1.0 / 256.0,
            alpha_timer: Duration::from_micros(55),
            rate_increase_timer: Duration::from_micros(55),
            cnp_interval: Duration::from_micros(50),
            fast_recovery_steps: 5,
            additive_increase_bps: 400e6,
            hyper_increase_bps: 4e9,
            max_inflight_packets: 1024,
        }
    }
}

/// Configuration of one [`Connection`](crate::Connection).
///
/// Both ends of a connection should use the same `mode` and `bitmap_len`. Fields are
/// public; build one with struct-update syntax from [`Config::default`] and check it with
/// [`Config::validate`].
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Multi-path (MP-RDMA) or the single-path baseline.
    pub mode: Mode,
    /// Virtual paths (UDP source-port indices) available: `PathId(0..num_paths)`.
    /// Default 64. Single-path mode uses only `PathId(single_path)`.
    pub num_paths: u16,
    /// The virtual path the single-path baseline uses (default 0).
    pub single_path: u16,
    /// Payload bytes per data packet (default 1024).
    pub mss: u16,
    /// Initial congestion window in packets, also the restart window after idle
    /// (default 16). The first window leaves on this many random paths.
    pub initial_window: u32,
    /// Smallest congestion window in packets (default 1).
    pub min_window: f64,
    /// Largest congestion window in packets (default 4096).
    pub max_window: f64,
    /// Δ: the out-of-order tolerance in packets. An ACK whose SACK is below
    /// `snd_ooh - Δ` comes from a slow path and is pruned (default 32).
    pub delta: u32,
    /// L: receiver bitmap length in packets; a PSN at or beyond `rcv_nxt + L` is dropped
    /// and NACKed (default 64, the paper's; at most [`MAX_BITMAP_LEN`]). Make it larger
    /// than the bandwidth-delay product in packets: while a hole is repaired the receiver
    /// accepts only L packets beyond it.
    pub bitmap_len: u32,
    /// Probability that an ACK-clocked packet probes a new random path instead of the
    /// echoed one (default 0.01).
    pub probe_probability: f64,
    /// Most packets one ACK may release on its path; the rest wait for the burst timer
    /// (default 2).
    pub burst_per_ack: u32,
    /// α of the synchronise delay Δt = α·Δ/(cwnd/RTT) (default 1.0).
    pub sync_alpha: f64,
    /// RTT assumed before the first sample (default 100 µs).
    pub initial_rtt: Duration,
    /// Lower bound of the retransmission timeout (default 1 ms).
    pub min_rto: Duration,
    /// Upper bound of the retransmission timeout after backoff (default 1 s).
    pub max_rto: Duration,
    /// Consecutive retransmission timeouts without progress before the connection
    /// fails with [`ConnectionError::TimedOut`](crate::ConnectionError::TimedOut)
    /// (default 10).
    pub max_rto_count: u32,
    /// Idle time, in smoothed RTTs, after which the window restarts from
    /// `initial_window` (default 3).
    pub idle_restart_rtts: u32,
    /// Least spacing of two NACKs for the same missing PSN (default 20 µs).
    pub nack_interval: Duration,
    /// Largest message `send` accepts, in bytes (default 1 GiB).
    pub max_message_len: u64,
    /// Most messages queued or unacknowledged before `send` returns
    /// [`SendError::QueueFull`](crate::SendError::QueueFull) (default 4096).
    pub max_queued_messages: usize,
    /// Seed of the connection's random choices (paths, probes). Same inputs and seed,
    /// same outputs.
    pub seed: u64,
    /// Record `(time, cwnd)` on every window change into [`Stats::cwnd_trace`](crate::Stats)
    /// (default false; costs one vector push per ACK when on).
    pub trace_cwnd: bool,
    /// Single-path baseline parameters.
    pub dcqcn: DcqcnConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mode: Mode::MultiPath,
            num_paths: 64,
            single_path: 0,
            mss: 1024,
            initial_window: 16,
            min_window: 1.0,
            max_window: 4096.0,
            delta: 32,
            bitmap_len: 64,
            probe_probability: 0.01,
            burst_per_ack: 2,
            sync_alpha: 1.0,
            initial_rtt: Duration::from_micros(100),
            min_rto: Duration::from_millis(1),
            max_rto: Duration::from_secs(1),
            max_rto_count: 10,
            idle_restart_rtts: 3,
            nack_interval: Duration::from_micros(20),
            max_message_len: 1 << 30,
            max_queued_messages: 4096,
            seed: 0,
            trace_cwnd: false,
            dcqcn: DcqcnConfig::default(),
        }
    }
}

/// Largest `mss` a UDP datagram can hold after the data header.
pub const MAX_MSS: u16 = (65_507 - DATA_HEADER_LEN) as u16;

/// Largest receiver bitmap. The paper's NIC keeps 64 two-bit slots in a 128-bit register
/// (the default `bitmap_len`); a software receiver can afford more when the
/// bandwidth-delay product, in packets, exceeds 64.
pub const MAX_BITMAP_LEN: u32 = 1024;

/// A [`Config`] value out of its allowed range.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A field is outside its allowed range.
    #[error("config field `{field}` out of range: {reason}")]
    OutOfRange {
        /// The field's name.
        field: &'static str,
        /// What the allowed range is.
        reason: &'static str,
    },
}

fn check(ok: bool, field: &'static str, reason: &'static str) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange { field, reason })
    }
}

impl Config {
    /// Checks every field against its allowed range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check(self.num_paths >= 1, "num_paths", "at least 1")?;
        check(
            self.single_path < self.num_paths,
            "single_path",
            "below num_paths",
        )?;
        check(self.mss >= 1 && self.mss <= MAX_MSS, "mss", "1..=65479")?;
        check(self.initial_window >= 1, "initial_window", "at least 1")?;
        check(
            self.min_window.is_finite() && self.min_window >= 1.0,
            "min_window",
            "finite, at least 1",
        )?;
        check(
            self.max_window.is_finite() && self.max_window >= self.min_window,
            "max_window",
            "finite, at least min_window",
        )?;
        check(
            f64::from(self.initial_window) <= self.max_window,
            "initial_window",
            "at most max_window",
        )?;
        check(
            self.bitmap_len >= 2 && self.bitmap_len <= MAX_BITMAP_LEN,
            "bitmap_len",
            "2..=1024",
        )?;
        check(
            self.delta >= 1 && self.delta < self.bitmap_len,
            "delta",
            "1..bitmap_len",
        )?;
        check(
            (0.0..=1.0).contains(&self.probe_probability),
            "probe_probability",
            "0..=1",
        )?;
        check(self.burst_per_ack >= 1, "burst_per_ack", "at least 1")?;
        check(
            self.sync_alpha.is_finite() && self.sync_alpha >= 0.0,
            "sync_alpha",
            "finite, at least 0",
        )?;
        check(!self.initial_rtt.is_zero(), "initial_rtt", "non-zero")?;
        check(!self.min_rto.is_zero(), "min_rto", "non-zero")?;
        check(self.max_rto >= self.min_rto, "max_rto", "at least min_rto")?;
        check(self.max_rto_count >= 1, "max_rto_count", "at least 1")?;
        check(
            self.idle_restart_rtts >= 1,
            "idle_restart_rtts",
            "at least 1",
        )?;
        check(self.max_message_len >= 1, "max_message_len", "at least 1")?;
        check(
            self.max_queued_messages >= 1,
            "max_queued_messages",
            "at least 1",
        )?;
        let d = &self.dcqcn;
        check(
            d.line_rate_bps.is_finite() && d.line_rate_bps > 0.0,
            "dcqcn.line_rate_bps",
            "finite, positive",
        )?;
        check(
            d.min_rate_bps.is_finite() && d.min_rate_bps > 0.0 && d.min_rate_bps <= d.line_rate_bps,
            "dcqcn.min_rate_bps",
            "positive, at most line_rate_bps",
        )?;
        check(d.g > 0.0 && d.g <= 1.0, "dcqcn.g", "0<g<=1")?;
        check(!d.alpha_timer.is_zero(), "dcqcn.alpha_timer", "non-zero")?;
        check(
            !d.rate_increase_timer.is_zero(),
            "dcqcn.rate_increase_timer",
            "non-zero",
        )?;
        check(
            d.additive_increase_bps.is_finite() && d.additive_increase_bps >= 0.0,
            "dcqcn.additive_increase_bps",
            "finite, at least 0",
        )?;
        check(
            d.hyper_increase_bps.is_finite() && d.hyper_increase_bps >= 0.0,
            "dcqcn.hyper_increase_bps",
            "finite, at least 0",
        )?;
        check(
            d.max_inflight_packets >= 1 && d.max_inflight_packets < (1 << 30),
            "dcqcn.max_inflight_packets",
            "1..2^30",
        )?;
        Ok(())
    }

    /// A copy with every out-of-range field replaced by its default (or clamped), so
    /// [`Connection::new`](crate::Connection::new) never panics on a bad config.
    pub fn sanitized(&self) -> Config {
        if self.validate().is_ok() {
            return self.clone();
        }
        let def = Config::default();
        let mut c = self.clone();
        c.num_paths = c.num_paths.max(1);
        if c.single_path >= c.num_paths {
            c.single_path = 0;
        }
        c.mss = c.mss.clamp(1, MAX_MSS);
        c.bitmap_len = c.bitmap_len.clamp(2, MAX_BITMAP_LEN);
        c.delta = c.delta.clamp(1, c.bitmap_len - 1);
        if !(c.min_window.is_finite() && c.min_window >= 1.0) {
            c.min_window = def.min_window;
        }
        if !(c.max_window.is_finite() && c.max_window >= c.min_window) {
            c.max_window = def.max_window.max(c.min_window);
        }
        c.initial_window = c.initial_window.max(1);
        if f64::from(c.initial_window) > c.max_window {
            c.initial_window = c.max_window as u32;
        }
        if !(0.0..=1.0).contains(&c.probe_probability) {
            c.probe_probability = def.probe_probability;
        }
        c.burst_per_ack = c.burst_per_ack.max(1);
        if !(c.sync_alpha.is_finite() && c.sync_alpha >= 0.0) {
            c.sync_alpha = def.sync_alpha;
        }
        if c.initial_rtt.is_zero() {
            c.initial_rtt = def.initial_rtt;
        }
        if c.min_rto.is_zero() {
            c.min_rto = def.min_rto;
        }
        c.max_rto = c.max_rto.max(c.min_rto);
        c.max_rto_count = c.max_rto_count.max(1);
        c.idle_restart_rtts = c.idle_restart_rtts.max(1);
        c.max_message_len = c.max_message_len.max(1);
        c.max_queued_messages = c.max_queued_messages.max(1);
        let dd = DcqcnConfig::default();
        let d = &mut c.dcqcn;
        if !(d.line_rate_bps.is_finite() && d.line_rate_bps > 0.0) {
            d.line_rate_bps = dd.line_rate_bps;
        }
        if !(d.min_rate_bps.is_finite()
            && d.min_rate_bps > 0.0
            && d.min_rate_bps <= d.line_rate_bps)
        {
            d.min_rate_bps = dd.min_rate_bps.min(d.line_rate_bps);
        }
        if !(d.g > 0.0 && d.g <= 1.0) {
            d.g = dd.g;
        }
        if d.alpha_timer.is_zero() {
            d.alpha_timer = dd.alpha_timer;
        }
        if d.rate_increase_timer.is_zero() {
            d.rate_increase_timer = dd.rate_increase_timer;
        }
        if !(d.additive_increase_bps.is_finite() && d.additive_increase_bps >= 0.0) {
            d.additive_increase_bps = dd.additive_increase_bps;
        }
        if !(d.hyper_increase_bps.is_finite() && d.hyper_increase_bps >= 0.0) {
            d.hyper_increase_bps = dd.hyper_increase_bps;
        }
        d.max_inflight_packets = d.max_inflight_packets.clamp(1, (1 << 30) - 1);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_matches_paper() {
        let c = Config::default();
        c.validate().unwrap();
        assert_eq!(
            (c.delta, c.bitmap_len, c.num_paths, c.burst_per_ack),
            (32, 64, 64, 2)
        );
        assert_eq!(c.probe_probability, 0.01);
    }

    #[test]
    fn out_of_range_fields_are_reported_and_sanitized() {
        let bad = Config {
            delta: 64,
            bitmap_len: 64,
            ..Config::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(ConfigError::OutOfRange { field: "delta", .. })
        ));
        bad.sanitized().validate().unwrap();
        let bad = Config {
            bitmap_len: MAX_BITMAP_LEN + 1,
            mss: 0,
            num_paths: 0,
            min_window: f64::NAN,
            ..Config::default()
        };
        assert!(bad.validate().is_err());
        bad.sanitized().validate().unwrap();
    }
}
