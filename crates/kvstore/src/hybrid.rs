//! The hybrid prefix-cache pool (paper 001 section 3.2, "Hybrid Prefix Cache Pool", after
//! vLLM's hybrid KV cache manager): one pool of equal-size blocks under one budget, shared by
//!
//! - **block-level KV** of the full-attention layers: it grows with the prompt and is reused
//!   by prefix, block by block (a [`PrefixCache`] over chained block hashes);
//! - **request-level state** of the linear-attention or sliding-window layers: a fixed number
//!   of blocks per request whatever its length, reusable only by a request whose cached length
//!   matches *exactly* (paper 001: "they can only be reused when the cached length matches
//!   exactly"), kept and evicted whole;
//!
//! and, across both, two kinds of use:
//!
//! - **prefix-cache blocks**: fully populated, shareable between requests, evictable when no
//!   request holds them;
//! - **transfer-cache blocks**: what a prefill produced and is sending to another instance;
//!   neither shareable nor evictable while in flight, and discarded when the transfer completes
//!   (paper 001: "the cache pool discards them once the transfer completes").
//!
//! When an allocation finds too few free blocks, the pool evicts the least recently used
//! unpinned entry of either kind (a KV block or a whole state), comparing their recency on one
//! clock, until enough are free; pinned entries and transfer blocks are never chosen, and an
//! allocation that cannot be met takes nothing.

use std::collections::HashMap;

use serde::Serialize;

use crate::error::StoreError;
use crate::pool::PagedPool;
use crate::prefix::{BlockKey, CacheError, Eviction, PrefixCache};

/// A transfer's handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct TransferId(pub u64);

/// How the pool's blocks are used now. `free + kv + state + transfer == total` always.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Usage {
    /// Blocks in the pool.
    pub total: usize,
    /// Free blocks.
    pub free: usize,
    /// Full-attention KV blocks cached for prefix reuse.
    pub kv: usize,
    /// Blocks of cached request-level states.
    pub state: usize,
    /// Transfer-cache blocks (in flight).
    pub transfer: usize,
    /// Of `kv + state`, blocks pinned by running requests.
    pub pinned: usize,
}

/// What a request can reuse ([`HybridPool::lookup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reuse {
    /// Leading full-attention blocks cached.
    pub kv_blocks: usize,
    /// The longest prefix, in blocks, at which both the KV blocks and a state of exactly that
    /// length are cached: what a hybrid model can skip recomputing (0: nothing).
    pub usable_blocks: usize,
}

/// Errors of the hybrid pool.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HybridError {
    /// Not enough blocks even after evicting everything evictable; nothing was taken.
    #[error("pool exhausted: {wanted} blocks wanted, {free} free and {evictable} evictable")]
    Exhausted {
        /// Blocks asked for.
        wanted: usize,
        /// Free now.
        free: usize,
        /// Held by unpinned cached entries.
        evictable: usize,
    },
    /// A transfer id that is not in flight.
    #[error("transfer {0:?} is not in flight")]
    UnknownTransfer(TransferId),
    /// The prefix cache refused.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// The block pool refused.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The pool. Blocks are indices into memory the owner registered (`blocks * block_bytes`).
#[derive(Debug)]
pub struct HybridPool {
    pool: PagedPool,
    kv: PrefixCache<u32>,
    /// Cached states, named by the hash of the block they follow and their exact token count.
    states: PrefixCache<Vec<u32>>,
    state_blocks: usize,
    block_tokens: u64,
    transfers: HashMap<TransferId, Vec<u32>>,
    next_transfer: u64,
    transfer_used: usize,
}

impl HybridPool {
    /// A pool of `blocks` blocks of `block_bytes` bytes holding `block_tokens` tokens of KV
    /// each, whose requests' states take `state_blocks` blocks (0 for a model without
    /// request-level state).
    pub fn new(
        blocks: u32,
        block_bytes: usize,
        block_tokens: u32,
        state_blocks: u32,
        policy: Eviction,
    ) -> Result<Self, HybridError> {
        if block_tokens == 0 {
            return Err(StoreError::Layout("a block holds tokens").into());
        }
        Ok(Self {
            pool: PagedPool::new(blocks, block_bytes)?,
            kv: PrefixCache::new(blocks as usize, policy),
            states: PrefixCache::new(0, Eviction::Lru),
            state_blocks: state_blocks as usize,
            block_tokens: u64::from(block_tokens),
            transfers: HashMap::new(),
            next_transfer: 0,
            transfer_used: 0,
        })
    }

    /// The pool's block allocator (offsets of blocks in the owner's memory).
    pub fn blocks(&self) -> &PagedPool {
        &self.pool
    }

    /// How the blocks are used now.
    pub fn usage(&self) -> Usage {
        Usage {
            total: self.pool.pages() as usize,
            free: self.pool.free_pages(),
            kv: self.kv.len(),
            state: self.state_block_count(),
            transfer: self.transfer_used,
            pinned: self.kv.pinned() + self.pinned_state_blocks(),
        }
    }

    /// What `hashes` (a prompt's chained block hashes) can reuse. Changes nothing.
    pub fn lookup(&self, hashes: &[u64]) -> Reuse {
        let kv_blocks = self.kv.longest_prefix(hashes);
        let usable_blocks = if self.state_blocks == 0 {
            kv_blocks
        } else {
            (1..=kv_blocks)
                .rev()
                .find(|&k| self.states.contains(self.state_key(hashes, k)))
                .unwrap_or(0)
        };
        Reuse {
            kv_blocks,
            usable_blocks,
        }
    }

    /// Pins what a request reuses: its first `blocks` KV blocks and the state at that length
    /// (when the model has one). Undo with [`unpin`](Self::unpin) with the same arguments.
    pub fn pin(&mut self, hashes: &[u64], blocks: usize) -> Result<(), HybridError> {
        let blocks = blocks.min(hashes.len());
        let cached = self.kv.longest_prefix(&hashes[..blocks]);
        if cached < blocks {
            let key = BlockKey::in_prompt(hashes, cached);
            return Err(CacheError::State {
                hash: key.hash,
                parent: key.parent,
                state: "not cached",
            }
            .into());
        }
        let state = (self.state_blocks != 0 && blocks != 0).then(|| self.state_key(hashes, blocks));
        if let Some(key) = state
            && !self.states.contains(key)
        {
            return Err(CacheError::State {
                hash: key.hash,
                parent: key.parent,
                state: "a state that is not cached",
            }
            .into());
        }
        self.kv.pin(&hashes[..blocks]);
        if let Some(key) = state {
            self.states.pin_key(key);
        }
        Ok(())
    }

    /// Releases what [`pin`](Self::pin) pinned.
    pub fn unpin(&mut self, hashes: &[u64], blocks: usize) -> Result<(), HybridError> {
        let blocks = blocks.min(hashes.len());
        self.tick();
        if self.state_blocks != 0 && blocks != 0 {
            // The state first: refused, it leaves the KV blocks pinned as they were.
            self.states.unpin_key(self.state_key(hashes, blocks))?;
        }
        self.kv.unpin(hashes, blocks)?;
        Ok(())
    }

    /// Allocates the blocks of a transfer (the tail KV of a prefill bound for another
    /// instance): not evictable, not shareable, until [`finish_transfer`](Self::finish_transfer).
    pub fn begin_transfer(&mut self, blocks: usize) -> Result<(TransferId, Vec<u32>), HybridError> {
        let got = self.alloc(blocks)?;
        let id = TransferId(self.next_transfer);
        self.next_transfer += 1;
        self.transfer_used += got.len();
        self.transfers.insert(id, got.clone());
        Ok((id, got))
    }

    /// The transfer completed (or failed): its blocks are discarded, free again.
    pub fn finish_transfer(&mut self, id: TransferId) -> Result<(), HybridError> {
        let blocks = self
            .transfers
            .remove(&id)
            .ok_or(HybridError::UnknownTransfer(id))?;
        self.transfer_used -= blocks.len();
        self.pool.release(&blocks)?;
        Ok(())
    }

    /// Caches block `i` of `hashes` (fully populated now) for prefix reuse and returns the
    /// block it was given (to write the KV into). Already cached: its block, made recent.
    pub fn commit_block(&mut self, hashes: &[u64], i: usize) -> Result<u32, HybridError> {
        let key = BlockKey::in_prompt(hashes, i);
        self.tick();
        if let Some(&block) = self.kv.get(key) {
            self.kv.touch(key);
            return Ok(block);
        }
        let block = self.alloc(1)?[0];
        // The allocation made room, so the insert evicts nothing.
        self.kv.insert(key, block, &mut |_, _| {})?;
        Ok(block)
    }

    /// Caches the request-level state after the first `blocks` blocks of `hashes` and returns
    /// its blocks. Already cached: those blocks, made recent.
    pub fn commit_state(&mut self, hashes: &[u64], blocks: usize) -> Result<Vec<u32>, HybridError> {
        if self.state_blocks == 0 || blocks == 0 || blocks > hashes.len() {
            return Err(
                StoreError::Layout("a state follows 1..=len blocks of a model with state").into(),
            );
        }
        let key = self.state_key(hashes, blocks);
        self.tick();
        if let Some(blocks) = self.states.get(key).cloned() {
            self.states.touch(key);
            return Ok(blocks);
        }
        let got = self.alloc(self.state_blocks)?;
        self.states.insert(key, got.clone(), &mut |_, _| {})?;
        Ok(got)
    }

    /// `n` free blocks, evicting the coldest unpinned entries (KV block or whole state) until
    /// they exist; nothing is evicted when even that could not make room.
    fn alloc(&mut self, n: usize) -> Result<Vec<u32>, HybridError> {
        let free = self.pool.free_pages();
        let evictable = (self.kv.len() - self.kv.pinned())
            + (self.state_block_count() - self.pinned_state_blocks());
        if free + evictable < n {
            return Err(HybridError::Exhausted {
                wanted: n,
                free,
                evictable,
            });
        }
        while self.pool.free_pages() < n {
            let take_kv = match (self.kv.coldest(), self.states.coldest()) {
                (Some(k), Some(s)) => k <= s,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => break,
            };
            if take_kv {
                if let Some((_, block)) = self.kv.evict_one() {
                    self.pool.release(&[block])?;
                }
            } else if let Some((_, blocks)) = self.states.evict_one() {
                self.pool.release(&blocks)?;
            }
        }
        Ok(self.pool.alloc(n)?)
    }

    /// Blocks of cached states (each state holds `state_blocks`).
    fn state_block_count(&self) -> usize {
        self.states.len() * self.state_blocks
    }

    fn pinned_state_blocks(&self) -> usize {
        self.states.pinned() * self.state_blocks
    }

    /// Moves both caches' clocks past either's, so that what becomes recent next is stamped
    /// later than anything in either: their coldest entries then compare.
    fn tick(&mut self) {
        let now = self.kv.clock().max(self.states.clock()) + 1;
        self.kv.set_clock(now);
        self.states.set_clock(now);
    }

    fn state_key(&self, hashes: &[u64], blocks: usize) -> BlockKey {
        BlockKey {
            parent: Some(blocks as u64 * self.block_tokens),
            hash: hashes[blocks - 1],
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn state_reuse_needs_the_exact_length() -> Result<(), HybridError> {
        let mut p = HybridPool::new(16, 64, 512, 2, Eviction::Lru)?;
        let prompt = [1, 2, 3];
        for i in 0..3 {
            p.commit_block(&prompt, i)?;
        }
        p.commit_state(&prompt, 2)?;
        assert_eq!(
            p.lookup(&prompt),
            Reuse {
                kv_blocks: 3,
                usable_blocks: 2
            }
        );
        assert_eq!(
            p.lookup(&[1, 2, 9]),
            Reuse {
                kv_blocks: 2,
                usable_blocks: 2
            }
        );
        assert_eq!(
            p.lookup(&[1, 9]),
            Reuse {
                kv_blocks: 1,
                usable_blocks: 0
            }
        );
        let u = p.usage();
        assert_eq!((u.kv, u.state, u.free), (3, 2, 11));
        Ok(())
    }

    #[test]
    fn transfers_are_not_evicted_and_are_discarded_when_done() -> Result<(), HybridError> {
        let mut p = HybridPool::new(4, 64, 512, 0, Eviction::Lru)?;
        let (id, blocks) = p.begin_transfer(3)?;
        assert_eq!(blocks.len(), 3);
        p.commit_block(&[7], 0)?;
        // The cached block is evictable, the transfer's are not.
        assert!(p.begin_transfer(1).is_ok(), "evicts the cached block");
        assert_eq!(p.lookup(&[7]).kv_blocks, 0);
        assert!(matches!(
            p.begin_transfer(1),
            Err(HybridError::Exhausted {
                wanted: 1,
                free: 0,
                evictable: 0
            })
        ));
        p.finish_transfer(id)?;
        assert_eq!(p.finish_transfer(id), Err(HybridError::UnknownTransfer(id)));
        assert_eq!(p.usage().free, 3);
        Ok(())
    }

    #[derive(Debug, Clone)]
    enum Op {
        Block(Vec<u64>),
        State(Vec<u64>, usize),
        Pin(Vec<u64>),
        Unpin,
        Begin(usize),
        Finish,
    }

    fn op() -> impl Strategy<Value = Op> {
        let prompt = proptest::collection::vec(0u64..5, 1..5);
        prop_oneof![
            4 => prompt.clone().prop_map(Op::Block),
            2 => (prompt.clone(), 1usize..5).prop_map(|(p, n)| Op::State(p, n)),
            2 => prompt.prop_map(Op::Pin),
            2 => Just(Op::Unpin),
            2 => (1usize..6).prop_map(Op::Begin),
            2 => Just(Op::Finish),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Random request mixes: the budget always adds up, no block is handed to two users,
        /// a transfer's blocks and everything pinned survive every eviction, and a refused
        /// allocation takes nothing.
        #[test]
        fn the_budget_holds_under_random_mixes(
            blocks in 1u32..24,
            state_blocks in 0u32..3,
            ops in proptest::collection::vec(op(), 1..120),
        ) {
            let mut p = HybridPool::new(blocks, 1, 512, state_blocks, Eviction::Lru)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut pins: Vec<(Vec<u64>, usize)> = Vec::new();
            let mut transfers: Vec<(TransferId, Vec<u32>)> = Vec::new();
            for op in ops {
                let before = p.usage();
                match op {
                    Op::Block(h) => {
                        for i in 0..h.len() {
                            if p.commit_block(&h, i).is_err() {
                                break;
                            }
                        }
                    }
                    Op::State(h, n) => {
                        let r = p.commit_state(&h, n.min(h.len()));
                        if let Err(HybridError::Exhausted { .. }) = r {
                            prop_assert_eq!(p.usage(), before, "a refused allocation changed the pool");
                        }
                    }
                    Op::Pin(h) => {
                        let n = p.lookup(&h).usable_blocks;
                        if n > 0 {
                            prop_assert!(p.pin(&h, n).is_ok());
                            pins.push((h, n));
                        }
                    }
                    Op::Unpin => {
                        if let Some((h, n)) = pins.pop() {
                            prop_assert!(p.unpin(&h, n).is_ok());
                        }
                    }
                    Op::Begin(n) => match p.begin_transfer(n) {
                        Ok(t) => transfers.push(t),
                        Err(HybridError::Exhausted { .. }) => {
                            prop_assert_eq!(p.usage(), before, "a refused transfer changed the pool");
                        }
                        Err(e) => prop_assert!(false, "{}", e),
                    },
                    Op::Finish => {
                        if let Some((id, _)) = transfers.pop() {
                            prop_assert!(p.finish_transfer(id).is_ok());
                        }
                    }
                }
                let u = p.usage();
                prop_assert_eq!(u.free + u.kv + u.state + u.transfer, u.total);
                prop_assert_eq!(u.free, p.blocks().free_pages());
                // Pinned prefixes are still whole, with their state.
                for (h, n) in &pins {
                    prop_assert!(p.lookup(h).usable_blocks >= *n, "a pinned prefix lost blocks");
                }
                // No block has two users.
                let mut seen = HashSet::new();
                for (_, b) in &transfers {
                    for x in b {
                        prop_assert!(seen.insert(*x), "block {} given twice", x);
                    }
                }
                prop_assert_eq!(seen.len(), u.transfer);
                for (_, &b) in p.kv.iter() {
                    prop_assert!(seen.insert(b), "block {} given twice", b);
                }
                for (_, b) in p.states.iter() {
                    for x in b {
                        prop_assert!(seen.insert(*x), "block {} given twice", x);
                    }
                }
                prop_assert_eq!(seen.len(), u.total - u.free);
            }
        }
    }
}
