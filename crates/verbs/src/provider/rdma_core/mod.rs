//! Provider `rdma-core`: real RDMA NICs (InfiniBand, RoCE, iWARP, and the kernel's soft-RoCE `rxe`
//! and `siw`) through libibverbs.
//!
//! The library is loaded at run time ([`ffi::verbs`]), never linked: a binary built on a machine
//! without rdma-core runs everywhere and lists no devices where the library or a device is
//! absent. With rdma-core installed but no device, `ibv_get_device_list` returns NULL with errno
//! `ENOSYS` (no `/sys/class/infiniband_verbs`); that is "no devices", not a failure.
//!
//! Each public object owns its verbs object and destroys it on drop, children first: a QP holds
//! its CQs, SRQ and PD alive; every object holds its context. An async-event thread per context
//! turns `IBV_EVENT_CQ_ERR` into the CQ's overflow flag (so `poll` reports
//! [`VerbsError::CqOverflow`]) and logs QP fatal events.
//!
//! RoCE addressing: the GID index is the first RoCE v2 GID holding an IPv4-mapped address (read
//! from sysfs `gid_attrs/types`), else the first RoCE v2 GID, else 0; `FABRIQ_GID_INDEX`
//! overrides. InfiniBand ports use the LID.
#![allow(unsafe_code)]

pub mod ffi;

use std::any::Any;
use std::collections::HashMap;
use std::ffi::{c_int, c_void, CStr};
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use self::ffi::*;
use crate::provider::{ContextOps, CqOps, MrOps, PdOps, Provider, QpOps, SrqOps};
use crate::{
    AccessFlags, AtomicCap, Capabilities, DeviceAttr, DeviceConfig, DeviceInfo, MrInfo, PortAttr,
    PortState, PostError, QpAttr, QpCaps, QpEndpoint, QpInfo, QpInitAttr, QpNum, QpState, RecvWr,
    Result, SendFlags, SendWr, SrqInitAttr, Transport, VerbsError, WcOpcode, WcStatus,
    WorkCompletion, WrOpcode,
};

const PROVIDER: &str = "rdma-core";
const PORT: u8 = 1;
const MAX_SGE_STACK: usize = 16;
/// Inline size requested from the device; libibverbs has no attribute for it.
const MAX_INLINE: u32 = 64;

/// The `rdma-core` provider.
pub struct RdmaCoreProvider;

fn errno_err(what: &str) -> VerbsError {
    VerbsError::io(what.to_string(), std::io::Error::last_os_error())
}

fn rc_err(what: &str, rc: c_int) -> VerbsError {
    // Verbs calls return either -1 with errno or a positive errno value.
    let err = if rc > 0 {
        std::io::Error::from_raw_os_error(rc)
    } else {
        std::io::Error::last_os_error()
    };
    if err.raw_os_error() == Some(libc::EINVAL) {
        return VerbsError::InvalidArgument(format!("{what}: refused by the device (EINVAL)"));
    }
    VerbsError::io(what.to_string(), err)
}

/// Devices libibverbs sees: (name, guid, transport).
fn list() -> Result<Vec<(String, u64, c_int, c_int)>> {
    let Ok(v) = ffi::verbs() else {
        return Ok(Vec::new());
    };
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the returned array is freed below.
    let devs = unsafe { (v.get_device_list)(&mut n) };
    if devs.is_null() {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOSYS) {
            return Ok(Vec::new());
        }
        return Err(VerbsError::io("ibv_get_device_list", e));
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the array holds `n` valid device pointers.
        let d = unsafe { *devs.add(i) };
        if d.is_null() {
            break;
        }
        // SAFETY: `d` is a live device from the list; the name is a NUL-terminated string owned
        // by the library; node/transport types are plain fields.
        let (name, guid, node, transport) = unsafe {
            (
                CStr::from_ptr((v.get_device_name)(d))
                    .to_string_lossy()
                    .into_owned(),
                u64::from_be((v.get_device_guid)(d)),
                (*d).node_type,
                (*d).transport_type,
            )
        };
        out.push((name, guid, node, transport));
    }
    // SAFETY: `devs` came from ibv_get_device_list and is freed once.
    unsafe { (v.free_device_list)(devs) };
    Ok(out)
}

fn link_transport(ctx_name: &str, transport: c_int) -> Transport {
    if transport == 1 {
        return Transport::Iwarp;
    }
    let ll = std::fs::read_to_string(format!(
        "/sys/class/infiniband/{ctx_name}/ports/{PORT}/link_layer"
    ))
    .unwrap_or_default();
    if ll.trim() == "Ethernet" {
        Transport::Roce
    } else {
        Transport::InfiniBand
    }
}

impl Provider for RdmaCoreProvider {
    fn name(&self) -> &'static str {
        PROVIDER
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(list()?
            .into_iter()
            .map(|(name, guid, _node, transport)| DeviceInfo {
                transport: link_transport(&name, transport),
                description: format!("RDMA device {name} (libibverbs)"),
                provider: PROVIDER.into(),
                name,
                guid,
            })
            .collect())
    }

    fn serves(&self, device: &str) -> bool {
        if ["shm", "tcp", "udp"].iter().any(|p| device.starts_with(p)) {
            return false;
        }
        list()
            .map(|l| l.iter().any(|(n, ..)| n == device))
            .unwrap_or(false)
    }

    fn open(&self, device: &str, config: &DeviceConfig) -> Result<Arc<dyn ContextOps>> {
        if let Some(key) = config.options.keys().next() {
            return Err(VerbsError::InvalidArgument(format!(
                "rdma-core takes no device options (got {key:?}; use FABRIQ_GID_INDEX to pick a GID)"
            )));
        }
        let v = ffi::verbs().map_err(|e| VerbsError::NoDevice(format!("{device}: {e}")))?;
        Ok(Ctx::open(v, device)?)
    }
}

/// Shared with the async-event thread.
#[derive(Default)]
struct AsyncShared {
    stop: AtomicBool,
    cq_errors: Mutex<HashMap<usize, Arc<AtomicBool>>>,
}

struct CtxInner {
    v: &'static Verbs,
    raw: *mut IbvContext,
    info: DeviceInfo,
    attr: DeviceAttr,
    raw_attr: IbvDeviceAttr,
    gid_index: c_int,
    gid: [u8; 16],
    shared: Arc<AsyncShared>,
    async_thread: Mutex<Option<JoinHandle<()>>>,
    srq_of_qp: Mutex<HashMap<u32, Arc<AtomicI64>>>,
    has_srq: AtomicBool,
    /// Per-QP shadow of the work queues, by QP number (see [`Shadow`]).
    shadows: Mutex<HashMap<u32, Arc<Shadow>>>,
}

/// What fabriq posted to one QP and has not yet seen complete, in posting order.
///
/// Verbs leaves `opcode` undefined in error completions and lets a device round queue depths
/// up; the shadow restores both contracts of the object model: every completion carries the
/// opcode of the request it ends, and a queue holds exactly the depth the QP reports. Devices
/// complete each queue in order, so a successful send completion retires every entry up to the
/// oldest signaled one (unsignaled sends free their slots then, as in the device), and an error
/// completion retires exactly the oldest entry (after an error every request completes).
struct Shadow {
    sq: Mutex<std::collections::VecDeque<SqShadow>>,
    rq: Mutex<std::collections::VecDeque<u64>>,
    send_cq: usize,
    recv_cq: usize,
}

#[derive(Clone, Copy)]
struct SqShadow {
    wr_id: u64,
    opcode: WcOpcode,
    signaled: bool,
}

impl Shadow {
    /// Retire the entries a completion polled from CQ `cq` ends; return the opcode to report.
    fn complete(&self, cq: usize, wc: &IbvWc, device_opcode: WcOpcode) -> WcOpcode {
        let device_says_recv = matches!(device_opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
        let is_recv = if self.send_cq != self.recv_cq {
            cq == self.recv_cq
        } else if wc.status == 0 {
            device_says_recv
        } else {
            // One CQ for both queues and an error completion: the device's opcode is not to be
            // trusted; a flushed receive names the oldest posted receive.
            let rq = self.rq.lock().unwrap_or_else(|e| e.into_inner());
            let sq = self.sq.lock().unwrap_or_else(|e| e.into_inner());
            let rq_match = rq.front() == Some(&wc.wr_id);
            let sq_match = sq.front().map(|e| e.wr_id) == Some(wc.wr_id);
            match (rq_match, sq_match) {
                (true, false) => true,
                (false, true) => false,
                (true, true) => device_says_recv,
                (false, false) => sq.is_empty() && !rq.is_empty(),
            }
        };
        if is_recv {
            self.rq
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
            return if wc.status == 0 {
                device_opcode
            } else {
                WcOpcode::Recv
            };
        }
        let mut sq = self.sq.lock().unwrap_or_else(|e| e.into_inner());
        if wc.status != 0 {
            return sq.pop_front().map(|e| e.opcode).unwrap_or(device_opcode);
        }
        while let Some(e) = sq.pop_front() {
            if e.signaled {
                return e.opcode;
            }
        }
        device_opcode
    }
}

// SAFETY: libibverbs contexts and their objects are thread-safe (the library serialises what
// needs it); the raw pointers are only handed to libibverbs.
unsafe impl Send for CtxInner {}
// SAFETY: as above.
unsafe impl Sync for CtxInner {}

/// An opened device; children hold the inner `Arc` so the context closes last.
struct Ctx(Arc<CtxInner>);

impl std::ops::Deref for Ctx {
    type Target = CtxInner;
    fn deref(&self) -> &CtxInner {
        &self.0
    }
}

impl Ctx {
    fn open(v: &'static Verbs, name: &str) -> Result<Arc<Ctx>> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer; the list is freed before returning.
        let devs = unsafe { (v.get_device_list)(&mut n) };
        if devs.is_null() {
            return Err(VerbsError::NoDevice(name.into()));
        }
        let mut raw = std::ptr::null_mut();
        let mut guid = 0;
        let mut transport = 0;
        for i in 0..n.max(0) as usize {
            // SAFETY: `n` valid entries.
            let d = unsafe { *devs.add(i) };
            // SAFETY: live device; NUL-terminated name owned by the library.
            let dn = unsafe { CStr::from_ptr((v.get_device_name)(d)) }.to_string_lossy();
            if dn == name {
                // SAFETY: `d` is a live device of the list, opened before the list is freed
                // (allowed by libibverbs: the context keeps its own reference).
                raw = unsafe { (v.open_device)(d) };
                // SAFETY: live device.
                unsafe {
                    guid = u64::from_be((v.get_device_guid)(d));
                    transport = (*d).transport_type;
                }
                break;
            }
        }
        // SAFETY: freed once.
        unsafe { (v.free_device_list)(devs) };
        if raw.is_null() {
            return Err(VerbsError::NoDevice(name.into()));
        }
        // SAFETY: an all-zero ibv_device_attr is a valid out buffer.
        let mut a: IbvDeviceAttr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        let rc = unsafe { (v.query_device)(raw, &mut a) };
        if rc != 0 {
            // SAFETY: opened above, closed once.
            unsafe { (v.close_device)(raw) };
            return Err(rc_err("ibv_query_device", rc));
        }
        let atomic_cap = match a.atomic_cap {
            1 => AtomicCap::Hca,
            2 => AtomicCap::Global,
            _ => AtomicCap::None,
        };
        let mut caps = Capabilities::SEND
            | Capabilities::SEND_IMM
            | Capabilities::WRITE
            | Capabilities::WRITE_IMM
            | Capabilities::READ
            | Capabilities::INLINE
            | Capabilities::CQ_EVENTS
            | Capabilities::SYNCHRONISE;
        if atomic_cap != AtomicCap::None {
            caps |= Capabilities::ATOMICS;
        }
        if a.max_srq > 0 {
            caps |= Capabilities::SRQ;
        }
        let fw = {
            // SAFETY: fw_ver is a NUL-terminated (zero-initialised) char array.
            let c = unsafe { CStr::from_ptr(a.fw_ver.as_ptr()) };
            c.to_string_lossy().into_owned()
        };
        let pos = |x: c_int| x.max(0) as u32;
        let attr = DeviceAttr {
            fw_ver: fw,
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            hw_ver: a.hw_ver,
            max_mr_size: a.max_mr_size,
            page_size_cap: a.page_size_cap,
            max_qp: pos(a.max_qp),
            max_qp_wr: pos(a.max_qp_wr),
            max_sge: pos(a.max_sge).min(MAX_SGE_STACK as u32),
            max_cq: pos(a.max_cq),
            max_cqe: pos(a.max_cqe),
            max_mr: pos(a.max_mr),
            max_pd: pos(a.max_pd),
            max_qp_init_rd_atom: pos(a.max_qp_init_rd_atom),
            max_qp_rd_atom: pos(a.max_qp_rd_atom),
            max_srq: pos(a.max_srq),
            max_srq_wr: pos(a.max_srq_wr),
            max_inline_data: MAX_INLINE,
            atomic_cap,
            phys_port_cnt: a.phys_port_cnt,
            capabilities: caps,
        };
        let (gid_index, gid) = pick_gid(v, raw, name)?;
        let info = DeviceInfo {
            name: name.into(),
            provider: PROVIDER.into(),
            transport: link_transport(name, transport),
            guid,
            description: format!("RDMA device {name} (libibverbs)"),
        };
        let shared = Arc::new(AsyncShared::default());
        let ctx = Arc::new(CtxInner {
            v,
            raw,
            info,
            attr,
            raw_attr: a,
            gid_index,
            gid,
            shared: shared.clone(),
            async_thread: Mutex::new(None),
            srq_of_qp: Mutex::new(HashMap::new()),
            has_srq: AtomicBool::new(false),
            shadows: Mutex::new(HashMap::new()),
        });
        // SAFETY: live context; async_fd is a plain field.
        let async_fd = unsafe { (*raw).async_fd };
        set_nonblocking(async_fd);
        let raw_addr = raw as usize;
        let handle = std::thread::Builder::new()
            .name(format!("fabriq-{name}-async"))
            .spawn(move || async_events(v, raw_addr, async_fd, shared))
            .map_err(|e| VerbsError::io("spawn async-event thread", e))?;
        *ctx.async_thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(Arc::new(Ctx(ctx)))
    }
}

impl CtxInner {
    fn port(&self) -> Result<IbvPortAttr> {
        // SAFETY: zeroed port attr is a valid out buffer (over-allocated with `_reserved`).
        let mut p: IbvPortAttr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        let rc = unsafe { (self.v.query_port)(self.raw, PORT, &mut p) };
        if rc != 0 {
            return Err(rc_err("ibv_query_port", rc));
        }
        Ok(p)
    }
}

fn set_nonblocking(fd: c_int) {
    // SAFETY: fcntl on an fd owned by libibverbs; only the O_NONBLOCK flag changes.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }
}

fn pick_gid(v: &Verbs, raw: *mut IbvContext, name: &str) -> Result<(c_int, [u8; 16])> {
    // SAFETY: zeroed out buffer; live context.
    let mut p: IbvPortAttr = unsafe { std::mem::zeroed() };
    // SAFETY: live context, valid out-pointer.
    let rc = unsafe { (v.query_port)(raw, PORT, &mut p) };
    if rc != 0 {
        return Err(rc_err("ibv_query_port", rc));
    }
    let query = |i: c_int| -> Option<[u8; 16]> {
        let mut g = [0u8; 16];
        // SAFETY: live context; `g` is a 16-byte out buffer as `union ibv_gid`.
        let rc = unsafe { (v.query_gid)(raw, PORT, i, &mut g) };
        (rc == 0 && g != [0u8; 16]).then_some(g)
    };
    if let Some(i) = std::env::var("FABRIQ_GID_INDEX")
        .ok()
        .and_then(|s| s.parse::<c_int>().ok())
    {
        let g = query(i).ok_or_else(|| {
            VerbsError::InvalidArgument(format!("FABRIQ_GID_INDEX={i}: no such GID"))
        })?;
        return Ok((i, g));
    }
    let mut first_v2 = None;
    let mut first_any = None;
    for i in 0..p.gid_tbl_len.max(0) {
        let Some(g) = query(i) else { continue };
        first_any.get_or_insert((i, g));
        let ty = std::fs::read_to_string(format!(
            "/sys/class/infiniband/{name}/ports/{PORT}/gid_attrs/types/{i}"
        ))
        .unwrap_or_default();
        if ty.trim() == "RoCE v2" {
            let v4 = g[..10] == [0u8; 10] && g[10] == 0xff && g[11] == 0xff;
            if v4 {
                return Ok((i, g));
            }
            first_v2.get_or_insert((i, g));
        }
    }
    Ok(first_v2.or(first_any).unwrap_or((0, [0u8; 16])))
}

fn async_events(v: &'static Verbs, raw: usize, fd: c_int, shared: Arc<AsyncShared>) {
    let raw = raw as *mut IbvContext;
    while !shared.stop.load(Ordering::Acquire) {
        // SAFETY: `fd` is the context's async fd, valid until the context is closed, which
        // happens only after this thread is joined.
        let bfd = unsafe { BorrowedFd::borrow_raw(fd) };
        match crate::provider::wait_readable(bfd, Some(Duration::from_millis(100))) {
            Ok(true) => {}
            _ => continue,
        }
        // SAFETY: zeroed event is a valid out buffer.
        let mut ev: IbvAsyncEvent = unsafe { std::mem::zeroed() };
        // SAFETY: live context (see above); non-blocking fd.
        if unsafe { (v.get_async_event)(raw, &mut ev) } != 0 {
            continue;
        }
        match ev.event_type {
            IBV_EVENT_CQ_ERR => {
                let map = shared.cq_errors.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(flag) = map.get(&(ev.element as usize)) {
                    flag.store(true, Ordering::Release);
                }
                tracing::warn!("rdma-core: CQ error (overrun)");
            }
            IBV_EVENT_QP_FATAL | IBV_EVENT_QP_REQ_ERR | IBV_EVENT_QP_ACCESS_ERR => {
                tracing::warn!(event = ev.event_type, "rdma-core: QP moved to error");
            }
            other => tracing::debug!(event = other, "rdma-core: async event"),
        }
        // SAFETY: acknowledges the event just read, once.
        unsafe { (v.ack_async_event)(&mut ev) };
    }
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(h) = self
            .async_thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = h.join();
        }
        // SAFETY: every child object holds an Arc<Ctx>, so none is alive; closed once.
        unsafe { (self.v.close_device)(self.raw) };
    }
}

fn mtu_bytes(code: u32) -> u32 {
    match code {
        1 => 256,
        2 => 512,
        3 => 1024,
        4 => 2048,
        5 => 4096,
        _ => 1024,
    }
}

fn mtu_code(bytes: u32) -> u32 {
    match bytes {
        0..=256 => 1,
        257..=512 => 2,
        513..=1024 => 3,
        1025..=2048 => 4,
        _ => 5,
    }
}

impl ContextOps for Ctx {
    fn device(&self) -> &DeviceInfo {
        &self.info
    }

    fn query_device(&self) -> DeviceAttr {
        self.attr.clone()
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        if port != PORT {
            return Err(VerbsError::InvalidArgument(format!("no port {port}")));
        }
        let p = self.port()?;
        let state = match p.state {
            1 => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            4 | 5 => PortState::Active,
            _ => PortState::Down,
        };
        let link_layer = match p.link_layer {
            IBV_LINK_LAYER_ETHERNET => "Ethernet",
            _ => "InfiniBand",
        };
        let g = self.gid;
        let address = if g[..10] == [0u8; 10] && g[10] == 0xff && g[11] == 0xff {
            format!("{}.{}.{}.{}", g[12], g[13], g[14], g[15])
        } else {
            std::net::Ipv6Addr::from(g).to_string()
        };
        Ok(PortAttr {
            port_num: PORT,
            state,
            max_mtu: mtu_bytes(p.max_mtu),
            active_mtu: mtu_bytes(p.active_mtu),
            link_layer: link_layer.into(),
            lid: p.lid,
            gid: g,
            address,
            speed_gbps: 0,
        })
    }

    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>> {
        let ctx = self.0.clone();
        // SAFETY: live context.
        let raw = unsafe { (self.v.alloc_pd)(self.raw) };
        if raw.is_null() {
            return Err(errno_err("ibv_alloc_pd"));
        }
        Ok(Arc::new(Pd(Arc::new(PdInner { ctx, raw }))))
    }

    fn create_cq(&self, cqe: u32) -> Result<Arc<dyn CqOps>> {
        let ctx = self.0.clone();
        // SAFETY: live context.
        let channel = unsafe { (self.v.create_comp_channel)(self.raw) };
        if channel.is_null() {
            return Err(errno_err("ibv_create_comp_channel"));
        }
        // SAFETY: channel is live; its fd is owned by libibverbs.
        set_nonblocking(unsafe { (*channel).fd });
        let n = c_int::try_from(cqe).unwrap_or(c_int::MAX);
        // SAFETY: live context and channel.
        let raw = unsafe { (self.v.create_cq)(self.raw, n, std::ptr::null_mut(), channel, 0) };
        if raw.is_null() {
            let e = errno_err("ibv_create_cq");
            // SAFETY: created above, no CQ uses it.
            unsafe { (self.v.destroy_comp_channel)(channel) };
            return Err(e);
        }
        let overflowed = Arc::new(AtomicBool::new(false));
        self.shared
            .cq_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(raw as usize, overflowed.clone());
        // SAFETY: live context; ops are filled by the driver at open time.
        let (poll_fn, notify_fn) =
            unsafe { ((*self.raw).ops.poll_cq, (*self.raw).ops.req_notify_cq) };
        let poll_fn = poll_fn.ok_or_else(|| VerbsError::unsupported(PROVIDER, "poll_cq"))?;
        let notify_fn =
            notify_fn.ok_or_else(|| VerbsError::unsupported(PROVIDER, "req_notify_cq"))?;
        // SAFETY: live CQ.
        let capacity = unsafe { (*raw).cqe }.max(0) as u32;
        Ok(Arc::new(Cq {
            ctx,
            raw,
            channel,
            capacity,
            overflowed,
            poll_fn,
            notify_fn,
            flushed: Mutex::new(std::collections::VecDeque::new()),
            has_flushed: AtomicBool::new(false),
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct PdInner {
    ctx: Arc<CtxInner>,
    raw: *mut IbvPd,
}

// SAFETY: see `CtxInner`.
unsafe impl Send for PdInner {}
// SAFETY: see `CtxInner`.
unsafe impl Sync for PdInner {}

/// A protection domain; MRs, QPs and SRQs hold the inner `Arc`.
struct Pd(Arc<PdInner>);

impl std::ops::Deref for Pd {
    type Target = PdInner;
    fn deref(&self) -> &PdInner {
        &self.0
    }
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR/QP/SRQ of this PD holds an Arc<Pd>; deallocated once.
        unsafe { (self.ctx.v.dealloc_pd)(self.raw) };
    }
}

struct Mr {
    pd: Arc<PdInner>,
    raw: *mut IbvMr,
    info: MrInfo,
    /// Memory allocated by `alloc_mr`, unmapped after deregistration.
    owned: Option<(usize, usize)>,
}

// SAFETY: see `CtxInner`.
unsafe impl Send for Mr {}
// SAFETY: see `CtxInner`.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once; the keys stop working here.
        unsafe { (self.pd.ctx.v.dereg_mr)(self.raw) };
        if let Some((addr, len)) = self.owned {
            // SAFETY: mapped by `alloc_mr` with this length, no longer registered.
            unsafe { libc::munmap(addr as *mut c_void, len) };
        }
    }
}

impl MrOps for Mr {
    fn info(&self) -> MrInfo {
        self.info
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Pd {
    fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        owned: Option<(usize, usize)>,
    ) -> Result<Box<dyn MrOps>> {
        // SAFETY: live PD; the caller guarantees the memory (see PdOps::reg_mr).
        let raw =
            unsafe { (self.ctx.v.reg_mr)(self.raw, addr.cast(), len, access.bits() as c_int) };
        if raw.is_null() {
            return Err(errno_err("ibv_reg_mr (check `ulimit -l`)"));
        }
        // SAFETY: live MR.
        let (lkey, rkey) = unsafe { ((*raw).lkey, (*raw).rkey) };
        Ok(Box::new(Mr {
            pd: self.0.clone(),
            raw,
            info: MrInfo {
                addr: addr as u64,
                len: len as u64,
                lkey: crate::Lkey(lkey),
                rkey: crate::Rkey(rkey),
                access,
            },
            owned,
        }))
    }
}

impl PdOps for Pd {
    unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Box<dyn MrOps>> {
        self.register(addr, len, access, None)
    }

    fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<Box<dyn MrOps>> {
        // SAFETY: anonymous private mapping, zero-filled by the kernel.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(errno_err("mmap for alloc_mr"));
        }
        match self.register(p.cast(), len, access, Some((p as usize, len))) {
            Ok(mr) => Ok(mr),
            Err(e) => {
                // SAFETY: mapped above, never registered.
                unsafe { libc::munmap(p, len) };
                Err(e)
            }
        }
    }

    fn create_qp(&self, init: &QpInitAttr<'_>) -> Result<Arc<dyn QpOps>> {
        let send_cq = init.send_cq.ops().clone();
        let recv_cq = init.recv_cq.ops().clone();
        let scq = send_cq
            .as_any()
            .downcast_ref::<Cq>()
            .ok_or_else(|| VerbsError::InvalidArgument("send CQ is not an rdma-core CQ".into()))?
            .raw;
        let rcq = recv_cq
            .as_any()
            .downcast_ref::<Cq>()
            .ok_or_else(|| VerbsError::InvalidArgument("recv CQ is not an rdma-core CQ".into()))?
            .raw;
        let srq = init.srq.map(|s| s.ops().clone());
        let (srq_raw, srq_count) = match &srq {
            Some(s) => {
                let s = s.as_any().downcast_ref::<Srq>().ok_or_else(|| {
                    VerbsError::InvalidArgument("SRQ is not an rdma-core SRQ".into())
                })?;
                (s.raw, Some(s.outstanding.clone()))
            }
            None => (std::ptr::null_mut(), None),
        };
        let c = init.caps;
        let mut ia = IbvQpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: scq,
            recv_cq: rcq,
            srq: srq_raw,
            cap: IbvQpCap {
                max_send_wr: c.max_send_wr,
                max_recv_wr: if srq.is_some() { 0 } else { c.max_recv_wr },
                max_send_sge: c.max_send_sge.max(1),
                max_recv_sge: if srq.is_some() {
                    0
                } else {
                    c.max_recv_sge.max(1)
                },
                max_inline_data: c.max_inline_data,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: c_int::from(init.sq_sig_all),
        };
        // SAFETY: live PD and CQs (kept alive by the Arcs stored in the QP); valid init attr.
        let raw = unsafe { (self.ctx.v.create_qp)(self.raw, &mut ia) };
        if raw.is_null() {
            return Err(errno_err("ibv_create_qp"));
        }
        // SAFETY: live QP.
        let qpn = unsafe { (*raw).qp_num };
        if let Some(count) = srq_count {
            self.ctx
                .srq_of_qp
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(qpn, count);
            self.ctx.has_srq.store(true, Ordering::Release);
        }
        // SAFETY: live context; ops filled by the driver.
        let (ps, pr) = unsafe { ((*self.ctx.raw).ops.post_send, (*self.ctx.raw).ops.post_recv) };
        let shadow = Arc::new(Shadow {
            sq: Mutex::new(std::collections::VecDeque::new()),
            rq: Mutex::new(std::collections::VecDeque::new()),
            send_cq: scq as usize,
            recv_cq: rcq as usize,
        });
        self.ctx
            .shadows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(qpn, shadow.clone());
        let caps = QpCaps {
            max_send_wr: ia.cap.max_send_wr,
            max_recv_wr: ia.cap.max_recv_wr,
            max_send_sge: ia.cap.max_send_sge,
            max_recv_sge: ia.cap.max_recv_sge,
            max_inline_data: ia.cap.max_inline_data,
        };
        Ok(Arc::new(Qp {
            pd: self.0.clone(),
            _send_cq: send_cq,
            _recv_cq: recv_cq,
            _srq: srq,
            raw,
            qpn,
            psn: rand::random::<u32>() & 0x00ff_ffff,
            post_send_fn: ps.ok_or_else(|| VerbsError::unsupported(PROVIDER, "post_send"))?,
            post_recv_fn: pr.ok_or_else(|| VerbsError::unsupported(PROVIDER, "post_recv"))?,
            attrs: Mutex::new(QpLocal {
                caps,
                access: AccessFlags::empty(),
                rnr_retry: 7,
                min_rnr_timer: 12,
                timeout: 14,
                retry_cnt: 7,
                remote: None,
            }),
            shadow,
            sq_sig_all: init.sq_sig_all,
        }))
    }

    fn create_srq(&self, init: &SrqInitAttr) -> Result<Arc<dyn SrqOps>> {
        let mut ia = IbvSrqInitAttr {
            srq_context: std::ptr::null_mut(),
            attr: IbvSrqAttr {
                max_wr: init.max_wr,
                max_sge: init.max_sge.max(1),
                srq_limit: init.srq_limit,
            },
        };
        // SAFETY: live PD, valid init attr.
        let raw = unsafe { (self.ctx.v.create_srq)(self.raw, &mut ia) };
        if raw.is_null() {
            return Err(errno_err("ibv_create_srq"));
        }
        // SAFETY: live context.
        let post = unsafe { (*self.ctx.raw).ops.post_srq_recv }
            .ok_or_else(|| VerbsError::unsupported(PROVIDER, "post_srq_recv"))?;
        Ok(Arc::new(Srq {
            pd: self.0.clone(),
            raw,
            post,
            max_sge: ia.attr.max_sge,
            outstanding: Arc::new(AtomicI64::new(0)),
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct Cq {
    ctx: Arc<CtxInner>,
    raw: *mut IbvCq,
    channel: *mut IbvCompChannel,
    capacity: u32,
    overflowed: Arc<AtomicBool>,
    poll_fn: PollCqFn,
    notify_fn: ReqNotifyFn,
    /// Completions made by the provider itself: requests posted to a QP already in ERROR, which
    /// devices differ on flushing.
    flushed: Mutex<std::collections::VecDeque<WorkCompletion>>,
    has_flushed: AtomicBool,
}

impl Cq {
    fn push_flushed(&self, wc: WorkCompletion) {
        self.flushed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(wc);
        self.has_flushed.store(true, Ordering::Release);
    }
}

// SAFETY: see `CtxInner`.
unsafe impl Send for Cq {}
// SAFETY: see `CtxInner`.
unsafe impl Sync for Cq {}

impl Drop for Cq {
    fn drop(&mut self) {
        self.ctx
            .shared
            .cq_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(self.raw as usize));
        let _ = self.ack_events();
        // SAFETY: every QP using this CQ holds an Arc to it, so none is alive; destroyed once,
        // before its channel.
        unsafe {
            (self.ctx.v.destroy_cq)(self.raw);
            (self.ctx.v.destroy_comp_channel)(self.channel);
        }
    }
}

fn wc_status(s: u32) -> WcStatus {
    match s {
        0 => WcStatus::Success,
        1 => WcStatus::LocalLength,
        2 => WcStatus::LocalQpOperation,
        4 => WcStatus::LocalProtection,
        5 => WcStatus::WrFlushed,
        6 => WcStatus::MemoryWindowBind,
        7 => WcStatus::BadResponse,
        8 => WcStatus::LocalAccess,
        9 => WcStatus::RemoteInvalidRequest,
        10 => WcStatus::RemoteAccess,
        11 => WcStatus::RemoteOperation,
        12 => WcStatus::RetryExceeded,
        13 => WcStatus::RnrRetryExceeded,
        16 => WcStatus::RemoteAborted,
        19 => WcStatus::Fatal,
        other => WcStatus::General(other),
    }
}

fn wc_opcode(o: u32) -> WcOpcode {
    match o {
        0 => WcOpcode::Send,
        1 => WcOpcode::RdmaWrite,
        2 => WcOpcode::RdmaRead,
        3 => WcOpcode::CompSwap,
        4 => WcOpcode::FetchAdd,
        IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        o if o & IBV_WC_RECV != 0 => WcOpcode::Recv,
        _ => WcOpcode::Send,
    }
}

impl CqOps for Cq {
    fn capacity(&self) -> u32 {
        self.capacity
    }

    fn poll(&self, wc: &mut [WorkCompletion]) -> Result<usize> {
        if self.overflowed.load(Ordering::Acquire) {
            return Err(VerbsError::CqOverflow {
                capacity: self.capacity,
            });
        }
        let mut done = 0;
        if self.has_flushed.load(Ordering::Acquire) {
            let mut q = self.flushed.lock().unwrap_or_else(|e| e.into_inner());
            while done < wc.len() {
                let Some(w) = q.pop_front() else { break };
                wc[done] = w;
                done += 1;
            }
            if q.is_empty() {
                self.has_flushed.store(false, Ordering::Release);
            }
        }
        let wc = &mut wc[done..];
        let mut buf = [IbvWc::default(); 16];
        let want = wc.len().min(buf.len());
        if want == 0 {
            return Ok(done);
        }
        // SAFETY: live CQ; `buf` holds `want` entries.
        let n = unsafe { (self.poll_fn)(self.raw, want as c_int, buf.as_mut_ptr()) };
        if n < 0 {
            return Err(rc_err("ibv_poll_cq", -n));
        }
        let n = n as usize;
        let track_srq = self.ctx.has_srq.load(Ordering::Acquire);
        let shadows = self.ctx.shadows.lock().unwrap_or_else(|e| e.into_inner());
        for (out, w) in wc.iter_mut().zip(&buf[..n]) {
            let device_opcode = wc_opcode(w.opcode);
            let opcode = match shadows.get(&w.qp_num) {
                Some(sh) => sh.complete(self.raw as usize, w, device_opcode),
                None => device_opcode,
            };
            *out = WorkCompletion {
                wr_id: w.wr_id,
                status: wc_status(w.status),
                opcode,
                byte_len: w.byte_len,
                imm_data: (w.wc_flags & IBV_WC_WITH_IMM != 0).then(|| u32::from_be(w.imm_data)),
                qp_num: QpNum(w.qp_num),
                src_qp: QpNum(w.src_qp),
                vendor_err: w.vendor_err,
            };
            if track_srq && matches!(opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
                let map = self.ctx.srq_of_qp.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(c) = map.get(&w.qp_num) {
                    c.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
        Ok(done + n)
    }

    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: live CQ.
        let rc = unsafe { (self.notify_fn)(self.raw, c_int::from(solicited_only)) };
        if rc != 0 {
            return Err(rc_err("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    fn event_fd(&self) -> Option<BorrowedFd<'_>> {
        // SAFETY: the channel's fd lives as long as `self`.
        Some(unsafe { BorrowedFd::borrow_raw((*self.channel).fd) })
    }

    fn ack_events(&self) -> Result<u32> {
        let mut n = 0u32;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: live channel with a non-blocking fd; valid out-pointers.
            let rc = unsafe { (self.ctx.v.get_cq_event)(self.channel, &mut cq, &mut ctx) };
            if rc != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: acknowledges exactly the events read above.
            unsafe { (self.ctx.v.ack_cq_events)(self.raw, n) };
        }
        Ok(n)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct Srq {
    pd: Arc<PdInner>,
    raw: *mut IbvSrq,
    post: PostSrqRecvFn,
    max_sge: u32,
    outstanding: Arc<AtomicI64>,
}

// SAFETY: see `CtxInner`.
unsafe impl Send for Srq {}
// SAFETY: see `CtxInner`.
unsafe impl Sync for Srq {}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: every QP using it holds an Arc; destroyed once.
        unsafe { (self.pd.ctx.v.destroy_srq)(self.raw) };
    }
}

fn to_sges(sg: &[crate::Sge], max: u32, out: &mut [IbvSge; MAX_SGE_STACK]) -> Result<usize> {
    if sg.len() > max as usize || sg.len() > MAX_SGE_STACK {
        return Err(VerbsError::LimitExceeded(format!(
            "{} SGEs exceed {max}",
            sg.len()
        )));
    }
    for (o, s) in out.iter_mut().zip(sg) {
        *o = IbvSge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey.0,
        };
    }
    Ok(sg.len())
}

fn post_recv_with(
    wrs: &[RecvWr<'_>],
    max_sge: u32,
    mut post: impl FnMut(&mut IbvRecvWr) -> c_int,
) -> Result<(), PostError> {
    for (index, wr) in wrs.iter().enumerate() {
        let mut sges = [IbvSge::default(); MAX_SGE_STACK];
        let n = to_sges(wr.sg_list, max_sge, &mut sges)
            .map_err(|source| PostError { index, source })?;
        let mut w = IbvRecvWr {
            wr_id: wr.wr_id,
            next: std::ptr::null_mut(),
            sg_list: sges.as_mut_ptr(),
            num_sge: n as c_int,
        };
        let rc = post(&mut w);
        if rc != 0 {
            let source = if rc == libc::ENOMEM {
                VerbsError::QueueFull
            } else {
                rc_err("ibv_post_recv", rc)
            };
            return Err(PostError { index, source });
        }
    }
    Ok(())
}

impl SrqOps for Srq {
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let r = post_recv_with(wrs, self.max_sge, |w| {
            let mut bad = std::ptr::null_mut();
            // SAFETY: live SRQ; `w` and its SGE array live across the call.
            unsafe { (self.post)(self.raw, w, &mut bad) }
        });
        let posted = match &r {
            Ok(()) => wrs.len(),
            Err(e) => e.index,
        };
        self.outstanding.fetch_add(posted as i64, Ordering::AcqRel);
        r
    }

    fn outstanding(&self) -> u32 {
        self.outstanding.load(Ordering::Acquire).max(0) as u32
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct QpLocal {
    caps: QpCaps,
    access: AccessFlags,
    rnr_retry: u8,
    min_rnr_timer: u8,
    timeout: u8,
    retry_cnt: u8,
    remote: Option<QpEndpoint>,
}

struct Qp {
    pd: Arc<PdInner>,
    _send_cq: Arc<dyn CqOps>,
    _recv_cq: Arc<dyn CqOps>,
    _srq: Option<Arc<dyn SrqOps>>,
    raw: *mut IbvQp,
    qpn: u32,
    psn: u32,
    post_send_fn: PostSendFn,
    post_recv_fn: PostRecvFn,
    attrs: Mutex<QpLocal>,
    shadow: Arc<Shadow>,
    sq_sig_all: bool,
}

// SAFETY: see `CtxInner`.
unsafe impl Send for Qp {}
// SAFETY: see `CtxInner`.
unsafe impl Sync for Qp {}

impl Drop for Qp {
    fn drop(&mut self) {
        self.pd
            .ctx
            .srq_of_qp
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.qpn);
        self.pd
            .ctx
            .shadows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.qpn);
        // SAFETY: destroyed once, before the CQs/SRQ/PD it holds.
        unsafe { (self.pd.ctx.v.destroy_qp)(self.raw) };
    }
}

fn state_code(s: QpState) -> u32 {
    match s {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
        QpState::Sqd => 4,
        QpState::Sqe => 5,
        QpState::Error => 6,
    }
}

fn state_from(code: u32) -> QpState {
    match code {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        4 => QpState::Sqd,
        5 => QpState::Sqe,
        _ => QpState::Error,
    }
}

impl Qp {
    fn lock(&self) -> std::sync::MutexGuard<'_, QpLocal> {
        self.attrs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn queried_state(&self) -> QpState {
        // SAFETY: zeroed attrs are valid out buffers.
        let mut a: IbvQpAttr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut ia: IbvQpInitAttr = unsafe { std::mem::zeroed() };
        // SAFETY: live QP, valid out-pointers.
        let rc = unsafe { (self.pd.ctx.v.query_qp)(self.raw, &mut a, IBV_QP_STATE, &mut ia) };
        if rc != 0 {
            // SAFETY: live QP; `state` is maintained by libibverbs on modify.
            return state_from(unsafe { (*self.raw).state });
        }
        state_from(a.qp_state)
    }

    /// The state libibverbs recorded at the last modify (cheap; hardware may have moved to
    /// ERROR since, which the next completion reports).
    fn cached_state(&self) -> QpState {
        // SAFETY: live QP; plain field read.
        state_from(unsafe { std::ptr::read_volatile(&(*self.raw).state) })
    }
}

impl Qp {
    fn flushed_wc(&self, wr_id: u64, opcode: WcOpcode) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status: WcStatus::WrFlushed,
            opcode,
            byte_len: 0,
            imm_data: None,
            qp_num: QpNum(self.qpn),
            src_qp: QpNum(0),
            vendor_err: 0,
        }
    }
}

impl QpOps for Qp {
    fn qp_num(&self) -> QpNum {
        QpNum(self.qpn)
    }

    fn state(&self) -> QpState {
        self.queried_state()
    }

    fn query(&self) -> QpInfo {
        let l = self.lock();
        QpInfo {
            qp_num: QpNum(self.qpn),
            state: self.queried_state(),
            caps: l.caps,
            access: l.access,
            rnr_retry: l.rnr_retry,
            min_rnr_timer: l.min_rnr_timer,
            timeout: l.timeout,
            retry_cnt: l.retry_cnt,
            remote: l.remote.clone(),
        }
    }

    fn endpoint(&self) -> QpEndpoint {
        let ctx = &self.pd.ctx;
        let port = ctx.port().ok();
        let mut extra = std::collections::BTreeMap::new();
        extra.insert("gid_index".into(), ctx.gid_index.to_string());
        QpEndpoint {
            provider: PROVIDER.into(),
            device: ctx.info.name.clone(),
            address: std::net::Ipv6Addr::from(ctx.gid).to_string(),
            qp_num: QpNum(self.qpn),
            psn: self.psn,
            lid: port.map(|p| p.lid).unwrap_or(0),
            gid: ctx.gid,
            mtu: port.map(|p| mtu_bytes(p.active_mtu)).unwrap_or(1024),
            extra,
        }
    }

    fn modify(&self, attr: &QpAttr) -> Result<()> {
        let ctx = &self.pd.ctx;
        let mut l = self.lock();
        // SAFETY: zeroed attr is the documented starting point for ibv_modify_qp.
        let mut a: IbvQpAttr = unsafe { std::mem::zeroed() };
        let mut mask = 0;
        if let Some(to) = attr.state {
            self.queried_state().check_transition(to)?;
            a.qp_state = state_code(to);
            mask |= IBV_QP_STATE;
            match to {
                QpState::Init => {
                    let access = attr.access.unwrap_or(
                        AccessFlags::REMOTE_READ
                            | AccessFlags::REMOTE_WRITE
                            | AccessFlags::REMOTE_ATOMIC,
                    );
                    a.qp_access_flags = access.bits();
                    a.port_num = attr.port.unwrap_or(PORT);
                    a.pkey_index = 0;
                    mask |= IBV_QP_ACCESS_FLAGS | IBV_QP_PORT | IBV_QP_PKEY_INDEX;
                    l.access = access;
                }
                QpState::Rtr => {
                    let remote = attr.remote.as_ref().ok_or_else(|| {
                        VerbsError::InvalidArgument("RTR needs the remote endpoint".into())
                    })?;
                    let port = ctx.port()?;
                    a.path_mtu = mtu_code(mtu_bytes(port.active_mtu).min(remote.mtu.max(256)));
                    a.dest_qp_num = remote.qp_num.0;
                    a.rq_psn = attr.rq_psn.unwrap_or(remote.psn) & 0x00ff_ffff;
                    a.max_dest_rd_atomic = attr
                        .max_dest_rd_atomic
                        .unwrap_or(16)
                        .min(ctx.raw_attr.max_qp_rd_atom.clamp(1, 255) as u8);
                    a.min_rnr_timer = attr.min_rnr_timer.unwrap_or(l.min_rnr_timer);
                    a.ah_attr.port_num = PORT;
                    a.ah_attr.dlid = remote.lid;
                    if port.link_layer == IBV_LINK_LAYER_ETHERNET || remote.gid != [0u8; 16] {
                        a.ah_attr.is_global = 1;
                        a.ah_attr.grh.dgid = remote.gid;
                        a.ah_attr.grh.sgid_index = ctx.gid_index as u8;
                        a.ah_attr.grh.hop_limit = 64;
                    }
                    mask |= IBV_QP_AV
                        | IBV_QP_PATH_MTU
                        | IBV_QP_DEST_QPN
                        | IBV_QP_RQ_PSN
                        | IBV_QP_MAX_DEST_RD_ATOMIC
                        | IBV_QP_MIN_RNR_TIMER;
                    l.min_rnr_timer = a.min_rnr_timer;
                    l.remote = Some(remote.clone());
                }
                QpState::Rts if self.cached_state() == QpState::Rtr => {
                    a.sq_psn = attr.sq_psn.unwrap_or(self.psn) & 0x00ff_ffff;
                    a.timeout = attr.timeout.unwrap_or(l.timeout);
                    a.retry_cnt = attr.retry_cnt.unwrap_or(l.retry_cnt).min(7);
                    a.rnr_retry = attr.rnr_retry.unwrap_or(l.rnr_retry).min(7);
                    a.max_rd_atomic = attr
                        .max_rd_atomic
                        .unwrap_or(16)
                        .min(ctx.raw_attr.max_qp_init_rd_atom.clamp(1, 255) as u8);
                    mask |= IBV_QP_SQ_PSN
                        | IBV_QP_TIMEOUT
                        | IBV_QP_RETRY_CNT
                        | IBV_QP_RNR_RETRY
                        | IBV_QP_MAX_QP_RD_ATOMIC;
                    l.timeout = a.timeout;
                    l.retry_cnt = a.retry_cnt;
                    l.rnr_retry = a.rnr_retry;
                }
                _ => {}
            }
        }
        let in_rts = self.cached_state() == QpState::Rts;
        if in_rts && matches!(attr.state, None | Some(QpState::Rts)) {
            // RTS → RTS may change only the access flags and the min RNR timer (IB spec and
            // ib_modify_qp_is_ok); the send-side timers are set once, at RTR → RTS.
            let changes = |new: Option<u8>, cur: u8| new.is_some_and(|n| n != cur);
            if changes(attr.rnr_retry, l.rnr_retry)
                || changes(attr.timeout, l.timeout)
                || changes(attr.retry_cnt, l.retry_cnt)
            {
                return Err(VerbsError::InvalidArgument(
                    "rnr_retry, timeout and retry_cnt are set at RTR -> RTS; RTS -> RTS changes \
                     only access and min_rnr_timer"
                        .into(),
                ));
            }
            if let Some(n) = attr.min_rnr_timer {
                a.min_rnr_timer = n;
                mask |= IBV_QP_MIN_RNR_TIMER;
                l.min_rnr_timer = n;
            }
            if let Some(acc) = attr.access {
                a.qp_access_flags = acc.bits();
                mask |= IBV_QP_ACCESS_FLAGS;
                l.access = acc;
            }
        }
        if mask == 0 {
            return Ok(());
        }
        // SAFETY: live QP; `a` is fully initialised for every bit in `mask`.
        let rc = unsafe { (ctx.v.modify_qp)(self.raw, &mut a, mask) };
        if rc != 0 {
            return Err(rc_err("ibv_modify_qp", rc));
        }
        Ok(())
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let st = self.cached_state();
        if !st.accepts_send() {
            return Err(PostError {
                index: 0,
                source: VerbsError::WrongState {
                    state: st,
                    what: "send",
                },
            });
        }
        if st == QpState::Error {
            let cq = self._send_cq.as_any().downcast_ref::<Cq>();
            for wr in wrs {
                if let Some(cq) = cq {
                    cq.push_flushed(self.flushed_wc(wr.wr_id, wr.opcode.wc_opcode()));
                }
            }
            return Ok(());
        }
        let (max_sge, depth) = {
            let l = self.lock();
            (l.caps.max_send_sge, l.caps.max_send_wr as usize)
        };
        for (index, wr) in wrs.iter().enumerate() {
            let fail = |source| PostError { index, source };
            if self
                .shadow
                .sq
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .len()
                >= depth
            {
                return Err(fail(VerbsError::QueueFull));
            }
            let mut sges = [IbvSge::default(); MAX_SGE_STACK];
            let n = to_sges(wr.sg_list, max_sge, &mut sges).map_err(fail)?;
            let mut flags = 0;
            if wr.flags.contains(SendFlags::SIGNALED) {
                flags |= IBV_SEND_SIGNALED;
            }
            if wr.flags.contains(SendFlags::INLINE) {
                flags |= IBV_SEND_INLINE;
            }
            if wr.flags.contains(SendFlags::FENCE) {
                flags |= IBV_SEND_FENCE;
            }
            if wr.flags.contains(SendFlags::SOLICITED) {
                flags |= IBV_SEND_SOLICITED;
            }
            // SYNCHRONISE: an RC QP on one path never reorders; nothing to do.
            let mut w = IbvSendWr {
                wr_id: wr.wr_id,
                next: std::ptr::null_mut(),
                sg_list: sges.as_mut_ptr(),
                num_sge: n as c_int,
                opcode: 0,
                send_flags: flags,
                imm_data: 0,
                wr: [0; 4],
                qp_type: 0,
                _pad: 0,
                tail: [0; 6],
            };
            match wr.opcode {
                WrOpcode::Send => w.opcode = IBV_WR_SEND,
                WrOpcode::SendWithImm { imm } => {
                    w.opcode = IBV_WR_SEND_WITH_IMM;
                    w.imm_data = imm.to_be();
                }
                WrOpcode::Write { remote } => {
                    w.opcode = IBV_WR_RDMA_WRITE;
                    w.wr = [remote.addr, u64::from(remote.rkey.0), 0, 0];
                }
                WrOpcode::WriteWithImm { remote, imm } => {
                    w.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
                    w.imm_data = imm.to_be();
                    w.wr = [remote.addr, u64::from(remote.rkey.0), 0, 0];
                }
                WrOpcode::Read { remote } => {
                    w.opcode = IBV_WR_RDMA_READ;
                    w.wr = [remote.addr, u64::from(remote.rkey.0), 0, 0];
                }
                WrOpcode::AtomicCmpSwp {
                    remote,
                    compare,
                    swap,
                } => {
                    w.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
                    w.wr = [remote.addr, compare, swap, u64::from(remote.rkey.0)];
                }
                WrOpcode::AtomicFetchAdd { remote, add } => {
                    w.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
                    w.wr = [remote.addr, add, 0, u64::from(remote.rkey.0)];
                }
            }
            let mut bad = std::ptr::null_mut();
            let mut sq = self.shadow.sq.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: live QP; `w` and `sges` live across the call; libibverbs copies the request
            // (and inline data) into the send queue before returning.
            let rc = unsafe { (self.post_send_fn)(self.raw, &mut w, &mut bad) };
            if rc != 0 {
                return Err(fail(if rc == libc::ENOMEM {
                    VerbsError::QueueFull
                } else {
                    rc_err("ibv_post_send", rc)
                }));
            }
            sq.push_back(SqShadow {
                wr_id: wr.wr_id,
                opcode: wr.opcode.wc_opcode(),
                signaled: self.sq_sig_all || wr.flags.contains(SendFlags::SIGNALED),
            });
        }
        Ok(())
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let st = self.cached_state();
        if !st.accepts_recv() {
            return Err(PostError {
                index: 0,
                source: VerbsError::WrongState {
                    state: st,
                    what: "recv",
                },
            });
        }
        if self._srq.is_some() {
            return Err(PostError {
                index: 0,
                source: VerbsError::InvalidArgument("QP draws receives from an SRQ".into()),
            });
        }
        if st == QpState::Error {
            if let Some(cq) = self._recv_cq.as_any().downcast_ref::<Cq>() {
                for wr in wrs {
                    cq.push_flushed(self.flushed_wc(wr.wr_id, WcOpcode::Recv));
                }
            }
            return Ok(());
        }
        let (max_sge, depth) = {
            let l = self.lock();
            (l.caps.max_recv_sge, l.caps.max_recv_wr as usize)
        };
        post_recv_with(wrs, max_sge, |w| {
            let mut rq = self.shadow.rq.lock().unwrap_or_else(|e| e.into_inner());
            if rq.len() >= depth {
                return libc::ENOMEM;
            }
            let mut bad = std::ptr::null_mut();
            // SAFETY: live QP; `w` and its SGEs live across the call.
            let rc = unsafe { (self.post_recv_fn)(self.raw, w, &mut bad) };
            if rc == 0 {
                rq.push_back(w.wr_id);
            }
            rc
        })
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
