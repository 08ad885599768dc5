//! RPC handlers that reply later (`serve_deferred`): the reply goes out from whichever thread
//! uses the `Responder`, reaches the right caller among many, a failure reaches it as
//! `RpcError::Handler`, and a responder dropped without a reply ends its call at once instead
//! of at the caller's deadline. On shm and tcp, with worker threads and in caller mode. A
//! handler's nested call: refused when blocking on its own worker, answered from a deferred
//! handler or an async one (`serve_async`); a handler's other waits on its own worker refused;
//! a panicking handler failing only its call. Waits are bounded by a generous deadline that
//! only catches hangs.

use std::sync::mpsc;
use std::time::Duration;

use fabriq::rpc::DROPPED_WITHOUT_REPLY;
use fabriq::{Config, Endpoint, Progress, Responder, Rpc, RpcError};

const HANG: Duration = Duration::from_secs(30);

/// Concurrent callers; the replier answers them only once all their requests are in, last
/// first, so every reply crosses the others.
const CALLERS: usize = 16;

/// An endpoint's configuration here: one worker (the tests that need a handler on the worker
/// of a given channel rely on it).
fn config(device: &str, progress: Progress) -> Config {
    Config {
        device: device.into(),
        progress,
        workers: 1,
        ..Config::default()
    }
}

fn pair(device: &str, progress: Progress) -> (Endpoint, Endpoint, fabriq::Channel, Rpc) {
    let cfg = config(device, progress);
    let server = Endpoint::new(cfg.clone()).expect("server endpoint");
    let client = Endpoint::new(cfg).expect("client endpoint");
    let listener = server.listen("127.0.0.1:0").expect("listen");
    let c = client.connect(listener.local_addr()).expect("connect");
    let s = listener.accept_timeout(HANG).expect("accept");
    (server, client, s, Rpc::new(c))
}

/// A backend endpoint for `server`'s handlers to call (it serves nothing yet), and `server`'s
/// RPC connection to it (on the server's only worker); the backend's end of it is kept open.
fn backend(server: &Endpoint, progress: Progress) -> (Endpoint, fabriq::Channel, Rpc) {
    let backend = Endpoint::new(config("shm0", progress)).expect("backend");
    let listener = backend.listen("127.0.0.1:0").expect("listen");
    let to_backend = Rpc::new(
        server
            .connect(listener.local_addr())
            .expect("connect to the backend"),
    );
    let end = listener.accept_timeout(HANG).expect("accept");
    (backend, end, to_backend)
}

/// `later` hands each request to a replier thread, which answers a batch of `CALLERS` in
/// reverse order of arrival: "ok:<request>", or a failure for requests that start with `!`.
fn replies_later(device: &str, progress: Progress) {
    let (server, _client, _s, rpc) = pair(device, progress);
    let (tx, rx) = mpsc::channel::<(Vec<u8>, Responder)>();
    let tx = std::sync::Mutex::new(tx);
    server.serve_deferred("later", move |req, responder| {
        tx.lock()
            .expect("sender")
            .send((req.to_vec(), responder))
            .expect("replier");
    });
    let replier = std::thread::spawn(move || {
        let mut batch: Vec<(Vec<u8>, Responder)> = Vec::new();
        while batch.len() < CALLERS {
            batch.push(rx.recv_timeout(HANG).expect("a request"));
        }
        for (req, responder) in batch.into_iter().rev() {
            if req.first() == Some(&b'!') {
                responder.fail("refused").expect("fail");
            } else {
                let mut body = b"ok:".to_vec();
                body.extend_from_slice(&req);
                responder.reply(&body).expect("reply");
            }
        }
    });
    let callers: Vec<_> = (0..CALLERS)
        .map(|i| {
            let rpc = rpc.clone();
            std::thread::spawn(move || {
                let req = match i % 4 {
                    3 => format!("!{i}"),
                    _ => format!("req-{i}"),
                };
                (req.clone(), rpc.call("later", req.as_bytes(), HANG))
            })
        })
        .collect();
    for c in callers {
        let (req, got) = c.join().expect("caller");
        if req.starts_with('!') {
            assert!(
                matches!(&got, Err(RpcError::Handler(m)) if m == "refused"),
                "{req}: {got:?}"
            );
        } else {
            assert_eq!(
                got.expect("reply"),
                format!("ok:{req}").into_bytes(),
                "{req}"
            );
        }
    }
    replier.join().expect("replier");
    // The channel is as good as before: an inline handler on it still answers.
    server.serve("echo", |req| Ok(req.to_vec()));
    assert_eq!(rpc.call("echo", b"after", HANG).expect("echo"), b"after");
}

#[test]
fn deferred_replies_reach_their_callers_shm_thread_mode() {
    replies_later("shm0", Progress::Thread);
}

#[test]
fn deferred_replies_reach_their_callers_shm_caller_mode() {
    replies_later("shm0", Progress::Caller);
}

#[test]
fn deferred_replies_reach_their_callers_tcp_thread_mode() {
    replies_later("tcp0", Progress::Thread);
}

#[test]
fn deferred_replies_reach_their_callers_tcp_caller_mode() {
    replies_later("tcp0", Progress::Caller);
}

/// A handler that drops its responder (here: at once; the same holds for one dropped on
/// another thread later) fails the call with `Handler` — not a `Timeout` at the deadline.
#[test]
fn a_responder_dropped_without_a_reply_fails_the_call_at_once() {
    for progress in [Progress::Thread, Progress::Caller] {
        let (server, _client, _s, rpc) = pair("shm0", progress);
        server.serve_deferred("forgets", |_, responder| drop(responder));
        server.serve_deferred("forgets_later", |_, responder| {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(5));
                drop(responder);
            });
        });
        for method in ["forgets", "forgets_later"] {
            let got = rpc.call(method, b"x", HANG);
            assert!(
                matches!(&got, Err(RpcError::Handler(m)) if m == DROPPED_WITHOUT_REPLY),
                "{method} ({progress:?}): {got:?}"
            );
        }
    }
}

/// A reply the server has no pool memory for (`Config::pool_max_bytes`) answers its caller at
/// once with `RpcError::Handler(NO_MEMORY)` — a reply held in place needs none — inline or
/// deferred (whose responder also tells the handler), and the caller's next calls go on: its
/// place in the call window came back. (Before, the caller waited for its deadline, and the
/// place stayed taken.)
#[test]
fn a_reply_without_pool_memory_answers_its_caller_at_once() {
    const HUGE: usize = 8 << 20;
    for progress in [Progress::Thread, Progress::Caller] {
        let server = Endpoint::new(Config {
            pool_max_bytes: Some(4 << 20),
            ..config("shm0", progress)
        })
        .expect("server");
        let client = Endpoint::new(config("shm0", progress)).expect("client");
        let listener = server.listen("127.0.0.1:0").expect("listen");
        server.serve("huge", |_| Ok(vec![7u8; HUGE]));
        let (told, handler_told) = mpsc::channel();
        server.serve_deferred("huge_later", move |_, responder| {
            let _ = told.send(responder.reply(&vec![7u8; HUGE]));
        });
        server.serve("echo", |req| Ok(req.to_vec()));
        let rpc = Rpc::new(client.connect(listener.local_addr()).expect("connect"));
        let _s = listener.accept_timeout(HANG).expect("accept");
        for round in 0..3 {
            for method in ["huge", "huge_later"] {
                let started = std::time::Instant::now();
                let got = rpc.call(method, b"x", HANG);
                assert!(
                    matches!(&got, Err(RpcError::Handler(m)) if m == fabriq::rpc::NO_MEMORY),
                    "{method} ({progress:?}, round {round}): {got:?}"
                );
                assert!(
                    started.elapsed() < HANG / 2,
                    "{method}: answered at the deadline"
                );
            }
            let told = handler_told
                .recv_timeout(HANG)
                .expect("the handler's result");
            assert!(
                matches!(told, Err(fabriq::ChannelError::Pool(_))),
                "{progress:?}: the deferred handler was told {told:?}"
            );
            assert_eq!(rpc.call("echo", b"on", HANG).expect("echo"), b"on");
            assert_eq!(
                server.guard_stats().replies_without_memory,
                2 * (round + 1),
                "{progress:?}: counted, one per reply"
            );
        }
        assert_eq!(client.guard_stats(), fabriq::GuardStats::default());
    }
}

/// A reply used inside the handler itself (no hand-off) goes out too.
#[test]
fn a_deferred_handler_may_reply_before_it_returns() {
    for progress in [Progress::Thread, Progress::Caller] {
        let (server, _client, _s, rpc) = pair("shm0", progress);
        server.serve_deferred("now", |req, responder| {
            responder.reply(req).expect("reply");
        });
        for i in 0..100u32 {
            let req = i.to_le_bytes();
            assert_eq!(
                rpc.call("now", &req, HANG).expect("reply"),
                req,
                "{progress:?}"
            );
        }
    }
}

/// A handler that makes a blocking call on a channel of its own worker (here the server's
/// only worker) gets `WouldDeadlock` at once, and nothing is sent: that worker would send the
/// request and read the reply only after the handler returned. Made from a deferred handler
/// with `call_async` instead, the nested call is answered.
#[test]
fn a_blocking_call_on_the_handlers_own_worker_is_refused_and_call_async_works() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    for progress in [Progress::Thread, Progress::Caller] {
        let (server, _client, _s, rpc) = pair("shm0", progress);
        let (backend, _backend_end, to_backend) = backend(&server, progress);
        let inner_calls = Arc::new(AtomicUsize::new(0));
        {
            let inner_calls = inner_calls.clone();
            backend.serve("inner", move |req| {
                inner_calls.fetch_add(1, Ordering::SeqCst);
                Ok(req.to_vec())
            });
        }
        {
            let to_backend = to_backend.clone();
            server.serve("blocking", move |req| {
                to_backend
                    .call("inner", req, HANG)
                    .map_err(|e| format!("{e:?}"))
            });
        }
        let got = rpc.call("blocking", b"x", HANG);
        assert!(
            matches!(&got, Err(RpcError::Handler(m)) if m == "WouldDeadlock"),
            "{progress:?}: {got:?}"
        );
        assert_eq!(inner_calls.load(Ordering::SeqCst), 0, "nothing was sent");

        let rt = Arc::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("runtime"),
        );
        server.serve_deferred("nested", move |req, responder| {
            let (to_backend, req) = (to_backend.clone(), req.to_vec());
            rt.spawn(async move {
                match to_backend.call_async("inner", &req, HANG).await {
                    Ok(r) => responder.reply(&r),
                    Err(e) => responder.fail(&e.to_string()),
                }
                .expect("answer");
            });
        });
        for i in 0..20u32 {
            assert_eq!(
                rpc.call("nested", &i.to_le_bytes(), HANG).expect("nested"),
                i.to_le_bytes(),
                "{progress:?}"
            );
        }
        assert_eq!(inner_calls.load(Ordering::SeqCst), 20);
    }
}

/// A handler of the server's only worker that waits on a channel of that worker: a receive
/// with nothing delivered, sends past the stream's window (the client reads none of them), a
/// one-sided read of the client's memory. Each would wait for a pass of the very worker whose
/// pass runs the handler — for ever; each fails with `ChannelError::WouldDeadlock` instead, and
/// the channel carries on afterwards. Thread mode and caller mode.
#[test]
fn a_handler_waiting_on_its_own_workers_channel_gets_would_deadlock() {
    use fabriq::ChannelError;
    for progress in [Progress::Thread, Progress::Caller] {
        let (done_tx, done_rx) = mpsc::channel();
        // On a thread of its own: a wait that never ends must fail the test, not hang it.
        std::thread::spawn(move || {
            let (server, client, s, rpc) = pair("shm0", progress);
            let c = rpc.channel().clone();
            let region = client.expose(4096).expect("expose");
            c.send(&region.descriptor().to_bytes()).expect("descriptor");
            let desc = fabriq::RegionDescriptor::from_bytes(&s.recv_timeout(HANG).expect("recv"))
                .expect("descriptor");
            let remote = s.remote_region(desc);
            let err = |e: ChannelError| format!("{e:?}");
            {
                let s = s.clone();
                server.serve("recv", move |_| s.recv().map(|m| m.to_vec()).map_err(err));
            }
            {
                let s = s.clone();
                server.serve("flood", move |_| {
                    for sent in 0..1_000_000u32 {
                        if let Err(e) = s.send(&[7u8; 512]) {
                            return Err(format!("{e:?} after {sent}"));
                        }
                    }
                    Ok(Vec::new())
                });
            }
            server.serve("read", move |_| remote.read(0, 8).map_err(err));
            let results: Vec<_> = ["recv", "flood", "read"]
                .iter()
                .map(|m| (*m, rpc.call(m, b"", HANG)))
                .collect();
            // The channel still works both ways: the flood's messages, then a new one.
            let mut flooded = 0;
            while let Ok(Some(_)) = c.try_recv() {
                flooded += 1;
            }
            while let Ok(m) = c.recv_timeout(Duration::from_millis(200)) {
                assert_eq!(m.len(), 512);
                flooded += 1;
            }
            c.send(b"after").expect("send after");
            let after = s.recv_timeout(HANG).expect("recv after");
            let _ = done_tx.send((format!("{results:?}"), flooded, after.to_vec()));
        });
        let (results, flooded, after) = done_rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("{progress:?}: a handler's wait never ended"));
        assert!(
            results.contains(r#"("recv", Err(Handler("WouldDeadlock")))"#),
            "{progress:?}: {results}"
        );
        assert!(
            results.contains(r#"("flood", Err(Handler("WouldDeadlock after "#),
            "{progress:?}: {results}"
        );
        assert!(
            results.contains(r#"("read", Err(Handler("WouldDeadlock")))"#),
            "{progress:?}: {results}"
        );
        assert!(
            flooded > 0,
            "{progress:?}: the sends before the window filled"
        );
        assert_eq!(after, b"after", "{progress:?}");
    }
}

/// A responder kept past its call's deadline, and past both endpoints: the late reply (and a
/// responder dropped then) goes nowhere, without a panic; the caller had its `Timeout`.
#[test]
fn a_responder_used_after_its_call_and_its_endpoint_are_gone_is_harmless() {
    for progress in [Progress::Thread, Progress::Caller] {
        let (server, client, s, rpc) = pair("shm0", progress);
        let kept: std::sync::Arc<std::sync::Mutex<Vec<Responder>>> = Default::default();
        {
            let kept = kept.clone();
            server.serve_deferred("never", move |_, responder| {
                kept.lock().expect("kept").push(responder);
            });
        }
        for _ in 0..3 {
            assert!(
                matches!(
                    rpc.call("never", b"", Duration::from_millis(50)),
                    Err(RpcError::Timeout)
                ),
                "{progress:?}"
            );
        }
        let mut late: Vec<Responder> = std::mem::take(&mut *kept.lock().expect("kept"));
        assert_eq!(late.len(), 3, "{progress:?}");
        // The caller is gone: its reply is dropped on arrival.
        late.pop()
            .expect("responder")
            .reply(b"late")
            .expect("queued");
        assert_eq!(
            rpc.channel()
                .try_recv()
                .expect("try_recv")
                .map(|m| m.to_vec()),
            None,
            "{progress:?}: a late reply is not a message"
        );
        drop((rpc, s, client, server));
        // Both endpoints gone: replying fails or goes nowhere; dropping one does nothing.
        let last = late.pop().expect("responder");
        let _ = last.reply(b"later still");
        drop(late);
        drop(kept);
    }
}

/// `serve_async`: a handler that is a future, run on the application's runtime, awaiting a
/// nested call to a backend and a timer before it answers — 32 calls in flight at once, on a
/// server of one worker (which only starts each future), each answered with its own
/// request's result; an `Err` reaches the caller as `Handler`.
#[test]
fn async_handlers_await_nested_calls_and_answer_their_own_callers() {
    for progress in [Progress::Thread, Progress::Caller] {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let (server, _client, _s, rpc) = pair("shm0", progress);
        let (backend, _backend_end, to_backend) = backend(&server, progress);
        backend.serve("double", |req| {
            let v = u32::from_le_bytes(req.try_into().map_err(|_| "4 bytes".to_string())?);
            Ok((v * 2).to_le_bytes().to_vec())
        });
        server.serve_async("double_later", rt.handle().clone(), move |req| {
            let to_backend = to_backend.clone();
            async move {
                if req.is_empty() {
                    return Err("empty request".to_string());
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                to_backend
                    .call_async("double", &req, HANG)
                    .await
                    .map_err(|e| e.to_string())
            }
        });
        let callers: Vec<_> = (0..32u32)
            .map(|i| {
                let rpc = rpc.clone();
                std::thread::spawn(move || (i, rpc.call("double_later", &i.to_le_bytes(), HANG)))
            })
            .collect();
        for c in callers {
            let (i, got) = c.join().expect("caller");
            assert_eq!(got.expect("reply"), (i * 2).to_le_bytes(), "{progress:?}");
        }
        assert!(
            matches!(
                rpc.call("double_later", b"", HANG),
                Err(RpcError::Handler(m)) if m == "empty request"
            ),
            "{progress:?}"
        );
    }
}

/// A handler that panics fails its call with `Handler("the handler panicked: …")`, and the
/// worker goes on: the same channel and another channel on the same (only) worker are served
/// after it, inline and deferred handlers alike (a deferred handler's panic drops its
/// responder, which answers the caller). Thread mode and caller mode.
#[test]
fn a_panicking_handler_fails_its_call_and_the_worker_goes_on() {
    use fabriq::rpc::HANDLER_PANICKED;
    const CALL: Duration = Duration::from_secs(5);
    for progress in [Progress::Thread, Progress::Caller] {
        let cfg = config("shm0", progress);
        let server = Endpoint::new(cfg.clone()).expect("server");
        let client = Endpoint::new(cfg).expect("client");
        let listener = server.listen("127.0.0.1:0").expect("listen");
        server.serve("echo", |req| Ok(req.to_vec()));
        server.serve("boom", |_| panic!("boom"));
        server.serve_deferred("boom_later", |_, _responder| {
            panic!("{}", String::from("boom later"))
        });
        let rpcs: Vec<Rpc> = (0..2)
            .map(|_| {
                let c = client.connect(listener.local_addr()).expect("connect");
                Rpc::new(c)
            })
            .collect();
        let _ends: Vec<_> = (0..2)
            .map(|_| listener.accept_timeout(HANG).expect("accept"))
            .collect();
        for round in 0..3 {
            let got = rpcs[0].call("boom", b"", CALL);
            assert!(
                matches!(&got, Err(RpcError::Handler(m)) if *m == format!("{HANDLER_PANICKED}boom")),
                "{progress:?} round {round}: {got:?}"
            );
            let got = rpcs[0].call("boom_later", b"", CALL);
            assert!(
                matches!(&got, Err(RpcError::Handler(m)) if m == DROPPED_WITHOUT_REPLY),
                "{progress:?} round {round}: {got:?}"
            );
            for rpc in &rpcs {
                assert_eq!(
                    rpc.call("echo", b"still here", CALL).expect("echo"),
                    b"still here",
                    "{progress:?} round {round}"
                );
            }
        }
    }
}

/// Calls outstanding together with different deadlines each end at their own: a short one
/// made after a long one, and the long one after it (the connection's one deadline timer is
/// armed again for the earliest left), then one made afterwards. Their late replies are dropped;
/// the channel goes on.
#[test]
fn outstanding_calls_with_different_deadlines_each_end_at_their_own() {
    for progress in [Progress::Thread, Progress::Caller] {
        let (server, _client, _s, rpc) = pair("shm0", progress);
        let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Responder>::new()));
        let keep = std::sync::Arc::clone(&held);
        server.serve_deferred("never", move |_, responder| {
            keep.lock().expect("responders").push(responder);
        });
        server.serve("echo", |req| Ok(req.to_vec()));
        // A call on its own thread; its outcome and how long it took, or a hang.
        let timed = |rpc: Rpc, deadline: Duration| {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let t0 = std::time::Instant::now();
                let got = rpc.call("never", b"", deadline);
                let _ = tx.send((got, t0.elapsed()));
            });
            rx
        };
        let ended = |rx: mpsc::Receiver<_>, what: &str| {
            rx.recv_timeout(HANG)
                .unwrap_or_else(|_| panic!("{progress:?}: the {what} call did not end"))
        };
        let long = timed(rpc.clone(), Duration::from_millis(1_500));
        std::thread::sleep(Duration::from_millis(50));
        let short = timed(rpc.clone(), Duration::from_millis(150));
        let (got, took) = ended(short, "short");
        assert!(
            matches!(got, Err(RpcError::Timeout)),
            "{progress:?}: {got:?}"
        );
        assert!(
            (Duration::from_millis(150)..Duration::from_millis(1_400)).contains(&took),
            "{progress:?}: the short call ended after {took:?}"
        );
        let (got, took) = ended(long, "long");
        assert!(
            matches!(got, Err(RpcError::Timeout)),
            "{progress:?}: {got:?}"
        );
        assert!(
            (Duration::from_millis(1_500)..HANG).contains(&took),
            "{progress:?}: the long call ended after {took:?}"
        );
        let (got, took) = ended(timed(rpc.clone(), Duration::from_millis(200)), "later");
        assert!(
            matches!(got, Err(RpcError::Timeout)),
            "{progress:?}: {got:?}"
        );
        assert!(took < HANG, "{progress:?}: {took:?}");
        // The handler answers now: the replies find no call and are dropped.
        for responder in held.lock().expect("responders").drain(..) {
            responder.reply(b"late").expect("late reply");
        }
        assert_eq!(rpc.call("echo", b"on", HANG).expect("echo"), b"on");
    }
}
