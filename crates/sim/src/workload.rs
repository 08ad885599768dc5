//! Flow-size distributions for workload traffic.
//!
//! Owns the empirical CDFs shipped with the crate (`data/*.cdf`: "size cumulative-probability"
//! per line) and sampling from them by inverse transform with linear interpolation between
//! points. Arrival processes live in `sim`.

use rand::Rng;

/// An empirical flow-size CDF.
#[derive(Clone, Debug, PartialEq)]
pub struct Cdf {
    /// (size in bytes, cumulative probability), both non-decreasing, last probability 1.
    points: Vec<(f64, f64)>,
}

const WEB_SEARCH: &str = include_str!("../data/web_search.cdf");

impl Cdf {
    /// A shipped distribution by name: `"web_search"`.
    pub fn by_name(name: &str) -> Option<Cdf> {
        match name {
            "web_search" => Cdf::parse(WEB_SEARCH),
            _ => None,
        }
    }

    /// Parses "size probability" lines (`#` starts a comment). `None` if the points are not
    /// monotone or do not end at probability 1.
    pub fn parse(text: &str) -> Option<Cdf> {
        let mut points = Vec::new();
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut it = line.split_whitespace();
            let size: f64 = it.next()?.parse().ok()?;
            let p: f64 = it.next()?.parse().ok()?;
            if it.next().is_some() || !size.is_finite() || !(0.0..=1.0).contains(&p) {
                return None;
            }
            if let Some(&(ls, lp)) = points.last() {
                if size < ls || p < lp {
                    return None;
                }
            }
            points.push((size, p));
        }
        match points.last() {
            Some(&(_, p)) if (p - 1.0).abs() < 1e-9 && points.len() >= 2 => Some(Cdf { points }),
            _ => None,
        }
    }

    /// The size at cumulative probability `u` in [0, 1].
    pub fn quantile(&self, u: f64) -> f64 {
        let mut prev = self.points[0];
        for &(s, p) in &self.points[1..] {
            if u <= p {
                if p <= prev.1 {
                    return s;
                }
                return prev.0 + (s - prev.0) * (u - prev.1) / (p - prev.1);
            }
            prev = (s, p);
        }
        prev.0
    }

    /// Draws one flow size in bytes (at least 1).
    pub fn sample<R: Rng>(&self, rng: &mut R) -> u64 {
        (self.quantile(rng.gen::<f64>()).round() as u64).max(1)
    }

    /// Mean flow size in bytes (exact for the piecewise-linear CDF).
    pub fn mean(&self) -> f64 {
        self.points
            .windows(2)
            .map(|w| (w[1].1 - w[0].1) * (w[0].0 + w[1].0) / 2.0)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    #[test]
    fn web_search_cdf_is_shipped_and_sane() {
        let c = Cdf::by_name("web_search").unwrap();
        assert_eq!(c.quantile(0.15), 10_000.0);
        assert_eq!(c.quantile(1.0), 30_000_000.0);
        assert!((c.quantile(0.65) - 600_000.0).abs() < 1.0);
        let mean = c.mean();
        assert!(mean > 1.0e6 && mean < 3.0e6, "mean {mean}");
        let mut rng = SmallRng::seed_from_u64(5);
        let n = 200_000;
        let avg = (0..n).map(|_| c.sample(&mut rng) as f64).sum::<f64>() / n as f64;
        assert!(
            (avg / mean - 1.0).abs() < 0.05,
            "sampled mean {avg} vs {mean}"
        );
    }

    #[test]
    fn malformed_cdfs_are_rejected() {
        assert!(Cdf::parse("0 0\n10 0.5\n").is_none(), "does not reach 1");
        assert!(Cdf::parse("0 0\n10 0.6\n5 1\n").is_none(), "sizes decrease");
        assert!(Cdf::parse("0 0\nx 1\n").is_none());
        assert!(Cdf::parse("0 0\n10 1 3\n").is_none());
        assert!(Cdf::by_name("nope").is_none());
    }
}
