"""The batch gate: per shared pool, pause batch work when interactive users need the replicas.

:class:`BatchGate` is the state machine of one pool (open / paused) with hysteresis:

* **pause** as soon as the interactive queue wait p95 or the largest replica KV-cache usage
  reaches its pause threshold (``GateSpec``), or when no load sample has arrived for
  ``signal_timeout_s`` (a scheduler that cannot see users must not lend their replicas);
* **resume** only after both signals stayed at or below their resume thresholds for the hold
  time. A pause that follows a resume within ``flap_window_s`` doubles the hold (up to
  ``max_hold_s``), so a pool whose own batch load pushes it back over the line does not flap.

KV usage counts batch sequences too, so the KV seen while paused understates what resuming
brings back: a pool whose batch share spans the hysteresis band pauses on its own batch KV,
calms once batch has left, resumes and pauses again, all day. So the gate learns batch's share
at each pause (the KV at the pause less the KV ``drain_s`` later, once batch has left; at most
``max_batch_kv``) and resumes on KV only when the usage is at or below the resume threshold
*and* the usage plus batch's share stays ``kv_margin`` (0.05) below the pause threshold. A wider
margin pauses less often but lends fewer busy-but-not-full hours to batch.

:class:`GateController` is the built-in control loop: it samples a :class:`LoadSource` every
``sample_interval_s`` (at most 250 ms), feeds each gate, and drives a :class:`LaneController`
until the lane has acknowledged the gate's state. Pausing is explicit and acknowledged:
``LaneController.pause`` returns only when the batch side confirmed it stopped dispatching to the
pool; an unconfirmed or failed call is retried with backoff, never assumed.

Every transition is logged and counted (``tidal_gate_transitions_total{pool,to,reason}``).

Example::

    gate = BatchGate("interactive", fleet.gate, clock=clock)
    loop = GateController([gate], source=gateway_admin, lane=lanes, clock=clock)
    await loop.run(stop)          # or: await loop.step() from a test driving a ManualClock
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from tidal.clock import Clock
from tidal.fleet import GateSpec
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.signals import LoadReport, LoadSource

__all__ = [
    "BatchGate",
    "GateController",
    "GateSample",
    "GateState",
    "LaneAck",
    "LaneController",
    "Transition",
]

log = logging.getLogger(__name__)


class GateState(StrEnum):
    OPEN = "open"
    PAUSED = "paused"


@dataclass(frozen=True, slots=True)
class GateSample:
    """What the gate decides on: interactive queue wait p95 and the largest KV-cache usage (0-1)."""

    queue_wait_p95_s: float
    kv_usage: float


@dataclass(frozen=True, slots=True)
class Transition:
    """One change of a gate's state; ``reason`` is a short label, ``detail`` the values behind it."""

    pool: str
    to: GateState
    reason: str
    detail: str
    at: float


class BatchGate:
    """The open/paused state machine of one shared pool (see the module docstring).

    Starts **paused** (reason ``startup``): a freshly started scheduler lends replicas to batch
    only after it has seen the pool calm for the hold time.
    """

    def __init__(
        self,
        pool: str,
        spec: GateSpec,
        *,
        clock: Clock,
        signal_timeout_s: float = 2.0,
        flap_window_s: float | None = None,
        max_hold_s: float | None = None,
        drain_s: float = 2.0,
        max_batch_kv: float | None = None,
        kv_margin: float = 0.05,
        initial: GateState = GateState.PAUSED,
    ) -> None:
        self.pool = pool
        self.spec = spec
        self.clock = clock
        self.signal_timeout_s = signal_timeout_s
        self.flap_window_s = flap_window_s if flap_window_s is not None else max(3 * spec.hold_s, 30.0)
        self.max_hold_s = max_hold_s if max_hold_s is not None else max(16 * spec.hold_s, spec.hold_s)
        self.drain_s = drain_s
        # The learned KV share of lent batch work is capped, so the gate can always reopen once
        # interactive KV usage is low enough.
        self.max_batch_kv = max_batch_kv if max_batch_kv is not None else spec.kv_usage_resume / 2
        self.kv_margin = kv_margin
        self.batch_kv = 0.0
        self._kv_at_pause: float | None = None
        self.state = initial
        self.hold_s = spec.hold_s
        self.reason = "startup"
        now = clock.now()
        self.since = now
        self._calm_since: float | None = None
        self._last_sample_at = now
        self._last_resume_at: float | None = None
        self.last_sample: GateSample | None = None

    def observe(self, sample: GateSample | None) -> Transition | None:
        """Feed one sample (``None``: the source gave none); returns the transition, if any."""
        now = self.clock.now()
        if sample is None:
            silent = now - self._last_sample_at
            self._calm_since = None
            if self.state is GateState.OPEN and silent >= self.signal_timeout_s:
                return self._pause(now, "signal_lost", f"no load sample for {silent:.2f} s")
            return None
        self._last_sample_at = now
        self.last_sample = sample
        spec = self.spec
        if self.state is GateState.OPEN:
            over: list[str] = []
            details: list[str] = []
            if sample.queue_wait_p95_s >= spec.queue_wait_p95_pause_s:
                over.append("queue_wait")
                details.append(
                    f"queue wait p95 {sample.queue_wait_p95_s:.3f} s >= {spec.queue_wait_p95_pause_s} s"
                )
            if sample.kv_usage >= spec.kv_usage_pause:
                over.append("kv_usage")
                details.append(f"KV usage {sample.kv_usage:.3f} >= {spec.kv_usage_pause}")
            if over:
                return self._pause(now, "+".join(over), "; ".join(details))
            return None
        if self._kv_at_pause is not None and now - self.since >= self.drain_s:
            # Batch has left the replicas by now: what the KV usage lost is its share.
            self.batch_kv = min(max(0.0, self._kv_at_pause - sample.kv_usage), self.max_batch_kv)
            self._kv_at_pause = None
        calm = (
            sample.queue_wait_p95_s <= spec.queue_wait_p95_resume_s
            and sample.kv_usage <= spec.kv_usage_resume
            # With batch back, the KV must stay clear of the pause threshold (see the docstring).
            and sample.kv_usage + self.batch_kv <= spec.kv_usage_pause - self.kv_margin
        )
        if not calm:
            self._calm_since = None
            return None
        if self._calm_since is None:
            self._calm_since = now
        if now - self._calm_since >= self.hold_s:
            return self._resume(now)
        return None

    def _pause(self, now: float, reason: str, detail: str) -> Transition:
        if self._last_resume_at is not None and now - self._last_resume_at < self.flap_window_s:
            # Paused again soon after resuming: the batch load itself tips the pool, so wait longer.
            self.hold_s = min(max(self.hold_s * 2, self.spec.hold_s), self.max_hold_s)
            detail += f" (re-paused {now - self._last_resume_at:.1f} s after resuming; hold now {self.hold_s:.0f} s)"
        else:
            self.hold_s = self.spec.hold_s
        # While open, batch ran: the KV now includes its share (measured once it has drained).
        last = self.last_sample
        self._kv_at_pause = last.kv_usage if self.state is GateState.OPEN and last is not None else None
        self.state = GateState.PAUSED
        self.reason = reason
        self.since = now
        self._calm_since = None
        return Transition(self.pool, GateState.PAUSED, reason, detail, now)

    def _resume(self, now: float) -> Transition:
        assert self.last_sample is not None
        s = self.last_sample
        sp = self.spec
        detail = (
            f"queue wait p95 <= {sp.queue_wait_p95_resume_s} s and KV usage <= {sp.kv_usage_resume} "
            f"(plus batch's share {self.batch_kv:.2f} <= {sp.kv_usage_pause - self.kv_margin:.2f}) "
            f"for {self.hold_s:.1f} s (now {s.queue_wait_p95_s:.3f} s, {s.kv_usage:.3f})"
        )
        self.state = GateState.OPEN
        self.reason = "calm"
        self.since = now
        self._calm_since = None
        self._last_resume_at = now
        return Transition(self.pool, GateState.OPEN, "calm", detail, now)


@dataclass(frozen=True, slots=True)
class LaneAck:
    """The batch side's answer to a pause or resume: ``confirmed`` only once it really took effect."""

    confirmed: bool
    detail: str = ""
    workers: tuple[str, ...] = ()


class LaneController(Protocol):
    """Stops and restarts batch dispatch to a shared pool (the batch tier's shared lane).

    ``pause`` must return only when the batch side confirmed that no new batch work goes to the
    pool (and in-flight shared-lane chunks were told to abort and requeue); ``resume`` when it
    consumes again. Both must be idempotent: the controller re-sends them until confirmed.
    """

    async def pause(self, pool: str, reason: str) -> LaneAck: ...

    async def resume(self, pool: str, reason: str) -> LaneAck: ...


def sample_of(report: LoadReport, pool: str) -> GateSample | None:
    load = report.pools.get(pool)
    if load is None:
        return None
    return GateSample(queue_wait_p95_s=load.queue_wait_p95_s, kv_usage=load.kv_cache_usage_max)


class GateController:
    """The gate's control loop: sample, decide, and drive the lane until it acknowledges."""

    def __init__(
        self,
        gates: Sequence[BatchGate],
        *,
        source: LoadSource,
        lane: LaneController,
        clock: Clock,
        metrics: SchedulerMetrics | None = None,
        actuation_timeout_s: float = 5.0,
        max_retry_s: float = 5.0,
        on_transition: Callable[[Transition], None] | None = None,
    ) -> None:
        if not gates:
            raise ValueError("the gate controller needs at least one shared pool")
        self.gates = {g.pool: g for g in gates}
        if len(self.gates) != len(gates):
            raise ValueError("one gate per pool")
        self.source = source
        self.lane = lane
        self.clock = clock
        self.metrics = metrics or SchedulerMetrics()
        self.actuation_timeout_s = actuation_timeout_s
        self.max_retry_s = max_retry_s
        self.interval_s = min(g.spec.sample_interval_s for g in gates)
        self.on_transition = on_transition
        # What the lane last confirmed per pool (None: unknown, e.g. right after start).
        self.applied: dict[str, GateState | None] = dict.fromkeys(self.gates)
        self._next_try: dict[str, float] = {p: -float("inf") for p in self.gates}
        self._backoff: dict[str, float] = dict.fromkeys(self.gates, 0.0)
        self._source_failing = False
        for g in gates:
            self.metrics.gate_paused.labels(g.pool).set(1.0 if g.state is GateState.PAUSED else 0.0)
            for action in ("pause", "resume"):  # at 0, so rates and alerts read 0, not "no data"
                self.metrics.gate_actuation_failures.labels(g.pool, action)

    async def step(self) -> list[Transition]:
        """One iteration: read the load, feed every gate, reconcile the lane with the gates."""
        t0 = time.perf_counter()
        report: LoadReport | None
        try:
            report = await self.source.load()
        except Exception as exc:  # any failure of the source is "no sample", never a crash
            self.metrics.gate_signal_errors.inc()
            # Once per outage, not four times a second (tidal_gate_signal_errors_total counts them all).
            log.log(
                logging.DEBUG if self._source_failing else logging.WARNING, "gate: cannot read load: %s", exc
            )
            self._source_failing = True
            report = None
        else:
            if self._source_failing:
                log.info("gate: load readable again")
            self._source_failing = False
        transitions: list[Transition] = []
        for pool, gate in self.gates.items():
            sample = sample_of(report, pool) if report is not None else None
            if sample is not None:
                self.metrics.gate_queue_wait.labels(pool).set(sample.queue_wait_p95_s)
                self.metrics.gate_kv_usage.labels(pool).set(sample.kv_usage)
            tr = gate.observe(sample)
            if tr is not None:
                transitions.append(tr)
                self._record(tr)
        self.metrics.gate_decision_seconds.observe(time.perf_counter() - t0)
        await self.reconcile()
        return transitions

    def _record(self, tr: Transition) -> None:
        self.metrics.gate_transitions.labels(tr.pool, tr.to.value, tr.reason).inc()
        self.metrics.gate_paused.labels(tr.pool).set(1.0 if tr.to is GateState.PAUSED else 0.0)
        log.info("gate %s -> %s (%s): %s", tr.pool, tr.to.value, tr.reason, tr.detail)
        # A new target state deserves an immediate attempt, whatever the previous backoff.
        self._next_try[tr.pool] = -float("inf")
        self._backoff[tr.pool] = 0.0
        if self.on_transition is not None:
            self.on_transition(tr)

    async def reconcile(self) -> None:
        """Send pause/resume to every pool whose lane has not confirmed the gate's state."""
        now = self.clock.now()
        due = [
            g for p, g in self.gates.items() if self.applied[p] is not g.state and now >= self._next_try[p]
        ]
        if due:
            await asyncio.gather(*(self._actuate(g) for g in due))

    async def _actuate(self, gate: BatchGate) -> None:
        pool, target = gate.pool, gate.state
        action = "pause" if target is GateState.PAUSED else "resume"
        call = self.lane.pause if target is GateState.PAUSED else self.lane.resume
        start = self.clock.now()
        try:
            ack = await asyncio.wait_for(call(pool, gate.reason), self.actuation_timeout_s)
            error = None if ack.confirmed else f"not confirmed: {ack.detail}"
        except Exception as exc:  # a failed actuation is retried; the loop must keep sampling
            error = f"{type(exc).__name__}: {exc}"
        if gate.state is not target:
            return  # the gate moved on while we waited; the next reconcile sends the new state
        if error is None:
            self.applied[pool] = target
            elapsed = self.clock.now() - start
            self.metrics.gate_actuation_seconds.labels(pool, action).observe(elapsed)
            log.info("gate %s: lane confirmed %s in %.3f s (%s)", pool, action, elapsed, ack.detail)
            return
        self.metrics.gate_actuation_failures.labels(pool, action).inc()
        self._backoff[pool] = min(max(self._backoff[pool] * 2, self.interval_s), self.max_retry_s)
        self._next_try[pool] = self.clock.now() + self._backoff[pool]
        log.warning("gate %s: %s failed (%s); retrying in %.2f s", pool, action, error, self._backoff[pool])

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Sample every ``interval_s`` until ``stop`` is set (or the task is cancelled)."""
        stop = stop or asyncio.Event()
        next_at = self.clock.now()
        while not stop.is_set():
            await self.step()
            next_at += self.interval_s
            delay = next_at - self.clock.now()
            if delay < 0:  # an overrun (slow source or lane) must not turn into a burst of samples
                next_at, delay = self.clock.now(), 0.0
            await self.clock.sleep(delay)

    def status(self) -> dict[str, dict[str, object]]:
        """Each pool's gate state, reason, hold and what the lane confirmed (for logs and the CLI)."""
        return {
            p: {
                "state": g.state.value,
                "reason": g.reason,
                "since": g.since,
                "hold_s": g.hold_s,
                "batch_kv": g.batch_kv,
                "applied": _value(self.applied[p]),
            }
            for p, g in self.gates.items()
        }


def _value(state: GateState | None) -> str | None:
    return state.value if state is not None else None
