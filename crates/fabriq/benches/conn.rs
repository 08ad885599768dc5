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
//! A second group, `endpoint_connect`, measures the same at the middleware level: one
//! iteration is `Endpoint::connect` plus the server's `Listener::accept` returning the channel
//! (hello, receive rings posted on both sides, RTR/RTS, Ready, adoption by a worker); the close
//! of both channels and the return of their QPs (drained, reset) happen outside the timed part.
//! **cold**: `qp_cache_size = 0`, `reuse_control_streams = false`; **cached**: defaults;
//! **pooled**: defaults with one other channel to the peer kept open, so the connect finds the
//! pooled connection and only opens a stream on it (no handshake; the server's `accept` returns
//! once the stream's `STREAM_OPEN` arrived); **pooled_async**: the same through
//! `Endpoint::connect_async`, each connect a `block_on` of a current-thread tokio runtime.
//! **cached_idle**: cached, with 2 ms of idleness
//! (untimed) before each connect, so that every busy-poll budget (the handshake's
//! `handshake_spin_us`, the workers' `idle_spin_us`) has run out and the server's acceptor
//! thread sleeps when the hello arrives; plain **cached** rounds follow each other at once,
//! the way a burst of reconnects would. `FABRIQ_BENCH_HANDSHAKE_SPIN_US` sets the handshake's
//! busy-poll budget in `connect` and `endpoint_connect` (default: the configurations' default,
//! 50 µs on a host of 2 or more CPUs, else 0).
//!
//! A third group, `qp_phases`, times the verbs steps of a connect on one in-process QP pair, to
//! show where the time goes: creating a QP, RESET → INIT, and INIT → RTR → RTS of both QPs. A
//! fourth, `control_floor`, is one loopback TCP round trip between two threads, and one over a
//! Unix stream socket pair (a local control stream), with blocking reads (each hop wakes a
//! sleeping thread) and with busy-polled non-blocking reads: the least each control-stream
//! exchange of a handshake costs.
//!
//! `cargo bench -p fabriq --bench conn` (`-- endpoint_connect` for one group)

use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use fabriq::conn::{ConnConfig, ConnError, ConnManager, ConnStats, ListenerCloser};
use fabriq::{Config, Endpoint};
use fabriq_verbs::{AccessFlags, Context, QpAttr, QpInitAttr, QueuePair};

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

/// `FABRIQ_BENCH_HANDSHAKE_SPIN_US`, if set.
fn spin_override_us() -> Option<u64> {
    std::env::var("FABRIQ_BENCH_HANDSHAKE_SPIN_US")
        .ok()
        .and_then(|v| v.parse().ok())
}

fn rig(device: &str, cached: bool) -> Result<Rig, String> {
    let mut cfg = if cached {
        ConnConfig::default()
    } else {
        ConnConfig {
            qp_cache_capacity: 0,
            reuse_control_streams: false,
            ..ConnConfig::default()
        }
    };
    if let Some(us) = spin_override_us() {
        cfg.handshake_spin = Duration::from_micros(us);
    }
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

/// Wait (bounded) until `cond` holds on `ep`'s connection counters.
fn wait_stats(ep: &Endpoint, cond: impl Fn(&ConnStats) -> bool) -> Result<(), String> {
    let deadline = Instant::now() + TIMEOUT;
    while !cond(&ep.conn_stats()) {
        if Instant::now() > deadline {
            return Err(format!("counters stuck at {:?}", ep.conn_stats()));
        }
        std::thread::yield_now();
    }
    Ok(())
}

/// One connect + accept, timed; then both channels closed and their QPs retired (untimed).
/// What a round of `endpoint_connect` does.
struct RoundKind<'a> {
    /// QPs go back to the cache (else: destroyed).
    cached: bool,
    /// Another channel holds the connection: nothing to wait for after the close.
    pooled: bool,
    /// Timed until `connect` returns (else: until the server's `accept` returns too).
    client_only: bool,
    /// Connect through `connect_async` on this runtime.
    rt: Option<&'a tokio::runtime::Runtime>,
}

fn endpoint_round(
    server: &Endpoint,
    client: &Endpoint,
    listener: &fabriq::Listener,
    round: u64,
    kind: &RoundKind<'_>,
) -> Result<Duration, String> {
    let RoundKind {
        cached,
        pooled,
        client_only,
        rt,
    } = *kind;
    let start = Instant::now();
    let c = match rt {
        Some(rt) => rt.block_on(client.connect_async(listener.local_addr())),
        None => client.connect(listener.local_addr()),
    }
    .map_err(|e| e.to_string())?;
    let connected = start.elapsed();
    let s = listener
        .accept_timeout(TIMEOUT)
        .map_err(|e| e.to_string())?;
    let took = if client_only {
        connected
    } else {
        start.elapsed()
    };
    drop(c);
    drop(s);
    if pooled {
        // The connection stays (another channel holds it): nothing to wait for.
        return Ok(took);
    }
    // Both QPs are back (cached, or destroyed when there is no cache) before the next round.
    let back = |st: &ConnStats| {
        if cached {
            st.qps_cached >= 1
        } else {
            st.qps_dropped >= round
        }
    };
    wait_stats(client, back)?;
    wait_stats(server, back)?;
    Ok(took)
}

fn endpoint_bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("endpoint_connect");
    g.sample_size(30);
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_millis(500));
    for device in devices() {
        for (mode, cached, pooled, idle, asynchronous) in [
            ("cold", false, false, None, false),
            ("cached", true, false, None, false),
            (
                "cached_idle",
                true,
                false,
                Some(Duration::from_millis(2)),
                false,
            ),
            ("pooled", true, true, None, false),
            ("pooled_async", true, true, None, true),
        ] {
            let rt = match asynchronous {
                true => match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => Some(rt),
                    Err(e) => {
                        eprintln!("endpoint connect bench: {device}: skipped: runtime: {e}");
                        continue;
                    }
                },
                false => None,
            };
            let mut cfg = Config {
                device: device.clone(),
                qp_cache_size: if cached { 64 } else { 0 },
                reuse_control_streams: cached,
                ..Config::default()
            };
            if let Some(us) = spin_override_us() {
                cfg.handshake_spin_us = Some(us);
            }
            let (server, client) = match (Endpoint::new(cfg.clone()), Endpoint::new(cfg)) {
                (Ok(s), Ok(c)) => (s, c),
                (Err(e), _) | (_, Err(e)) => {
                    eprintln!("endpoint connect bench: {device}: skipped: {e}");
                    continue;
                }
            };
            let listener = match server.listen("127.0.0.1:0") {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("endpoint connect bench: {device}: skipped: {e}");
                    continue;
                }
            };
            // Pooled: one channel stays open for the whole group, holding the connection.
            let keeper = if pooled {
                match client
                    .connect(listener.local_addr())
                    .and_then(|c| listener.accept_timeout(TIMEOUT).map(|s| (c, s)))
                {
                    Ok(pair) => Some(pair),
                    Err(e) => {
                        eprintln!("endpoint connect bench: {device}: skipped: {e}");
                        continue;
                    }
                }
            } else {
                None
            };
            let mut round = 0u64;
            let mut failures = 0u64;
            // `_both`: until both ends hold their channel; `_client`: until `connect` returns.
            for (what, client_only) in [("both", false), ("client", true)] {
                g.bench_function(format!("{device}_{mode}_{what}"), |b| {
                    b.iter_custom(|iters| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            round += 1;
                            if let Some(gap) = idle {
                                // Untimed: every busy-poll budget runs out.
                                std::thread::sleep(gap);
                            }
                            let kind = RoundKind {
                                cached,
                                pooled,
                                client_only,
                                rt: rt.as_ref(),
                            };
                            let r = endpoint_round(&server, &client, &listener, round, &kind);
                            match r {
                                Ok(t) => total += t,
                                Err(e) => {
                                    failures += 1;
                                    if failures == 1 {
                                        eprintln!("endpoint connect bench: {device} {mode}: {e}");
                                    }
                                }
                            }
                        }
                        total
                    })
                });
            }
            eprintln!(
                "endpoint connect bench: {device} {mode}: {failures} failed; client {:?}; server {:?}; pool {:?}",
                client.conn_stats(),
                server.conn_stats(),
                client.pool_stats()
            );
            drop(keeper);
        }
    }
    g.finish();
}

/// Two QPs of one context, in INIT, ready to connect to each other.
fn qp_pair(ctx: &Context) -> Result<(QueuePair, QueuePair), String> {
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let cq = ctx.create_cq(256).map_err(|e| e.to_string())?;
    let a = pd
        .create_qp(&QpInitAttr::new(&cq))
        .map_err(|e| e.to_string())?;
    let b = pd
        .create_qp(&QpInitAttr::new(&cq))
        .map_err(|e| e.to_string())?;
    Ok((a, b))
}

fn to_rts(a: &QueuePair, b: &QueuePair) {
    let (ea, eb) = (a.endpoint(), b.endpoint());
    // The handshake's order: the server's QP (b) reaches RTS before the client's (a) moves.
    b.modify(&QpAttr::rtr(ea)).expect("rtr");
    b.modify(&QpAttr::rts()).expect("rts");
    a.modify(&QpAttr::rtr(eb)).expect("rtr");
    a.modify(&QpAttr::rts()).expect("rts");
}

fn reset_init(a: &QueuePair, b: &QueuePair) {
    for q in [a, b] {
        q.modify(&QpAttr::reset()).expect("reset");
        q.modify(&QpAttr::init(AccessFlags::all())).expect("init");
    }
}

fn phases_bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("qp_phases");
    g.sample_size(30);
    g.measurement_time(Duration::from_secs(2));
    g.warm_up_time(Duration::from_millis(300));
    for device in devices() {
        let ctx = match Context::open(&device) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("qp phases bench: {device}: skipped: {e}");
                continue;
            }
        };
        let Ok(pd) = ctx.alloc_pd() else { continue };
        let Ok(cq) = ctx.create_cq(256) else { continue };
        g.bench_function(format!("{device}_create_qp"), |b| {
            b.iter(|| pd.create_qp(&QpInitAttr::new(&cq)).expect("create"))
        });
        // A channel's default receive ring (64 slots of 8 KiB + header), registered per connect.
        g.bench_function(format!("{device}_register_ring_mr"), |b| {
            b.iter(|| {
                pd.alloc_mr(64 * (8192 + 32), AccessFlags::LOCAL_WRITE)
                    .expect("ring")
            })
        });
        let (qa, qb) = match qp_pair(&ctx) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("qp phases bench: {device}: skipped: {e}");
                continue;
            }
        };
        reset_init(&qa, &qb);
        g.bench_function(format!("{device}_reset_init_pair"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    to_rts(&qa, &qb);
                    let t = Instant::now();
                    reset_init(&qa, &qb);
                    total += t.elapsed();
                }
                total
            })
        });
        g.bench_function(format!("{device}_rtr_rts_pair"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    to_rts(&qa, &qb);
                    total += t.elapsed();
                    reset_init(&qa, &qb);
                }
                total
            })
        });
    }
    g.finish();
}

/// The floor of a handshake step: one round trip of 64 bytes over a loopback TCP connection
/// between two threads with blocking reads (each hop wakes a sleeping reader), the way the
/// hello / hello-ack / ready exchange runs on a control stream.
fn control_floor_bench(c: &mut Criterion) {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let mut g = c.benchmark_group("control_floor");
    g.measurement_time(Duration::from_secs(2));

    // Busy-polled reads and writes of a non-blocking socket (yielding between tries), as the
    // handshake does within its spin budget.
    fn spin_read(s: &mut impl Read, b: &mut [u8]) -> bool {
        let mut off = 0;
        while off < b.len() {
            match s.read(&mut b[off..]) {
                Ok(0) => return false,
                Ok(n) => off += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(_) => return false,
            }
        }
        true
    }
    fn spin_write(s: &mut impl Write, b: &[u8]) -> bool {
        let mut off = 0;
        while off < b.len() {
            match s.write(&b[off..]) {
                Ok(n) => off += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(_) => return false,
            }
        }
        true
    }
    fn round(s: &mut (impl Read + Write), b: &mut [u8; 64], spin: bool) -> bool {
        if spin {
            spin_write(s, b) && spin_read(s, b)
        } else {
            s.write_all(b).is_ok() && s.read_exact(b).is_ok()
        }
    }
    fn echo(mut s: impl Read + Write, spin: bool) {
        let mut b = [0u8; 64];
        while if spin {
            spin_read(&mut s, &mut b) && spin_write(&mut s, &b)
        } else {
            s.read_exact(&mut b).is_ok() && s.write_all(&b).is_ok()
        } {}
    }
    // A loopback TCP pair with an echoing thread on the far end, both ends blocking or both
    // busy-polling.
    fn tcp_pair(spin: bool) -> Option<(std::net::TcpStream, std::thread::JoinHandle<()>)> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
        let addr = listener.local_addr().ok()?;
        let far = std::thread::spawn(move || {
            let Ok((s, _)) = listener.accept() else {
                return;
            };
            let _ = s.set_nodelay(true);
            let _ = s.set_nonblocking(spin);
            echo(s, spin);
        });
        let s = std::net::TcpStream::connect(addr).ok()?;
        let _ = s.set_nodelay(true);
        let _ = s.set_nonblocking(spin);
        Some((s, far))
    }
    // The same over a Unix stream socket pair: what a local control stream costs
    // (`conn::stream`).
    fn unix_pair(spin: bool) -> Option<(UnixStream, std::thread::JoinHandle<()>)> {
        let (a, b) = UnixStream::pair().ok()?;
        let _ = a.set_nonblocking(spin);
        let _ = b.set_nonblocking(spin);
        let far = std::thread::spawn(move || echo(b, spin));
        Some((a, far))
    }
    // One benchmark per transport and mode: 64-byte round trips to the echoing far end.
    fn bench_pair<S: Read + Write>(
        g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        name: &str,
        spin: bool,
        pair: Option<(S, std::thread::JoinHandle<()>)>,
    ) {
        let Some((mut s, far)) = pair else {
            return;
        };
        let mut b = [0u8; 64];
        g.bench_function(name, |bench| {
            bench.iter(|| assert!(round(&mut s, &mut b, spin), "round trip"))
        });
        drop(s);
        let _ = far.join();
    }
    for (mode, spin) in [("blocking", false), ("spinning", true)] {
        bench_pair(
            &mut g,
            &format!("{mode}_tcp_round_trip_64B"),
            spin,
            tcp_pair(spin),
        );
        bench_pair(
            &mut g,
            &format!("{mode}_unix_round_trip_64B"),
            spin,
            unix_pair(spin),
        );
    }
    g.finish();
}

criterion_group!(
    benches,
    bench,
    endpoint_bench,
    phases_bench,
    control_floor_bench
);
criterion_main!(benches);
