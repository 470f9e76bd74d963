//! Staged round-robin KV concatenation (paper 004 section 2.3): a sequence's decode tokens go
//! to KV shard 0 for `stage` tokens, then to shard 1 for the next `stage`, and so on around
//! the `KVP` shards, so that every shard grows whatever the batch and the length, and no two
//! shards ever differ by more than `stage` tokens.

use serde::{Deserialize, Serialize};

use crate::error::{HelixError, Result};

/// Where each token of a sequence lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// KV shards.
    pub kvp: usize,
    /// Consecutive tokens appended to one shard before moving to the next (the paper's
    /// example is 16).
    pub stage: usize,
}

impl Placement {
    /// `kvp` shards filled `stage` tokens at a time.
    pub fn new(kvp: usize, stage: usize) -> Result<Self> {
        if kvp == 0 || stage == 0 {
            return Err(HelixError::Config(format!(
                "placement needs at least one shard and a stage of at least one token (kvp {kvp}, stage {stage})"
            )));
        }
        Ok(Self { kvp, stage })
    }

    /// The shard of the token at `position` (0-based) of a sequence.
    pub const fn shard_of(&self, position: u64) -> usize {
        ((position / self.stage as u64) % self.kvp as u64) as usize
    }

    /// How many of a sequence's first `len` tokens shard `shard` holds.
    pub fn shard_len(&self, shard: usize, len: u64) -> u64 {
        let (stage, kvp) = (self.stage as u64, self.kvp as u64);
        let round = stage * kvp;
        let full = (len / round) * stage;
        let rest = len % round;
        let start = shard as u64 * stage;
        full + rest.saturating_sub(start).min(stage)
    }

    /// The positions among a sequence's first `len` tokens that shard `shard` holds, in order.
    pub fn positions(&self, shard: usize, len: u64) -> impl Iterator<Item = u64> + '_ {
        (0..len).filter(move |&p| self.shard_of(p) == shard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_paper_example_fills_rank_0_then_rank_1() {
        let p = Placement::new(4, 16).unwrap();
        assert!((0..16).all(|t| p.shard_of(t) == 0));
        assert!((16..32).all(|t| p.shard_of(t) == 1));
        assert_eq!(p.shard_of(64), 0);
        assert_eq!(p.shard_len(3, 40), 0, "shard 3 is still empty at 40 tokens");
        assert!(Placement::new(0, 16).is_err() && Placement::new(2, 0).is_err());
    }

    proptest! {
        #[test]
        fn shards_stay_within_one_stage_of_each_other_and_cover_every_token(
            kvp in 1usize..9, stage in 1usize..40, len in 0u64..5000,
        ) {
            let p = Placement::new(kvp, stage).unwrap();
            let lens: Vec<u64> = (0..kvp).map(|s| p.shard_len(s, len)).collect();
            prop_assert_eq!(lens.iter().sum::<u64>(), len);
            let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
            prop_assert!(hi - lo <= stage as u64, "{:?}", lens);
            // The closed form agrees with counting token by token.
            for (s, &n) in lens.iter().enumerate() {
                prop_assert_eq!(p.positions(s, len).count() as u64, n);
            }
        }
    }
}
