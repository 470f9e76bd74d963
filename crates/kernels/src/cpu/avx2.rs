//! The AVX2 + FMA tile for a few query rows (decode's Mq = 1-3), written with intrinsics.
//!
//! The portable [`super::tile::tile_few_rows`] reads the bf16 keys in place too, but left to
//! the autovectoriser its four-key score loop kept its eight accumulators on the stack (a
//! store and a reload on every multiply-add), and a single-key dot product has four chains,
//! too few to cover the FMA latency. Here each score step loads a 16-wide chunk of the query
//! once for four keys and keeps eight independent chains in registers; `P V` keeps 64 output
//! columns (eight registers) across the tile's tokens. bf16 -> f32 is a zero-extension and a
//! 16-bit shift, exact, so results match the portable path's up to summation order.
//!
//! The online-softmax step of every AVX2 tile ([`softmax_row`]) is here too: the portable step
//! called libm's scalar `expf` once per score, with a `vzeroupper` around each call and the
//! running sum through the stack, about a tenth of a dense partial at Mq = 256 (`perf`).

use std::arch::x86_64::{
    __m256, _CMP_UNORD_Q, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT, _mm_add_ps, _mm_add_ss,
    _mm_cvtss_f32, _mm_loadu_si128, _mm_max_ps, _mm_max_ss, _mm_movehdup_ps, _mm_movehl_ps,
    _mm256_add_epi32, _mm256_add_ps, _mm256_blendv_ps, _mm256_castps256_ps128, _mm256_castsi256_ps,
    _mm256_cmp_ps, _mm256_cmpgt_epi32, _mm256_cvtepu16_epi32, _mm256_cvtps_epi32,
    _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_loadu_ps, _mm256_max_ps,
    _mm256_movemask_ps, _mm256_mul_ps, _mm256_round_ps, _mm256_set1_epi32, _mm256_set1_ps,
    _mm256_setr_epi32, _mm256_setzero_ps, _mm256_slli_epi32, _mm256_storeu_ps,
};

use super::tile::{RowState, TILE};
use crate::layout::{D_LATENT, D_QK};

/// Output columns `P V` accumulates at once: eight registers.
const PV_COLS: usize = 64;

/// Eight bf16 at `p`, widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen8(p: *const u16) -> __m256 {
    // SAFETY (caller): `p..p + 8` is readable.
    unsafe {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p.cast()),
        )))
    }
}

/// The sum of the eight lanes of `v`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// `q` (576 f32) against the `KEYS` bf16 rows at the start of `kb`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dots<const KEYS: usize>(q: &[f32], kb: &[u16]) -> [f32; KEYS] {
    assert!(q.len() >= D_QK && kb.len() >= KEYS * D_QK);
    let (qp, kp) = (q.as_ptr(), kb.as_ptr());
    let mut lo = [_mm256_setzero_ps(); KEYS];
    let mut hi = [_mm256_setzero_ps(); KEYS];
    for c in (0..D_QK).step_by(16) {
        // SAFETY: c + 16 <= 576, and both slices were checked to hold what is read.
        unsafe {
            let (x0, x1) = (_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(qp.add(c + 8)));
            for k in 0..KEYS {
                let row = kp.add(k * D_QK + c);
                lo[k] = _mm256_fmadd_ps(x0, widen8(row), lo[k]);
                hi[k] = _mm256_fmadd_ps(x1, widen8(row.add(8)), hi[k]);
            }
        }
    }
    let mut out = [0f32; KEYS];
    for k in 0..KEYS {
        out[k] = hsum(_mm256_add_ps(lo[k], hi[k]));
    }
    out
}

/// `acc` (512 f32) += sum over j of `w[j]` x the first 512 columns of bf16 row j of `kb`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn pv(w: &[f32], kb: &[u16], acc: &mut [f32]) {
    assert!(acc.len() >= D_LATENT && kb.len() >= w.len() * D_QK);
    let (ap, kp) = (acc.as_mut_ptr(), kb.as_ptr());
    for c0 in (0..D_LATENT).step_by(PV_COLS) {
        // SAFETY: c0 + 64 <= 512 columns of `acc` and of each of the `w.len()` rows of `kb`,
        // checked above.
        unsafe {
            let mut a = [_mm256_setzero_ps(); PV_COLS / 8];
            for (i, a) in a.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(ap.add(c0 + 8 * i));
            }
            for (j, &wj) in w.iter().enumerate() {
                let (wv, row) = (_mm256_set1_ps(wj), kp.add(j * D_QK + c0));
                for (i, a) in a.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wv, widen8(row.add(8 * i)), *a);
                }
            }
            for (i, a) in a.iter().enumerate() {
                _mm256_storeu_ps(ap.add(c0 + 8 * i), *a);
            }
        }
    }
}

/// `e^x` for `x <= 0` or NaN, eight lanes (NaN stays NaN). Cephes' `expf` reduction and
/// polynomial, as the AVX-512 kernels use; AVX2 has no `vscalefps`, so `2^n` is built in the
/// exponent bits, and below `2^-126` (`x < -87.3`, far under any weight a softmax keeps
/// beside its maximum's 1) the result is 0 instead of a subnormal.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp_nonpos(x: __m256) -> __m256 {
    // `max(a, b)` returns `b` when either is NaN: NaN passes through.
    let x = _mm256_max_ps(_mm256_set1_ps(-103.9), x);
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    // n in [-150, 0]; clamped to -127, whose biased exponent 0 makes the factor +0. A NaN n
    // takes the clamp too, and `y` is NaN then anyway.
    let e = _mm256_cvtps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-127.0)));
    let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(e, _mm256_set1_epi32(127)));
    _mm256_mul_ps(y, _mm256_castsi256_ps(scale))
}

/// The largest of the eight lanes of `v` (no NaN among them).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn hmax(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)))
}

/// Row `r`'s online-softmax step over the first `n` of its [`TILE`] scores `s`: `s` becomes
/// `exp(s - m_new)` (0 past `n`) and the row's state is rescaled. Returns `false`, with `s`
/// zeroed, when the row has nothing to add: a NaN logit, which makes the row's maximum NaN
/// for good (its output is NaN), or no finite logit yet. The AVX-512 kernels' contract.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn softmax_row(s: &mut [f32], n: usize, r: usize, st: &mut RowState) -> bool {
    let s = &mut s[..TILE];
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let live = |c: usize| {
        let index = _mm256_add_epi32(lanes, _mm256_set1_epi32((c * 8) as i32));
        // n <= 64: no overflow in the comparison.
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), index))
    };
    let (mut max, mut nan) = (_mm256_set1_ps(f32::NEG_INFINITY), 0);
    for (c, chunk) in s.chunks_exact(8).enumerate() {
        // SAFETY: `chunk` holds eight f32.
        let v = unsafe { _mm256_loadu_ps(chunk.as_ptr()) };
        let live = live(c);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v)) & _mm256_movemask_ps(live);
        max = _mm256_max_ps(
            max,
            _mm256_blendv_ps(_mm256_set1_ps(f32::NEG_INFINITY), v, live),
        );
    }
    let m_old = st.m[r];
    let m_new = m_old.max(hmax(max));
    if nan != 0 || m_old.is_nan() || m_new == f32::NEG_INFINITY {
        if nan != 0 {
            st.m[r] = f32::NAN;
        }
        s.fill(0.0);
        return false;
    }
    let mut sum = _mm256_setzero_ps();
    for (c, chunk) in s.chunks_exact_mut(8).enumerate() {
        // SAFETY: `chunk` holds eight f32.
        let v = unsafe { _mm256_loadu_ps(chunk.as_ptr()) };
        let p = exp_nonpos(_mm256_add_ps(v, _mm256_set1_ps(-m_new)));
        let p = _mm256_blendv_ps(_mm256_setzero_ps(), p, live(c));
        sum = _mm256_add_ps(sum, p);
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), p) };
    }
    st.advance(r, m_new, hsum(sum));
    true
}

/// One tile of `n` bf16 cache rows `kb` for the block's pre-scaled f32 query rows `q` (fewer
/// than [`super::tile::TRANSPOSE_ROWS`]), folded into `st`; `scores` is scratch of
/// `rows * TILE`. The same contract as [`super::tile::tile_few_rows`].
#[target_feature(enable = "avx2,fma")]
pub(crate) fn tile_few_rows(
    q: &[f32],
    kb: &[u16],
    n: usize,
    st: &mut RowState,
    scores: &mut [f32],
) {
    let kb = &kb[..n * D_QK];
    for r in 0..st.m.len() {
        let qr = &q[r * D_QK..(r + 1) * D_QK];
        let s = &mut scores[r * TILE..r * TILE + n];
        let quads = n / 4 * 4;
        for j in (0..quads).step_by(4) {
            s[j..j + 4].copy_from_slice(&dots::<4>(qr, &kb[j * D_QK..]));
        }
        for j in quads..n {
            s[j] = dots::<1>(qr, &kb[j * D_QK..])[0];
        }
        if softmax_row(&mut scores[r * TILE..(r + 1) * TILE], n, r, st) {
            pv(
                &scores[r * TILE..r * TILE + n],
                kb,
                &mut st.acc[r * D_LATENT..(r + 1) * D_LATENT],
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn has_avx2() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }

    #[target_feature(enable = "avx2,fma")]
    fn exp_lanes(x: [f32; 8]) -> [f32; 8] {
        let mut out = [0f32; 8];
        // SAFETY: both arrays hold eight f32.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), exp_nonpos(_mm256_loadu_ps(x.as_ptr()))) };
        out
    }

    #[test]
    fn exp_is_within_2_ulp_of_std_flushes_below_normal_and_keeps_nan() {
        if !has_avx2() {
            kvroute_testkit::skip!("no AVX2 and FMA on this CPU");
            return;
        }
        let mut worst = 0u32;
        let mut x = 0f32;
        while x > -110.0 {
            let xs: [f32; 8] = std::array::from_fn(|i| x - i as f32 * 1.37e-3);
            // SAFETY: the features were detected above.
            let got = unsafe { exp_lanes(xs) };
            for (g, xi) in got.iter().zip(xs) {
                let want = xi.exp();
                if want >= f32::MIN_POSITIVE {
                    worst = worst.max(g.to_bits().abs_diff(want.to_bits()));
                } else {
                    assert!(*g <= f32::MIN_POSITIVE, "exp({xi}) = {g}");
                }
            }
            x -= 0.0219;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        let special = [
            f32::NAN,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            -1e30,
            -88.0,
            -100.0,
            -1.0,
        ];
        // SAFETY: as above.
        let got = unsafe { exp_lanes(special) };
        assert!(got[0].is_nan());
        assert_eq!((got[1], got[4], got[6]), (0.0, 0.0, 0.0));
        assert_eq!((got[2], got[3]), (1.0, 1.0));
        assert!(got[5] <= f32::MIN_POSITIVE);
        assert!((got[7] - (-1f32).exp()).abs() <= f32::EPSILON);
    }

    #[test]
    fn the_softmax_step_matches_the_portable_one_and_masks_past_n() {
        if !has_avx2() {
            kvroute_testkit::skip!("no AVX2 and FMA on this CPU");
            return;
        }
        for n in [1usize, 7, 8, 33, 64] {
            let scores: Vec<f32> = (0..TILE)
                .map(|j| ((j * 37) % 23) as f32 * 0.41 - 3.0)
                .collect();
            let (mut mine, mut theirs) = (RowState::new(1), RowState::new(1));
            for st in [&mut mine, &mut theirs] {
                st.m[0] = 2.5;
                st.l[0] = 1.75;
                st.acc.fill(1.0);
            }
            let mut s = scores.clone();
            s[n..].fill(f32::NAN); // stale past n: must neither count nor leak
            // SAFETY: the features were detected above.
            assert!(unsafe { softmax_row(&mut s, n, 0, &mut mine) });
            let mut t = scores[..n].to_vec();
            assert!(super::super::tile::softmax_step(&mut theirs, 0, &mut t));
            assert_eq!(mine.m[0], theirs.m[0], "n = {n}");
            assert!(
                (mine.l[0] - theirs.l[0]).abs() <= 1e-5 * theirs.l[0],
                "n = {n}"
            );
            assert!((mine.acc[7] - theirs.acc[7]).abs() <= 1e-6, "n = {n}");
            for j in 0..n {
                assert!(
                    (s[j] - t[j]).abs() <= 2e-7 * t[j].max(1e-30) + 1e-38,
                    "n = {n}, {j}"
                );
            }
            assert!(s[n..].iter().all(|&x| x == 0.0), "n = {n}");
        }
        // A NaN logit makes the row's maximum NaN for good and adds nothing.
        let mut st = RowState::new(1);
        let mut s = vec![0.5f32; TILE];
        s[3] = f32::NAN;
        // SAFETY: as above.
        assert!(!unsafe { softmax_row(&mut s, 4, 0, &mut st) });
        assert!(st.m[0].is_nan() && s.iter().all(|&x| x == 0.0));
        let mut s = vec![0.5f32; TILE];
        // SAFETY: as above.
        assert!(!unsafe { softmax_row(&mut s, 4, 0, &mut st) });
    }
}
