//! Adapter from `fabriq_mpath::Connection` (the unchanged MP-RDMA core) to the simulator's
//! [`Transport`] trait.
//!
//! Owns the translation only: simulated [`Time`] ↔ `fabriq_mpath::Instant` (both nanoseconds
//! from zero), messages as virtual payload (`Payload::Virtual`, so packets carry headers and
//! only stand for their payload), events, and a passive observer of arriving data packets
//! that records the out-of-order gap distribution (the core itself keeps only the maximum).
//! No protocol decision is taken here.

use fabriq_mpath::frame::{self, Frame};
use fabriq_mpath::{Config, Connection, Event, Instant, Mode, PathId, Payload, SendError};

use crate::clock::Time;
use crate::scenario::{PathMode, TransportConfig};
use crate::transport::{SendRejected, Transport, TransportEvent, TransportSample, TxInfo};

/// Out-of-order gaps above this are counted in the last histogram bucket.
pub const OOO_HISTOGRAM_CAP: usize = 4096;

/// Mirrors the receiver's next expected PSN (`rcv_nxt`) from the data packets it accepts, to
/// measure each arrival's out-of-order gap `psn - rcv_nxt` exactly as the core defines it.
#[derive(Debug, Clone)]
struct OooObserver {
    expected: u32,
    /// Entry i: PSN `expected + i` received (i < window ≤ `MAX_BITMAP_LEN`).
    received: std::collections::VecDeque<bool>,
    window: u32,
    histogram: Vec<u64>,
    /// Payload bytes of accepted (new, within-bitmap) data packets.
    accepted_bytes: u64,
}

impl OooObserver {
    fn new(window: u32) -> Self {
        let window = window.clamp(1, fabriq_mpath::MAX_BITMAP_LEN);
        OooObserver {
            expected: 0,
            received: std::iter::repeat(false).take(window as usize).collect(),
            window,
            histogram: Vec::new(),
            accepted_bytes: 0,
        }
    }

    fn on_data(&mut self, psn: u32, payload_len: u16) {
        let off = psn.wrapping_sub(self.expected) as i32;
        if off < 0 {
            return; // duplicate of something already delivered in order
        }
        let off = off as u32;
        let bucket = (off as usize).min(OOO_HISTOGRAM_CAP);
        if self.histogram.len() <= bucket {
            self.histogram.resize(bucket + 1, 0);
        }
        if off >= self.window {
            // The core drops it (beyond its bitmap): count the arrival, keep no state.
            self.histogram[bucket] += 1;
            return;
        }
        let Some(seen) = self.received.get_mut(off as usize) else {
            return;
        };
        if *seen {
            return; // duplicate
        }
        *seen = true;
        self.histogram[bucket] += 1;
        self.accepted_bytes += u64::from(payload_len);
        while self.received.front() == Some(&true) {
            self.received.pop_front();
            self.received.push_back(false);
            self.expected = self.expected.wrapping_add(1);
        }
    }
}

/// A `fabriq_mpath::Connection` as a simulator transport.
pub struct MpathTransport {
    conn: Connection,
    observer: OooObserver,
    mss: u16,
    is_multipath: bool,
}

/// Builds the core's configuration for one endpoint from the scenario's transport section.
pub fn mpath_config(t: &TransportConfig, host_link_gbps: f64, seed: u64) -> Config {
    let mut c = Config {
        mode: match t.mode {
            PathMode::MultiPath => Mode::MultiPath,
            PathMode::SinglePath => Mode::SinglePath,
        },
        seed,
        ..Config::default()
    };
    if let Some(v) = t.num_paths {
        c.num_paths = v;
    }
    if let Some(v) = t.mss {
        c.mss = v;
    }
    if let Some(v) = t.initial_window {
        c.initial_window = v;
    }
    if let Some(v) = t.delta {
        c.delta = v;
    }
    if let Some(v) = t.bitmap_len {
        c.bitmap_len = v;
    }
    if let Some(v) = t.probe_probability {
        c.probe_probability = v;
    }
    if let Some(v) = t.burst_per_ack {
        c.burst_per_ack = v;
    }
    if let Some(v) = t.min_rto_us {
        c.min_rto = std::time::Duration::from_micros(v);
    }
    if let Some(v) = t.max_window {
        c.max_window = v;
    }
    c.dcqcn.line_rate_bps = t.line_rate_gbps.unwrap_or(host_link_gbps) * 1e9;
    c.dcqcn.min_rate_bps = c.dcqcn.min_rate_bps.min(c.dcqcn.line_rate_bps);
    if c.single_path >= c.num_paths {
        c.single_path = 0;
    }
    c
}

impl MpathTransport {
    /// Wraps a new connection built from `config` at simulated time zero.
    pub fn new(config: Config) -> Self {
        let config = config.sanitized();
        let observer = OooObserver::new(config.bitmap_len);
        let mss = config.mss;
        let is_multipath = config.mode == Mode::MultiPath;
        MpathTransport {
            conn: Connection::new(config, Instant::ZERO),
            observer,
            mss,
            is_multipath,
        }
    }

    /// The wrapped connection.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }
}

fn instant(t: Time) -> Instant {
    Instant::from_nanos(t.as_nanos())
}

impl Transport for MpathTransport {
    fn send_message(&mut self, now: Time, len: u64) -> Result<u64, SendRejected> {
        match self.conn.send(instant(now), Payload::Virtual(len), false) {
            Ok(id) => Ok(id.0),
            Err(SendError::QueueFull) => Err(SendRejected::Backpressure),
            Err(_) => Err(SendRejected::Fatal),
        }
    }

    fn handle_datagram(&mut self, now: Time, path: u16, is_ce: bool, bytes: &[u8]) -> bool {
        if let Ok(Frame::Data(h, _)) = frame::decode(bytes) {
            self.observer.on_data(h.psn, h.payload_len);
        }
        self.conn
            .handle_datagram(instant(now), PathId(path), is_ce, bytes)
            .is_ok()
    }

    fn poll_transmit(&mut self, now: Time, out: &mut Vec<u8>) -> Option<TxInfo> {
        let t = self.conn.poll_transmit(instant(now), out)?;
        Some(TxInfo {
            path: t.path.0,
            datagram_bytes: u32::try_from(t.wire_len()).unwrap_or(u32::MAX),
            payload_bytes: if t.kind.is_data() { t.virtual_len } else { 0 },
            is_ecn_capable: t.ecn_capable,
        })
    }

    fn handle_timeout(&mut self, now: Time) {
        self.conn.handle_timeout(instant(now));
    }

    fn poll_timeout(&self) -> Option<Time> {
        self.conn.poll_timeout().map(|i| Time(i.as_nanos()))
    }

    fn poll_event(&mut self) -> Option<TransportEvent> {
        Some(match self.conn.poll_event()? {
            Event::MessageReceived { payload, .. } => {
                TransportEvent::Delivered { len: payload.len() }
            }
            Event::MessageAcked(id) => TransportEvent::Acked { id: id.0 },
            Event::Failed(_) => TransportEvent::Failed,
        })
    }

    fn sample(&self) -> TransportSample {
        let s = self.conn.stats();
        let cwnd_packets = if self.is_multipath {
            s.cwnd
        } else {
            // Rate-based baseline: the window its rate sustains over one smoothed RTT.
            s.rate_bps * s.srtt.as_secs_f64() / (8.0 * f64::from(self.mss))
        };
        TransportSample {
            cwnd_packets,
            retransmits: s.retransmits,
            max_ooo_gap: u64::from(s.max_ooo_gap),
        }
    }

    fn received_payload_bytes(&self) -> u64 {
        self.observer.accepted_bytes
    }

    fn drain_ooo_histogram(&mut self, hist: &mut Vec<u64>) {
        let h = &mut self.observer.histogram;
        if hist.len() < h.len() {
            hist.resize(h.len(), 0);
        }
        for (acc, c) in hist.iter_mut().zip(h.iter_mut()) {
            *acc += *c;
            *c = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observer_measures_gaps_like_the_receiver() {
        let mut o = OooObserver::new(64);
        for psn in [0, 2, 3, 1, 4, 4, 70, 5] {
            o.on_data(psn, 100);
        }
        // 0 -> gap 0; 2 -> 1; 3 -> 2; 1 -> 0 (then expected = 4); 4 -> 0; 4 again is a
        // duplicate; 70 -> 65 (beyond the bitmap, counted but not kept); 5 -> 0.
        assert_eq!(o.histogram[0], 4);
        assert_eq!(o.histogram[1], 1);
        assert_eq!(o.histogram[2], 1);
        assert_eq!(o.histogram[65], 1);
        assert_eq!(o.expected, 6);
        assert_eq!(
            o.accepted_bytes, 600,
            "six distinct packets within the bitmap"
        );
    }

    #[test]
    fn config_maps_the_scenario_fields() {
        let t = TransportConfig {
            mode: PathMode::SinglePath,
            num_paths: Some(8),
            delta: Some(16),
            ..TransportConfig::default()
        };
        let c = mpath_config(&t, 40.0, 9);
        assert_eq!(c.mode, Mode::SinglePath);
        assert_eq!((c.num_paths, c.delta, c.seed), (8, 16, 9));
        assert_eq!(c.dcqcn.line_rate_bps, 40e9);
        c.validate().unwrap();
    }

    #[test]
    fn two_connections_exchange_a_virtual_message() {
        let mut a = MpathTransport::new(Config {
            seed: 1,
            ..Config::default()
        });
        let mut b = MpathTransport::new(Config {
            seed: 2,
            ..Config::default()
        });
        let id = a.send_message(Time(0), 10_000).unwrap();
        let mut buf = Vec::new();
        let mut now = Time(0);
        let mut got = None;
        let mut acked = false;
        for _ in 0..1_000 {
            now += 1_000;
            while let Some(tx) = a.poll_transmit(now, &mut buf) {
                assert!(b.handle_datagram(now, tx.path, false, &buf));
            }
            while let Some(tx) = b.poll_transmit(now, &mut buf) {
                assert!(a.handle_datagram(now, tx.path, false, &buf));
            }
            while let Some(e) = b.poll_event() {
                got = Some(e);
            }
            while let Some(e) = a.poll_event() {
                acked |= e == TransportEvent::Acked { id };
            }
            if acked {
                break;
            }
        }
        assert_eq!(got, Some(TransportEvent::Delivered { len: 10_000 }));
        assert!(acked);
    }
}
