//! Which rank does what: the attention grid `KVP x TPA` and the FFN grid `TPF x EP` over the
//! same `N` ranks (paper 004 section 2, figure 4).
//!
//! Rank `r` attends as KV shard `r % KVP` of head group `r / KVP`: the ranks of one head group
//! (its "KVP domain") hold the same heads over different tokens, so the all-to-all after
//! attention runs within a domain. After it, rank `r` owns query heads
//! `[r Q / N, (r + 1) Q / N)`, which lie inside its own group's heads, and the post-attention
//! projection runs `N`-way tensor-parallel over them. For the FFN, rank `r` is TP shard
//! `r % TPF` of expert group `r / TPF`; expert group `g` holds the experts `e` with
//! `e % EP == g`.

use serde::{Deserialize, Serialize};

use crate::error::{HelixError, Result};

/// The most ranks one layer runs on (a round's sources are a 64-bit mask).
pub const MAX_RANKS: usize = 64;

/// The two grids over one pool of ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// KV-parallel width: sequence shards during attention.
    pub kvp: usize,
    /// Tensor-parallel width during attention (`<= K`, the KV heads).
    pub tpa: usize,
    /// Tensor-parallel width of the FFN (and within each expert).
    pub tpf: usize,
    /// Expert-parallel width of the FFN (1 for a dense FFN).
    pub ep: usize,
}

impl Layout {
    /// `KVP x TPA` ranks attending, re-provisioned as `TPF x EP = N` for the FFN.
    pub fn new(kvp: usize, tpa: usize, tpf: usize, ep: usize) -> Result<Self> {
        let layout = Self { kvp, tpa, tpf, ep };
        layout.validate()?;
        Ok(layout)
    }

    /// Every width at least 1, `KVP x TPA = TPF x EP`, and at most [`MAX_RANKS`] ranks.
    pub fn validate(&self) -> Result<()> {
        if [self.kvp, self.tpa, self.tpf, self.ep].contains(&0) {
            return Err(HelixError::Config(format!(
                "every width must be at least 1: {self:?}"
            )));
        }
        let n = self.kvp.checked_mul(self.tpa);
        if n.is_none() || n != self.tpf.checked_mul(self.ep) {
            return Err(HelixError::Config(format!(
                "KVP x TPA ({} x {}) must equal TPF x EP ({} x {})",
                self.kvp, self.tpa, self.tpf, self.ep
            )));
        }
        if self.ranks() > MAX_RANKS {
            return Err(HelixError::Config(format!(
                "{} ranks: at most {MAX_RANKS}",
                self.ranks()
            )));
        }
        Ok(())
    }

    /// `N`, the ranks of the pool.
    pub const fn ranks(&self) -> usize {
        self.kvp * self.tpa
    }

    /// Rank `r`'s KV shard during attention.
    pub const fn kvp_index(&self, rank: usize) -> usize {
        rank % self.kvp
    }

    /// Rank `r`'s head group during attention.
    pub const fn head_group(&self, rank: usize) -> usize {
        rank / self.kvp
    }

    /// The ranks that exchange partials with rank `r`: its head group's KV shards.
    pub fn kvp_domain(&self, rank: usize) -> std::ops::Range<usize> {
        let first = self.head_group(rank) * self.kvp;
        first..first + self.kvp
    }

    /// Rank `r`'s tensor-parallel index in the FFN.
    pub const fn tpf_index(&self, rank: usize) -> usize {
        rank % self.tpf
    }

    /// Rank `r`'s expert group in the FFN.
    pub const fn expert_group(&self, rank: usize) -> usize {
        rank / self.tpf
    }
}
