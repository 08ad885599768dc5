//! Shared receive queues: two QPs draw their receives from one SRQ.

use fabriq_verbs::{
    AccessFlags, Capabilities, QpInitAttr, RecvWr, SendWr, Sge, SrqInitAttr, WcOpcode, WcStatus,
    WrOpcode,
};

use crate::harness::{
    connect_pair, fail, pattern, read_mr, ConnectOpts, Env, TestCq, TestProvider, TestResult,
};

/// Two QPs on one SRQ, each connected to its own sender: four messages (two per sender) consume
/// the four SRQ receives exactly once each, every completion names the QP it arrived on, each
/// sender's messages arrive in order, and the SRQ ends empty. A fifth message waits (RNR) until
/// one more receive is posted to the SRQ.
pub fn srq_is_shared_by_two_qps<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SRQ | Capabilities::SEND) {
        return Ok(());
    }
    let ctx = env.open()?;
    let pd = ctx.alloc_pd()?;
    let cq = TestCq::new(ctx.create_cq(64)?, true);
    let srq = pd.create_srq(&SrqInitAttr {
        max_wr: 16,
        max_sge: 1,
        srq_limit: 0,
    })?;
    let mut init = QpInitAttr::new(&cq.cq);
    init.srq = Some(&srq);
    let (a1, a2) = (pd.create_qp(&init)?, pd.create_qp(&init)?);

    let sctx = env.open()?;
    let spd = sctx.alloc_pd()?;
    let scq = TestCq::new(sctx.create_cq(64)?, true);
    let (b1, b2) = (
        spd.create_qp(&QpInitAttr::new(&scq.cq))?,
        spd.create_qp(&QpInitAttr::new(&scq.cq))?,
    );
    let o = ConnectOpts {
        rnr_retry: 7,
        ..ConnectOpts::default()
    };
    connect_pair(&a1, &b1, &o, &o)?;
    connect_pair(&a2, &b2, &o, &o)?;

    let rmr = pd.alloc_mr(8 * 256, AccessFlags::LOCAL_WRITE)?;
    let rs: Vec<[Sge; 1]> = (0..5)
        .map(|i| rmr.sge(i * 256, 256).map(|s| [s]))
        .collect::<Result<_, _>>()?;
    let recvs: Vec<RecvWr<'_>> = rs[..4]
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr::new(100 + i as u64, s))
        .collect();
    srq.post_recv(&recvs)?;
    if srq.outstanding() != 4 {
        return Err(fail(format!(
            "SRQ reports {} outstanding receives after posting 4",
            srq.outstanding()
        )));
    }

    let smr = spd.alloc_mr(4096, AccessFlags::ALL)?;
    // Message k (0..5) is 100 + k bytes of pattern k+1 at offset k * 512.
    for k in 0..5u8 {
        smr.write_at(usize::from(k) * 512, &pattern(k + 1, 100 + usize::from(k)))?;
    }
    let ss: Vec<[Sge; 1]> = (0..5usize)
        .map(|k| smr.sge(k * 512, 100 + k as u32).map(|s| [s]))
        .collect::<Result<_, _>>()?;
    b1.post_send(&[
        SendWr::new(0, &ss[0], WrOpcode::Send),
        SendWr::new(2, &ss[2], WrOpcode::Send),
    ])?;
    b2.post_send(&[
        SendWr::new(1, &ss[1], WrOpcode::Send),
        SendWr::new(3, &ss[3], WrOpcode::Send),
    ])?;
    let wcs = cq.wait(4)?;
    let senders = scq.wait(4)?;
    if let Some(bad) = senders.iter().find(|w| w.status != WcStatus::Success) {
        return Err(fail(format!("sender completion: {bad:?}")));
    }
    let mut used: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
    used.sort_unstable();
    if used != [100, 101, 102, 103] {
        return Err(fail(format!(
            "SRQ receives must be consumed exactly once each: {wcs:?}"
        )));
    }
    for (qp, msgs) in [(a1.qp_num(), [0usize, 2]), (a2.qp_num(), [1, 3])] {
        let got: Vec<_> = wcs.iter().filter(|w| w.qp_num == qp).collect();
        if got.len() != 2 {
            return Err(fail(format!(
                "QP {qp:?} should have received 2 messages: {wcs:?}"
            )));
        }
        for (wc, k) in got.iter().zip(msgs) {
            if wc.status != WcStatus::Success
                || wc.opcode != WcOpcode::Recv
                || wc.byte_len as usize != 100 + k
            {
                return Err(fail(format!("message {k} on {qp:?}: {wc:?}")));
            }
            let slot = (wc.wr_id - 100) as usize * 256;
            if read_mr(&rmr, slot, 100 + k)? != pattern(k as u8 + 1, 100 + k) {
                return Err(fail(format!(
                    "message {k} on {qp:?} is not the one its sender sent next"
                )));
            }
        }
    }
    if srq.outstanding() != 0 {
        return Err(fail(format!(
            "SRQ reports {} outstanding after all were consumed",
            srq.outstanding()
        )));
    }

    b2.post_send(&[SendWr::new(4, &ss[4], WrOpcode::Send)])?;
    if let Ok(early) = cq.wait_for(1, std::time::Duration::from_millis(100)) {
        return Err(fail(format!(
            "a message completed with the SRQ empty: {early:?}"
        )));
    }
    srq.post_recv(&[RecvWr::new(104, &rs[4])])?;
    let wc = cq.wait(1)?[0];
    if wc.wr_id != 104
        || wc.status != WcStatus::Success
        || wc.qp_num != a2.qp_num()
        || wc.byte_len != 104
    {
        return Err(fail(format!("late SRQ receive: {wc:?}")));
    }
    if scq.wait(1)?[0].status != WcStatus::Success {
        return Err(fail("the RNR-delayed sender did not complete successfully"));
    }
    Ok(())
}

/// When one QP of an SRQ enters ERROR, the SRQ's receives are not flushed with it: they stay
/// posted and the other QP still consumes them.
pub fn srq_receives_survive_an_error_on_one_qp<P: TestProvider>(env: &Env<P>) -> TestResult {
    if !env.has(Capabilities::SRQ | Capabilities::SEND) {
        return Ok(());
    }
    let ctx = env.open()?;
    let pd = ctx.alloc_pd()?;
    let cq = TestCq::new(ctx.create_cq(64)?, true);
    let srq = pd.create_srq(&SrqInitAttr {
        max_wr: 16,
        max_sge: 1,
        srq_limit: 0,
    })?;
    let mut init = QpInitAttr::new(&cq.cq);
    init.srq = Some(&srq);
    let (a1, a2) = (pd.create_qp(&init)?, pd.create_qp(&init)?);
    let scq = TestCq::new(ctx.create_cq(64)?, true);
    let (b1, b2) = (
        pd.create_qp(&QpInitAttr::new(&scq.cq))?,
        pd.create_qp(&QpInitAttr::new(&scq.cq))?,
    );
    let o = ConnectOpts::default();
    connect_pair(&a1, &b1, &o, &o)?;
    connect_pair(&a2, &b2, &o, &o)?;
    let mr = pd.alloc_mr(4096, AccessFlags::ALL)?;
    let (r1, r2, src) = ([mr.sge(0, 64)?], [mr.sge(64, 64)?], [mr.sge(256, 32)?]);
    srq.post_recv(&[RecvWr::new(1, &r1), RecvWr::new(2, &r2)])?;
    a1.modify(&fabriq_verbs::QpAttr::error())?;
    if let Ok(flushed) = cq.wait_for(1, std::time::Duration::from_millis(100)) {
        return Err(fail(format!(
            "an error on one QP flushed receives of the shared SRQ: {flushed:?}"
        )));
    }
    if srq.outstanding() != 2 {
        return Err(fail(format!(
            "SRQ holds {} receives after one of its QPs failed, expected 2",
            srq.outstanding()
        )));
    }
    b2.post_send(&[SendWr::new(5, &src, WrOpcode::Send)])?;
    let wc = cq.wait(1)?[0];
    if wc.status != WcStatus::Success || wc.qp_num != a2.qp_num() || wc.byte_len != 32 {
        return Err(fail(format!(
            "the healthy QP's receive from the SRQ: {wc:?}"
        )));
    }
    drop(b1);
    Ok(())
}
