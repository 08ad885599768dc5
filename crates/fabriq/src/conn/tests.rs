//! Handshake, QP cache and error-path tests on the heap test context (QPs that only keep their
//! state machine), with raw `TcpStream`s playing misbehaving peers. Every wait is bounded by a
//! handshake timeout; none asserts on speed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use fabriq_verbs::{QpState, QueuePair};

use super::wire::{self, Message};
use super::*;
use crate::mempool::testing::{heap_cq, heap_pd_named, HeapCounters};

const LONG: Duration = Duration::from_secs(10);
const SHORT: Duration = Duration::from_millis(300);

/// `err` is a handshake timeout in `phase` (after exactly `after`, when given).
#[track_caller]
fn assert_timeout(err: &ConnError, phase: &str, after: Option<Duration>) {
    match err {
        ConnError::Timeout {
            phase: p, after: a, ..
        } => {
            assert_eq!(*p, phase, "{err}");
            if let Some(want) = after {
                assert_eq!(*a, want, "{err}");
            }
        }
        other => panic!("expected a timeout in {phase}, got {other}"),
    }
}

fn manager_named(provider: &'static str, cfg: ConnConfig) -> (ConnManager, Arc<HeapCounters>) {
    let (pd, counters) = heap_pd_named(provider);
    let cq = heap_cq(&pd);
    (ConnManager::new(&pd, &cq, cfg).unwrap(), counters)
}

fn manager(cfg: ConnConfig) -> (ConnManager, Arc<HeapCounters>) {
    manager_named("heap", cfg)
}

fn short_cfg() -> ConnConfig {
    ConnConfig {
        handshake_timeout: SHORT,
        ..ConnConfig::default()
    }
}

/// The next peer of `listener` accepted whole, the control stream kept (`finish_owned`).
fn accept_owned(listener: &Listener) -> (Established, ControlStream) {
    listener
        .accept_pending(Some(LONG))
        .unwrap()
        .finish_owned()
        .unwrap()
}

/// A connect of `cli` to `addr`, the control stream kept (`finish_owned`).
fn connect_owned(cli: &ConnManager, addr: SocketAddr) -> (Established, ControlStream) {
    cli.connect_pending(addr, None, LONG)
        .unwrap()
        .finish_owned()
        .unwrap()
}

/// A server thread accepting `n` peers, answering each with `accept_with`.
fn serve(listener: Listener, n: usize) -> JoinHandle<Vec<Result<Established, ConnError>>> {
    std::thread::spawn(move || {
        (0..n)
            .map(|_| {
                listener.accept_with(Some(LONG), |qp, _| {
                    assert_eq!(qp.state(), QpState::Init, "receives are posted in INIT");
                    Ok(())
                })
            })
            .collect()
    })
}

#[test]
fn handshake_exchanges_hellos_and_reaches_rts_after_receives_could_be_posted() {
    let server_cfg = ConnConfig {
        worker_id: 7,
        ring: RingGeometry {
            slots: 32,
            slot_size: 8192,
        },
        initial_credits: 30,
        eager_threshold: 8000,
        ..ConnConfig::default()
    };
    let (srv, _) = manager(server_cfg);
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let server = serve(listener, 1);
    let (cli, _) = manager(ConnConfig {
        worker_id: 3,
        ..ConnConfig::default()
    });
    let mut prepared = false;
    let est = cli
        .connect_with(addr, Some(7), LONG, |qp, peer| {
            assert_eq!(qp.state(), QpState::Init);
            assert_eq!(peer.ring.slots, 32);
            prepared = true;
            Ok(())
        })
        .unwrap();
    assert!(prepared);
    let srv_est = server.join().unwrap().pop().unwrap().unwrap();
    assert_eq!(est.role, Role::Client);
    assert_eq!(srv_est.role, Role::Server);
    assert_eq!(est.qp.state(), QpState::Rts);
    assert_eq!(srv_est.qp.state(), QpState::Rts);
    assert_eq!(est.peer.worker_id, 7);
    assert_eq!(est.peer.initial_credits, 30);
    assert_eq!(est.peer.eager_threshold, 8000);
    assert_eq!(est.peer.ring.slot_size, 8192);
    assert_eq!(srv_est.peer.worker_id, 3);
    assert_eq!(srv_est.peer.target_worker, Some(7));
    assert_eq!(est.peer.endpoint, srv_est.qp.endpoint());
    assert_eq!(srv_est.peer.endpoint, est.qp.endpoint());
    assert_eq!(
        est.qp.query().remote.as_ref(),
        Some(&srv_est.qp.endpoint()),
        "client QP connected to the server's"
    );
    assert_eq!(est.local, srv_est.peer);
    assert_eq!(cli.stats().connects, 1);
    assert_eq!(srv.stats().accepts, 1);
}

/// Control streams on this host: with local streams on (the default), the first connect goes
/// over TCP and the later ones over the listener's local socket, opened once and then kept;
/// without, the one TCP stream serves every connect.
fn stream_cfg(local: bool) -> ConnConfig {
    ConnConfig {
        local_control_streams: local,
        ..ConnConfig::default()
    }
}

/// `(streams opened, of them local, reuses)` after `n` connects to one peer of this host.
fn expected_streams(local: bool, n: u64) -> (u64, u64, u64) {
    match local {
        true => (2, 1, n - 2),
        false => (1, 0, n - 1),
    }
}

#[test]
fn released_qps_and_control_streams_are_reused() {
    for local in [false, true] {
        released_qps_and_control_streams_are_reused_with(local);
    }
}

fn released_qps_and_control_streams_are_reused_with(local: bool) {
    let (srv, srv_counters) = manager(stream_cfg(local));
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let server = std::thread::spawn(move || {
        for _ in 0..5 {
            let est = listener
                .accept_pending(Some(LONG))
                .unwrap()
                .finish()
                .unwrap();
            listener.manager().release(est);
        }
    });
    let (cli, cli_counters) = manager(stream_cfg(local));
    let mut qp_nums = Vec::new();
    for i in 0..5 {
        let est = cli.connect(addr, LONG).unwrap();
        assert_eq!(est.reused_qp, i > 0, "connect {i}");
        qp_nums.push(est.qp.qp_num());
        cli.release(est);
    }
    server.join().unwrap();
    assert!(
        qp_nums.iter().all(|&n| n == qp_nums[0]),
        "one QP serves all"
    );
    let s = cli.stats();
    assert_eq!(
        (s.qps_created, s.qp_cache_hits, s.qp_cache_misses),
        (1, 4, 1)
    );
    assert_eq!(
        (s.streams_opened, s.local_streams_opened, s.stream_reuses),
        expected_streams(local, 5),
        "local {local}"
    );
    assert_eq!(s.qps_cached, 1);
    assert_eq!(cli_counters.qps_created.load(Ordering::SeqCst), 1);
    assert_eq!(srv_counters.qps_created.load(Ordering::SeqCst), 1);
    assert_eq!(srv.stats().accepts, 5);
}

#[test]
fn qp_cache_is_bounded_and_resets_what_it_keeps() {
    let (m, counters) = manager(ConnConfig {
        qp_cache_capacity: 2,
        ..ConnConfig::default()
    });
    assert_eq!(m.prewarm(5).unwrap(), 2);
    assert_eq!(
        counters.qps_live.load(Ordering::SeqCst),
        2,
        "the third was destroyed"
    );
    let qp = m.qp_cache().take().unwrap();
    qp.modify(&fabriq_verbs::QpAttr::init(m.config().access))
        .unwrap();
    assert!(m.release_qp(qp));
    let qp: QueuePair = m.qp_cache().take().unwrap();
    assert_eq!(qp.state(), QpState::Reset, "cached QPs are in RESET");
    drop(qp);
    let cache = m.qp_cache();
    assert_eq!((cache.len(), cache.hits(), cache.dropped()), (1, 2, 1));
}

/// The listener a client kept a stream to (or learnt the local socket of) goes away and a new
/// one listens on its address: the next connect reaches the new one, transparently. Without
/// local streams the kept TCP stream reads EOF and a fresh one replaces it; with them, the old
/// listener's local socket refuses the connect, its name is forgotten, TCP reaches the new
/// listener, and the connect after that uses the new listener's local socket.
#[test]
fn a_stale_idle_stream_is_replaced_transparently() {
    for local in [false, true] {
        let (srv, _) = manager(stream_cfg(local));
        let listener = srv.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr();
        let server = serve(listener, 1);
        let (cli, _) = manager(stream_cfg(local));
        cli.connect(addr, LONG).unwrap();
        // The listener is dropped when its thread ends, closing the stream the client kept.
        server.join().unwrap().pop().unwrap().unwrap();
        let listener = srv.listen(addr).unwrap();
        let server = serve(listener, 2);
        let est = cli.connect(addr, LONG).unwrap();
        let s = cli.stats();
        assert_eq!(
            (s.streams_opened, s.local_streams_opened, s.stream_reuses),
            (2, 0, 0),
            "local {local}: a fresh TCP stream replaced it"
        );
        drop(est);
        cli.connect(addr, LONG).unwrap();
        let mut accepted = server.join().unwrap();
        let third = accepted.pop().unwrap().unwrap();
        let second = accepted.pop().unwrap().unwrap();
        assert_ne!(second.peer_addr.port(), 0, "local {local}: over TCP");
        let s = cli.stats();
        match local {
            true => {
                assert_eq!(
                    (s.streams_opened, s.local_streams_opened, s.stream_reuses),
                    (3, 1, 0),
                    "the new listener's local socket"
                );
                assert_eq!(third.peer_addr, "127.0.0.1:0".parse().unwrap());
            }
            false => assert_eq!((s.streams_opened, s.stream_reuses), (2, 1)),
        }
        assert_eq!(s.connects, 3);
        assert_eq!(s.failed, 0);
    }
}

/// A listener names its local socket in every hello-ack when streams are kept and local
/// streams are on, and not otherwise; a client of this host opens its second control stream
/// there (the accepting side reports such a peer at the listener's host, port 0) and keeps it.
#[test]
fn a_peer_on_this_host_gets_its_later_control_streams_on_a_local_socket() {
    for (reuse, local, named) in [
        (true, true, true),
        (true, false, false),
        (false, true, false),
    ] {
        let cfg = ConnConfig {
            reuse_control_streams: reuse,
            local_control_streams: local,
            ..ConnConfig::default()
        };
        let (srv, _) = manager(cfg.clone());
        let listener = srv.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr();
        let server = serve(listener, 3);
        let (cli, _) = manager(cfg);
        let mut names = Vec::new();
        for _ in 0..3 {
            let est = cli.connect(addr, LONG).unwrap();
            names.push(est.peer.local_control.clone());
            cli.release(est);
        }
        let accepted: Vec<Established> = server
            .join()
            .unwrap()
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let what = format!("reuse {reuse}, local {local}");
        assert!(names.iter().all(|n| *n == names[0]), "{what}: {names:?}");
        assert_eq!(!names[0].is_empty(), named, "{what}: {names:?}");
        assert!(accepted.iter().all(|e| e.local.local_control == names[0]));
        let s = cli.stats();
        let ports: Vec<u16> = accepted.iter().map(|e| e.peer_addr.port()).collect();
        if named {
            assert!(names[0].starts_with("fabriq-ctl/"), "{names:?}");
            assert_eq!(
                (s.streams_opened, s.local_streams_opened, s.stream_reuses),
                (2, 1, 1),
                "{what}"
            );
            assert!(ports[0] != 0 && ports[1] == 0 && ports[2] == 0, "{ports:?}");
        } else {
            assert_eq!(s.local_streams_opened, 0, "{what}");
            assert!(ports.iter().all(|&p| p != 0), "{what}: {ports:?}");
        }
    }
}

/// A peer names a local socket nobody listens on (a listener of another network namespace
/// behind a forwarded port would look so): the connect after the first tries it, finds
/// nothing, and goes over TCP; that name is not tried again, and the TCP stream is kept and
/// serves the third connect. Nothing fails.
#[test]
fn a_local_socket_nobody_listens_on_sends_the_connect_back_to_tcp() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let mut handshakes = Vec::new();
        // The first stream serves one handshake, the second two.
        for n in [1, 2] {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(LONG)).unwrap();
            for _ in 0..n {
                let Some(Message::Hello(h)) = read_frame(&mut s) else {
                    panic!("no hello");
                };
                let mut ack = server_hello_like(&h);
                ack.local_control = "fabriq-ctl/0/0000000000000000".into();
                s.write_all(&wire::encode(&Message::HelloAck(ack))).unwrap();
                assert_eq!(read_frame(&mut s), Some(Message::Ready));
            }
            handshakes.push(n);
        }
        handshakes
    });
    let (cli, _) = manager(ConnConfig::default());
    for _ in 0..3 {
        let est = cli.connect(addr, LONG).unwrap();
        cli.release(est);
    }
    assert_eq!(server.join().unwrap(), vec![1, 2]);
    let s = cli.stats();
    assert_eq!(
        (
            s.streams_opened,
            s.local_streams_opened,
            s.stream_reuses,
            s.failed
        ),
        (2, 0, 1, 0)
    );
}

#[test]
fn refused() {
    let addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (cli, counters) = manager(ConnConfig::default());
    let err = cli.connect(addr, LONG).unwrap_err();
    assert!(
        matches!(err, ConnError::Refused { addr: a, .. } if a == addr),
        "{err}"
    );
    assert_eq!(cli.stats().failed, 1);
    assert_eq!(cli.stats().qps_cached, 1, "the QP went back to the cache");
    assert_eq!(counters.qps_live.load(Ordering::SeqCst), 1);
}

/// A raw peer: accepts one connection and runs `f` on it.
fn raw_server(f: impl FnOnce(TcpStream) + Send + 'static) -> (SocketAddr, JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(LONG)).unwrap();
        f(s)
    });
    (addr, h)
}

fn read_frame(s: &mut TcpStream) -> Option<Message> {
    let mut prefix = [0u8; 4];
    s.read_exact(&mut prefix).ok()?;
    let len = wire::frame_len(prefix).ok()?;
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).ok()?;
    wire::decode_body(&body).ok()
}

fn server_hello_like(h: &Hello) -> Hello {
    let mut h = h.clone();
    h.target_worker = None;
    h
}

#[test]
fn client_times_out_when_the_server_never_answers() {
    let (addr, h) = raw_server(|mut s| {
        let _ = read_frame(&mut s);
        let mut sink = [0u8; 16];
        let _ = s.read(&mut sink); // until the client gives up
    });
    let (cli, _) = manager(ConnConfig::default());
    let err = cli.connect(addr, SHORT).unwrap_err();
    assert_timeout(&err, "hello-ack", Some(SHORT));
    h.join().unwrap();
}

#[test]
fn server_times_out_on_a_silent_client_and_keeps_listening() {
    let (srv, _) = manager(short_cfg());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let silent = TcpStream::connect(listener.local_addr()).unwrap();
    let err = listener.next_incoming(Some(LONG)).unwrap_err();
    assert_timeout(&err, "hello", None);
    drop(silent);
    // Nothing pending: an accept with a deadline reports it.
    let err = listener
        .next_incoming(Some(Duration::from_millis(20)))
        .unwrap_err();
    assert_timeout(&err, "accept", None);
    // Still usable.
    let addr = listener.local_addr();
    let server = serve(listener, 1);
    let (cli, _) = manager(ConnConfig::default());
    cli.connect(addr, LONG).unwrap();
    server.join().unwrap().pop().unwrap().unwrap();
}

/// A peer that connects and says nothing, or sends part of a frame, holds up no other peer:
/// the listener takes the next one's hello while they wait, and drops each of them, one per
/// call, when its deadline passes.
#[test]
fn a_silent_or_half_sent_peer_holds_up_no_other_handshake() {
    let (srv, _) = manager(ConnConfig {
        handshake_timeout: Duration::from_millis(1_500),
        ..ConnConfig::default()
    });
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let frame = wire::encode(&Message::Ready);
    let mut stalled = vec![TcpStream::connect(addr).unwrap()];
    for part in [&frame[..2], &frame[..frame.len() - 1]] {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(part).unwrap();
        stalled.push(s);
    }
    std::thread::sleep(Duration::from_millis(20));
    let client = std::thread::spawn(move || {
        let (cli, _) = manager(ConnConfig::default());
        cli.connect(addr, LONG).map(|_| ())
    });
    // The first peer to finish its hello is the real client's, before any deadline.
    let first = listener.accept_with(Some(LONG), |_, _| Ok(()));
    let started = std::time::Instant::now();
    assert!(first.is_ok(), "{:?}", first.err());
    client.join().unwrap().expect("the client connected");
    for _ in 0..stalled.len() {
        let err = listener.next_incoming(Some(LONG)).unwrap_err();
        assert_timeout(&err, "hello", None);
    }
    assert!(started.elapsed() < LONG);
    let err = listener
        .next_incoming(Some(Duration::from_millis(20)))
        .unwrap_err();
    assert_timeout(&err, "accept", None);
}

/// Past `MAX_GREETINGS` new peers waiting for their hello at once, the oldest go (closed,
/// counted as failed handshakes), and a client that says its hello is still served.
#[test]
fn past_the_most_waiting_greetings_the_oldest_go() {
    const EXTRA: usize = 8;
    let (srv, _) = manager(ConnConfig {
        handshake_timeout: LONG,
        ..ConnConfig::default()
    });
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    // Connected while the listener accepts (its backlog holds fewer).
    let peers = std::thread::spawn(move || {
        let silent: Vec<TcpStream> = (0..super::manager::MAX_GREETINGS + EXTRA)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let (cli, _) = manager(ConnConfig::default());
        let connected = cli.connect(addr, LONG).map(|_| ());
        (silent, connected)
    });
    let first = listener.accept_with(Some(LONG), |_, _| Ok(()));
    assert!(first.is_ok(), "{:?}", first.err());
    let (mut silent, connected) = peers.join().unwrap();
    connected.expect("the client connected");
    assert_eq!(srv.stats().failed, EXTRA as u64, "{:?}", srv.stats());
    for s in silent.iter_mut().take(EXTRA) {
        s.set_read_timeout(Some(LONG)).unwrap();
        let got = s.read(&mut [0u8; 1]);
        assert!(
            matches!(&got, Ok(0))
                || got
                    .as_ref()
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "an oldest greeting left open: {got:?}"
        );
    }
}

#[test]
fn version_mismatch_from_the_server_side() {
    let (addr, h) = raw_server(|mut s| {
        let Some(Message::Hello(hello)) = read_frame(&mut s) else {
            panic!("expected a hello")
        };
        let reply = Message::HelloAck(server_hello_like(&hello));
        s.write_all(&wire::encode_with_version(&reply, 9)).unwrap();
        let _ = s.read(&mut [0u8; 1]);
    });
    let (cli, _) = manager(ConnConfig::default());
    let err = cli.connect(addr, LONG).unwrap_err();
    assert!(
        matches!(
            err,
            ConnError::VersionMismatch {
                local: VERSION,
                peer: 9
            }
        ),
        "{err}"
    );
    h.join().unwrap();
}

fn raw_client(addr: SocketAddr, frame: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(LONG)).unwrap();
    s.write_all(frame).unwrap();
    s
}

fn some_hello(provider: &str) -> Hello {
    let (m, _) = manager(ConnConfig::default());
    let pd = m.pd().clone();
    let cq = heap_cq(&pd);
    let qp = pd.create_qp(&fabriq_verbs::QpInitAttr::new(&cq)).unwrap();
    let mut ep = qp.endpoint();
    ep.provider = provider.into();
    Hello {
        version: VERSION,
        provider: provider.into(),
        device: format!("{provider}0"),
        endpoint: ep,
        ring: RingGeometry {
            slots: 4,
            slot_size: 64,
        },
        initial_credits: 4,
        eager_threshold: 64,
        rndv_chunk_size: 4096,
        worker_id: 0,
        target_worker: None,
        stream_window: 64,
        auth_token: Vec::new(),
        local_control: String::new(),
    }
}

#[test]
fn version_mismatch_from_the_client_side_is_rejected_with_a_reason() {
    let (srv, _) = manager(short_cfg());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let frame = wire::encode_with_version(&Message::Hello(some_hello("heap")), 9);
    let mut raw = raw_client(listener.local_addr(), &frame);
    let err = listener.next_incoming(Some(LONG)).unwrap_err();
    assert!(
        matches!(
            err,
            ConnError::VersionMismatch {
                local: VERSION,
                peer: 9
            }
        ),
        "{err}"
    );
    let Some(Message::Reject(r)) = read_frame(&mut raw) else {
        panic!("expected a reject")
    };
    assert_eq!(r.code, RejectCode::VersionMismatch);
    assert_eq!(r.version, VERSION);
}

#[test]
fn provider_mismatch_is_refused_on_both_sides() {
    let (srv, _) = manager_named("shm", short_cfg());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let server = std::thread::spawn(move || listener.next_incoming(Some(LONG)).map(|_| ()));
    let (cli, _) = manager_named("tcp", ConnConfig::default());
    let err = cli.connect(addr, LONG).unwrap_err();
    assert!(
        matches!(&err, ConnError::ProviderMismatch { local, peer } if local == "tcp" && peer == "shm"),
        "{err}"
    );
    let err = server.join().unwrap().unwrap_err();
    assert!(
        matches!(&err, ConnError::ProviderMismatch { local, peer } if local == "shm" && peer == "tcp"),
        "{err}"
    );
}

#[test]
fn peer_closed_mid_handshake_on_either_side() {
    let (addr, h) = raw_server(|mut s| {
        let _ = read_frame(&mut s);
        // close without answering
    });
    let (cli, _) = manager(ConnConfig::default());
    let err = cli.connect(addr, LONG).unwrap_err();
    assert!(
        matches!(
            err,
            ConnError::PeerClosed {
                phase: "hello-ack",
                ..
            }
        ),
        "{err}"
    );
    h.join().unwrap();

    // A client that sends its hello, reads the ack, then vanishes before Ready.
    let (srv, _) = manager(short_cfg());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let client = std::thread::spawn(move || {
        let mut s = raw_client(addr, &wire::encode(&Message::Hello(some_hello("heap"))));
        let ack = read_frame(&mut s);
        assert!(matches!(ack, Some(Message::HelloAck(_))));
    });
    let pending = listener.accept_pending(Some(LONG)).unwrap();
    let err = pending.finish().unwrap_err();
    client.join().unwrap();
    assert!(
        matches!(err, ConnError::PeerClosed { phase: "ready", .. }),
        "{err}"
    );
    // The QP had reached RTS: the client could have sent to it, so it is destroyed, not reused.
    let s = srv.stats();
    assert_eq!((s.qps_cached, s.qps_dropped), (0, 1), "{s:?}");
}

#[test]
fn malformed_messages_are_errors_and_the_listener_survives() {
    // Server answers garbage.
    let (addr, h) = raw_server(|mut s| {
        let _ = read_frame(&mut s);
        s.write_all(&[0, 0, 0, 8, 1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        let _ = s.read(&mut [0u8; 1]);
    });
    let (cli, _) = manager(ConnConfig::default());
    let err = cli.connect(addr, LONG).unwrap_err();
    assert!(
        matches!(
            err,
            ConnError::Malformed {
                source: DecodeError::BadMagic(0x0102_0304),
                ..
            }
        ),
        "{err}"
    );
    h.join().unwrap();

    // Server answers a 4 GiB length prefix: refused before any allocation.
    let (addr, h) = raw_server(|mut s| {
        let _ = read_frame(&mut s);
        s.write_all(&[0xff, 0xff, 0xff, 0xff]).unwrap();
        let _ = s.read(&mut [0u8; 1]);
    });
    let err = cli.connect(addr, LONG).unwrap_err();
    assert!(
        matches!(
            err,
            ConnError::Malformed {
                source: DecodeError::TooLong { field: "frame", .. },
                ..
            }
        ),
        "{err}"
    );
    h.join().unwrap();

    // Server answers a valid message out of order.
    let (addr, h) = raw_server(|mut s| {
        let _ = read_frame(&mut s);
        s.write_all(&wire::encode(&Message::Ready)).unwrap();
        let _ = s.read(&mut [0u8; 1]);
    });
    let err = cli.connect(addr, LONG).unwrap_err();
    assert!(
        matches!(
            err,
            ConnError::Unexpected {
                phase: "hello-ack",
                got: "ready",
                ..
            }
        ),
        "{err}"
    );
    h.join().unwrap();

    // A client sends garbage; the listener reports it, tells the client, and keeps working.
    let (srv, _) = manager(short_cfg());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let mut raw = raw_client(addr, b"\0\0\0\x05GET /");
    let err = listener.next_incoming(Some(LONG)).unwrap_err();
    assert!(matches!(err, ConnError::Malformed { .. }), "{err}");
    assert!(matches!(
        read_frame(&mut raw),
        Some(Message::Reject(wire::Reject {
            code: RejectCode::Malformed,
            ..
        }))
    ));
    let server = serve(listener, 1);
    cli.connect(addr, LONG).unwrap();
    server.join().unwrap().pop().unwrap().unwrap();
}

#[test]
fn auth_token_and_target_worker_are_enforced() {
    let (srv, _) = manager(ConnConfig {
        auth_token: b"s3cret".to_vec(),
        worker_id: 2,
        ..short_cfg()
    });
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let server = std::thread::spawn(move || {
        let e1 = listener.accept_pending(Some(LONG)).map(|_| ()).unwrap_err();
        let e2 = listener.accept_pending(Some(LONG)).map(|_| ()).unwrap_err();
        let ok = listener.accept_pending(Some(LONG)).unwrap().finish();
        (e1, e2, ok)
    });
    let (bad, _) = manager(ConnConfig {
        auth_token: b"guess".to_vec(),
        ..ConnConfig::default()
    });
    let err = bad.connect(addr, LONG).unwrap_err();
    assert!(
        matches!(
            err,
            ConnError::Rejected {
                code: RejectCode::AuthFailed,
                ..
            }
        ),
        "{err}"
    );
    let (good, _) = manager(ConnConfig {
        auth_token: b"s3cret".to_vec(),
        ..ConnConfig::default()
    });
    let err = good.connect_pending(addr, Some(5), LONG).unwrap_err();
    assert!(
        matches!(
            err,
            ConnError::Rejected {
                code: RejectCode::Unavailable,
                ..
            }
        ),
        "{err}"
    );
    good.connect_pending(addr, Some(2), LONG)
        .unwrap()
        .finish()
        .unwrap();
    let (e1, e2, ok) = server.join().unwrap();
    assert!(matches!(e1, ConnError::AuthFailed { .. }), "{e1}");
    assert!(
        matches!(
            e2,
            ConnError::WrongWorker {
                requested: 5,
                local: 2
            }
        ),
        "{e2}"
    );
    ok.unwrap();
}

#[test]
fn a_qp_failure_on_the_server_is_reported_to_the_client() {
    let (srv, counters) = manager(short_cfg());
    counters.fail_rtr.store(1, Ordering::SeqCst);
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let server = serve(listener, 1);
    let (cli, _) = manager(ConnConfig::default());
    let err = cli.connect(addr, LONG).unwrap_err();
    assert_rejected_internal(&err);
    let srv_err = server.join().unwrap().pop().unwrap().unwrap_err();
    assert!(matches!(srv_err, ConnError::Verbs(_)), "{srv_err}");
    assert_eq!(srv.stats().qps_cached, 1);
}

#[test]
fn an_abandoned_pending_connection_tells_the_peer() {
    let (srv, _) = manager(short_cfg());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let server = serve(listener, 1);
    let (cli, _) = manager(ConnConfig::default());
    let pending = cli.connect_pending(addr, None, LONG).unwrap();
    drop(pending);
    let err = server.join().unwrap().pop().unwrap().unwrap_err();
    assert_rejected_internal(&err);
    assert_eq!(cli.stats().qps_cached, 1);
}

#[test]
fn a_closed_listener_wakes_its_accept() {
    let (srv, _) = manager(ConnConfig::default());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let closer = listener.closer();
    let t = std::thread::spawn(move || listener.next_incoming(None).map(|_| ()));
    closer.close();
    assert!(matches!(t.join().unwrap(), Err(ConnError::Closed)));
}

#[test]
fn configuration_is_checked() {
    let (pd, _) = heap_pd_named("heap");
    let cq = heap_cq(&pd);
    let bad = [
        ConnConfig {
            ring: RingGeometry {
                slots: 1024,
                slot_size: 64,
            },
            initial_credits: 64,
            ..ConnConfig::default()
        },
        ConnConfig {
            initial_credits: 65,
            ..ConnConfig::default()
        },
        ConnConfig {
            handshake_timeout: Duration::ZERO,
            ..ConnConfig::default()
        },
        ConnConfig {
            handshake_timeout: SHORT,
            handshake_spin: SHORT + Duration::from_nanos(1),
            ..ConnConfig::default()
        },
    ];
    for cfg in bad {
        assert!(matches!(
            ConnManager::new(&pd, &cq, cfg),
            Err(ConnError::InvalidConfig(_))
        ));
    }
}

#[test]
fn an_incoming_peer_can_be_finished_by_another_workers_manager() {
    // One listener (control thread) routes each hello to the worker it asks for.
    let (w0, _) = manager(ConnConfig {
        worker_id: 0,
        ..ConnConfig::default()
    });
    let (w1, w1_counters) = manager(ConnConfig {
        worker_id: 1,
        ..ConnConfig::default()
    });
    let listener = w0.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let workers = [w0.clone(), w1.clone()];
    let server = std::thread::spawn(move || {
        let incoming = listener.next_incoming(Some(LONG)).unwrap();
        let target = incoming.peer().target_worker.unwrap_or(0) as usize;
        // Hand it to the worker's thread, which creates the QP on its own CQ and finishes.
        let mgr = workers[target].clone();
        std::thread::spawn(move || mgr.accept_incoming(incoming)?.finish())
            .join()
            .unwrap()
    });
    let (cli, _) = manager(ConnConfig::default());
    let est = cli
        .connect_pending(addr, Some(1), LONG)
        .unwrap()
        .finish()
        .unwrap();
    let srv_est = server.join().unwrap().unwrap();
    assert_eq!(est.peer.worker_id, 1);
    assert_eq!(srv_est.local.worker_id, 1);
    assert_eq!(w1_counters.qps_created.load(Ordering::SeqCst), 1);
    assert_eq!((w0.stats().accepts, w1.stats().accepts), (0, 1));
}

#[test]
fn handles_cross_threads_where_the_design_says_so() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<ConnManager>();
    send_sync::<Listener>();
    send_sync::<ListenerCloser>();
    send_sync::<ConnPool<u32>>();
    send_sync::<QpCache>();
    send_sync::<ConnError>();
    send::<PendingConn>();
    send::<Incoming>();
    send::<Established>();
    send_sync::<ControlStream>();
    send_sync::<HangupProbe>();
    send_sync::<QpLease>();
    send_sync::<crate::mempool::PoolBuf>();
    send_sync::<crate::mempool::RegCache>();
}

#[test]
fn tcp_connect_times_out_against_a_full_accept_queue() {
    use rustix::net::{AddressFamily, SocketType};
    let fd = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    rustix::net::bind(&fd, &SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    rustix::net::listen(&fd, 0).unwrap();
    let listener = TcpListener::from(fd);
    let addr = listener.local_addr().unwrap();
    // Fill the accept queue (never accepted) until the kernel drops further SYNs.
    let mut fillers = Vec::new();
    let mut saturated = false;
    for _ in 0..16 {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(s) => fillers.push(s),
            Err(_) => {
                saturated = true;
                break;
            }
        }
    }
    if !saturated {
        eprintln!("accept queue never filled on this kernel; nothing to check");
        return;
    }
    let (cli, _) = manager(ConnConfig::default());
    let err = cli.connect(addr, SHORT).unwrap_err();
    assert_timeout(&err, "tcp connect", None);
    drop((fillers, listener));
}

/// Wait (bounded) for `poll_peer` to report something other than `Open`.
fn wait_peer(c: &mut ControlStream) -> ControlEvent {
    let deadline = std::time::Instant::now() + LONG;
    loop {
        match c.poll_peer() {
            ControlEvent::Open if std::time::Instant::now() < deadline => std::thread::yield_now(),
            other => return other,
        }
    }
}

#[test]
fn an_owned_control_stream_says_close_and_serves_the_next_handshake() {
    for local in [false, true] {
        an_owned_control_stream_says_close_and_serves_the_next_handshake_with(local);
    }
}

fn an_owned_control_stream_says_close_and_serves_the_next_handshake_with(local: bool) {
    let (srv, _) = manager(stream_cfg(local));
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    // Each round: the server keeps its stream, then closes first (even rounds) or waits for
    // the client's close (odd rounds); both sides report what they saw.
    let server = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for round in 0..4 {
            let (est, mut control) = accept_owned(&listener);
            control.set_nonblocking(true).unwrap();
            if round % 2 == 1 {
                seen.push(wait_peer(&mut control));
            } else {
                // The client waits for our Close this round: nothing from it yet.
                assert_eq!(control.poll_peer(), ControlEvent::Open, "round {round}");
            }
            drop(control);
            listener.manager().release(est);
        }
        seen
    });
    let (cli, _) = manager(stream_cfg(local));
    let mut seen = Vec::new();
    for round in 0..4 {
        let (est, mut control) = connect_owned(&cli, addr);
        control.set_nonblocking(true).unwrap();
        if round % 2 == 0 {
            seen.push(wait_peer(&mut control));
        }
        control.close();
        cli.release(est);
    }
    assert_eq!(seen, vec![ControlEvent::PeerClosed; 2]);
    assert_eq!(server.join().unwrap(), vec![ControlEvent::PeerClosed; 2]);
    // One TCP connection served all four handshakes (with local streams: the first, and one
    // local stream the other three), and nothing failed.
    let s = cli.stats();
    assert_eq!(
        (s.streams_opened, s.local_streams_opened, s.stream_reuses),
        expected_streams(local, 4),
        "local {local}"
    );
    assert_eq!(s.failed, 0);
    assert_eq!(srv.stats().failed, 0);
}

/// Only the connecting side nudges (`ControlStream::nudge`): the accepting side's owner reads
/// the nudge (`take_nudge`, once) with the connection still open; the accepting side writes
/// nothing (on the connecting side any byte ends the connection: `HangupProbe`).
#[test]
fn only_the_connecting_side_nudges_and_the_peer_reads_it() {
    let (srv, _) = manager(ConnConfig::default());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let (nudged_tx, nudged_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let (est, mut control) = accept_owned(&listener);
        control.set_nonblocking(true).unwrap();
        let wrote = control.nudge();
        let deadline = std::time::Instant::now() + LONG;
        let mut event = control.poll_peer();
        while event == ControlEvent::Open && !control.take_nudge() {
            assert!(std::time::Instant::now() < deadline, "no nudge came");
            std::thread::yield_now();
            event = control.poll_peer();
        }
        let again = control.take_nudge();
        nudged_tx.send((wrote, event, again)).unwrap();
        done_rx.recv().unwrap();
        let closed = wait_peer(&mut control);
        drop(control);
        listener.manager().release(est);
        closed
    });
    let (cli, _) = manager(ConnConfig::default());
    let (est, mut control) = connect_owned(&cli, addr);
    let probe = control.hangup_probe().expect("connecting side");
    assert!(control.nudge(), "the connecting side writes its nudge");
    let (wrote, event, again) = nudged_rx.recv().unwrap();
    assert!(!wrote, "the accepting side wrote a nudge");
    assert_eq!(
        event,
        ControlEvent::Open,
        "a nudge leaves the connection open"
    );
    assert!(!again, "one nudge read, taken once");
    assert!(!probe.ended(), "the connecting side's stream holds no byte");
    done_tx.send(()).unwrap();
    drop(control);
    cli.release(est);
    assert_eq!(server.join().unwrap(), ControlEvent::PeerClosed);
}

#[test]
fn a_control_stream_reports_a_vanished_peer_and_garbage() {
    let (srv, _) = manager(ConnConfig::default());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let server = std::thread::spawn(move || {
        let mut out = Vec::new();
        for _ in 0..2 {
            let (est, mut control) = accept_owned(&listener);
            control.set_nonblocking(true).unwrap();
            out.push((wait_peer(&mut control), control.take_ready()));
            listener.manager().release(est);
        }
        out
    });
    let (cli, _) = manager(ConnConfig {
        reuse_control_streams: false,
        ..ConnConfig::default()
    });
    // The client end vanishes (stream dropped without reuse: EOF at the server).
    let (est, control) = connect_owned(&cli, addr);
    drop(control);
    cli.release(est);
    // The client writes a Ready (the last step of a handshake: read, and told by
    // `take_ready`), then something that is neither a Ready nor a Close.
    let (est, control) = connect_owned(&cli, addr);
    let mut raw = control_stream_clone(&control);
    raw.write_all(&wire::encode(&Message::Ready)).unwrap();
    raw.write_all(&wire::encode(&Message::Reject(wire::Reject {
        code: wire::RejectCode::Internal,
        version: wire::VERSION,
        provider: "shm".into(),
        reason: "gave up".into(),
    })))
    .unwrap();
    assert_eq!(
        server.join().unwrap(),
        vec![(ControlEvent::Gone, false), (ControlEvent::Gone, true)]
    );
    drop(control);
    cli.release(est);
}

/// A connection a client made by hand (its hello written, the hello-ack read), accepted with
/// `finish_accepting`: the server's manager and listener, the client's socket, and the server's
/// side with its control stream non-blocking, as a worker owns it.
fn accepted_by_hand() -> (ConnManager, Listener, TcpStream, Established, ControlStream) {
    accepted_by_hand_with(ConnConfig::default())
}

/// [`accepted_by_hand`] with the server's configuration `cfg`.
fn accepted_by_hand_with(
    cfg: ConnConfig,
) -> (ConnManager, Listener, TcpStream, Established, ControlStream) {
    let (srv, _) = manager(cfg);
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let hello = wire::encode(&Message::Hello(some_hello("heap")));
    let mut c = raw_client(listener.local_addr(), &hello);
    let (est, control) = listener
        .accept_pending(Some(LONG))
        .unwrap()
        .finish_accepting()
        .unwrap();
    control.set_nonblocking(true).unwrap();
    assert!(matches!(read_frame(&mut c), Some(Message::HelloAck(_))));
    (srv, listener, c, est, control)
}

/// A kept control stream whose peer sends part of its next hello and stalls holds up no other
/// peer: that hello waits beside the others, and the stream is reported at its deadline.
#[test]
fn a_kept_stream_with_part_of_a_hello_holds_up_no_other_handshake() {
    let (srv, listener, mut c, est, mut control) = accepted_by_hand_with(ConnConfig {
        handshake_timeout: Duration::from_millis(1_500),
        ..ConnConfig::default()
    });
    let hello = wire::encode(&Message::Hello(some_hello("heap")));
    let mut all = wire::encode(&Message::Ready);
    all.extend(wire::encode(&Message::Close));
    all.extend_from_slice(&hello[..hello.len() - 3]);
    c.write_all(&all).unwrap();
    assert_eq!(wait_peer(&mut control), ControlEvent::PeerClosed);
    drop(control);
    srv.release(est);
    let addr = listener.local_addr();
    let client = std::thread::spawn(move || {
        let (cli, _) = manager(ConnConfig::default());
        cli.connect(addr, LONG).map(|_| ())
    });
    let first = listener.accept_with(Some(LONG), |_, _| Ok(()));
    assert!(first.is_ok(), "{:?}", first.err());
    client.join().unwrap().expect("the client connected");
    let err = listener.next_incoming(Some(LONG)).unwrap_err();
    assert_timeout(&err, "hello", None);
    drop(c);
}

/// The owner of an accepted control stream reads the peer's `Ready`, `Nudge` and `Close` and
/// not a byte more, whole frames in one receive each (never past the end of one): the next
/// connection's hello, written behind them in one write, is served on the stream given back.
#[test]
fn an_owned_control_stream_reads_up_to_the_close_and_serves_the_hello_behind_it() {
    let (srv, listener, mut c, est, mut control) = accepted_by_hand();
    let frame = |m: Message| wire::encode(&m);
    let mut all = frame(Message::Ready);
    all.extend(frame(Message::Nudge));
    all.extend(frame(Message::Close));
    all.extend(frame(Message::Hello(some_hello("heap"))));
    c.write_all(&all).unwrap();
    assert_eq!(wait_peer(&mut control), ControlEvent::PeerClosed);
    assert!(
        control.take_ready(),
        "the Ready in front of the Close was read"
    );
    assert!(
        control.take_nudge(),
        "the Nudge in front of the Close was read"
    );
    drop(control);
    srv.release(est);
    let next = serve(listener, 1);
    assert!(matches!(read_frame(&mut c), Some(Message::HelloAck(_))));
    c.write_all(&frame(Message::Ready)).unwrap();
    assert!(next.join().unwrap().iter().all(Result::is_ok));
    assert_eq!(srv.stats().failed, 0);
}

/// A frame shorter than the shortest a peer can send breaks the control stream (it is not
/// read past, nor taken for the start of a longer one).
#[test]
fn a_frame_shorter_than_any_breaks_the_control_stream() {
    let (srv, _listener, mut c, est, mut control) = accepted_by_hand();
    // A prefix that announces 2 bytes, then a whole Ready.
    let mut bad = 2u32.to_be_bytes().to_vec();
    bad.extend([0xAB, 0xCD]);
    bad.extend(wire::encode(&Message::Ready));
    c.write_all(&bad).unwrap();
    assert_eq!(wait_peer(&mut control), ControlEvent::Gone);
    assert!(!control.take_ready());
    drop(control);
    srv.release(est);
}

/// Wait (bounded) until `probe` says the connection ended.
fn wait_ended(probe: &HangupProbe) -> bool {
    let deadline = std::time::Instant::now() + LONG;
    while !probe.ended() {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

#[test]
fn a_hangup_probe_sees_the_end_of_a_connection_before_its_owner_reads_it() {
    for local in [false, true] {
        a_hangup_probe_sees_the_end_of_a_connection_before_its_owner_reads_it_with(local);
    }
}

fn a_hangup_probe_sees_the_end_of_a_connection_before_its_owner_reads_it_with(local: bool) {
    use std::sync::mpsc;
    let (srv, _) = manager(stream_cfg(local));
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let (go, step) = mpsc::channel::<()>();
    let (done, stepped) = mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        // Round 1: the server closes the connection (`Close`; the stream stays for the next).
        let (est, mut control) = accept_owned(&listener);
        assert!(control.hangup_probe().is_none(), "accepting side: no probe");
        step.recv().unwrap();
        drop(control);
        listener.manager().release(est);
        done.send(()).unwrap();
        // Round 2, on the same stream (with local streams: on a local one): the server hangs
        // up without a `Close`.
        let (est, control) = accept_owned(&listener);
        step.recv().unwrap();
        control_stream_clone(&control)
            .shutdown(std::net::Shutdown::Write)
            .unwrap();
        done.send(()).unwrap();
        step.recv().unwrap();
        drop(control);
        listener.manager().release(est);
    });
    let (cli, _) = manager(stream_cfg(local));

    let (est, mut first) = connect_owned(&cli, addr);
    first.set_nonblocking(true).unwrap();
    let p1 = first.hangup_probe().expect("connecting side: a probe");
    assert!(!p1.ended(), "a live connection");
    go.send(()).unwrap();
    stepped.recv().unwrap();
    // The server's `Close` is in the socket; nobody has read it.
    assert!(wait_ended(&p1), "the probe saw the server's Close");
    assert!(p1.clone().ended(), "clones answer alike");
    // Looking took nothing: the owner still reads the Close.
    assert_eq!(wait_peer(&mut first), ControlEvent::PeerClosed);
    drop(first); // the stream goes back to the idle set
    cli.release(est);
    assert!(p1.ended(), "the connection ended here too");

    // The same stream serves the next connection (with local streams: a local stream does);
    // the old probe does not look at it.
    let (est, mut second) = connect_owned(&cli, addr);
    let s = cli.stats();
    assert_eq!(
        (s.stream_reuses, s.local_streams_opened),
        if local { (0, 1) } else { (1, 0) },
        "the kept stream was reused, or a local one opened"
    );
    second.set_nonblocking(true).unwrap();
    let p2 = second.hangup_probe().expect("a probe");
    assert!(!p2.ended(), "a live connection");
    assert!(p1.ended(), "an earlier connection's probe stays ended");
    go.send(()).unwrap();
    stepped.recv().unwrap();
    // A hang-up without `Close` (EOF) ends it as well.
    assert!(wait_ended(&p2), "the probe saw the hang-up");
    assert_eq!(wait_peer(&mut second), ControlEvent::Gone);
    go.send(()).unwrap();
    drop(second);
    cli.release(est);
    server.join().unwrap();
}

/// A second handle on the stream under `c`, to misbehave through.
fn control_stream_clone(c: &ControlStream) -> TcpStream {
    use std::os::fd::AsFd;
    TcpStream::from(c.as_fd().try_clone_to_owned().unwrap())
}

#[test]
fn a_pending_connection_can_be_rejected_with_a_reason() {
    let (srv, _) = manager(ConnConfig::default());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let server = std::thread::spawn(move || {
        let pending = listener.accept_pending(Some(LONG)).unwrap();
        pending.reject(RejectCode::Unavailable, "ring too small");
        listener.manager().stats()
    });
    let (cli, _) = manager(ConnConfig::default());
    match cli.connect(addr, LONG) {
        Err(ConnError::Rejected { code, reason, .. }) => {
            assert_eq!(code, RejectCode::Unavailable);
            assert_eq!(reason, "ring too small");
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    let s = server.join().unwrap();
    assert_eq!((s.failed, s.qps_cached), (1, 1), "{s:?}");
}

/// A spin budget as long as the handshake timeout: every wait of the handshake is then a
/// busy-poll from start to deadline, and each must still end with its typed error.
fn spinning_cfg() -> ConnConfig {
    ConnConfig {
        handshake_timeout: SHORT,
        handshake_spin: SHORT,
        ..ConnConfig::default()
    }
}

#[test]
fn every_handshake_wait_times_out_with_its_typed_error_while_spinning() {
    // Client waiting for a hello-ack that never comes.
    let (addr, h) = raw_server(|mut s| {
        let _ = read_frame(&mut s);
        let mut sink = [0u8; 16];
        let _ = s.read(&mut sink); // until the client gives up
    });
    let (cli, _) = manager(spinning_cfg());
    let err = cli.connect(addr, SHORT).unwrap_err();
    assert_timeout(&err, "hello-ack", Some(SHORT));
    h.join().unwrap();
    assert_eq!(cli.stats().qps_cached, 1, "the QP went back to the cache");

    // Listener: nothing arrives before its deadline.
    let (srv, _) = manager(spinning_cfg());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let err = listener
        .next_incoming(Some(Duration::from_millis(20)))
        .unwrap_err();
    assert_timeout(&err, "accept", None);

    // Listener: a peer connects and never says hello.
    let silent = TcpStream::connect(listener.local_addr()).unwrap();
    let err = listener.next_incoming(Some(LONG)).unwrap_err();
    assert_timeout(&err, "hello", None);
    drop(silent);

    // Server waiting for a Ready that never comes.
    let addr = listener.local_addr();
    let client = std::thread::spawn(move || {
        let mut s = raw_client(addr, &wire::encode(&Message::Hello(some_hello("heap"))));
        let ack = read_frame(&mut s);
        assert!(matches!(ack, Some(Message::HelloAck(_))));
        // Hold the stream open, silent, until the server gives up and says why.
        read_frame(&mut s)
    });
    let pending = listener.accept_pending(Some(LONG)).unwrap();
    let err = pending.finish().unwrap_err();
    assert_timeout(&err, "ready", Some(SHORT));
    drop(listener);
    // The server's stream is closed (nothing more comes), not left hanging.
    assert!(client.join().unwrap().is_none());
}

#[test]
fn handshakes_complete_and_reuse_with_spinning_off() {
    for local in [false, true] {
        handshakes_complete_and_reuse_with_spinning_off_with(local);
    }
}

fn handshakes_complete_and_reuse_with_spinning_off_with(local: bool) {
    let cfg = ConnConfig {
        handshake_spin: Duration::ZERO,
        ..stream_cfg(local)
    };
    let (srv, _) = manager(cfg.clone());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let server = std::thread::spawn(move || {
        for _ in 0..3 {
            let (est, control) = accept_owned(&listener);
            drop(control);
            listener.manager().release(est);
        }
    });
    let (cli, _) = manager(cfg);
    for i in 0..3 {
        let (est, control) = connect_owned(&cli, addr);
        assert_eq!(est.reused_qp, i > 0, "connect {i}");
        drop(control);
        cli.release(est);
    }
    server.join().unwrap();
    let s = cli.stats();
    assert_eq!((s.qps_created, s.qp_cache_hits), (1, 2), "{s:?}");
    assert_eq!(
        (s.streams_opened, s.local_streams_opened, s.stream_reuses),
        expected_streams(local, 3),
        "{s:?}"
    );
    assert_eq!(s.failed, 0, "{s:?}");
    let s = srv.stats();
    assert_eq!(
        (s.qps_created, s.qp_cache_hits, s.accepts),
        (1, 2, 3),
        "{s:?}"
    );
}

/// `finish_connecting` leaves the connecting side's `Ready` to the control stream's owner: a
/// server waiting for it (`finish`) gets nothing until `send_ready`, then completes; sending
/// again is a no-op. A connection whose owner drops the stream with the `Ready` still owed
/// ends with a `Close` instead, and the waiting server fails its finish.
#[test]
fn a_ready_left_to_the_owner_is_sent_when_it_says_so() {
    use std::sync::mpsc;
    let (srv, _) = manager(ConnConfig::default());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let (tx, rx) = mpsc::channel();
    let server = std::thread::spawn(move || {
        for _ in 0..2 {
            let result = listener.accept_pending(Some(LONG)).unwrap().finish();
            let ok = result.is_ok();
            tx.send(result).unwrap();
            if !ok {
                break;
            }
        }
    });
    let (cli, _) = manager(ConnConfig::default());
    let (est, mut control) = cli
        .connect_pending(addr, None, LONG)
        .unwrap()
        .finish_connecting()
        .unwrap();
    assert_eq!(est.qp.state(), QpState::Rts);
    assert!(
        rx.recv_timeout(Duration::from_millis(100)).is_err(),
        "the server finished without the Ready"
    );
    assert!(control.send_ready());
    let srv_est = rx.recv_timeout(LONG).unwrap().unwrap();
    assert_eq!(srv_est.qp.state(), QpState::Rts);
    assert!(control.send_ready(), "nothing owed any more");
    drop(control);
    cli.release(est);
    // Second round: the Ready is never sent.
    let (est, control) = cli
        .connect_pending(addr, None, LONG)
        .unwrap()
        .finish_connecting()
        .unwrap();
    drop(control);
    match rx.recv_timeout(LONG).unwrap() {
        Err(ConnError::Unexpected {
            phase: "ready",
            got: "close",
            ..
        }) => {}
        other => panic!("expected the server to read a Close for its Ready: {other:?}"),
    }
    cli.release(est);
    server.join().unwrap();
}

/// One receive takes what has arrived of a hello or hello-ack, so frames that come together
/// are told apart: a kept stream's stray `Nudge` and `Close` in front of the next hello are
/// skipped and the hello served; a client that sends anything behind its hello before the hello-ack is
/// refused; a server whose `Close` follows its hello-ack at once ends that connect with
/// `PeerClosed`.
#[test]
fn frames_that_arrive_together_are_told_apart() {
    let (srv, _) = manager(ConnConfig::default());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let server = serve(listener, 2);
    let frame = |m: Message| wire::encode(&m);
    // A handshake by hand, then the next hello right behind a stray Nudge and Close, in one
    // write.
    let mut c = raw_client(addr, &frame(Message::Hello(some_hello("heap"))));
    assert!(matches!(read_frame(&mut c), Some(Message::HelloAck(_))));
    c.write_all(&frame(Message::Ready)).unwrap();
    let mut both = frame(Message::Nudge);
    both.extend(frame(Message::Close));
    both.extend(frame(Message::Hello(some_hello("heap"))));
    c.write_all(&both).unwrap();
    assert!(matches!(read_frame(&mut c), Some(Message::HelloAck(_))));
    c.write_all(&frame(Message::Ready)).unwrap();
    assert!(server.join().unwrap().iter().all(Result::is_ok));

    // A hello with a Ready behind it, before any hello-ack: refused.
    let (srv, _) = manager(ConnConfig::default());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let mut both = frame(Message::Hello(some_hello("heap")));
    both.extend(frame(Message::Ready));
    let mut c = raw_client(addr, &both);
    match listener.accept_pending(Some(LONG)) {
        Err(ConnError::Unexpected {
            phase: "hello",
            got: "ready",
            ..
        }) => {}
        other => panic!("expected the hello to be refused: {other:?}"),
    }
    match read_frame(&mut c) {
        Some(Message::Reject(r)) => assert_eq!(r.code, RejectCode::Malformed),
        other => panic!("expected a reject: {other:?}"),
    }

    // A hello-ack with the server's Close behind it.
    let (addr, h) = raw_server(|mut s| {
        let Some(Message::Hello(hello)) = read_frame(&mut s) else {
            panic!("no hello");
        };
        let mut both = wire::encode(&Message::HelloAck(server_hello_like(&hello)));
        both.extend(wire::encode(&Message::Close));
        s.write_all(&both).unwrap();
        let mut sink = [0u8; 64];
        let _ = s.read(&mut sink); // until the client leaves
    });
    let (cli, _) = manager(ConnConfig::default());
    match cli.connect(addr, LONG) {
        Err(ConnError::PeerClosed {
            phase: "hello-ack", ..
        }) => {}
        other => panic!("expected PeerClosed in hello-ack: {other:?}"),
    }
    assert_eq!(cli.stats().qps_cached, 1, "the QP went back to the cache");
    h.join().unwrap();
}

/// The hello-ack wait spins on a local stream only on a thread pinned to one CPU; on TCP it
/// spins either way, and a zero budget never spins.
#[test]
fn the_hello_ack_wait_spins_on_a_local_stream_only_on_a_pinned_thread() {
    let spin = Duration::from_micros(50);
    let (mgr, _) = manager(ConnConfig {
        handshake_spin: spin,
        ..short_cfg()
    });
    let (zero, _) = manager(ConnConfig {
        handshake_spin: Duration::ZERO,
        ..short_cfg()
    });
    let unpinned = rustix::thread::sched_getaffinity(None).expect("affinity");
    if unpinned.count() > 1 {
        assert_eq!(mgr.ack_spin(true), Duration::ZERO, "unpinned, local stream");
    }
    assert_eq!(mgr.ack_spin(false), spin, "TCP");
    std::thread::scope(|s| {
        s.spawn(|| {
            let first = (0..rustix::thread::CpuSet::MAX_CPU)
                .find(|&c| unpinned.is_set(c))
                .expect("a CPU");
            let mut one = rustix::thread::CpuSet::new();
            one.set(first);
            rustix::thread::sched_setaffinity(None, &one).expect("pin this thread");
            assert!(manager::runs_on_one_cpu());
            assert_eq!(mgr.ack_spin(true), spin, "pinned, local stream");
            assert_eq!(mgr.ack_spin(false), spin, "pinned, TCP");
            assert_eq!(zero.ack_spin(true), Duration::ZERO, "pinned, no budget");
        });
    });
}

/// What the connecting side sets up early runs once the hello has left and before the
/// hello-ack is read: the server here answers only after it ran.
#[test]
fn the_early_set_up_runs_once_after_the_hello_and_before_the_hello_ack() {
    let (srv, _) = manager(short_cfg());
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let (ran_tx, ran_rx) = std::sync::mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let pending = listener.accept_pending(Some(LONG)).unwrap();
        ran_rx
            .recv_timeout(LONG)
            .expect("the client's early set-up ran before the hello-ack");
        pending.finish()
    });
    let (cli, _) = manager(ConnConfig::default());
    let mut runs = 0;
    let (pending, qp) = cli
        .connect_pending_early(addr, None, LONG, |qp| {
            runs += 1;
            assert_eq!(
                qp.state(),
                QpState::Init,
                "the QP is in INIT, its ring postable"
            );
            ran_tx.send(()).unwrap();
            qp.clone()
        })
        .unwrap();
    assert_eq!(runs, 1);
    assert_eq!(qp.qp_num(), pending.qp().qp_num());
    drop(qp);
    pending.finish().unwrap();
    server.join().unwrap().unwrap();
}

/// A connect that fails after the early set-up drops what it made (here a clone of the QP)
/// before the QP goes back to the cache.
#[test]
fn a_failed_connect_drops_the_early_set_up_before_caching_the_qp() {
    struct Made {
        _qp: QueuePair,
        mgr: ConnManager,
        cached_at_drop: Arc<std::sync::Mutex<Option<u64>>>,
    }
    impl Drop for Made {
        fn drop(&mut self) {
            *self.cached_at_drop.lock().unwrap() = Some(self.mgr.stats().qps_cached);
        }
    }
    let (srv, counters) = manager(short_cfg());
    counters.fail_rtr.store(1, Ordering::SeqCst);
    let listener = srv.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let server = serve(listener, 1);
    let (cli, _) = manager(ConnConfig::default());
    let cached_at_drop = Arc::new(std::sync::Mutex::new(None));
    let mut runs = 0;
    let err = cli
        .connect_pending_early(addr, None, LONG, |qp| {
            runs += 1;
            Made {
                _qp: qp.clone(),
                mgr: cli.clone(),
                cached_at_drop: Arc::clone(&cached_at_drop),
            }
        })
        .map(|_| ())
        .unwrap_err();
    assert_rejected_internal(&err);
    assert_eq!(runs, 1);
    assert_eq!(
        *cached_at_drop.lock().unwrap(),
        Some(0),
        "dropped before caching"
    );
    assert_eq!(cli.stats().qps_cached, 1, "the QP went back to the cache");
    assert!(server.join().unwrap().pop().unwrap().is_err());
}

/// `err` is the peer's rejection with `RejectCode::Internal`.
#[track_caller]
fn assert_rejected_internal(err: &ConnError) {
    assert!(
        matches!(
            err,
            ConnError::Rejected {
                code: wire::RejectCode::Internal,
                ..
            }
        ),
        "{err}"
    );
}
