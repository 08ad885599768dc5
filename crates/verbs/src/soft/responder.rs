//! The responder half of a software RC QP: executes incoming requests against local registered
//! memory and answers them.
//!
//! Owns: the expected PSN, the NAK state (after an RNR or sequence NAK, later requests are
//! dropped until the NAK'd one is resent — go-back-N), a small cache of atomic results so a
//! resent atomic is answered without being executed twice, and ACK coalescing (one cumulative
//! ACK per input batch), and [`Placement`]: a large SEND/WRITE (or, for the requester, READ
//! response) whose payload is placed in pieces straight into its destination as a stream
//! transport reads it. Sans-IO: it is handed decoded requests and appends encoded responses to
//! the caller's buffer; memory goes through [`MrTable`], receives through [`RecvSource`]. The
//! one exception is [`Placement::recv_from`], which a stream transport calls with its socket
//! so the kernel copies the payload straight into the checked destination.

use std::collections::VecDeque;

use std::sync::Arc;

use super::mr::{AtomicOp, Dest, MemKey, MrTable, RemoteError};
use super::requester::ZERO_COPY_MIN;
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
    /// The output can send a READ response's payload straight from registered memory: a READ
    /// of at least [`ZERO_COPY_MIN`] bytes then appends only the response header and leaves
    /// the payload as a [`ReadRef`] ([`Responder::take_read_ref`]).
    pub read_by_ref: bool,
}

/// The payload of a READ response to send from registered memory, right after the header the
/// responder appended (see [`ResponderEnv::read_by_ref`]). Checked when it was answered;
/// checked again (REMOTE_READ) when the bytes are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRef {
    /// The requester's rkey.
    pub rkey: u32,
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
}

/// The result of one request besides the bytes appended to the output.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RequestOutcome {
    /// A receive completion to queue on the receive CQ, and whether it is solicited.
    pub recv_completion: Option<(WorkCompletion, bool)>,
    /// The responder hit an error that puts the QP in ERROR (after the completion above).
    pub fatal: Option<String>,
}

/// A SEND or WRITE whose payload is placed straight into its destination as it arrives (a
/// stream transport reading a large frame), instead of being buffered whole first.
///
/// Made by [`Responder::begin_placement`] only when the request will execute (expected PSN,
/// rights, keys and bounds checked, a receive taken for SEND and WRITE_WITH_IMM); fed with
/// [`Placement::put`] / [`Placement::recv_from`]; completed by
/// [`Responder::finish_placement`] once [`Placement::remaining`] is 0, or given up with
/// [`Placement::into_recv`] when the connection goes away first.
#[derive(Debug)]
pub struct Placement {
    psn: u32,
    solicited: bool,
    imm: Option<u32>,
    /// SEND: the receive it fills; WRITE_WITH_IMM: the receive it consumes.
    recv: Option<PostedRecv>,
    kind: PlaceKind,
    dests: Vec<Dest>,
    /// Current destination and the offset in it.
    idx: usize,
    off: u64,
    len: usize,
    done: usize,
    /// A destination stopped being a live registration while the payload arrived: the rest
    /// is discarded and the request fails at the end.
    lost: bool,
    table: Arc<MrTable>,
}

/// What a [`Placement`] receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PlaceKind {
    Send,
    Write,
    /// A READ response, into the READ's local SGEs (requester side).
    ReadResp,
}

impl Placement {
    /// A READ response of `len` bytes for the READ with `psn`, into `dests` (checked by the
    /// caller).
    pub(crate) fn read_response(
        psn: u32,
        dests: Vec<Dest>,
        len: usize,
        table: &Arc<MrTable>,
    ) -> Placement {
        Placement {
            psn,
            solicited: false,
            imm: None,
            recv: None,
            kind: PlaceKind::ReadResp,
            dests,
            idx: 0,
            off: 0,
            len,
            done: 0,
            lost: false,
            table: table.clone(),
        }
    }

    /// True for a READ response (finished by the requester).
    pub fn is_read_response(&self) -> bool {
        self.kind == PlaceKind::ReadResp
    }

    /// True when a destination stopped being a live registration while the payload arrived.
    pub fn lost(&self) -> bool {
        self.lost || self.remaining() > 0
    }

    /// Payload bytes still to come.
    pub fn remaining(&self) -> usize {
        self.len - self.done
    }

    /// The PSN of the request.
    pub fn psn(&self) -> u32 {
        self.psn
    }

    fn advance(&mut self, n: usize) {
        self.done += n;
        self.off += n as u64;
        while self
            .dests
            .get(self.idx)
            .is_some_and(|d| self.off >= d.len && self.idx + 1 < self.dests.len())
        {
            self.idx += 1;
            self.off = 0;
        }
    }

    /// The next destination piece: (dest, room in it), or `None` when the payload is lost.
    fn piece(&self) -> Option<(Dest, usize)> {
        if self.lost {
            return None;
        }
        let d = *self.dests.get(self.idx)?;
        let room = (d.len - self.off.min(d.len)) as usize;
        Some((d, room.min(self.remaining())))
    }

    /// Place bytes that already arrived (at most [`Placement::remaining`] are used); returns
    /// how many were taken.
    pub fn put(&mut self, mut data: &[u8]) -> usize {
        let take = data.len().min(self.remaining());
        data = data.get(..take).unwrap_or(&[]);
        let mut used = 0;
        while !data.is_empty() {
            let Some((d, room)) = self.piece() else {
                // Memory gone: the rest is discarded.
                self.done += data.len();
                used += data.len();
                break;
            };
            let n = room.min(data.len());
            let (head, tail) = data.split_at(n);
            if n > 0 && !self.table.put(d.key, d.addr + self.off, head, d.need) {
                self.lost = true;
                continue;
            }
            self.advance(n);
            used += n;
            data = tail;
            if n == 0 {
                break;
            }
        }
        used
    }

    /// One non-blocking `recv` from the stream socket `fd` of at most
    /// [`Placement::remaining`] bytes, straight into the destination (into `scratch`, then
    /// dropped, once the destination was lost). Returns the bytes read and whether that was
    /// all that was asked (a short read means the socket is drained). `Ok((0, _))`: the peer
    /// closed the connection.
    pub fn recv_from(
        &mut self,
        fd: std::os::fd::BorrowedFd<'_>,
        scratch: &mut Vec<u8>,
    ) -> std::io::Result<(usize, bool)> {
        if let Some((d, room)) = self.piece() {
            match self
                .table
                .recv_into(fd, d.key, d.addr + self.off, room, d.need)
            {
                Some(r) => {
                    let n = r?;
                    self.advance(n);
                    return Ok((n, n == room));
                }
                None => self.lost = true,
            }
        }
        let want = self.remaining().min(64 * 1024);
        scratch.clear();
        scratch.resize(want, 0);
        let (n, _) =
            rustix::net::recv(fd, scratch.as_mut_slice(), rustix::net::RecvFlags::DONTWAIT)?;
        self.done += n;
        Ok((n, n == want))
    }

    /// Give the placement up (connection lost, QP reset): the receive it took, if any, which
    /// the caller puts back or flushes.
    pub fn into_recv(self) -> Option<PostedRecv> {
        self.recv
    }
}

/// Responder state of one QP.
#[derive(Debug)]
pub struct Responder {
    expected_psn: u32,
    in_nak: bool,
    min_rnr_timer: u8,
    ack_pending: bool,
    atomic_cache: VecDeque<(u32, u64)>,
    read_ref: Option<ReadRef>,
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
            read_ref: None,
        }
    }

    /// The READ payload the last request left in memory, if any (see
    /// [`ResponderEnv::read_by_ref`]); take it after every [`Responder::handle_request`].
    pub fn take_read_ref(&mut self) -> Option<ReadRef> {
        self.read_ref.take()
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

    /// Start placing the payload (`len` bytes, not yet received) of SEND or WRITE `req`
    /// straight into its destination. `None` unless it will execute (the expected PSN, the
    /// rights, keys and bounds, a receive large enough for SEND, one for WRITE_WITH_IMM):
    /// then the caller buffers the whole frame and hands it to
    /// [`Responder::handle_request`], which answers every other case as usual.
    pub fn begin_placement(
        &mut self,
        req: &Request<'_>,
        len: usize,
        env: &mut ResponderEnv<'_>,
        table: &Arc<MrTable>,
    ) -> Option<Placement> {
        if req.psn != self.expected_psn || len == 0 || len > env.max_payload {
            return None;
        }
        let (imm, kind, recv, dests) = match req.op {
            RequestOp::Send { imm, .. } => {
                let recv = env.recv.pop()?;
                let dests =
                    Dest::local_scatter(&recv.sges, len as u64).filter(|d| table.check_dests(d));
                let Some(dests) = dests else {
                    env.recv.unpop(recv);
                    return None;
                };
                (imm, PlaceKind::Send, Some(recv), dests)
            }
            RequestOp::Write {
                addr, rkey, imm, ..
            } => {
                let dests = vec![Dest {
                    key: MemKey::Remote(crate::Rkey(rkey)),
                    addr,
                    len: len as u64,
                    need: AccessFlags::REMOTE_WRITE,
                }];
                if !env.access.contains(AccessFlags::REMOTE_WRITE) || !table.check_dests(&dests) {
                    return None;
                }
                let recv = match imm {
                    Some(_) => Some(env.recv.pop()?),
                    None => None,
                };
                (imm, PlaceKind::Write, recv, dests)
            }
            _ => return None,
        };
        Some(Placement {
            psn: req.psn,
            solicited: req.solicited,
            imm,
            recv,
            kind,
            dests,
            idx: 0,
            off: 0,
            len,
            done: 0,
            lost: false,
            table: table.clone(),
        })
    }

    /// Complete a placement whose payload arrived whole ([`Placement::remaining`] is 0), as
    /// [`Responder::handle_request`] completes the request: receive completion, ACK due. A
    /// destination deregistered meanwhile fails it as an access error found at once would
    /// (the bytes placed before stay written).
    pub fn finish_placement(
        &mut self,
        p: Placement,
        env: &mut ResponderEnv<'_>,
        out: &mut Vec<u8>,
    ) -> RequestOutcome {
        let mut outcome = RequestOutcome::default();
        if p.psn != self.expected_psn || p.kind == PlaceKind::ReadResp {
            // Cannot happen (nothing else is handled while a payload arrives); never execute
            // twice.
            return outcome;
        }
        self.in_nak = false;
        let byte_len = u32::try_from(p.len).unwrap_or(u32::MAX);
        let lost = p.lost();
        let recv = p.recv;
        if p.kind == PlaceKind::Send {
            let Some(recv) = recv else {
                return outcome;
            };
            let mut wc = WorkCompletion {
                wr_id: recv.wr_id,
                status: WcStatus::Success,
                opcode: WcOpcode::Recv,
                byte_len,
                imm_data: p.imm,
                qp_num: env.qp_num,
                src_qp: env.remote_qpn,
                vendor_err: 0,
            };
            if lost {
                wc.status = WcStatus::LocalProtection;
                wc.byte_len = 0;
                self.nak(env, p.psn, NakCode::RemoteOperation, out);
                outcome.fatal = Some(format!(
                    "receive {} lost its memory while a SEND of {} bytes arrived",
                    recv.wr_id, p.len
                ));
            } else {
                self.advance();
            }
            outcome.recv_completion = Some((wc, p.solicited));
            return outcome;
        }
        if lost {
            if let Some(r) = recv {
                env.recv.unpop(r);
            }
            self.remote_error(env, p.psn, RemoteError::Access, out);
            return outcome;
        }
        self.advance();
        if let (Some(imm), Some(recv)) = (p.imm, recv) {
            outcome.recv_completion = Some((
                WorkCompletion {
                    wr_id: recv.wr_id,
                    status: WcStatus::Success,
                    opcode: WcOpcode::RecvRdmaWithImm,
                    byte_len,
                    imm_data: Some(imm),
                    qp_num: env.qp_num,
                    src_qp: env.remote_qpn,
                    vendor_err: 0,
                },
                p.solicited,
            ));
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
        if env.read_by_ref && u64::from(len) >= ZERO_COPY_MIN {
            let range = Dest {
                key: MemKey::Remote(crate::Rkey(rkey)),
                addr,
                len: u64::from(len),
                need: AccessFlags::REMOTE_READ,
            };
            if !env.table.check_dests(&[range]) {
                self.remote_error(env, req.psn, RemoteError::Access, out);
                return false;
            }
            super::wire::FrameWriter::begin(
                out,
                super::wire::Opcode::ReadResp,
                0,
                env.remote_qpn.0,
                req.psn,
            )
            .finish();
            let total =
                u32::try_from(super::wire::HEADER_LEN as u64 + u64::from(len)).unwrap_or(u32::MAX);
            if let Some(slot) = out.get_mut(start..start + 4) {
                slot.copy_from_slice(&total.to_be_bytes());
            }
            self.read_ref = Some(ReadRef { rkey, addr, len });
            return true;
        }
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
            let mut env = test_env(&self.table, &mut self.rq);
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

    /// The environment every fixture request runs in: all access, its own receive queue.
    fn test_env<'a>(table: &'a Arc<MrTable>, rq: &'a mut RecvQueue) -> ResponderEnv<'a> {
        ResponderEnv {
            table,
            access: AccessFlags::ALL,
            recv: RecvSource::Own(rq),
            qp_num: QpNum(1),
            remote_qpn: QpNum(2),
            max_payload: 1 << 20,
            read_by_ref: false,
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

    impl Fixture {
        fn begin(&mut self, psn: u32, op: RequestOp<'_>, len: usize) -> Option<Placement> {
            let table = self.table.clone();
            let mut env = test_env(&table, &mut self.rq);
            let req = Request {
                qpn: 1,
                psn,
                solicited: true,
                op,
            };
            self.resp.begin_placement(&req, len, &mut env, &table)
        }
        fn finish(&mut self, p: Placement) -> (Vec<Response<'static>>, RequestOutcome) {
            let mut out = Vec::new();
            let mut env = test_env(&self.table, &mut self.rq);
            let outcome = self.resp.finish_placement(p, &mut env, &mut out);
            self.resp.poll_ack(QpNum(2), &mut out);
            (decode_all(&out), outcome)
        }
    }

    #[test]
    fn placed_send_scatters_in_pieces_over_receive_sges_and_completes_once() {
        let mut f = fixture(AccessFlags::ALL);
        let i = f.info();
        let sge = |off: u64, len: u32| Sge {
            addr: i.addr + off,
            length: len,
            lkey: i.lkey,
        };
        f.rq.post(&[RecvWr::new(7, &[sge(0, 3), sge(100, 5), sge(200, 50)])])
            .unwrap();
        let send = RequestOp::Send {
            imm: Some(9),
            payload: &[],
        };
        // Not the expected PSN, or longer than the receive: left to handle_request.
        assert!(f.begin(101, send, 10).is_none());
        assert!(f.begin(100, send, 59).is_none());
        assert_eq!(f.rq.len(), 1, "the receive was put back");
        let mut p = f.begin(100, send, 12).unwrap();
        assert_eq!(f.rq.len(), 0);
        let data = b"abcdefghijkl";
        for chunk in data.chunks(5) {
            assert_eq!(p.put(chunk), chunk.len());
        }
        assert_eq!(p.remaining(), 0);
        assert_eq!(p.put(b"more"), 0, "nothing beyond the payload is taken");
        let (r, outcome) = f.finish(p);
        assert_eq!(
            r,
            vec![Response {
                qpn: 2,
                psn: 100,
                kind: ResponseKind::Ack
            }]
        );
        let (wc, solicited) = outcome.recv_completion.unwrap();
        assert!(solicited);
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len, wc.imm_data),
            (7, WcStatus::Success, 12, Some(9))
        );
        assert!(outcome.fatal.is_none());
        assert_eq!(f.bytes(0, 4), b"abc\0");
        assert_eq!(f.bytes(100, 6), b"defgh\0");
        assert_eq!(f.bytes(200, 5), b"ijkl\0");
        assert_eq!(f.resp.expected_psn(), 101);
    }

    #[test]
    fn placed_write_checks_before_and_fails_when_its_region_goes_away() {
        let mut f = fixture(AccessFlags::ALL);
        let i = f.info();
        let write = |addr: u64, imm| RequestOp::Write {
            addr,
            rkey: i.rkey.0,
            imm,
            payload: &[],
        };
        // Out of bounds, bad rkey, WRITE_IMM without a receive: left to handle_request.
        assert!(f.begin(100, write(i.addr + 4000, None), 200).is_none());
        let bad_key = RequestOp::Write {
            addr: i.addr,
            rkey: i.rkey.0 ^ 1,
            imm: None,
            payload: &[],
        };
        assert!(f.begin(100, bad_key, 10).is_none());
        assert!(f.begin(100, write(i.addr, Some(1)), 10).is_none());
        // WRITE_IMM placed in two pieces.
        f.rq.post(&[RecvWr::new(3, &[])]).unwrap();
        let mut p = f.begin(100, write(i.addr + 8, Some(5)), 6).unwrap();
        p.put(b"xyz");
        p.put(b"uvw");
        let (r, outcome) = f.finish(p);
        assert_eq!(
            r,
            vec![Response {
                qpn: 2,
                psn: 100,
                kind: ResponseKind::Ack
            }]
        );
        let (wc, _) = outcome.recv_completion.unwrap();
        assert_eq!(
            (wc.wr_id, wc.opcode, wc.byte_len, wc.imm_data),
            (3, WcOpcode::RecvRdmaWithImm, 6, Some(5))
        );
        assert_eq!(f.bytes(8, 6), b"xyzuvw");
        // The region is deregistered while the payload arrives: the rest is dropped and the
        // request is refused as a remote access error.
        let mut p = f.begin(101, write(i.addr, None), 8).unwrap();
        p.put(b"1234");
        let other = SoftMr::alloc(&f.table, 64, AccessFlags::ALL).unwrap();
        drop(std::mem::replace(&mut f.mr, other));
        assert_eq!(p.put(b"5678"), 4);
        assert_eq!(p.remaining(), 0);
        let (r, outcome) = f.finish(p);
        assert_eq!(
            r,
            vec![Response {
                qpn: 2,
                psn: 101,
                kind: nak(NakCode::RemoteAccess)
            }]
        );
        assert!(outcome.recv_completion.is_none());
        assert_eq!(f.resp.expected_psn(), 101, "not executed");
    }

    #[test]
    fn placed_send_whose_receive_buffer_goes_away_fails_the_receive() {
        let mut f = fixture(AccessFlags::ALL);
        let i = f.info();
        f.rq.post(&[RecvWr::new(
            4,
            &[Sge {
                addr: i.addr,
                length: 100,
                lkey: i.lkey,
            }],
        )])
        .unwrap();
        let send = RequestOp::Send {
            imm: None,
            payload: &[],
        };
        let mut p = f.begin(100, send, 50).unwrap();
        p.put(&[1; 20]);
        let other = SoftMr::alloc(&f.table, 64, AccessFlags::ALL).unwrap();
        drop(std::mem::replace(&mut f.mr, other));
        p.put(&[2; 30]);
        let (r, outcome) = f.finish(p);
        assert_eq!(
            r,
            vec![Response {
                qpn: 2,
                psn: 100,
                kind: nak(NakCode::RemoteOperation)
            }]
        );
        let (wc, _) = outcome.recv_completion.unwrap();
        assert_eq!((wc.wr_id, wc.status), (4, WcStatus::LocalProtection));
        assert!(outcome.fatal.is_some());
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
