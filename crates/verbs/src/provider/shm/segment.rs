//! Context segments: the one memfd per opened `shm0` context that holds everything a peer
//! process touches — the header, the MR/QP/CQ/SRQ tables, the atomic mailbox, and a heap for
//! rings and `alloc_mr` memory — and the mappings of peers' segments.
//!
//! Layout (offsets from the segment start, fixed by [`VERSION`]):
//!
//! ```text
//! 0          Header (magic, version, pid, nonce, fds)
//! 4 KiB      Mailbox: MAILBOX_SLOTS × 64 B   (atomics on non-shared memory, see `service`)
//! 8 KiB      QP table: MAX_QP × 192 B
//! ...        CQ table: MAX_CQ × 64 B
//! ...        SRQ table: MAX_SRQ × 64 B
//! ...        MR table: MAX_MR × 64 B
//! HEAP_OFF   heap (page granular): rings, alloc_mr memory
//! SEG_SIZE   end (64 GiB of address space; pages exist only once touched)
//! ```
//!
//! A peer finds a segment by `(pid, fd number, nonce)`: it duplicates the memfd with
//! `pidfd_getfd`, checks that its size is sealed to [`SEG_SIZE`] (so the owner can never
//! truncate it under the peer's feet), maps it, and checks magic, version, pid and nonce. The
//! same pidfd later tells the peer when the owner dies. Mappings are shared per process through
//! a registry keyed by nonce, so each segment is mapped at most once per process.
//!
//! Everything read from a segment is untrusted: table indices are masked, offsets and lengths
//! are bounds-checked by [`Segment::ptr`] before any access.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::ring::{ring_bytes, Cell, Ring, RingHead};
use super::sys;
use crate::{Result, VerbsError};

/// Bytes of address space a segment spans: 64 GiB, or `1 << FABRIQ_SHM_SEGMENT_BITS` when that
/// variable is set at build time (28 ..= 40): an instruction counter such as valgrind maps only
/// a few tens of GiB (`bench/instructions.sh`). Processes that share segments must agree on it
/// (an import checks the size).
pub(crate) const SEG_SIZE: u64 = 1 << segment_bits(option_env!("FABRIQ_SHM_SEGMENT_BITS"));

/// The segment size's bits from the build-time setting (a bad one fails the build).
const fn segment_bits(setting: Option<&str>) -> u32 {
    let Some(s) = setting else {
        return 36;
    };
    let b = s.as_bytes();
    let mut i = 0;
    let mut bits = 0u32;
    while i < b.len() {
        assert!(
            b[i].is_ascii_digit() && i < 2,
            "FABRIQ_SHM_SEGMENT_BITS: a number of bits"
        );
        bits = bits * 10 + (b[i] - b'0') as u32;
        i += 1;
    }
    assert!(
        bits >= 28 && bits <= 40,
        "FABRIQ_SHM_SEGMENT_BITS must be in 28..=40"
    );
    bits
}
/// Segment magic, "FABRQSHM".
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"FABRQSHM");
/// Layout version.
pub(crate) const VERSION: u32 = 1;
/// Page size of the heap.
pub(crate) const PAGE: u64 = 4096;

/// QP table entries (index 0 unused, so no QP number is 0).
pub(crate) const MAX_QP: u32 = 4096;
/// CQ table entries (index 0 unused).
pub(crate) const MAX_CQ: u32 = 4096;
/// SRQ table entries (index 0 unused).
pub(crate) const MAX_SRQ: u32 = 1024;
/// MR table entries (index 0 unused). Keys carry the index in their low bits.
pub(crate) const MAX_MR: u32 = 1 << MR_INDEX_BITS;
/// Bits of an lkey/rkey that select the MR table entry; the rest are random.
pub(crate) const MR_INDEX_BITS: u32 = 14;
/// Bits of a QP number that select the QP table entry; the rest are random.
pub(crate) const QP_INDEX_BITS: u32 = 12;
/// Atomic mailbox slots.
pub(crate) const MAILBOX_SLOTS: u32 = 64;

const HEADER_OFF: u64 = 0;
const MAILBOX_OFF: u64 = 4096;
const QP_TABLE_OFF: u64 = MAILBOX_OFF + MAILBOX_SLOTS as u64 * 64;
const CQ_TABLE_OFF: u64 = QP_TABLE_OFF + MAX_QP as u64 * QP_STRIDE;
/// Bytes per QP table entry: read-mostly line, peer-written line, owner line.
const QP_STRIDE: u64 = 192;
const SRQ_TABLE_OFF: u64 = CQ_TABLE_OFF + MAX_CQ as u64 * 64;
const MR_TABLE_OFF: u64 = SRQ_TABLE_OFF + MAX_SRQ as u64 * 64;
/// Start of the heap, 2 MiB aligned.
pub(crate) const HEAP_OFF: u64 = (MR_TABLE_OFF + MAX_MR as u64 * 64).next_multiple_of(2 << 20);

/// The first bytes of a segment.
#[repr(C)]
pub(crate) struct Header {
    pub(crate) magic: AtomicU64,
    pub(crate) version: AtomicU32,
    pub(crate) pid: AtomicU32,
    pub(crate) nonce: AtomicU64,
    pub(crate) seg_size: AtomicU64,
    /// The owner's doorbell eventfd number (wakes its service thread).
    pub(crate) doorbell_fd: AtomicU32,
    /// 1 once the owning context is gone.
    pub(crate) closed: AtomicU32,
    /// 1 when the liveness mutex's lock word holds the owner thread's id while it lives (checked
    /// at start-up; glibc), so peers may read it.
    pub(crate) liveness_ok: AtomicU32,
}

/// Offset of the liveness mutex: a process-shared robust `pthread_mutex_t` that the owner's
/// service thread holds for the context's life. When the owner dies, the kernel's robust-futex
/// exit handling rewrites its lock word (owner id cleared, `FUTEX_OWNER_DIED` set) before the
/// process can be reaped — so a peer learns of the death with one load, no system call.
const LIVENESS_OFF: u64 = 256;
/// Thread-id bits of a futex word.
const FUTEX_TID_MASK: u32 = 0x3fff_ffff;

/// One QP table entry. Line 0 is read by peers on every operation, line 1 written by them,
/// line 2 is the owner's.
#[repr(C, align(64))]
pub(crate) struct QpSlot {
    /// The QP number while the entry is live, 0 when free.
    pub(crate) qpn: AtomicU32,
    /// `QpState` as `state_code`.
    pub(crate) state: AtomicU32,
    /// Remote access rights (`AccessFlags` bits).
    pub(crate) access: AtomicU32,
    pub(crate) pd: AtomicU32,
    pub(crate) min_rnr_timer: AtomicU32,
    /// CQ table index of the receive CQ.
    pub(crate) recv_cq: AtomicU32,
    /// SRQ table index, 0 for a private receive queue.
    pub(crate) srq: AtomicU32,
    /// Offset of the private receive ring, 0 with an SRQ.
    pub(crate) rq_off: AtomicU64,
    pub(crate) rq_cap: AtomicU32,
    /// The connected remote QP number (0 until RTR).
    pub(crate) remote_qpn: AtomicU32,
    /// The connected remote segment's nonce.
    pub(crate) remote_nonce: AtomicU64,
    /// 1 when a peer moved this QP to ERROR and the owner still has to flush it.
    pub(crate) needs_flush: AtomicU32,
    _pad0: [u32; 1],
    /// Peer operations in flight on this QP (see `mrtable::Guard`); on its own line, the
    /// only word of the entry peers write on the fast path.
    pub(crate) active: AtomicU32,
    _pad1: [u32; 15],
    /// Send-queue slots released by polled completions (owner only).
    pub(crate) sq_polled: AtomicU64,
    _pad2: [u64; 7],
}

/// One CQ table entry.
#[repr(C, align(64))]
pub(crate) struct CqSlot {
    /// Nonzero while the CQ exists.
    pub(crate) live: AtomicU32,
    pub(crate) cap: AtomicU32,
    pub(crate) ring_off: AtomicU64,
    /// 0 unarmed, 1 armed for any completion, 2 armed for solicited ones.
    pub(crate) armed: AtomicU32,
    /// 1 when a peer produced a completion for an armed CQ and the owner must signal its fd.
    pub(crate) notify_pending: AtomicU32,
    /// 1 once a completion was lost.
    pub(crate) overflow: AtomicU32,
}

/// One SRQ table entry.
#[repr(C, align(64))]
pub(crate) struct SrqSlot {
    pub(crate) live: AtomicU32,
    pub(crate) cap: AtomicU32,
    pub(crate) ring_off: AtomicU64,
    pub(crate) pd: AtomicU32,
}

/// One MR table entry; see `mrtable`.
#[repr(C, align(64))]
pub(crate) struct MrSlot {
    /// The key while registered, 0 when free.
    pub(crate) key: AtomicU32,
    /// Accesses in flight.
    pub(crate) active: AtomicU32,
    pub(crate) access: AtomicU32,
    pub(crate) pd: AtomicU32,
    /// `MR_KIND_SEGMENT` or `MR_KIND_FOREIGN`.
    pub(crate) kind: AtomicU32,
    /// Random tag of the previous key (so a new key never repeats it).
    pub(crate) last_tag: AtomicU32,
    /// Start address in the owner's address space.
    pub(crate) addr: AtomicU64,
    pub(crate) len: AtomicU64,
    /// For segment memory: offset of `addr` in the segment.
    pub(crate) seg_off: AtomicU64,
}

/// One atomic mailbox entry; see `service`.
#[repr(C, align(64))]
pub(crate) struct MailboxSlot {
    pub(crate) state: AtomicU32,
    pub(crate) op: AtomicU32,
    pub(crate) rkey: AtomicU32,
    pub(crate) status: AtomicU32,
    pub(crate) pd: AtomicU32,
    pub(crate) _pad: AtomicU32,
    pub(crate) addr: AtomicU64,
    pub(crate) compare: AtomicU64,
    pub(crate) operand: AtomicU64,
    pub(crate) result: AtomicU64,
}

const _: () = {
    assert!(std::mem::size_of::<QpSlot>() == QP_STRIDE as usize);
    assert!(std::mem::offset_of!(QpSlot, active) == 64);
    assert!(std::mem::offset_of!(QpSlot, sq_polled) == 128);
    assert!(std::mem::size_of::<CqSlot>() == 64);
    assert!(std::mem::size_of::<SrqSlot>() == 64);
    assert!(std::mem::size_of::<MrSlot>() == 64);
    assert!(std::mem::size_of::<MailboxSlot>() == 64);
    assert!(std::mem::size_of::<Header>() <= LIVENESS_OFF as usize);
    assert!(LIVENESS_OFF as usize + std::mem::size_of::<libc::pthread_mutex_t>() <= 4096);
};

/// A mapped context segment, ours or a peer's.
pub(crate) struct Segment {
    base: NonNull<u8>,
    memfd: OwnedFd,
    /// Owner process.
    pub(crate) pid: i32,
    /// Random identity of the owning context.
    pub(crate) nonce: u64,
    /// The owner's doorbell (its own eventfd for a local segment, a duplicate otherwise).
    doorbell: OwnedFd,
    /// Watches the owner's life (None when the owner is this process).
    pidfd: Option<OwnedFd>,
    /// True when the owner is this process.
    local: bool,
    /// True when this mapping's heap is advised onto transparent huge pages and the system
    /// backs shared memory with them (`provider::pages`).
    huge: bool,
}

// SAFETY: the mapping is process-wide and lives until drop; every access through `base` goes
// through atomics or through bounds-checked raw copies, as with memory a NIC writes.
unsafe impl Send for Segment {}
// SAFETY: as above; `Segment` has no interior state besides the mapping and descriptors.
unsafe impl Sync for Segment {}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.local {
            self.header().closed.store(1, Ordering::SeqCst);
        }
        {
            let mut reg = registry().lock();
            if reg.get(&self.nonce).is_some_and(|w| w.strong_count() == 0) {
                reg.remove(&self.nonce);
            }
        }
        // SAFETY: `base` is our mapping of SEG_SIZE bytes; no reference into it outlives
        // `self` (views borrow the segment).
        unsafe { sys::unmap(self.base.as_ptr(), SEG_SIZE as usize) };
    }
}

fn registry() -> &'static Mutex<HashMap<u64, Weak<Segment>>> {
    static REG: std::sync::OnceLock<Mutex<HashMap<u64, Weak<Segment>>>> =
        std::sync::OnceLock::new();
    REG.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Segment {
    /// Create a fresh segment for a new context of this process.
    pub(crate) fn create() -> Result<Arc<Segment>> {
        let memfd = sys::memfd_sealed("fabriq-shm", SEG_SIZE)
            .map_err(|e| VerbsError::io("create shm segment", e))?;
        let base = sys::map_shared(memfd.as_fd(), SEG_SIZE as usize)
            .map_err(|e| VerbsError::io("map shm segment", e))?;
        let base =
            NonNull::new(base).ok_or_else(|| VerbsError::InvalidArgument("null map".into()))?;
        let doorbell = sys::eventfd().map_err(|e| VerbsError::io("create doorbell", e))?;
        let mut nonce = rand::random::<u64>();
        while nonce == 0 {
            nonce = rand::random::<u64>();
        }
        let mut seg = Segment {
            base,
            memfd,
            pid: sys::getpid(),
            nonce,
            doorbell,
            pidfd: None,
            local: true,
            huge: false,
        };
        seg.advise_heap();
        // SAFETY: the liveness area lies in the header page of our fresh mapping, 64-byte
        // aligned, and nothing uses it yet.
        unsafe { sys::robust_mutex_init(seg.liveness_mutex()) }
            .map_err(|e| VerbsError::io("init liveness mutex", e))?;
        let h = seg.header();
        h.version.store(VERSION, Ordering::Relaxed);
        h.pid.store(seg.pid as u32, Ordering::Relaxed);
        h.nonce.store(nonce, Ordering::Relaxed);
        h.seg_size.store(SEG_SIZE, Ordering::Relaxed);
        h.doorbell_fd
            .store(seg.doorbell.as_raw_fd() as u32, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        let seg = Arc::new(seg);
        registry().lock().insert(nonce, Arc::downgrade(&seg));
        Ok(seg)
    }

    /// Map the segment of context `nonce` owned by `pid`, whose memfd is its fd `seg_fd`;
    /// reuses this process's mapping if it has one.
    pub(crate) fn attach(pid: i32, seg_fd: i32, nonce: u64) -> Result<Arc<Segment>> {
        // Bind first: the registry lock must be released before `existing` may drop.
        let existing = registry().lock().get(&nonce).and_then(Weak::upgrade);
        if let Some(seg) = existing {
            if seg.pid != pid {
                return Err(VerbsError::Connect(format!(
                    "segment {nonce:#x} belongs to pid {}, not {pid}",
                    seg.pid
                )));
            }
            return Ok(seg);
        }
        let fail = |what: &str, e: std::io::Error| {
            VerbsError::Connect(format!("attach to shm segment of pid {pid}: {what}: {e}"))
        };
        let pidfd = sys::pidfd_open(pid).map_err(|e| fail("pidfd_open", e))?;
        let memfd = sys::pidfd_getfd(pidfd.as_fd(), seg_fd).map_err(|e| fail("pidfd_getfd", e))?;
        match sys::is_sealed_memfd_of(memfd.as_fd(), SEG_SIZE) {
            Ok(true) => {}
            Ok(false) => {
                return Err(VerbsError::Connect(format!(
                    "fd {seg_fd} of pid {pid} is not a sealed shm segment"
                )))
            }
            Err(e) => return Err(fail("check segment", e)),
        }
        let base =
            sys::map_shared(memfd.as_fd(), SEG_SIZE as usize).map_err(|e| fail("mmap", e))?;
        let base = NonNull::new(base).ok_or_else(|| VerbsError::Connect("null map".into()))?;
        // The doorbell is filled in once the header checks out; until then, a placeholder
        // descriptor that is never kicked (the struct must be complete so Drop unmaps).
        let placeholder = sys::eventfd().map_err(|e| VerbsError::io("create eventfd", e))?;
        let mut seg = Segment {
            base,
            memfd,
            pid,
            nonce,
            doorbell: placeholder,
            pidfd: None,
            local: false,
            huge: false,
        };
        seg.advise_heap();
        let h = seg.header();
        if h.magic.load(Ordering::Acquire) != MAGIC
            || h.version.load(Ordering::Relaxed) != VERSION
            || h.pid.load(Ordering::Relaxed) != pid as u32
            || h.nonce.load(Ordering::Relaxed) != nonce
            || h.seg_size.load(Ordering::Relaxed) != SEG_SIZE
        {
            return Err(VerbsError::Connect(format!(
                "fd {seg_fd} of pid {pid} is not shm segment {nonce:#x} (stale endpoint?)"
            )));
        }
        let bell_fd = h.doorbell_fd.load(Ordering::Relaxed) as i32;
        let bell = sys::pidfd_getfd(pidfd.as_fd(), bell_fd).map_err(|e| fail("doorbell", e))?;
        if !sys::is_eventfd(bell.as_fd()) {
            return Err(VerbsError::Connect(format!(
                "doorbell fd {bell_fd} of pid {pid} is not an eventfd"
            )));
        }
        seg.doorbell = bell;
        seg.pidfd = Some(pidfd);
        let seg = Arc::new(seg);
        let mut reg = registry().lock();
        if let Some(existing) = reg.get(&nonce).and_then(Weak::upgrade) {
            return Ok(existing);
        }
        reg.insert(nonce, Arc::downgrade(&seg));
        Ok(seg)
    }

    /// True for the segment this process created (its own context's).
    #[inline]
    pub(crate) fn is_local(&self) -> bool {
        self.local
    }

    /// True when the owner is this process (memory of the owner is our memory).
    pub(crate) fn same_process(&self) -> bool {
        self.pid == sys::getpid()
    }

    /// The memfd (for hole punching by the owner).
    pub(crate) fn memfd(&self) -> BorrowedFd<'_> {
        self.memfd.as_fd()
    }

    /// The owner's pidfd, for peers.
    pub(crate) fn pidfd(&self) -> Option<BorrowedFd<'_>> {
        self.pidfd.as_ref().map(|f| f.as_fd())
    }

    /// The doorbell eventfd (ours for a local segment).
    pub(crate) fn doorbell(&self) -> BorrowedFd<'_> {
        self.doorbell.as_fd()
    }

    /// The liveness mutex (see [`LIVENESS_OFF`]).
    pub(crate) fn liveness_mutex(&self) -> *mut libc::pthread_mutex_t {
        self.base
            .as_ptr()
            .wrapping_add(LIVENESS_OFF as usize)
            .cast()
    }

    fn liveness_word(&self) -> &AtomicU32 {
        self.table(LIVENESS_OFF, 0, 0)
    }

    /// Hold the liveness mutex on the calling (service) thread; true when peers can rely on
    /// its lock word.
    pub(crate) fn hold_liveness(&self) -> bool {
        // SAFETY: the mutex was initialised in `create` and lives in our mapping, which
        // outlives the service thread that holds it (the thread holds an Arc to us).
        if unsafe { sys::robust_mutex_lock(self.liveness_mutex()) }.is_err() {
            return false;
        }
        let ok = self.liveness_word().load(Ordering::SeqCst) & FUTEX_TID_MASK == sys::gettid();
        self.header()
            .liveness_ok
            .store(u32::from(ok), Ordering::SeqCst);
        ok
    }

    /// Release the liveness mutex (service thread, at context close).
    pub(crate) fn release_liveness(&self) {
        self.header().liveness_ok.store(0, Ordering::SeqCst);
        self.header().closed.store(1, Ordering::SeqCst);
        // SAFETY: held by this thread since `hold_liveness`.
        unsafe { sys::robust_mutex_unlock(self.liveness_mutex()) };
    }

    /// Cheap liveness test for the data path: false once the owner died or closed the context.
    /// One or two loads; no system call.
    #[inline]
    pub(crate) fn owner_alive_fast(&self) -> bool {
        let h = self.header();
        if h.closed.load(Ordering::Acquire) != 0 {
            return false;
        }
        if self.local || h.liveness_ok.load(Ordering::Relaxed) == 0 {
            return true;
        }
        self.liveness_word().load(Ordering::Acquire) & FUTEX_TID_MASK != 0
    }

    /// True while the owner can still act: it runs and has not closed the context.
    pub(crate) fn owner_alive(&self) -> bool {
        self.owner_alive_fast()
            && self
                .pidfd
                .as_ref()
                .map_or(true, |p| sys::pidfd_alive(p.as_fd()))
    }

    /// Wake the owner's service thread.
    pub(crate) fn kick(&self) {
        sys::eventfd_kick(self.doorbell.as_fd());
    }

    /// Start of our mapping.
    /// Advise the heap of this mapping onto huge pages (each process advises its own mapping
    /// of a segment).
    fn advise_heap(&mut self) {
        // SAFETY: `HEAP_OFF < SEG_SIZE`: the range lies inside this mapping.
        let heap = unsafe { self.base.as_ptr().add(HEAP_OFF as usize) };
        self.huge = crate::provider::pages::advise_shared(heap, (SEG_SIZE - HEAP_OFF) as usize);
    }

    /// True when regions of the heap aligned to huge pages are backed by them.
    pub(crate) fn huge_pages(&self) -> bool {
        self.huge
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// `[off, off+len)` of the segment as a pointer in our mapping, if it lies inside.
    #[inline]
    pub(crate) fn ptr(&self, off: u64, len: u64) -> Option<*mut u8> {
        let end = off.checked_add(len)?;
        if end > SEG_SIZE {
            return None;
        }
        Some(self.base.as_ptr().wrapping_add(off as usize))
    }

    /// The segment offset of `[addr, addr+len)` when that range lies in our heap mapping.
    pub(crate) fn heap_offset_of(&self, addr: u64, len: u64) -> Option<u64> {
        let base = self.base.as_ptr() as u64;
        let off = addr.checked_sub(base)?;
        let end = off.checked_add(len)?;
        (off >= HEAP_OFF && end <= SEG_SIZE).then_some(off)
    }

    #[inline]
    fn table<T>(&self, off: u64, index: u32, stride: u64) -> &T {
        // SAFETY: callers mask `index` below the table size, so the entry lies inside the
        // fixed control area of the mapping, is aligned (tables are 64-byte aligned, strides
        // are multiples of 64) and consists of atomics, for which zeroed memory is valid.
        unsafe {
            &*(self
                .base
                .as_ptr()
                .add((off + index as u64 * stride) as usize) as *const T)
        }
    }

    /// The header.
    pub(crate) fn header(&self) -> &Header {
        self.table(HEADER_OFF, 0, 0)
    }

    /// QP table entry `index` (masked).
    #[inline]
    pub(crate) fn qp_slot(&self, index: u32) -> &QpSlot {
        self.table(QP_TABLE_OFF, index & (MAX_QP - 1), QP_STRIDE)
    }

    /// CQ table entry `index` (masked).
    #[inline]
    pub(crate) fn cq_slot(&self, index: u32) -> &CqSlot {
        self.table(CQ_TABLE_OFF, index & (MAX_CQ - 1), 64)
    }

    /// SRQ table entry `index` (masked).
    #[inline]
    pub(crate) fn srq_slot(&self, index: u32) -> &SrqSlot {
        self.table(SRQ_TABLE_OFF, index & (MAX_SRQ - 1), 64)
    }

    /// MR table entry `index` (masked).
    #[inline]
    pub(crate) fn mr_slot(&self, index: u32) -> &MrSlot {
        self.table(MR_TABLE_OFF, index & (MAX_MR - 1), 64)
    }

    /// Mailbox entry `index` (masked).
    pub(crate) fn mailbox_slot(&self, index: u32) -> &MailboxSlot {
        self.table(MAILBOX_OFF, index % MAILBOX_SLOTS, 64)
    }

    /// A view of the ring of `cap` slots of `T` at `off`, if the numbers (possibly written by a
    /// peer) describe a ring inside the segment.
    #[inline]
    pub(crate) fn ring<T: Copy>(&self, off: u64, cap: u64) -> Option<Ring<'_, T>> {
        if off < HEAP_OFF || off % 64 != 0 || cap == 0 || !cap.is_power_of_two() || cap > 1 << 24 {
            return None;
        }
        let bytes = ring_bytes::<T>(cap)?;
        let p = self.ptr(off, bytes)?;
        // SAFETY: `[off, off+bytes)` lies inside the mapping (checked), is 64-byte aligned, and
        // holds a RingHead followed by `cap` cells of atomics and plain data `T` (any bit
        // pattern is a valid `T` for the ring payloads used here). The references borrow `self`,
        // which keeps the mapping alive.
        let (head, cells) = unsafe {
            let head = &*(p as *const RingHead);
            let cells = std::slice::from_raw_parts(
                p.add(std::mem::size_of::<RingHead>()) as *const Cell<T>,
                cap as usize,
            );
            (head, cells)
        };
        Ring::new(head, cells)
    }
}

/// First-fit allocator of page runs in the owner's heap area. Freed runs are hole-punched, so
/// every allocation starts zeroed.
pub(crate) struct Heap {
    /// Free runs: offset → length, coalesced.
    free: std::collections::BTreeMap<u64, u64>,
}

impl Heap {
    /// The whole heap area free.
    pub(crate) fn new() -> Heap {
        let mut free = std::collections::BTreeMap::new();
        free.insert(HEAP_OFF, SEG_SIZE - HEAP_OFF);
        Heap { free }
    }

    /// Rounded length of an allocation of `len` bytes.
    pub(crate) fn rounded(len: u64) -> Option<u64> {
        len.max(1).checked_next_multiple_of(PAGE)
    }

    /// Allocate `len` bytes (rounded up to pages); returns the offset. A length that is a
    /// multiple of the huge page starts on a huge-page boundary (the heap starts on one), so
    /// that such a region can be backed by huge pages whatever was allocated before it.
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        let len = Self::rounded(len)?;
        let huge = crate::provider::pages::HUGE_PAGE as u64;
        let align = if len % huge == 0 { huge } else { PAGE };
        let (off, run, start) = self.free.iter().find_map(|(&off, &run)| {
            let start = off.checked_next_multiple_of(align)?;
            (start.checked_add(len)? <= off + run).then_some((off, run, start))
        })?;
        self.free.remove(&off);
        if start > off {
            self.free.insert(off, start - off);
        }
        let end = start + len;
        if off + run > end {
            self.free.insert(end, off + run - end);
        }
        Some(start)
    }

    /// Return `[off, off+len)` (as allocated) to the heap, zeroing its pages.
    pub(crate) fn free(&mut self, seg: &Segment, off: u64, len: u64) {
        let Some(len) = Self::rounded(len) else {
            return;
        };
        if let Err(err) = sys::punch_hole(seg.memfd(), off, len) {
            // Without a hole punch the pages are not zeroed: keep them out of circulation.
            tracing::warn!(%err, off, len, "shm: cannot release segment pages; leaking them");
            return;
        }
        let mut start = off;
        let mut run = len;
        if let Some((&prev, &plen)) = self.free.range(..off).next_back() {
            if prev + plen == off {
                self.free.remove(&prev);
                start = prev;
                run += plen;
            }
        }
        if let Some(&nlen) = self.free.get(&(off + len)) {
            self.free.remove(&(off + len));
            run += nlen;
        }
        self.free.insert(start, run);
    }
}

/// An owned ring in our own segment's heap: keeps the segment mapped.
pub(crate) struct SegRing<T> {
    pub(crate) seg: Arc<Segment>,
    pub(crate) off: u64,
    pub(crate) cap: u64,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T: Copy> SegRing<T> {
    /// Allocate and initialise a ring of at least `min_cap` slots.
    pub(crate) fn alloc(seg: &Arc<Segment>, heap: &Mutex<Heap>, min_cap: u32) -> Result<Self> {
        let cap = u64::from(min_cap.max(2)).next_power_of_two();
        let bytes = ring_bytes::<T>(cap)
            .ok_or_else(|| VerbsError::LimitExceeded(format!("ring of {cap} entries")))?;
        let off = heap
            .lock()
            .alloc(bytes)
            .ok_or_else(|| VerbsError::LimitExceeded("shm segment heap exhausted".into()))?;
        let r = SegRing {
            seg: seg.clone(),
            off,
            cap,
            _t: std::marker::PhantomData,
        };
        r.ring().init();
        Ok(r)
    }

    /// The ring view.
    #[inline]
    pub(crate) fn ring(&self) -> Ring<'_, T> {
        match self.seg.ring(self.off, self.cap) {
            Some(r) => r,
            None => unreachable!("ring allocated by this process lies inside its segment"),
        }
    }

    /// Give the memory back.
    pub(crate) fn release(&self, heap: &Mutex<Heap>) {
        if let Some(bytes) = ring_bytes::<T>(self.cap) {
            heap.lock().free(&self.seg, self.off, bytes);
        }
    }
}

/// A free-list of table indices `1..max`.
pub(crate) struct IndexAlloc {
    free: Vec<u32>,
}

impl IndexAlloc {
    /// Indices 1..max, lowest first.
    pub(crate) fn new(max: u32) -> IndexAlloc {
        IndexAlloc {
            free: (1..max).rev().collect(),
        }
    }
    /// Take one.
    pub(crate) fn take(&mut self) -> Option<u32> {
        self.free.pop()
    }
    /// Give one back.
    pub(crate) fn give(&mut self, i: u32) {
        self.free.push(i);
    }
}

/// A random tag of `bits` bits that differs from `previous` and makes a nonzero key.
pub(crate) fn fresh_tag(bits: u32, previous: u32) -> u32 {
    loop {
        let t = rand::random::<u32>() & ((1u32 << bits) - 1);
        if t != 0 && t != previous {
            return t;
        }
    }
}

#[cfg(test)]
mod heap_tests {
    use super::*;

    #[test]
    fn huge_page_multiples_are_aligned_and_the_gap_before_them_stays_usable() {
        let huge = crate::provider::pages::HUGE_PAGE as u64;
        let mut h = Heap::new();
        assert_eq!(HEAP_OFF % huge, 0);
        assert_eq!(h.alloc(100), Some(HEAP_OFF), "first fit, one page");
        let big = h.alloc(2 * huge).expect("room");
        assert_eq!(big % huge, 0, "a huge-page multiple starts on a huge page");
        assert_eq!(big, HEAP_OFF + huge);
        // The pages between the first region and the aligned one are still free, in order.
        assert_eq!(h.alloc(PAGE), Some(HEAP_OFF + PAGE));
        assert_eq!(h.alloc(huge - 2 * PAGE), Some(HEAP_OFF + 2 * PAGE));
        assert_eq!(h.alloc(PAGE), Some(big + 2 * huge), "the gap is used up");
        // Not a huge-page multiple: page alignment only.
        assert_eq!(h.alloc(huge + PAGE), Some(big + 2 * huge + PAGE));
    }
}

#[cfg(test)]
mod size_tests {
    use super::segment_bits;

    #[test]
    fn the_segment_size_is_64_gib_unless_the_build_sets_it() {
        assert_eq!(segment_bits(None), 36);
        assert_eq!(segment_bits(Some("32")), 32);
        assert_eq!(segment_bits(Some("28")), 28);
    }
}
