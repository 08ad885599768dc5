//! `device = "auto"` without an RDMA NIC: one endpoint on two devices, `shm0` for peers on this
//! host and `tcp0` for the others, with one listening address for both; a peer on a named
//! device is reached on that device whichever side chose `auto`; exposed memory is reachable
//! from peers on either device.

use std::time::Duration;

use fabriq::{Config, Endpoint, Progress};

const HANG: Duration = Duration::from_secs(30);

fn endpoint(device: &str) -> Endpoint {
    Endpoint::new(Config {
        device: device.into(),
        progress: Progress::Caller,
        ..Config::default()
    })
    .expect("endpoint")
}

fn auto_has_shm() -> bool {
    let e = endpoint("auto");
    if e.devices().first().map(String::as_str) != Some("shm0") {
        println!(
            "SKIP: auto opened {:?} (an RDMA NIC or no shm0)",
            e.devices()
        );
        return false;
    }
    assert_eq!(e.devices(), ["shm0", "tcp0"]);
    true
}

/// Echo once each way and check the device both ends report.
fn exchange(c: &fabriq::Channel, s: &fabriq::Channel, device: &str) {
    assert_eq!(c.device(), device);
    assert_eq!(s.device(), device);
    for len in [0usize, 8, 5000, 200_000] {
        let msg: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        c.send(&msg).expect("send");
        assert_eq!(&s.recv_timeout(HANG).expect("recv")[..], &msg[..]);
        s.send(&msg).expect("send back");
        assert_eq!(&c.recv_timeout(HANG).expect("recv back")[..], &msg[..]);
    }
}

#[test]
fn auto_uses_shm_for_a_peer_on_this_host_and_tcp_for_a_tcp_peer() {
    if !auto_has_shm() {
        return;
    }
    let server = endpoint("auto");
    let listener = server.listen("127.0.0.1:0").expect("listen");
    let addr = listener.local_addr();

    // An auto client on this host: shared memory.
    let auto_client = endpoint("auto");
    let c = auto_client.connect(addr).expect("auto connect");
    let s = listener.accept_timeout(HANG).expect("accept");
    exchange(&c, &s, "shm0");

    // A tcp0 client reaches the same listening address: the server's tcp0 device takes it.
    let tcp_client = endpoint("tcp0");
    let c2 = tcp_client.connect(addr).expect("tcp connect");
    let s2 = listener.accept_timeout(HANG).expect("accept tcp");
    exchange(&c2, &s2, "tcp0");

    // RPC is served on either device.
    server.serve("echo", |b| Ok(b.to_vec()));
    let rpc = fabriq::Rpc::new(c2.clone());
    assert_eq!(
        rpc.call("echo", b"via tcp", HANG).expect("call"),
        b"via tcp"
    );

    // One exposed region, reached one-sidedly from both peers: the same memory.
    let region = server.expose(64).expect("expose");
    let via_shm = c.remote_region(region.descriptor_for(&s));
    let via_tcp = c2.remote_region(region.descriptor_for(&s2));
    assert_eq!(via_shm.fetch_and_add(0, 5).expect("faa shm"), 0);
    assert_eq!(via_tcp.fetch_and_add(0, 7).expect("faa tcp"), 5);
    assert_eq!(via_shm.compare_and_swap(0, 12, 1).expect("cas shm"), 12);
    via_tcp.write(8, b"from tcp").expect("write tcp");
    assert_eq!(via_shm.read(8, 8).expect("read shm"), b"from tcp");
    assert_eq!(
        region
            .atomic_u64(0)
            .expect("word")
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
}

#[test]
fn an_auto_client_falls_back_to_the_device_a_named_listener_runs() {
    if !auto_has_shm() {
        return;
    }
    // The listener runs tcp0 only; the auto client's first choice (shm0, same host) is
    // refused with a provider mismatch and it connects on tcp0 instead.
    let server = endpoint("tcp0");
    let listener = server.listen("127.0.0.1:0").expect("listen");
    let client = endpoint("auto");
    let c = client.connect(listener.local_addr()).expect("connect");
    let s = listener.accept_timeout(HANG).expect("accept");
    exchange(&c, &s, "tcp0");
    // The refused shm0 attempt is the listener's failure, typed.
    let f = listener.next_failure(Duration::from_secs(1));
    assert!(
        matches!(f, Some(fabriq::ConnError::ProviderMismatch { .. })),
        "{f:?}"
    );
    // A second channel reuses the pooled tcp0 connection.
    let c2 = client
        .connect(listener.local_addr())
        .expect("second connect");
    let s2 = listener.accept_timeout(HANG).expect("accept second");
    exchange(&c2, &s2, "tcp0");
}
