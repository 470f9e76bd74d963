//! The feed-forward half of a layer: a dense SwiGLU, or DeepSeekMoE (DeepSeek-V2 section 2.2:
//! fine-grained routed experts plus always-active shared experts).
//!
//! Routing is DeepSeek-V2's `MoEGate` with `topk_method = "greedy"` and `scoring_func =
//! "softmax"`: a softmax over the router's logits, the `num_experts_per_tok` highest scores
//! (ties to the lower expert index), their scores as weights, renormalised to sum to 1 only
//! when `norm_topk_prob` is set and more than one expert is chosen, and otherwise multiplied
//! by `routed_scaling_factor` (modeling_deepseek.py, `MoEGate.forward`). Each token's output
//! is its shared experts' plus its routed experts' in rank order, whatever other tokens are
//! batched with it.

use crate::linalg::swiglu;
use crate::weights::{Ffn, Layer, Mlp, Model, Moe};

impl Mlp {
    /// `down(silu(gate x) * up x)` for `tokens` rows of `x`.
    fn apply(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        let mut g = self.gate.apply(x, tokens);
        let u = self.up.apply(x, tokens);
        swiglu(&mut g, &u);
        self.down.apply(&g, tokens)
    }
}

/// One token's routed experts and their weights, in rank order, from its router logits.
pub(crate) fn route(logits: &[f32], k: usize, renormalise: bool, scale: f32) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Stable: equal scores keep the lower index first.
    order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]));
    let mut top: Vec<(usize, f32)> = order[..k.min(order.len())]
        .iter()
        .map(|&e| (e, exp[e] / sum))
        .collect();
    if renormalise && k > 1 {
        let total: f32 = top.iter().map(|&(_, w)| w).sum::<f32>() + 1e-20;
        top.iter_mut().for_each(|(_, w)| *w /= total);
    } else {
        top.iter_mut().for_each(|(_, w)| *w *= scale);
    }
    top
}

impl Model {
    /// Layer `l`'s FFN of `h` (`[tokens, hidden]`, already normalised).
    pub(crate) fn ffn(&self, l: &Layer, h: &[f32], tokens: usize) -> Vec<f32> {
        match &l.ffn {
            Ffn::Dense(m) => m.apply(h, tokens),
            Ffn::Moe(moe) => self.moe(moe, h, tokens),
        }
    }

    /// Every token's routed experts, [`route`]d from `h`.
    pub(crate) fn routes(&self, moe: &Moe, h: &[f32], tokens: usize) -> Vec<Vec<(usize, f32)>> {
        let c = &self.config;
        let e = c.n_routed_experts;
        let logits = moe.gate.apply(h, tokens);
        (0..tokens)
            .map(|t| {
                route(
                    &logits[t * e..(t + 1) * e],
                    c.num_experts_per_tok,
                    c.norm_topk_prob,
                    c.routed_scaling_factor as f32,
                )
            })
            .collect()
    }

    fn moe(&self, moe: &Moe, h: &[f32], tokens: usize) -> Vec<f32> {
        let (hidden, k) = (self.config.hidden_size, self.config.num_experts_per_tok);
        let routes = self.routes(moe, h, tokens);
        // Each expert runs once over the tokens routed to it; its outputs land in the
        // (token, rank) slots, summed per token afterwards in rank order.
        let mut slots = vec![0f32; tokens * k * hidden];
        let mut members: Vec<Vec<(usize, usize)>> = vec![Vec::new(); moe.experts.len()];
        for (t, r) in routes.iter().enumerate() {
            for (rank, &(e, _)) in r.iter().enumerate() {
                members[e].push((t, rank));
            }
        }
        for (expert, who) in moe.experts.iter().zip(&members) {
            if who.is_empty() {
                continue;
            }
            let x: Vec<f32> = who
                .iter()
                .flat_map(|&(t, _)| &h[t * hidden..(t + 1) * hidden])
                .copied()
                .collect();
            let y = expert.apply(&x, who.len());
            for (j, &(t, rank)) in who.iter().enumerate() {
                slots[(t * k + rank) * hidden..][..hidden]
                    .copy_from_slice(&y[j * hidden..(j + 1) * hidden]);
            }
        }
        let mut out = match &moe.shared {
            Some(m) => m.apply(h, tokens),
            None => vec![0.0; tokens * hidden],
        };
        for (t, r) in routes.iter().enumerate() {
            let row = &mut out[t * hidden..(t + 1) * hidden];
            for (rank, &(_, w)) in r.iter().enumerate() {
                let y = &slots[(t * k + rank) * hidden..][..hidden];
                for (o, &v) in row.iter_mut().zip(y) {
                    *o += w * v;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::linalg::Linear;

    #[test]
    fn routing_takes_the_k_best_experts_with_their_softmax_scores() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 1.5, 0.0];
        let top = route(&logits, 3, false, 1.0);
        let experts: Vec<usize> = top.iter().map(|&(e, _)| e).collect();
        assert_eq!(
            experts,
            [1, 3, 4],
            "the tie between 1 and 3 goes to the lower index"
        );
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        for &(e, w) in &top {
            assert!((w - logits[e].exp() / z).abs() < 1e-6, "not renormalised");
        }
        let scaled = route(&logits, 3, false, 16.0);
        assert!((scaled[0].1 - 16.0 * top[0].1).abs() < 1e-5);
        let normed = route(&logits, 3, true, 16.0);
        let total: f32 = normed.iter().map(|&(_, w)| w).sum();
        assert!(
            (total - 1.0).abs() < 1e-6,
            "renormalised, and then not scaled"
        );
        assert_eq!(route(&logits, 1, true, 2.0)[0].1, 2.0 * top[0].1);
    }

    /// The MoE output depends on exactly the chosen experts: changing an expert no token
    /// chose changes nothing, changing a chosen one changes its tokens.
    #[test]
    fn moe_output_uses_only_the_routed_and_shared_experts() {
        let mut c = ModelConfig::tiny();
        c.num_hidden_layers = 2;
        c.hidden_size = 64;
        let mut model = Model::init(c.clone(), 11).unwrap();
        let tokens = 3;
        let h: Vec<f32> = (0..tokens * 64).map(|i| (i as f32 * 0.37).sin()).collect();
        let Ffn::Moe(moe) = &model.layers[1].ffn else {
            panic!("layer 1 is MoE")
        };
        let routes = model.routes(moe, &h, tokens);
        assert!(routes.iter().all(|r| r.len() == c.num_experts_per_tok));
        for r in &routes {
            let mut e: Vec<usize> = r.iter().map(|&(e, _)| e).collect();
            e.sort_unstable();
            e.dedup();
            assert_eq!(e.len(), c.num_experts_per_tok, "distinct experts");
        }
        let used: Vec<usize> = routes.iter().flatten().map(|&(e, _)| e).collect();
        let unused = (0..c.n_routed_experts).find(|e| !used.contains(e)).unwrap();
        let before = model.ffn(&model.layers[1], &h, tokens);
        let bump = |model: &mut Model, e: usize| {
            let Ffn::Moe(moe) = &mut model.layers[1].ffn else {
                unreachable!()
            };
            let down = &mut moe.experts[e].down;
            let doubled = down.weights().iter().map(|w| w * 2.0).collect();
            *down = Linear::new(down.out, down.inp, doubled);
        };
        bump(&mut model, unused);
        assert_eq!(model.ffn(&model.layers[1], &h, tokens), before);
        bump(&mut model, routes[0][0].0);
        let after = model.ffn(&model.layers[1], &h, tokens);
        assert_ne!(after[..64], before[..64], "token 0's first expert changed");
    }
}
