//! The truncated log-normal request-length distribution of paper 001 ("Prefill-as-a-Service"),
//! section 4.1, evaluated in closed form.
//!
//! For `L ~ LogNormal(mu, sigma)` truncated to `[a, b]`, with `z(x) = (ln x - mu) / sigma`,
//! `Phi` the standard normal CDF and `Z = Phi(z(b)) - Phi(z(a))`:
//!
//! - `P(L > t) = (Phi(z(b)) - Phi(z(t))) / Z`
//! - `E[L; x < L <= y] = exp(mu + sigma^2 / 2) (Phi(z(y) - sigma) - Phi(z(x) - sigma)) / Z`
//!
//! so the conditional means `E[L | L > t]` and `E[L | L <= t]` that the throughput model uses
//! as `l_long` and `l_short` need no sampling and no numerical integration.

use serde::{Deserialize, Serialize};

use crate::error::{CostModelError, Result, finite, positive};

/// The standard normal CDF, from `erfc` for accuracy in both tails.
fn phi(x: f64) -> f64 {
    0.5 * libm::erfc(-x / std::f64::consts::SQRT_2)
}

/// A log-normal distribution of request lengths (tokens) truncated to `[min, max]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "LogNormalSpec", into = "LogNormalSpec")]
pub struct TruncatedLogNormal {
    spec: LogNormalSpec,
    /// `Phi(z(min))`.
    phi_min: f64,
    /// `Phi(z(max))`.
    phi_max: f64,
    /// `exp(mu + sigma^2 / 2)`, the untruncated mean.
    scale: f64,
}

/// The parameters of a [`TruncatedLogNormal`], as they are written down.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LogNormalSpec {
    /// Mean of `ln L`.
    pub mu: f64,
    /// Standard deviation of `ln L`.
    pub sigma: f64,
    /// Smallest length, tokens.
    pub min_tokens: f64,
    /// Largest length, tokens.
    pub max_tokens: f64,
}

impl TryFrom<LogNormalSpec> for TruncatedLogNormal {
    type Error = CostModelError;

    fn try_from(spec: LogNormalSpec) -> Result<Self> {
        Self::new(spec.mu, spec.sigma, spec.min_tokens, spec.max_tokens)
    }
}

impl From<TruncatedLogNormal> for LogNormalSpec {
    fn from(d: TruncatedLogNormal) -> Self {
        d.spec
    }
}

impl TruncatedLogNormal {
    /// Paper 001 section 4.1's workload: mu = 9.90, sigma = 1.00, truncated to [128, 128K]
    /// (128K = 131072 tokens; its mean is about 27K).
    pub fn paper_001_workload() -> Self {
        Self::from_valid(LogNormalSpec {
            mu: 9.90,
            sigma: 1.00,
            min_tokens: 128.0,
            max_tokens: 131_072.0,
        })
    }

    /// Validates the parameters: finite `mu`, positive `sigma`, `0 < min < max`, and a range
    /// that holds probability mass.
    pub fn new(mu: f64, sigma: f64, min_tokens: f64, max_tokens: f64) -> Result<Self> {
        finite("mu", mu)?;
        positive("sigma", sigma)?;
        positive("min_tokens", min_tokens)?;
        positive("max_tokens", max_tokens)?;
        let spec = LogNormalSpec {
            mu,
            sigma,
            min_tokens,
            max_tokens,
        };
        let d = Self::from_valid(spec);
        if !(max_tokens > min_tokens && d.phi_max - d.phi_min > 0.0) {
            return Err(CostModelError::EmptyTruncation {
                min_tokens,
                max_tokens,
            });
        }
        Ok(d)
    }

    fn from_valid(spec: LogNormalSpec) -> Self {
        let z = |x: f64| (x.ln() - spec.mu) / spec.sigma;
        Self {
            spec,
            phi_min: phi(z(spec.min_tokens)),
            phi_max: phi(z(spec.max_tokens)),
            scale: (spec.mu + spec.sigma * spec.sigma / 2.0).exp(),
        }
    }

    /// The parameters.
    pub const fn spec(&self) -> &LogNormalSpec {
        &self.spec
    }

    fn z(&self, tokens: f64) -> f64 {
        let t = tokens.clamp(self.spec.min_tokens, self.spec.max_tokens);
        (t.ln() - self.spec.mu) / self.spec.sigma
    }

    fn mass(&self) -> f64 {
        self.phi_max - self.phi_min
    }

    /// `P(L <= t)`.
    pub fn cdf(&self, tokens: f64) -> f64 {
        (phi(self.z(tokens)) - self.phi_min) / self.mass()
    }

    /// `P(L > t)`: the fraction of requests a threshold `t` sends to PrfaaS.
    pub fn p_above(&self, tokens: f64) -> f64 {
        (self.phi_max - phi(self.z(tokens))) / self.mass()
    }

    /// `E[L; x < L <= y]`, the partial expectation over `(x, y]`.
    fn partial_mean(&self, z_low: f64, z_high: f64) -> f64 {
        let s = self.spec.sigma;
        self.scale * (phi(z_high - s) - phi(z_low - s)) / self.mass()
    }

    /// `E[L]`.
    pub fn mean(&self) -> f64 {
        let (lo, hi) = (self.z(self.spec.min_tokens), self.z(self.spec.max_tokens));
        self.partial_mean(lo, hi)
    }

    /// `E[L | L > t]` (`l_long`); `None` if no request is longer than `t`.
    pub fn mean_above(&self, tokens: f64) -> Option<f64> {
        let p = self.p_above(tokens);
        (p > 0.0).then(|| self.partial_mean(self.z(tokens), self.z(self.spec.max_tokens)) / p)
    }

    /// `E[L | L <= t]` (`l_short`); `None` if no request is that short.
    pub fn mean_at_or_below(&self, tokens: f64) -> Option<f64> {
        let p = self.cdf(tokens);
        (p > 0.0).then(|| self.partial_mean(self.z(self.spec.min_tokens), self.z(tokens)) / p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paper 001 sections 4.1 and 4.3.1: under mu = 9.90, sigma = 1.00 on [128, 128K], a
    /// threshold of t = 19.4K sends 49.6% of requests to PrfaaS with E[L | L > t] ~ 44K
    /// (closed form: 49.57% and 45.05K; tolerance 0.1 point and [44K, 45.5K]), and the
    /// distribution's mean is about 27K.
    #[test]
    fn paper_001_workload_splits_49_6_percent_above_19_4k_with_mean_44_to_45k() {
        let d = TruncatedLogNormal::paper_001_workload();
        let p = d.p_above(19_400.0);
        assert!((p - 0.496).abs() < 0.001, "{p}");
        let l_long = d.mean_above(19_400.0).unwrap();
        assert!((44_000.0..=45_500.0).contains(&l_long), "{l_long}");
        assert!(
            (d.mean() - 27_000.0).abs() / 27_000.0 < 0.03,
            "{}",
            d.mean()
        );
    }

    #[test]
    fn conditional_means_recombine_into_the_mean() {
        let d = TruncatedLogNormal::paper_001_workload();
        for t in [200.0, 5_000.0, 19_400.0, 80_000.0] {
            let p = d.p_above(t);
            let mixed = p * d.mean_above(t).unwrap() + (1.0 - p) * d.mean_at_or_below(t).unwrap();
            assert!((mixed - d.mean()).abs() / d.mean() < 1e-9, "t = {t}");
            assert!(d.mean_at_or_below(t).unwrap() <= t && d.mean_above(t).unwrap() > t);
        }
    }

    #[test]
    fn thresholds_outside_the_range_send_everything_one_way() {
        let d = TruncatedLogNormal::paper_001_workload();
        assert_eq!(d.p_above(50.0), 1.0);
        assert_eq!(d.mean_at_or_below(50.0), None);
        assert_eq!(d.p_above(1e9), 0.0);
        assert_eq!(d.mean_above(1e9), None);
    }

    #[test]
    fn bad_parameters_are_typed_errors() {
        assert!(TruncatedLogNormal::new(f64::NAN, 1.0, 1.0, 2.0).is_err());
        assert!(TruncatedLogNormal::new(9.9, 0.0, 1.0, 2.0).is_err());
        assert!(TruncatedLogNormal::new(9.9, 1.0, -1.0, 2.0).is_err());
        assert!(matches!(
            TruncatedLogNormal::new(9.9, 1.0, 5.0, 5.0),
            Err(CostModelError::EmptyTruncation { .. })
        ));
        // All mass far below the range: Phi rounds to 1 at both ends.
        assert!(matches!(
            TruncatedLogNormal::new(0.0, 0.01, 1e6, 2e6),
            Err(CostModelError::EmptyTruncation { .. })
        ));
    }

    #[test]
    fn deserialising_validates() {
        let bad = r#"{"mu":9.9,"sigma":-1.0,"min_tokens":128.0,"max_tokens":131072.0}"#;
        assert!(serde_json::from_str::<TruncatedLogNormal>(bad).is_err());
        let good = serde_json::to_string(&TruncatedLogNormal::paper_001_workload()).unwrap();
        assert_eq!(
            serde_json::from_str::<TruncatedLogNormal>(&good).unwrap(),
            TruncatedLogNormal::paper_001_workload()
        );
    }
}
