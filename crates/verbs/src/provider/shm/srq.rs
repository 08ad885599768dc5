//! Shared receive queues: one receive ring in our segment that every QP attached to it (and
//! so every peer sending to those QPs) draws from. The ring is multi-consumer: senders in any
//! process claim entries with a compare-and-swap, so each receive is consumed exactly once.

use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::ctx::CtxCore;
use super::qp::{RecvEntry, MAX_SGE};
use super::segment::SegRing;
use crate::provider::SrqOps;
use crate::{PostError, RecvWr, Result, SrqInitAttr, VerbsError};

/// The owner's side of an SRQ.
pub(crate) struct SrqShared {
    pub(crate) core: Arc<CtxCore>,
    pub(crate) index: u32,
    ring: SegRing<RecvEntry>,
    max_wr: u32,
    max_sge: u32,
}

impl SrqShared {
    /// A new SRQ.
    pub(crate) fn create(
        core: &Arc<CtxCore>,
        pd: u32,
        init: &SrqInitAttr,
    ) -> Result<Arc<SrqShared>> {
        if init.max_sge as usize > MAX_SGE {
            return Err(VerbsError::LimitExceeded(format!(
                "more than {MAX_SGE} SGEs"
            )));
        }
        let sh = &core.shared;
        let index = sh
            .srq_ids
            .lock()
            .take()
            .ok_or_else(|| VerbsError::LimitExceeded("too many SRQs".into()))?;
        let ring = match SegRing::<RecvEntry>::alloc(&sh.seg, &sh.heap, init.max_wr) {
            Ok(r) => r,
            Err(e) => {
                sh.srq_ids.lock().give(index);
                return Err(e);
            }
        };
        let slot = sh.seg.srq_slot(index);
        slot.cap.store(ring.cap as u32, Ordering::Relaxed);
        slot.ring_off.store(ring.off, Ordering::Relaxed);
        slot.pd.store(pd, Ordering::Relaxed);
        slot.live.store(1, Ordering::Release);
        Ok(Arc::new(SrqShared {
            core: core.clone(),
            index,
            ring,
            max_wr: init.max_wr,
            max_sge: init.max_sge.max(1),
        }))
    }
}

impl Drop for SrqShared {
    fn drop(&mut self) {
        // QPs hold their SRQ, and a QP is destroyed only once no peer is inside it, so no
        // sender can be inside this ring any more.
        let sh = &self.core.shared;
        sh.seg.srq_slot(self.index).live.store(0, Ordering::SeqCst);
        self.ring.release(&sh.heap);
        sh.srq_ids.lock().give(self.index);
    }
}

/// The provider object behind a `SharedReceiveQueue`.
pub(crate) struct ShmSrq {
    pub(crate) shared: Arc<SrqShared>,
}

impl SrqOps for ShmSrq {
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let s = &self.shared;
        let ring = s.ring.ring();
        if wrs.len() > 1 {
            ring.prefetch_push_run(wrs.len());
        }
        for (index, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > s.max_sge as usize {
                return Err(PostError {
                    index,
                    source: VerbsError::InvalidArgument(format!(
                        "{} SGEs exceed the SRQ's max_sge {}",
                        wr.sg_list.len(),
                        s.max_sge
                    )),
                });
            }
            let pushed = ring.push_limited(u64::from(s.max_wr), |p| {
                // SAFETY: `push_limited` hands over a claimed slot of the SRQ ring; `write_wr`
                // writes at most MAX_SGE SGEs.
                unsafe { RecvEntry::write_wr(p, wr) }
            });
            if pushed.is_err() {
                return Err(PostError {
                    index,
                    source: VerbsError::QueueFull,
                });
            }
        }
        Ok(())
    }

    fn outstanding(&self) -> u32 {
        self.shared.ring.ring().len() as u32
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
