//! The 16-byte datagram header in front of every fabriq-mpath datagram, and the demultiplexing
//! key it carries. All integers big-endian.
//!
//! | offset | size | field                                                  |
//! |-------:|-----:|--------------------------------------------------------|
//! | 0      | 2    | magic `0x4651` ("FQ")                                  |
//! | 2      | 1    | version (2)                                            |
//! | 3      | 1    | kind: 0 = mpath datagram follows, 1 = CLOSE            |
//! | 4      | 4    | destination QP number (the receiver's)                 |
//! | 8      | 4    | source QP number (the sender's)                        |
//! | 12     | 2    | virtual path the sender stamped (echoed by mpath ACKs) |
//! | 14     | 2    | generation of the sender's connection (from its initial PSN) |
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

/// Header length.
pub(crate) const HEADER_LEN: usize = 16;
const MAGIC: u16 = 0x4651;
const VERSION: u8 = 2;

/// What follows the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A fabriq-mpath datagram.
    Mpath,
    /// The sending QP left its connection (ERROR, RESET, destroyed): best effort, the peer's
    /// mpath timeout is the fallback.
    Close,
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: Kind,
    pub dst_qpn: u32,
    pub src_qpn: u32,
    pub path: u16,
    /// The sender QP's connection generation: datagrams of an earlier connection of the same
    /// QP pair (before a RESET) are told apart and dropped.
    pub generation: u16,
}

impl Header {
    /// Encode into 16 bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        let kind = match self.kind {
            Kind::Mpath => 0u8,
            Kind::Close => 1u8,
        };
        b[..2].copy_from_slice(&MAGIC.to_be_bytes());
        b[2] = VERSION;
        b[3] = kind;
        b[4..8].copy_from_slice(&self.dst_qpn.to_be_bytes());
        b[8..12].copy_from_slice(&self.src_qpn.to_be_bytes());
        b[12..14].copy_from_slice(&self.path.to_be_bytes());
        b[14..16].copy_from_slice(&self.generation.to_be_bytes());
        b
    }

    /// Decode; `None` for anything that is not a fabriq udp datagram of this version.
    pub fn decode(buf: &[u8]) -> Option<(Header, &[u8])> {
        let (h, rest) = buf.split_first_chunk::<HEADER_LEN>()?;
        let [m0, m1, version, kind, d0, d1, d2, d3, s0, s1, s2, s3, p0, p1, g0, g1] = *h;
        if u16::from_be_bytes([m0, m1]) != MAGIC || version != VERSION {
            return None;
        }
        let kind = match kind {
            0 => Kind::Mpath,
            1 => Kind::Close,
            _ => return None,
        };
        Some((
            Header {
                kind,
                dst_qpn: u32::from_be_bytes([d0, d1, d2, d3]),
                src_qpn: u32::from_be_bytes([s0, s1, s2, s3]),
                path: u16::from_be_bytes([p0, p1]),
                generation: u16::from_be_bytes([g0, g1]),
            },
            rest,
        ))
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = Header {
            kind: Kind::Mpath,
            dst_qpn: 0x00ab_cdef,
            src_qpn: 7,
            path: 13,
            generation: 3,
        };
        let mut d = h.encode().to_vec();
        d.extend_from_slice(b"xyz");
        let (back, rest) = Header::decode(&d).expect("valid header");
        assert_eq!(back, h);
        assert_eq!(rest, b"xyz");
        assert!(Header::decode(&d[..15]).is_none());
        d[0] ^= 1;
        assert!(Header::decode(&d).is_none());
        let mut c = Header {
            kind: Kind::Close,
            ..h
        }
        .encode();
        assert_eq!(Header::decode(&c).map(|x| x.0.kind), Some(Kind::Close));
        c[3] = 9;
        assert!(Header::decode(&c).is_none());
    }
}
