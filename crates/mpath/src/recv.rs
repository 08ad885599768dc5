//! The receiver: out-of-order bitmap, reassembly and in-order delivery.
//!
//! Owns `rcv_nxt`, the 2-bit-per-slot bitmap of the MP-RDMA receiver (design: MP-RDMA
//! §3.2/§3.3) and the buffers that hold out-of-order payload until `rcv_nxt` reaches it
//! (the software stand-in for placing data straight into registered memory). Decides
//! per data packet: accept and ACK, ACK a duplicate, drop beyond the bitmap and NACK
//! `rcv_nxt`, or drop an early synchronise packet and NACK it. Builds no packets: the
//! connection turns a [`RecvOutcome`] into an ACK or NACK.
//!
//! Slot `i` of the bitmap describes PSN `rcv_nxt + i`; a PSN at or beyond
//! `rcv_nxt + window` is dropped. The multi-path receiver uses `window = L`; the
//! single-path (go-back-N) receiver uses `window = 1`, which accepts only `rcv_nxt`.
//! The bitmap is a PSN-indexed ring (`crate::psnmap`): advancing `rcv_nxt` clears one
//! slot instead of shifting the whole bitmap.

use std::collections::VecDeque;

use bytes::Bytes;

use crate::connection::{ConnectionError, Event, MessageId, Payload};
use crate::frame::DataHeader;
use crate::psnmap::PsnRing;
use crate::seq;
use crate::Instant;

/// State of one bitmap slot (2 bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum SlotState {
    /// Not received.
    Empty = 0,
    /// Received, not the last packet of its message.
    Received = 1,
    /// Last packet of a message that needs no completion. Every message here produces a
    /// [`Event::MessageReceived`], so this crate writes `TailWithCompletion`; `Tail` is
    /// decoded and delivered the same way for compatibility with the paper's encoding.
    #[allow(dead_code)]
    Tail = 2,
    /// Last packet of a message whose arrival completes to the application.
    TailWithCompletion = 3,
}

/// The receiver's protocol state (what a NIC would keep per connection), besides the
/// bitmap ([`Receiver::bitmap_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReceiverState {
    /// Next PSN expected in order; every PSN below it was received.
    pub(crate) rcv_nxt: u32,
    /// The PSN last NACKed (meaningful once a NACK was sent).
    pub(crate) last_nack_psn: u32,
    /// Messages delivered so far: the id of the next message.
    pub(crate) rcv_msn: u64,
}

/// The 2-bit arrival slots of `[rcv_nxt, rcv_nxt + window)`; every other entry of the
/// ring is empty.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Bitmap(PsnRing<2>);

impl Bitmap {
    fn slot(&self, psn: u32) -> SlotState {
        match self.0.get(psn) {
            0 => SlotState::Empty,
            1 => SlotState::Received,
            2 => SlotState::Tail,
            _ => SlotState::TailWithCompletion,
        }
    }

    fn set_slot(&mut self, psn: u32, s: SlotState) {
        self.0.set(psn, s as u8);
    }

    /// Empties `psn`'s slot as `rcv_nxt` moves past it, for the PSN one window later.
    fn release(&mut self, psn: u32) {
        self.0.set(psn, 0);
    }
}

/// Payload of one out-of-order packet, waiting for `rcv_nxt`.
#[derive(Debug, Default)]
struct Slot {
    msn: u32,
    ipsn: u32,
    len: u16,
    synchronise: bool,
    is_virtual: bool,
    data: Vec<u8>,
}

/// The message being reassembled in order.
#[derive(Debug, Default)]
struct Assembly {
    active: bool,
    msn: u32,
    next_ipsn: u32,
    synchronise: bool,
    is_virtual: bool,
    len: u64,
    buf: Vec<u8>,
}

/// What the connection should answer to a data packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecvOutcome {
    /// Stored (and possibly delivered): ACK it.
    Accepted,
    /// Already received: ACK it again so the sender's ACK clock keeps running.
    Duplicate,
    /// Beyond the bitmap: dropped. `Some(psn)`: NACK that PSN (`rcv_nxt`); `None`: a
    /// NACK for it was sent less than `nack_interval` ago.
    Overflow(Option<u32>),
    /// A synchronise packet arrived before every earlier message completed: dropped,
    /// NACK its PSN so the sender resends it.
    EarlySync,
}

/// Receiver state plus its buffers.
#[derive(Debug)]
pub(crate) struct Receiver {
    pub(crate) state: ReceiverState,
    bitmap: Bitmap,
    /// Accepted window in packets (L for multi-path, 1 for go-back-N).
    window: u32,
    slots: Vec<Slot>,
    assembly: Assembly,
    max_message_len: u64,
    /// Earliest time another NACK for `last_nack_psn` may go out.
    pub(crate) nack_holdoff_until: Option<Instant>,
    /// Largest `psn - rcv_nxt` seen on an arriving packet.
    pub(crate) max_gap: u32,
}

impl Receiver {
    pub(crate) fn new(initial_psn: u32, window: u32, max_message_len: u64) -> Self {
        let window = window.clamp(1, crate::MAX_BITMAP_LEN);
        let bitmap = Bitmap(PsnRing::new(window));
        // Buffer slots by PSN modulo a power of two that covers the window (it divides
        // 2^32, so live PSNs never collide across a wrap).
        let slots = window.next_power_of_two();
        Receiver {
            state: ReceiverState {
                rcv_nxt: initial_psn,
                last_nack_psn: 0,
                rcv_msn: 0,
            },
            bitmap,
            window,
            slots: (0..slots).map(|_| Slot::default()).collect(),
            assembly: Assembly::default(),
            max_message_len,
            nack_holdoff_until: None,
            max_gap: 0,
        }
    }

    /// Bytes of the arrival bitmap (protocol state besides [`ReceiverState`]).
    pub(crate) fn bitmap_bytes(&self) -> usize {
        self.bitmap.0.state_bytes()
    }

    /// Buffer slot of a PSN.
    fn slot_index(&self, psn: u32) -> usize {
        (psn as usize) & (self.slots.len() - 1)
    }

    /// Handles one data packet. Delivered messages are pushed to `events`.
    pub(crate) fn on_data(
        &mut self,
        now: Instant,
        nack_interval: std::time::Duration,
        h: &DataHeader,
        payload: &[u8],
        events: &mut VecDeque<Event>,
    ) -> Result<RecvOutcome, ConnectionError> {
        let rcv_nxt = self.state.rcv_nxt;
        let off = seq::diff(h.psn, rcv_nxt);
        if off < 0 {
            return Ok(RecvOutcome::Duplicate);
        }
        let off = off as u32;
        self.max_gap = self.max_gap.max(off);
        if off >= self.window {
            let due = self.state.last_nack_psn != rcv_nxt
                || self.nack_holdoff_until.map_or(true, |t| now >= t);
            if due {
                self.state.last_nack_psn = rcv_nxt;
                self.nack_holdoff_until = Some(now + nack_interval);
                return Ok(RecvOutcome::Overflow(Some(rcv_nxt)));
            }
            return Ok(RecvOutcome::Overflow(None));
        }
        if h.synchronise {
            let first = h.psn.wrapping_sub(h.ipsn);
            if seq::lt(rcv_nxt, first) {
                return Ok(RecvOutcome::EarlySync);
            }
        }
        if self.bitmap.slot(h.psn) != SlotState::Empty {
            return Ok(RecvOutcome::Duplicate);
        }
        let mark = if h.tail {
            SlotState::TailWithCompletion
        } else {
            SlotState::Received
        };
        if off == 0 {
            // In order: consume straight from the datagram, no copy into a slot.
            self.consume(
                h.msn,
                h.ipsn,
                h.payload_len,
                h.synchronise,
                h.is_virtual,
                mark,
                payload,
                events,
            )?;
            self.advance(events)?;
        } else {
            self.bitmap.set_slot(h.psn, mark);
            let idx = self.slot_index(h.psn);
            if let Some(slot) = self.slots.get_mut(idx) {
                slot.msn = h.msn;
                slot.ipsn = h.ipsn;
                slot.len = h.payload_len;
                slot.synchronise = h.synchronise;
                slot.is_virtual = h.is_virtual;
                slot.data.clear();
                slot.data.extend_from_slice(payload);
            }
        }
        Ok(RecvOutcome::Accepted)
    }

    /// Consumes slot 0 after `rcv_nxt` was received, then every filled slot after it.
    fn advance(&mut self, events: &mut VecDeque<Event>) -> Result<(), ConnectionError> {
        // The slot of rcv_nxt (just consumed) is released by the first step.
        self.bitmap.release(self.state.rcv_nxt);
        self.state.rcv_nxt = self.state.rcv_nxt.wrapping_add(1);
        loop {
            let mark = self.bitmap.slot(self.state.rcv_nxt);
            if mark == SlotState::Empty {
                return Ok(());
            }
            let idx = self.slot_index(self.state.rcv_nxt);
            let mut slot = std::mem::take(
                self.slots
                    .get_mut(idx)
                    .ok_or(ConnectionError::Protocol("slot index"))?,
            );
            let r = self.consume(
                slot.msn,
                slot.ipsn,
                slot.len,
                slot.synchronise,
                slot.is_virtual,
                mark,
                &slot.data,
                events,
            );
            slot.data.clear();
            if let Some(s) = self.slots.get_mut(idx) {
                *s = slot;
            }
            r?;
            self.bitmap.release(self.state.rcv_nxt);
            self.state.rcv_nxt = self.state.rcv_nxt.wrapping_add(1);
        }
    }

    /// Appends one in-order packet to the message being reassembled.
    #[allow(clippy::too_many_arguments)]
    fn consume(
        &mut self,
        msn: u32,
        ipsn: u32,
        len: u16,
        synchronise: bool,
        is_virtual: bool,
        mark: SlotState,
        data: &[u8],
        events: &mut VecDeque<Event>,
    ) -> Result<(), ConnectionError> {
        let a = &mut self.assembly;
        if ipsn == 0 {
            if a.active {
                return Err(ConnectionError::Protocol(
                    "message started before the previous one ended",
                ));
            }
            if msn != self.state.rcv_msn as u32 {
                return Err(ConnectionError::Protocol(
                    "unexpected message sequence number",
                ));
            }
            a.active = true;
            a.msn = msn;
            a.next_ipsn = 0;
            a.synchronise = synchronise;
            a.is_virtual = is_virtual;
            a.len = 0;
            a.buf = Vec::new();
        } else if !a.active || a.msn != msn || a.next_ipsn != ipsn || a.is_virtual != is_virtual {
            return Err(ConnectionError::Protocol(
                "packet does not continue its message",
            ));
        }
        a.len += u64::from(len);
        if a.len > self.max_message_len {
            return Err(ConnectionError::Protocol(
                "message longer than max_message_len",
            ));
        }
        if !is_virtual {
            a.buf.extend_from_slice(data);
        }
        a.next_ipsn = a.next_ipsn.wrapping_add(1);
        if matches!(mark, SlotState::Tail | SlotState::TailWithCompletion) {
            a.active = false;
            let payload = if a.is_virtual {
                Payload::Virtual(a.len)
            } else {
                Payload::Bytes(Bytes::from(std::mem::take(&mut a.buf)))
            };
            events.push_back(Event::MessageReceived {
                id: MessageId(self.state.rcv_msn),
                payload,
                synchronise: a.synchronise,
            });
            self.state.rcv_msn += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn hdr(psn: u32, msn: u32, ipsn: u32, tail: bool) -> DataHeader {
        DataHeader {
            psn,
            msn,
            ipsn,
            tail,
            payload_len: 1,
            ..DataHeader::default()
        }
    }

    #[test]
    fn bitmap_slots_are_released_as_rcv_nxt_moves() {
        let mut b = Bitmap(PsnRing::new(64));
        b.set_slot(63, SlotState::TailWithCompletion);
        b.set_slot(1, SlotState::Received);
        b.set_slot(0, SlotState::Received);
        assert_eq!(b.slot(63), SlotState::TailWithCompletion);
        b.release(0);
        assert_eq!(b.slot(1), SlotState::Received);
        assert_eq!(b.slot(63), SlotState::TailWithCompletion);
        // PSN 64 takes PSN 0's place one window later, and starts empty.
        assert_eq!(b.slot(64), SlotState::Empty);
    }

    #[test]
    fn a_window_beyond_64_packets_reassembles_across_the_wrap() {
        let window = 512;
        let first = u32::MAX - 200;
        let mut r = Receiver::new(first, window, 1 << 20);
        let mut ev = VecDeque::new();
        let (now, d) = (Instant::ZERO, Duration::from_micros(1));
        // One message per PSN; all but the first arrive, newest first, then the hole.
        for i in (1..window).rev() {
            let psn = first.wrapping_add(i);
            let got = r.on_data(now, d, &hdr(psn, i, 0, true), &[i as u8], &mut ev);
            assert_eq!(got, Ok(RecvOutcome::Accepted), "psn {psn}");
        }
        assert!(ev.is_empty());
        let beyond = first.wrapping_add(window);
        assert_eq!(
            r.on_data(now, d, &hdr(beyond, window, 0, true), b"x", &mut ev),
            Ok(RecvOutcome::Overflow(Some(first)))
        );
        assert_eq!(
            r.on_data(now, d, &hdr(first, 0, 0, true), &[0], &mut ev),
            Ok(RecvOutcome::Accepted)
        );
        assert_eq!(r.state.rcv_nxt, first.wrapping_add(window));
        let got: Vec<u8> = ev
            .drain(..)
            .map(|e| match e {
                Event::MessageReceived {
                    payload: Payload::Bytes(b),
                    ..
                } => b[0],
                other => panic!("{other:?}"),
            })
            .collect();
        let want: Vec<u8> = (0..window).map(|i| i as u8).collect();
        assert_eq!(got, want);
        // The next window starts empty although its PSNs share the ring's positions.
        assert_eq!(
            r.on_data(
                now,
                d,
                &hdr(beyond.wrapping_add(1), window + 1, 0, true),
                b"y",
                &mut ev
            ),
            Ok(RecvOutcome::Accepted)
        );
        assert!(ev.is_empty(), "PSN {beyond} is still missing");
    }

    #[test]
    fn out_of_order_packets_are_delivered_in_order() {
        let mut r = Receiver::new(u32::MAX - 1, 64, 1 << 20);
        let mut ev = VecDeque::new();
        let now = Instant::ZERO;
        let d = Duration::from_micros(1);
        // Message 0 = PSNs MAX-1, MAX, 0 ; message 1 = PSN 1.
        assert_eq!(
            r.on_data(now, d, &hdr(1, 1, 0, true), b"d", &mut ev),
            Ok(RecvOutcome::Accepted)
        );
        assert_eq!(
            r.on_data(now, d, &hdr(0, 0, 2, true), b"c", &mut ev),
            Ok(RecvOutcome::Accepted)
        );
        assert_eq!(
            r.on_data(now, d, &hdr(u32::MAX, 0, 1, false), b"b", &mut ev),
            Ok(RecvOutcome::Accepted)
        );
        assert!(ev.is_empty());
        assert_eq!(
            r.on_data(now, d, &hdr(u32::MAX - 1, 0, 0, false), b"a", &mut ev),
            Ok(RecvOutcome::Accepted)
        );
        assert_eq!(r.state.rcv_nxt, 2);
        assert_eq!(r.max_gap, 3);
        let got: Vec<_> = ev.drain(..).collect();
        assert_eq!(
            got,
            vec![
                Event::MessageReceived {
                    id: MessageId(0),
                    payload: Payload::Bytes(Bytes::from_static(b"abc")),
                    synchronise: false
                },
                Event::MessageReceived {
                    id: MessageId(1),
                    payload: Payload::Bytes(Bytes::from_static(b"d")),
                    synchronise: false
                },
            ]
        );
        assert_eq!(
            r.on_data(now, d, &hdr(0, 0, 2, true), b"c", &mut ev),
            Ok(RecvOutcome::Duplicate)
        );
    }

    #[test]
    fn overflow_nacks_rcv_nxt_once_per_interval() {
        let mut r = Receiver::new(0, 64, 1 << 20);
        let mut ev = VecDeque::new();
        let d = Duration::from_micros(10);
        let t0 = Instant::ZERO;
        assert_eq!(
            r.on_data(t0, d, &hdr(64, 0, 64, false), b"x", &mut ev),
            Ok(RecvOutcome::Overflow(Some(0)))
        );
        assert_eq!(
            r.on_data(t0, d, &hdr(65, 0, 65, false), b"x", &mut ev),
            Ok(RecvOutcome::Overflow(None))
        );
        let t1 = Instant::from_micros(10);
        assert_eq!(
            r.on_data(t1, d, &hdr(65, 0, 65, false), b"x", &mut ev),
            Ok(RecvOutcome::Overflow(Some(0)))
        );
        assert_eq!(
            r.on_data(t1, d, &hdr(63, 0, 63, false), b"x", &mut ev),
            Ok(RecvOutcome::Accepted)
        );
    }

    #[test]
    fn inconsistent_messages_are_protocol_errors() {
        let mut r = Receiver::new(0, 64, 1 << 20);
        let mut ev = VecDeque::new();
        let d = Duration::from_micros(10);
        let err = r.on_data(Instant::ZERO, d, &hdr(0, 5, 0, true), b"x", &mut ev);
        assert!(matches!(err, Err(ConnectionError::Protocol(_))));
        let mut r = Receiver::new(0, 64, 1 << 20);
        let err = r.on_data(Instant::ZERO, d, &hdr(0, 0, 1, true), b"x", &mut ev);
        assert!(matches!(err, Err(ConnectionError::Protocol(_))));
    }
}
