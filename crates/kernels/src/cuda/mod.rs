//! The CUDA backend: `kernels.cu` compiled at run time by NVRTC for the GPU found
//! ([`nvrtc`]), launched through cudarc's driver API.
//!
//! Nothing here links CUDA: cudarc opens `libcuda` and `libnvrtc` at run time, and [`Gpu::open`]
//! checks both are loadable (cudarc panics inside a call otherwise) and that a device exists
//! before touching either, so on a machine without CUDA every entry point returns
//! [`KernelError::CudaUnavailable`].
//!
//! Two ways in:
//! - the host API ([`Gpu::partial_dense`], [`Gpu::partial_sparse`], [`Gpu::merge`],
//!   [`Gpu::splice`], and [`crate::Backend::Cuda`]): host slices in, host results out, every
//!   transfer included;
//! - resident cache rows ([`Gpu::upload_rows`], [`Gpu::partial_resident`]): a holder's chunks
//!   uploaded once, each call moving only its query rows up and its partial down;
//! - resident inputs ([`Gpu::prepare_partial`], [`Gpu::prepare_splice`]): everything uploaded
//!   once and launched many times, which is how the benchmarks time the kernels alone.

pub mod nvrtc;

use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DriverError,
    LaunchConfig, PushKernelArg,
    sys::{CUdevice_attribute, CUfunction_attribute},
};
use cudarc::nvrtc::Ptx;
use serde::Serialize;

use crate::error::KernelError;
use crate::layout::{Cache, D_LATENT, D_QK, D_ROPE, PARTIAL_ROW_BYTES, Queries, Selection};
use crate::partial::{Partial, WireOut};
use crate::rope::PAIRS;
use crate::splice::SpliceJob;
pub use nvrtc::KernelResources;

/// Query rows per block of `mla_partial` (one warp each; `ROWS` in kernels.cu).
const ROWS: usize = 8;
/// Cache tokens per shared-memory tile (`TILE` in kernels.cu).
const TILE: usize = 16;
/// Threads per block of `mla_partial`, `mla_combine`, `mla_splice`.
const PARTIAL_THREADS: u32 = (ROWS * 32) as u32;
const COMBINE_THREADS: u32 = 512;
/// Output dims one `mla_combine` block finishes (`COMBINE_DIMS` in kernels.cu).
const COMBINE_DIMS: usize = 128;
const SPLICE_THREADS: u32 = 256;
/// Blocks per SM the split-K planner aims for. A block works through its tiles one load
/// after another, so the loads in flight come from many blocks: with 80 registers per
/// thread three are resident per SM, and about eight per SM (queued ones start as others
/// finish) was the fastest split at Mq = 64-256 on an H200 (docs/kernels.md).
const BLOCKS_PER_SM: usize = 8;
/// The most splits the planner makes: each is a part the combine reads back (2 KB a row),
/// and past about 256 of them the combine cost more than the extra splits gained.
const MAX_SPLITS: usize = 256;
/// CUDA's grid.y limit.
const MAX_GRID_Y: usize = 65_535;
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
    partial: CudaFunction,
    combine: CudaFunction,
    splice: CudaFunction,
    info: GpuInfo,
    /// [`Gpu::partial_resident`]'s buffers, kept between calls (one call at a time).
    scratch: Mutex<Scratch>,
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
        let (partial, combine, splice) = (
            load("mla_partial")?,
            load("mla_combine")?,
            load("mla_splice")?,
        );
        let loaded = [
            ("mla_partial", &partial),
            ("mla_combine", &combine),
            ("mla_splice", &splice),
        ]
        .into_iter()
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
        };
        Ok(Self {
            partial,
            combine,
            splice,
            stream,
            ctx,
            info,
            scratch: Mutex::new(scratch),
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

    /// Uploads a dense or sparse partial's inputs (checked as by [`crate::partial_dense`] /
    /// [`crate::partial_sparse`]) and plans its split-K grid.
    pub fn prepare_partial(
        &self,
        q: &Queries<'_>,
        cache: &Cache<'_>,
        sel: Option<&Selection<'_>>,
        scale: f32,
    ) -> Result<PreparedPartial, KernelError> {
        self.prepare_partial_split(q, cache, sel, scale, None)
    }

    /// [`Gpu::prepare_partial`] with the split chosen by the caller: `tiles_per_split`
    /// tiles of 16 keys per block (at least one), or `None` for the planner's choice. For
    /// measuring the planner against the alternatives.
    pub fn prepare_partial_split(
        &self,
        q: &Queries<'_>,
        cache: &Cache<'_>,
        sel: Option<&Selection<'_>>,
        scale: f32,
        tiles_per_split: Option<usize>,
    ) -> Result<PreparedPartial, KernelError> {
        let plan = self.plan(q, cache.tokens(), sel, scale, tiles_per_split)?;
        let (pool, table) = cache.parts();
        Ok(PreparedPartial {
            q: self.upload(q.as_slice())?,
            cache: self.upload(pool)?,
            table: table.map(|t| self.upload(t)).transpose()?,
            sel: sel.map(|s| self.upload(s.raw())).transpose()?,
            ws: self.workspace(&plan)?,
            plan,
        })
    }

    /// Checks a partial's shape (as [`crate::partial_dense`] / [`crate::partial_sparse`]
    /// do, the selection against `tokens` cache tokens) and plans its split-K grid.
    fn plan(
        &self,
        q: &Queries<'_>,
        tokens: usize,
        sel: Option<&Selection<'_>>,
        scale: f32,
        tiles_per_split: Option<usize>,
    ) -> Result<SplitK, KernelError> {
        crate::check_scale(scale)?;
        if q.is_empty() {
            return Err(KernelError::Empty("query rows"));
        }
        let mq = q.len();
        let (keys, groups_per_token, groups) = match sel {
            None => (tokens, 1, mq.div_ceil(ROWS)),
            Some(sel) => {
                Selection::new(sel.raw(), sel.k(), sel.rows_per_token(), mq, tokens)?;
                let per_token = sel.rows_per_token().div_ceil(ROWS);
                (sel.k(), per_token, mq / sel.rows_per_token() * per_token)
            }
        };
        if groups > MAX_GRID_Y {
            return Err(KernelError::Parameter {
                what: "query row groups (CUDA grid.y)",
                value: groups as f64,
                why: "at most 65535 groups of 8 rows per launch",
            });
        }
        let tiles = keys.div_ceil(TILE).max(1);
        let keys_per_split = tiles_per_split.map_or_else(
            || plan_tiles_per_split(tiles, groups, self.info.sms),
            |t| t.clamp(1, tiles),
        ) * TILE;
        let splits = keys.div_ceil(keys_per_split).max(1);
        let to_i32 = |what: &'static str, v: usize| {
            i32::try_from(v).map_err(|_| KernelError::Parameter {
                what,
                value: v as f64,
                why: "exceeds the kernel's 32-bit index",
            })
        };
        Ok(SplitK {
            mq: to_i32("query rows", mq)?,
            keys: to_i32("keys", keys)?,
            rows_per_token: to_i32("rows per token", sel.map_or(1, |s| s.rows_per_token()))?,
            groups_per_token: to_i32("groups per token", groups_per_token)?,
            keys_per_split: to_i32("keys per split", keys_per_split)?,
            groups,
            splits,
            scale,
        })
    }

    /// The split states and the finished partial of `plan`, in device memory.
    fn workspace(&self, plan: &SplitK) -> Result<Workspace, KernelError> {
        let (states, out) = plan.workspace_lens();
        Ok(Workspace {
            states: self.zeros(states)?,
            out: self.zeros(out)?,
        })
    }

    /// Launches a prepared partial (split-K pass, then the combine) without waiting.
    pub fn launch_partial(&self, p: &mut PreparedPartial) -> Result<(), KernelError> {
        let (q, cache, sel) = (
            p.q.slice(..),
            p.cache.slice(..),
            p.sel.as_ref().map(|s| s.slice(..)),
        );
        let inputs = SplitKInputs {
            q: &q,
            cache: &cache,
            table: p.table.as_ref(),
            sel: sel.as_ref(),
        };
        self.launch_split_k(&p.plan, &inputs, &mut p.ws, None)
    }

    /// Launches `mla_partial` and `mla_combine` for `plan` on `inputs`, into `ws`.
    fn launch_split_k(
        &self,
        plan: &SplitK,
        inputs: &SplitKInputs<'_, '_>,
        ws: &mut Workspace,
        wire: Option<&mut CudaViewMut<'_, u8>>,
    ) -> Result<(), KernelError> {
        if plan.keys == 0 {
            // A dense partial over an empty cache: the empty partial, nothing to launch.
            return Ok(());
        }
        const NULL: u64 = 0;
        let mut b = self.stream.launch_builder(&self.partial);
        b.arg(inputs.q).arg(&plan.mq).arg(inputs.cache);
        match inputs.table {
            Some(t) => b.arg(t),
            None => b.arg(&NULL),
        };
        match inputs.sel {
            Some(s) => b.arg(s),
            None => b.arg(&NULL),
        };
        b.arg(&plan.keys)
            .arg(&plan.rows_per_token)
            .arg(&plan.groups_per_token)
            .arg(&plan.keys_per_split)
            .arg(&plan.scale);
        let (mq, states) = (plan.mq as usize, plan.splits * plan.mq as usize);
        let (mut ws_o, mut ws_ml) = ws.states.split_at_mut(states * D_LATENT);
        let (mut ws_m, mut ws_l) = ws_ml.split_at_mut(states);
        b.arg(&mut ws_o).arg(&mut ws_m).arg(&mut ws_l);
        let grid = (plan.splits as u32, plan.groups as u32, 1);
        // SAFETY: the arguments match mla_partial's signature in order and type; every index
        // the kernel forms was bounded by `plan` (Selection checked against the cache's
        // tokens, the block table against the pool), and the workspace holds splits x mq rows.
        unsafe { b.launch(config(grid, PARTIAL_THREADS)) }.map_err(driver("mla_partial"))?;
        let (parts, normalized) = (plan.splits as i32, 0i32);
        let (ws_o, ws_ml) = ws.states.split_at(states * D_LATENT);
        let (ws_m, ws_l) = ws_ml.split_at(states);
        let (mut o, mut ml) = ws.out.split_at_mut(mq * D_LATENT);
        let (mut m, mut l) = ml.split_at_mut(mq);
        let mut c = self.stream.launch_builder(&self.combine);
        c.arg(&ws_o)
            .arg(&ws_m)
            .arg(&ws_l)
            .arg(&parts)
            .arg(&plan.mq)
            .arg(&normalized)
            .arg(&mut o)
            .arg(&mut m)
            .arg(&mut l);
        match wire {
            Some(w) => c.arg(w),
            None => c.arg(&NULL_WIRE),
        };
        // SAFETY: as above; parts x mq states in the workspace, mq rows out (to `wire`, which
        // holds mq rows of 1032 bytes, when given).
        unsafe { c.launch(config(combine_grid(plan.mq as u32), COMBINE_THREADS)) }
            .map_err(driver("mla_combine"))?;
        Ok(())
    }

    /// The last launched result of `p`, downloaded (waits for it).
    pub fn read_partial(&self, p: &PreparedPartial) -> Result<Partial, KernelError> {
        self.read_split_k(&p.plan, &p.ws)
    }

    fn read_split_k(&self, plan: &SplitK, ws: &Workspace) -> Result<Partial, KernelError> {
        let mq = plan.mq as usize;
        if plan.keys == 0 {
            return Ok(Partial::empty(mq));
        }
        // One copy: o, then m, then l (a kept workspace may be longer).
        let mut o = self.download(&ws.out, mq * (D_LATENT + 2))?;
        let l = o.split_off(mq * (D_LATENT + 1));
        let m = o.split_off(mq * D_LATENT);
        Ok(Partial { o, m, l })
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
        let call = ResidentCall {
            tokens,
            q,
            sel,
            scale,
        };
        let plan = self.resident_plan(rows, &call)?;
        if plan.keys == 0 {
            return Ok(Partial::empty(q.len()));
        }
        let mut scratch = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        self.launch_resident(&mut scratch, rows, (&plan, &call), false)?;
        self.read_split_k(&plan, &scratch.ws)
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
        let call = ResidentCall {
            tokens,
            q,
            sel,
            scale,
        };
        let plan = self.resident_plan(rows, &call)?;
        if plan.keys == 0 {
            return out.write(&Partial::empty(q.len()));
        }
        let mut scratch = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        self.launch_resident(&mut scratch, rows, (&plan, &call), true)?;
        let Scratch {
            wire, host_wire, ..
        } = &mut *scratch;
        let dev = wire.slice(..plan.mq as usize * PARTIAL_ROW_BYTES);
        host_wire.resize(dev.len(), 0);
        self.stream
            .memcpy_dtoh(&dev, host_wire.as_mut_slice())
            .map_err(driver("download"))?;
        for (row, src) in out
            .row_slices()
            .iter_mut()
            .zip(host_wire.chunks_exact(PARTIAL_ROW_BYTES))
        {
            row.copy_from_slice(src);
        }
        Ok(())
    }

    /// A resident call checked (the rows this GPU's, the range inside them) and planned.
    fn resident_plan(
        &self,
        rows: &DeviceRows,
        call: &ResidentCall<'_, '_>,
    ) -> Result<SplitK, KernelError> {
        if !Arc::ptr_eq(rows.rows.context(), &self.ctx) {
            return Err(KernelError::Cuda(
                "resident rows uploaded to another GPU context".into(),
            ));
        }
        let tokens = &call.tokens;
        if tokens.start > tokens.end || tokens.end > rows.tokens {
            return Err(KernelError::Parameter {
                what: "resident token range end",
                value: tokens.end as f64,
                why: "must lie within the uploaded rows, start <= end",
            });
        }
        self.plan(call.q, tokens.len(), call.sel, call.scale, None)
    }

    /// Stages a planned resident call's query rows and selection in the kept buffers and
    /// launches it: its result lands in the kept workspace, or with `wire` in the kept wire
    /// rows.
    fn launch_resident(
        &self,
        scratch: &mut Scratch,
        rows: &DeviceRows,
        (plan, call): (&SplitK, &ResidentCall<'_, '_>),
        wire: bool,
    ) -> Result<(), KernelError> {
        let Scratch {
            ws,
            wire: wire_rows,
            q,
            sel,
            ..
        } = scratch;
        let (states_len, out_len) = plan.workspace_lens();
        self.grow(&mut ws.states, states_len)?;
        self.grow(&mut ws.out, out_len)?;
        let q = self.stage(q, call.q.as_slice())?;
        let sel = call.sel.map(|s| self.stage(sel, s.raw())).transpose()?;
        // An empty range attends nothing (sparse: every index is padding), and a view of no
        // elements cannot be made: the whole upload stands in, unread.
        let cache = if call.tokens.is_empty() {
            rows.rows.slice(..)
        } else {
            rows.rows
                .slice(call.tokens.start * D_QK..call.tokens.end * D_QK)
        };
        let inputs = SplitKInputs {
            q: &q,
            cache: &cache,
            table: None,
            sel: sel.as_ref(),
        };
        if !wire {
            return self.launch_split_k(plan, &inputs, ws, None);
        }
        let bytes = plan.mq as usize * PARTIAL_ROW_BYTES;
        self.grow(wire_rows, bytes)?;
        self.launch_split_k(plan, &inputs, ws, Some(&mut wire_rows.slice_mut(..bytes)))
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

/// The split-K planner: how many tiles of keys each block of `mla_partial` takes, given
/// `tiles` tiles of keys and `groups` row groups on `sms` SMs. Enough blocks for about
/// `BLOCKS_PER_SM` per SM, but no more than `MAX_SPLITS` splits, in whole tiles.
fn plan_tiles_per_split(tiles: usize, groups: usize, sms: usize) -> usize {
    let for_blocks = (tiles * groups.max(1)).div_ceil((sms * BLOCKS_PER_SM).max(1));
    let for_combine = tiles.div_ceil(MAX_SPLITS);
    for_blocks.max(for_combine).clamp(1, tiles.max(1))
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

/// A partial's split-K shape, checked and planned.
#[derive(Debug)]
struct SplitK {
    mq: i32,
    keys: i32,
    rows_per_token: i32,
    groups_per_token: i32,
    keys_per_split: i32,
    groups: usize,
    splits: usize,
    scale: f32,
}

impl SplitK {
    /// Floats of the workspace's states and of its result: `o`, `m` and `l` of every
    /// (split, row), and of every row.
    fn workspace_lens(&self) -> (usize, usize) {
        let mq = self.mq as usize;
        (self.splits * mq * (D_LATENT + 2), mq * (D_LATENT + 2))
    }
}

/// The split-K pass's states (`o` of every split and row, then their `m`, then their `l`)
/// and the combine's result (`o`, `m`, `l` of every row, likewise), one allocation each.
#[derive(Debug)]
struct Workspace {
    states: CudaSlice<f32>,
    out: CudaSlice<f32>,
}

/// What `mla_partial` reads.
struct SplitKInputs<'a, 'b> {
    q: &'a CudaView<'b, u16>,
    cache: &'a CudaView<'b, u16>,
    table: Option<&'a CudaSlice<u32>>,
    sel: Option<&'a CudaView<'b, i32>>,
}

/// Buffers [`Gpu::partial_resident`] keeps between calls (grown, never shrunk; one element
/// each until first used), so that a holder's call allocates nothing once the largest shape
/// has been seen: the split-K workspace, room for the query rows and the selection, and the
/// wire rows on the device and on their way to the caller's runs.
#[derive(Debug)]
struct Scratch {
    ws: Workspace,
    wire: CudaSlice<u8>,
    host_wire: Vec<u8>,
    q: CudaSlice<u16>,
    sel: CudaSlice<i32>,
}

/// A resident call's arguments besides the rows.
struct ResidentCall<'q, 's> {
    tokens: Range<usize>,
    q: &'q Queries<'q>,
    sel: Option<&'s Selection<'s>>,
    scale: f32,
}

/// A partial's inputs and outputs resident on the GPU (see [`Gpu::prepare_partial`]).
#[derive(Debug)]
pub struct PreparedPartial {
    plan: SplitK,
    q: CudaSlice<u16>,
    cache: CudaSlice<u16>,
    table: Option<CudaSlice<u32>>,
    sel: Option<CudaSlice<i32>>,
    ws: Workspace,
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
    /// The split-K grid: (splits of the keys, row groups).
    pub fn grid(&self) -> (usize, usize) {
        (self.plan.splits, self.plan.groups)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The planner picks, at each operating point swept on an H200 (132 SMs), the split
    /// that was fastest there or within the sweep's run-to-run noise of it (docs/kernels.md:
    /// tiles per split 1, 2, 4, 8, 16, 64 against the planner, partial and combine timed
    /// together).
    #[test]
    fn the_split_planner_picks_the_h200_sweeps_fastest_splits() {
        let h200 = 132;
        let tiles = |keys: usize| keys.div_ceil(TILE);
        // (keys, row groups of 8, tiles per split measured fastest)
        for (keys, groups, best) in [
            (2048, 1, 1),  // Mq = 1
            (2048, 2, 1),  // Mq = 16, and sparse top-2048 x 16 heads
            (2048, 32, 4), // Mq = 256: 152 us against 205 at the old planner's 15
            (8192, 1, 2),  // Mq = 1: 19.8 us against 27.1 with 512 splits
            (8192, 16, 8), // Mq = 128: 281 us against 404 at the old planner's 31
            (2048, 16, 2), // sparse top-2048 x 128 heads
            (512, 2, 1),   // sparse top-512 x 16 heads
        ] {
            assert_eq!(
                plan_tiles_per_split(tiles(keys), groups, h200),
                best,
                "{keys} keys, {groups} groups"
            );
        }
    }

    #[test]
    fn the_split_planner_stays_in_whole_tiles_of_the_keys() {
        for tiles in [1, 2, 7, 128, 100_000] {
            for groups in [0, 1, 3, 65_535] {
                for sms in [0, 1, 132] {
                    let t = plan_tiles_per_split(tiles, groups, sms);
                    assert!((1..=tiles).contains(&t), "{tiles} {groups} {sms}: {t}");
                    assert!(tiles.div_ceil(t) <= MAX_SPLITS);
                }
            }
        }
    }
}
