//! The worker's buffer source, usable from every thread that drives the worker or sends on its
//! channels: send payloads ([`crate::Channel::alloc`], the copy of a `send(&[u8])`, RPC requests
//! and replies) and rendezvous pull buffers.
//!
//! A [`MemPool`] belongs to the thread that created it, so each thread that allocates for this
//! worker gets its own pool, created on first use and kept in a thread-local table keyed by the
//! worker's buffer-source id; buffers are `Send` and return to their owning pool from whichever
//! thread drops them. Above the pool's largest class, buffers (rendezvous payloads) are cached
//! here, bounded, so that a stream of large messages reuses a few registrations instead of
//! registering — and making the peer map — a new region per message. Large buffers come back
//! from the channel (send completed) or, through a lock-free queue, from the application thread
//! that dropped a received [`crate::Message`].
//!
//! Idle reclaim: a pool takes back what other threads freed only when its own thread allocates
//! or reclaims, so a worker that goes quiet after a burst would keep the burst's slabs
//! registered for as long as it stays quiet. The worker therefore arms a reclaim timer when it
//! goes to sleep holding more than the pool's idle mark, or large buffers in the cache
//! ([`Buffers::needs_reclaim`]); when it fires, [`Buffers::reclaim_here`] drains the remote
//! frees of the thread's pool, trims its idle slabs to the mark, and lets go of the cached
//! large buffers if none was reused since the last reclaim.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crossbeam_queue::SegQueue;
use fabriq_verbs::ProtectionDomain;
use parking_lot::Mutex;

use crate::channel::driver::BufferSource;
use crate::mempool::{MemPool, PoolBuf, PoolConfig, PoolError};

/// Bytes of large buffers kept for reuse per worker.
const MAX_CACHED_BYTES: usize = 64 << 20;

/// One thread's pool for one buffer source; `alive` turns false when the source is dropped so
/// that the entry can be pruned.
struct ThreadPool {
    source: u64,
    alive: Arc<AtomicBool>,
    pool: MemPool,
}

thread_local! {
    static POOLS: RefCell<Vec<ThreadPool>> = const { RefCell::new(Vec::new()) };
}

struct Cache {
    by_cap: HashMap<usize, Vec<PoolBuf>>,
    bytes: usize,
    /// Buffers taken from the cache since the last reclaim: none, and the reclaim lets the
    /// cache go.
    taken: u64,
}

/// What the buffers of one endpoint hold: see [`crate::Endpoint::memory_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes registered by the endpoint's buffer pools — every thread's pool of every worker:
    /// slabs (in use or kept idle up to the mark) and large buffers (in use or cached). Receive
    /// rings and exposed regions are registered apart and not counted.
    pub registered_bytes: u64,
    /// Of those, bytes of large buffers (above the largest class) kept for reuse.
    pub cached_large_bytes: u64,
    /// Idle reclaims the workers' timers ran.
    pub reclaims: u64,
    /// Bytes those reclaims deregistered (slabs and cached large buffers).
    pub reclaimed_bytes: u64,
}

/// A worker's buffers: per-thread pools plus the shared large-buffer cache.
pub(crate) struct Buffers {
    id: u64,
    alive: Arc<AtomicBool>,
    pd: ProtectionDomain,
    config: PoolConfig,
    max_class: usize,
    cache: Mutex<Cache>,
    returned: Arc<SegQueue<PoolBuf>>,
    /// Registered bytes of each thread's pool ([`MemPool::registered_gauge`]), pruned as pools
    /// go.
    gauges: Mutex<Vec<Weak<AtomicU64>>>,
    reclaims: AtomicU64,
    reclaimed_bytes: AtomicU64,
}

impl std::fmt::Debug for Buffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffers")
            .field("id", &self.id)
            .field("max_class", &self.max_class)
            .finish()
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::Release);
    }
}

impl Buffers {
    pub(crate) fn new(pd: &ProtectionDomain, config: PoolConfig) -> Result<Buffers, PoolError> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        config.validate()?;
        Ok(Buffers {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            alive: Arc::new(AtomicBool::new(true)),
            pd: pd.clone(),
            max_class: config.max_class,
            config,
            cache: Mutex::new(Cache {
                by_cap: HashMap::new(),
                bytes: 0,
                taken: 0,
            }),
            returned: Arc::new(SegQueue::new()),
            gauges: Mutex::new(Vec::new()),
            reclaims: AtomicU64::new(0),
            reclaimed_bytes: AtomicU64::new(0),
        })
    }

    /// Identity of the protection domain the buffers are registered in: a buffer may be sent on
    /// any channel of the same domain.
    pub(crate) fn domain(&self) -> usize {
        crate::remote::domain_of(&self.pd)
    }

    /// Where other threads return large buffers.
    pub(crate) fn returned(&self) -> &Arc<SegQueue<PoolBuf>> {
        &self.returned
    }

    /// Keep a large buffer for reuse (within the bound); others go back to their pool on drop.
    pub(crate) fn recycle(&self, buf: PoolBuf) {
        if !buf.is_large() {
            return;
        }
        let mut c = self.cache.lock();
        if c.bytes + buf.capacity() > MAX_CACHED_BYTES {
            return;
        }
        c.bytes += buf.capacity();
        c.by_cap.entry(buf.capacity()).or_default().push(buf);
    }

    /// Run `f` on the calling thread's pool for this source, creating it on first use.
    fn with_pool<T>(
        &self,
        f: impl FnOnce(&mut MemPool) -> Result<T, PoolError>,
    ) -> Result<T, PoolError> {
        POOLS.with(|cell| {
            let mut pools = cell.borrow_mut();
            if let Some(p) = pools.iter_mut().find(|p| p.source == self.id) {
                return f(&mut p.pool);
            }
            // A new entry: drop the pools of sources that are gone first.
            pools.retain(|p| p.alive.load(Ordering::Acquire));
            let pool = MemPool::new(&self.pd, self.config.clone())?;
            {
                let mut gauges = self.gauges.lock();
                gauges.retain(|g| g.strong_count() > 0);
                gauges.push(Arc::downgrade(&pool.registered_gauge()));
            }
            pools.push(ThreadPool {
                source: self.id,
                alive: Arc::clone(&self.alive),
                pool,
            });
            match pools.last_mut() {
                Some(p) => f(&mut p.pool),
                None => Err(PoolError::InvalidConfig("thread pool table empty".into())),
            }
        })
    }

    /// A registered buffer of length `len` (capacity may be larger). At the pool's bound
    /// (`Config::pool_max_bytes`), the large buffers kept for reuse go before the allocation
    /// fails: they count against the bound of the pool that made them.
    pub(crate) fn alloc(&self, len: usize) -> Result<PoolBuf, PoolError> {
        match self.alloc_once(len) {
            Err(e @ PoolError::Exhausted { .. }) => self.alloc_after_dropping_cached(len, e),
            r => r,
        }
    }

    /// [`Buffers::alloc`] at the bound: once more after letting the cache go, if it held any;
    /// else `exhausted`.
    #[cold]
    #[inline(never)]
    fn alloc_after_dropping_cached(
        &self,
        len: usize,
        exhausted: PoolError,
    ) -> Result<PoolBuf, PoolError> {
        if self.drop_cached() > 0 {
            self.alloc_once(len)
        } else {
            Err(exhausted)
        }
    }

    /// Let go of the cached large buffers (each deregisters its region as it drops, outside
    /// the lock); the bytes they held.
    fn drop_cached(&self) -> u64 {
        let dropped = {
            let mut c = self.cache.lock();
            self.take_returned(&mut c);
            c.bytes = 0;
            std::mem::take(&mut c.by_cap)
        };
        dropped
            .values()
            .flatten()
            .map(|b| b.capacity() as u64)
            .sum()
    }

    fn alloc_once(&self, len: usize) -> Result<PoolBuf, PoolError> {
        if len <= self.max_class {
            return self.with_pool(|p| p.alloc(len));
        }
        let cap = len.checked_next_power_of_two().unwrap_or(len);
        {
            let mut c = self.cache.lock();
            self.take_returned(&mut c);
            if let Some(mut b) = c.by_cap.get_mut(&cap).and_then(Vec::pop) {
                c.bytes -= b.capacity();
                c.taken += 1;
                b.set_len(len);
                return Ok(b);
            }
        }
        let mut b = self.with_pool(|p| p.alloc_large(cap))?;
        b.set_len(len);
        Ok(b)
    }

    /// Large buffers other threads gave back, into the cache (within its bound).
    fn take_returned(&self, c: &mut Cache) {
        while let Some(b) = self.returned.pop() {
            if c.bytes + b.capacity() <= MAX_CACHED_BYTES {
                c.bytes += b.capacity();
                c.by_cap.entry(b.capacity()).or_default().push(b);
            }
        }
    }

    /// Run `f` on the calling thread's pool for this source, if it has one.
    fn with_existing_pool<T>(&self, f: impl FnOnce(&mut MemPool) -> T) -> Option<T> {
        POOLS.with(|cell| {
            let mut pools = cell.borrow_mut();
            pools
                .iter_mut()
                .find(|p| p.source == self.id)
                .map(|p| f(&mut p.pool))
        })
    }

    /// Whether a reclaim could give memory back: the calling thread's pool holds more than its
    /// idle mark registered (remote frees not yet taken back count, they are registered), or
    /// large buffers are cached. Cheap: a thread-local look-up, an atomic load, a lock.
    pub(crate) fn needs_reclaim(&self) -> bool {
        let mark = self.config.max_idle_bytes as u64;
        let pool_above = self
            .with_existing_pool(|p| p.registered_gauge().load(Ordering::Relaxed) > mark)
            .unwrap_or(false);
        pool_above || self.cache.lock().bytes > 0 || !self.returned.is_empty()
    }

    /// Idle reclaim on the calling thread's pool ([`MemPool::reclaim`]) and of the large-buffer
    /// cache when none of it was reused since the last one. Returns the bytes deregistered.
    pub(crate) fn reclaim_here(&self) -> u64 {
        let slabs = self.with_existing_pool(MemPool::reclaim).unwrap_or(0) as u64;
        let reused = std::mem::take(&mut self.cache.lock().taken) > 0;
        let large = if reused { 0 } else { self.drop_cached() };
        let released = slabs + large;
        self.reclaims.fetch_add(1, Ordering::Relaxed);
        self.reclaimed_bytes.fetch_add(released, Ordering::Relaxed);
        if released > 0 {
            tracing::debug!(bytes = released, "idle reclaim");
        }
        released
    }

    /// What these buffers hold and what reclaim gave back.
    pub(crate) fn memory_stats(&self) -> MemoryStats {
        let registered_bytes = self
            .gauges
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .map(|g| g.load(Ordering::Relaxed))
            .sum();
        let cached_large_bytes = {
            let mut c = self.cache.lock();
            self.take_returned(&mut c);
            c.bytes as u64
        };
        MemoryStats {
            registered_bytes,
            cached_large_bytes,
            reclaims: self.reclaims.load(Ordering::Relaxed),
            reclaimed_bytes: self.reclaimed_bytes.load(Ordering::Relaxed),
        }
    }

    /// Bytes of large buffers kept for reuse (those given back included).
    #[cfg(test)]
    pub(crate) fn kept_bytes(&self) -> usize {
        let mut c = self.cache.lock();
        self.take_returned(&mut c);
        c.bytes
    }
}

impl BufferSource for &Buffers {
    fn alloc_any(&mut self, len: usize) -> Result<PoolBuf, PoolError> {
        Buffers::alloc(self, len)
    }
}
