//! RC queue pairs and shared receive queues over libibverbs: state transitions with the
//! attributes each one takes, posting through the context's ops table.

#![allow(unsafe_code)]

use super::pd::covers;
use super::*;
use crate::provider::own_memory::read_own;

pub(super) struct Srq {
    pub(super) pd: Arc<PdInner>,
    pub(super) raw: *mut IbvSrq,
    pub(super) post: PostSrqRecvFn,
    pub(super) max_sge: u32,
    pub(super) outstanding: Arc<AtomicI64>,
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

pub(super) fn to_sges(
    sg: &[crate::Sge],
    max: u32,
    out: &mut [IbvSge; MAX_SGE_STACK],
) -> Result<usize> {
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

pub(super) fn post_recv_with(
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

pub(super) struct QpLocal {
    pub(super) caps: QpCaps,
    pub(super) access: AccessFlags,
    pub(super) rnr_retry: u8,
    pub(super) min_rnr_timer: u8,
    pub(super) timeout: u8,
    pub(super) retry_cnt: u8,
    pub(super) remote: Option<QpEndpoint>,
    /// The initial send PSN this QP advertises: random, drawn anew at every RESET.
    pub(super) psn: u32,
}

pub(super) struct Qp {
    pub(super) pd: Arc<PdInner>,
    pub(super) _send_cq: Arc<dyn CqOps>,
    pub(super) _recv_cq: Arc<dyn CqOps>,
    pub(super) _srq: Option<Arc<dyn SrqOps>>,
    pub(super) raw: *mut IbvQp,
    pub(super) qpn: u32,
    pub(super) post_send_fn: PostSendFn,
    pub(super) post_recv_fn: PostRecvFn,
    pub(super) attrs: Mutex<QpLocal>,
    pub(super) shadow: Arc<Shadow>,
    pub(super) sq_sig_all: bool,
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

pub(super) fn state_code(s: QpState) -> u32 {
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

pub(super) fn state_from(code: u32) -> QpState {
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
    pub(super) fn flushed_wc(&self, wr_id: u64, opcode: WcOpcode) -> WorkCompletion {
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

    fn provider(&self) -> std::borrow::Cow<'static, str> {
        PROVIDER.into()
    }

    fn endpoint(&self) -> QpEndpoint {
        let psn = self.lock().psn;
        let ctx = &self.pd.ctx;
        let port = ctx.port().ok();
        let mut extra = std::collections::BTreeMap::new();
        extra.insert("gid_index".into(), ctx.gid_index.to_string());
        QpEndpoint {
            provider: PROVIDER.into(),
            device: ctx.info.name.clone(),
            address: std::net::Ipv6Addr::from(ctx.gid).to_string(),
            qp_num: QpNum(self.qpn),
            psn,
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
                    a.sq_psn = attr.sq_psn.unwrap_or(l.psn) & 0x00ff_ffff;
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
        if attr.state == Some(QpState::Reset) {
            // RESET discards every posted request without a completion: the shadow follows, or
            // a reused QP would count the old requests against its depth (and pair completions
            // of new ones with old entries).
            self.shadow.clear();
            // The next connection starts at a new initial PSN, as rdma_cm's do: packets of the
            // previous one still on the wire (a retransmission, a late ACK or NAK) cannot fall
            // into its sequence window, even when both QPs are reconnected to each other.
            l.psn = crate::next_psn(l.psn);
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
        // In ERROR a send still goes to the device, which flushes it behind every request
        // queued before it; one the device refuses (or that finds the queue full of requests
        // about to flush) is flushed by the provider, in order behind them (see `Shadow`).
        let in_error = st == QpState::Error;
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
                if in_error {
                    self.shadow
                        .flush_send(self.flushed_wc(wr.wr_id, wr.opcode.wc_opcode()));
                    continue;
                }
                return Err(fail(VerbsError::QueueFull));
            }
            // The library's own rule on every provider (a NIC's driver may not check it): only
            // requests that carry a payload may be INLINE.
            if wr.is_inline() && !wr.opcode.carries_payload() {
                return Err(fail(VerbsError::InvalidArgument(format!(
                    "{:?} cannot be inline",
                    wr.opcode
                ))));
            }
            let mut sges = [IbvSge::default(); MAX_SGE_STACK];
            // Inline data goes first, as one more SGE of ordinary memory: with
            // IBV_SEND_INLINE the provider copies it at post time without looking at its lkey.
            let lead = usize::from(!wr.inline_data.is_empty());
            let n = if lead == 1 {
                let mut rest = [IbvSge::default(); MAX_SGE_STACK];
                let n = to_sges(wr.sg_list, max_sge.saturating_sub(1), &mut rest).map_err(fail)?;
                sges[0] = IbvSge {
                    addr: wr.inline_data.as_ptr() as u64,
                    length: u32::try_from(wr.inline_data.len()).map_err(|_| {
                        fail(VerbsError::LimitExceeded("inline data above 4 GiB".into()))
                    })?,
                    lkey: 0,
                };
                sges[1..=n].copy_from_slice(&rest[..n]);
                n + 1
            } else {
                to_sges(wr.sg_list, max_sge, &mut sges).map_err(fail)?
            };
            // INLINE: libibverbs reads the SGEs at post time without looking at their lkeys.
            // Those inside a live registration of this PD go as they are (no registration can
            // end before the post returns: `_held`); otherwise the whole payload is read through
            // the kernel first, so memory this process cannot read is a post error, not a fault.
            let mut gathered = Vec::new();
            let mut n = n;
            let _held = if wr.is_inline() && wr.sg_list.iter().any(|s| s.length > 0) {
                let regions = self.pd.regions.read();
                let registered = wr.sg_list.iter().all(|s| {
                    s.length == 0 || covers(&regions, s.lkey.0, s.addr, u64::from(s.length))
                });
                if !registered {
                    gathered.extend_from_slice(wr.inline_data);
                    for s in wr.sg_list {
                        read_own(s.addr, s.length as usize, &mut gathered).map_err(|e| {
                            fail(VerbsError::InvalidArgument(format!(
                                "INLINE SGE at {:#x} ({} bytes) names memory this process \
                                 cannot read: {e}",
                                s.addr, s.length
                            )))
                        })?;
                    }
                    sges[0] = IbvSge {
                        addr: gathered.as_ptr() as u64,
                        length: u32::try_from(gathered.len()).map_err(|_| {
                            fail(VerbsError::LimitExceeded("inline data above 4 GiB".into()))
                        })?,
                        lkey: 0,
                    };
                    n = 1;
                }
                Some(regions)
            } else {
                None
            };
            let mut flags = 0;
            if wr.flags.contains(SendFlags::SIGNALED) {
                flags |= IBV_SEND_SIGNALED;
            }
            if wr.is_inline() {
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
            if rc != 0 && in_error && rc != libc::ENOMEM {
                drop(sq);
                for wr in wrs.get(index..).unwrap_or_default() {
                    self.shadow
                        .flush_send(self.flushed_wc(wr.wr_id, wr.opcode.wc_opcode()));
                }
                return Ok(());
            }
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
            // Not handed to the device: a user-space receive queue may never be looked at again
            // once the QP is in ERROR (rxe flushes it only on the transition). The provider
            // flushes it, behind every receive posted before it (see `Shadow`).
            for wr in wrs {
                self.shadow
                    .flush_recv(self.flushed_wc(wr.wr_id, WcOpcode::Recv));
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
