//! What one (chunk, request) decision is asked about: the query batch, the chunk, how the
//! chunk is attended (contiguous or a scattered top-k selection), tensor-parallel degree, the
//! holder's load, and which primitives may be chosen.

use serde::{Deserialize, Serialize};

use crate::error::{CostModelError, Result, count};

/// The three ways to attend to KV that lives on another instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Primitive {
    /// Move the query rows to the holder and merge the partial that comes back.
    Route,
    /// Move the cache to the requester (and re-rotate it for contiguous reuse).
    Fetch,
    /// Recompute the chunk locally (re-prefill).
    Local,
}

impl Primitive {
    /// All primitives, in the order ties are broken.
    pub const ALL: [Self; 3] = [Self::Route, Self::Fetch, Self::Local];

    /// The lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Route => "route",
            Self::Fetch => "fetch",
            Self::Local => "local",
        }
    }
}

impl std::fmt::Display for Primitive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a request attends to on the holders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Selection {
    /// The whole contiguous chunk, on one holder (fetch re-homes it and pays the splice).
    Contiguous,
    /// An indexer's top-k entries scattered over `holders` holders (attended at their
    /// canonical positions: no splice, paper 000 section 3.3).
    Sparse {
        /// Selected entries per query.
        topk: u32,
        /// Holders the selection spans.
        holders: u32,
    },
}

/// Which primitives the predicate may choose (a byte store cannot route; experiments force one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allowed {
    /// Route is possible (the holder can run the partial).
    pub route: bool,
    /// Fetch is possible.
    pub fetch: bool,
    /// Local re-prefill is possible.
    pub local: bool,
}

impl Allowed {
    /// Every primitive.
    pub const ALL: Self = Self {
        route: true,
        fetch: true,
        local: true,
    };

    /// Only `primitive`.
    pub const fn only(primitive: Primitive) -> Self {
        Self {
            route: matches!(primitive, Primitive::Route),
            fetch: matches!(primitive, Primitive::Fetch),
            local: matches!(primitive, Primitive::Local),
        }
    }

    /// Whether `primitive` may be chosen.
    #[inline]
    pub const fn contains(self, primitive: Primitive) -> bool {
        match primitive {
            Primitive::Route => self.route,
            Primitive::Fetch => self.fetch,
            Primitive::Local => self.local,
        }
    }
}

impl Default for Allowed {
    fn default() -> Self {
        Self::ALL
    }
}

fn one() -> u32 {
    1
}

/// One (chunk, request) decision's inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// `Mq`: query rows routed in one round trip (one row per (token, head) pair).
    pub mq_rows: u32,
    /// `ct`: tokens (cache entries) in the chunk.
    pub chunk_tokens: u32,
    /// What is attended.
    pub selection: Selection,
    /// Tensor-parallel degree `N` of both instances; rank r pairs with rank r (paper 000
    /// section 8, "Tensor parallelism"), so each rank pair moves 1/N of the bytes in parallel.
    #[serde(default = "one")]
    pub tp_degree: u32,
    /// Routed requesters the holder is serving at once, itself included (its batch size).
    #[serde(default = "one")]
    pub holder_requesters: u32,
    /// The primitives that may be chosen.
    #[serde(default)]
    pub allowed: Allowed,
}

impl Request {
    /// A request against a whole contiguous chunk, all primitives allowed.
    pub const fn contiguous(mq_rows: u32, chunk_tokens: u32) -> Self {
        Self {
            mq_rows,
            chunk_tokens,
            selection: Selection::Contiguous,
            tp_degree: 1,
            holder_requesters: 1,
            allowed: Allowed::ALL,
        }
    }

    /// A request against a top-k selection of a chunk spread over `holders` holders.
    pub const fn sparse(mq_rows: u32, chunk_tokens: u32, topk: u32, holders: u32) -> Self {
        Self {
            selection: Selection::Sparse { topk, holders },
            ..Self::contiguous(mq_rows, chunk_tokens)
        }
    }

    /// Checks the counts and their consistency.
    #[inline]
    pub fn validate(&self) -> Result<()> {
        count("mq_rows", self.mq_rows)?;
        count("chunk_tokens", self.chunk_tokens)?;
        count("tp_degree", self.tp_degree)?;
        count("holder_requesters", self.holder_requesters)?;
        if let Selection::Sparse { topk, holders } = self.selection {
            count("topk", topk)?;
            count("holders", holders)?;
            if topk > self.chunk_tokens {
                return Err(CostModelError::TopKExceedsChunk {
                    topk,
                    chunk_tokens: self.chunk_tokens,
                });
            }
            if holders > topk {
                return Err(CostModelError::MoreHoldersThanEntries { topk, holders });
            }
        }
        if !(self.allowed.route || self.allowed.fetch || self.allowed.local) {
            return Err(CostModelError::NoPrimitiveAllowed);
        }
        Ok(())
    }
}
