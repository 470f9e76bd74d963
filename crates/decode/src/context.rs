//! The shared context and the requests decoded over it: which token ids each chunk holds,
//! where each chunk is stored (its canonical positions) and where each request places it.
//!
//! The context is a document of `chunks` chunks of `chunk_tokens` tokens. Chunk `c` is held,
//! and prefilled, as an independent sequence at the canonical positions
//! `c * chunk_tokens ..` (paper 000's setting: a canonical chunk's KV is computed once,
//! wherever it is later used, and a request that places it elsewhere splices it). Requests
//! come in a fixed pattern of four, so that some share chunks at the same place, some at
//! another place, and some have a chunk nobody else attends:
//!
//! | request `r % 4` | its chunks, in context order |
//! |---|---|
//! | 0, 1 | the shared chunks `0 .. C-1` at their canonical places (no splice) |
//! | 2 | the last chunk `C-1` alone, at position 0 (its own; spliced) |
//! | 3 | the shared chunks in reverse order (each spliced) |
//!
//! (with one chunk, every request attends it at its place). Each request then has its own
//! prompt of `prompt_tokens` token ids right after its chunks, and generates after that.

use kvroute_kvstore::ChunkId;
use serde::{Deserialize, Serialize};

use crate::error::DecodeError;

/// The shared context and the requests over it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContextSpec {
    /// Chunks of the document (1 to 64).
    pub chunks: u32,
    /// Tokens per chunk (1 to 65536).
    pub chunk_tokens: u32,
    /// Requests (1 to 256).
    pub requests: u32,
    /// Each request's own prompt, tokens (1 to 4096).
    pub prompt_tokens: u32,
    /// Seed of every token id.
    pub seed: u64,
}

/// One request's context: its chunks placed, its prompt, and where its own tokens start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestPlan {
    /// Each chunk and the position its first token has in this request's context.
    pub chunks: Vec<(ChunkId, i64)>,
    /// Its prompt's token ids.
    pub prompt: Vec<u32>,
    /// The position of its first prompt token (the tokens of its chunks come before).
    pub first_position: i64,
}

impl ContextSpec {
    /// Checks the sizes.
    pub fn validate(&self) -> Result<(), DecodeError> {
        let within = |what: &str, v: u32, hi: u32| {
            if (1..=hi).contains(&v) {
                Ok(())
            } else {
                Err(DecodeError::Config(format!(
                    "{what} is {v}, must be 1 to {hi}"
                )))
            }
        };
        within("chunks", self.chunks, 64)?;
        within("chunk tokens", self.chunk_tokens, 1 << 16)?;
        within("requests", self.requests, 256)?;
        within("prompt tokens", self.prompt_tokens, 4096)
    }

    /// Chunk `chunk`'s token ids (below `vocab`).
    pub fn chunk_ids(&self, chunk: ChunkId, vocab: usize) -> Vec<u32> {
        ids(
            self.seed ^ 0xc4_0000 ^ u64::from(chunk.0),
            self.chunk_tokens as usize,
            vocab,
        )
    }

    /// Chunk `chunk`'s canonical positions: where it is stored and prefilled.
    pub fn canonical_positions(&self, chunk: ChunkId) -> Vec<i64> {
        let first = i64::from(chunk.0) * i64::from(self.chunk_tokens);
        (first..first + i64::from(self.chunk_tokens)).collect()
    }

    /// Request `r`'s context (see the module's table), its prompt drawn below `vocab`.
    pub fn request(&self, r: u32, vocab: usize) -> RequestPlan {
        let c = self.chunks;
        let t = i64::from(self.chunk_tokens);
        let shared: Vec<u32> = (0..c.saturating_sub(1).max(1)).collect();
        let order: Vec<u32> = match (r % 4, c) {
            (_, 1) => vec![0],
            (2, _) => vec![c - 1],
            (3, _) => shared.iter().rev().copied().collect(),
            _ => shared,
        };
        let chunks: Vec<(ChunkId, i64)> = if r % 4 < 2 {
            // At their canonical places.
            order
                .iter()
                .map(|&id| (ChunkId(id), i64::from(id) * t))
                .collect()
        } else {
            order
                .iter()
                .enumerate()
                .map(|(i, &id)| (ChunkId(id), i as i64 * t))
                .collect()
        };
        let first_position = chunks
            .iter()
            .map(|&(_, start)| start + t)
            .max()
            .unwrap_or(0);
        RequestPlan {
            chunks,
            prompt: ids(
                self.seed ^ 0x9_0000 ^ u64::from(r),
                self.prompt_tokens as usize,
                vocab,
            ),
            first_position,
        }
    }
}

/// `n` token ids below `vocab` drawn from `seed` (splitmix64).
fn ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % vocab.max(1) as u64) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(chunks: u32) -> ContextSpec {
        ContextSpec {
            chunks,
            chunk_tokens: 100,
            requests: 4,
            prompt_tokens: 5,
            seed: 1,
        }
    }

    #[test]
    fn requests_share_some_chunks_place_some_elsewhere_and_own_one() {
        let s = spec(3);
        let plans: Vec<RequestPlan> = (0..4).map(|r| s.request(r, 50)).collect();
        let ids = |p: &RequestPlan| p.chunks.iter().map(|c| (c.0.0, c.1)).collect::<Vec<_>>();
        assert_eq!(ids(&plans[0]), vec![(0, 0), (1, 100)]);
        assert_eq!(ids(&plans[1]), ids(&plans[0]));
        assert_eq!(ids(&plans[2]), vec![(2, 0)]);
        assert_eq!(ids(&plans[3]), vec![(1, 0), (0, 100)]);
        assert_eq!(plans[0].first_position, 200);
        assert_eq!(plans[2].first_position, 100);
        assert_ne!(
            plans[0].prompt, plans[1].prompt,
            "prompts are the requests' own"
        );
        assert!(plans.iter().all(|p| p.prompt.iter().all(|&t| t < 50)));
        // Chunk 2 is attended by request 2 only.
        assert_eq!(
            plans
                .iter()
                .filter(|p| p.chunks.iter().any(|c| c.0 == ChunkId(2)))
                .count(),
            1
        );
        assert_eq!(spec(1).request(2, 50).chunks, vec![(ChunkId(0), 0)]);
    }

    #[test]
    fn chunk_tokens_are_fixed_by_the_seed_and_differ_between_chunks() {
        let s = spec(3);
        assert_eq!(s.chunk_ids(ChunkId(1), 1000), s.chunk_ids(ChunkId(1), 1000));
        assert_ne!(s.chunk_ids(ChunkId(1), 1000), s.chunk_ids(ChunkId(0), 1000));
        assert_eq!(s.canonical_positions(ChunkId(2))[0], 200);
        assert!(ContextSpec { chunks: 0, ..s }.validate().is_err());
    }
}
