//! The per-context service thread. It sleeps in `epoll_wait` on the context's doorbell eventfd
//! and on the pidfds of connected peer processes, and does only slow-path work:
//!
//! - signals a CQ's eventfd when a peer produced a completion into it while it was armed
//!   (peers cannot write our eventfds, they ring the doorbell);
//! - flushes QPs a peer moved to ERROR (responder-side errors);
//! - serves the atomic mailbox: atomics on registered memory of ours that is *not* in the
//!   segment, which a peer cannot reach with a CPU atomic (cross-memory attach copies, it is not
//!   atomic); the real `AtomicU64` operation runs here, against our own memory;
//! - retries send backlogs (RNR and not-ready targets) when their timers expire;
//! - notices a peer process's death (its pidfd turns readable): every QP connected to it goes
//!   to ERROR and flushes.
//!
//! Nothing on the data path waits for this thread, except atomics on foreign memory.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::ctx::{CtxShared, DOORBELL_TAG};
use super::exec::{
    MB_ABANDONED, MB_ACCESS, MB_DONE, MB_FREE, MB_INVALID, MB_OK, MB_OP_ADD, MB_OP_CAS, MB_REQUEST,
    MB_SERVING,
};
use super::mrtable::{lookup, Loc};
use super::segment::MAILBOX_SLOTS;
use super::sys;
use crate::AccessFlags;

/// The thread body. `started` is told once the thread holds the liveness mutex.
pub(crate) fn run(sh: Arc<CtxShared>, started: std::sync::mpsc::Sender<()>) {
    if !sh.seg.hold_liveness() {
        tracing::debug!("shm: liveness word unusable; peers detect our death by pidfd only");
    }
    let _ = started.send(());
    serve(&sh);
    sh.seg.release_liveness();
}

fn serve(sh: &Arc<CtxShared>) {
    let sh = &**sh;
    let mut ready = Vec::with_capacity(16);
    loop {
        let timeout_ms = sh.service_sleep_ms();
        let waited = sys::epoll_wait(sh.epoll.as_fd(), timeout_ms, &mut ready);
        sh.service_awake();
        if let Err(err) = waited {
            tracing::warn!(%err, "shm: service epoll_wait failed");
            std::thread::sleep(Duration::from_millis(10));
        }
        if sh.shutdown.load(Ordering::SeqCst) {
            return;
        }
        for &tag in &ready {
            if tag == DOORBELL_TAG {
                let _ = sys::eventfd_drain(sh.seg.doorbell());
            } else {
                peer_died(sh, tag as i32);
            }
        }
        serve_doorbell(sh);
        sh.run_due_timers();
    }
}

fn peer_died(sh: &CtxShared, pid: i32) {
    let watched = sh.watched.lock().remove(&pid);
    if let Some(w) = &watched {
        if let Some(pidfd) = w.watch.pidfd() {
            sys::epoll_del(sh.epoll.as_fd(), pidfd);
        }
    }
    let qps: Vec<_> = sh.qps.lock().values().filter_map(|w| w.upgrade()).collect();
    for qp in &qps {
        qp.peer_died(pid);
    }
    drop(qps);
    tracing::debug!(pid, "shm: peer process exited; its QPs are in ERROR");
}

fn serve_doorbell(sh: &CtxShared) {
    let cqs: Vec<_> = sh.cqs.lock().values().filter_map(|w| w.upgrade()).collect();
    for cq in &cqs {
        cq.deliver_pending_notify();
    }
    drop(cqs);
    let qps: Vec<_> = sh.qps.lock().values().filter_map(|w| w.upgrade()).collect();
    for qp in &qps {
        qp.sync_remote_error();
    }
    drop(qps);
    serve_mailbox(sh);
}

/// Run the atomics peers asked for on our foreign (non-segment) memory.
pub(crate) fn serve_mailbox(sh: &CtxShared) {
    let seg = &sh.seg;
    for i in 0..MAILBOX_SLOTS {
        let slot = seg.mailbox_slot(i);
        match slot.state.load(Ordering::Acquire) {
            MB_REQUEST => {}
            MB_ABANDONED => {
                let _ = slot.state.compare_exchange(
                    MB_ABANDONED,
                    MB_FREE,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                );
                continue;
            }
            _ => continue,
        }
        if slot
            .state
            .compare_exchange(MB_REQUEST, MB_SERVING, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            continue;
        }
        let rkey = slot.rkey.load(Ordering::Relaxed);
        let pd = slot.pd.load(Ordering::Relaxed);
        let addr = slot.addr.load(Ordering::Relaxed);
        let op = slot.op.load(Ordering::Relaxed);
        let compare = slot.compare.load(Ordering::Relaxed);
        let operand = slot.operand.load(Ordering::Relaxed);
        let (status, result) = if addr % 8 != 0 {
            (MB_INVALID, 0)
        } else {
            match lookup(seg, rkey).and_then(|mr| {
                mr.locate(addr, 8, AccessFlags::REMOTE_ATOMIC, pd)
                    .map(|l| (mr, l))
            }) {
                Some((_hold, Loc::Direct(p))) if (p as usize) % 8 == 0 => {
                    // SAFETY: `p` is 8-byte aligned and covers 8 bytes of a region registered
                    // (and held by `_hold`) in our own MR table; our memory, accessed
                    // atomically as every provider access to atomic targets is.
                    let word = unsafe { &*(p as *const AtomicU64) };
                    let v = match op {
                        MB_OP_CAS => match word.compare_exchange(
                            compare,
                            operand,
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        ) {
                            Ok(v) | Err(v) => v,
                        },
                        MB_OP_ADD => word.fetch_add(operand, Ordering::SeqCst),
                        _ => {
                            slot.status.store(MB_INVALID, Ordering::Relaxed);
                            slot.state.store(MB_DONE, Ordering::Release);
                            continue;
                        }
                    };
                    (MB_OK, v)
                }
                _ => (MB_ACCESS, 0),
            }
        };
        slot.result.store(result, Ordering::Relaxed);
        slot.status.store(status, Ordering::Relaxed);
        slot.state.store(MB_DONE, Ordering::Release);
    }
}
