//! MLA decode kernels for cross-instance attention (paper 000 sections 2.2, 3.2, 3.3): what a
//! holder runs when a query is routed to it ([`partial_dense`], [`partial_sparse`]), what a
//! requester runs to combine the answers ([`merge`]), and what fetch pays to re-home a chunk
//! ([`splice`]).
//!
//! Shapes are absorbed MLA decode ([`layout`]): query rows `[mq, 576]` and cache rows
//! `[ct, 576]` in bf16 (carried as `u16` bits), partials `(o [mq, 512], m, l)` in f32 with
//! natural-log semantics ([`Partial`]), and their 1152 B / 1032 B wire rows.
//!
//! Each kernel has three implementations, chosen by [`Backend`]:
//! - `Reference`: plain loops with f64 accumulation, the oracle the tests compare against;
//! - `Cpu`: f32 with AVX-512, AVX2 or baseline SIMD chosen at run time ([`Isa`]), threaded over
//!   query rows and split over the keys (rayon's pool);
//! - `Cuda`: CUDA C compiled at run time by NVRTC and launched through cudarc ([`cuda`]);
//!   split-K flash-decoding for the partials, one launch for an all-layer splice. Nothing is
//!   linked: on a machine without a GPU it returns [`KernelError::CudaUnavailable`].
//!
//! ```
//! use kvroute_kernels::{Backend, Cache, Queries, merge, partial_dense};
//!
//! let (q, c) = (vec![0x3f80u16; 2 * 576], vec![0x3f80u16; 100 * 576]); // all ones
//! let (q, cache) = (Queries::new(&q)?, Cache::contiguous(&c)?);
//! let whole = partial_dense(Backend::Cpu, &q, &cache, 0.1147)?;
//! // Split the 100 tokens over two holders and merge: the same answer.
//! let (a, b) = (Cache::contiguous(&c[..40 * 576])?, Cache::contiguous(&c[40 * 576..])?);
//! let parts = [
//!     partial_dense(Backend::Cpu, &q, &a, 0.1147)?,
//!     partial_dense(Backend::Cpu, &q, &b, 0.1147)?,
//! ];
//! let merged = merge(&[&parts[0], &parts[1]])?;
//! assert!((merged.lse(0) - whole.lse(0)).abs() < 1e-5);
//! # Ok::<(), kvroute_kernels::KernelError>(())
//! ```

mod batch;
#[cfg(feature = "bench")]
pub mod bench;
pub mod bf16;
mod cpu;
pub mod cuda;
mod error;
pub mod fp8;
pub mod layout;

mod merge;
pub mod npy;
mod partial;
mod reference;
pub mod rope;
mod splice;
pub mod workload;

pub use batch::{DecodeRequest, KvPool, KvRows, PoolShape};
pub use cpu::Isa;
pub use error::KernelError;
pub use layout::{Cache, Queries, RopeLayout, Selection};
pub use merge::{merge, merge_row, merge_wire};
pub use partial::{Partial, WireOut, WirePartial, queries_from_wire, queries_to_wire};
pub use rope::{Rope, Yarn};
pub use splice::SpliceJob;

use serde::{Deserialize, Serialize};

/// Which implementation runs a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Backend {
    /// Per call ([`Backend::resolve`]): [`Backend::Cuda`] for a partial of at least
    /// [`AUTO_GPU_MIN_ROWS`] query rows when a GPU is usable here, [`Backend::Cpu`] for
    /// everything else. The calls take and return host memory, so a GPU call pays for
    /// moving its inputs, and for merges, splices and short partials that costs more than
    /// the CPU's whole call.
    #[default]
    Auto,
    /// The CPU fast path with the widest available [`Isa`].
    Cpu,
    /// The CPU fast path on a given instruction set (tests, benchmarks).
    CpuWith(Isa),
    /// The f64 reference.
    Reference,
    /// The GPU ([`cuda::Gpu::global`]: device 0); an error where there is none.
    Cuda,
}

impl std::str::FromStr for Backend {
    type Err = KernelError;

    fn from_str(s: &str) -> Result<Self, KernelError> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "reference" => Ok(Self::Reference),
            "cuda" => Ok(Self::Cuda),
            "avx512bf16" => Ok(Self::CpuWith(Isa::Avx512Bf16)),
            "avx512" => Ok(Self::CpuWith(Isa::Avx512)),
            "avx2" => Ok(Self::CpuWith(Isa::Avx2)),
            "scalar" => Ok(Self::CpuWith(Isa::Scalar)),
            _ => Err(KernelError::Parameter {
                what: "backend",
                value: f64::NAN,
                why: "one of auto, cpu, cuda, reference, avx512bf16, avx512, avx2, scalar",
            }),
        }
    }
}

/// What a call is, for [`Backend::Auto`]'s choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// A dense or sparse partial of `rows` query rows.
    Partial {
        /// Query rows.
        rows: usize,
    },
    /// A partial of `rows` query rows over cache rows already on the GPU
    /// ([`partial_resident`]): only the query rows go up and the partial comes down.
    ResidentPartial {
        /// Query rows.
        rows: usize,
    },
    /// A merge of partials.
    Merge,
    /// A splice of a pool.
    Splice,
}

/// The fewest query rows for which [`Backend::Auto`] runs a partial on the GPU.
///
/// Measured host to host on an H200 machine with 16 Xeon cores (docs/kernels.md, "Host to
/// host"; the batched tensor-core kernel): the GPU partial pays for uploading its cache, so at
/// ct = 2048 it took 243 us at 1 row against the CPU's 69, was even at 16 rows (296 against
/// 273), ahead at 64 (590 against 729) and 1.8x faster at 128 (648 against 1135); at ct = 8192,
/// 785 against 137 at 1 row, 1822 against 1709 at 64, 1280 against 3085 at 128. A merge of
/// host partials was 7-25x slower on the GPU at every size tried (8 x 256 rows: 1764 us
/// against 258), and a splice uploads and downloads its whole pool (63.7 MB each way for 27 x
/// 2048 rows, several ms, against 0.3-0.7 ms on two CPU cores), so [`Backend::Auto`] runs
/// those on the CPU.
pub const AUTO_GPU_MIN_ROWS: usize = 64;

/// The fewest query rows for which [`Backend::Auto`] runs a partial over resident cache rows
/// ([`Call::ResidentPartial`]) on the GPU rather than over the host copy on the CPU: every
/// call. Measured as a holder runs it (host query rows in, wire rows out) on an H200 machine
/// with 16 Xeon cores (docs/kernels.md, "Chunks resident on the GPU"): at ct = 2048 the GPU
/// took 36.8 us at 1 row against the CPU's 63.9, 102 against 258 at 16 and 515 against 1654
/// at 256; at ct = 8192, 65.2 against 135.8 at 1 row. With nothing to upload but the queries,
/// no row count was faster on the CPU.
pub const AUTO_RESIDENT_MIN_ROWS: usize = 1;

impl Backend {
    /// The backend that runs `call` here: [`Backend::Auto`] resolved to [`Backend::Cuda`] or
    /// [`Backend::Cpu`] (the GPU is opened only for a call it would run); any other backend
    /// as it is.
    pub fn resolve(self, call: Call) -> Backend {
        match self {
            Backend::Auto if auto_on_gpu(call) && cuda::Gpu::global().is_ok() => Backend::Cuda,
            Backend::Auto => Backend::Cpu,
            other => other,
        }
    }
}

/// Whether [`Backend::Auto`] runs `call` on a GPU, where there is one.
fn auto_on_gpu(call: Call) -> bool {
    match call {
        Call::Partial { rows } => rows >= AUTO_GPU_MIN_ROWS,
        Call::ResidentPartial { rows } => rows >= AUTO_RESIDENT_MIN_ROWS,
        Call::Merge | Call::Splice => false,
    }
}

/// What runs a call.
enum Engine {
    Cpu(Isa),
    Reference,
    Cuda(&'static cuda::Gpu),
}

fn engine(backend: Backend, call: Call) -> Result<Engine, KernelError> {
    match backend.resolve(call) {
        Backend::Auto | Backend::Cpu => Ok(Engine::Cpu(Isa::detect())),
        Backend::CpuWith(isa) if isa.is_available() => Ok(Engine::Cpu(isa)),
        Backend::CpuWith(isa) => Err(KernelError::Parameter {
            what: "instruction set",
            value: f64::NAN,
            why: match isa {
                Isa::Avx512Bf16 => "this CPU lacks AVX-512 F/BW/VL/BF16 + FMA",
                Isa::Avx512 => "this CPU lacks AVX-512 F/BW/VL + FMA",
                _ => "this CPU lacks AVX2 + FMA",
            },
        }),
        Backend::Reference => Ok(Engine::Reference),
        Backend::Cuda => cuda::Gpu::global().map(Engine::Cuda),
    }
}

/// What `backend` runs on here, in words (`cpu avx512`, `reference`, `cuda NVIDIA H100
/// (sm_90)`), or why it cannot run. [`Backend::Auto`] where a GPU is usable names both and
/// when each runs (`Backend::resolve` gives the one for a given call).
pub fn describe(backend: Backend) -> Result<String, KernelError> {
    let one = |engine: Engine| match engine {
        Engine::Cpu(isa) => format!("cpu {isa}"),
        Engine::Reference => "reference".to_owned(),
        Engine::Cuda(gpu) => format!("cuda {} ({})", gpu.info().name, gpu.info().arch),
    };
    let big = Call::Partial {
        rows: AUTO_GPU_MIN_ROWS,
    };
    Ok(match backend {
        Backend::Auto if backend.resolve(big) == Backend::Cuda => format!(
            "auto: {} for partials of {AUTO_GPU_MIN_ROWS} rows or more, {} for the rest",
            one(engine(Backend::Cuda, big)?),
            one(engine(Backend::Cpu, big)?)
        ),
        _ => one(engine(backend, big)?),
    })
}

fn check_scale(scale: f32) -> Result<(), KernelError> {
    if scale.is_finite() && scale > 0.0 {
        Ok(())
    } else {
        Err(KernelError::Parameter {
            what: "softmax scale",
            value: f64::from(scale),
            why: "must be finite and positive",
        })
    }
}

/// Dense partial attention: every query row against every cache token. An empty cache gives
/// the empty partial (`o = 0, m = -inf, l = 0`); no query rows is an error.
pub fn partial_dense(
    backend: Backend,
    q: &Queries<'_>,
    cache: &Cache<'_>,
    scale: f32,
) -> Result<Partial, KernelError> {
    check_scale(scale)?;
    if q.is_empty() {
        return Err(KernelError::Empty("query rows"));
    }
    let p = match engine(backend, Call::Partial { rows: q.len() })? {
        Engine::Cpu(isa) => cpu::partial_dense(q, cache, scale, isa),
        Engine::Reference => reference::partial_dense(q, cache, scale),
        Engine::Cuda(gpu) => gpu.partial_dense(q, cache, scale)?,
    };
    p.check_finite(|_| cache.tokens() > 0)?;
    Ok(p)
}

/// Sparse partial attention: each query row against its selected tokens (`sel` was checked
/// against the cache when built; it is checked against `q` here).
pub fn partial_sparse(
    backend: Backend,
    q: &Queries<'_>,
    cache: &Cache<'_>,
    sel: &Selection<'_>,
    scale: f32,
) -> Result<Partial, KernelError> {
    check_scale(scale)?;
    if q.is_empty() {
        return Err(KernelError::Empty("query rows"));
    }
    let sel = selection_for(sel, q, cache)?;
    let p = match engine(backend, Call::Partial { rows: q.len() })? {
        Engine::Cpu(isa) => cpu::partial_sparse(q, cache, &sel, scale, isa),
        Engine::Reference => reference::partial_sparse(q, cache, &sel, scale),
        Engine::Cuda(gpu) => gpu.partial_sparse(q, cache, &sel, scale)?,
    };
    p.check_finite(|r| attends(&sel, r))?;
    Ok(p)
}

/// Batched paged decode ([`KvPool`], [`DecodeRequest`]): every request of `requests` against `pool`, one
/// [`Partial`] per request. On CUDA the whole batch is one launch of the tensor-core kernel,
/// split or not, with the pool uploaded for the call; [`cuda::Gpu`] also
/// runs it over a pool kept on the device. A request refused (its table, selection or query
/// rows) or a row that is not finite is a [`KernelError::Request`] naming the request. An
/// empty batch gives no partials.
pub fn partial_batched(
    backend: Backend,
    pool: &KvPool<'_>,
    requests: &[DecodeRequest<'_>],
    scale: f32,
) -> Result<Vec<Partial>, KernelError> {
    batch::check_batch(&pool.shape(), requests, scale)?;
    let rows = requests.iter().map(|r| r.queries().len()).sum();
    let parts = match engine(backend, Call::Partial { rows })? {
        Engine::Cpu(isa) => batch::host(batch::Host::Cpu(isa), pool, requests, scale)?,
        Engine::Reference => batch::host(batch::Host::Reference, pool, requests, scale)?,
        Engine::Cuda(gpu) => gpu.partial_batched(pool, requests, scale)?,
    };
    Ok(parts)
}

/// Whether query row `r` selects at least one token (not only padding).
fn attends(sel: &Selection<'_>, r: usize) -> bool {
    sel.of_row(r).iter().any(|&i| i >= 0)
}

/// `sel` checked again against these queries and this cache: a selection built for others
/// must not read out of bounds.
fn selection_for<'a>(
    sel: &Selection<'a>,
    q: &Queries<'_>,
    cache: &Cache<'_>,
) -> Result<Selection<'a>, KernelError> {
    Selection::new(
        sel.raw(),
        sel.k(),
        sel.rows_per_token(),
        q.len(),
        cache.tokens(),
    )
}

/// [`partial_dense`] written straight into its wire encoding (`out`: [`WireOut`], `q.len()`
/// rows): the epilogue a server runs so that the reply is produced where the NIC reads it.
/// The CPU path encodes each block of rows while it is in cache, so the f32 `o` never goes to
/// memory; the reference and CUDA compute the f32 partial and encode it after.
pub fn partial_dense_wire(
    backend: Backend,
    q: &Queries<'_>,
    cache: &Cache<'_>,
    scale: f32,
    out: &mut WireOut<'_>,
) -> Result<(), KernelError> {
    check_wire_rows(q, out)?;
    match engine(backend, Call::Partial { rows: q.len() })? {
        Engine::Cpu(isa) => {
            check_scale(scale)?;
            cpu::partial_dense_wire(q, cache, scale, isa, out)?;
            out.check_finite(|_| cache.tokens() > 0)
        }
        _ => out.write(&partial_dense(backend, q, cache, scale)?),
    }
}

/// [`partial_sparse`] written straight into its wire encoding, as [`partial_dense_wire`].
pub fn partial_sparse_wire(
    backend: Backend,
    q: &Queries<'_>,
    cache: &Cache<'_>,
    sel: &Selection<'_>,
    scale: f32,
    out: &mut WireOut<'_>,
) -> Result<(), KernelError> {
    check_wire_rows(q, out)?;
    match engine(backend, Call::Partial { rows: q.len() })? {
        Engine::Cpu(isa) => {
            check_scale(scale)?;
            let sel = selection_for(sel, q, cache)?;
            cpu::partial_sparse_wire(q, cache, &sel, scale, isa, out);
            out.check_finite(|r| attends(&sel, r))
        }
        _ => out.write(&partial_sparse(backend, q, cache, sel, scale)?),
    }
}

/// A dense (`sel` = `None`) or sparse partial over cache rows kept on the GPU: tokens
/// `tokens` of `rows` ([`cuda::Gpu::upload_rows`]) are the cache, and `sel` indexes them
/// from `tokens.start`. Only the query rows (and the selection) travel to the GPU, and the
/// partial back; checked and refused as [`partial_dense`] / [`partial_sparse`] are, NaN and
/// infinities included.
pub fn partial_resident(
    gpu: &cuda::Gpu,
    rows: &cuda::DeviceRows,
    tokens: std::ops::Range<usize>,
    q: &Queries<'_>,
    sel: Option<&Selection<'_>>,
    scale: f32,
) -> Result<Partial, KernelError> {
    let live = resident_live(&tokens, sel);
    let p = gpu.partial_resident(rows, tokens, q, sel, scale)?;
    p.check_finite(live)?;
    Ok(p)
}

/// [`partial_resident`] written into its wire encoding, as [`partial_dense_wire`]: encoded on
/// the GPU, so the rows come down at half the bytes of the f32 partial, the same bits.
pub fn partial_resident_wire(
    gpu: &cuda::Gpu,
    rows: &cuda::DeviceRows,
    tokens: std::ops::Range<usize>,
    q: &Queries<'_>,
    sel: Option<&Selection<'_>>,
    scale: f32,
    out: &mut WireOut<'_>,
) -> Result<(), KernelError> {
    check_wire_rows(q, out)?;
    let live = resident_live(&tokens, sel);
    gpu.partial_resident_wire(rows, tokens, q, sel, scale, out)?;
    out.check_finite(live)
}

/// Which rows of a resident call attend something: every row over a non-empty range, dense;
/// the rows whose selection names a token, sparse (the selection is checked against the
/// query rows and the range by the call itself).
fn resident_live<'a>(
    tokens: &std::ops::Range<usize>,
    sel: Option<&'a Selection<'_>>,
) -> impl Fn(usize) -> bool + 'a {
    let attended = !tokens.is_empty();
    move |r| sel.map_or(attended, |sel| attends(sel, r))
}

/// A wire partial has as many rows as its queries, and at least one.
fn check_wire_rows(q: &Queries<'_>, out: &WireOut<'_>) -> Result<(), KernelError> {
    if q.is_empty() {
        return Err(KernelError::Empty("query rows"));
    }
    error::check_len("partial wire rows", q.len(), out.rows())
}

/// The delta-rotation splice of `job` (all layers of a chunk in one call).
pub fn splice(backend: Backend, mut job: SpliceJob<'_>) -> Result<(), KernelError> {
    match engine(backend, Call::Splice)? {
        Engine::Cpu(isa) => cpu::splice(&mut job, isa),
        Engine::Reference => reference::splice(&mut job),
        Engine::Cuda(gpu) => gpu.splice(&mut job)?,
    }
    Ok(())
}

/// The exact merge ([`merge`]) on a chosen backend: the CPU and the reference run the same f64
/// combine; CUDA runs it on the GPU (the combine that also finishes its split-K partials),
/// uploading the parts first. [`Backend::Auto`] merges on the CPU.
pub fn merge_with(backend: Backend, parts: &[&Partial]) -> Result<Partial, KernelError> {
    match engine(backend, Call::Merge)? {
        Engine::Cpu(_) | Engine::Reference => merge(parts),
        Engine::Cuda(gpu) => gpu.merge(parts),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Auto` sends a partial to a GPU from `AUTO_GPU_MIN_ROWS` rows on, a partial over
    /// resident rows from `AUTO_RESIDENT_MIN_ROWS` (every one), and never a merge or a
    /// splice; without a GPU everything resolves to the CPU, and named backends stay.
    #[test]
    fn auto_takes_the_gpu_only_for_partials_of_many_rows() {
        assert!(!auto_on_gpu(Call::Partial {
            rows: AUTO_GPU_MIN_ROWS - 1
        }));
        assert!(auto_on_gpu(Call::Partial {
            rows: AUTO_GPU_MIN_ROWS
        }));
        assert!(auto_on_gpu(Call::ResidentPartial { rows: 1 }));
        assert!(!auto_on_gpu(Call::ResidentPartial { rows: 0 }));
        assert!(!auto_on_gpu(Call::Merge));
        assert!(!auto_on_gpu(Call::Splice));
        let big = Call::Partial { rows: 1 << 20 };
        let want = if cuda::Gpu::global().is_ok() {
            Backend::Cuda
        } else {
            Backend::Cpu
        };
        assert_eq!(Backend::Auto.resolve(big), want);
        assert_eq!(
            Backend::Auto.resolve(Call::ResidentPartial { rows: 1 }),
            want
        );
        assert_eq!(Backend::Auto.resolve(Call::Merge), Backend::Cpu);
        for named in [Backend::Cpu, Backend::Reference, Backend::Cuda] {
            assert_eq!(named.resolve(big), named);
        }
    }
}
