"""Holders, requesters and the step API: routed and stepped outputs checked against NumPy
attention over the same KV, in one process over ``mem`` and in two processes over ``shm``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvroute
from conftest import SCALE, TOLERANCE, attention, layer_rows, requires_shm

LAYERS, TOKENS = 4, 128
HERE = os.path.dirname(os.path.abspath(__file__))


def corpus() -> kvroute.Corpus:
    return kvroute.Corpus(layers=LAYERS, chunk_tokens=TOKENS, chunks=2, seed=1)


def start_holder(fabric: kvroute.Fabric, c: kvroute.Corpus, **kw) -> kvroute.Holder:
    """A holder of both chunks of ``c``, as two full blocks one after the other."""
    blocks = [c.chunk(0), c.chunk(1)]
    kv = np.concatenate(blocks)
    chunks = [
        kvroute.HeldChunk(0, c.layers, c.chunk_tokens, offset=0),
        kvroute.HeldChunk(1, c.layers, c.chunk_tokens, offset=blocks[0].size),
    ]
    return kvroute.Holder(fabric, kv, chunks, **kw)


def check_route(req: kvroute.Requester, c: kvroute.Corpus) -> float:
    """Routes a dense call to each chunk at layer 2; the largest difference from NumPy."""
    q = c.queries(16, 2 * TOKENS, seed=7).reshape(16, kvroute.D_QK)
    worst = 0.0
    for chunk in (0, 1):
        part = req.route(chunk, 2, q)
        o, lse = attention(q, layer_rows(c, c.chunk(chunk), 2), SCALE)
        assert part.o.shape == (16, kvroute.D_LATENT) and part.o.dtype == np.float32
        worst = max(worst, float(np.abs(part.o - o).max()), float(np.abs(part.lse() - lse).max()))
    return worst


def test_route_over_mem_matches_numpy_attention() -> None:
    c = corpus()
    fabric = kvroute.Fabric("mem")
    with start_holder(fabric, c) as holder, kvroute.Requester(
        fabric, [holder.addr], SCALE
    ) as req:
        assert req.chunks() == [0, 1]
        assert check_route(req, c) < TOLERANCE
        assert holder.stats().fields()  # counters as a Record


def test_sparse_route_matches_numpy_attention_over_the_picked_tokens() -> None:
    c = corpus()
    fabric = kvroute.Fabric("mem")
    with start_holder(fabric, c) as holder, kvroute.Requester(fabric, [holder.addr], SCALE) as req:
        q = c.queries(16, 2 * TOKENS, seed=3).reshape(16, kvroute.D_QK)
        picks = np.array([[5, 9, 40, 77, 100, 127]], np.int32)
        part = req.route(1, 3, q, indices=picks, rows_per_token=16)
        o, _ = attention(q, layer_rows(c, c.chunk(1), 3)[picks[0]], SCALE)
        assert np.abs(part.o - o).max() < TOLERANCE


def test_partials_of_two_chunks_merge_to_attention_over_both() -> None:
    c = corpus()
    fabric = kvroute.Fabric("mem")
    with start_holder(fabric, c) as holder, kvroute.Requester(fabric, [holder.addr], SCALE) as req:
        q = c.queries(8, 2 * TOKENS, seed=5).reshape(8, kvroute.D_QK)
        merged = kvroute.merge([req.route(0, 1, q), req.route(1, 1, q)])
        both = np.concatenate([layer_rows(c, c.chunk(i), 1) for i in (0, 1)])
        o, lse = attention(q, both, SCALE)
        assert np.abs(merged.o - o).max() < TOLERANCE
        assert np.abs(merged.lse() - lse).max() < TOLERANCE


def stepper_over(fabric: kvroute.Fabric, addrs: list[str], force: str | None = None) -> kvroute.Stepper:
    req = kvroute.Requester(fabric, addrs, SCALE)
    return kvroute.Stepper(req, layers=LAYERS, chunk_tokens=TOKENS, force=force)


def step_requests(c: kvroute.Corpus, own: np.ndarray) -> tuple[list[kvroute.StepRequest], np.ndarray]:
    """Two requests: both chunks at their stored positions, then 12 rows of their own KV."""
    q = c.queries(16, 2 * TOKENS + 12, seed=11).reshape(16, kvroute.D_QK)
    refs = [kvroute.ChunkRef(i, c.positions(i)[0]) for i in (0, 1)]
    return [kvroute.StepRequest(q, 16, refs, local=own) for _ in range(2)], q


@pytest.mark.parametrize("force", ["route", "fetch", None])
def test_step_merges_remote_chunks_and_own_kv_like_numpy(force: str | None) -> None:
    c = corpus()
    fabric = kvroute.Fabric("mem")
    own = (np.random.default_rng(1).integers(0x3C00, 0x3E00, (12, kvroute.D_QK))).astype(np.uint16)
    with start_holder(fabric, c) as holder, stepper_over(fabric, [holder.addr], force) as stepper:
        requests, q = step_requests(c, own)
        for layer in range(LAYERS):
            out = stepper.step(layer, requests)
            kv = np.concatenate([layer_rows(c, c.chunk(i), layer) for i in (0, 1)] + [own])
            o, lse = attention(q, kv, SCALE)
            assert len(out.outputs) == 2
            for part in out.outputs:
                assert np.abs(part.o - o).max() < TOLERANCE
                assert np.abs(part.lse() - lse).max() < TOLERANCE
            hows = {d.how for d in out.report.decisions}
            if force == "route":
                assert hows == {"Route"}
            elif force == "fetch":
                assert hows <= {"Fetch", "Cached"}
        assert stepper.stats().steps == LAYERS


def test_step_async_awaits_the_same_step() -> None:
    c = corpus()
    fabric = kvroute.Fabric("mem")
    own = np.full((4, kvroute.D_QK), 0x3C00, np.uint16)
    with start_holder(fabric, c) as holder, stepper_over(fabric, [holder.addr], "route") as stepper:
        requests, q = step_requests(c, own)

        async def main() -> kvroute.StepOutput:
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            ticker = asyncio.ensure_future(tick())
            out = await kvroute.step_async(stepper, 0, requests)
            ticker.cancel()
            return out

        out = asyncio.run(main())
        kv = np.concatenate([layer_rows(c, c.chunk(i), 0) for i in (0, 1)] + [own])
        o, _ = attention(q, kv, SCALE)
        assert np.abs(out.outputs[0].o - o).max() < TOLERANCE


class DlpackOnly:
    """An array that offers only the DLPack protocol (as a PyTorch tensor does)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    @property
    def dtype(self):
        return self._a.dtype


def test_queries_come_in_as_int16_views_and_through_dlpack() -> None:
    c = corpus()
    fabric = kvroute.Fabric("mem")
    with start_holder(fabric, c) as holder, kvroute.Requester(fabric, [holder.addr], SCALE) as req:
        q = c.queries(16, 2 * TOKENS, seed=7).reshape(16, kvroute.D_QK)
        want = req.route(0, 0, q).o
        assert np.array_equal(req.route(0, 0, q.view(np.int16)).o, want)
        assert np.array_equal(req.route(0, 0, DlpackOnly(q)).o, want)


def test_torch_cpu_tensors_go_through_dlpack() -> None:
    torch = pytest.importorskip("torch")
    c = corpus()
    fabric = kvroute.Fabric("mem")
    with start_holder(fabric, c) as holder, kvroute.Requester(fabric, [holder.addr], SCALE) as req:
        q = c.queries(16, 2 * TOKENS, seed=7).reshape(16, kvroute.D_QK)
        t = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16)
        assert np.array_equal(req.route(0, 0, t).o, req.route(0, 0, q).o)


def test_gil_is_released_while_a_call_waits() -> None:
    """A Python thread keeps running at full speed while another waits in ``serve``."""
    c = corpus()
    with start_holder(kvroute.Fabric("mem"), c) as holder:

        def count(seconds: float) -> int:
            n, end = 0, time.perf_counter() + seconds
            while time.perf_counter() < end:
                n += 1
            return n

        alone = count(0.3)
        waiter = threading.Thread(target=holder.serve, kwargs={"seconds": 0.6})
        waiter.start()
        beside = count(0.3)
        waiter.join()
        assert beside > 0.5 * alone, (alone, beside)


@requires_shm
def test_holder_and_requester_in_two_processes_over_shm() -> None:
    """A holder process (tests/holder_process.py) serves until Ctrl-C; this process routes
    to it and steps over it, each output checked against NumPy."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "holder_process.py"), "shm", str(LAYERS), str(TOKENS)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        addr = proc.stdout.readline().strip()
        assert addr, "the holder process printed no address"
        c = corpus()
        fabric = kvroute.Fabric("shm")
        with kvroute.Requester(fabric, [addr], SCALE) as req:
            assert check_route(req, c) < TOLERANCE
        own = np.full((4, kvroute.D_QK), 0x3C00, np.uint16)
        with stepper_over(fabric, [addr]) as stepper:
            requests, q = step_requests(c, own)
            out = stepper.step(3, requests)
            kv = np.concatenate([layer_rows(c, c.chunk(i), 3) for i in (0, 1)] + [own])
            o, _ = attention(q, kv, SCALE)
            assert np.abs(out.outputs[1].o - o).max() < TOLERANCE
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: serve() raises KeyboardInterrupt
        assert proc.wait(timeout=20) == 0, "the holder did not stop cleanly on Ctrl-C"


def test_closed_engines_leave_no_shm_region() -> None:
    """Closing a holder, requester or stepper stops its engine: over shm, its regions go."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    mine = lambda: sorted(n for n in os.listdir("/dev/shm") if n.split(":")[0] == str(os.getpid()))
    before = mine()
    c = corpus()
    fabric = kvroute.Fabric("shm")
    try:
        holder = start_holder(fabric, c)
    except kvroute.TransportError:
        pytest.skip("libfabric's shm provider is not available")
    with holder:
        kvroute.Requester(fabric, [holder.addr], SCALE).close()
        stepper_over(fabric, [holder.addr], "route").close()
    assert mine() == before

