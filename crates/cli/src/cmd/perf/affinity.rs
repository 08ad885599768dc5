//! CPU placement of the client and server processes (`sched_setaffinity`), and the default
//! placement of `--local` runs: client on CPU 0, server on CPU 1 (else the first two CPUs of
//! the process's set).
//!
//! Only the benchmark thread is pinned. Software providers run helper threads (the tcp
//! progress thread, the shm service thread) that a pinned, busy-polling benchmark thread would
//! starve if they inherited its single-CPU mask — completions that need them would then wait for
//! a scheduler time slice. So devices are opened inside [`unpinned`], which gives the thread
//! the process's original CPU set for the duration of the call: threads spawned there keep it.

use std::sync::OnceLock;

use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

use super::error::{PerfError, Result};

/// The CPU set the process started with, captured before any pinning.
static ORIGINAL: OnceLock<Option<CpuSet>> = OnceLock::new();

/// Remember the process's CPU set; call before pinning anything.
pub fn capture_original() {
    ORIGINAL.get_or_init(|| sched_getaffinity(None).ok());
}

fn cpus_of(set: &CpuSet) -> Vec<usize> {
    (0..CpuSet::MAX_CPU).filter(|&c| set.is_set(c)).collect()
}

/// CPUs this process started with, ascending.
pub fn available() -> Vec<usize> {
    capture_original();
    match ORIGINAL.get() {
        Some(Some(set)) => cpus_of(set),
        _ => Vec::new(),
    }
}

/// True when the process started with one CPU (`taskset -c N`, a cpuset of one): the
/// benchmark thread, the peer of a `--local` run and the providers' helper threads then share
/// it, and a busy wait steps aside at every empty poll, or the peer it waits for would run only
/// when the wait's time slice ends.
pub fn one_cpu() -> bool {
    static ONE: OnceLock<bool> = OnceLock::new();
    *ONE.get_or_init(|| available().len() == 1)
}

/// Pin the calling thread (and the threads it spawns later, outside [`unpinned`]) to `cpu`.
pub fn pin(cpu: usize) -> Result<()> {
    let ids = available();
    if !ids.contains(&cpu) {
        return Err(PerfError::Affinity {
            cpu,
            reason: format!("not in this process's CPU set {ids:?}"),
        });
    }
    let mut set = CpuSet::new();
    set.set(cpu);
    sched_setaffinity(None, &set).map_err(|e| PerfError::Affinity {
        cpu,
        reason: format!("sched_setaffinity: {e}"),
    })
}

/// Run `f` with the calling thread's affinity widened to the original CPU set, then restore
/// it; threads `f` spawns keep the wide set.
pub fn unpinned<T>(f: impl FnOnce() -> T) -> T {
    capture_original();
    let current = sched_getaffinity(None).ok();
    let widened = match ORIGINAL.get() {
        Some(Some(original)) => sched_setaffinity(None, original).is_ok(),
        _ => false,
    };
    let out = f();
    if widened {
        if let Some(cur) = current {
            // Restoring a mask the thread already had cannot fail for lack of CPUs; if it
            // does anyway the run continues unpinned, which only costs accuracy.
            let _ = sched_setaffinity(None, &cur);
        }
    }
    out
}

/// Default (client, server) CPUs for `--local`: 0 and 1 when present, else the first two CPUs of
/// the set, else the same CPU twice (with a warning from the caller).
pub fn local_defaults(available: &[usize]) -> (Option<usize>, Option<usize>) {
    let client = if available.contains(&0) {
        Some(0)
    } else {
        available.first().copied()
    };
    let server = if available.contains(&1) && client != Some(1) {
        Some(1)
    } else {
        available
            .iter()
            .copied()
            .find(|&c| Some(c) != client)
            .or(client)
    };
    (client, server)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_defaults_prefer_0_and_1() {
        assert_eq!(local_defaults(&[0, 1, 2]), (Some(0), Some(1)));
        assert_eq!(local_defaults(&[2, 5]), (Some(2), Some(5)));
        assert_eq!(local_defaults(&[3]), (Some(3), Some(3)));
        assert_eq!(local_defaults(&[]), (None, None));
    }

    #[test]
    fn pinning_outside_the_set_is_an_error() {
        assert!(matches!(pin(usize::MAX), Err(PerfError::Affinity { .. })));
    }

    #[test]
    fn unpinned_restores_the_pin_and_spawned_threads_keep_the_wide_set() {
        let all = available();
        let Some(&first) = all.first() else { return };
        // Run on a thread of its own: pinning must not leak into other tests.
        std::thread::spawn(move || {
            pin(first).expect("pin");
            let inner = unpinned(|| {
                std::thread::spawn(|| sched_getaffinity(None).map(|s| cpus_of(&s)))
                    .join()
                    .expect("join")
                    .expect("getaffinity")
            });
            assert_eq!(
                inner, all,
                "a thread spawned inside unpinned() keeps the full set"
            );
            let now = cpus_of(&sched_getaffinity(None).expect("getaffinity"));
            assert_eq!(now, vec![first], "the pin is restored");
        })
        .join()
        .expect("test thread");
    }
}
