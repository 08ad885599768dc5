//! The blocking edge of the handshake: framed reads and writes on a TCP control stream with a
//! deadline, and the checks applied to a peer's hello. Protocol encoding lives in
//! [`super::wire`]; the sequence of messages lives in [`super::manager`].

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::stream::Stream;
use super::wire::{self, DecodeError, Hello, Message, Reject, RejectCode, VERSION};
use super::ConnError;

/// How much [`Step::read_frames`] takes in its first receive: a hello with its strings is
/// about 200 bytes; a larger frame is completed by exact reads.
const FIRST_READ: usize = 1024;

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

    pub(crate) fn io_error(&self, e: std::io::Error) -> ConnError {
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
    /// Control streams are non-blocking. Hybrid wait: for up to `spin` the socket is polled
    /// with non-blocking receives (no thread sleeps or wakes when the peer answers within it),
    /// then the thread sleeps in `poll` for what is left before the deadline. What has arrived
    /// already (a frame's body behind its prefix, a reply that came while this side was busy)
    /// is taken by the first receive: one system call. The deadline bounds both phases.
    fn read_full(&self, s: &mut Stream, buf: &mut [u8], eof_ok: bool) -> Result<bool, ConnError> {
        Ok(self.read_some(s, buf, buf.len(), eof_ok)?.is_some())
    }

    /// [`Step::read_full`] for at least `min` bytes: what has arrived beyond them, up to
    /// `buf.len()`, is taken by the same receives. The count read, `None` as there.
    fn read_some(
        &self,
        s: &mut Stream,
        buf: &mut [u8],
        min: usize,
        eof_ok: bool,
    ) -> Result<Option<usize>, ConnError> {
        let spin_until = (!self.spin.is_zero()).then(|| Instant::now() + self.spin);
        let mut off = 0;
        while off < min {
            let left = remaining(self.deadline, self.allowed, self.peer, self.phase)?;
            let Some(dst) = buf.get_mut(off..) else { break };
            match rustix::net::recv(&*s, dst, rustix::net::RecvFlags::DONTWAIT) {
                Ok((0, _)) if off == 0 && eof_ok => return Ok(None),
                Ok((0, _)) => {
                    return Err(ConnError::PeerClosed {
                        peer: self.peer,
                        phase: self.phase,
                    })
                }
                Ok((n, _)) => off += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => {
                    if spin_until.is_some_and(|t| Instant::now() < t) {
                        spin_pause();
                    } else {
                        wait_ready(s, rustix::event::PollFlags::IN, left)
                            .map_err(|e| self.io_error(e))?;
                    }
                }
                Err(rustix::io::Errno::CONNRESET) if off == 0 && eof_ok => return Ok(None),
                Err(e) => return Err(self.io_error(e.into())),
            }
        }
        Ok(Some(off))
    }

    /// Read one message. `Ok(None)` only when `eof_ok` and the peer closed cleanly first.
    pub fn read_msg(&self, s: &mut Stream, eof_ok: bool) -> Result<Option<Message>, ConnError> {
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

    /// Read what the peer sent, at least one message, in one receive where it has all arrived
    /// (a frame's prefix and body, or a stray `Close` and the frame behind it) instead of one
    /// receive for the prefix and one for the body. Only for a wait after which the peer sends
    /// nothing more until this side answers — a hello, a hello-ack: bytes behind the awaited
    /// frame are taken too, and the caller says what they mean. `Ok(None)` as for
    /// [`Step::read_msg`].
    pub fn read_frames(
        &self,
        s: &mut Stream,
        eof_ok: bool,
    ) -> Result<Option<Vec<Message>>, ConnError> {
        let mut buf = [0u8; FIRST_READ];
        let Some(got) = self.read_some(s, &mut buf, 1, eof_ok)? else {
            return Ok(None);
        };
        let mut msgs = Vec::with_capacity(1);
        let mut rest = buf.get(..got).unwrap_or_default();
        loop {
            if rest.len() < 4 {
                // The end of what arrived is the start of a frame: the rest of it, exactly.
                let mut prefix = [0u8; 4];
                let (have, missing) = prefix.split_at_mut(rest.len());
                have.copy_from_slice(rest);
                self.read_full(s, missing, false)?;
                msgs.push(self.read_body(s, prefix, &[])?);
                return Ok(Some(msgs));
            }
            let (head, after) = rest.split_at(4);
            let mut prefix = [0u8; 4];
            prefix.copy_from_slice(head);
            let len = wire::frame_len(prefix).map_err(|e| self.decode_error(e))?;
            match (after.get(..len), after.get(len..)) {
                (Some(body), Some(next)) => {
                    msgs.push(wire::decode_body(body).map_err(|e| self.decode_error(e))?);
                    if next.is_empty() {
                        return Ok(Some(msgs));
                    }
                    rest = next;
                }
                _ => {
                    msgs.push(self.read_body(s, prefix, after)?);
                    return Ok(Some(msgs));
                }
            }
        }
    }

    /// [`Step::read_frames`] once what had arrived was read and was not the awaited frame (a
    /// stray `Close` on a kept stream): the receive that took it emptied the socket, so
    /// without a spin budget the thread waits for the stream to be readable before receiving,
    /// instead of a receive that finds nothing first.
    pub fn read_more_frames(
        &self,
        s: &mut Stream,
        eof_ok: bool,
    ) -> Result<Option<Vec<Message>>, ConnError> {
        if self.spin.is_zero() {
            let left = remaining(self.deadline, self.allowed, self.peer, self.phase)?;
            wait_ready(s, rustix::event::PollFlags::IN, left).map_err(|e| self.io_error(e))?;
        }
        self.read_frames(s, eof_ok)
    }

    /// The frame announced by `prefix`, of whose body `have` arrived: the rest is read exactly.
    fn read_body(
        &self,
        s: &mut Stream,
        prefix: [u8; 4],
        have: &[u8],
    ) -> Result<Message, ConnError> {
        let len = wire::frame_len(prefix).map_err(|e| self.decode_error(e))?;
        let mut body = vec![0u8; len];
        let (start, missing) = body.split_at_mut(have.len().min(len));
        start.copy_from_slice(have.get(..start.len()).unwrap_or_default());
        self.read_full(s, missing, false)?;
        wire::decode_body(&body).map_err(|e| self.decode_error(e))
    }

    pub(crate) fn decode_error(&self, e: DecodeError) -> ConnError {
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
    pub fn write_msg(&self, s: &mut Stream, msg: &Message) -> Result<(), ConnError> {
        remaining(self.deadline, self.allowed, self.peer, self.phase)?;
        send_all(s, &wire::encode(msg), self.deadline).map_err(|e| self.io_error(e))
    }
}

/// Sleep until `s` is ready for `flags` or `left` has passed (then the caller's deadline check
/// reports the timeout).
fn wait_ready(s: &Stream, flags: rustix::event::PollFlags, left: Duration) -> std::io::Result<()> {
    let ts = rustix::event::Timespec {
        tv_sec: i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(left.subsec_nanos()),
    };
    let mut fds = [rustix::event::PollFd::new(s, flags)];
    match rustix::event::poll(&mut fds, Some(&ts)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Write all of `bytes` to the non-blocking stream `s`, waiting for room no later than
/// `deadline` (`TimedOut` after it).
pub(crate) fn send_all(s: &Stream, bytes: &[u8], deadline: Instant) -> std::io::Result<()> {
    let mut off = 0;
    while let Some(rest) = bytes.get(off..).filter(|r| !r.is_empty()) {
        match rustix::net::send(
            s,
            rest,
            rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL,
        ) {
            Ok(n) => off += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ErrorKind::TimedOut.into());
                }
                wait_ready(s, rustix::event::PollFlags::OUT, left)?;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Send a rejection, best effort (the peer may be gone already), with a short write timeout.
pub(crate) fn send_reject(s: &mut Stream, code: RejectCode, provider: &str, reason: &str) {
    let msg = Message::Reject(Reject {
        code,
        version: VERSION,
        provider: provider.to_string(),
        reason: reason.to_string(),
    });
    let _ = send_all(
        s,
        &wire::encode(&msg),
        Instant::now() + Duration::from_millis(200),
    );
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

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    use super::*;
    use crate::conn::stream::Stream;

    /// After a read that took only a stray `Close`, the next read waits for the stream (no
    /// spin budget) and returns the frame that comes later; with nothing coming, it ends at
    /// the deadline with a timeout, as a first read does.
    #[test]
    fn a_read_after_a_stray_close_waits_for_the_next_frame() {
        let (ours, mut peer) = UnixStream::pair().expect("socket pair");
        ours.set_nonblocking(true).expect("non-blocking");
        let mut s = Stream::Local(ours);
        let addr: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        let step = Step::new(addr, "hello-ack", Duration::from_secs(5), Duration::ZERO);
        peer.write_all(&wire::encode(&Message::Close))
            .expect("close");
        let first = step.read_frames(&mut s, false).expect("read");
        assert_eq!(first, Some(vec![Message::Close]));
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            peer.write_all(&wire::encode(&Message::Ready))
                .expect("ready");
            peer
        });
        let next = step.read_more_frames(&mut s, false).expect("read more");
        assert_eq!(next, Some(vec![Message::Ready]));
        let _peer = writer.join().expect("writer");
        let short = Step::new(addr, "hello-ack", Duration::from_millis(50), Duration::ZERO);
        match short.read_more_frames(&mut s, false) {
            Err(ConnError::Timeout {
                phase: "hello-ack", ..
            }) => {}
            other => panic!("expected a timeout: {other:?}"),
        }
    }
}
