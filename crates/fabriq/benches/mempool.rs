//! Memory-pool hot paths: alloc + free of one buffer per class, a burst of 256, a free from
//! another thread taken back by the owner, and a registration-cache hit.
//!
//! Runs on the first device that opens among `FABRIQ_BENCH_DEVICE` (default `shm0`, then
//! `tcp0`); the pool never calls the provider after its slabs are registered, so the figures are
//! the pool's own.
//!
//! `cargo bench -p fabriq --bench mempool`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use fabriq::mempool::{MemPool, PoolBuf, PoolConfig};
use fabriq_verbs::{AccessFlags, Context, ProtectionDomain};

fn open_pd() -> Option<ProtectionDomain> {
    let wanted = std::env::var("FABRIQ_BENCH_DEVICE").ok();
    let candidates: Vec<String> = match wanted {
        Some(d) => vec![d],
        None => vec!["shm0".into(), "tcp0".into()],
    };
    for dev in candidates {
        match Context::open(&dev).and_then(|c| c.alloc_pd()) {
            Ok(pd) => return Some(pd),
            Err(e) => eprintln!("mempool bench: {dev}: {e}"),
        }
    }
    None
}

fn bench(c: &mut Criterion) {
    let Some(pd) = open_pd() else {
        eprintln!("mempool bench: no device opens; nothing measured");
        return;
    };
    let mut pool = MemPool::new(&pd, PoolConfig::default()).expect("pool");
    let mut g = c.benchmark_group("mempool");
    g.measurement_time(Duration::from_secs(3));
    g.warm_up_time(Duration::from_millis(500));

    for size in [64usize, 4096, 65536] {
        // Warm: the class has a carved slab.
        drop(pool.alloc(size).expect("alloc"));
        g.bench_function(format!("alloc_free/{size}"), |b| {
            b.iter(|| {
                let buf = pool.alloc(black_box(size)).expect("alloc");
                black_box(buf.addr());
                drop(buf);
            })
        });
    }

    g.bench_function("alloc_256_then_free/4096", |b| {
        let mut held: Vec<PoolBuf> = Vec::with_capacity(256);
        b.iter(|| {
            for _ in 0..256 {
                held.push(pool.alloc(4096).expect("alloc"));
            }
            held.clear();
        })
    });

    // Buffers freed on another thread come back through the queue. Per buffer: the owner's
    // alloc, the helper thread's drop (a queue push), the owner's drain; plus the hand-over of
    // each batch of 256 over a channel.
    let (to_helper, helper_rx) = std::sync::mpsc::channel::<Vec<PoolBuf>>();
    let (done_tx, done) = std::sync::mpsc::channel::<()>();
    let helper = std::thread::spawn(move || {
        for bufs in helper_rx {
            drop(bufs);
            if done_tx.send(()).is_err() {
                break;
            }
        }
    });
    g.bench_function("remote_free_batch_256/4096", |b| {
        b.iter_custom(|iters| {
            let rounds = iters.div_ceil(256).max(1);
            let start = Instant::now();
            for _ in 0..rounds {
                let bufs: Vec<PoolBuf> =
                    (0..256).map(|_| pool.alloc(4096).expect("alloc")).collect();
                to_helper.send(bufs).expect("helper alive");
                done.recv().expect("helper alive");
                pool.drain_returned();
            }
            start
                .elapsed()
                .mul_f64(iters as f64 / (rounds * 256) as f64)
        })
    });
    drop(to_helper);
    helper.join().expect("helper thread");

    let mut user = vec![0u8; 1 << 20];
    let ptr = user.as_mut_ptr();
    g.bench_function("reg_cache_hit/1MiB", |b| {
        b.iter_batched(
            || (),
            |()| {
                // SAFETY: `user` outlives the cache entry; the cache is cleared before it drops.
                let mr = unsafe {
                    pool.reg_cache()
                        .register(ptr, 1 << 20, AccessFlags::REMOTE_READ)
                }
                .expect("register");
                black_box(mr.lkey());
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
    pool.reg_cache().clear();
    drop(user);
    eprintln!("mempool bench: {:?}", pool.stats());
}

criterion_group!(benches, bench);
criterion_main!(benches);
