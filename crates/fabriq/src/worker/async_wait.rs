//! Async waits of application tasks — `Channel::recv_async`, a send's room in `send_async`,
//! `Rpc::call_async`, `RemoteRegion`'s `_async` operations: the hybrid polling of the blocking
//! waits, for a task.
//!
//! In caller mode the application's threads move the worker, its tasks included: a task first
//! looks for what it waits for during the worker's idle budget (`Config::idle_spin_us`),
//! running a progress pass at each look as a blocking wait does and handing its runtime
//! thread back between looks (`tokio::task::yield_now`), so what comes within microseconds
//! costs no wake-up. Then it sleeps on its notification, counted as an async sleeper
//! ([`AsyncSleep`]), and the worker's back-stop thread moves the worker for it, asleep in the
//! worker's epoll, instead of standing aside while application threads call in. Before,
//! nothing moved the worker for a sleeping task until the back-stop's grace (10 ms) had passed
//! since the last call of any thread, a send's included: an async ping-pong took 10 ms a round
//! trip.
//!
//! In thread mode the worker thread polls and its delivery wakes the task through the runtime;
//! a task does not spin there (on a host with fewer CPUs than polling threads, spinning tasks
//! took the worker threads' CPU: an async ping-pong between two endpoints of one process on two
//! CPUs went from 36–50 to 51–130 µs a round trip).

use std::time::Instant;

use tokio::sync::oneshot;

use super::shared::WorkerShared;

/// The answer of an operation handed to the worker (`Rpc::call_async`, a one-sided `_async`):
/// looked for during the idle budget, then awaited; `None` when the worker dropped the sender.
pub(crate) async fn answer<T>(w: &WorkerShared, mut rx: oneshot::Receiver<T>) -> Option<T> {
    use oneshot::error::TryRecvError;
    let got = spin(w, || match rx.try_recv() {
        Ok(v) => Some(Some(v)),
        Err(TryRecvError::Empty) => None,
        Err(TryRecvError::Closed) => Some(None),
    })
    .await;
    if let Some(v) = got {
        return v;
    }
    let _asleep = AsyncSleep::new(w);
    rx.await.ok()
}

/// Caller mode: look for `ready` during the worker's idle budget, progressing the worker and
/// yielding to the runtime after each look; what it produced, or `None` once the budget is
/// spent (a pass that did work starts it again). Thread mode: one look.
pub(crate) async fn spin<T>(w: &WorkerShared, mut ready: impl FnMut() -> Option<T>) -> Option<T> {
    if !w.is_caller_mode() {
        return ready();
    }
    let budget = w.idle_spin();
    // Where the process has one CPU, what the task waits for (the peer, the provider's
    // threads) runs only when this thread steps aside; the runtime would poll it again at once.
    let one_cpu = w.one_cpu();
    let mut since = Instant::now();
    loop {
        if let Some(v) = ready() {
            return Some(v);
        }
        // Counted as an application call: the back-stop stays out while the task moves the
        // worker itself (a blocking wait holds the spinner role for the same end).
        w.enter_caller();
        if w.try_progress().is_some_and(|n| n > 0) {
            since = Instant::now();
            if let Some(v) = ready() {
                return Some(v);
            }
        } else if since.elapsed() >= budget {
            return None;
        }
        // Every look ends with a yield, work or not: the runtime's other tasks (those this
        // pass delivered to, among them) run between looks.
        if one_cpu {
            std::thread::yield_now();
        }
        tokio::task::yield_now().await;
    }
}

/// A task asleep on its notification (see the module's text): counted while it lives; the
/// count's first makes a caller-mode worker's back-stop take over the progress.
pub(crate) struct AsyncSleep<'a> {
    w: &'a WorkerShared,
}

impl<'a> AsyncSleep<'a> {
    pub(crate) fn new(w: &'a WorkerShared) -> AsyncSleep<'a> {
        w.async_sleep_begin();
        AsyncSleep { w }
    }
}

impl Drop for AsyncSleep<'_> {
    fn drop(&mut self) {
        self.w.async_sleep_end();
    }
}
