//! What one message to send is held in until the peer has it: a registered pool buffer, or —
//! for a payload of at most [`SMALL_MAX`] bytes — the bytes themselves, which the core frames
//! straight behind the headers in the send slot (one SGE, no pool buffer to take, fill and give
//! back per message). Both are kept until the message is acknowledged.

use fabriq_verbs::{RemoteAddr, Sge};

use super::proto::OutPayload;
use super::wire::{MAX_HEAD_LEN, RTS_BODY_LEN};
use crate::mempool::PoolBuf;

/// The largest payload held in place: what the send slot has room for behind the headers
/// (the size of a rendezvous body, so a slot is no larger for it).
pub const SMALL_MAX: usize = RTS_BODY_LEN;
const _: () = assert!(super::wire::HEADER_LEN + SMALL_MAX <= MAX_HEAD_LEN);

/// A payload of at most [`SMALL_MAX`] bytes, held in place.
#[derive(Clone, Copy)]
pub struct SmallBuf {
    len: u8,
    bytes: [u8; SMALL_MAX],
}

impl SmallBuf {
    /// The concatenation of `parts`, or `None` when it is longer than [`SMALL_MAX`].
    pub fn from_parts(parts: &[&[u8]]) -> Option<SmallBuf> {
        let mut out = SmallBuf {
            len: 0,
            bytes: [0; SMALL_MAX],
        };
        let mut at = 0usize;
        for p in parts {
            let end = at.checked_add(p.len())?;
            out.bytes.get_mut(at..end)?.copy_from_slice(p);
            at = end;
        }
        out.len = at as u8;
        Some(out)
    }

    /// The payload.
    pub fn as_slice(&self) -> &[u8] {
        self.bytes.get(..usize::from(self.len)).unwrap_or(&[])
    }
}

impl std::fmt::Debug for SmallBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmallBuf").field("len", &self.len).finish()
    }
}

/// One message's payload on the sending side.
#[derive(Debug)]
pub enum OutBuf {
    /// In registered memory: gathered by the SEND, or READ by the peer (rendezvous).
    Pool(PoolBuf),
    /// Held in place, framed behind the headers.
    Small(SmallBuf),
}

impl OutBuf {
    /// Payload bytes.
    pub fn len(&self) -> usize {
        match self {
            OutBuf::Pool(b) => b.len(),
            OutBuf::Small(s) => usize::from(s.len),
        }
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The payload's bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            OutBuf::Pool(b) => b,
            OutBuf::Small(s) => s.as_slice(),
        }
    }
}

impl From<PoolBuf> for OutBuf {
    fn from(b: PoolBuf) -> OutBuf {
        OutBuf::Pool(b)
    }
}

impl OutPayload for OutBuf {
    fn len(&self) -> u64 {
        OutBuf::len(self) as u64
    }
    fn sge(&self) -> Option<Sge> {
        match self {
            OutBuf::Pool(b) => OutPayload::sge(b),
            OutBuf::Small(_) => None,
        }
    }
    fn remote(&self) -> Option<RemoteAddr> {
        match self {
            OutBuf::Pool(b) => OutPayload::remote(b),
            OutBuf::Small(_) => None,
        }
    }
    fn in_place(&self) -> Option<&[u8]> {
        match self {
            OutBuf::Pool(_) => None,
            OutBuf::Small(s) => Some(s.as_slice()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_buffers_hold_up_to_small_max_bytes_of_their_parts() {
        let s = SmallBuf::from_parts(&[b"ab", b"", b"cde"]).expect("fits");
        assert_eq!(s.as_slice(), b"abcde");
        let full = vec![7u8; SMALL_MAX];
        assert_eq!(
            SmallBuf::from_parts(&[&full]).expect("fits").as_slice(),
            &full[..]
        );
        assert!(SmallBuf::from_parts(&[&full, b"x"]).is_none());
        let b = OutBuf::Small(SmallBuf::from_parts(&[]).expect("empty"));
        assert!(b.is_empty());
        assert_eq!(OutPayload::in_place(&b), Some(&[][..]));
        assert!(OutPayload::sge(&b).is_none() && OutPayload::remote(&b).is_none());
    }
}
