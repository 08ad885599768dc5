//! [`Channel`]: the application's handle on one connection. Thread-safe and cheap to clone; every
//! operation is a hand-off to the worker that owns the connection (its inbox), and waiting is on
//! the channel's delivery queue or send window — there is no second engine. The async methods
//! are the same hand-offs awaited through `tokio::sync::Notify`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::channel::proto::TraceInfo;
use crate::channel::{ChannelError, ChannelStats, Thresholds};
use crate::endpoint::Endpoint;
use crate::message::Message;
use crate::remote::{RegionDescriptor, RemoteRegion};
use crate::worker::shared::ChannelShared;
use crate::worker::Command;

struct Inner {
    shared: Arc<ChannelShared>,
    endpoint: Endpoint,
    peer: SocketAddr,
    eager_max: u32,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shared.worker.submit(Command::Close {
            chan: self.shared.id,
        });
    }
}

/// A reliable, ordered, message-preserving connection. Closed when the last clone is dropped.
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
    ) -> Channel {
        Channel {
            inner: Arc::new(Inner {
                shared,
                endpoint,
                peer,
                eager_max,
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

    /// The eager threshold the channel started with.
    pub fn eager_max(&self) -> u32 {
        self.inner.eager_max
    }

    fn submit_send(&self, data: &[u8], trace: TraceInfo) {
        let s = &self.inner.shared;
        s.worker.submit(Command::Send {
            chan: s.id,
            data: data.to_vec(),
            trace,
        });
    }

    /// Send a message, waiting while the channel is back-pressured (no credit, queue full).
    pub fn send(&self, data: &[u8]) -> Result<(), ChannelError> {
        self.inner.shared.reserve(None)?;
        self.submit_send(data, TraceInfo::default());
        Ok(())
    }

    /// Send with a trace id carried in the message's trace header.
    pub fn send_traced(&self, data: &[u8], trace_id: u64) -> Result<(), ChannelError> {
        self.inner.shared.reserve(None)?;
        self.submit_send(
            data,
            TraceInfo {
                trace_id,
                flags: crate::channel::TraceFlags(crate::channel::TraceFlags::SAMPLED),
            },
        );
        Ok(())
    }

    /// Send, waiting at most `timeout` for room.
    pub fn send_timeout(&self, data: &[u8], timeout: Duration) -> Result<(), ChannelError> {
        self.inner.shared.reserve(Some(timeout))?;
        self.submit_send(data, TraceInfo::default());
        Ok(())
    }

    /// Send without waiting: [`ChannelError::WouldBlock`] when back-pressured.
    pub fn try_send(&self, data: &[u8]) -> Result<(), ChannelError> {
        self.inner.shared.try_reserve()?;
        self.submit_send(data, TraceInfo::default());
        Ok(())
    }

    /// Send from async code, awaiting room.
    pub async fn send_async(&self, data: &[u8]) -> Result<(), ChannelError> {
        let s = &self.inner.shared;
        loop {
            let notified = s.tx_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match s.try_reserve() {
                Ok(()) => break,
                Err(ChannelError::WouldBlock) => notified.await,
                Err(e) => return Err(e),
            }
        }
        self.submit_send(data, TraceInfo::default());
        Ok(())
    }

    fn released(&self) {
        let s = &self.inner.shared;
        if s.released.fetch_add(1, std::sync::atomic::Ordering::AcqRel) == 0 {
            s.worker.submit(Command::Released { chan: s.id });
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
        loop {
            let notified = s.rx_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(m) = s.try_take()? {
                self.released();
                return Ok(m);
            }
            notified.await;
        }
    }

    /// Change the eager threshold / READ chunk / READs in flight on the live channel.
    pub fn set_thresholds(&self, thresholds: Thresholds) {
        let s = &self.inner.shared;
        s.worker.submit(Command::SetThresholds {
            chan: s.id,
            thresholds,
        });
    }

    /// Protocol counters of this end (asks the worker).
    pub fn stats(&self) -> Result<ChannelStats, ChannelError> {
        let s = &self.inner.shared;
        let (tx, rx) = tokio::sync::oneshot::channel();
        s.worker.submit(Command::Stats {
            chan: s.id,
            reply: tx,
        });
        rx.blocking_recv().map_err(|_| ChannelError::Closed)
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
