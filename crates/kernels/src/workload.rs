//! The benchmark workloads and their baselines, shared by the criterion bench
//! (`benches/kernels.rs`) and `kvroute bench kernels`, so both measure the same thing:
//!
//! - dense partial at ct = [`DENSE_CT`] for Mq in [`DENSE_MQ`], against the machine's read
//!   bandwidth ([`read_sum`] over a DRAM-sized buffer and over one chunk);
//! - sparse partial: one query token of [`SPARSE_HEADS`] heads, top-k in [`SPARSE_K`] of
//!   [`SPARSE_CT`];
//! - merge of [`MERGE_PARTS`] partials of [`MERGE_ROWS`] rows against [`sum_floor`] (adding the
//!   `o` arrays, no softmax);
//! - the dense partial's arithmetic against the machine's f32 FMA peak ([`fma_peak_gflops`]):
//!   from Mq ~ 4 up, a dense partial is compute-bound on a CPU;
//! - the [`SPLICE_LAYERS`] x [`SPLICE_TOKENS`] splice (paper 000 section 6.3's 27-layer,
//!   2048-token chunk, re-homed as a whole: stored at `0..n`, moved to `100000..`): copying
//!   against copying the same rows ([`SpliceWorkload::copy_rows`]), in place (what fetch runs
//!   after its paged writes) against touching the same RoPE bands
//!   ([`SpliceWorkload::touch_bands`]), and in place with a distinct delta per token.

use rayon::prelude::*;

use crate::layout::{D_QK, PAGE_TOKENS};
use crate::{Backend, Cache, KernelError, Partial, Queries, Rope, RopeLayout, SpliceJob, Yarn};

/// DeepSeek-V2-Lite's softmax scale (qk_head_dim 192, YaRN factor 40, mscale 0.707).
pub const SCALE: f32 = 0.1147;
/// Tokens of the dense chunk.
pub const DENSE_CT: usize = 2048;
/// Query rows of the dense runs.
pub const DENSE_MQ: [usize; 4] = [1, 16, 64, 256];
/// Tokens the sparse selection picks from.
pub const SPARSE_CT: usize = 8192;
/// Query rows (heads) of the one sparse query token.
pub const SPARSE_HEADS: usize = 16;
/// Selection sizes.
pub const SPARSE_K: [usize; 2] = [512, 2048];
/// Partials merged.
pub const MERGE_PARTS: usize = 8;
/// Rows per merged partial.
pub const MERGE_ROWS: usize = 256;
/// Tokens behind each merged partial.
pub const MERGE_CT: usize = 256;
/// Layers of the spliced chunk (DeepSeek-V2-Lite).
pub const SPLICE_LAYERS: usize = 27;
/// Tokens of the spliced chunk.
pub const SPLICE_TOKENS: usize = 2048;

/// One step of the 64-bit LCG (Knuth's MMIX constants) behind every deterministic input of
/// this crate: advances `state` and returns it (the high bits are the good ones).
pub(crate) fn lcg(state: &mut u64) -> u64 {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    *state
}

/// Deterministic bf16 rows ~ U(-2, 2), `n` of 576.
pub fn rows(n: usize, seed: u64) -> Vec<u16> {
    let mut s = seed;
    (0..n * D_QK)
        .map(|_| {
            let s = lcg(&mut s);
            crate::bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
        })
        .collect()
}

/// The read-bandwidth baseline: a parallel sum over `buf` (every byte read once).
pub fn read_sum(buf: &[u64]) -> u64 {
    buf.par_chunks(1 << 14)
        .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
        .reduce(|| 0, u64::wrapping_add)
}

/// Independent accumulators per thread of [`fma_peak_gflops`]: 12 cover the FMA latency
/// (4 cycles) on two ports.
const FMA_CHAINS: usize = 12;

/// The portable chains (what the scalar instruction set can do).
fn fma_chains(iters: usize) -> f32 {
    let mut acc = [0f32; FMA_CHAINS];
    let (a, b) = (
        std::hint::black_box(1.000_001f32),
        std::hint::black_box(1e-7f32),
    );
    for _ in 0..iters {
        for x in &mut acc {
            *x = x.mul_add(a, b);
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn fma_chains_avx512(iters: usize) -> f32 {
    use std::arch::x86_64::{_mm512_add_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps, _mm512_set1_ps};
    let (a, b) = (_mm512_set1_ps(1.000_001), _mm512_set1_ps(1e-7));
    let mut acc = [_mm512_set1_ps(0.0); FMA_CHAINS];
    for _ in 0..iters {
        for x in &mut acc {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    _mm512_reduce_add_ps(
        acc.iter()
            .fold(_mm512_set1_ps(0.0), |s, &x| _mm512_add_ps(s, x)),
    )
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_chains_avx2(iters: usize) -> f32 {
    use std::arch::x86_64::{_mm256_fmadd_ps, _mm256_set1_ps, _mm256_storeu_ps};
    let (a, b) = (_mm256_set1_ps(1.000_001), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_set1_ps(0.0); FMA_CHAINS];
    for _ in 0..iters {
        for x in &mut acc {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut lanes = [0f32; 8];
    let mut sum = 0.0;
    for x in acc {
        // SAFETY: `lanes` holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), x) };
        sum += lanes.iter().sum::<f32>();
    }
    sum
}

/// The f32 arithmetic peak of this machine for `isa`, GFLOP/s (a multiply-add counts 2): every
/// thread of the pool runs independent FMA chains for about `millis` milliseconds. The
/// compute roofline of the dense partial, whose rows multiply-add every cache element.
pub fn fma_peak_gflops(isa: crate::Isa, millis: u64) -> f64 {
    let run = |iters: usize| -> f32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: only when the CPU has the features (checked at run time).
            crate::Isa::Avx512 | crate::Isa::Avx512Bf16 if isa.is_available() => unsafe {
                fma_chains_avx512(iters)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            crate::Isa::Avx2 if isa.is_available() => unsafe { fma_chains_avx2(iters) },
            _ => fma_chains(iters),
        }
    };
    let threads = rayon::current_num_threads();
    // Calibrate one thread's iterations to the time asked for, then run them on all threads.
    let mut iters = 1 << 10;
    loop {
        let t = std::time::Instant::now();
        std::hint::black_box(run(iters));
        let took = t.elapsed().as_secs_f64();
        if took * 1e3 >= millis as f64 / 4.0 || iters >= 1 << 30 {
            iters = (iters as f64 * (millis as f64 / 1e3 / took.max(1e-9))).max(1.0) as usize;
            break;
        }
        iters *= 4;
    }
    let t = std::time::Instant::now();
    (0..threads).into_par_iter().for_each(|_| {
        std::hint::black_box(run(iters));
    });
    let lanes = match isa {
        crate::Isa::Avx512 | crate::Isa::Avx512Bf16 if isa.is_available() => 16,
        crate::Isa::Avx2 if isa.is_available() => 8,
        _ => 1,
    };
    let flops = 2.0 * (FMA_CHAINS * lanes * iters * threads) as f64;
    flops / t.elapsed().as_secs_f64() / 1e9
}

/// `k` selected tokens of `ct`, spread over the whole chunk (a stride coprime with it).
pub fn sparse_indices(k: usize, ct: usize) -> Vec<i32> {
    (0..k).map(|i| ((i * 7919) % ct) as i32).collect()
}

/// [`MERGE_PARTS`] CPU partials of [`MERGE_ROWS`] rows over [`MERGE_CT`] tokens each.
pub fn merge_parts() -> Result<Vec<Partial>, KernelError> {
    let cache_rows = rows(MERGE_CT * MERGE_PARTS, 5);
    let q_rows = rows(MERGE_ROWS, 6);
    let q = Queries::new(&q_rows)?;
    cache_rows
        .chunks(MERGE_CT * D_QK)
        .map(|c| crate::partial_dense(Backend::Cpu, &q, &Cache::contiguous(c)?, SCALE))
        .collect()
}

/// The merge's floor: adding the parts' `o` arrays (the bytes a merge must read, no softmax).
pub fn sum_floor(parts: &[Partial]) -> Vec<f32> {
    let mut out = vec![0f32; parts.first().map_or(0, |p| p.o.len())];
    for p in parts {
        for (o, x) in out.iter_mut().zip(&p.o) {
            *o += x;
        }
    }
    out
}

/// A splice of [`SPLICE_LAYERS`] x [`SPLICE_TOKENS`] rows re-homed from positions `i` to
/// `100000 + i` (one delta, as fetch re-homes a chunk) with DeepSeek's YaRN, into a pool
/// whose pages run backwards; [`SpliceWorkload::scattered`] gives every token its own delta.
#[derive(Debug)]
pub struct SpliceWorkload {
    /// Source rows `[layers, tokens, 576]`.
    pub src: Vec<u16>,
    /// Stored positions.
    pub from: Vec<i64>,
    /// New positions.
    pub to: Vec<i64>,
    /// The frequencies.
    pub rope: Rope,
    /// The destination pool.
    pub pool: Vec<u16>,
    /// Layer-major block table.
    pub table: Vec<u32>,
}

impl SpliceWorkload {
    /// The workload.
    pub fn new() -> Result<Self, KernelError> {
        let (layers, n) = (SPLICE_LAYERS, SPLICE_TOKENS);
        let pages = layers * n.div_ceil(PAGE_TOKENS);
        Ok(Self {
            src: rows(layers * n, 7),
            from: (0..n as i64).collect(),
            to: (0..n as i64).map(|i| 100_000 + i).collect(),
            rope: Rope::yarn(10_000.0, Yarn::DEEPSEEK, RopeLayout::Interleaved)?,
            pool: vec![0u16; pages * PAGE_TOKENS * D_QK],
            table: (0..pages as u32).rev().collect(),
        })
    }

    /// The job over this workload's buffers.
    pub fn job(&mut self) -> Result<SpliceJob<'_>, KernelError> {
        SpliceJob::new(
            &self.src,
            SPLICE_LAYERS,
            &self.from,
            &self.to,
            self.rope,
            &mut self.pool,
            &self.table,
        )
    }

    /// The same workload with stored positions `3 i`: a distinct delta (and angle table) per
    /// token. Its pool starts with the rows in it (as fetch's writes leave them), so an
    /// in-place job rotates real values, not zeros.
    pub fn scattered() -> Result<Self, KernelError> {
        let mut w = Self::new()?;
        w.from = (0..SPLICE_TOKENS as i64).map(|i| i * 3).collect();
        w.copy_rows();
        Ok(w)
    }

    /// The in-place job over this workload's pool (its rows as they are).
    pub fn in_place_job(&mut self) -> Result<SpliceJob<'_>, KernelError> {
        SpliceJob::in_place(
            SPLICE_LAYERS,
            &self.from,
            &self.to,
            self.rope,
            &mut self.pool,
            &self.table,
        )
    }

    /// The in-place splice's floor: reading and writing back (plus one) every RoPE band the
    /// job touches, in parallel: the same memory traffic without the rotation.
    pub fn touch_bands(&mut self) {
        self.pool
            .par_chunks_mut(PAGE_TOKENS * D_QK)
            .for_each(|page| {
                for row in page.chunks_exact_mut(D_QK) {
                    for x in &mut row[crate::layout::D_LATENT..] {
                        *x = x.wrapping_add(1);
                    }
                }
            });
    }

    /// Bytes one splice reads (and writes): every source row once.
    pub fn bytes(&self) -> usize {
        self.src.len() * 2
    }

    /// The splice's floor: copying the same rows page by page into the pool, in parallel.
    pub fn copy_rows(&mut self) {
        self.pool
            .par_chunks_mut(PAGE_TOKENS * D_QK)
            .zip(self.src.par_chunks(PAGE_TOKENS * D_QK))
            .for_each(|(d, s)| d[..s.len()].copy_from_slice(s));
    }
}
