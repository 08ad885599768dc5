//! The `Pair` harness: two connections, a virtual clock and two one-way networks.
//!
//! Each direction is a queue of datagrams stamped with their arrival time. Knobs:
//! latency (base, per path, random jitter for reordering), loss (random, per path, or a
//! filter closure), duplication, ECN marking (random, by filter, or by a queue
//! threshold when a bottleneck rate is set), and an MTU. `drive()` advances time to the
//! earliest arrival or deadline and steps the side it belongs to, so a run is
//! deterministic and long simulated times cost microseconds.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::frame::{self, Frame};
use crate::{Config, Connection, Event, Instant, PacketKind, PathId, Transmit};

/// Which side of the pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    A,
    B,
}

/// A datagram as it leaves a side, given to filters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sent<'a> {
    pub(crate) from: Side,
    pub(crate) at: Instant,
    pub(crate) transmit: Transmit,
    pub(crate) frame: Frame<'a>,
}

type Filter = Box<dyn FnMut(&Sent<'_>) -> bool>;
type PathLatency = Box<dyn Fn(PathId) -> Duration>;

/// Behaviour of the network in one direction.
pub(crate) struct Network {
    /// One-way base latency.
    pub(crate) latency: Duration,
    /// Extra latency per path (e.g. slow paths).
    pub(crate) path_latency: Option<PathLatency>,
    /// Uniform random extra delay in `[0, jitter]`: reorders packets.
    pub(crate) jitter: Duration,
    /// Probability of losing a datagram.
    pub(crate) loss: f64,
    /// Probability of duplicating a datagram (the copy gets its own jitter).
    pub(crate) duplicate: f64,
    /// Probability of marking a datagram CE (ECN-capable ones only).
    pub(crate) ecn: f64,
    /// Drops datagrams for which it returns true.
    pub(crate) drop_if: Option<Filter>,
    /// Marks CE the ECN-capable datagrams for which it returns true.
    pub(crate) mark_if: Option<Filter>,
    /// Datagrams longer than this (counting virtual payload) are dropped.
    pub(crate) mtu: usize,
    /// Bottleneck rate in bits/s (None: infinite). Packets queue behind each other.
    pub(crate) rate_bps: Option<f64>,
    /// With a bottleneck: mark CE when the queue holds more than this many bytes.
    pub(crate) ecn_threshold_bytes: Option<u64>,
    /// With a bottleneck: drop when the queue holds more than this many bytes.
    pub(crate) queue_limit_bytes: Option<u64>,
    /// Time the bottleneck becomes free.
    busy_until: Instant,
}

impl Default for Network {
    fn default() -> Self {
        Network {
            latency: Duration::from_micros(5),
            path_latency: None,
            jitter: Duration::ZERO,
            loss: 0.0,
            duplicate: 0.0,
            ecn: 0.0,
            drop_if: None,
            mark_if: None,
            mtu: usize::MAX,
            rate_bps: None,
            ecn_threshold_bytes: None,
            queue_limit_bytes: None,
            busy_until: Instant::ZERO,
        }
    }
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: Instant,
    seq: u64,
    path: u16,
    ce: bool,
    data: Vec<u8>,
}

/// Counters of what the networks did.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct NetStats {
    pub(crate) dropped: u64,
    pub(crate) duplicated: u64,
    pub(crate) marked: u64,
    pub(crate) delivered: u64,
}

/// Two connections joined by two networks, in virtual time.
pub(crate) struct Pair {
    pub(crate) a: Connection,
    pub(crate) b: Connection,
    pub(crate) now: Instant,
    /// Network carrying A → B.
    pub(crate) ab: Network,
    /// Network carrying B → A.
    pub(crate) ba: Network,
    to_a: BinaryHeap<Reverse<InFlight>>,
    to_b: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    rng: SmallRng,
    buf: Vec<u8>,
    /// Events seen on each side, in order.
    pub(crate) a_events: Vec<Event>,
    pub(crate) b_events: Vec<Event>,
    /// Every datagram sent: (time, from, transmit).
    pub(crate) log: Vec<(Instant, Side, Transmit)>,
    pub(crate) net: NetStats,
    /// Decode errors returned by `handle_datagram` (should stay empty).
    pub(crate) decode_errors: u64,
    steps: u64,
}

impl Pair {
    pub(crate) fn new(config: Config) -> Pair {
        Self::with_configs(
            Config {
                seed: config.seed,
                ..config.clone()
            },
            Config {
                seed: config.seed ^ 0x5eed,
                ..config
            },
        )
    }

    pub(crate) fn with_configs(a: Config, b: Config) -> Pair {
        Self::with_initial_psn(a, b, 0)
    }

    /// Both sides start at PSN `psn` (to test sequence-number wrap).
    pub(crate) fn with_initial_psn(a: Config, b: Config, psn: u32) -> Pair {
        let seed = a.seed.wrapping_mul(31).wrapping_add(b.seed);
        Pair {
            a: Connection::with_initial_psn(a, Instant::ZERO, psn),
            b: Connection::with_initial_psn(b, Instant::ZERO, psn),
            now: Instant::ZERO,
            ab: Network::default(),
            ba: Network::default(),
            to_a: BinaryHeap::new(),
            to_b: BinaryHeap::new(),
            seq: 0,
            rng: SmallRng::seed_from_u64(seed),
            buf: Vec::new(),
            a_events: Vec::new(),
            b_events: Vec::new(),
            log: Vec::new(),
            net: NetStats::default(),
            decode_errors: 0,
            steps: 0,
        }
    }

    /// Both directions get the same settings.
    pub(crate) fn network(&mut self, f: impl Fn(&mut Network)) {
        f(&mut self.ab);
        f(&mut self.ba);
    }

    fn flush(&mut self) {
        for side in [Side::A, Side::B] {
            loop {
                let (conn, net, queue, events) = match side {
                    Side::A => (
                        &mut self.a,
                        &mut self.ab,
                        &mut self.to_b,
                        &mut self.a_events,
                    ),
                    Side::B => (
                        &mut self.b,
                        &mut self.ba,
                        &mut self.to_a,
                        &mut self.b_events,
                    ),
                };
                while let Some(e) = conn.poll_event() {
                    events.push(e);
                }
                let Some(t) = conn.poll_transmit(self.now, &mut self.buf) else {
                    break;
                };
                self.log.push((self.now, side, t));
                let Ok(frame) = frame::decode(&self.buf[..t.len]) else {
                    panic!("connection emitted an undecodable datagram");
                };
                let sent = Sent {
                    from: side,
                    at: self.now,
                    transmit: t,
                    frame,
                };
                let mut drop =
                    t.wire_len() > net.mtu || (net.loss > 0.0 && self.rng.gen_bool(net.loss));
                if let Some(f) = net.drop_if.as_mut() {
                    drop |= f(&sent);
                }
                let mut ce = t.ecn_capable && net.ecn > 0.0 && self.rng.gen_bool(net.ecn);
                if t.ecn_capable {
                    if let Some(f) = net.mark_if.as_mut() {
                        ce |= f(&sent);
                    }
                }
                // Bottleneck queue.
                let mut depart = self.now;
                if let Some(rate) = net.rate_bps {
                    let start = net.busy_until.max(self.now);
                    let backlog_ns = (start - self.now).as_nanos() as f64;
                    let backlog_bytes = (backlog_ns * rate / 8e9) as u64;
                    if net.queue_limit_bytes.is_some_and(|l| backlog_bytes > l) {
                        drop = true;
                    }
                    if !drop {
                        if t.ecn_capable
                            && net.ecn_threshold_bytes.is_some_and(|k| backlog_bytes > k)
                        {
                            ce = true;
                        }
                        let tx = Duration::from_secs_f64(t.wire_len() as f64 * 8.0 / rate);
                        net.busy_until = start + tx;
                        depart = net.busy_until;
                    }
                }
                if drop {
                    self.net.dropped += 1;
                    continue;
                }
                if ce {
                    self.net.marked += 1;
                }
                let copies = if net.duplicate > 0.0 && self.rng.gen_bool(net.duplicate) {
                    2
                } else {
                    1
                };
                if copies == 2 {
                    self.net.duplicated += 1;
                }
                for _ in 0..copies {
                    let mut delay = net.latency;
                    if let Some(pl) = net.path_latency.as_ref() {
                        delay += pl(t.path);
                    }
                    if !net.jitter.is_zero() {
                        let j = self.rng.gen_range(0..=net.jitter.as_nanos() as u64);
                        delay += Duration::from_nanos(j);
                    }
                    self.seq += 1;
                    queue.push(Reverse(InFlight {
                        at: depart + delay,
                        seq: self.seq,
                        path: t.path.0,
                        ce,
                        data: self.buf[..t.len].to_vec(),
                    }));
                }
            }
        }
    }

    fn next_time(&self) -> Option<Instant> {
        [
            self.to_a.peek().map(|r| r.0.at),
            self.to_b.peek().map(|r| r.0.at),
            self.a.poll_timeout(),
            self.b.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// One step: send what both sides have, advance to the earliest arrival or
    /// deadline, deliver/fire it. Returns false when nothing is left to do.
    pub(crate) fn drive(&mut self) -> bool {
        self.flush();
        let Some(t) = self.next_time() else {
            return false;
        };
        self.steps += 1;
        assert!(self.steps < 20_000_000, "pair did not settle (livelock?)");
        self.now = self.now.max(t);
        let now = self.now;
        for side in [Side::A, Side::B] {
            let (conn, queue) = match side {
                Side::A => (&mut self.a, &mut self.to_a),
                Side::B => (&mut self.b, &mut self.to_b),
            };
            while queue.peek().is_some_and(|r| r.0.at <= now) {
                let Some(Reverse(p)) = queue.pop() else { break };
                self.net.delivered += 1;
                if conn
                    .handle_datagram(now, PathId(p.path), p.ce, &p.data)
                    .is_err()
                {
                    self.decode_errors += 1;
                }
            }
            if conn.poll_timeout().is_some_and(|d| d <= now) {
                conn.handle_timeout(now);
            }
        }
        self.flush();
        true
    }

    /// Drives until nothing is left to do or `limit` is reached.
    pub(crate) fn run(&mut self, limit: Duration) {
        let end = self.now + limit;
        loop {
            self.flush();
            if !self.next_time().is_some_and(|t| t <= end) || !self.drive() {
                break;
            }
        }
    }

    /// Drives until `pred` holds (true) or the limit passes (false).
    pub(crate) fn run_until(
        &mut self,
        limit: Duration,
        mut pred: impl FnMut(&Pair) -> bool,
    ) -> bool {
        let end = self.now + limit;
        loop {
            self.flush();
            if pred(self) {
                return true;
            }
            if !self.next_time().is_some_and(|t| t <= end) || !self.drive() {
                return pred(self);
            }
        }
    }

    /// Messages B received, as (id, length).
    pub(crate) fn b_received(&self) -> Vec<(u64, u64)> {
        self.b_events
            .iter()
            .filter_map(|e| match e {
                Event::MessageReceived { id, payload, .. } => Some((id.0, payload.len())),
                _ => None,
            })
            .collect()
    }

    /// Number of messages A saw acknowledged.
    pub(crate) fn a_acked(&self) -> usize {
        self.a_events
            .iter()
            .filter(|e| matches!(e, Event::MessageAcked(_)))
            .count()
    }

    /// Data packets A sent of `kind`.
    pub(crate) fn a_sent(&self, kind: PacketKind) -> usize {
        self.log
            .iter()
            .filter(|(_, s, t)| *s == Side::A && t.kind == kind)
            .count()
    }
}
