//! The portable inner loops of the CPU partial, over plain arrays for LLVM to vectorise: the
//! kernels of the baseline instruction set (SSE2 on x86-64, or the target's baseline
//! elsewhere). AVX2 + FMA and AVX-512 have their own kernels in intrinsics
//! ([`super::avx2`], [`super::avx512`]), which share [`RowState`] and [`TILE`].
//!
//! Multiply-adds round twice (the baseline has no fused multiply-add, and Rust never fuses on
//! its own), so results do not depend on the compiler.
//!
//! A tile is up to 64 cache rows converted to f32 once and then used by every query row of the
//! block: scores, the online-softmax update, and `acc += P V` with 4 rows x 16 columns of
//! accumulators held in registers across the tile's tokens. Blocks of fewer than 4 rows skip
//! the conversion and read the bf16 rows directly ([`tile_few_rows`]).

use crate::layout::{D_LATENT, D_QK};

/// Tokens per tile (one page of the paged pool).
pub(crate) const TILE: usize = 64;

/// Running softmax state of a block of query rows.
#[derive(Debug, Clone)]
pub(crate) struct RowState {
    pub(crate) m: Vec<f32>,
    pub(crate) l: Vec<f32>,
    pub(crate) acc: Vec<f32>,
}

impl RowState {
    pub(crate) fn new(rows: usize) -> Self {
        Self {
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
            acc: vec![0.0; rows * D_LATENT],
        }
    }

    /// Row `r`'s online-softmax step to the running maximum `m_new` (finite, >= the old one),
    /// given the tile's `sum exp(s - m_new)`: `l` and the accumulators are rescaled by
    /// `exp(m_old - m_new)` before the tile's values are added.
    #[inline(always)]
    pub(crate) fn advance(&mut self, r: usize, m_new: f32, tile_sum: f32) {
        let m_old = self.m[r];
        let alpha = if m_old == f32::NEG_INFINITY {
            0.0
        } else {
            (m_old - m_new).exp()
        };
        self.l[r] = self.l[r] * alpha + tile_sum;
        self.m[r] = m_new;
        if alpha != 1.0 {
            for a in &mut self.acc[r * D_LATENT..(r + 1) * D_LATENT] {
                *a *= alpha;
            }
        }
    }
}

/// bf16 rows to f32 (exact: a shift).
#[inline(always)]
pub(crate) fn widen(src: &[u16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(u32::from(s) << 16);
    }
}

/// `a . b`, each element of `b` converted by `f` as it is read (f32 as is, or bf16 widened).
#[inline(always)]
fn dot<T: Copy>(a: &[f32], b: &[T], f: impl Fn(T) -> f32) -> f32 {
    let mut acc = [[0f32; 16]; 2];
    for (x, y) in a.chunks_exact(32).zip(b.chunks_exact(32)) {
        for h in 0..2 {
            for i in 0..16 {
                acc[h][i] += x[h * 16 + i] * f(y[h * 16 + i]);
            }
        }
    }
    let mut sum = [0f32; 16];
    for i in 0..16 {
        sum[i] = acc[0][i] + acc[1][i];
    }
    sum.iter().sum()
}

/// Row `r`'s online-softmax step over its tile scores `s`: `s` becomes `exp(s - m_new)` and the
/// state is rescaled; `false` (and `s` zeroed) when the logits are not finite, which the
/// state then carries (a NaN maximum) rather than hides.
#[inline(always)]
pub(crate) fn softmax_step(st: &mut RowState, r: usize, s: &mut [f32]) -> bool {
    let tile_max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let m_new = st.m[r].max(tile_max);
    if m_new == f32::NEG_INFINITY || m_new.is_nan() {
        if m_new.is_nan() {
            st.m[r] = f32::NAN;
        }
        s.fill(0.0);
        return false;
    }
    let mut sum = 0f32;
    for x in s.iter_mut() {
        *x = (*x - m_new).exp();
        sum += *x;
    }
    st.advance(r, m_new, sum);
    true
}

/// `kt[d][j] = k[j][d]` for the tile's `n` keys, in blocks of 16 keys x 16 dims: both sides
/// touch 16 cache lines per block, which stays in L1 (a key-major or dim-major sweep alone
/// turns into scatters or gathers).
#[inline(always)]
fn transpose(k: &[f32], n: usize, kt: &mut [f32]) {
    for j0 in (0..n).step_by(16) {
        let j1 = (j0 + 16).min(n);
        for d0 in (0..D_QK).step_by(16) {
            for j in j0..j1 {
                let src = &k[j * D_QK + d0..j * D_QK + d0 + 16];
                for (i, &x) in src.iter().enumerate() {
                    kt[(d0 + i) * TILE + j] = x;
                }
            }
        }
    }
}

/// Output columns (and tile columns of the scores) one register block covers: with 4 rows,
/// 4 x 16 f32 accumulators are 8 ymm registers, leaving AVX2's other 8 for the broadcasts and
/// loads. 4 x 32 took all 16 and two accumulators spilled to the stack on every step
/// (measured: 1.4-1.5x slower at Mq 16 and 256), when this tile was also the AVX2 path; the
/// baseline it serves now keeps the shape.
const BLOCK_COLS: usize = 16;

/// `acc[r] += sum_j p[r][j] v_j` for `R` rows, [`BLOCK_COLS`] columns at a time in registers.
#[inline(always)]
fn pv_block<const R: usize>(p: &[f32], n: usize, k: &[f32], acc: &mut [f32]) {
    for c0 in (0..D_LATENT).step_by(BLOCK_COLS) {
        let mut a = [[0f32; BLOCK_COLS]; R];
        for (r, row) in a.iter_mut().enumerate() {
            row.copy_from_slice(&acc[r * D_LATENT + c0..r * D_LATENT + c0 + BLOCK_COLS]);
        }
        for j in 0..n {
            let v = &k[j * D_QK + c0..j * D_QK + c0 + BLOCK_COLS];
            for (r, row) in a.iter_mut().enumerate() {
                let w = p[r * TILE + j];
                for c in 0..BLOCK_COLS {
                    row[c] += w * v[c];
                }
            }
        }
        for (r, row) in a.iter().enumerate() {
            acc[r * D_LATENT + c0..r * D_LATENT + c0 + BLOCK_COLS].copy_from_slice(row);
        }
    }
}

/// `s[r][j] = q_r . k_j` for `R` rows and all 64 tile columns, from the transposed tile `kt`
/// (`[576][64]`): a broadcast of `q[r][d]` times consecutive keys, so no horizontal sums; the
/// columns go [`BLOCK_COLS`] at a time, so `R` x [`BLOCK_COLS`] accumulators stay in registers.
/// Columns past the tile's `n` hold stale keys and are never read.
#[inline(always)]
fn scores_block<const R: usize>(q: &[f32], kt: &[f32], s: &mut [f32]) {
    for j0 in (0..TILE).step_by(BLOCK_COLS) {
        let mut acc = [[0f32; BLOCK_COLS]; R];
        for d in 0..D_QK {
            let kv = &kt[d * TILE + j0..d * TILE + j0 + BLOCK_COLS];
            for (r, row) in acc.iter_mut().enumerate() {
                let w = q[r * D_QK + d];
                for j in 0..BLOCK_COLS {
                    row[j] += w * kv[j];
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            s[r * TILE + j0..r * TILE + j0 + BLOCK_COLS].copy_from_slice(row);
        }
    }
}

/// Row blocks at least this tall use the transposed-tile scores; below it the transpose costs
/// more than the horizontal sums it saves.
pub(crate) const TRANSPOSE_ROWS: usize = 4;

/// bf16 bits to f32, one value (exact: a shift); vectorises inside the loops below.
#[inline(always)]
fn bf(x: u16) -> f32 {
    f32::from_bits(u32::from(x) << 16)
}

/// One tile of `n` bf16 cache rows `kb` for a block of fewer than [`TRANSPOSE_ROWS`] query
/// rows (decode's Mq = 1-3): the keys are read as bf16 and widened in registers by the scores
/// and again by `P V`, instead of being written out as a 147 KB f32 tile that both then read
/// back from L2: for so few rows the conversion is cheaper than the traffic.
#[inline(always)]
pub(crate) fn tile_few_rows(
    q: &[f32],
    kb: &[u16],
    n: usize,
    st: &mut RowState,
    scores: &mut [f32],
) {
    let rows = st.m.len();
    for r in 0..rows {
        let qr = &q[r * D_QK..(r + 1) * D_QK];
        let s = &mut scores[r * TILE..r * TILE + n];
        for (j, x) in s.iter_mut().enumerate() {
            *x = dot::<u16>(qr, &kb[j * D_QK..(j + 1) * D_QK], bf);
        }
        if !softmax_step(st, r, s) {
            continue;
        }
        let acc = &mut st.acc[r * D_LATENT..(r + 1) * D_LATENT];
        for c0 in (0..D_LATENT).step_by(BLOCK_COLS) {
            let mut a = [0f32; BLOCK_COLS];
            a.copy_from_slice(&acc[c0..c0 + BLOCK_COLS]);
            for (j, &w) in s.iter().enumerate() {
                let v = &kb[j * D_QK + c0..j * D_QK + c0 + BLOCK_COLS];
                for c in 0..BLOCK_COLS {
                    a[c] += w * bf(v[c]);
                }
            }
            acc[c0..c0 + BLOCK_COLS].copy_from_slice(&a);
        }
    }
}

/// One tile of `n` (1..=64) f32 cache rows `k` against the block's pre-scaled f32 query rows
/// `q`, folded into `st`. `scores` is scratch of `rows * TILE`, `kt` of `576 * TILE`.
#[inline(always)]
pub(crate) fn tile(
    q: &[f32],
    k: &[f32],
    n: usize,
    st: &mut RowState,
    scores: &mut [f32],
    kt: &mut [f32],
) {
    let rows = st.m.len();
    let blocked = rows / 4 * 4;
    if rows >= TRANSPOSE_ROWS {
        transpose(k, n, kt);
        for r0 in (0..blocked).step_by(4) {
            scores_block::<4>(&q[r0 * D_QK..], kt, &mut scores[r0 * TILE..]);
        }
    }
    for r in 0..rows {
        let qr = &q[r * D_QK..(r + 1) * D_QK];
        let s = &mut scores[r * TILE..(r + 1) * TILE];
        if rows < TRANSPOSE_ROWS || r >= blocked {
            for (j, x) in s[..n].iter_mut().enumerate() {
                *x = dot::<f32>(qr, &k[j * D_QK..(j + 1) * D_QK], |v| v);
            }
        }
        softmax_step(st, r, &mut s[..n]);
    }
    let mut r0 = 0;
    while r0 + 4 <= rows {
        pv_block::<4>(&scores[r0 * TILE..], n, k, &mut st.acc[r0 * D_LATENT..]);
        r0 += 4;
    }
    while r0 < rows {
        pv_block::<1>(&scores[r0 * TILE..], n, k, &mut st.acc[r0 * D_LATENT..]);
        r0 += 1;
    }
}
