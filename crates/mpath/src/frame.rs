//! Wire format of MP-RDMA packets: data, ACK and NACK headers.
//!
//! Owns the byte layout and nothing else: no sequence-number interpretation, no state.
//! [`decode`] never panics and never allocates; every length is checked against the
//! buffer first. The connection (`crate::connection`) expands the 32-bit wire PSN/MSN
//! values against its own state.
//!
//! Layout (network byte order). Every packet starts with the same 4 bytes:
//!
//! ```text
//!  0       1       2               4
//!  +-------+-------+---------------+
//!  |ver|knd| flags |   VP id (u16) |
//!  +-------+-------+---------------+
//! ```
//!
//! `ver` is the high nibble (1), `knd` the low nibble: 1 data, 2 ACK, 3 NACK.
//!
//! Data (28 bytes, then `payload_len` payload bytes unless the VIRTUAL flag is set):
//! `PSN u32 | MSN u32 | iPSN u32 | timestamp u64 (ns, echoed by the ACK) |
//! payload_len u16 | reserved u16 = 0`. Flags: SYNC 0x01, RETX 0x02, TAIL 0x04
//! (last packet of its message), VIRTUAL 0x08 (payload not carried, only counted).
//!
//! ACK and NACK (24 bytes): `SACK/lost PSN u32 | AACK u32 | timestamp echo u64 |
//! reserved u32 = 0`. Flags: ECE 0x01, SYNC echo 0x02, RETX echo 0x04. In a NACK the
//! first field is the PSN the receiver asks to have retransmitted.
#![deny(
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::panic,
    clippy::expect_used
)]

use thiserror::Error;

use crate::PathId;

/// Protocol version carried in the high nibble of the first byte.
pub const VERSION: u8 = 1;
/// Length of the data header in bytes.
pub const DATA_HEADER_LEN: usize = 28;
/// Length of the ACK and NACK headers in bytes.
pub const ACK_HEADER_LEN: usize = 24;

const KIND_DATA: u8 = 1;
const KIND_ACK: u8 = 2;
const KIND_NACK: u8 = 3;

const DATA_SYNC: u8 = 0x01;
const DATA_RETX: u8 = 0x02;
const DATA_TAIL: u8 = 0x04;
const DATA_VIRTUAL: u8 = 0x08;
const DATA_FLAGS: u8 = DATA_SYNC | DATA_RETX | DATA_TAIL | DATA_VIRTUAL;

const ACK_ECE: u8 = 0x01;
const ACK_SYNC: u8 = 0x02;
const ACK_RETX: u8 = 0x04;
const ACK_FLAGS: u8 = ACK_ECE | ACK_SYNC | ACK_RETX;

/// A datagram that is not a well-formed MP-RDMA packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Shorter than the header its kind requires.
    #[error("truncated packet: {len} bytes, header needs {need}")]
    Truncated {
        /// Bytes present.
        len: usize,
        /// Bytes the header needs.
        need: usize,
    },
    /// Unknown protocol version.
    #[error("unsupported protocol version {0}")]
    Version(u8),
    /// Unknown packet kind.
    #[error("unknown packet kind {0}")]
    Kind(u8),
    /// Flag bits this version does not define, or a reserved field not zero.
    #[error("reserved bits set")]
    Reserved,
    /// The payload length in the header disagrees with the bytes present.
    #[error("payload length mismatch: header says {header}, datagram carries {actual}")]
    PayloadLength {
        /// Length the header announces.
        header: usize,
        /// Bytes after the header.
        actual: usize,
    },
    /// Well-formed, but contradicts the connection's state (e.g. acknowledges a PSN
    /// never sent, or a message whose packets disagree). The packet was ignored.
    #[error("protocol violation: {0}")]
    Protocol(&'static str),
}

/// Header of a data packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DataHeader {
    /// Virtual path the sender chose (echoed by the ACK).
    pub path: PathId,
    /// Packet sequence number, contiguous across messages.
    pub psn: u32,
    /// Message sequence number.
    pub msn: u32,
    /// Packet offset within its message (0 for the first packet).
    pub ipsn: u32,
    /// Sender's send time in nanoseconds, echoed by the ACK for RTT measurement.
    pub timestamp: u64,
    /// Payload bytes this packet carries (or stands for, when `is_virtual`).
    pub payload_len: u16,
    /// The message must be applied only after all earlier messages are complete.
    pub synchronise: bool,
    /// This is a retransmission.
    pub retransmit: bool,
    /// Last packet of its message.
    pub tail: bool,
    /// The payload is not carried, only its length (simulation).
    pub is_virtual: bool,
}

/// Header of an ACK.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AckHeader {
    /// The virtual path of the data packet being acknowledged (echo).
    pub path: PathId,
    /// Selective ACK: the PSN just received.
    pub sack: u32,
    /// Cumulative ACK: every PSN below this was received.
    pub aack: u32,
    /// The data packet's timestamp, echoed.
    pub timestamp_echo: u64,
    /// ECN echo: the data packet arrived with CE set.
    pub ece: bool,
    /// Echo of the data packet's synchronise flag.
    pub synchronise: bool,
    /// Echo of the data packet's retransmit flag.
    pub retransmit: bool,
}

/// Header of a NACK: asks for one PSN to be retransmitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct NackHeader {
    /// The virtual path of the data packet that triggered the NACK (echo).
    pub path: PathId,
    /// The PSN the receiver is missing.
    pub lost: u32,
    /// Cumulative ACK at the receiver.
    pub aack: u32,
    /// The triggering data packet's timestamp, echoed.
    pub timestamp_echo: u64,
    /// ECN echo of the triggering data packet.
    pub ece: bool,
    /// The NACK reports a synchronise packet dropped for arriving early.
    pub synchronise: bool,
    /// Echo of the triggering data packet's retransmit flag.
    pub retransmit: bool,
}

/// One decoded packet, borrowing its payload from the datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A data packet and its payload (empty when virtual).
    Data(DataHeader, &'a [u8]),
    /// An acknowledgement.
    Ack(AckHeader),
    /// A negative acknowledgement.
    Nack(NackHeader),
}

fn first_byte(kind: u8) -> u8 {
    (VERSION << 4) | kind
}

/// Appends a data packet (header, then `payload` unless `header.is_virtual`) to `out`.
///
/// `payload.len()` must equal `header.payload_len` for a non-virtual packet; a virtual
/// packet writes no payload bytes whatever `payload` holds.
pub fn encode_data(header: &DataHeader, payload: &[u8], out: &mut Vec<u8>) {
    let mut flags = 0u8;
    if header.synchronise {
        flags |= DATA_SYNC;
    }
    if header.retransmit {
        flags |= DATA_RETX;
    }
    if header.tail {
        flags |= DATA_TAIL;
    }
    if header.is_virtual {
        flags |= DATA_VIRTUAL;
    }
    let mut w = HeaderWriter::<DATA_HEADER_LEN>::new();
    w.put(&[first_byte(KIND_DATA), flags]);
    w.put(&header.path.0.to_be_bytes());
    w.put(&header.psn.to_be_bytes());
    w.put(&header.msn.to_be_bytes());
    w.put(&header.ipsn.to_be_bytes());
    w.put(&header.timestamp.to_be_bytes());
    w.put(&header.payload_len.to_be_bytes());
    // Last 2 bytes: reserved, zero.
    if header.is_virtual {
        out.extend_from_slice(&w.buf);
    } else {
        out.reserve(DATA_HEADER_LEN + payload.len());
        out.extend_from_slice(&w.buf);
        out.extend_from_slice(payload);
    }
}

/// Builds a fixed-size header on the stack so it is appended with one copy.
struct HeaderWriter<const N: usize> {
    buf: [u8; N],
    at: usize,
}

impl<const N: usize> HeaderWriter<N> {
    fn new() -> Self {
        HeaderWriter { buf: [0; N], at: 0 }
    }

    /// Writes `bytes` next; the callers' layouts fit `N` by construction (a write past
    /// the end would be dropped, never a panic).
    fn put(&mut self, bytes: &[u8]) {
        let end = self.at + bytes.len();
        if let Some(dst) = self.buf.get_mut(self.at..end) {
            dst.copy_from_slice(bytes);
        }
        self.at = end;
    }
}

fn encode_ack_like(
    kind: u8,
    path: PathId,
    first: u32,
    aack: u32,
    ts: u64,
    flags: u8,
    out: &mut Vec<u8>,
) {
    let mut w = HeaderWriter::<ACK_HEADER_LEN>::new();
    w.put(&[first_byte(kind), flags]);
    w.put(&path.0.to_be_bytes());
    w.put(&first.to_be_bytes());
    w.put(&aack.to_be_bytes());
    w.put(&ts.to_be_bytes());
    // Last 4 bytes: reserved, zero.
    out.extend_from_slice(&w.buf);
}

fn ack_flags(ece: bool, sync: bool, retx: bool) -> u8 {
    (if ece { ACK_ECE } else { 0 })
        | (if sync { ACK_SYNC } else { 0 })
        | (if retx { ACK_RETX } else { 0 })
}

/// Appends an ACK to `out`.
pub fn encode_ack(header: &AckHeader, out: &mut Vec<u8>) {
    let flags = ack_flags(header.ece, header.synchronise, header.retransmit);
    encode_ack_like(
        KIND_ACK,
        header.path,
        header.sack,
        header.aack,
        header.timestamp_echo,
        flags,
        out,
    );
}

/// Appends a NACK to `out`.
pub fn encode_nack(header: &NackHeader, out: &mut Vec<u8>) {
    let flags = ack_flags(header.ece, header.synchronise, header.retransmit);
    encode_ack_like(
        KIND_NACK,
        header.path,
        header.lost,
        header.aack,
        header.timestamp_echo,
        flags,
        out,
    );
}

/// Appends any frame to `out`.
pub fn encode(frame: &Frame<'_>, out: &mut Vec<u8>) {
    match frame {
        Frame::Data(h, p) => encode_data(h, p, out),
        Frame::Ack(h) => encode_ack(h, out),
        Frame::Nack(h) => encode_nack(h, out),
    }
}

/// A bounds-checked big-endian reader over a header.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        match self.buf.split_first_chunk::<N>() {
            Some((head, rest)) => {
                self.buf = rest;
                Ok(*head)
            }
            None => Err(DecodeError::Truncated {
                len: self.buf.len(),
                need: N,
            }),
        }
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        self.take::<2>().map(u16::from_be_bytes)
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.take::<4>().map(u32::from_be_bytes)
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        self.take::<8>().map(u64::from_be_bytes)
    }
}

/// Decodes one datagram. Never panics, never allocates.
pub fn decode(datagram: &[u8]) -> Result<Frame<'_>, DecodeError> {
    let Some(&[b0, flags, p0, p1]) = datagram.first_chunk::<4>() else {
        return Err(DecodeError::Truncated {
            len: datagram.len(),
            need: 4,
        });
    };
    let version = b0 >> 4;
    if version != VERSION {
        return Err(DecodeError::Version(version));
    }
    let kind = b0 & 0x0f;
    let path = PathId(u16::from_be_bytes([p0, p1]));
    let need = match kind {
        KIND_DATA => DATA_HEADER_LEN,
        KIND_ACK | KIND_NACK => ACK_HEADER_LEN,
        other => return Err(DecodeError::Kind(other)),
    };
    let Some((header, rest)) = datagram.split_at_checked(need) else {
        return Err(DecodeError::Truncated {
            len: datagram.len(),
            need,
        });
    };
    let mut r = Reader {
        buf: header.get(4..).unwrap_or_default(),
    };
    match kind {
        KIND_DATA => {
            if flags & !DATA_FLAGS != 0 {
                return Err(DecodeError::Reserved);
            }
            let psn = r.u32()?;
            let msn = r.u32()?;
            let ipsn = r.u32()?;
            let timestamp = r.u64()?;
            let payload_len = r.u16()?;
            if r.u16()? != 0 {
                return Err(DecodeError::Reserved);
            }
            let is_virtual = flags & DATA_VIRTUAL != 0;
            let expected = if is_virtual {
                0
            } else {
                usize::from(payload_len)
            };
            if rest.len() != expected {
                return Err(DecodeError::PayloadLength {
                    header: expected,
                    actual: rest.len(),
                });
            }
            Ok(Frame::Data(
                DataHeader {
                    path,
                    psn,
                    msn,
                    ipsn,
                    timestamp,
                    payload_len,
                    synchronise: flags & DATA_SYNC != 0,
                    retransmit: flags & DATA_RETX != 0,
                    tail: flags & DATA_TAIL != 0,
                    is_virtual,
                },
                rest,
            ))
        }
        _ => {
            if flags & !ACK_FLAGS != 0 {
                return Err(DecodeError::Reserved);
            }
            let first = r.u32()?;
            let aack = r.u32()?;
            let ts = r.u64()?;
            if r.u32()? != 0 {
                return Err(DecodeError::Reserved);
            }
            if !rest.is_empty() {
                return Err(DecodeError::PayloadLength {
                    header: 0,
                    actual: rest.len(),
                });
            }
            let ece = flags & ACK_ECE != 0;
            let synchronise = flags & ACK_SYNC != 0;
            let retransmit = flags & ACK_RETX != 0;
            if kind == KIND_ACK {
                Ok(Frame::Ack(AckHeader {
                    path,
                    sack: first,
                    aack,
                    timestamp_echo: ts,
                    ece,
                    synchronise,
                    retransmit,
                }))
            } else {
                Ok(Frame::Nack(NackHeader {
                    path,
                    lost: first,
                    aack,
                    timestamp_echo: ts,
                    ece,
                    synchronise,
                    retransmit,
                }))
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn data_round_trip() {
        let h = DataHeader {
            path: PathId(63),
            psn: 0xdead_beef,
            msn: 7,
            ipsn: 3,
            timestamp: 123_456_789_012,
            payload_len: 5,
            synchronise: true,
            retransmit: false,
            tail: true,
            is_virtual: false,
        };
        let mut out = Vec::new();
        encode_data(&h, b"hello", &mut out);
        assert_eq!(out.len(), DATA_HEADER_LEN + 5);
        assert_eq!(decode(&out).unwrap(), Frame::Data(h, b"hello"));
    }

    #[test]
    fn wire_layout_is_stable() {
        let h = DataHeader {
            path: PathId(0x0102),
            psn: 0x0304_0506,
            msn: 0x0708_090a,
            ipsn: 0x0b0c_0d0e,
            timestamp: 0x1112_1314_1516_1718,
            payload_len: 2,
            synchronise: true,
            retransmit: true,
            tail: false,
            is_virtual: false,
        };
        let mut out = Vec::new();
        encode_data(&h, &[0xee, 0xff], &mut out);
        assert_eq!(
            out,
            [
                0x11, 0x03, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c,
                0x0d, 0x0e, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x00, 0x02, 0x00, 0x00,
                0xee, 0xff
            ]
        );
        out.clear();
        let a = AckHeader {
            path: PathId(5),
            sack: 6,
            aack: 7,
            timestamp_echo: 8,
            ece: true,
            synchronise: false,
            retransmit: true,
        };
        encode_ack(&a, &mut out);
        assert_eq!(
            out,
            [0x12, 0x05, 0, 5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0]
        );
    }

    #[test]
    fn virtual_data_carries_no_payload() {
        let h = DataHeader {
            payload_len: 1024,
            is_virtual: true,
            ..DataHeader::default()
        };
        let mut out = Vec::new();
        encode_data(&h, &[], &mut out);
        assert_eq!(out.len(), DATA_HEADER_LEN);
        assert_eq!(decode(&out).unwrap(), Frame::Data(h, &[]));
    }

    #[test]
    fn ack_and_nack_round_trip() {
        let a = AckHeader {
            path: PathId(9),
            sack: 10,
            aack: 4,
            timestamp_echo: 99,
            ece: true,
            synchronise: false,
            retransmit: true,
        };
        let mut out = Vec::new();
        encode_ack(&a, &mut out);
        assert_eq!(out.len(), ACK_HEADER_LEN);
        assert_eq!(decode(&out).unwrap(), Frame::Ack(a));
        let n = NackHeader {
            path: PathId(1),
            lost: 4,
            aack: 4,
            timestamp_echo: 1,
            ece: false,
            synchronise: true,
            retransmit: false,
        };
        out.clear();
        encode_nack(&n, &mut out);
        assert_eq!(decode(&out).unwrap(), Frame::Nack(n));
    }

    #[test]
    fn malformed_inputs_are_typed_errors() {
        assert!(matches!(decode(&[]), Err(DecodeError::Truncated { .. })));
        assert!(matches!(
            decode(&[0x21, 0, 0]),
            Err(DecodeError::Truncated { .. })
        ));
        assert_eq!(decode(&[0x19, 0, 0, 0]), Err(DecodeError::Kind(9)));
        assert_eq!(decode(&[0x31, 0, 0, 0]), Err(DecodeError::Version(3)));
        let mut out = Vec::new();
        encode_data(
            &DataHeader {
                payload_len: 4,
                ..DataHeader::default()
            },
            b"abcd",
            &mut out,
        );
        assert!(matches!(
            decode(&out[..out.len() - 1]),
            Err(DecodeError::PayloadLength {
                header: 4,
                actual: 3
            })
        ));
        out[1] = 0x80;
        assert_eq!(decode(&out), Err(DecodeError::Reserved));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn decode_never_panics_on_valid_prefixes(kind in 1u8..4, flags in any::<u8>(), body in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut bytes = vec![(VERSION << 4) | kind, flags, 0, 1];
            bytes.extend_from_slice(&body);
            let _ = decode(&bytes);
        }

        #[test]
        fn data_round_trips(psn in any::<u32>(), msn in any::<u32>(), ipsn in any::<u32>(), ts in any::<u64>(), len in 0usize..64, flags in 0u8..16) {
            let payload = vec![0xabu8; len];
            let h = DataHeader {
                path: PathId(psn as u16), psn, msn, ipsn, timestamp: ts, payload_len: len as u16,
                synchronise: flags & 1 != 0, retransmit: flags & 2 != 0, tail: flags & 4 != 0, is_virtual: flags & 8 != 0,
            };
            let mut out = Vec::new();
            encode_data(&h, &payload, &mut out);
            let expect: &[u8] = if h.is_virtual { &[] } else { &payload };
            prop_assert_eq!(decode(&out).unwrap(), Frame::Data(h, expect));
        }
    }
}
