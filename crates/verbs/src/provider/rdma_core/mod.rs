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

mod cq;
pub mod ffi;
mod pd;
mod qp;
mod shadow;

use self::cq::Cq;
use self::pd::{Pd, PdInner};
use self::qp::{Qp, QpLocal, Srq};
use self::shadow::{Shadow, SqShadow};

use std::any::Any;
use std::collections::HashMap;
use std::ffi::{c_int, CStr};
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
        Ok(Arc::new(Pd(Arc::new(PdInner {
            ctx,
            raw,
            regions: Default::default(),
        }))))
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
            made: Arc::new(cq::MadeCompletions::default()),
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
