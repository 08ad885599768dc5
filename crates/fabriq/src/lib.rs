//! fabriq: RDMA communication middleware.
//!
//! Three small interfaces over the verbs object model ([`fabriq_verbs`]): a socket-like
//! channel, request/response RPC, and one-sided remote memory; plus what production needs
//! underneath: pooled pre-registered memory, eager and rendezvous protocols, connection
//! management with a QP cache, seq-ack, credit flow control and run-to-completion workers.
#![warn(missing_docs)]
#![deny(unsafe_code)]

pub mod conn;
pub mod mempool;
