//! A distributed lock by remote compare-and-swap, contended by two processes × 10 000
//! acquisitions. The owner process only exposes memory: no handler of it runs per acquisition.
//! Each contender, holding the lock, increments a counter next to the lock word by a plain
//! (non-atomic) RDMA read + write; mutual exclusion shows as a final count of exactly 20 000.

use std::process::Command;
use std::time::Duration;

use fabriq::{CasLock, Config, Endpoint, RegionDescriptor};

const ACQUISITIONS: u64 = 10_000;
const HANG: Duration = Duration::from_secs(60);

fn config() -> Config {
    Config {
        device: "shm0".into(),
        ..Config::default()
    }
}

#[test]
fn cas_lock_two_processes_ten_thousand_acquisitions_each() {
    let owner = Endpoint::new(config()).expect("endpoint");
    let region = owner.expose(64).expect("expose");
    let listener = owner.listen("127.0.0.1:0").expect("listen");
    let exe = std::env::current_exe().expect("test binary");
    let children: Vec<_> = [1u64, 2]
        .iter()
        .map(|id| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "contender_process",
                    "--include-ignored",
                    "--nocapture",
                ])
                .env("FABRIQ_CAS_ADDR", listener.local_addr().to_string())
                .env("FABRIQ_CAS_ID", id.to_string())
                .spawn()
                .expect("spawn contender")
        })
        .collect();
    let mut channels = Vec::new();
    for _ in 0..2 {
        let ch = listener.accept_timeout(HANG).expect("contender connects");
        ch.send(&region.descriptor().to_bytes())
            .expect("send descriptor");
        channels.push(ch);
    }
    for ch in &channels {
        let done = ch.recv_timeout(HANG).expect("contender reports");
        assert_eq!(&done[..], b"done");
    }
    for mut c in children {
        assert!(c.wait().expect("wait").success(), "a contender failed");
    }
    let word = |off| {
        region
            .atomic_u64(off)
            .expect("word")
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    assert_eq!(word(0), 0, "lock left held");
    assert_eq!(
        word(8),
        2 * ACQUISITIONS,
        "increments lost: mutual exclusion broken"
    );
}

/// The contender side, run in a child process by the test above.
#[test]
#[ignore = "helper process of cas_lock_two_processes_ten_thousand_acquisitions_each"]
fn contender_process() {
    let (Ok(addr), Ok(id)) = (
        std::env::var("FABRIQ_CAS_ADDR"),
        std::env::var("FABRIQ_CAS_ID"),
    ) else {
        return;
    };
    let id: u64 = id.parse().expect("id");
    let ep = Endpoint::new(config()).expect("endpoint");
    let ch = ep.connect(addr.as_str()).expect("connect");
    let desc = RegionDescriptor::from_bytes(&ch.recv_timeout(HANG).expect("descriptor"))
        .expect("valid descriptor");
    let lock = CasLock::new(ch.remote_region(desc), 0, id).expect("lock");
    for _ in 0..ACQUISITIONS {
        lock.lock().expect("lock");
        let r = lock.region();
        let v = u64::from_le_bytes(r.read(8, 8).expect("read")[..8].try_into().expect("8"));
        r.write(8, &(v + 1).to_le_bytes()).expect("write");
        lock.unlock().expect("unlock");
    }
    ch.send(b"done").expect("report");
    // Wait for the owner to have read the report before tearing the channel down.
    let _ = ch.recv_timeout(Duration::from_secs(2));
}
