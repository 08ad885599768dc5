//! Provider `shm`: device `shm0`, RC verbs between processes of one host (and between QPs of
//! one process) over shared memory, with truly one-sided READ, WRITE and atomics.
//!
//! Design (the full story is `docs/arch/shm.md`):
//!
//! - Each opened context owns one memfd **segment** ([`segment`]) holding its MR, QP, CQ and
//!   SRQ tables, its receive and completion rings, and the memory of `alloc_mr` regions. A peer
//!   connecting a QP (`modify(rtr)`) duplicates the memfd with `pidfd_getfd` and maps it.
//! - The **initiator does all the work** ([`exec`]): it looks rkeys up in the target's mapped
//!   MR table, copies with `memcpy` (segment memory) or `process_vm_writev/readv` (other
//!   memory), runs real CPU atomics on mapped words, takes receives from the target's ring,
//!   writes the target's receive completion into its CQ and signals it if armed.
//! - Rings ([`ring`]) are lock-free bounded MPMC queues with cache-line slots; their atomics
//!   go through [`sync`], which switches to loom under `cfg(loom)`.
//! - A per-context **service thread** ([`service`]) does slow-path work only: CQ event
//!   forwarding for peers, flushes after peer-induced errors, RNR/transport retries, atomics on
//!   non-segment memory, and peer death (pidfd) → ERROR + flush.
//!
//! `unsafe` lives in this provider only, each block with its `SAFETY` argument: the mapping and
//! the tables in it (`segment`), raw copies and atomics on registered memory (`exec`,
//! `service`), ring slots (`ring`), and system calls (`sys`).
#![allow(unexpected_cfgs)]

mod cq;
mod ctx;
mod exec;
mod mrtable;
mod pd;
mod qp;
mod ring;
mod segment;
mod service;
mod srq;
mod sync;
mod sys;
#[cfg(all(test, not(loom), not(miri)))]
mod tests;

use std::any::Any;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::provider::{ContextOps, CqOps, PdOps, Provider};
use crate::{
    AtomicCap, Capabilities, DeviceAttr, DeviceConfig, DeviceInfo, PortAttr, PortState, Result,
    Transport, VerbsError,
};

#[doc(hidden)]
pub mod bench {
    //! Internals exposed for the criterion benches only.
    pub use super::ring::BenchRing;
}

/// The device name.
pub const DEVICE: &str = "shm0";

/// The `shm` provider.
pub struct ShmProvider;

fn device_info() -> DeviceInfo {
    let boot = sys::boot_id();
    let guid = boot.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    DeviceInfo {
        name: DEVICE.to_string(),
        provider: "shm".to_string(),
        transport: Transport::SharedMemory,
        guid,
        description: "shared-memory RC transport between processes of this host".to_string(),
    }
}

impl Provider for ShmProvider {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(vec![device_info()])
    }

    fn serves(&self, device: &str) -> bool {
        device.starts_with("shm")
    }

    fn open(&self, device: &str, config: &DeviceConfig) -> Result<Arc<dyn ContextOps>> {
        if device != DEVICE {
            return Err(VerbsError::NoDevice(device.to_string()));
        }
        if let Some(key) = config.options.keys().next() {
            return Err(VerbsError::InvalidArgument(format!(
                "unknown shm option {key:?} (shm takes none)"
            )));
        }
        let core = ctx::CtxCore::open(device_info())?;
        Ok(Arc::new(ShmContext { core }))
    }
}

/// An opened `shm0`.
pub struct ShmContext {
    core: Arc<ctx::CtxCore>,
}

/// What the provider supports, advertised in `query_device`.
fn device_attr() -> DeviceAttr {
    DeviceAttr {
        fw_ver: concat!("fabriq-shm ", env!("CARGO_PKG_VERSION")).to_string(),
        vendor_id: 0,
        vendor_part_id: 0,
        hw_ver: segment::VERSION,
        max_mr_size: 1 << 34,
        page_size_cap: segment::PAGE,
        max_qp: segment::MAX_QP - 1,
        max_qp_wr: 1 << 16,
        max_sge: qp::MAX_SGE as u32,
        max_cq: segment::MAX_CQ - 1,
        max_cqe: 1 << 22,
        max_mr: segment::MAX_MR - 1,
        max_pd: u32::MAX,
        max_qp_init_rd_atom: 16,
        max_qp_rd_atom: 16,
        max_srq: segment::MAX_SRQ - 1,
        max_srq_wr: 1 << 16,
        max_inline_data: qp::MAX_INLINE as u32,
        atomic_cap: AtomicCap::Global,
        phys_port_cnt: 1,
        capabilities: Capabilities::SEND
            | Capabilities::SEND_IMM
            | Capabilities::WRITE
            | Capabilities::WRITE_IMM
            | Capabilities::READ
            | Capabilities::ATOMICS
            | Capabilities::SRQ
            | Capabilities::INLINE
            | Capabilities::CQ_EVENTS
            | Capabilities::SYNCHRONISE,
    }
}

impl ContextOps for ShmContext {
    fn device(&self) -> &DeviceInfo {
        &self.core.shared.device
    }

    fn query_device(&self) -> DeviceAttr {
        device_attr()
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        if port != 1 {
            return Err(VerbsError::InvalidArgument(format!(
                "shm0 has no port {port}"
            )));
        }
        Ok(PortAttr {
            port_num: 1,
            state: PortState::Active,
            max_mtu: 4096,
            active_mtu: 4096,
            link_layer: "shared-memory".to_string(),
            lid: 0,
            gid: [0; 16],
            address: self.core.shared.boot_id.clone(),
            speed_gbps: 0,
        })
    }

    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>> {
        let pd = self.core.shared.next_pd.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(pd::ShmPd {
            core: self.core.clone(),
            pd,
        }))
    }

    fn create_cq(&self, cqe: u32) -> Result<Arc<dyn CqOps>> {
        Ok(Arc::new(cq::ShmCq {
            shared: cq::CqShared::create(&self.core, cqe)?,
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
