//! The delta-rotation splice (paper 000 section 2.2): cached rows stored at positions `from`
//! are re-rotated to `to` (RoPE band only; the 512 latent dims are copied bit-exactly) and
//! scattered into a paged pool, all layers of a chunk in one call.
//!
//! Source rows are `[layers, n, 576]` bf16 ([`SpliceJob::new`]), or the pool rows themselves
//! ([`SpliceJob::in_place`]: what fetch runs after its paged writes put the holder's rows in the
//! requester's pool; only the RoPE band is read and written, 128 of each row's 1152 bytes). The
//! destination is a pool of 64-token pages and a layer-major block table: layer `l`'s token `t`
//! goes to row `t % 64` of page `table[l * ceil(n / 64) + t / 64]`.

use rayon::prelude::*;

use crate::error::{KernelError, check_len};
use crate::layout::{D_QK, PAGE_TOKENS, check_pages};
use crate::rope::Rope;

/// A validated splice: shapes checked, pages in range and distinct.
#[derive(Debug)]
pub struct SpliceJob<'a> {
    /// `None`: in place (the rows are already in the pool).
    pub(crate) src: Option<&'a [u16]>,
    pub(crate) layers: usize,
    pub(crate) from: &'a [i64],
    pub(crate) to: &'a [i64],
    pub(crate) rope: Rope,
    pub(crate) pool: &'a mut [u16],
    pub(crate) table: &'a [u32],
}

impl<'a> SpliceJob<'a> {
    /// Checks every input; nothing is written by a job that fails to build.
    pub fn new(
        src: &'a [u16],
        layers: usize,
        from: &'a [i64],
        to: &'a [i64],
        rope: Rope,
        pool: &'a mut [u16],
        table: &'a [u32],
    ) -> Result<Self, KernelError> {
        let job = Self::in_place(layers, from, to, rope, pool, table)?;
        check_len(
            "splice source rows [layers, n, 576]",
            layers * from.len() * D_QK,
            src.len(),
        )?;
        Ok(Self {
            src: Some(src),
            ..job
        })
    }

    /// A splice of rows already in `pool` at the pages `table` names (same layout as
    /// [`SpliceJob::new`]'s destination): the RoPE band is re-rotated where it lies, the latent
    /// dims are not touched.
    pub fn in_place(
        layers: usize,
        from: &'a [i64],
        to: &'a [i64],
        rope: Rope,
        pool: &'a mut [u16],
        table: &'a [u32],
    ) -> Result<Self, KernelError> {
        if layers == 0 {
            return Err(KernelError::Empty("splice layers"));
        }
        let n = from.len();
        if n == 0 {
            return Err(KernelError::Empty("splice tokens"));
        }
        check_len("splice target positions", n, to.len())?;
        for (what, positions) in [("stored positions", from), ("new positions", to)] {
            if let Some((at, &p)) = positions.iter().enumerate().find(|&(_, &p)| p < 0) {
                return Err(KernelError::IndexOutOfRange {
                    what,
                    index: p,
                    at,
                    bound: usize::MAX,
                });
            }
        }
        let page_elems = PAGE_TOKENS * D_QK;
        if pool.is_empty() || !pool.len().is_multiple_of(page_elems) {
            return Err(KernelError::Shape {
                what: "splice pool (whole 64-token pages)",
                expected: pool.len().div_ceil(page_elems).max(1) * page_elems,
                got: pool.len(),
            });
        }
        let pages = pool.len() / page_elems;
        check_len(
            "splice block table",
            layers * n.div_ceil(PAGE_TOKENS),
            table.len(),
        )?;
        check_pages("splice block table", table, pages)?;
        let mut seen: Vec<(u32, usize)> = table.iter().copied().zip(0..).collect();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(KernelError::DuplicatePage {
                page: w[0].0,
                first: w[0].1,
                second: w[1].1,
            });
        }
        Ok(Self {
            src: None,
            layers,
            from,
            to,
            rope,
            pool,
            table,
        })
    }

    /// Whether the rows are re-rotated where they lie in the pool.
    pub fn is_in_place(&self) -> bool {
        self.src.is_none()
    }

    /// Tokens per layer.
    pub fn tokens(&self) -> usize {
        self.from.len()
    }

    /// The source row of (layer, token): from the source rows, or the pool row in place.
    pub(crate) fn src_row(&self, layer: usize, t: usize) -> &[u16] {
        match self.src {
            Some(src) => {
                let start = (layer * self.tokens() + t) * D_QK;
                &src[start..start + D_QK]
            }
            None => {
                let start = self.dst_start(layer, t);
                &self.pool[start..start + D_QK]
            }
        }
    }

    /// The distinct rotations of the job, each token's index into them, and their `(cos, sin)`
    /// tables (computed once per distinct `to - from`: a chunk re-homed as a whole has one).
    pub(crate) fn angle_tables(&self) -> (Vec<usize>, Vec<crate::rope::AngleTable>) {
        let deltas: Vec<i64> = self.to.iter().zip(self.from).map(|(t, f)| t - f).collect();
        let mut distinct = deltas.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let which = deltas
            .iter()
            .map(|d| distinct.binary_search(d).unwrap_or(0))
            .collect();
        // A delta per token means a table (32 f64 sin_cos) per token: built on every core.
        let tables = distinct
            .par_iter()
            .with_min_len(64)
            .map(|&d| self.rope.table(d))
            .collect();
        (which, tables)
    }

    pub(crate) fn dst_start(&self, layer: usize, t: usize) -> usize {
        let pages_per_layer = self.tokens().div_ceil(PAGE_TOKENS);
        let page = self.table[layer * pages_per_layer + t / PAGE_TOKENS] as usize;
        (page * PAGE_TOKENS + t % PAGE_TOKENS) * D_QK
    }

    pub(crate) fn dst_row(&mut self, layer: usize, t: usize) -> &mut [u16] {
        let start = self.dst_start(layer, t);
        &mut self.pool[start..start + D_QK]
    }
}
