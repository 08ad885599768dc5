//! Serial-number arithmetic for 32-bit packet and message sequence numbers.
//!
//! Owns the wrap-around rules (RFC 1982 style): every comparison is made as a distance
//! from a reference (`snd_una` at the sender, `rcv_nxt` at the receiver), so sequence
//! numbers may wrap freely as long as the live window stays below 2^31.

/// `a - b` as a signed distance (negative when `a` is "before" `b`).
pub(crate) fn diff(a: u32, b: u32) -> i32 {
    a.wrapping_sub(b) as i32
}

/// `a` is strictly before `b`.
pub(crate) fn lt(a: u32, b: u32) -> bool {
    diff(a, b) < 0
}

/// `a` is before or equal to `b`.
pub(crate) fn le(a: u32, b: u32) -> bool {
    diff(a, b) <= 0
}

/// The later of `a` and `b`.
pub(crate) fn max(a: u32, b: u32) -> u32 {
    if lt(a, b) {
        b
    } else {
        a
    }
}

/// Unsigned distance from `from` forward to `to` (caller guarantees `from <= to`).
pub(crate) fn dist(from: u32, to: u32) -> u32 {
    to.wrapping_sub(from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparisons_wrap() {
        assert!(lt(u32::MAX, 0));
        assert!(lt(u32::MAX - 5, 3));
        assert!(!lt(3, u32::MAX - 5));
        assert!(le(7, 7));
        assert_eq!(max(u32::MAX, 2), 2);
        assert_eq!(dist(u32::MAX, 1), 2);
        assert_eq!(diff(1, u32::MAX), 2);
    }
}
