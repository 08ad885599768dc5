//! The connection pool: one shared connection per (peer address, worker).
//!
//! Every channel between this process and one remote worker shares one connection, so the
//! number of connections grows with peers, not with threads × peers. The pool is generic over
//! the connection object (the channel layer's connection, which owns the QP, its rings and
//! its [`super::Established`]); it hands out `Arc`s and keeps only `Weak`s, so a connection lives
//! exactly as long as some user holds it, and its `Drop` (which releases its QP to the QP cache)
//! runs when the last user lets go.
//!
//! Two threads asking for the same peer at once get one connection: the second waits for the
//! first's connect on a per-key lock instead of racing it. Different peers never wait for each
//! other.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

/// The identity a pooled connection is shared under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerKey {
    /// The peer's control address (where its listener is).
    pub addr: SocketAddr,
    /// The remote worker (`None`: whichever the peer picks).
    pub worker: Option<u32>,
}

/// Counters of a [`ConnPool`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ConnPoolStats {
    /// Acquisitions served by a live shared connection.
    pub hits: u64,
    /// Acquisitions that connected.
    pub misses: u64,
    /// Live connections now.
    pub live: u64,
}

type Slot<C> = Arc<Mutex<Weak<C>>>;

/// A map from [`PeerKey`] to a shared connection. Thread-safe.
pub struct ConnPool<C> {
    slots: Mutex<HashMap<PeerKey, Slot<C>>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl<C> std::fmt::Debug for ConnPool<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnPool")
            .field("stats", &self.stats())
            .finish()
    }
}

impl<C> Default for ConnPool<C> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C> ConnPool<C> {
    /// An empty pool.
    pub fn new() -> Self {
        ConnPool {
            slots: Mutex::new(HashMap::new()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    fn slot(&self, key: PeerKey) -> Slot<C> {
        let mut slots = self.slots.lock();
        Arc::clone(slots.entry(key).or_default())
    }

    /// The live connection for `key`, if any.
    pub fn get(&self, key: PeerKey) -> Option<Arc<C>> {
        let slot = self.slots.lock().get(&key).cloned()?;
        let c = slot.lock().upgrade();
        if c.is_some() {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
        c
    }

    /// The live connection for `key`, or a new one from `connect` (called at most once per key
    /// at a time; a failure is returned and nothing is stored).
    pub fn get_or_connect<E>(
        &self,
        key: PeerKey,
        connect: impl FnOnce() -> Result<C, E>,
    ) -> Result<Arc<C>, E> {
        self.get_usable_or_connect(key, |_| true, connect)
    }

    /// [`ConnPool::get_or_connect`], handing out the pooled connection only if `usable` says
    /// so (e.g. its peer has not hung up); otherwise it is forgotten (its users keep it) and
    /// `connect` replaces it, counted as a miss. `usable` runs under the key's lock, so
    /// concurrent acquirers replace a dead connection once.
    pub fn get_usable_or_connect<E>(
        &self,
        key: PeerKey,
        usable: impl FnOnce(&C) -> bool,
        connect: impl FnOnce() -> Result<C, E>,
    ) -> Result<Arc<C>, E> {
        let slot = self.slot(key);
        let mut weak = slot.lock();
        if let Some(c) = weak.upgrade() {
            if usable(&c) {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(c);
            }
            *weak = Weak::new();
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let c = Arc::new(connect()?);
        *weak = Arc::downgrade(&c);
        Ok(c)
    }

    /// The live connection for `key` if `usable` says so, without waiting: `None` where there
    /// is none, it is not usable, or a connect for `key` holds the key's lock (the caller then
    /// takes [`ConnPool::get_usable_or_connect`], which waits for that connect). A hit counts
    /// as one; nothing else is counted or changed.
    pub fn try_get_usable(&self, key: PeerKey, usable: impl FnOnce(&C) -> bool) -> Option<Arc<C>> {
        let slot = self.slots.lock().get(&key).cloned()?;
        let weak = slot.try_lock()?;
        let c = weak.upgrade().filter(|c| usable(c))?;
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(c)
    }

    /// Forget the connection for `key` (e.g. after it failed) so the next acquisition
    /// reconnects; users holding it keep it. Returns it if it was live.
    pub fn remove(&self, key: PeerKey) -> Option<Arc<C>> {
        let slot = self.slots.lock().remove(&key)?;
        let c = slot.lock().upgrade();
        c
    }

    /// Forget `stale` (e.g. it failed) if it is still the connection for `key`; a newer one
    /// that replaced it stays.
    pub fn remove_stale(&self, key: PeerKey, stale: &Arc<C>) {
        let mut slots = self.slots.lock();
        let same = slots.get(&key).is_some_and(|slot| {
            slot.try_lock()
                .is_some_and(|w| w.upgrade().is_some_and(|c| Arc::ptr_eq(&c, stale)))
        });
        if same {
            slots.remove(&key);
        }
    }

    /// Drop the entries of connections nobody holds any more; returns how many.
    pub fn prune(&self) -> usize {
        let mut slots = self.slots.lock();
        let before = slots.len();
        slots.retain(|_, slot| {
            // A slot locked by a connect in progress is kept.
            slot.try_lock().map_or(true, |w| w.strong_count() > 0)
        });
        before - slots.len()
    }

    /// Live connections now.
    pub fn live(&self) -> usize {
        self.slots
            .lock()
            .values()
            .filter(|s| s.try_lock().map_or(true, |w| w.strong_count() > 0))
            .count()
    }

    /// Counters.
    pub fn stats(&self) -> ConnPoolStats {
        ConnPoolStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            live: self.live() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Barrier;

    fn key(port: u16, worker: Option<u32>) -> PeerKey {
        PeerKey {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            worker,
        }
    }

    struct Conn {
        id: usize,
        closed: Arc<AtomicUsize>,
    }
    impl Drop for Conn {
        fn drop(&mut self) {
            self.closed.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn one_connection_per_key_shared_and_closed_with_its_last_user() {
        let pool = ConnPool::new();
        let closed = Arc::new(AtomicUsize::new(0));
        let mk = |id| {
            let closed = Arc::clone(&closed);
            move || Ok::<_, ()>(Conn { id, closed })
        };
        let a1 = pool.get_or_connect(key(1, Some(0)), mk(1)).unwrap();
        let a2 = pool.get_or_connect(key(1, Some(0)), mk(2)).unwrap();
        assert!(Arc::ptr_eq(&a1, &a2), "same key shares one connection");
        let b = pool.get_or_connect(key(1, Some(1)), mk(3)).unwrap();
        let c = pool.get_or_connect(key(2, Some(0)), mk(4)).unwrap();
        assert_eq!((a1.id, b.id, c.id), (1, 3, 4));
        assert_eq!(
            pool.stats(),
            ConnPoolStats {
                hits: 1,
                misses: 3,
                live: 3
            }
        );
        drop(a1);
        assert_eq!(closed.load(Ordering::SeqCst), 0, "a2 still holds it");
        drop(a2);
        assert_eq!(closed.load(Ordering::SeqCst), 1);
        assert_eq!(pool.live(), 2);
        assert_eq!(pool.prune(), 1);
        let a3 = pool.get_or_connect(key(1, Some(0)), mk(5)).unwrap();
        assert_eq!(a3.id, 5, "a dead entry reconnects");
    }

    /// `try_get_usable` hands out a live, usable connection and never waits: not for a key
    /// without one, not for one it may not use (which stays for `get_usable_or_connect` to
    /// replace), not for a connect in progress on the key.
    #[test]
    fn try_get_usable_takes_only_what_is_there_and_never_waits() {
        let pool: ConnPool<u32> = ConnPool::new();
        assert!(pool.try_get_usable(key(1, None), |_| true).is_none());
        let a = pool
            .get_or_connect(key(1, None), || Ok::<_, ()>(7))
            .unwrap();
        let got = pool.try_get_usable(key(1, None), |&c| c == 7).unwrap();
        assert!(Arc::ptr_eq(&a, &got));
        assert!(pool.try_get_usable(key(1, None), |&c| c != 7).is_none());
        assert_eq!(pool.stats().hits, 1, "a hit counted, the refusals not");
        assert_eq!(pool.live(), 1, "an unusable connection is left in place");
        // A connect in progress holds the key: the look is answered at once, empty.
        let connecting = Barrier::new(2);
        let done = Barrier::new(2);
        std::thread::scope(|s| {
            s.spawn(|| {
                pool.get_usable_or_connect(
                    key(2, None),
                    |_| true,
                    || {
                        connecting.wait();
                        done.wait();
                        Ok::<_, ()>(9)
                    },
                )
            });
            connecting.wait();
            assert!(pool.try_get_usable(key(2, None), |_| true).is_none());
            done.wait();
        });
    }

    #[test]
    fn failed_connect_stores_nothing_and_remove_forces_reconnect() {
        let pool: ConnPool<u32> = ConnPool::new();
        assert_eq!(
            pool.get_or_connect(key(1, None), || Err("refused")),
            Err("refused")
        );
        assert_eq!(pool.live(), 0);
        let a = pool
            .get_or_connect(key(1, None), || Ok::<_, ()>(7))
            .unwrap();
        let removed = pool.remove(key(1, None)).unwrap();
        assert!(Arc::ptr_eq(&a, &removed));
        let b = pool
            .get_or_connect(key(1, None), || Ok::<_, ()>(8))
            .unwrap();
        assert_eq!((*a, *b), (7, 8));
    }

    #[test]
    fn an_unusable_connection_is_replaced_once_and_counted_as_a_miss() {
        use std::cell::Cell;
        let pool = ConnPool::new();
        let k = key(11, None);
        let old = pool
            .get_or_connect(k, || Ok::<_, ()>(Cell::new(1)))
            .unwrap();
        // Usable: handed out again.
        let again = pool
            .get_usable_or_connect(k, |c| c.get() == 1, || Ok::<_, ()>(Cell::new(2)))
            .unwrap();
        assert!(Arc::ptr_eq(&old, &again));
        // Not usable any more: replaced, though its holders keep it.
        old.set(0);
        let new = pool
            .get_usable_or_connect(k, |c| c.get() == 1, || Ok::<_, ()>(Cell::new(1)))
            .unwrap();
        assert!(!Arc::ptr_eq(&old, &new));
        assert_eq!((old.get(), new.get()), (0, 1));
        // The replacement is what the pool hands out now.
        let third = pool
            .get_usable_or_connect(k, |c| c.get() == 1, || Ok::<_, ()>(Cell::new(3)))
            .unwrap();
        assert!(Arc::ptr_eq(&new, &third));
        assert_eq!(
            pool.stats(),
            ConnPoolStats {
                hits: 2,
                misses: 2,
                live: 1
            }
        );
        // A failed replacement leaves nothing pooled, though the old one is still held.
        new.set(0);
        assert!(pool
            .get_usable_or_connect(k, |c| c.get() == 1, || Err::<Cell<u8>, _>("refused"))
            .is_err());
        assert_eq!(pool.stats().live, 0);
        assert_eq!(pool.stats().misses, 3);
        assert_eq!(third.get(), 0);
    }

    #[test]
    fn concurrent_acquirers_of_one_key_connect_once() {
        let pool = Arc::new(ConnPool::new());
        let connects = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(Barrier::new(8));
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let (pool, connects, barrier) = (
                    Arc::clone(&pool),
                    Arc::clone(&connects),
                    Arc::clone(&barrier),
                );
                std::thread::spawn(move || {
                    barrier.wait();
                    pool.get_or_connect(key(9, Some(0)), || {
                        connects.fetch_add(1, Ordering::SeqCst);
                        std::thread::yield_now();
                        Ok::<_, ()>(42u64)
                    })
                    .unwrap()
                })
            })
            .collect();
        let conns: Vec<Arc<u64>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(connects.load(Ordering::SeqCst), 1);
        assert!(conns.iter().all(|c| Arc::ptr_eq(c, &conns[0])));
        assert_eq!(pool.stats().misses, 1);
        assert_eq!(pool.stats().hits, 7);
    }
}
