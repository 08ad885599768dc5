//! Shared receive queues (`ibv_srq`): one pool of posted receives that several QPs draw from.

use std::sync::Arc;

use crate::provider::SrqOps;
use crate::{PostError, RecvWr};

/// Creation attributes of an SRQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrqInitAttr {
    /// Max outstanding receives.
    pub max_wr: u32,
    /// Max SGEs per receive.
    pub max_sge: u32,
    /// Limit event threshold (0 = none).
    pub srq_limit: u32,
}

/// A shared receive queue. Cheap to clone.
#[derive(Clone)]
pub struct SharedReceiveQueue {
    pub(crate) ops: Arc<dyn SrqOps>,
}

impl std::fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReceiveQueue").finish_non_exhaustive()
    }
}

impl SharedReceiveQueue {
    /// Provider-side object, for downcasting inside a provider.
    pub fn ops(&self) -> &Arc<dyn SrqOps> {
        &self.ops
    }

    /// Post receives (`ibv_post_srq_recv`).
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.ops.post_recv(wrs)
    }

    /// Receives currently posted and not yet consumed.
    pub fn outstanding(&self) -> u32 {
        self.ops.outstanding()
    }
}
