"""Shared helpers: NumPy attention over bf16 rows (the reference every routed or stepped
output is checked against), and the corpus and paths the tests use."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

import kvroute

REPO = pathlib.Path(__file__).resolve().parents[3]
TRACE = REPO / "data" / "mooncake" / "conversation_trace.jsonl"
#: The softmax scale of a 192-wide query-key head (DeepSeek's MLA).
SCALE = 0.0722
#: Largest difference from NumPy attention allowed: partials cross the wire as bf16.
TOLERANCE = 4e-3


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) as float32 values."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def attention(q: np.ndarray, kv: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Attention of query rows ``q`` ``[rows, 576]`` over KV rows ``kv`` ``[tokens, 576]``
    (both bf16 bits), in float64: the output ``[rows, 512]`` and the log-sum-exp per row."""
    qf = bf16_to_f32(q).astype(np.float64)
    kf = bf16_to_f32(kv).astype(np.float64)
    s = scale * (qf @ kf.T)
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=1, keepdims=True)
    o = (p @ kf[:, : kvroute.D_LATENT]) / l
    return o, (m + np.log(l))[:, 0]


def layer_rows(corpus: kvroute.Corpus, block: np.ndarray, layer: int) -> np.ndarray:
    """The ``[chunk_tokens, 576]`` rows of ``layer`` in a chunk's full block."""
    padded = corpus.padded_tokens()
    rows = block.reshape(corpus.layers, padded, kvroute.D_QK)
    return rows[layer, : corpus.chunk_tokens]


@pytest.fixture(autouse=True)
def _fixed_seed() -> None:
    np.random.seed(7)


def shm_available() -> bool:
    """Whether libfabric's shm provider can open here (CI installs libfabric)."""
    try:
        kvroute.Holder(
            kvroute.Fabric("shm"),
            np.zeros(kvroute.full_block_elems(1, 64), np.uint16),
            [kvroute.HeldChunk(0, 1, 64)],
        ).close()
        return True
    except kvroute.KvrouteError:
        return False


requires_shm = pytest.mark.skipif(
    os.environ.get("KVROUTE_REQUIRE_SHM") != "1" and not shm_available(),
    reason="libfabric's shm provider is not available (cargo xtask deps installs it)",
)
