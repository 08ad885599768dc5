//! The perf control protocol: how a `fabriq perf` client and server agree on a run and swap
//! what their QPs need, over one TCP connection.
//!
//! Frames are a 4-byte big-endian length and a JSON [`Msg`]; frames above [`MAX_FRAME`] are
//! refused before any allocation. One session is
//!
//! ```text
//! client                          server
//!   Hello{version, device}   →
//!                            ←    HelloAck{device, provider}      (or Error)
//!   Run{params}              →                                    (one per message size)
//!                            ←    Ready{endpoint, region}         (or Error)
//!   Connect{endpoint, region}→
//!                            ←    Go                              (server QP at RTS)
//!        … the test runs on the data path …
//!   End                      →
//!                            ←    Report{…}
//!   Bye                      →
//! ```
//!
//! Every parameter travels in `Run`, so a server needs no flags. [`Control`] also offers a
//! non-blocking receive, used by a side that must keep polling its CQ while it waits for `End`.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use fabriq_verbs::QpEndpoint;
use serde::{Deserialize, Serialize};

use super::error::{PerfError, Result};
use super::TestKind;

/// Version of this protocol; both sides must agree.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest control frame accepted from a peer.
pub const MAX_FRAME: usize = 64 * 1024;

/// Busy-poll or sleep on CQ events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Spin on the CQ (and, for write_lat, on memory).
    Busy,
    /// Arm the CQ and sleep on its event fd.
    Event,
}

/// Everything a run needs, sent by the client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunParams {
    /// The test.
    pub test: TestKind,
    /// Message size, bytes.
    pub size: u32,
    /// Measured iterations.
    pub iters: u64,
    /// Unmeasured iterations before them.
    pub warmup: u64,
    /// Completion handling.
    pub mode: Mode,
    /// Outstanding requests of bandwidth tests.
    pub tx_depth: u32,
    /// Receives kept posted by the receiving side.
    pub rx_depth: u32,
}

/// A registered region of the other side: where one-sided operations go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDesc {
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length, bytes.
    pub len: u64,
}

/// What the server measured.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ServerReport {
    /// Messages the server received (send tests) or answered (ping-pong tests).
    pub messages: u64,
    /// Nanoseconds from the first to the last measured message at the server (0 if not
    /// measured there).
    pub elapsed_ns: u64,
    /// Data checks that failed at the server.
    pub errors: u64,
}

/// A control message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Msg {
    /// Client → server: open this device.
    Hello {
        /// Protocol version.
        version: u32,
        /// Device name.
        device: String,
        /// Provider options to open it with (`DeviceConfig::options`).
        #[serde(default)]
        options: BTreeMap<String, String>,
    },
    /// Server → client: device opened.
    HelloAck {
        /// Protocol version.
        version: u32,
        /// Device name.
        device: String,
        /// Its provider.
        provider: String,
        /// The CPU the server is pinned to, if any.
        cpu: Option<usize>,
    },
    /// Client → server: set up one run.
    Run(RunParams),
    /// Server → client: resources ready.
    Ready {
        /// The server's QP (absent for the TCP baseline).
        endpoint: Option<QpEndpoint>,
        /// The server's target region (absent for the TCP baseline).
        region: Option<RegionDesc>,
        /// Port of the TCP baseline's data listener.
        data_port: Option<u16>,
    },
    /// Client → server: the client's QP and region.
    Connect {
        /// Client QP.
        endpoint: QpEndpoint,
        /// Client target region.
        region: RegionDesc,
    },
    /// Server → client: connected, start.
    Go,
    /// Client → server: the client finished the run.
    End,
    /// Server → client: the server's side of the run.
    Report(ServerReport),
    /// Either way: the run failed.
    Error {
        /// What went wrong.
        message: String,
    },
    /// Client → server: session over.
    Bye,
}

impl Msg {
    fn name(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "hello",
            Msg::HelloAck { .. } => "hello_ack",
            Msg::Run(_) => "run",
            Msg::Ready { .. } => "ready",
            Msg::Connect { .. } => "connect",
            Msg::Go => "go",
            Msg::End => "end",
            Msg::Report(_) => "report",
            Msg::Error { .. } => "error",
            Msg::Bye => "bye",
        }
    }

    /// A protocol error saying `self` came where `expected` was due (or the peer's error).
    pub fn unexpected(self, expected: &str) -> PerfError {
        match self {
            Msg::Error { message } => PerfError::Server(message),
            other => PerfError::Protocol(format!("expected {expected}, got {}", other.name())),
        }
    }
}

/// Encode one frame.
pub fn encode(msg: &Msg) -> Result<Vec<u8>> {
    let body = serde_json::to_vec(msg)
        .map_err(|e| PerfError::Protocol(format!("encode {}: {e}", msg.name())))?;
    if body.len() > MAX_FRAME {
        return Err(PerfError::Protocol(format!(
            "{} message of {} bytes exceeds {MAX_FRAME}",
            msg.name(),
            body.len()
        )));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    // body.len() <= MAX_FRAME < u32::MAX
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Try to take one frame off the front of `buf`: `Ok(None)` when it is not complete yet.
pub fn decode(buf: &mut Vec<u8>) -> Result<Option<Msg>> {
    let Some(header) = buf.get(..4) else {
        return Ok(None);
    };
    let mut len = [0u8; 4];
    len.copy_from_slice(header);
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(PerfError::Protocol(format!(
            "frame of {len} bytes exceeds {MAX_FRAME}"
        )));
    }
    let Some(body) = buf.get(4..4 + len) else {
        return Ok(None);
    };
    let msg = serde_json::from_slice(body)
        .map_err(|e| PerfError::Protocol(format!("malformed message: {e}")))?;
    buf.drain(..4 + len);
    Ok(Some(msg))
}

/// One end of the control connection.
#[derive(Debug)]
pub struct Control {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Blocking reads give up after this long.
    timeout: Duration,
}

impl Control {
    /// Wrap a connected stream.
    pub fn new(stream: TcpStream, timeout: Duration) -> Self {
        let _ = stream.set_nodelay(true);
        Control {
            stream,
            buf: Vec::new(),
            timeout,
        }
    }

    /// The local address of the connection.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.stream.local_addr().ok()
    }

    /// Send one message.
    pub fn send(&mut self, msg: &Msg) -> Result<()> {
        let frame = encode(msg)?;
        self.stream
            .set_nonblocking(false)
            .and_then(|_| self.stream.write_all(&frame))
            .and_then(|_| self.stream.flush())
            .map_err(|source| PerfError::Control {
                context: "send",
                source,
            })
    }

    /// Receive one message, waiting up to the connection's timeout.
    pub fn recv(&mut self) -> Result<Msg> {
        if let Some(msg) = decode(&mut self.buf)? {
            return Ok(msg);
        }
        self.stream
            .set_nonblocking(false)
            .and_then(|_| self.stream.set_read_timeout(Some(self.timeout)))
            .map_err(|source| PerfError::Control {
                context: "configure",
                source,
            })?;
        loop {
            match self.fill()? {
                Fill::Data => {
                    if let Some(msg) = decode(&mut self.buf)? {
                        return Ok(msg);
                    }
                }
                Fill::Nothing => {
                    return Err(PerfError::Stalled(
                        self.timeout,
                        "waiting for a control message",
                    ))
                }
            }
        }
    }

    /// Receive a message if one is complete, without blocking.
    pub fn try_recv(&mut self) -> Result<Option<Msg>> {
        if let Some(msg) = decode(&mut self.buf)? {
            return Ok(Some(msg));
        }
        self.stream
            .set_nonblocking(true)
            .map_err(|source| PerfError::Control {
                context: "configure",
                source,
            })?;
        match self.fill()? {
            Fill::Data => decode(&mut self.buf),
            Fill::Nothing => Ok(None),
        }
    }

    /// Wait for `End` (or fail on anything else).
    pub fn expect_end(&mut self) -> Result<()> {
        match self.recv()? {
            Msg::End => Ok(()),
            other => Err(other.unexpected("end")),
        }
    }

    fn fill(&mut self) -> Result<Fill> {
        let mut chunk = [0u8; 4096];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(PerfError::PeerClosed("mid-session")),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    if self.buf.len() > 4 + MAX_FRAME {
                        // A complete frame is decoded as soon as it is whole; more than one
                        // frame's worth unread means the peer is flooding us.
                        return Err(PerfError::Protocol("control peer sent too much".into()));
                    }
                    return Ok(Fill::Data);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Ok(Fill::Nothing)
                }
                Err(source) => {
                    return Err(PerfError::Control {
                        context: "receive",
                        source,
                    })
                }
            }
        }
    }
}

enum Fill {
    Data,
    Nothing,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> RunParams {
        RunParams {
            test: TestKind::SendLat,
            size: 8,
            iters: 10,
            warmup: 1,
            mode: Mode::Busy,
            tx_depth: 16,
            rx_depth: 32,
        }
    }

    #[test]
    fn frames_round_trip_and_split_anywhere() {
        let msgs = vec![
            Msg::Hello {
                version: PROTOCOL_VERSION,
                device: "shm0".into(),
                options: BTreeMap::from([("progress".into(), "busy".into())]),
            },
            Msg::Run(params()),
            Msg::Report(ServerReport {
                messages: 5,
                elapsed_ns: 7,
                errors: 0,
            }),
            Msg::Bye,
        ];
        let mut wire = Vec::new();
        for m in &msgs {
            wire.extend(encode(m).expect("encode"));
        }
        // Feed byte by byte: nothing is decoded before a frame is whole.
        let mut buf = Vec::new();
        let mut got = Vec::new();
        for b in wire {
            buf.push(b);
            while let Some(m) = decode(&mut buf).expect("decode") {
                got.push(m);
            }
        }
        assert_eq!(got, msgs);
        assert!(buf.is_empty());
    }

    #[test]
    fn oversized_frame_is_refused_before_allocation() {
        let mut buf = ((MAX_FRAME + 1) as u32).to_be_bytes().to_vec();
        assert!(matches!(decode(&mut buf), Err(PerfError::Protocol(_))));
    }

    #[test]
    fn garbage_frame_is_a_protocol_error() {
        let mut buf = 3u32.to_be_bytes().to_vec();
        buf.extend_from_slice(b"{x}");
        assert!(matches!(decode(&mut buf), Err(PerfError::Protocol(_))));
    }

    #[test]
    fn peer_error_becomes_server_error() {
        let e = Msg::Error {
            message: "no such device".into(),
        }
        .unexpected("ready");
        assert!(matches!(e, PerfError::Server(m) if m == "no such device"));
        let e = Msg::Go.unexpected("ready");
        assert!(matches!(e, PerfError::Protocol(_)));
    }

    #[test]
    fn control_over_loopback() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let t = std::thread::spawn(move || {
            let (s, _) = listener.accept().expect("accept");
            let mut c = Control::new(s, Duration::from_secs(10));
            let m = c.recv().expect("recv");
            c.send(&m).expect("echo");
            // The client closes: the next receive reports it.
            matches!(c.recv(), Err(PerfError::PeerClosed(_)))
        });
        let s = TcpStream::connect(addr).expect("connect");
        let mut c = Control::new(s, Duration::from_secs(10));
        assert!(c.try_recv().expect("try_recv").is_none());
        c.send(&Msg::Run(params())).expect("send");
        assert_eq!(c.recv().expect("recv"), Msg::Run(params()));
        drop(c);
        assert!(t.join().expect("join"));
    }
}
