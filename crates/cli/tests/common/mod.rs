//! What the CLI test binaries share: running the `fabriq` binary and reading `perf --json`.
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::process::{Command, Output};
use std::sync::Mutex;

use serde_json::Value;

/// `perf` runs two pinned, busy-polling processes (plus middleware workers): one at a time.
pub static PERF: Mutex<()> = Mutex::new(());

/// Run the `fabriq` binary with `args`.
pub fn fabriq(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fabriq"))
        .args(args)
        .output()
        .expect("spawn fabriq")
}

/// `fabriq perf --local --json ARGS`: must succeed without a panic and print JSON.
pub fn perf_json(args: &[&str]) -> Value {
    let _one_at_a_time = PERF.lock().unwrap_or_else(|e| e.into_inner());
    perf_json_held(args)
}

/// [`perf_json`] for a caller that holds [`PERF`] already.
pub fn perf_json_held(args: &[&str]) -> Value {
    let mut all = vec!["perf", "--local", "--json"];
    all.extend_from_slice(args);
    let out = fabriq(&all);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "fabriq {all:?} failed: {}\nstderr: {stderr}",
        out.status
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "fabriq {all:?} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}
