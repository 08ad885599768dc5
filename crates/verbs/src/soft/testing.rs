//! Fixtures for the software providers' in-process tests: a context per side, one QP with its
//! PD, CQ and a registered region, connected over loopback, and bounded waits that fail a
//! test instead of hanging it.

use std::time::{Duration, Instant};

use crate::*;

/// How long any wait may take before the test fails (catches hangs only).
pub const WAIT: Duration = Duration::from_secs(20);

/// One end of a test connection.
pub struct Side {
    /// The context (kept open as long as the side).
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub mr: MemoryRegion,
    pub qp: QueuePair,
}

/// Open `device` with these device options.
pub fn open(device: &str, opts: &[(&str, &str)]) -> Context {
    let mut cfg = DeviceConfig::default();
    for (k, v) in opts {
        cfg.options.insert((*k).into(), (*v).into());
    }
    Context::open_with(device, &cfg).unwrap()
}

/// A QP on `ctx` with a CQ of `cqe` entries and a 64 KiB region.
pub fn side(ctx: &Context, cqe: u32, caps: QpCaps, access: AccessFlags) -> Side {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(cqe).unwrap();
    let mr = pd.alloc_mr(1 << 16, access).unwrap();
    let mut init = QpInitAttr::new(&cq);
    init.caps = caps;
    let qp = pd.create_qp(&init).unwrap();
    Side {
        ctx: ctx.clone(),
        pd,
        cq,
        mr,
        qp,
    }
}

/// Take both QPs through INIT and RTR to the state `rts()` names.
pub fn connect_with(a: &Side, b: &Side, rts: impl Fn() -> QpAttr) {
    connect_through(a, b, QpAttr::rtr, rts);
}

/// Connect with the shortest RNR timer and `rnr_retry` RNR retries (7 = infinite).
pub fn connect_with_rnr_retry(a: &Side, b: &Side, rnr_retry: u8) {
    connect_through(
        a,
        b,
        |remote| QpAttr::rtr(remote).with_min_rnr_timer(1),
        || QpAttr::rts().with_rnr_retry(rnr_retry),
    );
}

fn connect_through(
    a: &Side,
    b: &Side,
    rtr: impl Fn(QpEndpoint) -> QpAttr,
    rts: impl Fn() -> QpAttr,
) {
    let (ea, eb) = (a.qp.endpoint(), b.qp.endpoint());
    for (s, remote) in [(a, &eb), (b, &ea)] {
        s.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
        s.qp.modify(&rtr(remote.clone())).unwrap();
        s.qp.modify(&rts()).unwrap();
    }
}

/// `rounds` empty SENDs from `a` to `b`, one at a time: each received and completed before
/// the next.
pub fn empty_sends(a: &Side, b: &Side, rounds: u64) {
    for i in 0..rounds {
        b.qp.post_recv(&[RecvWr::new(i, &[])]).unwrap();
        a.qp.post_send(&[SendWr::new(i, &[], WrOpcode::Send)])
            .unwrap();
        assert_eq!(wait(&b.cq, 1)[0].wr_id, i);
        assert_eq!(wait(&a.cq, 1)[0].wr_id, i);
    }
}

/// 200 empty SENDs from `a` to `b` beside `idle` other QP pairs of the same two contexts
/// make at most one timer round per context (`looks`: the QPs the two contexts' timer rounds
/// looked at so far), however many messages: the progress looks at QP timers only when an
/// announced deadline is due.
pub fn assert_timer_rounds_do_not_follow_messages(
    a: &Side,
    b: &Side,
    idle: usize,
    looks: impl Fn() -> u64,
) {
    let before = looks();
    let rounds = 200u64;
    empty_sends(a, b, rounds);
    let looked = looks() - before;
    assert!(
        looked <= (idle as u64 + 1) * 2,
        "{looked} QP timer looks for {rounds} messages beside {idle} idle QP pairs"
    );
}

/// `n` completions from `cq`, in order.
pub fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    let deadline = Instant::now() + WAIT;
    let mut buf = [WorkCompletion::EMPTY; 16];
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "timed out waiting for {n} completions, got {got:?}"
        );
        let k = cq
            .poll_blocking(&mut buf[..(n - got.len()).min(16)], left)
            .unwrap();
        got.extend_from_slice(&buf[..k]);
    }
    got
}

/// Wait until `qp` is in `state`.
pub fn wait_state(qp: &QueuePair, state: QpState) {
    let deadline = Instant::now() + WAIT;
    while qp.state() != state {
        assert!(Instant::now() < deadline, "QP stuck in {:?}", qp.state());
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A `len`-byte region on each side's PD, the first holding a byte pattern (returned).
pub fn big_regions(a: &Side, b: &Side, len: usize) -> (MemoryRegion, MemoryRegion, Vec<u8>) {
    let big_a = a.pd.alloc_mr(len, AccessFlags::ALL).unwrap();
    let big_b = b.pd.alloc_mr(len, AccessFlags::ALL).unwrap();
    let pattern: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    big_a.write_at(0, &pattern).unwrap();
    (big_a, big_b, pattern)
}

/// Zero `local`, READ all of `remote` into it with request `wr_id` on `a`'s QP, and check that
/// the request succeeded with every byte and that `local` now holds `expect`.
pub fn read_back(a: &Side, local: &MemoryRegion, remote: &MemoryRegion, expect: &[u8], wr_id: u64) {
    let len = expect.len();
    local.write_at(0, &vec![0u8; len]).unwrap();
    let sge = [local.sge(0, len as u32).unwrap()];
    let read = WrOpcode::Read {
        remote: remote.remote(0),
    };
    a.qp.post_send(&[SendWr::new(wr_id, &sge, read)]).unwrap();
    let wc = wait(&a.cq, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (wr_id, WcStatus::Success, len as u32)
    );
    let mut got = vec![0u8; len];
    local.read_at(0, &mut got).unwrap();
    assert!(got == expect, "READ corrupted data");
}

/// The initiating end of a connected pair: its PD, CQ and QP.
pub type Initiator = (ProtectionDomain, CompletionQueue, QueuePair);
/// The target end: its PD and QP.
pub type Target = (ProtectionDomain, QueuePair);

/// Rounds of one 8 MiB READ or WRITE (in turn) by a pair's initiator into memory of its
/// target, overlapped at some point of its copy by the target's owner moving its QP to ERROR
/// and then overwriting that memory, as a pool would when it hands it to something else.
/// Returns the rounds where the access ran on past `modify`: a READ that succeeded with bytes
/// written after it, or a WRITE that landed after it. `pair` makes a fresh connected pair.
pub fn accesses_past_error(
    rounds: u32,
    pair: impl Fn() -> (Initiator, Target),
) -> Vec<(u32, &'static str)> {
    const LEN: usize = 8 << 20;
    let (old, new, written) = (0x11u8, 0x22u8, 0x33u8);
    let mut torn = Vec::new();
    for round in 0..rounds {
        let read = round % 2 == 0;
        let ((a_pd, a_cq, a_qp), (b_pd, b_qp)) = pair();
        let mine = b_pd.alloc_mr(LEN, AccessFlags::ALL).unwrap();
        mine.write_at(0, &vec![old; LEN]).unwrap();
        let theirs = a_pd.alloc_mr(LEN, AccessFlags::ALL).unwrap();
        theirs.write_at(0, &vec![written; LEN]).unwrap();
        let start = std::sync::Barrier::new(2);
        let status = std::thread::scope(|s| {
            let peer = s.spawn(|| {
                let sge = [theirs.sge(0, LEN as u32).unwrap()];
                let remote = mine.remote(0);
                let op = if read {
                    WrOpcode::Read { remote }
                } else {
                    WrOpcode::Write { remote }
                };
                start.wait();
                a_qp.post_send(&[SendWr::new(1, &sge, op)]).unwrap();
                wait(&a_cq, 1)[0].status
            });
            start.wait();
            // Somewhere in the copy (8 MiB take hundreds of microseconds to move).
            std::thread::sleep(Duration::from_micros(u64::from(round / 2) * 40));
            b_qp.modify(&QpAttr::error()).unwrap();
            mine.write_at(0, &vec![new; LEN]).unwrap();
            peer.join().unwrap()
        });
        let mut got = vec![0u8; LEN];
        if read {
            if status == WcStatus::Success {
                theirs.read_at(0, &mut got).unwrap();
                if got.iter().any(|&x| x != old) {
                    torn.push((round, "READ returned bytes written after the QP's ERROR"));
                }
            }
        } else {
            mine.read_at(0, &mut got).unwrap();
            if got.iter().any(|&x| x != new) {
                torn.push((round, "WRITE landed after the QP's ERROR"));
            }
        }
    }
    torn
}
