//! The worker's buffer source: its [`MemPool`] for sizes up to the largest class, plus a bounded
//! cache of large buffers (rendezvous payloads) so that a stream of large messages reuses a few
//! registrations instead of registering — and making the peer map — a new region per message.
//! Large buffers come back from the channel (send completed) or, through a lock-free queue, from
//! the application thread that dropped a received [`crate::Message`].

use std::collections::HashMap;
use std::sync::Arc;

use crossbeam_queue::SegQueue;

use crate::channel::driver::BufferSource;
use crate::mempool::{MemPool, PoolBuf, PoolError};

/// Bytes of large buffers kept for reuse per worker.
const MAX_CACHED_BYTES: usize = 64 << 20;

pub(crate) struct Buffers {
    pool: MemPool,
    cache: HashMap<usize, Vec<PoolBuf>>,
    cached_bytes: usize,
    returned: Arc<SegQueue<PoolBuf>>,
}

impl Buffers {
    pub(crate) fn new(pool: MemPool) -> Buffers {
        Buffers {
            pool,
            cache: HashMap::new(),
            cached_bytes: 0,
            returned: Arc::new(SegQueue::new()),
        }
    }

    /// Where other threads return large buffers.
    pub(crate) fn returned(&self) -> &Arc<SegQueue<PoolBuf>> {
        &self.returned
    }

    /// Keep a large buffer for reuse (within the bound); others go back to the pool on drop.
    pub(crate) fn recycle(&mut self, buf: PoolBuf) {
        if !buf.is_large() || self.cached_bytes + buf.capacity() > MAX_CACHED_BYTES {
            return;
        }
        self.cached_bytes += buf.capacity();
        self.cache.entry(buf.capacity()).or_default().push(buf);
    }
}

impl BufferSource for Buffers {
    fn alloc_any(&mut self, len: usize) -> Result<PoolBuf, PoolError> {
        if len <= self.pool.max_class() {
            return self.pool.alloc_any(len);
        }
        while let Some(b) = self.returned.pop() {
            self.recycle(b);
        }
        let cap = len.checked_next_power_of_two().unwrap_or(len);
        if let Some(mut b) = self.cache.get_mut(&cap).and_then(Vec::pop) {
            self.cached_bytes -= b.capacity();
            b.set_len(len);
            return Ok(b);
        }
        let mut b = self.pool.alloc_large(cap)?;
        b.set_len(len);
        Ok(b)
    }
}
