//! `kvroute bench kernels`: [`kvroute_kernels::bench`]'s measurements, with the targets they
//! are held to.

use std::fmt;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvroute_kernels::Backend;
use kvroute_kernels::bench::{
    BatchedBench, BatchedKind, BatchedRow, Budget, DenseRow, KernelBench, TorchBaselines,
    batched_shapes, dense_flops, gpu_batched,
};
use kvroute_kernels::cuda::Gpu;
use kvroute_kernels::layout::D_QK;
use kvroute_kernels::workload as w;
use serde::Serialize;

use crate::args::KernelsBenchArgs;
use crate::bench::{Target, write_targets};

/// The measurements and the targets they are held to.
#[derive(Debug, Clone, Serialize)]
pub struct KernelsBenchReport {
    /// What was measured.
    #[serde(flatten)]
    pub measured: KernelBench,
    /// Targets.
    pub targets: Vec<Target>,
}

impl fmt::Display for KernelsBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.measured;
        writeln!(f, "kernels on {}", m.backend)?;
        write!(f, "read bandwidth baseline: {:.1} GB/s", m.read_gbps)?;
        if let Some(chunk) = m.chunk_read_gbps {
            write!(f, " (one 2.36 MB chunk, cache-resident: {chunk:.1} GB/s)")?;
        }
        if let Some(peak) = m.fma_gflops {
            write!(
                f,
                "\nf32 FMA peak baseline: {peak:.1} GFLOP/s (all threads)"
            )?;
        }
        writeln!(f, "\n\ndense partial, ct = {}", w::DENSE_CT)?;
        writeln!(
            f,
            "  {:>5} {:>10} {:>8} {:>9} {:>8} {:>7} {:>16}",
            "Mq", "us", "GB/s", "GFLOP/s", "of read", "of FMA", "speedup"
        )?;
        for r in &m.dense {
            let speedup = r.versus_us.map_or_else(
                || "-".to_owned(),
                |v| format!("{:.1}x {}", v / r.us, r.versus),
            );
            let of_fma = r
                .of_fma_peak
                .map_or_else(|| "-".to_owned(), |x| format!("{:.0}%", 100.0 * x));
            writeln!(
                f,
                "  {:>5} {:>10.1} {:>8.2} {:>9.1} {:>7.0}% {:>7} {:>16}",
                r.mq,
                r.us,
                r.gbps,
                r.gflops,
                100.0 * r.of_read_bandwidth,
                of_fma,
                speedup
            )?;
        }
        if let Some(peak) = m.fma_gflops {
            // The compute roofline: no kernel does a row's multiply-adds faster than the peak.
            for r in m.dense.iter().filter(|r| r.mq == 16) {
                let floor_us = dense_flops(r.mq) / peak / 1e3;
                let bytes = (w::DENSE_CT * D_QK * 2) as f64;
                writeln!(
                    f,
                    "  Mq = {} at the FMA peak: {floor_us:.1} us, at most {:.0}% of read bandwidth",
                    r.mq,
                    100.0 * bytes / floor_us / 1e3 / m.read_gbps
                )?;
            }
        }
        writeln!(
            f,
            "\nsparse partial, {} heads, of ct = {}",
            w::SPARSE_HEADS,
            w::SPARSE_CT
        )?;
        for r in &m.sparse {
            writeln!(
                f,
                "  top-{:<5} {:>10.1} us {:>8.2} GB/s   {:.1}x {}",
                r.k,
                r.us,
                r.gbps,
                r.versus_us / r.us,
                r.versus
            )?;
        }
        writeln!(f)?;
        for r in std::iter::once(&m.merge).chain(&m.splice).chain(&m.wire) {
            writeln!(
                f,
                "{:<40} {:>10.1} us   {} {:.1} us ({:.2}x)",
                r.what,
                r.us,
                r.floor,
                r.floor_us,
                r.us / r.floor_us
            )?;
        }
        write_targets(f, &self.targets, 1)
    }
}

/// `kvroute bench kernels`.
pub(crate) fn run(args: &KernelsBenchArgs) -> Result<KernelsBenchReport> {
    let backend: Backend = args.backend.parse()?;
    let budget = if args.quick {
        Budget {
            iters: 3,
            time: Duration::from_millis(50),
        }
    } else {
        Budget {
            iters: 20,
            time: Duration::from_millis(1500),
        }
    };
    let measured = match backend {
        Backend::Cuda => {
            kvroute_kernels::bench::gpu(&budget, Gpu::global().context("--backend cuda")?)?
        }
        Backend::Reference => bail!("--backend reference is the baseline, not a subject; use cpu"),
        _ => kvroute_kernels::bench::cpu(&budget, backend)?,
    };
    let targets = if backend == Backend::Cuda {
        gpu_targets(&measured)
    } else {
        cpu_targets(&measured)
    };
    Ok(KernelsBenchReport { measured, targets })
}

/// The CPU targets, each against a bound measured in the same run: the dense partial at
/// Mq = 1 near the read bandwidth, at Mq = 16 near whichever of the read bandwidth and the FMA
/// peak binds, at Mq = 256 near the FMA peak; the sparse partial's top-2048 of 16 heads (the
/// dense Mq = 16 call's rows x tokens) within 2x of that dense call; the in-place splice under
/// a millisecond; the merge within 2x of adding its o arrays.
fn cpu_targets(m: &KernelBench) -> Vec<Target> {
    let dense = |mq: usize| m.dense.iter().find(|r| r.mq == mq);
    let share = |mq: usize, of: fn(&DenseRow) -> f64| dense(mq).map_or(f64::NAN, |r| 100.0 * of(r));
    let sparse_over_dense = m
        .sparse
        .iter()
        .find(|r| r.k == 2048)
        .zip(dense(16))
        .map_or(f64::NAN, |(s, d)| s.us / d.us);
    let in_place = m.splice.get(1).map_or(f64::NAN, |r| r.us);
    let merge = m.merge.us / m.merge.floor_us;
    let (mq1, mq16, mq256) = (
        share(1, |r| r.of_read_bandwidth),
        share(16, bound),
        share(256, fma),
    );
    vec![
        Target::new(
            "dense partial Mq = 1, share of read bandwidth (%)",
            ">= 70",
            mq1,
            mq1 >= 70.0,
        ),
        Target::new(
            "dense partial Mq = 16, share of its bound (read or FMA peak, %)",
            ">= 70",
            mq16,
            mq16 >= 70.0,
        ),
        Target::new(
            "dense partial Mq = 256, share of the FMA peak (%)",
            ">= 70",
            mq256,
            mq256 >= 70.0,
        ),
        Target::new(
            "sparse top-2048 x 16 heads / dense Mq = 16 (same rows x tokens)",
            "<= 2",
            sparse_over_dense,
            sparse_over_dense <= 2.0,
        ),
        Target::new(
            "27 x 2048 splice in place (us)",
            "< 1000",
            in_place,
            in_place < 1000.0,
        ),
        Target::new(
            "merge 8 x 256 / adding its o arrays",
            "<= 2",
            merge,
            merge <= 2.0,
        ),
    ]
}

/// A dense row's share of the FMA peak (NaN where none was measured).
fn fma(r: &DenseRow) -> f64 {
    r.of_fma_peak.unwrap_or(f64::NAN)
}

/// A dense row's share of its time bound: the larger of the read time and the compute time at
/// the FMA peak, so the larger of the two shares.
fn bound(r: &DenseRow) -> f64 {
    r.of_read_bandwidth.max(fma(r))
}

/// The GPU targets: both fused splices under 30 us. A splice moves at least its bytes, so
/// each carries the same run's device copy of those bytes as its bound (the copying splice
/// reads and writes 63.7 MB, which no copy on an H100 or H200 moves in 30 us).
fn gpu_targets(m: &KernelBench) -> Vec<Target> {
    let target = |i: usize, what: &'static str| {
        let (us, floor) = m
            .splice
            .get(i)
            .map_or((f64::NAN, f64::NAN), |r| (r.us, r.floor_us));
        Target {
            bound: Some(format!(
                "a device copy of the bytes it moves takes {floor:.1} us"
            )),
            ..Target::new(what, "< 30", us, us < 30.0)
        }
    };
    vec![
        target(0, "27 x 2048 fused splice, copying (us)"),
        target(1, "27 x 2048 fused splice, in place (us)"),
    ]
}

/// `kvroute bench kernels --backend cuda --batched`: the batched kernels and their targets.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct BatchedReport {
    /// What was measured.
    #[serde(flatten)]
    pub measured: BatchedBench,
    /// Targets.
    pub targets: Vec<Target>,
}

impl fmt::Display for BatchedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.measured;
        writeln!(f, "batched paged decode on {}", m.device)?;
        writeln!(
            f,
            "roofline, this run: device copy {:.2} TB/s (read + write){}",
            m.copy_tbps,
            m.torch.as_ref().map_or_else(
                || "; no torch figures (--torch-baselines): compute shares and SDPA not shown"
                    .to_owned(),
                |t| format!(
                    "; torch {} bf16 matmul {:.0} TFLOP/s on {}",
                    t.torch, t.matmul_tflops, t.device
                )
            )
        )?;
        if let Some(us) = m.single_mq1_2048_us {
            writeln!(f, "one dense call, Mq = 1 over 2048 tokens: {us:.1} us")?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "  {:<9} {:>4} {:>3} {:>4} {:>5} {:>2} {:>10} {:>9} {:>6} {:>8} {:>8} {:>8} {:>9} {:>7}",
            "kind",
            "b",
            "s_q",
            "h_q",
            "s_k",
            "MT",
            "grid",
            "us",
            "TB/s",
            "TFLOP/s",
            "bound",
            "of roof",
            "SDPA us",
            "x SDPA"
        )?;
        for r in &m.rows {
            let s = &r.shape;
            let kind = match s.kind {
                BatchedKind::Dense => "dense",
                BatchedKind::Sparse => "top2k",
                BatchedKind::SparseFp8 => "top2k fp8",
            };
            let (sdpa, x) = r.sdpa_us.map_or(("-".to_owned(), "-".to_owned()), |t| {
                (format!("{t:.1}"), format!("{:.1}x", t / r.us))
            });
            writeln!(
                f,
                "  {:<9} {:>4} {:>3} {:>4} {:>5} {:>2} {:>10} {:>9.1} {:>6.2} {:>8.1} {:>8} {:>7.0}% {:>9} {:>7}",
                kind,
                s.b,
                s.s_q,
                s.h_q,
                s.s_k,
                r.row_tiles,
                format!("{}x{}", r.grid.0, r.grid.1),
                r.us,
                r.tbps,
                r.tflops,
                r.bound,
                100.0 * r.of_roofline,
                sdpa,
                x
            )?;
        }
        write_targets(f, &self.targets, 1)
    }
}

/// `kvroute bench kernels --backend cuda --batched [--torch-baselines FILE]`.
pub(crate) fn batched(args: &KernelsBenchArgs) -> Result<BatchedReport> {
    let backend: Backend = args.backend.parse()?;
    if backend != Backend::Cuda {
        bail!("--batched measures the CUDA kernels: pass --backend cuda");
    }
    let torch = args
        .torch_baselines
        .as_ref()
        .map(|path| -> Result<TorchBaselines> {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--torch-baselines {}", path.display()))?;
            serde_json::from_str(&text).with_context(|| {
                format!(
                    "--torch-baselines {}: not torch_baselines.py's JSON",
                    path.display()
                )
            })
        })
        .transpose()?;
    let gpu = Gpu::global().context("--backend cuda")?;
    let mut shapes = batched_shapes();
    if let Some(only) = &args.only {
        shapes.retain(|s| s.label() == *only);
        if shapes.is_empty() {
            bail!(
                "--only {only:?} names no shape of the grid (e.g. {:?})",
                batched_shapes()[0].label()
            );
        }
    }
    let measured = gpu_batched(gpu, args.quick, (&shapes, args.only.is_none()), torch)?;
    let targets = batched_targets(&measured);
    Ok(BatchedReport { measured, targets })
}

/// The batched targets (same-run ratios): memory-bound rows (h_q x s_q <= 32) at 60% of the
/// copy rate, compute-bound rows (>= 128) at 40% of torch's matrix rate, FP8 sparse rows of
/// 128 rows a query token or more at 25% of it, every row 3x faster than SDPA on the same
/// shape, and one Mq = 1 call over 2048 tokens under 8 us. Each ratio target is the worst row.
fn batched_targets(m: &BatchedBench) -> Vec<Target> {
    let per_token = |r: &BatchedRow| r.shape.h_q * r.shape.s_q;
    let worst = |pick: &dyn Fn(&BatchedRow) -> Option<f64>| {
        m.rows.iter().filter_map(pick).fold(f64::INFINITY, f64::min)
    };
    let mem = worst(&|r| (per_token(r) <= 32).then(|| r.tbps / m.copy_tbps));
    let cmp = worst(&|r| {
        (per_token(r) >= 128 && r.shape.kind != BatchedKind::SparseFp8)
            .then_some(r.of_matmul)
            .flatten()
    });
    let fp8 = worst(&|r| {
        (per_token(r) >= 128 && r.shape.kind == BatchedKind::SparseFp8)
            .then_some(r.of_matmul)
            .flatten()
    });
    let sdpa = worst(&|r| r.sdpa_us.map(|t| t / r.us));
    let pct = |x: f64| if x.is_finite() { 100.0 * x } else { f64::NAN };
    let x = |v: f64| if v.is_finite() { v } else { f64::NAN };
    vec![
        Target::new(
            "memory-bound rows (h_q x s_q <= 32), worst share of the copy rate (%)",
            ">= 60",
            pct(mem),
            mem >= 0.6,
        ),
        Target::new(
            "compute-bound rows (h_q x s_q >= 128), worst share of torch's matmul rate (%)",
            ">= 40",
            pct(cmp),
            cmp.is_finite() && cmp >= 0.4,
        ),
        Target::new(
            "sparse top-2048 FP8 (h_q x s_q >= 128), worst share of the matmul rate (%)",
            ">= 25",
            pct(fp8),
            fp8.is_finite() && fp8 >= 0.25,
        ),
        Target::new(
            "every row against SDPA on the same shape, worst speedup",
            ">= 3",
            x(sdpa),
            sdpa.is_finite() && sdpa >= 3.0,
        ),
        Target::new(
            "one dense call, Mq = 1 over 2048 tokens (us)",
            "< 8",
            m.single_mq1_2048_us.unwrap_or(f64::NAN),
            m.single_mq1_2048_us.is_some_and(|us| us < 8.0),
        ),
    ]
}
