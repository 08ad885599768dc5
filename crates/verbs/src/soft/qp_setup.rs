//! Creation and connection checks every software QP shares: the [`QpCore`] built from the
//! verbs `QpInitAttr` and the resources its PD resolved, the endpoint it advertises, and the
//! remote endpoint it accepts at RTR.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::cq::SoftCq;
use super::device::PORT_MTU;
use super::mr::MrTable;
use super::qp::{QpConfig, QpCore};
use super::rq::SoftSrq;
use super::wire::DEFAULT_MAX_PAYLOAD;
use crate::{QpAttr, QpEndpoint, QpInitAttr, QpNum, Result, VerbsError};

/// Where a new QP lives: its provider, device and the address peers reach it at.
pub struct QpHome<'a> {
    /// The provider's name (what a peer's endpoint must name too).
    pub provider: &'a str,
    /// The device name.
    pub device: &'a str,
    /// The context's address.
    pub address: SocketAddr,
    /// Floor under the QP's ACK timeout.
    pub min_ack_timeout: Duration,
}

/// What the PD resolved for a new QP: its CQs, its SRQ and the PD's MR table.
pub struct QpResources {
    /// Completions of send requests.
    pub send_cq: SoftCq,
    /// Completions of receives.
    pub recv_cq: SoftCq,
    /// The shared receive queue, if the QP takes its receives from one.
    pub srq: Option<SoftSrq>,
    /// The PD's memory regions.
    pub table: Arc<MrTable>,
}

/// The core of QP `qpn` and the endpoint it advertises (with transport-specific `extra` keys).
/// The initial PSN is random.
pub fn new_qp(
    home: &QpHome<'_>,
    qpn: u32,
    init: &QpInitAttr<'_>,
    res: QpResources,
    extra: BTreeMap<String, String>,
) -> (QpCore, QpEndpoint) {
    let psn = crate::random_psn();
    let mut caps = init.caps;
    caps.max_recv_sge = caps.max_recv_sge.max(1);
    caps.max_send_sge = caps.max_send_sge.max(1);
    let core = QpCore::new(QpConfig {
        qp_num: QpNum(qpn),
        caps,
        sq_sig_all: init.sq_sig_all,
        send_cq: res.send_cq,
        recv_cq: res.recv_cq,
        table: res.table,
        srq: res.srq,
        max_payload: DEFAULT_MAX_PAYLOAD,
        min_ack_timeout: home.min_ack_timeout,
        initial_psn: psn,
    });
    let endpoint = QpEndpoint {
        provider: home.provider.to_string(),
        device: home.device.to_string(),
        address: home.address.to_string(),
        qp_num: QpNum(qpn),
        psn,
        lid: 0,
        gid: [0; 16],
        mtu: PORT_MTU,
        extra,
    };
    (core, endpoint)
}

/// The remote endpoint of an RTR transition and its address, checked to belong to `provider`.
pub fn rtr_remote<'a>(attr: &'a QpAttr, provider: &str) -> Result<(&'a QpEndpoint, SocketAddr)> {
    let remote = attr
        .remote
        .as_ref()
        .ok_or_else(|| VerbsError::InvalidArgument("RTR needs the remote endpoint".into()))?;
    if remote.provider != provider {
        return Err(VerbsError::InvalidArgument(format!(
            "cannot connect a {provider} QP to a {} QP",
            remote.provider
        )));
    }
    let addr: SocketAddr = remote.address.parse().map_err(|e| {
        VerbsError::InvalidArgument(format!("remote address {:?}: {e}", remote.address))
    })?;
    Ok((remote, addr))
}
