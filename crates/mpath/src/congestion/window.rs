//! The MP-RDMA congestion window: one window for all paths, in packets.
//!
//! Rules (per ACK): ECE=0 → `cwnd += 1/cwnd`; ECE=1 → `cwnd -= 1/2`; an ACK from a slow
//! path, and an ACK that could send but finds no data (use it or lose it), → `cwnd -= 1`.
//! The window always stays within `[min_window, max_window]`.

/// Congestion window in packets; invariant: `min <= cwnd <= max`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Window {
    cwnd: f64,
}

impl Window {
    pub(crate) fn new(initial: f64, min: f64, max: f64) -> Self {
        Window {
            cwnd: initial.clamp(min, max),
        }
    }

    pub(crate) fn get(&self) -> f64 {
        self.cwnd
    }

    pub(crate) fn set(&mut self, value: f64, min: f64, max: f64) {
        self.cwnd = value.clamp(min, max);
    }

    /// ECE=0: additive increase, one packet per window of ACKs.
    pub(crate) fn on_unmarked_ack(&mut self, min: f64, max: f64) {
        self.set(self.cwnd + 1.0 / self.cwnd, min, max);
    }

    /// ECE=1: half a packet per marked ACK (a fully marked window halves cwnd).
    pub(crate) fn on_marked_ack(&mut self, min: f64, max: f64) {
        self.set(self.cwnd - 0.5, min, max);
    }

    /// Slow-path ACK or unused send opportunity: one packet less.
    pub(crate) fn shrink_by_one(&mut self, min: f64, max: f64) {
        self.set(self.cwnd - 1.0, min, max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_and_bounds() {
        let mut w = Window::new(4.0, 1.0, 8.0);
        w.on_unmarked_ack(1.0, 8.0);
        assert_eq!(w.get(), 4.25);
        w.on_marked_ack(1.0, 8.0);
        assert_eq!(w.get(), 3.75);
        w.shrink_by_one(1.0, 8.0);
        assert_eq!(w.get(), 2.75);
        for _ in 0..10 {
            w.shrink_by_one(1.0, 8.0);
        }
        assert_eq!(w.get(), 1.0);
        for _ in 0..1000 {
            w.on_unmarked_ack(1.0, 8.0);
        }
        assert_eq!(w.get(), 8.0);
    }
}
