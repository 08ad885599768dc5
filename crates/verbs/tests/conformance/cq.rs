//! Completion queues: overflow is reported, never silent; the event fd wakes a thread sleeping
//! in poll(2) when an armed CQ gets a completion, once per arm.

use std::sync::mpsc;
use std::time::Duration;

use fabriq_verbs::{
    provider::wait_readable, AccessFlags, Capabilities, QpInitAttr, RecvWr, SendWr, VerbsError,
    WcStatus, WorkCompletion, WrOpcode,
};

use crate::harness::{
    connect_pair, expect_wc, fail, Backoff, ConnectOpts, Env, NodeOpts, TestCq, TestProvider,
    TestResult, TIMEOUT,
};
use crate::peer::{connected, PeerSetup};

/// More signaled completions than a small CQ holds, never polled in between: a later poll
/// reports `CqOverflow` (after at most `capacity` completions), instead of delivering them all
/// or losing them silently.
pub fn cq_overflow_is_reported<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE | Capabilities::SEND) {
        return Ok(());
    }
    let ctx = env.open()?;
    let pd = ctx.alloc_pd()?;
    let small = ctx.create_cq(4)?;
    let cap = small.capacity();
    let writes = cap as usize + 4;
    if writes as u32 + 1 > env.attr.max_qp_wr {
        env.skip(&format!(
            "CQ capacity {cap} leaves no room under max_qp_wr {}",
            env.attr.max_qp_wr
        ));
        return Ok(());
    }
    let a_recv_cq = TestCq::new(ctx.create_cq(16)?, true);
    let b_cq = TestCq::new(ctx.create_cq(16)?, true);
    let mut ia = QpInitAttr::new(&small);
    ia.recv_cq = &a_recv_cq.cq;
    ia.caps.max_send_wr = writes as u32 + 1;
    let a = pd.create_qp(&ia)?;
    let b = pd.create_qp(&QpInitAttr::new(&b_cq.cq))?;
    connect_pair(&a, &b, &ConnectOpts::default(), &ConnectOpts::default())?;
    let mr = pd.alloc_mr(8192, AccessFlags::ALL)?;
    let (ra, rb, src) = ([mr.sge(0, 64)?], [mr.sge(64, 64)?], [mr.sge(128, 64)?]);
    a.post_recv(&[RecvWr::new(900, &ra)])?;
    b.post_recv(&[RecvWr::new(901, &rb)])?;
    let mut wrs: Vec<SendWr<'_>> = (0..writes as u64)
        .map(|i| {
            SendWr::new(
                i,
                &src,
                WrOpcode::Write {
                    remote: mr.remote(4096 + i as usize * 8),
                },
            )
        })
        .collect();
    wrs.push(SendWr::new(writes as u64, &src, WrOpcode::Send));
    a.post_send(&wrs)?;
    let mut overflowed = false;
    // Wait until b got the SEND that follows every WRITE, then answer it: when a receives the
    // answer, every WRITE was acknowledged. Meanwhile a's CQ is only driven, never drained.
    let mut backoff = Backoff::new(TIMEOUT);
    let mut answered = false;
    loop {
        match small.poll(&mut []) {
            Err(VerbsError::CqOverflow { .. }) => overflowed = true,
            Err(e) => return Err(fail(format!("poll of the small CQ with no room: {e}"))),
            Ok(_) => {}
        }
        b_cq.pump();
        a_recv_cq.pump();
        if !answered && !b_cq.take_ready().is_empty() {
            b.post_send(&[SendWr::new(77, &rb, WrOpcode::Send)])?;
            answered = true;
        }
        if answered && !a_recv_cq.take_ready().is_empty() {
            break;
        }
        if !backoff.snooze() {
            return Err(fail(
                "the SEND behind the WRITEs never arrived (or was never answered)",
            ));
        }
    }
    if overflowed {
        return Ok(());
    }
    let mut delivered = 0usize;
    let mut buf = [WorkCompletion::EMPTY; 16];
    let mut backoff = Backoff::new(TIMEOUT);
    loop {
        match small.poll(&mut buf) {
            Err(VerbsError::CqOverflow { capacity }) => {
                if capacity != cap {
                    return Err(fail(format!(
                        "CqOverflow names capacity {capacity}, the CQ holds {cap}"
                    )));
                }
                if delivered > cap as usize {
                    return Err(fail(format!(
                        "{delivered} completions delivered before CqOverflow from a CQ of {cap}"
                    )));
                }
                return Ok(());
            }
            Err(e) => {
                return Err(fail(format!(
                    "poll of the overflowed CQ: expected CqOverflow, got {e}"
                )))
            }
            Ok(n) => {
                delivered += n;
                if delivered > writes {
                    return Err(fail(format!(
                        "all {delivered} completions were delivered by a CQ of capacity {cap}: no overflow"
                    )));
                }
            }
        }
        if !backoff.snooze() {
            return Err(fail(format!(
                "neither CqOverflow nor all completions: {delivered} of {} delivered",
                writes + 1
            )));
        }
    }
}

/// A thread sleeping in poll(2) on the event fd of an armed CQ wakes when a completion arrives;
/// ack_events then counts the event and the completion is there to poll.
pub fn cq_event_fd_wakes_a_sleeper_on_completion<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::CQ_EVENTS | Capabilities::WRITE) {
        return Ok(());
    }
    let opts = NodeOpts {
        pumped: false,
        ..NodeOpts::default()
    };
    let (node, mut peer) = connected(env, &opts, PeerSetup::default())?;
    let rmr = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let cq = node.cq.cq.clone();
    let Some(fd) = cq.event_fd() else {
        return Err(fail("CQ_EVENTS is advertised but the CQ has no event fd"));
    };
    cq.req_notify(false)?;
    if wait_readable(fd, Some(Duration::ZERO))? {
        return Err(fail("the event fd is readable before any completion"));
    }
    let (ready_tx, ready_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let sleeper_cq = cq.clone();
    std::thread::spawn(move || {
        let _ = ready_tx.send(());
        let r = match sleeper_cq.event_fd() {
            Some(fd) => wait_readable(fd, Some(TIMEOUT)).map_err(|e| e.to_string()),
            None => Err("no event fd".to_string()),
        };
        let _ = done_tx.send(r);
    });
    ready_rx.recv_timeout(TIMEOUT)?;
    // Let the sleeper reach poll(2); the outcome does not depend on this pause.
    std::thread::sleep(Duration::from_millis(20));
    let mr = node.mr(64, AccessFlags::ALL)?;
    let s = [mr.sge(0, 8)?];
    node.qp
        .post_send(&[SendWr::new(1, &s, WrOpcode::Write { remote: rmr.at(0) })])?;
    match done_rx.recv_timeout(TIMEOUT + Duration::from_secs(5)) {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => {
            return Err(fail(format!(
                "the sleeper was not woken within {TIMEOUT:?}"
            )))
        }
        Ok(Err(e)) => return Err(fail(format!("poll(2) on the event fd failed: {e}"))),
        Err(e) => return Err(fail(format!("the sleeper did not report: {e}"))),
    }
    let events = cq.ack_events()?;
    if events == 0 {
        return Err(fail(
            "ack_events returned 0 after the event fd became readable",
        ));
    }
    expect_wc(
        &node.cq.wait(1)?[0],
        1,
        WcStatus::Success,
        "WRITE that woke the sleeper",
    )?;
    Ok(())
}

/// One arm, one event: after the event is acknowledged, a completion on the unarmed CQ does not
/// make the fd readable; arming again does.
pub fn cq_event_fires_once_per_arm<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::CQ_EVENTS | Capabilities::WRITE) {
        return Ok(());
    }
    let opts = NodeOpts {
        pumped: false,
        ..NodeOpts::default()
    };
    let (node, mut peer) = connected(env, &opts, PeerSetup::default())?;
    let rmr = peer.reg_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let cq = &node.cq.cq;
    let fd = cq
        .event_fd()
        .ok_or_else(|| fail("CQ_EVENTS is advertised but the CQ has no event fd"))?;
    let mr = node.mr(64, AccessFlags::ALL)?;
    let s = [mr.sge(0, 8)?];
    let write = |id: u64| {
        node.qp
            .post_send(&[SendWr::new(id, &s, WrOpcode::Write { remote: rmr.at(0) })])
    };

    cq.req_notify(false)?;
    write(1)?;
    if !wait_readable(fd, Some(TIMEOUT))? {
        return Err(fail("armed CQ: no event for the first completion"));
    }
    if cq.ack_events()? == 0 {
        return Err(fail("ack_events returned 0 after an event"));
    }
    expect_wc(&node.cq.wait(1)?[0], 1, WcStatus::Success, "first WRITE")?;

    write(2)?;
    expect_wc(
        &node.cq.wait(1)?[0],
        2,
        WcStatus::Success,
        "second WRITE (CQ not armed)",
    )?;
    if wait_readable(fd, Some(Duration::from_millis(50)))? {
        return Err(fail(format!(
            "the event fd became readable for a completion on an unarmed CQ (ack_events: {:?})",
            cq.ack_events()
        )));
    }

    cq.req_notify(false)?;
    write(3)?;
    if !wait_readable(fd, Some(TIMEOUT))? {
        return Err(fail("re-armed CQ: no event for the next completion"));
    }
    cq.ack_events()?;
    expect_wc(&node.cq.wait(1)?[0], 3, WcStatus::Success, "third WRITE")?;
    Ok(())
}

/// A CQ armed for solicited completions only stays quiet for an ordinary receive and wakes for
/// a SEND posted with SOLICITED.
pub fn cq_solicited_only_arm_wakes_on_solicited_send<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::CQ_EVENTS | Capabilities::SEND) {
        return Ok(());
    }
    let ctx = env.open()?;
    let pd = ctx.alloc_pd()?;
    let a_cq = TestCq::new(ctx.create_cq(16)?, false);
    let b_cq = TestCq::new(ctx.create_cq(16)?, true);
    let a = pd.create_qp(&QpInitAttr::new(&a_cq.cq))?;
    let b = pd.create_qp(&QpInitAttr::new(&b_cq.cq))?;
    connect_pair(&a, &b, &ConnectOpts::default(), &ConnectOpts::default())?;
    let mr = pd.alloc_mr(4096, AccessFlags::ALL)?;
    let (r1, r2, src) = ([mr.sge(0, 64)?], [mr.sge(64, 64)?], [mr.sge(128, 16)?]);
    a.post_recv(&[RecvWr::new(1, &r1), RecvWr::new(2, &r2)])?;
    let fd = a_cq
        .cq
        .event_fd()
        .ok_or_else(|| fail("CQ_EVENTS is advertised but the CQ has no event fd"))?;

    a_cq.cq.req_notify(true)?;
    b.post_send(&[SendWr::new(10, &src, WrOpcode::Send)])?;
    expect_wc(
        &a_cq.wait(1)?[0],
        1,
        WcStatus::Success,
        "unsolicited receive",
    )?;
    if wait_readable(fd, Some(Duration::from_millis(50)))? {
        return Err(fail(
            "a CQ armed for solicited completions signalled an unsolicited receive",
        ));
    }
    b.post_send(&[SendWr::new(11, &src, WrOpcode::Send)
        .with_flags(fabriq_verbs::SendFlags::SIGNALED | fabriq_verbs::SendFlags::SOLICITED)])?;
    if !wait_readable(fd, Some(TIMEOUT))? {
        return Err(fail(
            "no event for a solicited receive on a solicited-only arm",
        ));
    }
    a_cq.cq.ack_events()?;
    expect_wc(&a_cq.wait(1)?[0], 2, WcStatus::Success, "solicited receive")?;
    Ok(())
}

/// A thread sleeping in poll(2) on the event fd of an armed CQ wakes when a message from the
/// peer process lands in a posted receive (the idle-worker case).
pub fn cq_event_fd_wakes_on_a_message_from_the_peer<P: TestProvider>(env: &Env<P>) -> TestResult {
    use crate::peer::{PeerOp, PeerSge, PeerWr};
    if !env.has(Capabilities::CQ_EVENTS | Capabilities::SEND) {
        return Ok(());
    }
    let opts = NodeOpts {
        pumped: false,
        ..NodeOpts::default()
    };
    let (node, mut peer) = connected(env, &opts, PeerSetup::default())?;
    let mr = node.mr(4096, AccessFlags::ALL)?;
    let r = [mr.sge(0, 256)?];
    node.qp.post_recv(&[RecvWr::new(7, &r)])?;
    let src = peer.reg_mr(256, AccessFlags::LOCAL_WRITE)?;
    let cq = node.cq.cq.clone();
    cq.req_notify(false)?;
    let (ready_tx, ready_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let sleeper_cq = cq.clone();
    std::thread::spawn(move || {
        let _ = ready_tx.send(());
        let r = match sleeper_cq.event_fd() {
            Some(fd) => wait_readable(fd, Some(TIMEOUT)).map_err(|e| e.to_string()),
            None => Err("no event fd".to_string()),
        };
        let _ = done_tx.send(r);
    });
    ready_rx.recv_timeout(TIMEOUT)?;
    // Let the sleeper reach poll(2); the outcome does not depend on this pause.
    std::thread::sleep(Duration::from_millis(20));
    peer.post_send(&[PeerWr {
        wr_id: 1,
        op: PeerOp::Send,
        sges: vec![PeerSge {
            mr: src.id,
            offset: 0,
            len: 100,
        }],
        flags: fabriq_verbs::SendFlags::SIGNALED.bits(),
    }])?;
    match done_rx.recv_timeout(TIMEOUT + Duration::from_secs(5)) {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => {
            return Err(fail(format!(
                "a message from the peer did not wake the sleeper within {TIMEOUT:?}"
            )))
        }
        Ok(Err(e)) => return Err(fail(format!("poll(2) on the event fd failed: {e}"))),
        Err(e) => return Err(fail(format!("the sleeper did not report: {e}"))),
    }
    cq.ack_events()?;
    let wc = node.cq.wait(1)?[0];
    if wc.wr_id != 7 || wc.status != WcStatus::Success || wc.byte_len != 100 {
        return Err(fail(format!("the receive that woke the sleeper: {wc:?}")));
    }
    Ok(())
}
