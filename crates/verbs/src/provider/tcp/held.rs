//! Data connections that no QP owns at the moment: accepted ones that have not yet said which
//! QP they are for, and used ones kept for the next connection between the same two contexts.
//!
//! Owns: each such connection's reading state (what it still has to skip, a HELLO being
//! assembled), its deadline, and the rule of when a used connection is clean. Does not own:
//! the epoll registration and the table of them ([`super::engine`]), nor how a QP lets go of
//! a connection ([`super::qp`]).
//!
//! A connection outlives the QP pair that used it when both ends leave it cleanly. A QP that
//! lets go of a healthy connection (RESET, ERROR by a modify, or the peer's BYE) with nothing
//! half-read or half-written sends a BYE frame and writes nothing more; the connection is
//! **clean** at one end once that end has sent its BYE and read the peer's: every byte after
//! belongs to the connection's next use. Until then its reader skips the old frames.
//!
//! - The end that opened the connection keeps it for the QP that opened it ([`Owner::Opened`]);
//!   the accepting end keeps it for the next connection of that QP ([`Owner::Accepted`] with
//!   its `opener`) to any QP of this context. When the two QPs (the opener from a cache) are
//!   connected again, the connection carries the new use — no TCP handshake, no accept and
//!   fewer system calls on both sides. A new QP always opens its own connection.
//! - At RTR a QP reads the kept connection; if the peer's HELLO for this pair is there, it takes
//!   the connection without writing one. Else an accepting QP takes it and owes its HELLO,
//!   written in front of its first frame unless the peer speaks first (its endpoint meanwhile
//!   names the connection); an opening QP given that endpoint takes it without a HELLO too, and
//!   one given none writes its own. If both write, each skips the other's as the first frame
//!   of the use.
//! - A clean kept connection is not watched for input, only for the peer closing: nothing is
//!   read from it until a QP reaches RTR on it, so a HELLO written to it wakes no thread. Except
//!   on the accepting end when a QP reached RTR towards its opener before the connection was
//!   kept (another QP here still used it): that QP's RTR found nothing, so the connection stays
//!   watched and the opener's HELLO is read and handed over as on a new connection.
//! - The opening end that finds its kept connection not clean at RTR (the peer's BYE still on
//!   the way) gives it up and opens a new one. If the accepting end wrote its HELLO on it
//!   first, its QP sees the connection closed — or the new connection's HELLO — before any
//!   frame of the use came over it, and takes the new connection instead of failing,
//!   sending again what it had posted (`TcpQp::leave_unused_kept`).
//! - Bytes where none may be (anything on an opened connection once clean, a frame longer
//!   than the limit), the peer closing, a read error or the deadline close the connection;
//!   the next connect then opens a new one.

use std::io::Read;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::data_conn::DataConn;
use super::qp::HelloIds;
use crate::soft::wire::{self, Opcode};

/// An accepted connection must send its HELLO within this time.
pub(super) const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// The opening end keeps a used connection this long for its QP's next connection.
pub(super) const OPENED_IDLE: Duration = Duration::from_secs(30);
/// The accepting end keeps a used connection this long for its next HELLO: longer than the
/// opening end keeps it, so that the end which decides to reuse it closes it first.
const ACCEPTED_IDLE: Duration = Duration::from_secs(60);
/// The accepting end starts the next use of a connection (writes its HELLO first) only while
/// it has been idle for less than this, well within [`OPENED_IDLE`]: the opening end, which
/// closes it after that, still keeps it when its own RTR follows.
pub(super) const ACCEPTED_REUSE: Duration = Duration::from_secs(15);
/// Length of a HELLO frame.
const HELLO_LEN: usize = wire::HEADER_LEN + 16;
/// Largest frame a draining reader skips (longer: the connection is closed).
const MAX_SKIPPED_FRAME: usize = wire::DEFAULT_MAX_PAYLOAD + wire::HEADER_LEN + 32;
/// Reads per [`Held::read`].
const MAX_READS: usize = 16;

/// Who keeps a connection and for what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Owner {
    /// The listener accepted it: it waits for a HELLO naming one of the context's QPs. Once
    /// used, `opener` names the QP at the other end that opened it (the peer's listener and
    /// QP number): the next use is that QP's (`None`: not used yet).
    Accepted { opener: Option<(SocketAddr, u32)> },
    /// QP `qpn` opened it to the listener at `peer`: it waits for that QP's next connection to
    /// a QP there.
    Opened { peer: SocketAddr, qpn: u32 },
}

#[derive(Debug)]
enum Reading {
    /// Skipping the previous use's frames up to and including the peer's BYE.
    ToBye {
        head: [u8; wire::HEADER_LEN],
        got: usize,
        /// Bytes of the current frame's body still to skip.
        skip: usize,
        /// The current frame is the BYE.
        bye: bool,
    },
    /// Clean: a HELLO of the next use is assembled (from the peer that reached RTR first).
    Clean { buf: [u8; HELLO_LEN], got: usize },
}

/// What reading a held connection came to.
#[derive(Debug)]
pub(super) enum Step {
    /// Nothing more to read for now.
    Wait,
    /// A complete HELLO for QP `dst_qpn`.
    Hello { dst_qpn: u32, ids: HelloIds },
    /// Close the connection; the reason is logged when there is one (a peer closing an idle
    /// connection is not worth a line).
    Close(Option<String>),
}

/// A connection held by the context.
#[derive(Debug)]
pub(super) struct Held {
    /// Shared only for a moment: a QP that read the peer's BYE lets go of the connection while
    /// its reader still holds a handle.
    pub stream: Arc<DataConn>,
    pub owner: Owner,
    reading: Reading,
    deadline: Instant,
    /// Accepted and not used yet (it counts against another limit than used ones).
    fresh: bool,
    /// Watched for the peer closing only, not for input (see the module's notes).
    pub quiet: bool,
    /// Since when no QP uses it.
    since: Instant,
    /// Opening end: the peer's HELLO, read before this end's QP reached RTR (it takes it then).
    hello: Option<(u32, HelloIds)>,
}

impl Held {
    /// A connection the listener just accepted.
    pub fn accepted(stream: Arc<DataConn>, now: Instant) -> Held {
        Held {
            stream,
            owner: Owner::Accepted { opener: None },
            reading: Reading::Clean {
                buf: [0; HELLO_LEN],
                got: 0,
            },
            deadline: now + HELLO_TIMEOUT,
            fresh: true,
            quiet: false,
            since: now,
            hello: None,
        }
    }

    /// A connection a QP let go of after sending its BYE; `bye_read`: the peer's BYE was read
    /// already (it was the last frame the QP read), so the connection is clean.
    pub fn released(stream: Arc<DataConn>, owner: Owner, bye_read: bool, now: Instant) -> Held {
        let reading = if bye_read {
            Reading::Clean {
                buf: [0; HELLO_LEN],
                got: 0,
            }
        } else {
            Reading::ToBye {
                head: [0; wire::HEADER_LEN],
                got: 0,
                skip: 0,
                bye: false,
            }
        };
        let idle = match owner {
            Owner::Accepted { .. } => ACCEPTED_IDLE,
            Owner::Opened { .. } => OPENED_IDLE,
        };
        Held {
            stream,
            owner,
            reading,
            deadline: now + idle,
            fresh: false,
            quiet: false,
            since: now,
            hello: None,
        }
    }

    /// Accepting end, used: the QP at the other end that opened it.
    pub fn opener(&self) -> Option<(SocketAddr, u32)> {
        match self.owner {
            Owner::Accepted { opener } if !self.fresh => opener,
            _ => None,
        }
    }

    /// Clean, and a QP reaching RTR finds it (the one that opened it, or one connecting to
    /// that QP): nothing needs to watch it for input until then.
    pub fn may_be_quiet(&self) -> bool {
        let findable = matches!(self.owner, Owner::Opened { .. }) || self.opener().is_some();
        findable && self.is_clean()
    }

    /// How long no QP has used it.
    pub fn idle_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.since)
    }

    /// Accepted and not used yet.
    pub fn is_fresh(&self) -> bool {
        self.fresh
    }

    /// When the context closes it if nothing used it.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Clean, and nothing of a next use read yet: an opened connection can carry a HELLO.
    pub fn is_clean(&self) -> bool {
        matches!(self.reading, Reading::Clean { got: 0, .. }) && self.hello.is_none()
    }

    /// Opening end: keep the peer's HELLO, read before this end's QP reached RTR, for that
    /// RTR ([`Held::read`] returns it then).
    pub fn keep_hello(&mut self, dst_qpn: u32, ids: HelloIds) {
        self.hello = Some((dst_qpn, ids));
    }

    /// Read what the connection has (non-blocking), at most [`MAX_READS`] times: a peer
    /// streaming old frames does not hold the progress thread (epoll reports the rest again).
    pub fn read(&mut self) -> Step {
        if let Some((dst_qpn, ids)) = self.hello.take() {
            return Step::Hello { dst_qpn, ids };
        }
        let mut scratch = [0u8; 16 * 1024];
        for _ in 0..MAX_READS {
            let dst: &mut [u8] = match &mut self.reading {
                Reading::ToBye { skip, .. } if *skip > 0 => {
                    let n = (*skip).min(scratch.len());
                    scratch.get_mut(..n).unwrap_or_default()
                }
                Reading::ToBye { head, got, .. } => head.get_mut(*got..).unwrap_or_default(),
                Reading::Clean { buf, got } => buf.get_mut(*got..).unwrap_or_default(),
            };
            if dst.is_empty() {
                // Unreachable: every state asks for at least one byte.
                return Step::Close(Some("reader state asked for no bytes".into()));
            }
            match (&**self.stream).read(dst) {
                Ok(0) => return Step::Close(None),
                Ok(n) => {
                    if let Some(step) = self.consumed(n) {
                        return step;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Step::Wait,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Step::Close(Some(format!("read failed: {e}"))),
            }
        }
        Step::Wait
    }

    /// `n` bytes were read into what [`Held::read`] asked for.
    fn consumed(&mut self, n: usize) -> Option<Step> {
        match &mut self.reading {
            Reading::ToBye { skip, bye, .. } if *skip > 0 => {
                *skip -= n;
                if *skip == 0 && *bye {
                    self.clean();
                }
                None
            }
            Reading::ToBye {
                head,
                got,
                skip,
                bye,
            } => {
                *got += n;
                if *got < wire::HEADER_LEN {
                    return None;
                }
                let len = wire::peek_len(head).unwrap_or(0);
                if !(wire::HEADER_LEN..=MAX_SKIPPED_FRAME).contains(&len) {
                    return Some(Step::Close(Some(format!(
                        "frame of {len} bytes while draining"
                    ))));
                }
                *bye = head.get(4) == Some(&(Opcode::Bye as u8));
                *skip = len - wire::HEADER_LEN;
                *got = 0;
                if *skip == 0 {
                    // A body-less frame; a BYE has a body, so this one is skipped whole.
                    *bye = false;
                }
                None
            }
            Reading::Clean { buf, got } => {
                *got += n;
                let announced = buf.get(..*got).and_then(wire::peek_len);
                if announced.is_some_and(|len| len != HELLO_LEN) {
                    // Another protocol version, or not a HELLO at all.
                    return Some(Step::Close(Some(format!(
                        "first frame of {announced:?} bytes instead of a HELLO"
                    ))));
                }
                if *got < HELLO_LEN {
                    return None;
                }
                let decoded = wire::decode(buf, 0);
                let hello = decoded
                    .as_ref()
                    .ok()
                    .and_then(|f| f.as_ref())
                    .and_then(|(f, _)| HelloIds::of(f));
                Some(match hello {
                    Some((dst_qpn, ids)) => Step::Hello { dst_qpn, ids },
                    None => Step::Close(Some(format!("bad HELLO: {decoded:?}"))),
                })
            }
        }
    }

    fn clean(&mut self) {
        self.reading = Reading::Clean {
            buf: [0; HELLO_LEN],
            got: 0,
        };
    }
}
