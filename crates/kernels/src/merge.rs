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
    let mq = check_parts(parts)?;
    let mut out = Partial::empty(mq);
    for r in 0..mq {
        // `o` is normalised, so a part's values weigh `l` times its share.
        let rows = parts.iter().map(|p| (p.m[r], p.l[r], p.o_row(r), p.l[r]));
        let (m, l) = combine_row(rows, &mut out.o[r * D_LATENT..(r + 1) * D_LATENT]);
        out.m[r] = m;
        out.l[r] = l;
    }
    Ok(out)
}

/// One row of the combine, shared by [`merge`] and the CPU path's split-K states: each part
/// is `(m, l, values, value_weight)`, contributing `exp(m - M) * l` to the denominator and
/// `exp(m - M) * value_weight * values` to the numerator (`value_weight` is `l` for a
/// normalised `o`, 1 for a raw accumulator). Empty parts (`l = 0`) are skipped; if all are
/// empty, `o` is left alone and `(-inf, 0)` returned. Sums in f64, one rounding.
/// Checks `parts` can be merged (at least one, equal rows, each valid); returns their rows.
pub(crate) fn check_parts(parts: &[&Partial]) -> Result<usize, KernelError> {
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
    Ok(mq)
}

pub(crate) fn combine_row<'a>(
    parts: impl Iterator<Item = (f32, f32, &'a [f32], f32)> + Clone,
    o: &mut [f32],
) -> (f32, f32) {
    let live = parts.filter(|&(_, l, _, _)| l > 0.0);
    let big_m = live
        .clone()
        .map(|(m, ..)| m)
        .fold(f32::NEG_INFINITY, f32::max);
    if big_m == f32::NEG_INFINITY {
        return (f32::NEG_INFINITY, 0.0);
    }
    let mut acc = [0f64; D_LATENT];
    let mut l = 0f64;
    for (m, part_l, values, value_weight) in live {
        let w = (f64::from(m) - f64::from(big_m)).exp();
        l += w * f64::from(part_l);
        let w = w * f64::from(value_weight);
        for (a, &x) in acc.iter_mut().zip(values) {
            *a += w * f64::from(x);
        }
    }
    for (dst, a) in o.iter_mut().zip(&acc) {
        *dst = (a / l) as f32;
    }
    (big_m, l as f32)
}
