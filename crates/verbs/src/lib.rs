//! fabriq-verbs: the RDMA object model.
//!
//! The libibverbs RC model in idiomatic Rust: [`devices`] and [`Context`] (`ibv_context`),
//! [`ProtectionDomain`], [`MemoryRegion`] with [`AccessFlags`] and random keys,
//! [`CompletionQueue`] (poll, or arm and sleep on an event fd), [`QueuePair`] with the real
//! RESET → INIT → RTR → RTS → ERROR state machine, [`SharedReceiveQueue`], [`SendWr`] /
//! [`RecvWr`] work requests and [`WorkCompletion`]s with verbs [`WcStatus`]es.
//!
//! Providers (see [`provider`]) implement it: `shm` (same host, shared memory, true one-sided
//! access), `tcp` (a software RC transport over TCP), and more behind cargo features. Code above
//! this crate never names a provider type.
//!
//! ```no_run
//! use fabriq_verbs::*;
//! let ctx = Context::open("shm0")?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(256)?;
//! let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
//! let qp = pd.create_qp(&QpInitAttr::new(&cq))?;
//! let remote: QpEndpoint = oob::connect_exchange("127.0.0.1:7000", &qp.endpoint(), std::time::Duration::from_secs(5))?;
//! qp.connect(&remote, AccessFlags::REMOTE_WRITE)?;
//! qp.post_send(&[SendWr::new(1, &[mr.sge(0, 8)?], WrOpcode::Send)])?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]
#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod cq;
mod device;
mod error;
#[allow(unsafe_code)]
pub mod hint;
#[allow(unsafe_code)]
mod mr;
pub mod oob;
#[allow(unsafe_code)]
mod pd;
#[allow(unsafe_code)]
pub mod provider;
mod qp;
#[allow(unsafe_code)]
pub mod soft;
mod srq;
mod wc;
mod wr;

pub use cq::{one_cpu_here, CompletionQueue};
pub use device::{
    devices, AtomicCap, Capabilities, Context, DeviceAttr, DeviceConfig, DeviceInfo, PortAttr,
    PortState, Transport,
};
pub use error::{Result, VerbsError};
pub use mr::{AccessFlags, Lkey, MemoryRegion, MrInfo, PageKind, Rkey};
pub use pd::ProtectionDomain;
pub use qp::{
    ack_timeout, rnr_timer, QpAttr, QpCaps, QpEndpoint, QpInfo, QpInitAttr, QpNum, QpState,
    QueuePair,
};
pub(crate) use qp::{next_psn, random_psn};
pub use srq::{SharedReceiveQueue, SrqInitAttr};
pub use wc::{WcOpcode, WcStatus, WorkCompletion};
pub use wr::{PostError, RecvWr, RemoteAddr, SendFlags, SendWr, Sge, WrOpcode};
