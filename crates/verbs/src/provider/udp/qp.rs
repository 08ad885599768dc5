//! A `udp` queue pair: a [`QpCore`] and the fabriq-mpath [`Connection`] that carries its frames,
//! behind one lock.
//!
//! Every software-RC frame the core produces (request, response, ACK) becomes one mpath message
//! (`Payload::Bytes`), which mpath splits into packets sprayed over the virtual paths and
//! delivers to the peer reliably, exactly once and in order; each delivered message is one frame
//! for the peer's core. The core's own retransmission timer thus only fires if mpath stalls
//! without failing (a safety net); a peer that stops answering makes mpath fail, which moves the
//! QP to ERROR.
//!
//! The driver loop, [`UdpQp::pump`]: core requests → mpath `send` (a bounded backlog absorbs
//! mpath's `QueueFull`) → mpath `poll_transmit` → the pump's [`TxBatch`]; mpath events →
//! `handle_frame` → responses back into mpath; until nothing moves. Then the batch leaves in as
//! few system calls as the engine can manage (`sendmmsg`, per socket).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fabriq_mpath::{Connection, Event, PathId, Payload, SendError};
use parking_lot::Mutex;

use super::engine::Engine;
use super::sys::TxBatch;
use super::wire::{Header, Kind};
use super::PROVIDER;
use crate::soft::qp::{QpCore, Transition};
use crate::soft::qp_ops::SoftQpDriver;
use crate::soft::qp_setup::{new_qp, rtr_remote, QpHome, QpResources};
use crate::soft::qp_table::TimedQp;
use crate::soft::tx::FrameSink;
use crate::soft::wire::{self, DEFAULT_MAX_PAYLOAD};
use crate::{
    PostError, QpAttr, QpEndpoint, QpInitAttr, QpNum, QpState, Result, SendFlags, SendWr,
    VerbsError,
};

/// Largest frame (one mpath message).
pub(crate) const MAX_FRAME: usize = DEFAULT_MAX_PAYLOAD + wire::HEADER_LEN + 32;
/// Longest a QP in ERROR keeps its connection to deliver what it still owes the peer (a NAK,
/// an ACK) before it closes.
const LINGER: Duration = Duration::from_millis(200);
/// Extra key in the endpoint: the local ports of the virtual-path sockets, comma-separated.
pub(crate) const PORTS_KEY: &str = "udp_ports";

/// A request frame shared with the send queue, handed to mpath without copying.
struct SharedFrame(Arc<Vec<u8>>);

impl AsRef<[u8]> for SharedFrame {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// Collects the request frames `QpCore::poll_transmit` releases.
#[derive(Default)]
struct Frames(Vec<Arc<Vec<u8>>>);

impl FrameSink for Frames {
    fn push_frame(&mut self, frame: &Arc<Vec<u8>>) {
        self.0.push(frame.clone());
    }
}

/// The peer, fixed at RTR.
struct Peer {
    qpn: u32,
    /// Socket address of each of the peer's virtual-path sockets (at least one).
    addrs: Vec<SocketAddr>,
}

struct Side {
    core: QpCore,
    conn: Option<Connection>,
    peer: Option<Peer>,
    /// Frames mpath refused with `QueueFull`, in order, with their synchronise flag.
    backlog: VecDeque<(Bytes, bool)>,
    /// SYNCHRONISE flag of each posted request whose frame has not left yet, in post order.
    sync_flags: VecDeque<bool>,
    /// PSN of the newest request frame handed to mpath (to tell new frames from resends).
    last_request_psn: Option<u32>,
    /// Scratch for core output (responses, ACKs) and for mpath datagrams.
    out: Vec<u8>,
    dgram: Vec<u8>,
    /// Datagrams of the current pump, sent together when it ends.
    tx: TxBatch,
    /// The counters of the last connection, kept when it is dropped.
    last_stats: Option<fabriq_mpath::Stats>,
    /// Our connection's generation ([`generation_of`] our initial PSN at RTR).
    generation: u16,
    /// The peer's connection generation, from the initial PSN of the endpoint given at RTR:
    /// datagrams of another generation (an earlier connection of the same QP pair, before a
    /// RESET, still on the way) are dropped.
    peer_generation: Option<u16>,
    /// In ERROR with the connection still open: when the linger ends.
    closing_at: Option<Instant>,
}

impl Side {
    /// Whether a datagram of generation `g` from the peer belongs to the current connection.
    fn accept_generation(&self, g: u16) -> bool {
        self.peer_generation == Some(g)
    }
}

/// The generation a connection's datagrams carry: the low 16 bits of the sender's initial PSN,
/// which every RESET draws anew (never the same bits twice in a row, `crate::next_psn`) and
/// the endpoint tells the peer before its RTR — so each end knows the exact generation of the
/// peer's current connection, whatever it saw before.
pub(crate) fn generation_of(initial_psn: u32) -> u16 {
    (initial_psn & 0xffff) as u16
}

/// A QP of the `udp` provider.
pub(crate) struct UdpQp {
    qp_num: QpNum,
    endpoint: QpEndpoint,
    engine: Arc<Engine>,
    side: Mutex<Side>,
}

/// `a` is after `b` in 24-bit PSN serial order.
fn psn_after(a: u32, b: u32) -> bool {
    let d = a.wrapping_sub(b) & 0x00ff_ffff;
    d != 0 && d < 0x0080_0000
}

/// Opcode and PSN of a request frame (None for responses and anything short).
fn request_psn(frame: &[u8]) -> Option<u32> {
    let op = *frame.get(4)?;
    if !(0x01..=0x07).contains(&op) {
        return None;
    }
    let psn: [u8; 4] = frame.get(12..16)?.try_into().ok()?;
    Some(u32::from_be_bytes(psn) & 0x00ff_ffff)
}

impl UdpQp {
    pub fn create(
        engine: &Arc<Engine>,
        init: &QpInitAttr<'_>,
        res: QpResources,
    ) -> Result<Arc<UdpQp>> {
        let qpn = engine.qps.alloc_qpn();
        let ports = engine.ports.iter().map(|p| p.to_string());
        let extra = [(PORTS_KEY.to_string(), ports.collect::<Vec<_>>().join(","))].into();
        let home = QpHome {
            provider: PROVIDER,
            device: &engine.device.name,
            address: engine.local_addr,
            min_ack_timeout: engine.opts.min_ack_timeout,
        };
        let (core, endpoint) = new_qp(&home, qpn, init, res, extra);
        let qp = Arc::new(UdpQp {
            qp_num: QpNum(qpn),
            endpoint,
            engine: engine.clone(),
            side: Mutex::new(Side {
                core,
                conn: None,
                peer: None,
                backlog: VecDeque::new(),
                sync_flags: VecDeque::new(),
                last_request_psn: None,
                out: Vec::new(),
                dgram: Vec::with_capacity(2048),
                tx: TxBatch::default(),
                last_stats: None,
                generation: 0,
                peer_generation: None,
                closing_at: None,
            }),
        });
        engine.qps.insert(qpn, &qp);
        Ok(qp)
    }

    pub fn qp_num_raw(&self) -> u32 {
        self.qp_num.0
    }

    fn deadline(&self, side: &Side) -> Option<Instant> {
        let a = side.core.poll_timeout();
        let b = side
            .conn
            .as_ref()
            .and_then(Connection::poll_timeout)
            .map(|t| self.engine.std_instant(t));
        [a, b, side.closing_at].into_iter().flatten().min()
    }

    /// The counters of the current connection, else of the last one.
    pub fn stats(&self) -> Option<fabriq_mpath::Stats> {
        let side = self.side.lock();
        match side.conn.as_ref() {
            Some(c) => Some(c.stats().clone()),
            None => side.last_stats.clone(),
        }
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// A datagram for this QP arrived. Returns true if it was fed to the connection (the caller
    /// then pumps once its batch is read).
    pub fn handle_datagram(
        &self,
        now: Instant,
        h: &Header,
        from: SocketAddr,
        ce: bool,
        body: &[u8],
    ) -> bool {
        let mut side = self.side.lock();
        let Some(peer) = &side.peer else {
            // Not connected yet: mpath on the other side resends.
            return false;
        };
        if peer.qpn != h.src_qpn || peer.addrs.first().map(SocketAddr::ip) != Some(from.ip()) {
            tracing::debug!(qp = self.qp_num.0, %from, src_qpn = h.src_qpn, "udp0: datagram from a stranger dropped");
            return false;
        }
        if !side.accept_generation(h.generation) {
            return false;
        }
        let mnow = self.engine.mpath_now(now);
        let Some(conn) = side.conn.as_mut() else {
            return false;
        };
        if let Err(e) = conn.handle_datagram(mnow, PathId(h.path), ce, body) {
            tracing::debug!(qp = self.qp_num.0, %e, "udp0: malformed mpath datagram ignored");
        }
        true
    }

    /// The peer QP said it left the connection.
    pub fn handle_close(&self, h: &Header, from: SocketAddr) {
        let mut side = self.side.lock();
        let is_peer = side.peer.as_ref().is_some_and(|p| {
            p.qpn == h.src_qpn && p.addrs.first().map(SocketAddr::ip) == Some(from.ip())
        });
        if is_peer && side.conn.is_some() && side.accept_generation(h.generation) {
            side.core.fail("peer QP closed the connection");
            self.pump(&mut side, Instant::now());
        }
    }

    /// Pump after a batch of datagrams.
    pub fn pump_now(&self, now: Instant) {
        let mut side = self.side.lock();
        self.pump(&mut side, now);
    }

    /// Move everything that can move: core → mpath → sockets, mpath events → core.
    fn pump(&self, side: &mut Side, now: Instant) {
        let mnow = self.engine.mpath_now(now);
        loop {
            let mut moved = false;
            if side.conn.is_some() {
                // 1. New requests (and the core's own resends).
                let mut frames = Frames::default();
                side.core.poll_transmit(now, &mut frames);
                for f in frames.0 {
                    let sync = match request_psn(&f) {
                        Some(psn)
                            if side
                                .last_request_psn
                                .map_or(true, |last| psn_after(psn, last)) =>
                        {
                            side.last_request_psn = Some(psn);
                            side.sync_flags.pop_front().unwrap_or(false)
                        }
                        _ => false,
                    };
                    side.backlog
                        .push_back((Bytes::from_owner(SharedFrame(f)), sync));
                }
                // 2. Backlog into mpath.
                moved |= self.feed(side, mnow);
                // 3. Datagrams out.
                if let (Some(conn), Some(peer)) = (side.conn.as_mut(), side.peer.as_ref()) {
                    while let Some(t) = conn.poll_transmit(mnow, &mut side.dgram) {
                        let Some(body) = side.dgram.get(..t.len) else {
                            break;
                        };
                        let vp = t.path.0;
                        let to = peer.addrs[usize::from(vp) % peer.addrs.len()];
                        let h = Header {
                            kind: Kind::Mpath,
                            dst_qpn: peer.qpn,
                            src_qpn: self.qp_num.0,
                            path: vp,
                            generation: side.generation,
                        }
                        .encode();
                        side.tx.push(vp, to, [&h, body]);
                    }
                }
                // 4. Events in.
                let mut got_input = false;
                let mut failed = None;
                while let Some(ev) = side.conn.as_mut().and_then(Connection::poll_event) {
                    match ev {
                        Event::MessageReceived {
                            payload: Payload::Bytes(b),
                            ..
                        } => {
                            got_input = true;
                            moved = true;
                            match wire::decode(&b, DEFAULT_MAX_PAYLOAD) {
                                Ok(Some((frame, n))) if n == b.len() => {
                                    let Side { core, out, .. } = &mut *side;
                                    core.handle_frame(now, &frame, out);
                                }
                                Ok(_) => side.core.fail("mpath message is not exactly one frame"),
                                Err(e) => side.core.fail(format!("malformed frame from peer: {e}")),
                            }
                        }
                        Event::MessageReceived { .. } => {
                            side.core.fail("mpath message without bytes");
                        }
                        Event::MessageAcked(_) => moved |= !side.backlog.is_empty(),
                        Event::Failed(e) => failed = Some(e),
                    }
                }
                if got_input {
                    let Side { core, out, .. } = &mut *side;
                    core.end_batch(out);
                }
                if !side.out.is_empty() {
                    let out = std::mem::take(&mut side.out);
                    let mut rest = &out[..];
                    while let Some(len) = wire::peek_len(rest).filter(|&l| l > 0 && l <= rest.len())
                    {
                        let (frame, tail) = rest.split_at(len);
                        side.backlog
                            .push_back((Bytes::copy_from_slice(frame), false));
                        rest = tail;
                    }
                    side.out = out;
                    side.out.clear();
                    moved = true;
                }
                if let Some(e) = failed {
                    side.core.fail(format!("peer unreachable: {e}"));
                }
            }
            if !moved {
                break;
            }
        }
        self.engine.send_batch(&mut side.tx);
        if side.conn.as_ref().is_some_and(Connection::has_unsent) {
            self.engine.sender_blocked();
        }
        if side.core.state() == QpState::Error && side.conn.is_some() {
            // Deliver what the core still owes the peer (a NAK that explains the error), then
            // leave; a silent peer does not keep the connection past LINGER.
            let closing_at = *side.closing_at.get_or_insert(now + LINGER);
            let idle =
                side.backlog.is_empty() && side.conn.as_ref().is_some_and(Connection::is_idle);
            if idle || now >= closing_at {
                self.close(side);
            }
        }
        self.engine.note_deadline(self.deadline(side));
    }

    /// Hand backlog frames to mpath until it says its queue is full. True if any left.
    fn feed(&self, side: &mut Side, mnow: fabriq_mpath::Instant) -> bool {
        let Some(conn) = side.conn.as_mut() else {
            side.backlog.clear();
            return false;
        };
        let mut fed = false;
        while let Some((b, sync)) = side.backlog.front() {
            match conn.send(mnow, Payload::Bytes(b.clone()), *sync) {
                Ok(_) => {
                    side.backlog.pop_front();
                    fed = true;
                }
                Err(SendError::QueueFull) => break,
                Err(e) => {
                    side.core.fail(format!("mpath refused a frame: {e}"));
                    side.backlog.clear();
                    break;
                }
            }
        }
        fed
    }

    /// Leave the connection: tell the peer (best effort) and drop the mpath state.
    fn close(&self, side: &mut Side) {
        if let Some(conn) = side.conn.as_ref() {
            side.last_stats = Some(conn.stats().clone());
        }
        side.tx.clear();
        if let (Some(_), Some(peer)) = (side.conn.take(), side.peer.as_ref()) {
            let h = Header {
                kind: Kind::Close,
                dst_qpn: peer.qpn,
                src_qpn: self.qp_num.0,
                path: 0,
                generation: side.generation,
            };
            self.engine.send(0, peer.addrs[0], &h, &[]);
        }
        side.backlog.clear();
        side.sync_flags.clear();
        side.closing_at = None;
    }
}

impl Drop for UdpQp {
    fn drop(&mut self) {
        self.engine.qps.remove(self.qp_num.0);
        let mut side = self.side.lock();
        self.close(&mut side);
    }
}

impl TimedQp for UdpQp {
    /// Earliest deadline of the core and the connection.
    fn poll_timeout(&self) -> Option<Instant> {
        let side = self.side.lock();
        self.deadline(&side)
    }

    fn on_timer(&self, now: Instant) {
        let mut side = self.side.lock();
        if let Some(c) = side.conn.as_mut() {
            c.handle_timeout(self.engine.mpath_now(now));
        }
        side.core.handle_timeout(now);
        self.pump(&mut side, now);
    }
}

impl SoftQpDriver for UdpQp {
    fn advertised(&self) -> &QpEndpoint {
        &self.endpoint
    }

    fn with_core<R>(&self, f: impl FnOnce(&mut QpCore) -> R) -> R {
        f(&mut self.side.lock().core)
    }

    fn modify_rtr(&self, attr: &QpAttr) -> Result<()> {
        let (remote, base) = rtr_remote(attr, PROVIDER)?;
        let mut addrs = vec![base];
        if let Some(ports) = remote.extra.get(PORTS_KEY) {
            addrs.clear();
            for p in ports.split(',') {
                let port: u16 = p.trim().parse().map_err(|_| {
                    VerbsError::InvalidArgument(format!("remote {PORTS_KEY} {ports:?}"))
                })?;
                let mut a = base;
                a.set_port(port);
                addrs.push(a);
            }
            if addrs.is_empty() || addrs[0] != base {
                return Err(VerbsError::InvalidArgument(format!(
                    "remote {PORTS_KEY} {ports:?} does not start with the address's port"
                )));
            }
        }
        if base == self.engine.local_addr && remote.qp_num == self.qp_num {
            return Err(VerbsError::InvalidArgument(
                "a udp QP cannot be connected to itself".into(),
            ));
        }
        let mut side = self.side.lock();
        side.core.modify(attr)?;
        let now = Instant::now();
        let mut cfg = self.engine.opts.mpath.clone();
        cfg.seed = rand::random();
        side.conn = Some(Connection::new(cfg, self.engine.mpath_now(now)));
        side.peer = Some(Peer {
            qpn: remote.qp_num.0,
            addrs,
        });
        side.backlog.clear();
        side.sync_flags.clear();
        side.last_request_psn = None;
        side.closing_at = None;
        side.generation = generation_of(side.core.initial_psn());
        side.peer_generation = Some(generation_of(remote.psn));
        self.pump(&mut side, now);
        Ok(())
    }

    fn transition(&self, attr: &QpAttr) -> Result<()> {
        let mut side = self.side.lock();
        match side.core.modify(attr)? {
            Transition::Error => self.pump(&mut side, Instant::now()),
            Transition::Reset => {
                self.close(&mut side);
                side.peer = None;
            }
            Transition::Rts | Transition::None | Transition::Rtr(_) => {
                self.pump(&mut side, Instant::now())
            }
        }
        Ok(())
    }

    fn send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let mut side = self.side.lock();
        let now = Instant::now();
        let r = side.core.post_send(now, wrs);
        let accepted = match &r {
            Ok(()) => wrs.len(),
            Err(e) => e.index.min(wrs.len()),
        };
        for wr in wrs.iter().take(accepted) {
            side.sync_flags
                .push_back(wr.flags.contains(SendFlags::SYNCHRONISE));
        }
        self.pump(&mut side, now);
        r
    }
}
