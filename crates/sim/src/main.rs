//! `fabriq-sim`: run datacenter simulation scenarios of the fabriq MP-RDMA transport.
//!
//! `fabriq-sim run FILE [--out DIR] [--seed N] [--variant NAME] [--stats]` runs every
//! variant of a scenario file and writes CSV, JSON and SVG plots under `DIR/<scenario>/`;
//! `fabriq-sim list [DIR]` lists the scenario files it finds.
#![forbid(unsafe_code)]

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use fabriq_sim::plot::{plot_run, plot_variants};
use fabriq_sim::results::{write_summary, RunResult};
use fabriq_sim::runner::run_scenario;
use fabriq_sim::scenario::ScenarioFile;

#[derive(Parser)]
#[command(
    name = "fabriq-sim",
    version,
    about = "Discrete-event datacenter simulator for fabriq's MP-RDMA transport"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a scenario file (all its variants).
    Run {
        /// Scenario TOML file.
        file: PathBuf,
        /// Output directory (results go to DIR/<scenario name>/).
        #[arg(long, default_value = "sim/out")]
        out: PathBuf,
        /// Override the scenario's seed.
        #[arg(long)]
        seed: Option<u64>,
        /// Run only the variants whose name contains this string.
        #[arg(long)]
        variant: Option<String>,
        /// Print simulator performance (events, events per second) per run.
        #[arg(long)]
        stats: bool,
    },
    /// List scenario files with their descriptions.
    List {
        /// Directory to search.
        #[arg(default_value = "sim/scenarios")]
        dir: PathBuf,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run {
            file,
            out,
            seed,
            variant,
            stats,
        } => run(&file, &out, seed, variant.as_deref(), stats),
        Command::List { dir } => list(&dir),
    }
}

fn list(dir: &Path) -> Result<()> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    for f in files {
        match ScenarioFile::load(&f) {
            Ok(sf) => {
                let first = &sf.runs[0];
                let name = f.file_stem().unwrap_or_default().to_string_lossy();
                println!(
                    "{name:<24} {} variant(s), {} ms  {}",
                    sf.runs.len(),
                    first.duration_ms,
                    first.description
                );
            }
            Err(e) => println!("{:<24} INVALID: {e}", f.display()),
        }
    }
    Ok(())
}

fn run(file: &Path, out: &Path, seed: Option<u64>, only: Option<&str>, stats: bool) -> Result<()> {
    let sf = ScenarioFile::load(file)?;
    let mut runs = sf.runs;
    if let Some(only) = only {
        runs.retain(|r| r.name.contains(only));
        if runs.is_empty() {
            bail!("no variant matches `{only}`");
        }
    }
    let scenario_name = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "scenario".into());
    let dir = out.join(&scenario_name);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let is_tty = std::io::stderr().is_terminal();
    let mut results: Vec<RunResult> = Vec::new();
    let metric = runs[0]
        .output
        .summary_metric
        .clone()
        .unwrap_or_else(|| "mean_goodput_gbps".into());
    let x_label = runs[0]
        .output
        .summary_x_label
        .clone()
        .unwrap_or_else(|| "x".into());
    for mut s in runs {
        if let Some(seed) = seed {
            s.seed = seed;
        }
        let bar = if is_tty {
            let b = ProgressBar::new(1000);
            b.set_style(
                ProgressStyle::with_template("{prefix:>20} [{bar:40}] {percent:>3}% {elapsed}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.set_prefix(s.name.clone());
            Some(b)
        } else {
            None
        };
        let r = run_scenario(&s, &mut |f| {
            if let Some(b) = &bar {
                b.set_position((f * 1000.0) as u64);
            }
        });
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        let vdir = dir.join(&r.name);
        r.write(&vdir)
            .with_context(|| format!("writing {}", vdir.display()))?;
        plot_run(&r, &vdir)?;
        let m = &r.summary;
        println!(
            "{:<20} goodput mean {:7.3} Gb/s total {:8.3} Gb/s  jain {:.3}  fabric util {:5.1}%  retx {:7}  flows {:6}  fct p50/p99 {:.1}/{:.1} us  ooo p99.9 {}",
            r.name,
            m.mean_goodput_gbps,
            m.total_goodput_gbps,
            m.jain_index,
            m.fabric_utilisation * 100.0,
            m.retransmits,
            m.flows_completed,
            m.fct_p50_us,
            m.fct_p99_us,
            m.ooo_gap_p999
        );
        if stats {
            println!(
                "{:<20} {} events in {:.2} s wall ({:.2} M events/s), {:.2} s CPU ({:.2} M events/s per core); packet pool high water {}",
                "",
                m.events,
                m.wall_secs,
                m.events_per_sec / 1e6,
                m.cpu_secs,
                m.events_per_cpu_sec / 1e6,
                m.packet_pool_high_water
            );
        }
        results.push(r);
    }
    write_summary(&dir, &results)?;
    plot_variants(&results, &dir, &metric, &x_label)?;
    println!("results in {}", dir.display());
    Ok(())
}
