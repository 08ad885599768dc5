//! The simulation engine: builds a network from a [`Scenario`], runs the event loop and
//! collects results.
//!
//! Owns the event dispatch (links serialise, packets propagate, switches forward with ECMP,
//! hosts pull packets from their transports when their NIC is free, timers fire), the traffic
//! generators' schedule, fault injection and the measurements. It holds one [`Transport`] per
//! connection end and treats it as a black box: datagrams and time in, datagrams, deadlines and
//! events out. The hot loop allocates nothing once queues and pools have grown to size.

use std::collections::VecDeque;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::clock::{gbps_to_bps, Time, NANOS_PER_MICRO};
use crate::event_queue::{
    ConnId, EndpointId, Event, EventQueue, LinkId, NodeId, PacketId, TimerHeap,
};
use crate::link::{Enqueue, Pfc, Red};
use crate::node::{ecmp_select, FiveTuple, LeafSpineParams, NodeKind, Topology, ROCE_V2_PORT};
use crate::packet::PacketPool;
use crate::results::{self, FctRecord, RunResult, Timeline};
use crate::scenario::{glob_match, Scenario, TrafficConfig};
use crate::transport::{SendRejected, Transport, TransportEvent};
use crate::workload::Cdf;

/// What the transport factory is told about the endpoint it builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointSpec {
    /// Connection number.
    pub conn: ConnId,
    /// Whether this end sends the connection's messages (the other end receives them).
    pub is_sender: bool,
    /// Host this end lives on.
    pub host: NodeId,
    /// Host of the other end.
    pub peer_host: NodeId,
    /// Seed for the endpoint's own random choices (derived from the scenario seed).
    pub seed: u64,
}

#[derive(Debug)]
struct HostState {
    uplink: LinkId,
    endpoints: Vec<EndpointId>,
    next_endpoint: usize,
}

#[derive(Debug)]
struct EndpointState<T> {
    transport: T,
    host: NodeId,
    peer: EndpointId,
    conn: ConnId,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum ConnTraffic {
    Backlogged { message_bytes: u64, backlog: u32 },
    Once { bytes: u64 },
    Poisson { mean_gap_ns: f64, stop: Time },
}

#[derive(Debug)]
struct ConnState {
    src: NodeId,
    dst: NodeId,
    sender: EndpointId,
    receiver: EndpointId,
    base_port: u16,
    traffic: ConnTraffic,
    /// Messages accepted by the sender and not yet delivered: (start time, bytes), in order.
    in_flight: VecDeque<(Time, u64)>,
    /// Messages refused by back-pressure, retried after the next acknowledgement.
    waiting: VecDeque<(Time, u64)>,
    delivered_bytes: u64,
    measured_bytes: u64,
    messages_delivered: u64,
    traced_bytes_last: u64,
    is_failed: bool,
    is_started: bool,
}

/// A running simulation, generic over the transport on its connections.
pub struct Simulation<T: Transport> {
    scenario: Scenario,
    now: Time,
    end: Time,
    warmup: Time,
    queue: EventQueue,
    timers: TimerHeap,
    topo: Topology,
    packets: PacketPool,
    rng: SmallRng,
    traffic_rng: SmallRng,
    ecmp_seed: u64,
    pfc: Option<Pfc>,
    overhead: u32,
    hosts: Vec<HostState>,
    endpoints: Vec<EndpointState<T>>,
    conns: Vec<ConnState>,
    cdf: Option<Cdf>,
    sample_interval_ns: u64,
    watched: Vec<LinkId>,
    watched_last: Vec<u64>,
    traced: usize,
    timeline: Timeline,
    link_bytes_at_warmup: Vec<u64>,
    /// Receivers' accepted payload bytes when the measurement window opened, per connection.
    conn_bytes_at_warmup: Vec<u64>,
    fcts: Vec<FctRecord>,
    ooo_histogram: Vec<u64>,
    malformed_datagrams: u64,
    mismatched_deliveries: u64,
}

fn derive_seed(seed: u64, a: u64, b: u64) -> u64 {
    let mut z =
        seed ^ a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const EPHEMERAL_BASE: u16 = 49_152;
const EPHEMERAL_SPAN: u16 = 16_384;

impl<T: Transport> Simulation<T> {
    /// Builds the network and traffic of `scenario`; `make` builds each connection end.
    pub fn new(scenario: &Scenario, mut make: impl FnMut(&EndpointSpec) -> T) -> Self {
        let s = scenario;
        let t = &s.topology;
        let red = s.switch.ecn.map(|e| Red {
            kmin_bytes: (e.kmin_kb * 1024.0) as u64,
            kmax_bytes: (e.kmax_kb * 1024.0) as u64,
            pmax: e.pmax,
        });
        let pfc = s.switch.pfc.map(|p| Pfc {
            xoff_bytes: (p.xoff_kb * 1024.0) as u64,
            xon_bytes: (p.xon_kb * 1024.0) as u64,
        });
        let topo = Topology::leaf_spine(&LeafSpineParams {
            spines: t.spines,
            leaves: t.leaves,
            hosts_per_leaf: t.hosts_per_leaf,
            host_link_gbps: t.host_link_gbps,
            fabric_link_gbps: t.fabric_link_gbps,
            link_delay_ns: t.link_delay_ns,
            switch_buffer_bytes: t.switch_buffer_kb * 1024,
            // Hosts pull from their transports only when the NIC is idle, so at most one
            // packet waits here; the bound just has to admit the largest datagram.
            host_buffer_bytes: 1 << 20,
            red,
        });
        let mut traffic_rng = SmallRng::seed_from_u64(derive_seed(s.seed, 1, 0));
        let hosts_n = topo.num_hosts;
        let mut hosts: Vec<HostState> = (0..hosts_n)
            .map(|h| HostState {
                uplink: topo.host_uplink(h),
                endpoints: Vec::new(),
                next_endpoint: 0,
            })
            .collect();

        // Connections: (src, dst, traffic).
        let host_bps = gbps_to_bps(t.host_link_gbps) as f64;
        let end = Time::from_millis_f64(s.duration_ms);
        let mut cdf = None;
        let mut plan: Vec<(NodeId, NodeId, ConnTraffic)> = Vec::new();
        match &s.traffic {
            TrafficConfig::LongFlows {
                pairs,
                message_bytes,
                backlog,
            } => {
                for [a, b] in pairs {
                    plan.push((
                        *a,
                        *b,
                        ConnTraffic::Backlogged {
                            message_bytes: *message_bytes,
                            backlog: *backlog,
                        },
                    ));
                }
            }
            TrafficConfig::Permutation {
                message_bytes,
                backlog,
            } => {
                // Sattolo's shuffle: a single cycle, so nobody sends to itself.
                let mut perm: Vec<u32> = (0..hosts_n).collect();
                for i in (1..perm.len()).rev() {
                    let j = traffic_rng.gen_range(0..i);
                    perm.swap(i, j);
                }
                for (a, &b) in perm.iter().enumerate() {
                    plan.push((
                        a as u32,
                        b,
                        ConnTraffic::Backlogged {
                            message_bytes: *message_bytes,
                            backlog: *backlog,
                        },
                    ));
                }
            }
            TrafficConfig::Incast {
                receiver,
                senders,
                flow_bytes,
                message_bytes,
                backlog,
            } => {
                for i in 0..*senders {
                    let src = (receiver + 1 + i) % hosts_n;
                    let traffic = match flow_bytes {
                        Some(b) => ConnTraffic::Once { bytes: *b },
                        None => ConnTraffic::Backlogged {
                            message_bytes: *message_bytes,
                            backlog: *backlog,
                        },
                    };
                    plan.push((src, *receiver, traffic));
                }
            }
            TrafficConfig::Workload {
                connections,
                load,
                cdf: name,
                stop_ms,
            } => {
                let c = Cdf::by_name(name).unwrap_or_else(|| {
                    Cdf::by_name("web_search").expect("the web search CDF is shipped")
                });
                let mean_gap_ns = c.mean() * 8.0 / (load * host_bps) * 1e9;
                let stop = stop_ms.map(Time::from_millis_f64).unwrap_or(end);
                cdf = Some(c);
                for _ in 0..*connections {
                    let a = traffic_rng.gen_range(0..hosts_n);
                    let mut b = traffic_rng.gen_range(0..hosts_n - 1);
                    if b >= a {
                        b += 1;
                    }
                    plan.push((a, b, ConnTraffic::Poisson { mean_gap_ns, stop }));
                }
            }
        }

        let mut endpoints = Vec::with_capacity(plan.len() * 2);
        let mut conns = Vec::with_capacity(plan.len());
        let mut queue = EventQueue::with_capacity(1 << 16);
        for (i, (src, dst, traffic)) in plan.into_iter().enumerate() {
            let conn = i as ConnId;
            let sender = endpoints.len() as EndpointId;
            let receiver = sender + 1;
            for (is_sender, host, peer_host) in [(true, src, dst), (false, dst, src)] {
                let spec = EndpointSpec {
                    conn,
                    is_sender,
                    host,
                    peer_host,
                    seed: derive_seed(s.seed, 2 + u64::from(conn), u64::from(is_sender)),
                };
                endpoints.push(EndpointState {
                    transport: make(&spec),
                    host,
                    peer: if is_sender { receiver } else { sender },
                    conn,
                });
                hosts[host as usize]
                    .endpoints
                    .push(endpoints.len() as EndpointId - 1);
            }
            let base_port = EPHEMERAL_BASE + traffic_rng.gen_range(0..EPHEMERAL_SPAN);
            let start = match traffic {
                // A few microseconds of jitter so that flows do not start in lockstep.
                ConnTraffic::Backlogged { .. } | ConnTraffic::Once { .. } => {
                    Time(traffic_rng.gen_range(0..5 * NANOS_PER_MICRO))
                }
                ConnTraffic::Poisson { mean_gap_ns, .. } => {
                    Time(exp_sample(&mut traffic_rng, mean_gap_ns))
                }
            };
            queue.push(start, Event::MessageStart { conn });
            conns.push(ConnState {
                src,
                dst,
                sender,
                receiver,
                base_port,
                traffic,
                in_flight: VecDeque::new(),
                waiting: VecDeque::new(),
                delivered_bytes: 0,
                measured_bytes: 0,
                messages_delivered: 0,
                traced_bytes_last: 0,
                is_failed: false,
                is_started: false,
            });
        }

        let mut topo = topo;
        for f in &s.faults {
            for l in topo.links_matching_fn(|name| glob_match(&f.link, name)) {
                if let Some(loss) = f.loss {
                    if f.loss_from_ms <= 0.0 {
                        topo.links[l as usize].loss = loss;
                    } else {
                        queue.push(
                            Time::from_millis_f64(f.loss_from_ms),
                            Event::LinkLoss {
                                link: l,
                                loss_ppm: (loss * 1e6).round() as u32,
                            },
                        );
                    }
                }
                if let Some(r) = f.rate_gbps {
                    topo.links[l as usize].bits_per_sec = gbps_to_bps(r);
                }
                if let Some(d) = f.extra_delay_ns {
                    topo.links[l as usize].propagation_ns += d;
                }
                if let Some(at) = f.down_at_ms {
                    queue.push(
                        Time::from_millis_f64(at),
                        Event::LinkState { link: l, up: false },
                    );
                }
                if let Some(at) = f.up_at_ms {
                    queue.push(
                        Time::from_millis_f64(at),
                        Event::LinkState { link: l, up: true },
                    );
                }
            }
        }
        let mut watched = Vec::new();
        for pattern in &s.output.watch_links {
            for l in topo.links_matching_fn(|name| glob_match(pattern, name)) {
                if !watched.contains(&l) {
                    watched.push(l);
                }
            }
        }
        let sample_interval_ns = ((s.sample_interval_us * 1e3) as u64).max(1);
        queue.push(Time(sample_interval_ns), Event::Sample);
        let warmup = Time::from_millis_f64(s.warmup_ms);
        let traced = (s.output.trace_conns as usize).min(conns.len());
        let timeline = Timeline {
            time_ms: Vec::new(),
            link_names: watched
                .iter()
                .map(|&l| topo.links[l as usize].name.clone())
                .collect(),
            link_gbps: vec![Vec::new(); watched.len()],
            conn_cwnd: vec![Vec::new(); traced],
            conn_goodput_gbps: vec![Vec::new(); traced],
        };
        let link_count = topo.links.len();
        let conns_len = conns.len();
        Simulation {
            scenario: s.clone(),
            now: Time::ZERO,
            end,
            warmup,
            queue,
            timers: TimerHeap::new(endpoints.len()),
            watched_last: vec![0; watched.len()],
            watched,
            topo,
            packets: PacketPool::new(),
            rng: SmallRng::seed_from_u64(derive_seed(s.seed, 0, 0)),
            traffic_rng,
            ecmp_seed: derive_seed(s.seed, 3, 3),
            pfc,
            overhead: s.frame_overhead_bytes,
            hosts,
            endpoints,
            conns,
            cdf,
            sample_interval_ns,
            traced,
            timeline,
            link_bytes_at_warmup: vec![0; link_count],
            conn_bytes_at_warmup: vec![0; conns_len],
            fcts: Vec::new(),
            ooo_histogram: Vec::new(),
            malformed_datagrams: 0,
            mismatched_deliveries: 0,
        }
    }

    /// Current simulated time.
    pub fn now(&self) -> Time {
        self.now
    }

    /// End of the run.
    pub fn end(&self) -> Time {
        self.end
    }

    /// Events processed so far.
    pub fn events_processed(&self) -> u64 {
        self.queue.events_processed()
    }

    /// The transport of endpoint `ep` (connection `c` has endpoints `2c`, sender, and
    /// `2c + 1`, receiver).
    pub fn transport(&self, ep: EndpointId) -> Option<&T> {
        self.endpoints.get(ep as usize).map(|e| &e.transport)
    }

    /// The network (for inspection in tests).
    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    /// Runs every event up to `until` (capped at the end of the run); returns whether the
    /// run has finished.
    pub fn run_until(&mut self, until: Time) -> bool {
        let until = until.min(self.end);
        if self.warmup > self.now && self.warmup <= until {
            // Snapshot link counters when the measurement window opens.
            self.step_to(self.warmup);
            for (i, l) in self.topo.links.iter().enumerate() {
                self.link_bytes_at_warmup[i] = l.counters.tx_bytes;
            }
            for (i, c) in self.conns.iter().enumerate() {
                let r = &self.endpoints[c.receiver as usize].transport;
                self.conn_bytes_at_warmup[i] = r.received_payload_bytes();
            }
        }
        self.step_to(until);
        self.now = self.now.max(until);
        self.now >= self.end
    }

    fn step_to(&mut self, until: Time) {
        loop {
            // Events and timers share one (time, sequence) order.
            let event = self.queue.peek_key();
            let timer = self.timers.peek_key();
            let is_timer = match (event, timer) {
                (None, None) => break,
                (Some(_), None) => false,
                (None, Some(_)) => true,
                (Some(e), Some(t)) => t < e,
            };
            if is_timer {
                let Some((t, _)) = timer else { break };
                if t > until {
                    break;
                }
                let Some((t, ep)) = self.timers.pop() else {
                    break;
                };
                self.queue.count_external();
                self.now = t;
                self.timer(ep);
            } else {
                let Some((t, _)) = event else { break };
                if t > until {
                    break;
                }
                let Some((t, ev)) = self.queue.pop() else {
                    break;
                };
                self.now = t;
                self.dispatch(ev);
            }
        }
    }

    /// Runs to the end.
    pub fn run(&mut self) {
        self.run_until(self.end);
    }

    fn dispatch(&mut self, ev: Event) {
        match ev {
            Event::TxDone { link } => {
                let l = &mut self.topo.links[link as usize];
                if self.now < l.busy_until {
                    // Another packet started at the instant this one ended (an event at the
                    // same time ran first): wake up again when that one is done.
                    let at = l.busy_until;
                    self.queue.push(at, Event::TxDone { link });
                } else {
                    l.has_tx_done_pending = false;
                    self.resume_link(link);
                }
            }
            Event::Arrive { link, packet } => self.arrive(link, packet),
            Event::MessageStart { conn } => self.message_start(conn),
            Event::Pfc { link, pause } => {
                let l = &mut self.topo.links[link as usize];
                l.is_paused = pause;
                if pause {
                    l.counters.pauses += 1;
                } else {
                    self.resume_link(link);
                }
            }
            Event::LinkState { link, up } => self.set_link_state(link, up),
            Event::LinkLoss { link, loss_ppm } => {
                self.topo.links[link as usize].loss = f64::from(loss_ppm) / 1e6;
            }
            Event::Sample => self.sample(),
        }
    }

    /// Lets the transmitter of `link` start its next packet (pulling from the host's
    /// transports when it is a host NIC).
    fn resume_link(&mut self, link: LinkId) {
        let from = self.topo.links[link as usize].from;
        if from < self.topo.num_hosts {
            self.kick_host(from);
        } else {
            self.try_start(link);
        }
    }

    fn try_start(&mut self, l: LinkId) {
        let now = self.now;
        let is_host_nic = self.topo.links[l as usize].from < self.topo.num_hosts;
        let link = &mut self.topo.links[l as usize];
        let Some((p, bytes, ser)) = link.start_next(now) else {
            // Still serialising: come back when the wire is free if a packet waits.
            if link.is_up && !link.is_paused && !link.queue.is_empty() && !link.has_tx_done_pending
            {
                link.has_tx_done_pending = true;
                let at = link.busy_until;
                self.queue.push(at, Event::TxDone { link: l });
            }
            return;
        };
        let prop = link.propagation_ns;
        let lost = link.record_tx(bytes, &mut self.rng);
        // A switch port needs a wake-up only if packets wait behind this one; a host NIC
        // always does, to pull the next packet from its transports.
        if (is_host_nic || !link.queue.is_empty()) && !link.has_tx_done_pending {
            link.has_tx_done_pending = true;
            self.queue.push(now + ser, Event::TxDone { link: l });
        }
        if let Some(in_link) = self.packets.get_mut(p).ingress.take() {
            let upstream = &mut self.topo.links[in_link as usize];
            if upstream.ingress_remove(self.pfc, bytes) {
                let t = self.now + upstream.propagation_ns;
                self.queue.push(
                    t,
                    Event::Pfc {
                        link: in_link,
                        pause: false,
                    },
                );
            }
        }
        if lost {
            self.packets.free(p);
        } else {
            self.queue
                .push(self.now + ser + prop, Event::Arrive { link: l, packet: p });
        }
    }

    fn arrive(&mut self, l: LinkId, p: PacketId) {
        let link = &mut self.topo.links[l as usize];
        if !link.is_up {
            link.counters.drops_down += 1;
            self.packets.free(p);
            return;
        }
        let node = link.to;
        match self.topo.nodes[node as usize].kind {
            NodeKind::Host { .. } => self.deliver(p),
            NodeKind::Switch => self.forward(node, l, p),
        }
    }

    fn forward(&mut self, switch: NodeId, in_link: LinkId, p: PacketId) {
        let pkt = self.packets.get(p);
        let hops = self.topo.next_hops(switch, pkt.dst_host);
        let egress = match hops.len() {
            0 => {
                self.packets.free(p);
                return;
            }
            1 => hops[0],
            _ => {
                let tuple = FiveTuple {
                    src: pkt.src_host,
                    dst: pkt.dst_host,
                    src_port: pkt.src_port,
                    dst_port: ROCE_V2_PORT,
                };
                ecmp_select(self.ecmp_seed, switch, &tuple, hops)
            }
        };
        let (bytes, ecn) = (pkt.wire_bytes, pkt.is_ecn_capable);
        match self.topo.links[egress as usize].enqueue(p, bytes, ecn, &mut self.rng) {
            Enqueue::Queued { marked } => {
                let pkt = self.packets.get_mut(p);
                pkt.is_ce |= marked;
                pkt.ingress = Some(in_link);
                let upstream = &mut self.topo.links[in_link as usize];
                if upstream.ingress_add(self.pfc, bytes) {
                    let t = self.now + upstream.propagation_ns;
                    self.queue.push(
                        t,
                        Event::Pfc {
                            link: in_link,
                            pause: true,
                        },
                    );
                }
                self.try_start(egress);
            }
            Enqueue::Overflow | Enqueue::Down => self.packets.free(p),
        }
    }

    fn deliver(&mut self, p: PacketId) {
        let pkt = self.packets.get(p);
        let ep = pkt.dst_endpoint;
        let e = &mut self.endpoints[ep as usize];
        let ok = e
            .transport
            .handle_datagram(self.now, pkt.path, pkt.is_ce, &pkt.bytes);
        if !ok {
            self.malformed_datagrams += 1;
        }
        let host = e.host;
        self.packets.free(p);
        self.after_activity(ep);
        self.kick_host(host);
    }

    /// Hands the host's idle NIC the next packet of one of its transports, round-robin.
    fn kick_host(&mut self, h: NodeId) {
        let uplink = self.hosts[h as usize].uplink;
        let link = &self.topo.links[uplink as usize];
        if !link.can_start(self.now) {
            return;
        }
        if !link.queue.is_empty() {
            self.try_start(uplink);
            return;
        }
        let n = self.hosts[h as usize].endpoints.len();
        for i in 0..n {
            let host = &self.hosts[h as usize];
            let idx = (host.next_endpoint + i) % n;
            let ep = host.endpoints[idx];
            let p = self.packets.alloc();
            let e = &mut self.endpoints[ep as usize];
            let pkt = self.packets.get_mut(p);
            let Some(tx) = e.transport.poll_transmit(self.now, &mut pkt.bytes) else {
                self.packets.free(p);
                continue;
            };
            let peer = e.peer;
            let conn = &self.conns[e.conn as usize];
            pkt.src_endpoint = ep;
            pkt.dst_endpoint = peer;
            pkt.src_host = h;
            pkt.dst_host = self.endpoints[peer as usize].host;
            pkt.path = tx.path;
            pkt.src_port = EPHEMERAL_BASE
                + ((conn.base_port - EPHEMERAL_BASE).wrapping_add(tx.path) % EPHEMERAL_SPAN);
            pkt.wire_bytes = tx.datagram_bytes.saturating_add(self.overhead);
            pkt.payload_bytes = tx.payload_bytes;
            pkt.is_ecn_capable = tx.is_ecn_capable;
            pkt.is_ce = false;
            pkt.ingress = None;
            let wire = pkt.wire_bytes;
            self.hosts[h as usize].next_endpoint = (idx + 1) % n;
            let rng = &mut self.rng;
            match self.topo.links[uplink as usize].enqueue(p, wire, false, rng) {
                Enqueue::Queued { .. } => self.try_start(uplink),
                Enqueue::Overflow | Enqueue::Down => self.packets.free(p),
            }
            self.after_activity(ep);
            return;
        }
    }

    fn timer(&mut self, ep: EndpointId) {
        let now = self.now;
        let e = &mut self.endpoints[ep as usize];
        if let Some(deadline) = e.transport.poll_timeout() {
            if deadline <= now {
                e.transport.handle_timeout(now);
            }
        }
        let host = e.host;
        self.after_activity(ep);
        self.kick_host(host);
    }

    /// Drains the endpoint's events and re-arms its timer.
    fn after_activity(&mut self, ep: EndpointId) {
        while let Some(ev) = self.endpoints[ep as usize].transport.poll_event() {
            self.handle_transport_event(ep, ev);
        }
        let now = self.now;
        let deadline = self.endpoints[ep as usize].transport.poll_timeout();
        // Never schedule in the past; a deadline that stays due after handle_timeout is
        // retried a nanosecond later rather than spinning at one instant.
        let at = deadline.map(|d| if d <= now { now + 1 } else { d });
        let queue = &mut self.queue;
        self.timers.set(ep, at, || queue.take_seq());
    }

    fn handle_transport_event(&mut self, ep: EndpointId, ev: TransportEvent) {
        let conn_id = self.endpoints[ep as usize].conn;
        match ev {
            TransportEvent::Delivered { len } => {
                let now = self.now;
                let c = &mut self.conns[conn_id as usize];
                c.delivered_bytes += len;
                c.messages_delivered += 1;
                if now >= self.warmup {
                    c.measured_bytes += len;
                }
                match c.in_flight.pop_front() {
                    Some((start, size)) => {
                        if size != len {
                            self.mismatched_deliveries += 1;
                        }
                        if !matches!(c.traffic, ConnTraffic::Backlogged { .. }) {
                            self.fcts.push(FctRecord {
                                conn: conn_id,
                                size,
                                start_ns: start.0,
                                fct_ns: now - start,
                            });
                        }
                    }
                    None => self.mismatched_deliveries += 1,
                }
            }
            TransportEvent::Acked { .. } => {
                let c = &self.conns[conn_id as usize];
                if let ConnTraffic::Backlogged { message_bytes, .. } = c.traffic {
                    if self.now < self.end {
                        self.conns[conn_id as usize]
                            .waiting
                            .push_back((self.now, message_bytes));
                    }
                }
                self.flush_waiting(conn_id);
            }
            TransportEvent::Failed => self.conns[conn_id as usize].is_failed = true,
        }
    }

    /// Hands queued messages to the sender until it pushes back.
    fn flush_waiting(&mut self, conn_id: ConnId) {
        let now = self.now;
        let c = &mut self.conns[conn_id as usize];
        let sender = &mut self.endpoints[c.sender as usize];
        while let Some(&(start, size)) = c.waiting.front() {
            match sender.transport.send_message(now, size) {
                Ok(_) => {
                    c.waiting.pop_front();
                    c.in_flight.push_back((start, size));
                }
                Err(SendRejected::Backpressure) => break,
                Err(SendRejected::Fatal) => {
                    c.waiting.clear();
                    c.is_failed = true;
                    break;
                }
            }
        }
    }

    fn message_start(&mut self, conn_id: ConnId) {
        let now = self.now;
        let c = &mut self.conns[conn_id as usize];
        match c.traffic {
            ConnTraffic::Backlogged {
                message_bytes,
                backlog,
            } => {
                if !c.is_started {
                    for _ in 0..backlog {
                        c.waiting.push_back((now, message_bytes));
                    }
                }
            }
            ConnTraffic::Once { bytes } => {
                if !c.is_started {
                    c.waiting.push_back((now, bytes));
                }
            }
            ConnTraffic::Poisson { mean_gap_ns, stop } => {
                let size = match &self.cdf {
                    Some(cdf) => cdf.sample(&mut self.traffic_rng),
                    None => 1,
                };
                c.waiting.push_back((now, size));
                let next = now + exp_sample(&mut self.traffic_rng, mean_gap_ns);
                if next < stop && next < self.end {
                    self.queue.push(next, Event::MessageStart { conn: conn_id });
                }
            }
        }
        c.is_started = true;
        let sender = c.sender;
        let src = c.src;
        self.flush_waiting(conn_id);
        self.after_activity(sender);
        self.kick_host(src);
    }

    fn set_link_state(&mut self, l: LinkId, up: bool) {
        self.topo.links[l as usize].is_up = up;
        if up {
            self.resume_link(l);
            return;
        }
        // A failed port loses what it held.
        let held: Vec<(PacketId, u32)> = self.topo.links[l as usize].drain_queue().collect();
        for (p, bytes) in held {
            self.topo.links[l as usize].counters.drops_down += 1;
            if let Some(in_link) = self.packets.get_mut(p).ingress.take() {
                let upstream = &mut self.topo.links[in_link as usize];
                if upstream.ingress_remove(self.pfc, bytes) {
                    let t = self.now + upstream.propagation_ns;
                    self.queue.push(
                        t,
                        Event::Pfc {
                            link: in_link,
                            pause: false,
                        },
                    );
                }
            }
            self.packets.free(p);
        }
    }

    fn sample(&mut self) {
        let interval = self.sample_interval_ns as f64;
        self.timeline.time_ms.push(self.now.as_millis_f64());
        for (i, &l) in self.watched.iter().enumerate() {
            let bytes = self.topo.links[l as usize].counters.tx_bytes;
            let gbps = (bytes - self.watched_last[i]) as f64 * 8.0 / interval;
            self.watched_last[i] = bytes;
            self.timeline.link_gbps[i].push(gbps);
        }
        for c in 0..self.traced {
            let conn = &mut self.conns[c];
            let s = self.endpoints[conn.sender as usize].transport.sample();
            self.timeline.conn_cwnd[c].push(s.cwnd_packets);
            let gbps = (conn.delivered_bytes - conn.traced_bytes_last) as f64 * 8.0 / interval;
            conn.traced_bytes_last = conn.delivered_bytes;
            self.timeline.conn_goodput_gbps[c].push(gbps);
        }
        let next = self.now + self.sample_interval_ns;
        if next <= self.end {
            self.queue.push(next, Event::Sample);
        }
    }

    /// Collects the results of the run (call after [`Simulation::run`]); the wall-clock and
    /// CPU seconds it took are only reported.
    pub fn finish(mut self, wall_secs: f64, cpu_secs: f64) -> RunResult {
        for e in &mut self.endpoints {
            e.transport.drain_ooo_histogram(&mut self.ooo_histogram);
        }
        let window_ns = (self.end - self.warmup).max(1);
        let conns = self
            .conns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let s = self.endpoints[c.sender as usize].transport.sample();
                let receiver = &self.endpoints[c.receiver as usize].transport;
                let r = receiver.sample();
                let received = receiver.received_payload_bytes() - self.conn_bytes_at_warmup[i];
                results::ConnResult {
                    conn: i as u32,
                    src: c.src,
                    dst: c.dst,
                    goodput_gbps: received as f64 * 8.0 / window_ns as f64,
                    message_goodput_gbps: c.measured_bytes as f64 * 8.0 / window_ns as f64,
                    delivered_bytes: c.delivered_bytes,
                    messages_delivered: c.messages_delivered,
                    retransmits: s.retransmits,
                    final_cwnd: s.cwnd_packets,
                    max_ooo_gap: r.max_ooo_gap,
                    is_failed: c.is_failed,
                }
            })
            .collect();
        let links = self
            .topo
            .links
            .iter()
            .enumerate()
            .map(|(i, l)| results::LinkResult {
                name: l.name.clone(),
                gbps: l.bits_per_sec as f64 / 1e9,
                utilisation: (l.counters.tx_bytes - self.link_bytes_at_warmup[i]) as f64 * 8.0
                    / (l.bits_per_sec as f64 * window_ns as f64 / 1e9),
                counters: l.counters,
            })
            .collect();
        let events = self.queue.events_processed();
        results::assemble(results::RunParts {
            scenario_file: &self.scenario.scenario,
            scenario: &self.scenario,
            conns,
            links,
            fcts: self.fcts,
            timeline: self.timeline,
            ooo_histogram: self.ooo_histogram,
            events,
            wall_secs,
            cpu_secs,
            malformed_datagrams: self.malformed_datagrams,
            mismatched_deliveries: self.mismatched_deliveries,
            packet_pool_high_water: self.packets.capacity() as u64,
        })
    }
}

fn exp_sample<R: Rng>(rng: &mut R, mean: f64) -> u64 {
    let u: f64 = rng.gen::<f64>();
    (-(1.0 - u).ln() * mean).round().max(1.0) as u64
}
