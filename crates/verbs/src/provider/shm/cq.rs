//! Completion queues: a ring of [`CqEntry`]s in the owner's segment that any process may
//! produce into (a sender writes the receiver's completion itself) and only the owner consumes,
//! plus the arm/event-fd cycle.
//!
//! Overflow is never silent: a producer that finds the ring full sets the slot's `overflow`
//! word, and from then on `poll` answers `CqOverflow`.
//!
//! Events: `req_notify` sets `armed` (SeqCst), then the caller re-polls; a producer publishes
//! its entry, then reads `armed` (SeqCst) — so either the re-poll sees the entry or the producer
//! sees the arm. The producer that disarms the CQ signals it: directly on the CQ's eventfd when
//! it is the owner, otherwise by setting `notify_pending` and ringing the owner's doorbell, whose
//! service thread then signals the eventfd (a peer cannot write our eventfd).

use std::any::Any;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use super::ctx::CtxCore;
use super::ring::RingError;
use super::segment::{CqSlot, SegRing, Segment};
use super::sys;
use crate::provider::CqOps;
use crate::{QpNum, Result, VerbsError, WcOpcode, WcStatus, WorkCompletion};

/// One completion as stored in shared memory (plain data; any bit pattern decodes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CqEntry {
    pub(crate) wr_id: u64,
    pub(crate) byte_len: u32,
    pub(crate) imm: u32,
    pub(crate) qp_num: u32,
    pub(crate) src_qp: u32,
    pub(crate) vendor_err: u32,
    /// Send-queue slots this completion releases (send side only).
    pub(crate) sq_credit: u32,
    /// QP table index of `qp_num` in the owner's segment (send side only).
    pub(crate) qp_index: u32,
    pub(crate) status: u8,
    pub(crate) opcode: u8,
    pub(crate) has_imm: u8,
    pub(crate) _pad: u8,
}

const ST_GENERAL: u8 = 255;

/// How far past the next free slot a peer producer prefetches a CQ's ring (at least 1: the
/// next free slot is the one an idle consumer polls).
const CQ_PREFETCH_AHEAD: u64 = 2;

/// Status → (code, vendor_err for `General`).
pub(crate) fn encode_status(s: WcStatus) -> (u8, u32) {
    let code = match s {
        WcStatus::Success => 0,
        WcStatus::LocalLength => 1,
        WcStatus::LocalQpOperation => 2,
        WcStatus::LocalProtection => 3,
        WcStatus::WrFlushed => 4,
        WcStatus::MemoryWindowBind => 5,
        WcStatus::BadResponse => 6,
        WcStatus::LocalAccess => 7,
        WcStatus::RemoteInvalidRequest => 8,
        WcStatus::RemoteAccess => 9,
        WcStatus::RemoteOperation => 10,
        WcStatus::RetryExceeded => 11,
        WcStatus::RnrRetryExceeded => 12,
        WcStatus::RemoteAborted => 13,
        WcStatus::Fatal => 14,
        WcStatus::General(c) => return (ST_GENERAL, c),
        #[allow(unreachable_patterns)]
        _ => return (ST_GENERAL, 0),
    };
    (code, 0)
}

fn decode_status(code: u8, vendor_err: u32) -> WcStatus {
    match code {
        0 => WcStatus::Success,
        1 => WcStatus::LocalLength,
        2 => WcStatus::LocalQpOperation,
        3 => WcStatus::LocalProtection,
        4 => WcStatus::WrFlushed,
        5 => WcStatus::MemoryWindowBind,
        6 => WcStatus::BadResponse,
        7 => WcStatus::LocalAccess,
        8 => WcStatus::RemoteInvalidRequest,
        9 => WcStatus::RemoteAccess,
        10 => WcStatus::RemoteOperation,
        11 => WcStatus::RetryExceeded,
        12 => WcStatus::RnrRetryExceeded,
        13 => WcStatus::RemoteAborted,
        14 => WcStatus::Fatal,
        ST_GENERAL => WcStatus::General(vendor_err),
        other => WcStatus::General(u32::from(other)),
    }
}

/// Opcode → code.
pub(crate) fn encode_opcode(o: WcOpcode) -> u8 {
    match o {
        WcOpcode::Send => 0,
        WcOpcode::RdmaWrite => 1,
        WcOpcode::RdmaRead => 2,
        WcOpcode::CompSwap => 3,
        WcOpcode::FetchAdd => 4,
        WcOpcode::Recv => 5,
        WcOpcode::RecvRdmaWithImm => 6,
        #[allow(unreachable_patterns)]
        _ => 5,
    }
}

fn decode_opcode(code: u8) -> WcOpcode {
    match code {
        0 => WcOpcode::Send,
        1 => WcOpcode::RdmaWrite,
        2 => WcOpcode::RdmaRead,
        3 => WcOpcode::CompSwap,
        4 => WcOpcode::FetchAdd,
        6 => WcOpcode::RecvRdmaWithImm,
        _ => WcOpcode::Recv,
    }
}

impl CqEntry {
    /// A completion.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
        qp_num: u32,
        src_qp: u32,
    ) -> CqEntry {
        let (status, vendor_err) = encode_status(status);
        CqEntry {
            wr_id,
            byte_len,
            imm: imm.unwrap_or(0),
            qp_num,
            src_qp,
            vendor_err,
            sq_credit: 0,
            qp_index: 0,
            status,
            opcode: encode_opcode(opcode),
            has_imm: u8::from(imm.is_some()),
            _pad: 0,
        }
    }

    fn decode(&self) -> WorkCompletion {
        WorkCompletion {
            wr_id: self.wr_id,
            status: decode_status(self.status, self.vendor_err),
            opcode: decode_opcode(self.opcode),
            byte_len: self.byte_len,
            imm_data: (self.has_imm != 0).then_some(self.imm),
            qp_num: QpNum(self.qp_num),
            src_qp: QpNum(self.src_qp),
            vendor_err: self.vendor_err,
        }
    }

    fn is_error(&self) -> bool {
        self.status != 0
    }
}

/// Publish `e` into the CQ `slot` of `seg`; false (and the CQ marked overflowed) if it did not
/// fit. Returns whether the CQ must be signalled (it was armed for this completion and this
/// call disarmed it).
///
/// A peer producer (`prefetch`) also starts fetching a slot a little past the new tail, so a
/// stream of sends finds the CQ slots of a lagging consumer already in its cache.
#[inline]
fn produce(seg: &Segment, slot: &CqSlot, e: CqEntry, solicited: bool, prefetch: bool) -> bool {
    let cap = u64::from(slot.cap.load(Ordering::Relaxed));
    let off = slot.ring_off.load(Ordering::Relaxed);
    let ring = seg.ring::<CqEntry>(off, cap);
    let pushed = match &ring {
        Some(ring) => ring.push(e),
        None => Err(RingError::Stalled),
    };
    if pushed.is_err() {
        slot.overflow.store(1, Ordering::SeqCst);
    }
    fence(Ordering::SeqCst);
    if let (true, Some(ring)) = (prefetch, &ring) {
        ring.prefetch_for_push(CQ_PREFETCH_AHEAD);
    }
    let armed = slot.armed.load(Ordering::SeqCst);
    if armed == 0 || (armed == 2 && !solicited && !e.is_error()) {
        return false;
    }
    slot.armed
        .compare_exchange(armed, 0, Ordering::SeqCst, Ordering::Relaxed)
        .is_ok()
}

/// Produce a completion into CQ `cq_index` of a segment this process does not own the handle
/// of (a peer's, or ours reached through a QP table entry). Returns false if the CQ is gone.
pub(crate) fn push_remote(seg: &Segment, cq_index: u32, e: CqEntry, solicited: bool) -> bool {
    let slot = seg.cq_slot(cq_index);
    if slot.live.load(Ordering::Acquire) == 0 {
        return false;
    }
    if produce(seg, slot, e, solicited, true) {
        slot.notify_pending.store(1, Ordering::SeqCst);
        seg.kick();
    }
    true
}

/// The owner's side of a completion queue.
pub(crate) struct CqShared {
    pub(crate) core: Arc<CtxCore>,
    pub(crate) index: u32,
    ring: SegRing<CqEntry>,
    eventfd: OwnedFd,
    capacity: u32,
}

impl CqShared {
    /// A new CQ of at least `cqe` entries.
    pub(crate) fn create(core: &Arc<CtxCore>, cqe: u32) -> Result<Arc<CqShared>> {
        let sh = &core.shared;
        let index = sh
            .cq_ids
            .lock()
            .take()
            .ok_or_else(|| VerbsError::LimitExceeded("too many CQs".into()))?;
        let ring = match SegRing::<CqEntry>::alloc(&sh.seg, &sh.heap, cqe) {
            Ok(r) => r,
            Err(e) => {
                sh.cq_ids.lock().give(index);
                return Err(e);
            }
        };
        let eventfd = match sys::eventfd() {
            Ok(fd) => fd,
            Err(e) => {
                ring.release(&sh.heap);
                sh.cq_ids.lock().give(index);
                return Err(VerbsError::io("create CQ eventfd", e));
            }
        };
        let slot = sh.seg.cq_slot(index);
        slot.cap.store(ring.cap as u32, Ordering::Relaxed);
        slot.ring_off.store(ring.off, Ordering::Relaxed);
        slot.armed.store(0, Ordering::Relaxed);
        slot.notify_pending.store(0, Ordering::Relaxed);
        slot.overflow.store(0, Ordering::Relaxed);
        slot.live.store(1, Ordering::Release);
        let capacity = ring.cap as u32;
        let cq = Arc::new(CqShared {
            core: core.clone(),
            index,
            ring,
            eventfd,
            capacity,
        });
        sh.cqs.lock().insert(index, Arc::downgrade(&cq));
        Ok(cq)
    }

    fn slot(&self) -> &CqSlot {
        self.core.shared.seg.cq_slot(self.index)
    }

    /// Produce a completion of our own process into this CQ.
    #[inline]
    pub(crate) fn push_local(&self, e: CqEntry, solicited: bool) {
        if produce(&self.core.shared.seg, self.slot(), e, solicited, false) {
            sys::eventfd_kick(self.eventfd.as_fd());
        }
    }

    /// Signal the eventfd if a peer asked for it (service thread).
    pub(crate) fn deliver_pending_notify(&self) {
        if self.slot().notify_pending.swap(0, Ordering::SeqCst) != 0 {
            sys::eventfd_kick(self.eventfd.as_fd());
        }
    }

    #[inline]
    fn poll(&self, wc: &mut [WorkCompletion]) -> Result<usize> {
        let slot = self.slot();
        if slot.overflow.load(Ordering::Relaxed) != 0 {
            return Err(VerbsError::CqOverflow {
                capacity: self.capacity,
            });
        }
        let seg = &self.core.shared.seg;
        let ring = self.ring.ring();
        let mut n = 0;
        while n < wc.len() {
            match ring.pop() {
                Ok(Some(e)) => {
                    if e.sq_credit != 0 && e.opcode < 5 {
                        seg.qp_slot(e.qp_index)
                            .sq_polled
                            .fetch_add(u64::from(e.sq_credit), Ordering::Release);
                    }
                    wc[n] = e.decode();
                    n += 1;
                }
                Ok(None) | Err(_) => break,
            }
        }
        if n == 0 && self.core.shared.timer_due() {
            // Nothing to report while a send waits for its RNR or retry timer: run it here.
            self.core.shared.run_due_timers();
        }
        Ok(n)
    }
}

impl Drop for CqShared {
    fn drop(&mut self) {
        let sh = &self.core.shared;
        sh.cqs.lock().remove(&self.index);
        self.slot().live.store(0, Ordering::SeqCst);
        self.ring.release(&sh.heap);
        sh.cq_ids.lock().give(self.index);
    }
}

/// The provider object behind a `CompletionQueue`.
pub(crate) struct ShmCq {
    pub(crate) shared: Arc<CqShared>,
}

impl CqOps for ShmCq {
    fn capacity(&self) -> u32 {
        self.shared.capacity
    }

    fn may_have_completions(&self) -> bool {
        let sh = &self.shared;
        sh.ring.ring().may_have_entry()
            || sh.slot().overflow.load(Ordering::Relaxed) != 0
            || sh.core.shared.timer_due()
    }

    #[inline]
    fn poll(&self, wc: &mut [WorkCompletion]) -> Result<usize> {
        self.shared.poll(wc)
    }

    fn req_notify(&self, solicited_only: bool) -> Result<()> {
        self.shared
            .slot()
            .armed
            .store(if solicited_only { 2 } else { 1 }, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        Ok(())
    }

    fn event_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.shared.eventfd.as_fd())
    }

    fn ack_events(&self) -> Result<u32> {
        let n = sys::eventfd_drain(self.shared.eventfd.as_fd())
            .map_err(|e| VerbsError::io("read CQ eventfd", e))?;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
