//! RoPE frequencies (plain and DeepSeek YaRN) and the rotation of the 64-dim RoPE band.
//!
//! Angles are computed in f64 (`position * inv_freq`, then `sin_cos`): at positions near 160K
//! an f32 angle would be off by several ulps of the bf16 result.

use serde::{Deserialize, Serialize};

use crate::error::KernelError;
use crate::layout::{D_LATENT, D_ROPE, RopeLayout};

/// Frequency pairs in the RoPE band.
pub const PAIRS: usize = D_ROPE / 2;

/// DeepSeek's YaRN parameters (the `rope_scaling` block of a checkpoint's config).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Yarn {
    /// Context extension factor (`factor`, 40 for DeepSeek-V2/V3).
    pub factor: f64,
    /// `beta_fast` (32).
    pub beta_fast: f64,
    /// `beta_slow` (1).
    pub beta_slow: f64,
    /// `original_max_position_embeddings` (4096).
    pub original_max_positions: f64,
}

impl Yarn {
    /// DeepSeek-V2-Lite's and V3's values (their `config.json`).
    pub const DEEPSEEK: Self = Self {
        factor: 40.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        original_max_positions: 4096.0,
    };
}

/// The rotation a splice applies: inverse frequencies and the pair layout.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    inv_freq: [f64; PAIRS],
    layout: RopeLayout,
}

fn finite_above(what: &'static str, value: f64, min: f64) -> Result<(), KernelError> {
    if value.is_finite() && value > min {
        Ok(())
    } else {
        Err(KernelError::Parameter {
            what,
            value,
            why: "must be finite and above its minimum (theta > 1, factor >= 1, betas > 0)",
        })
    }
}

impl Rope {
    /// Plain RoPE: `inv_freq_i = theta^(-2i/64)`.
    pub fn plain(theta: f64, layout: RopeLayout) -> Result<Self, KernelError> {
        finite_above("rope theta", theta, 1.0)?;
        let inv_freq = std::array::from_fn(|i| theta.powf(-((2 * i) as f64) / D_ROPE as f64));
        Ok(Self { inv_freq, layout })
    }

    /// DeepSeek's YaRN (`precompute_freqs_cis` in DeepSeek-V3's `inference/model.py`): the
    /// plain frequencies divided by `factor` below the correction range, kept above it, and a
    /// linear ramp between. (The reference code also scales cos/sin by an mscale ratio that is
    /// 1 for DeepSeek's checkpoints, where `mscale == mscale_all_dim`; it is not applied.)
    pub fn yarn(theta: f64, yarn: Yarn, layout: RopeLayout) -> Result<Self, KernelError> {
        finite_above("rope theta", theta, 1.0)?;
        finite_above("yarn factor", yarn.factor, 0.999_999)?;
        finite_above("yarn beta_slow", yarn.beta_slow, 0.0)?;
        finite_above("yarn beta_fast", yarn.beta_fast, yarn.beta_slow)?;
        finite_above(
            "yarn original max positions",
            yarn.original_max_positions,
            0.0,
        )?;
        let dim = D_ROPE as f64;
        let correction_dim = |rotations: f64| {
            dim * (yarn.original_max_positions / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let low = correction_dim(yarn.beta_fast).floor().max(0.0);
        let mut high = correction_dim(yarn.beta_slow).ceil().min(dim - 1.0);
        if low == high {
            high += 0.001;
        }
        let plain = Self::plain(theta, layout)?;
        let inv_freq = std::array::from_fn(|i| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let smooth = 1.0 - ramp;
            let f = plain.inv_freq[i];
            f / yarn.factor * (1.0 - smooth) + f * smooth
        });
        Ok(Self { inv_freq, layout })
    }

    /// The inverse frequencies.
    pub fn inv_freq(&self) -> &[f64; PAIRS] {
        &self.inv_freq
    }

    /// The pair layout.
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// `(cos, sin)` of each pair's angle for a rotation by `delta` positions, in f64.
    pub fn angles(&self, delta: i64) -> [(f64, f64); PAIRS] {
        std::array::from_fn(|i| {
            let (s, c) = (delta as f64 * self.inv_freq[i]).sin_cos();
            (c, s)
        })
    }
}

/// `(cos, sin)` of one rotation, pair by pair, as separate arrays (what the vectorised rotation
/// reads): the f64 values, and the same rounded to f32 for the CPU's guarded f32 rotation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AngleTable {
    pub(crate) cos: [f64; PAIRS],
    pub(crate) sin: [f64; PAIRS],
    pub(crate) cos32: [f32; PAIRS],
    pub(crate) sin32: [f32; PAIRS],
}

impl Rope {
    /// [`Rope::angles`] as an [`AngleTable`].
    pub(crate) fn table(&self, delta: i64) -> AngleTable {
        let angles = self.angles(delta);
        AngleTable {
            cos: angles.map(|(c, _)| c),
            sin: angles.map(|(_, s)| s),
            cos32: angles.map(|(c, _)| c as f32),
            sin32: angles.map(|(_, s)| s as f32),
        }
    }
}

/// Rotates the RoPE band of one 576-wide bf16 row by `angles`, in f64, rounding once to bf16;
/// the latent dims are untouched. The reference rotation.
pub fn rotate_row_f64(row: &mut [u16], angles: &[(f64, f64); PAIRS], layout: RopeLayout) {
    let band = &mut row[D_LATENT..D_LATENT + D_ROPE];
    for (i, &(c, s)) in angles.iter().enumerate() {
        let (a, b) = layout.pair(i);
        let (x, y) = (
            f64::from(crate::bf16::to_f32(band[a])),
            f64::from(crate::bf16::to_f32(band[b])),
        );
        band[a] = crate::bf16::from_f64(x * c - y * s);
        band[b] = crate::bf16::from_f64(x * s + y * c);
    }
}

/// The softmax scale DeepSeek's attention uses: `qk_head_dim^-0.5 * mscale^2` with
/// `mscale = 0.1 * mscale_all_dim * ln(factor) + 1` (DeepSeek-V2/V3 `yarn_get_mscale`; 1 when
/// `factor <= 1`). DeepSeek-V2-Lite (qk_head_dim 192, factor 40, mscale_all_dim 0.707):
/// 0.1147; V3 (mscale_all_dim 1.0): 0.1352.
pub fn deepseek_softmax_scale(qk_head_dim: f64, factor: f64, mscale_all_dim: f64) -> f64 {
    let mscale = if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale_all_dim * factor.ln() + 1.0
    };
    qk_head_dim.powf(-0.5) * mscale * mscale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deepseek_scales_match_the_published_values() {
        assert!((deepseek_softmax_scale(192.0, 40.0, 0.707) - 0.1147).abs() < 5e-5);
        assert!((deepseek_softmax_scale(192.0, 40.0, 1.0) - 0.1352).abs() < 5e-5);
        assert!((deepseek_softmax_scale(576.0, 1.0, 1.0) - 576f64.powf(-0.5)).abs() < 1e-15);
    }

    #[test]
    fn yarn_keeps_high_frequencies_and_divides_low_ones_by_the_factor() {
        let plain = Rope::plain(10_000.0, RopeLayout::Interleaved).unwrap();
        let yarn = Rope::yarn(10_000.0, Yarn::DEEPSEEK, RopeLayout::Interleaved).unwrap();
        // Correction range for DeepSeek's values: low = floor(10.2) = 10, high = ceil(22.9) = 23.
        assert_eq!(yarn.inv_freq()[0], plain.inv_freq()[0]);
        assert_eq!(yarn.inv_freq()[10], plain.inv_freq()[10]);
        assert!((yarn.inv_freq()[31] - plain.inv_freq()[31] / 40.0).abs() < 1e-18);
        let mid = yarn.inv_freq()[16] / plain.inv_freq()[16];
        assert!(mid > 1.0 / 40.0 && mid < 1.0, "the ramp blends: {mid}");
    }

    #[test]
    fn bad_parameters_are_typed_errors() {
        assert!(Rope::plain(f64::NAN, RopeLayout::Half).is_err());
        assert!(Rope::plain(1.0, RopeLayout::Half).is_err());
        let bad = Yarn {
            beta_fast: 0.5,
            ..Yarn::DEEPSEEK
        };
        assert!(Rope::yarn(10_000.0, bad, RopeLayout::Half).is_err());
        let inf = Yarn {
            factor: f64::INFINITY,
            ..Yarn::DEEPSEEK
        };
        assert!(Rope::yarn(10_000.0, inf, RopeLayout::Half).is_err());
    }
}
