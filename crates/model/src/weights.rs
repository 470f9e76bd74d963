//! The model's tensors, named as in DeepSeek-V2's Hugging Face checkpoints.
//!
//! [`build`] is the one place the names and shapes are spelled out: loading a checkpoint and
//! initialising a fresh model both assemble the model through it (loading from files,
//! initialising from a random source), and [`Model::tensors`] walks the result in the same
//! terms, so what is saved is what is loaded.

use kvroute_kernels::Rope;
use kvroute_kernels::layout::{D_LATENT, D_QK};

use crate::config::ModelConfig;
use crate::error::Result;
use crate::linalg::Linear;

/// SwiGLU feed-forward: `down(silu(gate x) * up x)`.
#[derive(Debug, Clone)]
pub(crate) struct Mlp {
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// The query projection: direct (V2-Lite) or through a normalised low-rank latent (V2, V3).
#[derive(Debug, Clone)]
pub(crate) enum QProj {
    Direct(Linear),
    LowRank {
        a: Linear,
        norm: Vec<f32>,
        b: Linear,
    },
}

/// One layer's MLA weights, with the per-head slices of `kv_b_proj` that absorbed attention
/// multiplies by (DeepSeek-V2 section 2.1.2: `W_UK` folds into the query, `W_UV` into the
/// output), laid out for [`Linear`].
#[derive(Debug, Clone)]
pub(crate) struct Attention {
    pub(crate) q: QProj,
    pub(crate) kv_a: Linear,
    pub(crate) kv_norm: Vec<f32>,
    pub(crate) kv_b: Linear,
    pub(crate) o: Linear,
    /// Per head, `W_UK^T`: `[512, nope]`, so that `q_latent = W_UK^T q_nope`.
    pub(crate) uk_t: Vec<Linear>,
    /// Per head, `W_UV`: `[v, 512]`, so that `v = W_UV o_latent`.
    pub(crate) uv: Vec<Linear>,
}

/// A routed-expert layer: the router, the experts and the shared experts fused into one FFN.
#[derive(Debug, Clone)]
pub(crate) struct Moe {
    pub(crate) gate: Linear,
    pub(crate) experts: Vec<Mlp>,
    pub(crate) shared: Option<Mlp>,
}

#[derive(Debug, Clone)]
pub(crate) enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

#[derive(Debug, Clone)]
pub(crate) struct Layer {
    pub(crate) input_norm: Vec<f32>,
    pub(crate) attn: Attention,
    pub(crate) post_norm: Vec<f32>,
    pub(crate) ffn: Ffn,
}

/// A DeepSeek-V2-architecture model in f32, with its configuration.
#[derive(Debug, Clone)]
pub struct Model {
    pub(crate) config: ModelConfig,
    pub(crate) rope: Rope,
    pub(crate) scale: f32,
    pub(crate) embed: Linear,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Vec<f32>,
    pub(crate) lm_head: Linear,
}

/// One tensor of a [`Model`], by its checkpoint name.
#[derive(Debug, Clone)]
pub struct TensorRef<'a> {
    /// The checkpoint name (`model.layers.0.self_attn.kv_b_proj.weight`).
    pub name: String,
    /// `[out, in]` for a projection, `[width]` for a norm.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: &'a [f32],
}

/// Where [`build`] gets each tensor: `(name, shape) -> values` (`shape.iter().product()` of
/// them), or an error naming it.
pub(crate) type Source<'a> = dyn FnMut(&str, &[usize]) -> Result<Vec<f32>> + 'a;

fn linear(src: &mut Source<'_>, name: &str, out: usize, inp: usize) -> Result<Linear> {
    let w = src(&format!("{name}.weight"), &[out, inp])?;
    Ok(Linear::new(out, inp, w))
}

fn norm(src: &mut Source<'_>, name: &str, width: usize) -> Result<Vec<f32>> {
    src(&format!("{name}.weight"), &[width])
}

fn mlp(src: &mut Source<'_>, name: &str, hidden: usize, inter: usize) -> Result<Mlp> {
    Ok(Mlp {
        gate: linear(src, &format!("{name}.gate_proj"), inter, hidden)?,
        up: linear(src, &format!("{name}.up_proj"), inter, hidden)?,
        down: linear(src, &format!("{name}.down_proj"), hidden, inter)?,
    })
}

/// The model `config` describes (validated here), every tensor taken from `src`.
pub(crate) fn build(config: ModelConfig, src: &mut Source<'_>) -> Result<Model> {
    config.validate()?;
    let c = &config;
    let (h, heads) = (c.hidden_size, c.num_attention_heads);
    let (nope, v) = (c.qk_nope_head_dim, c.v_head_dim);
    let embed = linear(src, "model.embed_tokens", c.vocab_size, h)?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let input_norm = norm(src, &format!("{p}.input_layernorm"), h)?;
        let a = format!("{p}.self_attn");
        let q_out = heads * c.qk_head_dim();
        let q = match c.q_lora_rank {
            None => QProj::Direct(linear(src, &format!("{a}.q_proj"), q_out, h)?),
            Some(r) => QProj::LowRank {
                a: linear(src, &format!("{a}.q_a_proj"), r, h)?,
                norm: norm(src, &format!("{a}.q_a_layernorm"), r)?,
                b: linear(src, &format!("{a}.q_b_proj"), q_out, r)?,
            },
        };
        let kv_a = linear(src, &format!("{a}.kv_a_proj_with_mqa"), D_QK, h)?;
        let kv_norm = norm(src, &format!("{a}.kv_a_layernorm"), D_LATENT)?;
        let kv_b = linear(src, &format!("{a}.kv_b_proj"), heads * (nope + v), D_LATENT)?;
        let o = linear(src, &format!("{a}.o_proj"), h, heads * v)?;
        let (uk_t, uv) = absorbed(&kv_b, heads, nope, v);
        let attn = Attention {
            q,
            kv_a,
            kv_norm,
            kv_b,
            o,
            uk_t,
            uv,
        };
        let post_norm = norm(src, &format!("{p}.post_attention_layernorm"), h)?;
        let ffn = if c.is_moe_layer(i) {
            let inter = c.moe_intermediate_size;
            let gate = linear(src, &format!("{p}.mlp.gate"), c.n_routed_experts, h)?;
            let experts = (0..c.n_routed_experts)
                .map(|e| mlp(src, &format!("{p}.mlp.experts.{e}"), h, inter))
                .collect::<Result<_>>()?;
            let shared = (c.n_shared_experts > 0)
                .then(|| {
                    let shared_inter = inter * c.n_shared_experts;
                    mlp(src, &format!("{p}.mlp.shared_experts"), h, shared_inter)
                })
                .transpose()?;
            Ffn::Moe(Moe {
                gate,
                experts,
                shared,
            })
        } else {
            Ffn::Dense(mlp(src, &format!("{p}.mlp"), h, c.intermediate_size)?)
        };
        layers.push(Layer {
            input_norm,
            attn,
            post_norm,
            ffn,
        });
    }
    let norm = norm(src, "model.norm", h)?;
    let lm_head = linear(src, "lm_head", c.vocab_size, h)?;
    Ok(Model {
        rope: c.rope()?,
        scale: c.softmax_scale(),
        config,
        embed,
        layers,
        norm,
        lm_head,
    })
}

/// Per head, `W_UK^T` (`[512, nope]`) and `W_UV` (`[v, 512]`) out of `kv_b_proj`, whose rows
/// are, head by head, `nope` rows of `W_UK` then `v` rows of `W_UV`.
fn absorbed(kv_b: &Linear, heads: usize, nope: usize, v: usize) -> (Vec<Linear>, Vec<Linear>) {
    let rows = |r0: usize, n: usize| &kv_b.weights()[r0 * D_LATENT..(r0 + n) * D_LATENT];
    let mut uk_t = Vec::with_capacity(heads);
    let mut uv = Vec::with_capacity(heads);
    for head in 0..heads {
        let r0 = head * (nope + v);
        let uk = rows(r0, nope);
        let mut t = vec![0.0; D_LATENT * nope];
        for i in 0..nope {
            for j in 0..D_LATENT {
                t[j * nope + i] = uk[i * D_LATENT + j];
            }
        }
        uk_t.push(Linear::new(D_LATENT, nope, t));
        uv.push(Linear::new(v, D_LATENT, rows(r0 + nope, v).to_vec()));
    }
    (uk_t, uv)
}

impl Model {
    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The attention's softmax scale ([`ModelConfig::softmax_scale`]).
    pub fn softmax_scale(&self) -> f32 {
        self.scale
    }

    /// The RoPE keys and queries are rotated with ([`ModelConfig::rope`]).
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// Every tensor, in checkpoint order, under its checkpoint name (what [`Model::save`]
    /// writes, rounded to bf16).
    pub fn tensors(&self) -> Vec<TensorRef<'_>> {
        let mut out = Vec::new();
        self.visit_into(&mut out);
        out
    }

    /// The tensor named `name`, if the model has it.
    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        self.tensors().into_iter().find(|t| t.name == name)
    }

    fn visit_into<'a>(&'a self, out: &mut Vec<TensorRef<'a>>) {
        let lin = |out: &mut Vec<TensorRef<'a>>, name: String, l: &'a Linear| {
            out.push(TensorRef {
                name: format!("{name}.weight"),
                shape: vec![l.out, l.inp],
                data: l.weights(),
            });
        };
        let nrm = |out: &mut Vec<TensorRef<'a>>, name: String, w: &'a [f32]| {
            out.push(TensorRef {
                name: format!("{name}.weight"),
                shape: vec![w.len()],
                data: w,
            });
        };
        let mlp = |out: &mut Vec<TensorRef<'a>>, name: &str, m: &'a Mlp| {
            lin(out, format!("{name}.gate_proj"), &m.gate);
            lin(out, format!("{name}.up_proj"), &m.up);
            lin(out, format!("{name}.down_proj"), &m.down);
        };
        lin(out, "model.embed_tokens".into(), &self.embed);
        for (i, layer) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            nrm(out, format!("{p}.input_layernorm"), &layer.input_norm);
            let a = format!("{p}.self_attn");
            let at = &layer.attn;
            match &at.q {
                QProj::Direct(q) => lin(out, format!("{a}.q_proj"), q),
                QProj::LowRank { a: qa, norm, b } => {
                    lin(out, format!("{a}.q_a_proj"), qa);
                    nrm(out, format!("{a}.q_a_layernorm"), norm);
                    lin(out, format!("{a}.q_b_proj"), b);
                }
            }
            lin(out, format!("{a}.kv_a_proj_with_mqa"), &at.kv_a);
            nrm(out, format!("{a}.kv_a_layernorm"), &at.kv_norm);
            lin(out, format!("{a}.kv_b_proj"), &at.kv_b);
            lin(out, format!("{a}.o_proj"), &at.o);
            nrm(
                out,
                format!("{p}.post_attention_layernorm"),
                &layer.post_norm,
            );
            match &layer.ffn {
                Ffn::Dense(m) => mlp(out, &format!("{p}.mlp"), m),
                Ffn::Moe(moe) => {
                    lin(out, format!("{p}.mlp.gate"), &moe.gate);
                    for (e, m) in moe.experts.iter().enumerate() {
                        mlp(out, &format!("{p}.mlp.experts.{e}"), m);
                    }
                    if let Some(m) = &moe.shared {
                        mlp(out, &format!("{p}.mlp.shared_experts"), m);
                    }
                }
            }
        }
        nrm(out, "model.norm".into(), &self.norm);
        lin(out, "lm_head".into(), &self.lm_head);
    }
}
