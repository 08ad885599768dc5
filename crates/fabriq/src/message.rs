//! A delivered message: the payload (copied out of an eager slot, or the pool buffer a
//! rendezvous payload was pulled into) plus its trace header. Dropping it returns a pool buffer
//! to the worker that owns it, from any thread.

use std::sync::Arc;

use crossbeam_queue::SegQueue;

use crate::channel::proto::EagerBytes;
use crate::channel::TraceHeader;
use crate::mempool::PoolBuf;

/// Bytes of a message.
#[derive(Debug)]
pub(crate) enum Payload {
    /// An eager payload (held in place when small).
    Eager(EagerBytes),
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
            if let Payload::Pool(b) =
                std::mem::replace(&mut self.payload, Payload::Eager(EagerBytes::new()))
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

    /// The payload as a `Vec` (no copy for an eager payload above 24 bytes, which already is one).
    pub fn into_vec(mut self) -> Vec<u8> {
        match &mut self.payload {
            Payload::Eager(v) => std::mem::take(v).into_vec(),
            Payload::Pool(b) => b.to_vec(),
        }
    }
}

impl std::ops::Deref for Message {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.payload {
            Payload::Eager(v) => v,
            Payload::Pool(b) => b,
        }
    }
}

impl AsRef<[u8]> for Message {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// A send buffer in registered memory, from [`crate::Channel::alloc`]: fill it in place and
/// hand it to [`crate::Channel::send_buf`], which sends it without copying (eager: gathered by
/// the SEND; rendezvous: READ by the peer straight out of it). Derefs to its `len()` bytes;
/// dropping it unsent returns it to its pool.
#[derive(Debug)]
pub struct SendBuf {
    pub(crate) buf: PoolBuf,
    /// Identity of the protection domain it is registered in.
    pub(crate) domain: usize,
}

impl SendBuf {
    /// Bytes that will be sent.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// True when nothing would be sent.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Bytes the buffer can hold.
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Change how many bytes will be sent; [`crate::ChannelError::MessageTooLarge`] beyond the
    /// capacity.
    pub fn set_len(&mut self, len: usize) -> Result<(), crate::ChannelError> {
        if len > self.buf.capacity() {
            return Err(crate::ChannelError::MessageTooLarge {
                len: len as u64,
                max: self.buf.capacity() as u64,
            });
        }
        self.buf.set_len(len);
        Ok(())
    }
}

impl std::ops::Deref for SendBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl std::ops::DerefMut for SendBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl AsRef<[u8]> for SendBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for SendBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}
