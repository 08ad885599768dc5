//! Receive queues: a QP's private queue ([`RecvQueue`]) and the shared one ([`SoftSrq`]).
//!
//! Owns: posted receives (their SGE lists copied at post time), capacity checks, and taking the
//! next receive for an incoming SEND. Scattering the payload is the MR table's job
//! ([`super::mr::MrTable::scatter`]); producing the completion is the responder's.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;

use super::mr::MrTable;
use crate::provider::SrqOps;
use crate::{PostError, RecvWr, Result, Sge, SrqInitAttr, VerbsError};

/// A posted receive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostedRecv {
    /// The caller's id.
    pub wr_id: u64,
    /// Where the payload goes, in order.
    pub sges: Vec<Sge>,
}

/// A bounded FIFO of posted receives.
#[derive(Debug)]
pub struct RecvQueue {
    max_wr: u32,
    max_sge: u32,
    queue: VecDeque<PostedRecv>,
}

impl RecvQueue {
    /// A queue of at most `max_wr` receives of at most `max_sge` SGEs each.
    pub fn new(max_wr: u32, max_sge: u32) -> RecvQueue {
        RecvQueue {
            max_wr,
            max_sge,
            queue: VecDeque::new(),
        }
    }

    /// Post a batch; stops at the first refused request.
    pub fn post(&mut self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        for (index, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > self.max_sge as usize {
                return Err(PostError {
                    index,
                    source: VerbsError::LimitExceeded(format!(
                        "{} SGEs exceed max_recv_sge {}",
                        wr.sg_list.len(),
                        self.max_sge
                    )),
                });
            }
            if self.queue.len() >= self.max_wr as usize {
                return Err(PostError {
                    index,
                    source: VerbsError::QueueFull,
                });
            }
            self.queue.push_back(PostedRecv {
                wr_id: wr.wr_id,
                sges: wr.sg_list.to_vec(),
            });
        }
        Ok(())
    }

    /// Take the oldest receive.
    pub fn pop(&mut self) -> Option<PostedRecv> {
        self.queue.pop_front()
    }

    /// Put back a receive just taken with [`RecvQueue::pop`] (the request that took it
    /// failed before using it).
    pub fn unpop(&mut self, recv: PostedRecv) {
        self.queue.push_front(recv);
    }

    /// True if a receive is posted.
    pub fn has_recv(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Posted receives.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// True when none is posted.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Remove every posted receive (flush or reset).
    pub fn drain(&mut self) -> Vec<PostedRecv> {
        self.queue.drain(..).collect()
    }
}

/// A shared receive queue of a software provider: a cheap handle (clones are the same queue).
#[derive(Debug, Clone)]
pub struct SoftSrq {
    inner: Arc<SrqInner>,
}

#[derive(Debug)]
struct SrqInner {
    queue: Mutex<RecvQueue>,
    table: Arc<MrTable>,
}

impl SoftSrq {
    /// A new SRQ drawing buffers from the PD whose table is `table`.
    pub fn new(init: &SrqInitAttr, table: Arc<MrTable>) -> SoftSrq {
        SoftSrq {
            inner: Arc::new(SrqInner {
                queue: Mutex::new(RecvQueue::new(init.max_wr, init.max_sge.max(1))),
                table,
            }),
        }
    }

    /// The PD's MR table.
    pub fn table(&self) -> &Arc<MrTable> {
        &self.inner.table
    }

    /// Take the oldest receive.
    pub fn pop(&self) -> Option<PostedRecv> {
        self.inner.queue.lock().pop()
    }

    /// True if a receive is posted.
    pub fn has_recv(&self) -> bool {
        self.inner.queue.lock().has_recv()
    }

    /// Put back a receive just taken with [`SoftSrq::pop`].
    pub fn unpop(&self, recv: PostedRecv) {
        self.inner.queue.lock().unpop(recv)
    }
}

impl SrqOps for SoftSrq {
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.inner.queue.lock().post(wrs)
    }
    fn outstanding(&self) -> u32 {
        self.inner.queue.lock().len() as u32
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Lkey;

    #[test]
    fn bounded_fifo_with_sge_limit() {
        let mut q = RecvQueue::new(2, 1);
        let sge = [Sge {
            addr: 0,
            length: 1,
            lkey: Lkey(1),
        }];
        let two = [sge[0], sge[0]];
        let err = q
            .post(&[RecvWr::new(1, &sge), RecvWr::new(2, &two)])
            .unwrap_err();
        assert_eq!(err.index, 1);
        assert!(matches!(err.source, VerbsError::LimitExceeded(_)));
        q.post(&[RecvWr::new(3, &sge)]).unwrap();
        let err = q.post(&[RecvWr::new(4, &sge)]).unwrap_err();
        assert!(matches!(err.source, VerbsError::QueueFull));
        assert_eq!(q.pop().unwrap().wr_id, 1);
        assert_eq!(q.pop().unwrap().wr_id, 3);
        assert!(q.pop().is_none());
    }
}
