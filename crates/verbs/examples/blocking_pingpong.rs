//! Two threads of one process in an 8-byte SEND ping-pong over a QP pair of one context, each
//! waiting for its receives in `CompletionQueue::poll_blocking` (16 receives posted ahead, one
//! reposted per message): prints the mean one-way time in µs. Run under `taskset -c N` it
//! shows what the blocking poll's spin does where every thread shares one CPU
//! (`docs/arch/soft.md`).
//!
//! `cargo run --release -p fabriq-verbs --example blocking_pingpong -- [DEVICE] [ROUNDS]`;
//! `PP_PROGRESS=busy|thread` sets the tcp provider's progress mode.

use std::time::{Duration, Instant};

use fabriq_verbs::{
    AccessFlags, Context, DeviceConfig, QpAttr, QpInitAttr, RecvWr, SendWr, WcOpcode,
    WorkCompletion, WrOpcode,
};

fn main() {
    let device = std::env::args().nth(1).unwrap_or("shm0".into());
    let rounds: u64 = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let mut cfg = DeviceConfig::default();
    if let Ok(m) = std::env::var("PP_PROGRESS") {
        cfg.options.insert("progress".into(), m);
    }
    let ctx = Context::open_with(&device, &cfg).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cqs = [0, 1].map(|_| ctx.create_cq(64).unwrap());
    let qps = [0, 1].map(|i| pd.create_qp(&QpInitAttr::new(&cqs[i])).unwrap());
    for q in &qps {
        q.modify(&QpAttr::init(AccessFlags::LOCAL_WRITE)).unwrap();
    }
    let (e0, e1) = (qps[0].endpoint(), qps[1].endpoint());
    qps[0].modify(&QpAttr::rtr(e1)).unwrap();
    qps[1].modify(&QpAttr::rtr(e0)).unwrap();
    qps[0].modify(&QpAttr::rts()).unwrap();
    qps[1].modify(&QpAttr::rts()).unwrap();
    // Receives are posted ahead (a ring of them, one reposted per message), as a real
    // receiver does: a single receive posted just before each message would leave the sender
    // without credit until the peer says it reposted, which measures the transport's credit
    // recovery instead of the wait.
    const POSTED: u64 = 16;
    let mrs = [0, 1].map(|_| pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap());
    for (qp, mr) in qps.iter().zip(&mrs) {
        for r in 0..POSTED {
            qp.post_recv(&[RecvWr::new(r, &[mr.sge(64, 64).unwrap()])])
                .unwrap();
        }
    }
    let t = Instant::now();
    std::thread::scope(|s| {
        for side in 0..2 {
            let (cq, qp, mr) = (&cqs[side], &qps[side], &mrs[side]);
            s.spawn(move || {
                let src = [mr.sge(0, 8).unwrap()];
                let mut wcs = [WorkCompletion::default(); 4];
                // RECVs taken and not waited for yet (SEND completions are only drained).
                let mut received = 0u64;
                let mut wait_recv = || {
                    while received == 0 {
                        let n = cq.poll_blocking(&mut wcs, Duration::from_secs(10)).unwrap();
                        assert!(n > 0, "no completion in 10 s");
                        for wc in &wcs[..n] {
                            assert!(wc.status.is_success(), "{:?}", wc.status);
                            received += u64::from(wc.opcode == WcOpcode::Recv);
                        }
                    }
                    received -= 1;
                };
                for r in 0..rounds {
                    if side == 0 {
                        qp.post_send(&[SendWr::new(r, &src, WrOpcode::Send)])
                            .unwrap();
                        wait_recv();
                    } else {
                        wait_recv();
                        qp.post_send(&[SendWr::new(r, &src, WrOpcode::Send)])
                            .unwrap();
                    }
                    qp.post_recv(&[RecvWr::new(POSTED + r, &[mr.sge(64, 64).unwrap()])])
                        .unwrap();
                }
            });
        }
    });
    println!(
        "{:.2}",
        t.elapsed().as_secs_f64() * 1e6 / rounds as f64 / 2.0
    );
}
