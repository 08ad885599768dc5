//! The event queue: a binary heap of events ordered by (time, sequence number).
//!
//! Owns ordering only. Events scheduled for the same nanosecond run in the order they were
//! scheduled (the sequence number breaks ties), which makes a run a deterministic function of
//! its inputs. Events are small `Copy` values; packets travel as indices into the packet pool
//! so that pushing and popping never allocates once the heap has grown to its working size.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::clock::Time;

/// Index of a link in the simulator's link table.
pub type LinkId = u32;
/// Index of a node (host or switch).
pub type NodeId = u32;
/// Index of a packet in the packet pool.
pub type PacketId = u32;
/// Index of a transport endpoint (one side of a connection).
pub type EndpointId = u32;
/// Index of a connection.
pub type ConnId = u32;

/// Something that happens at a point in simulated time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The link finished serialising its current packet and may start the next one.
    TxDone {
        /// The transmitting link.
        link: LinkId,
    },
    /// A packet reaches the far end of a link.
    Arrive {
        /// The link it travelled over.
        link: LinkId,
        /// The packet.
        packet: PacketId,
    },
    /// The next message of a connection's traffic schedule is handed to its sender.
    MessageStart {
        /// The connection.
        conn: ConnId,
    },
    /// A PFC PAUSE (`pause = true`) or RESUME frame reaches the upstream end of a link.
    Pfc {
        /// The link whose transmitter is paused or resumed.
        link: LinkId,
        /// Pause or resume.
        pause: bool,
    },
    /// A link fails (`up = false`) or recovers.
    LinkState {
        /// The link.
        link: LinkId,
        /// New state.
        up: bool,
    },
    /// A link's random loss rate changes (index into the scenario's fault list).
    LinkLoss {
        /// The link.
        link: LinkId,
        /// Loss probability in millionths.
        loss_ppm: u32,
    },
    /// Periodic sampling of traces (utilisation, cwnd).
    Sample,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    time: Time,
    seq: u64,
    event: Event,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.time == other.time && self.seq == other.seq
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    // Reversed: BinaryHeap is a max-heap and we want the earliest (time, seq) on top.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .time
            .cmp(&self.time)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// Min-queue of events keyed by (time, insertion sequence).
#[derive(Debug, Default)]
pub struct EventQueue {
    heap: BinaryHeap<Entry>,
    next_seq: u64,
    popped: u64,
}

impl EventQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty queue with room for `n` events.
    pub fn with_capacity(n: usize) -> Self {
        EventQueue {
            heap: BinaryHeap::with_capacity(n),
            next_seq: 0,
            popped: 0,
        }
    }

    /// Schedules `event` at `time`.
    pub fn push(&mut self, time: Time, event: Event) {
        let seq = self.take_seq();
        self.heap.push(Entry { time, seq, event });
    }

    /// Hands out the next sequence number (also used by [`TimerHeap`] so that events and
    /// timers share one total order).
    pub fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// Removes and returns the earliest event.
    pub fn pop(&mut self) -> Option<(Time, Event)> {
        let e = self.heap.pop()?;
        self.popped += 1;
        Some((e.time, e.event))
    }

    /// Time of the earliest event.
    pub fn peek_time(&self) -> Option<Time> {
        self.heap.peek().map(|e| e.time)
    }

    /// (time, sequence) of the earliest event.
    pub fn peek_key(&self) -> Option<(Time, u64)> {
        self.heap.peek().map(|e| (e.time, e.seq))
    }

    /// Counts an event handled outside the heap (a timer from [`TimerHeap`]).
    pub fn count_external(&mut self) {
        self.popped += 1;
    }

    /// Number of pending events.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether no event is pending.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Number of events popped so far (the simulator's work counter).
    pub fn events_processed(&self) -> u64 {
        self.popped
    }
}

/// One deadline per endpoint, in an indexed binary min-heap keyed by (time, sequence).
///
/// Transports move their next deadline on almost every packet (retransmission timers are
/// re-armed by each ACK). Keeping exactly one entry per endpoint and moving it in place keeps
/// the structure as small as the number of endpoints, where pushing a fresh event for every
/// change would fill the event heap with stale timers.
#[derive(Debug, Default)]
pub struct TimerHeap {
    /// (deadline, sequence, endpoint), heap-ordered.
    heap: Vec<(Time, u64, EndpointId)>,
    /// `pos[ep]` = index of the endpoint's entry in `heap`, or `usize::MAX`.
    pos: Vec<usize>,
}

const NO_POS: usize = usize::MAX;

impl TimerHeap {
    /// An empty timer heap for `endpoints` endpoints.
    pub fn new(endpoints: usize) -> Self {
        TimerHeap {
            heap: Vec::with_capacity(endpoints),
            pos: vec![NO_POS; endpoints],
        }
    }

    /// The endpoint's current deadline.
    pub fn get(&self, ep: EndpointId) -> Option<Time> {
        match self.pos.get(ep as usize) {
            Some(&i) if i != NO_POS => Some(self.heap[i].0),
            _ => None,
        }
    }

    /// Sets (or with `None` clears) the endpoint's deadline; `seq` orders equal times.
    /// Setting the deadline it already has keeps its place.
    pub fn set(&mut self, ep: EndpointId, deadline: Option<Time>, seq: impl FnOnce() -> u64) {
        let e = ep as usize;
        if e >= self.pos.len() {
            self.pos.resize(e + 1, NO_POS);
        }
        let i = self.pos[e];
        match (i == NO_POS, deadline) {
            (true, None) => {}
            (true, Some(t)) => {
                self.heap.push((t, seq(), ep));
                let last = self.heap.len() - 1;
                self.pos[e] = last;
                self.sift_up(last);
            }
            (false, None) => self.remove_at(i),
            (false, Some(t)) => {
                if self.heap[i].0 == t {
                    return;
                }
                self.heap[i] = (t, seq(), ep);
                self.sift_up(i);
                let i = self.pos[e];
                self.sift_down(i);
            }
        }
    }

    /// (deadline, sequence) of the earliest timer.
    pub fn peek_key(&self) -> Option<(Time, u64)> {
        self.heap.first().map(|&(t, s, _)| (t, s))
    }

    /// Removes the earliest timer and returns its endpoint.
    pub fn pop(&mut self) -> Option<(Time, EndpointId)> {
        let &(t, _, ep) = self.heap.first()?;
        self.remove_at(0);
        Some((t, ep))
    }

    /// Number of armed timers.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether no timer is armed.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    fn key(&self, i: usize) -> (Time, u64) {
        (self.heap[i].0, self.heap[i].1)
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        self.pos[self.heap[a].2 as usize] = a;
        self.pos[self.heap[b].2 as usize] = b;
    }

    fn sift_up(&mut self, mut i: usize) {
        while i > 0 {
            let parent = (i - 1) / 2;
            if self.key(i) < self.key(parent) {
                self.swap(i, parent);
                i = parent;
            } else {
                break;
            }
        }
    }

    fn sift_down(&mut self, mut i: usize) {
        let n = self.heap.len();
        loop {
            let (l, r) = (2 * i + 1, 2 * i + 2);
            let mut m = i;
            if l < n && self.key(l) < self.key(m) {
                m = l;
            }
            if r < n && self.key(r) < self.key(m) {
                m = r;
            }
            if m == i {
                break;
            }
            self.swap(i, m);
            i = m;
        }
    }

    fn remove_at(&mut self, i: usize) {
        let last = self.heap.len() - 1;
        self.swap(i, last);
        let (_, _, ep) = self.heap.pop().expect("heap holds the entry being removed");
        self.pos[ep as usize] = NO_POS;
        if i < self.heap.len() {
            self.sift_up(i);
            let i = self.pos[self.heap[i].2 as usize];
            self.sift_down(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timer_heap_keeps_one_deadline_per_endpoint() {
        let mut seq = 0u64;
        let mut next = || {
            seq += 1;
            seq
        };
        let mut h = TimerHeap::new(4);
        h.set(0, Some(Time(50)), &mut next);
        h.set(1, Some(Time(20)), &mut next);
        h.set(2, Some(Time(30)), &mut next);
        h.set(3, Some(Time(40)), &mut next);
        h.set(1, Some(Time(60)), &mut next); // moved later
        h.set(3, Some(Time(10)), &mut next); // moved earlier
        h.set(2, None, &mut next); // cleared
        assert_eq!(h.len(), 3);
        assert_eq!(h.get(1), Some(Time(60)));
        assert_eq!(h.get(2), None);
        assert_eq!(h.pop(), Some((Time(10), 3)));
        assert_eq!(h.pop(), Some((Time(50), 0)));
        assert_eq!(h.pop(), Some((Time(60), 1)));
        assert_eq!(h.pop(), None);
    }

    #[test]
    fn timer_heap_matches_a_reference_model() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
        let mut seq = 0u64;
        let mut h = TimerHeap::new(0);
        let mut model: Vec<Option<(Time, u64)>> = vec![None; 32];
        for _ in 0..5_000 {
            let ep = rng.gen_range(0..32u32);
            if rng.gen_bool(0.2) {
                // Pop the earliest and compare with the model's minimum.
                let want = model
                    .iter()
                    .enumerate()
                    .filter_map(|(i, m)| m.map(|(t, s)| (t, s, i as u32)))
                    .min();
                let got = h.pop();
                assert_eq!(got, want.map(|(t, _, e)| (t, e)));
                if let Some((_, _, e)) = want {
                    model[e as usize] = None;
                }
                continue;
            }
            let d = if rng.gen_bool(0.1) {
                None
            } else {
                Some(Time(rng.gen_range(0..1_000)))
            };
            let before = h.get(ep);
            h.set(ep, d, || {
                seq += 1;
                seq
            });
            model[ep as usize] = match (d, before) {
                (Some(t), Some(b)) if t == b => model[ep as usize],
                (Some(t), _) => Some((t, seq)),
                (None, _) => None,
            };
            assert_eq!(h.get(ep), d);
        }
    }

    #[test]
    fn pops_in_time_order() {
        let mut q = EventQueue::new();
        q.push(Time(30), Event::Sample);
        q.push(Time(10), Event::TxDone { link: 1 });
        q.push(Time(20), Event::TxDone { link: 2 });
        assert_eq!(q.pop(), Some((Time(10), Event::TxDone { link: 1 })));
        assert_eq!(q.pop(), Some((Time(20), Event::TxDone { link: 2 })));
        assert_eq!(q.pop(), Some((Time(30), Event::Sample)));
        assert_eq!(q.pop(), None);
        assert_eq!(q.events_processed(), 3);
    }

    #[test]
    fn equal_times_pop_in_insertion_order() {
        let mut q = EventQueue::new();
        for link in 0..100 {
            q.push(Time(7), Event::TxDone { link });
        }
        q.push(Time(6), Event::Sample);
        assert_eq!(q.pop(), Some((Time(6), Event::Sample)));
        for link in 0..100 {
            assert_eq!(q.pop(), Some((Time(7), Event::TxDone { link })));
        }
        assert!(q.is_empty());
    }

    #[test]
    fn interleaved_push_pop_keeps_order() {
        let mut q = EventQueue::new();
        q.push(Time(5), Event::MessageStart { conn: 0 });
        q.push(Time(5), Event::MessageStart { conn: 1 });
        assert_eq!(q.pop().unwrap().1, Event::MessageStart { conn: 0 });
        q.push(Time(5), Event::MessageStart { conn: 2 });
        q.push(Time(4), Event::MessageStart { conn: 3 });
        assert_eq!(q.peek_time(), Some(Time(4)));
        assert_eq!(q.pop().unwrap().1, Event::MessageStart { conn: 3 });
        assert_eq!(q.pop().unwrap().1, Event::MessageStart { conn: 1 });
        assert_eq!(q.pop().unwrap().1, Event::MessageStart { conn: 2 });
    }
}
