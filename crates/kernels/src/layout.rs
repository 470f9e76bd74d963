//! The shapes of absorbed MLA decode, as DeepSeek's reference code and FlashMLA use them.
//!
//! A cache row is `[512 latent | 64 RoPE]` bf16 (1152 B); a query row, one (token, head) pair,
//! is 576 bf16 against it; V is the first 512 dims of the cache row. Tokens live in a paged
//! pool of 64-token pages addressed by a block table; a contiguous chunk is the case where the
//! table is `0, 1, 2, ...` over a buffer of rows.

use crate::error::{KernelError, check_len};

/// Latent (and V) width.
pub const D_LATENT: usize = 512;
/// RoPE band width.
pub const D_ROPE: usize = 64;
/// Query / key width: latent + RoPE.
pub const D_QK: usize = D_LATENT + D_ROPE;
/// Tokens per page of the paged pool.
pub const PAGE_TOKENS: usize = 64;
/// A query row on the wire (paper 000 section 3.2: 576 x 2 B).
pub const QUERY_ROW_BYTES: usize = D_QK * 2;
/// A partial row on the wire (paper 000 section 3.2: o as 512 bf16, then m and l as f32).
pub const PARTIAL_ROW_BYTES: usize = D_LATENT * 2 + 2 * 4;

/// How the 64 RoPE dims pair up for rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum RopeLayout {
    /// Pairs `(2i, 2i + 1)`: DeepSeek's checkpoints (the reference code's
    /// `view_as_complex` on adjacent dims).
    #[default]
    Interleaved,
    /// Pairs `(i, i + 32)`: the `rotate_half` convention (Hugging Face Llama-style).
    Half,
}

impl RopeLayout {
    /// The two dims (within the RoPE band) of frequency pair `i` (0..32).
    #[inline(always)]
    pub fn pair(self, i: usize) -> (usize, usize) {
        match self {
            Self::Interleaved => (2 * i, 2 * i + 1),
            Self::Half => (i, i + D_ROPE / 2),
        }
    }
}

/// Cache rows, contiguous or paged: the keys (and values) an attention call reads.
#[derive(Debug, Clone, Copy)]
pub struct Cache<'a> {
    rows: &'a [u16],
    table: Option<&'a [u32]>,
    tokens: usize,
    /// Tokens per page (paged), and its log2 where it is a power of two.
    block: usize,
    shift: Option<u32>,
}

impl<'a> Cache<'a> {
    /// `rows.len() / 576` contiguous rows.
    pub fn contiguous(rows: &'a [u16]) -> Result<Self, KernelError> {
        if !rows.len().is_multiple_of(D_QK) {
            return Err(KernelError::Shape {
                what: "cache rows",
                expected: rows.len() / D_QK * D_QK,
                got: rows.len(),
            });
        }
        Ok(Self {
            rows,
            table: None,
            tokens: rows.len() / D_QK,
            block: PAGE_TOKENS,
            shift: None,
        })
    }

    /// `tokens` tokens in a pool of 64-token pages: token `t` is row `t % 64` of page
    /// `table[t / 64]`. Every page the tokens touch is checked against the pool.
    pub fn paged(pool: &'a [u16], table: &'a [u32], tokens: usize) -> Result<Self, KernelError> {
        Self::paged_blocks(pool, PAGE_TOKENS, table, tokens)
    }

    /// [`Cache::paged`] over pages of `block_tokens` tokens (any positive number): token `t`
    /// is row `t % block_tokens` of page `table[t / block_tokens]`.
    pub fn paged_blocks(
        pool: &'a [u16],
        block_tokens: usize,
        table: &'a [u32],
        tokens: usize,
    ) -> Result<Self, KernelError> {
        if block_tokens == 0 {
            return Err(KernelError::Parameter {
                what: "tokens per block",
                value: 0.0,
                why: "must be positive",
            });
        }
        let page_elems = block_tokens * D_QK;
        if !pool.len().is_multiple_of(page_elems) {
            return Err(KernelError::Shape {
                what: "paged pool (whole blocks of rows)",
                expected: pool.len() / page_elems * page_elems,
                got: pool.len(),
            });
        }
        let pages = pool.len() / page_elems;
        let used = tokens.div_ceil(block_tokens);
        if table.len() < used {
            return Err(KernelError::Shape {
                what: "block table (pages for the tokens)",
                expected: used,
                got: table.len(),
            });
        }
        check_pages("block table", &table[..used], pages)?;
        Ok(Self {
            rows: pool,
            table: Some(table),
            tokens,
            block: block_tokens,
            shift: block_tokens
                .is_power_of_two()
                .then(|| block_tokens.trailing_zeros()),
        })
    }

    /// Tokens in the cache.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The rows (or the pool) and the block table, as the CUDA backend uploads them.
    pub(crate) fn parts(&self) -> (&'a [u16], Option<&'a [u32]>) {
        (self.rows, self.table)
    }

    /// Tokens per page of a paged cache.
    pub(crate) fn block_tokens(&self) -> usize {
        self.block
    }

    /// Token `t`'s (page index in the table, row within the page).
    #[inline(always)]
    fn page_of(&self, t: usize) -> (usize, usize) {
        match self.shift {
            Some(s) => (t >> s, t & (self.block - 1)),
            None => (t / self.block, t % self.block),
        }
    }

    #[inline(always)]
    fn row_start(&self, t: usize) -> usize {
        match self.table {
            None => t * D_QK,
            Some(table) => {
                let (page, at) = self.page_of(t);
                (table[page] as usize * self.block + at) * D_QK
            }
        }
    }

    /// Row `t`; panics past [`Cache::tokens`] (kernels validate indices before reading).
    #[inline(always)]
    pub fn row(&self, t: usize) -> &'a [u16] {
        let start = self.row_start(t);
        &self.rows[start..start + D_QK]
    }

    /// Rows `t0..t0 + n` as one slice when they are adjacent in memory (always for a
    /// contiguous cache; within one page for a paged one).
    #[inline]
    pub(crate) fn run(&self, t0: usize, n: usize) -> Option<&'a [u16]> {
        match self.table {
            None => Some(&self.rows[t0 * D_QK..(t0 + n) * D_QK]),
            Some(_) if self.page_of(t0).0 == self.page_of(t0 + n - 1).0 => {
                let start = self.row_start(t0);
                Some(&self.rows[start..start + n * D_QK])
            }
            Some(_) => None,
        }
    }
}

/// Checks that every entry of a block table names one of the pool's `pages`.
pub(crate) fn check_pages(
    what: &'static str,
    table: &[u32],
    pages: usize,
) -> Result<(), KernelError> {
    match table.iter().position(|&p| p as usize >= pages) {
        Some(at) => Err(KernelError::IndexOutOfRange {
            what,
            index: i64::from(table[at]),
            at,
            bound: pages,
        }),
        None => Ok(()),
    }
}

/// Query rows `[mq, 576]` bf16.
#[derive(Debug, Clone, Copy)]
pub struct Queries<'a> {
    rows: &'a [u16],
}

impl<'a> Queries<'a> {
    /// Wraps `rows` (a whole number of 576-wide rows).
    pub fn new(rows: &'a [u16]) -> Result<Self, KernelError> {
        check_len("query rows", rows.len() / D_QK * D_QK, rows.len())?;
        Ok(Self { rows })
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.rows.len() / D_QK
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Row `r`.
    #[inline(always)]
    pub fn row(&self, r: usize) -> &'a [u16] {
        &self.rows[r * D_QK..(r + 1) * D_QK]
    }

    /// All rows.
    pub fn as_slice(&self) -> &'a [u16] {
        self.rows
    }
}

/// A sparse selection: for each query *token*, `k` cache token indices (-1 = padding), shared
/// by its `rows_per_token` query rows (its heads). A duplicated index counts once per
/// occurrence, as a gather would.
#[derive(Debug, Clone, Copy)]
pub struct Selection<'a> {
    indices: &'a [i32],
    k: usize,
    rows_per_token: usize,
}

impl<'a> Selection<'a> {
    /// Checks the shape against `mq` query rows and every index against `cache_tokens`.
    pub fn new(
        indices: &'a [i32],
        k: usize,
        rows_per_token: usize,
        mq: usize,
        cache_tokens: usize,
    ) -> Result<Self, KernelError> {
        if k == 0 {
            return Err(KernelError::Empty("selection (k = 0)"));
        }
        if rows_per_token == 0 || !mq.is_multiple_of(rows_per_token) {
            return Err(KernelError::Parameter {
                what: "rows per token",
                value: rows_per_token as f64,
                why: "must be positive and divide the number of query rows",
            });
        }
        check_len("selected indices", mq / rows_per_token * k, indices.len())?;
        for (at, &i) in indices.iter().enumerate() {
            if i < -1 || (i >= 0 && i as usize >= cache_tokens) {
                return Err(KernelError::IndexOutOfRange {
                    what: "selected indices (-1 = padding)",
                    index: i64::from(i),
                    at,
                    bound: cache_tokens,
                });
            }
        }
        Ok(Self {
            indices,
            k,
            rows_per_token,
        })
    }

    /// The indices as given.
    pub fn raw(&self) -> &'a [i32] {
        self.indices
    }

    /// Indices per query token.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Query rows per query token.
    pub fn rows_per_token(&self) -> usize {
        self.rows_per_token
    }

    /// The selected indices of query row `r` (padding included).
    #[inline]
    pub fn of_row(&self, r: usize) -> &'a [i32] {
        let t = r / self.rows_per_token;
        &self.indices[t * self.k..(t + 1) * self.k]
    }
}
