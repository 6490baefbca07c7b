"""The plan's arithmetic (reserved replicas, break-even) and a whole plan on a small workload."""

from __future__ import annotations

import pytest

from tests.scheduler.plan.workloads import write_profile
from tidal.replicas.sim.capacity import Slo
from tidal.scheduler.plan.catalog import load_catalog, load_prices
from tidal.scheduler.plan.planner import PlanRequest, break_even, make_plan, reserved_count, week_plan
from tidal.scheduler.plan.workload import load_workload


@pytest.mark.parametrize(
    ("hours", "ratio", "reserved"),
    [
        ([2] * 168, 0.5, 2),  # always needed: reserve all
        ([1] * 84 + [3] * 84, 0.5, 3),  # the 3rd is needed half the time, reserving costs half: reserve
        ([1] * 84 + [3] * 84, 0.6, 1),  # at 0.6 the 2nd and 3rd cost more reserved than on demand
        ([1] * 160 + [4] * 8, 0.5, 1),  # a short peak is on demand
    ],
)
def test_reserve_a_replica_when_it_is_needed_often_enough(
    hours: list[int], ratio: float, reserved: int
) -> None:
    assert reserved_count(hours, ratio, 1.0) == reserved


def test_a_week_splits_into_reserved_on_demand_and_spot() -> None:
    prices, _ = load_prices()
    # 100 req/s for 84 hours, 20 the rest; 10 req/s per replica; 2 GPUs a replica
    rates = [100.0] * 84 + [20.0] * 84
    week = week_plan(
        rates,
        10.0,
        tp=2,
        warm_buffer=0.1,
        tokens_per_request=1000,
        prices=prices,
        gpu="h200",
        batch_tokens_per_day=3600 * 24 * 1000.0,
        batch_tokens_per_s=2000.0,
    )
    assert set(week.replicas_per_hour) == {11, 3}  # ceil(100 x 1.1 / 10), ceil(20 x 1.1 / 10)
    p = prices.gpu("h200")
    # the 4th..11th replicas are needed half the week: reserved when that beats on demand
    assert week.reserved_replicas == (11 if p.reserved / p.on_demand <= 0.5 else 3)
    assert week.on_demand_replica_hours == sum(
        max(0, n - week.reserved_replicas) for n in week.replicas_per_hour
    )
    # batch: 7 x 86.4 M tokens; the idle reserved replicas absorb what they can, spot the rest
    idle = sum(max(0, week.reserved_replicas - n) for n in week.replicas_per_hour)
    assert week.spot_replica_hours == pytest.approx(max(0.0, 7 * 86.4e6 - idle * 3600 * 2000) / (3600 * 2000))
    assert week.gpu_hours == pytest.approx(
        2 * (week.reserved_replicas * 168 + week.on_demand_replica_hours + week.spot_replica_hours)
    )
    assert week.tokens_per_week == pytest.approx(sum(r * 3600 * 1000 for r in rates) + 7 * 86.4e6)


def test_break_even_utilisation() -> None:
    # a 4-GPU replica at 2 $/GPU-hour serving 2 req/s; the API charges 0.001 $ a request
    assert break_even(2.0, 4, 2.0, 0.001) == pytest.approx(8.0 / (3600 * 2 * 0.001))
    assert break_even(2.0, 4, 2.0, 0.0) is None


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    path = write_profile(tmp_path_factory.mktemp("plan"), duration_s=150)
    req = PlanRequest(
        model="llama-3.1-8b",
        gpu="h100",
        workload=load_workload(profile=path),
        catalog=load_catalog(),
        prices=load_prices()[0],
        tps=[1, 2],
        context_caps={"rag": 16384},
        peak_rps=30.0,
        slo=Slo(1.0, 0.05),
        long_context_threshold=8192,
        batch_tokens_per_day=1e8,
        quick=True,
    )
    return make_plan(req).as_dict()


def test_a_plan_measures_sizes_predicts_and_checks_each_option(small_plan: dict[str, object]) -> None:
    d = small_plan
    assert d["kv_bytes_per_token"] == 131_072
    options = d["options"]
    assert isinstance(options, list) and [o["tp"] for o in options] == [1, 2]
    for o in options:
        # the contract's fields
        for key in (
            "tp",
            "replicas_per_node",
            "kv_tokens_per_replica",
            "batch_cap_at_slo",
            "requests_per_s_at_slo",
            "predicted_ttft_p95_s",
            "predicted_tpot_p95_s",
            "replay_ttft_p95_s",
            "replay_tpot_p95_s",
            "cost_per_million_tokens",
            "break_even_utilisation",
        ):
            assert o[key] is not None, key
        assert o["replicas_per_node"] == 8 // o["tp"]
        # the capacity is measured: its replay at that rate is within the SLO, a faster one is not
        replays = o["capacity_measurement"]["replays"]
        at = [r for r in replays if r["rate_rps"] == o["requests_per_s_at_slo"]][0]
        assert at["within_slo"] and at["ttft_p95_s"] <= 1.0 and at["tpot_p95_s"] <= 0.05
        assert any(not r["within_slo"] and r["rate_rps"] > at["rate_rps"] for r in replays)
        # the recommended size carries the peak with the warm buffer, and the prediction holds
        assert o["recommended_replicas"] * o["requests_per_s_at_slo"] >= 30.0 * 1.12
        assert o["predicted_ttft_p95_s"] == pytest.approx(o["replay_ttft_p95_s"], rel=0.10)
        assert o["predicted_tpot_p95_s"] == pytest.approx(o["replay_tpot_p95_s"], rel=0.10)
        assert o["replay_ttft_p95_s"] <= 1.0 and o["replay_tpot_p95_s"] <= 0.05
        week = o["week"]
        assert len(week["replicas_per_hour"]) == 168 and week["peak_replicas"] == o["recommended_replicas"]
        assert week["reserved_replicas"] >= min(week["replicas_per_hour"])
    # TP=2 against 2 x TP=1, and the effects of FP8 and of the cap
    tc = d["tp_comparison"]
    assert tc["one_big"]["share_of_node_lost_when_one_gpu_fails"] == 1.0
    assert tc["several_small"]["share_of_node_lost_when_one_gpu_fails"] == 0.5
    rows = {r["name"]: r for r in d["effects"]["rows"]}
    base = next(o for o in options if o["tp"] == d["effects"]["base_tp"])
    assert rows["kv fp8"]["kv_tokens_per_replica"] > 1.9 * base["kv_tokens_per_replica"]
    assert rows["weights fp8"]["kv_tokens_per_replica"] > base["kv_tokens_per_replica"]
    assert rows["weights fp8"]["requests_per_s_at_slo"] > base["requests_per_s_at_slo"]
    # without the cap, rag's 48k-token prompts miss the TTFT target far more often
    assert rows["without cap rag<=16384"]["requests_per_s_at_slo"] < base["requests_per_s_at_slo"]
    lc = d["long_context_pool"]
    assert 0.05 < lc["share_of_requests"] < 0.3 and lc["replicas_at_peak"] >= 1
    assert any("EXAMPLE" in n for n in d["notes"])
