//! One side of an MP-RDMA connection: the sans-IO state machine.
//!
//! Owns the public API (`Connection`, `Payload`, `Event`, `Transmit`, errors), the
//! sender's protocol state and timers, ACK/NACK processing, the synchronise delay, the
//! single-path baseline's sender (pacing, go-back-N, DCQCN reactions), and glues them to
//! the receiver (`crate::recv`), the message store (`crate::send`), the congestion
//! controllers (`crate::congestion`) and the wire format (`crate::frame`). ACK clocking
//! and path selection live in `path`, loss recovery and retransmission timing in
//! `recovery`. Design: MP-RDMA (NSDI 2018) §3 and §4; the single-path baseline follows
//! RoCEv2 go-back-N with DCQCN.
//!
//! Driving loop: input (`send`, `handle_datagram`, `handle_timeout`) → drain
//! `poll_transmit` → drain `poll_event` → sleep until `poll_timeout`. Nothing here reads
//! a clock or allocates per packet (queues keep their capacity; only a received
//! message's buffer is allocated, once per message).

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use thiserror::Error;

use crate::config::{Config, Mode};
use crate::congestion::{Dcqcn, Window};
use crate::frame::{self, AckHeader, DataHeader, DecodeError, Frame, NackHeader};
use crate::psnmap::PsnRing;
use crate::recv::{Receiver, ReceiverState, RecvOutcome};
use crate::rtt::RttEstimator;
use crate::send::{packets_for, SendQueue};
use crate::seq;
use crate::stats::{ProtocolStateSize, Stats};
use crate::time::duration_nanos;
use crate::{Instant, PathId};

mod path;
mod recovery;

/// Identifies a message within one direction of a connection: 0, 1, 2, … in send order.
/// The receiver reports the same id for the same message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct MessageId(pub u64);

/// A message's content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Payload {
    /// Real bytes, carried in the packets.
    Bytes(Bytes),
    /// Only a length: packets carry headers only and stand for this many payload bytes
    /// (see [`Transmit::virtual_len`]). Used by the simulator to avoid copying payload.
    Virtual(u64),
}

impl Payload {
    /// Length in bytes (real or virtual).
    pub fn len(&self) -> u64 {
        match self {
            Payload::Bytes(b) => b.len() as u64,
            Payload::Virtual(n) => *n,
        }
    }

    /// Whether the message is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Self {
        Payload::Bytes(Bytes::from(v))
    }
}

impl From<Bytes> for Payload {
    fn from(b: Bytes) -> Self {
        Payload::Bytes(b)
    }
}

/// What a datagram from [`Connection::poll_transmit`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PacketKind {
    /// First transmission of a data packet: on the path its ACK echoed, or on a random
    /// path for the first window, after idle, or from the burst timer.
    Data,
    /// First transmission of a data packet on a new random path chosen by probing
    /// (probability `probe_probability` per ACK-clocked packet).
    Probe,
    /// A data packet sent again.
    Retransmit,
    /// An acknowledgement.
    Ack,
    /// A negative acknowledgement.
    Nack,
}

impl PacketKind {
    /// Whether the packet carries (or stands for) payload.
    pub fn is_data(self) -> bool {
        matches!(
            self,
            PacketKind::Data | PacketKind::Probe | PacketKind::Retransmit
        )
    }
}

/// A datagram to send, written into the buffer given to [`Connection::poll_transmit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transmit {
    /// Virtual path to send it on (the driver's UDP source-port index).
    pub path: PathId,
    /// Bytes written to the buffer (`buf[..len]` is the datagram).
    pub len: usize,
    /// Payload bytes the datagram stands for without carrying them (virtual payload);
    /// its size on a modelled wire is `len + virtual_len`. 0 for real payload.
    pub virtual_len: u32,
    /// Whether the datagram may be sent ECN-capable (ECT): data yes, ACK/NACK no.
    pub ecn_capable: bool,
    /// What it is.
    pub kind: PacketKind,
}

impl Transmit {
    /// Size on the wire, counting virtual payload.
    pub fn wire_len(&self) -> usize {
        self.len + self.virtual_len as usize
    }
}

/// Why a connection stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ConnectionError {
    /// `max_rto_count` retransmission timeouts in a row without progress.
    #[error("peer unreachable: retransmission timed out {0} times")]
    TimedOut(u32),
    /// The peer broke the protocol in a way that cannot be ignored (e.g. a message
    /// whose packets disagree after they were acknowledged).
    #[error("protocol violation by peer: {0}")]
    Protocol(&'static str),
}

/// Why [`Connection::send`] refused a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SendError {
    /// Too many messages queued or unacknowledged: back-pressure, retry after
    /// [`Event::MessageAcked`].
    #[error("send queue full")]
    QueueFull,
    /// Longer than `Config::max_message_len`.
    #[error("message of {0} bytes exceeds max_message_len")]
    TooLarge(u64),
    /// The connection failed.
    #[error("connection failed: {0}")]
    Failed(ConnectionError),
}

/// Something the application should know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A complete message from the peer; delivered exactly once, in message order.
    MessageReceived {
        /// The message's id in the peer's send order.
        id: MessageId,
        /// Its content.
        payload: Payload,
        /// Whether it was sent with the synchronise flag (applied only after every
        /// earlier message was complete).
        synchronise: bool,
    },
    /// Every packet of a message we sent was acknowledged.
    MessageAcked(MessageId),
    /// The connection failed; nothing more will be sent or delivered.
    Failed(ConnectionError),
}

/// The sender's protocol state (what a NIC would keep per connection).
///
/// PSN invariants (serial order): `snd_una <= snd_nxt <= snd_max`,
/// `snd_una <= snd_ooh + 1`; in multi-path mode `snd_nxt == snd_max`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SenderState {
    /// Oldest unacknowledged PSN.
    pub(crate) snd_una: u32,
    /// Next PSN to send (multi-path: next new PSN; go-back-N: may rewind).
    pub(crate) snd_nxt: u32,
    /// One past the highest PSN ever sent.
    pub(crate) snd_max: u32,
    /// Highest SACKed PSN (out-of-order high).
    pub(crate) snd_ooh: u32,
    /// Loss recovery ends when `snd_una` reaches this (`snd_nxt` at entry).
    pub(crate) recovery: u32,
    /// Next PSN to retransmit in recovery.
    pub(crate) snd_retx: u32,
    /// Next PSN the tail-loss resend may send again.
    pub(crate) snd_tail: u32,
    /// Packets SACKed above `snd_una` (window inflation); `<= snd_nxt - snd_una`.
    pub(crate) inflate: u32,
    /// Retransmissions sent and not yet acknowledged.
    pub(crate) retx_in_flight: u32,
    /// Congestion window.
    pub(crate) window: Window,
    /// RTT estimate.
    pub(crate) rtt: RttEstimator,
    /// Consecutive timeouts without progress.
    pub(crate) rto_count: u8,
    /// In loss recovery.
    pub(crate) in_recovery: bool,
    /// The recovery was started by a timeout: every unSACKed packet below `recovery`
    /// is presumed lost (not only those more than Δ below `snd_ooh`).
    pub(crate) recovery_after_timeout: bool,
}

/// Timer kinds (timers are data: one optional deadline each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
enum Timer {
    /// Retransmission timeout.
    Rto = 0,
    /// Burst timer: release window left over by burst-limited ACKs.
    Burst = 1,
    /// Wake-up when a delayed synchronise message may go.
    Sync = 2,
    /// Wake-up when the single-path pacer allows the next packet.
    Pace = 3,
    /// DCQCN rate increase (runs from a rate cut until line rate is reached).
    Increase = 4,
    /// The resent hole at `snd_una` is overdue: its resend was lost too.
    Resend = 5,
}

const TIMER_COUNT: usize = 6;
const TIMERS: [Timer; TIMER_COUNT] = [
    Timer::Rto,
    Timer::Burst,
    Timer::Sync,
    Timer::Pace,
    Timer::Increase,
    Timer::Resend,
];

/// Deadlines and time marks.
#[derive(Clone, Copy, Debug, Default)]
struct Timers {
    deadline: [Option<Instant>; TIMER_COUNT],
    /// A synchronise message may not leave before this (Δt after the previous tail).
    sync_not_before: Instant,
    /// Restart from the initial window when sending after this instant with nothing in
    /// flight.
    idle_restart_at: Option<Instant>,
    /// A NACK may rewind the go-back-N pointer again after this.
    rewind_holdoff_until: Instant,
    /// The PSN last resent for a NACK, and when another NACK may resend it again.
    nack_resend: Option<(u32, Instant)>,
    /// The PSN the `Resend` timer watches (a resent hole at `snd_una`).
    resend_watch: u32,
    /// The path the latest ACK echoed: known to work, used for resends that no ACK
    /// clocks (resend timer, RTO).
    last_ack_path: PathId,
    /// Last DCQCN reaction to a congestion notification (alpha decays in whole
    /// `alpha_timer` periods from here, computed lazily at the next notification).
    last_rate_cut: Option<Instant>,
    /// Single-path pacer: earliest time of the next data packet.
    next_send: Instant,
    /// The paths of the latest ACKs (a ring): known to work, used by the burst timer.
    recent_ack_paths: [PathId; RECENT_ACK_PATHS],
    /// Next slot of `recent_ack_paths` to write; how many are filled, up to the size.
    recent_ack_next: u8,
    recent_ack_len: u8,
    /// Next slot the burst timer sends on.
    recent_ack_cursor: u8,
}

/// How many recent ACK paths the burst timer spreads its packets over.
const RECENT_ACK_PATHS: usize = 8;

impl Timers {
    fn note_ack_path(&mut self, path: PathId) {
        let i = usize::from(self.recent_ack_next) % RECENT_ACK_PATHS;
        if let Some(slot) = self.recent_ack_paths.get_mut(i) {
            *slot = path;
        }
        self.recent_ack_next = ((i + 1) % RECENT_ACK_PATHS) as u8;
        self.recent_ack_len = (usize::from(self.recent_ack_len) + 1).min(RECENT_ACK_PATHS) as u8;
    }

    /// The next of the recently ACKed paths, round-robin; `None` before any ACK.
    fn next_recent_ack_path(&mut self) -> Option<PathId> {
        let n = usize::from(self.recent_ack_len);
        if n == 0 {
            return None;
        }
        let i = usize::from(self.recent_ack_cursor) % n;
        self.recent_ack_cursor = ((i + 1) % n) as u8;
        self.recent_ack_paths.get(i).copied()
    }

    fn get(&self, t: Timer) -> Option<Instant> {
        self.deadline.get(t as usize).copied().flatten()
    }
    fn set(&mut self, t: Timer, at: Option<Instant>) {
        if let Some(d) = self.deadline.get_mut(t as usize) {
            *d = at;
        }
    }
}

/// One ACK-clock send opportunity: a packet may leave on `path`.
#[derive(Clone, Copy, Debug)]
struct Token {
    path: PathId,
    /// The path replaces the ACK's path because of probing.
    probe: bool,
    /// A specific PSN to resend (a NACKed one); `None`: whatever is due next.
    psn: Option<u32>,
}

/// An ACK or NACK waiting to be sent.
#[derive(Clone, Copy, Debug)]
enum Reply {
    Ack { via: PathId, h: AckHeader },
    Nack { via: PathId, h: NackHeader },
}

/// One side of a full-duplex MP-RDMA connection.
pub struct Connection {
    config: Config,
    s: SenderState,
    /// SACK scoreboard: PSN `p` in `[snd_una, snd_una + L)` was selectively acknowledged
    /// when its bit is set (bits outside that range are zero). Lets recovery and tail
    /// resend skip packets that arrived (not in the paper's 66 bytes; L/8 bytes that avoid
    /// resending a whole bitmap window per loss).
    sacked: PsnRing<1>,
    receiver: Receiver,
    queue: SendQueue,
    dcqcn: Dcqcn,
    timers: Timers,
    tokens: VecDeque<Token>,
    replies: VecDeque<Reply>,
    events: VecDeque<Event>,
    rng: SmallRng,
    stats: Stats,
    error: Option<ConnectionError>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("mode", &self.config.mode)
            .field("sender", &self.s)
            .field("receiver", &self.receiver.state)
            .field("queued_messages", &self.queue.len())
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

/// Tail resend waits until this many later packets were SACKed (TCP's duplicate-ACK
/// threshold), so mild reordering does not trigger it.
const TAIL_REORDER_THRESHOLD: u32 = 3;

/// Largest span of PSNs queued or in flight; keeps serial comparisons unambiguous.
const MAX_PSN_SPAN: u64 = 1 << 30;

impl Connection {
    /// Creates one side of a connection at time `now`.
    ///
    /// An invalid `config` is repaired with [`Config::sanitized`]; call
    /// [`Config::validate`] first to reject one instead. Both sides start at PSN 0.
    pub fn new(config: Config, now: Instant) -> Connection {
        Self::with_initial_psn(config, now, 0)
    }

    /// Like [`Connection::new`], with both directions starting at PSN `psn` (tests
    /// use it to cross the 32-bit wrap; peers must agree on it).
    pub(crate) fn with_initial_psn(config: Config, now: Instant, psn: u32) -> Connection {
        let config = config.sanitized();
        let window = match config.mode {
            Mode::MultiPath => config.bitmap_len,
            Mode::SinglePath => 1,
        };
        let initial_window = f64::from(config.initial_window);
        let s = SenderState {
            snd_una: psn,
            snd_nxt: psn,
            snd_max: psn,
            snd_ooh: psn,
            recovery: psn,
            snd_retx: psn,
            snd_tail: psn,
            inflate: 0,
            retx_in_flight: 0,
            window: Window::new(initial_window, config.min_window, config.max_window),
            rtt: RttEstimator::new(config.initial_rtt),
            rto_count: 0,
            in_recovery: false,
            recovery_after_timeout: false,
        };
        let timers = Timers {
            next_send: now,
            sync_not_before: now,
            rewind_holdoff_until: now,
            ..Timers::default()
        };
        let dcqcn = Dcqcn::new(&config.dcqcn);
        let sacked = PsnRing::new(config.bitmap_len);
        let receiver = Receiver::new(psn, window, config.max_message_len);
        let stats = Stats {
            state_size: ProtocolStateSize {
                sender: std::mem::size_of::<SenderState>() + sacked.state_bytes(),
                receiver: std::mem::size_of::<ReceiverState>() + receiver.bitmap_bytes(),
                rate_control: if config.mode == Mode::SinglePath {
                    std::mem::size_of::<Dcqcn>()
                } else {
                    0
                },
                timers: std::mem::size_of::<[Option<Instant>; TIMER_COUNT]>(),
            },
            ..Stats::default()
        };
        let mut c = Connection {
            receiver,
            sacked,
            queue: SendQueue::new(psn),
            rng: SmallRng::seed_from_u64(config.seed),
            config,
            s,
            dcqcn,
            timers,
            tokens: VecDeque::new(),
            replies: VecDeque::new(),
            events: VecDeque::new(),
            stats,
            error: None,
        };
        c.refresh_stats(now);
        c
    }

    /// The configuration in use (after sanitizing).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Counters and current congestion state.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Why the connection failed, if it did.
    pub fn error(&self) -> Option<ConnectionError> {
        self.error
    }

    /// Whether every message sent was acknowledged and nothing is waiting to be sent.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.replies.is_empty()
    }

    /// Whether packets of queued messages wait to leave for the first time: the window (ACK
    /// clocking) or the pacing holds them until an ACK or a timer releases them.
    pub fn has_unsent(&self) -> bool {
        self.s.snd_nxt != self.queue.end_psn()
    }

    /// Congestion window in packets.
    pub fn cwnd(&self) -> f64 {
        self.s.window.get()
    }

    /// Smoothed RTT estimate.
    pub fn srtt(&self) -> Duration {
        self.s.rtt.srtt()
    }

    /// Packets sent and not yet cumulatively acknowledged.
    pub fn packets_in_flight(&self) -> u32 {
        seq::dist(self.s.snd_una, self.s.snd_nxt)
    }

    /// Queues a message. It is split into `mss`-byte packets; `synchronise` makes the
    /// receiver apply it only after every earlier message is complete.
    pub fn send(
        &mut self,
        now: Instant,
        payload: Payload,
        synchronise: bool,
    ) -> Result<MessageId, SendError> {
        if let Some(e) = self.error {
            return Err(SendError::Failed(e));
        }
        let len = payload.len();
        if len > self.config.max_message_len {
            return Err(SendError::TooLarge(len));
        }
        let packets = packets_for(len, self.config.mss);
        if packets > MAX_PSN_SPAN {
            return Err(SendError::TooLarge(len));
        }
        let span = u64::from(seq::dist(self.s.snd_una, self.queue.end_psn()));
        if self.queue.len() >= self.config.max_queued_messages
            || span.saturating_add(packets) > MAX_PSN_SPAN
        {
            return Err(SendError::QueueFull);
        }
        let id = self.queue.push(payload, synchronise, packets as u32);
        self.stats.messages_sent += 1;
        if self.config.mode == Mode::MultiPath {
            self.kickoff(now);
        }
        self.refresh_stats(now);
        Ok(id)
    }

    /// Handles one datagram received on virtual path `path` (the path the ACK goes back
    /// on), with the ECN CE mark `ecn_ce`.
    ///
    /// A malformed datagram, or one that contradicts this side's state, is ignored and
    /// reported as an error; the connection keeps working. A fatal violation ends the
    /// connection with [`Event::Failed`].
    pub fn handle_datagram(
        &mut self,
        now: Instant,
        path: PathId,
        ecn_ce: bool,
        datagram: &[u8],
    ) -> Result<(), DecodeError> {
        if self.error.is_some() {
            return Ok(());
        }
        let r = match frame::decode(datagram)? {
            Frame::Data(h, payload) => {
                self.on_data(now, path, ecn_ce, &h, payload);
                Ok(())
            }
            Frame::Ack(h) => self.on_ack(now, &h),
            Frame::Nack(h) => self.on_nack(now, &h),
        };
        self.refresh_stats(now);
        r
    }

    /// Runs every timer whose deadline is at or before `now`. Spurious calls are harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.error.is_some() {
            return;
        }
        for t in TIMERS {
            if self.timers.get(t).is_some_and(|d| d <= now) {
                self.timers.set(t, None);
                self.on_timer(now, t);
                if self.error.is_some() {
                    return;
                }
            }
        }
        self.refresh_stats(now);
    }

    /// The next instant `handle_timeout` should be called, if any.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.error.is_some() {
            return None;
        }
        self.timers.deadline.iter().flatten().min().copied()
    }

    /// Writes the next datagram to send into `buf` (cleared first) and describes it.
    /// Call until it returns `None`.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit> {
        buf.clear();
        if self.error.is_some() {
            return None;
        }
        if let Some(reply) = self.replies.pop_front() {
            let (path, kind) = match reply {
                Reply::Ack { via, h } => {
                    frame::encode_ack(&h, buf);
                    self.stats.acks_sent += 1;
                    (via, PacketKind::Ack)
                }
                Reply::Nack { via, h } => {
                    frame::encode_nack(&h, buf);
                    self.stats.nacks_sent += 1;
                    (via, PacketKind::Nack)
                }
            };
            self.stats.packets_sent += 1;
            self.stats.bytes_sent += buf.len() as u64;
            return Some(Transmit {
                path,
                len: buf.len(),
                virtual_len: 0,
                ecn_capable: false,
                kind,
            });
        }
        let t = match self.config.mode {
            Mode::MultiPath => self.transmit_multipath(now, buf),
            Mode::SinglePath => self.transmit_single_path(now, buf),
        };
        if t.is_some() {
            self.refresh_stats(now);
        }
        t
    }

    /// The next event for the application, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    // ----- receiving data -------------------------------------------------------------

    fn on_data(&mut self, now: Instant, via: PathId, ecn_ce: bool, h: &DataHeader, payload: &[u8]) {
        let before = self.events.len();
        let outcome =
            self.receiver
                .on_data(now, self.config.nack_interval, h, payload, &mut self.events);
        self.stats.max_ooo_gap = self.receiver.max_gap;
        for e in self.events.iter().skip(before) {
            if let Event::MessageReceived { payload, .. } = e {
                self.stats.messages_received += 1;
                self.stats.payload_bytes_received += payload.len();
            }
        }
        let aack = self.receiver.state.rcv_nxt;
        let ack = AckHeader {
            path: h.path,
            sack: h.psn,
            aack,
            timestamp_echo: h.timestamp,
            ece: ecn_ce,
            synchronise: h.synchronise,
            retransmit: h.retransmit,
        };
        match outcome {
            Ok(RecvOutcome::Accepted) => self.replies.push_back(Reply::Ack { via, h: ack }),
            Ok(RecvOutcome::Duplicate) => {
                self.stats.duplicates_received += 1;
                self.replies.push_back(Reply::Ack { via, h: ack });
            }
            Ok(RecvOutcome::Overflow(nack)) => {
                self.stats.ooo_drops += 1;
                if let Some(lost) = nack {
                    self.replies.push_back(Reply::Nack {
                        via,
                        h: NackHeader {
                            path: h.path,
                            lost,
                            aack,
                            timestamp_echo: h.timestamp,
                            ece: ecn_ce,
                            synchronise: false,
                            retransmit: h.retransmit,
                        },
                    });
                }
            }
            Ok(RecvOutcome::EarlySync) => {
                self.stats.sync_early_drops += 1;
                self.replies.push_back(Reply::Nack {
                    via,
                    h: NackHeader {
                        path: h.path,
                        lost: h.psn,
                        aack,
                        timestamp_echo: h.timestamp,
                        ece: ecn_ce,
                        synchronise: true,
                        retransmit: h.retransmit,
                    },
                });
            }
            Err(e) => self.fail(e),
        }
    }

    // ----- sender: acknowledgements -----------------------------------------------------

    /// Checks that an acknowledged PSN range makes sense: `aack` within
    /// `[snd_una - span, snd_max]` and `psn` below `snd_max`.
    fn check_ack_range(&self, psn: u32, aack: u32) -> Result<(), DecodeError> {
        let s = &self.s;
        if seq::lt(s.snd_max, aack) || !seq::lt(psn, s.snd_max) {
            return Err(DecodeError::Protocol("acknowledges a PSN never sent"));
        }
        Ok(())
    }

    fn rtt_sample(&mut self, now: Instant, echo: u64) {
        let ts = Instant::from_nanos(echo);
        if ts <= now {
            self.s.rtt.on_sample(now - ts);
        }
    }

    fn on_ack(&mut self, now: Instant, h: &AckHeader) -> Result<(), DecodeError> {
        if seq::diff(h.sack, self.s.snd_una) < -(MAX_PSN_SPAN as i32) {
            return Ok(()); // ancient duplicate
        }
        self.check_ack_range(h.sack, h.aack)?;
        self.stats.acks_received += 1;
        self.rtt_sample(now, h.timestamp_echo);
        if h.ece {
            self.stats.ecn_echoes += 1;
        }
        match self.config.mode {
            Mode::MultiPath => self.on_ack_multipath(now, h),
            Mode::SinglePath => {
                self.advance_una(now, h.aack);
                if h.ece {
                    self.on_congestion_notification(now);
                }
            }
        }
        Ok(())
    }

    fn on_ack_multipath(&mut self, now: Instant, h: &AckHeader) {
        let (min, max) = (self.config.min_window, self.config.max_window);
        // Congestion-window-limited check (as TCP, RFC 7661, and QUIC): the window may
        // grow only if the packets actually sent filled it; window granted but still
        // waiting for the NIC (or the application) says nothing about the network.
        let window_limited = self.window_limited();
        self.timers.last_ack_path = h.path;
        self.timers.note_ack_path(h.path);
        // A SACK at or above snd_una is a packet leaving the network: inflate by one.
        let fresh = !seq::lt(h.sack, self.s.snd_una) && !self.is_sacked(h.sack);
        if fresh {
            self.s.inflate = self.s.inflate.saturating_add(1);
            self.mark_sacked(h.sack);
        }
        if h.retransmit {
            self.s.retx_in_flight = self.s.retx_in_flight.saturating_sub(1);
        }
        self.advance_una(now, h.aack);
        if h.ece {
            self.s.window.on_marked_ack(min, max);
        } else if window_limited {
            self.s.window.on_unmarked_ack(min, max);
        }
        // Out-of-order aware path selection: an ACK far behind the highest SACK comes
        // from a slow path; shrink the window and do not reuse that path.
        let snd_ool = self.s.snd_ooh.wrapping_sub(self.config.delta);
        let slow = !h.retransmit && seq::lt(h.sack, snd_ool);
        self.s.snd_ooh = seq::max(self.s.snd_ooh, h.sack);
        if slow {
            self.stats.slow_path_prunes += 1;
            self.s.window.shrink_by_one(min, max);
            self.kickoff(now);
            return;
        }
        self.detect_loss(now);
        self.release_on_ack(now, h.path);
        self.kickoff(now);
    }

    fn on_nack(&mut self, now: Instant, h: &NackHeader) -> Result<(), DecodeError> {
        if seq::diff(h.lost, self.s.snd_una) < -(MAX_PSN_SPAN as i32) {
            return Ok(());
        }
        self.check_ack_range(h.lost, h.aack)?;
        self.stats.nacks_received += 1;
        self.rtt_sample(now, h.timestamp_echo);
        if h.ece {
            self.stats.ecn_echoes += 1;
        }
        self.advance_una(now, h.aack);
        match self.config.mode {
            Mode::MultiPath => {
                if h.ece {
                    self.s
                        .window
                        .on_marked_ack(self.config.min_window, self.config.max_window);
                }
                if seq::lt(h.lost, self.s.snd_una) {
                    self.kickoff(now);
                    return Ok(()); // already recovered
                }
                if !h.synchronise {
                    // Bitmap overflow: `lost` (rcv_nxt) is missing while a packet L
                    // further arrived. Recover every hole up to the current snd_nxt.
                    if !self.s.in_recovery {
                        self.enter_recovery(now, h.lost.wrapping_add(1), false);
                    } else if !seq::lt(h.lost, self.s.recovery) {
                        self.s.recovery = self.s.snd_nxt;
                    }
                }
                // The named packet is known missing (lost, or an early synchronise
                // packet the receiver dropped): resend it now on the NACK's path,
                // outside the window; again for the same PSN only after an RTT.
                let repeat = self
                    .timers
                    .nack_resend
                    .is_some_and(|(psn, at)| psn == h.lost && now < at);
                if !repeat {
                    self.timers.nack_resend = Some((h.lost, now + self.s.rtt.srtt()));
                    self.tokens.push_front(Token {
                        path: h.path,
                        probe: false,
                        psn: Some(h.lost),
                    });
                }
                self.kickoff(now);
            }
            Mode::SinglePath => {
                if h.ece {
                    self.on_congestion_notification(now);
                }
                if seq::lt(h.lost, self.s.snd_nxt) && now >= self.timers.rewind_holdoff_until {
                    // Go-back-N: resend everything from the lost PSN.
                    self.s.snd_nxt = seq::max(h.lost, self.s.snd_una);
                    self.timers.rewind_holdoff_until = now + self.s.rtt.srtt();
                    self.stats.go_back_n += 1;
                }
            }
        }
        Ok(())
    }

    // ----- sender: window and send opportunities ------------------------------------------

    fn transmit_single_path(&mut self, now: Instant, buf: &mut Vec<u8>) -> Option<Transmit> {
        let s = self.s;
        if !seq::lt(s.snd_nxt, self.queue.end_psn()) {
            return None;
        }
        if seq::dist(s.snd_una, s.snd_nxt) >= self.config.dcqcn.max_inflight_packets {
            return None;
        }
        if now < self.timers.next_send {
            self.timers.set(Timer::Pace, Some(self.timers.next_send));
            return None;
        }
        let retransmit = seq::lt(s.snd_nxt, s.snd_max);
        let kind = if retransmit {
            PacketKind::Retransmit
        } else {
            PacketKind::Data
        };
        let t = self.emit_data(
            now,
            PathId(self.config.single_path),
            s.snd_nxt,
            retransmit,
            kind,
            buf,
        )?;
        let bits = (t.wire_len() as f64) * 8.0;
        let gap = Duration::from_secs_f64(bits / self.dcqcn.rate());
        self.timers.next_send = self.timers.next_send.max(now) + gap;
        Some(t)
    }

    /// Encodes data packet `psn` into `buf` and updates the sender state.
    fn emit_data(
        &mut self,
        now: Instant,
        path: PathId,
        psn: u32,
        retransmit: bool,
        kind: PacketKind,
        buf: &mut Vec<u8>,
    ) -> Option<Transmit> {
        let p = self.queue.packet(psn, self.config.mss)?;
        let was_idle = self.in_flight() == 0;
        let h = DataHeader {
            path,
            psn,
            msn: p.msn,
            ipsn: p.ipsn,
            timestamp: now.as_nanos(),
            payload_len: p.len,
            synchronise: p.synchronise,
            retransmit,
            tail: p.tail,
            is_virtual: p.is_virtual,
        };
        buf.clear();
        frame::encode_data(&h, self.queue.bytes(&p), buf);
        let virtual_len = if p.is_virtual { u32::from(p.len) } else { 0 };
        if retransmit {
            self.stats.retransmits += 1;
            if self.config.mode == Mode::MultiPath {
                self.s.retx_in_flight = self.s.retx_in_flight.saturating_add(1);
                if psn == self.s.snd_una && self.s.in_recovery && !self.s.recovery_after_timeout {
                    self.timers.resend_watch = psn;
                    self.timers
                        .set(Timer::Resend, Some(now + self.resend_grace()));
                }
            }
        } else {
            self.stats.payload_bytes_sent += u64::from(p.len);
            if kind == PacketKind::Probe {
                self.stats.probes += 1;
            }
        }
        if psn == self.s.snd_nxt {
            self.s.snd_nxt = psn.wrapping_add(1);
            self.s.snd_max = seq::max(self.s.snd_max, self.s.snd_nxt);
            if p.tail && !retransmit {
                // Δt = α·Δ / (cwnd / RTT): the time Δ packets take to leave at the
                // current rate; a synchronise message waits that long after this tail.
                let srtt = duration_nanos(self.s.rtt.srtt()) as f64;
                let dt = self.config.sync_alpha * f64::from(self.config.delta) * srtt
                    / self.s.window.get();
                self.timers.sync_not_before = now + Duration::from_nanos(dt as u64);
            }
        }
        self.stats.packets_sent += 1;
        self.stats.data_packets_sent += 1;
        self.stats.bytes_sent += (buf.len() as u64) + u64::from(virtual_len);
        let idle_after = self.s.rtt.srtt() * self.config.idle_restart_rtts;
        self.timers.idle_restart_at = Some(now + idle_after);
        if was_idle || self.timers.get(Timer::Rto).is_none() {
            self.rearm_rto(now, true);
        }
        Some(Transmit {
            path,
            len: buf.len(),
            virtual_len,
            ecn_capable: true,
            kind,
        })
    }

    // ----- timers -------------------------------------------------------------------------

    fn on_timer(&mut self, now: Instant, t: Timer) {
        match t {
            Timer::Rto => self.on_rto(now),
            Timer::Burst => {
                if self.config.mode == Mode::MultiPath {
                    self.on_burst_timer(now);
                }
            }
            Timer::Sync | Timer::Pace => {} // wake-ups: poll_transmit re-checks
            Timer::Resend => self.on_resend_timer(),
            Timer::Increase => {
                if self.dcqcn.on_increase_timer(&self.config.dcqcn) {
                    self.timers.set(
                        Timer::Increase,
                        Some(now + self.config.dcqcn.rate_increase_timer),
                    );
                }
            }
        }
    }

    fn on_congestion_notification(&mut self, now: Instant) {
        let cfg = &self.config.dcqcn;
        if self
            .timers
            .last_rate_cut
            .is_some_and(|t| now < t + cfg.cnp_interval)
        {
            return;
        }
        // Alpha decays once per alpha period without notification; applying the whole
        // periods elapsed since the last cut equals running the alpha timer.
        // Before the first cut alpha keeps its initial value 1 (the first cut halves).
        let since = self
            .timers
            .last_rate_cut
            .map_or(Duration::ZERO, |t| now - t);
        let periods = since.as_nanos() / cfg.alpha_timer.as_nanos().max(1);
        self.dcqcn
            .decay_alpha(cfg, u32::try_from(periods).unwrap_or(u32::MAX));
        self.timers.last_rate_cut = Some(now);
        self.dcqcn.on_congestion(cfg);
        self.stats.rate_cuts += 1;
        self.timers
            .set(Timer::Increase, Some(now + cfg.rate_increase_timer));
    }

    fn fail(&mut self, e: ConnectionError) {
        if self.error.is_some() {
            return;
        }
        self.error = Some(e);
        self.tokens.clear();
        self.replies.clear();
        self.timers.deadline = [None; TIMER_COUNT];
        self.events.push_back(Event::Failed(e));
    }

    fn refresh_stats(&mut self, now: Instant) {
        let cwnd = self.s.window.get();
        if self.config.trace_cwnd && self.stats.cwnd != cwnd {
            self.stats.cwnd_trace.push((now, cwnd));
        }
        self.stats.cwnd = cwnd;
        self.stats.srtt = self.s.rtt.srtt();
        self.stats.rto = self.s.rtt.rto(self.config.min_rto, self.config.max_rto);
        if self.config.mode == Mode::SinglePath {
            self.stats.rate_bps = self.dcqcn.rate();
        }
    }
}

/// Serial minimum for PSNs.
trait MinSerial {
    fn min_serial(self, other: u32) -> u32;
}

impl MinSerial for u32 {
    fn min_serial(self, other: u32) -> u32 {
        if seq::lt(other, self) {
            other
        } else {
            self
        }
    }
}

#[cfg(test)]
impl Connection {
    /// Internal state for tests.
    pub(crate) fn sender_state(&self) -> &SenderState {
        &self.s
    }
    pub(crate) fn receiver_state(&self) -> &ReceiverState {
        &self.receiver.state
    }
    pub(crate) fn timer_deadline_burst(&self) -> Option<Instant> {
        self.timers.get(Timer::Burst)
    }
    pub(crate) fn set_cwnd_for_test(&mut self, cwnd: f64) {
        self.s
            .window
            .set(cwnd, self.config.min_window, self.config.max_window);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_connection_is_quiet_until_asked_to_send() {
        let mut c = Connection::new(Config::default(), Instant::ZERO);
        let mut buf = Vec::new();
        assert!(c.is_idle());
        assert_eq!(c.packets_in_flight(), 0);
        assert_eq!(c.poll_timeout(), None);
        assert_eq!(c.poll_transmit(Instant::ZERO, &mut buf), None);
        assert_eq!(c.poll_event(), None);
        c.send(Instant::ZERO, Payload::Virtual(3000), false)
            .unwrap();
        assert!(!c.is_idle());
        let t = c.poll_transmit(Instant::ZERO, &mut buf).unwrap();
        assert_eq!(
            (t.kind, t.virtual_len, t.len),
            (PacketKind::Data, 1024, frame::DATA_HEADER_LEN)
        );
        assert_eq!(c.packets_in_flight(), 1);
        assert!(c.poll_timeout().is_some(), "the RTO is armed");
    }

    #[test]
    fn send_rejects_oversized_messages_and_full_queues() {
        let config = Config {
            max_message_len: 10,
            max_queued_messages: 2,
            ..Config::default()
        };
        let mut c = Connection::new(config, Instant::ZERO);
        assert_eq!(
            c.send(Instant::ZERO, Payload::Virtual(11), false),
            Err(SendError::TooLarge(11))
        );
        c.send(Instant::ZERO, Payload::Virtual(10), false).unwrap();
        c.send(Instant::ZERO, Payload::Virtual(0), false).unwrap();
        assert_eq!(
            c.send(Instant::ZERO, Payload::Virtual(1), false),
            Err(SendError::QueueFull)
        );
        // More packets than the sequence space may hold in flight at once.
        let config = Config {
            mss: 1,
            max_message_len: u64::MAX,
            ..Config::default()
        };
        let mut c = Connection::new(config, Instant::ZERO);
        let huge = Payload::Virtual(1 << 31);
        assert_eq!(
            c.send(Instant::ZERO, huge, false),
            Err(SendError::TooLarge(1 << 31))
        );
    }
}
