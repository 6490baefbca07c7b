"""The scheduler process, assembled: every control loop of a fleet in one asyncio loop.

:class:`SchedulerService` builds from a :class:`~tidal.fleet.FleetConfig`, the process
:class:`~tidal.settings.Settings`, a gateway (its ``/admin`` API as load source and replica
registry, :class:`~scheduler.gateway.GatewayAdmin`) and an injected clock:

* **batch gate** -- a :class:`~scheduler.gate.BatchGate` per pool with ``shared: true`` (the
  fleet's ``gate`` thresholds), driven by one :class:`~scheduler.gate.GateController` over the
  ``shared`` worker lane (:class:`~scheduler.lanes.SharedLane` over
  :class:`workers.control.LaneSwitch`);
* **health** -- a :class:`~scheduler.health.HealthProber` over every registered replica (a
  one-token generation, or a one-word embedding for embedding models), replacing a replica that
  stays unhealthy through the pool's actuator when autoscaling is on;
* **autoscaler** -- an :class:`~scheduler.autoscaler.AutoscalerLoop` over the pools with an
  ``autoscale`` section; the actuator of a pool is ``kubernetes`` when its ``autoscale`` has a
  ``kubernetes`` block, ``local`` (start ``tidal sim``/vLLM processes like the pool's replica
  with a ``launch`` block) when it has one, else ``gauge`` (only the
  ``tidal_autoscaler_desired_replicas{pool}`` gauge, for KEDA); ``SchedulerOptions.actuator``
  forces one; what each pool's hour-of-week profile learned is saved under the data dir
  (``scheduler/autoscaler-profiles.json``) every few minutes and at stop, and read at start;
* **canary** -- a :class:`~scheduler.canary.CanaryController` per pool whose replicas include a
  group other than the baseline (``stable``), with the pool's optional ``canary`` section; its
  ``eval`` (dataset and scorer) makes a :class:`~scheduler.evals.ReplicaEvalRunner`, and without
  one the rollout is judged on error rates alone. A finished rollout is recorded under the data
  dir (``scheduler/canary-outcomes.json``, per pool and group), so a restarted scheduler neither
  re-ramps a rolled-back build nor demotes a promoted one; a new group name (or removing the
  record) starts a new rollout.

Every loop shares one :class:`~scheduler.metrics.SchedulerMetrics` (``serve_metrics`` exposes it).
On stop the shared lane is paused (a scheduler that no longer watches users must not leave their
replicas lent to batch; the next one resumes it after the hold time), then everything the service
started is closed.

Example::

    async with GatewayAdmin(["http://127.0.0.1:8000"], admin_key=settings.admin_key) as gw:
        service = SchedulerService(fleet, settings, gateway=gw, clock=SystemClock())
        service.serve_metrics("127.0.0.1", 9100)
        await service.run(stop)          # until stop is set; then pauses the lane and cleans up
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from prometheus_client import start_http_server

from tidal.clock import Clock
from tidal.fleet import FleetConfig, KubernetesTargetSpec, PoolSpec
from tidal.scheduler.autoscaler import (
    Actuator,
    Autoscaler,
    AutoscalerLoop,
    CapacityPlan,
    EventCalendar,
    Forecaster,
    GaugeActuator,
    HourOfWeekProfile,
    OnlineCapacity,
    PoolReplicas,
    ReplicaCapacity,
    ScheduledEvent,
    StaticCapacity,
    known_plan,
    make_policy,
    plan_capacity,
    pool_slo,
)
from tidal.scheduler.autoscaler.local import LocalProcessActuator, LocalTemplate
from tidal.scheduler.canary import CanaryController, CanarySpec, CanaryState, EvalRunner
from tidal.scheduler.gate import BatchGate, GateController, GateState, LaneController
from tidal.scheduler.health import CanaryGeneration, HealthProber
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.signals import LoadSource, PoolLoad, ReplicaRegistry
from tidal.settings import Settings

__all__ = [
    "ActuatorKind",
    "Gateway",
    "PoolActuators",
    "SchedulerOptions",
    "SchedulerService",
    "SchedulerSetupError",
    "actuator_kind",
]

log = logging.getLogger(__name__)

ActuatorKind = Literal["auto", "gauge", "local", "kubernetes"]
_MAX_PROFILES_BYTES = 16 * 1024 * 1024


class SchedulerSetupError(ValueError):
    """The fleet and options do not make a runnable scheduler; the message says why."""


class Gateway(LoadSource, ReplicaRegistry, Protocol):
    """What the scheduler needs of the gateway: its load and its replica registry."""


@dataclass(frozen=True, slots=True)
class SchedulerOptions:
    """Which loops run and how (the ``tidal scheduler`` options)."""

    gate: bool = True
    health: bool = True
    autoscale: bool = True
    canary: bool = True
    probe_period_s: float = 2.0
    probe_timeout_s: float = 1.5
    recover_after: int = 3
    replace_after_s: float = 60.0
    signal_timeout_s: float = 2.0
    actuator: ActuatorKind = "auto"
    local_log_dir: Path = field(default_factory=lambda: Path(".tidal/logs/autoscaler"))
    pause_on_stop: bool = True
    stop_timeout_s: float = 10.0
    profile_save_s: float = 300.0

    def __post_init__(self) -> None:
        if self.probe_timeout_s <= 0 or self.probe_period_s <= 0:
            raise SchedulerSetupError("probe period and timeout must be positive")
        if self.probe_timeout_s >= self.probe_period_s:
            # A hung replica must be out of routing within two probe periods.
            raise SchedulerSetupError("the probe timeout must be shorter than the probe period")


def actuator_kind(pool: PoolSpec, forced: ActuatorKind = "auto") -> Literal["gauge", "local", "kubernetes"]:
    """The actuator a pool with an ``autoscale`` section gets (see the module docstring)."""
    spec = pool.autoscale
    if spec is None:
        raise SchedulerSetupError(f"pools.{pool.name}: no autoscale section")
    if forced == "kubernetes" and spec.kubernetes is None:
        raise SchedulerSetupError(
            f"pools.{pool.name}.autoscale: the kubernetes actuator needs a kubernetes block"
        )
    if forced == "local" and _template(pool) is None:
        raise SchedulerSetupError(
            f"pools.{pool.name}: the local actuator needs a replica with a launch block to copy"
        )
    if forced != "auto":
        return forced
    if spec.kubernetes is not None:
        return "kubernetes"
    if _template(pool) is not None:
        return "local"
    return "gauge"


def _template(pool: PoolSpec) -> LocalTemplate | None:
    baseline = pool.canary.baseline_group if pool.canary is not None else "stable"
    launched = [r for r in pool.replicas if r.launch is not None]
    launched.sort(key=lambda r: r.group != baseline)  # a baseline replica is the one to copy
    if not launched:
        return None
    r = launched[0]
    assert r.launch is not None
    return LocalTemplate(
        kind=r.launch.kind,
        served_model_name=pool.model,
        preset=r.launch.preset,
        model_dir=r.launch.model_dir,
        args=tuple(r.launch.extra_args()),
        group=r.group,
        max_loras=r.max_loras,
        kv_events=r.kv_events is not None,
    )


class PoolActuators:
    """One :class:`~scheduler.autoscaler.Actuator` over several: each pool goes to its own."""

    name = "fleet"

    def __init__(self, by_pool: Mapping[str, Actuator]) -> None:
        self.by_pool = dict(by_pool)

    def _of(self, pool: str) -> Actuator:
        try:
            return self.by_pool[pool]
        except KeyError:
            raise KeyError(f"pool {pool} is not autoscaled") from None

    async def observe(self, pool: str, load: PoolLoad | None) -> PoolReplicas:
        return await self._of(pool).observe(pool, load)

    async def scale(self, pool: str, replicas: int) -> None:
        await self._of(pool).scale(pool, replicas)

    async def replace(self, pool: str, replica: str) -> bool:
        actuator = self.by_pool.get(pool)
        return await actuator.replace(pool, replica) if actuator is not None else False


class SchedulerService:
    """Every control loop of one fleet (see the module docstring).

    **Parameters:** ``gateway`` -- load source and replica registry (owned by the caller, closed
    by it after :meth:`run`); ``lane`` -- the gate's lane controller (default: the ``shared``
    worker lane through ``LaneSwitch(settings)``); ``evals`` -- the canary's eval runner;
    ``actuators`` -- per pool, instead of the ones the fleet implies (tests, custom setups).
    """

    def __init__(
        self,
        fleet: FleetConfig,
        settings: Settings,
        *,
        gateway: Gateway,
        clock: Clock,
        options: SchedulerOptions | None = None,
        metrics: SchedulerMetrics | None = None,
        lane: LaneController | None = None,
        evals: EvalRunner | None = None,
        actuators: Mapping[str, Actuator] | None = None,
    ) -> None:
        self.fleet = fleet
        self.settings = settings
        self.gateway = gateway
        self.clock = clock
        self.options = opts = options or SchedulerOptions()
        self.metrics = metrics or SchedulerMetrics()
        self._closers: list[Any] = []  # objects this service created and must close
        self._metrics_server: Any = None

        # Everything that can be wrong in the config is checked before anything is started.
        scaled = [p for p in fleet.pools.values() if p.autoscale is not None] if opts.autoscale else []
        policies = {}
        for p in scaled:
            assert p.autoscale is not None
            try:
                policies[p.name] = make_policy(p.autoscale.policy, p.autoscale.parameters)
            except ValueError as exc:
                raise SchedulerSetupError(f"pools.{p.name}.autoscale: {exc}") from None
            if p.name not in (actuators or {}):
                actuator_kind(p, opts.actuator)

        shared = [p for p in fleet.pools.values() if p.shared]
        self.gates = (
            [
                BatchGate(p.name, fleet.gate, clock=clock, signal_timeout_s=opts.signal_timeout_s)
                for p in shared
            ]
            if opts.gate
            else []
        )
        self.lane: LaneController | None = None
        self.gate_controller: GateController | None = None
        if self.gates:
            self.lane = lane if lane is not None else self._shared_lane()
            self.gate_controller = GateController(
                self.gates, source=gateway, lane=self.lane, clock=clock, metrics=self.metrics
            )

        self.actuators: dict[str, Actuator] = self._actuators(scaled, dict(actuators or {}))
        self.autoscaler_loop: AutoscalerLoop | None = None
        self.profiles_path = settings.data_dir / "scheduler" / "autoscaler-profiles.json"
        self.plans_path = settings.data_dir / "scheduler" / "capacity-plans.json"
        self.profiles: dict[str, HourOfWeekProfile] = {}
        self.capacity_plans: dict[str, CapacityPlan] = {}
        self.static_capacity = StaticCapacity.from_fleet(fleet)
        self.learned_capacity: OnlineCapacity | None = None
        self._to_plan: list[PoolSpec] = []  # measured when run() starts (seconds of CPU)
        self._profiles_mtime: int | None = None
        if scaled:
            learned, saved_capacity = self._load_profiles()
            for p in scaled:
                assert p.autoscale is not None
                if p.autoscale.capacity_from != "plan":
                    continue
                try:
                    plan = known_plan(fleet, p, cache_path=self.plans_path)
                except ValueError as exc:
                    raise SchedulerSetupError(f"pools.{p.name}.autoscale.plan: {exc}") from None
                if plan is None:
                    self._to_plan.append(p)
                else:
                    self._use_plan(plan)
            capacity: ReplicaCapacity = self.static_capacity
            learning = {
                p.name: pool_slo(fleet, p.autoscale)
                for p in scaled
                if p.autoscale is not None and p.autoscale.learn_capacity
            }
            if learning:
                self.learned_capacity = OnlineCapacity(self.static_capacity, learning, learned=saved_capacity)
                capacity = self.learned_capacity
            for p in scaled:
                assert p.autoscale is not None
                if p.autoscale.capacity_from == "static":
                    self.metrics.planned_capacity_rps.labels(p.name).set(p.autoscale.capacity_rps_per_replica)
            scalers = []
            for p in scaled:
                assert p.autoscale is not None
                calendar = EventCalendar(ScheduledEvent.from_spec(e) for e in p.autoscale.events)
                self.profiles[p.name] = learned.get(p.name) or HourOfWeekProfile()
                scalers.append(
                    Autoscaler(
                        p.name,
                        p.autoscale,
                        policies[p.name],
                        capacity=capacity,
                        actuator=self.actuators[p.name],
                        clock=clock,
                        forecaster=Forecaster(self.profiles[p.name], calendar),
                        metrics=self.metrics,
                        lent_to_batch=self._lent_to_batch,
                    )
                )
            self.autoscaler_loop = AutoscalerLoop(scalers, source=gateway, clock=clock)

        self.prober: HealthProber | None = None
        self._generation: CanaryGeneration | None = None
        if opts.health:
            embedding = {p.name for p in fleet.pools.values() if fleet.model(p.model).embedding}
            self._generation = CanaryGeneration(
                {p.name: p.model for p in fleet.pools.values()},
                timeout_s=opts.probe_timeout_s,
                embedding_pools=embedding,
            )
            self.prober = HealthProber(
                gateway,
                self._generation,
                clock=clock,
                period_s=opts.probe_period_s,
                recover_after=opts.recover_after,
                replace_after_s=opts.replace_after_s,
                actuator=PoolActuators(self.actuators) if self.actuators else None,
                metrics=self.metrics,
            )
            for pool in fleet.pools:
                self.metrics.replacements.labels(pool)  # at 0, not "no data"

        self.canaries: dict[str, CanaryController] = {}
        self.outcomes_path = settings.data_dir / "scheduler" / "canary-outcomes.json"
        self.canary_outcomes: dict[str, dict[str, str]] = self._load_outcomes() if opts.canary else {}
        if opts.canary:
            for p in fleet.pools.values():
                group = p.canary_group
                if group is None:
                    continue
                done = self.canary_outcomes.get(p.name)
                if done is not None and done.get("group") == group:
                    continue  # this group's rollout already ended (see describe())
                c = p.canary
                pool_evals = evals if evals is not None else self._eval_runner(p)
                spec = (
                    CanarySpec(
                        canary_group=group,
                        baseline_group=c.baseline_group,
                        steps=tuple(c.steps),
                        step_s=c.step_s,
                        min_requests=c.min_requests,
                        max_error_rate_increase=c.max_error_rate_increase,
                        max_eval_drop=c.max_eval_drop,
                        require_eval=pool_evals is not None,
                    )
                    if c is not None
                    else CanarySpec(canary_group=group, require_eval=pool_evals is not None)
                )
                if pool_evals is None:
                    log.warning(
                        "canary %s: no eval runner; the rollout is judged on error rates only", p.name
                    )
                self.canaries[p.name] = CanaryController(
                    gateway,
                    gateway,
                    pool=p.name,
                    clock=clock,
                    spec=spec,
                    evals=pool_evals,
                    metrics=self.metrics,
                    interval_s=c.interval_s if c is not None else 5.0,
                )

    # -- assembly ------------------------------------------------------------------------------

    def _eval_runner(self, pool: PoolSpec) -> EvalRunner | None:
        """The pool's ``canary.eval``: the eval job kind run straight against each group."""
        from tidal.scheduler.evals import ReplicaEvalRunner

        spec = pool.canary.eval if pool.canary is not None else None
        if spec is None:
            return None
        dataset = Path(spec.dataset)
        if not dataset.is_file():
            raise SchedulerSetupError(f"pools.{pool.name}.canary.eval.dataset: no file {spec.dataset}")
        options: dict[str, Any] = {"scorer": spec.scorer, "max_tokens": spec.max_tokens}
        if spec.pattern is not None:
            options["pattern"] = spec.pattern
        try:
            return ReplicaEvalRunner(
                self.gateway,
                dataset,
                models={pool.name: pool.model},
                options=options,
                max_items=spec.max_items,
            )
        except ValueError as exc:
            raise SchedulerSetupError(f"pools.{pool.name}.canary.eval: {exc}") from None

    def _shared_lane(self) -> LaneController:
        from tidal.scheduler.lanes import SharedLane
        from tidal.workers.control import LaneSwitch

        switch = LaneSwitch(self.settings)
        self._closers.append(switch)
        return SharedLane(switch)

    def _actuators(self, pools: list[PoolSpec], given: dict[str, Actuator]) -> dict[str, Actuator]:
        kinds = {p.name: actuator_kind(p, self.options.actuator) for p in pools if p.name not in given}
        out: dict[str, Actuator] = {p.name: given[p.name] for p in pools if p.name in given}
        by_name = {p.name: p for p in pools}
        local = [n for n, k in kinds.items() if k == "local"]
        if local:
            templates: dict[str, LocalTemplate] = {}
            for n in local:
                t = _template(by_name[n])
                assert t is not None
                templates[n] = t
            actuator = LocalProcessActuator(
                templates,
                registry=self.gateway,
                fixed={n: len(by_name[n].replicas) for n in local},
                log_dir=self.options.local_log_dir,
            )
            self._closers.append(actuator)
            out.update(dict.fromkeys(local, actuator))
        k8s = [n for n, k in kinds.items() if k == "kubernetes"]
        if k8s:
            from tidal.scheduler.autoscaler.k8s import KubernetesActuator

            targets: dict[str, KubernetesTargetSpec] = {}
            for n in k8s:
                spec = by_name[n].autoscale
                assert spec is not None and spec.kubernetes is not None
                targets[n] = spec.kubernetes
            try:
                kube = KubernetesActuator(targets, registry=self.gateway)
            except Exception as exc:  # no kubeconfig, no service account, no `k8s` extra
                raise SchedulerSetupError(
                    f"the kubernetes actuator for {', '.join(k8s)} cannot start: {type(exc).__name__}: {exc}"
                ) from exc
            self._closers.append(kube)
            out.update(dict.fromkeys(k8s, kube))
        gauge = [n for n, k in kinds.items() if k == "gauge"]
        if gauge:
            out.update(dict.fromkeys(gauge, GaugeActuator()))
        return out

    def _lent_to_batch(self, pool: str) -> bool:
        return any(g.pool == pool and g.state is GateState.OPEN for g in self.gates)

    def _use_plan(self, plan: CapacityPlan) -> None:
        self.capacity_plans[plan.pool] = plan
        self.static_capacity.set(plan.pool, plan.rps)
        self.metrics.planned_capacity_rps.labels(plan.pool).set(plan.rps)
        log.info(
            "autoscaler %s: planned capacity %.2f rps per replica (%s%s)",
            plan.pool,
            plan.rps,
            plan.source,
            ", cached" if plan.cached else "",
        )

    async def _plan(self) -> None:
        """Measure the capacities no plan file or cache had (in a thread: it is seconds of CPU)."""
        for p in self._to_plan:
            log.info("autoscaler %s: measuring the capacity of one replica on the simulated replica", p.name)
            self._use_plan(await asyncio.to_thread(plan_capacity, self.fleet, p, cache_path=self.plans_path))
        self._to_plan = []

    async def _autoscale(self, stop: asyncio.Event) -> None:
        assert self.autoscaler_loop is not None
        await self._plan()  # until then the pools keep their size
        await self.autoscaler_loop.run(stop)

    def _read_profiles_file(self) -> tuple[dict[str, HourOfWeekProfile], dict[str, float]]:
        path = self.profiles_path
        if path.stat().st_size > _MAX_PROFILES_BYTES:
            raise ValueError(f"larger than {_MAX_PROFILES_BYTES} bytes")
        self._profiles_mtime = path.stat().st_mtime_ns
        data = json.loads(path.read_text())
        pools = data["pools"]
        if not isinstance(pools, dict):
            raise ValueError("'pools' must be an object")
        capacity = data.get("capacity") or {}
        if not isinstance(capacity, dict):
            raise ValueError("'capacity' must be an object")
        learned = {
            str(k): float(v)
            for k, v in capacity.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and v > 0
        }
        return {str(k): HourOfWeekProfile.from_json(v) for k, v in pools.items()}, learned

    def _load_profiles(self) -> tuple[dict[str, HourOfWeekProfile], dict[str, float]]:
        path = self.profiles_path
        try:
            if not path.exists():
                return {}, {}
            profiles, capacity = self._read_profiles_file()
        except Exception as exc:  # a damaged file costs the history, never the start
            log.warning("autoscaler: ignoring the saved profiles in %s: %s", path, exc)
            return {}, {}
        log.info(
            "autoscaler: read the learned load profiles of %s from %s", ", ".join(sorted(profiles)), path
        )
        return profiles, capacity

    def _pick_up_imports(self) -> None:
        """A profile written since the last save (``tidal autoscale import-profile`` while this
        scheduler runs) replaces what the pool learned, instead of being overwritten."""
        path = self.profiles_path
        try:
            if self._profiles_mtime is None or path.stat().st_mtime_ns == self._profiles_mtime:
                return
            profiles, _ = self._read_profiles_file()
        except FileNotFoundError:
            return
        except Exception as exc:
            log.warning("autoscaler: ignoring the changed profiles in %s: %s", path, exc)
            return
        scalers = {s.pool: s for s in self.autoscaler_loop.scalers} if self.autoscaler_loop else {}
        for pool, profile in profiles.items():
            if pool in scalers:
                self.profiles[pool] = profile
                scalers[pool].forecaster.profile = profile
                log.info("autoscaler %s: using the load profile written to %s", pool, path)

    def save_profiles(self) -> None:
        """Write what the autoscalers learned (atomically: a crash mid-write keeps the old file)."""
        if not self.profiles:
            return
        self._pick_up_imports()
        data: dict[str, Any] = {"pools": {k: v.to_json() for k, v in self.profiles.items()}}
        if self.learned_capacity is not None:
            data["capacity"] = self.learned_capacity.learned()
        self.profiles_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.profiles_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.profiles_path)
        self._profiles_mtime = self.profiles_path.stat().st_mtime_ns

    async def _save_profiles_every(self, period_s: float) -> None:
        while True:
            await self.clock.sleep(period_s)
            try:
                await asyncio.to_thread(self.save_profiles)
            except OSError as exc:
                log.warning("autoscaler: cannot save the learned profiles: %s", exc)

    def describe(self) -> list[str]:
        """One line per loop: what runs on which pools (printed at start)."""
        lines: list[str] = []
        if self.gates:
            spec = self.fleet.gate
            lines.append(
                f"batch gate on {', '.join(g.pool for g in self.gates)}: pause at queue wait p95 >= "
                f"{spec.queue_wait_p95_pause_s} s or KV usage >= {spec.kv_usage_pause}, resume after "
                f"{spec.hold_s} s calm, sampled every {spec.sample_interval_s} s"
            )
        else:
            lines.append("batch gate: off (no shared pool)" if self.options.gate else "batch gate: off")
        if self.prober is not None:
            lines.append(
                f"health: a probe per replica every {self.options.probe_period_s} s "
                f"(timeout {self.options.probe_timeout_s} s, back after {self.options.recover_after} successes)"
            )
        else:
            lines.append("health: off")
        if self.actuators:
            lines.append(
                "autoscaler: "
                + "; ".join(self._describe_pool(pool, a) for pool, a in sorted(self.actuators.items()))
            )
        else:
            lines.append(
                "autoscaler: off (no pool with autoscale)" if self.options.autoscale else "autoscaler: off"
            )
        if self.canaries:
            lines.append(
                "canary: "
                + ", ".join(
                    f"{pool} ({c.spec.canary_group} vs {c.spec.baseline_group}, steps "
                    f"{', '.join(f'{s:g}' for s in c.spec.steps)})"
                    for pool, c in sorted(self.canaries.items())
                )
            )
        for pool, done in sorted(self.canary_outcomes.items()):
            pool_spec = self.fleet.pools.get(pool)
            if (
                pool not in self.canaries
                and pool_spec is not None
                and pool_spec.canary_group == done.get("group")
            ):
                lines.append(
                    f"canary: {pool} group {done.get('group')} already {done.get('outcome')} "
                    f"({done.get('reason', '')}); recorded in {self.outcomes_path}"
                )
        return lines

    def _describe_pool(self, pool: str, actuator: Actuator) -> str:
        spec = self.fleet.pools[pool].autoscale
        assert spec is not None
        head = f"{pool} ({actuator.name} actuator): {spec.min_replicas}-{spec.max_replicas} replicas, {spec.policy}"
        plan = self.capacity_plans.get(pool)
        if plan is not None:
            cap = f"planned capacity {plan.rps:.1f} rps per replica: {plan.source}"
        elif spec.capacity_from == "plan":
            cap = "planned capacity: measuring on the simulated replica"
        else:
            cap = f"capacity {spec.capacity_rps_per_replica:g} rps per replica (set by hand)"
        if spec.learn_capacity:
            cap += ", learned online from what the replicas sustain within the SLO"
        return f"{head}, {cap}"

    # -- running ---------------------------------------------------------------------------------

    def serve_metrics(self, host: str, port: int) -> None:
        """Serve the scheduler's Prometheus metrics on ``http://host:port/metrics`` (until close)."""
        server, _ = start_http_server(port, addr=host, registry=self.metrics.registry)
        self._metrics_server = server

    async def run(self, stop: asyncio.Event) -> None:
        """Run every loop until ``stop`` is set; a loop that dies stops the service with its error."""
        loops: list[asyncio.Task[None]] = []
        if self.gate_controller is not None:
            loops.append(asyncio.create_task(self.gate_controller.run(stop), name="gate"))
        if self.prober is not None:
            loops.append(asyncio.create_task(self.prober.run(stop), name="health"))
        if self.autoscaler_loop is not None:
            loops.append(asyncio.create_task(self._autoscale(stop), name="autoscaler"))
            loops.append(
                asyncio.create_task(self._save_profiles_every(self.options.profile_save_s), name="profiles")
            )
        canaries = [
            asyncio.create_task(self._canary(pool, ctl, stop), name=f"canary-{pool}")
            for pool, ctl in self.canaries.items()
        ]
        stopped = asyncio.create_task(stop.wait(), name="stop")
        failed: BaseException | None = None
        try:
            done, _ = await asyncio.wait([stopped, *loops], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopped and not t.cancelled() and t.exception() is not None:
                    failed = t.exception()
                    log.error("scheduler: the %s loop failed: %r", t.get_name(), failed)
        finally:
            for t in [stopped, *loops, *canaries]:
                t.cancel()
            await asyncio.gather(stopped, *loops, *canaries, return_exceptions=True)
            await self._stop_cleanly()
        if failed is not None:
            raise failed

    async def _canary(self, pool: str, ctl: CanaryController, stop: asyncio.Event) -> None:
        """Run one pool's rollout to its end; a start that fails (groups not registered yet) is retried."""
        while not stop.is_set():
            try:
                state = await ctl.run(stop)
            except Exception as exc:
                log.warning("canary %s: cannot start yet (%s); retrying in %.0f s", pool, exc, ctl.interval_s)
                await self.clock.sleep(ctl.interval_s)
                continue
            if state in (CanaryState.PROMOTED, CanaryState.ROLLED_BACK):
                log.info("canary %s: %s (%s)", pool, state.value, ctl.reason)
                self.canary_outcomes[pool] = {
                    "group": ctl.spec.canary_group,
                    "outcome": state.value,
                    "reason": ctl.reason[:1000],
                }
                try:
                    await asyncio.to_thread(self._save_outcomes)
                except OSError as exc:
                    log.warning("canary %s: cannot record the outcome: %s", pool, exc)
            return

    def _load_outcomes(self) -> dict[str, dict[str, str]]:
        path = self.outcomes_path
        try:
            if not path.exists():
                return {}
            if path.stat().st_size > _MAX_PROFILES_BYTES:
                raise ValueError(f"larger than {_MAX_PROFILES_BYTES} bytes")
            pools = json.loads(path.read_text())["pools"]
            if not isinstance(pools, dict):
                raise ValueError("'pools' must be an object")
            return {str(k): {str(a): str(b) for a, b in v.items()} for k, v in pools.items()}
        except Exception as exc:  # unreadable: every configured canary rolls out again
            log.warning("canary: ignoring the recorded outcomes in %s: %s", path, exc)
            return {}

    def _save_outcomes(self) -> None:
        self.outcomes_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.outcomes_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pools": self.canary_outcomes}, indent=1))
        os.replace(tmp, self.outcomes_path)

    async def _stop_cleanly(self) -> None:
        try:
            self.save_profiles()
        except OSError as exc:
            log.warning("autoscaler: cannot save the learned profiles: %s", exc)
        if self.options.pause_on_stop and self.lane is not None:
            for g in self.gates:
                try:
                    ack = await asyncio.wait_for(
                        self.lane.pause(g.pool, "scheduler_stopped"), self.options.stop_timeout_s
                    )
                    log.info("gate %s: paused for the scheduler's stop (%s)", g.pool, ack.detail)
                except Exception as exc:
                    log.warning("gate %s: could not pause at stop: %s", g.pool, exc)
        await self.aclose()

    async def aclose(self) -> None:
        """Close what the service started: probers' connections, local replicas, the lane switch."""
        if self._generation is not None:
            await self._generation.aclose()
        for obj in reversed(self._closers):
            with contextlib.suppress(Exception):
                close = getattr(obj, "aclose", None)
                if close is not None:
                    await close()
                else:
                    await asyncio.to_thread(obj.close)
        self._closers.clear()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
