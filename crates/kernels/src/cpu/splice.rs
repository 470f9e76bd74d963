//! The CPU splice: one `(cos, sin)` table per distinct rotation (a chunk re-homed as a whole
//! has one), the rotation in f32 with an exactness guard that redoes the rare unsure value in
//! f64 with a single rounding to bf16 (bit-identical to the reference, see [`rotate_band`]),
//! written as straight-line loops over the 32 pairs that LLVM vectorises for the
//! instruction set of the wrapper ([`super::isa`]), latent dims copied (or, in place, not
//! touched), tokens in parallel.

use rayon::prelude::*;

use super::Isa;
use crate::layout::{D_LATENT, D_QK, RopeLayout};
use crate::rope::{AngleTable, PAIRS};
use crate::splice::SpliceJob;

/// Tokens per parallel task: enough rows to amortise a task, few enough to balance 2-64 cores.
const TOKENS_PER_TASK: usize = 32;

/// A destination row pointer that may cross threads: every (layer, token) has its own row, and
/// [`SpliceJob::new`] refused block tables that repeat a page, so no two writes overlap.
#[derive(Clone, Copy)]
struct Pool(*mut u16);
// SAFETY: used only to write disjoint rows (see above) while the job's `&mut` pool is held.
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

impl Pool {
    // A method, so closures capture the whole `Pool` (Send + Sync), not its raw field.
    fn base(self) -> *mut u16 {
        self.0
    }
}

/// `x` rounded once to bf16 (nearest, ties to even), branch-free so it vectorises: `x` is
/// rounded to f32 *to odd* (toward zero, then the last bit set when inexact), which keeps
/// enough information for the second rounding to f32 -> bf16 to be exact (f32 carries 16
/// more bits than bf16 at every exponent). Equal to [`crate::bf16::from_f64`] for every input.
#[inline(always)]
fn bf16_round_once(x: f64) -> u16 {
    let nearest = x as f32;
    let back = f64::from(nearest);
    let mut bits = nearest.to_bits();
    // Rounded away from zero: step the magnitude back one ulp (toward zero).
    bits -= u32::from(back.abs() > x.abs());
    bits |= u32::from(back != x);
    // A NaN stays a NaN through the steps above; `from_f32` quiets it, keeping its sign.
    crate::bf16::from_f32(f32::from_bits(bits))
}

/// The guard's bound on `|f32 result - f64 result|`, relative to `|x| + |y|` (see
/// [`rotate_band`]): 2^-21, twice the 2^-22 the error analysis gives.
const GUARD: f32 = 1.0 / (1u32 << 21) as f32;

/// Whether rounding the f32 rotation result `r` to bf16 can differ from rounding the f64 result
/// that lies within `e` of it: true when `r` is not finite, is below 2^-103 (where the f32 ulp
/// stops scaling), or when a bf16 rounding boundary (a midpoint between two bf16 values, low 16
/// bits of the f32 pattern 0x8000) may lie within `e` of `r`. The distance to the nearest
/// midpoint is at least `min(|low16 - 0x8000|, 0x4000)` f32 ulps of `r` (the cap covers the
/// binade below, whose bf16 steps are half as wide). Branch-free, so the loop vectorises.
#[inline(always)]
fn near_a_boundary(r: f32, e: f32) -> bool {
    let bits = r.to_bits();
    let exp = (bits >> 23) & 0xff;
    let low = (bits & 0xffff) as i32;
    let distance = (low - 0x8000).abs().min(0x4000) as f32;
    // The f32 ulp of `r`: 2^(exp - 150), a normal f32 for exp >= 24.
    let ulp = f32::from_bits((exp.max(24) - 23) << 23);
    // False for a NaN bound (a NaN or infinite input): unsure.
    let sure = e < distance * ulp;
    (exp < 24) | (exp == 255) | !sure
}

/// Rotates one RoPE band (64 bf16) by `t`, pairs laid out as `layout` says, bit-identical to
/// the reference's f64 rotation with its single rounding ([`crate::rope::rotate_row_f64`]).
///
/// The rotation runs in f32 first: 16 lanes where f64 has 8, and no f64 -> bf16 rounding.
/// Error analysis (x, y bf16, so exact in f32; `c32 = fl32(cos)`, `s32 = fl32(sin)`; u = 2^-24):
/// the table rounding costs at most `u (|x| + |y|)`, the two products and the sum at most
/// `u (|x c| + |y s| + |r|) <= 2u (|x| + |y|)` (|cos|, |sin| <= 1, |r| <= |x| + |y|), and the
/// reference's own f64 result is within `2^-52 (|x| + |y|)` of the exact one, so the f32 and
/// f64 results differ by less than `2^-22 (|x| + |y|)`. Whenever no bf16 rounding boundary
/// lies within [`GUARD`]` (|x| + |y|)` of the f32 result, both round to the same bf16; the
/// pairs where one might ([`near_a_boundary`]: about 1 value in 600 on typical rows, the unit
/// test measures it; every value below 2^-103) are redone in f64, as the reference does. A pair of
/// zeros is exact either way.
#[inline(always)]
fn rotate_band(band: &mut [u16], t: &AngleTable, layout: RopeLayout) {
    let (mut x, mut y) = ([0f32; PAIRS], [0f32; PAIRS]);
    match layout {
        RopeLayout::Interleaved => {
            for i in 0..PAIRS {
                (x[i], y[i]) = (
                    crate::bf16::to_f32(band[2 * i]),
                    crate::bf16::to_f32(band[2 * i + 1]),
                );
            }
        }
        RopeLayout::Half => {
            for i in 0..PAIRS {
                (x[i], y[i]) = (
                    crate::bf16::to_f32(band[i]),
                    crate::bf16::to_f32(band[PAIRS + i]),
                );
            }
        }
    }
    let mut out = [[0u16; PAIRS]; 2];
    let mut unsure = 0u32;
    for i in 0..PAIRS {
        let (a, b, e) = rotate_f32(x[i], y[i], t.cos32[i], t.sin32[i]);
        // Two zeros rotate to zeros, the same signed zeros in f32 as in f64.
        let zeros = (x[i] == 0.0) & (y[i] == 0.0);
        let u = (near_a_boundary(a, e) | near_a_boundary(b, e)) & !zeros;
        unsure |= u32::from(u) << i;
        // A NaN result is unsure, so redone below.
        out[0][i] = crate::bf16::from_f32_not_nan(a);
        out[1][i] = crate::bf16::from_f32_not_nan(b);
    }
    if unsure != 0 {
        redo_in_f64(&mut out, unsure, band, t, layout);
    }
    match layout {
        RopeLayout::Interleaved => {
            for i in 0..PAIRS {
                (band[2 * i], band[2 * i + 1]) = (out[0][i], out[1][i]);
            }
        }
        RopeLayout::Half => {
            band[..PAIRS].copy_from_slice(&out[0]);
            band[PAIRS..].copy_from_slice(&out[1]);
        }
    }
}

/// One pair rotated in f32: `(x cos - y sin, x sin + y cos)` and the guard's bound.
#[inline(always)]
fn rotate_f32(x: f32, y: f32, c: f32, s: f32) -> (f32, f32, f32) {
    (x * c - y * s, x * s + y * c, (x.abs() + y.abs()) * GUARD)
}

/// The pairs the f32 guard was unsure of (bit `i` of `unsure`), read again from the band (not
/// yet written) and computed as the reference does: two f64 products, one sum, no fused
/// multiply-add, one rounding to bf16.
#[cold]
#[inline(never)]
fn redo_in_f64(
    out: &mut [[u16; PAIRS]; 2],
    mut unsure: u32,
    band: &[u16],
    t: &AngleTable,
    layout: RopeLayout,
) {
    while unsure != 0 {
        let i = unsure.trailing_zeros() as usize;
        unsure &= unsure - 1;
        let (a, b) = layout.pair(i);
        let x = f64::from(crate::bf16::to_f32(band[a]));
        let y = f64::from(crate::bf16::to_f32(band[b]));
        out[0][i] = bf16_round_once(x * t.cos[i] - y * t.sin[i]);
        out[1][i] = bf16_round_once(x * t.sin[i] + y * t.cos[i]);
    }
}

/// How far ahead [`tokens`] asks for a row's RoPE band: rows are 1152 B apart and only 128 B
/// of each are touched in place, a stride the hardware prefetchers do not follow far enough.
const PREFETCH_ROWS: usize = 8;

/// A hint to load row `t` of `layer`'s RoPE band into cache.
#[inline(always)]
fn prefetch_band(job: &SpliceJob<'_>, pool: Pool, layer: usize, t: usize, t1: usize) {
    #[cfg(target_arch = "x86_64")]
    if t < t1 {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let band = pool.base().wrapping_add(job.dst_start(layer, t) + D_LATENT);
        // SAFETY: a prefetch is a hint; it never faults or changes memory.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(band.cast());
            _mm_prefetch::<_MM_HINT_T0>(band.wrapping_add(32).cast());
            _mm_prefetch::<_MM_HINT_T0>(band.wrapping_add(63).cast());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (job, pool, layer, t, t1);
}

/// Tokens `t0..t1` of every layer.
#[inline(always)]
fn tokens(
    job: &SpliceJob<'_>,
    pool: Pool,
    which: &[usize],
    tables: &[AngleTable],
    t0: usize,
    t1: usize,
) {
    let layout = job.rope.layout();
    let pool_len = job.pool.len();
    for layer in 0..job.layers {
        for t in t0..t1 {
            prefetch_band(job, pool, layer, t + PREFETCH_ROWS, t1);
            let start = job.dst_start(layer, t);
            assert!(start + D_QK <= pool_len, "validated by SpliceJob::new");
            // SAFETY: `start..start + 576` is inside the pool (checked above) and is this
            // (layer, token)'s own row: distinct pages per table entry, distinct slots per
            // token. In place, the row is read and written only here.
            let dst = unsafe { std::slice::from_raw_parts_mut(pool.base().add(start), D_QK) };
            if !job.is_in_place() {
                dst.copy_from_slice(job.src_row(layer, t));
            }
            rotate_band(&mut dst[D_LATENT..], &tables[which[t]], layout);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
fn tokens_avx512(
    job: &SpliceJob<'_>,
    pool: Pool,
    which: &[usize],
    tables: &[AngleTable],
    t0: usize,
    t1: usize,
) {
    tokens(job, pool, which, tables, t0, t1);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn tokens_avx2(
    job: &SpliceJob<'_>,
    pool: Pool,
    which: &[usize],
    tables: &[AngleTable],
    t0: usize,
    t1: usize,
) {
    tokens(job, pool, which, tables, t0, t1);
}

pub(crate) fn splice(job: &mut SpliceJob<'_>, isa: Isa) {
    let (which, tables) = job.angle_tables();
    let pool = Pool(job.pool.as_mut_ptr());
    let job = &*job;
    let n = job.tokens();
    (0..n.div_ceil(TOKENS_PER_TASK))
        .into_par_iter()
        .for_each(|task| {
            let (t0, t1) = (
                task * TOKENS_PER_TASK,
                ((task + 1) * TOKENS_PER_TASK).min(n),
            );
            match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa` is only used when `Isa::is_available` found its features at run time.
                Isa::Avx512Bf16 | Isa::Avx512 if isa.is_available() => unsafe {
                    tokens_avx512(job, pool, &which, &tables, t0, t1)
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Isa::Avx2 if isa.is_available() => unsafe {
                    tokens_avx2(job, pool, &which, &tables, t0, t1)
                },
                _ => tokens(job, pool, &which, &tables, t0, t1),
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::D_ROPE;
    use crate::rope::{Rope, Yarn, rotate_row_f64};
    use crate::workload::lcg;

    /// The guarded f32 rotation against the reference's f64 one, bit for bit, on bands built to
    /// find a guard that is too loose: any bf16 bit pattern (subnormals, infinities, NaN, the
    /// largest finite values), pairs that nearly cancel, signed zeros; deltas up to 160K, both
    /// layouts, plain RoPE and YaRN. With the guard's bound cut 256-fold this test finds
    /// mismatches.
    #[test]
    fn guarded_f32_rotation_is_bit_identical_to_the_f64_reference() {
        let mut rng = 7u64;
        let mut redone = 0usize;
        let mut values = 0usize;
        for layout in [RopeLayout::Interleaved, RopeLayout::Half] {
            for rope in [
                Rope::plain(10_000.0, layout).unwrap(),
                Rope::yarn(10_000.0, Yarn::DEEPSEEK, layout).unwrap(),
            ] {
                for case in 0..6_000u64 {
                    let delta = ((lcg(&mut rng) >> 16) % 320_001) as i64 - 160_000;
                    let table = rope.table(delta);
                    let mut row = vec![0u16; D_QK];
                    let band = &mut row[D_LATENT..];
                    for (i, v) in band.iter_mut().enumerate() {
                        let r = lcg(&mut rng) >> 16;
                        *v = match case % 5 {
                            // Signed zeros (and the odd tiny value).
                            4 => (r as u16) & if r.is_multiple_of(7) { 0x8001 } else { 0x8000 },
                            // Any bit pattern.
                            0 => r as u16,
                            // Typical magnitudes, either sign.
                            1 => crate::bf16::from_f32(((r % 20_001) as f32 - 10_000.0) / 997.0),
                            // A narrow band of exponents: many equal-magnitude pairs.
                            2 => ((r as u16) & 0x807f) | 0x3f80,
                            // The second of each pair nearly cancels the first after rotation.
                            _ => {
                                let x = ((r % 2001) as f32 - 1000.0) / 61.0;
                                if i % 2 == 0 {
                                    crate::bf16::from_f32(x)
                                } else {
                                    (r as u16) ^ 0x0001
                                }
                            }
                        };
                    }
                    let mut want = row.clone();
                    let angles = rope.angles(delta);
                    rotate_row_f64(&mut want, &angles, layout);
                    let mut got = row.clone();
                    rotate_band(&mut got[D_LATENT..], &table, layout);
                    for i in 0..D_ROPE {
                        let (w, g) = (want[D_LATENT + i], got[D_LATENT + i]);
                        let both_nan =
                            crate::bf16::to_f32(w).is_nan() && crate::bf16::to_f32(g).is_nan();
                        assert!(
                            w == g || both_nan,
                            "delta {delta}, case {case}, dim {i}: {w:#06x} != {g:#06x}"
                        );
                    }
                    for i in 0..PAIRS {
                        let (a, b) = layout.pair(i);
                        let (x, y) = (
                            crate::bf16::to_f32(row[D_LATENT + a]),
                            crate::bf16::to_f32(row[D_LATENT + b]),
                        );
                        // The rate is asked of typical values only (cases 1 and 2).
                        if !matches!(case % 5, 1 | 2) {
                            continue;
                        }
                        let (a, b, e) = rotate_f32(x, y, table.cos32[i], table.sin32[i]);
                        redone +=
                            usize::from(near_a_boundary(a, e)) + usize::from(near_a_boundary(b, e));
                        values += 2;
                    }
                }
            }
        }
        // The guard must leave the fast path the common case (else the f32 path buys nothing).
        assert!(
            redone * 100 < values,
            "{redone} of {values} values redone in f64"
        );
    }

    #[test]
    fn rounding_to_odd_then_to_bf16_is_the_single_rounding() {
        // Ties, near-ties, subnormals, overflow, signed zeros, and a random sweep.
        let mut cases = vec![
            0.0,
            -0.0,
            1.0 + 2f64.powi(-8),
            1.0 + 2f64.powi(-8) + 2f64.powi(-40),
            1.0 + 2f64.powi(-8) - 2f64.powi(-40),
            -(1.0 + 3.0 * 2f64.powi(-8)),
            1e-45,
            -3e-39,
            f64::from(f32::MAX) * 1.5,
            -f64::from(f32::MAX),
            f64::INFINITY,
            f64::NEG_INFINITY,
            1e-320,
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..200_000 {
            let z = lcg(&mut state);
            let mantissa = (z >> 11) as f64 / (1u64 << 53) as f64;
            let exp = ((z >> 3) % 300) as i32 - 150;
            cases.push((mantissa - 0.5) * 2f64.powi(exp));
        }
        for x in cases {
            assert_eq!(bf16_round_once(x), crate::bf16::from_f64(x), "{x:e}");
        }
        assert!(crate::bf16::to_f32(bf16_round_once(f64::NAN)).is_nan());
    }
}
