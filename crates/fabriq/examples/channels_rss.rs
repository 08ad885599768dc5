//! Memory of many connections: one process opens `channels` connections to another and runs
//! the same traffic on each, one connection at a time (a burst of 64 eager messages of 4000
//! bytes from the client, then 64 back, so every slot of a 64-slot receive ring is used on both
//! sides while at most one connection's burst is in flight), then prints its own VmRSS / VmHWM
//! (from /proc/self/status) and the bytes it registered for the connections, as one JSON line.
//! What remains is the per-connection cost, not the cost of traffic waiting to be read.
//!
//! Modes:
//! - `fabriq`: `Endpoint` channels, each on a connection of its own (`share_connections =
//!   false`: channels to one peer would otherwise share one connection, which is not what is
//!   measured here): a receive ring per connection sized by the configuration, send payloads
//!   copied into the worker's shared pool, QPs from the connection manager.
//! - `naive`: what plain verbs code does: every connection owns a separately allocated and
//!   registered receive ring (64 × 8 KiB) and send buffer (64 × 8 KiB), set up with the same
//!   connection manager (so only the buffer scheme differs).
//!
//! `channels_rss server <mode> <device> <channels> <addr>` prints `listening <addr>`, then its
//! report once its traffic is done, and exits when the client goes away.
//! `channels_rss client <mode> <device> <channels> <addr>` connects, runs, reports, exits.
//! `bench/rss.sh` runs both modes on shm0 and tcp0 and prints the table.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use fabriq::conn::{ConnConfig, ConnManager, Established, RingGeometry};
use fabriq::{Config, Endpoint};
use fabriq_verbs::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, QpCaps, RecvWr, SendFlags, SendWr,
    WcStatus, WorkCompletion, WrOpcode,
};

const MESSAGES: usize = 64;
const MESSAGE_LEN: usize = 4000;
const NAIVE_SLOT: usize = 8192;
const SEND_WINDOW: usize = 16;
const HANG: Duration = Duration::from_secs(60);

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn report(role: &str, mode: &str, device: &str, channels: usize, registered: u64) {
    println!(
        "{{\"role\":\"{role}\",\"mode\":\"{mode}\",\"device\":\"{device}\",\"channels\":{channels},\
         \"vm_rss_kib\":{},\"vm_hwm_kib\":{},\"rss_anon_kib\":{},\"rss_shmem_kib\":{},\
         \"registered_bytes\":{registered}}}",
        status_kib("VmRSS:"),
        status_kib("VmHWM:"),
        status_kib("RssAnon:"),
        status_kib("RssShmem:")
    );
    let _ = std::io::stdout().flush();
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [role, mode, device, channels, addr] = args.as_slice() else {
        return Err(
            "usage: channels_rss <server|client> <fabriq|naive> <device> <channels> <addr>".into(),
        );
    };
    let channels: usize = channels.parse()?;
    let addr: SocketAddr = addr.parse()?;
    match (role.as_str(), mode.as_str()) {
        ("server", "fabriq") => fabriq_server(device, channels, addr),
        ("client", "fabriq") => fabriq_client(device, channels, addr),
        ("server", "naive") => naive(true, device, channels, addr),
        ("client", "naive") => naive(false, device, channels, addr),
        _ => Err(format!("unknown role/mode {role}/{mode}").into()),
    }
}

/// `FABRIQ_*` variables apply (e.g. `FABRIQ_RX_SLOTS`), the device is the one given.
fn config(device: &str) -> Config {
    let base = Config::from_env().unwrap_or_else(|e| {
        eprintln!("ignoring the environment: {e}");
        Config::default()
    });
    Config {
        device: device.into(),
        share_connections: false,
        ..base
    }
}

/// Registered bytes of one channel end: its receive ring and its send-header slots.
fn fabriq_channel_bytes(cfg: &Config) -> u64 {
    let c = cfg.channel_config(0);
    u64::from(c.rx_slots) * u64::from(c.rx_slot_size) + u64::from(c.sq_depth) * 64
}

fn fabriq_server(device: &str, channels: usize, addr: SocketAddr) -> Res<()> {
    let cfg = config(device);
    let ep = Endpoint::new(cfg.clone())?;
    let listener = ep.listen(addr)?;
    println!("listening {}", listener.local_addr());
    let _ = std::io::stdout().flush();
    let chans: Vec<_> = (0..channels)
        .map(|_| listener.accept_timeout(HANG))
        .collect::<Result<_, _>>()?;
    let payload = vec![0x5a; MESSAGE_LEN];
    for ch in &chans {
        for _ in 0..MESSAGES {
            let m = ch.recv_timeout(HANG)?;
            if m.len() != MESSAGE_LEN {
                return Err(format!("a message of {} bytes", m.len()).into());
            }
        }
        for _ in 0..MESSAGES {
            ch.send(&payload)?;
        }
    }
    // The client confirms it received everything by one last message per channel.
    for ch in &chans {
        ch.recv_timeout(HANG)?;
    }
    report(
        "server",
        "fabriq",
        device,
        channels,
        channels as u64 * fabriq_channel_bytes(&cfg),
    );
    Ok(())
}

fn fabriq_client(device: &str, channels: usize, addr: SocketAddr) -> Res<()> {
    let cfg = config(device);
    let ep = Endpoint::new(cfg.clone())?;
    let chans: Vec<_> = (0..channels)
        .map(|_| ep.connect(addr))
        .collect::<Result<_, _>>()?;
    let payload = vec![0xa5; MESSAGE_LEN];
    for ch in &chans {
        for _ in 0..MESSAGES {
            ch.send(&payload)?;
        }
        for _ in 0..MESSAGES {
            let m = ch.recv_timeout(HANG)?;
            if m.len() != MESSAGE_LEN {
                return Err(format!("a message of {} bytes", m.len()).into());
            }
        }
    }
    for ch in &chans {
        ch.send(b"done")?;
    }
    report(
        "client",
        "fabriq",
        device,
        channels,
        channels as u64 * fabriq_channel_bytes(&cfg),
    );
    // Stay until the server has read the last messages (it closes when done).
    for ch in &chans {
        let _ = ch.recv_timeout(HANG);
    }
    Ok(())
}

/// One naive connection: its own registered receive ring and send buffer.
struct NaiveConn {
    est: Established,
    ring: MemoryRegion,
    send: MemoryRegion,
}

/// Poll `n` successful completions (busy-polling with yields, bounded by `HANG`).
fn poll_n(cq: &CompletionQueue, n: usize, what: &str) -> Res<()> {
    let mut wcs = [WorkCompletion::EMPTY; 64];
    let mut seen = 0;
    let deadline = std::time::Instant::now() + HANG;
    while seen < n {
        let got = cq.poll(&mut wcs[..(n - seen).min(64)])?;
        if got == 0 {
            if std::time::Instant::now() > deadline {
                return Err(format!("{what}: {seen} of {n} completions").into());
            }
            std::thread::yield_now();
            continue;
        }
        for wc in wcs.iter().take(got) {
            if wc.status != WcStatus::Success {
                return Err(format!("{what}: {wc:?}").into());
            }
        }
        seen += got;
    }
    Ok(())
}

fn naive(server: bool, device: &str, channels: usize, addr: SocketAddr) -> Res<()> {
    let ctx = Context::open(device)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16 * 1024)?;
    let cfg = ConnConfig {
        handshake_timeout: HANG,
        qp_caps: QpCaps {
            max_send_wr: MESSAGES as u32 + 8,
            max_recv_wr: MESSAGES as u32 + 8,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        ring: RingGeometry {
            slots: MESSAGES as u32,
            slot_size: NAIVE_SLOT as u32,
        },
        initial_credits: MESSAGES as u32,
        rnr_retry: Some(7),
        ..ConnConfig::default()
    };
    let mgr = ConnManager::new(&pd, &cq, cfg)?;
    let ring_len = MESSAGES * NAIVE_SLOT;
    let mut conns = Vec::with_capacity(channels);
    let post_ring = |qp: &fabriq_verbs::QueuePair, ring: &MemoryRegion| -> Res<()> {
        for i in 0..MESSAGES {
            let sge = ring.sge(i * NAIVE_SLOT, NAIVE_SLOT as u32)?;
            qp.post_recv(&[RecvWr::new(i as u64, &[sge])])?;
        }
        Ok(())
    };
    if server {
        let listener = mgr.listen(addr)?;
        println!("listening {}", listener.local_addr());
        let _ = std::io::stdout().flush();
        for _ in 0..channels {
            let ring = pd.alloc_mr(ring_len, AccessFlags::LOCAL_WRITE)?;
            let send = pd.alloc_mr(ring_len, AccessFlags::LOCAL_WRITE)?;
            let pending = listener.accept_pending(Some(HANG))?;
            post_ring(pending.qp(), &ring)?;
            conns.push(NaiveConn {
                est: pending.finish()?,
                ring,
                send,
            });
        }
    } else {
        for _ in 0..channels {
            let ring = pd.alloc_mr(ring_len, AccessFlags::LOCAL_WRITE)?;
            let send = pd.alloc_mr(ring_len, AccessFlags::LOCAL_WRITE)?;
            let pending = mgr.connect_pending(addr, None, HANG)?;
            post_ring(pending.qp(), &ring)?;
            conns.push(NaiveConn {
                est: pending.finish()?,
                ring,
                send,
            });
        }
    }
    let payload = vec![0x5a; MESSAGE_LEN];
    // Sends go out SEND_WINDOW at a time (each window completed before the next), which
    // changes no buffer and keeps the software providers' transmit queues short.
    let send_burst = |c: &NaiveConn| -> Res<()> {
        for i in 0..MESSAGES {
            c.send.write_at(i * NAIVE_SLOT, &payload)?;
            let sge = c.send.sge(i * NAIVE_SLOT, MESSAGE_LEN as u32)?;
            c.est.qp.post_send(&[
                SendWr::new(i as u64, &[sge], WrOpcode::Send).with_flags(SendFlags::SIGNALED)
            ])?;
            if (i + 1) % SEND_WINDOW == 0 {
                poll_n(&cq, SEND_WINDOW, "sends")?;
            }
        }
        Ok(())
    };
    for c in &conns {
        if server {
            poll_n(&cq, MESSAGES, "receives")?;
            send_burst(c)?;
        } else {
            send_burst(c)?;
            poll_n(&cq, MESSAGES, "receives")?;
        }
    }
    let registered = channels as u64 * 2 * ring_len as u64;
    let role = if server { "server" } else { "client" };
    report(role, "naive", device, channels, registered);
    // Keep everything registered until the report is out; the ring is read to keep it live.
    let mut first = [0u8; 1];
    for c in &conns {
        c.ring.read_at(0, &mut first)?;
    }
    if !server {
        // Let the server's last send completions arrive before the QPs go away.
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}
