//! Results of a run: per-connection goodput, link utilisation, flow completion times,
//! out-of-order gaps and timelines, and their CSV/JSON output.
//!
//! Owns the result types (serialisable), the derived statistics (percentiles, Jain's
//! fairness index, FCT by size bucket) and writing them to an output directory. Plots are in
//! `plot`.

use std::fmt::Write as _;
use std::io;
use std::path::Path;

use serde::Serialize;

use crate::link::LinkCounters;
use crate::scenario::Scenario;

/// One completed flow (message) of a workload or a sized incast.
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct FctRecord {
    /// Connection that carried it.
    pub conn: u32,
    /// Bytes.
    pub size: u64,
    /// When the application handed it to the transport.
    pub start_ns: u64,
    /// From hand-over to delivery of the last byte at the receiver.
    pub fct_ns: u64,
}

/// Sampled traces.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Timeline {
    /// Sample times.
    pub time_ms: Vec<f64>,
    /// Names of the watched links.
    pub link_names: Vec<String>,
    /// Throughput of each watched link over each sample interval.
    pub link_gbps: Vec<Vec<f64>>,
    /// Congestion window (packets) of each traced connection's sender.
    pub conn_cwnd: Vec<Vec<f64>>,
    /// Goodput of each traced connection over each sample interval.
    pub conn_goodput_gbps: Vec<Vec<f64>>,
}

/// One connection's outcome.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ConnResult {
    /// Connection number.
    pub conn: u32,
    /// Sending host.
    pub src: u32,
    /// Receiving host.
    pub dst: u32,
    /// Distinct payload bytes the receiver accepted during the measurement window, as a
    /// rate (packet granularity; duplicates and retransmissions not counted).
    pub goodput_gbps: f64,
    /// Complete messages delivered during the measurement window, as a rate.
    pub message_goodput_gbps: f64,
    /// Application bytes delivered over the whole run.
    pub delivered_bytes: u64,
    /// Messages delivered.
    pub messages_delivered: u64,
    /// Packets the sender retransmitted.
    pub retransmits: u64,
    /// Sender's final congestion window (packets).
    pub final_cwnd: f64,
    /// Largest out-of-order gap at the receiver (packets).
    pub max_ooo_gap: u64,
    /// Whether the connection failed.
    pub is_failed: bool,
}

/// One link's outcome.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LinkResult {
    /// Name.
    pub name: String,
    /// Capacity.
    pub gbps: f64,
    /// Share of capacity used during the measurement window.
    pub utilisation: f64,
    /// Counters over the whole run.
    pub counters: LinkCounters,
}

/// FCT statistics of flows within a size range.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct FctBucket {
    /// Label, e.g. "10K-100K".
    pub label: String,
    /// Smallest size (inclusive).
    pub min_bytes: u64,
    /// Largest size (exclusive).
    pub max_bytes: u64,
    /// Flows completed.
    pub count: usize,
    /// Mean FCT.
    pub mean_us: f64,
    /// Median FCT.
    pub p50_us: f64,
    /// 99th percentile FCT.
    pub p99_us: f64,
}

/// Headline numbers of a run.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Summary {
    /// Connections.
    pub connections: usize,
    /// Mean per-connection goodput.
    pub mean_goodput_gbps: f64,
    /// Sum of goodputs.
    pub total_goodput_gbps: f64,
    /// Smallest per-connection goodput.
    pub min_goodput_gbps: f64,
    /// Largest per-connection goodput.
    pub max_goodput_gbps: f64,
    /// Jain's fairness index of the goodputs (1 = perfectly fair).
    pub jain_index: f64,
    /// Mean utilisation of leaf→spine links in the measurement window.
    pub fabric_utilisation: f64,
    /// Packets retransmitted by all senders.
    pub retransmits: u64,
    /// Packets dropped by queues overflowing.
    pub drops_overflow: u64,
    /// Packets dropped by random loss.
    pub drops_loss: u64,
    /// Packets dropped by failed links.
    pub drops_down: u64,
    /// Packets marked CE.
    pub ecn_marks: u64,
    /// PAUSE frames.
    pub pfc_pauses: u64,
    /// Flows completed (workload and sized incast).
    pub flows_completed: usize,
    /// Mean FCT.
    pub fct_mean_us: f64,
    /// Median FCT.
    pub fct_p50_us: f64,
    /// 99th percentile FCT.
    pub fct_p99_us: f64,
    /// Mean over completed flows of size / FCT.
    pub flow_throughput_mean_gbps: f64,
    /// 99th percentile out-of-order gap (packets).
    pub ooo_gap_p99: f64,
    /// 99.9th percentile of the out-of-order gap (packets) over all received data packets.
    pub ooo_gap_p999: f64,
    /// Largest out-of-order gap.
    pub ooo_gap_max: u64,
    /// Failed connections.
    pub failed_connections: usize,
    /// Events processed.
    pub events: u64,
    /// Wall-clock seconds the run took.
    pub wall_secs: f64,
    /// Events per wall-clock second.
    pub events_per_sec: f64,
    /// CPU seconds the run took (0 where not measurable).
    pub cpu_secs: f64,
    /// Events per CPU second (the simulator's speed on one core, whatever else the machine
    /// was doing).
    pub events_per_cpu_sec: f64,
    /// Datagrams a transport rejected as malformed (should be 0).
    pub malformed_datagrams: u64,
    /// Deliveries that did not match the message sent (should be 0).
    pub mismatched_deliveries: u64,
    /// Most packets alive at once (packet pool size).
    pub packet_pool_high_water: u64,
}

/// Everything a run produced.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RunResult {
    /// Scenario (file) name.
    pub scenario: String,
    /// Variant name.
    pub name: String,
    /// Series label for summary plots.
    pub series: String,
    /// X value for summary plots.
    pub x: f64,
    /// Seed.
    pub seed: u64,
    /// Simulated duration.
    pub duration_ms: f64,
    /// Headline numbers.
    pub summary: Summary,
    /// Per connection.
    pub conns: Vec<ConnResult>,
    /// Per link.
    pub links: Vec<LinkResult>,
    /// FCT by size.
    pub fct_buckets: Vec<FctBucket>,
    /// Every completed flow.
    pub fcts: Vec<FctRecord>,
    /// Traces.
    pub timeline: Timeline,
    /// `ooo_histogram[g]` = received data packets that arrived `g` ahead of the next expected.
    pub ooo_histogram: Vec<u64>,
}

/// Inputs of [`assemble`].
pub struct RunParts<'a> {
    /// The scenario file's name.
    pub scenario_file: &'a str,
    /// The scenario run.
    pub scenario: &'a Scenario,
    /// Per connection.
    pub conns: Vec<ConnResult>,
    /// Per link.
    pub links: Vec<LinkResult>,
    /// Completed flows.
    pub fcts: Vec<FctRecord>,
    /// Traces.
    pub timeline: Timeline,
    /// OOO histogram.
    pub ooo_histogram: Vec<u64>,
    /// Events processed.
    pub events: u64,
    /// Wall-clock seconds.
    pub wall_secs: f64,
    /// CPU seconds.
    pub cpu_secs: f64,
    /// Malformed datagrams.
    pub malformed_datagrams: u64,
    /// Mismatched deliveries.
    pub mismatched_deliveries: u64,
    /// Packet pool high-water mark.
    pub packet_pool_high_water: u64,
}

/// The `q` quantile (0..=1) of sorted values (nearest rank); 0 when empty.
pub fn percentile_sorted(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The `q` quantile of a histogram (`hist[v]` = count of value v).
pub fn percentile_histogram(hist: &[u64], q: f64) -> f64 {
    let total: u64 = hist.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let rank = ((q * total as f64).ceil() as u64).max(1);
    let mut seen = 0;
    for (v, &c) in hist.iter().enumerate() {
        seen += c;
        if seen >= rank {
            return v as f64;
        }
    }
    (hist.len() - 1) as f64
}

/// Jain's fairness index (Σx)²/(n·Σx²); 1 for an empty or all-zero set.
pub fn jain_index(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let sq: f64 = xs.iter().map(|x| x * x).sum();
    if xs.is_empty() || sq == 0.0 {
        1.0
    } else {
        sum * sum / (xs.len() as f64 * sq)
    }
}

const FCT_BUCKETS: [(u64, u64, &str); 5] = [
    (0, 10_000, "<10K"),
    (10_000, 100_000, "10K-100K"),
    (100_000, 1_000_000, "100K-1M"),
    (1_000_000, 10_000_000, "1M-10M"),
    (10_000_000, u64::MAX, ">=10M"),
];

fn fct_stats(fcts: &mut [f64]) -> (f64, f64, f64) {
    fcts.sort_by(f64::total_cmp);
    let mean = if fcts.is_empty() {
        0.0
    } else {
        fcts.iter().sum::<f64>() / fcts.len() as f64
    };
    (
        mean,
        percentile_sorted(fcts, 0.5),
        percentile_sorted(fcts, 0.99),
    )
}

/// Derives the summary and buckets from a run's raw results.
pub fn assemble(p: RunParts<'_>) -> RunResult {
    let goodputs: Vec<f64> = p.conns.iter().map(|c| c.goodput_gbps).collect();
    let total: f64 = goodputs.iter().sum();
    let fabric: Vec<&LinkResult> = p
        .links
        .iter()
        .filter(|l| l.name.starts_with("leaf") && l.name.contains("->spine"))
        .collect();
    let fabric_utilisation = if fabric.is_empty() {
        0.0
    } else {
        fabric.iter().map(|l| l.utilisation).sum::<f64>() / fabric.len() as f64
    };
    let sum_counter = |f: fn(&LinkCounters) -> u64| p.links.iter().map(|l| f(&l.counters)).sum();
    let mut all: Vec<f64> = p.fcts.iter().map(|f| f.fct_ns as f64 / 1e3).collect();
    let (fct_mean_us, fct_p50_us, fct_p99_us) = fct_stats(&mut all);
    let fct_buckets = FCT_BUCKETS
        .iter()
        .map(|&(lo, hi, label)| {
            let mut v: Vec<f64> = p
                .fcts
                .iter()
                .filter(|f| f.size >= lo && f.size < hi)
                .map(|f| f.fct_ns as f64 / 1e3)
                .collect();
            let (mean_us, p50_us, p99_us) = fct_stats(&mut v);
            FctBucket {
                label: label.to_string(),
                min_bytes: lo,
                max_bytes: hi,
                count: v.len(),
                mean_us,
                p50_us,
                p99_us,
            }
        })
        .collect();
    let summary = Summary {
        connections: p.conns.len(),
        mean_goodput_gbps: if goodputs.is_empty() {
            0.0
        } else {
            total / goodputs.len() as f64
        },
        total_goodput_gbps: total,
        min_goodput_gbps: goodputs
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min)
            .min(total),
        max_goodput_gbps: goodputs.iter().copied().fold(0.0, f64::max),
        jain_index: jain_index(&goodputs),
        fabric_utilisation,
        retransmits: p.conns.iter().map(|c| c.retransmits).sum(),
        drops_overflow: sum_counter(|c| c.drops_overflow),
        drops_loss: sum_counter(|c| c.drops_loss),
        drops_down: sum_counter(|c| c.drops_down),
        ecn_marks: sum_counter(|c| c.ecn_marks),
        pfc_pauses: sum_counter(|c| c.pauses),
        flows_completed: p.fcts.len(),
        fct_mean_us,
        fct_p50_us,
        fct_p99_us,
        flow_throughput_mean_gbps: if p.fcts.is_empty() {
            0.0
        } else {
            p.fcts
                .iter()
                .map(|f| f.size as f64 * 8.0 / f.fct_ns.max(1) as f64)
                .sum::<f64>()
                / p.fcts.len() as f64
        },
        ooo_gap_p99: percentile_histogram(&p.ooo_histogram, 0.99),
        ooo_gap_p999: percentile_histogram(&p.ooo_histogram, 0.999),
        ooo_gap_max: p.ooo_histogram.iter().rposition(|&c| c > 0).unwrap_or(0) as u64,
        failed_connections: p.conns.iter().filter(|c| c.is_failed).count(),
        events: p.events,
        wall_secs: p.wall_secs,
        events_per_sec: if p.wall_secs > 0.0 {
            p.events as f64 / p.wall_secs
        } else {
            0.0
        },
        cpu_secs: p.cpu_secs,
        events_per_cpu_sec: if p.cpu_secs > 0.0 {
            p.events as f64 / p.cpu_secs
        } else {
            0.0
        },
        malformed_datagrams: p.malformed_datagrams,
        mismatched_deliveries: p.mismatched_deliveries,
        packet_pool_high_water: p.packet_pool_high_water,
    };
    RunResult {
        scenario: p.scenario_file.to_string(),
        name: p.scenario.name.clone(),
        series: p.scenario.series.clone(),
        x: p.scenario.x,
        seed: p.scenario.seed,
        duration_ms: p.scenario.duration_ms,
        summary,
        conns: p.conns,
        links: p.links,
        fct_buckets,
        fcts: p.fcts,
        timeline: p.timeline,
        ooo_histogram: p.ooo_histogram,
    }
}

impl RunResult {
    /// The result with wall-clock figures zeroed: what must be identical between two runs
    /// of the same scenario and seed.
    pub fn without_wall_clock(mut self) -> RunResult {
        self.summary.wall_secs = 0.0;
        self.summary.events_per_sec = 0.0;
        self.summary.cpu_secs = 0.0;
        self.summary.events_per_cpu_sec = 0.0;
        self
    }

    /// A named numeric field of the summary (for summary plots).
    pub fn metric(&self, name: &str) -> Option<f64> {
        let v = serde_json::to_value(&self.summary).ok()?;
        v.get(name)?.as_f64()
    }

    /// Writes `conns.csv`, `links.csv`, `fct.csv`, `fct_buckets.csv`, `timeline.csv`,
    /// `ooo.csv` and `result.json` into `dir`.
    pub fn write(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut s = String::from(
            "conn,src,dst,goodput_gbps,message_goodput_gbps,delivered_bytes,messages,retransmits,final_cwnd,max_ooo_gap,failed\n",
        );
        for c in &self.conns {
            let _ = writeln!(
                s,
                "{},{},{},{:.4},{:.4},{},{},{},{:.2},{},{}",
                c.conn,
                c.src,
                c.dst,
                c.goodput_gbps,
                c.message_goodput_gbps,
                c.delivered_bytes,
                c.messages_delivered,
                c.retransmits,
                c.final_cwnd,
                c.max_ooo_gap,
                c.is_failed
            );
        }
        std::fs::write(dir.join("conns.csv"), s)?;
        let mut s = String::from(
            "link,gbps,utilisation,tx_packets,tx_bytes,drops_overflow,drops_loss,drops_down,ecn_marks,max_queue_bytes,pauses\n",
        );
        for l in &self.links {
            let c = &l.counters;
            let _ = writeln!(
                s,
                "{},{},{:.4},{},{},{},{},{},{},{},{}",
                csv_field(&l.name),
                l.gbps,
                l.utilisation,
                c.tx_packets,
                c.tx_bytes,
                c.drops_overflow,
                c.drops_loss,
                c.drops_down,
                c.ecn_marks,
                c.max_queue_bytes,
                c.pauses
            );
        }
        std::fs::write(dir.join("links.csv"), s)?;
        let mut s = String::from("conn,size,start_ns,fct_ns\n");
        for f in &self.fcts {
            let _ = writeln!(s, "{},{},{},{}", f.conn, f.size, f.start_ns, f.fct_ns);
        }
        std::fs::write(dir.join("fct.csv"), s)?;
        let mut s = String::from("bucket,count,mean_us,p50_us,p99_us\n");
        for b in &self.fct_buckets {
            let _ = writeln!(
                s,
                "{},{},{:.2},{:.2},{:.2}",
                b.label, b.count, b.mean_us, b.p50_us, b.p99_us
            );
        }
        std::fs::write(dir.join("fct_buckets.csv"), s)?;
        let t = &self.timeline;
        let mut s = String::from("time_ms");
        for n in &t.link_names {
            let _ = write!(s, ",{n}_gbps");
        }
        for i in 0..t.conn_cwnd.len() {
            let _ = write!(s, ",conn{i}_cwnd,conn{i}_goodput_gbps");
        }
        s.push('\n');
        for (row, time) in t.time_ms.iter().enumerate() {
            let _ = write!(s, "{time:.4}");
            for series in &t.link_gbps {
                let _ = write!(s, ",{:.3}", series.get(row).copied().unwrap_or(0.0));
            }
            for (cw, gp) in t.conn_cwnd.iter().zip(&t.conn_goodput_gbps) {
                let _ = write!(
                    s,
                    ",{:.2},{:.3}",
                    cw.get(row).copied().unwrap_or(0.0),
                    gp.get(row).copied().unwrap_or(0.0)
                );
            }
            s.push('\n');
        }
        std::fs::write(dir.join("timeline.csv"), s)?;
        let mut s = String::from("gap_packets,count\n");
        for (g, c) in self.ooo_histogram.iter().enumerate() {
            if *c > 0 {
                let _ = writeln!(s, "{g},{c}");
            }
        }
        std::fs::write(dir.join("ooo.csv"), s)?;
        let json = serde_json::to_string_pretty(self).map_err(io::Error::other)?;
        std::fs::write(dir.join("result.json"), json)
    }
}

/// A CSV field: quoted when it holds a comma, quote or line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Writes `summary.csv` (one row per variant) into `dir`.
pub fn write_summary(dir: &Path, runs: &[RunResult]) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut s = String::from(
        "variant,series,x,mean_goodput_gbps,total_goodput_gbps,min_goodput_gbps,jain_index,fabric_utilisation,retransmits,drops_loss,drops_overflow,drops_down,ecn_marks,pfc_pauses,flows_completed,fct_mean_us,fct_p50_us,fct_p99_us,flow_throughput_mean_gbps,ooo_gap_p99,ooo_gap_p999,ooo_gap_max,failed_connections,events,wall_secs,events_per_sec,cpu_secs,events_per_cpu_sec\n",
    );
    for r in runs {
        let m = &r.summary;
        let _ = writeln!(
            s,
            "{},{},{},{:.4},{:.4},{:.4},{:.4},{:.4},{},{},{},{},{},{},{},{:.2},{:.2},{:.2},{:.4},{},{},{},{},{},{:.3},{:.0},{:.3},{:.0}",
            csv_field(&r.name),
            csv_field(&r.series),
            r.x,
            m.mean_goodput_gbps,
            m.total_goodput_gbps,
            m.min_goodput_gbps,
            m.jain_index,
            m.fabric_utilisation,
            m.retransmits,
            m.drops_loss,
            m.drops_overflow,
            m.drops_down,
            m.ecn_marks,
            m.pfc_pauses,
            m.flows_completed,
            m.fct_mean_us,
            m.fct_p50_us,
            m.fct_p99_us,
            m.flow_throughput_mean_gbps,
            m.ooo_gap_p99,
            m.ooo_gap_p999,
            m.ooo_gap_max,
            m.failed_connections,
            m.events,
            m.wall_secs,
            m.events_per_sec,
            m.cpu_secs,
            m.events_per_cpu_sec
        );
    }
    std::fs::write(dir.join("summary.csv"), s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_fields_are_quoted_when_needed() {
        assert_eq!(csv_field("mp"), "mp");
        assert_eq!(csv_field("MP, iw 64"), "\"MP, iw 64\"");
        assert_eq!(csv_field("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn percentiles_and_jain() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile_sorted(&v, 0.5), 50.0);
        assert_eq!(percentile_sorted(&v, 0.99), 99.0);
        assert_eq!(percentile_sorted(&v, 1.0), 100.0);
        assert_eq!(percentile_sorted(&[], 0.5), 0.0);
        let mut hist = vec![0u64; 10];
        hist[0] = 998;
        hist[9] = 2;
        assert_eq!(percentile_histogram(&hist, 0.99), 0.0);
        assert_eq!(percentile_histogram(&hist, 0.999), 9.0);
        assert!((jain_index(&[1.0, 1.0, 1.0]) - 1.0).abs() < 1e-12);
        assert!((jain_index(&[1.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
    }
}
