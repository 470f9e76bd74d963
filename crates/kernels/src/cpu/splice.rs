//! The CPU splice: one `(cos, sin)` table per distinct rotation (a chunk re-homed as a whole
//! has one), the rotation in f32 with an exactness guard that redoes the rare unsure value in
//! f64 with a single rounding to bf16 (bit-identical to the reference, see [`rotate_band`]):
//! in intrinsics for AVX-512 and for AVX2 ([`rotate_band_avx512`], [`rotate_band_avx2`]),
//! elsewhere as straight-line loops over the 32 pairs that LLVM vectorises; latent dims copied
//! (or, in place, not touched), tokens in parallel.

use rayon::prelude::*;

use super::Isa;
use crate::layout::{D_LATENT, D_QK, D_ROPE, RopeLayout};
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
/// Below this `|x| + |y|` (and above zero) a pair is always redone: underflow in the products
/// adds an absolute error the relative bound does not cover (2^-100: the guard's interval,
/// at least 2^-122 wide, dwarfs the 2^-149 steps of f32 subnormals).
const TINY: f32 = 1.0 / (1u128 << 100) as f32;

/// Whether the pair `(x, y)` must be redone in f64 whatever its result, given `s = |x| + |y|`:
/// below [`TINY`] (but two zeros are exact in f32 as in f64, the same signed zeros), and for
/// an infinity or a NaN. A finite pair whose f32 result overflows needs no exception: that
/// takes an exact sum of at least 2^128 (1 - 2^-25), which leaves the f64 result far above
/// the largest value bf16 rounds down from (2^128 (1 - 2^-9)): both round to the same infinity.
#[inline(always)]
fn unsure_pair(s: f32) -> bool {
    // A NaN fails every comparison: unsure.
    !((TINY..f32::INFINITY).contains(&s) | (s == 0.0))
}

/// Whether a bf16 rounding boundary (the midpoint of two adjacent bf16 values: an f32 whose
/// low 16 bits are 0x8000) lies in `[|r| - e, |r| + e]`, the interval holding the f64 result,
/// evaluated in f32: when none does, `r` rounds to bf16 as the f64 result does. Rounding the
/// ends in f32 pulls them inward by half an ulp at most, less than the slack between
/// [`GUARD`] and the proven bound (for `|x| + |y| >= 2^-100`, see [`TINY`]), and positive f32
/// bit patterns are ordered as their values, so the count of midpoints up to a
/// pattern `b` is `(b + 0x8000) >> 16`; an interval reaching below zero (a negative lower end
/// has the sign bit set) is unsure. Branch-free, so the loop vectorises.
#[inline(always)]
fn near_a_boundary(r: f32, e: f32) -> bool {
    let m = r.abs();
    let (lo, hi) = ((m - e).to_bits(), (m + e).to_bits());
    // `lo` is at most 0xff7f_ffff (a finite negative), so neither sum wraps.
    (hi + 0x8000) >> 16 != (lo + 0x7fff) >> 16
}

/// Rotates one RoPE band (64 bf16) by `t`, pairs laid out as `layout` says, bit-identical to
/// the reference's f64 rotation with its single rounding ([`crate::rope::rotate_row_f64`]).
///
/// The rotation runs in f32 first: 16 lanes where f64 has 8, and no f64 -> bf16 rounding.
/// Error analysis (x, y bf16, so exact in f32; `c32 = fl32(cos)`, `s32 = fl32(sin)`; u = 2^-24):
/// the table rounding costs at most `u (|x| + |y|)`, the two products and the sum at most
/// `u (|x c| + |y s| + |r|) <= 2u (|x| + |y|)` (|cos|, |sin| <= 1, |r| <= |x| + |y|; a fused
/// multiply-add, as the AVX-512 path uses, rounds once less), and the reference's own f64
/// result is within `2^-52 (|x| + |y|)` of the exact one, so the f32 and f64 results differ by
/// less than `2^-22 (|x| + |y|)`. Whenever no bf16 rounding boundary lies within
/// [`GUARD`]` (|x| + |y|)` of the f32 result ([`near_a_boundary`]), both round to the same
/// bf16; the values where one might (about 1 in 650 on typical rows, the unit test measures
/// it) and the pairs [`unsure_pair`] names are redone in f64, as the reference does.
#[inline(always)]
fn rotate_band(band: &mut [u16], t: &AngleTable, layout: RopeLayout) {
    // The layout is matched outside the loops so that each one vectorises.
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
        let (a, b, e, pair) = rotate_f32(x[i], y[i], t.cos32[i], t.sin32[i]);
        let u = pair | near_a_boundary(a, e) | near_a_boundary(b, e);
        unsure |= u32::from(u) << i;
        // A NaN result comes from an unsure pair, so is redone below.
        out[0][i] = crate::bf16::from_f32_not_nan(a);
        out[1][i] = crate::bf16::from_f32_not_nan(b);
    }
    let mut new = [0u16; D_ROPE];
    match layout {
        RopeLayout::Interleaved => {
            for i in 0..PAIRS {
                (new[2 * i], new[2 * i + 1]) = (out[0][i], out[1][i]);
            }
        }
        RopeLayout::Half => {
            new[..PAIRS].copy_from_slice(&out[0]);
            new[PAIRS..].copy_from_slice(&out[1]);
        }
    }
    if unsure != 0 {
        redo_in_f64(&mut new, unsure, band, t, layout);
    }
    band.copy_from_slice(&new);
}

/// One pair rotated in f32: `(x cos - y sin, x sin + y cos)`, the guard's bound, and whether
/// the pair is unsure whatever its result ([`unsure_pair`]).
#[inline(always)]
fn rotate_f32(x: f32, y: f32, c: f32, s: f32) -> (f32, f32, f32, bool) {
    let sum = x.abs() + y.abs();
    (x * c - y * s, x * s + y * c, sum * GUARD, unsure_pair(sum))
}

/// The pairs the f32 guard was unsure of (bit `i` of `unsure`), read again from `band` (the
/// rotation's input) and computed as the reference does: two f64 products, one sum, no fused
/// multiply-add, one rounding to bf16; written into `new` (the rotated band) in place of the
/// f32 results.
#[cold]
#[inline(never)]
fn redo_in_f64(
    new: &mut [u16; D_ROPE],
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
        new[a] = bf16_round_once(x * t.cos[i] - y * t.sin[i]);
        new[b] = bf16_round_once(x * t.sin[i] + y * t.cos[i]);
    }
}

/// [`rotate_band`] written out for AVX-512: the same guard and the same results, bit for bit,
/// with the pairs' unsure flags kept in mask registers (the portable loop's bit mask costs a
/// horizontal reduction per band) and no shuffles. A 64-byte load holds 32 bf16 as 16 u32:
/// `w << 16` is the low halves as f32, `w & 0xffff_0000` the high halves. Interleaved, word
/// `k` holds pairs `16k..16k + 16` (x low, y high); half-split, word 0 holds the x and word 1
/// the y of the even pairs (low halves) and of the odd pairs (high halves), so the angle
/// tables are split into even and odd lanes to match.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma")]
#[inline]
fn rotate_band_avx512(band: &mut [u16], t: &AngleTable, layout: RopeLayout) {
    use std::arch::x86_64::*;
    assert_eq!(band.len(), D_ROPE);
    // SAFETY: loads and stores stay inside `band` (64 u16 = two 64-byte vectors, checked
    // above) and the 32-entry tables; the closures inherit this function's features.
    unsafe {
        let p = band.as_mut_ptr().cast::<__m512i>();
        let (w0, w1) = (_mm512_loadu_si512(p), _mm512_loadu_si512(p.add(1)));
        let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
        let lo = |w: __m512i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
        let hi = |w: __m512i| _mm512_castsi512_ps(_mm512_and_si512(w, high));
        let table = |v: &[f32; PAIRS]| {
            let (a, b) = (
                _mm512_loadu_ps(v.as_ptr()),
                _mm512_loadu_ps(v.as_ptr().add(16)),
            );
            match layout {
                RopeLayout::Interleaved => (a, b),
                RopeLayout::Half => {
                    let even =
                        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
                    let odd =
                        _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
                    (
                        _mm512_permutex2var_ps(a, even, b),
                        _mm512_permutex2var_ps(a, odd, b),
                    )
                }
            }
        };
        let ((c0, c1), (s0, s1)) = (table(&t.cos32), table(&t.sin32));
        let (x0, y0, x1, y1) = match layout {
            RopeLayout::Interleaved => (lo(w0), hi(w0), lo(w1), hi(w1)),
            RopeLayout::Half => (lo(w0), lo(w1), hi(w0), hi(w1)),
        };
        let near = |r: __m512, e: __m512| {
            let m = _mm512_abs_ps(r);
            let up = _mm512_castps_si512(_mm512_add_ps(m, e));
            let down = _mm512_castps_si512(_mm512_sub_ps(m, e));
            let up = _mm512_add_epi32(up, _mm512_set1_epi32(0x8000));
            let down = _mm512_add_epi32(down, _mm512_set1_epi32(0x7fff));
            // Different counts of midpoints: the high 16 bits differ.
            _mm512_cmpge_epu32_mask(_mm512_xor_si512(up, down), _mm512_set1_epi32(0x1_0000))
        };
        let rotate = |x: __m512, y: __m512, c: __m512, s: __m512| {
            let a = _mm512_fmsub_ps(x, c, _mm512_mul_ps(y, s));
            let b = _mm512_fmadd_ps(x, s, _mm512_mul_ps(y, c));
            let sum = _mm512_add_ps(_mm512_abs_ps(x), _mm512_abs_ps(y));
            let e = _mm512_mul_ps(sum, _mm512_set1_ps(GUARD));
            // `unsure_pair`: below TINY but not zero, or not finite (NaN fails every ordered compare).
            let fine = _mm512_mask_cmp_ps_mask::<_CMP_LT_OQ>(
                _mm512_cmp_ps_mask::<_CMP_GE_OQ>(sum, _mm512_set1_ps(TINY)),
                sum,
                _mm512_set1_ps(f32::INFINITY),
            ) | _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(sum, _mm512_setzero_ps());
            let unsure = !fine | near(a, e) | near(b, e);
            (a, b, unsure)
        };
        let (a0, b0, u0) = rotate(x0, y0, c0, s0);
        let (a1, b1, u1) = rotate(x1, y1, c1, s1);
        // Round to nearest even: bits + 0x7fff + (bit 16), then the high 16 bits.
        let round = |r: __m512| {
            let b = _mm512_castps_si512(r);
            let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
            _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd)
        };
        // Low half from `l`, high half from `h`: `(l >> 16) | (h & 0xffff_0000)`.
        let pack = |l: __m512, h: __m512| {
            _mm512_ternarylogic_epi32::<0xf8>(_mm512_srli_epi32::<16>(round(l)), round(h), high)
        };
        let (n0, n1) = match layout {
            RopeLayout::Interleaved => (pack(a0, b0), pack(a1, b1)),
            RopeLayout::Half => (pack(a0, a1), pack(b0, b1)),
        };
        if u0 | u1 != 0 {
            let mut new = [0u16; D_ROPE];
            let q = new.as_mut_ptr().cast::<__m512i>();
            _mm512_storeu_si512(q, n0);
            _mm512_storeu_si512(q.add(1), n1);
            let unsure = match layout {
                RopeLayout::Interleaved => u32::from(u0) | u32::from(u1) << 16,
                RopeLayout::Half => (0..16).fold(0, |acc, j| {
                    acc | u32::from(u0 >> j & 1) << (2 * j) | u32::from(u1 >> j & 1) << (2 * j + 1)
                }),
            };
            redo_in_f64(&mut new, unsure, band, t, layout);
            band.copy_from_slice(&new);
        } else {
            _mm512_storeu_si512(p, n0);
            _mm512_storeu_si512(p.add(1), n1);
        }
    }
}

/// [`rotate_band`] written out for AVX2 and FMA: [`rotate_band_avx512`]'s method on 256-bit
/// words, the same guard and the same results, bit for bit. A band is four 32-byte words of
/// 8 u32, each two bf16: `w << 16` is the low halves as f32, `w & 0xffff_0000` the high halves.
/// Interleaved, word `k` holds pairs `8k..8k + 8` (x low, y high). Half-split, words 0-1 hold
/// the x and 2-3 the y; the low halves of words 0 and 2 are the even pairs of `0..16`, their
/// high halves the odd ones, and words 1 and 3 the same for `16..32`, so the angle tables are
/// split into even and odd lanes to match. Each group's unsure flags come out of a
/// `movemask`, eight pairs at a time (the portable loop builds its mask bit by bit, which LLVM
/// does not vectorise).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn rotate_band_avx2(band: &mut [u16], t: &AngleTable, layout: RopeLayout) {
    use std::arch::x86_64::*;
    assert_eq!(band.len(), D_ROPE);
    // SAFETY: loads and stores stay inside `band` (64 u16 = four 32-byte words, checked
    // above) and the 32-entry tables; the closures inherit this function's features.
    unsafe {
        let p = band.as_mut_ptr().cast::<__m256i>();
        let w = [
            _mm256_loadu_si256(p),
            _mm256_loadu_si256(p.add(1)),
            _mm256_loadu_si256(p.add(2)),
            _mm256_loadu_si256(p.add(3)),
        ];
        let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
        let lo = |w: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w));
        let hi = |w: __m256i| _mm256_castsi256_ps(_mm256_and_si256(w, high));
        // A table's four groups of eight lanes, in the order the groups below take them.
        let table = |v: &[f32; PAIRS]| {
            let q = |k: usize| _mm256_loadu_ps(v.as_ptr().add(8 * k));
            match layout {
                RopeLayout::Interleaved => [q(0), q(1), q(2), q(3)],
                RopeLayout::Half => {
                    // Each 8-lane run to (evens, odds) within its 128-bit halves, then the
                    // halves of two runs paired: evens of 16 pairs, odds of 16 pairs.
                    let split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
                    let s = |k: usize| _mm256_permutevar8x32_ps(q(k), split);
                    let (a, b, c, d) = (s(0), s(1), s(2), s(3));
                    [
                        _mm256_permute2f128_ps::<0x20>(a, b),
                        _mm256_permute2f128_ps::<0x31>(a, b),
                        _mm256_permute2f128_ps::<0x20>(c, d),
                        _mm256_permute2f128_ps::<0x31>(c, d),
                    ]
                }
            }
        };
        let (c, s) = (table(&t.cos32), table(&t.sin32));
        // (x, y) of each group of eight pairs.
        let groups = match layout {
            RopeLayout::Interleaved => [
                (lo(w[0]), hi(w[0])),
                (lo(w[1]), hi(w[1])),
                (lo(w[2]), hi(w[2])),
                (lo(w[3]), hi(w[3])),
            ],
            RopeLayout::Half => [
                (lo(w[0]), lo(w[2])),
                (hi(w[0]), hi(w[2])),
                (lo(w[1]), lo(w[3])),
                (hi(w[1]), hi(w[3])),
            ],
        };
        let sign = _mm256_set1_ps(-0.0);
        let abs = |x: __m256| _mm256_andnot_ps(sign, x);
        // All ones where a bf16 midpoint lies in `[|r| - e, |r| + e]` ([`near_a_boundary`]).
        let near = |r: __m256, e: __m256| {
            let m = abs(r);
            let up = _mm256_castps_si256(_mm256_add_ps(m, e));
            let down = _mm256_castps_si256(_mm256_sub_ps(m, e));
            let up = _mm256_add_epi32(up, _mm256_set1_epi32(0x8000));
            let down = _mm256_add_epi32(down, _mm256_set1_epi32(0x7fff));
            // Different counts of midpoints: the high 16 bits differ.
            let same = _mm256_cmpeq_epi32(
                _mm256_srli_epi32::<16>(_mm256_xor_si256(up, down)),
                _mm256_setzero_si256(),
            );
            _mm256_andnot_ps(_mm256_castsi256_ps(same), _mm256_castsi256_ps(high))
        };
        let mut out = [(_mm256_setzero_ps(), _mm256_setzero_ps()); 4];
        let mut unsure = [0u32; 4];
        for (k, &(x, y)) in groups.iter().enumerate() {
            let a = _mm256_fmsub_ps(x, c[k], _mm256_mul_ps(y, s[k]));
            let b = _mm256_fmadd_ps(x, s[k], _mm256_mul_ps(y, c[k]));
            let sum = _mm256_add_ps(abs(x), abs(y));
            let e = _mm256_mul_ps(sum, _mm256_set1_ps(GUARD));
            // `unsure_pair`: below TINY but not zero, or not finite (NaN fails every ordered
            // compare).
            let fine = _mm256_or_ps(
                _mm256_and_ps(
                    _mm256_cmp_ps::<_CMP_GE_OQ>(sum, _mm256_set1_ps(TINY)),
                    _mm256_cmp_ps::<_CMP_LT_OQ>(sum, _mm256_set1_ps(f32::INFINITY)),
                ),
                _mm256_cmp_ps::<_CMP_EQ_OQ>(sum, _mm256_setzero_ps()),
            );
            let flags = _mm256_or_ps(
                _mm256_andnot_ps(fine, sign),
                _mm256_or_ps(near(a, e), near(b, e)),
            );
            unsure[k] = _mm256_movemask_ps(flags) as u32;
            out[k] = (a, b);
        }
        // Round to nearest even: bits + 0x7fff + (bit 16), then the high 16 bits.
        let round = |r: __m256| {
            let b = _mm256_castps_si256(r);
            let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
            _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), odd)
        };
        // Low half from `l`, high half from `h`.
        let pack = |l: __m256, h: __m256| {
            _mm256_or_si256(
                _mm256_srli_epi32::<16>(round(l)),
                _mm256_and_si256(round(h), high),
            )
        };
        let n = match layout {
            RopeLayout::Interleaved => [
                pack(out[0].0, out[0].1),
                pack(out[1].0, out[1].1),
                pack(out[2].0, out[2].1),
                pack(out[3].0, out[3].1),
            ],
            RopeLayout::Half => [
                pack(out[0].0, out[1].0),
                pack(out[2].0, out[3].0),
                pack(out[0].1, out[1].1),
                pack(out[2].1, out[3].1),
            ],
        };
        if unsure.iter().any(|&u| u != 0) {
            let mut new = [0u16; D_ROPE];
            let q = new.as_mut_ptr().cast::<__m256i>();
            for (k, &v) in n.iter().enumerate() {
                _mm256_storeu_si256(q.add(k), v);
            }
            // Lane `j` of group `k` is pair `8k + j` interleaved; half-split, groups 0-1 are
            // the even and odd pairs of `0..16`, groups 2-3 those of `16..32`.
            let mut pairs = 0u32;
            for (k, &u) in unsure.iter().enumerate() {
                for j in 0..8 {
                    let pair = match layout {
                        RopeLayout::Interleaved => 8 * k + j,
                        RopeLayout::Half => 16 * (k / 2) + 2 * j + k % 2,
                    };
                    pairs |= (u >> j & 1) << pair;
                }
            }
            redo_in_f64(&mut new, pairs, band, t, layout);
            band.copy_from_slice(&new);
        } else {
            for (k, &v) in n.iter().enumerate() {
                _mm256_storeu_si256(p.add(k), v);
            }
        }
    }
}

/// How far ahead [`tokens`] asks for a row's RoPE band: rows are 1152 B apart and only 128 B
/// of each are touched in place, a stride the hardware prefetchers do not follow far enough.
const PREFETCH_ROWS: usize = 8;

/// A hint to load into cache the RoPE band [`PREFETCH_ROWS`] rows after `(layer, t)` in
/// [`tokens`]' order (tokens `t0..t1` of one layer, then of the next).
#[inline(always)]
fn prefetch_band(
    job: &SpliceJob<'_>,
    pool: Pool,
    layer: usize,
    t: usize,
    (t0, t1): (usize, usize),
) {
    let (mut layer, mut t) = (layer, t + PREFETCH_ROWS);
    if t >= t1 {
        (layer, t) = (layer + 1, t0 + (t - t1));
    }
    #[cfg(target_arch = "x86_64")]
    if layer < job.layers && t < t1 {
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
    let _ = (job, pool, layer, t);
}

/// Tokens `t0..t1` of every layer, each RoPE band rotated by `rotate`.
#[inline(always)]
fn tokens(
    job: &SpliceJob<'_>,
    pool: Pool,
    which: &[usize],
    tables: &[AngleTable],
    (t0, t1): (usize, usize),
    rotate: impl Fn(&mut [u16], &AngleTable, RopeLayout),
) {
    let layout = job.rope.layout();
    let pool_len = job.pool.len();
    for layer in 0..job.layers {
        for t in t0..t1 {
            prefetch_band(job, pool, layer, t, (t0, t1));
            let start = job.dst_start(layer, t);
            assert!(start + D_QK <= pool_len, "validated by SpliceJob::new");
            // SAFETY: `start..start + 576` is inside the pool (checked above) and is this
            // (layer, token)'s own row: distinct pages per table entry, distinct slots per
            // token. In place, the row is read and written only here.
            let dst = unsafe { std::slice::from_raw_parts_mut(pool.base().add(start), D_QK) };
            if !job.is_in_place() {
                dst.copy_from_slice(job.src_row(layer, t));
            }
            rotate(&mut dst[D_LATENT..], &tables[which[t]], layout);
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
    range: (usize, usize),
) {
    tokens(job, pool, which, tables, range, |band, t, layout| {
        rotate_band_avx512(band, t, layout)
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn tokens_avx2(
    job: &SpliceJob<'_>,
    pool: Pool,
    which: &[usize],
    tables: &[AngleTable],
    range: (usize, usize),
) {
    tokens(job, pool, which, tables, range, |band, t, layout| {
        rotate_band_avx2(band, t, layout)
    });
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
                    tokens_avx512(job, pool, &which, &tables, (t0, t1))
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Isa::Avx2 if isa.is_available() => unsafe {
                    tokens_avx2(job, pool, &which, &tables, (t0, t1))
                },
                _ => tokens(job, pool, &which, &tables, (t0, t1), rotate_band),
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rope::{Rope, Yarn, rotate_row_f64};
    use crate::workload::lcg;

    type Rotate = fn(&mut [u16], &AngleTable, RopeLayout);

    /// The band rotations this machine can run: the portable loop, and the AVX-512 one where
    /// the CPU has it (named, so a machine without it shows what it did not check).
    fn paths() -> Vec<(&'static str, Rotate)> {
        let mut paths: Vec<(&'static str, Rotate)> = vec![("portable", rotate_band)];
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx2.is_available() {
            // SAFETY: the features were found at run time.
            paths.push(("avx2", |b, t, l| unsafe { rotate_band_avx2(b, t, l) }));
        } else {
            kvroute_testkit::skip!("no AVX2 here: its band rotation is not checked");
        }
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx512.is_available() {
            // SAFETY: the features were found at run time.
            paths.push(("avx512", |b, t, l| unsafe { rotate_band_avx512(b, t, l) }));
        } else {
            kvroute_testkit::skip!("no AVX-512 here: only the portable band rotation is checked");
        }
        paths
    }

    /// The guarded f32 rotation against the reference's f64 one, bit for bit, on bands built to
    /// find a guard that is too loose: any bf16 bit pattern (subnormals, infinities, NaN, the
    /// largest finite values), pairs that nearly cancel, signed zeros; deltas up to 160K, both
    /// layouts, plain RoPE and YaRN. With the guard's bound cut 256-fold this test finds
    /// mismatches.
    #[test]
    fn guarded_f32_rotation_is_bit_identical_to_the_f64_reference() {
        let paths = paths();
        let mut rng = 7u64;
        let mut redone = 0usize;
        let mut values = 0usize;
        for layout in [RopeLayout::Interleaved, RopeLayout::Half] {
            for rope in [
                Rope::plain(10_000.0, layout).unwrap(),
                Rope::yarn(10_000.0, Yarn::DEEPSEEK, layout).unwrap(),
            ] {
                for case in 0..8_400u64 {
                    let delta = ((lcg(&mut rng) >> 16) % 320_001) as i64 - 160_000;
                    let table = rope.table(delta);
                    let mut row = vec![0u16; D_QK];
                    let band = &mut row[D_LATENT..];
                    for (i, v) in band.iter_mut().enumerate() {
                        let r = lcg(&mut rng) >> 16;
                        *v = match case % 7 {
                            // bf16 subnormals and the smallest normals: f32 products underflow.
                            6 => (r as u16) & 0x80ff,
                            // The largest exponents: sums overflow f32.
                            5 => (r as u16) & 0x807f | 0x7f00,
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
                    for &(path, rotate) in &paths {
                        let mut got = row.clone();
                        rotate(&mut got[D_LATENT..], &table, layout);
                        for i in 0..D_ROPE {
                            let (w, g) = (want[D_LATENT + i], got[D_LATENT + i]);
                            let both_nan =
                                crate::bf16::to_f32(w).is_nan() && crate::bf16::to_f32(g).is_nan();
                            assert!(
                                w == g || both_nan,
                                "{path}, delta {delta}, case {case}, dim {i}: {w:#06x} != {g:#06x}"
                            );
                        }
                    }
                    for i in 0..PAIRS {
                        let (a, b) = layout.pair(i);
                        let (x, y) = (
                            crate::bf16::to_f32(row[D_LATENT + a]),
                            crate::bf16::to_f32(row[D_LATENT + b]),
                        );
                        // The rate is asked of typical values only (cases 1 and 2).
                        if !matches!(case % 7, 1 | 2) {
                            continue;
                        }
                        let (a, b, e, pair) = rotate_f32(x, y, table.cos32[i], table.sin32[i]);
                        redone += 2 * usize::from(pair)
                            + usize::from(near_a_boundary(a, e))
                            + usize::from(near_a_boundary(b, e));
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

    /// A product that underflows f32 to zero where f64 keeps its sign: `(0, 2^-133)` rotated by
    /// one position under YaRN has `y sin` of about 2^-150 in its highest pairs, so the f64
    /// result rounds to bf16 -0 and the f32 one to +0. An exhaustive search over every pair
    /// of bf16 subnormals and eight deltas found only such signed zeros; [`TINY`] sends these
    /// pairs to f64 (without it, this test fails).
    #[test]
    fn underflowing_products_keep_the_sign_of_zero() {
        let rope = Rope::yarn(10_000.0, Yarn::DEEPSEEK, RopeLayout::Interleaved).unwrap();
        let (table, angles) = (rope.table(1), rope.angles(1));
        let paths = paths();
        for (x, y) in [
            (0x0000, 0x0001),
            (0x0000, 0x0002),
            (0x8001, 0x0000),
            (0x8002, 0x0000),
        ] {
            let mut row = vec![0u16; D_QK];
            for pair in row[D_LATENT..].chunks_exact_mut(2) {
                (pair[0], pair[1]) = (x, y);
            }
            let mut want = row.clone();
            rotate_row_f64(&mut want, &angles, RopeLayout::Interleaved);
            assert!(want[D_LATENT..].contains(&0x8000), "the case lost its -0");
            for &(path, rotate) in &paths {
                let mut got = row.clone();
                rotate(&mut got[D_LATENT..], &table, RopeLayout::Interleaved);
                assert_eq!(got, want, "{path}: ({x:#06x}, {y:#06x})");
            }
        }
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
