//! What `fabriq perf` prints: per-size results (latency percentiles or bandwidth), the run's
//! header, the perftest-like text table and the `--json` document; and the progress bar shown
//! on long runs.

use std::fmt::Write as _;
use std::io::IsTerminal;

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::size::human;

/// How latency figures are derived from the measured round trips.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LatencyKind {
    /// Ping-pong: half the round-trip time.
    OneWay,
    /// The request-to-completion round trip itself.
    RoundTrip,
    /// The time for `Endpoint::connect` to return a usable channel.
    Connect,
}

/// Latency of one message size, microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct LatStats {
    /// Message size, bytes.
    pub size: u32,
    /// Measured iterations.
    pub iters: u64,
    /// Unmeasured warm-up iterations.
    pub warmup: u64,
    /// Whether the figures are one-way (RTT/2) or round-trip.
    pub latency: LatencyKind,
    /// Minimum.
    pub min_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Maximum.
    pub max_us: f64,
    /// Mean.
    pub mean_us: f64,
    /// Standard deviation.
    pub stddev_us: f64,
    /// Failed data checks (client and server).
    pub errors: u64,
    /// What the row measured where it is not a message size (`connect_lat`: `cold`,
    /// `cached`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub case: Option<&'static str>,
}

impl LatStats {
    /// Summarise a histogram of round-trip nanoseconds.
    pub fn from_rtt(
        size: u32,
        warmup: u64,
        kind: LatencyKind,
        rtt_ns: &Histogram<u64>,
        errors: u64,
    ) -> Self {
        let div = match kind {
            LatencyKind::OneWay => 2000.0,
            LatencyKind::RoundTrip | LatencyKind::Connect => 1000.0,
        };
        let q = |x: f64| rtt_ns.value_at_quantile(x) as f64 / div;
        LatStats {
            size,
            iters: rtt_ns.len(),
            warmup,
            latency: kind,
            min_us: rtt_ns.min() as f64 / div,
            p50_us: q(0.5),
            p99_us: q(0.99),
            p999_us: q(0.999),
            max_us: rtt_ns.max() as f64 / div,
            mean_us: rtt_ns.mean() / div,
            stddev_us: rtt_ns.stdev() / div,
            errors,
            case: None,
        }
    }
}

/// Bandwidth of one message size.
#[derive(Debug, Clone, Serialize)]
pub struct BwStats {
    /// Message size, bytes.
    pub size: u32,
    /// Measured messages.
    pub iters: u64,
    /// Unmeasured warm-up messages.
    pub warmup: u64,
    /// Requests outstanding at most.
    pub tx_depth: u32,
    /// Seconds from the first measured post to the last completion.
    pub elapsed_s: f64,
    /// Payload bytes moved in the measured part.
    pub bytes: u64,
    /// Mebibytes per second.
    pub mib_s: f64,
    /// Gigabits per second (10^9).
    pub gbit_s: f64,
    /// Million messages per second.
    pub mmsg_s: f64,
    /// Messages the server counted (send_bw), all runs included.
    pub server_messages: Option<u64>,
    /// Concurrent callers (`rpc_rate` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub callers: Option<u32>,
    /// Completed calls per second (`rpc_rate` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calls_per_s: Option<f64>,
    /// Failed data checks.
    pub errors: u64,
}

impl BwStats {
    /// Derive rates from a count, size and elapsed time.
    pub fn new(size: u32, iters: u64, warmup: u64, tx_depth: u32, elapsed_s: f64) -> Self {
        let bytes = iters * u64::from(size);
        let secs = elapsed_s.max(1e-9);
        BwStats {
            size,
            iters,
            warmup,
            tx_depth,
            elapsed_s,
            bytes,
            mib_s: bytes as f64 / secs / (1024.0 * 1024.0),
            gbit_s: bytes as f64 * 8.0 / secs / 1e9,
            mmsg_s: iters as f64 / secs / 1e6,
            server_messages: None,
            callers: None,
            calls_per_s: None,
            errors: 0,
        }
    }
}

/// One row of the results.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum RunResult {
    /// A latency test.
    Latency(LatStats),
    /// A bandwidth test.
    Bandwidth(BwStats),
}

impl RunResult {
    /// Failed data checks of this row.
    pub fn errors(&self) -> u64 {
        match self {
            RunResult::Latency(l) => l.errors,
            RunResult::Bandwidth(b) => b.errors,
        }
    }
}

/// The whole run, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct PerfReport {
    /// Always `fabriq perf`.
    pub tool: &'static str,
    /// Layer measured: `verbs`, `channel` (fabriq::Channel) or `rpc` (fabriq::Rpc).
    pub layer: &'static str,
    /// Test name.
    pub test: String,
    /// Device.
    pub device: String,
    /// Provider options the device was opened with.
    pub device_options: std::collections::BTreeMap<String, String>,
    /// Its provider (`tcp-socket` for the TCP baseline).
    pub provider: String,
    /// `busy` or `event`; for the middleware layers the progress mode, `caller` or `thread`.
    pub mode: String,
    /// Middleware layers: the client's API, `sync` (blocking calls) or `async` (tokio).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api: Option<&'static str>,
    /// The server's control address.
    pub server: String,
    /// Whether the server was started as a local child.
    pub local: bool,
    /// CPU the client ran on, if pinned.
    pub client_cpu: Option<usize>,
    /// CPU the server ran on, if pinned.
    pub server_cpu: Option<usize>,
    /// The client's process had one CPU (`taskset -c N`, a cpuset of one), shared by the
    /// client, a `--local` server and the providers' threads: its busy waits (and the
    /// middleware's) stepped aside at every idle round.
    pub one_cpu: bool,
    /// Latency tests: what the latency figures mean.
    pub latency: Option<LatencyKind>,
    /// One entry per size.
    pub results: Vec<RunResult>,
    /// Sum of failed data checks over all sizes.
    pub errors: u64,
}

/// The perftest-like text table.
pub fn render_text(r: &PerfReport) -> String {
    let mut out = String::new();
    let rule = "-".repeat(96);
    let _ = writeln!(out, "{rule}");
    let _ = writeln!(
        out,
        " fabriq perf: {}  layer {}  device {} ({})  mode {}{}  server {}{}",
        r.test,
        r.layer,
        r.device,
        r.provider,
        r.mode,
        r.api.map(|a| format!("  api {a}")).unwrap_or_default(),
        r.server,
        if r.local { " (local child)" } else { "" }
    );
    let cpu = |c: Option<usize>| c.map(|c| c.to_string()).unwrap_or_else(|| "-".into());
    let _ = writeln!(
        out,
        " client cpu {}  server cpu {}{}",
        cpu(r.client_cpu),
        cpu(r.server_cpu),
        if r.one_cpu {
            "  (one CPU for the whole process: waits yield at every idle round)"
        } else {
            ""
        }
    );
    if let Some(kind) = r.latency {
        let what = match kind {
            LatencyKind::OneWay => "one-way latency (RTT/2), microseconds",
            LatencyKind::RoundTrip => "round-trip latency, microseconds",
            LatencyKind::Connect => {
                "time for Endpoint::connect to return a usable channel, microseconds"
            }
        };
        let _ = writeln!(out, " {what}");
    }
    let _ = writeln!(out, "{rule}");
    let lat_header = format!(
        " {:>10} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>6}",
        "#bytes", "#iters", "min", "p50", "p99", "p99.9", "max", "avg", "errors"
    );
    let bw_header = format!(
        " {:>10} {:>9} {:>7} {:>12} {:>10} {:>12} {:>6}",
        "#bytes", "#iters", "depth", "BW[MiB/s]", "BW[Gb/s]", "MsgRate[M/s]", "errors"
    );
    let mut header_done = false;
    for row in &r.results {
        match row {
            RunResult::Latency(l) => {
                if !header_done {
                    let _ = writeln!(out, "{lat_header}");
                    header_done = true;
                }
                let _ = writeln!(
                    out,
                    " {:>10} {:>9} {:>9.3} {:>9.3} {:>9.3} {:>10.3} {:>9.3} {:>9.3} {:>6}",
                    l.case
                        .map_or_else(|| human(u64::from(l.size)), str::to_string),
                    l.iters,
                    l.min_us,
                    l.p50_us,
                    l.p99_us,
                    l.p999_us,
                    l.max_us,
                    l.mean_us,
                    l.errors
                );
            }
            RunResult::Bandwidth(b) => {
                if !header_done {
                    let _ = writeln!(out, "{bw_header}");
                    header_done = true;
                }
                let _ = writeln!(
                    out,
                    " {:>10} {:>9} {:>7} {:>12.1} {:>10.3} {:>12.4} {:>6}",
                    human(u64::from(b.size)),
                    b.iters,
                    b.callers.unwrap_or(b.tx_depth),
                    b.mib_s,
                    b.gbit_s,
                    b.mmsg_s,
                    b.errors
                );
            }
        }
    }
    if let Some(ratio) = cold_to_cached(r) {
        let _ = writeln!(
            out,
            " cached connects {ratio:.2}x faster than cold ones (p50 over p50, one run, in turn)"
        );
    }
    if let Some((floor, cached)) = p50_of(r, "floor").zip(p50_of(r, "cached")) {
        let _ = writeln!(
            out,
            " wake floor {floor:.3} us: a byte's round trip to a server thread asleep on its CPU \
             (a cached connect's wake-ups, none of its work); cached connects {:.3} us above it",
            cached - floor
        );
    }
    let _ = writeln!(out, "{rule}");
    out
}

/// `connect_lat`: the p50 of the row of `case`.
fn p50_of(r: &PerfReport, case: &str) -> Option<f64> {
    r.results.iter().find_map(|row| match row {
        RunResult::Latency(l) if l.case == Some(case) => Some(l.p50_us),
        _ => None,
    })
}

/// `connect_lat`: the cold connect's p50 over the cached one's.
fn cold_to_cached(r: &PerfReport) -> Option<f64> {
    let (cold, cached) = (p50_of(r, "cold")?, p50_of(r, "cached")?);
    (cached > 0.0).then(|| cold / cached)
}

/// A progress bar on stderr for long runs; a no-op when off. Updates are cheap (one branch) and
/// only every 4096 iterations touch the bar.
pub struct Progress {
    bar: Option<ProgressBar>,
    base: std::cell::Cell<u64>,
}

impl Progress {
    /// Off.
    pub fn off() -> Self {
        Progress {
            bar: None,
            base: std::cell::Cell::new(0),
        }
    }

    /// A bar of `total` iterations when `wanted` and stderr is a terminal.
    pub fn new(wanted: bool, total: u64) -> Self {
        if !wanted || !std::io::stderr().is_terminal() {
            return Self::off();
        }
        let bar = ProgressBar::new(total);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} iterations ({eta} left) {msg}",
        ) {
            bar.set_style(style);
        }
        Progress {
            bar: Some(bar),
            base: std::cell::Cell::new(0),
        }
    }

    /// Start the next run (its iterations count from 0 again); `label` is shown beside the bar.
    pub fn next_run(&self, done_before: u64, label: &str) {
        if let Some(bar) = &self.bar {
            self.base.set(done_before);
            bar.set_position(done_before);
            bar.set_message(label.to_string());
        }
    }

    /// Iteration `i` of the current run is done.
    #[inline]
    pub fn at(&self, i: u64) {
        if let Some(bar) = &self.bar {
            if i % 4096 == 0 {
                bar.set_position(self.base.get() + i);
            }
        }
    }

    /// Remove the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_way_halves_the_round_trip() {
        let mut h = Histogram::<u64>::new_with_bounds(1, 1_000_000_000, 3).expect("histogram");
        for ns in [1000u64, 2000, 3000, 4000] {
            h.record(ns).expect("record");
        }
        let ow = LatStats::from_rtt(8, 0, LatencyKind::OneWay, &h, 0);
        let rt = LatStats::from_rtt(8, 0, LatencyKind::RoundTrip, &h, 0);
        assert_eq!(ow.iters, 4);
        assert!((ow.min_us - 0.5).abs() < 1e-3);
        assert!((rt.min_us - 1.0).abs() < 1e-3);
        assert!((rt.max_us - 4.0).abs() < 0.01);
        assert!(ow.p50_us > 0.0 && ow.p50_us <= ow.p99_us && ow.p99_us <= ow.max_us);
    }

    #[test]
    fn bandwidth_units() {
        let b = BwStats::new(1 << 20, 1024, 0, 16, 1.0);
        assert!((b.mib_s - 1024.0).abs() < 1e-6);
        assert!((b.gbit_s - 8.589934592).abs() < 1e-6);
        assert!((b.mmsg_s - 0.001024).abs() < 1e-9);
    }

    #[test]
    fn text_table_has_header_and_rows() {
        let mut h = Histogram::<u64>::new(3).expect("histogram");
        h.record(1000).expect("record");
        let r = PerfReport {
            tool: "fabriq perf",
            layer: "verbs",
            test: "send_lat".into(),
            device: "shm0".into(),
            device_options: Default::default(),
            provider: "shm".into(),
            mode: "busy".into(),
            api: None,
            server: "127.0.0.1:1".into(),
            local: true,
            client_cpu: Some(0),
            server_cpu: Some(1),
            one_cpu: false,
            latency: Some(LatencyKind::OneWay),
            results: vec![RunResult::Latency(LatStats::from_rtt(
                8,
                0,
                LatencyKind::OneWay,
                &h,
                0,
            ))],
            errors: 0,
        };
        let t = render_text(&r);
        assert!(t.contains("one-way latency"));
        assert!(t.contains("p99.9"));
        assert!(t.contains("8 B"));
        let v = serde_json::to_value(&r).expect("json");
        assert_eq!(v["results"][0]["size"], 8);
        assert_eq!(v["latency"], "one_way");
    }
}
