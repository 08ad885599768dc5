//! Load on one QP: many READs outstanding at once (more than `max_rd_atomic`), and several
//! threads posting to one QP while the test thread polls its CQ.

use std::collections::BTreeMap;
use std::sync::Arc;

use fabriq_verbs::{
    AccessFlags, Capabilities, PostError, QpCaps, SendFlags, SendWr, VerbsError, WcStatus, WrOpcode,
};

use crate::harness::{fail, pattern, read_mr, Backoff, Env, NodeOpts, TestProvider, TestResult};
use crate::peer::{connected, PeerSetup};

/// 128 READs of 64 bytes posted in one batch, far more than the 16 READs/atomics a QP may have
/// in flight: the provider queues the rest; all complete, in order, with the right bytes.
pub fn rc_many_outstanding_reads_complete_in_order<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::READ) {
        return Ok(());
    }
    let n = 128usize.min(env.attr.max_qp_wr as usize);
    let caps = QpCaps {
        max_send_wr: n as u32,
        ..QpCaps::default()
    };
    let opts = NodeOpts {
        caps,
        ..NodeOpts::default()
    };
    let (node, mut peer) = connected(env, &opts, PeerSetup::default())?;
    let rmr = peer.reg_mr(n * 64, AccessFlags::REMOTE_READ)?;
    let data = pattern(31, n * 64);
    peer.write(&rmr, 0, &data)?;
    let mr = node.mr(n * 64, AccessFlags::ALL)?;
    // READ i fetches remote chunk i into local chunk n-1-i.
    let sges: Vec<[fabriq_verbs::Sge; 1]> = (0..n)
        .map(|i| mr.sge((n - 1 - i) * 64, 64).map(|s| [s]))
        .collect::<Result<_, _>>()?;
    let wrs: Vec<SendWr<'_>> = sges
        .iter()
        .enumerate()
        .map(|(i, s)| {
            SendWr::new(
                i as u64,
                s,
                WrOpcode::Read {
                    remote: rmr.at(i as u64 * 64),
                },
            )
        })
        .collect();
    node.qp.post_send(&wrs)?;
    let wcs = node.cq.wait(n)?;
    for (i, wc) in wcs.iter().enumerate() {
        if wc.wr_id != i as u64 || wc.status != WcStatus::Success || wc.byte_len != 64 {
            return Err(fail(format!(
                "READ {i} of {n}: expected in-order Success with 64 bytes, got {wc:?}"
            )));
        }
    }
    let got = read_mr(&mr, 0, n * 64)?;
    for i in 0..n {
        if got[(n - 1 - i) * 64..(n - i) * 64] != data[i * 64..(i + 1) * 64] {
            return Err(fail(format!("READ {i} placed the wrong bytes")));
        }
    }
    Ok(())
}

/// Four threads post 500 signaled WRITEs each to one QP (retrying on QueueFull) while the test
/// thread polls the CQ: 2000 completions, each exactly once, each thread's in its post order.
pub fn rc_posting_from_several_threads_is_safe<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE) {
        return Ok(());
    }
    const THREADS: u64 = 4;
    const PER_THREAD: u64 = 500;
    let opts = NodeOpts {
        cq_size: 4096.min(env.attr.max_cqe),
        ..NodeOpts::default()
    };
    let (node, mut peer) = connected(env, &opts, PeerSetup::default())?;
    let rmr = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let mr = Arc::new(node.mr(4096, AccessFlags::ALL)?);
    let mut handles = Vec::new();
    for t in 0..THREADS {
        let qp = node.qp.clone();
        let mr = Arc::clone(&mr);
        handles.push(std::thread::spawn(move || -> Result<(), String> {
            let s = [mr.sge(t as usize * 64, 64).map_err(|e| e.to_string())?];
            for i in 0..PER_THREAD {
                let wr = SendWr::new(
                    t << 32 | i,
                    &s,
                    WrOpcode::Write {
                        remote: rmr.at(t * 64),
                    },
                );
                let mut backoff = Backoff::new(crate::harness::TIMEOUT);
                loop {
                    match qp.post_send(&[wr]) {
                        Ok(()) => break,
                        Err(PostError {
                            source: VerbsError::QueueFull,
                            ..
                        }) => {
                            if !backoff.snooze() {
                                return Err(format!("thread {t}: send queue never drained"));
                            }
                        }
                        Err(e) => return Err(format!("thread {t}: post_send: {e}")),
                    }
                }
            }
            Ok(())
        }));
    }
    let wcs = node.cq.wait((THREADS * PER_THREAD) as usize);
    for h in handles {
        h.join()
            .map_err(|_| fail("a posting thread panicked"))?
            .map_err(fail)?;
    }
    let wcs = wcs?;
    let mut next: BTreeMap<u64, u64> = BTreeMap::new();
    for wc in &wcs {
        let (t, i) = (wc.wr_id >> 32, wc.wr_id & 0xffff_ffff);
        let expect = next.entry(t).or_insert(0);
        if wc.status != WcStatus::Success || t >= THREADS || i != *expect {
            return Err(fail(format!(
                "completion {wc:?}: expected thread {t}'s request {expect}, Success"
            )));
        }
        *expect += 1;
    }
    let stray = node.cq.take_ready();
    if !stray.is_empty() {
        return Err(fail(format!("extra completions: {stray:?}")));
    }
    Ok(())
}

/// Sixteen QP pairs between two contexts of this process, all sharing one receive CQ: every
/// message arrives on the QP it was sent to (completion `qp_num`), with its own payload.
pub fn rc_many_qps_between_two_contexts_stay_separate<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    const PAIRS: usize = 16;
    let (actx, bctx) = (env.open()?, env.open()?);
    let (apd, bpd) = (actx.alloc_pd()?, bctx.alloc_pd()?);
    let acq = crate::harness::TestCq::new(actx.create_cq(256)?, true);
    let bcq = crate::harness::TestCq::new(bctx.create_cq(256)?, true);
    let o = crate::harness::ConnectOpts::default();
    let mut pairs = Vec::new();
    for _ in 0..PAIRS {
        let a = apd.create_qp(&fabriq_verbs::QpInitAttr::new(&acq.cq))?;
        let b = bpd.create_qp(&fabriq_verbs::QpInitAttr::new(&bcq.cq))?;
        crate::harness::connect_pair(&a, &b, &o, &o)?;
        pairs.push((a, b));
    }
    let rmr = bpd.alloc_mr(PAIRS * 128, AccessFlags::LOCAL_WRITE)?;
    let smr = apd.alloc_mr(PAIRS * 128, AccessFlags::ALL)?;
    for (i, (a, b)) in pairs.iter().enumerate() {
        let r = [rmr.sge(i * 128, 128)?];
        b.post_recv(&[fabriq_verbs::RecvWr::new(i as u64, &r)])?;
        smr.write_at(i * 128, &pattern(i as u8, 64 + i))?;
        let s = [smr.sge(i * 128, 64 + i as u32)?];
        a.post_send(&[SendWr::new(i as u64, &s, WrOpcode::Send)])?;
    }
    let sent = acq.wait(PAIRS)?;
    if let Some(bad) = sent.iter().find(|w| w.status != WcStatus::Success) {
        return Err(fail(format!("send completion: {bad:?}")));
    }
    let got = bcq.wait(PAIRS)?;
    for wc in &got {
        let i = wc.wr_id as usize;
        let Some((_, b)) = pairs.get(i) else {
            return Err(fail(format!("unknown receive {wc:?}")));
        };
        if wc.status != WcStatus::Success
            || wc.qp_num != b.qp_num()
            || wc.byte_len as usize != 64 + i
        {
            return Err(fail(format!(
                "message {i} must arrive on QP {:?} with {} bytes: {wc:?}",
                b.qp_num(),
                64 + i
            )));
        }
        if read_mr(&rmr, i * 128, 64 + i)? != pattern(i as u8, 64 + i) {
            return Err(fail(format!("message {i} carries another QP's payload")));
        }
    }
    Ok(())
}

/// Both sides of one connection WRITE 16 MiB to each other at the same time (32 requests of
/// 512 KiB each way, posted in one batch): neither direction stalls the other, and both regions
/// end up holding exactly the other side's bytes.
pub fn rc_bidirectional_bulk_writes_do_not_deadlock<P: TestProvider>(env: &Env<P>) -> TestResult {
    use crate::peer::{fnv1a, PeerOp, PeerSge, PeerWr};
    if !env.has(Capabilities::WRITE) {
        return Ok(());
    }
    const CHUNK: usize = 512 * 1024;
    const CHUNKS: usize = 32;
    const LEN: usize = CHUNK * CHUNKS;
    if (LEN as u64) > env.attr.max_mr_size {
        env.skip(&format!("max_mr_size {} < {LEN}", env.attr.max_mr_size));
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let (peer_src, peer_dst) = (peer.reg_mr(LEN, access)?, peer.reg_mr(LEN, access)?);
    let (src, dst) = (node.mr(LEN, access)?, node.mr(LEN, access)?);
    let ours = pattern(61, LEN);
    src.write_at(0, &ours)?;
    let theirs = pattern(62, LEN);
    peer.call_ok(&crate::peer::Request::FillPattern {
        id: peer_src.id,
        seed: 62,
    })?;
    let last = |i: usize| {
        if i + 1 == CHUNKS {
            SendFlags::SIGNALED
        } else {
            SendFlags::empty()
        }
    };
    let peer_wrs: Vec<PeerWr> = (0..CHUNKS)
        .map(|i| PeerWr {
            wr_id: i as u64,
            op: PeerOp::Write(dst.remote(i * CHUNK)),
            sges: vec![PeerSge {
                mr: peer_src.id,
                offset: i * CHUNK,
                len: CHUNK as u32,
            }],
            flags: last(i).bits(),
        })
        .collect();
    let sges: Vec<[fabriq_verbs::Sge; 1]> = (0..CHUNKS)
        .map(|i| src.sge(i * CHUNK, CHUNK as u32).map(|s| [s]))
        .collect::<Result<_, _>>()?;
    let wrs: Vec<SendWr<'_>> = sges
        .iter()
        .enumerate()
        .map(|(i, s)| {
            SendWr::new(
                i as u64,
                s,
                WrOpcode::Write {
                    remote: peer_dst.at((i * CHUNK) as u64),
                },
            )
            .with_flags(last(i))
        })
        .collect();
    // Both batches are in flight before either side waits.
    peer.send(&crate::peer::Request::PostSend { wrs: peer_wrs })?;
    node.qp.post_send(&wrs)?;
    match peer.reply()? {
        crate::peer::Reply::Ok => {}
        other => return Err(fail(format!("peer post: {other:?}"))),
    }
    let wc = node.cq.wait(1)?[0];
    if wc.wr_id != CHUNKS as u64 - 1 || wc.status != WcStatus::Success {
        return Err(fail(format!("local bulk WRITEs: {wc:?}")));
    }
    let pwc = peer.poll(1)?[0];
    if pwc.wr_id != CHUNKS as u64 - 1 || pwc.status != WcStatus::Success {
        return Err(fail(format!("peer bulk WRITEs: {pwc:?}")));
    }
    if read_mr(&dst, 0, LEN)? != theirs {
        return Err(fail(
            "this process's region differs from what the peer wrote",
        ));
    }
    if peer.digest(&peer_dst, 0, LEN)? != fnv1a(&ours) {
        return Err(fail(
            "the peer's region differs from what this process wrote",
        ));
    }
    Ok(())
}
