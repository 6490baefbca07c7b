"""The canary controller: roll a new build forward or back by router weight, automatically.

A pool holds a baseline group (``stable``) and a canary group (replicas of the new build,
registered with ``group: canary``). The controller gives the canary the first share of traffic
(``steps[0]``, e.g. 5%) through the replicas' router weights, and then, each round:

* compares the canary's **error rate** with the baseline's over the same period (the gateway's
  ``/admin/load`` ``groups`` counters): a one-sided two-proportion z-test; the canary fails if
  its rate is higher by more than ``max_error_rate_increase`` *and* the test is significant
  (``z > z_crit``);
* compares an **offline-eval score** of each group (the batch tier's eval job kind, run against
  each group's replicas through an :class:`EvalRunner`): the canary fails if it scores more
  than ``max_eval_drop`` below the baseline;
* a failure **rolls back** at once (canary weight 0, baseline weights restored); a step that
  lasted ``step_s`` with at least ``min_requests`` canary requests and no failure moves to the
  next share; after the last step, with the eval passed, the canary is **promoted** (canary
  weight 1, baseline weight 0). The baseline replicas stay up, serving their share, until then.

Weights assume the router splits traffic between replicas in proportion to their weights; a
group's share is the sum of its replicas' weights over the pool's total.

Example::

    ctl = CanaryController(gateway_admin, gateway_admin, evals=eval_runner, pool="interactive",
                           spec=CanarySpec(steps=(0.05, 0.25, 0.5)), clock=SystemClock())
    outcome = await ctl.run()          # CanaryState.PROMOTED or CanaryState.ROLLED_BACK
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from tidal.clock import Clock
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.signals import LoadSource, ReplicaRegistry, ReplicaView

__all__ = ["CanaryController", "CanarySpec", "CanaryState", "EvalRunner", "error_rate_worse", "group_weights"]

log = logging.getLogger(__name__)

_MAX_WEIGHT = 1000.0  # the gateway's bound on a replica weight


class EvalRunner(Protocol):
    """Runs the offline eval against one group's replicas; higher scores are better."""

    async def score(self, pool: str, group: str) -> float: ...


class CanaryState(StrEnum):
    PENDING = "pending"
    RAMPING = "ramping"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"


@dataclass(frozen=True, slots=True)
class CanarySpec:
    """How a rollout proceeds and what counts as worse (see the module docstring)."""

    canary_group: str = "canary"
    baseline_group: str = "stable"
    steps: tuple[float, ...] = (0.05, 0.25, 0.5)
    step_s: float = 300.0
    min_requests: int = 100
    max_error_rate_increase: float = 0.01
    z_crit: float = 2.33  # one-sided, about 1% false alarms
    min_requests_to_judge: int = 20
    max_eval_drop: float = 0.02
    require_eval: bool = True
    eval_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if (
            not self.steps
            or any(not 0.0 < s < 1.0 for s in self.steps)
            or list(self.steps) != sorted(self.steps)
        ):
            raise ValueError("steps must be increasing shares strictly between 0 and 1")
        if self.canary_group == self.baseline_group:
            raise ValueError("the canary and baseline groups must differ")


def group_weights(share: float, n_canary: int, n_baseline: int) -> tuple[float, float]:
    """Per-replica weights ``(canary, baseline)`` that give the canary group ``share`` of traffic."""
    if n_canary == 0 or n_baseline == 0 or share >= 1.0:
        return (1.0, 0.0) if share >= 1.0 else (0.0, 1.0)
    if share <= 0.0:
        return 0.0, 1.0
    w_c = share * n_baseline / ((1.0 - share) * n_canary)
    if w_c <= _MAX_WEIGHT:
        return w_c, 1.0
    return _MAX_WEIGHT, _MAX_WEIGHT / w_c  # keep the ratio inside the gateway's bounds


def error_rate_worse(
    canary_errors: float,
    canary_requests: float,
    base_errors: float,
    base_requests: float,
    *,
    max_increase: float,
    z_crit: float,
) -> tuple[bool, str]:
    """One-sided two-proportion z-test: is the canary's error rate significantly and materially higher?"""
    if canary_requests <= 0:
        return False, "no canary requests"
    p_c = canary_errors / canary_requests
    p_b = base_errors / base_requests if base_requests > 0 else 0.0
    detail = f"canary {p_c:.2%} of {canary_requests:.0f} vs baseline {p_b:.2%} of {base_requests:.0f}"
    if p_c - p_b <= max_increase:
        return False, detail
    if base_requests <= 0:
        # Nothing to compare with: judge the canary against the tolerance alone.
        return True, detail + " (no baseline traffic)"
    pooled = (canary_errors + base_errors) / (canary_requests + base_requests)
    se = math.sqrt(pooled * (1 - pooled) * (1 / canary_requests + 1 / base_requests))
    z = math.inf if se == 0 else (p_c - p_b) / se
    return z > z_crit, detail + f", z={z:.2f}"


class _Delta:
    """Growth of a cumulative counter since a mark, surviving a reset of the counter (a gateway
    restart: it fell below half of what it was) and reads that come out of order (a slightly
    lower value: another process of the gateway answered with totals a sync older; skipped)."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.total = 0.0

    def update(self, value: float) -> None:
        if self.last is not None and value < self.last:
            if value >= self.last / 2:
                return  # an older reading: the growth since shows in a later one
            self.total += value  # counted again from zero
        elif self.last is not None:
            self.total += value - self.last
        self.last = value

    def mark(self) -> None:
        self.total = 0.0


class CanaryController:
    """Drives one pool's canary rollout to promotion or rollback (see the module docstring)."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        source: LoadSource,
        *,
        pool: str,
        clock: Clock,
        spec: CanarySpec | None = None,
        evals: EvalRunner | None = None,
        metrics: SchedulerMetrics | None = None,
        interval_s: float = 5.0,
    ) -> None:
        self.registry = registry
        self.source = source
        self.pool = pool
        self.clock = clock
        self.spec = spec or CanarySpec()
        if self.spec.require_eval and evals is None:
            raise ValueError("require_eval is set but no eval runner was given")
        self.evals = evals
        self.metrics = metrics or SchedulerMetrics()
        self.interval_s = interval_s
        self.state = CanaryState.PENDING
        self.step_index = 0
        self.reason = ""
        self._step_started = 0.0
        # cumulative since the rollout started, and since the current step started (canary only)
        self._total = {k: _Delta() for k in ("c_req", "c_err", "b_req", "b_err")}
        self._step_requests = _Delta()
        self._eval_task: asyncio.Task[tuple[float, float]] | None = None
        self.eval_scores: tuple[float, float] | None = None

    @property
    def share(self) -> float:
        if self.state is CanaryState.PROMOTED:
            return 1.0
        if self.state is CanaryState.ROLLED_BACK or self.state is CanaryState.PENDING:
            return 0.0
        return self.spec.steps[self.step_index]

    async def _groups(self) -> tuple[list[ReplicaView], list[ReplicaView]]:
        views = [v for v in await self.registry.replicas() if v.pool == self.pool]
        canary = [v for v in views if v.group == self.spec.canary_group]
        baseline = [v for v in views if v.group == self.spec.baseline_group]
        return canary, baseline

    async def _apply(self, share: float) -> None:
        canary, baseline = await self._groups()
        w_c, w_b = group_weights(share, len(canary), len(baseline))
        # The side that gains traffic first, so the pool never has a moment with no weight at all.
        first, second = (canary, baseline) if share >= 0.5 else (baseline, canary)
        wf, ws = (w_c, w_b) if share >= 0.5 else (w_b, w_c)
        for v in first:
            await self.registry.update(v.name, weight=wf)
        for v in second:
            await self.registry.update(v.name, weight=ws)
        self.metrics.canary_share.labels(self.spec.canary_group).set(share)
        log.info(
            "canary %s: %s share %.1f%% (%d canary replicas at weight %.3g, %d baseline at %.3g)",
            self.pool,
            self.spec.canary_group,
            share * 100,
            len(canary),
            w_c,
            len(baseline),
            w_b,
        )

    async def _read_counters(self) -> None:
        report = await self.source.load()
        c = report.groups.get(self.spec.canary_group)
        b = report.groups.get(self.spec.baseline_group)
        if c is not None:
            self._total["c_req"].update(c.requests)
            self._total["c_err"].update(c.errors)
            self._step_requests.update(c.requests)
        if b is not None:
            self._total["b_req"].update(b.requests)
            self._total["b_err"].update(b.errors)

    async def _run_eval(self) -> tuple[float, float]:
        assert self.evals is not None
        evals = self.evals

        async def both() -> tuple[float, float]:
            base, can = await asyncio.gather(
                evals.score(self.pool, self.spec.baseline_group),
                evals.score(self.pool, self.spec.canary_group),
            )
            return base, can

        return await asyncio.wait_for(both(), self.spec.eval_timeout_s)

    async def start(self) -> None:
        """Check both groups exist, give the canary its first share, start the evals."""
        canary, baseline = await self._groups()
        if not canary or not baseline:
            raise ValueError(
                f"pool {self.pool} needs replicas in both groups "
                f"({self.spec.canary_group}: {len(canary)}, {self.spec.baseline_group}: {len(baseline)})"
            )
        await self._read_counters()  # the marks everything is measured from
        for d in self._total.values():
            d.mark()
        self._step_requests.mark()
        self.state = CanaryState.RAMPING
        self.step_index = 0
        self._step_started = self.clock.now()
        await self._apply(self.share)
        if self.evals is not None:
            self._eval_task = asyncio.create_task(self._run_eval(), name=f"canary-eval-{self.pool}")

    async def step(self) -> CanaryState:
        """Judge once; roll back, advance, promote, or keep waiting."""
        if self.state is not CanaryState.RAMPING:
            return self.state
        spec = self.spec
        await self._read_counters()
        t = {k: d.total for k, d in self._total.items()}
        if t["c_req"] >= spec.min_requests_to_judge:
            worse, detail = error_rate_worse(
                t["c_err"],
                t["c_req"],
                t["b_err"],
                t["b_req"],
                max_increase=spec.max_error_rate_increase,
                z_crit=spec.z_crit,
            )
            if worse:
                return await self._finish(CanaryState.ROLLED_BACK, "error_rate", detail)
        if self._eval_task is not None and self._eval_task.done() and self.eval_scores is None:
            try:
                self.eval_scores = self._eval_task.result()
            except Exception as exc:
                # An eval we cannot run is not a pass: without it the new build is unverified.
                return await self._finish(
                    CanaryState.ROLLED_BACK, "eval_failed", f"{type(exc).__name__}: {exc}"
                )
            base, can = self.eval_scores
            detail = f"eval canary {can:.4f} vs baseline {base:.4f}"
            log.info("canary %s: %s", self.pool, detail)
            if can < base - spec.max_eval_drop:
                return await self._finish(CanaryState.ROLLED_BACK, "eval_score", detail)
        elapsed = self.clock.now() - self._step_started
        if elapsed < spec.step_s or self._step_requests.total < spec.min_requests:
            return self.state
        if self.step_index + 1 < len(spec.steps):
            self.step_index += 1
            self._step_started = self.clock.now()
            self._step_requests.mark()
            await self._apply(self.share)
            return self.state
        if self.evals is not None and self.eval_scores is None:
            return self.state  # every step passed; promotion waits for the eval
        detail = f"errors {t['c_err']:.0f}/{t['c_req']:.0f} vs {t['b_err']:.0f}/{t['b_req']:.0f}"
        if self.eval_scores is not None:
            detail += f"; eval canary {self.eval_scores[1]:.4f} vs baseline {self.eval_scores[0]:.4f}"
        return await self._finish(CanaryState.PROMOTED, "passed", detail)

    async def _finish(self, state: CanaryState, reason: str, detail: str) -> CanaryState:
        self.state = state
        self.reason = f"{reason}: {detail}"
        if self._eval_task is not None and not self._eval_task.done():
            self._eval_task.cancel()
        await self._apply(1.0 if state is CanaryState.PROMOTED else 0.0)
        self.metrics.canary_outcomes.labels(self.spec.canary_group, state.value, reason).inc()
        log.warning("canary %s: %s (%s)", self.pool, state.value, self.reason)
        return state

    async def run(self, stop: asyncio.Event | None = None) -> CanaryState:
        """Start the rollout and judge every ``interval_s`` until promoted or rolled back."""
        stop = stop or asyncio.Event()
        if self.state is CanaryState.PENDING:
            await self.start()
        while self.state is CanaryState.RAMPING and not stop.is_set():
            await self.clock.sleep(self.interval_s)
            try:
                await self.step()
            except Exception as exc:  # a failed read or weight change is retried next round
                log.warning("canary %s: round failed: %s", self.pool, exc)
        return self.state
