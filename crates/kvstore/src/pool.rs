//! The paged pool: fixed-size blocks handed out by index (what paged writes target and what a
//! block table names). Only the indices live here; the memory is whatever the owner registered
//! (a [`kvroute_transport::RegisteredBuffer`] of `pages * page_bytes`).

use std::collections::BTreeSet;
use std::sync::Mutex;

use crate::error::StoreError;

/// A thread-safe allocator of page indices `0..pages`. Lowest indices first, so a fresh pool
/// hands out contiguous runs; a double free or a foreign index is refused, never absorbed.
#[derive(Debug)]
pub struct PagedPool {
    pages: u32,
    page_bytes: usize,
    free: Mutex<BTreeSet<u32>>,
}

impl PagedPool {
    /// A pool of `pages` pages of `page_bytes` bytes each, all free.
    pub fn new(pages: u32, page_bytes: usize) -> Result<Self, StoreError> {
        if pages == 0 || page_bytes == 0 {
            return Err(StoreError::Layout("a pool needs pages of positive size"));
        }
        if (pages as usize).checked_mul(page_bytes).is_none() {
            return Err(StoreError::Layout("pool too large to address"));
        }
        Ok(Self {
            pages,
            page_bytes,
            free: Mutex::new((0..pages).collect()),
        })
    }

    /// Pages in the pool.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Bytes the pool's memory must have.
    pub fn bytes(&self) -> usize {
        self.pages as usize * self.page_bytes
    }

    /// Byte offset of page `page` in the pool's memory.
    pub fn offset(&self, page: u32) -> Result<usize, StoreError> {
        if page >= self.pages {
            return Err(StoreError::OutOfRange {
                what: "pool page",
                index: u64::from(page),
                bound: u64::from(self.pages),
            });
        }
        Ok(page as usize * self.page_bytes)
    }

    /// Free pages now.
    pub fn free_pages(&self) -> usize {
        self.lock().len()
    }

    /// `n` pages, or [`StoreError::PoolExhausted`] (nothing taken) when fewer are free.
    pub fn alloc(&self, n: usize) -> Result<Vec<u32>, StoreError> {
        let mut free = self.lock();
        if n > free.len() {
            return Err(StoreError::PoolExhausted {
                wanted: n,
                free: free.len(),
            });
        }
        Ok((0..n).filter_map(|_| free.pop_first()).collect())
    }

    /// Returns `pages` to the pool: all of them, or (on a page not allocated, or listed
    /// twice) none of them.
    pub fn release(&self, pages: &[u32]) -> Result<(), StoreError> {
        let mut free = self.lock();
        let mut seen = BTreeSet::new();
        for &p in pages {
            if p >= self.pages || free.contains(&p) || !seen.insert(p) {
                return Err(StoreError::NotAllocated(p));
            }
        }
        free.extend(seen);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<u32>> {
        // A panic while holding the lock cannot leave the set half-updated (each method
        // checks before it mutates), so a poisoned lock is still consistent.
        self.free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hands_out_and_takes_back() -> Result<(), StoreError> {
        let pool = PagedPool::new(8, 100)?;
        let a = pool.alloc(3)?;
        assert_eq!(a, [0, 1, 2]);
        assert_eq!(pool.offset(2)?, 200);
        assert!(pool.offset(8).is_err());
        assert_eq!(
            pool.alloc(6),
            Err(StoreError::PoolExhausted { wanted: 6, free: 5 })
        );
        assert_eq!(pool.free_pages(), 5, "a refused alloc takes nothing");
        assert_eq!(pool.release(&[1, 1]), Err(StoreError::NotAllocated(1)));
        assert_eq!(pool.release(&[7]), Err(StoreError::NotAllocated(7)));
        assert_eq!(pool.release(&[9]), Err(StoreError::NotAllocated(9)));
        assert_eq!(pool.free_pages(), 5, "a refused release frees nothing");
        pool.release(&a)?;
        assert_eq!(pool.free_pages(), 8);
        Ok(())
    }

    proptest! {
        /// Any sequence of allocs and releases: no page is ever handed out twice, and the free
        /// count is always pages minus what is held.
        #[test]
        fn never_double_allocates(ops in proptest::collection::vec((any::<bool>(), 1usize..6), 1..60)) {
            let pool = PagedPool::new(16, 1).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut held: Vec<Vec<u32>> = Vec::new();
            for (take, n) in ops {
                if take {
                    if let Ok(pages) = pool.alloc(n) {
                        held.push(pages);
                    }
                } else if let Some(pages) = held.pop() {
                    prop_assert!(pool.release(&pages).is_ok());
                    prop_assert!(pool.release(&pages).is_err());
                }
                let mut all: Vec<u32> = held.iter().flatten().copied().collect();
                let count = all.len();
                all.sort_unstable();
                all.dedup();
                prop_assert_eq!(all.len(), count);
                prop_assert_eq!(pool.free_pages(), 16 - count);
            }
        }
    }
}
