"""The cost model: presets, predict, decide, PrfaaS and Helix planning, each report with the
fields of the command line's ``--json`` (compared field by field with the binary's output
where ``target/debug/kvroute`` or ``target/release/kvroute`` is built)."""

from __future__ import annotations

import json
import subprocess

import pytest

import kvroute
from conftest import REPO


def cli_json(*args: str):
    """The ``kvroute`` binary's ``--json`` output, or skip if it is not built."""
    for profile in ("debug", "release"):
        binary = REPO / "target" / profile / "kvroute"
        if binary.exists():
            out = subprocess.run([str(binary), "--json", *args], capture_output=True, text=True, check=True)
            return json.loads(out.stdout)
    pytest.skip("the kvroute binary is not built (cargo build -p kvroute)")


def test_presets_list_models_and_fabrics() -> None:
    p = kvroute.presets()
    ids = [m.id for m in p.models]
    assert "deepseek-v3.2" in ids and "deepseek-v2-lite" in ids
    assert "h100-ibgda" in [f.id for f in p.fabrics]


def test_the_readme_request_routes() -> None:
    r = kvroute.predict(128, 65536, model="deepseek-v3.2", fabric="h100-ibgda", topk=2048, holders=4)
    assert r.decision.choice == "route"
    assert r.model == "deepseek-v3.2" and r.fabric == "h100-ibgda"
    d = kvroute.decide(128, 65536, model="deepseek-v3.2", topk=2048, holders=4)
    assert d == r.decision


def test_only_limits_the_choice() -> None:
    d = kvroute.decide(128, 65536, model="deepseek-v3.2", topk=2048, holders=4, only=["fetch", "local"])
    assert d.choice in ("fetch", "local")


def test_measured_fabric_is_reported_as_measured() -> None:
    r = kvroute.predict(256, 2048, probe_us=4.2, bw_gbps=31.0)
    assert r.fabric == "measured"


def test_predict_has_the_fields_of_the_cli_json() -> None:
    ours = kvroute.predict(256, 2048, model="deepseek-v2-lite", fabric="h100-ibgda").to_dict()
    theirs = cli_json("predict", "--model", "deepseek-v2-lite", "--fabric", "h100-ibgda", "--mq", "256", "--ct", "2048")
    assert ours == theirs


def test_plans_have_the_fields_of_the_cli_json() -> None:
    helix = kvroute.plan_helix(kvp=16, hopb_requests=8, hopb_attention=2.0, hopb_comm=1.2)
    assert helix.total_us > 0 and helix.hopb is not None
    assert helix.to_dict() == cli_json(
        "plan", "helix", "--kvp", "16", "--hopb-requests", "8", "--hopb-attention", "2", "--hopb-comm", "1.2"
    )
    prfaas = kvroute.plan_prfaas(grid=64)
    assert prfaas.point.lambda_max > 0
    assert prfaas.to_dict() == cli_json("plan", "prfaas", "--grid", "64")


@pytest.mark.parametrize(
    "call",
    [
        lambda: kvroute.predict(256, 2048, model="no-such-model"),
        lambda: kvroute.predict(256, 2048, fabric="no-such-fabric"),
        lambda: kvroute.predict(256, 2048, probe_us=float("nan"), bw_gbps=1.0),
        lambda: kvroute.predict(256, 2048, probe_us=4.2),
        lambda: kvroute.predict(256, 2048, only=["teleport"]),
        lambda: kvroute.plan_prfaas(decode_tps=-1.0),
        lambda: kvroute.plan_prfaas(threshold=1000.0),
        lambda: kvroute.plan_helix(hopb_requests=8),
        lambda: kvroute.plan_prfaas(profile="{not json"),
    ],
)
def test_bad_input_raises_a_kvroute_error(call) -> None:
    with pytest.raises(kvroute.KvrouteError):
        call()


def test_unknown_presets_are_not_found_errors() -> None:
    with pytest.raises(kvroute.NotFoundError):
        kvroute.predict(1, 1, model="nope")
    with pytest.raises(ValueError):
        kvroute.predict(1, 1, only=["nope"])
