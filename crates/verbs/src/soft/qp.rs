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
use super::mr::{Dest, MemKey, MrTable};
use super::requester::{EntryKind, Fault, Requester, SqEntry};
use super::responder::{Placement, ReadRef, RecvSource, Responder, ResponderEnv};
use super::rq::{RecvQueue, SoftSrq};
use super::tx::{FrameSink, TxQueue};
use super::wire::{begin_request, Frame, RequestOp, ResponseKind};
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
    /// Our initial PSN (advertised in the endpoint) until the first RESET, which draws a new
    /// one (see [`QpCore::initial_psn`]).
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

    /// The initial send PSN the QP advertises now: the configured one, then a random one
    /// drawn at every RESET, so that a reset QP's next connection never starts where its
    /// previous one did (frames of that one still in flight cannot fall into its window).
    pub fn initial_psn(&self) -> u32 {
        self.cfg.initial_psn
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
                self.cfg.initial_psn = crate::next_psn(self.cfg.initial_psn);
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
            let inline = wr.is_inline();
            if inline && (!wr.opcode.carries_payload() || total > u64::from(caps.max_inline_data)) {
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
        // Room for an inline payload; a deferred one is gathered (and the frame grown) or left
        // in registered memory at first transmission.
        let mut frame = Vec::with_capacity(
            64 + if matches!(kind, EntryKind::Acked) && inline {
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
                    w.buf().extend_from_slice(wr.inline_data);
                    if let Err(status) = self.cfg.table.gather_inline(wr.sg_list, w.buf()) {
                        failed = Some(status);
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
            frame: Arc::new(frame),
            kind,
            byte_len: len32,
            failed,
            rnr_naks: 0,
            deferred_gather: deferred,
            payload_ref: None,
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
        self.handle_frame_inner(now, frame, out, false);
    }

    /// [`QpCore::handle_frame`] for a stream output: the payload of a large READ response is
    /// queued as registered memory, read by the kernel when it is sent (a READ reads the
    /// memory when the response leaves, as a NIC does; a request that must see the READ done
    /// first is FENCEd by the requester).
    pub fn handle_frame_tx(&mut self, now: Instant, frame: &Frame<'_>, tx: &mut TxQueue) {
        let read = tx.append_with(|out| self.handle_frame_inner(now, frame, out, true));
        if let Some(r) = read {
            let range = Dest {
                key: MemKey::Remote(crate::Rkey(r.rkey)),
                addr: r.addr,
                len: u64::from(r.len),
                need: AccessFlags::REMOTE_READ,
            };
            tx.push_ranges(Arc::new([range]), r.len as usize, &self.cfg.table);
        }
    }

    fn handle_frame_inner(
        &mut self,
        now: Instant,
        frame: &Frame<'_>,
        out: &mut Vec<u8>,
        read_by_ref: bool,
    ) -> Option<ReadRef> {
        match frame {
            Frame::Request(req) => {
                if req.qpn != self.cfg.qp_num.0 {
                    self.fail(format!(
                        "request for QP {} reached QP {}",
                        req.qpn, self.cfg.qp_num.0
                    ));
                    return None;
                }
                match self.state {
                    QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe => {}
                    // ERROR drops silently; RESET/INIT cannot have a connection.
                    _ => return None,
                }
                let (responder, mut env) = self.responder_with_env(read_by_ref);
                let remote_qpn = env.remote_qpn;
                let outcome = responder.handle_request(req, &mut env, out);
                let read = self.responder.take_read_ref();
                if let Some((wc, solicited)) = outcome.recv_completion {
                    self.cfg.recv_cq.push(wc, solicited);
                }
                if let Some(reason) = outcome.fatal {
                    self.responder.poll_ack(remote_qpn, out);
                    self.fail(reason);
                }
                read
            }
            Frame::Response(resp) => {
                if resp.qpn != self.cfg.qp_num.0 {
                    self.fail(format!(
                        "response for QP {} reached QP {}",
                        resp.qpn, self.cfg.qp_num.0
                    ));
                    return None;
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
                None
            }
            Frame::Hello { .. } | Frame::Bye { .. } => {
                self.fail("unexpected HELLO or BYE inside a connection");
                None
            }
        }
    }

    /// Start placing the payload (`len` bytes, not yet received) of a SEND, WRITE or READ
    /// response (the head of `frame`, from [`super::wire::decode_head`]) straight into its
    /// destination (see [`Placement`]). `None`: buffer the frame whole and use
    /// [`QpCore::handle_frame`] (it will not simply execute: wrong QP or state, a PSN other
    /// than the expected one, an access or length error, no receive, a response that is not
    /// the one the head READ waits for — every such case is answered there).
    pub fn begin_placement(
        &mut self,
        now: Instant,
        frame: &Frame<'_>,
        len: usize,
    ) -> Option<Placement> {
        let req = match frame {
            Frame::Request(req) => req,
            Frame::Response(resp) => {
                if resp.qpn != self.cfg.qp_num.0
                    || !matches!(self.state, QpState::Rts | QpState::Sqd | QpState::Sqe)
                    || !matches!(resp.kind, ResponseKind::ReadResp { .. })
                {
                    return None;
                }
                let table = self.cfg.table.clone();
                let p =
                    self.requester
                        .begin_read_placement(now, resp.psn, len, &table, &mut self.wcs);
                self.emit_send_completions();
                return p;
            }
            Frame::Hello { .. } | Frame::Bye { .. } => return None,
        };
        if req.qpn != self.cfg.qp_num.0
            || !matches!(
                self.state,
                QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
            )
        {
            return None;
        }
        let table = self.cfg.table.clone();
        let (responder, mut env) = self.responder_with_env(false);
        responder.begin_placement(req, len, &mut env, &table)
    }

    /// The responder and what it works against: the QP's regions and rights, its receives
    /// (the SRQ if it has one, else its own queue) and its peer.
    fn responder_with_env(&mut self, read_by_ref: bool) -> (&mut Responder, ResponderEnv<'_>) {
        let env = ResponderEnv {
            table: &self.cfg.table,
            access: self.access,
            recv: match &self.cfg.srq {
                Some(s) => RecvSource::Shared(s),
                None => RecvSource::Own(&mut self.rq),
            },
            qp_num: self.cfg.qp_num,
            remote_qpn: self.remote.as_ref().map_or(QpNum(0), |r| r.qp_num),
            max_payload: self.cfg.max_payload,
            read_by_ref,
        };
        (&mut self.responder, env)
    }

    /// Complete a placement whose payload arrived whole; responses are appended to `out`. In
    /// any state but the ones it began in (the QP left them meanwhile), it is given up as by
    /// [`QpCore::abandon_placement`].
    pub fn finish_placement(&mut self, now: Instant, p: Placement, out: &mut Vec<u8>) {
        if p.is_read_response() {
            if matches!(self.state, QpState::Rts | QpState::Sqd | QpState::Sqe) {
                let r = self.requester.finish_read_placement(now, p, &mut self.wcs);
                self.after_requester(r);
            }
            return;
        }
        if !matches!(
            self.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        ) {
            self.abandon_placement(p);
            return;
        }
        let (responder, mut env) = self.responder_with_env(false);
        let remote_qpn = env.remote_qpn;
        let outcome = responder.finish_placement(p, &mut env, out);
        if let Some((wc, solicited)) = outcome.recv_completion {
            self.cfg.recv_cq.push(wc, solicited);
        }
        if let Some(reason) = outcome.fatal {
            self.responder.poll_ack(remote_qpn, out);
            self.fail(reason);
        }
    }

    /// Give a placement up (its connection is gone, or the QP was reset): the request did not
    /// execute (the peer resends it, or is in ERROR). Its receive goes back to the queue it
    /// came from, or completes `WrFlushed` if this QP's own queue was flushed already (ERROR).
    pub fn abandon_placement(&mut self, p: Placement) {
        let Some(recv) = p.into_recv() else {
            return;
        };
        match (&self.cfg.srq, self.state) {
            (Some(srq), _) => srq.unpop(recv),
            (None, QpState::Error) => {
                let wc = self.flushed_recv(recv.wr_id);
                self.cfg.recv_cq.push(wc, true);
            }
            (None, QpState::Reset) => {}
            (None, _) => self.rq.unpop(recv),
        }
    }

    /// End of an input batch: append the coalesced ACK, if any.
    pub fn end_batch(&mut self, out: &mut Vec<u8>) {
        if self.state != QpState::Error {
            let remote_qpn = self.remote.as_ref().map_or(QpNum(0), |r| r.qp_num);
            self.responder.poll_ack(remote_qpn, out);
        }
    }

    /// Queue request frames that may go out now; returns how many.
    pub fn poll_transmit(&mut self, now: Instant, out: &mut impl FrameSink) -> usize {
        if self.state != QpState::Rts {
            return 0;
        }
        let n = self.requester.poll_transmit(now, &self.cfg.table, out);
        let r = self.requester.check_head_failure(now, &mut self.wcs);
        self.after_requester(r);
        n
    }

    /// Send every outstanding request again from the oldest (a stream provider's connection was
    /// replaced before the responder could have read any of them).
    pub fn rewind_requests(&mut self) {
        self.requester.rewind();
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

#[cfg(test)]
mod tests {
    //! Two `QpCore`s wired back to back with no sockets: bytes move between them by hand and
    //! time is virtual, as a datagram or stream driver would do it.
    use super::*;
    use crate::soft::mr::SoftMr;
    use crate::soft::wire::decode;
    use crate::{provider::MrOps, RecvWr, SendFlags, WcOpcode};

    struct Node {
        core: QpCore,
        cq: SoftCq,
        _mr: SoftMr,
        info: crate::MrInfo,
    }

    fn node(qpn: u32, psn: u32) -> Node {
        let table = MrTable::new();
        let mr = SoftMr::alloc(&table, 4096, AccessFlags::ALL).unwrap();
        let info = mr.info();
        let cq = SoftCq::new(64).unwrap();
        let core = QpCore::new(QpConfig {
            qp_num: QpNum(qpn),
            caps: QpCaps::default(),
            sq_sig_all: false,
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            table,
            srq: None,
            max_payload: 1 << 20,
            min_ack_timeout: Duration::ZERO,
            initial_psn: psn,
        });
        Node {
            core,
            cq,
            _mr: mr,
            info,
        }
    }

    fn endpoint(n: &Node, psn: u32) -> QpEndpoint {
        QpEndpoint {
            provider: "test".into(),
            device: "test0".into(),
            address: String::new(),
            qp_num: n.core.qp_num(),
            psn,
            lid: 0,
            gid: [0; 16],
            mtu: 4096,
            extra: Default::default(),
        }
    }

    fn connected(rnr_retry: u8) -> (Node, Node) {
        let mut a = node(1, 100);
        let mut b = node(2, 500);
        let (ea, eb) = (endpoint(&a, 100), endpoint(&b, 500));
        for (n, remote) in [(&mut a, eb), (&mut b, ea)] {
            n.core.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
            let t = n
                .core
                .modify(&QpAttr::rtr(remote.clone()).with_min_rnr_timer(1))
                .unwrap();
            assert_eq!(t, Transition::Rtr(remote));
            let t = n
                .core
                .modify(&QpAttr::rts().with_rnr_retry(rnr_retry))
                .unwrap();
            assert_eq!(t, Transition::Rts);
        }
        (a, b)
    }

    /// Deliver everything `from` wants to send to `to`; returns the frames moved.
    fn pump(now: Instant, from: &mut Node, to: &mut Node, pending: &mut Vec<u8>) -> usize {
        from.core.poll_transmit(now, pending);
        let mut out = Vec::new();
        let mut n = 0;
        let mut at = 0;
        while let Some((f, used)) = decode(&pending[at..], 1 << 20).unwrap() {
            to.core.handle_frame(now, &f, &mut out);
            at += used;
            n += 1;
        }
        pending.drain(..at);
        to.core.end_batch(&mut out);
        let mut back = Vec::new();
        let mut at = 0;
        while let Some((f, used)) = decode(&out[at..], 1 << 20).unwrap() {
            from.core.handle_frame(now, &f, &mut back);
            at += used;
        }
        n
    }

    fn sge(n: &Node, off: u64, len: u32) -> crate::Sge {
        crate::Sge {
            addr: n.info.addr + off,
            length: len,
            lkey: n.info.lkey,
        }
    }

    fn poll(n: &Node) -> Vec<WorkCompletion> {
        let mut out = [WorkCompletion::EMPTY; 16];
        let k = n.cq.poll_queue(&mut out).unwrap();
        out[..k].to_vec()
    }

    #[test]
    fn send_is_delivered_and_acknowledged_without_any_io() {
        let (mut a, mut b) = connected(7);
        let now = Instant::now();
        b.core
            .post_recv(&[RecvWr::new(9, &[sge(&b, 0, 64)])])
            .unwrap();
        a.core
            .post_send(
                now,
                &[SendWr::new(
                    1,
                    &[sge(&a, 0, 5)],
                    WrOpcode::SendWithImm { imm: 3 },
                )],
            )
            .unwrap();
        let mut wire = Vec::new();
        assert_eq!(pump(now, &mut a, &mut b, &mut wire), 1);
        let r = poll(&b);
        assert_eq!((r[0].wr_id, r[0].byte_len, r[0].imm_data), (9, 5, Some(3)));
        let s = poll(&a);
        assert_eq!(
            (s[0].wr_id, s[0].status, s[0].opcode),
            (1, WcStatus::Success, WcOpcode::Send)
        );
    }

    #[test]
    fn rnr_pause_resend_and_success_in_virtual_time() {
        let (mut a, mut b) = connected(7);
        let t0 = Instant::now();
        a.core
            .post_send(t0, &[SendWr::new(1, &[], WrOpcode::Send)])
            .unwrap();
        let mut wire = Vec::new();
        pump(t0, &mut a, &mut b, &mut wire);
        assert!(poll(&a).is_empty(), "RNR NAK'd, not completed");
        // Paused: nothing goes out before the RNR timer.
        assert_eq!(pump(t0, &mut a, &mut b, &mut wire), 0);
        let t1 = a.core.poll_timeout().unwrap();
        assert!(t1 > t0);
        b.core.post_recv(&[RecvWr::new(4, &[])]).unwrap();
        a.core.handle_timeout(t1);
        assert_eq!(pump(t1, &mut a, &mut b, &mut wire), 1);
        assert_eq!(poll(&b)[0].wr_id, 4);
        assert_eq!(poll(&a)[0].status, WcStatus::Success);
    }

    #[test]
    fn lost_frames_are_resent_on_ack_timeout_then_retry_exceeded() {
        let (mut a, _b) = connected(7);
        let t0 = Instant::now();
        a.core
            .post_send(
                t0,
                &[SendWr::new(1, &[], WrOpcode::Send).with_flags(SendFlags::empty())],
            )
            .unwrap();
        let mut lost = Vec::new();
        assert_eq!(a.core.poll_transmit(t0, &mut lost), 1);
        let mut t = t0;
        let retries = a.core.query().retry_cnt;
        assert!(retries > 0);
        for _ in 0..retries {
            t = a.core.poll_timeout().unwrap();
            a.core.handle_timeout(t);
            lost.clear();
            assert_eq!(a.core.poll_transmit(t, &mut lost), 1, "resent");
        }
        let t = a.core.poll_timeout().unwrap().max(t);
        a.core.handle_timeout(t);
        let wc = poll(&a);
        assert_eq!(
            wc[0].status,
            WcStatus::RetryExceeded,
            "failures complete even unsignaled"
        );
        assert_eq!(a.core.state(), QpState::Error);
    }

    #[test]
    fn posting_rules_by_state() {
        let mut n = node(1, 0);
        let now = Instant::now();
        let e = n
            .core
            .post_send(now, &[SendWr::new(1, &[], WrOpcode::Send)])
            .unwrap_err();
        assert!(matches!(
            e.source,
            VerbsError::WrongState {
                state: QpState::Reset,
                ..
            }
        ));
        assert!(n.core.post_recv(&[RecvWr::new(1, &[])]).is_err());
        assert!(matches!(
            n.core.modify(&QpAttr::rtr(endpoint(&n, 0))),
            Err(VerbsError::IllegalTransition { .. })
        ));
        n.core.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
        n.core.post_recv(&[RecvWr::new(1, &[])]).unwrap();
        assert_eq!(n.core.modify(&QpAttr::error()).unwrap(), Transition::Error);
        let wc = poll(&n);
        assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::WrFlushed));
        n.core
            .post_send(now, &[SendWr::new(2, &[], WrOpcode::Send)])
            .unwrap();
        assert_eq!(poll(&n)[0].status, WcStatus::WrFlushed);
        n.core.modify(&QpAttr::reset()).unwrap();
        assert!(poll(&n).is_empty(), "RESET completes nothing");
    }
}
