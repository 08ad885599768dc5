//! The per-QP shadow of posted work requests: restores the opcode of error completions and
//! the exact queue depth the object model promises, which devices leave loose, and keeps the
//! completions the provider makes itself in their queue's order.

use super::cq::MadeCompletions;
use super::*;

/// What fabriq posted to one QP and has not yet seen complete, in posting order.
///
/// Verbs leaves `opcode` undefined in error completions and lets a device round queue depths
/// up; the shadow restores both contracts of the object model: every completion carries the
/// opcode of the request it ends, and a queue holds exactly the depth the QP reports. Devices
/// complete each queue in order, so a successful send completion retires every entry up to the
/// oldest signaled one (unsignaled sends free their slots then, as in the device), and an error
/// completion retires the entries up to the one it names (an unsignaled send ahead of it may
/// have completed unseen; after an error every request still queued completes).
///
/// Requests posted to a QP in ERROR that the device does not complete itself (receives, which
/// a user-space queue hands to the device without telling it; sends a device refuses) get a
/// flushed completion made here. It is *held* until every request posted before it on its queue
/// has completed, so that it surfaces after their flushed completions — the order the verbs
/// model promises for each queue, on which draining a QP relies (post a marker in ERROR, wait
/// for it: nothing of the QP can complete after it). Released completions go to the CQ's
/// [`MadeCompletions`], polled with the device's.
pub(super) struct Shadow {
    pub(super) sq: Mutex<std::collections::VecDeque<SqShadow>>,
    pub(super) rq: Mutex<std::collections::VecDeque<u64>>,
    /// Made completions not yet released; locked after `sq` / `rq`.
    held: Mutex<Held>,
    pub(super) send_cq: usize,
    pub(super) recv_cq: usize,
    send_made: Arc<MadeCompletions>,
    recv_made: Arc<MadeCompletions>,
}

#[derive(Default)]
struct Held {
    sq: std::collections::VecDeque<WorkCompletion>,
    rq: std::collections::VecDeque<WorkCompletion>,
}

#[derive(Clone, Copy)]
pub(super) struct SqShadow {
    pub(super) wr_id: u64,
    pub(super) opcode: WcOpcode,
    pub(super) signaled: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// True when no send ahead can still complete with a completion of its own that we know of:
/// no signaled entry is outstanding (an unsignaled one may have completed unseen already).
fn sends_settled(sq: &std::collections::VecDeque<SqShadow>) -> bool {
    !sq.iter().any(|e| e.signaled)
}

impl Shadow {
    pub(super) fn new(send_cq: &Cq, recv_cq: &Cq) -> Shadow {
        Shadow {
            sq: Mutex::new(std::collections::VecDeque::new()),
            rq: Mutex::new(std::collections::VecDeque::new()),
            held: Mutex::new(Held::default()),
            send_cq: send_cq.raw as usize,
            recv_cq: recv_cq.raw as usize,
            send_made: send_cq.made.clone(),
            recv_made: recv_cq.made.clone(),
        }
    }

    /// A receive posted in ERROR: its flushed completion `wc`, once every receive posted before
    /// it has completed (every posted receive completes, flushed at the latest).
    pub(super) fn flush_recv(&self, wc: WorkCompletion) {
        let rq = lock(&self.rq);
        let mut held = lock(&self.held);
        if rq.is_empty() && held.rq.is_empty() {
            self.recv_made.push(wc);
        } else {
            held.rq.push_back(wc);
        }
    }

    /// A send posted in ERROR that the device refused: its flushed completion `wc`, once every
    /// signaled send posted before it has completed.
    pub(super) fn flush_send(&self, wc: WorkCompletion) {
        let sq = lock(&self.sq);
        let mut held = lock(&self.held);
        if sends_settled(&sq) && held.sq.is_empty() {
            self.send_made.push(wc);
        } else {
            held.sq.push_back(wc);
        }
    }

    /// RESET: every posted request is discarded without a completion, made ones included.
    pub(super) fn clear(&self) {
        let mut sq = lock(&self.sq);
        let mut rq = lock(&self.rq);
        let mut held = lock(&self.held);
        sq.clear();
        rq.clear();
        held.sq.clear();
        held.rq.clear();
    }

    fn release_recv(&self, rq: &std::collections::VecDeque<u64>) {
        if rq.is_empty() {
            let mut held = lock(&self.held);
            for wc in held.rq.drain(..) {
                self.recv_made.push(wc);
            }
        }
    }

    fn release_send(&self, sq: &std::collections::VecDeque<SqShadow>) {
        if sends_settled(sq) {
            let mut held = lock(&self.held);
            for wc in held.sq.drain(..) {
                self.send_made.push(wc);
            }
        }
    }

    /// Retire the entries a completion polled from CQ `cq` ends; return the opcode to report.
    /// Made completions this unblocks are released to their CQ.
    pub(super) fn complete(&self, cq: usize, wc: &IbvWc, device_opcode: WcOpcode) -> WcOpcode {
        let device_says_recv = matches!(device_opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
        let is_recv = if self.send_cq != self.recv_cq {
            cq == self.recv_cq
        } else if wc.status == 0 {
            device_says_recv
        } else {
            // One CQ for both queues and an error completion: the device's opcode is not to be
            // trusted; a flushed receive names the oldest posted receive.
            let rq = lock(&self.rq);
            let sq = lock(&self.sq);
            let rq_match = rq.front() == Some(&wc.wr_id);
            let sq_match = sq.iter().any(|e| e.wr_id == wc.wr_id);
            match (rq_match, sq_match) {
                (true, false) => true,
                (false, true) => false,
                (true, true) => device_says_recv,
                (false, false) => sq.is_empty() && !rq.is_empty(),
            }
        };
        if is_recv {
            let mut rq = lock(&self.rq);
            rq.pop_front();
            self.release_recv(&rq);
            return if wc.status == 0 {
                device_opcode
            } else {
                WcOpcode::Recv
            };
        }
        let mut sq = lock(&self.sq);
        let opcode = if wc.status != 0 {
            // Completions come in order: unsignaled sends ahead of the one named completed.
            match sq.iter().position(|e| e.wr_id == wc.wr_id) {
                Some(i) => sq.drain(..=i).next_back().map(|e| e.opcode),
                None => sq.pop_front().map(|e| e.opcode),
            }
        } else {
            let mut found = None;
            while let Some(e) = sq.pop_front() {
                if e.signaled {
                    found = Some(e.opcode);
                    break;
                }
            }
            found
        };
        self.release_send(&sq);
        opcode.unwrap_or(device_opcode)
    }
}
