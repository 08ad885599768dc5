//! The software-RC wire format: one frame per request or response, transport-agnostic.
//!
//! Owns: the byte layout of frames, their encoding into a caller's buffer, and a decoder that
//! never panics on peer input. Does not own: how frames travel (a TCP stream, a datagram), nor
//! what they mean to a QP (see [`super::requester`] and [`super::responder`]).
//!
//! Every frame starts with the same 16-byte header, all integers big-endian:
//!
//! | offset | size | field                                                    |
//! |-------:|-----:|----------------------------------------------------------|
//! | 0      | 4    | `len`: total frame length, header included               |
//! | 4      | 1    | `opcode`                                                 |
//! | 5      | 1    | `flags` (bit 0: solicited event)                         |
//! | 6      | 2    | reserved, sent as 0, ignored                             |
//! | 8      | 4    | `qpn`: destination QP number                             |
//! | 12     | 4    | `psn`: packet sequence number (meaning per opcode)       |
//!
//! Bodies per opcode are listed on [`Opcode`]. A stream transport reads `len` first; a
//! datagram transport carries exactly one frame per datagram. [`decode`] checks `len` against
//! the buffer and against a caller limit before anything else, so a peer cannot make the
//! receiver allocate or wait for more than the limit.
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

/// Size of the common header.
pub const HEADER_LEN: usize = 16;

/// Default upper bound on a frame's payload (64 MiB). Transports may choose a lower one.
pub const DEFAULT_MAX_PAYLOAD: usize = 64 << 20;

/// Wire protocol version carried in [`Frame::Hello`].
pub const PROTOCOL_VERSION: u16 = 4;

/// Frame flag: the receiver should raise a solicited event for the receive completion.
pub const FLAG_SOLICITED: u8 = 1 << 0;

/// The frame opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Opcode {
    /// SEND. Body: payload.
    Send = 0x01,
    /// SEND_WITH_IMM. Body: imm u32, payload.
    SendImm = 0x02,
    /// RDMA WRITE. Body: addr u64, rkey u32, payload.
    Write = 0x03,
    /// RDMA WRITE_WITH_IMM. Body: addr u64, rkey u32, imm u32, payload.
    WriteImm = 0x04,
    /// RDMA READ request. Body: addr u64, rkey u32, len u32.
    ReadReq = 0x05,
    /// Atomic compare-and-swap. Body: addr u64, rkey u32, compare u64, swap u64.
    CmpSwap = 0x06,
    /// Atomic fetch-and-add. Body: addr u64, rkey u32, add u64.
    FetchAdd = 0x07,
    /// Cumulative acknowledgement of every request up to and including `psn`. Body: empty.
    Ack = 0x10,
    /// Negative acknowledgement of request `psn`. Body: code u8, rnr_timer u8, reserved u16.
    Nak = 0x11,
    /// READ response for request `psn`. Body: payload.
    ReadResp = 0x12,
    /// Atomic response for request `psn`. Body: original value u64.
    AtomicResp = 0x13,
    /// Connection greeting: the connection carries QP `qpn` (the receiver's) to QP `src_qpn`
    /// (the sender's). Body: src_qpn u32, version u16, reserved u16.
    Hello = 0x20,
    /// End of a QP pair's use of a stream connection: the sender's QP (`src_qpn`) sends nothing
    /// more on it, so everything after the frame belongs to the connection's next use. Body:
    /// src_qpn u32, src_incarnation u32.
    Bye = 0x21,
}

impl Opcode {
    fn from_u8(v: u8) -> Option<Opcode> {
        Some(match v {
            0x01 => Opcode::Send,
            0x02 => Opcode::SendImm,
            0x03 => Opcode::Write,
            0x04 => Opcode::WriteImm,
            0x05 => Opcode::ReadReq,
            0x06 => Opcode::CmpSwap,
            0x07 => Opcode::FetchAdd,
            0x10 => Opcode::Ack,
            0x11 => Opcode::Nak,
            0x12 => Opcode::ReadResp,
            0x13 => Opcode::AtomicResp,
            0x20 => Opcode::Hello,
            0x21 => Opcode::Bye,
            _ => return None,
        })
    }
}

/// Why a NAK was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum NakCode {
    /// Receiver not ready: no receive posted. The requester retries after the RNR timer.
    Rnr = 1,
    /// Bad rkey, out of bounds, or missing access right.
    RemoteAccess = 2,
    /// Malformed or unsupported request, misaligned atomic, message longer than the receive.
    InvalidRequest = 3,
    /// The responder failed to complete the operation (bad receive buffer).
    RemoteOperation = 4,
    /// A request arrived out of sequence: the requester resends from `psn`.
    PsnSequence = 5,
}

impl NakCode {
    fn from_u8(v: u8) -> Option<NakCode> {
        Some(match v {
            1 => NakCode::Rnr,
            2 => NakCode::RemoteAccess,
            3 => NakCode::InvalidRequest,
            4 => NakCode::RemoteOperation,
            5 => NakCode::PsnSequence,
            _ => return None,
        })
    }
}

/// A decoded frame, borrowing its payload from the input buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A request from a requester to a responder.
    Request(Request<'a>),
    /// A response from a responder to a requester.
    Response(Response<'a>),
    /// Connection greeting.
    Hello {
        /// The receiver's QP the connection is for.
        dst_qpn: u32,
        /// The sender's QP.
        src_qpn: u32,
        /// Sender's protocol version.
        version: u16,
        /// The incarnation of the sender's QP (a QP's incarnation changes at every RESET).
        src_incarnation: u32,
        /// The incarnation of the receiver's QP the sender was connected to (from the endpoint
        /// it got at RTR); 0 when that endpoint named none.
        dst_incarnation: u32,
    },
    /// End of the sender's use of a stream connection (see [`Opcode::Bye`]).
    Bye {
        /// The receiver's QP the connection carried.
        dst_qpn: u32,
        /// The sender's QP.
        src_qpn: u32,
        /// The incarnation of the sender's QP.
        src_incarnation: u32,
    },
}

/// A request frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request<'a> {
    /// Destination QP.
    pub qpn: u32,
    /// Sequence number.
    pub psn: u32,
    /// Solicited-event flag.
    pub solicited: bool,
    /// Operation.
    pub op: RequestOp<'a>,
}

/// The operation of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOp<'a> {
    /// SEND, optionally with immediate data.
    Send {
        /// Immediate data.
        imm: Option<u32>,
        /// Payload.
        payload: &'a [u8],
    },
    /// RDMA WRITE, optionally with immediate data.
    Write {
        /// Target address.
        addr: u64,
        /// Target rkey.
        rkey: u32,
        /// Immediate data.
        imm: Option<u32>,
        /// Payload.
        payload: &'a [u8],
    },
    /// RDMA READ.
    Read {
        /// Source address.
        addr: u64,
        /// Source rkey.
        rkey: u32,
        /// Bytes to read.
        len: u32,
    },
    /// Compare-and-swap.
    CmpSwap {
        /// Target word.
        addr: u64,
        /// Target rkey.
        rkey: u32,
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// Fetch-and-add.
    FetchAdd {
        /// Target word.
        addr: u64,
        /// Target rkey.
        rkey: u32,
        /// Addend.
        add: u64,
    },
}

/// A response frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response<'a> {
    /// Destination QP (the requester's).
    pub qpn: u32,
    /// Sequence number of the request answered (for ACK: the last one acknowledged).
    pub psn: u32,
    /// What it says.
    pub kind: ResponseKind<'a>,
}

/// The body of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseKind<'a> {
    /// Every request up to `psn` was executed.
    Ack,
    /// Request `psn` was refused.
    Nak {
        /// Why.
        code: NakCode,
        /// For [`NakCode::Rnr`]: the responder's min RNR timer code.
        rnr_timer: u8,
    },
    /// Data of READ `psn`.
    ReadResp {
        /// The bytes read.
        payload: &'a [u8],
    },
    /// Original value of atomic `psn`.
    AtomicResp {
        /// The word before the operation.
        orig: u64,
    },
}

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The length field is smaller than the header or the opcode's fixed body.
    #[error("frame length {len} too small for opcode {opcode:#04x}")]
    TooShort {
        /// Length field.
        len: usize,
        /// Opcode byte.
        opcode: u8,
    },
    /// The length field exceeds the limit.
    #[error("frame length {len} exceeds the limit {limit}")]
    TooLong {
        /// Length field.
        len: usize,
        /// Limit in force.
        limit: usize,
    },
    /// Unknown opcode.
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// Unknown NAK code.
    #[error("unknown NAK code {0}")]
    UnknownNak(u8),
    /// A fixed-size frame carries trailing bytes.
    #[error("frame of opcode {opcode:#04x} has length {len}, expected {expected}")]
    BadLength {
        /// Opcode byte.
        opcode: u8,
        /// Length field.
        len: usize,
        /// Expected length.
        expected: usize,
    },
}

/// A bounds-checked big-endian reader over one frame.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).and_then(|b| b.first().copied())
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2)
            .and_then(|b| b.try_into().ok())
            .map(u16::from_be_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_be_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_be_bytes)
    }
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
}

/// Read the frame length announced at the start of `buf`, if 4 bytes are there.
pub fn peek_len(buf: &[u8]) -> Option<usize> {
    let b: [u8; 4] = buf.get(..4)?.try_into().ok()?;
    Some(u32::from_be_bytes(b) as usize)
}

/// Decode one frame from the front of `buf`.
///
/// Returns `Ok(None)` when `buf` holds only part of a frame (read more), or
/// `Ok(Some((frame, consumed)))`. `max_payload` bounds the payload; a length above it is an
/// error before any further byte is needed.
pub fn decode(buf: &[u8], max_payload: usize) -> Result<Option<(Frame<'_>, usize)>, WireError> {
    let Some(len) = peek_len(buf) else {
        return Ok(None);
    };
    let limit = max_payload.saturating_add(HEADER_LEN + 32);
    let opcode_byte = buf.get(4).copied().unwrap_or(0);
    if len < HEADER_LEN {
        return Err(WireError::TooShort {
            len,
            opcode: opcode_byte,
        });
    }
    if len > limit {
        return Err(WireError::TooLong { len, limit });
    }
    let Some(frame_bytes) = buf.get(..len) else {
        return Ok(None);
    };
    let frame = decode_frame(frame_bytes, max_payload)?;
    Ok(Some((frame, len)))
}

/// The start of a SEND, SEND_IMM, WRITE, WRITE_IMM or READ_RESP frame whose payload has not
/// all arrived: the frame with an empty payload, the bytes before the payload, and the payload
/// length.
///
/// Lets a stream transport place a large payload straight into memory instead of buffering
/// the whole frame. `Ok(None)`: another opcode, or the fixed part of the body is not there
/// yet (decode the frame whole with [`decode`]). Errors as [`decode`] for the length; other
/// malformations are left to [`decode`], once the frame is complete.
pub fn decode_head(
    buf: &[u8],
    max_payload: usize,
) -> Result<Option<(Frame<'_>, usize, usize)>, WireError> {
    let Some(len) = peek_len(buf) else {
        return Ok(None);
    };
    let op = buf.get(4).copied().unwrap_or(0);
    let body = match Opcode::from_u8(op) {
        Some(Opcode::Send) | Some(Opcode::ReadResp) => 0,
        Some(Opcode::SendImm) => 4,
        Some(Opcode::Write) => 12,
        Some(Opcode::WriteImm) => 16,
        _ => return Ok(None),
    };
    let head = HEADER_LEN + body;
    if len < head {
        return Ok(None);
    }
    let payload = len - head;
    if payload > max_payload {
        return Err(WireError::TooLong {
            len,
            limit: max_payload,
        });
    }
    let Some(head_bytes) = buf.get(..head) else {
        return Ok(None);
    };
    Ok(Some((
        decode_frame(head_bytes, max_payload)?,
        head,
        payload,
    )))
}

fn decode_frame<'a>(bytes: &'a [u8], max_payload: usize) -> Result<Frame<'a>, WireError> {
    let len = bytes.len();
    let mut r: Reader<'a> = Reader { buf: bytes };
    let short = |opcode: u8| WireError::TooShort { len, opcode };
    let _len = r.u32().ok_or(short(0))?;
    let op = r.u8().ok_or(short(0))?;
    let flags = r.u8().ok_or(short(op))?;
    let _reserved = r.u16().ok_or(short(op))?;
    let qpn = r.u32().ok_or(short(op))?;
    let psn = r.u32().ok_or(short(op))?;
    let opcode = Opcode::from_u8(op).ok_or(WireError::UnknownOpcode(op))?;
    let exact = |r: &Reader<'_>, body: usize| {
        if r.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::BadLength {
                opcode: op,
                len,
                expected: HEADER_LEN + body,
            })
        }
    };
    let payload_ok = |p: &[u8]| {
        if p.len() > max_payload {
            Err(WireError::TooLong {
                len,
                limit: max_payload,
            })
        } else {
            Ok(())
        }
    };
    let solicited = flags & FLAG_SOLICITED != 0;
    let req = |op: RequestOp<'a>| -> Frame<'a> {
        Frame::Request(Request {
            qpn,
            psn,
            solicited,
            op,
        })
    };
    let resp =
        |kind: ResponseKind<'a>| -> Frame<'a> { Frame::Response(Response { qpn, psn, kind }) };
    Ok(match opcode {
        Opcode::Send => {
            let payload = r.rest();
            payload_ok(payload)?;
            req(RequestOp::Send { imm: None, payload })
        }
        Opcode::SendImm => {
            let imm = r.u32().ok_or(short(op))?;
            let payload = r.rest();
            payload_ok(payload)?;
            req(RequestOp::Send {
                imm: Some(imm),
                payload,
            })
        }
        Opcode::Write | Opcode::WriteImm => {
            let addr = r.u64().ok_or(short(op))?;
            let rkey = r.u32().ok_or(short(op))?;
            let imm = if opcode == Opcode::WriteImm {
                Some(r.u32().ok_or(short(op))?)
            } else {
                None
            };
            let payload = r.rest();
            payload_ok(payload)?;
            req(RequestOp::Write {
                addr,
                rkey,
                imm,
                payload,
            })
        }
        Opcode::ReadReq => {
            let addr = r.u64().ok_or(short(op))?;
            let rkey = r.u32().ok_or(short(op))?;
            let rlen = r.u32().ok_or(short(op))?;
            exact(&r, 16)?;
            req(RequestOp::Read {
                addr,
                rkey,
                len: rlen,
            })
        }
        Opcode::CmpSwap => {
            let addr = r.u64().ok_or(short(op))?;
            let rkey = r.u32().ok_or(short(op))?;
            let compare = r.u64().ok_or(short(op))?;
            let swap = r.u64().ok_or(short(op))?;
            exact(&r, 28)?;
            req(RequestOp::CmpSwap {
                addr,
                rkey,
                compare,
                swap,
            })
        }
        Opcode::FetchAdd => {
            let addr = r.u64().ok_or(short(op))?;
            let rkey = r.u32().ok_or(short(op))?;
            let add = r.u64().ok_or(short(op))?;
            exact(&r, 20)?;
            req(RequestOp::FetchAdd { addr, rkey, add })
        }
        Opcode::Ack => {
            exact(&r, 0)?;
            resp(ResponseKind::Ack)
        }
        Opcode::Nak => {
            let code = r.u8().ok_or(short(op))?;
            let rnr_timer = r.u8().ok_or(short(op))?;
            let _reserved = r.u16().ok_or(short(op))?;
            exact(&r, 4)?;
            let code = NakCode::from_u8(code).ok_or(WireError::UnknownNak(code))?;
            resp(ResponseKind::Nak {
                code,
                rnr_timer: rnr_timer & 31,
            })
        }
        Opcode::ReadResp => {
            let payload = r.rest();
            payload_ok(payload)?;
            resp(ResponseKind::ReadResp { payload })
        }
        Opcode::AtomicResp => {
            let orig = r.u64().ok_or(short(op))?;
            exact(&r, 8)?;
            resp(ResponseKind::AtomicResp { orig })
        }
        Opcode::Hello => {
            let src_qpn = r.u32().ok_or(short(op))?;
            let version = r.u16().ok_or(short(op))?;
            let _reserved = r.u16().ok_or(short(op))?;
            let src_incarnation = r.u32().ok_or(short(op))?;
            let dst_incarnation = r.u32().ok_or(short(op))?;
            exact(&r, 16)?;
            Frame::Hello {
                dst_qpn: qpn,
                src_qpn,
                version,
                src_incarnation,
                dst_incarnation,
            }
        }
        Opcode::Bye => {
            let src_qpn = r.u32().ok_or(short(op))?;
            let src_incarnation = r.u32().ok_or(short(op))?;
            exact(&r, 8)?;
            Frame::Bye {
                dst_qpn: qpn,
                src_qpn,
                src_incarnation,
            }
        }
    })
}

/// Appends one frame to a buffer: header first, then fields, then payload; [`FrameWriter::finish`]
/// patches the length. Lets callers gather a payload straight from memory into the frame.
pub struct FrameWriter<'b> {
    out: &'b mut Vec<u8>,
    start: usize,
}

impl<'b> FrameWriter<'b> {
    /// Start a frame at the end of `out`.
    pub fn begin(out: &'b mut Vec<u8>, opcode: Opcode, flags: u8, qpn: u32, psn: u32) -> Self {
        let start = out.len();
        out.extend_from_slice(&[0, 0, 0, 0, opcode as u8, flags, 0, 0]);
        out.extend_from_slice(&qpn.to_be_bytes());
        out.extend_from_slice(&psn.to_be_bytes());
        FrameWriter { out, start }
    }
    /// Append a u8.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.out.push(v);
        self
    }
    /// Append a big-endian u16.
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.out.extend_from_slice(&v.to_be_bytes());
        self
    }
    /// Append a big-endian u32.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.out.extend_from_slice(&v.to_be_bytes());
        self
    }
    /// Append a big-endian u64.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.out.extend_from_slice(&v.to_be_bytes());
        self
    }
    /// Append raw bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.out.extend_from_slice(b);
        self
    }
    /// The buffer, to append payload in place (e.g. gathered from memory).
    pub fn buf(&mut self) -> &mut Vec<u8> {
        self.out
    }
    /// Patch the length field; returns the frame's length.
    pub fn finish(self) -> usize {
        let len = self.out.len() - self.start;
        let len32 = u32::try_from(len).unwrap_or(u32::MAX);
        if let Some(slot) = self.out.get_mut(self.start..self.start + 4) {
            slot.copy_from_slice(&len32.to_be_bytes());
        }
        len
    }
}

/// Append the header and fixed fields of a request (everything but the payload). The caller
/// appends the payload (if any) through the returned writer and calls `finish`.
pub fn begin_request<'b>(
    out: &'b mut Vec<u8>,
    qpn: u32,
    psn: u32,
    solicited: bool,
    op: &RequestOp<'_>,
) -> FrameWriter<'b> {
    let flags = if solicited { FLAG_SOLICITED } else { 0 };
    match *op {
        RequestOp::Send { imm: None, .. } => FrameWriter::begin(out, Opcode::Send, flags, qpn, psn),
        RequestOp::Send { imm: Some(imm), .. } => {
            let mut w = FrameWriter::begin(out, Opcode::SendImm, flags, qpn, psn);
            w.u32(imm);
            w
        }
        RequestOp::Write {
            addr, rkey, imm, ..
        } => {
            let code = if imm.is_some() {
                Opcode::WriteImm
            } else {
                Opcode::Write
            };
            let mut w = FrameWriter::begin(out, code, flags, qpn, psn);
            w.u64(addr).u32(rkey);
            if let Some(imm) = imm {
                w.u32(imm);
            }
            w
        }
        RequestOp::Read { addr, rkey, len } => {
            let mut w = FrameWriter::begin(out, Opcode::ReadReq, flags, qpn, psn);
            w.u64(addr).u32(rkey).u32(len);
            w
        }
        RequestOp::CmpSwap {
            addr,
            rkey,
            compare,
            swap,
        } => {
            let mut w = FrameWriter::begin(out, Opcode::CmpSwap, flags, qpn, psn);
            w.u64(addr).u32(rkey).u64(compare).u64(swap);
            w
        }
        RequestOp::FetchAdd { addr, rkey, add } => {
            let mut w = FrameWriter::begin(out, Opcode::FetchAdd, flags, qpn, psn);
            w.u64(addr).u32(rkey).u64(add);
            w
        }
    }
}

/// Encode a complete frame (payload included) at the end of `out`; returns its length.
pub fn encode(frame: &Frame<'_>, out: &mut Vec<u8>) -> usize {
    match frame {
        Frame::Request(r) => {
            let mut w = begin_request(out, r.qpn, r.psn, r.solicited, &r.op);
            match r.op {
                RequestOp::Send { payload, .. } | RequestOp::Write { payload, .. } => {
                    w.bytes(payload);
                }
                _ => {}
            }
            w.finish()
        }
        Frame::Response(r) => encode_response(r, out),
        Frame::Hello {
            dst_qpn,
            src_qpn,
            version,
            src_incarnation,
            dst_incarnation,
        } => {
            let mut w = FrameWriter::begin(out, Opcode::Hello, 0, *dst_qpn, 0);
            w.u32(*src_qpn)
                .u16(*version)
                .u16(0)
                .u32(*src_incarnation)
                .u32(*dst_incarnation);
            w.finish()
        }
        Frame::Bye {
            dst_qpn,
            src_qpn,
            src_incarnation,
        } => {
            let mut w = FrameWriter::begin(out, Opcode::Bye, 0, *dst_qpn, 0);
            w.u32(*src_qpn).u32(*src_incarnation);
            w.finish()
        }
    }
}

/// Encode a response at the end of `out`; returns its length.
pub fn encode_response(r: &Response<'_>, out: &mut Vec<u8>) -> usize {
    match r.kind {
        ResponseKind::Ack => FrameWriter::begin(out, Opcode::Ack, 0, r.qpn, r.psn).finish(),
        ResponseKind::Nak { code, rnr_timer } => {
            let mut w = FrameWriter::begin(out, Opcode::Nak, 0, r.qpn, r.psn);
            w.u8(code as u8).u8(rnr_timer & 31).u16(0);
            w.finish()
        }
        ResponseKind::ReadResp { payload } => {
            let mut w = FrameWriter::begin(out, Opcode::ReadResp, 0, r.qpn, r.psn);
            w.bytes(payload);
            w.finish()
        }
        ResponseKind::AtomicResp { orig } => {
            let mut w = FrameWriter::begin(out, Opcode::AtomicResp, 0, r.qpn, r.psn);
            w.u64(orig);
            w.finish()
        }
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(f: Frame<'_>) {
        let mut buf = Vec::new();
        let n = encode(&f, &mut buf);
        assert_eq!(n, buf.len());
        let (g, used) = decode(&buf, 1 << 20).unwrap().unwrap();
        assert_eq!(used, n);
        assert_eq!(f, g);
        // Every strict prefix is "incomplete", never an error or a wrong frame.
        for cut in 0..n {
            assert_eq!(decode(&buf[..cut], 1 << 20), Ok(None), "prefix {cut}");
        }
    }

    #[test]
    fn every_opcode_round_trips() {
        let p = b"hello";
        let reqs = [
            RequestOp::Send {
                imm: None,
                payload: p,
            },
            RequestOp::Send {
                imm: Some(7),
                payload: &[],
            },
            RequestOp::Write {
                addr: 1,
                rkey: 2,
                imm: None,
                payload: p,
            },
            RequestOp::Write {
                addr: u64::MAX,
                rkey: 3,
                imm: Some(9),
                payload: p,
            },
            RequestOp::Read {
                addr: 5,
                rkey: 6,
                len: 7,
            },
            RequestOp::CmpSwap {
                addr: 8,
                rkey: 9,
                compare: 10,
                swap: 11,
            },
            RequestOp::FetchAdd {
                addr: 8,
                rkey: 9,
                add: 12,
            },
        ];
        for op in reqs {
            roundtrip(Frame::Request(Request {
                qpn: 44,
                psn: 0xffff_ffff,
                solicited: true,
                op,
            }));
        }
        for kind in [
            ResponseKind::Ack,
            ResponseKind::Nak {
                code: NakCode::Rnr,
                rnr_timer: 12,
            },
            ResponseKind::ReadResp { payload: p },
            ResponseKind::AtomicResp { orig: 99 },
        ] {
            roundtrip(Frame::Response(Response {
                qpn: 1,
                psn: 2,
                kind,
            }));
        }
        roundtrip(Frame::Hello {
            dst_qpn: 1,
            src_qpn: 2,
            version: PROTOCOL_VERSION,
            src_incarnation: 3,
            dst_incarnation: 4,
        });
        roundtrip(Frame::Bye {
            dst_qpn: 5,
            src_qpn: 6,
            src_incarnation: 7,
        });
    }

    #[test]
    fn length_below_header_is_an_error() {
        let mut buf = vec![0u8; 32];
        buf[..4].copy_from_slice(&8u32.to_be_bytes());
        assert!(matches!(
            decode(&buf, 1024),
            Err(WireError::TooShort { .. })
        ));
    }

    #[test]
    fn length_above_limit_is_refused_before_the_bytes_arrive() {
        let buf = (u32::MAX).to_be_bytes();
        assert!(matches!(decode(&buf, 1024), Err(WireError::TooLong { .. })));
    }

    #[test]
    fn unknown_opcode_and_trailing_bytes_are_errors() {
        let mut buf = Vec::new();
        FrameWriter::begin(&mut buf, Opcode::Ack, 0, 1, 1).finish();
        buf[4] = 0x7f;
        assert_eq!(decode(&buf, 1024), Err(WireError::UnknownOpcode(0x7f)));
        let mut buf = Vec::new();
        let mut w = FrameWriter::begin(&mut buf, Opcode::Ack, 0, 1, 1);
        w.u8(0);
        w.finish();
        assert!(matches!(
            decode(&buf, 1024),
            Err(WireError::BadLength { .. })
        ));
        let mut buf = Vec::new();
        let mut w = FrameWriter::begin(&mut buf, Opcode::Nak, 0, 1, 1);
        w.u8(99).u8(0).u16(0);
        w.finish();
        assert_eq!(decode(&buf, 1024), Err(WireError::UnknownNak(99)));
    }

    #[test]
    fn payload_above_limit_is_an_error() {
        let mut buf = Vec::new();
        encode(
            &Frame::Request(Request {
                qpn: 1,
                psn: 1,
                solicited: false,
                op: RequestOp::Send {
                    imm: None,
                    payload: &[0; 64],
                },
            }),
            &mut buf,
        );
        assert!(matches!(decode(&buf, 16), Err(WireError::TooLong { .. })));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes, 128);
        }

        #[test]
        fn arbitrary_bodies_behind_valid_headers_never_panic(
            op in any::<u8>(),
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut buf = Vec::new();
            let len = (HEADER_LEN + body.len()) as u32;
            buf.extend_from_slice(&len.to_be_bytes());
            buf.extend_from_slice(&[op, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2]);
            buf.extend_from_slice(&body);
            if let Ok(Some((_, used))) = decode(&buf, 128) {
                prop_assert_eq!(used, buf.len());
            }
        }

        #[test]
        fn send_and_write_round_trip(
            qpn in any::<u32>(), psn in any::<u32>(), imm in any::<Option<u32>>(),
            addr in any::<u64>(), rkey in any::<u32>(), sol in any::<bool>(),
            payload in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            for op in [RequestOp::Send { imm, payload: &payload },
                       RequestOp::Write { addr, rkey, imm, payload: &payload }] {
                let f = Frame::Request(Request { qpn, psn, solicited: sol, op });
                let mut buf = Vec::new();
                encode(&f, &mut buf);
                let (g, used) = decode(&buf, 1 << 16).unwrap().unwrap();
                prop_assert_eq!(used, buf.len());
                prop_assert_eq!(&f, &g);
                // The head alone, from any prefix that holds it, names the same request.
                let Frame::Request(full) = f else { unreachable!() };
                for cut in 0..=buf.len().min(40) {
                    if let Some((head, at, plen)) = decode_head(&buf[..cut], 1 << 16).unwrap() {
                        prop_assert!(at <= cut);
                        prop_assert_eq!(at + plen, buf.len());
                        prop_assert_eq!(&buf[at..], &payload[..]);
                        let empty = match full.op {
                            RequestOp::Send { imm, .. } => RequestOp::Send { imm, payload: &[] },
                            RequestOp::Write { addr, rkey, imm, .. } => {
                                RequestOp::Write { addr, rkey, imm, payload: &[] }
                            }
                            other => other,
                        };
                        prop_assert_eq!(head, Frame::Request(Request { op: empty, ..full }));
                    }
                }
                prop_assert!(decode_head(&buf, 1 << 16).unwrap().is_some());
                // A payload above the limit is refused from the head.
                if !payload.is_empty() {
                    prop_assert!(decode_head(&buf, payload.len() - 1).is_err());
                }
            }
        }

        #[test]
        fn read_response_head_names_its_payload(
            qpn in any::<u32>(), psn in any::<u32>(),
            payload in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let f = Frame::Response(Response { qpn, psn, kind: ResponseKind::ReadResp { payload: &payload } });
            let mut buf = Vec::new();
            encode(&f, &mut buf);
            let (head, at, plen) = decode_head(&buf[..HEADER_LEN], 1 << 16).unwrap().unwrap();
            prop_assert_eq!((at, plen), (HEADER_LEN, payload.len()));
            prop_assert_eq!(
                head,
                Frame::Response(Response { qpn, psn, kind: ResponseKind::ReadResp { payload: &[] } })
            );
        }

        #[test]
        fn decode_head_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_head(&bytes, 128);
        }

        #[test]
        fn fixed_frames_round_trip(
            qpn in any::<u32>(), psn in any::<u32>(), addr in any::<u64>(), rkey in any::<u32>(),
            a in any::<u64>(), b in any::<u64>(), len in any::<u32>(), t in 0u8..32,
        ) {
            let frames = [
                Frame::Request(Request { qpn, psn, solicited: false, op: RequestOp::Read { addr, rkey, len } }),
                Frame::Request(Request { qpn, psn, solicited: false, op: RequestOp::CmpSwap { addr, rkey, compare: a, swap: b } }),
                Frame::Request(Request { qpn, psn, solicited: false, op: RequestOp::FetchAdd { addr, rkey, add: a } }),
                Frame::Response(Response { qpn, psn, kind: ResponseKind::AtomicResp { orig: b } }),
                Frame::Response(Response { qpn, psn, kind: ResponseKind::Nak { code: NakCode::PsnSequence, rnr_timer: t } }),
                Frame::Hello { dst_qpn: qpn, src_qpn: rkey, version: 1, src_incarnation: len, dst_incarnation: psn },
            ];
            for f in frames {
                let mut buf = Vec::new();
                encode(&f, &mut buf);
                let (g, used) = decode(&buf, 0).unwrap().unwrap();
                prop_assert_eq!(used, buf.len());
                prop_assert_eq!(f, g);
            }
        }
    }
}
