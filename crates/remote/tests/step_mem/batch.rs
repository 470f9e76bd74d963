//! The batch under test: the requests' shapes (shared and private chunks at their own
//! positions), their own KV paged at several block sizes, their queries and sparse picks, and
//! single-instance attention over each request's whole context, the reference.

use super::*;

/// Deterministic bf16 rows in (-2, 2).
pub(crate) fn rows(n: usize, seed: u64) -> Vec<u16> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n * D_QK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            kvroute_kernels::bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
        })
        .collect()
}

/// A request's own KV: `tokens` rows in blocks of `block` (0: contiguous), blocks in reverse
/// order in a pool with one spare block.
pub(crate) struct Own {
    pub(crate) pool: Vec<u16>,
    pub(crate) table: Vec<u32>,
    pub(crate) block: usize,
    pub(crate) tokens: usize,
    /// The same rows, contiguous.
    rows: Vec<u16>,
}

impl Own {
    fn new(tokens: usize, block: usize, seed: u64) -> Self {
        let data = rows(tokens, seed);
        if block == 0 {
            return Self {
                pool: data.clone(),
                table: Vec::new(),
                block,
                tokens,
                rows: data,
            };
        }
        let blocks = tokens.div_ceil(block);
        let table: Vec<u32> = (0..blocks as u32).rev().collect();
        let mut pool = vec![0u16; (blocks + 1) * block * D_QK];
        for t in 0..tokens {
            let at = (table[t / block] as usize * block + t % block) * D_QK;
            pool[at..at + D_QK].copy_from_slice(&data[t * D_QK..(t + 1) * D_QK]);
        }
        Self {
            pool,
            table,
            block,
            tokens,
            rows: data,
        }
    }

    fn cache(&self) -> Cache<'_> {
        if self.block == 0 {
            Cache::contiguous(&self.pool).unwrap_or_else(|e| panic!("{e}"))
        } else {
            Cache::paged_blocks(&self.pool, self.block, &self.table, self.tokens)
                .unwrap_or_else(|e| panic!("{e}"))
        }
    }
}

/// One request's shape: its chunks (id, start), its own KV (tokens, block size), query tokens.
pub(crate) struct Shape {
    pub(crate) chunks: Vec<(u32, i64)>,
    pub(crate) own: (usize, usize),
    pub(crate) new: usize,
}

/// Four requests: 0 and 1 share chunk 0 at the same place, 1 and 3 share chunk 1 at
/// different places, 2 has chunk 3 alone far from its stored place; own KV at blocks of 16,
/// 64, 256 (lengths not a multiple of them) and contiguous.
pub(crate) fn shapes() -> Vec<Shape> {
    vec![
        Shape {
            chunks: vec![(0, 0), (1, 200)],
            own: (37, 16),
            new: 1,
        },
        Shape {
            chunks: vec![(0, 0), (2, 200)],
            own: (100, 64),
            new: 2,
        },
        Shape {
            chunks: vec![(3, 5000)],
            own: (300, 256),
            new: 1,
        },
        Shape {
            chunks: vec![(1, 1000), (0, 1200)],
            own: (20, 0),
            new: 1,
        },
    ]
}

/// The batch's data: queries, own KV, and (sparse) picks per chunk and for the own KV.
pub(crate) struct Batch {
    pub(crate) q: Vec<Vec<u16>>,
    pub(crate) own: Vec<Own>,
    refs: Vec<Vec<ChunkRef<'static>>>,
    pub(crate) chunk_picks: Vec<Vec<Vec<i32>>>,
    pub(crate) own_picks: Vec<Vec<i32>>,
    pub(crate) k: usize,
}

impl Batch {
    pub(crate) fn new(sparse: bool, seed: u64) -> Self {
        let (s, k) = (spec(), 24);
        let mut b = Self {
            q: Vec::new(),
            own: Vec::new(),
            refs: Vec::new(),
            chunk_picks: Vec::new(),
            own_picks: Vec::new(),
            k,
        };
        let mut x = seed | 1;
        let mut pick = |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // About one pick in eleven is padding.
            match x % 11 {
                0 => -1,
                _ => ((x >> 8) % n as u64) as i32,
            }
        };
        for (r, shape) in shapes().iter().enumerate() {
            b.q.push(rows(HEADS * shape.new, seed + r as u64));
            b.own
                .push(Own::new(shape.own.0, shape.own.1, seed + 100 + r as u64));
            let refs = shape
                .chunks
                .iter()
                .map(|&(c, start)| ChunkRef::dense(ChunkId(c), start))
                .collect();
            b.refs.push(refs);
            if sparse {
                let ct = s.chunk_tokens as usize;
                b.chunk_picks.push(
                    shape
                        .chunks
                        .iter()
                        .map(|_| (0..shape.new * k).map(|_| pick(ct)).collect())
                        .collect(),
                );
                b.own_picks
                    .push((0..shape.new * k).map(|_| pick(shape.own.0)).collect());
            }
        }
        b
    }

    fn sparse(&self) -> bool {
        !self.chunk_picks.is_empty()
    }

    /// Chunk refs with their picks (sparse), per request.
    pub(crate) fn chunk_refs(&self) -> Vec<Vec<ChunkRef<'_>>> {
        self.refs
            .iter()
            .enumerate()
            .map(|(r, refs)| {
                refs.iter()
                    .enumerate()
                    .map(|(i, c)| ChunkRef {
                        picks: self.sparse().then(|| Picks {
                            indices: &self.chunk_picks[r][i],
                            k: self.k,
                        }),
                        ..*c
                    })
                    .collect()
            })
            .collect()
    }

    pub(crate) fn requests<'a>(&'a self, refs: &'a [Vec<ChunkRef<'a>>]) -> Vec<StepRequest<'a>> {
        (0..self.q.len())
            .map(|r| StepRequest {
                queries: &self.q[r],
                heads: HEADS,
                chunks: &refs[r],
                local: Some(LocalKv {
                    cache: self.own[r].cache(),
                    picks: self.sparse().then(|| Picks {
                        indices: &self.own_picks[r],
                        k: self.k,
                    }),
                }),
            })
            .collect()
    }

    /// Single-instance attention over request `r`'s whole context at `layer`: its chunks'
    /// rows rotated to their places, then its own rows; sparse over the same picks.
    pub(crate) fn reference(&self, r: usize, layer: u32, blocks: &[Vec<u16>]) -> Result<Partial> {
        let s = spec();
        let rope = s.rope()?;
        let mut whole = Vec::new();
        let mut offsets = Vec::new();
        for &(c, start) in &shapes()[r].chunks {
            let full = FullBlock::new(&blocks[c as usize], s.layout())?;
            let stored = s.positions(ChunkId(c))[0];
            let angles = rope.angles(start - stored);
            offsets.push((whole.len() / D_QK) as i32);
            for row in full.layer(layer)?.rows().chunks_exact(D_QK) {
                let mut row = row.to_vec();
                rotate_row_f64(&mut row, &angles, rope.layout());
                whole.extend_from_slice(&row);
            }
        }
        let own_at = (whole.len() / D_QK) as i32;
        whole.extend_from_slice(&self.own[r].rows);
        let q = Queries::new(&self.q[r])?;
        let cache = Cache::contiguous(&whole)?;
        if !self.sparse() {
            return Ok(partial_dense(Backend::Reference, &q, &cache, SCALE)?);
        }
        let tokens = q.len() / HEADS;
        let parts = offsets.len() + 1;
        let mut idx = Vec::with_capacity(tokens * self.k * parts);
        for t in 0..tokens {
            for (i, &off) in offsets.iter().enumerate() {
                idx.extend(
                    self.chunk_picks[r][i][t * self.k..(t + 1) * self.k]
                        .iter()
                        .map(|&p| if p < 0 { -1 } else { p + off }),
                );
            }
            idx.extend(
                self.own_picks[r][t * self.k..(t + 1) * self.k]
                    .iter()
                    .map(|&p| if p < 0 { -1 } else { p + own_at }),
            );
        }
        let sel = Selection::new(&idx, self.k * parts, HEADS, q.len(), cache.tokens())?;
        Ok(partial_sparse(Backend::Reference, &q, &cache, &sel, SCALE)?)
    }
}
