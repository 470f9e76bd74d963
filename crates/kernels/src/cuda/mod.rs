//! The CUDA backend: `kernels.cu` compiled at run time by NVRTC for the GPU found
//! ([`nvrtc`]), launched through cudarc's driver API.
//!
//! Nothing here links CUDA: cudarc opens `libcuda` and `libnvrtc` at run time, and [`Gpu::open`]
//! checks both are loadable (cudarc panics inside a call otherwise) and that a device exists
//! before touching either, so on a machine without CUDA every entry point returns
//! [`KernelError::CudaUnavailable`].
//!
//! Every partial runs on the tensor-core decode kernel (`decode.cu`): a batch of requests over
//! a paged pool in one launch, a single cache being the one-request batch. Ways in:
//! - the host API ([`Gpu::partial_batched`], [`Gpu::partial_dense`], [`Gpu::partial_sparse`],
//!   [`Gpu::merge`], [`Gpu::splice`], and [`crate::Backend::Cuda`]): host slices in, host
//!   results out, every transfer included;
//! - a pool kept on the device ([`Gpu::upload_pool`], [`Gpu::partial_batched_resident`]) or
//!   contiguous rows ([`Gpu::upload_rows`], [`Gpu::partial_resident`]): a holder's chunks
//!   uploaded once, each call moving only its query rows up and its partials down;
//! - resident inputs ([`Gpu::prepare_batched`], [`Gpu::prepare_partial`],
//!   [`Gpu::prepare_splice`]): everything uploaded once and launched many times, which is how
//!   the benchmarks time the kernels alone.

mod decode;
pub mod nvrtc;

pub use decode::{DevicePool, PreparedBatch};

use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DriverError, LaunchConfig,
    PushKernelArg,
    sys::{CUdevice_attribute, CUfunction_attribute},
};
use cudarc::nvrtc::Ptx;
use serde::Serialize;

use crate::batch::{DecodeRequest, KvPool, PoolShape};
use crate::error::KernelError;
use crate::layout::{Cache, D_LATENT, D_QK, D_ROPE, Queries, Selection};
use crate::partial::{Partial, WireOut};
use crate::rope::PAIRS;
use crate::splice::SpliceJob;
pub use nvrtc::KernelResources;

/// Threads per block of `mla_combine`, `mla_splice`.
const COMBINE_THREADS: u32 = 512;
/// Output dims one `mla_combine` block finishes (`COMBINE_DIMS` in kernels.cu).
const COMBINE_DIMS: usize = 128;
const SPLICE_THREADS: u32 = 256;
/// `mla_combine`'s `wire` argument when its rows go to `out_o` / `out_m` / `out_l`.
const NULL_WIRE: u64 = 0;

fn driver(what: &'static str) -> impl Fn(DriverError) -> KernelError {
    move |e| KernelError::Cuda(format!("CUDA driver, {what}: {e:?}"))
}

/// What was found and compiled.
#[derive(Debug, Clone, Serialize)]
pub struct GpuInfo {
    /// The device's name.
    pub name: String,
    /// Its ordinal.
    pub ordinal: usize,
    /// The architecture the kernels were compiled for (`sm_90` on an H100).
    pub arch: String,
    /// Streaming multiprocessors.
    pub sms: usize,
    /// NVRTC's version.
    pub nvrtc: (i32, i32),
    /// Each kernel's registers, shared memory and spills, from ptxas's report. Empty when
    /// NVRTC gave no report: the CUDA 13.0.88 NVRTC of an H200 machine's toolkit returned an
    /// empty program log for every compile after the first one on that machine, in the same
    /// process or another. [`GpuInfo::loaded`] always holds the driver's figures.
    pub resources: Vec<KernelResources>,
    /// Each kernel as the driver loaded it.
    pub loaded: Vec<LoadedKernel>,
}

/// A loaded kernel's resources as the driver reports them (`cuFuncGetAttribute`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LoadedKernel {
    /// The entry point.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Static shared memory per block, bytes.
    pub shared_bytes: u32,
    /// Local memory per thread (stack frame and spills together), bytes.
    pub local_bytes: u32,
}

/// A GPU with the kernels loaded.
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// `mla_decode_*`, by [`decode::DECODE_KERNELS`]'s order.
    decode: Vec<CudaFunction>,
    combine: CudaFunction,
    splice: CudaFunction,
    info: GpuInfo,
    /// The resident calls' buffers, kept between calls (one call at a time).
    scratch: Mutex<Scratch>,
    launches: decode::LaunchCount,
}

/// Why no GPU can be used here, or `Ok` with nothing when one can (without opening it).
fn probe_libraries() -> Result<(), KernelError> {
    // SAFETY: only tries to dlopen the driver library by its candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(KernelError::CudaUnavailable(
            "libcuda.so not found (no NVIDIA driver on this machine)".into(),
        ));
    }
    if !nvrtc::nvrtc_present() {
        return Err(nvrtc::missing_nvrtc());
    }
    Ok(())
}

impl Gpu {
    /// Opens device `ordinal`, compiles the kernels for its architecture and loads them.
    pub fn open(ordinal: usize) -> Result<Self, KernelError> {
        probe_libraries()?;
        let count = CudaContext::device_count().map_err(|e| {
            KernelError::CudaUnavailable(format!("the driver found no usable device ({e:?})"))
        })?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(KernelError::CudaUnavailable(format!(
                "device {ordinal} requested, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("context"))?;
        let (major, minor) = ctx.compute_capability().map_err(driver("capability"))?;
        let arch = format!("sm_{major}{minor}");
        let compiled = nvrtc::compile(&arch)?;
        let module = ctx
            .load_module(Ptx::from_binary(compiled.cubin))
            .map_err(driver("loading the cubin"))?;
        let load = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| KernelError::Cuda(format!("kernel {name}: {e:?}")))
        };
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver("SM count"))?;
        let (combine, splice) = (load("mla_combine")?, load("mla_splice")?);
        let decode = decode::DECODE_KERNELS
            .iter()
            .map(|name| load(name))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, f) in decode.iter().enumerate() {
            // More than 48 KB of dynamic shared memory is refused until asked for.
            let (_, bytes) = decode::decode_layout(1 << (i % 3), i >= 3);
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                i32::try_from(bytes).unwrap_or(i32::MAX),
            )
            .map_err(driver("raising the decode kernel's shared memory"))?;
        }
        let loaded = [("mla_combine", &combine), ("mla_splice", &splice)]
            .into_iter()
            .chain(decode::DECODE_KERNELS.iter().copied().zip(&decode))
            .map(|(name, f)| {
                let get = |what: &'static str, attribute| {
                    f.get_attribute(attribute)
                        .map(|v| u32::try_from(v).unwrap_or(0))
                        .map_err(driver(what))
                };
                Ok(LoadedKernel {
                    name: name.to_owned(),
                    registers: get(
                        "registers",
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS,
                    )?,
                    shared_bytes: get(
                        "shared memory",
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                    )?,
                    local_bytes: get(
                        "local memory",
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                    )?,
                })
            })
            .collect::<Result<Vec<_>, KernelError>>()?;
        let info = GpuInfo {
            name: ctx.name().map_err(driver("name"))?,
            ordinal,
            arch,
            sms: usize::try_from(sms).unwrap_or(1).max(1),
            nvrtc: nvrtc::nvrtc_version()?,
            resources: compiled.resources,
            loaded,
        };
        let stream = ctx.new_stream().map_err(driver("stream"))?;
        let scratch = Scratch {
            ws: Workspace {
                states: stream.alloc_zeros(1).map_err(driver("allocation"))?,
                out: stream.alloc_zeros(1).map_err(driver("allocation"))?,
            },
            wire: stream.alloc_zeros(1).map_err(driver("allocation"))?,
            host_wire: Vec::new(),
            q: stream.alloc_zeros(1).map_err(driver("allocation"))?,
            sel: stream.alloc_zeros(1).map_err(driver("allocation"))?,
            tables: stream.alloc_zeros(1).map_err(driver("allocation"))?,
            reqs: stream.alloc_zeros(1).map_err(driver("allocation"))?,
            work: stream.alloc_zeros(1).map_err(driver("allocation"))?,
            counters: stream.alloc_zeros(1).map_err(driver("allocation"))?,
        };
        Ok(Self {
            decode,
            combine,
            splice,
            stream,
            ctx,
            info,
            scratch: Mutex::new(scratch),
            launches: decode::LaunchCount::default(),
        })
    }

    /// Device 0, opened once per process; the error says why not when there is none.
    pub fn global() -> Result<&'static Self, KernelError> {
        static GPU: OnceLock<Result<Gpu, KernelError>> = OnceLock::new();
        GPU.get_or_init(|| Self::open(0))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// What was found and compiled.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// Waits for everything launched so far.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(driver("synchronize"))
    }

    fn upload<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        host: &[T],
    ) -> Result<CudaSlice<T>, KernelError> {
        if host.is_empty() {
            // cuMemAlloc refuses zero bytes; a one-element buffer nothing reads stands in.
            return self.stream.alloc_zeros(1).map_err(driver("allocation"));
        }
        self.stream.clone_htod(host).map_err(driver("upload"))
    }

    fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, KernelError> {
        self.stream
            .alloc_zeros(n.max(1))
            .map_err(driver("allocation"))
    }

    fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
        n: usize,
    ) -> Result<Vec<T>, KernelError> {
        // The first `n` elements (a kept buffer may be longer).
        let dev = dev.slice(..n.min(dev.len()));
        let mut host = vec![T::default(); dev.len()];
        self.stream
            .memcpy_dtoh(&dev, &mut host)
            .map_err(driver("download"))?;
        Ok(host)
    }

    /// `buf` replaced by a new zeroed buffer of `n` elements if it holds fewer: a kept buffer
    /// only grows.
    fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        buf: &mut CudaSlice<T>,
        n: usize,
    ) -> Result<(), KernelError> {
        if buf.len() < n {
            *buf = self.zeros(n)?;
        }
        Ok(())
    }

    /// `host` copied into the front of the kept buffer `buf` (grown first if too small); the
    /// view of it the kernel reads (one element, unread, for an empty `host`).
    fn stage<'a, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        buf: &'a mut CudaSlice<T>,
        host: &[T],
    ) -> Result<CudaView<'a, T>, KernelError> {
        let n = host.len().max(1);
        self.grow(buf, n)?;
        if !host.is_empty() {
            self.stream
                .memcpy_htod(host, &mut buf.slice_mut(..host.len()))
                .map_err(driver("upload"))?;
        }
        Ok(buf.slice(..n))
    }

    /// Uploads a dense (`sel` = `None`) or sparse partial's inputs (checked as by
    /// [`crate::partial_dense`] / [`crate::partial_sparse`]) to launch again and again: the
    /// one-request case of [`Gpu::prepare_batched`].
    pub fn prepare_partial(
        &self,
        q: &Queries<'_>,
        cache: &Cache<'_>,
        sel: Option<&Selection<'_>>,
        scale: f32,
    ) -> Result<PreparedPartial, KernelError> {
        let (pool, table) = one_pool(cache)?;
        let request = one_request(q, &table, cache.tokens(), sel);
        let dev = self.upload_pool(&pool)?;
        let batch = self
            .prepare_batched(&dev, &[request], scale)
            .map_err(unwrap_one)?;
        Ok(PreparedPartial { pool: dev, batch })
    }

    /// Launches a prepared partial without waiting.
    pub fn launch_partial(&self, p: &mut PreparedPartial) -> Result<(), KernelError> {
        self.launch_batched(&p.pool, &mut p.batch)
    }

    /// The last launched result of `p`, downloaded (waits for it).
    pub fn read_partial(&self, p: &PreparedPartial) -> Result<Partial, KernelError> {
        let mut parts = self.read_batched(&p.batch)?;
        parts
            .pop()
            .ok_or_else(|| KernelError::Cuda("a one-request batch gave no partial".into()))
    }

    /// Uploads contiguous cache rows (`[tokens, 576]` bf16, as [`Cache::contiguous`] takes
    /// them) to stay on this GPU: a holder's chunks, attended by
    /// [`Gpu::partial_resident`] without being moved again.
    pub fn upload_rows(&self, rows: &[u16]) -> Result<DeviceRows, KernelError> {
        let tokens = Cache::contiguous(rows)?.tokens();
        Ok(DeviceRows {
            rows: self.upload(rows)?,
            tokens,
        })
    }

    /// A dense (`sel` = `None`) or sparse partial over tokens `tokens` of `rows`, which stay
    /// on the GPU: only the query rows (and the selection) go up and the partial comes down.
    /// `sel` indexes the range (token 0 is `tokens.start`). Checked as
    /// [`crate::partial_dense`] / [`crate::partial_sparse`] check their inputs, and `rows`
    /// must have been uploaded to this GPU. The device buffers a call needs are kept for the
    /// next one, so calls on one GPU run one at a time.
    pub fn partial_resident(
        &self,
        rows: &DeviceRows,
        tokens: Range<usize>,
        q: &Queries<'_>,
        sel: Option<&Selection<'_>>,
        scale: f32,
    ) -> Result<Partial, KernelError> {
        let (plan, kv) = self.resident_plan(rows, &tokens, q, sel, scale)?;
        let mut parts = self.run_batch(&kv, &plan, None)?;
        parts
            .pop()
            .ok_or_else(|| KernelError::Cuda("a one-request batch gave no partial".into()))
    }

    /// [`Gpu::partial_resident`] into its wire rows (`out`, one per query row), encoded on the
    /// GPU: the rows come down in their 1032-byte form (half the bytes of the f32 partial) and
    /// are copied into `out`'s runs. Bit for bit what [`WireOut`] encodes from the f32
    /// partial on the CPU.
    pub fn partial_resident_wire(
        &self,
        rows: &DeviceRows,
        tokens: Range<usize>,
        q: &Queries<'_>,
        sel: Option<&Selection<'_>>,
        scale: f32,
        out: &mut WireOut<'_>,
    ) -> Result<(), KernelError> {
        crate::error::check_len("partial wire rows", q.len(), out.rows())?;
        let (plan, kv) = self.resident_plan(rows, &tokens, q, sel, scale)?;
        self.run_batch(&kv, &plan, Some(out))?;
        Ok(())
    }

    /// A resident call checked (the rows this GPU's, the range inside them) and planned as a
    /// one-request batch over the range's rows (one block of its length).
    fn resident_plan<'r>(
        &self,
        rows: &'r DeviceRows,
        tokens: &Range<usize>,
        q: &Queries<'_>,
        sel: Option<&Selection<'_>>,
        scale: f32,
    ) -> Result<(decode::DecodePlan, CudaView<'r, u16>), KernelError> {
        if !Arc::ptr_eq(rows.rows.context(), &self.ctx) {
            return Err(KernelError::Cuda(
                "resident rows uploaded to another GPU context".into(),
            ));
        }
        if tokens.start > tokens.end || tokens.end > rows.tokens {
            return Err(KernelError::Parameter {
                what: "resident token range end",
                value: tokens.end as f64,
                why: "must lie within the uploaded rows, start <= end",
            });
        }
        let shape = PoolShape {
            block_tokens: tokens.len().max(1),
            blocks: 1,
            fp8: false,
        };
        let request = one_request(q, &[0], tokens.len(), sel);
        let plan =
            decode::DecodePlan::new(shape, &[request], scale, self.info.sms).map_err(unwrap_one)?;
        // An empty range attends nothing (sparse: every index is padding), and a view of no
        // elements cannot be made: the whole upload stands in, unread.
        let kv = if tokens.is_empty() {
            rows.rows.slice(..)
        } else {
            rows.rows.slice(tokens.start * D_QK..tokens.end * D_QK)
        };
        Ok((plan, kv))
    }

    /// Dense partial attention on the GPU, host to host.
    pub fn partial_dense(
        &self,
        q: &Queries<'_>,
        cache: &Cache<'_>,
        scale: f32,
    ) -> Result<Partial, KernelError> {
        let mut p = self.prepare_partial(q, cache, None, scale)?;
        self.launch_partial(&mut p)?;
        self.read_partial(&p)
    }

    /// Sparse partial attention on the GPU, host to host.
    pub fn partial_sparse(
        &self,
        q: &Queries<'_>,
        cache: &Cache<'_>,
        sel: &Selection<'_>,
        scale: f32,
    ) -> Result<Partial, KernelError> {
        let mut p = self.prepare_partial(q, cache, Some(sel), scale)?;
        self.launch_partial(&mut p)?;
        self.read_partial(&p)
    }

    /// The exact merge on the GPU (the same combine as the split-K finish), host to host.
    pub fn merge(&self, parts: &[&Partial]) -> Result<Partial, KernelError> {
        crate::merge::check_parts(parts)?;
        let mq = parts[0].rows();
        let gather = |f: &dyn Fn(&Partial) -> &[f32]| -> Vec<f32> {
            parts.iter().flat_map(|p| f(p).iter().copied()).collect()
        };
        let (o, m, l) = (
            self.upload(&gather(&|p| &p.o))?,
            self.upload(&gather(&|p| &p.m))?,
            self.upload(&gather(&|p| &p.l))?,
        );
        let (mut out_o, mut out_m, mut out_l) =
            (self.zeros(mq * D_LATENT)?, self.zeros(mq)?, self.zeros(mq)?);
        let (n, rows, normalized) = (
            i32::try_from(parts.len()).unwrap_or(i32::MAX),
            i32::try_from(mq).unwrap_or(i32::MAX),
            1i32,
        );
        let mut c = self.stream.launch_builder(&self.combine);
        c.arg(&o)
            .arg(&m)
            .arg(&l)
            .arg(&n)
            .arg(&rows)
            .arg(&normalized)
            .arg(&mut out_o)
            .arg(&mut out_m)
            .arg(&mut out_l)
            .arg(&NULL_WIRE);
        // SAFETY: matches mla_combine (no wire rows: a null pointer); parts x mq rows
        // uploaded, mq rows out.
        unsafe { c.launch(config(combine_grid(mq as u32), COMBINE_THREADS)) }
            .map_err(driver("mla_combine"))?;
        Ok(Partial {
            o: self.download(&out_o, mq * D_LATENT)?,
            m: self.download(&out_m, mq)?,
            l: self.download(&out_l, mq)?,
        })
    }

    /// Uploads a splice job: its source rows, the per-token (cos, sin) computed on the CPU in
    /// f64, the block table, and the pool (so rows the job does not write keep their values).
    pub fn prepare_splice(&self, job: &SpliceJob<'_>) -> Result<PreparedSplice, KernelError> {
        let n = job.tokens();
        let mut cs = Vec::with_capacity(n * PAIRS * 2);
        for t in 0..n {
            for (c, s) in job.rope.angles(job.to[t] - job.from[t]) {
                cs.extend([c, s]);
            }
        }
        let rows = job.layers * n;
        let int = |what: &'static str, v: usize| {
            i32::try_from(v).map_err(|_| KernelError::Parameter {
                what,
                value: v as f64,
                why: "exceeds the kernel's 32-bit index",
            })
        };
        let blocks = rows.div_ceil((SPLICE_THREADS / 32) as usize);
        Ok(PreparedSplice {
            layers: int("splice layers", job.layers)?,
            tokens: int("splice tokens", n)?,
            half: i32::from(job.rope.layout() == crate::RopeLayout::Half),
            blocks: u32::try_from(blocks).map_err(|_| KernelError::Parameter {
                what: "splice rows",
                value: rows as f64,
                why: "exceeds one launch's grid",
            })?,
            src: job.src.map(|src| self.upload(src)).transpose()?,
            cs: self.upload(&cs)?,
            table: self.upload(job.table)?,
            pool: self.upload(job.pool)?,
            pool_len: job.pool.len(),
        })
    }

    /// Launches a prepared splice (one launch for every layer) without waiting.
    pub fn launch_splice(&self, s: &mut PreparedSplice) -> Result<(), KernelError> {
        let mut b = self.stream.launch_builder(&self.splice);
        // In place: a null source pointer (the kernel then reads the pool rows).
        let null = 0u64;
        match &s.src {
            Some(src) => b.arg(src),
            None => b.arg(&null),
        };
        b.arg(&s.layers)
            .arg(&s.tokens)
            .arg(&s.cs)
            .arg(&s.half)
            .arg(&mut s.pool)
            .arg(&s.table);
        // SAFETY: matches mla_splice; SpliceJob::new bounded every table entry by the pool's
        // pages and refused repeated pages, so rows are in bounds and writes disjoint.
        unsafe { b.launch(config((s.blocks, 1, 1), SPLICE_THREADS)) }
            .map_err(driver("mla_splice"))?;
        Ok(())
    }

    /// The delta-rotation splice on the GPU, host to host (the whole pool travels both ways).
    pub fn splice(&self, job: &mut SpliceJob<'_>) -> Result<(), KernelError> {
        let mut s = self.prepare_splice(job)?;
        self.launch_splice(&mut s)?;
        let pool = self.download(&s.pool, s.pool_len)?;
        job.pool.copy_from_slice(&pool);
        Ok(())
    }

    /// The baseline for the kernels' bandwidth: a device-to-device copy of `bytes` (read once,
    /// written once), microseconds per copy over `iters`.
    pub fn time_copy_us(&self, bytes: usize, iters: usize) -> Result<f64, KernelError> {
        let src: CudaSlice<u8> = self.zeros(bytes)?;
        let mut dst: CudaSlice<u8> = self.zeros(bytes)?;
        self.time_us(iters, || {
            self.stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(driver("device copy"))
        })
    }

    /// Times `launch` over `iters` launches with CUDA events (after one warm-up), in
    /// microseconds per launch.
    pub fn time_us(
        &self,
        iters: usize,
        mut launch: impl FnMut() -> Result<(), KernelError>,
    ) -> Result<f64, KernelError> {
        launch()?;
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).map_err(driver("event"))?;
        let end = self.ctx.new_event(flags).map_err(driver("event"))?;
        start.record(&self.stream).map_err(driver("event"))?;
        for _ in 0..iters.max(1) {
            launch()?;
        }
        end.record(&self.stream).map_err(driver("event"))?;
        let ms = start.elapsed_ms(&end).map_err(driver("event timing"))?;
        Ok(f64::from(ms) * 1e3 / iters.max(1) as f64)
    }
}

/// `mla_combine`'s grid for `rows` rows: a block for each `COMBINE_DIMS` dims of each row.
fn combine_grid(rows: u32) -> (u32, u32, u32) {
    (rows, (D_LATENT / COMBINE_DIMS) as u32, 1)
}

fn config(grid: (u32, u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The split-K pass's states (`o` of every split and row, then their `m`, then their `l`)
/// and the combine's result (`o`, `m`, `l` of every row, likewise), one allocation each.
#[derive(Debug)]
struct Workspace {
    states: CudaSlice<f32>,
    out: CudaSlice<f32>,
}

/// Buffers the resident calls keep between calls (grown, never shrunk; one element each
/// until first used), so that a holder's call allocates nothing once the largest shape has
/// been seen: the split-K workspace, room for the query rows, tables, per-request and
/// per-work-item records and selections, and the wire rows on the device and on their way to
/// the caller's runs.
#[derive(Debug)]
struct Scratch {
    ws: Workspace,
    wire: CudaSlice<u8>,
    host_wire: Vec<u8>,
    q: CudaSlice<u16>,
    sel: CudaSlice<i32>,
    tables: CudaSlice<u32>,
    reqs: CudaSlice<i32>,
    work: CudaSlice<i32>,
    /// The decode kernel's per-work-item counters (zero between launches).
    counters: CudaSlice<i32>,
}

/// A partial's inputs and outputs resident on the GPU (see [`Gpu::prepare_partial`]).
#[derive(Debug)]
pub struct PreparedPartial {
    pool: DevicePool,
    batch: PreparedBatch,
}

/// Contiguous cache rows kept on a GPU ([`Gpu::upload_rows`]), freed when dropped.
#[derive(Debug)]
pub struct DeviceRows {
    rows: CudaSlice<u16>,
    tokens: usize,
}

impl DeviceRows {
    /// Cache tokens (rows of 576) held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        self.tokens * D_QK * 2
    }
}

impl PreparedPartial {
    /// The decode kernel's grid: (work items, splits of the keys).
    pub fn grid(&self) -> (usize, usize) {
        self.batch.grid()
    }
}

/// A single cache as a pool: a contiguous one is one block of all its tokens, a paged one its
/// pool; and the block table.
fn one_pool<'a>(cache: &Cache<'a>) -> Result<(KvPool<'a>, Vec<u32>), KernelError> {
    let (rows, table) = cache.parts();
    match table {
        None => Ok((KvPool::bf16(rows, cache.tokens().max(1))?, vec![0])),
        Some(t) => Ok((KvPool::bf16(rows, cache.block_tokens())?, t.to_vec())),
    }
}

/// The request of a single-cache call.
fn one_request<'a>(
    q: &Queries<'a>,
    table: &'a [u32],
    tokens: usize,
    sel: Option<&Selection<'a>>,
) -> DecodeRequest<'a> {
    match sel {
        None => DecodeRequest::dense(*q, table, tokens),
        Some(sel) => DecodeRequest::sparse(*q, table, tokens, *sel),
    }
}

/// A one-request batch's error as the single call's own (without the request's position).
fn unwrap_one(e: KernelError) -> KernelError {
    match e {
        KernelError::Request { source, .. } => *source,
        other => other,
    }
}

/// A splice's inputs resident on the GPU (see [`Gpu::prepare_splice`]).
#[derive(Debug)]
pub struct PreparedSplice {
    layers: i32,
    tokens: i32,
    half: i32,
    blocks: u32,
    /// `None`: in place.
    src: Option<CudaSlice<u16>>,
    cs: CudaSlice<f64>,
    table: CudaSlice<u32>,
    pool: CudaSlice<u16>,
    pool_len: usize,
}

impl PreparedSplice {
    /// The bytes one launch moves: every source row read and written once, or in place the
    /// RoPE band of every row.
    pub fn bytes_moved(&self) -> usize {
        let per_row = if self.src.is_some() { D_QK } else { D_ROPE };
        2 * self.layers as usize * self.tokens as usize * per_row * 2
    }
}
