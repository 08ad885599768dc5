//! The region cache: the registered regions of released connections (each channel's receive
//! ring and send-header slots), kept beside the QP cache for the next connection.
//!
//! A connection's rings are registered memory, and on most providers getting them is not free:
//! a NIC registration pins and maps pages, the `shm` provider carves them from its segment,
//! and the first touch of each fresh page faults; giving them back costs as much again (`shm`
//! punches the pages out of its segment, a TLB shootdown across every CPU of the process). A
//! connection that is closed cleanly (its QP drained: nothing posted on it can still complete
//! into its memory) leaves its regions here, and the next connection of the same geometry
//! takes them instead of registering new ones. A ring's old bytes are never read: a receive
//! completion names the bytes it placed, and a header slot is written before each send.
//! Bounded: beyond `capacity` regions a released one is deregistered.

use std::sync::atomic::{AtomicU64, Ordering};

use fabriq_verbs::{AccessFlags, MemoryRegion};
use parking_lot::Mutex;

/// A bounded set of idle registered regions of one protection domain. Thread-safe.
#[derive(Debug)]
pub struct RegionCache {
    regions: Mutex<Vec<MemoryRegion>>,
    capacity: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl RegionCache {
    /// An empty cache holding at most `capacity` regions.
    pub fn new(capacity: usize) -> RegionCache {
        RegionCache {
            regions: Mutex::new(Vec::new()),
            capacity,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// A cached region of exactly `len` bytes and `access` (a hit), or `None` (a miss: the
    /// caller registers one).
    pub fn take(&self, len: usize, access: AccessFlags) -> Option<MemoryRegion> {
        let mr = {
            let mut regions = self.regions.lock();
            regions
                .iter()
                .rposition(|mr| mr.len() == len && mr.access() == access)
                .map(|i| regions.swap_remove(i))
        };
        match &mr {
            Some(_) => self.hits.fetch_add(1, Ordering::Relaxed),
            None => self.misses.fetch_add(1, Ordering::Relaxed),
        };
        mr
    }

    /// Keep `mr` for a later [`RegionCache::take`]; false if it was deregistered instead (the
    /// cache is full). Only a region nothing can still write into may be offered: every work
    /// request that named it has completed.
    pub fn put(&self, mr: MemoryRegion) -> bool {
        let mut regions = self.regions.lock();
        if regions.len() >= self.capacity {
            return false;
        }
        regions.push(mr);
        true
    }

    /// Regions held now.
    pub fn len(&self) -> usize {
        self.regions.lock().len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes that found a region.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Takes that found none.
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }

    /// Deregister every cached region.
    pub fn clear(&self) {
        self.regions.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabriq_verbs::Context;

    #[test]
    fn a_region_is_taken_back_only_with_its_length_and_access_and_the_cache_is_bounded() {
        let ctx = Context::open("shm0").expect("shm0");
        let pd = ctx.alloc_pd().expect("pd");
        let cache = RegionCache::new(2);
        let w = AccessFlags::LOCAL_WRITE;
        let a = pd.alloc_mr(8192, w).expect("mr");
        let a_addr = a.as_ptr() as usize;
        assert!(cache.put(a));
        assert!(cache.take(4096, w).is_none(), "another length");
        assert!(
            cache.take(8192, w | AccessFlags::REMOTE_READ).is_none(),
            "other rights"
        );
        let back = cache.take(8192, w).expect("the same geometry");
        assert_eq!(back.as_ptr() as usize, a_addr, "the very region");
        assert_eq!((cache.hits(), cache.misses()), (1, 2));
        assert!(cache.put(back));
        assert!(cache.put(pd.alloc_mr(4096, w).expect("mr")));
        assert!(
            !cache.put(pd.alloc_mr(4096, w).expect("mr")),
            "beyond capacity"
        );
        assert_eq!(cache.len(), 2);
        cache.clear();
        assert!(cache.is_empty());
    }
}
