//! A `tcp` queue pair: a [`QpCore`] behind a lock, plus the TCP connection to its peer QP.
//!
//! Two locks, always taken in this order: `rx` (the read side of the connection, its
//! reassembly buffer and a payload being placed; held by whoever reads the socket: the
//! progress thread or a busy poller) then `side` (the QP core, the write side and its output
//! queue; held by posters too). Posting writes frames straight to the socket from the posting
//! thread; only when the socket buffer is full does the rest wait for socket room (EPOLLOUT on
//! the progress thread, or the next poll of a busy poller).
//!
//! Large payloads are never copied here: output leaves by `sendmsg` straight from registered
//! memory ([`TxQueue::send_to`]); a large SEND, WRITE or READ response still arriving is read
//! by `recv` straight into its destination ([`Placement`]), while everything else is
//! reassembled in the buffer and decoded whole.
//!
//! Incarnations: a QP's incarnation is a number that changes at every RESET (random at
//! creation, then +1, never 0). The endpoint carries it (`extra["incarnation"]`), the HELLO of a
//! data connection names both the connecting QP's incarnation and the one of the target QP it
//! was given at RTR, and the accepting side attaches a connection only to that incarnation and
//! only from the incarnation of the peer named at its own RTR. A connection opened by an
//! earlier incarnation of either QP (a HELLO still unread when both QPs were reset and
//! connected again) is closed instead of being taken for the new one.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use super::data_conn::DataConn;
use super::engine::{Engine, ProgressMode, BUSY_GRACE};
use super::held::Owner;
use super::PROVIDER;
use crate::soft::qp::{QpCore, Transition};
use crate::soft::qp_ops::SoftQpDriver;
use crate::soft::qp_setup::{new_qp, rtr_remote, QpHome, QpResources};
use crate::soft::qp_table::TimedQp;
use crate::soft::responder::Placement;
use crate::soft::tx::TxQueue;
use crate::soft::wire::{self, Frame, DEFAULT_MAX_PAYLOAD};
use crate::{
    PostError, QpAttr, QpEndpoint, QpInitAttr, QpNum, QpState, Result, SendWr, VerbsError,
};

/// Initial size of the reassembly buffer, and the least free room a read is given.
const RX_CHUNK: usize = 64 * 1024;
/// Largest frame accepted.
const MAX_FRAME: usize = DEFAULT_MAX_PAYLOAD + wire::HEADER_LEN + 32;
/// Reads per `drive_rx` call, so one busy connection cannot starve the others.
const MAX_READS_PER_DRIVE: usize = 16;
/// SEND/WRITE/READ-response payloads from this size on that have not all arrived in one read
/// are received straight into their destination (see [`Placement`]) instead of the
/// reassembly buffer.
const PLACE_MIN: usize = 16 * 1024;
/// After a placed frame, the next read takes only this much (the longest frame head), so the
/// payload of a following large frame goes straight to its destination, not through the
/// buffer; a complete small frame in that read switches back to full reads.
const HEAD_PEEK: usize = wire::HEADER_LEN + 16;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Busy mode: how long a lone ACK may wait for a request to ride along with.
const ACK_HOLD: Duration = Duration::from_micros(100);
/// The endpoint key naming the QP's incarnation.
pub(crate) const INCARNATION_KEY: &str = "incarnation";
/// The endpoint key of an accepting QP that took a kept connection at RTR without a HELLO:
/// the address that connection's opening end has (its local address), so that the opening
/// QP, reading the endpoint for its own RTR, takes the connection without one too.
pub(crate) const KEPT_FROM_KEY: &str = "kept_from";
/// The endpoint key of a QP that reached RTR first ([`QpAttr::rtr_before_peer`]): it accepts
/// the data connection, and its peer opens it.
pub(crate) const FIRST_KEY: &str = "rtr_first";
/// Accepted connections kept for a QP that has not reached RTR yet, at most.
const MAX_PARKED: usize = 4;

/// An accepted connection waiting for its QP to reach RTR.
struct Parked {
    src_qpn: u32,
    src_incarnation: u32,
    stream: Arc<DataConn>,
}

/// A connection a QP takes.
struct Attached {
    stream: Arc<DataConn>,
    /// The listener this QP opened it to (else it was accepted).
    opened_to: Option<SocketAddr>,
    /// In the engine's epoll set already.
    watched: bool,
    /// A kept connection this QP wrote its HELLO on: the peer's HELLO may come first (both
    /// reached RTR before either arrived), and is skipped.
    hello_due: bool,
    /// A kept connection this QP took without a HELLO either way: it writes one before its
    /// first frame if the peer has said nothing by then ([`Side::hello_owed`]).
    hello_owed: bool,
}

/// What the HELLO of an accepted connection says about both ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HelloIds {
    pub src_qpn: u32,
    pub src_incarnation: u32,
    /// 0: the connecting QP did not know this QP's incarnation.
    pub dst_incarnation: u32,
}

impl HelloIds {
    /// The QP a HELLO of this protocol version is for, and what it says of both ends; `None`
    /// for any other frame.
    pub(crate) fn of(frame: &Frame<'_>) -> Option<(u32, HelloIds)> {
        match *frame {
            Frame::Hello {
                dst_qpn,
                src_qpn,
                version,
                src_incarnation,
                dst_incarnation,
            } if version == wire::PROTOCOL_VERSION => Some((
                dst_qpn,
                HelloIds {
                    src_qpn,
                    src_incarnation,
                    dst_incarnation,
                },
            )),
            _ => None,
        }
    }
}

/// The incarnation after `i` (never 0, which means "unknown" in a HELLO).
fn next_incarnation(i: u32) -> u32 {
    i.wrapping_add(1).max(1)
}

/// Whether a connection from incarnation `got` may serve a QP that expects `expected` (`None`:
/// the peer's endpoint named no incarnation, so any).
fn incarnation_matches(expected: Option<u32>, got: u32) -> bool {
    match expected {
        Some(i) => i == got,
        None => true,
    }
}

/// The incarnation a remote endpoint names, if any.
fn remote_incarnation(remote: &QpEndpoint) -> Result<Option<u32>> {
    match remote.extra.get(INCARNATION_KEY) {
        None => Ok(None),
        Some(v) => match v.parse::<u32>() {
            Ok(i) if i != 0 => Ok(Some(i)),
            _ => Err(VerbsError::InvalidArgument(format!(
                "remote endpoint {INCARNATION_KEY} = {v:?}"
            ))),
        },
    }
}

/// The opening end's address of the kept connection a remote endpoint says its QP took
/// without a HELLO ([`KEPT_FROM_KEY`]), if it says so.
fn remote_kept_from(remote: &QpEndpoint) -> Result<Option<SocketAddr>> {
    match remote.extra.get(KEPT_FROM_KEY) {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| {
            VerbsError::InvalidArgument(format!("remote endpoint {KEPT_FROM_KEY} = {v:?}"))
        }),
    }
}

/// Whether a remote endpoint says its QP reached RTR first ([`FIRST_KEY`]).
fn remote_first(remote: &QpEndpoint) -> Result<bool> {
    match remote.extra.get(FIRST_KEY).map(String::as_str) {
        None => Ok(false),
        Some("1") => Ok(true),
        Some(v) => Err(VerbsError::InvalidArgument(format!(
            "remote endpoint {FIRST_KEY} = {v:?}"
        ))),
    }
}

/// How `drive_rx` takes the read lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lock {
    /// Wait for it (progress thread: it must not lose an edge).
    Wait,
    /// Skip if someone else is reading (busy poller).
    Try,
}

struct Side {
    core: QpCore,
    conn: Option<Arc<DataConn>>,
    /// The listener `conn` was opened to, when this QP opened it (else it was accepted).
    opened_to: Option<SocketAddr>,
    /// Accepted connections for this incarnation that arrived before it knew its peer.
    parked: Vec<Parked>,
    /// This QP's incarnation.
    incarnation: u32,
    /// The peer's incarnation named at RTR (`None`: its endpoint named none).
    remote_incarnation: Option<u32>,
    /// The peer's listener, as named at RTR.
    remote_addr: Option<SocketAddr>,
    tx: TxQueue,
    out_armed: bool,
    /// Busy mode: `tx` holds only a coalesced ACK, unsent since then (it leaves with the next
    /// request, or after [`ACK_HOLD`]).
    held_at: Option<Instant>,
    /// This QP wrote the HELLO of the use on a kept connection and nothing of the peer has
    /// come over it yet: the first frame may be the peer's HELLO, skipped (see
    /// [`Attached::hello_due`]); and, on the accepting end, the peer may give the connection up
    /// unused ([`TcpQp::leave_unused_kept`]).
    hello_due: bool,
    /// Accepting end: this QP took the kept connection at RTR without writing a HELLO. Until
    /// the peer's first frame arrives, whatever this QP writes first on it is preceded by the
    /// HELLO, so that a peer that has not reached RTR yet finds it there as before; the
    /// endpoint meanwhile names the connection ([`KEPT_FROM_KEY`]), so that a peer reading
    /// it takes the connection without a HELLO too.
    hello_owed: bool,
    /// This incarnation reached RTR first ([`QpAttr::rtr_before_peer`]): the endpoint says so
    /// ([`FIRST_KEY`]).
    first: bool,
}

impl Side {
    /// Accepting end, on a kept connection the peer has not used yet (see `hello_due`).
    fn kept_unconfirmed(&self) -> bool {
        self.hello_due && self.opened_to.is_none()
    }
}

struct Rx {
    conn: Option<Arc<DataConn>>,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// The payload of the frame at the head of the stream, being received straight into its
    /// destination; nothing else is read until it is complete.
    placing: Option<Placement>,
    /// Where the rest of a placement whose memory was deregistered meanwhile is read and
    /// dropped.
    scratch: Vec<u8>,
    /// The last frame was placed: read only [`HEAD_PEEK`] bytes into an empty buffer.
    peek_next: bool,
    /// `SO_RCVLOWAT` of the connection as last set (1: the kernel's default).
    lowat: usize,
}

impl Rx {
    /// Forget the connection's input (RESET, ERROR, a new connection), giving up a placement.
    fn reset(&mut self, core: &mut QpCore) {
        if let Some(p) = self.placing.take() {
            core.abandon_placement(p);
        }
        self.start = 0;
        self.end = 0;
        self.peek_next = false;
        self.lowat = 1;
    }

    /// While a payload is placed, let readiness wait for a larger piece of it (at most what
    /// is left, so the end of the payload always wakes the reader); back to 1 byte after.
    fn tune_lowat(&mut self, stream: &TcpStream) {
        let want = match &self.placing {
            Some(p) => p.remaining().clamp(1, LOWAT_MAX),
            None => 1,
        };
        let set = match &self.placing {
            Some(_) => self.lowat == 1 || self.lowat > want,
            None => self.lowat != 1,
        };
        if set && crate::soft::poller::set_rcvlowat(stream.as_fd(), want).is_ok() {
            self.lowat = want;
        }
    }
}

/// Largest `SO_RCVLOWAT` set while a payload is placed.
const LOWAT_MAX: usize = 256 * 1024;

/// A QP of the `tcp` provider.
pub(crate) struct TcpQp {
    qp_num: QpNum,
    endpoint: QpEndpoint,
    engine: Arc<Engine>,
    rx: Mutex<Rx>,
    side: Mutex<Side>,
    /// Mirrors `Side::held_at.is_some()` so pollers can skip the lock.
    ack_held: AtomicBool,
}

impl TcpQp {
    pub fn create(
        engine: &Arc<Engine>,
        init: &QpInitAttr<'_>,
        res: QpResources,
    ) -> Result<Arc<TcpQp>> {
        let qpn = engine.qps.alloc_qpn();
        let home = QpHome {
            provider: PROVIDER,
            device: &engine.device.name,
            address: engine.local_addr,
            min_ack_timeout: engine.opts.min_ack_timeout,
        };
        let (core, endpoint) = new_qp(&home, qpn, init, res, Default::default());
        let qp = Arc::new(TcpQp {
            qp_num: QpNum(qpn),
            endpoint,
            engine: engine.clone(),
            rx: Mutex::new(Rx {
                conn: None,
                buf: Vec::new(),
                start: 0,
                end: 0,
                placing: None,
                scratch: Vec::new(),
                peek_next: false,
                lowat: 1,
            }),
            side: Mutex::new(Side {
                core,
                conn: None,
                opened_to: None,
                parked: Vec::new(),
                incarnation: next_incarnation(rand::random::<u32>()),
                remote_incarnation: None,
                remote_addr: None,
                tx: TxQueue::new(),
                out_armed: false,
                held_at: None,
                hello_due: false,
                hello_owed: false,
                first: false,
            }),
            ack_held: AtomicBool::new(false),
        });
        engine.qps.insert(qpn, &qp);
        Ok(qp)
    }

    /// Send what the core allows and what is buffered; close the connection if the QP is in
    /// ERROR; make sure the progress thread wakes for the next deadline.
    fn transmit(&self, side: &mut Side, now: Instant) {
        if side.held_at.take().is_some() {
            self.ack_held.store(false, Ordering::Relaxed);
        }
        if side.conn.is_some() {
            let Side { core, tx, .. } = side;
            core.poll_transmit(now, tx);
            if side.hello_owed && !side.tx.is_empty() {
                side.hello_owed = false;
                let hello = self.hello_of_use(side);
                if !side.tx.prepend(hello) {
                    // Unreachable: nothing of this use was written before the HELLO.
                    side.core
                        .fail("output began before the connection's HELLO".to_string());
                }
            }
            self.flush_tx(side);
        }
        if side.core.state() == QpState::Error {
            close_side(side);
        }
        self.engine.note_deadline(side.core.poll_timeout());
    }

    fn flush_tx(&self, side: &mut Side) {
        let Some(conn) = side.conn.clone() else {
            side.tx.clear();
            return;
        };
        while !side.tx.is_empty() {
            // One sendmsg of up to 64 segments; large payloads straight from registered memory.
            match side.tx.send_to(conn.as_fd()) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if !side.out_armed {
                        side.out_armed = true;
                        self.engine.set_out_interest(self.qp_num.0, &conn, true);
                    }
                    return;
                }
                Err(_) if side.kept_unconfirmed() => {
                    // The peer gave the kept connection up unused: the reader, finding it
                    // closed, lets go of it (`leave_unused_kept`); what was posted goes again
                    // over the peer's new connection.
                    let _ = conn.shutdown(Shutdown::Both);
                    side.tx.clear();
                    return;
                }
                Err(e) => {
                    side.core.fail(format!("send to peer failed: {e}"));
                    close_side(side);
                    return;
                }
            }
        }
        side.tx.shrink();
        if side.out_armed {
            side.out_armed = false;
            self.engine.set_out_interest(self.qp_num.0, &conn, false);
        }
    }

    /// Busy mode: send a held ACK once it waited [`ACK_HOLD`] (or now, with `force`). Returns
    /// whether one is still held.
    pub fn flush_held_ack(&self, now: Instant, force: bool) -> bool {
        if !self.ack_held.load(Ordering::Relaxed) {
            return false;
        }
        let mut side = self.side.lock();
        match side.held_at {
            Some(t) if force || now.saturating_duration_since(t) >= ACK_HOLD => {
                self.transmit(&mut side, now);
                false
            }
            Some(_) => true,
            None => {
                self.ack_held.store(false, Ordering::Relaxed);
                false
            }
        }
    }

    /// The socket has room again (an EPOLLOUT event; the interest stays until the output is
    /// all written).
    pub fn flush_out(&self) {
        let mut side = self.side.lock();
        self.transmit(&mut side, Instant::now());
    }

    /// Read what the connection has, feed the frames to the core, answer.
    pub fn drive_rx(&self, lock: Lock) {
        let mut rx = match lock {
            Lock::Wait => self.rx.lock(),
            Lock::Try => match self.rx.try_lock() {
                Some(g) => g,
                None => return,
            },
        };
        let Some(stream) = rx.conn.clone() else {
            return;
        };
        let mut closed = None;
        for _ in 0..MAX_READS_PER_DRIVE {
            if rx.placing.is_some() {
                let Rx {
                    placing, scratch, ..
                } = &mut *rx;
                let Some(p) = placing.as_mut() else {
                    break;
                };
                match p.recv_from(stream.as_fd(), scratch) {
                    Ok((0, _)) => {
                        closed = Some("peer closed the connection".to_string());
                        break;
                    }
                    Ok((_, full)) => {
                        if p.remaining() == 0 {
                            if !self.process(&mut rx) {
                                return;
                            }
                        } else if !full {
                            break;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        closed = Some(format!("read from peer failed: {e}"));
                        break;
                    }
                }
                continue;
            }
            make_room(&mut rx);
            let limit = if rx.peek_next && rx.start == rx.end {
                HEAD_PEEK
            } else {
                usize::MAX
            };
            let Rx { buf, end, .. } = &mut *rx;
            let Some(dst) = buf.get_mut(*end..) else {
                break;
            };
            let take = dst.len().min(limit);
            let Some(dst) = dst.get_mut(..take) else {
                break;
            };
            let room = dst.len();
            match (&**stream).read(dst) {
                Ok(0) => {
                    closed = Some("peer closed the connection".to_string());
                    break;
                }
                Ok(n) => {
                    *end += n;
                    if !self.process(&mut rx) {
                        return;
                    }
                    if n < room {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    closed = Some(format!("read from peer failed: {e}"));
                    break;
                }
            }
        }
        if closed.is_none() {
            rx.tune_lowat(&stream);
        }
        if let Some(reason) = closed {
            let mut side = self.side.lock();
            if let Some(p) = rx.placing.take() {
                side.core.abandon_placement(p);
            }
            // Only the QP's current connection can fail it (not one a RESET already dropped).
            if side.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, &stream)) {
                if side.kept_unconfirmed() {
                    self.leave_unused_kept(&mut rx, &mut side, &reason);
                } else {
                    side.core.fail(reason);
                    close_side(&mut side);
                }
            }
            rx.conn = None;
        }
    }

    /// Decode and handle every complete frame in the buffer. Returns false when the connection
    /// was dropped.
    fn process(&self, rx: &mut MutexGuard<'_, Rx>) -> bool {
        let mut side_guard = self.side.lock();
        let side = &mut *side_guard;
        if side.conn.is_none() {
            // Closed from the posting side (ERROR, RESET): stop reading it.
            rx.reset(&mut side.core);
            rx.conn = None;
            return false;
        }
        let now = Instant::now();
        let mut bad = None;
        let mut bye = false;
        let tx_before = side.tx.len();
        {
            let Rx {
                buf,
                start,
                end,
                placing,
                peek_next,
                ..
            } = &mut **rx;
            // A placed payload that arrived whole completes first: it precedes the buffer.
            if placing.as_ref().is_some_and(|p| p.remaining() == 0) {
                if let Some(p) = placing.take() {
                    let Side { core, tx, .. } = &mut *side;
                    tx.append_with(|out| core.finish_placement(now, p, out));
                    *peek_next = true;
                }
            }
            while let Some(bytes) = buf.get(*start..*end) {
                if placing.is_some() || side.core.state() == QpState::Error {
                    break;
                }
                match wire::decode(bytes, DEFAULT_MAX_PAYLOAD) {
                    Ok(None) => {
                        // A large SEND/WRITE/READ response still arriving: receive the rest of
                        // its payload straight into its destination, if it will execute.
                        if let Ok(Some((head_frame, head, len))) =
                            wire::decode_head(bytes, DEFAULT_MAX_PAYLOAD)
                        {
                            if len >= PLACE_MIN {
                                if let Some(mut p) =
                                    side.core.begin_placement(now, &head_frame, len)
                                {
                                    p.put(bytes.get(head..).unwrap_or(&[]));
                                    *start = *end;
                                    *placing = Some(p);
                                }
                            }
                        }
                        break;
                    }
                    Ok(Some((frame, n))) => {
                        *peek_next = false;
                        let first = std::mem::take(&mut side.hello_due);
                        if first {
                            // The peer took the connection for this use: no HELLO is owed.
                            side.hello_owed = false;
                        }
                        match frame {
                            // Both ends wrote a HELLO on a kept connection: the peer's is
                            // the first frame.
                            Frame::Hello { .. }
                                if first
                                    && HelloIds::of(&frame).is_some_and(|(dst, ids)| {
                                        dst == self.qp_num.0 && from_peer(side, ids)
                                    }) =>
                            {
                                *start += n;
                                continue;
                            }
                            Frame::Hello { .. } => {
                                bad = Some("HELLO inside an established connection".to_string());
                                break;
                            }
                            Frame::Bye { .. } => {
                                // The peer's QP left the connection (reset, or in ERROR).
                                *start += n;
                                bye = true;
                                break;
                            }
                            _ => {}
                        }
                        let Side { core, tx, .. } = &mut *side;
                        core.handle_frame_tx(now, &frame, tx);
                        *start += n;
                        if side.core.state() == QpState::Error {
                            break;
                        }
                    }
                    Err(e) => {
                        bad = Some(format!("malformed frame from peer: {e}"));
                        break;
                    }
                }
            }
        }
        if bye {
            side.core.fail("the peer's QP left the connection");
            if tx_before == 0 {
                // Only what this batch's frames made the core answer waits, none of it sent:
                // it goes nowhere now. Output from before may be partly written (a request
                // cut by a full socket): then `release` gives the connection up.
                side.tx.clear();
            }
            self.release(rx, side, true);
            rx.reset(&mut side.core);
            self.transmit(side, now);
            return false;
        }
        let answered = side.tx.len() > tx_before;
        if let Some(reason) = bad {
            side.core.fail(reason);
        }
        {
            let Side { core, tx, .. } = &mut *side;
            tx.append_with(|out| core.end_batch(out));
        }
        let lone_ack = !answered && side.tx.len() > tx_before;
        if self.engine.mode == ProgressMode::Busy
            && lone_ack
            && (tx_before == 0 || side.held_at.is_some())
            && side.core.state() != QpState::Error
            && !side.core.wants_transmit()
        {
            // Hold the ACK: the application polling this CQ is likely to post a request
            // next, and both then leave in one write.
            if side.held_at.is_none() {
                side.held_at = Some(now);
                self.ack_held.store(true, Ordering::Relaxed);
                // If no poller comes back, the progress thread sends it.
                self.engine.ack_held(self.qp_num.0, now + BUSY_GRACE);
            }
            // The frames may have armed a timer: the thread and pollers look at QP timers only
            // when an announced one is due (see `Engine::note_deadline`).
            self.engine.note_deadline(side.core.poll_timeout());
        } else {
            self.transmit(side, now);
        }
        if side.conn.is_none() {
            rx.conn = None;
            return false;
        }
        true
    }

    /// Run `f` while this QP's connection cannot be read (its reader busy elsewhere).
    #[cfg(test)]
    pub(super) fn with_reader_held<R>(&self, f: impl FnOnce() -> R) -> R {
        let _reader = self.rx.lock();
        f()
    }

    /// The listener accepted a connection whose HELLO names this QP (still in the engine's
    /// epoll set; dropping it closes it, which takes it out of the set).
    pub fn accept_incoming(&self, hello: HelloIds, stream: Arc<DataConn>) {
        let mut rx = self.rx.lock();
        let mut side = self.side.lock();
        let src_qpn = hello.src_qpn;
        if hello.dst_incarnation != 0 && hello.dst_incarnation != side.incarnation {
            // Opened towards an earlier incarnation of this QP (reset since).
            tracing::debug!(
                qp = self.qp_num.0,
                src_qpn,
                incarnation = side.incarnation,
                hello_incarnation = hello.dst_incarnation,
                "tcp0: connection for an earlier incarnation of the QP; closed"
            );
            return;
        }
        let state = side.core.state();
        if state != QpState::Error && side.kept_unconfirmed() && from_peer(&side, hello) {
            // The peer gave up the kept connection this QP wrote its HELLO on, and opened this
            // one instead.
            self.leave_unused_kept(&mut rx, &mut side, "the peer opened a new connection");
        }
        if state == QpState::Error || side.conn.is_some() {
            tracing::warn!(
                qp = self.qp_num.0,
                src_qpn,
                ?state,
                "tcp0: connection for a QP that is connected or in ERROR; closed"
            );
            return;
        }
        match side.core.remote().map(|r| r.qp_num.0) {
            Some(_) if from_peer(&side, hello) => {
                let a = Attached {
                    stream,
                    opened_to: None,
                    watched: true,
                    hello_due: false,
                    hello_owed: false,
                };
                self.attach(&mut rx, &mut side, a);
            }
            Some(remote) => tracing::warn!(
                qp = self.qp_num.0,
                src_qpn,
                src_incarnation = hello.src_incarnation,
                remote,
                remote_incarnation = ?side.remote_incarnation,
                "tcp0: connection from a QP (or incarnation) other than the peer; closed"
            ),
            None => {
                if side.parked.len() >= MAX_PARKED {
                    side.parked.remove(0);
                }
                // Unread until RTR: out of the epoll set meanwhile.
                self.engine.unwatch(&stream);
                side.parked.push(Parked {
                    src_qpn,
                    src_incarnation: hello.src_incarnation,
                    stream,
                });
            }
        }
    }

    /// Accepting end: the peer gave up the kept connection this QP wrote the HELLO of the use
    /// on before anything of the use came over it — it found the connection not clean at its
    /// own RTR (the last use's BYE still on the way) and opens a new one. Let go of it without
    /// failing: the peer's new connection is attached as any accepted one, and what was posted
    /// meanwhile, none of which the peer read, is sent again over it.
    fn leave_unused_kept(&self, rx: &mut Rx, side: &mut Side, why: &str) {
        tracing::debug!(
            qp = self.qp_num.0,
            why,
            "tcp0: the peer gave up the kept connection unused; waiting for its new one"
        );
        close_side(side);
        rx.conn = None;
        rx.reset(&mut side.core);
        self.ack_held.store(false, Ordering::Relaxed);
        side.core.rewind_requests();
    }

    /// Make `stream` the QP's connection; `opened_to`: the listener this QP opened it to;
    /// `watched`: the engine's epoll set has it already.
    fn attach(&self, rx: &mut Rx, side: &mut Side, a: Attached) {
        let Attached {
            stream,
            opened_to,
            watched,
            hello_due,
            hello_owed,
        } = a;
        let opts = &self.engine.opts;
        // Best effort: a refused size leaves the kernel's autotuning in place.
        if opts.sndbuf > 0 {
            let _ = rustix::net::sockopt::set_socket_send_buffer_size(&stream, opts.sndbuf);
        }
        if opts.rcvbuf > 0 {
            let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&stream, opts.rcvbuf);
        }
        if let Err(e) = self.engine.register_conn(self.qp_num.0, &stream, watched) {
            side.core.fail(format!("cannot watch the connection: {e}"));
            return;
        }
        if opened_to.is_none() {
            if let (Some(addr), Some(r)) = (side.remote_addr, side.core.remote()) {
                self.engine.opener_served(addr, r.qp_num.0);
            }
        }
        rx.conn = Some(stream.clone());
        rx.reset(&mut side.core);
        side.hello_due = hello_due;
        side.hello_owed = hello_owed;
        side.conn = Some(stream);
        side.opened_to = opened_to;
        side.tx.clear();
        side.out_armed = false;
        self.transmit(side, Instant::now());
    }
}

impl TcpQp {
    /// Let go of the connection (RESET, ERROR by a modify, or the peer's BYE, `bye_read`):
    /// when nothing is half-read or half-written on it, send a BYE and hand it to the engine,
    /// which keeps it for a next connection between the two contexts (see
    /// [`super::held`]); otherwise shut it down.
    fn release(&self, rx: &mut Rx, side: &mut Side, bye_read: bool) {
        let Some(conn) = side.conn.take() else {
            close_side(side);
            return;
        };
        rx.conn = None;
        // Nothing half-read, nothing of `tx` sent (empty, or only an ACK held back whole), and
        // the socket's read threshold back at its default for the next use.
        let idle = rx.placing.is_none()
            && rx.start == rx.end
            && (side.tx.is_empty() || side.held_at.is_some())
            && (rx.lowat == 1 || crate::soft::poller::set_rcvlowat(conn.as_fd(), 1).is_ok());
        let opened_to = side.opened_to.take();
        let kept = idle && {
            // A HELLO still owed goes first, so that the peer's end reads the use it ends.
            let mut bye = match side.hello_owed {
                true => self.hello_of_use(side),
                false => Vec::with_capacity(wire::HEADER_LEN + 8),
            };
            wire::encode(
                &Frame::Bye {
                    dst_qpn: side.core.remote().map_or(0, |r| r.qp_num.0),
                    src_qpn: self.qp_num.0,
                    src_incarnation: side.incarnation,
                },
                &mut bye,
            );
            // Nothing waits for socket room: a frame this short is taken whole in practice;
            // anything else gives the connection up.
            matches!((&**conn).write(&bye), Ok(n) if n == bye.len())
        };
        if kept {
            let owner = match opened_to {
                Some(peer) => Owner::Opened {
                    peer,
                    qpn: self.qp_num.0,
                },
                None => Owner::Accepted {
                    opener: side.remote_addr.zip(side.core.remote().map(|r| r.qp_num.0)),
                },
            };
            self.engine.keep_released(conn, owner, bye_read);
        } else {
            let _ = conn.shutdown(Shutdown::Both);
        }
        close_side(side);
    }

    /// The HELLO of this QP's current use of its connection, for the peer named at RTR.
    fn hello_of_use(&self, side: &Side) -> Vec<u8> {
        let dst = side.core.remote().map_or(0, |r| r.qp_num.0);
        hello_frame(
            (dst, side.remote_incarnation.unwrap_or(0)),
            (self.qp_num.0, side.incarnation),
        )
    }
}

/// Whether a HELLO (`ids`) comes from the peer this QP was connected to at RTR and is meant
/// for its current incarnation.
fn from_peer(side: &Side, ids: HelloIds) -> bool {
    side.core
        .remote()
        .is_some_and(|r| hello_is_from(ids, r.qp_num.0, side.remote_incarnation, side.incarnation))
}

/// Whether a HELLO (`ids`) comes from the peer named at RTR (QP `remote_qpn`, incarnation
/// `remote_inc`) and is meant for this incarnation (`mine`) of the QP.
fn hello_is_from(ids: HelloIds, remote_qpn: u32, remote_inc: Option<u32>, mine: u32) -> bool {
    ids.src_qpn == remote_qpn
        && incarnation_matches(remote_inc, ids.src_incarnation)
        && (ids.dst_incarnation == 0 || ids.dst_incarnation == mine)
}

/// Open the connection to the peer's listener and introduce it.
fn connect(addr: SocketAddr, dst: (u32, u32), src: (u32, u32)) -> Result<TcpStream> {
    let mut s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|e| VerbsError::Connect(format!("tcp connect to {addr}: {e}")))?;
    s.set_nodelay(true)
        .map_err(|e| VerbsError::io("set TCP_NODELAY", e))?;
    s.write_all(&hello_frame(dst, src))
        .map_err(|e| VerbsError::Connect(format!("HELLO to {addr}: {e}")))?;
    s.set_nonblocking(true)
        .map_err(|e| VerbsError::io("set non-blocking", e))?;
    Ok(s)
}

/// Send the HELLO of a next use on a clean kept connection (non-blocking: the frame goes
/// whole, or the connection is not used — the socket may still be full of the last use's
/// frames that the other end is skipping).
fn introduce(s: Arc<DataConn>, dst: (u32, u32), src: (u32, u32)) -> std::io::Result<Arc<DataConn>> {
    let hello = hello_frame(dst, src);
    match (&**s).write(&hello) {
        Ok(n) if n == hello.len() => Ok(s),
        Ok(_) => {
            let _ = s.shutdown(Shutdown::Both);
            Err(std::io::ErrorKind::WriteZero.into())
        }
        Err(e) => Err(e),
    }
}

/// The HELLO a connecting QP sends: `dst`/`src` are (QP number, incarnation) of the target
/// and of the sender.
pub(super) fn hello_frame(dst: (u32, u32), src: (u32, u32)) -> Vec<u8> {
    let mut hello = Vec::with_capacity(32);
    wire::encode(
        &Frame::Hello {
            dst_qpn: dst.0,
            src_qpn: src.0,
            version: wire::PROTOCOL_VERSION,
            src_incarnation: src.1,
            dst_incarnation: dst.1,
        },
        &mut hello,
    );
    hello
}

fn close_side(side: &mut Side) {
    if let Some(c) = side.conn.take() {
        let _ = c.shutdown(Shutdown::Both);
    }
    side.parked.clear();
    side.tx.clear();
    side.out_armed = false;
    side.held_at = None;
    side.hello_due = false;
    side.hello_owed = false;
}

/// Ensure the buffer has room for the next read: compact, and grow to hold the frame being
/// reassembled (its length was checked against the limit by the decoder before it is trusted
/// here: a length above [`MAX_FRAME`] fails decoding, so we never grow past it).
fn make_room(rx: &mut Rx) {
    if rx.start == rx.end {
        rx.start = 0;
        rx.end = 0;
        if rx.buf.len() > 16 * RX_CHUNK {
            // Give back the room a large frame needed.
            rx.buf = Vec::new();
        }
    }
    let pending = rx.buf.get(rx.start..rx.end).unwrap_or(&[]);
    let frame_len = wire::peek_len(pending)
        .filter(|&l| l <= MAX_FRAME)
        .unwrap_or(0);
    let need_from_start = frame_len.max(pending.len() + RX_CHUNK);
    if rx.buf.len() - rx.start < need_from_start && rx.start > 0 {
        rx.buf.copy_within(rx.start..rx.end, 0);
        rx.end -= rx.start;
        rx.start = 0;
    }
    if rx.buf.len() - rx.start < need_from_start {
        rx.buf.resize(rx.start + need_from_start, 0);
    }
}

impl Drop for TcpQp {
    fn drop(&mut self) {
        self.engine.qps.remove(self.qp_num.0);
        self.engine.take_opened(None, self.qp_num.0, None);
        if let Some(p) = self.rx.get_mut().placing.take() {
            // A receive taken from an SRQ for a SEND still arriving goes back to the SRQ.
            self.side.get_mut().core.abandon_placement(p);
        }
        if let Some(c) = self.side.get_mut().conn.take() {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

impl TimedQp for TcpQp {
    fn poll_timeout(&self) -> Option<Instant> {
        self.side.lock().core.poll_timeout()
    }

    fn on_timer(&self, now: Instant) {
        let mut side = self.side.lock();
        side.core.handle_timeout(now);
        self.transmit(&mut side, now);
    }
}

impl SoftQpDriver for TcpQp {
    fn advertised(&self) -> &QpEndpoint {
        &self.endpoint
    }

    fn current_endpoint(&self) -> QpEndpoint {
        let (incarnation, psn, kept_from, first) = {
            let side = self.side.lock();
            let kept_from = match (&side.conn, side.hello_owed) {
                (Some(c), true) => c.opener(),
                _ => None,
            };
            (
                side.incarnation,
                side.core.initial_psn(),
                kept_from,
                side.first,
            )
        };
        let mut ep = self.endpoint.clone();
        ep.psn = psn;
        ep.extra
            .insert(INCARNATION_KEY.to_string(), incarnation.to_string());
        if first {
            ep.extra.insert(FIRST_KEY.to_string(), "1".to_string());
        }
        if let Some(a) = kept_from {
            ep.extra.insert(KEPT_FROM_KEY.to_string(), a.to_string());
        }
        ep
    }

    fn with_core<R>(&self, f: impl FnOnce(&mut QpCore) -> R) -> R {
        f(&mut self.side.lock().core)
    }

    fn modify_rtr(&self, attr: &QpAttr) -> Result<()> {
        let incarnation = {
            let side = self.side.lock();
            side.core.state().check_transition(QpState::Rtr)?;
            side.incarnation
        };
        let (remote, raddr) = rtr_remote(attr, PROVIDER)?;
        let remote_inc = remote_incarnation(remote)?;
        // Both ends must order the pair alike to agree on who connects. Bound to every
        // interface, the engine knows its port but not which of its addresses the peer sees:
        // the one the kernel routes towards the peer (the peer resolved ours from our control
        // stream, which takes that route too).
        let local = match self.engine.local_addr {
            a if a.ip().is_unspecified() => {
                source_towards(raddr).map_or(a, |ip| std::net::SocketAddr::new(ip, a.port()))
            }
            a => a,
        };
        let me = (local, self.qp_num.0);
        let peer = (raddr, remote.qp_num.0);
        if me == peer {
            return Err(VerbsError::InvalidArgument(
                "a tcp QP cannot be connected to itself".into(),
            ));
        }
        let dst = (remote.qp_num.0, remote_inc.unwrap_or(0));
        let src = (self.qp_num.0, incarnation);
        // Who opens the data connection: the end that was not first at RTR, when one says it
        // was; else the lower (address, QP number), as both ends order the pair alike.
        let peer_first = remote_first(remote)?;
        if attr.rtr_before_peer && peer_first {
            return Err(VerbsError::InvalidArgument(
                "both ends of the QP pair say they reached RTR first".into(),
            ));
        }
        let opener = match (attr.rtr_before_peer, peer_first) {
            (true, _) => false,
            (false, true) => true,
            (false, false) => me < peer,
        };
        let kept_from = match opener {
            true => remote_kept_from(remote)?,
            false => None,
        };
        // The connection of the pair's last use, kept at both ends: by the opening end for the
        // QP that opened it (reused towards the same peer context only; a QP that accepts now
        // gives its own up), by the accepting end for the peer's next use.
        let opened = self
            .engine
            .take_opened(opener.then_some(raddr), self.qp_num.0, kept_from);
        let kept = match opener {
            true => opened,
            false => self
                .engine
                .take_accepted(raddr, remote.qp_num.0, self.qp_num.0),
        };
        // Its next use starts with the HELLO of the end that reaches RTR first: the peer's,
        // found on it, or this QP's, written now (then the peer's may still follow) — except
        // that an accepting end takes it without writing one (owing it until it writes
        // anything), and an opening end whose peer's endpoint says it took this connection so
        // takes it without one too.
        let kept = kept.and_then(|k| match k.hello {
            Some(ids) if hello_is_from(ids, remote.qp_num.0, remote_inc, incarnation) => {
                self.engine.hellos_found.fetch_add(1, Ordering::Relaxed);
                Some((k.stream, false, false))
            }
            Some(_) => {
                tracing::debug!(
                    qp = self.qp_num.0,
                    "tcp0: kept connection carried a HELLO from another QP or incarnation; closed"
                );
                let _ = k.stream.shutdown(Shutdown::Both);
                None
            }
            None if !opener => {
                self.engine.hellos_spared.fetch_add(1, Ordering::Relaxed);
                Some((k.stream, true, true))
            }
            None if kept_from.is_some() && k.stream.opener() == kept_from => {
                self.engine.hellos_spared.fetch_add(1, Ordering::Relaxed);
                Some((k.stream, true, false))
            }
            None => introduce(k.stream, dst, src).ok().map(|s| (s, true, false)),
        });
        let stream = match (kept, opener) {
            (Some((stream, hello_due, hello_owed)), opener) => {
                if opener {
                    self.engine.conns_reused.fetch_add(1, Ordering::Relaxed);
                }
                Some(Attached {
                    stream,
                    opened_to: opener.then_some(raddr),
                    watched: true,
                    hello_due,
                    hello_owed,
                })
            }
            (None, true) => {
                let s = connect(raddr, dst, src)?;
                self.engine.conns_opened.fetch_add(1, Ordering::Relaxed);
                Some(Attached {
                    stream: Arc::new(DataConn::opened(s)),
                    opened_to: Some(raddr),
                    watched: false,
                    hello_due: false,
                    hello_owed: false,
                })
            }
            (None, false) => None,
        };
        let mut rx = self.rx.lock();
        let mut side = self.side.lock();
        if side.incarnation != incarnation {
            return Err(VerbsError::Connect(
                "QP was reset while it connected".into(),
            ));
        }
        side.core.modify(attr)?;
        side.first = attr.rtr_before_peer;
        side.remote_incarnation = remote_inc;
        side.remote_addr = Some(raddr);
        let parked = std::mem::take(&mut side.parked);
        if let Some(a) = stream {
            if side.conn.is_some() {
                return Err(VerbsError::Connect("QP is already connected".into()));
            }
            self.attach(&mut rx, &mut side, a);
        } else {
            // The latest connection from the peer's incarnation; the others are closed.
            let mut chosen = None;
            for p in parked.into_iter().rev() {
                let from_peer = p.src_qpn == remote.qp_num.0
                    && incarnation_matches(remote_inc, p.src_incarnation);
                if from_peer && chosen.is_none() {
                    chosen = Some(p);
                } else {
                    tracing::debug!(
                        qp = self.qp_num.0,
                        src = p.src_qpn,
                        src_incarnation = p.src_incarnation,
                        "tcp0: parked connection from another QP or incarnation; closed"
                    );
                }
            }
            if let Some(p) = chosen {
                let a = Attached {
                    stream: p.stream,
                    opened_to: None,
                    watched: false,
                    hello_due: false,
                    hello_owed: false,
                };
                self.attach(&mut rx, &mut side, a);
            }
        }
        Ok(())
    }

    fn transition(&self, attr: &QpAttr) -> Result<()> {
        let mut rx = self.rx.lock();
        let mut side = self.side.lock();
        match side.core.modify(attr)? {
            Transition::Reset => {
                self.release(&mut rx, &mut side, false);
                side.incarnation = next_incarnation(side.incarnation);
                side.first = false;
                side.remote_incarnation = None;
                side.remote_addr = None;
                rx.reset(&mut side.core);
            }
            Transition::Error => {
                self.release(&mut rx, &mut side, false);
                rx.reset(&mut side.core);
            }
            Transition::Rts | Transition::None | Transition::Rtr(_) => {
                self.transmit(&mut side, Instant::now())
            }
        }
        Ok(())
    }

    fn send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let mut side = self.side.lock();
        let now = Instant::now();
        let r = side.core.post_send(now, wrs);
        self.transmit(&mut side, now);
        r
    }
}

/// The address this host sends from towards `peer` (a connected UDP socket's local address:
/// the kernel's route lookup; nothing is sent).
fn source_towards(peer: std::net::SocketAddr) -> Option<std::net::IpAddr> {
    let any: std::net::SocketAddr = if peer.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s = std::net::UdpSocket::bind(any).ok()?;
    s.connect(peer).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}
