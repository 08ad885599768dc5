//! What the tests that run a peer in a process of its own share: the process, stopped
//! (SIGSTOP), continued and killed.

use std::process::Child;
use std::time::{Duration, Instant};

use rustix::process::{kill_process, Pid, Signal};

/// A peer's process; killed (stopped or not) when the test ends, however it ends.
pub struct PeerProcess(pub Child);

impl PeerProcess {
    pub fn signal(&self, sig: Signal) {
        let pid = Pid::from_raw(self.0.id() as i32).expect("pid");
        kill_process(pid, sig).expect("signal the peer");
    }

    /// SIGSTOP, and wait until every thread of the peer is stopped (at most `bound`): `kill`
    /// returns before they are, and a thread still running could serve the next operation.
    pub fn stop(&self, bound: Duration) {
        self.signal(Signal::STOP);
        let tasks = format!("/proc/{}/task", self.0.id());
        let until = Instant::now() + bound;
        loop {
            let stopped = std::fs::read_dir(&tasks)
                .expect("the peer's threads")
                .filter_map(Result::ok)
                .all(|t| {
                    // `pid (comm) S ...`: the state follows the last ')'.
                    std::fs::read_to_string(t.path().join("stat")).is_ok_and(|st| {
                        st.rsplit_once(')')
                            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['T', 't']))
                    })
                });
            if stopped {
                return;
            }
            assert!(Instant::now() < until, "the peer did not stop");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
