//! One channel's 8-byte ping-pong latency while K other connections of the same two endpoints
//! sit idle: K listeners on the server endpoint, one connection to each from the client endpoint
//! (one QP each on both sides, one worker per endpoint), then 20 000 exchanges on one more
//! channel, echoed by a thread of the server. Prints the one-way p50 / p90 (half the round trip).
//! What it shows: whether a worker's or provider's polling costs grow with the connections it
//! serves.
//!
//! `cargo run --release -p fabriq --example idle_connections -- [DEVICE] [K] [KEY=VALUE…]`, e.g.
//! `tcp0 128`, or `tcp0 128 progress=thread` (device options on top of the defaults).

use fabriq::{Config, Endpoint};
use std::time::{Duration, Instant};
const T: Duration = Duration::from_secs(10);
fn main() {
    let dev = std::env::args().nth(1).unwrap_or("tcp0".into());
    let k: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let device_options: std::collections::BTreeMap<String, String> = std::env::args()
        .skip(3)
        .filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    let cfg = || Config {
        device: dev.clone(),
        workers: 1,
        device_options: device_options.clone(),
        ..Config::default()
    };
    let server = Endpoint::new(cfg()).unwrap();
    let client = Endpoint::new(cfg()).unwrap();
    let mut keep = vec![];
    for _ in 0..k {
        let l = server.listen("127.0.0.1:0").unwrap();
        let c = client.connect(l.local_addr()).unwrap();
        let s = l.accept_timeout(T).unwrap();
        keep.push((l, c, s));
    }
    let l = server.listen("127.0.0.1:0").unwrap();
    let c = client.connect(l.local_addr()).unwrap();
    let s = l.accept_timeout(T).unwrap();
    let echo = std::thread::spawn(move || {
        while let Ok(m) = s.recv_timeout(T) {
            if m.is_empty() {
                break;
            }
            s.send_timeout(&m, T).unwrap();
        }
    });
    let mut v = vec![];
    for i in 0..20000 {
        let t = Instant::now();
        c.send_timeout(&[1u8; 8], T).unwrap();
        let _ = c.recv_timeout(T).unwrap();
        if i > 1000 {
            v.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    c.send_timeout(&[], T).unwrap();
    echo.join().unwrap();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "{dev} idle connections {k}: one-way p50 {:.2} us p90 {:.2}",
        v[v.len() / 2],
        v[v.len() * 9 / 10]
    );
}
