//! The whole model: embedding, the layers with attention supplied by the caller, the final
//! norm and `lm_head`, greedy choice; and prefill, which supplies the attention itself.

use crate::attention::AttnInputs;
use crate::error::{ModelError, Result, check_len};
use crate::linalg::rms_norm;
use crate::weights::Model;

/// The best token of a row of logits and its lead over the runner-up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Top2 {
    /// The argmax (the lower id on a tie).
    pub token: u32,
    /// Its logit minus the second-largest (0 on a tie; infinite for a one-token vocabulary).
    pub margin: f32,
}

/// The argmax of `logits` and its margin; an error if `logits` is empty or not finite.
pub fn top2(logits: &[f32]) -> Result<Top2> {
    crate::error::check_finite("logits", logits)?;
    let mut best: Option<(usize, f32)> = None;
    let mut second = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        match best {
            Some((_, b)) if l <= b => second = second.max(l),
            Some((_, b)) => {
                second = b;
                best = Some((i, l));
            }
            None => best = Some((i, l)),
        }
    }
    let (token, b) = best.ok_or(ModelError::Shape {
        what: "logits",
        expected: 1,
        got: 0,
    })?;
    Ok(Top2 {
        token: token as u32,
        margin: b - second,
    })
}

/// What [`Model::prefill_with_hidden`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Prefill {
    /// Per layer, every token's cache row, bf16 bits `[tokens, 576]`.
    pub kv: Vec<Vec<u16>>,
    /// The last layer's output hidden states `[tokens, hidden]` (before the final norm).
    pub hidden: Vec<f32>,
}

impl Model {
    /// Token `token`'s embedding (`[hidden]`).
    pub fn embed(&self, token: u32) -> Result<Vec<f32>> {
        let (vocab, h) = (self.config.vocab_size, self.config.hidden_size);
        let t = token as usize;
        if t >= vocab {
            return Err(ModelError::OutOfRange {
                what: "token",
                index: u64::from(token),
                bound: vocab as u64,
            });
        }
        Ok(self.embed.weights()[t * h..(t + 1) * h].to_vec())
    }

    /// The embeddings of `tokens`, `[tokens, hidden]`.
    pub fn embed_tokens(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut x = Vec::with_capacity(tokens.len() * self.config.hidden_size);
        for &t in tokens {
            x.extend_from_slice(&self.embed(t)?);
        }
        Ok(x)
    }

    /// Logits `[tokens, vocab]` of hidden states `x` (`[tokens, hidden]`, a layer stack's
    /// output): the final RMSNorm, then `lm_head`.
    pub fn logits(&self, x: &[f32]) -> Result<Vec<f32>> {
        let n = self.tokens_of("hidden states", x)?;
        let normed = rms_norm(x, &self.norm, self.config.rms_norm_eps as f32);
        Ok(self.lm_head.apply(&normed, n))
    }

    /// Each token's greedy choice from hidden states `x` (`[tokens, hidden]`).
    pub fn greedy(&self, x: &[f32]) -> Result<Vec<Top2>> {
        let vocab = self.config.vocab_size;
        self.logits(x)?.chunks_exact(vocab).map(top2).collect()
    }

    /// All layers over `tokens` at `positions`, with each layer's attention computed by
    /// `attend(layer, inputs)`, which returns the `[tokens * heads, 512]` outputs over the
    /// latents (from local kernels, [`Model::attend_causal`], or another engine holding the
    /// context's cache rows). Returns the last layer's hidden states `[tokens, hidden]`.
    pub fn forward<E, F>(
        &self,
        tokens: &[u32],
        positions: &[i64],
        mut attend: F,
    ) -> Result<Vec<f32>, E>
    where
        E: From<ModelError>,
        F: FnMut(usize, &AttnInputs) -> Result<Vec<f32>, E>,
    {
        check_len("positions", tokens.len(), positions.len())?;
        let mut x = self.embed_tokens(tokens)?;
        for layer in 0..self.layers.len() {
            let inputs = self.attention_inputs_owned(layer, x, positions)?;
            let o = attend(layer, &inputs)?;
            x = self.attention_output(layer, &inputs.residual, &o)?;
        }
        Ok(x)
    }

    /// Prefills `tokens` at `positions` as one independent causal sequence (token `t`
    /// attends the cache rows of tokens `0..=t` of this call): every layer's cache rows,
    /// `[tokens, 576]` bf16 each, what an instance holding this chunk stores.
    pub fn prefill(&self, tokens: &[u32], positions: &[i64]) -> Result<Vec<Vec<u16>>> {
        Ok(self.prefill_with_hidden(tokens, positions)?.kv)
    }

    /// [`Model::prefill`], with the last layer's hidden states.
    pub fn prefill_with_hidden(&self, tokens: &[u32], positions: &[i64]) -> Result<Prefill> {
        let mut kv = Vec::with_capacity(self.layers.len());
        let hidden = self.forward(tokens, positions, |_, inputs| {
            let o = self.attend_causal(inputs)?;
            kv.push(inputs.kv.clone());
            Ok::<_, ModelError>(o)
        })?;
        Ok(Prefill { kv, hidden })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top2_picks_the_lower_id_on_ties_and_refuses_nan() {
        assert_eq!(
            top2(&[1.0, 3.0, 2.5]).unwrap(),
            Top2 {
                token: 1,
                margin: 0.5
            }
        );
        assert_eq!(
            top2(&[3.0, 1.0, 3.0]).unwrap(),
            Top2 {
                token: 0,
                margin: 0.0
            }
        );
        assert_eq!(top2(&[-2.0]).unwrap().margin, f32::INFINITY);
        assert!(matches!(
            top2(&[1.0, f32::NAN]),
            Err(ModelError::NonFiniteInput { index: 1, .. })
        ));
        assert!(top2(&[]).is_err());
    }
}
