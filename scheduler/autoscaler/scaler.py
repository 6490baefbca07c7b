"""The autoscaler: the machinery around a decision policy that always runs.

Per pool, each step it (1) asks the actuator what is ready and what is starting, (2) feeds the
observed rate to the hour-of-week profile (and the load to a capacity that learns), (3) asks the policy plugin how many replicas are
needed, (4) clamps to ``[min_replicas, max_replicas]``, (5) stabilises: **up at once**, **down
slowly** -- only to the largest answer of the last ``scale_down_stabilisation_s`` and only when
the policy says the pool is in a trough, (6) tells the actuator, and (7) offers the replicas a
trough leaves idle to batch (``tidal_autoscaler_trough_spare_replicas``).

:class:`AutoscalerLoop` runs every pool's autoscaler every ``decision_interval_s`` from one
load source. The virtual-time benchmark (``tidal bench autoscale``) drives the same
:class:`Autoscaler` objects with a virtual clock.

Example::

    scaler = Autoscaler("interactive", spec, make_policy("tidal"), capacity=capacity,
                        actuator=GaugeActuator(), forecaster=Forecaster(profile, calendar), clock=clock)
    step = await scaler.step(now_unix, report.pools["interactive"])
    step.target, step.reason
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tidal.clock import Clock
from tidal.fleet import AutoscalerSpec
from tidal.scheduler.autoscaler.actuators import Actuator
from tidal.scheduler.autoscaler.capacity import LearnsCapacity, ReplicaCapacity
from tidal.scheduler.autoscaler.forecast import Forecaster
from tidal.scheduler.autoscaler.policy import ScaleInput, ScalePolicy
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.signals import LoadSource, PoolLoad

__all__ = ["Autoscaler", "AutoscalerLoop", "ScaleStep"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScaleStep:
    """What one autoscaler step saw and did."""

    pool: str
    at: float
    desired: int  # the policy's answer, within bounds
    target: int  # after stabilisation: what the actuator was asked for
    ready: int
    starting: int
    trough: bool
    spare: int  # replicas offered to batch
    predicted_rps: float | None
    reason: str


# How long the loop waits for one actuator call before counting it as failed and going on.
ACTUATOR_TIMEOUT_S = 30.0


class Autoscaler:
    """One pool's autoscaler (see the module docstring)."""

    def __init__(
        self,
        pool: str,
        spec: AutoscalerSpec,
        policy: ScalePolicy,
        *,
        capacity: ReplicaCapacity,
        actuator: Actuator,
        clock: Clock,
        forecaster: Forecaster | None = None,
        metrics: SchedulerMetrics | None = None,
        learn: bool = True,
        lent_to_batch: Callable[[str], bool] | None = None,
        actuator_timeout_s: float = ACTUATOR_TIMEOUT_S,
    ) -> None:
        self.pool = pool
        self.actuator_timeout_s = actuator_timeout_s
        self.spec = spec
        self.policy = policy
        self.capacity = capacity
        self.actuator = actuator
        self.clock = clock
        self.forecaster = forecaster or Forecaster()
        self.metrics = metrics or SchedulerMetrics()
        self.learn = learn
        # Whether the pool is lent to batch right now (the batch gate is open), if known.
        self.lent_to_batch = lent_to_batch or (lambda pool: False)
        self.target: int | None = None
        # (monotonic time, answer, how long it counts for scale-down)
        self._window: deque[tuple[float, int, float]] = deque()
        self._sent: int | None = None
        self._scaling: asyncio.Task[None] | None = None  # an actuator call still running
        # Every series this pool reports exists from the start, at 0 (not "no data").
        self.metrics.actuator_errors.labels(pool, actuator.name)
        for direction in ("up", "down", "hold"):
            self.metrics.scale_decisions.labels(pool, policy.type_name, direction)

    def _forecast(self, start: float, end: float) -> float | None:
        return self.forecaster.peak(start, end)

    async def step(self, now: float, load: PoolLoad | None) -> ScaleStep:
        """One decision at wall time ``now`` (Unix seconds) with the pool's current load."""
        spec = self.spec
        seen = await self.actuator.observe(self.pool, load)
        profile = self.forecaster.profile
        # An event's load is the calendar's business; learning it would count it twice.
        if (
            self.learn
            and load is not None
            and profile is not None
            and not self.forecaster.calendar.active(now)
        ):
            profile.observe(now, load.requests_per_s)
        lent = self.lent_to_batch(self.pool)
        if load is not None and isinstance(self.capacity, LearnsCapacity):
            self.capacity.observe(self.pool, load, seen.ready, lent_to_batch=lent)
        cap = self.capacity.capacity_rps(self.pool)
        inp = ScaleInput(
            pool=self.pool,
            now=now,
            spec=spec,
            ready=seen.ready,
            starting=seen.starting,
            load=load,
            capacity_rps=cap,
            forecast=self._forecast,
            lent_to_batch=lent,
        )
        t0 = time.perf_counter()
        decision = self.policy.decide(inp)
        self.metrics.scale_decision_seconds.labels(self.policy.type_name).observe(time.perf_counter() - t0)
        desired = min(spec.max_replicas, max(spec.min_replicas, decision.replicas))

        mono = self.clock.now()
        if self.target is None:
            # What runs at start counts as a recent answer: a restart must not shrink the pool at once.
            self._window.append((mono, seen.total, spec.scale_down_stabilisation_s))
        hold = spec.scale_down_stabilisation_s
        if decision.hold_s is not None:
            hold = min(hold, decision.hold_s)
        self._window.append((mono, desired, hold))
        while self._window and mono - self._window[0][0] > spec.scale_down_stabilisation_s:
            self._window.popleft()
        current = self.target if self.target is not None else seen.total
        if desired >= current:
            target = desired  # fast up
        elif decision.trough:
            # slow down: the largest recent answer (each counts for its hold)
            target = max(v for t, v, h in self._window if mono - t <= h)
        else:
            target = current
        target = min(spec.max_replicas, max(spec.min_replicas, target))
        direction = "up" if target > current else "down" if target < current else "hold"
        self.metrics.scale_decisions.labels(self.pool, self.policy.type_name, direction).inc()
        if direction != "hold":
            log.info(
                "autoscaler %s: %d -> %d replicas (%s; ready %d, starting %d)",
                self.pool,
                current,
                target,
                decision.reason,
                seen.ready,
                seen.starting,
            )
        self.target = target

        if target != self._sent or seen.total != target:
            await self._actuate(target)

        rps = load.requests_per_s if load is not None else 0.0
        need_now = math.ceil(rps * (1 + spec.warm_buffer) / cap - 1e-9)
        spare = max(0, seen.ready - need_now) if decision.trough else 0
        predicted = decision.parts.get("predicted_rps")
        predicted = None if predicted is None or math.isnan(predicted) else predicted
        m = self.metrics
        m.desired_replicas.labels(self.pool).set(target)
        m.capacity_rps.labels(self.pool).set(cap)
        m.ready_replicas.labels(self.pool).set(seen.ready)
        m.starting_replicas.labels(self.pool).set(seen.starting)
        m.trough_spare.labels(self.pool).set(spare)
        if predicted is not None:
            m.predicted_rps.labels(self.pool).set(predicted)
        return ScaleStep(
            pool=self.pool,
            at=now,
            desired=desired,
            target=target,
            ready=seen.ready,
            starting=seen.starting,
            trough=decision.trough,
            spare=spare,
            predicted_rps=predicted,
            reason=decision.reason,
        )

    async def _actuate(self, target: int) -> None:
        """Ask the actuator for ``target`` replicas. A failure is counted and the next step
        retries; a call that hangs (an API server that accepts and never answers) is counted as
        failed after ``actuator_timeout_s`` and left to finish on its own -- cancelling it could
        leave a half-stopped replica -- and no new call is placed while it runs."""
        if self._scaling is not None and not self._scaling.done():
            self._actuator_failed("the previous call is still running")
            return
        task = self._scaling = asyncio.ensure_future(self.actuator.scale(self.pool, target))
        await asyncio.wait({task}, timeout=self.actuator_timeout_s)
        if not task.done():
            self._actuator_failed(f"no answer in {self.actuator_timeout_s:g} s")
            # Whatever it ends with later is only logged; the next call decides afresh.
            task.add_done_callback(self._late_answer)
            return
        self._scaling = None
        if task.cancelled():
            self._actuator_failed("cancelled")
        elif (exc := task.exception()) is not None:
            self._actuator_failed(str(exc) or repr(exc))
        else:
            self._sent = target

    def _late_answer(self, task: asyncio.Task[None]) -> None:
        exc = None if task.cancelled() else task.exception()
        log.info("autoscaler %s: a late actuator call ended (%s)", self.pool, "ok" if exc is None else exc)

    def _actuator_failed(self, why: str) -> None:
        self.metrics.actuator_errors.labels(self.pool, self.actuator.name).inc()
        log.warning("autoscaler %s: actuator %s failed: %s", self.pool, self.actuator.name, why)


class AutoscalerLoop:
    """Runs every pool's :class:`Autoscaler` from one load source, every ``interval_s``."""

    def __init__(
        self,
        scalers: Sequence[Autoscaler],
        *,
        source: LoadSource,
        clock: Clock,
        interval_s: float | None = None,
    ) -> None:
        if not scalers:
            raise ValueError("no pool to autoscale")
        self.scalers = list(scalers)
        self.source = source
        self.clock = clock
        self.interval_s = interval_s or min(s.spec.decision_interval_s for s in scalers)
        self.last: dict[str, ScaleStep] = {}

    async def step(self) -> list[ScaleStep]:
        """One round; without a load report nothing is decided (the pools keep their size)."""
        try:
            report = await self.source.load()
        except Exception as exc:
            log.warning("autoscaler: cannot read load, holding: %s", exc)
            return []
        steps = []
        for s in self.scalers:
            try:
                step = await s.step(report.time, report.pools.get(s.pool))
            except Exception as exc:  # e.g. the actuator cannot observe: this pool holds, the others go on
                s.metrics.actuator_errors.labels(s.pool, s.actuator.name).inc()
                log.warning("autoscaler %s: step failed, holding: %s", s.pool, exc)
                continue
            self.last[s.pool] = step
            steps.append(step)
        return steps

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        while not stop.is_set():
            await self.step()
            await self.clock.sleep(self.interval_s)
