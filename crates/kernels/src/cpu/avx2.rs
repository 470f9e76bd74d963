//! The AVX2 + FMA partials, written with intrinsics: dense ([`dense_range`], contiguous or
//! paged caches) and sparse ([`sparse_range`]), both through one tile ([`tile_rows`]) that
//! takes up to 64 cache rows by reference, for any number of query rows.
//!
//! The keys are read as bf16 and widened in registers (a zero-extension and a 16-bit shift,
//! exact), never written out as f32: rows go six (or four) at a time, so one widened key
//! vector serves six rows' scores (two keys by six rows, 12 chains) and one widened value
//! slice six rows' `P V` (16 columns by six rows). The portable tile ([`super::tile`]) widens
//! each 64-key tile to f32, transposes it and then runs 4 x 16 register blocks over both;
//! with the same softmax step, skipping that took Mq = 16 from 408 to 359 us, Mq = 4 from
//! 184-280 to 100 us and a top-2048 sparse partial of 16 heads from 439-449 to 384-387 us
//! (Zen 5, docs/perf.md; four rows a block then, and six took Mq = 16 on to 329-331 us): the
//! widening, the transpose and their 300 KB of traffic per tile weighed as much as a block of
//! 16 rows' multiply-adds. Left to the autovectoriser, the one-row score loop kept its
//! accumulators on the stack (a store and a reload on every multiply-add); here every chain
//! stays in a register. Results match the portable path's up to summation order.
//!
//! The online-softmax step ([`softmax_row`]) takes 8 lanes at a time; the portable one called
//! libm's scalar `expf` once per score, with a `vzeroupper` around each call and the running
//! sum through the stack (about a tenth of a dense partial at Mq = 256, `perf`).

use std::arch::x86_64::{
    __m256, _CMP_UNORD_Q, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT, _mm_add_ps, _mm_add_ss,
    _mm_cvtss_f32, _mm_loadu_si128, _mm_max_ps, _mm_max_ss, _mm_movehdup_ps, _mm_movehl_ps,
    _mm_storeu_ps, _mm256_add_epi32, _mm256_add_ps, _mm256_blendv_ps, _mm256_broadcast_ss,
    _mm256_castps256_ps128, _mm256_castsi256_ps, _mm256_cmp_ps, _mm256_cmpgt_epi32,
    _mm256_cvtepu16_epi32, _mm256_cvtps_epi32, _mm256_extractf128_ps, _mm256_fmadd_ps,
    _mm256_fnmadd_ps, _mm256_hadd_ps, _mm256_loadu_ps, _mm256_max_ps, _mm256_movemask_ps,
    _mm256_mul_ps, _mm256_round_ps, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setr_epi32,
    _mm256_setzero_ps, _mm256_slli_epi32, _mm256_storeu_ps,
};

use super::tile::{RowState, TILE};
use super::{Scratch, tile_keys};
use crate::layout::{Cache, D_LATENT, D_QK};

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

/// `q` (576 f32) against the first `KEYS` bf16 rows of `keys` (each checked 576 long by the
/// caller, [`tile_rows`]).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dots<const KEYS: usize>(q: &[f32], keys: &[&[u16]]) -> [f32; KEYS] {
    assert!(q.len() >= D_QK && keys.len() >= KEYS);
    let qp = q.as_ptr();
    let kp: [*const u16; KEYS] = std::array::from_fn(|k| keys[k].as_ptr());
    let mut lo = [_mm256_setzero_ps(); KEYS];
    let mut hi = [_mm256_setzero_ps(); KEYS];
    for c in (0..D_QK).step_by(16) {
        // SAFETY: c + 16 <= 576, within `q` (checked) and every key (checked by the caller).
        unsafe {
            let (x0, x1) = (_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(qp.add(c + 8)));
            for k in 0..KEYS {
                let row = kp[k].add(c);
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

/// `acc` (512 f32) += sum over j of `w[j]` x the first 512 columns of `keys[j]` (bf16, each
/// checked 576 long by the caller).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn pv(w: &[f32], keys: &[&[u16]], acc: &mut [f32]) {
    assert!(acc.len() >= D_LATENT && keys.len() >= w.len());
    let ap = acc.as_mut_ptr();
    for c0 in (0..D_LATENT).step_by(PV_COLS) {
        // SAFETY: c0 + 64 <= 512 columns of `acc` (checked) and of every key (the caller's).
        unsafe {
            let mut a = [_mm256_setzero_ps(); PV_COLS / 8];
            for (i, a) in a.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(ap.add(c0 + 8 * i));
            }
            for (&wj, key) in w.iter().zip(keys) {
                let (wv, row) = (_mm256_set1_ps(wj), key.as_ptr().add(c0));
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

/// `q_r . k_j` for `R` (4 or 6) query rows (`q`, rows 576 apart) and two bf16 keys `k0`,
/// `k1`: each widened key vector serves `R` rows, `2 R` chains in registers.
///
/// # Safety
/// `R` rows of `q` and 576 values at `k0` and at `k1` must be readable; AVX2 and FMA enabled.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_x2<const R: usize>(q: *const f32, k0: *const u16, k1: *const u16) -> [[f32; 2]; R] {
    // SAFETY (caller): as documented; c + 8 <= 576.
    unsafe {
        let mut a = [[_mm256_setzero_ps(); 2]; R];
        for c in (0..D_QK).step_by(8) {
            let (v0, v1) = (widen8(k0.add(c)), widen8(k1.add(c)));
            for (r, a) in a.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(q.add(r * D_QK + c));
                a[0] = _mm256_fmadd_ps(x, v0, a[0]);
                a[1] = _mm256_fmadd_ps(x, v1, a[1]);
            }
        }
        // Two rows' four sums at a time: two rounds of pairwise adds within 128-bit lanes,
        // then one add of the halves.
        let mut out = [[0f32; 2]; R];
        for r in (0..R).step_by(2) {
            let h = _mm256_hadd_ps(
                _mm256_hadd_ps(a[r][0], a[r][1]),
                _mm256_hadd_ps(a[r + 1][0], a[r + 1][1]),
            );
            let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
            let mut four = [0f32; 4];
            _mm_storeu_ps(four.as_mut_ptr(), sums);
            out[r] = [four[0], four[1]];
            out[r + 1] = [four[2], four[3]];
        }
        out
    }
}

/// `acc[r] += sum_j p[r][j] k_j` for `R` (4 or 6) rows of weights `p` (`[R][TILE]`) and
/// accumulators `acc` (`[R][512]`) over the first 512 columns of the bf16 `keys` (each checked
/// 576 long by the caller), each widened 16-column slice serving the `R` rows.
#[target_feature(enable = "avx2,fma")]
fn pv_rows<const R: usize>(p: &[f32], keys: &[&[u16]], acc: &mut [f32]) {
    let n = keys.len();
    assert!(n <= TILE && p.len() >= (R - 1) * TILE + n && acc.len() >= R * D_LATENT);
    let (pp, ap) = (p.as_ptr(), acc.as_mut_ptr());
    for c0 in (0..D_LATENT).step_by(16) {
        // SAFETY: weights j < n of the R rows of `p` and columns c0..c0 + 16 <= 512 of the R
        // rows of `acc` (checked above) and of every key (the caller's check).
        unsafe {
            let mut a: [[__m256; 2]; R] = std::array::from_fn(|r| {
                let at = ap.add(r * D_LATENT + c0);
                [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))]
            });
            for (j, key) in keys.iter().enumerate() {
                let row = key.as_ptr().add(c0);
                let (v0, v1) = (widen8(row), widen8(row.add(8)));
                for (r, a) in a.iter_mut().enumerate() {
                    let w = _mm256_broadcast_ss(&*pp.add(r * TILE + j));
                    a[0] = _mm256_fmadd_ps(w, v0, a[0]);
                    a[1] = _mm256_fmadd_ps(w, v1, a[1]);
                }
            }
            for (r, a) in a.iter().enumerate() {
                let at = ap.add(r * D_LATENT + c0);
                _mm256_storeu_ps(at, a[0]);
                _mm256_storeu_ps(at.add(8), a[1]);
            }
        }
    }
}

/// Rows `r0..r0 + R` (R = 4 or 6) of one tile: scores two keys at a time, each row's softmax
/// step, then `P V` for the `R` rows together.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn rows_block<const R: usize>(
    q: &[f32],
    keys: &[&[u16]],
    r0: usize,
    st: &mut RowState,
    scores: &mut [f32],
) {
    let n = keys.len();
    assert!(q.len() >= (r0 + R) * D_QK && scores.len() >= (r0 + R) * TILE);
    let pairs = n / 2 * 2;
    for j in (0..pairs).step_by(2) {
        // SAFETY: rows r0..r0 + R of `q` and keys j, j + 1 < n (576 long: the caller's check).
        let d = unsafe {
            dots_x2::<R>(
                q.as_ptr().add(r0 * D_QK),
                keys[j].as_ptr(),
                keys[j + 1].as_ptr(),
            )
        };
        for (i, d) in d.iter().enumerate() {
            scores[(r0 + i) * TILE + j..(r0 + i) * TILE + j + 2].copy_from_slice(d);
        }
    }
    for r in r0..r0 + R {
        let qr = &q[r * D_QK..(r + 1) * D_QK];
        for j in pairs..n {
            scores[r * TILE + j] = dots::<1>(qr, &keys[j..])[0];
        }
        // A row with nothing to add has its weights zeroed: P V adds nothing for it.
        softmax_row(&mut scores[r * TILE..(r + 1) * TILE], n, r, st);
    }
    pv_rows::<R>(
        &scores[r0 * TILE..],
        keys,
        &mut st.acc[r0 * D_LATENT..(r0 + R) * D_LATENT],
    );
}

/// One tile of up to [`TILE`] bf16 cache rows `keys` for any number of pre-scaled f32 query
/// rows `q`, folded into `st`, reading the keys as bf16 in place: rows go six (or four) at a
/// time, so each key vector widened in registers serves six rows (12 of the 16 registers
/// accumulate), and the last one to three one at a time (four keys per step, 64 output
/// columns per sweep). `scores` is scratch of `rows * TILE`.
#[target_feature(enable = "avx2,fma")]
fn tile_rows(q: &[f32], keys: &[&[u16]], st: &mut RowState, scores: &mut [f32]) {
    let (rows, n) = (st.m.len(), keys.len());
    assert!(n <= TILE && q.len() >= rows * D_QK && scores.len() >= rows * TILE);
    assert!(
        keys.iter().all(|k| k.len() >= D_QK),
        "a cache row is 576 values"
    );
    let mut r0 = 0;
    // Sixes while they leave no 2 or 3 rows that fours would take (16 = 6 + 6 + 4, 32 = 4 x
    // 6 + 2 x 4).
    while rows - r0 >= 6 && !matches!(rows - r0, 8 | 9) {
        rows_block::<6>(q, keys, r0, st, scores);
        r0 += 6;
    }
    while rows - r0 >= 4 {
        rows_block::<4>(q, keys, r0, st, scores);
        r0 += 4;
    }
    for r in r0..rows {
        let qr = &q[r * D_QK..(r + 1) * D_QK];
        let key_quads = n / 4 * 4;
        for j in (0..key_quads).step_by(4) {
            scores[r * TILE + j..r * TILE + j + 4].copy_from_slice(&dots::<4>(qr, &keys[j..]));
        }
        for j in key_quads..n {
            scores[r * TILE + j] = dots::<1>(qr, &keys[j..])[0];
        }
        if softmax_row(&mut scores[r * TILE..(r + 1) * TILE], n, r, st) {
            pv(
                &scores[r * TILE..r * TILE + n],
                keys,
                &mut st.acc[r * D_LATENT..(r + 1) * D_LATENT],
            );
        }
    }
}

/// Tokens `t0..t1` of `cache` into `st` (bf16 query rows `q`, softmax scale `scale`): the AVX2
/// dense partial, 64 keys a tile, read in place (contiguous or paged alike).
#[target_feature(enable = "avx2,fma")]
pub(crate) fn dense_range(
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    (t0, t1): (usize, usize),
    st: &mut RowState,
    scratch: &mut Scratch,
) {
    let (q, scores) = scratch.rows(q, scale, st.m.len());
    let mut keys: Vec<&[u16]> = Vec::with_capacity(TILE);
    let mut t = t0;
    while t < t1 {
        let n = TILE.min(t1 - t);
        tile_keys(cache, t, n, &mut keys);
        tile_rows(q, &keys, st, scores);
        t += n;
    }
}

/// The selected tokens `picked` (-1 skipped) into `st`: the AVX2 sparse partial, 64 selected
/// rows a tile, read in place.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn sparse_range(
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    picked: &[i32],
    st: &mut RowState,
    scratch: &mut Scratch,
) {
    let (q, scores) = scratch.rows(q, scale, st.m.len());
    let mut keys: Vec<&[u16]> = Vec::with_capacity(TILE);
    for &i in picked.iter().filter(|&&i| i >= 0) {
        keys.push(cache.row(i as usize));
        if keys.len() == TILE {
            tile_rows(q, &keys, st, scores);
            keys.clear();
        }
    }
    if !keys.is_empty() {
        tile_rows(q, &keys, st, scores);
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
        // SAFETY: the features were detected above.
        let worst = super::super::exp_worst_ulp(|xs: [f32; 8]| unsafe { exp_lanes(xs) });
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
    fn every_split_of_rows_into_sixes_fours_and_ones_matches_the_portable_tile() {
        if !has_avx2() {
            kvroute_testkit::skip!("no AVX2 and FMA on this CPU");
            return;
        }
        // Small integers scaled by powers of two: bf16 keys and f32 queries exactly.
        let value = |i: usize, salt: usize| ((i * 7 + salt * 13) % 17) as f32 / 16.0 - 0.5;
        let bf = |x: f32| (x.to_bits() >> 16) as u16;
        for rows in 1..=20 {
            for n in [1usize, 2, 7, 64] {
                let kb: Vec<u16> = (0..n * D_QK).map(|i| bf(value(i, 1))).collect();
                let q: Vec<f32> = (0..rows * D_QK).map(|i| value(i, 2) / 8.0).collect();
                let keys: Vec<&[u16]> = kb.chunks_exact(D_QK).collect();
                let (mut mine, mut theirs) = (RowState::new(rows), RowState::new(rows));
                let mut scores = vec![0f32; rows * TILE];
                // SAFETY: the features were detected above.
                unsafe { tile_rows(&q, &keys, &mut mine, &mut scores) };
                super::super::tile::tile_few_rows(&q, &kb, n, &mut theirs, &mut scores);
                for r in 0..rows {
                    let at = format!("rows {rows}, n {n}, row {r}");
                    assert!((mine.m[r] - theirs.m[r]).abs() <= 1e-5, "{at}");
                    assert!(
                        (mine.l[r] - theirs.l[r]).abs() <= 1e-4 * theirs.l[r],
                        "{at}"
                    );
                    let (a, b) = (
                        &mine.acc[r * D_LATENT..(r + 1) * D_LATENT],
                        &theirs.acc[r * D_LATENT..(r + 1) * D_LATENT],
                    );
                    assert!(a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-4), "{at}");
                }
            }
        }
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
