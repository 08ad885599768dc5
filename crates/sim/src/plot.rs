//! SVG plots of results, drawn with plotters.
//!
//! Owns chart layout only: a [`LineChart`] (titled axes, several named series, optional
//! category labels on x) and the standard figures of a run or a set of variants (link
//! timeline, cwnd trace, FCT by size, out-of-order gap CDF, summary metric across variants).
//! It computes nothing: every number comes from `results`.

use std::path::Path;

use plotters::prelude::*;

use crate::results::RunResult;

/// One named line.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// Points in x order.
    pub points: Vec<(f64, f64)>,
}

/// A line chart.
#[derive(Clone, Debug, PartialEq)]
pub struct LineChart {
    /// Title.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// Lines.
    pub series: Vec<Series>,
    /// When set, x values are indices into these labels.
    pub x_categories: Option<Vec<String>>,
    /// Draw point markers as well as lines.
    pub has_markers: bool,
}

/// Error drawing a chart.
#[derive(Debug, thiserror::Error)]
#[error("plot {path}: {message}")]
pub struct PlotError {
    path: String,
    message: String,
}

const COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

impl LineChart {
    /// Renders the chart as an SVG file.
    pub fn render_svg(&self, path: &Path) -> Result<(), PlotError> {
        let err = |e: &dyn std::fmt::Display| PlotError {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let pts = self.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
        for &(x, y) in pts {
            if x.is_finite() && y.is_finite() {
                x0 = x0.min(x);
                x1 = x1.max(x);
                y1 = y1.max(y);
            }
        }
        if !x0.is_finite() {
            (x0, x1) = (0.0, 1.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        if self.x_categories.is_some() {
            x0 -= 0.5;
            x1 += 0.5;
        }
        let y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
        let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&self.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, 0.0..y1)
            .map_err(|e| err(&e))?;
        let cats = self.x_categories.clone();
        let fmt_x = move |x: &f64| match &cats {
            Some(c) => {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < c.len() {
                    c[i as usize].clone()
                } else {
                    String::new()
                }
            }
            None => format!("{}", (x * 1000.0).round() / 1000.0),
        };
        let mut mesh = chart.configure_mesh();
        mesh.x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_label_formatter(&fmt_x);
        if let Some(c) = &self.x_categories {
            mesh.x_labels(c.len() * 2 + 1);
        }
        mesh.draw().map_err(|e| err(&e))?;
        for (i, s) in self.series.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            let style = ShapeStyle::from(&colour).stroke_width(2);
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), style))
                .map_err(|e| err(&e))?
                .label(s.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
            if self.has_markers {
                chart
                    .draw_series(
                        s.points
                            .iter()
                            .map(|&(x, y)| Circle::new((x, y), 4, colour.filled())),
                    )
                    .map_err(|e| err(&e))?;
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
        Ok(())
    }
}

/// Writes the per-run figures that apply to `r` into `dir`; returns the files written.
pub fn plot_run(r: &RunResult, dir: &Path) -> Result<Vec<String>, PlotError> {
    let mut written = Vec::new();
    let t = &r.timeline;
    let timed = |v: &Vec<f64>| -> Vec<(f64, f64)> {
        t.time_ms.iter().copied().zip(v.iter().copied()).collect()
    };
    if !t.link_names.is_empty() {
        let chart = LineChart {
            title: format!("{}: link throughput", r.name),
            x_label: "time (ms)".into(),
            y_label: "Gb/s".into(),
            series: t
                .link_names
                .iter()
                .zip(&t.link_gbps)
                .map(|(n, v)| Series {
                    name: n.clone(),
                    points: timed(v),
                })
                .collect(),
            x_categories: None,
            has_markers: false,
        };
        chart.render_svg(&dir.join("links.svg"))?;
        written.push("links.svg".into());
    }
    if !t.conn_cwnd.is_empty() {
        let chart = LineChart {
            title: format!("{}: sender congestion window", r.name),
            x_label: "time (ms)".into(),
            y_label: "cwnd (packets)".into(),
            series: t
                .conn_cwnd
                .iter()
                .enumerate()
                .map(|(i, v)| Series {
                    name: format!("conn {i}"),
                    points: timed(v),
                })
                .collect(),
            x_categories: None,
            has_markers: false,
        };
        chart.render_svg(&dir.join("cwnd.svg"))?;
        let chart = LineChart {
            title: format!("{}: connection goodput", r.name),
            y_label: "Gb/s".into(),
            series: t
                .conn_goodput_gbps
                .iter()
                .enumerate()
                .map(|(i, v)| Series {
                    name: format!("conn {i}"),
                    points: timed(v),
                })
                .collect(),
            ..chart
        };
        chart.render_svg(&dir.join("goodput.svg"))?;
        written.push("cwnd.svg".into());
        written.push("goodput.svg".into());
    }
    Ok(written)
}

/// Writes the cross-variant figures into `dir`: the summary metric against x (when variants
/// set x), FCT by size (when flows completed) and the OOO gap CDF (when recorded).
pub fn plot_variants(
    runs: &[RunResult],
    dir: &Path,
    metric: &str,
    x_label: &str,
) -> Result<Vec<String>, PlotError> {
    let mut written = Vec::new();
    let mut series: Vec<Series> = Vec::new();
    for r in runs {
        let Some(y) = r.metric(metric) else { continue };
        let name = if r.series.is_empty() {
            "all".to_string()
        } else {
            r.series.clone()
        };
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push((r.x, y)),
            None => series.push(Series {
                name,
                points: vec![(r.x, y)],
            }),
        }
    }
    if runs.len() > 1 && series.iter().any(|s| s.points.len() > 1) {
        for s in &mut series {
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        LineChart {
            title: format!("{}: {}", runs[0].scenario, metric.replace('_', " ")),
            x_label: x_label.into(),
            y_label: metric.into(),
            series,
            x_categories: None,
            has_markers: true,
        }
        .render_svg(&dir.join("summary.svg"))?;
        written.push("summary.svg".into());
    }
    if runs.iter().any(|r| r.conns.len() >= 4) {
        // Per-connection goodput, sorted: spread and fairness at a glance.
        let series = runs
            .iter()
            .map(|r| {
                let mut g: Vec<f64> = r.conns.iter().map(|c| c.goodput_gbps).collect();
                g.sort_by(f64::total_cmp);
                let n = g.len().max(1) as f64;
                Series {
                    name: r.name.clone(),
                    points: g
                        .into_iter()
                        .enumerate()
                        .map(|(i, v)| ((i + 1) as f64 / n, v))
                        .collect(),
                }
            })
            .collect();
        LineChart {
            title: "per-connection goodput (sorted)".into(),
            x_label: "fraction of connections".into(),
            y_label: "goodput (Gb/s)".into(),
            series,
            x_categories: None,
            has_markers: false,
        }
        .render_svg(&dir.join("conn_goodput.svg"))?;
        written.push("conn_goodput.svg".into());
    }
    if runs.iter().any(|r| r.summary.flows_completed > 0) {
        let cats: Vec<String> = runs[0]
            .fct_buckets
            .iter()
            .map(|b| b.label.clone())
            .collect();
        for (stat, file) in [
            ("p50", "fct_p50.svg"),
            ("p99", "fct_p99.svg"),
            ("mean", "fct_mean.svg"),
        ] {
            let series = runs
                .iter()
                .map(|r| Series {
                    name: r.name.clone(),
                    points: r
                        .fct_buckets
                        .iter()
                        .enumerate()
                        .filter(|(_, b)| b.count > 0)
                        .map(|(i, b)| {
                            let v = match stat {
                                "p50" => b.p50_us,
                                "p99" => b.p99_us,
                                _ => b.mean_us,
                            };
                            (i as f64, v)
                        })
                        .collect(),
                })
                .collect();
            LineChart {
                title: format!("{stat} flow completion time by flow size"),
                x_label: "flow size (bytes)".into(),
                y_label: format!("{stat} FCT (us)"),
                series,
                x_categories: Some(cats.clone()),
                has_markers: true,
            }
            .render_svg(&dir.join(file))?;
            written.push(file.into());
        }
    }
    if runs.iter().any(|r| r.ooo_histogram.iter().any(|&c| c > 0)) {
        let series = runs
            .iter()
            .map(|r| {
                let total: u64 = r.ooo_histogram.iter().sum();
                let mut acc = 0u64;
                let points = r
                    .ooo_histogram
                    .iter()
                    .enumerate()
                    .filter_map(|(g, &c)| {
                        acc += c;
                        (c > 0 && total > 0).then(|| (g as f64, acc as f64 / total as f64))
                    })
                    .collect();
                Series {
                    name: r.name.clone(),
                    points,
                }
            })
            .collect();
        LineChart {
            title: "out-of-order gap CDF".into(),
            x_label: "OOO gap (packets)".into(),
            y_label: "fraction of data packets".into(),
            series,
            x_categories: None,
            has_markers: false,
        }
        .render_svg(&dir.join("ooo_cdf.svg"))?;
        written.push("ooo_cdf.svg".into());
    }
    Ok(written)
}
