//! `fabriq perf --layer channel|rpc`: the same measurements one layer up, through the
//! middleware's `fabriq::Channel` and `fabriq::Rpc` instead of raw verbs.
//!
//! There is no separate control connection: the middleware's own listen address is the
//! rendezvous. The server (`--server --layer channel|rpc`) opens an `Endpoint` on its device,
//! serves the `echo` RPC method, listens and prints its address on the first stdout line; the
//! client connects one `Channel`, and every run is agreed on that channel with small JSON
//! control messages ([`Ctl`]) between the data messages:
//!
//! ```text
//! Run{test, size, iters, warmup} → Ready
//! send_lat:  (warmup + iters) × [client data → server, same bytes back]
//! send_bw:   warmup × data → Count{messages};  iters × data → Count{messages}  (clock: first
//!            measured send .. the second Count)
//! rpc_*:     calls of `echo` (served by the server's worker thread, not by this loop)
//! read_lat, atomic_lat: Run → Region{addr, len, rkey} instead of Ready (a region the server
//!            exposed for the run, holding the payload: no server code runs per operation);
//!            then (warmup + iters) `RemoteRegion::read` / `fetch_and_add` on it
//! connect_lat: Run → Listeners{cold_port, cached_port, floor} instead of Ready; then
//!            (warmup + iters) connects to each listener, in alternating blocks, each one
//!            closed and settled on both sides (the `perf.settled` RPC) before the next,
//!            and as many round trips on the server's wake floor socket in the same blocks
//! End → Done{errors}
//! Bye (server exits with --once)
//! ```
//!
//! Each side knows from `Run` exactly how many data messages follow, so data and control never
//! need to be told apart by content. Every wait is bounded by [`STALL`]; peer input (a bad
//! `Run`, a wrong message length) becomes an error or a counted data-check failure, never a
//! panic.
//!
//! Threads: with `--progress caller` (the default) the benchmark thread drives its endpoint's
//! worker itself — `send` posts, `recv_timeout` / `Rpc::call` poll the CQ — and the worker
//! thread (spawned by `Endpoint::new`, outside the pinned CPU, see [`affinity::unpinned`]) only
//! stands by; with `--progress thread` the worker threads move the bytes and the benchmark
//! thread waits on them. `rpc_rate` adds `--callers` caller threads. `send_bw` sends buffers
//! taken from the channel (`Channel::alloc` + `send_buf`): no copy per message, and — as in
//! perftest — the payload is written once per buffer, not per message.
//!
//! `connect_lat` times `Endpoint::connect` from the client's benchmark thread: **cold** from an
//! endpoint without a QP cache or kept control streams to a server endpoint without them (a
//! new QP on both sides, a new TCP control stream), **cached** between two endpoints with the
//! defaults (the QPs and the control stream of the previous connection reused). Neither
//! client endpoint has any other connection to the server, so the connection pool never
//! answers a connect. The server's listeners and their accepting threads run on the server's
//! pinned CPU; between connects the client waits until both sides have closed the connection
//! and put its QPs back (out of the timed part), and the run fails if the cached connects did
//! not reuse QPs or the cold ones did.

mod asynchronous;
mod floor;

use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use fabriq::{Channel, Config, Endpoint, Progress, RegionDescriptor, RemoteRegion, Rpc};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use super::affinity;
use super::error::{PerfError, Result};
use super::report::{BwStats, LatStats, LatencyKind, PerfReport, RunResult};
use super::{Layer, TestKind, STALL};

/// RPC method the server answers with its request.
pub const ECHO: &str = "echo";

/// Control messages on the benchmark channel.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Ctl {
    /// Client → server: the next run.
    Run {
        /// Test.
        test: TestKind,
        /// Message / request size, bytes.
        size: u32,
        /// Measured iterations.
        iters: u64,
        /// Warm-up iterations.
        warmup: u64,
    },
    /// Server → client: ready for the data phase.
    Ready,
    /// Server → client (connect_lat): the ports of its two listeners, on the address the
    /// client reached it at.
    Listeners {
        /// The listener of an endpoint without QP cache or kept control streams.
        cold_port: u16,
        /// The listener of the server's own endpoint (defaults).
        cached_port: u16,
        /// The abstract Unix socket name of the wake floor ([`floor`]); absent from a server
        /// without one.
        #[serde(default)]
        floor: Option<String>,
    },
    /// Server → client (read_lat, atomic_lat): the region exposed for the run.
    Region {
        /// Its address in the server.
        addr: u64,
        /// Its length, bytes.
        len: u64,
        /// Its key for this channel.
        rkey: u32,
    },
    /// Server → client (send_bw): messages received in the phase just ended.
    Count {
        /// Messages.
        messages: u64,
        /// Messages of the wrong length.
        errors: u64,
    },
    /// Client → server: the run is over (latency, rpc tests).
    End,
    /// Server → client: its data-check failures in the run.
    Done {
        /// Failed checks.
        errors: u64,
    },
    /// Server → client: the run was refused or failed.
    Error {
        /// Why.
        message: String,
    },
    /// Client → server: session over.
    Bye,
}

/// Largest control message accepted (a `Run` is well under 200 bytes).
const MAX_CTL: usize = 4096;

/// RPC method of the server (connect_lat): how many of the test's accepted connections have
/// been closed and have their QPs back (a `u64`, little-endian).
pub const SETTLED: &str = "perf.settled";

/// connect_lat: connects of one kind in a row before the other kind's turn.
const CONNECT_BLOCK: u64 = 10;

fn chan_err(context: impl Into<String>) -> impl FnOnce(fabriq::ChannelError) -> PerfError {
    let context = context.into();
    move |source| PerfError::Channel { context, source }
}

fn send_ctl(ch: &Channel, msg: &Ctl) -> Result<()> {
    let bytes = serde_json::to_vec(msg)
        .map_err(|e| PerfError::Protocol(format!("encode control message: {e}")))?;
    ch.send_timeout(&bytes, STALL)
        .map_err(chan_err("send a control message"))
}

fn recv_ctl(ch: &Channel, waiting_for: &str) -> Result<Ctl> {
    let m = ch
        .recv_timeout(STALL)
        .map_err(chan_err(format!("wait for {waiting_for}")))?;
    if m.len() > MAX_CTL {
        return Err(PerfError::Protocol(format!(
            "{}-byte message where a control message ({waiting_for}) was expected",
            m.len()
        )));
    }
    serde_json::from_slice(&m)
        .map_err(|e| PerfError::Protocol(format!("bad control message ({waiting_for}): {e}")))
}

fn expect_ctl(ch: &Channel, waiting_for: &str) -> Result<Ctl> {
    match recv_ctl(ch, waiting_for)? {
        Ctl::Error { message } => Err(PerfError::Server(message)),
        m => Ok(m),
    }
}

/// Check a run's parameters for a middleware layer (command line or peer input).
/// Whether `test` has an async form (`--api async`).
pub fn has_async_form(test: TestKind) -> bool {
    matches!(
        test,
        TestKind::SendLat | TestKind::RpcLat | TestKind::ReadLat | TestKind::AtomicLat
    )
}

pub fn validate(layer: Layer, test: TestKind, size: u32, iters: u64, warmup: u64) -> Result<()> {
    let ok = match layer {
        Layer::Channel => matches!(
            test,
            TestKind::SendLat
                | TestKind::SendBw
                | TestKind::ConnectLat
                | TestKind::ReadLat
                | TestKind::AtomicLat
        ),
        Layer::Rpc => matches!(test, TestKind::RpcLat | TestKind::RpcRate),
        Layer::Verbs => false,
    };
    if !ok {
        return Err(PerfError::Unsupported(format!(
            "test {} is not available at --layer {} (channel: send_lat, send_bw, connect_lat, read_lat, atomic_lat; rpc: rpc_lat, rpc_rate)",
            test.name(),
            layer.name()
        )));
    }
    if size == 0 || u64::from(size) > super::size::MAX_SIZE {
        return Err(PerfError::Unsupported(format!(
            "message size {size} not in 1..={}",
            super::size::MAX_SIZE
        )));
    }
    if iters == 0 {
        return Err(PerfError::Unsupported(
            "iterations must be at least 1".into(),
        ));
    }
    if !iters.checked_add(warmup).is_some_and(|t| t <= u64::MAX / 2) {
        return Err(PerfError::Unsupported("too many iterations".into()));
    }
    Ok(())
}

/// The endpoint's configuration: `FABRIQ_*` variables (and `FABRIQ_CONFIG`) tune it, the
/// command line sets device and progress.
fn open_endpoint(device: &str, progress: Progress) -> Result<Endpoint> {
    open_endpoint_with(device, progress, false)
}

/// [`open_endpoint`]; `cold`: without QP cache and kept control streams (connect_lat).
fn open_endpoint_with(device: &str, progress: Progress, cold: bool) -> Result<Endpoint> {
    let mut config = Config::from_env().map_err(|e| PerfError::Unsupported(format!("{e}")))?;
    config.device = device.to_string();
    config.progress = progress;
    if cold {
        config.qp_cache_size = 0;
        config.reuse_control_streams = false;
    }
    // Worker threads must not inherit a benchmark thread's single-CPU mask.
    affinity::unpinned(|| Endpoint::new(config))
        .map_err(chan_err(format!("open a middleware endpoint on {device}")))
}

/// What the middleware server needs.
#[derive(Debug, Clone)]
pub struct ServerOpts {
    /// Listen address.
    pub bind: String,
    /// Device.
    pub device: String,
    /// Who drives the worker.
    pub progress: Progress,
    /// Serve one session, then exit.
    pub once: bool,
    /// CPU to pin the serving thread to.
    pub cpu: Option<usize>,
    /// No per-session log lines.
    pub quiet: bool,
}

/// Run the middleware-layer server: print the listen address, serve sessions.
pub fn serve(opts: &ServerOpts) -> Result<()> {
    let ep = open_endpoint(&opts.device, opts.progress)?;
    ep.serve(ECHO, |req| Ok(req.to_vec()));
    let settled = Arc::new(AtomicU64::new(0));
    let count = settled.clone();
    ep.serve(SETTLED, move |_| {
        Ok(count.load(Ordering::Acquire).to_le_bytes().to_vec())
    });
    let listener = ep
        .listen(opts.bind.as_str())
        .map_err(chan_err(format!("listen on {}", opts.bind)))?;
    let rig = ServerRig {
        ep: &ep,
        opts,
        ip: listener.local_addr().ip(),
        settled: &settled,
    };
    if let Some(cpu) = opts.cpu {
        affinity::pin(cpu)?;
    }
    println!(
        "fabriq perf server (middleware, device {}) listening on {}",
        opts.device,
        listener.local_addr()
    );
    let _ = std::io::stdout().flush();
    loop {
        let ch = if opts.once {
            listener
                .accept_timeout(STALL)
                .map_err(chan_err("wait for the client's channel"))?
        } else {
            listener.accept().map_err(chan_err("accept a channel"))?
        };
        let result = session(&ch, &rig);
        if let Err(e) = &result {
            let message = super::error::chain(e);
            if send_ctl(
                &ch,
                &Ctl::Error {
                    message: message.clone(),
                },
            )
            .is_ok()
            {
                // Give the message time to leave before the endpoint goes; the wait ends early
                // when the client closes.
                let _ = ch.recv_timeout(Duration::from_secs(1));
            }
            if !opts.quiet {
                eprintln!("fabriq perf server: session failed: {message}");
            }
        }
        if opts.once {
            return result;
        }
    }
}

/// What a session needs besides its channel.
struct ServerRig<'a> {
    ep: &'a Endpoint,
    opts: &'a ServerOpts,
    /// The address the session's listener is bound to (connect_lat's listeners too).
    ip: std::net::IpAddr,
    /// connect_lat: accepted connections closed and settled (the `perf.settled` RPC).
    settled: &'a AtomicU64,
}

fn session(ch: &Channel, rig: &ServerRig<'_>) -> Result<()> {
    loop {
        // Between runs the client may take its time (printing, the next size's set-up), but a
        // vanished client must not hold the server forever.
        match recv_ctl(ch, "the next run")? {
            Ctl::Run {
                test,
                size,
                iters,
                warmup,
            } => {
                let layer = if matches!(test, TestKind::RpcLat | TestKind::RpcRate) {
                    Layer::Rpc
                } else {
                    Layer::Channel
                };
                validate(layer, test, size, iters, warmup)?;
                if test == TestKind::ConnectLat {
                    serve_connects(ch, rig)?;
                    continue;
                }
                // One-sided tests: the region lives until the run's end.
                let _region = match test {
                    TestKind::ReadLat | TestKind::AtomicLat => Some(offer_region(ch, rig, size)?),
                    _ => {
                        send_ctl(ch, &Ctl::Ready)?;
                        None
                    }
                };
                let errors = match test {
                    TestKind::SendLat => serve_pingpong(ch, size, iters + warmup)?,
                    TestKind::SendBw => {
                        let e1 = serve_stream(ch, size, warmup)?;
                        let e2 = serve_stream(ch, size, iters)?;
                        e1 + e2
                    }
                    _ => 0,
                };
                match expect_ctl(ch, "the end of the run")? {
                    Ctl::End => send_ctl(ch, &Ctl::Done { errors })?,
                    other => {
                        return Err(PerfError::Protocol(format!("expected End, got {other:?}")))
                    }
                }
            }
            Ctl::Bye => return Ok(()),
            other => {
                return Err(PerfError::Protocol(format!(
                    "expected Run or Bye, got {other:?}"
                )))
            }
        }
    }
}

/// read_lat, atomic_lat, server side: a region of `size` bytes (8 at least) holding the
/// payload (an atomic's word starts at 0), its descriptor for this channel to the client.
fn offer_region(ch: &Channel, rig: &ServerRig<'_>, size: u32) -> Result<fabriq::ExposedRegion> {
    let len = size.max(8) as usize;
    let region = rig
        .ep
        .expose(len)
        .map_err(chan_err("expose a region for the run"))?;
    let mut content = payload(size);
    content.resize(len, 0);
    content[..8].fill(0);
    region
        .write_at(0, &content)
        .map_err(chan_err("fill the run's region"))?;
    let d = region.descriptor_for(ch);
    send_ctl(
        ch,
        &Ctl::Region {
            addr: d.addr,
            len: d.len,
            rkey: d.rkey,
        },
    )?;
    Ok(region)
}

/// connect_lat, server side: two listeners (a cold endpoint's and this endpoint's), their
/// ports to the client, and a thread per listener that accepts, waits for the client's close
/// and counts the connection once its QP is back; until the client's `End`.
fn serve_connects(ch: &Channel, rig: &ServerRig<'_>) -> Result<()> {
    let cold_ep = open_endpoint_with(&rig.opts.device, rig.opts.progress, true)?;
    let at = std::net::SocketAddr::new(rig.ip, 0);
    let cold = cold_ep
        .listen(at)
        .map_err(chan_err("connect_lat: listen (cold)"))?;
    let cached = rig
        .ep
        .listen(at)
        .map_err(chan_err("connect_lat: listen (cached)"))?;
    let wake_floor = floor::FloorServer::bind()?;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let result = std::thread::scope(|scope| {
        let accepting = [(&cold_ep, &cold), (rig.ep, &cached)].map(|(ep, l)| {
            let stop = &stop;
            scope.spawn(move || accept_and_settle(ep, l, stop, rig.settled))
        });
        let flooring = scope.spawn(|| wake_floor.serve(&stop));
        let ran = (|| {
            send_ctl(
                ch,
                &Ctl::Listeners {
                    cold_port: cold.local_addr().port(),
                    cached_port: cached.local_addr().port(),
                    floor: Some(wake_floor.name().to_string()),
                },
            )?;
            match expect_ctl(ch, "the end of the run")? {
                Ctl::End => Ok(()),
                other => Err(PerfError::Protocol(format!("expected End, got {other:?}"))),
            }
        })();
        stop.store(true, Ordering::Release);
        let mut errors = 0;
        for t in accepting.into_iter().chain([flooring]) {
            match t.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    if !rig.opts.quiet {
                        eprintln!("fabriq perf server: connect_lat: {}", super::error::chain(&e));
                    }
                    errors += 1;
                }
                Err(_) => errors += 1,
            }
        }
        ran.map(|()| errors)
    });
    let errors = result?;
    send_ctl(ch, &Ctl::Done { errors })
}

/// QPs of `ep` in use now (created, not cached, not destroyed).
fn qps_in_use(ep: &Endpoint) -> u64 {
    let st = ep.conn_stats();
    st.qps_created
        .saturating_sub(st.qps_dropped)
        .saturating_sub(st.qps_cached)
}

/// connect_lat: how often the untimed waits between connects look again. They sleep rather
/// than spin, so that they leave the CPUs to the endpoints' threads.
const SETTLE_POLL: Duration = Duration::from_micros(20);

/// Wait until `ep` has no more than `baseline` QPs in use.
fn await_qps_back(ep: &Endpoint, baseline: u64, who: &str) -> Result<()> {
    let until = Instant::now() + STALL;
    while qps_in_use(ep) > baseline {
        if Instant::now() > until {
            return Err(PerfError::Protocol(format!(
                "connect_lat: the {who}'s QPs did not come back after a close ({:?})",
                ep.conn_stats()
            )));
        }
        std::thread::sleep(SETTLE_POLL);
    }
    Ok(())
}

fn accept_and_settle(
    ep: &Endpoint,
    listener: &fabriq::Listener,
    stop: &std::sync::atomic::AtomicBool,
    settled: &AtomicU64,
) -> Result<()> {
    let baseline = qps_in_use(ep);
    while !stop.load(Ordering::Acquire) {
        let ch = match listener.accept_timeout(Duration::from_millis(50)) {
            Ok(ch) => ch,
            Err(fabriq::ChannelError::Timeout) => continue,
            Err(e) => return Err(chan_err("connect_lat: accept")(e)),
        };
        drop(ch);
        await_qps_back(ep, baseline, "server")?;
        settled.fetch_add(1, Ordering::AcqRel);
    }
    Ok(())
}

/// Echo `count` messages; count the ones of the wrong length.
fn serve_pingpong(ch: &Channel, size: u32, count: u64) -> Result<u64> {
    let mut errors = 0;
    for _ in 0..count {
        let m = ch
            .recv_timeout(STALL)
            .map_err(chan_err("send_lat: wait for a ping"))?;
        if m.len() != size as usize {
            errors += 1;
        }
        ch.send_timeout(&m, STALL)
            .map_err(chan_err("send_lat: send the pong"))?;
    }
    Ok(errors)
}

/// Receive `count` messages and acknowledge the count.
fn serve_stream(ch: &Channel, size: u32, count: u64) -> Result<u64> {
    let mut errors = 0;
    for _ in 0..count {
        let m = ch
            .recv_timeout(STALL)
            .map_err(chan_err("send_bw: wait for a message"))?;
        if m.len() != size as usize {
            errors += 1;
        }
    }
    send_ctl(
        ch,
        &Ctl::Count {
            messages: count,
            errors,
        },
    )?;
    Ok(errors)
}

/// The client's API in the middleware layers: the blocking calls, or the async ones awaited on
/// a current-thread tokio runtime (`send_async` / `recv_async`, `call_async`, `read_async`,
/// `fetch_and_add_async`). The server answers with the blocking calls either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Api {
    #[default]
    Sync,
    Async,
}

impl Api {
    pub fn name(self) -> &'static str {
        match self {
            Api::Sync => "sync",
            Api::Async => "async",
        }
    }
}

/// What the client side runs.
#[derive(Debug, Clone)]
pub struct ClientPlan {
    /// The server's middleware listen address.
    pub server: String,
    /// Layer (channel or rpc).
    pub layer: Layer,
    /// Device.
    pub device: String,
    /// Test.
    pub test: TestKind,
    /// Sizes, one run each.
    pub sizes: Vec<u32>,
    /// Measured iterations per size.
    pub iters: u64,
    /// Warm-up iterations per size.
    pub warmup: u64,
    /// Concurrent callers (rpc_rate).
    pub callers: u32,
    /// Who drives the worker.
    pub progress: Progress,
    /// The client's API.
    pub api: Api,
    /// Started the server as a local child?
    pub local: bool,
    /// Client CPU, if pinned.
    pub client_cpu: Option<usize>,
    /// Server CPU, if pinned.
    pub server_cpu: Option<usize>,
}

fn provider_of(device: &str) -> String {
    fabriq_verbs::devices()
        .ok()
        .and_then(|list| list.into_iter().find(|d| d.name == device))
        .map(|d| d.provider)
        .unwrap_or_else(|| "-".into())
}

fn payload(size: u32) -> Vec<u8> {
    (0..size).map(|i| (i as u8).wrapping_mul(31)).collect()
}

/// Run a middleware-layer session against a server.
pub fn run_client(plan: &ClientPlan) -> Result<PerfReport> {
    let ep = open_endpoint(&plan.device, plan.progress)?;
    let ch = ep
        .connect(plan.server.as_str())
        .map_err(chan_err(format!("connect to {}", plan.server)))?;
    let rpc = Rpc::new(ch.clone());
    let mut results = Vec::with_capacity(plan.sizes.len());
    for &size in &plan.sizes {
        validate(plan.layer, plan.test, size, plan.iters, plan.warmup)?;
        send_ctl(
            &ch,
            &Ctl::Run {
                test: plan.test,
                size,
                iters: plan.iters,
                warmup: plan.warmup,
            },
        )?;
        if plan.test == TestKind::ConnectLat {
            let rows = connect_lat(plan, &ch, &rpc, plan.iters, plan.warmup)?;
            send_ctl(&ch, &Ctl::End)?;
            let server_errors = match expect_ctl(&ch, "Done")? {
                Ctl::Done { errors } => errors,
                other => {
                    return Err(PerfError::Protocol(format!("expected Done, got {other:?}")))
                }
            };
            let mut rows = rows.into_iter();
            results.extend(rows.next().map(|r| add_errors(r, server_errors)));
            results.extend(rows);
            break;
        }
        let region = match expect_ctl(&ch, "Ready")? {
            Ctl::Ready => None,
            Ctl::Region { addr, len, rkey } => Some(ch.remote_region(RegionDescriptor {
                addr,
                len,
                rkey,
            })),
            other => {
                return Err(PerfError::Protocol(format!(
                    "expected Ready, got {other:?}"
                )))
            }
        };
        let row = match (plan.test, &region) {
            _ if plan.api == Api::Async => {
                asynchronous::run(plan, &ch, &rpc, region.as_ref(), size)?
            }
            (TestKind::ReadLat, Some(r)) => read_lat(r, size, plan.iters, plan.warmup)?,
            (TestKind::AtomicLat, Some(r)) => atomic_lat(r, plan.iters, plan.warmup)?,
            _ => match plan.test {
            TestKind::SendLat => send_lat(&ch, size, plan.iters, plan.warmup)?,
            TestKind::SendBw => send_bw(&ch, size, plan.iters, plan.warmup)?,
            TestKind::RpcLat => rpc_lat(&rpc, size, plan.iters, plan.warmup)?,
            TestKind::RpcRate => rpc_rate(&rpc, size, plan.iters, plan.warmup, plan.callers)?,
            other => {
                return Err(PerfError::Unsupported(format!(
                    "{} is a verbs-layer test, or the server sent no region",
                    other.name()
                )))
            }
            },
        };
        send_ctl(&ch, &Ctl::End)?;
        let server_errors = match expect_ctl(&ch, "Done")? {
            Ctl::Done { errors } => errors,
            other => return Err(PerfError::Protocol(format!("expected Done, got {other:?}"))),
        };
        results.push(add_errors(row, server_errors));
    }
    send_ctl(&ch, &Ctl::Bye)?;
    // Keep the endpoint (and its worker) until the server has the Bye and closes its side;
    // the wait ends with the close (an error here) or after a bound.
    let _ = ch.recv_timeout(Duration::from_secs(2));
    let errors = results.iter().map(RunResult::errors).sum();
    Ok(PerfReport {
        tool: "fabriq perf",
        layer: plan.layer.name(),
        test: plan.test.name().to_string(),
        device: plan.device.clone(),
        device_options: Default::default(),
        provider: provider_of(&plan.device),
        mode: plan.progress.to_string(),
        api: Some(plan.api.name()),
        server: plan.server.clone(),
        local: plan.local,
        client_cpu: plan.client_cpu,
        server_cpu: plan.server_cpu,
        one_cpu: super::affinity::one_cpu(),
        latency: plan.test.latency_kind(),
        results,
        errors,
    })
}

fn add_errors(row: RunResult, more: u64) -> RunResult {
    match row {
        RunResult::Latency(mut l) => {
            l.errors += more;
            RunResult::Latency(l)
        }
        RunResult::Bandwidth(mut b) => {
            b.errors += more;
            RunResult::Bandwidth(b)
        }
    }
}

fn histogram() -> Result<Histogram<u64>> {
    Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)
        .map_err(|e| PerfError::Protocol(format!("histogram: {e}")))
}

fn record(h: &mut Histogram<u64>, d: Duration) {
    let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1);
    h.saturating_record(ns);
}

/// `warmup + iters` timed exchanges; `exchange` does one and says whether its reply was intact.
fn latency_loop(
    size: u32,
    iters: u64,
    warmup: u64,
    kind: LatencyKind,
    mut exchange: impl FnMut() -> Result<bool>,
) -> Result<RunResult> {
    let mut lat = Latencies::new(warmup)?;
    for i in 0..warmup + iters {
        let t0 = Instant::now();
        let intact = exchange()?;
        lat.add(i, t0.elapsed(), intact);
    }
    Ok(lat.finish(size, kind))
}

/// The timings of a latency loop: exchanges after the warm-up recorded, failed checks counted.
struct Latencies {
    h: Histogram<u64>,
    warmup: u64,
    errors: u64,
}

impl Latencies {
    fn new(warmup: u64) -> Result<Latencies> {
        Ok(Latencies {
            h: histogram()?,
            warmup,
            errors: 0,
        })
    }

    /// Exchange `i` took `rtt`; its reply was `intact`.
    fn add(&mut self, i: u64, rtt: Duration, intact: bool) {
        if !intact {
            self.errors += 1;
        }
        if i >= self.warmup {
            record(&mut self.h, rtt);
        }
    }

    fn finish(self, size: u32, kind: LatencyKind) -> RunResult {
        RunResult::Latency(LatStats::from_rtt(
            size,
            self.warmup,
            kind,
            &self.h,
            self.errors,
        ))
    }
}

/// connect_lat, client side: cold and cached connects in turn (blocks of [`CONNECT_BLOCK`]),
/// each closed and settled on both sides before the next, and — where the server's wake floor
/// socket can be reached — as many floor round trips in blocks of their own, each followed by
/// one `settled` call as the connects are; a row for each kind.
fn connect_lat(
    plan: &ClientPlan,
    ch: &Channel,
    rpc: &Rpc,
    iters: u64,
    warmup: u64,
) -> Result<Vec<RunResult>> {
    let (cold_port, cached_port, floor_name) = match expect_ctl(ch, "Listeners")? {
        Ctl::Listeners {
            cold_port,
            cached_port,
            floor,
        } => (cold_port, cached_port, floor),
        other => {
            return Err(PerfError::Protocol(format!(
                "expected Listeners, got {other:?}"
            )))
        }
    };
    let ip = std::net::ToSocketAddrs::to_socket_addrs(plan.server.as_str())
        .ok()
        .and_then(|mut a| a.next())
        .map(|a| a.ip())
        .ok_or_else(|| PerfError::Protocol(format!("server address {:?}", plan.server)))?;
    let settled = || -> Result<u64> {
        let r = rpc
            .call(SETTLED, &[], STALL)
            .map_err(rpc_err("connect_lat: ask the server"))?;
        let bytes: [u8; 8] = r
            .try_into()
            .map_err(|_| PerfError::Protocol("connect_lat: a bad settled count".into()))?;
        Ok(u64::from_le_bytes(bytes))
    };
    enum Target {
        Connect {
            ep: Endpoint,
            to: std::net::SocketAddr,
        },
        Floor(floor::FloorClient),
    }
    struct Kind {
        target: Target,
        h: Histogram<u64>,
        name: &'static str,
        errors: u64,
    }
    let mut kinds = vec![
        Kind {
            target: Target::Connect {
                ep: open_endpoint_with(&plan.device, plan.progress, true)?,
                to: std::net::SocketAddr::new(ip, cold_port),
            },
            h: histogram()?,
            name: "cold",
            errors: 0,
        },
        Kind {
            target: Target::Connect {
                ep: open_endpoint_with(&plan.device, plan.progress, false)?,
                to: std::net::SocketAddr::new(ip, cached_port),
            },
            h: histogram()?,
            name: "cached",
            errors: 0,
        },
    ];
    if let Some(f) = floor_name.as_deref().and_then(floor::FloorClient::connect) {
        kinds.push(Kind {
            target: Target::Floor(f),
            h: histogram()?,
            name: "floor",
            errors: 0,
        });
    }
    let base = settled()?;
    let total = warmup + iters;
    let mut done = 0u64;
    let mut next = vec![0u64; kinds.len()];
    while next.iter().any(|&n| n < total) {
        for (k, kind) in kinds.iter_mut().enumerate() {
            for _ in 0..CONNECT_BLOCK.min(total - next[k]) {
                let took = match &mut kind.target {
                    Target::Connect { ep, to } => {
                        let t0 = Instant::now();
                        let c = ep.connect(*to).map_err(chan_err(format!(
                            "connect_lat: connect ({})",
                            kind.name
                        )))?;
                        let took = t0.elapsed();
                        drop(c);
                        done += 1;
                        // Untimed: both sides have closed and have their QPs back.
                        await_qps_back(ep, 0, "client")?;
                        took
                    }
                    Target::Floor(f) => {
                        let t0 = Instant::now();
                        let same = f.ping()?;
                        let took = t0.elapsed();
                        kind.errors += u64::from(!same);
                        took
                    }
                };
                if next[k] >= warmup {
                    record(&mut kind.h, took);
                }
                next[k] += 1;
                let until = Instant::now() + STALL;
                while settled()? < base + done {
                    if Instant::now() > until {
                        return Err(PerfError::Protocol(
                            "connect_lat: the server did not settle a closed connection".into(),
                        ));
                    }
                    std::thread::sleep(SETTLE_POLL);
                }
            }
        }
    }
    // Self-check: the kinds measured what they say.
    let stats = |k: &Kind| match &k.target {
        Target::Connect { ep, .. } => Some(ep.conn_stats()),
        Target::Floor(_) => None,
    };
    let (cs, hs) = (stats(&kinds[0]), stats(&kinds[1]));
    if let Some(cs) = cs.filter(|cs| cs.qp_cache_hits > 0 || cs.stream_reuses > 0) {
        return Err(PerfError::Protocol(format!(
            "connect_lat: cold connects reused a QP or a control stream ({cs:?})"
        )));
    }
    // The first connect creates the QP and opens a TCP control stream, the second opens the
    // server's local one (same host); every later one reuses both.
    if let Some(hs) = hs.filter(|hs| hs.qp_cache_hits + 1 < total || hs.stream_reuses + 2 < total)
    {
        return Err(PerfError::Protocol(format!(
            "connect_lat: cached connects did not reuse their QP and control stream ({hs:?})"
        )));
    }
    Ok(kinds
        .iter()
        .map(|k| {
            let mut l = LatStats::from_rtt(0, warmup, LatencyKind::Connect, &k.h, k.errors);
            l.case = Some(k.name);
            RunResult::Latency(l)
        })
        .collect())
}

fn send_lat(ch: &Channel, size: u32, iters: u64, warmup: u64) -> Result<RunResult> {
    let buf = payload(size);
    latency_loop(size, iters, warmup, LatencyKind::OneWay, || {
        ch.send_timeout(&buf, STALL)
            .map_err(chan_err("send_lat: send a ping"))?;
        let m = ch
            .recv_timeout(STALL)
            .map_err(chan_err("send_lat: wait for the pong"))?;
        Ok(m[..] == buf[..])
    })
}

/// Missing (or extra) messages according to the receiver's count.
fn count_gap(ch: &Channel, expected: u64) -> Result<u64> {
    match expect_ctl(ch, "the receiver's count")? {
        Ctl::Count { messages, .. } => Ok(expected.abs_diff(messages)),
        other => Err(PerfError::Protocol(format!(
            "expected Count, got {other:?}"
        ))),
    }
}

/// One message of a stream in a buffer taken from the channel, sent without a copy. The pool
/// and the large-buffer cache hand the same few buffers out again and again: each gets the
/// payload written the first time it is seen (`filled`, by address; nothing else is sent from
/// this thread during the stream, so a filled buffer still holds it).
fn send_zero_copy(
    ch: &Channel,
    payload: &[u8],
    filled: &mut std::collections::HashSet<usize>,
    context: &'static str,
) -> Result<()> {
    let mut buf = ch.alloc(payload.len()).map_err(chan_err(context))?;
    if filled.insert(buf.as_ptr() as usize) {
        buf.copy_from_slice(payload);
    }
    ch.send_buf_timeout(buf, STALL).map_err(chan_err(context))
}

fn send_bw(ch: &Channel, size: u32, iters: u64, warmup: u64) -> Result<RunResult> {
    let buf = payload(size);
    let mut filled = std::collections::HashSet::new();
    for _ in 0..warmup {
        send_zero_copy(ch, &buf, &mut filled, "send_bw: send (warm-up)")?;
    }
    // Wrong lengths come back in Done; the counts check completeness.
    let warm_gap = count_gap(ch, warmup)?;
    let t0 = Instant::now();
    for _ in 0..iters {
        send_zero_copy(ch, &buf, &mut filled, "send_bw: send")?;
    }
    let missing = count_gap(ch, iters)?;
    let elapsed = t0.elapsed().as_secs_f64();
    let mut b = BwStats::new(size, iters, warmup, 0, elapsed);
    b.server_messages = Some(iters.saturating_sub(missing));
    b.errors = warm_gap + missing;
    Ok(RunResult::Bandwidth(b))
}

fn rpc_err(context: &'static str) -> impl FnOnce(fabriq::RpcError) -> PerfError {
    move |source| PerfError::Rpc {
        context: context.into(),
        source,
    }
}

/// read_lat: one-sided reads of the server's region, checked against the payload it holds
/// (whose first 8 bytes are zero).
fn read_lat(region: &RemoteRegion, size: u32, iters: u64, warmup: u64) -> Result<RunResult> {
    let mut want = payload(size);
    want.iter_mut().take(8).for_each(|b| *b = 0);
    latency_loop(size, iters, warmup, LatencyKind::RoundTrip, || {
        let got = region
            .read(0, size)
            .map_err(chan_err("read_lat: read the server's region"))?;
        Ok(got == want)
    })
}

/// atomic_lat: fetch-and-add 1 on the server's word, which must return the count so far.
fn atomic_lat(region: &RemoteRegion, iters: u64, warmup: u64) -> Result<RunResult> {
    let mut expected = 0u64;
    latency_loop(8, iters, warmup, LatencyKind::RoundTrip, || {
        let before = region
            .fetch_and_add(0, 1)
            .map_err(chan_err("atomic_lat: fetch-and-add on the server's word"))?;
        let intact = before == expected;
        expected = before.wrapping_add(1);
        Ok(intact)
    })
}

fn rpc_lat(rpc: &Rpc, size: u32, iters: u64, warmup: u64) -> Result<RunResult> {
    let buf = payload(size);
    latency_loop(size, iters, warmup, LatencyKind::RoundTrip, || {
        let reply = rpc
            .call(ECHO, &buf, STALL)
            .map_err(rpc_err("rpc_lat: call echo"))?;
        Ok(reply == buf)
    })
}

fn rpc_rate(rpc: &Rpc, size: u32, iters: u64, warmup: u64, callers: u32) -> Result<RunResult> {
    let callers = u64::from(callers.max(1));
    let buf = Arc::new(payload(size));
    let errors = Arc::new(AtomicU64::new(0));
    // Callers plus this thread: everyone warmed up before the clock starts.
    let start = Arc::new(Barrier::new(callers as usize + 1));
    let mut threads = Vec::with_capacity(callers as usize);
    for c in 0..callers {
        // Spread iterations and warm-up over the callers; the first ones take the remainder.
        let share = |total: u64| total / callers + u64::from(c < total % callers);
        let (n, w) = (share(iters), share(warmup));
        let (rpc, buf, errors, start) = (rpc.clone(), buf.clone(), errors.clone(), start.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("perf-caller-{c}"))
            .spawn(move || -> Result<()> {
                let one = |what: &'static str| -> Result<()> {
                    let reply = rpc.call(ECHO, &buf, STALL).map_err(rpc_err(what))?;
                    if reply[..] != buf[..] {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(())
                };
                let warm = (0..w).try_for_each(|_| one("rpc_rate: call echo (warm-up)"));
                start.wait();
                warm?;
                (0..n).try_for_each(|_| one("rpc_rate: call echo"))
            });
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => {
                // Callers already started stay parked on the barrier; the process is about to
                // report the error and exit, which ends them.
                return Err(PerfError::Unsupported(format!(
                    "cannot start caller thread {c}: {e}"
                )));
            }
        }
    }
    start.wait();
    let t0 = Instant::now();
    let mut first_err = None;
    for t in threads {
        match t.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert(PerfError::Protocol("a caller thread panicked".into()));
            }
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    if let Some(e) = first_err {
        return Err(e);
    }
    let mut b = BwStats::new(size, iters, warmup, 0, elapsed);
    b.callers = Some(callers as u32);
    b.calls_per_s = Some(iters as f64 / elapsed.max(1e-9));
    b.errors = errors.load(Ordering::Relaxed);
    Ok(RunResult::Bandwidth(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_messages_round_trip_as_json() {
        let m = Ctl::Run {
            test: TestKind::RpcRate,
            size: 8,
            iters: 10,
            warmup: 1,
        };
        let bytes = serde_json::to_vec(&m).expect("encode");
        assert!(bytes.len() < MAX_CTL);
        let back: Ctl = serde_json::from_slice(&bytes).expect("decode");
        assert_eq!(back, m);
        assert!(serde_json::from_slice::<Ctl>(b"\x00\x01garbage").is_err());
        let m = Ctl::Listeners {
            cold_port: 1,
            cached_port: 65535,
            floor: Some("fabriq-perf-floor-1-0".into()),
        };
        let back: Ctl = serde_json::from_slice(&serde_json::to_vec(&m).expect("encode"))
            .expect("decode");
        assert_eq!(back, m);
        // A server without a wake floor leaves the name out.
        let back: Ctl =
            serde_json::from_slice(br#"{"op":"listeners","cold_port":1,"cached_port":2}"#)
                .expect("decode");
        assert_eq!(
            back,
            Ctl::Listeners {
                cold_port: 1,
                cached_port: 2,
                floor: None
            }
        );
        // A port out of range is a decode error, not a wrapped number.
        assert!(serde_json::from_slice::<Ctl>(
            br#"{"op":"listeners","cold_port":70000,"cached_port":1}"#
        )
        .is_err());
    }

    #[test]
    fn tests_belong_to_their_layer() {
        assert!(validate(Layer::Channel, TestKind::SendLat, 8, 10, 0).is_ok());
        assert!(validate(Layer::Channel, TestKind::SendBw, 8, 10, 0).is_ok());
        assert!(validate(Layer::Rpc, TestKind::RpcLat, 8, 10, 0).is_ok());
        assert!(validate(Layer::Rpc, TestKind::RpcRate, 8, 10, 0).is_ok());
        assert!(validate(Layer::Channel, TestKind::ConnectLat, 8, 10, 0).is_ok());
        assert!(validate(Layer::Rpc, TestKind::ConnectLat, 8, 10, 0).is_err());
        assert!(validate(Layer::Channel, TestKind::RpcLat, 8, 10, 0).is_err());
        assert!(validate(Layer::Rpc, TestKind::SendLat, 8, 10, 0).is_err());
        assert!(validate(Layer::Channel, TestKind::WriteLat, 8, 10, 0).is_err());
        assert!(validate(Layer::Channel, TestKind::ReadLat, 8, 10, 0).is_ok());
        assert!(validate(Layer::Channel, TestKind::AtomicLat, 8, 10, 0).is_ok());
        assert!(validate(Layer::Rpc, TestKind::ReadLat, 8, 10, 0).is_err());
        assert!(validate(Layer::Channel, TestKind::SendLat, 0, 10, 0).is_err());
        assert!(validate(Layer::Channel, TestKind::SendLat, 8, 0, 0).is_err());
        assert!(validate(Layer::Rpc, TestKind::RpcLat, 8, u64::MAX, 1).is_err());
    }
}
