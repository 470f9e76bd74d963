//! What a holder serves: full blocks (paper 003 A.5: every layer of a chunk's tokens) that
//! the caller already has in one registered region, each described by a [`HeldChunk`].
//!
//! A chunk lies in the region either as one contiguous full block ([`Placement::Full`]) or,
//! as a serving engine keeps its KV, in a paged cache: fixed-size blocks of B tokens of one
//! layer each, addressed by a block table ([`Placement::Paged`]), served in place with no copy
//! into a contiguous block. A serving engine registers its own KV memory with the transfer
//! engine and hands it over here; [`HeldChunks::generate`] and [`HeldChunks::generate_paged`]
//! fill a fresh region from the synthetic corpus for tests, the demo and benchmarks, and
//! [`HeldChunks::paged_from_layers`] lays out rows an engine computed (a prefill). The region
//! must be registered [`Access::Local`]: its descriptor goes to every requester (fetch writes
//! from it), and no peer write, forged or mistaken, may land in the KV.

use std::collections::BTreeMap;

use kvroute_kernels::layout::D_QK;
use kvroute_kernels::{Cache, RopeLayout};
use kvroute_kvstore::{
    BlockLayout, ChunkEntry, ChunkId, CorpusSpec, FullBlock, MAX_BLOCK_TOKENS, ROW_BYTES,
};
use kvroute_transport::{Access, NetAddr, RegisteredBuffer, SealedBuffer, TransferEngine};

use crate::error::RemoteError;

/// Where a chunk's rows lie in the held region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// One full block (layer-major, each layer padded to whole 64-token pages) at `offset`.
    Full {
        /// Byte offset of the full block in the region.
        offset: usize,
    },
    /// A paged KV cache: the region is a pool of blocks of `block_tokens` rows (block `b` at
    /// byte `b * block_tokens * 1152`); token `t` of layer `l` is row `t % block_tokens` of
    /// block `table[l * per_layer + t / block_tokens]`, `per_layer` being
    /// `ceil(tokens / block_tokens)`. The last block of a layer may be partly filled.
    Paged {
        /// Tokens per block (1 to 65536).
        block_tokens: usize,
        /// The block table, layer-major.
        table: Vec<u32>,
    },
}

/// One chunk held in the region.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldChunk {
    /// The chunk.
    pub id: ChunkId,
    /// Where its rows lie.
    pub placement: Placement,
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
    store: SealedBuffer,
    chunks: Vec<HeldChunk>,
    by_id: BTreeMap<ChunkId, usize>,
}

impl HeldChunk {
    /// Tokens per block of the paged cache it is served from, 0 for a full block (the
    /// registry's [`ChunkEntry::block_tokens`]).
    pub fn block_tokens(&self) -> u32 {
        match &self.placement {
            Placement::Full { .. } => 0,
            // Bounded by MAX_BLOCK_TOKENS in `HeldChunks::new`.
            Placement::Paged { block_tokens, .. } => *block_tokens as u32,
        }
    }

    /// Byte offset in the region of row (`layer`, `token`); both in range (checked by the
    /// caller against the layout), the placement checked by [`HeldChunks::new`].
    pub(crate) fn row_offset(&self, layer: u32, token: u32) -> usize {
        match &self.placement {
            Placement::Full { offset } => {
                offset + layer as usize * self.layout.layer_elems() * 2 + token as usize * ROW_BYTES
            }
            Placement::Paged {
                block_tokens,
                table,
            } => {
                let per_layer = (self.layout.tokens as usize).div_ceil(*block_tokens);
                let t = token as usize;
                let block = table[layer as usize * per_layer + t / block_tokens] as usize;
                (block * block_tokens + t % block_tokens) * ROW_BYTES
            }
        }
    }

    /// The byte ranges of the region its rows occupy (whole blocks where paged).
    fn spans(&self) -> Vec<(usize, usize)> {
        match &self.placement {
            Placement::Full { offset } => vec![(*offset, offset + self.layout.full_bytes())],
            Placement::Paged {
                block_tokens,
                table,
            } => {
                let bytes = block_tokens * ROW_BYTES;
                table
                    .iter()
                    .map(|&b| (b as usize * bytes, (b as usize + 1) * bytes))
                    .collect()
            }
        }
    }

    /// Checks the placement against a region of `region` bytes.
    fn check(&self, region: usize) -> Result<(), String> {
        match &self.placement {
            Placement::Full { offset } => {
                if !offset.is_multiple_of(2) {
                    return Err("full block offset is not 2-byte aligned".into());
                }
                let end = offset.checked_add(self.layout.full_bytes());
                if end.is_none_or(|end| end > region) {
                    return Err("full block lies outside the region".into());
                }
            }
            Placement::Paged {
                block_tokens,
                table,
            } => {
                if *block_tokens == 0 || *block_tokens > MAX_BLOCK_TOKENS as usize {
                    return Err(format!(
                        "{block_tokens} tokens per block (1 to {MAX_BLOCK_TOKENS})"
                    ));
                }
                let per_layer = (self.layout.tokens as usize).div_ceil(*block_tokens);
                let want = per_layer * self.layout.layers as usize;
                if table.len() != want {
                    return Err(format!(
                        "block table of {} entries, its layers and tokens need {want}",
                        table.len()
                    ));
                }
                let blocks = region / (block_tokens * ROW_BYTES);
                if let Some(b) = table.iter().find(|&&b| b as usize >= blocks) {
                    return Err(format!(
                        "block {b} lies outside the region ({blocks} blocks)"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// One chunk's KV as a model's prefill leaves it: its id, its cache rows per layer
/// (`[tokens, 576]` bf16, every layer the same token count) and the position each token's
/// RoPE band was rotated to.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkRows {
    /// The chunk.
    pub id: ChunkId,
    /// Per layer, its rows.
    pub layers: Vec<Vec<u16>>,
    /// Per token, its position.
    pub positions: Vec<i64>,
}

impl HeldChunks {
    /// Serves `chunks` out of `store`. Refused: a region peers may write, no chunks, a chunk
    /// listed twice, a bad layout, a position count that is not the token count, negative
    /// positions, a full block or a paged block outside the region, a block table of the
    /// wrong length, a full block offset that is not 2-byte aligned (rows are bf16), or two
    /// chunks (or two blocks of one) sharing bytes. The region is sealed
    /// ([`RegisteredBuffer::seal`]): a live grant onto it is refused too, and nothing writes
    /// it from here on.
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
            c.check(store.len()).map_err(|why| bad(&why))?;
            spans.extend(c.spans().into_iter().map(|(a, b)| (a, b, c.id)));
        }
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(RemoteError::Chunks(if w[0].2 == w[1].2 {
                format!("{} lists a block twice", w[0].2)
            } else {
                format!("{} and {} overlap in the region", w[0].2, w[1].2)
            }));
        }
        let store = store
            .seal()
            .map_err(|e| RemoteError::Chunks(format!("the held region: {e}")))?;
        Ok(Self {
            store,
            chunks,
            by_id,
        })
    }

    /// A fresh local-only region holding `ids` of the synthetic `corpus`, one full block
    /// after another.
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
            store.write_at(offset, &to_bytes(&block))?;
            chunks.push(HeldChunk {
                id,
                placement: Placement::Full { offset },
                layout,
                rope_layout: corpus.rope_layout,
                positions: corpus.positions(id),
            });
        }
        Self::new(store, chunks)
    }

    /// [`HeldChunks::generate`] into a paged cache of `block_tokens`-token blocks, the blocks
    /// of every chunk and layer scattered over the pool in an order drawn from `seed` (as an
    /// engine's block allocator leaves them after some churn).
    pub fn generate_paged(
        engine: &TransferEngine,
        corpus: &CorpusSpec,
        ids: &[ChunkId],
        block_tokens: usize,
        seed: u64,
    ) -> Result<Self, RemoteError> {
        corpus.validate()?;
        let layout = corpus.layout();
        let chunks = ids
            .iter()
            .map(|&id| {
                let mut block = vec![0u16; layout.full_elems()];
                corpus.fill(id, &mut block)?;
                let layers = block
                    .chunks_exact(layout.layer_elems())
                    .map(|l| l[..layout.tokens as usize * D_QK].to_vec())
                    .collect();
                Ok(ChunkRows {
                    id,
                    layers,
                    positions: corpus.positions(id),
                })
            })
            .collect::<Result<Vec<_>, RemoteError>>()?;
        Self::paged_from_layers(engine, chunks, corpus.rope_layout, block_tokens, seed)
    }

    /// A fresh local-only paged cache of `block_tokens`-token blocks holding `chunks`. Blocks
    /// are placed in an order drawn from `seed`.
    pub fn paged_from_layers(
        engine: &TransferEngine,
        chunks: Vec<ChunkRows>,
        rope_layout: RopeLayout,
        block_tokens: usize,
        seed: u64,
    ) -> Result<Self, RemoteError> {
        if block_tokens == 0 || block_tokens > MAX_BLOCK_TOKENS as usize {
            return Err(RemoteError::Chunks(format!(
                "{block_tokens} tokens per block (1 to {MAX_BLOCK_TOKENS})"
            )));
        }
        let mut layouts = Vec::with_capacity(chunks.len());
        for ChunkRows { id, layers, .. } in &chunks {
            let tokens = layers.first().map_or(0, |l| l.len() / D_QK);
            if layers.iter().any(|l| l.len() != tokens * D_QK) {
                return Err(RemoteError::Chunks(format!(
                    "{id}: every layer needs the same whole number of 576-wide rows"
                )));
            }
            let layout = BlockLayout::new(layers.len() as u32, tokens as u32)?;
            layouts.push((
                layout,
                layout.layers as usize * tokens.div_ceil(block_tokens),
            ));
        }
        let total: usize = layouts.iter().map(|&(_, n)| n).sum();
        let bytes = total
            .checked_mul(block_tokens * ROW_BYTES)
            .ok_or_else(|| RemoteError::Chunks("too many blocks for one region".into()))?;
        let store = engine.alloc_mr_with(bytes.max(1), Access::Local)?;
        let order = scattered(total, seed);
        let mut next = 0;
        let mut held = Vec::with_capacity(chunks.len());
        for (
            ChunkRows {
                id,
                layers,
                positions,
            },
            (layout, blocks),
        ) in chunks.into_iter().zip(layouts)
        {
            let table: Vec<u32> = order[next..next + blocks].to_vec();
            next += blocks;
            let per_layer = blocks / layout.layers as usize;
            for (l, rows) in layers.iter().enumerate() {
                for (i, part) in rows.chunks(block_tokens * D_QK).enumerate() {
                    let at = table[l * per_layer + i] as usize * block_tokens * ROW_BYTES;
                    store.write_at(at, &to_bytes(part))?;
                }
            }
            held.push(HeldChunk {
                id,
                placement: Placement::Paged {
                    block_tokens,
                    table,
                },
                layout,
                rope_layout,
                positions,
            });
        }
        Self::new(store, held)
    }

    /// The chunks, in the order given.
    pub fn chunks(&self) -> &[HeldChunk] {
        &self.chunks
    }

    /// The region, sealed: nothing writes it while it is served.
    pub fn store(&self) -> &SealedBuffer {
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
                offset: match c.placement {
                    Placement::Full { offset } => offset as u64,
                    Placement::Paged { .. } => 0,
                },
                block_tokens: c.block_tokens(),
                layout: c.layout,
                rope_layout: c.rope_layout,
                positions: c.positions.clone(),
            })
            .collect()
    }

    /// The first `tokens` rows (at most the chunk's) of layer `layer` of `chunk`, read in
    /// place: contiguous for a full block, through the block table for a paged one.
    pub(crate) fn layer_cache<'a>(
        &'a self,
        chunk: &'a HeldChunk,
        layer: u32,
        tokens: Option<usize>,
    ) -> Result<Cache<'a>, RemoteError> {
        let all = chunk.layout.tokens as usize;
        let tokens = tokens.map_or(all, |t| t.min(all));
        match &chunk.placement {
            Placement::Full { .. } => {
                let rows = self.block(chunk)?.layer(layer)?.rows();
                Ok(Cache::contiguous(&rows[..tokens * D_QK])?)
            }
            Placement::Paged {
                block_tokens,
                table,
            } => {
                chunk.layout.layer_offset(layer)?;
                let blocks = self.store.len() / (block_tokens * ROW_BYTES);
                let pool = self.store.u16s(0, blocks * block_tokens * D_QK)?;
                let per_layer = all.div_ceil(*block_tokens);
                let at = layer as usize * per_layer;
                Ok(Cache::paged_blocks(
                    pool,
                    *block_tokens,
                    &table[at..at + per_layer],
                    tokens,
                )?)
            }
        }
    }

    /// Chunk `chunk`'s full block, padded layers and all: borrowed in place where it lies as
    /// one, assembled from its blocks where paged (what a GPU upload copies anyway).
    pub(crate) fn full_copy(&self, chunk: &HeldChunk) -> Result<Vec<u16>, RemoteError> {
        let layout = chunk.layout;
        let mut out = vec![0u16; layout.full_elems()];
        for layer in 0..layout.layers {
            let cache = self.layer_cache(chunk, layer, None)?;
            let base = layer as usize * layout.layer_elems();
            for t in 0..cache.tokens() {
                out[base + t * D_QK..base + (t + 1) * D_QK].copy_from_slice(cache.row(t));
            }
        }
        Ok(out)
    }

    /// Chunk `chunk`'s full block, where it lies as one.
    pub(crate) fn block(&self, chunk: &HeldChunk) -> Result<FullBlock<'_>, RemoteError> {
        let Placement::Full { offset } = chunk.placement else {
            return Err(RemoteError::Chunk {
                chunk: chunk.id,
                why: "held in a paged cache, not as one full block".into(),
            });
        };
        let elems = self.store.u16s(offset, chunk.layout.full_elems())?;
        Ok(FullBlock::new(elems, chunk.layout)?)
    }

    /// `len` bytes of the region at `offset`, for packing gathered rows.
    pub(crate) fn bytes(&self, offset: usize, len: usize) -> Result<&[u8], RemoteError> {
        Ok(self.store.bytes(offset, len)?)
    }
}

fn to_bytes(words: &[u16]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// `0..n` in an order drawn from `seed`, then with most consecutive neighbours broken up: a
/// paged chunk's blocks then seldom lie as one contiguous run, as they would not in an
/// engine's cache.
fn scattered(n: usize, seed: u64) -> Vec<u32> {
    let mut order: Vec<u32> = (0..n as u32).collect();
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..n).rev() {
        order.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    if n > 3 {
        for i in 1..n {
            if order[i] == order[i - 1] + 1 {
                let j = (i + 1 + (next() as usize % (n - 2))) % n;
                order.swap(i, j);
            }
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use kvroute_transport::MemFabric;

    use super::*;

    fn spec(tokens: u32) -> CorpusSpec {
        CorpusSpec {
            layers: 2,
            chunk_tokens: tokens,
            chunks: 2,
            seed: 3,
            rope_theta: 1e4,
            yarn: None,
            rope_layout: RopeLayout::Interleaved,
        }
    }

    /// Every row read through a paged placement is the row the corpus generated, at every
    /// block size, the last block partly filled.
    #[test]
    fn a_paged_chunk_reads_back_the_rows_it_was_given() -> Result<(), RemoteError> {
        let fabric = MemFabric::new();
        let engine = TransferEngine::mem(&fabric, 1)?;
        let spec = spec(100);
        for block in [1, 16, 64, 100, 256] {
            let held =
                HeldChunks::generate_paged(&engine, &spec, &[ChunkId(1), ChunkId(0)], block, 5)?;
            for c in held.chunks() {
                let want = spec.chunk(c.id)?;
                assert_eq!(held.full_copy(c)?, want, "blocks of {block}");
                let cache = held.layer_cache(c, 1, Some(7))?;
                assert_eq!(cache.tokens(), 7);
                let layer1 = c.layout.layer_elems();
                assert_eq!(cache.row(6), &want[layer1 + 6 * D_QK..layer1 + 7 * D_QK]);
                let at = c.row_offset(1, 99);
                let bytes = held.bytes(at, ROW_BYTES)?;
                assert_eq!(
                    bytes,
                    to_bytes(&want[layer1 + 99 * D_QK..layer1 + 100 * D_QK])
                );
            }
        }
        Ok(())
    }

    /// A block table too short or too long, a block past the region, a block listed twice,
    /// two chunks sharing a block, a zero or absurd block size: each refused, naming it.
    #[test]
    fn bad_block_tables_are_refused() -> Result<(), RemoteError> {
        let fabric = MemFabric::new();
        let engine = TransferEngine::mem(&fabric, 1)?;
        let layout = BlockLayout::new(2, 40)?;
        let paged = |id: u32, block_tokens: usize, table: Vec<u32>| HeldChunk {
            id: ChunkId(id),
            placement: Placement::Paged {
                block_tokens,
                table,
            },
            layout,
            rope_layout: RopeLayout::Interleaved,
            positions: (0..40).collect(),
        };
        // 16 blocks of 16 tokens; a layer of 40 tokens takes 3.
        let region = || engine.alloc_mr_with(16 * 16 * ROW_BYTES, Access::Local);
        let refused = |chunks: Vec<HeldChunk>, says: &str| -> Result<(), RemoteError> {
            match HeldChunks::new(region()?, chunks) {
                Err(RemoteError::Chunks(why)) => assert!(why.contains(says), "{why}"),
                other => panic!("{says}: {other:?}"),
            }
            Ok(())
        };
        assert!(HeldChunks::new(region()?, vec![paged(0, 16, vec![7, 0, 5, 1, 6, 2])]).is_ok());
        refused(vec![paged(0, 16, vec![7, 0, 5, 1, 6])], "block table of 5")?;
        refused(
            vec![paged(0, 16, vec![7, 0, 5, 1, 6, 2, 3])],
            "block table of 7",
        )?;
        refused(
            vec![paged(0, 16, vec![7, 0, 5, 1, 6, 16])],
            "block 16 lies outside",
        )?;
        refused(
            vec![paged(0, 16, vec![7, 0, 5, 1, 6, 7])],
            "lists a block twice",
        )?;
        refused(
            vec![
                paged(0, 16, vec![7, 0, 5, 1, 6, 2]),
                paged(1, 16, vec![8, 9, 10, 11, 12, 5]),
            ],
            "overlap",
        )?;
        refused(vec![paged(0, 0, vec![])], "0 tokens per block")?;
        refused(vec![paged(0, 1 << 20, vec![0, 0])], "tokens per block")?;
        Ok(())
    }
}
