//! The AVX2 + FMA tile for a few query rows (decode's Mq = 1-3), written with intrinsics.
//!
//! The portable [`super::tile::tile_few_rows`] reads the bf16 keys in place too, but left to
//! the autovectoriser its four-key score loop kept its eight accumulators on the stack (a
//! store and a reload on every multiply-add), and a single-key dot product has four chains,
//! too few to cover the FMA latency. Here each score step loads a 16-wide chunk of the query
//! once for four keys and keeps eight independent chains in registers; `P V` keeps 64 output
//! columns (eight registers) across the tile's tokens. bf16 -> f32 is a zero-extension and a
//! 16-bit shift, exact, so results match the portable path's up to summation order.

use std::arch::x86_64::{
    __m256, _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_loadu_si128, _mm_movehdup_ps, _mm_movehl_ps,
    _mm256_add_ps, _mm256_castps256_ps128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32,
    _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps, _mm256_setzero_ps,
    _mm256_slli_epi32, _mm256_storeu_ps,
};

use super::tile::{RowState, TILE, softmax_step};
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
        if softmax_step(st, r, s) {
            pv(s, kb, &mut st.acc[r * D_LATENT..(r + 1) * D_LATENT]);
        }
    }
}
