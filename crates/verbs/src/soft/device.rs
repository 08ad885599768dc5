//! Device and port attributes of the software providers: the limits they share, the
//! capabilities every software RC transport has, and one always-active port.

use std::net::SocketAddr;

use crate::{AtomicCap, Capabilities, DeviceAttr, PortAttr, PortState, Result, VerbsError};

/// Inline data a software send request carries, bytes.
pub const MAX_INLINE: u32 = 4096;
/// SGEs per work request.
pub const MAX_SGE: u32 = 16;
/// Outstanding work requests per queue.
pub const MAX_QP_WR: u32 = 16384;
/// The MTU the port reports, bytes.
pub const PORT_MTU: u32 = 4096;

/// Attributes of a software device; `extra` adds transport-specific capabilities (e.g.
/// SYNCHRONISE for a reordering transport).
pub fn device_attr(extra: Capabilities) -> DeviceAttr {
    DeviceAttr {
        fw_ver: env!("CARGO_PKG_VERSION").to_string(),
        vendor_id: 0,
        vendor_part_id: 0,
        hw_ver: 0,
        max_mr_size: 1 << 40,
        page_size_cap: 4096,
        max_qp: 1 << 16,
        max_qp_wr: MAX_QP_WR,
        max_sge: MAX_SGE,
        max_cq: 1 << 16,
        max_cqe: 1 << 20,
        max_mr: 1 << 20,
        max_pd: 1 << 16,
        max_qp_init_rd_atom: 16,
        max_qp_rd_atom: 16,
        max_srq: 1 << 16,
        max_srq_wr: MAX_QP_WR,
        max_inline_data: MAX_INLINE,
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
            | extra,
    }
}

/// Port 1 of a software device: always active, reached at `address` over `link_layer`.
pub fn port_attr(
    device: &str,
    port: u8,
    link_layer: &str,
    address: SocketAddr,
) -> Result<PortAttr> {
    if port != 1 {
        return Err(VerbsError::InvalidArgument(format!(
            "{device} has port 1 only, not {port}"
        )));
    }
    Ok(PortAttr {
        port_num: 1,
        state: PortState::Active,
        max_mtu: PORT_MTU,
        active_mtu: PORT_MTU,
        link_layer: link_layer.to_string(),
        lid: 0,
        gid: [0; 16],
        address: address.to_string(),
        speed_gbps: 0,
    })
}
