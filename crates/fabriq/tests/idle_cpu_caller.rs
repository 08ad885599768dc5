//! Caller-mode endpoints nobody calls into sleep: over 2 s with connected channels, after some
//! traffic, the process uses a small fraction of one CPU (the back-stop threads sleep in epoll
//! with the CQ armed; no application thread polls). One test per file: the process CPU time it
//! measures is its own.

use std::time::Duration;

use fabriq::{Config, Endpoint, Progress, Rpc};

fn cpu_time() -> Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[test]
fn idle_caller_mode_endpoints_use_almost_no_cpu() {
    for device in ["shm0", "tcp0"] {
        let cfg = Config {
            device: device.into(),
            workers: 2,
            progress: Progress::Caller,
            ..Config::default()
        };
        let server = Endpoint::new(cfg.clone()).expect("server");
        server.serve("echo", |r| Ok(r.to_vec()));
        let client = Endpoint::new(cfg).expect("client");
        let listener = server.listen("127.0.0.1:0").expect("listen");
        let c = client.connect(listener.local_addr()).expect("connect");
        let s = listener
            .accept_timeout(Duration::from_secs(30))
            .expect("accept");
        // Traffic first, in both directions and through RPC, so every worker has been driven.
        let rpc = Rpc::new(c.clone());
        for i in 0..1000u32 {
            c.send(&i.to_le_bytes()).expect("send");
            s.recv_timeout(Duration::from_secs(30)).expect("recv");
            s.send(&i.to_le_bytes()).expect("send back");
            c.recv_timeout(Duration::from_secs(30)).expect("recv back");
        }
        for _ in 0..100 {
            rpc.call("echo", b"x", Duration::from_secs(30))
                .expect("call");
        }
        std::thread::sleep(Duration::from_millis(100));
        let before = cpu_time();
        std::thread::sleep(Duration::from_secs(2));
        let used = cpu_time() - before;
        assert!(
            used < Duration::from_millis(300),
            "{device}: idle caller-mode endpoints used {used:?} of CPU in 2 s"
        );
        // Still alive after the idle period.
        assert_eq!(
            rpc.call("echo", b"y", Duration::from_secs(30))
                .expect("call"),
            b"y"
        );
    }
}
