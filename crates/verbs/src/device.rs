//! Devices: discovery across providers, attributes (`ibv_query_device`, `ibv_query_port`) and the
//! opened [`Context`] (`ibv_context`).
//!
//! Device names are the provider's: `shm0`, `tcp0`, `udp0`, or a real NIC's (`mlx5_0`, `rxe0`).
//! [`devices`] lists every device of every built-in provider; [`Context::open`] opens one by name.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::provider::{self, ContextOps};
use crate::{CompletionQueue, ProtectionDomain, Result, VerbsError};

/// What kind of link a device sits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum Transport {
    /// Software transport over shared memory (same host).
    SharedMemory,
    /// Software RC transport over TCP.
    Tcp,
    /// Multi-path RC transport (MP-RDMA) over UDP.
    Udp,
    /// InfiniBand HCA.
    InfiniBand,
    /// RoCE (Ethernet) NIC, including soft-RoCE.
    Roce,
    /// iWARP NIC, including siw.
    Iwarp,
}

/// A device as listed by discovery.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceInfo {
    /// Device name, unique on this host (`shm0`, `tcp0`, `mlx5_0`).
    pub name: String,
    /// Provider that serves it (`shm`, `tcp`, `udp`, `rdma-core`).
    pub provider: String,
    /// Link kind.
    pub transport: Transport,
    /// Node GUID or another stable 64-bit id.
    pub guid: u64,
    /// One line for humans.
    pub description: String,
}

/// Atomic capability (`ibv_atomic_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum AtomicCap {
    /// No atomics.
    None,
    /// Atomic only against other atomics through this device (`IBV_ATOMIC_HCA`).
    Hca,
    /// Atomic against the CPU too (`IBV_ATOMIC_GLOB`).
    Global,
}

bitflags::bitflags! {
    /// Operations a device supports; an unadvertised operation is refused with
    /// [`VerbsError::Unsupported`].
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
    pub struct Capabilities: u32 {
        /// SEND / RECV.
        const SEND = 1 << 0;
        /// SEND_WITH_IMM.
        const SEND_IMM = 1 << 1;
        /// RDMA_WRITE.
        const WRITE = 1 << 2;
        /// RDMA_WRITE_WITH_IMM.
        const WRITE_IMM = 1 << 3;
        /// RDMA_READ.
        const READ = 1 << 4;
        /// ATOMIC_CMP_AND_SWP and ATOMIC_FETCH_AND_ADD.
        const ATOMICS = 1 << 5;
        /// Shared receive queues.
        const SRQ = 1 << 6;
        /// Inline sends.
        const INLINE = 1 << 7;
        /// CQ event fd (arm and sleep).
        const CQ_EVENTS = 1 << 8;
        /// The SYNCHRONISE send flag is honoured by a reordering transport.
        const SYNCHRONISE = 1 << 9;
    }
}

/// Device attributes (`ibv_device_attr`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceAttr {
    /// Firmware or provider version.
    pub fw_ver: String,
    /// Vendor id (0 for software providers).
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Largest region that can be registered, bytes.
    pub max_mr_size: u64,
    /// Supported page sizes (bit mask).
    pub page_size_cap: u64,
    /// Max QPs.
    pub max_qp: u32,
    /// Max outstanding work requests per work queue.
    pub max_qp_wr: u32,
    /// Max SGEs per work request.
    pub max_sge: u32,
    /// Max CQs.
    pub max_cq: u32,
    /// Max entries per CQ.
    pub max_cqe: u32,
    /// Max MRs.
    pub max_mr: u32,
    /// Max PDs.
    pub max_pd: u32,
    /// Max outstanding READ/atomic per QP as initiator.
    pub max_qp_init_rd_atom: u32,
    /// Max outstanding READ/atomic per QP as target.
    pub max_qp_rd_atom: u32,
    /// Max SRQs (0 = no SRQ).
    pub max_srq: u32,
    /// Max work requests per SRQ.
    pub max_srq_wr: u32,
    /// Max inline data per send request, bytes.
    pub max_inline_data: u32,
    /// Atomic guarantees.
    pub atomic_cap: AtomicCap,
    /// Physical ports.
    pub phys_port_cnt: u8,
    /// Supported operations.
    pub capabilities: Capabilities,
}

/// Logical port state (`ibv_port_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum PortState {
    /// No link.
    Down,
    /// Link up, not yet configured.
    Init,
    /// Configured, not yet active.
    Armed,
    /// Up and passing traffic.
    Active,
}

/// Port attributes (`ibv_port_attr`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PortAttr {
    /// Port number (1-based).
    pub port_num: u8,
    /// State.
    pub state: PortState,
    /// Largest MTU, bytes.
    pub max_mtu: u32,
    /// Active MTU, bytes.
    pub active_mtu: u32,
    /// `InfiniBand`, `Ethernet`, or the software link (`shared-memory`, `tcp`, `udp`).
    pub link_layer: String,
    /// Local identifier (InfiniBand), 0 elsewhere.
    pub lid: u16,
    /// Port GID 0, or zeros.
    pub gid: [u8; 16],
    /// Where peers reach this port: a socket address for tcp/udp, a host id for shm.
    pub address: String,
    /// Active link speed in Gb/s, 0 if unknown.
    pub speed_gbps: u32,
}

/// Per-device settings given at open time. Providers read what concerns them and ignore the
/// rest; unknown keys in `options` are reported as [`VerbsError::InvalidArgument`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceConfig {
    /// Local address to bind (tcp, udp). Default: the provider's (loopback, ephemeral port),
    /// overridable by the `FABRIQ_<PROVIDER>_BIND` environment variable.
    pub bind_addr: Option<SocketAddr>,
    /// Provider-specific options, `key = value`.
    pub options: BTreeMap<String, String>,
}

/// List every device of every built-in provider. A provider that finds no hardware contributes
/// nothing; it is not an error.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let mut out = Vec::new();
    for p in provider::providers() {
        match p.devices() {
            Ok(list) => out.extend(list),
            Err(err) => tracing::debug!(provider = p.name(), %err, "device discovery failed"),
        }
    }
    Ok(out)
}

/// An opened device (`ibv_context`): the factory for PDs and CQs. Cheap to clone.
#[derive(Clone)]
pub struct Context {
    pub(crate) ops: Arc<dyn ContextOps>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.ops.device().name)
            .finish()
    }
}

impl Context {
    /// Open a device by name with default settings.
    pub fn open(name: &str) -> Result<Context> {
        Self::open_with(name, &DeviceConfig::default())
    }

    /// Open a device by name.
    pub fn open_with(name: &str, config: &DeviceConfig) -> Result<Context> {
        for p in provider::providers() {
            if p.serves(name) {
                let ops = p.open(name, config)?;
                return Ok(Context { ops });
            }
        }
        Err(VerbsError::NoDevice(name.to_string()))
    }

    /// Wrap a provider's context. For provider implementations and tests.
    pub fn from_ops(ops: Arc<dyn ContextOps>) -> Context {
        Context { ops }
    }

    /// Provider-side object.
    pub fn ops(&self) -> &Arc<dyn ContextOps> {
        &self.ops
    }

    /// The device this context opened.
    pub fn device(&self) -> &DeviceInfo {
        self.ops.device()
    }

    /// Device attributes.
    pub fn query_device(&self) -> DeviceAttr {
        self.ops.query_device()
    }

    /// Port attributes (ports are 1-based).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        self.ops.query_port(port)
    }

    /// Allocate a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        Ok(ProtectionDomain {
            ops: self.ops.alloc_pd()?,
            ctx: self.clone(),
        })
    }

    /// Create a completion queue with room for at least `cqe` completions.
    pub fn create_cq(&self, cqe: u32) -> Result<CompletionQueue> {
        let attr = self.query_device();
        if cqe == 0 || cqe > attr.max_cqe {
            return Err(VerbsError::LimitExceeded(format!(
                "cqe {cqe} not in 1..={}",
                attr.max_cqe
            )));
        }
        Ok(CompletionQueue::from_ops(self.ops.create_cq(cqe)?))
    }
}
