//! Protection domains and memory regions over libibverbs, and QP/SRQ creation.

#![allow(unsafe_code)]

use super::*;

pub(super) struct PdInner {
    pub(super) ctx: Arc<CtxInner>,
    pub(super) raw: *mut IbvPd,
    /// The live registrations of this PD by lkey: (address, length). An INLINE request's SGE
    /// inside one of them is handed to libibverbs, which reads it at post time; any other is
    /// read through the kernel first (see `Qp::post_send`).
    pub(super) regions: parking_lot::RwLock<HashMap<u32, (u64, u64)>>,
}

/// Whether `[addr, addr + len)` lies in the registration `lkey` of `regions`.
pub(super) fn covers(regions: &HashMap<u32, (u64, u64)>, lkey: u32, addr: u64, len: u64) -> bool {
    regions.get(&lkey).is_some_and(|&(base, rlen)| {
        addr >= base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= base.saturating_add(rlen))
    })
}

// SAFETY: see `CtxInner`.
unsafe impl Send for PdInner {}
// SAFETY: see `CtxInner`.
unsafe impl Sync for PdInner {}

/// A protection domain; MRs, QPs and SRQs hold the inner `Arc`.
pub(super) struct Pd(pub(super) Arc<PdInner>);

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

pub(super) struct Mr {
    pub(super) pd: Arc<PdInner>,
    pub(super) raw: *mut IbvMr,
    pub(super) info: MrInfo,
    /// Memory allocated by `alloc_mr`, unmapped after deregistration.
    pub(super) owned: Option<(usize, usize)>,
    /// What backs `owned` (base pages for caller memory).
    pub(super) pages: crate::PageKind,
}

// SAFETY: see `CtxInner`.
unsafe impl Send for Mr {}
// SAFETY: see `CtxInner`.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        self.pd.regions.write().remove(&self.info.lkey.0);
        // SAFETY: registered once, deregistered once; the keys stop working here.
        unsafe { (self.pd.ctx.v.dereg_mr)(self.raw) };
        if let Some((addr, len)) = self.owned {
            // SAFETY: mapped by `alloc_mr` (`pages::map`) with this length, no longer
            // registered.
            unsafe { crate::provider::pages::unmap(addr as *mut u8, len) };
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
    fn pages(&self) -> crate::PageKind {
        self.pages
    }
}

impl Pd {
    fn register(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        owned: Option<(usize, usize)>,
        pages: crate::PageKind,
    ) -> Result<Box<dyn MrOps>> {
        // SAFETY: live PD; the caller guarantees the memory (see PdOps::reg_mr).
        let raw =
            unsafe { (self.ctx.v.reg_mr)(self.raw, addr.cast(), len, access.bits() as c_int) };
        if raw.is_null() {
            return Err(errno_err("ibv_reg_mr (check `ulimit -l`)"));
        }
        // SAFETY: live MR.
        let (lkey, rkey) = unsafe { ((*raw).lkey, (*raw).rkey) };
        self.regions.write().insert(lkey, (addr as u64, len as u64));
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
            pages,
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
        self.register(addr, len, access, None, crate::PageKind::Base)
    }

    fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<Box<dyn MrOps>> {
        // Anonymous private memory, zero-filled by the kernel, on huge pages where the
        // system has them (fewer translation entries for the NIC).
        let (p, pages) =
            crate::provider::pages::map(len).map_err(|e| VerbsError::io("mmap for alloc_mr", e))?;
        match self.register(p, len, access, Some((p as usize, len)), pages) {
            Ok(mr) => Ok(mr),
            Err(e) => {
                // SAFETY: mapped above, never registered.
                unsafe { crate::provider::pages::unmap(p, len) };
                Err(e)
            }
        }
    }

    fn create_qp(&self, init: &QpInitAttr<'_>) -> Result<Arc<dyn QpOps>> {
        let send_cq = init.send_cq.ops().clone();
        let recv_cq = init.recv_cq.ops().clone();
        let send = send_cq
            .as_any()
            .downcast_ref::<Cq>()
            .ok_or_else(|| VerbsError::InvalidArgument("send CQ is not an rdma-core CQ".into()))?;
        let recv = recv_cq
            .as_any()
            .downcast_ref::<Cq>()
            .ok_or_else(|| VerbsError::InvalidArgument("recv CQ is not an rdma-core CQ".into()))?;
        let (scq, rcq) = (send.raw, recv.raw);
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
        let shadow = Arc::new(Shadow::new(send, recv));
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
                psn: crate::random_psn(),
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
