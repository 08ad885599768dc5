//! Figures and a median table from the JSON lines `bench/netns.sh` prints (the udp provider on
//! the network-namespace fabric, docs/MPRDMA.md "On a real kernel network").
//!
//! ```text
//! sudo bench/netns.sh all > out.jsonl
//! cargo run -p fabriq-sim --bin netns-plot -- out.jsonl docs/img [PREFIX]
//! ```
//!
//! Writes `<PREFIX><experiment>.svg` (PREFIX defaults to `netns-`) into the directory: for
//! bandwidth and loss the median goodput of each setting and mode as bars with min–max
//! whiskers over the runs; for ECN each spine's share of the packets the same way (marking
//! moves load off the marked spine); for the link failure the goodput timeline of every run; for
//! synchronise the goodput of its rounds the same way, with the violation count and the
//! receiver's largest out-of-order gap in the title. Prints a Markdown table of the medians.
//! Reads only lines with an `"exp"` field; `"summary"` lines are ignored (the medians are
//! recomputed here from the runs).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use fabriq_sim::plot::{LineChart, Series};
use plotters::prelude::*;
use serde_json::Value;

/// One run of `bench/netns.sh`.
#[derive(Debug, Clone)]
struct Run {
    exp: String,
    setting: String,
    mode: String,
    variant: String,
    goodput_mbps: f64,
    timeline_mbps: Vec<f64>,
    violations: Option<u64>,
    receiver_max_ooo_gap: Option<u64>,
    /// Packets each spine forwarded during the run (both directions), by spine name.
    spine_packets: Vec<(String, u64)>,
    is_clean: bool,
}

fn parse_run(v: &Value) -> Option<Run> {
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    let client = v.get("client")?;
    let server = v.get("server")?;
    let exp = s("exp")?;
    let complete = server.get("complete").and_then(Value::as_bool) == Some(true);
    let failed = client.get("failed").and_then(Value::as_bool) == Some(true);
    let corrupt = server.get("corrupt").and_then(Value::as_u64).unwrap_or(0);
    let ooo = server
        .get("out_of_order")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    Some(Run {
        exp,
        setting: s("setting").unwrap_or_default(),
        mode: s("mode").unwrap_or_default(),
        variant: s("variant").unwrap_or_default(),
        goodput_mbps: client.get("goodput_mbps").and_then(Value::as_f64)?,
        timeline_mbps: client
            .get("timeline_mbps")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default(),
        violations: server.get("violations").and_then(Value::as_u64),
        receiver_max_ooo_gap: server
            .get("mpath")
            .and_then(|m| m.get("max_ooo_gap"))
            .and_then(Value::as_u64),
        spine_packets: v
            .get("spines")
            .and_then(Value::as_object)
            .map(|o| {
                o.iter()
                    .map(|(k, s)| {
                        let total = s.get("total").and_then(Value::as_u64).unwrap_or(0);
                        (k.clone(), total)
                    })
                    .collect()
            })
            .unwrap_or_default(),
        is_clean: complete && !failed && corrupt == 0 && ooo == 0,
    })
}

/// Median, min, max.
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return (0.0, 0.0, 0.0);
    }
    let med = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (med, v[0], v[n - 1])
}

/// Runs of one experiment grouped by (setting [variant]) then mode, in first-seen order.
struct Groups {
    categories: Vec<String>,
    modes: Vec<String>,
    values: BTreeMap<(usize, usize), Vec<f64>>,
}

fn group(runs: &[&Run], value: impl Fn(&Run) -> f64) -> Groups {
    let many_variants = runs
        .iter()
        .map(|r| &r.variant)
        .collect::<std::collections::BTreeSet<_>>()
        .len()
        > 1;
    let mut g = Groups {
        categories: Vec::new(),
        modes: Vec::new(),
        values: BTreeMap::new(),
    };
    for r in runs {
        let cat = if many_variants {
            format!("{} [{}]", r.setting, r.variant)
        } else {
            r.setting.clone()
        };
        let ci = match g.categories.iter().position(|c| *c == cat) {
            Some(i) => i,
            None => {
                g.categories.push(cat);
                g.categories.len() - 1
            }
        };
        let mi = match g.modes.iter().position(|m| *m == r.mode) {
            Some(i) => i,
            None => {
                g.modes.push(r.mode.clone());
                g.modes.len() - 1
            }
        };
        g.values.entry((ci, mi)).or_default().push(value(r));
    }
    g
}

const COLOURS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
];

/// Grouped bars (median) with min–max whiskers.
fn bars(g: &Groups, title: &str, y_label: &str, path: &Path) -> Result<()> {
    let n = g.categories.len().max(1);
    let m = g.modes.len().max(1);
    let y_max = g
        .values
        .values()
        .flat_map(|v| v.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.3;
    let width = (180 * n as u32).clamp(640, 1400);
    let root = SVGBackend::new(path, (width, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0.0f64..y_max)?;
    let cats = g.categories.clone();
    let fmt_x = move |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < cats.len() {
            cats[i as usize].clone()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&fmt_x)
        .y_desc(y_label)
        .draw()?;
    let bar_w = 0.8 / m as f64;
    for (mi, mode) in g.modes.iter().enumerate() {
        let colour = COLOURS[mi % COLOURS.len()];
        let mut rects = Vec::new();
        let mut whiskers = Vec::new();
        for ci in 0..n {
            let Some(v) = g.values.get(&(ci, mi)) else {
                continue;
            };
            let (med, lo, hi) = spread(v);
            let x0 = ci as f64 - 0.4 + mi as f64 * bar_w;
            rects.push(Rectangle::new(
                [(x0 + 0.05 * bar_w, 0.0), (x0 + 0.95 * bar_w, med)],
                colour.mix(0.8).filled(),
            ));
            let (xc, cap) = (x0 + bar_w / 2.0, bar_w / 6.0);
            for seg in [
                vec![(xc, lo), (xc, hi)],
                vec![(xc - cap, lo), (xc + cap, lo)],
                vec![(xc - cap, hi), (xc + cap, hi)],
            ] {
                whiskers.push(PathElement::new(seg, BLACK.stroke_width(1)));
            }
        }
        chart
            .draw_series(rects)?
            .label(mode.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], colour.filled()));
        chart.draw_series(whiskers)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (input, dir, prefix) = match args.as_slice() {
        [input, dir] => (input, dir, "netns-"),
        [input, dir, prefix] => (input, dir, prefix.as_str()),
        _ => bail!("usage: netns-plot OUT.jsonl DIR [PREFIX]"),
    };
    let file = std::fs::File::open(input).with_context(|| format!("open {input}"))?;
    let mut runs = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line?;
        if !line.starts_with('{') {
            continue;
        }
        let v: Value =
            serde_json::from_str(&line).with_context(|| format!("{input}:{}: not JSON", i + 1))?;
        if let Some(r) = parse_run(&v) {
            runs.push(r);
        }
    }
    if runs.is_empty() {
        bail!("{input}: no runs");
    }
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir)?;
    let mut exps: Vec<String> = Vec::new();
    for r in &runs {
        if !exps.contains(&r.exp) {
            exps.push(r.exp.clone());
        }
    }
    println!(
        "| experiment | setting | mode | variant | runs | median Mbit/s | min–max | all clean |"
    );
    println!("|---|---|---|---|---:|---:|---:|---|");
    for exp in &exps {
        let of: Vec<&Run> = runs.iter().filter(|r| &r.exp == exp).collect();
        let g = group(&of, |r| r.goodput_mbps);
        for ((ci, mi), v) in &g.values {
            let (med, lo, hi) = spread(v);
            let (setting, variant) = match g.categories[*ci].rsplit_once(" [") {
                Some((s, v)) => (s.to_string(), v.trim_end_matches(']').to_string()),
                None => (g.categories[*ci].clone(), of[0].variant.clone()),
            };
            let clean = of
                .iter()
                .filter(|r| r.setting == setting && r.mode == g.modes[*mi])
                .all(|r| r.is_clean);
            println!(
                "| {exp} | {setting} | {} | {variant} | {} | {med:.1} | {lo:.1}–{hi:.1} | {} |",
                g.modes[*mi],
                v.len(),
                if clean { "yes" } else { "no" }
            );
        }
        let path = dir.join(format!("{prefix}{exp}.svg"));
        match exp.as_str() {
            "failure" => {
                let series = of
                    .iter()
                    .enumerate()
                    .map(|(i, r)| Series {
                        name: format!("run {} ({})", i + 1, r.variant),
                        points: r
                            .timeline_mbps
                            .iter()
                            .enumerate()
                            .map(|(k, &y)| ((k + 1) as f64 * 0.1, y))
                            .collect(),
                    })
                    .collect();
                LineChart {
                    title: format!("link failure: {} (100 ms windows)", of[0].setting),
                    x_label: "time (s)".into(),
                    y_label: "goodput (Mbit/s)".into(),
                    series,
                    x_categories: None,
                    has_markers: false,
                }
                .render_svg(&path)?;
            }
            "sync" => {
                let violations: u64 = of.iter().filter_map(|r| r.violations).sum();
                let gap = of
                    .iter()
                    .filter_map(|r| r.receiver_max_ooo_gap)
                    .max()
                    .unwrap_or(0);
                bars(
                    &g,
                    &format!(
                        "synchronise: {violations} violations in {} runs; receiver out-of-order gap up to {gap}",
                        of.len()
                    ),
                    "goodput of data + flag rounds (Mbit/s)",
                    &path,
                )?;
                println!(
                    "| {exp} | largest receiver out-of-order gap (packets) | | | {} | {gap} | | violations: {violations} |",
                    of.len()
                );
            }
            "ecn" => {
                // Where the packets went: each spine's share per setting (median of runs).
                let mut shares = Groups {
                    categories: Vec::new(),
                    modes: Vec::new(),
                    values: BTreeMap::new(),
                };
                for r in &of {
                    let total: u64 = r.spine_packets.iter().map(|(_, n)| n).sum();
                    if total == 0 {
                        continue;
                    }
                    let mi = match shares.modes.iter().position(|m| *m == r.setting) {
                        Some(i) => i,
                        None => {
                            shares.modes.push(r.setting.clone());
                            shares.modes.len() - 1
                        }
                    };
                    for (spine, n) in &r.spine_packets {
                        let ci = match shares.categories.iter().position(|c| c == spine) {
                            Some(i) => i,
                            None => {
                                shares.categories.push(spine.clone());
                                shares.categories.len() - 1
                            }
                        };
                        shares
                            .values
                            .entry((ci, mi))
                            .or_default()
                            .push(100.0 * *n as f64 / total as f64);
                    }
                }
                bars(
                    &shares,
                    "ECN: each spine's share of the packets, median of runs (whiskers: min–max)",
                    "share of packets (%)",
                    &path,
                )?;
            }
            _ => bars(
                &g,
                &format!("{exp}: goodput, median of runs (whiskers: min–max)"),
                "goodput (Mbit/s)",
                &path,
            )?,
        }
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
