"""The health prober: out of routing at once, back after consecutive successes, replaced when it
stays broken. Scenarios on a ManualClock with a scripted prober; the canary generation itself is
checked against a real vLLM CPU replica."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from tidal.clock import ManualClock
from tidal.scheduler.autoscaler.actuators import PoolReplicas
from tidal.scheduler.health import CanaryGeneration, HealthProber, ProbeResult
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.signals import PoolLoad, ReplicaView

pytestmark = pytest.mark.anyio


class Registry:
    def __init__(self, *names: str) -> None:
        self.views = {n: ReplicaView(n, f"http://127.0.0.1:1/{n}", "interactive") for n in names}
        self.updates: list[tuple[str, dict[str, Any]]] = []
        self.fail_updates = False

    async def replicas(self) -> list[ReplicaView]:
        return list(self.views.values())

    async def register(self, *a: Any, **k: Any) -> None:
        raise AssertionError("the prober never registers")

    async def update(self, name: str, **fields: Any) -> None:
        if self.fail_updates:
            raise ConnectionError("gateway down")
        fields = {k: v for k, v in fields.items() if v is not None}
        self.updates.append((name, fields))
        v = self.views[name]
        self.views[name] = ReplicaView(
            v.name,
            v.url,
            v.pool,
            v.group,
            v.weight,
            fields.get("healthy", v.healthy),
            fields.get("draining", v.draining),
        )

    async def deregister(self, name: str) -> None:
        self.views.pop(name, None)


class Script:
    """Probe results per replica, one per round; the last repeats."""

    def __init__(self, **plans: str) -> None:
        self.plans = {n: list(p) for n, p in plans.items()}
        self.probed: list[str] = []

    async def probe(self, replica: ReplicaView) -> ProbeResult:
        self.probed.append(replica.name)
        plan = self.plans.get(replica.name, ["+"])
        mark = plan.pop(0) if len(plan) > 1 else plan[0]
        if mark == "!":
            raise RuntimeError("prober bug")
        return ProbeResult(mark == "+", 0.01, "" if mark == "+" else "timed out")


class Actuator:
    name = "memory"

    def __init__(self, manages: bool = True) -> None:
        self.manages = manages
        self.replaced: list[str] = []

    async def observe(self, pool: str, load: PoolLoad | None) -> PoolReplicas:
        return PoolReplicas(0)

    async def scale(self, pool: str, replicas: int) -> None:
        pass

    async def replace(self, pool: str, replica: str) -> bool:
        self.replaced.append(replica)
        return self.manages


def prober(reg: Registry, script: Script, clock: ManualClock, **kw: Any) -> HealthProber:
    return HealthProber(
        reg, script, clock=clock, period_s=2.0, recover_after=3, metrics=SchedulerMetrics(), **kw
    )


async def test_one_failed_canary_takes_the_replica_out_and_three_successes_bring_it_back() -> None:
    # Given two healthy replicas; r1 fails one probe, then fails once more while recovering
    clock, reg = ManualClock(), Registry("r0", "r1")
    hp = prober(reg, Script(r1="+-++-+++"), clock)
    actions = []
    for _ in range(9):
        actions.append([(e.replica, e.action) for e in await hp.step()])
        clock.advance(2.0)
    # Then it is taken out at the first failure and back only after 3 successes in a row
    assert actions == [[], [("r1", "removed")], [], [], [], [], [], [("r1", "restored")], []]
    assert reg.updates == [("r1", {"healthy": False}), ("r1", {"healthy": True})]
    m = hp.metrics.registry
    assert m.get_sample_value("tidal_health_transitions_total", {"replica": "r1", "to": "unhealthy"}) == 1
    assert m.get_sample_value("tidal_health_probes_total", {"replica": "r1", "result": "fail"}) == 2


async def test_a_replica_that_stays_unhealthy_is_replaced_once_through_the_actuator() -> None:
    clock, reg, act = ManualClock(), Registry("r0"), Actuator()
    hp = prober(reg, Script(r0="-"), clock, replace_after_s=10.0, actuator=act)
    events = []
    for _ in range(12):
        events += [(e.action, e.at) for e in await hp.step()]
        clock.advance(2.0)
    assert events == [("removed", 0.0), ("replaced", 10.0)]
    assert act.replaced == ["r0"]
    assert (
        hp.metrics.registry.get_sample_value("tidal_health_replacements_total", {"pool": "interactive"}) == 1
    )


async def test_an_actuator_that_does_not_manage_the_replica_leaves_it_out_of_routing() -> None:
    clock, reg, act = ManualClock(), Registry("static-0"), Actuator(manages=False)
    hp = prober(reg, Script(**{"static-0": "-"}), clock, replace_after_s=4.0, actuator=act)
    actions = []
    for _ in range(6):
        actions += [e.action for e in await hp.step()]
        clock.advance(2.0)
    assert actions == ["removed", "unreplaceable"]
    assert not reg.views["static-0"].healthy


async def test_draining_replicas_are_not_probed_and_a_broken_prober_counts_as_a_failure() -> None:
    clock, reg = ManualClock(), Registry("r0", "r1")
    reg.views["r1"] = ReplicaView("r1", "http://127.0.0.1:1", "interactive", draining=True)
    script = Script(r0="!")
    hp = prober(reg, script, clock)
    events = await hp.step()
    assert script.probed == ["r0"]
    assert [(e.replica, e.action) for e in events] == [("r0", "removed")]


async def test_if_the_gateway_cannot_be_told_the_prober_tries_again_next_period() -> None:
    clock, reg = ManualClock(), Registry("r0")
    hp = prober(reg, Script(r0="-"), clock)
    reg.fail_updates = True
    assert await hp.step() == []
    assert reg.views["r0"].healthy
    reg.fail_updates = False
    clock.advance(2.0)
    assert [e.action for e in await hp.step()] == ["removed"]


async def test_the_prober_runs_every_period() -> None:
    clock, reg = ManualClock(), Registry("r0")
    script = Script()
    hp = prober(reg, script, clock)
    stop = asyncio.Event()
    task = asyncio.create_task(hp.run(stop))
    for _ in range(5):
        for _ in range(30):
            await asyncio.sleep(0)
        clock.advance(2.0)
    stop.set()
    for _ in range(30):
        await asyncio.sleep(0)
    clock.advance(2.0)
    await task
    assert len(script.probed) in (5, 6)


async def test_the_canary_generation_fails_fast_on_a_dead_or_hung_replica() -> None:
    # Nothing listens on a freed port; a listening socket that never answers is a hung replica.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    probe = CanaryGeneration({"interactive": "tiny"}, timeout_s=0.5)
    try:
        for port in (dead_port, hung.getsockname()[1]):
            res = await probe.probe(ReplicaView("x", f"http://127.0.0.1:{port}", "interactive"))
            assert not res.ok and res.latency_s < 2.0, res
        res = await probe.probe(ReplicaView("x", "http://127.0.0.1:1", "unknown-pool"))
        assert not res.ok and "no model" in res.error
    finally:
        hung.close()
        await probe.aclose()


@pytest.mark.vllm
async def test_the_canary_generation_passes_on_a_real_vllm_replica(vllm_replica: Any) -> None:
    view = ReplicaView("vllm", vllm_replica.url, "interactive")
    probe = CanaryGeneration({"interactive": "tiny"}, timeout_s=5.0, priority=0)
    wrong = CanaryGeneration({"interactive": "no-such-model"}, timeout_s=5.0)
    try:
        res = await probe.probe(view)
        assert res.ok, res.error
        assert not (await wrong.probe(view)).ok
    finally:
        await probe.aclose()
        await wrong.aclose()
