//! Congestion control: the MP-RDMA congestion window and the single-path DCQCN rate.
//!
//! Owns the arithmetic of each controller, not when it is applied: the connection
//! decides which rule an ACK triggers (design: MP-RDMA §3.1 "multi-path ACK clocking",
//! §3.2 "out-of-order aware path selection"; DCQCN, Zhu et al., SIGCOMM 2015).

mod dcqcn;
mod window;

pub(crate) use dcqcn::Dcqcn;
pub(crate) use window::Window;
