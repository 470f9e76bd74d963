//! Latency percentiles and max/avg balance, as the papers report them.

use serde::Serialize;

/// Mean and percentiles of a set of samples, in the samples' unit.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Percentiles {
    /// Summarises `samples` (sorted in place; NaNs sort last). Nearest-rank percentiles.
    pub fn of(samples: &mut [f64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable_by(f64::total_cmp);
        let n = samples.len();
        let rank = |q: f64| samples[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
        Self {
            count: n as u64,
            mean: samples.iter().sum::<f64>() / n as f64,
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: samples[n - 1],
        }
    }
}

/// Max over avg of `loads` (1.0 is perfect balance); `None` when every load is zero.
pub fn max_over_avg(loads: &[f64]) -> Option<f64> {
    let sum: f64 = loads.iter().sum();
    if loads.is_empty() || sum <= 0.0 {
        return None;
    }
    let max = loads.iter().copied().fold(0.0, f64::max);
    Some(max / (sum / loads.len() as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let p = Percentiles::of(&mut v);
        assert_eq!(
            (p.count, p.p50, p.p90, p.p99, p.max),
            (100, 50.0, 90.0, 99.0, 100.0)
        );
        assert!((p.mean - 50.5).abs() < 1e-12);
        assert_eq!(Percentiles::of(&mut []), Percentiles::default());
    }

    #[test]
    fn balance() {
        assert_eq!(max_over_avg(&[1.0, 1.0, 1.0]), Some(1.0));
        assert_eq!(max_over_avg(&[3.0, 0.0, 0.0]), Some(3.0));
        assert_eq!(max_over_avg(&[0.0, 0.0]), None);
        assert_eq!(max_over_avg(&[]), None);
    }
}
