//! End-to-end tests of `fabriq perf --layer channel|rpc`: the middleware measurements on the
//! software providers (shm0, tcp0), their JSON documents, the refused test/layer combinations,
//! and a middleware server meeting a client that breaks the protocol. They check structure and
//! the absence of errors, never speed.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

mod common;

use common::{fabriq, perf_json, PERF};
use serde_json::Value;

const HANG: Duration = Duration::from_secs(30);

fn assert_header(v: &Value, layer: &str, test: &str, device: &str) {
    assert_eq!(v["tool"], "fabriq perf");
    assert_eq!(v["layer"], layer, "{v}");
    assert_eq!(v["test"], test);
    assert_eq!(v["device"], device);
    assert_eq!(v["provider"], &device[..3], "{v}");
    assert_eq!(v["local"], true);
    assert!(v["server"].as_str().is_some_and(|s| s.contains(':')), "{v}");
    assert_eq!(v["errors"], 0, "{v}");
}

fn assert_latency(v: &Value, iters: u64, size: u64, kind: &str) {
    assert_eq!(v["latency"], kind);
    let rows = v["results"].as_array().expect("results array");
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(r["iters"], iters, "{r}");
    assert_eq!(r["size"], size, "{r}");
    assert_eq!(r["errors"], 0, "{r}");
    let get = |k: &str| {
        r[k].as_f64()
            .unwrap_or_else(|| panic!("{k} missing in {r}"))
    };
    assert!(get("min_us") > 0.0, "{r}");
    assert!(get("min_us") <= get("p50_us"));
    assert!(get("p50_us") <= get("p99_us"));
    assert!(get("p99_us") <= get("p999_us"));
    assert!(get("p999_us") <= get("max_us"));
    assert!(get("mean_us") > 0.0);
}

/// A latency run of 200 iterations of `size` bytes: the report's header and its one row.
fn latency_run(layer: &str, test: &str, device: &str, size: u64, kind: &str) {
    let size_arg = size.to_string();
    let v = perf_json(&[
        "--layer", layer, "-d", device, "-t", test, "-n", "200", "-s", &size_arg,
    ]);
    assert_header(&v, layer, test, device);
    assert_eq!(v["api"], "sync", "{v}");
    assert_latency(&v, 200, size, kind);
}

fn channel_send_lat(device: &str) {
    latency_run("channel", "send_lat", device, 8, "one_way");
}

fn rpc_lat(device: &str) {
    latency_run("rpc", "rpc_lat", device, 64, "round_trip");
}

/// One-sided operations through `RemoteRegion` on a region the server exposed: each read
/// checked against the region's content, each fetch-and-add against the count so far.
fn channel_one_sided(device: &str) {
    latency_run("channel", "read_lat", device, 4096, "round_trip");
    latency_run("channel", "atomic_lat", device, 8, "round_trip");
}

#[test]
fn channel_one_sided_on_shm0() {
    channel_one_sided("shm0");
}

#[test]
fn channel_one_sided_on_tcp0() {
    channel_one_sided("tcp0");
}

#[test]
fn channel_send_lat_on_shm0() {
    channel_send_lat("shm0");
}

#[test]
fn channel_send_lat_on_tcp0() {
    channel_send_lat("tcp0");
}

#[test]
fn rpc_lat_on_shm0() {
    rpc_lat("shm0");
}

#[test]
fn rpc_lat_on_tcp0() {
    rpc_lat("tcp0");
}

/// `connect_lat`: a row for cold connects, one for cached ones and one for the wake floor (the
/// server runs on this host), all measured; the run
/// itself fails when the cached connects did not reuse their QP and control stream or the cold
/// ones did (the client checks its endpoints' counters), and when a connection did not close
/// and settle on both sides.
fn connect_lat(device: &str) {
    let v = perf_json(&[
        "--layer",
        "channel",
        "-d",
        device,
        "-t",
        "connect_lat",
        "-n",
        "30",
        "-w",
        "3",
    ]);
    assert_header(&v, "channel", "connect_lat", device);
    assert_eq!(v["latency"], "connect");
    let rows = v["results"].as_array().expect("results array");
    let cases: Vec<_> = rows.iter().map(|r| r["case"].as_str()).collect();
    assert_eq!(cases, [Some("cold"), Some("cached"), Some("floor")], "{v}");
    for r in rows {
        assert_eq!(r["iters"], 30, "{r}");
        assert_eq!(r["warmup"], 3, "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        let p50 = r["p50_us"].as_f64().expect("p50");
        assert!(
            p50 > 0.0 && p50 <= r["max_us"].as_f64().expect("max"),
            "{r}"
        );
    }
}

#[test]
fn connect_lat_on_shm0() {
    connect_lat("shm0");
}

#[test]
fn connect_lat_on_tcp0() {
    connect_lat("tcp0");
}

#[test]
fn connect_lat_text_report_gives_the_ratio() {
    let _one_at_a_time = PERF.lock().unwrap_or_else(|e| e.into_inner());
    let out = fabriq(&[
        "perf",
        "--local",
        "--layer",
        "channel",
        "-d",
        "shm0",
        "-t",
        "connect_lat",
        "-n",
        "10",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("Endpoint::connect"), "{stdout}");
    assert!(
        stdout.contains("cold") && stdout.contains("cached"),
        "{stdout}"
    );
    assert!(stdout.contains("faster than cold ones"), "{stdout}");
    assert!(stdout.contains("wake floor"), "{stdout}");
}

#[test]
fn rpc_is_the_default_test_of_the_rpc_layer() {
    let v = perf_json(&["--layer", "rpc", "-d", "shm0", "-n", "50"]);
    assert_header(&v, "rpc", "rpc_lat", "shm0");
}

#[test]
fn channel_send_bw_counts_every_message_eager_and_rendezvous() {
    // 8 B travels eagerly; 256 KiB is above every eager threshold (rendezvous READ).
    for (size, bytes, iters) in [("8", 8u64, 2000u64), ("256K", 256 << 10, 40)] {
        let n = iters.to_string();
        let v = perf_json(&[
            "--layer", "channel", "-d", "shm0", "-t", "send_bw", "-s", size, "-n", &n, "-w", "10",
        ]);
        assert_header(&v, "channel", "send_bw", "shm0");
        assert_eq!(v["latency"], Value::Null);
        let r = &v["results"][0];
        assert_eq!(r["size"], bytes, "{r}");
        assert_eq!(r["iters"], iters, "{r}");
        assert_eq!(r["warmup"], 10, "{r}");
        assert_eq!(r["bytes"], iters * bytes, "{r}");
        assert_eq!(r["server_messages"], iters, "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        for k in ["mib_s", "gbit_s", "mmsg_s", "elapsed_s"] {
            assert!(r[k].as_f64().unwrap_or(0.0) > 0.0, "{k} in {r}");
        }
    }
}

#[test]
fn rpc_rate_spreads_calls_over_callers() {
    // 301 calls over 4 callers: the remainder must not be lost.
    let v = perf_json(&[
        "--layer",
        "rpc",
        "-d",
        "tcp0",
        "-t",
        "rpc_rate",
        "--callers",
        "4",
        "-n",
        "301",
    ]);
    assert_header(&v, "rpc", "rpc_rate", "tcp0");
    let r = &v["results"][0];
    assert_eq!(r["iters"], 301, "{r}");
    assert_eq!(r["callers"], 4, "{r}");
    assert_eq!(r["errors"], 0, "{r}");
    let rate = r["calls_per_s"].as_f64().expect("calls_per_s");
    let elapsed = r["elapsed_s"].as_f64().expect("elapsed_s");
    assert!(rate > 0.0 && elapsed > 0.0, "{r}");
    assert!((rate * elapsed - 301.0).abs() < 1.0, "{r}");
}

/// `--api async`: the same latency tests through the async API (send_async / recv_async,
/// call_async, read_async, fetch_and_add_async), every reply checked, in both progress modes.
fn async_api(device: &str, progress: &str) {
    for (layer, test, size, kind) in [
        ("channel", "send_lat", 8u64, "one_way"),
        ("channel", "send_lat", 100_000, "one_way"),
        ("rpc", "rpc_lat", 64, "round_trip"),
        ("channel", "read_lat", 4096, "round_trip"),
        ("channel", "atomic_lat", 8, "round_trip"),
    ] {
        let size_arg = size.to_string();
        let v = perf_json(&[
            "--layer",
            layer,
            "-d",
            device,
            "-t",
            test,
            "-n",
            "200",
            "-s",
            &size_arg,
            "--api",
            "async",
            "--progress",
            progress,
        ]);
        assert_header(&v, layer, test, device);
        assert_eq!(v["api"], "async", "{v}");
        assert_eq!(v["mode"], progress, "{v}");
        assert_latency(&v, 200, size, kind);
    }
}

#[test]
fn async_api_on_shm0() {
    async_api("shm0", "caller");
    async_api("shm0", "thread");
}

#[test]
fn async_api_on_tcp0() {
    async_api("tcp0", "caller");
}

#[test]
fn text_report_names_the_layer() {
    let _one_at_a_time = PERF.lock().unwrap_or_else(|e| e.into_inner());
    let out = fabriq(&[
        "perf", "--local", "--layer", "channel", "-d", "shm0", "-n", "20",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("layer channel"), "{stdout}");
    assert!(stdout.contains("one-way latency"), "{stdout}");
    assert!(stdout.contains("p99.9"), "{stdout}");
}

#[test]
fn wrong_layer_and_bad_input_are_clean_errors() {
    for (args, code, needle) in [
        (
            &["perf", "--local", "--layer", "rpc", "-t", "send_lat"][..],
            1,
            "not available at --layer rpc",
        ),
        (
            &["perf", "--local", "--layer", "channel", "-t", "write_lat"][..],
            1,
            "not available at --layer channel",
        ),
        (
            &["perf", "--local", "--layer", "channel", "-t", "rpc_lat"][..],
            1,
            "not available",
        ),
        (&["perf", "--local", "-t", "rpc_rate"][..], 1, "--layer rpc"),
        (
            &["perf", "--local", "-t", "connect_lat"][..],
            1,
            "--layer channel",
        ),
        (
            &["perf", "--local", "--layer", "rpc", "-t", "connect_lat"][..],
            1,
            "not available at --layer rpc",
        ),
        (
            &[
                "perf",
                "--local",
                "--layer",
                "rpc",
                "-t",
                "rpc_rate",
                "--callers",
                "0",
            ][..],
            1,
            "--callers",
        ),
        (
            &[
                "perf", "--local", "--layer", "channel", "-d", "nosuch7", "-n", "5",
            ][..],
            1,
            "nosuch7",
        ),
        (&["perf", "--local", "--layer", "bogus"][..], 2, "bogus"),
        (
            &[
                "perf",
                "--layer",
                "channel",
                "-d",
                "shm0",
                "127.0.0.1:1",
                "-n",
                "5",
            ][..],
            1,
            "127.0.0.1:1",
        ),
        (&["perf", "--layer", "channel"][..], 1, "--local"),
        (
            &[
                "perf", "--local", "--layer", "channel", "-t", "send_bw", "--api", "async",
            ][..],
            1,
            "no async form",
        ),
        (
            &["perf", "--local", "-t", "send_lat", "--api", "async"][..],
            1,
            "--api applies to --layer channel|rpc",
        ),
        (
            &["perf", "--local", "--layer", "channel", "--api", "bogus"][..],
            2,
            "bogus",
        ),
    ] {
        let out = fabriq(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// A client that sends garbage instead of a run gets an error message back, and the one-shot
/// server exits with a failure instead of panicking or hanging.
#[test]
fn middleware_server_refuses_a_malformed_run() {
    let _one_at_a_time = PERF.lock().unwrap_or_else(|e| e.into_inner());
    let mut child = Command::new(env!("CARGO_BIN_EXE_fabriq"))
        .args([
            "perf",
            "--server",
            "--layer",
            "channel",
            "-d",
            "shm0",
            "--bind",
            "127.0.0.1:0",
            "--once",
            "--quiet",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    let addr = line.trim().rsplit(' ').next().expect("address").to_string();
    assert!(addr.parse::<std::net::SocketAddr>().is_ok(), "{line:?}");

    let ep = fabriq::Endpoint::new(fabriq::Config {
        device: "shm0".into(),
        ..fabriq::Config::default()
    })
    .expect("endpoint");
    let ch = ep.connect(addr.as_str()).expect("connect");
    ch.send(b"\xffnot json").expect("send");
    let reply = ch.recv_timeout(HANG).expect("the server's answer");
    let v: Value = serde_json::from_slice(&reply).expect("a JSON control message");
    assert_eq!(v["op"], "error", "{v}");
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.contains("bad control message")),
        "{v}"
    );

    let deadline = std::time::Instant::now() + HANG;
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "server did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(1));
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read as _;
        let _ = e.read_to_string(&mut stderr);
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}
