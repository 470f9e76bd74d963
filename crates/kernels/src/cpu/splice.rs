//! The CPU splice: one `(cos, sin)` table per distinct rotation (a chunk re-homed as a whole
//! has one), the rotation in f64 with a single rounding to bf16 (bit-identical to the
//! reference) written as straight-line loops over the 32 pairs that LLVM vectorises for the
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
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    if x.is_nan() {
        ((nearest.to_bits() >> 16) as u16) | 0x0040
    } else {
        rounded
    }
}

/// Rotates one RoPE band (64 bf16) by `t`, pairs laid out as `layout` says.
#[inline(always)]
fn rotate_band(band: &mut [u16], t: &AngleTable, layout: RopeLayout) {
    let (mut x, mut y) = ([0f64; PAIRS], [0f64; PAIRS]);
    let widen = |b: u16| f64::from(crate::bf16::to_f32(b));
    match layout {
        RopeLayout::Interleaved => {
            for i in 0..PAIRS {
                (x[i], y[i]) = (widen(band[2 * i]), widen(band[2 * i + 1]));
            }
        }
        RopeLayout::Half => {
            for i in 0..PAIRS {
                (x[i], y[i]) = (widen(band[i]), widen(band[PAIRS + i]));
            }
        }
    }
    let mut out = [[0u16; PAIRS]; 2];
    for i in 0..PAIRS {
        // The reference's operations in its order: two products, one sum, no fused multiply-add.
        out[0][i] = bf16_round_once(x[i] * t.cos[i] - y[i] * t.sin[i]);
        out[1][i] = bf16_round_once(x[i] * t.sin[i] + y[i] * t.cos[i]);
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
        let mut z = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..200_000 {
            z = z
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
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
