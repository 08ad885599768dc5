//! A peer process killed (SIGKILL) in the middle of traffic: every operation on its channels —
//! sends and receives of eager and rendezvous messages, a receive waiting for a message that
//! never comes, RPC calls (one of them in its handler when the peer dies), one-sided atomics —
//! ends with `PeerGone` soon after, none waits for its own deadline, nothing panics; the
//! endpoint's channels to another peer carry on untouched; a new connect to the dead peer's
//! address fails. Waits are bounded by a generous deadline that only catches hangs.

use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabriq::{Channel, ChannelError, Config, Endpoint, Progress, RegionDescriptor, Rpc, RpcError};

/// Longer than any wait of a working run: an operation still going this long after the kill
/// is a hang. Also every operation's own deadline, so that one ended by it is told apart.
const HANG: Duration = Duration::from_secs(20);
/// How soon after the kill each operation must have ended.
const DETECTED: Duration = Duration::from_secs(5);

fn config(device: &str, progress: Progress) -> Config {
    Config {
        device: device.into(),
        progress,
        workers: 2,
        rpc_timeout_ms: HANG.as_millis() as u64,
        remote_timeout_ms: HANG.as_millis() as u64,
        ..Config::default()
    }
}

/// The peer's process, killed when the test ends however it ends.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// How one of the client's loops ended: its error, and when.
type Ended = (String, Instant);

/// Run `step` until it fails (or `HANG` passes); the failure and its time.
fn until_it_fails(
    mut step: impl FnMut() -> Result<(), String> + Send + 'static,
) -> std::thread::JoinHandle<Ended> {
    std::thread::spawn(move || {
        let t0 = Instant::now();
        while t0.elapsed() < 2 * HANG {
            if let Err(e) = step() {
                return (e, Instant::now());
            }
        }
        ("never failed".into(), Instant::now())
    })
}

fn chan(e: ChannelError) -> String {
    format!("{e:?}")
}

fn rpc(e: RpcError) -> String {
    format!("{e:?}")
}

fn killed_peer(device: &str, progress: Progress) {
    let ep = Endpoint::new(config(device, progress)).expect("endpoint");
    let rendezvous = ep.listen("127.0.0.1:0").expect("listen");
    let exe = std::env::current_exe().expect("test binary");
    let mut peer = Peer(
        Command::new(exe)
            .args([
                "--exact",
                "peer_process",
                "--include-ignored",
                "--nocapture",
            ])
            .env(
                "FABRIQ_PEER_RENDEZVOUS",
                rendezvous.local_addr().to_string(),
            )
            .env("FABRIQ_PEER_DEVICE", device)
            .env(
                "FABRIQ_PEER_PROGRESS",
                if progress == Progress::Caller {
                    "caller"
                } else {
                    "thread"
                },
            )
            .spawn()
            .expect("spawn the peer"),
    );
    // The peer says where it listens and what it exposes.
    let hello = rendezvous.accept_timeout(HANG).expect("the peer calls");
    let addr: std::net::SocketAddr =
        String::from_utf8(hello.recv_timeout(HANG).expect("address").to_vec())
            .expect("utf-8")
            .parse()
            .expect("an address");
    let desc = RegionDescriptor::from_bytes(&hello.recv_timeout(HANG).expect("descriptor"))
        .expect("a descriptor");

    // Another peer, in this process, whose channel must not notice.
    let other = Endpoint::new(config(device, progress)).expect("other endpoint");
    other.serve("echo", |req| Ok(req.to_vec()));
    let other_listener = other.listen("127.0.0.1:0").expect("listen");
    let other_rpc = Rpc::new(
        ep.connect(other_listener.local_addr())
            .expect("connect other"),
    );
    let _other_end = other_listener.accept_timeout(HANG).expect("accept other");

    let mut loops = Vec::new();
    // Eager and rendezvous messages echoed by the peer.
    for size in [8usize, 256 << 10] {
        let ch = ep.connect(addr).expect("connect");
        loops.push(until_it_fails(move || {
            let data = vec![size as u8; size];
            ch.send_timeout(&data, HANG).map_err(chan)?;
            let m = ch.recv_timeout(HANG).map_err(chan)?;
            if m[..] != data[..] {
                return Err("an echo differs".into());
            }
            Ok(())
        }));
    }
    // A receive that waits for a message the peer never sends.
    let quiet = ep.connect(addr).expect("connect");
    quiet.send(b"quiet").expect("open");
    loops.push(until_it_fails(move || match quiet.recv_timeout(HANG) {
        Ok(_) => Err("the quiet channel got a message".into()),
        Err(e) => Err(chan(e)),
    }));
    // Calls, and one left in the peer's handler when it dies.
    let calls = Rpc::new(ep.connect(addr).expect("connect"));
    loops.push(until_it_fails(move || {
        calls.call("echo", b"call", HANG).map(drop).map_err(rpc)
    }));
    let stuck = Rpc::new(ep.connect(addr).expect("connect"));
    loops.push(until_it_fails(move || {
        stuck.call("stall", b"", HANG).map(drop).map_err(rpc)
    }));
    // One-sided atomics on the peer's region.
    let region = ep.connect(addr).expect("connect").remote_region(desc);
    loops.push(until_it_fails(move || {
        region.fetch_and_add(0, 1).map(drop).map_err(chan)
    }));

    // The other peer's traffic, from before the kill until well after it.
    let stop_other = Arc::new(AtomicBool::new(false));
    let other_loop = {
        let stop = Arc::clone(&stop_other);
        std::thread::spawn(move || {
            let mut calls = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let reply = other_rpc
                    .call("echo", b"other", HANG)
                    .expect("the other peer's call");
                assert_eq!(&reply[..], b"other");
                calls += 1;
            }
            calls
        })
    };

    std::thread::sleep(Duration::from_millis(300));
    peer.0.kill().expect("kill the peer");
    let killed = Instant::now();
    let _ = peer.0.wait();

    for (i, l) in loops.into_iter().enumerate() {
        let (why, at) = l.join().expect("a loop panicked");
        let after = at.saturating_duration_since(killed);
        assert!(
            why.contains("PeerGone") && after < DETECTED,
            "{device} {progress:?}: loop {i} ended {after:?} after the kill with {why}"
        );
    }
    // The other peer: still answering, then its calls stop.
    std::thread::sleep(Duration::from_millis(200));
    stop_other.store(true, Ordering::Relaxed);
    let calls = other_loop.join().expect("the other peer's loop");
    assert!(
        calls > 0,
        "{device} {progress:?}: no calls to the other peer"
    );
    // Nobody listens at the dead peer's address.
    let t0 = Instant::now();
    assert!(
        ep.connect(addr).is_err(),
        "{device} {progress:?}: a connect to a dead peer"
    );
    assert!(
        t0.elapsed() < DETECTED,
        "{device} {progress:?}: the refused connect took {:?}",
        t0.elapsed()
    );
    drop(hello);
}

#[test]
fn a_killed_peer_ends_every_operation_on_shm() {
    killed_peer("shm0", Progress::Thread);
    killed_peer("shm0", Progress::Caller);
}

#[test]
fn a_killed_peer_ends_every_operation_on_tcp() {
    killed_peer("tcp0", Progress::Thread);
    killed_peer("tcp0", Progress::Caller);
}

/// The peer: echoes on every channel, serves `echo` and `stall` (which never answers in
/// time), exposes a region; tells the test where it listens, then runs until it is killed.
#[test]
#[ignore = "helper process of the killed-peer tests"]
fn peer_process() {
    let Ok(rendezvous) = std::env::var("FABRIQ_PEER_RENDEZVOUS") else {
        return;
    };
    let device = std::env::var("FABRIQ_PEER_DEVICE").expect("device");
    let progress = match std::env::var("FABRIQ_PEER_PROGRESS").as_deref() {
        Ok("caller") => Progress::Caller,
        _ => Progress::Thread,
    };
    let ep = Endpoint::new(config(&device, progress)).expect("endpoint");
    ep.serve("echo", |req| Ok(req.to_vec()));
    ep.serve("stall", |_| {
        std::thread::sleep(2 * HANG);
        Ok(Vec::new())
    });
    let region = ep.expose(64).expect("expose");
    let listener = ep.listen("127.0.0.1:0").expect("listen");
    let hello = ep.connect(rendezvous.as_str()).expect("call the test");
    hello
        .send(listener.local_addr().to_string().as_bytes())
        .expect("send the address");
    hello
        .send(&region.descriptor().to_bytes())
        .expect("send the descriptor");
    loop {
        let Ok(ch) = listener.accept_timeout(2 * HANG) else {
            return;
        };
        std::thread::spawn(move || echo(ch));
    }
}

fn echo(ch: Channel) {
    while let Ok(m) = ch.recv_timeout(2 * HANG) {
        if &m[..] == b"quiet" {
            continue;
        }
        if ch.send_timeout(&m, 2 * HANG).is_err() {
            return;
        }
    }
}
