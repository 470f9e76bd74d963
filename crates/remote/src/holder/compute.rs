//! Where a holder's partials run: on the CPU over the held region, or on a GPU over copies of
//! the held chunks uploaded once when the holder starts (resident), so that a call moves only
//! its query rows up and its partial down.

use std::collections::BTreeMap;

use kvroute_kernels::cuda::{DeviceRows, Gpu};
use kvroute_kernels::layout::D_QK;
use kvroute_kernels::{
    Backend, Cache, Call, Queries, Selection, WireOut, partial_dense_wire, partial_resident_wire,
    partial_sparse_wire,
};
use kvroute_kvstore::ChunkId;

use crate::chunks::{HeldChunk, HeldChunks};
use crate::error::RemoteError;

/// The held chunks' full blocks on one GPU, each uploaded whole (every layer, padding
/// included, so layer `l`'s tokens start at row `l x padded tokens`).
struct Resident {
    gpu: &'static Gpu,
    blocks: BTreeMap<ChunkId, DeviceRows>,
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

    /// Whether a partial of `rows` query rows runs on the GPU.
    pub(super) fn on_gpu(&self, rows: usize) -> bool {
        self.gpu_for(rows).is_some()
    }

    /// Bytes of chunks held on the GPU (0 where none are).
    pub(super) fn resident_bytes(&self) -> usize {
        self.resident
            .as_ref()
            .map_or(0, |r| r.blocks.values().map(DeviceRows::bytes).sum())
    }

    /// The partial of `q` over the first `tokens` tokens of layer `layer` of `held` (all of
    /// them when serving; fewer when calibrating), dense or over `sel` (`indices`, `k` per
    /// token, `rows_per_token`), written into `out`; returns the entries each row attended.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn partial_wire(
        &self,
        chunks: &HeldChunks,
        held: &HeldChunk,
        (layer, tokens): (u32, Option<usize>),
        q: &Queries<'_>,
        sel: Option<(&[i32], usize, usize)>,
        scale: f32,
        out: &mut WireOut<'_>,
    ) -> Result<usize, RemoteError> {
        let block = chunks.block(held)?.layer(layer)?;
        let tokens = tokens.map_or(block.tokens(), |t| t.min(block.tokens()));
        let sel = sel
            .map(|(indices, k, rows_per_token)| {
                Selection::new(indices, k, rows_per_token, q.len(), tokens)
            })
            .transpose()?;
        let entries = sel.as_ref().map_or(tokens, Selection::k);
        if let Some(gpu) = self.gpu_for(q.len()) {
            let rows = gpu.blocks.get(&held.id).ok_or(RemoteError::Chunk {
                chunk: held.id,
                why: "not on the GPU".into(),
            })?;
            let start = layer as usize * (held.layout.layer_elems() / D_QK);
            let range = start..start + tokens;
            partial_resident_wire(gpu.gpu, rows, range, q, sel.as_ref(), scale, out)?;
        } else {
            let cache = Cache::contiguous(&block.rows()[..tokens * D_QK])?;
            match &sel {
                None => partial_dense_wire(self.backend, q, &cache, scale, out)?,
                Some(sel) => partial_sparse_wire(self.backend, q, &cache, sel, scale, out)?,
            }
        }
        Ok(entries)
    }
}

/// Every held chunk's full block, uploaded to `gpu`.
fn upload(gpu: &'static Gpu, chunks: &HeldChunks) -> Result<Resident, RemoteError> {
    let mut blocks = BTreeMap::new();
    for held in chunks.chunks() {
        let rows = gpu.upload_rows(chunks.block(held)?.elems())?;
        blocks.insert(held.id, rows);
    }
    Ok(Resident { gpu, blocks })
}
