//! The canonical chunk registry (docs/kvstore.md; paper 000 section 2.1's canonical chunks):
//! chunk id -> who holds it, where, in what layout, at which stored positions. Any instance can
//! ask it who holds a chunk; a chunk may have several holders (replicas), so a requester that
//! loses one can fall back to another.

use std::collections::BTreeMap;

use kvroute_kernels::RopeLayout;
use kvroute_transport::{MrDesc, NetAddr};
use serde::{Deserialize, Serialize};

use crate::error::StoreError;
use crate::layout::BlockLayout;

/// A chunk's id, stable across instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ChunkId(pub u32);

impl std::fmt::Display for ChunkId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "chunk {}", self.0)
    }
}

/// The largest block of a paged KV cache a chunk may be served from, tokens.
pub const MAX_BLOCK_TOKENS: u32 = 1 << 16;

/// One holder's copy of a chunk: enough to route a query to it or to fetch its blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkEntry {
    /// The chunk.
    pub id: ChunkId,
    /// The holder's transfer-engine address.
    pub holder: NetAddr,
    /// The registered region the chunk's full block lies in.
    pub desc: MrDesc,
    /// Byte offset of the full block inside `desc` (0 for a paged chunk).
    pub offset: u64,
    /// Tokens per block of the holder's paged KV cache the chunk is served from, or 0 where
    /// it lies as one full block at `offset`. A fetch's writes follow the blocks, so the
    /// requester counts its arrivals from this (`kvroute_remote::wire::fetch_pieces`).
    #[serde(default)]
    pub block_tokens: u32,
    /// Layers and tokens.
    pub layout: BlockLayout,
    /// How the RoPE band pairs up.
    pub rope_layout: RopeLayout,
    /// The position each token's RoPE band was rotated to when stored (`layout.tokens` of them).
    pub positions: Vec<i64>,
}

impl ChunkEntry {
    /// Checks an entry (from a peer): layout addressable, one non-negative position per token,
    /// the full block inside the region, the address well formed.
    pub fn validate(&self) -> Result<(), StoreError> {
        let bad = |why| StoreError::InvalidEntry {
            chunk: self.id.0,
            why,
        };
        self.layout.validate()?;
        if self.positions.len() != self.layout.tokens as usize {
            return Err(bad("one stored position per token"));
        }
        if self.positions.iter().any(|&p| p < 0) {
            return Err(bad("negative stored position"));
        }
        if self.block_tokens > MAX_BLOCK_TOKENS {
            return Err(bad("paged block larger than 65536 tokens"));
        }
        if self.block_tokens == 0 {
            let end = self.offset.checked_add(self.layout.full_bytes() as u64);
            if end.is_none_or(|end| end > self.desc.len) {
                return Err(bad("full block outside its region"));
            }
        } else if self.offset != 0 {
            return Err(bad("a paged chunk has no full-block offset"));
        }
        if self.holder.validate().is_err() {
            return Err(bad("malformed holder address"));
        }
        Ok(())
    }
}

/// Chunk id -> holders, in registration order (the first is the preferred replica).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ChunkRegistry {
    chunks: BTreeMap<ChunkId, Vec<ChunkEntry>>,
}

impl ChunkRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a holder of a chunk after checking the entry; a replica must have the same layout
    /// and positions as the copies already registered, and a holder is registered once per
    /// chunk (a second registration replaces the first).
    pub fn register(&mut self, entry: ChunkEntry) -> Result<(), StoreError> {
        entry.validate()?;
        let replicas = self.chunks.entry(entry.id).or_default();
        if let Some(first) = replicas.first()
            && (first.layout != entry.layout
                || first.positions != entry.positions
                || first.rope_layout != entry.rope_layout)
        {
            return Err(StoreError::InvalidEntry {
                chunk: entry.id.0,
                why: "replica differs from the registered copy",
            });
        }
        replicas.retain(|e| e.holder != entry.holder);
        replicas.push(entry);
        Ok(())
    }

    /// The holders of `id`, preferred first.
    pub fn holders(&self, id: ChunkId) -> Result<&[ChunkEntry], StoreError> {
        match self.chunks.get(&id) {
            Some(v) if !v.is_empty() => Ok(v),
            _ => Err(StoreError::UnknownChunk(id.0)),
        }
    }

    /// Forgets every chunk copy `holder` had (it died or left); returns how many.
    pub fn remove_holder(&mut self, holder: &NetAddr) -> usize {
        let mut removed = 0;
        for replicas in self.chunks.values_mut() {
            let before = replicas.len();
            replicas.retain(|e| &e.holder != holder);
            removed += before - replicas.len();
        }
        self.chunks.retain(|_, v| !v.is_empty());
        removed
    }

    /// Reorders the holders of `id` by `rank` (lowest first; equal ranks keep their order):
    /// the order routes and fetches prefer them in.
    pub fn reorder(&mut self, id: ChunkId, rank: impl Fn(&ChunkEntry) -> usize) {
        if let Some(replicas) = self.chunks.get_mut(&id) {
            replicas.sort_by_key(|e| rank(e));
        }
    }

    /// The registered chunk ids, ascending.
    pub fn ids(&self) -> impl Iterator<Item = ChunkId> + '_ {
        self.chunks.keys().copied()
    }

    /// Registered chunks.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_transport::{DomainAddr, RemoteKey};

    fn addr(n: u8) -> NetAddr {
        NetAddr {
            nics: vec![DomainAddr {
                provider: "mem".to_owned(),
                bytes: vec![n],
            }],
        }
    }

    fn entry(id: u32, holder: u8, tokens: u32) -> ChunkEntry {
        let layout = BlockLayout { layers: 2, tokens };
        ChunkEntry {
            id: ChunkId(id),
            holder: addr(holder),
            desc: MrDesc {
                addr: 0,
                len: layout.full_bytes() as u64,
                rkeys: vec![RemoteKey {
                    nic: addr(holder).nics[0].clone(),
                    rkey: 1,
                }],
            },
            offset: 0,
            block_tokens: 0,
            layout,
            rope_layout: RopeLayout::Interleaved,
            positions: (0..i64::from(tokens)).collect(),
        }
    }

    #[test]
    fn replicas_and_removal() -> Result<(), StoreError> {
        let mut reg = ChunkRegistry::new();
        reg.register(entry(1, 1, 64))?;
        reg.register(entry(1, 2, 64))?;
        reg.register(entry(1, 2, 64))?; // re-registration replaces
        reg.register(entry(2, 2, 10))?;
        assert_eq!(reg.holders(ChunkId(1))?.len(), 2);
        assert_eq!(reg.holders(ChunkId(1))?[0].holder, addr(1));
        assert!(matches!(
            reg.register(entry(1, 3, 65)),
            Err(StoreError::InvalidEntry { .. })
        ));
        reg.reorder(ChunkId(1), |e| usize::from(e.holder != addr(2)));
        assert_eq!(reg.holders(ChunkId(1))?[0].holder, addr(2));
        assert_eq!(reg.remove_holder(&addr(2)), 2);
        assert_eq!(reg.holders(ChunkId(1))?.len(), 1);
        assert_eq!(reg.holders(ChunkId(2)), Err(StoreError::UnknownChunk(2)));
        assert_eq!(reg.ids().collect::<Vec<_>>(), [ChunkId(1)]);
        Ok(())
    }

    #[test]
    fn forged_entries_are_refused() {
        let mut e = entry(1, 1, 64);
        e.offset = 1;
        assert!(e.validate().is_err(), "block past the region");
        let mut e = entry(1, 1, 64);
        e.offset = u64::MAX;
        assert!(e.validate().is_err(), "offset overflow");
        let mut e = entry(1, 1, 64);
        e.block_tokens = 16;
        assert!(e.validate().is_ok(), "a paged chunk");
        e.offset = 64;
        assert!(e.validate().is_err(), "a paged chunk with an offset");
        e.offset = 0;
        e.block_tokens = MAX_BLOCK_TOKENS + 1;
        assert!(e.validate().is_err(), "an absurd block size");
        let mut e = entry(1, 1, 64);
        e.positions.pop();
        assert!(e.validate().is_err());
        let mut e = entry(1, 1, 64);
        e.positions[3] = -1;
        assert!(e.validate().is_err());
        let mut e = entry(1, 1, 64);
        e.holder.nics.clear();
        assert!(e.validate().is_err());
        let json = serde_json::to_string(&entry(1, 1, 64)).unwrap_or_default();
        let back: Result<ChunkEntry, _> = serde_json::from_str(&json);
        assert!(back.is_ok_and(|b| b == entry(1, 1, 64)));
    }
}
