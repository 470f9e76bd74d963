//! The prefix cache replaying Mooncake's conversation trace (`data/mooncake`): the published
//! figures of the trace (182,790 distinct blocks, a 36.6% block prefix hit ratio with an
//! unbounded cache) and, for bounded LRU caches, the counts an independent replay computed
//! (Python, an `OrderedDict` keyed by block id, the same arrival-order semantics).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;

use kvroute_kvstore::{Eviction, ReplayConfig, TraceReader, replay};

fn trace() -> TraceReader<BufReader<File>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/mooncake/conversation_trace.jsonl");
    TraceReader::new(BufReader::new(File::open(path).unwrap()), 512)
}

fn config(capacity_blocks: usize) -> ReplayConfig {
    ReplayConfig {
        block_tokens: 512,
        capacity_blocks,
        policy: Eviction::Lru,
        limit: 0,
    }
}

#[test]
fn an_unbounded_cache_reproduces_the_published_figures() {
    let r = replay(trace(), config(0), None).unwrap();
    assert_eq!(r.requests, 12_031);
    assert_eq!(r.distinct_blocks, 182_790);
    assert_eq!((r.hit_blocks, r.blocks), (105_710, 288_500));
    assert_eq!(format!("{:.3}", r.block_prefix_hit_ratio), "0.366");
    assert_eq!(r.evictions, 0);
}

#[test]
fn bounded_lru_caches_match_an_independent_replay() {
    for (capacity, hits, evictions) in [(1_000, 12_831, 274_669), (10_000, 60_921, 217_579)] {
        let r = replay(trace(), config(capacity), None).unwrap();
        assert_eq!(
            (r.hit_blocks, r.evictions),
            (hits, evictions),
            "capacity {capacity}"
        );
    }
}

/// With a storage tier under a small memory cache, every evicted block goes to disk and comes
/// back when a prefix needs it, so memory and disk together hit exactly what an unbounded
/// cache hits; each block is written once, and every read is checksum-checked.
#[test]
fn a_storage_tier_under_a_small_cache_hits_what_an_unbounded_cache_hits() {
    use kvroute_kvstore::{BlockLayout, BlockStore};
    let dir = std::env::temp_dir().join(format!("kvroute-trace-store-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Small stand-in blocks (one 64-token page) keep the test's disk traffic small.
    let layout = BlockLayout::new(1, 64).unwrap();
    let (mut store, _) = BlockStore::open(&dir, layout).unwrap();
    store.set_durable(false);
    let limit = 150;
    let unbounded = replay(trace(), ReplayConfig { limit, ..config(0) }, None).unwrap();
    let small = replay(
        trace(),
        ReplayConfig {
            limit,
            ..config(50)
        },
        None,
    )
    .unwrap();
    let tiered = replay(
        trace(),
        ReplayConfig {
            limit,
            ..config(50)
        },
        Some(&mut store),
    )
    .unwrap();
    assert!(small.hit_blocks < unbounded.hit_blocks);
    assert_eq!(tiered.hit_blocks, unbounded.hit_blocks);
    assert_eq!(
        tiered.hit_blocks,
        small.hit_blocks + tiered.storage_hit_blocks
    );
    let stats = tiered.storage.unwrap();
    let record = (kvroute_kvstore::storage::HEADER_BYTES + layout.full_bytes()) as u64;
    assert_eq!(
        stats.puts as usize,
        store.len(),
        "each block is written once"
    );
    assert_eq!(stats.bytes_written, stats.puts * record);
    assert_eq!(stats.bytes_read, tiered.storage_hit_blocks * record);
    let _ = std::fs::remove_dir_all(&dir);
}
