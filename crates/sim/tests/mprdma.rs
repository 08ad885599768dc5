//! Coarse end-to-end results of the real MP-RDMA core (`fabriq_mpath`) in the simulator:
//! multi-path goodput barely moves when one of four paths loses packets, while the
//! single-path baseline on the lossy path falls well below its lossless goodput. Small
//! scenarios (a few simulated milliseconds) so that the suite stays fast in debug builds.

use fabriq_sim::results::RunResult;
use fabriq_sim::runner::run_scenario;
use fabriq_sim::scenario::Scenario;

const BASE: &str = r#"
    duration_ms = 4.0
    warmup_ms = 1.0
    [topology]
    spines = 4
    leaves = 2
    hosts_per_leaf = 1
    host_link_gbps = 40
    fabric_link_gbps = 40
    link_delay_ns = 500
    [switch]
    ecn = { kmin_kb = 40, kmax_kb = 200, pmax = 0.2 }
    [traffic]
    kind = "long_flows"
    pairs = [[0, 1]]
"#;

fn run(mode: &str, lossy: Option<(&str, f64)>) -> RunResult {
    let mut toml = format!("{BASE}\n[transport]\nnum_paths = 64\nmode = \"{mode}\"\n");
    if let Some((link, loss)) = lossy {
        toml.push_str(&format!("[[faults]]\nlink = \"{link}\"\nloss = {loss}\n"));
    }
    let s = Scenario::from_toml(&toml).expect("valid scenario");
    let r = run_scenario(&s, &mut |_| {});
    assert_eq!(r.summary.malformed_datagrams, 0);
    assert_eq!(r.summary.mismatched_deliveries, 0);
    r
}

/// The one leaf0->spine link a single-path connection's 5-tuple hashes to.
fn single_path_link(r: &RunResult) -> String {
    let used: Vec<&str> = r
        .links
        .iter()
        .filter(|l| l.name.starts_with("leaf0->spine") && l.counters.tx_packets > 0)
        .map(|l| l.name.as_str())
        .collect();
    assert_eq!(used.len(), 1, "single path uses one spine: {used:?}");
    used[0].to_string()
}

#[test]
fn multipath_shrugs_off_loss_on_one_path_single_path_does_not() {
    let mp_clean = run("multi_path", None);
    let sp_clean = run("single_path", None);
    let line = 40.0 * 1024.0 / (1024.0 + 28.0 + 66.0);
    for r in [&mp_clean, &sp_clean] {
        let g = r.summary.mean_goodput_gbps;
        assert!(g > 0.9 * line, "{}: lossless goodput {g} of {line}", r.name);
    }
    let sp_link = single_path_link(&sp_clean);

    let mp_lossy = run("multi_path", Some((&sp_link, 0.005)));
    let mp_ratio = mp_lossy.summary.mean_goodput_gbps / mp_clean.summary.mean_goodput_gbps;
    assert!(
        mp_ratio >= 0.85,
        "MP with 0.5% loss on one of 4 paths: {mp_ratio:.3} of lossless"
    );
    assert!(mp_lossy.summary.drops_loss > 0);

    let sp_lossy = run("single_path", Some((&sp_link, 0.05)));
    let sp_ratio = sp_lossy.summary.mean_goodput_gbps / sp_clean.summary.mean_goodput_gbps;
    assert!(
        sp_ratio < 0.7,
        "single path on a 5%-lossy path: {sp_ratio:.3} of lossless"
    );

    let mp_lossy5 = run("multi_path", Some((&sp_link, 0.05)));
    assert!(
        mp_lossy5.summary.mean_goodput_gbps > 1.5 * sp_lossy.summary.mean_goodput_gbps,
        "MP {} vs SP {} at 5% loss",
        mp_lossy5.summary.mean_goodput_gbps,
        sp_lossy.summary.mean_goodput_gbps
    );
}

#[test]
fn multipath_is_deterministic_by_seed() {
    let a = run("multi_path", Some(("leaf0->spine1", 0.01))).without_wall_clock();
    let b = run("multi_path", Some(("leaf0->spine1", 0.01))).without_wall_clock();
    assert_eq!(a, b);
}

fn failure_run(down_ms: f64, up_ms: f64, duration_ms: f64) -> RunResult {
    let toml = format!(
        "{}\n[transport]\nnum_paths = 64\n\
         [[faults]]\nlink = \"leaf0->spine2\"\ndown_at_ms = {down_ms}\nup_at_ms = {up_ms}\n\
         [[faults]]\nlink = \"spine2->leaf0\"\ndown_at_ms = {down_ms}\nup_at_ms = {up_ms}\n\
         [output]\nwatch_links = [\"leaf0->spine*\"]\n",
        BASE.replace(
            "duration_ms = 4.0",
            &format!("duration_ms = {duration_ms}\nsample_interval_us = 100")
        )
    );
    let s = Scenario::from_toml(&toml).expect("valid");
    run_scenario(&s, &mut |_| {})
}

/// Throughput of each watched link (and their total) over samples in (from, to].
fn window_gbps(r: &RunResult, from: f64, to: f64) -> (Vec<f64>, f64) {
    let t = &r.timeline;
    let idx: Vec<usize> = (0..t.time_ms.len())
        .filter(|&i| t.time_ms[i] > from && t.time_ms[i] <= to)
        .collect();
    let per_link: Vec<f64> = t
        .link_gbps
        .iter()
        .map(|v| idx.iter().map(|&i| v[i]).sum::<f64>() / idx.len().max(1) as f64)
        .collect();
    let total = per_link.iter().sum();
    (per_link, total)
}

#[test]
fn failed_path_carries_nothing_and_is_used_again_after_recovery() {
    let r = failure_run(1.0, 2.0, 6.0);
    let spine2 = r
        .timeline
        .link_names
        .iter()
        .position(|n| n == "leaf0->spine2")
        .expect("watched");
    let (during, _) = window_gbps(&r, 1.1, 2.0);
    assert_eq!(during[spine2], 0.0, "nothing crosses the failed link");
    let (after, total) = window_gbps(&r, 5.0, 6.0);
    assert!(
        total > 30.0,
        "full goodput again after recovery: {total} Gb/s"
    );
    for (i, g) in after.iter().enumerate() {
        assert!(
            *g > 1.0,
            "{} unused after recovery ({g} Gb/s)",
            r.timeline.link_names[i]
        );
    }
    assert_eq!(r.summary.failed_connections, 0);
}

/// The paper's behaviour: when one of four paths fails, traffic moves to the other three
/// at once (ACK clocking stops using the dead path; its losses are recovered once).
#[test]
fn traffic_moves_to_the_live_paths_within_a_millisecond_of_a_failure() {
    let r = failure_run(1.0, 4.0, 4.0);
    let (_, total) = window_gbps(&r, 2.0, 4.0);
    assert!(
        total > 25.0,
        "live paths carry {total} Gb/s after the failure"
    );
}

#[test]
fn incast_senders_share_the_receiver_fairly() {
    let toml = r#"
        duration_ms = 3.0
        warmup_ms = 1.0
        [topology]
        spines = 2
        leaves = 2
        hosts_per_leaf = 4
        host_link_gbps = 40
        fabric_link_gbps = 40
        link_delay_ns = 1000
        [switch]
        ecn = { kmin_kb = 40, kmax_kb = 200, pmax = 0.2 }
        [transport]
        num_paths = 64
        [traffic]
        kind = "incast"
        receiver = 0
        senders = 6
    "#;
    let r = run_scenario(&Scenario::from_toml(toml).expect("valid"), &mut |_| {});
    let line = 40.0 * 1024.0 / (1024.0 + 28.0 + 66.0);
    assert!(
        r.summary.total_goodput_gbps > 0.9 * line,
        "{}",
        r.summary.total_goodput_gbps
    );
    assert!(
        r.summary.jain_index > 0.9,
        "Jain index {}",
        r.summary.jain_index
    );
    assert!(
        r.summary.ecn_marks > 0,
        "the receiver's port is the bottleneck and marks"
    );
}
