//! End-to-end scenarios: steady state under ECN, and the multi-path transport against
//! the single-path baseline under random loss.

use std::time::Duration;

use super::pair::Pair;
use crate::{Config, Instant, Mode, Payload};

/// Completion time of one `packets`-packet message over a 10 Gb/s bottleneck.
fn completion(mode: Mode, loss: f64, packets: u64, seed: u64) -> (Duration, Pair) {
    let config = Config {
        mode,
        seed,
        min_rto: Duration::from_micros(500),
        max_rto_count: 30,
        dcqcn: crate::DcqcnConfig {
            line_rate_bps: 10e9,
            ..Default::default()
        },
        trace_cwnd: true,
        ..Config::default()
    };
    let mut p = Pair::new(config);
    p.network(|n| {
        n.rate_bps = Some(10e9);
        n.latency = Duration::from_micros(5);
        n.ecn_threshold_bytes = Some(30_000);
    });
    p.ab.loss = loss;
    p.a.send(p.now, Payload::Virtual(packets * 1024), false)
        .unwrap();
    let done = p.run_until(Duration::from_secs(60), |p| p.a_acked() == 1);
    assert!(done, "{mode:?} did not finish");
    (p.now - Instant::ZERO, p)
}

#[test]
fn ecn_keeps_the_queue_short_at_full_rate() {
    let (t, p) = completion(Mode::MultiPath, 0.0, 20_000, 1);
    // 20 000 × (1024 + 28) bytes at 10 Gb/s ≈ 16.8 ms.
    let ideal = Duration::from_secs_f64(20_000.0 * 1052.0 * 8.0 / 10e9);
    assert!(t < ideal.mul_f64(1.1), "{t:?} vs ideal {ideal:?}");
    assert!(p.net.marked > 0, "the queue reached the marking threshold");
    assert!(p.a.stats().ecn_echoes > 0);
    // Marking caps the window near BDP + K: ~ (10 µs × 10 Gb/s + 30 kB) / 1 kB ≈ 42.
    let max_cwnd =
        p.a.stats()
            .cwnd_trace
            .iter()
            .map(|x| x.1)
            .fold(0.0, f64::max);
    assert!(max_cwnd < 120.0, "cwnd grew to {max_cwnd}");
    assert_eq!(p.a.stats().retransmits, 0);
}

#[test]
fn multipath_beats_single_path_under_random_loss() {
    // Selective recovery against go-back-N: at 5 % data loss the multi-path transport
    // finishes sooner and resends a fraction of what go-back-N resends.
    let (mp, p) = completion(Mode::MultiPath, 0.05, 5_000, 2);
    let (sp, q) = completion(Mode::SinglePath, 0.05, 5_000, 2);
    let (mp_rtx, sp_rtx) = (p.a.stats().retransmits, q.a.stats().retransmits);
    assert!(mp < sp, "multi-path {mp:?} vs single-path {sp:?}");
    assert!(
        mp_rtx * 4 < sp_rtx,
        "resends: multi-path {mp_rtx}, single-path {sp_rtx}"
    );
    assert_eq!(
        p.a.stats().timeouts,
        0,
        "losses are found from SACKs, not by timeout"
    );
    assert!(p.a.stats().recoveries > 0);
}

#[test]
fn low_loss_costs_little() {
    let (t, p) = completion(Mode::MultiPath, 0.01, 5_000, 3);
    let ideal = Duration::from_secs_f64(5_000.0 * 1052.0 * 8.0 / 10e9);
    assert!(t < ideal.mul_f64(1.3), "{t:?} vs ideal {ideal:?}");
    assert_eq!(p.a.stats().timeouts, 0);
}
