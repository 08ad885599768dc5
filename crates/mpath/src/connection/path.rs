//! Multi-path ACK clocking and path selection.
//!
//! Owns how send opportunities arise and which virtual path each uses (MP-RDMA §3.1,
//! §3.2): the available window `awnd = cwnd + inflate - in flight`, up to
//! `burst_per_ack` packets per ACK on the echoed path (or a random path when probing),
//! the burst timer for window left over, use it or lose it, the first window and idle
//! restart on random paths, and which PSN an opportunity carries (resend, new data, or
//! tail resend). Keeps no per-path state.

use super::*;

impl Connection {
    pub(super) fn in_flight(&self) -> u32 {
        seq::dist(self.s.snd_una, self.s.snd_nxt)
    }

    /// Available window: `cwnd + inflate - (snd_nxt - snd_una) - retransmissions in
    /// flight - opportunities already granted`, rounded down.
    pub(super) fn available_window(&self) -> i64 {
        let awnd = self.s.window.get() + f64::from(self.s.inflate)
            - f64::from(self.in_flight())
            - f64::from(self.s.retx_in_flight)
            - self.tokens.len() as f64;
        awnd.floor() as i64
    }

    /// Packets that could be sent now: retransmissions owed, new data, tail resends.
    pub(super) fn sendable(&self) -> u64 {
        let s = &self.s;
        let mut n = 0u64;
        if s.in_recovery {
            let from = seq::max(s.snd_retx, s.snd_una);
            n += self.unsacked_between(from, self.recovery_limit());
        }
        if self.new_data_blocked_by_bitmap() {
            return n;
        }
        n += u64::from(seq::dist(s.snd_nxt, self.queue.end_psn()));
        if n == 0 {
            let from = seq::max(s.snd_tail, s.snd_una);
            n += self.unsacked_between(from, self.tail_resend_limit());
        }
        n
    }

    /// Whether the packets on the wire fill the window: `cwnd + inflate - in flight -
    /// retransmissions in flight` (the available window, not counting opportunities
    /// granted but not yet sent) is at most `burst_per_ack`. Checked before an ACK is
    /// applied; only then may an unmarked ACK grow the window.
    pub(super) fn window_limited(&self) -> bool {
        let unused = self.s.window.get() + f64::from(self.s.inflate)
            - f64::from(self.in_flight())
            - f64::from(self.s.retx_in_flight);
        unused <= f64::from(self.config.burst_per_ack)
    }

    pub(super) fn random_path(&mut self) -> PathId {
        PathId(self.rng.gen_range(0..self.config.num_paths))
    }

    /// Multi-path ACK clocking: an ACK releases up to `burst_per_ack` packets on its own
    /// path (each may instead probe a random path); window left over waits for the burst
    /// timer; an opportunity without data shrinks the window (use it or lose it).
    pub(super) fn release_on_ack(&mut self, now: Instant, path: PathId) {
        let avail = self.available_window();
        if avail <= 0 {
            return;
        }
        let sendable = self.sendable().saturating_sub(self.tokens.len() as u64);
        if sendable == 0 {
            if self.new_data_blocked_by_bitmap() {
                return; // data waits for the hole to fill: not an unused opportunity
            }
            self.stats.unused_send_opportunities += 1;
            self.s
                .window
                .shrink_by_one(self.config.min_window, self.config.max_window);
            return;
        }
        let avail = avail as u64;
        let k = avail
            .min(u64::from(self.config.burst_per_ack))
            .min(sendable);
        for _ in 0..k {
            let probe = self.config.probe_probability > 0.0
                && self.rng.gen_bool(self.config.probe_probability);
            let token = if probe {
                Token {
                    path: self.random_path(),
                    probe: true,
                    psn: None,
                }
            } else {
                Token {
                    path,
                    probe: false,
                    psn: None,
                }
            };
            self.tokens.push_back(token);
        }
        if avail > k && sendable > k && self.timers.get(Timer::Burst).is_none() {
            self.timers
                .set(Timer::Burst, Some(now + self.s.rtt.srtt() / 2));
        }
    }

    /// With nothing in flight no ACK will clock the sender: send the window on random
    /// paths (the first window, or after idle, restarting from the initial window).
    pub(super) fn kickoff(&mut self, now: Instant) {
        if self.in_flight() != 0 || !self.tokens.is_empty() || self.error.is_some() {
            return;
        }
        let sendable = self.sendable();
        if sendable == 0 {
            return;
        }
        if self.timers.idle_restart_at.is_some_and(|t| now >= t) {
            self.stats.idle_restarts += 1;
            self.s.window.set(
                f64::from(self.config.initial_window),
                self.config.min_window,
                self.config.max_window,
            );
            self.timers.idle_restart_at = None;
        }
        let n = (self.available_window().max(1) as u64).min(sendable);
        for _ in 0..n {
            let path = self.random_path();
            self.tokens.push_back(Token {
                path,
                probe: false,
                psn: None,
            });
        }
    }

    pub(super) fn on_burst_timer(&mut self, now: Instant) {
        let avail = self.available_window();
        if avail <= 0 {
            return;
        }
        let sendable = self.sendable().saturating_sub(self.tokens.len() as u64);
        let n = (avail as u64).min(sendable);
        for _ in 0..n {
            // Window left over by burst-limited ACKs goes out on the paths of the latest
            // ACKs (known to work), not on random ones: a random path may be a failed
            // one, and a quarter of every burst would vanish into it.
            let path = match self.timers.next_recent_ack_path() {
                Some(p) => p,
                None => self.random_path(),
            };
            self.tokens.push_back(Token {
                path,
                probe: false,
                psn: None,
            });
        }
        self.kickoff(now);
    }

    /// Which PSN a send opportunity goes to, and whether it is a retransmission.
    /// `None`: nothing to send (or a synchronise message must wait).
    pub(super) fn next_psn(&mut self, now: Instant) -> Option<(u32, bool)> {
        let s = self.s;
        if s.in_recovery {
            // Loss recovery: the next packet from snd_retx that was not SACKed.
            let from = seq::max(s.snd_retx, s.snd_una);
            if let Some(psn) = self.first_unsacked(from, self.recovery_limit()) {
                self.s.snd_retx = psn.wrapping_add(1);
                return Some((psn, true));
            }
        }
        if self.new_data_blocked_by_bitmap() {
            return None;
        }
        if seq::lt(s.snd_nxt, self.queue.end_psn()) {
            let p = self.queue.packet(s.snd_nxt, self.config.mss)?;
            if p.synchronise
                && p.ipsn == 0
                && s.snd_una != s.snd_nxt
                && now < self.timers.sync_not_before
            {
                self.timers
                    .set(Timer::Sync, Some(self.timers.sync_not_before));
                return None;
            }
            return Some((s.snd_nxt, false));
        }
        // Tail loss: no new data. Resend, as if new, an unacknowledged packet below the
        // highest SACK (a later packet arrived, so this one is lost or on a slow path).
        let from = seq::max(s.snd_tail, s.snd_una);
        if let Some(psn) = self.first_unsacked(from, self.tail_resend_limit()) {
            self.s.snd_tail = psn.wrapping_add(1);
            return Some((psn, true));
        }
        None
    }

    pub(super) fn transmit_multipath(
        &mut self,
        now: Instant,
        buf: &mut Vec<u8>,
    ) -> Option<Transmit> {
        while let Some(token) = self.tokens.front().copied() {
            let named = token
                .psn
                .filter(|&p| !seq::lt(p, self.s.snd_una) && seq::lt(p, self.s.snd_nxt));
            if named.is_some() || token.psn.is_some() {
                self.tokens.pop_front();
                if let Some(psn) = named {
                    if let Some(t) =
                        self.emit_data(now, token.path, psn, true, PacketKind::Retransmit, buf)
                    {
                        return Some(t);
                    }
                }
                continue;
            }
            let Some((psn, retransmit)) = self.next_psn(now) else {
                if self.timers.get(Timer::Sync).is_some() && self.sendable() > 0 {
                    return None; // keep the opportunities for the synchronise message
                }
                self.tokens.clear();
                return None;
            };
            self.tokens.pop_front();
            let kind = if retransmit {
                PacketKind::Retransmit
            } else if token.probe {
                PacketKind::Probe
            } else {
                PacketKind::Data
            };
            if let Some(t) = self.emit_data(now, token.path, psn, retransmit, kind, buf) {
                return Some(t);
            }
        }
        None
    }
}
