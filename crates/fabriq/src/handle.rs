//! [`Channel`]: the application's handle on one stream of a connection (see
//! `worker::streams`). Thread-safe and cheap to clone.
//! A send is posted directly by the calling thread under the worker's lock (always in caller
//! mode; in thread mode when the worker thread does not hold it), else handed to the worker's
//! inbox; waiting (delivery queue, send window) goes through the worker's wait loop, which
//! progresses the worker from the waiting thread — there is no second engine. Zero-copy sends
//! take a registered buffer with [`Channel::alloc`] and give it back with
//! [`Channel::send_buf`]. The async methods await `tokio::sync::Notify`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::channel::outbuf::OutBuf;
use crate::channel::proto::TraceInfo;
use crate::channel::{ChannelError, ChannelStats, Thresholds};
use crate::endpoint::Endpoint;
use crate::message::{Message, SendBuf};
use crate::remote::{RegionDescriptor, RemoteRegion};
use crate::worker::async_wait::{self, AsyncSleep};
use crate::worker::shared::ChannelShared;
use crate::worker::streams::ConnHandle;
use crate::worker::{alloc_filled, close_on_drop, submit_on_stream, Command, Worker};

struct Inner {
    shared: Arc<ChannelShared>,
    peer: SocketAddr,
    eager_max: u32,
    /// Connecting side: this channel's share of the pooled connection (dropped after the
    /// stream's `Close`, so a last channel closes the connection behind its stream).
    _conn: Option<Arc<ConnHandle>>,
    /// Dropped last (fields drop in order): when this is the endpoint's last handle, its
    /// workers are told to stop only after the connection's close, so they deliver what the
    /// channel sent before stopping.
    endpoint: Endpoint,
}

impl Drop for Inner {
    fn drop(&mut self) {
        close_on_drop(
            &self.shared.worker,
            self.shared.id,
            Worker::enqueue_close,
            |chan| Command::Close { chan },
        );
    }
}

/// Counts an async sender waiting for room while it lives (also when its future is dropped).
struct AsyncWaiter<'a>(&'a AtomicUsize);

impl Drop for AsyncWaiter<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A reliable, ordered, message-preserving channel: one stream of a connection that every
/// channel between the same two endpoints (and worker) shares. Closed when the last clone is
/// dropped; the peer's handle then reports [`ChannelError::PeerGone`] once it has read what
/// was delivered.
#[derive(Clone)]
pub struct Channel {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("id", &self.inner.shared.id)
            .field("peer", &self.inner.peer)
            .finish()
    }
}

impl Channel {
    pub(crate) fn new(
        shared: Arc<ChannelShared>,
        endpoint: Endpoint,
        peer: SocketAddr,
        eager_max: u32,
        conn: Option<Arc<ConnHandle>>,
    ) -> Channel {
        Channel {
            inner: Arc::new(Inner {
                shared,
                endpoint,
                peer,
                eager_max,
                _conn: conn,
            }),
        }
    }

    pub(crate) fn shared(&self) -> &Arc<ChannelShared> {
        &self.inner.shared
    }

    /// The endpoint this channel belongs to.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    /// The peer's control address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.inner.peer
    }

    /// The device this channel's connection runs on (with `auto`: `shm0` for a peer on this
    /// host, `tcp0` for the others).
    pub fn device(&self) -> &str {
        self.inner.endpoint.device_of(&self.inner.shared.worker)
    }

    /// The protection domain of this channel's device (which registration of an
    /// [`crate::ExposedRegion`] its peer needs).
    pub(crate) fn domain(&self) -> Option<usize> {
        self.inner.shared.worker.buffers().map(|b| b.domain())
    }

    /// The eager threshold the channel started with.
    pub fn eager_max(&self) -> u32 {
        self.inner.eager_max
    }

    /// The stream window the channel's connection uses: the smaller of the two ends'
    /// [`crate::Config::stream_window`], in window units (a message counts one per MiB it
    /// started, half the window at most). Past it unread at the peer, sends wait. An
    /// application that sends several messages before it reads the answers keeps within half
    /// of it, or both ends may wait for the other to read.
    pub fn stream_window(&self) -> u32 {
        u32::try_from(self.inner.shared.stream_window()).unwrap_or(u32::MAX)
    }

    /// Post `buf` now under the worker's lock, or queue it in the worker's inbox. The send
    /// window slot is already reserved.
    fn submit_buf(&self, buf: OutBuf, trace: TraceInfo) {
        submit_on_stream(&self.inner.shared, buf, trace);
    }

    /// Copy `data` into a registered buffer and submit it (the window slot is reserved).
    fn submit_send(&self, data: &[u8], trace: TraceInfo) -> Result<(), ChannelError> {
        let s = &self.inner.shared;
        let filled = match s.worker.buffers() {
            Some(b) => alloc_filled(b, &[data]).map_err(ChannelError::Pool),
            None => Err(ChannelError::Closed),
        };
        match filled {
            Ok(buf) => {
                self.submit_buf(buf, trace);
                Ok(())
            }
            Err(e) => {
                s.cancel_reservation(data.len() as u64);
                Err(e)
            }
        }
    }

    /// Send a message, waiting while the channel is back-pressured (no credit, queue full).
    pub fn send(&self, data: &[u8]) -> Result<(), ChannelError> {
        self.inner.shared.reserve(data.len(), None)?;
        self.submit_send(data, TraceInfo::default())
    }

    /// Send with a trace id carried in the message's trace header.
    pub fn send_traced(&self, data: &[u8], trace_id: u64) -> Result<(), ChannelError> {
        self.inner.shared.reserve(data.len(), None)?;
        self.submit_send(
            data,
            TraceInfo {
                trace_id,
                flags: crate::channel::TraceFlags(crate::channel::TraceFlags::SAMPLED),
                stream: 0,
                stream_credits: 0,
            },
        )
    }

    /// Send, waiting at most `timeout` for room.
    pub fn send_timeout(&self, data: &[u8], timeout: Duration) -> Result<(), ChannelError> {
        self.inner.shared.reserve(data.len(), Some(timeout))?;
        self.submit_send(data, TraceInfo::default())
    }

    /// Send without waiting: [`ChannelError::WouldBlock`] when back-pressured.
    pub fn try_send(&self, data: &[u8]) -> Result<(), ChannelError> {
        self.inner.shared.try_reserve(data.len())?;
        self.submit_send(data, TraceInfo::default())
    }

    /// Send from async code, awaiting room.
    pub async fn send_async(&self, data: &[u8]) -> Result<(), ChannelError> {
        self.reserve_async(data.len()).await?;
        self.submit_send(data, TraceInfo::default())
    }

    async fn reserve_async(&self, len: usize) -> Result<(), ChannelError> {
        let s = &self.inner.shared;
        let room = || match s.try_reserve(len) {
            Err(ChannelError::WouldBlock) => None,
            r => Some(r),
        };
        if let Some(r) = async_wait::spin(&s.worker, room).await {
            return r;
        }
        s.tx_async_waiters.fetch_add(1, Ordering::SeqCst);
        let _waiting = AsyncWaiter(&s.tx_async_waiters);
        let _asleep = AsyncSleep::new(&s.worker);
        loop {
            let notified = s.tx_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match s.try_reserve(len) {
                Ok(()) => return Ok(()),
                Err(ChannelError::WouldBlock) => {
                    // Caller mode: move the worker along before waiting.
                    if s.worker.try_progress().is_some_and(|n| n > 0) {
                        continue;
                    }
                    notified.await
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A registered buffer of `len` bytes to fill and pass to [`Channel::send_buf`]: from the
    /// worker's pool up to the largest size class, above it a large buffer the worker caches
    /// and reuses. Usable on any channel of the same endpoint.
    pub fn alloc(&self, len: usize) -> Result<SendBuf, ChannelError> {
        let w = &self.inner.shared.worker;
        let buffers = w.buffers().ok_or(ChannelError::Closed)?;
        let mut buf = buffers.alloc(len.max(1))?;
        buf.set_len(len);
        Ok(SendBuf {
            buf,
            domain: buffers.domain(),
        })
    }

    fn check_domain(&self, buf: &SendBuf) -> Result<(), ChannelError> {
        let w = &self.inner.shared.worker;
        match w.buffers() {
            Some(b) if b.domain() == buf.domain => Ok(()),
            _ => Err(ChannelError::NotRegistered),
        }
    }

    /// Send a buffer from [`Channel::alloc`] without copying it, waiting while back-pressured.
    /// [`ChannelError::NotRegistered`] for a buffer of another endpoint.
    pub fn send_buf(&self, buf: SendBuf) -> Result<(), ChannelError> {
        self.check_domain(&buf)?;
        self.inner.shared.reserve(buf.len(), None)?;
        self.submit_buf(OutBuf::Pool(buf.buf), TraceInfo::default());
        Ok(())
    }

    /// [`Channel::send_buf`], waiting at most `timeout` for room.
    pub fn send_buf_timeout(&self, buf: SendBuf, timeout: Duration) -> Result<(), ChannelError> {
        self.check_domain(&buf)?;
        self.inner.shared.reserve(buf.len(), Some(timeout))?;
        self.submit_buf(OutBuf::Pool(buf.buf), TraceInfo::default());
        Ok(())
    }

    /// [`Channel::send_buf`] from async code.
    pub async fn send_buf_async(&self, buf: SendBuf) -> Result<(), ChannelError> {
        self.check_domain(&buf)?;
        self.reserve_async(buf.len()).await?;
        self.submit_buf(OutBuf::Pool(buf.buf), TraceInfo::default());
        Ok(())
    }

    /// The application consumed a message: the peer's stream window may open. The count (the
    /// delivery queue's count of reads) rides on the stream's next message (the worker takes
    /// it when it sends one); only once a report's worth (a quarter of the stream window) has
    /// built up untaken is the worker told, at once when its lock is free, else through the
    /// inbox, so that a lone `STREAM_CREDIT` goes out for a reader that does not send. (The
    /// slot's connection credit went back at delivery.)
    fn released(&self) {
        let s = &self.inner.shared;
        if s.report_due() {
            match s.worker.try_lock_state() {
                Some(mut g) => {
                    g.release_now(s.id);
                    drop(g);
                    s.worker.notify_parked();
                }
                None => s.worker.submit(Command::Released { chan: s.id }),
            }
        }
    }

    /// Receive the next message, waiting for it.
    pub fn recv(&self) -> Result<Message, ChannelError> {
        let m = self.inner.shared.take(None)?;
        self.released();
        Ok(m)
    }

    /// Receive, waiting at most `timeout` ([`ChannelError::Timeout`]).
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Message, ChannelError> {
        let m = self.inner.shared.take(Some(timeout))?;
        self.released();
        Ok(m)
    }

    /// Receive if a message is there.
    pub fn try_recv(&self) -> Result<Option<Message>, ChannelError> {
        let m = self.inner.shared.try_take()?;
        if m.is_some() {
            self.released();
        }
        Ok(m)
    }

    /// Receive from async code.
    pub async fn recv_async(&self) -> Result<Message, ChannelError> {
        let s = &self.inner.shared;
        // Hybrid, as a blocking wait: look for the idle budget, then sleep (`async_wait`).
        if let Some(r) = async_wait::spin(&s.worker, || s.try_take().transpose()).await {
            let m = r?;
            self.released();
            return Ok(m);
        }
        s.rx_async_waiters.fetch_add(1, Ordering::SeqCst);
        let _waiting = AsyncWaiter(&s.rx_async_waiters);
        let _asleep = AsyncSleep::new(&s.worker);
        loop {
            let notified = s.rx_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Pairs with `ChannelShared::deliver`: counted before looking at the queue, and
            // the look takes the queue's lock.
            if let Some(m) = s.try_take_locked()? {
                self.released();
                return Ok(m);
            }
            // Caller mode: move the worker along before waiting.
            if s.worker.try_progress().is_some_and(|n| n > 0) {
                continue;
            }
            notified.await;
        }
    }

    /// Change the eager threshold / READ chunk / READs in flight on the live channel (on the
    /// connection it shares with the other channels to the same peer).
    pub fn set_thresholds(&self, thresholds: Thresholds) {
        let s = &self.inner.shared;
        s.worker.submit(Command::SetThresholds {
            chan: s.id,
            thresholds,
        });
    }

    /// Protocol counters of this end of the connection carrying the channel (shared with the
    /// other channels on it). [`ChannelError::WouldBlock`] when called from an RPC handler
    /// running on this channel's worker.
    pub fn stats(&self) -> Result<ChannelStats, ChannelError> {
        let s = &self.inner.shared;
        s.worker.enter_caller();
        let g = s.worker.lock_state().ok_or(ChannelError::WouldBlock)?;
        g.stats(s.id).ok_or(ChannelError::Closed)
    }

    /// One-sided access to a region the peer exposed.
    pub fn remote_region(&self, descriptor: RegionDescriptor) -> RemoteRegion {
        RemoteRegion::new(self.clone(), descriptor)
    }

    /// True once the channel failed or was closed.
    pub fn is_closed(&self) -> bool {
        self.inner.shared.is_failed()
    }
}
