//! Latency tests, perftest style: one message in flight, timed per iteration, recorded in an
//! HDR histogram of round-trip nanoseconds.
//!
//! * `send_lat`: SEND ping-pong; both sides keep receives posted; one-way = RTT / 2.
//! * `write_lat`: RDMA WRITE ping-pong with no receives: each side writes its whole buffer into
//!   the peer's, the last byte carrying an iteration counter, and spins on the last byte of its
//!   own buffer until the peer's write shows the expected counter (the perftest trick).
//!   One-way = RTT / 2. Busy mode only: a WRITE raises no completion at the target.
//! * `read_lat`, `atomic_lat`: the client issues one READ (fetch-and-add) and waits for its
//!   completion; the server is passive. Reported as round trips.
//!
//! The client owns the clock; the server only answers. Both sides poll their CQ while they
//! spin, so providers that progress inside `poll` keep moving.

use std::time::Instant;

use fabriq_verbs::{QpState, SendFlags, SendWr, WcOpcode, WrOpcode};
use hdrhistogram::Histogram;

use super::error::{PerfError, Result, VerbsContext};
use super::proto::{Control, Mode, Msg, RegionDesc, RunParams};
use super::report::Progress;
use super::rig::{remote_slot, Poller, Rig, SendTracker};

/// Signal one request in this many in ping-pong tests (the rest are unsignaled).
const LAT_SIGNAL_EVERY: u32 = 16;

/// What a latency run hands back: the round-trip histogram and failed data checks.
pub struct LatOutcome {
    /// Round-trip times of the measured iterations, nanoseconds.
    pub rtt_ns: Histogram<u64>,
    /// Iterations whose data check failed (wrong length, unexpected atomic value).
    pub errors: u64,
}

/// A fresh histogram for round-trip nanoseconds (1 ns .. 100 s, 3 significant digits).
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3)
        .expect("invariant: constant histogram bounds 1..1e11 with 3 digits are valid")
}

fn record(h: &mut Histogram<u64>, t0: Instant) {
    let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
    h.saturating_record(ns.max(1));
}

fn send_flags(rig: &Rig, len: u32, signaled: bool) -> SendFlags {
    let mut f = SendFlags::empty();
    if signaled {
        f |= SendFlags::SIGNALED;
    }
    if len <= rig.max_inline {
        f |= SendFlags::INLINE;
    }
    f
}

/// Post one SEND of `len` bytes, first waiting for room in the send queue.
fn post_one(
    rig: &Rig,
    poller: &mut Poller,
    tracker: &mut SendTracker,
    opcode: WrOpcode,
    len: u32,
    pending_recv: &mut u64,
) -> Result<()> {
    while !tracker.has_room() {
        poller.wait("waiting for send-queue room", |wc| {
            if wc.opcode == WcOpcode::Recv {
                *pending_recv += 1;
            } else {
                tracker.on_completion(wc.wr_id);
            }
        })?;
    }
    let k = tracker.posted;
    let sge = [rig.local.sge(0, len).verbs("send buffer")?];
    let wr = SendWr::new(k, &sge, opcode).with_flags(send_flags(
        rig,
        len,
        tracker.should_signal(k, false),
    ));
    rig.qp.post_send(&[wr]).verbs("post send")?;
    tracker.posted += 1;
    Ok(())
}

/// Wait for the next receive completion, retiring send completions on the way.
fn wait_recv(
    poller: &mut Poller,
    tracker: &mut SendTracker,
    pending_recv: &mut u64,
    size: u32,
    errors: &mut u64,
) -> Result<u32> {
    let mut slot = 0u32;
    while *pending_recv == 0 {
        poller.wait("waiting for the peer's message", |wc| {
            if wc.opcode == WcOpcode::Recv {
                *pending_recv += 1;
                slot = wc.wr_id as u32;
                if wc.byte_len != size {
                    *errors += 1;
                }
            } else {
                tracker.on_completion(wc.wr_id);
            }
        })?;
    }
    *pending_recv -= 1;
    Ok(slot)
}

/// A QP that went to ERROR (peer died, transport failure) ends the run; loops that wait on
/// memory rather than completions call this now and then.
fn check_qp(rig: &Rig) -> Result<()> {
    match rig.qp.state() {
        QpState::Error => Err(PerfError::QpError),
        _ => Ok(()),
    }
}

/// `send_lat`, either side. The client returns the histogram; the server returns an empty one.
pub fn send_lat(rig: &Rig, p: &RunParams, client: bool, progress: &Progress) -> Result<LatOutcome> {
    let mut poller = Poller::new(&rig.cq, p.mode, super::STALL);
    let mut tracker = SendTracker::new(rig.sq_depth, LAT_SIGNAL_EVERY);
    let mut hist = new_histogram();
    let mut errors = 0u64;
    let mut pending_recv = 0u64;
    let total = p.warmup + p.iters;
    for i in 0..total {
        if client {
            let t0 = Instant::now();
            post_one(
                rig,
                &mut poller,
                &mut tracker,
                WrOpcode::Send,
                p.size,
                &mut pending_recv,
            )?;
            let slot = wait_recv(
                &mut poller,
                &mut tracker,
                &mut pending_recv,
                p.size,
                &mut errors,
            )?;
            if i >= p.warmup {
                record(&mut hist, t0);
            }
            rig.post_recv(slot, p.size)?;
            progress.at(i);
        } else {
            let slot = wait_recv(
                &mut poller,
                &mut tracker,
                &mut pending_recv,
                p.size,
                &mut errors,
            )?;
            post_one(
                rig,
                &mut poller,
                &mut tracker,
                WrOpcode::Send,
                p.size,
                &mut pending_recv,
            )?;
            rig.post_recv(slot, p.size)?;
        }
    }
    Ok(LatOutcome {
        rtt_ns: hist,
        errors,
    })
}

/// Where the counter byte of a `size`-byte message sits: the aligned 8-byte word holding byte
/// `size - 1`, and that byte's shift inside the (little-endian) word.
fn marker_position(size: u32) -> (usize, u32) {
    let last = size.saturating_sub(1) as usize;
    (last & !7, ((last & 7) * 8) as u32)
}

/// `write_lat`, either side.
pub fn write_lat(
    rig: &Rig,
    p: &RunParams,
    peer: &RegionDesc,
    client: bool,
    progress: &Progress,
) -> Result<LatOutcome> {
    if p.mode == Mode::Event {
        return Err(PerfError::Unsupported(
            "write_lat polls memory (a WRITE raises no completion at the target); use --mode busy"
                .into(),
        ));
    }
    let mut poller = Poller::new(&rig.cq, p.mode, super::STALL);
    let mut tracker = SendTracker::new(rig.sq_depth, LAT_SIGNAL_EVERY);
    let mut hist = new_histogram();
    let remote = remote_slot(peer, 0, rig.slot_len, p.size)?;
    let (word_off, shift) = marker_position(p.size);
    let inbox = rig.target.atomic_u64(word_off).verbs("receive marker")?;
    let last = p.size as usize - 1;
    let mut unused_recv = 0u64;
    let total = p.warmup + p.iters;

    let wait_marker = |poller: &mut Poller, tracker: &mut SendTracker, want: u8| -> Result<()> {
        let mut spins = 0u32;
        let mut since = None;
        loop {
            let word = inbox.load(std::sync::atomic::Ordering::Acquire);
            if (word >> shift) as u8 == want {
                return Ok(());
            }
            spins = spins.wrapping_add(1);
            if spins % 16 == 0 {
                poller.poll(|wc| tracker.on_completion(wc.wr_id))?;
            }
            if spins % 4096 == 0 {
                poller.check_stall(&mut since, "waiting for the peer's write")?;
                check_qp(rig)?;
            }
            poller.pause(spins);
        }
    };

    for i in 0..total {
        let want = (i.wrapping_add(1) & 0xff) as u8;
        if client {
            rig.local
                .write_at(last, &[want])
                .verbs("stamp send buffer")?;
            let t0 = Instant::now();
            post_one(
                rig,
                &mut poller,
                &mut tracker,
                WrOpcode::Write { remote },
                p.size,
                &mut unused_recv,
            )?;
            wait_marker(&mut poller, &mut tracker, want)?;
            if i >= p.warmup {
                record(&mut hist, t0);
            }
            progress.at(i);
        } else {
            wait_marker(&mut poller, &mut tracker, want)?;
            rig.local
                .write_at(last, &[want])
                .verbs("stamp send buffer")?;
            post_one(
                rig,
                &mut poller,
                &mut tracker,
                WrOpcode::Write { remote },
                p.size,
                &mut unused_recv,
            )?;
        }
    }
    Ok(LatOutcome {
        rtt_ns: hist,
        errors: 0,
    })
}

/// `read_lat` / `atomic_lat`, client side: one signaled request at a time, timed to its
/// completion. Atomics are fetch-and-add of 1 on the server's word, and each fetched value is
/// checked against the count so far.
pub fn one_sided_rtt(
    rig: &Rig,
    p: &RunParams,
    peer: &RegionDesc,
    atomic: bool,
    progress: &Progress,
) -> Result<LatOutcome> {
    let mut poller = Poller::new(&rig.cq, p.mode, super::STALL);
    let mut hist = new_histogram();
    let mut errors = 0u64;
    let len = if atomic { 8 } else { p.size };
    let remote = remote_slot(peer, 0, rig.slot_len, len)?;
    let opcode = if atomic {
        WrOpcode::AtomicFetchAdd { remote, add: 1 }
    } else {
        WrOpcode::Read { remote }
    };
    let sge = rig.local.sge(0, len).verbs("local buffer")?;
    let total = p.warmup + p.iters;
    for i in 0..total {
        let t0 = Instant::now();
        rig.qp
            .post_send(&[SendWr::new(i, &[sge], opcode)])
            .verbs("post request")?;
        let mut done = false;
        while !done {
            poller.wait("waiting for the one-sided completion", |wc| {
                if wc.wr_id == i {
                    done = true;
                }
            })?;
        }
        if i >= p.warmup {
            record(&mut hist, t0);
        }
        if atomic {
            let mut old = [0u8; 8];
            rig.local.read_at(0, &mut old).verbs("atomic result")?;
            if u64::from_ne_bytes(old) != i {
                errors += 1;
            }
        }
        progress.at(i);
    }
    Ok(LatOutcome {
        rtt_ns: hist,
        errors,
    })
}

/// The passive side of one-sided tests: keep polling the CQ (providers may progress there)
/// until the client says `End`.
pub fn serve_passive(rig: &Rig, mode: Mode, control: &mut Control) -> Result<()> {
    let mut poller = Poller::new(&rig.cq, mode, super::STALL);
    let mut spins = 0u32;
    loop {
        poller.poll(|_| {})?;
        spins = spins.wrapping_add(1);
        if spins % 1024 == 0 {
            check_qp(rig)?;
            match control.try_recv()? {
                Some(Msg::End) => return Ok(()),
                Some(other) => return Err(other.unexpected("end")),
                None => {}
            }
            match mode {
                Mode::Busy => std::thread::yield_now(),
                Mode::Event => std::thread::sleep(std::time::Duration::from_micros(100)),
            }
        } else if mode == Mode::Busy && poller.polite() {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_sits_in_the_word_holding_the_last_byte() {
        assert_eq!(marker_position(1), (0, 0));
        assert_eq!(marker_position(2), (0, 8));
        assert_eq!(marker_position(8), (0, 56));
        assert_eq!(marker_position(9), (8, 0));
        assert_eq!(marker_position(4096), (4088, 56));
    }

    #[test]
    fn histogram_covers_nanoseconds_to_seconds() {
        let mut h = new_histogram();
        h.saturating_record(1);
        h.saturating_record(10_000_000_000);
        assert_eq!(h.len(), 2);
        assert_eq!(h.min(), 1);
    }
}
