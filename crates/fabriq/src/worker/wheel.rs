//! The worker's timers: a hierarchical timing wheel (the design of tokio's timer, Kafka's
//! purgatory and the Linux kernel's timer lists), owned by one worker and driven by its pass.
//!
//! * Time is counted in ticks of [`TICK_NS`] (1 µs: the channel's ack delay is tens of
//!   microseconds, RPC deadlines milliseconds and up).
//! * [`LEVELS`] levels of [`SLOTS`] slots; a slot of level `l` spans `SLOTS^l` ticks, so the
//!   wheel spans `SLOTS^LEVELS` ticks (≈ 19 hours); later deadlines wait in the top level's
//!   last slots and are re-filed as the wheel turns.
//! * Insert is O(1): the level is the highest 6-bit digit in which the deadline differs from
//!   the wheel's position, the slot that digit. Each level keeps a bitmap of occupied slots,
//!   so the next expiry is found with a few bit scans, without walking empty slots.
//! * Expiry: the lowest occupied level's next slot is always the earliest; a level-0 slot fires
//!   its entries, a higher slot is cascaded (its entries re-filed into lower levels) when the
//!   wheel reaches it. An entry never fires before its deadline and fires at the first
//!   [`TimerWheel::poll`] at or after it (in tick order; entries of one tick in insertion
//!   order).
//!
//! Entries are not removed when what they guard is done: the worker checks, when one fires,
//! whether it still applies (a channel's timer moved, an RPC already answered), as it did with
//! its earlier heap.

use super::Instant;

/// Nanoseconds per tick.
pub(crate) const TICK_NS: u64 = 1_000;
const SLOT_BITS: u32 = 6;
/// Slots per level.
pub(crate) const SLOTS: usize = 1 << SLOT_BITS;
/// Levels.
pub(crate) const LEVELS: usize = 6;
/// Ticks the wheel spans from its position.
const SPAN: u64 = 1 << (SLOT_BITS * LEVELS as u32);

struct Level<T> {
    occupied: u64,
    slots: [Vec<(u64, T)>; SLOTS],
}

impl<T> Level<T> {
    fn new() -> Level<T> {
        Level {
            occupied: 0,
            slots: std::array::from_fn(|_| Vec::new()),
        }
    }
}

/// A timing wheel of entries `T`, each with a deadline.
pub(crate) struct TimerWheel<T> {
    levels: Vec<Level<T>>,
    /// The wheel's position: every entry's deadline tick is ≥ it.
    elapsed: u64,
    len: usize,
    /// A tick at or before every entry's deadline (`None`: no entry): the next slot's start
    /// after a poll, lowered by inserts, so asking for the next deadline costs no bit scan.
    next_hint: Option<u64>,
}

impl<T> TimerWheel<T> {
    /// An empty wheel at time `now`.
    pub(crate) fn new(now: Instant) -> TimerWheel<T> {
        TimerWheel {
            levels: (0..LEVELS).map(|_| Level::new()).collect(),
            elapsed: now.as_nanos() / TICK_NS,
            len: 0,
            next_hint: None,
        }
    }

    /// Entries waiting.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// True when no entry waits.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// File `value` to fire at `deadline` (one in the past fires at the next poll).
    pub(crate) fn insert(&mut self, deadline: Instant, value: T) {
        // Rounded up: an entry never fires before its deadline.
        let tick = deadline.as_nanos().div_ceil(TICK_NS).max(self.elapsed);
        self.file(tick, value);
        self.len += 1;
        self.next_hint = Some(self.next_hint.map_or(tick, |h| h.min(tick)));
    }

    fn file(&mut self, tick: u64, value: T) {
        let (level, slot) = self.place(tick);
        let l = &mut self.levels[level];
        l.occupied |= 1 << slot;
        l.slots[slot].push((tick, value));
    }

    /// Level and slot of a deadline tick (≥ `elapsed`).
    fn place(&self, tick: u64) -> (usize, usize) {
        let tick = tick.min(self.elapsed + SPAN - 1);
        let diff = (tick ^ self.elapsed) | 1;
        let level = (((63 - diff.leading_zeros()) / SLOT_BITS) as usize).min(LEVELS - 1);
        let slot = ((tick >> (SLOT_BITS * level as u32)) as usize) & (SLOTS - 1);
        (level, slot)
    }

    /// The start tick of the next occupied slot, and its level: the lowest occupied level's
    /// first occupied slot at or after the wheel's position in that level.
    fn next_slot(&self) -> Option<(u64, usize, usize)> {
        for (level, l) in self.levels.iter().enumerate() {
            if l.occupied == 0 {
                continue;
            }
            let shift = SLOT_BITS * level as u32;
            let pos = ((self.elapsed >> shift) as usize) & (SLOTS - 1);
            // Slots before `pos` in this level belong to the next turn of the level above,
            // which only the top level ever holds (deadlines beyond the span).
            let ahead = l.occupied.rotate_right(pos as u32);
            let slot = (pos + ahead.trailing_zeros() as usize) & (SLOTS - 1);
            let level_span = 1u64 << (shift + SLOT_BITS);
            let base = self.elapsed & !(level_span - 1);
            let mut start = base + ((slot as u64) << shift);
            if slot < pos {
                start += level_span;
            }
            return Some((start.max(self.elapsed), level, slot));
        }
        None
    }

    /// The earliest time an entry may fire (a lower bound for a higher-level slot, which is
    /// cascaded then), for the worker's sleep.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.next_hint
            .map(|tick| Instant::from_nanos(tick.saturating_mul(TICK_NS)))
    }

    /// Move the wheel to `now` and hand every entry whose deadline passed to `fire`, in
    /// deadline order. Returns how many fired.
    pub(crate) fn poll(&mut self, now: Instant, mut fire: impl FnMut(Instant, T)) -> usize {
        let now_tick = now.as_nanos() / TICK_NS;
        let mut fired = 0;
        while let Some((start, level, slot)) = self.next_slot() {
            if start > now_tick {
                break;
            }
            self.elapsed = start;
            let l = &mut self.levels[level];
            l.occupied &= !(1 << slot);
            let entries = std::mem::take(&mut l.slots[slot]);
            if level == 0 {
                for (tick, value) in entries {
                    self.len -= 1;
                    fired += 1;
                    fire(Instant::from_nanos(tick.saturating_mul(TICK_NS)), value);
                }
            } else {
                // Cascade: re-file relative to the new position (into lower levels, or level 0
                // of this very tick).
                for (tick, value) in entries {
                    self.file(tick.max(self.elapsed), value);
                }
            }
        }
        self.elapsed = self.elapsed.max(now_tick);
        self.next_hint = self.next_slot().map(|(tick, _, _)| tick);
        fired
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(us: u64) -> Instant {
        Instant::from_nanos(us * 1_000)
    }

    #[test]
    fn fires_at_or_after_the_deadline_in_order() {
        let mut w = TimerWheel::new(at(0));
        for (d, v) in [
            (50, 'c'),
            (10, 'a'),
            (10, 'b'),
            (5_000, 'd'),
            (3_000_000, 'e'),
        ] {
            w.insert(at(d), v);
        }
        assert_eq!(w.len(), 5);
        let mut got = Vec::new();
        w.poll(at(9), |_, v| got.push(v));
        assert!(got.is_empty());
        assert_eq!(w.next_deadline(), Some(at(10)));
        w.poll(at(10), |_, v| got.push(v));
        assert_eq!(got, ['a', 'b']);
        w.poll(at(4_999), |_, v| got.push(v));
        assert_eq!(got, ['a', 'b', 'c']);
        w.poll(at(10_000_000), |_, v| got.push(v));
        assert_eq!(got, ['a', 'b', 'c', 'd', 'e']);
        assert!(w.is_empty());
        assert_eq!(w.next_deadline(), None);
    }

    #[test]
    fn a_deadline_in_the_past_fires_at_the_next_poll() {
        let mut w = TimerWheel::new(at(1_000));
        w.insert(at(3), 1);
        let mut n = 0;
        assert_eq!(w.poll(at(1_000), |_, _| n += 1), 1);
        assert_eq!(n, 1);
    }

    #[test]
    fn deadlines_beyond_the_span_wait_and_fire() {
        let mut w = TimerWheel::new(at(0));
        let far = SPAN * 3 + 17; // ticks = µs
        w.insert(at(far), ());
        let mut fired = Vec::new();
        w.poll(at(SPAN), |t, ()| fired.push(t));
        w.poll(at(far - 1), |t, ()| fired.push(t));
        assert!(fired.is_empty());
        w.poll(at(far), |t, ()| fired.push(t));
        assert_eq!(fired, [at(far)]);
    }

    proptest! {
        /// Against a sorted list: after each poll exactly the entries with deadline ≤ now have
        /// fired, each once, in deadline order; none early; the next deadline is a lower bound.
        #[test]
        fn matches_a_sorted_model(
            start in 0u64..1u64 << 40,
            steps in prop::collection::vec(
                (prop::collection::vec((0u64..1u64 << 34, 0u8..4), 0..6), 0u64..1u64 << 30),
                1..40,
            ),
        ) {
            let mut w = TimerWheel::new(at(start));
            let mut model: Vec<(u64, u32)> = Vec::new();
            let mut now = start;
            let mut id = 0u32;
            for (inserts, advance) in steps {
                for (offset, scale) in inserts {
                    // Deadlines from just behind `now` out to far beyond the span.
                    let off = offset >> (8 * u32::from(scale));
                    let d = (now + off).saturating_sub(2);
                    w.insert(at(d), id);
                    model.push((d.max(now), id));
                    id += 1;
                }
                if let (Some(lb), Some(&(first, _))) =
                    (w.next_deadline(), model.iter().min())
                {
                    prop_assert!(lb <= at(first), "next deadline {lb:?} after {first}");
                }
                now += advance;
                let mut fired = Vec::new();
                w.poll(at(now), |t, v| fired.push((t, v)));
                model.sort();
                let due: Vec<(u64, u32)> =
                    model.iter().copied().filter(|&(d, _)| d <= now).collect();
                model.retain(|&(d, _)| d > now);
                let got: Vec<(u64, u32)> =
                    fired.iter().map(|&(t, v)| (t.as_nanos() / 1_000, v)).collect();
                let mut got_sorted = got.clone();
                got_sorted.sort();
                prop_assert_eq!(&got_sorted, &due);
                prop_assert!(got.windows(2).all(|p| p[0].0 <= p[1].0), "out of order: {:?}", got);
                prop_assert_eq!(w.len(), model.len());
            }
        }
    }
}
