use super::is_this_host;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

#[test]
fn this_host_is_told_by_binding_not_by_sending() {
    assert!(is_this_host(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    assert!(is_this_host(IpAddr::V4(Ipv4Addr::new(127, 3, 2, 1))));
    assert!(is_this_host(IpAddr::V6(Ipv6Addr::LOCALHOST)));
    assert!(is_this_host(IpAddr::V4(Ipv4Addr::UNSPECIFIED)));
    // TEST-NET addresses (RFC 5737) are never assigned to a host.
    assert!(!is_this_host(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1))));
    assert!(!is_this_host(IpAddr::V4(Ipv4Addr::new(198, 51, 100, 7))));
}

#[test]
fn auto_sends_peers_of_this_host_to_shm_and_the_others_to_tcp() {
    let ep = super::Endpoint::new(crate::Config {
        device: "auto".into(),
        ..crate::Config::default()
    })
    .expect("auto endpoint");
    if ep.devices() != ["shm0", "tcp0"] {
        println!("SKIP: auto opened {:?}", ep.devices());
        return;
    }
    assert_eq!(ep.fabric_for("127.0.0.1:9".parse().unwrap()), 0);
    assert_eq!(ep.fabric_for("[::1]:9".parse().unwrap()), 0);
    assert_eq!(ep.fabric_for("192.0.2.1:9".parse().unwrap()), 1);
    let named = super::Endpoint::new(crate::Config {
        device: "tcp0".into(),
        ..crate::Config::default()
    })
    .expect("tcp0 endpoint");
    assert_eq!(named.devices(), ["tcp0"]);
    assert_eq!(named.fabric_for("192.0.2.1:9".parse().unwrap()), 0);
}

/// An endpoint built on a thread confined to one CPU tells its workers so (their spins
/// and its waiters' step aside at every round), and channels and RPC work there in both
/// progress modes, with every thread of both ends on that CPU; one built where the
/// process has more CPUs spins as before.
#[test]
fn an_endpoint_built_on_one_cpu_steps_aside_and_still_serves() {
    use crate::{Config, Progress};
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    let Some(core) = core_affinity::get_core_ids().and_then(|ids| ids.last().copied()) else {
        println!("SKIP: the CPUs of this process cannot be read");
        return;
    };
    let one_cpu = |ep: &super::Endpoint| {
        ep.inner.fabrics[0]
            .workers
            .iter()
            .all(|w| w.shared.one_cpu())
    };
    let wide = super::Endpoint::new(Config {
        device: "shm0".into(),
        ..Config::default()
    })
    .expect("endpoint");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(one_cpu(&wide), cpus <= 1, "{cpus} CPUs");
    drop(wide);
    for progress in [Progress::Thread, Progress::Caller] {
        std::thread::spawn(move || {
            assert!(core_affinity::set_for_current(core), "pin to {core:?}");
            let cfg = Config {
                device: "shm0".into(),
                workers: 1,
                progress,
                ..Config::default()
            };
            let a = super::Endpoint::new(cfg.clone()).expect("a");
            let b = super::Endpoint::new(cfg).expect("b");
            assert!(one_cpu(&a) && one_cpu(&b), "{progress:?}");
            b.serve("echo", |req| Ok(req.to_vec()));
            let listener = b.listen("127.0.0.1:0").expect("listen");
            let ca = a.connect(listener.local_addr()).expect("connect");
            let cb = listener.accept_timeout(WAIT).expect("accept");
            for i in 0..200u64 {
                ca.send_timeout(&i.to_le_bytes(), WAIT).expect("send");
                let m = cb.recv_timeout(WAIT).expect("recv");
                assert_eq!(m[..], i.to_le_bytes(), "{progress:?} message {i}");
                cb.send_timeout(&m, WAIT).expect("echo");
                assert_eq!(ca.recv_timeout(WAIT).expect("reply")[..], m[..]);
            }
            let rpc = crate::Rpc::new(ca);
            for i in 0..200u64 {
                let reply = rpc.call("echo", &i.to_le_bytes(), WAIT).expect("call");
                assert_eq!(reply[..], i.to_le_bytes(), "{progress:?} call {i}");
            }
        })
        .join()
        .expect("pinned endpoints");
    }
}

/// The configuration of the caller-mode tests: shm0, one worker, caller progress.
fn caller_mode_config() -> crate::Config {
    crate::Config {
        device: "shm0".into(),
        workers: 1,
        progress: crate::Progress::Caller,
        ..crate::Config::default()
    }
}

/// One worker on `device`, otherwise the defaults.
fn one_worker(device: &str) -> crate::Config {
    crate::Config {
        device: device.into(),
        workers: 1,
        ..crate::Config::default()
    }
}

/// Two endpoints of `cfg` (a client and a server) and a listener of the server.
fn client_server(cfg: crate::Config) -> (super::Endpoint, super::Endpoint, super::Listener) {
    let a = super::Endpoint::new(cfg.clone()).expect("a");
    let b = super::Endpoint::new(cfg).expect("b");
    let listener = b.listen("127.0.0.1:0").expect("listen");
    (a, b, listener)
}

/// Both ends of a channel between two caller-mode endpoints on shm0, one worker each, with
/// stream window `stream_window` (each end keeps its endpoint alive).
fn caller_mode_channel(stream_window: u32) -> (crate::Channel, crate::Channel) {
    let (a, _b, listener) = client_server(crate::Config {
        stream_window,
        ..caller_mode_config()
    });
    let ca = a.connect(listener.local_addr()).expect("connect");
    let cb = listener
        .accept_timeout(std::time::Duration::from_secs(10))
        .expect("accept");
    (ca, cb)
}

/// A reader in caller mode whose own pass delivers its stream's next message takes it
/// straight from the pass (no delivery queue); such reads still count as consumed, so a
/// one-way stream of many windows' worth keeps flowing, and messages stay in order
/// whichever way each one took.
#[test]
fn messages_handed_to_the_reading_thread_count_as_consumed_and_keep_their_order() {
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    let (ca, cb) = caller_mode_channel(8);
    let n = 2_000u64; // 250 stream windows
    let sender = std::thread::spawn(move || {
        for i in 0..n {
            ca.send_timeout(&i.to_le_bytes(), WAIT).expect("send");
        }
        ca
    });
    for i in 0..n {
        let m = cb.recv_timeout(WAIT).expect("recv");
        assert_eq!(m[..], i.to_le_bytes(), "message {i}");
    }
    let _ca = sender.join().expect("sender");
    let handed = cb.shared().handed_count();
    assert!(handed > 0, "no message was handed to the reading thread");
    assert!(handed <= n);
}

/// Caller mode, both ends answering what they read (a ping-pong) on a small stream window:
/// the pass that hands a reader its message leaves the connection's housekeeping (slots to
/// repost, acks, completions of its sends) to the next pump — the answer's — and the flow
/// never stalls on what was left: every round trip completes in order, and the readers
/// took their messages from their own passes.
#[test]
fn a_ping_pong_of_handed_messages_keeps_flowing_on_a_small_window() {
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    let (ca, cb) = caller_mode_channel(4);
    let n = 3_000u64;
    let echo = std::thread::spawn(move || {
        for _ in 0..n {
            let m = cb.recv_timeout(WAIT).expect("ping");
            cb.send_timeout(&m, WAIT).expect("pong");
        }
        cb
    });
    for i in 0..n {
        ca.send_timeout(&i.to_le_bytes(), WAIT).expect("send");
        let m = ca.recv_timeout(WAIT).expect("recv");
        assert_eq!(m[..], i.to_le_bytes(), "round trip {i}");
    }
    let cb = echo.join().expect("echo");
    for (side, ch) in [("a", &ca), ("b", &cb)] {
        let handed = ch.shared().handed_count();
        assert!(
            handed > 0,
            "{side}: no message was handed to the reading thread"
        );
    }
    // Nothing left behind: both ends still answer at once.
    ca.send_timeout(b"last", WAIT).expect("send last");
    assert_eq!(&cb.recv_timeout(WAIT).expect("recv last")[..], b"last");
}

/// Caller mode: the pass that gives a waiting caller its RPC reply ends there, leaving
/// the rest of its work (the reply's receive slot, acks, send completions) to the next
/// pass — the caller's next call or wait. On a receive ring of 8 slots and a stream window
/// of 4, 3 000 calls in a row from each of two threads keep flowing (a pass that left
/// slots or credits behind for good would stall them) and every reply is the right one.
#[test]
fn calls_whose_reply_ends_the_callers_pass_keep_flowing_on_a_small_ring() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    let (a, b, listener) = client_server(crate::Config {
        rx_slots: 8,
        stream_window: 4,
        ..caller_mode_config()
    });
    b.serve("echo", |req| Ok(req.to_vec()));
    let ca = a.connect(listener.local_addr()).expect("connect");
    let cb = listener.accept_timeout(WAIT).expect("accept");
    // The server's handlers run in the passes of a thread that calls in.
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match cb.recv_timeout(Duration::from_millis(1)) {
                    Err(crate::ChannelError::Timeout) => {}
                    other => panic!("server: {other:?}"),
                }
            }
            cb
        })
    };
    let rpc = crate::Rpc::new(ca);
    let callers: Vec<_> = (0..2u64)
        .map(|t| {
            let rpc = rpc.clone();
            std::thread::spawn(move || {
                for i in 0..3_000u64 {
                    let req = (t << 32 | i).to_le_bytes();
                    let reply = rpc.call("echo", &req, WAIT).expect("call");
                    assert_eq!(reply[..], req, "caller {t}, call {i}");
                }
            })
        })
        .collect();
    for c in callers {
        c.join().expect("caller");
    }
    let handed = rpc.channel().shared().replies_handed_count();
    assert!(handed > 0, "no reply ended its caller's pass");
    // Nothing left behind: a call still returns at once.
    assert_eq!(
        rpc.call("echo", b"last", WAIT).expect("last call")[..],
        b"last"[..]
    );
    stop.store(true, Ordering::Relaxed);
    let _cb = server.join().expect("server");
}

/// QPs of `ep` in use (created, neither cached nor destroyed).
fn qps_in_use(ep: &super::Endpoint) -> u64 {
    let st = ep.conn_stats();
    st.qps_created
        .saturating_sub(st.qps_dropped)
        .saturating_sub(st.qps_cached)
}

/// Caller mode: how long until `ep` has no QP in use, watched from outside (no call into
/// either endpoint); `None` after a second.
fn time_until_qps_back(ep: &super::Endpoint) -> Option<std::time::Duration> {
    let t = std::time::Instant::now();
    while qps_in_use(ep) > 0 {
        if t.elapsed() > std::time::Duration::from_secs(1) {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_micros(20));
    }
    Some(t.elapsed())
}

/// Caller mode: dropping one of two channels that share a connection closes its stream at
/// once — the `STREAM_CLOSE` leaves from the dropping thread, not when the back-stop next
/// takes the worker's queue (a grace after the last call) — so the peer's reader learns
/// within moments. 20 rounds; at most two may take a grace.
#[test]
fn a_dropped_channel_closes_its_stream_at_once() {
    use std::time::{Duration, Instant};
    const WAIT: Duration = Duration::from_secs(10);
    let (a, _b, listener) = client_server(caller_mode_config());
    // Kept open throughout: the connection stays, only streams close.
    let _keep = a.connect(listener.local_addr()).expect("connect");
    let _kept = listener.accept_timeout(WAIT).expect("accept");
    let mut slow = Vec::new();
    for round in 0..20 {
        let ca = a.connect(listener.local_addr()).expect("second channel");
        let cb = listener.accept_timeout(WAIT).expect("accept second");
        let t = Instant::now();
        drop(ca);
        assert!(
            matches!(cb.recv_timeout(WAIT), Err(crate::ChannelError::PeerGone)),
            "round {round}: the close reaches the peer"
        );
        let took = t.elapsed();
        if took >= crate::worker::shared::BACKSTOP_GRACE {
            slow.push((round, took));
        }
    }
    assert!(
        slow.len() <= 2,
        "stream closes that waited a grace: {slow:?}"
    );
    assert_eq!(
        a.conn_stats().qps_created,
        1,
        "one connection carried every channel"
    );
}

/// Caller mode: a connection closed with a message not yet acknowledged lingers until the
/// peer acknowledges it; the acknowledgement arrives while nobody calls into the closing
/// endpoint, and its back-stop takes it (`WorkerShared::watch_lingering`) instead of
/// leaving it for when its grace runs out. 20 rounds of send, drop, and a reader on the
/// other side; at most two may take a grace.
#[test]
fn a_lingering_close_ends_when_the_peer_acknowledges() {
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    let (a, b, listener) = client_server(caller_mode_config());
    let mut slow = Vec::new();
    for round in 0..20u64 {
        let ca = a.connect(listener.local_addr()).expect("connect");
        let cb = listener.accept_timeout(WAIT).expect("accept");
        ca.send_timeout(&round.to_le_bytes(), WAIT).expect("send");
        drop(ca);
        // The reader reads the message and waits on (its pass acknowledges it).
        let reader = std::thread::spawn(move || {
            let m = cb
                .recv_timeout(WAIT)
                .expect("the message sent before the close");
            assert_eq!(m[..], round.to_le_bytes());
            assert!(
                matches!(cb.recv_timeout(WAIT), Err(crate::ChannelError::PeerGone)),
                "the close reaches the reader"
            );
        });
        let took = time_until_qps_back(&a).expect("the client's QP never came back");
        if took >= crate::worker::shared::BACKSTOP_GRACE {
            slow.push((round, took));
        }
        reader.join().expect("reader");
        time_until_qps_back(&b).expect("the server's QP never came back");
        // The close ended the linger (published by the pass that retired the
        // connection, moments after its QP went back): the back-stop goes back to its
        // quiet watch.
        let t = std::time::Instant::now();
        while a.inner.workers().any(|w| w.shared.is_lingering()) {
            assert!(
                t.elapsed() < Duration::from_secs(1),
                "round {round}: a connection still counted as lingering"
            );
            std::thread::sleep(Duration::from_micros(20));
        }
    }
    assert!(slow.len() <= 2, "closes that waited a grace: {slow:?}");
}

/// A caller-mode server of two workers with a channel on each to a thread-mode sink: the
/// server, the sink, the sink's listener (its accepts give the sink's ends) and the two
/// channels (the first on one worker, the second on the other).
fn two_workers_and_a_sink() -> (
    super::Endpoint,
    super::Endpoint,
    super::Listener,
    std::sync::Arc<Vec<crate::Channel>>,
) {
    two_workers_and_a_sink_in(crate::Progress::Caller)
}

/// [`two_workers_and_a_sink`] with the server in `progress` mode.
fn two_workers_and_a_sink_in(
    progress: crate::Progress,
) -> (
    super::Endpoint,
    super::Endpoint,
    super::Listener,
    std::sync::Arc<Vec<crate::Channel>>,
) {
    two_workers_and_a_sink_with(crate::Config {
        progress,
        ..caller_mode_config()
    })
}

/// [`two_workers_and_a_sink`] with the server built from `cfg` (two workers).
fn two_workers_and_a_sink_with(
    cfg: crate::Config,
) -> (
    super::Endpoint,
    super::Endpoint,
    super::Listener,
    std::sync::Arc<Vec<crate::Channel>>,
) {
    let server = super::Endpoint::new(crate::Config { workers: 2, ..cfg }).expect("server");
    let sink = super::Endpoint::new(crate::Config {
        progress: crate::Progress::Thread,
        ..caller_mode_config()
    })
    .expect("sink");
    let sink_listener = sink.listen("127.0.0.1:0").expect("listen");
    let sink_at = sink_listener.local_addr();
    let out: Vec<crate::Channel> = (0..2)
        .map(|_| server.connect(sink_at).expect("connect to the sink"))
        .collect();
    assert!(
        !std::sync::Arc::ptr_eq(&out[0].shared().worker, &out[1].shared().worker),
        "the two channels share a worker"
    );
    (server, sink, sink_listener, std::sync::Arc::new(out))
}

/// A thread-mode client of two workers with an RPC connection from each to `server`
/// (accepted round the server's workers): the server's listener, the client, and per
/// connection its `Rpc` and the server's accepted end (whose worker handles its calls).
fn two_rpc_clients(
    server: &super::Endpoint,
) -> (
    super::Listener,
    super::Endpoint,
    Vec<(crate::Rpc, crate::Channel)>,
) {
    let listener = server.listen("127.0.0.1:0").expect("listen");
    let client = super::Endpoint::new(crate::Config {
        workers: 2,
        progress: crate::Progress::Thread,
        ..caller_mode_config()
    })
    .expect("client");
    let conns = (0..2)
        .map(|_| {
            let c = client.connect(listener.local_addr()).expect("connect");
            let a = listener
                .accept_timeout(std::time::Duration::from_secs(5))
                .expect("accept");
            (crate::Rpc::new(c), a)
        })
        .collect();
    (listener, client, conns)
}

/// A handler's first step where two handlers must run at the same time: count itself in, then
/// wait (at most `bound`) for the other.
fn both_in(arrived: &std::sync::atomic::AtomicUsize, bound: std::time::Duration) {
    use std::sync::atomic::Ordering;
    arrived.fetch_add(1, Ordering::SeqCst);
    let t = std::time::Instant::now();
    while arrived.load(Ordering::SeqCst) < 2 && t.elapsed() < bound {
        std::thread::yield_now();
    }
}

/// The sink's ends of the server's channels (`two_workers_and_a_sink`): a message on each makes
/// the sink's listener hand them out; kept open by the caller.
fn sink_ends(
    out: &[crate::Channel],
    sink_listener: &super::Listener,
    wait: std::time::Duration,
) -> Vec<crate::Channel> {
    out.iter().for_each(|c| c.send(b"hello").expect("send"));
    (0..out.len())
        .map(|_| {
            sink_listener
                .accept_timeout(wait)
                .expect("the sink accepts")
        })
        .collect()
}

/// Each of `rpcs` calls `method` at once, on a thread of its own, with `request(i)`; the
/// results in the order of `rpcs`.
fn call_each(
    rpcs: Vec<crate::Rpc>,
    method: &'static str,
    request: impl Fn(usize) -> Vec<u8>,
    wait: std::time::Duration,
) -> Vec<Result<Vec<u8>, crate::RpcError>> {
    let calls: Vec<_> = rpcs
        .into_iter()
        .enumerate()
        .map(|(i, rpc)| {
            let req = request(i);
            std::thread::spawn(move || rpc.call(method, &req, wait))
        })
        .collect();
    calls
        .into_iter()
        .map(|t| t.join().expect("caller"))
        .collect()
}

/// Caller mode: a handler's send on a channel of another worker whose state is busy at
/// that moment is queued there, and that worker's back-stop is nudged to take it once the
/// worker is free (`WorkerShared::nudge_backstop`). Here the state is held by an application
/// thread that called in moments before and then stops calling: without the nudge the
/// send waited for the back-stop's grace in some rounds (10–20 ms). Ten rounds; at most
/// one may take 8 ms or more (two scheduler ticks of a 250 Hz kernel: on a loaded host a
/// woken thread may wait a tick or two for its CPU: 4.0–5.3 ms in 3 of 12 runs with two busy
/// loops beside the test).
#[test]
fn a_send_a_handler_queues_for_a_busy_worker_goes_once_that_worker_is_free() {
    use std::time::{Duration, Instant};
    const WAIT: Duration = Duration::from_secs(5);
    let (server, _sink, sink_listener, out) = two_workers_and_a_sink();
    let (other, mine) = (&out[1].shared().worker, &out[0].shared().worker);
    {
        let out = out.clone();
        server.serve("other", move |_| {
            out[1].send(b"queued").map_err(|e| e.to_string())?;
            Ok(Vec::new())
        });
    }
    // The sink's end of the second channel: the one its first message comes on.
    out[1].send(b"first").expect("send");
    let ends: Vec<_> = (0..2)
        .map(|_| {
            sink_listener
                .accept_timeout(WAIT)
                .expect("the sink accepts")
        })
        .collect();
    let end = ends
        .iter()
        .find(|e| e.recv_timeout(Duration::from_millis(500)).is_ok())
        .expect("the first message");
    // Calls the server handles on the first channel's worker.
    let (listener, client, conns) = two_rpc_clients(&server);
    let (rpc, _) = conns
        .iter()
        .find(|(_, a)| std::sync::Arc::ptr_eq(&a.shared().worker, mine))
        .expect("a connection on the first channel's worker");
    let mut slow = Vec::new();
    for round in 0..10 {
        // The application calls in on the other worker, then holds its state while a
        // handler sends on it, then lets go and calls no more.
        out[1].send(b"warm").expect("send");
        assert_eq!(&end.recv_timeout(WAIT).expect("warm")[..], b"warm");
        let held = other.lock_state().expect("the other worker's state");
        rpc.call("other", b"", WAIT).expect("the handler's call");
        let t = Instant::now();
        drop(held);
        assert_eq!(&end.recv_timeout(WAIT).expect("queued")[..], b"queued");
        let took = t.elapsed();
        if took >= Duration::from_millis(8) {
            slow.push((round, took));
        }
    }
    assert!(slow.len() <= 1, "queued sends that waited: {slow:?}");
    drop((conns, client, listener));
}

/// Caller mode, two workers whose RPC handlers, running at the same time, each send on a
/// channel of the other worker: a handler holds its own worker's state, so a sender that
/// waited for the other worker's state would wait for a handler that waits for its own —
/// each send is queued instead, and the calls complete.
#[test]
fn handlers_of_two_workers_sending_on_each_others_channels_do_not_deadlock() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(5);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    // The body runs on a thread of its own: deadlocked workers would never let its
    // endpoints drop.
    std::thread::spawn(move || {
        let (server, sink, sink_listener, out) = two_workers_and_a_sink();
        let arrived = Arc::new(AtomicUsize::new(0));
        {
            let (out, arrived) = (out.clone(), arrived.clone());
            server.serve("cross", move |_| {
                // Both handlers in at once (bounded: the test reports it otherwise).
                both_in(&arrived, WAIT / 5);
                for ch in out.iter() {
                    ch.send(b"across").map_err(|e| e.to_string())?;
                }
                Ok(arrived.load(Ordering::SeqCst).to_le_bytes().to_vec())
            });
        }
        // Two connections, accepted on the server's two workers.
        let (listener, client, conns) = two_rpc_clients(&server);
        let (rpcs, accepted): (Vec<_>, Vec<_>) = conns.into_iter().unzip();
        let results = call_each(rpcs, "cross", |_| Vec::new(), WAIT);
        // Every send of both handlers arrived.
        let mut got = 0;
        for _ in 0..2 {
            let ch = sink_listener
                .accept_timeout(WAIT)
                .expect("the sink accepts");
            for _ in 0..2 {
                assert_eq!(
                    &ch.recv_timeout(WAIT).expect("a handler's send")[..],
                    b"across"
                );
                got += 1;
            }
        }
        assert_eq!(got, 4);
        let _ = done_tx.send(format!("{:?}", [&results[0], &results[1]]));
        drop((accepted, client, listener, server, sink_listener, sink));
    });
    let got = done_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the calls never returned");
    let both: Result<Vec<u8>, crate::RpcError> = Ok(2usize.to_le_bytes().to_vec());
    let two = format!("{:?}", [&both, &both]);
    assert_eq!(
        got, two,
        "both calls answered, their handlers at the same time"
    );
}

/// Nested calls: the server's handlers, on its two workers at the same time, each need the
/// replies of two calls to a backend — over channels on both workers — before they answer.
/// A handler that made them with a blocking `call` would hold its worker while the other
/// handler's calls need that worker's passes (its replies arrive there). Served deferred,
/// each handler starts its calls on a runtime and returns; the task answers through the
/// `Responder` when both replies are in.
#[test]
fn deferred_handlers_of_two_workers_answer_after_nested_calls_on_each_others_channels() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    let (server, sink, sink_listener, out) = two_workers_and_a_sink();
    sink.serve("inner", |req| {
        let mut r = b"inner:".to_vec();
        r.extend_from_slice(req);
        Ok(r)
    });
    let _ends = sink_ends(&out, &sink_listener, WAIT);
    let backends: Arc<Vec<crate::Rpc>> =
        Arc::new(out.iter().map(|c| crate::Rpc::new(c.clone())).collect());
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime"),
    );
    let arrived = Arc::new(AtomicUsize::new(0));
    {
        let (rt, arrived) = (rt.clone(), arrived.clone());
        server.serve_deferred("outer", move |req, responder| {
            // Both handlers in at once (bounded: the assertions tell it otherwise).
            both_in(&arrived, WAIT / 5);
            let (backends, req) = (backends.clone(), req.to_vec());
            rt.spawn(async move {
                let mut body = Vec::new();
                for b in backends.iter() {
                    match b.call_async("inner", &req, WAIT).await {
                        Ok(r) => body.extend_from_slice(&r),
                        Err(e) => return drop(responder.fail(&e.to_string())),
                    }
                    body.push(b'|');
                }
                responder.reply(&body).expect("reply");
            });
        });
    }
    let (listener, client, conns) = two_rpc_clients(&server);
    let (rpcs, accepted): (Vec<_>, Vec<_>) = conns.into_iter().unzip();
    let results = call_each(rpcs, "outer", |i| format!("{i}").into_bytes(), WAIT);
    for (i, got) in results.into_iter().enumerate() {
        assert_eq!(
            got.expect("the outer call"),
            format!("inner:{i}|inner:{i}|").into_bytes()
        );
    }
    assert_eq!(
        arrived.load(Ordering::SeqCst),
        2,
        "both handlers ran (at the same time)"
    );
    drop((accepted, client, listener));
}

/// The same nested calls made blocking, each on the other worker's channel only (on its
/// own worker's a blocking call is refused: `RpcError::WouldDeadlock`): each handler holds
/// its worker while its call needs the other's pass, so at least one call cannot be
/// answered in time — but every call ends by its deadline (300 ms), and the outer calls
/// with it. The nested call's deadline used to be kept by its worker's timer only, which
/// the held worker never fired: both handlers waited for ever (their outer calls until
/// their own deadline). Server in caller mode and with worker threads.
#[test]
fn blocking_nested_calls_of_two_workers_handlers_end_by_their_deadline() {
    for progress in [crate::Progress::Caller, crate::Progress::Thread] {
        blocking_nested_calls_end(progress);
    }
}

fn blocking_nested_calls_end(progress: crate::Progress) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    const NESTED: Duration = Duration::from_millis(300);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    // On a thread of its own: held workers would never let its endpoints drop.
    std::thread::spawn(move || {
        let (server, sink, sink_listener, out) = two_workers_and_a_sink_in(progress);
        sink.serve("inner", |req| Ok(req.to_vec()));
        let _ends = sink_ends(&out, &sink_listener, WAIT);
        let backends: Arc<Vec<crate::Rpc>> =
            Arc::new(out.iter().map(|c| crate::Rpc::new(c.clone())).collect());
        let arrived = Arc::new(AtomicUsize::new(0));
        {
            let arrived = arrived.clone();
            server.serve("outer", move |req| {
                both_in(&arrived, WAIT / 5);
                let other = backends
                    .iter()
                    .find(|b| !b.channel().shared().worker.held_here())
                    .expect("a channel on the other worker");
                other.call("inner", req, NESTED).map_err(|e| e.to_string())
            });
        }
        let (listener, client, conns) = two_rpc_clients(&server);
        let (rpcs, accepted): (Vec<_>, Vec<_>) = conns.into_iter().unzip();
        let results = call_each(rpcs, "outer", |_| b"x".to_vec(), WAIT);
        let _ = done_tx.send((results, arrived.load(Ordering::SeqCst)));
        drop((accepted, client, listener, server, sink_listener, sink));
    });
    let (results, arrived) = done_rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{progress:?}: the calls never returned"));
    assert_eq!(arrived, 2, "{progress:?}: both handlers ran");
    let timed_out = crate::RpcError::Timeout.to_string();
    let mut late = 0;
    for r in &results {
        match r {
            Ok(body) => assert_eq!(body, b"x"),
            Err(crate::RpcError::Handler(m)) if *m == timed_out => late += 1,
            Err(e) => panic!("{progress:?}: outer call: {e:?}"),
        }
    }
    assert!(
        late >= 1,
        "{progress:?}: a nested call answered in time both ways: {results:?}"
    );
}

/// A handler's waits that have no deadline of their own, on a channel of the *other*
/// worker, end by the endpoint's RPC deadline (here 300 ms) with `Timeout`: a `recv` for a
/// message that never comes, and a one-sided read whose completion only that worker can
/// read while a handler holds it for 1.5 s. Before, the first waited for ever and the
/// second until the other handler returned. Server in caller mode and with worker threads.
#[test]
fn a_handlers_wait_on_another_workers_channel_ends_by_the_rpc_deadline() {
    for progress in [crate::Progress::Caller, crate::Progress::Thread] {
        // On a thread of its own: a handler that never returns would never let the
        // endpoints drop.
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let passed = std::panic::catch_unwind(|| handler_waits_end(progress)).is_ok();
            let _ = done_tx.send(passed);
        });
        let passed = done_rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("{progress:?}: a handler's wait never ended"));
        assert!(passed, "{progress:?}: failed (the panic above)");
    }
}

fn handler_waits_end(progress: crate::Progress) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    const WAIT: Duration = Duration::from_secs(10);
    const HOLD: Duration = Duration::from_millis(1500);
    let (server, sink, sink_listener, out) = two_workers_and_a_sink_with(crate::Config {
        progress,
        rpc_timeout_ms: 300,
        ..caller_mode_config()
    });
    let region = sink.expose(4096).expect("expose");
    let _ends = sink_ends(&out, &sink_listener, WAIT);
    let remotes: Arc<Vec<crate::RemoteRegion>> = Arc::new(
        out.iter()
            .map(|c| c.remote_region(region.descriptor()))
            .collect(),
    );
    // The sink sends nothing on these channels: a `recv` there waits for what never comes.
    {
        let out = out.clone();
        server.serve("recv_other", move |_| {
            let other = out
                .iter()
                .find(|c| !c.shared().worker.held_here())
                .expect("a channel on the other worker");
            other
                .recv()
                .map(|m| m.to_vec())
                .map_err(|e| format!("{e:?}"))
        });
    }
    let holding = Arc::new(AtomicBool::new(false));
    {
        let (out, holding) = (out.clone(), holding.clone());
        server.serve("hold_or_read", move |_| {
            if out[0].shared().worker.held_here() {
                // Holds the first channel's worker while the other handler reads.
                holding.store(true, Ordering::SeqCst);
                std::thread::sleep(HOLD);
                holding.store(false, Ordering::SeqCst);
                return Ok(b"held".to_vec());
            }
            let t = Instant::now();
            while !holding.load(Ordering::SeqCst) && t.elapsed() < WAIT {
                std::thread::yield_now();
            }
            let t = Instant::now();
            let r = remotes[0].read(0, 8).map_err(|e| format!("{e:?}"));
            let still_held = holding.load(Ordering::SeqCst);
            Ok(format!("{r:?} after {:?}, still held {still_held}", t.elapsed()).into_bytes())
        });
    }
    let (listener, client, conns) = two_rpc_clients(&server);
    let (rpcs, accepted): (Vec<_>, Vec<_>) = conns.into_iter().unzip();
    let got = rpcs[0].call("recv_other", b"", WAIT);
    assert!(
        matches!(&got, Err(crate::RpcError::Handler(m)) if m == "Timeout"),
        "{progress:?}: recv on the other worker's channel: {got:?}"
    );
    let results: Vec<String> = call_each(rpcs, "hold_or_read", |_| Vec::new(), WAIT)
        .into_iter()
        .map(|r| String::from_utf8_lossy(&r.expect("hold_or_read")).into_owned())
        .collect();
    assert!(
        results.iter().any(|r| r == "held"),
        "{progress:?}: {results:?}"
    );
    assert!(
        results
            .iter()
            .any(|r| r.starts_with("Err(\"Timeout\")") && r.ends_with("still held true")),
        "{progress:?}: the read ended by its deadline, while the other worker was held: \
         {results:?}"
    );
    drop((accepted, client, listener));
}

/// Caller mode, a close whose peer's application called in moments ago and then stopped:
/// the peer's back-stop stays out of the way for its grace, so the `STREAM_CLOSE` would be
/// read (and acknowledged) — and the closing side's QP come back — only a grace later. The
/// closing side nudges the peer over the control stream (`Worker::nudge_peer`), and the
/// peer's back-stop, which watches control streams meanwhile, progresses the worker. 20
/// rounds of connect, one message read by the peer, drop, on shm0 and on tcp0 (whose data
/// path may deliver after the nudge: a later one covers it); at most two may take a grace.
#[test]
fn a_close_does_not_wait_for_a_quiet_peer_to_call_in() {
    for device in ["shm0", "tcp0"] {
        let cfg = crate::Config {
            device: device.into(),
            ..caller_mode_config()
        };
        close_with_a_quiet_peer(cfg);
    }
}

/// Caller mode, tcp0 without QP cache or kept control streams, a close right after the
/// connect: the data connection of the new QP pair is still being set up when the
/// `STREAM_CLOSE` is posted, so the first nudge reaches the peer before the message does
/// and a later one has to follow — from the closing side's timers, which fire in the
/// passes its back-stop runs while the connection lingers. 20 rounds; at most two may take
/// a grace.
#[test]
fn a_close_right_after_a_new_tcp0_connect_is_nudged_until_acknowledged() {
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    let cfg = crate::Config {
        device: "tcp0".into(),
        qp_cache_size: 0,
        reuse_control_streams: false,
        ..caller_mode_config()
    };
    let (a, b, listener) = client_server(cfg);
    let mut slow = Vec::new();
    for round in 0..20u64 {
        let ca = a.connect(listener.local_addr()).expect("connect");
        let cb = listener.accept_timeout(WAIT).expect("accept");
        drop(ca);
        let took = time_until_qps_back(&a).expect("the client's QP never came back");
        if took >= crate::worker::shared::BACKSTOP_GRACE {
            slow.push((round, took));
        }
        drop(cb);
        time_until_qps_back(&b).expect("the server's QP never came back");
    }
    assert!(
        slow.len() <= 2,
        "closes that waited for the peer's grace: {slow:?}"
    );
}

fn close_with_a_quiet_peer(cfg: crate::Config) {
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    let device = cfg.device.clone();
    let (a, b, listener) = client_server(cfg);
    let mut slow = Vec::new();
    for round in 0..20u64 {
        let ca = a.connect(listener.local_addr()).expect("connect");
        let cb = listener.accept_timeout(WAIT).expect("accept");
        ca.send_timeout(&round.to_le_bytes(), WAIT).expect("send");
        // The peer's application calls in, then goes quiet with its channel open.
        assert_eq!(
            cb.recv_timeout(WAIT).expect("the message")[..],
            round.to_le_bytes()
        );
        drop(ca);
        let took = time_until_qps_back(&a).expect("the client's QP never came back");
        if took >= crate::worker::shared::BACKSTOP_GRACE {
            slow.push((round, took));
        }
        assert!(
            matches!(cb.recv_timeout(WAIT), Err(crate::ChannelError::PeerGone)),
            "the close reaches the peer"
        );
        drop(cb);
        time_until_qps_back(&b).expect("the server's QP never came back");
    }
    assert!(
        slow.len() <= 2,
        "{device}: closes that waited for the peer's grace: {slow:?}"
    );
}

/// Caller mode, a peer that closes and at once connects again (on the kept control
/// stream): its hello reaches the listener only once the accepting side has let that
/// stream go, which needs the peer's `Close` read — and no application thread reads
/// control streams while it calls in. The back-stop watches them meanwhile
/// (`WorkerShared::watch_control`); before it did, about a third of such reconnects waited
/// one or two back-stop graces (10–20 ms; 62 of 200 here). A reconnect that takes a whole
/// grace is that wait, not load: at most a few may, out of 50.
#[test]
fn a_reconnect_right_after_a_close_does_not_wait_for_the_back_stop() {
    use crate::{Config, Progress};
    use std::time::{Duration, Instant};
    const WAIT: Duration = Duration::from_secs(10);
    let cfg = Config {
        device: "shm0".into(),
        progress: Progress::Caller,
        ..Config::default()
    };
    let server = super::Endpoint::new(cfg.clone()).expect("server");
    let client = super::Endpoint::new(cfg).expect("client");
    let listener = server.listen("127.0.0.1:0").expect("listen");
    let rounds = 50;
    let mut slow = Vec::new();
    for i in 0..rounds {
        let t = Instant::now();
        let c = client.connect(listener.local_addr()).expect("connect");
        let s = listener.accept_timeout(WAIT).expect("accept");
        let took = t.elapsed();
        c.send(b"x").expect("send");
        assert_eq!(&s.recv_timeout(WAIT).expect("recv")[..], b"x");
        drop((c, s));
        if took >= crate::worker::shared::BACKSTOP_GRACE {
            slow.push((i, took));
        }
    }
    let stats = client.conn_stats();
    assert!(
        stats.stream_reuses > 0,
        "the reconnects did not reuse the control stream: {stats:?}"
    );
    assert!(
        slow.len() <= 3,
        "{} of {rounds} reconnects took a back-stop grace or more: {slow:?}",
        slow.len()
    );
}

/// The peer of a pooled connection went away (its endpoint dropped: the `Close` and the
/// hang-up of its control stream are in this host's socket) while the connecting side's
/// worker has not read that stream yet — arranged here by holding every worker of the
/// client, which a busy worker amounts to: it looks at control streams only every 1024th
/// idle pass or when it sleeps. A connect to a new endpoint on the same address must not
/// be handed the dead connection (it once was, and the new endpoint never saw a peer): it
/// sets up a new one, which the new endpoint accepts.
#[test]
fn a_pooled_connection_whose_peer_hung_up_is_not_reused_before_its_worker_noticed() {
    use crate::{ChannelError, Config, Endpoint};
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    let devices = std::env::var("FABRIQ_TEST_DEVICES").unwrap_or_else(|_| "tcp0,shm0".into());
    for device in devices.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let cfg = Config {
            device: device.into(),
            handshake_timeout_ms: 10_000,
            ..Config::default()
        };
        let Ok(first) = Endpoint::new(cfg.clone()) else {
            eprintln!("skipping {device}: it does not open here");
            continue;
        };
        let client = Endpoint::new(cfg.clone()).expect("client");
        let listener = first.listen("127.0.0.1:0").expect("listen");
        let addr = listener.local_addr();
        let old = client.connect(addr).expect("connect");
        let old_peer = listener.accept_timeout(WAIT).expect("accept");
        old.send(b"first").expect("send");
        assert_eq!(&old_peer.recv_timeout(WAIT).expect("recv")[..], b"first");
        // From here on the client's workers read nothing.
        let held: Vec<_> = client
            .inner
            .workers()
            .map(|w| loop {
                // (Once this thread holds one worker's state, the next is taken only free.)
                if let Some(g) = w.shared.try_lock_state() {
                    break g;
                }
                std::thread::yield_now();
            })
            .collect();
        drop((listener, old_peer, first));
        let second = Endpoint::new(cfg).expect("second server");
        let listener = match second.listen(addr) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("skipping {device}: {addr} not free again: {e}");
                continue;
            }
        };
        let new = client.connect(addr).expect("connect again");
        drop(held);
        let new_peer = listener
            .accept_timeout(WAIT)
            .unwrap_or_else(|e| panic!("{device}: the new endpoint saw no peer: {e}"));
        new.send(b"second").expect("send");
        assert_eq!(&new_peer.recv_timeout(WAIT).expect("recv")[..], b"second");
        new_peer.send(b"back").expect("send back");
        assert_eq!(&new.recv_timeout(WAIT).expect("recv back")[..], b"back");
        let pool = client.pool_stats();
        assert_eq!((pool.hits, pool.misses), (0, 2), "{device}: {pool:?}");
        assert_eq!(client.conn_stats().connects, 2, "{device}");
        match old.recv_timeout(WAIT) {
            Err(ChannelError::PeerGone) => {}
            other => panic!("{device}: expected PeerGone on the old channel, got {other:?}"),
        }
    }
}

/// A call's deadline does not stay in the worker's timer wheel after its reply: one timer per
/// connection follows the earliest deadline of its calls. (Filed per call, 2 000 answered calls
/// with a minute to run left 2 000 entries behind, and a busy server millions.)
#[test]
fn answered_calls_leave_no_deadlines_in_the_timer_wheel() {
    use std::time::Duration;
    for progress in [crate::Progress::Thread, crate::Progress::Caller] {
        let (a, b, listener) = client_server(crate::Config {
            progress,
            ..caller_mode_config()
        });
        b.serve("echo", |req| Ok(req.to_vec()));
        let rpc = crate::Rpc::new(a.connect(listener.local_addr()).expect("connect"));
        let _server = listener
            .accept_timeout(Duration::from_secs(10))
            .expect("accept");
        for i in 0..2_000u32 {
            let reply = rpc
                .call("echo", &i.to_le_bytes(), Duration::from_secs(60))
                .expect("call");
            assert_eq!(reply[..], i.to_le_bytes());
        }
        let worker = &rpc.channel().shared().worker;
        let filed = worker.lock_state().expect("worker state").timers_filed();
        assert!(
            filed <= 4,
            "{progress:?}: {filed} timers filed after 2 000 answered calls"
        );
    }
}

/// A peer that sends a stream more messages than its window lets it leave unconsumed — which
/// would grow the reader's delivery queue without bound — has its connection failed with
/// `ChannelError::Protocol` once past the window; what arrived within the window can still be
/// read, in order, the sender learns its connection is gone, and another peer's connection
/// to the same endpoint keeps working.
#[test]
fn a_peer_past_its_stream_window_fails_its_connection_alone() {
    use crate::ChannelError;
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    for device in ["shm0", "tcp0"] {
        let cfg = crate::Config {
            stream_window: 4,
            ..one_worker(device)
        };
        let (a, b, listener) = client_server(cfg.clone());
        let ca = a.connect(listener.local_addr()).expect("connect");
        let cb = listener.accept_timeout(WAIT).expect("accept");
        ca.shared().ignore_stream_window();
        for i in 0..32u64 {
            if let Err(e) = ca.send_timeout(&i.to_le_bytes(), WAIT) {
                // The server may fail the connection before the last sends.
                assert!(i > 4, "{device}: send {i}: {e}");
                break;
            }
        }
        // Nothing is read before the server failed the connection, which the sender learns.
        match ca.recv_timeout(WAIT) {
            Err(ChannelError::PeerGone | ChannelError::Closed) => {}
            other => panic!("{device}: the sender got {other:?}"),
        }
        let mut read = 0u64;
        let err = loop {
            match cb.recv_timeout(WAIT) {
                Ok(m) => {
                    assert_eq!(m[..], read.to_le_bytes(), "{device}: message {read}");
                    read += 1;
                }
                Err(e) => break e,
            }
        };
        assert!(
            matches!(err, ChannelError::Protocol(ref what) if what.contains("window")),
            "{device}: {err:?} after {read} messages"
        );
        assert_eq!(read, 5, "{device}: the window's 4 and the one past it");
        let counted = |ep: &super::Endpoint| ep.guard_stats().protocol_violations;
        assert_eq!((counted(&b), counted(&a)), (1, 0), "{device}: violations");
        // Another peer of the same server is not affected.
        let c = super::Endpoint::new(cfg).expect("c");
        let cc = c.connect(listener.local_addr()).expect("connect c");
        let cs = listener.accept_timeout(WAIT).expect("accept c");
        for i in 0..100u64 {
            cc.send_timeout(&i.to_le_bytes(), WAIT).expect("send c");
            let m = cs.recv_timeout(WAIT).expect("recv c");
            cs.send_timeout(&m, WAIT).expect("echo c");
            assert_eq!(cc.recv_timeout(WAIT).expect("reply c")[..], i.to_le_bytes());
        }
        assert_eq!(counted(&b), 1, "{device}: a well-behaved peer counted");
        assert_eq!(c.guard_stats(), crate::GuardStats::default(), "{device}");
        drop(b);
    }
}

/// Requests a deferred handler holds, each with its responder.
type Held = parking_lot::Mutex<Vec<(Vec<u8>, crate::rpc::Responder)>>;

/// Deferred handler `hold` of `ep`: each request waits in the returned list with its responder.
fn held_calls(ep: &super::Endpoint) -> std::sync::Arc<Held> {
    let held = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let h = std::sync::Arc::clone(&held);
    ep.serve_deferred("hold", move |req, responder| {
        h.lock().push((req.to_vec(), responder));
    });
    held
}

/// Waits until `held` has `n` requests (or `within`) and then 100 ms more; how many it has.
fn settle_at(held: &Held, n: usize, within: std::time::Duration) -> usize {
    let until = std::time::Instant::now() + within;
    while held.lock().len() < n && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    held.lock().len()
}

/// A stream keeps at most a window of calls out: the rest wait at the caller, in order, and go
/// as replies come, so the server never holds more than a window of one stream's requests (it
/// held all 20 before). A call that timed out while out keeps its place until its late reply
/// comes; one that timed out while waiting never reaches the server.
#[test]
fn a_stream_keeps_at_most_a_window_of_calls_out() {
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    for device in ["shm0", "tcp0"] {
        let (a, b, listener) = client_server(crate::Config {
            stream_window: 4,
            ..one_worker(device)
        });
        let held = held_calls(&b);
        let rpc = std::sync::Arc::new(crate::Rpc::new(
            a.connect(listener.local_addr()).expect("connect"),
        ));
        let _server = listener.accept_timeout(WAIT).expect("accept");
        let callers: Vec<_> = (0..20u32)
            .map(|i| {
                let rpc = std::sync::Arc::clone(&rpc);
                std::thread::spawn(move || rpc.call("hold", &i.to_le_bytes(), WAIT))
            })
            .collect();
        let mut answered = 0;
        while answered < 20 {
            let n = settle_at(&held, 4.min(20 - answered), WAIT);
            assert_eq!(n, 4.min(20 - answered), "{device}: requests held at once");
            for (req, responder) in held.lock().drain(..) {
                responder.reply(&[&req[..], b"!"].concat()).expect("reply");
                answered += 1;
            }
        }
        for (i, c) in callers.into_iter().enumerate() {
            let reply = c.join().expect("caller").expect("call");
            assert_eq!(
                reply,
                [&(i as u32).to_le_bytes()[..], b"!"].concat(),
                "{device}"
            );
        }

        // Four calls time out while out; a fifth, waiting behind them, times out unsent; a
        // sixth waits until the four late replies come, then goes.
        let short: Vec<_> = (0..4u32)
            .map(|i| {
                let rpc = std::sync::Arc::clone(&rpc);
                std::thread::spawn(move || {
                    rpc.call("hold", &i.to_le_bytes(), Duration::from_millis(200))
                })
            })
            .collect();
        assert_eq!(settle_at(&held, 4, WAIT), 4, "{device}");
        let unsent = rpc.call("hold", b"unsent", Duration::from_millis(100));
        assert!(
            matches!(unsent, Err(crate::RpcError::Timeout)),
            "{device}: {unsent:?}"
        );
        for c in short {
            let r = c.join().expect("caller");
            assert!(
                matches!(r, Err(crate::RpcError::Timeout)),
                "{device}: {r:?}"
            );
        }
        let last = {
            let rpc = std::sync::Arc::clone(&rpc);
            std::thread::spawn(move || rpc.call("hold", b"last", WAIT))
        };
        assert_eq!(
            settle_at(&held, 5, Duration::from_millis(300)),
            4,
            "{device}: the sixth waits behind the late four"
        );
        for (_, responder) in held.lock().drain(..) {
            responder.reply(b"late").expect("late reply");
        }
        assert_eq!(settle_at(&held, 1, WAIT), 1, "{device}");
        let (req, responder) = held.lock().pop().expect("the sixth");
        assert_eq!(
            req, b"last",
            "{device}: the unsent call never reached the server"
        );
        responder.reply(b"done").expect("reply");
        assert_eq!(
            last.join().expect("caller").expect("call"),
            b"done",
            "{device}"
        );
    }
}

/// A caller that keeps more than a window of calls out on a stream — whose replies the server
/// would queue without bound while it withheld its credits — has its connection failed with
/// `ChannelError::Protocol`; another caller of the same server goes on.
#[test]
fn a_caller_past_its_call_window_fails_its_connection_alone() {
    use crate::{ChannelError, RpcError};
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    for device in ["shm0", "tcp0"] {
        let cfg = crate::Config {
            stream_window: 4,
            ..one_worker(device)
        };
        let (a, b, listener) = client_server(cfg.clone());
        let held = held_calls(&b);
        b.serve("echo", |req| Ok(req.to_vec()));
        let rude = std::sync::Arc::new(crate::Rpc::new(
            a.connect(listener.local_addr()).expect("connect"),
        ));
        let server_side = listener.accept_timeout(WAIT).expect("accept");
        rude.channel().shared().ignore_stream_window();
        let callers: Vec<_> = (0..8u32)
            .map(|i| {
                let rpc = std::sync::Arc::clone(&rude);
                std::thread::spawn(move || rpc.call("hold", &i.to_le_bytes(), WAIT))
            })
            .collect();
        for c in callers {
            match c.join().expect("caller") {
                Err(RpcError::PeerGone | RpcError::Channel(_)) => {}
                other => panic!("{device}: a call past the window got {other:?}"),
            }
        }
        match server_side.recv_timeout(WAIT) {
            Err(ChannelError::Protocol(what)) => {
                assert!(what.contains("calls"), "{device}: {what}")
            }
            other => panic!("{device}: the server's stream got {other:?}"),
        }
        assert!(
            held.lock().len() <= 4,
            "{device}: {} requests held",
            held.lock().len()
        );
        assert_eq!(b.guard_stats().protocol_violations, 1, "{device}");
        held.lock().clear();
        let c = super::Endpoint::new(cfg).expect("c");
        let polite = crate::Rpc::new(c.connect(listener.local_addr()).expect("connect c"));
        let _s = listener.accept_timeout(WAIT).expect("accept c");
        for i in 0..100u32 {
            assert_eq!(
                polite.call("echo", &i.to_le_bytes(), WAIT).expect("call"),
                i.to_le_bytes()
            );
        }
    }
}

/// Each pair (connecting end, accepted end) carries a message, in turn.
fn each_carries<'a>(
    pairs: impl IntoIterator<Item = &'a (crate::Channel, crate::Channel)>,
    device: &str,
) {
    const WAIT: std::time::Duration = std::time::Duration::from_secs(10);
    for (i, (c, s)) in pairs.into_iter().enumerate() {
        c.send_timeout(&[i as u8], WAIT).expect("send");
        let m = s.recv_timeout(WAIT).expect("recv");
        assert_eq!(m[..], [i as u8], "{device}: pair {i}");
    }
}

/// Close a pair on both ends: the connecting end first, the accepted end once it saw the close.
fn close_both((c, s): (crate::Channel, crate::Channel), device: &str) {
    drop(c);
    match s.recv_timeout(std::time::Duration::from_secs(10)) {
        Err(crate::ChannelError::PeerGone) => {}
        other => panic!("{device}: the accepted end got {other:?}"),
    }
}

/// Past `max_streams` open on one connection, the accepting side refuses a peer's new stream:
/// nothing of it is kept or handed to the listener, and the opener's channel (and a call on it)
/// fails with `StreamRefused`; the connection's channels go on, the opener's pool sets up
/// another connection for the next channel, and on a connection a stream that closed on both
/// ends makes room for the next. (Without the bound, a peer could make the accepting side keep
/// streams without end.)
#[test]
fn streams_past_the_limit_are_refused_and_the_rest_go_on() {
    use crate::{ChannelError, RpcError};
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    for device in ["shm0", "tcp0"] {
        let (a, b, listener) = client_server(crate::Config {
            max_streams: 3,
            ..one_worker(device)
        });
        b.serve("echo", |req| Ok(req.to_vec()));
        let pair = || {
            let c = a.connect(listener.local_addr()).expect("connect");
            let s = listener.accept_timeout(WAIT).expect("accept");
            (c, s)
        };
        let first: Vec<_> = (0..3).map(|_| pair()).collect();
        assert_eq!(
            a.conn_stats().connects,
            1,
            "{device}: one shared connection"
        );
        let refused = a
            .connect(listener.local_addr())
            .expect("connect past the limit");
        match refused.recv_timeout(WAIT) {
            Err(ChannelError::StreamRefused) => {}
            other => panic!("{device}: the fourth channel got {other:?}"),
        }
        let rpc = crate::Rpc::new(refused);
        match rpc.call("echo", b"x", WAIT) {
            Err(RpcError::Channel(ChannelError::StreamRefused)) => {}
            other => panic!("{device}: a call on it got {other:?}"),
        }
        assert!(
            listener.accept_timeout(Duration::from_millis(200)).is_err(),
            "{device}: a refused stream reached the listener"
        );
        let refused = |ep: &super::Endpoint| ep.guard_stats().streams_refused;
        assert_eq!((refused(&b), refused(&a)), (1, 0), "{device}: refusals");
        // The next channel gets a connection of its own; the first connection's go on.
        let mut second = vec![pair()];
        assert_eq!(a.conn_stats().connects, 2, "{device}: a second connection");
        each_carries(first.iter().chain(&second), device);
        // On the second connection: three streams, one closes on both ends, a fourth is taken.
        second.push(pair());
        second.push(pair());
        close_both(second.pop().expect("pair"), device);
        // The server's worker takes the close of its end from its inbox within a pass.
        std::thread::sleep(Duration::from_millis(100));
        each_carries(&[pair()], device);
        assert_eq!(
            a.conn_stats().connects,
            2,
            "{device}: on the second connection"
        );
        assert_eq!(
            refused(&b),
            1,
            "{device}: a stream within the limit counted"
        );
    }
}

/// Both ends of a channel report the stream window their connection uses: the smaller of the
/// two ends' `Config::stream_window`, whichever end has it.
#[test]
fn both_ends_report_the_smaller_stream_window() {
    use std::time::Duration;
    for device in ["shm0", "tcp0"] {
        for (client, server) in [(64, 64), (8, 64), (64, 8)] {
            let a = super::Endpoint::new(crate::Config {
                stream_window: client,
                ..one_worker(device)
            })
            .expect("a");
            let b = super::Endpoint::new(crate::Config {
                stream_window: server,
                ..one_worker(device)
            })
            .expect("b");
            let listener = b.listen("127.0.0.1:0").expect("listen");
            let c = a.connect(listener.local_addr()).expect("connect");
            let s = listener
                .accept_timeout(Duration::from_secs(10))
                .expect("accept");
            let want = client.min(server);
            assert_eq!(
                (c.stream_window(), s.stream_window()),
                (want, want),
                "{device}: windows {client} and {server}"
            );
        }
    }
}

/// A call on a stream its peer refuses fails with `StreamRefused` however the call and the
/// refusal cross: one checked before the refusal arrived but taken by the worker after it
/// (queued while the worker thread held its state) was told `PeerGone`, as if the server had
/// gone. The crossing is timing: calls follow their stream's open after 0 to 63 µs, on a
/// worker thread that holds its state while it polls.
#[test]
fn a_call_crossing_the_refusal_of_its_stream_is_told_it_was_refused() {
    use crate::{ChannelError, RpcError};
    use std::time::{Duration, Instant};
    const WAIT: Duration = Duration::from_secs(10);
    for device in ["shm0", "tcp0"] {
        let (a, b, listener) = client_server(crate::Config {
            max_streams: 1,
            ..one_worker(device)
        });
        b.serve("echo", |req| Ok(req.to_vec()));
        let mut told = std::collections::BTreeMap::<String, u32>::new();
        for i in 0..3000u64 {
            // The pool hands the refusing connection out no more: each round sets one up,
            // whose first stream is taken, and opens a second one on it, which is refused.
            let _first = a.connect(listener.local_addr()).expect("connect");
            let _accepted = listener.accept_timeout(WAIT).expect("accept");
            let refused = a
                .connect(listener.local_addr())
                .expect("connect past the limit");
            let t0 = Instant::now();
            let gap = Duration::from_micros(i.wrapping_mul(37) % 64);
            while t0.elapsed() < gap {
                std::hint::spin_loop();
            }
            match crate::Rpc::new(refused).call("echo", b"x", WAIT) {
                Err(RpcError::Channel(ChannelError::StreamRefused)) => {}
                other => *told.entry(format!("{other:?}")).or_default() += 1,
            }
        }
        assert!(
            told.is_empty(),
            "{device}: calls on refused streams got {told:?}"
        );
    }
}

/// An endpoint keeps at most `max_connections` connections that peers made to it: a handshake
/// past them is rejected (`Unavailable`, said in the connecting side's error) before a QP or a
/// receive ring is set up, the kept connections go on, and once one of them is gone the next
/// handshake is taken. (Without the bound, peers could make it pin rings without end.)
#[test]
fn connections_past_the_limit_are_rejected_and_the_rest_go_on() {
    use crate::conn::{ConnError, RejectCode};
    use crate::ChannelError;
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    for device in ["shm0", "tcp0"] {
        let cfg = crate::Config {
            share_connections: false,
            max_connections: 2,
            ..one_worker(device)
        };
        let (a, b, listener) = client_server(cfg);
        let mut pairs = Vec::new();
        for _ in 0..2 {
            let c = a.connect(listener.local_addr()).expect("connect");
            let s = listener.accept_timeout(WAIT).expect("accept");
            pairs.push((c, s));
        }
        let qps = b.conn_stats().qps_created;
        match a.connect(listener.local_addr()) {
            Err(ChannelError::Connect(ConnError::Rejected {
                code: RejectCode::Unavailable,
                reason,
                ..
            })) => assert!(reason.contains("capacity"), "{device}: {reason}"),
            other => panic!("{device}: a third connection got {other:?}"),
        }
        assert_eq!(
            b.conn_stats().qps_created,
            qps,
            "{device}: a QP for a rejected peer"
        );
        match listener.next_failure(WAIT) {
            Some(ConnError::AtCapacity { max: 2, .. }) => {}
            other => panic!("{device}: the server recorded {other:?}"),
        }
        let rejected = |ep: &super::Endpoint| ep.guard_stats().connections_rejected;
        assert_eq!((rejected(&b), rejected(&a)), (1, 0), "{device}: rejections");
        each_carries(&pairs, device);
        close_both(pairs.pop().expect("pair"), device);
        let until = std::time::Instant::now() + WAIT;
        let mut retries = 0;
        let c = loop {
            match a.connect(listener.local_addr()) {
                Ok(c) => break c,
                Err(e) if std::time::Instant::now() < until => {
                    assert!(
                        matches!(e, ChannelError::Connect(ConnError::Rejected { .. })),
                        "{e}"
                    );
                    retries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("{device}: no connection after one closed: {e}"),
            }
        };
        let s = listener.accept_timeout(WAIT).expect("accept again");
        each_carries(&[(c, s)], device);
        assert_eq!(
            b.guard_stats().connections_rejected,
            retries + 1,
            "{device}: one per rejected handshake"
        );
    }
}

/// The stream window counts a unit per started MiB of a message (half the window at most), so
/// a reader that stops holds at most a window of MiB or two messages of any size, not a window
/// of messages of any size: on a window of 4, two unread 1.5 MiB messages fill it, and so
/// would two of 10 MiB. Payloads arrive whole and in order.
#[test]
fn the_stream_window_bounds_unread_bytes_not_only_messages() {
    use crate::ChannelError;
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    const MIB: usize = 1 << 20;
    for device in ["shm0", "tcp0"] {
        let (a, _b, listener) = client_server(crate::Config {
            stream_window: 4,
            ..one_worker(device)
        });
        let ca = a.connect(listener.local_addr()).expect("connect");
        let cb = listener.accept_timeout(WAIT).expect("accept");
        let msg = |tag: u8, len: usize| vec![tag; len];
        ca.send_timeout(&msg(1, 3 * MIB / 2), WAIT).expect("first");
        ca.send_timeout(&msg(2, 3 * MIB / 2), WAIT).expect("second");
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            matches!(
                ca.try_send(&msg(3, 3 * MIB / 2)),
                Err(ChannelError::WouldBlock)
            ),
            "{device}: a third 1.5 MiB message past a window of 4 MiB"
        );
        // A small message takes a unit too: the two took all four.
        assert!(
            matches!(ca.try_send(b"x"), Err(ChannelError::WouldBlock)),
            "{device}"
        );
        let big = std::thread::spawn(move || {
            ca.send_timeout(&msg(3, 3 * MIB / 2), WAIT).expect("third");
            ca.send_timeout(&msg(4, 10 * MIB), WAIT)
                .expect("the large one");
            ca.send_timeout(&msg(5, 10 * MIB), WAIT)
                .expect("another large one");
            ca
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !big.is_finished(),
            "{device}: the third went into a full window"
        );
        for (tag, len) in [(1u8, 3 * MIB / 2), (2, 3 * MIB / 2), (3, 3 * MIB / 2)] {
            let m = cb.recv_timeout(WAIT).expect("recv");
            assert_eq!(m.len(), len, "{device}");
            assert!(m.iter().all(|&b| b == tag), "{device}: message {tag}");
        }
        for tag in [4u8, 5] {
            let m = cb.recv_timeout(WAIT).expect("recv a large one");
            assert_eq!(m.len(), 10 * MIB, "{device}");
            assert!(m.iter().all(|&b| b == tag), "{device}: message {tag}");
        }
        let ca = big.join().expect("sender");
        ca.send_timeout(b"after", WAIT).expect("send after");
        assert_eq!(&cb.recv_timeout(WAIT).expect("recv after")[..], b"after");
    }
}

/// One-sided operations past the pool's largest class (64 KiB) reuse one large buffer and its
/// registration: after ten READs and ten WRITEs of 1 MiB by the copying forms (`read`,
/// `write`), the worker keeps the one MiB buffer they went through. (Before, each operation
/// registered a MiB and deregistered it when done, and nothing was kept.)
#[test]
fn large_one_sided_buffers_are_kept_for_reuse() {
    const WAIT: std::time::Duration = std::time::Duration::from_secs(10);
    const MIB: usize = 1 << 20;
    for device in ["shm0", "tcp0"] {
        let (a, b, listener) = client_server(one_worker(device));
        let ca = a.connect(listener.local_addr()).expect("connect");
        let cb = listener.accept_timeout(WAIT).expect("accept");
        let region = b.expose(2 * MIB).expect("expose");
        let remote = ca.remote_region(region.descriptor_for(&cb));
        let data = vec![5u8; MIB];
        for _ in 0..10 {
            assert_eq!(remote.read(0, MIB as u32).expect("read").len(), MIB);
            remote.write(MIB as u64, &data).expect("write");
        }
        let buffers = a.inner.fabrics[0].workers[0]
            .shared
            .buffers()
            .expect("buffers");
        assert_eq!(buffers.kept_bytes(), MIB, "{device}");
    }
}

/// Async waits in caller mode: a task's `recv_async`, `send_async`, `call_async` and one-sided
/// `_async` operation move the worker themselves while they look, and once asleep the
/// back-stop moves it for them. Before, nothing did until the back-stop's grace had passed
/// since the last call of any thread — each round trip of an async ping-pong took 10 ms. Run
/// with the idle budget (the task looks, then sleeps after every message) and without it (it
/// sleeps at once: the back-stop's path alone).
#[test]
fn async_waits_in_caller_mode_do_not_wait_for_the_back_stop() {
    use std::time::{Duration, Instant};
    const WAIT: Duration = Duration::from_secs(10);
    for idle_spin_us in [50, 0] {
        let (a, b, listener) = client_server(crate::Config {
            idle_spin_us,
            ..caller_mode_config()
        });
        b.serve("echo", |req| Ok(req.to_vec()));
        let region = b.expose(64).expect("expose");
        let ca = a.connect(listener.local_addr()).expect("connect");
        let cb = listener.accept_timeout(WAIT).expect("accept");
        let remote = ca.remote_region(region.descriptor_for(&cb));
        let rpc = crate::Rpc::new(ca.clone());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let rounds = 200u64;
        let echo = rt.spawn(async move {
            for _ in 0..rounds {
                let m = cb.recv_async().await.expect("recv");
                cb.send_async(&m).await.expect("echo");
            }
            // Open until the calls and operations on its connection are done.
            cb
        });
        let slow = rt.block_on(async move {
            let mut slow = Vec::new();
            for i in 0..rounds {
                let t = Instant::now();
                ca.send_async(&i.to_le_bytes()).await.expect("send");
                let m = ca.recv_async().await.expect("recv echo");
                assert_eq!(&m[..], &i.to_le_bytes());
                let r = rpc
                    .call_async("echo", &i.to_le_bytes(), WAIT)
                    .await
                    .expect("call");
                assert_eq!(r, i.to_le_bytes());
                let before = remote.fetch_and_add_async(0, 1).await.expect("fetch-add");
                assert_eq!(before, i);
                let took = t.elapsed();
                if took >= crate::worker::shared::BACKSTOP_GRACE {
                    slow.push((i, took));
                }
            }
            slow
        });
        drop(rt.block_on(echo).expect("echo task"));
        assert!(
            slow.len() <= 5,
            "idle_spin_us {idle_spin_us}: {} of {rounds} async rounds took a back-stop grace or \
             more: {slow:?}",
            slow.len()
        );
    }
}

/// A connection closed at once (`close_linger_ms = 0`) while its peer pulls a rendezvous
/// message — its last channel dropped, or its whole endpoint — : the peer reads either the
/// whole message, intact, or `PeerGone`; never a failed READ, which it got when the closing
/// end gave the message's buffer back (or deregistered it) while its QP still served the
/// peer's READs. Sizes in the pool's classes and above them; shm0, tcp0 and udp0.
#[test]
fn a_close_at_once_during_a_pull_tells_the_reader_its_peer_went() {
    use std::time::Duration;
    const WAIT: Duration = Duration::from_secs(10);
    for dev in ["shm0", "tcp0", "udp0"] {
        let cfg = crate::Config {
            close_linger_ms: 0,
            ..one_worker(dev)
        };
        let (a, b, listener) = client_server(cfg.clone());
        for len in [64usize << 10, 512 << 10, 8 << 20] {
            let mut gone = [0; 2];
            for round in 0..40u8 {
                // Every fourth round the sender's endpoint goes with its channel.
                let whole = round % 4 == 3;
                let own = whole.then(|| super::Endpoint::new(cfg.clone()).expect("sender"));
                let ca = own
                    .as_ref()
                    .unwrap_or(&a)
                    .connect(listener.local_addr())
                    .expect("connect");
                let cb = listener.accept_timeout(WAIT).expect("accept");
                ca.send(&vec![round; len]).expect("send");
                drop(ca);
                drop(own);
                match cb.recv_timeout(WAIT) {
                    Ok(m) => assert!(
                        m.len() == len && m.iter().all(|&b| b == round),
                        "{dev} {len} B, round {round}: a message of {} bytes not as sent",
                        m.len()
                    ),
                    Err(crate::ChannelError::PeerGone) => gone[usize::from(whole)] += 1,
                    Err(e) => panic!("{dev} {len} B, round {round} (endpoint gone: {whole}): {e}"),
                }
            }
            eprintln!(
                "{dev} {len} B: {} of 30 ended by the channel's close, {} of 10 by the endpoint's",
                gone[0], gone[1]
            );
        }
        drop(b);
    }
}
