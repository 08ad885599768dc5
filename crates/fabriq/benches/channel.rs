//! The software cost of the channel's eager path, without the cross-core effects a two-process
//! ping-pong measures: two caller-progress endpoints in **one thread** exchange an 8-byte
//! message and its echo (A sends, B receives and sends back, A receives), so every cache line
//! stays on one core and each iteration is four channel operations plus two deliveries of the
//! provider. Beside it, the same exchange at the verbs level (two QPs of one shm context, one
//! thread, SEND into pre-posted receives, signaled): the difference is what the middleware adds
//! per message (credits, sequence numbers and acks, streams, pooled buffers, the worker pass).
//!
//! Devices: `FABRIQ_BENCH_DEVICES` (comma-separated), default `shm0`; one that does not open
//! is skipped. The tcp provider moves bytes on its own progress threads, so on one pinned core
//! its figure measures the scheduler (milliseconds at the verbs level), not the software path.
//!
//! `taskset -c 0 cargo bench -p fabriq --bench channel` (pinned: one core, as the name says).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use fabriq::{Config, Endpoint, Progress};
use fabriq_verbs::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, QpAttr, QpInitAttr, QueuePair, RecvWr,
    SendFlags, SendWr, WorkCompletion, WrOpcode,
};

const TIMEOUT: Duration = Duration::from_secs(10);

fn devices() -> Vec<String> {
    std::env::var("FABRIQ_BENCH_DEVICES")
        .unwrap_or_else(|_| "shm0".into())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn endpoint(device: &str, signal_every: u32) -> Result<Endpoint, String> {
    Endpoint::new(Config {
        device: device.into(),
        workers: 1,
        progress: Progress::Caller,
        signal_every,
        ..Config::default()
    })
    .map_err(|e| e.to_string())
}

fn channel_bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("channel_pingpong_one_thread");
    g.measurement_time(Duration::from_secs(3));
    // The default (one SEND in `signal_every` signaled) and, beside it, a completion for every
    // SEND, as before selective signaling.
    let variants = [
        ("", Config::default().signal_every),
        ("/signal_every_send", 1),
    ];
    for (device, (variant, signal_every)) in devices()
        .into_iter()
        .flat_map(|d| variants.map(|v| (d.clone(), v)))
    {
        let pair = (|| -> Result<_, String> {
            let a = endpoint(&device, signal_every)?;
            let b = endpoint(&device, signal_every)?;
            let listener = b.listen("127.0.0.1:0").map_err(|e| e.to_string())?;
            let ca = a
                .connect(listener.local_addr())
                .map_err(|e| e.to_string())?;
            let cb = listener
                .accept_timeout(TIMEOUT)
                .map_err(|e| e.to_string())?;
            Ok((a, b, listener, ca, cb))
        })();
        let (_a, _b, _listener, ca, cb) = match pair {
            Ok(p) => p,
            Err(e) => {
                eprintln!("channel bench: {device}: skipped: {e}");
                continue;
            }
        };
        let msg = [7u8; 8];
        g.bench_function(format!("{device}/8B{variant}"), |bench| {
            bench.iter(|| {
                ca.send_timeout(&msg, TIMEOUT).expect("send");
                let m = cb.recv_timeout(TIMEOUT).expect("recv");
                cb.send_timeout(&m, TIMEOUT).expect("echo");
                let back = ca.recv_timeout(TIMEOUT).expect("recv echo");
                assert_eq!(back.len(), 8);
            });
        });
    }
    g.finish();
}

/// Two QPs of one context connected to each other, with a registered buffer each.
struct VerbsPair {
    _ctx: Context,
    cq: CompletionQueue,
    qps: [QueuePair; 2],
    mrs: [MemoryRegion; 2],
}

fn verbs_pair(device: &str) -> Result<VerbsPair, String> {
    let e = |e: fabriq_verbs::VerbsError| e.to_string();
    let ctx = Context::open(device).map_err(e)?;
    let pd = ctx.alloc_pd().map_err(e)?;
    let cq = ctx.create_cq(256).map_err(e)?;
    let qa = pd.create_qp(&QpInitAttr::new(&cq)).map_err(e)?;
    let qb = pd.create_qp(&QpInitAttr::new(&cq)).map_err(e)?;
    for (q, peer) in [(&qa, &qb), (&qb, &qa)] {
        q.modify(&QpAttr::init(
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ))
        .map_err(e)?;
        q.modify(&QpAttr::rtr(peer.endpoint())).map_err(e)?;
        q.modify(&QpAttr::rts()).map_err(e)?;
    }
    let ma = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).map_err(e)?;
    let mb = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).map_err(e)?;
    Ok(VerbsPair {
        _ctx: ctx,
        cq,
        qps: [qa, qb],
        mrs: [ma, mb],
    })
}

impl VerbsPair {
    /// SEND 8 bytes from `from` to the other QP (a receive posted first); wait for both
    /// completions.
    fn hop(&self, from: usize) {
        let to = 1 - from;
        let rsge = self.mrs[to].sge(64, 64).expect("sge");
        self.qps[to]
            .post_recv(&[RecvWr::new(2, &[rsge])])
            .expect("post_recv");
        let ssge = self.mrs[from].sge(0, 8).expect("sge");
        self.qps[from]
            .post_send(&[SendWr::new(1, &[ssge], WrOpcode::Send).with_flags(SendFlags::SIGNALED)])
            .expect("post_send");
        let mut got = 0;
        let mut wcs = [WorkCompletion::default(); 4];
        while got < 2 {
            got += self.cq.poll(&mut wcs).expect("poll");
        }
    }
}

fn verbs_bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("verbs_pingpong_one_thread");
    g.measurement_time(Duration::from_secs(3));
    for device in devices() {
        let pair = match verbs_pair(&device) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("verbs bench: {device}: skipped: {e}");
                continue;
            }
        };
        g.bench_function(format!("{device}/8B"), |bench| {
            bench.iter(|| {
                pair.hop(0);
                pair.hop(1);
            });
        });
    }
    g.finish();
}

criterion_group!(benches, channel_bench, verbs_bench);
criterion_main!(benches);
