"""``tidal bench autoscale``: reactive-only vs predictive + warm buffer + reactive, over a week.

A week of interactive load in virtual time, replayed for each workload: the **synthetic week**
(daily evening peaks, higher at the weekend; a scheduled event -- a cricket final on Saturday
afternoon, announced in the calendar; one unannounced spike on Wednesday late morning; Poisson
arrivals) and, with ``--trace auto`` (the default) when ``../shared/traces`` has it, the **Azure
conversation trace**: the same week shaped minute by minute by the trace's per-minute arrival
counts (over their mean, cycled) and served at the trace's request lengths. A replica takes 3
minutes to start. Every run uses the product's own objects -- :class:`~scheduler.autoscaler.Autoscaler`
with the ``reactive`` or ``tidal`` policy plugin, the hour-of-week profile learned from three
earlier weeks (imported as per-minute rates through :mod:`scheduler.autoscaler.history`), the
event calendar, and the :class:`~scheduler.gate.BatchGate` that lends idle replicas to batch.

Replicas are sized with the **simulated replica's measured capacity**: for each workload, one
replica of ``--preset`` is replayed in virtual time (:mod:`replicas.sim.capacity`) to find the
requests/s it serves at the SLO (TTFT p95 <= 1 s, TPOT p95 <= 50 ms), and its TTFT p95, TPOT p95
and KV usage at a ladder of rates around it; that measured curve is the fleet model
(:class:`MeasuredReplicaModel`) and the measured capacity is what the autoscaler divides load
by. (A week is tens of millions of requests; replaying each on simulated replicas would take
hours, so the fleet's step-by-step behaviour is the replica's measured curve plus a queue.)

Printed per workload and policy: minutes whose TTFT p95 or TPOT p95 is above the SLO, GPU-hours,
batch tokens done on the pool in its troughs, and the ratios against the reactive run; plots go to
``bench/results/autoscale.png`` (synthetic) and ``autoscale-<trace>.png``.

Options: ``--trace auto|none|FILE``; ``--preset NAME``; ``--seed N``; ``--cold-start-s S``;
``--peak-rps R``; ``--days D`` (from Monday; 7); ``--fleet-model sim|analytic`` (``analytic``:
the older stand-in replica with ``--capacity-rps``, for comparison).

Example: tidal bench autoscale --quick
"""

from __future__ import annotations

import asyncio
import logging
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tidal.bench.traces import TraceRequest, block_hashes, find_trace
from tidal.clock import ManualClock
from tidal.fleet import AutoscalerSpec, GateSpec
from tidal.replicas.sim.capacity import Slo, WorkloadRequest, replay
from tidal.replicas.sim.presets import get_preset
from tidal.scheduler.autoscaler import (
    Autoscaler,
    EventCalendar,
    Forecaster,
    HourOfWeekProfile,
    PoolReplicas,
    ScheduledEvent,
    StaticCapacity,
    make_policy,
)
from tidal.scheduler.autoscaler.history import read_history
from tidal.scheduler.gate import BatchGate, GateSample, GateState
from tidal.scheduler.metrics import SchedulerMetrics
from tidal.scheduler.plan.capacity import measure as measure_at_slo
from tidal.scheduler.plan.workload import Workload as RequestMix, load_workload
from tidal.scheduler.signals import PoolLoad

__all__ = [
    "FleetModel",
    "MeasuredReplicaModel",
    "ReplicaModel",
    "Workload",
    "run",
    "simulate",
    "synthetic_week",
]

POOL = "interactive"
WEEK_START = datetime(2026, 3, 2, tzinfo=UTC).timestamp()  # a Monday, 00:00 UTC
DAY = 86400.0
WEEK = 7 * DAY


# -- the fleet model ------------------------------------------------------------------------------


class FleetModel(Protocol):
    """How a pool of ``n`` ready replicas behaves for one step of virtual time."""

    @property
    def capacity_rps(self) -> float: ...

    @property
    def ttft_target_s(self) -> float: ...

    @property
    def tpot_target_s(self) -> float: ...

    @property
    def ttft_idle_s(self) -> float: ...

    def step(self, n: int, arrivals: float, dt: float, backlog: float, batch_on: bool) -> StepOutcome: ...


@dataclass(frozen=True, slots=True)
class StepOutcome:
    ttft_p95_s: float
    queue_wait_s: float
    kv_usage: float
    backlog: float
    batch_tokens: float
    tpot_p95_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ReplicaModel:
    """Analytic replica: within target up to ``capacity_rps``, degraded up to ``saturation`` x it.

    TTFT p95 rises from ``ttft_idle_s`` to the target as utilisation reaches 1 (4th power: flat,
    then steep, as with continuous batching), keeps rising beyond it, and requests beyond the
    saturated rate wait in the gateway's queue. KV usage is ``kv_at_capacity`` x utilisation,
    plus ``batch_kv`` while batch work runs (which also slows interactive steps by
    ``batch_interference``). Batch gets the unused share of each replica at
    ``batch_tokens_per_s``. Its constants are chosen, not measured: ``--fleet-model analytic``
    keeps it for comparison with :class:`MeasuredReplicaModel`.
    """

    capacity_rps: float = 8.0
    ttft_idle_s: float = 0.25
    ttft_target_s: float = 1.0
    tpot_target_s: float = math.inf  # it has no TPOT
    saturation: float = 1.3
    kv_at_capacity: float = 0.8
    batch_kv: float = 0.2
    batch_interference: float = 0.1
    batch_tokens_per_s: float = 2500.0

    def step(self, n: int, arrivals: float, dt: float, backlog: float, batch_on: bool) -> StepOutcome:
        if n <= 0:
            return StepOutcome(math.inf, math.inf, 1.0, backlog + arrivals, 0.0)
        max_rate = n * self.capacity_rps * self.saturation
        pending = backlog + arrivals
        served = min(pending, max_rate * dt)
        backlog = pending - served
        rho = served / dt / (n * self.capacity_rps)
        wait = backlog / max_rate
        ttft = self.ttft_idle_s + (self.ttft_target_s - self.ttft_idle_s) * rho**4
        if batch_on:
            ttft *= 1.0 + self.batch_interference
        kv = min(1.0, self.kv_at_capacity * rho + (self.batch_kv if batch_on else 0.0))
        batch = n * max(0.0, 1.0 - rho) * self.batch_tokens_per_s * dt if batch_on else 0.0
        return StepOutcome(ttft + wait, wait, kv, backlog, batch)


@dataclass(frozen=True)
class MeasuredReplicaModel:
    """One replica as the simulated replica behaves, measured by replaying a workload on it.

    ``capacity_rps`` is the largest Poisson rate whose replay keeps TTFT p95 and TPOT p95 within
    the SLO (:func:`replicas.sim.capacity.measure_capacity`); ``utilisation`` (rate over
    capacity) with ``ttft_p95``, ``tpot_p95`` and ``kv_usage`` is the replica's measured curve at
    a ladder of rates; ``saturation`` is the most completions per second any replay sustained,
    over capacity. A pool of ``n`` replicas serves up to ``n x capacity x saturation`` requests/s
    (the rest waits in the gateway's queue) and each replica sees the curve at the pool's
    utilisation, as with a balanced router. While batch is lent the pool, batch work fills each
    replica up to its capacity: interactive requests see the curve at utilisation 1 (at least),
    and batch gets ``(1 - utilisation) x capacity`` requests/s of ``tokens_per_request`` output
    tokens.
    """

    preset: str
    workload: str
    capacity_rps: float
    ttft_target_s: float
    tpot_target_s: float
    utilisation: tuple[float, ...]
    ttft_p95: tuple[float, ...]
    tpot_p95: tuple[float, ...]
    kv_usage: tuple[float, ...]
    saturation: float
    tokens_per_request: float

    @property
    def ttft_idle_s(self) -> float:
        return self.ttft_p95[0]

    @classmethod
    def measure(
        cls,
        preset: str,
        mix: RequestMix,
        slo: Slo,
        *,
        label: str,
        rel_tol: float = 0.02,
        ladder: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.85, 0.95, 1.1, 1.25),
        seed: int = 0,
    ) -> MeasuredReplicaModel:
        """Measure the capacity as ``tidal plan`` does (:func:`scheduler.plan.capacity.measure`:
        the replica's batch capped within the TPOT target), then replay that replica at
        ``ladder`` x capacity (the bisection's own replays are points of the curve too)."""
        base = get_preset(preset)
        planned = measure_at_slo(base, mix, slo, rel_tol=rel_tol)
        cap = planned.measured
        capped = replace(base, max_num_seqs=planned.batch_cap)
        requests = _mix(mix.requests)
        points = {round(p.rate_rps, 9): p for p in cap.points}
        for u in ladder:
            rate = u * cap.rps_at_slo
            if all(abs(r / rate - 1) > 0.02 for r in points):
                points[round(rate, 9)] = replay(capped, requests, rate, duration_s=cap.duration_s, seed=seed)
        ordered = sorted(points.values(), key=lambda p: p.rate_rps)
        saturation = max(p.throughput_rps for p in ordered) / cap.rps_at_slo
        # The curve up to where the replica still keeps up: beyond, the queue is the model's.
        curve = [p for p in ordered if p.rate_rps <= saturation * cap.rps_at_slo * 1.001]
        return cls(
            preset=f"{preset} (max_num_seqs {planned.batch_cap})",
            workload=label,
            capacity_rps=cap.rps_at_slo,
            ttft_target_s=slo.ttft_p95_s,
            tpot_target_s=slo.tpot_p95_s,
            utilisation=tuple(p.rate_rps / cap.rps_at_slo for p in curve),
            ttft_p95=tuple(p.ttft_p95_s for p in curve),
            tpot_p95=tuple(p.tpot_p95_s for p in curve),
            kv_usage=tuple(p.kv_usage_mean for p in curve),
            saturation=max(1.0, saturation),
            tokens_per_request=mix.mean_output_tokens,
        )

    def at(self, rho: float) -> tuple[float, float, float]:
        """TTFT p95, TPOT p95 and KV usage of a replica at utilisation ``rho``."""
        u = self.utilisation
        return (
            float(np.interp(rho, u, self.ttft_p95)),
            float(np.interp(rho, u, self.tpot_p95)),
            float(np.interp(rho, u, self.kv_usage)),
        )

    def step(self, n: int, arrivals: float, dt: float, backlog: float, batch_on: bool) -> StepOutcome:
        if n <= 0:
            return StepOutcome(math.inf, math.inf, 1.0, backlog + arrivals, 0.0, math.inf)
        max_rate = n * self.capacity_rps * self.saturation
        pending = backlog + arrivals
        served = min(pending, max_rate * dt)
        backlog = pending - served
        rho = served / dt / (n * self.capacity_rps)
        wait = backlog / max_rate
        ttft, tpot, kv = self.at(max(rho, 1.0) if batch_on else rho)
        batch = 0.0
        if batch_on:
            batch = n * max(0.0, 1.0 - rho) * self.capacity_rps * self.tokens_per_request * dt
        return StepOutcome(ttft + wait, wait, kv, backlog, batch, tpot)

    def describe(self) -> str:
        at_cap = self.at(1.0)
        return (
            f"{self.preset} replayed in virtual time on {self.workload}: {self.capacity_rps:.2f} requests/s "
            f"per replica at TTFT p95 <= {self.ttft_target_s:g} s, TPOT p95 <= {self.tpot_target_s * 1000:g} ms "
            f"(there: TTFT p95 {at_cap[0]:.2f} s, TPOT p95 {at_cap[1] * 1000:.0f} ms, KV {at_cap[2]:.0%}); "
            f"saturates at {self.saturation:.2f} x"
        )


# -- the workload ---------------------------------------------------------------------------------


@dataclass
class Workload:
    """Expected request rate per step, the announced events and the unannounced spikes."""

    start: float
    step_s: float
    rates: np.ndarray
    events: list[ScheduledEvent]
    spikes: list[tuple[float, float]]
    label: str
    burstiness: np.ndarray | None = None  # per-minute multipliers with mean 1 (from a trace)
    burst_phase: int = 0  # the minute of the burstiness the workload's first minute takes

    @property
    def steps(self) -> int:
        return len(self.rates)

    def time(self, k: int) -> float:
        return self.start + k * self.step_s


def _bump(h: np.ndarray, centre: float, width: float) -> np.ndarray:
    d = np.abs(h - centre)
    d = np.minimum(d, 24.0 - d)  # hours wrap around midnight
    return np.asarray(np.exp(-((d / width) ** 2)))


def _daily_shape(t: np.ndarray) -> np.ndarray:
    """Relative load (peak about 1) by time of day and weekday: a day plateau and an evening peak."""
    h = (t % DAY) / 3600.0
    weekday = ((t - WEEK_START) // DAY).astype(int) % 7
    weekend = weekday >= 5
    friday = weekday == 4
    day = np.where(weekend, 0.40, 0.30) * _bump(h, 13.0, 3.5)
    evening = np.where(weekend | friday, 0.75, 0.65) * _bump(h, 20.75, 1.3)
    return np.asarray(0.22 + day + evening)


def synthetic_week(
    *,
    start: float = WEEK_START,
    days: float = 7.0,
    step_s: float = 5.0,
    peak_rps: float = 240.0,
    seed: int = 1,
    event: bool = True,
    spike: bool = True,
) -> Workload:
    """The benchmark's load from ``start`` for ``days`` (see the module docstring).

    The event (Saturday 14:00-17:00) and the spike (Wednesday 11:00) fall in the week of
    ``start`` when they are inside the period; ``event``/``spike`` off gives a usual week
    (history).
    """
    rng = np.random.default_rng(seed)
    n = int(round(days * DAY / step_s))
    t = start + np.arange(n) * step_s
    end = start + n * step_s
    monday = WEEK_START + math.floor((start + 3600.0 - WEEK_START) / WEEK) * WEEK
    day_index = ((t - start) // DAY).astype(int)
    jitter = 1.0 + 0.05 * rng.standard_normal(int(math.ceil(days)) + 1)
    rates = peak_rps * _daily_shape(t) * jitter[day_index]
    events: list[ScheduledEvent] = []
    spikes: list[tuple[float, float]] = []
    ev_start = monday + 5 * DAY + 14 * 3600.0
    ev_end = ev_start + 3 * 3600.0
    if event and start <= ev_start and ev_end <= end:
        # The final; most viewers arrive in its first ten minutes and leave over twenty after it.
        ramp = np.clip((t - ev_start) / 600.0, 0.0, 1.0) * (t < ev_end)
        fade = np.clip(1.0 - (t - ev_end) / 1200.0, 0.0, 1.0) * (t >= ev_end)
        rates = rates * (1.0 + 1.2 * np.maximum(ramp, fade))
        events.append(ScheduledEvent("cricket-final", ev_start, ev_end, multiplier=2.2, lead_s=900.0))
    sp_start = monday + 2 * DAY + 11 * 3600.0
    sp_end = sp_start + 40 * 60.0
    if spike and start <= sp_start and sp_end <= end:
        # Something goes viral: +80% in two minutes, gone after forty.
        up = np.clip((t - sp_start) / 120.0, 0.0, 1.0) * (t < sp_end)
        down = np.clip(1.0 - (t - sp_end) / 300.0, 0.0, 1.0) * (t >= sp_end)
        rates = rates * (1.0 + 0.8 * np.maximum(up, down))
        spikes.append((sp_start, sp_end))
    label = f"synthetic week (evening peaks up to ~{peak_rps:g} rps, event, spike; seed {seed})"
    return Workload(start, step_s, rates, events, spikes, label)


def trace_burstiness(requests: Sequence[TraceRequest], step_s: float) -> np.ndarray:
    """Per-step arrival counts of a trace, normalised to mean 1 (its shape, not its volume).
    Only whole steps count: the trace's last, partial step is no lull."""
    if len(requests) < 100:
        raise ValueError("too few requests to take burstiness from")
    arrivals = np.sort(np.asarray([r.arrival_s for r in requests]))
    arrivals -= arrivals[0]
    whole = int(arrivals[-1] // step_s)
    if whole < 1:
        raise ValueError(f"the trace is shorter than one step of {step_s:g} s")
    counts = np.bincount((arrivals // step_s).astype(int)).astype(float)[:whole]
    return np.asarray(counts / counts.mean())


def _find_trace(option: str) -> Path | None:
    if option != "auto":
        path = Path(option)
        if not path.is_file():
            raise ValueError(f"--trace {option}: no such file")
        return path
    return find_trace("AzureLLMInferenceTrace_conv.csv")


def _mix(requests: Sequence[TraceRequest], block_size: int = 16) -> list[WorkloadRequest]:
    """A trace's requests as the simulated replica replays them (prefixes as chained block hashes)."""
    return [
        WorkloadRequest(
            r.input_length,
            r.output_length,
            tuple(block_hashes(r, block_size))[: r.input_length // block_size],
        )
        for r in requests
    ]


# -- the virtual pool -----------------------------------------------------------------------------


class VirtualPool:
    """The autoscaler's actuator in virtual time: replicas are ready ``cold_start_s`` after asked."""

    name = "virtual"

    def __init__(self, clock: ManualClock, ready: int, cold_start_s: float) -> None:
        self.clock = clock
        self.ready = ready
        self.pending: list[float] = []
        self.cold_start_s = cold_start_s

    def settle(self) -> None:
        now = self.clock.now()
        done = sum(1 for t in self.pending if t <= now)
        if done:
            self.pending = [t for t in self.pending if t > now]
            self.ready += done

    async def observe(self, pool: str, load: PoolLoad | None) -> PoolReplicas:
        self.settle()
        return PoolReplicas(self.ready, len(self.pending))

    async def scale(self, pool: str, replicas: int) -> None:
        self.settle()
        diff = replicas - self.ready - len(self.pending)
        if diff > 0:
            self.pending += [self.clock.now() + self.cold_start_s] * diff
        for _ in range(max(0, -diff)):
            if self.pending:
                self.pending.pop()  # cancel the newest cold start first
            else:
                self.ready -= 1

    async def replace(self, pool: str, replica: str) -> bool:
        return False


# -- one run --------------------------------------------------------------------------------------


@dataclass
class PolicyRun:
    policy: str
    violation_minutes: int
    gpu_hours: float
    batch_tokens_in_troughs: float
    peak_replicas: int
    gate_pauses: int
    minutes: dict[str, list[float]] = field(default_factory=dict)  # per-minute series for the plot


def per_minute_rates(w: Workload) -> list[tuple[float, float]]:
    """The workload's expected request rate in each whole minute, burstiness included."""
    per_min = max(1, int(round(60.0 / w.step_s)))
    m = len(w.rates) // per_min
    rates = w.rates[: m * per_min].reshape(m, per_min).mean(axis=1)
    out = []
    for i, r in enumerate(rates):
        if w.burstiness is not None:
            r = r * w.burstiness[(i + w.burst_phase) % len(w.burstiness)]
        out.append((w.start + i * 60.0, float(r)))
    return out


def _profile_from_history(weeks: Sequence[Workload]) -> HourOfWeekProfile:
    """The profile learned from earlier weeks' per-minute rates, imported as an operator would
    (``tidal autoscale import-profile``): a CSV of ``time,rps`` read by the product's reader."""
    if not weeks:
        return HourOfWeekProfile()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "history.csv"
        with path.open("w") as f:
            f.write("time,rps\n")
            for w in weeks:
                f.writelines(f"{t:.0f},{r:.6g}\n" for t, r in per_minute_rates(w))
        return read_history(path, "rates").profile(quantile=0.9, weeks=len(weeks))


def simulate(
    policy: str,
    workload: Workload,
    model: FleetModel,
    spec: AutoscalerSpec,
    *,
    history: Sequence[Workload] = (),
    seed: int = 7,
    parameters: dict[str, Any] | None = None,
    gate_spec: GateSpec | None = None,
    warmup_s: float = 0.0,
) -> PolicyRun:
    """Run one policy over the workload; the same arrivals for every policy (same seed).

    The first ``warmup_s`` of the workload run but are not counted (the fleet settles from its
    initial size).
    """
    return asyncio.run(
        _simulate(policy, workload, model, spec, history, seed, parameters or {}, gate_spec, warmup_s)
    )


async def _simulate(
    policy: str,
    workload: Workload,
    model: FleetModel,
    spec: AutoscalerSpec,
    history: Sequence[Workload],
    seed: int,
    parameters: dict[str, Any],
    gate_spec: GateSpec | None,
    warmup_s: float,
) -> PolicyRun:
    rng = np.random.default_rng(seed)
    dt = workload.step_s
    clock = ManualClock(workload.start)
    counted_from = workload.start + warmup_s
    initial = max(spec.min_replicas, math.ceil(workload.rates[0] / model.capacity_rps))
    pool = VirtualPool(clock, ready=initial, cold_start_s=spec.cold_start_s)
    forecaster = Forecaster(_profile_from_history(history), EventCalendar(workload.events))
    gate = BatchGate(POOL, gate_spec or GateSpec(), clock=clock, signal_timeout_s=3 * dt)
    scaler = Autoscaler(
        POOL,
        spec,
        make_policy(policy.split(":")[0], parameters),
        capacity=StaticCapacity({POOL: model.capacity_rps}),
        actuator=pool,
        clock=clock,
        forecaster=forecaster,
        metrics=SchedulerMetrics(),
        lent_to_batch=lambda pool: gate.state is GateState.OPEN,
    )
    decide_every = max(1, round(spec.decision_interval_s / dt))
    per_min = max(1, round(60.0 / dt))

    backlog = 0.0
    gpu_seconds = 0.0
    batch_tokens = 0.0
    peak = 0
    pauses = 0
    window_arrivals = 0.0
    last_ttft = model.ttft_idle_s
    last_tpot = 0.0
    last_wait = 0.0
    last_kv = 0.0
    minute_ttft: list[tuple[float, float]] = []
    minute_tpot: list[tuple[float, float]] = []
    series: dict[str, list[float]] = {
        "t": [],
        "load_rps": [],
        "capacity_rps": [],
        "ttft_p95_s": [],
        "tpot_p95_s": [],
        "violation": [],
        "batch": [],
    }
    violations = 0
    for k in range(workload.steps):
        now = clock.now()
        if k % decide_every == 0:
            load = PoolLoad(
                requests_per_s=window_arrivals / (decide_every * dt) if k else workload.rates[0],
                ttft_p95_s=last_ttft,
                tpot_p95_s=last_tpot,
                queue_wait_p95_s=last_wait,
                kv_cache_usage_max=last_kv,
            )
            await scaler.step(now, load)
            window_arrivals = 0.0
        pool.settle()
        n = pool.ready
        counted = now >= counted_from
        if counted:
            peak = max(peak, n + len(pool.pending))
            gpu_seconds += (n + len(pool.pending)) * dt

        lam = workload.rates[k]
        if workload.burstiness is not None:  # one multiplier per minute, the trace's minutes cycled
            minute = int(k * dt // 60.0) + workload.burst_phase
            lam *= workload.burstiness[minute % len(workload.burstiness)]
        arrivals = float(rng.poisson(lam * dt))
        window_arrivals += arrivals
        batch_on = gate.state is GateState.OPEN
        out = model.step(n, arrivals, dt, backlog, batch_on)
        backlog = out.backlog
        if counted:
            batch_tokens += out.batch_tokens
        tr = gate.observe(GateSample(out.queue_wait_s, out.kv_usage))
        if tr is not None and tr.to is GateState.PAUSED and counted:
            pauses += 1
        last_ttft, last_tpot = out.ttft_p95_s, out.tpot_p95_s
        last_wait, last_kv = out.queue_wait_s, out.kv_usage
        if counted:
            minute_ttft.append((out.ttft_p95_s, arrivals))
            minute_tpot.append((out.tpot_p95_s, arrivals))
        if len(minute_ttft) == per_min:
            # A minute violates the SLO when its requests' TTFT p95 or TPOT p95 is above target.
            p95 = _weighted_p95(minute_ttft)
            tpot95 = _weighted_p95(minute_tpot)
            bad = p95 > model.ttft_target_s or tpot95 > model.tpot_target_s
            violations += bad
            series["t"].append(len(series["t"]) * 60.0 / DAY)  # the minute's start
            series["load_rps"].append(sum(a for _, a in minute_ttft) / (per_min * dt))
            series["capacity_rps"].append(n * model.capacity_rps)
            series["ttft_p95_s"].append(min(p95, 30.0))
            series["tpot_p95_s"].append(min(tpot95, 30.0))
            series["violation"].append(1.0 if bad else 0.0)
            series["batch"].append(1.0 if batch_on else 0.0)
            minute_ttft, minute_tpot = [], []
        clock.advance(dt)
    return PolicyRun(
        policy=policy,
        violation_minutes=violations,
        gpu_hours=gpu_seconds / 3600.0,
        batch_tokens_in_troughs=batch_tokens,
        peak_replicas=peak,
        gate_pauses=pauses,
        minutes=series,
    )


def _weighted_p95(samples: list[tuple[float, float]]) -> float:
    """The 95th percentile of a per-request latency when each step's requests share its value."""
    total = sum(w for _, w in samples)
    if total <= 0:
        return 0.0
    acc = 0.0
    for v, w in sorted(samples):
        acc += w
        if acc >= 0.95 * total:
            return v
    return sorted(samples)[-1][0]


# -- the benchmark --------------------------------------------------------------------------------


def _plot(runs: Sequence[PolicyRun], workload: Workload, model: FleetModel, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(14, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1]})
    base = runs[0].minutes
    axes[0].plot(base["t"], base["load_rps"], color="black", lw=0.6, label="interactive load (rps)")
    colours = ["tab:red", "tab:blue", "tab:green"]
    for run, c in zip(runs, colours, strict=False):
        axes[0].plot(
            run.minutes["t"], run.minutes["capacity_rps"], color=c, lw=0.9, label=f"{run.policy}: capacity"
        )
        bad = [t for t, v in zip(run.minutes["t"], run.minutes["violation"], strict=True) if v]
        axes[1].scatter(bad, [run.policy] * len(bad), s=4, color=c, label=f"{run.policy}: {len(bad)} min")
        axes[2].fill_between(
            run.minutes["t"], 0, run.minutes["batch"], step="post", alpha=0.3, color=c, label=run.policy
        )
    for ev in workload.events:
        for ax in axes:
            ax.axvspan(
                (ev.start - workload.start) / DAY, (ev.end - workload.start) / DAY, color="gold", alpha=0.2
            )
    for a, b in workload.spikes:
        for ax in axes:
            ax.axvspan((a - workload.start) / DAY, (b - workload.start) / DAY, color="purple", alpha=0.15)
    axes[0].set_ylabel("requests/s")
    axes[0].legend(loc="upper left", fontsize=8)
    axes[0].set_title(f"autoscale: {workload.label}; gold = scheduled event, purple = unannounced spike")
    axes[1].set_ylabel("TTFT or TPOT p95 > SLO")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[2].set_ylabel("batch on")
    axes[2].set_xlabel("day of week (0 = Monday)")
    axes[2].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _measure_replica(preset: str, mix: RequestMix, slo: Slo, label: str, quick: bool) -> MeasuredReplicaModel:
    # --quick: a coarser bisection and ladder.
    if quick:
        return MeasuredReplicaModel.measure(
            preset, mix, slo, label=label, rel_tol=0.05, ladder=(0.2, 0.5, 0.8, 1.2)
        )
    return MeasuredReplicaModel.measure(preset, mix, slo, label=label)


def _one_trace(
    name: str,
    requests: Sequence[TraceRequest] | None,
    *,
    quick: bool,
    out_dir: Path,
    seed: int,
    cold: float,
    peak: float,
    preset: str,
    fleet_model: str,
    analytic_capacity: float,
    slo: Slo,
    days: float,
) -> list[dict[str, Any]]:
    # --quick: 10-second steps instead of 5 (same week, events and spike).
    step_s = 10.0 if quick else 5.0
    warmup = 3600.0  # the week starts on a settled fleet: the hour before runs but is not counted
    workload = synthetic_week(
        start=WEEK_START - warmup, days=days + warmup / DAY, step_s=step_s, peak_rps=peak, seed=seed
    )
    history = [
        synthetic_week(
            start=WEEK_START - w * WEEK,
            step_s=60.0,
            peak_rps=peak,
            seed=seed + 100 + w,
            event=False,
            spike=False,
        )
        for w in (1, 2, 3)
    ]
    # The request mix is the one `tidal plan --workload synthetic|FILE` measures.
    if requests is None:
        mix = load_workload("synthetic")
        mix_label = "tidal plan's synthetic chat workload (shared system prompts, multi-turn sessions)"
    else:
        mix = RequestMix(name, tuple(requests))
        mix_label = f"{name}'s request lengths"
        burst = trace_burstiness(requests, 60.0)
        workload.burstiness = burst
        workload.label += f"; minute by minute shaped like {name} ({len(burst)} minutes, cycled)"
        for i, w in enumerate(history, 1):
            # Earlier weeks had the same kind of minutes, not the same minutes at the same times.
            w.burstiness, w.burst_phase = burst, (17 * i) % len(burst)
    print(f"\n== {name}: {workload.label}; history: 3 earlier weeks of per-minute rates, imported")
    model: FleetModel
    if fleet_model == "analytic":
        model = ReplicaModel(capacity_rps=analytic_capacity)
        print(
            f"fleet model: analytic replica ({analytic_capacity:g} rps within TTFT {model.ttft_target_s:g} s, "
            f"saturates at 1.3x), cold start {cold:g} s; step {step_s:g} s"
        )
    else:
        model = _measure_replica(preset, mix, slo, mix_label, quick)
        print(f"replica: {model.describe()}; cold start {cold:g} s; step {step_s:g} s")
    spec = AutoscalerSpec(
        min_replicas=2,
        max_replicas=500,
        capacity_rps_per_replica=model.capacity_rps,
        warm_buffer=0.12,
        cold_start_s=cold,
        scale_down_stabilisation_s=900.0,
        decision_interval_s=15.0,
    )
    # Both policies step up on the same SLO signals the replicas are measured against.
    targets: dict[str, Any] = {"target_ttft_p95_s": model.ttft_target_s}
    if math.isfinite(model.tpot_target_s):
        targets["target_tpot_p95_s"] = model.tpot_target_s
    runs = [
        simulate(
            "reactive", workload, model, spec, history=history, seed=seed, parameters=targets, warmup_s=warmup
        ),
        simulate(
            "tidal", workload, model, spec, history=history, seed=seed, parameters=targets, warmup_s=warmup
        ),
        simulate(
            "reactive:buffered",
            workload,
            model,
            spec,
            history=history,
            seed=seed,
            parameters={**targets, "target_utilisation": round(1 / 1.12, 4)},
            warmup_s=warmup,
        ),
    ]
    base = runs[0]
    rows: list[dict[str, Any]] = []
    for r in runs:
        rows.append(
            {
                "trace": name,
                "policy": r.policy,
                "violation_minutes": r.violation_minutes,
                "gpu_hours": round(r.gpu_hours, 1),
                "batch_tokens_in_troughs": round(r.batch_tokens_in_troughs),
                "violations_vs_reactive": round(r.violation_minutes / base.violation_minutes, 3)
                if base.violation_minutes
                else None,
                "gpu_hours_vs_reactive": round(r.gpu_hours / base.gpu_hours, 3),
                "batch_tokens_vs_reactive": round(r.batch_tokens_in_troughs / base.batch_tokens_in_troughs, 3)
                if base.batch_tokens_in_troughs
                else None,
                "peak_replicas": r.peak_replicas,
                "gate_pauses": r.gate_pauses,
                "capacity_rps_per_replica": round(model.capacity_rps, 3),
                "fleet_model": model.describe() if isinstance(model, MeasuredReplicaModel) else "analytic",
                "workload": workload.label,
                "cold_start_s": cold,
            }
        )
    from tidal.cli.bench import print_table

    print_table(
        rows,
        [
            "trace",
            "policy",
            "violation_minutes",
            "gpu_hours",
            "batch_tokens_in_troughs",
            "violations_vs_reactive",
            "gpu_hours_vs_reactive",
            "peak_replicas",
            "gate_pauses",
        ],
    )
    tidal = runs[1]
    fewer = 1 - tidal.violation_minutes / base.violation_minutes if base.violation_minutes else 0.0
    more = tidal.gpu_hours / base.gpu_hours - 1
    met = fewer >= 0.8 and more <= 0.15
    print(
        f"{name}: tidal vs reactive: {fewer:.0%} fewer violation minutes for {more:+.1%} GPU-hours "
        f"(target: >= 80% fewer for <= +15%): {'met' if met else 'NOT met'}"
    )
    plot = out_dir / ("autoscale.png" if requests is None else f"autoscale-{name}.png")
    _plot(runs, workload, model, plot)
    print(f"plot: {plot}")
    return rows


def run(
    quick: bool,
    out_dir: Path,
    *,
    trace: str = "auto",
    seed: str | int = 1,
    cold_start_s: str | float = 180.0,
    peak_rps: str | float = 240.0,
    preset: str = "llama-3.1-70b-fp8-h200-tp4",
    fleet_model: str = "sim",
    capacity_rps: str | float = 8.0,
    days: str | float = 7.0,
) -> list[dict[str, Any]]:
    """Each policy over the synthetic week and, with ``--trace``, the trace-shaped week: one row
    per workload and policy (the buffered-reactive row is a reference)."""
    if fleet_model not in ("sim", "analytic"):
        raise ValueError(f"--fleet-model must be sim or analytic, not {fleet_model!r}")
    # A week of decisions would log thousands of scale changes; the table says what matters.
    logging.getLogger("tidal.scheduler").setLevel(logging.WARNING)
    traces: list[tuple[str, Sequence[TraceRequest] | None]] = [("synthetic", None)]
    if str(trace) != "none":
        path = _find_trace(str(trace))
        if path is None:
            print(
                "no Azure conversation trace under ../shared/traces or TIDAL_TRACES_DIR: the synthetic week only"
            )
        else:
            name = "azure-conv" if path.name == "AzureLLMInferenceTrace_conv.csv" else path.stem
            traces.append((name, load_workload(str(path), seed=int(seed)).requests))
    rows: list[dict[str, Any]] = []
    for name, requests in traces:
        rows += _one_trace(
            name,
            requests,
            quick=quick,
            out_dir=out_dir,
            seed=int(seed),
            cold=float(cold_start_s),
            peak=float(peak_rps),
            preset=str(preset),
            fleet_model=str(fleet_model),
            analytic_capacity=float(capacity_rps),
            slo=Slo(ttft_p95_s=1.0, tpot_p95_s=0.05),
            days=float(days),
        )
    return rows
