//! Goodput of a SEND stream over the `udp` provider, with every byte checked at the receiver.
//!
//! ```text
//! udp_goodput server --bind 198.18.2.1:47000 --oob 198.18.2.1:47999 [--size N] [--opt k=v]...
//! udp_goodput client --bind 198.18.1.1:46000 --oob 198.18.2.1:47999 [--secs S] [--size N]
//!                    [--depth D] [--interval-ms I] [--opt k=v]...
//! ```
//!
//! The client streams `size`-byte SENDs (`depth` outstanding) for `secs` seconds, then a final
//! 8-byte message holding the count; each message carries its sequence number and a pattern
//! derived from it. The server checks order and content of every message. Both print one JSON
//! line: the client `{"role":"client","goodput_mbps":..,"timeline_mbps":[..],..}`, the server
//! `{"role":"server","messages":..,"corrupt":..,"out_of_order":..,"complete":..}`.
//! `--opt` passes udp device options (`mode=single`, `paths=16`, ...).
//!
//! `cargo run --release -p fabriq-verbs --example udp_goodput -- server ...`

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use fabriq_verbs::*;

struct Args {
    role: String,
    bind: SocketAddr,
    oob: SocketAddr,
    secs: f64,
    size: usize,
    depth: usize,
    interval: Duration,
    opts: Vec<(String, String)>,
}

fn parse(args: Vec<String>) -> Args {
    let mut it = args.into_iter();
    let role = it.next().unwrap_or_default();
    let mut a = Args {
        role,
        bind: "127.0.0.1:0".parse().unwrap(),
        oob: "127.0.0.1:47999".parse().unwrap(),
        secs: 3.0,
        size: 64 * 1024,
        depth: 16,
        interval: Duration::from_millis(250),
        opts: Vec::new(),
    };
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--bind" => a.bind = v.parse().expect("--bind ADDR:PORT"),
            "--oob" => a.oob = v.parse().expect("--oob ADDR:PORT"),
            "--secs" => a.secs = v.parse().expect("--secs S"),
            "--size" => a.size = v.parse().expect("--size N"),
            "--depth" => a.depth = v.parse().expect("--depth D"),
            "--interval-ms" => a.interval = Duration::from_millis(v.parse().expect("ms")),
            "--opt" => {
                let (k, v) = v.split_once('=').expect("--opt k=v");
                a.opts.push((k.to_string(), v.to_string()));
            }
            _ => panic!("unknown argument {k}"),
        }
    }
    assert!(a.size >= 16, "--size must be at least 16");
    a
}

/// Byte `j` of message `seq` (the first 8 bytes hold `seq`).
fn pattern(seq: u64, j: usize) -> u8 {
    (seq.wrapping_mul(131) as usize).wrapping_add(j.wrapping_mul(7)) as u8
}

fn fill(buf: &mut [u8], seq: u64) {
    buf[..8].copy_from_slice(&seq.to_le_bytes());
    for (j, b) in buf.iter_mut().enumerate().skip(8) {
        *b = pattern(seq, j);
    }
}

struct Setup {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn setup(a: &Args, max_wr: u32) -> Setup {
    let mut cfg = DeviceConfig {
        bind_addr: Some(a.bind),
        ..Default::default()
    };
    for (k, v) in &a.opts {
        cfg.options.insert(k.clone(), v.clone());
    }
    let ctx = Context::open_with("udp0", &cfg).expect("open udp0");
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(max_wr * 2 + 16).unwrap();
    let mut init = QpInitAttr::new(&cq);
    init.caps.max_send_wr = max_wr;
    init.caps.max_recv_wr = max_wr;
    let qp = pd.create_qp(&init).unwrap();
    qp.modify(&QpAttr::init(AccessFlags::ALL)).unwrap();
    Setup {
        _ctx: ctx,
        pd,
        cq,
        qp,
    }
}

fn connect(s: &Setup, remote: QpEndpoint) {
    s.qp.modify(&QpAttr::rtr(remote)).unwrap();
    s.qp.modify(&QpAttr::rts()).unwrap();
}

fn server(a: &Args) {
    const SLOTS: usize = 256;
    let s = setup(a, SLOTS as u32);
    let mr =
        s.pd.alloc_mr(SLOTS * a.size, AccessFlags::LOCAL_WRITE)
            .unwrap();
    for i in 0..SLOTS {
        let sge = [mr.sge(i * a.size, a.size as u32).unwrap()];
        s.qp.post_recv(&[RecvWr::new(i as u64, &sge)]).unwrap();
    }
    let listener = TcpListener::bind(a.oob).expect("bind oob");
    let remote = oob::accept_exchange(&listener, &s.qp.endpoint()).expect("exchange");
    connect(&s, remote);
    let (mut next, mut corrupt, mut out_of_order) = (0u64, 0u64, 0u64);
    let mut complete = false;
    let mut buf = vec![0u8; a.size];
    let mut wcs = [WorkCompletion::EMPTY; 32];
    let deadline = Instant::now() + Duration::from_secs_f64(a.secs + 60.0);
    'outer: while Instant::now() < deadline {
        let n =
            s.cq.poll_blocking(&mut wcs, Duration::from_secs(1))
                .expect("poll");
        for wc in &wcs[..n] {
            if !wc.status.is_success() {
                eprintln!("receive failed: {:?}", wc.status);
                break 'outer;
            }
            let slot = wc.wr_id as usize;
            let len = wc.byte_len as usize;
            mr.read_at(slot * a.size, &mut buf[..len]).unwrap();
            let seq = u64::from_le_bytes(buf[..8].try_into().unwrap());
            if len == 8 {
                // The final message: the number of messages sent.
                complete = seq == next;
                break 'outer;
            }
            if seq != next {
                out_of_order += 1;
            }
            next = seq + 1;
            if len != a.size
                || buf[8..len]
                    .iter()
                    .enumerate()
                    .any(|(j, &b)| b != pattern(seq, j + 8))
            {
                corrupt += 1;
            }
            let sge = [mr.sge(slot * a.size, a.size as u32).unwrap()];
            s.qp.post_recv(&[RecvWr::new(slot as u64, &sge)]).unwrap();
        }
    }
    println!(
        "{{\"role\":\"server\",\"messages\":{next},\"corrupt\":{corrupt},\"out_of_order\":{out_of_order},\"complete\":{complete}}}"
    );
}

fn client(a: &Args) {
    let depth = a.depth.max(1);
    let s = setup(a, depth as u32 + 1);
    let mr =
        s.pd.alloc_mr((depth + 1) * a.size, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let remote =
        oob::connect_exchange(a.oob, &s.qp.endpoint(), Duration::from_secs(20)).expect("exchange");
    connect(&s, remote);
    let mut scratch = vec![0u8; a.size];
    let (mut seq, mut done_bytes, mut outstanding) = (0u64, 0u64, 0usize);
    let mut free: Vec<usize> = (0..depth).collect();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(a.secs);
    let mut timeline = Vec::new();
    let (mut tick, mut tick_bytes) = (start + a.interval, 0u64);
    let mut wcs = [WorkCompletion::EMPTY; 32];
    let mut failed = None;
    loop {
        let now = Instant::now();
        while now >= tick {
            timeline.push((done_bytes - tick_bytes) as f64 * 8.0 / a.interval.as_secs_f64() / 1e6);
            tick_bytes = done_bytes;
            tick += a.interval;
        }
        if now < end {
            while let Some(slot) = free.pop() {
                fill(&mut scratch, seq);
                mr.write_at(slot * a.size, &scratch).unwrap();
                let sge = [mr.sge(slot * a.size, a.size as u32).unwrap()];
                s.qp.post_send(&[SendWr::new(slot as u64, &sge, WrOpcode::Send)])
                    .expect("post_send");
                seq += 1;
                outstanding += 1;
            }
        } else if outstanding == 0 {
            break;
        }
        let n =
            s.cq.poll_blocking(&mut wcs, Duration::from_millis(50))
                .expect("poll");
        for wc in &wcs[..n] {
            if !wc.status.is_success() {
                failed = Some(wc.status);
            }
            outstanding -= 1;
            done_bytes += a.size as u64;
            free.push(wc.wr_id as usize);
        }
        if failed.is_some() || now > end + Duration::from_secs(30) {
            break;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // The final message: how many came before it.
    mr.write_at(depth * a.size, &seq.to_le_bytes()).unwrap();
    let sge = [mr.sge(depth * a.size, 8).unwrap()];
    s.qp.post_send(&[SendWr::new(u64::MAX, &sge, WrOpcode::Send)])
        .ok();
    let _ = s.cq.poll_blocking(&mut wcs[..1], Duration::from_secs(10));
    let timeline: Vec<String> = timeline.iter().map(|m| format!("{m:.1}")).collect();
    println!(
        "{{\"role\":\"client\",\"goodput_mbps\":{:.1},\"bytes\":{done_bytes},\"messages\":{seq},\"secs\":{secs:.3},\"failed\":{},\"timeline_mbps\":[{}]}}",
        done_bytes as f64 * 8.0 / secs / 1e6,
        failed.is_some(),
        timeline.join(",")
    );
}

fn main() {
    run(std::env::args().skip(1).collect());
}

/// Run one role with the command-line arguments (without the program name).
pub fn run(args: Vec<String>) {
    let a = parse(args);
    match a.role.as_str() {
        "server" => server(&a),
        "client" => client(&a),
        _ => {
            eprintln!("usage: udp_goodput server|client --bind ADDR:PORT --oob ADDR:PORT ...");
            std::process::exit(2);
        }
    }
}
