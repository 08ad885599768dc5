//! Connect latency through `Endpoint` for several handshake busy-poll budgets
//! (`Config::handshake_spin_us`), measured side by side in one process: one endpoint pair per
//! (mode, budget), the pairs take turns in blocks of rounds, so load that comes and goes on
//! the host falls on every configuration alike. Prints p10 / p50 / p90 per configuration, for
//! "both" (`connect` plus the server's `accept` returning) and "client" (`connect` returning).
//!
//! Modes: **cold** (`qp_cache_size = 0`, `reuse_control_streams = false`: a new QP on both
//! sides and a new TCP control stream per connect) and **cached** (defaults: the QP and the
//! control stream of the previous, closed connection are reused on both sides). Closing and
//! the return of the QPs are outside the timed part.
//!
//! `cargo run --release -p fabriq --example connect_spin_ab -- [device] [rounds] [budgets]`,
//! e.g. `-- shm0 2000 0,50,200`. `AB_BLOCK` (default 50): rounds per turn; `AB_GAP_US`: an
//! untimed pause before each connect (e.g. 2000: every spin budget has run out and the
//! server's acceptor sleeps when the hello arrives); `AB_SETTLE_US`: after the QPs of a round
//! are back, yield this long before the next round's untimed gap and connect (the close's last
//! frames are handled and every thread of both endpoints is back asleep, as in a connect after
//! a pause, without the thread of the test going to sleep itself); `AB_MODES` =
//! `cold,cached` (default); `AB_IDLE_SPIN_US`: the workers' `idle_spin_us` (default: the `Config` default);
//! `AB_MARK=1`: a `getppid` system call just before each timed part starts and just after it
//! ends, so that a system-call trace can tell the connect's calls from the rest
//! (`bench/connect_syscalls.sh`).

use std::time::{Duration, Instant};

use fabriq::{Config, Endpoint};

const TIMEOUT: Duration = Duration::from_secs(10);

struct Pair {
    label: String,
    server: Endpoint,
    client: Endpoint,
    listener: fabriq::Listener,
    cached: bool,
    rounds: u64,
    both: Vec<f64>,
    client_only: Vec<f64>,
}

fn pair(device: &str, cached: bool, spin_us: u64) -> Result<Pair, String> {
    let cfg = Config {
        device: device.into(),
        qp_cache_size: if cached { 64 } else { 0 },
        reuse_control_streams: cached,
        handshake_spin_us: Some(spin_us),
        ..Config::default()
    };
    let mut cfg = cfg;
    if let Some(us) = std::env::var("AB_IDLE_SPIN_US")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        cfg.idle_spin_us = us;
    }
    let server = Endpoint::new(cfg.clone()).map_err(|e| e.to_string())?;
    let client = Endpoint::new(cfg).map_err(|e| e.to_string())?;
    let listener = server.listen("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(Pair {
        label: format!(
            "{device} {:6} spin {spin_us:4} us",
            if cached { "cached" } else { "cold" }
        ),
        server,
        client,
        listener,
        cached,
        rounds: 0,
        both: Vec::new(),
        client_only: Vec::new(),
    })
}

fn round(
    p: &mut Pair,
    gap: Option<Duration>,
    settle: Option<Duration>,
    mark: bool,
) -> Result<(), String> {
    if let Some(g) = gap {
        std::thread::sleep(g);
    }
    if mark {
        // A system call of its own (`getppid`, which nothing else here calls) opens the timed part in a
        // system-call trace.
        std::hint::black_box(std::os::unix::process::parent_id());
    }
    let start = Instant::now();
    let c = p
        .client
        .connect(p.listener.local_addr())
        .map_err(|e| e.to_string())?;
    let connected = start.elapsed();
    let s = p
        .listener
        .accept_timeout(TIMEOUT)
        .map_err(|e| e.to_string())?;
    let both = start.elapsed();
    if mark {
        std::hint::black_box(std::os::unix::process::parent_id());
    }
    p.rounds += 1;
    p.client_only.push(connected.as_secs_f64() * 1e6);
    p.both.push(both.as_secs_f64() * 1e6);
    drop(c);
    drop(s);
    // Both QPs are back (cached, or destroyed without a cache) before the next round.
    let (cached, rounds) = (p.cached, p.rounds);
    for ep in [&p.client, &p.server] {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let st = ep.conn_stats();
            if (cached && st.qps_cached >= 1) || (!cached && st.qps_dropped >= rounds) {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("{}: counters stuck at {st:?}", p.label));
            }
            std::thread::yield_now();
        }
    }
    if let Some(settle) = settle {
        let until = Instant::now() + settle;
        while Instant::now() < until {
            std::thread::yield_now();
        }
    }
    Ok(())
}

fn percentiles(v: &mut [f64]) -> String {
    v.sort_by(f64::total_cmp);
    let at = |q: usize| v.get(v.len() * q / 100).copied().unwrap_or(f64::NAN);
    format!("p10 {:6.1} p50 {:6.1} p90 {:6.1}", at(10), at(50), at(90))
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let device = args.get(1).cloned().unwrap_or_else(|| "shm0".into());
    let rounds: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2000);
    let budgets: Vec<u64> = args
        .get(3)
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![0, 50, 200]);
    let env = |k: &str| std::env::var(k).ok();
    let block: u64 = env("AB_BLOCK")
        .and_then(|v| v.parse().ok())
        .unwrap_or(50)
        .max(1);
    let gap = env("AB_GAP_US")
        .and_then(|v| v.parse().ok())
        .map(Duration::from_micros);
    let settle = env("AB_SETTLE_US")
        .and_then(|v| v.parse().ok())
        .map(Duration::from_micros);
    let mark = env("AB_MARK").is_some_and(|v| v == "1");
    let modes = env("AB_MODES").unwrap_or_else(|| "cold,cached".into());
    let mut pairs = Vec::new();
    for mode in modes.split(',') {
        for &b in &budgets {
            pairs.push(pair(&device, mode.trim() == "cached", b)?);
        }
    }
    for _ in 0..rounds.div_ceil(block) {
        for p in pairs.iter_mut() {
            for _ in 0..block {
                round(p, gap, settle, mark)?;
            }
        }
    }
    for p in pairs.iter_mut() {
        println!(
            "{}: both {} | client {}",
            p.label,
            percentiles(&mut p.both),
            percentiles(&mut p.client_only)
        );
    }
    Ok(())
}
