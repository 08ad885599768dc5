//! The sans-IO channel protocol core (STYLE.md §2; ARCHITECTURE.md "The data path of one
//! message"): eager SEND into the peer's receive ring, rendezvous RTS + chunked RDMA READ + FIN,
//! sequence numbers with cumulative piggybacked acks, and credit flow control.
//!
//! It owns every protocol decision and nothing else: it never touches a queue pair, a clock, a
//! thread or registered memory. Input: [`ChannelCore::send`], [`ChannelCore::handle_completion`]
//! (a work completion plus, for receives, the bytes of the slot), [`ChannelCore::handle_buffer`]
//! (a buffer asked for with [`ChannelCore::poll_buffer_request`]), [`ChannelCore::handle_released`]
//! (the application consumed delivered messages) and [`ChannelCore::handle_timeout`]. Output:
//! [`ChannelCore::poll_work_request`] (what to post, in order), [`ChannelCore::poll_timeout`] and
//! [`ChannelCore::poll_event`]. The driver (`driver.rs`) and the test harness (`harness.rs`) are
//! its two users.
//!
//! # Credits (why the peer never sees RNR)
//!
//! Each side pre-posts `rx_slots` receive slots and the peer starts with that many credits. Every
//! frame (data or control) consumes one credit; a slot's credit is returned, piggybacked on the
//! next header, only after the slot was reposted *and* the application released the message that
//! arrived in it — so a slow receiver back-pressures the sender instead of queueing without bound.
//! Two rules keep the scheme live without a ping-pong of lone updates:
//!
//! 1. A frame may use a side's last credit only if it returns at least one credit. Hence in any
//!    quiet state at least one side holds a credit and can return the other's.
//! 2. A lone `Update` is sent only when it returns at least two credits (and the peer is starved
//!    or half the ring is owed), or to deliver an acknowledgement that is due. Receiving an update
//!    makes the receiver owe one credit, so updates cannot answer updates forever.
//!
//! # Ownership of payloads
//!
//! A payload given to [`ChannelCore::send`] stays owned by the core until the peer acknowledged
//! the message (eager) or finished pulling it (rendezvous) and — when its SEND was signaled —
//! the local send completion arrived; it is then handed back in [`Event::SendComplete`]. On a
//! fatal error the core drops what it holds (payload types release their memory on drop).
//!
//! # Selective signaling
//!
//! One SEND in [`ChannelConfig::signal_every`] (at most half the send queue) asks for a
//! completion. Completions of one send queue arrive in posting order, so a signaled SEND's
//! completion frees the send-queue entries and header slots of the unsignaled SENDs before it
//! too. An unsignaled message needs no completion of its own: the peer can acknowledge it (or
//! send FIN for it) only after the local side finished reading its payload.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use fabriq_verbs::{RemoteAddr, Sge, WcOpcode, WcStatus, WorkCompletion};

use super::window::SeqWindow;
use super::wire::{
    self, FrameBody, HeadBuf, MsgHeader, MsgKind, Rts, TraceFlags, TraceHeader, FIN_BODY_LEN,
    HEADER_LEN, RTS_BODY_LEN,
};
use super::ChannelError;

/// A point in time for the core: nanoseconds from an arbitrary zero chosen by the driver (the
/// harness starts at zero; the driver uses the host's monotonic clock so that send timestamps
/// compare across processes of one host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(u64);

impl Instant {
    /// Time zero.
    pub const ZERO: Instant = Instant(0);

    /// From nanoseconds.
    pub fn from_nanos(ns: u64) -> Instant {
        Instant(ns)
    }
    /// As nanoseconds.
    pub fn as_nanos(self) -> u64 {
        self.0
    }
    /// As microseconds.
    pub fn as_micros(self) -> u64 {
        self.0 / 1000
    }
    /// `self + d`, saturating.
    pub fn saturating_add(self, d: Duration) -> Instant {
        Instant(
            self.0
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
    /// `self - earlier`, or zero.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// Protocol thresholds; changeable on a live channel with [`ChannelCore::set_thresholds`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Thresholds {
    /// Payloads up to this many bytes go eagerly; larger ones by rendezvous. Capped by the
    /// peer's receive-slot size.
    pub eager_max: u32,
    /// Bytes per RDMA READ when pulling a rendezvous payload.
    pub chunk_size: u32,
    /// RDMA READs in flight per channel.
    pub reads_in_flight: u32,
}

impl Thresholds {
    /// The profile for a link speed: 25 Gb/s → 2 KiB / 32 KiB, 100 Gb/s → 4 KiB / 64 KiB,
    /// 200 Gb/s and above → 8 KiB / 128 KiB (eager maximum / READ chunk). Unknown (0) → 100.
    pub fn for_link_speed(gbps: u32) -> Thresholds {
        let (eager_max, chunk_size) = match gbps {
            1..=40 => (2 << 10, 32 << 10),
            0 | 41..=150 => (4 << 10, 64 << 10),
            _ => (8 << 10, 128 << 10),
        };
        Thresholds {
            eager_max,
            chunk_size,
            reads_in_flight: 16,
        }
    }
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds::for_link_speed(100)
    }
}

/// Static settings of one channel end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelConfig {
    /// Receive slots this end pre-posts (the peer's initial credits). At least 4.
    pub rx_slots: u32,
    /// Bytes per receive slot, headers included; bounds the largest eager payload the peer
    /// may send us.
    pub rx_slot_size: u32,
    /// Send-queue entries this end may use (SENDs and READs outstanding together).
    pub sq_depth: u32,
    /// Thresholds.
    pub thresholds: Thresholds,
    /// A received message is acknowledged at the latest this long after delivery.
    pub ack_delay: Duration,
    /// Accepted messages waiting for credit before [`ChannelCore::send`] answers
    /// [`ChannelError::WouldBlock`].
    pub max_queued: u32,
    /// Rendezvous messages pulled at the same time (each holds a receive buffer).
    pub max_pulls: u32,
    /// Largest message accepted, in either direction.
    pub max_message_len: u64,
    /// Every this many SENDs one asks for a completion (selective signaling); the others
    /// leave the send queue with it (completions of one send queue arrive in order). An eager
    /// message whose SEND was not signaled is done once the peer acknowledged it. Capped at
    /// half of `sq_depth`; 1 signals every SEND.
    pub signal_every: u32,
}

impl Default for ChannelConfig {
    fn default() -> Self {
        ChannelConfig {
            rx_slots: 64,
            rx_slot_size: (8 << 10) + HEADER_LEN as u32,
            sq_depth: 128,
            thresholds: Thresholds::default(),
            ack_delay: Duration::from_micros(50),
            max_queued: 64,
            max_pulls: 4,
            max_message_len: 4 << 30,
            signal_every: 16,
        }
    }
}

impl ChannelConfig {
    /// The receive ring this configuration posts, as a peer sees it (every slot a credit).
    pub fn ring_geometry(&self) -> PeerGeometry {
        PeerGeometry {
            rx_slots: self.rx_slots,
            rx_slot_size: self.rx_slot_size,
        }
    }

    /// Check internal consistency.
    pub fn validate(&self) -> Result<(), ChannelError> {
        let bad = |what: &str| Err(ChannelError::InvalidConfig(what.to_string()));
        if self.rx_slots < 4 {
            return bad("rx_slots must be at least 4");
        }
        if (self.rx_slot_size as usize) < HEADER_LEN + RTS_BODY_LEN {
            return bad("rx_slot_size must hold the headers and an RTS body");
        }
        if self.sq_depth < 2 {
            return bad("sq_depth must be at least 2");
        }
        if self.thresholds.chunk_size == 0 || self.thresholds.reads_in_flight == 0 {
            return bad("chunk_size and reads_in_flight must be positive");
        }
        if self.max_queued == 0 || self.max_pulls == 0 {
            return bad("max_queued and max_pulls must be positive");
        }
        if self.signal_every == 0 {
            return bad("signal_every must be positive");
        }
        Ok(())
    }
}

/// A peer ring the protocol can work with: room for a few frames, each at least a header and
/// a rendezvous body.
fn check_peer(peer: PeerGeometry) -> Result<(), ChannelError> {
    if peer.rx_slots < 4 || (peer.rx_slot_size as usize) < HEADER_LEN + RTS_BODY_LEN {
        return Err(ChannelError::InvalidConfig(format!(
            "peer ring geometry {peer:?} too small"
        )));
    }
    Ok(())
}

/// What the peer told us about its receive ring at connection time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PeerGeometry {
    /// Slots the peer pre-posted: our initial credits.
    pub rx_slots: u32,
    /// Bytes per slot, headers included.
    pub rx_slot_size: u32,
}

/// A payload to send. Eager sends gather it with [`OutPayload::sge`]; rendezvous sends let the
/// peer READ it at [`OutPayload::remote`].
pub trait OutPayload {
    /// Length in bytes.
    fn len(&self) -> u64;
    /// True for zero bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The payload as one local SGE, if it lies in registered memory and fits in 4 GiB.
    fn sge(&self) -> Option<Sge>;
    /// Where the peer may READ the payload, if its memory allows remote reads.
    fn remote(&self) -> Option<RemoteAddr>;
    /// The payload's bytes when it is small and held in place: framed behind the headers
    /// instead of gathered from registered memory (eager only).
    fn in_place(&self) -> Option<&[u8]> {
        None
    }
}

/// A receive buffer for a rendezvous payload, handed in with [`ChannelCore::handle_buffer`].
pub trait InPayload {
    /// Capacity in bytes.
    fn len(&self) -> u64;
    /// True for zero bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A local SGE for `len` bytes at `offset`, if inside the buffer.
    fn sge(&self, offset: u64, len: u32) -> Option<Sge>;
}

/// Identifies a sent message: its sequence number on this channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MsgId(pub u64);

/// Per-message trace settings given to [`ChannelCore::send`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TraceInfo {
    /// Trace id carried end to end.
    pub trace_id: u64,
    /// Trace flags.
    pub flags: TraceFlags,
    /// Stream of the connection the message belongs to (carried in the message header, opaque
    /// to the core: sequence numbers, acks and credits are the connection's).
    pub stream: u32,
    /// Stream window report carried in the header (opaque to the core).
    pub stream_credits: u32,
}

/// A work request the driver must post, in the order returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkRequest {
    /// Post receive slot `slot` of the local ring.
    Recv {
        /// Id to post with.
        wr_id: u64,
        /// Slot index, `< rx_slots`.
        slot: u32,
    },
    /// Write `head` into local send-header slot `tx_slot`, then post a SEND gathering
    /// [head, payload], signaled when `signaled` says so. An unsignaled SEND must not complete
    /// successfully on its own: its completion is implied by the next signaled one.
    Send {
        /// Id to post with.
        wr_id: u64,
        /// Send-header slot index, `< sq_depth`.
        tx_slot: u32,
        /// Frame prefix.
        head: HeadBuf,
        /// Eager payload, gathered after the head.
        payload: Option<Sge>,
        /// Ask for a completion.
        signaled: bool,
    },
    /// Post a signaled RDMA READ of `remote` into `local`.
    Read {
        /// Id to post with.
        wr_id: u64,
        /// Destination.
        local: Sge,
        /// Source in the peer's memory.
        remote: RemoteAddr,
    },
}

/// The core needs a receive buffer of `len` bytes for a rendezvous message; answer with
/// [`ChannelCore::handle_buffer`] (now or later, when memory is available).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferRequest {
    /// Request id (the message's sequence number).
    pub id: u64,
    /// Bytes needed.
    pub len: u64,
}

/// Bytes of an eager payload copied out of a receive slot: held in place up to
/// [`EAGER_INLINE`] bytes (no allocation for a small message), else on the heap.
pub type EagerBytes = smallvec::SmallVec<[u8; EAGER_INLINE]>;

/// Eager payloads up to this many bytes are held in place once received.
pub const EAGER_INLINE: usize = 24;

/// A delivered payload.
#[derive(Debug)]
pub enum Received<I> {
    /// An eager payload, copied out of the receive slot.
    Eager(EagerBytes),
    /// A rendezvous payload, pulled into the buffer the driver provided.
    Rendezvous {
        /// The buffer.
        buf: I,
        /// Bytes of payload at its start.
        len: u64,
    },
}

impl<I> Received<I> {
    /// Payload length.
    pub fn len(&self) -> u64 {
        match self {
            Received::Eager(v) => v.len() as u64,
            Received::Rendezvous { len, .. } => *len,
        }
    }
    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What happened, for the driver and the application.
#[derive(Debug)]
pub enum Event<O, I> {
    /// A message arrived, in order, once.
    Received {
        /// Its sequence number on this channel.
        seq: u64,
        /// Its trace header.
        trace: TraceHeader,
        /// Its stream (from the message header).
        stream: u32,
        /// Its stream window report (from the message header).
        stream_credits: u32,
        /// The payload.
        payload: Received<I>,
    },
    /// The peer has the message and no longer reads the payload: it is handed back.
    SendComplete {
        /// The message.
        id: MsgId,
        /// Its stream, as given to `send`.
        stream: u32,
        /// Its trace flags, as given to `send`.
        flags: TraceFlags,
        /// The payload given to `send`.
        payload: O,
    },
    /// Room to queue again after [`ChannelError::WouldBlock`].
    Writable,
    /// The channel failed; no more work requests follow.
    Error(ChannelError),
}

/// Counters of one channel end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChannelStats {
    /// Messages accepted by `send`.
    pub msgs_sent: u64,
    /// Messages that left the send queue for the wire (`msgs_posted <= msgs_sent`).
    pub msgs_posted: u64,
    /// Messages delivered.
    pub msgs_received: u64,
    /// Eager messages sent.
    pub eager_sent: u64,
    /// Rendezvous messages sent.
    pub rendezvous_sent: u64,
    /// Payload bytes delivered.
    pub bytes_received: u64,
    /// RDMA READs posted.
    pub reads_posted: u64,
    /// Lone updates (ack / credit) sent.
    pub updates_sent: u64,
    /// FIN frames sent.
    pub fins_sent: u64,
    /// Duplicate data messages dropped.
    pub duplicates_dropped: u64,
    /// Times `send` answered WouldBlock.
    pub would_block: u64,
}

/// First wait before a pull that found no memory asks again ([`ChannelCore::retry_buffer_request`]).
const BUFFER_RETRY_FIRST: Duration = Duration::from_micros(100);
/// Longest wait between two asks of a pull that keeps finding no memory.
const BUFFER_RETRY_MAX: Duration = Duration::from_millis(5);

const WR_KIND_SHIFT: u32 = 56;
const WR_RECV: u64 = 1;
const WR_SEND: u64 = 2;
const WR_READ: u64 = 3;

fn wr_id(kind: u64, index: u64) -> u64 {
    (kind << WR_KIND_SHIFT) | (index & ((1 << WR_KIND_SHIFT) - 1))
}

fn wr_parts(id: u64) -> (u64, u64) {
    (id >> WR_KIND_SHIFT, id & ((1 << WR_KIND_SHIFT) - 1))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TxUse {
    Free,
    Data(u64),
    Control,
    /// Posted without a completion: freed by the next signaled SEND's completion.
    Unsignaled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendKind {
    Eager,
    Rendezvous,
}

struct Queued<O> {
    seq: u64,
    kind: SendKind,
    payload: O,
    trace: TraceInfo,
}

struct Inflight<O> {
    payload: O,
    stream: u32,
    flags: TraceFlags,
    kind: SendKind,
    /// The local SEND completion arrived.
    wc_done: bool,
    /// Acked (eager) or FIN'd / acked (rendezvous).
    peer_done: bool,
}

enum Incoming<I> {
    Ready(Received<I>),
    Pulling {
        rts: Rts,
        buf: Option<I>,
        requested: bool,
        /// Next byte to request; `0 <= done <= next_offset <= rts.total_len`.
        next_offset: u64,
        done: u64,
    },
}

/// What a delivery reports of an arrived message besides its payload.
struct ArrivedHead {
    seq: u64,
    trace: TraceHeader,
    stream: u32,
    stream_credits: u32,
}

struct Arrived<I> {
    head: ArrivedHead,
    state: Incoming<I>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    Failed,
}

/// One end of a channel: the protocol state machine.
pub struct ChannelCore<O, I> {
    config: ChannelConfig,
    peer: PeerGeometry,
    state: State,
    /// Send-queue work requests (SENDs, READs) to post, in order.
    out: VecDeque<WorkRequest>,
    /// Receive slots to post (again): returned after the send-queue work requests, so a reply
    /// is not held up by reposting the slot of the message it answers. A slot's credit goes
    /// back only once it is posted ([`ChannelCore::returnable`]).
    reposts: VecDeque<u32>,
    events: VecDeque<Event<O, I>>,
    /// `SendComplete` events, apart from `events`: [`ChannelCore::poll_event`] hands out
    /// arrivals first, so that a frame that delivers a message and acknowledges sends gives
    /// the waiting reader its message before the sender's bookkeeping
    /// ([`ChannelCore::poll_send_complete`] takes the latter alone).
    completed: VecDeque<Event<O, I>>,
    stats: ChannelStats,

    // ---- send side ----
    /// Next sequence number to assign; sequence numbers start at 1.
    next_seq: u64,
    queued: VecDeque<Queued<O>>,
    inflight: SeqWindow<Inflight<O>>,
    /// Frames we may still send: `0 <= credits <= peer.rx_slots`.
    credits: u32,
    /// Free send-queue entries: `0 <= sq_free <= sq_depth`.
    sq_free: u32,
    tx_free: Vec<u32>,
    tx_use: Vec<TxUse>,
    /// For a signaled send slot: how many unsignaled SENDs before it its completion frees.
    tx_covers: Vec<u32>,
    /// Unsignaled send slots, oldest first, not yet freed by a later completion.
    unsignaled: VecDeque<u32>,
    /// Unsignaled SENDs posted since the last signaled one.
    since_signal: u32,
    /// Highest cumulative ack from the peer: `peer_acked < next_seq`.
    peer_acked: u64,
    was_full: bool,

    // ---- receive side ----
    /// Highest sequence number accepted (arrived) from the peer.
    last_arrived: u64,
    /// Highest sequence number delivered: `delivered <= last_arrived`.
    delivered: u64,
    /// Ack value last sent: `ack_sent <= delivered`.
    ack_sent: u64,
    ack_deadline: Option<Instant>,
    arrived: VecDeque<Arrived<I>>,
    buffer_requests: VecDeque<BufferRequest>,
    /// A pull waits for memory ([`ChannelCore::retry_buffer_request`]): when to ask again, and
    /// the wait before that (doubling from [`BUFFER_RETRY_FIRST`] to [`BUFFER_RETRY_MAX`]
    /// while the driver finds none).
    buffer_retry: Option<(Instant, Duration)>,
    reads: HashMap<u64, (u64, u32)>,
    next_read_token: u64,
    reads_outstanding: u32,
    fins: VecDeque<u64>,
    /// Delivered messages the application still holds.
    held: u64,
    /// Credits to return to the peer (slots reposted and released).
    owed: u32,
    /// Credits ever given to the peer (initial + returned).
    granted_total: u64,
    /// Frames ever received from the peer.
    received_total: u64,

    // ---- after a failure ----
    /// Sent messages a failure ended: a rendezvous source the peer may still be reading, a
    /// posted SEND's payload the provider may still gather. Kept until the core is dropped,
    /// which its worker does once the QP is stopped (ERROR) and drained (`Worker::retire`), or
    /// as the endpoint ends: a buffer given back earlier could carry another message while the
    /// peer still reads this one.
    failed_sends: SeqWindow<Inflight<O>>,
    /// Messages arriving when a failure ended them: the buffers of pulls whose READs may
    /// still be writing into them. Kept as long as `failed_sends`, for the same reason.
    failed_arrivals: VecDeque<Arrived<I>>,
}

impl<O: OutPayload, I: InPayload> ChannelCore<O, I> {
    /// A new channel end. The first work requests it returns post the whole receive ring; the
    /// driver must post them before the peer may send (before completing the handshake).
    pub fn new(config: ChannelConfig, peer: PeerGeometry) -> Result<Self, ChannelError> {
        config.validate()?;
        check_peer(peer)?;
        let reposts = (0..config.rx_slots).collect();
        let sq = config.sq_depth;
        Ok(ChannelCore {
            peer,
            state: State::Open,
            out: VecDeque::new(),
            reposts,
            events: VecDeque::new(),
            completed: VecDeque::new(),
            stats: ChannelStats::default(),
            next_seq: 1,
            queued: VecDeque::new(),
            inflight: SeqWindow::default(),
            credits: peer.rx_slots,
            sq_free: sq,
            tx_free: (0..sq).rev().collect(),
            tx_use: vec![TxUse::Free; sq as usize],
            tx_covers: vec![0; sq as usize],
            unsignaled: VecDeque::new(),
            since_signal: 0,
            peer_acked: 0,
            was_full: false,
            last_arrived: 0,
            delivered: 0,
            ack_sent: 0,
            ack_deadline: None,
            arrived: VecDeque::new(),
            buffer_requests: VecDeque::new(),
            buffer_retry: None,
            reads: HashMap::new(),
            next_read_token: 0,
            reads_outstanding: 0,
            fins: VecDeque::new(),
            held: 0,
            owed: 0,
            granted_total: u64::from(config.rx_slots),
            received_total: 0,
            failed_sends: SeqWindow::default(),
            failed_arrivals: VecDeque::new(),
            config,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &ChannelConfig {
        &self.config
    }

    /// The peer's receive ring, learnt after this end was made (a connecting side posts its
    /// own ring while the peer's hello-ack is on its way). Only before any message went or
    /// came: the peer's geometry sets the credits the first frames spend.
    pub fn set_peer(&mut self, peer: PeerGeometry) -> Result<(), ChannelError> {
        check_peer(peer)?;
        let untouched = self.next_seq == 1
            && self.received_total == 0
            && self.queued.is_empty()
            && self.sq_free == self.config.sq_depth
            && self.credits == self.peer.rx_slots;
        if !untouched {
            return Err(ChannelError::InvalidConfig(
                "the peer's ring geometry changes only before the first message".into(),
            ));
        }
        self.peer = peer;
        self.credits = peer.rx_slots;
        Ok(())
    }

    /// Change thresholds on the live channel; applies to messages sent and pulls started from
    /// now on.
    pub fn set_thresholds(&mut self, t: Thresholds) -> Result<(), ChannelError> {
        if t.chunk_size == 0 || t.reads_in_flight == 0 {
            return Err(ChannelError::InvalidConfig(
                "chunk_size and reads_in_flight must be positive".into(),
            ));
        }
        self.config.thresholds = t;
        Ok(())
    }

    /// Largest payload sent eagerly now.
    pub fn eager_limit(&self) -> u64 {
        let slot_cap = u64::from(self.peer.rx_slot_size).saturating_sub(HEADER_LEN as u64);
        u64::from(self.config.thresholds.eager_max).min(slot_cap)
    }

    /// Counters.
    pub fn stats(&self) -> ChannelStats {
        self.stats
    }

    /// Credits in hand.
    pub fn credits(&self) -> u32 {
        self.credits
    }

    /// True once the channel failed.
    pub fn is_failed(&self) -> bool {
        self.state == State::Failed
    }

    /// True when nothing is queued, in flight or pending on either direction.
    pub fn is_idle(&self) -> bool {
        self.queued.is_empty()
            && self.inflight.is_empty()
            && self.arrived.is_empty()
            && self.fins.is_empty()
            && self.out.is_empty()
            && self.reposts.is_empty()
            && self.reads_outstanding == 0
    }

    /// True when `send` would accept a message now.
    pub fn can_queue(&self) -> bool {
        self.state == State::Open && (self.queued.len() as u32) < self.config.max_queued
    }

    /// Messages accepted but not yet handed back (queued or in flight).
    pub fn outstanding_sends(&self) -> usize {
        self.queued.len() + self.inflight.len()
    }

    /// Messages accepted and not yet framed (waiting for credit or send-queue room).
    pub fn outstanding_queued(&self) -> usize {
        self.queued.len()
    }

    /// Queue a message. Back-pressure answers `WouldBlock` and hands the payload back.
    pub fn send(&mut self, payload: O, trace: TraceInfo) -> Result<MsgId, (ChannelError, O)> {
        if self.state == State::Failed {
            return Err((ChannelError::Closed, payload));
        }
        let len = payload.len();
        if len > self.config.max_message_len {
            return Err((
                ChannelError::MessageTooLarge {
                    len,
                    max: self.config.max_message_len,
                },
                payload,
            ));
        }
        let kind = if len <= self.eager_limit() {
            if len > 0 && payload.sge().is_none() && payload.in_place().is_none() {
                return Err((ChannelError::NotRegistered, payload));
            }
            SendKind::Eager
        } else {
            if payload.remote().is_none() {
                return Err((ChannelError::NotRegistered, payload));
            }
            SendKind::Rendezvous
        };
        if self.queued.len() as u32 >= self.config.max_queued {
            self.was_full = true;
            self.stats.would_block += 1;
            return Err((ChannelError::WouldBlock, payload));
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.stats.msgs_sent += 1;
        self.queued.push_back(Queued {
            seq,
            kind,
            payload,
            trace,
        });
        Ok(MsgId(seq))
    }

    /// The application finished with `n` delivered messages: their slots' credits may return.
    pub fn handle_released(&mut self, n: u64) {
        let n = n.min(self.held);
        self.held -= n;
        self.owed = self
            .owed
            .saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
    }

    /// A buffer for [`BufferRequest`] `id`. A buffer too small, or for an unknown request, is
    /// dropped (released) and the request stays open.
    pub fn handle_buffer(&mut self, id: u64, buf: I) {
        // Memory was found: the next shortage starts its back-off afresh.
        self.buffer_retry = None;
        let Some(a) = self.arrived.iter_mut().find(|a| a.head.seq == id) else {
            return;
        };
        if let Incoming::Pulling {
            rts,
            buf: slot @ None,
            ..
        } = &mut a.state
        {
            if buf.len() >= rts.total_len {
                *slot = Some(buf);
            } else {
                // Too small: dropped (released) here, asked for again.
                self.buffer_requests.push_back(BufferRequest {
                    id,
                    len: rts.total_len,
                });
            }
        }
    }

    /// A buffer request the driver could not serve yet (no memory at `now`): asked again by
    /// the next [`ChannelCore::poll_buffer_request`], and by [`ChannelCore::poll_timeout`] a
    /// little later, doubling while none is found — memory may come back without anything
    /// else for this channel to do (the application dropping messages it held, on its own
    /// thread), and a pull that only waited for the next event could wait for ever.
    pub fn retry_buffer_request(&mut self, now: Instant, req: BufferRequest) {
        self.buffer_requests.push_front(req);
        let wait = match self.buffer_retry {
            Some((_, last)) => (last * 2).min(BUFFER_RETRY_MAX),
            None => BUFFER_RETRY_FIRST,
        };
        self.buffer_retry = Some((now.saturating_add(wait), wait));
    }

    /// A local failure outside the protocol (a refused post, no memory for the ring): the
    /// channel fails as with a bad completion.
    pub fn handle_fatal(&mut self, err: ChannelError) {
        self.fail(err);
    }

    /// A delivered message broke the protocol of the layer above (a stream sent past its
    /// window, say): the channel fails with [`ChannelError::Protocol`], and nothing that
    /// arrived after that message is handed out.
    pub fn handle_violation(&mut self, what: String) {
        self.events.retain(|e| !matches!(e, Event::Received { .. }));
        self.protocol_error(what);
    }

    /// Time passed; spurious calls are harmless.
    pub fn handle_timeout(&mut self, _now: Instant) {
        // Deadlines are checked against `now` in `poll_work_request`.
    }

    /// A completion of one of this channel's work requests. For a receive, `rx` holds the first
    /// `wc.byte_len` bytes of the slot it names.
    pub fn handle_completion(&mut self, now: Instant, wc: &WorkCompletion, rx: &[u8]) {
        if self.state == State::Failed {
            return;
        }
        let (kind, index) = wr_parts(wc.wr_id);
        if wc.status != WcStatus::Success {
            self.fail(ChannelError::Completion {
                opcode: wc.opcode,
                status: wc.status,
            });
            return;
        }
        match kind {
            WR_RECV => self.on_recv(now, index, wc, rx),
            WR_SEND => self.on_send_done(index),
            WR_READ => self.on_read_done(now, index, wc),
            _ => self.fail(ChannelError::Protocol(format!(
                "completion with foreign wr_id {:#x}",
                wc.wr_id
            ))),
        }
    }

    /// Next buffer the core needs for a rendezvous pull.
    pub fn poll_buffer_request(&mut self) -> Option<BufferRequest> {
        if self.state == State::Failed {
            return None;
        }
        if self.arrived.is_empty() {
            return self.buffer_requests.pop_front();
        }
        self.schedule_pulls();
        self.buffer_requests.pop_front()
    }

    /// Next work request to post. Post them in the order returned.
    pub fn poll_work_request(&mut self, now: Instant) -> Option<WorkRequest> {
        if self.state == State::Failed {
            return None;
        }
        // Slots the peer already holds credits for (the ring at set-up) go before anything.
        let credited_unposted =
            self.peer_credits() + self.reposts.len() as u64 > u64::from(self.config.rx_slots);
        if self.out.is_empty() && !credited_unposted {
            self.fill(now);
        }
        if !credited_unposted {
            if let Some(wr) = self.out.pop_front() {
                return Some(wr);
            }
        }
        // A slot posted now: its credit may go back with the next frame (which the next call
        // may build, e.g. an update the peer waits for).
        self.reposts.pop_front().map(|slot| WorkRequest::Recv {
            wr_id: wr_id(WR_RECV, u64::from(slot)),
            slot,
        })
    }

    /// Credits the peer holds as far as this end knows: granted (initial and returned) minus
    /// the frames that arrived. Never more than the slots posted and not yet used.
    pub fn peer_credits(&self) -> u64 {
        self.granted_total.saturating_sub(self.received_total)
    }

    /// Like [`ChannelCore::poll_work_request`], but receive slots are left for later while
    /// fewer than a quarter of the ring wait and the peer holds at least half of it in credits:
    /// what the driver posts in the pass that delivered a message, so the reader gets it
    /// without waiting for the reposts (the next pass posts them; their credits stay withheld
    /// until then, which a peer with credits to spare does not notice). Slots the peer already
    /// holds credits for (the ring at set-up) are never left.
    pub fn poll_work_request_deferring(&mut self, now: Instant) -> Option<WorkRequest> {
        let rx_slots = u64::from(self.config.rx_slots);
        let peer_view = self.peer_credits();
        let unposted = self.reposts.len() as u64;
        if unposted >= (rx_slots / 4).max(1)
            || peer_view * 2 < rx_slots
            || peer_view + unposted > rx_slots
        {
            return self.poll_work_request(now);
        }
        if self.state == State::Failed {
            return None;
        }
        if self.out.is_empty() {
            self.fill(now);
        }
        self.out.pop_front()
    }

    /// Receive slots waiting to be posted.
    pub fn reposts_pending(&self) -> usize {
        self.reposts.len()
    }

    /// Acknowledge what was delivered without the usual delay: the next frame carries it, a
    /// lone update if nothing else goes (a peer that closed a stream may be waiting for it to
    /// close the connection).
    pub fn ack_now(&mut self) {
        if self.delivered > self.ack_sent {
            // Due already: the next `fill` sends it, and a timer armed for it fires at once.
            self.ack_deadline = Some(Instant::from_nanos(0));
        }
    }

    /// When to call [`ChannelCore::handle_timeout`] next (then pump the channel): an ack due,
    /// or a pull waiting for memory to ask again.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.state == State::Failed {
            return None;
        }
        if let Some((retry, _)) = self.buffer_retry {
            if !self.buffer_requests.is_empty() {
                return Some(self.ack_timeout().map_or(retry, |ack| ack.min(retry)));
            }
        }
        self.ack_timeout()
    }

    /// When an ack is due, if one is and may go.
    #[inline]
    fn ack_timeout(&self) -> Option<Instant> {
        if self.delivered <= self.ack_sent {
            return None;
        }
        // A due ack that cannot go for lack of credit waits for the peer, not for the clock.
        if !self.may_send_frame(self.returnable()) {
            return None;
        }
        self.ack_deadline
    }

    /// True when [`ChannelCore::poll_event`] has something.
    pub fn has_events(&self) -> bool {
        !self.events.is_empty() || !self.completed.is_empty() || self.writable_due()
    }

    /// A sender was refused for a full queue and there is room again: `Writable` is due.
    fn writable_due(&self) -> bool {
        self.state == State::Open && self.was_full && self.can_queue()
    }

    /// True when a message (or the channel's failure) waits in [`ChannelCore::poll_event`].
    pub fn has_deliveries(&self) -> bool {
        !self.events.is_empty()
    }

    /// Next event: what arrived (messages in order, the failure) before the completions of
    /// sends, then `Writable`.
    pub fn poll_event(&mut self) -> Option<Event<O, I>> {
        if let Some(ev) = self.events.pop_front() {
            return Some(ev);
        }
        if self.completed.is_empty() && self.writable_due() {
            self.was_full = false;
            return Some(Event::Writable);
        }
        self.completed.pop_front()
    }

    /// Next `SendComplete` event only (arrivals stay for [`ChannelCore::poll_event`]).
    pub fn poll_send_complete(&mut self) -> Option<Event<O, I>> {
        self.completed.pop_front()
    }

    // ------------------------------------------------------------------------------------
    // internals

    /// The channel ends with `err`: nothing more is posted or delivered. What the peer or the
    /// provider may still touch is kept (`failed_sends`, `failed_arrivals`) until the core is
    /// dropped.
    fn fail(&mut self, err: ChannelError) {
        if self.state == State::Failed {
            return;
        }
        tracing::debug!(%err, "channel failed");
        self.state = State::Failed;
        self.out.clear();
        self.reposts.clear();
        self.queued.clear();
        self.failed_sends = std::mem::take(&mut self.inflight);
        self.failed_arrivals = std::mem::take(&mut self.arrived);
        self.buffer_requests.clear();
        self.fins.clear();
        self.events.push_back(Event::Error(err));
    }

    fn protocol_error(&mut self, what: String) {
        self.fail(ChannelError::Protocol(what));
    }

    /// Rule 1: the last credit only goes with a frame that returns one.
    /// Credits a frame may return now: the released slots (`owed`), but no more than the
    /// posted slots the peer holds no credit for — a slot waiting in `reposts` is not posted
    /// yet, and a credit for it would let the peer send into nothing (RNR).
    fn returnable(&self) -> u32 {
        let peer_view = self.peer_credits();
        let unposted = self.reposts.len() as u64;
        let room = u64::from(self.config.rx_slots).saturating_sub(peer_view + unposted);
        self.owed.min(u32::try_from(room).unwrap_or(u32::MAX))
    }

    fn may_send_frame(&self, returning: u32) -> bool {
        self.sq_free > 0
            && !self.tx_free.is_empty()
            && (self.credits >= 2 || (self.credits == 1 && returning >= 1))
    }

    fn on_recv(&mut self, now: Instant, slot: u64, wc: &WorkCompletion, rx: &[u8]) {
        let Ok(slot) = u32::try_from(slot) else {
            return self.protocol_error("receive completion for an unknown slot".into());
        };
        if slot >= self.config.rx_slots {
            return self.protocol_error(format!("receive completion for slot {slot}"));
        }
        if wc.opcode != WcOpcode::Recv {
            return self.protocol_error(format!("unexpected receive opcode {:?}", wc.opcode));
        }
        // The slot's bytes are consumed below; the slot goes back to the ring when the driver
        // next posts receives, its credit once it is posted and the message released.
        self.reposts.push_back(slot);
        self.received_total += 1;
        let Some(bytes) = rx.get(..wc.byte_len as usize) else {
            return self.protocol_error("receive shorter than its completion says".into());
        };
        let frame = match wire::decode(bytes) {
            Ok(f) => f,
            Err(e) => return self.fail(ChannelError::Decode(e)),
        };
        // Piggybacked credits.
        let credits = u32::from(frame.header.credits);
        match self.credits.checked_add(credits) {
            Some(c) if c <= self.peer.rx_slots => self.credits = c,
            _ => {
                return self.protocol_error(format!(
                    "peer returned {credits} credits, more than it was lent"
                ))
            }
        }
        // Piggybacked cumulative ack.
        let ack = wire::expand_seq(frame.header.ack, self.peer_acked);
        if ack >= self.next_seq {
            return self.protocol_error(format!(
                "ack {ack} for a message never sent (next {})",
                self.next_seq
            ));
        }
        if ack > self.peer_acked {
            self.peer_acked = ack;
            for s in self.inflight.seqs_through(ack) {
                let done = self.inflight.get_mut(s).is_some_and(|m| {
                    m.peer_done = true;
                    m.wc_done
                });
                if done {
                    self.complete(s);
                }
            }
        }
        match frame.body {
            FrameBody::Data(payload) => {
                if payload.len() as u64 > self.config.max_message_len {
                    return self.protocol_error("eager payload above max message size".into());
                }
                self.accept_seq(
                    now,
                    frame.header.seq,
                    frame.trace,
                    (frame.header.stream, frame.header.stream_credits),
                    || Incoming::Ready(Received::Eager(EagerBytes::from_slice(payload))),
                );
            }
            FrameBody::Rts(rts) => {
                if rts.total_len == 0 {
                    return self.protocol_error("rendezvous of an empty payload".into());
                }
                if rts.total_len > self.config.max_message_len {
                    return self.protocol_error(format!(
                        "rendezvous of {} bytes above the {}-byte limit",
                        rts.total_len, self.config.max_message_len
                    ));
                }
                self.accept_seq(
                    now,
                    frame.header.seq,
                    frame.trace,
                    (frame.header.stream, frame.header.stream_credits),
                    || Incoming::Pulling {
                        rts,
                        buf: None,
                        requested: false,
                        next_offset: 0,
                        done: 0,
                    },
                );
            }
            FrameBody::Fin { seq } => {
                self.owed = self.owed.saturating_add(1);
                let seq = wire::expand_seq(seq, self.next_seq.saturating_sub(1));
                if seq == 0 || seq >= self.next_seq {
                    return self.protocol_error(format!("FIN for unknown message {seq}"));
                }
                if let Some(m) = self.inflight.get_mut(seq) {
                    if m.kind != SendKind::Rendezvous {
                        return self.protocol_error(format!("FIN for eager message {seq}"));
                    }
                    m.peer_done = true;
                    self.maybe_complete(seq);
                }
            }
            FrameBody::Update => {
                self.owed = self.owed.saturating_add(1);
            }
        }
        if self.state == State::Open {
            self.deliver_ready(now);
        }
    }

    fn accept_seq(
        &mut self,
        now: Instant,
        wire_seq: u32,
        trace: TraceHeader,
        (stream, stream_credits): (u32, u32),
        make: impl FnOnce() -> Incoming<I>,
    ) {
        let seq = wire::expand_seq(wire_seq, self.last_arrived + 1);
        if seq <= self.last_arrived {
            // A replayed message we already have: drop it, return its slot at once.
            self.stats.duplicates_dropped += 1;
            self.owed = self.owed.saturating_add(1);
            return;
        }
        if seq != self.last_arrived + 1 {
            return self.protocol_error(format!(
                "message {seq} arrived, expected {}",
                self.last_arrived + 1
            ));
        }
        self.last_arrived = seq;
        let head = ArrivedHead {
            seq,
            trace,
            stream,
            stream_credits,
        };
        match make() {
            // Nothing before it is still being pulled: delivered at once, without the queue.
            Incoming::Ready(payload) if self.arrived.is_empty() => self.deliver(now, head, payload),
            state => self.arrived.push_back(Arrived { head, state }),
        }
    }

    fn deliver_ready(&mut self, now: Instant) {
        while let Some(front) = self.arrived.front() {
            if !matches!(front.state, Incoming::Ready(_)) {
                break;
            }
            let Some(a) = self.arrived.pop_front() else {
                break;
            };
            let Incoming::Ready(payload) = a.state else {
                break;
            };
            self.deliver(now, a.head, payload);
        }
    }

    /// Hand the next message in sequence to the application.
    fn deliver(&mut self, now: Instant, a: ArrivedHead, payload: Received<I>) {
        self.delivered = a.seq;
        self.held += 1;
        self.stats.msgs_received += 1;
        self.stats.bytes_received += payload.len();
        if self.ack_deadline.is_none() {
            self.ack_deadline = Some(now.saturating_add(self.config.ack_delay));
        }
        self.events.push_back(Event::Received {
            seq: a.seq,
            trace: a.trace,
            stream: a.stream,
            stream_credits: a.stream_credits,
            payload,
        });
    }

    fn on_send_done(&mut self, tx_slot: u64) {
        let Some(use_) = usize::try_from(tx_slot)
            .ok()
            .and_then(|i| self.tx_use.get_mut(i))
        else {
            return self.protocol_error(format!("send completion for unknown slot {tx_slot}"));
        };
        let was = std::mem::replace(use_, TxUse::Free);
        if was == TxUse::Free || was == TxUse::Unsignaled {
            return self.protocol_error(format!("unexpected completion for send slot {tx_slot}"));
        }
        self.tx_free.push(tx_slot as u32);
        self.sq_free += 1;
        // The unsignaled SENDs posted before this one are done with it.
        let covers = self
            .tx_covers
            .get_mut(tx_slot as usize)
            .map_or(0, std::mem::take);
        for _ in 0..covers {
            let Some(slot) = self.unsignaled.pop_front() else {
                return self.protocol_error("send completions out of order".into());
            };
            if let Some(u) = self.tx_use.get_mut(slot as usize) {
                *u = TxUse::Free;
            }
            self.tx_free.push(slot);
            self.sq_free += 1;
        }
        if let TxUse::Data(seq) = was {
            if let Some(m) = self.inflight.get_mut(seq) {
                m.wc_done = true;
            }
            self.maybe_complete(seq);
        }
    }

    fn on_read_done(&mut self, now: Instant, token: u64, wc: &WorkCompletion) {
        let Some((seq, len)) = self.reads.remove(&token) else {
            return self.protocol_error(format!("READ completion for unknown token {token}"));
        };
        self.sq_free += 1;
        self.reads_outstanding = self.reads_outstanding.saturating_sub(1);
        if wc.opcode != WcOpcode::RdmaRead {
            return self.protocol_error(format!("unexpected READ opcode {:?}", wc.opcode));
        }
        let Some(a) = self.arrived.iter_mut().find(|a| a.head.seq == seq) else {
            return self.protocol_error(format!("READ completion for message {seq} not pulling"));
        };
        let Incoming::Pulling { rts, buf, done, .. } = &mut a.state else {
            return self.protocol_error(format!("READ completion for message {seq} not pulling"));
        };
        *done += u64::from(len);
        if *done >= rts.total_len {
            let len = rts.total_len;
            let Some(buf) = buf.take() else {
                return self.protocol_error("pull finished without a buffer".into());
            };
            a.state = Incoming::Ready(Received::Rendezvous { buf, len });
            self.fins.push_back(seq);
            self.deliver_ready(now);
        }
    }

    fn maybe_complete(&mut self, seq: u64) {
        let done = self
            .inflight
            .get(seq)
            .is_some_and(|m| m.wc_done && m.peer_done);
        if done {
            self.complete(seq);
        }
    }

    /// Message `seq` is done (sent, and the peer has it): its payload is handed back.
    fn complete(&mut self, seq: u64) {
        if let Some(m) = self.inflight.remove(seq) {
            self.completed.push_back(Event::SendComplete {
                id: MsgId(seq),
                stream: m.stream,
                flags: m.flags,
                payload: m.payload,
            });
        }
    }

    /// Ask for buffers of rendezvous messages, oldest first, at most `max_pulls` at once.
    fn schedule_pulls(&mut self) {
        let mut active = 0;
        for a in self.arrived.iter_mut() {
            if let Incoming::Pulling { rts, requested, .. } = &mut a.state {
                if active >= self.config.max_pulls {
                    break;
                }
                active += 1;
                if !*requested {
                    *requested = true;
                    self.buffer_requests.push_back(BufferRequest {
                        id: a.head.seq,
                        len: rts.total_len,
                    });
                }
            }
        }
    }

    /// Build what may go now: a check of the four sources first (inlined), since most calls
    /// (one per work request polled, and one more that finds the queue empty) find nothing.
    #[inline]
    fn fill(&mut self, now: Instant) {
        if self.arrived.is_empty()
            && self.fins.is_empty()
            && self.queued.is_empty()
            && self.owed < 2
            && self.delivered <= self.ack_sent
        {
            return;
        }
        self.fill_some(now);
    }

    #[inline(never)]
    fn fill_some(&mut self, now: Instant) {
        // 1. RDMA READs of rendezvous pulls (none while every message is delivered on arrival).
        if !self.arrived.is_empty() {
            self.fill_reads();
        }
        // 2. FINs: they free the peer's memory.
        while let Some(&seq) = self.fins.front() {
            if !self.may_send_frame(self.returnable()) {
                break;
            }
            self.fins.pop_front();
            self.stats.fins_sent += 1;
            let head = self.frame(
                MsgKind::Fin,
                0,
                TraceInfo::default(),
                now,
                FIN_BODY_LEN as u32,
                FrameBody::Fin {
                    seq: wire::wire_seq(seq),
                },
            );
            self.push_send(head, None, TxUse::Control);
        }
        // 3. Queued data, in order.
        if !self.queued.is_empty() {
            self.fill_data(now);
        }
        // 4. A lone update when credits or an ack must go and nothing carried them.
        if self.owed >= 2 || self.delivered > self.ack_sent {
            // (Cheap test first: what is returnable is at most `owed`.)
            self.fill_update(now);
        }
    }

    /// RDMA READs for pulls that have a buffer, oldest first.
    fn fill_reads(&mut self) {
        self.schedule_pulls();
        let chunk = u64::from(self.config.thresholds.chunk_size);
        'pulls: for a in self.arrived.iter_mut() {
            let Incoming::Pulling {
                rts,
                buf: Some(buf),
                next_offset,
                ..
            } = &mut a.state
            else {
                continue;
            };
            while *next_offset < rts.total_len {
                if self.reads_outstanding >= self.config.thresholds.reads_in_flight
                    || self.sq_free <= 1
                {
                    break 'pulls;
                }
                let len = (rts.total_len - *next_offset).min(chunk) as u32;
                let Some(local) = buf.sge(*next_offset, len) else {
                    break 'pulls;
                };
                let remote = RemoteAddr {
                    addr: rts.source.addr.wrapping_add(*next_offset),
                    rkey: rts.source.rkey,
                };
                let token = self.next_read_token;
                // Tokens stay below 2^40: the bits above the index of a work-request id carry
                // the driver's epoch (a token wraps long after its READ completed).
                self.next_read_token = (self.next_read_token + 1) & ((1 << 40) - 1);
                self.reads.insert(token, (a.head.seq, len));
                self.reads_outstanding += 1;
                self.sq_free -= 1;
                self.stats.reads_posted += 1;
                *next_offset += u64::from(len);
                self.out.push_back(WorkRequest::Read {
                    wr_id: wr_id(WR_READ, token),
                    local,
                    remote,
                });
            }
        }
    }

    /// Queued data, in order, as far as credits and the send queue allow.
    fn fill_data(&mut self, now: Instant) {
        while let Some(q) = self.queued.front() {
            if !self.may_send_frame(self.returnable()) {
                break;
            }
            let (kind, len, sge, remote) =
                (q.kind, q.payload.len(), q.payload.sge(), q.payload.remote());
            let Some(q) = self.queued.pop_front() else {
                break;
            };
            self.stats.msgs_posted += 1;
            let in_place = q.payload.in_place().is_some();
            let head = match kind {
                SendKind::Eager => {
                    self.stats.eager_sent += 1;
                    let body = q.payload.in_place().unwrap_or(&[]);
                    let (trace, seq) = (q.trace, q.seq);
                    self.frame(
                        MsgKind::Data,
                        seq,
                        trace,
                        now,
                        len as u32,
                        FrameBody::Data(body),
                    )
                }
                SendKind::Rendezvous => {
                    self.stats.rendezvous_sent += 1;
                    let Some(source) = remote else {
                        return self.fail(ChannelError::NotRegistered);
                    };
                    self.frame(
                        MsgKind::Rts,
                        q.seq,
                        q.trace,
                        now,
                        RTS_BODY_LEN as u32,
                        FrameBody::Rts(Rts {
                            total_len: len,
                            source,
                        }),
                    )
                }
            };
            let payload = match kind {
                SendKind::Eager if len > 0 && !in_place => sge,
                _ => None,
            };
            let signaled = self.push_send(head, payload, TxUse::Data(q.seq));
            let fresh = self.inflight.insert(
                q.seq,
                Inflight {
                    payload: q.payload,
                    stream: q.trace.stream,
                    flags: q.trace.flags,
                    kind,
                    // Without a completion of its own the message is done once the peer has it:
                    // its acknowledgement (eager) or FIN (rendezvous) follows the whole transfer.
                    wc_done: !signaled,
                    peer_done: false,
                },
            );
            // Sequence numbers are handed out in queue order and leave the queue in order.
            debug_assert!(fresh, "message {} added out of order", q.seq);
        }
    }

    /// A lone update when credits or an ack must go and nothing carried them.
    fn fill_update(&mut self, now: Instant) {
        let peer_view = self.granted_total as i64 - self.received_total as i64;
        let returnable = self.returnable();
        let credit_due =
            returnable >= 2 && (peer_view <= 1 || returnable >= self.config.rx_slots / 2);
        let unacked = self.delivered - self.ack_sent;
        let ack_every = u64::from((self.config.rx_slots / 4).max(1));
        let ack_due =
            unacked > 0 && (unacked >= ack_every || self.ack_deadline.is_some_and(|d| now >= d));
        if (credit_due || ack_due) && self.may_send_frame(self.returnable()) {
            self.stats.updates_sent += 1;
            let head = self.frame(
                MsgKind::Update,
                0,
                TraceInfo::default(),
                now,
                0,
                FrameBody::Update,
            );
            self.push_send(head, None, TxUse::Control);
        }
    }

    /// Build a frame prefix, taking the piggybacked ack and credits and one credit.
    fn frame(
        &mut self,
        kind: MsgKind,
        seq: u64,
        trace: TraceInfo,
        now: Instant,
        len: u32,
        body: FrameBody<'_>,
    ) -> HeadBuf {
        let returning = self.returnable().min(u32::from(u16::MAX));
        self.owed -= returning;
        self.granted_total += u64::from(returning);
        self.ack_sent = self.delivered;
        self.ack_deadline = None;
        self.credits -= 1;
        let header = MsgHeader {
            seq: wire::wire_seq(seq),
            ack: wire::wire_seq(self.delivered),
            credits: returning as u16,
            kind,
            len,
            stream: trace.stream,
            stream_credits: trace.stream_credits,
        };
        let trace = TraceHeader {
            trace_id: trace.trace_id,
            send_ts_us: now.as_micros() as u32,
            flags: trace.flags,
        };
        HeadBuf::encode(&trace, &header, &body)
    }

    /// Queue a SEND of `head` (and `payload`); true if it asks for a completion. Every
    /// `signal_every`-th SEND does (at most half the send queue is ever waiting for one).
    fn push_send(&mut self, head: HeadBuf, payload: Option<Sge>, use_: TxUse) -> bool {
        // `may_send_frame` checked both resources.
        let Some(tx_slot) = self.tx_free.pop() else {
            self.fail(ChannelError::Protocol("send slots exhausted".into()));
            return true;
        };
        let every = self
            .config
            .signal_every
            .min(self.config.sq_depth / 2)
            .max(1);
        let signaled = self.since_signal + 1 >= every;
        let slot = tx_slot as usize;
        if signaled {
            if let Some(c) = self.tx_covers.get_mut(slot) {
                *c = self.since_signal;
            }
            self.since_signal = 0;
        } else {
            self.since_signal += 1;
            self.unsignaled.push_back(tx_slot);
        }
        if let Some(u) = self.tx_use.get_mut(slot) {
            *u = if signaled { use_ } else { TxUse::Unsignaled };
        }
        self.sq_free -= 1;
        self.out.push_back(WorkRequest::Send {
            wr_id: wr_id(WR_SEND, u64::from(tx_slot)),
            tx_slot,
            head,
            payload,
            signaled,
        });
        signaled
    }
}

/// Split a work-request id into (kind, index); for drivers that share a CQ among channels and
/// need to know which completions are receives.
pub fn is_recv_wr(wr_id: u64) -> bool {
    wr_parts(wr_id).0 == WR_RECV
}
