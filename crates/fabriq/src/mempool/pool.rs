//! The slab pool and its buffers.
//!
//! Unsafe lives here for two reasons, each stated where it is used:
//! - [`PoolBuf`] derefs to `[u8]` over registered memory it uniquely owns (a slot of a slab, or
//!   a dedicated region), kept mapped by the `Arc` it holds.
//! - The owner-only state ([`OwnerCell`]) is reached from `PoolBuf::drop` on any thread, so it
//!   sits in a `Sync` wrapper whose `RefCell` is only ever borrowed on the owning thread (a
//!   per-thread token check); every other thread goes through the lock-free return queue.
//!
//! Data layout: slab metadata (free-slot stacks, counts) lives in ordinary heap vectors, never in
//! the registered memory, because a peer holding a slab's rkey may write that memory at any time
//! and must not be able to corrupt the allocator.

use std::cell::{Cell, RefCell, RefMut};
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_queue::SegQueue;
use fabriq_verbs::{Lkey, MemoryRegion, ProtectionDomain, RemoteAddr, Rkey, Sge};

use super::class::SizeClasses;
use super::regcache::RegCache;
use super::{PoolConfig, PoolError, PoolStats};

/// Sentinel for "not in the class's partial list".
const NOT_LISTED: u32 = u32::MAX;

/// A token unique to the calling thread for the life of the process (never reused).
#[inline]
fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TOKEN: Cell<u64> = const { Cell::new(0) };
    }
    TOKEN.with(|t| {
        let v = t.get();
        if v != 0 {
            return v;
        }
        let v = NEXT.fetch_add(1, Ordering::Relaxed);
        t.set(v);
        v
    })
}

/// State that only the owning thread may touch, shared with buffers that may be dropped on
/// other threads.
struct OwnerCell<T> {
    owner: u64,
    cell: RefCell<T>,
}

// SAFETY: the `RefCell` (its borrow flag and its contents) is only accessed through
// `OwnerCell::borrow`, which returns `None` unless the calling thread is the owner, so no two
// threads ever access it concurrently. `T: Send` covers the final drop, which may run on whichever
// thread releases the last `Arc` (by then no other reference exists).
unsafe impl<T: Send> Sync for OwnerCell<T> {}

impl<T> OwnerCell<T> {
    fn new(value: T) -> Self {
        OwnerCell {
            owner: thread_token(),
            cell: RefCell::new(value),
        }
    }

    /// The state, if the caller is the owning thread and nothing else borrows it.
    #[inline]
    fn borrow(&self) -> Option<RefMut<'_, T>> {
        if thread_token() != self.owner {
            return None;
        }
        self.cell.try_borrow_mut().ok()
    }
}

/// What a buffer dropped off the owning thread sends back.
enum Returned {
    /// A slab slot to put back on its free stack.
    Slot { slab: u32, slot: u32 },
    /// A large buffer whose region was already deregistered by the dropping thread.
    Large { len: usize },
}

/// Shared between the pool and its buffers.
struct Shared {
    local: OwnerCell<Local>,
    returned: SegQueue<Returned>,
    /// The pool's registered bytes (`Local::registered`).
    registered: Arc<AtomicU64>,
}

/// Metadata of one slab.
struct Slab {
    mr: MemoryRegion,
    /// Class it is carved into; `None` while idle.
    class: Option<usize>,
    /// Slots `fresh..slots` were never handed out since carving.
    fresh: u32,
    /// Slots of the current class.
    slots: u32,
    /// Freed slots, reused first (LIFO keeps caches warm).
    free: Vec<u32>,
    /// Slots handed out and not yet returned. 0 <= in_use <= slots.
    in_use: u32,
    /// Index in its class's partial list, or `NOT_LISTED`.
    partial_pos: u32,
}

impl Slab {
    fn has_free(&self) -> bool {
        !self.free.is_empty() || self.fresh < self.slots
    }
}

#[derive(Default)]
struct Counters {
    bytes_registered: u64,
    bytes_in_use: u64,
    large_buffers: u64,
    registrations: u64,
    deregistrations: u64,
    allocs: u64,
    remote_frees: u64,
    /// Bytes of idle slabs deregistered so far (`Local::trim_idle`).
    slab_bytes_trimmed: u64,
}

/// The owner-only state of a pool.
struct Local {
    pd: ProtectionDomain,
    cfg: PoolConfig,
    classes: SizeClasses,
    /// Slab table indexed by slab id; `None` for a vacant id.
    slabs: Vec<Option<Slab>>,
    vacant: Vec<u32>,
    /// Per class: ids of carved slabs with at least one free slot.
    partial: Vec<Vec<u32>>,
    /// Ids of idle (uncarved, entirely free) slabs.
    idle: Vec<u32>,
    counters: Counters,
    /// Bytes registered, readable from any thread ([`MemPool::registered_gauge`]; also in
    /// [`Shared`]): changed only where registrations are, never on the alloc/free path of a
    /// slab slot. A large buffer's drop takes its bytes off at once, on whichever thread it
    /// deregisters the buffer, ahead of `counters.bytes_registered` when that is a foreign one.
    registered: Arc<AtomicU64>,
}

impl Drop for Local {
    fn drop(&mut self) {
        // The last buffer is gone (each holds the pool's `Shared`) and the slabs deregister
        // with their regions here.
        self.registered.store(0, Ordering::Relaxed);
    }
}

impl Local {
    fn add_registered(&mut self, bytes: u64) {
        self.counters.bytes_registered += bytes;
        self.registered.fetch_add(bytes, Ordering::Relaxed);
    }

    fn slab_mut(&mut self, id: u32) -> &mut Slab {
        self.slabs
            .get_mut(id as usize)
            .and_then(Option::as_mut)
            .expect("pool invariant: a live buffer names a live slab")
    }

    fn check_limit(&self, requested: usize) -> Result<(), PoolError> {
        if let Some(limit) = self.cfg.max_registered_bytes {
            let registered = self.counters.bytes_registered as usize;
            if registered.saturating_add(requested) > limit {
                return Err(PoolError::Exhausted {
                    registered,
                    requested,
                    limit,
                });
            }
        }
        Ok(())
    }

    /// A slab with a free slot of `class`, carving an idle one or registering a new one.
    fn slab_for(&mut self, class: usize) -> Result<u32, PoolError> {
        if let Some(&id) = self.partial[class].last() {
            return Ok(id);
        }
        let id = match self.idle.pop() {
            Some(id) => id,
            None => self.register_slab()?,
        };
        let size = self.classes.size_of(class);
        let slots = (self.cfg.slab_size / size) as u32;
        let pos = self.partial[class].len() as u32;
        let s = self.slab_mut(id);
        s.class = Some(class);
        s.fresh = 0;
        s.slots = slots;
        s.free.clear();
        s.in_use = 0;
        s.partial_pos = pos;
        self.partial[class].push(id);
        Ok(id)
    }

    fn register_slab(&mut self) -> Result<u32, PoolError> {
        let size = self.cfg.slab_size;
        self.check_limit(size)?;
        let mr = self.pd.alloc_mr(size, self.cfg.access)?;
        self.counters.registrations += 1;
        self.add_registered(size as u64);
        let slab = Slab {
            mr,
            class: None,
            fresh: 0,
            slots: 0,
            free: Vec::new(),
            in_use: 0,
            partial_pos: NOT_LISTED,
        };
        let id = match self.vacant.pop() {
            Some(id) => {
                self.slabs[id as usize] = Some(slab);
                id
            }
            None => {
                self.slabs.push(Some(slab));
                (self.slabs.len() - 1) as u32
            }
        };
        tracing::debug!(slab = id, bytes = size, "pool slab registered");
        Ok(id)
    }

    /// Take one slot of `class`: (slab id, slot, slot address, lkey, rkey).
    fn take_slot(&mut self, class: usize) -> Result<(u32, u32, u64, Lkey, Rkey), PoolError> {
        let id = self.slab_for(class)?;
        let size = self.classes.size_of(class) as u64;
        let s = self.slab_mut(id);
        let slot = match s.free.pop() {
            Some(slot) => slot,
            None => {
                let slot = s.fresh;
                s.fresh += 1;
                slot
            }
        };
        s.in_use += 1;
        let full = !s.has_free();
        let addr = s.mr.addr() + u64::from(slot) * size;
        let (lkey, rkey) = (s.mr.lkey(), s.mr.rkey());
        if full {
            self.unlist(class, id);
        }
        self.counters.allocs += 1;
        self.counters.bytes_in_use += size;
        Ok((id, slot, addr, lkey, rkey))
    }

    /// Remove slab `id` from the partial list of `class`.
    fn unlist(&mut self, class: usize, id: u32) {
        let pos = std::mem::replace(&mut self.slab_mut(id).partial_pos, NOT_LISTED);
        debug_assert_ne!(pos, NOT_LISTED, "pool invariant: unlisting a listed slab");
        let list = &mut self.partial[class];
        list.swap_remove(pos as usize);
        if let Some(&moved) = list.get(pos as usize) {
            self.slab_mut(moved).partial_pos = pos;
        }
    }

    fn release(&mut self, ret: Returned) {
        match ret {
            Returned::Slot { slab, slot } => self.release_slot(slab, slot),
            Returned::Large { len } => {
                self.counters.large_buffers -= 1;
                self.counters.bytes_in_use -= len as u64;
                // The gauge went down when the buffer was dropped (`PoolBuf::drop`).
                self.counters.bytes_registered -= len as u64;
                self.counters.deregistrations += 1;
            }
        }
    }

    fn release_slot(&mut self, id: u32, slot: u32) {
        let s = self.slab_mut(id);
        let class = s
            .class
            .expect("pool invariant: a live buffer's slab is carved");
        let was_full = !s.has_free();
        s.free.push(slot);
        s.in_use -= 1;
        let now_empty = s.in_use == 0;
        self.counters.bytes_in_use -= self.classes.size_of(class) as u64;
        if was_full {
            let pos = self.partial[class].len() as u32;
            self.slab_mut(id).partial_pos = pos;
            self.partial[class].push(id);
        }
        // Keep the class's last partial slab carved (hysteresis against alloc/free ping-pong);
        // a second empty one goes idle, and idle memory above the mark is returned.
        if now_empty && self.partial[class].len() > 1 {
            self.make_idle(class, id);
            self.trim_idle();
        }
    }

    fn make_idle(&mut self, class: usize, id: u32) {
        self.unlist(class, id);
        let s = self.slab_mut(id);
        s.class = None;
        s.slots = 0;
        s.fresh = 0;
        s.free = Vec::new();
        self.idle.push(id);
    }

    /// Deregister idle slabs above the high-water mark; returns the bytes released.
    fn trim_idle(&mut self) -> usize {
        self.trim_idle_to(self.cfg.max_idle_bytes)
    }

    /// Deregister idle slabs above `keep_bytes`; returns the bytes released.
    fn trim_idle_to(&mut self, keep_bytes: usize) -> usize {
        let size = self.cfg.slab_size;
        let keep = keep_bytes / size;
        let mut released = 0;
        while self.idle.len() > keep {
            let Some(id) = self.idle.pop() else { break };
            // Dropping the region deregisters it; its memory goes back to the provider.
            self.slabs[id as usize] = None;
            self.vacant.push(id);
            self.counters.bytes_registered -= size as u64;
            self.counters.slab_bytes_trimmed += size as u64;
            self.registered.fetch_sub(size as u64, Ordering::Relaxed);
            self.counters.deregistrations += 1;
            released += size;
            tracing::debug!(slab = id, bytes = size, "pool slab reclaimed");
        }
        released
    }

    /// Turn every entirely free carved slab idle, then keep at most `keep_bytes` of idle
    /// memory; returns the bytes deregistered.
    fn reclaim_to(&mut self, keep_bytes: usize) -> usize {
        for class in 0..self.partial.len() {
            let empty: Vec<u32> = self.partial[class]
                .iter()
                .copied()
                .filter(|&id| {
                    self.slabs[id as usize]
                        .as_ref()
                        .is_some_and(|s| s.in_use == 0)
                })
                .collect();
            for id in empty {
                self.make_idle(class, id);
            }
        }
        self.trim_idle_to(keep_bytes)
    }
}

/// A per-worker pool of pre-registered buffers. See the [module docs](super).
///
/// `!Send` and `!Sync`: it belongs to the thread that created it. Its buffers are `Send` and
/// may be dropped on any thread.
pub struct MemPool {
    shared: Arc<Shared>,
    classes: SizeClasses,
    reg_cache: RegCache,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for MemPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemPool")
            .field("classes", &self.classes)
            .field("stats", &self.stats())
            .finish()
    }
}

impl MemPool {
    /// A pool on `pd`. Registers nothing until the first allocation.
    pub fn new(pd: &ProtectionDomain, cfg: PoolConfig) -> Result<MemPool, PoolError> {
        cfg.validate()?;
        let classes = SizeClasses::new(cfg.min_class, cfg.max_class);
        let reg_cache = RegCache::new(pd, cfg.reg_cache.clone());
        let registered = Arc::new(AtomicU64::new(0));
        let local = Local {
            pd: pd.clone(),
            partial: vec![Vec::new(); classes.count()],
            cfg,
            classes,
            slabs: Vec::new(),
            vacant: Vec::new(),
            idle: Vec::new(),
            counters: Counters::default(),
            registered: Arc::clone(&registered),
        };
        Ok(MemPool {
            shared: Arc::new(Shared {
                local: OwnerCell::new(local),
                returned: SegQueue::new(),
                registered,
            }),
            classes,
            reg_cache,
            _not_send: PhantomData,
        })
    }

    fn local(&self) -> RefMut<'_, Local> {
        self.shared
            .local
            .borrow()
            .expect("MemPool is !Send and never re-entered: only its owner thread reaches it")
    }

    /// The size classes.
    pub fn classes(&self) -> SizeClasses {
        self.classes
    }

    /// Largest length [`MemPool::alloc`] serves.
    pub fn max_class(&self) -> usize {
        self.classes.max_size()
    }

    /// A buffer of capacity `len` rounded up to its class, with length `len` (contents
    /// unspecified: zeroed on first use, stale after reuse). At the registration bound the
    /// pool first lets go of what it keeps unused (its idle slabs, whatever the mark) before
    /// it answers [`PoolError::Exhausted`].
    pub fn alloc(&mut self, len: usize) -> Result<PoolBuf, PoolError> {
        match self.alloc_slot(len) {
            Err(e @ PoolError::Exhausted { .. }) => self.alloc_slot_after_room(len, e),
            r => r,
        }
    }

    /// [`MemPool::alloc`] at the bound: once more after [`MemPool::make_room`], if that
    /// changed anything; else `exhausted`.
    #[cold]
    #[inline(never)]
    fn alloc_slot_after_room(
        &mut self,
        len: usize,
        exhausted: PoolError,
    ) -> Result<PoolBuf, PoolError> {
        if self.make_room() {
            self.alloc_slot(len)
        } else {
            Err(exhausted)
        }
    }

    fn alloc_slot(&mut self, len: usize) -> Result<PoolBuf, PoolError> {
        let class = self.classes.class_of(len).ok_or(PoolError::TooLarge {
            len,
            max_class: self.classes.max_size(),
        })?;
        let mut local = self.local();
        if local.partial[class].is_empty() {
            // Before registering more, take back what other threads freed.
            drain(&self.shared.returned, &mut local);
        }
        let (slab, slot, addr, lkey, rkey) = local.take_slot(class)?;
        drop(local);
        let cap = self.classes.size_of(class);
        Ok(PoolBuf {
            ptr: NonNull::new(addr as usize as *mut u8)
                .expect("provider invariant: registered memory is not at address 0"),
            len,
            cap,
            lkey,
            rkey,
            backing: Backing::Slab { slab, slot },
            shared: Arc::clone(&self.shared),
        })
    }

    /// A pool-owned buffer of exactly `len` bytes in a dedicated registration
    /// (`alloc_mr(len)`), for payloads above the largest class. Deregistered when dropped. At
    /// the registration bound, as [`MemPool::alloc`].
    pub fn alloc_large(&mut self, len: usize) -> Result<PoolBuf, PoolError> {
        match self.alloc_region(len) {
            Err(PoolError::Exhausted { .. }) if self.make_room() => self.alloc_region(len),
            r => r,
        }
    }

    fn alloc_region(&mut self, len: usize) -> Result<PoolBuf, PoolError> {
        let mut local = self.local();
        local.check_limit(len)?;
        let mr = local.pd.alloc_mr(len, local.cfg.access)?;
        local.counters.registrations += 1;
        local.add_registered(len as u64);
        local.counters.bytes_in_use += len as u64;
        local.counters.large_buffers += 1;
        local.counters.allocs += 1;
        drop(local);
        Ok(PoolBuf {
            ptr: NonNull::new(mr.as_ptr())
                .expect("provider invariant: registered memory is not at address 0"),
            len,
            cap: len,
            lkey: mr.lkey(),
            rkey: mr.rkey(),
            backing: Backing::Large(Some(Box::new(mr))),
            shared: Arc::clone(&self.shared),
        })
    }

    /// [`MemPool::alloc`] up to the largest class, [`MemPool::alloc_large`] above.
    pub fn alloc_any(&mut self, len: usize) -> Result<PoolBuf, PoolError> {
        if len <= self.classes.max_size() {
            self.alloc(len)
        } else {
            self.alloc_large(len)
        }
    }

    /// Take back buffers freed on other threads; returns how many. Cheap when none are pending.
    pub fn drain_returned(&mut self) -> usize {
        drain(&self.shared.returned, &mut self.local())
    }

    /// Idle reclaim, for the worker's timer: take back remote frees, turn every entirely free
    /// slab idle, and deregister idle slabs above [`PoolConfig::max_idle_bytes`]. Returns the
    /// bytes deregistered (slabs the remote frees emptied included).
    pub fn reclaim(&mut self) -> usize {
        let mut local = self.local();
        let before = local.counters.slab_bytes_trimmed;
        drain(&self.shared.returned, &mut local);
        let keep = local.cfg.max_idle_bytes;
        local.reclaim_to(keep);
        (local.counters.slab_bytes_trimmed - before) as usize
    }

    /// At the registration bound ([`PoolConfig::max_registered_bytes`]), before an allocation
    /// fails for it: what the pool keeps unused goes — remote frees taken back, every entirely
    /// free slab deregistered, the idle mark notwithstanding. True if that changed anything.
    fn make_room(&self) -> bool {
        let mut local = self.local();
        let drained = drain(&self.shared.returned, &mut local);
        drained > 0 || local.reclaim_to(0) > 0
    }

    /// Bytes the pool holds registered (slabs and large buffers), readable from any thread:
    /// the same figure as [`PoolStats::bytes_registered`], kept current as slabs and large
    /// buffers are registered and deregistered. It outlives the pool while its buffers do.
    pub fn registered_gauge(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.shared.registered)
    }

    /// The registration cache for caller memory above the largest class.
    pub fn reg_cache(&self) -> &RegCache {
        &self.reg_cache
    }

    /// The protection domain the pool registers in.
    pub fn pd(&self) -> ProtectionDomain {
        self.local().pd.clone()
    }

    /// A snapshot of the counters (remote frees not yet drained still count as in use).
    pub fn stats(&self) -> PoolStats {
        let local = self.local();
        let c = &local.counters;
        let rc = self.reg_cache.stats();
        PoolStats {
            bytes_registered: c.bytes_registered,
            bytes_in_use: c.bytes_in_use,
            bytes_idle: (local.idle.len() * local.cfg.slab_size) as u64,
            slabs: (local.slabs.len() - local.vacant.len()) as u64,
            huge_page_bytes: local
                .slabs
                .iter()
                .flatten()
                .filter(|s| s.mr.pages().is_huge())
                .count() as u64
                * local.cfg.slab_size as u64,
            large_buffers: c.large_buffers,
            registrations: c.registrations,
            deregistrations: c.deregistrations,
            allocs: c.allocs,
            remote_frees: c.remote_frees,
            cache_hits: rc.hits,
            cache_misses: rc.misses,
            cache_evictions: rc.evictions,
            cache_bytes: rc.bytes,
        }
    }
}

fn drain(queue: &SegQueue<Returned>, local: &mut Local) -> usize {
    let mut n = 0;
    while let Some(ret) = queue.pop() {
        local.release(ret);
        n += 1;
    }
    local.counters.remote_frees += n as u64;
    n
}

enum Backing {
    Slab {
        slab: u32,
        slot: u32,
    },
    /// `Some` until dropped. Boxed: every `PoolBuf` moves through the channel's queues, and the
    /// region would make each of them as large as it is (large buffers are rare and costly).
    Large(Option<Box<MemoryRegion>>),
}

/// A buffer from a [`MemPool`]: registered memory, owned, returned to its pool on drop.
///
/// Derefs to the first [`PoolBuf::len`] bytes; [`PoolBuf::capacity`] is the class size (or the
/// exact length of a large buffer). To send it without a copy, post [`PoolBuf::sge`] and keep the
/// buffer alive until the work request completes; to expose it to a peer, hand out
/// [`PoolBuf::remote`] (the rkey covers the whole slab, see `docs/arch/mempool.md`).
pub struct PoolBuf {
    /// Start of the slot. Valid for `cap` bytes while `shared` (slab buffers) or the owned region
    /// (large buffers) lives.
    ptr: NonNull<u8>,
    /// 0 <= len <= cap.
    len: usize,
    cap: usize,
    lkey: Lkey,
    rkey: Rkey,
    backing: Backing,
    shared: Arc<Shared>,
}

// SAFETY: a PoolBuf uniquely owns its slot (a slot is on a free stack or in exactly one PoolBuf),
// the memory stays registered while `shared` or the owned region lives, and dropping it on a
// foreign thread only pushes onto a lock-free queue (the owner-only state is never touched there).
unsafe impl Send for PoolBuf {}
// SAFETY: `&PoolBuf` only gives shared reads of memory this buffer exclusively owns.
unsafe impl Sync for PoolBuf {}

impl std::fmt::Debug for PoolBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolBuf")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .field("large", &matches!(self.backing, Backing::Large(_)))
            .finish()
    }
}

impl PoolBuf {
    /// Bytes in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when `len() == 0`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes available (the class size).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Set the length, e.g. after a receive completion placed `byte_len` bytes.
    ///
    /// # Panics
    /// If `len > capacity()` (a caller bug, never peer input: a completion's `byte_len` cannot
    /// exceed the posted SGE).
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.cap,
            "PoolBuf::set_len({len}) beyond capacity {}",
            self.cap
        );
        self.len = len;
    }

    /// Copy `data` to the start of the buffer and set the length to `data.len()`; `false` (and
    /// nothing copied) if it does not fit.
    pub fn fill_from(&mut self, data: &[u8]) -> bool {
        if data.len() > self.cap {
            return false;
        }
        self.len = data.len();
        self.as_mut().copy_from_slice(data);
        true
    }

    /// The whole capacity, for filling before [`PoolBuf::set_len`].
    pub fn spare_capacity_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is valid for `cap` bytes (see the field), and `&mut self` gives exclusive
        // access to this slot.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }

    /// Start address (a verbs virtual address).
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }

    /// Local key of the region holding the buffer.
    pub fn lkey(&self) -> Lkey {
        self.lkey
    }

    /// Remote key of the region holding the buffer.
    pub fn rkey(&self) -> Rkey {
        self.rkey
    }

    /// SGE over the first `len()` bytes: post it to send the buffer without a copy.
    pub fn sge(&self) -> Sge {
        Sge {
            addr: self.addr(),
            length: u32::try_from(self.len).unwrap_or(u32::MAX),
            lkey: self.lkey,
        }
    }

    /// SGE over the whole capacity: post it as a receive buffer or READ target.
    pub fn sge_full(&self) -> Sge {
        Sge {
            addr: self.addr(),
            length: u32::try_from(self.cap).unwrap_or(u32::MAX),
            lkey: self.lkey,
        }
    }

    /// What a peer needs to READ or WRITE this buffer (address and rkey).
    pub fn remote(&self) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr(),
            rkey: self.rkey,
        }
    }

    /// True for a buffer from [`MemPool::alloc_large`].
    pub fn is_large(&self) -> bool {
        matches!(self.backing, Backing::Large(_))
    }
}

impl std::ops::Deref for PoolBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `cap >= len` bytes and this buffer owns the slot; writes by
        // the provider happen only while the caller has the buffer posted, which the verbs
        // contract forbids overlapping with reads, as with any registered memory.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, with `&mut self` giving exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for PoolBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        let ret = match &mut self.backing {
            Backing::Slab { slab, slot } => Returned::Slot {
                slab: *slab,
                slot: *slot,
            },
            Backing::Large(mr) => {
                // Deregister here, on whichever thread drops it; only the counters travel back.
                drop(mr.take());
                self.shared
                    .registered
                    .fetch_sub(self.cap as u64, Ordering::Relaxed);
                Returned::Large { len: self.cap }
            }
        };
        match self.shared.local.borrow() {
            Some(mut local) => local.release(ret),
            None => self.shared.returned.push(ret),
        }
    }
}
