//! Model geometry: the published dimensions that fix the routed payload and the size of a chunk.
//!
//! The cost model sees a model only through a few byte counts (paper 000, "Move the Query, Not
//! the Cache", section 1: "our cost model depends on the model only through the wire payload
//! q+p"): the query row `q`, the partial row `p`, and the cache bytes per token per layer
//! `b_KV`. Under absorbed MLA decode a query row and a cache row are the same `d_qk`-wide
//! object (512 latent + 64 RoPE = 576), which is why a routed query is so small next to the
//! chunk it attends.

use serde::{Deserialize, Serialize};

use crate::error::{CostModelError, Result, count};

/// Bytes per bf16 element: query rows, cache rows and the partial's `o` travel as bf16.
pub const BF16_BYTES: u64 = 2;
/// Bytes per f32 element: the partial's `m` and `l` statistics travel as f32.
pub const F32_BYTES: u64 = 4;

/// How a model's attention makes a chunk small; informational, the arithmetic is the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttentionKind {
    /// Multi-head latent attention: one `kv_lora_rank + rope` latent per token.
    Mla,
    /// DeepSeek-V4 compressed sparse attention: one K=V entry per compressed group of tokens;
    /// a "token" of the cost model is then one compressed entry (paper 000 section 5.4).
    CompressedSparse,
}

/// The dimensions of one model that the cost model needs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelDims {
    /// Transformer layers `L` (all of them hold a KV cache).
    pub layers: u32,
    /// Width of a query row and of a cache row (`d_qk`): 576 for MLA.
    pub d_qk: u32,
    /// Width of the attention output, i.e. of the partial's `o` (`d_v`): 512 for MLA.
    pub d_v: u32,
    /// RoPE dimensions inside `d_qk` (re-rotated by the splice).
    pub rope_dims: u32,
    /// Query heads `h_q`: one decode token routes `h_q` query rows per layer.
    pub query_heads: u32,
    /// Entries a sparse-attention indexer selects per query (`index_topk`), if the model has one.
    pub topk: Option<u32>,
    /// The attention family.
    pub attention: AttentionKind,
}

impl ModelDims {
    /// Checks every dimension; a `ModelDims` read from a file goes through this before use.
    pub fn validate(&self) -> Result<()> {
        count("layers", self.layers)?;
        count("d_qk", self.d_qk)?;
        count("d_v", self.d_v)?;
        count("query_heads", self.query_heads)?;
        if let Some(topk) = self.topk {
            count("topk", topk)?;
        }
        if self.rope_dims > self.d_qk {
            return Err(CostModelError::RopeExceedsRow {
                rope_dims: self.rope_dims,
                d_qk: self.d_qk,
            });
        }
        Ok(())
    }

    /// `q`: bytes of one routed query row, `d_qk` bf16 values (paper 000 section 3.2).
    #[inline]
    pub const fn query_row_bytes(&self) -> u64 {
        self.d_qk as u64 * BF16_BYTES
    }

    /// `p`: bytes of one partial row, `o` as `d_v` bf16 plus `m` and `l` as f32
    /// (paper 000 section 3.2: p = 512 x 2 + 2 x 4 = 1032 B).
    #[inline]
    pub const fn partial_row_bytes(&self) -> u64 {
        self.d_v as u64 * BF16_BYTES + 2 * F32_BYTES
    }

    /// `q + p`: bytes one routed row moves there and back.
    #[inline]
    pub const fn routed_row_bytes(&self) -> u64 {
        self.query_row_bytes() + self.partial_row_bytes()
    }

    /// `b_KV`: cache bytes per token per layer, one `d_qk`-wide bf16 row.
    #[inline]
    pub const fn kv_bytes_per_token_layer(&self) -> u64 {
        self.d_qk as u64 * BF16_BYTES
    }

    /// Cache bytes of `tokens` tokens over `layers` layers, as `f64`: exact below 2^53 bytes,
    /// and no product of counts can overflow or panic.
    #[inline]
    pub fn chunk_bytes(&self, tokens: u32, layers: u32) -> f64 {
        f64::from(tokens) * f64::from(layers) * self.kv_bytes_per_token_layer() as f64
    }
}

/// A named model with the source of its dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ModelPreset {
    /// The id used on the command line (`--model`).
    pub id: &'static str,
    /// Other accepted ids.
    pub aliases: &'static [&'static str],
    /// The dimensions.
    pub dims: ModelDims,
    /// Where the dimensions are published.
    pub source: &'static str,
}

const MLA_576: ModelDims = ModelDims {
    layers: 0,
    d_qk: 576,
    d_v: 512,
    rope_dims: 64,
    query_heads: 0,
    topk: None,
    attention: AttentionKind::Mla,
};

const V4_ENTRY: ModelDims = ModelDims {
    layers: 0,
    d_qk: 512,
    d_v: 512,
    rope_dims: 64,
    query_heads: 0,
    topk: None,
    attention: AttentionKind::CompressedSparse,
};

/// The models the project knows by name.
pub const MODEL_PRESETS: &[ModelPreset] = &[
    ModelPreset {
        id: "deepseek-v2-lite",
        aliases: &["v2-lite"],
        dims: ModelDims {
            layers: 27,
            query_heads: 16,
            ..MLA_576
        },
        source: "DeepSeek-V2 (arXiv:2405.04434) and the DeepSeek-V2-Lite config: 27 layers, \
                 16 heads, kv_lora_rank 512, qk_rope_head_dim 64; the instance measured by \
                 paper 000 (section 3)",
    },
    ModelPreset {
        id: "deepseek-v3",
        aliases: &["deepseek-r1", "v3", "r1"],
        dims: ModelDims {
            layers: 61,
            query_heads: 128,
            ..MLA_576
        },
        source: "DeepSeek-V3 technical report (arXiv:2412.19437) and config: 61 layers, \
                 128 heads, kv_lora_rank 512, qk_rope_head_dim 64; R1 shares it",
    },
    ModelPreset {
        id: "deepseek-v3.2",
        aliases: &["v3.2"],
        dims: ModelDims {
            layers: 61,
            query_heads: 128,
            topk: Some(2048),
            ..MLA_576
        },
        source: "DeepSeek-V3.2 (arXiv:2512.02556): V3's MLA with a DSA indexer, index_topk \
                 2048 (paper 000 section 5.4)",
    },
    ModelPreset {
        id: "deepseek-v4-flash",
        aliases: &["v4-flash"],
        dims: ModelDims {
            layers: 43,
            query_heads: 64,
            topk: Some(512),
            ..V4_ENTRY
        },
        source: "DeepSeek-V4-Flash config: 43 layers, 64 heads, one 512-wide K=V entry \
                 (head_dim 512, 64 RoPE), index_topk 512 (paper 000 section 5.4)",
    },
    ModelPreset {
        id: "deepseek-v4-pro",
        aliases: &["v4-pro"],
        dims: ModelDims {
            layers: 61,
            query_heads: 128,
            topk: Some(1024),
            ..V4_ENTRY
        },
        source: "DeepSeek-V4-Pro model card: 61 layers, 128 heads, one 512-wide K=V entry, \
                 top-1024 compressed entries (paper 000 section 5.4)",
    },
    ModelPreset {
        id: "glm-5.1",
        aliases: &["glm-5", "glm5.1"],
        dims: ModelDims {
            layers: 78,
            query_heads: 64,
            topk: Some(2048),
            ..MLA_576
        },
        source: "GLM-5 / GLM-5.1 config (glm_moe_dsa): 78 layers, 64 heads, kv_lora_rank 512, \
                 qk_rope_head_dim 64, index_topk 2048 (paper 000 section 5.4)",
    },
    ModelPreset {
        id: "kimi-k2",
        aliases: &["kimi-k2.6"],
        dims: ModelDims {
            layers: 61,
            query_heads: 64,
            ..MLA_576
        },
        source: "Kimi K2 (arXiv:2507.20534) config: 61 layers, 64 heads, MLA with \
                 kv_lora_rank 512, qk_rope_head_dim 64",
    },
];

/// Looks a model up by id or alias (case-insensitive).
pub fn model_preset(name: &str) -> Result<&'static ModelPreset> {
    MODEL_PRESETS
        .iter()
        .find(|p| {
            p.id.eq_ignore_ascii_case(name)
                || p.aliases.iter().any(|a| a.eq_ignore_ascii_case(name))
        })
        .ok_or_else(|| {
            CostModelError::unknown_preset("model", name, MODEL_PRESETS.iter().map(|p| p.id))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v2_lite() -> ModelDims {
        model_preset("deepseek-v2-lite").unwrap().dims
    }

    /// Paper 000 section 3.2 and figure 1: q = 1152 B, p = 1032 B, q + p = 2184 B.
    #[test]
    fn mla_wire_rows_are_1152_and_1032_bytes() {
        let m = v2_lite();
        assert_eq!(m.query_row_bytes(), 1152);
        assert_eq!(m.partial_row_bytes(), 1032);
        assert_eq!(m.routed_row_bytes(), 2184);
    }

    /// Paper 000 figure 1(a): a 2048-token chunk is 2.36 MB for one layer and about 64 MB for
    /// all 27 layers (exact: 2,359,296 B and 63,700,992 B; tolerance 0.5% on the rounded MB).
    #[test]
    fn v2_lite_2048_token_chunk_is_2_36_mb_per_layer_and_64_mb_in_all() {
        let m = v2_lite();
        let one_layer = m.chunk_bytes(2048, 1) / 1e6;
        let all_layers = m.chunk_bytes(2048, m.layers) / 1e6;
        assert!((one_layer - 2.36).abs() / 2.36 < 0.005, "{one_layer}");
        assert!((all_layers - 64.0).abs() / 64.0 < 0.005, "{all_layers}");
    }

    #[test]
    fn every_preset_validates_and_sparse_budgets_match_paper_000_section_5_4() {
        for p in MODEL_PRESETS {
            p.dims.validate().unwrap();
        }
        let topk = |id| model_preset(id).unwrap().dims.topk;
        assert_eq!(topk("deepseek-v3.2"), Some(2048));
        assert_eq!(topk("glm-5.1"), Some(2048));
        assert_eq!(topk("deepseek-v4-pro"), Some(1024));
        assert_eq!(topk("deepseek-v4-flash"), Some(512));
        assert_eq!(topk("kimi-k2"), None);
    }

    #[test]
    fn presets_resolve_by_alias_and_case() {
        assert_eq!(model_preset("DeepSeek-R1").unwrap().id, "deepseek-v3");
        assert_eq!(model_preset("V2-LITE").unwrap().id, "deepseek-v2-lite");
    }

    #[test]
    fn unknown_model_is_a_typed_error_listing_known_ids() {
        let err = model_preset("llama-405b").unwrap_err();
        match err {
            CostModelError::UnknownPreset { kind, name, known } => {
                assert_eq!(kind, "model");
                assert_eq!(name, "llama-405b");
                assert!(known.contains("deepseek-v2-lite"));
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn zero_layers_or_rope_wider_than_row_is_rejected() {
        let mut m = v2_lite();
        m.layers = 0;
        assert!(m.validate().is_err());
        let mut m = v2_lite();
        m.rope_dims = 600;
        assert_eq!(
            m.validate(),
            Err(CostModelError::RopeExceedsRow {
                rope_dims: 600,
                d_qk: 576
            })
        );
        let mut m = v2_lite();
        m.topk = Some(0);
        assert!(m.validate().is_err());
    }
}
