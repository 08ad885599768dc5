//! RPC framing inside a channel message. A request or response is an ordinary channel message
//! whose trace flags say `RPC_REQUEST` / `RPC_RESPONSE`; its payload starts with a 12-byte
//! header (little endian):
//!
//! ```text
//! request:  call_id u64 | method u32          | body
//! response: call_id u64 | status u8 | 0 0 0  | body (status Ok: the reply; else UTF-8 detail)
//! ```
//!
//! Methods are named by the 32-bit FNV-1a hash of their name. Decoders return `Result`.
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

/// Bytes of the RPC header.
pub const RPC_HEADER_LEN: usize = 12;

/// The method id of a method name (32-bit FNV-1a).
pub fn method_id(name: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// Outcome code of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The handler answered.
    Ok,
    /// No handler for the method.
    UnknownMethod,
    /// The handler failed; the body says why.
    HandlerError,
}

impl Status {
    fn code(self) -> u8 {
        match self {
            Status::Ok => 0,
            Status::UnknownMethod => 1,
            Status::HandlerError => 2,
        }
    }
    fn from_code(c: u8) -> Result<Status, RpcDecodeError> {
        Ok(match c {
            0 => Status::Ok,
            1 => Status::UnknownMethod,
            2 => Status::HandlerError,
            other => return Err(RpcDecodeError::BadStatus(other)),
        })
    }
}

/// A malformed RPC message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RpcDecodeError {
    /// Shorter than the header.
    #[error("RPC message of {0} bytes is shorter than its {RPC_HEADER_LEN}-byte header")]
    Short(usize),
    /// Unknown status code.
    #[error("unknown RPC status {0}")]
    BadStatus(u8),
}

fn split(bytes: &[u8]) -> Result<([u8; RPC_HEADER_LEN], &[u8]), RpcDecodeError> {
    let head = bytes
        .get(..RPC_HEADER_LEN)
        .ok_or(RpcDecodeError::Short(bytes.len()))?;
    let mut h = [0u8; RPC_HEADER_LEN];
    h.copy_from_slice(head);
    Ok((h, bytes.get(RPC_HEADER_LEN..).unwrap_or(&[])))
}

fn u64_of(h: &[u8; RPC_HEADER_LEN]) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(h.get(..8).unwrap_or(&[0; 8]));
    u64::from_le_bytes(v)
}

/// Write a request header.
pub fn encode_request_header(call_id: u64, method: u32) -> [u8; RPC_HEADER_LEN] {
    let mut h = [0u8; RPC_HEADER_LEN];
    if let Some(d) = h.get_mut(..8) {
        d.copy_from_slice(&call_id.to_le_bytes());
    }
    if let Some(d) = h.get_mut(8..12) {
        d.copy_from_slice(&method.to_le_bytes());
    }
    h
}

/// Write a response header.
pub fn encode_response_header(call_id: u64, status: Status) -> [u8; RPC_HEADER_LEN] {
    let mut h = [0u8; RPC_HEADER_LEN];
    if let Some(d) = h.get_mut(..8) {
        d.copy_from_slice(&call_id.to_le_bytes());
    }
    if let Some(d) = h.get_mut(8) {
        *d = status.code();
    }
    h
}

/// Decode a request: (call id, method id, body).
pub fn decode_request(bytes: &[u8]) -> Result<(u64, u32, &[u8]), RpcDecodeError> {
    let (h, body) = split(bytes)?;
    let mut m = [0u8; 4];
    m.copy_from_slice(h.get(8..12).unwrap_or(&[0; 4]));
    Ok((u64_of(&h), u32::from_le_bytes(m), body))
}

/// Decode a response: (call id, status, body).
pub fn decode_response(bytes: &[u8]) -> Result<(u64, Status, &[u8]), RpcDecodeError> {
    let (h, body) = split(bytes)?;
    let status = Status::from_code(h.get(8).copied().unwrap_or(0))?;
    Ok((u64_of(&h), status, body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn headers_round_trip() {
        let mut req = encode_request_header(7, method_id("echo")).to_vec();
        req.extend_from_slice(b"hi");
        assert_eq!(decode_request(&req), Ok((7, method_id("echo"), &b"hi"[..])));
        let resp = encode_response_header(9, Status::UnknownMethod);
        assert_eq!(
            decode_response(&resp),
            Ok((9, Status::UnknownMethod, &b""[..]))
        );
        assert_ne!(method_id("echo"), method_id("ecgo"));
    }

    proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = decode_request(&bytes);
            let _ = decode_response(&bytes);
        }
    }
}
