//! The prefix cache: which leading blocks of a request are already cached, where each one is,
//! and which block goes when room is needed.
//!
//! A request's prompt is cut into fixed-size token blocks, and block `i` is named by a hash
//! *chained* over blocks `0..=i` (vLLM's and Mooncake's block hashes; the `hash_ids` of the
//! Mooncake traces). The cache is a trie over those names: a node is one block, its edge is
//! `(parent block's hash, block hash)` (`None` as the parent for a prompt's first block), and
//! every edge is found by one lookup in a single hash table, so walking a prompt costs one
//! probe per block and no pointer chasing. Keying by the parent's *hash*, not by a parent
//! node, keeps a block findable when its parent was evicted and later comes back: exactly
//! the "is block `i` of this prompt cached" question a chained-hash cache answers.
//!
//! Blocks carry a value `V` (where the block is: a pool page, a disk file, a peer) and a
//! reference count. A block with references is *pinned*: it is out of the eviction order and
//! never chosen, so a block a request is reading cannot disappear under it. Unpinned blocks sit
//! in one intrusive recency list (indices into the node array, no allocation), and eviction
//! takes its cold end.
//!
//! Eviction policies ([`Eviction`]):
//! - [`Eviction::Lru`]: a request's blocks are touched in prompt order, so within one request
//!   the first block is the least recent. These are the semantics trace studies use
//!   (Mooncake's simulator; `kvroute trace replay` follows them so its hit ratios compare).
//! - [`Eviction::TailFirst`]: after a request's blocks are touched in order they are touched
//!   again deepest-first, so within a request the *last* block is the least recent: the cache
//!   evicts the tail of a prompt before its head. This is vLLM's order (a finished request's
//!   blocks are freed in reverse). Under plain LRU a shared head block is evicted before the
//!   blocks that hang off it, and every one of those becomes unreachable (a prefix hit stops at
//!   the first missing block) while still taking room; tail-first keeps prefixes whole. The
//!   replay of the Mooncake trace measures what that is worth (docs/kvstore.md).
//!
//! Costs: lookups and touches allocate nothing; an insert allocates only when the node array
//! or the table grows (never with a capacity, which reserves both up front).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use serde::Serialize;
use thiserror::Error;

/// No node (end of the recency list, or not linked).
const NIL: u32 = u32::MAX;

/// A block's name in the trie: its parent block's hash (`None` for a prompt's first block)
/// and its own hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockKey {
    /// The hash of the block before it in the prompt, or `None` for the first block.
    pub parent: Option<u64>,
    /// The block's (chained) hash.
    pub hash: u64,
}

impl BlockKey {
    /// The key of block `i` of a prompt whose block hashes are `hashes`.
    ///
    /// # Panics
    /// If `i >= hashes.len()`.
    pub fn in_prompt(hashes: &[u64], i: usize) -> Self {
        Self {
            parent: if i == 0 { None } else { Some(hashes[i - 1]) },
            hash: hashes[i],
        }
    }
}

/// Which block is evicted when room is needed (see the module docs for why each exists).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Eviction {
    /// Least recently used, a request's blocks touched in prompt order.
    #[default]
    Lru,
    /// Least recently used, a request's blocks made recent deepest-first (vLLM's order).
    TailFirst,
}

impl std::str::FromStr for Eviction {
    type Err = CacheError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "lru" => Ok(Self::Lru),
            "tail-first" => Ok(Self::TailFirst),
            _ => Err(CacheError::UnknownPolicy(s.to_owned())),
        }
    }
}

/// What the prefix cache refuses.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CacheError {
    /// Every cached block is pinned and the cache is at capacity.
    #[error("prefix cache full: all {0} blocks are pinned")]
    Full(usize),
    /// The block is already cached (insert) or not cached (remove, unpin).
    #[error("block {hash:#x} (parent {parent:?}) is {state}")]
    State {
        /// The block's hash.
        hash: u64,
        /// Its parent's hash.
        parent: Option<u64>,
        /// What it is, that the operation did not expect.
        state: &'static str,
    },
    /// A pinned block cannot be removed.
    #[error("block {0:#x} is pinned")]
    Pinned(u64),
    /// An eviction policy name that is not one of `lru`, `tail-first`.
    #[error("unknown eviction policy `{0}` (lru, tail-first)")]
    UnknownPolicy(String),
}

#[derive(Debug, Clone)]
struct Node<V> {
    key: BlockKey,
    value: Option<V>,
    refs: u32,
    prev: u32,
    next: u32,
    /// The clock when it last became most recent.
    tick: u64,
}

/// What [`PrefixCache::access`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    /// Blocks of the request's longest cached prefix at its arrival.
    pub hit_blocks: usize,
    /// Blocks inserted (the request's blocks that were not cached).
    pub inserted: usize,
    /// Blocks evicted to make room.
    pub evicted: usize,
}

/// The prefix cache. `V` is what the cache knows of each block (its location); the cache
/// itself holds no KV.
#[derive(Debug)]
pub struct PrefixCache<V> {
    nodes: Vec<Node<V>>,
    free: Vec<u32>,
    index: HashMap<BlockKey, u32, KeyHasher>,
    /// Cold end of the recency list (next to evict).
    head: u32,
    /// Hot end.
    tail: u32,
    capacity: usize,
    policy: Eviction,
    len: usize,
    pinned: usize,
    /// Stamped on a block when it becomes most recent; advanced by every such change unless
    /// an owner sets it ([`PrefixCache::set_clock`]).
    clock: u64,
}

impl<V> PrefixCache<V> {
    /// A cache of at most `capacity` blocks (0: unbounded) evicting by `policy`. A bounded
    /// cache reserves its node array and table now, so it never allocates again.
    pub fn new(capacity: usize, policy: Eviction) -> Self {
        Self {
            nodes: Vec::with_capacity(capacity),
            free: Vec::with_capacity(capacity),
            // Twice the capacity: a table with deleted slots piling up rehashes in place (no
            // allocation) while it is at most half full, and grows (allocates) otherwise.
            index: HashMap::with_capacity_and_hasher(capacity.saturating_mul(2), KeyHasher::new()),
            head: NIL,
            tail: NIL,
            capacity,
            policy,
            len: 0,
            pinned: 0,
            clock: 0,
        }
    }

    /// Sets the recency clock: blocks made recent from now on are stamped `now` (an owner
    /// that evicts across several caches keeps their stamps comparable this way). The clock
    /// still advances by one with every stamp.
    pub fn set_clock(&mut self, now: u64) {
        self.clock = self.clock.max(now);
    }

    /// The clock now.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// The stamp of the block [`evict_one`](Self::evict_one) would take, if any.
    pub fn coldest(&self) -> Option<u64> {
        (self.head != NIL).then(|| self.nodes[self.head as usize].tick)
    }

    /// Blocks cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no block is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The capacity in blocks (0: unbounded).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The eviction policy.
    pub fn policy(&self) -> Eviction {
        self.policy
    }

    /// Blocks pinned now.
    pub fn pinned(&self) -> usize {
        self.pinned
    }

    /// Length in blocks of the longest prefix of `hashes` that is cached. Changes nothing.
    pub fn longest_prefix(&self, hashes: &[u64]) -> usize {
        (0..hashes.len())
            .take_while(|&i| self.index.contains_key(&BlockKey::in_prompt(hashes, i)))
            .count()
    }

    /// The values (locations) of the longest cached prefix of `hashes`, in prompt order: which
    /// blocks to fetch, and from where. Changes nothing, allocates nothing.
    pub fn prefix_values<'a>(&'a self, hashes: &'a [u64]) -> impl Iterator<Item = &'a V> + 'a {
        (0..hashes.len())
            .map_while(move |i| self.index.get(&BlockKey::in_prompt(hashes, i)))
            .filter_map(move |&n| self.nodes[n as usize].value.as_ref())
    }

    /// Every cached block and its value, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (BlockKey, &V)> + '_ {
        self.nodes
            .iter()
            .filter_map(|n| n.value.as_ref().map(|v| (n.key, v)))
    }

    /// The value of one block, if cached.
    pub fn get(&self, key: BlockKey) -> Option<&V> {
        self.index
            .get(&key)
            .and_then(|&n| self.nodes[n as usize].value.as_ref())
    }

    /// Whether a block is cached.
    pub fn contains(&self, key: BlockKey) -> bool {
        self.index.contains_key(&key)
    }

    /// Makes a cached block the most recent. False when it is not cached.
    pub fn touch(&mut self, key: BlockKey) -> bool {
        match self.index.get(&key) {
            Some(&n) => {
                if self.nodes[n as usize].refs == 0 {
                    self.unlink(n);
                    self.push_hot(n);
                }
                true
            }
            None => false,
        }
    }

    /// Caches a block as the most recent, evicting the coldest unpinned block first when the
    /// cache is full; the evicted block and its value go to `evicted`.
    pub fn insert(
        &mut self,
        key: BlockKey,
        value: V,
        evicted: &mut impl FnMut(BlockKey, V),
    ) -> Result<(), CacheError> {
        if self.index.contains_key(&key) {
            return Err(CacheError::State {
                hash: key.hash,
                parent: key.parent,
                state: "already cached",
            });
        }
        if self.capacity != 0 && self.len >= self.capacity {
            let (k, v) = self.evict_one().ok_or(CacheError::Full(self.len))?;
            evicted(k, v);
        }
        let node = Node {
            key,
            value: Some(value),
            refs: 0,
            prev: NIL,
            next: NIL,
            tick: 0,
        };
        let n = match self.free.pop() {
            Some(n) => {
                self.nodes[n as usize] = node;
                n
            }
            None => {
                let n = u32::try_from(self.nodes.len())
                    .ok()
                    .filter(|&n| n != NIL)
                    .ok_or(CacheError::Full(self.len))?;
                self.nodes.push(node);
                n
            }
        };
        self.index.insert(key, n);
        self.push_hot(n);
        self.len += 1;
        Ok(())
    }

    /// Removes the coldest unpinned block and returns it, or `None` when every block is
    /// pinned (or none is cached). What a pool that shares its memory with other users calls
    /// to make room.
    pub fn evict_one(&mut self) -> Option<(BlockKey, V)> {
        let n = self.head;
        if n == NIL {
            return None;
        }
        self.unlink(n);
        Some(self.drop_node(n))
    }

    /// Removes an unpinned block and returns its value.
    pub fn remove(&mut self, key: BlockKey) -> Result<V, CacheError> {
        let &n = self.index.get(&key).ok_or(CacheError::State {
            hash: key.hash,
            parent: key.parent,
            state: "not cached",
        })?;
        if self.nodes[n as usize].refs != 0 {
            return Err(CacheError::Pinned(key.hash));
        }
        self.unlink(n);
        Ok(self.drop_node(n).1)
    }

    /// Pins the longest cached prefix of `hashes` (each block's reference count goes up by
    /// one; a pinned block is never evicted) and returns its length in blocks. Release with
    /// [`unpin`](Self::unpin) on the same prefix.
    pub fn pin(&mut self, hashes: &[u64]) -> usize {
        (0..hashes.len())
            .take_while(|&i| self.pin_key(BlockKey::in_prompt(hashes, i)))
            .count()
    }

    /// Pins one block by its key (see [`pin`](Self::pin)). False when it is not cached.
    pub fn pin_key(&mut self, key: BlockKey) -> bool {
        let Some(&n) = self.index.get(&key) else {
            return false;
        };
        if self.nodes[n as usize].refs == 0 {
            self.unlink(n);
            self.pinned += 1;
        }
        self.nodes[n as usize].refs += 1;
        true
    }

    /// Drops one reference from one block (see [`unpin`](Self::unpin)).
    pub fn unpin_key(&mut self, key: BlockKey) -> Result<(), CacheError> {
        let n = match self.index.get(&key) {
            Some(&n) if self.nodes[n as usize].refs > 0 => n,
            _ => {
                return Err(CacheError::State {
                    hash: key.hash,
                    parent: key.parent,
                    state: "not pinned",
                });
            }
        };
        let node = &mut self.nodes[n as usize];
        node.refs -= 1;
        if node.refs == 0 {
            self.pinned -= 1;
            self.push_hot(n);
        }
        Ok(())
    }

    /// Drops one reference from each of the first `blocks` blocks of `hashes`; a block whose
    /// count reaches zero becomes the most recent. All or nothing: a block in the range that
    /// is not cached or not pinned refuses the whole call.
    pub fn unpin(&mut self, hashes: &[u64], blocks: usize) -> Result<(), CacheError> {
        let blocks = blocks.min(hashes.len());
        for i in 0..blocks {
            let key = BlockKey::in_prompt(hashes, i);
            match self.index.get(&key) {
                Some(&n) if self.nodes[n as usize].refs > 0 => {}
                _ => {
                    return Err(CacheError::State {
                        hash: key.hash,
                        parent: key.parent,
                        state: "not pinned",
                    });
                }
            }
        }
        (0..blocks).try_for_each(|i| self.unpin_key(BlockKey::in_prompt(hashes, i)))
    }

    /// One request as trace studies replay it: the hit is the longest cached prefix of
    /// `hashes` at arrival; then every block is touched in order, a cached one made most
    /// recent, a missing one inserted with `value(i)` (evicting the coldest when full, each
    /// eviction reported to `evicted`). Under [`Eviction::TailFirst`] the blocks are then made
    /// recent again deepest-first.
    pub fn access(
        &mut self,
        hashes: &[u64],
        mut value: impl FnMut(usize) -> V,
        evicted: &mut impl FnMut(BlockKey, V),
    ) -> Result<Access, CacheError> {
        let mut out = Access {
            hit_blocks: self.longest_prefix(hashes),
            ..Access::default()
        };
        let mut count = |k: BlockKey, v: V| {
            out.evicted += 1;
            evicted(k, v);
        };
        let mut inserted = 0;
        for i in 0..hashes.len() {
            let key = BlockKey::in_prompt(hashes, i);
            if !self.touch(key) {
                self.insert(key, value(i), &mut count)?;
                inserted += 1;
            }
        }
        if self.policy == Eviction::TailFirst {
            for i in (0..hashes.len()).rev() {
                self.touch(BlockKey::in_prompt(hashes, i));
            }
        }
        out.inserted = inserted;
        crate::observe::prefix_access(hashes.len(), out.hit_blocks, out.evicted);
        Ok(out)
    }

    fn drop_node(&mut self, n: u32) -> (BlockKey, V) {
        let node = &mut self.nodes[n as usize];
        let key = node.key;
        // Linked nodes always hold a value; `take` leaves the slot empty for reuse.
        let value = node.value.take();
        self.index.remove(&key);
        self.free.push(n);
        self.len -= 1;
        match value {
            Some(v) => (key, v),
            None => unreachable_value(),
        }
    }

    fn unlink(&mut self, n: u32) {
        let (prev, next) = {
            let node = &self.nodes[n as usize];
            (node.prev, node.next)
        };
        if prev == NIL {
            if self.head == n {
                self.head = next;
            }
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            if self.tail == n {
                self.tail = prev;
            }
        } else {
            self.nodes[next as usize].prev = prev;
        }
        let node = &mut self.nodes[n as usize];
        node.prev = NIL;
        node.next = NIL;
    }

    fn push_hot(&mut self, n: u32) {
        let old = self.tail;
        self.clock += 1;
        {
            let node = &mut self.nodes[n as usize];
            node.prev = old;
            node.next = NIL;
            node.tick = self.clock;
        }
        if old == NIL {
            self.head = n;
        } else {
            self.nodes[old as usize].next = n;
        }
        self.tail = n;
    }
}

/// A cached node without a value would be a bug in this module, not bad input; it is kept out
/// of the panicking lints' way and documented here.
#[cold]
fn unreachable_value() -> ! {
    unreachable!("a cached block always holds its value")
}

/// The table's hasher: a keyed multiply-fold (the keys are hashes already, so one 128-bit
/// multiply per word mixes enough), seeded per cache from the standard library's random state
/// so that a peer choosing block hashes cannot aim them at one bucket chain.
#[derive(Debug, Clone, Copy)]
struct KeyHasher {
    seed: u64,
}

impl KeyHasher {
    fn new() -> Self {
        Self {
            seed: std::collections::hash_map::RandomState::new()
                .hash_one(0x006b_7672_6f75_7465_u64)
                | 1,
        }
    }
}

impl BuildHasher for KeyHasher {
    type Hasher = FoldHasher;

    fn build_hasher(&self) -> FoldHasher {
        FoldHasher { state: self.seed }
    }
}

#[derive(Debug)]
struct FoldHasher {
    state: u64,
}

impl FoldHasher {
    #[inline]
    fn mix(&mut self, word: u64) {
        let product = u128::from(self.state ^ word) * 0x9e37_79b9_7f4a_7c15_u128;
        self.state = (product as u64) ^ ((product >> 64) as u64);
    }
}

impl Hasher for FoldHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.state
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u64(&mut self, word: u64) {
        self.mix(word);
    }

    #[inline]
    fn write_u8(&mut self, byte: u8) {
        self.mix(u64::from(byte));
    }

    #[inline]
    fn write_isize(&mut self, word: isize) {
        self.mix(word as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn noop(_: BlockKey, _: ()) {}

    #[test]
    fn longest_prefix_stops_at_the_first_missing_block() -> Result<(), CacheError> {
        let mut c = PrefixCache::new(0, Eviction::Lru);
        c.access(&[1, 2, 3], |_| (), &mut noop)?;
        assert_eq!(c.longest_prefix(&[1, 2, 3, 4]), 3);
        assert_eq!(c.longest_prefix(&[1, 2, 9, 3]), 2);
        // Block 2 under another parent is another block.
        assert_eq!(c.longest_prefix(&[7, 2]), 0);
        assert_eq!(c.longest_prefix(&[2]), 0);
        let a = c.access(&[1, 2, 5], |_| (), &mut noop)?;
        assert_eq!((a.hit_blocks, a.inserted, a.evicted), (2, 1, 0));
        assert_eq!(c.len(), 4);
        Ok(())
    }

    #[test]
    fn lru_evicts_the_head_first_and_tail_first_the_tail() -> Result<(), CacheError> {
        for (policy, survivor) in [
            (Eviction::Lru, [false, true, true]),
            (Eviction::TailFirst, [true, true, false]),
        ] {
            let mut c = PrefixCache::new(3, policy);
            c.access(&[1, 2, 3], |i| i, &mut |_, _| {})?;
            let mut gone = Vec::new();
            c.access(&[9], |_| 9, &mut |k, v| gone.push((k.hash, v)))?;
            let cached: Vec<bool> = (0..3)
                .map(|i| c.contains(BlockKey::in_prompt(&[1, 2, 3], i)))
                .collect();
            assert_eq!(cached, survivor, "{policy:?}");
            assert_eq!(gone.len(), 1);
        }
        Ok(())
    }

    #[test]
    fn pinned_blocks_are_never_evicted() -> Result<(), CacheError> {
        let mut c = PrefixCache::new(2, Eviction::Lru);
        c.access(&[1, 2], |_| (), &mut noop)?;
        assert_eq!(c.pin(&[1, 2, 3]), 2);
        assert_eq!(c.access(&[5], |_| (), &mut noop), Err(CacheError::Full(2)));
        assert_eq!(
            c.remove(BlockKey {
                parent: None,
                hash: 1
            }),
            Err(CacheError::Pinned(1))
        );
        assert!(c.unpin(&[1, 2], 3).is_ok());
        assert!(c.unpin(&[1], 1).is_err(), "a second unpin is refused");
        // Unpinned in order, so block 1 is the coldest again.
        let mut gone = Vec::new();
        c.access(&[5], |_| (), &mut |k, _| gone.push(k.hash))?;
        assert_eq!(gone, [1]);
        Ok(())
    }

    #[test]
    fn values_say_where_each_prefix_block_is() -> Result<(), CacheError> {
        let mut c = PrefixCache::new(0, Eviction::Lru);
        c.access(&[4, 5, 6], |i| 10 * i, &mut |_, _| {})?;
        let found: Vec<usize> = c.prefix_values(&[4, 5, 7]).copied().collect();
        assert_eq!(found, [0, 10]);
        assert_eq!(
            c.remove(BlockKey {
                parent: Some(4),
                hash: 5
            }),
            Ok(10)
        );
        assert_eq!(c.prefix_values(&[4, 5, 6]).count(), 1);
        Ok(())
    }

    /// The trie's semantics in the plainest form: a list of keys, most recent last, with pin
    /// counts.
    #[derive(Default)]
    struct Naive {
        order: Vec<(BlockKey, u32)>,
    }

    impl Naive {
        fn find(&self, key: BlockKey) -> Option<usize> {
            self.order.iter().position(|(k, _)| *k == key)
        }
        fn longest(&self, hashes: &[u64]) -> usize {
            (0..hashes.len())
                .take_while(|&i| self.find(BlockKey::in_prompt(hashes, i)).is_some())
                .count()
        }
        fn touch(&mut self, key: BlockKey) -> bool {
            match self.find(key) {
                Some(p) => {
                    if self.order[p].1 == 0 {
                        let e = self.order.remove(p);
                        self.order.push(e);
                    }
                    true
                }
                None => false,
            }
        }
        fn access(
            &mut self,
            hashes: &[u64],
            cap: usize,
            tail_first: bool,
        ) -> Result<(usize, Vec<u64>), ()> {
            let hit = self.longest(hashes);
            let mut gone = Vec::new();
            for i in 0..hashes.len() {
                let key = BlockKey::in_prompt(hashes, i);
                if !self.touch(key) {
                    if cap != 0 && self.order.len() >= cap {
                        // Coldest unpinned; pinned ones keep their place out of the order.
                        let p = self.order.iter().position(|(_, r)| *r == 0).ok_or(())?;
                        gone.push(self.order.remove(p).0.hash);
                    }
                    self.order.push((key, 0));
                }
            }
            if tail_first {
                for i in (0..hashes.len()).rev() {
                    self.touch(BlockKey::in_prompt(hashes, i));
                }
            }
            Ok((hit, gone))
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Access(Vec<u64>),
        Pin(Vec<u64>),
        Unpin,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Small alphabets so prompts share prefixes and blocks collide often.
        let prompt = proptest::collection::vec(0u64..6, 0..6);
        prop_oneof![
            4 => prompt.clone().prop_map(Op::Access),
            1 => prompt.prop_map(Op::Pin),
            1 => Just(Op::Unpin),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// The trie against the naive list on random operation sequences: same hits, same
        /// evictions in the same order, and a pinned block is never evicted. Pinned blocks
        /// re-enter the order as most recent when unpinned in both.
        #[test]
        fn matches_a_naive_reference(
            cap in 0usize..8,
            tail_first in any::<bool>(),
            ops in proptest::collection::vec(op(), 1..80),
        ) {
            let policy = if tail_first { Eviction::TailFirst } else { Eviction::Lru };
            let mut trie: PrefixCache<u64> = PrefixCache::new(cap, policy);
            let mut naive = Naive::default();
            let mut pins: Vec<(Vec<u64>, usize)> = Vec::new();
            for op in ops {
                match op {
                    Op::Access(h) => {
                        let mut gone = Vec::new();
                        let got = trie.access(&h, |i| h[i], &mut |k, v| { assert_eq!(k.hash, v); gone.push(k.hash) });
                        let want = naive.access(&h, cap, tail_first);
                        match (got, want) {
                            (Ok(a), Ok((hit, g))) => {
                                prop_assert_eq!(a.hit_blocks, hit);
                                prop_assert_eq!(&gone, &g);
                                prop_assert_eq!(a.evicted, g.len());
                            }
                            (Err(CacheError::Full(_)), Err(())) => {
                                // Both gave up at the same block: resynchronise from the trie.
                                naive.order.retain(|(k, _)| trie.contains(*k));
                            }
                            (a, b) => prop_assert!(false, "trie {:?} naive {:?}", a, b),
                        }
                        for (p, n) in &pins {
                            for i in 0..*n {
                                prop_assert!(trie.contains(BlockKey::in_prompt(p, i)), "a pinned block was evicted");
                            }
                        }
                    }
                    Op::Pin(h) => {
                        let n = trie.pin(&h);
                        prop_assert_eq!(n, naive.longest(&h));
                        for i in 0..n {
                            let p = naive.find(BlockKey::in_prompt(&h, i)).ok_or_else(|| TestCaseError::fail("pinned block missing"))?;
                            naive.order[p].1 += 1;
                        }
                        pins.push((h, n));
                    }
                    Op::Unpin => {
                        if let Some((h, n)) = pins.pop() {
                            prop_assert!(trie.unpin(&h, n).is_ok());
                            for i in 0..n {
                                let key = BlockKey::in_prompt(&h, i);
                                let p = naive.find(key).ok_or_else(|| TestCaseError::fail("pinned block missing"))?;
                                naive.order[p].1 -= 1;
                                if naive.order[p].1 == 0 {
                                    let e = naive.order.remove(p);
                                    naive.order.push(e);
                                }
                            }
                        }
                    }
                }
                prop_assert_eq!(trie.len(), naive.order.len());
                prop_assert_eq!(trie.pinned(), naive.order.iter().filter(|(_, r)| *r > 0).count());
                prop_assert!(cap == 0 || trie.len() <= cap);
            }
        }
    }
}
