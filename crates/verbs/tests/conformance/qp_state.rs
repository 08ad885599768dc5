//! The RC state machine: every (from, to) pair is accepted or refused exactly as
//! [`QpState::can_transition_to`] says; posting in a state that does not accept the request is
//! `WrongState`; ERROR flushes every outstanding request and every new one; a full send queue
//! is back-pressure; RESET makes a QP reusable.

use std::rc::Rc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Duration;

use fabriq_verbs::{
    AccessFlags, Capabilities, Context, MemoryRegion, ProtectionDomain, QpAttr, QpCaps, QpEndpoint,
    QpInitAttr, QpState, QueuePair, RecvWr, SendFlags, SendWr, VerbsError, WcOpcode, WcStatus,
    WrOpcode,
};

use crate::harness::{
    connect_pair, drive_to_rtr, drive_to_rts, expect_wc, fail, pattern, pump_all, Backoff,
    ConnectOpts, Env, TestCq, TestProvider, TestResult,
};
use crate::peer::{connected, PeerSetup, PeerSge, Reply, Request};

/// QPs of this process on one context, PD and CQ.
struct Lab {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: Rc<TestCq>,
    mr: MemoryRegion,
}

impl Lab {
    fn new<P: TestProvider>(env: &Env<P>) -> Result<Lab, Box<dyn std::error::Error>> {
        let ctx = env.open()?;
        let pd = ctx.alloc_pd()?;
        let cq = TestCq::new(ctx.create_cq(1024)?, true);
        let mr = pd.alloc_mr(4096, AccessFlags::ALL)?;
        Ok(Lab {
            _ctx: ctx,
            pd,
            cq,
            mr,
        })
    }

    fn qp(&self, caps: QpCaps) -> Result<QueuePair, VerbsError> {
        let mut init = QpInitAttr::new(&self.cq.cq);
        init.caps = caps;
        self.pd.create_qp(&init)
    }

    /// Two QPs connected with unlimited RNR retries (a SEND to `b`, which has no receive
    /// posted, waits in RNR rather than fails), `a` with four 256-byte receives posted (ids
    /// 100 ..= 103, at 1024 in `mr`).
    fn pair_with_four_receives(
        &self,
    ) -> Result<(QueuePair, QueuePair), Box<dyn std::error::Error>> {
        let a = self.qp(QpCaps::default())?;
        let b = self.qp(QpCaps::default())?;
        let forever = ConnectOpts {
            rnr_retry: 7,
            ..ConnectOpts::default()
        };
        connect_pair(&a, &b, &forever, &forever)?;
        self.post_recvs(&a, 4, 256, 100)?;
        Ok((a, b))
    }

    /// Post `n` receives of `len` bytes each on `qp`, back to back in `mr` from offset 1024,
    /// with ids `first_id`, `first_id + 1`, …
    fn post_recvs(
        &self,
        qp: &QueuePair,
        n: usize,
        len: u32,
        first_id: u64,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let r: Vec<[fabriq_verbs::Sge; 1]> = (0..n)
            .map(|i| self.mr.sge(1024 + i * len as usize, len).map(|s| [s]))
            .collect::<Result<_, _>>()?;
        let recvs: Vec<RecvWr<'_>> = r
            .iter()
            .enumerate()
            .map(|(i, s)| RecvWr::new(first_id + i as u64, s))
            .collect();
        qp.post_recv(&recvs)?;
        Ok(())
    }
}

/// Drive `b` to RTS towards `toward` on another thread (a provider may block in RTR until the
/// other side moves).
fn drive_partner(b: &QueuePair, toward: QpEndpoint) -> Receiver<Result<(), String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let b = b.clone();
    std::thread::spawn(move || {
        let _ =
            tx.send(drive_to_rts(&b, &toward, &ConnectOpts::default()).map_err(|e| e.to_string()));
    });
    rx
}

fn join_partner(rx: Receiver<Result<(), String>>) -> TestResult {
    let mut backoff = Backoff::new(crate::harness::TIMEOUT);
    loop {
        match rx.try_recv() {
            Ok(r) => return r.map_err(|e| fail(format!("driving the partner QP: {e}"))),
            Err(TryRecvError::Disconnected) => return Err(fail("partner thread died")),
            Err(TryRecvError::Empty) => {}
        }
        pump_all();
        if !backoff.snooze() {
            return Err(fail("timed out driving the partner QP"));
        }
    }
}

/// A fresh QP in `state`, with the partner it is connected to (kept alive by the caller).
fn fresh_at(
    lab: &Lab,
    state: QpState,
) -> Result<(QueuePair, Option<QueuePair>), Box<dyn std::error::Error>> {
    let a = lab.qp(QpCaps::default())?;
    match state {
        QpState::Reset => Ok((a, None)),
        QpState::Init => {
            a.modify(&QpAttr::init(ConnectOpts::default().access))?;
            Ok((a, None))
        }
        QpState::Rtr => {
            let b = lab.qp(QpCaps::default())?;
            let rx = drive_partner(&b, a.endpoint());
            let r = drive_to_rtr(&a, &b.endpoint(), &ConnectOpts::default());
            join_partner(rx)?;
            r?;
            Ok((a, Some(b)))
        }
        QpState::Rts | QpState::Sqd => {
            let b = lab.qp(QpCaps::default())?;
            connect_pair(&a, &b, &ConnectOpts::default(), &ConnectOpts::default())?;
            if state == QpState::Sqd {
                a.modify(&state_only(QpState::Sqd))?;
            }
            Ok((a, Some(b)))
        }
        QpState::Error => {
            // RESET → ERROR is not a legal transition; go through INIT.
            a.modify(&QpAttr::init(ConnectOpts::default().access))?;
            a.modify(&QpAttr::error())?;
            Ok((a, None))
        }
        QpState::Sqe => Err(fail("SQE cannot be entered by modify")),
    }
}

fn state_only(s: QpState) -> QpAttr {
    QpAttr {
        state: Some(s),
        ..QpAttr::default()
    }
}

/// The attributes of a transition into `to` (a remote is only needed for RTR).
fn attr_for(to: QpState, remote: &QpEndpoint) -> QpAttr {
    match to {
        QpState::Init => QpAttr::init(ConnectOpts::default().access),
        QpState::Rtr => QpAttr::rtr(remote.clone()),
        QpState::Rts => QpAttr::rts(),
        other => state_only(other),
    }
}

const STATES: [QpState; 7] = [
    QpState::Reset,
    QpState::Init,
    QpState::Rtr,
    QpState::Rts,
    QpState::Sqd,
    QpState::Sqe,
    QpState::Error,
];

/// Every (from, to) pair: legal transitions succeed and land in `to`; illegal ones are refused
/// with IllegalTransition and leave the QP where it was. SQE is never entered by modify, so it
/// is only a target. A provider without SQD support may refuse transitions into SQD with
/// Unsupported (reported as a skip).
pub fn qp_state_machine_allows_exactly_the_legal_transitions<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    let lab = Lab::new(env)?;
    let spare = lab.qp(QpCaps::default())?.endpoint();
    let mut problems = Vec::new();
    for from in STATES.into_iter().filter(|s| *s != QpState::Sqe) {
        let (a, _partner) = match fresh_at(&lab, from) {
            Ok(x) => x,
            Err(e) if from == QpState::Sqd && e.to_string().contains("not supported") => {
                env.skip(&format!(
                    "SQD not supported ({e}); pairs from SQD not checked"
                ));
                continue;
            }
            Err(e) => {
                problems.push(format!("cannot bring a QP to {from:?}: {e}"));
                continue;
            }
        };
        for to in STATES.into_iter().filter(|to| !from.can_transition_to(*to)) {
            match a.modify(&attr_for(to, &spare)) {
                Err(VerbsError::IllegalTransition { from: f, to: t }) if f == from && t == to => {}
                other => problems.push(format!(
                    "{from:?} -> {to:?} must be IllegalTransition, got {other:?}"
                )),
            }
            if a.state() != from {
                problems.push(format!(
                    "refused {from:?} -> {to:?} moved the QP to {:?}",
                    a.state()
                ));
            }
        }
        for to in STATES.into_iter().filter(|to| from.can_transition_to(*to)) {
            let (a, _partner) = fresh_at(&lab, from)?;
            // The new partner of an RTR transition lives until the state is checked.
            let mut _rtr_partner = None;
            let result = if to == QpState::Rtr {
                let b = lab.qp(QpCaps::default())?;
                let rx = drive_partner(&b, a.endpoint());
                let r = a.modify(&attr_for(to, &b.endpoint()));
                join_partner(rx)?;
                _rtr_partner = Some(b);
                r
            } else if from == QpState::Sqd {
                // A device drains the send queue asynchronously after RTS -> SQD and refuses to
                // leave SQD while the drain is in progress (rxe: `sq_draining` -> EINVAL, slow
                // under emulation): legal once drained, so give the drain a bounded time.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
                loop {
                    match a.modify(&attr_for(to, &spare)) {
                        Err(VerbsError::InvalidArgument(_))
                            if std::time::Instant::now() < deadline =>
                        {
                            std::thread::sleep(std::time::Duration::from_millis(5));
                        }
                        r => break r,
                    }
                }
            } else {
                a.modify(&attr_for(to, &spare))
            };
            match result {
                Ok(()) if a.state() == to => {}
                Ok(()) => problems.push(format!(
                    "{from:?} -> {to:?} succeeded but the QP is in {:?}",
                    a.state()
                )),
                Err(VerbsError::Unsupported { .. }) if to == QpState::Sqd => {
                    env.skip(&format!("{from:?} -> SQD: Unsupported"));
                }
                Err(e) => problems.push(format!("legal {from:?} -> {to:?} failed: {e}")),
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(fail(format!(
            "state machine violations:\n  {}",
            problems.join("\n  ")
        )))
    }
}

fn expect_wrong_state(
    r: Result<(), fabriq_verbs::PostError>,
    state: QpState,
    what: &str,
) -> TestResult {
    match r {
        Err(e) if e.index == 0 => match e.source {
            VerbsError::WrongState { state: s, .. } if s == state => Ok(()),
            other => Err(fail(format!(
                "post_{what} in {state:?}: expected WrongState, got {other:?}"
            ))),
        },
        other => Err(fail(format!(
            "post_{what} in {state:?}: expected WrongState at index 0, got {other:?}"
        ))),
    }
}

/// RESET refuses sends and receives; INIT and RTR refuse sends and accept receives; all with
/// `WrongState` at index 0.
pub fn qp_posting_in_wrong_state_is_wrong_state_error<P: TestProvider>(env: &Env<P>) -> TestResult {
    let lab = Lab::new(env)?;
    let s = [lab.mr.sge(0, 64)?];
    for state in [QpState::Reset, QpState::Init, QpState::Rtr] {
        let (a, _partner) = fresh_at(&lab, state)?;
        expect_wrong_state(
            a.post_send(&[SendWr::new(1, &s, WrOpcode::Send)]),
            state,
            "send",
        )?;
        let recv = a.post_recv(&[RecvWr::new(2, &s)]);
        if state == QpState::Reset {
            expect_wrong_state(recv, state, "recv")?;
        } else if let Err(e) = recv {
            return Err(fail(format!(
                "post_recv in {state:?} must be accepted: {e}"
            )));
        }
    }
    Ok(())
}

/// With a SEND stuck in RNR at the head of the send queue, three requests behind it (one
/// unsignaled) and four receives posted, moving the QP to ERROR completes every one of them
/// with WrFlushed: sends in post order, receives with opcode Recv.
pub fn qp_error_flushes_outstanding_send_and_recv<P: TestProvider>(env: &Env<P>) -> TestResult {
    let lab = Lab::new(env)?;
    let (a, _b) = lab.pair_with_four_receives()?;
    let s = [lab.mr.sge(0, 64)?];
    let behind = if env.attr.capabilities.contains(Capabilities::WRITE) {
        WrOpcode::Write {
            remote: lab.mr.remote(512),
        }
    } else {
        WrOpcode::Send
    };
    a.post_send(&[
        SendWr::new(1, &s, WrOpcode::Send),
        SendWr::new(2, &s, behind),
        SendWr::new(3, &s, behind).with_flags(SendFlags::empty()),
        SendWr::new(4, &s, WrOpcode::Send),
    ])?;
    if let Ok(early) = lab.cq.wait_for(1, Duration::from_millis(100)) {
        return Err(fail(format!(
            "a request completed while the SEND at the head of the queue had no receive: {early:?}"
        )));
    }
    a.modify(&QpAttr::error())?;
    let wcs = lab.cq.wait(8)?;
    let (sends, recvd): (Vec<&fabriq_verbs::WorkCompletion>, Vec<_>) =
        wcs.iter().partition(|wc| wc.wr_id < 100);
    let send_ids: Vec<u64> = sends.iter().map(|wc| wc.wr_id).collect();
    if send_ids != [1, 2, 3, 4] {
        return Err(fail(format!(
            "flushed sends must complete once each, in post order: {wcs:?}"
        )));
    }
    if let Some(bad) = wcs
        .iter()
        .find(|wc| wc.status != WcStatus::WrFlushed || wc.qp_num != a.qp_num())
    {
        return Err(fail(format!(
            "every outstanding request must complete with WrFlushed: {bad:?}"
        )));
    }
    let mut recv_ids: Vec<u64> = recvd.iter().map(|wc| wc.wr_id).collect();
    recv_ids.sort_unstable();
    if recv_ids != [100, 101, 102, 103] || recvd.iter().any(|wc| wc.opcode != WcOpcode::Recv) {
        return Err(fail(format!(
            "flushed receives must complete once each with opcode Recv: {recvd:?}"
        )));
    }
    if a.state() != QpState::Error {
        return Err(fail(format!("QP is {:?} after modify(ERROR)", a.state())));
    }
    let more = lab.cq.take_ready();
    if !more.is_empty() {
        return Err(fail(format!("extra completions after the flush: {more:?}")));
    }
    Ok(())
}

/// A QP in ERROR accepts sends (signaled or not) and receives, and completes each with
/// WrFlushed.
pub fn qp_posting_in_error_completes_with_wr_flushed<P: TestProvider>(env: &Env<P>) -> TestResult {
    let lab = Lab::new(env)?;
    let (a, _b) = fresh_at(&lab, QpState::Rts)?;
    a.modify(&QpAttr::error())?;
    let s = [lab.mr.sge(0, 64)?];
    a.post_send(&[
        SendWr::new(7, &s, WrOpcode::Send),
        SendWr::new(8, &s, WrOpcode::Send).with_flags(SendFlags::empty()),
    ])?;
    a.post_recv(&[RecvWr::new(9, &s)])?;
    let mut wcs = lab.cq.wait(3)?;
    wcs.sort_by_key(|wc| wc.wr_id);
    for (wc, id) in wcs.iter().zip(7..) {
        expect_wc(wc, id, WcStatus::WrFlushed, "request posted in ERROR")?;
    }
    Ok(())
}

/// A request posted to a QP in ERROR completes after every request posted to its queue before
/// it. With four receives outstanding and three sends waiting behind a SEND in RNR (an
/// unsignaled WRITE that executed ahead of them, where the device has WRITE), a receive and a
/// send posted right after `modify(ERROR)` come back last on their queues, every completion
/// `WrFlushed` with the opcode its request was posted with, and nothing follows them. Draining a
/// QP for reuse relies on this (ERROR, post a marker on each queue, wait for the markers): no
/// completion of the QP's last connection may surface after it was reset and reconnected.
pub fn qp_request_posted_in_error_completes_after_the_ones_before_it<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    let lab = Lab::new(env)?;
    let (a, _b) = lab.pair_with_four_receives()?;
    let s = [lab.mr.sge(0, 64)?];
    let mut sends = Vec::new();
    if env.attr.capabilities.contains(Capabilities::WRITE) {
        let write = WrOpcode::Write {
            remote: lab.mr.remote(512),
        };
        sends.push(SendWr::new(1, &s, write).with_flags(SendFlags::empty()));
    }
    sends.extend([
        SendWr::new(2, &s, WrOpcode::Send),
        SendWr::new(3, &s, WrOpcode::Send).with_flags(SendFlags::empty()),
        SendWr::new(4, &s, WrOpcode::Send),
    ]);
    a.post_send(&sends)?;
    if let Ok(early) = lab.cq.wait_for(1, Duration::from_millis(100)) {
        return Err(fail(format!(
            "a request completed while the SEND at the head of the queue had no receive: {early:?}"
        )));
    }
    a.modify(&QpAttr::error())?;
    a.post_recv(&[RecvWr::new(900, &s)])?;
    a.post_send(&[SendWr::new(901, &s, WrOpcode::Send)])?;
    let must: [u64; 9] = [100, 101, 102, 103, 900, 2, 3, 4, 901];
    let mut wcs: Vec<fabriq_verbs::WorkCompletion> = Vec::new();
    let seen = |wcs: &[fabriq_verbs::WorkCompletion], id: u64| wcs.iter().any(|wc| wc.wr_id == id);
    while !must.iter().all(|&id| seen(&wcs, id)) {
        wcs.extend(lab.cq.wait(1)?);
    }
    // Anything of the QP still to come would come after the markers: give it a moment.
    if let Ok(late) = lab.cq.wait_for(1, Duration::from_millis(100)) {
        wcs.extend(late);
    }
    let at = |id: u64| wcs.iter().position(|wc| wc.wr_id == id);
    let ids: Vec<u64> = wcs.iter().map(|wc| wc.wr_id).collect();
    for (marker, before) in [(900, &[100, 101, 102, 103][..]), (901, &[1, 2, 3, 4][..])] {
        if before.iter().any(|&id| at(id) > at(marker)) {
            return Err(fail(format!(
                "request {marker}, posted in ERROR, completed before an earlier request of its \
                 queue ({before:?}); completions in order: {ids:?}"
            )));
        }
    }
    let posted_as = |id: u64| match id {
        1 => WcOpcode::RdmaWrite,
        2..=4 | 901 => WcOpcode::Send,
        _ => WcOpcode::Recv,
    };
    if let Some(bad) = wcs.iter().find(|wc| {
        wc.status != WcStatus::WrFlushed
            || wc.qp_num != a.qp_num()
            || wc.opcode != posted_as(wc.wr_id)
            || !(must.contains(&wc.wr_id) || wc.wr_id == 1)
    }) {
        return Err(fail(format!(
            "every completion must be one WrFlushed completion of a request of the QP, with its \
             opcode: {bad:?} in {wcs:?}"
        )));
    }
    if ids.len() != must.len() + usize::from(at(1).is_some()) {
        return Err(fail(format!("a request completed twice: {ids:?}")));
    }
    Ok(())
}

/// Every RESET gives the QP a new initial PSN, which its endpoint carries for the next
/// connection (providers with sequence numbers on the wire; shm has none and reports 0): a
/// QP reconnected after RESET, even to the same peer QP, never starts where its last connection
/// did, so a packet of that connection still on its way cannot fall into the new one's window.
/// Traffic over the new PSNs is covered by `qp_reset_and_reconnect_carries_traffic_again`.
pub fn qp_reset_gives_a_new_initial_psn<P: TestProvider>(env: &Env<P>) -> TestResult {
    let lab = Lab::new(env)?;
    let a = lab.qp(QpCaps::default())?;
    let b = lab.qp(QpCaps::default())?;
    let mut psns = vec![a.endpoint().psn];
    for round in 0..4 {
        // From RTS (connected to the same peer QP each time) and from INIT alike.
        if round % 2 == 0 {
            connect_pair(&a, &b, &ConnectOpts::default(), &ConnectOpts::default())?;
        } else {
            a.modify(&QpAttr::init(AccessFlags::ALL))?;
        }
        a.modify(&QpAttr::reset())?;
        if b.state() != QpState::Reset {
            b.modify(&QpAttr::reset())?;
        }
        psns.push(a.endpoint().psn);
    }
    if psns.iter().all(|&p| p == 0) {
        env.skip("the provider has no packet sequence numbers (every endpoint says 0)");
        return Ok(());
    }
    if let Some(w) = psns.windows(2).find(|w| w[0] == w[1]) {
        return Err(fail(format!(
            "the endpoint's PSN did not change at RESET ({:#x} twice): {psns:x?}",
            w[0]
        )));
    }
    if psns.iter().any(|&p| p > 0x00ff_ffff) {
        return Err(fail(format!("a PSN beyond 24 bits: {psns:x?}")));
    }
    Ok(())
}

/// A QP that reaches RTR first and says so ([`QpAttr::before_peer`]), its peer connected to
/// the endpoint read after that RTR, carries SENDs both ways; reset and connected again the same
/// way, the pair does so again (a provider that keeps something of the pair's last connection
/// may take it at these RTRs).
pub fn qp_rtr_before_peer_carries_traffic<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    let lab = Lab::new(env)?;
    let a = lab.qp(QpCaps::default())?;
    let b = lab.qp(QpCaps::default())?;
    let o = ConnectOpts::default();
    for round in 0..3u8 {
        if round > 0 {
            a.modify(&QpAttr::reset())?;
            b.modify(&QpAttr::reset())?;
        }
        a.modify(&QpAttr::init(o.access))?;
        a.modify(&QpAttr::rtr(b.endpoint()).before_peer())?;
        a.modify(&QpAttr::rts())?;
        drive_to_rts(&b, &a.endpoint(), &o)?;
        for (dir, (from, to)) in [(&a, &b), (&b, &a)].into_iter().enumerate() {
            let seed = round * 2 + dir as u8 + 1;
            let id = u64::from(seed);
            let (src, dst) = (256 * dir, 1024 + 256 * dir);
            lab.mr.write_at(src, &pattern(seed, 100))?;
            to.post_recv(&[RecvWr::new(id, &[lab.mr.sge(dst, 100)?])])?;
            from.post_send(&[SendWr::new(id, &[lab.mr.sge(src, 100)?], WrOpcode::Send)])?;
            for wc in lab.cq.wait(2)? {
                expect_wc(
                    &wc,
                    id,
                    WcStatus::Success,
                    &format!("round {round}, SEND {dir}"),
                )?;
            }
            let mut got = vec![0u8; 100];
            lab.mr.read_at(dst, &mut got)?;
            if got != pattern(seed, 100) {
                return Err(fail(format!("round {round}, SEND {dir}: wrong bytes")));
            }
        }
    }
    Ok(())
}

/// Posting more sends than the send queue holds fails with QueueFull at the first request that
/// does not fit; once the queue drains, posting works again.
pub fn qp_full_send_queue_is_back_pressure<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    let lab = Lab::new(env)?;
    let requested = 8u32;
    let a = lab.qp(QpCaps {
        max_send_wr: requested,
        ..QpCaps::default()
    })?;
    let b = lab.qp(QpCaps::default())?;
    let granted = a.query().caps.max_send_wr;
    if granted < requested || granted > 120 {
        return Err(fail(format!(
            "max_send_wr {requested} requested, {granted} granted"
        )));
    }
    let forever = ConnectOpts {
        rnr_retry: 7,
        ..ConnectOpts::default()
    };
    connect_pair(&a, &b, &forever, &forever)?;
    let s = [lab.mr.sge(0, 32)?];
    let wrs: Vec<SendWr<'_>> = (0..=u64::from(granted))
        .map(|i| SendWr::new(i, &s, WrOpcode::Send))
        .collect();
    let posted = match a.post_send(&wrs) {
        Err(e) if matches!(e.source, VerbsError::QueueFull) && e.index >= requested as usize && e.index <= granted as usize => e.index,
        other => {
            return Err(fail(format!(
                "posting {} sends on a queue of {granted}: expected QueueFull at index {granted}, got {other:?}",
                granted + 1
            )))
        }
    };
    lab.post_recvs(&b, posted, 32, 1000)?;
    // Both QPs share the lab CQ: the senders' completions and the receiver's arrive there.
    let wcs = lab.cq.wait(2 * posted)?;
    let sends: Vec<u64> = wcs
        .iter()
        .filter(|w| w.qp_num == a.qp_num())
        .map(|w| w.wr_id)
        .collect();
    if sends.len() != posted || sends.iter().enumerate().any(|(i, &id)| id != i as u64) {
        return Err(fail(format!(
            "queued sends must complete in order after the receives arrived: {wcs:?}"
        )));
    }
    if let Some(bad) = wcs.iter().find(|w| w.status != WcStatus::Success) {
        return Err(fail(format!("completion after back-pressure: {bad:?}")));
    }
    lab.post_recvs(&b, 1, 32, 2000)?;
    a.post_send(&[SendWr::new(500, &s, WrOpcode::Send)])?;
    let wcs = lab.cq.wait(2)?;
    if !wcs
        .iter()
        .any(|w| w.wr_id == 500 && w.status == WcStatus::Success)
    {
        return Err(fail(format!("a send after the queue drained: {wcs:?}")));
    }
    Ok(())
}

/// A connected QP moved to RESET (both sides) and connected again carries traffic again.
pub fn qp_reset_and_reconnect_carries_traffic_again<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SEND) {
        return Ok(());
    }
    let (node, mut peer) = connected(
        env,
        &crate::harness::NodeOpts::default(),
        PeerSetup::default(),
    )?;
    let rbuf = peer.reg_mr(256, AccessFlags::LOCAL_WRITE)?;
    let mr = node.mr(256, AccessFlags::ALL)?;
    for round in 0..2u8 {
        if round > 0 {
            node.qp.modify(&QpAttr::reset())?;
            if node.qp.state() != QpState::Reset {
                return Err(fail(format!(
                    "after modify(RESET) the QP is {:?}",
                    node.qp.state()
                )));
            }
            peer.endpoint = match peer.call(&Request::Reset)? {
                Reply::Endpoint(ep) => ep,
                other => return Err(fail(format!("peer reset: {other:?}"))),
            };
            if peer.state()? != QpState::Reset {
                return Err(fail("the peer QP is not in RESET after modify(RESET)"));
            }
            let o = ConnectOpts::default();
            peer.connect(&node, &o, &o)?;
        }
        peer.post_recv(
            u64::from(round),
            &[PeerSge {
                mr: rbuf.id,
                offset: 0,
                len: 256,
            }],
        )?;
        mr.write_at(0, &pattern(round + 1, 100))?;
        let s = [mr.sge(0, 100)?];
        node.qp
            .post_send(&[SendWr::new(10 + u64::from(round), &s, WrOpcode::Send)])?;
        expect_wc(
            &node.cq.wait(1)?[0],
            10 + u64::from(round),
            WcStatus::Success,
            &format!("SEND in round {round}"),
        )?;
        let r = peer.poll(1)?[0];
        if r.wr_id != u64::from(round)
            || r.status != WcStatus::Success
            || peer.read(&rbuf, 0, 100)? != pattern(round + 1, 100)
        {
            return Err(fail(format!(
                "round {round}: receive {r:?} or its payload is wrong"
            )));
        }
    }
    Ok(())
}

/// RESET empties both work queues: a QP whose send queue is full of unsignaled WRITEs (their
/// slots not yet freed by a signaled completion) and whose receive queue is full takes the
/// whole depth of both again once reset and connected anew, as a cached QP must.
pub fn qp_reset_frees_the_full_depth_of_both_queues<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::WRITE) {
        return Ok(());
    }
    let lab = Lab::new(env)?;
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        ..QpCaps::default()
    };
    let a = lab.qp(caps)?;
    let b = lab.qp(QpCaps::default())?;
    let (sq, rq) = {
        let c = a.query().caps;
        (c.max_send_wr as usize, c.max_recv_wr as usize)
    };
    if !(8..=120).contains(&sq) || !(8..=120).contains(&rq) {
        return Err(fail(format!("queues of 8 requested, {sq} / {rq} granted")));
    }
    let remote = lab.mr.remote(2048);
    let s = [lab.mr.sge(0, 16)?];
    let r: Vec<[fabriq_verbs::Sge; 1]> = (0..rq)
        .map(|i| lab.mr.sge(1024 + (i % 32) * 16, 16).map(|s| [s]))
        .collect::<Result<_, _>>()?;
    let recvs: Vec<RecvWr<'_>> = r
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr::new(100 + i as u64, s))
        .collect();
    let writes = |last_signaled: bool| -> Vec<SendWr<'_>> {
        (0..sq)
            .map(|i| {
                let w = SendWr::new(i as u64, &s, WrOpcode::Write { remote });
                w.with_flags(if last_signaled && i + 1 == sq {
                    SendFlags::SIGNALED
                } else {
                    SendFlags::empty()
                })
            })
            .collect()
    };
    for round in 0..2 {
        if round > 0 {
            for q in [&a, &b] {
                q.modify(&QpAttr::reset())?;
            }
        }
        connect_pair(&a, &b, &ConnectOpts::default(), &ConnectOpts::default())?;
        if let Err(e) = a.post_recv(&recvs) {
            return Err(fail(format!(
                "round {round}: {rq} receives on a reset queue of {rq}: {e:?}"
            )));
        }
        // Round 0 leaves the send queue full of unsignaled WRITEs; round 1 must find it empty.
        if let Err(e) = a.post_send(&writes(round == 1)) {
            return Err(fail(format!(
                "round {round}: {sq} WRITEs on a reset send queue of {sq}: {e:?}"
            )));
        }
        if round == 0 {
            // Let the unsignaled WRITEs execute before the reset (they complete silently).
            std::thread::sleep(Duration::from_millis(50));
            let stray = lab.cq.take_ready();
            if !stray.is_empty() {
                return Err(fail(format!("unsignaled WRITEs completed: {stray:?}")));
            }
        }
    }
    let wcs = lab.cq.wait(1)?;
    expect_wc(
        &wcs[0],
        sq as u64 - 1,
        WcStatus::Success,
        "the signaled WRITE after the reset",
    )
}

/// Posting more receives than the receive queue holds fails with QueueFull at the first one
/// that does not fit.
pub fn qp_full_receive_queue_is_back_pressure<P: TestProvider>(env: &Env<P>) -> TestResult {
    let lab = Lab::new(env)?;
    let a = lab.qp(QpCaps {
        max_recv_wr: 8,
        ..QpCaps::default()
    })?;
    a.modify(&QpAttr::init(ConnectOpts::default().access))?;
    let granted = a.query().caps.max_recv_wr;
    if !(8..=120).contains(&granted) {
        return Err(fail(format!("max_recv_wr 8 requested, {granted} granted")));
    }
    let s: Vec<[fabriq_verbs::Sge; 1]> = (0..=granted as usize)
        .map(|i| lab.mr.sge(i * 16, 16).map(|s| [s]))
        .collect::<Result<_, _>>()?;
    let wrs: Vec<RecvWr<'_>> = s
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr::new(i as u64, s))
        .collect();
    match a.post_recv(&wrs) {
        Err(e) if matches!(e.source, VerbsError::QueueFull) && e.index >= 8 && e.index <= granted as usize => Ok(()),
        other => Err(fail(format!(
            "posting {} receives on a queue of {granted}: expected QueueFull at index {granted}, got {other:?}",
            granted + 1
        ))),
    }
}

/// `query` reports what is in force: RTS, the access flags and timers given at connect time,
/// the connected peer; a later RTS → RTS modify changes the RNR retry count it reports.
pub fn qp_query_reports_the_attributes_in_force<P: TestProvider>(env: &Env<P>) -> TestResult {
    let lab = Lab::new(env)?;
    let a = lab.qp(QpCaps::default())?;
    let b = lab.qp(QpCaps::default())?;
    let oa = ConnectOpts {
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        min_rnr_timer: 5,
        rnr_retry: 6,
        timeout: 13,
        retry_cnt: 4,
    };
    connect_pair(&a, &b, &oa, &ConnectOpts::default())?;
    let q = a.query();
    let want = (
        QpState::Rts,
        oa.access,
        oa.min_rnr_timer,
        oa.rnr_retry,
        oa.timeout,
        oa.retry_cnt,
    );
    let got = (
        q.state,
        q.access,
        q.min_rnr_timer,
        q.rnr_retry,
        q.timeout,
        q.retry_cnt,
    );
    if got != want || q.qp_num != a.qp_num() {
        return Err(fail(format!(
            "query after connect: expected (state, access, min_rnr_timer, rnr_retry, timeout, \
             retry_cnt) = {want:?}, got {got:?}"
        )));
    }
    match &q.remote {
        Some(r) if r.qp_num == b.qp_num() => {}
        other => {
            return Err(fail(format!(
                "query names remote {other:?}, expected QP {:?}",
                b.qp_num()
            )))
        }
    }
    let caps = q.caps;
    let want_caps = QpCaps::default();
    if caps.max_send_wr < want_caps.max_send_wr
        || caps.max_recv_wr < want_caps.max_recv_wr
        || caps.max_send_sge < want_caps.max_send_sge
        || caps.max_recv_sge < want_caps.max_recv_sge
    {
        return Err(fail(format!(
            "granted caps {caps:?} are below the requested {want_caps:?}"
        )));
    }
    // The IB spec sets rnr_retry at RTR -> RTS; RTS -> RTS may refuse to change it (the kernel's
    // ib_modify_qp_is_ok does). Either it is refused and unchanged, or applied and reported.
    match a.modify(&QpAttr {
        state: Some(QpState::Rts),
        rnr_retry: Some(2),
        ..QpAttr::default()
    }) {
        Err(VerbsError::InvalidArgument(_)) => {
            if a.query().rnr_retry != oa.rnr_retry || a.state() != QpState::Rts {
                return Err(fail(format!(
                    "a refused RTS -> RTS modify changed the QP: {:?}",
                    a.query()
                )));
            }
            return Ok(());
        }
        r => r?,
    }
    if a.query().rnr_retry != 2 || a.state() != QpState::Rts {
        return Err(fail(format!(
            "RTS -> RTS with rnr_retry 2: query reports {:?}",
            a.query()
        )));
    }
    Ok(())
}

/// RTR toward an endpoint of another provider is refused with `InvalidArgument` and leaves
/// the QP in INIT, where it connects to its real peer afterwards; an endpoint of this
/// provider passes the check (the QP compares the remote's provider with its own name, which
/// must be the one its endpoints carry).
pub fn qp_rtr_toward_another_providers_endpoint_is_refused<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    let lab = Lab::new(env)?;
    let a = lab.qp(QpCaps::default())?;
    let b = lab.qp(QpCaps::default())?;
    let o = ConnectOpts::default();
    a.modify(&QpAttr::init(o.access))?;
    let mut foreign = b.endpoint();
    foreign.provider = format!("not-{}", foreign.provider);
    match a.modify(&QpAttr::rtr(foreign)) {
        Err(VerbsError::InvalidArgument(_)) => {}
        other => {
            return Err(fail(format!(
                "RTR toward another provider's endpoint: {other:?}"
            )))
        }
    }
    if a.state() != QpState::Init {
        return Err(fail(format!("left in {:?} by a refused RTR", a.state())));
    }
    drive_to_rts(&b, &a.endpoint(), &o)?;
    a.modify(&QpAttr::rtr(b.endpoint()))?;
    a.modify(&QpAttr::rts())?;
    Ok(())
}
