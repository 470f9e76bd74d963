"""Leak checks: 10,000 calls of each kind with the process's resident memory flat (a leak of
a few hundred bytes a call would show as megabytes), and no shm region left behind."""

from __future__ import annotations

import gc
import os

import numpy as np

import kvroute
from conftest import SCALE
from test_remote import LAYERS, TOKENS, corpus, start_holder, step_requests, stepper_over

CALLS = 10_000
#: Growth of resident memory allowed over CALLS calls after a warm-up (allocator noise).
SLACK_BYTES = 2 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def flat(call) -> int:
    """Runs ``call`` CALLS / 5 times to warm up, then CALLS times; the RSS growth."""
    for _ in range(CALLS // 5):
        call()
    gc.collect()
    before = rss_bytes()
    for _ in range(CALLS):
        call()
    gc.collect()
    return rss_bytes() - before


def test_steps_and_routes_leak_nothing() -> None:
    c = corpus()
    fabric = kvroute.Fabric("mem")
    own = np.full((4, kvroute.D_QK), 0x3C00, np.uint16)
    with start_holder(fabric, c) as holder:
        with kvroute.Requester(fabric, [holder.addr], SCALE) as req:
            q = c.queries(16, 2 * TOKENS, seed=1).reshape(16, kvroute.D_QK)
            grown = flat(lambda: req.route(0, 1, q).o)
            assert grown < SLACK_BYTES, f"route: RSS grew {grown} bytes over {CALLS} calls"
        with stepper_over(fabric, [holder.addr], "route") as stepper:
            requests, _ = step_requests(c, own)
            grown = flat(lambda: stepper.step(LAYERS - 1, requests).outputs[0].o)
            assert grown < SLACK_BYTES, f"step: RSS grew {grown} bytes over {CALLS} calls"


def test_failing_calls_leak_nothing() -> None:
    """The error path too: each call raises a mapped exception."""

    def bad() -> None:
        try:
            kvroute.predict(256, 2048, model="no-such-model")
        except kvroute.NotFoundError:
            pass

    grown = flat(bad)
    assert grown < SLACK_BYTES, f"RSS grew {grown} bytes over {CALLS} failing calls"


def test_cost_model_and_cache_calls_leak_nothing() -> None:
    cache = kvroute.PrefixCache(64)
    hashes = list(range(32))
    grown = flat(lambda: (kvroute.predict(256, 2048), cache.access(hashes)))
    assert grown < SLACK_BYTES, f"RSS grew {grown} bytes over {CALLS} calls"
