//! A randomized soak of the middleware between two endpoints of one process, every feature at
//! once: client threads open channels over the pooled connections of two workers, send bursts
//! of messages of random sizes around the protocol's edges (the bytes held in place, the eager
//! threshold, the READ chunk, 1 MiB) and check every echo byte for byte and in order; close
//! channels with echoes still on their way; have the echoing side close a channel after what it
//! echoed (every echo is read, then `PeerGone`); change a live connection's thresholds
//! mid-burst; make RPC calls; run fetch-and-add on a region the server exposed. Any error, lost,
//! duplicated, reordered or corrupted message, or a wait past `STALL`, fails the run.
//!
//! Each case runs `FABRIQ_SOAK_SECS` seconds (default 2) from seed `FABRIQ_SOAK_SEED` (default
//! 1); other `FABRIQ_*` variables change the configuration, e.g.
//! `FABRIQ_RX_SLOTS=4 FABRIQ_STREAM_WINDOW=4` for flow control at its tightest:
//! `FABRIQ_SOAK_SECS=60 cargo test --release -p fabriq --test soak -- --nocapture`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fabriq::{
    Channel, ChannelError, Config, Endpoint, Progress, RegionDescriptor, Rpc, Thresholds,
};

/// Longer than any wait of a working run, on a loaded 2-CPU machine too.
const STALL: Duration = Duration::from_secs(30);
/// A message asking the echoing side to close the channel (echoing nothing for it).
const BYE: &[u8] = b"SOAKBYE";
/// RPC method that returns the descriptor of the server's exposed region.
const REGION: &str = "region";
/// Words of the exposed region: one per client thread.
const WORDS: u64 = 512;

type Result<T> = std::result::Result<T, String>;

/// xorshift64*: a small generator, seeded per thread, so that a seed replays a run's choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A size at one of the protocol's edges (± 2), a small one, or any up to 2 MiB.
fn size(rng: &mut Rng, eager: usize) -> usize {
    let edges = [0usize, 24, eager, 64 << 10, 1 << 20];
    match rng.below(4) {
        0 => rng.below(2 << 20) as usize,
        1 => rng.below(64) as usize,
        _ => (edges[rng.below(edges.len() as u64) as usize] + rng.below(5) as usize)
            .saturating_sub(2),
    }
}

/// The bytes of message `n` of stream `tag`: a misplaced or truncated message never matches.
fn payload(tag: u64, n: u64, len: usize) -> Vec<u8> {
    let seed = tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ n.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (0..len)
        .map(|i| (seed >> ((i % 8) * 8)) as u8 ^ (i as u8).wrapping_mul(31) ^ len as u8)
        .collect()
}

#[derive(Default)]
struct Counts {
    channels: AtomicU64,
    echoes: AtomicU64,
    calls: AtomicU64,
    atomics: AtomicU64,
    early_closes: AtomicU64,
    peer_closes: AtomicU64,
    threshold_changes: AtomicU64,
}

/// The accepting side of one channel: echo every message until the peer closes, a `BYE`
/// arrives (drop the channel) or the run stops.
fn echo(ch: Channel, stop: &AtomicBool) -> Result<()> {
    loop {
        match ch.recv_timeout(Duration::from_millis(100)) {
            Ok(m) if m[..] == *BYE => return Ok(()),
            Ok(m) => match ch.send_timeout(&m, STALL) {
                Ok(()) | Err(ChannelError::PeerGone | ChannelError::Closed) => {}
                Err(e) => return Err(format!("echo: send: {e}")),
            },
            Err(ChannelError::Timeout) if !stop.load(Ordering::Relaxed) => {}
            Err(ChannelError::Timeout | ChannelError::PeerGone | ChannelError::Closed) => {
                return Ok(())
            }
            Err(e) => return Err(format!("echo: recv: {e}")),
        }
    }
}

/// Read echo `n` of stream `tag` and check it.
fn check(ch: &Channel, tag: u64, n: u64, len: usize, counts: &Counts) -> Result<()> {
    let m = ch
        .recv_timeout(STALL)
        .map_err(|e| format!("echo {n} of {tag:#x}: {e}"))?;
    if m.len() != len || m[..] != payload(tag, n, len)[..] {
        return Err(format!(
            "echo {n} of {tag:#x}: {} bytes where {len} were sent, or other bytes",
            m.len()
        ));
    }
    counts.echoes.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Fetch-and-add on this thread's word of the server's region: each add sees the one before.
fn atomics(ch: Channel, rng: &mut Rng, word: u64, counts: &Counts) -> Result<()> {
    let desc = Rpc::new(ch.clone())
        .call(REGION, &[], STALL)
        .map_err(|e| format!("region call: {e}"))?;
    let desc = RegionDescriptor::from_bytes(&desc).ok_or("region: not a descriptor")?;
    let region = ch.remote_region(desc);
    let mut last: Option<u64> = None;
    for _ in 0..1 + rng.below(64) {
        let before = region
            .fetch_and_add(8 * word, 1)
            .map_err(|e| format!("fetch_and_add: {e}"))?;
        if last.is_some_and(|l| before != l + 1) {
            return Err(format!("fetch_and_add returned {before} after {last:?}"));
        }
        last = Some(before);
        counts.atomics.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

fn calls(ch: Channel, rng: &mut Rng, tag: u64, eager: usize, counts: &Counts) -> Result<()> {
    let rpc = Rpc::new(ch);
    for i in 0..1 + rng.below(32) {
        let req = payload(tag, i, size(rng, eager).min(256 << 10));
        let got = rpc
            .call("echo", &req, STALL)
            .map_err(|e| format!("call {i} of {tag:#x}: {e}"))?;
        if got != req {
            return Err(format!("call {i} of {tag:#x}: the reply differs"));
        }
        counts.calls.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// One burst of messages on a new channel, its echoes checked; the channel then ends one of
/// three ways: every echo read, closed with echoes on their way, or closed by the peer.
fn burst(a: &Endpoint, ch: Channel, rng: &mut Rng, tag: u64, counts: &Counts) -> Result<()> {
    let cfg = a.config();
    let eager = cfg.eager_max.unwrap_or(4096) as usize;
    let n = 1 + rng.below(64);
    // Messages out before the first echo is read: at most half the stream window, or both
    // ends could wait for the other to read (as with any flow-controlled stream).
    let depth = 1 + rng.below(16.min(u64::from(cfg.stream_window) / 2));
    // A close that does not linger may end rendezvous messages the peer is still pulling
    // (which it reports as a failed READ): then every echo is read before the close.
    let read_all = cfg.close_linger_ms == 0 || rng.below(5) != 0;
    let peer_closes = read_all && rng.below(4) == 0;
    let change_at = (rng.below(4) == 0).then(|| rng.below(n));
    let mut lens = VecDeque::new();
    let mut read = 0u64;
    for i in 0..n {
        if change_at == Some(i) {
            ch.set_thresholds(Thresholds {
                eager_max: [256, 1024, 2048, 4096][rng.below(4) as usize],
                chunk_size: [4096, 16 << 10, 64 << 10, 256 << 10][rng.below(4) as usize],
                reads_in_flight: 1 + rng.below(16) as u32,
            });
            counts.threshold_changes.fetch_add(1, Ordering::Relaxed);
        }
        let len = size(rng, eager);
        ch.send_timeout(&payload(tag, i, len), STALL)
            .map_err(|e| format!("send {i} of {tag:#x}: {e}"))?;
        lens.push_back(len);
        while lens.len() as u64 >= depth {
            check(&ch, tag, read, lens.pop_front().unwrap_or(0), counts)?;
            read += 1;
        }
    }
    if !read_all {
        counts.early_closes.fetch_add(1, Ordering::Relaxed);
        return Ok(());
    }
    if peer_closes {
        ch.send_timeout(BYE, STALL)
            .map_err(|e| format!("bye of {tag:#x}: {e}"))?;
    }
    while let Some(len) = lens.pop_front() {
        check(&ch, tag, read, len, counts)?;
        read += 1;
    }
    if peer_closes {
        // Every echo was read: the next receive reports the close.
        match ch.recv_timeout(STALL) {
            Err(ChannelError::PeerGone) => {}
            other => {
                return Err(format!(
                    "after the peer closed {tag:#x}: {:?} instead of PeerGone",
                    other.map(|m| m.len())
                ))
            }
        }
        counts.peer_closes.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

fn client(
    a: &Endpoint,
    addr: SocketAddr,
    seed: u64,
    until: Instant,
    counts: &Counts,
) -> Result<()> {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let eager = a.config().eager_max.unwrap_or(4096) as usize;
    let mut tag = seed << 32;
    // Every kind of step first, however short the run; then at random.
    let mut kinds = [0, 1, 3].into_iter();
    loop {
        let kind = match kinds.next() {
            Some(k) => k,
            None if Instant::now() < until => rng.below(8),
            None => return Ok(()),
        };
        tag += 1;
        let ch = a.connect(addr).map_err(|e| format!("connect: {e}"))?;
        counts.channels.fetch_add(1, Ordering::Relaxed);
        match kind {
            0 => atomics(ch, &mut rng, seed % WORDS, counts)?,
            1 | 2 => calls(ch, &mut rng, tag, eager, counts)?,
            _ => burst(a, ch, &mut rng, tag, counts)?,
        }
    }
}

/// One soak at a time: each loads every CPU of a small machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// One soak on `device` in `progress` mode with `threads` client threads.
fn soak(device: &str, progress: Progress, threads: u64) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let secs: u64 =
        std::env::var("FABRIQ_SOAK_SECS").map_or(2, |s| s.parse().expect("FABRIQ_SOAK_SECS"));
    let seed: u64 =
        std::env::var("FABRIQ_SOAK_SEED").map_or(1, |s| s.parse().expect("FABRIQ_SOAK_SEED"));
    let mut cfg = Config::from_env().expect("FABRIQ_* configuration");
    cfg.device = device.into();
    cfg.progress = progress;
    if std::env::var_os("FABRIQ_WORKERS").is_none() {
        cfg.workers = 2;
    }
    let a = Endpoint::new(cfg.clone()).expect("client endpoint");
    let b = Endpoint::new(cfg).expect("server endpoint");
    b.serve("echo", |req| Ok(req.to_vec()));
    let exposed = b.expose((8 * WORDS) as usize).expect("expose");
    let desc = exposed.descriptor().to_bytes().to_vec();
    b.serve(REGION, move |_| Ok(desc.clone()));
    let listener = b.listen("127.0.0.1:0").expect("listen");
    let addr = listener.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let acceptor = {
        let (stop, errors) = (Arc::clone(&stop), Arc::clone(&errors));
        std::thread::spawn(move || {
            let mut echoes = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match listener.accept_timeout(Duration::from_millis(100)) {
                    Ok(ch) => {
                        let (stop, errors) = (Arc::clone(&stop), Arc::clone(&errors));
                        echoes.push(std::thread::spawn(move || {
                            if let Err(e) = echo(ch, &stop) {
                                errors.lock().expect("errors").push(e);
                            }
                        }));
                        echoes.retain(|h: &std::thread::JoinHandle<()>| !h.is_finished());
                    }
                    Err(ChannelError::Timeout) => {}
                    Err(e) => errors.lock().expect("errors").push(format!("accept: {e}")),
                }
            }
            for h in echoes {
                h.join().expect("an echo thread panicked");
            }
        })
    };
    let counts = Arc::new(Counts::default());
    let until = Instant::now() + Duration::from_secs(secs);
    let clients: Vec<_> = (0..threads)
        .map(|t| {
            let (a, counts) = (a.clone(), Arc::clone(&counts));
            std::thread::spawn(move || client(&a, addr, seed * WORDS + t, until, &counts))
        })
        .collect();
    let mut failed: Vec<String> = clients
        .into_iter()
        .filter_map(|c| c.join().expect("a client thread panicked").err())
        .collect();
    stop.store(true, Ordering::Relaxed);
    acceptor.join().expect("the acceptor panicked");
    failed.extend(errors.lock().expect("errors").drain(..));
    let c = |v: &AtomicU64| v.load(Ordering::Relaxed);
    println!(
        "{device} {progress:?}, {secs} s, seed {seed}: {} channels, {} echoes, {} calls, {} \
         fetch-and-adds, {} closed early, {} closed by the peer, {} threshold changes",
        c(&counts.channels),
        c(&counts.echoes),
        c(&counts.calls),
        c(&counts.atomics),
        c(&counts.early_closes),
        c(&counts.peer_closes),
        c(&counts.threshold_changes),
    );
    assert!(
        failed.is_empty(),
        "{device} {progress:?} seed {seed}: {failed:#?}"
    );
    // Every kind of step ran (a run too short for them would prove nothing).
    for (what, v) in [
        ("echoes", &counts.echoes),
        ("calls", &counts.calls),
        ("fetch-and-adds", &counts.atomics),
    ] {
        assert!(c(v) > 0, "{device} {progress:?}: no {what} in {secs} s");
    }
    drop(exposed);
}

#[test]
fn soak_shm_thread_mode() {
    soak("shm0", Progress::Thread, 4);
}

#[test]
fn soak_shm_caller_mode() {
    soak("shm0", Progress::Caller, 4);
}

#[test]
fn soak_tcp_thread_mode() {
    soak("tcp0", Progress::Thread, 4);
}

#[test]
fn soak_tcp_caller_mode() {
    soak("tcp0", Progress::Caller, 4);
}
