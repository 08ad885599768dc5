//! The data path: executing one send-queue work request against the connected QP, on the
//! initiator's CPU, at post time. Nothing here runs on the target's CPU, except atomics on
//! target memory that is not in a shared segment (see [`super::service`]).
//!
//! - WRITE / READ: look the rkey up in the target's MR table (mapped), check rights, bounds and
//!   PD, then copy: `memcpy` for segment memory, `process_vm_writev/readv` for private memory of
//!   another process. Every request holds the target QP's entry while it runs ([`target`]), so
//!   the owner's move of that QP to ERROR or RESET returns only after it.
//! - Atomics: a real `AtomicU64` CAS / fetch-add on the mapped word — atomic against every other
//!   atomic on that address from any process, and against the owner's CPU.
//! - SEND / SEND_IMM / WRITE_IMM: take a receive from the target's RQ or SRQ (a shared ring),
//!   scatter into its buffers, write the receive completion into the target's CQ, and signal it
//!   if armed. No receive → RNR, retried by the caller.
//!
//! Outcomes follow verbs: local SGE errors are `LocalProtection`; target-side access errors
//! `RemoteAccess`; misaligned atomics `RemoteInvalidRequest`; a receive too small gives the
//! target `LocalLength` and the initiator `RemoteInvalidRequest`; an unusable receive SGE gives
//! the target `LocalProtection` and the initiator `RemoteOperation` (both move the target QP to
//! ERROR); a target QP that is not connected to us (not yet RTR, or gone) is `NotReady`.

use std::mem::MaybeUninit;

use smallvec::SmallVec;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::cq::{push_remote, CqEntry};
use super::mrtable::{lookup, peek_own_segment, Guard, Loc};
use super::qp::{
    atomic_wait, decode_state, state_code, RawSge, RecvEntry, RemoteQp, MAX_INLINE, MAX_SGE,
};
use super::ring::{Ring, RingError};
use super::segment::{QpSlot, Segment, MAILBOX_SLOTS, QP_INDEX_BITS};
use super::sys;
use crate::provider::own_memory::vm_read;
use crate::{AccessFlags, QpState, SendFlags, Sge, WcOpcode, WcStatus, WrOpcode};

/// What happened to a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Finished (successfully or not): complete it.
    Done {
        /// Completion status.
        status: WcStatus,
        /// Bytes moved.
        byte_len: u32,
    },
    /// The target had no receive posted; retry after the target's RNR timer (code).
    Rnr {
        /// The target QP's min_rnr_timer code.
        timer: u8,
    },
    /// The target QP is not (yet) connected to us; retry until the transport timeout.
    NotReady,
}

impl Outcome {
    fn done(status: WcStatus, byte_len: u64) -> Outcome {
        Outcome::Done {
            status,
            byte_len: u32::try_from(byte_len).unwrap_or(u32::MAX),
        }
    }
}

/// One request, as executed.
pub(crate) struct Op<'a> {
    pub(crate) opcode: WrOpcode,
    pub(crate) flags: SendFlags,
    pub(crate) sges: &'a [Sge],
    /// The payload, already gathered, for INLINE requests.
    pub(crate) inline: Option<&'a [u8]>,
}

/// The initiator's side of an execution.
pub(crate) struct Initiator<'a> {
    /// Our segment (local lkeys).
    pub(crate) seg: &'a Segment,
    pub(crate) pd: u32,
    pub(crate) qpn: u32,
    pub(crate) remote: &'a RemoteQp,
    /// The QP's `timeout` and `retry_cnt`: bound the wait for a target-side atomic.
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
}

/// Memory pieces (at most [`MAX_SGE`]) with the MR holds that keep them registered. Held in
/// place without initialising the unused entries (an 8-byte SEND uses one of eight).
struct Pieces<'s> {
    locs: SmallVec<[(Loc, u64); MAX_SGE]>,
    total: u64,
    holds: SmallVec<[Guard<'s>; MAX_SGE]>,
}

impl<'s> Pieces<'s> {
    fn new() -> Self {
        Pieces {
            locs: SmallVec::new(),
            total: 0,
            holds: SmallVec::new(),
        }
    }

    fn push(&mut self, loc: Loc, len: u64, hold: Option<Guard<'s>>) -> bool {
        if self.locs.len() >= MAX_SGE {
            return false;
        }
        self.locs.push((loc, len));
        if let Some(h) = hold {
            self.holds.push(h);
        }
        self.total += len;
        true
    }

    fn list(&self) -> &[(Loc, u64)] {
        &self.locs
    }
}

/// Resolve SGEs against `seg`'s MR table into `p` (entries of length 0 are skipped, as verbs
/// does). Filled in place (`p` starts empty): a `Pieces` is a few hundred bytes, not worth
/// moving.
#[inline]
fn resolve<'s>(
    p: &mut Pieces<'s>,
    seg: &'s Segment,
    pd: u32,
    sges: &[Sge],
    need: AccessFlags,
) -> Option<()> {
    for s in sges {
        if s.length == 0 {
            continue;
        }
        let len = u64::from(s.length);
        let mr = lookup(seg, s.lkey.0)?;
        let loc = mr.locate(s.addr, len, need, pd)?;
        if !p.push(loc, len, Some(mr.into_guard())) {
            return None;
        }
    }
    Some(())
}

#[inline]
fn resolve_raw<'s>(p: &mut Pieces<'s>, seg: &'s Segment, pd: u32, sges: &[RawSge]) -> Option<()> {
    for s in sges {
        if s.length == 0 {
            continue;
        }
        let len = u64::from(s.length);
        let mr = lookup(seg, s.lkey)?;
        let loc = mr.locate(s.addr, len, AccessFlags::LOCAL_WRITE, pd)?;
        if !p.push(loc, len, Some(mr.into_guard())) {
            return None;
        }
    }
    Some(())
}

/// Gather an INLINE payload at post time into `buf`: `prefix` (the request's inline data),
/// then the SGEs. SGEs inside a registered region are copied directly; others are read
/// through the kernel (`process_vm_readv` on ourselves), so a bad address is a
/// `LocalProtection` completion rather than a crash.
pub(crate) fn gather_inline<'b>(
    seg: &Segment,
    pd: u32,
    prefix: &[u8],
    sges: &[Sge],
    buf: &'b mut [MaybeUninit<u8>; MAX_INLINE],
) -> Result<&'b [u8], WcStatus> {
    if prefix.len() > MAX_INLINE {
        return Err(WcStatus::LocalLength);
    }
    for (d, s) in buf.iter_mut().zip(prefix) {
        d.write(*s);
    }
    let mut at = prefix.len();
    for s in sges {
        let len = s.length as usize;
        if len == 0 {
            continue;
        }
        let end = at
            .checked_add(len)
            .filter(|e| *e <= MAX_INLINE)
            .ok_or(WcStatus::LocalLength)?;
        let dst = &mut buf[at..end];
        let dst_ptr = dst.as_mut_ptr().cast::<u8>();
        if let Some(p) = peek_own_segment(seg, s.lkey.0, s.addr, len as u64, pd) {
            // SAFETY: `p` covers `len` bytes of our own segment's mapping (bounds-checked by
            // `peek_own_segment`), which stays mapped while `seg` lives; `dst` is a distinct
            // stack buffer of `len` bytes.
            unsafe {
                if len <= 16 {
                    small_move(p, dst_ptr, len);
                } else {
                    std::ptr::copy_nonoverlapping(p, dst_ptr, len);
                }
            }
            at = end;
            continue;
        }
        let direct = lookup(seg, s.lkey.0).and_then(|mr| {
            mr.locate(s.addr, len as u64, AccessFlags::empty(), pd)
                .map(|loc| (mr, loc))
        });
        match direct {
            Some((_hold, Loc::Direct(p))) => {
                // SAFETY: `p` covers `len` bytes of a region registered in our MR table, held
                // by `_hold`; `dst` is a distinct stack buffer of `len` bytes.
                unsafe { std::ptr::copy_nonoverlapping(p, dst_ptr, len) };
            }
            _ => vm_read(sys::getpid(), s.addr, dst_ptr, len)
                .map_err(|_| WcStatus::LocalProtection)?,
        }
        at = end;
    }
    // SAFETY: every byte of `buf[..at]` was written above (the pieces are contiguous from 0),
    // and `MaybeUninit<u8>` has the layout of `u8`.
    Ok(unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), at) })
}

/// `memmove` of `n <= 16` bytes without a call: every byte is loaded before any is stored
/// (two possibly overlapping words from each end), so overlapping ranges are fine.
///
/// # Safety
/// `s` is valid for reads and `d` for writes of `n` bytes.
#[inline(always)]
unsafe fn small_move(s: *const u8, d: *mut u8, n: usize) {
    // SAFETY: every access below lies in `[0, n)` of its range (the caller's promise), and
    // unaligned reads/writes of plain integers are allowed anywhere in valid memory.
    unsafe {
        if n >= 8 {
            let (a, b) = (
                s.cast::<u64>().read_unaligned(),
                s.add(n - 8).cast::<u64>().read_unaligned(),
            );
            d.cast::<u64>().write_unaligned(a);
            d.add(n - 8).cast::<u64>().write_unaligned(b);
        } else if n >= 4 {
            let (a, b) = (
                s.cast::<u32>().read_unaligned(),
                s.add(n - 4).cast::<u32>().read_unaligned(),
            );
            d.cast::<u32>().write_unaligned(a);
            d.add(n - 4).cast::<u32>().write_unaligned(b);
        } else if n > 0 {
            let (a, m, b) = (s.read(), s.add(n / 2).read(), s.add(n - 1).read());
            d.write(a);
            d.add(n / 2).write(m);
            d.add(n - 1).write(b);
        }
    }
}

enum CopyError {
    Fault,
    PeerGone,
}

#[inline]
fn copy_chunk(src: Loc, so: u64, dst: Loc, doff: u64, n: u64) -> Result<(), CopyError> {
    let n_us = usize::try_from(n).map_err(|_| CopyError::Fault)?;
    let map = |e: std::io::Error| {
        if e.raw_os_error() == Some(libc::ESRCH) {
            CopyError::PeerGone
        } else {
            CopyError::Fault
        }
    };
    match (src, dst) {
        (Loc::Direct(s), Loc::Direct(d)) => {
            // SAFETY: both pieces were resolved through MR tables — entries held for the
            // duration of the copy, or (a source in our own segment) mapped for the segment's
            // life: each covers at least `offset + n` bytes of memory that is mapped in this
            // process (our own registered memory, or our mapping of a peer's segment).
            // Regions may overlap (a READ of our own region): both copies have memmove
            // semantics.
            unsafe {
                let (s, d) = (s.add(so as usize), d.add(doff as usize));
                if n_us <= 16 {
                    small_move(s, d, n_us);
                } else {
                    std::ptr::copy(s, d, n_us);
                }
            }
            Ok(())
        }
        (Loc::Direct(s), Loc::Remote { pid, addr }) => sys::vm_write(
            pid,
            s.wrapping_add(so as usize),
            addr.wrapping_add(doff),
            n_us,
        )
        .map_err(map),
        (Loc::Remote { pid, addr }, Loc::Direct(d)) => vm_read(
            pid,
            addr.wrapping_add(so),
            d.wrapping_add(doff as usize),
            n_us,
        )
        .map_err(map),
        (Loc::Remote { .. }, Loc::Remote { .. }) => Err(CopyError::Fault),
    }
}

/// Copy `min(src total, dst total)` bytes from the `src` pieces to the `dst` pieces.
#[inline]
fn transfer(src: &[(Loc, u64)], dst: &[(Loc, u64)]) -> Result<(), CopyError> {
    let (mut si, mut so, mut di, mut doff) = (0usize, 0u64, 0usize, 0u64);
    while si < src.len() && di < dst.len() {
        let (sl, slen) = src[si];
        let (dl, dlen) = dst[di];
        let n = (slen - so).min(dlen - doff);
        if n > 0 {
            copy_chunk(sl, so, dl, doff, n)?;
        }
        so += n;
        doff += n;
        if so == slen {
            si += 1;
            so = 0;
        }
        if doff == dlen {
            di += 1;
            doff = 0;
        }
    }
    Ok(())
}

fn copy_status(e: CopyError) -> WcStatus {
    match e {
        CopyError::Fault => WcStatus::RemoteAccess,
        CopyError::PeerGone => WcStatus::RetryExceeded,
    }
}

/// The target QP entry if it is live, connected back to us, and accepting requests, held
/// until the guard drops; `Err(outcome)` says how to finish instead: not ready yet, or the
/// target process is gone.
///
/// The hold keeps the entry's rings from being freed while a receive is consumed, and it is
/// what a `modify` of the target out of RTR/RTS waits for (`QpInner::modify`): once the
/// target's owner has moved its QP to ERROR or RESET, no READ, WRITE or atomic that began
/// through it is still copying, so the memory behind it may be handed to something else.
#[inline]
fn target<'t>(ini: &Initiator<'t>) -> Result<(Guard<'t>, &'t QpSlot), Outcome> {
    let tseg: &'t Segment = &ini.remote.seg;
    if !tseg.owner_alive_fast() {
        return Err(Outcome::done(WcStatus::RetryExceeded, 0));
    }
    target_qp(ini).ok_or(Outcome::NotReady)
}

#[inline]
fn target_qp<'t>(ini: &Initiator<'t>) -> Option<(Guard<'t>, &'t QpSlot)> {
    let tseg: &'t Segment = &ini.remote.seg;
    let tqpn = ini.remote.qpn;
    let slot = tseg.qp_slot(tqpn & ((1 << QP_INDEX_BITS) - 1));
    let guard = Guard::enter(&slot.active, &slot.qpn, tqpn)?;
    // SeqCst, after the guard's SeqCst increment: either the owner's move out of RTR/RTS is
    // seen here, or the owner sees the guard and waits for it.
    let state = decode_state(slot.state.load(Ordering::SeqCst));
    if !matches!(
        state,
        QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
    ) {
        return None;
    }
    if slot.remote_nonce.load(Ordering::Acquire) != ini.seg.nonce
        || slot.remote_qpn.load(Ordering::Acquire) != ini.qpn
    {
        return None;
    }
    Some((guard, slot))
}

/// Move a target QP to ERROR after a responder-side error; its owner flushes it.
fn fail_target(tseg: &Segment, slot: &QpSlot) {
    let mut cur = slot.state.load(Ordering::Acquire);
    loop {
        let st = decode_state(cur);
        if matches!(st, QpState::Error | QpState::Reset) {
            return;
        }
        match slot.state.compare_exchange(
            cur,
            state_code(QpState::Error),
            Ordering::SeqCst,
            Ordering::Acquire,
        ) {
            Ok(_) => break,
            Err(actual) => cur = actual,
        }
    }
    slot.needs_flush.store(1, Ordering::SeqCst);
    tseg.kick();
}

fn target_access(slot: &QpSlot) -> AccessFlags {
    AccessFlags::from_bits_truncate(slot.access.load(Ordering::Relaxed))
}

/// Execute `op` now.
pub(crate) fn execute(ini: &Initiator<'_>, op: &Op<'_>) -> Outcome {
    match op.opcode {
        WrOpcode::Write { remote } => write(ini, op, remote.addr, remote.rkey.0),
        WrOpcode::Read { remote } => read(ini, op, remote.addr, remote.rkey.0),
        WrOpcode::AtomicCmpSwp {
            remote,
            compare,
            swap,
        } => atomic(
            ini,
            op,
            remote.addr,
            remote.rkey.0,
            AtomicOp::Cas { compare, swap },
        ),
        WrOpcode::AtomicFetchAdd { remote, add } => {
            atomic(ini, op, remote.addr, remote.rkey.0, AtomicOp::Add(add))
        }
        WrOpcode::Send => deliver(ini, op, None, None),
        WrOpcode::SendWithImm { imm } => deliver(ini, op, Some(imm), None),
        WrOpcode::WriteWithImm { remote, imm } => {
            deliver(ini, op, Some(imm), Some((remote.addr, remote.rkey.0)))
        }
    }
}

/// The payload pieces of a SEND/WRITE, into `p`: the inline copy or the local SGEs.
#[inline]
fn source<'s>(p: &mut Pieces<'s>, ini: &Initiator<'s>, op: &Op<'_>) -> Option<()> {
    match op.inline {
        Some(bytes) => {
            if !bytes.is_empty() {
                p.push(
                    Loc::Direct(bytes.as_ptr() as *mut u8),
                    bytes.len() as u64,
                    None,
                );
            }
            Some(())
        }
        None => {
            for s in op.sges {
                if s.length == 0 {
                    continue;
                }
                let len = u64::from(s.length);
                // Our own segment memory is read without a hold (see `peek_own_segment`);
                // anything else is looked up and held.
                let ok = match peek_own_segment(ini.seg, s.lkey.0, s.addr, len, ini.pd) {
                    Some(ptr) => p.push(Loc::Direct(ptr as *mut u8), len, None),
                    None => {
                        let mr = lookup(ini.seg, s.lkey.0)?;
                        let loc = mr.locate(s.addr, len, AccessFlags::empty(), ini.pd)?;
                        p.push(loc, len, Some(mr.into_guard()))
                    }
                };
                if !ok {
                    return None;
                }
            }
            Some(())
        }
    }
}

fn write(ini: &Initiator<'_>, op: &Op<'_>, raddr: u64, rkey: u32) -> Outcome {
    let mut src = Pieces::new();
    if source(&mut src, ini, op).is_none() {
        return Outcome::done(WcStatus::LocalProtection, 0);
    }
    let (_hold, tslot) = match target(ini) {
        Ok(t) => t,
        Err(outcome) => return outcome,
    };
    if src.total == 0 {
        return Outcome::done(WcStatus::Success, 0);
    }
    if !target_access(tslot).contains(AccessFlags::REMOTE_WRITE) {
        return Outcome::done(WcStatus::RemoteAccess, 0);
    }
    let tpd = tslot.pd.load(Ordering::Relaxed);
    let Some(mr) = lookup(&ini.remote.seg, rkey) else {
        return Outcome::done(WcStatus::RemoteAccess, 0);
    };
    let Some(dst) = mr.locate(raddr, src.total, AccessFlags::REMOTE_WRITE, tpd) else {
        return Outcome::done(WcStatus::RemoteAccess, 0);
    };
    match transfer(src.list(), &[(dst, src.total)]) {
        Ok(()) => Outcome::done(WcStatus::Success, src.total),
        Err(e) => Outcome::done(copy_status(e), 0),
    }
}

fn read(ini: &Initiator<'_>, op: &Op<'_>, raddr: u64, rkey: u32) -> Outcome {
    let mut dst = Pieces::new();
    if resolve(&mut dst, ini.seg, ini.pd, op.sges, AccessFlags::LOCAL_WRITE).is_none() {
        return Outcome::done(WcStatus::LocalProtection, 0);
    }
    let (_hold, tslot) = match target(ini) {
        Ok(t) => t,
        Err(outcome) => return outcome,
    };
    if dst.total == 0 {
        return Outcome::done(WcStatus::Success, 0);
    }
    if !target_access(tslot).contains(AccessFlags::REMOTE_READ) {
        return Outcome::done(WcStatus::RemoteAccess, 0);
    }
    let tpd = tslot.pd.load(Ordering::Relaxed);
    let Some(mr) = lookup(&ini.remote.seg, rkey) else {
        return Outcome::done(WcStatus::RemoteAccess, 0);
    };
    let Some(src) = mr.locate(raddr, dst.total, AccessFlags::REMOTE_READ, tpd) else {
        return Outcome::done(WcStatus::RemoteAccess, 0);
    };
    match transfer(&[(src, dst.total)], dst.list()) {
        Ok(()) => Outcome::done(WcStatus::Success, dst.total),
        Err(e) => Outcome::done(copy_status(e), 0),
    }
}

#[derive(Clone, Copy)]
enum AtomicOp {
    Cas { compare: u64, swap: u64 },
    Add(u64),
}

fn atomic(ini: &Initiator<'_>, op: &Op<'_>, raddr: u64, rkey: u32, aop: AtomicOp) -> Outcome {
    let mut dst = Pieces::new();
    if resolve(&mut dst, ini.seg, ini.pd, op.sges, AccessFlags::LOCAL_WRITE).is_none() {
        return Outcome::done(WcStatus::LocalProtection, 0);
    }
    let Some((Loc::Direct(result_ptr), 8)) = dst.list().first().copied() else {
        return Outcome::done(WcStatus::LocalProtection, 0);
    };
    let (hold, tslot) = match target(ini) {
        Ok(t) => t,
        Err(outcome) => return outcome,
    };
    if raddr % 8 != 0 {
        return Outcome::done(WcStatus::RemoteInvalidRequest, 0);
    }
    if !target_access(tslot).contains(AccessFlags::REMOTE_ATOMIC) {
        return Outcome::done(WcStatus::RemoteAccess, 0);
    }
    let tpd = tslot.pd.load(Ordering::Relaxed);
    let Some(mr) = lookup(&ini.remote.seg, rkey) else {
        return Outcome::done(WcStatus::RemoteAccess, 0);
    };
    let original = match mr.locate(raddr, 8, AccessFlags::REMOTE_ATOMIC, tpd) {
        None => return Outcome::done(WcStatus::RemoteAccess, 0),
        Some(Loc::Direct(p)) => {
            if (p as usize) % 8 != 0 {
                return Outcome::done(WcStatus::RemoteInvalidRequest, 0);
            }
            // SAFETY: `p` is 8-byte aligned (checked) and covers 8 bytes of a registered region
            // held by `mr` (our memory, or our mapping of the target's segment). Every access
            // to it by providers is atomic, as with a NIC; an `AtomicU64` over shared memory is
            // atomic against other processes' atomics on the same physical word.
            let word = unsafe { &*(p as *const AtomicU64) };
            match aop {
                AtomicOp::Cas { compare, swap } => {
                    match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                        Ok(v) | Err(v) => v,
                    }
                }
                AtomicOp::Add(add) => word.fetch_add(add, Ordering::SeqCst),
            }
        }
        Some(Loc::Remote { .. }) => {
            // The target's service does it: nothing of ours runs on its memory meanwhile, and
            // a `modify` of the target need not wait for its own service to answer us.
            drop(mr);
            drop(hold);
            match mailbox_atomic(ini, rkey, tpd, raddr, aop) {
                Ok(v) => v,
                Err(status) => return Outcome::done(status, 0),
            }
        }
    };
    let bytes = original.to_ne_bytes();
    // SAFETY: `result_ptr` is our own registered memory of exactly 8 bytes with LOCAL_WRITE,
    // held by `dst`.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), result_ptr, 8) };
    Outcome::done(WcStatus::Success, 8)
}

/// Mailbox protocol states (see `service`).
pub(crate) const MB_FREE: u32 = 0;
pub(crate) const MB_CLAIMED: u32 = 1;
pub(crate) const MB_REQUEST: u32 = 2;
pub(crate) const MB_SERVING: u32 = 3;
pub(crate) const MB_DONE: u32 = 4;
pub(crate) const MB_ABANDONED: u32 = 5;
/// Mailbox op codes.
pub(crate) const MB_OP_CAS: u32 = 1;
pub(crate) const MB_OP_ADD: u32 = 2;
/// Mailbox result codes.
pub(crate) const MB_OK: u32 = 0;
pub(crate) const MB_ACCESS: u32 = 1;
pub(crate) const MB_INVALID: u32 = 2;

/// Ask the target's service thread to run an atomic on its private memory and wait for it.
fn mailbox_atomic(
    ini: &Initiator<'_>,
    rkey: u32,
    pd: u32,
    addr: u64,
    aop: AtomicOp,
) -> Result<u64, WcStatus> {
    let tseg: &Segment = &ini.remote.seg;
    let deadline = Instant::now() + atomic_wait(ini.timeout, ini.retry_cnt);
    let start = (rand::random::<u32>()) % MAILBOX_SLOTS;
    let mut spins = 0u32;
    let slot = 'claim: loop {
        for i in 0..MAILBOX_SLOTS {
            let s = tseg.mailbox_slot(start + i);
            if s.state
                .compare_exchange(MB_FREE, MB_CLAIMED, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                break 'claim s;
            }
        }
        spins += 1;
        if Instant::now() > deadline || !tseg.owner_alive() {
            return Err(WcStatus::RetryExceeded);
        }
        if spins % 16 == 0 {
            std::thread::yield_now();
        }
    };
    let (op, compare, operand) = match aop {
        AtomicOp::Cas { compare, swap } => (MB_OP_CAS, compare, swap),
        AtomicOp::Add(add) => (MB_OP_ADD, 0, add),
    };
    slot.op.store(op, Ordering::Relaxed);
    slot.rkey.store(rkey, Ordering::Relaxed);
    slot.pd.store(pd, Ordering::Relaxed);
    slot.addr.store(addr, Ordering::Relaxed);
    slot.compare.store(compare, Ordering::Relaxed);
    slot.operand.store(operand, Ordering::Relaxed);
    slot.state.store(MB_REQUEST, Ordering::Release);
    tseg.kick();
    let mut spins = 0u32;
    loop {
        if slot.state.load(Ordering::Acquire) == MB_DONE {
            let status = slot.status.load(Ordering::Relaxed);
            let result = slot.result.load(Ordering::Relaxed);
            slot.state.store(MB_FREE, Ordering::Release);
            return match status {
                MB_OK => Ok(result),
                MB_INVALID => Err(WcStatus::RemoteInvalidRequest),
                _ => Err(WcStatus::RemoteAccess),
            };
        }
        spins += 1;
        if spins % 256 == 0 {
            // A request already being served is answered moments later: keep waiting then.
            if (Instant::now() > deadline || !tseg.owner_alive())
                && slot
                    .state
                    .compare_exchange(
                        MB_REQUEST,
                        MB_ABANDONED,
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                return Err(WcStatus::RetryExceeded);
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// How far past the next receive a sender prefetches a peer's RQ/SRQ ring slot.
const RQ_PREFETCH_AHEAD: u64 = 1;

/// Pop one receive from a target's RQ/SRQ ring, reading only the SGEs it uses, and start
/// fetching the slot the next send will take while this one is being delivered.
#[inline]
fn take_receive(ring: &Ring<'_, RecvEntry>, into: &mut RecvEntry) -> Result<Option<()>, RingError> {
    let got = ring.pop_with(|p| {
        // SAFETY: `pop_with` hands over the claimed slot of a receive ring.
        unsafe { RecvEntry::read_used(p, into) }
    });
    ring.prefetch_for_pop(RQ_PREFETCH_AHEAD);
    got
}

/// SEND, SEND_WITH_IMM and WRITE_WITH_IMM: consume a receive at the target.
fn deliver(
    ini: &Initiator<'_>,
    op: &Op<'_>,
    imm: Option<u32>,
    write_to: Option<(u64, u32)>,
) -> Outcome {
    let mut src = Pieces::new();
    if source(&mut src, ini, op).is_none() {
        return Outcome::done(WcStatus::LocalProtection, 0);
    }
    let (_hold, tslot) = match target(ini) {
        Ok(t) => t,
        Err(outcome) => return outcome,
    };
    let tseg: &Segment = &ini.remote.seg;
    let tpd = tslot.pd.load(Ordering::Relaxed);
    let tqpn = ini.remote.qpn;
    // WRITE_WITH_IMM: check the destination before consuming a receive.
    let write_dst = match write_to {
        Some((raddr, rkey)) if src.total > 0 => {
            if !target_access(tslot).contains(AccessFlags::REMOTE_WRITE) {
                return Outcome::done(WcStatus::RemoteAccess, 0);
            }
            let Some(mr) = lookup(tseg, rkey) else {
                return Outcome::done(WcStatus::RemoteAccess, 0);
            };
            let Some(loc) = mr.locate(raddr, src.total, AccessFlags::REMOTE_WRITE, tpd) else {
                return Outcome::done(WcStatus::RemoteAccess, 0);
            };
            Some((mr, loc))
        }
        _ => None,
    };
    let srq = tslot.srq.load(Ordering::Relaxed);
    // Filled in place: an entry is a few cache lines, not worth returning by value.
    let mut recv = RecvEntry::default();
    let popped = if srq != 0 {
        let s = tseg.srq_slot(srq);
        if s.live.load(Ordering::Acquire) == 0 {
            return Outcome::NotReady;
        }
        tseg.ring::<RecvEntry>(
            s.ring_off.load(Ordering::Relaxed),
            u64::from(s.cap.load(Ordering::Relaxed)),
        )
        .map(|r| take_receive(&r, &mut recv))
    } else {
        tseg.ring::<RecvEntry>(
            tslot.rq_off.load(Ordering::Relaxed),
            u64::from(tslot.rq_cap.load(Ordering::Relaxed)),
        )
        .map(|r| take_receive(&r, &mut recv))
    };
    match popped {
        Some(Ok(Some(()))) => {}
        Some(Ok(None)) | Some(Err(_)) => {
            return Outcome::Rnr {
                timer: (tslot.min_rnr_timer.load(Ordering::Relaxed) & 31) as u8,
            }
        }
        None => return Outcome::done(WcStatus::RemoteOperation, 0),
    }
    let recv_cq = tslot.recv_cq.load(Ordering::Relaxed);
    let solicited = op.flags.contains(SendFlags::SOLICITED);
    let recv_done = |status: WcStatus, opcode: WcOpcode, len: u64| {
        let e = CqEntry::new(
            recv.wr_id,
            status,
            opcode,
            u32::try_from(len).unwrap_or(u32::MAX),
            if status.is_success() { imm } else { None },
            tqpn,
            ini.qpn,
        );
        push_remote(tseg, recv_cq, e, solicited);
    };
    if let Some((_mr, dst)) = write_dst {
        return match transfer(src.list(), &[(dst, src.total)]) {
            Ok(()) => {
                recv_done(WcStatus::Success, WcOpcode::RecvRdmaWithImm, src.total);
                Outcome::done(WcStatus::Success, src.total)
            }
            Err(e) => {
                recv_done(WcStatus::RemoteAccess, WcOpcode::RecvRdmaWithImm, 0);
                fail_target(tseg, tslot);
                Outcome::done(copy_status(e), 0)
            }
        };
    }
    if write_to.is_some() {
        // Zero-length WRITE_WITH_IMM: only the immediate travels.
        recv_done(WcStatus::Success, WcOpcode::RecvRdmaWithImm, 0);
        return Outcome::done(WcStatus::Success, 0);
    }
    let nsge = (recv.num_sge as usize).min(MAX_SGE);
    let unusable = || {
        recv_done(WcStatus::LocalProtection, WcOpcode::Recv, 0);
        fail_target(tseg, tslot);
        Outcome::done(WcStatus::RemoteOperation, 0)
    };
    let too_small = || {
        recv_done(WcStatus::LocalLength, WcOpcode::Recv, 0);
        fail_target(tseg, tslot);
        Outcome::done(WcStatus::RemoteInvalidRequest, 0)
    };
    let copied = match (src.list(), &recv.sge[..nsge]) {
        // The usual shape (at most one piece into one receive buffer) without piece lists.
        ([] | [_], [one]) if one.length != 0 => {
            let len = u64::from(one.length);
            let Some(mr) = lookup(tseg, one.lkey) else {
                return unusable();
            };
            let Some(dst) = mr.locate(one.addr, len, AccessFlags::LOCAL_WRITE, tpd) else {
                return unusable();
            };
            if len < src.total {
                return too_small();
            }
            match src.list() {
                [(from, n)] => copy_chunk(*from, 0, dst, 0, *n),
                _ => Ok(()),
            }
        }
        (from, sges) => {
            let mut dst = Pieces::new();
            if resolve_raw(&mut dst, tseg, tpd, sges).is_none() {
                return unusable();
            }
            if dst.total < src.total {
                return too_small();
            }
            transfer(from, dst.list())
        }
    };
    match copied {
        Ok(()) => {
            recv_done(WcStatus::Success, WcOpcode::Recv, src.total);
            Outcome::done(WcStatus::Success, src.total)
        }
        Err(e) => {
            recv_done(WcStatus::LocalProtection, WcOpcode::Recv, 0);
            fail_target(tseg, tslot);
            Outcome::done(
                match e {
                    CopyError::PeerGone => WcStatus::RetryExceeded,
                    CopyError::Fault => WcStatus::RemoteOperation,
                },
                0,
            )
        }
    }
}
