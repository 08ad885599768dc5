//! The endpoint's buffer memory under pressure and at rest, on shm0 and tcp0
//! (`FABRIQ_TEST_DEVICES` to choose), in both progress modes where it matters.
//!
//! Idle reclaim (`Config::pool_reclaim_ms`, `Endpoint::memory_stats`): a burst of rendezvous
//! messages fills the receiving worker's pool while the application holds them; the
//! application then drops them on its own thread, which only queues them back to the worker's
//! pool. A worker that then goes quiet must still give that memory back — its slabs trimmed to
//! `pool_idle_bytes`, the large buffers it kept deregistered — and, once it holds no more than
//! that, sleep without the reclaim timer.
//!
//! A bounded pool (`Config::pool_max_bytes`): a rendezvous pull that finds no memory waits, and
//! goes on once the application frees some — also when nothing else happens on the channel;
//! memory kept for reuse gives way to it; a message the pool can never hold fails its
//! connection with a typed error instead of holding it up for good.
//!
//! Waits are bounded; the bounds only catch a reclaim or a pull that never comes.

use std::time::{Duration, Instant};

use fabriq::{ChannelError, Config, Endpoint, MemoryStats, Message, Progress};

const HANG: Duration = Duration::from_secs(30);
/// Longest the reclaim may take once the application dropped its messages (the timer is set
/// to 100 ms below).
const RECLAIM_WITHIN: Duration = Duration::from_secs(10);
const MIB: u64 = 1 << 20;

#[path = "support/devices.rs"]
mod support_devices;
use support_devices::devices;

/// Each device in both progress modes.
fn devices_and_modes() -> Vec<(String, Progress)> {
    devices()
        .into_iter()
        .flat_map(|d| [(d.clone(), Progress::Thread), (d, Progress::Caller)])
        .collect()
}

/// A server and a client endpoint, connected: the server's listener and both ends of the
/// channel. `None` (with a note) where the device does not open.
struct Pair {
    server: Endpoint,
    _client: Endpoint,
    listener: fabriq::Listener,
    c: fabriq::Channel,
    s: fabriq::Channel,
}

fn pair(server_cfg: Config, client_cfg: Config) -> Option<Pair> {
    let device = server_cfg.device.clone();
    let server = match Endpoint::new(server_cfg) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("skipping {device}: {e}");
            return None;
        }
    };
    let client = Endpoint::new(client_cfg).expect("client");
    let listener = server.listen("127.0.0.1:0").expect("listen");
    let c = client.connect(listener.local_addr()).expect("connect");
    let s = listener.accept_timeout(HANG).expect("accept");
    Some(Pair {
        server,
        _client: client,
        listener,
        c,
        s,
    })
}

/// Poll the endpoint's memory stats until `cond` holds or `within` passes; the last reading.
fn wait_memory(
    ep: &Endpoint,
    within: Duration,
    cond: impl Fn(&MemoryStats) -> bool,
) -> (bool, MemoryStats) {
    let end = Instant::now() + within;
    loop {
        let m = ep.memory_stats();
        if cond(&m) {
            return (true, m);
        }
        if Instant::now() >= end {
            return (false, m);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn pattern(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j * 7) as u8).collect()
}

fn receive_all(s: &fabriq::Channel, n: usize, len: usize) -> Vec<Message> {
    (0..n)
        .map(|i| {
            let m = s.recv_timeout(HANG).expect("recv");
            assert_eq!(m.len(), len, "message {i}: length");
            assert!(m[..] == pattern(i, len)[..], "message {i}: bytes");
            m
        })
        .collect()
}

#[test]
fn a_quiet_worker_gives_back_what_the_application_freed_on_its_own_thread() {
    for (device, progress) in devices_and_modes() {
        let cfg = Config {
            device: device.clone(),
            progress,
            // Room for the whole burst unconsumed, so the worker pulls it all by itself.
            stream_window: 1024,
            ..Config::default()
        };
        let server_cfg = Config {
            pool_idle_bytes: 2 * MIB,
            pool_reclaim_ms: 100,
            ..cfg.clone()
        };
        let Some(Pair {
            server,
            _client,
            listener: _listener,
            c,
            s,
        }) = pair(server_cfg, cfg)
        else {
            continue;
        };

        // 320 rendezvous messages of 48 KiB, each pulled into a 64 KiB buffer of the server
        // worker's pool (20 MiB, ten slabs) while nothing reads them.
        const N: usize = 320;
        const LEN: usize = 48 << 10;
        for i in 0..N {
            c.send(&pattern(i, LEN)).expect("send");
        }
        let (pulled, m) = wait_memory(&server, HANG, |m| m.registered_bytes >= 20 * MIB);
        assert!(
            pulled,
            "{device} {progress:?}: the burst never filled the pool: {m:?}"
        );
        let held = receive_all(&s, N, LEN);
        // What the reads set going (acks, window updates) goes out first, so that nothing
        // allocates on the worker after the drop below.
        std::thread::sleep(Duration::from_millis(300));
        // Dropped here, on the application thread: each buffer is queued back to the worker's
        // pool, which takes it back only when its own thread allocates — or reclaims.
        drop(held);
        let (trimmed, m) = wait_memory(&server, RECLAIM_WITHIN, |m| m.registered_bytes <= 6 * MIB);
        assert!(
            trimmed,
            "{device} {progress:?}: a quiet worker kept what the application freed registered: {m:?}"
        );
        // (Most runs, the reclaim timer is what gave it back — `m.reclaims` counts it; on a
        // loaded host a later allocation of the worker's may take the frees back first. Without
        // the timer the memory stays registered: the wait above fails.)
        eprintln!("{device} {progress:?}: {m:?}");

        // Large messages (above the pool's largest class) come in buffers the worker keeps for
        // reuse; unused over a reclaim period, they are let go as well.
        const BIG: usize = 3 << 20;
        for i in 0..4 {
            c.send(&pattern(i, BIG)).expect("send big");
        }
        let held = receive_all(&s, 4, BIG);
        drop(held);
        let (released, m) = wait_memory(&server, RECLAIM_WITHIN, |m| {
            m.cached_large_bytes == 0 && m.registered_bytes <= 6 * MIB
        });
        assert!(
            released,
            "{device} {progress:?}: a quiet worker kept its large buffers registered: {m:?}"
        );

        // At or under its mark, the worker sleeps without the timer: no more reclaims run.
        std::thread::sleep(Duration::from_millis(300));
        let before = server.memory_stats().reclaims;
        std::thread::sleep(Duration::from_millis(700));
        let after = server.memory_stats();
        assert_eq!(
            after.reclaims, before,
            "{device} {progress:?}: a worker holding no more than its mark still woke to reclaim: {after:?}"
        );

        // The connection still works both ways after its memory went back.
        c.send(b"after").expect("send after");
        assert_eq!(&s.recv_timeout(HANG).expect("recv after")[..], b"after");
        s.send(&pattern(7, LEN)).expect("send back");
        assert!(c.recv_timeout(HANG).expect("recv back")[..] == pattern(7, LEN)[..]);
    }
}

#[test]
fn with_pool_reclaim_ms_zero_the_timer_never_runs() {
    for device in devices() {
        let cfg = Config {
            device: device.clone(),
            progress: Progress::Thread,
            pool_idle_bytes: 0,
            pool_reclaim_ms: 0,
            ..Config::default()
        };
        let Some(Pair {
            server,
            _client,
            listener: _listener,
            c,
            s,
        }) = pair(cfg.clone(), cfg)
        else {
            continue;
        };
        for i in 0..8 {
            c.send(&pattern(i, 48 << 10)).expect("send");
        }
        drop(receive_all(&s, 8, 48 << 10));
        std::thread::sleep(Duration::from_millis(500));
        let m = server.memory_stats();
        assert_eq!(m.reclaims, 0, "{device}: {m:?}");
        assert!(m.registered_bytes > 0, "{device}: {m:?}");
    }
}

#[test]
fn a_pull_waiting_for_memory_goes_on_when_the_application_frees_some() {
    const BIG: usize = 3 << 20; // pulled into a 4 MiB buffer: two fit under the bound
    for (device, progress) in devices_and_modes() {
        let cfg = Config {
            device: device.clone(),
            progress,
            ..Config::default()
        };
        let Some(Pair {
            server: _server,
            _client,
            listener: _listener,
            c,
            s,
        }) = pair(
            Config {
                pool_max_bytes: Some(8 * MIB),
                pool_reclaim_ms: 0,
                ..cfg.clone()
            },
            cfg,
        )
        else {
            continue;
        };
        for i in 0..3 {
            c.send(&pattern(i, BIG)).expect("send");
        }
        let first = s.recv_timeout(HANG).expect("first");
        assert!(first[..] == pattern(0, BIG)[..]);
        // The second is pulled into the rest of the bound; the third waits for memory.
        std::thread::sleep(Duration::from_millis(200));
        // Freed on another thread, while nothing else happens on the channel.
        std::thread::spawn(move || drop(first))
            .join()
            .expect("drop");
        for i in 1..3 {
            let m = s
                .recv_timeout(Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("{device} {progress:?}: message {i}: {e}"));
            assert!(
                m[..] == pattern(i, BIG)[..],
                "{device} {progress:?}: message {i}"
            );
        }
    }
}

#[test]
fn a_busy_worker_does_not_stop_to_reclaim() {
    for device in devices() {
        let cfg = Config {
            device: device.clone(),
            progress: Progress::Thread,
            stream_window: 1024,
            ..Config::default()
        };
        let Some(Pair {
            server,
            _client,
            listener: _listener,
            c,
            s,
        }) = pair(
            Config {
                pool_idle_bytes: 2 * MIB,
                pool_reclaim_ms: 100,
                ..cfg.clone()
            },
            cfg,
        )
        else {
            continue;
        };
        // A burst the application keeps: the worker holds more than its mark, so each of its
        // sleeps arms the reclaim timer.
        const LEN: usize = 48 << 10;
        for i in 0..160 {
            c.send(&pattern(i, LEN)).expect("send");
        }
        let (pulled, m) = wait_memory(&server, HANG, |m| m.registered_bytes >= 10 * MIB);
        assert!(pulled, "{device}: {m:?}");
        let held = receive_all(&s, 160, LEN);
        std::thread::sleep(Duration::from_millis(20));
        // Then steady traffic for several reclaim periods: the timers that fire meanwhile find
        // the worker busy and leave its memory alone.
        let before = server.memory_stats().reclaims;
        let end = Instant::now() + Duration::from_millis(600);
        let mut n = 0u64;
        while Instant::now() < end {
            c.send(&n.to_le_bytes()).expect("send");
            let m = s.recv_timeout(HANG).expect("recv");
            s.send(&m).expect("echo");
            c.recv_timeout(HANG).expect("echo back");
            n += 1;
        }
        let during = server.memory_stats().reclaims - before;
        assert_eq!(
            during, 0,
            "{device}: {during} reclaims ran on a busy worker ({n} echoes)"
        );
        drop(held);
        // Quiet again: the reclaim comes.
        let (trimmed, m) = wait_memory(&server, RECLAIM_WITHIN, |m| m.registered_bytes <= 6 * MIB);
        assert!(trimmed, "{device}: {m:?}");
    }
}

#[test]
fn kept_memory_gives_way_to_a_pull_under_the_pool_bound() {
    for (device, progress) in devices_and_modes() {
        let cfg = Config {
            device: device.clone(),
            progress,
            ..Config::default()
        };
        let Some(Pair {
            server,
            _client,
            listener: _listener,
            c,
            s,
        }) = pair(
            Config {
                pool_max_bytes: Some(8 * MIB),
                pool_reclaim_ms: 0,
                ..cfg.clone()
            },
            cfg,
        )
        else {
            continue;
        };
        // A 3 MiB message's 4 MiB buffer, kept for reuse once the application dropped it …
        c.send(&pattern(1, 3 << 20)).expect("send");
        let m = s.recv_timeout(HANG).expect("recv");
        assert!(m[..] == pattern(1, 3 << 20)[..]);
        drop(m);
        // … must not keep a 6 MiB message (an 8 MiB buffer) out of the 8 MiB bound.
        c.send(&pattern(2, 6 << 20)).expect("send");
        let m = s
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("{device} {progress:?}: {e}: {:?}", server.memory_stats()));
        assert!(m[..] == pattern(2, 6 << 20)[..], "{device} {progress:?}");
    }
}

#[test]
fn a_message_the_pool_can_never_hold_fails_its_connection_with_a_typed_error() {
    for (device, progress) in devices_and_modes() {
        let cfg = Config {
            device: device.clone(),
            progress,
            ..Config::default()
        };
        let server_cfg = Config {
            pool_max_bytes: Some(8 * MIB),
            ..cfg.clone()
        };
        let Some(Pair {
            server: _server,
            _client,
            listener,
            c,
            s,
        }) = pair(server_cfg, cfg.clone())
        else {
            continue;
        };
        c.send(&pattern(0, 16 << 20)).expect("send");
        // A message behind it: sent, or refused already if the failure came back first.
        if let Err(e) = c.send(b"behind it") {
            assert!(
                matches!(e, ChannelError::PeerGone),
                "{device} {progress:?}: {e}"
            );
        }
        match s.recv_timeout(Duration::from_secs(5)) {
            Err(ChannelError::MessageTooLarge { len, max }) => {
                assert_eq!((len, max), (16 * MIB, 8 * MIB), "{device} {progress:?}");
            }
            other => panic!("{device} {progress:?}: {:?}", other.map(|m| m.len())),
        }
        // The sender learns that its connection is gone, rather than waiting for ever.
        assert!(
            c.recv_timeout(Duration::from_secs(5))
                .is_err_and(|e| !matches!(e, ChannelError::Timeout)),
            "{device} {progress:?}: the sender was not told"
        );
        // Other connections keep working.
        let other = Endpoint::new(cfg).expect("another client");
        let c2 = other.connect(listener.local_addr()).expect("connect again");
        let s2 = listener.accept_timeout(HANG).expect("accept again");
        c2.send(&pattern(1, 3 << 20)).expect("send");
        let m = s2.recv_timeout(HANG).expect("recv on the other connection");
        assert!(m[..] == pattern(1, 3 << 20)[..], "{device} {progress:?}");
    }
}
