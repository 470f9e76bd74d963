//! Deterministic random weights: a synthetic checkpoint with the real one's shapes and names.
//!
//! Every tensor is drawn from its own stream (SplitMix64 seeded by the model seed and the
//! tensor's name), so a tensor does not change when others are added, and every value is
//! rounded to bf16 when drawn, so that [`crate::Model::save`] (bf16, as DeepSeek's
//! checkpoints are stored) loses nothing and a saved model computes the same bits as the one
//! that was saved.
//!
//! Scales: norms are 1; the embedding has unit variance (the residual stream starts at RMS
//! 1); every projection has standard deviation `1 / sqrt(fan_in)`, so that each keeps the
//! RMS of its input; `lm_head` has `LOGIT_STD / sqrt(hidden)`, so that the logits over the
//! final norm's unit-RMS output have a standard deviation of `LOGIT_STD` = 8. The gap between
//! the two largest of 512 such logits is then about 2.3 on average (the spacing of Gaussian
//! extremes, `sigma / sqrt(2 ln n)`), against a few hundredths of change when attention
//! outputs are rounded to bf16, so greedy decoding is rarely a near tie: compare
//! [`crate::Top2::margin`] before asserting two paths picked the same token.

use kvroute_kernels::bf16;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::{self, Model};

/// The standard deviation of the initial model's logits.
pub const LOGIT_STD: f32 = 8.0;

/// SplitMix64 (Steele, Lea and Flood 2014): a 64-bit counter through a mixing function.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `(0, 1]`.
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// A standard normal (Box-Muller; one of the pair is dropped).
    pub(crate) fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit(), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// FNV-1a of a tensor's name: its stream's offset from the model seed.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Model {
    /// A model with random weights for `config` (validated), the same for the same seed.
    /// See the module docs of `init` for the scales.
    pub fn init(config: ModelConfig, seed: u64) -> Result<Model> {
        let hidden = config.hidden_size as f64;
        weights::build(config, &mut |name, shape| {
            let n = shape.iter().product();
            if shape.len() == 1 {
                return Ok(vec![1.0; n]); // a norm's weight
            }
            let std = if name == "model.embed_tokens.weight" {
                1.0
            } else if name == "lm_head.weight" {
                f64::from(LOGIT_STD) / hidden.sqrt()
            } else {
                1.0 / (shape[1] as f64).sqrt()
            };
            let mut rng = SplitMix64::new(seed ^ name_hash(name));
            Ok((0..n)
                .map(|_| bf16::to_f32(bf16::from_f64(rng.normal() * std)))
                .collect())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normals_have_unit_variance_and_streams_differ_by_name() {
        let mut rng = SplitMix64::new(7);
        let xs: Vec<f64> = (0..20_000).map(|_| rng.normal()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(
            mean.abs() < 0.03 && (var - 1.0).abs() < 0.03,
            "{mean} {var}"
        );
        assert_ne!(name_hash("lm_head.weight"), name_hash("model.norm.weight"));
    }

    #[test]
    fn init_is_deterministic_bf16_and_scaled_by_fan_in() {
        let mut c = ModelConfig::tiny();
        c.num_hidden_layers = 2;
        let (a, b) = (
            Model::init(c.clone(), 3).unwrap(),
            Model::init(c, 3).unwrap(),
        );
        let kv_b = a
            .tensor("model.layers.1.self_attn.kv_b_proj.weight")
            .unwrap();
        assert_eq!(kv_b.data, b.tensor(&kv_b.name).unwrap().data);
        assert!(
            kv_b.data
                .iter()
                .all(|&x| bf16::to_f32(bf16::from_f32(x)) == x)
        );
        let rms = (kv_b.data.iter().map(|x| x * x).sum::<f32>() / kv_b.data.len() as f32).sqrt();
        assert!((rms * 512f32.sqrt() - 1.0).abs() < 0.02, "rms {rms}");
        let other = Model::init(a.config().clone(), 4).unwrap();
        assert_ne!(other.tensor(&kv_b.name).unwrap().data, kv_b.data);
    }
}
