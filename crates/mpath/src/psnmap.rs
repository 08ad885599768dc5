//! PSN-indexed bit rings: the sender's SACK scoreboard (1 bit per PSN) and the receiver's
//! arrival bitmap (2 bits per PSN, MP-RDMA §3.2).
//!
//! Entry `psn` lives at `psn mod capacity`; the capacity is a power of two, so it divides
//! 2^32 and a PSN keeps its position across the 32-bit wrap. The ring itself does not know
//! which PSNs are live: its owner keeps every entry outside its live window at zero
//! (clearing entries as the window's base moves), so a later PSN that maps to the same
//! position starts empty. Moving the base is then one clear per PSN, never a shift of the
//! whole bitmap, which keeps a large window (a long bandwidth-delay product) as cheap per
//! packet as the paper's 64 slots.

/// A ring of `W`-bit entries (`W` = 1 or 2) indexed by PSN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PsnRing<const W: u32> {
    words: Box<[u64]>,
    /// `capacity - 1`.
    mask: u32,
}

impl<const W: u32> PsnRing<W> {
    const PER_WORD: u32 = 64 / W;
    const ENTRY: u64 = (1u64 << W) - 1;

    /// A ring holding at least `len` entries (rounded up to a power of two, and to whole
    /// 64-bit words).
    pub(crate) fn new(len: u32) -> Self {
        let capacity = len.max(Self::PER_WORD).next_power_of_two();
        PsnRing {
            words: vec![0; (capacity / Self::PER_WORD) as usize].into_boxed_slice(),
            mask: capacity - 1,
        }
    }

    /// Entries the ring holds: the widest live window it can track.
    pub(crate) fn capacity(&self) -> u32 {
        self.mask + 1
    }

    /// Bytes of state (what a NIC would keep for this bitmap).
    pub(crate) fn state_bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Word index and bit shift of `psn`'s entry in a ring of `mask + 1` entries.
    fn pos(mask: u32, psn: u32) -> (usize, u32) {
        let i = psn & mask;
        ((i / Self::PER_WORD) as usize, (i % Self::PER_WORD) * W)
    }

    fn at(&self, psn: u32) -> (usize, u32) {
        Self::pos(self.mask, psn)
    }

    pub(crate) fn get(&self, psn: u32) -> u8 {
        let (w, shift) = self.at(psn);
        self.words
            .get(w)
            .map_or(0, |word| ((word >> shift) & Self::ENTRY) as u8)
    }

    pub(crate) fn set(&mut self, psn: u32, value: u8) {
        let (w, shift) = self.at(psn);
        if let Some(word) = self.words.get_mut(w) {
            *word = (*word & !(Self::ENTRY << shift)) | ((u64::from(value) & Self::ENTRY) << shift);
        }
    }

    /// Zeroes the entries of `[from, from + count)`; a count of at least the capacity
    /// zeroes the whole ring.
    pub(crate) fn clear_range(&mut self, from: u32, count: u32) {
        if count >= self.capacity() {
            self.words.fill(0);
            return;
        }
        for (w, mask) in Self::chunks(self.mask, from, count) {
            if let Some(word) = self.words.get_mut(w) {
                *word &= !mask;
            }
        }
    }

    /// Entries of `[from, from + count)` that are non-zero (`count` at most the capacity).
    pub(crate) fn count_nonzero(&self, from: u32, count: u32) -> u32 {
        Self::chunks(self.mask, from, count.min(self.capacity()))
            .map(|(w, mask)| {
                let v = self.words.get(w).map_or(0, |word| word & mask);
                if W == 1 {
                    v.count_ones()
                } else {
                    // An entry is non-zero when either of its bits is set.
                    ((v | (v >> 1)) & 0x5555_5555_5555_5555).count_ones()
                }
            })
            .sum()
    }

    /// `[from, from + count)` word by word: each word's index and the mask of the range's
    /// bits in it (a range wraps at the ring's end, which is a word boundary).
    fn chunks(ring_mask: u32, from: u32, count: u32) -> impl Iterator<Item = (usize, u64)> {
        let mut psn = from;
        let mut left = count;
        std::iter::from_fn(move || {
            if left == 0 {
                return None;
            }
            let (w, shift) = Self::pos(ring_mask, psn);
            let take = left.min(Self::PER_WORD - shift / W);
            let bits = take * W;
            let ones = if bits >= 64 {
                u64::MAX
            } else {
                (1u64 << bits) - 1
            };
            psn = psn.wrapping_add(take);
            left -= take;
            Some((w, ones << shift))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn capacity_is_a_power_of_two_of_whole_words() {
        assert_eq!(PsnRing::<1>::new(2).capacity(), 64);
        assert_eq!(PsnRing::<2>::new(2).capacity(), 32);
        assert_eq!(PsnRing::<2>::new(64).capacity(), 64);
        assert_eq!(PsnRing::<2>::new(64).state_bytes(), 16);
        assert_eq!(PsnRing::<1>::new(100).capacity(), 128);
        assert_eq!(PsnRing::<1>::new(1024).state_bytes(), 128);
    }

    #[test]
    fn entries_keep_their_place_across_the_psn_wrap() {
        let mut r = PsnRing::<2>::new(64);
        r.set(u32::MAX, 3);
        r.set(0, 1);
        assert_eq!((r.get(u32::MAX), r.get(0), r.get(1)), (3, 1, 0));
        assert_eq!(r.count_nonzero(u32::MAX - 1, 4), 2);
        r.clear_range(u32::MAX, 1);
        assert_eq!((r.get(u32::MAX), r.get(0)), (0, 1));
    }

    proptest! {
        /// Against a plain map of PSN → value: set, clear ranges and count over a window
        /// sliding across the wrap.
        #[test]
        fn matches_a_reference_map(
            base in prop::sample::select(vec![0u32, u32::MAX - 300, 1 << 31]),
            ops in prop::collection::vec((0u8..3, 0u32..256, 0u32..300, 0u8..4), 1..200),
        ) {
            let mut ring = PsnRing::<2>::new(256);
            let mut bits = PsnRing::<1>::new(256);
            let mut map = std::collections::HashMap::<u32, u8>::new();
            let mut lo = base;
            for (op, off, count, v) in ops {
                match op {
                    0 => {
                        let psn = lo.wrapping_add(off);
                        ring.set(psn, v);
                        bits.set(psn, v & 1);
                        map.insert(psn, v);
                    }
                    1 => {
                        // Slide the window: clear what leaves it.
                        let k = count.min(256);
                        ring.clear_range(lo, k);
                        bits.clear_range(lo, k);
                        for i in 0..k {
                            map.remove(&lo.wrapping_add(i));
                        }
                        lo = lo.wrapping_add(k);
                    }
                    _ => {
                        let from = lo.wrapping_add(off);
                        let k = count.min(256 - off);
                        let want = (0..k)
                            .filter(|i| map.get(&from.wrapping_add(*i)).is_some_and(|v| *v != 0))
                            .count() as u32;
                        let want_bits = (0..k)
                            .filter(|i| map.get(&from.wrapping_add(*i)).is_some_and(|v| v & 1 != 0))
                            .count() as u32;
                        prop_assert_eq!(ring.count_nonzero(from, k), want);
                        prop_assert_eq!(bits.count_nonzero(from, k), want_bits);
                    }
                }
                for i in 0..256 {
                    let psn = lo.wrapping_add(i);
                    let v = map.get(&psn).copied().unwrap_or(0);
                    prop_assert_eq!(ring.get(psn), v);
                    prop_assert_eq!(bits.get(psn), v & 1);
                }
            }
        }
    }
}
