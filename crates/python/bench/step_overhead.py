"""What calling the step API from Python costs over calling it from Rust, in one run.

The same step as ``crates/remote/examples/step_overhead.rs`` (one request of Mq query rows
over four 512-token chunks on two holders, every chunk routed; and a small step over four
64-token chunks, where the fixed cost of the call shows most), called through
``Stepper.step`` from Python and timed there, alternated call by call with
``Stepper.step_timed``, whose second value is the time ``kvroute_remote::step::Stepper::step``
took as its Rust caller sees it. Medians of 300 calls each after 20 of each to warm up; and,
per ``step_timed`` call, its time from Python less its time in Rust (what the binding adds
around one step: arguments borrowed, the GIL released and taken back, outputs wrapped).

    python crates/python/bench/step_overhead.py            # mem and shm
    python crates/python/bench/step_overhead.py shm        # one of them
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

import kvroute

SCALE = 0.1147
CALLS, WARMUP = 300, 20


def measure(fabric_name: str, mq: int, tokens: int) -> tuple[float, float, float]:
    corpus = kvroute.Corpus(layers=2, chunk_tokens=tokens, chunks=4, seed=3, yarn=True)
    fabric = kvroute.Fabric(fabric_name)
    holders = []
    for ids in ((0, 1), (2, 3)):
        blocks = [corpus.chunk(i) for i in ids]
        chunks = [
            kvroute.HeldChunk(i, 2, tokens, offset=k * blocks[0].size) for k, i in enumerate(ids)
        ]
        holders.append(kvroute.Holder(fabric, np.concatenate(blocks), chunks))
    req = kvroute.Requester(fabric, [h.addr for h in holders], SCALE)
    stepper = kvroute.Stepper(req, layers=2, chunk_tokens=tokens, yarn=True, force="route", probe_mq=[1, 16, 64])
    q = corpus.queries(mq, 3000, seed=2).reshape(mq, kvroute.D_QK)
    refs = [kvroute.ChunkRef(c, corpus.positions(c)[0]) for c in range(4)]
    request = [kvroute.StepRequest(q, min(16, mq), refs)]
    from_python, from_rust, around = [], [], []
    try:
        for i in range(CALLS + WARMUP):
            t = time.perf_counter_ns()
            stepper.step(1, request)
            py_us = (time.perf_counter_ns() - t) / 1e3
            t = time.perf_counter_ns()
            _, rust_us = stepper.step_timed(1, request)
            around_us = (time.perf_counter_ns() - t) / 1e3 - rust_us
            if i >= WARMUP:
                from_python.append(py_us)
                from_rust.append(rust_us)
                around.append(around_us)
    finally:
        stepper.close()
        for h in holders:
            h.close()
    return (
        statistics.median(from_rust),
        statistics.median(from_python),
        statistics.median(around),
    )


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else None
    print(
        f"{'fabric':<6} {'Mq':>4} {'tokens':>6} {'Rust step us':>13} {'Python step us':>15}"
        f" {'Python / Rust':>14} {'around the step us':>19}"
    )
    for fabric in ("mem", "shm"):
        if which and which != fabric:
            continue
        for mq, tokens in ((16, 512), (64, 512), (16, 64)):
            rust, py, around = measure(fabric, mq, tokens)
            print(
                f"{fabric:<6} {mq:>4} {tokens:>6} {rust:>13.1f} {py:>15.1f}"
                f" {py / rust:>13.3f}x {around:>19.1f}"
            )


if __name__ == "__main__":
    main()
