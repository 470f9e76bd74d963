//! Where a holder's partials run: on the CPU over the held region, or on a GPU over copies of
//! the held chunks uploaded once when the holder starts (resident), so that a call moves only
//! its query rows up and its partial down, and one launch of the batched kernel serves every
//! (chunk, layer) group of a batch.

use std::collections::BTreeMap;

use kvroute_kernels::cuda::{DevicePool, Gpu};
use kvroute_kernels::layout::PAGE_TOKENS;
use kvroute_kernels::{
    Backend, Call, DecodeRequest, Queries, Selection, WireOut, partial_dense_wire,
    partial_sparse_wire,
};
use kvroute_kvstore::ChunkId;

use crate::Sparse;
use crate::chunks::{HeldChunk, HeldChunks};
use crate::error::RemoteError;

/// The held chunks' full blocks on one GPU, one pool of 64-token blocks: each chunk's block
/// whole (every layer, padding included, so layer `l`'s tokens start `l x padded tokens`
/// rows in, a whole number of blocks), one after another.
struct Resident {
    gpu: &'static Gpu,
    pool: DevicePool,
    /// Each chunk's first block in the pool.
    first: BTreeMap<ChunkId, u32>,
}

/// One (chunk, layer) group of a batched call: its held chunk, its layer, its query rows, and
/// for sparse attention its selection.
pub(super) struct GroupCall<'a> {
    pub(super) held: &'a HeldChunk,
    pub(super) layer: u32,
    pub(super) q: Queries<'a>,
    pub(super) sel: Option<Sparse<'a>>,
}

/// `sel` checked as the kernels take it, against `mq` query rows over `tokens` tokens.
fn checked<'a>(sel: Sparse<'a>, mq: usize, tokens: usize) -> Result<Selection<'a>, RemoteError> {
    let (k, per) = (sel.k as usize, sel.rows_per_token as usize);
    Ok(Selection::new(sel.indices, k, per, mq, tokens)?)
}

/// A holder's kernels: its backend and, where that runs partials on a GPU, the chunks there.
pub(super) struct Compute {
    backend: Backend,
    resident: Option<Resident>,
}

impl Compute {
    /// For `backend`: [`Backend::Cuda`] uploads every chunk to the GPU and fails if it cannot;
    /// [`Backend::Auto`] uploads them where a GPU is usable and serves from host memory where
    /// not (or where the upload failed, which it logs); the CPU backends upload nothing.
    pub(super) fn new(chunks: &HeldChunks, backend: Backend) -> Result<Self, RemoteError> {
        let resident = match backend {
            Backend::Cuda => Some(upload(Gpu::global()?, chunks)?),
            Backend::Auto => match Gpu::global() {
                Err(_) => None,
                Ok(gpu) => upload(gpu, chunks)
                    .inspect_err(|e| {
                        tracing::warn!(%e, "chunks not uploaded to the GPU; serving from host memory");
                    })
                    .ok(),
            },
            _ => None,
        };
        Ok(Self { backend, resident })
    }

    /// The GPU that serves partials of `rows` query rows, if one does.
    fn gpu_for(&self, rows: usize) -> Option<&Resident> {
        let call = Call::ResidentPartial { rows };
        self.resident
            .as_ref()
            .filter(|_| self.backend.resolve(call) == Backend::Cuda)
    }

    /// The backend's name as a metrics label: `cuda` where chunks are resident on a GPU,
    /// else `cpu` (the CPU's instruction sets and the reference alike).
    pub(super) fn backend_label(&self) -> &'static str {
        if self.resident.is_some() {
            "cuda"
        } else {
            "cpu"
        }
    }

    /// Whether a partial of `rows` query rows runs on the GPU.
    pub(super) fn on_gpu(&self, rows: usize) -> bool {
        self.gpu_for(rows).is_some()
    }

    /// Bytes of chunks held on the GPU (0 where none are).
    pub(super) fn resident_bytes(&self) -> usize {
        self.resident.as_ref().map_or(0, |r| r.pool.bytes())
    }

    /// Whether several groups can be served by one call ([`Compute::batch_wire`]): the GPU
    /// serves partials of any size here.
    pub(super) fn batches(&self) -> bool {
        self.gpu_for(1).is_some()
    }

    /// The block table of the first `tokens` tokens of layer `layer` of `held` in the pool.
    fn table(
        r: &Resident,
        held: &HeldChunk,
        layer: u32,
        tokens: usize,
    ) -> Result<Vec<u32>, RemoteError> {
        let first = *r.first.get(&held.id).ok_or(RemoteError::Chunk {
            chunk: held.id,
            why: "not on the GPU".into(),
        })?;
        let per_layer = held.layout.padded_tokens() / PAGE_TOKENS;
        let start = first as usize + layer as usize * per_layer;
        Ok((0..tokens.div_ceil(PAGE_TOKENS))
            .map(|b| (start + b) as u32)
            .collect())
    }

    /// Every group of `calls` (one scale) in one launch on the GPU, written into `out` (their
    /// rows in order); returns the entries each group's rows attended. `Err` where there is no
    /// GPU batching here ([`Compute::batches`]) or the batch is refused; a caller then serves
    /// the groups one by one, which names what is wrong.
    pub(super) fn batch_wire(
        &self,
        calls: &[GroupCall<'_>],
        scale: f32,
        out: &mut WireOut<'_>,
    ) -> Result<Vec<usize>, RemoteError> {
        let gpu = self.gpu_for(1).ok_or(RemoteError::Kernel(
            kvroute_kernels::KernelError::CudaUnavailable("no resident GPU".into()),
        ))?;
        let mut tables = Vec::with_capacity(calls.len());
        let mut tokens = Vec::with_capacity(calls.len());
        for c in calls {
            let n = c.held.layout.tokens as usize;
            c.held.layout.layer_offset(c.layer)?;
            tables.push(Self::table(gpu, c.held, c.layer, n)?);
            tokens.push(n);
        }
        let requests = calls
            .iter()
            .zip(&tables)
            .zip(&tokens)
            .map(|((c, table), &n)| {
                Ok(match c.sel {
                    None => DecodeRequest::dense(c.q, table, n),
                    Some(sel) => DecodeRequest::sparse(c.q, table, n, checked(sel, c.q.len(), n)?),
                })
            })
            .collect::<Result<Vec<_>, RemoteError>>()?;
        gpu.gpu
            .partial_batched_resident_wire(&gpu.pool, &requests, scale, out)?;
        Ok(calls
            .iter()
            .zip(&tokens)
            .map(|(c, &n)| c.sel.map_or(n, |s| s.k as usize))
            .collect())
    }

    /// The partial of `q` over the first `tokens` tokens of layer `layer` of `held` (all of
    /// them when serving; fewer when calibrating), dense or over `sel`, written into `out`;
    /// returns the entries each row attended.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn partial_wire(
        &self,
        chunks: &HeldChunks,
        held: &HeldChunk,
        (layer, tokens): (u32, Option<usize>),
        q: &Queries<'_>,
        sel: Option<Sparse<'_>>,
        scale: f32,
        out: &mut WireOut<'_>,
    ) -> Result<usize, RemoteError> {
        let cache = chunks.layer_cache(held, layer, tokens)?;
        let tokens = cache.tokens();
        let sel = sel.map(|s| checked(s, q.len(), tokens)).transpose()?;
        let entries = sel.as_ref().map_or(tokens, Selection::k);
        if let Some(gpu) = self.gpu_for(q.len()) {
            let table = Self::table(gpu, held, layer, tokens)?;
            let request = match sel {
                None => DecodeRequest::dense(*q, &table, tokens),
                Some(sel) => DecodeRequest::sparse(*q, &table, tokens, sel),
            };
            gpu.gpu
                .partial_batched_resident_wire(&gpu.pool, &[request], scale, out)
                .map_err(|e| match e {
                    kvroute_kernels::KernelError::Request { source, .. } => *source,
                    other => other,
                })?;
        } else {
            match &sel {
                None => partial_dense_wire(self.backend, q, &cache, scale, out)?,
                Some(sel) => partial_sparse_wire(self.backend, q, &cache, sel, scale, out)?,
            }
        }
        Ok(entries)
    }
}

/// Every held chunk's full block, uploaded to `gpu` as one pool.
fn upload(gpu: &'static Gpu, chunks: &HeldChunks) -> Result<Resident, RemoteError> {
    let held: Vec<&HeldChunk> = chunks.chunks().iter().collect();
    // A paged chunk is assembled into a full block first: the GPU holds its own copy.
    let copies = held
        .iter()
        .map(|h| chunks.full_copy(h))
        .collect::<Result<Vec<_>, RemoteError>>()?;
    let parts: Vec<&[u16]> = copies.iter().map(Vec::as_slice).collect();
    let (pool, firsts) = gpu.upload_pool_parts(&parts, PAGE_TOKENS)?;
    let first = held.iter().map(|h| h.id).zip(firsts).collect();
    Ok(Resident { gpu, pool, first })
}
