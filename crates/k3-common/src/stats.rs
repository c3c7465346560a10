//! Statistics of repeated measurements: the one median and percentile definition of the project.
//!
//! Percentiles are nearest-rank; the median of an even count is the mean of the two middle samples.
//! A sample set that is empty or holds a non-finite value has no statistics (`None`, or NaN from
//! [`median`]), so a broken measurement never turns into a plausible number.

use serde::{Deserialize, Serialize};

/// Summary statistics of repeated measurements.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub n: usize,
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
}

impl Stats {
    /// Statistics of `samples`. `None` when empty or non-finite.
    pub fn from_samples(samples: &[f64]) -> Option<Stats> {
        let s = sorted_finite(samples)?;
        Some(Stats {
            n: s.len(),
            median: median_sorted(&s),
            p10: percentile_sorted(&s, 10.0),
            p90: percentile_sorted(&s, 90.0),
            p99: percentile_sorted(&s, 99.0),
            min: s[0],
            max: s[s.len() - 1],
        })
    }
}

/// Median of `samples`; NaN when empty or when any sample is not finite.
pub fn median(samples: &[f64]) -> f64 {
    sorted_finite(samples).map_or(f64::NAN, |s| median_sorted(&s))
}

/// Nearest-rank percentile `p` (0..=100) of `samples`; NaN when empty, non-finite, or `p` is out of range.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    if !(0.0..=100.0).contains(&p) {
        return f64::NAN;
    }
    sorted_finite(samples).map_or(f64::NAN, |s| percentile_sorted(&s, p))
}

/// Empirical CDF points `(value, fraction of samples <= value)`, ascending; empty for empty input.
pub fn cdf(samples: &[f64]) -> Vec<(f64, f64)> {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len() as f64;
    s.into_iter()
        .enumerate()
        .map(|(i, v)| (v, (i + 1) as f64 / n))
        .collect()
}

fn sorted_finite(samples: &[f64]) -> Option<Vec<f64>> {
    if samples.is_empty() || samples.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    Some(s)
}

fn median_sorted(s: &[f64]) -> f64 {
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

fn percentile_sorted(s: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny xorshift so the test needs no rand crate; the seed is printed.
    fn samples(seed: u64, n: usize) -> Vec<f64> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 1_000_000) as f64 / 1000.0
            })
            .collect()
    }

    #[test]
    fn percentiles_nearest_rank() {
        let samples: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = Stats::from_samples(&samples).unwrap();
        assert_eq!((s.n, s.min, s.max), (100, 1.0, 100.0));
        assert_eq!((s.p10, s.p90, s.p99), (10.0, 90.0, 99.0));
        assert_eq!(s.median, 50.5);
        assert_eq!(percentile(&samples, 0.0), 1.0);
        assert_eq!(percentile(&samples, 100.0), 100.0);
        assert!(percentile(&samples, 101.0).is_nan());
    }

    #[test]
    fn empty_or_non_finite_has_no_statistics() {
        assert!(Stats::from_samples(&[]).is_none());
        assert!(Stats::from_samples(&[1.0, f64::NAN]).is_none());
        assert!(median(&[]).is_nan());
        assert!(median(&[1.0, f64::INFINITY]).is_nan());
        assert!(cdf(&[]).is_empty());
    }

    #[test]
    fn median_splits_random_samples_in_half() {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(7, |d| d.as_nanos() as u64);
        for n in [1, 2, 3, 10, 101, 1000] {
            let x = samples(seed ^ n as u64, n);
            let m = median(&x);
            let below = x.iter().filter(|v| **v < m).count();
            let above = x.iter().filter(|v| **v > m).count();
            assert!(below <= n / 2 && above <= n / 2, "seed {seed} n {n}");
            assert_eq!(Stats::from_samples(&x).unwrap().median, m, "seed {seed}");
            let c = cdf(&x);
            assert_eq!(c.last().map(|p| p.1), Some(1.0), "seed {seed}");
            assert!(c.windows(2).all(|w| w[0].0 <= w[1].0), "seed {seed}");
        }
    }
}
