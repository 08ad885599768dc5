//! The single-path baseline: fixed path, go-back-N, DCQCN rate control.

use std::time::Duration;

use super::pair::{Pair, Side};
use crate::frame::Frame;
use crate::{Config, Event, Mode, PacketKind, PathId, Payload};

fn cfg() -> Config {
    Config {
        mode: Mode::SinglePath,
        single_path: 3,
        seed: 1,
        ..Config::default()
    }
}

#[test]
fn uses_one_path_and_delivers_in_order() {
    let mut p = Pair::new(cfg());
    for i in 0..5u8 {
        p.a.send(p.now, Payload::Bytes(vec![i; 3000].into()), false)
            .unwrap();
    }
    p.run(Duration::from_secs(1));
    assert_eq!(
        p.b_received(),
        (0..5).map(|i| (i, 3000)).collect::<Vec<_>>()
    );
    assert_eq!(p.a_acked(), 5);
    assert!(p
        .log
        .iter()
        .filter(|(_, s, t)| *s == Side::A && t.kind.is_data())
        .all(|(_, _, t)| t.path == PathId(3)));
    assert_eq!(p.a.stats().rate_bps, 100e9);
}

#[test]
fn data_is_paced_at_the_current_rate() {
    let config = Config {
        dcqcn: crate::DcqcnConfig {
            line_rate_bps: 1e9,
            ..Default::default()
        },
        ..cfg()
    };
    let mut p = Pair::new(config);
    p.a.send(p.now, Payload::Virtual(20 * 1024), false).unwrap();
    p.run(Duration::from_secs(1));
    let sends: Vec<_> = p
        .log
        .iter()
        .filter(|(_, s, t)| *s == Side::A && t.kind.is_data())
        .collect();
    assert_eq!(sends.len(), 20);
    for w in sends.windows(2) {
        let gap = w[1].0 - w[0].0;
        let expect = Duration::from_secs_f64(w[0].2.wire_len() as f64 * 8.0 / 1e9);
        assert!(
            gap + Duration::from_nanos(2) >= expect,
            "gap {gap:?} < {expect:?}"
        );
    }
}

#[test]
fn loss_triggers_go_back_n() {
    let mut p = Pair::new(cfg());
    let mut dropped = false;
    p.ab.drop_if = Some(Box::new(move |s| match s.frame {
        Frame::Data(h, _) if h.psn == 5 && !dropped => {
            dropped = true;
            true
        }
        _ => false,
    }));
    p.a.send(p.now, Payload::Virtual(40 * 1024), false).unwrap();
    p.run(Duration::from_secs(1));
    assert_eq!(p.b_received(), vec![(0, 40 * 1024)]);
    let st = p.a.stats();
    assert_eq!(st.go_back_n, 1);
    assert_eq!(st.timeouts, 0);
    assert_eq!(
        p.b.stats().nacks_sent,
        1,
        "one NACK per gap within the NACK interval"
    );
    // Go-back-N resends everything from the hole that was sent before the NACK came.
    assert!(st.retransmits > 1);
    assert!(p.b.stats().ooo_drops >= 1);
}

#[test]
fn timeout_goes_back_to_snd_una() {
    let mut p = Pair::new(cfg());
    let mut drops = 0;
    p.ab.drop_if = Some(Box::new(move |s| match s.frame {
        Frame::Data(h, _) if h.psn == 9 && drops < 1 => {
            drops += 1;
            true
        }
        _ => false,
    }));
    p.a.send(p.now, Payload::Virtual(10 * 1024), false).unwrap();
    p.run(Duration::from_secs(1));
    assert_eq!(p.a_acked(), 1);
    assert_eq!(p.a.stats().timeouts, 1);
    assert_eq!(p.a.stats().retransmits, 1);
}

#[test]
fn ecn_echo_cuts_the_rate_and_it_recovers() {
    let mut p = Pair::new(cfg());
    // Mark every data packet sent in the first 200 µs.
    p.ab.mark_if = Some(Box::new(|s| s.at.as_nanos() < 200_000));
    p.a.send(p.now, Payload::Virtual(4000 * 1024), false)
        .unwrap();
    let cut = p.run_until(Duration::from_millis(1), |p| p.a.stats().rate_cuts > 0);
    assert!(cut);
    let st = p.a.stats();
    assert_eq!(
        st.rate_bps, 50e9,
        "the first cut (alpha = 1) halves the rate"
    );
    p.run_until(Duration::from_millis(1), |p| p.now.as_nanos() > 250_000);
    let cuts = p.a.stats().rate_cuts;
    // At most one reaction per 50 µs CNP interval over ~200 µs of marking (+ one RTT).
    assert!((2..=6).contains(&cuts), "{cuts} cuts");
    assert!(p.a.stats().rate_bps < 50e9);
    p.run(Duration::from_secs(1));
    assert_eq!(p.a_acked(), 1);
    assert_eq!(
        p.a.stats().rate_bps,
        100e9,
        "rate recovers to line rate without marks"
    );
    assert!(!p.a_events.iter().any(|e| matches!(e, Event::Failed(_))));
}

#[test]
fn single_path_sends_no_probes_or_multipath_state() {
    let mut p = Pair::new(cfg());
    p.a.send(p.now, Payload::Virtual(100 * 1024), false)
        .unwrap();
    p.run(Duration::from_secs(1));
    assert_eq!(p.a_sent(PacketKind::Probe), 0);
    assert_eq!(p.a.stats().slow_path_prunes, 0);
    assert!(p.a.stats().state_size.rate_control > 0);
}
