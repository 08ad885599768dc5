//! Loss recovery and retransmission timing of the multi-path sender.
//!
//! Owns the rules that decide a packet is lost and when it is resent: the SACK bitmap
//! above `snd_una`, sender-side loss detection (highest SACK more than Δ ahead), the
//! NACK-started recovery sweep (MP-RDMA §3.3), tail-loss resend, the hole resend timer
//! and the RTO with exponential backoff. Which path a resend takes is decided by the
//! caller's send opportunity (`super::path`).

use super::*;

impl Connection {
    /// Sender-side loss detection. Path selection keeps reordering within Δ, so when
    /// the highest SACK is more than Δ above `snd_una`, the packet at `snd_una` (and
    /// every unSACKed one that far behind) is lost: start recovery without waiting for
    /// the receiver's bitmap to overflow.
    pub(super) fn detect_loss(&mut self, now: Instant) {
        let behind = seq::diff(self.s.snd_ooh, self.s.snd_una);
        if self.s.in_recovery || behind <= 0 || behind.unsigned_abs() <= self.config.delta {
            return;
        }
        let una = self.s.snd_una;
        self.enter_recovery(now, una, false);
    }

    /// How long a resent hole may stay missing before its resend counts as lost:
    /// one RTT for the resend plus the usual RTO margin (`srtt + 4·rttvar`).
    pub(super) fn resend_grace(&self) -> Duration {
        self.s.rtt.srtt() + self.s.rtt.rto(Duration::ZERO, self.config.max_rto)
    }

    /// The `Resend` timer fired: the resent hole at `snd_una` is still missing, so the
    /// resend was lost as well; send it again (the timer re-arms when it leaves).
    pub(super) fn on_resend_timer(&mut self) {
        let una = self.s.snd_una;
        if self.timers.resend_watch != una || self.in_flight() == 0 {
            return;
        }
        self.stats.repeated_resends += 1;
        let path = self.timers.last_ack_path;
        self.tokens.push_front(Token {
            path,
            probe: false,
            psn: Some(una),
        });
    }

    /// Enters loss recovery until `snd_una` reaches the current `snd_nxt`; the sweep
    /// of holes starts at `sweep_from`.
    pub(super) fn enter_recovery(&mut self, now: Instant, sweep_from: u32, after_timeout: bool) {
        self.s.in_recovery = true;
        self.s.recovery_after_timeout = after_timeout;
        self.s.recovery = self.s.snd_nxt;
        self.s.snd_retx = sweep_from;
        self.timers.rewind_holdoff_until = now + self.s.rtt.srtt();
        self.stats.recoveries += 1;
    }

    /// Moves `snd_una` to `aack` if that is progress; completes acknowledged messages.
    pub(super) fn advance_una(&mut self, now: Instant, aack: u32) {
        if !seq::lt(self.s.snd_una, aack) {
            return;
        }
        let advanced = seq::dist(self.s.snd_una, aack);
        self.s.inflate = self.s.inflate.saturating_sub(advanced);
        self.sacked.clear_range(self.s.snd_una, advanced);
        self.s.snd_una = aack;
        if seq::lt(self.s.snd_nxt, aack) {
            self.s.snd_nxt = aack; // go-back-N rewound below an ACK that then arrived
        }
        let events = &mut self.events;
        let stats = &mut self.stats;
        self.queue.pop_acked(aack, |id| {
            stats.messages_acked += 1;
            events.push_back(Event::MessageAcked(id));
        });
        if self.s.in_recovery && !seq::lt(self.s.snd_una, self.s.recovery) {
            self.s.in_recovery = false;
            self.s.recovery_after_timeout = false;
            self.s.retx_in_flight = 0;
        }
        let in_flight = seq::dist(self.s.snd_una, self.s.snd_nxt);
        self.s.inflate = self.s.inflate.min(in_flight);
        if in_flight == 0 {
            self.s.retx_in_flight = 0;
        }
        self.s.rto_count = 0;
        self.rearm_rto(now, true);
        if self.timers.get(Timer::Resend).is_some() {
            if self.s.in_recovery
                && !self.s.recovery_after_timeout
                && seq::lt(self.s.snd_una, self.s.snd_retx)
            {
                // The new hole at snd_una was already resent by the sweep: watch it.
                self.timers.resend_watch = self.s.snd_una;
                self.timers
                    .set(Timer::Resend, Some(now + self.resend_grace()));
            } else {
                self.timers.set(Timer::Resend, None);
            }
        }
    }

    /// Whether `psn` lies in the scoreboard's range `[snd_una, snd_una + capacity)`.
    fn on_scoreboard(&self, psn: u32) -> bool {
        let off = seq::diff(psn, self.s.snd_una);
        off >= 0 && off.unsigned_abs() < self.sacked.capacity()
    }

    pub(super) fn is_sacked(&self, psn: u32) -> bool {
        self.on_scoreboard(psn) && self.sacked.get(psn) != 0
    }

    pub(super) fn mark_sacked(&mut self, psn: u32) {
        if self.on_scoreboard(psn) {
            self.sacked.set(psn, 1);
        }
    }

    /// PSNs in `[from, until)` not known to be SACKed (`from >= snd_una`).
    pub(super) fn unsacked_between(&self, from: u32, until: u32) -> u64 {
        if !seq::lt(from, until) {
            return 0;
        }
        let total = u64::from(seq::dist(from, until));
        let cap = self.sacked.capacity();
        let lo = seq::dist(self.s.snd_una, from).min(cap);
        let hi = seq::dist(self.s.snd_una, until).min(cap);
        let known = self
            .sacked
            .count_nonzero(self.s.snd_una.wrapping_add(lo), hi - lo);
        total - u64::from(known)
    }

    /// First PSN at or after `from` and before `until` that is not SACKed.
    pub(super) fn first_unsacked(&self, mut from: u32, until: u32) -> Option<u32> {
        while seq::lt(from, until) {
            if !self.is_sacked(from) {
                return Some(from);
            }
            from = from.wrapping_add(1);
        }
        None
    }

    /// Recovery resends unSACKed packets more than Δ below the highest SACK: path
    /// selection keeps reordering within Δ, so such a packet is lost, while one closer
    /// to `snd_ooh` may still be in flight on a slightly slower path.
    pub(super) fn recovery_limit(&self) -> u32 {
        let s = &self.s;
        let limit = s.recovery.min_serial(s.snd_nxt);
        if s.recovery_after_timeout {
            return limit;
        }
        if seq::lt(s.snd_ooh, s.snd_una) {
            return s.snd_una;
        }
        let reorder_bound = s.snd_ooh.wrapping_sub(self.config.delta).wrapping_add(1);
        limit.min_serial(seq::max(reorder_bound, s.snd_una))
    }

    /// Tail resend covers unacknowledged packets at least [`TAIL_REORDER_THRESHOLD`]
    /// below the highest SACK: so many later packets arrived that this one is lost
    /// or on a slow path, not merely overtaken.
    pub(super) fn tail_resend_limit(&self) -> u32 {
        if seq::lt(self.s.snd_ooh, self.s.snd_una) {
            return self.s.snd_una; // nothing SACKed above snd_una
        }
        let bound = self
            .s
            .snd_ooh
            .wrapping_sub(TAIL_REORDER_THRESHOLD)
            .wrapping_add(1);
        seq::max(bound, self.s.snd_una).min_serial(self.s.snd_nxt)
    }

    /// In recovery the receiver's bitmap is pinned at the hole (`rcv_nxt == snd_una`):
    /// a new packet at or beyond `snd_una + L` would be dropped on arrival, so new data
    /// waits until the hole fills. Outside recovery the window may run beyond
    /// `snd_una + L` (the receiver's `rcv_nxt` is ahead of `snd_una` by the ACKs in
    /// flight); capping it there too would leave a path whose BDP exceeds L unfilled.
    pub(super) fn new_data_blocked_by_bitmap(&self) -> bool {
        self.s.in_recovery
            && seq::dist(self.s.snd_una, self.s.snd_nxt) >= self.config.bitmap_len
            && seq::lt(self.s.snd_nxt, self.queue.end_psn())
    }

    pub(super) fn rto(&self) -> Duration {
        let base = self.s.rtt.rto(self.config.min_rto, self.config.max_rto);
        let backoff = base.saturating_mul(1u32 << u32::from(self.s.rto_count.min(16)));
        backoff.min(self.config.max_rto)
    }

    /// (Re)arms the retransmission timer while anything is in flight.
    pub(super) fn rearm_rto(&mut self, now: Instant, restart: bool) {
        if self.in_flight() == 0 {
            self.timers.set(Timer::Rto, None);
        } else if restart || self.timers.get(Timer::Rto).is_none() {
            self.timers.set(Timer::Rto, Some(now + self.rto()));
        }
    }

    pub(super) fn on_rto(&mut self, now: Instant) {
        if self.in_flight() == 0 {
            return;
        }
        self.stats.timeouts += 1;
        self.s.rto_count = self.s.rto_count.saturating_add(1);
        if u32::from(self.s.rto_count) > self.config.max_rto_count {
            self.fail(ConnectionError::TimedOut(u32::from(self.s.rto_count) - 1));
            return;
        }
        match self.config.mode {
            Mode::MultiPath => {
                let (min, max) = (self.config.min_window, self.config.max_window);
                let una = self.s.snd_una;
                self.enter_recovery(now, una.wrapping_add(1), true);
                self.s.snd_tail = una;
                // Everything in flight is presumed gone: it no longer holds the window.
                self.s.inflate = self.in_flight();
                self.s.retx_in_flight = 0;
                self.s.window.set(
                    (self.s.window.get() / 2.0).min(f64::from(self.config.initial_window)),
                    min,
                    max,
                );
                self.tokens.clear();
                let path = self.timers.last_ack_path;
                self.tokens.push_back(Token {
                    path,
                    probe: false,
                    psn: Some(una),
                });
            }
            Mode::SinglePath => {
                self.s.snd_nxt = self.s.snd_una;
                self.stats.go_back_n += 1;
            }
        }
        self.timers.set(Timer::Rto, Some(now + self.rto()));
    }
}
