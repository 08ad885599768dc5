//! A stream's delivered messages, in order, between the worker that delivers them and the
//! application threads that read them.
//!
//! The worker pushes under its own lock, so pushes never race each other; readers are usually
//! one thread. A short lock around a deque is cheaper here than a lock-free queue, which pays
//! a block allocation every few dozen messages and more atomic steps per message; the length
//! beside it lets a waiter that polls look for a message with one load and no lock.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::shared::window_units;
use crate::message::Message;

/// Delivered messages waiting for the application.
pub(crate) struct DeliveryQueue {
    /// The stream window, which caps a message's units.
    stream_window: u64,
    /// The deque's length, published after every change made under the lock.
    len: AtomicUsize,
    /// Window units ([`window_units`]) of the messages popped so far (wrapping), published
    /// under the lock like `len`: the stream's consumed count, which the worker reads instead
    /// of being told of every read.
    taken: AtomicU64,
    queue: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    messages: VecDeque<Message>,
    /// Their window units.
    units: u64,
}

impl DeliveryQueue {
    /// An empty queue of a stream of window `stream_window`.
    pub(crate) fn new(stream_window: u64) -> DeliveryQueue {
        DeliveryQueue {
            stream_window,
            len: AtomicUsize::new(0),
            taken: AtomicU64::new(0),
            queue: Mutex::default(),
        }
    }

    /// Append a delivered message; the window units of the messages that wait now.
    pub(crate) fn push(&self, m: Message) -> u64 {
        let units = window_units(m.len() as u64, self.stream_window);
        let mut q = self.queue.lock();
        q.messages.push_back(m);
        q.units += units;
        self.len.store(q.messages.len(), Ordering::Release);
        q.units
    }

    /// True when no message waits (one load: a message pushed meanwhile is seen next time).
    pub(crate) fn is_empty(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0
    }

    /// The oldest message, if any.
    pub(crate) fn pop(&self) -> Option<Message> {
        if self.is_empty() {
            return None;
        }
        self.pop_locked()
    }

    /// Window units of the messages popped so far (wrapping).
    pub(crate) fn taken(&self) -> u64 {
        self.taken.load(Ordering::Acquire)
    }

    /// The oldest message, if any, looked for under the lock even when the length says
    /// there is none (see `ChannelShared::deliver`).
    pub(crate) fn pop_locked(&self) -> Option<Message> {
        let mut q = self.queue.lock();
        let m = q.messages.pop_front()?;
        let units = window_units(m.len() as u64, self.stream_window);
        q.units -= units;
        self.len.store(q.messages.len(), Ordering::Release);
        // Only a holder of the lock writes it: a load and a store, no locked add.
        let taken = self.taken.load(Ordering::Relaxed);
        self.taken
            .store(taken.wrapping_add(units), Ordering::Release);
        Some(m)
    }

    /// Drop every waiting message; how many there were.
    pub(crate) fn clear(&self) -> u64 {
        let drained = {
            let mut q = self.queue.lock();
            self.len.store(0, Ordering::Release);
            std::mem::take(&mut *q).messages
        };
        // Dropped outside the lock: a message may hand a buffer back to its pool.
        drained.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::proto::EagerBytes;
    use crate::channel::TraceHeader;
    use crate::message::Payload;

    fn msg(seq: u64) -> Message {
        Message {
            payload: Payload::Eager(EagerBytes::from_slice(&seq.to_le_bytes())),
            trace: TraceHeader::default(),
            seq,
            recycle: None,
        }
    }

    #[test]
    fn messages_come_out_in_order_and_clear_counts_them() {
        let q = DeliveryQueue::new(64);
        assert!(q.is_empty());
        assert!(q.pop().is_none());
        for s in 1..=5 {
            q.push(msg(s));
        }
        assert!(!q.is_empty());
        assert_eq!(q.pop().map(|m| m.seq()), Some(1));
        assert_eq!(q.pop().map(|m| m.seq()), Some(2));
        assert_eq!(q.clear(), 3);
        assert!(q.is_empty());
        assert!(q.pop().is_none());
    }

    /// What waits and what was read count in window units: one per started MiB of a message,
    /// half the window (64 here) at most.
    #[test]
    fn waiting_and_taken_count_window_units() {
        let q = DeliveryQueue::new(64);
        let sized = |len: usize| Message {
            payload: Payload::Eager(EagerBytes::from_slice(&vec![1u8; len])),
            trace: TraceHeader::default(),
            seq: 0,
            recycle: None,
        };
        assert_eq!(q.push(sized(0)), 1);
        assert_eq!(q.push(sized(1 << 20)), 2);
        assert_eq!(q.push(sized((1 << 20) + 1)), 4);
        assert_eq!(q.push(sized(10 << 20)), 14);
        assert_eq!(q.push(sized(40 << 20)), 46, "half the window at most");
        assert_eq!(q.taken(), 0);
        q.pop().expect("first");
        q.pop().expect("second");
        assert_eq!(q.taken(), 2);
        q.pop().expect("third");
        assert_eq!(q.taken(), 4);
        assert_eq!(q.push(sized(8)), 43);
        assert_eq!(q.clear(), 3);
        assert_eq!(q.push(sized(8)), 1, "cleared units start again from none");
    }

    #[test]
    fn a_reader_on_another_thread_sees_every_message_once_in_order() {
        let q = std::sync::Arc::new(DeliveryQueue::new(64));
        let n = 20_000u64;
        let reader = {
            let q = std::sync::Arc::clone(&q);
            std::thread::spawn(move || {
                let mut next = 1;
                while next <= n {
                    match q.pop() {
                        Some(m) => {
                            assert_eq!(m.seq(), next);
                            assert_eq!(&m[..], &next.to_le_bytes());
                            next += 1;
                        }
                        None => std::hint::spin_loop(),
                    }
                }
            })
        };
        for s in 1..=n {
            q.push(msg(s));
        }
        reader.join().expect("reader");
        assert!(q.is_empty());
    }
}
