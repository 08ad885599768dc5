//! Goodput of a SEND stream over the `udp` provider, with every byte checked at the receiver;
//! or (`--test sync`) WRITE data then WRITE a flag, checking the flag never shows before the data.
//!
//! ```text
//! udp_goodput server --bind 198.18.2.1:47000 --oob 198.18.2.1:47999 [--size N] [--opt k=v]...
//! udp_goodput client --bind 198.18.1.1:46000 --oob 198.18.2.1:47999 [--secs S] [--size N]
//!                    [--depth D] [--interval-ms I] [--opt k=v]...
//! udp_goodput server|client ... --test sync [--iters N] [--sync on|off]
//! ```
//!
//! Stream test: the client streams `size`-byte SENDs (`depth` outstanding) for `secs` seconds,
//! then a final 8-byte message holding the count; each message carries its sequence number and a
//! pattern derived from it. The server checks order and content of every message. Both print
//! one JSON line: the client `{"role":"client","goodput_mbps":..,"timeline_mbps":[..],..}`, the
//! server `{"role":"server","messages":..,"corrupt":..,"out_of_order":..,"complete":..}`.
//!
//! Sync test: `iters` rounds; in round `i` the client WRITEs `depth` chunks of `size` bytes
//! (a pattern of `i`) into the server's memory, then an 8-byte flag `i` (with
//! `SendFlags::SYNCHRONISE` unless `--sync off`). The server spins on the flag word; the moment
//! it reads `i` it checks every data byte, counts a `violation` if any is not yet round `i`'s,
//! and SENDs the client leave to start the next round. JSON: `{"role":"server","test":"sync",
//! "rounds":..,"violations":..,"complete":..}`.
//!
//! Both roles add the QP's counters: `"mpath":{..}` (retransmissions, timeouts, largest
//! out-of-order gap seen by the receiver, ...) and `"sockets":{..}` (system calls, datagrams).
//! `--opt` passes udp device options (`mode=single`, `paths=16`, `gso=16`, ...).
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
    test: String,
    iters: u64,
    sync: bool,
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
        test: "stream".to_string(),
        iters: 200,
        sync: true,
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
            "--test" => a.test = v,
            "--iters" => a.iters = v.parse().expect("--iters N"),
            "--sync" => a.sync = v == "on",
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

/// The QP's counters as JSON fields (`,"mpath":{..},"sockets":{..}`).
fn stats_json(qp: &QueuePair) -> String {
    let Some(st) = provider::udp::qp_stats(qp) else {
        return String::new();
    };
    let k = st.sockets;
    let mut out = format!(
        ",\"sockets\":{{\"tx_calls\":{},\"tx_datagrams\":{},\"tx_dropped\":{},\"rx_calls\":{},\"rx_datagrams\":{}}}",
        k.tx_calls, k.tx_datagrams, k.tx_dropped, k.rx_calls, k.rx_datagrams
    );
    if let Some(m) = st.mpath {
        out.push_str(&format!(
            ",\"mpath\":{{\"data_packets_sent\":{},\"retransmits\":{},\"timeouts\":{},\"recoveries\":{},\"acks_sent\":{},\"max_ooo_gap\":{},\"duplicates_received\":{},\"ooo_drops\":{},\"sync_early_drops\":{},\"slow_path_prunes\":{},\"ecn_echoes\":{},\"nacks_sent\":{},\"nacks_received\":{},\"repeated_resends\":{},\"unused_send_opportunities\":{},\"rto_us\":{},\"srtt_us\":{},\"cwnd\":{:.1}}}",
            m.data_packets_sent,
            m.retransmits,
            m.timeouts,
            m.recoveries,
            m.acks_sent,
            m.max_ooo_gap,
            m.duplicates_received,
            m.ooo_drops,
            m.sync_early_drops,
            m.slow_path_prunes,
            m.ecn_echoes,
            m.nacks_sent,
            m.nacks_received,
            m.repeated_resends,
            m.unused_send_opportunities,
            m.rto.as_micros(),
            m.srtt.as_micros(),
            m.cwnd
        ));
    }
    out
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
        "{{\"role\":\"server\",\"test\":\"stream\",\"messages\":{next},\"corrupt\":{corrupt},\"out_of_order\":{out_of_order},\"complete\":{complete}{}}}",
        stats_json(&s.qp)
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
        "{{\"role\":\"client\",\"test\":\"stream\",\"goodput_mbps\":{:.1},\"bytes\":{done_bytes},\"messages\":{seq},\"secs\":{secs:.3},\"failed\":{},\"timeline_mbps\":[{}]{}}}",
        done_bytes as f64 * 8.0 / secs / 1e6,
        failed.is_some(),
        timeline.join(","),
        stats_json(&s.qp)
    );
}

fn main() {
    run(std::env::args().skip(1).collect());
}

/// Run one role with the command-line arguments (without the program name).
pub fn run(args: Vec<String>) {
    let a = parse(args);
    match (a.role.as_str(), a.test.as_str()) {
        ("server", "stream") => server(&a),
        ("client", "stream") => client(&a),
        ("server", "sync") => sync_server(&a),
        ("client", "sync") => sync_client(&a),
        _ => {
            eprintln!("usage: udp_goodput server|client --bind ADDR:PORT --oob ADDR:PORT ...");
            std::process::exit(2);
        }
    }
}

/// Extra endpoint keys through which the sync server tells the client where to write.
const SYNC_ADDR_KEY: &str = "sync_addr";
const SYNC_RKEY_KEY: &str = "sync_rkey";

/// Round `round`'s data byte at offset `j` of the data region.
fn round_byte(round: u64, j: usize) -> u8 {
    pattern(round.wrapping_mul(0x9e37), j) ^ 0x5a
}

/// Sync test, server: owns the target memory (`depth` chunks of `size` bytes, then the flag).
fn sync_server(a: &Args) {
    let data_len = a.size * a.depth.max(1);
    let s = setup(a, 16);
    let mr =
        s.pd.alloc_mr(
            data_len + 64,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )
        .unwrap();
    let flag = mr.atomic_u64(data_len).expect("flag word aligned");
    let ack = s.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut endpoint = s.qp.endpoint();
    endpoint
        .extra
        .insert(SYNC_ADDR_KEY.into(), mr.addr().to_string());
    endpoint
        .extra
        .insert(SYNC_RKEY_KEY.into(), mr.rkey().0.to_string());
    let listener = TcpListener::bind(a.oob).expect("bind oob");
    let remote = oob::accept_exchange(&listener, &endpoint).expect("exchange");
    connect(&s, remote);
    let (mut rounds, mut violations, mut timed_out) = (0u64, 0u64, false);
    let mut buf = vec![0u8; data_len];
    let mut wcs = [WorkCompletion::EMPTY; 4];
    'rounds: for round in 1..=a.iters {
        // Spin on the flag (yielding now and then: the machine may be shared).
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut spins = 0u32;
        while flag.load(std::sync::atomic::Ordering::Acquire) != round {
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 {
                std::thread::yield_now();
                if Instant::now() > deadline {
                    timed_out = true;
                    break 'rounds;
                }
            }
        }
        mr.read_at(0, &mut buf).unwrap();
        if buf
            .iter()
            .enumerate()
            .any(|(j, &b)| b != round_byte(round, j))
        {
            violations += 1;
        }
        rounds = round;
        // Leave to start the next round.
        ack.write_at(0, &round.to_le_bytes()).unwrap();
        let sge = [ack.sge(0, 8).unwrap()];
        s.qp.post_send(&[SendWr::new(round, &sge, WrOpcode::Send)])
            .expect("post ack");
        let n =
            s.cq.poll_blocking(&mut wcs[..1], Duration::from_secs(30))
                .expect("poll");
        // The client leaves once it has the last leave, so the last SEND may flush.
        if round < a.iters && (n == 0 || !wcs[0].status.is_success()) {
            timed_out = true;
            break;
        }
    }
    println!(
        "{{\"role\":\"server\",\"test\":\"sync\",\"rounds\":{rounds},\"violations\":{violations},\"complete\":{}{}}}",
        !timed_out && rounds == a.iters,
        stats_json(&s.qp)
    );
}

/// Sync test, client: writes each round's data, then its flag.
fn sync_client(a: &Args) {
    let depth = a.depth.max(1);
    let data_len = a.size * depth;
    let s = setup(a, depth as u32 + 4);
    let src =
        s.pd.alloc_mr(data_len + 64, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let ack = s.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let remote =
        oob::connect_exchange(a.oob, &s.qp.endpoint(), Duration::from_secs(20)).expect("exchange");
    let field = |k: &str| -> u64 {
        remote
            .extra
            .get(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("server endpoint lacks {k}"))
    };
    let (base, rkey) = (field(SYNC_ADDR_KEY), Rkey(field(SYNC_RKEY_KEY) as u32));
    connect(&s, remote);
    let flags = if a.sync {
        SendFlags::SIGNALED | SendFlags::SYNCHRONISE
    } else {
        SendFlags::SIGNALED
    };
    let mut wcs = [WorkCompletion::EMPTY; 32];
    let mut data = vec![0u8; data_len];
    let start = Instant::now();
    let (mut rounds, mut failed) = (0u64, false);
    for round in 1..=a.iters {
        let sge = [ack.sge(0, 8).unwrap()];
        s.qp.post_recv(&[RecvWr::new(u64::MAX, &sge)]).unwrap();
        for (j, b) in data.iter_mut().enumerate() {
            *b = round_byte(round, j);
        }
        src.write_at(0, &data).unwrap();
        src.write_at(data_len, &round.to_ne_bytes()).unwrap();
        let sges: Vec<[Sge; 1]> = (0..depth)
            .map(|i| [src.sge(i * a.size, a.size as u32).unwrap()])
            .collect();
        let flag_sge = [src.sge(data_len, 8).unwrap()];
        let mut wrs: Vec<SendWr<'_>> = sges
            .iter()
            .enumerate()
            .map(|(i, sg)| {
                SendWr::new(
                    i as u64,
                    sg,
                    WrOpcode::Write {
                        remote: RemoteAddr {
                            addr: base + (i * a.size) as u64,
                            rkey,
                        },
                    },
                )
                .with_flags(SendFlags::empty())
            })
            .collect();
        wrs.push(
            SendWr::new(
                u64::MAX - 1,
                &flag_sge,
                WrOpcode::Write {
                    remote: RemoteAddr {
                        addr: base + data_len as u64,
                        rkey,
                    },
                },
            )
            .with_flags(flags),
        );
        s.qp.post_send(&wrs).expect("post_send");
        // The flag's completion and the server's leave to go on.
        let (mut flag_done, mut acked) = (false, false);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let is_round_over = flag_done && acked;
            if failed || is_round_over {
                break;
            }
            let n =
                s.cq.poll_blocking(&mut wcs, Duration::from_millis(100))
                    .expect("poll");
            for wc in &wcs[..n] {
                failed |= !wc.status.is_success();
                flag_done |= wc.wr_id == u64::MAX - 1;
                acked |= wc.wr_id == u64::MAX;
            }
            failed |= Instant::now() > deadline;
        }
        if failed {
            break;
        }
        rounds = round;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"role\":\"client\",\"test\":\"sync\",\"rounds\":{rounds},\"synchronise\":{},\"secs\":{secs:.3},\"goodput_mbps\":{:.1},\"failed\":{failed}{}}}",
        a.sync,
        (rounds as f64 * data_len as f64 * 8.0) / secs / 1e6,
        stats_json(&s.qp)
    );
}
