//! Scenario files: the TOML description of one experiment and its variants.
//!
//! Owns parsing, defaults and validation of scenarios, and the expansion of `[[variants]]`
//! (each variant is a partial scenario deep-merged over the base: tables merge key by key,
//! other values replace). It builds nothing: `sim` turns a validated [`Scenario`] into a
//! network. Bad files give a typed [`ScenarioError`], never a panic.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Errors from reading a scenario.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("cannot read scenario {path}: {source}")]
    Io {
        /// Path given.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed or does not match the schema.
    #[error("invalid scenario: {0}")]
    Parse(#[from] toml::de::Error),
    /// A value is out of range or inconsistent.
    #[error("invalid scenario `{variant}`: {reason}")]
    Invalid {
        /// Variant name.
        variant: String,
        /// What is wrong.
        reason: String,
    },
}

/// One fully specified simulation run.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Run name: the variant's name, or the scenario's for a file without variants.
    #[serde(default)]
    pub name: String,
    /// Name of the scenario (file) the run belongs to; set when the file is expanded.
    #[serde(skip)]
    pub scenario: String,
    /// What the scenario shows.
    #[serde(default)]
    pub description: String,
    /// Seed of every random choice of the run.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Simulated time to run, in milliseconds.
    pub duration_ms: f64,
    /// Goodput is measured from this time on (milliseconds), to skip slow start.
    #[serde(default)]
    pub warmup_ms: f64,
    /// Period of the timeline samples (utilisation, cwnd), in microseconds.
    #[serde(default = "default_sample_interval")]
    pub sample_interval_us: f64,
    /// Link-layer bytes added to every datagram on the wire (Ethernet header, FCS, IP,
    /// UDP, preamble and inter-frame gap).
    #[serde(default = "default_overhead")]
    pub frame_overhead_bytes: u32,
    /// Network.
    pub topology: TopologyConfig,
    /// Switch queue behaviour.
    #[serde(default)]
    pub switch: SwitchConfig,
    /// Transport on every connection.
    #[serde(default)]
    pub transport: TransportConfig,
    /// Offered traffic.
    pub traffic: TrafficConfig,
    /// Link faults.
    #[serde(default)]
    pub faults: Vec<FaultConfig>,
    /// What to record.
    #[serde(default)]
    pub output: OutputConfig,
    /// Variant label used as the series name in summary plots.
    #[serde(default)]
    pub series: String,
    /// Variant's x value in summary plots.
    #[serde(default)]
    pub x: f64,
}

fn default_seed() -> u64 {
    1
}
fn default_sample_interval() -> f64 {
    100.0
}
fn default_overhead() -> u32 {
    // 14 Ethernet + 4 FCS + 20 IPv4 + 8 UDP + 20 preamble/IFG.
    66
}

/// A two-tier leaf-spine fabric; N parallel paths between two hosts is `leaves = 2,
/// hosts_per_leaf = 1, spines = N`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologyConfig {
    /// Spine switches (= parallel paths between two leaves).
    pub spines: u32,
    /// Leaf switches.
    pub leaves: u32,
    /// Hosts per leaf.
    pub hosts_per_leaf: u32,
    /// Host link rate, Gb/s.
    pub host_link_gbps: f64,
    /// Fabric (leaf–spine) link rate, Gb/s.
    pub fabric_link_gbps: f64,
    /// Propagation delay per link, nanoseconds.
    pub link_delay_ns: u64,
    /// Switch port queue capacity, KiB.
    #[serde(default = "default_switch_buffer")]
    pub switch_buffer_kb: u64,
}

fn default_switch_buffer() -> u64 {
    // About 1 MiB per port: a 12 MB shared buffer over 12 busy ports.
    1024
}

/// Switch queue management.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchConfig {
    /// RED/ECN marking; absent = no marking.
    pub ecn: Option<EcnConfig>,
    /// Priority flow control; absent = lossless mode off (tail drop).
    pub pfc: Option<PfcConfig>,
}

/// RED/ECN thresholds on the instantaneous queue.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EcnConfig {
    /// Kmin, KiB.
    pub kmin_kb: f64,
    /// Kmax, KiB.
    pub kmax_kb: f64,
    /// Pmax.
    pub pmax: f64,
}

/// PFC thresholds per ingress port.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PfcConfig {
    /// PAUSE above this many KiB held from one ingress link.
    pub xoff_kb: f64,
    /// RESUME at or below this many KiB.
    pub xon_kb: f64,
}

/// Which transport runs on the connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// `fabriq_mpath::Connection`.
    #[default]
    Mpath,
    /// The fixed-window test transport.
    FixedWindow,
}

/// MP-RDMA or the single-path baseline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PathMode {
    /// Multi-path (MP-RDMA).
    #[default]
    MultiPath,
    /// Single path (RoCE-like baseline).
    SinglePath,
}

/// Transport parameters; unset ones keep the transport's defaults.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransportConfig {
    /// Which implementation.
    #[serde(default)]
    pub kind: TransportKind,
    /// Multi-path or single-path.
    #[serde(default)]
    pub mode: PathMode,
    /// Virtual paths per connection.
    pub num_paths: Option<u16>,
    /// Payload bytes per packet.
    pub mss: Option<u16>,
    /// Initial window, packets.
    pub initial_window: Option<u32>,
    /// Δ, packets (MP-RDMA out-of-order tolerance).
    pub delta: Option<u32>,
    /// Receiver bitmap length L, packets.
    pub bitmap_len: Option<u32>,
    /// Path probing probability.
    pub probe_probability: Option<f64>,
    /// Packets one ACK may release.
    pub burst_per_ack: Option<u32>,
    /// Minimum retransmission timeout, microseconds.
    pub min_rto_us: Option<u64>,
    /// Largest congestion window, packets.
    pub max_window: Option<f64>,
    /// Window of the fixed-window transport, packets.
    pub window: Option<u32>,
    /// Single-path DCQCN line rate, Gb/s (defaults to the host link rate).
    pub line_rate_gbps: Option<f64>,
}

/// Offered traffic.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TrafficConfig {
    /// Backlogged connections between given host pairs.
    LongFlows {
        /// `[src, dst]` host numbers.
        pairs: Vec<[u32; 2]>,
        /// Bytes per message the application keeps queued.
        #[serde(default = "default_message_bytes")]
        message_bytes: u64,
        /// Messages kept outstanding per connection.
        #[serde(default = "default_backlog")]
        backlog: u32,
    },
    /// Every host sends one backlogged flow to a distinct random host (a derangement).
    Permutation {
        /// Bytes per message.
        #[serde(default = "default_message_bytes")]
        message_bytes: u64,
        /// Messages outstanding per connection.
        #[serde(default = "default_backlog")]
        backlog: u32,
    },
    /// `senders` hosts send to one receiver at the same time.
    Incast {
        /// Receiving host.
        receiver: u32,
        /// Number of senders (hosts `receiver+1 ..`, wrapping).
        senders: u32,
        /// Bytes each sender sends; absent = backlogged.
        flow_bytes: Option<u64>,
        /// Bytes per message when backlogged.
        #[serde(default = "default_message_bytes")]
        message_bytes: u64,
        /// Messages outstanding when backlogged.
        #[serde(default = "default_backlog")]
        backlog: u32,
    },
    /// Persistent connections between random host pairs, each carrying flows (messages)
    /// that arrive as a Poisson process with sizes drawn from a CDF.
    Workload {
        /// Number of connections.
        connections: u32,
        /// Offered load per connection as a fraction of the host link rate.
        load: f64,
        /// Size distribution: `"web_search"` or `"data_mining"`.
        #[serde(default = "default_cdf")]
        cdf: String,
        /// Stop starting new flows after this time (ms); defaults to the duration.
        stop_ms: Option<f64>,
    },
}

fn default_message_bytes() -> u64 {
    64 * 1024
}
fn default_backlog() -> u32 {
    8
}
fn default_cdf() -> String {
    "web_search".into()
}

/// A fault on the links whose names match `link` (`*` matches any run of characters).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultConfig {
    /// Link name pattern, e.g. `"leaf0->spine0"` or `"*spine1*"`.
    pub link: String,
    /// Random loss probability from `loss_from_ms` on.
    pub loss: Option<f64>,
    /// When the loss starts (ms, default 0).
    #[serde(default)]
    pub loss_from_ms: f64,
    /// When the link fails (ms).
    pub down_at_ms: Option<f64>,
    /// When it recovers (ms).
    pub up_at_ms: Option<f64>,
    /// A degraded link: its rate for the whole run, Gb/s.
    pub rate_gbps: Option<f64>,
    /// A degraded link: propagation delay added for the whole run, nanoseconds.
    pub extra_delay_ns: Option<u64>,
}

/// What to record.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    /// Links whose throughput is sampled over time (patterns as in faults).
    #[serde(default)]
    pub watch_links: Vec<String>,
    /// The first this-many connections get cwnd and goodput traces.
    #[serde(default)]
    pub trace_conns: u32,
    /// Metric on the y axis of the summary plot across variants (a field of the run
    /// summary, e.g. `"mean_goodput_gbps"`).
    pub summary_metric: Option<String>,
    /// X axis label of the summary plot.
    pub summary_x_label: Option<String>,
}

/// A scenario file: a base scenario and its variants.
#[derive(Clone, Debug)]
pub struct ScenarioFile {
    /// One fully merged scenario per variant (or just the base when there are none).
    pub runs: Vec<Scenario>,
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let mut rest = name;
    for (i, part) in parts.iter().enumerate() {
        if i == 0 {
            match rest.strip_prefix(part) {
                Some(r) => rest = r,
                None => return false,
            }
        } else if i == parts.len() - 1 {
            return rest.ends_with(part);
        } else {
            match rest.find(part) {
                Some(pos) => rest = &rest[pos + part.len()..],
                None => return false,
            }
        }
    }
    true
}

fn merge(base: &mut toml::Value, over: toml::Value) {
    match (base, over) {
        (toml::Value::Table(b), toml::Value::Table(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (slot, v) => *slot = v,
    }
}

impl ScenarioFile {
    /// Reads and expands a scenario file.
    pub fn load(path: &std::path::Path) -> Result<ScenarioFile, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Self::parse(&text, &stem)
    }

    /// Parses and expands scenario text; `default_name` names a scenario without `name`.
    pub fn parse(text: &str, default_name: &str) -> Result<ScenarioFile, ScenarioError> {
        let mut base: toml::Value = toml::from_str(text)?;
        let variants = match base.as_table_mut().and_then(|t| t.remove("variants")) {
            Some(toml::Value::Array(v)) => v,
            Some(_) => {
                return Err(ScenarioError::Invalid {
                    variant: default_name.into(),
                    reason: "`variants` must be an array of tables".into(),
                })
            }
            None => Vec::new(),
        };
        if let Some(t) = base.as_table_mut() {
            t.entry("name")
                .or_insert_with(|| toml::Value::String(default_name.into()));
        }
        let base_name = base
            .get("name")
            .and_then(|n| n.as_str())
            .unwrap_or(default_name)
            .to_string();
        let mut runs = Vec::new();
        if variants.is_empty() {
            let mut s: Scenario = base.clone().try_into()?;
            s.scenario = base_name.clone();
            s.validate()?;
            runs.push(s);
        }
        for (i, v) in variants.into_iter().enumerate() {
            if !v.is_table() {
                return Err(ScenarioError::Invalid {
                    variant: format!("variant {i}"),
                    reason: "each variant must be a table".into(),
                });
            }
            let mut merged = base.clone();
            merge(&mut merged, v);
            let mut s: Scenario = merged.try_into()?;
            s.scenario = base_name.clone();
            s.validate()?;
            runs.push(s);
        }
        let mut names = std::collections::HashSet::new();
        for r in &runs {
            if !names.insert(r.name.clone()) {
                return Err(ScenarioError::Invalid {
                    variant: r.name.clone(),
                    reason: "variant names must be unique".into(),
                });
            }
        }
        Ok(ScenarioFile { runs })
    }
}

impl Scenario {
    /// Parses a single scenario (variants are not allowed here).
    pub fn from_toml(text: &str) -> Result<Scenario, ScenarioError> {
        let mut f = ScenarioFile::parse(text, "scenario")?;
        if f.runs.len() != 1 {
            return Err(ScenarioError::Invalid {
                variant: "scenario".into(),
                reason: "expected exactly one run".into(),
            });
        }
        Ok(f.runs.remove(0))
    }

    /// Checks ranges and cross-field consistency.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        let bad = |reason: String| {
            Err(ScenarioError::Invalid {
                variant: self.name.clone(),
                reason,
            })
        };
        let t = &self.topology;
        if !(self.duration_ms.is_finite() && self.duration_ms > 0.0 && self.duration_ms <= 60_000.0)
        {
            return bad("duration_ms must be in (0, 60000]".into());
        }
        if !(self.warmup_ms.is_finite()
            && self.warmup_ms >= 0.0
            && self.warmup_ms < self.duration_ms)
        {
            return bad("warmup_ms must be in [0, duration_ms)".into());
        }
        if !(self.sample_interval_us.is_finite() && self.sample_interval_us >= 1.0) {
            return bad("sample_interval_us must be at least 1".into());
        }
        if t.spines == 0 || t.leaves == 0 || t.hosts_per_leaf == 0 {
            return bad("spines, leaves and hosts_per_leaf must be positive".into());
        }
        let hosts = u64::from(t.leaves) * u64::from(t.hosts_per_leaf);
        // The forwarding tables hold one entry per (node, host) pair.
        if !(2..=2_048).contains(&hosts) || t.spines > 256 {
            return bad("between 2 and 2048 hosts and at most 256 spines".into());
        }
        let gbps_ok = |g: f64| g.is_finite() && g > 0.0 && g <= 10_000.0;
        if !gbps_ok(t.host_link_gbps) || !gbps_ok(t.fabric_link_gbps) {
            return bad("link rates must be in (0, 10000] Gb/s".into());
        }
        if t.switch_buffer_kb == 0 {
            return bad("switch_buffer_kb must be positive".into());
        }
        if let Some(e) = &self.switch.ecn {
            if !(e.kmin_kb >= 0.0 && e.kmax_kb > e.kmin_kb && (0.0..=1.0).contains(&e.pmax)) {
                return bad("ecn needs 0 <= kmin_kb < kmax_kb and 0 <= pmax <= 1".into());
            }
        }
        if let Some(p) = &self.switch.pfc {
            if !(p.xon_kb >= 0.0 && p.xoff_kb > p.xon_kb) {
                return bad("pfc needs 0 <= xon_kb < xoff_kb".into());
            }
        }
        let check_host = |h: u32| u64::from(h) < hosts;
        match &self.traffic {
            TrafficConfig::LongFlows {
                pairs,
                message_bytes,
                backlog,
            } => {
                if pairs.is_empty() {
                    return bad("long_flows needs at least one pair".into());
                }
                if pairs
                    .iter()
                    .any(|[a, b]| !check_host(*a) || !check_host(*b) || a == b)
                {
                    return bad("pairs must name two distinct existing hosts".into());
                }
                if *message_bytes == 0 || *backlog == 0 {
                    return bad("message_bytes and backlog must be positive".into());
                }
            }
            TrafficConfig::Permutation {
                message_bytes,
                backlog,
            } => {
                if *message_bytes == 0 || *backlog == 0 {
                    return bad("message_bytes and backlog must be positive".into());
                }
            }
            TrafficConfig::Incast {
                receiver,
                senders,
                flow_bytes,
                message_bytes,
                backlog,
            } => {
                if !check_host(*receiver) || *senders == 0 || u64::from(*senders) >= hosts {
                    return bad("incast needs an existing receiver and 1..hosts senders".into());
                }
                if flow_bytes == &Some(0) || *message_bytes == 0 || *backlog == 0 {
                    return bad("flow_bytes, message_bytes and backlog must be positive".into());
                }
            }
            TrafficConfig::Workload {
                connections,
                load,
                cdf,
                stop_ms,
            } => {
                if *connections == 0 || *connections > 100_000 {
                    return bad("connections must be in 1..=100000".into());
                }
                if !(load.is_finite() && *load > 0.0 && *load <= 1.0) {
                    return bad("load must be in (0, 1]".into());
                }
                if crate::workload::Cdf::by_name(cdf).is_none() {
                    return bad(format!("unknown cdf `{cdf}`"));
                }
                if let Some(s) = stop_ms {
                    if !(s.is_finite() && *s > 0.0) {
                        return bad("stop_ms must be positive".into());
                    }
                }
            }
        }
        for f in &self.faults {
            if let Some(l) = f.loss {
                if !(0.0..=1.0).contains(&l) {
                    return bad(format!("loss on `{}` must be in [0, 1]", f.link));
                }
            }
            if let Some(r) = f.rate_gbps {
                if !(r.is_finite() && r > 0.0 && r <= 10_000.0) {
                    return bad(format!("rate_gbps on `{}` must be in (0, 10000]", f.link));
                }
            }
            if f.extra_delay_ns.is_some_and(|d| d > 1_000_000_000) {
                return bad(format!(
                    "extra_delay_ns on `{}` must be at most 1 s",
                    f.link
                ));
            }
            let times = [Some(f.loss_from_ms), f.down_at_ms, f.up_at_ms];
            if times
                .iter()
                .flatten()
                .any(|t| !(t.is_finite() && *t >= 0.0))
            {
                return bad(format!("fault times on `{}` must be >= 0", f.link));
            }
        }
        if let Some(w) = self.transport.window {
            if w == 0 {
                return bad("transport.window must be positive".into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
        duration_ms = 2.0
        [topology]
        spines = 4
        leaves = 2
        hosts_per_leaf = 1
        host_link_gbps = 40
        fabric_link_gbps = 40
        link_delay_ns = 1000
        [traffic]
        kind = "long_flows"
        pairs = [[0, 1]]
    "#;

    #[test]
    fn parses_a_minimal_scenario_with_defaults() {
        let s = Scenario::from_toml(BASE).unwrap();
        assert_eq!(s.seed, 1);
        assert_eq!(s.frame_overhead_bytes, 66);
        assert_eq!(s.transport.mode, PathMode::MultiPath);
        assert!(matches!(
            s.traffic,
            TrafficConfig::LongFlows { backlog: 8, .. }
        ));
    }

    #[test]
    fn variants_merge_over_the_base() {
        let text = format!(
            "{BASE}\n[[variants]]\nname = \"mp\"\n[[variants]]\nname = \"sp\"\nx = 1.0\ntransport = {{ mode = \"single_path\" }}\nfaults = [{{ link = \"leaf0->spine0\", loss = 0.01 }}]\n"
        );
        let f = ScenarioFile::parse(&text, "t").unwrap();
        assert_eq!(f.runs.len(), 2);
        assert_eq!(f.runs[0].transport.mode, PathMode::MultiPath);
        assert!(f.runs[0].faults.is_empty());
        assert_eq!(f.runs[1].transport.mode, PathMode::SinglePath);
        assert_eq!(f.runs[1].faults[0].loss, Some(0.01));
        assert_eq!(f.runs[1].topology.spines, 4, "base kept");
    }

    #[test]
    fn bad_values_are_typed_errors() {
        let bad = BASE.replace("pairs = [[0, 1]]", "pairs = [[0, 7]]");
        assert!(matches!(
            Scenario::from_toml(&bad),
            Err(ScenarioError::Invalid { .. })
        ));
        let bad = BASE.replace("duration_ms = 2.0", "duration_ms = -1.0");
        assert!(Scenario::from_toml(&bad).is_err());
        assert!(matches!(
            Scenario::from_toml("nonsense = "),
            Err(ScenarioError::Parse(_))
        ));
        let bad = format!("{BASE}\nunknown_key = 3\n");
        assert!(Scenario::from_toml(&bad).is_err());
        let dup = format!("{BASE}\n[[variants]]\nname = \"a\"\n[[variants]]\nname = \"a\"\n");
        assert!(ScenarioFile::parse(&dup, "t").is_err());
    }

    #[test]
    fn glob_patterns() {
        assert!(glob_match("leaf0->spine0", "leaf0->spine0"));
        assert!(!glob_match("leaf0->spine0", "leaf0->spine01"));
        assert!(glob_match("leaf0->spine*", "leaf0->spine3"));
        assert!(glob_match("*spine1*", "spine1->leaf0"));
        assert!(glob_match("*spine1*", "leaf1->spine1"));
        assert!(!glob_match("*spine1*", "leaf1->spine2"));
        assert!(glob_match("*", "anything"));
    }
}
