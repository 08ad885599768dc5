//! One-sided operations have a deadline: against an owner that stopped answering (a process
//! stopped with SIGSTOP, on tcp0, where the owner's provider serves them), a read, a write and
//! an atomic end with `Timeout` at their deadline — the endpoint's `remote_timeout_ms` or the
//! region's own — whether posted, waiting for room in the send queue or awaited from async
//! code. Once the owner goes on, the channel works and late completions are dropped. (Without
//! a deadline of their own such operations ended only when the transport's retries ran out —
//! `RetryExceeded` after ≈ 7 s on tcp0 — and took the channel down with them.) Waits are
//! bounded by a generous deadline that only catches hangs.

mod common;

use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fabriq::{ChannelError, Config, Endpoint, RegionDescriptor, RemoteRegion};
use rustix::process::Signal;

use common::PeerProcess as Owner;

const HANG: Duration = Duration::from_secs(30);
/// The endpoint's deadline for one-sided operations here.
const DEADLINE: Duration = Duration::from_millis(400);

fn config() -> Config {
    Config {
        device: "tcp0".into(),
        remote_timeout_ms: DEADLINE.as_millis() as u64,
        ..Config::default()
    }
}

/// `op` on a thread of its own: its outcome and how long it took, or a panic if it hangs.
fn timed<T: Send + 'static>(what: &str, op: impl FnOnce() -> T + Send + 'static) -> (T, Duration) {
    let rx = started(op);
    rx.recv_timeout(HANG)
        .unwrap_or_else(|_| panic!("{what}: did not end"))
}

fn started<T: Send + 'static>(
    op: impl FnOnce() -> T + Send + 'static,
) -> mpsc::Receiver<(T, Duration)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let got = op();
        let _ = tx.send((got, t0.elapsed()));
    });
    rx
}

fn is_timeout<T: std::fmt::Debug>(what: &str, got: &Result<T, ChannelError>) {
    assert!(matches!(got, Err(ChannelError::Timeout)), "{what}: {got:?}");
}

#[test]
fn one_sided_operations_on_a_stopped_owner_end_by_their_deadline() {
    let ep = Endpoint::new(config()).expect("endpoint");
    let listener = ep.listen("127.0.0.1:0").expect("listen");
    let exe = std::env::current_exe().expect("test binary");
    let owner = Owner(
        Command::new(exe)
            .args([
                "--exact",
                "owner_process",
                "--include-ignored",
                "--nocapture",
            ])
            .env("FABRIQ_OWNER_ADDR", listener.local_addr().to_string())
            .spawn()
            .expect("spawn the owner"),
    );
    let ch = listener.accept_timeout(HANG).expect("the owner connects");
    let desc = RegionDescriptor::from_bytes(&ch.recv_timeout(HANG).expect("descriptor"))
        .expect("valid descriptor");
    let region = ch.remote_region(desc);
    assert_eq!(region.timeout(), DEADLINE);
    region.write(0, b"before").expect("write");
    assert_eq!(region.read(0, 6).expect("read"), b"before");

    owner.stop(HANG);
    let r = region.clone();
    let (got, took) = timed("read", move || r.read(0, 6));
    is_timeout("read", &got);
    assert!(
        (DEADLINE..HANG).contains(&took),
        "read ended after {took:?}"
    );

    // A longer deadline awaited from async code, then a shorter one on the blocking path,
    // outstanding together: each ends at its own.
    let slow = region.clone().with_timeout(Duration::from_millis(1_500));
    let slow = started(move || {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(slow.read_async(0, 6))
    });
    std::thread::sleep(Duration::from_millis(50));
    let fast = region.clone().with_timeout(Duration::from_millis(200));
    let (got, took) = timed("fetch_and_add", move || fast.fetch_and_add(8, 1));
    is_timeout("fetch_and_add", &got);
    assert!(
        (Duration::from_millis(200)..Duration::from_millis(1_400)).contains(&took),
        "fetch_and_add ended after {took:?}"
    );
    let (got, took) = slow.recv_timeout(HANG).expect("the async read did not end");
    is_timeout("async read", &got);
    assert!(
        (Duration::from_millis(1_500)..HANG).contains(&took),
        "the async read ended after {took:?}"
    );

    // More writes at once than the worker keeps posted: the rest wait in its queue, and end
    // there at their deadline.
    let writers: Vec<_> = (0..48u8)
        .map(|i| {
            let r: RemoteRegion = region.clone();
            started(move || r.write(24, &[i; 16]))
        })
        .collect();
    for (i, w) in writers.into_iter().enumerate() {
        let (got, took) = w
            .recv_timeout(HANG)
            .unwrap_or_else(|_| panic!("write {i} did not end"));
        is_timeout("write", &got);
        assert!(took >= DEADLINE, "write {i} ended after {took:?}");
    }

    // The owner goes on: the late completions find no caller, the channel carries on.
    owner.signal(Signal::CONT);
    region.write(0, b"after!").expect("write after");
    assert_eq!(region.read(0, 6).expect("read after"), b"after!");
    let before = region.fetch_and_add(40, 5).expect("fetch_and_add after");
    assert_eq!(before, 0);
    assert_eq!(
        region.read(40, 8).expect("read the word"),
        5u64.to_ne_bytes()
    );
    ch.send(b"bye").expect("bye");
    let mut owner = owner;
    let status = owner.0.wait().expect("wait for the owner");
    assert!(status.success(), "the owner failed: {status}");
}

/// The owner side, run in a child process by the test above: exposes a region, hands over its
/// descriptor, and waits for the word to end.
#[test]
#[ignore = "helper process of one_sided_operations_on_a_stopped_owner_end_by_their_deadline"]
fn owner_process() {
    let Ok(addr) = std::env::var("FABRIQ_OWNER_ADDR") else {
        return;
    };
    let ep = Endpoint::new(config()).expect("endpoint");
    let region = ep.expose(64).expect("expose");
    let ch = ep.connect(addr.as_str()).expect("connect");
    ch.send(&region.descriptor().to_bytes())
        .expect("send descriptor");
    let bye = ch.recv_timeout(Duration::from_secs(120)).expect("bye");
    assert_eq!(&bye[..], b"bye");
}
