"""``tidal bench autoscale``: reactive-only vs predictive + warm buffer + reactive, over a week.

A synthetic week of interactive load in virtual time: daily evening peaks (higher at the
weekend), a scheduled event (a cricket final on Saturday afternoon, announced in the calendar),
and one unannounced spike (Wednesday late morning); Poisson arrivals; a replica takes 3 minutes
to start. Both runs use the product's own objects -- :class:`~scheduler.autoscaler.Autoscaler`
with the ``reactive`` or ``tidal`` policy plugin, the hour-of-week profile learned from three
earlier weeks, the event calendar, and the :class:`~scheduler.gate.BatchGate` that lends idle
replicas to batch -- against a fleet model in virtual time. Printed per policy: minutes whose
TTFT p95 is above the target, GPU-hours, batch tokens done on the pool in its troughs, and the
ratios against the reactive run; a plot goes to ``bench/results/autoscale.png``.

The fleet model (:class:`ReplicaModel`) is an analytic stand-in for the simulated replica's cost
model: a replica serves ``capacity_rps`` within the TTFT target, degrades beyond it up to
``saturation`` x that rate, and queues the rest. Its numbers are options
(``--capacity-rps``...); a capacity measured on ``replicas.sim`` plugs in through the same
interface.

Options: ``--trace FILE`` (or ``auto``: ``../shared/traces`` / ``TIDAL_TRACES_DIR``) multiplies
the rate by the per-minute shape of a real trace (its arrival counts per minute over their mean,
cycled), on top of the Poisson arrivals; ``--seed N``;
``--cold-start-s S``; ``--capacity-rps R``; ``--peak-rps R``.

Example: tidal bench autoscale --quick
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from scheduler.autoscaler import (
    Autoscaler,
    EventCalendar,
    Forecaster,
    HourOfWeekProfile,
    PoolReplicas,
    ScheduledEvent,
    StaticCapacity,
    make_policy,
)
from scheduler.gate import BatchGate, GateSample, GateState
from scheduler.metrics import SchedulerMetrics
from scheduler.signals import PoolLoad
from tidal.clock import ManualClock
from tidal.fleet import AutoscalerSpec, GateSpec

__all__ = ["FleetModel", "ReplicaModel", "Workload", "run", "simulate", "synthetic_week"]

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
    def ttft_idle_s(self) -> float: ...

    def step(self, n: int, arrivals: float, dt: float, backlog: float, batch_on: bool) -> StepOutcome: ...


@dataclass(frozen=True, slots=True)
class StepOutcome:
    ttft_p95_s: float
    queue_wait_s: float
    kv_usage: float
    backlog: float
    batch_tokens: float


@dataclass(frozen=True, slots=True)
class ReplicaModel:
    """Analytic replica: within target up to ``capacity_rps``, degraded up to ``saturation`` x it.

    TTFT p95 rises from ``ttft_idle_s`` to the target as utilisation reaches 1 (4th power: flat,
    then steep, as with continuous batching), keeps rising beyond it, and requests beyond the
    saturated rate wait in the gateway's queue. KV usage is ``kv_at_capacity`` x utilisation,
    plus ``batch_kv`` while batch work runs (which also slows interactive steps by
    ``batch_interference``). Batch gets the unused share of each replica at
    ``batch_tokens_per_s``.
    """

    capacity_rps: float = 8.0
    ttft_idle_s: float = 0.25
    ttft_target_s: float = 1.0
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


def _trace_arrivals(path: Path) -> np.ndarray:
    """Arrival times (s from the first) of an Azure CSV or a Mooncake JSONL trace."""
    import csv
    import json

    times: list[float] = []
    if path.suffix == ".csv":
        with path.open() as f:
            for row in csv.DictReader(f):
                stamp = row["TIMESTAMP"].strip()
                if "." in stamp:  # seven fractional digits; datetime wants at most six
                    head, frac = stamp.split(".", 1)
                    stamp = f"{head}.{frac[:6]}"
                times.append(datetime.fromisoformat(stamp).timestamp())
    else:
        with path.open() as f:
            for line in f:
                if line.strip():
                    times.append(float(json.loads(line)["timestamp"]) / 1000.0)
    if len(times) < 100:
        raise ValueError(f"{path}: too few requests to take burstiness from")
    arr = np.sort(np.asarray(times))
    return np.asarray(arr - arr[0])


def trace_burstiness(path: Path, step_s: float) -> np.ndarray:
    """Per-step arrival counts of a trace, normalised to mean 1 (its shape, not its volume)."""
    arrivals = _trace_arrivals(path)
    counts = np.bincount((arrivals // step_s).astype(int)).astype(float)
    return np.asarray(counts / counts.mean())


def _find_trace(option: str) -> Path | None:
    if option != "auto":
        return Path(option)
    root = Path(__file__).resolve().parents[1]
    for d in [os.environ.get("TIDAL_TRACES_DIR"), str(root.parent / "shared" / "traces")]:
        if d and (Path(d) / "AzureLLMInferenceTrace_conv.csv").exists():
            return Path(d) / "AzureLLMInferenceTrace_conv.csv"
    return None


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


def _profile_from_history(weeks: Sequence[Workload]) -> HourOfWeekProfile:
    """The profile the scheduler would have learned from earlier weeks' per-minute rates."""
    profile = HourOfWeekProfile(quantile=0.9, weeks=len(weeks))
    for w in weeks:
        per_min = int(round(60.0 / w.step_s))
        m = len(w.rates) // per_min
        rates = w.rates[: m * per_min].reshape(m, per_min).mean(axis=1)
        # Shifted back by whole weeks so the hour of week lines up with the benchmark's week.
        profile.fit((w.start + i * 60.0, float(r)) for i, r in enumerate(rates))
    return profile


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
    last_wait = 0.0
    last_kv = 0.0
    minute_ttft: list[tuple[float, float]] = []
    series: dict[str, list[float]] = {
        "t": [],
        "load_rps": [],
        "capacity_rps": [],
        "ttft_p95_s": [],
        "batch": [],
    }
    violations = 0
    for k in range(workload.steps):
        now = clock.now()
        if k % decide_every == 0:
            load = PoolLoad(
                requests_per_s=window_arrivals / (decide_every * dt) if k else workload.rates[0],
                ttft_p95_s=last_ttft,
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
            lam *= workload.burstiness[int(k * dt // 60.0) % len(workload.burstiness)]
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
        last_ttft, last_wait, last_kv = out.ttft_p95_s, out.queue_wait_s, out.kv_usage
        if counted:
            minute_ttft.append((out.ttft_p95_s, arrivals))
        if len(minute_ttft) == per_min:
            p95 = _weighted_p95(minute_ttft)
            if p95 > model.ttft_target_s:
                violations += 1
            series["t"].append(len(series["t"]) * 60.0 / DAY)  # the minute's start
            series["load_rps"].append(sum(a for _, a in minute_ttft) / (per_min * dt))
            series["capacity_rps"].append(n * model.capacity_rps)
            series["ttft_p95_s"].append(min(p95, 30.0))
            series["batch"].append(1.0 if batch_on else 0.0)
            minute_ttft = []
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
    """The 95th percentile of per-request TTFT when each step's requests share its TTFT."""
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
        bad = [
            t
            for t, v in zip(run.minutes["t"], run.minutes["ttft_p95_s"], strict=True)
            if v > model.ttft_target_s
        ]
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
    axes[1].set_ylabel("TTFT p95 > target")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[2].set_ylabel("batch on")
    axes[2].set_xlabel("day of week (0 = Monday)")
    axes[2].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    quick: bool,
    out_dir: Path,
    *,
    trace: str | None = None,
    seed: str | int = 1,
    cold_start_s: str | float = 180.0,
    capacity_rps: str | float = 8.0,
    peak_rps: str | float = 240.0,
    **options: Any,
) -> list[dict[str, Any]]:
    """Both policies over the same week; one row each, plus the buffered-reactive reference."""
    if options:
        raise ValueError(f"unknown options: {', '.join('--' + k.replace('_', '-') for k in options)}")
    seed_i, cold, cap, peak = int(seed), float(cold_start_s), float(capacity_rps), float(peak_rps)
    # A week of decisions would log thousands of scale changes; the table says what matters.
    logging.getLogger("scheduler").setLevel(logging.WARNING)
    # --quick: 10-second steps instead of 5 (same week, events and spike).
    step_s = 10.0 if quick else 5.0
    warmup = 3600.0  # the week starts on a settled fleet: the hour before runs but is not counted
    workload = synthetic_week(
        start=WEEK_START - warmup, days=7 + warmup / DAY, step_s=step_s, peak_rps=peak, seed=seed_i
    )
    history = [
        synthetic_week(
            start=WEEK_START - w * WEEK,
            step_s=60.0,
            peak_rps=peak,
            seed=seed_i + 100 + w,
            event=False,
            spike=False,
        )
        for w in (1, 2, 3)
    ]
    if trace:
        path = _find_trace(str(trace))
        if path is None:
            print("no trace found under ../shared/traces or TIDAL_TRACES_DIR: plain Poisson arrivals")
        else:
            workload.burstiness = trace_burstiness(path, 60.0)
            workload.label += f", per-minute burstiness of {path.name}"
    print(f"workload: {workload.label}; history: 3 earlier weeks (learned by hour of week)")
    model = ReplicaModel(capacity_rps=cap)
    spec = AutoscalerSpec(
        min_replicas=2,
        max_replicas=200,
        capacity_rps_per_replica=cap,
        warm_buffer=0.12,
        cold_start_s=cold,
        scale_down_stabilisation_s=900.0,
        decision_interval_s=15.0,
    )
    print(
        f"fleet model: analytic replica ({cap:g} rps within TTFT {model.ttft_target_s:g} s, "
        f"saturates at {model.saturation:g}x), cold start {cold:g} s; step {step_s:g} s"
    )
    runs = [
        simulate("reactive", workload, model, spec, history=history, seed=seed_i, warmup_s=warmup),
        simulate("tidal", workload, model, spec, history=history, seed=seed_i, warmup_s=warmup),
        simulate(
            "reactive:buffered",
            workload,
            model,
            spec,
            history=history,
            seed=seed_i,
            parameters={"target_utilisation": round(1 / 1.12, 4)},
            warmup_s=warmup,
        ),
    ]
    base = runs[0]
    rows: list[dict[str, Any]] = []
    for r in runs:
        rows.append(
            {
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
                "workload": workload.label,
                "cold_start_s": cold,
            }
        )
    from tidal.cli.bench import print_table

    print_table(
        rows,
        [
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
        f"\ntidal vs reactive: {fewer:.0%} fewer violation minutes for {more:+.1%} GPU-hours "
        f"(target: >= 80% fewer for <= +15%): {'met' if met else 'NOT met'}"
    )
    plot = out_dir / "autoscale.png"
    _plot(runs, workload, model, plot)
    print(f"plot: {plot}")
    return rows
