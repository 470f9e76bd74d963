//! The layer Helix runs: its shapes, its weights and KV (random, but a pure function of a seed
//! and each element's index, so every rank generates exactly its own shard and a reference
//! generates the whole), and the dense math the FFN and projection need.

use serde::{Deserialize, Serialize};

use crate::error::{HelixError, Result};
use crate::layout::Layout;

/// The attention of the layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Attention {
    /// Absorbed MLA decode: one shared 576-wide latent per token (`K = 1`), query rows of 576,
    /// outputs of 512 per head (kvroute-kernels' shapes). The latent-to-hidden up-projection
    /// is folded into the output projection.
    Mla,
    /// Grouped-query attention: `kv_heads` key and value heads of `head_dim`.
    Gqa {
        /// `K`, key/value heads.
        kv_heads: usize,
        /// `Hsz`, the width of every head.
        head_dim: usize,
    },
}

/// The FFN of the layer (SwiGLU: `down(silu(x gate) * (x up))`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Ffn {
    /// One FFN of intermediate width `dim`, tensor-parallel over every rank.
    Dense {
        /// `F`.
        dim: usize,
    },
    /// `experts` experts of width `dim`, `top_k` of them per token chosen by a softmax router.
    Moe {
        /// Experts.
        experts: usize,
        /// Experts per token.
        top_k: usize,
        /// Intermediate width of one expert.
        dim: usize,
    },
}

impl Ffn {
    /// DeepSeek-V3's MoE scaled to this machine: 256 experts of 2048 with 8 per token -> 16
    /// experts of 256 with 2 per token.
    pub const DEEPSEEK_V3_SCALED: Self = Self::Moe {
        experts: 16,
        top_k: 2,
        dim: 256,
    };
}

/// One decode layer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    /// The attention.
    pub attention: Attention,
    /// `Q`, query heads.
    pub q_heads: usize,
    /// `H`, the hidden width.
    pub hidden: usize,
    /// The FFN.
    pub ffn: Ffn,
}

/// Elements per MLA query and cache row (kvroute-kernels' `D_QK`).
pub const MLA_QK: usize = kvroute_kernels::layout::D_QK;
/// Elements per MLA output row (kvroute-kernels' `D_LATENT`).
pub const MLA_V: usize = kvroute_kernels::layout::D_LATENT;

impl Shape {
    /// DeepSeek-V3's layer scaled to this machine: its MLA attention unchanged per head
    /// (576-wide latent, 512 out, softmax scale of its 192-wide query-key heads) with 16 of
    /// its 128 heads, hidden 7168 -> 1024; its MoE of 256 experts of 2048 with 8 per token ->
    /// 16 experts of 256 with 2 per token, or a dense FFN of 2048 (its first layers' 18432
    /// scaled alike).
    pub const fn deepseek_v3_scaled(moe: bool) -> Self {
        Self {
            attention: Attention::Mla,
            q_heads: 16,
            hidden: 1024,
            ffn: if moe {
                Ffn::DEEPSEEK_V3_SCALED
            } else {
                Ffn::Dense { dim: 2048 }
            },
        }
    }

    /// Llama-3.1-405B's layer scaled to this machine: GQA with 128 query and 8 KV heads of
    /// 128 -> 16 query and its 8 KV heads (kept, so that TPA can reach 8) of 64, hidden
    /// 16384 -> 1024, FFN 53248 -> 3328 (the same 3.25 x hidden); `moe` swaps in
    /// DeepSeek-V3's scaled MoE.
    pub const fn llama_405b_scaled(moe: bool) -> Self {
        Self {
            attention: Attention::Gqa {
                kv_heads: 8,
                head_dim: 64,
            },
            q_heads: 16,
            hidden: 1024,
            ffn: if moe {
                Ffn::DEEPSEEK_V3_SCALED
            } else {
                Ffn::Dense { dim: 3328 }
            },
        }
    }

    /// `K`: 1 for MLA (every head reads the one latent).
    pub const fn kv_heads(&self) -> usize {
        match self.attention {
            Attention::Mla => 1,
            Attention::Gqa { kv_heads, .. } => kv_heads,
        }
    }

    /// Elements of a query row (and of a key).
    pub const fn qk_dim(&self) -> usize {
        match self.attention {
            Attention::Mla => MLA_QK,
            Attention::Gqa { head_dim, .. } => head_dim,
        }
    }

    /// Elements of an attention output row (and of a value).
    pub const fn v_dim(&self) -> usize {
        match self.attention {
            Attention::Mla => MLA_V,
            Attention::Gqa { head_dim, .. } => head_dim,
        }
    }

    /// The softmax scale: `1/sqrt(192)` for DeepSeek's MLA (128 + 64 query-key dims),
    /// `1/sqrt(Hsz)` for GQA.
    pub fn softmax_scale(&self) -> f32 {
        match self.attention {
            Attention::Mla => 1.0 / 192f32.sqrt(),
            Attention::Gqa { head_dim, .. } => 1.0 / (head_dim as f32).sqrt(),
        }
    }

    /// Checks the shape against `layout`: heads divide over the ranks, `TPA <= K` and
    /// divides `K`, the FFN divides over `TPF` and its experts over `EP`.
    pub fn check(&self, layout: &Layout) -> Result<()> {
        layout.validate()?;
        let n = layout.ranks();
        let bad = |why: String| Err(HelixError::Config(why));
        if self.q_heads == 0 || self.hidden == 0 || self.qk_dim() == 0 {
            return bad(format!("empty shape {self:?}"));
        }
        if !self.q_heads.is_multiple_of(n) {
            return bad(format!(
                "{} query heads do not divide over {n} ranks",
                self.q_heads
            ));
        }
        if !self.hidden.is_multiple_of(n) {
            return bad(format!(
                "hidden width {} does not divide over {n} ranks",
                self.hidden
            ));
        }
        let k = self.kv_heads();
        if layout.tpa > k || !k.is_multiple_of(layout.tpa) || !self.q_heads.is_multiple_of(k) {
            return bad(format!(
                "TPA {} must divide the {k} KV heads (which divide the {} query heads)",
                layout.tpa, self.q_heads
            ));
        }
        if self.v_dim() > self.qk_dim() && matches!(self.attention, Attention::Gqa { .. }) {
            return bad("GQA heads have one width".to_owned());
        }
        match self.ffn {
            Ffn::Dense { dim } => {
                if layout.ep != 1 {
                    return bad(format!("a dense FFN runs with EP = 1, not {}", layout.ep));
                }
                if dim == 0 || !dim.is_multiple_of(layout.tpf) {
                    return bad(format!(
                        "FFN width {dim} does not divide over TPF {}",
                        layout.tpf
                    ));
                }
            }
            Ffn::Moe {
                experts,
                top_k,
                dim,
            } => {
                if experts == 0 || !experts.is_multiple_of(layout.ep) {
                    return bad(format!(
                        "{experts} experts do not divide over EP {}",
                        layout.ep
                    ));
                }
                if top_k == 0 || top_k > experts {
                    return bad(format!("top-{top_k} of {experts} experts"));
                }
                if dim == 0 || !dim.is_multiple_of(layout.tpf) {
                    return bad(format!(
                        "expert width {dim} does not divide over TPF {}",
                        layout.tpf
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The streams of the generator: one per tensor.
pub(crate) mod stream {
    pub(crate) const W_O: u64 = 1;
    /// The dense FFN's gate, up and down are `DENSE + {0, 1, 2}`.
    pub(crate) const DENSE: u64 = 2;
    pub(crate) const ROUTER: u64 = 5;
    /// Expert `e`'s gate, up and down are `EXPERT + 3e + {0, 1, 2}`.
    pub(crate) const EXPERT: u64 = 1 << 16;
    /// Request `b`'s latents / keys / values are `KV + 4b + {0, 1, 2}`.
    pub(crate) const KV: u64 = 1 << 32;
    /// Step `s`'s queries are `QUERY + s`.
    pub(crate) const QUERY: u64 = 1 << 48;
}

const fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Element `index` of tensor `stream` under `seed`: uniform in `[-1, 1)`, a pure function of
/// its arguments.
pub fn element(seed: u64, stream: u64, index: u64) -> f32 {
    let key = splitmix(seed ^ splitmix(stream));
    let bits = splitmix(key ^ index.wrapping_mul(0x2545_f491_4f6c_dd1d));
    (bits >> 40) as f32 * (2.0 / (1u64 << 24) as f32) - 1.0
}

/// Rows `rows` and columns `cols` of the `[_, width]` matrix of `stream`, scaled by `scale`,
/// row-major.
pub fn block(
    seed: u64,
    stream: u64,
    width: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    scale: f32,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * cols.len());
    for r in rows {
        for c in cols.clone() {
            out.push(scale * element(seed, stream, (r * width + c) as u64));
        }
    }
    out
}

/// Weights scaled by `1/sqrt(fan_in)`, so activations stay of order one through the layer.
pub fn init_scale(fan_in: usize) -> f32 {
    1.0 / (fan_in as f32).sqrt()
}

/// `out[b] += x[b] w` for `x: [B, k]`, `w: [k, n]`, `out: [B, n]`. Decode is weight-bound
/// (`B` is small): the loop reads each row of `w` once for every request, so `w` streams
/// from memory once per call instead of once per request.
pub fn matmul_acc(x: &[f32], w: &[f32], k: usize, n: usize, out: &mut [f32]) {
    debug_assert_eq!(w.len(), k * n);
    let rows = x.len() / k.max(1);
    for (i, wr) in w.chunks_exact(n).enumerate() {
        for b in 0..rows {
            let xi = x[b * k + i];
            if xi == 0.0 {
                continue;
            }
            for (o, wv) in out[b * n..(b + 1) * n].iter_mut().zip(wr) {
                *o += xi * wv;
            }
        }
    }
}

/// RMS normalisation of each `width`-wide row, without a learned gain (the FFN's input norm
/// of every model here; its gain would fold into the FFN's weights).
pub fn rms_norm(x: &mut [f32], width: usize) {
    for row in x.chunks_exact_mut(width) {
        let mean_square = row
            .iter()
            .map(|v| f64::from(*v) * f64::from(*v))
            .sum::<f64>()
            / width as f64;
        let scale = (1.0 / (mean_square + 1e-12).sqrt()) as f32;
        row.iter_mut().for_each(|v| *v *= scale);
    }
}

/// `silu(g) * u`, elementwise into `g`.
pub fn swiglu(g: &mut [f32], u: &[f32]) {
    for (gv, uv) in g.iter_mut().zip(u) {
        *gv = *gv / (1.0 + (-*gv).exp()) * uv;
    }
}

/// The router's choice for one token: the `top_k` largest logits (lower index first on a
/// tie) and their softmax weights over the chosen.
pub fn route(logits: &[f32], top_k: usize) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    let top = logits[order[0]];
    let weights: Vec<f32> = order.iter().map(|&e| (logits[e] - top).exp()).collect();
    let sum: f32 = weights.iter().sum();
    order
        .into_iter()
        .zip(weights)
        .map(|(e, w)| (e, w / sum))
        .collect()
}
