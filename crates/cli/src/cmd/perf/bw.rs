//! Bandwidth tests, perftest style: the client keeps up to `tx_depth` requests outstanding,
//! signals one in `tx_depth / 4` (selective signaling) and posts in batches; the clock runs
//! from the first measured post to the completion of the last request.
//!
//! * `send_bw`: SENDs; the server keeps `rx_depth` receives posted over a ring of slots and
//!   counts arrivals (its own first-to-last time goes back in the report).
//! * `write_bw`: RDMA WRITEs into the server's slots; the server is passive.
//! * `read_bw`: RDMA READs from the server's slots, at most `max_qp_init_rd_atom` outstanding.

use std::time::{Duration, Instant};

use fabriq_verbs::{RecvWr, SendFlags, SendWr, WcOpcode, WrOpcode};

use super::error::{Result, VerbsContext};
use super::proto::{RegionDesc, RunParams, ServerReport};
use super::report::Progress;
use super::rig::{remote_slot, Poller, Rig, SendTracker};
use super::TestKind;

/// Requests handed to one `post_send` call.
const POST_BATCH: usize = 16;

/// The client's measurement of a bandwidth run.
#[derive(Debug, Clone, Copy)]
pub struct BwOutcome {
    /// From the first measured post to the last completion.
    pub elapsed: Duration,
    /// Requests outstanding at most.
    pub depth: u32,
}

/// The client side of `send_bw` / `write_bw` / `read_bw`.
pub fn client(
    rig: &Rig,
    p: &RunParams,
    peer: &RegionDesc,
    progress: &Progress,
) -> Result<BwOutcome> {
    let mut depth = rig.sq_depth;
    if p.test == TestKind::ReadBw && rig.max_rd_atomic > 0 {
        depth = depth.min(rig.max_rd_atomic);
    }
    let mut poller = Poller::new(&rig.cq, p.mode, super::STALL);
    // Warm-up stream first, then the measured one, so neither's tail skews the other.
    if p.warmup > 0 {
        stream(rig, p, peer, depth, p.warmup, &mut poller, &Progress::off())?;
    }
    let t0 = Instant::now();
    stream(rig, p, peer, depth, p.iters, &mut poller, progress)?;
    Ok(BwOutcome {
        elapsed: t0.elapsed(),
        depth,
    })
}

fn stream(
    rig: &Rig,
    p: &RunParams,
    peer: &RegionDesc,
    depth: u32,
    count: u64,
    poller: &mut Poller,
    progress: &Progress,
) -> Result<()> {
    let mut tracker = SendTracker::new(depth, (depth / 4).max(1));
    let sge = [rig.local.sge(0, p.size).verbs("local buffer")?];
    let mut remotes = Vec::with_capacity(rig.slots as usize);
    for slot in 0..rig.slots {
        remotes.push(remote_slot(peer, slot, rig.slot_len, p.size)?);
    }
    let inline = p.test != TestKind::ReadBw && p.size <= rig.max_inline;
    let mut batch: Vec<SendWr<'_>> = Vec::with_capacity(POST_BATCH);
    while tracker.completed < count {
        let room = tracker.room().min(count - tracker.posted) as usize;
        if room > 0 {
            batch.clear();
            for _ in 0..room.min(POST_BATCH) {
                let k = tracker.posted + batch.len() as u64;
                let remote = remotes[(k % u64::from(rig.slots)) as usize];
                let opcode = match p.test {
                    TestKind::WriteBw => WrOpcode::Write { remote },
                    TestKind::ReadBw => WrOpcode::Read { remote },
                    _ => WrOpcode::Send,
                };
                let mut flags = SendFlags::empty();
                if tracker.should_signal(k, k + 1 == count) {
                    flags |= SendFlags::SIGNALED;
                }
                if inline {
                    flags |= SendFlags::INLINE;
                }
                batch.push(SendWr::new(k, &sge, opcode).with_flags(flags));
            }
            match rig.qp.post_send(&batch) {
                Ok(()) => tracker.posted += batch.len() as u64,
                // Requests before the refused one were posted; a full queue is back-pressure.
                Err(e) if matches!(e.source, fabriq_verbs::VerbsError::QueueFull) => {
                    tracker.posted += e.index as u64;
                }
                Err(e) => return Err(e).verbs("post send"),
            }
            poller.poll(|wc| tracker.on_completion(wc.wr_id))?;
        } else {
            poller.wait("waiting for send completions", |wc| {
                tracker.on_completion(wc.wr_id)
            })?;
        }
        progress.at(tracker.completed);
    }
    Ok(())
}

/// The server side of `send_bw`: count `warmup + iters` receives, reposting each at once.
pub fn send_sink(rig: &Rig, p: &RunParams) -> Result<ServerReport> {
    let mut poller = Poller::new(&rig.cq, p.mode, super::STALL);
    let total = p.warmup + p.iters;
    let mut received = 0u64;
    let mut errors = 0u64;
    let mut first: Option<Instant> = None;
    let mut repost: Vec<u32> = Vec::with_capacity(32);
    while received < total {
        repost.clear();
        poller.wait("waiting for the client's sends", |wc| {
            if wc.opcode == WcOpcode::Recv {
                received += 1;
                if wc.byte_len != p.size {
                    errors += 1;
                }
                repost.push(wc.wr_id as u32);
            }
        })?;
        if first.is_none() && received > p.warmup {
            first = Some(Instant::now());
        }
        // Keep the receive queue full; receives left over at the end are flushed with the QP.
        let want = repost.len();
        if want > 0 {
            let sges: Vec<_> = repost[..want]
                .iter()
                .map(|&slot| rig.target.sge((slot * rig.slot_len) as usize, p.size))
                .collect::<std::result::Result<_, _>>()
                .verbs("receive buffer")?;
            let wrs: Vec<RecvWr<'_>> = repost[..want]
                .iter()
                .zip(&sges)
                .map(|(&slot, sge)| RecvWr::new(u64::from(slot), std::slice::from_ref(sge)))
                .collect();
            rig.qp.post_recv(&wrs).verbs("repost receives")?;
        }
    }
    let elapsed_ns = first
        .map(|t| u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0);
    Ok(ServerReport {
        messages: received,
        elapsed_ns,
        errors,
    })
}
