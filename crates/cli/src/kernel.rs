//! `kvroute kernel partial | merge | splice | gpu-info`: the kernels on `.npy` files, so a user
//! can check them against PyTorch or NumPy in a few lines. Float inputs are rounded to bf16 as
//! the wire would; `<u2` inputs are raw bf16 bits; outputs are f32.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use kvroute_kernels::layout::{D_QK, PAGE_TOKENS};
use kvroute_kernels::{
    Backend, Cache, Call, Partial, Queries, Rope, RopeLayout, Selection, SpliceJob, Yarn, cuda,
};
use serde::Serialize;

use crate::args::{KernelMergeArgs, KernelPartialArgs, KernelSpliceArgs, LayoutArg};
use kvroute_kernels::npy::{self, Array};

/// What a kernel command did.
#[derive(Debug, Clone, Serialize)]
pub struct KernelReport {
    /// `partial`, `merge` or `splice`.
    pub kernel: &'static str,
    /// What ran it (`cpu avx512`, `cuda NVIDIA H100 (sm_90)`, ...).
    pub backend: String,
    /// The shapes, in words.
    pub shapes: String,
    /// Files written.
    pub wrote: Vec<PathBuf>,
    /// Wall time of the kernel call (transfers to and from a GPU included), milliseconds.
    pub kernel_ms: f64,
}

impl fmt::Display for KernelReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} on {}: {} in {:.3} ms",
            self.kernel, self.backend, self.shapes, self.kernel_ms
        )?;
        for path in &self.wrote {
            writeln!(f, "  wrote {}", path.display())?;
        }
        Ok(())
    }
}

/// `--backend NAME` for `call`: the backend that runs it (`auto` resolved per call) and what
/// that is, in words.
fn backend(name: &str, call: Call) -> Result<(Backend, String)> {
    let backend = name
        .parse::<Backend>()
        .with_context(|| format!("--backend {name}"))?
        .resolve(call);
    let described =
        kvroute_kernels::describe(backend).with_context(|| format!("--backend {name}"))?;
    Ok((backend, described))
}

/// An array that must be 2-D with `cols` columns; returns its rows.
fn rows_of(a: &Array, what: &str, cols: usize) -> Result<usize> {
    match a.shape[..] {
        [rows, c] if c == cols => Ok(rows),
        _ => bail!("{what} must be [rows, {cols}], got shape {:?}", a.shape),
    }
}

fn read_indices(path: &Path, mq: usize, ct: usize) -> Result<(Vec<i32>, usize, usize)> {
    let a = Array::read(path)?;
    let [tokens, k] = a.shape[..] else {
        bail!(
            "--indices must be [Mq, k] (or [Mq / h, k]), got shape {:?}",
            a.shape
        );
    };
    ensure!(
        tokens > 0 && k > 0 && mq.is_multiple_of(tokens),
        "--indices has {tokens} rows of {k}: needs k > 0 and a row count dividing Mq = {mq} \
         (one row per query row, or per token of h = Mq / rows consecutive query rows)"
    );
    let indices = a
        .to_i64()
        .context("--indices")?
        .into_iter()
        .enumerate()
        .map(|(at, i)| {
            i32::try_from(i).ok().filter(|&i| i >= -1).with_context(|| {
                format!("--indices: entry {at} = {i} is outside -1..{ct} (-1 = padding)")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((indices, k, mq / tokens))
}

/// `kvroute kernel partial`.
pub(crate) fn partial(args: &KernelPartialArgs) -> Result<KernelReport> {
    // A misspelt backend is reported before any file is read; which one runs depends on the
    // query's rows.
    args.backend
        .parse::<Backend>()
        .with_context(|| format!("--backend {}", args.backend))?;
    let q = Array::read(&args.q)?;
    let mq = rows_of(&q, "--q", D_QK)?;
    let (backend, described) = backend(&args.backend, Call::Partial { rows: mq })?;
    let c = Array::read(&args.cache)?;
    let ct = rows_of(&c, "--cache", D_QK)?;
    let (q_bits, c_bits) = (q.to_bf16().context("--q")?, c.to_bf16().context("--cache")?);
    let queries = Queries::new(&q_bits)?;
    let cache = Cache::contiguous(&c_bits)?;
    let started = Instant::now();
    let (result, shapes) = match &args.indices {
        None => (
            kvroute_kernels::partial_dense(backend, &queries, &cache, args.scale)?,
            format!("dense Mq = {mq}, ct = {ct}"),
        ),
        Some(path) => {
            let (indices, k, h) = read_indices(path, mq, ct)?;
            let sel = Selection::new(&indices, k, h, mq, ct)?;
            (
                kvroute_kernels::partial_sparse(backend, &queries, &cache, &sel, args.scale)?,
                format!("sparse Mq = {mq}, top-k = {k} of ct = {ct}, {h} rows per index row"),
            )
        }
    };
    let kernel_ms = started.elapsed().as_secs_f64() * 1e3;
    Ok(KernelReport {
        kernel: "partial",
        backend: described,
        shapes,
        wrote: npy::write_partial(&args.out, &result)?,
        kernel_ms,
    })
}

/// `kvroute kernel merge`.
pub(crate) fn merge(args: &KernelMergeArgs) -> Result<KernelReport> {
    let (backend, described) = backend(&args.backend, Call::Merge)?;
    let parts = args
        .parts
        .iter()
        .map(|dir| npy::read_partial(dir).with_context(|| format!("partial {}", dir.display())))
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&Partial> = parts.iter().collect();
    let started = Instant::now();
    let merged = kvroute_kernels::merge_with(backend, &refs)?;
    let kernel_ms = started.elapsed().as_secs_f64() * 1e3;
    Ok(KernelReport {
        kernel: "merge",
        backend: described,
        shapes: format!("{} partials of {} rows", parts.len(), merged.rows()),
        wrote: npy::write_partial(&args.out, &merged)?,
        kernel_ms,
    })
}

fn positions(path: &Path, what: &str, n: usize) -> Result<Vec<i64>> {
    let a = Array::read(path)?;
    ensure!(
        a.shape == [n],
        "{what} must be [{n}] (one position per row), got {:?}",
        a.shape
    );
    a.to_i64().with_context(|| what.to_owned())
}

/// `kvroute kernel splice`: the rows re-rotated from `--from` to `--to` positions.
pub(crate) fn splice(args: &KernelSpliceArgs) -> Result<KernelReport> {
    let (backend, described) = backend(&args.backend, Call::Splice)?;
    let c = Array::read(&args.cache)?;
    let n = rows_of(&c, "--cache", D_QK)?;
    ensure!(n > 0, "--cache has no rows");
    let src = c.to_bf16().context("--cache")?;
    let (from, to) = (
        positions(&args.from, "--from", n)?,
        positions(&args.to, "--to", n)?,
    );
    let layout = match args.layout {
        LayoutArg::Interleaved => RopeLayout::Interleaved,
        LayoutArg::Half => RopeLayout::Half,
    };
    let rope = match args.yarn_factor {
        None => Rope::plain(args.theta, layout)?,
        Some(factor) => Rope::yarn(
            args.theta,
            Yarn {
                factor,
                beta_fast: args.beta_fast,
                beta_slow: args.beta_slow,
                original_max_positions: args.original_max,
            },
            layout,
        )?,
    };
    // One layer; the pool's pages in order, so the result is rows 0..n of the pool.
    let pages = n.div_ceil(PAGE_TOKENS);
    let table: Vec<u32> = (0..u32::try_from(pages)?).collect();
    let mut pool = vec![0u16; pages * PAGE_TOKENS * D_QK];
    let started = Instant::now();
    kvroute_kernels::splice(
        backend,
        SpliceJob::new(&src, 1, &from, &to, rope, &mut pool, &table)?,
    )?;
    let kernel_ms = started.elapsed().as_secs_f64() * 1e3;
    let out: Vec<f32> = pool[..n * D_QK]
        .iter()
        .map(|&b| kvroute_kernels::bf16::to_f32(b))
        .collect();
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    npy::write_f32(&args.out, &[n, D_QK], &out)?;
    Ok(KernelReport {
        kernel: "splice",
        backend: described,
        shapes: format!("{n} rows, {layout:?} RoPE"),
        wrote: vec![args.out.clone()],
        kernel_ms,
    })
}

/// `kvroute kernel gpu-info`: the GPU and what its kernels compiled to, or why there is none.
#[derive(Debug, Clone, Serialize)]
pub struct GpuReport {
    /// The device and the kernels' resources.
    pub gpu: cuda::GpuInfo,
}

impl fmt::Display for GpuReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = &self.gpu;
        writeln!(
            f,
            "GPU {}: {} ({}, {} SMs), NVRTC {}.{}",
            g.ordinal, g.name, g.arch, g.sms, g.nvrtc.0, g.nvrtc.1
        )?;
        writeln!(
            f,
            "  {:<12} {:>9} {:>11} {:>11} {:>12}",
            "kernel", "registers", "smem bytes", "local bytes", "spill st/ld"
        )?;
        // The driver's figures for the loaded kernels; spills from ptxas's report, which
        // NVRTC does not always give.
        for k in &g.loaded {
            let spills = g.resources.iter().find(|r| r.name == k.name).map_or_else(
                || "no report".to_owned(),
                |r| format!("{}/{}", r.spill_stores, r.spill_loads),
            );
            writeln!(
                f,
                "  {:<12} {:>9} {:>11} {:>11} {:>12}",
                k.name, k.registers, k.shared_bytes, k.local_bytes, spills
            )?;
        }
        Ok(())
    }
}

pub(crate) fn gpu_info() -> Result<GpuReport> {
    let gpu = cuda::Gpu::global().context("no usable GPU")?;
    Ok(GpuReport {
        gpu: gpu.info().clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{KernelMergeArgs, KernelPartialArgs, KernelSpliceArgs};
    use kvroute_kernels::workload::rows;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvroute-kernel-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn partial_args(d: &Path, indices: Option<PathBuf>, out: &str) -> KernelPartialArgs {
        KernelPartialArgs {
            q: d.join("q.npy"),
            cache: d.join("c.npy"),
            indices,
            scale: 0.1147,
            out: d.join(out),
            backend: "cpu".into(),
        }
    }

    /// The files in, the library's answer out: raw bf16 bits, f32 inputs rounded the same way,
    /// sparse indices as int64, a merge of two halves equal to the whole, and a splice.
    #[test]
    fn the_npy_commands_give_the_library_results() {
        let d = dir("roundtrip");
        let (mq, ct) = (4, 100);
        let (q, c) = (rows(mq, 1), rows(ct, 2));
        npy::write_u16(&d.join("q.npy"), &[mq, D_QK], &q).unwrap();
        npy::write_u16(&d.join("c.npy"), &[ct, D_QK], &c).unwrap();
        partial(&partial_args(&d, None, "whole")).unwrap();
        let got = npy::read_partial(&d.join("whole")).unwrap();
        let want = kvroute_kernels::partial_dense(
            Backend::Cpu,
            &Queries::new(&q).unwrap(),
            &Cache::contiguous(&c).unwrap(),
            0.1147,
        )
        .unwrap();
        assert_eq!(got, want);

        // The same cache as f32: rounded to the same bf16, the same answer.
        let cf: Vec<f32> = c
            .iter()
            .map(|&b| kvroute_kernels::bf16::to_f32(b))
            .collect();
        npy::write_f32(&d.join("c.npy"), &[ct, D_QK], &cf).unwrap();
        partial(&partial_args(&d, None, "whole_f32")).unwrap();
        assert_eq!(npy::read_partial(&d.join("whole_f32")).unwrap(), want);

        // Sparse: the first and second halves as selections, merged.
        for (name, range) in [("a", 0..50i64), ("b", 50..100)] {
            let idx: Vec<i64> = (0..mq).flat_map(|_| range.clone()).collect();
            npy::write_i64(&d.join(format!("i{name}.npy")), &[mq, 50], &idx).unwrap();
            let args = partial_args(&d, Some(d.join(format!("i{name}.npy"))), name);
            partial(&args).unwrap();
        }
        let merged = merge(&KernelMergeArgs {
            parts: vec![d.join("a"), d.join("b")],
            out: d.join("merged"),
            backend: "cpu".into(),
        })
        .unwrap();
        assert_eq!(merged.shapes, "2 partials of 4 rows");
        let m = npy::read_partial(&d.join("merged")).unwrap();
        let err =
            m.o.iter()
                .zip(&want.o)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
        assert!(err < 1e-5, "merged halves vs whole: {err}");

        // Splice to the same positions: the identity.
        let pos: Vec<i64> = (0..ct as i64).collect();
        npy::write_i64(&d.join("p.npy"), &[ct], &pos).unwrap();
        let args = KernelSpliceArgs {
            cache: d.join("c.npy"),
            from: d.join("p.npy"),
            to: d.join("p.npy"),
            theta: 10_000.0,
            yarn_factor: Some(40.0),
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max: 4096.0,
            layout: LayoutArg::Interleaved,
            out: d.join("r.npy"),
            backend: "reference".into(),
        };
        splice(&args).unwrap();
        assert_eq!(Array::read(&d.join("r.npy")).unwrap().to_f32().unwrap(), cf);
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn bad_files_and_arguments_are_errors() {
        let d = dir("bad");
        let (q, c) = (rows(2, 1), rows(10, 2));
        npy::write_u16(&d.join("q.npy"), &[2, D_QK], &q).unwrap();
        npy::write_u16(&d.join("c.npy"), &[10, D_QK], &c).unwrap();
        let err = |args: &KernelPartialArgs| format!("{:#}", partial(args).unwrap_err());
        // Index out of range, index rows not dividing Mq, a wrong width, a NaN scale, a
        // backend that does not exist, a missing file.
        npy::write_i64(&d.join("i.npy"), &[2, 1], &[0, 10]).unwrap();
        assert!(err(&partial_args(&d, Some(d.join("i.npy")), "o")).contains("outside"));
        npy::write_i64(&d.join("i3.npy"), &[3, 1], &[0, 1, 2]).unwrap();
        assert!(err(&partial_args(&d, Some(d.join("i3.npy")), "o")).contains("dividing"));
        npy::write_u16(&d.join("w.npy"), &[2, 575], &q[..2 * 575]).unwrap();
        let mut a = partial_args(&d, None, "o");
        a.q = d.join("w.npy");
        assert!(err(&a).contains("[rows, 576]"));
        let mut a = partial_args(&d, None, "o");
        a.scale = f32::NAN;
        assert!(err(&a).contains("softmax scale"));
        a.scale = 0.1;
        a.backend = "tpu".into();
        assert!(err(&a).contains("--backend tpu"));
        a.backend = "cpu".into();
        a.cache = d.join("missing.npy");
        assert!(err(&a).contains("missing.npy"));
        // A NaN in a query row, an infinity in a cache row (f32 files too): refused naming the
        // row, never an output of NaN or zeroed rows.
        let mut bad_q = q.clone();
        bad_q[D_QK + 3] = 0x7fc0;
        npy::write_u16(&d.join("nan_q.npy"), &[2, D_QK], &bad_q).unwrap();
        let mut cf: Vec<f32> = c
            .iter()
            .map(|&b| kvroute_kernels::bf16::to_f32(b))
            .collect();
        cf[4 * D_QK] = f32::INFINITY;
        npy::write_f32(&d.join("inf_c.npy"), &[10, D_QK], &cf).unwrap();
        for (qf, cfile, row) in [("nan_q.npy", "c.npy", 1), ("q.npy", "inf_c.npy", 0)] {
            for backend in ["cpu", "reference"] {
                let mut a = partial_args(&d, None, "nf");
                (a.q, a.cache, a.backend) = (d.join(qf), d.join(cfile), backend.into());
                let e = err(&a);
                assert!(
                    e.contains(&format!("query row {row}")) && e.contains("not finite"),
                    "{e}"
                );
                assert!(!d.join("nf").exists(), "an output was written");
            }
        }
        // A partial holding NaN is refused by merge, not merged into zeros.
        partial(&partial_args(&d, None, "good")).unwrap();
        let mut m = Array::read(&d.join("good").join("m.npy"))
            .unwrap()
            .to_f32()
            .unwrap();
        m[1] = f32::NAN;
        npy::write_f32(&d.join("good").join("m.npy"), &[2], &m).unwrap();
        let merged = merge(&KernelMergeArgs {
            parts: vec![d.join("good")],
            out: d.join("merged_nan"),
            backend: "cpu".into(),
        });
        let e = format!("{:#}", merged.unwrap_err());
        assert!(e.contains("row 1") && e.contains("finite"), "{e}");
        assert!(!d.join("merged_nan").exists());
        std::fs::remove_dir_all(&d).ok();
    }
}
