//! Nodes (hosts and switches), the topology builder and ECMP forwarding.
//!
//! Owns: which nodes exist, which links join them, the shortest-path next-hop sets every
//! switch uses (computed once by breadth-first search from each host), and the seeded 5-tuple
//! hash that picks one next hop among equal-cost links. It does not own queues (`link`) or
//! transports (`sim`). A host has exactly one uplink, its NIC.

use std::collections::VecDeque;

use crate::clock::gbps_to_bps;
use crate::event_queue::{LinkId, NodeId};
use crate::link::{Link, Red};

/// What a node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    /// An end host; `index` is its host number (0-based, the order hosts were created).
    Host {
        /// Host number.
        index: u32,
    },
    /// A switch (leaf or spine).
    Switch,
}

/// A node of the topology.
#[derive(Clone, Debug)]
pub struct Node {
    /// Name, `"h3"`, `"leaf0"`, `"spine2"`.
    pub name: String,
    /// Host or switch.
    pub kind: NodeKind,
    /// Links leaving this node (for a host: exactly one, the NIC uplink).
    pub out_links: Vec<LinkId>,
}

/// Parameters of a two-tier leaf-spine (Clos) fabric. "N parallel paths between two hosts"
/// is the special case `leaves = 2, hosts_per_leaf = 1, spines = N`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LeafSpineParams {
    /// Spine switches.
    pub spines: u32,
    /// Leaf (top-of-rack) switches.
    pub leaves: u32,
    /// Hosts under each leaf.
    pub hosts_per_leaf: u32,
    /// Host–leaf link rate.
    pub host_link_gbps: f64,
    /// Leaf–spine link rate.
    pub fabric_link_gbps: f64,
    /// Propagation delay of every link, in nanoseconds.
    pub link_delay_ns: u64,
    /// Output queue capacity of switch ports, in bytes.
    pub switch_buffer_bytes: u64,
    /// Output queue capacity of host NICs, in bytes (hosts pull from their transports, so
    /// this only bounds what a host may have queued behind the wire).
    pub host_buffer_bytes: u64,
    /// RED/ECN at switch ports.
    pub red: Option<Red>,
}

/// The built network: nodes, links and forwarding tables.
#[derive(Debug)]
pub struct Topology {
    /// All nodes; hosts first (node id = host index), then leaves, then spines.
    pub nodes: Vec<Node>,
    /// All links.
    pub links: Vec<Link>,
    /// Number of hosts.
    pub num_hosts: u32,
    /// Leaf switch of each host.
    pub host_leaf: Vec<NodeId>,
    /// `route_index[node * num_hosts + host]` = (start, len) into `route_links`: the
    /// equal-cost next-hop links from `node` towards `host`.
    route_index: Vec<(u32, u16)>,
    route_links: Vec<LinkId>,
}

impl Topology {
    /// Builds a leaf-spine fabric, every leaf joined to every spine by one link each way.
    pub fn leaf_spine(p: &LeafSpineParams) -> Topology {
        let num_hosts = p.leaves * p.hosts_per_leaf;
        let mut nodes = Vec::new();
        for h in 0..num_hosts {
            nodes.push(Node {
                name: format!("h{h}"),
                kind: NodeKind::Host { index: h },
                out_links: Vec::new(),
            });
        }
        let leaf0 = nodes.len() as NodeId;
        for l in 0..p.leaves {
            nodes.push(Node {
                name: format!("leaf{l}"),
                kind: NodeKind::Switch,
                out_links: Vec::new(),
            });
        }
        let spine0 = nodes.len() as NodeId;
        for s in 0..p.spines {
            nodes.push(Node {
                name: format!("spine{s}"),
                kind: NodeKind::Switch,
                out_links: Vec::new(),
            });
        }
        let mut links = Vec::new();
        let host_bps = gbps_to_bps(p.host_link_gbps);
        let fabric_bps = gbps_to_bps(p.fabric_link_gbps);
        let mut add = |nodes: &mut Vec<Node>, a: NodeId, b: NodeId, bps: u64, cap: u64, red| {
            let name = format!("{}->{}", nodes[a as usize].name, nodes[b as usize].name);
            let id = links.len() as LinkId;
            links.push(Link::new(name, a, b, bps, p.link_delay_ns, cap, red));
            nodes[a as usize].out_links.push(id);
        };
        let mut host_leaf = Vec::with_capacity(num_hosts as usize);
        for h in 0..num_hosts {
            let leaf = leaf0 + h / p.hosts_per_leaf;
            host_leaf.push(leaf);
            add(&mut nodes, h, leaf, host_bps, p.host_buffer_bytes, None);
            add(&mut nodes, leaf, h, host_bps, p.switch_buffer_bytes, p.red);
        }
        for l in 0..p.leaves {
            for s in 0..p.spines {
                let (leaf, spine) = (leaf0 + l, spine0 + s);
                add(
                    &mut nodes,
                    leaf,
                    spine,
                    fabric_bps,
                    p.switch_buffer_bytes,
                    p.red,
                );
                add(
                    &mut nodes,
                    spine,
                    leaf,
                    fabric_bps,
                    p.switch_buffer_bytes,
                    p.red,
                );
            }
        }
        let mut topo = Topology {
            nodes,
            links,
            num_hosts,
            host_leaf,
            route_index: Vec::new(),
            route_links: Vec::new(),
        };
        topo.compute_routes();
        topo
    }

    /// Fills the next-hop tables by breadth-first search towards every host.
    fn compute_routes(&mut self) {
        let n = self.nodes.len();
        let hosts = self.num_hosts as usize;
        // Incoming links of every node, for the reverse search.
        let mut in_links: Vec<Vec<LinkId>> = vec![Vec::new(); n];
        for (id, l) in self.links.iter().enumerate() {
            in_links[l.to as usize].push(id as LinkId);
        }
        self.route_index = vec![(0, 0); n * hosts];
        self.route_links.clear();
        let mut dist = vec![u32::MAX; n];
        let mut frontier = VecDeque::new();
        for h in 0..hosts {
            dist.iter_mut().for_each(|d| *d = u32::MAX);
            dist[h] = 0;
            frontier.push_back(h);
            while let Some(v) = frontier.pop_front() {
                for &l in &in_links[v] {
                    let u = self.links[l as usize].from as usize;
                    // Hosts do not forward: paths never pass through another host.
                    if dist[u] == u32::MAX {
                        dist[u] = dist[v] + 1;
                        if matches!(self.nodes[u].kind, NodeKind::Switch) {
                            frontier.push_back(u);
                        }
                    }
                }
            }
            for u in 0..n {
                if dist[u] == u32::MAX || u == h {
                    continue;
                }
                let start = self.route_links.len() as u32;
                for &l in &self.nodes[u].out_links {
                    let to = self.links[l as usize].to as usize;
                    if dist[to] != u32::MAX && dist[to] + 1 == dist[u] {
                        self.route_links.push(l);
                    }
                }
                let len = (self.route_links.len() as u32 - start) as u16;
                self.route_index[u * hosts + h] = (start, len);
            }
        }
    }

    /// Equal-cost next-hop links from `node` towards host `dst`.
    pub fn next_hops(&self, node: NodeId, dst: NodeId) -> &[LinkId] {
        let (start, len) = self.route_index[node as usize * self.num_hosts as usize + dst as usize];
        &self.route_links[start as usize..start as usize + len as usize]
    }

    /// The NIC uplink of host `h`.
    pub fn host_uplink(&self, h: NodeId) -> LinkId {
        self.nodes[h as usize].out_links[0]
    }

    /// Links whose name satisfies `pred`.
    pub fn links_matching_fn(&self, pred: impl Fn(&str) -> bool) -> Vec<LinkId> {
        self.links
            .iter()
            .enumerate()
            .filter(|(_, l)| pred(&l.name))
            .map(|(i, _)| i as LinkId)
            .collect()
    }

    /// Finds links by name: an exact name, or a pattern ending in `*` matching a prefix.
    pub fn links_matching(&self, pattern: &str) -> Vec<LinkId> {
        let (prefix, is_glob) = match pattern.strip_suffix('*') {
            Some(p) => (p, true),
            None => (pattern, false),
        };
        self.links
            .iter()
            .enumerate()
            .filter(|(_, l)| {
                if is_glob {
                    l.name.starts_with(prefix)
                } else {
                    l.name == prefix
                }
            })
            .map(|(i, _)| i as LinkId)
            .collect()
    }
}

/// The 5-tuple of a RoCEv2 packet as switches hash it (protocol is always UDP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FiveTuple {
    /// Source address (the host number stands for its IP).
    pub src: u32,
    /// Destination address.
    pub dst: u32,
    /// UDP source port: varies with the virtual path.
    pub src_port: u16,
    /// UDP destination port (4791 for RoCEv2).
    pub dst_port: u16,
}

/// RoCEv2's UDP destination port.
pub const ROCE_V2_PORT: u16 = 4791;

fn mix64(mut z: u64) -> u64 {
    // splitmix64 finaliser: a fast, well-spread 64-bit mixer.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Seeded ECMP hash of a 5-tuple at one switch (each switch has its own hash seed, as real
/// fabrics configure to avoid polarisation).
pub fn ecmp_hash(seed: u64, switch: NodeId, t: &FiveTuple) -> u64 {
    let a = mix64(seed ^ mix64(u64::from(switch).wrapping_add(0x9e37_79b9_7f4a_7c15)));
    let b = (u64::from(t.src) << 32) | u64::from(t.dst);
    let c = (u64::from(t.src_port) << 16) | u64::from(t.dst_port) | (17 << 32);
    mix64(a ^ mix64(b ^ mix64(c)))
}

/// Picks the next hop for a tuple among `choices` (non-empty).
pub fn ecmp_select(seed: u64, switch: NodeId, t: &FiveTuple, choices: &[LinkId]) -> LinkId {
    let n = choices.len() as u64;
    choices[(ecmp_hash(seed, switch, t) % n) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(spines: u32, leaves: u32, hosts_per_leaf: u32) -> LeafSpineParams {
        LeafSpineParams {
            spines,
            leaves,
            hosts_per_leaf,
            host_link_gbps: 40.0,
            fabric_link_gbps: 100.0,
            link_delay_ns: 2_000,
            switch_buffer_bytes: 1 << 20,
            host_buffer_bytes: 1 << 20,
            red: None,
        }
    }

    #[test]
    fn parallel_paths_topology() {
        let t = Topology::leaf_spine(&params(4, 2, 1));
        assert_eq!(t.num_hosts, 2);
        assert_eq!(t.nodes.len(), 2 + 2 + 4);
        // 2 host links each way + 2*4 fabric links each way.
        assert_eq!(t.links.len(), 4 + 16);
        let leaf0 = t.host_leaf[0];
        assert_eq!(t.nodes[leaf0 as usize].name, "leaf0");
        // leaf0 reaches h1 over all four spines.
        let hops = t.next_hops(leaf0, 1);
        assert_eq!(hops.len(), 4);
        for &l in hops {
            assert!(t.links[l as usize].name.starts_with("leaf0->spine"));
        }
        // leaf0 reaches its own host directly.
        assert_eq!(t.next_hops(leaf0, 0).len(), 1);
        // A spine has one way down to each leaf.
        let spine0 = t.nodes.iter().position(|n| n.name == "spine0").unwrap() as NodeId;
        assert_eq!(t.next_hops(spine0, 1).len(), 1);
        assert_eq!(t.links_matching("leaf0->spine*").len(), 4);
        assert_eq!(t.links_matching("leaf0->spine2").len(), 1);
    }

    #[test]
    fn leaf_spine_320_hosts() {
        let t = Topology::leaf_spine(&params(4, 32, 10));
        assert_eq!(t.num_hosts, 320);
        let leaf = t.host_leaf[0];
        assert_eq!(t.next_hops(leaf, 319).len(), 4);
        assert_eq!(t.next_hops(leaf, 5).len(), 1);
        assert_eq!(t.links[t.host_uplink(7) as usize].to, t.host_leaf[7]);
    }

    #[test]
    fn ecmp_is_deterministic_and_seeded() {
        let t = FiveTuple {
            src: 1,
            dst: 2,
            src_port: 50_000,
            dst_port: ROCE_V2_PORT,
        };
        assert_eq!(ecmp_hash(1, 10, &t), ecmp_hash(1, 10, &t));
        assert_ne!(ecmp_hash(1, 10, &t), ecmp_hash(2, 10, &t));
        assert_ne!(ecmp_hash(1, 10, &t), ecmp_hash(1, 11, &t));
        let u = FiveTuple {
            src_port: 50_001,
            ..t
        };
        assert_ne!(ecmp_hash(1, 10, &t), ecmp_hash(1, 10, &u));
    }

    #[test]
    fn ecmp_spreads_source_ports_evenly() {
        let choices = [10, 11, 12, 13];
        let mut counts = [0u32; 4];
        let n = 20_000;
        for port in 0..n {
            let t = FiveTuple {
                src: 0,
                dst: 1,
                src_port: 32_768 + port as u16,
                dst_port: ROCE_V2_PORT,
            };
            let l = ecmp_select(42, 3, &t, &choices);
            counts[(l - 10) as usize] += 1;
        }
        for c in counts {
            let share = f64::from(c) / f64::from(n);
            assert!((share - 0.25).abs() < 0.02, "share {share}");
        }
    }
}
