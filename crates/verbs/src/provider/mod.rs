//! The provider contract: what a transport implements to join the verbs object model, and the
//! table of built-in providers.
//!
//! A provider is a leaf. It implements these traits for its own types; the public handles
//! ([`crate::Context`], [`crate::QueuePair`], …) wrap them as trait objects, so one dispatch
//! through a vtable sits on the hot path (`post_send`, `poll`). A provider receives the public
//! handles of its own objects (a QP's CQs, an SRQ) and downcasts them with `as_any`; an object of
//! another provider is refused with `InvalidArgument`.
//!
//! Defaults answer [`VerbsError::Unsupported`], so a new provider starts small; what it
//! advertises in [`crate::Capabilities`] must work.

use std::any::Any;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

use crate::{
    AccessFlags, DeviceAttr, DeviceConfig, DeviceInfo, MrInfo, PortAttr, PostError, QpAttr,
    QpEndpoint, QpInfo, QpInitAttr, QpNum, QpState, RecvWr, Result, SendWr, SrqInitAttr,
    VerbsError, WorkCompletion,
};

pub(crate) mod own_memory;
pub mod pages;
#[cfg(feature = "rdma-core")]
pub mod rdma_core;
#[cfg(feature = "shm")]
pub mod shm;
#[cfg(feature = "tcp")]
pub mod tcp;
#[cfg(feature = "udp")]
pub mod udp;

/// A transport family: discovers and opens its devices.
pub trait Provider: Send + Sync + 'static {
    /// Short name (`shm`, `tcp`, `udp`, `rdma-core`).
    fn name(&self) -> &'static str;
    /// Devices present now (empty when the hardware or library is absent).
    fn devices(&self) -> Result<Vec<DeviceInfo>>;
    /// True if `device` is one of this provider's names (may be true for a device not present;
    /// `open` then reports it).
    fn serves(&self, device: &str) -> bool;
    /// Open a device.
    fn open(&self, device: &str, config: &DeviceConfig) -> Result<Arc<dyn ContextOps>>;
}

/// The built-in providers, in auto-selection preference order.
pub fn providers() -> &'static [&'static dyn Provider] {
    &[
        #[cfg(feature = "rdma-core")]
        &rdma_core::RdmaCoreProvider,
        #[cfg(feature = "shm")]
        &shm::ShmProvider,
        #[cfg(feature = "tcp")]
        &tcp::TcpProvider,
        #[cfg(feature = "udp")]
        &udp::UdpProvider,
    ]
}

/// An opened device.
pub trait ContextOps: Send + Sync + 'static {
    /// The device.
    fn device(&self) -> &DeviceInfo;
    /// Attributes.
    fn query_device(&self) -> DeviceAttr;
    /// Port attributes.
    fn query_port(&self, port: u8) -> Result<PortAttr>;
    /// New protection domain.
    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>>;
    /// New completion queue holding at least `cqe` entries.
    fn create_cq(&self, cqe: u32) -> Result<Arc<dyn CqOps>>;
    /// For downcasting.
    fn as_any(&self) -> &dyn Any;
}

/// A protection domain.
pub trait PdOps: Send + Sync + 'static {
    /// Register caller memory.
    ///
    /// # Safety
    /// As [`crate::ProtectionDomain::reg_mr`].
    unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Box<dyn MrOps>>;
    /// Allocate and register provider memory (zeroed).
    fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<Box<dyn MrOps>>;
    /// Create an RC QP in RESET.
    fn create_qp(&self, init: &QpInitAttr<'_>) -> Result<Arc<dyn QpOps>>;
    /// Create an SRQ.
    fn create_srq(&self, _init: &SrqInitAttr) -> Result<Arc<dyn SrqOps>> {
        Err(VerbsError::unsupported("provider", "shared receive queues"))
    }
    /// For downcasting.
    fn as_any(&self) -> &dyn Any;
}

/// A registered region. Dropping it deregisters: the keys stop working at once.
pub trait MrOps: Send + Sync + 'static {
    /// Identity and bounds.
    fn info(&self) -> MrInfo;
    /// For downcasting.
    fn as_any(&self) -> &dyn Any;
    /// What backs the region's memory.
    fn pages(&self) -> crate::mr::PageKind {
        crate::mr::PageKind::Base
    }
}

/// A completion queue.
pub trait CqOps: Send + Sync + 'static {
    /// Entries the queue holds.
    fn capacity(&self) -> u32;
    /// Non-blocking poll; `Err(CqOverflow)` once completions were lost.
    fn poll(&self, wc: &mut [WorkCompletion]) -> Result<usize>;
    /// False only when a poll now would certainly find nothing (and has nothing else to do,
    /// such as a retry timer the poll runs): a cheap look without taking anything, for busy
    /// pollers. Providers that cannot tell answer true.
    fn may_have_completions(&self) -> bool {
        true
    }
    /// Arm for the next (solicited) completion.
    fn req_notify(&self, _solicited_only: bool) -> Result<()> {
        Err(VerbsError::unsupported("provider", "CQ events"))
    }
    /// Readable when an armed CQ gets a completion.
    fn event_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
    /// Consume pending events, non-blocking; returns how many.
    fn ack_events(&self) -> Result<u32> {
        Err(VerbsError::unsupported("provider", "CQ events"))
    }
    /// Sleep until an event or timeout; true if an event arrived.
    fn wait_event(&self, timeout: Option<Duration>) -> Result<bool> {
        let Some(fd) = self.event_fd() else {
            return Err(VerbsError::unsupported("provider", "CQ events"));
        };
        wait_readable(fd, timeout)
    }
    /// For downcasting.
    fn as_any(&self) -> &dyn Any;
}

/// A shared receive queue.
pub trait SrqOps: Send + Sync + 'static {
    /// Post receives.
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError>;
    /// Receives posted and not yet consumed.
    fn outstanding(&self) -> u32;
    /// For downcasting.
    fn as_any(&self) -> &dyn Any;
}

/// An RC queue pair.
pub trait QpOps: Send + Sync + 'static {
    /// QP number.
    fn qp_num(&self) -> QpNum;
    /// Current state.
    fn state(&self) -> QpState;
    /// Snapshot of attributes.
    fn query(&self) -> QpInfo;
    /// Endpoint for the peer.
    fn endpoint(&self) -> QpEndpoint;
    /// The provider's name, as in the endpoint (checked against the remote's at every RTR):
    /// providers say it without building an endpoint.
    fn provider(&self) -> std::borrow::Cow<'static, str> {
        self.endpoint().provider.into()
    }
    /// Apply a modify; the transition was already checked against the state machine, but the
    /// provider re-checks under its own lock (the state may have moved to ERROR meanwhile).
    fn modify(&self, attr: &QpAttr) -> Result<()>;
    /// Post send requests.
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError>;
    /// Post receive requests.
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError>;
    /// For downcasting.
    fn as_any(&self) -> &dyn Any;
}

/// Block until `fd` is readable or `timeout` passes (poll(2)); true if readable.
pub fn wait_readable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> Result<bool> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    let ts = timeout.map(|d| Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: i64::from(d.subsec_nanos()),
    });
    loop {
        match poll(&mut fds, ts.as_ref()) {
            Ok(n) => return Ok(n > 0),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(VerbsError::io("poll CQ event fd", e)),
        }
    }
}
