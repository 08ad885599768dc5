//! Completion queues (`ibv_cq`): where finished work requests are reported.
//!
//! Two ways to consume: busy-poll with [`CompletionQueue::poll`], or arm with
//! [`CompletionQueue::req_notify`] and sleep until the [`CompletionQueue::event_fd`] becomes
//! readable (epoll, tokio `AsyncFd`), then [`CompletionQueue::ack_events`] and poll again — the
//! `ibv_req_notify_cq` / `ibv_get_cq_event` cycle. Overflow is never silent: once more completions
//! arrive than the CQ holds, `poll` returns [`crate::VerbsError::CqOverflow`].

use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

use crate::provider::CqOps;
use crate::{Result, WorkCompletion};

/// A completion queue. Cheap to clone; clones are the same queue.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) ops: Arc<dyn CqOps>,
    /// Created on a thread with one CPU to run on (see [`CompletionQueue::one_cpu`]).
    one_cpu: bool,
}

/// Whether the calling thread may run on one CPU only (its affinity, within the cgroup's
/// quota): every thread it spawns shares that CPU, and a peer of the same process runs only
/// when it steps aside. What [`CompletionQueue::one_cpu`] records at creation.
pub fn one_cpu_here() -> bool {
    std::thread::available_parallelism().map_or(1, |n| n.get()) <= 1
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("capacity", &self.ops.capacity())
            .finish()
    }
}

impl CompletionQueue {
    /// Wrap a provider's CQ. For provider implementations.
    pub fn from_ops(ops: Arc<dyn CqOps>) -> Self {
        CompletionQueue {
            ops,
            one_cpu: one_cpu_here(),
        }
    }

    /// True when the queue was created on a thread with one CPU to run on (a `taskset -c N`,
    /// a container's cpuset of one): every thread that thread spawns shares it, and
    /// [`CompletionQueue::poll_blocking`] steps aside at every empty poll — what it waits for
    /// comes from a thread (the peer's, a provider's progress thread) that runs only when
    /// this one does.
    pub fn one_cpu(&self) -> bool {
        self.one_cpu
    }

    /// Provider-side object, for downcasting inside a provider.
    pub fn ops(&self) -> &Arc<dyn CqOps> {
        &self.ops
    }

    /// Number of completions the queue holds.
    pub fn capacity(&self) -> u32 {
        self.ops.capacity()
    }

    /// Move up to `wc.len()` completions into `wc`; returns how many (`ibv_poll_cq`). Never
    /// blocks. Also drives the provider's progress where it has no thread of its own.
    #[inline]
    pub fn poll(&self, wc: &mut [WorkCompletion]) -> Result<usize> {
        self.ops.poll(wc)
    }

    /// False only when [`CompletionQueue::poll`] would certainly find nothing now: a look
    /// without taking anything (two loads on `shm`), for a busy poller that wants to skip the
    /// rest of its loop body while idle. Providers that cannot tell answer true.
    pub fn may_have_completions(&self) -> bool {
        self.ops.may_have_completions()
    }

    /// Arm the queue: the next completion (or next solicited one) makes the event fd readable.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        self.ops.req_notify(solicited_only)
    }

    /// The fd that becomes readable when an armed queue gets a completion, if the provider has
    /// one (see [`crate::Capabilities::CQ_EVENTS`]).
    pub fn event_fd(&self) -> Option<BorrowedFd<'_>> {
        self.ops.event_fd()
    }

    /// Consume pending events (`ibv_get_cq_event` + `ibv_ack_cq_events`); returns how many
    /// arrived. Non-blocking.
    pub fn ack_events(&self) -> Result<u32> {
        self.ops.ack_events()
    }

    /// Block until the event fd is readable or `timeout` passes; true if an event arrived. The
    /// queue must have been armed.
    pub fn wait_event(&self, timeout: Option<Duration>) -> Result<bool> {
        self.ops.wait_event(timeout)
    }

    /// Poll until at least one completion arrives or `timeout` passes, arming and sleeping
    /// between polls when the provider supports events (after 2 048 empty polls, yielding the
    /// CPU every 256th — every one where the queue was created with one CPU,
    /// [`CompletionQueue::one_cpu`]). Returns the number polled (0 on timeout).
    pub fn poll_blocking(&self, wc: &mut [WorkCompletion], timeout: Duration) -> Result<usize> {
        let deadline = std::time::Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            let n = self.poll(wc)?;
            if n > 0 {
                return Ok(n);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Ok(0);
            }
            spins += 1;
            if spins < 2048 || self.event_fd().is_none() {
                if self.one_cpu || spins % 256 == 0 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            self.req_notify(false)?;
            // Re-poll after arming: a completion that raced the arm is not missed.
            let n = self.poll(wc)?;
            if n > 0 {
                return Ok(n);
            }
            self.wait_event(Some(deadline - now))?;
            self.ack_events()?;
        }
    }
}
