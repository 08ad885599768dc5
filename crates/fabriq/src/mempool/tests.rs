//! Unit tests of the pool and the registration cache on a heap-backed verbs context.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use fabriq_verbs::AccessFlags;

use super::testing::heap_pd;
use super::*;

const SLAB: usize = 2 << 20;

fn pool_with(cfg: PoolConfig) -> (MemPool, Arc<testing::HeapCounters>) {
    let (pd, counters) = heap_pd();
    (MemPool::new(&pd, cfg).unwrap(), counters)
}

fn pool() -> (MemPool, Arc<testing::HeapCounters>) {
    pool_with(PoolConfig::default())
}

#[test]
fn every_class_allocates_frees_and_reuses_its_slot() {
    let (mut p, _) = pool();
    let classes = p.classes();
    assert_eq!(classes.count(), 11);
    for k in 0..classes.count() {
        let size = classes.size_of(k);
        let mut b = p.alloc(size).unwrap();
        assert_eq!((b.len(), b.capacity()), (size, size));
        assert_eq!(b.addr() % size.min(4096) as u64, 0, "class-aligned");
        b.fill(k as u8);
        assert!(b.iter().all(|&x| x == k as u8));
        let addr = b.addr();
        drop(b);
        let b = p.alloc(size / 2 + 1).unwrap();
        assert_eq!(b.addr(), addr, "LIFO reuse of the slot just freed");
        assert_eq!(b.capacity(), size);
    }
    assert!(matches!(
        p.alloc(64 * 1024 + 1),
        Err(PoolError::TooLarge { len: 65537, .. })
    ));
}

#[test]
fn buffers_describe_their_registration() {
    let (mut p, _) = pool();
    let mut b = p.alloc(100).unwrap();
    assert!(b.fill_from(b"hello"));
    assert_eq!(&b[..], b"hello");
    let sge = b.sge();
    assert_eq!((sge.addr, sge.length, sge.lkey), (b.addr(), 5, b.lkey()));
    assert_eq!(b.sge_full().length, 128);
    assert_eq!(b.remote().rkey, b.rkey());
    assert_eq!(b.remote().addr, b.addr());
    assert!(!b.fill_from(&[0u8; 129]), "refuses more than capacity");
    assert_eq!(b.len(), 5, "unchanged after a refused fill");
    b.spare_capacity_mut()[127] = 9;
    b.set_len(128);
    assert_eq!(b[127], 9);
}

#[test]
#[should_panic(expected = "beyond capacity")]
fn set_len_beyond_capacity_is_a_caller_bug() {
    let (mut p, _) = pool();
    let mut b = p.alloc(64).unwrap();
    b.set_len(65);
}

#[test]
fn live_buffers_never_overlap_and_slabs_are_registered_once() {
    let (mut p, counters) = pool();
    // 2 MiB / 4 KiB = 512 buffers per slab: 1000 buffers need two slabs.
    let bufs: Vec<PoolBuf> = (0..1000).map(|_| p.alloc(4096).unwrap()).collect();
    let mut ranges: Vec<(u64, u64)> = bufs.iter().map(|b| (b.addr(), b.addr() + 4096)).collect();
    ranges.sort_unstable();
    assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "overlap");
    let s = p.stats();
    assert_eq!(s.slabs, 2);
    assert_eq!(s.registrations, 2);
    assert_eq!(counters.registered.load(Ordering::SeqCst), 2);
    assert_eq!(s.bytes_registered, 2 * SLAB as u64);
    assert_eq!(s.bytes_in_use, 1000 * 4096);
    assert_eq!(s.allocs, 1000);
    drop(bufs);
    let s = p.stats();
    assert_eq!(s.bytes_in_use, 0);
    assert_eq!(s.deregistrations, 0, "4 MiB idle is under the 8 MiB mark");
}

#[test]
fn a_free_slab_serves_another_class() {
    let (mut p, counters) = pool();
    let small: Vec<PoolBuf> = (0..(2 * SLAB / 64)).map(|_| p.alloc(64).unwrap()).collect();
    assert_eq!(p.stats().slabs, 2);
    drop(small);
    p.reclaim();
    assert_eq!(p.stats().bytes_idle, 2 * SLAB as u64);
    let big: Vec<PoolBuf> = (0..64).map(|_| p.alloc(64 * 1024).unwrap()).collect();
    assert_eq!(
        p.stats().slabs,
        2,
        "idle slabs re-carved, nothing registered"
    );
    assert_eq!(counters.registered.load(Ordering::SeqCst), 2);
    drop(big);
}

#[test]
fn frees_from_other_threads_come_back_through_the_queue() {
    let (mut p, _) = pool();
    let bufs: Vec<PoolBuf> = (0..512).map(|_| p.alloc(4096).unwrap()).collect();
    let addrs: std::collections::HashSet<u64> = bufs.iter().map(PoolBuf::addr).collect();
    assert_eq!(p.stats().slabs, 1);
    std::thread::spawn(move || drop(bufs)).join().unwrap();
    let s = p.stats();
    assert_eq!(s.bytes_in_use, 512 * 4096, "not taken back before a drain");
    // The slab is full, so this alloc drains the queue and reuses a slot instead of
    // registering a second slab.
    let b = p.alloc(4096).unwrap();
    assert!(addrs.contains(&b.addr()));
    let s = p.stats();
    assert_eq!(s.slabs, 1);
    assert_eq!(s.remote_frees, 512);
    assert_eq!(s.bytes_in_use, 4096);
}

#[test]
fn buffers_may_outlive_their_pool_on_any_thread() {
    let (mut p, counters) = pool();
    let mut a = p.alloc(1000).unwrap();
    let b = p.alloc_large(1 << 20).unwrap();
    a.fill(7);
    drop(p);
    assert_eq!(counters.live.load(Ordering::SeqCst), 2, "still registered");
    assert!(a.iter().all(|&x| x == 7));
    std::thread::spawn(move || drop((a, b))).join().unwrap();
    assert_eq!(counters.live.load(Ordering::SeqCst), 0, "all deregistered");
}

#[test]
fn reclaim_returns_idle_slabs_above_the_mark() {
    let cfg = PoolConfig {
        max_idle_bytes: SLAB, // keep one idle slab
        ..PoolConfig::default()
    };
    let (mut p, counters) = pool_with(cfg);
    let bufs: Vec<PoolBuf> = (0..4 * 32).map(|_| p.alloc(64 * 1024).unwrap()).collect();
    assert_eq!(p.stats().slabs, 4);
    drop(bufs);
    // On free: every slab but the class's last partial one went idle, and idle memory above
    // the mark was deregistered at once.
    let s = p.stats();
    assert_eq!(s.slabs, 2, "{s:?}");
    assert_eq!(s.bytes_idle, SLAB as u64);
    assert_eq!(s.deregistrations, 2);
    // The timer's reclaim turns the last empty carved slab idle and trims to the mark.
    let released = p.reclaim();
    assert_eq!(released, SLAB);
    let s = p.stats();
    assert_eq!(
        (s.slabs, s.bytes_idle, s.deregistrations),
        (1, SLAB as u64, 3)
    );
    assert_eq!(counters.live.load(Ordering::SeqCst), 1);
    assert_eq!(s.bytes_registered, SLAB as u64);
    // Nothing is reclaimed while in use.
    let _held = p.alloc(64).unwrap();
    assert_eq!(p.reclaim(), 0);
    assert_eq!(p.stats().slabs, 1);
}

#[test]
fn reclaim_counts_the_slabs_remote_frees_emptied_and_the_gauge_follows_registrations() {
    let (mut p, counters) = pool_with(PoolConfig {
        max_idle_bytes: SLAB, // keep one idle slab
        ..PoolConfig::default()
    });
    let gauge = p.registered_gauge();
    let bufs: Vec<PoolBuf> = (0..4 * 32).map(|_| p.alloc(64 * 1024).unwrap()).collect();
    assert_eq!(gauge.load(Ordering::Relaxed), 4 * SLAB as u64);
    // Freed on another thread: only queued back, nothing deregistered yet.
    std::thread::spawn(move || drop(bufs)).join().unwrap();
    assert_eq!(gauge.load(Ordering::Relaxed), 4 * SLAB as u64);
    assert_eq!(counters.live.load(Ordering::SeqCst), 4);
    // The reclaim takes them back (emptying slabs that go idle and above the mark on the way)
    // and trims the rest: everything but the one idle slab the mark keeps, all counted.
    assert_eq!(p.reclaim(), 3 * SLAB);
    assert_eq!(counters.live.load(Ordering::SeqCst), 1);
    assert_eq!(gauge.load(Ordering::Relaxed), SLAB as u64);
    assert_eq!(p.stats().bytes_registered, SLAB as u64);

    // A large buffer counts while it lives; dropped on another thread, it is deregistered
    // there, and the gauge says so at once (the counters follow when the pool drains).
    let big = p.alloc_large(3 << 20).unwrap();
    assert_eq!(gauge.load(Ordering::Relaxed), SLAB as u64 + (3 << 20));
    std::thread::spawn(move || drop(big)).join().unwrap();
    assert_eq!(gauge.load(Ordering::Relaxed), SLAB as u64);
    assert_eq!(
        p.reclaim(),
        0,
        "the large buffer was not the reclaim's to deregister"
    );
    assert_eq!(p.stats().bytes_registered, SLAB as u64);
    // The gauge outlives the pool while its buffers do, and reads 0 once all is gone.
    let last = p.alloc(64).unwrap();
    drop(p);
    assert!(gauge.load(Ordering::Relaxed) > 0);
    drop(last);
    assert_eq!(gauge.load(Ordering::Relaxed), 0);
}

#[test]
fn at_the_bound_kept_memory_gives_way_before_an_allocation_fails() {
    let (mut p, counters) = pool_with(PoolConfig {
        max_idle_bytes: 4 * SLAB, // the mark would keep all four
        max_registered_bytes: Some(4 * SLAB),
        ..PoolConfig::default()
    });
    let bufs: Vec<PoolBuf> = (0..4 * 32).map(|_| p.alloc(64 * 1024).unwrap()).collect();
    drop(bufs);
    assert_eq!(
        p.stats().bytes_registered,
        4 * SLAB as u64,
        "kept under the mark"
    );
    // Another class, and a large buffer: both need room the idle slabs hold.
    let big = p.alloc_large(3 * SLAB).expect("the idle slabs give way");
    let small = p.alloc(64).expect("one slab left under the bound");
    assert_eq!(counters.live.load(Ordering::SeqCst), 2);
    assert!(matches!(
        p.alloc_large(SLAB),
        Err(PoolError::Exhausted { .. })
    ));
    // Frees from another thread count too: taken back before the answer is no.
    std::thread::spawn(move || drop(big)).join().unwrap();
    let again = p.alloc_large(2 * SLAB).expect("the remote free made room");
    drop((small, again));
}

#[test]
fn alloc_free_ping_pong_does_not_churn_registrations() {
    let (mut p, counters) = pool_with(PoolConfig {
        max_idle_bytes: 0,
        ..PoolConfig::default()
    });
    for _ in 0..10_000 {
        let b = p.alloc(256).unwrap();
        drop(b);
    }
    assert_eq!(counters.registered.load(Ordering::SeqCst), 1);
    assert_eq!(p.stats().deregistrations, 0);
}

#[test]
fn the_registration_limit_is_a_typed_error() {
    let (mut p, _) = pool_with(PoolConfig {
        max_registered_bytes: Some(SLAB),
        ..PoolConfig::default()
    });
    let _one: Vec<PoolBuf> = (0..32).map(|_| p.alloc(64 * 1024).unwrap()).collect();
    assert!(matches!(
        p.alloc(64 * 1024),
        Err(PoolError::Exhausted { limit, .. }) if limit == SLAB
    ));
    assert!(matches!(p.alloc_large(1), Err(PoolError::Exhausted { .. })));
    // A smaller class still has room in... nothing: the only slab is carved for 64 KiB.
    assert!(p.alloc(64).is_err());
}

#[test]
fn provider_failures_surface_as_verbs_errors() {
    let (mut p, counters) = pool();
    counters.fail_after.store(1, Ordering::SeqCst);
    let _a = p.alloc(64).unwrap();
    let _b = p.alloc(64 * 1024).unwrap_err();
    assert!(matches!(
        p.alloc(64 * 1024),
        Err(PoolError::Verbs(fabriq_verbs::VerbsError::LimitExceeded(_)))
    ));
}

#[test]
fn large_buffers_have_their_own_registration() {
    let (mut p, counters) = pool();
    let mut b = p.alloc_any(1 << 20).unwrap();
    assert!(b.is_large());
    assert_eq!((b.len(), b.capacity()), (1 << 20, 1 << 20));
    b[(1 << 20) - 1] = 1;
    let s = p.stats();
    assert_eq!((s.large_buffers, s.bytes_in_use), (1, 1 << 20));
    assert_eq!(counters.live.load(Ordering::SeqCst), 1);
    drop(b);
    let s = p.stats();
    assert_eq!(
        (s.large_buffers, s.bytes_in_use, s.bytes_registered),
        (0, 0, 0)
    );
    assert_eq!((s.registrations, s.deregistrations), (1, 1));
    assert_eq!(counters.live.load(Ordering::SeqCst), 0);
    assert!(!p.alloc_any(100).unwrap().is_large());
}

#[test]
fn bad_configurations_are_refused() {
    let (pd, _) = heap_pd();
    for cfg in [
        PoolConfig {
            min_class: 48,
            ..PoolConfig::default()
        },
        PoolConfig {
            max_class: 32,
            ..PoolConfig::default()
        },
        PoolConfig {
            slab_size: 3 << 20,
            max_class: 1 << 21,
            ..PoolConfig::default()
        },
        PoolConfig {
            access: AccessFlags::REMOTE_WRITE,
            ..PoolConfig::default()
        },
    ] {
        assert!(MemPool::new(&pd, cfg).is_err());
    }
    let cfg = PoolConfig::default().with_chunk_size(1 << 22);
    assert_eq!((cfg.max_class, cfg.slab_size), (1 << 22, 1 << 22));
    assert!(cfg.validate().is_ok());
    let cfg = PoolConfig::default().with_chunk_size(100_000);
    assert_eq!(cfg.max_class, 131_072);
}

// ----- registration cache -----

fn user_buffer(len: usize) -> Vec<u8> {
    vec![0u8; len]
}

#[test]
fn reg_cache_registers_a_buffer_once() {
    let (pd, counters) = heap_pd();
    let cache = RegCache::new(&pd, RegCacheConfig::default());
    let mut buf = user_buffer(1 << 20);
    let ptr = buf.as_mut_ptr();
    // SAFETY: `buf` outlives the cache's use of it; invalidated before it is dropped.
    let mr1 = unsafe { cache.register(ptr, buf.len(), AccessFlags::REMOTE_READ) }.unwrap();
    // SAFETY: as above.
    let mr2 = unsafe { cache.register(ptr, buf.len(), AccessFlags::REMOTE_READ) }.unwrap();
    // SAFETY: as above; a sub-range is covered by the cached entry.
    let mr3 = unsafe { cache.register(ptr.add(4096), 8192, AccessFlags::empty()) }.unwrap();
    assert!(Arc::ptr_eq(&mr1, &mr2) && Arc::ptr_eq(&mr1, &mr3));
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.entries, s.bytes), (2, 1, 1, 1 << 20));
    assert_eq!(counters.registered.load(Ordering::SeqCst), 1);
    // More rights than cached: a new registration with the union of rights replaces it.
    // SAFETY: as above.
    let mr4 = unsafe { cache.register(ptr, 4096, AccessFlags::LOCAL_WRITE) }.unwrap();
    assert!(!Arc::ptr_eq(&mr1, &mr4));
    assert!(mr4
        .access()
        .contains(AccessFlags::REMOTE_READ | AccessFlags::LOCAL_WRITE));
    assert_eq!(mr4.len(), 1 << 20);
    assert_eq!(cache.stats().entries, 1);
    assert_eq!(cache.invalidate(ptr, buf.len()), 1);
    assert_eq!(cache.stats().entries, 0);
    drop((mr1, mr2, mr3, mr4));
    assert_eq!(counters.live.load(Ordering::SeqCst), 0);
    drop(buf);
}

#[test]
fn reg_cache_merges_overlapping_ranges() {
    let (pd, _) = heap_pd();
    let cache = RegCache::new(&pd, RegCacheConfig::default());
    let mut buf = user_buffer(3 * 4096);
    let p = buf.as_mut_ptr();
    // SAFETY: `buf` outlives every use below and is invalidated before being dropped.
    let a = unsafe { cache.register(p, 2 * 4096, AccessFlags::empty()) }.unwrap();
    // SAFETY: as above.
    let b = unsafe { cache.register(p.add(4096), 2 * 4096, AccessFlags::empty()) }.unwrap();
    assert_eq!(b.addr(), p as u64);
    assert_eq!(b.len(), 3 * 4096, "union of both ranges");
    // Both halves now hit the merged entry.
    // SAFETY: as above.
    let c = unsafe { cache.register(p, 2 * 4096, AccessFlags::empty()) }.unwrap();
    assert!(Arc::ptr_eq(&b, &c));
    let s = cache.stats();
    assert_eq!((s.misses, s.hits, s.evictions, s.entries), (2, 1, 1, 1));
    cache.invalidate(p, buf.len());
    drop((a, b, c));
    drop(buf);
}

#[test]
fn reg_cache_evicts_least_recently_used_within_its_bounds() {
    let (pd, counters) = heap_pd();
    let cache = RegCache::new(
        &pd,
        RegCacheConfig {
            max_entries: 2,
            max_bytes: 3 * 4096,
        },
    );
    let mut bufs: Vec<Vec<u8>> = (0..4).map(|_| user_buffer(4096)).collect();
    let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let reg = |i: usize| {
        // SAFETY: `bufs` outlives the cache (cleared below before the buffers drop).
        drop(unsafe { cache.register(ptrs[i], 4096, AccessFlags::empty()) }.unwrap())
    };
    reg(0);
    reg(1);
    reg(0); // 0 is now more recent than 1
    reg(2); // evicts 1
    let s = cache.stats();
    assert_eq!((s.entries, s.evictions, s.hits, s.misses), (2, 1, 1, 3));
    reg(0);
    assert_eq!(cache.stats().hits, 2, "0 survived");
    reg(1);
    assert_eq!(cache.stats().misses, 4, "1 was evicted");
    assert_eq!(
        counters.live.load(Ordering::SeqCst),
        2,
        "evicted regions deregistered"
    );
    // Bytes bound: an entry larger than max_bytes is registered but not cached.
    let mut big = user_buffer(4 * 4096);
    // SAFETY: `big` outlives the returned region.
    let r = unsafe { cache.register(big.as_mut_ptr(), big.len(), AccessFlags::empty()) }.unwrap();
    assert_eq!(r.len(), 4 * 4096);
    assert_eq!(cache.stats().entries, 2);
    drop(r);
    cache.clear();
    assert_eq!(counters.live.load(Ordering::SeqCst), 0);
    drop(bufs);
}

#[test]
fn reg_cache_refuses_empty_and_null_ranges() {
    let (pd, _) = heap_pd();
    let cache = RegCache::new(&pd, RegCacheConfig::default());
    let mut buf = user_buffer(16);
    // SAFETY: invalid ranges are refused before any registration.
    unsafe {
        assert!(matches!(
            cache.register(std::ptr::null_mut(), 16, AccessFlags::empty()),
            Err(PoolError::InvalidRange(_))
        ));
        assert!(matches!(
            cache.register(buf.as_mut_ptr(), 0, AccessFlags::empty()),
            Err(PoolError::InvalidRange(_))
        ));
    }
}

#[test]
fn pool_stats_include_the_registration_cache() {
    let (mut p, _) = pool();
    let mut buf = user_buffer(1 << 20);
    for _ in 0..3 {
        // SAFETY: `buf` outlives the pool's cache entry (cleared below).
        let mr = unsafe {
            p.reg_cache()
                .register(buf.as_mut_ptr(), buf.len(), AccessFlags::empty())
        }
        .unwrap();
        drop(mr);
    }
    let _b = p.alloc(64).unwrap();
    let s = p.stats();
    assert_eq!(
        (s.cache_hits, s.cache_misses, s.cache_bytes),
        (2, 1, 1 << 20)
    );
    assert_eq!(s.bytes_in_use, 64);
    p.reg_cache().clear();
    drop(buf);
}

mod model {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        Free(usize),
        FreeRemote(usize),
        Reclaim,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (0usize..=70_000).prop_map(Op::Alloc),
            3 => any::<usize>().prop_map(Op::Free),
            1 => any::<usize>().prop_map(Op::FreeRemote),
            1 => Just(Op::Reclaim),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

        /// Live buffers never overlap, keep their contents, and the counters match a model.
        #[test]
        fn random_alloc_free_sequences_keep_the_pool_consistent(
            ops in proptest::collection::vec(op(), 1..300)
        ) {
            let (mut p, counters) = pool_with(PoolConfig {
                max_idle_bytes: SLAB,
                ..PoolConfig::default()
            });
            let mut live: Vec<(PoolBuf, u8)> = Vec::new();
            let mut tag = 0u8;
            let mut remote = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        let mut b = p.alloc_any(len).unwrap();
                        tag = tag.wrapping_add(1);
                        b.fill(tag);
                        live.push((b, tag));
                    }
                    Op::Free(i) | Op::FreeRemote(i) if !live.is_empty() => {
                        let (b, t) = live.swap_remove(i % live.len());
                        prop_assert!(b.iter().all(|&x| x == t), "contents changed");
                        if matches!(op, Op::FreeRemote(_)) {
                            remote.push(b);
                        }
                    }
                    Op::Reclaim => {
                        std::thread::spawn({
                            let bufs = std::mem::take(&mut remote);
                            move || drop(bufs)
                        })
                        .join()
                        .unwrap();
                        p.reclaim();
                        prop_assert!(p.stats().bytes_idle <= SLAB as u64);
                    }
                    _ => {}
                }
                let mut ranges: Vec<(u64, u64)> = live
                    .iter()
                    .map(|(b, _)| (b.addr(), b.addr() + b.capacity() as u64))
                    .collect();
                ranges.sort_unstable();
                prop_assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "overlap");
            }
            drop(remote);
            p.drain_returned();
            let s = p.stats();
            let in_use: u64 = live.iter().map(|(b, _)| b.capacity() as u64).sum();
            prop_assert_eq!(s.bytes_in_use, in_use);
            prop_assert_eq!(s.large_buffers, live.iter().filter(|(b, _)| b.is_large()).count() as u64);
            prop_assert_eq!(
                counters.live_bytes.load(Ordering::SeqCst),
                s.bytes_registered,
                "pool's count of registered bytes matches the provider's"
            );
            drop(live);
            p.reclaim();
            let s = p.stats();
            prop_assert_eq!(s.bytes_in_use, 0);
            prop_assert!(s.bytes_registered <= SLAB as u64);
        }
    }
}

#[test]
fn a_pool_buffer_stays_small_enough_to_move_cheaply() {
    // Every eager message's buffer moves through the channel core's queues (queued, in flight,
    // its completion event) by value: the large-buffer region lives behind a box.
    assert!(
        std::mem::size_of::<PoolBuf>() <= 56,
        "PoolBuf is {} bytes",
        std::mem::size_of::<PoolBuf>()
    );
}
