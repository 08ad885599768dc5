//! CPU pinning of the client and server processes (`sched_setaffinity` through
//! `core_affinity`), and the default placement of `--local` runs: client on the first CPU of
//! the process's set, server on the second.

use super::error::{PerfError, Result};

/// CPUs this process may run on, ascending.
pub fn available() -> Vec<usize> {
    let mut ids: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect();
    ids.sort_unstable();
    ids
}

/// Pin the calling thread (and the threads it spawns later) to `cpu`.
pub fn pin(cpu: usize) -> Result<()> {
    let ids = available();
    if !ids.contains(&cpu) {
        return Err(PerfError::Affinity {
            cpu,
            reason: format!("not in this process's CPU set {ids:?}"),
        });
    }
    if core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
        Ok(())
    } else {
        Err(PerfError::Affinity {
            cpu,
            reason: "sched_setaffinity refused".into(),
        })
    }
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
}
