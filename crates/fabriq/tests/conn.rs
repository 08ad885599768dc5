//! Connection manager and memory pool over real providers on loopback: handshake, receives
//! posted before RTR (no RNR), zero-copy sends of pool buffers, RDMA READ of a pool buffer
//! through its rkey, and QP reuse through the cache. Each test runs against every provider whose
//! device opens here (`shm0`, `tcp0`); a device that does not open is reported and skipped.
//! Waits are bounded by generous timeouts that only catch hangs.

use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::Duration;

use fabriq::conn::{ConnConfig, ConnError, ConnManager, Established, RingGeometry};
use fabriq::mempool::{MemPool, PoolBuf, PoolConfig};
use fabriq_verbs::{
    CompletionQueue, Context, ProtectionDomain, QpAttr, QpState, QueuePair, RecvWr, SendWr,
    WcOpcode, WcStatus, WorkCompletion, WrOpcode,
};

const LONG: Duration = Duration::from_secs(20);

#[path = "support/devices.rs"]
mod support_devices;
use support_devices::devices;

struct Side {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    mgr: ConnManager,
}

fn side(device: &str, worker_id: u32) -> Option<Side> {
    let ctx = match Context::open(device) {
        Ok(ctx) => ctx,
        Err(err) => {
            eprintln!("skipping {device}: {err}");
            return None;
        }
    };
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024).unwrap();
    let cfg = ConnConfig {
        worker_id,
        ring: RingGeometry {
            slots: 16,
            slot_size: 4096,
        },
        initial_credits: 16,
        ..ConnConfig::default()
    };
    let mgr = ConnManager::new(&pd, &cq, cfg).unwrap();
    Some(Side { pd, cq, mgr })
}

fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::EMPTY; 1];
    let n = cq.poll_blocking(&mut wc, LONG).unwrap();
    assert_eq!(n, 1, "no completion within {LONG:?}");
    wc[0]
}

/// Post every buffer of `ring` as a receive on `qp`, wr_id = index.
fn post_ring(qp: &QueuePair, ring: &[PoolBuf]) -> Result<(), ConnError> {
    for (i, b) in ring.iter().enumerate() {
        qp.post_recv(&[RecvWr::new(i as u64, &[b.sge_full()])])?;
    }
    Ok(())
}

/// A server on its own thread: for each round, accept one peer with a receive ring of pool
/// buffers posted before RTR, echo one message back reversed from a pool buffer, then release
/// the QP (after flushing the ring) to the cache. Returns whether each round reused a QP.
fn start_server(device: &str, rounds: usize) -> Option<(SocketAddr, JoinHandle<Vec<bool>>)> {
    let srv = side(device, 1)?;
    let listener = srv.mgr.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let handle = std::thread::spawn(move || {
        let mut pool = MemPool::new(&srv.pd, PoolConfig::default()).unwrap();
        let mut reused = Vec::new();
        for _ in 0..rounds {
            let ring: Vec<PoolBuf> = (0..4).map(|_| pool.alloc(4096).unwrap()).collect();
            let est = listener
                .accept_with(Some(LONG), |qp, _| post_ring(qp, &ring))
                .unwrap();
            reused.push(est.reused_qp);
            let wc = wait_one(&srv.cq);
            assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Recv));
            let got = &ring[wc.wr_id as usize][..wc.byte_len as usize];
            let mut reply = pool.alloc(got.len()).unwrap();
            reply.copy_from_slice(got);
            reply.reverse();
            est.qp
                .post_send(&[SendWr::new(99, &[reply.sge()], WrOpcode::Send)])
                .unwrap();
            let wc = wait_one(&srv.cq);
            assert_eq!((wc.wr_id, wc.status), (99, WcStatus::Success));
            release_flushed(&srv.mgr, &srv.cq, est, 3);
        }
        reused
    });
    Some((addr, handle))
}

/// Move the QP to ERROR, collect the `pending` flushed receives, and release it to the cache.
fn release_flushed(mgr: &ConnManager, cq: &CompletionQueue, est: Established, pending: usize) {
    est.qp.modify(&QpAttr::error()).unwrap();
    for _ in 0..pending {
        assert_eq!(wait_one(cq).status, WcStatus::WrFlushed);
    }
    mgr.release(est);
}

#[test]
fn messages_flow_both_ways_right_after_the_handshake_and_qps_are_reused() {
    for device in devices() {
        let device = device.as_str();
        let Some(cli) = side(device, 0) else { continue };
        let Some((addr, server)) = start_server(device, 3) else {
            continue;
        };
        let mut pool = MemPool::new(&cli.pd, PoolConfig::default()).unwrap();
        for round in 0..3 {
            let ring: Vec<PoolBuf> = (0..4).map(|_| pool.alloc(4096).unwrap()).collect();
            let est = cli
                .mgr
                .connect_with(addr, Some(1), LONG, |qp, peer| {
                    assert_eq!(qp.state(), QpState::Init);
                    assert_eq!(peer.ring.slots, 16);
                    post_ring(qp, &ring)
                })
                .unwrap_or_else(|e| panic!("{device} round {round}: {e}"));
            assert_eq!(est.qp.state(), QpState::Rts);
            assert_eq!(est.reused_qp, round > 0, "{device} round {round}");
            if device == "tcp0" {
                // The server reached RTR first and said so, and the client was given its
                // endpoint as read after that RTR: from the second round on, it names the data
                // connection kept from the round before, which both QPs take with no greeting.
                let extra = &est.peer.endpoint.extra;
                assert_eq!(extra.get("rtr_first").map(String::as_str), Some("1"));
                assert_eq!(
                    extra.contains_key("kept_from"),
                    round > 0,
                    "{device} round {round}: {extra:?}"
                );
            }
            // Send at once: the server posted its receives before its QP reached RTR.
            let mut msg = pool.alloc(11).unwrap();
            msg.copy_from_slice(b"hello world");
            est.qp
                .post_send(&[SendWr::new(7, &[msg.sge()], WrOpcode::Send)])
                .unwrap();
            let mut seen_send = false;
            let mut reply = None;
            while !(seen_send && reply.is_some()) {
                let wc = wait_one(&cli.cq);
                assert_eq!(wc.status, WcStatus::Success, "{device}: {wc:?}");
                match wc.opcode {
                    WcOpcode::Send => seen_send = true,
                    WcOpcode::Recv => {
                        reply = Some(ring[wc.wr_id as usize][..wc.byte_len as usize].to_vec())
                    }
                    other => panic!("{device}: unexpected {other:?}"),
                }
            }
            assert_eq!(reply.unwrap(), b"dlrow olleh", "{device}");
            drop(msg);
            // Three receives are still posted: flush them before the QP is reused.
            release_flushed(&cli.mgr, &cli.cq, est, 3);
        }
        let server_reused = server.join().unwrap();
        assert_eq!(server_reused, vec![false, true, true], "{device}");
        let s = cli.mgr.stats();
        assert_eq!(
            (s.qps_created, s.qp_cache_hits, s.connects),
            (1, 2, 3),
            "{device}"
        );
    }
}

#[test]
fn a_peer_reads_a_pool_buffer_through_its_rkey() {
    for device in devices() {
        let device = device.as_str();
        let Some(srv) = side(device, 1) else { continue };
        let Some(cli) = side(device, 0) else { continue };
        let listener = srv.mgr.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr();
        let server = std::thread::spawn(move || listener.accept().unwrap());
        let est = cli.mgr.connect(addr, LONG).unwrap();
        let srv_est = server.join().unwrap();
        // The server exposes a pool buffer (REMOTE_READ is in the pool's default rights).
        let mut srv_pool = MemPool::new(&srv.pd, PoolConfig::default()).unwrap();
        let mut exposed = srv_pool.alloc(4096).unwrap();
        for (i, b) in exposed.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let remote = exposed.remote();
        // The client pulls it into one of its own pool buffers (the rendezvous data path).
        let mut cli_pool = MemPool::new(&cli.pd, PoolConfig::default()).unwrap();
        let mut target = cli_pool.alloc(4096).unwrap();
        target.fill(0);
        est.qp
            .post_send(&[SendWr::new(5, &[target.sge()], WrOpcode::Read { remote })])
            .unwrap();
        let wc = wait_one(&cli.cq);
        assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success), "{device}");
        assert_eq!(&target[..], &exposed[..], "{device}");
        drop((est, srv_est));
    }
}

#[test]
fn errors_are_typed_on_real_providers() {
    for device in devices() {
        let device = device.as_str();
        let Some(cli) = side(device, 0) else { continue };
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(matches!(
            cli.mgr.connect(closed, LONG),
            Err(ConnError::Refused { .. })
        ));
        // Another provider's server: refused with a provider mismatch on both sides.
        let other = if device == "tcp0" { "shm0" } else { "tcp0" };
        let Some(srv) = side(other, 1) else { continue };
        let listener = srv.mgr.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr();
        let server = std::thread::spawn(move || listener.accept().map(|_| ()));
        let err = cli.mgr.connect(addr, LONG).unwrap_err();
        assert!(matches!(err, ConnError::ProviderMismatch { .. }), "{err}");
        let err = server.join().unwrap().unwrap_err();
        assert!(matches!(err, ConnError::ProviderMismatch { .. }), "{err}");
    }
}
