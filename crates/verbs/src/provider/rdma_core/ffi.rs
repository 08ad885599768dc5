//! Raw libibverbs ABI: the `#[repr(C)]` structures fabriq passes to the library and the table of
//! functions resolved from `libibverbs.so.1` at run time with `libloading`.
//!
//! Nothing here is linked at build time, so a binary built on a machine without rdma-core runs
//! everywhere and reports "no RDMA device" where the library or the device is absent. Layouts
//! follow rdma-core's `infiniband/verbs.h`, whose user ABI is stable across releases (x86-64
//! and aarch64, LP64). Structures are declared up to the last field fabriq reads or writes; the
//! ones libibverbs fills for us are over-allocated by the callers (see `mod.rs`).
//!
//! Five data-path verbs are `static inline` in verbs.h and dispatch through the context's ops
//! table (`ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq`,
//! `ibv_req_notify_cq`); [`IbvContextOps`] mirrors that table so we can do the same.
#![allow(non_camel_case_types, missing_docs, dead_code)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

#[repr(C)]
pub struct IbvDevice {
    pub _ops: [*mut c_void; 2],
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

pub type PollCqFn = unsafe extern "C" fn(*mut IbvCq, c_int, *mut IbvWc) -> c_int;
pub type ReqNotifyFn = unsafe extern "C" fn(*mut IbvCq, c_int) -> c_int;
pub type PostSrqRecvFn =
    unsafe extern "C" fn(*mut IbvSrq, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;
pub type PostSendFn =
    unsafe extern "C" fn(*mut IbvQp, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int;
pub type PostRecvFn =
    unsafe extern "C" fn(*mut IbvQp, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;

/// `struct ibv_context_ops`: 32 function pointers; the named ones are the inline verbs' targets.
#[repr(C)]
pub struct IbvContextOps {
    pub _compat_0_10: [*mut c_void; 11],
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<ReqNotifyFn>,
    pub _compat_13_19: [*mut c_void; 7],
    pub post_srq_recv: Option<PostSrqRecvFn>,
    pub _compat_21_24: [*mut c_void; 4],
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    pub _compat_27_31: [*mut c_void; 5],
}

#[repr(C)]
pub struct IbvContext {
    pub device: *mut IbvDevice,
    pub ops: IbvContextOps,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvDeviceAttr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: u32,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: u32,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr` (the compat prefix the exported `ibv_query_port` fills, plus the
/// trailing fields, zeroed when the library does not fill them).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvPortAttr {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
    pub _reserved: [u8; 64],
}

#[repr(C)]
pub struct IbvPd {
    pub context: *mut IbvContext,
    pub handle: u32,
}

#[repr(C)]
pub struct IbvMr {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
pub struct IbvCompChannel {
    pub context: *mut IbvContext,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct IbvCq {
    pub context: *mut IbvContext,
    pub channel: *mut IbvCompChannel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
}

#[repr(C)]
pub struct IbvSrq {
    pub context: *mut IbvContext,
}

#[repr(C)]
pub struct IbvQp {
    pub context: *mut IbvContext,
    pub qp_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: u32,
    pub qp_type: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvQpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct IbvQpInitAttr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub cap: IbvQpCap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvSrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

#[repr(C)]
pub struct IbvSrqInitAttr {
    pub srq_context: *mut c_void,
    pub attr: IbvSrqAttr,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvGlobalRoute {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvAhAttr {
    pub grh: IbvGlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvQpAttr {
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: IbvQpCap,
    pub ah_attr: IbvAhAttr,
    pub alt_ah_attr: IbvAhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvSge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `struct ibv_send_wr` (128 bytes on LP64). `wr` is the union: RDMA = {remote_addr, rkey},
/// atomic = {remote_addr, compare_add, swap, rkey}.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvSendWr {
    pub wr_id: u64,
    pub next: *mut IbvSendWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
    pub opcode: u32,
    pub send_flags: u32,
    pub imm_data: u32,
    pub wr: [u64; 4],
    pub qp_type: u32,
    pub _pad: u32,
    pub tail: [u64; 6],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvRecvWr {
    pub wr_id: u64,
    pub next: *mut IbvRecvWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvWc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvAsyncEvent {
    pub element: *mut c_void,
    pub event_type: u32,
}

// enum values
pub const IBV_QPT_RC: u32 = 2;
pub const IBV_QP_STATE: c_int = 1;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_CAP: c_int = 1 << 19;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

pub const IBV_WR_RDMA_WRITE: u32 = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: u32 = 1;
pub const IBV_WR_SEND: u32 = 2;
pub const IBV_WR_SEND_WITH_IMM: u32 = 3;
pub const IBV_WR_RDMA_READ: u32 = 4;
pub const IBV_WR_ATOMIC_CMP_AND_SWP: u32 = 5;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: u32 = 6;

pub const IBV_SEND_FENCE: u32 = 1;
pub const IBV_SEND_SIGNALED: u32 = 1 << 1;
pub const IBV_SEND_SOLICITED: u32 = 1 << 2;
pub const IBV_SEND_INLINE: u32 = 1 << 3;

pub const IBV_WC_WITH_IMM: u32 = 1 << 1;
pub const IBV_WC_RECV: u32 = 1 << 7;
pub const IBV_WC_RECV_RDMA_WITH_IMM: u32 = (1 << 7) + 1;

pub const IBV_EVENT_CQ_ERR: u32 = 0;
pub const IBV_EVENT_QP_FATAL: u32 = 1;
pub const IBV_EVENT_QP_REQ_ERR: u32 = 2;
pub const IBV_EVENT_QP_ACCESS_ERR: u32 = 3;

pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

/// The functions fabriq resolves from libibverbs.
pub struct Verbs {
    _lib: libloading::Library,
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut IbvDevice,
    pub free_device_list: unsafe extern "C" fn(*mut *mut IbvDevice),
    pub get_device_name: unsafe extern "C" fn(*mut IbvDevice) -> *const c_char,
    pub get_device_guid: unsafe extern "C" fn(*mut IbvDevice) -> u64,
    pub open_device: unsafe extern "C" fn(*mut IbvDevice) -> *mut IbvContext,
    pub close_device: unsafe extern "C" fn(*mut IbvContext) -> c_int,
    pub query_device: unsafe extern "C" fn(*mut IbvContext, *mut IbvDeviceAttr) -> c_int,
    pub query_port: unsafe extern "C" fn(*mut IbvContext, u8, *mut IbvPortAttr) -> c_int,
    pub query_gid: unsafe extern "C" fn(*mut IbvContext, u8, c_int, *mut [u8; 16]) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut IbvContext) -> *mut IbvPd,
    pub dealloc_pd: unsafe extern "C" fn(*mut IbvPd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut IbvPd, *mut c_void, usize, c_int) -> *mut IbvMr,
    pub dereg_mr: unsafe extern "C" fn(*mut IbvMr) -> c_int,
    pub create_comp_channel: unsafe extern "C" fn(*mut IbvContext) -> *mut IbvCompChannel,
    pub destroy_comp_channel: unsafe extern "C" fn(*mut IbvCompChannel) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        *mut IbvContext,
        c_int,
        *mut c_void,
        *mut IbvCompChannel,
        c_int,
    ) -> *mut IbvCq,
    pub destroy_cq: unsafe extern "C" fn(*mut IbvCq) -> c_int,
    pub get_cq_event:
        unsafe extern "C" fn(*mut IbvCompChannel, *mut *mut IbvCq, *mut *mut c_void) -> c_int,
    pub ack_cq_events: unsafe extern "C" fn(*mut IbvCq, u32),
    pub create_qp: unsafe extern "C" fn(*mut IbvPd, *mut IbvQpInitAttr) -> *mut IbvQp,
    pub modify_qp: unsafe extern "C" fn(*mut IbvQp, *mut IbvQpAttr, c_int) -> c_int,
    pub query_qp:
        unsafe extern "C" fn(*mut IbvQp, *mut IbvQpAttr, c_int, *mut IbvQpInitAttr) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut IbvQp) -> c_int,
    pub create_srq: unsafe extern "C" fn(*mut IbvPd, *mut IbvSrqInitAttr) -> *mut IbvSrq,
    pub destroy_srq: unsafe extern "C" fn(*mut IbvSrq) -> c_int,
    pub get_async_event: unsafe extern "C" fn(*mut IbvContext, *mut IbvAsyncEvent) -> c_int,
    pub ack_async_event: unsafe extern "C" fn(*mut IbvAsyncEvent),
}

static VERBS: OnceLock<Result<Verbs, String>> = OnceLock::new();

/// The library, loaded once; `Err` says why it is unavailable.
pub fn verbs() -> Result<&'static Verbs, &'static str> {
    VERBS.get_or_init(load).as_ref().map_err(|e| e.as_str())
}

fn load() -> Result<Verbs, String> {
    let name = std::env::var("FABRIQ_LIBIBVERBS").unwrap_or_else(|_| "libibverbs.so.1".into());
    // SAFETY: loading libibverbs runs its constructors, which only initialise the library's own
    // state (provider list, fork detection); it is a well-behaved shared library.
    let lib = unsafe { libloading::Library::new(&name) }
        .map_err(|e| format!("cannot load {name}: {e} (install rdma-core / libibverbs1)"))?;
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: the symbol is looked up by its documented name, and the field's type is the
            // C prototype from verbs.h, so calls through it follow the library's ABI.
            let s = unsafe { lib.get($name) }.map_err(|e| {
                format!(
                    "{name} lacks {}: {e}",
                    String::from_utf8_lossy(&$name[..$name.len() - 1])
                )
            })?;
            *s
        }};
    }
    Ok(Verbs {
        get_device_list: sym!(b"ibv_get_device_list\0"),
        free_device_list: sym!(b"ibv_free_device_list\0"),
        get_device_name: sym!(b"ibv_get_device_name\0"),
        get_device_guid: sym!(b"ibv_get_device_guid\0"),
        open_device: sym!(b"ibv_open_device\0"),
        close_device: sym!(b"ibv_close_device\0"),
        query_device: sym!(b"ibv_query_device\0"),
        query_port: sym!(b"ibv_query_port\0"),
        query_gid: sym!(b"ibv_query_gid\0"),
        alloc_pd: sym!(b"ibv_alloc_pd\0"),
        dealloc_pd: sym!(b"ibv_dealloc_pd\0"),
        reg_mr: sym!(b"ibv_reg_mr\0"),
        dereg_mr: sym!(b"ibv_dereg_mr\0"),
        create_comp_channel: sym!(b"ibv_create_comp_channel\0"),
        destroy_comp_channel: sym!(b"ibv_destroy_comp_channel\0"),
        create_cq: sym!(b"ibv_create_cq\0"),
        destroy_cq: sym!(b"ibv_destroy_cq\0"),
        get_cq_event: sym!(b"ibv_get_cq_event\0"),
        ack_cq_events: sym!(b"ibv_ack_cq_events\0"),
        create_qp: sym!(b"ibv_create_qp\0"),
        modify_qp: sym!(b"ibv_modify_qp\0"),
        query_qp: sym!(b"ibv_query_qp\0"),
        destroy_qp: sym!(b"ibv_destroy_qp\0"),
        create_srq: sym!(b"ibv_create_srq\0"),
        destroy_srq: sym!(b"ibv_destroy_srq\0"),
        get_async_event: sym!(b"ibv_get_async_event\0"),
        ack_async_event: sym!(b"ibv_ack_async_event\0"),
        _lib: lib,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_verbs_h() {
        assert_eq!(size_of::<IbvContextOps>(), 32 * 8);
        assert_eq!(offset_of!(IbvContextOps, poll_cq), 11 * 8);
        assert_eq!(offset_of!(IbvContextOps, post_srq_recv), 20 * 8);
        assert_eq!(offset_of!(IbvContextOps, post_send), 25 * 8);
        assert_eq!(offset_of!(IbvContext, cmd_fd), 8 + 32 * 8);
        assert_eq!(size_of::<IbvSendWr>(), 128);
        assert_eq!(offset_of!(IbvSendWr, wr), 40);
        assert_eq!(size_of::<IbvRecvWr>(), 32);
        assert_eq!(size_of::<IbvWc>(), 48);
        assert_eq!(size_of::<IbvSge>(), 16);
        assert_eq!(size_of::<IbvAhAttr>(), 32);
        assert_eq!(offset_of!(IbvQpAttr, ah_attr), 56);
        assert_eq!(offset_of!(IbvQpAttr, pkey_index), 120);
        assert_eq!(offset_of!(IbvQpAttr, rate_limit), 136);
        assert_eq!(size_of::<IbvQpAttr>(), 140);
        assert_eq!(offset_of!(IbvDeviceAttr, max_qp), 108);
        assert_eq!(offset_of!(IbvDeviceAttr, atomic_cap), 164);
        assert_eq!(size_of::<IbvDeviceAttr>(), 232);
        assert_eq!(offset_of!(IbvQp, qp_num), 52);
        assert_eq!(offset_of!(IbvQpInitAttr, cap), 32);
        assert_eq!(offset_of!(IbvMr, lkey), 36);
        assert_eq!(offset_of!(IbvDevice, name), 24);
    }
}
