//! The matmul kernel with AVX2 + FMA intrinsics: tiles of 4 tokens, each weight row's 16-lane
//! chunk loaded once (f32, or bf16 widened) and multiplied into 4 tokens' accumulators (8 of
//! the 16 ymm registers).
//!
//! LLVM's auto-vectoriser, given the same loops over `[f32; 16]` arrays, spilled the
//! accumulators and shuffled xmm halves: prefill of 2048 tokens of the tiny model took 13.5 s
//! on one core, 3.9 s with this kernel (f32 weights, the Xeon the crate docs name). Per token,
//! the operations are those of a single-token dot product in the same order (16 lanes,
//! [`super::reduce`]'s tree, then the tail), so a token's result does not depend on its tile.

use std::arch::x86_64::{
    __m128i, __m256, _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_fmadd_ps,
    _mm256_loadu_ps, _mm256_setzero_ps, _mm256_slli_epi32, _mm256_storeu_ps,
};

use super::{LANES, Rows, TILE_TOKENS, Weight, reduce};

/// 16 lanes as two 8-lane halves.
pub(crate) type Pair = (__m256, __m256);

/// Loads 16 f32s.
///
/// # Safety
/// The CPU must have AVX.
#[inline(always)]
pub(super) unsafe fn load_f32(chunk: &[f32; LANES]) -> Pair {
    // SAFETY: `chunk` is 16 readable f32s; each unaligned load reads 8 of them; the caller
    // guarantees AVX.
    unsafe {
        (
            _mm256_loadu_ps(chunk.as_ptr()),
            _mm256_loadu_ps(chunk.as_ptr().add(8)),
        )
    }
}

/// Loads 16 bf16s, widened to f32 (exactly: the bits shifted into the upper half).
///
/// # Safety
/// The CPU must have AVX2.
#[inline(always)]
pub(super) unsafe fn load_bf16(chunk: &[u16; LANES]) -> Pair {
    let p = chunk.as_ptr().cast::<__m128i>();
    // SAFETY: `chunk` is 32 readable bytes; each unaligned 128-bit load reads 16 of them; the
    // caller guarantees AVX2.
    unsafe {
        let widen = |v| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)));
        (widen(_mm_loadu_si128(p)), widen(_mm_loadu_si128(p.add(1))))
    }
}

/// The 16 lanes of `acc` as an array, in lane order.
#[target_feature(enable = "avx2,fma")]
fn lanes(acc: Pair) -> [f32; LANES] {
    let mut out = [0f32; LANES];
    // SAFETY: `out` has room for 16 f32s; each unaligned store writes 8 of them.
    unsafe {
        _mm256_storeu_ps(out.as_mut_ptr(), acc.0);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), acc.1);
    }
    out
}

/// `w . x` from its 16-lane accumulator and the tail past the whole chunks.
#[target_feature(enable = "avx2,fma")]
fn finish<W: Weight>(acc: Pair, w_tail: &[W], x_tail: &[f32]) -> f32 {
    let mut s = reduce(lanes(acc));
    for (&w, &x) in w_tail.iter().zip(x_tail) {
        s = w.value().mul_add(x, s);
    }
    s
}

#[target_feature(enable = "avx2,fma")]
#[inline]
fn fma(a: Pair, w: Pair, x: &[f32; LANES]) -> Pair {
    // SAFETY: this function's AVX2 + FMA cover the load.
    let (xl, xh) = unsafe { load_f32(x) };
    (_mm256_fmadd_ps(w.0, xl, a.0), _mm256_fmadd_ps(w.1, xh, a.1))
}

#[target_feature(enable = "avx2,fma")]
#[inline]
fn dots4<W: Weight>(w: &[W], xs: [&[f32]; TILE_TOKENS]) -> [f32; TILE_TOKENS] {
    let (wc, wt) = w.as_chunks::<LANES>();
    let (c0, t0) = xs[0].as_chunks::<LANES>();
    let (c1, t1) = xs[1].as_chunks::<LANES>();
    let (c2, t2) = xs[2].as_chunks::<LANES>();
    let (c3, t3) = xs[3].as_chunks::<LANES>();
    let z = _mm256_setzero_ps();
    let (mut a0, mut a1, mut a2, mut a3) = ((z, z), (z, z), (z, z), (z, z));
    for ((((w, x0), x1), x2), x3) in wc.iter().zip(c0).zip(c1).zip(c2).zip(c3) {
        // SAFETY: this function's AVX2 covers the load.
        let w = unsafe { W::load(w) };
        a0 = fma(a0, w, x0);
        a1 = fma(a1, w, x1);
        a2 = fma(a2, w, x2);
        a3 = fma(a3, w, x3);
    }
    [
        finish(a0, wt, t0),
        finish(a1, wt, t1),
        finish(a2, wt, t2),
        finish(a3, wt, t3),
    ]
}

#[target_feature(enable = "avx2,fma")]
#[inline]
fn dot<W: Weight>(w: &[W], x: &[f32]) -> f32 {
    let (wc, wt) = w.as_chunks::<LANES>();
    let (xc, xt) = x.as_chunks::<LANES>();
    let z = _mm256_setzero_ps();
    let mut a = (z, z);
    for (w, x) in wc.iter().zip(xc) {
        // SAFETY: this function's AVX2 covers the load.
        a = fma(a, unsafe { W::load(w) }, x);
    }
    finish(a, wt, xt)
}

/// Output rows `rows` of `W x` (`W` row-major with rows of `n`) for tokens `tokens`, handed to
/// `put(token, row, value)`.
#[target_feature(enable = "avx2,fma")]
pub(super) fn kernel<W: Weight>(
    w: &[W],
    n: usize,
    x: Rows<'_>,
    tokens: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    mut put: impl FnMut(usize, usize, f32),
) {
    let mut t0 = tokens.start;
    while t0 + TILE_TOKENS <= tokens.end {
        let xs: [&[f32]; TILE_TOKENS] = std::array::from_fn(|i| x.row(t0 + i, n));
        for o in rows.clone() {
            let d = dots4(&w[o * n..(o + 1) * n], xs);
            for (i, v) in d.into_iter().enumerate() {
                put(t0 + i, o, v);
            }
        }
        t0 += TILE_TOKENS;
    }
    for t in t0..tokens.end {
        let xt = x.row(t, n);
        for o in rows.clone() {
            put(t, o, dot(&w[o * n..(o + 1) * n], xt));
        }
    }
}
