//! The client side of `fabriq perf`: connects the control channel, asks the server for each
//! run (one per message size), drives the data path and collects the [`PerfReport`].

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use fabriq_verbs::{Context, DeviceConfig};

use super::baseline::{self, BaselineSocket};
use super::bw;
use super::error::{PerfError, Result, VerbsContext};
use super::lat::{self, LatOutcome};
use super::proto::{Control, Mode, Msg, RunParams, PROTOCOL_VERSION};
use super::report::{BwStats, LatStats, PerfReport, Progress, RunResult};
use super::rig::{Rig, Role};
use super::{TestKind, DEFAULT_PORT, STALL};

/// What the client was asked to run.
#[derive(Debug, Clone)]
pub struct ClientPlan {
    /// Server control address, `HOST` or `HOST:PORT`.
    pub server: String,
    /// Device on both sides.
    pub device: String,
    /// Provider options for the device, on both sides.
    pub options: BTreeMap<String, String>,
    /// One run per size, with these parameters (the size field is replaced per run).
    pub template: RunParams,
    /// Sizes to run.
    pub sizes: Vec<u32>,
    /// Whether the server is a local child (for the report).
    pub local: bool,
    /// The client's CPU, if pinned.
    pub client_cpu: Option<usize>,
    /// Show a progress bar if stderr is a terminal.
    pub progress: bool,
}

/// `HOST` → `HOST:18515`; `HOST:PORT` and `[v6]:PORT` as given.
pub fn with_default_port(server: &str) -> String {
    let has_port = if let Some(rest) = server.strip_prefix('[') {
        rest.contains("]:")
    } else {
        server.matches(':').count() == 1
    };
    if has_port {
        server.to_string()
    } else if server.contains(':') {
        format!("[{server}]:{DEFAULT_PORT}")
    } else {
        format!("{server}:{DEFAULT_PORT}")
    }
}

fn connect(server: &str) -> Result<(Control, SocketAddr)> {
    let target = with_default_port(server);
    let addrs: Vec<SocketAddr> = target
        .to_socket_addrs()
        .map_err(|e| PerfError::BadAddress {
            addr: server.to_string(),
            reason: e.to_string(),
        })?
        .collect();
    let mut last = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, Duration::from_secs(5)) {
            Ok(s) => return Ok((Control::new(s, STALL), *a)),
            Err(e) => last = Some(e),
        }
    }
    Err(PerfError::Unreachable {
        addr: target,
        source: last.unwrap_or_else(|| std::io::Error::other("address resolved to nothing")),
    })
}

/// The provider options a run opens its device with: the user's, plus `progress = busy` for a
/// `tcp` device in busy mode unless the user chose otherwise — a spinning poller should read
/// the sockets itself rather than wait for the provider's progress thread to wake up — and for
/// a `udp` device likewise where the process has more than one CPU (on one, the woken progress
/// thread delivers sooner than a poller's turn comes: see `fabriq::config::busy_progress_pays`).
pub fn device_options(
    device: &str,
    mode: Mode,
    user: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut options = user.clone();
    if mode == Mode::Busy && !options.contains_key("progress") {
        let provider = fabriq_verbs::devices()
            .unwrap_or_default()
            .into_iter()
            .find(|d| d.name == device)
            .map(|d| d.provider);
        let busy = match provider.as_deref() {
            Some("tcp") => true,
            Some("udp") => !super::affinity::one_cpu(),
            _ => false,
        };
        if busy {
            options.insert("progress".into(), "busy".into());
        }
    }
    options
}

/// Run the plan against the server.
pub fn run(plan: &ClientPlan) -> Result<PerfReport> {
    let test = plan.template.test;
    let device = if test == TestKind::TcpLat {
        String::new()
    } else {
        plan.device.clone()
    };
    let options = device_options(&device, plan.template.mode, &plan.options);
    // Open our side first: a missing device is reported without bothering the server.
    let ctx = if device.is_empty() {
        None
    } else {
        let config = DeviceConfig {
            bind_addr: None,
            options: options.clone(),
        };
        let opened = super::affinity::unpinned(|| Context::open_with(&device, &config));
        Some(opened.verbs(format!("open device {device}"))?)
    };
    let (mut control, server_addr) = connect(&plan.server)?;
    control.send(&Msg::Hello {
        version: PROTOCOL_VERSION,
        device: device.clone(),
        options: options.clone(),
    })?;
    let (provider, server_cpu) = match control.recv()? {
        Msg::HelloAck {
            version,
            provider,
            cpu,
            ..
        } => {
            if version != PROTOCOL_VERSION {
                return Err(PerfError::Protocol(format!(
                    "server speaks protocol {version}, this client {PROTOCOL_VERSION}"
                )));
            }
            (provider, cpu)
        }
        other => return Err(other.unexpected("hello_ack")),
    };
    if let Some(ctx) = &ctx {
        if ctx.device().provider != provider {
            return Err(PerfError::Protocol(format!(
                "server's {device} is a {provider} device, ours is {}",
                ctx.device().provider
            )));
        }
    }

    let per_run = plan.template.warmup + plan.template.iters;
    let progress = Progress::new(
        plan.progress && (plan.sizes.len() > 1 || per_run >= 200_000),
        per_run * plan.sizes.len() as u64,
    );
    let mut results = Vec::with_capacity(plan.sizes.len());
    for (n, &size) in plan.sizes.iter().enumerate() {
        let mut p = plan.template.clone();
        p.size = test.effective_size(size);
        if test.is_bandwidth() {
            // Warm-up touches every target slot once, so the peer's first-touch page faults
            // stay out of the measured stream.
            p.warmup = p.warmup.max(u64::from(super::rig::slot_count(&p)));
        }
        super::validate(&p)?;
        progress.next_run(per_run * n as u64, &super::size::human(u64::from(p.size)));
        let row = match &ctx {
            Some(ctx) => run_verbs(ctx, &mut control, &p, &progress)?,
            None => run_baseline(&mut control, server_addr, &p, &progress)?,
        };
        results.push(row);
    }
    progress.finish();
    control.send(&Msg::Bye)?;

    let errors = results.iter().map(RunResult::errors).sum();
    Ok(PerfReport {
        tool: "fabriq perf",
        layer: "verbs",
        test: test.name().to_string(),
        device: if device.is_empty() {
            "-".into()
        } else {
            device
        },
        device_options: options,
        provider,
        mode: format!("{:?}", plan.template.mode).to_lowercase(),
        api: None,
        server: server_addr.to_string(),
        local: plan.local,
        client_cpu: plan.client_cpu,
        server_cpu,
        one_cpu: super::affinity::one_cpu(),
        latency: test.latency_kind(),
        results,
        errors,
    })
}

fn lat_row(p: &RunParams, out: LatOutcome, server_errors: u64) -> Result<RunResult> {
    let kind = p
        .test
        .latency_kind()
        .ok_or_else(|| PerfError::Protocol("not a latency test".into()))?;
    Ok(RunResult::Latency(LatStats::from_rtt(
        p.size,
        p.warmup,
        kind,
        &out.rtt_ns,
        out.errors + server_errors,
    )))
}

fn run_verbs(
    ctx: &Context,
    control: &mut Control,
    p: &RunParams,
    progress: &Progress,
) -> Result<RunResult> {
    let rig = Rig::new(ctx, p, Role::Client)?;
    control.send(&Msg::Run(p.clone()))?;
    let (endpoint, peer) = match control.recv()? {
        Msg::Ready {
            endpoint: Some(endpoint),
            region: Some(region),
            ..
        } => (endpoint, region),
        other => return Err(other.unexpected("ready with endpoint and region")),
    };
    control.send(&Msg::Connect {
        endpoint: rig.qp.endpoint(),
        region: rig.region(),
    })?;
    rig.connect(&endpoint)?;
    match control.recv()? {
        Msg::Go => {}
        other => return Err(other.unexpected("go")),
    }
    enum Outcome {
        Lat(LatOutcome),
        Bw(bw::BwOutcome),
    }
    let outcome = match p.test {
        TestKind::SendLat => Outcome::Lat(lat::send_lat(&rig, p, true, progress)?),
        TestKind::WriteLat => Outcome::Lat(lat::write_lat(&rig, p, &peer, true, progress)?),
        TestKind::ReadLat => Outcome::Lat(lat::one_sided_rtt(&rig, p, &peer, false, progress)?),
        TestKind::AtomicLat => Outcome::Lat(lat::one_sided_rtt(&rig, p, &peer, true, progress)?),
        TestKind::SendBw | TestKind::WriteBw | TestKind::ReadBw => {
            Outcome::Bw(bw::client(&rig, p, &peer, progress)?)
        }
        TestKind::TcpLat => {
            return Err(PerfError::Protocol("tcp_lat runs without a device".into()))
        }
        TestKind::RpcLat | TestKind::RpcRate => {
            return Err(PerfError::Protocol(format!(
                "{} runs at --layer rpc",
                p.test.name()
            )))
        }
        TestKind::ConnectLat => {
            return Err(PerfError::Protocol(
                "connect_lat runs at --layer channel".into(),
            ))
        }
    };
    control.send(&Msg::End)?;
    let report = match control.recv()? {
        Msg::Report(r) => r,
        other => return Err(other.unexpected("report")),
    };
    match outcome {
        Outcome::Lat(out) => lat_row(p, out, report.errors),
        Outcome::Bw(out) => {
            let mut row = BwStats::new(
                p.size,
                p.iters,
                p.warmup,
                out.depth,
                out.elapsed.as_secs_f64(),
            );
            row.errors = report.errors;
            if p.test == TestKind::SendBw {
                row.server_messages = Some(report.messages);
                if report.messages != p.warmup + p.iters {
                    row.errors += 1;
                }
            }
            Ok(RunResult::Bandwidth(row))
        }
    }
}

fn run_baseline(
    control: &mut Control,
    server: SocketAddr,
    p: &RunParams,
    progress: &Progress,
) -> Result<RunResult> {
    control.send(&Msg::Run(p.clone()))?;
    let port = match control.recv()? {
        Msg::Ready {
            data_port: Some(port),
            ..
        } => port,
        other => return Err(other.unexpected("ready with a data port")),
    };
    let stream = TcpStream::connect_timeout(&SocketAddr::new(server.ip(), port), STALL).map_err(
        |source| PerfError::Baseline {
            context: "connect data socket",
            source,
        },
    )?;
    let mut sock = BaselineSocket::new(stream, p.mode, STALL)?;
    match control.recv()? {
        Msg::Go => {}
        other => return Err(other.unexpected("go")),
    }
    let out = baseline::client(&mut sock, p, progress)?;
    control.send(&Msg::End)?;
    let report = match control.recv()? {
        Msg::Report(r) => r,
        other => return Err(other.unexpected("report")),
    };
    lat_row(p, out, report.errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_port_is_added_only_when_missing() {
        assert_eq!(with_default_port("localhost"), "localhost:18515");
        assert_eq!(with_default_port("127.0.0.1:9"), "127.0.0.1:9");
        assert_eq!(with_default_port("::1"), "[::1]:18515");
        assert_eq!(with_default_port("[::1]:7"), "[::1]:7");
    }

    #[test]
    fn unreachable_server_is_a_typed_error() {
        // Bind then drop: the port is (very likely) closed now.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("ephemeral port");
        let e = connect(&format!("127.0.0.1:{port}")).expect_err("nothing listens");
        assert!(matches!(e, PerfError::Unreachable { .. }), "{e}");
        let e = connect("127.0.0.1:notaport").expect_err("bad port");
        assert!(matches!(e, PerfError::BadAddress { .. }), "{e}");
    }
}
