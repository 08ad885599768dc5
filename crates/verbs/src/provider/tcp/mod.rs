//! Provider `tcp`: a software RC transport over TCP, in the manner of the kernel's siw.
//!
//! Owns: the device `tcp0`, its context (a listener, an epoll set, the progress thread), PDs,
//! CQs, QPs and the TCP connections between QPs. The RC semantics (state machine, ordered send
//! queue, responder, memory checks, wire format) come from [`crate::soft`]; this module only
//! moves bytes, drives time, and maps connection events onto QPs.
//!
//! - One TCP connection per connected QP pair. At RTR, the side whose `(address, qpn)` is
//!   smaller — or the side that did not reach RTR first, when one says it did
//!   (`QpAttr::before_peer`) — connects to the other's listener and sends a HELLO naming the
//!   target QP; the listener side attaches the accepted stream to that QP (parking it until
//!   RTR if needed).
//! - A QP pair that leaves a healthy connection says BYE on it, and the connection outlives
//!   the pair ([`held`]): the QP that opened it takes it again when it connects again to a QP
//!   of the same context (a QP from a cache), instead of opening another — with a HELLO on it,
//!   or none when the accepting QP reached RTR first and its endpoint names the connection.
//! - Progress: a thread per context waits on epoll (accepts, readable and writable sockets,
//!   timers). Requests are written straight from the posting thread. With
//!   `progress = "busy"` a `poll` on a CQ also reads the sockets, so a spinning poller sees
//!   a completion without a thread wake-up; the thread stays as a fallback.
//! - A malformed frame, a write error or the peer closing moves that QP to ERROR (logged with
//!   `tracing::warn`), flushing its work requests; other QPs are untouched.
//! - Large payloads move between registered memory and the socket with no copy in user space
//!   (`sendmsg` straight from the buffers, `recv` straight into the destination).
//!
//! Options (`DeviceConfig::options`): `progress = "thread" | "busy"` (default `thread`),
//! `min_ack_timeout_ms` (default 1000: the floor under a QP's ACK timeout — TCP already
//! retransmits, so the RC timer only has to catch a peer that stopped answering), `sndbuf` /
//! `rcvbuf` (bytes: `SO_SNDBUF` / `SO_RCVBUF` of each QP connection; default 0, the kernel's
//! autotuning).
//! Bind address: `DeviceConfig::bind_addr`, else `FABRIQ_TCP_BIND`, else `127.0.0.1:0`.
//! See `docs/arch/tcp.md`.

mod data_conn;
mod engine;
mod held;
mod qp;
#[cfg(test)]
mod reuse_tests;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::provider::ContextOps;
use crate::soft::context::SoftContext;
use crate::soft::cq::ProgressHook;
use crate::soft::open::{self as soft_open, SoftProvider};
use crate::soft::qp_setup::QpResources;
use crate::{Capabilities, DeviceConfig, DeviceInfo, QpInitAttr, Result, Transport, VerbsError};

pub use crate::soft::poller::ProgressMode;
use engine::Engine;

const PROVIDER: &str = "tcp";
const DEVICE: &str = "tcp0";
/// Env variable overriding the default bind address.
pub const BIND_ENV: &str = "FABRIQ_TCP_BIND";

/// The `tcp` provider.
pub struct TcpProvider;

impl SoftProvider for TcpProvider {
    const PROVIDER: &'static str = PROVIDER;
    const DEVICE: &'static str = DEVICE;
    const TRANSPORT: Transport = Transport::Tcp;
    const GUID_TAG: u64 = 0x7463_7000_0000_0000;
    const DESCRIPTION: &'static str = "software RC transport over TCP";

    fn start(&self, info: DeviceInfo, config: &DeviceConfig) -> Result<Arc<dyn ContextOps>> {
        Ok(Engine::start(info, Options::parse(config)?)?)
    }
}

/// Parsed device options.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub bind: SocketAddr,
    pub mode: ProgressMode,
    pub min_ack_timeout: Duration,
    /// `SO_SNDBUF` of QP connections in bytes (0: the kernel's autotuning).
    pub sndbuf: usize,
    /// `SO_RCVBUF` of QP connections in bytes (0: the kernel's autotuning).
    pub rcvbuf: usize,
}

/// Default `SO_SNDBUF` of a QP connection.
pub(crate) const DEFAULT_SNDBUF: usize = 0;
/// Default `SO_RCVBUF` of a QP connection.
pub(crate) const DEFAULT_RCVBUF: usize = 0;

impl Options {
    fn parse(config: &DeviceConfig) -> Result<Options> {
        let mut opts = Options {
            bind: soft_open::bind_addr(config, BIND_ENV)?,
            mode: ProgressMode::Thread,
            min_ack_timeout: Duration::from_millis(1000),
            sndbuf: DEFAULT_SNDBUF,
            rcvbuf: DEFAULT_RCVBUF,
        };
        for (k, v) in &config.options {
            match k.as_str() {
                "progress" => opts.mode = ProgressMode::parse(PROVIDER, v)?,
                "min_ack_timeout_ms" => {
                    let ms: u64 = v.parse().map_err(|_| {
                        VerbsError::InvalidArgument(format!(
                            "tcp option min_ack_timeout_ms = {v:?}"
                        ))
                    })?;
                    // Bounded so deadlines never overflow `Instant`.
                    opts.min_ack_timeout = Duration::from_millis(ms.min(3_600_000));
                }
                "sndbuf" | "rcvbuf" => {
                    let bytes: usize = v.parse().map_err(|_| {
                        VerbsError::InvalidArgument(format!("tcp option {k} = {v:?}"))
                    })?;
                    // The kernel caps it at net.core.{w,r}mem_max anyway.
                    let bytes = bytes.min(1 << 30);
                    if k == "sndbuf" {
                        opts.sndbuf = bytes;
                    } else {
                        opts.rcvbuf = bytes;
                    }
                }
                _ => {
                    return Err(VerbsError::InvalidArgument(format!(
                        "unknown tcp option {k:?} (known: progress, min_ack_timeout_ms, sndbuf, \
                         rcvbuf)"
                    )))
                }
            }
        }
        Ok(opts)
    }
}

impl SoftContext for Engine {
    const LINK_LAYER: &'static str = "tcp";
    const EXTRA_CAPS: Capabilities = Capabilities::empty();
    type Qp = qp::TcpQp;

    fn info(&self) -> &DeviceInfo {
        &self.device
    }
    fn address(&self) -> SocketAddr {
        self.local_addr
    }
    fn strong(&self) -> Result<Arc<Engine>> {
        soft_open::upgrade(&self.weak_self, DEVICE)
    }
    fn create_qp(
        self: &Arc<Self>,
        init: &QpInitAttr<'_>,
        res: QpResources,
    ) -> Result<Arc<qp::TcpQp>> {
        qp::TcpQp::create(self, init, res)
    }
    fn progress_hook(&self) -> Option<Weak<dyn ProgressHook>> {
        let hook: Weak<dyn ProgressHook> = self.weak_self.clone();
        (self.mode == ProgressMode::Busy).then_some(hook)
    }
}
