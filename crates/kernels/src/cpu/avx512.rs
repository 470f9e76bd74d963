//! The AVX-512 BF16 tile: scores with `vdpbf16ps` straight from the bf16 cache rows (32
//! products per instruction, each exact in f32, summed in f32), and `acc += P V` in f32 with
//! the value rows widened in registers. No f32 copy or transpose of the tile is made.
//!
//! Values are widened without shuffles: a 64-byte load holds 32 bf16 = 16 u32, and
//! `x << 16` is the even columns as f32, `x & 0xffff_0000` the odd ones. The accumulators are
//! therefore kept "split": in each 32-column group, the 16 even columns and then the 16 odd
//! ones. [`unsplit`] restores the natural order once per range.
//!
//! Accuracy matches the f32 paths: bf16 x bf16 products are exact in f32, accumulation is f32,
//! `exp` is a degree-6 polynomial within 2 ulp of `f32::exp` over the range a softmax uses.

use std::arch::x86_64::{
    __m512, __m512bh, __m512i, _CMP_UNORD_Q, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT,
    _mm512_add_ps, _mm512_and_si512, _mm512_castpd_ps, _mm512_castps_pd, _mm512_castsi512_ps,
    _mm512_cmp_ps_mask, _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_loadu_ps,
    _mm512_loadu_si512, _mm512_mask_blend_ps, _mm512_max_ps, _mm512_mul_ps, _mm512_reduce_add_ps,
    _mm512_reduce_max_ps, _mm512_roundscale_ps, _mm512_scalef_ps, _mm512_set1_epi32,
    _mm512_set1_ps, _mm512_setzero_ps, _mm512_shuffle_f32x4, _mm512_slli_epi32, _mm512_storeu_ps,
    _mm512_unpackhi_pd, _mm512_unpackhi_ps, _mm512_unpacklo_pd, _mm512_unpacklo_ps,
};

use super::tile::{RowState, TILE};
use super::tile_keys;
use crate::layout::{Cache, D_LATENT, D_QK};

/// 32-dim steps in a 576-wide row.
const STEPS: usize = D_QK / 32;
/// 32-column value groups in the 512-wide latent.
const GROUPS: usize = D_LATENT / 32;

#[inline(always)]
unsafe fn load_bh(p: *const u16) -> __m512bh {
    // SAFETY (caller): `p..p + 32` is readable. `__m512bh` and `__m512i` are both 64 bytes.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.cast())) }
}

/// Lane `i` of the result is the sum of the lanes of `v[i]`.
#[inline(always)]
unsafe fn hsum16(v: [__m512; 16]) -> __m512 {
    // SAFETY (caller): AVX-512 F is enabled.
    unsafe {
        // 16 -> 8: per 128-bit lane, [a0+a2, b0+b2, a1+a3, b1+b3] for each pair (a, b).
        let mut h8 = [_mm512_setzero_ps(); 8];
        for (i, h) in h8.iter_mut().enumerate() {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            *h = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        // 8 -> 4: per 128-bit lane, the four lane sums of v[4k..4k + 4] in order.
        let mut h4 = [_mm512_setzero_ps(); 4];
        for (i, h) in h4.iter_mut().enumerate() {
            let (a, b) = (_mm512_castps_pd(h8[2 * i]), _mm512_castps_pd(h8[2 * i + 1]));
            let (lo, hi) = (_mm512_unpacklo_pd(a, b), _mm512_unpackhi_pd(a, b));
            *h = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
        }
        // 4 -> 2 -> 1: add the 128-bit lanes pairwise.
        let fold = |a: __m512, b: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        };
        // fold(a, b) = [a.L0 + a.L1, a.L2 + a.L3, b.L0 + b.L1, b.L2 + b.L3] (128-bit lanes):
        // x holds v0-3 and v4-7 as half sums, y v8-11 and v12-15, fold(x, y) the full sums.
        fold(fold(h4[0], h4[1]), fold(h4[2], h4[3]))
    }
}

/// `e^x` for `x <= 0` or NaN (NaN stays NaN; below -103.9 the result is 0 or the smallest
/// subnormal). Cephes' `expf` reduction and polynomial, the scaling by `vscalefps`.
#[inline(always)]
unsafe fn exp_nonpos(x: __m512) -> __m512 {
    // SAFETY (caller): AVX-512 F is enabled.
    unsafe {
        // `max(a, b)` returns `b` when either is NaN: NaN passes through.
        let x = _mm512_max_ps(_mm512_set1_ps(-103.9), x);
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut y = _mm512_set1_ps(1.987_569_1e-4);
        for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
        }
        let r2 = _mm512_mul_ps(r, r);
        let y = _mm512_fmadd_ps(y, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
        _mm512_scalef_ps(y, n)
    }
}

/// `s[r][j] = scale * (q_r . k_j)` for `R` rows and `J` keys (`R * J = 16`) with
/// `vdpbf16ps` on the raw bf16 rows.
#[inline(always)]
unsafe fn scores_dp<const R: usize, const J: usize>(
    q: [*const u16; R],
    k: [*const u16; J],
) -> __m512 {
    // SAFETY (caller): every pointer reads a 576-element row; AVX-512 BF16 is enabled.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); 16];
        for step in 0..STEPS {
            let qv: [__m512bh; R] = std::array::from_fn(|r| load_bh(q[r].add(step * 32)));
            for j in 0..J {
                let kv = load_bh(k[j].add(step * 32));
                for r in 0..R {
                    acc[r * J + j] = _mm512_dpbf16_ps(acc[r * J + j], qv[r], kv);
                }
            }
        }
        hsum16(acc)
    }
}

/// The same with f32 FMAs: each key step is widened in registers (even and odd columns) and
/// multiplied by the query rows in [`QRows`]' split f32 copy.
#[inline(always)]
unsafe fn scores_fma<const R: usize, const J: usize>(
    q: [*const f32; R],
    k: [*const u16; J],
) -> __m512 {
    // SAFETY (caller): every key pointer reads 576 bf16, every query pointer 576 f32; AVX-512 F
    // is enabled.
    unsafe {
        let mask = _mm512_set1_epi32(0xffff_0000_u32 as i32);
        let mut acc = [_mm512_setzero_ps(); 16];
        for step in 0..STEPS {
            for j in 0..J {
                let v = _mm512_loadu_si512(k[j].add(step * 32).cast());
                let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                let odd = _mm512_castsi512_ps(_mm512_and_si512(v, mask));
                for r in 0..R {
                    let qe = _mm512_loadu_ps(q[r].add(step * 32));
                    let qo = _mm512_loadu_ps(q[r].add(step * 32 + 16));
                    let a = _mm512_fmadd_ps(qe, even, acc[r * J + j]);
                    acc[r * J + j] = _mm512_fmadd_ps(qo, odd, a);
                }
            }
        }
        hsum16(acc)
    }
}

/// A block's query rows as the score kernels read them: raw bf16 for `vdpbf16ps`, and for the
/// FMA path an f32 copy in split order (per 32-dim step, 16 even then 16 odd dims).
pub(crate) struct QRows<'a> {
    raw: &'a [u16],
    split: Vec<f32>,
}

impl<'a> QRows<'a> {
    /// `dp`: whether the scores use `vdpbf16ps` (no f32 copy is made then). Inlined into the
    /// `#[target_feature]` kernels, so the conversion vectorises (out of line it ran as
    /// baseline x86-64 code).
    #[inline(always)]
    pub(crate) fn new(raw: &'a [u16], dp: bool) -> Self {
        let mut split = Vec::new();
        if !dp {
            split.resize(raw.len(), 0.0);
            for (dst, src) in split.chunks_exact_mut(32).zip(raw.chunks_exact(32)) {
                for i in 0..16 {
                    dst[i] = crate::bf16::to_f32(src[2 * i]);
                    dst[16 + i] = crate::bf16::to_f32(src[2 * i + 1]);
                }
            }
        }
        Self { raw, split }
    }

    fn rows(&self) -> usize {
        self.raw.len() / D_QK
    }
}

/// Scores of every row of the block against the tile's `n` keys into `s` (`rows x TILE`),
/// 4 rows x 4 keys per register block, the rows past a multiple of 4 one at a time x 16 keys.
#[inline(always)]
unsafe fn all_scores<const DP: bool>(q: &QRows<'_>, keys: &[&[u16]], scale: f32, s: &mut [f32]) {
    let rows = q.rows();
    let n = keys.len();
    // Keys past `n` repeat the last one; their scores are never stored.
    let key = |j: usize| keys[j.min(n - 1)].as_ptr();
    let raw = |r: usize| q.raw[r * D_QK..].as_ptr();
    let split = |r: usize| q.split[r * D_QK..].as_ptr();
    const RB: usize = 4;
    const JB: usize = 16 / RB;
    let quads = rows / RB * RB;
    let mut out = [0f32; 16];
    // SAFETY (all blocks): rows are 576 long (`Queries`, `Cache::row`, `QRows`); the caller
    // enabled AVX-512 F, and BF16 when `DP`.
    unsafe {
        for j0 in (0..n).step_by(JB) {
            let k: [_; JB] = std::array::from_fn(|j| key(j0 + j));
            for r0 in (0..quads).step_by(RB) {
                let sums = if DP {
                    scores_dp::<RB, JB>(std::array::from_fn(|r| raw(r0 + r)), k)
                } else {
                    scores_fma::<RB, JB>(std::array::from_fn(|r| split(r0 + r)), k)
                };
                _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
                for r in 0..RB {
                    for j in j0..(j0 + JB).min(n) {
                        s[(r0 + r) * TILE + j] = out[r * JB + j - j0];
                    }
                }
            }
        }
        for r in quads..rows {
            for j0 in (0..n).step_by(16) {
                let k: [_; 16] = std::array::from_fn(|j| key(j0 + j));
                let sums = if DP {
                    scores_dp::<1, 16>([raw(r)], k)
                } else {
                    scores_fma::<1, 16>([split(r)], k)
                };
                _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
                let m = (j0 + 16).min(n);
                s[r * TILE + j0..r * TILE + m].copy_from_slice(&out[..m - j0]);
            }
        }
    }
}

/// The online-softmax update of row `r` from its `n` scores; leaves `exp(s - m)` in `s`
/// (zero past `n`) and rescales the row's accumulators.
#[inline(always)]
unsafe fn softmax_row(s: &mut [f32], n: usize, r: usize, st: &mut RowState) {
    // SAFETY (caller): AVX-512 F is enabled; `s` is TILE (64) long.
    unsafe {
        let valid = |c: usize| -> u16 {
            let live = n.saturating_sub(c * 16).min(16);
            ((1u32 << live) - 1) as u16
        };
        let mut tile_max = f32::NEG_INFINITY;
        let mut nan = false;
        for c in 0..TILE / 16 {
            let v = _mm512_loadu_ps(s.as_ptr().add(c * 16));
            let live = valid(c);
            nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v) & live != 0;
            let v = _mm512_mask_blend_ps(live, _mm512_set1_ps(f32::NEG_INFINITY), v);
            tile_max = tile_max.max(_mm512_reduce_max_ps(v));
        }
        let m_old = st.m[r];
        let m_new = m_old.max(tile_max);
        if nan || m_old.is_nan() || m_new == f32::NEG_INFINITY {
            // Non-finite logits (non-finite inputs): NaN propagates to the output through
            // `m`; a row that saw only -inf logits attends nothing yet.
            if nan {
                st.m[r] = f32::NAN;
            }
            s.fill(0.0);
            return;
        }
        let mut sum = _mm512_setzero_ps();
        for c in 0..TILE / 16 {
            let v = _mm512_loadu_ps(s.as_ptr().add(c * 16));
            let p = exp_nonpos(_mm512_add_ps(v, _mm512_set1_ps(-m_new)));
            let p = _mm512_mask_blend_ps(valid(c), _mm512_setzero_ps(), p);
            sum = _mm512_add_ps(sum, p);
            _mm512_storeu_ps(s.as_mut_ptr().add(c * 16), p);
        }
        st.advance(r, m_new, _mm512_reduce_add_ps(sum));
    }
}

/// `acc[r] += sum_j p[r][j] v_j` for `R` rows in value group `g` (split column order).
#[inline(always)]
unsafe fn pv_block<const R: usize>(p: &[f32], keys: &[&[u16]], g: usize, acc: &mut [f32]) {
    // SAFETY (caller): AVX-512 F is enabled; `p` holds R x TILE weights, `acc` R rows of 512,
    // every key 576 long.
    unsafe {
        let odd = _mm512_set1_epi32(0xffff_0000_u32 as i32);
        let mut a = [[_mm512_setzero_ps(); 2]; R];
        for (r, ar) in a.iter_mut().enumerate() {
            let base = acc.as_ptr().add(r * D_LATENT + g * 32);
            *ar = [_mm512_loadu_ps(base), _mm512_loadu_ps(base.add(16))];
        }
        for (j, k) in keys.iter().enumerate() {
            let v = _mm512_loadu_si512(k.as_ptr().add(g * 32).cast());
            let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
            let odd = _mm512_castsi512_ps(_mm512_and_si512(v, odd));
            for (r, ar) in a.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*p.get_unchecked(r * TILE + j));
                ar[0] = _mm512_fmadd_ps(w, even, ar[0]);
                ar[1] = _mm512_fmadd_ps(w, odd, ar[1]);
            }
        }
        for (r, ar) in a.iter().enumerate() {
            let base = acc.as_mut_ptr().add(r * D_LATENT + g * 32);
            _mm512_storeu_ps(base, ar[0]);
            _mm512_storeu_ps(base.add(16), ar[1]);
        }
    }
}

/// One tile of `keys` (1..=64 cache rows) against the block's query rows `q`, folded into
/// `st` (accumulators in split order). `scores` is scratch of `rows * TILE`.
#[inline(always)]
unsafe fn tile<const DP: bool>(
    q: &QRows<'_>,
    scale: f32,
    keys: &[&[u16]],
    st: &mut RowState,
    scores: &mut [f32],
) {
    let rows = st.m.len();
    debug_assert!(q.rows() == rows && keys.iter().all(|k| k.len() == D_QK));
    debug_assert!(!keys.is_empty() && keys.len() <= TILE && scores.len() >= rows * TILE);
    // SAFETY (caller): the features are enabled; the shapes are the callers' invariants
    // (checked above in debug builds): 576-long rows, `scores` rows x 64.
    unsafe {
        all_scores::<DP>(q, keys, scale, scores);
        for r in 0..rows {
            softmax_row(&mut scores[r * TILE..(r + 1) * TILE], keys.len(), r, st);
        }
        for g in 0..GROUPS {
            let mut r0 = 0;
            while r0 < rows {
                let (p, acc) = (&scores[r0 * TILE..], &mut st.acc[r0 * D_LATENT..]);
                let step = match rows - r0 {
                    8.. => 8,
                    4.. => 4,
                    2.. => 2,
                    _ => 1,
                };
                match step {
                    8 => pv_block::<8>(p, keys, g, acc),
                    4 => pv_block::<4>(p, keys, g, acc),
                    2 => pv_block::<2>(p, keys, g, acc),
                    _ => pv_block::<1>(p, keys, g, acc),
                }
                r0 += step;
            }
        }
    }
}

/// Tokens `t0..t1` of `cache` into `st`; `DP`: scores with `vdpbf16ps`.
#[inline(always)]
unsafe fn dense_range<const DP: bool>(
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    t0: usize,
    t1: usize,
    st: &mut RowState,
) {
    let q = QRows::new(q, DP);
    let mut scores = vec![0f32; st.m.len() * TILE];
    let mut keys: Vec<&[u16]> = Vec::with_capacity(TILE);
    let mut t = t0;
    while t < t1 {
        let n = TILE.min(t1 - t);
        tile_keys(cache, t, n, &mut keys);
        // SAFETY (caller): features enabled; keys are cache rows (576 long).
        unsafe { tile::<DP>(&q, scale, &keys, st, &mut scores) };
        t += n;
    }
    unsplit(&mut st.acc);
}

/// The selected tokens `picked` (-1 skipped) into `st`; `DP` as above.
#[inline(always)]
unsafe fn sparse_range<const DP: bool>(
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    picked: &[i32],
    st: &mut RowState,
) {
    let q = QRows::new(q, DP);
    let mut scores = vec![0f32; st.m.len() * TILE];
    let mut keys: Vec<&[u16]> = Vec::with_capacity(TILE);
    for &i in picked.iter().filter(|&&i| i >= 0) {
        keys.push(cache.row(i as usize));
        if keys.len() == TILE {
            // SAFETY (caller): features enabled; keys are cache rows (576 long).
            unsafe { tile::<DP>(&q, scale, &keys, st, &mut scores) };
            keys.clear();
        }
    }
    if !keys.is_empty() {
        // SAFETY: as above.
        unsafe { tile::<DP>(&q, scale, &keys, st, &mut scores) };
    }
    unsplit(&mut st.acc);
}

/// [`super::dense_range`] on AVX-512 F/BW/VL: FMA scores from keys widened in registers.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(crate) fn dense_fma(
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    t0: usize,
    t1: usize,
    st: &mut RowState,
) {
    // SAFETY: the features `dense_range::<false>` needs are enabled on this function.
    unsafe { dense_range::<false>(q, scale, cache, t0, t1, st) }
}

/// [`super::dense_range`] with `vdpbf16ps` scores (AVX-512 BF16).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma")]
pub(crate) fn dense_dp(
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    t0: usize,
    t1: usize,
    st: &mut RowState,
) {
    // SAFETY: the features `dense_range::<true>` needs are enabled on this function.
    unsafe { dense_range::<true>(q, scale, cache, t0, t1, st) }
}

/// [`super::sparse_range`] on AVX-512 F/BW/VL: FMA scores.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
pub(crate) fn sparse_fma(
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    picked: &[i32],
    st: &mut RowState,
) {
    // SAFETY: the features `sparse_range::<false>` needs are enabled on this function.
    unsafe { sparse_range::<false>(q, scale, cache, picked, st) }
}

/// [`super::sparse_range`] with `vdpbf16ps` scores (AVX-512 BF16).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma")]
pub(crate) fn sparse_dp(
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    picked: &[i32],
    st: &mut RowState,
) {
    // SAFETY: the features `sparse_range::<true>` needs are enabled on this function.
    unsafe { sparse_range::<true>(q, scale, cache, picked, st) }
}

/// Split column order (per 32-column group: 16 even, then 16 odd columns) back to natural.
pub(crate) fn unsplit(acc: &mut [f32]) {
    for group in acc.chunks_exact_mut(32) {
        let split: [f32; 32] = group.try_into().unwrap_or([0.0; 32]);
        for i in 0..16 {
            group[2 * i] = split[i];
            group[2 * i + 1] = split[16 + i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn has_bf16() -> bool {
        std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512f")
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma")]
    fn hsum_lanes(v: [[f32; 16]; 16]) -> [f32; 16] {
        // SAFETY: features enabled above; arrays are 16 f32.
        unsafe {
            let regs = v.map(|x| _mm512_loadu_ps(x.as_ptr()));
            let mut out = [0f32; 16];
            _mm512_storeu_ps(out.as_mut_ptr(), hsum16(regs));
            out
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma")]
    fn exp_lanes(x: [f32; 16]) -> [f32; 16] {
        // SAFETY: features enabled above.
        unsafe {
            let mut out = [0f32; 16];
            _mm512_storeu_ps(out.as_mut_ptr(), exp_nonpos(_mm512_loadu_ps(x.as_ptr())));
            out
        }
    }

    #[test]
    fn hsum16_puts_each_vectors_sum_in_its_lane() {
        if !has_bf16() {
            kvroute_testkit::skip!("no AVX-512 BF16 on this CPU");
            return;
        }
        // Distinct powers of two per (vector, lane): any misplaced term changes the sum.
        let v: [[f32; 16]; 16] =
            std::array::from_fn(|i| std::array::from_fn(|l| (i * 100) as f32 + (1 << l) as f32));
        // SAFETY: the features were detected above.
        let got = unsafe { hsum_lanes(v) };
        for (i, g) in got.iter().enumerate() {
            assert_eq!(*g, v[i].iter().sum::<f32>(), "lane {i}");
        }
    }

    #[test]
    fn exp_is_within_2_ulp_of_std_and_keeps_nan() {
        if !has_bf16() {
            kvroute_testkit::skip!("no AVX-512 BF16 on this CPU");
            return;
        }
        // SAFETY: the features were detected above.
        let worst = super::super::exp_worst_ulp(|xs: [f32; 16]| unsafe { exp_lanes(xs) });
        assert!(worst <= 2, "worst error {worst} ulp");
        // SAFETY: as above.
        let special = unsafe {
            exp_lanes([
                f32::NAN,
                f32::NEG_INFINITY,
                0.0,
                -0.0,
                -1e30,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
                0.0,
            ])
        };
        assert!(special[0].is_nan());
        assert!(special[1] <= f32::MIN_POSITIVE && special[4] <= f32::MIN_POSITIVE);
        assert_eq!((special[2], special[3]), (1.0, 1.0));
    }

    #[test]
    fn unsplit_restores_natural_order() {
        let mut v: Vec<f32> = (0..64)
            .map(|i| {
                let (g, c) = (i / 32, i % 32);
                let col = if c < 16 { 2 * c } else { 2 * (c - 16) + 1 };
                (g * 32 + col) as f32
            })
            .collect();
        unsplit(&mut v);
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32));
    }
}
