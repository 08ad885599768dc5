//! `fabriq perf --server`: accepts control connections one at a time and answers each run the
//! client asks for. It needs no flags beyond where to listen: device, test, sizes and depths all
//! come in the client's messages, and are checked like any other peer input.

use std::io::Write as _;
use std::net::{SocketAddr, TcpListener};

use fabriq_verbs::{Context, DeviceConfig};

use super::baseline::{self, BaselineSocket};
use super::error::{chain, PerfError, Result, VerbsContext};
use super::lat;
use super::proto::{Control, Msg, RunParams, ServerReport, PROTOCOL_VERSION};
use super::report::Progress;
use super::rig::{Rig, Role};
use super::{affinity, bw, validate, TestKind, STALL};

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerOpts {
    /// Listen address.
    pub bind: String,
    /// Serve one session, then exit with its outcome.
    pub once: bool,
    /// Pin to this CPU.
    pub cpu: Option<usize>,
    /// No per-run log lines on stderr.
    pub quiet: bool,
}

/// Run the server until killed (or after one session with `once`).
pub fn serve(opts: &ServerOpts) -> Result<()> {
    if let Some(cpu) = opts.cpu {
        affinity::pin(cpu)?;
    }
    let listener = TcpListener::bind(&opts.bind).map_err(|source| PerfError::Unreachable {
        addr: format!("{} (bind)", opts.bind),
        source,
    })?;
    let local = listener.local_addr().map_err(|source| PerfError::Control {
        context: "local address",
        source,
    })?;
    // The first stdout line is the contract with `--local`, which reads the port from it.
    println!("fabriq perf server listening on {local}");
    let _ = std::io::stdout().flush();
    loop {
        let (stream, peer) = listener.accept().map_err(|source| PerfError::Control {
            context: "accept",
            source,
        })?;
        let mut control = Control::new(stream, STALL);
        let outcome = session(&mut control, opts);
        if let Err(e) = &outcome {
            // Tell the client when we still can; it may already be gone.
            let message = chain(e);
            let _ = control.send(&Msg::Error {
                message: message.clone(),
            });
            if !opts.once {
                eprintln!("fabriq perf server: session from {peer} failed: {message}");
            }
        }
        if opts.once {
            return outcome;
        }
    }
}

fn session(control: &mut Control, opts: &ServerOpts) -> Result<()> {
    let (device, options) = match control.recv()? {
        Msg::Hello {
            version,
            device,
            options,
        } => {
            if version != PROTOCOL_VERSION {
                return Err(PerfError::Protocol(format!(
                    "client speaks protocol {version}, this server {PROTOCOL_VERSION}"
                )));
            }
            (device, options)
        }
        other => return Err(other.unexpected("hello")),
    };
    // The device is opened lazily: the TCP baseline needs none.
    let mut ctx: Option<Context> = None;
    let provider = if device.is_empty() {
        String::from("tcp-socket")
    } else {
        let config = DeviceConfig {
            bind_addr: None,
            options,
        };
        let c = affinity::unpinned(|| Context::open_with(&device, &config))
            .verbs(format!("open device {device}"))?;
        let p = c.device().provider.clone();
        ctx = Some(c);
        p
    };
    control.send(&Msg::HelloAck {
        version: PROTOCOL_VERSION,
        device: device.clone(),
        provider,
        cpu: opts.cpu,
    })?;
    loop {
        match control.recv()? {
            Msg::Run(p) => {
                validate(&p)?;
                if !opts.quiet {
                    eprintln!(
                        "fabriq perf server: {} {} on {} ({} + {} iterations, {:?})",
                        p.test.name(),
                        super::size::human(u64::from(p.size)),
                        if device.is_empty() { "tcp" } else { &device },
                        p.warmup,
                        p.iters,
                        p.mode
                    );
                }
                let report = match (p.test, &ctx) {
                    (TestKind::TcpLat, _) => run_baseline(control, &p)?,
                    (_, Some(ctx)) => run_verbs(ctx, control, &p)?,
                    (_, None) => {
                        return Err(PerfError::Protocol(format!(
                            "{} needs a device; the client named none",
                            p.test.name()
                        )))
                    }
                };
                control.send(&Msg::Report(report))?;
            }
            Msg::Bye => return Ok(()),
            other => return Err(other.unexpected("run or bye")),
        }
    }
}

fn run_verbs(ctx: &Context, control: &mut Control, p: &RunParams) -> Result<ServerReport> {
    let rig = Rig::new(ctx, p, Role::Server)?;
    control.send(&Msg::Ready {
        endpoint: Some(rig.qp.endpoint()),
        region: Some(rig.region()),
        data_port: None,
    })?;
    let (endpoint, peer) = match control.recv()? {
        Msg::Connect { endpoint, region } => (endpoint, region),
        other => return Err(other.unexpected("connect")),
    };
    rig.connect(&endpoint)?;
    control.send(&Msg::Go)?;
    let total = p.warmup + p.iters;
    let quiet = Progress::off();
    let report = match p.test {
        TestKind::SendLat => {
            let out = lat::send_lat(&rig, p, false, &quiet)?;
            control.expect_end()?;
            ServerReport {
                messages: total,
                elapsed_ns: 0,
                errors: out.errors,
            }
        }
        TestKind::WriteLat => {
            lat::write_lat(&rig, p, &peer, false, &quiet)?;
            control.expect_end()?;
            ServerReport {
                messages: total,
                elapsed_ns: 0,
                errors: 0,
            }
        }
        TestKind::SendBw => {
            let r = bw::send_sink(&rig, p)?;
            control.expect_end()?;
            r
        }
        TestKind::AtomicLat => {
            lat::serve_passive(&rig, p.mode, control)?;
            // Every fetch-and-add of 1 must have landed exactly once.
            let word = rig
                .target
                .atomic_u64(0)
                .verbs("atomic target")?
                .load(std::sync::atomic::Ordering::Acquire);
            ServerReport {
                messages: word,
                elapsed_ns: 0,
                errors: u64::from(word != total),
            }
        }
        TestKind::ReadLat | TestKind::WriteBw | TestKind::ReadBw => {
            lat::serve_passive(&rig, p.mode, control)?;
            ServerReport::default()
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
    Ok(report)
}

fn run_baseline(control: &mut Control, p: &RunParams) -> Result<ServerReport> {
    let ip = control
        .local_addr()
        .map(|a| a.ip())
        .unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
    let listener =
        TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|source| PerfError::Baseline {
            context: "bind data listener",
            source,
        })?;
    let port = listener
        .local_addr()
        .map_err(|source| PerfError::Baseline {
            context: "data listener address",
            source,
        })?
        .port();
    control.send(&Msg::Ready {
        endpoint: None,
        region: None,
        data_port: Some(port),
    })?;
    let mut sock = BaselineSocket::accept(&listener, p.mode, STALL)?;
    control.send(&Msg::Go)?;
    let messages = baseline::server(&mut sock, p)?;
    control.expect_end()?;
    Ok(ServerReport {
        messages,
        elapsed_ns: 0,
        errors: 0,
    })
}
