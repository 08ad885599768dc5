//! What the building blocks of the message path cost on this host, one call at a time: a
//! locked read-modify-write, a SeqCst fence, the clocks the worker reads, a queue hand-off
//! and a small heap allocation. The channel's per-message overhead
//! (`BENCHMARKS.md`, "Targets still missed") is read against these: how much of it a count of
//! atomics or clock reads can explain, and how much is plain instructions.
//!
//! `taskset -c 1 cargo bench -p fabriq --bench primitives`

use std::hint::black_box;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use crossbeam_queue::SegQueue;

fn primitives(c: &mut Criterion) {
    let mut g = c.benchmark_group("primitives");
    g.measurement_time(Duration::from_secs(2));
    g.warm_up_time(Duration::from_millis(500));

    let counter = AtomicU64::new(0);
    g.bench_function("atomic_fetch_add", |b| {
        b.iter(|| counter.fetch_add(1, Ordering::AcqRel))
    });
    g.bench_function("atomic_compare_exchange", |b| {
        b.iter(|| {
            let cur = counter.load(Ordering::Acquire);
            counter.compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
        })
    });
    g.bench_function("store_then_fence_seqcst", |b| {
        b.iter(|| {
            counter.store(black_box(1), Ordering::Relaxed);
            fence(Ordering::SeqCst);
        })
    });
    g.bench_function("clock_monotonic", |b| {
        b.iter(|| rustix::time::clock_gettime(rustix::time::ClockId::Monotonic))
    });
    g.bench_function("clock_monotonic_coarse", |b| {
        b.iter(|| rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse))
    });
    g.bench_function("std_instant_now", |b| b.iter(Instant::now));
    let queue = SegQueue::new();
    g.bench_function("segqueue_push_pop", |b| {
        b.iter(|| {
            queue.push(black_box(7u64));
            queue.pop()
        })
    });
    let payload = [7u8; 8];
    g.bench_function("vec_8_bytes", |b| b.iter(|| black_box(&payload).to_vec()));
    g.finish();
}

criterion_group!(benches, primitives);
criterion_main!(benches);
