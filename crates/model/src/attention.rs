//! One layer split around its attention, in absorbed MLA form (DeepSeek-V2: A Strong,
//! Economical, and Efficient Mixture-of-Experts Language Model, section 2.1).
//!
//! MLA caches per token one latent `c = kv_a_layernorm(kv_a_proj(x)[..512])` and one shared
//! RoPE key `k_pe`; head `h`'s key is `[W_UK[h] c | k_pe]` and its value `W_UV[h] c`.
//! Section 2.1.2's absorption moves `W_UK[h]` into the query (`q_nope . W_UK c = (W_UK^T
//! q_nope) . c`) and `W_UV[h]` after the softmax (`sum p W_UV c = W_UV sum p c`), so attention
//! runs over the cache rows themselves: a query row `[W_UK^T q_nope | rot(q_pe)]` against key
//! rows `[c | rot(k_pe)]`, 576 dims, with the first 512 of each key row as its value. That is
//! the kernels' convention ([`kvroute_kernels::layout`]), so [`Model::attention_inputs`]
//! produces exactly what a holder of the rows attends with, and [`Model::attention_output`]
//! takes the `[512]` outputs back, wherever they were computed.

use kvroute_kernels::layout::{D_LATENT, D_QK, D_ROPE};
use kvroute_kernels::{Backend, Cache, Queries, bf16, partial_dense};
use rayon::prelude::*;

use crate::error::{ModelError, Result, check_finite, check_len};
use crate::linalg::{Rows, rms_norm, rms_norm_in_place};
use crate::weights::{Model, QProj};

/// One layer's attention inputs for a batch of tokens, and the residual stream it adds to.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnInputs {
    /// Tokens in the batch.
    pub tokens: usize,
    /// Query heads per token.
    pub heads: usize,
    /// Query rows, bf16 bits, `[tokens * heads, 576]`, token-major: row `t * heads + h`.
    pub queries: Vec<u16>,
    /// Each token's cache row, bf16 bits, `[tokens, 576]`: `[latent | rotated k_pe]`.
    pub kv: Vec<u16>,
    /// The layer's input hidden states `[tokens, hidden]`, which the attention adds to.
    pub residual: Vec<f32>,
}

/// Rotates the 64-dim RoPE band `x` by `angles` in f64 (as the kernels'
/// `rope::rotate_row_f64`) into bf16 bits, rounding once.
fn rotate_into(x: &[f32], angles: &[(f64, f64); D_ROPE / 2], model: &Model, out: &mut [u16]) {
    let layout = model.rope.layout();
    for (i, &(c, s)) in angles.iter().enumerate() {
        let (a, b) = layout.pair(i);
        let (xa, xb) = (f64::from(x[a]), f64::from(x[b]));
        out[a] = bf16::from_f64(xa * c - xb * s);
        out[b] = bf16::from_f64(xa * s + xb * c);
    }
}

impl Model {
    pub(crate) fn check_layer(&self, layer: usize) -> Result<()> {
        if layer < self.layers.len() {
            Ok(())
        } else {
            Err(ModelError::OutOfRange {
                what: "layer",
                index: layer as u64,
                bound: self.layers.len() as u64,
            })
        }
    }

    /// Rows `[tokens, hidden]` of `x`: the token count, or an error.
    pub(crate) fn tokens_of(&self, what: &'static str, x: &[f32]) -> Result<usize> {
        let h = self.config.hidden_size;
        let n = x.len() / h;
        check_len(what, n.max(1) * h, x.len())?;
        check_finite(what, x)?;
        Ok(n)
    }

    /// Layer `layer`'s query rows and cache rows for hidden states `x` (`[tokens, hidden]`)
    /// at `positions` (one per token): `q = q_proj(rmsnorm(x))` per head `[nope | rope]`,
    /// query row `bf16([W_UK^T q_nope | rot(q_pe)])`; `c = kv_a_proj_with_mqa(rmsnorm(x))`,
    /// cache row `bf16([kv_a_layernorm(c[..512]) | rot(c[512..])])`, both rotated at the
    /// token's position. Scores are then `softmax_scale * (query row . cache row)`.
    pub fn attention_inputs(
        &self,
        layer: usize,
        x: &[f32],
        positions: &[i64],
    ) -> Result<AttnInputs> {
        self.attention_inputs_owned(layer, x.to_vec(), positions)
    }

    pub(crate) fn attention_inputs_owned(
        &self,
        layer: usize,
        x: Vec<f32>,
        positions: &[i64],
    ) -> Result<AttnInputs> {
        self.check_layer(layer)?;
        let n = self.tokens_of("hidden states", &x)?;
        check_len("positions", n, positions.len())?;
        let c = &self.config;
        let (heads, nope, eps) = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.rms_norm_eps as f32,
        );
        let qk = c.qk_head_dim();
        let at = &self.layers[layer].attn;
        let h = rms_norm(&x, &self.layers[layer].input_norm, eps);
        let q = match &at.q {
            QProj::Direct(w) => w.apply(&h, n),
            QProj::LowRank { a, norm, b } => {
                let mut qa = a.apply(&h, n);
                rms_norm_in_place(&mut qa, norm, eps);
                b.apply(&qa, n)
            }
        };
        let mut ckv = at.kv_a.apply(&h, n);
        // Absorbed query latents, straight into the rows' first 512 dims.
        let mut q_rows = vec![0f32; n * heads * D_QK];
        for (head, uk_t) in at.uk_t.iter().enumerate() {
            let q_nope = Rows {
                data: &q[head * qk..],
                stride: heads * qk,
            };
            uk_t.apply_into(q_nope, n, &mut q_rows[head * D_QK..], heads * D_QK);
        }
        let mut queries = bf16::slice_from_f32(&q_rows);
        let mut kv = vec![0u16; n * D_QK];
        for (t, &pos) in positions.iter().enumerate() {
            let angles = self.rope.angles(pos);
            let row = &mut ckv[t * D_QK..(t + 1) * D_QK];
            rms_norm_in_place(&mut row[..D_LATENT], &at.kv_norm, eps);
            let out = &mut kv[t * D_QK..(t + 1) * D_QK];
            for (o, &v) in out[..D_LATENT].iter_mut().zip(&row[..D_LATENT]) {
                *o = bf16::from_f32(v);
            }
            rotate_into(&row[D_LATENT..], &angles, self, &mut out[D_LATENT..]);
            for head in 0..heads {
                let q_pe = &q[t * heads * qk + head * qk + nope..][..D_ROPE];
                let r = (t * heads + head) * D_QK;
                rotate_into(q_pe, &angles, self, &mut queries[r + D_LATENT..r + D_QK]);
            }
        }
        Ok(AttnInputs {
            tokens: n,
            heads,
            queries,
            kv,
            residual: x,
        })
    }

    /// The rest of layer `layer` given its attention outputs over the latents, `o`
    /// (`[tokens * heads, 512]`, row `t * heads + h` as the query rows): per head `v = W_UV o`, the heads
    /// through `o_proj` and added to `residual` (`[tokens, hidden]`, [`AttnInputs::residual`]);
    /// then `post_attention_layernorm` and the FFN (dense SwiGLU, or MoE), added again. The
    /// layer's output hidden states, `[tokens, hidden]`. `o` may come from another engine: a
    /// non-finite value is an error.
    pub fn attention_output(&self, layer: usize, residual: &[f32], o: &[f32]) -> Result<Vec<f32>> {
        self.check_layer(layer)?;
        let n = self.tokens_of("residual", residual)?;
        let c = &self.config;
        let (heads, v) = (c.num_attention_heads, c.v_head_dim);
        check_len("attention outputs", n * heads * D_LATENT, o.len())?;
        check_finite("attention outputs", o)?;
        let l = &self.layers[layer];
        let mut v_all = vec![0f32; n * heads * v];
        for (head, uv) in l.attn.uv.iter().enumerate() {
            let o_head = Rows {
                data: &o[head * D_LATENT..],
                stride: heads * D_LATENT,
            };
            uv.apply_into(o_head, n, &mut v_all[head * v..], heads * v);
        }
        let mut x = l.attn.o.apply(&v_all, n);
        for (a, &r) in x.iter_mut().zip(residual) {
            *a += r;
        }
        let h = rms_norm(&x, &l.post_norm, c.rms_norm_eps as f32);
        let f = self.ffn(l, &h, n);
        for (a, b) in x.iter_mut().zip(f) {
            *a += b;
        }
        Ok(x)
    }

    /// Dense attention of every query row (`[rows, 576]` bf16) over every cache row (`[ct,
    /// 576]` bf16), on the CPU kernels: `[rows, 512]` outputs. A decode step's local
    /// attention, the reference a remote one is checked against.
    pub fn attend(&self, queries: &[u16], cache: &[u16]) -> Result<Vec<f32>> {
        let (q, cache) = (Queries::new(queries)?, Cache::contiguous(cache)?);
        Ok(partial_dense(Backend::Cpu, &q, &cache, self.scale)?.o)
    }

    /// Causal attention within one batch: token `t`'s query rows over cache rows `0..=t` of
    /// `inputs.kv` (an independent sequence, as a chunk prefilled alone). `[tokens * heads,
    /// 512]` outputs. Tokens run in parallel, each one dense kernel call over its prefix.
    pub fn attend_causal(&self, inputs: &AttnInputs) -> Result<Vec<f32>> {
        let (n, heads) = (inputs.tokens, inputs.heads);
        // The fields are public: sizes are checked, without overflow, before any slicing.
        let elems = |what, per: usize, got: usize| match n.checked_mul(per) {
            Some(want) if per > 0 => check_len(what, want, got),
            _ => Err(ModelError::Shape {
                what,
                expected: usize::MAX,
                got,
            }),
        };
        elems(
            "query rows",
            heads.saturating_mul(D_QK),
            inputs.queries.len(),
        )?;
        elems("cache rows", D_QK, inputs.kv.len())?;
        let mut o = vec![0f32; n * heads * D_LATENT];
        o.par_chunks_mut(heads * D_LATENT)
            .enumerate()
            .try_for_each(|(t, out)| {
                let q = Queries::new(&inputs.queries[t * heads * D_QK..(t + 1) * heads * D_QK])?;
                let cache = Cache::contiguous(&inputs.kv[..(t + 1) * D_QK])?;
                out.copy_from_slice(&partial_dense(Backend::Cpu, &q, &cache, self.scale)?.o);
                Ok::<_, ModelError>(())
            })?;
        Ok(o)
    }
}
