//! The shapes of transfer requests and their validation. Every check here runs on the calling
//! thread before anything is queued: a request that fails one is refused whole, never
//! partially posted.

use std::sync::Arc;

use crate::error::{Side, TransportError};
use crate::mr::{MrDesc, check_range};

/// The pages of one side of a paged transfer: page `i` starts at
/// `offset + indices[i] * stride` and is `page_len` bytes long (paper 002 figure 2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pages {
    /// Page indices, in transfer order.
    pub indices: Arc<[u32]>,
    /// Bytes from one page index to the next (at least the page length).
    pub stride: u64,
    /// Bytes before page index 0.
    pub offset: u64,
}

impl Pages {
    /// Pages at `indices` with the given stride and offset.
    pub fn new(indices: impl Into<Arc<[u32]>>, stride: u64, offset: u64) -> Self {
        Self {
            indices: indices.into(),
            stride,
            offset,
        }
    }

    /// Byte offset of transfer page `i` (callers have validated the pages).
    #[inline]
    pub(crate) fn byte_offset(&self, i: usize) -> u64 {
        self.offset + u64::from(self.indices[i]) * self.stride
    }

    /// Checks that every page lies inside a region of `region_len` bytes and that pages
    /// cannot overlap. One pass over the indices, using the largest one.
    pub(crate) fn validate(
        &self,
        side: Side,
        page_len: u64,
        region_len: u64,
    ) -> Result<(), TransportError> {
        if self.stride < page_len {
            return Err(TransportError::StrideTooSmall {
                side,
                stride: self.stride,
                page_len,
            });
        }
        let Some(&max) = self.indices.iter().max() else {
            return Ok(());
        };
        let end = u64::from(max)
            .checked_mul(self.stride)
            .and_then(|b| b.checked_add(self.offset))
            .and_then(|b| b.checked_add(page_len));
        match end {
            Some(end) if end <= region_len => Ok(()),
            _ => Err(TransportError::PageOutOfBounds {
                side,
                index: max,
                stride: self.stride,
                offset: self.offset,
                page_len,
                region_len,
            }),
        }
    }
}

/// One target of a scatter: `len` bytes from `src_offset` of the source region to
/// `dst_offset` of the target region (paper 002 figure 2, `ScatterDst`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScatterDst {
    /// Bytes to write.
    pub len: u64,
    /// Offset in the source region.
    pub src_offset: u64,
    /// The target region.
    pub dst: MrDesc,
    /// Offset in the target region.
    pub dst_offset: u64,
}

/// Checks a scatter's ranges against its source region and each target's descriptor.
pub(crate) fn validate_scatter(src_len: u64, dsts: &[ScatterDst]) -> Result<(), TransportError> {
    for d in dsts {
        check_range(Side::Source, src_len, d.src_offset, d.len)?;
        check_range(Side::Destination, d.dst.len, d.dst_offset, d.len)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_must_not_overlap_or_run_past_the_region() {
        let pages = Pages::new(vec![0, 3, 1], 1024, 64);
        assert!(pages.validate(Side::Source, 1024, 64 + 4 * 1024).is_ok());
        assert_eq!(
            pages.validate(Side::Source, 1024, 64 + 4 * 1024 - 1),
            Err(TransportError::PageOutOfBounds {
                side: Side::Source,
                index: 3,
                stride: 1024,
                offset: 64,
                page_len: 1024,
                region_len: 64 + 4 * 1024 - 1
            })
        );
        assert_eq!(
            Pages::new(vec![0], 512, 0).validate(Side::Destination, 1024, 1 << 20),
            Err(TransportError::StrideTooSmall {
                side: Side::Destination,
                stride: 512,
                page_len: 1024
            })
        );
        assert!(
            Pages::new(vec![u32::MAX], u64::MAX, 0)
                .validate(Side::Source, 1, u64::MAX)
                .is_err(),
            "overflow"
        );
        assert!(
            Pages::new(Vec::new(), 8, 0)
                .validate(Side::Source, 8, 0)
                .is_ok(),
            "no pages, nothing to check"
        );
        assert_eq!(pages.byte_offset(1), 64 + 3 * 1024);
    }
}
