//! Atomics under contention from two processes: FETCH_AND_ADD totals are exact and every
//! fetched value is unique; a CAS spin lock gives mutual exclusion to a plain counter updated
//! with READ + WRITE.

use std::sync::atomic::Ordering;

use fabriq_verbs::{AccessFlags, Capabilities, QpCaps, QpInitAttr};

use crate::harness::{fail, Env, Node, TestCq, TestProvider, TestResult};
use crate::peer::{from_hex, Peer, PeerSetup, Reply, Request};

/// FETCH_AND_ADD(+1) requests per process (a hard requirement: 100 000).
const FAA_PER_PROCESS: u64 = 100_000;
/// Requests per signaled batch.
const FAA_BATCH: u32 = 64;
/// Lock acquisitions per process.
const LOCK_ITERATIONS: u32 = 500;
/// How long a process may take for its whole loop of atomics: generous, so a slow device (an
/// emulated soft-RoCE, say) is measured by its result and a hang still ends.
const LONG_RUN: std::time::Duration = std::time::Duration::from_secs(300);

/// Two peers of this process's region (QPs on one PD, CQ and context), connected.
fn two_peers<P: TestProvider>(
    env: &Env<P>,
    setup: PeerSetup,
) -> Result<(Node, Node, Vec<Peer>), Box<dyn std::error::Error>> {
    let ctx = env.open()?;
    let pd = ctx.alloc_pd()?;
    let cq = TestCq::new(ctx.create_cq(256)?, true);
    let mk = || -> Result<Node, Box<dyn std::error::Error>> {
        let qp = pd.create_qp(&QpInitAttr::new(&cq.cq))?;
        Ok(Node {
            pd: pd.clone(),
            cq: cq.clone(),
            qp,
        })
    };
    let (n1, n2) = (mk()?, mk()?);
    let mut peers = vec![Peer::spawn(env, setup)?, Peer::spawn(env, setup)?];
    let o = crate::harness::ConnectOpts::default();
    peers[0].connect(&n1, &o, &o)?;
    peers[1].connect(&n2, &o, &o)?;
    Ok((n1, n2, peers))
}

/// Two processes each run 100 000 FETCH_AND_ADD(+1) on one counter of this process: the
/// counter ends at exactly 200 000, and the fetched values are 0..200 000, each exactly once
/// (increasing within each process).
pub fn fetch_and_add_from_two_processes_sums_exactly<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::ATOMICS) {
        return Ok(());
    }
    let setup = PeerSetup {
        caps: QpCaps {
            max_send_wr: 2 * FAA_BATCH,
            ..QpCaps::default()
        },
        ..PeerSetup::default()
    };
    let (n1, _n2, mut peers) = two_peers(env, setup)?;
    let counter = n1.mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC)?;
    let total = 2 * FAA_PER_PROCESS;
    let req = Request::FetchAddLoop {
        remote: counter.remote(64),
        count: FAA_PER_PROCESS,
        batch: FAA_BATCH,
        range: total,
    };
    for p in &mut peers {
        p.send(&req)?;
    }
    let mut seen = vec![0u8; total.div_ceil(8) as usize];
    for (i, p) in peers.iter_mut().enumerate() {
        match p.reply_within(LONG_RUN)? {
            Reply::FetchAdd {
                bitmap,
                duplicates,
                out_of_range,
                non_monotonic,
            } => {
                if duplicates + out_of_range + non_monotonic != 0 {
                    return Err(fail(format!(
                        "process {i}: {duplicates} values fetched twice, {out_of_range} out of \
                         range, {non_monotonic} not increasing"
                    )));
                }
                let bitmap = from_hex(&bitmap)?;
                for (s, b) in seen.iter_mut().zip(&bitmap) {
                    if *s & b != 0 {
                        return Err(fail("both processes fetched the same counter value"));
                    }
                    *s |= b;
                }
            }
            other => return Err(fail(format!("process {i}: unexpected reply {other:?}"))),
        }
    }
    let value = counter.atomic_u64(64)?.load(Ordering::Acquire);
    if value != total {
        return Err(fail(format!(
            "counter is {value} after {total} FETCH_AND_ADD(+1)"
        )));
    }
    let fetched: u64 = seen.iter().map(|b| u64::from(b.count_ones())).sum();
    if fetched != total {
        return Err(fail(format!(
            "{fetched} distinct values fetched, expected {total}"
        )));
    }
    Ok(())
}

/// Two processes take a CAS spin lock (0 = free, owner id when held) 500 times each and, under
/// it, increment a plain counter with READ then WRITE: the counter ends at exactly 1000, and
/// every release finds the lock still held by its owner.
pub fn cas_spin_lock_guards_counter_across_two_processes<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    if !env.has(Capabilities::ATOMICS | Capabilities::READ | Capabilities::WRITE) {
        return Ok(());
    }
    let (n1, _n2, mut peers) = two_peers(env, PeerSetup::default())?;
    let mr = n1.mr(4096, AccessFlags::ALL)?;
    for (i, p) in peers.iter_mut().enumerate() {
        p.send(&Request::CasLockLoop {
            lock: mr.remote(0),
            counter: mr.remote(8),
            iterations: LOCK_ITERATIONS,
            id: i as u64 + 1,
        })?;
    }
    let mut contended = 0;
    for (i, p) in peers.iter_mut().enumerate() {
        match p.reply_within(LONG_RUN)? {
            Reply::CasLock { contended: c } => contended += c,
            other => return Err(fail(format!("process {i}: unexpected reply {other:?}"))),
        }
    }
    let lock = mr.atomic_u64(0)?.load(Ordering::Acquire);
    let count = mr.atomic_u64(8)?.load(Ordering::Acquire);
    if lock != 0 || count != 2 * u64::from(LOCK_ITERATIONS) {
        return Err(fail(format!(
            "after 2 x {LOCK_ITERATIONS} locked increments: counter {count}, lock word {lock} \
             ({contended} contended acquisitions)"
        )));
    }
    Ok(())
}
