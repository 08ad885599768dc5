//! Peer failure: when the peer process dies, the local QP enters ERROR and every outstanding
//! request completes (in error) instead of hanging.

use std::time::Duration;

use fabriq_verbs::{AccessFlags, Capabilities, QpState, RecvWr, SendWr, Sge, WcStatus, WrOpcode};

use crate::peer::{connected, Request};

use crate::harness::{
    expect_wc, fail, wait_until, ConnectOpts, Env, NodeOpts, TestProvider, TestResult,
};
use crate::peer::{connected_with, PeerSetup};

/// A SEND is outstanding (the peer has no receive; RNR retried forever) and three receives are
/// posted when the peer process is killed (SIGKILL); a WRITE is posted after the kill. The SEND
/// completes in error (not Success), the WRITE behind it does not succeed, every receive
/// completes with WrFlushed, and the QP ends in ERROR — within the suite's timeout.
pub fn peer_killed_moves_qp_to_error_and_flushes<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    // Short transport timers (~67 ms ACK timeout, 3 retries: ~270 ms to give up on a dead peer);
    // RNR retried forever, so only the peer's death can end the outstanding SEND. The timeout is
    // well above the 100 ms probe below: on a slow (emulated) host soft-RoCE's retransmit timer
    // can expire while RNR NAKs stall the SEND, and each expiry spends one retry.
    let local = ConnectOpts {
        timeout: 14,
        retry_cnt: 3,
        rnr_retry: 7,
        ..ConnectOpts::default()
    };
    let (node, mut peer) = connected_with(
        env,
        &NodeOpts::default(),
        PeerSetup::default(),
        &local,
        &ConnectOpts::default(),
    )?;
    let rmr = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let mr = node.mr(4096, AccessFlags::ALL)?;
    let rs: Vec<[Sge; 1]> = (0..3)
        .map(|i| mr.sge(1024 + i * 256, 256).map(|s| [s]))
        .collect::<Result<_, _>>()?;
    let recvs: Vec<RecvWr<'_>> = rs
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr::new(100 + i as u64, s))
        .collect();
    node.qp.post_recv(&recvs)?;
    let s = [mr.sge(0, 64)?];
    node.qp.post_send(&[SendWr::new(1, &s, WrOpcode::Send)])?;
    if let Ok(early) = node.cq.wait_for(1, Duration::from_millis(100)) {
        return Err(fail(format!(
            "a SEND to a peer without receives completed: {early:?}"
        )));
    }
    peer.kill()?;
    let behind = if env.attr.capabilities.contains(Capabilities::WRITE) {
        WrOpcode::Write { remote: rmr.at(0) }
    } else {
        WrOpcode::Send
    };
    node.qp.post_send(&[SendWr::new(2, &s, behind)])?;
    let wcs = node.cq.wait(5)?;
    let sends: Vec<_> = wcs.iter().filter(|w| w.wr_id < 100).collect();
    let recvd: Vec<_> = wcs.iter().filter(|w| w.wr_id >= 100).collect();
    if sends.len() != 2 || sends[0].wr_id != 1 || sends[1].wr_id != 2 {
        return Err(fail(format!(
            "both sends must complete once, in order: {wcs:?}"
        )));
    }
    if let Some(ok) = sends.iter().find(|w| w.status == WcStatus::Success) {
        return Err(fail(format!(
            "a request to a killed peer completed with Success: {ok:?}"
        )));
    }
    if recvd.len() != 3 || recvd.iter().any(|w| w.status != WcStatus::WrFlushed) {
        return Err(fail(format!(
            "every posted receive must be flushed: {wcs:?}"
        )));
    }
    wait_until("the QP is in ERROR after its peer died", || {
        node.qp.state() == QpState::Error
    })?;
    Ok(())
}

/// After the peer process was killed and reaped, a one-sided WRITE to its (former) region must
/// not report Success: it completes in error and the QP enters ERROR.
pub fn peer_killed_one_sided_write_does_not_succeed<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE) {
        return Ok(());
    }
    let local = ConnectOpts {
        timeout: 12,
        retry_cnt: 3,
        ..ConnectOpts::default()
    };
    let (node, mut peer) = connected_with(
        env,
        &NodeOpts::default(),
        PeerSetup::default(),
        &local,
        &ConnectOpts::default(),
    )?;
    let rmr = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let mr = node.mr(4096, AccessFlags::ALL)?;
    let s = [mr.sge(0, 64)?];
    node.qp
        .post_send(&[SendWr::new(1, &s, WrOpcode::Write { remote: rmr.at(0) })])?;
    expect_wc(
        &node.cq.wait(1)?[0],
        1,
        WcStatus::Success,
        "WRITE while the peer lives",
    )?;
    peer.kill()?;
    node.qp
        .post_send(&[SendWr::new(2, &s, WrOpcode::Write { remote: rmr.at(64) })])?;
    let wc = node.cq.wait(1)?[0];
    if wc.wr_id != 2 || wc.status == WcStatus::Success {
        return Err(fail(format!(
            "a WRITE to a peer that was killed and reaped completed with {wc:?}"
        )));
    }
    wait_until("the QP is in ERROR after its peer died", || {
        node.qp.state() == QpState::Error
    })?;
    Ok(())
}

/// The peer destroys its QP (its process lives on): a SEND and a WRITE to it complete in error
/// (not Success) and the QP enters ERROR, within the suite's timeout.
pub fn peer_destroyed_qp_makes_requests_fail<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND | Capabilities::WRITE) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rmr = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    peer.call_ok(&Request::DestroyQp)?;
    let mr = node.mr(4096, AccessFlags::ALL)?;
    let s = [mr.sge(0, 64)?];
    node.qp.post_send(&[
        SendWr::new(1, &s, WrOpcode::Write { remote: rmr.at(0) }),
        SendWr::new(2, &s, WrOpcode::Send),
    ])?;
    // A hardware RC QP learns of a vanished peer only when its transport retries run out
    // (timeout × retry_cnt, longer on an emulated soft-RoCE): wait generously.
    let wcs = node.cq.wait_for(2, std::time::Duration::from_secs(120))?;
    if wcs.iter().any(|w| w.status == WcStatus::Success) || wcs[0].wr_id != 1 || wcs[1].wr_id != 2 {
        return Err(fail(format!(
            "requests to a destroyed QP must complete in error, in order: {wcs:?}"
        )));
    }
    wait_until("the QP is in ERROR after the peer QP was destroyed", || {
        node.qp.state() == QpState::Error
    })?;
    if peer.read(&rmr, 0, 64)?.iter().any(|&b| b != 0) {
        return Err(fail(
            "a WRITE through a destroyed QP changed the peer's memory",
        ));
    }
    Ok(())
}
