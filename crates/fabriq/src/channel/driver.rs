//! Binds one [`ChannelCore`] to a real [`QueuePair`]: owns the registered receive ring and the
//! send-header slots, posts what the core asks for in the order it asks, copies a completed
//! receive slot out for the core, and answers the core's buffer requests from the worker's
//! [`MemPool`]. It owns no protocol decision: every `if` about credits, sequence numbers or
//! thresholds lives in `proto.rs`.
//!
//! Completion polling is not here: the worker polls its CQ (shared by many channels) and hands
//! each completion to the driver of the QP it names.

use std::collections::VecDeque;

use fabriq_verbs::{
    AccessFlags, MemoryRegion, ProtectionDomain, QueuePair, RecvWr, RemoteAddr, SendFlags, SendWr,
    Sge, WorkCompletion, WrOpcode,
};

use super::outbuf::OutBuf;
use super::proto::{
    ChannelConfig, ChannelCore, Event, InPayload, Instant, OutPayload, PeerGeometry, TraceInfo,
    WorkRequest,
};
use super::wire::MAX_HEAD_LEN;
use super::ChannelError;
use crate::mempool::{MemPool, PoolBuf, PoolError};

/// Bytes per send-header slot.
const TX_SLOT: usize = 64;

/// Access of a channel's own regions: only its QP writes into them.
pub const REGION_ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE;
/// Largest send (headers + payload) the endpoint asks its QPs to take inline.
pub const INLINE_MAX: u32 = 128;

/// Bits of a work-request id that carry the driver's epoch (below the core's kind byte, above
/// any slot or READ token the core uses).
const EPOCH_SHIFT: u32 = 40;
const EPOCH_MASK: u64 = 0xFFFF << EPOCH_SHIFT;

/// A fresh epoch for each driver: a QP taken from the QP cache gets a driver whose epoch
/// differs from the previous one's (the last 65 535 of them).
fn next_epoch() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    (NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) & 0xFFFF) << EPOCH_SHIFT
}
const _: () = assert!(MAX_HEAD_LEN <= TX_SLOT);

impl OutPayload for PoolBuf {
    fn len(&self) -> u64 {
        PoolBuf::len(self) as u64
    }
    fn sge(&self) -> Option<Sge> {
        u32::try_from(PoolBuf::len(self))
            .ok()
            .map(|_| PoolBuf::sge(self))
    }
    fn remote(&self) -> Option<RemoteAddr> {
        Some(PoolBuf::remote(self))
    }
}

impl InPayload for PoolBuf {
    fn len(&self) -> u64 {
        self.capacity() as u64
    }
    fn sge(&self, offset: u64, len: u32) -> Option<Sge> {
        let end = offset.checked_add(u64::from(len))?;
        (end <= self.capacity() as u64).then(|| Sge {
            addr: self.addr() + offset,
            length: len,
            lkey: self.lkey(),
        })
    }
}

/// Where the driver takes buffers for rendezvous pulls.
pub trait BufferSource {
    /// A registered buffer of length `len`.
    fn alloc_any(&mut self, len: usize) -> Result<PoolBuf, PoolError>;
}

impl BufferSource for MemPool {
    fn alloc_any(&mut self, len: usize) -> Result<PoolBuf, PoolError> {
        MemPool::alloc_any(self, len)
    }
}

/// The core type the driver runs.
pub type Core = ChannelCore<OutBuf, PoolBuf>;
/// The events it produces.
pub type CoreEvent = Event<OutBuf, PoolBuf>;

/// A channel end bound to a queue pair.
pub struct ChannelDriver {
    qp: QueuePair,
    core: Core,
    rx_ring: MemoryRegion,
    tx_heads: MemoryRegion,
    slot_size: usize,
    scratch: Vec<u8>,
    /// Sends up to this many bytes (headers + payload) are posted inline.
    inline_max: u32,
    /// Stamped into every work-request id this driver posts (`EPOCH_MASK`): a completion of
    /// an earlier connection on the same QP (one that raced the QP's drain: a peer's SEND that
    /// took a receive of the old ring just before the QP went to ERROR, completed after the
    /// flush) is recognised and dropped instead of being read as this connection's.
    epoch: u64,
    /// Completions dropped for another epoch.
    stale: u64,
    /// False while the peer has not yet confirmed that its receive ring is posted (accepting
    /// side, between the hello-ack and the peer's `Ready` or first message): sends and READs
    /// wait in `held`, in order; receives are posted at once.
    peer_ready: bool,
    /// Send-queue work requests held until the peer is ready.
    held: VecDeque<WorkRequest>,
    /// Receive slots in the ring.
    rx_slots: usize,
    /// Where the peer's next message is expected: the address of the receive slot after the
    /// last one completed (slots are posted, and taken by the peer's sends, in ring order).
    /// 0 before the first message. A prefetch hint ([`ChannelDriver::next_rx_addr`]).
    next_rx: usize,
}

impl std::fmt::Debug for ChannelDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelDriver")
            .field("qp", &self.qp)
            .field("stats", &self.core.stats())
            .finish()
    }
}

impl ChannelDriver {
    /// Register the ring and header slots on `pd` and build the core. Nothing is posted yet:
    /// call [`ChannelDriver::post_ready`] (the QP must be in INIT or later) before the peer may
    /// send.
    pub fn new(
        pd: &ProtectionDomain,
        qp: QueuePair,
        config: ChannelConfig,
        peer: PeerGeometry,
    ) -> Result<ChannelDriver, ChannelError> {
        let [rx, tx] = Self::region_sizes(&config);
        let rx_ring = pd.alloc_mr(rx, REGION_ACCESS)?;
        let tx_heads = pd.alloc_mr(tx, REGION_ACCESS)?;
        Self::with_regions(qp, config, peer, [rx_ring, tx_heads])
    }

    /// The lengths of the two regions a channel of `config` needs: its receive ring and its
    /// send-header slots (both registered with [`REGION_ACCESS`]).
    pub fn region_sizes(config: &ChannelConfig) -> [usize; 2] {
        [
            config.rx_slot_size as usize * config.rx_slots as usize,
            TX_SLOT * config.sq_depth as usize,
        ]
    }

    /// [`ChannelDriver::new`] on regions already registered (of [`ChannelDriver::region_sizes`],
    /// e.g. from a released connection: their old bytes are never read). Refuses regions of
    /// another size.
    pub fn with_regions(
        qp: QueuePair,
        config: ChannelConfig,
        peer: PeerGeometry,
        [rx_ring, tx_heads]: [MemoryRegion; 2],
    ) -> Result<ChannelDriver, ChannelError> {
        if [rx_ring.len(), tx_heads.len()] != Self::region_sizes(&config) {
            return Err(ChannelError::InvalidConfig(
                "channel regions of another geometry".into(),
            ));
        }
        let slot_size = config.rx_slot_size as usize;
        let rx_slots = config.rx_slots as usize;
        let core = ChannelCore::new(config, peer)?;
        let inline_max = qp.query().caps.max_inline_data;
        Ok(ChannelDriver {
            qp,
            core,
            rx_ring,
            tx_heads,
            slot_size,
            scratch: vec![0; slot_size],
            inline_max,
            epoch: next_epoch(),
            stale: 0,
            peer_ready: true,
            held: VecDeque::new(),
            rx_slots,
            next_rx: 0,
        })
    }

    /// The driver's regions back (receive ring, send-header slots), for the next connection.
    /// Only once nothing posted on the QP can still complete into them (the QP drained).
    pub fn into_regions(self) -> [MemoryRegion; 2] {
        [self.rx_ring, self.tx_heads]
    }

    /// The peer's receive ring, once its hello is read ([`ChannelCore::set_peer`]): a driver
    /// may be made, and its ring posted, before it is known.
    pub fn set_peer(&mut self, peer: PeerGeometry) -> Result<(), ChannelError> {
        self.core.set_peer(peer)
    }

    /// Hold every send and READ until [`ChannelDriver::set_peer_ready`] or a receive
    /// completion shows that the peer has its receive ring posted (the accepting side returns
    /// its channel as soon as its hello-ack is out, the way an IB CM passive side may use its
    /// QP before the RTU: its first send waits for the peer, not the accept).
    pub fn await_peer(&mut self) {
        self.peer_ready = false;
    }

    /// The peer confirmed it is ready: what was held is posted by the next
    /// [`ChannelDriver::pump`].
    pub fn set_peer_ready(&mut self) {
        self.peer_ready = true;
    }

    /// True until the peer confirmed it is ready (see [`ChannelDriver::await_peer`]).
    pub fn awaiting_peer(&self) -> bool {
        !self.peer_ready
    }

    /// Send-queue work requests held for the peer's confirmation.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The queue pair.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The protocol core (stats, thresholds).
    pub fn core(&self) -> &Core {
        &self.core
    }

    /// The protocol core, mutably (set thresholds, release, send).
    pub fn core_mut(&mut self) -> &mut Core {
        &mut self.core
    }

    /// Queue a payload.
    #[allow(clippy::result_large_err)] // the payload is handed back, not boxed
    pub fn send(
        &mut self,
        payload: OutBuf,
        trace: TraceInfo,
    ) -> Result<u64, (ChannelError, OutBuf)> {
        self.core.send(payload, trace).map(|id| id.0)
    }

    /// Largest payload sent eagerly now (a larger one must be in registered memory).
    pub fn eager_limit(&self) -> u64 {
        self.core.eager_limit()
    }

    /// Feed one completion of this QP to the core.
    pub fn handle_completion(&mut self, now: Instant, wc: &WorkCompletion) {
        if wc.wr_id & EPOCH_MASK != self.epoch {
            self.stale += 1;
            tracing::debug!(
                qp = wc.qp_num.0,
                status = ?wc.status,
                "completion of an earlier connection on this QP dropped"
            );
            return;
        }
        let mut own = *wc;
        own.wr_id &= !EPOCH_MASK;
        let wc = &own;
        let is_recv = super::proto::is_recv_wr(wc.wr_id) && wc.status.is_success();
        if is_recv {
            // The peer posts its ring before it may send: a message from it confirms it.
            self.peer_ready = true;
            let slot = (wc.wr_id & 0xFFFF_FFFF) as usize;
            // (No division on the message's path: `slot` is below `rx_slots`.)
            let next = if slot + 1 < self.rx_slots {
                slot + 1
            } else {
                0
            };
            self.next_rx = self.rx_ring.as_ptr() as usize + next * self.slot_size;
            let n = (wc.byte_len as usize).min(self.slot_size);
            let read = self
                .scratch
                .get_mut(..n)
                .map(|dst| self.rx_ring.read_at(slot * self.slot_size, dst));
            match read {
                Some(Ok(())) => {
                    let bytes = self.scratch.get(..n).unwrap_or(&[]);
                    self.core.handle_completion(now, wc, bytes);
                }
                _ => self.core.handle_completion(now, wc, &[]),
            }
        } else {
            self.core.handle_completion(now, wc, &[]);
        }
    }

    /// Where the peer's next message will be written: the receive slot after the last one
    /// completed, 0 before the first message. A thread about to poll the completion of that
    /// message can start fetching the slot first ([`fabriq_verbs::hint::prefetch_read`]), so
    /// that reading it does not wait for the line to come over from the writer's core after
    /// the completion was found. Only a hint: the peer may not have sent, or a flushed
    /// connection may take its slots out of order.
    pub fn next_rx_addr(&self) -> usize {
        self.next_rx
    }

    /// Answer buffer requests from `pool`, then post every work request the core has (send
    /// queue first, then receive slots). Returns how many work requests were posted. A post
    /// the QP refuses fails the channel.
    pub fn pump(&mut self, now: Instant, pool: &mut impl BufferSource) -> usize {
        self.pump_with(now, pool, false)
    }

    /// [`ChannelDriver::pump`] that leaves receive slots to repost for a later pump, as far as
    /// the core allows (`ChannelCore::poll_work_request_deferring`): for the pass that just
    /// delivered a message, whose reader should not wait for the reposts.
    pub fn pump_deferring(&mut self, now: Instant, pool: &mut impl BufferSource) -> usize {
        self.pump_with(now, pool, true)
    }

    /// Receive slots waiting to be posted (left by [`ChannelDriver::pump_deferring`]).
    pub fn reposts_pending(&self) -> usize {
        self.core.reposts_pending()
    }

    fn pump_with(&mut self, now: Instant, pool: &mut impl BufferSource, defer: bool) -> usize {
        while let Some(req) = self.core.poll_buffer_request() {
            let Ok(len) = usize::try_from(req.len) else {
                self.core
                    .handle_fatal(ChannelError::InvalidConfig("message too large".into()));
                return 0;
            };
            match pool.alloc_any(len) {
                Ok(buf) => self.core.handle_buffer(req.id, buf),
                Err(PoolError::Exhausted {
                    requested, limit, ..
                }) if requested > limit => {
                    // More than the pool may ever register (`Config::pool_max_bytes`): no
                    // memory freed later would make room, and waiting would hold up the
                    // connection's every later message, silently.
                    self.core.handle_fatal(ChannelError::MessageTooLarge {
                        len: req.len,
                        max: limit as u64,
                    });
                    return 0;
                }
                Err(e) => {
                    // Out of memory for now: the pull waits and the request is asked again on
                    // the next pump.
                    tracing::debug!(%e, len, "no buffer for rendezvous pull yet");
                    self.core.retry_buffer_request(now, req);
                    break;
                }
            }
        }
        let mut posted = 0;
        if self.peer_ready {
            while let Some(wr) = self.held.pop_front() {
                if let Err(e) = self.post(&wr) {
                    self.core.handle_fatal(e);
                    return posted;
                }
                posted += 1;
            }
        }
        while let Some(wr) = if defer {
            self.core.poll_work_request_deferring(now)
        } else {
            self.core.poll_work_request(now)
        } {
            if !self.peer_ready && !matches!(wr, WorkRequest::Recv { .. }) {
                self.held.push_back(wr);
                continue;
            }
            if let Err(e) = self.post(&wr) {
                self.core.handle_fatal(e);
                break;
            }
            posted += 1;
        }
        posted
    }

    /// Post what the core has without serving buffer requests: used once at set-up to post the
    /// receive ring before the peer may send.
    pub fn post_ready(&mut self, now: Instant) -> Result<usize, ChannelError> {
        let mut posted = 0;
        while let Some(wr) = self.core.poll_work_request(now) {
            self.post(&wr)?;
            posted += 1;
        }
        Ok(posted)
    }

    fn post(&mut self, wr: &WorkRequest) -> Result<(), ChannelError> {
        match *wr {
            WorkRequest::Recv { wr_id, slot } => {
                let sge = self
                    .rx_ring
                    .sge(slot as usize * self.slot_size, self.slot_size as u32)?;
                self.qp
                    .post_recv(&[RecvWr::new(wr_id | self.epoch, &[sge])])
                    .map_err(|e| ChannelError::Verbs(e.source))
            }
            WorkRequest::Send {
                wr_id,
                tx_slot,
                head,
                payload,
                signaled,
            } => {
                let bytes = head.as_slice();
                let payload = payload.filter(|p| p.length > 0);
                let total = bytes.len() as u64 + payload.map_or(0, |p| u64::from(p.length));
                let flags = if signaled {
                    SendFlags::SIGNALED
                } else {
                    SendFlags::empty()
                };
                if total <= u64::from(self.inline_max) {
                    // Inline: the headers go from where they were built (no header slot to
                    // write), the payload, if any, gathered after them.
                    return self
                        .qp
                        .post_send(&[SendWr::new(
                            wr_id | self.epoch,
                            payload.as_slice(),
                            WrOpcode::Send,
                        )
                        .with_flags(flags)
                        .with_inline_data(bytes)])
                        .map_err(|e| ChannelError::Verbs(e.source));
                }
                let off = tx_slot as usize * TX_SLOT;
                self.tx_heads.write_at(off, bytes)?;
                let head_sge = self.tx_heads.sge(off, bytes.len() as u32)?;
                let sges;
                let list: &[Sge] = match payload {
                    Some(p) => {
                        sges = [head_sge, p];
                        &sges
                    }
                    None => std::slice::from_ref(&head_sge),
                };
                self.qp
                    .post_send(&[
                        SendWr::new(wr_id | self.epoch, list, WrOpcode::Send).with_flags(flags)
                    ])
                    .map_err(|e| ChannelError::Verbs(e.source))
            }
            WorkRequest::Read {
                wr_id,
                local,
                remote,
            } => self
                .qp
                .post_send(&[
                    SendWr::new(wr_id | self.epoch, &[local], WrOpcode::Read { remote })
                        .with_flags(SendFlags::SIGNALED),
                ])
                .map_err(|e| ChannelError::Verbs(e.source)),
        }
    }

    /// Completions dropped because they belonged to an earlier connection on this QP.
    pub fn stale_completions(&self) -> u64 {
        self.stale
    }

    /// True when the core has an event for [`ChannelDriver::poll_event`].
    pub fn has_events(&self) -> bool {
        self.core.has_events()
    }

    /// Next event of the core.
    pub fn poll_event(&mut self) -> Option<CoreEvent> {
        self.core.poll_event()
    }

    /// Next send completion of the core ([`ChannelCore::poll_send_complete`]).
    pub fn poll_send_complete(&mut self) -> Option<CoreEvent> {
        self.core.poll_send_complete()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use crate::mempool::PoolConfig;
    use fabriq_verbs::{CompletionQueue, Context, QpAttr, QpInitAttr, WcOpcode, WcStatus};

    /// The accepting side's driver before the peer confirmed its ring: its receive ring is
    /// posted, but a message it is given stays held (nothing reaches the peer's QP, which has
    /// a receive posted and would complete it) until the peer is said to be ready; then the
    /// held SEND goes out, in order before a later one.
    /// Two QPs of one shm0 context in INIT, each with a CQ of its own.
    struct QpPair {
        pd: ProtectionDomain,
        cq_a: CompletionQueue,
        cq_b: CompletionQueue,
        qa: QueuePair,
        qb: QueuePair,
    }

    fn qp_pair() -> QpPair {
        let ctx = Context::open("shm0").expect("shm0");
        let pd = ctx.alloc_pd().expect("pd");
        let (cq_a, cq_b) = (
            ctx.create_cq(64).expect("cq"),
            ctx.create_cq(64).expect("cq"),
        );
        let qa = pd.create_qp(&QpInitAttr::new(&cq_a)).expect("qp");
        let qb = pd.create_qp(&QpInitAttr::new(&cq_b)).expect("qp");
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
        for q in [&qa, &qb] {
            q.modify(&QpAttr::init(access)).expect("init");
        }
        QpPair {
            pd,
            cq_a,
            cq_b,
            qa,
            qb,
        }
    }

    #[test]
    fn sends_are_held_until_the_peer_is_ready_and_then_go_in_order() {
        let QpPair {
            pd,
            cq_a: _cq_a,
            cq_b,
            qa,
            qb,
        } = qp_pair();
        let cfg = ChannelConfig::default();
        let geo = cfg.ring_geometry();
        let t = Instant::from_nanos(1);
        let mut a = ChannelDriver::new(&pd, qa.clone(), cfg.clone(), geo).expect("driver a");
        let mut b = ChannelDriver::new(&pd, qb.clone(), cfg, geo).expect("driver b");
        a.await_peer();
        assert!(
            a.post_ready(t).expect("ring a") > 0,
            "receives are never held"
        );
        b.post_ready(t).expect("ring b");
        for (q, peer) in [(&qa, &qb), (&qb, &qa)] {
            q.modify(&QpAttr::rtr(peer.endpoint())).expect("rtr");
            q.modify(&QpAttr::rts()).expect("rts");
        }
        let mut pool = MemPool::new(&pd, PoolConfig::default()).expect("pool");
        let mut msg = |bytes: &[u8]| {
            let mut buf = pool.alloc_any(bytes.len()).expect("buf");
            buf.set_len(bytes.len());
            buf.copy_from_slice(bytes);
            buf
        };
        // One payload gathered from the pool, one held in place behind the headers.
        let first = OutBuf::Pool(msg(b"first"));
        let second = OutBuf::Small(
            crate::channel::outbuf::SmallBuf::from_parts(&[b"sec", b"ond"]).expect("small"),
        );
        a.send(first, TraceInfo::default())
            .map_err(|(e, _)| e)
            .expect("send");
        assert_eq!(a.pump(t, &mut pool), 0);
        assert_eq!(a.held(), 1);
        let mut wcs = vec![WorkCompletion::EMPTY; 8];
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            cq_b.poll(&mut wcs).expect("poll b"),
            0,
            "a held SEND reached the peer"
        );
        a.set_peer_ready();
        a.send(second, TraceInfo::default())
            .map_err(|(e, _)| e)
            .expect("send");
        assert_eq!(a.pump(t, &mut pool), 2);
        assert_eq!(a.held(), 0);
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while got.len() < 2 && std::time::Instant::now() < deadline {
            let n = cq_b.poll(&mut wcs).expect("poll b");
            for wc in wcs.iter().take(n) {
                b.handle_completion(t, wc);
            }
            while let Some(ev) = b.poll_event() {
                if let Event::Received {
                    payload: super::super::proto::Received::Eager(bytes),
                    ..
                } = ev
                {
                    got.push(bytes.into_vec());
                }
            }
        }
        assert_eq!(got, vec![b"first".to_vec(), b"second".to_vec()]);
        assert!(!b.awaiting_peer());
    }

    /// `next_rx_addr` names the slot the next message lands in: the one after the slot just
    /// completed, wrapping at the ring's end (the receiving side's prefetch hint relies on the
    /// peer's sends taking the posted slots in ring order, reposts included).
    #[test]
    fn the_next_receive_lands_where_the_hint_says() {
        let QpPair {
            pd,
            cq_a,
            cq_b,
            qa,
            qb,
        } = qp_pair();
        let cfg = ChannelConfig {
            rx_slots: 4,
            ..ChannelConfig::default()
        };
        let geo = cfg.ring_geometry();
        let t = Instant::from_nanos(1);
        let mut a = ChannelDriver::new(&pd, qa.clone(), cfg.clone(), geo).expect("driver a");
        let mut b = ChannelDriver::new(&pd, qb.clone(), cfg.clone(), geo).expect("driver b");
        a.post_ready(t).expect("ring a");
        b.post_ready(t).expect("ring b");
        for (q, peer) in [(&qa, &qb), (&qb, &qa)] {
            q.modify(&QpAttr::rtr(peer.endpoint())).expect("rtr");
            q.modify(&QpAttr::rts()).expect("rts");
        }
        assert_eq!(b.next_rx_addr(), 0, "no hint before the first message");
        let base = b.rx_ring.as_ptr() as usize;
        let slot_size = cfg.rx_slot_size as usize;
        let mut pool = MemPool::new(&pd, PoolConfig::default()).expect("pool");
        let mut wcs = vec![WorkCompletion::EMPTY; 8];
        let mut hinted = None;
        let mut now = 1u64;
        // Three times round the ring, each message delivered (and its slot reposted) before
        // the next is sent; the time moves on, so that the credit and ack updates go out.
        for i in 0..12u32 {
            let body =
                crate::channel::outbuf::SmallBuf::from_parts(&[&i.to_le_bytes()]).expect("small");
            a.send(OutBuf::Small(body), TraceInfo::default())
                .map_err(|(e, _)| e)
                .expect("send");
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            let mut slot = None;
            while slot.is_none() && std::time::Instant::now() < deadline {
                now += 1_000_000;
                let t = Instant::from_nanos(now);
                a.pump(t, &mut pool);
                let n = cq_b.poll(&mut wcs).expect("poll b");
                for wc in wcs.iter().take(n) {
                    if wc.opcode == WcOpcode::Recv && wc.status == WcStatus::Success {
                        let s = (wc.wr_id & 0xFFFF_FFFF) as usize;
                        if slot.replace(s).is_some() {
                            panic!("two messages for one send");
                        }
                    }
                    b.handle_completion(t, wc);
                }
                while let Some(ev) = b.poll_event() {
                    if matches!(ev, Event::Received { .. }) {
                        b.core_mut().handle_released(1); // read by the application
                    }
                }
                b.pump(t, &mut pool);
                let n = cq_a.poll(&mut wcs).expect("poll a");
                for wc in wcs.iter().take(n) {
                    a.handle_completion(t, wc);
                }
                while a.poll_event().is_some() {}
            }
            let slot = slot.unwrap_or_else(|| panic!("message {i} not received"));
            if let Some(h) = hinted {
                assert_eq!(base + slot * slot_size, h, "message {i} landed elsewhere");
            }
            let next = b.next_rx_addr();
            assert_eq!(next, base + ((slot + 1) % 4) * slot_size);
            hinted = Some(next);
        }
    }

    /// A completion left over from an earlier connection on the same QP (it raced the QP's
    /// drain) carries that connection's epoch: the new driver drops it instead of reading a
    /// slot of its own fresh ring as a frame (which once failed a new connection with "bad
    /// magic/version 0x0000"); its own completions go through.
    #[test]
    fn completions_of_an_earlier_epoch_are_dropped() {
        let ctx = Context::open("shm0").expect("shm0");
        let pd = ctx.alloc_pd().expect("pd");
        let cq = ctx.create_cq(64).expect("cq");
        let qp = pd.create_qp(&QpInitAttr::new(&cq)).expect("qp");
        let cfg = ChannelConfig::default();
        let geo = cfg.ring_geometry();
        let old = ChannelDriver::new(&pd, qp.clone(), cfg.clone(), geo).expect("old driver");
        let mut new = ChannelDriver::new(&pd, qp.clone(), cfg, geo).expect("new driver");
        assert_ne!(old.epoch, new.epoch);
        let recv_of = |epoch: u64| WorkCompletion {
            wr_id: (1 << 56) | epoch, // a receive into slot 0
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: 40,
            qp_num: qp.qp_num(),
            ..WorkCompletion::EMPTY
        };
        new.handle_completion(Instant::from_nanos(1), &recv_of(old.epoch));
        assert_eq!(new.stale_completions(), 1);
        assert!(
            !new.core().is_failed(),
            "a stale completion must not reach the core"
        );
        // The new driver's own receive of an empty slot is a real protocol error.
        new.handle_completion(Instant::from_nanos(2), &recv_of(new.epoch));
        assert_eq!(new.stale_completions(), 1);
        assert!(new.core().is_failed());
    }
}
