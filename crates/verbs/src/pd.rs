//! Protection domains (`ibv_pd`): the scope in which memory regions, QPs and SRQs are created.
//! A QP may only use memory regions of its own PD.

use std::sync::Arc;

use crate::provider::PdOps;
use crate::{
    AccessFlags, Context, MemoryRegion, QpInitAttr, QueuePair, Result, SharedReceiveQueue,
    SrqInitAttr, VerbsError,
};

/// A protection domain. Cheap to clone.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) ops: Arc<dyn PdOps>,
    pub(crate) ctx: Context,
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.ctx.device().name)
            .finish()
    }
}

impl ProtectionDomain {
    /// The context it belongs to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Provider-side object.
    pub fn ops(&self) -> &Arc<dyn PdOps> {
        &self.ops
    }

    /// Register caller memory (`ibv_reg_mr`).
    ///
    /// # Safety
    /// `[addr, addr+len)` must be valid, writable memory of this process that stays allocated
    /// (and is not moved or unmapped) until the returned region is dropped. While registered it may
    /// be read and written by the provider and, as the access flags allow, by peers, at any time.
    pub unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        access.validate()?;
        let max = self.ctx.query_device().max_mr_size;
        if len as u64 > max {
            return Err(VerbsError::LimitExceeded(format!(
                "region of {len} bytes exceeds max_mr_size {max}"
            )));
        }
        if addr.is_null() && len > 0 {
            return Err(VerbsError::InvalidArgument("null address".into()));
        }
        // SAFETY: forwarded contract of this function.
        let ops = unsafe { self.ops.reg_mr(addr, len, access)? };
        Ok(MemoryRegion::from_ops(ops))
    }

    /// Allocate `len` zeroed bytes from the provider and register them. The memory lives as long
    /// as the region, and is placed where the provider moves bytes fastest (for `shm`, a shared
    /// segment that peers map for true one-sided access).
    pub fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        access.validate()?;
        let max = self.ctx.query_device().max_mr_size;
        if len == 0 || len as u64 > max {
            return Err(VerbsError::LimitExceeded(format!(
                "region of {len} bytes not in 1..={max}"
            )));
        }
        Ok(MemoryRegion::from_ops(self.ops.alloc_mr(len, access)?))
    }

    /// Create an RC queue pair in the RESET state.
    pub fn create_qp(&self, init: &QpInitAttr<'_>) -> Result<QueuePair> {
        let attr = self.ctx.query_device();
        let c = &init.caps;
        if c.max_send_wr == 0 || c.max_send_wr > attr.max_qp_wr {
            return Err(VerbsError::LimitExceeded(format!(
                "max_send_wr {} not in 1..={}",
                c.max_send_wr, attr.max_qp_wr
            )));
        }
        if init.srq.is_none() && (c.max_recv_wr == 0 || c.max_recv_wr > attr.max_qp_wr) {
            return Err(VerbsError::LimitExceeded(format!(
                "max_recv_wr {} not in 1..={}",
                c.max_recv_wr, attr.max_qp_wr
            )));
        }
        if c.max_send_sge > attr.max_sge || c.max_recv_sge > attr.max_sge {
            return Err(VerbsError::LimitExceeded(format!(
                "max sge {}/{} exceeds {}",
                c.max_send_sge, c.max_recv_sge, attr.max_sge
            )));
        }
        if c.max_inline_data > attr.max_inline_data {
            return Err(VerbsError::LimitExceeded(format!(
                "max_inline_data {} exceeds {}",
                c.max_inline_data, attr.max_inline_data
            )));
        }
        let ops = self.ops.create_qp(init)?;
        Ok(QueuePair::from_ops(ops))
    }

    /// Create a shared receive queue.
    pub fn create_srq(&self, init: &SrqInitAttr) -> Result<SharedReceiveQueue> {
        let attr = self.ctx.query_device();
        if attr.max_srq == 0 {
            return Err(VerbsError::unsupported(
                "verbs",
                format!("{} has no SRQ", self.ctx.device().name),
            ));
        }
        if init.max_wr == 0 || init.max_wr > attr.max_srq_wr {
            return Err(VerbsError::LimitExceeded(format!(
                "srq max_wr {} not in 1..={}",
                init.max_wr, attr.max_srq_wr
            )));
        }
        Ok(SharedReceiveQueue {
            ops: self.ops.create_srq(init)?,
        })
    }
}
