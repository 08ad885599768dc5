//! The requester half of a software RC QP: the ordered send queue.
//!
//! Owns: posted send requests with their encoded frames (payload gathered at first
//! transmission, inline payload at post time), PSN
//! assignment, what may be transmitted now (FENCE, the READ/atomic limit, the RNR pause),
//! in-order completion (responses acknowledge cumulatively), the ACK timer with its retry
//! counter, the RNR retry counter (7 = forever), and go-back-N resends. Sans-IO: frames go out
//! through [`Requester::poll_transmit`], time comes in as arguments, completions come out into
//! a caller's vector. Memory is touched only through [`MrTable`] (READ and atomic results).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::mr::{Dest, MrTable};
use super::responder::{psn_before, Placement};
use super::tx::FrameSink;
use super::wire::{NakCode, Response, ResponseKind};
use crate::{AccessFlags, QpNum, Sge, WcOpcode, WcStatus, WorkCompletion};

/// What a send-queue entry is waiting for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryKind {
    /// SEND or WRITE (with or without immediate): an acknowledgement.
    Acked,
    /// READ: `len` bytes to scatter over `sges`.
    Read {
        /// Destination SGEs.
        sges: Vec<Sge>,
        /// Bytes requested.
        len: u32,
    },
    /// Atomic: the original value, into one 8-byte SGE.
    Atomic {
        /// Destination.
        sge: Sge,
    },
}

impl EntryKind {
    fn is_read_or_atomic(&self) -> bool {
        !matches!(self, EntryKind::Acked)
    }
}

/// One posted send request.
#[derive(Debug, Clone)]
pub struct SqEntry {
    /// The caller's id.
    pub wr_id: u64,
    /// Opcode reported in the completion.
    pub opcode: WcOpcode,
    /// Complete with a CQE on success.
    pub signaled: bool,
    /// FENCE: wait for earlier READs and atomics.
    pub fence: bool,
    /// Sequence number (from [`Requester::alloc_psn`]).
    pub psn: u32,
    /// The encoded request frame, resent as is.
    pub frame: Arc<Vec<u8>>,
    /// What completes it.
    pub kind: EntryKind,
    /// `byte_len` of the completion.
    pub byte_len: u32,
    /// A local error found at post time: the entry completes with it when it reaches the head
    /// of the queue, and the QP then enters ERROR.
    pub failed: Option<WcStatus>,
    /// RNR NAKs received for this entry.
    pub rnr_naks: u8,
    /// SGEs whose bytes are appended to `frame` at first transmission (as a NIC reads the
    /// buffer when it processes the request, so a FENCE or an RNR pause sees later data).
    pub deferred_gather: Option<Vec<Sge>>,
    /// Set at first transmission into a sink that [`FrameSink::takes_memory`] when the payload
    /// is at least [`ZERO_COPY_MIN`]: the payload stays in registered memory and `frame` is
    /// the frame without it (its length field counts it); every transmission reads the memory
    /// again.
    pub payload_ref: Option<Arc<[Sge]>>,
}

/// Payloads from this size on are left in registered memory when the sink can send from it
/// (below it, copying into the frame costs less than another segment).
pub const ZERO_COPY_MIN: u64 = 16 * 1024;

/// Timer and retry parameters (from the RTS attributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequesterParams {
    /// ACK timeout (`None`: infinite).
    pub ack_timeout: Option<Duration>,
    /// Transport retries before `RetryExceeded`.
    pub retry_cnt: u8,
    /// RNR retries before `RnrRetryExceeded`; 7 = retry forever.
    pub rnr_retry: u8,
    /// Max READ/atomic outstanding.
    pub max_rd_atomic: u32,
}

impl Default for RequesterParams {
    fn default() -> Self {
        RequesterParams {
            ack_timeout: crate::ack_timeout(14),
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
        }
    }
}

/// Why the QP must enter ERROR; the failing request's completion was already emitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault(pub String);

/// Send-queue state of one QP.
#[derive(Debug)]
pub struct Requester {
    qp_num: QpNum,
    remote_qpn: QpNum,
    entries: VecDeque<SqEntry>,
    /// Entries `[0, next_tx)` were transmitted (since the last rewind).
    next_tx: usize,
    next_psn: u32,
    rnr_until: Option<Instant>,
    ack_deadline: Option<Instant>,
    retries: u8,
    params: RequesterParams,
}

impl Requester {
    /// An empty send queue of QP `qp_num` starting at `psn`.
    pub fn new(qp_num: QpNum, psn: u32) -> Requester {
        Requester {
            qp_num,
            remote_qpn: QpNum(0),
            entries: VecDeque::new(),
            next_tx: 0,
            next_psn: psn,
            rnr_until: None,
            ack_deadline: None,
            retries: 0,
            params: RequesterParams::default(),
        }
    }

    /// Set the first PSN (RTS). Only meaningful while the queue is empty.
    pub fn set_psn(&mut self, psn: u32) {
        if self.entries.is_empty() {
            self.next_psn = psn;
        }
    }

    /// The peer QP, named as `src_qp` in completions.
    pub fn set_remote(&mut self, remote: QpNum) {
        self.remote_qpn = remote;
    }

    /// Timer and retry parameters.
    pub fn set_params(&mut self, params: RequesterParams) {
        self.params = params;
    }

    /// Parameters in force.
    pub fn params(&self) -> RequesterParams {
        self.params
    }

    /// Entries posted and not completed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is outstanding.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The PSN the next entry must carry; call once per entry, then [`Requester::push`] it.
    pub fn alloc_psn(&mut self) -> u32 {
        let p = self.next_psn;
        self.next_psn = self.next_psn.wrapping_add(1);
        p
    }

    /// Queue an entry built with the PSN from [`Requester::alloc_psn`].
    pub fn push(&mut self, now: Instant, entry: SqEntry) {
        self.entries.push_back(entry);
        if self.ack_deadline.is_none() && self.rnr_until.is_none() {
            self.ack_deadline = self.params.ack_timeout.map(|t| now + t);
        }
    }

    fn completion(&self, e: &SqEntry, status: WcStatus) -> WorkCompletion {
        WorkCompletion {
            wr_id: e.wr_id,
            status,
            opcode: e.opcode,
            byte_len: if status.is_success() { e.byte_len } else { 0 },
            imm_data: None,
            qp_num: self.qp_num,
            src_qp: self.remote_qpn,
            vendor_err: 0,
        }
    }

    fn complete_head(&mut self, now: Instant, status: WcStatus, out: &mut Vec<WorkCompletion>) {
        if let Some(e) = self.entries.pop_front() {
            if e.signaled || !status.is_success() {
                out.push(self.completion(&e, status));
            }
            self.next_tx = self.next_tx.saturating_sub(1);
            self.retries = 0;
            self.ack_deadline = if self.entries.is_empty() || self.rnr_until.is_some() {
                None
            } else {
                self.params.ack_timeout.map(|t| now + t)
            };
        }
    }

    fn fail_head(
        &mut self,
        now: Instant,
        status: WcStatus,
        why: String,
        out: &mut Vec<WorkCompletion>,
    ) -> Fault {
        self.complete_head(now, status, out);
        Fault(why)
    }

    /// Complete a head entry that failed locally at post time. Call after posting and after
    /// handling responses.
    pub fn check_head_failure(
        &mut self,
        now: Instant,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<(), Fault> {
        if let Some(status) = self.entries.front().and_then(|e| e.failed) {
            let wr_id = self.entries.front().map_or(0, |e| e.wr_id);
            return Err(self.fail_head(
                now,
                status,
                format!("send request {wr_id} failed locally: {status:?}"),
                out,
            ));
        }
        Ok(())
    }

    /// Append frames that may go out now; returns how many. Deferred payloads are gathered from
    /// `table` here; an entry whose SGEs fail the check is marked failed (see
    /// [`Requester::check_head_failure`]).
    pub fn poll_transmit(
        &mut self,
        now: Instant,
        table: &Arc<MrTable>,
        out: &mut impl FrameSink,
    ) -> usize {
        if let Some(t) = self.rnr_until {
            if now < t {
                return 0;
            }
            self.rnr_until = None;
            self.ack_deadline = self.params.ack_timeout.map(|t| now + t);
        }
        let mut outstanding_rd = self
            .entries
            .iter()
            .take(self.next_tx)
            .filter(|e| e.kind.is_read_or_atomic())
            .count() as u32;
        let mut sent = 0;
        while let Some(e) = self.entries.get_mut(self.next_tx) {
            if e.failed.is_some() {
                break;
            }
            if e.fence && outstanding_rd > 0 {
                break;
            }
            if e.kind.is_read_or_atomic() && outstanding_rd >= self.params.max_rd_atomic.max(1) {
                break;
            }
            let total: u64 = e
                .deferred_gather
                .as_ref()
                .map_or(0, |s| s.iter().map(|s| u64::from(s.length)).sum());
            if out.takes_memory() && total >= ZERO_COPY_MIN {
                if let Some(sges) = e.deferred_gather.take() {
                    // Checked now as a gather would be; the sink checks again when it sends.
                    if let Err(status) = table.validate_local(&sges, AccessFlags::empty()) {
                        e.failed = Some(status);
                        break;
                    }
                    // Not transmitted yet, so nobody else holds the frame: no copy here.
                    let buf = Arc::make_mut(&mut e.frame);
                    let len = u32::try_from(buf.len() as u64 + total).unwrap_or(u32::MAX);
                    if let Some(slot) = buf.get_mut(..4) {
                        slot.copy_from_slice(&len.to_be_bytes());
                    }
                    e.payload_ref = Some(sges.into());
                }
            } else if let Some(sges) = e.deferred_gather.take() {
                // Not transmitted yet, so nobody else holds the frame: no copy here.
                let buf = Arc::make_mut(&mut e.frame);
                let gathered = table.gather(&sges, buf);
                let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
                if let Some(slot) = buf.get_mut(..4) {
                    slot.copy_from_slice(&len.to_be_bytes());
                }
                match gathered {
                    Ok(_) => {}
                    Err(status) => {
                        e.failed = Some(status);
                        break;
                    }
                }
            }
            if e.kind.is_read_or_atomic() {
                outstanding_rd += 1;
            }
            match &e.payload_ref {
                Some(p) => {
                    let len = p.iter().map(|s| s.length as usize).sum();
                    out.push_memory(&e.frame, p, len, table);
                }
                None => out.push_frame(&e.frame),
            }
            self.next_tx += 1;
            sent += 1;
        }
        if sent > 0 && self.ack_deadline.is_none() {
            self.ack_deadline = self.params.ack_timeout.map(|t| now + t);
        }
        sent
    }

    /// True if entries are waiting to be transmitted and nothing but a connection stops them.
    pub fn has_untransmitted(&self) -> bool {
        self.next_tx < self.entries.len()
    }

    /// When [`Requester::handle_timeout`] should be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match (self.rnr_until, self.ack_deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Expire timers: the RNR pause ends, or the ACK timer fires (resend from the oldest
    /// entry, or `RetryExceeded` once the retries are spent). Spurious calls are harmless.
    pub fn handle_timeout(
        &mut self,
        now: Instant,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<(), Fault> {
        if self.rnr_until.is_some_and(|t| now >= t) {
            self.rnr_until = None;
            self.ack_deadline = self.params.ack_timeout.map(|t| now + t);
        }
        if self.ack_deadline.is_some_and(|t| now >= t) {
            if self.entries.is_empty() {
                self.ack_deadline = None;
                return Ok(());
            }
            return self.retry(now, "ACK timeout", out);
        }
        Ok(())
    }

    fn retry(
        &mut self,
        now: Instant,
        why: &str,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<(), Fault> {
        if self.retries >= self.params.retry_cnt {
            let psn = self.entries.front().map_or(0, |e| e.psn);
            return Err(self.fail_head(
                now,
                WcStatus::RetryExceeded,
                format!(
                    "{why} on PSN {psn}: {} retries spent",
                    self.params.retry_cnt
                ),
                out,
            ));
        }
        self.retries += 1;
        self.next_tx = 0;
        self.ack_deadline = self.params.ack_timeout.map(|t| now + t);
        Ok(())
    }

    /// Handle one response; completions are appended to `out` in posting order.
    pub fn handle_response(
        &mut self,
        now: Instant,
        resp: &Response<'_>,
        table: &MrTable,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<(), Fault> {
        let psn = resp.psn;
        if !psn_before(psn, self.next_psn) {
            return Err(Fault(format!("response for PSN {psn} that was never sent")));
        }
        let is_ack = matches!(resp.kind, ResponseKind::Ack);
        // Every entry before `psn` (and `psn` itself for an ACK) is acknowledged.
        while let Some(head) = self.entries.front() {
            let covered = psn_before(head.psn, psn) || (is_ack && head.psn == psn);
            if !covered {
                break;
            }
            if head.kind.is_read_or_atomic() {
                return Err(Fault(format!(
                    "response for PSN {psn} skips the answer to READ/atomic PSN {}",
                    head.psn
                )));
            }
            if head.failed.is_some() {
                return Err(Fault(format!(
                    "response for PSN {psn} acknowledges request {} that was never sent",
                    head.psn
                )));
            }
            self.complete_head(now, WcStatus::Success, out);
        }
        if is_ack {
            return self.check_head_failure(now, out);
        }
        let Some(head) = self.entries.front() else {
            return self.stale_or_bogus(psn);
        };
        if head.psn != psn {
            return self.stale_or_bogus(psn);
        }
        match resp.kind {
            ResponseKind::Ack => {}
            ResponseKind::Nak { code, rnr_timer } => {
                return self.handle_nak(now, code, rnr_timer, out)
            }
            ResponseKind::ReadResp { payload } => {
                let EntryKind::Read { sges, len } = &head.kind else {
                    return Err(Fault(format!("READ response for non-READ PSN {psn}")));
                };
                if payload.len() != *len as usize {
                    return Err(Fault(format!(
                        "READ response of {} bytes for a READ of {len}",
                        payload.len()
                    )));
                }
                match table.scatter(sges, payload) {
                    Ok(_) => self.complete_head(now, WcStatus::Success, out),
                    Err(status) => {
                        return Err(self.fail_head(
                            now,
                            status,
                            format!("READ result could not be placed: {status:?}"),
                            out,
                        ))
                    }
                }
            }
            ResponseKind::AtomicResp { orig } => {
                let EntryKind::Atomic { sge } = &head.kind else {
                    return Err(Fault(format!("atomic response for non-atomic PSN {psn}")));
                };
                match table.scatter(std::slice::from_ref(sge), &orig.to_ne_bytes()) {
                    Ok(_) => self.complete_head(now, WcStatus::Success, out),
                    Err(status) => {
                        return Err(self.fail_head(
                            now,
                            status,
                            format!("atomic result could not be placed: {status:?}"),
                            out,
                        ))
                    }
                }
            }
        }
        self.check_head_failure(now, out)
    }

    /// Start placing the payload (`len` bytes, not yet received) of the READ response for
    /// `psn` straight into the READ's SGEs (see [`Placement`]). Entries before `psn` are
    /// acknowledged now, as the whole response would acknowledge them. `None` unless the
    /// response answers the READ at the head with its exact length into live LOCAL_WRITE
    /// memory: the caller then buffers the frame and [`Requester::handle_response`] judges it.
    pub fn begin_read_placement(
        &mut self,
        now: Instant,
        psn: u32,
        len: usize,
        table: &Arc<MrTable>,
        out: &mut Vec<WorkCompletion>,
    ) -> Option<Placement> {
        if !psn_before(psn, self.next_psn) {
            return None;
        }
        while let Some(head) = self.entries.front() {
            if !psn_before(head.psn, psn) {
                break;
            }
            if head.kind.is_read_or_atomic() || head.failed.is_some() {
                return None;
            }
            self.complete_head(now, WcStatus::Success, out);
        }
        let head = self.entries.front()?;
        let EntryKind::Read { sges, len: want } = &head.kind else {
            return None;
        };
        if head.psn != psn || *want as usize != len || len == 0 {
            return None;
        }
        let dests = Dest::local_scatter(sges, len as u64)?;
        if !table.check_dests(&dests) {
            return None;
        }
        Some(Placement::read_response(psn, dests, len, table))
    }

    /// Complete a READ response placement whose payload arrived whole: the READ at the head
    /// succeeds, or fails `LocalProtection` if its memory was deregistered meanwhile. A
    /// placement for an entry no longer at the head (flushed meanwhile) is dropped.
    pub fn finish_read_placement(
        &mut self,
        now: Instant,
        p: Placement,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<(), Fault> {
        let at_head = self
            .entries
            .front()
            .is_some_and(|h| h.psn == p.psn() && matches!(h.kind, EntryKind::Read { .. }));
        if !at_head {
            return Ok(());
        }
        if p.lost() {
            return Err(self.fail_head(
                now,
                WcStatus::LocalProtection,
                format!(
                    "READ result could not be placed: {:?}",
                    WcStatus::LocalProtection
                ),
                out,
            ));
        }
        self.complete_head(now, WcStatus::Success, out);
        self.check_head_failure(now, out)
    }

    fn stale_or_bogus(&self, psn: u32) -> Result<(), Fault> {
        // A response older than every outstanding request answers a resend: ignore it.
        let oldest = self.entries.front().map_or(self.next_psn, |e| e.psn);
        if psn_before(psn, oldest) {
            Ok(())
        } else {
            Err(Fault(format!("response for PSN {psn} that was never sent")))
        }
    }

    fn handle_nak(
        &mut self,
        now: Instant,
        code: NakCode,
        rnr_timer: u8,
        out: &mut Vec<WorkCompletion>,
    ) -> Result<(), Fault> {
        let (psn, rnr_naks) = self.entries.front().map_or((0, 0), |e| (e.psn, e.rnr_naks));
        let status = match code {
            NakCode::Rnr => {
                if self.params.rnr_retry != 7 && rnr_naks >= self.params.rnr_retry {
                    return Err(self.fail_head(
                        now,
                        WcStatus::RnrRetryExceeded,
                        format!(
                            "receiver not ready for PSN {psn}: {} RNR retries spent",
                            self.params.rnr_retry
                        ),
                        out,
                    ));
                }
                if let Some(e) = self.entries.front_mut() {
                    e.rnr_naks = e.rnr_naks.saturating_add(1);
                }
                self.next_tx = 0;
                self.rnr_until = Some(now + crate::rnr_timer(rnr_timer));
                self.ack_deadline = None;
                return Ok(());
            }
            NakCode::PsnSequence => return self.retry(now, "PSN sequence NAK", out),
            NakCode::RemoteAccess => WcStatus::RemoteAccess,
            NakCode::InvalidRequest => WcStatus::RemoteInvalidRequest,
            NakCode::RemoteOperation => WcStatus::RemoteOperation,
        };
        Err(self.fail_head(
            now,
            status,
            format!("peer refused PSN {psn}: {code:?}"),
            out,
        ))
    }

    /// Transmit every entry again from the oldest, as a retry does but without counting one:
    /// the connection changed before any of them could have reached the responder.
    pub fn rewind(&mut self) {
        self.next_tx = 0;
    }

    /// Complete every entry with `WrFlushed` (ERROR).
    pub fn flush(&mut self, out: &mut Vec<WorkCompletion>) {
        while let Some(e) = self.entries.pop_front() {
            out.push(self.completion(&e, WcStatus::WrFlushed));
        }
        self.clear_timers();
    }

    /// Drop every entry without completions (RESET).
    pub fn reset(&mut self) {
        self.entries.clear();
        self.clear_timers();
    }

    fn clear_timers(&mut self) {
        self.next_tx = 0;
        self.rnr_until = None;
        self.ack_deadline = None;
        self.retries = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::mr::SoftMr;

    fn entry(r: &mut Requester, kind: EntryKind, signaled: bool) -> SqEntry {
        let psn = r.alloc_psn();
        SqEntry {
            wr_id: u64::from(psn),
            opcode: WcOpcode::Send,
            signaled,
            fence: false,
            psn,
            frame: Arc::new(psn.to_be_bytes().to_vec()),
            kind,
            byte_len: 1,
            failed: None,
            rnr_naks: 0,
            deferred_gather: None,
            payload_ref: None,
        }
    }

    fn ack(psn: u32) -> Response<'static> {
        Response {
            qpn: 1,
            psn,
            kind: ResponseKind::Ack,
        }
    }

    fn rq(n: u32) -> (Requester, Instant) {
        let mut r = Requester::new(QpNum(1), 10);
        r.set_params(RequesterParams {
            ack_timeout: Some(Duration::from_millis(10)),
            retry_cnt: 2,
            rnr_retry: 1,
            max_rd_atomic: 1,
        });
        let now = Instant::now();
        for _ in 0..n {
            let e = entry(&mut r, EntryKind::Acked, true);
            r.push(now, e);
        }
        (r, now)
    }

    #[test]
    fn cumulative_ack_completes_in_order_and_skips_unsignaled_successes() {
        let (mut r, now) = rq(0);
        for s in [true, false, true] {
            let e = entry(&mut r, EntryKind::Acked, s);
            r.push(now, e);
        }
        let t = MrTable::new();
        let mut tx = Vec::new();
        assert_eq!(r.poll_transmit(now, &t, &mut tx), 3);
        let mut out = Vec::new();
        r.handle_response(now, &ack(11), &t, &mut out).unwrap();
        assert_eq!(out.iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![10]);
        r.handle_response(now, &ack(12), &t, &mut out).unwrap();
        assert_eq!(
            out.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
            vec![10, 12]
        );
        assert!(r.is_empty());
        // A stale ACK is ignored; an ACK from the future is a fault.
        r.handle_response(now, &ack(11), &t, &mut out).unwrap();
        assert!(r.handle_response(now, &ack(40), &t, &mut out).is_err());
    }

    #[test]
    fn ack_timeout_resends_then_retry_exceeded() {
        let (mut r, now) = rq(2);
        let tbl = MrTable::new();
        let mut tx = Vec::new();
        r.poll_transmit(now, &tbl, &mut tx);
        let mut out = Vec::new();
        let mut t = now;
        for _ in 0..2 {
            t = r.poll_timeout().unwrap();
            r.handle_timeout(t, &mut out).unwrap();
            tx.clear();
            assert_eq!(r.poll_transmit(t, &tbl, &mut tx), 2, "go-back-N resend");
        }
        let t = r.poll_timeout().unwrap().max(t);
        let f = r.handle_timeout(t, &mut out);
        assert!(f.is_err());
        assert_eq!(out[0].status, WcStatus::RetryExceeded);
    }

    #[test]
    fn rnr_nak_pauses_then_exceeds() {
        let (mut r, now) = rq(2);
        let t = MrTable::new();
        let mut tx = Vec::new();
        r.poll_transmit(now, &t, &mut tx);
        let nak = Response {
            qpn: 1,
            psn: 10,
            kind: ResponseKind::Nak {
                code: NakCode::Rnr,
                rnr_timer: 1,
            },
        };
        let mut out = Vec::new();
        r.handle_response(now, &nak, &t, &mut out).unwrap();
        tx.clear();
        assert_eq!(r.poll_transmit(now, &t, &mut tx), 0, "paused");
        let later = r.poll_timeout().unwrap();
        r.handle_timeout(later, &mut out).unwrap();
        assert_eq!(r.poll_transmit(later, &t, &mut tx), 2);
        assert!(r.handle_response(later, &nak, &t, &mut out).is_err());
        assert_eq!(out[0].status, WcStatus::RnrRetryExceeded);
        assert_eq!(out[0].wr_id, 10);
    }

    #[test]
    fn fence_and_read_limit_hold_back_transmission() {
        let table = MrTable::new();
        let mr = SoftMr::alloc(&table, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let info = crate::provider::MrOps::info(&mr);
        let sge = Sge {
            addr: info.addr,
            length: 4,
            lkey: info.lkey,
        };
        let (mut r, now) = rq(0);
        let e = entry(
            &mut r,
            EntryKind::Read {
                sges: vec![sge],
                len: 4,
            },
            true,
        );
        r.push(now, e);
        let e = entry(
            &mut r,
            EntryKind::Read {
                sges: vec![sge],
                len: 4,
            },
            true,
        );
        r.push(now, e);
        let mut e = entry(&mut r, EntryKind::Acked, true);
        e.fence = true;
        r.push(now, e);
        let t = MrTable::new();
        let mut tx = Vec::new();
        assert_eq!(r.poll_transmit(now, &t, &mut tx), 1, "max_rd_atomic = 1");
        let mut out = Vec::new();
        let rr = Response {
            qpn: 1,
            psn: 10,
            kind: ResponseKind::ReadResp { payload: b"abcd" },
        };
        r.handle_response(now, &rr, &table, &mut out).unwrap();
        assert_eq!(
            r.poll_transmit(now, &t, &mut tx),
            1,
            "second READ, fenced SEND waits"
        );
        let rr = Response { psn: 11, ..rr };
        r.handle_response(now, &rr, &table, &mut out).unwrap();
        assert_eq!(r.poll_transmit(now, &t, &mut tx), 1);
        assert_eq!(out.len(), 2);
        let mut got = Vec::new();
        table.gather(&[sge], &mut got).unwrap();
        assert_eq!(got, b"abcd");
        // Wrong-length READ response is a fault.
        let (mut r, now) = rq(0);
        let e = entry(
            &mut r,
            EntryKind::Read {
                sges: vec![sge],
                len: 4,
            },
            true,
        );
        r.push(now, e);
        r.poll_transmit(now, &t, &mut tx);
        let bad = Response {
            qpn: 1,
            psn: 10,
            kind: ResponseKind::ReadResp { payload: b"ab" },
        };
        assert!(r.handle_response(now, &bad, &table, &mut out).is_err());
    }

    #[test]
    fn large_payloads_stay_in_memory_for_a_stream_sink_and_are_gathered_otherwise() {
        use crate::soft::tx::TxQueue;
        let table = MrTable::new();
        let len = 3 * ZERO_COPY_MIN as usize;
        let mr = SoftMr::alloc(&table, len, AccessFlags::ALL).unwrap();
        let info = crate::provider::MrOps::info(&mr);
        let sge = |l: usize| Sge {
            addr: info.addr,
            length: l as u32,
            lkey: info.lkey,
        };
        for (n, by_ref) in [(len, true), (ZERO_COPY_MIN as usize - 1, false)] {
            for stream in [true, false] {
                let (mut r, now) = rq(0);
                let mut e = entry(&mut r, EntryKind::Acked, true);
                e.frame = Arc::new(vec![0u8; 16]);
                e.deferred_gather = Some(vec![sge(n)]);
                r.push(now, e);
                let (mut q, mut v) = (TxQueue::new(), Vec::new());
                let sent = if stream {
                    r.poll_transmit(now, &table, &mut q)
                } else {
                    r.poll_transmit(now, &table, &mut v)
                };
                assert_eq!(sent, 1);
                let head = &r.entries[0];
                let announced = u32::from_be_bytes(head.frame[..4].try_into().unwrap());
                assert_eq!(
                    announced as usize,
                    16 + n,
                    "length field counts the payload"
                );
                let kept = stream && by_ref;
                assert_eq!(head.payload_ref.is_some(), kept, "n {n} stream {stream}");
                assert_eq!(head.frame.len(), if kept { 16 } else { 16 + n });
                assert_eq!(q.len() + v.len(), 16 + n);
                if kept {
                    // A resend reads the memory again.
                    r.handle_timeout(r.poll_timeout().unwrap(), &mut Vec::new())
                        .unwrap();
                    assert_eq!(r.poll_transmit(now, &table, &mut q), 1);
                    assert_eq!(q.len(), 2 * (16 + n));
                }
            }
        }
        // A payload that no longer names registered memory fails the request at the head.
        let (mut r, now) = rq(0);
        let mut e = entry(&mut r, EntryKind::Acked, true);
        e.deferred_gather = Some(vec![sge(len)]);
        r.push(now, e);
        drop(mr);
        let mut q = TxQueue::new();
        assert_eq!(r.poll_transmit(now, &table, &mut q), 0);
        let mut out = Vec::new();
        assert!(r.check_head_failure(now, &mut out).is_err());
        assert_eq!(out[0].status, WcStatus::LocalProtection);
    }

    #[test]
    fn flush_completes_everything_with_wr_flushed() {
        let (mut r, _) = rq(3);
        let mut out = Vec::new();
        r.flush(&mut out);
        assert_eq!(out.len(), 3);
        assert!(out.iter().all(|w| w.status == WcStatus::WrFlushed));
        assert!(r.is_empty());
    }
}
