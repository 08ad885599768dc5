//! Provider `udp`: a multi-path software RC transport over UDP (MP-RDMA).
//!
//! Owns: the device `udp0`, its context (one UDP socket per virtual path, an epoll set, the
//! progress thread), PDs, CQs, QPs. The RC semantics come from [`crate::soft`] (`QpCore`), the
//! multi-path reliable transport from `fabriq-mpath`; this module is only a driver: it moves
//! frames between the two, datagrams between mpath and the sockets, and drives time.
//!
//! - Virtual path `k` is the local socket `k`: its source port is what ECMP hashes, so packets
//!   mpath puts on different VPs take different physical paths. A datagram leaves socket `k` for
//!   the peer's socket `k mod n_peer` (the peer's ports travel in the endpoint, key
//!   `udp_ports`) with a 16-byte header (destination QPN, source QPN, the VP stamped)
//!   in front of the mpath datagram; mpath echoes the VP in its ACKs.
//! - One mpath `Connection` per connected QP pair, created at RTR. The receiver demultiplexes by
//!   the destination QPN in the header and accepts only the peer QP from the peer's address.
//! - ECN: every datagram leaves ECT(0) (IP_TOS 2); CE is read back with IP_RECVTOS and passed to
//!   mpath, whose DCTCP-style response shifts load away from marked paths.
//! - A QP that enters ERROR or RESET, or is destroyed, drops its connection and tells the peer
//!   (CLOSE datagram, best effort); a peer that stops answering makes mpath fail after its
//!   retransmission budget: either way the QP goes to ERROR and its work requests flush.
//!
//! - Progress: a thread per context waits on epoll (the sockets, timers). Requests are sent
//!   straight from the posting thread. With `progress = "busy"` a `poll` on a CQ also reads the
//!   sockets and runs due timers, so a spinning poller sees a completion without a thread
//!   wake-up; the thread stays as the fallback and leaves the sockets to a poller while it polls.
//!
//! Options (`DeviceConfig::options`): `progress = thread | busy` (default `thread`), `paths = N`
//! (virtual paths, default 16), `mode =
//! multi | single` (MP-RDMA or the single-path baseline), `mss` (payload bytes per datagram,
//! default fits a 1500-byte MTU), `min_rto_ms` (mpath RTO floor, default 2),
//! `line_rate_mbps` (single-path rate cap, default 10000), `min_ack_timeout_ms` (RC safety-net
//! timer floor, default 1000), `delta` (mpath's out-of-order tolerance Δ in packets, default
//! 32), `bitmap` (mpath's receive bitmap L in packets, above Δ, default 256: the paper's NIC
//! keeps 64, but a software receiver can afford a window that covers the millisecond round
//! trips of a kernel-queued path, so a loss does not drop everything sent during its repair),
//! `gso` (datagrams per UDP GSO send, 1 = off,
//! default 1), `gro` (`on` | `off`, UDP GRO on receive, default off). Bind address:
//! `DeviceConfig::bind_addr`, else `FABRIQ_UDP_BIND`, else `127.0.0.1:0`; a non-zero port
//! makes the VP sockets take consecutive ports from it, port 0 gives each an ephemeral port.
//! Counters for experiments: [`qp_stats`]. See `docs/arch/udp.md`.

mod engine;
mod qp;
mod sys;
#[cfg(test)]
mod tests;
mod wire;

use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::provider::ContextOps;
use crate::soft::context::SoftContext;
use crate::soft::cq::ProgressHook;
use crate::soft::open::{self as soft_open, SoftProvider};
use crate::soft::poller::ProgressMode;
use crate::soft::qp_setup::QpResources;
use crate::{Capabilities, DeviceConfig, DeviceInfo, QpInitAttr, Result, Transport, VerbsError};

use engine::Engine;
pub use engine::SocketStats;

const PROVIDER: &str = "udp";
const DEVICE: &str = "udp0";
/// Env variable overriding the default bind address.
pub const BIND_ENV: &str = "FABRIQ_UDP_BIND";
/// IPv4 + UDP + our header + mpath's data header, taken from a 1500-byte MTU.
const DEFAULT_MSS: u16 =
    (1500 - 20 - 8 - wire::HEADER_LEN - fabriq_mpath::frame::DATA_HEADER_LEN) as u16;

/// mpath's receive bitmap L: four times the paper's 64 slots (see the module docs).
const DEFAULT_BITMAP: u32 = 256;

/// The `udp` provider.
pub struct UdpProvider;

impl SoftProvider for UdpProvider {
    const PROVIDER: &'static str = PROVIDER;
    const DEVICE: &'static str = DEVICE;
    const TRANSPORT: Transport = Transport::Udp;
    const GUID_TAG: u64 = 0x7564_7000_0000_0000;
    const DESCRIPTION: &'static str = "multi-path (MP-RDMA) software RC transport over UDP";

    fn start(&self, info: DeviceInfo, config: &DeviceConfig) -> Result<Arc<dyn ContextOps>> {
        Ok(Engine::start(info, Options::parse(config)?)?)
    }
}

/// Parsed device options.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub bind: SocketAddr,
    pub paths: u16,
    pub min_ack_timeout: Duration,
    /// Who reads the sockets: the progress thread alone, or CQ pollers too.
    pub progress: ProgressMode,
    /// Datagrams one UDP GSO send may carry (1: no GSO).
    pub gso_segments: usize,
    /// UDP GRO on the receive sockets.
    pub gro: bool,
    /// Template of every QP's connection (the seed is drawn per connection).
    pub mpath: fabriq_mpath::Config,
}

fn bad(k: &str, v: &str, what: &str) -> VerbsError {
    VerbsError::InvalidArgument(format!("udp option {k} = {v:?}: {what}"))
}

fn num<T: std::str::FromStr>(k: &str, v: &str) -> Result<T> {
    v.parse().map_err(|_| bad(k, v, "not a number"))
}

impl Options {
    fn parse(config: &DeviceConfig) -> Result<Options> {
        let bind = soft_open::bind_addr(config, BIND_ENV)?;
        let mut mpath = fabriq_mpath::Config {
            num_paths: 16,
            mss: DEFAULT_MSS,
            bitmap_len: DEFAULT_BITMAP,
            min_rto: Duration::from_millis(2),
            initial_rtt: Duration::from_micros(200),
            max_message_len: qp::MAX_FRAME as u64,
            ..fabriq_mpath::Config::default()
        };
        mpath.dcqcn.line_rate_bps = 10e9;
        let mut min_ack_timeout = Duration::from_millis(1000);
        let mut gso_segments = 1usize;
        let mut gro = false;
        let mut progress = ProgressMode::Thread;
        for (k, v) in &config.options {
            match k.as_str() {
                "progress" => progress = ProgressMode::parse(PROVIDER, v)?,
                "paths" => {
                    mpath.num_paths = num(k, v)?;
                    if mpath.num_paths == 0 || mpath.num_paths > 1024 {
                        return Err(bad(k, v, "expected 1..=1024"));
                    }
                }
                "mode" => {
                    mpath.mode = match v.as_str() {
                        "multi" => fabriq_mpath::Mode::MultiPath,
                        "single" => fabriq_mpath::Mode::SinglePath,
                        _ => return Err(bad(k, v, "expected \"multi\" or \"single\"")),
                    }
                }
                "mss" => mpath.mss = num(k, v)?,
                "min_rto_ms" => mpath.min_rto = Duration::from_millis(num(k, v)?),
                "line_rate_mbps" => mpath.dcqcn.line_rate_bps = num::<f64>(k, v)? * 1e6,
                "min_ack_timeout_ms" => min_ack_timeout = Duration::from_millis(num(k, v)?),
                "delta" => mpath.delta = num(k, v)?,
                "bitmap" => mpath.bitmap_len = num(k, v)?,
                "gso" => {
                    gso_segments = num(k, v)?;
                    if gso_segments == 0 || gso_segments > sys::MAX_GSO_SEGMENTS {
                        return Err(bad(k, v, "expected 1..=64 datagrams per send"));
                    }
                }
                "gro" => {
                    gro = match v.as_str() {
                        "on" => true,
                        "off" => false,
                        _ => return Err(bad(k, v, "expected \"on\" or \"off\"")),
                    }
                }
                _ => {
                    return Err(VerbsError::InvalidArgument(format!(
                        "unknown udp option {k:?} (known: progress, paths, mode, mss, \
                         min_rto_ms, line_rate_mbps, min_ack_timeout_ms, delta, bitmap, gso, gro)"
                    )))
                }
            }
        }
        mpath.single_path = 0;
        mpath
            .validate()
            .map_err(|e| VerbsError::InvalidArgument(format!("udp options: {e}")))?;
        Ok(Options {
            bind,
            paths: mpath.num_paths,
            min_ack_timeout,
            progress,
            gso_segments,
            gro,
            mpath,
        })
    }
}

impl SoftContext for Engine {
    const LINK_LAYER: &'static str = "udp";
    const EXTRA_CAPS: Capabilities = Capabilities::SYNCHRONISE;
    type Qp = qp::UdpQp;

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
    ) -> Result<Arc<qp::UdpQp>> {
        qp::UdpQp::create(self, init, res)
    }
    fn progress_hook(&self) -> Option<Weak<dyn ProgressHook>> {
        let hook: Weak<dyn ProgressHook> = self.weak_self.clone();
        (self.opts.progress == ProgressMode::Busy).then_some(hook)
    }
}

/// Counters of one `udp` QP: its mpath connection's and its context's sockets'.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct QpStats {
    /// The current connection's counters (else the last one's; `None` before the first RTR).
    pub mpath: Option<fabriq_mpath::Stats>,
    /// The context's socket counters (shared by every QP of the context).
    pub sockets: SocketStats,
}

/// The counters of `qp`, or `None` if it is not a `udp` QP. For experiments and diagnostics:
/// reordering (`mpath.max_ooo_gap`), retransmissions, system calls per datagram.
pub fn qp_stats(qp: &crate::QueuePair) -> Option<QpStats> {
    let udp = qp.ops().as_any().downcast_ref::<qp::UdpQp>()?;
    Some(QpStats {
        mpath: udp.stats(),
        sockets: udp.engine().socket_stats(),
    })
}
