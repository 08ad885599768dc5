//! The software cost of one-sided operations through `RemoteRegion`: one caller-progress
//! endpoint reads and writes a region another endpoint of the same process exposed, on one
//! thread (the shm provider carries a one-sided operation out when it is posted, so the thread
//! posts, the provider copies, the thread reaps the completion). Each size is done twice: by the
//! copying forms (`read` into a `Vec`, `write` from a slice) and from / into a buffer of
//! `Channel::alloc` (`read_buf`, `write_buf`), which the operation hands back. Sizes: 8 B, the
//! pool's largest class (64 KiB) and 1 MiB (past it: a large buffer).
//!
//! `taskset -c 0 cargo bench -p fabriq --bench remote`

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fabriq::{Config, Endpoint, Progress};

const TIMEOUT: Duration = Duration::from_secs(10);

fn endpoint() -> Endpoint {
    Endpoint::new(Config {
        device: "shm0".into(),
        workers: 1,
        progress: Progress::Caller,
        ..Config::default()
    })
    .expect("endpoint")
}

fn remote_bench(c: &mut Criterion) {
    let (a, b) = (endpoint(), endpoint());
    let listener = b.listen("127.0.0.1:0").expect("listen");
    let ca = a.connect(listener.local_addr()).expect("connect");
    let cb = listener.accept_timeout(TIMEOUT).expect("accept");
    const REGION: usize = 2 << 20;
    let region = b.expose(REGION).expect("expose");
    let remote = ca.remote_region(region.descriptor_for(&cb));
    let mut g = c.benchmark_group("remote_one_thread");
    g.measurement_time(Duration::from_secs(3));
    for len in [8usize, 64 << 10, 1 << 20] {
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_with_input(BenchmarkId::new("read", len), &len, |bench, &len| {
            bench.iter(|| remote.read(0, len as u32).expect("read"));
        });
        let mut buf = Some(ca.alloc(len).expect("alloc"));
        g.bench_with_input(BenchmarkId::new("read_buf", len), &len, |bench, _| {
            bench.iter(|| {
                let b = buf.take().expect("buffer");
                buf = Some(remote.read_buf(0, b).expect("read_buf"));
            });
        });
        let data = vec![3u8; len];
        g.bench_with_input(BenchmarkId::new("write", len), &len, |bench, _| {
            bench.iter(|| remote.write(0, &data).expect("write"));
        });
        g.bench_with_input(BenchmarkId::new("write_buf", len), &len, |bench, _| {
            bench.iter(|| {
                let b = buf.take().expect("buffer");
                buf = Some(remote.write_buf(0, b).expect("write_buf"));
            });
        });
    }
    g.finish();
    drop(listener);
}

criterion_group!(benches, remote_bench);
criterion_main!(benches);
