//! Packets in flight and the pool that recycles them.
//!
//! Owns the packet record (addressing, wire size, ECN bits, the transport's encoded bytes)
//! and a free list so that the hot loop reuses packet slots and their byte buffers instead of
//! allocating. Events refer to packets by [`PacketId`].

use crate::event_queue::{EndpointId, LinkId, NodeId, PacketId};

/// One packet in the network.
#[derive(Debug, Default)]
pub struct Packet {
    /// Sending endpoint.
    pub src_endpoint: EndpointId,
    /// Receiving endpoint.
    pub dst_endpoint: EndpointId,
    /// Sending host node.
    pub src_host: NodeId,
    /// Receiving host node.
    pub dst_host: NodeId,
    /// UDP source port: the connection's base port plus the virtual path. Part of the
    /// ECMP 5-tuple.
    pub src_port: u16,
    /// Virtual path the transport chose (delivered to the receiving transport).
    pub path: u16,
    /// Bytes this packet occupies on a wire (headers, payload, framing overhead).
    pub wire_bytes: u32,
    /// Application payload bytes the packet carries or stands for.
    pub payload_bytes: u32,
    /// ECN-capable transport.
    pub is_ecn_capable: bool,
    /// Congestion Experienced mark.
    pub is_ce: bool,
    /// Link it arrived over at the switch holding it (PFC ingress accounting).
    pub ingress: Option<LinkId>,
    /// Encoded transport datagram.
    pub bytes: Vec<u8>,
}

/// Slab of packets with a free list.
#[derive(Debug, Default)]
pub struct PacketPool {
    slots: Vec<Packet>,
    free: Vec<PacketId>,
}

impl PacketPool {
    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes a free slot (its byte buffer is empty but keeps its capacity).
    pub fn alloc(&mut self) -> PacketId {
        if let Some(id) = self.free.pop() {
            id
        } else {
            self.slots.push(Packet::default());
            (self.slots.len() - 1) as PacketId
        }
    }

    /// Returns a slot to the pool.
    pub fn free(&mut self, id: PacketId) {
        let p = &mut self.slots[id as usize];
        p.bytes.clear();
        p.ingress = None;
        p.is_ce = false;
        self.free.push(id);
    }

    /// The packet in slot `id`.
    pub fn get(&self, id: PacketId) -> &Packet {
        &self.slots[id as usize]
    }

    /// The packet in slot `id`, mutably.
    pub fn get_mut(&mut self, id: PacketId) -> &mut Packet {
        &mut self.slots[id as usize]
    }

    /// Packets currently allocated (in queues or on wires).
    pub fn in_use(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Slots ever created (the pool's high-water mark).
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_recycled() {
        let mut pool = PacketPool::new();
        let a = pool.alloc();
        pool.get_mut(a).bytes.extend_from_slice(&[1, 2, 3]);
        pool.get_mut(a).is_ce = true;
        let b = pool.alloc();
        assert_ne!(a, b);
        assert_eq!(pool.in_use(), 2);
        pool.free(a);
        let c = pool.alloc();
        assert_eq!(c, a);
        assert!(pool.get(c).bytes.is_empty());
        assert!(pool.get(c).bytes.capacity() >= 3, "buffer capacity kept");
        assert!(!pool.get(c).is_ce);
        assert_eq!(pool.capacity(), 2);
    }
}
