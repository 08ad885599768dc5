//! The connection manager's handshake messages and their binary encoding (sans-IO).
//!
//! Every message travels in a frame: a 4-byte big-endian body length, then the body. The body
//! starts with a fixed prefix that every version keeps — magic `"FBRQ"` (u32), version (u16),
//! kind (u8) — so a peer of another version is recognised and answered with a clear
//! [`RejectCode::VersionMismatch`] instead of being misparsed. All integers are big-endian;
//! strings and byte strings are a u16 length then the bytes.
//!
//! The decoder never panics and never allocates more than the frame it was given, which is
//! itself limited to [`MAX_FRAME_LEN`]: every length read off the wire is checked against the
//! bytes left and against a per-field limit first.
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

use std::collections::BTreeMap;

use fabriq_verbs::{QpEndpoint, QpNum};

/// `"FBRQ"`.
pub const MAGIC: u32 = 0x4642_5251;
/// The handshake version this build speaks. It names the data-path protocol too: version 2
/// carries streams (the channel wire format `0xFB02`), so a peer of another version is refused
/// at the handshake, not at its first message. Version 4: the hello names the sender's local
/// control socket ([`Hello::local_control`]). Version 5: the server reaches RTR first and says
/// so (`QpAttr::before_peer`), and its hello-ack carries its QP's endpoint as read after that
/// RTR, which the client's RTR must be given. Version 6: a connecting side whose connection
/// lingers in its close may write [`Message::Nudge`] on the live control stream. Version 7:
/// a stream's window (`stream_window`) and its reports count window units — one per started
/// MiB of a data message — instead of messages.
pub const VERSION: u16 = 7;
/// Shortest frame a peer can send, bytes: the length prefix, then a body of at least the
/// magic, the version and the kind (a `Ready`, a `Close`). A reader that does not know the
/// length yet may ask for this many without reading past the end of the first frame.
pub const MIN_FRAME_LEN: usize = 4 + 4 + 2 + 1;
/// Largest frame body accepted from a peer, bytes.
pub const MAX_FRAME_LEN: usize = 16 * 1024;
/// Largest string field accepted from a peer, bytes.
pub const MAX_STR_LEN: usize = 1024;
/// Most provider-specific endpoint extras accepted from a peer.
pub const MAX_EXTRAS: usize = 64;
/// Largest auth token accepted from a peer, bytes.
pub const MAX_TOKEN_LEN: usize = 1024;
/// Largest local control socket name accepted from a peer, bytes (an abstract Unix socket
/// name: `sun_path` less its leading NUL).
pub const MAX_LOCAL_CONTROL_LEN: usize = 107;

const KIND_HELLO: u8 = 1;
const KIND_HELLO_ACK: u8 = 2;
const KIND_READY: u8 = 3;
const KIND_REJECT: u8 = 4;
const KIND_CLOSE: u8 = 5;
const KIND_NUDGE: u8 = 6;

/// Why a frame could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The frame does not start with the fabriq magic: not a fabriq peer.
    #[error("bad magic {0:#010x}: not a fabriq peer")]
    BadMagic(u32),
    /// A version this build does not speak; the rest of the frame was not parsed.
    #[error("unsupported handshake version {0}")]
    UnsupportedVersion(u16),
    /// Unknown message kind.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// The frame ends before the message does.
    #[error("truncated {0}")]
    Truncated(&'static str),
    /// A length above its limit.
    #[error("{field} of {len} bytes exceeds the limit of {max}")]
    TooLong {
        /// Which field.
        field: &'static str,
        /// Length read off the wire.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A string that is not UTF-8.
    #[error("{0} is not UTF-8")]
    BadUtf8(&'static str),
    /// Bytes left over after the message.
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
    /// A field with a value that makes no sense (zero ring slots, ...).
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// Which field.
        field: &'static str,
        /// Why.
        reason: &'static str,
    },
}

/// Receive-ring geometry a side announces: the peer may have at most `slots` eager messages of
/// at most `slot_size` bytes in flight towards it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RingGeometry {
    /// Receive slots posted per connection. ≥ 1.
    pub slots: u32,
    /// Bytes per slot (largest eager message including headers). ≥ 1.
    pub slot_size: u32,
}

/// One side's handshake announcement: who it is, where its QP is, and how to talk to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Handshake version of the sender.
    pub version: u16,
    /// Provider name (`shm`, `tcp`, `rdma-core`); both sides must match.
    pub provider: String,
    /// Device name on the sender's host.
    pub device: String,
    /// The sender's QP.
    pub endpoint: QpEndpoint,
    /// The sender's receive ring.
    pub ring: RingGeometry,
    /// Credits the sender grants the peer at start (≤ `ring.slots`).
    pub initial_credits: u32,
    /// Largest payload the sender sends eagerly; above it, rendezvous.
    pub eager_threshold: u32,
    /// Rendezvous READ chunk size the sender uses.
    pub rndv_chunk_size: u32,
    /// The sender's worker.
    pub worker_id: u32,
    /// Client hello: the worker it wants on the server (`None`: any). Server hello: `None`.
    pub target_worker: Option<u32>,
    /// Data messages of one stream the sender lets its peer have unconsumed (its stream
    /// window; the connection uses the smaller of the two sides', see
    /// [`negotiated_stream_window`]). 4 ..= 65 536.
    pub stream_window: u32,
    /// Authentication token (empty: none).
    pub auth_token: Vec<u8>,
    /// Server hello: the abstract Unix socket name under which the sender's listener also takes
    /// control streams from processes of its host (empty: none). A peer on the same host opens
    /// its later control streams there (cheaper than loopback TCP; see `conn::stream`). Client
    /// hello: empty.
    pub local_control: String,
}

/// The hello this side sent.
pub type LocalHello = Hello;
/// The hello the peer sent.
pub type PeerHello = Hello;

/// Why a side refused a handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectCode {
    /// The handshake versions do not match.
    VersionMismatch,
    /// The providers do not match.
    ProviderMismatch,
    /// Authentication failed.
    AuthFailed,
    /// No such worker, or the server is at capacity.
    Unavailable,
    /// The peer's message was malformed.
    Malformed,
    /// A local failure (QP creation or transition).
    Internal,
    /// A code this build does not know.
    Other(u8),
}

impl RejectCode {
    fn to_u8(self) -> u8 {
        match self {
            RejectCode::VersionMismatch => 1,
            RejectCode::ProviderMismatch => 2,
            RejectCode::AuthFailed => 3,
            RejectCode::Unavailable => 4,
            RejectCode::Malformed => 5,
            RejectCode::Internal => 6,
            RejectCode::Other(c) => c,
        }
    }

    fn from_u8(c: u8) -> Self {
        match c {
            1 => RejectCode::VersionMismatch,
            2 => RejectCode::ProviderMismatch,
            3 => RejectCode::AuthFailed,
            4 => RejectCode::Unavailable,
            5 => RejectCode::Malformed,
            6 => RejectCode::Internal,
            c => RejectCode::Other(c),
        }
    }
}

/// A refusal, sent instead of (or after) a hello so the peer learns why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    /// Why.
    pub code: RejectCode,
    /// The version the rejecting side speaks.
    pub version: u16,
    /// The rejecting side's provider.
    pub provider: String,
    /// Human-readable detail.
    pub reason: String,
}

/// A handshake message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Client → server: the client's hello (its QP is in INIT).
    Hello(Hello),
    /// Server → client: the server's hello; the server's QP is at RTS with receives posted.
    HelloAck(Hello),
    /// Client → server: the client's QP is at RTS with receives posted; traffic may start.
    Ready,
    /// Either side: the handshake is refused.
    Reject(Reject),
    /// Either side, after a handshake: the connection set up on this control stream is over
    /// (its channel closed). The stream stays open for the next handshake; a reader waiting for
    /// a hello or a hello-ack skips it.
    Close,
    /// Client → server, on a live connection's control stream: the connection is closing and
    /// waits for the server to acknowledge what it sent (its data path holds messages for the
    /// server), so the server should progress it now rather than when its application next
    /// calls in. Carries no state: a server may read it late, or not at all; a reader waiting
    /// for a hello skips it.
    Nudge,
}

impl Message {
    /// A short name for errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::HelloAck(_) => "hello-ack",
            Message::Ready => "ready",
            Message::Reject(_) => "reject",
            Message::Close => "close",
            Message::Nudge => "nudge",
        }
    }
}

// ----- encoding -----

fn put_str(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    let n = bytes.len().min(MAX_STR_LEN);
    out.extend_from_slice(&(n as u16).to_be_bytes());
    out.extend_from_slice(bytes.get(..n).unwrap_or_default());
}

fn put_hello(out: &mut Vec<u8>, h: &Hello) {
    put_str(out, &h.provider);
    put_str(out, &h.device);
    let ep = &h.endpoint;
    put_str(out, &ep.provider);
    put_str(out, &ep.device);
    put_str(out, &ep.address);
    out.extend_from_slice(&ep.qp_num.0.to_be_bytes());
    out.extend_from_slice(&ep.psn.to_be_bytes());
    out.extend_from_slice(&ep.lid.to_be_bytes());
    out.extend_from_slice(&ep.gid);
    out.extend_from_slice(&ep.mtu.to_be_bytes());
    let extras = ep.extra.len().min(MAX_EXTRAS);
    out.extend_from_slice(&(extras as u16).to_be_bytes());
    for (k, v) in ep.extra.iter().take(extras) {
        put_str(out, k);
        put_str(out, v);
    }
    for v in [
        h.ring.slots,
        h.ring.slot_size,
        h.initial_credits,
        h.eager_threshold,
        h.rndv_chunk_size,
        h.worker_id,
        h.target_worker.unwrap_or(u32::MAX),
        h.stream_window,
    ] {
        out.extend_from_slice(&v.to_be_bytes());
    }
    let n = h.auth_token.len().min(MAX_TOKEN_LEN);
    out.extend_from_slice(&(n as u16).to_be_bytes());
    out.extend_from_slice(h.auth_token.get(..n).unwrap_or_default());
    // Never clipped mid-name: a name over the limit is not sent at all.
    let local = if h.local_control.len() <= MAX_LOCAL_CONTROL_LEN {
        h.local_control.as_bytes()
    } else {
        &[]
    };
    out.extend_from_slice(&(local.len() as u16).to_be_bytes());
    out.extend_from_slice(local);
}

/// Encode `msg` as one frame (length prefix included), speaking `version` in the prefix.
/// Fields above their limits are clipped, so our own frames always decode.
pub fn encode_with_version(msg: &Message, version: u16) -> Vec<u8> {
    let mut body = Vec::with_capacity(256);
    body.extend_from_slice(&MAGIC.to_be_bytes());
    body.extend_from_slice(&version.to_be_bytes());
    match msg {
        Message::Hello(h) => {
            body.push(KIND_HELLO);
            put_hello(&mut body, h);
        }
        Message::HelloAck(h) => {
            body.push(KIND_HELLO_ACK);
            put_hello(&mut body, h);
        }
        Message::Ready => body.push(KIND_READY),
        Message::Close => body.push(KIND_CLOSE),
        Message::Nudge => body.push(KIND_NUDGE),
        Message::Reject(r) => {
            body.push(KIND_REJECT);
            body.push(r.code.to_u8());
            body.extend_from_slice(&r.version.to_be_bytes());
            put_str(&mut body, &r.provider);
            put_str(&mut body, &r.reason);
        }
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    frame
}

/// Encode `msg` as one frame of this build's [`VERSION`].
pub fn encode(msg: &Message) -> Vec<u8> {
    encode_with_version(msg, VERSION)
}

// ----- decoding -----

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Truncated(what));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(u8::from_be_bytes(self.array(what)?))
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(what)?))
    }

    fn bytes(&mut self, what: &'static str, max: usize) -> Result<&'a [u8], DecodeError> {
        let len = usize::from(self.u16(what)?);
        if len > max {
            return Err(DecodeError::TooLong {
                field: what,
                len,
                max,
            });
        }
        self.take(len, what)
    }

    fn string(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let b = self.bytes(what, MAX_STR_LEN)?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| DecodeError::BadUtf8(what))
    }
}

fn get_hello(r: &mut Reader<'_>) -> Result<Hello, DecodeError> {
    let provider = r.string("provider")?;
    let device = r.string("device")?;
    let ep_provider = r.string("endpoint provider")?;
    let ep_device = r.string("endpoint device")?;
    let address = r.string("endpoint address")?;
    let qp_num = QpNum(r.u32("qp number")?);
    let psn = r.u32("psn")?;
    let lid = r.u16("lid")?;
    let gid = r.array::<16>("gid")?;
    let mtu = r.u32("mtu")?;
    let n_extra = usize::from(r.u16("extras count")?);
    if n_extra > MAX_EXTRAS {
        return Err(DecodeError::TooLong {
            field: "extras count",
            len: n_extra,
            max: MAX_EXTRAS,
        });
    }
    let mut extra = BTreeMap::new();
    for _ in 0..n_extra {
        let k = r.string("extra key")?;
        let v = r.string("extra value")?;
        extra.insert(k, v);
    }
    let slots = r.u32("ring slots")?;
    let slot_size = r.u32("ring slot size")?;
    let initial_credits = r.u32("initial credits")?;
    let eager_threshold = r.u32("eager threshold")?;
    let rndv_chunk_size = r.u32("rendezvous chunk size")?;
    let worker_id = r.u32("worker id")?;
    let target = r.u32("target worker")?;
    let stream_window = r.u32("stream window")?;
    let auth_token = r.bytes("auth token", MAX_TOKEN_LEN)?.to_vec();
    let local_control = std::str::from_utf8(r.bytes("local control", MAX_LOCAL_CONTROL_LEN)?)
        .map(str::to_owned)
        .map_err(|_| DecodeError::BadUtf8("local control"))?;
    if slots == 0 || slot_size == 0 {
        return Err(DecodeError::Invalid {
            field: "ring geometry",
            reason: "zero slots or zero slot size",
        });
    }
    if initial_credits > slots {
        return Err(DecodeError::Invalid {
            field: "initial credits",
            reason: "more credits than ring slots",
        });
    }
    if rndv_chunk_size == 0 {
        return Err(DecodeError::Invalid {
            field: "rendezvous chunk size",
            reason: "zero",
        });
    }
    if !STREAM_WINDOW_RANGE.contains(&stream_window) {
        return Err(DecodeError::Invalid {
            field: "stream window",
            reason: "outside 4 ..= 65536",
        });
    }
    Ok(Hello {
        version: VERSION,
        provider,
        device,
        endpoint: QpEndpoint {
            provider: ep_provider,
            device: ep_device,
            address,
            qp_num,
            psn,
            lid,
            gid,
            mtu,
            extra,
        },
        ring: RingGeometry { slots, slot_size },
        initial_credits,
        eager_threshold,
        rndv_chunk_size,
        worker_id,
        target_worker: (target != u32::MAX).then_some(target),
        stream_window,
        auth_token,
        local_control,
    })
}

/// Stream windows a hello may announce.
pub const STREAM_WINDOW_RANGE: std::ops::RangeInclusive<u32> = 4..=65_536;

/// The stream window of a connection: the smaller of the two sides' (each side sends at most
/// what the other accepts to hold unconsumed, and reports consumption every quarter of it).
pub fn negotiated_stream_window(local: &Hello, peer: &Hello) -> u32 {
    local.stream_window.min(peer.stream_window)
}

/// The body length announced by a frame's 4-byte prefix, checked against [`MAX_FRAME_LEN`].
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, DecodeError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > MAX_FRAME_LEN {
        return Err(DecodeError::TooLong {
            field: "frame",
            len,
            max: MAX_FRAME_LEN,
        });
    }
    Ok(len)
}

/// Decode one frame body (without its length prefix).
pub fn decode_body(body: &[u8]) -> Result<Message, DecodeError> {
    if body.len() > MAX_FRAME_LEN {
        return Err(DecodeError::TooLong {
            field: "frame",
            len: body.len(),
            max: MAX_FRAME_LEN,
        });
    }
    let mut r = Reader { buf: body };
    let magic = r.u32("magic")?;
    if magic != MAGIC {
        return Err(DecodeError::BadMagic(magic));
    }
    let version = r.u16("version")?;
    if version != VERSION {
        return Err(DecodeError::UnsupportedVersion(version));
    }
    let kind = r.u8("kind")?;
    let msg = match kind {
        KIND_HELLO => Message::Hello(get_hello(&mut r)?),
        KIND_HELLO_ACK => Message::HelloAck(get_hello(&mut r)?),
        KIND_READY => Message::Ready,
        KIND_CLOSE => Message::Close,
        KIND_NUDGE => Message::Nudge,
        KIND_REJECT => {
            let code = RejectCode::from_u8(r.u8("reject code")?);
            let version = r.u16("reject version")?;
            let provider = r.string("reject provider")?;
            let reason = r.string("reject reason")?;
            Message::Reject(Reject {
                code,
                version,
                provider,
                reason,
            })
        }
        k => return Err(DecodeError::UnknownKind(k)),
    };
    if !r.buf.is_empty() {
        return Err(DecodeError::Trailing(r.buf.len()));
    }
    Ok(msg)
}

/// Decode the first frame of `buf` (length prefix included): `Ok(None)` if more bytes are
/// needed, else the message and the bytes consumed.
pub fn decode_frame(buf: &[u8]) -> Result<Option<(Message, usize)>, DecodeError> {
    let Some(prefix) = buf.get(..4) else {
        return Ok(None);
    };
    let mut p = [0u8; 4];
    p.copy_from_slice(prefix);
    let len = frame_len(p)?;
    let Some(body) = buf.get(4..4 + len) else {
        return Ok(None);
    };
    Ok(Some((decode_body(body)?, 4 + len)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn sample_hello() -> Hello {
        let mut extra = BTreeMap::new();
        extra.insert("segment".to_string(), "/fabriq-1234-7".to_string());
        Hello {
            version: VERSION,
            provider: "tcp".into(),
            device: "tcp0".into(),
            endpoint: QpEndpoint {
                provider: "tcp".into(),
                device: "tcp0".into(),
                address: "127.0.0.1:4791".into(),
                qp_num: QpNum(17),
                psn: 0x00ab_cdef,
                lid: 0,
                gid: [7; 16],
                mtu: 4096,
                extra,
            },
            ring: RingGeometry {
                slots: 64,
                slot_size: 4160,
            },
            initial_credits: 64,
            eager_threshold: 4096,
            rndv_chunk_size: 65536,
            worker_id: 3,
            target_worker: Some(1),
            stream_window: 64,
            auth_token: vec![],
            local_control: String::new(),
        }
    }

    #[test]
    fn every_message_round_trips() {
        let h = sample_hello();
        let mut h2 = h.clone();
        h2.target_worker = None;
        h2.auth_token = b"secret".to_vec();
        h2.local_control = "fabriq-ctl/4242/00000000deadbeef".into();
        for msg in [
            Message::Hello(h.clone()),
            Message::HelloAck(h2),
            Message::Ready,
            Message::Close,
            Message::Nudge,
            Message::Reject(Reject {
                code: RejectCode::ProviderMismatch,
                version: VERSION,
                provider: "shm".into(),
                reason: "provider tcp != shm".into(),
            }),
            Message::Reject(Reject {
                code: RejectCode::Other(200),
                version: 9,
                provider: String::new(),
                reason: String::new(),
            }),
        ] {
            let frame = encode(&msg);
            let (got, used) = decode_frame(&frame).unwrap().unwrap();
            assert_eq!(used, frame.len());
            assert_eq!(got, msg);
        }
    }

    #[test]
    fn partial_frames_ask_for_more() {
        let frame = encode(&Message::Hello(sample_hello()));
        for cut in 0..frame.len() {
            assert_eq!(decode_frame(&frame[..cut]), Ok(None), "cut at {cut}");
        }
    }

    #[test]
    fn foreign_version_is_named_not_misparsed() {
        for other in [VERSION - 1, VERSION + 1] {
            let frame = encode_with_version(&Message::Hello(sample_hello()), other);
            assert_eq!(
                decode_frame(&frame),
                Err(DecodeError::UnsupportedVersion(other))
            );
        }
    }

    #[test]
    fn bad_magic_oversized_frame_and_trailing_bytes_are_errors() {
        let mut frame = encode(&Message::Ready);
        frame[4] ^= 0xff;
        assert!(matches!(
            decode_frame(&frame),
            Err(DecodeError::BadMagic(_))
        ));
        let huge = ((MAX_FRAME_LEN + 1) as u32).to_be_bytes();
        assert!(matches!(
            decode_frame(&huge),
            Err(DecodeError::TooLong { field: "frame", .. })
        ));
        let mut frame = encode(&Message::Ready);
        frame.push(0);
        let len = (frame.len() - 4) as u32;
        frame[..4].copy_from_slice(&len.to_be_bytes());
        assert_eq!(decode_frame(&frame), Err(DecodeError::Trailing(1)));
    }

    #[test]
    fn nonsense_geometry_is_refused() {
        let mut h = sample_hello();
        h.initial_credits = h.ring.slots + 1;
        assert!(matches!(
            decode_frame(&encode(&Message::Hello(h))),
            Err(DecodeError::Invalid { .. })
        ));
        let mut h = sample_hello();
        h.ring.slots = 0;
        h.initial_credits = 0;
        assert!(matches!(
            decode_frame(&encode(&Message::Hello(h))),
            Err(DecodeError::Invalid { .. })
        ));
        for w in [0, 3, 65_537, u32::MAX] {
            let mut h = sample_hello();
            h.stream_window = w;
            assert!(
                matches!(
                    decode_frame(&encode(&Message::Hello(h))),
                    Err(DecodeError::Invalid {
                        field: "stream window",
                        ..
                    })
                ),
                "stream window {w}"
            );
        }
    }

    #[test]
    fn a_local_control_name_is_bounded_both_ways() {
        // Ours: a name over the limit is not sent at all (never clipped into another name).
        let mut h = sample_hello();
        h.local_control = "n".repeat(MAX_LOCAL_CONTROL_LEN + 1);
        let mut want = h.clone();
        want.local_control.clear();
        assert_eq!(
            decode_frame(&encode(&Message::Hello(h)))
                .unwrap()
                .unwrap()
                .0,
            Message::Hello(want)
        );
        // A peer's: refused before it is read.
        let mut h = sample_hello();
        h.local_control = "n".repeat(10);
        let mut frame = encode(&Message::Hello(h));
        frame.truncate(frame.len() - 12);
        frame.extend_from_slice(&((MAX_LOCAL_CONTROL_LEN + 1) as u16).to_be_bytes());
        frame.extend_from_slice(&[b'n'; MAX_LOCAL_CONTROL_LEN + 1]);
        let len = (frame.len() - 4) as u32;
        frame[..4].copy_from_slice(&len.to_be_bytes());
        assert_eq!(
            decode_frame(&frame),
            Err(DecodeError::TooLong {
                field: "local control",
                len: MAX_LOCAL_CONTROL_LEN + 1,
                max: MAX_LOCAL_CONTROL_LEN,
            })
        );
    }

    #[test]
    fn the_smaller_stream_window_wins() {
        let (mut a, mut b) = (sample_hello(), sample_hello());
        a.stream_window = 8;
        b.stream_window = 64;
        assert_eq!(negotiated_stream_window(&a, &b), 8);
        assert_eq!(negotiated_stream_window(&b, &a), 8);
        b.stream_window = 4;
        assert_eq!(negotiated_stream_window(&a, &b), 4);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode_frame(&bytes);
            let _ = decode_body(&bytes);
        }

        #[test]
        fn mutated_hellos_never_panic(
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..16),
            cut in any::<usize>(),
        ) {
            let mut frame = encode(&Message::Hello(sample_hello()));
            for (i, b) in flips {
                let n = frame.len();
                frame[i % n] ^= b;
            }
            let n = frame.len();
            frame.truncate(cut % (n + 1));
            let _ = decode_frame(&frame);
        }

        #[test]
        fn hellos_round_trip(
            slots in 1u32..100_000, slot_size in 1u32.., worker in any::<u32>(),
            target in proptest::option::of(0u32..u32::MAX), token in proptest::collection::vec(any::<u8>(), 0..64),
            address in "[ -~]{0,64}", local in "[ -~]{0,107}",
        ) {
            let mut h = sample_hello();
            h.ring = RingGeometry { slots, slot_size };
            h.initial_credits = slots;
            h.worker_id = worker;
            h.target_worker = target;
            h.auth_token = token;
            h.endpoint.address = address;
            h.local_control = local;
            let msg = Message::Hello(h);
            let frame = encode(&msg);
            prop_assert_eq!(decode_frame(&frame).unwrap().unwrap().0, msg);
        }
    }
}
