//! Pre-registered memory for the data path: one [`MemPool`] per worker (and protection domain).
//!
//! What it owns:
//! - **Slabs** of [`PoolConfig::slab_size`] bytes (2 MiB by default) obtained from the provider
//!   with `ProtectionDomain::alloc_mr`, so each slab is registered exactly once and lives where
//!   the provider moves bytes fastest (for `shm`, a shared segment the peer maps, which is what
//!   makes one-sided access and zero-copy work). A slab is one huge page: the providers back
//!   such regions with huge pages when the system has them (the kernel's explicit pool, else
//!   transparent huge pages; base pages otherwise), and [`PoolStats::huge_page_bytes`] says
//!   how many slab bytes got them.
//! - **Size classes**: powers of two from [`PoolConfig::min_class`] (64 B) to
//!   [`PoolConfig::max_class`] (the rendezvous chunk size, 64 KiB by default). A slab is carved
//!   into one class at a time; allocation and free are O(1) stack operations on side metadata
//!   (never on the buffer memory itself, which peers may write).
//! - **[`PoolBuf`]**: an owned buffer that derefs to `[u8]`, knows its [`fabriq_verbs::Sge`],
//!   lkey and rkey, and returns to its pool on drop: directly on the owning thread, through a
//!   lock-free queue (crossbeam `SegQueue`) from any other thread.
//! - **Idle reclaim**: entirely free slabs above [`PoolConfig::max_idle_bytes`] are deregistered
//!   and returned to the provider, on free and from [`MemPool::reclaim`] (the worker's timer).
//! - **Large buffers**: [`MemPool::alloc_large`] gives a pool-owned buffer with a dedicated
//!   region; caller-owned memory above the largest class goes through the [`RegCache`], an LRU
//!   registration cache bounded by entries and bytes.
//! - **Counters**: [`PoolStats`].
//!
//! What it does not do: post work requests or know about channels. The channel posts a
//! buffer's SGE and keeps the [`PoolBuf`] alive until the completion arrives.
//!
//! Threads: the pool is `!Send`: it is created on, and used by, one worker thread. Buffers are
//! `Send` and may be dropped anywhere. See `docs/arch/mempool.md`.

mod class;
#[allow(unsafe_code)]
mod pool;
#[allow(unsafe_code)]
mod regcache;
#[cfg(test)]
#[allow(unsafe_code)]
pub(crate) mod testing;
#[cfg(test)]
#[allow(unsafe_code)]
mod tests;

pub use class::SizeClasses;
pub use pool::{MemPool, PoolBuf};
pub use regcache::{RegCache, RegCacheConfig, RegCacheStats};

use fabriq_verbs::{AccessFlags, VerbsError};

/// One mebibyte.
const MIB: usize = 1 << 20;

/// Errors of the memory pool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The verbs layer refused a registration or allocation.
    #[error("verbs: {0}")]
    Verbs(#[from] VerbsError),
    /// The configuration is inconsistent.
    #[error("invalid pool configuration: {0}")]
    InvalidConfig(String),
    /// A request for more than the largest size class; use [`MemPool::alloc_large`] or the
    /// [`RegCache`].
    #[error("{len} bytes exceed the largest size class ({max_class} bytes)")]
    TooLarge {
        /// Requested length.
        len: usize,
        /// Largest class.
        max_class: usize,
    },
    /// Registering more memory would exceed [`PoolConfig::max_registered_bytes`].
    #[error("pool limit reached: {registered} + {requested} bytes exceed {limit}")]
    Exhausted {
        /// Bytes registered now.
        registered: usize,
        /// Bytes the request needed.
        requested: usize,
        /// The configured limit.
        limit: usize,
    },
    /// A zero-length or null range given to the registration cache, or a range that wraps.
    #[error("invalid memory range: {0}")]
    InvalidRange(String),
}

/// Configuration of a [`MemPool`]. Serialisable so it can sit in the middleware's config file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PoolConfig {
    /// Bytes per slab (one registration). Default 2 MiB. A multiple of `max_class`.
    pub slab_size: usize,
    /// Smallest size class, a power of two ≥ 8. Default 64 B.
    pub min_class: usize,
    /// Largest size class, a power of two ≤ `slab_size`: the rendezvous chunk size. Default
    /// 64 KiB.
    pub max_class: usize,
    /// Access rights every slab is registered with. Default `LOCAL_WRITE | REMOTE_READ`
    /// (receives land in pool buffers; the rendezvous receiver READs the sender's buffer).
    pub access: AccessFlags,
    /// High-water mark of idle registered memory: entirely free slabs beyond this many bytes are
    /// deregistered. Default 8 MiB.
    pub max_idle_bytes: usize,
    /// Hard limit on bytes registered by the pool (slabs and large buffers; not the registration
    /// cache, which has its own bound). `None`: unlimited. Default `None`. Idle slabs count
    /// until an allocation needs their room: then they go first.
    pub max_registered_bytes: Option<usize>,
    /// Bounds of the registration cache.
    pub reg_cache: RegCacheConfig,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            slab_size: 2 * MIB,
            min_class: 64,
            max_class: 64 * 1024,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
            max_idle_bytes: 8 * MIB,
            max_registered_bytes: None,
            reg_cache: RegCacheConfig::default(),
        }
    }
}

impl PoolConfig {
    /// Set the largest class to the rendezvous chunk size (rounded up to a power of two, and the
    /// slab grown to hold at least one chunk).
    pub fn with_chunk_size(mut self, chunk: usize) -> Self {
        self.max_class = chunk.max(self.min_class).next_power_of_two();
        if self.slab_size < self.max_class {
            self.slab_size = self.max_class;
        }
        self
    }

    /// Check the invariants the pool relies on.
    pub fn validate(&self) -> Result<(), PoolError> {
        let bad = |m: String| Err(PoolError::InvalidConfig(m));
        if !self.min_class.is_power_of_two() || self.min_class < 8 {
            return bad(format!(
                "min_class {} is not a power of two >= 8",
                self.min_class
            ));
        }
        if !self.max_class.is_power_of_two() || self.max_class < self.min_class {
            return bad(format!(
                "max_class {} is not a power of two >= min_class {}",
                self.max_class, self.min_class
            ));
        }
        if self.slab_size < self.max_class || self.slab_size % self.max_class != 0 {
            return bad(format!(
                "slab_size {} is not a multiple of max_class {}",
                self.slab_size, self.max_class
            ));
        }
        if self.max_class > u32::MAX as usize || self.slab_size / self.min_class > u32::MAX as usize
        {
            return bad("classes or slab too large".into());
        }
        self.access.validate()?;
        Ok(())
    }
}

/// A snapshot of a pool's counters ([`MemPool::stats`]). Byte counts are current values;
/// `registrations` … `cache_misses` are cumulative since the pool was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolStats {
    /// Bytes registered now by the pool: slabs plus large buffers.
    pub bytes_registered: u64,
    /// Bytes handed out now (class size of each slab buffer, length of each large buffer).
    pub bytes_in_use: u64,
    /// Bytes in entirely free slabs kept for reuse (≤ the high-water mark after a reclaim).
    pub bytes_idle: u64,
    /// Slabs registered now.
    pub slabs: u64,
    /// Bytes of those slabs on huge pages (explicit or transparent; see
    /// [`fabriq_verbs::PageKind`]): all of them where the system has huge pages, none
    /// otherwise.
    pub huge_page_bytes: u64,
    /// Large buffers outstanding now.
    pub large_buffers: u64,
    /// Registrations made by the pool (slabs and large buffers).
    pub registrations: u64,
    /// Deregistrations made by the pool (reclaimed slabs, freed large buffers).
    pub deregistrations: u64,
    /// Buffers allocated.
    pub allocs: u64,
    /// Buffers freed from a thread other than the owner (returned through the queue).
    pub remote_frees: u64,
    /// Registration-cache hits.
    pub cache_hits: u64,
    /// Registration-cache misses (each one a registration).
    pub cache_misses: u64,
    /// Registration-cache entries evicted (LRU bound, merge or invalidation).
    pub cache_evictions: u64,
    /// Bytes currently covered by registration-cache entries.
    pub cache_bytes: u64,
}
