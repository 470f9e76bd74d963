//! The exact merge of partials (online softmax across instances; paper 000 section 3.3).
//!
//! For a row with parts `(o_i, m_i, l_i)`: `M = max m_i` over the non-empty parts,
//! `w_i = l_i exp(m_i - M)`, `l = sum w_i`, `o = sum w_i o_i / l`, `m = M`. Empty parts
//! (`l = 0`, `m = -inf`) are skipped, so `-inf - -inf` is never evaluated and an empty part is
//! the identity. Sums run in f64 and are rounded to f32 once at the end, so the result depends
//! on the parts' order only through f64 round-off (in practice not at all).

use crate::cpu::vectorised;
use crate::error::KernelError;
use crate::layout::D_LATENT;
use crate::partial::{Partial, WirePartial};

/// Merges `parts` (all with the same number of rows) into one. Every part is validated first
/// (they may come from peers); nothing is merged if one is malformed.
pub fn merge(parts: &[&Partial]) -> Result<Partial, KernelError> {
    let mq = check_parts_but_o(parts)?;
    let mut out = Partial::empty(mq);
    let non_finite = vectorised(
        #[inline(always)]
        || merge_rows(parts, &mut out),
    );
    match non_finite {
        Some(row) => Err(KernelError::InvalidPartial {
            row,
            why: "o must be finite",
        }),
        None => Ok(out),
    }
}

/// [`merge`]'s rows (the same code on every instruction set: the f64 sums vectorise); the
/// first row whose merged `o` is not finite, if any. The parts' `o` values are checked
/// here, on the merged row, instead of in a pass of their own over every part before: a
/// merged value is a convex combination of the contributing parts' values, so it is finite
/// exactly when theirs are (an infinity or NaN in a contributing part makes the sum NaN or
/// infinite whatever its weight, even a weight that underflowed to 0). Parts that do not
/// contribute (`l = 0`) were checked to hold zeros.
#[inline(always)]
fn merge_rows(parts: &[&Partial], out: &mut Partial) -> Option<usize> {
    for r in 0..out.rows() {
        // `o` is normalised, so a part's values weigh `l` times its share.
        let rows = parts.iter().map(|p| (p.m[r], p.l[r], p.o_row(r), p.l[r]));
        let o = &mut out.o[r * D_LATENT..(r + 1) * D_LATENT];
        let (m, l) = combine_row(rows, o);
        if !crate::partial::all_finite_in(o) {
            return Some(r);
        }
        out.m[r] = m;
        out.l[r] = l;
    }
    None
}

/// [`merge`] of partials in their wire encoding, read where they landed (a requester's reply
/// region), into `out` (resized to their rows, its allocations reused): the reply's bf16 rows
/// are read once, by the merge, instead of being decoded to f32 first. One part is an exact
/// decode (its weight is exactly 1). Weights `l_i exp(m_i - M) / l` are computed in f64 and
/// the 512 values summed in f32: the inputs carry bf16 rounding (2^-9 relative), which f32
/// sums of at most a few hundred parts do not approach.
///
/// A non-finite `o` value in a part that contributes (or rows that differ in number) is an
/// error; then `out` holds empty rows (the identity), never a half-merged result.
pub fn merge_wire(parts: &[WirePartial<'_>], out: &mut Partial) -> Result<(), KernelError> {
    let mq = same_rows(parts.iter().map(WirePartial::rows))?;
    out.o.resize(mq * D_LATENT, 0.0);
    out.m.resize(mq, f32::NEG_INFINITY);
    out.l.resize(mq, 0.0);
    let merged = vectorised(
        #[inline(always)]
        || merge_wire_rows(parts, out),
    );
    if merged.is_err() {
        out.o.fill(0.0);
        out.m.fill(f32::NEG_INFINITY);
        out.l.fill(0.0);
    }
    merged
}

#[inline(always)]
fn merge_wire_rows(parts: &[WirePartial<'_>], out: &mut Partial) -> Result<(), KernelError> {
    // Per row: each live part and its weight `l_i exp(m_i - M)` (computed once).
    let mut live: Vec<(&WirePartial<'_>, f64)> = Vec::with_capacity(parts.len());
    for (r, o) in out.o.chunks_exact_mut(D_LATENT).enumerate() {
        live.clear();
        live.extend(parts.iter().filter(|p| p.l(r) > 0.0).map(|p| (p, 0.0)));
        let big_m = live
            .iter()
            .map(|(p, _)| p.m(r))
            .fold(f32::NEG_INFINITY, f32::max);
        if big_m == f32::NEG_INFINITY {
            o.fill(0.0);
            (out.m[r], out.l[r]) = (f32::NEG_INFINITY, 0.0);
            continue;
        }
        let mut l = 0f64;
        for (p, w) in &mut live {
            // `exp(0)` is exactly 1: the part that holds the maximum (every part, when there
            // is one) skips the call.
            let d = f64::from(p.m(r)) - f64::from(big_m);
            *w = f64::from(p.l(r)) * if d == 0.0 { 1.0 } else { d.exp() };
            l += *w;
        }
        let mut worst = 0u16;
        for (i, &(p, w)) in live.iter().enumerate() {
            let w = (w / l) as f32;
            let src = &p.row(r)[..D_LATENT * 2];
            if i == 0 {
                for (x, b) in o.iter_mut().zip(src.chunks_exact(2)) {
                    let bits = u16::from_le_bytes([b[0], b[1]]);
                    worst = worst.max(bits & 0x7fff);
                    *x = w * crate::bf16::to_f32(bits);
                }
            } else {
                for (x, b) in o.iter_mut().zip(src.chunks_exact(2)) {
                    let bits = u16::from_le_bytes([b[0], b[1]]);
                    worst = worst.max(bits & 0x7fff);
                    *x += w * crate::bf16::to_f32(bits);
                }
            }
        }
        if worst >= 0x7f80 {
            return Err(KernelError::InvalidPartial {
                row: r,
                why: "o must be finite",
            });
        }
        (out.m[r], out.l[r]) = (big_m, l as f32);
    }
    Ok(())
}

/// One row of the combine, shared by [`merge`] and the CPU path's split-K states: each part
/// is `(m, l, values, value_weight)`, contributing `exp(m - M) * l` to the denominator and
/// `exp(m - M) * value_weight * values` to the numerator (`value_weight` is `l` for a
/// normalised `o`, 1 for a raw accumulator). Empty parts (`l = 0`) are skipped; if all are
/// empty, `o` is left alone and `(-inf, 0)` returned. Sums in f64, rounded to f32 at the end.
/// Checks `parts` can be merged (at least one, equal rows, each valid); returns their rows.
pub(crate) fn check_parts(parts: &[&Partial]) -> Result<usize, KernelError> {
    let mq = same_rows(parts.iter().map(|p| p.rows()))?;
    for p in parts {
        p.validate()?;
    }
    Ok(mq)
}

/// [`check_parts`] but for the finiteness of `o`, which [`merge`] checks on the merged rows.
fn check_parts_but_o(parts: &[&Partial]) -> Result<usize, KernelError> {
    let mq = same_rows(parts.iter().map(|p| p.rows()))?;
    for p in parts {
        p.validate_rows(false)?;
    }
    Ok(mq)
}

/// The parts' common number of rows: at least one part, all with as many rows as the first.
fn same_rows(rows: impl Iterator<Item = usize>) -> Result<usize, KernelError> {
    let mut rows = rows.enumerate();
    let (_, mq) = rows.next().ok_or(KernelError::Empty("partials to merge"))?;
    match rows.find(|&(_, n)| n != mq) {
        Some((index, got)) => Err(KernelError::RowMismatch {
            index,
            expected: mq,
            got,
        }),
        None => Ok(mq),
    }
}

/// One row of [`merge`]'s formula for outputs of any width up to 512 (MLA's; narrower heads,
/// such as GQA's, use the same statistic): `parts` are `(m, l, o_row)` with `o_row`
/// normalised; writes the merged row into `o` and returns its `(m, l)`. Parts with `l = 0`
/// are skipped; with none left the row is `(-inf, 0)` and `o` is untouched. The caller
/// validates the parts ([`Partial::validate`]'s rules) and checks `o` is finite after.
pub fn merge_row<'a>(
    parts: impl Iterator<Item = (f32, f32, &'a [f32])> + Clone,
    o: &mut [f32],
) -> Result<(f32, f32), KernelError> {
    if o.len() > D_LATENT || parts.clone().any(|(_, _, v)| v.len() != o.len()) {
        return Err(KernelError::Parameter {
            what: "merged row width",
            value: o.len() as f64,
            why: "at most 512, and every part's row as wide as the output",
        });
    }
    Ok(combine_row(parts.map(|(m, l, v)| (m, l, v, l)), o))
}

#[inline(always)]
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
    // One f64 reciprocal instead of 512 divisions (a division per value cost this loop as
    // much as all the sums). `a * (1 / l)` is within 2^-52 relative of `a / l`, so its f32
    // rounding is the same except for values that close to an f32 rounding boundary (about
    // 1 in 2^27), which move by 1 ulp.
    let inv = 1.0 / l;
    for (dst, a) in o.iter_mut().zip(&acc) {
        *dst = (a * inv) as f32;
    }
    (big_m, l as f32)
}
