//! Fetched chunks kept across layers and steps: each spliced once to the positions one request
//! placed it at, within a byte budget, evicted least recently used, and dropped when the
//! registry's description of the chunk (its layout or stored positions) is no longer the one
//! it was fetched under.

use kvroute_kvstore::{BlockLayout, ChunkId};

use crate::requester::{Fetched, Requester};

/// A fetched chunk and what it was fetched under.
#[derive(Debug)]
struct Entry {
    chunk: ChunkId,
    /// The position its first token was spliced to.
    start: i64,
    fetched: Fetched,
    bytes: usize,
    last_used: u64,
    /// The registry's description of the chunk when it was fetched.
    layout: BlockLayout,
    positions: Vec<i64>,
}

/// The fetch cache ([`crate::step::Stepper`]'s).
#[derive(Debug)]
pub(crate) struct FetchCache {
    budget: usize,
    used: usize,
    clock: u64,
    entries: Vec<Entry>,
    /// Fetches kept, evictions and drops, for the stats.
    pub(crate) inserted: u64,
    pub(crate) evicted: u64,
    pub(crate) dropped: u64,
}

impl FetchCache {
    /// An empty cache of `budget` bytes.
    pub(crate) fn new(budget: usize) -> Self {
        Self {
            budget,
            used: 0,
            clock: 0,
            entries: Vec::new(),
            inserted: 0,
            evicted: 0,
            dropped: 0,
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.used
    }

    /// Marks the entry for `chunk` spliced to `start` used now; whether there is one.
    pub(crate) fn touch(&mut self, chunk: ChunkId, start: i64) -> bool {
        self.clock += 1;
        let clock = self.clock;
        match self
            .entries
            .iter_mut()
            .find(|e| e.chunk == chunk && e.start == start)
        {
            Some(e) => {
                e.last_used = clock;
                true
            }
            None => false,
        }
    }

    /// Whether `chunk` spliced to `start` is held (not counted, not marked used).
    pub(crate) fn contains(&self, chunk: ChunkId, start: i64) -> bool {
        self.entries
            .iter()
            .any(|e| e.chunk == chunk && e.start == start)
    }

    /// The fetched chunk held for `(chunk, start)`, without marking it.
    pub(crate) fn peek(&self, chunk: ChunkId, start: i64) -> Option<&Fetched> {
        self.entries
            .iter()
            .find(|e| e.chunk == chunk && e.start == start)
            .map(|e| &e.fetched)
    }

    /// Keeps `fetched` (spliced to `start`, under `layout` and `positions`), evicting the
    /// least recently used entries not in `pinned` until it fits. Where it cannot fit (the
    /// budget, or everything else pinned) it is handed back, for the caller to use once and
    /// release.
    pub(crate) fn insert(
        &mut self,
        req: &mut Requester,
        (chunk, start): (ChunkId, i64),
        fetched: Fetched,
        (layout, positions): (BlockLayout, Vec<i64>),
        pinned: &[(ChunkId, i64)],
    ) -> Option<Fetched> {
        let bytes = layout.full_bytes();
        if bytes > self.budget {
            return Some(fetched);
        }
        while self.used + bytes > self.budget {
            let Some(i) = self.least_recent(pinned) else {
                return Some(fetched);
            };
            self.remove(req, i);
            self.evicted += 1;
        }
        self.clock += 1;
        self.used += bytes;
        self.inserted += 1;
        self.entries.push(Entry {
            chunk,
            start,
            fetched,
            bytes,
            last_used: self.clock,
            layout,
            positions,
        });
        None
    }

    /// Evicts least recently used entries not in `pinned` until the requester's pool has
    /// `pages` free pages; whether it has.
    pub(crate) fn make_room(
        &mut self,
        req: &mut Requester,
        pages: usize,
        pinned: &[(ChunkId, i64)],
    ) -> bool {
        while req.free_pool_pages() < pages {
            let Some(i) = self.least_recent(pinned) else {
                return false;
            };
            self.remove(req, i);
            self.evicted += 1;
        }
        true
    }

    /// Drops every entry whose chunk the registry now describes otherwise (another layout or
    /// stored positions): the holders' copy changed since it was fetched. A chunk no longer
    /// registered anywhere keeps its entry: it is the same data, and the only copy left.
    pub(crate) fn drop_changed(&mut self, req: &mut Requester) {
        let mut i = 0;
        while i < self.entries.len() {
            let e = &self.entries[i];
            let changed = req
                .entry(e.chunk)
                .ok()
                .is_some_and(|now| now.layout != e.layout || now.positions != e.positions);
            if changed {
                self.remove(req, i);
                self.dropped += 1;
            } else {
                i += 1;
            }
        }
    }

    /// Releases every entry's pages.
    pub(crate) fn clear(&mut self, req: &mut Requester) {
        while !self.entries.is_empty() {
            self.remove(req, self.entries.len() - 1);
        }
    }

    /// The least recently used entry not in `pinned`.
    fn least_recent(&self, pinned: &[(ChunkId, i64)]) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| !pinned.contains(&(e.chunk, e.start)))
            .min_by_key(|(_, e)| e.last_used)
            .map(|(i, _)| i)
    }

    fn remove(&mut self, req: &mut Requester, i: usize) {
        let e = self.entries.swap_remove(i);
        self.used -= e.bytes;
        if let Err(err) = req.release(e.fetched) {
            tracing::warn!(chunk = e.chunk.0, %err, "releasing a cached chunk's pages");
        }
    }
}
