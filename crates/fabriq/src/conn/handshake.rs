//! The blocking edge of the handshake: framed reads and writes on a TCP control stream with a
//! deadline, and the checks applied to a peer's hello. Protocol encoding lives in
//! [`super::wire`]; the sequence of messages lives in [`super::manager`].

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::wire::{self, DecodeError, Hello, Message, Reject, RejectCode, VERSION};
use super::ConnError;

/// One pause of a handshake's busy-poll loop: give the core away if another thread wants it.
/// On a host with fewer free cores than busy threads the thread being waited for (the peer's
/// side of the handshake, a worker) may need this core; a pure spin would hold it until the
/// budget runs out, and the wait would cost the whole budget instead of a wake-up. With a
/// core to spare, `sched_yield` returns at once.
pub(crate) fn spin_pause() {
    std::thread::yield_now();
}

/// Time left before `deadline`, or a timeout error.
fn remaining(
    deadline: Instant,
    allowed: Duration,
    peer: SocketAddr,
    phase: &'static str,
) -> Result<Duration, ConnError> {
    let now = Instant::now();
    if now >= deadline {
        return Err(ConnError::Timeout {
            peer: Some(peer),
            phase,
            after: allowed,
        });
    }
    Ok(deadline - now)
}

/// A deadline-bounded step on one control stream.
pub(crate) struct Step {
    pub peer: SocketAddr,
    pub phase: &'static str,
    pub deadline: Instant,
    /// The total time allowed, for error messages.
    pub allowed: Duration,
    /// How long each read busy-polls the socket (non-blocking receives) before it blocks;
    /// zero: block at once. See [`super::ConnConfig::handshake_spin`].
    pub spin: Duration,
}

impl Step {
    pub fn new(peer: SocketAddr, phase: &'static str, allowed: Duration, spin: Duration) -> Step {
        Step {
            peer,
            phase,
            deadline: Instant::now() + allowed,
            allowed,
            spin,
        }
    }

    fn io_error(&self, e: std::io::Error) -> ConnError {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => ConnError::Timeout {
                peer: Some(self.peer),
                phase: self.phase,
                after: self.allowed,
            },
            ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe => ConnError::PeerClosed {
                peer: self.peer,
                phase: self.phase,
            },
            _ => ConnError::io(
                format!("control stream to {} ({})", self.peer, self.phase),
                e,
            ),
        }
    }

    /// Fill `buf` completely. `Ok(false)` if the peer closed before sending anything and
    /// `eof_ok` is set (an idle stream the peer let go of).
    ///
    /// Hybrid wait: for up to `spin` the socket is polled with non-blocking receives (no
    /// thread sleeps or wakes when the peer answers within it), then the read blocks with a
    /// timeout of what is left before the deadline. The deadline bounds both phases.
    fn read_full(
        &self,
        s: &mut TcpStream,
        buf: &mut [u8],
        eof_ok: bool,
    ) -> Result<bool, ConnError> {
        let spin_until = (!self.spin.is_zero()).then(|| Instant::now() + self.spin);
        let mut off = 0;
        let mut first_try = true;
        while off < buf.len() {
            let left = remaining(self.deadline, self.allowed, self.peer, self.phase)?;
            let Some(dst) = buf.get_mut(off..) else { break };
            // What has arrived already (a frame's body behind its prefix, a reply that came
            // while this side was busy) is taken without a timeout to set: one system call.
            let spinning = first_try || spin_until.is_some_and(|t| Instant::now() < t);
            first_try = false;
            let got = if spinning {
                rustix::net::recv(&*s, dst, rustix::net::RecvFlags::DONTWAIT)
                    .map(|(n, _)| n)
                    .map_err(std::io::Error::from)
            } else {
                s.set_read_timeout(Some(left))
                    .map_err(|e| ConnError::io("set control stream timeout", e))?;
                s.read(dst)
            };
            match got {
                Ok(0) if off == 0 && eof_ok => return Ok(false),
                Ok(0) => {
                    return Err(ConnError::PeerClosed {
                        peer: self.peer,
                        phase: self.phase,
                    })
                }
                Ok(n) => off += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    if spinning && spin_until.is_some() {
                        spin_pause();
                    }
                }
                Err(e) if e.kind() == ErrorKind::ConnectionReset && off == 0 && eof_ok => {
                    return Ok(false)
                }
                Err(e) => return Err(self.io_error(e)),
            }
        }
        Ok(true)
    }

    /// Read one message. `Ok(None)` only when `eof_ok` and the peer closed cleanly first.
    pub fn read_msg(&self, s: &mut TcpStream, eof_ok: bool) -> Result<Option<Message>, ConnError> {
        let mut prefix = [0u8; 4];
        if !self.read_full(s, &mut prefix, eof_ok)? {
            return Ok(None);
        }
        let len = wire::frame_len(prefix).map_err(|e| self.decode_error(e))?;
        let mut body = vec![0u8; len];
        self.read_full(s, &mut body, false)?;
        wire::decode_body(&body)
            .map(Some)
            .map_err(|e| self.decode_error(e))
    }

    fn decode_error(&self, e: DecodeError) -> ConnError {
        match e {
            DecodeError::UnsupportedVersion(v) => ConnError::VersionMismatch {
                local: VERSION,
                peer: v,
            },
            source => ConnError::Malformed {
                peer: self.peer,
                source,
            },
        }
    }

    /// Write one message.
    ///
    /// A handshake frame fits the socket's send buffer, so it normally leaves in one
    /// non-blocking send; only what does not (a full buffer) waits, bounded by the deadline.
    pub fn write_msg(&self, s: &mut TcpStream, msg: &Message) -> Result<(), ConnError> {
        let left = remaining(self.deadline, self.allowed, self.peer, self.phase)?;
        let frame = wire::encode(msg);
        let sent = loop {
            match rustix::net::send(
                &*s,
                &frame,
                rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
            ) {
                Ok(n) => break n,
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => break 0,
                Err(e) => return Err(self.io_error(e.into())),
            }
        };
        let Some(rest) = frame.get(sent..).filter(|r| !r.is_empty()) else {
            return Ok(());
        };
        s.set_write_timeout(Some(left))
            .map_err(|e| ConnError::io("set control stream timeout", e))?;
        s.write_all(rest)
            .and_then(|()| s.flush())
            .map_err(|e| self.io_error(e))
    }
}

/// Send a rejection, best effort (the peer may be gone already), with a short write timeout.
pub(crate) fn send_reject(s: &mut TcpStream, code: RejectCode, provider: &str, reason: &str) {
    let msg = Message::Reject(Reject {
        code,
        version: VERSION,
        provider: provider.to_string(),
        reason: reason.to_string(),
    });
    let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
    let _ = s.write_all(&wire::encode(&msg));
}

/// The rejection to send for a local handshake error, if the peer should hear one.
pub(crate) fn reject_code_for(err: &ConnError) -> Option<RejectCode> {
    match err {
        ConnError::VersionMismatch { .. } => Some(RejectCode::VersionMismatch),
        ConnError::ProviderMismatch { .. } => Some(RejectCode::ProviderMismatch),
        ConnError::Malformed { .. } | ConnError::Unexpected { .. } => Some(RejectCode::Malformed),
        ConnError::AuthFailed { .. } => Some(RejectCode::AuthFailed),
        ConnError::WrongWorker { .. } => Some(RejectCode::Unavailable),
        ConnError::Rejected { .. }
        | ConnError::PeerClosed { .. }
        | ConnError::Timeout { .. }
        | ConnError::Refused { .. }
        | ConnError::Closed => None,
        _ => Some(RejectCode::Internal),
    }
}

/// The error a received rejection stands for.
pub(crate) fn rejected(peer: SocketAddr, local_provider: &str, r: Reject) -> ConnError {
    match r.code {
        RejectCode::VersionMismatch => ConnError::VersionMismatch {
            local: VERSION,
            peer: r.version,
        },
        RejectCode::ProviderMismatch => ConnError::ProviderMismatch {
            local: local_provider.to_string(),
            peer: r.provider,
        },
        code => ConnError::Rejected {
            peer,
            code,
            reason: r.reason,
        },
    }
}

/// Constant-time comparison of auth tokens.
fn tokens_equal(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Checks every side applies to the peer's hello: same provider, a consistent endpoint, and the
/// auth token when one is configured.
pub(crate) fn check_peer_hello(
    peer_addr: SocketAddr,
    local_provider: &str,
    auth_token: &[u8],
    peer: &Hello,
) -> Result<(), ConnError> {
    if peer.provider != local_provider || peer.endpoint.provider != local_provider {
        return Err(ConnError::ProviderMismatch {
            local: local_provider.to_string(),
            peer: if peer.provider != local_provider {
                peer.provider.clone()
            } else {
                peer.endpoint.provider.clone()
            },
        });
    }
    // Symmetric: each side requires the other to hold the same token when either has one, so
    // the accepting side refuses a connect its peer would refuse after the hello-ack (the
    // accepting side does not wait for the peer's verdict, see `PendingConn::finish_accepting`).
    let either = !auth_token.is_empty() || !peer.auth_token.is_empty();
    if either && !tokens_equal(auth_token, &peer.auth_token) {
        return Err(ConnError::AuthFailed { peer: peer_addr });
    }
    Ok(())
}
