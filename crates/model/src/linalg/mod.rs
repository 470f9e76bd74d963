//! The f32 arithmetic of the forward pass: `y = W x` for a batch of tokens over row-major
//! `[out, in]` weights, RMSNorm and SwiGLU.
//!
//! Every output element is one dot product whose order of operations depends only on the
//! input width, never on how many tokens are batched, which rows a thread got, or where in
//! the batch a token sits: a token decoded alone and the same token inside a prefill get the
//! same bits. Each dot runs 16 lanes side by side and sums them in a fixed tree.
//!
//! The batch is tiled 4 tokens at a time, so a weight row is read once per 4 tokens (a decode
//! step of 4 requests streams each weight once), and rows are split over rayon's threads when
//! the work is large enough to pay for it. The kernel runs with AVX2 + FMA intrinsics where
//! the CPU has them ([`avx2`]), in plain Rust elsewhere.
//!
//! A decode step is bound by streaming the weights, so a weight whose every value is a bf16
//! (all of a bf16 checkpoint's, and [`crate::Model::init`]'s) is also kept packed as bf16, and
//! the kernels read that: half the bytes, and the same bits out, since widening a bf16 to f32
//! is exact. For [`crate::ModelConfig::tiny`] that took a decode step of 4 requests from 5.6-7.7
//! ms to 2.9-4.0 ms on one core (64-token context; the machine the crate docs name).

use kvroute_kernels::bf16;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Lanes of one dot product's accumulator.
pub(crate) const LANES: usize = 16;
/// Tokens per tile: each weight row is read once per tile.
pub(crate) const TILE_TOKENS: usize = 4;
/// Multiply-adds below which a matmul stays on the calling thread.
const PARALLEL_MACS: usize = 1 << 20;

/// A row-major `[out, in]` weight, `y = W x`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Linear {
    pub(crate) out: usize,
    pub(crate) inp: usize,
    w: Vec<f32>,
    /// `w` as bf16 bits, when every value is one: what the kernels read.
    packed: Option<Vec<u16>>,
}

/// `tokens` rows of `width` values, row `t` at `data[t * stride..]` (a strided view, so that a
/// head's slice of a wider activation is used in place).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rows<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) stride: usize,
}

impl Rows<'_> {
    pub(crate) fn row(&self, t: usize, width: usize) -> &[f32] {
        &self.data[t * self.stride..t * self.stride + width]
    }
}

impl Linear {
    /// `[out, in]` weights `w` (`out * in` values, checked by the caller).
    pub(crate) fn new(out: usize, inp: usize, w: Vec<f32>) -> Self {
        let exact = w
            .iter()
            .all(|&x| bf16::to_f32(bf16::from_f32(x)).to_bits() == x.to_bits());
        let packed = exact.then(|| bf16::slice_from_f32(&w));
        Self {
            out,
            inp,
            w,
            packed,
        }
    }

    /// The weights, row-major.
    pub(crate) fn weights(&self) -> &[f32] {
        &self.w
    }

    /// `W x` for `tokens` contiguous rows of `x`, as a new `[tokens, out]` buffer.
    pub(crate) fn apply(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        let mut y = vec![0.0; tokens * self.out];
        let x = Rows {
            data: x,
            stride: self.inp,
        };
        self.apply_into(x, tokens, &mut y, self.out);
        y
    }

    /// `W x_t` into `y[t * y_stride..][..out]` for each of `tokens` rows of `x`.
    pub(crate) fn apply_into(&self, x: Rows<'_>, tokens: usize, y: &mut [f32], y_stride: usize) {
        if tokens == 0 || self.out == 0 {
            return;
        }
        let macs = self.out * self.inp * tokens;
        let threads = rayon::current_num_threads();
        if macs < PARALLEL_MACS || threads == 1 {
            kernel(self, x, 0..tokens, 0..self.out, |t, o, v| {
                y[t * y_stride + o] = v
            });
        } else if tokens >= 4 * TILE_TOKENS * threads {
            // A prefill: whole tiles of tokens per task, each writing its own rows of `y`.
            let per = tokens.div_ceil(2 * threads).next_multiple_of(TILE_TOKENS);
            y.par_chunks_mut(per * y_stride)
                .enumerate()
                .for_each(|(i, part)| {
                    let t0 = i * per;
                    let t1 = (t0 + per).min(tokens);
                    kernel(self, x, t0..t1, 0..self.out, |t, o, v| {
                        part[(t - t0) * y_stride + o] = v;
                    });
                });
        } else {
            // A decode step: output rows per task (each weight read once); a task's columns of
            // `y` are not a slice, so its results come back and are copied in.
            let per = self.out.div_ceil(4 * threads);
            let parts: Vec<(usize, Vec<f32>)> = (0..self.out)
                .step_by(per)
                .collect::<Vec<_>>()
                .into_par_iter()
                .map(|o0| {
                    let o1 = (o0 + per).min(self.out);
                    let mut part = vec![0.0; tokens * (o1 - o0)];
                    kernel(self, x, 0..tokens, o0..o1, |t, o, v| {
                        part[t * (o1 - o0) + o - o0] = v;
                    });
                    (o0, part)
                })
                .collect();
            for (o0, part) in parts {
                let n = part.len() / tokens;
                for t in 0..tokens {
                    y[t * y_stride + o0..][..n].copy_from_slice(&part[t * n..][..n]);
                }
            }
        }
    }
}

/// A weight value as the kernels read it: f32, or bf16 bits widened exactly.
pub(crate) trait Weight: Copy + Send + Sync {
    /// The value.
    fn value(self) -> f32;

    /// 16 values as two 8-lane f32 vectors.
    ///
    /// # Safety
    /// The CPU must have AVX2 (only [`avx2`]'s kernel calls it, behind the check).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load(chunk: &[Self; LANES]) -> avx2::Pair;
}

impl Weight for f32 {
    #[inline(always)]
    fn value(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load(chunk: &[Self; LANES]) -> avx2::Pair {
        // SAFETY: the caller guarantees AVX2.
        unsafe { avx2::load_f32(chunk) }
    }
}

impl Weight for u16 {
    #[inline(always)]
    fn value(self) -> f32 {
        bf16::to_f32(self)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load(chunk: &[Self; LANES]) -> avx2::Pair {
        // SAFETY: the caller guarantees AVX2.
        unsafe { avx2::load_bf16(chunk) }
    }
}

/// Output rows `rows` of `W x` for tokens `tokens`, handed to `put(token, row, value)`.
fn kernel(
    w: &Linear,
    x: Rows<'_>,
    tokens: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    put: impl FnMut(usize, usize, f32),
) {
    match &w.packed {
        Some(p) => kernel_of(p, w.inp, x, tokens, rows, put),
        None => kernel_of(&w.w, w.inp, x, tokens, rows, put),
    }
}

fn kernel_of<W: Weight>(
    w: &[W],
    n: usize,
    x: Rows<'_>,
    tokens: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    put: impl FnMut(usize, usize, f32),
) {
    #[cfg(target_arch = "x86_64")]
    {
        if *HAS_AVX2_FMA {
            // SAFETY: the CPU has AVX2 and FMA, all that `avx2::kernel` enables.
            unsafe { avx2::kernel(w, n, x, tokens, rows, put) };
            return;
        }
    }
    portable::kernel(w, n, x, tokens, rows, put);
}

#[cfg(target_arch = "x86_64")]
static HAS_AVX2_FMA: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
});

/// The kernel in plain Rust, for CPUs without AVX2 + FMA: the same lanes and tree, separate
/// multiplies and adds.
mod portable {
    use super::{LANES, Rows, Weight, reduce};

    pub(super) fn kernel<W: Weight>(
        w: &[W],
        n: usize,
        x: Rows<'_>,
        tokens: std::ops::Range<usize>,
        rows: std::ops::Range<usize>,
        mut put: impl FnMut(usize, usize, f32),
    ) {
        for t in tokens {
            let xt = x.row(t, n);
            for o in rows.clone() {
                put(t, o, dot(&w[o * n..(o + 1) * n], xt));
            }
        }
    }

    fn dot<W: Weight>(w: &[W], x: &[f32]) -> f32 {
        let (wc, wt) = w.as_chunks::<LANES>();
        let (xc, xt) = x.as_chunks::<LANES>();
        let mut acc = [0f32; LANES];
        for (w, x) in wc.iter().zip(xc) {
            for l in 0..LANES {
                acc[l] += w[l].value() * x[l];
            }
        }
        let mut s = reduce(acc);
        for (&w, &x) in wt.iter().zip(xt) {
            s += w.value() * x;
        }
        s
    }
}

/// The 16 lanes summed in a fixed pairwise tree.
#[inline(always)]
pub(crate) fn reduce(a: [f32; LANES]) -> f32 {
    let b: [f32; 8] = std::array::from_fn(|i| a[i] + a[i + 8]);
    let c: [f32; 4] = std::array::from_fn(|i| b[i] + b[i + 4]);
    (c[0] + c[2]) + (c[1] + c[3])
}

/// RMSNorm of each `weight.len()`-wide row of `x` (`x / sqrt(mean(x^2) + eps) * weight`), as
/// DeepSeek's `DeepseekV2RMSNorm` computes it in f32.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm_in_place(&mut out, weight, eps);
    out
}

/// [`rms_norm`] in place.
pub(crate) fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let width = weight.len();
    if width == 0 {
        return;
    }
    for row in x.chunks_exact_mut(width) {
        let mut lanes = [0f32; LANES];
        let body = width / LANES * LANES;
        for c in row[..body].chunks_exact(LANES) {
            for l in 0..LANES {
                lanes[l] += c[l] * c[l];
            }
        }
        let mut sum = reduce(lanes);
        for &v in &row[body..] {
            sum += v * v;
        }
        let inv = 1.0 / (sum / width as f32 + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(weight) {
            *v = *v * inv * g;
        }
    }
}

/// SwiGLU's gate: `silu(gate) * up`, into `gate`.
pub(crate) fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize, k: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * k).sin() * 3.0).round() / 4.0)
            .collect()
    }

    /// Small integers times quarters are exact in f32, so the kernel's result must equal the
    /// plain sum exactly, for widths with and without a tail past the 16 lanes.
    #[test]
    fn matmul_is_exact_on_representable_products() {
        for inp in [1, 15, 16, 37, 64] {
            let (out, tokens) = (7, 6);
            let w = Linear::new(out, inp, ramp(out * inp, 0.37));
            let x = ramp(tokens * inp, 0.11);
            let y = w.apply(&x, tokens);
            for t in 0..tokens {
                for o in 0..out {
                    let want: f32 = (0..inp)
                        .map(|i| w.weights()[o * inp + i] * x[t * inp + i])
                        .sum();
                    assert_eq!(y[t * out + o], want, "inp {inp} token {t} row {o}");
                }
            }
        }
    }

    /// A token's outputs do not depend on the batch around it, nor on the rows being split
    /// over threads: the property that makes a decoded token equal its prefilled self.
    #[test]
    fn a_tokens_outputs_are_the_same_bits_in_any_batch() {
        let (out, inp) = (300, 257);
        let w = Linear::new(
            out,
            inp,
            (0..out * inp).map(|i| (i as f32 * 0.013).sin()).collect(),
        );
        // 9 tokens split the rows over threads; 40 split the tokens.
        let x: Vec<f32> = (0..40 * inp).map(|i| (i as f32 * 0.029).cos()).collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for tokens in [9, 40] {
            let all = pool.install(|| w.apply(&x[..tokens * inp], tokens));
            for t in 0..tokens {
                let alone = w.apply(&x[t * inp..(t + 1) * inp], 1);
                assert_eq!(alone, all[t * out..(t + 1) * out], "token {t} of {tokens}");
            }
        }
    }

    #[test]
    fn rms_norm_gives_unit_rms_times_the_weight() {
        let x = [3.0f32, -4.0, 0.0, 5.0, 1.0, 1.0, 1.0, 1.0];
        let y = rms_norm(&x, &[1.0, 2.0, 1.0, 1.0], 0.0);
        let rms = (50.0f32 / 4.0).sqrt();
        assert!((y[0] - 3.0 / rms).abs() < 1e-6 && (y[1] + 8.0 / rms).abs() < 1e-6);
        assert_eq!(&y[4..], &[1.0, 2.0, 1.0, 1.0]);
    }
}
