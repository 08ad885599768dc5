//! Message sizes on the command line: `8`, `4K`, `64KiB`, `1M`, `2MB`, … (binary multiples, as
//! perftest), and the `-a` sweep.

use std::fmt;

/// Largest message `fabriq perf` accepts: one SGE carries at most `u32::MAX` bytes, and 1 GiB is
/// already far beyond any useful benchmark message.
pub const MAX_SIZE: u64 = 1 << 30;

/// Smallest and largest sizes of the `-a` sweep (powers of two).
pub const SWEEP_MIN: u32 = 2;
/// See [`SWEEP_MIN`].
pub const SWEEP_MAX: u32 = 8 << 20;

/// Why a size string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// Nothing given.
    #[error("empty size")]
    Empty,
    /// Not a number followed by an optional unit.
    #[error(
        "malformed size {0:?}: expected a number with an optional unit (K, KiB, M, MiB, G, GiB)"
    )]
    Malformed(String),
    /// Unknown unit.
    #[error("unknown unit {unit:?} in size {input:?}: use K, KiB, M, MiB, G or GiB")]
    UnknownUnit {
        /// The unit as written.
        unit: String,
        /// The whole input.
        input: String,
    },
    /// Zero bytes.
    #[error("size must be at least 1 byte")]
    Zero,
    /// Above [`MAX_SIZE`].
    #[error("size {0} bytes exceeds the limit of {MAX_SIZE} bytes")]
    TooLarge(u64),
}

/// A message size in bytes, 1..=[`MAX_SIZE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct MsgSize(pub u32);

impl fmt::Display for MsgSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", human(u64::from(self.0)))
    }
}

/// Parse a size with an optional binary unit. Units are case-insensitive; `B` alone means bytes.
pub fn parse_size(input: &str) -> Result<MsgSize, SizeError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(SizeError::Empty);
    }
    let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(digits_end);
    if digits.is_empty() {
        return Err(SizeError::Malformed(input.to_string()));
    }
    let value: u64 = digits.parse().map_err(|_| SizeError::TooLarge(u64::MAX))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => {
            return Err(SizeError::UnknownUnit {
                unit: other.to_string(),
                input: input.to_string(),
            })
        }
    };
    let bytes = value
        .checked_mul(mult)
        .ok_or(SizeError::TooLarge(u64::MAX))?;
    if bytes == 0 {
        return Err(SizeError::Zero);
    }
    if bytes > MAX_SIZE {
        return Err(SizeError::TooLarge(bytes));
    }
    // MAX_SIZE < u32::MAX, so this cannot fail after the check above.
    u32::try_from(bytes)
        .map(MsgSize)
        .map_err(|_| SizeError::TooLarge(bytes))
}

/// The `-a` sweep: every power of two from [`SWEEP_MIN`] to [`SWEEP_MAX`].
pub fn sweep() -> Vec<u32> {
    let mut out = Vec::new();
    let mut s = SWEEP_MIN;
    while s <= SWEEP_MAX {
        out.push(s);
        s *= 2;
    }
    out
}

/// `4096` → `4 KiB`, `8` → `8 B`, `1536` → `1536 B`.
pub fn human(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (mult, name) in UNITS {
        if bytes >= mult && bytes % mult == 0 {
            return format!("{} {name}", bytes / mult);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_binary_units() {
        assert_eq!(parse_size("8"), Ok(MsgSize(8)));
        assert_eq!(parse_size("4K"), Ok(MsgSize(4096)));
        assert_eq!(parse_size("4k"), Ok(MsgSize(4096)));
        assert_eq!(parse_size("64KiB"), Ok(MsgSize(65536)));
        assert_eq!(parse_size("1M"), Ok(MsgSize(1 << 20)));
        assert_eq!(parse_size("2MB"), Ok(MsgSize(2 << 20)));
        assert_eq!(parse_size("1GiB"), Ok(MsgSize(1 << 30)));
        assert_eq!(parse_size(" 16B "), Ok(MsgSize(16)));
    }

    #[test]
    fn bad_sizes_are_typed_errors() {
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert_eq!(parse_size("0"), Err(SizeError::Zero));
        assert!(matches!(parse_size("K"), Err(SizeError::Malformed(_))));
        assert!(matches!(parse_size("-4"), Err(SizeError::Malformed(_))));
        assert!(matches!(
            parse_size("4X"),
            Err(SizeError::UnknownUnit { .. })
        ));
        assert!(matches!(parse_size("2G"), Err(SizeError::TooLarge(_))));
        assert!(matches!(
            parse_size("99999999999999999999999"),
            Err(SizeError::TooLarge(_))
        ));
        assert!(matches!(
            parse_size("18446744073709551615G"),
            Err(SizeError::TooLarge(_))
        ));
    }

    #[test]
    fn sweep_is_powers_of_two_from_2_to_8_mib() {
        let s = sweep();
        assert_eq!(s.first(), Some(&2));
        assert_eq!(s.last(), Some(&(8 << 20)));
        assert_eq!(s.len(), 23);
        assert!(s.windows(2).all(|w| w[1] == 2 * w[0]));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(8), "8 B");
        assert_eq!(human(4096), "4 KiB");
        assert_eq!(human(1 << 20), "1 MiB");
        assert_eq!(human(1536), "1536 B");
    }
}
