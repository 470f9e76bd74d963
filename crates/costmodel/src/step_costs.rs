//! The measured costs of the steps that are not wire transfers: the fetch splice, the sparse
//! gather's per-holder overhead, the holder's partial attention, and local re-prefill.
//!
//! Each default is calibrated from measurements paper 000 ("Move the Query, Not the Cache")
//! states in its text; the tests below recompute the calibration from those statements, so
//! the constants cannot drift from their sources unnoticed.

use serde::{Deserialize, Serialize};

use crate::error::{Result, count, non_negative, positive};

/// The position-adaptation splice of a contiguous fetch: `fixed_us + per_token_us x ct`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SpliceCost {
    /// Chunk-size-independent part (launch-bound per-layer delta rotation), microseconds.
    pub fixed_us: f64,
    /// Part that grows with the chunk (the scatter), microseconds per token.
    pub per_token_us: f64,
}

impl SpliceCost {
    /// The least-squares line through paper 000 section 7's measured splices on H100 with
    /// DeepSeek-V2-Lite: 2.77 / 2.78 / 2.91 / 3.06 ms at ct = 55 / 1024 / 2048 / 4096.
    pub const MEASURED_H100_V2_LITE: Self = Self {
        fixed_us: 2741.2,
        per_token_us: 0.076_866,
    };
    /// The rounded "flat ~3 ms splice" paper 000 sections 2.2 and 5.1 reason with.
    pub const FLAT_3_MS: Self = Self {
        fixed_us: 3000.0,
        per_token_us: 0.0,
    };

    /// Checks both terms (the fixed part must be positive: a splice is never free).
    pub fn validate(&self) -> Result<()> {
        positive("splice.fixed_us", self.fixed_us)?;
        non_negative("splice.per_token_us", self.per_token_us)?;
        Ok(())
    }

    /// The splice of a `tokens`-token chunk, in microseconds.
    #[inline]
    pub fn at(&self, tokens: f64) -> f64 {
        self.fixed_us + self.per_token_us * tokens
    }
}

/// The non-byte overhead of gathering a scattered selection from several holders, per layer:
/// `fixed_us_per_layer + holders x per_holder_us_per_layer` (each holder is a separate
/// transfer because scattering defeats bulk coalescing, paper 000 section 5.4).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GatherCost {
    /// Per-layer setup of a gather, microseconds.
    pub fixed_us_per_layer: f64,
    /// Per-layer handshake with each holder, microseconds.
    pub per_holder_us_per_layer: f64,
}

impl GatherCost {
    /// Paper 000 section 5.4 measures a top-2048 gather at ~1.3 ms per layer from one holder
    /// and ~3.9 ms from seven (2-node H100, IBGDA, host-copy-bound prototype). The per-holder
    /// term is the slope, (3.9 - 1.3) / 6 ms; the fixed term is what remains at one holder
    /// after the slope and the 2048 x 1152 B payload at IBGDA's 25 GB/s (94.4 us).
    pub const PROTOTYPE_H100_IBGDA: Self = Self {
        fixed_us_per_layer: 772.3,
        per_holder_us_per_layer: 433.3,
    };

    /// Checks both terms.
    pub fn validate(&self) -> Result<()> {
        non_negative("gather.fixed_us_per_layer", self.fixed_us_per_layer)?;
        non_negative(
            "gather.per_holder_us_per_layer",
            self.per_holder_us_per_layer,
        )?;
        Ok(())
    }

    /// The overhead of one layer's gather from `holders` holders, microseconds.
    #[inline]
    pub fn per_layer_us(&self, holders: f64) -> f64 {
        self.fixed_us_per_layer + holders * self.per_holder_us_per_layer
    }
}

/// A holder's batched partial attention as a function of the routed requesters it serves:
/// flat up to an elbow, then linear (paper 000 section 6.3, figure 4(b)).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HolderCompute {
    /// Latency of the partial while the GPU is underused, microseconds.
    pub flat_us: f64,
    /// Requesters served before the partial turns linear.
    pub elbow_requesters: u32,
    /// Added latency per requester beyond the elbow, microseconds.
    pub per_extra_requester_us: f64,
}

impl HolderCompute {
    /// A piecewise-linear fit to paper 000 section 6.3's three statements about FlashMLA on one
    /// H100 at ct = 2048: flat to N ~ 8, 15-37 us for N <= 16, and <= 0.4 ms at N = 256.
    pub const FLASHMLA_H100: Self = Self {
        flat_us: 15.0,
        elbow_requesters: 8,
        per_extra_requester_us: 1.5,
    };

    /// Checks the terms.
    pub fn validate(&self) -> Result<()> {
        positive("holder.flat_us", self.flat_us)?;
        count("holder.elbow_requesters", self.elbow_requesters)?;
        non_negative("holder.per_extra_requester_us", self.per_extra_requester_us)?;
        Ok(())
    }

    /// The partial's latency when `requesters` routed requesters share the holder.
    #[inline]
    pub fn at(&self, requesters: u32) -> f64 {
        let extra = requesters.saturating_sub(self.elbow_requesters);
        self.flat_us + f64::from(extra) * self.per_extra_requester_us
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::least_squares;

    #[test]
    fn measured_splice_is_the_least_squares_line_through_section_7s_four_points() {
        let points = [
            (55.0, 2770.0),
            (1024.0, 2780.0),
            (2048.0, 2910.0),
            (4096.0, 3060.0),
        ];
        let line = least_squares(points.iter().copied()).unwrap();
        let s = SpliceCost::MEASURED_H100_V2_LITE;
        assert!((line.intercept - s.fixed_us).abs() < 0.1, "{line:?}");
        assert!((line.slope - s.per_token_us).abs() < 1e-5, "{line:?}");
        for (ct, ms) in points {
            assert!((s.at(ct) - ms).abs() / ms < 0.02, "ct {ct}");
        }
    }

    #[test]
    fn prototype_gather_reproduces_1_3_ms_from_one_holder_and_3_9_ms_from_seven() {
        let g = GatherCost::PROTOTYPE_H100_IBGDA;
        let payload_us = 2048.0 * 1152.0 / 25e3;
        let one = g.per_layer_us(1.0) + payload_us;
        let seven = g.per_layer_us(7.0) + payload_us;
        assert!((one - 1300.0).abs() < 1.0, "{one}");
        assert!((seven - 3900.0).abs() < 1.0, "{seven}");
    }

    #[test]
    fn holder_compute_honours_section_6_3_flat_to_8_decode_band_and_saturation_bound() {
        let h = HolderCompute::FLASHMLA_H100;
        assert_eq!(h.at(1), h.at(8), "flat up to the elbow");
        assert!(h.at(9) > h.at(8), "linear beyond it");
        for n in 1..=16 {
            assert!((15.0..=37.0).contains(&h.at(n)), "N = {n}: {}", h.at(n));
        }
        assert!(h.at(256) <= 400.0, "{}", h.at(256));
    }

    #[test]
    fn step_costs_reject_bad_values() {
        assert!(
            SpliceCost {
                fixed_us: 0.0,
                per_token_us: 0.0
            }
            .validate()
            .is_err()
        );
        assert!(
            SpliceCost {
                fixed_us: 1.0,
                per_token_us: -1.0
            }
            .validate()
            .is_err()
        );
        assert!(
            GatherCost {
                fixed_us_per_layer: f64::NAN,
                per_holder_us_per_layer: 0.0
            }
            .validate()
            .is_err()
        );
        assert!(
            HolderCompute {
                elbow_requesters: 0,
                ..HolderCompute::FLASHMLA_H100
            }
            .validate()
            .is_err()
        );
    }
}
