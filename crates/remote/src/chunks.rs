//! What a holder serves: full blocks (paper 003 A.5: every layer of a chunk's tokens) that
//! the caller already has in one registered region, each described by a [`HeldChunk`].
//!
//! A serving engine registers its own KV memory with the transfer engine and hands it over
//! here; [`HeldChunks::generate`] fills a fresh region from the synthetic corpus for tests,
//! the demo and benchmarks. The region must be registered [`Access::Local`]: its descriptor
//! goes to every requester (fetch writes from it), and no peer write, forged or mistaken,
//! may land in the KV.

use std::collections::BTreeMap;

use kvroute_kernels::RopeLayout;
use kvroute_kvstore::{BlockLayout, ChunkEntry, ChunkId, CorpusSpec, FullBlock};
use kvroute_transport::{Access, NetAddr, RegisteredBuffer, TransferEngine};

use crate::error::RemoteError;

/// One chunk's full block in the held region.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldChunk {
    /// The chunk.
    pub id: ChunkId,
    /// Byte offset of its full block in the region.
    pub offset: usize,
    /// Its layers and tokens.
    pub layout: BlockLayout,
    /// How its RoPE band pairs up.
    pub rope_layout: RopeLayout,
    /// The position each token's RoPE band was rotated to (`layout.tokens` of them): a
    /// requester that fetches the chunk splices it from these to its own.
    pub positions: Vec<i64>,
}

/// Chunks in one registered region, checked to lie inside it without overlapping.
#[derive(Debug)]
pub struct HeldChunks {
    store: RegisteredBuffer,
    chunks: Vec<HeldChunk>,
    by_id: BTreeMap<ChunkId, usize>,
}

impl HeldChunks {
    /// Serves `chunks` out of `store`. Refused: a region peers may write, no chunks, a chunk
    /// listed twice, a bad layout, a position count that is not the token count, negative
    /// positions, a full block outside the region or overlapping another, or a block offset
    /// that is not 2-byte aligned (blocks are bf16).
    pub fn new(store: RegisteredBuffer, chunks: Vec<HeldChunk>) -> Result<Self, RemoteError> {
        if store.access() != Access::Local {
            return Err(RemoteError::Chunks(
                "the held region must be registered local only (Access::Local): its \
                 descriptor is published, and peers must not be able to write the KV"
                    .into(),
            ));
        }
        if chunks.is_empty() {
            return Err(RemoteError::Chunks("a holder needs chunks".into()));
        }
        let mut by_id = BTreeMap::new();
        let mut spans = Vec::with_capacity(chunks.len());
        for (i, c) in chunks.iter().enumerate() {
            let bad = |why: &str| RemoteError::Chunks(format!("{}: {why}", c.id));
            if by_id.insert(c.id, i).is_some() {
                return Err(bad("listed twice"));
            }
            c.layout.validate()?;
            if c.positions.len() != c.layout.tokens as usize {
                return Err(bad("needs one stored position per token"));
            }
            if c.positions.iter().any(|&p| p < 0) {
                return Err(bad("has a negative stored position"));
            }
            if !c.offset.is_multiple_of(2) {
                return Err(bad("full block offset is not 2-byte aligned"));
            }
            let end = c.offset.checked_add(c.layout.full_bytes());
            if end.is_none_or(|end| end > store.len()) {
                return Err(bad("full block lies outside the region"));
            }
            spans.push((c.offset, c.offset + c.layout.full_bytes(), c.id));
        }
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(RemoteError::Chunks(format!(
                "{} and {} overlap in the region",
                w[0].2, w[1].2
            )));
        }
        Ok(Self {
            store,
            chunks,
            by_id,
        })
    }

    /// A fresh local-only region holding `ids` of the synthetic `corpus`, one after another.
    pub fn generate(
        engine: &TransferEngine,
        corpus: &CorpusSpec,
        ids: &[ChunkId],
    ) -> Result<Self, RemoteError> {
        corpus.validate()?;
        let layout = corpus.layout();
        let bytes = layout
            .full_bytes()
            .checked_mul(ids.len())
            .ok_or_else(|| RemoteError::Chunks("too many chunks for one region".into()))?;
        let store = engine.alloc_mr_with(bytes.max(1), Access::Local)?;
        let mut chunks = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let mut block = vec![0u16; layout.full_elems()];
            corpus.fill(id, &mut block)?;
            let offset = i * layout.full_bytes();
            let bytes: Vec<u8> = block.iter().flat_map(|w| w.to_le_bytes()).collect();
            store.write_at(offset, &bytes)?;
            chunks.push(HeldChunk {
                id,
                offset,
                layout,
                rope_layout: corpus.rope_layout,
                positions: corpus.positions(id),
            });
        }
        Self::new(store, chunks)
    }

    /// The chunks, in the order given.
    pub fn chunks(&self) -> &[HeldChunk] {
        &self.chunks
    }

    /// The region.
    pub fn store(&self) -> &RegisteredBuffer {
        &self.store
    }

    /// The chunk `id`, if held.
    pub fn get(&self, id: ChunkId) -> Option<&HeldChunk> {
        self.by_id.get(&id).map(|&i| &self.chunks[i])
    }

    /// The registry entries requesters receive, for a holder at `holder`.
    pub fn entries(&self, holder: &NetAddr) -> Vec<ChunkEntry> {
        self.chunks
            .iter()
            .map(|c| ChunkEntry {
                id: c.id,
                holder: holder.clone(),
                desc: self.store.desc().clone(),
                offset: c.offset as u64,
                layout: c.layout,
                rope_layout: c.rope_layout,
                positions: c.positions.clone(),
            })
            .collect()
    }

    /// Chunk `chunk`'s full block.
    pub(crate) fn block(&self, chunk: &HeldChunk) -> Result<FullBlock<'_>, RemoteError> {
        // SAFETY: the region is registered local only (checked in `new`), so no peer writes
        // it; this crate never writes it; the caller that handed it over gave up its
        // ownership with it. The range lies inside it (checked in `new`).
        let elems = unsafe { self.store.u16s(chunk.offset, chunk.layout.full_elems())? };
        Ok(FullBlock::new(elems, chunk.layout)?)
    }

    /// `len` bytes of the region at `offset`, for packing gathered rows.
    pub(crate) fn bytes(&self, offset: usize, len: usize) -> Result<&[u8], RemoteError> {
        // SAFETY: as in `block`: nothing writes the region.
        Ok(unsafe { self.store.bytes(offset, len)? })
    }
}
