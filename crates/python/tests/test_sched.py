"""The simulators: DualPath against its baselines on a synthetic rollout, the PrfaaS case
study reproducing paper 001 table 6's ratios, and PrfaaS on the Mooncake trace."""

from __future__ import annotations

import pytest

import kvroute
from conftest import TRACE


def test_dualpath_runs_every_policy_with_ratios() -> None:
    r = kvroute.simulate_dualpath(agents=128, model="ds-27b", prefill_nodes=1, decode_nodes=2)
    assert [run.policy for run in r.runs][0] == "dualpath" and len(r.runs) == 3
    assert all(run.ttft_s.p90 > 0 for run in r.runs)
    assert r.throughput_ratio.vs_prefill_read > 1.0
    assert r.config.snic_gbps == 400.0 and r.plots == []


def test_prfaas_case_study_reproduces_table_6() -> None:
    r = kvroute.simulate_prfaas(requests=20_000)
    assert len(r.case_study) == 2 and r.trace is None
    assert abs(r.case_study[0].throughput_ratio.vs_naive - 1.32) < 0.132
    assert abs(r.case_study[1].throughput_ratio.vs_homogeneous - 1.54) < 0.154


def test_prfaas_on_the_mooncake_trace() -> None:
    r = kvroute.simulate_prfaas(trace=str(TRACE))
    assert r.case_study == [] and len(r.trace.at_trace_rate) == 3
    assert r.trace.at_trace_rate[0].requests == 12_031
    assert r.trace.sustainable[0].kept_up


@pytest.mark.parametrize(
    "call",
    [
        lambda: kvroute.simulate_dualpath(agents=4, policy="fastest"),
        lambda: kvroute.simulate_dualpath(agents=4, model="gpt-5"),
        lambda: kvroute.simulate_dualpath(agents=4, snic_gbps=-400.0),
        lambda: kvroute.simulate_dualpath(trace="/nonexistent.jsonl"),
        lambda: kvroute.simulate_prfaas(h20_slowdown=float("nan")),
    ],
)
def test_bad_input_raises_a_kvroute_error(call) -> None:
    with pytest.raises(kvroute.KvrouteError):
        call()


def test_ctrl_c_interrupts_a_long_simulation() -> None:
    """SIGINT half a second into a simulation of many seconds raises KeyboardInterrupt
    within a fraction of a second (the wait checks signals every 50 ms)."""
    import signal
    import subprocess
    import sys
    import time

    child = (
        "import sys, time, kvroute\n"
        "print('started', flush=True)\n"
        "try:\n"
        "    kvroute.simulate_prfaas(requests=250_000)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    time.sleep(0.5)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    line = proc.stdout.readline().strip()
    took = time.perf_counter() - sent
    assert proc.wait(timeout=60) == 0 and line == "interrupted"
    assert took < 2.0, f"KeyboardInterrupt {took:.2f} s after SIGINT"
