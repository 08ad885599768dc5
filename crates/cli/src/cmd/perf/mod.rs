//! `fabriq perf`: what perftest is to verbs, for every fabriq device.
//!
//! A client and a server (`--server`, or a child started by `--local`) agree on a run over a
//! TCP control connection ([`proto`]), each builds its verbs resources ([`rig`]), swaps QP
//! endpoints and region keys, and runs one test: ping-pong latency ([`lat`]), streaming
//! bandwidth ([`bw`]), or the plain kernel-TCP ping-pong baseline ([`baseline`]). Results are a
//! perftest-like table or one JSON document ([`report`]). `--layer channel|rpc` measures the
//! middleware's `fabriq::Channel` / `fabriq::Rpc` instead ([`mw`]).
//!
//! Threads (verbs layer): none. Each side is one pinned thread that owns its CQ and busy-polls it or sleeps
//! on its event fd (`--mode`). `--local` re-executes this binary as the server, pinned to
//! another CPU, and reads the port it listens on from its first stdout line.

pub mod affinity;
pub mod baseline;
pub mod bw;
pub mod client;
pub mod error;
pub mod lat;
pub mod mw;
pub mod proto;
pub mod report;
pub mod rig;
pub mod server;
pub mod size;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use fabriq_verbs::Capabilities;
use serde::{Deserialize, Serialize};

use error::{PerfError, Result};
use proto::{Mode, RunParams};
use report::LatencyKind;
use size::MsgSize;

/// Control port when none is given (perftest's).
pub const DEFAULT_PORT: u16 = 18515;

/// How long any wait may see no progress before the run is declared stalled.
pub const STALL: Duration = Duration::from_secs(15);

/// Largest `--tx-depth` / `--rx-depth` accepted (from the command line or a peer).
pub const MAX_DEPTH: u32 = 1 << 16;

/// The tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum TestKind {
    /// SEND/RECV ping-pong, one-way latency.
    SendLat,
    /// RDMA WRITE ping-pong polling the last byte, one-way latency.
    WriteLat,
    /// RDMA READ, round-trip latency.
    ReadLat,
    /// RDMA fetch-and-add, round-trip latency.
    AtomicLat,
    /// SEND streaming bandwidth and message rate.
    SendBw,
    /// RDMA WRITE streaming bandwidth and message rate.
    WriteBw,
    /// RDMA READ streaming bandwidth and message rate.
    ReadBw,
    /// Plain kernel TCP ping-pong (no device), one-way latency: the baseline.
    TcpLat,
    /// `fabriq::Rpc` call round trip (`--layer rpc`).
    RpcLat,
    /// `fabriq::Rpc` calls per second with `--callers` concurrent callers (`--layer rpc`).
    RpcRate,
    /// `fabriq::Endpoint::connect` until the channel is usable, cold (no cached QP or control
    /// stream on either side) and cached (both reused), in alternating blocks (`--layer
    /// channel`).
    ConnectLat,
}

/// The software layer a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Layer {
    /// Raw verbs: QPs, CQs, registered regions (perftest's level).
    Verbs,
    /// The middleware's `fabriq::Channel` (send / recv of messages).
    Channel,
    /// The middleware's `fabriq::Rpc` (`call` of a served method).
    Rpc,
}

impl Layer {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Layer::Verbs => "verbs",
            Layer::Channel => "channel",
            Layer::Rpc => "rpc",
        }
    }

    /// The test run when `-t` is not given.
    pub fn default_test(self) -> TestKind {
        match self {
            Layer::Verbs | Layer::Channel => TestKind::SendLat,
            Layer::Rpc => TestKind::RpcLat,
        }
    }
}

impl TestKind {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            TestKind::SendLat => "send_lat",
            TestKind::WriteLat => "write_lat",
            TestKind::ReadLat => "read_lat",
            TestKind::AtomicLat => "atomic_lat",
            TestKind::SendBw => "send_bw",
            TestKind::WriteBw => "write_bw",
            TestKind::ReadBw => "read_bw",
            TestKind::TcpLat => "tcp_lat",
            TestKind::RpcLat => "rpc_lat",
            TestKind::RpcRate => "rpc_rate",
            TestKind::ConnectLat => "connect_lat",
        }
    }

    /// Streaming bandwidth test?
    pub fn is_bandwidth(self) -> bool {
        matches!(
            self,
            TestKind::SendBw | TestKind::WriteBw | TestKind::ReadBw | TestKind::RpcRate
        )
    }

    /// What latency figures mean, for latency tests.
    pub fn latency_kind(self) -> Option<LatencyKind> {
        match self {
            TestKind::SendLat | TestKind::WriteLat | TestKind::TcpLat => Some(LatencyKind::OneWay),
            TestKind::ReadLat | TestKind::AtomicLat | TestKind::RpcLat => {
                Some(LatencyKind::RoundTrip)
            }
            TestKind::ConnectLat => Some(LatencyKind::Connect),
            _ => None,
        }
    }

    /// Device capabilities the test uses.
    pub fn needs(self) -> Capabilities {
        match self {
            TestKind::SendLat
            | TestKind::SendBw
            | TestKind::RpcLat
            | TestKind::RpcRate
            | TestKind::ConnectLat => Capabilities::SEND,
            TestKind::WriteLat | TestKind::WriteBw => Capabilities::WRITE,
            TestKind::ReadLat | TestKind::ReadBw => Capabilities::READ,
            TestKind::AtomicLat => Capabilities::ATOMICS,
            TestKind::TcpLat => Capabilities::empty(),
        }
    }

    /// Whether `role` keeps receives posted in this test.
    pub fn receives_on(self, role: rig::Role) -> bool {
        match self {
            TestKind::SendLat => true,
            TestKind::SendBw => role == rig::Role::Server,
            _ => false,
        }
    }

    /// The size actually moved: atomics are always 8 bytes.
    pub fn effective_size(self, size: u32) -> u32 {
        if self == TestKind::AtomicLat {
            8
        } else {
            size
        }
    }

    fn default_iters(self) -> u64 {
        if self.is_bandwidth() {
            5000
        } else {
            1000
        }
    }
}

/// Check run parameters, from the command line or from a peer.
pub fn validate(p: &RunParams) -> Result<()> {
    if p.size == 0 || u64::from(p.size) > size::MAX_SIZE {
        return Err(PerfError::Unsupported(format!(
            "message size {} not in 1..={}",
            p.size,
            size::MAX_SIZE
        )));
    }
    if p.iters == 0 {
        return Err(PerfError::Unsupported(
            "iterations must be at least 1".into(),
        ));
    }
    if p.iters.checked_add(p.warmup).is_none() || p.iters + p.warmup > u64::MAX / 2 {
        return Err(PerfError::Unsupported("too many iterations".into()));
    }
    for (name, v) in [("tx-depth", p.tx_depth), ("rx-depth", p.rx_depth)] {
        if v == 0 || v > MAX_DEPTH {
            return Err(PerfError::Unsupported(format!(
                "{name} {v} not in 1..={MAX_DEPTH}"
            )));
        }
    }
    if matches!(p.test, TestKind::RpcLat | TestKind::RpcRate) {
        return Err(PerfError::Unsupported(format!(
            "{} measures the middleware: use --layer rpc",
            p.test.name()
        )));
    }
    if p.test == TestKind::ConnectLat {
        return Err(PerfError::Unsupported(
            "connect_lat measures the middleware's connect: use --layer channel".into(),
        ));
    }
    if p.test == TestKind::WriteLat && p.mode == Mode::Event {
        return Err(PerfError::Unsupported(
            "write_lat polls memory (a WRITE raises no completion at the target); use --mode busy"
                .into(),
        ));
    }
    Ok(())
}

fn parse_option_arg(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

fn parse_size_arg(s: &str) -> std::result::Result<MsgSize, String> {
    size::parse_size(s).map_err(|e| e.to_string())
}

/// Measure latency and bandwidth between two fabriq endpoints (like perftest).
#[derive(Debug, clap::Args)]
#[command(
    about = "Measure latency and bandwidth between two fabriq endpoints (like perftest)",
    after_help = "Examples:\n  fabriq perf --server\n  fabriq perf 127.0.0.1 -d tcp0 -t send_lat -s 8\n  fabriq perf --local -d shm0 -t write_bw -a --json\n  fabriq perf --local --tcp-baseline -s 8\n  fabriq perf --local --layer channel -d shm0 -t send_lat\n  fabriq perf --local --layer rpc -d tcp0 -t rpc_rate --callers 16"
)]
pub struct Args {
    /// Server to connect to: HOST or HOST:PORT (default port 18515).
    #[arg(value_name = "HOST[:PORT]", conflicts_with_all = ["server", "local"])]
    pub target: Option<String>,
    /// Run as the server: wait for clients, which send every parameter.
    #[arg(long)]
    pub server: bool,
    /// Server listen address.
    #[arg(
        long,
        value_name = "ADDR",
        default_value = "127.0.0.1:18515",
        requires = "server"
    )]
    pub bind: String,
    /// Serve one session, then exit.
    #[arg(long, hide = true, requires = "server")]
    pub once: bool,
    /// Server: no per-run log lines.
    #[arg(long, hide = true, requires = "server")]
    pub quiet: bool,
    /// Start a server as a child process on this host (pinned to --server-cpu) and run against it.
    #[arg(long)]
    pub local: bool,
    /// Device (both sides).
    #[arg(
        short = 'd',
        long = "device",
        value_name = "DEVICE",
        default_value = "tcp0"
    )]
    pub device: String,
    /// Provider option for opening the device on both sides, KEY=VALUE (repeatable), e.g.
    /// `-o progress=thread` for tcp0 or udp0 (busy mode picks `progress=busy` for them).
    #[arg(short = 'o', long = "dev-opt", value_name = "KEY=VALUE", value_parser = parse_option_arg)]
    pub dev_opts: Vec<(String, String)>,
    /// Layer to measure: raw verbs, the middleware's fabriq::Channel, or its fabriq::Rpc.
    #[arg(long, value_enum, default_value = "verbs")]
    pub layer: Layer,
    /// Test to run (default: send_lat; rpc_lat with --layer rpc). Channel layer: send_lat,
    /// send_bw, connect_lat, read_lat, atomic_lat (one-sided, through `RemoteRegion`); rpc
    /// layer: rpc_lat, rpc_rate.
    #[arg(short = 't', long = "test", value_enum)]
    pub test: Option<TestKind>,
    /// Concurrent callers in rpc_rate.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub callers: u32,
    /// Middleware layers: who drives the endpoint's worker — the calling thread ("caller":
    /// send posts, recv/call poll the CQ) or a worker thread ("thread"). Both sides.
    #[arg(long, value_name = "caller|thread", default_value = "caller", value_parser = parse_progress_arg)]
    pub progress: fabriq::Progress,
    /// Middleware layers: the client's API — the blocking calls, or the async ones awaited on a
    /// tokio runtime (send_lat, rpc_lat, read_lat, atomic_lat).
    #[arg(long, value_enum, default_value = "sync")]
    pub api: mw::Api,
    /// Run the plain kernel-TCP ping-pong baseline instead of a device test (same as -t tcp_lat).
    #[arg(long)]
    pub tcp_baseline: bool,
    /// Message size: 8, 4K, 64KiB, 1M … (binary units).
    #[arg(short = 's', long = "size", value_parser = parse_size_arg, default_value = "8", conflicts_with = "all")]
    pub size: MsgSize,
    /// Sweep sizes 2 B .. 8 MiB in powers of two.
    #[arg(short = 'a', long = "all")]
    pub all: bool,
    /// Measured iterations per size (default 1000 for latency, 5000 for bandwidth tests).
    #[arg(short = 'n', long = "iters", value_name = "N")]
    pub iters: Option<u64>,
    /// Unmeasured warm-up iterations per size (default: a tenth of the iterations, at most 1000).
    #[arg(short = 'w', long = "warmup", value_name = "N")]
    pub warmup: Option<u64>,
    /// Busy-poll the CQ, or arm it and sleep on its event fd.
    #[arg(long, value_enum, default_value = "busy")]
    pub mode: Mode,
    /// Client CPU (--local default: 0); with --server, the server's CPU.
    #[arg(long, value_name = "N")]
    pub cpu: Option<usize>,
    /// Server CPU for --local (default: 1).
    #[arg(long, value_name = "M", requires = "local")]
    pub server_cpu: Option<usize>,
    /// Outstanding requests in bandwidth tests.
    #[arg(long, default_value_t = 128, value_name = "N")]
    pub tx_depth: u32,
    /// Receives kept posted by the receiving side.
    #[arg(long, default_value_t = 512, value_name = "N")]
    pub rx_depth: u32,
    /// Print one JSON document instead of the table (and no progress bar).
    #[arg(long)]
    pub json: bool,
}

fn parse_progress_arg(s: &str) -> Result<fabriq::Progress, String> {
    s.parse()
}

/// Entry point of `fabriq perf`.
pub fn run(args: Args) -> anyhow::Result<()> {
    affinity::capture_original();
    if args.server && args.layer != Layer::Verbs {
        let opts = mw::ServerOpts {
            bind: args.bind.clone(),
            device: args.device.clone(),
            progress: args.progress,
            once: args.once,
            cpu: args.cpu,
            quiet: args.quiet,
        };
        return mw::serve(&opts).context("perf server");
    }
    if args.server {
        let opts = server::ServerOpts {
            bind: args.bind.clone(),
            once: args.once,
            cpu: args.cpu,
            quiet: args.quiet,
        };
        return server::serve(&opts).context("perf server");
    }
    if args.layer != Layer::Verbs {
        return run_middleware(&args);
    }
    if args.api != mw::Api::Sync {
        anyhow::bail!("--api applies to --layer channel|rpc");
    }
    let test = if args.tcp_baseline {
        TestKind::TcpLat
    } else {
        args.test.unwrap_or(Layer::Verbs.default_test())
    };
    let iters = args.iters.unwrap_or(test.default_iters());
    let template = RunParams {
        test,
        size: args.size.0,
        iters,
        warmup: args.warmup.unwrap_or((iters / 10).min(1000)),
        mode: args.mode,
        tx_depth: args.tx_depth,
        rx_depth: args.rx_depth,
    };
    validate(&template)?;
    let sizes = if args.all {
        size::sweep()
    } else {
        vec![args.size.0]
    };

    let report = if args.local {
        run_local(&args, template, sizes)?
    } else {
        let Some(target) = args.target.clone() else {
            anyhow::bail!("give a server HOST[:PORT], or --server, or --local");
        };
        if let Some(cpu) = args.cpu {
            affinity::pin(cpu)?;
        }
        client::run(&client::ClientPlan {
            server: target,
            device: args.device.clone(),
            options: args.dev_opts.iter().cloned().collect(),
            template,
            sizes,
            local: false,
            client_cpu: args.cpu,
            progress: !args.json,
        })?
    };
    print_report(&args, &report)
}

fn print_report(args: &Args, report: &report::PerfReport) -> anyhow::Result<()> {
    if args.json {
        crate::out::outln!(
            "{}",
            serde_json::to_string_pretty(report).context("encode JSON")?
        )?;
    } else {
        crate::out::out!("{}", report::render_text(report))?;
    }
    if report.errors > 0 {
        anyhow::bail!("{} data check(s) failed", report.errors);
    }
    Ok(())
}

/// `--layer channel|rpc`: the middleware measurements ([`mw`]).
fn run_middleware(args: &Args) -> anyhow::Result<()> {
    let layer = args.layer;
    let test = args.test.unwrap_or(layer.default_test());
    if args.tcp_baseline {
        anyhow::bail!(
            "--tcp-baseline measures kernel TCP, not --layer {}",
            layer.name()
        );
    }
    if !args.dev_opts.is_empty() {
        anyhow::bail!(
            "-o provider options apply to --layer verbs; the middleware opens devices itself"
        );
    }
    if args.api == mw::Api::Async && !mw::has_async_form(test) {
        anyhow::bail!(
            "--api async: {} has no async form (send_lat, rpc_lat, read_lat, atomic_lat)",
            test.name()
        );
    }
    if args.callers == 0 || args.callers > 1024 {
        anyhow::bail!("--callers {} not in 1..=1024", args.callers);
    }
    let iters = args.iters.unwrap_or(test.default_iters());
    let warmup = args.warmup.unwrap_or((iters / 10).min(1000));
    let sizes = if args.all {
        size::sweep()
    } else {
        vec![args.size.0]
    };
    for &s in &sizes {
        mw::validate(layer, test, s, iters, warmup)?;
    }
    let plan = |server: String, local, client_cpu, server_cpu| mw::ClientPlan {
        server,
        layer,
        device: args.device.clone(),
        test,
        sizes: sizes.clone(),
        iters,
        warmup,
        callers: args.callers,
        progress: args.progress,
        api: args.api,
        local,
        client_cpu,
        server_cpu,
    };
    let report = if args.local {
        let extra = vec![
            "--layer".to_string(),
            layer.name().to_string(),
            "--device".to_string(),
            args.device.clone(),
            "--progress".to_string(),
            args.progress.to_string(),
        ];
        with_local_server(args, &extra, |addr, client_cpu, server_cpu| {
            mw::run_client(&plan(addr, true, client_cpu, server_cpu))
        })?
    } else {
        let Some(target) = args.target.clone() else {
            anyhow::bail!("give a server HOST:PORT (its middleware listen address), or --local");
        };
        if let Some(cpu) = args.cpu {
            affinity::pin(cpu)?;
        }
        mw::run_client(&plan(target, false, args.cpu, None))?
    };
    print_report(args, &report)
}

/// Kills and reaps the local server child unless it was waited for.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn run_local(args: &Args, template: RunParams, sizes: Vec<u32>) -> Result<report::PerfReport> {
    with_local_server(args, &[], |addr, client_cpu, _server_cpu| {
        client::run(&client::ClientPlan {
            server: addr,
            device: args.device.clone(),
            options: args.dev_opts.iter().cloned().collect(),
            template,
            sizes,
            local: true,
            client_cpu,
            progress: !args.json,
        })
    })
}

/// Start this binary as a one-session server child (with `extra` server arguments), read its
/// address from its first stdout line, pin this thread, and run `client` against it.
fn with_local_server<T>(
    args: &Args,
    extra: &[String],
    client: impl FnOnce(String, Option<usize>, Option<usize>) -> Result<T>,
) -> Result<T> {
    let cpus = affinity::available();
    let (default_client, default_server) = affinity::local_defaults(&cpus);
    let client_cpu = args.cpu.or(default_client);
    let server_cpu = args.server_cpu.or(default_server);
    if client_cpu.is_some() && client_cpu == server_cpu && !args.json {
        eprintln!(
            "warning: client and server share CPU {}; latency will suffer",
            client_cpu.unwrap_or(0)
        );
    }
    let exe = std::env::current_exe()
        .map_err(|e| PerfError::LocalServer(format!("cannot find own executable: {e}")))?;
    let mut cmd = Command::new(exe);
    cmd.args([
        "perf",
        "--server",
        "--bind",
        "127.0.0.1:0",
        "--once",
        "--quiet",
    ]);
    cmd.args(extra);
    if let Some(cpu) = server_cpu {
        cmd.args(["--cpu", &cpu.to_string()]);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd
        .spawn()
        .map_err(|e| PerfError::LocalServer(format!("spawn: {e}")))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| PerfError::LocalServer("no stdout pipe".into()))?;
    let mut guard = ChildGuard(Some(child));
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| PerfError::LocalServer(format!("read its address: {e}")))?;
    let addr = line
        .trim()
        .rsplit(' ')
        .next()
        .filter(|a| a.parse::<std::net::SocketAddr>().is_ok())
        .ok_or_else(|| {
            PerfError::LocalServer(if line.is_empty() {
                "exited before listening".into()
            } else {
                format!("unexpected first line {line:?}")
            })
        })?
        .to_string();

    if let Some(cpu) = client_cpu {
        affinity::pin(cpu)?;
    }
    let report = client(addr, client_cpu, server_cpu);

    // The child exits after the session; give it a moment, then the guard kills it.
    if let Some(child) = guard.0.as_mut() {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => {
                    guard.0 = None;
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(test: TestKind) -> RunParams {
        RunParams {
            test,
            size: 8,
            iters: 10,
            warmup: 0,
            mode: Mode::Busy,
            tx_depth: 16,
            rx_depth: 16,
        }
    }

    #[test]
    fn validate_refuses_bad_parameters() {
        assert!(validate(&params(TestKind::SendLat)).is_ok());
        let mut p = params(TestKind::SendLat);
        p.iters = 0;
        assert!(validate(&p).is_err());
        let mut p = params(TestKind::SendBw);
        p.tx_depth = 0;
        assert!(validate(&p).is_err());
        let mut p = params(TestKind::SendBw);
        p.rx_depth = MAX_DEPTH + 1;
        assert!(validate(&p).is_err());
        let mut p = params(TestKind::SendLat);
        p.iters = u64::MAX;
        p.warmup = 1;
        assert!(validate(&p).is_err());
        let mut p = params(TestKind::WriteLat);
        p.mode = Mode::Event;
        assert!(validate(&p).is_err());
        let mut p = params(TestKind::SendLat);
        p.size = 0;
        assert!(validate(&p).is_err());
    }

    #[test]
    fn test_properties() {
        assert_eq!(TestKind::AtomicLat.effective_size(4096), 8);
        assert_eq!(TestKind::SendLat.effective_size(4096), 4096);
        assert!(TestKind::SendLat.receives_on(rig::Role::Client));
        assert!(!TestKind::SendBw.receives_on(rig::Role::Client));
        assert!(TestKind::SendBw.receives_on(rig::Role::Server));
        assert_eq!(
            TestKind::ReadLat.latency_kind(),
            Some(LatencyKind::RoundTrip)
        );
        assert_eq!(TestKind::WriteBw.latency_kind(), None);
        assert!(TestKind::WriteBw.is_bandwidth());
    }

    #[test]
    fn cli_parses_the_documented_forms() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            a: Args,
        }
        let t = T::try_parse_from([
            "x", "--local", "-d", "shm0", "-t", "write_bw", "-s", "64KiB",
        ])
        .expect("parse");
        assert_eq!(t.a.test, Some(TestKind::WriteBw));
        assert_eq!(t.a.layer, Layer::Verbs);
        assert_eq!(t.a.size, MsgSize(65536));
        let t = T::try_parse_from([
            "x",
            "--local",
            "--layer",
            "rpc",
            "-t",
            "rpc_rate",
            "--callers",
            "4",
        ])
        .expect("parse");
        assert_eq!(t.a.layer, Layer::Rpc);
        assert_eq!(t.a.test, Some(TestKind::RpcRate));
        assert_eq!(t.a.callers, 4);
        assert!(T::try_parse_from(["x", "--local", "--layer", "nope"]).is_err());
        assert!(T::try_parse_from(["x", "--local", "-t", "nope"]).is_err());
        assert!(T::try_parse_from(["x", "--local", "-s", "0"]).is_err());
        assert!(T::try_parse_from(["x", "--local", "-s", "8", "-a"]).is_err());
        let t = T::try_parse_from(["x", "127.0.0.1:9", "--mode", "event"]).expect("parse");
        assert_eq!(t.a.mode, Mode::Event);
        assert!(T::try_parse_from(["x", "127.0.0.1", "--server"]).is_err());
    }
}
