//! Unidirectional links and the output queue at their transmitting end.
//!
//! Owns: bandwidth and propagation delay, the FIFO output queue (byte-counted, tail drop at
//! capacity), RED/ECN marking on enqueue, random loss, up/down state, PFC pause state of the
//! transmitter, and the ingress buffer accounting a switch uses to decide when to send PAUSE
//! upstream. It does not decide where packets go (`node`) nor when events happen (`sim`): the
//! functions here are pure state transitions that the engine calls and schedules around.

use std::collections::VecDeque;

use rand::Rng;

use crate::clock::{serialisation_nanos, Time};
use crate::event_queue::{NodeId, PacketId};

/// RED/ECN marking parameters, on the instantaneous queue length (DCQCN/DCTCP style).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Red {
    /// Below this many queued bytes nothing is marked.
    pub kmin_bytes: u64,
    /// At or above this many queued bytes every ECN-capable packet is marked.
    pub kmax_bytes: u64,
    /// Marking probability reached just below `kmax_bytes`.
    pub pmax: f64,
}

impl Red {
    /// Probability that a packet arriving to a queue of `queue_bytes` is marked CE.
    pub fn mark_probability(&self, queue_bytes: u64) -> f64 {
        if queue_bytes <= self.kmin_bytes {
            0.0
        } else if queue_bytes >= self.kmax_bytes {
            1.0
        } else {
            let span = (self.kmax_bytes - self.kmin_bytes) as f64;
            self.pmax * (queue_bytes - self.kmin_bytes) as f64 / span
        }
    }
}

/// PFC thresholds on the bytes a switch holds that arrived over one ingress link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pfc {
    /// PAUSE is sent upstream when the ingress count rises above this.
    pub xoff_bytes: u64,
    /// RESUME is sent when it falls back to or below this.
    pub xon_bytes: u64,
}

/// Counters of one link over the whole run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LinkCounters {
    /// Packets that finished serialisation.
    pub tx_packets: u64,
    /// Wire bytes that finished serialisation.
    pub tx_bytes: u64,
    /// Packets dropped because the queue was full.
    pub drops_overflow: u64,
    /// Packets dropped by random loss.
    pub drops_loss: u64,
    /// Packets dropped because the link was down.
    pub drops_down: u64,
    /// Packets marked CE on enqueue.
    pub ecn_marks: u64,
    /// Largest queue seen, in bytes.
    pub max_queue_bytes: u64,
    /// PAUSE frames received by this link's transmitter.
    pub pauses: u64,
}

/// Outcome of offering a packet to a link's queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Enqueue {
    /// Queued; `marked` says whether it was marked CE.
    Queued {
        /// Marked CE by RED.
        marked: bool,
    },
    /// Dropped: the queue is full.
    Overflow,
    /// Dropped: the link is down.
    Down,
}

/// One direction of a cable, with the output queue of the port that drives it.
#[derive(Debug)]
pub struct Link {
    /// Human-readable name, `"leaf0->spine1"`.
    pub name: String,
    /// Transmitting node.
    pub from: NodeId,
    /// Receiving node.
    pub to: NodeId,
    /// Bandwidth.
    pub bits_per_sec: u64,
    /// Propagation delay in nanoseconds.
    pub propagation_ns: u64,
    /// Random loss probability applied to each packet that finishes serialisation.
    pub loss: f64,
    /// Whether the link carries traffic.
    pub is_up: bool,
    /// Whether the transmitter is paused by PFC from downstream.
    pub is_paused: bool,
    /// The transmitter is serialising a packet until this time.
    pub busy_until: Time,
    /// Whether a `TxDone` event for `busy_until` is scheduled (the engine schedules one only
    /// when something waits for the transmitter: a queued packet or a host NIC's pull).
    pub has_tx_done_pending: bool,
    /// Queue capacity in bytes (tail drop above it).
    pub capacity_bytes: u64,
    /// RED/ECN marking at this queue, if any.
    pub red: Option<Red>,
    /// Packets waiting, in order.
    pub queue: VecDeque<(PacketId, u32)>,
    /// Sum of the wire sizes in `queue`. Invariant: equals the sum of `queue[i].1`.
    pub queue_bytes: u64,
    /// Bytes held at the receiving switch that arrived over this link (PFC accounting).
    pub ingress_bytes: u64,
    /// Whether the receiving switch has PAUSEd this link (and not yet RESUMEd it).
    pub has_sent_pause: bool,
    /// Counters.
    pub counters: LinkCounters,
}

impl Link {
    /// A new, idle, up link with an empty queue.
    pub fn new(
        name: String,
        from: NodeId,
        to: NodeId,
        bits_per_sec: u64,
        propagation_ns: u64,
        capacity_bytes: u64,
        red: Option<Red>,
    ) -> Self {
        Link {
            name,
            from,
            to,
            bits_per_sec,
            propagation_ns,
            loss: 0.0,
            is_up: true,
            is_paused: false,
            busy_until: Time::ZERO,
            has_tx_done_pending: false,
            capacity_bytes,
            red,
            queue: VecDeque::new(),
            queue_bytes: 0,
            ingress_bytes: 0,
            has_sent_pause: false,
            counters: LinkCounters::default(),
        }
    }

    /// Time to serialise `wire_bytes` on this link.
    pub fn serialisation_ns(&self, wire_bytes: u32) -> u64 {
        serialisation_nanos(u64::from(wire_bytes), self.bits_per_sec)
    }

    /// Offers a packet to the queue: drops it when the link is down or the queue is full,
    /// otherwise appends it, marking it CE with the RED probability if it is ECN-capable.
    pub fn enqueue<R: Rng>(
        &mut self,
        packet: PacketId,
        wire_bytes: u32,
        ecn_capable: bool,
        rng: &mut R,
    ) -> Enqueue {
        if !self.is_up {
            self.counters.drops_down += 1;
            return Enqueue::Down;
        }
        if self.queue_bytes + u64::from(wire_bytes) > self.capacity_bytes {
            self.counters.drops_overflow += 1;
            return Enqueue::Overflow;
        }
        let mut marked = false;
        if ecn_capable {
            if let Some(red) = &self.red {
                let p = red.mark_probability(self.queue_bytes);
                if p >= 1.0 || (p > 0.0 && rng.gen::<f64>() < p) {
                    marked = true;
                    self.counters.ecn_marks += 1;
                }
            }
        }
        self.queue.push_back((packet, wire_bytes));
        self.queue_bytes += u64::from(wire_bytes);
        self.counters.max_queue_bytes = self.counters.max_queue_bytes.max(self.queue_bytes);
        Enqueue::Queued { marked }
    }

    /// Whether the transmitter may start serialising a packet at `now`.
    pub fn can_start(&self, now: Time) -> bool {
        self.is_up && !self.is_paused && now >= self.busy_until
    }

    /// Takes the next queued packet if the transmitter may start at `now`; the link is busy
    /// until the returned serialisation time has passed.
    pub fn start_next(&mut self, now: Time) -> Option<(PacketId, u32, u64)> {
        if !self.can_start(now) {
            return None;
        }
        let (p, bytes) = self.queue.pop_front()?;
        self.queue_bytes -= u64::from(bytes);
        let ser = self.serialisation_ns(bytes);
        self.busy_until = now + ser;
        Some((p, bytes, ser))
    }

    /// Records a packet of `wire_bytes` put on the wire; returns whether random loss
    /// destroys it.
    pub fn record_tx<R: Rng>(&mut self, wire_bytes: u32, rng: &mut R) -> bool {
        self.counters.tx_packets += 1;
        self.counters.tx_bytes += u64::from(wire_bytes);
        let lost = self.loss > 0.0 && rng.gen::<f64>() < self.loss;
        if lost {
            self.counters.drops_loss += 1;
        }
        lost
    }

    /// Adds bytes to the ingress count of the receiving switch; returns true when PAUSE must
    /// be sent upstream now.
    pub fn ingress_add(&mut self, pfc: Option<Pfc>, bytes: u32) -> bool {
        self.ingress_bytes += u64::from(bytes);
        match pfc {
            Some(p) if !self.has_sent_pause && self.ingress_bytes > p.xoff_bytes => {
                self.has_sent_pause = true;
                true
            }
            _ => false,
        }
    }

    /// Removes bytes from the ingress count; returns true when RESUME must be sent now.
    pub fn ingress_remove(&mut self, pfc: Option<Pfc>, bytes: u32) -> bool {
        self.ingress_bytes = self.ingress_bytes.saturating_sub(u64::from(bytes));
        match pfc {
            Some(p) if self.has_sent_pause && self.ingress_bytes <= p.xon_bytes => {
                self.has_sent_pause = false;
                true
            }
            _ => false,
        }
    }

    /// Empties the queue (on failure), returning the packets it held.
    pub fn drain_queue(&mut self) -> impl Iterator<Item = (PacketId, u32)> + '_ {
        self.queue_bytes = 0;
        self.queue.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    fn link(red: Option<Red>) -> Link {
        Link::new("a->b".into(), 0, 1, 40_000_000_000, 1_000, 10_000, red)
    }

    #[test]
    fn red_probability_is_piecewise_linear() {
        let red = Red {
            kmin_bytes: 100,
            kmax_bytes: 300,
            pmax: 0.2,
        };
        assert_eq!(red.mark_probability(0), 0.0);
        assert_eq!(red.mark_probability(100), 0.0);
        assert!((red.mark_probability(200) - 0.1).abs() < 1e-12);
        assert!((red.mark_probability(250) - 0.15).abs() < 1e-12);
        assert_eq!(red.mark_probability(300), 1.0);
        assert_eq!(red.mark_probability(10_000), 1.0);
    }

    #[test]
    fn red_marks_at_the_configured_rate() {
        let red = Red {
            kmin_bytes: 0,
            kmax_bytes: 2_000,
            pmax: 0.5,
        };
        let mut rng = SmallRng::seed_from_u64(7);
        let mut l = link(Some(red));
        l.capacity_bytes = u64::MAX;
        // Hold the queue at exactly 1000 bytes: p = 0.25.
        l.enqueue(0, 1_000, true, &mut rng);
        let trials = 40_000;
        let mut marks = 0;
        for i in 0..trials {
            if let Enqueue::Queued { marked: true } = l.enqueue(i + 1, 1, true, &mut rng) {
                marks += 1;
            }
            l.queue.pop_back();
            l.queue_bytes -= 1;
        }
        let rate = marks as f64 / trials as f64;
        assert!((rate - 0.25).abs() < 0.01, "mark rate {rate}");
        // Not ECN-capable: never marked.
        assert_eq!(
            l.enqueue(99, 1, false, &mut rng),
            Enqueue::Queued { marked: false }
        );
    }

    #[test]
    fn tail_drop_and_down_link() {
        let mut rng = SmallRng::seed_from_u64(1);
        let mut l = link(None);
        assert!(matches!(
            l.enqueue(0, 6_000, false, &mut rng),
            Enqueue::Queued { .. }
        ));
        assert_eq!(l.enqueue(1, 6_000, false, &mut rng), Enqueue::Overflow);
        assert!(matches!(
            l.enqueue(2, 4_000, false, &mut rng),
            Enqueue::Queued { .. }
        ));
        assert_eq!(l.queue_bytes, 10_000);
        assert_eq!(l.counters.drops_overflow, 1);
        l.is_up = false;
        assert_eq!(l.enqueue(3, 1, false, &mut rng), Enqueue::Down);
        assert!(l.start_next(Time(0)).is_none());
        assert_eq!(l.drain_queue().count(), 2);
        assert_eq!(l.queue_bytes, 0);
    }

    #[test]
    fn transmitter_serialises_one_packet_at_a_time() {
        let mut rng = SmallRng::seed_from_u64(1);
        let mut l = link(None);
        l.enqueue(10, 100, false, &mut rng);
        l.enqueue(11, 200, false, &mut rng);
        // 100 bytes at 40 Gb/s = 20 ns.
        assert_eq!(l.start_next(Time(0)), Some((10, 100, 20)));
        assert!(
            l.start_next(Time(19)).is_none(),
            "busy link started a second packet"
        );
        assert!(!l.record_tx(100, &mut rng));
        assert!(l.start_next(Time(10)).is_none(), "still serialising");
        l.is_paused = true;
        assert!(l.start_next(Time(20)).is_none(), "paused link transmitted");
        l.is_paused = false;
        assert_eq!(l.start_next(Time(20)), Some((11, 200, 40)));
        assert_eq!(l.queue_bytes, 0);
        assert_eq!(l.counters.tx_bytes, 100);
    }

    #[test]
    fn random_loss_rate() {
        let mut rng = SmallRng::seed_from_u64(3);
        let mut l = link(None);
        l.loss = 0.05;
        let n = 100_000;
        let lost = (0..n).filter(|_| l.record_tx(1, &mut rng)).count();
        let rate = lost as f64 / n as f64;
        assert!((rate - 0.05).abs() < 0.003, "loss rate {rate}");
        assert_eq!(l.counters.drops_loss, lost as u64);
    }

    #[test]
    fn pfc_pause_and_resume_hysteresis() {
        let pfc = Some(Pfc {
            xoff_bytes: 1_000,
            xon_bytes: 500,
        });
        let mut l = link(None);
        assert!(!l.ingress_add(pfc, 600));
        assert!(!l.ingress_add(pfc, 400)); // exactly xoff: not above
        assert!(l.ingress_add(pfc, 1)); // above: PAUSE once
        assert!(!l.ingress_add(pfc, 100)); // already paused
        assert!(!l.ingress_remove(pfc, 300)); // 801: still above xon
        assert!(l.ingress_remove(pfc, 301)); // 500: RESUME
        assert!(!l.ingress_remove(pfc, 100));
        assert!(!l.ingress_add(None, 10_000), "no PFC configured");
    }
}
