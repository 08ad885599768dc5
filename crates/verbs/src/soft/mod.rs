//! Software RC building blocks shared by the software transports (`tcp` and the MP-RDMA
//! `udp` provider).
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
//! These are sans-IO: no sockets, no threads, no clock. A provider wraps them in its locks,
//! feeds them frames and `Instant`s, and moves the bytes they produce.
//!
//! The rest is what every software provider's driver would otherwise write again:
//! - [`open`]: the verbs `Provider` of a one-device provider, and the bind address;
//! - `context`: the verbs `ContextOps` of a software context (device, ports, PDs, CQs);
//! - [`qp_setup`]: a new QP's core and endpoint, and the remote endpoint accepted at RTR;
//! - `qp_ops`: the verbs `QpOps` of a software QP, over the provider's lock and transport;
//! - [`poller`]: the context's epoll set, wake-up eventfd, deadline timer and progress thread;
//! - `testing` (tests only): fixtures of the providers' in-process tests.
//!
//! See `docs/arch/soft.md`.

pub(crate) mod context;
pub mod cq;
pub mod device;
pub mod mr;
pub mod open;
pub mod pd;
pub mod poller;
pub mod qp;
pub(crate) mod qp_ops;
pub mod qp_setup;
pub mod qp_table;
pub mod requester;
pub mod responder;
pub mod rq;
#[cfg(test)]
pub(crate) mod testing;
pub mod tx;
pub mod wire;
