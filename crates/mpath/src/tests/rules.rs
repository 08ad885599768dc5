//! One test per MP-RDMA rule, driving a single connection with hand-made packets (exact
//! control over every ACK) or a [`Pair`] (end-to-end behaviour).

use std::collections::HashSet;
use std::time::Duration;

use super::pair::{Pair, Side};
use crate::frame::{self, AckHeader, DataHeader, Frame, NackHeader};
use crate::{
    Config, Connection, ConnectionError, Event, Instant, PacketKind, PathId, Payload, Transmit,
};

/// A transmitted datagram and its decoded header.
pub(super) type Sent = (
    Transmit,
    Option<DataHeader>,
    Option<AckHeader>,
    Option<NackHeader>,
);

pub(super) fn cfg() -> Config {
    Config {
        seed: 7,
        ..Config::default()
    }
}

/// Everything `c` wants to send now, decoded.
pub(super) fn drain(c: &mut Connection, now: Instant) -> Vec<Sent> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    while let Some(t) = c.poll_transmit(now, &mut buf) {
        let (d, a, n) = match frame::decode(&buf[..t.len]).unwrap() {
            Frame::Data(h, _) => (Some(h), None, None),
            Frame::Ack(h) => (None, Some(h), None),
            Frame::Nack(h) => (None, None, Some(h)),
        };
        out.push((t, d, a, n));
    }
    out
}

fn data_psns(v: &[Sent]) -> Vec<(u32, PathId, PacketKind)> {
    v.iter()
        .filter_map(|(t, d, _, _)| d.map(|d| (d.psn, t.path, t.kind)))
        .collect()
}

pub(super) fn ack(
    c: &mut Connection,
    now: Instant,
    path: u16,
    sack: u32,
    aack: u32,
    ece: bool,
    retx: bool,
) {
    let mut b = Vec::new();
    frame::encode_ack(
        &AckHeader {
            path: PathId(path),
            sack,
            aack,
            timestamp_echo: 0,
            ece,
            synchronise: false,
            retransmit: retx,
        },
        &mut b,
    );
    c.handle_datagram(now, PathId(path), false, &b).unwrap();
}

fn nack(c: &mut Connection, now: Instant, path: u16, lost: u32, aack: u32) {
    let mut b = Vec::new();
    frame::encode_nack(
        &NackHeader {
            path: PathId(path),
            lost,
            aack,
            timestamp_echo: 0,
            ece: false,
            synchronise: false,
            retransmit: false,
        },
        &mut b,
    );
    c.handle_datagram(now, PathId(path), false, &b).unwrap();
}

fn data(c: &mut Connection, now: Instant, h: DataHeader, payload: &[u8]) {
    let mut b = Vec::new();
    frame::encode_data(&h, payload, &mut b);
    c.handle_datagram(now, h.path, false, &b).unwrap();
}

/// A sender with `packets` packets of virtual payload queued and its first window sent.
fn sender(config: Config, packets: u64) -> (Connection, Vec<(u32, PathId, PacketKind)>) {
    let now = Instant::ZERO;
    let mss = u64::from(config.mss);
    let mut c = Connection::new(config, now);
    c.send(now, Payload::Virtual(packets * mss), false).unwrap();
    let first = data_psns(&drain(&mut c, now));
    (c, first)
}

mod ack_clocking {
    use super::*;

    #[test]
    fn first_window_leaves_on_initial_window_random_paths() {
        let (_, first) = sender(cfg(), 100);
        assert_eq!(first.len(), 16);
        assert_eq!(
            first.iter().map(|p| p.0).collect::<Vec<_>>(),
            (0..16).collect::<Vec<_>>()
        );
        let paths: HashSet<_> = first.iter().map(|p| p.1).collect();
        assert!(
            paths.len() >= 8,
            "first window should spread over random paths: {paths:?}"
        );
        assert!(first.iter().all(|p| p.1 .0 < 64 && p.2 == PacketKind::Data));
    }

    #[test]
    fn packets_beyond_the_window_are_unsent_until_acks_release_them() {
        let (_, first) = sender(cfg(), 10);
        assert_eq!(first.len(), 10);
        let (c, _) = sender(cfg(), 10);
        assert!(!c.has_unsent(), "ten packets fit the first window");
        let (mut c, first) = sender(cfg(), 17);
        assert_eq!(first.len(), 16);
        assert!(c.has_unsent(), "the 17th waits for an ACK");
        ack(&mut c, Instant::ZERO, first[0].1 .0, 0, 1, false, false);
        assert_eq!(data_psns(&drain(&mut c, Instant::ZERO)).len(), 1);
        assert!(!c.has_unsent());
    }

    #[test]
    fn unmarked_ack_grows_cwnd_by_one_over_cwnd() {
        let (mut c, _) = sender(cfg(), 100);
        ack(&mut c, Instant::ZERO, 9, 0, 1, false, false);
        assert!((c.cwnd() - (16.0 + 1.0 / 16.0)).abs() < 1e-12);
    }

    #[test]
    fn marked_ack_shrinks_cwnd_by_half() {
        let (mut c, _) = sender(cfg(), 100);
        ack(&mut c, Instant::ZERO, 9, 0, 1, true, false);
        assert_eq!(c.cwnd(), 15.5);
        assert_eq!(c.stats().ecn_echoes, 1);
    }

    #[test]
    fn ack_releases_packets_on_the_echoed_path() {
        let config = Config {
            probe_probability: 0.0,
            ..cfg()
        };
        let (mut c, _) = sender(config, 100);
        // In-order ACK: one packet leaves the network, cwnd grows by 1/16: one new packet.
        ack(&mut c, Instant::ZERO, 42, 0, 1, false, false);
        let out = data_psns(&drain(&mut c, Instant::ZERO));
        assert_eq!(out, vec![(16, PathId(42), PacketKind::Data)]);
        // 15 more ACKs on path 5: each frees one slot, cwnd stays below 17.
        for psn in 1..16 {
            ack(&mut c, Instant::ZERO, 5, psn, psn + 1, false, false);
        }
        assert!(c.cwnd() < 17.0);
        let out = data_psns(&drain(&mut c, Instant::ZERO));
        assert_eq!(out.len(), 15);
        assert!(out.iter().all(|p| p.1 == PathId(5)));
    }

    #[test]
    fn inflate_counts_sacks_above_snd_una() {
        let config = Config {
            probe_probability: 0.0,
            ..cfg()
        };
        let (mut c, _) = sender(config, 100);
        let now = Instant::ZERO;
        // PSN 0 is late; 3 and 4 arrive: the window inflates, packets keep flowing.
        ack(&mut c, now, 1, 3, 0, false, false);
        assert_eq!(c.sender_state().inflate, 1);
        ack(&mut c, now, 2, 4, 0, false, false);
        assert_eq!(c.sender_state().inflate, 2);
        // A duplicate SACK does not inflate again.
        ack(&mut c, now, 2, 4, 0, false, false);
        assert_eq!(c.sender_state().inflate, 2);
        assert_eq!(data_psns(&drain(&mut c, now)).len(), 2);
        // PSN 0 arrives, AACK jumps to 1: nothing between, inflate unchanged (-0 +1 -1).
        ack(&mut c, now, 3, 0, 1, false, false);
        assert_eq!(c.sender_state().inflate, 2);
        // 1 and 2 arrive: AACK jumps over the SACKed 3 and 4 to 5: inflate drops by the jump.
        ack(&mut c, now, 3, 1, 2, false, false);
        ack(&mut c, now, 3, 2, 5, false, false);
        assert_eq!(c.sender_state().inflate, 0);
        assert_eq!(c.sender_state().snd_una, 5);
    }

    #[test]
    fn burst_is_limited_per_ack_and_the_rest_leaves_on_the_burst_timer() {
        let config = Config {
            probe_probability: 0.0,
            ..cfg()
        };
        let (mut c, _) = sender(config, 200);
        let now = Instant::ZERO;
        c.set_cwnd_for_test(30.0);
        ack(&mut c, now, 7, 0, 1, false, false);
        // awnd = 30 + 1/30 - 15 = 15: two leave on path 7, the rest waits.
        let out = data_psns(&drain(&mut c, now));
        assert_eq!(
            out,
            vec![
                (16, PathId(7), PacketKind::Data),
                (17, PathId(7), PacketKind::Data)
            ]
        );
        let at = c.timer_deadline_burst().expect("burst timer armed");
        assert_eq!(at, now + c.srtt() / 2);
        c.handle_timeout(at);
        let out = data_psns(&drain(&mut c, at));
        assert_eq!(out.len(), 13);
        // They go on the paths of the latest ACKs (known to work): here only path 7.
        assert!(
            out.iter().all(|p| p.1 == PathId(7)),
            "burst-timer packets go on recently ACKed paths: {out:?}"
        );
    }

    #[test]
    fn unused_send_opportunity_shrinks_cwnd() {
        let (mut c, first) = sender(cfg(), 4);
        assert_eq!(first.len(), 4);
        let now = Instant::ZERO;
        // Four packets in a window of 16: the window is not used, so unmarked ACKs do
        // not grow it (congestion-window-limited rule) and each unused opportunity
        // shrinks it by one.
        let mut expect = 16.0;
        for psn in 0..4 {
            ack(&mut c, now, 1, psn, psn + 1, false, false);
            expect -= 1.0;
        }
        assert!((c.cwnd() - expect).abs() < 1e-9, "{} vs {expect}", c.cwnd());
        assert_eq!(c.stats().unused_send_opportunities, 4);
        assert!(drain(&mut c, now).is_empty());
    }

    #[test]
    fn window_restarts_from_initial_window_after_idle() {
        let mut p = Pair::new(cfg());
        p.a.send(p.now, Payload::Virtual(64 * 1024), false).unwrap();
        p.run(Duration::from_millis(10));
        assert_eq!(p.a_acked(), 1);
        let shrunk = p.a.cwnd();
        assert!(
            shrunk < 16.0,
            "use-it-or-lose-it shrank the window at the tail: {shrunk}"
        );
        // Soon after: no restart, the small window stays.
        p.a.send(p.now, Payload::Virtual(64 * 1024), false).unwrap();
        assert_eq!(p.a.stats().idle_restarts, 0);
        p.run(Duration::from_millis(10));
        // After more than 3 RTTs of silence the next message starts from IW.
        p.now += p.a.srtt() * 4;
        let before = p.log.len();
        p.a.send(p.now, Payload::Virtual(64 * 1024), false).unwrap();
        assert_eq!(p.a.stats().idle_restarts, 1);
        assert_eq!(p.a.cwnd(), 16.0);
        p.drive();
        let burst = p.log[before..]
            .iter()
            .filter(|(t, s, x)| *t == p.log[before].0 && *s == Side::A && x.kind.is_data())
            .count();
        assert_eq!(burst, 16);
    }
}

mod path_selection {
    use super::*;

    #[test]
    fn ack_from_slow_path_is_pruned() {
        let config = Config {
            probe_probability: 0.0,
            initial_window: 48,
            ..cfg()
        };
        let (mut c, first) = sender(config, 200);
        assert_eq!(first.len(), 48);
        let now = Instant::ZERO;
        ack(&mut c, now, 3, 40, 0, false, false); // snd_ooh = 40, snd_ool = 8
        assert_eq!(data_psns(&drain(&mut c, now)).len(), 1);
        let cwnd = c.cwnd();
        ack(&mut c, now, 9, 5, 0, false, false); // 5 < 8: slow path
        assert_eq!(c.stats().slow_path_prunes, 1);
        assert!((c.cwnd() - (cwnd + 1.0 / cwnd - 1.0)).abs() < 1e-9);
        assert!(
            drain(&mut c, now).is_empty(),
            "nothing may leave on a slow path"
        );
        // Just inside Δ is not slow.
        ack(&mut c, now, 9, 8, 0, false, false);
        assert_eq!(c.stats().slow_path_prunes, 1);
    }

    #[test]
    fn ack_of_a_retransmission_is_not_pruned() {
        let config = Config {
            probe_probability: 0.0,
            initial_window: 48,
            ..cfg()
        };
        let (mut c, _) = sender(config, 200);
        let now = Instant::ZERO;
        ack(&mut c, now, 3, 40, 0, false, false);
        ack(&mut c, now, 9, 5, 0, false, true);
        assert_eq!(c.stats().slow_path_prunes, 0);
    }

    #[test]
    fn slow_path_loses_traffic_over_time() {
        // Path 0..64; paths below 8 are 50 µs slower than the rest.
        let mut p = Pair::new(Config {
            seed: 3,
            ..Config::default()
        });
        p.ab.path_latency = Some(Box::new(|path| {
            if path.0 < 8 {
                Duration::from_micros(50)
            } else {
                Duration::ZERO
            }
        }));
        p.a.send(p.now, Payload::Virtual(4000 * 1024), false)
            .unwrap();
        p.run(Duration::from_secs(1));
        assert_eq!(p.a_acked(), 1);
        assert!(p.a.stats().slow_path_prunes > 0);
        let on_slow = |from: usize, to: usize| {
            let window = &p.log[from..to];
            let data: Vec<_> = window
                .iter()
                .filter(|(_, s, t)| *s == Side::A && t.kind.is_data())
                .collect();
            data.iter().filter(|(_, _, t)| t.path.0 < 8).count() as f64 / data.len().max(1) as f64
        };
        let n = p.log.len();
        let late = on_slow(n / 2, n);
        assert!(
            late < 0.5 * 8.0 / 64.0,
            "slow paths should carry well under their share: {late}"
        );
    }

    #[test]
    fn dead_paths_are_abandoned() {
        // A quarter of the virtual paths black-hole data; ACK clocking stops using them.
        let mut p = Pair::new(Config {
            seed: 21,
            ..Config::default()
        });
        p.network(|n| n.rate_bps = Some(25e9));
        p.ab.drop_if = Some(Box::new(|s| {
            s.from == Side::A && s.transmit.kind.is_data() && s.transmit.path.0 < 16
        }));
        p.a.send(p.now, Payload::Virtual(3000 * 1024), false)
            .unwrap();
        p.run(Duration::from_secs(10));
        assert_eq!(p.b_received(), vec![(0, 3000 * 1024)]);
        assert!(p.a.error().is_none());
        let data: Vec<_> = p
            .log
            .iter()
            .filter(|(_, s, t)| *s == Side::A && t.kind.is_data())
            .collect();
        let late = &data[data.len() / 2..];
        let dead = late.iter().filter(|(_, _, t)| t.path.0 < 16).count() as f64 / late.len() as f64;
        // Fair share 0.25; what remains comes from the random paths of the burst timer
        // and of probes, which keep sampling every path.
        assert!(dead < 0.1, "dead paths still carry {dead} of the traffic");
    }

    #[test]
    fn probes_follow_the_probability() {
        let config = Config {
            probe_probability: 0.1,
            seed: 11,
            ..Config::default()
        };
        let mut p = Pair::new(config.clone());
        p.a.send(p.now, Payload::Virtual(5000 * 1024), false)
            .unwrap();
        p.run(Duration::from_secs(1));
        assert_eq!(p.a_acked(), 1);
        let probes = p.a_sent(PacketKind::Probe) as f64;
        let clocked = (p.a_sent(PacketKind::Data) as f64) + probes;
        let rate = probes / clocked;
        assert!((0.08..0.12).contains(&rate), "probe rate {rate}");
        assert_eq!(p.a.stats().probes as f64, probes);
        let mut q = Pair::new(Config {
            probe_probability: 0.0,
            ..config
        });
        q.a.send(q.now, Payload::Virtual(500 * 1024), false)
            .unwrap();
        q.run(Duration::from_secs(1));
        assert_eq!(q.a_sent(PacketKind::Probe), 0);
    }
}

mod loss_recovery {
    use super::*;

    #[test]
    fn receiver_nacks_rcv_nxt_when_the_bitmap_overflows() {
        let now = Instant::ZERO;
        let mut b = Connection::new(cfg(), now);
        for psn in 1..=64u32 {
            data(
                &mut b,
                now,
                DataHeader {
                    path: PathId(2),
                    psn,
                    msn: 0,
                    ipsn: psn,
                    payload_len: 0,
                    is_virtual: true,
                    ..DataHeader::default()
                },
                &[],
            );
        }
        let out = drain(&mut b, now);
        assert_eq!(out.len(), 64);
        assert!(out[..63]
            .iter()
            .all(|(t, _, a, _)| t.kind == PacketKind::Ack && a.is_some_and(|a| a.aack == 0)));
        let (t, _, _, n) = &out[63];
        assert_eq!(t.kind, PacketKind::Nack);
        assert_eq!(n.unwrap().lost, 0);
        assert_eq!(b.stats().ooo_drops, 1);
        assert_eq!(b.receiver_state().rcv_nxt, 0);
        assert_eq!(b.stats().max_ooo_gap, 64);
    }

    #[test]
    fn nack_starts_recovery_and_acks_release_retransmissions() {
        let config = Config {
            probe_probability: 0.0,
            initial_window: 40,
            ..cfg()
        };
        let (mut c, _) = sender(config, 200);
        let now = Instant::ZERO;
        // 1..=9 arrived, 0 lost; 10..=39 in flight.
        for psn in 1..10 {
            ack(&mut c, now, 4, psn, 0, false, false);
        }
        let _ = drain(&mut c, now);
        nack(&mut c, now, 6, 0, 0);
        let s = *c.sender_state();
        assert!(s.in_recovery);
        assert_eq!(c.stats().recoveries, 1);
        // The lost packet goes out at once, on the NACK's path.
        assert_eq!(
            data_psns(&drain(&mut c, now)),
            vec![(0, PathId(6), PacketKind::Retransmit)]
        );
        // A second NACK for the same PSN within an RTT does not resend it again.
        nack(&mut c, now, 6, 0, 0);
        assert!(drain(&mut c, now).is_empty());
        // ACKs release retransmissions of holes more than Δ below the highest SACK
        // before new data; SACKed packets are skipped.
        c.set_cwnd_for_test(80.0);
        ack(&mut c, now, 8, 45, 0, false, false); // snd_ooh = 45: 10..=13 are holes
        let out = data_psns(&drain(&mut c, now));
        assert_eq!(
            &out[..2],
            &[
                (10, PathId(8), PacketKind::Retransmit),
                (11, PathId(8), PacketKind::Retransmit)
            ]
        );
        // The rest of the window leaves on the burst timer: the remaining holes 12 and
        // 13, then new data; 14.. are within Δ of snd_ooh and may still be in flight.
        let at = c.timer_deadline_burst().unwrap();
        c.handle_timeout(at);
        let out = data_psns(&drain(&mut c, at));
        assert_eq!(
            out.iter()
                .filter(|p| p.2 == PacketKind::Retransmit)
                .map(|p| p.0)
                .collect::<Vec<_>>(),
            vec![12, 13]
        );
        assert!(
            out.len() > 2
                && out[2..]
                    .iter()
                    .all(|p| p.2 == PacketKind::Data && p.0 >= 40),
            "{out:?}"
        );
        // The retransmitted 0 arrives: snd_una passes the holes filled so far.
        ack(&mut c, now, 6, 0, 10, false, true);
        assert_eq!(c.sender_state().snd_una, 10);
        assert!(
            c.sender_state().in_recovery,
            "recovery lasts until snd_una reaches the recovery point"
        );
        let recovery = c.sender_state().recovery;
        ack(&mut c, now, 6, 10, recovery, false, true);
        assert!(!c.sender_state().in_recovery);
    }

    #[test]
    fn random_loss_is_recovered_without_timeouts() {
        let mut p = Pair::new(Config {
            seed: 5,
            ..Config::default()
        });
        // 10 Gb/s bottleneck (0.8 µs per packet) and 2 µs of jitter: mild reordering.
        p.network(|n| n.rate_bps = Some(10e9));
        p.ab.jitter = Duration::from_micros(2);
        // Drop the first transmission of PSN 100 only.
        let mut dropped = false;
        p.ab.drop_if = Some(Box::new(move |s| match s.frame {
            Frame::Data(h, _) if h.psn == 100 && !dropped => {
                dropped = true;
                true
            }
            _ => false,
        }));
        p.a.send(p.now, Payload::Virtual(2000 * 1024), false)
            .unwrap();
        p.run(Duration::from_secs(1));
        assert_eq!(p.b_received(), vec![(0, 2000 * 1024)]);
        let st = p.a.stats();
        assert_eq!(st.timeouts, 0);
        assert!(st.recoveries >= 1 || st.retransmits >= 1);
        // The hole, plus what the receiver dropped beyond its bitmap while the hole was
        // open; reordering within Δ causes no spurious resends.
        let dropped_beyond_bitmap = p.b.stats().ooo_drops;
        assert!(
            st.retransmits <= 1 + dropped_beyond_bitmap + 2,
            "{} resends, {} bitmap drops",
            st.retransmits,
            dropped_beyond_bitmap
        );
        assert_eq!(p.b.stats().duplicates_received, 0);
    }

    #[test]
    fn tail_loss_is_resent_before_the_timeout() {
        let config = Config {
            probe_probability: 0.0,
            ..cfg()
        };
        let mut p = Pair::new(config);
        let mut dropped = false;
        p.ab.drop_if = Some(Box::new(move |s| match s.frame {
            Frame::Data(h, _) if h.psn == 10 && !dropped => {
                dropped = true;
                true
            }
            _ => false,
        }));
        p.a.send(p.now, Payload::Virtual(14 * 1024), false).unwrap();
        let done = p.run_until(Duration::from_millis(100), |p| p.a_acked() == 1);
        assert!(done);
        assert!(
            p.now < Instant::ZERO + Duration::from_micros(100),
            "resent within a few RTTs: {:?}",
            p.now
        );
        assert_eq!(p.a.stats().timeouts, 0);
        assert_eq!(p.a.stats().retransmits, 1);
    }

    #[test]
    fn last_packet_loss_is_recovered_by_rto_with_backoff() {
        let config = Config {
            probe_probability: 0.0,
            ..cfg()
        };
        let mut p = Pair::new(config);
        // Lose PSN 13 (the last) three times.
        let mut drops = 0;
        p.ab.drop_if = Some(Box::new(move |s| match s.frame {
            Frame::Data(h, _) if h.psn == 13 && drops < 3 => {
                drops += 1;
                true
            }
            _ => false,
        }));
        p.a.send(p.now, Payload::Virtual(14 * 1024), false).unwrap();
        p.run(Duration::from_secs(1));
        assert_eq!(p.a_acked(), 1);
        assert_eq!(p.a.stats().timeouts, 3);
        let resends: Vec<Instant> = p
            .log
            .iter()
            .filter(|(_, s, t)| *s == Side::A && t.kind == PacketKind::Retransmit)
            .map(|x| x.0)
            .collect();
        assert_eq!(resends.len(), 3);
        let gap1 = resends[1] - resends[0];
        let gap2 = resends[2] - resends[1];
        assert!(
            gap2 >= gap1 * 2 - Duration::from_micros(1),
            "exponential backoff: {gap1:?} then {gap2:?}"
        );
        assert!(
            resends[0] >= Instant::ZERO + Duration::from_millis(1),
            "min_rto respected"
        );
    }

    #[test]
    fn packets_above_the_path_mtu_never_arrive() {
        // A 1024-byte MSS does not fit a 600-byte MTU: nothing arrives, the sender gives
        // up; a 500-byte MSS does.
        let run = |mss: u16| {
            let config = Config {
                mss,
                max_rto_count: 2,
                max_rto: Duration::from_millis(4),
                ..cfg()
            };
            let mut p = Pair::new(config);
            p.network(|n| n.mtu = 600);
            p.a.send(p.now, Payload::Bytes(vec![9u8; 5000].into()), false)
                .unwrap();
            p.run(Duration::from_secs(1));
            (p.b_received(), p.a.error())
        };
        assert_eq!(run(1024), (vec![], Some(ConnectionError::TimedOut(2))));
        assert_eq!(run(500), (vec![(0, 5000)], None));
    }

    #[test]
    fn unreachable_peer_fails_after_max_timeouts() {
        let config = Config {
            max_rto_count: 3,
            max_rto: Duration::from_millis(8),
            ..cfg()
        };
        let mut p = Pair::new(config);
        p.ab.loss = 1.0;
        p.a.send(p.now, Payload::Virtual(4 * 1024), false).unwrap();
        p.run(Duration::from_secs(10));
        assert_eq!(p.a.error(), Some(ConnectionError::TimedOut(3)));
        assert!(p
            .a_events
            .contains(&Event::Failed(ConnectionError::TimedOut(3))));
        assert_eq!(p.a.poll_timeout(), None);
        assert!(p.a.send(p.now, Payload::Virtual(1), false).is_err());
    }
}

mod synchronise {
    use super::*;

    #[test]
    fn synchronise_message_waits_delta_t_after_the_previous_tail() {
        let config = Config {
            probe_probability: 0.0,
            ..cfg()
        };
        let now = Instant::ZERO;
        let mut c = Connection::new(config, now);
        c.send(now, Payload::Virtual(20 * 1024), false).unwrap();
        c.send(now, Payload::Virtual(4 * 1024), true).unwrap();
        assert_eq!(data_psns(&drain(&mut c, now)).len(), 16);
        let t = Instant::from_micros(10);
        for psn in 0..4 {
            ack(&mut c, t, 1, psn, psn + 1, false, false);
        }
        // 16..=19 left; 19 is the tail of message 0.
        let out = data_psns(&drain(&mut c, t));
        assert_eq!(
            out.iter().map(|p| p.0).collect::<Vec<_>>(),
            vec![16, 17, 18, 19]
        );
        let dt = Duration::from_nanos((32.0 * c.srtt().as_nanos() as f64 / c.cwnd()) as u64);
        ack(&mut c, t, 1, 4, 5, false, false);
        assert!(
            drain(&mut c, t).is_empty(),
            "the synchronise message must wait"
        );
        assert_eq!(c.poll_timeout(), Some(t + dt));
        let early = t + dt - Duration::from_nanos(1);
        c.handle_timeout(early);
        assert!(drain(&mut c, early).is_empty());
        c.handle_timeout(t + dt);
        let out = data_psns(&drain(&mut c, t + dt));
        assert_eq!(out.first().map(|p| p.0), Some(20));
    }

    #[test]
    fn synchronise_delay_prevents_early_arrivals() {
        let run = |alpha: f64| {
            let config = Config {
                sync_alpha: alpha,
                seed: 9,
                ..Config::default()
            };
            let mut p = Pair::new(config);
            p.ab.path_latency = Some(Box::new(|path| {
                Duration::from_micros(u64::from(path.0 % 4) * 3)
            }));
            for i in 0..40 {
                p.a.send(p.now, Payload::Virtual(8 * 1024), i % 2 == 1)
                    .unwrap();
            }
            p.run(Duration::from_secs(1));
            let got: Vec<u64> = p.b_received().iter().map(|m| m.0).collect();
            assert_eq!(got, (0..40).collect::<Vec<_>>());
            p.b.stats().sync_early_drops
        };
        let without = run(0.0);
        let with = run(1.0);
        assert!(without > 0, "the scenario should provoke early arrivals");
        assert!(with < without, "delay {with} vs none {without}");
    }

    #[test]
    fn early_synchronise_packet_is_dropped_and_nacked() {
        let now = Instant::ZERO;
        let mut b = Connection::new(cfg(), now);
        let d = |psn, msn, ipsn, sync, tail| DataHeader {
            path: PathId(1),
            psn,
            msn,
            ipsn,
            payload_len: 1,
            synchronise: sync,
            tail,
            ..DataHeader::default()
        };
        data(&mut b, now, d(1, 0, 1, false, true), b"b");
        data(&mut b, now, d(2, 1, 0, true, true), b"s"); // message 1 is synchronise, 0 incomplete
        let out = drain(&mut b, now);
        let (t, _, _, n) = &out[1];
        assert_eq!(t.kind, PacketKind::Nack);
        let n = n.unwrap();
        assert!(n.synchronise);
        assert_eq!(n.lost, 2);
        assert_eq!(b.stats().sync_early_drops, 1);
        data(&mut b, now, d(0, 0, 0, false, false), b"a");
        assert!(matches!(b.poll_event(), Some(Event::MessageReceived { id, .. }) if id.0 == 0));
        assert_eq!(
            b.poll_event(),
            None,
            "the dropped synchronise message is not delivered"
        );
        data(&mut b, now, d(2, 1, 0, true, true), b"s");
        assert_eq!(
            b.poll_event(),
            Some(Event::MessageReceived {
                id: crate::MessageId(1),
                payload: Payload::Bytes(bytes::Bytes::from_static(b"s")),
                synchronise: true
            })
        );
    }

    #[test]
    fn early_synchronise_is_recovered_end_to_end() {
        // No sender delay and slow paths: synchronise packets arrive early, get dropped
        // and NACKed, and are delivered after the earlier message.
        let config = Config {
            sync_alpha: 0.0,
            seed: 9,
            ..Config::default()
        };
        let mut p = Pair::new(config);
        p.ab.path_latency = Some(Box::new(|path| {
            Duration::from_micros(u64::from(path.0 % 4) * 10)
        }));
        for i in 0..20 {
            p.a.send(p.now, Payload::Virtual(8 * 1024), i % 2 == 1)
                .unwrap();
        }
        p.run(Duration::from_secs(1));
        let got: Vec<u64> = p.b_received().iter().map(|m| m.0).collect();
        assert_eq!(got, (0..20).collect::<Vec<_>>());
        assert!(
            p.b.stats().sync_early_drops > 0,
            "the scenario should provoke early arrivals"
        );
    }
}

mod state {
    use super::*;

    /// Per-connection protocol state, counted field by field (bytes):
    ///
    /// sender (`SenderState`): snd_una 4, snd_nxt 4, snd_max 4, snd_ooh 4, recovery 4,
    /// snd_retx 4, snd_tail 4, inflate 4, retransmissions in flight 4, cwnd 8 (f64),
    /// RTT estimator 12 (srtt 4, rttvar 4, flag), rto count 1, recovery flags 2,
    /// padding → 64; SACK scoreboard 1 bit × L = 8 → 72.
    /// receiver (`ReceiverState`): rcv_nxt 4, last NACKed PSN 4, message counter 8 → 16;
    /// bitmap 2 bits × L = 16 → 32.
    /// Multi-path total 104 ≤ 128. Of these, the multi-path additions over a
    /// single-path RC connection are snd_ooh, recovery, snd_retx, snd_tail, inflate,
    /// retransmissions in flight, SACK bitmap, cwnd, the receive bitmap and the two
    /// recovery flags: 58 bytes (the paper counts 66).
    #[test]
    fn protocol_state_fits_128_bytes() {
        let c = Connection::new(cfg(), Instant::ZERO);
        let size = c.stats().state_size;
        assert_eq!(size.sender, 72, "{size:?}");
        assert_eq!(size.receiver, 32, "{size:?}");
        assert_eq!(size.rate_control, 0);
        assert!(size.protocol() <= 128, "{size:?}");
        // A larger bitmap adds L/8 + L/4 bytes.
        let wide = Connection::new(
            Config {
                bitmap_len: 256,
                ..cfg()
            },
            Instant::ZERO,
        );
        let size = wide.stats().state_size;
        assert_eq!((size.sender, size.receiver), (64 + 32, 16 + 64), "{size:?}");
        let sp = Connection::new(
            Config {
                mode: crate::Mode::SinglePath,
                ..cfg()
            },
            Instant::ZERO,
        );
        assert!(
            sp.stats().state_size.protocol() <= 136,
            "{:?}",
            sp.stats().state_size
        );
    }

    #[test]
    fn cwnd_trace_is_recorded_when_enabled() {
        let mut p = Pair::new(Config {
            trace_cwnd: true,
            ..cfg()
        });
        p.a.send(p.now, Payload::Virtual(1000 * 1024), false)
            .unwrap();
        p.run(Duration::from_millis(10));
        let trace = &p.a.stats().cwnd_trace;
        assert!(trace.len() > 50, "{}", trace.len());
        assert!(trace.windows(2).all(|w| w[0].0 <= w[1].0));
        let q = Pair::new(cfg());
        assert!(q.a.stats().cwnd_trace.is_empty());
    }

    #[test]
    fn garbage_datagrams_are_errors_and_change_nothing() {
        let mut c = Connection::new(cfg(), Instant::ZERO);
        assert!(c
            .handle_datagram(Instant::ZERO, PathId(0), false, &[1, 2, 3])
            .is_err());
        // An ACK for a PSN never sent is a protocol error, ignored.
        let mut b = Vec::new();
        frame::encode_ack(
            &AckHeader {
                sack: 5,
                aack: 6,
                ..AckHeader::default()
            },
            &mut b,
        );
        assert!(c
            .handle_datagram(Instant::ZERO, PathId(0), false, &b)
            .is_err());
        assert_eq!(c.stats().acks_received, 0);
        assert!(c.error().is_none());
    }
}
