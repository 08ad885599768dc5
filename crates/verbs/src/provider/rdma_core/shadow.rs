//! The per-QP shadow of posted work requests: restores the opcode of error completions and
//! the exact queue depth the object model promises, which devices leave loose.

#![allow(unsafe_code)]

use super::*;

/// What fabriq posted to one QP and has not yet seen complete, in posting order.
///
/// Verbs leaves `opcode` undefined in error completions and lets a device round queue depths
/// up; the shadow restores both contracts of the object model: every completion carries the
/// opcode of the request it ends, and a queue holds exactly the depth the QP reports. Devices
/// complete each queue in order, so a successful send completion retires every entry up to the
/// oldest signaled one (unsignaled sends free their slots then, as in the device), and an error
/// completion retires exactly the oldest entry (after an error every request completes).
pub(super) struct Shadow {
    pub(super) sq: Mutex<std::collections::VecDeque<SqShadow>>,
    pub(super) rq: Mutex<std::collections::VecDeque<u64>>,
    pub(super) send_cq: usize,
    pub(super) recv_cq: usize,
}

#[derive(Clone, Copy)]
pub(super) struct SqShadow {
    pub(super) wr_id: u64,
    pub(super) opcode: WcOpcode,
    pub(super) signaled: bool,
}

impl Shadow {
    /// Retire the entries a completion polled from CQ `cq` ends; return the opcode to report.
    pub(super) fn complete(&self, cq: usize, wc: &IbvWc, device_opcode: WcOpcode) -> WcOpcode {
        let device_says_recv = matches!(device_opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
        let is_recv = if self.send_cq != self.recv_cq {
            cq == self.recv_cq
        } else if wc.status == 0 {
            device_says_recv
        } else {
            // One CQ for both queues and an error completion: the device's opcode is not to be
            // trusted; a flushed receive names the oldest posted receive.
            let rq = self.rq.lock().unwrap_or_else(|e| e.into_inner());
            let sq = self.sq.lock().unwrap_or_else(|e| e.into_inner());
            let rq_match = rq.front() == Some(&wc.wr_id);
            let sq_match = sq.front().map(|e| e.wr_id) == Some(wc.wr_id);
            match (rq_match, sq_match) {
                (true, false) => true,
                (false, true) => false,
                (true, true) => device_says_recv,
                (false, false) => sq.is_empty() && !rq.is_empty(),
            }
        };
        if is_recv {
            self.rq
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
            return if wc.status == 0 {
                device_opcode
            } else {
                WcOpcode::Recv
            };
        }
        let mut sq = self.sq.lock().unwrap_or_else(|e| e.into_inner());
        if wc.status != 0 {
            return sq.pop_front().map(|e| e.opcode).unwrap_or(device_opcode);
        }
        while let Some(e) = sq.pop_front() {
            if e.signaled {
                return e.opcode;
            }
        }
        device_opcode
    }
}
