"""kvroute from Python: attention across instances, the cost model and the KV store.

A decode step attends to KV chunks other instances hold. kvroute decides per (chunk,
request) whether to **route** the query rows to the holder, **fetch** the chunk, or
recompute it, moves the bytes and merges the partial attentions exactly. This package
binds the Rust crates with no logic of its own:

The main job (``kvroute-remote``)
    :class:`Fabric` (``"mem"``, ``"shm"``, ``"tcp"``, ...), :class:`Holder` serving your KV
    chunks (:class:`HeldChunk`), :class:`Requester` (``route``), and the step API:
    :class:`Stepper` with one :meth:`Stepper.step` call per layer for a batch of
    :class:`StepRequest` (each its query rows, :class:`ChunkRef`\\ s and own KV), returning a
    :class:`StepOutput` of :class:`PartialAttention`. :func:`step_async` awaits a step from
    asyncio. :func:`merge` merges partials; :class:`Corpus` makes synthetic KV for tests.
    Query and KV rows are bf16 bits in ``uint16`` NumPy arrays (any 2-byte dtype, e.g.
    ml_dtypes' ``bfloat16``, is viewed as ``uint16``; PyTorch CPU tensors come in through
    DLPack), ``[rows, 576]``; they are borrowed, not copied. Outputs are float32 arrays.
The cost model (``kvroute-costmodel``)
    :func:`presets`, :func:`predict`, :func:`decide`, :func:`plan_prfaas`,
    :func:`plan_helix`.
The KV store (``kvroute-kvstore``)
    :class:`PrefixCache`, :func:`replay_trace`, :class:`BlockStore` (the storage tier).
The simulators (``kvroute-sched``)
    :func:`simulate_dualpath`, :func:`simulate_prfaas`.

Reports are :class:`Record` objects with the fields of the command line's ``--json``.
Errors are the exceptions of :mod:`kvroute.errors` (:class:`KvrouteError` and its
subclasses). The GIL is released during every wait and transfer, and long calls
(connecting, calibrating, replays, simulations, :meth:`Holder.serve`) stop on Ctrl-C.
docs/python.md in the repository is the manual.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from kvroute._native import (
    BlockStore,
    ChunkRef,
    Corpus,
    Fabric,
    HeldChunk,
    Holder,
    PartialAttention,
    PrefixCache,
    Requester,
    StepOutput,
    StepRequest,
    Stepper,
    decide,
    merge,
    plan_helix,
    plan_prfaas,
    predict,
    presets,
    replay_trace,
    simulate_dualpath,
    simulate_prfaas,
)
from kvroute._record import Record
from kvroute.errors import (
    BusyError,
    CacheFullError,
    CorruptError,
    InvalidInputError,
    KvrouteError,
    NotFoundError,
    PinnedError,
    RefusedError,
    TimedOutError,
    TransportError,
    UnreachableError,
)

__version__ = "0.1.0"

#: Columns of a query or KV row: the 512-wide latent and the 64-wide RoPE band (MLA).
D_QK = 576
#: Columns of an attention output row.
D_LATENT = 512
#: Tokens of a page: a full block pads each layer's tokens to whole pages.
PAGE_TOKENS = 64


def full_block_elems(layers: int, tokens: int) -> int:
    """Elements (uint16) of one chunk's full block: ``layers`` x ``tokens`` padded to whole
    64-token pages x 576. A :class:`HeldChunk` without ``block_tokens`` lies in the KV
    array as one such block, layer-major."""
    padded = -(-tokens // PAGE_TOKENS) * PAGE_TOKENS
    return layers * padded * D_QK


async def step_async(
    stepper: Stepper, layer: int, requests: Sequence[StepRequest]
) -> StepOutput:
    """Awaits ``stepper.step(layer, requests)`` from asyncio: the step runs on the event
    loop's default executor with the GIL released, so other tasks run meanwhile. One step
    at a time per stepper (a second concurrent call raises ``RuntimeError``)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, stepper.step, layer, list(requests))


__all__ = [
    "D_QK",
    "D_LATENT",
    "PAGE_TOKENS",
    "BlockStore",
    "BusyError",
    "CacheFullError",
    "ChunkRef",
    "CorruptError",
    "Corpus",
    "Fabric",
    "HeldChunk",
    "Holder",
    "InvalidInputError",
    "KvrouteError",
    "NotFoundError",
    "PartialAttention",
    "PinnedError",
    "PrefixCache",
    "Record",
    "RefusedError",
    "Requester",
    "StepOutput",
    "StepRequest",
    "Stepper",
    "TimedOutError",
    "TransportError",
    "UnreachableError",
    "decide",
    "full_block_elems",
    "merge",
    "plan_helix",
    "plan_prfaas",
    "predict",
    "presets",
    "replay_trace",
    "simulate_dualpath",
    "simulate_prfaas",
    "step_async",
]
