//! In-process tests of the tcp provider: two contexts (two listeners) talking over loopback.
//! Every wait has a generous timeout that only catches hangs.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

pub(super) use super::qp::hello_frame;
use crate::soft::testing::{
    self as fixture, big_regions, connect_with, connect_with_rnr_retry, read_back, wait,
    wait_state, Side, WAIT,
};
use crate::soft::wire::{self, Frame};
use crate::*;

fn open(progress: &str) -> Context {
    fixture::open("tcp0", &[("progress", progress)])
}

fn side(ctx: &Context, caps: QpCaps, access: AccessFlags) -> Side {
    fixture::side(ctx, 256, caps, access)
}

fn pair_in(ca: &Context, cb: &Context) -> (Side, Side) {
    let a = side(ca, QpCaps::default(), AccessFlags::ALL);
    let b = side(cb, QpCaps::default(), AccessFlags::ALL);
    connect_with(&a, &b, QpAttr::rts);
    (a, b)
}

/// The engine behind a tcp0 context.
pub(super) fn engine(ctx: &Context) -> &super::engine::Engine {
    ctx.ops()
        .as_any()
        .downcast_ref::<super::engine::Engine>()
        .expect("a tcp0 context is its engine")
}

fn pair() -> (Side, Side) {
    pair_in(&open("thread"), &open("thread"))
}

fn assert_no_completion(cq: &CompletionQueue) {
    let mut buf = [WorkCompletion::EMPTY; 4];
    assert_eq!(cq.poll(&mut buf).unwrap(), 0, "unexpected {:?}", &buf[..1]);
}

#[test]
fn device_is_listed_and_advertises_what_it_implements() {
    let devs = devices().unwrap();
    assert!(devs.iter().any(|d| d.name == "tcp0" && d.provider == "tcp"));
    let ctx = open("thread");
    let caps = ctx.query_device().capabilities;
    for c in [
        Capabilities::SEND,
        Capabilities::SEND_IMM,
        Capabilities::WRITE,
        Capabilities::WRITE_IMM,
        Capabilities::READ,
        Capabilities::ATOMICS,
        Capabilities::SRQ,
        Capabilities::INLINE,
        Capabilities::CQ_EVENTS,
    ] {
        assert!(caps.contains(c), "{c:?}");
    }
    assert!(!caps.contains(Capabilities::SYNCHRONISE));
    let port = ctx.query_port(1).unwrap();
    assert_eq!(port.state, PortState::Active);
    assert!(port.address.parse::<std::net::SocketAddr>().is_ok());
    assert!(Context::open("tcp7").is_err());
    let mut cfg = DeviceConfig::default();
    cfg.options.insert("nonsense".into(), "1".into());
    assert!(matches!(
        Context::open_with("tcp0", &cfg),
        Err(VerbsError::InvalidArgument(_))
    ));
}

#[test]
fn send_with_sge_lists_and_immediate_data() {
    let (a, b) = pair();
    a.mr.write_at(0, b"hello, ").unwrap();
    a.mr.write_at(100, b"world").unwrap();
    let recv_sges = [b.mr.sge(0, 4).unwrap(), b.mr.sge(200, 100).unwrap()];
    b.qp.post_recv(&[RecvWr::new(1, &recv_sges)]).unwrap();
    b.qp.post_recv(&[RecvWr::new(2, &[b.mr.sge(400, 16).unwrap()])])
        .unwrap();
    let sges = [a.mr.sge(0, 7).unwrap(), a.mr.sge(100, 5).unwrap()];
    a.qp.post_send(&[
        SendWr::new(10, &sges, WrOpcode::Send),
        SendWr::new(11, &sges[1..], WrOpcode::SendWithImm { imm: 0xfeed }),
    ])
    .unwrap();
    let wcs = wait(&b.cq, 2);
    assert_eq!(wcs[0].wr_id, 1);
    assert_eq!(wcs[0].status, WcStatus::Success);
    assert_eq!(wcs[0].opcode, WcOpcode::Recv);
    assert_eq!(wcs[0].byte_len, 12);
    assert_eq!(wcs[0].imm_data, None);
    assert_eq!(wcs[0].src_qp, a.qp.qp_num());
    assert_eq!(wcs[1].wr_id, 2);
    assert_eq!(wcs[1].imm_data, Some(0xfeed));
    let mut got = [0u8; 12];
    b.mr.read_at(0, &mut got[..4]).unwrap();
    b.mr.read_at(200, &mut got[4..]).unwrap();
    assert_eq!(&got, b"hello, world");
    let sent = wait(&a.cq, 2);
    assert!(sent
        .iter()
        .all(|w| w.status.is_success() && w.opcode == WcOpcode::Send));
    assert_eq!([sent[0].wr_id, sent[1].wr_id], [10, 11]);
}

#[test]
fn write_write_imm_and_read() {
    let (a, b) = pair();
    a.mr.write_at(0, &[7u8; 300]).unwrap();
    let src = [a.mr.sge(0, 100).unwrap(), a.mr.sge(100, 200).unwrap()];
    a.qp.post_send(&[SendWr::new(
        1,
        &src,
        WrOpcode::Write {
            remote: b.mr.remote(1000),
        },
    )])
    .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 302];
    b.mr.read_at(999, &mut got).unwrap();
    assert_eq!(got[0], 0);
    assert!(got[1..301].iter().all(|&x| x == 7));
    assert_eq!(got[301], 0);

    b.qp.post_recv(&[RecvWr::new(5, &[])]).unwrap();
    a.mr.write_at(0, b"imm!").unwrap();
    a.qp.post_send(&[SendWr::new(
        2,
        &[a.mr.sge(0, 4).unwrap()],
        WrOpcode::WriteWithImm {
            remote: b.mr.remote(4000),
            imm: 77,
        },
    )])
    .unwrap();
    let wc = wait(&b.cq, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.opcode, wc.imm_data, wc.byte_len),
        (5, WcOpcode::RecvRdmaWithImm, Some(77), 4)
    );
    let mut got = [0u8; 4];
    b.mr.read_at(4000, &mut got).unwrap();
    assert_eq!(&got, b"imm!");
    wait(&a.cq, 1);

    b.mr.write_at(8000, b"remote bytes").unwrap();
    let dst = [a.mr.sge(500, 6).unwrap(), a.mr.sge(600, 6).unwrap()];
    a.qp.post_send(&[SendWr::new(
        3,
        &dst,
        WrOpcode::Read {
            remote: b.mr.remote(8000),
        },
    )])
    .unwrap();
    let wc = wait(&a.cq, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (3, WcStatus::Success, WcOpcode::RdmaRead, 12)
    );
    let mut got = [0u8; 12];
    a.mr.read_at(500, &mut got[..6]).unwrap();
    a.mr.read_at(600, &mut got[6..]).unwrap();
    assert_eq!(&got, b"remote bytes");
}

#[test]
fn large_write_and_read_cross_many_socket_buffers() {
    let ctx_a = open("thread");
    let ctx_b = open("thread");
    let a = side(&ctx_a, QpCaps::default(), AccessFlags::ALL);
    let b = side(&ctx_b, QpCaps::default(), AccessFlags::ALL);
    connect_with(&a, &b, QpAttr::rts);
    let len = 8 << 20;
    let (big_a, big_b, pattern) = big_regions(&a, &b, len);
    let sge = [big_a.sge(0, len as u32).unwrap()];
    a.qp.post_send(&[
        SendWr::new(
            1,
            &sge,
            WrOpcode::Write {
                remote: big_b.remote(0),
            },
        ),
        SendWr::new(
            2,
            &sge,
            WrOpcode::Write {
                remote: big_b.remote(0),
            },
        ),
    ])
    .unwrap();
    assert!(wait(&a.cq, 2).iter().all(|w| w.status.is_success()));
    let mut got = vec![0u8; len];
    big_b.read_at(0, &mut got).unwrap();
    assert!(got == pattern);
    read_back(&a, &big_a, &big_b, &pattern, 3);
}

#[test]
fn atomics_and_misaligned_atomic() {
    let (a, b) = pair();
    b.mr.atomic_u64(64)
        .unwrap()
        .store(40, std::sync::atomic::Ordering::SeqCst);
    let res = [a.mr.sge(0, 8).unwrap()];
    a.qp.post_send(&[SendWr::new(
        1,
        &res,
        WrOpcode::AtomicFetchAdd {
            remote: b.mr.remote(64),
            add: 2,
        },
    )])
    .unwrap();
    wait(&a.cq, 1);
    assert_eq!(
        a.mr.atomic_u64(0)
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst),
        40
    );
    a.qp.post_send(&[
        SendWr::new(
            2,
            &res,
            WrOpcode::AtomicCmpSwp {
                remote: b.mr.remote(64),
                compare: 42,
                swap: 100,
            },
        ),
        SendWr::new(
            3,
            &[a.mr.sge(8, 8).unwrap()],
            WrOpcode::AtomicCmpSwp {
                remote: b.mr.remote(64),
                compare: 42,
                swap: 7,
            },
        ),
    ])
    .unwrap();
    let wcs = wait(&a.cq, 2);
    assert_eq!(wcs[0].opcode, WcOpcode::CompSwap);
    assert_eq!(
        a.mr.atomic_u64(0)
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst),
        42
    );
    assert_eq!(
        a.mr.atomic_u64(8)
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst),
        100
    );
    assert_eq!(
        b.mr.atomic_u64(64)
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst),
        100
    );

    a.qp.post_send(&[SendWr::new(
        4,
        &res,
        WrOpcode::AtomicFetchAdd {
            remote: b.mr.remote(65),
            add: 1,
        },
    )])
    .unwrap();
    let wc = wait(&a.cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RemoteInvalidRequest);
    assert_eq!(
        b.mr.atomic_u64(64)
            .unwrap()
            .load(std::sync::atomic::Ordering::SeqCst),
        100
    );
    wait_state(&a.qp, QpState::Error);
}

#[test]
fn inline_send_from_a_stack_buffer_and_limits() {
    let (a, b) = pair();
    b.qp.post_recv(&[RecvWr::new(1, &[b.mr.sge(0, 64).unwrap()])])
        .unwrap();
    let data = *b"inline payload";
    let sge = [Sge {
        addr: data.as_ptr() as u64,
        length: data.len() as u32,
        lkey: Lkey(0),
    }];
    a.qp.post_send(&[
        SendWr::new(1, &sge, WrOpcode::Send).with_flags(SendFlags::INLINE | SendFlags::SIGNALED)
    ])
    .unwrap();
    let wc = wait(&b.cq, 1)[0];
    assert_eq!(wc.byte_len, data.len() as u32);
    let mut got = [0u8; 14];
    b.mr.read_at(0, &mut got).unwrap();
    assert_eq!(got, data);
    wait(&a.cq, 1);
    // Above max_inline_data (64 by default): refused at post time.
    let big = [0u8; 65];
    let sge = [Sge {
        addr: big.as_ptr() as u64,
        length: 65,
        lkey: Lkey(0),
    }];
    let err =
        a.qp.post_send(&[SendWr::new(2, &sge, WrOpcode::Send).with_flags(SendFlags::INLINE)])
            .unwrap_err();
    assert_eq!(err.index, 0);
    assert!(matches!(err.source, VerbsError::InvalidArgument(_)));
    // Too many SGEs.
    let sges = [a.mr.sge(0, 1).unwrap(); 5];
    let err =
        a.qp.post_send(&[SendWr::new(3, &sges, WrOpcode::Send)])
            .unwrap_err();
    assert!(matches!(err.source, VerbsError::LimitExceeded(_)));
}

#[test]
fn unsignaled_sends_complete_silently_and_bad_lkey_is_local_protection() {
    let (a, b) = pair();
    b.qp.post_recv(&[RecvWr::new(1, &[]), RecvWr::new(2, &[])])
        .unwrap();
    a.qp.post_send(&[
        SendWr::new(1, &[], WrOpcode::Send).with_flags(SendFlags::empty()),
        SendWr::new(2, &[], WrOpcode::Send),
    ])
    .unwrap();
    let wcs = wait(&a.cq, 1);
    assert_eq!(wcs[0].wr_id, 2);
    wait(&b.cq, 2);
    assert_no_completion(&a.cq);
    let bad = [Sge {
        addr: a.mr.addr(),
        length: 8,
        lkey: Lkey(a.mr.lkey().0 ^ 0x5a5a),
    }];
    a.qp.post_send(&[SendWr::new(3, &bad, WrOpcode::Send).with_flags(SendFlags::empty())])
        .unwrap();
    let wc = wait(&a.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (3, WcStatus::LocalProtection));
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn remote_access_errors_leave_memory_unchanged() {
    let ctx_a = open("thread");
    let ctx_b = open("thread");
    let a = side(&ctx_a, QpCaps::default(), AccessFlags::ALL);
    let b = side(
        &ctx_b,
        QpCaps::default(),
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
    );
    connect_with(&a, &b, QpAttr::rts);
    a.mr.write_at(0, &[9u8; 64]).unwrap();
    let src = [a.mr.sge(0, 64).unwrap()];
    // No REMOTE_WRITE on the target region.
    a.qp.post_send(&[SendWr::new(
        1,
        &src,
        WrOpcode::Write {
            remote: b.mr.remote(0),
        },
    )])
    .unwrap();
    let wc = wait(&a.cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RemoteAccess);
    let mut got = [1u8; 64];
    b.mr.read_at(0, &mut got).unwrap();
    assert_eq!(got, [0u8; 64]);
    wait_state(&a.qp, QpState::Error);

    // Out of bounds, on a fresh pair with a writable region.
    let (a, b) = pair();
    let src = [a.mr.sge(0, 64).unwrap()];
    a.qp.post_send(&[SendWr::new(
        1,
        &src,
        WrOpcode::Write {
            remote: b.mr.remote(b.mr.len() - 32),
        },
    )])
    .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemoteAccess);
    let mut got = [1u8; 32];
    b.mr.read_at(b.mr.len() - 32, &mut got).unwrap();
    assert_eq!(got, [0u8; 32]);
}

#[test]
fn deregistered_region_refuses_its_old_rkey() {
    let (a, b) = pair();
    let extra = b.pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
    let remote = extra.remote(0);
    drop(extra);
    a.qp.post_send(&[SendWr::new(
        1,
        &[a.mr.sge(0, 8).unwrap()],
        WrOpcode::Write { remote },
    )])
    .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemoteAccess);
}

#[test]
fn rnr_is_retried_until_a_receive_is_posted() {
    let ctx_a = open("thread");
    let ctx_b = open("thread");
    let a = side(&ctx_a, QpCaps::default(), AccessFlags::ALL);
    let b = side(&ctx_b, QpCaps::default(), AccessFlags::ALL);
    // Shortest RNR timer, infinite RNR retries.
    connect_with_rnr_retry(&a, &b, 7);
    a.mr.write_at(0, b"late").unwrap();
    a.qp.post_send(&[SendWr::new(1, &[a.mr.sge(0, 4).unwrap()], WrOpcode::Send)])
        .unwrap();
    // Let a few RNR rounds happen (no assertion on timing).
    std::thread::sleep(Duration::from_millis(20));
    assert_no_completion(&a.cq);
    b.qp.post_recv(&[RecvWr::new(9, &[b.mr.sge(0, 8).unwrap()])])
        .unwrap();
    let wc = wait(&b.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.byte_len), (9, 4));
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
}

#[test]
fn rnr_retry_exceeded_then_the_queue_flushes() {
    let ctx_a = open("thread");
    let ctx_b = open("thread");
    let a = side(&ctx_a, QpCaps::default(), AccessFlags::ALL);
    let b = side(&ctx_b, QpCaps::default(), AccessFlags::ALL);
    connect_with_rnr_retry(&a, &b, 2);
    a.qp.post_send(&[
        SendWr::new(1, &[], WrOpcode::Send),
        SendWr::new(2, &[], WrOpcode::Send),
    ])
    .unwrap();
    let wcs = wait(&a.cq, 2);
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status),
        (1, WcStatus::RnrRetryExceeded)
    );
    assert_eq!((wcs[1].wr_id, wcs[1].status), (2, WcStatus::WrFlushed));
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn error_state_flushes_everything_and_new_posts() {
    let (a, _b) = pair();
    a.qp.post_recv(&[
        RecvWr::new(1, &[a.mr.sge(0, 8).unwrap()]),
        RecvWr::new(2, &[]),
    ])
    .unwrap();
    a.qp.modify(&QpAttr::error()).unwrap();
    let wcs = wait(&a.cq, 2);
    assert!(wcs
        .iter()
        .all(|w| w.status == WcStatus::WrFlushed && w.opcode == WcOpcode::Recv));
    a.qp.post_send(&[SendWr::new(3, &[], WrOpcode::Send).with_flags(SendFlags::empty())])
        .unwrap();
    a.qp.post_recv(&[RecvWr::new(4, &[])]).unwrap();
    let wcs = wait(&a.cq, 2);
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status, wcs[0].opcode),
        (3, WcStatus::WrFlushed, WcOpcode::Send)
    );
    assert_eq!((wcs[1].wr_id, wcs[1].status), (4, WcStatus::WrFlushed));
    // RESET → INIT is allowed again; posting a send in INIT is refused.
    a.qp.modify(&QpAttr::reset()).unwrap();
    a.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    let err =
        a.qp.post_send(&[SendWr::new(5, &[], WrOpcode::Send)])
            .unwrap_err();
    assert!(matches!(
        err.source,
        VerbsError::WrongState {
            state: QpState::Init,
            ..
        }
    ));
    assert!(matches!(
        a.qp.modify(&QpAttr::rts()),
        Err(VerbsError::IllegalTransition { .. })
    ));
}

#[test]
fn peer_disconnect_moves_qp_to_error_and_flushes() {
    let (a, b) = pair();
    a.qp.post_recv(&[RecvWr::new(1, &[])]).unwrap();
    drop(b);
    let wc = wait(&a.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::WrFlushed));
    wait_state(&a.qp, QpState::Error);
}

/// Accept the connection of a QP whose "peer" is this test, and read its HELLO.
fn fake_peer(qp: &QueuePair) -> TcpStream {
    fake_peer_at(qp).1
}

/// A listener of this test at 127.0.0.2 (above the contexts' 127.0.0.1, so `qp` is the side
/// that connects), `qp` (RESET) taken to RTS towards a QP 77 there, and the connection it opened,
/// its HELLO read.
pub(super) fn fake_peer_at(qp: &QueuePair) -> (TcpListener, TcpStream) {
    let listener = TcpListener::bind("127.0.0.2:0").unwrap();
    connect_to(qp, listener.local_addr().unwrap());
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    expect_hello(&mut s, qp);
    (listener, s)
}

/// Take `qp` (RESET) to RTS towards a QP 77 at `peer`.
pub(super) fn connect_to(qp: &QueuePair, peer: std::net::SocketAddr) {
    let fake = QpEndpoint {
        address: peer.to_string(),
        qp_num: QpNum(77),
        ..qp.endpoint()
    };
    qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    qp.modify(&QpAttr::rtr(fake)).unwrap();
    qp.modify(&QpAttr::rts()).unwrap();
}

/// Read a HELLO from `qp` to QP 77.
pub(super) fn expect_hello(s: &mut TcpStream, qp: &QueuePair) {
    let mut hello = [0u8; wire::HEADER_LEN + 16];
    s.read_exact(&mut hello).unwrap();
    match wire::decode(&hello, 0).unwrap().unwrap().0 {
        Frame::Hello {
            dst_qpn, src_qpn, ..
        } => assert_eq!((dst_qpn, src_qpn), (77, qp.qp_num().0)),
        f => panic!("expected HELLO, got {f:?}"),
    }
}

#[test]
fn malformed_frame_fails_only_its_qp() {
    let ca = open("thread");
    let cb = open("thread");
    let (a, b) = pair_in(&ca, &cb);
    let victim = side(&cb, QpCaps::default(), AccessFlags::ALL);
    let mut s = fake_peer(&victim.qp);
    victim.qp.post_recv(&[RecvWr::new(5, &[])]).unwrap();
    // A frame with an unknown opcode.
    let mut bad = vec![0u8; 16];
    bad[..4].copy_from_slice(&16u32.to_be_bytes());
    bad[4] = 0x7e;
    s.write_all(&bad).unwrap();
    let wc = wait(&victim.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::WrFlushed));
    assert_eq!(victim.qp.state(), QpState::Error);
    // The victim closed the connection.
    let mut buf = [0u8; 1];
    s.set_read_timeout(Some(WAIT)).unwrap();
    assert_eq!(s.read(&mut buf).unwrap_or(0), 0);
    // The other QP of the same context keeps working.
    b.qp.post_recv(&[RecvWr::new(1, &[b.mr.sge(0, 8).unwrap()])])
        .unwrap();
    a.qp.post_send(&[SendWr::new(1, &[a.mr.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
}

#[test]
fn truncated_frame_then_close_fails_the_qp_and_flushes_sends() {
    let ctx = open("thread");
    let victim = side(&ctx, QpCaps::default(), AccessFlags::ALL);
    let mut s = fake_peer(&victim.qp);
    victim
        .qp
        .post_send(&[SendWr::new(
            9,
            &[victim.mr.sge(0, 8).unwrap()],
            WrOpcode::Send,
        )])
        .unwrap();
    // Half a frame, then the peer goes away.
    let mut frame = Vec::new();
    wire::encode(
        &Frame::Request(wire::Request {
            qpn: victim.qp.qp_num().0,
            psn: 0,
            solicited: false,
            op: wire::RequestOp::Send {
                imm: None,
                payload: &[1; 32],
            },
        }),
        &mut frame,
    );
    s.write_all(&frame[..20]).unwrap();
    drop(s);
    let wc = wait(&victim.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (9, WcStatus::WrFlushed));
    assert_eq!(victim.qp.state(), QpState::Error);
}

#[test]
fn hello_for_unknown_qp_and_garbage_connections_are_dropped() {
    let ctx = open("thread");
    let addr = ctx.query_port(1).unwrap().address;
    let mut s = TcpStream::connect(&addr).unwrap();
    let mut hello = Vec::new();
    wire::encode(
        &Frame::Hello {
            dst_qpn: 0x00ff_fff0,
            src_qpn: 1,
            version: wire::PROTOCOL_VERSION,
            src_incarnation: 1,
            dst_incarnation: 0,
        },
        &mut hello,
    );
    s.write_all(&hello).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(s.read(&mut buf).unwrap_or(0), 0, "closed by the context");
    let mut g = TcpStream::connect(&addr).unwrap();
    g.write_all(&[0xff; 24]).unwrap();
    g.set_read_timeout(Some(WAIT)).unwrap();
    assert_eq!(g.read(&mut buf).unwrap_or(0), 0, "closed by the context");
    // The context still serves QPs.
    let (a, b) = pair_in(&ctx, &ctx);
    b.qp.post_recv(&[RecvWr::new(1, &[])]).unwrap();
    a.qp.post_send(&[SendWr::new(1, &[], WrOpcode::Send)])
        .unwrap();
    wait(&b.cq, 1);
}

#[test]
fn shared_receive_queue_feeds_two_qps() {
    let ca = open("thread");
    let cb = open("thread");
    let pd = cb.alloc_pd().unwrap();
    let cq = cb.create_cq(64).unwrap();
    let srq = pd
        .create_srq(&SrqInitAttr {
            max_wr: 8,
            max_sge: 1,
            srq_limit: 0,
        })
        .unwrap();
    let mr = pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
    let mut init = QpInitAttr::new(&cq);
    init.srq = Some(&srq);
    let t1 = pd.create_qp(&init).unwrap();
    let t2 = pd.create_qp(&init).unwrap();
    let s1 = side(&ca, QpCaps::default(), AccessFlags::ALL);
    let s2 = side(&ca, QpCaps::default(), AccessFlags::ALL);
    for (s, t) in [(&s1, &t1), (&s2, &t2)] {
        s.qp.connect(&t.endpoint(), AccessFlags::ALL).unwrap();
        t.connect(&s.qp.endpoint(), AccessFlags::ALL).unwrap();
    }
    assert!(matches!(
        t1.post_recv(&[RecvWr::new(0, &[])]),
        Err(PostError {
            source: VerbsError::InvalidArgument(_),
            ..
        })
    ));
    srq.post_recv(&[
        RecvWr::new(1, &[mr.sge(0, 16).unwrap()]),
        RecvWr::new(2, &[mr.sge(16, 16).unwrap()]),
    ])
    .unwrap();
    assert_eq!(srq.outstanding(), 2);
    s1.qp
        .post_send(&[SendWr::new(1, &[s1.mr.sge(0, 4).unwrap()], WrOpcode::Send)])
        .unwrap();
    wait(&s1.cq, 1);
    s2.qp
        .post_send(&[SendWr::new(1, &[s2.mr.sge(0, 4).unwrap()], WrOpcode::Send)])
        .unwrap();
    wait(&s2.cq, 1);
    let wcs = wait(&cq, 2);
    assert_eq!([wcs[0].wr_id, wcs[1].wr_id], [1, 2]);
    assert_eq!([wcs[0].qp_num, wcs[1].qp_num], [t1.qp_num(), t2.qp_num()]);
    assert_eq!(srq.outstanding(), 0);
}

#[test]
fn cq_event_fd_wakes_a_sleeping_poller() {
    let (a, b) = pair();
    b.qp.post_recv(&[RecvWr::new(1, &[])]).unwrap();
    b.cq.req_notify(false).unwrap();
    a.qp.post_send(&[SendWr::new(1, &[], WrOpcode::Send)])
        .unwrap();
    assert!(b.cq.wait_event(Some(WAIT)).unwrap());
    assert_eq!(b.cq.ack_events().unwrap(), 1);
    wait(&b.cq, 1);
}

/// A busy poller that arms its CQ to sleep sends the ACKs it held back for its next post
/// itself, and wakes the progress thread only for sockets it left to it: with none, every
/// socket is still watched and nothing needs the thread.
#[test]
fn a_busy_poller_that_sleeps_sends_what_it_held_and_leaves_the_thread_asleep() {
    let cb = open("busy");
    let (a, b) = pair_in(&open("busy"), &cb);
    let engine = engine(&cb);
    let mut wc = [WorkCompletion::EMPTY; 1];
    for i in 0..20u64 {
        b.qp.post_recv(&[RecvWr::new(i, &[])]).unwrap();
        a.qp.post_send(&[SendWr::new(i, &[], WrOpcode::Send)])
            .unwrap();
        // b spins on its CQ (each poll reads the sockets) until the SEND is there; its ACK
        // may be held back for a reply that does not come: it leaves when b sleeps.
        let deadline = std::time::Instant::now() + WAIT;
        while b.cq.poll(&mut wc).unwrap() == 0 {
            assert!(std::time::Instant::now() < deadline, "no SEND");
        }
        assert_eq!(wc[0].wr_id, i);
        b.cq.req_notify(false).unwrap();
        assert_eq!(wait(&a.cq, 1)[0].wr_id, i, "the ACK came");
        b.cq.ack_events().unwrap();
    }
    // Quiet now: polling and going to sleep again leaves nothing to the thread.
    std::thread::sleep(Duration::from_millis(20));
    for _ in 0..10 {
        assert_eq!(b.cq.poll(&mut wc).unwrap(), 0);
        let wakes = engine.thread_wakes();
        b.cq.req_notify(false).unwrap();
        assert_eq!(
            engine.thread_wakes(),
            wakes,
            "nothing was left to the thread"
        );
    }
    // And the thread still serves the sleeping poller.
    b.qp.post_recv(&[RecvWr::new(99, &[])]).unwrap();
    a.qp.post_send(&[SendWr::new(99, &[], WrOpcode::Send)])
        .unwrap();
    assert!(b.cq.wait_event(Some(WAIT)).unwrap());
    b.cq.ack_events().unwrap();
    assert_eq!(wait(&b.cq, 1)[0].wr_id, 99);
    assert_eq!(wait(&a.cq, 1)[0].wr_id, 99);
}

/// A busy poll reads only the connections that have something: beside 32 idle connected QP
/// pairs of the same two contexts, a spinning poller of one pair's CQ reads about one socket
/// per message it receives, not every QP's socket on every poll.
#[test]
fn a_busy_poll_reads_only_the_ready_connections() {
    let (ca, cb) = (open("busy"), open("busy"));
    let (a, b) = pair_in(&ca, &cb);
    let idle: Vec<(Side, Side)> = (0..32).map(|_| pair_in(&ca, &cb)).collect();
    let engine = engine(&cb);
    let mut wc = [WorkCompletion::EMPTY; 1];
    let rounds = 200u64;
    let reads_before = engine
        .polled_reads
        .load(std::sync::atomic::Ordering::Relaxed);
    let mut polls = 0u64;
    for i in 0..rounds {
        b.qp.post_recv(&[RecvWr::new(i, &[])]).unwrap();
        // Polls that find nothing read nothing.
        for _ in 0..10 {
            polls += 1;
            assert_eq!(b.cq.poll(&mut wc).unwrap(), 0);
        }
        a.qp.post_send(&[SendWr::new(i, &[], WrOpcode::Send)])
            .unwrap();
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            polls += 1;
            if b.cq.poll(&mut wc).unwrap() == 1 {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "no SEND");
        }
        assert_eq!(wc[0].wr_id, i);
        assert_eq!(wait(&a.cq, 1)[0].wr_id, i);
    }
    let reads = engine
        .polled_reads
        .load(std::sync::atomic::Ordering::Relaxed)
        - reads_before;
    assert!(polls >= 11 * rounds);
    assert!(
        reads <= 2 * rounds + 16,
        "{reads} socket reads for {rounds} messages in {polls} polls beside {} idle QPs",
        idle.len()
    );
    // The idle pairs still work.
    for (x, y) in &idle {
        y.qp.post_recv(&[RecvWr::new(7, &[])]).unwrap();
        x.qp.post_send(&[SendWr::new(7, &[], WrOpcode::Send)])
            .unwrap();
        assert_eq!(wait(&y.cq, 1)[0].wr_id, 7);
        assert_eq!(wait(&x.cq, 1)[0].wr_id, 7);
    }
}

/// The progress thread's wake-ups cost the same however many QPs the context has: in thread
/// mode, 200 messages beside 32 idle QP pairs make the engines look at QP timers only when a
/// deadline comes due — never here, with ACK timeouts of an hour — not at every QP on every
/// wake-up (≥ 33 per message).
#[test]
fn the_thread_looks_at_qp_timers_only_when_a_deadline_is_due() {
    let opts = [("progress", "thread"), ("min_ack_timeout_ms", "3600000")];
    let (ca, cb) = (fixture::open("tcp0", &opts), fixture::open("tcp0", &opts));
    let (a, b) = pair_in(&ca, &cb);
    let idle: Vec<(Side, Side)> = (0..32).map(|_| pair_in(&ca, &cb)).collect();
    let looks = || {
        [&ca, &cb]
            .iter()
            .map(|c| {
                engine(c)
                    .timer_looks
                    .load(std::sync::atomic::Ordering::Relaxed)
            })
            .sum::<u64>()
    };
    fixture::assert_timer_rounds_do_not_follow_messages(&a, &b, idle.len(), looks);
}

#[test]
fn busy_mode_progresses_from_poll_and_still_serves_one_sided_ops() {
    let (a, b) = pair_in(&open("busy"), &open("busy"));
    for i in 0..100u64 {
        b.qp.post_recv(&[RecvWr::new(i, &[b.mr.sge(0, 8).unwrap()])])
            .unwrap();
        a.qp.post_send(&[SendWr::new(i, &[a.mr.sge(0, 8).unwrap()], WrOpcode::Send)])
            .unwrap();
        assert_eq!(wait(&b.cq, 1)[0].wr_id, i);
        assert_eq!(wait(&a.cq, 1)[0].wr_id, i);
    }
    // b never polls here: its progress thread serves the READ.
    b.mr.write_at(0, b"fallback").unwrap();
    a.qp.post_send(&[SendWr::new(
        7,
        &[a.mr.sge(100, 8).unwrap()],
        WrOpcode::Read {
            remote: b.mr.remote(0),
        },
    )])
    .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 8];
    a.mr.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"fallback");
}

/// A busy poller owns the sockets while it polls; once it arms its CQ to sleep, its grace
/// ends at once (the progress thread serves the sockets, not after the grace period), and the
/// canonical re-poll of an armed CQ does not claim them again.
#[test]
fn a_busy_poller_that_arms_its_cq_hands_the_sockets_back_at_once() {
    let cb = open("busy");
    let (a, b) = pair_in(&open("busy"), &cb);
    let engine = engine(&cb);
    let mut wc = [WorkCompletion::EMPTY; 1];
    assert_eq!(b.cq.poll(&mut wc).unwrap(), 0);
    assert!(engine.poller_active(std::time::Instant::now()));
    b.cq.req_notify(false).unwrap();
    assert!(!engine.poller_active(std::time::Instant::now()));
    assert_eq!(b.cq.poll(&mut wc).unwrap(), 0);
    assert!(!engine.poller_active(std::time::Instant::now()));
    // The sleeping poller is woken by its event, served by the thread.
    b.qp.post_recv(&[RecvWr::new(1, &[])]).unwrap();
    a.qp.post_send(&[SendWr::new(1, &[], WrOpcode::Send)])
        .unwrap();
    assert!(b.cq.wait_event(Some(WAIT)).unwrap());
    b.cq.ack_events().unwrap();
    assert_eq!(wait(&b.cq, 1)[0].wr_id, 1);
}

#[test]
fn fence_orders_a_send_after_a_read() {
    let (a, b) = pair();
    b.mr.write_at(0, b"fenced").unwrap();
    b.qp.post_recv(&[RecvWr::new(1, &[b.mr.sge(100, 8).unwrap()])])
        .unwrap();
    a.qp.post_send(&[
        SendWr::new(
            1,
            &[a.mr.sge(0, 6).unwrap()],
            WrOpcode::Read {
                remote: b.mr.remote(0),
            },
        ),
        SendWr::new(2, &[a.mr.sge(0, 6).unwrap()], WrOpcode::Send)
            .with_flags(SendFlags::SIGNALED | SendFlags::FENCE),
    ])
    .unwrap();
    let wcs = wait(&a.cq, 2);
    assert_eq!([wcs[0].wr_id, wcs[1].wr_id], [1, 2]);
    wait(&b.cq, 1);
    let mut got = [0u8; 6];
    b.mr.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"fenced", "the SEND carried what the READ brought");
}

#[test]
fn send_queue_full_is_back_pressure() {
    let ctx_a = open("thread");
    let ctx_b = open("thread");
    let caps = QpCaps {
        max_send_wr: 2,
        ..QpCaps::default()
    };
    let a = side(&ctx_a, caps, AccessFlags::ALL);
    let b = side(&ctx_b, QpCaps::default(), AccessFlags::ALL);
    connect_with(&a, &b, QpAttr::rts);
    // No receives at b: the SENDs wait in RNR, so the queue stays full.
    let wrs = [
        SendWr::new(1, &[], WrOpcode::Send),
        SendWr::new(2, &[], WrOpcode::Send),
        SendWr::new(3, &[], WrOpcode::Send),
    ];
    let err = a.qp.post_send(&wrs).unwrap_err();
    assert_eq!(err.index, 2);
    assert!(matches!(err.source, VerbsError::QueueFull));
    b.qp.post_recv(&[RecvWr::new(1, &[]), RecvWr::new(2, &[])])
        .unwrap();
    wait(&a.cq, 2);
    let _ = &b.ctx;
}

#[test]
fn contexts_bound_to_different_addresses_connect_through_their_listeners() {
    let open_at = |ip: &str| {
        let cfg = DeviceConfig {
            bind_addr: Some(format!("{ip}:0").parse().unwrap()),
            ..DeviceConfig::default()
        };
        Context::open_with("tcp0", &cfg).unwrap()
    };
    let (ca, cb) = (open_at("127.0.0.2"), open_at("127.0.0.3"));
    assert!(ca.query_port(1).unwrap().address.starts_with("127.0.0.2:"));
    let (a, b) = pair_in(&ca, &cb);
    assert!(b.qp.endpoint().address.starts_with("127.0.0.3:"));
    b.qp.post_recv(&[RecvWr::new(1, &[b.mr.sge(0, 8).unwrap()])])
        .unwrap();
    a.mr.write_at(0, b"netns ok").unwrap();
    a.qp.post_send(&[SendWr::new(1, &[a.mr.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    wait(&b.cq, 1);
    let mut got = [0u8; 8];
    b.mr.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"netns ok");
    // And the other direction.
    a.qp.post_recv(&[RecvWr::new(2, &[])]).unwrap();
    b.qp.post_send(&[SendWr::new(2, &[], WrOpcode::Send)])
        .unwrap();
    wait(&a.cq, 2);
}

#[test]
fn bad_bind_settings_are_refused() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let cfg = DeviceConfig {
        bind_addr: Some(taken.local_addr().unwrap()),
        ..DeviceConfig::default()
    };
    assert!(matches!(
        Context::open_with("tcp0", &cfg),
        Err(VerbsError::Io { .. })
    ));
    let mut cfg = DeviceConfig::default();
    cfg.options.insert("progress".into(), "sometimes".into());
    assert!(matches!(
        Context::open_with("tcp0", &cfg),
        Err(VerbsError::InvalidArgument(_))
    ));
}

/// Take `a` and `b` (RESET or INIT) to RTS towards each other, `b` first (as a server does:
/// RTR and RTS before it answers, then the client).
fn connect_qps(a: &QueuePair, b: &QueuePair) {
    for qp in [a, b] {
        if qp.state() == QpState::Reset {
            qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
        }
    }
    let (ea, eb) = (a.endpoint(), b.endpoint());
    for (qp, remote) in [(b, ea), (a, eb)] {
        qp.modify(&QpAttr::rtr(remote)).unwrap();
        qp.modify(&QpAttr::rts()).unwrap();
    }
}

/// Many QPs complete into one CQ while several threads wait on it with `poll_blocking` (arm,
/// poll again, sleep): a completion that is queued always ends a wait. Each round delivers
/// exactly one receive completion per waiter, so a waiter that sleeps while a completion is
/// queued waits until the hang timeout.
#[test]
fn blocking_waiters_on_a_shared_cq_miss_no_completion() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};
    use std::time::Instant;
    const QPS: usize = 16;
    const WAITERS: usize = 4;
    const ROUNDS: usize = 300;
    let (ca, cb) = (open("thread"), open("thread"));
    let (pa, pb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let (cqa, cqb) = (ca.create_cq(4096).unwrap(), cb.create_cq(4096).unwrap());
    let mra = pa.alloc_mr(4096, AccessFlags::ALL).unwrap();
    let mrb = pb.alloc_mr(4096, AccessFlags::ALL).unwrap();
    let qps: Vec<(QueuePair, QueuePair)> = (0..QPS)
        .map(|_| {
            let a = pa.create_qp(&QpInitAttr::new(&cqa)).unwrap();
            let b = pb.create_qp(&QpInitAttr::new(&cqb)).unwrap();
            connect_qps(&a, &b);
            (a, b)
        })
        .collect();
    let start = Arc::new(Barrier::new(WAITERS + 1));
    let end = Arc::new(Barrier::new(WAITERS + 1));
    let stranded = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicUsize::new(0));
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| {
            let (cq, start, end) = (cqb.clone(), start.clone(), end.clone());
            let (stranded, received) = (stranded.clone(), received.clone());
            std::thread::spawn(move || loop {
                start.wait();
                if stranded.load(Ordering::Acquire) {
                    return;
                }
                let deadline = Instant::now() + WAIT;
                let mut wc = [WorkCompletion::EMPTY; 1];
                let n = cq.poll_blocking(&mut wc, WAIT).unwrap();
                if n == 1 && wc[0].status == WcStatus::Success && Instant::now() < deadline {
                    received.fetch_add(1, Ordering::AcqRel);
                } else {
                    stranded.store(true, Ordering::Release);
                }
                end.wait();
            })
        })
        .collect();
    let sge = [mra.sge(0, 64).unwrap()];
    let mut rounds = 0;
    for round in 0..ROUNDS {
        start.wait();
        if stranded.load(Ordering::Acquire) {
            break;
        }
        for i in 0..WAITERS {
            let (a, b) = &qps[(round * WAITERS + i) % QPS];
            b.post_recv(&[RecvWr::new(i as u64, &[mrb.sge(0, 64).unwrap()])])
                .unwrap();
            a.post_send(&[SendWr::new(i as u64, &sge, WrOpcode::Send)])
                .unwrap();
        }
        assert!(wait(&cqa, WAITERS).iter().all(|w| w.status.is_success()));
        end.wait();
        rounds += 1;
    }
    if rounds == ROUNDS {
        // Release the waiters, which are at the start barrier.
        stranded.store(true, Ordering::Release);
        start.wait();
    }
    for w in waiters {
        w.join().unwrap();
    }
    assert_eq!(
        (rounds, received.load(Ordering::Acquire)),
        (ROUNDS, ROUNDS * WAITERS),
        "a waiter slept while its completion was queued"
    );
}

/// The same QP pair reset and connected again, round after round, the way a QP cache reuses
/// QPs: rounds without traffic (the listening side may not even have read the connection's
/// HELLO before both QPs are reset) alternate with rounds whose traffic must flow. A connection
/// of an earlier incarnation must never be taken for the current one.
#[test]
fn reset_and_reconnect_of_the_same_pair_ignores_earlier_incarnations() {
    const ROUNDS: usize = 2000;
    let (ca, cb) = (open("thread"), open("thread"));
    let a = side(&ca, QpCaps::default(), AccessFlags::ALL);
    let b = side(&cb, QpCaps::default(), AccessFlags::ALL);
    let sge = [a.mr.sge(0, 32).unwrap()];
    for round in 0..ROUNDS {
        for s in [&a, &b] {
            if s.qp.state() != QpState::Reset {
                s.qp.modify(&QpAttr::reset()).unwrap();
            }
        }
        // Either side connects first in turn.
        if round % 4 < 2 {
            connect_qps(&a.qp, &b.qp);
        } else {
            connect_qps(&b.qp, &a.qp);
        }
        if round % 2 == 0 {
            continue;
        }
        let id = round as u64;
        b.qp.post_recv(&[RecvWr::new(id, &[b.mr.sge(0, 64).unwrap()])])
            .unwrap();
        a.qp.post_send(&[SendWr::new(id, &sge, WrOpcode::Send)])
            .unwrap();
        let (sent, got) = (wait(&a.cq, 1)[0], wait(&b.cq, 1)[0]);
        assert_eq!(
            (sent.wr_id, sent.status, got.wr_id, got.status),
            (id, WcStatus::Success, id, WcStatus::Success),
            "round {round}: QP states {:?} / {:?}",
            a.qp.state(),
            b.qp.state()
        );
    }
}

/// The accepting side checks both incarnations a HELLO names: a connection opened towards an
/// earlier incarnation of its QP (reset since) is closed even before RTR, one from an
/// incarnation of the peer other than the one named at RTR is closed, and the right one is
/// attached (its close then fails the QP).
#[test]
fn hello_for_or_from_another_incarnation_is_closed() {
    let ctx = open("thread");
    let b = side(&ctx, QpCaps::default(), AccessFlags::ALL);
    let addr = ctx.query_port(1).unwrap().address;
    let incarnation = |ep: &QpEndpoint| ep.extra["incarnation"].parse::<u32>().unwrap();
    let before = incarnation(&b.qp.endpoint());
    b.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    b.qp.modify(&QpAttr::reset()).unwrap();
    let now = incarnation(&b.qp.endpoint());
    assert_ne!(before, now, "RESET gives the QP a new incarnation");
    const PEER_QPN: u32 = 0x00ff_fff1;
    let hello = |src_incarnation: u32, dst_incarnation: u32| {
        let mut s = TcpStream::connect(&addr).unwrap();
        let buf = hello_frame(
            (b.qp.qp_num().0, dst_incarnation),
            (PEER_QPN, src_incarnation),
        );
        s.write_all(&buf).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s
    };
    let closed_by_context = |mut s: TcpStream| s.read(&mut [0u8; 1]).unwrap_or(0) == 0;
    b.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    assert!(
        closed_by_context(hello(7, before)),
        "HELLO for the earlier incarnation"
    );
    // The peer: a lower address than the context's, so the context waits for its connection.
    let mut peer = QpEndpoint {
        address: "127.0.0.1:1".into(),
        qp_num: QpNum(PEER_QPN),
        ..b.qp.endpoint()
    };
    peer.extra.insert("incarnation".into(), "7".into());
    b.qp.modify(&QpAttr::rtr(peer)).unwrap();
    assert!(
        closed_by_context(hello(8, now)),
        "HELLO from another incarnation of the peer"
    );
    assert_eq!(b.qp.state(), QpState::Rtr);
    let s = hello(7, now);
    b.qp.post_recv(&[RecvWr::new(1, &[])]).unwrap();
    drop(s);
    let wc = wait(&b.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::WrFlushed));
    wait_state(&b.qp, QpState::Error);
}

/// Large SEND, SEND_IMM, WRITE and WRITE_IMM in flight together, gathered from several SGEs
/// (sent straight from registered memory) and scattered over several receive SGEs (received
/// straight into them), in both progress modes: every byte lands where it belongs, in order,
/// with the right completions, and the bytes around each destination stay untouched.
#[test]
fn large_messages_go_straight_between_registered_buffers() {
    for mode in ["thread", "busy"] {
        let (a, b) = pair_in(&open(mode), &open(mode));
        let len = 6 << 20;
        let (big_a, big_b, pattern) = big_regions(&a, &b, len);
        // Sender SGEs: three pieces of the pattern at odd offsets (700_001 bytes).
        let src = [
            big_a.sge(1, 100_000).unwrap(),
            big_a.sge(300_007, 250_000).unwrap(),
            big_a.sge(900_013, 350_001).unwrap(),
        ];
        let src_bytes: Vec<u8> = [(1, 100_000), (300_007, 250_000), (900_013, 350_001)]
            .iter()
            .flat_map(|&(o, l)| pattern[o..o + l].to_vec())
            .collect();
        // Receive SGEs: three pieces of big_b, the last larger than needed.
        let dst = [
            (2_000_000usize, 123_457usize),
            (2_500_000, 400_000),
            (3_000_000, 500_000),
        ];
        let recv_sges: Vec<Sge> = dst
            .iter()
            .map(|&(o, l)| big_b.sge(o, l as u32).unwrap())
            .collect();
        let one_mib = [big_a.sge(0, 1 << 20).unwrap()];
        let second = [big_b.sge(4 << 20, 1 << 20).unwrap()];
        b.qp.post_recv(&[
            RecvWr::new(1, &recv_sges),
            RecvWr::new(2, &second),
            RecvWr::new(3, &[]),
        ])
        .unwrap();
        a.qp.post_send(&[
            SendWr::new(10, &src, WrOpcode::Send),
            SendWr::new(11, &one_mib, WrOpcode::SendWithImm { imm: 0xabcd }),
            SendWr::new(
                12,
                &src,
                WrOpcode::Write {
                    remote: big_b.remote(5 << 20),
                },
            ),
            SendWr::new(
                13,
                &one_mib,
                WrOpcode::WriteWithImm {
                    remote: big_b.remote(0),
                    imm: 42,
                },
            ),
        ])
        .unwrap();
        let sent = wait(&a.cq, 4);
        assert_eq!(
            sent.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            (10..14).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>(),
            "{mode}"
        );
        let got = wait(&b.cq, 3);
        assert_eq!(
            got.iter()
                .map(|w| (w.wr_id, w.status, w.opcode, w.byte_len, w.imm_data))
                .collect::<Vec<_>>(),
            vec![
                (1, WcStatus::Success, WcOpcode::Recv, 700_001, None),
                (2, WcStatus::Success, WcOpcode::Recv, 1 << 20, Some(0xabcd)),
                (
                    3,
                    WcStatus::Success,
                    WcOpcode::RecvRdmaWithImm,
                    1 << 20,
                    Some(42)
                ),
            ],
            "{mode}"
        );
        let mut mem = vec![0u8; len];
        big_b.read_at(0, &mut mem).unwrap();
        // The scattered SEND, and nothing past its end.
        let mut at = 0;
        for &(o, l) in &dst {
            let n = l.min(src_bytes.len() - at);
            assert!(
                mem[o..o + n] == src_bytes[at..at + n],
                "{mode}: SEND at {o}"
            );
            assert!(
                mem[o + n..o + l].iter().all(|&x| x == 0),
                "{mode}: past {o}"
            );
            assert_eq!(mem[o - 1], 0, "{mode}: before {o}");
            at += n;
        }
        assert_eq!(at, src_bytes.len());
        assert!(
            mem[4 << 20..5 << 20] == pattern[..1 << 20],
            "{mode}: SEND_IMM"
        );
        assert!(mem[..1 << 20] == pattern[..1 << 20], "{mode}: WRITE_IMM");
        assert!(
            mem[1 << 20..2_000_000].iter().all(|&x| x == 0),
            "{mode}: past it"
        );
        let w = 5 << 20;
        assert!(
            mem[w..w + src_bytes.len()] == src_bytes[..],
            "{mode}: WRITE"
        );
        assert_eq!(mem[w + src_bytes.len()], 0, "{mode}: past the WRITE");

        // A SEND, then two large READs into three SGEs each (served straight from b's memory,
        // placed straight into a's), then a READ with a bad rkey: completions in order.
        big_a.write_at(0, &vec![0u8; len]).unwrap();
        b.qp.post_recv(&[RecvWr::new(4, &[b.mr.sge(0, 64).unwrap()])])
            .unwrap();
        let local = |base: usize| {
            [
                big_a.sge(base, 100_000).unwrap(),
                big_a.sge(base + 200_000, 300_000).unwrap(),
                big_a.sge(base + 600_000, 648_576).unwrap(),
            ]
        };
        let (l1, l2) = (local(0), local(3 << 20));
        let mut bad = big_b.remote(0);
        bad.rkey = Rkey(bad.rkey.0 ^ 0x5a5a);
        a.qp.post_send(&[
            SendWr::new(20, &[a.mr.sge(0, 8).unwrap()], WrOpcode::Send),
            SendWr::new(
                21,
                &l1,
                WrOpcode::Read {
                    remote: big_b.remote(4 << 20),
                },
            ),
            SendWr::new(
                22,
                &l2,
                WrOpcode::Read {
                    remote: big_b.remote(0),
                },
            ),
            SendWr::new(23, &l2[..1], WrOpcode::Read { remote: bad }),
        ])
        .unwrap();
        let done = wait(&a.cq, 4);
        assert_eq!(
            done.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            vec![
                (20, WcStatus::Success),
                (21, WcStatus::Success),
                (22, WcStatus::Success),
                (23, WcStatus::RemoteAccess)
            ],
            "{mode}"
        );
        assert_eq!(done[1].byte_len, 1 << 20);
        assert_eq!(wait(&b.cq, 1)[0].wr_id, 4);
        let mut back = vec![0u8; len];
        big_a.read_at(0, &mut back).unwrap();
        let pieces = |base: usize| {
            [
                (base, 100_000),
                (base + 200_000, 300_000),
                (base + 600_000, 648_576),
            ]
        };
        for (base, from) in [(0usize, &mem[4 << 20..5 << 20]), (3 << 20, &mem[..1 << 20])] {
            let mut at = 0;
            for (o, l) in pieces(base) {
                assert!(back[o..o + l] == from[at..at + l], "{mode}: READ into {o}");
                assert_eq!(back[o + l], 0, "{mode}: past {o}");
                at += l;
            }
        }
    }
}

/// A large SEND that cannot be placed (no receive yet, then one too small) is answered as a
/// small one is: RNR until a receive is posted, and a receive too small fails both sides.
#[test]
fn large_send_without_a_fitting_receive_keeps_rc_semantics() {
    let ctx_a = open("thread");
    let ctx_b = open("thread");
    let a = side(&ctx_a, QpCaps::default(), AccessFlags::ALL);
    let b = side(&ctx_b, QpCaps::default(), AccessFlags::ALL);
    connect_with_rnr_retry(&a, &b, 7);
    let len = 2 << 20;
    let (big_a, big_b, pattern) = big_regions(&a, &b, len);
    a.qp.post_send(&[SendWr::new(
        1,
        &[big_a.sge(0, 1 << 20).unwrap()],
        WrOpcode::Send,
    )])
    .unwrap();
    // Let a few RNR rounds happen (no assertion on timing).
    std::thread::sleep(Duration::from_millis(20));
    assert_no_completion(&a.cq);
    b.qp.post_recv(&[RecvWr::new(9, &[big_b.sge(0, 1 << 20).unwrap()])])
        .unwrap();
    let wc = wait(&b.cq, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (9, WcStatus::Success, 1 << 20)
    );
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let mut got = vec![0u8; 1 << 20];
    big_b.read_at(0, &mut got).unwrap();
    assert!(got == pattern[..1 << 20]);

    // One byte too many for the receive.
    b.qp.post_recv(&[RecvWr::new(10, &[big_b.sge(0, 300_000).unwrap()])])
        .unwrap();
    a.qp.post_send(&[SendWr::new(
        2,
        &[big_a.sge(0, 300_001).unwrap()],
        WrOpcode::Send,
    )])
    .unwrap();
    let wc = wait(&b.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (10, WcStatus::LocalLength));
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemoteInvalidRequest);
}

/// A large WRITE to a bad rkey or beyond its region is refused without touching memory, and
/// a large SEND drawn from an SRQ lands in the SRQ's buffer.
#[test]
fn large_write_errors_and_srq_sends() {
    let (a, b) = pair();
    let len = 2 << 20;
    let (big_a, big_b, pattern) = big_regions(&a, &b, len);
    let src = [big_a.sge(0, 1 << 20).unwrap()];
    let mut beyond = big_b.remote(1 << 20);
    beyond.addr += 1;
    a.qp.post_send(&[SendWr::new(1, &src, WrOpcode::Write { remote: beyond })])
        .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::RemoteAccess);
    let mut got = vec![0u8; len];
    big_b.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 0), "memory untouched");

    let ca = open("busy");
    let cb = open("busy");
    let pd = cb.alloc_pd().unwrap();
    let cq = cb.create_cq(64).unwrap();
    let srq = pd
        .create_srq(&SrqInitAttr {
            max_wr: 8,
            max_sge: 2,
            srq_limit: 0,
        })
        .unwrap();
    let mr = pd.alloc_mr(len, AccessFlags::ALL).unwrap();
    let mut init = QpInitAttr::new(&cq);
    init.srq = Some(&srq);
    let t = pd.create_qp(&init).unwrap();
    let s = side(&ca, QpCaps::default(), AccessFlags::ALL);
    let big_s = s.pd.alloc_mr(len, AccessFlags::ALL).unwrap();
    big_s.write_at(0, &pattern).unwrap();
    s.qp.connect(&t.endpoint(), AccessFlags::ALL).unwrap();
    t.connect(&s.qp.endpoint(), AccessFlags::ALL).unwrap();
    srq.post_recv(&[RecvWr::new(
        5,
        &[mr.sge(0, 1000).unwrap(), mr.sge(4096, 1 << 20).unwrap()],
    )])
    .unwrap();
    s.qp.post_send(&[SendWr::new(
        6,
        &[big_s.sge(0, 1 << 20).unwrap()],
        WrOpcode::Send,
    )])
    .unwrap();
    assert_eq!(wait(&s.cq, 1)[0].status, WcStatus::Success);
    let wc = wait(&cq, 1)[0];
    assert_eq!((wc.wr_id, wc.byte_len), (5, 1 << 20));
    let mut got = vec![0u8; (1 << 20) - 1000];
    mr.read_at(4096, &mut got).unwrap();
    assert!(got == pattern[1000..1 << 20]);
    let mut head = vec![0u8; 1000];
    mr.read_at(0, &mut head).unwrap();
    assert!(head == pattern[..1000]);
}

/// Busy mode with an active poller on the responder: READ responses far larger than the socket
/// buffers keep flowing to the end of the burst. The ACK timeout is made huge so output that
/// waited for input that never comes (the requester has nothing more to send) would hang the
/// test instead of being rescued by a resend.
#[test]
fn busy_responder_with_an_active_poller_keeps_sending_when_the_socket_fills() {
    let opts = [
        ("progress", "busy"),
        ("min_ack_timeout_ms", "3600000"),
        ("sndbuf", "65536"),
        ("rcvbuf", "65536"),
    ];
    let ca = fixture::open("tcp0", &opts);
    let cb = fixture::open("tcp0", &opts);
    let (a, b) = pair_in(&ca, &cb);
    let len = 1 << 20;
    let (big_a, big_b, pattern) = big_regions(&a, &b, len);
    big_b.write_at(0, &pattern).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poller = {
        let cq = b.cq.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut buf = [WorkCompletion::EMPTY; 4];
            let mut spins = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = cq.poll(&mut buf);
                spins += 1;
                if spins % 256 == 0 {
                    std::thread::yield_now();
                }
            }
        })
    };
    let sge = [big_a.sge(0, len as u32).unwrap()];
    let read = WrOpcode::Read {
        remote: big_b.remote(0),
    };
    for round in 0..3u64 {
        let wrs: Vec<SendWr<'_>> = (0..8)
            .map(|i| SendWr::new(round * 8 + i, &sge, read))
            .collect();
        a.qp.post_send(&wrs).unwrap();
        let done = wait(&a.cq, 8);
        assert!(
            done.iter().all(|w| w.status == WcStatus::Success),
            "{done:?}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    poller.join().unwrap();
    let mut got = vec![0u8; len];
    big_a.read_at(0, &mut got).unwrap();
    assert!(got == pattern);
}

#[test]
fn socket_buffer_options_are_parsed() {
    for (k, v) in [("sndbuf", "lots"), ("rcvbuf", "-1")] {
        let mut cfg = DeviceConfig::default();
        cfg.options.insert(k.into(), v.into());
        assert!(
            matches!(
                Context::open_with("tcp0", &cfg),
                Err(VerbsError::InvalidArgument(_))
            ),
            "{k} = {v}"
        );
    }
    let ctx = fixture::open("tcp0", &[("sndbuf", "262144"), ("rcvbuf", "0")]);
    let (a, b) = pair_in(&ctx, &open("thread"));
    b.qp.post_recv(&[RecvWr::new(1, &[b.mr.sge(0, 8).unwrap()])])
        .unwrap();
    a.qp.post_send(&[SendWr::new(2, &[a.mr.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
}

/// Once `modify` has moved a QP to ERROR, no peer READ or WRITE through it is still being
/// served (`crate::soft::testing::accesses_past_error`).
#[test]
fn a_qp_moved_to_error_lets_no_peer_access_run_on() {
    let torn = fixture::accesses_past_error(16, || {
        let (a, b) = pair();
        ((a.pd, a.cq, a.qp), (b.pd, b.qp))
    });
    assert!(torn.is_empty(), "{torn:?}");
}
