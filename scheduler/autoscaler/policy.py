"""Scale decision policies: plugins that say how many replicas a pool needs now.

A policy is a pure function of a :class:`ScaleInput` (load, replicas, capacity, forecast); the
:class:`~scheduler.autoscaler.Autoscaler` owns what must always happen around it (fast up, slow
down over the stabilisation window, bounds, the actuator). Policies register by type name in
:data:`POLICIES` and parse their parameters strictly (unknown or bad ones fail at start).

``reactive`` -- what HPA/KEDA on serving metrics do: replicas for the load seen now, plus a step
up while TTFT p95, queue wait p95, KV usage or (with ``target_tpot_p95_s``) TPOT p95 breach
their targets (KV usage only while the pool is not lent to batch, whose sequences fill the
cache at low priority). No forecast, no buffer.
Config::

    autoscale: {policy: reactive, parameters: {target_ttft_p95_s: 1.0, breach_step: 0.25}}

``tidal`` -- predictive + warm buffer + reactive: replicas for the peak forecast over the next
cold start (``lookahead_s``), times ``1 + warm_buffer``, never fewer than the reactive answer
(with the same buffer); scale-down only in troughs, i.e. when the forecast over
``trough_horizon_s`` says the load is not coming back. An answer above the forecast (a burst, a
breach) holds the pool up for ``lookahead_s`` only, not the whole stabilisation window: the
forecast keeps what the expected load needs. Config::

    autoscale: {policy: tidal, warm_buffer: 0.12, parameters: {lookahead_s: 240}}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tidal.fleet import AutoscalerSpec
from tidal.scheduler.signals import PoolLoad

__all__ = [
    "POLICIES",
    "ReactivePolicy",
    "ScaleDecision",
    "ScaleInput",
    "ScalePolicy",
    "TidalPolicy",
    "make_policy",
]


@dataclass(frozen=True, slots=True)
class ScaleInput:
    """Everything a policy may look at for one pool at one instant."""

    pool: str
    now: float  # wall time, Unix seconds
    spec: AutoscalerSpec
    ready: int
    starting: int
    load: PoolLoad | None
    capacity_rps: float  # requests/s one replica serves within the latency targets
    forecast: Callable[[float, float], float | None] = field(default=lambda a, b: None)
    # True while the batch gate lends the pool to batch: its KV usage then includes batch
    # sequences (low priority, preempted first), so it says nothing about interactive pressure.
    lent_to_batch: bool = False


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """The policy's answer: replicas wanted, why, and whether the pool is in a trough.

    ``trough`` allows the autoscaler to scale down and to offer the spare replicas to batch.
    ``parts`` are the numbers behind the decision (for logs and plots).
    """

    replicas: int
    reason: str
    trough: bool
    parts: Mapping[str, float] = field(default_factory=dict)
    # How long this answer holds the pool up once the pool may shrink (None: the pool's
    # scale_down_stabilisation_s; the autoscaler never holds longer than that).
    hold_s: float | None = None


class ScalePolicy(Protocol):
    """A decision plugin: ``type_name`` is how configs name it."""

    type_name: ClassVar[str]

    def decide(self, inp: ScaleInput) -> ScaleDecision: ...


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target_ttft_p95_s: float = Field(default=1.0, gt=0)
    target_tpot_p95_s: float | None = Field(default=None, gt=0)  # None: TPOT is not a breach
    target_queue_wait_p95_s: float = Field(default=0.5, gt=0)
    kv_usage_high: float = Field(default=0.9, gt=0, le=1.0)
    breach_step: float = Field(default=0.25, gt=0, le=10.0)


def _replicas_for(rps: float, capacity_rps: float) -> int:
    # A tiny epsilon so 8.0000001 rps on 1-rps replicas is 8, not 9, after float noise.
    return max(0, math.ceil(rps / capacity_rps - 1e-9))


def _breach(load: PoolLoad | None, p: _Params, lent_to_batch: bool) -> list[str]:
    if load is None:
        return []
    out = []
    if load.ttft_p95_s > p.target_ttft_p95_s:
        out.append(f"TTFT p95 {load.ttft_p95_s:.2f}s > {p.target_ttft_p95_s}s")
    if p.target_tpot_p95_s is not None and load.tpot_p95_s > p.target_tpot_p95_s:
        out.append(f"TPOT p95 {load.tpot_p95_s * 1000:.0f}ms > {p.target_tpot_p95_s * 1000:g}ms")
    if load.queue_wait_p95_s > p.target_queue_wait_p95_s:
        out.append(f"queue wait p95 {load.queue_wait_p95_s:.2f}s > {p.target_queue_wait_p95_s}s")
    if load.kv_cache_usage_max > p.kv_usage_high and not lent_to_batch:
        out.append(f"KV usage {load.kv_cache_usage_max:.2f} > {p.kv_usage_high}")
    return out


def _step_up(ready: int, step: float) -> int:
    # Relative to *ready* replicas: while a step is still cold-starting, a breach that persists
    # asks for the same number again instead of compounding every decision.
    return ready + max(1, math.ceil(ready * step))


class ReactivePolicy:
    """``reactive``: the load seen now, plus a step up on a breached signal (see module docstring)."""

    type_name: ClassVar[str] = "reactive"

    class Params(_Params):
        target_utilisation: float = Field(default=1.0, gt=0, le=1.0)

    def __init__(self, params: ReactivePolicy.Params | None = None) -> None:
        self.params = params or self.Params()

    @classmethod
    def from_config(cls, parameters: Mapping[str, Any]) -> ReactivePolicy:
        return cls(cls.Params.model_validate(dict(parameters)))

    def decide(self, inp: ScaleInput) -> ScaleDecision:
        p = self.params
        rps = inp.load.requests_per_s if inp.load is not None else 0.0
        demand = _replicas_for(rps, inp.capacity_rps * p.target_utilisation)
        breaches = _breach(inp.load, p, inp.lent_to_batch)
        want = demand
        reason = f"{rps:.1f} rps needs {demand}"
        if breaches:
            bump = _step_up(inp.ready, p.breach_step)
            if bump > want:
                want = bump
                reason = "; ".join(breaches) + f" -> step up to {bump}"
        return ScaleDecision(
            replicas=want,
            reason=reason,
            trough=not breaches,
            parts={"observed_rps": rps, "demand": float(demand)},
        )


class TidalPolicy:
    """``tidal``: forecast over the cold start + warm buffer + reactive (see module docstring)."""

    type_name: ClassVar[str] = "tidal"

    class Params(_Params):
        warm_buffer: float | None = Field(default=None, ge=0.0, le=1.0)  # None: the pool's warm_buffer
        lookahead_s: float | None = Field(default=None, ge=0.0)  # None: cold_start_s + decision_interval_s
        trough_horizon_s: float | None = Field(default=None, ge=0.0)  # None: scale_down_stabilisation_s

    def __init__(self, params: TidalPolicy.Params | None = None) -> None:
        self.params = params or self.Params()

    @classmethod
    def from_config(cls, parameters: Mapping[str, Any]) -> TidalPolicy:
        return cls(cls.Params.model_validate(dict(parameters)))

    def decide(self, inp: ScaleInput) -> ScaleDecision:
        p, spec = self.params, inp.spec
        buffer = spec.warm_buffer if p.warm_buffer is None else p.warm_buffer
        lookahead = spec.cold_start_s + spec.decision_interval_s if p.lookahead_s is None else p.lookahead_s
        horizon = spec.scale_down_stabilisation_s if p.trough_horizon_s is None else p.trough_horizon_s
        rps = inp.load.requests_per_s if inp.load is not None else 0.0
        # The load that arrives before a replica started now is ready is what we must hold.
        predicted = inp.forecast(inp.now, inp.now + lookahead)
        predictive = _replicas_for((predicted or 0.0) * (1 + buffer), inp.capacity_rps)
        reactive = _replicas_for(rps * (1 + buffer), inp.capacity_rps)
        want = max(predictive, reactive)
        reason = (
            f"forecast {predicted:.1f} rps -> {predictive}, " if predicted is not None else "no forecast, "
        ) + f"observed {rps:.1f} rps -> {reactive} (buffer {buffer:.0%})"
        breaches = _breach(inp.load, p, inp.lent_to_batch)
        if breaches:
            bump = _step_up(inp.ready, p.breach_step)
            if bump > want:
                want = bump
                reason = "; ".join(breaches) + f" -> step up to {bump}"
        # A trough: neither now nor over the coming horizon does the load need what we run.
        later = inp.forecast(inp.now, inp.now + horizon)
        later_need = _replicas_for((later or 0.0) * (1 + buffer), inp.capacity_rps)
        trough = not breaches and later_need <= want
        return ScaleDecision(
            replicas=want,
            reason=reason,
            trough=trough,
            # Replicas for load above a forecast (a burst, a breach) are kept as long as it takes
            # to start new ones, not a whole stabilisation window: the forecast, not the window,
            # holds the pool up for the load that is expected. Without a forecast the window does.
            hold_s=lookahead if predicted is not None and want > predictive else None,
            parts={
                "observed_rps": rps,
                "predicted_rps": predicted if predicted is not None else math.nan,
                "predictive": float(predictive),
                "reactive": float(reactive),
                "horizon_need": float(later_need),
            },
        )


PolicyFactory = Callable[[Mapping[str, Any]], ScalePolicy]

POLICIES: dict[str, PolicyFactory] = {
    ReactivePolicy.type_name: ReactivePolicy.from_config,
    TidalPolicy.type_name: TidalPolicy.from_config,
}


def make_policy(name: str, parameters: Mapping[str, Any] | None = None) -> ScalePolicy:
    """Build a registered policy; an unknown name or parameter is a ``ValueError`` naming it."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown autoscaler policy '{name}' (known: {', '.join(sorted(POLICIES))})")
    try:
        return factory(parameters or {})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"autoscaler policy '{name}' parameters: {problems}") from None
