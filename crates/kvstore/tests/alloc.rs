//! The prefix cache's hot path allocates nothing: with a capacity, lookups, touches, inserts,
//! evictions, pins and unpins over a whole real trace make no heap allocation at all (counted
//! by a global allocator that wraps the system's). One test in this binary, so nothing else
//! allocates while it counts.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvroute_kvstore::{Eviction, PrefixCache, TraceReader};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn a_bounded_cache_allocates_nothing_per_block() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/mooncake/conversation_trace.jsonl");
    let prompts: Vec<Vec<u64>> = TraceReader::new(BufReader::new(File::open(path).unwrap()), 512)
        .map(|r| r.unwrap().hash_ids)
        .collect();
    for policy in [Eviction::Lru, Eviction::TailFirst] {
        let mut cache: PrefixCache<u32> = PrefixCache::new(4_096, policy);
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        let (mut hits, mut evicted, mut located) = (0, 0, 0);
        for prompt in &prompts {
            let access = cache
                .access(prompt, |i| i as u32, &mut |_, _| evicted += 1)
                .unwrap();
            hits += access.hit_blocks;
            located += cache.prefix_values(prompt).count();
            let pinned = cache.pin(prompt);
            cache.unpin(prompt, pinned).unwrap();
        }
        let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
        assert!(hits > 0 && evicted > 0 && located > 0);
        assert_eq!(
            allocations,
            0,
            "{policy:?}: {allocations} allocations over {} prompts",
            prompts.len()
        );
    }
}
