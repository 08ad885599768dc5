//! Registration cache for caller memory above the largest size class.
//!
//! Registering memory costs a system call (pinning pages on a NIC, an MR-table insert on a
//! software provider), far more than sending a few KiB, so repeated sends of one big user buffer
//! must register it once. Entries are keyed by address range and never overlap: a request that
//! overlaps existing entries without being covered by one registers the union and replaces them
//! (the way UCX's rcache merges), so two overlapping buffers sent alternately do not ping-pong.
//! Bounded by entries and bytes; the least recently used entry goes first.
//!
//! Evicting an entry only drops the cache's reference: a region still used by an in-flight work
//! request stays registered until its last `Arc` is dropped.
//!
//! The cache cannot see `free`/`munmap`: the caller must [`RegCache::invalidate`] a range before
//! releasing its memory (see the `# Safety` section of [`RegCache::register`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use fabriq_verbs::{AccessFlags, MemoryRegion, ProtectionDomain};
use parking_lot::Mutex;

use super::PoolError;

/// Bounds of a [`RegCache`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct RegCacheConfig {
    /// Most entries kept. Default 256.
    pub max_entries: usize,
    /// Most bytes covered by entries. Default 1 GiB. A single region larger than this is
    /// registered and returned but not cached.
    pub max_bytes: u64,
}

impl Default for RegCacheConfig {
    fn default() -> Self {
        RegCacheConfig {
            max_entries: 256,
            max_bytes: 1 << 30,
        }
    }
}

/// Counters of a [`RegCache`]; `entries` and `bytes` are current, the rest cumulative.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RegCacheStats {
    /// Lookups served by an existing entry.
    pub hits: u64,
    /// Lookups that registered memory.
    pub misses: u64,
    /// Entries dropped by the LRU bound or replaced by a merged registration.
    pub evictions: u64,
    /// Entries dropped by [`RegCache::invalidate`] or [`RegCache::clear`].
    pub invalidations: u64,
    /// Entries now.
    pub entries: u64,
    /// Bytes covered by entries now.
    pub bytes: u64,
}

struct Entry {
    len: u64,
    access: AccessFlags,
    mr: Arc<MemoryRegion>,
    /// Last use, key in `Inner::lru`.
    tick: u64,
}

#[derive(Default)]
struct Inner {
    /// Start address → entry; ranges never overlap.
    by_addr: BTreeMap<u64, Entry>,
    /// Last-use tick → start address.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    stats: RegCacheStats,
}

impl Inner {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn remove(&mut self, addr: u64) -> Option<Entry> {
        let e = self.by_addr.remove(&addr)?;
        self.lru.remove(&e.tick);
        self.stats.entries -= 1;
        self.stats.bytes -= e.len;
        Some(e)
    }

    /// Start addresses of entries overlapping `[start, end)`.
    fn overlapping(&self, start: u64, end: u64) -> Vec<u64> {
        let mut out = Vec::new();
        for (&a, e) in self.by_addr.range(..end).rev() {
            if a + e.len <= start {
                break; // entries do not overlap each other, so none further left reaches start
            }
            out.push(a);
        }
        out
    }
}

/// An LRU cache of registrations of caller memory. Thread-safe; usually one per worker, reached
/// through [`super::MemPool::reg_cache`].
pub struct RegCache {
    pd: ProtectionDomain,
    cfg: RegCacheConfig,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for RegCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegCache")
            .field("cfg", &self.cfg)
            .field("stats", &self.stats())
            .finish()
    }
}

impl RegCache {
    /// An empty cache registering in `pd`.
    pub fn new(pd: &ProtectionDomain, cfg: RegCacheConfig) -> RegCache {
        RegCache {
            pd: pd.clone(),
            cfg,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// A region covering `[ptr, ptr+len)` with at least `access`: a cached one if an entry
    /// covers the range with those rights, else a new registration (merged with overlapping
    /// entries) that is cached.
    ///
    /// # Safety
    /// `[ptr, ptr+len)` must be valid, writable memory of this process, and it must stay
    /// allocated and mapped until (a) [`RegCache::invalidate`] has been called for a range that
    /// covers it (or the cache was cleared or dropped) **and** (b) every region returned for it
    /// has been dropped. When a request overlaps earlier entries, the merged registration also
    /// covers their ranges, which the callers that registered them vouched for under the same
    /// contract.
    pub unsafe fn register(
        &self,
        ptr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Arc<MemoryRegion>, PoolError> {
        if ptr.is_null() || len == 0 {
            return Err(PoolError::InvalidRange(format!(
                "{len} bytes at {ptr:p}: null or empty"
            )));
        }
        let start = ptr as usize as u64;
        let end = start
            .checked_add(len as u64)
            .ok_or_else(|| PoolError::InvalidRange(format!("{len} bytes at {ptr:p} wrap")))?;
        let mut inner = self.inner.lock();
        if let Some((&a, e)) = inner.by_addr.range(..=start).next_back() {
            if a + e.len >= end && e.access.contains(access) {
                let mr = Arc::clone(&e.mr);
                let old = e.tick;
                let tick = inner.next_tick();
                inner.lru.remove(&old);
                inner.lru.insert(tick, a);
                if let Some(e) = inner.by_addr.get_mut(&a) {
                    e.tick = tick;
                }
                inner.stats.hits += 1;
                return Ok(mr);
            }
        }
        // Miss: register the union with everything it overlaps, with the union of rights.
        let overlapping = inner.overlapping(start, end);
        let (mut lo, mut hi, mut rights) = (start, end, access);
        for a in &overlapping {
            if let Some(e) = inner.by_addr.get(a) {
                lo = lo.min(*a);
                hi = hi.max(a + e.len);
                rights |= e.access;
            }
        }
        let union_len = usize::try_from(hi - lo)
            .map_err(|_| PoolError::InvalidRange("merged range too large".into()))?;
        // SAFETY: `[start, end)` is valid under this function's contract; the rest of
        // `[lo, hi)` is covered by live entries, whose memory their registrants keep valid until
        // they invalidate it (which would have removed those entries).
        let mr = unsafe { self.pd.reg_mr(lo as usize as *mut u8, union_len, rights)? };
        let mr = Arc::new(mr);
        inner.stats.misses += 1;
        for a in overlapping {
            if inner.remove(a).is_some() {
                inner.stats.evictions += 1;
            }
        }
        let size = hi - lo;
        if size > self.cfg.max_bytes || self.cfg.max_entries == 0 {
            return Ok(mr); // too big to cache: registered for this use only
        }
        // Make room, least recently used first.
        while inner.stats.entries as usize >= self.cfg.max_entries
            || inner.stats.bytes + size > self.cfg.max_bytes
        {
            let Some((_, &victim)) = inner.lru.iter().next() else {
                break;
            };
            inner.remove(victim);
            inner.stats.evictions += 1;
        }
        let tick = inner.next_tick();
        inner.by_addr.insert(
            lo,
            Entry {
                len: size,
                access: rights,
                mr: Arc::clone(&mr),
                tick,
            },
        );
        inner.lru.insert(tick, lo);
        inner.stats.entries += 1;
        inner.stats.bytes += size;
        Ok(mr)
    }

    /// Drop every entry overlapping `[ptr, ptr+len)`; call it before freeing or unmapping that
    /// memory. Returns how many entries were dropped. Regions still held by callers stay
    /// registered until they are dropped.
    pub fn invalidate(&self, ptr: *const u8, len: usize) -> usize {
        let start = ptr as usize as u64;
        let end = start.saturating_add(len as u64);
        let mut inner = self.inner.lock();
        let hits = inner.overlapping(start, end.max(start + 1));
        let n = hits.len();
        for a in hits {
            inner.remove(a);
        }
        inner.stats.invalidations += n as u64;
        n
    }

    /// Drop every entry.
    pub fn clear(&self) {
        let mut inner = self.inner.lock();
        let n = inner.by_addr.len() as u64;
        inner.by_addr.clear();
        inner.lru.clear();
        inner.stats.entries = 0;
        inner.stats.bytes = 0;
        inner.stats.invalidations += n;
    }

    /// Counters.
    pub fn stats(&self) -> RegCacheStats {
        self.inner.lock().stats
    }

    /// The bounds.
    pub fn config(&self) -> &RegCacheConfig {
        &self.cfg
    }
}
