//! Round-trip latency of 8-byte messages on loopback: a plain busy-polled TCP ping-pong
//! (the baseline) against a SEND/RECV ping-pong over the `tcp` provider, in both progress
//! modes. Prints median and 99th percentile in microseconds.
//!
//! `cargo run --release -p fabriq-verbs --example tcp_latency -- [iterations]`

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use fabriq_verbs::*;

fn percentiles(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    (us(v[v.len() / 2]), us(v[v.len() * 99 / 100]))
}

fn spin_read(s: &mut TcpStream, buf: &mut [u8]) {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => panic!("peer closed"),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => panic!("{e}"),
        }
    }
}

fn plain_tcp(iters: usize) -> Vec<Duration> {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let echo = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_nodelay(true).unwrap();
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 8];
        for _ in 0..iters + 100 {
            spin_read(&mut s, &mut b);
            s.write_all(&b).unwrap();
        }
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 8];
    let mut out = Vec::with_capacity(iters);
    for i in 0..iters + 100 {
        let t = Instant::now();
        s.write_all(&b).unwrap();
        spin_read(&mut s, &mut b);
        if i >= 100 {
            out.push(t.elapsed());
        }
    }
    echo.join().unwrap();
    out
}

struct End {
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
    _pd: ProtectionDomain,
}

fn end(progress: &str) -> End {
    let mut cfg = DeviceConfig::default();
    cfg.options.insert("progress".into(), progress.into());
    let ctx = Context::open_with("tcp0", &cfg).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024).unwrap();
    let mr = pd.alloc_mr(4096, AccessFlags::ALL).unwrap();
    let qp = pd.create_qp(&QpInitAttr::new(&cq)).unwrap();
    End {
        cq,
        qp,
        mr,
        _pd: pd,
    }
}

fn wait_recv(e: &End) {
    let mut wc = [WorkCompletion::EMPTY; 4];
    let mut spins = 0u32;
    loop {
        let n = e.cq.poll(&mut wc).unwrap();
        for w in &wc[..n] {
            assert!(w.status.is_success(), "{w:?}");
            if w.opcode == WcOpcode::Recv {
                return;
            }
        }
        spins += 1;
        if spins % 1024 == 0 {
            std::thread::yield_now();
        }
    }
}

fn verbs(progress: &str, iters: usize) -> Vec<Duration> {
    let a = end(progress);
    let b = end(progress);
    let (ea, eb) = (a.qp.endpoint(), b.qp.endpoint());
    a.qp.connect(&eb, AccessFlags::ALL).unwrap();
    b.qp.connect(&ea, AccessFlags::ALL).unwrap();
    let total = iters + 100;
    let echo = std::thread::spawn(move || {
        b.qp.post_recv(&[RecvWr::new(0, &[b.mr.sge(0, 8).unwrap()])])
            .unwrap();
        for _ in 0..total {
            wait_recv(&b);
            b.qp.post_recv(&[RecvWr::new(0, &[b.mr.sge(0, 8).unwrap()])])
                .unwrap();
            let s = [b.mr.sge(0, 8).unwrap()];
            b.qp.post_send(&[SendWr::new(1, &s, WrOpcode::Send).with_flags(SendFlags::empty())])
                .unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
    });
    let mut out = Vec::with_capacity(iters);
    for i in 0..total {
        a.qp.post_recv(&[RecvWr::new(0, &[a.mr.sge(64, 8).unwrap()])])
            .unwrap();
        let s = [a.mr.sge(0, 8).unwrap()];
        let t = Instant::now();
        a.qp.post_send(&[SendWr::new(1, &s, WrOpcode::Send).with_flags(SendFlags::empty())])
            .unwrap();
        wait_recv(&a);
        if i >= 100 {
            out.push(t.elapsed());
        }
    }
    echo.join().unwrap();
    out
}

/// One-directional bandwidth of 1 MiB RDMA WRITEs, 8 in flight.
fn write_bandwidth(progress: &str, total_mib: usize) -> f64 {
    let a = end(progress);
    let b = end(progress);
    let (ea, eb) = (a.qp.endpoint(), b.qp.endpoint());
    a.qp.connect(&eb, AccessFlags::ALL).unwrap();
    b.qp.connect(&ea, AccessFlags::ALL).unwrap();
    const CHUNK: usize = 1 << 20;
    let pd_a = &a._pd;
    let src = pd_a.alloc_mr(CHUNK, AccessFlags::ALL).unwrap();
    let dst = b._pd.alloc_mr(8 * CHUNK, AccessFlags::ALL).unwrap();
    let sge = [src.sge(0, CHUNK as u32).unwrap()];
    let t = Instant::now();
    let mut posted = 0;
    let mut done = 0;
    let mut wc = [WorkCompletion::EMPTY; 16];
    while done < total_mib {
        while posted < total_mib && posted - done < 8 {
            let wr = SendWr::new(
                posted as u64,
                &sge,
                WrOpcode::Write {
                    remote: dst.remote((posted % 8) * CHUNK),
                },
            );
            a.qp.post_send(&[wr]).unwrap();
            posted += 1;
        }
        let n = a.cq.poll(&mut wc).unwrap();
        for w in &wc[..n] {
            assert!(w.status.is_success(), "{w:?}");
        }
        done += n;
        if n == 0 {
            std::thread::yield_now();
        }
    }
    (total_mib as f64) / t.elapsed().as_secs_f64()
}

fn main() {
    let iters: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let (p50, p99) = percentiles(plain_tcp(iters));
    println!("plain-tcp      rtt_us p50 {p50:7.2} p99 {p99:7.2}");
    let base = p50;
    for mode in ["busy", "thread"] {
        let (p50, p99) = percentiles(verbs(mode, iters));
        println!(
            "tcp0 {mode:<9} rtt_us p50 {p50:7.2} p99 {p99:7.2}  ratio {:.2}",
            p50 / base
        );
    }
    for mode in ["busy", "thread"] {
        println!(
            "tcp0 {mode:<9} write 1 MiB x 8 in flight: {:.0} MiB/s",
            write_bandwidth(mode, 512)
        );
    }
}
