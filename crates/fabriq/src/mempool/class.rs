//! Size-class arithmetic: powers of two from `min_class` to `max_class`, O(1) length → class.

/// The size classes of a pool: powers of two from `min` to `max` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeClasses {
    min_shift: u32,
    max_shift: u32,
}

impl SizeClasses {
    /// Classes from `min` to `max` bytes; both must be powers of two with `min <= max` (checked
    /// by [`super::PoolConfig::validate`]).
    pub fn new(min: usize, max: usize) -> Self {
        assert!(
            min.is_power_of_two() && max.is_power_of_two() && min <= max,
            "size classes need powers of two with min <= max"
        );
        SizeClasses {
            min_shift: min.trailing_zeros(),
            max_shift: max.trailing_zeros(),
        }
    }

    /// Number of classes.
    pub fn count(&self) -> usize {
        (self.max_shift - self.min_shift + 1) as usize
    }

    /// The smallest class holding `len` bytes, or `None` above the largest.
    #[inline]
    pub fn class_of(&self, len: usize) -> Option<usize> {
        if len <= 1 << self.min_shift {
            return Some(0);
        }
        // ceil(log2(len)) for len >= 2.
        let shift = usize::BITS - (len - 1).leading_zeros();
        if shift > self.max_shift {
            None
        } else {
            Some((shift - self.min_shift) as usize)
        }
    }

    /// Bytes of class `class`.
    #[inline]
    pub fn size_of(&self, class: usize) -> usize {
        1usize << (self.min_shift as usize + class)
    }

    /// Largest class size.
    pub fn max_size(&self) -> usize {
        1usize << self.max_shift
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_every_length_with_the_smallest_fit() {
        let c = SizeClasses::new(64, 65536);
        assert_eq!(c.count(), 11);
        assert_eq!(c.class_of(0), Some(0));
        assert_eq!(c.class_of(1), Some(0));
        assert_eq!(c.class_of(64), Some(0));
        assert_eq!(c.class_of(65), Some(1));
        assert_eq!(c.class_of(128), Some(1));
        assert_eq!(c.class_of(65536), Some(10));
        assert_eq!(c.class_of(65537), None);
        assert_eq!(c.class_of(usize::MAX), None);
        for len in 1..=65536usize {
            let k = c.class_of(len).unwrap();
            assert!(c.size_of(k) >= len);
            assert!(k == 0 || c.size_of(k - 1) < len, "len {len} class {k}");
        }
    }
}
