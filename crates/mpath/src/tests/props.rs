//! Property tests: delivery, ordering and bounds under random network behaviour.

use std::time::Duration;

use proptest::prelude::*;

use super::pair::Pair;
use crate::frame::{self, AckHeader, DataHeader, NackHeader};
use crate::{Config, Connection, Event, Instant, MessageId, Mode, PathId, Payload};

#[derive(Clone, Debug)]
struct Net {
    loss: f64,
    duplicate: f64,
    jitter_us: u64,
    ecn: f64,
    slow_paths: u16,
    rate_gbps: Option<u32>,
}

fn net() -> impl Strategy<Value = Net> {
    (
        0.0..0.1f64,
        0.0..0.1f64,
        0u64..20,
        0.0..0.3f64,
        0u16..16,
        proptest::option::of(1u32..100),
    )
        .prop_map(
            |(loss, duplicate, jitter_us, ecn, slow_paths, rate_gbps)| Net {
                loss,
                duplicate,
                jitter_us,
                ecn,
                slow_paths,
                rate_gbps,
            },
        )
}

fn apply(p: &mut Pair, n: &Net) {
    let slow = n.slow_paths;
    p.network(|x| {
        x.loss = n.loss;
        x.duplicate = n.duplicate;
        x.jitter = Duration::from_micros(n.jitter_us);
        x.ecn = n.ecn;
        x.rate_bps = n.rate_gbps.map(|g| f64::from(g) * 1e9);
    });
    p.ab.path_latency = Some(Box::new(move |path| {
        if path.0 < slow {
            Duration::from_micros(30)
        } else {
            Duration::ZERO
        }
    }));
}

fn messages() -> impl Strategy<Value = Vec<(Vec<u8>, bool)>> {
    proptest::collection::vec(
        (
            proptest::collection::vec(any::<u8>(), 0..6000),
            any::<bool>(),
        ),
        1..12,
    )
}

fn base(mode: Mode, seed: u64) -> Config {
    Config {
        mode,
        seed,
        max_rto_count: 30,
        min_rto: Duration::from_micros(300),
        max_rto: Duration::from_millis(5),
        trace_cwnd: true,
        ..Config::default()
    }
}

/// 48 cases in CI; `PROPTEST_CASES=n` runs more.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// Under random loss, reordering, duplication and ECN marks every message arrives
    /// exactly once, intact, in order, with its synchronise flag; every message is
    /// acknowledged; the window stays in bounds. Bitmaps from the paper's 64 slots to the
    /// largest.
    #[test]
    fn every_byte_exactly_once_in_order(msgs in messages(), n in net(), seed in any::<u64>(), single in any::<bool>(), mss in 64u16..1500, bitmap_len in prop::sample::select(vec![64u32, 100, 256, crate::MAX_BITMAP_LEN])) {
        let mode = if single { Mode::SinglePath } else { Mode::MultiPath };
        let config = Config { mss, min_window: 2.0, max_window: 200.0, bitmap_len, ..base(mode, seed) };
        let mut p = Pair::new(config.clone());
        apply(&mut p, &n);
        for (m, sync) in &msgs {
            p.a.send(p.now, Payload::Bytes(m.clone().into()), *sync).unwrap();
        }
        // Traffic the other way at the same time.
        p.b.send(p.now, Payload::Virtual(50_000), false).unwrap();
        p.run(Duration::from_secs(30));
        let got: Vec<_> = p.b_events.iter().filter_map(|e| match e {
            Event::MessageReceived { id, payload: Payload::Bytes(b), synchronise } => Some((id.0, b.to_vec(), *synchronise)),
            Event::MessageReceived { .. } => panic!("virtual payload on a bytes connection"),
            _ => None,
        }).collect();
        let want: Vec<_> = msgs.iter().enumerate().map(|(i, (m, s))| (i as u64, m.clone(), *s)).collect();
        prop_assert_eq!(got, want);
        let acked: Vec<_> = p.a_events.iter().filter_map(|e| match e { Event::MessageAcked(id) => Some(id.0), _ => None }).collect();
        prop_assert_eq!(acked, (0..msgs.len() as u64).collect::<Vec<_>>());
        prop_assert!(p.a_events.iter().chain(&p.b_events).all(|e| !matches!(e, Event::Failed(_))));
        prop_assert_eq!(p.decode_errors, 0);
        prop_assert!(p.a.stats().cwnd_trace.iter().all(|&(_, c)| (2.0..=200.0).contains(&c)));
        let b_to_a = p.a_events.iter().filter(|e| matches!(e, Event::MessageReceived { .. })).count();
        prop_assert_eq!(b_to_a, 1);
    }

    /// Heavy ECN marking and slow paths never push cwnd out of `[min, max]`.
    #[test]
    fn cwnd_stays_within_bounds(n in net(), seed in any::<u64>(), min in 1.0..8.0f64, span in 1.0..100.0f64) {
        let max = min + span;
        let config = Config { min_window: min, max_window: max, initial_window: min.ceil() as u32, ..base(Mode::MultiPath, seed) };
        let mut p = Pair::new(config);
        apply(&mut p, &n);
        p.a.send(p.now, Payload::Virtual(300 * 1024), false).unwrap();
        p.run(Duration::from_secs(30));
        prop_assert_eq!(p.a_acked(), 1);
        for &(_, c) in &p.a.stats().cwnd_trace {
            prop_assert!(c >= min && c <= max, "cwnd {} outside [{}, {}]", c, min, max);
        }
    }

    /// Arbitrary and adversarial datagrams never panic a connection; well-formed
    /// traffic afterwards still works for a connection that was not failed.
    #[test]
    fn arbitrary_datagrams_never_panic(inputs in proptest::collection::vec(datagram(), 0..64), seed in any::<u64>()) {
        let now = Instant::ZERO;
        let mut c = Connection::new(Config { seed, ..Config::default() }, now);
        c.send(now, Payload::Virtual(100 * 1024), false).unwrap();
        let mut buf = Vec::new();
        let mut t = now;
        for d in &inputs {
            t += Duration::from_micros(3);
            let _ = c.handle_datagram(t, PathId(1), false, d);
            while c.poll_transmit(t, &mut buf).is_some() {}
            c.handle_timeout(t);
            while c.poll_event().is_some() {}
            let _ = c.poll_timeout();
        }
    }
}

/// Datagrams that are mostly well-formed, with hostile field values.
fn datagram() -> impl Strategy<Value = Vec<u8>> {
    let data = (
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u16>(),
        any::<u8>(),
        0u32..200,
    )
        .prop_map(|(psn, msn, ipsn, len, flags, near)| {
            let mut out = Vec::new();
            let psn = if flags & 0x80 != 0 { near } else { psn };
            let h = DataHeader {
                path: PathId(u16::from(flags)),
                psn,
                msn: if flags & 0x40 != 0 { msn % 4 } else { msn },
                ipsn: if flags & 0x20 != 0 { ipsn % 4 } else { ipsn },
                timestamp: u64::from(psn),
                payload_len: len % 2000,
                synchronise: flags & 1 != 0,
                retransmit: flags & 2 != 0,
                tail: flags & 4 != 0,
                is_virtual: flags & 8 != 0,
            };
            let payload = vec![7u8; usize::from(h.payload_len)];
            frame::encode_data(&h, &payload, &mut out);
            out
        });
    let ack =
        (0u32..200, 0u32..200, any::<u64>(), any::<u8>()).prop_map(|(sack, aack, ts, flags)| {
            let mut out = Vec::new();
            if flags & 0x80 != 0 {
                frame::encode_nack(
                    &NackHeader {
                        path: PathId(2),
                        lost: sack,
                        aack,
                        timestamp_echo: ts,
                        ece: flags & 1 != 0,
                        synchronise: flags & 2 != 0,
                        retransmit: flags & 4 != 0,
                    },
                    &mut out,
                );
            } else {
                frame::encode_ack(
                    &AckHeader {
                        path: PathId(2),
                        sack,
                        aack,
                        timestamp_echo: ts,
                        ece: flags & 1 != 0,
                        synchronise: flags & 2 != 0,
                        retransmit: flags & 4 != 0,
                    },
                    &mut out,
                );
            }
            out
        });
    prop_oneof![data, ack, proptest::collection::vec(any::<u8>(), 0..64)]
}

#[test]
fn bidirectional_transfer_with_loss() {
    let mut p = Pair::new(base(Mode::MultiPath, 42));
    p.network(|n| {
        n.loss = 0.02;
        n.jitter = Duration::from_micros(3);
        n.rate_bps = Some(25e9);
    });
    for i in 0..50u64 {
        p.a.send(p.now, Payload::Virtual(10_000 + i), i % 7 == 0)
            .unwrap();
        p.b.send(p.now, Payload::Virtual(20_000 + i), false)
            .unwrap();
    }
    p.run(Duration::from_secs(30));
    assert_eq!(
        p.b_received(),
        (0..50).map(|i| (i, 10_000 + i)).collect::<Vec<_>>()
    );
    let a_got: Vec<_> = p
        .a_events
        .iter()
        .filter_map(|e| match e {
            Event::MessageReceived { id, payload, .. } => Some((id.0, payload.len())),
            _ => None,
        })
        .collect();
    assert_eq!(a_got, (0..50).map(|i| (i, 20_000 + i)).collect::<Vec<_>>());
    assert!(p.a_events.contains(&Event::MessageAcked(MessageId(49))));
    assert!(p.a.stats().retransmits > 0);
}

#[test]
fn transfer_crosses_the_psn_wrap() {
    for mode in [Mode::MultiPath, Mode::SinglePath] {
        let config = base(mode, 8);
        let mut p = Pair::with_initial_psn(
            config.clone(),
            Config { seed: 99, ..config },
            u32::MAX - 150,
        );
        p.network(|n| {
            n.loss = 0.03;
            n.jitter = Duration::from_micros(2);
            n.rate_bps = Some(25e9);
        });
        for i in 0..30u8 {
            p.a.send(p.now, Payload::Bytes(vec![i; 10_000].into()), i % 5 == 0)
                .unwrap();
        }
        p.run(Duration::from_secs(30));
        let got: Vec<_> = p
            .b_events
            .iter()
            .filter_map(|e| match e {
                Event::MessageReceived {
                    id,
                    payload: Payload::Bytes(b),
                    ..
                } => Some((id.0, b.len(), b[0])),
                _ => None,
            })
            .collect();
        assert_eq!(
            got,
            (0..30u8)
                .map(|i| (u64::from(i), 10_000, i))
                .collect::<Vec<_>>(),
            "{mode:?}"
        );
        assert!(
            p.a.sender_state().snd_una < 1_000_000,
            "{mode:?}: PSNs wrapped"
        );
    }
}

#[test]
fn same_inputs_and_seed_give_the_same_trace() {
    let run = |seed: u64| {
        let mut p = Pair::new(base(Mode::MultiPath, seed));
        p.network(|n| {
            n.loss = 0.02;
            n.jitter = Duration::from_micros(4);
            n.ecn = 0.05;
            n.rate_bps = Some(40e9);
        });
        for i in 0..20u64 {
            p.a.send(p.now, Payload::Virtual(5_000 * (i + 1)), i % 3 == 0)
                .unwrap();
        }
        p.run(Duration::from_secs(10));
        (p.log.clone(), p.a.stats().clone(), p.now)
    };
    let first = run(77);
    assert_eq!(first, run(77));
    assert_ne!(first.0, run(78).0, "the seed changes path choices");
}
