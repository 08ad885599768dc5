//! The MR table in each context segment, read directly by every process that maps the segment:
//! key → (address, length, rights, PD, where the bytes live). No round trip to the owner.
//!
//! Keys: the low [`MR_INDEX_BITS`] bits select the table entry, the high bits are random and
//! change at every registration, so keys are neither sequential nor reusable by a stale holder.
//! `lkey == rkey` (as on mlx5 NICs); the rights decide what each may do.
//!
//! Immediate deregistration without locks: a user of an entry first announces itself
//! (`active += 1`, SeqCst), then checks the key (SeqCst). Deregistration clears the key
//! (SeqCst), then waits until `active` drains to 0. Either the user sees the cleared key and
//! backs off, or deregistration sees the user and waits for it to finish — so once
//! deregistration returns no access can touch the memory. A user that died with the count
//! raised would stall deregistration: after [`DRAIN_TIMEOUT`] the entry (and its segment pages)
//! are quarantined — never reused — instead of hanging.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::segment::{Segment, MR_INDEX_BITS};
use crate::AccessFlags;

/// The bytes live in the owner's segment heap (peers reach them through their mapping).
pub(crate) const MR_KIND_SEGMENT: u32 = 1;
/// The bytes are ordinary memory of the owner process (peers use cross-memory attach).
pub(crate) const MR_KIND_FOREIGN: u32 = 2;

/// Longest wait for in-flight accesses when an entry is invalidated.
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// The table index a key selects.
#[inline]
pub(crate) fn key_index(key: u32) -> u32 {
    key & ((1 << MR_INDEX_BITS) - 1)
}

/// Where bytes are, seen from this process.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Loc {
    /// Addressable here: our own memory or our mapping of a peer's segment.
    Direct(*mut u8),
    /// Private memory of another process.
    Remote {
        /// The process.
        pid: i32,
        /// Address in that process.
        addr: u64,
    },
}

/// Announced use of a table entry; dropping it ends the use.
pub(crate) struct Guard<'a> {
    active: &'a AtomicU32,
}

impl<'a> Guard<'a> {
    /// Enter the entry guarded by `active` if `key` still reads `want` (nonzero).
    #[inline]
    pub(crate) fn enter(active: &'a AtomicU32, key: &AtomicU32, want: u32) -> Option<Guard<'a>> {
        if want == 0 {
            return None;
        }
        active.fetch_add(1, Ordering::SeqCst);
        let guard = Guard { active };
        (key.load(Ordering::SeqCst) == want).then_some(guard)
    }
}

impl Drop for Guard<'_> {
    #[inline]
    fn drop(&mut self) {
        self.active.fetch_sub(1, Ordering::Release);
    }
}

/// Clear `key` and wait until no user is inside; false if users stayed past [`DRAIN_TIMEOUT`],
/// or while `dead()` says the only process that may still be inside has died.
pub(crate) fn invalidate(key: &AtomicU32, active: &AtomicU32, dead: impl Fn() -> bool) -> bool {
    key.store(0, Ordering::SeqCst);
    wait_holders(active, 0, dead) == Holders::Left
}

/// How [`wait_holders`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holders {
    /// Every hold above the floor ended.
    Left,
    /// Holds remain (this many in all) but the only process entitled to them died: they never
    /// end, and nothing of theirs runs any more.
    Dead(u32),
    /// Holds remain (this many in all) after [`DRAIN_TIMEOUT`].
    TimedOut(u32),
}

/// Wait until `active` reads at most `floor` (holds known to be left by a dead process), or
/// `dead()` says the process that may hold it is gone (asked every few hundred spins: it may
/// make a system call), or [`DRAIN_TIMEOUT`] passed.
pub(crate) fn wait_holders(active: &AtomicU32, floor: u32, dead: impl Fn() -> bool) -> Holders {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let n = active.load(Ordering::SeqCst);
        if n <= floor {
            return Holders::Left;
        }
        spins += 1;
        if spins % 128 == 0 {
            if dead() {
                return Holders::Dead(n);
            }
            if start.elapsed() > DRAIN_TIMEOUT {
                return Holders::TimedOut(n);
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// A registered region, looked up and held (it cannot be deregistered while this lives).
pub(crate) struct MrRef<'a> {
    _guard: Guard<'a>,
    seg: &'a Segment,
    addr: u64,
    len: u64,
    access: AccessFlags,
    pd: u32,
    kind: u32,
    seg_off: u64,
}

/// Look `key` up in `seg`'s MR table.
#[inline]
pub(crate) fn lookup(seg: &Segment, key: u32) -> Option<MrRef<'_>> {
    let slot = seg.mr_slot(key_index(key));
    let guard = Guard::enter(&slot.active, &slot.key, key)?;
    Some(MrRef {
        _guard: guard,
        seg,
        addr: slot.addr.load(Ordering::Relaxed),
        len: slot.len.load(Ordering::Relaxed),
        access: AccessFlags::from_bits_truncate(slot.access.load(Ordering::Relaxed)),
        pd: slot.pd.load(Ordering::Relaxed),
        kind: slot.kind.load(Ordering::Relaxed),
        seg_off: slot.seg_off.load(Ordering::Relaxed),
    })
}

impl<'a> MrRef<'a> {
    /// Keep only the hold (the entry stays registered while it lives).
    #[inline]
    pub(crate) fn into_guard(self) -> Guard<'a> {
        self._guard
    }

    /// Where `[addr, addr+len)` is, if it lies in the region, the region belongs to `pd` and
    /// grants `need`.
    #[inline]
    pub(crate) fn locate(&self, addr: u64, len: u64, need: AccessFlags, pd: u32) -> Option<Loc> {
        if self.pd != pd || !self.access.contains(need) {
            return None;
        }
        let end = addr.checked_add(len)?;
        if addr < self.addr || end > self.addr.checked_add(self.len)? {
            return None;
        }
        let delta = addr - self.addr;
        match self.kind {
            MR_KIND_SEGMENT => {
                let off = self.seg_off.checked_add(delta)?;
                self.seg.ptr(off, len).map(Loc::Direct)
            }
            MR_KIND_FOREIGN if self.seg.same_process() => {
                Some(Loc::Direct(addr as usize as *mut u8))
            }
            MR_KIND_FOREIGN => Some(Loc::Remote {
                pid: self.seg.pid,
                addr,
            }),
            _ => None,
        }
    }
}

/// Where `[addr, addr+len)` of the region `key` is, for reading it as a local source (a
/// SEND/WRITE payload or an INLINE gather), without announcing the use: `Some` only for
/// memory of our **own** segment's heap that lies in the region, belongs to `pd`, and `key`
/// names a live registration when looked at.
///
/// No guard is needed for that case: the segment stays mapped for the context's life, so the
/// read never faults even if the region is deregistered (and its pages hole-punched or
/// reused) while it runs — a race the caller created with its own deregistration, which can
/// at worst send stale bytes of its own memory. Fields read concurrently with a
/// re-registration may be mixed, but `Segment::ptr` bounds whatever they say to the mapping.
/// Foreign (`reg_mr`) memory could be unmapped by its owner after deregistration: it takes
/// the guarded [`lookup`].
#[inline]
pub(crate) fn peek_own_segment(
    seg: &Segment,
    key: u32,
    addr: u64,
    len: u64,
    pd: u32,
) -> Option<*const u8> {
    if key == 0 || !seg.is_local() {
        return None;
    }
    let slot = seg.mr_slot(key_index(key));
    // Acquire: pairs with the publishing store of the key, so the fields below are at least
    // those of this registration.
    if slot.key.load(Ordering::Acquire) != key
        || slot.kind.load(Ordering::Relaxed) != MR_KIND_SEGMENT
        || slot.pd.load(Ordering::Relaxed) != pd
    {
        return None;
    }
    let base = slot.addr.load(Ordering::Relaxed);
    let rlen = slot.len.load(Ordering::Relaxed);
    let end = addr.checked_add(len)?;
    if addr < base || end > base.checked_add(rlen)? {
        return None;
    }
    let off = slot
        .seg_off
        .load(Ordering::Relaxed)
        .checked_add(addr - base)?;
    seg.ptr(off, len).map(|p| p as *const u8)
}

/// What a registration publishes.
pub(crate) struct MrEntry {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: AccessFlags,
    pub(crate) pd: u32,
    pub(crate) kind: u32,
    pub(crate) seg_off: u64,
}

/// Fill entry `index` of our table and publish it under a fresh key; returns the key.
pub(crate) fn publish(seg: &Segment, index: u32, e: &MrEntry) -> u32 {
    let slot = seg.mr_slot(index);
    let previous_tag = slot.last_tag.load(Ordering::Relaxed);
    let tag = super::segment::fresh_tag(32 - MR_INDEX_BITS, previous_tag);
    slot.last_tag.store(tag, Ordering::Relaxed);
    let key = (tag << MR_INDEX_BITS) | key_index(index);
    slot.addr.store(e.addr, Ordering::Relaxed);
    slot.len.store(e.len, Ordering::Relaxed);
    slot.access.store(e.access.bits(), Ordering::Relaxed);
    slot.pd.store(e.pd, Ordering::Relaxed);
    slot.kind.store(e.kind, Ordering::Relaxed);
    slot.seg_off.store(e.seg_off, Ordering::Relaxed);
    slot.key.store(key, Ordering::SeqCst);
    key
}
