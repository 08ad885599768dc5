//! The responder half of a software RC QP: executes incoming requests against local registered
//! memory and answers them.
//!
//! Owns: the expected PSN, the NAK state (after an RNR or sequence NAK, later requests are
//! dropped until the NAK'd one is resent — go-back-N), a small cache of atomic results so a
//! resent atomic is answered without being executed twice, and ACK coalescing (one cumulative
//! ACK per input batch). Sans-IO: it is handed decoded requests and appends encoded responses to
//! the caller's buffer; memory goes through [`MrTable`], receives through [`RecvSource`].

use std::collections::VecDeque;

use super::mr::{AtomicOp, MrTable, RemoteError};
use super::rq::{PostedRecv, RecvQueue, SoftSrq};
use super::wire::{encode_response, NakCode, Request, RequestOp, Response, ResponseKind};
use crate::{AccessFlags, QpNum, WcOpcode, WcStatus, WorkCompletion};

const ATOMIC_CACHE: usize = 16;

/// Where receives come from.
pub enum RecvSource<'a> {
    /// The QP's own queue.
    Own(&'a mut RecvQueue),
    /// A shared receive queue.
    Shared(&'a SoftSrq),
}

impl RecvSource<'_> {
    fn unpop(&mut self, recv: PostedRecv) {
        match self {
            RecvSource::Own(q) => q.unpop(recv),
            RecvSource::Shared(s) => s.unpop(recv),
        }
    }
    fn pop(&mut self) -> Option<PostedRecv> {
        match self {
            RecvSource::Own(q) => q.pop(),
            RecvSource::Shared(s) => s.pop(),
        }
    }
}

/// What the responder needs from its QP for one request.
pub struct ResponderEnv<'a> {
    /// The PD's regions.
    pub table: &'a MrTable,
    /// Rights the QP grants peers (REMOTE_WRITE/READ/ATOMIC).
    pub access: AccessFlags,
    /// Receives.
    pub recv: RecvSource<'a>,
    /// This QP.
    pub qp_num: QpNum,
    /// The connected peer QP (responses are addressed to it).
    pub remote_qpn: QpNum,
    /// Largest READ served (the transport's payload limit).
    pub max_payload: usize,
}

/// The result of one request besides the bytes appended to the output.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RequestOutcome {
    /// A receive completion to queue on the receive CQ, and whether it is solicited.
    pub recv_completion: Option<(WorkCompletion, bool)>,
    /// The responder hit an error that puts the QP in ERROR (after the completion above).
    pub fatal: Option<String>,
}

/// Responder state of one QP.
#[derive(Debug)]
pub struct Responder {
    expected_psn: u32,
    in_nak: bool,
    min_rnr_timer: u8,
    ack_pending: bool,
    atomic_cache: VecDeque<(u32, u64)>,
}

/// `a` is before `b` in 32-bit serial arithmetic.
pub fn psn_before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

impl Responder {
    /// Expect `psn` first.
    pub fn new(psn: u32) -> Responder {
        Responder {
            expected_psn: psn,
            in_nak: false,
            min_rnr_timer: 12,
            ack_pending: false,
            atomic_cache: VecDeque::with_capacity(ATOMIC_CACHE),
        }
    }

    /// Reset the expected PSN (RTR).
    pub fn set_expected_psn(&mut self, psn: u32) {
        *self = Responder {
            min_rnr_timer: self.min_rnr_timer,
            ..Responder::new(psn)
        };
    }

    /// The RNR timer code sent in RNR NAKs.
    pub fn set_min_rnr_timer(&mut self, code: u8) {
        self.min_rnr_timer = code & 31;
    }

    /// The next PSN expected.
    pub fn expected_psn(&self) -> u32 {
        self.expected_psn
    }

    /// Append the coalesced ACK, if one is due. Call once per input batch.
    pub fn poll_ack(&mut self, remote_qpn: QpNum, out: &mut Vec<u8>) {
        if std::mem::take(&mut self.ack_pending) {
            encode_response(
                &Response {
                    qpn: remote_qpn.0,
                    psn: self.expected_psn.wrapping_sub(1),
                    kind: ResponseKind::Ack,
                },
                out,
            );
        }
    }

    fn respond(
        &mut self,
        env: &ResponderEnv<'_>,
        psn: u32,
        kind: ResponseKind<'_>,
        out: &mut Vec<u8>,
    ) {
        // Any response to psn P acknowledges every request before P: a pending ACK is implied.
        self.ack_pending = false;
        encode_response(
            &Response {
                qpn: env.remote_qpn.0,
                psn,
                kind,
            },
            out,
        );
    }

    fn nak(&mut self, env: &ResponderEnv<'_>, psn: u32, code: NakCode, out: &mut Vec<u8>) {
        let rnr_timer = self.min_rnr_timer;
        self.respond(env, psn, ResponseKind::Nak { code, rnr_timer }, out);
    }

    /// Execute one request; responses are appended to `out`.
    pub fn handle_request(
        &mut self,
        req: &Request<'_>,
        env: &mut ResponderEnv<'_>,
        out: &mut Vec<u8>,
    ) -> RequestOutcome {
        let psn = req.psn;
        if psn != self.expected_psn {
            if psn_before(psn, self.expected_psn) {
                self.handle_duplicate(req, env, out);
            } else if !self.in_nak {
                // A gap: ask for a resend from the expected PSN, once.
                self.in_nak = true;
                let expected = self.expected_psn;
                self.nak(env, expected, NakCode::PsnSequence, out);
            }
            return RequestOutcome::default();
        }
        self.in_nak = false;
        let mut outcome = RequestOutcome::default();
        match req.op {
            RequestOp::Send { imm, payload } => {
                let Some(recv) = env.recv.pop() else {
                    self.rnr(env, psn, out);
                    return outcome;
                };
                let mut wc = WorkCompletion {
                    wr_id: recv.wr_id,
                    status: WcStatus::Success,
                    opcode: WcOpcode::Recv,
                    byte_len: 0,
                    imm_data: imm,
                    qp_num: env.qp_num,
                    src_qp: env.remote_qpn,
                    vendor_err: 0,
                };
                match env.table.scatter(&recv.sges, payload) {
                    Ok(n) => {
                        wc.byte_len = n;
                        self.advance();
                    }
                    Err(status) => {
                        wc.status = status;
                        let code = if status == WcStatus::LocalLength {
                            NakCode::InvalidRequest
                        } else {
                            NakCode::RemoteOperation
                        };
                        self.nak(env, psn, code, out);
                        outcome.fatal = Some(format!(
                            "receive {} could not take a SEND of {} bytes: {status:?}",
                            recv.wr_id,
                            payload.len()
                        ));
                    }
                }
                outcome.recv_completion = Some((wc, req.solicited));
            }
            RequestOp::Write {
                addr,
                rkey,
                imm,
                payload,
            } => {
                // WRITE_WITH_IMM takes its receive first (RNR before touching memory) and
                // puts it back if the write is refused.
                let recv = match imm {
                    Some(_) => match env.recv.pop() {
                        Some(r) => Some(r),
                        None => {
                            self.rnr(env, psn, out);
                            return outcome;
                        }
                    },
                    None => None,
                };
                let refused = if !env.access.contains(AccessFlags::REMOTE_WRITE) {
                    Some(RemoteError::Access)
                } else if payload.is_empty() {
                    None
                } else {
                    env.table.remote_write(rkey, addr, payload).err()
                };
                if let Some(e) = refused {
                    if let Some(r) = recv {
                        env.recv.unpop(r);
                    }
                    self.remote_error(env, psn, e, out);
                    return outcome;
                }
                self.advance();
                if let Some(imm) = imm {
                    if let Some(recv) = recv {
                        outcome.recv_completion = Some((
                            WorkCompletion {
                                wr_id: recv.wr_id,
                                status: WcStatus::Success,
                                opcode: WcOpcode::RecvRdmaWithImm,
                                byte_len: payload.len() as u32,
                                imm_data: Some(imm),
                                qp_num: env.qp_num,
                                src_qp: env.remote_qpn,
                                vendor_err: 0,
                            },
                            req.solicited,
                        ));
                    }
                }
            }
            RequestOp::Read { .. } => {
                if self.execute_read(req, env, out) {
                    self.advance_no_ack();
                }
            }
            RequestOp::CmpSwap { .. } | RequestOp::FetchAdd { .. } => {
                if let Some(orig) = self.execute_atomic(req, env, out) {
                    if self.atomic_cache.len() == ATOMIC_CACHE {
                        self.atomic_cache.pop_front();
                    }
                    self.atomic_cache.push_back((psn, orig));
                    self.advance_no_ack();
                }
            }
        }
        outcome
    }

    fn advance(&mut self) {
        self.expected_psn = self.expected_psn.wrapping_add(1);
        self.ack_pending = true;
    }

    fn advance_no_ack(&mut self) {
        self.expected_psn = self.expected_psn.wrapping_add(1);
    }

    fn rnr(&mut self, env: &ResponderEnv<'_>, psn: u32, out: &mut Vec<u8>) {
        self.in_nak = true;
        self.nak(env, psn, NakCode::Rnr, out);
    }

    fn remote_error(
        &mut self,
        env: &ResponderEnv<'_>,
        psn: u32,
        e: RemoteError,
        out: &mut Vec<u8>,
    ) {
        // The requester's QP goes to ERROR on this NAK; stay put and drop what follows.
        self.in_nak = true;
        let code = match e {
            RemoteError::Access => NakCode::RemoteAccess,
            RemoteError::InvalidRequest => NakCode::InvalidRequest,
        };
        self.nak(env, psn, code, out);
    }

    /// Returns true when a READ response was sent.
    fn execute_read(
        &mut self,
        req: &Request<'_>,
        env: &ResponderEnv<'_>,
        out: &mut Vec<u8>,
    ) -> bool {
        let RequestOp::Read { addr, rkey, len } = req.op else {
            return false;
        };
        if !env.access.contains(AccessFlags::REMOTE_READ) {
            self.remote_error(env, req.psn, RemoteError::Access, out);
            return false;
        }
        if len as usize > env.max_payload {
            self.remote_error(env, req.psn, RemoteError::InvalidRequest, out);
            return false;
        }
        self.ack_pending = false;
        let start = out.len();
        let mut w = super::wire::FrameWriter::begin(
            out,
            super::wire::Opcode::ReadResp,
            0,
            env.remote_qpn.0,
            req.psn,
        );
        if len > 0 {
            if let Err(e) = env.table.remote_read(rkey, addr, len, w.buf()) {
                out.truncate(start);
                self.remote_error(env, req.psn, e, out);
                return false;
            }
        }
        w.finish();
        true
    }

    fn execute_atomic(
        &mut self,
        req: &Request<'_>,
        env: &ResponderEnv<'_>,
        out: &mut Vec<u8>,
    ) -> Option<u64> {
        let (addr, rkey, op) = match req.op {
            RequestOp::CmpSwap {
                addr,
                rkey,
                compare,
                swap,
            } => (addr, rkey, AtomicOp::CmpSwap { compare, swap }),
            RequestOp::FetchAdd { addr, rkey, add } => (addr, rkey, AtomicOp::FetchAdd { add }),
            _ => return None,
        };
        if addr % 8 != 0 {
            self.remote_error(env, req.psn, RemoteError::InvalidRequest, out);
            return None;
        }
        if !env.access.contains(AccessFlags::REMOTE_ATOMIC) {
            self.remote_error(env, req.psn, RemoteError::Access, out);
            return None;
        }
        match env.table.remote_atomic(rkey, addr, op) {
            Ok(orig) => {
                self.respond(env, req.psn, ResponseKind::AtomicResp { orig }, out);
                Some(orig)
            }
            Err(e) => {
                self.remote_error(env, req.psn, e, out);
                None
            }
        }
    }

    fn handle_duplicate(&mut self, req: &Request<'_>, env: &ResponderEnv<'_>, out: &mut Vec<u8>) {
        match req.op {
            RequestOp::Send { .. } | RequestOp::Write { .. } => {
                // Already executed: acknowledge again, do not execute twice.
                self.ack_pending = true;
            }
            RequestOp::Read { .. } => {
                // READ is idempotent: serve it again.
                self.execute_read(req, env, out);
            }
            RequestOp::CmpSwap { .. } | RequestOp::FetchAdd { .. } => {
                match self.atomic_cache.iter().find(|(p, _)| *p == req.psn) {
                    Some(&(_, orig)) => {
                        self.respond(env, req.psn, ResponseKind::AtomicResp { orig }, out)
                    }
                    None => self.nak(env, req.psn, NakCode::InvalidRequest, out),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::mr::SoftMr;
    use crate::soft::wire::{decode, Frame};
    use crate::{RecvWr, Sge};
    use std::sync::Arc;

    struct Fixture {
        table: Arc<MrTable>,
        mr: SoftMr,
        rq: RecvQueue,
        resp: Responder,
    }

    fn fixture(access: AccessFlags) -> Fixture {
        let table = MrTable::new();
        let mr = SoftMr::alloc(&table, 4096, access).unwrap();
        Fixture {
            table,
            mr,
            rq: RecvQueue::new(8, 4),
            resp: Responder::new(100),
        }
    }

    impl Fixture {
        fn info(&self) -> crate::MrInfo {
            crate::provider::MrOps::info(&self.mr)
        }
        fn run(&mut self, psn: u32, op: RequestOp<'_>) -> (Vec<Response<'static>>, RequestOutcome) {
            let mut out = Vec::new();
            let mut env = ResponderEnv {
                table: &self.table,
                access: AccessFlags::ALL,
                recv: RecvSource::Own(&mut self.rq),
                qp_num: QpNum(1),
                remote_qpn: QpNum(2),
                max_payload: 1 << 20,
            };
            let req = Request {
                qpn: 1,
                psn,
                solicited: false,
                op,
            };
            let outcome = self.resp.handle_request(&req, &mut env, &mut out);
            self.resp.poll_ack(QpNum(2), &mut out);
            (decode_all(&out), outcome)
        }
        fn bytes(&self, off: u64, len: u32) -> Vec<u8> {
            let i = self.info();
            let mut v = Vec::new();
            self.table
                .gather(
                    &[Sge {
                        addr: i.addr + off,
                        length: len,
                        lkey: i.lkey,
                    }],
                    &mut v,
                )
                .unwrap();
            v
        }
    }

    fn decode_all(mut buf: &[u8]) -> Vec<Response<'static>> {
        let mut v = Vec::new();
        while let Some((f, n)) = decode(buf, 1 << 20).unwrap() {
            let Frame::Response(r) = f else {
                panic!("not a response")
            };
            // Leak payloads: test-only convenience to return owned responses.
            let kind = match r.kind {
                ResponseKind::ReadResp { payload } => ResponseKind::ReadResp {
                    payload: Box::leak(payload.to_vec().into_boxed_slice()),
                },
                ResponseKind::Ack => ResponseKind::Ack,
                ResponseKind::Nak { code, rnr_timer } => ResponseKind::Nak { code, rnr_timer },
                ResponseKind::AtomicResp { orig } => ResponseKind::AtomicResp { orig },
            };
            v.push(Response {
                qpn: r.qpn,
                psn: r.psn,
                kind,
            });
            buf = &buf[n..];
        }
        v
    }

    fn nak(code: NakCode) -> ResponseKind<'static> {
        ResponseKind::Nak {
            code,
            rnr_timer: 12,
        }
    }

    #[test]
    fn write_outside_region_is_remote_access_and_leaves_memory_alone() {
        let mut f = fixture(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        let i = f.info();
        let (r, _) = f.run(
            100,
            RequestOp::Write {
                addr: i.addr + 4090,
                rkey: i.rkey.0,
                imm: None,
                payload: b"too long",
            },
        );
        assert_eq!(r[0].kind, nak(NakCode::RemoteAccess));
        assert_eq!(f.bytes(4088, 8), vec![0; 8]);
        assert_eq!(f.resp.expected_psn(), 100);
    }

    #[test]
    fn write_without_remote_write_right_is_remote_access() {
        let mut f = fixture(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ);
        let i = f.info();
        let (r, _) = f.run(
            100,
            RequestOp::Write {
                addr: i.addr,
                rkey: i.rkey.0,
                imm: None,
                payload: b"x",
            },
        );
        assert_eq!(r[0].kind, nak(NakCode::RemoteAccess));
        assert_eq!(f.bytes(0, 1), vec![0]);
    }

    #[test]
    fn read_needs_remote_read() {
        let mut f = fixture(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        let i = f.info();
        let (r, _) = f.run(
            100,
            RequestOp::Read {
                addr: i.addr,
                rkey: i.rkey.0,
                len: 8,
            },
        );
        assert_eq!(r[0].kind, nak(NakCode::RemoteAccess));
    }

    #[test]
    fn misaligned_atomic_is_invalid_request() {
        let mut f = fixture(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC);
        let i = f.info();
        let (r, _) = f.run(
            100,
            RequestOp::FetchAdd {
                addr: i.addr + 3,
                rkey: i.rkey.0,
                add: 1,
            },
        );
        assert_eq!(r[0].kind, nak(NakCode::InvalidRequest));
    }

    #[test]
    fn send_without_receive_is_rnr_then_resend_succeeds() {
        let mut f = fixture(AccessFlags::ALL);
        let i = f.info();
        let (r, o) = f.run(
            100,
            RequestOp::Send {
                imm: Some(5),
                payload: b"hi",
            },
        );
        assert_eq!(r[0].kind, nak(NakCode::Rnr));
        assert!(o.recv_completion.is_none());
        // Later requests are dropped until the NAK'd one is resent.
        let (r, _) = f.run(
            101,
            RequestOp::Send {
                imm: None,
                payload: b"x",
            },
        );
        assert!(r.is_empty());
        let sge = [Sge {
            addr: i.addr,
            length: 16,
            lkey: i.lkey,
        }];
        f.rq.post(&[RecvWr::new(7, &sge)]).unwrap();
        let (r, o) = f.run(
            100,
            RequestOp::Send {
                imm: Some(5),
                payload: b"hi",
            },
        );
        assert_eq!(r[0].kind, ResponseKind::Ack);
        assert_eq!(r[0].psn, 100);
        let (wc, _) = o.recv_completion.unwrap();
        assert_eq!((wc.wr_id, wc.byte_len, wc.imm_data), (7, 2, Some(5)));
        assert_eq!(f.bytes(0, 2), b"hi");
    }

    #[test]
    fn send_longer_than_receive_fails_both_sides() {
        let mut f = fixture(AccessFlags::ALL);
        let i = f.info();
        let sge = [Sge {
            addr: i.addr,
            length: 2,
            lkey: i.lkey,
        }];
        f.rq.post(&[RecvWr::new(7, &sge)]).unwrap();
        let (r, o) = f.run(
            100,
            RequestOp::Send {
                imm: None,
                payload: b"hello",
            },
        );
        assert_eq!(r[0].kind, nak(NakCode::InvalidRequest));
        assert_eq!(o.recv_completion.unwrap().0.status, WcStatus::LocalLength);
        assert!(o.fatal.is_some());
        assert_eq!(f.bytes(0, 2), vec![0, 0]);
    }

    #[test]
    fn duplicate_atomic_is_answered_from_cache_not_executed_twice() {
        let mut f = fixture(AccessFlags::ALL);
        let i = f.info();
        let op = RequestOp::FetchAdd {
            addr: i.addr,
            rkey: i.rkey.0,
            add: 3,
        };
        let (r, _) = f.run(100, op);
        assert_eq!(r[0].kind, ResponseKind::AtomicResp { orig: 0 });
        let (r, _) = f.run(100, op);
        assert_eq!(r[0].kind, ResponseKind::AtomicResp { orig: 0 });
        assert_eq!(f.bytes(0, 8), 3u64.to_ne_bytes());
    }

    #[test]
    fn refused_write_with_imm_keeps_its_receive() {
        let mut f = fixture(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        let i = f.info();
        f.rq.post(&[RecvWr::new(3, &[])]).unwrap();
        let (r, o) = f.run(
            100,
            RequestOp::Write {
                addr: i.addr + 4095,
                rkey: i.rkey.0,
                imm: Some(1),
                payload: b"xy",
            },
        );
        assert_eq!(r[0].kind, nak(NakCode::RemoteAccess));
        assert!(o.recv_completion.is_none());
        assert_eq!(f.rq.len(), 1, "receive put back");
    }

    #[test]
    fn read_above_the_payload_limit_is_invalid_request() {
        let mut f = fixture(AccessFlags::ALL);
        let i = f.info();
        let (r, _) = f.run(
            100,
            RequestOp::Read {
                addr: i.addr,
                rkey: i.rkey.0,
                len: (1 << 20) + 1,
            },
        );
        assert_eq!(r[0].kind, nak(NakCode::InvalidRequest));
    }

    #[test]
    fn gap_is_nakked_once() {
        let mut f = fixture(AccessFlags::ALL);
        let (r, _) = f.run(
            105,
            RequestOp::Send {
                imm: None,
                payload: b"",
            },
        );
        assert_eq!(r[0].kind, nak(NakCode::PsnSequence));
        assert_eq!(r[0].psn, 100);
        let (r, _) = f.run(
            106,
            RequestOp::Send {
                imm: None,
                payload: b"",
            },
        );
        assert!(r.is_empty());
    }
}
