//! Remote access enforcement: a one-sided operation without the region's right, without the
//! QP's right, outside the region's bounds, with a wrong rkey, an rkey of another PD or of a
//! deregistered region completes with `RemoteAccess`, touches neither the target's memory nor
//! the local destination, and moves the requester QP to ERROR. A misaligned atomic is an
//! invalid request.

use fabriq_verbs::{
    AccessFlags, Capabilities, QpState, RemoteAddr, Rkey, SendFlags, SendWr, WcStatus, WrOpcode,
};

use crate::harness::{
    expect_wc, fail, pattern, read_mr, wait_until, ConnectOpts, Env, Node, NodeOpts, TestProvider,
    TestResult,
};
use crate::peer::{connected, connected_with, MrDesc, Peer, PeerSetup, Reply, Request};

const REGION: usize = 4096;
const SENTINEL: u8 = 0xee;

/// Which one-sided operation a case posts.
#[derive(Clone, Copy, Debug)]
enum Op {
    Write,
    Read,
    FetchAdd,
    CmpSwap,
}

impl Op {
    fn caps(self) -> Capabilities {
        match self {
            Op::Write => Capabilities::WRITE,
            Op::Read => Capabilities::READ,
            Op::FetchAdd | Op::CmpSwap => Capabilities::ATOMICS,
        }
    }
}

/// How a denial case is set up, beyond the region's rights.
#[derive(Clone, Copy)]
struct Case {
    /// Rights the peer's QP grants (INIT access flags).
    qp_access: AccessFlags,
    /// Register the target region in a second PD of the peer.
    other_pd: bool,
    /// Post the request unsignaled (an error completes anyway).
    signaled: bool,
    /// Status the request must complete with.
    status: WcStatus,
    /// A second status the verbs specification also allows for this case (devices differ).
    also: Option<WcStatus>,
    /// The provider may instead refuse the request at post time with InvalidArgument (a local
    /// check some devices make, e.g. atomic alignment in rxe).
    post_refusal_ok: bool,
}

impl Default for Case {
    fn default() -> Self {
        Case {
            qp_access: AccessFlags::ALL,
            other_pd: false,
            signaled: true,
            status: WcStatus::RemoteAccess,
            also: None,
            post_refusal_ok: false,
        }
    }
}

/// Set up a peer region with `access` filled with a known pattern, post `op` towards
/// `target(region)`, and check the denial.
fn expect_denied<P: TestProvider>(
    env: &Env<P>,
    op: Op,
    access: AccessFlags,
    len: u32,
    target: impl FnOnce(&MrDesc) -> RemoteAddr,
) -> TestResult {
    expect_denied_case(env, op, access, len, target, Case::default())
}

/// [`expect_denied`] with the set-up of `case`.
fn expect_denied_case<P: TestProvider>(
    env: &Env<P>,
    op: Op,
    access: AccessFlags,
    len: u32,
    target: impl FnOnce(&MrDesc) -> RemoteAddr,
    case: Case,
) -> TestResult {
    if !env.has(op.caps()) {
        return Ok(());
    }
    let remote_opts = ConnectOpts {
        access: case.qp_access,
        ..ConnectOpts::default()
    };
    let (node, mut peer) = connected_with(
        env,
        &NodeOpts::default(),
        PeerSetup::default(),
        &ConnectOpts::default(),
        &remote_opts,
    )?;
    let rmr = if case.other_pd {
        match peer.call(&Request::RegMrOtherPd {
            len: REGION,
            access,
        })? {
            Reply::Mr(d) => d,
            other => return Err(fail(format!("reg_mr in a second PD: {other:?}"))),
        }
    } else {
        peer.reg_mr(REGION, access)?
    };
    let original = pattern(9, rmr.len as usize);
    peer.write(&rmr, 0, &original)?;
    let remote = target(&rmr);
    if post_one(&node, op, remote, len, case)? == Posted::RefusedLocally {
        if peer.read(&rmr, 0, rmr.len as usize)? != original {
            return Err(fail(format!("a refused {op:?} changed the target region")));
        }
        return Ok(());
    }
    expect_denial(&node, op)?;
    if peer.read(&rmr, 0, rmr.len as usize)? != original {
        return Err(fail(format!("a denied {op:?} changed the target region")));
    }
    Ok(())
}

/// How a denied request ended.
#[derive(Debug, PartialEq, Eq)]
enum Posted {
    /// It completed with the expected error status.
    Completed,
    /// The provider refused it at post time (allowed by `Case::post_refusal_ok`).
    RefusedLocally,
}

/// Post `op` (wr_id 1) from a local region filled with source data, destination range at
/// offset 2048 holding a sentinel, and check its completion.
fn post_one(
    node: &Node,
    op: Op,
    remote: RemoteAddr,
    len: u32,
    case: Case,
) -> Result<Posted, Box<dyn std::error::Error>> {
    let mr = node.mr(REGION, AccessFlags::ALL)?;
    mr.write_at(0, &pattern(3, 2048))?;
    mr.write_at(2048, &[SENTINEL; 2048])?;
    let src = [mr.sge(0, len)?];
    let dst = [mr.sge(2048, len)?];
    let wr = match op {
        Op::Write => SendWr::new(1, &src, WrOpcode::Write { remote }),
        Op::Read => SendWr::new(1, &dst, WrOpcode::Read { remote }),
        Op::FetchAdd => SendWr::new(1, &dst, WrOpcode::AtomicFetchAdd { remote, add: 1 }),
        Op::CmpSwap => SendWr::new(
            1,
            &dst,
            WrOpcode::AtomicCmpSwp {
                remote,
                compare: u64::from_ne_bytes(pattern(9, 8).try_into().unwrap_or_default()),
                swap: 0,
            },
        ),
    };
    let flags = if case.signaled {
        SendFlags::SIGNALED
    } else {
        SendFlags::empty()
    };
    match node.qp.post_send(&[wr.with_flags(flags)]) {
        Err(e)
            if case.post_refusal_ok
                && matches!(e.source, fabriq_verbs::VerbsError::InvalidArgument(_)) =>
        {
            return Ok(Posted::RefusedLocally)
        }
        r => r?,
    }
    let wc = node.cq.wait(1)?[0];
    if case.also != Some(wc.status) {
        expect_wc(&wc, 1, case.status, &format!("{op:?} that must be denied"))?;
    }
    if read_mr(&mr, 2048, 2048)?.iter().any(|&b| b != SENTINEL) {
        return Err(fail(format!(
            "a denied {op:?} wrote into the local destination"
        )));
    }
    Ok(Posted::Completed)
}

/// After an error completion the requester QP is in ERROR.
fn expect_denial(node: &Node, op: Op) -> TestResult {
    wait_until(
        &format!("the QP enters ERROR after the denied {op:?}"),
        || node.qp.state() == QpState::Error,
    )
}

fn all_but(flag: AccessFlags) -> AccessFlags {
    AccessFlags::ALL - flag
}

/// WRITE into a region registered without REMOTE_WRITE.
pub fn rc_write_without_remote_write_is_remote_access_error<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    expect_denied(
        env,
        Op::Write,
        all_but(AccessFlags::REMOTE_WRITE),
        256,
        |m| m.at(0),
    )
}

/// READ from a region registered without REMOTE_READ.
pub fn rc_read_without_remote_read_is_remote_access_error<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    expect_denied(env, Op::Read, all_but(AccessFlags::REMOTE_READ), 256, |m| {
        m.at(0)
    })
}

/// FETCH_AND_ADD and CAS on a region registered without REMOTE_ATOMIC.
pub fn rc_atomic_without_remote_atomic_is_remote_access_error<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    expect_denied(
        env,
        Op::FetchAdd,
        all_but(AccessFlags::REMOTE_ATOMIC),
        8,
        |m| m.at(0),
    )?;
    expect_denied(
        env,
        Op::CmpSwap,
        all_but(AccessFlags::REMOTE_ATOMIC),
        8,
        |m| m.at(0),
    )
}

/// WRITE that starts inside the region and runs past its end; nothing of it lands, not even the
/// in-bounds part.
pub fn rc_write_outside_mr_is_remote_access_error<P: TestProvider>(env: &Env<P>) -> TestResult {
    expect_denied(env, Op::Write, AccessFlags::ALL, 200, |m| m.at(m.len - 100))?;
    expect_denied(env, Op::Write, AccessFlags::ALL, 16, |m| RemoteAddr {
        addr: m.addr - 16,
        rkey: m.rkey,
    })
}

/// READ that runs past the end of the region, and one before its start.
pub fn rc_read_outside_mr_is_remote_access_error<P: TestProvider>(env: &Env<P>) -> TestResult {
    expect_denied(env, Op::Read, AccessFlags::ALL, 200, |m| m.at(m.len - 100))?;
    expect_denied(env, Op::Read, AccessFlags::ALL, 16, |m| RemoteAddr {
        addr: m.addr - 16,
        rkey: m.rkey,
    })
}

/// An atomic on the word just past the end of the region.
pub fn rc_atomic_outside_mr_is_remote_access_error<P: TestProvider>(env: &Env<P>) -> TestResult {
    expect_denied(env, Op::FetchAdd, AccessFlags::ALL, 8, |m| m.at(m.len))
}

/// WRITE with an rkey no region has.
pub fn rc_write_with_wrong_rkey_is_remote_access_error<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    expect_denied(env, Op::Write, AccessFlags::ALL, 64, |m| RemoteAddr {
        addr: m.addr,
        rkey: Rkey(m.rkey.0 ^ 0x5a5a_5a5a),
    })
}

/// WRITE with the rkey of a region the peer deregistered. When the provider registers user
/// memory, the memory (kept by the peer) is checked to be unchanged too.
pub fn rc_write_to_deregistered_mr_is_remote_access_error<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    if !env.has(Capabilities::WRITE) {
        return Ok(());
    }
    let (node, mut peer) = connected(env, &NodeOpts::default(), PeerSetup::default())?;
    let user = match peer.reg(REGION, AccessFlags::ALL, true) {
        Ok(d) => Some(d),
        Err(e) => {
            env.skip(&format!(
                "reg_mr of user memory failed ({e}); checking the completion only"
            ));
            None
        }
    };
    let rmr = match user {
        Some(d) => d,
        None => peer.reg_mr(REGION, AccessFlags::ALL)?,
    };
    let original = pattern(9, REGION);
    peer.write(&rmr, 0, &original)?;
    deregister(&mut peer, &rmr)?;
    post_one(&node, Op::Write, rmr.at(0), 256, Case::default())?;
    expect_denial(&node, Op::Write)?;
    if user.is_some() && peer.read(&rmr, 0, REGION)? != original {
        return Err(fail(
            "a WRITE with the rkey of a deregistered region changed its memory",
        ));
    }
    Ok(())
}

fn deregister(peer: &mut Peer, mr: &MrDesc) -> TestResult {
    peer.call_ok(&crate::peer::Request::DeregMr { id: mr.id })
}

/// WRITE and READ through a QP whose peer granted neither REMOTE_WRITE nor REMOTE_READ at INIT,
/// into a region that allows both: the QP's rights are enforced too.
pub fn rc_access_not_granted_by_the_qp_is_remote_access_error<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    // The IB spec lets the responder NAK an operation its QP does not enable as an invalid
    // request (rxe does); RemoteAccess is what most devices report.
    let case = Case {
        qp_access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC,
        also: Some(WcStatus::RemoteInvalidRequest),
        ..Case::default()
    };
    expect_denied_case(env, Op::Write, AccessFlags::ALL, 64, |m| m.at(0), case)?;
    expect_denied_case(env, Op::Read, AccessFlags::ALL, 64, |m| m.at(0), case)
}

/// WRITE with the rkey of a region that belongs to another PD than the target QP's.
pub fn rc_rkey_of_another_pd_is_remote_access_error<P: TestProvider>(env: &Env<P>) -> TestResult {
    let case = Case {
        other_pd: true,
        ..Case::default()
    };
    expect_denied_case(env, Op::Write, AccessFlags::ALL, 64, |m| m.at(0), case)
}

/// An unsignaled request that fails still produces its (error) completion.
pub fn rc_unsignaled_request_that_fails_still_completes<P: TestProvider>(
    env: &Env<P>,
) -> TestResult {
    let case = Case {
        signaled: false,
        ..Case::default()
    };
    let wrong_rkey = |m: &MrDesc| RemoteAddr {
        addr: m.addr,
        rkey: Rkey(m.rkey.0 ^ 0x0f0f_0f0f),
    };
    expect_denied_case(env, Op::Write, AccessFlags::ALL, 64, wrong_rkey, case)
}

/// An atomic on an address that is not 8-byte aligned is an invalid request: it completes with
/// RemoteInvalidRequest and changes nothing.
pub fn rc_misaligned_atomic_is_remote_invalid_request<P: TestProvider>(env: &Env<P>) -> TestResult {
    let case = Case {
        status: WcStatus::RemoteInvalidRequest,
        post_refusal_ok: true,
        ..Case::default()
    };
    expect_denied_case(env, Op::FetchAdd, AccessFlags::ALL, 8, |m| m.at(4), case)
}
