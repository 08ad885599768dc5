//! The sender's message store: queued and unacknowledged messages and the mapping from
//! a PSN to the bytes it carries.
//!
//! Owns the payload buffers only; which PSN to send when is decided by
//! `crate::connection`. Messages get contiguous PSN ranges when queued, so a PSN maps to
//! (message, iPSN) by a binary search over the queue, with no per-packet state. A
//! message stays here until the cumulative ACK passes its last packet.

use std::collections::VecDeque;

use crate::connection::{MessageId, Payload};
use crate::seq;

/// One message, queued or in flight.
#[derive(Debug)]
pub(crate) struct OutMessage {
    pub(crate) id: MessageId,
    pub(crate) payload: Payload,
    pub(crate) synchronise: bool,
    /// PSN of the first packet.
    pub(crate) first_psn: u32,
    /// Number of packets (at least 1; an empty message sends one empty packet).
    pub(crate) packets: u32,
}

impl OutMessage {
    /// PSN after the last packet.
    pub(crate) fn end_psn(&self) -> u32 {
        self.first_psn.wrapping_add(self.packets)
    }
}

/// Where a PSN's payload is, and how long it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PacketRef {
    pub(crate) index: usize,
    pub(crate) msn: u32,
    pub(crate) ipsn: u32,
    pub(crate) tail: bool,
    pub(crate) synchronise: bool,
    pub(crate) is_virtual: bool,
    /// Byte range of the payload inside the message.
    pub(crate) offset: u64,
    pub(crate) len: u16,
}

/// Queued and unacknowledged messages, in PSN order.
#[derive(Debug, Default)]
pub(crate) struct SendQueue {
    msgs: VecDeque<OutMessage>,
    /// PSN the next queued message starts at.
    end_psn: u32,
    /// Id of the next queued message.
    next_id: u64,
}

/// Number of packets a message of `len` bytes needs at `mss` bytes per packet.
pub(crate) fn packets_for(len: u64, mss: u16) -> u64 {
    len.div_ceil(u64::from(mss)).max(1)
}

impl SendQueue {
    pub(crate) fn new(initial_psn: u32) -> Self {
        SendQueue {
            msgs: VecDeque::new(),
            end_psn: initial_psn,
            next_id: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.msgs.len()
    }

    /// PSN after the last queued packet.
    pub(crate) fn end_psn(&self) -> u32 {
        self.end_psn
    }

    /// Queues a message of `packets` packets; returns its id.
    pub(crate) fn push(&mut self, payload: Payload, synchronise: bool, packets: u32) -> MessageId {
        let id = MessageId(self.next_id);
        self.next_id += 1;
        let first_psn = self.end_psn;
        self.end_psn = self.end_psn.wrapping_add(packets);
        self.msgs.push_back(OutMessage {
            id,
            payload,
            synchronise,
            first_psn,
            packets,
        });
        id
    }

    /// Index of the message holding `psn`, which must lie in `[front.first_psn, end_psn)`.
    fn index_of(&self, psn: u32) -> Option<usize> {
        let front = self.msgs.front()?;
        let base = front.first_psn;
        let off = seq::dist(base, psn);
        if off >= seq::dist(base, self.end_psn) {
            return None;
        }
        // Messages are contiguous: the holder is the last one starting at or before psn.
        let idx = self
            .msgs
            .partition_point(|m| seq::dist(base, m.first_psn) <= off);
        idx.checked_sub(1)
    }

    /// Describes the packet `psn`, or `None` when it is not queued.
    pub(crate) fn packet(&self, psn: u32, mss: u16) -> Option<PacketRef> {
        let index = self.index_of(psn)?;
        let m = self.msgs.get(index)?;
        let ipsn = seq::dist(m.first_psn, psn);
        let total = m.payload.len();
        let offset = u64::from(ipsn) * u64::from(mss);
        let len = total.saturating_sub(offset).min(u64::from(mss)) as u16;
        Some(PacketRef {
            index,
            msn: m.id.0 as u32,
            ipsn,
            tail: ipsn + 1 == m.packets,
            synchronise: m.synchronise,
            is_virtual: matches!(m.payload, Payload::Virtual(_)),
            offset,
            len,
        })
    }

    /// The payload bytes of a packet described by [`SendQueue::packet`] (empty when virtual).
    pub(crate) fn bytes(&self, p: &PacketRef) -> &[u8] {
        match self.msgs.get(p.index).map(|m| &m.payload) {
            Some(Payload::Bytes(b)) => {
                let start = p.offset as usize;
                b.get(start..start + usize::from(p.len)).unwrap_or_default()
            }
            _ => &[],
        }
    }

    /// Removes the messages whose every packet is below `snd_una`, calling `acked` on each.
    pub(crate) fn pop_acked(&mut self, snd_una: u32, mut acked: impl FnMut(MessageId)) {
        while let Some(m) = self.msgs.front() {
            if seq::le(m.end_psn(), snd_una) {
                acked(m.id);
                self.msgs.pop_front();
            } else {
                break;
            }
        }
    }

    /// No message is queued or unacknowledged.
    pub(crate) fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_maps_to_message_and_offset() {
        let mut q = SendQueue::new(u32::MAX - 1);
        let a = q.push(Payload::Bytes(vec![1u8; 2500].into()), false, 3);
        let b = q.push(Payload::Virtual(0), true, 1);
        let c = q.push(Payload::Bytes(vec![2u8; 10].into()), false, 1);
        assert_eq!((a.0, b.0, c.0), (0, 1, 2));
        let p = q.packet(u32::MAX, 1024).unwrap();
        assert_eq!((p.index, p.ipsn, p.len, p.tail), (0, 1, 1024, false));
        let p = q.packet(0, 1024).unwrap();
        assert_eq!(
            (p.index, p.ipsn, p.len, p.tail, p.offset),
            (0, 2, 452, true, 2048)
        );
        assert_eq!(q.bytes(&p).len(), 452);
        let p = q.packet(1, 1024).unwrap();
        assert!(p.is_virtual && p.synchronise && p.tail && p.len == 0);
        assert_eq!(q.packet(2, 1024).unwrap().index, 2);
        assert_eq!(q.packet(3, 1024), None);
        let mut acked = Vec::new();
        q.pop_acked(1, |id| acked.push(id));
        assert_eq!(acked, vec![a]);
        q.pop_acked(3, |id| acked.push(id));
        assert_eq!(acked, vec![a, b, c]);
        assert!(q.is_empty());
    }
}
