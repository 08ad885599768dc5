//! Test harness for the channel core: two [`ChannelCore`]s joined by a fake queue-pair pair in
//! virtual time (STYLE.md §2). SENDs land in the peer's posted receive slots (a SEND finding no
//! receive is counted as an RNR event and retried later, as RC would), READs execute against the
//! peer's fake memory with bounds and key checks (a bad access completes with `RemoteAccess`),
//! and tests can inject a `WcStatus` on the next work request of a kind.
//!
//! Fake memory: each side has regions named by a key (used as lkey and rkey) at address
//! `key << 40`. A region holds real bytes, or — for gigabyte messages — a *pattern* source and a
//! *sink* destination: a READ from a pattern into a sink checks that source and destination
//! offsets agree and records coverage instead of copying, so a 1 GiB transfer is verified exactly
//! without touching a gigabyte.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use fabriq_verbs::{Lkey, QpNum, RemoteAddr, Rkey, Sge, WcOpcode, WcStatus, WorkCompletion};

use super::proto::{
    ChannelConfig, ChannelCore, Event, InPayload, Instant, OutPayload, PeerGeometry, Received,
    TraceInfo, WorkRequest,
};
use super::ChannelError;

const ADDR_SHIFT: u32 = 40;

/// A region of fake memory.
#[derive(Debug)]
pub enum Region {
    Bytes(Vec<u8>),
    /// Read-only source of `len` bytes whose content is position-dependent.
    Pattern {
        len: u64,
    },
    /// Write-only destination that accepts only same-offset copies from a pattern.
    Sink {
        len: u64,
        /// Next offset expected (READs of a pull complete in order here).
        covered: u64,
        bad: bool,
    },
}

impl Region {
    fn len(&self) -> u64 {
        match self {
            Region::Bytes(v) => v.len() as u64,
            Region::Pattern { len } | Region::Sink { len, .. } => *len,
        }
    }
}

/// A side's fake memory.
#[derive(Debug, Default)]
pub struct Mem {
    regions: HashMap<u32, Region>,
    next_key: u32,
}

impl Mem {
    fn add(&mut self, r: Region) -> u32 {
        self.next_key += 1;
        let key = self.next_key;
        self.regions.insert(key, r);
        key
    }

    fn locate(&self, addr: u64, key: u32, len: u64) -> Option<u64> {
        let r = self.regions.get(&key)?;
        let base = u64::from(key) << ADDR_SHIFT;
        let off = addr.checked_sub(base)?;
        (off.checked_add(len)? <= r.len()).then_some(off)
    }
}

/// Outgoing payload handle.
#[derive(Debug)]
pub struct TestOut {
    key: u32,
    len: u64,
    /// Small payloads of every other message are also held in place (as `OutBuf::Small` is):
    /// the core frames them behind the headers instead of gathering the region.
    in_place: Option<Vec<u8>>,
}

impl OutPayload for TestOut {
    fn len(&self) -> u64 {
        self.len
    }
    fn sge(&self) -> Option<Sge> {
        Some(Sge {
            addr: u64::from(self.key) << ADDR_SHIFT,
            length: u32::try_from(self.len).ok()?,
            lkey: Lkey(self.key),
        })
    }
    fn remote(&self) -> Option<RemoteAddr> {
        Some(RemoteAddr {
            addr: u64::from(self.key) << ADDR_SHIFT,
            rkey: Rkey(self.key),
        })
    }
    fn in_place(&self) -> Option<&[u8]> {
        self.in_place.as_deref()
    }
}

/// Receive buffer handle.
#[derive(Debug)]
pub struct TestIn {
    key: u32,
    len: u64,
}

impl InPayload for TestIn {
    fn len(&self) -> u64 {
        self.len
    }
    fn sge(&self, offset: u64, len: u32) -> Option<Sge> {
        (offset + u64::from(len) <= self.len).then(|| Sge {
            addr: (u64::from(self.key) << ADDR_SHIFT) + offset,
            length: len,
            lkey: Lkey(self.key),
        })
    }
}

/// What a test saw arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Got {
    Bytes(Vec<u8>),
    /// A verified pattern transfer of this many bytes.
    Pattern(u64),
}

/// One side: the core plus its fake QP and memory.
pub struct Side {
    pub core: ChannelCore<TestOut, TestIn>,
    pub mem: Mem,
    cfg: ChannelConfig,
    rx_ring: Vec<u8>,
    posted_recvs: VecDeque<(u64, u32)>,
    sq_outstanding: u32,
    /// Unsignaled SENDs that finished but hold their send-queue entry (see `complete_send`).
    unsignaled_done: u32,
    /// SENDs posted, and how many of them asked for a completion.
    pub sends_posted: u64,
    pub signaled_sends: u64,
    pub received: Vec<(u64, Got)>,
    pub completed: Vec<u64>,
    pub errors: Vec<ChannelError>,
    /// Slow receiver: don't release delivered messages.
    pub hold: bool,
    pub held: u64,
    pub rnr_events: u64,
    pub writable_events: u64,
    /// Answer buffer requests with sinks (for pattern transfers).
    pub sink_buffers: bool,
    /// Don't answer buffer requests (memory pressure).
    pub withhold_buffers: bool,
    pending_buffers: VecDeque<(u64, u64)>,
    /// Until then, buffer requests find no memory and go back to the core
    /// (`ChannelCore::retry_buffer_request`), as the driver's do when the pool is exhausted.
    pub no_memory_until: Option<Instant>,
    /// Buffer requests handed back for want of memory.
    pub memory_refusals: u64,
    inject: VecDeque<(WcOpcode, WcStatus)>,
    /// Pumps so far: every other one leaves receive reposts for later, as the driver does in
    /// the pass that delivers a message.
    pumps: u64,
    /// Every pump leaves receive reposts for later (as far as the core lets it).
    pub always_defer: bool,
    /// Not pumped at all (a receiver busy elsewhere): arrivals still land in posted slots.
    pub paused: bool,
}

#[derive(Debug)]
enum Action {
    /// A SEND from `from` arrives at the other side.
    Arrive {
        from: usize,
        wr_id: u64,
        bytes: Vec<u8>,
        status: Option<WcStatus>,
        signaled: bool,
    },
    /// A READ by `side` completes.
    ReadDone {
        side: usize,
        wr_id: u64,
        local: Sge,
        remote: RemoteAddr,
        status: Option<WcStatus>,
    },
}

/// Two sides and the virtual wire between them.
pub struct Pair {
    pub sides: [Side; 2],
    pub now: Instant,
    pub latency: Duration,
    queue: BinaryHeap<Reverse<(Instant, u64)>>,
    actions: BTreeMap<u64, Action>,
    order: u64,
    pub steps: u64,
}

impl Side {
    fn new(cfg: ChannelConfig, peer: PeerGeometry) -> Side {
        Side {
            core: ChannelCore::new(cfg.clone(), peer).expect("valid config"),
            mem: Mem::default(),
            rx_ring: vec![0; cfg.rx_slots as usize * cfg.rx_slot_size as usize],
            cfg,
            posted_recvs: VecDeque::new(),
            sq_outstanding: 0,
            unsignaled_done: 0,
            sends_posted: 0,
            signaled_sends: 0,
            received: Vec::new(),
            completed: Vec::new(),
            errors: Vec::new(),
            hold: false,
            held: 0,
            rnr_events: 0,
            writable_events: 0,
            sink_buffers: false,
            withhold_buffers: false,
            pending_buffers: VecDeque::new(),
            no_memory_until: None,
            memory_refusals: 0,
            inject: VecDeque::new(),
            pumps: 0,
            always_defer: false,
            paused: false,
        }
    }

    /// Release `n` held messages (slow receiver catching up).
    pub fn release(&mut self, n: u64) {
        let n = n.min(self.held);
        self.held -= n;
        self.core.handle_released(n);
    }

    /// Inject `status` on the next work request completing with `opcode`.
    pub fn inject(&mut self, opcode: WcOpcode, status: WcStatus) {
        self.inject.push_back((opcode, status));
    }

    fn take_injection(&mut self, opcode: WcOpcode) -> Option<WcStatus> {
        let i = self.inject.iter().position(|(o, _)| *o == opcode)?;
        self.inject.remove(i).map(|(_, s)| s)
    }

    fn read_sge(&self, sge: &Sge) -> Vec<u8> {
        let key = sge.lkey.0;
        let off = self
            .mem
            .locate(sge.addr, key, u64::from(sge.length))
            .expect("core gathered from memory outside a live region");
        match self.mem.regions.get(&key) {
            Some(Region::Bytes(v)) => v[off as usize..off as usize + sge.length as usize].to_vec(),
            other => panic!("eager gather from a non-byte region {other:?}"),
        }
    }
}

impl Pair {
    pub fn new(cfg_a: ChannelConfig, cfg_b: ChannelConfig) -> Pair {
        let a = Side::new(cfg_a.clone(), cfg_b.ring_geometry());
        let b = Side::new(cfg_b, cfg_a.ring_geometry());
        Pair {
            sides: [a, b],
            now: Instant::ZERO,
            latency: Duration::from_micros(2),
            queue: BinaryHeap::new(),
            actions: BTreeMap::new(),
            order: 0,
            steps: 0,
        }
    }

    pub fn symmetric(cfg: ChannelConfig) -> Pair {
        Pair::new(cfg.clone(), cfg)
    }

    /// Offer `data` on side `s`; WouldBlock hands the error back.
    pub fn send(&mut self, s: usize, data: Vec<u8>) -> Result<u64, ChannelError> {
        let len = data.len() as u64;
        let small = data.len() <= super::outbuf::SMALL_MAX;
        let copy = small.then(|| data.clone());
        let key = self.sides[s].mem.add(Region::Bytes(data));
        let in_place = copy.filter(|_| key % 2 == 0);
        self.send_out(s, TestOut { key, len, in_place })
    }

    /// Offer a pattern payload of `len` bytes on side `s`.
    pub fn send_pattern(&mut self, s: usize, len: u64) -> Result<u64, ChannelError> {
        let key = self.sides[s].mem.add(Region::Pattern { len });
        self.send_out(
            s,
            TestOut {
                key,
                len,
                in_place: None,
            },
        )
    }

    fn send_out(&mut self, s: usize, out: TestOut) -> Result<u64, ChannelError> {
        let side = &mut self.sides[s];
        match side.core.send(out, TraceInfo::default()) {
            Ok(id) => Ok(id.0),
            Err((e, p)) => {
                side.mem.regions.remove(&p.key);
                Err(e)
            }
        }
    }

    fn schedule(&mut self, at: Instant, a: Action) {
        self.order += 1;
        self.queue.push(Reverse((at, self.order)));
        self.actions.insert(self.order, a);
    }

    /// Drain one side's outputs. True if anything happened.
    fn pump(&mut self, s: usize) -> bool {
        if self.sides[s].paused {
            return false;
        }
        let now = self.now;
        let mut progress = false;
        // Buffer requests: while the side has no memory, handed back as the driver does.
        while let Some(req) = self.sides[s].core.poll_buffer_request() {
            if self.sides[s].no_memory_until.is_some_and(|t| now < t) {
                self.sides[s].core.retry_buffer_request(now, req);
                self.sides[s].memory_refusals += 1;
                break;
            }
            self.sides[s].pending_buffers.push_back((req.id, req.len));
        }
        if !self.sides[s].withhold_buffers {
            while let Some((id, len)) = self.sides[s].pending_buffers.pop_front() {
                let side = &mut self.sides[s];
                let region = if side.sink_buffers {
                    Region::Sink {
                        len,
                        covered: 0,
                        bad: false,
                    }
                } else {
                    Region::Bytes(vec![0; len as usize])
                };
                let key = side.mem.add(region);
                side.core.handle_buffer(id, TestIn { key, len });
                progress = true;
            }
        }
        // Work requests; every other pump leaves the receive reposts for the next.
        self.sides[s].pumps += 1;
        let deferring = self.sides[s].always_defer || self.sides[s].pumps % 2 == 0;
        while let Some(wr) = if deferring {
            self.sides[s].core.poll_work_request_deferring(now)
        } else {
            self.sides[s].core.poll_work_request(now)
        } {
            progress = true;
            match wr {
                WorkRequest::Recv { wr_id, slot } => {
                    let side = &mut self.sides[s];
                    assert!(slot < side.cfg.rx_slots, "recv slot out of range");
                    assert!(
                        !side.posted_recvs.iter().any(|(_, sl)| *sl == slot),
                        "slot {slot} posted twice"
                    );
                    side.posted_recvs.push_back((wr_id, slot));
                }
                WorkRequest::Send {
                    wr_id,
                    head,
                    payload,
                    signaled,
                    ..
                } => {
                    let side = &mut self.sides[s];
                    // Every credit the peer holds (this frame's included) names a posted,
                    // unused slot: else a SEND could find none.
                    assert!(
                        side.core.peer_credits() <= side.posted_recvs.len() as u64,
                        "credits granted for slots not posted ({} > {})",
                        side.core.peer_credits(),
                        side.posted_recvs.len()
                    );
                    side.sq_outstanding += 1;
                    assert!(
                        side.sq_outstanding <= side.cfg.sq_depth,
                        "send queue overrun"
                    );
                    side.sends_posted += 1;
                    side.signaled_sends += u64::from(signaled);
                    let mut bytes = head.as_slice().to_vec();
                    if let Some(p) = payload {
                        bytes.extend_from_slice(&side.read_sge(&p));
                    }
                    let status = side.take_injection(WcOpcode::Send);
                    let at = now.saturating_add(self.latency);
                    self.schedule(
                        at,
                        Action::Arrive {
                            from: s,
                            wr_id,
                            bytes,
                            status,
                            signaled,
                        },
                    );
                }
                WorkRequest::Read {
                    wr_id,
                    local,
                    remote,
                } => {
                    let side = &mut self.sides[s];
                    side.sq_outstanding += 1;
                    assert!(
                        side.sq_outstanding <= side.cfg.sq_depth,
                        "send queue overrun"
                    );
                    let status = side.take_injection(WcOpcode::RdmaRead);
                    let at = now.saturating_add(self.latency * 2);
                    self.schedule(
                        at,
                        Action::ReadDone {
                            side: s,
                            wr_id,
                            local,
                            remote,
                            status,
                        },
                    );
                }
            }
        }
        // Events.
        while let Some(ev) = self.sides[s].core.poll_event() {
            progress = true;
            let side = &mut self.sides[s];
            match ev {
                Event::Received { seq, payload, .. } => {
                    let got = match payload {
                        Received::Eager(v) => Got::Bytes(v.into_vec()),
                        Received::Rendezvous { buf, len } => {
                            let r = side.mem.regions.remove(&buf.key).expect("buffer region");
                            match r {
                                Region::Bytes(mut v) => {
                                    v.truncate(len as usize);
                                    Got::Bytes(v)
                                }
                                Region::Sink { covered, bad, .. } => {
                                    assert!(!bad, "pattern transfer landed at a wrong offset");
                                    assert_eq!(covered, len, "pattern transfer incomplete");
                                    Got::Pattern(len)
                                }
                                Region::Pattern { .. } => panic!("received into a pattern"),
                            }
                        }
                    };
                    side.received.push((seq, got));
                    if side.hold {
                        side.held += 1;
                    } else {
                        side.core.handle_released(1);
                    }
                }
                Event::SendComplete { id, payload, .. } => {
                    side.completed.push(id.0);
                    // The payload is free: its memory goes away, so any later access by the
                    // peer would complete with RemoteAccess.
                    side.mem.regions.remove(&payload.key);
                }
                Event::Writable => side.writable_events += 1,
                Event::Error(e) => side.errors.push(e),
            }
        }
        // Reposts left by a deferring pump are posted by the next full one.
        progress
            || (deferring
                && !self.sides[s].always_defer
                && self.sides[s].core.reposts_pending() > 0)
    }

    fn apply(&mut self, a: Action) {
        let now = self.now;
        match a {
            Action::Arrive {
                from,
                wr_id,
                bytes,
                status,
                signaled,
            } => {
                let to = 1 - from;
                if let Some(status) = status {
                    self.complete_send(from, wr_id, status, WcOpcode::Send, 0, signaled);
                    let _ = to;
                    return;
                }
                let Some((rwr, slot)) = self.sides[to].posted_recvs.pop_front() else {
                    // RNR: the transport would back off and retry.
                    self.sides[to].rnr_events += 1;
                    let at = now.saturating_add(Duration::from_micros(10));
                    self.schedule(
                        at,
                        Action::Arrive {
                            from,
                            wr_id,
                            bytes,
                            status,
                            signaled,
                        },
                    );
                    return;
                };
                let dst = &mut self.sides[to];
                let size = dst.cfg.rx_slot_size as usize;
                let recv_status = dst.take_injection(WcOpcode::Recv);
                let (st, n) = if let Some(st) = recv_status {
                    (st, 0)
                } else if bytes.len() > size {
                    (WcStatus::LocalLength, 0)
                } else {
                    let start = slot as usize * size;
                    dst.rx_ring[start..start + bytes.len()].copy_from_slice(&bytes);
                    (WcStatus::Success, bytes.len())
                };
                let wc = WorkCompletion {
                    wr_id: rwr,
                    status: st,
                    opcode: WcOpcode::Recv,
                    byte_len: n as u32,
                    imm_data: None,
                    qp_num: QpNum(to as u32),
                    src_qp: QpNum(from as u32),
                    vendor_err: 0,
                };
                let start = slot as usize * size;
                let rx = dst.rx_ring[start..start + size].to_vec();
                dst.core.handle_completion(now, &wc, &rx);
                let sender_status = if st == WcStatus::Success {
                    WcStatus::Success
                } else {
                    WcStatus::RemoteOperation
                };
                self.complete_send(from, wr_id, sender_status, WcOpcode::Send, 0, signaled);
            }
            Action::ReadDone {
                side,
                wr_id,
                local,
                remote,
                status,
            } => {
                let peer = 1 - side;
                let len = u64::from(local.length);
                let status = status.unwrap_or_else(|| {
                    let Some(src_off) =
                        self.sides[peer].mem.locate(remote.addr, remote.rkey.0, len)
                    else {
                        return WcStatus::RemoteAccess;
                    };
                    let Some(dst_off) = self.sides[side].mem.locate(local.addr, local.lkey.0, len)
                    else {
                        return WcStatus::LocalProtection;
                    };
                    let src = &self.sides[peer].mem.regions[&remote.rkey.0];
                    let data = match src {
                        Region::Bytes(v) => {
                            Some(v[src_off as usize..(src_off + len) as usize].to_vec())
                        }
                        Region::Pattern { .. } => None,
                        Region::Sink { .. } => return WcStatus::RemoteAccess,
                    };
                    let dst = self.sides[side]
                        .mem
                        .regions
                        .get_mut(&local.lkey.0)
                        .expect("located");
                    match (dst, data) {
                        (Region::Bytes(v), Some(d)) => {
                            v[dst_off as usize..(dst_off + len) as usize].copy_from_slice(&d)
                        }
                        (Region::Sink { covered, bad, .. }, None) => {
                            if src_off != dst_off || *covered != dst_off {
                                *bad = true;
                            }
                            *covered = dst_off + len;
                        }
                        _ => return WcStatus::LocalProtection,
                    }
                    WcStatus::Success
                });
                self.complete_send(side, wr_id, status, WcOpcode::RdmaRead, local.length, true);
            }
        }
    }

    /// A send-queue request finished. As on a real queue pair, a successful unsignaled SEND
    /// gives no completion and keeps its send-queue entry until a later signaled SEND's
    /// completion (SENDs complete in order here); a failed one always completes.
    fn complete_send(
        &mut self,
        s: usize,
        wr_id: u64,
        status: WcStatus,
        op: WcOpcode,
        n: u32,
        signaled: bool,
    ) {
        let side = &mut self.sides[s];
        if !signaled && status == WcStatus::Success {
            side.unsignaled_done += 1;
            return;
        }
        side.sq_outstanding -= 1;
        if op == WcOpcode::Send && status == WcStatus::Success {
            side.sq_outstanding -= side.unsignaled_done;
            side.unsignaled_done = 0;
        }
        let wc = WorkCompletion {
            wr_id,
            status,
            opcode: op,
            byte_len: n,
            imm_data: None,
            qp_num: QpNum(s as u32),
            src_qp: QpNum(0),
            vendor_err: 0,
        };
        side.core.handle_completion(self.now, &wc, &[]);
    }

    /// Deliver raw frame bytes into side `to`'s next posted receive slot, as if its peer had
    /// sent them.
    pub fn inject_frame(&mut self, to: usize, bytes: &[u8]) {
        self.pump(to);
        let (rwr, slot) = self.sides[to]
            .posted_recvs
            .pop_front()
            .expect("a posted receive");
        let dst = &mut self.sides[to];
        let size = dst.cfg.rx_slot_size as usize;
        let start = slot as usize * size;
        let n = bytes.len().min(size);
        dst.rx_ring[start..start + n].copy_from_slice(&bytes[..n]);
        let wc = WorkCompletion {
            wr_id: rwr,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: n as u32,
            imm_data: None,
            qp_num: QpNum(to as u32),
            src_qp: QpNum(1 - to as u32),
            vendor_err: 0,
        };
        let rx = dst.rx_ring[start..start + size].to_vec();
        dst.core.handle_completion(self.now, &wc, &rx);
    }

    /// Run until both sides are idle (nothing scheduled, no deadline). Panics after `max_steps`
    /// (a livelock is a bug).
    pub fn drive(&mut self) {
        self.drive_limit(50_000_000);
    }

    pub fn drive_limit(&mut self, max_steps: u64) {
        loop {
            self.steps += 1;
            assert!(self.steps < max_steps, "harness did not go idle: livelock?");
            let p0 = self.pump(0);
            let p1 = self.pump(1);
            if p0 || p1 {
                continue;
            }
            let next_action = self.queue.peek().map(|Reverse((t, _))| *t);
            let next_timer = [0, 1]
                .iter()
                .filter_map(|&s| self.sides[s].core.poll_timeout())
                .min();
            let next = match (next_action, next_timer) {
                (None, None) => return,
                (Some(a), None) => a,
                (None, Some(t)) => t,
                (Some(a), Some(t)) => a.min(t),
            };
            if next > self.now {
                self.now = next;
            }
            if next_action.is_some_and(|a| a <= self.now) {
                let Some(Reverse((_, id))) = self.queue.pop() else {
                    continue;
                };
                if let Some(a) = self.actions.remove(&id) {
                    self.apply(a);
                }
            } else {
                for s in 0..2 {
                    if self.sides[s]
                        .core
                        .poll_timeout()
                        .is_some_and(|t| t <= self.now)
                    {
                        self.sides[s].core.handle_timeout(self.now);
                    }
                }
            }
        }
    }

    /// Step once through scheduled actions or timers (for tests that interleave sends with
    /// progress). Returns false when idle.
    pub fn step(&mut self) -> bool {
        let p0 = self.pump(0);
        let p1 = self.pump(1);
        if p0 || p1 {
            return true;
        }
        let Some(Reverse((t, id))) = self.queue.pop() else {
            let next_timer = [0, 1]
                .iter()
                .filter_map(|&s| self.sides[s].core.poll_timeout())
                .min();
            let Some(t) = next_timer else {
                return false;
            };
            self.now = self.now.max(t);
            for s in 0..2 {
                self.sides[s].core.handle_timeout(self.now);
            }
            return true;
        };
        self.now = self.now.max(t);
        if let Some(a) = self.actions.remove(&id) {
            self.apply(a);
        }
        true
    }
}
