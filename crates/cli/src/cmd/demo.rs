//! `fabriq demo`: the middleware end to end in one command, with no NIC and no set-up.
//!
//! Starts a server as a second process (this same binary, re-executed with `--serve`), connects
//! to it on the embedded default device (`auto`: shm on one host), and shows an eager message, a
//! rendezvous message, RPC calls and a distributed lock by remote compare-and-swap, each with
//! measured latencies, in a short report. The server prints its address on its first stdout line
//! and then serves until the client's channel closes.
//!
//! Latency is what the demo measures, so by default each process's application thread drives
//! its endpoint's worker (`--progress caller`: no hand-off to a worker thread) and, where the
//! host has two CPUs or more, the client's thread runs on one CPU and the server's on another
//! (as `fabriq perf --local` places them); the report says so. `--progress thread` shows the
//! default of an application endpoint instead.

use std::io::{BufRead, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::cmd::perf::affinity;
use crate::out::outln;
use anyhow::{bail, Context as _};
use fabriq::{CasLock, Config, Endpoint, Progress, RegionDescriptor, Rpc};

/// Run a client and a server process and show channel, RPC and one-sided operations.
#[derive(Debug, clap::Args)]
#[command(about = "Run a server and a client process and show channels, RPC and a CAS lock")]
pub struct Args {
    /// Device: auto (shm on one host), shm0, tcp0, …
    #[arg(short = 'd', long = "device", default_value = "auto")]
    pub device: String,
    /// Round trips per measurement.
    #[arg(short = 'n', long = "iterations", default_value_t = 2000)]
    pub iterations: u32,
    /// Who drives each endpoint's worker: the application thread ("caller") or a worker
    /// thread ("thread", the `Config` default).
    #[arg(long, value_name = "caller|thread", default_value = "caller", value_parser = parse_progress)]
    pub progress: Progress,
    /// The client thread's CPU (default: 0 and the server on 1 where the host has two CPUs
    /// or more, else neither is pinned).
    #[arg(long, value_name = "N")]
    pub cpu: Option<usize>,
    /// The server thread's CPU (default: see `--cpu`).
    #[arg(long, value_name = "M")]
    pub server_cpu: Option<usize>,
    /// Internal: run the server half and print its address.
    #[arg(long, hide = true)]
    pub serve: bool,
}

fn parse_progress(s: &str) -> Result<Progress, String> {
    s.parse()
}

/// Pin the calling thread to `cpu` if given; a CPU that cannot be had leaves it unpinned
/// (with a note on stderr) — the demo still runs.
fn pin(cpu: Option<usize>) -> Option<usize> {
    let cpu = cpu?;
    match affinity::pin(cpu) {
        Ok(()) => Some(cpu),
        Err(e) => {
            eprintln!("fabriq demo: not pinned: {e}");
            None
        }
    }
}

const TIMEOUT: Duration = Duration::from_secs(30);

/// Run `fabriq demo`.
pub fn run(args: Args) -> anyhow::Result<()> {
    affinity::capture_original();
    let config = Config {
        device: args.device.clone(),
        progress: args.progress,
        ..Config::from_env().context("reading FABRIQ_* configuration")?
    };
    if args.serve {
        return serve(config, args.cpu);
    }
    client(config, &args)
}

fn serve(config: Config, cpu: Option<usize>) -> anyhow::Result<()> {
    pin(cpu);
    // Opened with the process's whole CPU set: the provider's and the worker's threads must
    // not share the pinned thread's CPU.
    let ep = affinity::unpinned(|| Endpoint::new(config)).context("opening the server endpoint")?;
    ep.serve("echo", |req| Ok(req.to_vec()));
    let region = ep.expose(4096).context("exposing the lock region")?;
    let listener = ep.listen("127.0.0.1:0").context("listening")?;
    outln!("LISTEN {}", listener.local_addr())?;
    std::io::stdout().flush().ok();
    let ch = listener
        .accept_timeout(TIMEOUT)
        .context("waiting for the client")?;
    ch.send(&region.descriptor().to_bytes())?;
    // Echo channel messages until the client goes away.
    while let Ok(m) = ch.recv() {
        ch.send(&m)?;
    }
    Ok(())
}

struct Lat {
    samples: Vec<Duration>,
}

impl Lat {
    fn new() -> Lat {
        Lat {
            samples: Vec::new(),
        }
    }
    fn pct(&mut self, p: f64) -> Duration {
        self.samples.sort_unstable();
        let i = ((self.samples.len() as f64 - 1.0) * p).round() as usize;
        self.samples.get(i).copied().unwrap_or_default()
    }
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn client(config: Config, args: &Args) -> anyhow::Result<()> {
    let cpus = affinity::available();
    let (client_cpu, server_cpu) = match (args.cpu, args.server_cpu) {
        (None, None) if cpus.len() >= 2 => affinity::local_defaults(&cpus),
        given => given,
    };
    let exe = std::env::current_exe().context("locating this binary")?;
    let progress = args.progress.to_string();
    let mut cmd = Command::new(exe);
    cmd.args(["demo", "--serve", "--device", &args.device, "--progress", &progress]);
    if let Some(c) = server_cpu {
        cmd.args(["--cpu", &c.to_string()]);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the server process")?;
    let stdout = child.stdout.take().context("server stdout")?;
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .context("reading the server address")?;
    let Some(addr) = line.trim().strip_prefix("LISTEN ") else {
        let _ = child.kill();
        bail!("server did not start: {line:?}");
    };
    let placement = Placement {
        progress,
        client: pin(client_cpu),
        server: server_cpu,
    };
    let result = run_client(config, addr, args.iterations.max(10), &placement);
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// How the two processes run, for the report's first line.
struct Placement {
    progress: String,
    client: Option<usize>,
    server: Option<usize>,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} progress", self.progress)?;
        match (self.client, self.server) {
            (Some(c), Some(s)) => write!(f, ", client on CPU {c}, server on CPU {s}"),
            _ => write!(f, ", not pinned"),
        }
    }
}

fn run_client(config: Config, addr: &str, n: u32, placement: &Placement) -> anyhow::Result<()> {
    let ep = affinity::unpinned(|| Endpoint::new(config)).context("opening the client endpoint")?;
    let t0 = Instant::now();
    let ch = ep.connect(addr).context("connecting to the server")?;
    let connect = t0.elapsed();
    let desc = RegionDescriptor::from_bytes(&ch.recv_timeout(TIMEOUT)?)
        .context("server sent a bad region descriptor")?;
    outln!(
        "fabriq demo: two processes, device {} ({placement})",
        ep.device()
    )?;
    outln!("  connected to {addr} in {}", us(connect))?;
    // More channels to the same peer are new streams on the pooled connection. The first
    // pays for what runs for the first time in the process; the median is what one costs.
    const MORE: usize = 20;
    let mut more = Lat::new();
    for _ in 0..MORE {
        let t = Instant::now();
        let c = ep.connect(addr).context("opening another channel")?;
        more.samples.push(t.elapsed());
        drop(c);
    }
    let first = more.samples[0];
    outln!(
        "  {MORE} more channels to it: p50 {}, the first {} (streams on the pooled connection: {} connection set up)",
        us(more.pct(0.5)),
        us(first),
        ep.conn_stats().connects
    )?;
    outln!(
        "  thresholds: eager up to {} B, rendezvous above (RDMA READ in chunks)",
        ch.eager_max()
    )?;

    // Eager: 8-byte ping-pong.
    let mut lat = Lat::new();
    let msg = [7u8; 8];
    for _ in 0..n {
        let t = Instant::now();
        ch.send(&msg)?;
        let back = ch.recv_timeout(TIMEOUT)?;
        lat.samples.push(t.elapsed() / 2);
        anyhow::ensure!(back[..] == msg, "eager echo corrupted");
    }
    outln!(
        "  eager 8 B message:       one-way p50 {}  p99 {}  ({} round trips)",
        us(lat.pct(0.5)),
        us(lat.pct(0.99)),
        n
    )?;

    // Rendezvous: 1 MiB ping-pong.
    let big: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
    let mut lat = Lat::new();
    let rounds = (n / 20).clamp(5, 100);
    let start = Instant::now();
    for _ in 0..rounds {
        let t = Instant::now();
        ch.send(&big)?;
        let back = ch.recv_timeout(TIMEOUT)?;
        lat.samples.push(t.elapsed() / 2);
        anyhow::ensure!(back[..] == big[..], "rendezvous echo corrupted");
    }
    let secs = start.elapsed().as_secs_f64();
    let gib_s = (2.0 * f64::from(rounds) * (1u64 << 20) as f64) / secs / (1u64 << 30) as f64;
    outln!(
        "  rendezvous 1 MiB message: one-way p50 {}  ({gib_s:.2} GiB/s, {rounds} round trips)",
        us(lat.pct(0.5)),
    )?;
    let st = ch.stats()?;
    outln!(
        "    sent {} eager / {} rendezvous; the peer pulled the large ones with RDMA READ",
        st.eager_sent, st.rendezvous_sent
    )?;

    // RPC.
    let rpc = Rpc::new(ch.clone());
    let mut lat = Lat::new();
    for i in 0..n {
        let t = Instant::now();
        let r = rpc.call("echo", &i.to_le_bytes(), TIMEOUT)?;
        lat.samples.push(t.elapsed());
        anyhow::ensure!(r == i.to_le_bytes(), "RPC reply mismatch");
    }
    outln!(
        "  RPC echo (4 B):          p50 {}  p99 {}  ({} calls, handler runs on the server's worker)",
        us(lat.pct(0.5)),
        us(lat.pct(0.99)),
        n
    )?;
    // The same calls from a tokio task: `call_async` awaits the reply without a thread of its
    // own (in caller mode the task moves the worker while it looks for the reply).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let mut lat = rt.block_on(async {
        let mut lat = Lat::new();
        for i in 0..n {
            let t = Instant::now();
            let r = rpc.call_async("echo", &i.to_le_bytes(), TIMEOUT).await?;
            lat.samples.push(t.elapsed());
            anyhow::ensure!(r == i.to_le_bytes(), "async RPC reply mismatch");
        }
        Ok::<_, anyhow::Error>(lat)
    })?;
    outln!(
        "  RPC echo, async (tokio): p50 {}  p99 {}  ({} call_async from one task)",
        us(lat.pct(0.5)),
        us(lat.pct(0.99)),
        n
    )?;
    let threads = 8u32;
    let per = (n / 2).max(10);
    let start = Instant::now();
    // The callers share the client's CPU (they inherit its pin, where there is one). Spawned
    // on any CPU they also ran on the server's and took it from the server's worker: 46–51 k
    // calls/s against 0.55–0.91 M on the 2-CPU test host (three demos each, 2026-12-04).
    let workers: Vec<_> = {
        (0..threads)
            .map(|_| {
                let rpc = rpc.clone();
                std::thread::spawn(move || -> anyhow::Result<()> {
                    for i in 0..per {
                        rpc.call("echo", &i.to_le_bytes(), TIMEOUT)?;
                    }
                    Ok(())
                })
            })
            .collect()
    };
    for w in workers {
        w.join().map_err(|_| anyhow::anyhow!("caller panicked"))??;
    }
    let rate = f64::from(threads * per) / start.elapsed().as_secs_f64();
    outln!("  RPC rate, {threads} callers:      {rate:.0} calls/s")?;
    match rpc.call("no-such-method", b"", TIMEOUT) {
        Err(fabriq::RpcError::UnknownMethod(_)) => {
            outln!("  RPC to an unknown method: UnknownMethod error, as expected")?
        }
        other => bail!("unknown method answered {other:?}"),
    }

    // CAS lock on the server's memory: no server code runs per acquisition.
    let lock = CasLock::new(ch.remote_region(desc), 0, u64::from(std::process::id()))?;
    let mut lat = Lat::new();
    let rounds = n.min(2000);
    for _ in 0..rounds {
        let t = Instant::now();
        lock.lock()?;
        lat.samples.push(t.elapsed());
        let r = lock.region();
        let v = u64::from_le_bytes(r.read(8, 8)?[..8].try_into()?);
        r.write(8, &(v + 1).to_le_bytes())?;
        lock.unlock()?;
    }
    let count = u64::from_le_bytes(lock.region().read(8, 8)?[..8].try_into()?);
    outln!(
        "  CAS lock on server memory: acquire p50 {}  ({rounds} lock/increment/unlock, counter = {count})",
        us(lat.pct(0.5)),
    )?;
    let mem = ep.memory_stats();
    outln!(
        "  buffer memory (client): {:.1} MiB registered in its pools, {:.1} MiB of it large buffers kept for reuse",
        mem.registered_bytes as f64 / (1 << 20) as f64,
        mem.cached_large_bytes as f64 / (1 << 20) as f64,
    )?;
    outln!("done.")?;
    Ok(())
}
