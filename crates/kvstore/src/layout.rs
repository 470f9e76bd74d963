//! Layer blocks and full blocks (docs/kvstore.md; paper 003's layer-wise blocks, paper 000's
//! MLA rows).
//!
//! A **layer block** is one layer's rows of a run of tokens, `[tokens, 576]` bf16 (1152 B per
//! token per layer for MLA). A **full block** is the `L` layer blocks of the same tokens back
//! to back, so concatenating layer blocks *is* a full block, with no copy. Tokens are stored in
//! whole 64-token pages (the kernels' [`PAGE_TOKENS`]); the rows past the last token of a
//! partial page are padding. A full block is then `L * pages_per_layer` pages, layer-major: the
//! page order a splice's block table and a paged write both use.

use kvroute_kernels::Cache;
use kvroute_kernels::layout::{D_QK, PAGE_TOKENS};
use serde::{Deserialize, Serialize};

use crate::error::StoreError;

/// Bytes of one cache row (one token, one layer): 576 bf16.
pub const ROW_BYTES: usize = D_QK * 2;
/// Bytes of one 64-token page of one layer.
pub const PAGE_BYTES: usize = PAGE_TOKENS * ROW_BYTES;

/// The shape of a full block: `layers` layer blocks of `tokens` tokens each, in pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockLayout {
    /// Layers `L`.
    pub layers: u32,
    /// Tokens per layer block (`ct`).
    pub tokens: u32,
}

impl BlockLayout {
    /// A checked layout: both counts positive, the block addressable.
    pub fn new(layers: u32, tokens: u32) -> Result<Self, StoreError> {
        let layout = Self { layers, tokens };
        layout.validate()?;
        Ok(layout)
    }

    /// Checks a layout (one read from a peer goes through this before use).
    pub fn validate(&self) -> Result<(), StoreError> {
        if self.layers == 0 || self.tokens == 0 {
            return Err(StoreError::Layout("layers and tokens must be positive"));
        }
        // Page indices are u32 on the wire (paged writes, block tables).
        let pages = u64::from(self.layers) * u64::from(self.tokens).div_ceil(PAGE_TOKENS as u64);
        if pages > u64::from(u32::MAX) || pages * PAGE_BYTES as u64 > isize::MAX as u64 {
            return Err(StoreError::Layout("block too large to address"));
        }
        Ok(())
    }

    /// Pages per layer block: `ceil(tokens / 64)`.
    pub fn pages_per_layer(&self) -> usize {
        (self.tokens as usize).div_ceil(PAGE_TOKENS)
    }

    /// Pages of the full block.
    pub fn pages(&self) -> usize {
        self.layers as usize * self.pages_per_layer()
    }

    /// Rows per layer block including the padding of the last page.
    pub fn padded_tokens(&self) -> usize {
        self.pages_per_layer() * PAGE_TOKENS
    }

    /// `u16` elements of one layer block (padding included).
    pub fn layer_elems(&self) -> usize {
        self.padded_tokens() * D_QK
    }

    /// `u16` elements of the full block.
    pub fn full_elems(&self) -> usize {
        self.layers as usize * self.layer_elems()
    }

    /// Bytes of the full block.
    pub fn full_bytes(&self) -> usize {
        self.full_elems() * 2
    }

    /// Byte offset of layer `layer`'s block inside the full block.
    pub fn layer_offset(&self, layer: u32) -> Result<usize, StoreError> {
        self.check_layer(layer)?;
        Ok(layer as usize * self.layer_elems() * 2)
    }

    /// Byte offset of row (`layer`, `token`) inside the full block.
    pub fn row_offset(&self, layer: u32, token: u32) -> Result<usize, StoreError> {
        if token >= self.tokens {
            return Err(StoreError::OutOfRange {
                what: "token",
                index: u64::from(token),
                bound: u64::from(self.tokens),
            });
        }
        Ok(self.layer_offset(layer)? + token as usize * ROW_BYTES)
    }

    /// Page index (inside the full block) of layer `layer`'s `page`-th page.
    pub fn page(&self, layer: u32, page: usize) -> Result<u32, StoreError> {
        self.check_layer(layer)?;
        if page >= self.pages_per_layer() {
            return Err(StoreError::OutOfRange {
                what: "page of a layer block",
                index: page as u64,
                bound: self.pages_per_layer() as u64,
            });
        }
        // Fits: validate() bounded the page count by u32::MAX.
        Ok((layer as usize * self.pages_per_layer() + page) as u32)
    }

    fn check_layer(&self, layer: u32) -> Result<(), StoreError> {
        if layer >= self.layers {
            return Err(StoreError::OutOfRange {
                what: "layer",
                index: u64::from(layer),
                bound: u64::from(self.layers),
            });
        }
        Ok(())
    }
}

/// One layer's rows of a run of tokens: `[tokens, 576]` bf16 bits (plus page padding).
#[derive(Debug, Clone, Copy)]
pub struct LayerBlock<'a> {
    rows: &'a [u16],
    tokens: usize,
}

impl<'a> LayerBlock<'a> {
    /// The tokens' rows (padding excluded).
    pub fn rows(&self) -> &'a [u16] {
        &self.rows[..self.tokens * D_QK]
    }

    /// Tokens in the block.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The block as the kernels' contiguous cache.
    pub fn cache(&self) -> Result<Cache<'a>, StoreError> {
        Ok(Cache::contiguous(self.rows())?)
    }
}

/// The `L` layer blocks of the same tokens, back to back, over borrowed memory (a registered
/// buffer or a plain vector).
#[derive(Debug, Clone, Copy)]
pub struct FullBlock<'a> {
    elems: &'a [u16],
    layout: BlockLayout,
}

impl<'a> FullBlock<'a> {
    /// A view of `elems` as a full block of `layout` (the length must match exactly).
    pub fn new(elems: &'a [u16], layout: BlockLayout) -> Result<Self, StoreError> {
        layout.validate()?;
        if elems.len() != layout.full_elems() {
            return Err(StoreError::Shape {
                what: "full block",
                expected: layout.full_elems(),
                got: elems.len(),
            });
        }
        Ok(Self { elems, layout })
    }

    /// Its layout.
    pub fn layout(&self) -> BlockLayout {
        self.layout
    }

    /// Layer `layer`'s block.
    pub fn layer(&self, layer: u32) -> Result<LayerBlock<'a>, StoreError> {
        let start = self.layout.layer_offset(layer)? / 2;
        Ok(LayerBlock {
            rows: &self.elems[start..start + self.layout.layer_elems()],
            tokens: self.layout.tokens as usize,
        })
    }

    /// The whole block's elements (layer-major pages), as a paged pool the kernels read.
    pub fn elems(&self) -> &'a [u16] {
        self.elems
    }
}

/// Concatenates layer blocks of the same tokens into one full block's memory (what a store
/// that receives layer blocks one by one ends up with; the views above then need no copy).
pub fn concat_layers(layers: &[LayerBlock<'_>]) -> Result<(Vec<u16>, BlockLayout), StoreError> {
    let first = layers
        .first()
        .ok_or(StoreError::Layout("no layer blocks"))?;
    let tokens =
        u32::try_from(first.tokens()).map_err(|_| StoreError::Layout("too many tokens"))?;
    let layer_count =
        u32::try_from(layers.len()).map_err(|_| StoreError::Layout("too many layers"))?;
    let layout = BlockLayout::new(layer_count, tokens)?;
    let mut out = Vec::with_capacity(layout.full_elems());
    for block in layers {
        if block.tokens() != first.tokens() {
            return Err(StoreError::Shape {
                what: "layer block tokens",
                expected: first.tokens(),
                got: block.tokens(),
            });
        }
        out.extend_from_slice(block.rows());
        out.resize(
            out.len() + (layout.padded_tokens() - block.tokens()) * D_QK,
            0,
        );
    }
    Ok((out, layout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_follow_pages() -> Result<(), StoreError> {
        let layout = BlockLayout::new(27, 100)?;
        assert_eq!(layout.pages_per_layer(), 2);
        assert_eq!(layout.pages(), 54);
        assert_eq!(layout.full_bytes(), 27 * 128 * ROW_BYTES);
        assert_eq!(layout.layer_offset(1)?, 128 * ROW_BYTES);
        assert_eq!(layout.row_offset(2, 65)?, (2 * 128 + 65) * ROW_BYTES);
        assert_eq!(layout.page(2, 1)?, 5);
        assert!(layout.page(2, 2).is_err());
        assert!(layout.row_offset(0, 100).is_err());
        assert!(layout.layer_offset(27).is_err());
        assert!(BlockLayout::new(0, 1).is_err());
        assert!(BlockLayout::new(u32::MAX, u32::MAX).is_err());
        Ok(())
    }

    #[test]
    fn full_block_is_its_layer_blocks_back_to_back() -> Result<(), StoreError> {
        let layout = BlockLayout::new(3, 70)?;
        let a: Vec<u16> = (0..layout.full_elems()).map(|i| i as u16).collect();
        let full = FullBlock::new(&a, layout)?;
        let layers: Vec<_> = (0..3).map(|l| full.layer(l)).collect::<Result<_, _>>()?;
        let (b, again) = concat_layers(&layers)?;
        assert_eq!(again, layout);
        // Rows agree; padding is zero in the concatenation.
        for l in 0..3 {
            let (x, y) = (full.layer(l)?, FullBlock::new(&b, layout)?.layer(l)?);
            assert_eq!(x.rows(), y.rows());
            assert_eq!(x.cache()?.tokens(), 70);
        }
        assert!(FullBlock::new(&a[1..], layout).is_err());
        Ok(())
    }
}
