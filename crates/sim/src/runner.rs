//! Running scenarios: picks the transport, drives a [`Simulation`] to its end in slices (so
//! a caller can show progress) and times it.
//!
//! Owns nothing but the glue between `scenario`, `sim` and the transports; the CLI and the
//! tests both run scenarios through here.

use std::time::Instant as WallClock;

use crate::clock::Time;
use crate::mpath_adapter::{mpath_config, MpathTransport};
use crate::results::RunResult;
use crate::scenario::{Scenario, TransportKind};
use crate::sim::{EndpointSpec, Simulation};
use crate::transport::{FixedWindow, Transport};

/// Slices a run is cut into for progress reports.
const PROGRESS_SLICES: u64 = 200;

/// CPU time this process has used, in seconds, from `/proc/self/stat` (utime + stime, in
/// USER_HZ = 100 ticks per second on Linux); `None` where that file is unavailable.
pub fn process_cpu_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

fn drive<T: Transport>(mut sim: Simulation<T>, progress: &mut dyn FnMut(f64)) -> RunResult {
    let start = WallClock::now();
    let cpu_start = process_cpu_secs();
    let end = sim.end();
    let step = (end.as_nanos() / PROGRESS_SLICES).max(1);
    let mut t = Time::ZERO;
    loop {
        t += step;
        let done = sim.run_until(t);
        progress(sim.now().as_nanos() as f64 / end.as_nanos().max(1) as f64);
        if done {
            break;
        }
    }
    let cpu = match (cpu_start, process_cpu_secs()) {
        (Some(a), Some(b)) => b - a,
        _ => 0.0,
    };
    sim.finish(start.elapsed().as_secs_f64(), cpu)
}

/// Runs one scenario to its end; `progress` is called with the fraction done.
pub fn run_scenario(s: &Scenario, progress: &mut dyn FnMut(f64)) -> RunResult {
    let host_gbps = s.topology.host_link_gbps;
    match s.transport.kind {
        TransportKind::Mpath => {
            let t = s.transport.clone();
            let sim = Simulation::new(s, |spec: &EndpointSpec| {
                MpathTransport::new(mpath_config(&t, host_gbps, spec.seed))
            });
            drive(sim, progress)
        }
        TransportKind::FixedWindow => {
            let window = s.transport.window.unwrap_or(16);
            let mss = u32::from(s.transport.mss.unwrap_or(1024));
            let paths = s.transport.num_paths.unwrap_or(1);
            let sim = Simulation::new(s, |_: &EndpointSpec| FixedWindow::new(window, mss, paths));
            drive(sim, progress)
        }
    }
}
