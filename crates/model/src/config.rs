//! The model's hyper-parameters, under the field names of DeepSeek-V2's Hugging Face
//! `config.json`, so that a checkpoint's own file parses into [`ModelConfig`] as it is
//! (fields this crate does not use are ignored).

use kvroute_costmodel::ModelDims;
use kvroute_costmodel::model::AttentionKind;
use kvroute_kernels::layout::{D_LATENT, D_QK, D_ROPE};
use kvroute_kernels::rope::deepseek_softmax_scale;
use kvroute_kernels::{Rope, RopeLayout, Yarn};
use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{ModelError, Result};

/// DeepSeek's YaRN block (`rope_scaling`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    /// `"yarn"`, the only kind implemented.
    #[serde(rename = "type")]
    pub kind: String,
    /// Context extension factor (40).
    pub factor: f64,
    /// The pre-extension context (4096).
    pub original_max_position_embeddings: u64,
    /// YaRN's `beta_fast` (32).
    pub beta_fast: f64,
    /// YaRN's `beta_slow` (1).
    pub beta_slow: f64,
    /// Scales cos/sin by `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` (0.707).
    #[serde(default = "one")]
    pub mscale: f64,
    /// Enters the softmax scale (0.707).
    #[serde(default = "one")]
    pub mscale_all_dim: f64,
}

fn one() -> f64 {
    1.0
}

fn greedy() -> String {
    "greedy".to_owned()
}

fn softmax() -> String {
    "softmax".to_owned()
}

fn silu() -> String {
    "silu".to_owned()
}

/// `null` (a dense model's expert counts in some configs) read as 0.
fn null_as_zero<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    Ok(Option::<usize>::deserialize(d)?.unwrap_or(0))
}

/// A DeepSeek-V2-architecture model: MLA attention (a 512-wide latent and a 64-wide RoPE key
/// per token) and DeepSeekMoE feed-forward layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Intermediate width of the dense FFN layers.
    pub intermediate_size: usize,
    /// Intermediate width of one expert.
    pub moe_intermediate_size: usize,
    /// Transformer layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Always-active experts, fused into one FFN of `n_shared_experts * moe_intermediate_size`.
    #[serde(default, deserialize_with = "null_as_zero")]
    pub n_shared_experts: usize,
    /// Routed experts per MoE layer.
    #[serde(default, deserialize_with = "null_as_zero")]
    pub n_routed_experts: usize,
    /// Routed experts each token uses.
    pub num_experts_per_tok: usize,
    /// Layers `0..first_k_dense_replace` have a dense FFN.
    pub first_k_dense_replace: usize,
    /// Past those, layer `i` is MoE when `i % moe_layer_freq == 0`.
    pub moe_layer_freq: usize,
    /// Width of the compressed KV latent (must be 512: the kernels' row).
    pub kv_lora_rank: usize,
    /// Width of the compressed query (`null`: the query is projected directly).
    pub q_lora_rank: Option<usize>,
    /// Width of each head's RoPE part (must be 64: the kernels' row).
    pub qk_rope_head_dim: usize,
    /// Width of each head's non-RoPE query/key part.
    pub qk_nope_head_dim: usize,
    /// Width of each head's value.
    pub v_head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// YaRN context extension (`null`: plain RoPE).
    pub rope_scaling: Option<RopeScaling>,
    /// Whether the top-k expert weights are renormalised to sum to 1.
    pub norm_topk_prob: bool,
    /// Multiplies the routed experts' weights when they are not renormalised.
    pub routed_scaling_factor: f64,
    /// The longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// Expert selection: `"greedy"` (top-k over all experts) is implemented.
    #[serde(default = "greedy")]
    pub topk_method: String,
    /// Router scores: `"softmax"` is implemented.
    #[serde(default = "softmax")]
    pub scoring_func: String,
    /// FFN activation: `"silu"` (SwiGLU) is implemented.
    #[serde(default = "silu")]
    pub hidden_act: String,
    /// Whether `lm_head` is the embedding (false for every DeepSeek checkpoint).
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn config_err<T: ToString>(field: &'static str, value: T, why: &'static str) -> ModelError {
    ModelError::Config {
        field,
        value: value.to_string(),
        why,
    }
}

fn unsupported<T: ToString>(field: &'static str, value: T, why: &'static str) -> ModelError {
    ModelError::Unsupported {
        field,
        value: value.to_string(),
        why,
    }
}

impl ModelConfig {
    /// DeepSeek-V2-Lite's published `config.json` (15.7B parameters, 2.4B active).
    pub fn deepseek_v2_lite() -> Self {
        Self {
            vocab_size: 102_400,
            hidden_size: 2048,
            intermediate_size: 10_944,
            moe_intermediate_size: 1408,
            num_hidden_layers: 27,
            num_attention_heads: 16,
            n_shared_experts: 2,
            n_routed_experts: 64,
            num_experts_per_tok: 6,
            first_k_dense_replace: 1,
            moe_layer_freq: 1,
            kv_lora_rank: D_LATENT,
            q_lora_rank: None,
            qk_rope_head_dim: D_ROPE,
            qk_nope_head_dim: 128,
            v_head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_scaling: Some(RopeScaling {
                kind: "yarn".to_owned(),
                factor: 40.0,
                original_max_position_embeddings: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 0.707,
                mscale_all_dim: 0.707,
            }),
            norm_topk_prob: false,
            routed_scaling_factor: 1.0,
            max_position_embeddings: 163_840,
            topk_method: greedy(),
            scoring_func: softmax(),
            hidden_act: silu(),
            tie_word_embeddings: false,
        }
    }

    /// DeepSeek-V2-Lite's architecture at a size two CPU cores run: the same MLA row (512 +
    /// 64), head dims (128 / 64 / 128), YaRN and softmax scale, a dense first layer and MoE
    /// after it (8 routed experts, 2 per token, 1 shared), with a 256-wide residual stream, 4
    /// layers, 8 heads and a 512-token vocabulary. See the crate docs for its measured cost.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 512,
            hidden_size: 256,
            intermediate_size: 512,
            moe_intermediate_size: 128,
            num_hidden_layers: 4,
            num_attention_heads: 8,
            n_shared_experts: 1,
            n_routed_experts: 8,
            num_experts_per_tok: 2,
            ..Self::deepseek_v2_lite()
        }
    }

    /// Whether layer `layer` has an MoE feed-forward (otherwise a dense one), as DeepSeek's
    /// modelling code decides it.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.n_routed_experts > 0
            && layer >= self.first_k_dense_replace
            && layer.is_multiple_of(self.moe_layer_freq.max(1))
    }

    /// Width of one head's query and key: `qk_nope_head_dim + qk_rope_head_dim` (192).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Checks every value against what the architecture and this crate allow.
    pub fn validate(&self) -> Result<()> {
        if self.kv_lora_rank != D_LATENT {
            return Err(unsupported(
                "kv_lora_rank",
                self.kv_lora_rank,
                "must be 512: the attention kernels' latent width",
            ));
        }
        if self.qk_rope_head_dim != D_ROPE {
            return Err(unsupported(
                "qk_rope_head_dim",
                self.qk_rope_head_dim,
                "must be 64: the attention kernels' RoPE band",
            ));
        }
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("moe_layer_freq", self.moe_layer_freq),
        ] {
            if value == 0 {
                return Err(config_err(field, value, "must be positive"));
            }
        }
        if u32::try_from(self.vocab_size).is_err() {
            return Err(config_err(
                "vocab_size",
                self.vocab_size,
                "token ids are u32",
            ));
        }
        if self.q_lora_rank == Some(0) {
            return Err(config_err("q_lora_rank", 0, "must be positive or null"));
        }
        let layers = 0..self.num_hidden_layers;
        if layers.clone().any(|l| !self.is_moe_layer(l)) && self.intermediate_size == 0 {
            return Err(config_err(
                "intermediate_size",
                0,
                "must be positive when a layer is dense",
            ));
        }
        if layers.clone().any(|l| self.is_moe_layer(l)) {
            if self.moe_intermediate_size == 0 {
                return Err(config_err("moe_intermediate_size", 0, "must be positive"));
            }
            if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.n_routed_experts {
                return Err(config_err(
                    "num_experts_per_tok",
                    self.num_experts_per_tok,
                    "must be in 1..=n_routed_experts",
                ));
            }
        }
        let positive = |field, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(config_err(field, v, "must be finite and positive"))
            }
        };
        positive("rms_norm_eps", self.rms_norm_eps)?;
        positive("routed_scaling_factor", self.routed_scaling_factor)?;
        if let Some(s) = &self.rope_scaling {
            if s.kind != "yarn" {
                return Err(unsupported("rope_scaling.type", &s.kind, "only \"yarn\""));
            }
            positive("rope_scaling.mscale_all_dim", s.mscale_all_dim)?;
            // The kernels' rotation does not scale cos/sin (kvroute_kernels::Rope::yarn).
            if s.mscale != s.mscale_all_dim {
                return Err(unsupported(
                    "rope_scaling.mscale",
                    s.mscale,
                    "must equal mscale_all_dim (as in every DeepSeek checkpoint)",
                ));
            }
        }
        self.rope()?;
        for (field, value, want) in [
            ("topk_method", &self.topk_method, "greedy"),
            ("scoring_func", &self.scoring_func, "softmax"),
            ("hidden_act", &self.hidden_act, "silu"),
        ] {
            if value != want {
                return Err(unsupported(field, value, "see the crate docs"));
            }
        }
        if self.tie_word_embeddings {
            return Err(unsupported(
                "tie_word_embeddings",
                true,
                "lm_head is its own tensor",
            ));
        }
        if self.parameters().is_none() {
            return Err(config_err(
                "hidden_size",
                self.hidden_size,
                "the parameter count overflows",
            ));
        }
        Ok(())
    }

    /// The RoPE the model's keys and queries are rotated with: YaRN from `rope_scaling` (plain
    /// RoPE when it is null), dims paired `(2i, 2i + 1)` as DeepSeek's checkpoints pair them.
    pub fn rope(&self) -> Result<Rope> {
        let rope = match &self.rope_scaling {
            None => Rope::plain(self.rope_theta, RopeLayout::Interleaved),
            Some(s) => Rope::yarn(
                self.rope_theta,
                Yarn {
                    factor: s.factor,
                    beta_fast: s.beta_fast,
                    beta_slow: s.beta_slow,
                    original_max_positions: s.original_max_position_embeddings as f64,
                },
                RopeLayout::Interleaved,
            ),
        };
        rope.map_err(|e| config_err("rope_theta / rope_scaling", e, "rejected by the RoPE"))
    }

    /// The attention's softmax scale: `qk_head_dim^-0.5 * mscale^2` (DeepSeek-V2
    /// modeling_deepseek.py `yarn_get_mscale` with `mscale_all_dim`); 0.1147 for V2-Lite.
    pub fn softmax_scale(&self) -> f32 {
        let (factor, mscale_all_dim) = self
            .rope_scaling
            .as_ref()
            .map_or((1.0, 1.0), |s| (s.factor, s.mscale_all_dim));
        deepseek_softmax_scale(self.qk_head_dim() as f64, factor, mscale_all_dim) as f32
    }

    /// Parameters in the checkpoint (`None` if the count overflows): 15.7B for V2-Lite.
    pub fn parameters(&self) -> Option<u64> {
        let n = |x: usize| u64::try_from(x).ok();
        let mul = |a: u64, b: u64| a.checked_mul(b);
        let (h, heads) = (n(self.hidden_size)?, n(self.num_attention_heads)?);
        let q_out = mul(heads, n(self.qk_head_dim())?)?;
        let q = match self.q_lora_rank {
            None => mul(q_out, h)?,
            Some(r) => {
                let r = n(r)?;
                mul(r, h)?.checked_add(r)?.checked_add(mul(q_out, r)?)?
            }
        };
        let kv_b = mul(heads, n(self.qk_nope_head_dim + self.v_head_dim)?)?;
        let attention = [
            q,
            mul(n(D_QK)?, h)?,
            n(D_LATENT)?,
            mul(kv_b, n(D_LATENT)?)?,
            mul(h, mul(heads, n(self.v_head_dim)?)?)?,
            mul(2, h)?, // the two layer norms
        ];
        let mlp = |inter: u64| mul(3, mul(h, inter)?);
        let moe = [
            mul(n(self.n_routed_experts)?, h)?,
            mul(
                n(self.n_routed_experts)?,
                mlp(n(self.moe_intermediate_size)?)?,
            )?,
            mlp(mul(
                n(self.n_shared_experts)?,
                n(self.moe_intermediate_size)?,
            )?)?,
        ];
        let sum = |xs: &[u64]| xs.iter().try_fold(0u64, |a, &b| a.checked_add(b));
        let (attention, moe, dense) = (
            sum(&attention)?,
            sum(&moe)?,
            mlp(n(self.intermediate_size)?)?,
        );
        let mut total = sum(&[mul(2, mul(n(self.vocab_size)?, h)?)?, h])?;
        for layer in 0..self.num_hidden_layers {
            let ffn = if self.is_moe_layer(layer) { moe } else { dense };
            total = sum(&[total, attention, ffn])?;
        }
        Some(total)
    }

    /// The dimensions the cost model needs: absorbed MLA rows (576 / 512 / 64), this model's
    /// layers and query heads.
    pub fn dims(&self) -> ModelDims {
        ModelDims {
            layers: u32::try_from(self.num_hidden_layers).unwrap_or(u32::MAX),
            d_qk: D_QK as u32,
            d_v: D_LATENT as u32,
            rope_dims: D_ROPE as u32,
            query_heads: u32::try_from(self.num_attention_heads).unwrap_or(u32::MAX),
            topk: None,
            attention: AttentionKind::Mla,
        }
    }
}
