//! Batched paged decode: one call for a batch of requests, as a serving engine's decode step
//! makes it (FlashMLA's `flash_mla_with_kvcache`: a block table and a length per request).
//!
//! The cache is one pool of blocks of `block_tokens` token rows ([`KvPool`]), bf16 rows of 576
//! or FP8 rows of 656 bytes ([`crate::fp8`]). Each request ([`DecodeRequest`]) brings its query
//! rows (heads x new tokens), its block table and its context length, and for sparse attention
//! its top-k selection over that context. The answer is one [`Partial`] per request, in the
//! crate's convention. The CPU and the reference run the requests side by side (rayon); CUDA
//! runs the whole batch in one launch of the tensor-core kernel ([`crate::cuda`]), whose last
//! block per work item combines the splits of the keys.

use rayon::prelude::*;

use crate::cpu::{self, Isa};
use crate::error::{KernelError, check_len};
use crate::fp8::{self, FP8_ROW_BYTES};
use crate::layout::{Cache, D_QK, Queries, Selection, check_pages};
use crate::partial::Partial;
use crate::reference;

/// A pool's rows: bf16 (`[blocks * block_tokens, 576]`) or FP8 (`[blocks * block_tokens, 656]`
/// bytes).
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    /// bf16 rows, 576 values each.
    Bf16(&'a [u16]),
    /// FP8 rows, 656 bytes each.
    Fp8(&'a [u8]),
}

/// What a pool is, without its rows: enough to check a batch against it (a pool kept on a GPU
/// has this and no host rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    /// Tokens per block.
    pub block_tokens: usize,
    /// Blocks in the pool.
    pub blocks: usize,
    /// Whether rows are FP8.
    pub fp8: bool,
}

/// The cache pool a batched call reads.
#[derive(Debug, Clone, Copy)]
pub struct KvPool<'a> {
    rows: KvRows<'a>,
    shape: PoolShape,
}

impl<'a> KvPool<'a> {
    /// bf16 rows in blocks of `block_tokens` (a whole number of blocks).
    pub fn bf16(rows: &'a [u16], block_tokens: usize) -> Result<Self, KernelError> {
        let blocks = whole_blocks(rows.len(), D_QK, block_tokens, "bf16 pool")?;
        Ok(Self {
            rows: KvRows::Bf16(rows),
            shape: PoolShape {
                block_tokens,
                blocks,
                fp8: false,
            },
        })
    }

    /// FP8 rows ([`crate::fp8::quantize`]'s bytes) in blocks of `block_tokens`.
    pub fn fp8(rows: &'a [u8], block_tokens: usize) -> Result<Self, KernelError> {
        let blocks = whole_blocks(rows.len(), FP8_ROW_BYTES, block_tokens, "FP8 pool")?;
        Ok(Self {
            rows: KvRows::Fp8(rows),
            shape: PoolShape {
                block_tokens,
                blocks,
                fp8: true,
            },
        })
    }

    /// The rows.
    pub fn rows(&self) -> KvRows<'a> {
        self.rows
    }

    /// Block size, block count and row format.
    pub fn shape(&self) -> PoolShape {
        self.shape
    }

    /// The rows' bytes, as a GPU uploads them.
    pub(crate) fn bytes(&self) -> &'a [u8] {
        match self.rows {
            KvRows::Bf16(rows) => bytemuck_u16(rows),
            KvRows::Fp8(bytes) => bytes,
        }
    }
}

/// `u16`s as their little-endian bytes (every target this crate builds for is little-endian).
fn bytemuck_u16(rows: &[u16]) -> &[u8] {
    // SAFETY: u8 has no alignment requirement and every byte of a u16 is initialised; the
    // slice covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(rows.as_ptr().cast::<u8>(), std::mem::size_of_val(rows)) }
}

/// Blocks in a pool of `len` elements, `row` elements a token, `block_tokens` tokens a block.
fn whole_blocks(
    len: usize,
    row: usize,
    block_tokens: usize,
    what: &'static str,
) -> Result<usize, KernelError> {
    if block_tokens == 0 || block_tokens > i32::MAX as usize {
        return Err(KernelError::Parameter {
            what: "tokens per block",
            value: block_tokens as f64,
            why: "must be positive and fit the kernels' 32-bit index",
        });
    }
    let block = row * block_tokens;
    check_len(what, len / block * block, len)?;
    Ok(len / block)
}

/// One request of a batched call: its query rows, its block table over the pool and its
/// context length, and for sparse attention its selection over that context.
#[derive(Debug, Clone, Copy)]
pub struct DecodeRequest<'a> {
    q: Queries<'a>,
    table: &'a [u32],
    tokens: usize,
    sel: Option<Selection<'a>>,
}

impl<'a> DecodeRequest<'a> {
    /// Every query row attends context tokens `0..tokens`: token `t` is row
    /// `t % block_tokens` of block `table[t / block_tokens]`.
    pub fn dense(q: Queries<'a>, table: &'a [u32], tokens: usize) -> Self {
        Self {
            q,
            table,
            tokens,
            sel: None,
        }
    }

    /// Each query row attends its selected context tokens ([`Selection`], built against
    /// `tokens`; -1 is padding).
    pub fn sparse(q: Queries<'a>, table: &'a [u32], tokens: usize, sel: Selection<'a>) -> Self {
        Self {
            q,
            table,
            tokens,
            sel: Some(sel),
        }
    }

    /// The query rows.
    pub fn queries(&self) -> Queries<'a> {
        self.q
    }

    /// The block table.
    pub fn table(&self) -> &'a [u32] {
        self.table
    }

    /// Context tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The selection, for a sparse request.
    pub fn selection(&self) -> Option<&Selection<'a>> {
        self.sel.as_ref()
    }

    /// Whether query row `r` attends at least one token.
    pub(crate) fn attends(&self, r: usize) -> bool {
        match &self.sel {
            None => self.tokens > 0,
            Some(sel) => crate::attends(sel, r),
        }
    }

    /// Checks this request against `pool`: query rows present, the table's blocks inside the
    /// pool for every token, the selection's shape and indices against the rows and the context.
    fn check(&self, pool: &PoolShape) -> Result<(), KernelError> {
        if self.q.is_empty() {
            return Err(KernelError::Empty("query rows"));
        }
        if self.tokens > i32::MAX as usize {
            return Err(KernelError::Parameter {
                what: "context tokens",
                value: self.tokens as f64,
                why: "exceeds the kernels' 32-bit index",
            });
        }
        let used = self.tokens.div_ceil(pool.block_tokens);
        if self.table.len() < used {
            return Err(KernelError::Shape {
                what: "block table (blocks for the context)",
                expected: used,
                got: self.table.len(),
            });
        }
        check_pages("block table", &self.table[..used], pool.blocks)?;
        if let Some(sel) = &self.sel {
            Selection::new(
                sel.raw(),
                sel.k(),
                sel.rows_per_token(),
                self.q.len(),
                self.tokens,
            )?;
        }
        Ok(())
    }
}

/// Checks every request of a batch against `pool` and the scale, naming the first request
/// refused.
pub(crate) fn check_batch(
    pool: &PoolShape,
    requests: &[DecodeRequest<'_>],
    scale: f32,
) -> Result<(), KernelError> {
    crate::check_scale(scale)?;
    for (i, r) in requests.iter().enumerate() {
        r.check(pool).map_err(|e| in_request(i, e))?;
    }
    Ok(())
}

/// `e` as the error of request `request`.
pub(crate) fn in_request(request: usize, e: KernelError) -> KernelError {
    KernelError::Request {
        request,
        source: Box::new(e),
    }
}

/// Refuses a request's partial that is not finite where it attends something (the crate's
/// non-finite contract), naming the request and the row.
pub(crate) fn check_results(
    requests: &[DecodeRequest<'_>],
    parts: &[Partial],
) -> Result<(), KernelError> {
    for (i, (r, p)) in requests.iter().zip(parts).enumerate() {
        p.check_finite(|row| r.attends(row))
            .map_err(|e| in_request(i, e))?;
    }
    Ok(())
}

/// What computes a request on the host.
#[derive(Clone, Copy)]
pub(crate) enum Host {
    Cpu(Isa),
    Reference,
}

/// The batch on the host, requests side by side (checked already); a non-finite result is
/// refused ([`check_results`]).
pub(crate) fn host(
    how: Host,
    pool: &KvPool<'_>,
    requests: &[DecodeRequest<'_>],
    scale: f32,
) -> Result<Vec<Partial>, KernelError> {
    let parts = requests
        .par_iter()
        .enumerate()
        .map(|(i, r)| host_request(how, pool, r, scale).map_err(|e| in_request(i, e)))
        .collect::<Result<Vec<_>, _>>()?;
    check_results(requests, &parts)?;
    Ok(parts)
}

fn host_request(
    how: Host,
    pool: &KvPool<'_>,
    r: &DecodeRequest<'_>,
    scale: f32,
) -> Result<Partial, KernelError> {
    let run = |cache: &Cache<'_>, sel: Option<&Selection<'_>>| match (how, sel) {
        (Host::Cpu(isa), None) => cpu::partial_dense(&r.q, cache, scale, isa),
        (Host::Cpu(isa), Some(sel)) => cpu::partial_sparse(&r.q, cache, sel, scale, isa),
        (Host::Reference, None) => reference::partial_dense(&r.q, cache, scale),
        (Host::Reference, Some(sel)) => reference::partial_sparse(&r.q, cache, sel, scale),
    };
    match pool.rows {
        KvRows::Bf16(rows) => {
            let cache = Cache::paged_blocks(rows, pool.shape.block_tokens, r.table, r.tokens)?;
            Ok(run(&cache, r.sel.as_ref()))
        }
        KvRows::Fp8(bytes) => {
            let (rows, remapped) = dequantize_attended(bytes, pool.shape.block_tokens, r);
            let cache = Cache::contiguous(&rows)?;
            Ok(match (&r.sel, &remapped) {
                (Some(sel), Some(idx)) => {
                    let (k, per) = (sel.k(), sel.rows_per_token());
                    let sel = Selection::new(idx, k, per, r.q.len(), cache.tokens())?;
                    run(&cache, Some(&sel))
                }
                _ => run(&cache, None),
            })
        }
    }
}

/// The bf16 rows an FP8 request attends, dequantized into one contiguous cache: dense, its
/// whole context in order; sparse, each distinct selected token once, with the selection
/// rewritten to index them (padding and repeats kept).
fn dequantize_attended(
    bytes: &[u8],
    block_tokens: usize,
    r: &DecodeRequest<'_>,
) -> (Vec<u16>, Option<Vec<i32>>) {
    let row_of = |t: usize| {
        let block = r.table[t / block_tokens] as usize;
        let at = (block * block_tokens + t % block_tokens) * FP8_ROW_BYTES;
        &bytes[at..at + FP8_ROW_BYTES]
    };
    let push = |rows: &mut Vec<u16>, t: usize| {
        let start = rows.len();
        rows.resize(start + D_QK, 0);
        fp8::dequantize_row(row_of(t), &mut rows[start..]);
    };
    let mut rows = Vec::new();
    match &r.sel {
        None => {
            rows.reserve(r.tokens * D_QK);
            for t in 0..r.tokens {
                push(&mut rows, t);
            }
            (rows, None)
        }
        Some(sel) => {
            let mut slot = vec![u32::MAX; r.tokens];
            let mut next = 0u32;
            let remapped = sel
                .raw()
                .iter()
                .map(|&i| {
                    if i < 0 {
                        return -1;
                    }
                    let t = i as usize;
                    if slot[t] == u32::MAX {
                        slot[t] = next;
                        next += 1;
                        push(&mut rows, t);
                    }
                    slot[t] as i32
                })
                .collect();
            (rows, Some(remapped))
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn pools_are_whole_blocks() {
        let rows = vec![0u16; 3 * 16 * D_QK];
        assert_eq!(KvPool::bf16(&rows, 16).unwrap().shape().blocks, 3);
        assert!(KvPool::bf16(&rows, 0).is_err());
        assert!(KvPool::bf16(&rows[..D_QK * 47], 16).is_err());
        let bytes = vec![0u8; 5 * 4 * FP8_ROW_BYTES];
        let p = KvPool::fp8(&bytes, 4).unwrap();
        assert_eq!((p.shape().blocks, p.shape().fp8), (5, true));
        assert!(KvPool::fp8(&bytes[1..], 4).is_err());
    }

    #[test]
    fn a_bad_request_is_refused_by_its_position() {
        let rows = vec![0x3f80u16; 2 * 4 * D_QK];
        let pool = KvPool::bf16(&rows, 4).unwrap();
        let q = vec![0x3f80u16; D_QK];
        let q = Queries::new(&q).unwrap();
        let good = DecodeRequest::dense(q, &[1, 0], 7);
        let short = DecodeRequest::dense(q, &[1], 7); // 7 tokens need 2 blocks
        let outside = DecodeRequest::dense(q, &[0, 2], 5); // block 2 of 2
        let idx = [3, -1, 6];
        let sel = Selection::new(&idx, 3, 1, 1, 7).unwrap();
        let sparse_past = DecodeRequest::sparse(q, &[0, 1], 6, sel); // index 6 of 6 tokens
        for (bad, want) in [(short, 1), (outside, 1), (sparse_past, 1)] {
            let err = check_batch(&pool.shape(), &[good, bad], 0.1).unwrap_err();
            assert!(
                matches!(err, KernelError::Request { request, .. } if request == want),
                "{err}"
            );
        }
        assert!(check_batch(&pool.shape(), &[good], f32::NAN).is_err());
        assert!(check_batch(&pool.shape(), &[good, good], 0.1).is_ok());
    }

    /// An FP8 sparse request attends the same rows as its selection names, once each in the
    /// dequantized cache, padding and repeats kept.
    #[test]
    fn fp8_selections_are_remapped_onto_the_rows_they_name() {
        let tokens = 10;
        let rows: Vec<u16> = (0..tokens * D_QK)
            .map(|i| crate::bf16::from_f32((i % 577) as f32 / 64.0 - 4.0))
            .collect();
        let q8 = fp8::quantize(&rows).unwrap();
        let q = vec![0x3f80u16; 2 * D_QK];
        let q = Queries::new(&q).unwrap();
        let idx = [9, -1, 2, 9, 4, 4];
        let sel = Selection::new(&idx, 3, 1, 2, tokens).unwrap();
        // Two blocks of 8 tokens: tokens 0..8 in block 1, 8..10 in block 0.
        let mut pool = vec![0u8; 16 * FP8_ROW_BYTES];
        pool[8 * FP8_ROW_BYTES..].copy_from_slice(&q8[..8 * FP8_ROW_BYTES]);
        pool[..2 * FP8_ROW_BYTES].copy_from_slice(&q8[8 * FP8_ROW_BYTES..]);
        let r = DecodeRequest::sparse(q, &[1, 0], tokens, sel);
        let (got, remapped) = dequantize_attended(&pool, 8, &r);
        assert_eq!(remapped.unwrap(), vec![0, -1, 1, 0, 2, 2]);
        let all = fp8::dequantize(&q8).unwrap();
        for (slot, t) in [(0, 9), (1, 2), (2, 4)] {
            assert_eq!(
                &got[slot * D_QK..(slot + 1) * D_QK],
                &all[t * D_QK..(t + 1) * D_QK]
            );
        }
    }
}
