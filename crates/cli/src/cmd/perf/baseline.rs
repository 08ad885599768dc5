//! The plain TCP ping-pong baseline (`--tcp-baseline`): what a kernel TCP socket pair costs on
//! the same path, to put the software providers' figures in context.
//!
//! The client writes `size` bytes, the server reads them all and writes them back; one-way =
//! RTT / 2. Sockets have `TCP_NODELAY`. In busy mode both sockets are non-blocking and the
//! reader spins on `read` (the fairest comparison with a busy-polled CQ); in event mode they
//! block in the kernel.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::error::{PerfError, Result};
use super::lat::{new_histogram, LatOutcome};
use super::proto::{Mode, RunParams};
use super::report::Progress;

/// One end of the baseline's data connection.
pub struct BaselineSocket {
    stream: TcpStream,
    mode: Mode,
    stall: Duration,
}

fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> PerfError {
    move |source| PerfError::Baseline { context, source }
}

impl BaselineSocket {
    /// Configure a connected stream for `mode`.
    pub fn new(stream: TcpStream, mode: Mode, stall: Duration) -> Result<Self> {
        stream.set_nodelay(true).map_err(io("set TCP_NODELAY"))?;
        match mode {
            Mode::Busy => stream
                .set_nonblocking(true)
                .map_err(io("set non-blocking"))?,
            Mode::Event => stream
                .set_read_timeout(Some(stall))
                .map_err(io("set read timeout"))?,
        }
        Ok(BaselineSocket {
            stream,
            mode,
            stall,
        })
    }

    /// Accept one connection on `listener`, giving up after `stall`.
    pub fn accept(listener: &TcpListener, mode: Mode, stall: Duration) -> Result<Self> {
        listener
            .set_nonblocking(true)
            .map_err(io("configure listener"))?;
        let deadline = Instant::now() + stall;
        loop {
            match listener.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false).map_err(io("configure socket"))?;
                    return Self::new(s, mode, stall);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        return Err(PerfError::Stalled(
                            stall,
                            "waiting for the baseline connection",
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(io("accept")(e)),
            }
        }
    }

    fn read_full(&mut self, buf: &mut [u8]) -> Result<()> {
        let mut got = 0;
        let mut spins = 0u32;
        let mut since: Option<Instant> = None;
        while got < buf.len() {
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => return Err(PerfError::PeerClosed("during the TCP baseline")),
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock && self.mode == Mode::Busy => {
                    spins = spins.wrapping_add(1);
                    if spins % 4096 == 0 {
                        let now = Instant::now();
                        let start = *since.get_or_insert(now);
                        if now.duration_since(start) > self.stall {
                            return Err(PerfError::Stalled(
                                self.stall,
                                "reading the baseline echo",
                            ));
                        }
                        std::thread::yield_now();
                    } else if super::affinity::one_cpu() {
                        std::thread::yield_now();
                    }
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(PerfError::Stalled(self.stall, "reading the baseline echo"))
                }
                Err(e) => return Err(io("read")(e)),
            }
        }
        Ok(())
    }

    fn write_full(&mut self, buf: &[u8]) -> Result<()> {
        let mut sent = 0;
        let mut spins = 0u32;
        let mut since: Option<Instant> = None;
        while sent < buf.len() {
            match self.stream.write(&buf[sent..]) {
                Ok(0) => return Err(PerfError::PeerClosed("during the TCP baseline")),
                Ok(n) => sent += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    // Socket buffer full: let the kernel (and the reader) run now and then.
                    spins = spins.wrapping_add(1);
                    if spins % 64 == 0 {
                        let now = Instant::now();
                        let start = *since.get_or_insert(now);
                        if now.duration_since(start) > self.stall {
                            return Err(PerfError::Stalled(self.stall, "writing the baseline"));
                        }
                        std::thread::yield_now();
                    }
                }
                Err(e) => return Err(io("write")(e)),
            }
        }
        Ok(())
    }
}

/// Client: time `warmup + iters` round trips.
pub fn client(sock: &mut BaselineSocket, p: &RunParams, progress: &Progress) -> Result<LatOutcome> {
    let mut hist = new_histogram();
    let mut out = vec![0u8; p.size as usize];
    let mut back = vec![0u8; p.size as usize];
    let mut errors = 0u64;
    for i in 0..p.warmup + p.iters {
        let stamp = (i & 0xff) as u8;
        if let Some(b) = out.last_mut() {
            *b = stamp;
        }
        let t0 = Instant::now();
        sock.write_full(&out)?;
        sock.read_full(&mut back)?;
        if i >= p.warmup {
            let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
            hist.saturating_record(ns.max(1));
        }
        if back.last() != Some(&stamp) {
            errors += 1;
        }
        progress.at(i);
    }
    Ok(LatOutcome {
        rtt_ns: hist,
        errors,
    })
}

/// Server: echo `warmup + iters` messages.
pub fn server(sock: &mut BaselineSocket, p: &RunParams) -> Result<u64> {
    let mut buf = vec![0u8; p.size as usize];
    let total = p.warmup + p.iters;
    for _ in 0..total {
        sock.read_full(&mut buf)?;
        sock.write_full(&buf)?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::perf::TestKind;

    #[test]
    fn baseline_ping_pong_over_loopback() {
        for mode in [Mode::Busy, Mode::Event] {
            let p = RunParams {
                test: TestKind::TcpLat,
                size: 64,
                iters: 50,
                warmup: 5,
                mode,
                tx_depth: 1,
                rx_depth: 1,
            };
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = listener.local_addr().expect("addr");
            let sp = p.clone();
            let t = std::thread::spawn(move || {
                let mut s = BaselineSocket::accept(&listener, sp.mode, Duration::from_secs(30))
                    .expect("accept");
                server(&mut s, &sp).expect("serve")
            });
            let stream = TcpStream::connect(addr).expect("connect");
            let mut c = BaselineSocket::new(stream, mode, Duration::from_secs(30)).expect("socket");
            let out = client(&mut c, &p, &Progress::off()).expect("client");
            assert_eq!(out.rtt_ns.len(), 50);
            assert_eq!(out.errors, 0);
            assert_eq!(t.join().expect("join"), 55);
        }
    }
}
