//! How a transfer becomes work requests, and how many immediates it delivers.
//!
//! The sender shards and the receiver counts with the same functions, so nobody computes
//! "pages x layers x shards" by hand (paper 002 appendix A's decoder does exactly that, for
//! one NIC). The rules:
//!
//! - a single write of `len` bytes is split over `min(nics, ceil(len / MIN_SHARD_BYTES))` NICs;
//!   every shard carries the immediate;
//! - a paged transfer posts one write per page, pages rotated over the NICs; every page carries
//!   the immediate;
//! - an immediate-only write, each scatter target and each barrier target is one write.

/// Writes shorter than this go through one NIC: below it, splitting adds more per-request
/// overhead than it saves in wire time.
pub const MIN_SHARD_BYTES: u64 = 64 * 1024;

/// The shape of a transfer, for counting the immediates it delivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferShape {
    /// `submit_single_write` of `len` bytes.
    SingleWrite {
        /// Bytes written.
        len: u64,
    },
    /// `submit_paged_writes` of `pages` pages.
    PagedWrites {
        /// Pages written.
        pages: u64,
    },
    /// `submit_imm`, and each target of a scatter or barrier.
    Imm,
}

/// How many shards (work requests) a single write of `len` bytes becomes over `nics` NICs.
#[inline]
pub fn single_write_shards(len: u64, nics: usize) -> usize {
    let wanted = len.div_ceil(MIN_SHARD_BYTES).max(1);
    usize::try_from(wanted)
        .unwrap_or(usize::MAX)
        .min(nics.max(1))
}

/// Shard `i` of `shards` of a `len`-byte range: `(offset, length)`, the first `len % shards`
/// shards one byte longer, so the shards tile the range exactly.
#[inline]
pub fn shard(len: u64, shards: usize, i: usize) -> (u64, u64) {
    let (shards, i) = (shards as u64, i as u64);
    let (base, extra) = (len / shards, len % shards);
    let offset = i * base + i.min(extra);
    (offset, base + u64::from(i < extra))
}

/// How many immediates the receiver counts for one transfer of `shape` between domain groups
/// of `nics` NICs (all peers have the same NIC count, paper 002 section 3.2).
#[inline]
pub fn arrivals(shape: TransferShape, nics: usize) -> u64 {
    match shape {
        TransferShape::SingleWrite { len } => single_write_shards(len, nics) as u64,
        TransferShape::PagedWrites { pages } => pages,
        TransferShape::Imm => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_writes_use_one_nic_large_ones_all() {
        assert_eq!(single_write_shards(0, 4), 1);
        assert_eq!(single_write_shards(4096, 4), 1);
        assert_eq!(single_write_shards(MIN_SHARD_BYTES + 1, 4), 2);
        assert_eq!(single_write_shards(1 << 30, 4), 4);
        assert_eq!(single_write_shards(1 << 30, 1), 1);
        assert_eq!(
            arrivals(TransferShape::PagedWrites { pages: 27 * 16 }, 2),
            432
        );
    }

    proptest! {
        #[test]
        fn shards_tile_the_range_exactly(len in 0u64..1 << 40, nics in 1usize..=4) {
            let shards = single_write_shards(len, nics);
            let mut next = 0;
            for i in 0..shards {
                let (offset, l) = shard(len, shards, i);
                prop_assert_eq!(offset, next);
                prop_assert!(l >= len / shards as u64);
                next = offset + l;
            }
            prop_assert_eq!(next, len);
        }
    }
}
