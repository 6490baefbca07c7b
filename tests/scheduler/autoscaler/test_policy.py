"""Decision plugins, table-driven: the same inputs, what each policy answers."""

from __future__ import annotations

from typing import Any

import pytest

from tidal.fleet import AutoscalerSpec
from tidal.scheduler.autoscaler.policy import POLICIES, ReactivePolicy, ScaleInput, TidalPolicy, make_policy
from tidal.scheduler.signals import PoolLoad

SPEC = AutoscalerSpec(
    min_replicas=1,
    max_replicas=100,
    capacity_rps_per_replica=2.0,
    warm_buffer=0.12,
    cold_start_s=180,
    scale_down_stabilisation_s=900,
    decision_interval_s=15,
)


def inp(
    rps: float,
    *,
    ready: int = 4,
    starting: int = 0,
    ttft: float = 0.2,
    wait: float = 0.0,
    kv: float = 0.3,
    soon: float | None = None,
    later: float | None = None,
) -> ScaleInput:
    # soon: the forecast over the cold start; later: the forecast over the trough horizon
    def forecast(start: float, end: float) -> float | None:
        return soon if end - start <= 195 else later

    load = PoolLoad(requests_per_s=rps, ttft_p95_s=ttft, queue_wait_p95_s=wait, kv_cache_usage_max=kv)
    return ScaleInput("interactive", 0.0, SPEC, ready, starting, load, 2.0, forecast)


@pytest.mark.parametrize(
    ("case", "expect", "trough"),
    [
        (inp(10.0), 5, True),
        (inp(10.1), 6, True),
        (inp(0.0), 0, True),
        (inp(4.0, ready=8, ttft=1.5), 10, False),  # breach: +25% of ready
        (inp(4.0, ready=8, wait=0.9), 10, False),
        (inp(4.0, ready=8, kv=0.95), 10, False),
        (inp(4.0, ready=8, starting=2, ttft=1.5), 10, False),  # a step in flight is not compounded
        (inp(40.0, ready=8, ttft=1.5), 20, False),  # the demand is larger than the step
        (inp(4.0, ready=0, ttft=1.5), 2, False),
        (inp(10.0, soon=100.0), 5, True),  # blind to the forecast
    ],
)
def test_reactive(case: ScaleInput, expect: int, trough: bool) -> None:
    d = ReactivePolicy().decide(case)
    assert (d.replicas, d.trough) == (expect, trough), d.reason


@pytest.mark.parametrize(
    ("case", "expect", "trough"),
    [
        (inp(10.0), 6, True),  # 10 * 1.12 / 2 = 5.6 -> 6, no forecast known
        (inp(10.0, soon=20.0, later=20.0), 12, True),  # 20 * 1.12 / 2 = 11.2 -> 12
        (inp(30.0, soon=20.0, later=20.0), 17, True),  # the observed load beats a low forecast
        (inp(10.0, soon=10.0, later=40.0), 6, False),  # the evening peak is coming: not a trough
        (inp(4.0, ready=8, soon=4.0, later=4.0, ttft=1.5), 10, False),
    ],
)
def test_tidal(case: ScaleInput, expect: int, trough: bool) -> None:
    d = TidalPolicy().decide(case)
    assert (d.replicas, d.trough) == (expect, trough), d.reason


def test_tidal_parameters_override_the_pool_defaults() -> None:
    d = TidalPolicy.from_config({"warm_buffer": 0.5}).decide(inp(10.0))
    assert d.replicas == 8


def test_the_registry_builds_policies_strictly() -> None:
    assert set(POLICIES) == {"reactive", "tidal"}
    assert make_policy("reactive", {"target_ttft_p95_s": 2.0}).type_name == "reactive"
    bad: list[tuple[str, dict[str, Any], str]] = [
        ("magic", {}, "unknown autoscaler policy 'magic'"),
        ("tidal", {"lookahead": 10}, "lookahead"),
        ("reactive", {"breach_step": -1}, "breach_step"),
    ]
    for name, params, message in bad:
        with pytest.raises(ValueError, match=message):
            make_policy(name, params)


def test_kv_usage_is_no_breach_while_the_pool_is_lent_to_batch() -> None:
    # Batch sequences fill the KV cache at low priority; only the users' own signals count then.
    from dataclasses import replace

    case = inp(4.0, ready=8, kv=0.95)
    for policy in (ReactivePolicy(), TidalPolicy()):
        assert policy.decide(case).replicas == 10
        lent = policy.decide(replace(case, lent_to_batch=True))
        assert lent.replicas < 10 and lent.trough
        assert (
            policy.decide(replace(case, lent_to_batch=True, load=PoolLoad(4.0, ttft_p95_s=3.0))).replicas
            >= 10
        )


def test_tpot_is_a_breach_once_a_target_is_set() -> None:
    from dataclasses import replace

    case = inp(4.0, ready=8)
    slow = replace(case, load=replace(case.load, tpot_p95_s=0.08)) if case.load else case
    for name in ("reactive", "tidal"):
        assert make_policy(name).decide(slow).replicas < 10  # no target: not a breach
        d = make_policy(name, {"target_tpot_p95_s": 0.05}).decide(slow)
        assert d.replicas == 10 and not d.trough and "TPOT p95 80ms > 50ms" in d.reason
