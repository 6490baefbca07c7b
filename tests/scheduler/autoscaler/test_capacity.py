"""A replica's capacity: planned (measured on the simulated replica, or a tidal plan file) and
learned online from what the pool's replicas sustained within the SLO."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tidal.clock import ManualClock
from tidal.fleet import AutoscalerSpec, FleetConfig, parse_fleet
from tidal.replicas.sim.capacity import CapacityError, Slo
from tidal.scheduler.autoscaler import (
    Autoscaler,
    GaugeActuator,
    OnlineCapacity,
    StaticCapacity,
    known_plan,
    make_policy,
    plan_capacity,
)
from tidal.scheduler.autoscaler.capacity import read_plan_file
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.signals import PoolLoad

pytestmark = pytest.mark.anyio

SLO = Slo(ttft_p95_s=1.0, tpot_p95_s=0.05)


def fleet(autoscale: dict[str, Any], classes: dict[str, Any] | None = None) -> FleetConfig:
    data: dict[str, Any] = {
        "models": [{"name": "m"}],
        "pools": {
            "chat": {
                "kind": "interactive",
                "model": "m",
                "replicas": [
                    {
                        "name": "r0",
                        "url": "http://127.0.0.1:9001",
                        "launch": {"kind": "sim", "preset": "llama-3.1-70b-fp8-h200-tp4"},
                    }
                ],
                "autoscale": autoscale,
            }
        },
    }
    if classes is not None:
        data["classes"] = classes
    return parse_fleet(data)


# -- planned ----------------------------------------------------------------------------------


def test_a_plan_is_measured_on_the_pools_simulated_replica_and_cached(tmp_path: Path) -> None:
    # Given a pool planned on its launch preset at short chat requests, with its class's SLO
    f = fleet(
        {
            "capacity_from": "plan",
            "plan": {"prompt_tokens": [900, 1100], "output_tokens": [150, 250]},
        },
        classes={"interactive": {"ttft_slo_s": 1.0, "tpot_slo_s": 0.05}},
    )
    pool = f.pools["chat"]
    cache = tmp_path / "plans.json"
    # When nothing is cached yet, there is no plan without measuring
    assert known_plan(f, pool, cache_path=cache) is None
    plan = plan_capacity(f, pool, cache_path=cache)
    # Then one 70B TP4 replica carries a few to a few tens of requests/s at the SLO
    assert 3.0 < plan.rps < 40.0 and plan.slo == SLO and not plan.cached
    assert "llama-3.1-70b-fp8-h200-tp4 replayed in virtual time as tidal plan does" in plan.source
    # And the next start reads it back without measuring
    again = known_plan(f, pool, cache_path=cache)
    assert again is not None and again.cached and again.rps == plan.rps
    # A different SLO is another plan
    tighter = fleet(
        {
            "capacity_from": "plan",
            "plan": {
                "prompt_tokens": [900, 1100],
                "output_tokens": [150, 250],
                "tpot_p95_s": 0.03,
            },
        }
    )
    assert known_plan(tighter, tighter.pools["chat"], cache_path=cache) is None


def test_an_unknown_preset_is_refused_before_anything_is_measured() -> None:
    f = fleet({"capacity_from": "plan", "plan": {"preset": "gpt-9-on-abacus"}})
    with pytest.raises(CapacityError, match="unknown preset 'gpt-9-on-abacus'"):
        known_plan(f, f.pools["chat"])


def plan_json(options: list[dict[str, Any]]) -> dict[str, Any]:
    return {"kv_bytes_per_token": 327680, "kv_tokens_in_500_gb": 1600000, "options": options}


@pytest.mark.parametrize(
    ("content", "tp", "expected"),
    [
        (plan_json([{"tp": 4, "requests_per_s_at_slo": 9.5}]), None, 9.5),
        (plan_json([{"tp": 4, "requests_per_s_at_slo": 9.5}, {"tp": 8, "requests_per_s_at_slo": 21}]), 8, 21.0),
        (plan_json([{"tp": 4, "requests_per_s_at_slo": 9.5}, {"tp": 8, "requests_per_s_at_slo": 21}]), None,
         "2 options (tp 4, 8); pick one with plan.tp"),
        (plan_json([{"tp": 4, "requests_per_s_at_slo": 9.5}]), 8, "no option with tp 8 (options: tp 4)"),
        (plan_json([{"tp": 4, "requests_per_s_at_slo": -1}]), None, "requests_per_s_at_slo must be a positive number"),
        (plan_json([{"tp": 4, "requests_per_s_at_slo": "fast"}]), None, "must be a positive number, got 'fast'"),
        ({"options": []}, None, "not a tidal plan --json output"),
        ([1, 2], None, "not a tidal plan --json output"),
        ("{not json", None, "not JSON"),
    ],
)  # fmt: skip
def test_a_tidal_plan_file_gives_one_options_capacity(
    tmp_path: Path, content: Any, tp: int | None, expected: float | str
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    if isinstance(expected, float):
        rps, source = read_plan_file(path, tp)
        assert rps == expected and str(path) in source
    else:
        with pytest.raises(CapacityError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            read_plan_file(path, tp)


def test_a_pool_planned_from_a_file_needs_no_measuring(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_json([{"tp": 8, "requests_per_s_at_slo": 21.5}])))
    f = fleet({"capacity_from": "plan", "plan": {"file": str(path)}})
    plan = known_plan(f, f.pools["chat"])
    assert plan is not None and plan.rps == 21.5 and "tp 8" in plan.source
    with pytest.raises(CapacityError, match="cannot read the plan"):
        g = fleet({"capacity_from": "plan", "plan": {"file": str(tmp_path / "missing.json")}})
        known_plan(g, g.pools["chat"])


# -- learned ----------------------------------------------------------------------------------


def load(rps: float, replicas: int = 4, ttft: float = 0.3, tpot: float = 0.02, wait: float = 0.0) -> PoolLoad:
    return PoolLoad(
        requests_per_s=rps,
        replicas_healthy=replicas,
        replicas_serving=replicas,
        ttft_p95_s=ttft,
        tpot_p95_s=tpot,
        queue_wait_p95_s=wait,
    )


def learner(prior: float = 10.0, confirm: int = 4) -> OnlineCapacity:
    return OnlineCapacity(StaticCapacity({"chat": prior}), {"chat": SLO}, confirm=confirm)


@pytest.mark.parametrize(
    ("samples", "lent", "expected"),
    [
        # Four replicas carry 60 rps (15 each) within the SLO for a minute: capacity is at least 15
        ([load(60)] * 4, False, 15.0),
        # ... but not for long enough
        ([load(60)] * 3, False, 10.0),
        # The least of the window counts
        ([load(60), load(48), load(60), load(56)], False, 12.0),
        # One breach in the window: no evidence either way
        ([load(60), load(60, tpot=0.08), load(60), load(60)], False, 10.0),
        # They breach TPOT at 8 rps per replica for a minute: capacity falls to the most of them
        ([load(32, tpot=0.08), load(30, tpot=0.07), load(28, ttft=2.0), load(32, wait=1.0)], False, 8.0),
        # Breaching above the estimate says nothing new
        ([load(48, tpot=0.08)] * 4, False, 10.0),
        # Lent to batch: batch sequences share the steps, so nothing is learned
        ([load(32, tpot=0.08)] * 4, True, 10.0),
        # Bounded: never below a quarter of the prior, never above four times it
        ([load(2, tpot=0.08)] * 4, False, 2.5),
        ([load(400)] * 4, False, 40.0),
        # Idle pools say nothing
        ([load(0)] * 4, False, 10.0),
    ],
)
def test_capacity_is_learned_from_what_the_replicas_sustained(
    samples: list[PoolLoad], lent: bool, expected: float
) -> None:
    c = learner()
    for s in samples:
        c.observe("chat", s, ready=4, lent_to_batch=lent)
    assert c.capacity_rps("chat") == pytest.approx(expected)


def test_a_learned_capacity_needs_fresh_evidence_to_move_again_and_survives_a_restart() -> None:
    c = learner()
    for _ in range(4):
        c.observe("chat", load(60), ready=4, lent_to_batch=False)
    assert c.capacity_rps("chat") == 15.0
    for _ in range(3):
        c.observe("chat", load(72), ready=4, lent_to_batch=False)
    assert c.capacity_rps("chat") == 15.0  # the window restarted after the move
    c.observe("chat", load(72), ready=4, lent_to_batch=False)
    assert c.capacity_rps("chat") == 18.0
    # A pool that does not learn keeps its prior
    other = OnlineCapacity(StaticCapacity({"chat": 10.0, "batch": 3.0}), {"chat": SLO}, learned=c.learned())
    assert other.capacity_rps("batch") == 3.0 and other.capacity_rps("chat") == 18.0


async def test_the_autoscaler_sizes_the_pool_with_what_it_learned() -> None:
    # Given a pool of 4 replicas believed to carry 10 rps each, that carries 15 within the SLO
    clock = ManualClock(1000.0)
    spec = AutoscalerSpec(min_replicas=1, max_replicas=50, warm_buffer=0.0, capacity_rps_per_replica=10.0)
    capacity = learner()
    metrics = SchedulerMetrics()
    scaler = Autoscaler(
        "chat",
        spec,
        make_policy("reactive"),
        capacity=capacity,
        actuator=GaugeActuator(),
        clock=clock,
        metrics=metrics,
    )
    steps = []
    for _ in range(4):
        steps.append(await scaler.step(clock.now(), load(60)))
        clock.advance(15)
    # Then it first asks for 6 replicas (60 / 10), and once it learned 15 rps per replica, 4
    assert steps[0].desired == 6 and steps[-1].desired == 4
    assert metrics.capacity_rps.labels("chat")._value.get() == 15.0
