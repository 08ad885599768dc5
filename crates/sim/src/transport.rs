//! The transport seen from the network: what an endpoint on a host must offer the simulator.
//!
//! Owns the [`Transport`] trait (a sans-IO endpoint: datagrams and time in, datagrams,
//! deadlines and events out) and [`FixedWindow`], a deliberately simple transport used to test
//! the network model on its own. The real transport, `fabriq_mpath::Connection`, is adapted to
//! this trait in `mpath_adapter`. The engine (`sim`) holds one `Transport` per connection end.

use crate::clock::Time;

/// What one datagram handed to the network stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxInfo {
    /// Virtual path chosen by the transport (added to the connection's base UDP source port).
    pub path: u16,
    /// Bytes of the datagram as seen by IP (encoded bytes plus virtual payload), without
    /// link-layer framing.
    pub datagram_bytes: u32,
    /// Application payload carried or stood for (0 for acknowledgements).
    pub payload_bytes: u32,
    /// Whether the packet is ECN-capable (ECT): RED marks it instead of ignoring it.
    pub is_ecn_capable: bool,
}

/// Something a transport tells the application.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportEvent {
    /// The receiving end delivered a complete message of `len` bytes (messages are delivered
    /// in the order they were sent).
    Delivered {
        /// Message length in bytes.
        len: u64,
    },
    /// The sending end learned that message `id` was fully acknowledged.
    Acked {
        /// Id returned by [`Transport::send_message`].
        id: u64,
    },
    /// The connection failed (e.g. retransmission timeouts exhausted).
    Failed,
}

/// A snapshot of transport state for traces.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TransportSample {
    /// Congestion window in packets (or the equivalent of a rate, for rate-based control).
    pub cwnd_packets: f64,
    /// Packets retransmitted so far.
    pub retransmits: u64,
    /// Largest out-of-order gap seen by this end as a receiver, in packets.
    pub max_ooo_gap: u64,
}

/// Why a message was not accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendRejected {
    /// Too many messages queued: retry after one is acknowledged.
    Backpressure,
    /// The connection can never accept it (failed, or the message is invalid).
    Fatal,
}

/// A sans-IO transport endpoint driven by the simulator.
pub trait Transport {
    /// Queues a message of `len` bytes for sending; returns its id.
    fn send_message(&mut self, now: Time, len: u64) -> Result<u64, SendRejected>;
    /// Feeds a datagram that arrived on virtual path `path` with CE mark `is_ce`.
    /// Returns false when the transport rejected it as malformed.
    fn handle_datagram(&mut self, now: Time, path: u16, is_ce: bool, bytes: &[u8]) -> bool;
    /// Produces the next datagram to send, if any, encoding it into `out` (empty on entry).
    fn poll_transmit(&mut self, now: Time, out: &mut Vec<u8>) -> Option<TxInfo>;
    /// Lets timers fire; spurious calls are harmless.
    fn handle_timeout(&mut self, now: Time);
    /// When `handle_timeout` should next be called.
    fn poll_timeout(&self) -> Option<Time>;
    /// Next event for the application.
    fn poll_event(&mut self) -> Option<TransportEvent>;
    /// State for traces.
    fn sample(&self) -> TransportSample;
    /// Out-of-order gaps observed by this end as a receiver since the last call, as a
    /// histogram: `hist[g]` += packets that arrived `g` packets ahead of the next expected
    /// one. Transports without this measure leave it untouched.
    fn drain_ooo_histogram(&mut self, _hist: &mut Vec<u64>) {}
    /// Payload bytes of distinct data packets this end accepted as a receiver (duplicates
    /// and packets the receiver had to drop not counted): goodput at packet granularity.
    fn received_payload_bytes(&self) -> u64;
}

const KIND_DATA: u8 = 0;
const KIND_ACK: u8 = 1;
const DATA_HEADER: usize = 1 + 8 + 8 + 8;

/// A fixed-window, per-packet-acknowledged transport that sprays packets round-robin over
/// `num_paths` paths. It has no loss recovery and no congestion control: it exists to test
/// the network model (serialisation, queues, ECMP, PFC) independently of the real transport,
/// on loss-free scenarios.
#[derive(Debug)]
pub struct FixedWindow {
    window: u32,
    mss: u32,
    num_paths: u16,
    next_path: u16,
    in_flight: u32,
    // Sender: messages (id, len) not fully sent, and bytes acknowledged of the oldest.
    send_queue: std::collections::VecDeque<(u64, u64)>,
    sent_of_head: u64,
    unacked: std::collections::VecDeque<(u64, u64)>,
    acked_of_oldest: u64,
    next_id: u64,
    // Receiver.
    received_bytes: u64,
    /// Bytes received and length of each incomplete message, by id.
    partial: std::collections::BTreeMap<u64, (u64, u64)>,
    next_delivery: u64,
    pending_acks: std::collections::VecDeque<u64>,
    events: std::collections::VecDeque<TransportEvent>,
}

impl FixedWindow {
    /// A transport that keeps `window` packets of `mss` payload bytes in flight.
    pub fn new(window: u32, mss: u32, num_paths: u16) -> Self {
        FixedWindow {
            window: window.max(1),
            mss: mss.max(1),
            num_paths: num_paths.max(1),
            next_path: 0,
            in_flight: 0,
            send_queue: Default::default(),
            sent_of_head: 0,
            unacked: Default::default(),
            acked_of_oldest: 0,
            next_id: 0,
            received_bytes: 0,
            partial: Default::default(),
            next_delivery: 0,
            pending_acks: Default::default(),
            events: Default::default(),
        }
    }
}

impl Transport for FixedWindow {
    fn send_message(&mut self, _now: Time, len: u64) -> Result<u64, SendRejected> {
        if len == 0 {
            return Err(SendRejected::Fatal);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.send_queue.push_back((id, len));
        self.unacked.push_back((id, len));
        Ok(id)
    }

    fn handle_datagram(&mut self, _now: Time, _path: u16, _is_ce: bool, bytes: &[u8]) -> bool {
        match bytes.first() {
            Some(&KIND_DATA) if bytes.len() == DATA_HEADER => {
                let mut f = [0u8; 8];
                f.copy_from_slice(&bytes[1..9]);
                let seg = u64::from_le_bytes(f);
                f.copy_from_slice(&bytes[9..17]);
                let msg_len = u64::from_le_bytes(f);
                f.copy_from_slice(&bytes[17..25]);
                let msg_id = u64::from_le_bytes(f);
                self.pending_acks.push_back(seg);
                self.received_bytes += seg;
                if msg_id >= self.next_delivery {
                    let e = self.partial.entry(msg_id).or_insert((0, msg_len));
                    e.0 += seg;
                }
                // Deliver complete messages in order.
                while let Some(&(got, len)) = self.partial.get(&self.next_delivery) {
                    if got < len {
                        break;
                    }
                    self.partial.remove(&self.next_delivery);
                    self.next_delivery += 1;
                    self.events.push_back(TransportEvent::Delivered { len });
                }
                true
            }
            Some(&KIND_ACK) if bytes.len() == DATA_HEADER => {
                let mut f = [0u8; 8];
                f.copy_from_slice(&bytes[1..9]);
                let seg = u64::from_le_bytes(f);
                self.in_flight = self.in_flight.saturating_sub(1);
                self.acked_of_oldest += seg;
                while let Some(&(id, len)) = self.unacked.front() {
                    if self.acked_of_oldest < len {
                        break;
                    }
                    self.acked_of_oldest -= len;
                    self.unacked.pop_front();
                    self.events.push_back(TransportEvent::Acked { id });
                }
                true
            }
            _ => false,
        }
    }

    fn poll_transmit(&mut self, _now: Time, out: &mut Vec<u8>) -> Option<TxInfo> {
        let path = self.next_path;
        if let Some(seg) = self.pending_acks.pop_front() {
            out.push(KIND_ACK);
            out.extend_from_slice(&seg.to_le_bytes());
            out.extend_from_slice(&0u64.to_le_bytes());
            out.extend_from_slice(&0u64.to_le_bytes());
            self.next_path = (self.next_path + 1) % self.num_paths;
            return Some(TxInfo {
                path,
                datagram_bytes: out.len() as u32,
                payload_bytes: 0,
                is_ecn_capable: false,
            });
        }
        if self.in_flight >= self.window {
            return None;
        }
        let &(id, len) = self.send_queue.front()?;
        let seg = (len - self.sent_of_head).min(u64::from(self.mss));
        self.sent_of_head += seg;
        if self.sent_of_head >= len {
            self.send_queue.pop_front();
            self.sent_of_head = 0;
        }
        self.in_flight += 1;
        out.push(KIND_DATA);
        out.extend_from_slice(&seg.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&id.to_le_bytes());
        self.next_path = (self.next_path + 1) % self.num_paths;
        Some(TxInfo {
            path,
            datagram_bytes: (out.len() as u64 + seg) as u32,
            payload_bytes: seg as u32,
            is_ecn_capable: false,
        })
    }

    fn handle_timeout(&mut self, _now: Time) {}

    fn poll_timeout(&self) -> Option<Time> {
        None
    }

    fn poll_event(&mut self) -> Option<TransportEvent> {
        self.events.pop_front()
    }

    fn received_payload_bytes(&self) -> u64 {
        self.received_bytes
    }

    fn sample(&self) -> TransportSample {
        TransportSample {
            cwnd_packets: f64::from(self.window),
            retransmits: 0,
            max_ooo_gap: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_window_moves_a_message_between_two_ends() {
        let mut a = FixedWindow::new(4, 1000, 2);
        let mut b = FixedWindow::new(4, 1000, 2);
        let id = a.send_message(Time(0), 2_500).unwrap();
        let mut buf = Vec::new();
        let mut sent = Vec::new();
        while let Some(tx) = a.poll_transmit(Time(0), &mut buf) {
            sent.push((tx, std::mem::take(&mut buf)));
        }
        assert_eq!(sent.len(), 3, "2500 bytes in 1000-byte segments");
        assert_eq!(sent[0].0.path, 0);
        assert_eq!(sent[1].0.path, 1);
        for (tx, bytes) in &sent {
            assert!(b.handle_datagram(Time(1), tx.path, false, bytes));
        }
        assert_eq!(
            b.poll_event(),
            Some(TransportEvent::Delivered { len: 2_500 })
        );
        while let Some(tx) = b.poll_transmit(Time(1), &mut buf) {
            assert_eq!(tx.payload_bytes, 0);
            assert!(a.handle_datagram(Time(2), tx.path, false, &buf));
            buf.clear();
        }
        assert_eq!(a.poll_event(), Some(TransportEvent::Acked { id }));
        assert!(!a.handle_datagram(Time(2), 0, false, &[9, 9]));
    }

    #[test]
    fn fixed_window_respects_its_window() {
        let mut a = FixedWindow::new(2, 100, 1);
        a.send_message(Time(0), 10_000).unwrap();
        let mut buf = Vec::new();
        assert!(a.poll_transmit(Time(0), &mut buf).is_some());
        buf.clear();
        assert!(a.poll_transmit(Time(0), &mut buf).is_some());
        buf.clear();
        assert!(a.poll_transmit(Time(0), &mut buf).is_none());
    }
}
