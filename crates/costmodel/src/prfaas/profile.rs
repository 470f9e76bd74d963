//! A request-length profile: KVCache size and prefill time at a few measured lengths,
//! interpolated log-log in between (both grow as power laws of the length, so a straight line
//! in log-log space is the natural interpolant; paper 001 section 3.2 notes prefill is near
//! quadratic and KV size linear at long lengths).
//!
//! Outside the measured range the nearest segment is extended, which keeps the power law of
//! that segment; say so when reporting a point beyond the table.

use serde::{Deserialize, Serialize};

use crate::error::{CostModelError, Result, positive};

/// Bytes per MiB: paper 001 table 5 gives KVCache sizes in MiB.
const MIB: f64 = 1_048_576.0;

/// One measured row of a profile.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ProfilePoint {
    /// Uncached input length, tokens.
    pub tokens: f64,
    /// KVCache produced, bytes.
    pub kv_bytes: f64,
    /// Prefill latency, seconds.
    pub prefill_s: f64,
}

/// A validated profile: at least two points, strictly increasing lengths, positive values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "Vec<ProfilePoint>", into = "Vec<ProfilePoint>")]
pub struct LengthProfile {
    points: Vec<ProfilePoint>,
}

impl TryFrom<Vec<ProfilePoint>> for LengthProfile {
    type Error = CostModelError;

    fn try_from(points: Vec<ProfilePoint>) -> Result<Self> {
        Self::new(points)
    }
}

impl From<LengthProfile> for Vec<ProfilePoint> {
    fn from(p: LengthProfile) -> Self {
        p.points
    }
}

impl LengthProfile {
    /// Validates and wraps measured points.
    pub fn new(points: Vec<ProfilePoint>) -> Result<Self> {
        if points.len() < 2 {
            return Err(CostModelError::ProfileTooShort(points.len()));
        }
        for (index, p) in points.iter().enumerate() {
            positive("profile tokens", p.tokens)?;
            positive("profile kv_bytes", p.kv_bytes)?;
            positive("profile prefill_s", p.prefill_s)?;
            if index > 0 && p.tokens <= points[index - 1].tokens {
                return Err(CostModelError::ProfileNotIncreasing { index });
            }
        }
        Ok(Self { points })
    }

    /// Paper 001 table 5: the internal 1T hybrid model (Kimi-Linear-style KDA:MLA = 3:1) on
    /// 8 x H200: KVCache 190.8 / 308.9 / 701.3 / 2316.3 MiB and prefill 0.44 / 0.72 / 1.84 /
    /// 7.40 s at 1K / 8K / 32K / 128K tokens.
    pub fn paper_001_table_5() -> Self {
        let row = |k: f64, mib: f64, s: f64| ProfilePoint {
            tokens: k * 1024.0,
            kv_bytes: mib * MIB,
            prefill_s: s,
        };
        Self {
            points: vec![
                row(1.0, 190.8, 0.44),
                row(8.0, 308.9, 0.72),
                row(32.0, 701.3, 1.84),
                row(128.0, 2316.3, 7.40),
            ],
        }
    }

    /// The measured points.
    pub fn points(&self) -> &[ProfilePoint] {
        &self.points
    }

    /// The same profile on hardware whose prefill takes `factor` times as long (KV sizes are a
    /// property of the model and do not change).
    pub fn with_prefill_scaled(&self, factor: f64) -> Result<Self> {
        positive("prefill scale factor", factor)?;
        Ok(self.scaled_prefill(factor))
    }

    /// [`Self::with_prefill_scaled`] for a factor already known to be positive and finite.
    pub(crate) fn scaled_prefill(&self, factor: f64) -> Self {
        let points = self
            .points
            .iter()
            .map(|p| ProfilePoint {
                prefill_s: p.prefill_s * factor,
                ..*p
            })
            .collect();
        Self { points }
    }

    /// `S_kv(l)`: KVCache bytes of a request of `tokens` tokens.
    pub fn kv_bytes(&self, tokens: f64) -> f64 {
        self.interpolate(tokens, |p| p.kv_bytes)
    }

    /// `T_prefill(l)`: prefill seconds of a request of `tokens` tokens.
    pub fn prefill_s(&self, tokens: f64) -> f64 {
        self.interpolate(tokens, |p| p.prefill_s)
    }

    /// `Phi_kv(l) = S_kv(l) / T_prefill(l)` in Gbps (paper 001 eq. 1).
    pub fn phi_kv_gbps(&self, tokens: f64) -> f64 {
        super::throughput::phi_kv_unchecked(self.kv_bytes(tokens), self.prefill_s(tokens))
    }

    fn interpolate(&self, tokens: f64, value: impl Fn(&ProfilePoint) -> f64) -> f64 {
        // The segment containing `tokens`, or the end segment nearest to it.
        let upper = self
            .points
            .partition_point(|p| p.tokens < tokens)
            .clamp(1, self.points.len() - 1);
        let (a, b) = (&self.points[upper - 1], &self.points[upper]);
        let exponent = (value(b) / value(a)).ln() / (b.tokens / a.tokens).ln();
        value(a) * (tokens / a.tokens).powf(exponent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paper 001 table 5's KV throughput column (3.61 / 3.59 / 3.19 / 2.62 Gbps) is eq. 1 over
    /// its size and latency columns; tolerance 1% (the 1K row's latency is rounded to 0.44 s).
    #[test]
    fn table_5_kv_throughput_is_size_over_prefill_time() {
        let profile = LengthProfile::paper_001_table_5();
        for (point, published) in profile.points().iter().zip([3.61, 3.59, 3.19, 2.62]) {
            let phi = profile.phi_kv_gbps(point.tokens);
            assert!(
                (phi - published).abs() / published < 0.01,
                "{}: {phi} vs {published}",
                point.tokens
            );
        }
    }

    #[test]
    fn interpolation_hits_the_rows_and_is_a_power_law_between_them() {
        let profile = LengthProfile::paper_001_table_5();
        for p in profile.points() {
            assert!((profile.prefill_s(p.tokens) - p.prefill_s).abs() < 1e-12);
            assert!((profile.kv_bytes(p.tokens) - p.kv_bytes).abs() / p.kv_bytes < 1e-12);
        }
        // Geometric midpoint of 8K and 32K gives the geometric mean of the two latencies.
        let mid = profile.prefill_s(16_384.0);
        assert!((mid - (0.72f64 * 1.84).sqrt()).abs() < 1e-12, "{mid}");
        // Monotone across the whole range, extrapolated ends included.
        let mut last = 0.0;
        for tokens in [128.0, 1_000.0, 19_400.0, 45_000.0, 131_072.0, 200_000.0] {
            let t = profile.prefill_s(tokens);
            assert!(t > last, "{tokens}");
            last = t;
        }
    }

    #[test]
    fn malformed_profiles_are_typed_errors() {
        let p = |tokens: f64| ProfilePoint {
            tokens,
            kv_bytes: 1.0,
            prefill_s: 1.0,
        };
        assert_eq!(
            LengthProfile::new(vec![p(1.0)]),
            Err(CostModelError::ProfileTooShort(1))
        );
        assert_eq!(
            LengthProfile::new(vec![p(2.0), p(2.0)]),
            Err(CostModelError::ProfileNotIncreasing { index: 1 })
        );
        assert!(
            LengthProfile::new(vec![
                p(1.0),
                ProfilePoint {
                    prefill_s: f64::NAN,
                    ..p(2.0)
                }
            ])
            .is_err()
        );
        assert!(
            LengthProfile::paper_001_table_5()
                .with_prefill_scaled(0.0)
                .is_err()
        );
        assert!(
            serde_json::from_str::<LengthProfile>(
                r#"[{"tokens":1.0,"kv_bytes":1.0,"prefill_s":1.0}]"#
            )
            .is_err()
        );
    }
}
