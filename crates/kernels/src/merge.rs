//! The exact merge of partials (online softmax across instances; paper 000 section 3.3).
//!
//! For a row with parts `(o_i, m_i, l_i)`: `M = max m_i` over the non-empty parts,
//! `w_i = l_i exp(m_i - M)`, `l = sum w_i`, `o = sum w_i o_i / l`, `m = M`. Empty parts
//! (`l = 0`, `m = -inf`) are skipped, so `-inf - -inf` is never evaluated and an empty part is
//! the identity. Sums run in f64 and round once, so the result depends on the parts' order only
//! through that final rounding (in practice not at all).

use crate::error::KernelError;
use crate::layout::D_LATENT;
use crate::partial::Partial;

/// Merges `parts` (all with the same number of rows) into one. Every part is validated first
/// (they may come from peers); nothing is merged if one is malformed.
pub fn merge(parts: &[&Partial]) -> Result<Partial, KernelError> {
    let Some(first) = parts.first() else {
        return Err(KernelError::Empty("partials to merge"));
    };
    let mq = first.rows();
    for (index, p) in parts.iter().enumerate() {
        if p.rows() != mq {
            return Err(KernelError::RowMismatch {
                index,
                expected: mq,
                got: p.rows(),
            });
        }
        p.validate()?;
    }
    let mut out = Partial::empty(mq);
    let mut acc = [0f64; D_LATENT];
    for r in 0..mq {
        let big_m = parts
            .iter()
            .filter(|p| p.l[r] > 0.0)
            .map(|p| p.m[r])
            .fold(f32::NEG_INFINITY, f32::max);
        if big_m == f32::NEG_INFINITY {
            continue; // every part empty: the row stays empty
        }
        acc.fill(0.0);
        let mut l = 0f64;
        for p in parts.iter().filter(|p| p.l[r] > 0.0) {
            let w = f64::from(p.l[r]) * (f64::from(p.m[r]) - f64::from(big_m)).exp();
            l += w;
            for (a, &o) in acc.iter_mut().zip(p.o_row(r)) {
                *a += w * f64::from(o);
            }
        }
        for (dst, a) in out.o[r * D_LATENT..(r + 1) * D_LATENT].iter_mut().zip(&acc) {
            *dst = (a / l) as f32;
        }
        out.m[r] = big_m;
        out.l[r] = l as f32;
    }
    Ok(out)
}
