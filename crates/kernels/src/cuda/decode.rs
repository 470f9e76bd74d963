//! The tensor-core decode kernel (`decode.cu`) from the host: the launch plan of a batch (pure,
//! tested without a GPU, and run through the CPU emulation of the kernel in this module's
//! tests), the pool kept on the device, and the launches.
//!
//! A batch is cut into work items of up to `16 MT` query rows that share their keys (a dense
//! request's rows in blocks; a sparse request's rows of one query token), `MT` (1, 2 or 4) the
//! smallest that holds the largest group, and the keys of every request into the same number
//! of splits ([`choose_splits`]). Grid = (work items, splits): one split writes the finished
//! partial (or its wire rows) directly; with several, each writes its state and the last of a
//! work item's blocks combines them: one launch either way.

use std::sync::atomic::Ordering;
use std::sync::{PoisonError, atomic::AtomicU64};

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};

use super::{Gpu, NULL_WIRE, Workspace, driver};
use crate::batch::{DecodeRequest, KvPool, PoolShape, check_batch, check_results};
use crate::error::KernelError;
use crate::layout::{D_LATENT, PARTIAL_ROW_BYTES};
use crate::partial::{Partial, WireOut};

/// Threads per block (`DEC_THREADS`).
pub(crate) const DEC_THREADS: u32 = 256;
/// Keys per tile (`DEC_BN`).
pub(crate) const DEC_BN: usize = 32;
/// The fewest tiles of keys a split takes: a split pays for filling its pipeline.
const MIN_TILES_PER_SPLIT: usize = 2;
/// The most splits: the last block of a work item reads back 2 KB a split and row.
const MAX_SPLITS: usize = 256;
/// The kernels, by (FP8, MT = 1, 2, 4).
pub(crate) const DECODE_KERNELS: [&str; 6] = [
    "mla_decode_m1",
    "mla_decode_m2",
    "mla_decode_m4",
    "mla_decode_fp8_m1",
    "mla_decode_fp8_m2",
    "mla_decode_fp8_m4",
];

/// `DecCfg<MT, FP8>` of decode.cu: pipeline stages and dynamic shared memory of a variant
/// (the emulation prints decode.cu's own figures, and a test compares them with these).
pub(crate) const fn decode_layout(mt: usize, fp8: bool) -> (usize, usize) {
    const KROW: usize = 576 + 8;
    const PROW: usize = DEC_BN + 8;
    const SROW: usize = DEC_BN + 8;
    let bm = 16 * mt;
    let stages = match (fp8, mt) {
        (true, 4) => 4,
        (true, _) => 6,
        (false, 1) => 5,
        (false, 2) => 4,
        (false, _) => 3,
    };
    // KG: the S phase's groups of dims, one buffer of partial scores each.
    let sbufs = if mt == 4 { 2 } else { 4 };
    let stage_row = if fp8 {
        crate::fp8::FP8_ROW_BYTES
    } else {
        KROW * 2
    };
    let bytes = bm * KROW * 2
        + stages * DEC_BN * stage_row
        + if fp8 { DEC_BN * KROW * 2 } else { 0 }
        + sbufs * bm * SROW * 4
        + bm * PROW * 2
        + 3 * bm * 4
        + stages * DEC_BN * 4
        + 16;
    (stages, bytes)
}

/// The index into [`DECODE_KERNELS`] of a variant.
fn kernel_index(mt: usize, fp8: bool) -> usize {
    usize::from(fp8) * 3 + mt.trailing_zeros() as usize
}

/// (row, split) states the last block of a work item reads back in the time a block takes
/// for one tile of keys: a state is 2 KB of f32 `o`, a bf16 tile 32 x 1152 B = 36 KB, both
/// read by one SM from L2 or HBM.
const STATES_PER_TILE: f64 = 18.0;

/// How many splits of the keys a batch of `work` work items of up to `rows` query rows gets
/// on `sms` SMs (one block per SM: each takes most of an SM's shared memory), when its longest
/// request has `max_tiles` tiles of keys: the fewest that reach the lowest time, taken as the
/// waves of blocks times the tiles a block works through plus the last block's combine
/// (`rows` x splits states, [`STATES_PER_TILE`] a tile), each extra split kept only for a
/// gain of more than 5%, and at least [`MIN_TILES_PER_SPLIT`] tiles a split. Many rows
/// thus split less: a 64-row item's states outweigh its keys long before 32 splits.
pub(crate) fn choose_splits(work: usize, max_tiles: usize, rows: usize, sms: usize) -> usize {
    let (work, sms) = (work.max(1), sms.max(1));
    let most = max_tiles.div_ceil(MIN_TILES_PER_SPLIT).clamp(1, MAX_SPLITS);
    let cost = |s: usize| {
        let blocks = ((work * s).div_ceil(sms) * max_tiles.div_ceil(s).max(1)) as f64;
        let combine = if s > 1 {
            (rows * s) as f64 / STATES_PER_TILE
        } else {
            0.0
        };
        blocks + combine
    };
    let mut best = (cost(1), 1);
    for s in 2..=most {
        let c = cost(s);
        if c < best.0 * 0.95 {
            best = (c, s);
        }
    }
    best.1
}

/// A checked batch cut into the kernel's launch: what goes to the device and the grid.
#[derive(Debug, Clone)]
pub(crate) struct DecodePlan {
    /// Row tiles per block (1, 2 or 4).
    pub(crate) mt: usize,
    pub(crate) shape: PoolShape,
    pub(crate) splits: usize,
    /// Query rows of the whole batch.
    pub(crate) rows: usize,
    /// Per request: (first entry of its table in `tables`, tokens, keys, tiles per split).
    pub(crate) reqs: Vec<i32>,
    /// Per work item: (request, first row, rows, first index in `sel` or -1).
    pub(crate) work: Vec<i32>,
    /// The used part of every request's table, one after another.
    pub(crate) tables: Vec<u32>,
    /// Every sparse request's selection, one after another.
    pub(crate) sel: Vec<i32>,
    /// Every request's query rows, one after another.
    pub(crate) q: Vec<u16>,
    /// Each request's first row, and the total at the end.
    pub(crate) row_starts: Vec<usize>,
    pub(crate) scale: f32,
}

fn index(what: &'static str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::Parameter {
        what,
        value: v as f64,
        why: "exceeds the kernel's 32-bit index",
    })
}

impl DecodePlan {
    /// Checks `requests` against `shape` and cuts them into work items for `sms` SMs.
    pub(crate) fn new(
        shape: PoolShape,
        requests: &[DecodeRequest<'_>],
        scale: f32,
        sms: usize,
    ) -> Result<Self, KernelError> {
        Self::with_splits(shape, requests, scale, |work, tiles, rows| {
            choose_splits(work, tiles, rows, sms)
        })
    }

    /// [`DecodePlan::new`] with the number of splits chosen by `splits(work items, most
    /// tiles of a request, most rows of a work item)` (at least 1).
    pub(crate) fn with_splits(
        shape: PoolShape,
        requests: &[DecodeRequest<'_>],
        scale: f32,
        splits: impl FnOnce(usize, usize, usize) -> usize,
    ) -> Result<Self, KernelError> {
        check_batch(&shape, requests, scale)?;
        let group = |r: &DecodeRequest<'_>| {
            r.selection()
                .map_or(r.queries().len(), |s| s.rows_per_token())
        };
        let mt = match requests.iter().map(group).max().unwrap_or(1) {
            0..=16 => 1,
            17..=32 => 2,
            _ => 4,
        };
        let bm = 16 * mt;
        let mut plan = Self {
            mt,
            shape,
            splits: 1,
            rows: 0,
            reqs: Vec::with_capacity(4 * requests.len()),
            work: Vec::new(),
            tables: Vec::new(),
            sel: Vec::new(),
            q: Vec::new(),
            row_starts: Vec::with_capacity(requests.len() + 1),
            scale,
        };
        let mut max_tiles = 0;
        for (i, r) in requests.iter().enumerate() {
            let (mq, first) = (r.queries().len(), plan.rows);
            plan.row_starts.push(first);
            plan.q.extend_from_slice(r.queries().as_slice());
            let table_at = index("block table entries", plan.tables.len())?;
            let used = r.tokens().div_ceil(shape.block_tokens);
            plan.tables.extend_from_slice(&r.table()[..used]);
            let keys = match r.selection() {
                None => {
                    for b in (0..mq).step_by(bm) {
                        let n = bm.min(mq - b);
                        plan.work
                            .extend([i as i32, index("query rows", first + b)?, n as i32, -1]);
                    }
                    r.tokens()
                }
                Some(sel) => {
                    let (k, per) = (sel.k(), sel.rows_per_token());
                    let sel_at = plan.sel.len();
                    plan.sel.extend_from_slice(sel.raw());
                    for t in 0..mq / per {
                        for b in (0..per).step_by(bm) {
                            plan.work.extend([
                                i as i32,
                                index("query rows", first + t * per + b)?,
                                bm.min(per - b) as i32,
                                index("selected indices", sel_at + t * k)?,
                            ]);
                        }
                    }
                    k
                }
            };
            let tiles = keys.div_ceil(DEC_BN);
            max_tiles = max_tiles.max(tiles);
            plan.reqs.extend([
                table_at,
                index("tokens", r.tokens())?,
                index("keys", keys)?,
                0,
            ]);
            plan.rows = first + mq;
        }
        plan.row_starts.push(plan.rows);
        index("query rows", plan.rows)?;
        index("selected indices", plan.sel.len())?;
        let item_rows = plan
            .work
            .chunks_exact(4)
            .map(|w| w[2] as usize)
            .max()
            .unwrap_or(1);
        plan.splits = splits(plan.work.len() / 4, max_tiles, item_rows).clamp(1, MAX_SPLITS);
        for r in plan.reqs.chunks_exact_mut(4) {
            let tiles = (r[2] as usize).div_ceil(DEC_BN);
            r[3] = tiles.div_ceil(plan.splits) as i32;
        }
        Ok(plan)
    }

    /// Work items (grid.x).
    pub(crate) fn work_items(&self) -> usize {
        self.work.len() / 4
    }

    /// The kernel's `mode`: 1 the f32 partial, 2 wire rows.
    fn mode(wire: bool) -> i32 {
        if wire { 2 } else { 1 }
    }

    /// Floats of the workspace's split states (none unsplit) and of its result.
    fn workspace_lens(&self) -> (usize, usize) {
        let per = D_LATENT + 2;
        let states = if self.splits > 1 { self.splits } else { 0 };
        ((states * self.rows * per).max(1), self.rows * per)
    }

    /// The per-request partials out of one f32 result (`o` of every row, then `m`, then `l`).
    fn split_result(&self, all: &[f32]) -> Vec<Partial> {
        let rows = self.rows;
        let (o, ml) = all.split_at(rows * D_LATENT);
        let (m, l) = ml.split_at(rows);
        self.row_starts
            .windows(2)
            .map(|w| Partial {
                o: o[w[0] * D_LATENT..w[1] * D_LATENT].to_vec(),
                m: m[w[0]..w[1]].to_vec(),
                l: l[w[0]..w[1]].to_vec(),
            })
            .collect()
    }
}

/// A cache pool kept on a GPU ([`Gpu::upload_pool`]): what a holder attends without moving it
/// again. Freed when dropped.
#[derive(Debug)]
pub struct DevicePool {
    bytes: CudaSlice<u8>,
    shape: PoolShape,
}

impl DevicePool {
    /// Block size, block count and row format.
    pub fn shape(&self) -> PoolShape {
        self.shape
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes.len()
    }
}

/// A batch's inputs and outputs resident on the GPU ([`Gpu::prepare_batched`]): launched
/// again and again over the same pool, which is how the benchmark times the kernel alone.
#[derive(Debug)]
pub struct PreparedBatch {
    plan: DecodePlan,
    q: CudaSlice<u16>,
    tables: CudaSlice<u32>,
    reqs: CudaSlice<i32>,
    work: CudaSlice<i32>,
    sel: CudaSlice<i32>,
    ws: Workspace,
    counters: CudaSlice<i32>,
}

impl PreparedBatch {
    /// (work items, splits): the kernel's grid.
    pub fn grid(&self) -> (usize, usize) {
        (self.plan.work_items(), self.plan.splits)
    }

    /// Row tiles of 16 per block (1, 2 or 4).
    pub fn row_tiles(&self) -> usize {
        self.plan.mt
    }
}

/// The device views one launch reads.
struct DecodeInputs<'a> {
    q: CudaView<'a, u16>,
    tables: CudaView<'a, u32>,
    reqs: CudaView<'a, i32>,
    work: CudaView<'a, i32>,
    sel: CudaView<'a, i32>,
}

/// Kernel launches counted: what a test asserts batching with.
#[derive(Debug, Default)]
pub(crate) struct LaunchCount(AtomicU64);

impl LaunchCount {
    fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
}

impl Gpu {
    /// Launches of the decode kernel so far, in this process.
    pub fn decode_launches(&self) -> u64 {
        self.launches.0.load(Ordering::Relaxed)
    }

    /// Uploads a pool to stay on this GPU.
    pub fn upload_pool(&self, pool: &KvPool<'_>) -> Result<DevicePool, KernelError> {
        Ok(DevicePool {
            bytes: self.upload(pool.bytes())?,
            shape: pool.shape(),
        })
    }

    /// Uploads a bf16 pool in `parts`, one after another (each a whole number of blocks of
    /// `block_tokens` rows): what a holder does with its chunks, so that one batch can attend
    /// any of them. Returns the pool and each part's first block.
    pub fn upload_pool_parts(
        &self,
        parts: &[&[u16]],
        block_tokens: usize,
    ) -> Result<(DevicePool, Vec<u32>), KernelError> {
        let mut firsts = Vec::with_capacity(parts.len());
        let mut blocks = 0usize;
        for part in parts {
            firsts.push(u32::try_from(blocks).map_err(|_| KernelError::Parameter {
                what: "pool blocks",
                value: blocks as f64,
                why: "exceeds a block table's 32-bit entries",
            })?);
            blocks += KvPool::bf16(part, block_tokens)?.shape().blocks;
        }
        let block_bytes = block_tokens * crate::layout::D_QK * 2;
        let mut bytes: CudaSlice<u8> = self.zeros(blocks * block_bytes)?;
        for (part, &first) in parts.iter().zip(&firsts) {
            let host = KvPool::bf16(part, block_tokens)?.bytes();
            if host.is_empty() {
                continue;
            }
            let at = first as usize * block_bytes;
            self.stream
                .memcpy_htod(host, &mut bytes.slice_mut(at..at + host.len()))
                .map_err(driver("upload"))?;
        }
        let shape = PoolShape {
            block_tokens,
            blocks,
            fp8: false,
        };
        Ok((DevicePool { bytes, shape }, firsts))
    }

    /// [`crate::partial_batched`] on this GPU, host to host: the pool is uploaded for the call.
    pub fn partial_batched(
        &self,
        pool: &KvPool<'_>,
        requests: &[DecodeRequest<'_>],
        scale: f32,
    ) -> Result<Vec<Partial>, KernelError> {
        let plan = DecodePlan::new(pool.shape(), requests, scale, self.info.sms)?;
        let dev = self.upload_pool(pool)?;
        let parts = self.run_batch(&dev.bytes.slice(..), &plan, None)?;
        check_results(requests, &parts)?;
        Ok(parts)
    }

    /// The batch over a pool kept on this GPU: only the query rows, tables and selections go
    /// up, the partials come down. Calls on one GPU run one at a time (they share its kept
    /// buffers).
    pub fn partial_batched_resident(
        &self,
        pool: &DevicePool,
        requests: &[DecodeRequest<'_>],
        scale: f32,
    ) -> Result<Vec<Partial>, KernelError> {
        let plan = DecodePlan::new(pool.shape, requests, scale, self.info.sms)?;
        let parts = self.run_batch(&pool.bytes.slice(..), &plan, None)?;
        check_results(requests, &parts)?;
        Ok(parts)
    }

    /// [`Gpu::partial_batched_resident`] into wire rows (`out`: every request's rows in
    /// order), encoded on the GPU: the rows come down at half the bytes of the f32 partial.
    pub fn partial_batched_resident_wire(
        &self,
        pool: &DevicePool,
        requests: &[DecodeRequest<'_>],
        scale: f32,
        out: &mut WireOut<'_>,
    ) -> Result<(), KernelError> {
        let plan = DecodePlan::new(pool.shape, requests, scale, self.info.sms)?;
        crate::error::check_len("partial wire rows", plan.rows, out.rows())?;
        self.run_batch(&pool.bytes.slice(..), &plan, Some(out))?;
        out.check_finite_batch(requests)
    }

    /// Stages `plan`'s inputs in the kept buffers, launches it over `kv` (a pool's rows), and
    /// brings the result down: as partials, or with `wire` into its rows (then no partials).
    pub(super) fn run_batch<T: DeviceRepr>(
        &self,
        kv: &CudaView<'_, T>,
        plan: &DecodePlan,
        wire: Option<&mut WireOut<'_>>,
    ) -> Result<Vec<Partial>, KernelError> {
        if plan.rows == 0 {
            return Ok(Vec::new());
        }
        let mut guard = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        let s = &mut *guard;
        let (states, out) = plan.workspace_lens();
        self.grow(&mut s.ws.states, states)?;
        self.grow(&mut s.ws.out, out)?;
        self.grow(&mut s.counters, plan.work_items())?;
        let inputs = DecodeInputs {
            q: self.stage(&mut s.q, &plan.q)?,
            tables: self.stage(&mut s.tables, &plan.tables)?,
            reqs: self.stage(&mut s.reqs, &plan.reqs)?,
            work: self.stage(&mut s.work, &plan.work)?,
            sel: self.stage(&mut s.sel, &plan.sel)?,
        };
        let Some(out) = wire else {
            self.launch_decode(plan, kv, &inputs, (&mut s.ws, &mut s.counters), None)?;
            let all = self.download(&s.ws.out, out)?;
            return Ok(plan.split_result(&all));
        };
        let bytes = plan.rows * PARTIAL_ROW_BYTES;
        self.grow(&mut s.wire, bytes)?;
        let mut dev = s.wire.slice_mut(..bytes);
        self.launch_decode(
            plan,
            kv,
            &inputs,
            (&mut s.ws, &mut s.counters),
            Some(&mut dev),
        )?;
        s.host_wire.resize(bytes, 0);
        self.stream
            .memcpy_dtoh(&s.wire.slice(..bytes), s.host_wire.as_mut_slice())
            .map_err(driver("download"))?;
        for (row, src) in out
            .row_slices()
            .iter_mut()
            .zip(s.host_wire.chunks_exact(PARTIAL_ROW_BYTES))
        {
            row.copy_from_slice(src);
        }
        Ok(Vec::new())
    }

    /// Uploads a batch's inputs against `pool` once, for [`Gpu::launch_batched`].
    pub fn prepare_batched(
        &self,
        pool: &DevicePool,
        requests: &[DecodeRequest<'_>],
        scale: f32,
    ) -> Result<PreparedBatch, KernelError> {
        let plan = DecodePlan::new(pool.shape, requests, scale, self.info.sms)?;
        let (states, out) = plan.workspace_lens();
        Ok(PreparedBatch {
            q: self.upload(&plan.q)?,
            tables: self.upload(&plan.tables)?,
            reqs: self.upload(&plan.reqs)?,
            work: self.upload(&plan.work)?,
            sel: self.upload(&plan.sel)?,
            ws: Workspace {
                states: self.zeros(states)?,
                out: self.zeros(out)?,
            },
            counters: self.zeros(plan.work_items())?,
            plan,
        })
    }

    /// Launches a prepared batch over `pool` (the one it was prepared against) without waiting.
    pub fn launch_batched(
        &self,
        pool: &DevicePool,
        p: &mut PreparedBatch,
    ) -> Result<(), KernelError> {
        if pool.shape != p.plan.shape {
            return Err(KernelError::Cuda(
                "a prepared batch launched over another pool than its own".into(),
            ));
        }
        let inputs = DecodeInputs {
            q: p.q.slice(..),
            tables: p.tables.slice(..),
            reqs: p.reqs.slice(..),
            work: p.work.slice(..),
            sel: p.sel.slice(..),
        };
        self.launch_decode(
            &p.plan,
            &pool.bytes.slice(..),
            &inputs,
            (&mut p.ws, &mut p.counters),
            None,
        )
    }

    /// The last launched result of `p`, per request (waits for it).
    pub fn read_batched(&self, p: &PreparedBatch) -> Result<Vec<Partial>, KernelError> {
        let (_, out) = p.plan.workspace_lens();
        Ok(p.plan.split_result(&self.download(&p.ws.out, out)?))
    }

    /// The batched kernel over `kv` (a pool's rows, or a view of resident rows): the result in
    /// `ws.out`, or with `wire` in its rows. `counters` holds a zero per work item (the
    /// kernel leaves them zero).
    fn launch_decode<T: DeviceRepr>(
        &self,
        plan: &DecodePlan,
        kv: &CudaView<'_, T>,
        inputs: &DecodeInputs<'_>,
        (ws, counters): (&mut Workspace, &mut CudaSlice<i32>),
        wire: Option<&mut CudaViewMut<'_, u8>>,
    ) -> Result<(), KernelError> {
        if plan.rows == 0 {
            return Ok(());
        }
        let (rows, splits) = (plan.rows, plan.splits);
        let mode = DecodePlan::mode(wire.is_some());
        let (block_tokens, total_rows) = (
            index("tokens per block", plan.shape.block_tokens)?,
            index("query rows", rows)?,
        );
        let f = &self.decode[kernel_index(plan.mt, plan.shape.fp8)];
        let mut b = self.stream.launch_builder(f);
        b.arg(&inputs.q)
            .arg(kv)
            .arg(&block_tokens)
            .arg(&inputs.tables)
            .arg(&inputs.reqs)
            .arg(&inputs.work)
            .arg(&inputs.sel)
            .arg(&total_rows)
            .arg(&plan.scale)
            .arg(&mode);
        let states = if splits > 1 { splits * rows } else { 0 };
        let (mut ws_o, mut ws_ml) = ws.states.split_at_mut(states * D_LATENT);
        let (mut ws_m, mut ws_l) = ws_ml.split_at_mut(states);
        b.arg(&mut ws_o).arg(&mut ws_m).arg(&mut ws_l).arg(counters);
        let (mut o, mut ml) = ws.out.split_at_mut(rows * D_LATENT);
        let (mut m, mut l) = ml.split_at_mut(rows);
        b.arg(&mut o).arg(&mut m).arg(&mut l);
        match wire {
            Some(w) => b.arg(w),
            None => b.arg(&NULL_WIRE),
        };
        let (_, smem) = decode_layout(plan.mt, plan.shape.fp8);
        let cfg = LaunchConfig {
            grid_dim: (plan.work_items() as u32, splits as u32, 1),
            block_dim: (DEC_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: the arguments match decode_body's in order and type. DecodePlan::new
        // checked every table entry a context token reaches against the pool's blocks and
        // every selected index against its request's tokens, so the kernel reads inside `kv`
        // and the staged arrays. It writes `rows` rows (f32, or to `wire`, which holds rows x
        // 1032 bytes), with several splits splits x rows states first, which the workspace
        // holds, and one counter per work item, which `counters` holds.
        unsafe { b.launch(cfg) }.map_err(driver("mla_decode"))?;
        self.launches.add(1);
        Ok(())
    }
}

impl WireOut<'_> {
    /// [`WireOut::check_finite`] over a batch's rows, naming the request.
    fn check_finite_batch(&self, requests: &[DecodeRequest<'_>]) -> Result<(), KernelError> {
        let mut owner = Vec::with_capacity(self.rows());
        for (i, r) in requests.iter().enumerate() {
            owner.extend((0..r.queries().len()).map(|row| (i, row)));
        }
        debug_assert_eq!(owner.len(), self.rows());
        self.check_finite(|at| {
            let (i, row) = owner[at];
            requests[i].attends(row)
        })
        .map_err(|e| match e {
            KernelError::NonFinite { row, why } => {
                let (i, r) = owner[row];
                crate::batch::in_request(i, KernelError::NonFinite { row: r, why })
            }
            other => other,
        })
    }
}

#[cfg(test)]
mod tests;
