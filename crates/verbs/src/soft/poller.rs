//! The progress plumbing of a software provider's context: the epoll set, the eventfd that wakes
//! the progress thread, an optional timerfd for sub-millisecond deadlines, the word that says
//! until when the thread sleeps (so a poster wakes it only for an earlier deadline), and the
//! thread's loop.
//!
//! The provider keeps what is specific to its transport: which fds it watches under which
//! tokens, how long the thread may sleep, and what a ready fd means. The tokens
//! [`TOKEN_WAKE`] and [`TOKEN_TIMER`] are reserved here and never reach the provider.
//! Also [`set_rcvlowat`], how much input makes a stream socket ready, and what busy-mode
//! providers share: [`ProgressMode`] (who reads the sockets) and [`BusyGrace`] (whether a CQ
//! poller is reading them now).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use rustix::event::epoll;

use crate::{Result, VerbsError};

/// Token of the wake-up eventfd.
pub const TOKEN_WAKE: u64 = u64::MAX;
/// Token of the deadline timerfd.
pub const TOKEN_TIMER: u64 = u64::MAX - 1;

/// Who drives a software context's progress (device option `progress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// The context's progress thread alone (epoll); polling a CQ costs one atomic load when
    /// it is empty.
    Thread,
    /// Polling a CQ also reads the context's sockets and runs due timers, so a spinning poller
    /// sees completions without a thread wake-up. The thread remains as a fallback.
    Busy,
}

impl ProgressMode {
    /// The value of option `progress` of a `provider` device: `thread` or `busy`.
    pub fn parse(provider: &str, v: &str) -> Result<ProgressMode> {
        match v {
            "thread" => Ok(ProgressMode::Thread),
            "busy" => Ok(ProgressMode::Busy),
            _ => Err(VerbsError::InvalidArgument(format!(
                "{provider} option progress = {v:?}: expected \"thread\" or \"busy\""
            ))),
        }
    }
}

/// How long after its last poll a busy poller still counts as polling: while it does, the
/// progress thread leaves the sockets to it (and is not woken per datagram or message).
pub const BUSY_GRACE: Duration = Duration::from_millis(1);

/// Busy mode: when a CQ poller last drove the context (microseconds since `epoch`, 0: none
/// since it armed its CQ to sleep).
pub struct BusyGrace {
    epoch: Instant,
    last_drive_us: AtomicU64,
}

impl BusyGrace {
    /// No poller yet.
    pub fn new(epoch: Instant) -> BusyGrace {
        BusyGrace {
            epoch,
            last_drive_us: AtomicU64::new(0),
        }
    }

    #[inline]
    fn us(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_micros() as u64
    }

    /// A poller drove at `now` and keeps polling.
    #[inline]
    pub fn note(&self, now: Instant) {
        self.last_drive_us
            .store(self.us(now).max(1), Ordering::Relaxed);
    }

    /// True while a poller drove less than [`BUSY_GRACE`] ago.
    #[inline]
    pub fn active(&self, now: Instant) -> bool {
        let last = self.last_drive_us.load(Ordering::Relaxed);
        last != 0 && self.us(now).saturating_sub(last) < BUSY_GRACE.as_micros() as u64
    }

    /// The poller goes to sleep: its grace ends now. False if none was noted since the last end.
    #[inline]
    pub fn end(&self) -> bool {
        self.last_drive_us.swap(0, Ordering::Relaxed) != 0
    }
}

/// How the progress thread's sleep is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SleepTimer {
    /// epoll's own timeout (millisecond resolution).
    Epoll,
    /// A timerfd armed with the deadline (nanosecond resolution, for pacing timers).
    Timerfd,
}

/// The fds a progress thread waits on, shared by the context and its thread.
pub struct Poller {
    /// The device name, for errors and logs.
    device: &'static str,
    epoll: OwnedFd,
    wake: OwnedFd,
    timer: Option<OwnedFd>,
    stop: AtomicBool,
    /// Nanoseconds since `epoch` the thread sleeps until (`u64::MAX` while it computes its
    /// timeout, 0 while awake).
    sleep_until_ns: AtomicU64,
    epoch: Instant,
    /// Wake-ups written.
    wakes: AtomicU64,
}

impl Poller {
    /// An epoll set watching its wake-up eventfd (and a timerfd with [`SleepTimer::Timerfd`]).
    pub fn new(device: &'static str, sleep: SleepTimer) -> Result<Arc<Poller>> {
        let err = |what: &str| {
            let what = format!("{device}: {what}");
            move |e| VerbsError::io(what, e)
        };
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(err("epoll_create"))?;
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )
        .map_err(err("eventfd"))?;
        let timer = match sleep {
            SleepTimer::Epoll => None,
            SleepTimer::Timerfd => Some(
                rustix::time::timerfd_create(
                    rustix::time::TimerfdClockId::Monotonic,
                    rustix::time::TimerfdFlags::NONBLOCK | rustix::time::TimerfdFlags::CLOEXEC,
                )
                .map_err(err("timerfd_create"))?,
            ),
        };
        let poller = Poller {
            device,
            epoll,
            wake,
            timer,
            stop: AtomicBool::new(false),
            sleep_until_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            wakes: AtomicU64::new(0),
        };
        poller
            .add(&poller.wake, TOKEN_WAKE, epoll::EventFlags::IN)
            .map_err(err("epoll add"))?;
        if let Some(t) = &poller.timer {
            poller
                .add(t, TOKEN_TIMER, epoll::EventFlags::IN)
                .map_err(err("epoll add"))?;
        }
        Ok(Arc::new(poller))
    }

    /// Watch `fd`; its events come back under `token`.
    pub fn add(
        &self,
        fd: impl AsFd,
        token: u64,
        flags: epoll::EventFlags,
    ) -> rustix::io::Result<()> {
        epoll::add(&self.epoll, fd, epoll::EventData::new_u64(token), flags)
    }

    /// Change what `fd` is watched for (and re-arm a one-shot registration).
    pub fn modify(
        &self,
        fd: impl AsFd,
        token: u64,
        flags: epoll::EventFlags,
    ) -> rustix::io::Result<()> {
        epoll::modify(&self.epoll, fd, epoll::EventData::new_u64(token), flags)
    }

    /// Stop watching `fd` (errors ignored: the fd may be closed already).
    pub fn delete(&self, fd: impl AsFd) {
        let _ = epoll::delete(&self.epoll, fd);
    }

    /// When the poller started; [`Poller::nanos`] counts from here.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Nanoseconds from the epoch to `t` (0 before it).
    pub fn nanos(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Wake the progress thread.
    pub fn wake(&self) {
        self.wakes.fetch_add(1, Ordering::Relaxed);
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// Wake-ups written so far.
    pub fn wakes(&self) -> u64 {
        self.wakes.load(Ordering::Relaxed)
    }

    /// Make sure the thread wakes by `deadline`.
    pub fn note_deadline(&self, deadline: Option<Instant>) {
        let Some(d) = deadline else { return };
        if self.nanos(d) < self.sleep_until_ns.load(Ordering::Acquire) {
            self.wake();
        }
    }

    /// Ask the thread to end (it does at its next wake-up, which this causes).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake();
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Sleep until an fd is ready or `timeout` passes; `events` then holds the provider's
    /// events (wake-ups and timer expiries are consumed here).
    fn wait(&self, events: &mut Vec<epoll::Event>, timeout: Duration) -> rustix::io::Result<()> {
        let until = Instant::now() + timeout;
        self.sleep_until_ns
            .store(self.nanos(until), Ordering::Release);
        events.clear();
        match &self.timer {
            Some(timer) => {
                // A zero relative value would disarm the timer: 1 ns means "now".
                let timeout = timeout.max(Duration::from_nanos(1));
                let spec = rustix::time::Itimerspec {
                    it_interval: rustix::time::Timespec {
                        tv_sec: 0,
                        tv_nsec: 0,
                    },
                    it_value: timespec(timeout),
                };
                rustix::time::timerfd_settime(
                    timer,
                    rustix::time::TimerfdTimerFlags::empty(),
                    &spec,
                )?;
                epoll::wait(&self.epoll, rustix::buffer::spare_capacity(events), None)?;
            }
            None => {
                let ts = timespec(timeout);
                epoll::wait(
                    &self.epoll,
                    rustix::buffer::spare_capacity(events),
                    Some(&ts),
                )?;
            }
        }
        self.sleep_until_ns.store(0, Ordering::Release);
        events.retain(|ev| {
            let fd = match ev.data.u64() {
                TOKEN_WAKE => &self.wake,
                TOKEN_TIMER => match &self.timer {
                    Some(t) => t,
                    None => return true,
                },
                _ => return true,
            };
            let mut b = [0u8; 8];
            let _ = rustix::io::read(fd, &mut b);
            false
        });
        Ok(())
    }
}

fn timespec(d: Duration) -> rustix::time::Timespec {
    rustix::time::Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: i64::from(d.subsec_nanos()),
    }
}

/// Start the progress thread of a context. It holds only a `Weak` to the context, so dropping
/// the last handle ends it (the context's `Drop` calls [`Poller::stop`]). Each round:
/// `timeout(ctx, now)` says how long it may sleep, then `handle(ctx, events)` gets the ready
/// fds (possibly none, on a timeout), and should run due timers.
pub fn spawn_progress_thread<E, T, H>(
    name: String,
    ctx: Weak<E>,
    poller: Arc<Poller>,
    mut timeout: T,
    mut handle: H,
) -> Result<()>
where
    E: Send + Sync + 'static,
    T: FnMut(&E, Instant) -> Duration + Send + 'static,
    H: FnMut(&E, &[epoll::Event]) + Send + 'static,
{
    let device = poller.device;
    let run = move || {
        let mut events: Vec<epoll::Event> = Vec::with_capacity(256);
        loop {
            if poller.stopped() {
                return;
            }
            // While the timeout is being computed, a new deadline must wake us (see
            // `note_deadline`).
            poller.sleep_until_ns.store(u64::MAX, Ordering::Release);
            let t = {
                let Some(ctx) = ctx.upgrade() else {
                    return;
                };
                timeout(&ctx, Instant::now())
            };
            match poller.wait(&mut events, t) {
                Ok(()) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    tracing::warn!(device = poller.device, %e, "progress thread stops: wait failed");
                    return;
                }
            }
            if poller.stopped() {
                return;
            }
            let Some(ctx) = ctx.upgrade() else {
                return;
            };
            handle(&ctx, &events);
        }
    };
    std::thread::Builder::new()
        .name(name)
        .spawn(run)
        .map(|_| ())
        .map_err(|e| VerbsError::io(format!("{device}: spawn progress thread"), e))
}

/// Set `SO_RCVLOWAT` of a stream socket: readiness (and a blocking read) waits for `bytes`.
pub fn set_rcvlowat(fd: std::os::fd::BorrowedFd<'_>, bytes: usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: `v` is a live c_int for the duration of the call and its size is passed; the fd
    // is borrowed, so open.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
