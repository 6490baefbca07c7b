"""SchedulerService: which loops a fleet gets, with which actuators, and how they run together
(fakes for the gateway and the lane, an injected clock)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from tidal.clock import ManualClock
from tidal.fleet import FleetConfig, parse_fleet
from tidal.replicas.launcher import free_port
from tidal.scheduler.autoscaler import GaugeActuator, PoolReplicas
from tidal.scheduler.gate import LaneAck
from tidal.scheduler.service import (
    PoolActuators,
    SchedulerOptions,
    SchedulerService,
    SchedulerSetupError,
    actuator_kind,
)
from tidal.scheduler.signals import GroupLoad, LoadReport, PoolLoad, ReplicaView
from tidal.settings import Settings

pytestmark = pytest.mark.anyio


def fleet_data() -> dict[str, Any]:
    return {
        "models": [{"name": "m"}, {"name": "e", "embedding": True}],
        "pools": {
            "interactive": {
                "kind": "interactive",
                "model": "m",
                "shared": True,
                "replicas": [
                    {"name": "i0", "url": "http://127.0.0.1:9001"},
                    {"name": "i1", "url": "http://127.0.0.1:9002", "group": "next", "weight": 0},
                ],
                "canary": {"steps": [0.1, 0.5], "step_s": 60, "min_requests": 10},
            },
            "batch": {
                "kind": "batch",
                "model": "m",
                "replicas": [{"name": "b0", "url": "http://127.0.0.1:9003"}],
                "autoscale": {"min_replicas": 1, "max_replicas": 20, "capacity_rps_per_replica": 1.0},
            },
            "spot": {
                "kind": "spot",
                "model": "m",
                "replicas": [
                    {
                        "name": "s0",
                        "url": "http://127.0.0.1:9004",
                        "launch": {"kind": "sim", "preset": "fast-test"},
                    }
                ],
                "autoscale": {"max_replicas": 4},
            },
            "embed": {"kind": "batch", "model": "e", "replicas": []},
        },
        "gate": {"hold_s": 2},
    }


def fleet(**changes: Any) -> FleetConfig:
    data = fleet_data()
    for pool, section in changes.items():
        data["pools"][pool].update(section)
    return parse_fleet(data)


class FakeGateway:
    """The admin API as the scheduler sees it: a load report and a replica registry."""

    def __init__(self, replicas: list[ReplicaView]) -> None:
        self.report = LoadReport(time=1_700_000_000.0, pools={"interactive": PoolLoad()})
        self.views = {v.name: v for v in replicas}
        self.updates: list[tuple[str, dict[str, Any]]] = []

    async def load(self) -> LoadReport:
        return self.report

    async def replicas(self) -> list[ReplicaView]:
        return list(self.views.values())

    async def register(self, name: str, url: str, pool: str, **kw: Any) -> None:
        self.views[name] = ReplicaView(name, url, pool)

    async def update(self, name: str, **kw: Any) -> None:
        self.updates.append((name, {k: v for k, v in kw.items() if v is not None}))
        v = self.views[name]
        if kw.get("healthy") is not None:
            self.views[name] = ReplicaView(v.name, v.url, v.pool, v.group, v.weight, kw["healthy"])

    async def deregister(self, name: str) -> None:
        self.views.pop(name, None)


class FakeLane:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    async def pause(self, pool: str, reason: str) -> LaneAck:
        self.calls.append(("pause", pool, reason))
        return LaneAck(True, "paused")

    async def resume(self, pool: str, reason: str) -> LaneAck:
        self.calls.append(("resume", pool, reason))
        return LaneAck(True, "resumed")


@pytest.fixture(autouse=True)
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TIDAL_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def service(f: FleetConfig, gw: FakeGateway, clock: ManualClock, **opts: Any) -> SchedulerService:
    return SchedulerService(
        f,
        Settings(_env_file=None, environment="test"),  # type: ignore[call-arg]
        gateway=gw,
        clock=clock,
        options=SchedulerOptions(**opts),
        lane=FakeLane(),
    )


def test_each_fleet_part_gets_its_loop_and_each_autoscaled_pool_its_actuator() -> None:
    s = service(fleet(), FakeGateway([]), ManualClock())
    # A gate for the shared pool only
    assert [g.pool for g in s.gates] == ["interactive"]
    assert s.gate_controller is not None and s.gates[0].spec.hold_s == 2
    # Autoscalers for the pools with an autoscale section: gauge without launch, local with it
    assert s.autoscaler_loop is not None
    assert {sc.pool: sc.actuator.name for sc in s.autoscaler_loop.scalers} == {
        "batch": "gauge",
        "spot": "local",
    }
    # The prober replaces through the pools' actuators and probes embedding pools with embeddings
    assert s.prober is not None and isinstance(s.prober.actuator, PoolActuators)
    assert s._generation is not None and s._generation.embedding_pools == {"embed"}
    # A canary controller for the pool with a second replica group, configured by its section
    [(pool, ctl)] = s.canaries.items()
    assert pool == "interactive"
    assert (ctl.spec.canary_group, ctl.spec.steps, ctl.spec.step_s, ctl.spec.require_eval) == (
        "next",
        (0.1, 0.5),
        60.0,
        False,
    )
    text = "\n".join(s.describe())
    assert "batch gate on interactive" in text and "spot (local actuator)" in text


def test_a_canary_eval_section_scores_each_group_with_the_eval_job_kind(tmp_path: Path) -> None:
    from tidal.scheduler.evals import ReplicaEvalRunner

    dataset = tmp_path / "capitals.jsonl"
    dataset.write_text('{"prompt": "Capital of France?", "reference": "Paris"}\n')
    canary = {"steps": [0.1], "eval": {"dataset": str(dataset), "scorer": "contains", "max_items": 50}}
    s = service(fleet(interactive={"canary": canary}), FakeGateway([]), ManualClock())
    ctl = s.canaries["interactive"]
    # The rollout now needs the eval to pass, scored on the pool's model by the job kind's scorer
    assert ctl.spec.require_eval and isinstance(ctl.evals, ReplicaEvalRunner)
    # A dataset that is not there is a start-up error naming the key
    canary["eval"] = {"dataset": str(tmp_path / "missing.jsonl")}
    with pytest.raises(SchedulerSetupError, match=r"pools.interactive.canary.eval.dataset: no file"):
        service(fleet(interactive={"canary": canary}), FakeGateway([]), ManualClock())


def test_switches_turn_loops_off() -> None:
    s = service(
        fleet(), FakeGateway([]), ManualClock(), gate=False, health=False, autoscale=False, canary=False
    )
    assert (s.gate_controller, s.prober, s.autoscaler_loop, s.canaries) == (None, None, None, {})
    assert s.describe() == ["batch gate: off", "health: off", "autoscaler: off"]


def test_actuator_choice_follows_the_pool_and_a_forced_one_must_fit() -> None:
    f = fleet(batch={"autoscale": {"kubernetes": {"deployment": "vllm", "namespace": "llm"}}})
    assert actuator_kind(f.pools["batch"]) == "kubernetes"
    assert actuator_kind(f.pools["spot"]) == "local"
    assert actuator_kind(f.pools["spot"], "gauge") == "gauge"
    with pytest.raises(
        SchedulerSetupError, match="pools.batch: the local actuator needs a replica with a launch"
    ):
        actuator_kind(fleet().pools["batch"], "local")
    with pytest.raises(SchedulerSetupError, match="pools.spot.autoscale: the kubernetes actuator needs"):
        actuator_kind(f.pools["spot"], "kubernetes")


def test_a_bad_autoscaler_policy_fails_at_start_naming_the_pool() -> None:
    f = fleet(batch={"autoscale": {"policy": "magic"}})
    with pytest.raises(
        SchedulerSetupError, match=r"pools.batch.autoscale: unknown autoscaler policy 'magic'"
    ):
        service(f, FakeGateway([]), ManualClock())
    f = fleet(batch={"autoscale": {"parameters": {"lookahed_s": 3}}})
    with pytest.raises(SchedulerSetupError, match="pools.batch.autoscale: .*lookahed_s"):
        service(f, FakeGateway([]), ManualClock())


def test_a_probe_timeout_must_be_shorter_than_the_period() -> None:
    with pytest.raises(SchedulerSetupError, match="shorter than the probe period"):
        SchedulerOptions(probe_period_s=1.0, probe_timeout_s=1.0)


async def test_pool_actuators_send_each_pool_to_its_own_and_replace_only_what_they_manage() -> None:
    a, b = GaugeActuator(), GaugeActuator()
    both = PoolActuators({"x": a, "y": b})
    await both.scale("x", 5)
    serving = PoolLoad(replicas_total=2, replicas_healthy=2, replicas_serving=2)
    assert await both.observe("x", serving) == PoolReplicas(2, 3)
    assert await both.observe("y", serving) == PoolReplicas(2, 0)
    # a canary held at weight 0 is registered and healthy, but not ready capacity
    held = PoolLoad(replicas_total=3, replicas_healthy=3, replicas_serving=2)
    assert await both.observe("y", held) == PoolReplicas(2, 0)
    assert await both.replace("z", "r") is False
    with pytest.raises(KeyError):
        await both.scale("z", 1)


async def test_the_service_runs_every_loop_and_pauses_the_lane_when_it_stops() -> None:
    clock = ManualClock()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every probe fails at once
    gw = FakeGateway([ReplicaView("i0", dead, "interactive")])
    gw.report = LoadReport(
        time=1_700_000_000.0, pools={"interactive": PoolLoad(), "batch": PoolLoad(requests_per_s=7.5)}
    )
    f = fleet(
        spot={"autoscale": None},
        interactive={"canary": None, "replicas": fleet_data()["pools"]["interactive"]["replicas"][:1]},
    )
    s = service(f, gw, clock, probe_period_s=1.0, probe_timeout_s=0.5)
    lane = s.lane
    assert isinstance(lane, FakeLane)
    stop = asyncio.Event()
    task = asyncio.create_task(s.run(stop))
    try:
        # The gate starts paused and tells the lane; calm for the hold time opens it
        await clock.advance_and_settle(0.5, 0.25)
        assert lane.calls[0][:2] == ("pause", "interactive")
        await clock.advance_and_settle(2.5, 0.25)
        assert lane.calls[-1] == ("resume", "interactive", "calm")
        # Interactive pressure closes it again, counted by reason
        gw.report = LoadReport(time=1_700_000_010.0, pools={"interactive": PoolLoad(queue_wait_p95_s=0.9)})
        await clock.advance_and_settle(0.5, 0.25)
        assert lane.calls[-1] == ("pause", "interactive", "queue_wait")
        paused = s.metrics.registry.get_sample_value(
            "tidal_gate_transitions_total", {"pool": "interactive", "to": "paused", "reason": "queue_wait"}
        )
        assert paused == 1.0
        # The prober took the unreachable replica out of routing
        for _ in range(50):
            if ("i0", {"healthy": False}) in gw.updates:
                break
            await asyncio.sleep(0.02)
        assert ("i0", {"healthy": False}) in gw.updates
        # The autoscaler of the batch pool asked for the load's replicas plus the warm buffer
        desired = s.metrics.registry.get_sample_value("tidal_autoscaler_desired_replicas", {"pool": "batch"})
        assert desired == 9.0  # ceil(7.5 * 1.12 / 1.0)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    # When it stops, the lane is left paused for the next scheduler
    assert lane.calls[-1] == ("pause", "interactive", "scheduler_stopped")
    # And what the autoscaler learned is saved for the next one
    assert s.profiles_path.exists()
    assert set(json.loads(s.profiles_path.read_text())["pools"]) == {"batch"}


def test_learned_load_profiles_survive_a_restart_and_a_damaged_file_is_ignored(data_dir: Path) -> None:
    week = [(1_700_000_000.0 + i * 60.0, 5.0 + (i // 60) % 24) for i in range(7 * 24 * 60 + 120)]
    first = service(fleet(), FakeGateway([]), ManualClock())
    first.profiles["batch"].fit(week)
    first.save_profiles()
    # When the scheduler restarts, it forecasts from what it had learned
    again = service(fleet(), FakeGateway([]), ManualClock())
    t = 1_700_000_000.0 + 7 * 24 * 3600.0 + 5 * 3600.0
    assert again.profiles["batch"].predict(t) == first.profiles["batch"].predict(t) is not None
    assert again.profiles["spot"].trained_hours == 0
    # A damaged file costs the history, not the start
    again.profiles_path.write_text("{not json")
    fresh = service(fleet(), FakeGateway([]), ManualClock())
    assert fresh.profiles["batch"].trained_hours == 0


async def test_a_finished_rollout_is_recorded_and_not_repeated_by_the_next_scheduler() -> None:
    clock = ManualClock()
    gw = FakeGateway(
        [
            ReplicaView("i0", "http://127.0.0.1:9001", "interactive"),
            ReplicaView("i1", "http://127.0.0.1:9002", "interactive", group="next", weight=0.0),
        ]
    )
    gw.report = LoadReport(
        time=1_700_000_000.0,
        pools={"interactive": PoolLoad()},
        groups={"next": GroupLoad(), "stable": GroupLoad(requests=100)},
    )
    s = service(fleet(), gw, clock, gate=False, health=False, autoscale=False)
    stop = asyncio.Event()
    task = asyncio.create_task(s.run(stop))
    for _ in range(10):
        await asyncio.sleep(0)
    # The canary got its first share (10%) by weight
    assert ("i1", {"weight": pytest.approx(1 / 9)}) in gw.updates
    # When the new build fails far more often than the baseline
    gw.report = LoadReport(
        time=1_700_000_005.0,
        pools={"interactive": PoolLoad()},
        groups={"next": GroupLoad(requests=60, errors=30), "stable": GroupLoad(requests=640, errors=1)},
    )
    await clock.advance_and_settle(5.0, 1.0)
    # Then it is rolled back (weight 0) and the outcome recorded
    assert gw.updates[-2:] == [("i0", {"weight": 1.0}), ("i1", {"weight": 0.0})]
    for _ in range(50):
        if s.outcomes_path.exists():
            break
        await asyncio.sleep(0.02)
    recorded = json.loads(s.outcomes_path.read_text())["pools"]["interactive"]
    assert (recorded["group"], recorded["outcome"]) == ("next", "rolled_back")
    assert recorded["reason"].startswith("error_rate")
    stop.set()
    await asyncio.wait_for(task, 10)
    # And a restarted scheduler leaves the rolled-back group alone, saying so
    again = service(fleet(), gw, clock, gate=False, health=False, autoscale=False)
    assert again.canaries == {}
    assert any("interactive group next already rolled_back" in line for line in again.describe())


async def test_the_probe_generates_one_token_or_embeds_one_word_by_the_pool_model(tmp_path: Path) -> None:
    from tidal.replicas.launcher import sim_process
    from tidal.scheduler.health import CanaryGeneration

    chat = sim_process("fast-test", args=["--served-model-name", "m"], log_path=tmp_path / "chat.log")
    embed = sim_process("e5-mistral-7b-h100", args=["--served-model-name", "e"], log_path=tmp_path / "e5.log")
    for p in (chat, embed):
        p.start()
    probes = CanaryGeneration({"interactive": "m", "embed": "e", "wrong": "e"}, embedding_pools={"embed"})
    try:
        await asyncio.gather(*(asyncio.to_thread(p.wait_ready, 60) for p in (chat, embed)))
        assert (await probes.probe(ReplicaView("c", chat.url, "interactive"))).ok
        assert (await probes.probe(ReplicaView("e", embed.url, "embed"))).ok
        # An embedding model cannot generate: probing it with a completion would take it out of routing
        bad = await probes.probe(ReplicaView("e", embed.url, "wrong"))
        assert not bad.ok and bad.error
    finally:
        await probes.aclose()
        for p in (chat, embed):
            p.stop()


PLANNED = {
    "capacity_from": "plan",
    "max_replicas": 40,
    "plan": {
        "preset": "llama-3.1-70b-fp8-h200-tp4",
        "prompt_tokens": [900, 1100],
        "output_tokens": [150, 250],
    },
}


async def test_a_planned_pool_is_measured_when_the_service_starts_and_cached_for_the_next() -> None:
    # Given a pool whose capacity is planned on the simulated replica, not measured yet
    gw = FakeGateway([])
    gw.report = LoadReport(time=1_700_000_000.0, pools={"spot": PoolLoad(requests_per_s=40.0)})
    f = fleet(spot={"autoscale": PLANNED})

    def make() -> SchedulerService:
        return SchedulerService(
            f,
            Settings(_env_file=None, environment="test"),  # type: ignore[call-arg]
            gateway=gw,
            clock=ManualClock(),
            options=SchedulerOptions(gate=False, health=False, canary=False),
            actuators={"spot": GaugeActuator()},
        )

    s = make()
    assert "spot" not in s.capacity_plans
    assert any("planned capacity: measuring on the simulated replica" in line for line in s.describe())
    # When it runs, it measures first, then sizes the pool with what it measured
    stop = asyncio.Event()
    task = asyncio.create_task(s.run(stop))
    try:
        for _ in range(600):
            if s.metrics.registry.get_sample_value("tidal_autoscaler_desired_replicas", {"pool": "spot"}):
                break
            await asyncio.sleep(0.05)
        plan = s.capacity_plans["spot"]
        planned = s.metrics.registry.get_sample_value(
            "tidal_autoscaler_planned_capacity_requests_per_second", {"pool": "spot"}
        )
        assert planned == plan.rps and 3.0 < plan.rps < 40.0
        desired = s.metrics.registry.get_sample_value("tidal_autoscaler_desired_replicas", {"pool": "spot"})
        assert desired == math.ceil(40.0 * 1.12 / plan.rps - 1e-9)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    # And the next scheduler starts with it at once
    again = make()
    assert again.capacity_plans["spot"].rps == plan.rps and again.capacity_plans["spot"].cached
    assert any(f"planned capacity {plan.rps:.1f} rps per replica" in line for line in again.describe())


def test_a_plan_that_cannot_be_used_stops_the_start_naming_the_pool(tmp_path: Path) -> None:
    bad = {"capacity_from": "plan", "plan": {"file": str(tmp_path / "plan.json")}}
    with pytest.raises(SchedulerSetupError, match=r"pools.spot.autoscale.plan: .*cannot read the plan"):
        service(fleet(spot={"autoscale": bad}), FakeGateway([]), ManualClock())
    (tmp_path / "plan.json").write_text(json.dumps({"options": [{"tp": 8, "requests_per_s_at_slo": 12.5}]}))
    s = service(fleet(spot={"autoscale": bad}), FakeGateway([]), ManualClock())
    assert s.capacity_plans["spot"].rps == 12.5


def test_a_learned_capacity_is_saved_with_the_profiles_and_read_back(data_dir: Path) -> None:
    learning = {"capacity_rps_per_replica": 10.0, "learn_capacity": True}
    first = service(fleet(batch={"autoscale": learning}), FakeGateway([]), ManualClock())
    capacity = first.learned_capacity
    assert capacity is not None
    busy = PoolLoad(
        requests_per_s=60.0, replicas_healthy=4, replicas_serving=4, ttft_p95_s=0.2, tpot_p95_s=0.02
    )
    for _ in range(4):
        capacity.observe("batch", busy, 4, lent_to_batch=False)
    assert capacity.capacity_rps("batch") == 15.0
    first.save_profiles()
    again = service(fleet(batch={"autoscale": learning}), FakeGateway([]), ManualClock())
    assert again.learned_capacity is not None and again.learned_capacity.capacity_rps("batch") == 15.0
    assert any("learned online" in line for line in again.describe())


def test_a_profile_imported_while_the_scheduler_runs_replaces_the_learned_one(data_dir: Path) -> None:
    from click.testing import CliRunner

    from tidal.cli.autoscale import import_profile

    s = service(fleet(), FakeGateway([]), ManualClock())
    s.save_profiles()
    assert s.autoscaler_loop is not None
    scaler = next(sc for sc in s.autoscaler_loop.scalers if sc.pool == "batch")
    assert scaler.forecaster.profile is not None and scaler.forecaster.profile.trained_hours == 0
    # When an operator imports a day of per-minute rates for the batch pool
    monday = 1_772_409_600.0  # 2026-03-02 00:00 UTC
    history = data_dir.parent / "rates.csv"
    history.write_text("time,rps\n" + "".join(f"{monday + 60 * m},{3 + m // 60}\n" for m in range(24 * 60)))
    out = CliRunner().invoke(import_profile, [str(history), "--pool", "batch", "--data-dir", str(data_dir)])
    assert out.exit_code == 0, out.output
    assert (
        "24 of 168 hours of the week learned" in out.output
        and "busiest hour: Mon 23:00 at 26.0 rps" in out.output
    )
    # Then the scheduler's next save takes it instead of overwriting it
    s.save_profiles()
    assert scaler.forecaster.profile is s.profiles["batch"] and s.profiles["batch"].trained_hours == 24
    assert s.profiles["batch"].predict(monday + 7 * 86400 + 5.5 * 3600) == 8.0
    saved = json.loads(s.profiles_path.read_text())["pools"]
    assert sum(1 for b in saved["batch"]["buckets"] if b) == 24


def test_the_embedded_fleet_autoscales_its_interactive_pool_with_local_replicas() -> None:
    from tidal.defaults import DEFAULT_FLEET_PATH
    from tidal.fleet import load_fleet

    s = service(load_fleet(DEFAULT_FLEET_PATH), FakeGateway([]), ManualClock())
    assert s.autoscaler_loop is not None
    assert {sc.pool: sc.actuator.name for sc in s.autoscaler_loop.scalers} == {"interactive": "local"}
    [line] = [x for x in s.describe() if x.startswith("autoscaler:")]
    assert "interactive (local actuator): 2-4 replicas" in line
