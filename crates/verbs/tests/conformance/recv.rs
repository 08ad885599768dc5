//! The receive side of SEND: a receive too small for the message, and receiver-not-ready (RNR)
//! handling: retried until a receive shows up, or failed once `rnr_retry` is spent.

use std::time::Duration;

use fabriq_verbs::{AccessFlags, Capabilities, QpState, SendWr, WcStatus, WrOpcode};

use crate::harness::{
    expect_wc, fail, pattern, wait_until, ConnectOpts, Env, NodeOpts, TestProvider, TestResult,
};
use crate::peer::{connected, connected_with, PeerSetup, PeerSge};

/// A 256-byte SEND into a receive of exactly 256 bytes succeeds; one into a receive of 255
/// bytes (split over two SGEs) completes with LocalLength, and the sender gets an error
/// completion (not Success, not a mere flush).
pub fn rc_receive_too_small_is_local_length_error<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let rbuf = peer.reg_mr(1024, AccessFlags::LOCAL_WRITE)?;
    let sge = |offset, len| PeerSge {
        mr: rbuf.id,
        offset,
        len,
    };
    peer.post_recv(0, &[sge(512, 256)])?;
    peer.post_recv(1, &[sge(0, 200), sge(256, 55)])?;
    let mr = node.mr(256, AccessFlags::ALL)?;
    mr.write_at(0, &pattern(1, 256))?;
    let s = [mr.sge(0, 256)?];
    node.qp.post_send(&[SendWr::new(9, &s, WrOpcode::Send)])?;
    expect_wc(
        &node.cq.wait(1)?[0],
        9,
        WcStatus::Success,
        "SEND into an exact-size receive",
    )?;
    let exact = peer.poll(1)?[0];
    if exact.wr_id != 0 || exact.status != WcStatus::Success || exact.byte_len != 256 {
        return Err(fail(format!(
            "a receive of exactly the message size: expected Success, 256 bytes, got {exact:?}"
        )));
    }
    node.qp.post_send(&[SendWr::new(2, &s, WrOpcode::Send)])?;
    let r = peer.poll(1)?[0];
    // rxe reports a too-long message at the receiver as a local QP operation error.
    if r.wr_id != 1 || !matches!(r.status, WcStatus::LocalLength | WcStatus::LocalQpOperation) {
        return Err(fail(format!(
            "too-small receive: expected LocalLength, got {r:?}"
        )));
    }
    let wc = node.cq.wait(1)?[0];
    if wc.wr_id != 2 || wc.status == WcStatus::Success || wc.status == WcStatus::WrFlushed {
        return Err(fail(format!(
            "sender of a message too large for the receive: expected an error completion \
             (e.g. RemoteInvalidRequest), got {wc:?}"
        )));
    }
    Ok(())
}

/// A SEND to a peer with no receive posted does not complete while none is there (RNR retried,
/// rnr_retry = 7 = forever), and succeeds with the data intact once a receive is posted.
pub fn rc_send_waits_for_late_receive_within_rnr_retry<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    let opts = ConnectOpts {
        rnr_retry: 7,
        min_rnr_timer: 1,
        ..ConnectOpts::default()
    };
    let (node, mut peer) = connected_with(
        env,
        &NodeOpts::default(),
        PeerSetup::default(),
        &opts,
        &opts,
    )?;
    let rbuf = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE)?;
    let mr = node.mr(4096, AccessFlags::ALL)?;
    mr.write_at(0, &pattern(2, 3000))?;
    let s = [mr.sge(0, 3000)?];
    node.qp.post_send(&[SendWr::new(5, &s, WrOpcode::Send)])?;
    // The SEND cannot complete while the peer has no receive: give it time to be refused (RNR)
    // a few times. Whatever the timing, any completion here is wrong.
    let early = node.cq.wait_for(1, Duration::from_millis(300));
    if let Ok(wcs) = early {
        return Err(fail(format!(
            "SEND completed before any receive was posted: {wcs:?}"
        )));
    }
    peer.post_recv(
        6,
        &[PeerSge {
            mr: rbuf.id,
            offset: 0,
            len: 4096,
        }],
    )?;
    expect_wc(
        &node.cq.wait(1)?[0],
        5,
        WcStatus::Success,
        "SEND retried after RNR",
    )?;
    let r = peer.poll(1)?[0];
    if r.wr_id != 6 || r.status != WcStatus::Success || r.byte_len != 3000 {
        return Err(fail(format!(
            "late receive: expected Success with 3000 bytes, got {r:?}"
        )));
    }
    if peer.read(&rbuf, 0, 3000)? != pattern(2, 3000) {
        return Err(fail("payload of the RNR-retried SEND differs"));
    }
    Ok(())
}

/// With rnr_retry 0 and 2 and no receive ever posted, the SEND completes with
/// RnrRetryExceeded and the QP enters ERROR.
pub fn rc_send_without_receive_exhausts_rnr_retry<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    for rnr_retry in [0u8, 2] {
        let opts = ConnectOpts {
            rnr_retry,
            min_rnr_timer: 1,
            ..ConnectOpts::default()
        };
        let (node, peer) = connected_with(
            env,
            &NodeOpts::default(),
            PeerSetup::default(),
            &opts,
            &opts,
        )?;
        let mr = node.mr(64, AccessFlags::ALL)?;
        let s = [mr.sge(0, 64)?];
        node.qp.post_send(&[SendWr::new(9, &s, WrOpcode::Send)])?;
        let wc = node.cq.wait(1)?[0];
        expect_wc(
            &wc,
            9,
            WcStatus::RnrRetryExceeded,
            &format!("SEND with rnr_retry {rnr_retry} and no receive"),
        )?;
        wait_until("the QP enters ERROR after RnrRetryExceeded", || {
            node.qp.state() == QpState::Error
        })?;
        drop(peer);
    }
    Ok(())
}

/// The peer streams 2000 SENDs of 1..4096 bytes (32 in flight) into 8 receives that this
/// process reposts only after checking each message: the sender keeps hitting RNR and
/// retrying, and every message arrives once, in order, intact.
pub fn rc_send_stream_with_reposted_receives_is_intact<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    use crate::peer::{stream_message, Reply, Request, STREAM_MAX};
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    const COUNT: u32 = 2000;
    const SLOTS: usize = 8;
    let opts = ConnectOpts {
        rnr_retry: 7,
        min_rnr_timer: 1,
        ..ConnectOpts::default()
    };
    let (node, mut peer) = connected_with(
        env,
        &NodeOpts::default(),
        PeerSetup::default(),
        &opts,
        &opts,
    )?;
    let mr = node.mr(SLOTS * STREAM_MAX, AccessFlags::ALL)?;
    let sges: Vec<[fabriq_verbs::Sge; 1]> = (0..SLOTS)
        .map(|i| mr.sge(i * STREAM_MAX, STREAM_MAX as u32).map(|s| [s]))
        .collect::<Result<_, _>>()?;
    for (i, s) in sges.iter().enumerate() {
        node.qp
            .post_recv(&[fabriq_verbs::RecvWr::new(i as u64, s)])?;
    }
    peer.send(&Request::SendStream {
        count: COUNT,
        window: 32,
    })?;
    for i in 0..COUNT {
        let wc = node.cq.wait(1)?[0];
        let slot = i as usize % SLOTS;
        let want = stream_message(i);
        if wc.wr_id != slot as u64
            || wc.status != WcStatus::Success
            || wc.byte_len as usize != want.len()
        {
            return Err(fail(format!(
                "message {i}: expected receive {slot} with {} bytes, got {wc:?}",
                want.len()
            )));
        }
        if crate::harness::read_mr(&mr, slot * STREAM_MAX, want.len())? != want {
            return Err(fail(format!("message {i} arrived with the wrong bytes")));
        }
        node.qp
            .post_recv(&[fabriq_verbs::RecvWr::new(slot as u64, &sges[slot])])?;
    }
    match peer.reply()? {
        Reply::Ok => Ok(()),
        other => Err(fail(format!("stream sender: {other:?}"))),
    }
}

/// WRITE_WITH_IMM needs a receive like SEND: with none posted it waits (RNR, retried forever),
/// writes nothing visible as complete, and succeeds once a receive is posted.
pub fn rc_write_with_imm_waits_for_a_receive<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE_IMM) {
        return Ok(());
    }
    let opts = ConnectOpts {
        rnr_retry: 7,
        min_rnr_timer: 1,
        ..ConnectOpts::default()
    };
    let (node, mut peer) = connected_with(
        env,
        &NodeOpts::default(),
        PeerSetup::default(),
        &opts,
        &opts,
    )?;
    let rmr = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let mr = node.mr(4096, AccessFlags::ALL)?;
    mr.write_at(0, &pattern(3, 256))?;
    let s = [mr.sge(0, 256)?];
    node.qp.post_send(&[SendWr::new(
        1,
        &s,
        WrOpcode::WriteWithImm {
            remote: rmr.at(0),
            imm: 5,
        },
    )])?;
    if let Ok(early) = node.cq.wait_for(1, Duration::from_millis(200)) {
        return Err(fail(format!(
            "WRITE_WITH_IMM completed before any receive was posted: {early:?}"
        )));
    }
    peer.post_recv(9, &[])?;
    expect_wc(
        &node.cq.wait(1)?[0],
        1,
        WcStatus::Success,
        "WRITE_WITH_IMM after RNR",
    )?;
    let r = peer.poll(1)?[0];
    if r.wr_id != 9 || r.imm_data != Some(5) || r.byte_len != 256 {
        return Err(fail(format!("late receive of WRITE_WITH_IMM: {r:?}")));
    }
    if peer.read(&rmr, 0, 256)? != pattern(3, 256) {
        return Err(fail("WRITE_WITH_IMM data missing after the RNR wait"));
    }
    Ok(())
}
