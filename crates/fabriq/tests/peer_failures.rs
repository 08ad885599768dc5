//! A peer process killed (SIGKILL) in the middle of traffic. Killed server: every operation on
//! its channels — sends and receives of eager and rendezvous messages, a receive waiting for a
//! message that never comes, RPC calls (one of them in its handler when the peer dies),
//! one-sided atomics — ends with `PeerGone` soon after, none waits for its own deadline,
//! nothing panics; the endpoint's channels to another peer carry on untouched; a new connect to
//! the dead peer's address fails. Killed client: the server's channels to it end with
//! `PeerGone`, a handler still running for it replies into nothing, and the server goes on
//! serving its other clients and new ones. A peer stopped (SIGSTOP) and continued: what waits
//! on it ends at its own deadline, and once it goes on nothing sent was lost or doubled. Waits
//! are bounded by a generous deadline that only catches hangs.

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabriq::{Channel, ChannelError, Config, Endpoint, Progress, RegionDescriptor, Rpc, RpcError};
use rustix::process::Signal;

use common::PeerProcess as Peer;

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

/// Calls to `echo` over `rpc`, from a thread of their own, until [`Calls::stop`]: the traffic
/// of a peer the failure must not touch.
struct Calls {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Calls {
    fn start(rpc: Rpc) -> Calls {
        let stop = Arc::new(AtomicBool::new(false));
        let until = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut calls = 0u64;
            while !until.load(Ordering::Relaxed) {
                let reply = rpc
                    .call("echo", b"other", HANG)
                    .expect("a call to the unaffected peer");
                assert_eq!(&reply[..], b"other");
                calls += 1;
            }
            calls
        });
        Calls { stop, thread }
    }

    /// Stop, after `for_more` of calls; how many were answered (every one was).
    fn stop(self, for_more: Duration) -> u64 {
        std::thread::sleep(for_more);
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the unaffected peer's calls")
    }
}

/// Kill `peer`, then check that each of `ends` ended with `PeerGone` within [`DETECTED`] of
/// the kill (`what` names them in a failure).
fn kill_and_check(peer: &mut Peer, ends: Vec<std::thread::JoinHandle<Ended>>, what: &str) {
    peer.0.kill().expect("kill the peer");
    let killed = Instant::now();
    let _ = peer.0.wait();
    for (i, e) in ends.into_iter().enumerate() {
        let (why, at) = e.join().expect("a thread panicked");
        let after = at.saturating_duration_since(killed);
        assert!(
            why.contains("PeerGone") && after < DETECTED,
            "{what} {i} ended {after:?} after the kill with {why}"
        );
    }
}

/// Start this test binary's `helper` (an ignored test) as the peer process, which calls
/// back at `rendezvous`.
fn spawn_peer(
    helper: &str,
    rendezvous: &fabriq::Listener,
    device: &str,
    progress: Progress,
) -> Peer {
    let exe = std::env::current_exe().expect("test binary");
    let progress = if progress == Progress::Caller {
        "caller"
    } else {
        "thread"
    };
    Peer(
        Command::new(exe)
            .args(["--exact", helper, "--include-ignored", "--nocapture"])
            .env(
                "FABRIQ_PEER_RENDEZVOUS",
                rendezvous.local_addr().to_string(),
            )
            .env("FABRIQ_PEER_DEVICE", device)
            .env("FABRIQ_PEER_PROGRESS", progress)
            .spawn()
            .expect("spawn the peer"),
    )
}

/// In the peer process: the rendezvous address and an endpoint as the test configured it;
/// `None` when the binary runs as the test itself.
fn peer_side() -> Option<(String, Endpoint)> {
    let rendezvous = std::env::var("FABRIQ_PEER_RENDEZVOUS").ok()?;
    let device = std::env::var("FABRIQ_PEER_DEVICE").expect("device");
    let progress = match std::env::var("FABRIQ_PEER_PROGRESS").as_deref() {
        Ok("caller") => Progress::Caller,
        _ => Progress::Thread,
    };
    let ep = Endpoint::new(config(&device, progress)).expect("endpoint");
    Some((rendezvous, ep))
}

fn killed_peer(device: &str, progress: Progress) {
    let ep = Endpoint::new(config(device, progress)).expect("endpoint");
    let rendezvous = ep.listen("127.0.0.1:0").expect("listen");
    let mut peer = spawn_peer("peer_process", &rendezvous, device, progress);
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
    let other_calls = Calls::start(other_rpc);

    std::thread::sleep(Duration::from_millis(300));
    kill_and_check(&mut peer, loops, &format!("{device} {progress:?}: loop"));
    // The other peer: still answering, then its calls stop.
    let calls = other_calls.stop(Duration::from_millis(200));
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

/// Echo on one of the server's channels to the killed client; how it ended, and when.
fn echo_until_gone(ch: Channel) -> Ended {
    loop {
        let m = match ch.recv_timeout(2 * HANG) {
            Ok(m) => m,
            Err(e) => return (chan(e), Instant::now()),
        };
        if let Err(e) = ch.send_timeout(&m, HANG) {
            return (chan(e), Instant::now());
        }
    }
}

fn killed_client(device: &str, progress: Progress) {
    let server = Endpoint::new(config(device, progress)).expect("server");
    server.serve("echo", |req| Ok(req.to_vec()));
    // A handler still running when its caller dies, then replying into nothing.
    let handled = Arc::new(AtomicBool::new(false));
    let h = Arc::clone(&handled);
    server.serve("slow", move |req| {
        std::thread::sleep(Duration::from_millis(600));
        h.store(true, Ordering::Release);
        Ok(req.to_vec())
    });
    let region = server.expose(64).expect("expose");
    let listener = server.listen("127.0.0.1:0").expect("listen");
    let rendezvous = server.listen("127.0.0.1:0").expect("listen");
    let mut peer = spawn_peer("client_process", &rendezvous, device, progress);
    let hello = rendezvous.accept_timeout(HANG).expect("the client calls");
    hello
        .send(listener.local_addr().to_string().as_bytes())
        .expect("address");
    hello
        .send(&region.descriptor().to_bytes())
        .expect("descriptor");
    // The client's six channels (four echoed, one for calls, one for atomics; in whatever
    // order its two connections bring them): each read, and echoed, until the client is gone.
    let echoes: Vec<_> = (0..6)
        .map(|_| {
            let ch = listener.accept_timeout(HANG).expect("the client's channel");
            std::thread::spawn(move || echo_until_gone(ch))
        })
        .collect();
    // Another client, in this process, before, across and after the kill.
    let other = Endpoint::new(config(device, progress)).expect("other client");
    let other_rpc = Rpc::new(other.connect(listener.local_addr()).expect("connect"));
    let _other_end = listener.accept_timeout(HANG).expect("accept the other");
    let other_calls = Calls::start(other_rpc);

    std::thread::sleep(Duration::from_millis(300));
    kill_and_check(
        &mut peer,
        echoes,
        &format!("{device} {progress:?}: the server's channel"),
    );
    // The slow handler finished, its reply went nowhere, and the server still serves.
    let t0 = Instant::now();
    while !handled.load(Ordering::Acquire) {
        assert!(
            t0.elapsed() < HANG,
            "{device} {progress:?}: the slow handler never returned"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let calls = other_calls.stop(Duration::from_millis(200));
    assert!(
        calls > 0,
        "{device} {progress:?}: no calls of the other client"
    );
    let late = Endpoint::new(config(device, progress)).expect("a new client");
    let ch = late
        .connect(listener.local_addr())
        .expect("a new client connects");
    let s = listener.accept_timeout(HANG).expect("and is accepted");
    ch.send(b"new").expect("send");
    assert_eq!(&s.recv_timeout(HANG).expect("recv")[..], b"new");
    drop(hello);
}

#[test]
fn a_killed_client_leaves_the_server_serving_the_rest() {
    for device in ["shm0", "tcp0"] {
        killed_client(device, Progress::Thread);
        killed_client(device, Progress::Caller);
    }
}

/// The client: channels of eager and rendezvous echoes, calls to `slow` and `echo`, atomics on
/// the server's region, until it is killed.
#[test]
#[ignore = "helper process of the killed-peer tests"]
fn client_process() {
    let Some((rendezvous, ep)) = peer_side() else {
        return;
    };
    let hello = ep.connect(rendezvous.as_str()).expect("call the test");
    let addr =
        String::from_utf8(hello.recv_timeout(HANG).expect("address").to_vec()).expect("utf-8");
    let desc = RegionDescriptor::from_bytes(&hello.recv_timeout(HANG).expect("descriptor"))
        .expect("a descriptor");
    let mut loops = Vec::new();
    for size in [8usize, 4096, 256 << 10, 1 << 20] {
        let ch = ep.connect(addr.as_str()).expect("connect");
        loops.push(std::thread::spawn(move || {
            let data = vec![7u8; size];
            while ch.send_timeout(&data, HANG).is_ok() && ch.recv_timeout(HANG).is_ok() {}
        }));
    }
    let rpc = Rpc::new(ep.connect(addr.as_str()).expect("connect"));
    let slow = rpc.clone();
    loops.push(std::thread::spawn(move || {
        while slow.call("slow", b"s", HANG).is_ok() {}
    }));
    loops.push(std::thread::spawn(move || {
        while rpc.call("echo", b"e", HANG).is_ok() {}
    }));
    let region = ep
        .connect(addr.as_str())
        .expect("connect")
        .remote_region(desc);
    loops.push(std::thread::spawn(move || {
        while region.fetch_and_add(0, 1).is_ok() {}
    }));
    for l in loops {
        let _ = l.join();
    }
}

/// Message `i` of the stopped-peer test: eager and rendezvous in turn, its number in it.
fn numbered(i: u64) -> Vec<u8> {
    let len = if i % 3 == 2 { (64 << 10) + 1 } else { 8 };
    let mut v = vec![(i % 251) as u8; len];
    v[..8].copy_from_slice(&i.to_le_bytes());
    v
}

fn stopped_peer(device: &str, progress: Progress) {
    let ep = Endpoint::new(config(device, progress)).expect("endpoint");
    let rendezvous = ep.listen("127.0.0.1:0").expect("listen");
    let peer = spawn_peer("peer_process", &rendezvous, device, progress);
    let hello = rendezvous.accept_timeout(HANG).expect("the peer calls");
    let addr: std::net::SocketAddr =
        String::from_utf8(hello.recv_timeout(HANG).expect("address").to_vec())
            .expect("utf-8")
            .parse()
            .expect("an address");
    let ch = ep.connect(addr).expect("connect");
    let rpc = Rpc::new(ep.connect(addr).expect("connect"));
    assert_eq!(rpc.call("echo", b"before", HANG).expect("call"), b"before");

    peer.stop(HANG);
    // Sends go on until the peer's window is full, then one waits out its deadline.
    let wait = Duration::from_millis(300);
    let mut sent = 0u64;
    loop {
        let t0 = Instant::now();
        match ch.send_timeout(&numbered(sent), wait) {
            Ok(()) => sent += 1,
            Err(ChannelError::Timeout) => {
                assert!(
                    t0.elapsed() >= wait,
                    "{device} {progress:?}: an early Timeout"
                );
                break;
            }
            Err(e) => panic!("{device} {progress:?}: send {sent} to a stopped peer: {e}"),
        }
        assert!(sent < 100_000, "{device} {progress:?}: no back-pressure");
    }
    let t0 = Instant::now();
    match rpc.call("echo", b"stopped", wait) {
        Err(RpcError::Timeout) => assert!(t0.elapsed() >= wait),
        other => panic!("{device} {progress:?}: a call to a stopped peer: {other:?}"),
    }
    peer.signal(Signal::CONT);

    // Every message sent comes back once, in order; the channel and calls go on.
    for i in 0..sent {
        let m = ch.recv_timeout(HANG).expect("an echo");
        assert!(
            m[..] == numbered(i)[..],
            "{device} {progress:?}: echo {i} of {sent}: {} bytes, or other bytes",
            m.len()
        );
    }
    match ch.recv_timeout(Duration::from_millis(200)) {
        Err(ChannelError::Timeout) => {}
        other => panic!(
            "{device} {progress:?}: after the echoes: {:?}",
            other.map(|m| m.len())
        ),
    }
    ch.send(b"after").expect("send");
    assert_eq!(&ch.recv_timeout(HANG).expect("recv")[..], b"after");
    // The late reply of the call that timed out goes to nobody.
    assert_eq!(rpc.call("echo", b"after", HANG).expect("call"), b"after");
    drop(hello);
}

#[test]
fn a_stopped_peer_loses_nothing() {
    for device in ["shm0", "tcp0"] {
        stopped_peer(device, Progress::Thread);
        stopped_peer(device, Progress::Caller);
    }
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
    let Some((rendezvous, ep)) = peer_side() else {
        return;
    };
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
