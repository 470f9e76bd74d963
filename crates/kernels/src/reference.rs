//! The oracle: plain loops, f64 accumulation, one rounding at the end. Slow on purpose; every
//! other implementation is tested against it.

use crate::bf16;
use crate::layout::{Cache, D_LATENT, D_QK, Queries, Selection};
use crate::partial::Partial;
use crate::splice::SpliceJob;

/// One row's partial over `tokens` (f64 throughout).
fn attend_row(
    q: &[u16],
    cache: &Cache<'_>,
    tokens: impl Iterator<Item = usize> + Clone,
    scale: f64,
) -> (Vec<f32>, f32, f32) {
    let qf: Vec<f64> = q.iter().map(|&b| f64::from(bf16::to_f32(b))).collect();
    let scores: Vec<(usize, f64)> = tokens
        .map(|t| {
            let k = cache.row(t);
            let dot: f64 = qf
                .iter()
                .zip(k)
                .map(|(&a, &b)| a * f64::from(bf16::to_f32(b)))
                .sum();
            (t, scale * dot)
        })
        .collect();
    if scores.is_empty() {
        return (vec![0.0; D_LATENT], f32::NEG_INFINITY, 0.0);
    }
    let m = scores
        .iter()
        .map(|&(_, s)| s)
        .fold(f64::NEG_INFINITY, f64::max);
    let mut l = 0f64;
    let mut acc = vec![0f64; D_LATENT];
    for &(t, s) in &scores {
        let p = (s - m).exp();
        l += p;
        for (a, &v) in acc.iter_mut().zip(&cache.row(t)[..D_LATENT]) {
            *a += p * f64::from(bf16::to_f32(v));
        }
    }
    let o = acc.iter().map(|a| (a / l) as f32).collect();
    (o, m as f32, l as f32)
}

fn collect(rows: impl Iterator<Item = (Vec<f32>, f32, f32)>, mq: usize) -> Partial {
    let mut p = Partial::empty(mq);
    for (r, (o, m, l)) in rows.enumerate() {
        p.o[r * D_LATENT..(r + 1) * D_LATENT].copy_from_slice(&o);
        p.m[r] = m;
        p.l[r] = l;
    }
    p
}

/// Every query row against every cache token.
pub(crate) fn partial_dense(q: &Queries<'_>, cache: &Cache<'_>, scale: f32) -> Partial {
    let rows =
        (0..q.len()).map(|r| attend_row(q.row(r), cache, 0..cache.tokens(), f64::from(scale)));
    collect(rows, q.len())
}

/// Every query row against its selected tokens (padding skipped, duplicates counted).
pub(crate) fn partial_sparse(
    q: &Queries<'_>,
    cache: &Cache<'_>,
    sel: &Selection<'_>,
    scale: f32,
) -> Partial {
    let rows = (0..q.len()).map(|r| {
        let picked = sel
            .of_row(r)
            .iter()
            .filter(|&&i| i >= 0)
            .map(|&i| i as usize);
        attend_row(q.row(r), cache, picked, f64::from(scale))
    });
    collect(rows, q.len())
}

/// The splice, one row at a time, rotating in f64.
pub(crate) fn splice(job: &mut SpliceJob<'_>) {
    for t in 0..job.tokens() {
        let angles = job.rope.angles(job.to[t] - job.from[t]);
        for layer in 0..job.layers {
            let mut row = [0u16; D_QK];
            row.copy_from_slice(job.src_row(layer, t)); // the pool row itself when in place
            crate::rope::rotate_row_f64(&mut row, &angles, job.rope.layout());
            job.dst_row(layer, t).copy_from_slice(&row);
        }
    }
}
