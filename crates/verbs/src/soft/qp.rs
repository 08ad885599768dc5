//! [`QpCore`]: the transport-agnostic state of one software RC queue pair.
//!
//! Owns: the QP state machine (every transition through [`QpState::check_transition`] and one
//! `set_state`), attributes, the requester and responder halves, the private receive queue,
//! posting rules (limits, inline, WrongState, ERROR flush) and the routing of decoded frames.
//! Does not own: sockets, threads, locks or the clock — a provider driver wraps a `QpCore` in
//! its lock, feeds it frames and time (`handle_frame`, `handle_timeout`), and sends what
//! `poll_transmit` produces. Completions go straight to the QP's [`SoftCq`]s, which are
//! thread-safe.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cq::SoftCq;
use super::mr::{append_raw, MrTable};
use super::requester::{EntryKind, Fault, Requester, SqEntry};
use super::responder::{RecvSource, Responder, ResponderEnv};
use super::rq::{RecvQueue, SoftSrq};
use super::wire::{begin_request, Frame, RequestOp};
use crate::{
    AccessFlags, PostError, QpAttr, QpCaps, QpEndpoint, QpInfo, QpNum, QpState, RecvWr, Result,
    SendFlags, SendWr, VerbsError, WcOpcode, WcStatus, WorkCompletion, WrOpcode,
};

/// Creation parameters of a [`QpCore`].
pub struct QpConfig {
    /// The QP number.
    pub qp_num: QpNum,
    /// Granted queue sizes.
    pub caps: QpCaps,
    /// Every send request is signaled.
    pub sq_sig_all: bool,
    /// Send completions.
    pub send_cq: SoftCq,
    /// Receive completions.
    pub recv_cq: SoftCq,
    /// The PD's regions.
    pub table: Arc<MrTable>,
    /// Shared receive queue, if any.
    pub srq: Option<SoftSrq>,
    /// Largest message.
    pub max_payload: usize,
    /// Floor under the ACK timeout a transport with its own reliability applies (0: none).
    pub min_ack_timeout: Duration,
    /// Our initial PSN (advertised in the endpoint).
    pub initial_psn: u32,
}

/// What a modify did that the driver must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// Nothing beyond attributes.
    None,
    /// Entered RTR towards this peer: connect.
    Rtr(QpEndpoint),
    /// Entered RTS: transmission may start.
    Rts,
    /// Entered ERROR.
    Error,
    /// Entered RESET: drop the connection.
    Reset,
}

/// The state of one software RC QP.
pub struct QpCore {
    cfg: QpConfig,
    state: QpState,
    access: AccessFlags,
    remote: Option<QpEndpoint>,
    min_rnr_timer: u8,
    timeout_code: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    rq: RecvQueue,
    requester: Requester,
    responder: Responder,
    error_reason: Option<String>,
    wcs: Vec<WorkCompletion>,
}

impl std::fmt::Debug for QpCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpCore")
            .field("qp_num", &self.cfg.qp_num)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

fn post_err(index: usize, source: VerbsError) -> PostError {
    PostError { index, source }
}

impl QpCore {
    /// A QP in RESET.
    pub fn new(cfg: QpConfig) -> QpCore {
        let rq = RecvQueue::new(cfg.caps.max_recv_wr, cfg.caps.max_recv_sge.max(1));
        let requester = Requester::new(cfg.qp_num, cfg.initial_psn);
        QpCore {
            cfg,
            state: QpState::Reset,
            access: AccessFlags::empty(),
            remote: None,
            min_rnr_timer: 12,
            timeout_code: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            rq,
            requester,
            responder: Responder::new(0),
            error_reason: None,
            wcs: Vec::new(),
        }
    }

    /// QP number.
    pub fn qp_num(&self) -> QpNum {
        self.cfg.qp_num
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// The connected peer, once RTR.
    pub fn remote(&self) -> Option<&QpEndpoint> {
        self.remote.as_ref()
    }

    /// Why the QP entered ERROR, if it did on its own.
    pub fn error_reason(&self) -> Option<&str> {
        self.error_reason.as_deref()
    }

    /// The shared receive queue, if any.
    pub fn srq(&self) -> Option<&SoftSrq> {
        self.cfg.srq.as_ref()
    }

    /// The send CQ.
    pub fn send_cq(&self) -> &SoftCq {
        &self.cfg.send_cq
    }

    /// The receive CQ.
    pub fn recv_cq(&self) -> &SoftCq {
        &self.cfg.recv_cq
    }

    /// `ibv_query_qp`.
    pub fn query(&self) -> QpInfo {
        QpInfo {
            qp_num: self.cfg.qp_num,
            state: self.state,
            caps: self.cfg.caps,
            access: self.access,
            rnr_retry: self.rnr_retry,
            min_rnr_timer: self.min_rnr_timer,
            timeout: self.timeout_code,
            retry_cnt: self.retry_cnt,
            remote: self.remote.clone(),
        }
    }

    fn set_state(&mut self, to: QpState) {
        if self.state != to {
            tracing::debug!(qp = self.cfg.qp_num.0, from = ?self.state, ?to, "QP state");
        }
        self.state = to;
    }

    /// Apply a modify (`ibv_modify_qp`), re-checking the transition.
    pub fn modify(&mut self, attr: &QpAttr) -> Result<Transition> {
        let to = attr.state.unwrap_or(self.state);
        if attr.state.is_some() {
            self.state.check_transition(to)?;
        }
        if let Some(code) = attr.rnr_retry.or(attr.retry_cnt) {
            if code > 7 {
                return Err(VerbsError::InvalidArgument(format!(
                    "retry count {code} not in 0..=7"
                )));
            }
        }
        let from = self.state;
        match to {
            QpState::Reset => {
                self.requester.reset();
                self.rq.drain();
                self.remote = None;
                self.error_reason = None;
                self.set_state(QpState::Reset);
                return Ok(Transition::Reset);
            }
            QpState::Error => {
                if from != QpState::Error {
                    self.enter_error(None);
                }
                return Ok(Transition::Error);
            }
            _ => {}
        }
        if let Some(access) = attr.access {
            self.access = access;
        }
        if let Some(code) = attr.min_rnr_timer {
            self.min_rnr_timer = code & 31;
            self.responder.set_min_rnr_timer(code);
        }
        if let Some(t) = attr.timeout {
            self.timeout_code = t;
        }
        if let Some(n) = attr.retry_cnt {
            self.retry_cnt = n;
        }
        if let Some(n) = attr.rnr_retry {
            self.rnr_retry = n;
        }
        let mut params = self.requester.params();
        params.ack_timeout =
            crate::ack_timeout(self.timeout_code).map(|t| t.max(self.cfg.min_ack_timeout));
        params.retry_cnt = self.retry_cnt;
        params.rnr_retry = self.rnr_retry;
        if let Some(n) = attr.max_rd_atomic {
            params.max_rd_atomic = u32::from(n.max(1));
        }
        self.requester.set_params(params);
        let mut transition = Transition::None;
        if to == QpState::Rtr && from == QpState::Init {
            let remote = attr.remote.clone().ok_or_else(|| {
                VerbsError::InvalidArgument("RTR needs the remote endpoint".into())
            })?;
            self.responder
                .set_expected_psn(attr.rq_psn.unwrap_or(remote.psn));
            self.responder.set_min_rnr_timer(self.min_rnr_timer);
            self.requester.set_remote(remote.qp_num);
            self.remote = Some(remote.clone());
            transition = Transition::Rtr(remote);
        }
        if to == QpState::Rts && from == QpState::Rtr {
            self.requester
                .set_psn(attr.sq_psn.unwrap_or(self.cfg.initial_psn));
            transition = Transition::Rts;
        }
        if to == QpState::Rts && matches!(from, QpState::Sqd | QpState::Sqe) {
            transition = Transition::Rts;
        }
        self.set_state(to);
        Ok(transition)
    }

    /// Move to ERROR on our own (bad frame, peer gone, fatal completion): logs `reason`, flushes
    /// every outstanding send and receive with `WrFlushed`.
    pub fn fail(&mut self, reason: impl Into<String>) {
        if self.state == QpState::Error {
            return;
        }
        let reason = reason.into();
        tracing::warn!(qp = self.cfg.qp_num.0, %reason, "QP enters ERROR");
        self.enter_error(Some(reason));
    }

    fn enter_error(&mut self, reason: Option<String>) {
        self.error_reason = reason;
        self.set_state(QpState::Error);
        let mut wcs = std::mem::take(&mut self.wcs);
        self.requester.flush(&mut wcs);
        for wc in wcs.drain(..) {
            self.cfg.send_cq.push(wc, true);
        }
        for r in self.rq.drain() {
            self.cfg.recv_cq.push(self.flushed_recv(r.wr_id), true);
        }
        self.wcs = wcs;
    }

    fn flushed_recv(&self, wr_id: u64) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status: WcStatus::WrFlushed,
            opcode: WcOpcode::Recv,
            byte_len: 0,
            imm_data: None,
            qp_num: self.cfg.qp_num,
            src_qp: self.remote.as_ref().map_or(QpNum(0), |r| r.qp_num),
            vendor_err: 0,
        }
    }

    fn emit_send_completions(&mut self) {
        for wc in self.wcs.drain(..) {
            self.cfg.send_cq.push(wc, false);
        }
    }

    fn after_requester(&mut self, r: std::result::Result<(), Fault>) {
        self.emit_send_completions();
        if let Err(Fault(reason)) = r {
            self.fail(reason);
        }
    }

    /// Post send requests (`ibv_post_send`).
    pub fn post_send(&mut self, now: Instant, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        if !self.state.accepts_send() {
            return Err(post_err(
                0,
                VerbsError::WrongState {
                    state: self.state,
                    what: "send",
                },
            ));
        }
        let caps = self.cfg.caps;
        for (index, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > caps.max_send_sge as usize {
                return Err(post_err(
                    index,
                    VerbsError::LimitExceeded(format!(
                        "{} SGEs exceed max_send_sge {}",
                        wr.sg_list.len(),
                        caps.max_send_sge
                    )),
                ));
            }
            let total = wr.total_len();
            let inline = wr.flags.contains(SendFlags::INLINE);
            let carries_payload = matches!(
                wr.opcode,
                WrOpcode::Send
                    | WrOpcode::SendWithImm { .. }
                    | WrOpcode::Write { .. }
                    | WrOpcode::WriteWithImm { .. }
            );
            if inline && (!carries_payload || total > u64::from(caps.max_inline_data)) {
                return Err(post_err(
                    index,
                    VerbsError::InvalidArgument(format!(
                        "inline payload of {total} bytes (max_inline_data {}) on {:?}",
                        caps.max_inline_data, wr.opcode
                    )),
                ));
            }
            if total > self.cfg.max_payload as u64 {
                return Err(post_err(
                    index,
                    VerbsError::LimitExceeded(format!(
                        "message of {total} bytes exceeds {}",
                        self.cfg.max_payload
                    )),
                ));
            }
            if wr.opcode.is_atomic()
                && (wr.sg_list.len() != 1 || wr.sg_list.first().is_some_and(|s| s.length != 8))
            {
                return Err(post_err(
                    index,
                    VerbsError::InvalidArgument("an atomic needs exactly one 8-byte SGE".into()),
                ));
            }
            if self.state == QpState::Error {
                let wc = WorkCompletion {
                    wr_id: wr.wr_id,
                    status: WcStatus::WrFlushed,
                    opcode: wr.opcode.wc_opcode(),
                    byte_len: 0,
                    imm_data: None,
                    qp_num: self.cfg.qp_num,
                    src_qp: self.remote.as_ref().map_or(QpNum(0), |r| r.qp_num),
                    vendor_err: 0,
                };
                self.cfg.send_cq.push(wc, true);
                continue;
            }
            if self.requester.len() >= caps.max_send_wr as usize {
                return Err(post_err(index, VerbsError::QueueFull));
            }
            let entry = self.build_entry(wr, total, inline);
            self.requester.push(now, entry);
        }
        let r = self.requester.check_head_failure(now, &mut self.wcs);
        self.after_requester(r);
        Ok(())
    }

    fn build_entry(&mut self, wr: &SendWr<'_>, total: u64, inline: bool) -> SqEntry {
        let psn = self.requester.alloc_psn();
        let remote_qpn = self.remote.as_ref().map_or(0, |r| r.qp_num.0);
        let solicited = wr.flags.contains(SendFlags::SOLICITED);
        let len32 = u32::try_from(total).unwrap_or(u32::MAX);
        let (op, kind) = match wr.opcode {
            WrOpcode::Send => (
                RequestOp::Send {
                    imm: None,
                    payload: &[],
                },
                EntryKind::Acked,
            ),
            WrOpcode::SendWithImm { imm } => (
                RequestOp::Send {
                    imm: Some(imm),
                    payload: &[],
                },
                EntryKind::Acked,
            ),
            WrOpcode::Write { remote } => (
                RequestOp::Write {
                    addr: remote.addr,
                    rkey: remote.rkey.0,
                    imm: None,
                    payload: &[],
                },
                EntryKind::Acked,
            ),
            WrOpcode::WriteWithImm { remote, imm } => (
                RequestOp::Write {
                    addr: remote.addr,
                    rkey: remote.rkey.0,
                    imm: Some(imm),
                    payload: &[],
                },
                EntryKind::Acked,
            ),
            WrOpcode::Read { remote } => (
                RequestOp::Read {
                    addr: remote.addr,
                    rkey: remote.rkey.0,
                    len: len32,
                },
                EntryKind::Read {
                    sges: wr.sg_list.to_vec(),
                    len: len32,
                },
            ),
            WrOpcode::AtomicCmpSwp {
                remote,
                compare,
                swap,
            } => (
                RequestOp::CmpSwap {
                    addr: remote.addr,
                    rkey: remote.rkey.0,
                    compare,
                    swap,
                },
                EntryKind::Atomic {
                    sge: wr.sg_list.first().copied().unwrap_or(crate::Sge {
                        addr: 0,
                        length: 0,
                        lkey: crate::Lkey(0),
                    }),
                },
            ),
            WrOpcode::AtomicFetchAdd { remote, add } => (
                RequestOp::FetchAdd {
                    addr: remote.addr,
                    rkey: remote.rkey.0,
                    add,
                },
                EntryKind::Atomic {
                    sge: wr.sg_list.first().copied().unwrap_or(crate::Sge {
                        addr: 0,
                        length: 0,
                        lkey: crate::Lkey(0),
                    }),
                },
            ),
        };
        let mut frame = Vec::with_capacity(
            64 + if matches!(kind, EntryKind::Acked) {
                total as usize
            } else {
                0
            },
        );
        let mut failed = None;
        let mut deferred = None;
        {
            let mut w = begin_request(&mut frame, remote_qpn, psn, solicited, &op);
            match kind {
                EntryKind::Acked if inline => {
                    for s in wr.sg_list {
                        // SAFETY: INLINE's contract (crate::SendFlags::INLINE): the SGEs name
                        // readable memory of the caller for the duration of post_send; lkeys are
                        // not consulted, as with verbs.
                        unsafe { append_raw(w.buf(), s.addr, s.length as usize) };
                    }
                }
                EntryKind::Acked => {
                    if let Err(status) = self
                        .cfg
                        .table
                        .validate_local(wr.sg_list, AccessFlags::empty())
                    {
                        failed = Some(status);
                    } else if !wr.sg_list.is_empty() {
                        deferred = Some(wr.sg_list.to_vec());
                    }
                }
                EntryKind::Read { .. } | EntryKind::Atomic { .. } => {
                    if let Err(status) = self
                        .cfg
                        .table
                        .validate_local(wr.sg_list, AccessFlags::LOCAL_WRITE)
                    {
                        failed = Some(status);
                    }
                }
            }
            w.finish();
        }
        SqEntry {
            wr_id: wr.wr_id,
            opcode: wr.opcode.wc_opcode(),
            signaled: self.cfg.sq_sig_all || wr.flags.contains(SendFlags::SIGNALED),
            fence: wr.flags.contains(SendFlags::FENCE),
            psn,
            frame,
            kind,
            byte_len: len32,
            failed,
            rnr_naks: 0,
            deferred_gather: deferred,
        }
    }

    /// Post receive requests (`ibv_post_recv`).
    pub fn post_recv(&mut self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        if !self.state.accepts_recv() {
            return Err(post_err(
                0,
                VerbsError::WrongState {
                    state: self.state,
                    what: "recv",
                },
            ));
        }
        if self.cfg.srq.is_some() {
            return Err(post_err(
                0,
                VerbsError::InvalidArgument("QP draws receives from an SRQ".into()),
            ));
        }
        if self.state == QpState::Error {
            for (index, wr) in wrs.iter().enumerate() {
                if wr.sg_list.len() > self.cfg.caps.max_recv_sge.max(1) as usize {
                    return Err(post_err(
                        index,
                        VerbsError::LimitExceeded("too many SGEs".into()),
                    ));
                }
                self.cfg.recv_cq.push(self.flushed_recv(wr.wr_id), true);
            }
            return Ok(());
        }
        self.rq.post(wrs)
    }

    /// Feed one decoded frame; responses and resends are appended to `out`.
    pub fn handle_frame(&mut self, now: Instant, frame: &Frame<'_>, out: &mut Vec<u8>) {
        match frame {
            Frame::Request(req) => {
                if req.qpn != self.cfg.qp_num.0 {
                    self.fail(format!(
                        "request for QP {} reached QP {}",
                        req.qpn, self.cfg.qp_num.0
                    ));
                    return;
                }
                match self.state {
                    QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe => {}
                    // ERROR drops silently; RESET/INIT cannot have a connection.
                    _ => return,
                }
                let remote_qpn = self.remote.as_ref().map_or(QpNum(0), |r| r.qp_num);
                let srq = self.cfg.srq.clone();
                let recv = match &srq {
                    Some(s) => RecvSource::Shared(s),
                    None => RecvSource::Own(&mut self.rq),
                };
                let mut env = ResponderEnv {
                    table: &self.cfg.table,
                    access: self.access,
                    recv,
                    qp_num: self.cfg.qp_num,
                    remote_qpn,
                };
                let outcome = self.responder.handle_request(req, &mut env, out);
                if let Some((wc, solicited)) = outcome.recv_completion {
                    self.cfg.recv_cq.push(wc, solicited);
                }
                if let Some(reason) = outcome.fatal {
                    self.responder.poll_ack(remote_qpn, out);
                    self.fail(reason);
                }
            }
            Frame::Response(resp) => {
                if resp.qpn != self.cfg.qp_num.0 {
                    self.fail(format!(
                        "response for QP {} reached QP {}",
                        resp.qpn, self.cfg.qp_num.0
                    ));
                    return;
                }
                match self.state {
                    QpState::Rts | QpState::Sqd | QpState::Sqe => {
                        let r = self.requester.handle_response(
                            now,
                            resp,
                            &self.cfg.table,
                            &mut self.wcs,
                        );
                        self.after_requester(r);
                    }
                    QpState::Error => {}
                    _ => self.fail(format!("response PSN {} before RTS", resp.psn)),
                }
            }
            Frame::Hello { .. } => self.fail("unexpected HELLO inside a connection"),
        }
    }

    /// End of an input batch: append the coalesced ACK, if any.
    pub fn end_batch(&mut self, out: &mut Vec<u8>) {
        if self.state != QpState::Error {
            let remote_qpn = self.remote.as_ref().map_or(QpNum(0), |r| r.qp_num);
            self.responder.poll_ack(remote_qpn, out);
        }
    }

    /// Append request frames that may go out now; returns how many.
    pub fn poll_transmit(&mut self, now: Instant, out: &mut Vec<u8>) -> usize {
        if self.state != QpState::Rts {
            return 0;
        }
        let n = self.requester.poll_transmit(now, &self.cfg.table, out);
        let r = self.requester.check_head_failure(now, &mut self.wcs);
        self.after_requester(r);
        n
    }

    /// True if requests wait for transmission.
    pub fn wants_transmit(&self) -> bool {
        self.state == QpState::Rts && self.requester.has_untransmitted()
    }

    /// When [`QpCore::handle_timeout`] should run next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            QpState::Rts | QpState::Sqd | QpState::Sqe => self.requester.poll_timeout(),
            _ => None,
        }
    }

    /// Expire timers. Spurious calls are harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.poll_timeout().is_some_and(|t| now >= t) {
            let r = self.requester.handle_timeout(now, &mut self.wcs);
            self.after_requester(r);
        }
    }
}
