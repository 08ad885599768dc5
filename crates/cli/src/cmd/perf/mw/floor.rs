//! connect_lat's **wake floor**: a one-byte round trip over a bare Unix socket to a thread of
//! the server asleep on the server's CPU, the client spinning for the answer — the wake-ups of
//! a cached connect between two processes (the sleeping acceptor woken by the hello, the
//! pinned client spinning for the hello-ack) with none of the connect's own work. Timed in the
//! same blocks and settled the same way as the connects, it is what no handshake, however
//! short, can go under on the host it ran on: on a virtual machine, where a wake-up across
//! CPUs goes through the hypervisor, it is tens of microseconds (the writer pays part of it in
//! its `write`, the sleeper the rest until it runs: `docs/BENCHMARKS.md`).
//!
//! The server binds an abstract Unix socket (Linux) named after its process and the run and
//! sends the name in `Listeners`; a client on another host cannot reach it and runs without a
//! floor row.

use std::io::{ErrorKind, Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::cmd::perf::error::{PerfError, Result};
use crate::cmd::perf::STALL;

/// How often the server's floor thread looks at the run's stop flag while it waits.
const LOOK: Duration = Duration::from_millis(20);

/// The server's end: a listener on a fresh abstract name.
pub(super) struct FloorServer {
    listener: UnixListener,
    name: String,
}

impl FloorServer {
    /// Bind a listener on a name of this process and run.
    pub(super) fn bind() -> Result<Self> {
        static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let name = format!(
            "fabriq-perf-floor-{}-{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        );
        let listener = SocketAddr::from_abstract_name(name.as_bytes())
            .and_then(|a| UnixListener::bind_addr(&a))
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| PerfError::Protocol(format!("connect_lat: wake floor socket: {e}")))?;
        Ok(FloorServer { listener, name })
    }

    /// The name the client connects to.
    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// Answer each byte with the same byte until `stop`: a blocking read (the thread asleep in
    /// the socket's wait queue, as an acceptor is in its `poll`), waking every [`LOOK`] to look
    /// at `stop`. A client that never connects (another host) or leaves is no error.
    pub(super) fn serve(&self, stop: &AtomicBool) -> Result<()> {
        let io = |e: std::io::Error| PerfError::Protocol(format!("connect_lat: wake floor: {e}"));
        let mut stream = loop {
            if stop.load(Ordering::Acquire) {
                return Ok(());
            }
            match self.listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(LOOK),
                Err(e) => return Err(io(e)),
            }
        };
        stream.set_nonblocking(false).map_err(io)?;
        stream.set_read_timeout(Some(LOOK)).map_err(io)?;
        let mut b = [0u8; 1];
        while !stop.load(Ordering::Acquire) {
            match stream.read(&mut b) {
                Ok(0) => return Ok(()),
                Ok(_) => stream.write_all(&b).map_err(io)?,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io(e)),
            }
        }
        Ok(())
    }
}

/// The client's end: connected to the server's floor socket, non-blocking.
pub(super) struct FloorClient {
    stream: UnixStream,
    next: u8,
}

impl FloorClient {
    /// Connect to the server's floor socket; `None` where it cannot be reached (the server runs
    /// on another host).
    pub(super) fn connect(name: &str) -> Option<Self> {
        let stream = SocketAddr::from_abstract_name(name.as_bytes())
            .and_then(|a| UnixStream::connect_addr(&a))
            .and_then(|s| s.set_nonblocking(true).map(|()| s))
            .ok()?;
        Some(FloorClient { stream, next: 0 })
    }

    /// One round trip: a byte out, spin until it is back. `Ok(false)`: another byte came back.
    pub(super) fn ping(&mut self) -> Result<bool> {
        let io = |e: std::io::Error| PerfError::Protocol(format!("connect_lat: wake floor: {e}"));
        self.next = self.next.wrapping_add(1);
        self.stream.write_all(&[self.next]).map_err(io)?;
        let until = Instant::now() + STALL;
        let mut b = [0u8; 1];
        loop {
            match self.stream.read(&mut b) {
                Ok(1) => return Ok(b[0] == self.next),
                Ok(_) => {
                    return Err(PerfError::Protocol(
                        "connect_lat: the server closed the wake floor socket".into(),
                    ))
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                    if Instant::now() > until {
                        return Err(PerfError::Protocol(
                            "connect_lat: no answer on the wake floor socket".into(),
                        ));
                    }
                    std::hint::spin_loop();
                }
                Err(e) => return Err(io(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_floor_round_trip_echoes_each_byte_and_ends_on_stop() {
        let server = FloorServer::bind().expect("bind");
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let t = s.spawn(|| server.serve(&stop));
            let mut c = FloorClient::connect(server.name()).expect("connect");
            for _ in 0..300 {
                assert!(c.ping().expect("ping"));
            }
            stop.store(true, Ordering::Release);
            t.join().expect("join").expect("serve");
        });
    }

    #[test]
    fn a_floor_server_without_a_client_ends_on_stop() {
        let server = FloorServer::bind().expect("bind");
        let stop = AtomicBool::new(true);
        server.serve(&stop).expect("serve");
        assert!(FloorClient::connect("fabriq-perf-floor-nobody").is_none());
    }
}
