//! Streams: many channels on one connection.
//!
//! A connection (one queue pair, its receive ring, one [`crate::channel::proto::ChannelCore`]
//! with its sequence numbers, acks and credits) lives on one worker and carries any number of
//! streams; each application [`crate::Channel`] is one stream. A stream is named on the wire by
//! the `stream` field of the message header, chosen by the side that connected, and opened and
//! closed by empty messages flagged `STREAM_OPEN` / `STREAM_CLOSE` that travel in order with the
//! stream's data (so an open always precedes the stream's first message and a close follows its
//! last). Stream 1 of a connection is opened by the handshake itself and is on the worker from
//! the connection's adoption, on both sides (the peer may send on it at once): the accepting
//! side hands it to `Listener::accept` from the handshake, so channels set up by handshakes are
//! accepted in the order their handshakes finished (data of different connections has no
//! order); the connecting side keeps it in the [`ConnHandle`] for the first channel opened.
//!
//! This module owns the identifiers and the hand-offs:
//! * [`StreamKey`]: a stream's id inside its worker, `(connection qpn << 32) | stream`;
//! * [`ConnHandle`]: the connecting side's share of a pooled connection. Every channel opened on
//!   the connection holds one `Arc` of it, the endpoint's [`crate::conn::ConnPool`] only a
//!   `Weak`; when the last channel lets go, its `Drop` asks the worker to close the connection
//!   (its QP goes back to the QP cache);
//! * [`Accepted`]: a stream the peer opened, on its way from the worker to `Listener::accept`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::shared::{ChannelShared, WorkerShared};
use super::{Command, Worker};
use crate::conn::HangupProbe;

/// The stream the handshake opens on every connection.
pub(crate) const FIRST_STREAM: u32 = 1;

/// A stream's id inside its worker: connection (QP number) in the high half, the wire stream id
/// in the low half.
pub(crate) type StreamKey = u64;

/// The key of `stream` on connection `conn`.
pub(crate) fn stream_key(conn: u32, stream: u32) -> StreamKey {
    (u64::from(conn) << 32) | u64::from(stream)
}

/// The connection (QP number) of a key.
pub(crate) fn key_conn(key: StreamKey) -> u32 {
    (key >> 32) as u32
}

/// The wire stream id of a key.
pub(crate) fn key_stream(key: StreamKey) -> u32 {
    key as u32
}

/// The connecting side's share of a connection; see the module header.
pub(crate) struct ConnHandle {
    pub(crate) worker: Arc<WorkerShared>,
    /// The connection's QP number (its id on the worker).
    pub(crate) conn: u32,
    /// The peer's listening address the connection was made to.
    pub(crate) peer: SocketAddr,
    /// Eager threshold the connection started with.
    pub(crate) eager_max: u32,
    /// The stream window both sides agreed on.
    pub(crate) stream_window: u32,
    next_stream: AtomicU32,
    first_taken: AtomicBool,
    /// The handshake's stream, registered on the worker at the adoption (so that what the
    /// peer sends on it before the first channel is opened is kept), until that channel takes it.
    first: Mutex<Option<Arc<ChannelShared>>>,
    /// Set by the worker when the connection failed: the pool must not hand it out again.
    pub(crate) failed: Arc<AtomicBool>,
    /// Set by the worker when the peer refused a stream on the connection (it keeps as many
    /// as it allows): the pool hands the connection out no more.
    refusing: Arc<AtomicBool>,
    /// Whether the peer ended the connection, before the worker reads it off the control
    /// stream (the worker looks at control streams only when its epoll says so, which a busy
    /// worker asks every 1024th idle pass): `None` where no probe could be made.
    hangup: Option<HangupProbe>,
}

impl ConnHandle {
    pub(crate) fn new(
        worker: Arc<WorkerShared>,
        conn: u32,
        peer: SocketAddr,
        eager_max: u32,
        stream_window: u32,
        failed: Arc<AtomicBool>,
        first: Option<Arc<ChannelShared>>,
    ) -> ConnHandle {
        ConnHandle {
            worker,
            conn,
            peer,
            eager_max,
            stream_window,
            next_stream: AtomicU32::new(FIRST_STREAM),
            first_taken: AtomicBool::new(false),
            first: Mutex::new(first),
            failed,
            refusing: Arc::new(AtomicBool::new(false)),
            hangup: None,
        }
    }

    /// The flag the worker sets when the peer refuses a stream of this connection.
    pub(crate) fn with_refusals(mut self, refusing: Arc<AtomicBool>) -> ConnHandle {
        self.refusing = refusing;
        self
    }

    /// True once the peer refused a stream of this connection: the pool must not hand it out
    /// for new channels (those it has go on).
    pub(crate) fn refuses_streams(&self) -> bool {
        self.refusing.load(Ordering::Acquire)
    }

    /// The probe [`ConnHandle::is_failed`] asks whether the peer ended the connection.
    pub(crate) fn with_hangup_probe(mut self, probe: Option<HangupProbe>) -> ConnHandle {
        self.hangup = probe;
        self
    }

    /// The handshake's stream, for the channel that drew [`FIRST_STREAM`].
    pub(crate) fn take_first(&self) -> Option<Arc<ChannelShared>> {
        self.first.lock().take()
    }

    /// A fresh stream id on this connection, and whether it is [`FIRST_STREAM`] (opened by the
    /// handshake; the others need a `STREAM_OPEN`). Ids 0 and 1 are never reused.
    pub(crate) fn next_stream(&self) -> (u32, bool) {
        loop {
            let s = self.next_stream.fetch_add(1, Ordering::Relaxed);
            if s == FIRST_STREAM && !self.first_taken.swap(true, Ordering::AcqRel) {
                return (s, true);
            }
            if s > FIRST_STREAM {
                return (s, false);
            }
        }
    }

    /// True when the connection failed (the worker said so) or its peer ended it (its `Close`
    /// or hang-up reached this host, read by the worker or not): the pool must not hand it out.
    /// Costs one non-blocking system call while the connection looks live.
    pub(crate) fn is_failed(&self) -> bool {
        if self.failed.load(Ordering::Acquire) {
            return true;
        }
        let ended = self.hangup.as_ref().is_some_and(HangupProbe::ended);
        if ended {
            // The worker fails the connection when it reads the stream; the pool's next look
            // need not ask the socket again.
            self.failed.store(true, Ordering::Release);
        }
        ended
    }
}

impl Drop for ConnHandle {
    fn drop(&mut self) {
        super::close_on_drop(
            &self.worker,
            self.conn,
            Worker::enqueue_close_conn,
            |conn| Command::CloseConn { conn },
        );
    }
}

/// Where a listener's accepted channels go: its queue, and the notification an async accept
/// waits on (`Listener::accept_async`). Every send notifies, and so does every clone's drop (the
/// last one gone is the queue's end, which a waiting accept must see).
#[derive(Clone)]
pub(crate) struct AcceptSender {
    /// `None` only while dropped: the sender goes before the notification, so that a woken
    /// accept finds the queue's end if this was the last sender.
    tx: Option<std::sync::mpsc::Sender<Accepted>>,
    notify: Arc<tokio::sync::Notify>,
}

impl AcceptSender {
    pub(crate) fn new(
        tx: std::sync::mpsc::Sender<Accepted>,
        notify: Arc<tokio::sync::Notify>,
    ) -> AcceptSender {
        AcceptSender {
            tx: Some(tx),
            notify,
        }
    }

    /// Queue `a` for the listener; back if the listener is gone.
    pub(crate) fn send(&self, a: Accepted) -> Result<(), Accepted> {
        let r = match &self.tx {
            Some(tx) => tx.send(a).map_err(|e| e.0),
            None => Err(a),
        };
        self.notify.notify_one();
        r
    }
}

impl Drop for AcceptSender {
    fn drop(&mut self) {
        drop(self.tx.take());
        self.notify.notify_one();
    }
}

/// A stream the peer opened on an accepted connection.
pub(crate) struct Accepted {
    shared: Option<Arc<ChannelShared>>,
    pub(crate) peer: SocketAddr,
    pub(crate) eager_max: u32,
}

impl Accepted {
    pub(crate) fn new(shared: Arc<ChannelShared>, peer: SocketAddr, eager_max: u32) -> Accepted {
        Accepted {
            shared: Some(shared),
            peer,
            eager_max,
        }
    }

    /// The stream, now owned by a `Channel`.
    pub(crate) fn take(mut self) -> Option<Arc<ChannelShared>> {
        self.shared.take()
    }
}

impl Drop for Accepted {
    fn drop(&mut self) {
        // Never taken (the listener is gone): the stream closes.
        if let Some(s) = self.shared.take() {
            s.worker.submit(Command::Close { chan: s.id });
        }
    }
}
