//! Connection statistics: counters, the current congestion state and an optional cwnd
//! trace.
//!
//! Owns nothing the protocol reads back: the connection writes these as it goes, the
//! driver (simulator, `fabriq stat`) reads them. Counters only grow.

use std::time::Duration;

use crate::Instant;

/// Bytes of per-connection protocol state, by part. Buffers of payload and the queues
/// of pending packets and events are not counted (the paper's accounting).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProtocolStateSize {
    /// Sender: `snd_una`, `snd_nxt`, `snd_max`, `snd_ooh`, `recovery`, `snd_retx`,
    /// `snd_tail`, `inflate`, retransmissions in flight, `cwnd`, RTT estimator, flags.
    pub sender: usize,
    /// Receiver: `rcv_nxt`, last NACKed PSN, message counter, the 2×L-bit bitmap.
    pub receiver: usize,
    /// The single-path baseline's DCQCN rate state (0 in multi-path mode).
    pub rate_control: usize,
    /// Timer deadlines (timers are data: one optional instant per timer kind).
    pub timers: usize,
}

impl ProtocolStateSize {
    /// Sender + receiver + rate control: the protocol state excluding timers.
    pub fn protocol(&self) -> usize {
        self.sender + self.receiver + self.rate_control
    }
}

/// Counters and current state of one connection.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    /// Current congestion window in packets (multi-path mode).
    pub cwnd: f64,
    /// Current sending rate in bits/s (single-path mode; 0 in multi-path mode).
    pub rate_bps: f64,
    /// Smoothed round-trip time.
    pub srtt: Duration,
    /// Current retransmission timeout (before backoff).
    pub rto: Duration,
    /// Datagrams handed to the driver (data, ACK, NACK).
    pub packets_sent: u64,
    /// Bytes on the wire handed to the driver, counting virtual payload.
    pub bytes_sent: u64,
    /// Data packets sent, first transmissions and retransmissions.
    pub data_packets_sent: u64,
    /// Payload bytes sent in first transmissions (virtual bytes counted).
    pub payload_bytes_sent: u64,
    /// Data packets sent again (recovery, tail resend, RTO, go-back-N).
    pub retransmits: u64,
    /// Data packets sent on a new random path as a probe.
    pub probes: u64,
    /// ACKs sent.
    pub acks_sent: u64,
    /// ACKs received.
    pub acks_received: u64,
    /// NACKs sent.
    pub nacks_sent: u64,
    /// NACKs received.
    pub nacks_received: u64,
    /// ACKs received with the ECN echo set.
    pub ecn_echoes: u64,
    /// ACKs from slow paths (SACK below `snd_ooh - Δ`): cwnd − 1, path not reused.
    pub slow_path_prunes: u64,
    /// ACKs that could send but found no data: cwnd − 1.
    pub unused_send_opportunities: u64,
    /// Window restarts from the initial window after an idle period.
    pub idle_restarts: u64,
    /// Entries into loss recovery (NACK or timeout).
    pub recoveries: u64,
    /// Resends of a hole at `snd_una` whose first resend was lost as well.
    pub repeated_resends: u64,
    /// Retransmission timeouts.
    pub timeouts: u64,
    /// Rate cuts of the single-path baseline.
    pub rate_cuts: u64,
    /// Go-back-N rewinds of the single-path baseline.
    pub go_back_n: u64,
    /// Data packets dropped for arriving beyond the receiver bitmap.
    pub ooo_drops: u64,
    /// Synchronise packets dropped for arriving before earlier messages completed.
    pub sync_early_drops: u64,
    /// Data packets received again.
    pub duplicates_received: u64,
    /// Largest `psn - rcv_nxt` of an arriving data packet (out-of-order degree).
    pub max_ooo_gap: u32,
    /// Messages queued by `send`.
    pub messages_sent: u64,
    /// Messages acknowledged.
    pub messages_acked: u64,
    /// Messages delivered.
    pub messages_received: u64,
    /// Payload bytes delivered (virtual bytes counted).
    pub payload_bytes_received: u64,
    /// Per-connection protocol state size.
    pub state_size: ProtocolStateSize,
    /// `(time, cwnd)` at every window change, when `Config::trace_cwnd` is on.
    pub cwnd_trace: Vec<(Instant, f64)>,
}
