//! The verbs resources one side of a run owns, and the two loops every test is built from:
//! waiting for completions ([`Poller`]) and keeping the send queue within its depth with
//! selective signaling ([`SendTracker`]).
//!
//! Both sides build the same [`Rig`]: a PD, one CQ for sends and receives, one RC QP, a `local`
//! region (the source of SENDs and WRITEs, the destination of READs and atomic results) and a
//! `target` region (where receives land and where the peer's one-sided operations go). Receives
//! are posted while the QP is in INIT, before the endpoints are exchanged, so the first message
//! never meets an empty receive queue.

use std::time::{Duration, Instant};

use fabriq_verbs::{
    AccessFlags, Capabilities, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpAttr,
    QpCaps, QpInitAttr, QueuePair, RecvWr, RemoteAddr, Rkey, WorkCompletion,
};

use super::error::{PerfError, Result, VerbsContext};
use super::proto::{Mode, RegionDesc, RunParams};
use super::TestKind;

/// Rights the target region and the QP grant to the peer.
pub const REMOTE_ALL: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

/// Bandwidth tests spread their messages over at most this many bytes of target slots: enough
/// slots that consecutive messages land in different places, few enough bytes to stay
/// cache-resident like perftest's and ucx_perftest's single buffer (a 16 MiB ring measured
/// DRAM instead: shm 1 MiB WRITE 1.3 GiB/s vs 5.7 GiB/s).
const SLOT_BYTES: u64 = 2 << 20;

/// Verbs RNR timer code for 0.01 ms.
const RNR_TIMER_10US: u8 = 1;

/// Send-queue depth of latency tests (one request in flight, room for unsignaled ones).
const LAT_SQ_DEPTH: u32 = 64;

/// Which end of the run this side plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Starts every exchange.
    Client,
    /// Answers.
    Server,
}

/// One side's verbs resources for one run.
pub struct Rig {
    /// The QP.
    pub qp: QueuePair,
    /// Its CQ (send and receive).
    pub cq: CompletionQueue,
    /// Source of SENDs/WRITEs, destination of READs and atomic results.
    pub local: MemoryRegion,
    /// Receive buffers and target of the peer's one-sided operations: `slots` slots of
    /// `slot_len` bytes.
    pub target: MemoryRegion,
    /// Bytes per target slot (the message size rounded up to 8).
    pub slot_len: u32,
    /// Slots in `target`.
    pub slots: u32,
    /// Send-queue depth granted.
    pub sq_depth: u32,
    /// Largest payload sent inline.
    pub max_inline: u32,
    /// Outstanding READ/atomic requests the device allows as initiator (0 = no limit given).
    pub max_rd_atomic: u32,
    _pd: ProtectionDomain,
}

impl Rig {
    /// Allocate everything for `params` on `ctx`, move the QP to INIT and post its receives.
    pub fn new(ctx: &Context, params: &RunParams, role: Role) -> Result<Rig> {
        let attr = ctx.query_device();
        check_capabilities(params.test, attr.capabilities, &ctx.device().name)?;
        if params.mode == Mode::Event && !attr.capabilities.contains(Capabilities::CQ_EVENTS) {
            return Err(PerfError::Unsupported(format!(
                "device {} has no CQ events; use --mode busy",
                ctx.device().name
            )));
        }
        if u64::from(params.size) > attr.max_mr_size {
            return Err(PerfError::Unsupported(format!(
                "message size {} exceeds max_mr_size {} of {}",
                params.size,
                attr.max_mr_size,
                ctx.device().name
            )));
        }
        let size = params.test.effective_size(params.size);
        let slot_len = slot_len(size);
        let slots = slot_count(params);
        let max_wr = attr.max_qp_wr.max(1);
        let sq_depth = if params.test.is_bandwidth() {
            params.tx_depth.clamp(1, max_wr)
        } else {
            LAT_SQ_DEPTH.min(max_wr)
        };
        let receives = params.test.receives_on(role);
        let rq_depth = if receives {
            params.rx_depth.clamp(1, max_wr)
        } else {
            0
        };
        let max_inline = if attr.capabilities.contains(Capabilities::INLINE) {
            attr.max_inline_data.min(256)
        } else {
            0
        };
        let cqe = (sq_depth + rq_depth + 16).min(attr.max_cqe.max(1));

        let pd = ctx.alloc_pd().verbs("allocate protection domain")?;
        let cq = ctx.create_cq(cqe).verbs("create completion queue")?;
        let local = pd
            .alloc_mr(slot_len as usize, AccessFlags::LOCAL_WRITE)
            .verbs("register local buffer")?;
        let target_len = u64::from(slot_len) * u64::from(slots);
        let target = pd
            .alloc_mr(target_len as usize, REMOTE_ALL)
            .verbs("register target buffer")?;
        let mut init = QpInitAttr::new(&cq);
        init.caps = QpCaps {
            max_send_wr: sq_depth,
            max_recv_wr: rq_depth.max(1),
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: max_inline,
        };
        init.sq_sig_all = false;
        // Touch every page now, so first-touch faults do not land in the measurement.
        prefault(&local)?;
        prefault(&target)?;
        let qp = pd.create_qp(&init).verbs("create queue pair")?;
        qp.modify(&QpAttr::init(REMOTE_ALL))
            .verbs("move queue pair to INIT")?;
        let rig = Rig {
            qp,
            cq,
            local,
            target,
            slot_len,
            slots,
            sq_depth,
            max_inline,
            max_rd_atomic: attr.max_qp_init_rd_atom,
            _pd: pd,
        };
        for i in 0..rq_depth {
            rig.post_recv(i % slots, size)?;
        }
        Ok(rig)
    }

    /// What the peer needs to reach `target`.
    pub fn region(&self) -> RegionDesc {
        RegionDesc {
            addr: self.target.addr(),
            rkey: self.target.rkey().0,
            len: self.target.len() as u64,
        }
    }

    /// Post one receive of `len` bytes into target slot `slot`; `wr_id` is the slot.
    pub fn post_recv(&self, slot: u32, len: u32) -> Result<()> {
        let sge = self
            .target
            .sge((slot * self.slot_len) as usize, len)
            .verbs("receive buffer")?;
        self.qp
            .post_recv(&[RecvWr::new(u64::from(slot), &[sge])])
            .verbs("post receive")
    }

    /// Connect the QP to the peer's endpoint (INIT → RTR → RTS). The RNR NAK timer is the
    /// shortest verbs offers (10 µs, code 1) instead of the usual 640 µs: when a streaming
    /// sender outruns the receiver's reposting it should retry as soon as receives are back,
    /// not idle for most of a millisecond, which would measure the timer rather than the
    /// transport. Retries are unlimited (`rnr_retry` 7).
    pub fn connect(&self, remote: &fabriq_verbs::QpEndpoint) -> Result<()> {
        self.qp
            .modify(&QpAttr::rtr(remote.clone()).with_min_rnr_timer(RNR_TIMER_10US))
            .verbs("move queue pair to RTR")?;
        self.qp
            .modify(&QpAttr::rts().with_rnr_retry(7))
            .verbs("move queue pair to RTS")
    }
}

/// Bytes per target slot for a message of `size` bytes: rounded up to 8, so the last byte's
/// word is aligned and atomics fit.
pub fn slot_len(size: u32) -> u32 {
    size.max(8).next_multiple_of(8)
}

/// Target slots of a run: one for latency tests; for bandwidth tests as many as the deeper
/// queue, within [`SLOT_BYTES`].
pub fn slot_count(params: &RunParams) -> u32 {
    if params.test.is_bandwidth() {
        let len = slot_len(params.test.effective_size(params.size));
        let by_bytes = (SLOT_BYTES / u64::from(len)).max(1);
        by_bytes.min(u64::from(params.tx_depth.max(params.rx_depth)).max(1)) as u32
    } else {
        1
    }
}

fn prefault(mr: &MemoryRegion) -> Result<()> {
    const CHUNK: usize = 64 * 1024;
    static ZEROS: [u8; CHUNK] = [0; CHUNK];
    let mut off = 0;
    while off < mr.len() {
        let n = CHUNK.min(mr.len() - off);
        mr.write_at(off, &ZEROS[..n]).verbs("touch buffer")?;
        off += n;
    }
    Ok(())
}

/// The peer's region, checked for the accesses a run will make.
pub fn remote_slot(region: &RegionDesc, slot: u32, slot_len: u32, len: u32) -> Result<RemoteAddr> {
    let offset = u64::from(slot) * u64::from(slot_len);
    if offset + u64::from(len) > region.len {
        return Err(PerfError::Protocol(format!(
            "peer region of {} bytes cannot hold slot {slot} of {slot_len} bytes",
            region.len
        )));
    }
    Ok(RemoteAddr {
        addr: region.addr + offset,
        rkey: Rkey(region.rkey),
    })
}

fn check_capabilities(test: TestKind, caps: Capabilities, device: &str) -> Result<()> {
    let need = test.needs();
    if caps.contains(need) {
        Ok(())
    } else {
        Err(PerfError::Unsupported(format!(
            "device {device} does not support {:?} (needed by {})",
            need.difference(caps),
            test.name()
        )))
    }
}

/// Waits for completions, busy-polling or sleeping on the CQ event fd, and turns error
/// completions into [`PerfError::Completion`]. Gives up with [`PerfError::Stalled`] when nothing
/// arrives for `stall`.
pub struct Poller {
    cq: CompletionQueue,
    mode: Mode,
    stall: Duration,
    wcs: Vec<WorkCompletion>,
    /// Step aside at every idle round ([`super::affinity::one_cpu`]).
    polite: bool,
}

impl Poller {
    /// A poller for `cq`.
    pub fn new(cq: &CompletionQueue, mode: Mode, stall: Duration) -> Self {
        Poller {
            cq: cq.clone(),
            mode,
            stall,
            wcs: vec![WorkCompletion::EMPTY; 32],
            polite: super::affinity::one_cpu(),
        }
    }

    /// Poll once, without waiting; hands each completion to `f`; returns how many.
    #[inline]
    pub fn poll(&mut self, mut f: impl FnMut(&WorkCompletion)) -> Result<usize> {
        let n = self.cq.poll(&mut self.wcs).verbs("poll completion queue")?;
        for wc in &self.wcs[..n] {
            if !wc.status.is_success() {
                return Err(PerfError::Completion {
                    opcode: wc.opcode,
                    status: wc.status,
                    wr_id: wc.wr_id,
                    vendor_err: wc.vendor_err,
                });
            }
            f(wc);
        }
        Ok(n)
    }

    /// Wait until at least one completion arrives; `what` names the wait in a stall error.
    pub fn wait(
        &mut self,
        what: &'static str,
        mut f: impl FnMut(&WorkCompletion),
    ) -> Result<usize> {
        match self.mode {
            Mode::Busy => {
                let mut spins = 0u32;
                let mut since: Option<Instant> = None;
                loop {
                    let n = self.poll(&mut f)?;
                    if n > 0 {
                        return Ok(n);
                    }
                    spins = spins.wrapping_add(1);
                    if spins % 4096 == 0 {
                        self.check_stall(&mut since, what)?;
                    }
                    self.pause(spins);
                }
            }
            Mode::Event => loop {
                let n = self.poll(&mut f)?;
                if n > 0 {
                    return Ok(n);
                }
                self.cq.req_notify(false).verbs("arm completion queue")?;
                // A completion that raced the arm is polled here, not slept through.
                let n = self.poll(&mut f)?;
                if n > 0 {
                    return Ok(n);
                }
                let woke = self
                    .cq
                    .wait_event(Some(self.stall))
                    .verbs("wait for completion event")?;
                if !woke {
                    return Err(PerfError::Stalled(self.stall, what));
                }
                self.cq
                    .ack_events()
                    .verbs("acknowledge completion events")?;
            },
        }
    }

    /// True where the process has one CPU: busy waits step aside at every idle round.
    pub fn polite(&self) -> bool {
        self.polite
    }

    /// One idle round of a busy wait (`spins` counts them): the CPU is given up every 4096th
    /// round, or at every round where the process has one CPU.
    pub fn pause(&self, spins: u32) {
        if self.polite || spins % 4096 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }

    /// Start or check a stall clock; call every few thousand idle spins.
    pub fn check_stall(&self, since: &mut Option<Instant>, what: &'static str) -> Result<()> {
        let now = Instant::now();
        match since {
            None => *since = Some(now),
            Some(t) if now.duration_since(*t) > self.stall => {
                return Err(PerfError::Stalled(self.stall, what))
            }
            Some(_) => {}
        }
        Ok(())
    }
}

/// Selective signaling bookkeeping for one send queue: request `k` (counted from 0) carries
/// `wr_id = k`; a signaled completion of `k` retires every request up to `k`.
///
/// Invariant: `completed <= posted` and `posted - completed <= depth`.
#[derive(Debug, Clone)]
pub struct SendTracker {
    /// Requests posted.
    pub posted: u64,
    /// Requests known complete.
    pub completed: u64,
    depth: u64,
    signal_every: u64,
}

impl SendTracker {
    /// `depth` outstanding at most; a signaled request every `signal_every` (clamped so one is
    /// always outstanding when the queue is full).
    pub fn new(depth: u32, signal_every: u32) -> Self {
        let depth = u64::from(depth.max(1));
        SendTracker {
            posted: 0,
            completed: 0,
            depth,
            signal_every: u64::from(signal_every).clamp(1, depth),
        }
    }

    /// Whether another request fits.
    #[inline]
    pub fn has_room(&self) -> bool {
        self.posted - self.completed < self.depth
    }

    /// How many more requests fit.
    #[inline]
    pub fn room(&self) -> u64 {
        self.depth - (self.posted - self.completed)
    }

    /// Whether request `k` must be signaled (`last` marks the final request of a stream).
    #[inline]
    pub fn should_signal(&self, k: u64, last: bool) -> bool {
        last || (k + 1) % self.signal_every == 0
    }

    /// Account a send-side completion.
    #[inline]
    pub fn on_completion(&mut self, wr_id: u64) {
        let done = wr_id.saturating_add(1).min(self.posted);
        if done > self.completed {
            self.completed = done;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_keeps_depth_and_signals_periodically() {
        let mut t = SendTracker::new(8, 4);
        assert!(t.should_signal(3, false));
        assert!(!t.should_signal(4, false));
        assert!(t.should_signal(4, true));
        for _ in 0..8 {
            assert!(t.has_room());
            t.posted += 1;
        }
        assert!(!t.has_room());
        assert_eq!(t.room(), 0);
        t.on_completion(3);
        assert_eq!(t.completed, 4);
        assert_eq!(t.room(), 4);
        // A stale completion never moves the count back; a bogus one never passes `posted`.
        t.on_completion(1);
        assert_eq!(t.completed, 4);
        t.on_completion(1000);
        assert_eq!(t.completed, 8);
    }

    #[test]
    fn signal_interval_is_clamped_to_depth() {
        let t = SendTracker::new(4, 100);
        assert!(t.should_signal(3, false));
        let t = SendTracker::new(4, 0);
        assert!(t.should_signal(0, false));
    }

    #[test]
    fn remote_slot_checks_bounds() {
        let r = RegionDesc {
            addr: 0x1000,
            rkey: 7,
            len: 64,
        };
        let a = remote_slot(&r, 1, 32, 32).expect("in bounds");
        assert_eq!(a.addr, 0x1020);
        assert_eq!(a.rkey, Rkey(7));
        assert!(remote_slot(&r, 2, 32, 8).is_err());
    }
}
