//! The channel's wire format: the 16-byte trace header, the 24-byte message header and the small
//! bodies of the control kinds (RTS, FIN). Encoders write into caller buffers; decoders take
//! bytes received from a peer and return `Result`, never panic (design: ARCHITECTURE.md, "The data
//! path of one message").
//!
//! Layout (little endian), 40 bytes in front of every message:
//!
//! ```text
//!  0  trace_id      u64   chosen by the sender, carried end to end
//!  8  send_ts_us    u32   sender's monotonic clock, microseconds, truncated (wraps ~71 min)
//! 12  trace_flags   u16   TraceFlags
//! 14  magic         u16   0xFB02: protocol 0xFB, version 02
//! 16  seq           u32   sequence of a data message (Data, Rts); 0 for control kinds
//! 20  ack           u32   cumulative: every data message up to this seq was delivered
//! 24  credits       u16   receive slots returned to the peer by this message
//! 26  kind          u8    1 Data, 2 Rts, 3 Fin, 4 Update
//! 27  flags         u8    reserved, sent as 0, ignored
//! 28  len           u32   bytes following the 40-byte header in this frame
//! 32  stream        u32   the stream (channel) of a connection this message belongs to
//! 36  stream_credits u32  messages of `stream` the sender's application consumed since its
//!                         last report: the stream's flow-control window opens by that much
//! ```
//!
//! One connection (queue pair) carries many streams: sequence numbers, acks and credits belong
//! to the connection; the stream id routes a message to its channel (`worker::streams`), and
//! each stream has its own window of [`STREAM_WINDOW`] messages its peer's application has not
//! consumed yet, so a stream whose reader stops back-pressures only itself.
//!
//! Bodies: `Data` carries `len` payload bytes; `Rts` 24 bytes {total_len u64, addr u64, rkey u32,
//! reserved u32}; `Fin` 8 bytes {seq u32, reserved u32}; `Update` nothing.
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

use fabriq_verbs::{RemoteAddr, Rkey};

/// Size of the trace header.
pub const TRACE_HEADER_LEN: usize = 16;
/// Size of the message header.
pub const MSG_HEADER_LEN: usize = 24;
/// Both headers: the fixed prefix of every frame.
pub const HEADER_LEN: usize = TRACE_HEADER_LEN + MSG_HEADER_LEN;
/// Body of an RTS frame.
pub const RTS_BODY_LEN: usize = 24;
/// Body of a FIN frame.
pub const FIN_BODY_LEN: usize = 8;
/// The longest frame prefix the sender builds itself (headers and a control body, or a small
/// Data payload held in place); a larger Data payload is gathered from its buffer behind it.
pub const MAX_HEAD_LEN: usize = HEADER_LEN + RTS_BODY_LEN;

/// The default stream window: data messages a sender may have on one stream that the
/// receiving application has not consumed (each side announces its own in the connection
/// hello and the connection uses the smaller). The receiver reports consumption in
/// `stream_credits` (piggybacked, or alone once a quarter of the window is owed, so a sender at
/// the window's edge is never left waiting).
pub const STREAM_WINDOW: u64 = 64;

/// Protocol magic and version in one `u16`.
pub const MAGIC: u16 = 0xFB02;

/// Flags of the trace header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TraceFlags(pub u16);

impl TraceFlags {
    /// The message is sampled for tracing: record it along its path.
    pub const SAMPLED: u16 = 1 << 0;
    /// The message is an RPC request.
    pub const RPC_REQUEST: u16 = 1 << 1;
    /// The message is an RPC response.
    pub const RPC_RESPONSE: u16 = 1 << 2;
    /// The (empty) message opens its stream on the connection.
    pub const STREAM_OPEN: u16 = 1 << 3;
    /// The (empty) message closes its stream: no more messages follow on it in either direction.
    pub const STREAM_CLOSE: u16 = 1 << 4;
    /// The (empty) message only reports `stream_credits`.
    pub const STREAM_CREDIT: u16 = 1 << 5;
    /// With `STREAM_CLOSE`: the accepting side refused the stream (it has as many open on
    /// the connection as it allows). A peer that does not know the bit sees a close.
    pub const STREAM_REFUSED: u16 = 1 << 6;

    /// True if every bit of `bits` is set.
    pub fn contains(self, bits: u16) -> bool {
        self.0 & bits == bits
    }
}

/// The 16-byte trace header every message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TraceHeader {
    /// Chosen by the sender (an RPC keeps one id for request and response).
    pub trace_id: u64,
    /// Sender's monotonic clock at send time, microseconds, truncated to 32 bits.
    pub send_ts_us: u32,
    /// Flags.
    pub flags: TraceFlags,
}

/// The kinds of frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MsgKind {
    /// An eager message: the payload follows the header.
    Data,
    /// Request to send: a rendezvous message the receiver pulls with RDMA READ.
    Rts,
    /// The receiver finished pulling a rendezvous message; the sender may free its buffer.
    Fin,
    /// A lone acknowledgement / credit update.
    Update,
}

impl MsgKind {
    fn code(self) -> u8 {
        match self {
            MsgKind::Data => 1,
            MsgKind::Rts => 2,
            MsgKind::Fin => 3,
            MsgKind::Update => 4,
        }
    }

    fn from_code(code: u8) -> Result<Self, DecodeError> {
        Ok(match code {
            1 => MsgKind::Data,
            2 => MsgKind::Rts,
            3 => MsgKind::Fin,
            4 => MsgKind::Update,
            other => return Err(DecodeError::UnknownKind(other)),
        })
    }

    /// Data kinds carry a sequence number and are acknowledged; control kinds are not.
    pub fn is_sequenced(self) -> bool {
        matches!(self, MsgKind::Data | MsgKind::Rts)
    }
}

/// The 16-byte message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MsgHeader {
    /// Sequence number (wire form, 32 bits), 0 for control kinds.
    pub seq: u32,
    /// Cumulative acknowledgement (wire form).
    pub ack: u32,
    /// Receive slots returned.
    pub credits: u16,
    /// Kind.
    pub kind: MsgKind,
    /// Bytes following the header in this frame.
    pub len: u32,
    /// Stream of the connection the message belongs to.
    pub stream: u32,
    /// Messages of `stream` consumed by the sender's application since its last report.
    pub stream_credits: u32,
}

/// A rendezvous announcement: where the receiver pulls the payload from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rts {
    /// Payload length in bytes.
    pub total_len: u64,
    /// Sender memory holding the payload.
    pub source: RemoteAddr,
}

/// A decoded frame, borrowing the payload of a Data frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    /// Trace header.
    pub trace: TraceHeader,
    /// Message header.
    pub header: MsgHeader,
    /// Kind-specific body.
    pub body: FrameBody<'a>,
}

/// The body of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameBody<'a> {
    /// Eager payload.
    Data(&'a [u8]),
    /// Rendezvous announcement.
    Rts(Rts),
    /// Rendezvous finished for the message with this (wire) sequence number.
    Fin {
        /// Wire sequence number of the RTS.
        seq: u32,
    },
    /// Nothing beyond the header.
    Update,
}

/// Malformed input from a peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Fewer bytes than the fixed header.
    #[error("frame of {0} bytes is shorter than the {HEADER_LEN}-byte header")]
    Short(usize),
    /// Wrong magic or version.
    #[error("bad magic/version {0:#06x}")]
    BadMagic(u16),
    /// Unknown kind code.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The header's length does not match the frame.
    #[error("{kind:?} frame declares {declared} body bytes, frame holds {actual}")]
    Length {
        /// Frame kind.
        kind: MsgKind,
        /// Length in the header.
        declared: u32,
        /// Bytes actually present after the header.
        actual: usize,
    },
    /// A control kind with a sequence number.
    #[error("{kind:?} frame with sequence number {seq}")]
    BadSeq {
        /// Frame kind.
        kind: MsgKind,
        /// Sequence number in the header.
        seq: u32,
    },
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    let mut v = [0u8; 2];
    if let Some(s) = b.get(at..at + 2) {
        v.copy_from_slice(s);
    }
    u16::from_le_bytes(v)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut v = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        v.copy_from_slice(s);
    }
    u32::from_le_bytes(v)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        v.copy_from_slice(s);
    }
    u64::from_le_bytes(v)
}

/// A frame prefix built by the sender: headers plus a control body, at most
/// [`MAX_HEAD_LEN`] bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct HeadBuf {
    bytes: [u8; MAX_HEAD_LEN],
    len: u8,
}

impl std::fmt::Debug for HeadBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeadBuf").field("len", &self.len).finish()
    }
}

impl HeadBuf {
    /// The encoded bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.bytes.get(..usize::from(self.len)).unwrap_or(&[])
    }

    /// Encode headers and a body.
    pub fn encode(trace: &TraceHeader, header: &MsgHeader, body: &FrameBody<'_>) -> HeadBuf {
        let mut out = HeadBuf {
            bytes: [0u8; MAX_HEAD_LEN],
            len: HEADER_LEN as u8,
        };
        let b = &mut out.bytes;
        put(b, 0, &trace.trace_id.to_le_bytes());
        put(b, 8, &trace.send_ts_us.to_le_bytes());
        put(b, 12, &trace.flags.0.to_le_bytes());
        put(b, 14, &MAGIC.to_le_bytes());
        put(b, 16, &header.seq.to_le_bytes());
        put(b, 20, &header.ack.to_le_bytes());
        put(b, 24, &header.credits.to_le_bytes());
        put(b, 26, &[header.kind.code(), 0]);
        put(b, 28, &header.len.to_le_bytes());
        put(b, 32, &header.stream.to_le_bytes());
        put(b, 36, &header.stream_credits.to_le_bytes());
        match body {
            FrameBody::Rts(rts) => {
                put(b, HEADER_LEN, &rts.total_len.to_le_bytes());
                put(b, HEADER_LEN + 8, &rts.source.addr.to_le_bytes());
                put(b, HEADER_LEN + 16, &rts.source.rkey.0.to_le_bytes());
                out.len = (HEADER_LEN + RTS_BODY_LEN) as u8;
            }
            FrameBody::Fin { seq } => {
                put(b, HEADER_LEN, &seq.to_le_bytes());
                out.len = (HEADER_LEN + FIN_BODY_LEN) as u8;
            }
            FrameBody::Data(payload) => {
                // A small payload held in place goes behind the headers (the caller keeps it
                // within MAX_HEAD_LEN); a larger one is gathered from its own buffer instead.
                let end = HEADER_LEN + payload.len();
                if let Some(dst) = b.get_mut(HEADER_LEN..end) {
                    dst.copy_from_slice(payload);
                    out.len = end as u8;
                }
            }
            FrameBody::Update => {}
        }
        out
    }
}

fn put(dst: &mut [u8], at: usize, src: &[u8]) {
    if let Some(d) = dst.get_mut(at..at + src.len()) {
        d.copy_from_slice(src);
    }
}

/// Decode one received frame. Every length is checked against the bytes present.
pub fn decode(bytes: &[u8]) -> Result<Frame<'_>, DecodeError> {
    if bytes.len() < HEADER_LEN {
        return Err(DecodeError::Short(bytes.len()));
    }
    let magic = u16_at(bytes, 14);
    if magic != MAGIC {
        return Err(DecodeError::BadMagic(magic));
    }
    let trace = TraceHeader {
        trace_id: u64_at(bytes, 0),
        send_ts_us: u32_at(bytes, 8),
        flags: TraceFlags(u16_at(bytes, 12)),
    };
    let kind = MsgKind::from_code(bytes.get(26).copied().unwrap_or(0))?;
    let header = MsgHeader {
        seq: u32_at(bytes, 16),
        ack: u32_at(bytes, 20),
        credits: u16_at(bytes, 24),
        kind,
        len: u32_at(bytes, 28),
        stream: u32_at(bytes, 32),
        stream_credits: u32_at(bytes, 36),
    };
    let rest = bytes.get(HEADER_LEN..).unwrap_or(&[]);
    let expect = match kind {
        MsgKind::Data => rest.len(),
        MsgKind::Rts => RTS_BODY_LEN,
        MsgKind::Fin => FIN_BODY_LEN,
        MsgKind::Update => 0,
    };
    if header.len as usize != expect || rest.len() != expect {
        return Err(DecodeError::Length {
            kind,
            declared: header.len,
            actual: rest.len(),
        });
    }
    if !kind.is_sequenced() && header.seq != 0 {
        return Err(DecodeError::BadSeq {
            kind,
            seq: header.seq,
        });
    }
    let body = match kind {
        MsgKind::Data => FrameBody::Data(rest),
        MsgKind::Rts => FrameBody::Rts(Rts {
            total_len: u64_at(rest, 0),
            source: RemoteAddr {
                addr: u64_at(rest, 8),
                rkey: Rkey(u32_at(rest, 16)),
            },
        }),
        MsgKind::Fin => FrameBody::Fin {
            seq: u32_at(rest, 0),
        },
        MsgKind::Update => FrameBody::Update,
    };
    Ok(Frame {
        trace,
        header,
        body,
    })
}

/// Expand a 32-bit wire sequence number to the 64-bit value nearest to `reference`.
/// Sequence numbers start at 1; the 64-bit form never wraps in practice.
pub fn expand_seq(wire: u32, reference: u64) -> u64 {
    // The value with these low 32 bits within 2^31 below to 2^31 above the reference: serial
    // number arithmetic, unless that lies below zero (then the search below).
    let delta = i64::from(wire.wrapping_sub(reference as u32) as i32);
    if let Some(v) = reference.checked_add_signed(delta) {
        return v;
    }
    expand_seq_slow(wire, reference)
}

/// [`expand_seq`] by comparing the three candidates around `reference`.
fn expand_seq_slow(wire: u32, reference: u64) -> u64 {
    let base = reference & !0xFFFF_FFFF;
    let candidates = [
        base.wrapping_sub(1 << 32) | u64::from(wire),
        base | u64::from(wire),
        base.wrapping_add(1 << 32) | u64::from(wire),
    ];
    let mut best = candidates[1];
    let mut best_dist = u64::MAX;
    for c in candidates {
        let d = c.abs_diff(reference);
        if d < best_dist {
            best = c;
            best_dist = d;
        }
    }
    best
}

/// The wire form of a sequence number: its low 32 bits.
pub fn wire_seq(seq: u64) -> u32 {
    seq as u32
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample_header(kind: MsgKind, len: u32) -> MsgHeader {
        MsgHeader {
            seq: if kind.is_sequenced() { 7 } else { 0 },
            ack: 5,
            credits: 3,
            kind,
            len,
            stream: 11,
            stream_credits: 2,
        }
    }

    #[test]
    fn a_small_data_payload_is_framed_behind_the_headers() {
        let h = MsgHeader {
            seq: 3,
            ack: 1,
            credits: 0,
            kind: MsgKind::Data,
            len: 5,
            stream: 2,
            stream_credits: 0,
        };
        let head = HeadBuf::encode(&TraceHeader::default(), &h, &FrameBody::Data(b"hello"));
        assert_eq!(head.as_slice().len(), HEADER_LEN + 5);
        let f = decode(head.as_slice()).expect("decode");
        assert_eq!(f.body, FrameBody::Data(b"hello"));
        assert_eq!(f.header, h);
    }

    #[test]
    fn rts_round_trips() {
        let trace = TraceHeader {
            trace_id: 0xdead_beef,
            send_ts_us: 42,
            flags: TraceFlags(TraceFlags::SAMPLED),
        };
        let rts = Rts {
            total_len: 1 << 30,
            source: RemoteAddr {
                addr: 0x1000,
                rkey: Rkey(99),
            },
        };
        let head = HeadBuf::encode(
            &trace,
            &sample_header(MsgKind::Rts, RTS_BODY_LEN as u32),
            &FrameBody::Rts(rts),
        );
        let frame = decode(head.as_slice()).expect("decodes");
        assert_eq!(frame.trace, trace);
        assert_eq!(frame.body, FrameBody::Rts(rts));
        assert_eq!(frame.header.credits, 3);
        assert_eq!(frame.header.stream, 11);
        assert_eq!(frame.header.stream_credits, 2);
    }

    #[test]
    fn data_frame_carries_payload() {
        let head = HeadBuf::encode(
            &TraceHeader::default(),
            &sample_header(MsgKind::Data, 3),
            &FrameBody::Data(&[]),
        );
        let mut frame = head.as_slice().to_vec();
        frame.extend_from_slice(b"abc");
        let f = decode(&frame).expect("decodes");
        assert_eq!(f.body, FrameBody::Data(b"abc"));
        // A truncated payload is a length error, not a panic.
        assert!(matches!(
            decode(&frame[..frame.len() - 1]),
            Err(DecodeError::Length { .. })
        ));
    }

    #[test]
    fn control_kind_with_seq_is_refused() {
        let mut h = sample_header(MsgKind::Update, 0);
        h.seq = 9;
        let head = HeadBuf::encode(&TraceHeader::default(), &h, &FrameBody::Update);
        assert!(matches!(
            decode(head.as_slice()),
            Err(DecodeError::BadSeq { .. })
        ));
    }

    #[test]
    fn seq_expansion_crosses_the_32_bit_boundary() {
        assert_eq!(expand_seq(5, 3), 5);
        assert_eq!(expand_seq(2, (1 << 32) - 3), (1 << 32) + 2);
        assert_eq!(expand_seq(u32::MAX, (1 << 32) + 1), (1 << 32) - 1);
    }

    proptest! {
        /// The serial-number shortcut picks the same value as the search over the candidates.
        #[test]
        fn seq_expansion_matches_the_nearest_candidate(
            wire in any::<u32>(),
            reference in prop_oneof![any::<u64>(), 0u64..(1 << 33), (u64::MAX - (1 << 33))..=u64::MAX],
        ) {
            prop_assert_eq!(expand_seq(wire, reference), expand_seq_slow(wire, reference));
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn decode_never_panics_with_valid_magic(mut bytes in proptest::collection::vec(any::<u8>(), 40..120), kind in 0u8..6) {
            bytes[14..16].copy_from_slice(&MAGIC.to_le_bytes());
            bytes[26] = kind;
            if let Ok(f) = decode(&bytes) {
                // Whatever decodes stays inside the input.
                if let FrameBody::Data(p) = f.body {
                    prop_assert!(p.len() <= bytes.len() - HEADER_LEN);
                }
            }
        }

        #[test]
        fn headers_round_trip(trace_id: u64, ts: u32, flags: u16, seq in 1u32.., ack: u32, credits: u16, fin_seq: u32, kind in 0usize..3, stream: u32, sc: u32) {
            let trace = TraceHeader { trace_id, send_ts_us: ts, flags: TraceFlags(flags) };
            let (h, body) = match kind {
                0 => (MsgHeader { seq, ack, credits, kind: MsgKind::Data, len: 0, stream, stream_credits: sc }, FrameBody::Data(&[])),
                1 => (MsgHeader { seq: 0, ack, credits, kind: MsgKind::Fin, len: FIN_BODY_LEN as u32, stream, stream_credits: sc }, FrameBody::Fin { seq: fin_seq }),
                _ => (MsgHeader { seq: 0, ack, credits, kind: MsgKind::Update, len: 0, stream, stream_credits: sc }, FrameBody::Update),
            };
            let head = HeadBuf::encode(&trace, &h, &body);
            let f = decode(head.as_slice()).expect("own encoding decodes");
            prop_assert_eq!(f.trace, trace);
            prop_assert_eq!(f.header, h);
            prop_assert_eq!(f.body, body);
        }
    }
}
