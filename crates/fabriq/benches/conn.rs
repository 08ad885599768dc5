//! Connect cost on loopback, per provider: **cold** (no QP cache, no kept control stream: a new
//! QP on both sides and a new TCP control connection per connect) against **cached** (the QP
//! comes from the cache and the control stream is reused, on both sides). One iteration is a
//! full handshake to RTS on both sides plus the release of the client's QP; the server thread
//! accepts and releases in a loop.
//!
//! Devices: `FABRIQ_BENCH_DEVICES` (comma-separated), default `tcp0,shm0`; one that does not
//! open is skipped. Criterion writes each median to
//! `target/criterion/connect/<device>_<mode>/new/estimates.json`.
//!
//! `cargo bench -p fabriq --bench conn`

use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use fabriq::conn::{ConnConfig, ConnError, ConnManager, ListenerCloser};
use fabriq_verbs::Context;

const TIMEOUT: Duration = Duration::from_secs(10);

struct Rig {
    client: ConnManager,
    addr: SocketAddr,
    closer: ListenerCloser,
    server: Option<JoinHandle<()>>,
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.closer.close();
        if let Some(h) = self.server.take() {
            let _ = h.join();
        }
    }
}

fn manager(device: &str, cfg: ConnConfig) -> Result<ConnManager, String> {
    let ctx = Context::open(device).map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let cq = ctx.create_cq(4096).map_err(|e| e.to_string())?;
    ConnManager::new(&pd, &cq, cfg).map_err(|e| e.to_string())
}

fn rig(device: &str, cached: bool) -> Result<Rig, String> {
    let cfg = if cached {
        ConnConfig::default()
    } else {
        ConnConfig {
            qp_cache_capacity: 0,
            reuse_control_streams: false,
            ..ConnConfig::default()
        }
    };
    let server_mgr = manager(device, cfg.clone())?;
    let client = manager(device, cfg)?;
    let listener = server_mgr
        .listen("127.0.0.1:0")
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr();
    let closer = listener.closer();
    let server = std::thread::spawn(move || loop {
        match listener.accept() {
            Ok(est) => server_mgr.release(est),
            Err(ConnError::Closed) => break,
            Err(e) => eprintln!("connect bench server: {e}"),
        }
    });
    let rig = Rig {
        client,
        addr,
        closer,
        server: Some(server),
    };
    // Warm up, and check this mode works at all on this device.
    for _ in 0..3 {
        let est = rig
            .client
            .connect(rig.addr, TIMEOUT)
            .map_err(|e| e.to_string())?;
        rig.client.release(est);
    }
    Ok(rig)
}

fn devices() -> Vec<String> {
    std::env::var("FABRIQ_BENCH_DEVICES")
        .unwrap_or_else(|_| "tcp0,shm0".into())
        .split(',')
        .map(|d| d.trim().to_string())
        .filter(|d| !d.is_empty())
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("connect");
    g.sample_size(30);
    g.measurement_time(Duration::from_secs(4));
    g.warm_up_time(Duration::from_millis(500));
    for device in devices() {
        for (mode, cached) in [("cold", false), ("cached", true)] {
            let rig = match rig(&device, cached) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("connect bench: {device} {mode}: skipped: {e}");
                    continue;
                }
            };
            let mut failures = 0u64;
            g.bench_function(format!("{device}_{mode}"), |b| {
                b.iter(|| match rig.client.connect(rig.addr, TIMEOUT) {
                    Ok(est) => rig.client.release(est),
                    Err(e) => {
                        failures += 1;
                        if failures == 1 {
                            eprintln!("connect bench: {device} {mode}: {e}");
                        }
                    }
                })
            });
            let s = rig.client.stats();
            eprintln!("connect bench: {device} {mode}: {failures} failed; client stats {s:?}");
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
