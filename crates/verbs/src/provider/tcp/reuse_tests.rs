//! The reuse of data connections (see `held.rs`): a QP from a cache that connects again to a
//! QP of the same context sends its HELLO on the connection it opened before; what the old use
//! left in flight never reaches the new one; bad bytes on a kept connection close it alone.
//! Wire-level tests play one end themselves.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;

use super::tests::{connect_to, engine, expect_hello, fake_peer_at, hello_frame};
use crate::soft::testing::{self as fixture, connect_with, wait, wait_state, Side, WAIT};
use crate::soft::wire::{self, Frame};
use crate::*;

fn open() -> Context {
    fixture::open("tcp0", &[("progress", "thread")])
}

fn side(ctx: &Context) -> Side {
    fixture::side(ctx, 256, QpCaps::default(), AccessFlags::ALL)
}

fn addr(ctx: &Context) -> SocketAddr {
    ctx.query_port(1).unwrap().address.parse().unwrap()
}

/// (connections opened, kept connections used again) by the QPs of `ctx`.
fn counts(ctx: &Context) -> (u64, u64) {
    let e = engine(ctx);
    (
        e.conns_opened.load(Ordering::Relaxed),
        e.conns_reused.load(Ordering::Relaxed),
    )
}

/// Kept connections on which a QP of `ctx` found the peer's HELLO at RTR.
fn found(ctx: &Context) -> u64 {
    engine(ctx).hellos_found.load(Ordering::Relaxed)
}

/// Wait until `ctx` keeps `n` clean connections, unwatched for input.
fn wait_quiet(ctx: &Context, n: usize) {
    let deadline = std::time::Instant::now() + WAIT;
    while engine(ctx).quiet_conns() != n {
        assert!(
            std::time::Instant::now() < deadline,
            "{} quiet connections, not {n}",
            engine(ctx).quiet_conns()
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Two contexts (the first opens the connections) and a QP on each, connected, that used
/// their connection once.
fn used_pair() -> (Context, Context, Side, Side) {
    let (lo, hi) = contexts();
    let (a, b) = (side(&lo), side(&hi));
    connect_with(&a, &b, QpAttr::rts);
    exchange(&a, &b, 0);
    (lo, hi, a, b)
}

/// Both QPs leave their connection cleanly, and both contexts keep it, unwatched for input.
fn leave_clean(lo: &Context, hi: &Context, a: &Side, b: &Side) {
    retire(a);
    retire(b);
    wait_quiet(lo, 1);
    wait_quiet(hi, 1);
}

/// One side's part of a connect: INIT, RTR and RTS towards `remote`.
fn reach_rts(s: &Side, remote: &Side) {
    reach_rts_towards(s, remote.qp.endpoint());
}

/// INIT, RTR and RTS towards the QP at `remote`.
fn reach_rts_towards(s: &Side, remote: QpEndpoint) {
    s.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    s.qp.modify(&QpAttr::rtr(remote)).unwrap();
    s.qp.modify(&QpAttr::rts()).unwrap();
}

fn incarnation(qp: &QueuePair) -> u32 {
    qp.endpoint().extra["incarnation"].parse().unwrap()
}

/// Two contexts; the QPs of the first open the connections (its address is the lower).
fn contexts() -> (Context, Context) {
    let (x, y) = (open(), open());
    if addr(&x) < addr(&y) {
        (x, y)
    } else {
        (y, x)
    }
}

/// What a QP cache does before a QP serves another connection: ERROR, then RESET.
fn retire(s: &Side) {
    if s.qp.state() == QpState::Reset {
        return;
    }
    if s.qp.state() != QpState::Error {
        s.qp.modify(&QpAttr::error()).unwrap();
    }
    s.qp.modify(&QpAttr::reset()).unwrap();
}

/// `from` sends `id` as the 8 bytes at the start of its region, with wr_id `id`.
fn send_id(from: &Side, id: u64) {
    from.mr.write_at(0, &id.to_le_bytes()).unwrap();
    from.qp
        .post_send(&[SendWr::new(
            id,
            &[from.mr.sge(0, 8).unwrap()],
            WrOpcode::Send,
        )])
        .unwrap();
}

/// 8 bytes each way, checked byte for byte.
fn exchange(a: &Side, b: &Side, tag: u64) {
    for (from, to, id) in [(a, b, tag * 2), (b, a, tag * 2 + 1)] {
        to.qp
            .post_recv(&[RecvWr::new(id, &[to.mr.sge(1024, 8).unwrap()])])
            .unwrap();
        send_id(from, id);
        expect_delivered(from, to, id);
    }
}

/// The 8-byte SEND `id` (carrying `id`) from `from` completed at both ends, into `to`'s
/// receive at offset 1024, byte for byte.
fn expect_delivered(from: &Side, to: &Side, id: u64) {
    let (sent, got) = (wait(&from.cq, 1)[0], wait(&to.cq, 1)[0]);
    assert_eq!(
        (sent.wr_id, sent.status, got.wr_id, got.status, got.byte_len),
        (id, WcStatus::Success, id, WcStatus::Success, 8)
    );
    let mut back = [0u8; 8];
    to.mr.read_at(1024, &mut back).unwrap();
    assert_eq!(u64::from_le_bytes(back), id, "message {id}");
}

#[test]
fn a_cached_qp_reconnects_over_the_connection_it_opened_to_any_qp_of_that_context() {
    let (lo, hi) = contexts();
    let a = side(&lo);
    let (b1, b2) = (side(&hi), side(&hi));
    connect_with(&a, &b1, QpAttr::rts);
    exchange(&a, &b1, 0);
    assert_eq!(counts(&lo), (1, 0));
    const ROUNDS: u64 = 20;
    for round in 1..=ROUNDS {
        for s in [&a, &b1, &b2] {
            retire(s);
        }
        // The peer QP changes every round; its context stays.
        let b = if round % 2 == 0 { &b1 } else { &b2 };
        // Either end reaches RTR first.
        if round % 4 < 2 {
            connect_with(&a, b, QpAttr::rts);
        } else {
            connect_with(b, &a, QpAttr::rts);
        }
        exchange(&a, b, round);
    }
    assert_eq!(
        counts(&lo),
        (1, ROUNDS),
        "one connection, used again every round"
    );
    assert_eq!(counts(&hi), (0, 0), "the higher context opens none");
    // A new QP opens its own connection.
    let c = side(&lo);
    retire(&b1);
    connect_with(&c, &b1, QpAttr::rts);
    exchange(&c, &b1, 99);
    assert_eq!(counts(&lo), (2, ROUNDS));
}

/// The accepting end may reach RTR towards a cached QP while its kept connection is still
/// another QP's there (that QP has not read the opener's BYE yet): nothing to take at RTR. The
/// connection, kept once that QP lets go of it, must stay watched for input, so that the
/// HELLO the opener then writes on it reaches the waiting QP, not lie unread behind a
/// connection watched only for the peer closing (the opener would retry into it until its
/// QP fails).
#[test]
fn a_qp_that_reached_rtr_before_its_connection_was_kept_gets_the_hello_written_on_it() {
    let (lo, hi, a, b1) = used_pair();
    let b2 = side(&hi);
    let reader = engine(&hi)
        .qps
        .get(b1.qp.qp_num().0)
        .expect("b1 in the table");
    reader.with_reader_held(|| {
        // a leaves and comes back from its cache; its BYE waits for b1's reader.
        retire(&a);
        b2.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
        b2.qp.modify(&QpAttr::rtr(a.qp.endpoint())).unwrap();
        b2.qp.modify(&QpAttr::rts()).unwrap();
    });
    drop(reader);
    // b1 reads the BYE and lets go of the connection; the opening end reads b1's BYE.
    wait_state(&b1.qp, QpState::Error);
    wait_quiet(&lo, 1);
    reach_rts(&a, &b2);
    exchange(&a, &b2, 1);
    assert_eq!(
        counts(&lo),
        (1, 1),
        "the kept connection carries the new use"
    );
    assert_eq!(engine(&hi).quiet_conns(), 0);
}

/// Kept connections a QP of `ctx` took at RTR with no HELLO written or found.
fn spared(ctx: &Context) -> u64 {
    engine(ctx).hellos_spared.load(Ordering::Relaxed)
}

/// The next use of a kept connection: an opening end first at RTR writes the HELLO, which lies
/// unread — no thread of the other context wakes for it — until the QP there reaches RTR and
/// finds it. An accepting end first at RTR writes none: an opening QP given the accepting
/// QP's endpoint as read after that RTR (it names the connection) takes the connection
/// without one either; given the endpoint from before, it writes its HELLO, which the
/// accepting QP skips; and if the accepting QP posts a request before the opening one reached
/// RTR, its HELLO goes first, and the opening QP finds it at RTR.
#[test]
fn the_first_end_at_rtr_greets_unless_it_accepts_and_the_peer_reads_its_endpoint_after() {
    let (lo, hi, a, b) = used_pair();
    const ROUNDS: u64 = 8;
    for round in 1..=ROUNDS {
        // Clean at both ends: nothing is watched for until the next use.
        leave_clean(&lo, &hi, &a, &b);
        let before = (found(&lo), found(&hi), spared(&lo), spared(&hi));
        let delta = || {
            (
                found(&lo) - before.0,
                found(&hi) - before.1,
                spared(&lo) - before.2,
                spared(&hi) - before.3,
            )
        };
        match round % 4 {
            0 => {
                // The opening end first: its HELLO waits, found by the accepting end's RTR.
                reach_rts(&a, &b);
                std::thread::sleep(std::time::Duration::from_millis(20));
                assert_eq!(engine(&hi).quiet_conns(), 1, "round {round}: unread");
                reach_rts(&b, &a);
                assert_eq!(delta(), (0, 1, 0, 0), "round {round}");
                exchange(&a, &b, round);
            }
            1 | 2 => {
                // The accepting end first: nothing is written on the connection.
                let early = a.qp.endpoint();
                let b_before = b.qp.endpoint();
                reach_rts(&b, &a);
                assert!(!b_before.extra.contains_key(super::qp::KEPT_FROM_KEY));
                let named = b.qp.endpoint();
                assert!(
                    named.extra.contains_key(super::qp::KEPT_FROM_KEY),
                    "round {round}: the endpoint after RTR names the connection"
                );
                std::thread::sleep(std::time::Duration::from_millis(20));
                assert_eq!(engine(&lo).quiet_conns(), 1, "round {round}: nothing came");
                if round % 4 == 1 {
                    reach_rts_towards(&a, named);
                    assert_eq!(delta(), (0, 0, 1, 1), "round {round}: no HELLO either way");
                } else {
                    // The endpoint as read before: a writes its HELLO, b skips it.
                    reach_rts_towards(&a, b_before);
                    assert_eq!(delta(), (0, 0, 0, 1), "round {round}: a's HELLO");
                }
                assert_eq!(early.qp_num, a.qp.qp_num());
                exchange(&a, &b, round);
            }
            _ => {
                // The accepting end first, and it sends before the opening end's RTR: its HELLO
                // precedes the SEND, and the opening end finds it.
                reach_rts(&b, &a);
                let id = round * 2;
                send_before_peer_rtr(&b, &a, id, || b.qp.endpoint());
                assert_eq!(delta(), (1, 0, 0, 1), "round {round}: b's HELLO found");
                expect_delivered(&b, &a, id);
                exchange(&a, &b, round);
            }
        }
    }
    assert_eq!(counts(&lo), (1, ROUNDS), "one connection all along");
}

/// `from` (at RTS) sends `id` as 8 bytes before `to` reaches RTR: the frames are on the
/// connection (20 ms) when `to` goes to RTS towards the endpoint `towards` gives then, with a
/// receive for them posted at INIT.
fn send_before_peer_rtr(from: &Side, to: &Side, id: u64, towards: impl FnOnce() -> QpEndpoint) {
    send_id(from, id);
    std::thread::sleep(std::time::Duration::from_millis(20));
    to.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    to.qp
        .post_recv(&[RecvWr::new(id, &[to.mr.sge(1024, 8).unwrap()])])
        .unwrap();
    to.qp.modify(&QpAttr::rtr(towards())).unwrap();
    to.qp.modify(&QpAttr::rts()).unwrap();
}

/// An opening QP given an endpoint that names the kept connection takes it without reading it
/// at RTR (no system call on the connect's path). The endpoint may be older than what the
/// accepting QP did since: here it posts a request after its endpoint was read, so its owed
/// HELLO and the SEND are on the connection before the opening QP's RTR. The opening QP's
/// reader skips that HELLO as the use's first frame and the SEND arrives whole; then the pair
/// exchanges both ways. (Reading the connection at RTR, the opening QP found the HELLO there:
/// counted as found, not spared.)
#[test]
fn an_opening_qp_takes_a_named_connection_unread_and_skips_the_hello_written_since() {
    let (lo, hi, a, b) = used_pair();
    const ROUNDS: u64 = 6;
    for round in 1..=ROUNDS {
        leave_clean(&lo, &hi, &a, &b);
        let before = (found(&lo), found(&hi), spared(&lo), spared(&hi));
        reach_rts(&b, &a);
        let named = b.qp.endpoint();
        assert!(
            named.extra.contains_key(super::qp::KEPT_FROM_KEY),
            "round {round}: the endpoint after RTR names the connection"
        );
        let id = round * 2;
        send_before_peer_rtr(&b, &a, id, || named);
        let delta = (
            found(&lo) - before.0,
            found(&hi) - before.1,
            spared(&lo) - before.2,
            spared(&hi) - before.3,
        );
        assert_eq!(
            delta,
            (0, 0, 1, 1),
            "round {round}: taken unread at both ends"
        );
        expect_delivered(&b, &a, id);
        let mut got = [0u8; 8];
        a.mr.read_at(1024, &mut got).unwrap();
        assert_eq!(got, id.to_le_bytes(), "round {round}: the SEND's bytes");
        exchange(&a, &b, round);
    }
    assert_eq!(counts(&lo), (1, ROUNDS), "one connection all along");
}

/// Both ends reach RTR before either HELLO arrives: both write one, and each skips the
/// other's as the first frame of the use. Rounds with both ends connecting at once, from two
/// threads, must each exchange exactly their own bytes.
#[test]
fn both_ends_at_rtr_at_once_each_skip_the_other_hello() {
    let (lo, hi, a, b) = used_pair();
    const ROUNDS: u64 = 100;
    for round in 1..=ROUNDS {
        leave_clean(&lo, &hi, &a, &b);
        let go = std::sync::Barrier::new(2);
        std::thread::scope(|t| {
            t.spawn(|| {
                go.wait();
                reach_rts(&b, &a);
            });
            go.wait();
            reach_rts(&a, &b);
        });
        exchange(&a, &b, round);
    }
    assert_eq!(counts(&lo), (1, ROUNDS));
    assert!(found(&lo) + found(&hi) <= ROUNDS);
}

/// Rounds that leave with requests in flight (large SENDs and WRITEs) alternate with
/// rounds that leave once everything completed; after each, the pair connects again and an
/// exchange must see exactly its own bytes. A connection left with something half-read or
/// half-written is closed (the next round opens one); one left idle is used again.
#[test]
fn what_a_leaving_qp_left_in_flight_never_reaches_the_next_use() {
    let (lo, hi) = contexts();
    let (a, b) = (side(&lo), side(&hi));
    const N: usize = 8;
    const LEN: usize = 1 << 20;
    let big_a = a.pd.alloc_mr(N * LEN, AccessFlags::ALL).unwrap();
    let big_b = b.pd.alloc_mr(N * LEN, AccessFlags::ALL).unwrap();
    big_a.write_at(0, &vec![0x5a; N * LEN]).unwrap();
    const ROUNDS: u64 = 60;
    let mut idle_leaves = 0;
    for round in 0..ROUNDS {
        connect_with(&a, &b, QpAttr::rts);
        exchange(&a, &b, round);
        // SENDs of 1 MiB into posted receives and WRITEs of 1 MiB: more than the sockets
        // hold, so a QP that leaves at once leaves something half-written or half-read.
        for i in 0..N {
            let off = i * LEN;
            let local = [big_a.sge(off, LEN as u32).unwrap()];
            if i % 2 == 0 {
                b.qp.post_recv(&[RecvWr::new(
                    i as u64,
                    &[big_b.sge(off, LEN as u32).unwrap()],
                )])
                .unwrap();
                a.qp.post_send(&[SendWr::new(i as u64, &local, WrOpcode::Send)])
                    .unwrap();
            } else {
                let op = WrOpcode::Write {
                    remote: big_b.remote(off),
                };
                a.qp.post_send(&[SendWr::new(i as u64, &local, op)])
                    .unwrap();
            }
        }
        let idle = round % 3 == 0;
        if idle {
            // Everything completes before the QPs leave.
            assert!(wait(&a.cq, N)
                .iter()
                .all(|wc| wc.status == WcStatus::Success));
            assert!(wait(&b.cq, N / 2)
                .iter()
                .all(|wc| wc.status == WcStatus::Success));
            idle_leaves += 1;
        }
        // Either end leaves first.
        let (first, second) = if round % 2 == 0 { (&a, &b) } else { (&b, &a) };
        retire(first);
        retire(second);
        if !idle {
            // Every request and receive completes, successfully or flushed.
            wait(&a.cq, N);
            wait(&b.cq, N / 2);
        }
        for s in [&a, &b] {
            let mut rest = [WorkCompletion::EMPTY; 4];
            assert_eq!(s.cq.poll(&mut rest).unwrap(), 0, "stray {:?}", &rest[..1]);
        }
    }
    connect_with(&a, &b, QpAttr::rts);
    exchange(&a, &b, ROUNDS);
    let (opened, reused) = counts(&lo);
    assert_eq!(opened + reused, ROUNDS + 1);
    assert!(
        reused >= idle_leaves,
        "a connection left idle is used again: {reused} reused, {idle_leaves} idle leaves"
    );
}

/// A BYE frame from a peer QP `src_qpn` to `dst_qpn`.
fn bye(dst_qpn: u32, src_qpn: u32) -> Vec<u8> {
    let mut out = Vec::new();
    wire::encode(
        &Frame::Bye {
            dst_qpn,
            src_qpn,
            src_incarnation: 1,
        },
        &mut out,
    );
    out
}

/// A 0-byte SEND to `qp`, the first request of the use (at the PSN its endpoint names).
fn empty_send(qp: &QueuePair) -> Vec<u8> {
    let mut out = Vec::new();
    wire::encode(
        &Frame::Request(wire::Request {
            qpn: qp.qp_num().0,
            psn: qp.endpoint().psn,
            solicited: false,
            op: wire::RequestOp::Send {
                imm: None,
                payload: &[],
            },
        }),
        &mut out,
    );
    out
}

fn read_frame(s: &mut TcpStream, len: usize) -> Frame<'static> {
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf).unwrap();
    let buf: &'static [u8] = Box::leak(buf.into_boxed_slice());
    wire::decode(buf, 0).unwrap().unwrap().0
}

/// The peer leaves with a BYE: the QP fails (flushing a receive) and answers with its own.
fn peer_leaves(s: &mut TcpStream, victim: &Side, wr_id: u64) {
    victim.qp.post_recv(&[RecvWr::new(wr_id, &[])]).unwrap();
    s.write_all(&bye(victim.qp.qp_num().0, 77)).unwrap();
    let wc = wait(&victim.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::WrFlushed));
    wait_state(&victim.qp, QpState::Error);
    match read_frame(s, wire::HEADER_LEN + 8) {
        Frame::Bye {
            dst_qpn, src_qpn, ..
        } => assert_eq!((dst_qpn, src_qpn), (77, victim.qp.qp_num().0)),
        f => panic!("expected BYE, got {f:?}"),
    }
}

/// The test is the accepting end (a listener at 127.0.0.2, above the context's 127.0.0.1).
#[test]
fn the_opening_end_sends_its_next_hello_on_the_clean_connection_and_closes_it_on_stray_bytes() {
    let ctx = open();
    let victim = side(&ctx);
    let (listener, mut s) = fake_peer_at(&victim.qp);
    let peer = listener.local_addr().unwrap();
    peer_leaves(&mut s, &victim, 1);
    victim.qp.modify(&QpAttr::reset()).unwrap();
    connect_to(&victim.qp, peer);
    expect_hello(&mut s, &victim.qp);
    listener.set_nonblocking(true).unwrap();
    assert!(listener.accept().is_err(), "no new connection");
    assert_eq!(counts(&ctx), (1, 1));
    // Left again, then bytes that are no HELLO: the next RTR, which reads them, closes the
    // connection and opens a new one.
    peer_leaves(&mut s, &victim, 2);
    s.write_all(&[0xff; 8]).unwrap();
    victim.qp.modify(&QpAttr::reset()).unwrap();
    listener.set_nonblocking(false).unwrap();
    connect_to(&victim.qp, peer);
    assert_eq!(
        s.read(&mut [0u8; 1]).unwrap_or(1),
        0,
        "closed by the context"
    );
    let (mut s2, _) = listener.accept().unwrap();
    s2.set_read_timeout(Some(WAIT)).unwrap();
    expect_hello(&mut s2, &victim.qp);
    assert_eq!(counts(&ctx), (2, 1));
}

/// The test is the opening end (its QP "lives" at 127.0.0.1:1, below the context).
#[test]
fn the_accepting_end_skips_what_preceded_the_bye_and_takes_the_next_hello() {
    const PEER_QPN: u32 = 0x00ff_fff1;
    let ctx = open();
    let b = side(&ctx);
    let incarnation = || b.qp.endpoint().extra["incarnation"].parse::<u32>().unwrap();
    let hello = |src_incarnation: u32, dst_incarnation: u32| {
        hello_frame(
            (b.qp.qp_num().0, dst_incarnation),
            (PEER_QPN, src_incarnation),
        )
    };
    let rtr = |peer_incarnation: u32| {
        let mut peer = QpEndpoint {
            address: "127.0.0.1:1".into(),
            qp_num: QpNum(PEER_QPN),
            ..b.qp.endpoint()
        };
        peer.extra
            .insert("incarnation".into(), peer_incarnation.to_string());
        b.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
        b.qp.modify(&QpAttr::rtr(peer)).unwrap();
    };
    rtr(7);
    let mut s = TcpStream::connect(addr(&ctx)).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(&hello(7, incarnation())).unwrap();
    // A SEND over it arrives, and the ACK comes back.
    b.qp.post_recv(&[RecvWr::new(1, &[])]).unwrap();
    s.write_all(&empty_send(&b.qp)).unwrap();
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::Success);
    assert!(matches!(
        read_frame(&mut s, wire::HEADER_LEN),
        Frame::Response(wire::Response {
            kind: wire::ResponseKind::Ack,
            ..
        })
    ));
    // The QP leaves first: its BYE comes, and the context skips what the test still sends of
    // the old use — a request, a large one split across writes — up to the test's BYE.
    b.qp.modify(&QpAttr::error()).unwrap();
    match read_frame(&mut s, wire::HEADER_LEN + 8) {
        Frame::Bye { src_qpn, .. } => assert_eq!(src_qpn, b.qp.qp_num().0),
        f => panic!("expected BYE, got {f:?}"),
    }
    let mut old = Vec::new();
    for len in [8, 100_000] {
        wire::encode(
            &Frame::Request(wire::Request {
                qpn: b.qp.qp_num().0,
                psn: 0,
                solicited: false,
                op: wire::RequestOp::Send {
                    imm: None,
                    payload: &vec![3; len],
                },
            }),
            &mut old,
        );
    }
    let (first, rest) = old.split_at(50_000);
    s.write_all(first).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    s.write_all(rest).unwrap();
    s.write_all(&bye(b.qp.qp_num().0, PEER_QPN)).unwrap();
    // Reset and connected again, the QP at RTR first: it takes the same connection without
    // writing anything, and its endpoint names the connection by the test's address.
    b.qp.modify(&QpAttr::reset()).unwrap();
    wait_quiet(&ctx, 1);
    rtr(8);
    assert_eq!(
        b.qp.endpoint().extra.get(super::qp::KEPT_FROM_KEY),
        Some(&s.local_addr().unwrap().to_string())
    );
    s.set_read_timeout(Some(std::time::Duration::from_millis(20)))
        .unwrap();
    assert!(s.read(&mut [0u8; 1]).is_err(), "nothing written at RTR");
    s.set_read_timeout(Some(WAIT)).unwrap();
    // Its first frame comes after the HELLO it owes; the test's own HELLO, written as if at
    // once, is skipped.
    b.qp.modify(&QpAttr::rts()).unwrap();
    b.qp.post_send(&[SendWr::new(9, &[], WrOpcode::Send)])
        .unwrap();
    match read_next(&mut s) {
        Frame::Hello {
            dst_qpn, src_qpn, ..
        } => assert_eq!((dst_qpn, src_qpn), (PEER_QPN, b.qp.qp_num().0)),
        f => panic!("expected HELLO, got {f:?}"),
    }
    match read_next(&mut s) {
        Frame::Request(wire::Request {
            op: wire::RequestOp::Send { .. },
            ..
        }) => {}
        f => panic!("expected the SEND, got {f:?}"),
    }
    assert!(!b.qp.endpoint().extra.contains_key(super::qp::KEPT_FROM_KEY));
    s.write_all(&hello(8, incarnation())).unwrap();
    b.qp.post_recv(&[RecvWr::new(2, &[])]).unwrap();
    assert_eq!(b.qp.state(), QpState::Rts);
    // Attached: the test closing it now fails the QP.
    drop(s);
    let mut ids: Vec<(u64, bool)> = wait(&b.cq, 2)
        .iter()
        .map(|wc| (wc.wr_id, wc.status == WcStatus::Success))
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, [(2, false), (9, false)]);
    wait_state(&b.qp, QpState::Error);

    // Bytes after the BYE that are not a HELLO close the connection.
    b.qp.modify(&QpAttr::reset()).unwrap();
    rtr(9);
    let mut s = TcpStream::connect(addr(&ctx)).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(&hello(9, incarnation())).unwrap();
    s.write_all(&bye(b.qp.qp_num().0, PEER_QPN)).unwrap();
    b.qp.post_recv(&[RecvWr::new(3, &[])]).unwrap();
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::WrFlushed);
    read_frame(&mut s, wire::HEADER_LEN + 8);
    s.write_all(&u32::MAX.to_be_bytes()).unwrap();
    s.write_all(&[0u8; 28]).unwrap();
    assert_eq!(
        s.read(&mut [0u8; 1]).unwrap_or(0),
        0,
        "closed by the context"
    );
}

/// The test is the accepting end. It reaches RTR first: its HELLO lies on the kept connection
/// until the opening QP's RTR, which takes it and writes none. Then both write one (the test
/// after the QP): the QP skips the test's as the first frame of the use, and fails on a HELLO
/// anywhere else.
#[test]
fn the_opening_end_takes_the_accepting_ends_hello_and_skips_one_written_at_once() {
    let ctx = open();
    let victim = side(&ctx);
    let (listener, mut s) = fake_peer_at(&victim.qp);
    let peer = listener.local_addr().unwrap();
    // The fake peer (QP 77) is given the victim's own incarnation and PSN (`connect_to`).
    let hello = |qp: &QueuePair| {
        let inc = incarnation(qp);
        hello_frame((qp.qp_num().0, inc), (77, inc))
    };
    let acked = |s: &mut TcpStream| {
        matches!(
            read_frame(s, wire::HEADER_LEN),
            Frame::Response(wire::Response {
                kind: wire::ResponseKind::Ack,
                ..
            })
        )
    };

    peer_leaves(&mut s, &victim, 1);
    victim.qp.modify(&QpAttr::reset()).unwrap();
    wait_quiet(&ctx, 1);
    s.write_all(&hello(&victim.qp)).unwrap();
    connect_to(&victim.qp, peer);
    assert_eq!(found(&ctx), 1, "the test's HELLO found at RTR");
    victim.qp.post_recv(&[RecvWr::new(2, &[])]).unwrap();
    s.write_all(&empty_send(&victim.qp)).unwrap();
    assert_eq!(wait(&victim.cq, 1)[0].status, WcStatus::Success);
    assert!(
        acked(&mut s),
        "the QP's first frame is the ACK: it wrote no HELLO"
    );

    peer_leaves(&mut s, &victim, 3);
    victim.qp.modify(&QpAttr::reset()).unwrap();
    wait_quiet(&ctx, 1);
    connect_to(&victim.qp, peer);
    expect_hello(&mut s, &victim.qp);
    s.write_all(&hello(&victim.qp)).unwrap();
    victim.qp.post_recv(&[RecvWr::new(4, &[])]).unwrap();
    s.write_all(&empty_send(&victim.qp)).unwrap();
    assert_eq!(wait(&victim.cq, 1)[0].status, WcStatus::Success);
    assert!(acked(&mut s));
    victim.qp.post_recv(&[RecvWr::new(5, &[])]).unwrap();
    s.write_all(&hello(&victim.qp)).unwrap();
    let wc = wait(&victim.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::WrFlushed));
    wait_state(&victim.qp, QpState::Error);
    assert_eq!(counts(&ctx), (1, 2), "one connection all along");
}

/// A kept connection past its deadline is closed at the next look at the timers; those within
/// it stay (their QP can take them) until their own time is up.
#[test]
fn kept_connections_are_closed_after_their_idle_time() {
    use super::held::{Held, Owner, OPENED_IDLE};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let ctx = open();
    let engine = engine(&ctx);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = listener.local_addr().unwrap();
    let mut far_ends = Vec::new();
    let ages = [
        OPENED_IDLE + Duration::from_secs(1),
        Duration::ZERO,
        Duration::ZERO,
    ];
    for (qpn, age) in (1..).zip(ages) {
        let near = TcpStream::connect(peer).unwrap();
        near.set_nonblocking(true).unwrap();
        let (far, _) = listener.accept().unwrap();
        far.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        far_ends.push(far);
        let kept_since = Instant::now().checked_sub(age).unwrap();
        engine.hold(Held::released(
            Arc::new(super::data_conn::DataConn::opened(near)),
            Owner::Opened { peer, qpn },
            true,
            kept_since,
        ));
    }
    engine.prune_held(Instant::now());
    assert!(
        matches!(far_ends[0].read(&mut [0u8; 1]), Ok(0)),
        "the expired one is closed"
    );
    assert!(
        far_ends[1].read(&mut [0u8; 1]).is_err(),
        "the other one stays open (the read times out)"
    );
    assert!(engine.take_opened(Some(peer), 1, None).is_none());
    assert!(engine.take_opened(Some(peer), 3, None).is_some());
    // Once its time is up too, the second one is closed.
    engine.prune_held(Instant::now() + OPENED_IDLE + Duration::from_secs(1));
    assert!(
        matches!(far_ends[1].read(&mut [0u8; 1]), Ok(0)),
        "closed when its time is up"
    );
}

/// A QP that reads the peer's BYE while a request of its own is half written (the socket
/// full) gives the connection up: a BYE behind half a frame would make the other end take
/// the rest of the stream for old frames. The next connect opens a new connection.
#[test]
fn a_bye_read_while_a_request_is_half_written_gives_the_connection_up() {
    // Small socket buffers: an 8 MiB SEND cannot leave whole while the test does not read.
    let ctx = fixture::open("tcp0", &[("progress", "thread"), ("sndbuf", "65536")]);
    let victim = side(&ctx);
    let big = victim.pd.alloc_mr(8 << 20, AccessFlags::ALL).unwrap();
    let (listener, mut s) = fake_peer_at(&victim.qp);
    let peer = listener.local_addr().unwrap();
    victim
        .qp
        .post_send(&[SendWr::new(
            7,
            &[big.sge(0, 8 << 20).unwrap()],
            WrOpcode::Send,
        )])
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    s.write_all(&bye(victim.qp.qp_num().0, 77)).unwrap();
    let wc = wait(&victim.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (7, WcStatus::WrFlushed));
    wait_state(&victim.qp, QpState::Error);
    // Shut down, not kept: the rest of the stream ends.
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.len() < (8 << 20), "the SEND was cut");
    victim.qp.modify(&QpAttr::reset()).unwrap();
    connect_to(&victim.qp, peer);
    let (mut s2, _) = listener.accept().unwrap();
    s2.set_read_timeout(Some(WAIT)).unwrap();
    expect_hello(&mut s2, &victim.qp);
    assert_eq!(counts(&ctx), (2, 0));
}

/// The next frame on `s`, whatever its length.
fn read_next(s: &mut TcpStream) -> Frame<'static> {
    let mut head = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut head).unwrap();
    let len = wire::peek_len(&head).unwrap();
    let mut buf = head.to_vec();
    buf.resize(len, 0);
    s.read_exact(&mut buf[wire::HEADER_LEN..]).unwrap();
    let buf: &'static [u8] = Box::leak(buf.into_boxed_slice());
    wire::decode(buf, 0).unwrap().unwrap().0
}

/// The test is the opening end (its QP 77 "lives" at 127.0.0.1:1, below the context). The QP
/// reaches RTR first, takes the kept connection and posts a SEND over it (the HELLO it owes
/// first); the test then does what an opening end does that finds the connection not clean at
/// its own RTR (the QP's BYE still on the way): it gives the connection up unread and opens a
/// new one. The QP does not fail: it takes the new connection and sends its SEND again over
/// it — whether the old connection's end (here a reset: the test left bytes unread) or the new
/// connection's HELLO reaches it first.
#[test]
fn an_accepting_end_whose_kept_connection_the_opener_gives_up_unused_takes_its_new_one() {
    let ctx = open();
    let b = side(&ctx);
    let hello = |peer_inc: u32| hello_frame((b.qp.qp_num().0, incarnation(&b.qp)), (77, peer_inc));
    let connect = |peer_inc: u32| {
        let mut peer = QpEndpoint {
            address: "127.0.0.1:1".into(),
            qp_num: QpNum(77),
            ..b.qp.endpoint()
        };
        peer.extra
            .insert("incarnation".into(), peer_inc.to_string());
        reach_rts_towards(&b, peer);
    };
    let open_conn = |peer_inc: u32| {
        let mut s = TcpStream::connect(addr(&ctx)).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(&hello(peer_inc)).unwrap();
        s
    };
    let post_send = |wr_id: u64| {
        b.qp.post_send(&[SendWr::new(wr_id, &[], WrOpcode::Send)])
            .unwrap();
    };
    // The QP's SEND, read on `s`, acknowledged there.
    let take_send = |s: &mut TcpStream, wr_id: u64| {
        let psn = match read_next(s) {
            Frame::Request(wire::Request {
                psn,
                op: wire::RequestOp::Send { .. },
                ..
            }) => psn,
            f => panic!("expected the SEND, got {f:?}"),
        };
        let mut ack = Vec::new();
        wire::encode(
            &Frame::Response(wire::Response {
                qpn: b.qp.qp_num().0,
                psn,
                kind: wire::ResponseKind::Ack,
            }),
            &mut ack,
        );
        s.write_all(&ack).unwrap();
        let wc = wait(&b.cq, 1)[0];
        assert_eq!((wc.wr_id, wc.status), (wr_id, WcStatus::Success));
    };
    // A use, left by the test: the context keeps the connection, clean.
    let leave = |s: &mut TcpStream, wr_id: u64| {
        peer_leaves(s, &b, wr_id);
        b.qp.modify(&QpAttr::reset()).unwrap();
        wait_quiet(&ctx, 1);
    };

    connect(7);
    let mut k = open_conn(7);
    leave(&mut k, 1);

    // The old connection's end first.
    connect(8);
    post_send(2);
    drop(k);
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(b.qp.state(), QpState::Rts, "{:?}", b.qp.query());
    let mut f = open_conn(8);
    take_send(&mut f, 2);
    leave(&mut f, 3);

    // The new connection's HELLO first.
    connect(9);
    post_send(4);
    let mut g = open_conn(9);
    take_send(&mut g, 4);
    drop(f);
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(b.qp.state(), QpState::Rts);
    // The new connection carries the use both ways.
    b.qp.post_recv(&[RecvWr::new(5, &[])]).unwrap();
    g.write_all(&empty_send(&b.qp)).unwrap();
    let wc = wait(&b.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success));
}

/// A QP that reaches RTR first and says so (`QpAttr::before_peer`) accepts the data connection
/// whatever the addresses: its peer opens it (here the context with the higher address, which
/// would accept by the address order), and at the pair's next connections takes it again with
/// no HELLO either way. A peer's endpoint that says it was first too, or names a connection in
/// a form no endpoint has, is refused at RTR.
#[test]
fn the_end_first_at_rtr_accepts_and_its_peer_opens_whatever_their_addresses() {
    use super::qp::{FIRST_KEY, KEPT_FROM_KEY};
    let (lo, hi) = contexts();
    let (a, b) = (side(&lo), side(&hi));
    let first = |s: &Side, remote: QpEndpoint| {
        s.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
        s.qp.modify(&QpAttr::rtr(remote).before_peer()).unwrap();
        s.qp.modify(&QpAttr::rts()).unwrap();
    };
    const ROUNDS: u64 = 4;
    for round in 0..ROUNDS {
        if round > 0 {
            leave_clean(&lo, &hi, &a, &b);
        }
        let before = (spared(&lo), spared(&hi));
        first(&a, b.qp.endpoint());
        let named = a.qp.endpoint();
        assert_eq!(named.extra.get(FIRST_KEY).map(String::as_str), Some("1"));
        assert_eq!(named.extra.contains_key(KEPT_FROM_KEY), round > 0);
        reach_rts_towards(&b, named);
        exchange(&a, &b, round);
        let spared_now = (spared(&lo) - before.0, spared(&hi) - before.1);
        let want = if round > 0 { (1, 1) } else { (0, 0) };
        assert_eq!(spared_now, want, "round {round}");
    }
    assert_eq!(
        counts(&hi),
        (1, ROUNDS - 1),
        "the peer opened the one connection"
    );
    assert_eq!(counts(&lo), (0, 0));

    // Both ends say they were first.
    leave_clean(&lo, &hi, &a, &b);
    first(&a, b.qp.endpoint());
    b.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    let refused = |remote: QpEndpoint, attr: fn(QpEndpoint) -> QpAttr| {
        match b.qp.modify(&attr(remote)) {
            Err(VerbsError::InvalidArgument(_)) => {}
            r => panic!("expected InvalidArgument, got {r:?}"),
        }
        assert_eq!(b.qp.state(), QpState::Init);
    };
    refused(a.qp.endpoint(), |r| QpAttr::rtr(r).before_peer());
    let mut bad = a.qp.endpoint();
    bad.extra.insert(FIRST_KEY.into(), "yes".into());
    refused(bad, QpAttr::rtr);
    let mut bad = a.qp.endpoint();
    bad.extra.insert(KEPT_FROM_KEY.into(), "somewhere".into());
    refused(bad, QpAttr::rtr);
    // The endpoint as it is still connects, over the kept connection: the refusals took
    // nothing from it.
    b.qp.modify(&QpAttr::rtr(a.qp.endpoint())).unwrap();
    b.qp.modify(&QpAttr::rts()).unwrap();
    exchange(&a, &b, ROUNDS);
    assert_eq!(counts(&hi), (1, ROUNDS));
}

/// Busy mode with pollers that never stop (a thread spinning on a CQ of its own in each
/// context): the pollers read the QPs' connections, while fresh connections (a new QP pair's)
/// and kept ones (a cached QP's next use) still change hands from the engine to their QPs, and
/// every message arrives.
#[test]
fn busy_contexts_whose_pollers_never_stop_connect_and_reconnect() {
    let (x, y) = (
        fixture::open("tcp0", &[("progress", "busy")]),
        fixture::open("tcp0", &[("progress", "busy")]),
    );
    let (lo, hi) = if addr(&x) < addr(&y) { (x, y) } else { (y, x) };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spinners: Vec<_> = [&lo, &hi]
        .into_iter()
        .map(|ctx| {
            let cq = ctx.create_cq(16).unwrap();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut wc = [WorkCompletion::EMPTY; 4];
                let mut spins = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    assert_eq!(cq.poll(&mut wc).unwrap(), 0, "nothing completes here");
                    spins = spins.wrapping_add(1);
                    if spins % 256 == 0 {
                        std::thread::yield_now();
                    }
                }
            })
        })
        .collect();
    let (a, b) = (side(&lo), side(&hi));
    connect_with(&a, &b, QpAttr::rts);
    exchange(&a, &b, 0);
    const ROUNDS: u64 = 10;
    for round in 1..=ROUNDS {
        retire(&a);
        retire(&b);
        if round % 2 == 0 {
            connect_with(&a, &b, QpAttr::rts);
        } else {
            connect_with(&b, &a, QpAttr::rts);
        }
        exchange(&a, &b, round);
    }
    assert_eq!(counts(&lo), (1, ROUNDS), "the kept connection, every round");
    for round in 0..5 {
        let (c, d) = (side(&lo), side(&hi));
        connect_with(&c, &d, QpAttr::rts);
        exchange(&c, &d, 100 + round);
    }
    assert_eq!(counts(&lo), (6, ROUNDS));
    stop.store(true, Ordering::Relaxed);
    for s in spinners {
        s.join().unwrap();
    }
}
