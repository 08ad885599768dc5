//! The udp provider on a real 4-path ECMP fabric (network namespaces, `tests/netns/fabric.sh`):
//! a short form of the MP-RDMA testbed experiments, with coarse assertions.
//!
//! - multi-path goodput with 0.5% loss on one spine stays ≥ 85% of its lossless goodput;
//! - single-path goodput on the lossy spine is clearly lower;
//! - every message arrives intact and in order (the receiver checks every byte);
//! - with the spines shaped very unequally (heavy reordering across paths), a flag WRITE posted
//!   with `SendFlags::SYNCHRONISE` after data WRITEs is never visible before the data.
//!
//! Needs root, iproute2 and nftables; elsewhere it prints SKIP and passes. Processes run in the
//! namespaces as `ip netns exec <ns> <this test binary>` in a helper role (the
//! `udp_goodput` example's code, selected by an environment variable).

use std::path::PathBuf;
use std::process::{Command, Stdio};

#[allow(dead_code)]
#[path = "../examples/udp_goodput.rs"]
mod goodput;

const ROLE_ENV: &str = "FABRIQ_UDP_GOODPUT_ARGS";
/// Each spine shaped to this rate. A debug build does not fill 4 spines of it on a 2-core
/// machine; both multi-path runs are then bounded alike, and the single path by its one spine.
const SPINE_RATE: &str = "40mbit";
const SECS: &str = "4";
/// The four spine rates of the synchronise run: spraying over them reorders heavily.
const UNEQUAL_RATES: [&str; 4] = ["40mbit", "20mbit", "8mbit", "4mbit"];
const SYNC_ROUNDS: &str = "40";
const CLIENT_PORT: u16 = 46000;
const SERVER_PORT: u16 = 47000;

fn fabric_sh() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/netns/fabric.sh")
}

/// Network namespaces, torn down on drop (also when an assertion fails).
struct Fabric {
    prefix: String,
}

impl Fabric {
    fn sh(&self, args: &[&str]) -> String {
        let out = Command::new("bash")
            .arg(fabric_sh())
            .args(args)
            .env("FABRIQ_NETNS_PREFIX", &self.prefix)
            .output()
            .expect("run fabric.sh");
        assert!(
            out.status.success(),
            "fabric.sh {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(fabric_sh())
            .arg("down")
            .env("FABRIQ_NETNS_PREFIX", &self.prefix)
            .status();
    }
}

fn json_field(line: &str, key: &str) -> String {
    let pat = format!("\"{key}\":");
    let at = line
        .find(&pat)
        .unwrap_or_else(|| panic!("no {key} in {line}"))
        + pat.len();
    line[at..]
        .split([',', '}'])
        .next()
        .unwrap_or_default()
        .to_string()
}

/// One transfer: server in hB, client in hA; returns (client line, server line).
fn transfer(f: &Fabric, opts: &[&str], run: u16) -> (String, String) {
    transfer_with(f, opts, &[], run)
}

/// [`transfer`] with extra arguments for both roles (e.g. `--test sync`).
fn transfer_with(f: &Fabric, opts: &[&str], extra: &[&str], run: u16) -> (String, String) {
    let exe = std::env::current_exe().unwrap();
    let ns = |h: &str| format!("{}-{h}", f.prefix);
    let oob = format!("198.18.2.1:{}", 48000 + run);
    let mut common: Vec<String> = vec!["--size".into(), "16384".into()];
    common.extend(extra.iter().map(|e| (*e).to_string()));
    for o in opts {
        common.push("--opt".into());
        common.push((*o).into());
    }
    let spawn = |host: &str, role_args: Vec<String>| {
        Command::new("ip")
            .args(["netns", "exec", &ns(host)])
            .arg(&exe)
            .args(["--exact", "goodput_role", "--nocapture", "--quiet"])
            .env(ROLE_ENV, role_args.join(" "))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn helper")
    };
    let mut server_args = vec![
        "server".to_string(),
        "--bind".into(),
        format!("198.18.2.1:{SERVER_PORT}"),
        "--oob".into(),
        oob.clone(),
        "--secs".into(),
        SECS.into(),
    ];
    server_args.extend(common.iter().cloned());
    let mut client_args = vec![
        "client".to_string(),
        "--bind".into(),
        format!("198.18.1.1:{CLIENT_PORT}"),
        "--oob".into(),
        oob,
        "--secs".into(),
        SECS.into(),
        "--depth".into(),
        "32".into(),
    ];
    if !extra.is_empty() {
        // The sync test's data WRITEs per round (both roles size the target memory from it).
        server_args.extend(["--depth".to_string(), "16".to_string()]);
        client_args.extend(["--depth".to_string(), "16".to_string()]);
    }
    client_args.extend(common);
    let server = spawn("hB", server_args);
    let client = spawn("hA", client_args);
    let out_c = client.wait_with_output().expect("client");
    let out_s = server.wait_with_output().expect("server");
    let line = |o: &std::process::Output| {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .find(|l| l.starts_with("{\"role\""))
            .unwrap_or_else(|| panic!("helper printed no result: {o:?}"))
            .to_string()
    };
    (line(&out_c), line(&out_s))
}

/// Goodput of one run, after checking the receiver saw every byte, in order.
fn goodput(f: &Fabric, opts: &[&str], run: u16) -> f64 {
    let (c, s) = transfer(f, opts, run);
    eprintln!("{opts:?}: {c}\n    {s}");
    assert_eq!(json_field(&c, "failed"), "false", "{c}");
    assert_eq!(json_field(&s, "corrupt"), "0", "{s}");
    assert_eq!(json_field(&s, "out_of_order"), "0", "{s}");
    assert_eq!(json_field(&s, "complete"), "true", "{s}");
    assert_eq!(json_field(&s, "messages"), json_field(&c, "messages"));
    json_field(&c, "goodput_mbps").parse().unwrap()
}

/// Helper role: runs only when re-executed by the test below.
#[test]
fn goodput_role() {
    if let Ok(args) = std::env::var(ROLE_ENV) {
        goodput::run(args.split_whitespace().map(String::from).collect());
    }
}

#[test]
fn multipath_keeps_goodput_under_loss_where_single_path_does_not() {
    let prefix = format!("fqu{}", std::process::id() % 100_000);
    let check = Command::new("bash")
        .arg(fabric_sh())
        .arg("check")
        .env("FABRIQ_NETNS_PREFIX", &prefix)
        .output();
    match check {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            eprintln!(
                "SKIP: network namespaces unavailable here ({})",
                String::from_utf8_lossy(&o.stdout).trim()
            );
            return;
        }
        Err(e) => {
            eprintln!("SKIP: cannot run fabric.sh ({e})");
            return;
        }
    }
    let f = Fabric { prefix };
    f.sh(&["up"]);
    f.sh(&["shape", SPINE_RATE]);
    // The spine the single-path baseline (VP 0: client port → server port) takes.
    let lossy = f.sh(&["path", &CLIENT_PORT.to_string(), &SERVER_PORT.to_string()]);
    assert!(
        ["1", "2", "3", "4"].contains(&lossy.as_str()),
        "path: {lossy:?}"
    );
    let mp = ["mode=multi", "paths=16"];
    let sp = ["mode=single", "paths=1", "line_rate_mbps=40"];

    // Lossless and lossy runs alternate, five of each, and their medians are compared, so a
    // burst of load on this shared machine during one or two runs does not decide the outcome
    // (with three, two disturbed lossy runs of 0.77 × lossless failed 2 of 6 test runs on one
    // 2-core host, where undisturbed ones keep 0.95–0.97).
    let (mut clean, mut lossy_runs) = (Vec::new(), Vec::new());
    for round in 0..5u16 {
        f.sh(&["clear", &lossy]);
        clean.push(goodput(&f, &mp, 2 * round));
        f.sh(&["loss", &lossy, "50"]);
        lossy_runs.push(goodput(&f, &mp, 2 * round + 1));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mp_clean = median(&mut clean);
    let mp_lossy = median(&mut lossy_runs);
    let sp_lossy = goodput(&f, &sp, 10);
    eprintln!("{}", f.sh(&["counters"]));
    eprintln!(
        "goodput Mbit/s: multi-path lossless {mp_clean:.1}, multi-path 0.5% loss on spine {lossy} \
         {mp_lossy:.1}, single-path on that spine {sp_lossy:.1}"
    );
    assert!(
        mp_lossy >= 0.85 * mp_clean,
        "multi-path lost too much goodput: {mp_lossy:.1} < 0.85 × {mp_clean:.1}"
    );
    assert!(
        sp_lossy < 0.6 * mp_lossy,
        "single-path on the lossy spine not clearly lower: {sp_lossy:.1} vs {mp_lossy:.1}"
    );

    // Synchronise under heavy reordering: data WRITEs sprayed over very unequal spines, then
    // a flag WRITE with SYNCHRONISE; the server checks the data the moment the flag shows.
    f.sh(&["clear", &lossy]);
    let mut shape = vec!["shape"];
    shape.extend(UNEQUAL_RATES);
    f.sh(&shape);
    let (c, s) = transfer_with(
        &f,
        &mp,
        &["--test", "sync", "--iters", SYNC_ROUNDS, "--sync", "on"],
        11,
    );
    eprintln!("synchronise over spines {UNEQUAL_RATES:?}: {c}\n    {s}");
    assert_eq!(json_field(&c, "failed"), "false", "{c}");
    assert_eq!(json_field(&s, "complete"), "true", "{s}");
    assert_eq!(json_field(&s, "rounds"), SYNC_ROUNDS, "{s}");
    assert_eq!(
        json_field(&s, "violations"),
        "0",
        "a SYNCHRONISE flag was visible before its data: {s}"
    );
    let gap: u64 = json_field(&s, "max_ooo_gap").parse().unwrap();
    assert!(
        gap > 0,
        "the unequal spines did not reorder anything, so synchronise was not exercised: {s}"
    );
}
