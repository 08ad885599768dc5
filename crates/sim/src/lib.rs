//! fabriq-sim: a discrete-event, packet-level datacenter simulator that drives the
//! unchanged `fabriq-mpath` MP-RDMA core.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod clock;
pub mod event_queue;
pub mod link;
pub mod mpath_adapter;
pub mod node;
pub mod packet;
pub mod plot;
pub mod results;
pub mod runner;
pub mod scenario;
pub mod sim;
pub mod transport;
pub mod workload;
