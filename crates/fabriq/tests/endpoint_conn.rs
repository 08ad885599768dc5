//! Channel set-up through the connection manager, at the `Endpoint` level, on the real
//! providers (`shm0`, `tcp0`; `FABRIQ_TEST_DEVICES` to choose): auth-token and version
//! mismatches fail with typed errors on both sides, a refused or half-finished handshake is a
//! typed error, a closed channel's QP, ring regions and control stream serve the next connect
//! (seen in the connection counters) and one QP serves many connects in a row, a peer's close
//! fails the other end with `PeerGone`, and failures never disturb an established channel.
//! Waits are bounded by generous timeouts that only catch hangs.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use fabriq::conn::wire::{self, Hello, Message, RingGeometry};
use fabriq::conn::{ConnError, ConnStats, RejectCode};
use fabriq::{Channel, ChannelError, Config, Endpoint};
use fabriq_verbs::{QpEndpoint, QpNum};

const HANG: Duration = Duration::from_secs(30);

#[path = "support/devices.rs"]
mod support_devices;
use support_devices::devices;

fn endpoint(device: &str, token: &str) -> Option<Endpoint> {
    let cfg = Config {
        device: device.into(),
        auth_token: token.into(),
        handshake_timeout_ms: 10_000,
        ..Config::default()
    };
    match Endpoint::new(cfg) {
        Ok(e) => Some(e),
        Err(e) => {
            eprintln!("skipping {device}: {e}");
            None
        }
    }
}

/// A server endpoint listening on loopback and a client endpoint, both from `cfg`; `None`
/// (with a note) where the device does not open.
fn server_client_listener(cfg: Config) -> Option<(Endpoint, Endpoint, fabriq::Listener)> {
    let server = match Endpoint::new(cfg.clone()) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("skipping {}: {e}", cfg.device);
            return None;
        }
    };
    let client = Endpoint::new(cfg).expect("client");
    let listener = server.listen("127.0.0.1:0").expect("listen");
    Some((server, client, listener))
}

fn ping(a: &Channel, b: &Channel, what: &[u8]) {
    a.send(what).expect("send");
    assert_eq!(&b.recv_timeout(HANG).expect("recv")[..], what);
}

/// Wait (bounded) until `cond` holds on the endpoint's connection counters.
fn wait_stats(ep: &Endpoint, what: &str, cond: impl Fn(&ConnStats) -> bool) -> ConnStats {
    let deadline = Instant::now() + HANG;
    loop {
        let s = ep.conn_stats();
        if cond(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}: counters stuck at {s:?}");
        std::thread::yield_now();
    }
}

/// Close round `round`'s channel pair from the client side: the server's end sees `PeerGone`,
/// and both sides' QPs go back to their caches (bounded wait on the counters).
fn close_and_wait_cached(
    (client, server): (&Endpoint, &Endpoint),
    (c, s): (Channel, Channel),
    round: u64,
    what: &str,
) {
    drop(c);
    match s.recv_timeout(HANG) {
        Err(ChannelError::PeerGone) => {}
        other => panic!("{what} round {round}: expected PeerGone, got {other:?}"),
    }
    drop(s);
    wait_stats(client, "client QP back in the cache", |st| {
        st.qps_cached >= 1 && st.connects > round
    });
    wait_stats(server, "server QP back in the cache", |st| {
        st.qps_cached >= 1 && st.accepts > round
    });
}

/// A raw peer with a QP of `device`'s provider, driven through the connection manager (which
/// keeps the PD and CQ it is given).
fn raw_peer(device: &str) -> fabriq::conn::ConnManager {
    let ctx = fabriq_verbs::Context::open(device).expect("device");
    let pd = ctx.alloc_pd().expect("pd");
    let cq = ctx.create_cq(256).expect("cq");
    fabriq::conn::ConnManager::new(&pd, &cq, fabriq::conn::ConnConfig::default()).expect("manager")
}

fn is_auth_error(e: &ConnError) -> bool {
    matches!(
        e,
        ConnError::AuthFailed { .. }
            | ConnError::Rejected {
                code: RejectCode::AuthFailed,
                ..
            }
    )
}

#[test]
fn auth_token_mismatch_fails_on_both_sides_and_a_matching_token_connects() {
    for device in devices() {
        // The server requires a token the client does not have.
        let Some(server) = endpoint(&device, "s3cret") else {
            continue;
        };
        let listener = server.listen("127.0.0.1:0").expect("listen");
        let addr = listener.local_addr();
        let wrong = endpoint(&device, "guess").expect("client");
        match wrong.connect(addr) {
            Err(ChannelError::Connect(e)) => assert!(is_auth_error(&e), "{device}: {e}"),
            other => panic!("{device}: wrong token connected: {other:?}"),
        }
        let seen = listener.next_failure(HANG).expect("server-side failure");
        assert!(
            matches!(seen, ConnError::AuthFailed { .. }),
            "{device}: {seen}"
        );
        // The client requires a token the server does not present.
        let open = endpoint(&device, "").expect("server without token");
        let open_listener = open.listen("127.0.0.1:0").expect("listen");
        match wrong.connect(open_listener.local_addr()) {
            Err(ChannelError::Connect(e)) => assert!(is_auth_error(&e), "{device}: {e}"),
            other => panic!("{device}: unauthenticated server accepted: {other:?}"),
        }
        let seen = open_listener
            .next_failure(HANG)
            .expect("server-side failure");
        assert!(is_auth_error(&seen), "{device}: {seen}");
        // The right token works, on the same listener.
        let right = endpoint(&device, "s3cret").expect("client");
        let c = right.connect(addr).expect("connect with the right token");
        let s = listener.accept_timeout(HANG).expect("accept");
        ping(&c, &s, b"authenticated");
        ping(&s, &c, b"both ways");
    }
}

/// A hello for `provider` with a plausible (never connected) endpoint.
fn raw_hello(provider: &str) -> Hello {
    Hello {
        version: wire::VERSION,
        provider: provider.into(),
        device: format!("{provider}0"),
        endpoint: QpEndpoint {
            provider: provider.into(),
            device: format!("{provider}0"),
            address: "127.0.0.1:1".into(),
            qp_num: QpNum(1),
            psn: 0,
            lid: 0,
            gid: [0; 16],
            mtu: 4096,
            extra: Default::default(),
        },
        ring: RingGeometry {
            slots: 64,
            slot_size: 8224,
        },
        initial_credits: 64,
        eager_threshold: 4096,
        rndv_chunk_size: 65536,
        stream_window: 64,
        worker_id: 0,
        target_worker: None,
        auth_token: Vec::new(),
        local_control: String::new(),
    }
}

fn read_frame(s: &mut TcpStream) -> Message {
    s.set_read_timeout(Some(HANG)).unwrap();
    let mut prefix = [0u8; 4];
    s.read_exact(&mut prefix).expect("frame prefix");
    let len = wire::frame_len(prefix).expect("frame length");
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).expect("frame body");
    wire::decode_body(&body).expect("decodes")
}

#[test]
fn version_mismatch_is_typed_on_both_sides() {
    for device in devices() {
        let Some(server) = endpoint(&device, "") else {
            continue;
        };
        let provider = device.trim_end_matches(char::is_numeric).to_string();
        // A client of another version: the endpoint answers with its own version.
        let listener = server.listen("127.0.0.1:0").expect("listen");
        let mut raw = TcpStream::connect(listener.local_addr()).expect("tcp");
        raw.write_all(&wire::encode_with_version(
            &Message::Hello(raw_hello(&provider)),
            wire::VERSION + 1,
        ))
        .unwrap();
        match read_frame(&mut raw) {
            Message::Reject(r) => {
                assert_eq!(r.code, RejectCode::VersionMismatch, "{device}");
                assert_eq!(r.version, wire::VERSION, "{device}");
            }
            other => panic!("{device}: expected a reject, got {other:?}"),
        }
        let seen = listener.next_failure(HANG).expect("server-side failure");
        assert!(
            matches!(seen, ConnError::VersionMismatch { peer, .. } if peer == wire::VERSION + 1),
            "{device}: {seen}"
        );
        // A server of another version: the endpoint's connect says so.
        let fake = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = fake.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let (mut s, _) = fake.accept().unwrap();
            let hello = read_frame(&mut s);
            assert!(matches!(hello, Message::Hello(_)), "{hello:?}");
            let mut h = raw_hello(&provider);
            h.version = wire::VERSION + 1;
            s.write_all(&wire::encode_with_version(
                &Message::HelloAck(h),
                wire::VERSION + 1,
            ))
            .unwrap();
            // The client tells us why it gives up.
            read_frame(&mut s)
        });
        let client = endpoint(&device, "").expect("client");
        match client.connect(addr) {
            Err(ChannelError::Connect(ConnError::VersionMismatch { local, peer })) => {
                assert_eq!(
                    (local, peer),
                    (wire::VERSION, wire::VERSION + 1),
                    "{device}"
                );
            }
            other => panic!("{device}: expected a version mismatch, got {other:?}"),
        }
        match peer.join().unwrap() {
            Message::Reject(r) => assert_eq!(r.code, RejectCode::VersionMismatch, "{device}"),
            other => panic!("{device}: expected a reject, got {other:?}"),
        }
    }
}

#[test]
fn connect_to_nothing_and_handshakes_cut_short_are_typed_errors() {
    for device in devices() {
        let Some(client) = endpoint(&device, "") else {
            continue;
        };
        // Nothing listens.
        let closed = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(
            matches!(
                client.connect(closed),
                Err(ChannelError::Connect(ConnError::Refused { .. }))
            ),
            "{device}"
        );
        // A server that reads the hello and hangs up before answering.
        let fake = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = fake.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let (mut s, _) = fake.accept().unwrap();
            let _ = read_frame(&mut s);
        });
        match client.connect(addr) {
            Err(ChannelError::Connect(ConnError::PeerClosed { phase, .. })) => {
                assert_eq!(phase, "hello-ack", "{device}")
            }
            other => panic!("{device}: expected PeerClosed, got {other:?}"),
        }
        peer.join().unwrap();
        // A client that sends half a hello and hangs up: the server reports it, and a
        // channel established before keeps working.
        let server = endpoint(&device, "").expect("server");
        let listener = server.listen("127.0.0.1:0").expect("listen");
        let c = client.connect(listener.local_addr()).expect("connect");
        let s = listener.accept_timeout(HANG).expect("accept");
        let provider = device.trim_end_matches(char::is_numeric).to_string();
        let frame = wire::encode(&Message::Hello(raw_hello(&provider)));
        let mut raw = TcpStream::connect(listener.local_addr()).expect("tcp");
        raw.write_all(&frame[..frame.len() / 2]).unwrap();
        drop(raw);
        let seen = listener.next_failure(HANG).expect("server-side failure");
        assert!(
            matches!(seen, ConnError::PeerClosed { phase: "hello", .. }),
            "{device}: {seen}"
        );
        // Garbage from another client: reported, and the listener goes on.
        let mut raw = TcpStream::connect(listener.local_addr()).expect("tcp");
        raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let seen = listener.next_failure(HANG).expect("server-side failure");
        assert!(
            matches!(seen, ConnError::Malformed { .. }),
            "{device}: {seen}"
        );
        drop(raw);
        ping(&c, &s, b"still here");
        ping(&s, &c, b"and back");
        let c2 = client
            .connect(listener.local_addr())
            .expect("connect again");
        let s2 = listener.accept_timeout(HANG).expect("accept again");
        ping(&c2, &s2, b"second channel");
        ping(&c, &s, b"first channel unaffected");
    }
}

/// Peers that connect and say nothing, or part of a hello, hold up no other peer's
/// handshake: a client behind five of them connects at once, and each of them is reported
/// when its handshake deadline passes. (The listener read one peer's hello at a time: the
/// client behind three silent peers timed out after the handshake deadline, and the server
/// took its connection a deadline per silent peer later.)
#[test]
fn silent_and_half_sent_peers_hold_up_no_other_connect() {
    for device in devices() {
        let Some((server, client, listener)) = server_client_listener(Config {
            device: device.clone(),
            handshake_timeout_ms: 3_000,
            ..Config::default()
        }) else {
            continue;
        };
        let addr = listener.local_addr();
        let provider = device.trim_end_matches(char::is_numeric).to_string();
        let frame = wire::encode(&Message::Hello(raw_hello(&provider)));
        let mut stalled: Vec<TcpStream> = (0..3)
            .map(|_| TcpStream::connect(addr).expect("tcp"))
            .collect();
        for part in [&frame[..2], &frame[..frame.len() - 1]] {
            let mut raw = TcpStream::connect(addr).expect("tcp");
            raw.write_all(part).expect("part of a hello");
            stalled.push(raw);
        }
        std::thread::sleep(Duration::from_millis(50));
        let t0 = Instant::now();
        let c = client.connect(addr).expect("connect behind stalled peers");
        let s = listener.accept_timeout(HANG).expect("accept");
        let took = t0.elapsed();
        assert!(
            took < Duration::from_millis(2_500),
            "{device}: connect and accept took {took:?}, a handshake deadline"
        );
        ping(&c, &s, b"through");
        for i in 0..stalled.len() {
            let seen = listener
                .next_failure(HANG)
                .unwrap_or_else(|| panic!("{device}: stalled peer {i} not reported"));
            assert!(
                matches!(seen, ConnError::Timeout { phase: "hello", .. }),
                "{device}: {seen}"
            );
        }
        ping(&s, &c, b"and back");
        drop(stalled);
        drop(server);
    }
}

#[test]
fn a_closed_channels_qp_and_control_stream_serve_the_next_connect() {
    for device in devices() {
        let Some(server) = endpoint(&device, "") else {
            continue;
        };
        let client = endpoint(&device, "").expect("client");
        let listener = server.listen("127.0.0.1:0").expect("listen");
        let addr = listener.local_addr();
        // Rounds alternate which side closes first.
        for round in 0..4u8 {
            let c = client.connect(addr).expect("connect");
            let s = listener.accept_timeout(HANG).expect("accept");
            ping(&c, &s, &[round; 100]);
            ping(&s, &c, &[round; 5000]);
            let (first, second) = if round % 2 == 0 { (c, s) } else { (s, c) };
            drop(first);
            // The peer's close reaches the other end as PeerGone.
            match second.recv_timeout(HANG) {
                Err(ChannelError::PeerGone) => {}
                other => panic!("{device} round {round}: expected PeerGone, got {other:?}"),
            }
            drop(second);
            let want = u64::from(round) + 1;
            wait_stats(&client, "client QP back in the cache", |s| {
                s.qps_cached >= 1 && s.connects >= want
            });
            wait_stats(&server, "server QP back in the cache", |s| {
                s.qps_cached >= 1 && s.accepts >= want
            });
        }
        let cs = client.conn_stats();
        let ss = server.conn_stats();
        // One QP per side served every round; the control stream was reused.
        assert_eq!(cs.qps_created, 1, "{device}: client {cs:?}");
        assert_eq!(ss.qps_created, 1, "{device}: server {ss:?}");
        assert_eq!(cs.qp_cache_hits, 3, "{device}: client {cs:?}");
        assert_eq!(ss.qp_cache_hits, 3, "{device}: server {ss:?}");
        // The channel's ring and header slots came with the QP: registered once per side,
        // and the pings of each round crossed the reused ring intact.
        for (side, st) in [("client", &cs), ("server", &ss)] {
            assert_eq!(
                (st.region_cache_misses, st.region_cache_hits),
                (2, 6),
                "{device}: {side} {st:?}"
            );
        }
        assert!(cs.stream_reuses >= 1, "{device}: client {cs:?}");
        assert_eq!(cs.failed + ss.failed, 0, "{device}: {cs:?} {ss:?}");
    }
}

#[test]
fn a_dying_peer_process_fails_the_channel_with_peer_gone() {
    for device in devices() {
        let Some(server) = endpoint(&device, "") else {
            continue;
        };
        let client = endpoint(&device, "").expect("client");
        let listener = server.listen("127.0.0.1:0").expect("listen");
        let c = client.connect(listener.local_addr()).expect("connect");
        let s = listener.accept_timeout(HANG).expect("accept");
        ping(&c, &s, b"alive");
        // The whole server endpoint goes away (its workers stop, its streams close).
        drop(listener);
        drop(s);
        drop(server);
        match c.recv_timeout(HANG) {
            Err(ChannelError::PeerGone) => {}
            other => panic!("{device}: expected PeerGone, got {other:?}"),
        }
        assert!(c.is_closed(), "{device}");
    }
}

/// The connection pool: many channels from many threads to one peer share one connection per
/// client worker (connections grow with peers × workers, not with channels), each channel keeps
/// its own messages apart, closing one leaves the others working, and the last one closing
/// sends the QP back to the cache so a later connect sets a connection up again.
#[test]
fn channels_to_one_peer_share_one_connection_per_worker() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 6;
    const ROUNDS: u32 = 50;
    for device in devices() {
        let cfg = |workers| Config {
            device: device.clone(),
            workers,
            handshake_timeout_ms: 10_000,
            ..Config::default()
        };
        let Ok(server) = Endpoint::new(cfg(1)) else {
            eprintln!("skipping {device}");
            continue;
        };
        let client = Endpoint::new(cfg(2)).expect("client");
        let listener = server.listen("127.0.0.1:0").expect("listen");
        let addr = listener.local_addr();
        // Echo every accepted channel from its own thread until the peer closes it.
        let echo = std::thread::spawn(move || {
            let mut served = Vec::new();
            for _ in 0..THREADS * PER_THREAD {
                let s = listener.accept_timeout(HANG).expect("accept");
                served.push(std::thread::spawn(move || {
                    let mut n = 0u32;
                    loop {
                        match s.recv_timeout(HANG) {
                            Ok(m) => {
                                s.send(&m).expect("echo");
                                n += 1;
                            }
                            Err(ChannelError::PeerGone) => return n,
                            Err(e) => panic!("echo: {e}"),
                        }
                    }
                }));
            }
            (listener, served)
        });
        let clients: Vec<_> = (0..THREADS)
            .map(|t| {
                let client = client.clone();
                std::thread::spawn(move || {
                    let chans: Vec<Channel> = (0..PER_THREAD)
                        .map(|_| client.connect(addr).expect("connect"))
                        .collect();
                    for r in 0..ROUNDS {
                        // Interleave the channels: each message names its channel and round.
                        for (i, c) in chans.iter().enumerate() {
                            let mut m = vec![t as u8, i as u8];
                            m.extend_from_slice(&r.to_le_bytes());
                            // Every 10th round a rendezvous-sized message.
                            m.resize(if r % 10 == 9 { 20_000 } else { 64 }, r as u8);
                            c.send(&m).expect("send");
                        }
                        for (i, c) in chans.iter().enumerate() {
                            let m = c.recv_timeout(HANG).expect("recv");
                            assert_eq!(&m[..2], &[t as u8, i as u8], "crossed channels");
                            assert_eq!(&m[2..6], &r.to_le_bytes(), "order");
                        }
                    }
                    chans
                })
            })
            .collect();
        let mut chans: Vec<Channel> = clients
            .into_iter()
            .flat_map(|h| h.join().expect("client thread"))
            .collect();
        let cs = client.conn_stats();
        let pool = client.pool_stats();
        // 24 channels, 2 client workers: 2 connections, set up by 2 handshakes.
        assert_eq!(cs.connects, 2, "{device}: {cs:?}");
        assert_eq!(pool.misses, 2, "{device}: {pool:?}");
        assert_eq!(pool.hits, (THREADS * PER_THREAD - 2) as u64, "{device}");
        assert_eq!(pool.live, 2, "{device}: {pool:?}");
        assert_eq!(server.conn_stats().accepts, 2, "{device}");
        // Closing one channel leaves the others on its connection working.
        drop(chans.remove(0));
        for c in &chans {
            c.send(b"still here").expect("send after a sibling closed");
            assert_eq!(&c.recv_timeout(HANG).expect("recv")[..], b"still here");
        }
        // The last channels go: both connections close, their QPs go back to the cache.
        drop(chans);
        let (listener, served) = echo.join().expect("echo thread");
        let echoed: u32 = served.into_iter().map(|h| h.join().expect("echo")).sum();
        let per_chan = ROUNDS as usize;
        assert!(
            echoed as usize >= THREADS * PER_THREAD * per_chan,
            "{device}: {echoed}"
        );
        wait_stats(&client, "client QPs cached", |s| s.qps_cached >= 2);
        wait_stats(&server, "server QPs cached", |s| s.qps_cached >= 2);
        assert_eq!(client.pool_stats().live, 0, "{device}");
        // A new connect finds no live connection and sets one up (from the QP cache).
        let c = client.connect(addr).expect("reconnect");
        let s = listener.accept_timeout(HANG).expect("accept");
        ping(&c, &s, b"again");
        assert_eq!(client.pool_stats().misses, 3, "{device}");
        assert!(client.conn_stats().qp_cache_hits >= 1, "{device}");
    }
}

/// `share_connections = false`: every connect sets up a connection of its own, and channels
/// set up by handshakes are accepted in the order the handshakes finished (each connection's
/// first stream is opened by its handshake, not by a message racing the other connections').
#[test]
fn unshared_connections_are_one_per_channel() {
    for device in devices() {
        let cfg = Config {
            device: device.clone(),
            share_connections: false,
            handshake_timeout_ms: 10_000,
            ..Config::default()
        };
        let Some((server, client, listener)) = server_client_listener(cfg) else {
            continue;
        };
        const N: usize = 24;
        // All connects first, then all accepts: the k-th accepted is the k-th connected.
        let clients: Vec<Channel> = (0..N)
            .map(|_| client.connect(listener.local_addr()).expect("connect"))
            .collect();
        let servers: Vec<Channel> = (0..N)
            .map(|_| listener.accept_timeout(HANG).expect("accept"))
            .collect();
        for (i, (c, s)) in clients.iter().zip(&servers).enumerate() {
            ping(c, s, &[i as u8; 10]);
            ping(s, c, &[i as u8; 20]);
        }
        assert_eq!(client.conn_stats().connects, N as u64, "{device}");
        assert_eq!(server.conn_stats().accepts, N as u64, "{device}");
        assert_eq!(
            client.pool_stats().live,
            0,
            "{device}: the pool is not used"
        );
    }
}

/// Streams of one connection do not block each other: a channel whose reader stops is
/// back-pressured by its own window, while a sibling channel on the same connection carries
/// many times the connection's receive ring; once the reader catches up the stalled channel
/// goes on, in order. `rnr_retry = 0`: a single RNR would fail the connection.
#[test]
fn a_stalled_channel_does_not_block_its_siblings() {
    for device in devices() {
        let cfg = Config {
            device: device.clone(),
            rnr_retry: 0,
            rx_slots: 8,
            handshake_timeout_ms: 10_000,
            ..Config::default()
        };
        let Some((_server, client, listener)) = server_client_listener(cfg) else {
            continue;
        };
        let stalled = client.connect(listener.local_addr()).expect("connect a");
        let stalled_peer = listener.accept_timeout(HANG).expect("accept a");
        let busy = client.connect(listener.local_addr()).expect("connect b");
        let busy_peer = listener.accept_timeout(HANG).expect("accept b");
        assert_eq!(
            client.conn_stats().connects,
            1,
            "{device}: one shared connection"
        );
        // Fill the stalled channel's window: nobody reads it.
        let mut sent = 0u64;
        let deadline = Instant::now() + HANG;
        loop {
            match stalled.try_send(&sent.to_le_bytes()) {
                Ok(()) => sent += 1,
                Err(ChannelError::WouldBlock) => {
                    // Also refused while acks are on their way; a send that finds no room for
                    // a whole second means the window is closed.
                    match stalled.send_timeout(&sent.to_le_bytes(), Duration::from_secs(1)) {
                        Ok(()) => sent += 1,
                        Err(ChannelError::Timeout) => break,
                        Err(e) => panic!("{device}: {e}"),
                    }
                }
                Err(e) => panic!("{device}: {e}"),
            }
            assert!(Instant::now() < deadline, "{device}: never back-pressured");
        }
        assert!(sent > 8, "{device}: window {sent} not beyond the ring");
        // The sibling carries 20 rings' worth both ways meanwhile.
        for i in 0..160u32 {
            busy.send(&i.to_le_bytes()).expect("sibling send");
            let m = busy_peer.recv_timeout(HANG).expect("sibling recv");
            assert_eq!(&m[..], &i.to_le_bytes(), "{device}");
            busy_peer.send(&m).expect("sibling reply");
            assert_eq!(
                &busy.recv_timeout(HANG).expect("reply")[..],
                &i.to_le_bytes()
            );
        }
        // The reader catches up; the stalled channel resumes in order.
        for i in 0..sent {
            let m = stalled_peer.recv_timeout(HANG).expect("stalled recv");
            assert_eq!(&m[..], &i.to_le_bytes(), "{device}");
        }
        stalled
            .send_timeout(b"resumed", HANG)
            .expect("room after the reader caught up");
        assert_eq!(
            &stalled_peer.recv_timeout(HANG).expect("recv")[..],
            b"resumed"
        );
        assert!(!stalled.is_closed() && !busy.is_closed(), "{device}");
    }
}

/// A pooled connection that failed is never handed out again: after the peer endpoint died
/// (its channel still held here, failed), a connect to a new endpoint on the same address sets
/// up a new connection instead of opening a stream on the dead one. The channel's `PeerGone`
/// may come from the peer's close of the stream before the worker has read the end of the
/// connection off its control stream; the pool looks at that stream itself (it once handed out
/// the dead connection in that gap, about one run in ten of the single-reconnect version on a
/// 2-core host, and the new endpoint never saw a peer). Five endpoints in turn on one address, each reconnect straight after the
/// `PeerGone`; the control stream to a gone endpoint never serves a handshake.
#[test]
fn a_failed_pooled_connection_is_replaced() {
    const ROUNDS: u64 = 5;
    for device in devices() {
        let Some(first) = endpoint(&device, "") else {
            continue;
        };
        let client = endpoint(&device, "").expect("client");
        let mut listener = first.listen("127.0.0.1:0").expect("listen");
        let addr = listener.local_addr();
        let mut server = first;
        let mut old = client.connect(addr).expect("connect");
        let mut old_peer = listener.accept_timeout(HANG).expect("accept");
        ping(&old, &old_peer, b"first");
        let mut rounds = 1;
        while rounds < ROUNDS {
            drop((listener, old_peer, server));
            match old.recv_timeout(HANG) {
                Err(ChannelError::PeerGone) => {}
                other => panic!("{device}: expected PeerGone, got {other:?}"),
            }
            // A new endpoint on the same address (the old channel is still held, failed).
            server = endpoint(&device, "").expect("next server");
            listener = match server.listen(addr) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("skipping the rest on {device}: {addr} not free again: {e}");
                    break;
                }
            };
            let new = client.connect(addr).expect("connect again");
            let new_peer = listener
                .accept_timeout(HANG)
                .unwrap_or_else(|e| panic!("{device} round {rounds}: accept again: {e}"));
            ping(&new, &new_peer, b"second");
            ping(&new_peer, &new, b"back");
            assert!(old.is_closed() && !new.is_closed(), "{device}");
            rounds += 1;
            let conn = client.conn_stats();
            let pool = client.pool_stats();
            assert_eq!(conn.connects, rounds, "{device}: {conn:?}");
            assert_eq!((pool.hits, pool.misses), (0, rounds), "{device}: {pool:?}");
            assert_eq!(conn.stream_reuses, 0, "{device}: {conn:?}");
            (old, old_peer) = (new, new_peer);
        }
    }
}

/// The accepting side may send on a new channel the moment `accept` returns, before the
/// connecting side's worker has seen the first channel opened: that first message must be
/// kept, not dropped as a message for an unknown stream (it once was, about one connect in
/// 30–70 on tcp0, and the connecting side waited forever). 600 fresh connections per device,
/// each greeted by the server at once.
#[test]
fn the_first_message_on_a_new_connection_is_never_lost() {
    const ROUNDS: u32 = 600;
    for device in devices() {
        let cfg = Config {
            device: device.clone(),
            handshake_timeout_ms: 10_000,
            share_connections: false,
            ..Config::default()
        };
        let Some((_server, client, listener)) = server_client_listener(cfg) else {
            continue;
        };
        let addr = listener.local_addr();
        let greeter = std::thread::spawn(move || {
            for i in 0..ROUNDS {
                let ch = listener.accept_timeout(HANG).expect("accept");
                ch.send(&i.to_le_bytes()).expect("greet");
                // Held until the client closes it.
                let _ = ch.recv_timeout(HANG);
            }
        });
        for i in 0..ROUNDS {
            let ch = client.connect(addr).expect("connect");
            let m = ch
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("{device}: greeting {i} lost: {e}"));
            assert_eq!(&m[..], &i.to_le_bytes(), "{device}");
        }
        greeter.join().expect("greeter");
    }
}

/// A connect that hits the QP cache and a kept control stream is a full connection: both
/// sides' first messages, sent the moment `connect` / `accept` return, arrive; and it works
/// the same whether the handshake's waits busy-poll (a budget longer than any handshake here)
/// or block at once (budget 0). Every round after the first reuses the QP on both sides and
/// the one TCP control stream.
#[test]
fn cached_connects_deliver_the_first_messages_with_spinning_on_and_off() {
    const ROUNDS: u64 = 5;
    for device in devices() {
        for spin_us in [0, 100_000] {
            let cfg = Config {
                device: device.clone(),
                handshake_timeout_ms: 10_000,
                handshake_spin_us: Some(spin_us),
                ..Config::default()
            };
            let Some((server, client, listener)) = server_client_listener(cfg) else {
                continue;
            };
            let addr = listener.local_addr();
            for round in 0..ROUNDS {
                let c = client.connect(addr).expect("connect");
                c.send(&round.to_le_bytes()).expect("client's first send");
                let s = listener.accept_timeout(HANG).expect("accept");
                s.send(&[round as u8; 3000]).expect("server's first send");
                let got = s.recv_timeout(HANG).expect("server's first recv");
                assert_eq!(&got[..], &round.to_le_bytes(), "{device} spin {spin_us}");
                let got = c.recv_timeout(HANG).expect("client's first recv");
                assert_eq!(
                    &got[..],
                    &[round as u8; 3000][..],
                    "{device} spin {spin_us}"
                );
                let what = format!("{device} spin {spin_us}");
                close_and_wait_cached((&client, &server), (c, s), round, &what);
            }
            let cs = client.conn_stats();
            let ss = server.conn_stats();
            let what = format!("{device} spin {spin_us}: client {cs:?}, server {ss:?}");
            assert_eq!(
                (cs.qps_created, cs.qp_cache_hits),
                (1, ROUNDS - 1),
                "{what}"
            );
            assert_eq!(
                (ss.qps_created, ss.qp_cache_hits),
                (1, ROUNDS - 1),
                "{what}"
            );
            // Loopback: the first connect's TCP stream, then one local stream kept for the rest.
            assert_eq!(
                (cs.streams_opened, cs.local_streams_opened, cs.stream_reuses),
                (2, 1, ROUNDS - 2),
                "{what}"
            );
            assert_eq!(cs.failed + ss.failed, 0, "{what}");
        }
    }
}

/// One QP per side serves many connects in a row, each with traffic both ways: the reset of a
/// cached QP leaves nothing of the previous connection's work queues behind (posted receives,
/// unsignaled sends), so the queues never fill up over the reuses.
#[test]
fn a_cached_qp_serves_many_connects_in_a_row() {
    const ROUNDS: u64 = 48;
    for device in devices() {
        let Some(server) = endpoint(&device, "") else {
            continue;
        };
        let client = endpoint(&device, "").expect("client");
        let listener = server.listen("127.0.0.1:0").expect("listen");
        let addr = listener.local_addr();
        for round in 0..ROUNDS {
            let c = client
                .connect(addr)
                .unwrap_or_else(|e| panic!("{device} round {round}: connect: {e}"));
            let s = listener
                .accept_timeout(HANG)
                .unwrap_or_else(|e| panic!("{device} round {round}: accept: {e}"));
            for i in 0..5u8 {
                ping(&c, &s, &[i; 64]);
                ping(&s, &c, &[i; 64]);
            }
            close_and_wait_cached((&client, &server), (c, s), round, &device);
        }
        let cs = client.conn_stats();
        let ss = server.conn_stats();
        let what = format!("{device}: client {cs:?}, server {ss:?}");
        assert_eq!(
            (cs.qps_created, cs.qp_cache_hits),
            (1, ROUNDS - 1),
            "{what}"
        );
        assert_eq!(
            (ss.qps_created, ss.qp_cache_hits),
            (1, ROUNDS - 1),
            "{what}"
        );
        assert_eq!(cs.failed + ss.failed, 0, "{what}");
    }
}

/// The stream window is announced in the hello and a connection uses the smaller side's: with
/// 8 on the server and 64 on the client, each side may have exactly 8 messages of a channel
/// unconsumed by the other's application, and a reader that takes a quarter of it (2) lets
/// the sender go on.
#[test]
fn the_stream_window_is_negotiated_to_the_smaller_side() {
    for device in devices() {
        let base = Config {
            device: device.clone(),
            progress: fabriq::Progress::Caller,
            handshake_timeout_ms: 10_000,
            ..Config::default()
        };
        let Ok(server) = Endpoint::new(Config {
            stream_window: 8,
            ..base.clone()
        }) else {
            continue;
        };
        let client = Endpoint::new(Config {
            stream_window: 64,
            ..base
        })
        .expect("client");
        let listener = server.listen("127.0.0.1:0").expect("listen");
        let c = client.connect(listener.local_addr()).expect("connect");
        let s = listener.accept_timeout(HANG).expect("accept");
        for (tx, rx, dir) in [(&c, &s, "client → server"), (&s, &c, "server → client")] {
            for i in 0..8u32 {
                tx.try_send(&i.to_le_bytes())
                    .unwrap_or_else(|e| panic!("{device} {dir}: message {i}: {e}"));
            }
            assert!(
                matches!(tx.try_send(b"ninth"), Err(ChannelError::WouldBlock)),
                "{device} {dir}: a ninth unconsumed message"
            );
            assert!(matches!(
                tx.send_timeout(b"ninth", Duration::from_millis(300)),
                Err(ChannelError::Timeout)
            ));
            for i in 0..2u32 {
                assert_eq!(&rx.recv_timeout(HANG).expect("recv")[..], &i.to_le_bytes());
            }
            // Two consumed: the report lets two more go.
            tx.send_timeout(b"ninth", HANG)
                .expect("room after the report");
            tx.send_timeout(b"tenth", HANG)
                .expect("room after the report");
            for i in 2..8u32 {
                assert_eq!(&rx.recv_timeout(HANG).expect("recv")[..], &i.to_le_bytes());
            }
            assert_eq!(&rx.recv_timeout(HANG).expect("recv")[..], b"ninth");
            assert_eq!(&rx.recv_timeout(HANG).expect("recv")[..], b"tenth");
        }
    }
}

/// The accepting side hands its channel out once its hello-ack is sent, before the peer's
/// `Ready`; what it sends meanwhile waits for the peer. A peer that stops after the hello-ack
/// (its QP never leaves INIT, no `Ready`) fails that channel once the handshake timeout has
/// passed, with nothing delivered; a peer that gives up (its half-done handshake dropped: it
/// sends a reject) fails it at once. An established channel of the same listener keeps working
/// throughout.
#[test]
fn an_accepted_channel_fails_when_its_peer_never_finishes_the_handshake() {
    for device in devices() {
        let cfg = Config {
            device: device.clone(),
            handshake_timeout_ms: 400,
            ..Config::default()
        };
        let Some((_server, client, listener)) = server_client_listener(cfg) else {
            continue;
        };
        let addr = listener.local_addr();
        let c = client.connect(addr).expect("connect");
        let s = listener.accept_timeout(HANG).expect("accept");
        ping(&c, &s, b"before");
        let raw = raw_peer(&device);
        for abandon in [false, true] {
            let mut pending = Some(
                raw.connect_pending(addr, None, HANG)
                    .expect("hello and hello-ack"),
            );
            let early = listener
                .accept_timeout(HANG)
                .expect("accepted before the peer's Ready");
            early.send(b"held").expect("a send is queued, not refused");
            let started = Instant::now();
            if abandon {
                drop(pending.take());
            }
            match early.recv_timeout(HANG) {
                Err(ChannelError::PeerGone) if abandon => {}
                Err(ChannelError::Failed(why)) if !abandon => {
                    assert!(why.contains("handshake"), "{device}: {why}");
                    assert!(
                        started.elapsed() >= Duration::from_millis(300),
                        "{device}: failed before the handshake timeout"
                    );
                }
                other => panic!("{device} (abandon {abandon}): {other:?}"),
            }
            drop(pending);
            ping(&s, &c, b"still here");
        }
    }
}

/// An accepted connection whose peer never sends its `Ready` fails at the handshake's deadline
/// even when no application thread calls in: the worker thread, asleep, wakes for it. The
/// channel is only looked at (`is_closed`, no progress pass) until then.
#[test]
fn a_sleeping_worker_fails_an_accepted_connection_whose_peer_stays_silent() {
    for device in devices() {
        let cfg = Config {
            device: device.clone(),
            handshake_timeout_ms: 300,
            ..Config::default()
        };
        let Some((_server, _client, listener)) = server_client_listener(cfg) else {
            continue;
        };
        let addr = listener.local_addr();
        let raw = raw_peer(&device);
        let pending = raw
            .connect_pending(addr, None, HANG)
            .expect("hello and hello-ack");
        let early = listener
            .accept_timeout(HANG)
            .expect("accepted before the peer's Ready");
        let started = Instant::now();
        while !early.is_closed() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{device}: the silent peer's connection never failed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        match early.try_recv() {
            Err(ChannelError::Failed(why)) => assert!(why.contains("handshake"), "{device}: {why}"),
            other => panic!("{device}: {other:?}"),
        }
        drop(pending);
    }
}

/// What the close tests send, in order: 48 eager messages (more than the receive ring's
/// credits), one of 1 MiB (rendezvous: the peer pulls it from the sender's memory) and a last
/// small one. Returns what was sent.
fn send_close_batch(ch: &Channel, tag: u8) -> Vec<Vec<u8>> {
    let mut sent: Vec<Vec<u8>> = (0..48u32)
        .map(|i| [&i.to_le_bytes()[..], &[tag; 60][..]].concat())
        .collect();
    sent.push((0..1usize << 20).map(|i| (i as u8) ^ tag).collect());
    sent.push(b"last".to_vec());
    for m in &sent {
        ch.send(m).expect("send");
    }
    sent
}

/// Read `ch` until it ends: what arrived and how it ended.
fn read_until_end(ch: &Channel) -> (Vec<Vec<u8>>, ChannelError) {
    let mut got = Vec::new();
    loop {
        match ch.recv_timeout(HANG) {
            Ok(m) => got.push(m.to_vec()),
            Err(e) => return (got, e),
        }
    }
}

/// `got` is `sent`, in order, and the channel then ended with `PeerGone`.
fn assert_all_delivered(sent: &[Vec<u8>], (got, end): (Vec<Vec<u8>>, ChannelError), what: &str) {
    assert_eq!(
        got.len(),
        sent.len(),
        "{what}: messages lost (ended with {end})"
    );
    for (i, (g, s)) in got.iter().zip(sent).enumerate() {
        assert!(g == s, "{what}: message {i} differs");
    }
    assert!(
        matches!(end, ChannelError::PeerGone),
        "{what}: ended with {end}"
    );
}

/// Messages sent just before the connecting side closes its last channel on a connection all
/// arrive, in order: eager ones still waiting for credit or acknowledgement and a rendezvous
/// one the peer has yet to pull (its buffer must outlive the close), like a TCP close that
/// delivers what was written before it. Then the reader sees `PeerGone`, and the closed
/// connection's QP still goes back to the cache.
#[test]
fn what_was_sent_before_a_close_is_delivered() {
    for device in devices() {
        let cfg = Config {
            device: device.clone(),
            handshake_timeout_ms: 10_000,
            ..Config::default()
        };
        let Some((server, client, listener)) = server_client_listener(cfg) else {
            continue;
        };
        let addr = listener.local_addr();
        for round in 0..3u64 {
            let ch = client.connect(addr).expect("connect");
            let s = listener.accept_timeout(HANG).expect("accept");
            let sent = send_close_batch(&ch, round as u8);
            drop(ch);
            let what = format!("{device} round {round}");
            assert_all_delivered(&sent, read_until_end(&s), &what);
            drop(s);
            wait_stats(&client, "client QP back in the cache", |st| {
                st.qps_cached >= 1 && st.connects > round
            });
            wait_stats(&server, "server QP back in the cache", |st| {
                st.qps_cached >= 1 && st.accepts > round
            });
        }
    }
}

/// The same when the sending side drops its endpoint right after the channel, or before it
/// (the channel then holds the last handle: the workers stop with it): they deliver what was
/// sent before stopping, in both progress modes, whether the sender connected or accepted.
#[test]
fn what_was_sent_before_the_endpoint_is_dropped_is_delivered() {
    let modes = [fabriq::Progress::Thread, fabriq::Progress::Caller];
    for device in devices() {
        for progress in modes {
            for (accepted_sends, endpoint_first) in
                [(false, false), (false, true), (true, false), (true, true)]
            {
                let cfg = Config {
                    device: device.clone(),
                    handshake_timeout_ms: 10_000,
                    progress,
                    ..Config::default()
                };
                let Some((server, client, listener)) = server_client_listener(cfg) else {
                    continue;
                };
                let what = format!(
                    "{device} {progress:?} accepted side sends: {accepted_sends}, \
                     endpoint first: {endpoint_first}"
                );
                let c = client.connect(listener.local_addr()).expect("connect");
                let s = listener.accept_timeout(HANG).expect("accept");
                drop(listener);
                let (sender, sender_ep, reader, reader_ep) = if accepted_sends {
                    (s, server, c, client)
                } else {
                    (c, client, s, server)
                };
                let sent = send_close_batch(&sender, 9);
                // The reader runs meanwhile: the endpoint's drop waits for the deliveries.
                let reading = std::thread::spawn(move || read_until_end(&reader));
                if endpoint_first {
                    drop(sender_ep);
                    drop(sender);
                } else {
                    drop(sender);
                    drop(sender_ep);
                }
                assert_all_delivered(&sent, reading.join().expect("reader"), &what);
                drop(reader_ep);
            }
        }
    }
}

/// The connecting side posts its ring while the hello-ack is on its way, before it knows the
/// server's ring, and then takes the server's geometry: a client with a larger ring than the
/// server's sends a reader that does not read no more than the server's ring holds
/// (`rnr_retry = 0`: one SEND into a full ring would fail the connection), on a fresh QP and
/// on a cached one.
#[test]
fn a_client_with_a_larger_ring_sends_no_more_than_the_servers_ring_holds() {
    for device in devices() {
        let base = Config {
            device: device.clone(),
            rnr_retry: 0,
            handshake_timeout_ms: 10_000,
            ..Config::default()
        };
        let Ok(server) = Endpoint::new(Config {
            rx_slots: 4,
            ..base.clone()
        }) else {
            eprintln!("skipping {device}");
            continue;
        };
        let client = Endpoint::new(Config {
            rx_slots: 64,
            ..base
        })
        .expect("client");
        let listener = server.listen("127.0.0.1:0").expect("listen");
        for round in 0..2 {
            let c = client.connect(listener.local_addr()).expect("connect");
            let s = listener.accept_timeout(HANG).expect("accept");
            let mut sent = 0u64;
            let deadline = Instant::now() + HANG;
            loop {
                match c.send_timeout(&sent.to_le_bytes(), Duration::from_millis(500)) {
                    Ok(()) => sent += 1,
                    Err(ChannelError::Timeout) => break,
                    Err(e) => panic!("{device} round {round}: send {sent}: {e}"),
                }
                assert!(Instant::now() < deadline, "{device}: never back-pressured");
            }
            assert!(sent > 4, "{device} round {round}: only {sent} sent");
            for i in 0..sent {
                let m = s
                    .recv_timeout(HANG)
                    .unwrap_or_else(|e| panic!("{device} round {round}: message {i}: {e}"));
                assert_eq!(m[..8], i.to_le_bytes(), "{device} round {round}");
            }
            ping(&c, &s, b"after");
            ping(&s, &c, b"back");
            assert!(!c.is_closed() && !s.is_closed(), "{device} round {round}");
            close_and_wait_cached((&client, &server), (c, s), round, &device);
        }
        assert!(
            client.conn_stats().qp_cache_hits >= 1,
            "{device}: the second connect reused a QP: {:?}",
            client.conn_stats()
        );
    }
}
