//! In-process tests of the udp provider: two contexts talking over loopback. Every wait has a
//! generous timeout that only catches hangs.

use crate::soft::testing::{self as fixture, big_regions, connect_with, read_back, wait, Side};
use crate::*;

fn open(opts: &[(&str, &str)]) -> Context {
    fixture::open("udp0", opts)
}

fn side(ctx: &Context) -> Side {
    fixture::side(ctx, 1024, QpCaps::default(), AccessFlags::ALL)
}

fn pair(opts: &[(&str, &str)]) -> (Side, Side) {
    let a = side(&open(opts));
    let b = side(&open(opts));
    connect_with(&a, &b, QpAttr::rts);
    (a, b)
}

#[test]
fn device_is_listed_and_advertises_synchronise() {
    let devs = devices().unwrap();
    assert!(devs.iter().any(|d| d.name == "udp0" && d.provider == "udp"));
    let ctx = open(&[]);
    let caps = ctx.query_device().capabilities;
    for c in [
        Capabilities::SEND,
        Capabilities::WRITE,
        Capabilities::READ,
        Capabilities::ATOMICS,
        Capabilities::SYNCHRONISE,
    ] {
        assert!(caps.contains(c), "missing {c:?}");
    }
}

#[test]
fn bad_options_are_refused() {
    for (k, v) in [
        ("paths", "0"),
        ("mode", "zigzag"),
        ("nope", "1"),
        ("mss", "x"),
        ("gso", "0"),
        ("gso", "65"),
        ("gro", "maybe"),
        ("delta", "256"),
        ("bitmap", "1025"),
        ("bitmap", "16"),
        ("progress", "sometimes"),
    ] {
        let mut cfg = DeviceConfig::default();
        cfg.options.insert(k.into(), v.into());
        assert!(
            matches!(
                Context::open_with("udp0", &cfg),
                Err(VerbsError::InvalidArgument(_))
            ),
            "{k}={v} accepted"
        );
    }
}

fn exercise(opts: &[(&str, &str)]) {
    let (a, b) = pair(opts);
    // SEND/RECV.
    b.qp.post_recv(&[RecvWr::new(9, &[b.mr.sge(0, 64).unwrap()])])
        .unwrap();
    a.mr.write_at(0, b"hello over many paths").unwrap();
    a.qp.post_send(&[SendWr::new(1, &[a.mr.sge(0, 21).unwrap()], WrOpcode::Send)])
        .unwrap();
    let wc = wait(&b.cq, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (9, WcStatus::Success, 21)
    );
    let mut got = [0u8; 21];
    b.mr.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"hello over many paths");
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);

    // A large WRITE (many mpath packets over many paths), then READ it back.
    let len = 4 << 20;
    let (big_a, big_b, pattern) = big_regions(&a, &b, len);
    let sge = [big_a.sge(0, len as u32).unwrap()];
    a.qp.post_send(&[SendWr::new(
        2,
        &sge,
        WrOpcode::Write {
            remote: big_b.remote(0),
        },
    )
    .with_flags(SendFlags::SIGNALED | SendFlags::SYNCHRONISE)])
        .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let mut back = vec![0u8; len];
    big_b.read_at(0, &mut back).unwrap();
    assert!(back == pattern, "WRITE corrupted data");
    read_back(&a, &big_a, &big_b, &pattern, 3);

    // Atomics.
    b.mr.write_at(128, &40u64.to_ne_bytes()).unwrap();
    a.qp.post_send(&[SendWr::new(
        4,
        &[a.mr.sge(256, 8).unwrap()],
        WrOpcode::AtomicFetchAdd {
            remote: b.mr.remote(128),
            add: 2,
        },
    )])
    .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let mut v = [0u8; 8];
    b.mr.read_at(128, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), 42);
    a.mr.read_at(256, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), 40);
}

#[test]
fn multipath_send_write_read_atomic() {
    exercise(&[]);
}

#[test]
fn busy_progress_send_write_read_atomic() {
    exercise(&[("progress", "busy")]);
}

/// SENDs back and forth, 8 bytes, each side spinning on its CQ until the completion is there;
/// returns the socket counters of `b`'s context over the exchange.
fn ping_pong(a: &Side, b: &Side, rounds: u64) -> crate::provider::udp::SocketStats {
    let before = crate::provider::udp::qp_stats(&b.qp).expect("udp").sockets;
    for i in 0..rounds {
        b.qp.post_recv(&[RecvWr::new(i, &[b.mr.sge(0, 8).unwrap()])])
            .unwrap();
        a.qp.post_recv(&[RecvWr::new(i, &[a.mr.sge(64, 8).unwrap()])])
            .unwrap();
        a.qp.post_send(&[SendWr::new(i, &[a.mr.sge(0, 8).unwrap()], WrOpcode::Send)])
            .unwrap();
        let got = wait(&b.cq, 1);
        assert_eq!((got[0].wr_id, got[0].status), (i, WcStatus::Success));
        b.qp.post_send(&[SendWr::new(i, &[b.mr.sge(0, 8).unwrap()], WrOpcode::Send)])
            .unwrap();
        // a: its send's completion and b's reply, in either order.
        let got = wait(&a.cq, 2);
        assert!(got
            .iter()
            .all(|w| w.status == WcStatus::Success && w.wr_id == i));
        assert_eq!(wait(&b.cq, 1)[0].wr_id, i);
    }
    let after = crate::provider::udp::qp_stats(&b.qp).expect("udp").sockets;
    crate::provider::udp::SocketStats {
        rx_datagrams: after.rx_datagrams - before.rx_datagrams,
        rx_polled: after.rx_polled - before.rx_polled,
        ..after
    }
}

/// With `progress = busy` a spinning poller reads the sockets itself (the progress thread
/// leaves them to it); with `thread` it never does.
#[test]
fn a_busy_poller_reads_the_sockets_and_a_thread_mode_one_never_does() {
    let (a, b) = pair(&[("progress", "busy")]);
    let st = ping_pong(&a, &b, 200);
    assert!(st.rx_datagrams >= 400, "a SEND and an ACK each way: {st:?}");
    assert!(
        st.rx_polled * 2 >= st.rx_datagrams,
        "most datagrams read by the poller: {st:?}"
    );
    let (a, b) = pair(&[("progress", "thread")]);
    let st = ping_pong(&a, &b, 50);
    assert!(st.rx_datagrams >= 100, "{st:?}");
    assert_eq!(st.rx_polled, 0, "{st:?}");
}

/// A busy poller that stops polling, or arms its CQ to sleep, leaves the sockets to the
/// progress thread: what arrives then is read by the thread, and a sleeping poller is woken by
/// its CQ's event.
#[test]
fn a_busy_poller_that_stops_or_sleeps_leaves_the_sockets_to_the_thread() {
    let (a, b) = pair(&[("progress", "busy")]);
    ping_pong(&a, &b, 20);
    // b stops polling (no arming): its thread takes the sockets back after the grace, so
    // a's SEND is received and acknowledged while b does nothing.
    let before = crate::provider::udp::qp_stats(&b.qp).expect("udp").sockets;
    b.qp.post_recv(&[RecvWr::new(100, &[b.mr.sge(0, 8).unwrap()])])
        .unwrap();
    a.qp.post_send(&[SendWr::new(100, &[a.mr.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].wr_id, 100, "acknowledged by b's thread");
    let after = crate::provider::udp::qp_stats(&b.qp).expect("udp").sockets;
    assert!(after.rx_datagrams > before.rx_datagrams, "{after:?}");
    assert_eq!(
        after.rx_polled, before.rx_polled,
        "b did not poll: {after:?}"
    );
    assert_eq!(wait(&b.cq, 1)[0].wr_id, 100);
    // b polls, then arms its CQ and sleeps on its event: the thread serves it at once.
    ping_pong(&a, &b, 5);
    let mut wc = [WorkCompletion::EMPTY; 1];
    assert_eq!(b.cq.poll(&mut wc).unwrap(), 0);
    b.cq.req_notify(false).unwrap();
    b.qp.post_recv(&[RecvWr::new(101, &[b.mr.sge(0, 8).unwrap()])])
        .unwrap();
    a.qp.post_send(&[SendWr::new(101, &[a.mr.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    assert!(b
        .cq
        .wait_event(Some(std::time::Duration::from_secs(10)))
        .unwrap());
    b.cq.ack_events().unwrap();
    assert_eq!(wait(&b.cq, 1)[0].wr_id, 101);
    assert_eq!(wait(&a.cq, 1)[0].wr_id, 101);
}

#[test]
fn multipath_with_gso_and_gro_send_write_read_atomic() {
    // Loopback carries a GSO message whole into the GRO socket: the receive path splits it.
    exercise(&[("gso", "16"), ("gro", "on")]);
}

#[test]
fn qp_stats_count_datagrams_and_system_calls() {
    let (a, b) = pair(&[]);
    let sge = [a.mr.sge(0, 4096).unwrap()];
    let rsge = [b.mr.sge(0, 4096).unwrap()];
    b.qp.post_recv(&[RecvWr::new(1, &rsge)]).unwrap();
    a.qp.post_send(&[SendWr::new(2, &sge, WrOpcode::Send)])
        .unwrap();
    wait(&a.cq, 1);
    wait(&b.cq, 1);
    let st = crate::provider::udp::qp_stats(&a.qp).expect("a udp QP");
    let m = st.mpath.expect("connected");
    assert!(
        m.data_packets_sent >= 3,
        "4 KiB take three datagrams: {m:?}"
    );
    assert!(st.sockets.tx_datagrams >= m.data_packets_sent);
    assert!(st.sockets.tx_calls >= 1 && st.sockets.tx_calls <= st.sockets.tx_datagrams);
    assert!(
        st.sockets.rx_datagrams >= 1,
        "ACKs came back: {:?}",
        st.sockets
    );
}

#[test]
fn single_path_send_write_read_atomic() {
    exercise(&[("mode", "single"), ("paths", "1")]);
}

#[test]
fn peer_error_flushes_and_moves_qp_to_error() {
    let (a, b) = pair(&[]);
    b.qp.modify(&QpAttr::error()).unwrap();
    // The CLOSE datagram (or mpath's timeout) fails `a`; its receive flushes.
    a.qp.post_recv(&[RecvWr::new(7, &[])]).unwrap();
    let wc = wait(&a.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (7, WcStatus::WrFlushed));
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn unreachable_peer_fails_outstanding_requests() {
    let a = side(&open(&[("min_ack_timeout_ms", "60000")]));
    // A peer that existed once: its endpoint is valid, its sockets are gone.
    let gone = {
        let b = side(&open(&[]));
        b.qp.endpoint()
    };
    a.qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    a.qp.modify(&QpAttr::rtr(gone)).unwrap();
    a.qp.modify(&QpAttr::rts()).unwrap();
    a.qp.post_send(&[SendWr::new(1, &[a.mr.sge(0, 8).unwrap()], WrOpcode::Send)])
        .unwrap();
    // mpath gives up after its retransmission budget: the QP fails, the request flushes.
    let wc = wait(&a.cq, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::WrFlushed));
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn a_close_of_the_peers_earlier_connection_is_not_taken_for_the_new_one() {
    use super::qp::generation_of;
    use super::wire::{Header, Kind};
    let a = side(&open(&[]));
    let b = side(&open(&[]));
    // A first connection over which nothing is sent: `a` sees none of `b`'s datagrams.
    let old_b = b.qp.endpoint();
    connect_with(&a, &b, QpAttr::rts);
    a.qp.modify(&QpAttr::reset()).unwrap();
    b.qp.modify(&QpAttr::reset()).unwrap();
    let new_b = b.qp.endpoint();
    assert_ne!(generation_of(old_b.psn), generation_of(new_b.psn));
    connect_with(&a, &b, QpAttr::rts);
    // A CLOSE of `b`'s first connection, late (as one still queued at a RESET would be),
    // from `b`'s address.
    let to: std::net::SocketAddr = a.qp.endpoint().address.parse().unwrap();
    let from = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let close = |psn: u32| {
        Header {
            kind: Kind::Close,
            dst_qpn: a.qp.qp_num().0,
            src_qpn: b.qp.qp_num().0,
            path: 0,
            generation: generation_of(psn),
        }
        .encode()
    };
    from.send_to(&close(old_b.psn), to).unwrap();
    // The connection works both ways after it, and `a` stays in RTS.
    let (ma, mb) = (
        a.pd.alloc_mr(64, AccessFlags::ALL).unwrap(),
        b.pd.alloc_mr(64, AccessFlags::ALL).unwrap(),
    );
    for (from_side, to_side, src, dst) in [(&b, &a, &mb, &ma), (&a, &b, &ma, &mb)] {
        to_side
            .qp
            .post_recv(&[RecvWr::new(1, &[dst.sge(0, 8).unwrap()])])
            .unwrap();
        from_side
            .qp
            .post_send(&[SendWr::new(2, &[src.sge(0, 8).unwrap()], WrOpcode::Send)])
            .unwrap();
        assert_eq!(wait(&from_side.cq, 1)[0].status, WcStatus::Success);
        assert_eq!(wait(&to_side.cq, 1)[0].status, WcStatus::Success);
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(
        a.qp.state(),
        QpState::Rts,
        "a stale CLOSE ended the new connection"
    );
    // A CLOSE of the current connection is taken (the same way in, so the one above was read).
    from.send_to(&close(new_b.psn), to).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while a.qp.state() != QpState::Error {
        assert!(
            std::time::Instant::now() < deadline,
            "the peer's CLOSE was not taken"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// The QP timers are looked at only when an announced deadline is due, however many idle QPs
/// a context has: 200 messages beside 32 idle QP pairs, in thread mode (the thread serves
/// every datagram), with retransmission timeouts a second and ACK timeouts an hour away, make no timer round at
/// all. (Before, the thread looked at every QP's timers twice per wake-up: ≈ 66 looks per
/// datagram here.)
#[test]
fn the_thread_looks_at_qp_timers_only_when_a_deadline_is_due() {
    let opts = [
        ("progress", "thread"),
        ("min_rto_ms", "1000"),
        ("min_ack_timeout_ms", "3600000"),
    ];
    let (ca, cb) = (open(&opts), open(&opts));
    let pair_in = |ca: &Context, cb: &Context| {
        let (a, b) = (side(ca), side(cb));
        connect_with(&a, &b, QpAttr::rts);
        (a, b)
    };
    let (a, b) = pair_in(&ca, &cb);
    let idle: Vec<(Side, Side)> = (0..32).map(|_| pair_in(&ca, &cb)).collect();
    let looks = || {
        [&a, &b]
            .iter()
            .map(|s| {
                let qp = s.qp.ops().as_any().downcast_ref::<super::qp::UdpQp>();
                qp.expect("a udp QP")
                    .engine()
                    .timer_looks
                    .load(std::sync::atomic::Ordering::Relaxed)
            })
            .sum::<u64>()
    };
    fixture::assert_timer_rounds_do_not_follow_messages(&a, &b, idle.len(), looks);
}

/// Once `modify` has moved a QP to ERROR, no peer READ or WRITE through it is still being
/// served (`crate::soft::testing::accesses_past_error`).
#[test]
fn a_qp_moved_to_error_lets_no_peer_access_run_on() {
    let torn = fixture::accesses_past_error(16, || {
        let (a, b) = pair(&[]);
        ((a.pd, a.cq, a.qp), (b.pd, b.qp))
    });
    assert!(torn.is_empty(), "{torn:?}");
}
