//! The sender's messages in flight, by sequence number.
//!
//! Sequence numbers are handed out in order and messages are added in that order, so the
//! window is a deque whose front is the oldest message not yet handed back: lookup is an
//! index, completion in order pops the front, and one finishing out of order (a rendezvous
//! whose FIN overtakes an older eager message's ack) leaves a hole that is popped once the
//! messages before it finish. No allocation per message once the deque has grown.

use std::collections::VecDeque;

/// Values keyed by consecutive sequence numbers from `base`.
#[derive(Debug)]
pub(crate) struct SeqWindow<T> {
    /// Sequence number of `slots[0]`.
    base: u64,
    slots: VecDeque<Option<T>>,
    len: usize,
}

impl<T> Default for SeqWindow<T> {
    fn default() -> Self {
        SeqWindow {
            base: 0,
            slots: VecDeque::new(),
            len: 0,
        }
    }
}

impl<T> SeqWindow<T> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds `value` at `seq`, which must lie at or above every sequence number added so far
    /// (a gap is left empty). `false` (nothing added) for a `seq` below that.
    pub(crate) fn insert(&mut self, seq: u64, value: T) -> bool {
        if self.slots.is_empty() {
            self.base = seq;
        }
        let Some(at) = seq.checked_sub(self.base) else {
            return false;
        };
        let Ok(at) = usize::try_from(at) else {
            return false;
        };
        if at < self.slots.len() {
            return false;
        }
        while self.slots.len() < at {
            self.slots.push_back(None);
        }
        self.slots.push_back(Some(value));
        self.len += 1;
        true
    }

    fn index(&self, seq: u64) -> Option<usize> {
        let at = usize::try_from(seq.checked_sub(self.base)?).ok()?;
        (at < self.slots.len()).then_some(at)
    }

    pub(crate) fn get(&self, seq: u64) -> Option<&T> {
        self.slots.get(self.index(seq)?)?.as_ref()
    }

    pub(crate) fn get_mut(&mut self, seq: u64) -> Option<&mut T> {
        let at = self.index(seq)?;
        self.slots.get_mut(at)?.as_mut()
    }

    /// Takes the value at `seq` out; the front's empty slots go with it.
    pub(crate) fn remove(&mut self, seq: u64) -> Option<T> {
        let at = self.index(seq)?;
        let v = self.slots.get_mut(at)?.take()?;
        self.len -= 1;
        while matches!(self.slots.front(), Some(None)) {
            self.slots.pop_front();
            self.base += 1;
        }
        Some(v)
    }

    /// Sequence numbers held, from the oldest, up to and including `last`.
    pub(crate) fn seqs_through(&self, last: u64) -> std::ops::RangeInclusive<u64> {
        let top = self.base + self.slots.len() as u64;
        self.base..=last.min(top.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Against a `BTreeMap`: inserts in increasing order (with gaps), removals in any order.
        #[test]
        fn matches_an_ordered_map(ops in prop::collection::vec((any::<bool>(), 0u64..4, 0usize..16), 1..200)) {
            let mut w = SeqWindow::default();
            let mut m = std::collections::BTreeMap::new();
            let mut next = 5u64;
            for (add, gap, pick) in ops {
                if add {
                    next += gap;
                    prop_assert!(w.insert(next, next * 10));
                    m.insert(next, next * 10);
                    next += 1;
                } else if let Some(&k) = m.keys().nth(pick % m.len().max(1)) {
                    prop_assert_eq!(w.remove(k), m.remove(&k));
                    prop_assert_eq!(w.remove(k), None);
                }
                prop_assert_eq!(w.len(), m.len());
                for (k, v) in &m {
                    prop_assert_eq!(w.get(*k), Some(v));
                }
                let held: Vec<u64> = w.seqs_through(next).filter(|s| w.get(*s).is_some()).collect();
                prop_assert_eq!(held, m.keys().copied().collect::<Vec<_>>());
            }
            prop_assert!(!w.insert(0, 0) || m.is_empty());
        }
    }
}
