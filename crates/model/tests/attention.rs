//! The split forward pass against an independent f64 reference of DeepSeek-V2's MLA written
//! from the checkpoint's tensors (non-absorbed: per-head keys and values up-projected from
//! the latent), and the properties a remote attention engine relies on.

// Test helpers panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{rel_err, small_config};
use kvroute_kernels::RopeLayout;
use kvroute_model::{Model, ModelConfig, ModelError};

/// A tensor's values and its row width.
fn w<'a>(m: &'a Model, name: &str) -> (&'a [f32], usize) {
    let t = m.tensor(name).unwrap_or_else(|| panic!("{name}"));
    (t.data, *t.shape.last().unwrap())
}

/// `y = W x` in f64 for a row-major `[out, in]` weight.
fn matvec(wt: (&[f32], usize), x: &[f64]) -> Vec<f64> {
    let (data, cols) = wt;
    assert_eq!(cols, x.len());
    data.chunks_exact(cols)
        .map(|r| r.iter().zip(x).map(|(&a, &b)| f64::from(a) * b).sum())
        .collect()
}

fn rms_norm(x: &[f64], g: &[f32], eps: f64) -> Vec<f64> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter()
        .zip(g)
        .map(|(v, &g)| v * inv * f64::from(g))
        .collect()
}

fn rotate(x: &mut [f64], model: &Model, pos: i64, layout: RopeLayout) {
    for (i, (c, s)) in model.rope().angles(pos).into_iter().enumerate() {
        let (a, b) = layout.pair(i);
        let (xa, xb) = (x[a], x[b]);
        x[a] = xa * c - xb * s;
        x[b] = xa * s + xb * c;
    }
}

/// Layer 0 (dense FFN) of `model` over `tokens` at `positions`, causal, as DeepSeek-V2's
/// modelling code computes it without absorption, in f64, rotating with `layout`.
fn naive_layer0(model: &Model, tokens: &[u32], positions: &[i64], layout: RopeLayout) -> Vec<f64> {
    let c = model.config();
    let (h, heads, nope, v) = (
        c.hidden_size,
        c.num_attention_heads,
        c.qk_nope_head_dim,
        c.v_head_dim,
    );
    let (qk, eps, scale) = (
        c.qk_head_dim(),
        c.rms_norm_eps,
        f64::from(model.softmax_scale()),
    );
    let p = "model.layers.0";
    let n = tokens.len();
    let x: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| model.embed(t).unwrap().into_iter().map(f64::from).collect())
        .collect();
    let (mut q, mut k, mut val) = (vec![], vec![], vec![]);
    for (t, xt) in x.iter().enumerate() {
        let hn = rms_norm(xt, w(model, &format!("{p}.input_layernorm.weight")).0, eps);
        let qt = match c.q_lora_rank {
            None => matvec(w(model, &format!("{p}.self_attn.q_proj.weight")), &hn),
            Some(_) => {
                let qa = matvec(w(model, &format!("{p}.self_attn.q_a_proj.weight")), &hn);
                let qa = rms_norm(
                    &qa,
                    w(model, &format!("{p}.self_attn.q_a_layernorm.weight")).0,
                    eps,
                );
                matvec(w(model, &format!("{p}.self_attn.q_b_proj.weight")), &qa)
            }
        };
        let ckv = matvec(
            w(model, &format!("{p}.self_attn.kv_a_proj_with_mqa.weight")),
            &hn,
        );
        let latent = rms_norm(
            &ckv[..512],
            w(model, &format!("{p}.self_attn.kv_a_layernorm.weight")).0,
            eps,
        );
        let mut k_pe = ckv[512..].to_vec();
        rotate(&mut k_pe, model, positions[t], layout);
        let kv = matvec(
            w(model, &format!("{p}.self_attn.kv_b_proj.weight")),
            &latent,
        );
        for head in 0..heads {
            let mut qh = qt[head * qk..(head + 1) * qk].to_vec();
            rotate(&mut qh[nope..], model, positions[t], layout);
            let kvh = &kv[head * (nope + v)..(head + 1) * (nope + v)];
            q.push(qh);
            k.push([&kvh[..nope], &k_pe[..]].concat());
            val.push(kvh[nope..].to_vec());
        }
    }
    let mut out = Vec::with_capacity(n * h);
    for t in 0..n {
        let mut heads_out = Vec::with_capacity(heads * v);
        for head in 0..heads {
            let qh = &q[t * heads + head];
            let s: Vec<f64> = (0..=t)
                .map(|u| {
                    scale
                        * qh.iter()
                            .zip(&k[u * heads + head])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            heads_out.extend((0..v).map(|d| {
                (0..=t)
                    .map(|u| e[u] / z * val[u * heads + head][d])
                    .sum::<f64>()
            }));
        }
        let attn = matvec(
            w(model, &format!("{p}.self_attn.o_proj.weight")),
            &heads_out,
        );
        let x1: Vec<f64> = x[t].iter().zip(&attn).map(|(a, b)| a + b).collect();
        let h2 = rms_norm(
            &x1,
            w(model, &format!("{p}.post_attention_layernorm.weight")).0,
            eps,
        );
        let g = matvec(w(model, &format!("{p}.mlp.gate_proj.weight")), &h2);
        let u = matvec(w(model, &format!("{p}.mlp.up_proj.weight")), &h2);
        let act: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let f = matvec(w(model, &format!("{p}.mlp.down_proj.weight")), &act);
        out.extend(x1.iter().zip(&f).map(|(a, b)| a + b));
    }
    out
}

/// Layer 0 through the split API with local causal attention.
fn split_layer0(model: &Model, tokens: &[u32], positions: &[i64]) -> Vec<f32> {
    let x = model.embed_tokens(tokens).unwrap();
    let inputs = model.attention_inputs(0, &x, positions).unwrap();
    let o = model.attend_causal(&inputs).unwrap();
    model.attention_output(0, &inputs.residual, &o).unwrap()
}

/// Absorbed attention over bf16 rows equals non-absorbed MLA in f64 to bf16 accuracy, and the
/// check is sharp enough to see the wrong RoPE pairing.
#[test]
fn absorbed_attention_equals_naive_mla_within_bf16_rounding() {
    let mut with_q_lora = small_config();
    with_q_lora.q_lora_rank = Some(48);
    for config in [small_config(), with_q_lora] {
        let model = Model::init(config.clone(), 21).unwrap();
        let (tokens, positions) = ([7, 99, 3, 64, 12], [40, 41, 42, 43, 44]);
        let got = split_layer0(&model, &tokens, &positions);
        let want = naive_layer0(&model, &tokens, &positions, RopeLayout::Interleaved);
        // The cache rows (and so the values) and the query rows are bf16: about 2^-9 relative
        // each; measured 1.4e-3 and 1.6e-3. A wrong RoPE pairing gives 0.08.
        let err = rel_err(&got, &want);
        assert!(
            err < 4e-3,
            "q_lora_rank {:?}: relative error {err}",
            config.q_lora_rank
        );
        let wrong = naive_layer0(&model, &tokens, &positions, RopeLayout::Half);
        assert!(
            rel_err(&got, &wrong) > 10.0 * err,
            "the test would not see a wrong pairing"
        );
    }
}

/// Layer 0's cache rows from a prefill are those [`Model::attention_inputs`] gives for the
/// same tokens, and the layer-1 rows are those of the layer-0 output.
#[test]
fn prefill_rows_are_the_split_apis_rows() {
    let model = Model::init(small_config(), 4).unwrap();
    let (tokens, positions) = ([1, 2, 3, 5, 8, 13, 21], [100, 101, 102, 103, 104, 105, 106]);
    let kv = model.prefill(&tokens, &positions).unwrap();
    assert_eq!(kv.len(), 2);
    let x = model.embed_tokens(&tokens).unwrap();
    assert_eq!(kv[0], model.attention_inputs(0, &x, &positions).unwrap().kv);
    let x1 = split_layer0(&model, &tokens, &positions);
    assert_eq!(
        kv[1],
        model.attention_inputs(1, &x1, &positions).unwrap().kv
    );
}

/// Decoding a token through the split API, attending the prefilled rows plus its own, gives
/// the same bits as prefilling it with the others, alone or batched with other requests.
#[test]
fn decoding_a_token_equals_prefilling_it() {
    let model = Model::init(small_config(), 9).unwrap();
    let tokens = [5, 17, 33, 2, 90, 41];
    let positions: Vec<i64> = (0..6).map(|i| 2048 + i).collect();
    let full = model.prefill_with_hidden(&tokens, &positions).unwrap();
    let part = model.prefill(&tokens[..5], &positions[..5]).unwrap();
    // The decoded token in slot 1 of a batch of 3 requests; the others attend only themselves.
    let (batch, pos) = ([77, tokens[5], 8], [0, positions[5], 9]);
    let heads = model.config().num_attention_heads;
    let mut x = model.embed_tokens(&batch).unwrap();
    for (layer, rows) in part.iter().enumerate() {
        let inputs = model.attention_inputs(layer, &x, &pos).unwrap();
        assert_eq!(inputs.kv[576..1152], full.kv[layer][5 * 576..]);
        let mut o = Vec::new();
        for r in 0..3 {
            let own = &inputs.kv[r * 576..(r + 1) * 576];
            let cache = if r == 1 {
                [rows.as_slice(), own].concat()
            } else {
                own.to_vec()
            };
            o.extend(
                model
                    .attend(
                        &inputs.queries[r * heads * 576..(r + 1) * heads * 576],
                        &cache,
                    )
                    .unwrap(),
            );
        }
        x = model.attention_output(layer, &inputs.residual, &o).unwrap();
    }
    let h = model.config().hidden_size;
    assert_eq!(x[h..2 * h], full.hidden[5 * h..]);
}

/// RoPE makes attention depend on relative positions only: shifting a whole chunk's
/// positions changes its outputs by bf16 rounding alone, while spreading them apart does not.
#[test]
fn shifting_all_positions_changes_outputs_only_by_rounding() {
    let model = Model::init(small_config(), 13).unwrap();
    let tokens: Vec<u32> = (0..12).map(|i| (i * 37 % 128) as u32).collect();
    let at = |p0: i64, step: i64| {
        let pos: Vec<i64> = (0..12).map(|i| p0 + step * i).collect();
        model.prefill_with_hidden(&tokens, &pos).unwrap().hidden
    };
    let base: Vec<f64> = at(0, 1).into_iter().map(f64::from).collect();
    let shifted = rel_err(&at(100_000, 1), &base);
    // Measured 1.8e-3 (the rows' bf16 rounding differs with the angles); spread: 0.21.
    assert!(shifted < 5e-3, "shifted: {shifted}");
    let spread = rel_err(&at(0, 3), &base);
    assert!(
        spread > 10.0 * shifted,
        "spread {spread} vs shifted {shifted}"
    );
}

/// With the tiny model's `lm_head` scale, greedy choices lead by more than bf16 noise.
#[test]
fn greedy_margins_are_large_against_bf16_noise() {
    let model = Model::init(ModelConfig::tiny(), 1).unwrap();
    let tokens: Vec<u32> = (0..32).map(|i| (i * 101 % 512) as u32).collect();
    let pos: Vec<i64> = (0..32).collect();
    let hidden = model.prefill_with_hidden(&tokens, &pos).unwrap().hidden;
    let mut margins: Vec<f32> = model
        .greedy(&hidden)
        .unwrap()
        .iter()
        .map(|t| t.margin)
        .collect();
    margins.sort_by(f32::total_cmp);
    // Measured median 2.6 (with a logit scale of 1 it would be about 0.3).
    assert!(margins[16] > 1.0, "median margin {}", margins[16]);
}

#[test]
fn malformed_calls_are_refused() {
    let model = Model::init(small_config(), 1).unwrap();
    let x = model.embed_tokens(&[1, 2]).unwrap();
    assert!(matches!(
        model.attention_inputs(2, &x, &[0, 1]),
        Err(ModelError::OutOfRange { what: "layer", .. })
    ));
    assert!(matches!(
        model.attention_inputs(0, &x, &[0]),
        Err(ModelError::Shape { .. })
    ));
    assert!(matches!(
        model.attention_inputs(0, &x[1..], &[0, 1]),
        Err(ModelError::Shape { .. })
    ));
    assert!(matches!(
        model.embed(128),
        Err(ModelError::OutOfRange { what: "token", .. })
    ));
    let inputs = model.attention_inputs(0, &x, &[0, 1]).unwrap();
    for (tokens, heads) in [(2, 0), (usize::MAX, 4), (3, 4)] {
        let bad = kvroute_model::AttnInputs {
            tokens,
            heads,
            ..inputs.clone()
        };
        assert!(matches!(
            model.attend_causal(&bad),
            Err(ModelError::Shape { .. })
        ));
    }
    let mut o = model.attend_causal(&inputs).unwrap();
    assert!(
        model
            .attention_output(0, &inputs.residual, &o[1..])
            .is_err()
    );
    o[77] = f32::NAN;
    assert!(matches!(
        model.attention_output(0, &inputs.residual, &o),
        Err(ModelError::NonFiniteInput { index: 77, .. })
    ));
}
