//! Software RC building blocks shared by the software transports (`tcp`, and later the
//! MP-RDMA `udp` provider and fault-injecting wrappers).
//!
//! Owns the parts of a reliable-connected QP that do not depend on how bytes travel:
//! - [`cq`]: a bounded completion queue with overflow detection and an event fd;
//! - [`device`]: the device and port attributes the software providers share;
//! - [`mr`]: the per-PD memory-region table and every access to registered memory;
//! - [`pd`]: the protection domain (MR table, SRQs) with provider-specific QP creation;
//! - [`rq`]: receive queues and shared receive queues;
//! - [`wire`]: the request/response frame format and its never-panicking decoder;
//! - [`responder`]: executes incoming requests against local memory;
//! - [`requester`]: the ordered send queue, timers and retries;
//! - [`qp`]: the QP state machine tying them together ([`qp::QpCore`]);
//! - [`qp_table`]: a context's live QPs by number, and QP-number allocation;
//! - [`tx`]: a connection's ordered output, sharing request frames instead of copying them.
//!
//! Everything here is sans-IO: no sockets, no threads, no clock. A provider wraps these in
//! its locks, feeds them frames and `Instant`s, and moves the bytes they produce. See
//! `docs/arch/soft.md`.

pub mod cq;
pub mod device;
pub mod mr;
pub mod pd;
pub mod qp;
pub mod qp_table;
pub mod requester;
pub mod responder;
pub mod rq;
pub mod tx;
pub mod wire;
