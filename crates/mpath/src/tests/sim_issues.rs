//! Regressions found by the datacenter simulator, reproduced on the `Pair` harness:
//! a failed path, a bandwidth-delay product above the receiver bitmap, and a sender
//! whose own NIC is the bottleneck.

use std::time::Duration;

use super::pair::Pair;
use crate::frame::{self, Frame};
use crate::{Config, Connection, Instant, PathId, Payload};

fn base_config(seed: u64) -> Config {
    Config {
        seed,
        min_rto: Duration::from_micros(500),
        max_rto_count: 30,
        trace_cwnd: true,
        ..Config::default()
    }
}

/// Serialisation time of `packets` full packets at `bps`.
fn ideal(packets: u64, bps: f64) -> Duration {
    Duration::from_secs_f64(packets as f64 * 1052.0 * 8.0 / bps)
}

#[test]
fn traffic_leaves_a_blackholed_path_and_losses_are_recovered_once() {
    // A quarter of the virtual paths is a black hole (a failed link that routing has
    // not yet removed). ACK clocking stops using those paths, so after the first
    // window only probes reach them: the transfer runs at nearly the full rate and
    // resends little more than what was lost.
    let mut p = Pair::new(base_config(7));
    p.network(|n| {
        n.rate_bps = Some(10e9);
        n.latency = Duration::from_micros(5);
        n.ecn_threshold_bytes = Some(30_000);
    });
    p.ab.drop_if = Some(Box::new(|s| {
        s.transmit.kind.is_data() && s.transmit.path.0 % 4 == 3
    }));
    let packets = 20_000u64;
    p.a.send(p.now, Payload::Virtual(packets * 1024), false)
        .unwrap();
    assert!(p.run_until(Duration::from_secs(10), |p| p.a_acked() == 1));
    let t = p.now - Instant::ZERO;
    let st = p.a.stats();
    assert!(
        t < ideal(packets, 10e9).mul_f64(1.15),
        "{t:?} vs ideal {:?}",
        ideal(packets, 10e9)
    );
    assert!(
        st.retransmits < packets / 50,
        "{} retransmissions, {} packets dropped",
        st.retransmits,
        p.net.dropped
    );
    assert!(
        p.b.stats().duplicates_received < packets / 200,
        "{} duplicates",
        p.b.stats().duplicates_received
    );
}

/// 20 000 packets at 40 Gb/s and a 16 µs RTT (about 76 packets in flight, more than the
/// paper's L = 64) with 0.5% loss, receive bitmap `bitmap_len`: the pair when the transfer is
/// acknowledged, and the packets sent.
fn long_rtt_lossy_transfer(bitmap_len: u32) -> (Pair, u64) {
    let mut p = Pair::new(Config {
        bitmap_len,
        ..base_config(11)
    });
    p.network(|n| {
        n.rate_bps = Some(40e9);
        n.latency = Duration::from_micros(8);
        n.ecn_threshold_bytes = Some(60_000);
    });
    p.ab.loss = 0.005;
    let packets = 20_000u64;
    p.a.send(p.now, Payload::Virtual(packets * 1024), false)
        .unwrap();
    assert!(p.run_until(Duration::from_secs(10), |p| p.a_acked() == 1));
    (p, packets)
}

#[test]
fn a_bitmap_larger_than_the_bdp_keeps_loss_recovery_cheap() {
    // A loss pins the receiver's bitmap at the hole for a round trip; with L = 256 what is
    // sent meanwhile still fits, so nothing is dropped beyond the bitmap and each loss
    // costs one retransmission, not a stall (docs/MPRDMA.md, Known core issues 3).
    let (p, packets) = long_rtt_lossy_transfer(256);
    let t = p.now - Instant::ZERO;
    assert!(p.net.dropped > 50, "only {} losses", p.net.dropped);
    assert_eq!(p.b.stats().ooo_drops, 0, "bitmap overflow drops");
    assert!(
        p.b.stats().max_ooo_gap > 64,
        "the run never needed more than the paper's bitmap: {}",
        p.b.stats().max_ooo_gap
    );
    assert_eq!(p.a.stats().timeouts, 0);
    assert!(
        p.a.stats().retransmits < 2 * p.net.dropped + 10,
        "{} retransmissions for {} losses",
        p.a.stats().retransmits,
        p.net.dropped
    );
    assert!(
        t < ideal(packets, 40e9).mul_f64(1.15),
        "{t:?} vs ideal {:?}",
        ideal(packets, 40e9)
    );
}

#[test]
fn with_the_papers_bitmap_below_the_bdp_losses_overflow_it() {
    // The same run with L = 64: the bitmap drops the larger bitmap removes (the reason the
    // udp provider defaults to L = 256).
    let (p, _) = long_rtt_lossy_transfer(64);
    assert!(p.b.stats().ooo_drops > 0);
}

#[test]
fn cwnd_does_not_grow_while_the_senders_nic_limits_it() {
    // The sender's NIC is the bottleneck: it takes one packet per `gap` and nothing
    // queues in the network, so no ACK is marked. The window is never filled, so it
    // must not grow (TCP/QUIC's congestion-window-limited rule).
    let config = base_config(3);
    let mut a = Connection::new(config.clone(), Instant::ZERO);
    let mut b = Connection::new(config, Instant::ZERO);
    let latency = Duration::from_micros(2); // one way; RTT ≈ 4 µs ≈ 20 packets
    let gap = Duration::from_nanos(210); // 40 Gb/s for a 1052-byte packet
    let mut now = Instant::ZERO;
    a.send(now, Payload::Virtual(30_000 * 1024), false).unwrap();
    // (arrival, to_b, path, bytes)
    let mut wire: Vec<(Instant, bool, PathId, Vec<u8>)> = Vec::new();
    let mut buf = Vec::new();
    let mut nic_free = Instant::ZERO;
    let end = Instant::ZERO + Duration::from_millis(5);
    let mut max_cwnd: f64 = 0.0;
    while now < end {
        // A's NIC takes one packet when it is free; B replies at once.
        if now >= nic_free {
            if let Some(t) = a.poll_transmit(now, &mut buf) {
                wire.push((now + latency, true, t.path, buf.clone()));
                nic_free = now + gap;
            }
        }
        while let Some(t) = b.poll_transmit(now, &mut buf) {
            wire.push((now + latency, false, t.path, buf.clone()));
        }
        let next_wire = wire.iter().map(|w| w.0).min();
        let mut next = [
            Some(nic_free),
            next_wire,
            a.poll_timeout(),
            b.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .filter(|&t| t > now)
        .min()
        .unwrap_or(end);
        if next_wire.is_some_and(|t| t <= now) {
            next = now;
        }
        now = next;
        let (due, rest): (Vec<_>, Vec<_>) = wire.drain(..).partition(|w| w.0 <= now);
        wire = rest;
        for (_, to_b, path, bytes) in due {
            let conn = if to_b { &mut b } else { &mut a };
            assert!(matches!(
                frame::decode(&bytes),
                Ok(Frame::Data(..) | Frame::Ack(..) | Frame::Nack(..))
            ));
            conn.handle_datagram(now, path, false, &bytes).unwrap();
        }
        a.handle_timeout(now);
        b.handle_timeout(now);
        max_cwnd = max_cwnd.max(a.cwnd());
    }
    assert!(a.stats().data_packets_sent > 20_000, "the NIC stayed busy");
    assert_eq!(a.stats().retransmits, 0);
    assert!(
        max_cwnd < 80.0,
        "cwnd grew to {max_cwnd} with about 20 packets in flight"
    );
}
