//! What a finished handshake hands to the connection that runs on it, and takes back when that
//! connection ends: the TCP control stream ([`ControlStream`]) and the QP ([`QpLease`]).
//!
//! **Control stream.** While the connection lives, the stream is its liveness signal: the
//! owner polls it (non-blocking) and [`ControlStream::poll_peer`] says whether the peer is still
//! there, closed its end of the connection (a [`Message::Close`] frame), or vanished (EOF,
//! reset, garbage). When the owner drops it, the stream tells the peer (a `Close` frame, unless
//! the peer closed first) and goes back where it came from — the client manager's idle set or
//! the server's [`super::Listener`] — ready for the next handshake, so a reconnect skips the TCP
//! handshake. On the accepting side the peer's `Ready` may still come on the live stream (see
//! [`super::PendingConn::finish_accepting`]); [`ControlStream::take_ready`] tells it. Frames are read exactly (prefix, then body), never past the `Close`: a hello the
//! peer sends right after it stays in the socket for the listener.
//!
//! The owner reads the stream when it gets round to it; a thread that must know *now* whether
//! the peer ended the connection (the connection pool, before it hands a connection out again)
//! asks a [`HangupProbe`] (connecting side): on that side nothing but the end of the
//! connection ever arrives, so any byte or EOF waiting in the socket means it is over.
//!
//! **QP lease.** The QP goes back to its manager's cache only once no completion of it can
//! still surface: [`QpLease::drain`] moves it to ERROR, posts one marker on each work queue, and
//! polls the owner's CQ until both markers come back flushed (completions of a queue arrive in
//! order, so every earlier request has completed by then); [`QpLease::release`] then resets it
//! into the cache. Completions of other QPs polled meanwhile are handed back to the caller.
//!
//! Not here: the handshake itself (`manager`), framing (`wire`).

use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabriq_verbs::{
    CompletionQueue, MemoryRegion, QpAttr, QpState, QueuePair, RecvWr, SendFlags, SendWr,
    WorkCompletion, WrOpcode,
};
use parking_lot::Mutex;

use super::handshake::send_all;
use super::manager::{ConnManager, ListenerHome};
use super::stream::Stream;
use super::wire::{self, Message, MAX_FRAME_LEN};

/// What [`ControlStream::poll_peer`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlEvent {
    /// Nothing new: the peer is there.
    Open,
    /// The peer closed its end of the connection; the stream is clean and will be reused.
    PeerClosed,
    /// The peer is gone (EOF, reset, or bytes that are not a `Close`).
    Gone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    PeerClosed,
    Broken,
}

/// Where the stream goes back to.
pub(super) enum Home {
    /// Client side: the manager's idle set for this peer address.
    Client(ConnManager),
    /// Server side: the listener that accepted it (if any, and if reuse is on).
    Server(Option<Arc<ListenerHome>>),
}

/// The control stream of an established connection: its `Close` or hang-up ends the connection,
/// its drop says `Close` and gives the stream back for reuse.
pub struct ControlStream {
    /// Shared with the connection's hang-up probes (no duplicate descriptor: a probe holds a
    /// clone only while the connection lives, see `probe`).
    stream: Option<Arc<Stream>>,
    /// False while an owner switched the stream to blocking mode (control streams are
    /// non-blocking otherwise; a stream given back for reuse is non-blocking again).
    nonblocking: AtomicBool,
    peer_addr: SocketAddr,
    home: Home,
    reuse: bool,
    state: State,
    /// Bytes of a frame read so far: `rx.len() < 4 + body length`.
    rx: Vec<u8>,
    /// The peer's `Ready` (the last step of its handshake) arrived on this stream and was not
    /// taken yet: accepting side, see [`super::PendingConn::finish_accepting`].
    ready: bool,
    /// This side's `Ready` is still to be written: connecting side, see
    /// [`super::PendingConn::finish_connecting`].
    ready_owed: bool,
    /// The peer's [`Message::Nudge`] arrived and was not taken yet (accepting side).
    nudged: bool,
    /// The probes' share of the socket, withdrawn when the connection ends here, so a probe
    /// never keeps the socket open nor looks at a later connection's handshake on it.
    probe: Option<Arc<Mutex<Option<Arc<Stream>>>>>,
}

impl std::fmt::Debug for ControlStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlStream")
            .field("peer_addr", &self.peer_addr)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl ControlStream {
    pub(super) fn new(
        stream: Stream,
        peer_addr: SocketAddr,
        home: Home,
        reuse: bool,
    ) -> ControlStream {
        ControlStream {
            stream: Some(Arc::new(stream)),
            nonblocking: AtomicBool::new(true),
            peer_addr,
            home,
            reuse,
            state: State::Open,
            rx: Vec::new(),
            ready: false,
            ready_owed: false,
            nudged: false,
            probe: None,
        }
    }

    /// A probe that tells from any thread, without reading, whether the peer has ended the
    /// connection on this stream. Connecting side only: `None` on the accepting side (the
    /// peer's `Ready` may still be in the socket there, which a look without reading cannot
    /// tell from a `Close`).
    pub fn hangup_probe(&mut self) -> Option<HangupProbe> {
        if !matches!(self.home, Home::Client(_)) {
            return None;
        }
        if let Some(shared) = &self.probe {
            return Some(HangupProbe {
                stream: Arc::clone(shared),
            });
        }
        let shared = Arc::new(Mutex::new(Some(Arc::clone(self.stream.as_ref()?))));
        self.probe = Some(Arc::clone(&shared));
        Some(HangupProbe { stream: shared })
    }

    pub(super) fn owe_ready(&mut self, owed: bool) {
        self.ready_owed = owed;
    }

    /// Write this side's `Ready` if it is owed ([`super::PendingConn::finish_connecting`]):
    /// one non-blocking write. False when it could not be written (the peer is gone: the
    /// stream is broken and [`ControlStream::poll_peer`] says `Gone`); true otherwise,
    /// including when nothing was owed.
    pub fn send_ready(&mut self) -> bool {
        if !std::mem::take(&mut self.ready_owed) {
            return true;
        }
        let Some(stream) = self.stream.as_deref() else {
            return false;
        };
        let frame = wire::encode(&Message::Ready);
        let deadline = Instant::now() + Duration::from_millis(200);
        if send_all(stream, &frame, deadline).is_err() {
            self.state = State::Broken;
            return false;
        }
        true
    }

    /// True once after the peer's `Ready` was read by [`ControlStream::poll_peer`].
    pub fn take_ready(&mut self) -> bool {
        std::mem::take(&mut self.ready)
    }

    /// Connecting side, while the connection lingers in its close: ask the peer to progress
    /// the connection now ([`Message::Nudge`]; one non-blocking write, best effort). Nothing is
    /// written on the accepting side (the connecting side takes any byte on its stream for the
    /// end of the connection: [`HangupProbe`]), nor while this side's `Ready` is owed (the
    /// peer must read that first). False when nothing was written.
    pub fn nudge(&mut self) -> bool {
        if !matches!(self.home, Home::Client(_)) || self.ready_owed || self.state != State::Open {
            return false;
        }
        let Some(stream) = self.stream.as_deref() else {
            return false;
        };
        let frame = wire::encode(&Message::Nudge);
        // A full socket buffer means the peer reads nothing anyway: no nudge this time. A
        // frame begun is finished (a part of one would break the stream).
        let sent = match (&*stream).write(&frame) {
            Ok(n) => n,
            Err(_) => return false,
        };
        if sent == frame.len() {
            return true;
        }
        if sent == 0 {
            return false;
        }
        let rest = frame.get(sent..).unwrap_or_default();
        if send_all(stream, rest, Instant::now() + Duration::from_millis(200)).is_err() {
            self.state = State::Broken;
            return false;
        }
        true
    }

    /// True once after the peer's `Nudge` was read by [`ControlStream::poll_peer`].
    pub fn take_nudge(&mut self) -> bool {
        std::mem::take(&mut self.nudged)
    }

    /// True for a stream on a local (Unix) socket: a peer of this host reached after the
    /// first connect (see `conn::stream`).
    pub fn is_local(&self) -> bool {
        self.stream.as_deref().is_some_and(Stream::is_local)
    }

    /// The peer's control address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// Switch the stream to non-blocking mode (for an owner that polls it with epoll), or
    /// back. Control streams are non-blocking from the start, so switching it on costs
    /// nothing unless an owner switched it off before.
    pub fn set_nonblocking(&self, on: bool) -> std::io::Result<()> {
        let Some(s) = &self.stream else {
            return Ok(());
        };
        if self.nonblocking.load(Ordering::Relaxed) == on {
            return Ok(());
        }
        s.set_nonblocking(on)?;
        self.nonblocking.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Read what the peer sent, without blocking (the stream must be non-blocking), and say
    /// whether the peer is still there. Reads at most up to the end of a `Close` frame.
    pub fn poll_peer(&mut self) -> ControlEvent {
        loop {
            match self.state {
                State::PeerClosed => return ControlEvent::PeerClosed,
                State::Broken => return ControlEvent::Gone,
                State::Open => {}
            }
            let Some(mut stream) = self.stream.as_deref() else {
                self.state = State::Broken;
                continue;
            };
            // Not past the end of the frame (the next connection's hello may follow a
            // `Close`), and a `Ready` or a `Close` in one receive.
            let want = match self.rx.get(..4) {
                None => wire::MIN_FRAME_LEN - self.rx.len(),
                Some(prefix) => {
                    let mut p = [0u8; 4];
                    p.copy_from_slice(prefix);
                    // (Read past a frame shorter than the shortest: it failed to decode.)
                    match wire::frame_len(p).map(|len| (4 + len).checked_sub(self.rx.len())) {
                        Ok(Some(want)) if want > 0 => want,
                        _ => {
                            self.state = State::Broken;
                            continue;
                        }
                    }
                }
            };
            let mut buf = [0u8; 64];
            let n = want.min(buf.len());
            let Some(dst) = buf.get_mut(..n) else {
                self.state = State::Broken;
                continue;
            };
            match stream.read(dst) {
                Ok(0) => self.state = State::Broken,
                Ok(got) => {
                    self.rx
                        .extend_from_slice(dst.get(..got).unwrap_or_default());
                    match wire::decode_frame(&self.rx) {
                        Ok(None) if self.rx.len() <= 4 + MAX_FRAME_LEN => {}
                        Ok(Some((Message::Close, _))) => {
                            self.rx.clear();
                            self.state = State::PeerClosed;
                        }
                        // Accepting side: the last step of the peer's handshake.
                        Ok(Some((Message::Ready, _))) => {
                            self.rx.clear();
                            self.ready = true;
                        }
                        // Accepting side: the peer's close waits for this side's progress.
                        Ok(Some((Message::Nudge, _))) => {
                            self.rx.clear();
                            self.nudged = true;
                        }
                        Ok(Some((other, _))) => {
                            tracing::debug!(peer = %self.peer_addr, got = other.name(),
                                "unexpected message on a live control stream");
                            self.state = State::Broken;
                        }
                        Ok(None) | Err(_) => self.state = State::Broken,
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return ControlEvent::Open,
                Err(_) => self.state = State::Broken,
            }
        }
    }

    /// Tell the peer the connection is over (unless it said so first) and hand the stream back
    /// for reuse. Dropping the stream does the same.
    pub fn close(self) {}

    fn finish(&mut self) {
        // The connection ends here: probes let go of the socket first (they answer "ended"
        // from now on), so closing it below closes it, and a stream given back for reuse
        // carries no probe into its next connection.
        if let Some(probe) = self.probe.take() {
            probe.lock().take();
        }
        // No probe holds the stream any more: it is this side's alone.
        let Some(stream) = self.stream.take().and_then(|s| Arc::try_unwrap(s).ok()) else {
            return;
        };
        if !self.reuse || self.state == State::Broken || !self.rx.is_empty() {
            return; // dropped: the peer sees EOF
        }
        if !self.nonblocking.load(Ordering::Relaxed) && stream.set_nonblocking(true).is_err() {
            return;
        }
        if self.state == State::Open {
            let frame = wire::encode(&Message::Close);
            let deadline = Instant::now() + Duration::from_millis(200);
            if send_all(&stream, &frame, deadline).is_err() {
                return;
            }
        }
        match &self.home {
            Home::Client(mgr) => mgr.put_idle_stream(self.peer_addr, stream),
            Home::Server(Some(home)) => home.give_back(stream, self.peer_addr),
            Home::Server(None) => {}
        }
    }
}

/// Tells whether the peer of a connection (connecting side) has ended it, from any thread and
/// without taking anything from the stream: a non-blocking `recv(MSG_PEEK)` of one byte on the
/// control stream's socket (shared with the [`ControlStream`] while the connection lives). On the connecting side a live connection's
/// stream carries nothing from the peer; a byte (its `Close`, or anything else, which the owner
/// would take as the peer gone), EOF or an error means the connection is over, even when the
/// owner ([`ControlStream::poll_peer`]) has not read it yet. Once the [`ControlStream`] is
/// dropped (the connection ended on this side) the probe says so without a system call.
///
/// It answers for what has reached this host: a peer that leaves just after the look is seen by
/// the owner, and the connection's users get its error then.
#[derive(Clone)]
pub struct HangupProbe {
    stream: Arc<Mutex<Option<Arc<Stream>>>>,
}

impl std::fmt::Debug for HangupProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HangupProbe")
            .field("ended", &self.stream.lock().is_none())
            .finish()
    }
}

impl HangupProbe {
    /// True when the connection is over: the peer's `Close`, hang-up or reset waits in the
    /// socket, or the connection's [`ControlStream`] was dropped.
    pub fn ended(&self) -> bool {
        let guard = self.stream.lock();
        let Some(stream) = guard.as_ref() else {
            return true;
        };
        let mut byte = [0u8; 1];
        loop {
            match rustix::net::recv(
                stream,
                &mut byte,
                rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
            ) {
                // Nothing waiting: as far as this host knows, the peer is there.
                Err(rustix::io::Errno::AGAIN) => return false,
                Err(rustix::io::Errno::INTR) => {}
                // A byte (only the end of the connection can come), EOF, or a reset.
                Ok(_) | Err(_) => return true,
            }
        }
    }
}

impl AsFd for ControlStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match &self.stream {
            Some(s) => s.as_fd(),
            // The stream is only taken in drop; no caller can hold `self` then.
            None => unreachable!("ControlStream invariant: the stream is present until drop"),
        }
    }
}

impl Drop for ControlStream {
    fn drop(&mut self) {
        self.finish();
    }
}

/// `wr_id` of the markers [`QpLease::drain`] posts; no other user of a QP may use it.
pub const DRAIN_MARKER_WR_ID: u64 = 0xFFFF_FFFF_FFFF_FFFF;

/// The QP of an established connection, to be given back to its manager when the connection
/// ends. Dropping a lease without [`QpLease::release`] destroys the QP.
pub struct QpLease {
    mgr: ConnManager,
    qp: QueuePair,
}

impl std::fmt::Debug for QpLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpLease").field("qp", &self.qp).finish()
    }
}

impl QpLease {
    pub(super) fn new(mgr: ConnManager, qp: QueuePair) -> QpLease {
        QpLease { mgr, qp }
    }

    /// The QP.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// Stop the QP and collect every completion it still owes: ERROR, one flushed marker per
    /// work queue, polled from `cq` (the CQ its requests complete on) for at most `limit`.
    /// Completions of other QPs polled meanwhile are appended to `others`. True when both
    /// markers came back, i.e. the QP can serve another connection.
    pub fn drain(
        &self,
        cq: &CompletionQueue,
        limit: Duration,
        others: &mut Vec<WorkCompletion>,
    ) -> bool {
        let qp = &self.qp;
        if qp.state() == QpState::Reset {
            return true; // nothing posted can complete
        }
        // Even from ERROR: a provider returns from the move only when no peer access through
        // the QP is running any more (shm), so what it exposed may be reused after the drain.
        if qp.modify(&QpAttr::error()).is_err() {
            return false;
        }
        let mut pending = 0;
        if qp
            .post_recv(&[RecvWr::new(DRAIN_MARKER_WR_ID, &[])])
            .is_ok()
        {
            pending += 1;
        }
        let marker =
            SendWr::new(DRAIN_MARKER_WR_ID, &[], WrOpcode::Send).with_flags(SendFlags::SIGNALED);
        if qp.post_send(&[marker]).is_ok() {
            pending += 1;
        }
        if pending < 2 {
            return false;
        }
        let me = qp.qp_num();
        let deadline = Instant::now() + limit;
        let mut wcs = [WorkCompletion::EMPTY; 32];
        let mut spins = 0u32;
        while pending > 0 {
            let n = match cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(_) => return false,
            };
            for wc in wcs.iter().take(n) {
                if wc.qp_num != me {
                    others.push(*wc);
                } else if wc.wr_id == DRAIN_MARKER_WR_ID {
                    pending -= 1;
                }
            }
            if n == 0 {
                if Instant::now() >= deadline {
                    tracing::warn!(qp = me.0, "QP did not flush in {limit:?}; not reused");
                    return false;
                }
                spins += 1;
                if spins % 64 == 0 {
                    std::thread::yield_now();
                }
            }
        }
        true
    }

    /// Give the QP back to its manager's cache (reset first). Call after a successful
    /// [`QpLease::drain`], once every other handle on the QP is dropped. True if it was cached.
    pub fn release(self) -> bool {
        self.mgr.release_qp(self.qp)
    }

    /// Keep the connection's channel regions (receive ring, send-header slots) in the
    /// manager's region cache. Only after a successful [`QpLease::drain`]: nothing posted on the
    /// QP can complete into them any more. Regions beyond the cache's room are deregistered.
    pub fn keep_regions(&self, regions: impl IntoIterator<Item = MemoryRegion>) {
        for mr in regions {
            self.mgr.region_cache().put(mr);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    use proptest::prelude::*;

    use super::*;
    use crate::conn::stream::Stream;

    /// What a peer may write on a live control stream.
    #[derive(Debug, Clone)]
    enum Item {
        Ready,
        Nudge,
        Close,
        /// A frame whose body is not one (bad magic), of this body length.
        BadMagic(u8),
        /// A prefix announcing fewer bytes than any frame has, and that many.
        Short(u8),
        /// A well-formed frame that has no place on a live stream.
        Reject,
    }

    fn encode(item: &Item) -> Vec<u8> {
        match item {
            Item::Ready => wire::encode(&Message::Ready),
            Item::Nudge => wire::encode(&Message::Nudge),
            Item::Close => wire::encode(&Message::Close),
            Item::BadMagic(n) => {
                let n = usize::from(*n).max(wire::MIN_FRAME_LEN - 4);
                let mut f = (n as u32).to_be_bytes().to_vec();
                f.extend(vec![0xEE; n]);
                f
            }
            Item::Short(n) => {
                let n = usize::from(*n) % (wire::MIN_FRAME_LEN - 4);
                let mut f = (n as u32).to_be_bytes().to_vec();
                f.extend(vec![0x11; n]);
                f
            }
            Item::Reject => wire::encode(&Message::Reject(wire::Reject {
                code: wire::RejectCode::Internal,
                version: wire::VERSION,
                provider: "shm".into(),
                reason: "no".into(),
            })),
        }
    }

    fn item() -> impl Strategy<Value = Item> {
        prop_oneof![
            4 => Just(Item::Ready),
            2 => Just(Item::Nudge),
            2 => Just(Item::Close),
            1 => any::<u8>().prop_map(Item::BadMagic),
            1 => any::<u8>().prop_map(Item::Short),
            1 => Just(Item::Reject),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever a peer writes, however the bytes are split, the owner's reads end as the
        /// frames say: the `Ready`s in front are taken, a `Close` ends the stream with every
        /// byte behind it left unread in the socket, anything else breaks it — never a panic,
        /// never a read past the `Close`.
        #[test]
        fn poll_peer_reads_frames_however_they_are_split(
            items in proptest::collection::vec(item(), 1..8),
            cuts in proptest::collection::vec(1usize..24, 1..40),
        ) {
            let (ours, mut peer) = UnixStream::pair().expect("socket pair");
            ours.set_nonblocking(true).expect("non-blocking");
            let reader = ours.try_clone().expect("clone");
            let addr: SocketAddr = "127.0.0.1:1".parse().expect("addr");
            let mut c = ControlStream::new(Stream::Local(ours), addr, Home::Server(None), false);
            // What the frames say, and the bytes after a Close.
            let mut want_ready = false;
            let mut want_nudge = false;
            let mut want = ControlEvent::Open;
            let mut after_close = Vec::new();
            for it in &items {
                match (&want, it) {
                    (ControlEvent::PeerClosed, _) => after_close.extend(encode(it)),
                    (ControlEvent::Gone, _) => {}
                    (_, Item::Ready) => want_ready = true,
                    (_, Item::Nudge) => want_nudge = true,
                    (_, Item::Close) => want = ControlEvent::PeerClosed,
                    _ => want = ControlEvent::Gone,
                }
            }
            let bytes: Vec<u8> = items.iter().flat_map(encode).collect();
            let mut at = 0;
            let mut seen = ControlEvent::Open;
            for cut in cuts.iter().cycle() {
                if at == bytes.len() {
                    break;
                }
                let end = (at + cut).min(bytes.len());
                peer.write_all(&bytes[at..end]).expect("write");
                at = end;
                seen = c.poll_peer();
                if seen != ControlEvent::Open {
                    break;
                }
            }
            prop_assert_eq!(seen, want);
            // The Readys in front of whatever ended the reads, or of the end of the bytes.
            prop_assert_eq!(c.take_ready(), want_ready);
            prop_assert_eq!(c.take_nudge(), want_nudge);
            if want == ControlEvent::PeerClosed {
                // Write what is left, then read the socket: exactly the bytes after the Close.
                peer.write_all(&bytes[at..]).expect("write rest");
                drop(peer);
                let mut rest = Vec::new();
                let mut r = reader;
                r.set_nonblocking(false).expect("blocking");
                r.read_to_end(&mut rest).expect("read rest");
                prop_assert_eq!(rest, after_close);
            }
        }
    }
}
