//! [`TxQueue`]: the bytes a QP has to send, in order, without copying request frames.
//!
//! Owns: a FIFO of segments — owned bytes (responses, appended in place) and shared request
//! frames (the same `Arc` the send queue keeps for resending) — and how much of the head was
//! sent. A stream driver hands [`TxQueue::io_slices`] to `writev`/`sendmsg` and reports what
//! the kernel took with [`TxQueue::consume`]; a datagram driver takes whole frames.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::Arc;

/// Something request frames can be transmitted into.
pub trait FrameSink {
    /// Queue one encoded request frame.
    fn push_frame(&mut self, frame: &Arc<Vec<u8>>);
}

impl FrameSink for Vec<u8> {
    fn push_frame(&mut self, frame: &Arc<Vec<u8>>) {
        self.extend_from_slice(frame);
    }
}

enum Segment {
    Owned(Vec<u8>),
    Shared(Arc<Vec<u8>>),
}

impl Segment {
    fn bytes(&self) -> &[u8] {
        match self {
            Segment::Owned(v) => v,
            Segment::Shared(f) => f,
        }
    }
}

/// Ordered output of one connection.
#[derive(Default)]
pub struct TxQueue {
    segments: VecDeque<Segment>,
    /// Bytes of the front segment already sent.
    head_sent: usize,
    /// Unsent bytes in total.
    pending: usize,
}

impl std::fmt::Debug for TxQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxQueue")
            .field("segments", &self.segments.len())
            .field("pending", &self.pending)
            .finish()
    }
}

/// Owned segments larger than this are not reused for later bytes.
const OWNED_KEEP: usize = 1 << 20;

impl TxQueue {
    /// An empty queue.
    pub fn new() -> TxQueue {
        TxQueue::default()
    }

    /// Unsent bytes.
    pub fn len(&self) -> usize {
        self.pending
    }

    /// True when everything was sent.
    pub fn is_empty(&self) -> bool {
        self.pending == 0
    }

    /// Append owned bytes (responses) through `f`, which writes to the end of a buffer.
    pub fn append_with<R>(&mut self, f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
        let reuse = matches!(self.segments.back(), Some(Segment::Owned(_)));
        if !reuse {
            self.segments.push_back(Segment::Owned(Vec::new()));
        }
        let Some(Segment::Owned(buf)) = self.segments.back_mut() else {
            unreachable!("an owned segment was just ensured at the back");
        };
        let before = buf.len();
        let r = f(buf);
        let added = buf.len() - before;
        self.pending += added;
        if added == 0 && before == 0 {
            self.segments.pop_back();
        }
        r
    }

    /// Drop everything (connection closed).
    pub fn clear(&mut self) {
        self.segments.clear();
        self.head_sent = 0;
        self.pending = 0;
    }

    /// Up to `max` slices covering the unsent bytes, in order.
    pub fn io_slices<'a>(&'a self, out: &mut Vec<IoSlice<'a>>, max: usize) {
        for (i, seg) in self.segments.iter().enumerate().take(max) {
            let b = seg.bytes();
            let b = if i == 0 {
                b.get(self.head_sent..).unwrap_or(&[])
            } else {
                b
            };
            if !b.is_empty() {
                out.push(IoSlice::new(b));
            }
        }
    }

    /// `n` bytes were sent.
    pub fn consume(&mut self, mut n: usize) {
        self.pending = self.pending.saturating_sub(n);
        while n > 0 {
            let Some(front) = self.segments.front() else {
                break;
            };
            let left = front.bytes().len() - self.head_sent;
            if n < left {
                self.head_sent += n;
                return;
            }
            n -= left;
            self.head_sent = 0;
            self.segments.pop_front();
        }
        // Drop fully sent empty owned segments left at the front.
        while let Some(front) = self.segments.front() {
            if front.bytes().len() > self.head_sent {
                break;
            }
            self.segments.pop_front();
            self.head_sent = 0;
        }
        if self.segments.is_empty() {
            self.head_sent = 0;
        }
    }

    /// Give back memory after a burst.
    pub fn shrink(&mut self) {
        if self.segments.is_empty() {
            self.segments.shrink_to(8);
        }
        if let Some(Segment::Owned(v)) = self.segments.back_mut() {
            if v.is_empty() && v.capacity() > OWNED_KEEP {
                *v = Vec::new();
            }
        }
    }
}

impl FrameSink for TxQueue {
    fn push_frame(&mut self, frame: &Arc<Vec<u8>>) {
        if frame.is_empty() {
            return;
        }
        self.pending += frame.len();
        self.segments.push_back(Segment::Shared(frame.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(q: &mut TxQueue, step: usize) -> Vec<u8> {
        let mut out = Vec::new();
        while !q.is_empty() {
            let mut sl = Vec::new();
            q.io_slices(&mut sl, 3);
            let mut take = step;
            let mut n = 0;
            for s in &sl {
                let k = take.min(s.len());
                out.extend_from_slice(&s[..k]);
                n += k;
                take -= k;
                if take == 0 {
                    break;
                }
            }
            q.consume(n);
        }
        out
    }

    #[test]
    fn keeps_order_across_owned_and_shared_segments_and_partial_writes() {
        for step in [1, 2, 3, 5, 7, 100] {
            let mut q = TxQueue::new();
            q.append_with(|b| b.extend_from_slice(b"ab"));
            q.push_frame(&Arc::new(b"cde".to_vec()));
            q.append_with(|b| b.extend_from_slice(b"f"));
            q.append_with(|b| b.extend_from_slice(b"g"));
            q.push_frame(&Arc::new(b"hij".to_vec()));
            q.push_frame(&Arc::new(Vec::new()));
            assert_eq!(q.len(), 10);
            let mut got = Vec::new();
            // Bytes appended while the head is partially sent stay behind it.
            let mut sl = Vec::new();
            q.io_slices(&mut sl, 8);
            drop(sl);
            q.consume(1);
            got.push(b'a');
            q.append_with(|b| b.extend_from_slice(b"k"));
            got.extend(drain(&mut q, step));
            assert_eq!(got, b"abcdefghijk", "step {step}");
            assert!(q.is_empty());
        }
    }
}
