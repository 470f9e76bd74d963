//! The kernels' benchmark workloads ([`crate::workload`], the same the criterion bench runs),
//! each beside its baseline measured in the same run (behind the `bench` feature; `kvroute
//! bench kernels` prints them):
//! - CPU: the dense partial's cache bytes per second against the machine's read bandwidth (a
//!   parallel sum over 256 MiB), its arithmetic against the machine's f32 FMA peak (its
//!   compute roofline), and the f64 reference; the sparse partial against the reference; the
//!   merge against adding the `o` arrays; the copying splice against copying its rows, the
//!   in-place splice against touching the same RoPE bands.
//! - CUDA: the kernels on resident inputs (CUDA events) against a device-to-device copy's
//!   traffic and the CPU path; the merge host to host (its transfers included).

use std::hint::black_box;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cuda::Gpu;
use crate::layout::{D_QK, PARTIAL_ROW_BYTES};
use crate::workload::{self as w, SCALE, rows};
use crate::{Backend, Cache, KernelError, Partial, Queries, Selection, WireOut, WirePartial};

type Result<T, E = KernelError> = std::result::Result<T, E>;

/// One dense row of the report.
#[derive(Debug, Clone, Serialize)]
pub struct DenseRow {
    /// Query rows.
    pub mq: usize,
    /// Median time per call, microseconds.
    pub us: f64,
    /// Cache bytes read per second, GB/s.
    pub gbps: f64,
    /// Arithmetic rate: 2 Mq ct (576 + 512) flops per call, GFLOP/s.
    pub gflops: f64,
    /// `gbps` as a share of the read-bandwidth baseline.
    pub of_read_bandwidth: f64,
    /// `gflops` as a share of the FMA-peak baseline (CPU only).
    pub of_fma_peak: Option<f64>,
    /// What the speedup is against (`reference`, or `cpu` for CUDA).
    pub versus: &'static str,
    /// That baseline's time, microseconds (absent where it was not run: too slow to matter).
    pub versus_us: Option<f64>,
}

/// One sparse row.
#[derive(Debug, Clone, Serialize)]
pub struct SparseRow {
    /// Selected tokens.
    pub k: usize,
    /// Median time per call, microseconds.
    pub us: f64,
    /// Selected cache bytes per second, GB/s.
    pub gbps: f64,
    /// What the speedup is against.
    pub versus: &'static str,
    /// That baseline's time, microseconds.
    pub versus_us: f64,
}

/// A kernel beside its floor.
#[derive(Debug, Clone, Serialize)]
pub struct FloorRow {
    /// What ran.
    pub what: String,
    /// Median time, microseconds.
    pub us: f64,
    /// The floor (the same bytes moved without the kernel's arithmetic), microseconds.
    pub floor_us: f64,
    /// What the floor is.
    pub floor: &'static str,
}

/// `kvroute bench kernels`.
#[derive(Debug, Clone, Serialize)]
pub struct KernelBench {
    /// What ran the kernels.
    pub backend: String,
    /// The read-bandwidth baseline, GB/s (CPU: parallel sum over 256 MiB; CUDA: a device
    /// copy's read + write traffic).
    pub read_gbps: f64,
    /// The same sum over one ct = 2048 chunk (cache-resident; CPU only).
    pub chunk_read_gbps: Option<f64>,
    /// The f32 FMA peak of all threads, GFLOP/s (CPU only).
    pub fma_gflops: Option<f64>,
    /// Dense partial at ct = 2048.
    pub dense: Vec<DenseRow>,
    /// Sparse partial, one token of 16 heads, top-k of 8192.
    pub sparse: Vec<SparseRow>,
    /// Merge of 8 partials of 256 rows.
    pub merge: FloorRow,
    /// The 27 x 2048 splice: copying, in place, in place with a delta per token.
    pub splice: Vec<FloorRow>,
    /// The wire paths against their unfused baselines, same run (CPU only): the dense partial
    /// writing its wire rows in its epilogue against the f32 partial then its encode; the
    /// merge reading wire rows against decoding them and merging.
    pub wire: Vec<FloorRow>,
}

/// Median microseconds per call of `f` over at least `min_iters` calls and `min_time`.
pub fn median_us(min_iters: usize, min_time: Duration, mut f: impl FnMut()) -> f64 {
    f(); // warm caches and thread pools
    let started = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < min_iters || started.elapsed() < min_time {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    kvroute_costmodel::fit::median(&mut samples).unwrap_or(f64::NAN)
}

/// How long each measurement runs: at least `iters` calls and `time`.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// Calls at least.
    pub iters: usize,
    /// Time at least.
    pub time: Duration,
}

/// Floating-point operations of the dense partial over the bench chunk at `mq` rows.
pub fn dense_flops(mq: usize) -> f64 {
    2.0 * mq as f64 * w::DENSE_CT as f64 * (D_QK + crate::layout::D_LATENT) as f64
}

/// The CPU kernels of `backend` (a CPU backend: [`Backend::Auto`] would move calls between
/// the CPU and a GPU by their size).
pub fn cpu(budget: &Budget, backend: Backend) -> Result<KernelBench> {
    if !matches!(backend, Backend::Cpu | Backend::CpuWith(_)) {
        return Err(KernelError::Parameter {
            what: "bench backend",
            value: f64::NAN,
            why: "the CPU bench takes cpu or an instruction set",
        });
    }
    let described = crate::describe(backend)?;
    let dram_bytes = 256usize << 20;
    let big: Vec<u64> = (0..dram_bytes / 8).map(|i| i as u64).collect();
    let read_us = median_us(budget.iters, budget.time, || {
        black_box(w::read_sum(&big));
    });
    drop(big);
    let chunk_bytes = w::DENSE_CT * D_QK * 2;
    let chunk: Vec<u64> = (0..chunk_bytes / 8).map(|i| i as u64).collect();
    let chunk_us = median_us(budget.iters, budget.time, || {
        black_box(w::read_sum(&chunk));
    });
    let read_gbps = dram_bytes as f64 / read_us / 1e3;
    let isa = match backend {
        Backend::CpuWith(isa) => isa,
        _ => crate::Isa::detect(),
    };
    let fma_gflops = w::fma_peak_gflops(isa, budget.time.as_millis() as u64 / 3 + 20);

    let cache_rows = rows(w::DENSE_CT, 1);
    let cache = Cache::contiguous(&cache_rows)?;
    let mut dense = Vec::new();
    for mq in w::DENSE_MQ {
        let q_rows = rows(mq, 2);
        let q = Queries::new(&q_rows)?;
        let call = |b| crate::partial_dense(b, &q, &cache, SCALE).map(black_box);
        call(backend)?;
        let us = median_us(budget.iters, budget.time, || {
            let _ = call(backend);
        });
        let versus_us = (mq <= 16).then(|| {
            median_us(budget.iters.min(5), budget.time / 2, || {
                let _ = call(Backend::Reference);
            })
        });
        let gbps = chunk_bytes as f64 / us / 1e3;
        dense.push(DenseRow {
            mq,
            us,
            gbps,
            gflops: dense_flops(mq) / us / 1e3,
            of_read_bandwidth: gbps / read_gbps,
            of_fma_peak: Some(dense_flops(mq) / us / 1e3 / fma_gflops),
            versus: "reference",
            versus_us,
        });
    }

    let sparse = sparse_rows(
        budget,
        |q, cache, sel| {
            let call = || crate::partial_sparse(backend, q, cache, sel, SCALE);
            call()?;
            Ok(median_us(budget.iters, budget.time, || {
                let _ = black_box(call());
            }))
        },
        Backend::Reference,
        "reference",
    )?;

    let parts = w::merge_parts()?;
    let refs: Vec<_> = parts.iter().collect();
    let merge = FloorRow {
        what: format!("merge {}x{} rows", w::MERGE_PARTS, w::MERGE_ROWS),
        us: median_us(budget.iters, budget.time, || {
            let _ = black_box(crate::merge(&refs));
        }),
        floor_us: median_us(budget.iters, budget.time, || {
            black_box(w::sum_floor(&parts));
        }),
        floor: "adding the o arrays",
    };

    let mut work = w::SpliceWorkload::new()?;
    let name = format!("splice {}x{}", w::SPLICE_LAYERS, w::SPLICE_TOKENS);
    let copying = FloorRow {
        what: format!("{name}, copying"),
        us: median_us(budget.iters, budget.time, || {
            if let Ok(job) = work.job() {
                let _ = crate::splice(backend, job);
            }
        }),
        floor_us: median_us(budget.iters, budget.time, || work.copy_rows()),
        floor: "copying the rows",
    };
    let in_place = |work: &mut w::SpliceWorkload, what: String| FloorRow {
        what,
        us: median_us(budget.iters, budget.time, || {
            if let Ok(job) = work.in_place_job() {
                let _ = crate::splice(backend, job);
            }
        }),
        floor_us: median_us(budget.iters, budget.time, || work.touch_bands()),
        floor: "touching the RoPE bands",
    };
    let splice = vec![
        copying,
        in_place(&mut work, format!("{name}, in place")),
        in_place(
            &mut w::SpliceWorkload::scattered()?,
            format!("{name}, in place, a delta per token"),
        ),
    ];

    let wire = wire_rows(budget, backend, &cache, &parts)?;

    Ok(KernelBench {
        backend: described,
        read_gbps,
        chunk_read_gbps: Some(chunk_bytes as f64 / chunk_us / 1e3),
        fma_gflops: Some(fma_gflops),
        dense,
        sparse,
        merge,
        splice,
        wire,
    })
}

/// The wire paths (see [`KernelsBenchReport::wire`]).
fn wire_rows(
    budget: &Budget,
    backend: Backend,
    cache: &Cache<'_>,
    parts: &[Partial],
) -> Result<Vec<FloorRow>> {
    let mq = w::MERGE_ROWS;
    let q_rows = rows(mq, 3);
    let q = Queries::new(&q_rows)?;
    let mut bytes = vec![0u8; mq * PARTIAL_ROW_BYTES];
    let fused = FloorRow {
        what: format!("dense {mq} x {} into wire rows", w::DENSE_CT),
        us: median_us(budget.iters, budget.time, || {
            if let Ok(mut out) = WireOut::new([&mut bytes[..]]) {
                let _ = crate::partial_dense_wire(backend, &q, cache, SCALE, &mut out);
            }
        }),
        floor_us: median_us(budget.iters, budget.time, || {
            if let Ok(p) = crate::partial_dense(backend, &q, cache, SCALE) {
                let _ = black_box(p.write_wire(&mut bytes));
            }
        }),
        floor: "baseline: the f32 partial, then its encode",
    };
    let wires: Vec<Vec<u8>> = parts.iter().map(Partial::to_wire).collect();
    let views = wires
        .iter()
        .map(|b| WirePartial::new(b))
        .collect::<Result<Vec<_>, _>>()?;
    let mut merged = Partial::empty(0);
    let mut decoded: Vec<Partial> = parts.to_vec();
    let merge_wire = FloorRow {
        what: format!("merge {}x{mq} wire rows", parts.len()),
        us: median_us(budget.iters, budget.time, || {
            let _ = black_box(crate::merge_wire(&views, &mut merged));
        }),
        floor_us: median_us(budget.iters, budget.time, || {
            for (p, b) in decoded.iter_mut().zip(&wires) {
                let _ = p.read_wire(b);
            }
            let _ = black_box(crate::merge(&decoded.iter().collect::<Vec<_>>()));
        }),
        floor: "baseline: decode each, then merge",
    };
    Ok(vec![fused, merge_wire])
}

/// The sparse workloads, each timed by `subject` (microseconds per call) beside `versus`
/// (a host-to-host call, median).
fn sparse_rows(
    budget: &Budget,
    mut subject: impl FnMut(&Queries<'_>, &Cache<'_>, &Selection<'_>) -> Result<f64>,
    versus: Backend,
    versus_name: &'static str,
) -> Result<Vec<SparseRow>> {
    let (ct, h) = (w::SPARSE_CT, w::SPARSE_HEADS);
    let cache_rows = rows(ct, 3);
    let cache = Cache::contiguous(&cache_rows)?;
    let q_rows = rows(h, 4);
    let q = Queries::new(&q_rows)?;
    let mut out = Vec::new();
    for k in w::SPARSE_K {
        let idx = w::sparse_indices(k, ct);
        let sel = Selection::new(&idx, k, h, h, ct)?;
        let us = subject(&q, &cache, &sel)?;
        out.push(SparseRow {
            k,
            us,
            gbps: (k * D_QK * 2) as f64 / us / 1e3,
            versus: versus_name,
            versus_us: median_us(budget.iters.min(5), budget.time / 2, || {
                let _ = crate::partial_sparse(versus, &q, &cache, &sel, SCALE);
            }),
        });
    }
    Ok(out)
}

/// The CUDA kernels on `gpu`.
pub fn gpu(budget: &Budget, gpu: &Gpu) -> Result<KernelBench> {
    let iters = budget.iters.max(20) * 5;
    let copy_bytes = 256usize << 20;
    let copy_us = gpu.time_copy_us(copy_bytes, iters)?;
    // A copy reads and writes every byte: its traffic is the device's achievable bandwidth.
    let read_gbps = 2.0 * copy_bytes as f64 / copy_us / 1e3;
    let chunk_bytes = w::DENSE_CT * D_QK * 2;
    let cache_rows = rows(w::DENSE_CT, 1);
    let cache = Cache::contiguous(&cache_rows)?;
    let mut dense = Vec::new();
    for mq in w::DENSE_MQ {
        let q_rows = rows(mq, 2);
        let q = Queries::new(&q_rows)?;
        let mut prepared = gpu.prepare_partial(&q, &cache, None, SCALE)?;
        let us = gpu.time_us(iters, || gpu.launch_partial(&mut prepared))?;
        let versus_us = median_us(budget.iters, budget.time, || {
            let _ = crate::partial_dense(Backend::Cpu, &q, &cache, SCALE);
        });
        let gbps = chunk_bytes as f64 / us / 1e3;
        dense.push(DenseRow {
            mq,
            us,
            gbps,
            gflops: dense_flops(mq) / us / 1e3,
            of_read_bandwidth: gbps / read_gbps,
            of_fma_peak: None,
            versus: "cpu",
            versus_us: Some(versus_us),
        });
    }
    // Sparse on resident inputs.
    let sparse = sparse_rows(
        budget,
        |q, cache, sel| {
            let mut prepared = gpu.prepare_partial(q, cache, Some(sel), SCALE)?;
            gpu.time_us(iters, || gpu.launch_partial(&mut prepared))
        },
        Backend::Cpu,
        "cpu",
    )?;
    let parts = w::merge_parts()?;
    let refs: Vec<_> = parts.iter().collect();
    let merge = FloorRow {
        what: format!("merge {}x{} (host to host)", w::MERGE_PARTS, w::MERGE_ROWS),
        us: median_us(budget.iters, budget.time, || {
            let _ = black_box(gpu.merge(&refs));
        }),
        floor_us: median_us(budget.iters, budget.time, || {
            let _ = black_box(crate::merge(&refs));
        }),
        floor: "the CPU merge",
    };
    let mut work = w::SpliceWorkload::new()?;
    let mut splice = Vec::new();
    for in_place in [false, true] {
        let job = if in_place {
            work.in_place_job()?
        } else {
            work.job()?
        };
        let mut prepared = gpu.prepare_splice(&job)?;
        let us = gpu.time_us(iters, || gpu.launch_splice(&mut prepared))?;
        let moved = prepared.bytes_moved();
        splice.push(FloorRow {
            what: format!(
                "splice {}x{} {} (one launch)",
                w::SPLICE_LAYERS,
                w::SPLICE_TOKENS,
                if in_place { "in place" } else { "copying" }
            ),
            us,
            floor_us: gpu.time_copy_us(moved / 2, iters)?,
            floor: "device copy of the bytes it moves",
        });
    }
    Ok(KernelBench {
        backend: crate::describe(Backend::Cuda)?,
        read_gbps,
        chunk_read_gbps: None,
        fma_gflops: None,
        dense,
        sparse,
        merge,
        wire: Vec::new(),
        splice,
    })
}

/// What a row of the batched bench attends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BatchedKind {
    /// Every context token, bf16 rows.
    Dense,
    /// A top-k selection per query token, bf16 rows.
    Sparse,
    /// A top-k selection per query token, FP8 rows ([`crate::fp8`]).
    SparseFp8,
}

/// One shape of FlashMLA's decode benchmark: `b` requests of `s_q` new tokens x `h_q` heads
/// over `s_k` context tokens in blocks of 64, dense or sparse top-`topk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct BatchedShape {
    /// Requests.
    pub b: usize,
    /// New tokens per request.
    pub s_q: usize,
    /// Query heads.
    pub h_q: usize,
    /// Context tokens per request.
    pub s_k: usize,
    /// Selected tokens per query token (sparse rows).
    pub topk: Option<usize>,
    /// Dense, sparse over bf16, or sparse over FP8.
    pub kind: BatchedKind,
}

/// Tokens per block of the batched bench's pool (FlashMLA's).
pub const BATCHED_BLOCK: usize = 64;
/// The sparse rows' selection size (DeepSeek-V3.2's top-k).
pub const BATCHED_TOPK: usize = 2048;

impl BatchedShape {
    /// The shape in words, as `--only` takes it: `dense b=64 s_q=1 h_q=16 s_k=4096`
    /// (`sparse` or `sparse-fp8` for the top-k rows).
    pub fn label(&self) -> String {
        let kind = match self.kind {
            BatchedKind::Dense => "dense",
            BatchedKind::Sparse => "sparse",
            BatchedKind::SparseFp8 => "sparse-fp8",
        };
        format!(
            "{kind} b={} s_q={} h_q={} s_k={}",
            self.b, self.s_q, self.h_q, self.s_k
        )
    }

    /// Query rows of the batch.
    pub fn rows(&self) -> usize {
        self.b * self.s_q * self.h_q
    }

    /// Keys each query row attends.
    pub fn keys(&self) -> usize {
        self.topk.unwrap_or(self.s_k)
    }

    /// Floating-point operations: 2 x rows x keys x (576 + 512), QK^T and PV.
    pub fn flops(&self) -> f64 {
        2.0 * self.rows() as f64 * self.keys() as f64 * (D_QK + crate::layout::D_LATENT) as f64
    }

    /// The fewest bytes a call moves: each attended cache row read once (a dense request's
    /// context once for all its rows; a sparse query token's selected rows once for its heads,
    /// with their indices), the query rows read and the f32 partials written.
    pub fn bytes(&self) -> f64 {
        let row = match self.kind {
            BatchedKind::SparseFp8 => crate::fp8::FP8_ROW_BYTES,
            _ => D_QK * 2,
        };
        let cache = match self.topk {
            None => self.b * self.s_k * row,
            Some(k) => self.b * self.s_q * k * (row + 4),
        };
        let io = self.rows() * (D_QK * 2 + (crate::layout::D_LATENT + 2) * 4);
        (cache + io) as f64
    }
}

/// FlashMLA's benchmark grid (its `tests/test_flash_mla*.py` decode shapes): b = 64 and 128,
/// s_q = 1 and 2, h_q = 16, 64 and 128, s_k = 4096 and 8192; dense over bf16, then sparse
/// top-2048 over bf16 and over FP8. `scripts/torch_baselines.py` measures SDPA on the same grid.
pub fn batched_shapes() -> Vec<BatchedShape> {
    let mut out = Vec::new();
    for kind in [
        BatchedKind::Dense,
        BatchedKind::Sparse,
        BatchedKind::SparseFp8,
    ] {
        for b in [64, 128] {
            for s_q in [1, 2] {
                for h_q in [16, 64, 128] {
                    for s_k in [4096, 8192] {
                        let topk = (kind != BatchedKind::Dense).then_some(BATCHED_TOPK);
                        out.push(BatchedShape {
                            b,
                            s_q,
                            h_q,
                            s_k,
                            topk,
                            kind,
                        });
                    }
                }
            }
        }
    }
    out
}

/// PyTorch's figures for the same grid, measured by `scripts/torch_baselines.py` on the same
/// GPU in the same run: its bf16 matrix-product rate (the compute roofline), its device copy
/// rate, and SDPA's time per shape.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct TorchBaselines {
    /// torch's version.
    pub torch: String,
    /// The device torch saw.
    pub device: String,
    /// An 8192^3 bf16 matrix product on random data, TFLOP/s.
    pub matmul_tflops: f64,
    /// A device-to-device copy, bytes read plus written per second, TB/s.
    pub copy_tbps: f64,
    /// SDPA per shape (heads folded into the query length: every head attends the one latent).
    pub sdpa: Vec<SdpaTime>,
}

/// SDPA's time on one shape.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct SdpaTime {
    /// The shape (`kind` is `dense` or `sparse`; SDPA runs on bf16 for both sparse rows).
    pub shape: BatchedShape,
    /// Microseconds per call (the sparse rows' gather not included).
    pub us: f64,
}

/// One row of `kvroute bench kernels --batched`.
#[derive(Debug, Clone, Serialize)]
pub struct BatchedRow {
    /// The shape.
    pub shape: BatchedShape,
    /// Row tiles per block and the grid (work items, splits) the planner chose.
    pub row_tiles: usize,
    /// Work items x splits.
    pub grid: (usize, usize),
    /// Median microseconds per batch (one launch of the decode kernel, its splits combined).
    pub us: f64,
    /// [`BatchedShape::bytes`] per second, TB/s.
    pub tbps: f64,
    /// [`BatchedShape::flops`] per second, TFLOP/s.
    pub tflops: f64,
    /// The roofline's time: the larger of the bytes at the copy rate and the flops at the
    /// matrix rate (the latter only with torch's figures), microseconds.
    pub roofline_us: f64,
    /// Which of the two binds: `memory` or `compute`.
    pub bound: &'static str,
    /// `roofline_us / us`.
    pub of_roofline: f64,
    /// `tflops` over torch's matrix rate.
    pub of_matmul: Option<f64>,
    /// SDPA on the same shape, microseconds.
    pub sdpa_us: Option<f64>,
}

/// `kvroute bench kernels --backend cuda --batched`.
#[derive(Debug, Clone, Serialize)]
pub struct BatchedBench {
    /// The GPU.
    pub device: String,
    /// A device-to-device copy of 1 GiB in this run, bytes read plus written, TB/s.
    pub copy_tbps: f64,
    /// torch's figures, when given.
    pub torch: Option<TorchBaselines>,
    /// One dense call of one query row over 2048 tokens (a contiguous cache), microseconds:
    /// the smallest thing a holder runs (not measured for a subset of the grid).
    pub single_mq1_2048_us: Option<f64>,
    /// The grid.
    pub rows: Vec<BatchedRow>,
}

/// `base` repeated to `len` elements: the batched bench's pool is 16,384 random rows over
/// and over, so that every call reads its rows at distinct addresses without generating (or
/// quantizing) gigabytes on the host row by row.
fn tiled<T: Copy>(base: &[T], len: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        let n = (len - out.len()).min(base.len());
        out.extend_from_slice(&base[..n]);
    }
    out
}

/// Times `launch` on `gpu`: the median of `reps` event-timed batches of launches, each batch
/// sized to run about 20 ms (`quick`: 3 launches, one batch).
fn time_launches(gpu: &Gpu, quick: bool, mut launch: impl FnMut() -> Result<()>) -> Result<f64> {
    let first = gpu.time_us(1, &mut launch)?;
    let (iters, reps) = if quick {
        (3, 1)
    } else {
        (((20_000.0 / first.max(1.0)) as usize).clamp(5, 500), 3)
    };
    let mut t: Vec<f64> = (0..reps)
        .map(|_| gpu.time_us(iters, &mut launch))
        .collect::<Result<_>>()?;
    Ok(kvroute_costmodel::fit::median(&mut t).unwrap_or(f64::NAN))
}

/// The batched kernels at FlashMLA's shapes on `gpu`, each beside the roofline measured in
/// this run (the device copy here; the matrix rate and SDPA from `torch`, measured by
/// `scripts/torch_baselines.py` on the same GPU just before); with `single`, also one
/// Mq = 1 call over 2048 tokens.
pub fn gpu_batched(
    gpu: &Gpu,
    quick: bool,
    (shapes, single): (&[BatchedShape], bool),
    torch: Option<TorchBaselines>,
) -> Result<BatchedBench> {
    use crate::{DecodeRequest, KvPool};

    let copy_bytes = 1usize << 30;
    let copy_us = gpu.time_copy_us(copy_bytes, if quick { 3 } else { 20 })?;
    let copy_tbps = 2.0 * copy_bytes as f64 / copy_us / 1e6;
    let single = if single {
        let (c, q) = (rows(w::DENSE_CT, 1), rows(1, 2));
        let (cache, q) = (Cache::contiguous(&c)?, Queries::new(&q)?);
        let mut p = gpu.prepare_partial(&q, &cache, None, SCALE)?;
        Some(time_launches(gpu, quick, || gpu.launch_partial(&mut p))?)
    } else {
        None
    };
    // One pool for every shape: the largest batch's contexts, 64-token blocks in a shuffled
    // order, bf16 and FP8.
    let most = shapes.iter().map(|s| s.b * s.s_k).max().unwrap_or(0);
    let blocks = most.div_ceil(BATCHED_BLOCK);
    let distinct = rows(16_384, 3);
    let bf16_rows = tiled(&distinct, blocks * BATCHED_BLOCK * D_QK);
    let bf16_pool = gpu.upload_pool(&KvPool::bf16(&bf16_rows, BATCHED_BLOCK)?)?;
    drop(bf16_rows);
    let fp8_rows = tiled(
        &crate::fp8::quantize(&distinct)?,
        blocks * BATCHED_BLOCK * crate::fp8::FP8_ROW_BYTES,
    );
    let fp8_pool = gpu.upload_pool(&KvPool::fp8(&fp8_rows, BATCHED_BLOCK)?)?;
    drop(fp8_rows);
    let mut order: Vec<u32> = (0..blocks as u32).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    };
    for i in (1..order.len()).rev() {
        order.swap(i, next(i + 1));
    }
    let mut out = Vec::new();
    for &shape in shapes {
        let per = shape.s_k.div_ceil(BATCHED_BLOCK);
        let tables: Vec<&[u32]> = (0..shape.b)
            .map(|r| &order[r * per..(r + 1) * per])
            .collect();
        let q_rows = rows(shape.rows(), 5);
        let mut sel = Vec::new();
        if let Some(k) = shape.topk {
            let mut all: Vec<i32> = (0..shape.s_k as i32).collect();
            for _ in 0..shape.b * shape.s_q {
                for i in 0..k {
                    let j = i + next(shape.s_k - i);
                    all.swap(i, j);
                }
                sel.extend_from_slice(&all[..k]);
            }
        }
        let per_req = shape.s_q * shape.h_q;
        let requests: Vec<DecodeRequest<'_>> = (0..shape.b)
            .map(|r| {
                let q = Queries::new(&q_rows[r * per_req * D_QK..(r + 1) * per_req * D_QK])?;
                Ok(match shape.topk {
                    None => DecodeRequest::dense(q, tables[r], shape.s_k),
                    Some(k) => {
                        let idx = &sel[r * shape.s_q * k..(r + 1) * shape.s_q * k];
                        let s = Selection::new(idx, k, shape.h_q, per_req, shape.s_k)?;
                        DecodeRequest::sparse(q, tables[r], shape.s_k, s)
                    }
                })
            })
            .collect::<Result<_>>()?;
        let pool = if shape.kind == BatchedKind::SparseFp8 {
            &fp8_pool
        } else {
            &bf16_pool
        };
        let mut prepared = gpu.prepare_batched(pool, &requests, SCALE)?;
        let us = time_launches(gpu, quick, || gpu.launch_batched(pool, &mut prepared))?;
        let matmul = torch.as_ref().map(|t| t.matmul_tflops);
        let mem_us = shape.bytes() / (copy_tbps * 1e6);
        let cmp_us = matmul.map_or(0.0, |m| shape.flops() / (m * 1e6));
        let sdpa_us = torch.as_ref().and_then(|t| {
            let want = BatchedShape {
                kind: match shape.kind {
                    BatchedKind::Dense => BatchedKind::Dense,
                    _ => BatchedKind::Sparse,
                },
                ..shape
            };
            t.sdpa.iter().find(|s| s.shape == want).map(|s| s.us)
        });
        let tflops = shape.flops() / us / 1e6;
        out.push(BatchedRow {
            shape,
            row_tiles: prepared.row_tiles(),
            grid: prepared.grid(),
            us,
            tbps: shape.bytes() / us / 1e6,
            tflops,
            roofline_us: mem_us.max(cmp_us),
            bound: if cmp_us > mem_us { "compute" } else { "memory" },
            of_roofline: mem_us.max(cmp_us) / us,
            of_matmul: matmul.map(|m| tflops / m),
            sdpa_us,
        });
    }
    Ok(BatchedBench {
        device: crate::describe(Backend::Cuda)?,
        copy_tbps,
        torch,
        single_mq1_2048_us: single,
        rows: out,
    })
}
