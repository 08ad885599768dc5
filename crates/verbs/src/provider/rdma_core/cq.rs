//! Completion queues over libibverbs: polling through the context's ops table, the completion
//! channel as event fd, provider-made flush completions, CQ-overrun reporting.

#![allow(unsafe_code)]

use super::*;

pub(super) struct Cq {
    pub(super) ctx: Arc<CtxInner>,
    pub(super) raw: *mut IbvCq,
    pub(super) channel: *mut IbvCompChannel,
    pub(super) capacity: u32,
    pub(super) overflowed: Arc<AtomicBool>,
    pub(super) poll_fn: PollCqFn,
    pub(super) notify_fn: ReqNotifyFn,
    /// Completions made by the provider itself (requests posted to a QP already in ERROR, which
    /// devices differ on flushing), released by the QPs' shadows in queue order.
    pub(super) made: Arc<MadeCompletions>,
}

/// Flushed completions the provider made for requests posted in ERROR, released to the CQ once
/// every earlier request of their queue has completed (see [`super::Shadow`]); polled before the
/// device's completions.
#[derive(Default)]
pub(super) struct MadeCompletions {
    queue: Mutex<std::collections::VecDeque<WorkCompletion>>,
    any: AtomicBool,
}

impl MadeCompletions {
    pub(super) fn push(&self, wc: WorkCompletion) {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(wc);
        self.any.store(true, Ordering::Release);
    }

    /// Move what was released into `out`; returns how many.
    fn take_into(&self, out: &mut [WorkCompletion]) -> usize {
        if out.is_empty() || !self.any.load(Ordering::Acquire) {
            return 0;
        }
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let mut done = 0;
        for slot in out.iter_mut() {
            let Some(w) = q.pop_front() else { break };
            *slot = w;
            done += 1;
        }
        if q.is_empty() {
            self.any.store(false, Ordering::Release);
        }
        done
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

pub(super) fn wc_status(s: u32) -> WcStatus {
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

pub(super) fn wc_opcode(o: u32) -> WcOpcode {
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
        let done = self.made.take_into(wc);
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
        drop(shadows);
        // Made completions the device's just released come right behind them.
        let released = wc.get_mut(n..).map_or(0, |rest| self.made.take_into(rest));
        Ok(done + n + released)
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
