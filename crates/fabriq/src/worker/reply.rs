//! Where a worker's answer to one operation goes: an RPC call's reply, a one-sided
//! operation's result.
//!
//! An async caller awaits a tokio oneshot. A blocking caller waits on a [`Slot`] of its own
//! thread instead, which the thread keeps from one operation to the next: no allocation and no
//! free per operation (a oneshot is one of each: with them, ≈ 5% of an 8-byte one-sided READ's
//! instructions on shm, `bench/instructions.sh`). A slot is reused only when nothing else holds it any more — a worker
//! still holding the sender of an operation the caller gave up on (its own deadline passed)
//! keeps that slot, and the thread's next operation takes a new one — and a thread that waits
//! inside another wait (an RPC handler run by the waiting thread's pass, calling out) takes a
//! slot of its own, since the outer wait holds the kept one.

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::thread::{self, LocalKey, Thread};

use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::channel::ChannelError;
use crate::rpc::RpcError;

use super::OneSidedDone;

/// Where the worker sends its answer.
pub(crate) enum ReplyTo<T> {
    /// An async caller's oneshot.
    Task(oneshot::Sender<T>),
    /// A blocking caller's slot.
    Thread(SlotSender<T>),
}

impl<T> ReplyTo<T> {
    /// Hand the answer over; back when the caller is gone (what it holds can be reused).
    pub(crate) fn send(self, value: T) -> Result<(), T> {
        match self {
            ReplyTo::Task(tx) => tx.send(value),
            ReplyTo::Thread(tx) => tx.send(value),
        }
    }
}

/// Nothing yet.
const EMPTY: u8 = 0;
/// The answer is in `value`.
const SET: u8 = 1;
/// The sender went without answering, or the caller stopped waiting.
const CLOSED: u8 = 2;

/// One answer, from the worker to a blocking caller.
pub(crate) struct Slot<T> {
    /// `EMPTY`, `SET` or `CLOSED`: read without the lock by a caller that polls; written under it.
    state: AtomicU8,
    inner: Mutex<SlotInner<T>>,
}

struct SlotInner<T> {
    value: Option<T>,
    /// A caller parked until the state changes.
    waiter: Option<Thread>,
}

impl<T> Slot<T> {
    fn new() -> Slot<T> {
        Slot {
            state: AtomicU8::new(EMPTY),
            inner: Mutex::new(SlotInner {
                value: None,
                waiter: None,
            }),
        }
    }

    /// Close the slot if nothing was set in it, and wake a parked caller.
    fn close(&self) {
        // Set once: seen set without the lock, it stays so (the drop after an answer).
        if self.state.load(Ordering::Relaxed) != EMPTY {
            return;
        }
        let waiter = {
            let mut g = self.inner.lock();
            if self.state.load(Ordering::Relaxed) != EMPTY {
                return;
            }
            self.state.store(CLOSED, Ordering::Release);
            g.waiter.take()
        };
        if let Some(t) = waiter {
            t.unpark();
        }
    }
}

/// The worker's end of a [`Slot`]: dropped without an answer, it closes the slot.
pub(crate) struct SlotSender<T>(Option<Arc<Slot<T>>>);

impl<T> SlotSender<T> {
    fn send(mut self, value: T) -> Result<(), T> {
        let Some(slot) = self.0.take() else {
            return Err(value);
        };
        let waiter = {
            let mut g = slot.inner.lock();
            if slot.state.load(Ordering::Relaxed) != EMPTY {
                // The caller stopped waiting.
                return Err(value);
            }
            g.value = Some(value);
            // Under the lock: a caller that registers as waiter after this sees it there.
            slot.state.store(SET, Ordering::Release);
            g.waiter.take()
        };
        if let Some(t) = waiter {
            t.unpark();
        }
        Ok(())
    }
}

impl<T> Drop for SlotSender<T> {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            slot.close();
        }
    }
}

/// Why [`SlotReceiver::try_recv`] has no answer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TryRecvError {
    /// Not yet.
    Empty,
    /// The sender went without one.
    Closed,
}

/// The blocking caller's end of a [`Slot`]. Dropped, it gives the slot back to its thread.
pub(crate) struct SlotReceiver<T: Cached> {
    slot: Option<Arc<Slot<T>>>,
}

impl<T: Cached> SlotReceiver<T> {
    /// The answer, if it came.
    pub(crate) fn try_recv(&mut self) -> Result<T, TryRecvError> {
        let slot = self.slot.as_ref().expect("slot held until drop");
        match slot.state.load(Ordering::Acquire) {
            EMPTY => Err(TryRecvError::Empty),
            // Taken once; a second look finds nothing, as a oneshot's would.
            SET => slot.inner.lock().value.take().ok_or(TryRecvError::Closed),
            _ => Err(TryRecvError::Closed),
        }
    }

    /// Park the thread until the answer comes or the sender goes.
    pub(crate) fn blocking_recv(mut self) -> Result<T, TryRecvError> {
        let slot = Arc::clone(self.slot.as_ref().expect("slot held until drop"));
        {
            let mut g = slot.inner.lock();
            if slot.state.load(Ordering::Relaxed) == EMPTY {
                g.waiter = Some(thread::current());
            }
        }
        while slot.state.load(Ordering::Acquire) == EMPTY {
            thread::park();
        }
        drop(slot);
        self.try_recv()
    }
}

impl<T: Cached> Drop for SlotReceiver<T> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            // Not waited on any more: a late answer goes back to the worker.
            slot.close();
            // A slot another wait put back meanwhile (a nested one) is dropped for this one;
            // while the thread's locals are torn down, this one is dropped.
            let _ = T::kept().try_with(|k| k.set(Some(slot)));
        }
    }
}

/// A type answered through slots: each keeps one slot per thread.
pub(crate) trait Cached: Sized + 'static {
    fn kept() -> &'static LocalKey<Cell<Option<Arc<Slot<Self>>>>>;
}

/// The two ends of a slot for one blocking operation: the thread's kept slot when nothing
/// else holds it, a new one otherwise.
pub(crate) fn slot<T: Cached>() -> (ReplyTo<T>, SlotReceiver<T>) {
    let kept = T::kept().try_with(Cell::take).ok().flatten();
    let slot = match kept {
        Some(mut s) => match Arc::get_mut(&mut s) {
            Some(unique) => {
                *unique.state.get_mut() = EMPTY;
                let inner = unique.inner.get_mut();
                inner.value = None;
                inner.waiter = None;
                s
            }
            None => Arc::new(Slot::new()),
        },
        None => Arc::new(Slot::new()),
    };
    let tx = SlotSender(Some(Arc::clone(&slot)));
    (ReplyTo::Thread(tx), SlotReceiver { slot: Some(slot) })
}

/// The result of a one-sided operation.
pub(crate) type OneSidedResult = Result<OneSidedDone, ChannelError>;
/// The result of an RPC call.
pub(crate) type CallResult = Result<Vec<u8>, RpcError>;

thread_local! {
    static ONE_SIDED: Cell<Option<Arc<Slot<OneSidedResult>>>> = const { Cell::new(None) };
    static CALL: Cell<Option<Arc<Slot<CallResult>>>> = const { Cell::new(None) };
}

impl Cached for OneSidedResult {
    fn kept() -> &'static LocalKey<Cell<Option<Arc<Slot<Self>>>>> {
        &ONE_SIDED
    }
}

impl Cached for CallResult {
    fn kept() -> &'static LocalKey<Cell<Option<Arc<Slot<Self>>>>> {
        &CALL
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ok(n: u8) -> CallResult {
        Ok(vec![n])
    }

    fn addr<T>(r: &SlotReceiver<T>) -> *const Slot<T>
    where
        T: Cached,
    {
        Arc::as_ptr(r.slot.as_ref().unwrap())
    }

    #[test]
    fn an_answer_is_taken_once_and_the_slot_is_reused() {
        let (tx, mut rx) = slot::<CallResult>();
        let first = addr(&rx);
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty);
        tx.send(ok(1)).unwrap();
        assert_eq!(rx.try_recv().unwrap().unwrap(), vec![1]);
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Closed);
        drop(rx);
        let (tx, mut rx) = slot::<CallResult>();
        assert_eq!(addr(&rx), first, "the thread's slot is used again");
        assert_eq!(
            rx.try_recv().unwrap_err(),
            TryRecvError::Empty,
            "and starts empty"
        );
        tx.send(ok(2)).unwrap();
        assert_eq!(rx.try_recv().unwrap().unwrap(), vec![2]);
    }

    #[test]
    fn a_sender_dropped_without_an_answer_closes_the_slot() {
        let (tx, mut rx) = slot::<CallResult>();
        drop(tx);
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Closed);
        let (tx, rx) = slot::<CallResult>();
        drop(tx);
        assert_eq!(rx.blocking_recv().unwrap_err(), TryRecvError::Closed);
    }

    #[test]
    fn a_slot_still_held_by_a_sender_is_not_reused() {
        // The caller gave up (its deadline), the worker still holds the sender.
        let (late, rx) = slot::<CallResult>();
        let abandoned = addr(&rx);
        drop(rx);
        let (tx, mut rx) = slot::<CallResult>();
        assert_ne!(addr(&rx), abandoned);
        // The late answer comes back to the worker, never to this operation.
        let back = late.send(ok(9)).expect_err("nobody waits for it");
        assert_eq!(back.unwrap(), vec![9]);
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty);
        tx.send(ok(3)).unwrap();
        assert_eq!(rx.try_recv().unwrap().unwrap(), vec![3]);
    }

    #[test]
    fn nested_waits_take_slots_of_their_own() {
        let (outer_tx, mut outer) = slot::<CallResult>();
        let (inner_tx, mut inner) = slot::<CallResult>();
        assert_ne!(addr(&outer), addr(&inner));
        inner_tx.send(ok(2)).unwrap();
        assert_eq!(inner.try_recv().unwrap().unwrap(), vec![2]);
        drop(inner);
        outer_tx.send(ok(1)).unwrap();
        assert_eq!(outer.try_recv().unwrap().unwrap(), vec![1]);
    }

    #[test]
    fn a_parked_caller_is_woken_by_an_answer_from_another_thread() {
        for i in 0..200u8 {
            let (tx, rx) = slot::<CallResult>();
            let t = std::thread::spawn(move || {
                if i % 2 == 0 {
                    std::thread::sleep(Duration::from_micros(50));
                }
                if i % 7 == 0 {
                    drop(tx);
                } else {
                    tx.send(ok(i)).unwrap();
                }
            });
            match rx.blocking_recv() {
                Ok(v) => assert_eq!(v.unwrap(), vec![i]),
                Err(e) => {
                    assert_eq!(i % 7, 0);
                    assert_eq!(e, TryRecvError::Closed);
                }
            }
            t.join().unwrap();
        }
    }

    #[test]
    fn an_async_caller_gets_its_answer_through_a_oneshot() {
        let (tx, rx) = oneshot::channel::<CallResult>();
        ReplyTo::Task(tx).send(ok(4)).unwrap();
        assert_eq!(rx.blocking_recv().unwrap().unwrap(), vec![4]);
    }
}
