//! Idle endpoints sleep: over 2 s with connected channels and no traffic, the process uses a
//! small fraction of one CPU (a busy-polling worker would use ~2 s per worker). Both progress
//! modes: thread (workers sleep in epoll with their CQ armed) and caller (no application thread
//! polls; the back-stop threads sleep — also while an async task sleeps in `recv_async`, for
//! which the back-stop progresses the worker). This file holds a single test so that the
//! process CPU time it measures is its own.

use std::time::Duration;

use fabriq::{Config, Endpoint, Progress, Rpc};

const HANG: Duration = Duration::from_secs(30);

fn cpu_time() -> Duration {
    // CPU time of every thread of this process.
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[test]
fn idle_endpoints_use_almost_no_cpu_in_both_progress_modes() {
    for progress in [Progress::Thread, Progress::Caller] {
        for device in ["shm0", "tcp0"] {
            let cfg = Config {
                device: device.into(),
                workers: 2,
                progress,
                ..Config::default()
            };
            let server = Endpoint::new(cfg.clone()).expect("server");
            server.serve("echo", |r| Ok(r.to_vec()));
            let client = Endpoint::new(cfg).expect("client");
            let listener = server.listen("127.0.0.1:0").expect("listen");
            let c = client.connect(listener.local_addr()).expect("connect");
            let s = listener.accept_timeout(HANG).expect("accept");
            // Traffic first, both ways and through RPC, so every worker has been busy and must
            // go back to sleep.
            let rpc = Rpc::new(c.clone());
            for i in 0..1000u32 {
                c.send(&i.to_le_bytes()).expect("send");
                s.recv_timeout(HANG).expect("recv");
                s.send(&i.to_le_bytes()).expect("send back");
                c.recv_timeout(HANG).expect("recv back");
            }
            for _ in 0..100 {
                rpc.call("echo", b"x", HANG).expect("call");
            }
            // A task waits for a message through the idle period.
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("runtime");
            let waiting = {
                let s = s.clone();
                rt.spawn(async move { s.recv_async().await })
            };
            std::thread::sleep(Duration::from_millis(100));
            let before = cpu_time();
            std::thread::sleep(Duration::from_secs(2));
            let used = cpu_time() - before;
            c.send(b"wake").expect("send to the waiting task");
            let got = rt
                .block_on(async { tokio::time::timeout(HANG, waiting).await })
                .expect("the task got its message")
                .expect("task")
                .expect("recv_async");
            assert_eq!(&got[..], b"wake");
            // Four workers spinning would use ~8 s; sleeping ones use next to nothing.
            assert!(
                used < Duration::from_millis(300),
                "{device}, {progress:?}: idle endpoints used {used:?} of CPU in 2 s"
            );
            // Still alive after the idle period.
            assert_eq!(rpc.call("echo", b"y", HANG).expect("call"), b"y");
        }
    }
}
