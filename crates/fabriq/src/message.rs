//! A delivered message: the payload (copied out of an eager slot, or the pool buffer a
//! rendezvous payload was pulled into) plus its trace header. Dropping it returns a pool buffer
//! to the worker that owns it, from any thread.

use std::sync::Arc;

use crossbeam_queue::SegQueue;

use crate::channel::TraceHeader;
use crate::mempool::PoolBuf;

/// Bytes of a message.
#[derive(Debug)]
pub(crate) enum Payload {
    Vec(Vec<u8>),
    Pool(PoolBuf),
}

/// A message received on a [`crate::Channel`]. Derefs to its payload bytes.
#[derive(Debug)]
pub struct Message {
    pub(crate) payload: Payload,
    pub(crate) trace: TraceHeader,
    pub(crate) seq: u64,
    /// Where a large buffer goes back to its worker for reuse.
    pub(crate) recycle: Option<Arc<SegQueue<PoolBuf>>>,
}

impl Drop for Message {
    fn drop(&mut self) {
        if let Some(q) = self.recycle.take() {
            if let Payload::Pool(b) = std::mem::replace(&mut self.payload, Payload::Vec(Vec::new()))
            {
                q.push(b);
            }
        }
    }
}

impl Message {
    /// The trace header the sender attached.
    pub fn trace(&self) -> &TraceHeader {
        &self.trace
    }

    /// Sequence number on its channel (1, 2, …).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Copy the payload into a `Vec` (free when it already is one).
    pub fn into_vec(mut self) -> Vec<u8> {
        match &mut self.payload {
            Payload::Vec(v) => std::mem::take(v),
            Payload::Pool(b) => b.to_vec(),
        }
    }
}

impl std::ops::Deref for Message {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.payload {
            Payload::Vec(v) => v,
            Payload::Pool(b) => b,
        }
    }
}

impl AsRef<[u8]> for Message {
    fn as_ref(&self) -> &[u8] {
        self
    }
}
