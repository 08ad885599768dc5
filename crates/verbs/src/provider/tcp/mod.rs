//! Provider `tcp`: a software RC transport over TCP, in the manner of the kernel's siw.
//!
//! Owns: the device `tcp0`, its context (a listener, an epoll set, the progress thread), PDs,
//! CQs, QPs and the TCP connections between QPs. The RC semantics (state machine, ordered send
//! queue, responder, memory checks, wire format) come from [`crate::soft`]; this module only
//! moves bytes, drives time, and maps connection events onto QPs.
//!
//! - One TCP connection per connected QP pair. At RTR, the side whose `(address, qpn)` is
//!   smaller connects to the other's listener and sends a HELLO naming the target QP; the
//!   listener side attaches the accepted stream to that QP (parking it until RTR if needed).
//! - Progress: a thread per context waits on epoll (accepts, readable and writable sockets,
//!   timers). Requests are written straight from the posting thread. With
//!   `progress = "busy"` a `poll` on a CQ also reads the sockets, so a spinning poller sees
//!   a completion without a thread wake-up; the thread stays as a fallback.
//! - A malformed frame, a write error or the peer closing moves that QP to ERROR (logged with
//!   `tracing::warn`), flushing its work requests; other QPs are untouched.
//!
//! Options (`DeviceConfig::options`): `progress = "thread" | "busy"` (default `thread`),
//! `min_ack_timeout_ms` (default 1000: the floor under a QP's ACK timeout — TCP already
//! retransmits, so the RC timer only has to catch a peer that stopped answering).
//! Bind address: `DeviceConfig::bind_addr`, else `FABRIQ_TCP_BIND`, else `127.0.0.1:0`.
//! See `docs/arch/tcp.md`.

mod engine;
mod qp;
#[cfg(test)]
mod tests;

use std::any::Any;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::provider::{ContextOps, CqOps, PdOps, Provider, QpOps};
use crate::soft::cq::SoftCq;
use crate::soft::device::{self as soft_device, MAX_SGE};
use crate::soft::mr::MrTable;
use crate::soft::pd::{QpFactory, SoftPd};
use crate::soft::rq::SoftSrq;
use crate::{
    Capabilities, DeviceAttr, DeviceConfig, DeviceInfo, PortAttr, QpInitAttr, Result, Transport,
    VerbsError,
};

use engine::Engine;
pub use engine::ProgressMode;

const PROVIDER: &str = "tcp";
const DEVICE: &str = "tcp0";
/// Env variable overriding the default bind address.
pub const BIND_ENV: &str = "FABRIQ_TCP_BIND";

/// The `tcp` provider.
pub struct TcpProvider;

fn device_info() -> DeviceInfo {
    DeviceInfo {
        name: DEVICE.to_string(),
        provider: PROVIDER.to_string(),
        transport: Transport::Tcp,
        guid: 0x7463_7000_0000_0000 | u64::from(std::process::id()),
        description: "software RC transport over TCP".to_string(),
    }
}

impl Provider for TcpProvider {
    fn name(&self) -> &'static str {
        PROVIDER
    }
    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(vec![device_info()])
    }
    fn serves(&self, device: &str) -> bool {
        device.starts_with("tcp")
    }
    fn open(&self, device: &str, config: &DeviceConfig) -> Result<Arc<dyn ContextOps>> {
        if device != DEVICE {
            return Err(VerbsError::NoDevice(device.to_string()));
        }
        let opts = Options::parse(config)?;
        let engine = Engine::start(device_info(), opts)?;
        Ok(engine)
    }
}

/// Parsed device options.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub bind: SocketAddr,
    pub mode: ProgressMode,
    pub min_ack_timeout: Duration,
}

impl Options {
    fn parse(config: &DeviceConfig) -> Result<Options> {
        let bind = match config.bind_addr {
            Some(a) => a,
            None => match std::env::var(BIND_ENV) {
                Ok(s) if !s.is_empty() => s.parse().map_err(|e| {
                    VerbsError::InvalidArgument(format!(
                        "{BIND_ENV}={s:?} is not a socket address: {e}"
                    ))
                })?,
                _ => SocketAddr::from(([127, 0, 0, 1], 0)),
            },
        };
        let mut opts = Options {
            bind,
            mode: ProgressMode::Thread,
            min_ack_timeout: Duration::from_millis(1000),
        };
        for (k, v) in &config.options {
            match k.as_str() {
                "progress" => {
                    opts.mode = match v.as_str() {
                        "thread" => ProgressMode::Thread,
                        "busy" => ProgressMode::Busy,
                        _ => {
                            return Err(VerbsError::InvalidArgument(format!(
                                "tcp option progress = {v:?}: expected \"thread\" or \"busy\""
                            )))
                        }
                    }
                }
                "min_ack_timeout_ms" => {
                    let ms: u64 = v.parse().map_err(|_| {
                        VerbsError::InvalidArgument(format!(
                            "tcp option min_ack_timeout_ms = {v:?}"
                        ))
                    })?;
                    // Bounded so deadlines never overflow `Instant`.
                    opts.min_ack_timeout = Duration::from_millis(ms.min(3_600_000));
                }
                _ => {
                    return Err(VerbsError::InvalidArgument(format!(
                        "unknown tcp option {k:?} (known: progress, min_ack_timeout_ms)"
                    )))
                }
            }
        }
        Ok(opts)
    }
}

impl ContextOps for Engine {
    fn device(&self) -> &DeviceInfo {
        &self.device
    }
    fn query_device(&self) -> DeviceAttr {
        soft_device::device_attr(Capabilities::empty())
    }
    fn query_port(&self, port: u8) -> Result<PortAttr> {
        soft_device::port_attr(DEVICE, port, "tcp", self.local_addr)
    }
    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>> {
        let engine = self.self_arc()?;
        Ok(Arc::new(SoftPd::new(TcpQpFactory(engine), MAX_SGE)))
    }
    fn create_cq(&self, cqe: u32) -> Result<Arc<dyn CqOps>> {
        let cq = SoftCq::new(cqe)?;
        if self.mode == ProgressMode::Busy {
            let hook: std::sync::Weak<dyn crate::soft::cq::ProgressHook> = self.weak_self.clone();
            cq.set_progress_hook(hook);
        }
        Ok(Arc::new(cq))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// QP creation for this provider's PDs (everything else is [`SoftPd`]'s).
struct TcpQpFactory(Arc<Engine>);

impl QpFactory for TcpQpFactory {
    fn create_qp(
        &self,
        init: &QpInitAttr<'_>,
        send_cq: SoftCq,
        recv_cq: SoftCq,
        srq: Option<SoftSrq>,
        table: Arc<MrTable>,
    ) -> Result<Arc<dyn QpOps>> {
        let qp = qp::TcpQp::create(&self.0, init, send_cq, recv_cq, srq, table)?;
        Ok(qp)
    }
}
