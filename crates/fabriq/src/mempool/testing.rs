//! A heap-backed verbs context for unit tests of the middleware: memory registration on the
//! heap, and QPs that only keep their state machine (nothing is ever transmitted), with counters
//! so tests can check what the pool registers and what the connection manager creates.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::any::Any;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use fabriq_verbs::provider::{ContextOps, CqOps, MrOps, PdOps, QpOps};
use fabriq_verbs::{
    AccessFlags, AtomicCap, Capabilities, CompletionQueue, Context, DeviceAttr, DeviceInfo, Lkey,
    MrInfo, PortAttr, PortState, PostError, ProtectionDomain, QpAttr, QpCaps, QpEndpoint, QpInfo,
    QpInitAttr, QpNum, QpState, RecvWr, Result, Rkey, SendWr, Transport, VerbsError,
    WorkCompletion,
};
use parking_lot::Mutex;

/// Live-registration counters shared by a heap context and its regions.
#[derive(Debug, Default)]
pub struct HeapCounters {
    /// Regions alive now.
    pub live: AtomicUsize,
    /// Bytes in live regions.
    pub live_bytes: AtomicU64,
    /// Registrations ever made.
    pub registered: AtomicUsize,
    /// Fail `alloc_mr` once this many provider allocations exist (0: never).
    pub fail_after: AtomicUsize,
    /// QPs created.
    pub qps_created: AtomicUsize,
    /// QPs alive now.
    pub qps_live: AtomicUsize,
    /// Fail `modify` to RTR (0: never; 1: always).
    pub fail_rtr: AtomicUsize,
}

struct HeapContext {
    info: DeviceInfo,
    counters: Arc<HeapCounters>,
    provider: &'static str,
}

struct HeapPd {
    counters: Arc<HeapCounters>,
    next_key: AtomicU32,
    provider: &'static str,
}

struct FakeCq;

impl CqOps for FakeCq {
    fn capacity(&self) -> u32 {
        1024
    }
    fn poll(&self, _wc: &mut [WorkCompletion]) -> Result<usize> {
        Ok(0)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A QP that only keeps its state machine and attributes.
struct FakeQp {
    num: QpNum,
    provider: &'static str,
    caps: QpCaps,
    state: Mutex<(QpState, Option<QpEndpoint>)>,
    counters: Arc<HeapCounters>,
}

impl Drop for FakeQp {
    fn drop(&mut self) {
        self.counters.qps_live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl QpOps for FakeQp {
    fn qp_num(&self) -> QpNum {
        self.num
    }
    fn state(&self) -> QpState {
        self.state.lock().0
    }
    fn query(&self) -> QpInfo {
        let st = self.state.lock();
        QpInfo {
            qp_num: self.num,
            state: st.0,
            caps: self.caps,
            access: AccessFlags::empty(),
            rnr_retry: 7,
            min_rnr_timer: 12,
            timeout: 14,
            retry_cnt: 7,
            remote: st.1.clone(),
        }
    }
    fn endpoint(&self) -> QpEndpoint {
        QpEndpoint {
            provider: self.provider.into(),
            device: format!("{}0", self.provider),
            address: "heap".into(),
            qp_num: self.num,
            psn: self.num.0.wrapping_mul(7919),
            lid: 0,
            gid: [0; 16],
            mtu: 4096,
            extra: Default::default(),
        }
    }
    fn modify(&self, attr: &QpAttr) -> Result<()> {
        let mut st = self.state.lock();
        if let Some(to) = attr.state {
            st.0.check_transition(to)?;
            if to == QpState::Rtr && self.counters.fail_rtr.load(Ordering::SeqCst) != 0 {
                return Err(VerbsError::Connect("injected RTR failure".into()));
            }
            if to == QpState::Reset {
                st.1 = None;
            }
            st.0 = to;
        }
        if let Some(remote) = &attr.remote {
            st.1 = Some(remote.clone());
        }
        Ok(())
    }
    fn post_send(&self, _wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        Err(PostError {
            index: 0,
            source: VerbsError::unsupported("heap", "post_send"),
        })
    }
    fn post_recv(&self, _wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        Ok(())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct HeapMr {
    info: MrInfo,
    /// Set for provider-allocated memory, freed on drop.
    owned: Option<Layout>,
    counters: Arc<HeapCounters>,
}

impl Drop for HeapMr {
    fn drop(&mut self) {
        self.counters.live.fetch_sub(1, Ordering::SeqCst);
        self.counters
            .live_bytes
            .fetch_sub(self.info.len, Ordering::SeqCst);
        if let Some(layout) = self.owned {
            // SAFETY: allocated in `alloc_mr` with this very layout and not freed since.
            unsafe { dealloc(self.info.addr as usize as *mut u8, layout) };
        }
    }
}

impl MrOps for HeapMr {
    fn info(&self) -> MrInfo {
        self.info
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl HeapPd {
    fn region(&self, addr: u64, len: usize, access: AccessFlags, owned: Option<Layout>) -> HeapMr {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        self.counters.live.fetch_add(1, Ordering::SeqCst);
        self.counters.registered.fetch_add(1, Ordering::SeqCst);
        self.counters
            .live_bytes
            .fetch_add(len as u64, Ordering::SeqCst);
        HeapMr {
            info: MrInfo {
                addr,
                len: len as u64,
                lkey: Lkey(key),
                rkey: Rkey(key ^ 0x5a5a_0000),
                access,
            },
            owned,
            counters: Arc::clone(&self.counters),
        }
    }
}

impl PdOps for HeapPd {
    unsafe fn reg_mr(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Box<dyn MrOps>> {
        Ok(Box::new(self.region(
            addr as usize as u64,
            len,
            access,
            None,
        )))
    }

    fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<Box<dyn MrOps>> {
        let limit = self.counters.fail_after.load(Ordering::SeqCst);
        if limit != 0 && self.counters.live.load(Ordering::SeqCst) >= limit {
            return Err(VerbsError::LimitExceeded("heap test provider limit".into()));
        }
        let layout = Layout::from_size_align(len, 4096)
            .map_err(|e| VerbsError::InvalidArgument(e.to_string()))?;
        // SAFETY: `len > 0` (checked by `ProtectionDomain::alloc_mr`), so the layout is non-zero.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(VerbsError::LimitExceeded("out of memory".into()));
        }
        Ok(Box::new(self.region(
            ptr as usize as u64,
            len,
            access,
            Some(layout),
        )))
    }

    fn create_qp(&self, init: &QpInitAttr<'_>) -> Result<Arc<dyn QpOps>> {
        static NEXT_QP: AtomicU32 = AtomicU32::new(1);
        self.counters.qps_created.fetch_add(1, Ordering::SeqCst);
        self.counters.qps_live.fetch_add(1, Ordering::SeqCst);
        Ok(Arc::new(FakeQp {
            num: QpNum(NEXT_QP.fetch_add(1, Ordering::Relaxed)),
            provider: self.provider,
            caps: init.caps,
            state: Mutex::new((QpState::Reset, None)),
            counters: Arc::clone(&self.counters),
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl ContextOps for HeapContext {
    fn device(&self) -> &DeviceInfo {
        &self.info
    }

    fn query_device(&self) -> DeviceAttr {
        DeviceAttr {
            fw_ver: "test".into(),
            vendor_id: 0,
            vendor_part_id: 0,
            hw_ver: 0,
            max_mr_size: 1 << 40,
            page_size_cap: 4096,
            max_qp: 1 << 16,
            max_qp_wr: 4096,
            max_sge: 8,
            max_cq: 1 << 16,
            max_cqe: 1 << 16,
            max_mr: u32::MAX,
            max_pd: 1,
            max_qp_init_rd_atom: 0,
            max_qp_rd_atom: 0,
            max_srq: 0,
            max_srq_wr: 0,
            max_inline_data: 256,
            atomic_cap: AtomicCap::None,
            phys_port_cnt: 1,
            capabilities: Capabilities::empty(),
        }
    }

    fn query_port(&self, port: u8) -> Result<PortAttr> {
        Ok(PortAttr {
            port_num: port,
            state: PortState::Active,
            max_mtu: 4096,
            active_mtu: 4096,
            link_layer: "heap".into(),
            lid: 0,
            gid: [0; 16],
            address: String::new(),
            speed_gbps: 0,
        })
    }

    fn alloc_pd(&self) -> Result<Arc<dyn PdOps>> {
        Ok(Arc::new(HeapPd {
            counters: Arc::clone(&self.counters),
            next_key: AtomicU32::new(1),
            provider: self.provider,
        }))
    }

    fn create_cq(&self, _cqe: u32) -> Result<Arc<dyn CqOps>> {
        Ok(Arc::new(FakeCq))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A protection domain on a fresh heap context, and its counters.
pub fn heap_pd() -> (ProtectionDomain, Arc<HeapCounters>) {
    heap_pd_named("heap")
}

/// [`heap_pd`] whose QPs claim to belong to `provider` (for provider-mismatch tests).
pub fn heap_pd_named(provider: &'static str) -> (ProtectionDomain, Arc<HeapCounters>) {
    let counters = Arc::new(HeapCounters::default());
    let ctx = Context::from_ops(Arc::new(HeapContext {
        info: DeviceInfo {
            name: format!("{provider}0"),
            provider: provider.into(),
            transport: Transport::SharedMemory,
            guid: 0,
            description: "heap memory for unit tests".into(),
        },
        counters: Arc::clone(&counters),
        provider,
    }));
    let pd = ctx.alloc_pd().expect("heap pd");
    (pd, counters)
}

/// A CQ of the heap context of `pd` (never yields completions).
pub fn heap_cq(pd: &ProtectionDomain) -> CompletionQueue {
    pd.context().create_cq(256).expect("heap cq")
}
