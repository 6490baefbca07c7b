"""The autoscaler's machinery: fast up, slow down only in troughs, bounds, actuator failures.

Time is a ManualClock; the actuator is an in-memory pool whose replicas become ready after a cold
start (the actuators themselves are tested against real processes and a real HTTP API).
"""

from __future__ import annotations

import asyncio

import pytest

from tidal.clock import ManualClock
from tidal.fleet import AutoscalerSpec
from tidal.scheduler.autoscaler import (
    Autoscaler,
    AutoscalerLoop,
    Forecaster,
    GaugeActuator,
    HourOfWeekProfile,
    PoolReplicas,
    StaticCapacity,
    make_policy,
)
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.signals import LoadReport, PoolLoad

pytestmark = pytest.mark.anyio

SPEC = AutoscalerSpec(
    min_replicas=2,
    max_replicas=20,
    capacity_rps_per_replica=1.0,
    warm_buffer=0.0,
    cold_start_s=180,
    scale_down_stabilisation_s=600,
    decision_interval_s=15,
)


class ColdStartPool:
    """Replicas asked for become ready ``cold_start_s`` later; removals are immediate."""

    name = "memory"

    def __init__(self, clock: ManualClock, ready: int, cold_start_s: float = 180.0) -> None:
        self.clock = clock
        self.ready = ready
        self.pending: list[float] = []
        self.cold_start_s = cold_start_s
        self.calls: list[int] = []
        self.fail = False

    def _settle(self) -> None:
        now = self.clock.now()
        done = [t for t in self.pending if t <= now]
        self.pending = [t for t in self.pending if t > now]
        self.ready += len(done)

    async def observe(self, pool: str, load: PoolLoad | None) -> PoolReplicas:
        self._settle()
        return PoolReplicas(self.ready, len(self.pending))

    async def scale(self, pool: str, replicas: int) -> None:
        self.calls.append(replicas)
        if self.fail:
            raise RuntimeError("API server unreachable")
        self._settle()
        diff = replicas - self.ready - len(self.pending)
        if diff > 0:
            self.pending += [self.clock.now() + self.cold_start_s] * diff
        else:
            for _ in range(-diff):
                if self.pending:
                    self.pending.pop()
                else:
                    self.ready -= 1

    async def replace(self, pool: str, replica: str) -> bool:
        return False


def scaler(clock: ManualClock, pool: ColdStartPool, policy: str = "reactive", **kw: object) -> Autoscaler:
    return Autoscaler(
        "interactive",
        SPEC,
        make_policy(policy),
        capacity=StaticCapacity({"interactive": 1.0}),
        actuator=pool,
        clock=clock,
        metrics=SchedulerMetrics(),
        **kw,  # type: ignore[arg-type]
    )


async def test_scale_up_is_immediate_and_cold_starting_replicas_are_not_asked_for_twice() -> None:
    # Given 4 ready replicas at 4 rps
    clock = ManualClock()
    pool = ColdStartPool(clock, ready=4)
    s = scaler(clock, pool)
    await s.step(0.0, PoolLoad(requests_per_s=4.0))
    # When the load jumps to 9 rps
    step = await s.step(15.0, PoolLoad(requests_per_s=9.0))
    # Then 9 are asked for at once, 5 of them cold-starting
    assert (step.target, step.ready) == (9, 4)
    assert pool.pending and (await pool.observe("interactive", None)) == PoolReplicas(4, 5)
    # And while they start, the same answer does not start more
    for _ in range(6):
        clock.advance(15)
        await s.step(clock.now(), PoolLoad(requests_per_s=9.0))
    assert (await pool.observe("interactive", None)).total == 9
    clock.advance(120)
    assert (await pool.observe("interactive", None)) == PoolReplicas(9, 0)


async def test_scale_down_waits_for_the_stabilisation_window() -> None:
    # Given 10 replicas serving 10 rps
    clock = ManualClock()
    pool = ColdStartPool(clock, ready=10)
    s = scaler(clock, pool)
    await s.step(0.0, PoolLoad(requests_per_s=10.0))
    # When the load falls to 3 rps
    targets = []
    for _ in range(50):
        clock.advance(15)
        targets.append((await s.step(clock.now(), PoolLoad(requests_per_s=3.0))).target)
    # Then the pool holds 10 replicas for the 600 s window, then drops to 3
    assert targets[:39] == [10] * 39
    assert targets[40:] == [3] * 10


async def test_the_tidal_policy_does_not_scale_down_before_a_forecast_peak() -> None:
    # Given history saying 3 rps from 00:00 and 10 rps from 01:00 (Thursdays, hour 72 and 73)
    clock = ManualClock(start=2400.0)
    pool = ColdStartPool(clock, ready=10)
    profile = HourOfWeekProfile()
    profile.fit([(t * 60.0, 3.0 if t < 60 else 10.0) for t in range(120)])
    s = scaler(clock, pool, policy="tidal", forecaster=Forecaster(profile), learn=False)
    # When 3 rps are observed from 00:40 to 01:00 with 10 replicas running
    steps = []
    while clock.now() < 3600.0:
        steps.append(await s.step(clock.now(), PoolLoad(requests_per_s=3.0)))
        clock.advance(15)
    # Then the policy wants fewer replicas for a while, but the pool is not in a trough since
    # the forecast over the horizon needs them again: nothing is stopped
    assert any(st.desired < 10 for st in steps)
    assert all(st.target == 10 for st in steps)
    assert all(not st.trough for st in steps if st.at > 3000.0 and st.desired < 10)


async def test_replicas_for_a_burst_above_the_forecast_are_released_sooner_than_the_window() -> None:
    # Given history saying 5 rps all hour (Thursday 00:00, hour 72), and 5 replicas serving it
    clock = ManualClock(start=600.0)
    pool = ColdStartPool(clock, ready=5)
    profile = HourOfWeekProfile()
    profile.fit([(t * 60.0, 5.0) for t in range(60)])
    s = scaler(clock, pool, policy="tidal", forecaster=Forecaster(profile), learn=False)
    await s.step(clock.now(), PoolLoad(requests_per_s=5.0))
    # When a one-minute burst of 9 rps comes and goes
    targets = []
    for t in range(60):
        clock.advance(15)
        rps = 9.0 if t < 4 else 5.0
        targets.append((await s.step(clock.now(), PoolLoad(requests_per_s=rps))).target)
    # Then the pool grows for it at once, and shrinks back to the forecast's 5 once the
    # lookahead (cold start + one decision, 195 s) has passed -- not the 600 s window
    assert targets[0] == 9
    back = targets.index(5)
    assert 3 * 60 <= back * 15 <= 5 * 60 and targets[back:] == [5] * (60 - back)
    # Without a forecast the window holds them, as for the reactive policy
    blind = scaler(clock, ColdStartPool(clock, ready=5), policy="tidal", learn=False)
    await blind.step(clock.now(), PoolLoad(requests_per_s=5.0))
    held = []
    for t in range(30):
        clock.advance(15)
        held.append((await blind.step(clock.now(), PoolLoad(requests_per_s=9.0 if t < 4 else 5.0))).target)
    assert held[:20] == [9] * 20  # for the 600 s window


async def test_bounds_hold_and_the_desired_gauge_follows_the_target() -> None:
    clock = ManualClock()
    pool = ColdStartPool(clock, ready=2)
    s = scaler(clock, pool)
    assert (await s.step(0.0, PoolLoad(requests_per_s=500.0))).target == 20
    assert (
        s.metrics.registry.get_sample_value("tidal_autoscaler_desired_replicas", {"pool": "interactive"})
        == 20
    )
    s2 = scaler(clock, ColdStartPool(clock, ready=2))
    assert (await s2.step(0.0, PoolLoad(requests_per_s=0.0))).target == 2


async def test_an_actuator_failure_is_counted_and_retried_on_the_next_step() -> None:
    clock = ManualClock()
    pool = ColdStartPool(clock, ready=2)
    pool.fail = True
    s = scaler(clock, pool)
    await s.step(0.0, PoolLoad(requests_per_s=6.0))
    labels = {"pool": "interactive", "actuator": "memory"}
    assert s.metrics.registry.get_sample_value("tidal_autoscaler_actuator_errors_total", labels) == 1
    pool.fail = False
    await s.step(15.0, PoolLoad(requests_per_s=6.0))
    assert pool.calls == [6, 6] and (await pool.observe("interactive", None)).total == 6


async def test_an_actuator_that_hangs_counts_as_failed_and_the_loop_goes_on() -> None:
    clock = ManualClock()
    pool = ColdStartPool(clock, ready=2)
    answer = asyncio.Event()
    scale = pool.scale
    calls = 0

    async def hanging(pool_name: str, replicas: int) -> None:
        nonlocal calls
        calls += 1
        await answer.wait()  # accepts the request and answers only when told
        await scale(pool_name, replicas)

    pool.scale = hanging  # type: ignore[method-assign]
    s = scaler(clock, pool, actuator_timeout_s=0.05)
    labels = {"pool": "interactive", "actuator": "memory"}
    step = await asyncio.wait_for(s.step(0.0, PoolLoad(requests_per_s=6.0)), 10)
    assert step.target == 6
    assert s.metrics.registry.get_sample_value("tidal_autoscaler_actuator_errors_total", labels) == 1
    # The next step goes on without piling a second call onto the one still running.
    await asyncio.wait_for(s.step(15.0, PoolLoad(requests_per_s=6.0)), 10)
    assert calls == 1
    assert s.metrics.registry.get_sample_value("tidal_autoscaler_actuator_errors_total", labels) == 2
    # Once it answers, the step after places the request again (and it lands).
    answer.set()
    await asyncio.sleep(0)
    await asyncio.wait_for(s.step(30.0, PoolLoad(requests_per_s=6.0)), 10)
    assert calls == 2 and (await pool.observe("interactive", None)).total == 6


async def test_a_trough_offers_its_idle_replicas_to_batch() -> None:
    clock = ManualClock()
    pool = ColdStartPool(clock, ready=10)
    s = scaler(clock, pool)
    await s.step(0.0, PoolLoad(requests_per_s=10.0))
    clock.advance(15)
    step = await s.step(15.0, PoolLoad(requests_per_s=3.0))
    assert step.trough and step.spare == 7
    busy = await s.step(30.0, PoolLoad(requests_per_s=3.0, ttft_p95_s=5.0))
    assert not busy.trough and busy.spare == 0


async def test_the_loop_learns_the_profile_from_the_gateway_time_and_holds_without_a_report() -> None:
    clock = ManualClock()
    profile = HourOfWeekProfile()
    s = Autoscaler(
        "interactive",
        SPEC,
        make_policy("tidal"),
        capacity=StaticCapacity({"interactive": 1.0}),
        actuator=GaugeActuator(),
        clock=clock,
        forecaster=Forecaster(profile),
    )

    class Source:
        t = 0.0
        down = False

        async def load(self) -> LoadReport:
            if self.down:
                raise ConnectionError("gateway down")
            self.t += 60.0
            return LoadReport(
                self.t, {"interactive": PoolLoad(requests_per_s=7.0, replicas_healthy=3, replicas_serving=3)}
            )

    src = Source()
    loop = AutoscalerLoop([s], source=src, clock=clock)
    for _ in range(3):
        await loop.step()
    profile.fit([])
    assert profile.predict(60.0) == 7.0
    assert loop.last["interactive"].ready == 3
    src.down = True
    assert await loop.step() == []


async def test_a_pool_whose_actuator_cannot_observe_holds_while_the_others_scale() -> None:
    clock = ManualClock()

    class Broken(ColdStartPool):
        async def observe(self, pool: str, load: PoolLoad | None) -> PoolReplicas:
            raise ConnectionError("API server unreachable")

    good = scaler(clock, ColdStartPool(clock, ready=2))
    bad = Autoscaler(
        "batch",
        SPEC,
        make_policy("reactive"),
        capacity=StaticCapacity({"batch": 1.0}),
        actuator=Broken(clock, ready=2),
        clock=clock,
        metrics=good.metrics,
    )

    class Source:
        async def load(self) -> LoadReport:
            return LoadReport(
                0.0, {"interactive": PoolLoad(requests_per_s=5.0), "batch": PoolLoad(requests_per_s=5.0)}
            )

    steps = await AutoscalerLoop([bad, good], source=Source(), clock=clock).step()
    assert [s.pool for s in steps] == ["interactive"] and steps[0].target == 5
    labels = {"pool": "batch", "actuator": "memory"}
    assert good.metrics.registry.get_sample_value("tidal_autoscaler_actuator_errors_total", labels) == 1
