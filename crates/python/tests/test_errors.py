"""Bad input raises the mapped exception, never a crash: shapes, dtypes, placements,
addresses, unknown chunks, a busy holder, closed objects; and every public name is
documented (what ``help(kvroute)`` shows)."""

from __future__ import annotations

import inspect
import pydoc
import socket

import numpy as np
import pytest

import kvroute
from conftest import SCALE
from test_remote import TOKENS, corpus, start_holder, step_requests, stepper_over


@pytest.fixture(scope="module")
def served():
    c = corpus()
    fabric = kvroute.Fabric("mem")
    with start_holder(fabric, c) as holder:
        yield c, fabric, holder


def test_bad_queries_are_invalid_input(served) -> None:
    c, fabric, holder = served
    with kvroute.Requester(fabric, [holder.addr], SCALE) as req:
        q = c.queries(16, 2 * TOKENS, seed=1).reshape(16, kvroute.D_QK)
        for bad in (q.astype(np.float32), q[:, :100], q[:, ::2], "rows", np.zeros(0, np.uint16)):
            with pytest.raises(kvroute.InvalidInputError):
                req.route(0, 0, bad)
        with pytest.raises(kvroute.InvalidInputError):
            req.route(0, 0, q, indices=np.array([[1, 2]], np.int64), rows_per_token=16)
        with pytest.raises(kvroute.InvalidInputError):
            req.route(0, 0, q, indices=np.array([[1, 2]], np.int32))
        with pytest.raises(kvroute.RefusedError):
            req.route(0, 99, q)  # a layer the chunk does not have: the holder refuses
        with pytest.raises(kvroute.UnreachableError):
            req.route(7, 0, q)  # no holder has chunk 7


def test_bad_step_requests_are_invalid_input(served) -> None:
    c, fabric, holder = served
    with stepper_over(fabric, [holder.addr], "route") as stepper:
        requests, q = step_requests(c, np.full((4, kvroute.D_QK), 0x3C00, np.uint16))
        with pytest.raises(kvroute.InvalidInputError):
            stepper.step(0, [kvroute.StepRequest(q, 5, requests[0].chunks)])  # 16 rows, 5 heads
        with pytest.raises(kvroute.UnreachableError):
            stepper.step(0, [kvroute.StepRequest(q, 16, [kvroute.ChunkRef(42, 0)])])
        with pytest.raises(kvroute.InvalidInputError):
            stepper.step(0, [kvroute.StepRequest(q, 16, requests[0].chunks, local=q[:, :7])])
        picks = kvroute.ChunkRef(0, 0, picks=np.array([1, 2], np.int32))  # not [tokens, k]
        with pytest.raises(kvroute.InvalidInputError):
            stepper.step(0, [kvroute.StepRequest(q, 16, [picks])])
        with pytest.raises(kvroute.InvalidInputError):
            kvroute.StepRequest(q, 16, [], local=q, local_block_tokens=64)
        assert len(stepper.step(0, requests).outputs) == 2  # still works afterwards


def test_bad_holders_and_addresses(served) -> None:
    c, fabric, holder = served
    block = c.chunk(0)
    with pytest.raises(kvroute.InvalidInputError):  # outside the array
        kvroute.Holder(fabric, block, [kvroute.HeldChunk(0, c.layers, TOKENS, offset=10)])
    with pytest.raises(kvroute.InvalidInputError):  # twice
        kvroute.Holder(fabric, block, [kvroute.HeldChunk(0, c.layers, TOKENS)] * 2)
    with pytest.raises(kvroute.InvalidInputError):
        kvroute.Holder(fabric, block, [kvroute.HeldChunk(0, 0, TOKENS)])
    with pytest.raises(kvroute.InvalidInputError):
        kvroute.HeldChunk(0, 1, 64, block_tokens=16)
    with pytest.raises(kvroute.InvalidInputError):
        kvroute.HeldChunk(0, 1, 64, rope_layout="spiral")
    with pytest.raises(kvroute.InvalidInputError):
        kvroute.Requester(fabric, ["not an address"], SCALE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(kvroute.UnreachableError):
        kvroute.Requester(fabric, [closed], SCALE, timeout_s=1.0)
    with pytest.raises(kvroute.InvalidInputError):
        kvroute.Stepper(kvroute.Requester(fabric, [holder.addr], SCALE), layers=4, chunk_tokens=TOKENS, force="teleport")


def test_a_full_holder_is_busy() -> None:
    c = corpus()
    fabric = kvroute.Fabric("mem")
    with start_holder(fabric, c, max_requesters=1) as holder:
        with kvroute.Requester(fabric, [holder.addr], SCALE) as first:
            first.route(0, 0, c.queries(16, 0, seed=1).reshape(16, kvroute.D_QK))
            with pytest.raises(kvroute.BusyError):
                kvroute.Requester(fabric, [holder.addr], SCALE)


def test_closed_objects_raise_instead_of_crashing(served) -> None:
    c, fabric, holder = served
    req = kvroute.Requester(fabric, [holder.addr], SCALE)
    stepper = kvroute.Stepper(req, layers=4, chunk_tokens=TOKENS)
    with pytest.raises(kvroute.InvalidInputError):
        req.chunks()  # moved into the stepper
    stepper.close()
    with pytest.raises(kvroute.InvalidInputError):
        stepper.stats()
    h = start_holder(fabric, c)
    h.close()
    h.close()
    with pytest.raises(kvroute.InvalidInputError):
        h.stats()


def test_every_public_name_is_documented() -> None:
    text = pydoc.render_doc(kvroute, renderer=pydoc.plaintext)
    undocumented = []
    for name in kvroute.__all__:
        obj = getattr(kvroute, name)
        assert name in text, name
        if isinstance(obj, int):
            continue
        if not (inspect.getdoc(obj) or "").strip():
            undocumented.append(name)
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not callable(member) and not isinstance(member, property) and not hasattr(member, "__get__"):
                    continue
                if not (getattr(member, "__doc__", None) or "").strip():
                    undocumented.append(f"{name}.{attr}")
    assert undocumented == []


@pytest.mark.parametrize(
    "call",
    [
        lambda: kvroute.PrefixCache(10**12),
        lambda: kvroute.replay_trace("x.jsonl", capacity_blocks=10**12),
        lambda: kvroute.simulate_dualpath(agents=10**9),
        lambda: kvroute.simulate_prfaas(requests=10**12),
        lambda: kvroute.plan_prfaas(grid=10**9),
        lambda: kvroute.Corpus(layers=1, chunk_tokens=64, chunks=1).queries(10**10, 0, 1),
    ],
)
def test_sizes_past_memory_are_refused_not_allocated(call) -> None:
    with pytest.raises(kvroute.InvalidInputError):
        call()
