//! The atomics the shared-memory rings are built on: `std`'s normally, loom's under
//! `cfg(loom)`, so the ring algorithm in `ring` is model-checked unchanged
//! (`RUSTFLAGS="--cfg loom" cargo test -p fabriq-verbs --lib ring`).
//!
//! Only `ring` uses this shim; the rest of the provider works on `std` atomics that live in
//! mapped segments (a loom atomic cannot live in memory another process maps).
#![allow(unexpected_cfgs)]

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

/// Interior-mutable storage of one ring slot's payload (loom's `UnsafeCell` API on `std`).
#[cfg(not(loom))]
#[derive(Debug, Default)]
#[repr(transparent)]
pub(crate) struct DataCell<T>(core::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> DataCell<T> {
    /// A cell holding `v`.
    #[allow(dead_code)]
    pub(crate) fn new(v: T) -> Self {
        DataCell(core::cell::UnsafeCell::new(v))
    }
    /// Run `f` with a read pointer to the payload.
    #[inline]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }
    /// Run `f` with a write pointer to the payload.
    #[inline]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell as DataCell;

/// Back off inside a bounded wait (a spin hint; loom needs a yield to make progress).
#[inline]
pub(crate) fn backoff(spins: u32) {
    #[cfg(loom)]
    {
        let _ = spins;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    {
        if spins % 64 == 63 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}
