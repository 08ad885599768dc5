//! Asymmetric memory barriers for the worker's park hand-shake.
//!
//! A thread that made progress looks whether anyone parks waiting for it (after every pass
//! that did work, every direct send); a thread about to park looks whether work arrived
//! meanwhile. Each side writes one thing and reads the other's, which needs a
//! store-load barrier on both sides — a full fence, tens of cycles, on every message for the
//! side that progresses, while the side that parks is about to spend microseconds anyway.
//! Linux's `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` moves the cost: the parker's
//! [`heavy`] makes every running thread of the process execute a full barrier, so the
//! progressing side's [`light`] only has to keep the compiler from reordering. Where the kernel
//! lacks it (before 4.14, or a sandbox that filters it), both sides fall back to fences.

use std::sync::atomic::{compiler_fence, fence, Ordering};
use std::sync::OnceLock;

use rustix::thread::{membarrier, membarrier_query, MembarrierCommand, MembarrierQuery};

static ASYMMETRIC: OnceLock<bool> = OnceLock::new();

/// Register the process for expedited barriers (once); true when they are available. The
/// answer never changes afterwards: a worker reads it once, before its threads pair barriers.
pub(crate) fn asymmetric() -> bool {
    *ASYMMETRIC.get_or_init(|| {
        let needed =
            MembarrierQuery::PRIVATE_EXPEDITED | MembarrierQuery::REGISTER_PRIVATE_EXPEDITED;
        membarrier_query().contains(needed)
            && membarrier(MembarrierCommand::RegisterPrivateExpedited).is_ok()
    })
}

/// The progressing side's barrier (its write before, its read of the parked count after).
#[inline]
pub(crate) fn light(asymmetric: bool) {
    if asymmetric {
        compiler_fence(Ordering::SeqCst);
    } else {
        fence(Ordering::SeqCst);
    }
}

/// The parking side's barrier (its announcement before, its look for work after).
pub(crate) fn heavy(asymmetric: bool) {
    if asymmetric {
        // Registered: the call does not fail. Were it to, a parker could miss a wake-up
        // until its timeout (a park is capped), never forever.
        let _ = membarrier(MembarrierCommand::PrivateExpedited);
    }
    fence(Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::sync::Arc;

    /// The hand-shake the barriers serve, many times over: a waiter announces itself and then
    /// looks for the work; the other side posts work and then looks for a waiter. At least
    /// one of the two must see the other's write in every round (else a wake-up is lost).
    #[test]
    fn one_side_always_sees_the_other() {
        let asym = asymmetric();
        let rounds = 2_000u64;
        // Round numbers: the waiter's announcement, the posted work, the round started (by the
        // poster) and finished (by the waiter), and what the waiter saw.
        let waiter_at = Arc::new(AtomicU64::new(0));
        let work_at = Arc::new(AtomicU64::new(0));
        let started = Arc::new(AtomicU64::new(0));
        let finished = Arc::new(AtomicU64::new(0));
        let saw_work = Arc::new(AtomicBool::new(false));
        let t = {
            let (waiter_at, work_at, started, finished, saw_work) = (
                Arc::clone(&waiter_at),
                Arc::clone(&work_at),
                Arc::clone(&started),
                Arc::clone(&finished),
                Arc::clone(&saw_work),
            );
            std::thread::spawn(move || {
                for r in 1..=rounds {
                    while started.load(Ordering::Acquire) < r {
                        std::hint::spin_loop();
                    }
                    waiter_at.store(r, Ordering::Relaxed);
                    heavy(asym);
                    saw_work.store(work_at.load(Ordering::Relaxed) >= r, Ordering::Relaxed);
                    finished.store(r, Ordering::Release);
                }
            })
        };
        let mut missed = 0;
        for r in 1..=rounds {
            started.store(r, Ordering::Release);
            work_at.store(r, Ordering::Relaxed);
            light(asym);
            let saw_waiter = waiter_at.load(Ordering::Relaxed) >= r;
            while finished.load(Ordering::Acquire) < r {
                std::hint::spin_loop();
            }
            if !saw_waiter && !saw_work.load(Ordering::Relaxed) {
                missed += 1;
            }
        }
        t.join().expect("waiter");
        assert_eq!(missed, 0, "rounds where a wake-up would have been lost");
    }
}
