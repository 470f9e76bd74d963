//! The fast CPU path: f32 accumulation, SIMD chosen at run time ([`Isa`]), threads over query
//! row blocks and over the keys (split-K, each split a partial state merged at the end, the
//! same algebra as [`crate::merge`]), so a decode-sized batch uses every core.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod isa;
mod splice;
mod tile;

pub use isa::Isa;
pub(crate) use isa::vectorised;
pub(crate) use splice::splice;

use rayon::prelude::*;

use crate::error::KernelError;
use crate::layout::{Cache, D_LATENT, D_QK, Queries, Selection};
use crate::merge::combine_row;
use crate::partial::{Partial, WireOut};
use tile::{RowState, TILE, widen};

/// Query rows per block in the dense partial: a block's scores (rows x 64) and accumulators
/// (rows x 512 f32) stay in L1/L2 while a 64-token tile is reused by every row. (64 measured
/// within 2% of 32 on AVX2 and AVX-512 alike, Zen 5; 32 keeps the block in a 512 KB L2.)
const DENSE_ROWS: usize = 32;

/// The tile loops' working memory: the block's scaled query rows and its scores, and for the
/// portable loops one tile of f32 keys and its transpose (about 300 KB at 16 rows). Kept per thread
/// and reused: allocated per task, glibc handed each back to the kernel on free (the heap top
/// above its trim threshold), so every task paid page faults and a memset for it, about a
/// tenth of a dense partial at Mq = 16 on AVX2. Stale contents are never read: every loop
/// writes what it then reads (the tiles' columns past `n` are computed on but masked).
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    q: Vec<f32>,
    scores: Vec<f32>,
    k: Vec<f32>,
    kt: Vec<f32>,
}

impl Scratch {
    /// The block's query rows (scaled from `q`) and its scores, for `rows` rows.
    fn rows(&mut self, q: &[u16], scale: f32, rows: usize) -> (&[f32], &mut [f32]) {
        (
            scaled(&mut self.q, q, scale),
            lined(&mut self.scores, rows * TILE),
        )
    }

    /// [`Scratch::rows`], and one tile of f32 keys and its transpose.
    fn for_block(
        &mut self,
        q: &[u16],
        scale: f32,
        rows: usize,
    ) -> (&[f32], &mut [f32], &mut [f32], &mut [f32]) {
        (
            scaled(&mut self.q, q, scale),
            lined(&mut self.scores, rows * TILE),
            lined(&mut self.k, TILE * D_QK),
            lined(&mut self.kt, TILE * D_QK),
        )
    }
}

/// bf16 query rows `q` widened and multiplied by the softmax scale, into `v`.
fn scaled<'a>(v: &'a mut Vec<f32>, q: &[u16], scale: f32) -> &'a [f32] {
    let qs = lined(v, q.len());
    for (d, &b) in qs.iter_mut().zip(q) {
        *d = crate::bf16::to_f32(b) * scale;
    }
    qs
}

/// The first `len` floats of `v` from a cache-line boundary, grown as needed: vector loads
/// never straddle two lines.
fn lined(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    const LINE: usize = 64 / size_of::<f32>();
    if v.len() < len + LINE {
        v.resize(len + LINE, 0.0);
    }
    let skip = v.as_ptr().align_offset(64).min(LINE);
    &mut v[skip..skip + len]
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Floats a thread keeps in its [`Scratch`] between calls: the query rows of a 128-row block
/// (a sparse token of 128 heads; dense blocks are 32 rows). A call with taller blocks gets
/// its buffers and gives them back, so one large request does not pin memory on every thread.
const SCRATCH_KEEP: usize = 128 * D_QK + 64;

/// Runs `f` with this thread's [`Scratch`]. Called outside the `#[target_feature]` kernels, so
/// the closure it takes never carries their code.
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with_borrow_mut(|scratch| {
        let out = f(scratch);
        for v in [&mut scratch.q, &mut scratch.scores] {
            if v.len() > SCRATCH_KEEP {
                *v = Vec::new();
            }
        }
        out
    })
}

/// The cache rows of tokens `t..t + n` into `keys` (cleared first): one slice per token,
/// from one contiguous run or page by page. The intrinsics kernels' tiles take their keys so.
fn tile_keys<'c>(cache: &Cache<'c>, t: usize, n: usize, keys: &mut Vec<&'c [u16]>) {
    keys.clear();
    match cache.run(t, n) {
        Some(rows) => keys.extend(rows.chunks_exact(D_QK)),
        None => keys.extend((t..t + n).map(|i| cache.row(i))),
    }
}

/// Tokens `t0..t1` of `cache` into `st` (bf16 query rows `q`, softmax scale `scale`): the
/// portable loops (the baseline ISA; AVX2 has [`avx2::dense_range`], AVX-512 its own).
#[inline(always)]
pub(crate) fn dense_range(
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    (t0, t1): (usize, usize),
    st: &mut RowState,
    scratch: &mut Scratch,
) {
    let (q, scores, k, kt) = scratch.for_block(q, scale, st.m.len());
    let mut t = t0;
    while t < t1 {
        let n = TILE.min(t1 - t);
        match cache.run(t, n) {
            // A few query rows read the keys as bf16 in place (below that, widening a tile
            // costs more than it saves).
            Some(rows) if st.m.len() < tile::TRANSPOSE_ROWS => {
                tile::tile_few_rows(q, rows, n, st, scores);
                t += n;
                continue;
            }
            Some(rows) => widen(rows, &mut k[..n * D_QK]),
            None => {
                for j in 0..n {
                    widen(cache.row(t + j), &mut k[j * D_QK..(j + 1) * D_QK]);
                }
            }
        }
        tile::tile(q, &k[..n * D_QK], n, st, scores, kt);
        t += n;
    }
}

/// The selected tokens `picked` (-1 skipped) into `st`: the portable loops.
#[inline(always)]
pub(crate) fn sparse_range(
    q: &[u16],
    scale: f32,
    cache: &Cache<'_>,
    picked: &[i32],
    st: &mut RowState,
    scratch: &mut Scratch,
) {
    let (q, scores, k, kt) = scratch.for_block(q, scale, st.m.len());
    let mut n = 0;
    for &i in picked.iter().filter(|&&i| i >= 0) {
        widen(cache.row(i as usize), &mut k[n * D_QK..(n + 1) * D_QK]);
        n += 1;
        if n == TILE {
            tile::tile(q, k, n, st, scores, kt);
            n = 0;
        }
    }
    if n > 0 {
        tile::tile(q, &k[..n * D_QK], n, st, scores, kt);
    }
}

/// Folds the split states of one row block into rows `r0..` of `out` ([`crate::merge`]'s
/// combine; here the accumulators are not yet normalised, so values weigh 1), on the best
/// instruction set (the f64 sums vectorise).
fn finish(states: &[RowState], r0: usize, out: &mut Partial) {
    vectorised(
        #[inline(always)]
        || finish_rows(states, r0, out),
    );
}

#[inline(always)]
fn finish_rows(states: &[RowState], r0: usize, out: &mut Partial) {
    for r in 0..states[0].m.len() {
        let o = &mut out.o[(r0 + r) * D_LATENT..(r0 + r + 1) * D_LATENT];
        if states
            .iter()
            .any(|s| s.m[r].is_nan() || s.m[r] == f32::INFINITY || !s.l[r].is_finite())
        {
            // Non-finite inputs or scores: propagate rather than hide (the combine skips a
            // split whose `l` is not positive, so a NaN `l` would drop the whole split).
            o.fill(f32::NAN);
            (out.m[r0 + r], out.l[r0 + r]) = (f32::NAN, f32::NAN);
            continue;
        }
        let parts = states.iter().map(|s| {
            (
                s.m[r],
                s.l[r],
                &s.acc[r * D_LATENT..(r + 1) * D_LATENT],
                1.0,
            )
        });
        (out.m[r0 + r], out.l[r0 + r]) = combine_row(parts, o);
    }
}

/// How many key splits: enough tasks for every thread twice over, no split under a tile.
fn splits(blocks: usize, units: usize) -> usize {
    let threads = rayon::current_num_threads();
    (2 * threads).div_ceil(blocks).clamp(1, units.max(1))
}

/// The split states of a partial, `split` per block of `block` consecutive query rows (the
/// last block may be shorter), before they are folded into rows.
struct States {
    states: Vec<RowState>,
    split: usize,
    block: usize,
}

impl States {
    /// Folds every block into `out` (f32 rows).
    fn finish(&self, out: &mut Partial) {
        for (b, chunk) in self.states.chunks(self.split).enumerate() {
            finish(chunk, b * self.block, out);
        }
    }

    /// Folds every block and encodes its rows straight into `out`'s wire rows while they are in
    /// cache (the fused epilogue), one block per task.
    fn finish_wire(&self, out: &mut WireOut<'_>) {
        self.states
            .par_chunks(self.split)
            .zip(out.row_slices().par_chunks_mut(self.block))
            .for_each(|(chunk, rows)| {
                let mut block = Partial::empty(rows.len());
                finish(chunk, 0, &mut block);
                for (r, row) in rows.iter_mut().enumerate() {
                    // Cannot fail: the row is 1032 bytes and `r` is a row of `block`.
                    let _ = block.write_wire_rows(r, row);
                }
            });
    }
}

/// Dense partial, every query row against every cache token.
pub(crate) fn partial_dense(q: &Queries<'_>, cache: &Cache<'_>, scale: f32, isa: Isa) -> Partial {
    let mut out = Partial::empty(q.len());
    if let Some(states) = dense_states(q, cache, scale, isa) {
        states.finish(&mut out);
    }
    out
}

/// [`partial_dense`] with its rows encoded for the wire into `out` (`q.len()` rows, checked by
/// the caller).
pub(crate) fn partial_dense_wire(
    q: &Queries<'_>,
    cache: &Cache<'_>,
    scale: f32,
    isa: Isa,
    out: &mut WireOut<'_>,
) -> Result<(), KernelError> {
    match dense_states(q, cache, scale, isa) {
        Some(states) => states.finish_wire(out),
        None => out.write(&Partial::empty(q.len()))?,
    }
    Ok(())
}

/// The dense partial's split states; `None` for an empty cache.
fn dense_states(q: &Queries<'_>, cache: &Cache<'_>, scale: f32, isa: Isa) -> Option<States> {
    let (mq, ct) = (q.len(), cache.tokens());
    if ct == 0 {
        return None;
    }
    let blocks: Vec<(usize, usize)> = (0..mq)
        .step_by(DENSE_ROWS)
        .map(|r0| (r0, (r0 + DENSE_ROWS).min(mq)))
        .collect();
    let tiles = ct.div_ceil(TILE);
    let nsplit = splits(blocks.len(), tiles);
    let tasks: Vec<(usize, usize)> = (0..blocks.len())
        .flat_map(|b| (0..nsplit).map(move |s| (b, s)))
        .collect();
    let states: Vec<RowState> = tasks
        .par_iter()
        .map(|&(b, s)| {
            let (r0, r1) = blocks[b];
            let t0 = (s * tiles / nsplit) * TILE;
            let t1 = (((s + 1) * tiles / nsplit) * TILE).min(ct);
            let mut st = RowState::new(r1 - r0);
            let rows = &q.as_slice()[r0 * D_QK..r1 * D_QK];
            with_scratch(|scratch| isa::dense(isa, rows, scale, cache, (t0, t1), &mut st, scratch));
            st
        })
        .collect();
    Some(States {
        states,
        split: nsplit,
        block: DENSE_ROWS,
    })
}

/// Sparse partial: each query token's rows against its selected tokens.
pub(crate) fn partial_sparse(
    q: &Queries<'_>,
    cache: &Cache<'_>,
    sel: &Selection<'_>,
    scale: f32,
    isa: Isa,
) -> Partial {
    let mut out = Partial::empty(q.len());
    sparse_states(q, cache, sel, scale, isa).finish(&mut out);
    out
}

/// [`partial_sparse`] with its rows encoded for the wire into `out` (`q.len()` rows, checked
/// by the caller).
pub(crate) fn partial_sparse_wire(
    q: &Queries<'_>,
    cache: &Cache<'_>,
    sel: &Selection<'_>,
    scale: f32,
    isa: Isa,
    out: &mut WireOut<'_>,
) {
    sparse_states(q, cache, sel, scale, isa).finish_wire(out);
}

/// The sparse partial's split states, one block per query token.
fn sparse_states(
    q: &Queries<'_>,
    cache: &Cache<'_>,
    sel: &Selection<'_>,
    scale: f32,
    isa: Isa,
) -> States {
    let mq = q.len();
    let h = sel.rows_per_token();
    let tokens = mq / h;
    let nsplit = splits(tokens, sel.k().div_ceil(TILE));
    let tasks: Vec<(usize, usize)> = (0..tokens)
        .flat_map(|t| (0..nsplit).map(move |s| (t, s)))
        .collect();
    let states: Vec<RowState> = tasks
        .par_iter()
        .map(|&(t, s)| {
            let picked = sel.of_row(t * h);
            let (i0, i1) = (s * picked.len() / nsplit, (s + 1) * picked.len() / nsplit);
            let rows = &q.as_slice()[t * h * D_QK..(t + 1) * h * D_QK];
            let mut st = RowState::new(h);
            with_scratch(|scratch| {
                isa::sparse(isa, rows, scale, cache, &picked[i0..i1], &mut st, scratch);
            });
            st
        })
        .collect();
    States {
        states,
        split: nsplit,
        block: h,
    }
}

/// The largest error, in ulp, of a vectorised `exp` (`N` lanes at a time) against `f32::exp`
/// over `[-110, 0]` where the result is a normal number; below that it must be at most
/// `f32::MIN_POSITIVE` (0 or a subnormal). Shared by the AVX2 and AVX-512 tests.
#[cfg(all(test, target_arch = "x86_64"))]
fn exp_worst_ulp<const N: usize>(exp: impl Fn([f32; N]) -> [f32; N]) -> u32 {
    let mut worst = 0u32;
    let mut x = 0f32;
    while x > -110.0 {
        let xs: [f32; N] = std::array::from_fn(|i| x - i as f32 * 1.37e-3);
        for (g, xi) in exp(xs).iter().zip(xs) {
            let want = xi.exp();
            if want >= f32::MIN_POSITIVE {
                worst = worst.max(g.to_bits().abs_diff(want.to_bits()));
            } else {
                assert!(*g <= f32::MIN_POSITIVE, "exp({xi}) = {g}");
            }
        }
        x -= 0.0219;
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_keeps_only_a_bounded_scratch_between_calls() {
        let tall = vec![0u16; 256 * D_QK];
        with_scratch(|s| {
            let (q, scores, ..) = s.for_block(&tall, 1.0, 256);
            assert_eq!((q.len(), scores.len()), (256 * D_QK, 256 * TILE));
        });
        SCRATCH.with_borrow(|s| {
            assert!(s.q.len() <= SCRATCH_KEEP && s.scores.len() <= SCRATCH_KEEP);
        });
        let usual = vec![0u16; 16 * D_QK];
        with_scratch(|s| {
            s.for_block(&usual, 1.0, 16);
        });
        SCRATCH.with_borrow(|s| assert!(s.q.len() >= 16 * D_QK, "a usual block's buffers stay"));
    }
}
