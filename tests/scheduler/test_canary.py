"""The canary controller: shares by weight, error-rate and eval comparisons, promote or roll back.

Scenarios on a ManualClock; the registry, the load source and the eval runner are in-memory
stand-ins that behave like the gateway and the batch tier's eval job.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tidal.clock import ManualClock
from tidal.scheduler.canary import (
    CanaryController,
    CanarySpec,
    CanaryState,
    _Delta,
    error_rate_worse,
    group_weights,
)
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.signals import GroupLoad, LoadReport, ReplicaView

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("share", "n_c", "n_b", "expect_share"),
    [
        (0.05, 1, 4, 0.05),
        (0.25, 2, 6, 0.25),
        (0.5, 1, 3, 0.5),
        (0.01, 3, 1, 0.01),
        (0.0, 1, 1, 0.0),
        (1.0, 1, 1, 1.0),
    ],
)
def test_group_weights_give_the_canary_its_share(
    share: float, n_c: int, n_b: int, expect_share: float
) -> None:
    w_c, w_b = group_weights(share, n_c, n_b)
    assert n_c * w_c / (n_c * w_c + n_b * w_b) == pytest.approx(expect_share)
    assert 0 <= w_c <= 1000 and 0 <= w_b <= 1000


def test_extreme_shares_stay_within_the_weight_bounds() -> None:
    w_c, w_b = group_weights(0.999999, 1, 1000)
    assert w_c <= 1000 and 1 * w_c / (w_c + 1000 * w_b) == pytest.approx(0.999999)


@pytest.mark.parametrize(
    ("c_err", "c_req", "b_err", "b_req", "worse"),
    [
        (1, 100, 10, 1000, False),  # same rate
        (2, 100, 10, 1000, False),  # +1 point: within the tolerance
        (10, 100, 10, 1000, True),  # 10% vs 1%: significant and material
        (2, 30, 10, 200, False),  # 6.7% of 30 vs 5%: material but not significant
        (60, 1000, 400, 10000, True),
        (5, 100, 0, 0, True),  # no baseline traffic at all: the tolerance alone decides
        (0, 0, 10, 1000, False),
    ],
)
def test_error_rate_comparison(c_err: int, c_req: int, b_err: int, b_req: int, worse: bool) -> None:
    got, detail = error_rate_worse(c_err, c_req, b_err, b_req, max_increase=0.01, z_crit=2.33)
    assert got is worse, detail


class Gateway:
    """Registry + load source: canary/stable replicas, group counters the test moves forward."""

    def __init__(self, n_canary: int = 1, n_stable: int = 3) -> None:
        self.views = {
            f"c{i}": ReplicaView(f"c{i}", f"http://127.0.0.1:1/c{i}", "interactive", "canary")
            for i in range(n_canary)
        }
        self.views |= {
            f"s{i}": ReplicaView(f"s{i}", f"http://127.0.0.1:1/s{i}", "interactive", "stable")
            for i in range(n_stable)
        }
        self.views["other"] = ReplicaView("other", "http://127.0.0.1:1/o", "batch", "canary")
        self.counts = {"canary": [0.0, 0.0], "stable": [0.0, 0.0]}

    def traffic(self, canary: tuple[int, int], stable: tuple[int, int]) -> None:
        for g, (req, err) in (("canary", canary), ("stable", stable)):
            self.counts[g][0] += req
            self.counts[g][1] += err

    def share(self) -> float:
        pool = [v for v in self.views.values() if v.pool == "interactive"]
        total = sum(v.weight for v in pool)
        return sum(v.weight for v in pool if v.group == "canary") / total

    async def load(self) -> LoadReport:
        return LoadReport(
            0.0, {}, {g: GroupLoad(r, e, e / r if r else 0.0) for g, (r, e) in self.counts.items()}
        )

    async def replicas(self) -> list[ReplicaView]:
        return list(self.views.values())

    async def register(self, *a: Any, **k: Any) -> None:
        raise AssertionError

    async def update(self, name: str, *, weight: float | None = None, **_: Any) -> None:
        v = self.views[name]
        assert weight is not None
        self.views[name] = ReplicaView(v.name, v.url, v.pool, v.group, weight)

    async def deregister(self, name: str) -> None:
        raise AssertionError("the old group stays up")


class Evals:
    def __init__(self, stable: float, canary: float, fail: bool = False) -> None:
        self.scores = {"stable": stable, "canary": canary}
        self.fail = fail
        self.asked: list[tuple[str, str]] = []

    async def score(self, pool: str, group: str) -> float:
        self.asked.append((pool, group))
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeError("eval job failed: no answer key")
        return self.scores[group]


SPEC = CanarySpec(steps=(0.05, 0.25, 0.5), step_s=60.0, min_requests=50)


def controller(gw: Gateway, clock: ManualClock, evals: Evals | None) -> CanaryController:
    return CanaryController(
        gw,
        gw,
        pool="interactive",
        clock=clock,
        spec=SPEC,
        evals=evals,
        metrics=SchedulerMetrics(),
        interval_s=5.0,
    )


async def rounds(
    ctl: CanaryController, gw: Gateway, clock: ManualClock, n: int, canary: tuple[int, int]
) -> list[float]:
    shares = []
    for _ in range(n):
        gw.traffic(canary, (canary[0] * 10, canary[0] // 10))
        clock.advance(5.0)
        for _ in range(5):  # let the eval task run, as network waits would
            await asyncio.sleep(0)
        await ctl.step()
        shares.append(round(gw.share(), 4))
    return shares


async def test_a_good_build_is_ramped_step_by_step_and_promoted() -> None:
    # Given a canary with the baseline's error rate and the same eval score
    clock, gw, evals = ManualClock(), Gateway(), Evals(stable=0.81, canary=0.82)
    ctl = controller(gw, clock, evals)
    await ctl.start()
    assert gw.share() == pytest.approx(0.05)
    # When 40 rounds of 5 s pass with 10 canary requests per round, 1% errors on both sides
    shares = await rounds(ctl, gw, clock, 40, (10, 0))
    # Then each share lasted a step (60 s, 50+ requests) and the canary was promoted
    assert ctl.state is CanaryState.PROMOTED, ctl.reason
    assert sorted(set(shares)) == [0.05, 0.25, 0.5, 1.0]
    assert shares.index(0.25) == 11 and shares.index(0.5) == 23 and shares.index(1.0) == 35
    assert {v.weight for v in gw.views.values() if v.group == "stable" and v.pool == "interactive"} == {0.0}
    assert sorted(evals.asked) == [("interactive", "canary"), ("interactive", "stable")]
    assert gw.views["other"].weight == 1.0  # another pool's canary group is not touched
    assert (
        ctl.metrics.registry.get_sample_value(
            "tidal_canary_outcomes_total", {"group": "canary", "outcome": "promoted", "reason": "passed"}
        )
        == 1
    )


async def test_a_build_that_errors_more_is_rolled_back_at_once() -> None:
    clock, gw = ManualClock(), Gateway()
    ctl = controller(gw, clock, Evals(0.8, 0.8))
    await ctl.start()
    # When the canary fails 30% of its requests
    shares = await rounds(ctl, gw, clock, 4, (10, 3))
    # Then it is rolled back as soon as there is enough evidence, back to the baseline
    assert ctl.state is CanaryState.ROLLED_BACK and ctl.reason.startswith("error_rate")
    assert shares[-1] == 0.0 and shares.count(0.0) >= 1
    assert {v.weight for v in gw.views.values() if v.group == "stable"} == {1.0}


async def test_a_build_that_scores_worse_on_the_eval_is_rolled_back() -> None:
    clock, gw = ManualClock(), Gateway()
    ctl = controller(gw, clock, Evals(stable=0.80, canary=0.55))
    await ctl.start()
    await rounds(ctl, gw, clock, 2, (10, 0))
    assert ctl.state is CanaryState.ROLLED_BACK and ctl.reason.startswith("eval_score")
    assert gw.share() == 0.0


async def test_an_eval_that_cannot_run_is_not_a_pass() -> None:
    clock, gw = ManualClock(), Gateway()
    ctl = controller(gw, clock, Evals(0.8, 0.8, fail=True))
    await ctl.start()
    await rounds(ctl, gw, clock, 2, (10, 0))
    assert ctl.state is CanaryState.ROLLED_BACK and ctl.reason.startswith("eval_failed")


async def test_promotion_waits_for_the_eval() -> None:
    clock, gw = ManualClock(), Gateway()
    gate = asyncio.Event()

    class SlowEvals(Evals):
        async def score(self, pool: str, group: str) -> float:
            await gate.wait()
            return 0.9

    ctl = controller(gw, clock, SlowEvals(0.9, 0.9))
    await ctl.start()
    shares = await rounds(ctl, gw, clock, 60, (10, 0))
    assert ctl.state is CanaryState.RAMPING and shares[-1] == 0.5
    gate.set()
    await rounds(ctl, gw, clock, 2, (10, 0))
    assert ctl.state is CanaryState.PROMOTED


async def test_a_gateway_restart_that_resets_the_counters_does_not_confuse_the_comparison() -> None:
    clock, gw = ManualClock(), Gateway()
    ctl = CanaryController(
        gw,
        gw,
        pool="interactive",
        clock=clock,
        spec=CanarySpec(steps=(0.1,), step_s=10, min_requests=10, require_eval=False),
    )
    gw.traffic((1000, 500), (1000, 0))  # before the rollout: not the canary's fault
    await ctl.start()
    gw.traffic((20, 0), (200, 2))
    await ctl.step()
    gw.counts = {"canary": [5.0, 0.0], "stable": [50.0, 0.0]}  # the gateway restarted
    clock.advance(10.0)
    await ctl.step()
    assert ctl.state is CanaryState.PROMOTED, ctl.reason


async def test_a_rollout_needs_both_groups_and_an_eval_runner_unless_told_otherwise() -> None:
    clock = ManualClock()
    with pytest.raises(ValueError, match="eval"):
        CanaryController(Gateway(), Gateway(), pool="interactive", clock=clock)
    ctl = controller(Gateway(n_canary=0), clock, Evals(1, 1))
    with pytest.raises(ValueError, match="both groups"):
        await ctl.start()
    with pytest.raises(ValueError):
        CanarySpec(steps=(0.5, 0.1))


def test_a_counters_growth_survives_a_restart_and_readings_out_of_order() -> None:
    delta = _Delta()
    for value in (100, 130, 128, 131, 160):  # 128: a reading one sync older than 130's
        delta.update(value)
    assert delta.total == 60
    delta.update(4)  # the gateway restarted: counted from zero again
    delta.update(10)
    assert delta.total == 70
