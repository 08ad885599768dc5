//! DCQCN-style rate control for the single-path baseline (reaction point side).
//!
//! Owns the current rate `Rc`, the target rate `Rt`, the congestion estimate `alpha` and
//! the increase stage. The connection calls [`Dcqcn::on_congestion`] for an ECN echo
//! (the notification point's CNP, rate limited to one reaction per `cnp_interval`),
//! [`Dcqcn::decay_alpha`] for the alpha periods that passed without one, and
//! [`Dcqcn::on_increase_timer`] when a rate-increase period ends.
//! Increase is timer driven only (no byte counter): `F` fast-recovery steps toward `Rt`,
//! then additive increase of `Rt` by `R_AI`, then hyper increase by `i·R_HAI`.

use crate::config::DcqcnConfig;

/// Rate-control state; invariant: `min_rate <= rate <= line_rate`, `0 <= alpha <= 1`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Dcqcn {
    /// Current sending rate `Rc` (bits/s).
    rate: f64,
    /// Target rate `Rt` (bits/s).
    target: f64,
    /// Congestion estimate.
    alpha: f64,
    /// Increase-timer expiries since the last cut.
    stage: u32,
}

impl Dcqcn {
    pub(crate) fn new(cfg: &DcqcnConfig) -> Self {
        Dcqcn {
            rate: cfg.line_rate_bps,
            target: cfg.line_rate_bps,
            alpha: 1.0,
            stage: 0,
        }
    }

    pub(crate) fn rate(&self) -> f64 {
        self.rate
    }

    #[cfg(test)]
    pub(crate) fn alpha(&self) -> f64 {
        self.alpha
    }

    /// A congestion notification: cut the rate by `alpha/2`, raise alpha.
    pub(crate) fn on_congestion(&mut self, cfg: &DcqcnConfig) {
        self.target = self.rate;
        self.rate =
            (self.rate * (1.0 - self.alpha / 2.0)).clamp(cfg.min_rate_bps, cfg.line_rate_bps);
        self.alpha = ((1.0 - cfg.g) * self.alpha + cfg.g).min(1.0);
        self.stage = 0;
    }

    /// `periods` alpha periods passed without notification: decay alpha once for each.
    pub(crate) fn decay_alpha(&mut self, cfg: &DcqcnConfig, periods: u32) {
        let periods = i32::try_from(periods).unwrap_or(i32::MAX);
        self.alpha *= (1.0 - cfg.g).powi(periods);
    }

    /// A rate-increase period passed. Returns whether the rate is still below line rate
    /// (the timer should keep running).
    pub(crate) fn on_increase_timer(&mut self, cfg: &DcqcnConfig) -> bool {
        self.stage = self.stage.saturating_add(1);
        let f = cfg.fast_recovery_steps;
        if self.stage > 2 * f {
            self.target += cfg.hyper_increase_bps * f64::from(self.stage - 2 * f);
        } else if self.stage > f {
            self.target += cfg.additive_increase_bps;
        }
        self.target = self.target.min(cfg.line_rate_bps);
        self.rate = ((self.rate + self.target) / 2.0).clamp(cfg.min_rate_bps, cfg.line_rate_bps);
        if cfg.line_rate_bps - self.rate < 1.0 {
            self.rate = cfg.line_rate_bps;
        }
        self.rate < cfg.line_rate_bps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_then_recover_to_line_rate() {
        let cfg = DcqcnConfig::default();
        let mut d = Dcqcn::new(&cfg);
        d.on_congestion(&cfg);
        // alpha starts at 1: the first cut halves the rate.
        assert_eq!(d.rate(), 50e9);
        assert!(d.alpha() > 0.99);
        d.on_congestion(&cfg);
        assert!(d.rate() < 26e9 && d.rate() > 24e9);
        let mut steps = 0;
        while d.on_increase_timer(&cfg) {
            steps += 1;
            assert!(steps < 10_000, "rate never recovered");
        }
        assert_eq!(d.rate(), cfg.line_rate_bps);
        let a = d.alpha();
        d.decay_alpha(&cfg, 1);
        assert!(d.alpha() < a);
    }
}
