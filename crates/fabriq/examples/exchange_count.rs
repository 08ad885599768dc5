//! The one-thread 8-byte exchange of `benches/channel.rs`, a fixed number of times, for an
//! instruction counter: `valgrind --tool=callgrind` counts what the channel path executes per
//! message, the same count run after run whatever else the host does (`bench/instructions.sh`).
//!
//! `cargo run --release -p fabriq --example exchange_count -- [ITERS] [DEVICE]`

use std::time::Duration;

use fabriq::{Config, Endpoint, Progress};

const TIMEOUT: Duration = Duration::from_secs(10);

fn main() {
    let mut args = std::env::args().skip(1);
    let iters: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let device = args.next().unwrap_or_else(|| "shm0".into());
    if args.next().as_deref() == Some("verbs") {
        return verbs(iters, &device);
    }
    // Under an instruction counter the program runs tens of times slower: an ack timer of
    // the default 50 µs would fire on every exchange, which it never does at full speed.
    let cfg = || Config {
        device: device.clone(),
        workers: 1,
        progress: Progress::Caller,
        ack_delay_us: 1_000_000,
        ..Config::default()
    };
    let a = Endpoint::new(cfg()).expect("endpoint a");
    let b = Endpoint::new(cfg()).expect("endpoint b");
    let listener = b.listen("127.0.0.1:0").expect("listen");
    let ca = a.connect(listener.local_addr()).expect("connect");
    let cb = listener.accept_timeout(TIMEOUT).expect("accept");
    let msg = [7u8; 8];
    let exchange = || {
        ca.send_timeout(&msg, TIMEOUT).expect("send");
        let m = cb.recv_timeout(TIMEOUT).expect("recv");
        cb.send_timeout(&m, TIMEOUT).expect("echo");
        let back = ca.recv_timeout(TIMEOUT).expect("recv echo");
        assert_eq!(back.len(), 8);
    };
    for _ in 0..1000 {
        exchange();
    }
    marker_start();
    for _ in 0..iters {
        exchange();
    }
    marker_end();
    println!("{iters} exchanges on {device}");
}

/// The same exchange at the verbs level: two QPs of one context, a SEND of 8 bytes into a
/// receive posted just before, both completions polled, and back.
fn verbs(iters: u64, device: &str) {
    use fabriq_verbs::{
        AccessFlags, Context, QpAttr, QpInitAttr, RecvWr, SendFlags, SendWr, WorkCompletion,
        WrOpcode,
    };
    let ctx = Context::open(device).expect("device");
    let pd = ctx.alloc_pd().expect("pd");
    let cq = ctx.create_cq(64).expect("cq");
    let qps = [0, 1].map(|_| pd.create_qp(&QpInitAttr::new(&cq)).expect("qp"));
    let mrs = [0, 1].map(|_| pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).expect("mr"));
    for (i, q) in qps.iter().enumerate() {
        q.modify(&QpAttr::init(AccessFlags::LOCAL_WRITE))
            .expect("init");
        q.modify(&QpAttr::rtr(qps[1 - i].endpoint())).expect("rtr");
        q.modify(&QpAttr::rts()).expect("rts");
    }
    let mut wcs = [WorkCompletion::default(); 4];
    let mut hop = |from: usize| {
        let rsge = mrs[1 - from].sge(64, 64).expect("sge");
        qps[1 - from]
            .post_recv(&[RecvWr::new(2, &[rsge])])
            .expect("recv");
        let ssge = [mrs[from].sge(0, 8).expect("sge")];
        let wr = SendWr::new(1, &ssge, WrOpcode::Send).with_flags(SendFlags::SIGNALED);
        qps[from].post_send(&[wr]).expect("send");
        let mut done = 0;
        while done < 2 {
            done += cq.poll(&mut wcs).expect("poll");
        }
    };
    for _ in 0..1000 {
        hop(0);
        hop(1);
    }
    marker_start();
    for _ in 0..iters {
        hop(0);
        hop(1);
    }
    marker_end();
    println!("{iters} verbs exchanges on {device}");
}

#[inline(never)]
fn marker_start() {
    std::hint::black_box(());
}

#[inline(never)]
fn marker_end() {
    std::hint::black_box(());
}
