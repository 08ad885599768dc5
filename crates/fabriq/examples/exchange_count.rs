//! The one-thread 8-byte exchange of `benches/channel.rs`, a fixed number of times, for an
//! instruction counter: `valgrind --tool=callgrind` counts what the channel path executes per
//! message, the same count run after run whatever else the host does (`bench/instructions.sh`).
//!
//! With `read` (third argument), one-sided 8-byte READs through `RemoteRegion::read` instead
//! (caller progress, one thread; the shm provider carries a READ out when it is posted), and with
//! `verbs-read` the same READ at the verbs level.
//!
//! `cargo run --release -p fabriq --example exchange_count -- [ITERS] [DEVICE] [verbs|read|verbs-read]`

use std::time::Duration;

use fabriq::{Config, Endpoint, Progress};

const TIMEOUT: Duration = Duration::from_secs(10);

fn main() {
    let mut args = std::env::args().skip(1);
    let iters: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let device = args.next().unwrap_or_else(|| "shm0".into());
    let mode = args.next();
    match mode.as_deref() {
        Some("verbs") => return verbs(iters, &device),
        Some("verbs-read") => return verbs_read(iters, &device),
        _ => {}
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
    if mode.as_deref() == Some("read") {
        let region = b.expose(4096).expect("expose");
        let remote = ca.remote_region(region.descriptor_for(&cb));
        counted(iters, "reads", &device, || {
            assert_eq!(remote.read(64, 8).expect("read").len(), 8)
        });
        return;
    }
    let msg = [7u8; 8];
    let exchange = || {
        ca.send_timeout(&msg, TIMEOUT).expect("send");
        let m = cb.recv_timeout(TIMEOUT).expect("recv");
        cb.send_timeout(&m, TIMEOUT).expect("echo");
        let back = ca.recv_timeout(TIMEOUT).expect("recv echo");
        assert_eq!(back.len(), 8);
    };
    counted(iters, "exchanges", &device, exchange);
}

/// `op` 1 000 times to warm up, then `iters` times between the markers the count starts and
/// ends at.
fn counted(iters: u64, what: &str, device: &str, mut op: impl FnMut()) {
    for _ in 0..1000 {
        op();
    }
    marker_start();
    for _ in 0..iters {
        op();
    }
    marker_end();
    println!("{iters} {what} on {device}");
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
    counted(iters, "verbs exchanges", device, || {
        hop(0);
        hop(1);
    });
}

/// An 8-byte RDMA READ at the verbs level: two QPs of one context, a signaled READ of the
/// other's buffer, its completion polled.
fn verbs_read(iters: u64, device: &str) {
    use fabriq_verbs::{
        AccessFlags, Context, QpAttr, QpInitAttr, SendFlags, SendWr, WorkCompletion, WrOpcode,
    };
    let ctx = Context::open(device).expect("device");
    let pd = ctx.alloc_pd().expect("pd");
    let cq = ctx.create_cq(64).expect("cq");
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
    let qps = [0, 1].map(|_| pd.create_qp(&QpInitAttr::new(&cq)).expect("qp"));
    let mrs = [0, 1].map(|_| pd.alloc_mr(4096, access).expect("mr"));
    for (i, q) in qps.iter().enumerate() {
        q.modify(&QpAttr::init(access)).expect("init");
        q.modify(&QpAttr::rtr(qps[1 - i].endpoint())).expect("rtr");
        q.modify(&QpAttr::rts()).expect("rts");
    }
    let remote = mrs[1].remote(64);
    let mut wcs = [WorkCompletion::default(); 4];
    let read = || {
        let sge = [mrs[0].sge(0, 8).expect("sge")];
        let wr = SendWr::new(1, &sge, WrOpcode::Read { remote }).with_flags(SendFlags::SIGNALED);
        qps[0].post_send(&[wr]).expect("read");
        let mut done = 0;
        while done < 1 {
            done += cq.poll(&mut wcs).expect("poll");
        }
    };
    counted(iters, "verbs reads", device, read);
}

#[inline(never)]
fn marker_start() {
    std::hint::black_box(());
}

#[inline(never)]
fn marker_end() {
    std::hint::black_box(());
}
