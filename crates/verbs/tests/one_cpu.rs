//! A completion queue created on a thread that may run on one CPU says so, and its blocking
//! poll steps aside at every empty poll: a ping-pong between two threads on that one CPU, each
//! waiting in `poll_blocking`, completes on shm0 and on tcp0 in both progress modes. Created
//! where the thread has several CPUs, it does not say so.

use std::time::Duration;

use fabriq_verbs::{
    AccessFlags, Context, DeviceConfig, QpAttr, QpInitAttr, QueuePair, RecvWr, SendWr, WcOpcode,
    WcStatus, WorkCompletion, WrOpcode,
};

const ROUNDS: u64 = 200;
const WAIT: Duration = Duration::from_secs(20);

/// Connect two QPs of one context to each other.
fn pair(a: &QueuePair, b: &QueuePair) {
    for q in [a, b] {
        q.modify(&QpAttr::init(AccessFlags::LOCAL_WRITE))
            .expect("init");
    }
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.modify(&QpAttr::rtr(eb)).expect("rtr a");
    b.modify(&QpAttr::rtr(ea)).expect("rtr b");
    a.modify(&QpAttr::rts()).expect("rts a");
    b.modify(&QpAttr::rts()).expect("rts b");
}

/// `ROUNDS` 8-byte SENDs from `a` to `b` and back, each side on its own thread (both on the
/// calling thread's CPUs), each waiting in `poll_blocking`; returns whether the CQs were
/// created with one CPU.
fn ping_pong(device: &str, progress: Option<&str>) -> bool {
    let mut cfg = DeviceConfig::default();
    if let Some(p) = progress {
        cfg.options.insert("progress".into(), p.into());
    }
    let ctx = Context::open_with(device, &cfg).expect("device");
    let pd = ctx.alloc_pd().expect("pd");
    let cqs = [0, 1].map(|_| ctx.create_cq(64).expect("cq"));
    let qps = [0, 1].map(|i| pd.create_qp(&QpInitAttr::new(&cqs[i])).expect("qp"));
    pair(&qps[0], &qps[1]);
    let one_cpu = cqs.iter().all(|c| c.one_cpu());
    assert_eq!(one_cpu, cqs[0].one_cpu() || cqs[1].one_cpu(), "both alike");
    std::thread::scope(|s| {
        for side in 0..2 {
            let (cq, qp, pd) = (&cqs[side], &qps[side], &pd);
            s.spawn(move || {
                let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).expect("mr");
                let src = [mr.sge(0, 8).expect("sge")];
                let mut wcs = [WorkCompletion::default(); 4];
                // Completions taken but not waited for yet, by kind (SEND, RECV).
                let mut early = [0u32; 2];
                let mut wait = |want: WcOpcode| {
                    let slot = |op: WcOpcode| usize::from(op != WcOpcode::Send);
                    let deadline = std::time::Instant::now() + WAIT;
                    while early[slot(want)] == 0 {
                        assert!(
                            std::time::Instant::now() < deadline,
                            "{device}: no {want:?}"
                        );
                        let n = cq.poll_blocking(&mut wcs, WAIT).expect("poll");
                        for wc in &wcs[..n] {
                            assert_eq!(wc.status, WcStatus::Success, "{device}");
                            early[slot(wc.opcode)] += 1;
                        }
                    }
                    early[slot(want)] -= 1;
                };
                for round in 0..ROUNDS {
                    qp.post_recv(&[RecvWr::new(round, &[mr.sge(64, 64).expect("sge")])])
                        .expect("recv");
                    if side == 0 {
                        qp.post_send(&[SendWr::new(round, &src, WrOpcode::Send)])
                            .expect("send");
                        wait(WcOpcode::Send);
                        wait(WcOpcode::Recv);
                    } else {
                        wait(WcOpcode::Recv);
                        qp.post_send(&[SendWr::new(round, &src, WrOpcode::Send)])
                            .expect("send");
                        wait(WcOpcode::Send);
                    }
                }
            });
        }
    });
    one_cpu
}

#[test]
fn a_cq_created_on_one_cpu_says_so_and_its_blocking_polls_complete() {
    let Some(core) = core_affinity::get_core_ids().and_then(|ids| ids.last().copied()) else {
        println!("SKIP: the CPUs of this process cannot be read");
        return;
    };
    for (device, progress) in [
        ("shm0", None),
        ("tcp0", Some("thread")),
        ("tcp0", Some("busy")),
    ] {
        let one_cpu = std::thread::spawn(move || {
            assert!(core_affinity::set_for_current(core), "pin to {core:?}");
            ping_pong(device, progress)
        })
        .join()
        .expect("pinned thread");
        assert!(one_cpu, "{device}: created on one CPU");
        if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
            assert!(
                !ping_pong(device, progress),
                "{device}: created with several CPUs"
            );
        } else {
            println!("SKIP (part): this process has one CPU; the case of several is not run");
        }
    }
}
