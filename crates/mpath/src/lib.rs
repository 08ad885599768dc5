//! fabriq-mpath: the MP-RDMA multi-path reliable transport core, sans-IO.
//!
//! One [`Connection`] is one side of a full-duplex reliable connection: it owns the
//! sender state (congestion window, multi-path ACK clocking, loss recovery) and the
//! receiver state (out-of-order bitmap, reassembly, in-order delivery) of the MP-RDMA
//! design (Lu et al., "Multi-Path Transport for RDMA in Datacenters", NSDI 2018), plus a
//! single-path DCQCN/go-back-N baseline ([`Mode::SinglePath`]) for comparison.
//!
//! The crate does no I/O: no sockets, no clock, no threads. A driver (the UDP verbs
//! provider, or the simulator) runs the loop
//!
//! ```text
//! input  → handle_datagram / handle_timeout / send
//! output → poll_transmit (until None) → poll_event (until None) → sleep until poll_timeout
//! ```
//!
//! and maps [`PathId`]s to UDP source ports so that ECMP spreads virtual paths over
//! physical paths.
//!
//! ```
//! use fabriq_mpath::{Config, Connection, Event, Instant, PathId, Payload};
//!
//! // Moves every pending datagram from one side to the other (zero latency).
//! fn pump(from: &mut Connection, to: &mut Connection, now: Instant) -> bool {
//!     let mut buf = Vec::new();
//!     let mut moved = false;
//!     while let Some(t) = from.poll_transmit(now, &mut buf) {
//!         to.handle_datagram(now, t.path, false, &buf[..t.len]).unwrap();
//!         moved = true;
//!     }
//!     moved
//! }
//!
//! let now = Instant::ZERO;
//! let mut a = Connection::new(Config { seed: 1, ..Config::default() }, now);
//! let mut b = Connection::new(Config { seed: 2, ..Config::default() }, now);
//! let id = a.send(now, Payload::Bytes(b"hello".to_vec().into()), false).unwrap();
//! while pump(&mut a, &mut b, now) | pump(&mut b, &mut a, now) {}
//! assert!(matches!(b.poll_event(), Some(Event::MessageReceived { payload: Payload::Bytes(p), .. }) if &p[..] == b"hello"));
//! assert_eq!(a.poll_event(), Some(Event::MessageAcked(id)));
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod congestion;
mod connection;
pub mod frame;
mod psnmap;
mod recv;
mod rtt;
mod send;
mod seq;
mod stats;
mod time;

#[cfg(test)]
mod tests;

pub use config::{Config, ConfigError, DcqcnConfig, Mode, MAX_BITMAP_LEN, MAX_MSS};
pub use connection::{
    Connection, ConnectionError, Event, MessageId, PacketKind, Payload, SendError, Transmit,
};
pub use frame::DecodeError;
pub use stats::{ProtocolStateSize, Stats};
pub use time::Instant;

/// A virtual path (VP): an index `0..num_paths` the driver maps to a UDP source port.
///
/// Packets with different VPs hash to (likely) different ECMP paths. The core keeps no
/// per-path state; a VP is only a label a packet carries and its ACK echoes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PathId(pub u16);
