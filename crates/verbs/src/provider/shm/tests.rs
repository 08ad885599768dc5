//! In-process scenarios of the `shm` provider through the public verbs API: two contexts
//! (standing in for two processes) or one, every opcode, access errors, RNR, flush, overflow,
//! SRQ, events; plus one test across real processes (the test binary re-executes itself).

use std::time::Duration;

use crate::*;

const WAIT: Duration = Duration::from_secs(10);

struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn side_in(ctx: &Context, caps: QpCaps, cqe: u32) -> Side {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(cqe).unwrap();
    let mut init = QpInitAttr::new(&cq);
    init.caps = caps;
    let qp = pd.create_qp(&init).unwrap();
    Side {
        ctx: ctx.clone(),
        pd,
        cq,
        qp,
    }
}

fn connect(a: &Side, b: &Side, access: AccessFlags) {
    let ea = a.qp.endpoint();
    let eb = b.qp.endpoint();
    a.qp.connect(&eb, access).unwrap();
    b.qp.connect(&ea, access).unwrap();
}

/// Two contexts (as two processes would have), connected, with every remote right.
fn pair() -> (Side, Side) {
    pair_with(QpCaps::default(), 256, AccessFlags::ALL)
}

fn pair_with(caps: QpCaps, cqe: u32, access: AccessFlags) -> (Side, Side) {
    let a = side_in(&Context::open("shm0").unwrap(), caps, cqe);
    let b = side_in(&Context::open("shm0").unwrap(), caps, cqe);
    connect(&a, &b, access);
    (a, b)
}

fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::EMPTY; 1];
    let n = cq.poll_blocking(&mut wc, WAIT).unwrap();
    assert_eq!(n, 1, "no completion within {WAIT:?}");
    wc[0]
}

fn assert_empty(cq: &CompletionQueue) {
    let mut wc = [WorkCompletion::EMPTY; 4];
    assert_eq!(
        cq.poll(&mut wc).unwrap(),
        0,
        "unexpected completion {:?}",
        wc[0]
    );
}

fn mr(pd: &ProtectionDomain, len: usize) -> MemoryRegion {
    pd.alloc_mr(len, AccessFlags::ALL).unwrap()
}

// ---------------------------------------------------------------- device

#[test]
fn device_is_listed_and_advertises_what_works() {
    let devs = devices().unwrap();
    assert!(devs.iter().any(|d| d.name == "shm0" && d.provider == "shm"));
    let ctx = Context::open("shm0").unwrap();
    let attr = ctx.query_device();
    assert!(attr.capabilities.contains(
        Capabilities::SEND
            | Capabilities::SEND_IMM
            | Capabilities::WRITE
            | Capabilities::WRITE_IMM
            | Capabilities::READ
            | Capabilities::ATOMICS
            | Capabilities::SRQ
            | Capabilities::INLINE
            | Capabilities::CQ_EVENTS
    ));
    assert_eq!(attr.atomic_cap, AtomicCap::Global);
    assert_eq!(ctx.query_port(1).unwrap().state, PortState::Active);
    assert!(ctx.query_port(2).is_err());
    assert!(matches!(
        Context::open("shm7"),
        Err(VerbsError::NoDevice(_))
    ));
}

// ---------------------------------------------------------------- MR table

/// The shared-memory segment of `pd`'s context.
fn segment(pd: &ProtectionDomain) -> &std::sync::Arc<super::segment::Segment> {
    &pd.context()
        .ops()
        .as_any()
        .downcast_ref::<super::ShmContext>()
        .unwrap()
        .core
        .shared
        .seg
}

#[test]
fn keys_are_random_and_deregistration_is_immediate() {
    let ctx = Context::open("shm0").unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let a = mr(&pd, 64);
    let b = mr(&pd, 64);
    assert_eq!(a.lkey().0, a.rkey().0);
    assert_ne!(a.rkey(), b.rkey());
    assert_ne!(
        b.rkey().0.wrapping_sub(a.rkey().0),
        1,
        "keys look sequential"
    );
    let old = a.rkey();
    drop(a);
    let c = mr(&pd, 64);
    assert_ne!(c.rkey(), old, "a reused entry gets a new key");
    let seg = segment(&pd);
    assert!(super::mrtable::lookup(seg, old.0).is_none());
    assert!(super::mrtable::lookup(seg, c.rkey().0).is_some());
}

#[test]
fn huge_page_regions_are_advised_where_shared_memory_takes_huge_pages() {
    let ctx = Context::open("shm0").unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let huge = crate::provider::pages::HUGE_PAGE;
    let want = if crate::provider::pages::shmem_transparent_enabled() {
        PageKind::Transparent
    } else {
        PageKind::Base
    };
    let m = mr(&pd, 2 * huge);
    let base = segment(&pd).base() as u64;
    assert_eq!(
        (m.addr() - base) % huge as u64,
        0,
        "heap regions of huge-page multiples start on a huge-page boundary of the segment"
    );
    // The segment itself lies on one where the kernel can back shared memory with huge pages
    // (it aligns such mappings); elsewhere its place is the kernel's choice, and nothing is
    // advised either way.
    if want == PageKind::Transparent {
        assert_eq!(
            m.addr() % huge as u64,
            0,
            "the segment is huge-page aligned"
        );
    }
    assert_eq!(m.pages(), want);
    assert_eq!(mr(&pd, huge + 4096).pages(), PageKind::Base);
    // Caller memory registered in place is the caller's pages.
    let mut own = vec![0u8; 4096];
    // SAFETY: `own` outlives the region.
    let r = unsafe { pd.reg_mr(own.as_mut_ptr(), own.len(), AccessFlags::LOCAL_WRITE) }.unwrap();
    assert_eq!(r.pages(), PageKind::Base);
}

#[test]
fn alloc_mr_is_zeroed_even_when_reused() {
    let ctx = Context::open("shm0").unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let m = mr(&pd, 8192);
    m.write_at(100, &[0xAB; 64]).unwrap();
    drop(m);
    let m = mr(&pd, 8192);
    let mut buf = [1u8; 8192];
    m.read_at(0, &mut buf).unwrap();
    assert!(buf.iter().all(|b| *b == 0));
}

// ---------------------------------------------------------------- one-sided

#[test]
fn write_and_read_move_bytes_one_sided() {
    let (a, b) = pair();
    let src = mr(&a.pd, 4096);
    let dst = mr(&b.pd, 4096);
    src.write_at(0, b"hello, shared memory").unwrap();
    let sge = [src.sge(0, 20).unwrap()];
    a.qp.post_send(&[SendWr::new(
        7,
        &sge,
        WrOpcode::Write {
            remote: dst.remote(100),
        },
    )])
    .unwrap();
    let wc = wait_one(&a.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (7, WcStatus::Success, WcOpcode::RdmaWrite)
    );
    let mut got = [0u8; 20];
    dst.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"hello, shared memory");
    assert_empty(&b.cq);

    let back = [src.sge(1000, 20).unwrap()];
    a.qp.post_send(&[SendWr::new(
        8,
        &back,
        WrOpcode::Read {
            remote: dst.remote(100),
        },
    )])
    .unwrap();
    let wc = wait_one(&a.cq);
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (8, WcStatus::Success, WcOpcode::RdmaRead, 20)
    );
    src.read_at(1000, &mut got).unwrap();
    assert_eq!(&got, b"hello, shared memory");
}

#[test]
fn write_gathers_sge_list_and_reaches_reg_mr_memory() {
    let (a, b) = pair();
    let src = mr(&a.pd, 4096);
    src.write_at(0, b"abc").unwrap();
    src.write_at(2000, b"defg").unwrap();
    let mut target = vec![0u8; 256];
    // SAFETY: `target` outlives the region (dropped at the end of the test, after `dst`).
    let dst = unsafe {
        b.pd.reg_mr(target.as_mut_ptr(), target.len(), AccessFlags::ALL)
    }
    .unwrap();
    let sges = [src.sge(0, 3).unwrap(), src.sge(2000, 4).unwrap()];
    a.qp.post_send(&[SendWr::new(
        1,
        &sges,
        WrOpcode::Write {
            remote: dst.remote(10),
        },
    )])
    .unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    drop(dst);
    assert_eq!(&target[10..17], b"abcdefg");
}

#[test]
fn atomics_are_real_and_return_the_original_value() {
    let (a, b) = pair();
    let res = mr(&a.pd, 64);
    let word = mr(&b.pd, 64);
    word.atomic_u64(8)
        .unwrap()
        .store(5, std::sync::atomic::Ordering::SeqCst);
    let sge = [res.sge(0, 8).unwrap()];
    let post = |id, op| {
        a.qp.post_send(&[SendWr::new(id, &sge, op)]).unwrap();
        let wc = wait_one(&a.cq);
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        res.atomic_u64(0)
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    let remote = word.remote(8);
    assert_eq!(post(1, WrOpcode::AtomicFetchAdd { remote, add: 10 }), 5);
    assert_eq!(
        post(
            2,
            WrOpcode::AtomicCmpSwp {
                remote,
                compare: 1,
                swap: 99
            }
        ),
        15
    );
    assert_eq!(
        post(
            3,
            WrOpcode::AtomicCmpSwp {
                remote,
                compare: 15,
                swap: 99
            }
        ),
        15
    );
    assert_eq!(
        word.atomic_u64(8)
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst),
        99
    );
}

#[test]
fn fetch_add_is_atomic_against_the_owner_cpu_and_other_initiators() {
    let target_ctx = Context::open("shm0").unwrap();
    let t = side_in(&target_ctx, QpCaps::default(), 64);
    let word = mr(&t.pd, 64);
    const N: u64 = 2000;
    let initiators: Vec<_> = (0..2)
        .map(|_| {
            let s = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 256);
            // The target side needs one QP per initiator.
            let tq = t.pd.create_qp(&QpInitAttr::new(&t.cq)).unwrap();
            s.qp.connect(&tq.endpoint(), AccessFlags::ALL).unwrap();
            tq.connect(&s.qp.endpoint(), AccessFlags::ALL).unwrap();
            (s, tq)
        })
        .collect();
    let remote = word.remote(0);
    std::thread::scope(|scope| {
        for (s, _) in &initiators {
            scope.spawn(move || {
                let res = mr(&s.pd, 8);
                let sge = [res.sge(0, 8).unwrap()];
                for i in 0..N {
                    let op = WrOpcode::AtomicFetchAdd { remote, add: 1 };
                    s.qp.post_send(&[SendWr::new(i, &sge, op)]).unwrap();
                    assert_eq!(wait_one(&s.cq).status, WcStatus::Success);
                }
            });
        }
        let w = word.atomic_u64(0).unwrap();
        for _ in 0..N {
            w.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    assert_eq!(
        word.atomic_u64(0)
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst),
        3 * N
    );
}

// ---------------------------------------------------------------- two-sided

/// The look a busy poller takes before polling: false on an empty CQ, true once a completion
/// (from another context, written across the segment) waits, false again once it is polled.
#[test]
fn a_cq_tells_without_polling_whether_a_completion_waits() {
    let (a, b) = pair();
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    assert!(!a.cq.may_have_completions() && !b.cq.may_have_completions());
    b.qp.post_recv(&[RecvWr::new(1, &[dst.sge(0, 64).unwrap()])])
        .unwrap();
    assert!(
        !b.cq.may_have_completions(),
        "a posted receive is no completion"
    );
    let sges = [src.sge(0, 8).unwrap()];
    a.qp.post_send(&[SendWr::new(2, &sges, WrOpcode::Send).with_flags(SendFlags::SIGNALED)])
        .unwrap();
    assert!(b.cq.may_have_completions() && a.cq.may_have_completions());
    let r = wait_one(&b.cq);
    assert_eq!(r.wr_id, 1);
    assert!(!b.cq.may_have_completions());
    assert!(a.cq.may_have_completions());
    wait_one(&a.cq);
    assert!(!a.cq.may_have_completions());
}

#[test]
fn send_recv_scatters_and_reports_imm_len_and_qps() {
    let (a, b) = pair();
    let src = mr(&a.pd, 4096);
    let dst = mr(&b.pd, 4096);
    src.write_at(0, b"0123456789").unwrap();
    let rsges = [dst.sge(0, 4).unwrap(), dst.sge(1000, 64).unwrap()];
    b.qp.post_recv(&[RecvWr::new(55, &rsges)]).unwrap();
    let sges = [src.sge(0, 10).unwrap()];
    a.qp.post_send(&[SendWr::new(9, &sges, WrOpcode::SendWithImm { imm: 0xfeed })])
        .unwrap();
    let s = wait_one(&a.cq);
    assert_eq!(
        (s.wr_id, s.status, s.opcode),
        (9, WcStatus::Success, WcOpcode::Send)
    );
    let r = wait_one(&b.cq);
    assert_eq!(
        (r.wr_id, r.status, r.opcode, r.byte_len),
        (55, WcStatus::Success, WcOpcode::Recv, 10)
    );
    assert_eq!(r.imm_data, Some(0xfeed));
    assert_eq!(r.qp_num, b.qp.qp_num());
    assert_eq!(r.src_qp, a.qp.qp_num());
    let mut head = [0u8; 4];
    let mut tail = [0u8; 6];
    dst.read_at(0, &mut head).unwrap();
    dst.read_at(1000, &mut tail).unwrap();
    assert_eq!((&head, &tail), (b"0123", b"456789"));
}

#[test]
fn write_with_imm_consumes_a_receive() {
    let (a, b) = pair();
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    src.write_at(0, b"xyz").unwrap();
    b.qp.post_recv(&[RecvWr::new(3, &[])]).unwrap();
    let sges = [src.sge(0, 3).unwrap()];
    a.qp.post_send(&[SendWr::new(
        4,
        &sges,
        WrOpcode::WriteWithImm {
            remote: dst.remote(5),
            imm: 77,
        },
    )])
    .unwrap();
    assert_eq!(wait_one(&a.cq).opcode, WcOpcode::RdmaWrite);
    let r = wait_one(&b.cq);
    assert_eq!(
        (r.wr_id, r.opcode, r.imm_data, r.byte_len),
        (3, WcOpcode::RecvRdmaWithImm, Some(77), 3)
    );
    let mut got = [0u8; 3];
    dst.read_at(5, &mut got).unwrap();
    assert_eq!(&got, b"xyz");
}

#[test]
fn inline_send_copies_at_post_time_from_unregistered_memory() {
    let (a, b) = pair();
    let dst = mr(&b.pd, 64);
    b.qp.post_recv(&[RecvWr::new(1, &[dst.full_sge()])])
        .unwrap();
    let mut stack = *b"inline!";
    let sge = [Sge {
        addr: stack.as_ptr() as u64,
        length: 7,
        lkey: Lkey(0),
    }];
    a.qp.post_send(&[
        SendWr::new(2, &sge, WrOpcode::Send).with_flags(SendFlags::SIGNALED | SendFlags::INLINE)
    ])
    .unwrap();
    stack.fill(0);
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    assert_eq!(wait_one(&b.cq).byte_len, 7);
    let mut got = [0u8; 7];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"inline!");
    // Above max_inline_data: refused at post time.
    let big = [0u8; 300];
    let sge = [Sge {
        addr: big.as_ptr() as u64,
        length: 300,
        lkey: Lkey(0),
    }];
    let err =
        a.qp.post_send(&[SendWr::new(3, &sge, WrOpcode::Send).with_flags(SendFlags::INLINE)]);
    assert!(matches!(
        err,
        Err(PostError {
            index: 0,
            source: VerbsError::LimitExceeded(_)
        })
    ));
}

#[test]
fn write_then_send_is_visible_when_the_send_completes() {
    let (a, b) = pair();
    let src = mr(&a.pd, 1 << 16);
    let dst = mr(&b.pd, 1 << 16);
    let msg = mr(&b.pd, 64);
    for round in 0..20u8 {
        src.write_at(0, &[round; 1 << 16]).unwrap();
        b.qp.post_recv(&[RecvWr::new(round as u64, &[msg.full_sge()])])
            .unwrap();
        let w = [src.sge(0, 1 << 16).unwrap()];
        let s = [src.sge(0, 1).unwrap()];
        a.qp.post_send(&[
            SendWr::new(
                0,
                &w,
                WrOpcode::Write {
                    remote: dst.remote(0),
                },
            )
            .with_flags(SendFlags::empty()),
            SendWr::new(1, &s, WrOpcode::Send),
        ])
        .unwrap();
        assert_eq!(wait_one(&b.cq).status, WcStatus::Success);
        let mut got = vec![0u8; 1 << 16];
        dst.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|v| *v == round));
        assert_eq!(
            wait_one(&a.cq).wr_id,
            1,
            "only the signaled request completes"
        );
    }
}

#[test]
fn two_qps_of_one_context_talk() {
    let ctx = Context::open("shm0").unwrap();
    let a = side_in(&ctx, QpCaps::default(), 64);
    let b = side_in(&ctx, QpCaps::default(), 64);
    connect(&a, &b, AccessFlags::ALL);
    let m = mr(&a.pd, 64);
    let n = mr(&b.pd, 64);
    b.qp.post_recv(&[RecvWr::new(1, &[n.full_sge()])]).unwrap();
    a.qp.post_send(&[SendWr::new(2, &[m.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait_one(&b.cq).status, WcStatus::Success);
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
}

// ---------------------------------------------------------------- errors

fn expect_remote_error(
    op: impl Fn(&MemoryRegion) -> WrOpcode,
    dst_access: AccessFlags,
    want: WcStatus,
) {
    let (a, b) = pair();
    let src = mr(&a.pd, 64);
    src.write_at(0, &[0xEE; 64]).unwrap();
    let dst = b.pd.alloc_mr(64, dst_access).unwrap();
    let sges = [src.sge(0, 8).unwrap()];
    a.qp.post_send(&[SendWr::new(1, &sges, op(&dst))]).unwrap();
    let wc = wait_one(&a.cq);
    assert_eq!(wc.status, want);
    assert_eq!(
        a.qp.state(),
        QpState::Error,
        "an error completion moves the QP to ERROR"
    );
    let mut got = [0u8; 64];
    dst.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|v| *v == 0), "target memory untouched");
    // The failed request was the last: nothing else completes, later posts flush.
    a.qp.post_send(&[SendWr::new(2, &sges, WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::WrFlushed);
}

#[test]
fn write_without_remote_write_is_remote_access() {
    expect_remote_error(
        |m| WrOpcode::Write {
            remote: m.remote(0),
        },
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
        WcStatus::RemoteAccess,
    );
}

#[test]
fn read_without_remote_read_is_remote_access() {
    expect_remote_error(
        |m| WrOpcode::Read {
            remote: m.remote(0),
        },
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        WcStatus::RemoteAccess,
    );
}

#[test]
fn atomic_without_remote_atomic_is_remote_access() {
    expect_remote_error(
        |m| WrOpcode::AtomicFetchAdd {
            remote: m.remote(0),
            add: 1,
        },
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        WcStatus::RemoteAccess,
    );
}

#[test]
fn out_of_bounds_and_wrong_rkey_are_remote_access() {
    expect_remote_error(
        |m| WrOpcode::Write {
            remote: m.remote(60),
        },
        AccessFlags::ALL,
        WcStatus::RemoteAccess,
    );
    expect_remote_error(
        |m| WrOpcode::Write {
            remote: RemoteAddr {
                addr: m.addr(),
                rkey: Rkey(m.rkey().0 ^ 0x8000_0000),
            },
        },
        AccessFlags::ALL,
        WcStatus::RemoteAccess,
    );
}

#[test]
fn misaligned_atomic_is_remote_invalid_request() {
    expect_remote_error(
        |m| WrOpcode::AtomicCmpSwp {
            remote: m.remote(4),
            compare: 0,
            swap: 1,
        },
        AccessFlags::ALL,
        WcStatus::RemoteInvalidRequest,
    );
}

#[test]
fn qp_without_remote_rights_refuses_one_sided_access() {
    let (a, b) = pair_with(QpCaps::default(), 64, AccessFlags::LOCAL_WRITE);
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    a.qp.post_send(&[SendWr::new(
        1,
        &[src.sge(0, 8).unwrap()],
        WrOpcode::Write {
            remote: dst.remote(0),
        },
    )])
    .unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::RemoteAccess);
}

#[test]
fn deregistered_rkey_is_remote_access() {
    let (a, b) = pair();
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    let remote = dst.remote(0);
    drop(dst);
    a.qp.post_send(&[SendWr::new(
        1,
        &[src.sge(0, 8).unwrap()],
        WrOpcode::Write { remote },
    )])
    .unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::RemoteAccess);
}

#[test]
fn bad_lkey_is_local_protection() {
    let (a, b) = pair();
    let dst = mr(&b.pd, 64);
    let sge = [Sge {
        addr: 0x1000,
        length: 8,
        lkey: Lkey(0x1234_5678),
    }];
    a.qp.post_send(&[SendWr::new(
        1,
        &sge,
        WrOpcode::Write {
            remote: dst.remote(0),
        },
    )])
    .unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::LocalProtection);
    // An MR of another PD is refused too.
    let (c, d) = pair();
    let other_pd = c.ctx.alloc_pd().unwrap();
    let foreign = mr(&other_pd, 64);
    let dst = mr(&d.pd, 64);
    c.qp.post_send(&[SendWr::new(
        2,
        &[foreign.sge(0, 8).unwrap()],
        WrOpcode::Write {
            remote: dst.remote(0),
        },
    )])
    .unwrap();
    assert_eq!(wait_one(&c.cq).status, WcStatus::LocalProtection);
}

#[test]
fn receive_too_small_is_local_length_at_receiver() {
    let (a, b) = pair();
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    b.qp.post_recv(&[
        RecvWr::new(1, &[dst.sge(0, 4).unwrap()]),
        RecvWr::new(2, &[dst.sge(8, 4).unwrap()]),
    ])
    .unwrap();
    a.qp.post_send(&[SendWr::new(3, &[src.sge(0, 16).unwrap()], WrOpcode::Send)])
        .unwrap();
    expect_receive_failed(
        &a,
        &b,
        WcStatus::RemoteInvalidRequest,
        WcStatus::LocalLength,
    );
}

/// The SEND just posted from `a` failed with `sender` and took `b`'s receive 1 with
/// `receiver`; `b`'s QP went to ERROR, so its receive 2 is flushed.
fn expect_receive_failed(a: &Side, b: &Side, sender: WcStatus, receiver: WcStatus) {
    assert_eq!(wait_one(&a.cq).status, sender);
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.status), (1, receiver));
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.status), (2, WcStatus::WrFlushed));
    assert_eq!(b.qp.state(), QpState::Error);
}

#[test]
fn receive_into_a_deregistered_buffer_fails_both_ends() {
    let (a, b) = pair();
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    let gone = dst.sge(0, 64).unwrap();
    b.qp.post_recv(&[RecvWr::new(1, &[gone]), RecvWr::new(2, &[gone])])
        .unwrap();
    drop(dst);
    a.qp.post_send(&[SendWr::new(3, &[src.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    expect_receive_failed(&a, &b, WcStatus::RemoteOperation, WcStatus::LocalProtection);
}

#[test]
fn empty_send_takes_a_receive_of_any_shape() {
    let (a, b) = pair();
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    dst.write_at(0, &[5u8; 64]).unwrap();
    let empty = dst.sge(0, 0).unwrap();
    let one = dst.sge(0, 16).unwrap();
    let two = [dst.sge(16, 8).unwrap(), dst.sge(32, 8).unwrap()];
    b.qp.post_recv(&[
        RecvWr::new(1, &[one]),
        RecvWr::new(2, &[empty]),
        RecvWr::new(3, &two),
        RecvWr::new(4, &[]),
    ])
    .unwrap();
    for id in 1..=4u64 {
        a.qp.post_send(&[SendWr::new(id, &[], WrOpcode::Send).with_flags(SendFlags::SIGNALED)])
            .unwrap();
        assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
        let r = wait_one(&b.cq);
        assert_eq!((r.wr_id, r.status, r.byte_len), (id, WcStatus::Success, 0));
    }
    // Nothing was written into the buffers.
    let mut back = [0u8; 64];
    dst.read_at(0, &mut back).unwrap();
    assert_eq!(back, [5u8; 64]);
    // A payload into a receive whose only buffer is empty is too long for it.
    b.qp.post_recv(&[RecvWr::new(5, &[empty])]).unwrap();
    a.qp.post_send(&[SendWr::new(6, &[src.sge(0, 1).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::RemoteInvalidRequest);
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.status), (5, WcStatus::LocalLength));
}

#[test]
fn receive_slot_reused_with_fewer_sges_ignores_the_old_ones() {
    // Receive queue of 3 (ring of 4 slots): the depth limit is below the ring's capacity.
    let caps = QpCaps {
        max_recv_wr: 3,
        ..QpCaps::default()
    };
    let (a, b) = pair_with(caps, 64, AccessFlags::ALL);
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 256);
    src.write_at(0, &[7u8; 64]).unwrap();
    // The first three receives have three SGEs each (slots 0, 1, 2).
    let three_sges = [
        dst.sge(0, 4).unwrap(),
        dst.sge(8, 4).unwrap(),
        dst.sge(16, 4).unwrap(),
    ];
    for id in 0..3u64 {
        b.qp.post_recv(&[RecvWr::new(id, &three_sges)]).unwrap();
    }
    let err = b.qp.post_recv(&[RecvWr::new(9, &three_sges)]).unwrap_err();
    assert!(matches!(err.source, VerbsError::QueueFull), "depth 3 holds");
    for id in 0..3u64 {
        a.qp.post_send(
            &[SendWr::new(id, &[src.sge(0, 12).unwrap()], WrOpcode::Send)
                .with_flags(SendFlags::SIGNALED)],
        )
        .unwrap();
        assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
        let r = wait_one(&b.cq);
        assert_eq!((r.wr_id, r.status, r.byte_len), (id, WcStatus::Success, 12));
    }
    // One-SGE receives of 4 bytes go to slot 3, then to slot 0, which held a three-SGE
    // receive: a 12-byte message must not spill into the SGEs the slot held before.
    b.qp.post_recv(&[RecvWr::new(10, &[dst.sge(128, 4).unwrap()])])
        .unwrap();
    a.qp.post_send(&[
        SendWr::new(10, &[src.sge(0, 4).unwrap()], WrOpcode::Send).with_flags(SendFlags::SIGNALED)
    ])
    .unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
    assert_eq!(wait_one(&b.cq).byte_len, 4);
    b.qp.post_recv(&[RecvWr::new(11, &[dst.sge(136, 4).unwrap()])])
        .unwrap();
    a.qp.post_send(&[SendWr::new(11, &[src.sge(0, 12).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::RemoteInvalidRequest);
    let r = wait_one(&b.cq);
    assert_eq!((r.wr_id, r.status), (11, WcStatus::LocalLength));
}

// ---------------------------------------------------------------- RNR

#[test]
fn rnr_retry_zero_fails_at_once() {
    let a = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    let b = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    a.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    a.qp.modify(&QpAttr::rtr(b.qp.endpoint())).unwrap();
    a.qp.modify(&QpAttr::rts().with_rnr_retry(0)).unwrap();
    b.qp.connect(&a.qp.endpoint(), AccessFlags::ALL).unwrap();
    let src = mr(&a.pd, 64);
    a.qp.post_send(&[SendWr::new(1, &[src.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::RnrRetryExceeded);
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn rnr_gives_up_after_rnr_retry_timers() {
    let a = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    let b = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    a.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    a.qp.modify(&QpAttr::rtr(b.qp.endpoint())).unwrap();
    a.qp.modify(&QpAttr::rts().with_rnr_retry(3)).unwrap();
    b.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    b.qp.modify(&QpAttr::rtr(a.qp.endpoint()).with_min_rnr_timer(1))
        .unwrap();
    b.qp.modify(&QpAttr::rts()).unwrap();
    let src = mr(&a.pd, 64);
    let sge = [src.sge(0, 8).unwrap()];
    a.qp.post_send(&[
        SendWr::new(1, &sge, WrOpcode::Send),
        SendWr::new(2, &sge, WrOpcode::Send),
    ])
    .unwrap();
    let w = wait_one(&a.cq);
    assert_eq!((w.wr_id, w.status), (1, WcStatus::RnrRetryExceeded));
    let w = wait_one(&a.cq);
    assert_eq!((w.wr_id, w.status), (2, WcStatus::WrFlushed));
}

#[test]
fn rnr_retries_until_a_receive_is_posted_and_keeps_order() {
    let a = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    let b = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    a.qp.connect(&b.qp.endpoint(), AccessFlags::ALL).unwrap();
    b.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    b.qp.modify(&QpAttr::rtr(a.qp.endpoint()).with_min_rnr_timer(1))
        .unwrap();
    b.qp.modify(&QpAttr::rts()).unwrap();
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    src.write_at(0, b"AB").unwrap();
    a.qp.post_send(&[
        SendWr::new(1, &[src.sge(0, 1).unwrap()], WrOpcode::Send),
        SendWr::new(2, &[src.sge(1, 1).unwrap()], WrOpcode::Send),
    ])
    .unwrap();
    assert_empty(&a.cq);
    b.qp.post_recv(&[
        RecvWr::new(10, &[dst.sge(0, 1).unwrap()]),
        RecvWr::new(11, &[dst.sge(1, 1).unwrap()]),
    ])
    .unwrap();
    assert_eq!(wait_one(&a.cq).wr_id, 1);
    assert_eq!(wait_one(&a.cq).wr_id, 2);
    assert_eq!(wait_one(&b.cq).wr_id, 10);
    assert_eq!(wait_one(&b.cq).wr_id, 11);
    let mut got = [0u8; 2];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"AB");
}

#[test]
fn send_before_peer_reaches_rtr_is_delivered_once_it_does() {
    let a = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    let b = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    // timeout 0: wait for the peer as long as it takes (no wall-clock assumption).
    a.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    a.qp.modify(&QpAttr::rtr(b.qp.endpoint())).unwrap();
    a.qp.modify(&QpAttr::rts().with_timeout(0, 7)).unwrap();
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    a.qp.post_send(&[SendWr::new(
        1,
        &[src.sge(0, 8).unwrap()],
        WrOpcode::Write {
            remote: dst.remote(0),
        },
    )])
    .unwrap();
    assert_empty(&a.cq);
    b.qp.connect(&a.qp.endpoint(), AccessFlags::ALL).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
}

#[test]
fn destroyed_peer_qp_ends_in_retry_exceeded() {
    let a = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    let b = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    a.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    a.qp.modify(&QpAttr::rtr(b.qp.endpoint())).unwrap();
    a.qp.modify(&QpAttr::rts().with_timeout(1, 1)).unwrap();
    b.qp.connect(&a.qp.endpoint(), AccessFlags::ALL).unwrap();
    let Side { qp: bqp, .. } = b;
    drop(bqp);
    let src = mr(&a.pd, 64);
    a.qp.post_send(&[SendWr::new(1, &[src.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::RetryExceeded);
}

// ---------------------------------------------------------------- state machine, flush

#[test]
fn posting_in_wrong_states_is_refused() {
    let ctx = Context::open("shm0").unwrap();
    let s = side_in(&ctx, QpCaps::default(), 64);
    let m = mr(&s.pd, 64);
    let sge = [m.sge(0, 8).unwrap()];
    let recv = s.qp.post_recv(&[RecvWr::new(1, &sge)]);
    assert!(matches!(
        recv,
        Err(PostError {
            source: VerbsError::WrongState {
                state: QpState::Reset,
                ..
            },
            ..
        })
    ));
    s.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    let send = s.qp.post_send(&[SendWr::new(1, &sge, WrOpcode::Send)]);
    assert!(matches!(
        send,
        Err(PostError {
            source: VerbsError::WrongState {
                state: QpState::Init,
                ..
            },
            ..
        })
    ));
    assert!(matches!(
        s.qp.modify(&QpAttr::rts()),
        Err(VerbsError::IllegalTransition {
            from: QpState::Init,
            to: QpState::Rts
        })
    ));
    assert_eq!(s.qp.state(), QpState::Init);
}

#[test]
fn error_flushes_everything_and_later_posts_flush_at_once() {
    let (a, b) = pair();
    let m = mr(&a.pd, 64);
    let sge = [m.sge(0, 8).unwrap()];
    a.qp.post_recv(&[RecvWr::new(1, &sge), RecvWr::new(2, &sge)])
        .unwrap();
    a.qp.modify(&QpAttr::error()).unwrap();
    for id in [1, 2] {
        let w = wait_one(&a.cq);
        assert_eq!(
            (w.wr_id, w.status, w.opcode),
            (id, WcStatus::WrFlushed, WcOpcode::Recv)
        );
    }
    a.qp.post_recv(&[RecvWr::new(3, &sge)]).unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::WrFlushed);
    a.qp.post_send(&[SendWr::new(4, &sge, WrOpcode::Send).with_flags(SendFlags::empty())])
        .unwrap();
    let w = wait_one(&a.cq);
    assert_eq!(
        (w.wr_id, w.status),
        (4, WcStatus::WrFlushed),
        "flushes complete even unsignaled"
    );
    // RESET → INIT → ... makes the QP usable again.
    a.qp.modify(&QpAttr::reset()).unwrap();
    b.qp.modify(&QpAttr::reset()).unwrap();
    connect(&a, &b, AccessFlags::ALL);
    let buf = mr(&b.pd, 64);
    b.qp.post_recv(&[RecvWr::new(5, &[buf.full_sge()])])
        .unwrap();
    a.qp.post_send(&[SendWr::new(6, &sge, WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait_one(&a.cq).status, WcStatus::Success);
}

#[test]
fn rnr_backlog_is_flushed_by_error() {
    let (a, _b) = pair();
    let m = mr(&a.pd, 64);
    let sge = [m.sge(0, 8).unwrap()];
    a.qp.post_send(&[
        SendWr::new(1, &sge, WrOpcode::Send),
        SendWr::new(2, &sge, WrOpcode::Send),
    ])
    .unwrap();
    assert_empty(&a.cq);
    a.qp.modify(&QpAttr::error()).unwrap();
    assert_eq!(wait_one(&a.cq).wr_id, 1);
    assert_eq!(wait_one(&a.cq).wr_id, 2);
}

// ---------------------------------------------------------------- queues

#[test]
fn cq_overflow_is_reported() {
    let (a, b) = pair_with(QpCaps::default(), 2, AccessFlags::ALL);
    assert_eq!(a.cq.capacity(), 2);
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    let sge = [src.sge(0, 8).unwrap()];
    for i in 0..3 {
        a.qp.post_send(&[SendWr::new(
            i,
            &sge,
            WrOpcode::Write {
                remote: dst.remote(0),
            },
        )])
        .unwrap();
    }
    let mut wc = [WorkCompletion::EMPTY; 4];
    assert!(matches!(
        a.cq.poll(&mut wc),
        Err(VerbsError::CqOverflow { capacity: 2 })
    ));
}

#[test]
fn send_queue_full_is_back_pressure() {
    let caps = QpCaps {
        max_send_wr: 2,
        ..QpCaps::default()
    };
    let (a, b) = pair_with(caps, 64, AccessFlags::ALL);
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    let sge = [src.sge(0, 8).unwrap()];
    let w = |id| {
        SendWr::new(
            id,
            &sge,
            WrOpcode::Write {
                remote: dst.remote(0),
            },
        )
    };
    let err = a.qp.post_send(&[w(1), w(2), w(3)]).unwrap_err();
    assert_eq!(err.index, 2);
    assert!(matches!(err.source, VerbsError::QueueFull));
    let mut wc = [WorkCompletion::EMPTY; 4];
    assert_eq!(a.cq.poll(&mut wc).unwrap(), 2);
    a.qp.post_send(&[w(3)]).unwrap();
    assert_eq!(wait_one(&a.cq).wr_id, 3);
}

#[test]
fn srq_feeds_several_qps() {
    let rctx = Context::open("shm0").unwrap();
    let pd = rctx.alloc_pd().unwrap();
    let cq = rctx.create_cq(64).unwrap();
    let srq = pd
        .create_srq(&SrqInitAttr {
            max_wr: 8,
            max_sge: 1,
            srq_limit: 0,
        })
        .unwrap();
    let buf = mr(&pd, 4096);
    for i in 0..4u64 {
        srq.post_recv(&[RecvWr::new(
            100 + i,
            &[buf.sge(i as usize * 64, 64).unwrap()],
        )])
        .unwrap();
    }
    assert_eq!(srq.outstanding(), 4);
    let mut senders = Vec::new();
    for _ in 0..2 {
        let mut init = QpInitAttr::new(&cq);
        init.srq = Some(&srq);
        let rqp = pd.create_qp(&init).unwrap();
        let s = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
        s.qp.connect(&rqp.endpoint(), AccessFlags::ALL).unwrap();
        rqp.connect(&s.qp.endpoint(), AccessFlags::ALL).unwrap();
        assert!(
            rqp.post_recv(&[RecvWr::new(0, &[])]).is_err(),
            "an SRQ QP has no own RQ"
        );
        senders.push((s, rqp));
    }
    for (s, rqp) in &senders {
        let m = mr(&s.pd, 8);
        s.qp.post_send(&[SendWr::new(1, &[m.sge(0, 8).unwrap()], WrOpcode::Send)])
            .unwrap();
        assert_eq!(wait_one(&s.cq).status, WcStatus::Success);
        let r = wait_one(&cq);
        assert_eq!(r.qp_num, rqp.qp_num());
        assert!((100..104).contains(&r.wr_id));
    }
    assert_eq!(srq.outstanding(), 2);
}

#[test]
fn armed_cq_signals_its_event_fd() {
    let (a, b) = pair();
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    b.cq.req_notify(false).unwrap();
    a.cq.req_notify(false).unwrap();
    assert!(!b.cq.wait_event(Some(Duration::from_millis(1))).unwrap());
    b.qp.post_recv(&[RecvWr::new(1, &[dst.full_sge()])])
        .unwrap();
    a.qp.post_send(&[SendWr::new(2, &[src.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert!(
        b.cq.wait_event(Some(WAIT)).unwrap(),
        "peer completion signals the armed CQ"
    );
    assert!(b.cq.ack_events().unwrap() >= 1);
    assert_eq!(wait_one(&b.cq).wr_id, 1);
    // Local completions signal too; an unarmed CQ stays quiet.
    assert!(a.cq.wait_event(Some(WAIT)).unwrap());
    assert_eq!(a.cq.ack_events().unwrap(), 1);
    assert_eq!(wait_one(&a.cq).wr_id, 2);
    b.qp.post_recv(&[RecvWr::new(3, &[dst.full_sge()])])
        .unwrap();
    a.qp.post_send(&[SendWr::new(4, &[src.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait_one(&b.cq).wr_id, 3);
    assert!(!b.cq.wait_event(Some(Duration::from_millis(20))).unwrap());
}

#[test]
fn solicited_only_arm_ignores_unsolicited_sends() {
    let (a, b) = pair();
    let src = mr(&a.pd, 64);
    let dst = mr(&b.pd, 64);
    b.qp.post_recv(&[
        RecvWr::new(1, &[dst.full_sge()]),
        RecvWr::new(2, &[dst.full_sge()]),
    ])
    .unwrap();
    b.cq.req_notify(true).unwrap();
    let sge = [src.sge(0, 8).unwrap()];
    a.qp.post_send(&[SendWr::new(3, &sge, WrOpcode::Send)])
        .unwrap();
    assert!(!b.cq.wait_event(Some(Duration::from_millis(20))).unwrap());
    a.qp.post_send(&[
        SendWr::new(4, &sge, WrOpcode::Send).with_flags(SendFlags::SIGNALED | SendFlags::SOLICITED)
    ])
    .unwrap();
    assert!(b.cq.wait_event(Some(WAIT)).unwrap());
}

// ---------------------------------------------------------------- separate processes

const CHILD_ENV: &str = "FABRIQ_SHM_TEST_CHILD";

/// Child half of `separate_processes_*`: run only when re-executed by the parent.
#[test]
fn child_process_entry() {
    let Ok(addr) = std::env::var(CHILD_ENV) else {
        return;
    };
    let s = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    let seg_mem = mr(&s.pd, 4096);
    let mut private = vec![0u64; 64];
    // SAFETY: `private` lives until the process exits, after the region.
    let priv_mr = unsafe {
        s.pd.reg_mr(private.as_mut_ptr().cast(), 512, AccessFlags::ALL)
    }
    .unwrap();
    seg_mem.write_at(0, b"child segment").unwrap();
    priv_mr.write_at(8, b"private!").unwrap();
    let mut ep = s.qp.endpoint();
    ep.extra.insert(
        "seg".into(),
        format!("{}:{}", seg_mem.addr(), seg_mem.rkey().0),
    );
    ep.extra.insert(
        "priv".into(),
        format!("{}:{}", priv_mr.addr(), priv_mr.rkey().0),
    );
    let recv = mr(&s.pd, 64);
    s.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    s.qp.post_recv(&[RecvWr::new(1, &[recv.full_sge()])])
        .unwrap();
    let remote = oob::connect_exchange(addr.as_str(), &ep, WAIT).unwrap();
    s.qp.modify(&QpAttr::rtr(remote)).unwrap();
    s.qp.modify(&QpAttr::rts()).unwrap();
    // Wait for the parent's SEND, answer with one, then wait to be killed.
    let r = wait_one(&s.cq);
    assert_eq!(r.status, WcStatus::Success);
    let mut got = [0u8; 4];
    recv.read_at(0, &mut got).unwrap();
    s.qp.post_send(&[SendWr::new(2, &[recv.sge(0, 4).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait_one(&s.cq).status, WcStatus::Success);
    std::thread::sleep(Duration::from_secs(30));
}

fn parse_remote(ep: &QpEndpoint, key: &str) -> RemoteAddr {
    let v = &ep.extra[key];
    let (a, k) = v.split_once(':').unwrap();
    RemoteAddr {
        addr: a.parse().unwrap(),
        rkey: Rkey(k.parse().unwrap()),
    }
}

#[test]
fn separate_processes_one_sided_two_sided_and_peer_death() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Kill(
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "provider::shm::tests::child_process_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &addr)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let s = side_in(&Context::open("shm0").unwrap(), QpCaps::default(), 64);
    let local = mr(&s.pd, 4096);
    listener.set_nonblocking(true).unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    let mut stream = loop {
        match listener.accept() {
            Ok((st, _)) => break st,
            Err(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("child never connected: {e}"),
        }
    };
    stream.set_nonblocking(false).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let remote = oob::exchange(&mut stream, &s.qp.endpoint()).unwrap();
    // A generous transport timeout (code 20 ≈ 4.3 s, 7 retries): the child may still be on its
    // way to RTR when the first request runs.
    s.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    s.qp.modify(&QpAttr::rtr(remote.clone())).unwrap();
    s.qp.modify(&QpAttr::rts().with_timeout(20, 7)).unwrap();
    let seg = parse_remote(&remote, "seg");
    let private = parse_remote(&remote, "priv");

    // READ from the child's segment memory (mapped) and private memory (cross-memory attach).
    s.qp.post_send(&[SendWr::new(
        1,
        &[local.sge(0, 13).unwrap()],
        WrOpcode::Read { remote: seg },
    )])
    .unwrap();
    assert_eq!(wait_one(&s.cq).status, WcStatus::Success);
    let mut got = [0u8; 13];
    local.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"child segment");
    let p8 = RemoteAddr {
        addr: private.addr + 8,
        rkey: private.rkey,
    };
    s.qp.post_send(&[SendWr::new(
        2,
        &[local.sge(100, 8).unwrap()],
        WrOpcode::Read { remote: p8 },
    )])
    .unwrap();
    assert_eq!(wait_one(&s.cq).status, WcStatus::Success);
    let mut got = [0u8; 8];
    local.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"private!");
    // Atomics on both kinds of memory (the private one is served by the child's service thread).
    let res = [local.sge(200, 8).unwrap()];
    for (id, target) in [
        (3, seg),
        (
            4,
            RemoteAddr {
                addr: private.addr + 16,
                rkey: private.rkey,
            },
        ),
    ] {
        for _ in 0..3 {
            s.qp.post_send(&[SendWr::new(
                id,
                &res,
                WrOpcode::AtomicFetchAdd {
                    remote: target,
                    add: 2,
                },
            )])
            .unwrap();
            assert_eq!(wait_one(&s.cq).status, WcStatus::Success);
        }
        s.qp.post_send(&[SendWr::new(
            id,
            &res,
            WrOpcode::AtomicCmpSwp {
                remote: target,
                compare: 0,
                swap: 0,
            },
        )])
        .unwrap();
        assert_eq!(wait_one(&s.cq).status, WcStatus::Success);
        let v = local
            .atomic_u64(200)
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst);
        let base = if id == 3 {
            u64::from_ne_bytes(*b"child se")
        } else {
            0
        };
        assert_eq!(v, base.wrapping_add(6));
    }
    // WRITE into private memory, SEND both ways.
    local.write_at(300, b"ping").unwrap();
    s.qp.post_send(&[SendWr::new(
        5,
        &[local.sge(300, 4).unwrap()],
        WrOpcode::Write { remote: p8 },
    )])
    .unwrap();
    assert_eq!(wait_one(&s.cq).status, WcStatus::Success);
    s.qp.post_recv(&[RecvWr::new(6, &[local.sge(400, 64).unwrap()])])
        .unwrap();
    s.qp.post_recv(&[RecvWr::new(7, &[local.sge(500, 64).unwrap()])])
        .unwrap();
    s.qp.post_send(&[SendWr::new(
        8,
        &[local.sge(300, 4).unwrap()],
        WrOpcode::Send,
    )])
    .unwrap();
    let mut seen = Vec::new();
    for _ in 0..2 {
        let w = wait_one(&s.cq);
        assert_eq!(w.status, WcStatus::Success, "{w:?}");
        seen.push(w.wr_id);
    }
    seen.sort_unstable();
    assert_eq!(seen, [6, 8]);
    let mut echo = [0u8; 4];
    local.read_at(400, &mut echo).unwrap();
    assert_eq!(&echo, b"ping");

    // The child dies: our QP goes to ERROR and the outstanding receive is flushed.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let w = wait_one(&s.cq);
    assert_eq!((w.wr_id, w.status), (7, WcStatus::WrFlushed));
    assert_eq!(s.qp.state(), QpState::Error);
}

/// Once `modify` has moved a QP to ERROR, no peer READ or WRITE through it is still copying
/// (`crate::soft::testing::accesses_past_error`).
#[test]
fn a_qp_moved_to_error_lets_no_peer_access_run_on() {
    let torn = crate::soft::testing::accesses_past_error(24, || {
        let (a, b) = pair();
        ((a.pd, a.cq, a.qp), (b.pd, b.qp))
    });
    assert!(torn.is_empty(), "{torn:?}");
}

/// A peer that died inside a request leaves its hold on the target QP's entry for ever; the
/// owner's moves of that QP to ERROR and RESET do not wait for it (each would take the drain
/// timeout, 2 s, and a QP reused from a cache would pay it at every close).
#[test]
fn a_hold_left_by_a_dead_peer_is_not_waited_for() {
    use std::sync::atomic::Ordering;
    use std::time::Instant;
    let (a, b) = pair();
    let slot = segment(&b.pd).qp_slot(b.qp.qp_num().0 & ((1 << super::segment::QP_INDEX_BITS) - 1));
    // The peer's thread inside a request, when its process ends.
    slot.active.fetch_add(1, Ordering::SeqCst);
    drop(a);
    for (attr, what) in [(QpAttr::error(), "ERROR"), (QpAttr::reset(), "RESET")] {
        let t = Instant::now();
        b.qp.modify(&attr).unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "the move to {what} waited {:?} for a dead peer's hold",
            t.elapsed()
        );
    }
    // Nor does its destroy (the entry is quarantined).
    let t = Instant::now();
    drop(b.qp);
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "the destroy waited {:?} for a dead peer's hold",
        t.elapsed()
    );
    slot.active.fetch_sub(1, Ordering::SeqCst);
}
