//! Hot-path benchmarks: frame encode/decode, and one connection pair moving data with
//! zero latency (per-packet cost of the sans-IO core, both directions' work included).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use fabriq_mpath::frame::{self, AckHeader, DataHeader};
use fabriq_mpath::{Config, Connection, Instant, PathId, Payload};

fn frames(c: &mut Criterion) {
    let data = DataHeader {
        path: PathId(17),
        psn: 123_456,
        msn: 77,
        ipsn: 3,
        timestamp: 987_654_321,
        payload_len: 1024,
        synchronise: false,
        retransmit: false,
        tail: false,
        is_virtual: false,
    };
    let payload = vec![0xa5u8; 1024];
    let ack = AckHeader {
        path: PathId(17),
        sack: 123_456,
        aack: 123_400,
        timestamp_echo: 1,
        ece: true,
        synchronise: false,
        retransmit: false,
    };
    let mut g = c.benchmark_group("frame");
    g.throughput(Throughput::Elements(1));
    let mut buf = Vec::with_capacity(2048);
    g.bench_function("encode_data_1k", |b| {
        b.iter(|| {
            buf.clear();
            frame::encode_data(black_box(&data), black_box(&payload), &mut buf);
        })
    });
    g.bench_function("encode_ack", |b| {
        b.iter(|| {
            buf.clear();
            frame::encode_ack(black_box(&ack), &mut buf);
        })
    });
    let mut data_bytes = Vec::new();
    frame::encode_data(&data, &payload, &mut data_bytes);
    let mut ack_bytes = Vec::new();
    frame::encode_ack(&ack, &mut ack_bytes);
    g.bench_function("decode_data_1k", |b| {
        b.iter(|| frame::decode(black_box(&data_bytes)).is_ok())
    });
    g.bench_function("decode_ack", |b| {
        b.iter(|| frame::decode(black_box(&ack_bytes)).is_ok())
    });
    g.finish();
}

/// Moves every pending datagram from `from` to `to`; returns how many.
fn pump(from: &mut Connection, to: &mut Connection, now: Instant, buf: &mut Vec<u8>) -> usize {
    let mut n = 0;
    while let Some(t) = from.poll_transmit(now, buf) {
        let _ = to.handle_datagram(now, t.path, false, &buf[..t.len]);
        n += 1;
    }
    n
}

fn connection(c: &mut Criterion) {
    const PACKETS: u64 = 1000;
    let mut g = c.benchmark_group("connection");
    g.throughput(Throughput::Elements(PACKETS));
    g.bench_function("virtual_1000_packets", |b| {
        b.iter_batched(
            || {
                let a = Connection::new(
                    Config {
                        seed: 1,
                        ..Config::default()
                    },
                    Instant::ZERO,
                );
                let z = Connection::new(
                    Config {
                        seed: 2,
                        ..Config::default()
                    },
                    Instant::ZERO,
                );
                (a, z, Vec::with_capacity(2048))
            },
            |(mut a, mut z, mut buf)| {
                let mut now = Instant::ZERO;
                a.send(now, Payload::Virtual(PACKETS * 1024), false)
                    .unwrap();
                loop {
                    now += std::time::Duration::from_micros(1);
                    let moved =
                        pump(&mut a, &mut z, now, &mut buf) + pump(&mut z, &mut a, now, &mut buf);
                    while a.poll_event().is_some() {}
                    while z.poll_event().is_some() {}
                    if moved == 0 {
                        match a.poll_timeout().or(z.poll_timeout()) {
                            Some(t) if a.stats().messages_acked == 0 => {
                                now = now.max(t);
                                a.handle_timeout(now);
                                z.handle_timeout(now);
                            }
                            _ => break,
                        }
                    }
                }
                assert_eq!(a.stats().messages_acked, 1);
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, frames, connection);
criterion_main!(benches);
