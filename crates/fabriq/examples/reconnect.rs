//! Close and at once connect again, in one process: the latency of `connect` plus `accept` when
//! a connection to the same listener was closed just before (the QP and the control stream of
//! the previous one reused), in either progress mode.
//!
//! `cargo run --release -p fabriq --example reconnect -- [caller|thread] [device] [rounds]`
//! (defaults: caller, shm0, 200). Prints p50 / p90 / max, how many took 5 ms or more, and the
//! client's QP cache hits.
use std::time::{Duration, Instant};

use fabriq::{Config, Endpoint, Progress};

const WAIT: Duration = Duration::from_secs(10);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let progress = match args.next().as_deref() {
        None | Some("caller") => Progress::Caller,
        Some("thread") => Progress::Thread,
        Some(other) => return Err(format!("progress mode {other:?}: caller or thread").into()),
    };
    let device = args.next().unwrap_or_else(|| "shm0".into());
    let rounds: usize = match args.next() {
        Some(n) => n.parse()?,
        None => 200,
    };
    let cfg = Config {
        device: device.clone(),
        progress,
        ..Config::default()
    };
    let server = Endpoint::new(cfg.clone())?;
    let client = Endpoint::new(cfg)?;
    let listener = server.listen("127.0.0.1:0")?;
    let mut us = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        let c = client.connect(listener.local_addr())?;
        let s = listener.accept_timeout(WAIT)?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
        c.send(b"x")?;
        s.recv_timeout(WAIT)?;
    }
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q) as usize];
    let slow = us.iter().filter(|&&u| u >= 5_000.0).count();
    println!(
        "{device} {progress:?}: {rounds} reconnects, p50 {:.0} µs, p90 {:.0} µs, max {:.0} µs; \
         {slow} took 5 ms or more; QP cache hits {}",
        at(0.5),
        at(0.9),
        at(1.0),
        client.conn_stats().qp_cache_hits
    );
    Ok(())
}
