//! `kvroute bench kernels`: [`kvroute_kernels::bench`]'s measurements, with the targets they
//! are held to.

use std::fmt;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvroute_kernels::Backend;
use kvroute_kernels::bench::{Budget, KernelBench, dense_flops};
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

/// The CPU targets: the dense partial at small Mq near the read bandwidth, the splice in
/// place under a millisecond.
fn cpu_targets(m: &KernelBench) -> Vec<Target> {
    let worst_small = m
        .dense
        .iter()
        .filter(|r| r.mq <= 16)
        .map(|r| r.of_read_bandwidth)
        .fold(f64::INFINITY, f64::min);
    let in_place = m.splice.get(1).map_or(f64::NAN, |r| r.us);
    vec![
        Target {
            what: "dense partial, Mq <= 16, share of read bandwidth (%)",
            target: ">= 70",
            measured: 100.0 * worst_small,
            met: worst_small >= 0.7,
        },
        Target {
            what: "27 x 2048 splice in place (us)",
            target: "< 1000",
            measured: in_place,
            met: in_place < 1000.0,
        },
    ]
}

/// The GPU targets: both fused splices under 30 us.
fn gpu_targets(m: &KernelBench) -> Vec<Target> {
    let us = |i: usize| m.splice.get(i).map_or(f64::NAN, |r| r.us);
    vec![
        Target {
            what: "27 x 2048 fused splice, copying (us)",
            target: "< 30",
            measured: us(0),
            met: us(0) < 30.0,
        },
        Target {
            what: "27 x 2048 fused splice, in place (us)",
            target: "< 30",
            measured: us(1),
            met: us(1) < 30.0,
        },
    ]
}
