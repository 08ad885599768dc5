//! RC queue pairs: the state machine, connection (attaching to the peer's segment), posting,
//! RNR / not-ready retries and flushing.
//!
//! A QP is an entry in our segment's QP table (state, rights, PD, where its receives and
//! receive completions live, which remote QP it is connected to) plus local state under one
//! mutex: attributes, the connected peer, and the backlog of send requests waiting for an RNR
//! or transport retry. Send requests run at post time on the caller's thread (see `exec`); a
//! request that cannot run yet waits in the backlog, in order, and every later request queues
//! behind it. The context's service thread retries the backlog when its timer expires.
//!
//! The authoritative state is the table entry's `state` word, changed only by compare-and-swap
//! through [`QpState::check_transition`]: the owner moves it freely, a peer only to ERROR (after
//! a responder-side error), after which the owner flushes on its service thread.

use std::any::Any;
use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::cq::{CqEntry, CqShared, ShmCq};
use super::ctx::CtxCore;
use super::exec::{execute, gather_inline, Initiator, Op, Outcome};
use super::mrtable::{invalidate, wait_holders, Holders};
use super::segment::{fresh_tag, QpSlot, SegRing, Segment, QP_INDEX_BITS};
use super::srq::{ShmSrq, SrqShared};
use crate::provider::QpOps;
use crate::{
    ack_timeout, rnr_timer, AccessFlags, PostError, QpAttr, QpCaps, QpEndpoint, QpInfo, QpInitAttr,
    QpNum, QpState, RecvWr, Result, SendFlags, SendWr, Sge, VerbsError, WcOpcode, WcStatus,
    WrOpcode,
};

/// Most SGEs per work request.
pub(crate) const MAX_SGE: usize = 8;
/// Most inline payload per send request, bytes.
pub(crate) const MAX_INLINE: usize = 256;
/// How often a request waiting for an unconnected target looks again.
const NOT_READY_POLL: Duration = Duration::from_millis(1);
/// Bounds of the wait for an atomic served by the target's service thread.
const ATOMIC_WAIT_MIN: Duration = Duration::from_millis(100);
const ATOMIC_WAIT_MAX: Duration = Duration::from_secs(10);

/// Longest wait for an atomic served by the target's service thread: the QP's transport
/// timeout, `(retry_cnt + 1)` ACK timeouts, clamped (worked out only when such an atomic runs).
pub(crate) fn atomic_wait(timeout: u8, retry_cnt: u8) -> Duration {
    match ack_timeout(timeout) {
        None => ATOMIC_WAIT_MAX,
        Some(t) => (t * (u32::from(retry_cnt) + 1)).clamp(ATOMIC_WAIT_MIN, ATOMIC_WAIT_MAX),
    }
}

/// One receive SGE as stored in shared memory.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RawSge {
    pub(crate) addr: u64,
    pub(crate) length: u32,
    pub(crate) lkey: u32,
}

/// One posted receive as stored in a receive ring (plain data).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RecvEntry {
    pub(crate) wr_id: u64,
    pub(crate) num_sge: u32,
    pub(crate) _pad: u32,
    pub(crate) sge: [RawSge; MAX_SGE],
}

impl RecvEntry {
    /// Write receive `wr` (at most [`MAX_SGE`] SGEs; the caller checked) into the ring slot
    /// `p`, touching only the header and the SGEs it has: a one-SGE receive is one cache line.
    ///
    /// # Safety
    /// `p` is valid for writes of one `RecvEntry` and owned by the caller (a claimed slot).
    #[inline]
    pub(crate) unsafe fn write_wr(p: *mut RecvEntry, wr: &RecvWr<'_>) {
        let n = wr.sg_list.len().min(MAX_SGE);
        // SAFETY: field projections of a pointer the caller vouches for; `i < MAX_SGE` stays
        // inside the `sge` array.
        unsafe {
            std::ptr::addr_of_mut!((*p).wr_id).write(wr.wr_id);
            std::ptr::addr_of_mut!((*p).num_sge).write(n as u32);
            let sge = std::ptr::addr_of_mut!((*p).sge).cast::<RawSge>();
            for (i, s) in wr.sg_list[..n].iter().enumerate() {
                sge.add(i).write(RawSge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey.0,
                });
            }
        }
    }

    /// Read the entry in the ring slot `p` into `e`: the header and the SGEs it announces (the
    /// count clamped to [`MAX_SGE`]); the SGEs past that are not read (`e` keeps its own).
    ///
    /// # Safety
    /// `p` is valid for reads of one `RecvEntry` and owned by the caller (a claimed slot).
    #[inline]
    pub(crate) unsafe fn read_used(p: *const RecvEntry, e: &mut RecvEntry) {
        // SAFETY: field projections of a pointer the caller vouches for; `i < n <= MAX_SGE`
        // stays inside the `sge` array. Plain data: any bit pattern a peer left is valid.
        unsafe {
            e.wr_id = std::ptr::addr_of!((*p).wr_id).read();
            let n = (std::ptr::addr_of!((*p).num_sge).read() as usize).min(MAX_SGE);
            e.num_sge = n as u32;
            let sge = std::ptr::addr_of!((*p).sge).cast::<RawSge>();
            // The usual single SGE as one plain load (a loop becomes a `memcpy` call).
            if n >= 1 {
                e.sge[0] = sge.read();
            }
            for (i, d) in e.sge[..n].iter_mut().enumerate().skip(1) {
                *d = sge.add(i).read();
            }
        }
    }
}

/// State → table code.
pub(crate) fn state_code(s: QpState) -> u32 {
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

/// Table code → state (an unknown code reads as ERROR).
pub(crate) fn decode_state(c: u32) -> QpState {
    match c {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        4 => QpState::Sqd,
        5 => QpState::Sqe,
        _ => QpState::Error,
    }
}

/// The QP we are connected to.
pub(crate) struct RemoteQp {
    pub(crate) seg: Arc<Segment>,
    pub(crate) qpn: u32,
    pub(crate) endpoint: QpEndpoint,
}

/// A send request waiting in the backlog.
struct PendingWr {
    wr_id: u64,
    opcode: WrOpcode,
    flags: SendFlags,
    signaled: bool,
    sges: Vec<Sge>,
    inline: Option<Vec<u8>>,
    /// RNR retries left (7 = forever); `None` until the first RNR.
    rnr_left: Option<u8>,
    /// When the target first proved not ready (transport retry budget starts).
    not_ready_since: Option<Instant>,
    next_try: Instant,
}

impl PendingWr {
    /// `wr` queued for a later attempt (its SGE list and inline bytes copied).
    fn new(wr: &SendWr<'_>, signaled: bool, inline: Option<&[u8]>) -> PendingWr {
        PendingWr {
            wr_id: wr.wr_id,
            opcode: wr.opcode,
            flags: wr.flags,
            signaled,
            sges: wr.sg_list.to_vec(),
            inline: inline.map(<[u8]>::to_vec),
            rnr_left: None,
            not_ready_since: None,
            next_try: Instant::now(),
        }
    }
}

/// Everything under the QP lock.
struct SqState {
    access: AccessFlags,
    min_rnr_timer: u8,
    rnr_retry: u8,
    timeout: u8,
    retry_cnt: u8,
    remote: Option<RemoteQp>,
    backlog: VecDeque<PendingWr>,
    /// Send requests ever accepted (minus resets); outstanding = posted - sq_polled.
    posted: u64,
    /// Successful unsignaled requests not yet credited by a completion.
    unsignaled: u32,
    /// The ERROR flush ran.
    flushed: bool,
    /// Holds on the QP's entry left by a peer that died inside a request: they never end, so a
    /// move to ERROR or RESET waits only for holds beyond them (`QpInner::modify`).
    stale_holds: u32,
}

/// The provider's QP.
pub(crate) struct QpInner {
    core: Arc<CtxCore>,
    index: u32,
    qpn: u32,
    pd: u32,
    caps: QpCaps,
    sq_sig_all: bool,
    send_cq: Arc<CqShared>,
    recv_cq: Arc<CqShared>,
    srq: Option<Arc<SrqShared>>,
    rq: Option<SegRing<RecvEntry>>,
    sq: Mutex<SqState>,
    weak: Weak<QpInner>,
}

fn downcast_cq(cq: &crate::CompletionQueue) -> Result<Arc<CqShared>> {
    cq.ops()
        .as_any()
        .downcast_ref::<ShmCq>()
        .map(|c| c.shared.clone())
        .ok_or_else(|| VerbsError::InvalidArgument("CQ of another provider".into()))
}

impl QpInner {
    /// Create a QP in RESET.
    pub(crate) fn create(
        core: &Arc<CtxCore>,
        pd: u32,
        init: &QpInitAttr<'_>,
    ) -> Result<Arc<QpInner>> {
        let sh = &core.shared;
        let send_cq = downcast_cq(init.send_cq)?;
        let recv_cq = downcast_cq(init.recv_cq)?;
        if !Arc::ptr_eq(&send_cq.core.shared, sh) || !Arc::ptr_eq(&recv_cq.core.shared, sh) {
            return Err(VerbsError::InvalidArgument("CQ of another context".into()));
        }
        let srq = match init.srq {
            Some(s) => {
                let s = s
                    .ops()
                    .as_any()
                    .downcast_ref::<ShmSrq>()
                    .map(|s| s.shared.clone())
                    .ok_or_else(|| VerbsError::InvalidArgument("SRQ of another provider".into()))?;
                if !Arc::ptr_eq(&s.core.shared, sh) {
                    return Err(VerbsError::InvalidArgument("SRQ of another context".into()));
                }
                Some(s)
            }
            None => None,
        };
        let c = init.caps;
        if c.max_send_sge as usize > MAX_SGE || c.max_recv_sge as usize > MAX_SGE {
            return Err(VerbsError::LimitExceeded(format!(
                "more than {MAX_SGE} SGEs"
            )));
        }
        if c.max_inline_data as usize > MAX_INLINE {
            return Err(VerbsError::LimitExceeded(format!(
                "inline above {MAX_INLINE} bytes"
            )));
        }
        let index = sh
            .qp_ids
            .lock()
            .take()
            .ok_or_else(|| VerbsError::LimitExceeded("too many QPs".into()))?;
        let rq = if srq.is_none() {
            match SegRing::<RecvEntry>::alloc(&sh.seg, &sh.heap, c.max_recv_wr) {
                Ok(r) => Some(r),
                Err(e) => {
                    sh.qp_ids.lock().give(index);
                    return Err(e);
                }
            }
        } else {
            None
        };
        let qpn = (fresh_tag(32 - QP_INDEX_BITS, 0) << QP_INDEX_BITS) | index;
        let slot = sh.seg.qp_slot(index);
        slot.state
            .store(state_code(QpState::Reset), Ordering::Relaxed);
        slot.access.store(0, Ordering::Relaxed);
        slot.pd.store(pd, Ordering::Relaxed);
        slot.min_rnr_timer.store(12, Ordering::Relaxed);
        slot.recv_cq.store(recv_cq.index, Ordering::Relaxed);
        slot.srq
            .store(srq.as_ref().map_or(0, |s| s.index), Ordering::Relaxed);
        slot.rq_off
            .store(rq.as_ref().map_or(0, |r| r.off), Ordering::Relaxed);
        slot.rq_cap
            .store(rq.as_ref().map_or(0, |r| r.cap as u32), Ordering::Relaxed);
        slot.remote_qpn.store(0, Ordering::Relaxed);
        slot.remote_nonce.store(0, Ordering::Relaxed);
        slot.needs_flush.store(0, Ordering::Relaxed);
        slot.sq_polled.store(0, Ordering::Relaxed);
        slot.qpn.store(qpn, Ordering::SeqCst);
        let qp = Arc::new_cyclic(|weak| QpInner {
            core: core.clone(),
            index,
            qpn,
            pd,
            caps: c,
            sq_sig_all: init.sq_sig_all,
            send_cq,
            recv_cq,
            srq,
            rq,
            sq: Mutex::new(SqState {
                access: AccessFlags::empty(),
                min_rnr_timer: 12,
                rnr_retry: 7,
                timeout: 14,
                retry_cnt: 7,
                remote: None,
                backlog: VecDeque::new(),
                posted: 0,
                unsignaled: 0,
                flushed: false,
                stale_holds: 0,
            }),
            weak: weak.clone(),
        });
        sh.qps.lock().insert(index, Arc::downgrade(&qp));
        Ok(qp)
    }

    fn seg(&self) -> &Segment {
        &self.core.shared.seg
    }

    fn slot(&self) -> &QpSlot {
        self.seg().qp_slot(self.index)
    }

    /// Current state.
    pub(crate) fn state(&self) -> QpState {
        decode_state(self.slot().state.load(Ordering::Acquire))
    }

    /// Move the state word to `to` if the state machine allows it from the current state.
    fn cas_state(&self, to: QpState) -> Result<QpState> {
        let slot = self.slot();
        let mut cur = slot.state.load(Ordering::Acquire);
        loop {
            let from = decode_state(cur);
            from.check_transition(to)?;
            match slot.state.compare_exchange(
                cur,
                state_code(to),
                Ordering::SeqCst,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(from),
                Err(actual) => cur = actual,
            }
        }
    }

    #[inline]
    fn complete_send(
        &self,
        unsignaled: &mut u32,
        wr_id: u64,
        opcode: WcOpcode,
        signaled: bool,
        status: WcStatus,
        byte_len: u32,
    ) {
        if signaled || !status.is_success() {
            let mut e = CqEntry::new(wr_id, status, opcode, byte_len, None, self.qpn, 0);
            e.sq_credit = unsignaled.saturating_add(1);
            e.qp_index = self.index;
            *unsignaled = 0;
            self.send_cq.push_local(e, false);
        } else {
            *unsignaled = unsignaled.saturating_add(1);
        }
    }

    fn flush_rq(&self) {
        let Some(rq) = &self.rq else {
            return;
        };
        let ring = rq.ring();
        while let Ok(Some(e)) = ring.pop() {
            let c = CqEntry::new(
                e.wr_id,
                WcStatus::WrFlushed,
                WcOpcode::Recv,
                0,
                None,
                self.qpn,
                0,
            );
            self.recv_cq.push_local(c, false);
        }
    }

    /// The ERROR flush: every outstanding request completes with `WrFlushed`, once.
    fn flush_locked(&self, st: &mut SqState) {
        if st.flushed {
            return;
        }
        st.flushed = true;
        while let Some(p) = st.backlog.pop_front() {
            self.complete_send(
                &mut st.unsignaled,
                p.wr_id,
                p.opcode.wc_opcode(),
                p.signaled,
                WcStatus::WrFlushed,
                0,
            );
        }
        self.flush_rq();
    }

    fn enter_error(&self, st: &mut SqState) {
        let _ = self.cas_state(QpState::Error);
        self.flush_locked(st);
    }

    /// A peer moved us to ERROR: flush (service thread).
    pub(crate) fn sync_remote_error(&self) {
        if self.slot().needs_flush.swap(0, Ordering::SeqCst) == 0 {
            return;
        }
        let mut st = self.sq.lock();
        if self.state() == QpState::Error {
            self.flush_locked(&mut st);
        }
    }

    /// The peer process `pid` died: ERROR and flush if we are connected to it.
    pub(crate) fn peer_died(&self, pid: i32) {
        let mut st = self.sq.lock();
        if st.remote.as_ref().is_some_and(|r| r.seg.pid == pid) && self.state() != QpState::Reset {
            self.enter_error(&mut st);
        }
    }

    fn reset_locked(&self, st: &mut SqState) {
        if let Some(rq) = &self.rq {
            let ring = rq.ring();
            while let Ok(Some(_)) = ring.pop() {}
        }
        st.backlog.clear();
        st.remote = None;
        let slot = self.slot();
        slot.remote_qpn.store(0, Ordering::SeqCst);
        slot.remote_nonce.store(0, Ordering::SeqCst);
        slot.needs_flush.store(0, Ordering::SeqCst);
        st.posted = slot.sq_polled.load(Ordering::Acquire);
        st.unsignaled = 0;
        st.flushed = false;
    }

    fn endpoint(&self) -> QpEndpoint {
        let sh = &self.core.shared;
        QpEndpoint {
            provider: "shm".into(),
            device: sh.device.name.clone(),
            address: sh.qp_address.clone(),
            qp_num: QpNum(self.qpn),
            psn: 0,
            lid: 0,
            gid: [0; 16],
            mtu: 4096,
            extra: Default::default(),
        }
    }

    fn attach(&self, remote: &QpEndpoint) -> Result<RemoteQp> {
        let sh = &self.core.shared;
        let bad = || VerbsError::Protocol(format!("malformed shm address {:?}", remote.address));
        let mut parts = remote.address.split('/');
        let (Some(boot), Some(pid), Some(fd), Some(nonce), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(bad());
        };
        if boot != sh.boot_id {
            return Err(VerbsError::Connect(
                "peer QP is on another host (shm connects processes of one host only)".into(),
            ));
        }
        let pid: i32 = pid.parse().map_err(|_| bad())?;
        let fd: i32 = fd.parse().map_err(|_| bad())?;
        let nonce = u64::from_str_radix(nonce, 16).map_err(|_| bad())?;
        if pid <= 0 || fd < 0 {
            return Err(bad());
        }
        let seg = Segment::attach(pid, fd, nonce)?;
        let qpn = remote.qp_num.0;
        if seg
            .qp_slot(qpn & ((1 << QP_INDEX_BITS) - 1))
            .qpn
            .load(Ordering::Acquire)
            != qpn
        {
            return Err(VerbsError::Connect(format!("no QP {qpn:#x} at pid {pid}")));
        }
        sh.watch(&seg);
        Ok(RemoteQp {
            seg,
            qpn,
            endpoint: remote.clone(),
        })
    }

    fn modify(&self, attr: &QpAttr) -> Result<()> {
        let mut st = self.sq.lock();
        if let Some(to) = attr.state {
            self.state().check_transition(to)?;
        }
        let check_code = |v: Option<u8>, max: u8, what: &str| match v {
            Some(x) if x > max => Err(VerbsError::InvalidArgument(format!("{what} {x} > {max}"))),
            _ => Ok(()),
        };
        check_code(attr.rnr_retry, 7, "rnr_retry")?;
        check_code(attr.retry_cnt, 7, "retry_cnt")?;
        check_code(attr.min_rnr_timer, 31, "min_rnr_timer")?;
        check_code(attr.timeout, 31, "timeout")?;
        if let Some(port) = attr.port {
            if port != 1 {
                return Err(VerbsError::InvalidArgument(format!("no port {port}")));
            }
        }
        if let Some(a) = attr.access {
            a.validate()?;
        }
        let slot = self.slot();
        let new_remote = match (attr.state, &attr.remote) {
            (Some(QpState::Rtr), Some(r)) => Some(self.attach(r)?),
            (Some(QpState::Rtr), None) if st.remote.is_none() => {
                return Err(VerbsError::InvalidArgument(
                    "RTR needs the remote endpoint".into(),
                ))
            }
            _ => None,
        };
        if let Some(a) = attr.access {
            st.access = a;
            slot.access.store(a.bits(), Ordering::SeqCst);
        }
        if let Some(t) = attr.min_rnr_timer {
            st.min_rnr_timer = t;
            slot.min_rnr_timer.store(u32::from(t), Ordering::SeqCst);
        }
        if let Some(v) = attr.rnr_retry {
            st.rnr_retry = v;
        }
        if let Some(v) = attr.timeout {
            st.timeout = v;
        }
        if let Some(v) = attr.retry_cnt {
            st.retry_cnt = v;
        }
        if let Some(r) = new_remote {
            slot.remote_nonce.store(r.seg.nonce, Ordering::SeqCst);
            slot.remote_qpn.store(r.qpn, Ordering::SeqCst);
            st.remote = Some(r);
        }
        let Some(to) = attr.state else {
            return Ok(());
        };
        self.cas_state(to)?;
        if matches!(to, QpState::Error | QpState::Reset) {
            // A peer's READ or WRITE that began before the change (or before the QP went to
            // ERROR by itself, which a later move to ERROR confirms) may still be copying; it
            // ends before this returns, so the owner may reuse what the QP exposed (a pool
            // does). Peers see the new state from now on (`exec::target`). A peer that died
            // inside a request holds on for ever: not waited for once it is known dead.
            let peer = st.remote.as_ref().map(|r| Arc::clone(&r.seg));
            let dead = || peer.as_ref().is_some_and(|seg| !seg.owner_alive());
            match wait_holders(&slot.active, st.stale_holds, dead) {
                Holders::Left => {}
                Holders::Dead(n) => st.stale_holds = n,
                Holders::TimedOut(n) => {
                    tracing::warn!(
                        qpn = self.qpn,
                        "shm: a peer stayed inside the QP past the drain timeout"
                    );
                    st.stale_holds = n;
                }
            }
        }
        match to {
            QpState::Error => self.flush_locked(&mut st),
            QpState::Reset => self.reset_locked(&mut st),
            QpState::Rts => self.run_backlog(&mut st),
            _ => {}
        }
        Ok(())
    }

    /// The transport retry budget for a target that is not connected: `(retry_cnt + 1)` ACK
    /// timeouts (none: wait forever, as `timeout = 0` means in verbs).
    fn not_ready_budget(st: &SqState) -> Option<Duration> {
        ack_timeout(st.timeout).map(|t| t * (u32::from(st.retry_cnt) + 1))
    }

    fn validate(&self, wr: &SendWr<'_>) -> Result<()> {
        if wr.sg_list.len() > self.caps.max_send_sge.max(1) as usize || wr.sg_list.len() > MAX_SGE {
            return Err(VerbsError::InvalidArgument(format!(
                "{} SGEs exceed max_send_sge {}",
                wr.sg_list.len(),
                self.caps.max_send_sge
            )));
        }
        if wr.opcode.is_atomic() {
            if wr.sg_list.len() != 1 || wr.sg_list[0].length != 8 {
                return Err(VerbsError::InvalidArgument(
                    "atomics take exactly one 8-byte SGE".into(),
                ));
            }
            if wr.is_inline() {
                return Err(VerbsError::InvalidArgument(
                    "atomics cannot be inline".into(),
                ));
            }
        }
        if wr.is_inline() {
            if matches!(wr.opcode, WrOpcode::Read { .. }) {
                return Err(VerbsError::InvalidArgument("READ cannot be inline".into()));
            }
            if wr.total_len() > u64::from(self.caps.max_inline_data) {
                return Err(VerbsError::LimitExceeded(format!(
                    "inline payload of {} bytes exceeds max_inline_data {}",
                    wr.total_len(),
                    self.caps.max_inline_data
                )));
            }
        }
        Ok(())
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let mut st = self.sq.lock();
        let state = self.state();
        if !state.accepts_send() {
            return Err(PostError {
                index: 0,
                source: VerbsError::WrongState {
                    state,
                    what: "send",
                },
            });
        }
        let slot = self.slot();
        for (index, wr) in wrs.iter().enumerate() {
            self.validate(wr)
                .map_err(|source| PostError { index, source })?;
            let polled = slot.sq_polled.load(Ordering::Acquire);
            let outstanding = (st.posted as i64).wrapping_sub(polled as i64).max(0) as u64;
            if outstanding >= u64::from(self.caps.max_send_wr) {
                return Err(PostError {
                    index,
                    source: VerbsError::QueueFull,
                });
            }
            st.posted = st.posted.wrapping_add(1);
            let signaled = self.sq_sig_all || wr.flags.contains(SendFlags::SIGNALED);
            let wc_opcode = wr.opcode.wc_opcode();
            let state = self.state();
            if state == QpState::Error {
                self.flush_locked(&mut st);
                self.complete_send(
                    &mut st.unsignaled,
                    wr.wr_id,
                    wc_opcode,
                    signaled,
                    WcStatus::WrFlushed,
                    0,
                );
                continue;
            }
            // Only INLINE requests use the buffer (never zeroed: only what is gathered is read).
            let mut inline_store = [MaybeUninit::<u8>::uninit(); MAX_INLINE];
            let inline = if wr.is_inline() {
                if wr.sg_list.iter().all(|s| s.length == 0) {
                    // Only inline data: sent from where it is.
                    Some(wr.inline_data)
                } else {
                    match gather_inline(
                        self.seg(),
                        self.pd,
                        wr.inline_data,
                        wr.sg_list,
                        &mut inline_store,
                    ) {
                        Ok(bytes) => Some(bytes),
                        Err(status) => {
                            self.complete_send(
                                &mut st.unsignaled,
                                wr.wr_id,
                                wc_opcode,
                                signaled,
                                status,
                                0,
                            );
                            self.enter_error(&mut st);
                            continue;
                        }
                    }
                }
            } else {
                None
            };
            let inline: Option<&[u8]> = inline;
            if !st.backlog.is_empty() || state == QpState::Sqd || st.remote.is_none() {
                st.backlog.push_back(PendingWr::new(wr, signaled, inline));
                continue;
            }
            let op = Op {
                opcode: wr.opcode,
                flags: wr.flags,
                sges: wr.sg_list,
                inline,
            };
            let outcome = match st.remote.as_ref() {
                Some(remote) => execute(
                    &Initiator {
                        seg: self.seg(),
                        pd: self.pd,
                        qpn: self.qpn,
                        remote,
                        timeout: st.timeout,
                        retry_cnt: st.retry_cnt,
                    },
                    &op,
                ),
                None => Outcome::NotReady,
            };
            match outcome {
                Outcome::Done { status, byte_len } => {
                    self.complete_send(
                        &mut st.unsignaled,
                        wr.wr_id,
                        wc_opcode,
                        signaled,
                        status,
                        byte_len,
                    );
                    if !status.is_success() {
                        self.enter_error(&mut st);
                    }
                }
                Outcome::Rnr { .. } | Outcome::NotReady => {
                    st.backlog.push_back(PendingWr::new(wr, signaled, inline));
                    // Account for this first attempt exactly as a retry would.
                    self.after_attempt(&mut st, outcome, Instant::now());
                }
            }
        }
        if !st.backlog.is_empty() && self.state() == QpState::Rts {
            self.run_backlog(&mut st);
        }
        Ok(())
    }

    /// Book-keeping after an attempt of the backlog head that did not finish; returns false
    /// when the head failed for good (completed, QP in ERROR).
    fn after_attempt(&self, st: &mut SqState, outcome: Outcome, now: Instant) -> bool {
        let rnr_retry = st.rnr_retry;
        let budget = Self::not_ready_budget(st);
        // Only a not-ready target needs the (system-call) liveness check.
        let alive = matches!(outcome, Outcome::NotReady)
            && st.remote.as_ref().is_some_and(|r| r.seg.owner_alive());
        let Some(head) = st.backlog.front_mut() else {
            return false;
        };
        let fail = match outcome {
            Outcome::Rnr { timer } => {
                let left = head.rnr_left.get_or_insert(rnr_retry);
                let retry = match *left {
                    7 => true,
                    0 => false,
                    _ => {
                        *left -= 1;
                        true
                    }
                };
                head.next_try = now + rnr_timer(timer);
                (!retry).then_some(WcStatus::RnrRetryExceeded)
            }
            Outcome::NotReady => {
                let since = *head.not_ready_since.get_or_insert(now);
                head.next_try = now + NOT_READY_POLL;
                let expired = budget.is_some_and(|b| now.duration_since(since) >= b);
                (expired || !alive).then_some(WcStatus::RetryExceeded)
            }
            Outcome::Done { .. } => None,
        };
        match fail {
            Some(status) => {
                if let Some(p) = st.backlog.pop_front() {
                    self.complete_send(
                        &mut st.unsignaled,
                        p.wr_id,
                        p.opcode.wc_opcode(),
                        p.signaled,
                        status,
                        0,
                    );
                }
                self.enter_error(st);
                false
            }
            None => {
                let at = head.next_try;
                self.core.shared.schedule(at, self.weak.clone());
                true
            }
        }
    }

    /// Retry the backlog head(s) that are due.
    fn run_backlog(&self, st: &mut SqState) {
        loop {
            match self.state() {
                QpState::Error => {
                    self.flush_locked(st);
                    return;
                }
                QpState::Rts | QpState::Sqe => {}
                _ => return,
            }
            let now = Instant::now();
            let outcome = {
                let Some(head) = st.backlog.front() else {
                    return;
                };
                if head.next_try > now {
                    self.core.shared.schedule(head.next_try, self.weak.clone());
                    return;
                }
                let Some(remote) = st.remote.as_ref() else {
                    return;
                };
                execute(
                    &Initiator {
                        seg: self.seg(),
                        pd: self.pd,
                        qpn: self.qpn,
                        remote,
                        timeout: st.timeout,
                        retry_cnt: st.retry_cnt,
                    },
                    &Op {
                        opcode: head.opcode,
                        flags: head.flags,
                        sges: &head.sges,
                        inline: head.inline.as_deref(),
                    },
                )
            };
            match outcome {
                Outcome::Done { status, byte_len } => {
                    if let Some(p) = st.backlog.pop_front() {
                        self.complete_send(
                            &mut st.unsignaled,
                            p.wr_id,
                            p.opcode.wc_opcode(),
                            p.signaled,
                            status,
                            byte_len,
                        );
                    }
                    if !status.is_success() {
                        self.enter_error(st);
                        return;
                    }
                }
                other => {
                    self.after_attempt(st, other, now);
                    return;
                }
            }
        }
    }

    /// Timer expiry (service thread).
    pub(crate) fn progress(&self) {
        let mut st = self.sq.lock();
        self.run_backlog(&mut st);
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let (None, Some(rq)) = (&self.srq, &self.rq) else {
            return Err(PostError {
                index: 0,
                source: VerbsError::InvalidArgument("QP receives from an SRQ".into()),
            });
        };
        let state = self.state();
        if !state.accepts_recv() {
            return Err(PostError {
                index: 0,
                source: VerbsError::WrongState {
                    state,
                    what: "recv",
                },
            });
        }
        let ring = rq.ring();
        if wrs.len() > 1 {
            ring.prefetch_push_run(wrs.len());
        }
        for (index, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > self.caps.max_recv_sge.max(1) as usize
                || wr.sg_list.len() > MAX_SGE
            {
                return Err(PostError {
                    index,
                    source: VerbsError::InvalidArgument(format!(
                        "{} SGEs exceed max_recv_sge {}",
                        wr.sg_list.len(),
                        self.caps.max_recv_sge
                    )),
                });
            }
            if self.state() == QpState::Error {
                let c = CqEntry::new(
                    wr.wr_id,
                    WcStatus::WrFlushed,
                    WcOpcode::Recv,
                    0,
                    None,
                    self.qpn,
                    0,
                );
                self.recv_cq.push_local(c, false);
                continue;
            }
            let pushed = ring.push_limited(u64::from(self.caps.max_recv_wr), |p| {
                // SAFETY: `push_limited` hands over a claimed slot of the receive ring; the
                // SGE count was checked above.
                unsafe { RecvEntry::write_wr(p, wr) }
            });
            if pushed.is_err() {
                return Err(PostError {
                    index,
                    source: VerbsError::QueueFull,
                });
            }
        }
        if self.state() == QpState::Error {
            // Raced with a move to ERROR: whatever landed after the flush is flushed now.
            self.flush_rq();
        }
        Ok(())
    }

    fn query(&self) -> QpInfo {
        let st = self.sq.lock();
        QpInfo {
            qp_num: QpNum(self.qpn),
            state: self.state(),
            caps: self.caps,
            access: st.access,
            rnr_retry: st.rnr_retry,
            min_rnr_timer: st.min_rnr_timer,
            timeout: st.timeout,
            retry_cnt: st.retry_cnt,
            remote: st.remote.as_ref().map(|r| r.endpoint.clone()),
        }
    }
}

impl Drop for QpInner {
    fn drop(&mut self) {
        let sh = self.core.shared.clone();
        let slot = sh.seg.qp_slot(self.index);
        // Holds a dead peer left are not waited for (as in `modify`); the entry is then
        // quarantined like one a peer stayed in.
        let (stale, peer) = {
            let st = self.sq.lock();
            (
                st.stale_holds,
                st.remote.as_ref().map(|r| Arc::clone(&r.seg)),
            )
        };
        let dead = || peer.as_ref().is_some_and(|seg| !seg.owner_alive());
        let idle = stale == 0 && invalidate(&slot.qpn, &slot.active, dead);
        if stale > 0 {
            slot.qpn.store(0, Ordering::SeqCst);
        }
        slot.state
            .store(state_code(QpState::Reset), Ordering::SeqCst);
        sh.qps.lock().remove(&self.index);
        if idle {
            if let Some(rq) = &self.rq {
                rq.release(&sh.heap);
            }
            sh.qp_ids.lock().give(self.index);
        } else {
            tracing::warn!(
                qpn = self.qpn,
                "shm: peer still inside QP at destroy; entry quarantined"
            );
        }
    }
}

/// The provider object behind a `QueuePair`.
pub(crate) struct ShmQp {
    pub(crate) inner: Arc<QpInner>,
}

impl QpOps for ShmQp {
    fn qp_num(&self) -> QpNum {
        QpNum(self.inner.qpn)
    }
    fn state(&self) -> QpState {
        self.inner.state()
    }
    fn query(&self) -> QpInfo {
        self.inner.query()
    }
    fn endpoint(&self) -> QpEndpoint {
        self.inner.endpoint()
    }
    fn provider(&self) -> std::borrow::Cow<'static, str> {
        "shm".into()
    }
    fn modify(&self, attr: &QpAttr) -> Result<()> {
        self.inner.modify(attr)
    }
    #[inline]
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        self.inner.post_send(wrs)
    }
    #[inline]
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.inner.post_recv(wrs)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
