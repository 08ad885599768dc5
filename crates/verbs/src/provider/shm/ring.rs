//! The bounded multi-producer multi-consumer ring every shared queue of the provider is made of
//! (receive queues, SRQs, completion queues): D. Vyukov's array queue with one sequence word per
//! slot.
//!
//! It owns only the algorithm; where the memory lives is the caller's business (`segment`
//! lays rings out in memfd segments, the loom tests on the heap). Slots are cache-line
//! aligned; the producer index (`tail`) and consumer index (`head`) sit on their own lines, so a
//! producer in one process and a consumer in another share only the slot they hand over.
//!
//! A ring may live in memory a peer process can scribble on, so nothing here trusts the
//! contents: indices are masked, and every wait is bounded ([`SPIN_LIMIT`]); a ring that stays
//! inconsistent for that long is reported as [`RingError::Stalled`], never spun on forever.
//!
//! Full/empty: `push` reports [`RingError::Full`] only when `capacity` entries are really
//! outstanding (a consumer in the middle of releasing the slot is waited for, briefly); `pop`
//! reports empty when the next slot is not yet published. `push_limited` bounds the count
//! below the capacity without reading the consumers' index.
//!
//! `push_with` / `pop_with` let the caller write or read only part of a slot's payload (a
//! receive with one SGE is one cache line of a three-line slot); `push` / `pop` are those with
//! the whole payload, and the algorithm — and its loom model — is the same for both. The
//! `prefetch_*` hints ask for slot lines ahead of use; they never change what the protocol
//! does.
#![allow(unexpected_cfgs)]

use super::sync::{backoff, AtomicU64, DataCell, Ordering};

/// Longest bounded wait, in spins, on a slot another thread or process is handing over.
#[cfg(not(loom))]
pub(crate) const SPIN_LIMIT: u32 = 1 << 16;
/// Under loom every spin is a scheduling point: keep the model small.
#[cfg(loom)]
pub(crate) const SPIN_LIMIT: u32 = 3;

/// One index on its own cache line.
#[repr(C, align(64))]
pub(crate) struct Padded(pub(crate) AtomicU64);

/// The two indices of a ring. All-zero is the state of a fresh ring.
#[repr(C)]
pub(crate) struct RingHead {
    /// Next position to produce into.
    pub(crate) tail: Padded,
    /// Next position to consume from.
    pub(crate) head: Padded,
}

/// One slot: its sequence word and payload.
///
/// Invariant: `seq == pos` means free for the producer of position `pos`; `seq == pos + 1`
/// means filled for the consumer of `pos`; the consumer releases it with `pos + capacity`.
#[repr(C, align(64))]
pub(crate) struct Cell<T> {
    pub(crate) seq: AtomicU64,
    pub(crate) val: DataCell<T>,
}

// SAFETY: the payload is only touched by the one thread that won the slot's position with a
// compare-and-swap on `tail` (writer) or `head` (reader), and the hand-over is ordered by the
// Release/Acquire pair on `seq`; so sharing a `Cell` is sound when the payload may move between
// threads.
unsafe impl<T: Send> Sync for Cell<T> {}

/// Why a push or pop did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RingError {
    /// `capacity` entries are outstanding.
    Full,
    /// The ring stayed inconsistent for [`SPIN_LIMIT`] spins (a peer died mid-operation or
    /// corrupted it).
    Stalled,
}

/// A view of a ring: its indices and slots.
pub(crate) struct Ring<'a, T> {
    head: &'a RingHead,
    cells: &'a [Cell<T>],
    mask: u64,
}

impl<'a, T: Copy> Ring<'a, T> {
    /// A view over `cells.len()` slots; `None` unless that is a power of two.
    pub(crate) fn new(head: &'a RingHead, cells: &'a [Cell<T>]) -> Option<Self> {
        let n = cells.len();
        if n == 0 || !n.is_power_of_two() {
            return None;
        }
        Some(Ring {
            head,
            cells,
            mask: n as u64 - 1,
        })
    }

    /// Reset to empty. Only before the ring is shared.
    pub(crate) fn init(&self) {
        for (i, c) in self.cells.iter().enumerate() {
            c.seq.store(i as u64, Ordering::Relaxed);
        }
        self.head.tail.0.store(0, Ordering::Relaxed);
        self.head.head.0.store(0, Ordering::Release);
    }

    /// Slots in the ring.
    pub(crate) fn capacity(&self) -> u64 {
        self.mask + 1
    }

    /// Entries published and not yet consumed (a snapshot).
    pub(crate) fn len(&self) -> u64 {
        let head = self.head.head.0.load(Ordering::Acquire);
        let tail = self.head.tail.0.load(Ordering::Acquire);
        tail.saturating_sub(head).min(self.capacity())
    }

    #[inline]
    fn cell(&self, pos: u64) -> &Cell<T> {
        // Masked index: always in bounds of a power-of-two slice.
        &self.cells[(pos & self.mask) as usize]
    }

    /// Append `v`.
    #[inline]
    pub(crate) fn push(&self, v: T) -> Result<(), RingError> {
        self.push_with(|p| {
            // SAFETY: `push_with` hands `fill` the slot it owns exclusively; T is plain data.
            unsafe { p.write(v) }
        })
    }

    /// Append an entry that `fill` writes in place (it may write only the fields the entry
    /// uses: a receive with one SGE touches one cache line, not the whole slot).
    ///
    /// `fill` gets a pointer to the slot's payload, valid for writes of one `T` and owned by
    /// this thread alone until the slot is published (after `fill` returns).
    #[inline]
    pub(crate) fn push_with(&self, fill: impl FnOnce(*mut T)) -> Result<(), RingError> {
        let mut pos = self.head.tail.0.load(Ordering::Relaxed);
        // Ask for the slot's line in exclusive state: the sequence load below and the payload
        // stores then cost one transfer from the consumer's cache instead of a read followed
        // by an upgrade. A hint only; it has no effect on the protocol.
        prefetch_write(self.cell(pos));
        let mut spins = 0u32;
        let mut fill = Some(fill);
        loop {
            let cell = self.cell(pos);
            let seq = cell.seq.load(Ordering::Acquire);
            let dif = seq.wrapping_sub(pos) as i64;
            if dif == 0 {
                match self.head.tail.0.compare_exchange(
                    pos,
                    pos.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        if let Some(fill) = fill.take() {
                            // Winning the CAS on `tail` for `pos` gives this thread the slot
                            // exclusively until it publishes it below (the Acquire load of
                            // `seq == pos` ordered the previous consumer's reads before this).
                            cell.val.with_mut(fill);
                        }
                        cell.seq.store(pos.wrapping_add(1), Ordering::Release);
                        return Ok(());
                    }
                    Err(actual) => pos = actual,
                }
                continue;
            } else if dif < 0 {
                // The slot still holds the entry of the previous lap. Full, unless its consumer
                // has already claimed it and is about to release it.
                let head = self.head.head.0.load(Ordering::Acquire);
                if pos.wrapping_sub(head) >= self.capacity() {
                    return Err(RingError::Full);
                }
            } else {
                pos = self.head.tail.0.load(Ordering::Relaxed);
            }
            spins += 1;
            if spins >= SPIN_LIMIT {
                return Err(RingError::Stalled);
            }
            backoff(spins);
        }
    }

    /// Like [`Ring::push_with`], but [`RingError::Full`] once `limit` entries are outstanding
    /// (published or being consumed).
    ///
    /// The count is checked without reading `head`, the line every consumer writes: a
    /// producer that read it on each push would pull it away from the consumer each time (a
    /// receive queue is usually kept full, so the check runs on every post). With
    /// `limit >= capacity` the slot's own sequence word is the bound; below that, the slot of
    /// position `tail - limit` tells whether that entry was consumed and released.
    #[inline]
    pub(crate) fn push_limited(
        &self,
        limit: u64,
        fill: impl FnOnce(*mut T),
    ) -> Result<(), RingError> {
        if limit < self.capacity() {
            let tail = self.head.tail.0.load(Ordering::Relaxed);
            if tail >= limit {
                let pos = tail - limit;
                // Released slots read `pos + capacity` (or more, once refilled a lap later);
                // published or claimed ones read `pos + 1` or less.
                let seq = self.cell(pos).seq.load(Ordering::Acquire);
                if (seq.wrapping_sub(pos) as i64) < self.capacity() as i64 {
                    return Err(RingError::Full);
                }
            }
        }
        self.push_with(fill)
    }

    /// Take the oldest entry, if one is published.
    #[inline]
    pub(crate) fn pop(&self) -> Result<Option<T>, RingError> {
        self.pop_with(|p| {
            // SAFETY: `pop_with` hands `read` the published slot it owns exclusively; any bit
            // pattern is a valid T for the payloads rings carry.
            unsafe { p.read() }
        })
    }

    /// False only when no entry is published at the head now (two loads, nothing taken): a
    /// poller that sees false may skip its poll. True may be a moment stale.
    #[inline]
    pub(crate) fn may_have_entry(&self) -> bool {
        let pos = self.head.head.0.load(Ordering::Relaxed);
        let seq = self.cell(pos).seq.load(Ordering::Acquire);
        seq.wrapping_sub(pos.wrapping_add(1)) as i64 >= 0
    }

    /// Take the oldest entry, if one is published, reading from it only what `read` reads.
    ///
    /// `read` gets a pointer to the slot's payload, valid for reads of one `T` and owned by
    /// this thread alone until `read` returns (the slot is released after it).
    #[inline]
    pub(crate) fn pop_with<R>(
        &self,
        read: impl FnOnce(*const T) -> R,
    ) -> Result<Option<R>, RingError> {
        let mut pos = self.head.head.0.load(Ordering::Relaxed);
        let mut spins = 0u32;
        let mut read = Some(read);
        loop {
            let cell = self.cell(pos);
            let seq = cell.seq.load(Ordering::Acquire);
            let dif = seq.wrapping_sub(pos.wrapping_add(1)) as i64;
            if dif == 0 {
                match self.head.head.0.compare_exchange(
                    pos,
                    pos.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // Winning the CAS on `head` for `pos` gives this thread the published
                        // slot (made visible by the Acquire load of `seq == pos + 1`)
                        // exclusively until it releases it below.
                        let v = read.take().map(|read| cell.val.with(read));
                        cell.seq.store(
                            pos.wrapping_add(self.mask).wrapping_add(1),
                            Ordering::Release,
                        );
                        return Ok(v);
                    }
                    Err(actual) => pos = actual,
                }
                continue;
            } else if dif < 0 {
                return Ok(None);
            } else {
                pos = self.head.head.0.load(Ordering::Relaxed);
            }
            spins += 1;
            if spins >= SPIN_LIMIT {
                return Err(RingError::Stalled);
            }
            backoff(spins);
        }
    }

    /// Hint: fetch, in exclusive state, the slot `ahead` positions past the next one to pop
    /// (a consumer's release writes it). A consumer that takes entries a producer wrote long
    /// before (a sender taking the receives a peer posted) calls it after each pop, so the
    /// transfer overlaps the current delivery instead of stalling the next one. No effect on
    /// the protocol.
    #[inline]
    pub(crate) fn prefetch_for_pop(&self, ahead: u64) {
        let pos = self.head.head.0.load(Ordering::Relaxed);
        prefetch_write(self.cell(pos.wrapping_add(ahead)));
    }

    /// Hint: fetch, in exclusive state, the next `n` slots to fill (at most 16), all at once.
    /// A producer about to push a batch into slots its consumers released (a receiver
    /// reposting the receives it has just seen completed) then waits for one transfer, not for
    /// `n` in a row. No effect on the protocol.
    #[inline]
    pub(crate) fn prefetch_push_run(&self, n: usize) {
        let pos = self.head.tail.0.load(Ordering::Relaxed);
        for k in 0..n.min(16) as u64 {
            prefetch_write(self.cell(pos.wrapping_add(k)));
        }
    }

    /// Hint: fetch, in exclusive state, the slot `ahead` positions past the next one to fill.
    /// A producer that streams into a ring whose consumer lags (a sender filling a peer's
    /// CQ) then finds the slot in its cache; with `ahead >= 1` it never takes the slot an
    /// idle consumer is polling. No effect on the protocol.
    #[inline]
    pub(crate) fn prefetch_for_push(&self, ahead: u64) {
        let pos = self.head.tail.0.load(Ordering::Relaxed);
        prefetch_write(self.cell(pos.wrapping_add(ahead)));
    }
}

/// Prefetch the cache line at `p` for writing (`PREFETCHW`), where the target has it.
#[inline(always)]
fn prefetch_write<T>(p: *const T) {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    // SAFETY: a prefetch is a hint: it never faults and never changes memory, whatever `p`.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_ET0 }>(p.cast::<i8>());
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    let _ = p;
}

/// Bytes a ring of `cap` slots of `T` occupies when laid out as [`RingHead`] followed by the
/// slots.
pub(crate) fn ring_bytes<T>(cap: u64) -> Option<u64> {
    let cell = std::mem::size_of::<Cell<T>>() as u64;
    cap.checked_mul(cell)?
        .checked_add(std::mem::size_of::<RingHead>() as u64)
}

/// A heap-allocated ring of `u64`, for the criterion benches.
#[doc(hidden)]
pub struct BenchRing {
    head: Box<RingHead>,
    cells: Box<[Cell<u64>]>,
}

impl BenchRing {
    /// An empty ring of `cap` (a power of two) slots.
    pub fn new(cap: usize) -> BenchRing {
        BenchRing {
            head: Box::new(RingHead {
                tail: Padded(AtomicU64::new(0)),
                head: Padded(AtomicU64::new(0)),
            }),
            cells: (0..cap.max(1).next_power_of_two())
                .map(|i| Cell {
                    seq: AtomicU64::new(i as u64),
                    val: DataCell::new(0),
                })
                .collect(),
        }
    }

    /// Push `v` and pop it back.
    pub fn push_pop(&self, v: u64) -> Option<u64> {
        let ring = Ring::new(&self.head, &self.cells)?;
        ring.push(v).ok()?;
        ring.pop().ok().flatten()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    struct Heap<T> {
        head: Box<RingHead>,
        cells: Vec<Cell<T>>,
    }

    fn heap<T: Copy + Default>(cap: usize) -> Heap<T> {
        Heap {
            head: Box::new(RingHead {
                tail: Padded(AtomicU64::new(0)),
                head: Padded(AtomicU64::new(0)),
            }),
            cells: (0..cap)
                .map(|_| Cell {
                    seq: AtomicU64::new(0),
                    val: DataCell::new(T::default()),
                })
                .collect(),
        }
    }

    #[test]
    fn rejects_non_power_of_two() {
        let h = heap::<u64>(3);
        assert!(Ring::new(&h.head, &h.cells).is_none());
        let h = heap::<u64>(0);
        assert!(Ring::new(&h.head, &h.cells).is_none());
    }

    #[test]
    fn push_pop_in_order_and_full_and_wrap() {
        let h = heap::<u64>(4);
        let r = Ring::new(&h.head, &h.cells).unwrap();
        r.init();
        assert_eq!(r.pop(), Ok(None));
        for lap in 0..5u64 {
            for i in 0..4 {
                r.push(lap * 10 + i).unwrap();
            }
            assert_eq!(r.len(), 4);
            assert_eq!(r.push(99), Err(RingError::Full));
            for i in 0..4 {
                assert_eq!(r.pop(), Ok(Some(lap * 10 + i)));
            }
            assert_eq!(r.pop(), Ok(None));
            assert_eq!(r.len(), 0);
        }
    }

    /// A `push_with` filler writing `v`.
    fn put<T>(v: T) -> impl FnOnce(*mut T) {
        move |p| {
            // SAFETY: the ring hands the filler its claimed slot, valid for one `T`.
            unsafe { p.write(v) }
        }
    }

    /// A `pop_with` reader of the first word only.
    fn first_word<T>(p: *const T) -> u64 {
        // SAFETY: the ring hands the reader its claimed slot; every `T` used here starts with
        // a `u64`.
        unsafe { p.cast::<u64>().read() }
    }

    #[test]
    fn push_limited_counts_outstanding_entries_below_capacity() {
        let h = heap::<u64>(8);
        let r = Ring::new(&h.head, &h.cells).unwrap();
        r.init();
        for lap in 0..4u64 {
            for i in 0..5 {
                r.push_limited(5, put(lap * 10 + i)).unwrap();
            }
            assert_eq!(r.push_limited(5, put(99)), Err(RingError::Full));
            assert_eq!(r.pop(), Ok(Some(lap * 10)));
            // One consumed: one more fits, and then the limit holds again.
            r.push_limited(5, put(lap * 10 + 5)).unwrap();
            assert_eq!(r.push_limited(5, put(99)), Err(RingError::Full));
            for i in 1..6 {
                assert_eq!(r.pop(), Ok(Some(lap * 10 + i)));
            }
            assert_eq!(r.pop(), Ok(None));
        }
        // At capacity the slots themselves are the bound.
        for i in 0..8 {
            r.push_limited(8, put(i)).unwrap();
        }
        assert_eq!(r.push_limited(8, put(99)), Err(RingError::Full));
    }

    #[test]
    fn partial_writes_and_reads_touch_only_what_they_name() {
        let h = heap::<[u64; 4]>(2);
        let r = Ring::new(&h.head, &h.cells).unwrap();
        r.init();
        r.push([1, 2, 3, 4]).unwrap();
        assert_eq!(r.pop(), Ok(Some([1, 2, 3, 4])));
        // The slot comes round again: a partial write leaves the rest as it was.
        r.push([5, 6, 7, 8]).unwrap();
        r.push_with(|p| put(9u64)(p.cast::<u64>())).unwrap();
        assert_eq!(r.pop(), Ok(Some([5, 6, 7, 8])));
        assert_eq!(r.pop_with(first_word), Ok(Some(9)));
        assert_eq!(r.pop_with(first_word), Ok(None));
    }

    #[test]
    fn corrupted_sequence_is_reported_not_spun_on() {
        let h = heap::<u64>(2);
        let r = Ring::new(&h.head, &h.cells).unwrap();
        r.init();
        // A slot whose sequence is ahead of every position the ring can reach.
        h.cells[0].seq.store(1 << 40, Ordering::Relaxed);
        assert_eq!(r.push(1), Err(RingError::Stalled));
        assert_eq!(r.pop(), Err(RingError::Stalled));
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn threads_exchange_every_item_once() {
        let h = std::sync::Arc::new(heap::<u64>(8));
        Ring::new(&h.head, &h.cells).unwrap().init();
        const PER: u64 = 20_000;
        let producers: Vec<_> = (0..2u64)
            .map(|t| {
                let h = h.clone();
                std::thread::spawn(move || {
                    let r = Ring::new(&h.head, &h.cells).unwrap();
                    for i in 0..PER {
                        let mut spins = 0u32;
                        while r.push(t * PER + i).is_err() {
                            spins += 1;
                            backoff(spins);
                        }
                    }
                })
            })
            .collect();
        let r = Ring::new(&h.head, &h.cells).unwrap();
        let mut seen = vec![false; (2 * PER) as usize];
        let mut last = [None::<u64>; 2];
        let mut got = 0;
        let mut spins = 0u32;
        while got < 2 * PER {
            match r.pop().unwrap() {
                Some(v) => {
                    assert!(!seen[v as usize], "{v} twice");
                    seen[v as usize] = true;
                    let t = (v / PER) as usize;
                    assert!(last[t].map_or(true, |l| l < v), "producer order broken");
                    last[t] = Some(v);
                    got += 1;
                }
                None => {
                    spins += 1;
                    backoff(spins);
                }
            }
        }
        for p in producers {
            p.join().unwrap();
        }
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    struct Heap {
        head: RingHead,
        cells: Vec<Cell<u64>>,
    }

    fn heap(cap: usize) -> Arc<Heap> {
        let h = Heap {
            head: RingHead {
                tail: Padded(AtomicU64::new(0)),
                head: Padded(AtomicU64::new(0)),
            },
            cells: (0..cap)
                .map(|i| Cell {
                    seq: AtomicU64::new(i as u64),
                    val: DataCell::new(0),
                })
                .collect(),
        };
        Arc::new(h)
    }

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(f);
    }

    #[test]
    fn two_producers_one_consumer_wrap() {
        model(|| {
            let h = heap(2);
            let p = {
                let h = h.clone();
                loom::thread::spawn(move || {
                    let r = Ring::new(&h.head, &h.cells).unwrap();
                    r.push(1).is_ok() as u32 + r.push(2).is_ok() as u32
                })
            };
            let q = {
                let h = h.clone();
                loom::thread::spawn(move || {
                    let r = Ring::new(&h.head, &h.cells).unwrap();
                    r.push(3).is_ok() as u32
                })
            };
            let r = Ring::new(&h.head, &h.cells).unwrap();
            let mut got = Vec::new();
            for _ in 0..2 {
                if let Ok(Some(v)) = r.pop() {
                    got.push(v);
                }
            }
            let pushed = p.join().unwrap() + q.join().unwrap();
            while let Ok(Some(v)) = r.pop() {
                got.push(v);
            }
            assert_eq!(got.len() as u32, pushed, "every accepted push popped once");
            let ones: Vec<_> = got.iter().filter(|v| **v != 3).collect();
            assert!(ones.windows(2).all(|w| w[0] < w[1]), "producer order kept");
        });
    }

    #[test]
    fn push_limited_never_exceeds_the_limit() {
        model(|| {
            let h = heap(4);
            let c = {
                let h = h.clone();
                loom::thread::spawn(move || {
                    let r = Ring::new(&h.head, &h.cells).unwrap();
                    r.pop().unwrap_or(None)
                })
            };
            let r = Ring::new(&h.head, &h.cells).unwrap();
            let put = |v: u64| {
                move |p: *mut u64| {
                    // SAFETY: the ring hands the filler its claimed slot, valid for a u64.
                    unsafe { p.write(v) }
                }
            };
            let first = r.push_limited(1, put(1)).is_ok();
            let second = r.push_limited(1, put(2)).is_ok();
            let popped = c.join().unwrap();
            assert!(first, "an empty ring takes one entry");
            if second {
                assert_eq!(
                    popped,
                    Some(1),
                    "a second entry only once the first was consumed"
                );
            }
            let mut rest = Vec::new();
            while let Ok(Some(v)) = r.pop() {
                rest.push(v);
            }
            let total = usize::from(popped.is_some()) + rest.len();
            assert_eq!(
                total,
                1 + usize::from(second),
                "every accepted push popped once"
            );
        });
    }

    #[test]
    fn producer_and_two_consumers() {
        model(|| {
            let h = heap(2);
            let consumers: Vec<_> = (0..2)
                .map(|_| {
                    let h = h.clone();
                    loom::thread::spawn(move || {
                        let r = Ring::new(&h.head, &h.cells).unwrap();
                        r.pop().unwrap_or(None)
                    })
                })
                .collect();
            let r = Ring::new(&h.head, &h.cells).unwrap();
            let mut pushed = 0;
            for v in 1..=2u64 {
                if r.push(v).is_ok() {
                    pushed += 1;
                }
            }
            let mut got: Vec<u64> = consumers
                .into_iter()
                .filter_map(|c| c.join().unwrap())
                .collect();
            while let Ok(Some(v)) = r.pop() {
                got.push(v);
            }
            got.sort_unstable();
            got.dedup();
            assert_eq!(got.len(), pushed, "no item lost or duplicated");
        });
    }
}
