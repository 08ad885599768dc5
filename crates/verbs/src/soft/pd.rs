//! The protection domain of the software providers: an [`MrTable`] shared by its QPs and SRQs.
//!
//! Registration, allocation and SRQs are the same for every software transport; only QP
//! creation differs (it binds the QP to the provider's transport), so a provider supplies a
//! [`QpFactory`] and gets a complete [`PdOps`].

use std::any::Any;
use std::sync::Arc;

use super::cq::SoftCq;
use super::mr::{MrTable, SoftMr};
use super::rq::SoftSrq;
use crate::provider::{MrOps, PdOps, QpOps, SrqOps};
use crate::{AccessFlags, QpInitAttr, Result, SrqInitAttr, VerbsError};

/// How a provider creates a QP once the PD has resolved its CQs, SRQ and MR table.
pub trait QpFactory: Send + Sync + 'static {
    /// Create an RC QP in RESET on this provider's transport.
    fn create_qp(
        &self,
        init: &QpInitAttr<'_>,
        send_cq: SoftCq,
        recv_cq: SoftCq,
        srq: Option<SoftSrq>,
        table: Arc<MrTable>,
    ) -> Result<Arc<dyn QpOps>>;
}

/// A protection domain of a software provider.
pub struct SoftPd<F: QpFactory> {
    factory: F,
    table: Arc<MrTable>,
    /// Largest SGE list an SRQ of this PD takes.
    max_sge: u32,
}

impl<F: QpFactory> SoftPd<F> {
    /// A new PD with an empty MR table.
    pub fn new(factory: F, max_sge: u32) -> SoftPd<F> {
        SoftPd {
            factory,
            table: MrTable::new(),
            max_sge,
        }
    }
}

impl<F: QpFactory> PdOps for SoftPd<F> {
    unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Box<dyn MrOps>> {
        // SAFETY: forwarded contract of `ProtectionDomain::reg_mr`: the memory stays valid until
        // the region is dropped.
        let mr = unsafe {
            self.table
                .register(addr as usize as u64, len as u64, access, None)
        };
        Ok(Box::new(mr))
    }

    fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<Box<dyn MrOps>> {
        Ok(Box::new(SoftMr::alloc(&self.table, len, access)?))
    }

    fn create_qp(&self, init: &QpInitAttr<'_>) -> Result<Arc<dyn QpOps>> {
        let soft_cq = |cq: &crate::CompletionQueue| -> Result<SoftCq> {
            cq.ops()
                .as_any()
                .downcast_ref::<SoftCq>()
                .cloned()
                .ok_or_else(|| VerbsError::InvalidArgument("CQ of another provider".into()))
        };
        let send_cq = soft_cq(init.send_cq)?;
        let recv_cq = soft_cq(init.recv_cq)?;
        let srq = match init.srq {
            Some(s) => {
                let srq = s
                    .ops()
                    .as_any()
                    .downcast_ref::<SoftSrqOps>()
                    .ok_or_else(|| VerbsError::InvalidArgument("SRQ of another provider".into()))?;
                if !Arc::ptr_eq(srq.srq.table(), &self.table) {
                    return Err(VerbsError::InvalidArgument("SRQ of another PD".into()));
                }
                Some(srq.srq.clone())
            }
            None => None,
        };
        self.factory
            .create_qp(init, send_cq, recv_cq, srq, self.table.clone())
    }

    fn create_srq(&self, init: &SrqInitAttr) -> Result<Arc<dyn SrqOps>> {
        if init.max_sge > self.max_sge {
            return Err(VerbsError::LimitExceeded(format!(
                "srq max_sge {} exceeds {}",
                init.max_sge, self.max_sge
            )));
        }
        Ok(Arc::new(SoftSrqOps {
            srq: SoftSrq::new(init, self.table.clone()),
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// An SRQ of a software provider.
pub struct SoftSrqOps {
    srq: SoftSrq,
}

impl SrqOps for SoftSrqOps {
    fn post_recv(&self, wrs: &[crate::RecvWr<'_>]) -> Result<(), crate::PostError> {
        self.srq.post_recv(wrs)
    }
    fn outstanding(&self) -> u32 {
        self.srq.outstanding()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
