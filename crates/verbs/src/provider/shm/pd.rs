//! Protection domains and memory regions.
//!
//! `alloc_mr` memory is carved from our segment's heap, so peers reach it through their
//! mapping of the segment: copies and atomics without the owner's CPU and without a system
//! call. `reg_mr` of caller memory that happens to lie in our segment (a sub-range of an
//! `alloc_mr` region) is treated the same way; other caller memory is "foreign": peers reach it
//! with cross-memory attach, and atomics on it are served by our service thread.

use std::any::Any;
use std::sync::Arc;

use super::ctx::CtxCore;
use super::mrtable::{invalidate, publish, MrEntry, MR_KIND_FOREIGN, MR_KIND_SEGMENT};
use super::qp::{QpInner, ShmQp};
use super::segment::Heap;
use super::srq::{ShmSrq, SrqShared};
use crate::provider::{MrOps, PdOps, QpOps, SrqOps};
use crate::{AccessFlags, Lkey, MrInfo, QpInitAttr, Result, Rkey, SrqInitAttr, VerbsError};

/// The provider object behind a `ProtectionDomain`.
pub(crate) struct ShmPd {
    pub(crate) core: Arc<CtxCore>,
    pub(crate) pd: u32,
}

impl ShmPd {
    fn register(&self, entry: MrEntry, heap_run: Option<(u64, u64)>) -> Result<Box<dyn MrOps>> {
        let sh = &self.core.shared;
        let Some(index) = sh.mr_ids.lock().take() else {
            if let Some((off, len)) = heap_run {
                sh.heap.lock().free(&sh.seg, off, len);
            }
            return Err(VerbsError::LimitExceeded("too many memory regions".into()));
        };
        let key = publish(&sh.seg, index, &entry);
        Ok(Box::new(ShmMr {
            core: self.core.clone(),
            index,
            heap_run,
            info: MrInfo {
                addr: entry.addr,
                len: entry.len,
                lkey: Lkey(key),
                rkey: Rkey(key),
                access: entry.access,
            },
        }))
    }
}

impl PdOps for ShmPd {
    unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Box<dyn MrOps>> {
        let sh = &self.core.shared;
        let addr = addr as usize as u64;
        let len = len as u64;
        let entry = match sh.seg.heap_offset_of(addr, len) {
            Some(seg_off) => MrEntry {
                addr,
                len,
                access,
                pd: self.pd,
                kind: MR_KIND_SEGMENT,
                seg_off,
            },
            None => MrEntry {
                addr,
                len,
                access,
                pd: self.pd,
                kind: MR_KIND_FOREIGN,
                seg_off: 0,
            },
        };
        self.register(entry, None)
    }

    fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<Box<dyn MrOps>> {
        let sh = &self.core.shared;
        let len = len as u64;
        let rounded = Heap::rounded(len)
            .ok_or_else(|| VerbsError::LimitExceeded(format!("region of {len} bytes")))?;
        let off = sh
            .heap
            .lock()
            .alloc(rounded)
            .ok_or_else(|| VerbsError::LimitExceeded("shm segment heap exhausted".into()))?;
        let addr = sh.seg.base() as u64 + off;
        self.register(
            MrEntry {
                addr,
                len,
                access,
                pd: self.pd,
                kind: MR_KIND_SEGMENT,
                seg_off: off,
            },
            Some((off, rounded)),
        )
    }

    fn create_qp(&self, init: &QpInitAttr<'_>) -> Result<Arc<dyn QpOps>> {
        Ok(Arc::new(ShmQp {
            inner: QpInner::create(&self.core, self.pd, init)?,
        }))
    }

    fn create_srq(&self, init: &SrqInitAttr) -> Result<Arc<dyn SrqOps>> {
        Ok(Arc::new(ShmSrq {
            shared: SrqShared::create(&self.core, self.pd, init)?,
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A registered region: table entry `index`, and for `alloc_mr` the heap run it owns.
pub(crate) struct ShmMr {
    core: Arc<CtxCore>,
    index: u32,
    heap_run: Option<(u64, u64)>,
    info: MrInfo,
}

impl MrOps for ShmMr {
    fn info(&self) -> MrInfo {
        self.info
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn pages(&self) -> crate::PageKind {
        let huge = crate::provider::pages::HUGE_PAGE as u64;
        let aligned = self.info.addr % huge == 0 && self.info.len % huge == 0;
        if self.heap_run.is_some() && aligned && self.core.shared.seg.huge_pages() {
            crate::PageKind::Transparent
        } else {
            crate::PageKind::Base
        }
    }
}

impl Drop for ShmMr {
    fn drop(&mut self) {
        let sh = &self.core.shared;
        let slot = sh.seg.mr_slot(self.index);
        if invalidate(&slot.key, &slot.active, || false) {
            if let Some((off, len)) = self.heap_run {
                sh.heap.lock().free(&sh.seg, off, len);
            }
            sh.mr_ids.lock().give(self.index);
        } else {
            tracing::warn!(
                rkey = self.info.rkey.0,
                "shm: an access stayed inside a deregistered region; entry and memory quarantined"
            );
        }
    }
}
