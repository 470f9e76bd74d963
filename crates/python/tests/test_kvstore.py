"""The KV store: the prefix cache, the Mooncake trace replay matching the Rust crate's
figures, and the storage tier's write, read and verify (a flipped byte caught)."""

from __future__ import annotations

import numpy as np
import pytest

import kvroute
from conftest import TRACE


def test_prefix_cache_lookup_insert_pin_evict() -> None:
    cache = kvroute.PrefixCache(3, "lru")
    assert cache.access([1, 2, 3]) == (0, 3, [])
    assert cache.lookup([1, 2, 3, 4]) == 3
    assert cache.get(2, parent=1) == 1
    assert cache.pin([1, 2]) == 2
    hit, inserted, evicted = cache.access([9])
    assert (hit, inserted) == (0, 1)
    assert evicted == [(3, 2, 2)]  # the only unpinned block
    with pytest.raises(kvroute.PinnedError):
        cache.remove(1)
    with pytest.raises(kvroute.CacheFullError):
        cache.pin([9])
        cache.insert(10, 0)
    cache.unpin([1, 2], 2)
    cache.unpin([9], 1)
    assert cache.evict() is not None
    assert len(cache) == 2 and cache.capacity == 3 and cache.policy == "lru"


def test_tail_first_keeps_prefixes_longer_than_lru() -> None:
    lru, tail = kvroute.PrefixCache(4, "lru"), kvroute.PrefixCache(4, "tail-first")
    for c in (lru, tail):
        c.access([1, 2, 3, 4])
        c.access([7])
    assert tail.lookup([1, 2, 3, 4]) > lru.lookup([1, 2, 3, 4])


def test_unknown_policy_is_invalid_input() -> None:
    with pytest.raises(kvroute.InvalidInputError):
        kvroute.PrefixCache(3, "mru")


def test_trace_replay_reproduces_the_published_figures() -> None:
    r = kvroute.replay_trace(str(TRACE))
    assert r.requests == 12_031
    assert r.distinct_blocks == 182_790
    assert (r.hit_blocks, r.blocks) == (105_710, 288_500)
    assert f"{r.block_prefix_hit_ratio:.3f}" == "0.366"
    assert r.evictions == 0
    assert r.cache_ns_per_block > 0 and r.baseline_ns_per_block > 0


def test_bounded_lru_replays_match_the_rust_figures() -> None:
    for capacity, hits, evictions in [(1_000, 12_831, 274_669), (10_000, 60_921, 217_579)]:
        r = kvroute.replay_trace(str(TRACE), capacity_blocks=capacity)
        assert (r.hit_blocks, r.evictions) == (hits, evictions)


def test_missing_trace_is_not_found(tmp_path) -> None:
    with pytest.raises(kvroute.NotFoundError):
        kvroute.replay_trace(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(kvroute.CorruptError):
        kvroute.replay_trace(str(bad))


def test_storage_tier_writes_reads_and_catches_a_flipped_byte(tmp_path) -> None:
    c = kvroute.Corpus(layers=2, chunk_tokens=64, chunks=3, seed=4)
    store = kvroute.BlockStore(str(tmp_path), layers=2, tokens=64)
    assert store.block_elems == c.chunk(0).size
    for k in range(3):
        store.put(k, c.chunk(k))
    assert store.keys() == [0, 1, 2] and 1 in store and len(store) == 3
    assert np.array_equal(store.get(1), c.chunk(1))
    assert store.verify().ok == 3
    with pytest.raises(kvroute.InvalidInputError):
        store.put(5, c.chunk(0)[:-1])
    path = store.path(2)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))
    reopened = kvroute.BlockStore(str(tmp_path))
    with pytest.raises(kvroute.CorruptError):
        reopened.get(2)
    report = reopened.verify()
    assert (report.ok, report.corrupt, report.missing) == (2, 1, 0)
    with pytest.raises(kvroute.NotFoundError):
        reopened.get(9)
