//! The verbs [`ContextOps`] of a software provider's context, written once over
//! [`SoftContext`]: device and port attributes, PDs ([`SoftPd`]) and CQs ([`SoftCq`]) are the
//! same for every software transport; the provider supplies its device, address, extra
//! capabilities, QP creation and, optionally, a busy-poll hook for its CQs.

use std::any::Any;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use super::cq::{ProgressHook, SoftCq};
use super::device::{self, MAX_SGE};
use super::mr::MrTable;
use super::pd::{QpFactory, SoftPd};
use super::qp_setup::QpResources;
use super::rq::SoftSrq;
use crate::provider::{ContextOps, CqOps, PdOps, QpOps};
use crate::{Capabilities, DeviceAttr, DeviceInfo, PortAttr, QpInitAttr, Result};

/// A software provider's context.
pub(crate) trait SoftContext: Send + Sync + Sized + 'static {
    /// The link layer its port reports.
    const LINK_LAYER: &'static str;
    /// Capabilities beyond those every software device has.
    const EXTRA_CAPS: Capabilities;
    /// The provider's QP.
    type Qp: QpOps;

    /// The device this context opened.
    fn info(&self) -> &DeviceInfo;
    /// The address peers reach this context at.
    fn address(&self) -> SocketAddr;
    /// A strong handle of this context (for the PDs it hands out).
    fn strong(&self) -> Result<Arc<Self>>;
    /// Create an RC QP in RESET once the PD has resolved its CQs, SRQ and MR table.
    fn create_qp(
        self: &Arc<Self>,
        init: &QpInitAttr<'_>,
        res: QpResources,
    ) -> Result<Arc<Self::Qp>>;
    /// What polling one of this context's CQs should also drive (`None`: nothing).
    fn progress_hook(&self) -> Option<Weak<dyn ProgressHook>> {
        None
    }
}

impl<C: SoftContext> ContextOps for C {
    fn device(&self) -> &DeviceInfo {
        self.info()
    }

    fn query_device(&self) -> DeviceAttr {
        device::device_attr(C::EXTRA_CAPS)
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        device::port_attr(&self.info().name, port, C::LINK_LAYER, self.address())
    }

    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>> {
        Ok(Arc::new(SoftPd::new(Factory(self.strong()?), MAX_SGE)))
    }

    fn create_cq(&self, cqe: u32) -> Result<Arc<dyn CqOps>> {
        let cq = SoftCq::new(cqe)?;
        if let Some(hook) = self.progress_hook() {
            cq.set_progress_hook(hook);
        }
        Ok(Arc::new(cq))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// QP creation for a software context's PDs (everything else is [`SoftPd`]'s).
struct Factory<C>(Arc<C>);

impl<C: SoftContext> QpFactory for Factory<C> {
    fn create_qp(
        &self,
        init: &QpInitAttr<'_>,
        send_cq: SoftCq,
        recv_cq: SoftCq,
        srq: Option<SoftSrq>,
        table: Arc<MrTable>,
    ) -> Result<Arc<dyn QpOps>> {
        let res = QpResources {
            send_cq,
            recv_cq,
            srq,
            table,
        };
        let qp = C::create_qp(&self.0, init, res)?;
        Ok(qp)
    }
}
