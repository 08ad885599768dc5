//! An async ping-pong between two endpoints of one process on shm0: a task sends 8 bytes
//! with `send_async` and awaits the echo with `recv_async`, another task echoes; prints the
//! round trip's p50 / p99 / max. With a gap, the sending task sleeps that long before each
//! round, so both tasks go to sleep on their notifications between messages (past the idle
//! budget) instead of finding the next one while they look.
//!
//! `cargo run --release -p fabriq --example async_pingpong -- [thread|caller] [ROUNDS] [GAP_US]`
//! (defaults: thread, 20 000, 0).
use std::time::{Duration, Instant};

use fabriq::{Config, Endpoint, Progress};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let progress = match args.next().as_deref() {
        None | Some("thread") => Progress::Thread,
        Some("caller") => Progress::Caller,
        Some(other) => return Err(format!("progress mode {other:?}: thread or caller").into()),
    };
    let rounds: usize = match args.next() {
        Some(n) => n.parse()?,
        None => 20_000,
    };
    let gap_us: u64 = match args.next() {
        Some(n) => n.parse()?,
        None => 0,
    };
    if rounds == 0 {
        return Err("ROUNDS must be at least 1".into());
    }
    let cfg = Config {
        device: "shm0".into(),
        progress,
        ..Config::default()
    };
    let a = Endpoint::new(cfg.clone())?;
    let b = Endpoint::new(cfg)?;
    let l = b.listen("127.0.0.1:0")?;
    let ca = a.connect(l.local_addr())?;
    let cb = l.accept_timeout(Duration::from_secs(5))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    const WARMUP: usize = 100;
    let echo = rt.spawn(async move {
        for _ in 0..rounds + WARMUP {
            let m = cb.recv_async().await?;
            cb.send_async(&m).await?;
        }
        Ok::<_, fabriq::ChannelError>(cb)
    });
    let mut us = rt.block_on(async move {
        let mut us = Vec::with_capacity(rounds);
        for i in 0..rounds + WARMUP {
            if gap_us > 0 {
                tokio::time::sleep(Duration::from_micros(gap_us)).await;
            }
            let t = Instant::now();
            ca.send_async(&[1u8; 8]).await?;
            let m = ca.recv_async().await?;
            if m.len() != 8 {
                return Err(format!("echo of {} bytes, not 8", m.len()).into());
            }
            if i >= WARMUP {
                us.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        Ok::<_, Box<dyn std::error::Error>>(us)
    })?;
    drop(rt.block_on(echo)??);
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q) as usize];
    println!(
        "{progress:?}, gap {gap_us} µs: {rounds} async round trips, p50 {:.2} µs, p99 {:.2} µs, \
         max {:.0} µs",
        at(0.5),
        at(0.99),
        at(1.0)
    );
    Ok(())
}
