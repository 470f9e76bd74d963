"""Type stubs of kvroute's native module (the Rust extension); import ``kvroute``."""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import numpy.typing as npt

from kvroute._record import Record

_U16 = npt.NDArray[np.uint16]
_F32 = npt.NDArray[np.float32]
# bf16 bits: a uint16 array, any 2-byte array (viewed as uint16) or a DLPack tensor.
_Rows = Any
_Indices = npt.NDArray[np.int32]
_Evicted = tuple[int, int | None, int]

class Fabric:
    """Where engines come from: ``"mem"`` (in process), ``"shm"``, ``"tcp"``, ``"efa"``,
    ``"auto"`` or a libfabric provider name."""

    def __init__(self, provider: str = "mem") -> None: ...
    @property
    def provider(self) -> str: ...

class HeldChunk:
    """One chunk a Holder serves: a full block at element ``offset`` of the KV array, or
    paged (``block_tokens`` rows a block, ``table`` layer-major)."""

    chunk: int
    layers: int
    tokens: int
    offset: int
    block_tokens: int | None
    table: list[int] | None
    positions: list[int]
    rope_layout: str
    def __init__(
        self,
        chunk: int,
        layers: int,
        tokens: int,
        offset: int = 0,
        positions: Sequence[int] | None = None,
        block_tokens: int | None = None,
        table: Sequence[int] | None = None,
        rope_layout: str = "interleaved",
    ) -> None: ...

class Holder:
    """Serves partial attention over the chunks of a KV array (copied once into registered
    memory) until closed."""

    def __init__(
        self,
        fabric: Fabric,
        kv: _Rows,
        chunks: Sequence[HeldChunk],
        listen: str = "127.0.0.1:0",
        max_requesters: int = 8,
    ) -> None: ...
    @property
    def addr(self) -> str: ...
    def stats(self) -> Record: ...
    def serve(self, seconds: float | None = None) -> None: ...
    def close(self) -> None: ...
    def __enter__(self) -> Holder: ...
    def __exit__(self, *exc: object) -> bool: ...

class PartialAttention:
    """A partial attention: ``o`` [rows, 512], ``m`` and ``l`` [rows] (float32)."""

    o: _F32
    m: _F32
    l: _F32
    def lse(self) -> _F32: ...

class Requester:
    """Sessions with holders and the route call."""

    def __init__(
        self,
        fabric: Fabric,
        holders: Sequence[str],
        scale: float,
        timeout_s: float = 5.0,
        pool_pages: int = 512,
    ) -> None: ...
    def chunks(self) -> list[int]: ...
    def holders(self) -> int: ...
    def holder_stats(self, holder: int) -> Record: ...
    def route(
        self,
        chunk: int,
        layer: int,
        queries: _Rows,
        indices: _Indices | None = None,
        rows_per_token: int | None = None,
    ) -> PartialAttention: ...
    def close(self) -> None: ...
    def __enter__(self) -> Requester: ...
    def __exit__(self, *exc: object) -> bool: ...

def merge(parts: Sequence[PartialAttention]) -> PartialAttention:
    """Merges partials of the same rows over disjoint KV, exactly."""

class ChunkRef:
    """A remote chunk a request attends, placed at ``start``; sparse with ``picks``."""

    chunk: int
    start: int
    picks: _Indices | None
    def __init__(self, chunk: int, start: int, picks: _Indices | None = None) -> None: ...

class StepRequest:
    """One request of a step: query rows, heads, remote chunks, own KV."""

    queries: _Rows
    heads: int
    chunks: list[ChunkRef]
    local: _Rows | None
    local_picks: _Indices | None
    local_block_tokens: int | None
    local_table: list[int] | None
    local_tokens: int | None
    def __init__(
        self,
        queries: _Rows,
        heads: int,
        chunks: Sequence[ChunkRef],
        local: _Rows | None = None,
        local_picks: _Indices | None = None,
        local_block_tokens: int | None = None,
        local_table: Sequence[int] | None = None,
        local_tokens: int | None = None,
    ) -> None: ...

class StepOutput:
    """One merged partial per request, and what the step did."""

    @property
    def outputs(self) -> list[PartialAttention]: ...
    @property
    def report(self) -> Record: ...

class Stepper:
    """A requester, its calibrated selector and the fetch cache: one ``step`` per layer."""

    def __init__(
        self,
        requester: Requester,
        layers: int,
        chunk_tokens: int,
        model: str = "deepseek-v2-lite",
        rope_theta: float = 10000.0,
        yarn: bool = False,
        rope_layout: str = "interleaved",
        force: str | None = None,
        fetch_budget_bytes: int = 1 << 30,
        probe_mq: Sequence[int] = (1, 16, 64),
        probe_reps: int = 10,
    ) -> None: ...
    def step(self, layer: int, requests: Sequence[StepRequest]) -> StepOutput: ...
    def step_timed(self, layer: int, requests: Sequence[StepRequest]) -> tuple[StepOutput, float]: ...
    def stats(self) -> Record: ...
    def close(self) -> None: ...
    def __enter__(self) -> Stepper: ...
    def __exit__(self, *exc: object) -> bool: ...

class Corpus:
    """A synthetic MLA corpus (seeded, RoPE-rotated at canonical positions)."""

    layers: int
    chunk_tokens: int
    chunks: int
    seed: int
    rope_theta: float
    yarn: bool
    def __init__(
        self,
        layers: int,
        chunk_tokens: int,
        chunks: int,
        seed: int = 1,
        rope_theta: float = 10000.0,
        yarn: bool = False,
    ) -> None: ...
    def chunk(self, chunk: int) -> _U16: ...
    def padded_tokens(self) -> int: ...
    def positions(self, chunk: int) -> list[int]: ...
    def queries(self, rows: int, position: int, seed: int) -> _U16: ...

def presets() -> Record: ...
def predict(
    mq: int,
    ct: int,
    model: str = "deepseek-v2-lite",
    fabric: str | None = None,
    topk: int | None = None,
    holders: int = 1,
    tp: int = 1,
    holder_requesters: int = 1,
    probe_us: float | None = None,
    bw_gbps: float | None = None,
    turnaround_us: float | None = None,
    link_gbps: float | None = None,
    splice_us: float | None = None,
    merge_us: float | None = None,
    local_us_per_token_layer: float = 1.0,
    bw_degradation: float = 1.0,
    probe_inflation: float = 1.0,
    flows: int = 1,
    only: Sequence[str] | None = None,
) -> Record: ...
def decide(
    mq: int,
    ct: int,
    model: str = "deepseek-v2-lite",
    fabric: str | None = None,
    topk: int | None = None,
    holders: int = 1,
    probe_us: float | None = None,
    bw_gbps: float | None = None,
    only: Sequence[str] | None = None,
) -> Record: ...
def plan_prfaas(
    n_prfaas: int = 4,
    n_pd: int = 8,
    egress_gbps: float = 100.0,
    bs_max: int = 20,
    decode_tps: float = 40.0,
    output_tokens: float = 1024.0,
    mu: float = 9.90,
    sigma: float = 1.00,
    min_tokens: float = 128.0,
    max_tokens: float = 131072.0,
    profile: str | None = None,
    pd_prefill_slowdown: float | None = None,
    grid: int = 1024,
    threshold: float | None = None,
    np: int | None = None,
) -> Record: ...
def plan_helix(
    batch: int = 8,
    q_heads: int = 128,
    kv_heads: int = 8,
    head_size: int = 128,
    seq_len: int = 1 << 20,
    ffn_dim: int = 65536,
    tpa: int = 8,
    tpf: int = 64,
    kvp: int = 8,
    bytes_per_param: float = 0.5,
    mem_bw_gbps: float = 8000.0,
    hopb_requests: int | None = None,
    hopb_attention: float | None = None,
    hopb_comm: float | None = None,
) -> Record: ...

class PrefixCache:
    """A prefix cache over chained block hashes (LRU or tail-first; pins)."""

    def __init__(self, capacity: int, policy: str = "lru") -> None: ...
    def lookup(self, hashes: Sequence[int]) -> int: ...
    def access(
        self, hashes: Sequence[int], values: Sequence[int] | None = None
    ) -> tuple[int, int, list[_Evicted]]: ...
    def insert(self, hash: int, value: int, parent: int | None = None) -> list[_Evicted]: ...
    def get(self, hash: int, parent: int | None = None) -> int | None: ...
    def touch(self, hash: int, parent: int | None = None) -> bool: ...
    def pin(self, hashes: Sequence[int]) -> int: ...
    def unpin(self, hashes: Sequence[int], blocks: int) -> None: ...
    def evict(self) -> _Evicted | None: ...
    def remove(self, hash: int, parent: int | None = None) -> int: ...
    @property
    def pinned(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def policy(self) -> str: ...
    def __len__(self) -> int: ...

def replay_trace(
    trace: str | os.PathLike[str],
    block_tokens: int = 512,
    capacity_blocks: int = 0,
    policy: str = "lru",
    limit: int = 0,
    store_dir: str | os.PathLike[str] | None = None,
    store_layers: int = 1,
) -> Record: ...

class BlockStore:
    """The storage tier: checksummed full blocks in a directory."""

    def __init__(
        self, dir: str | os.PathLike[str], layers: int | None = None, tokens: int | None = None
    ) -> None: ...
    @property
    def block_elems(self) -> int: ...
    def put(self, key: int, block: _Rows) -> None: ...
    def get(self, key: int) -> _U16: ...
    def remove(self, key: int) -> None: ...
    def verify(self) -> Record: ...
    def keys(self) -> list[int]: ...
    def path(self, key: int) -> os.PathLike[str]: ...
    def stats(self) -> Record: ...
    def __contains__(self, key: int) -> bool: ...
    def __len__(self) -> int: ...

def simulate_dualpath(
    trace: str | os.PathLike[str] | None = None,
    scale: int = 1,
    time_scale: float = 1.0,
    agents: int = 1024,
    seed: int = 1,
    model: str = "deepseek-v3.2",
    prefill_nodes: int = 2,
    decode_nodes: int = 4,
    policy: str = "all",
    gpu_tflops: float = 400.0,
    snic_gbps: float = 400.0,
    cnic_gbps: float = 400.0,
    de_hbm_gb: float | None = None,
    beta_s: float = 2.0,
    alpha_s: float = 0.5,
) -> Record: ...
def simulate_prfaas(
    trace: str | os.PathLike[str] | None = None,
    time_scale: float = 1.0,
    cache_blocks: int = 0,
    h20_slowdown: float | None = None,
    requests: int = 40000,
    seed: int = 1,
    adapt: bool = False,
) -> Record: ...
