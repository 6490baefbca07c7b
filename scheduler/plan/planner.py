"""``tidal plan``: how many replicas of which shape a workload needs, what they cost, and why.

For each tensor-parallel option of one model on one GPU type the plan gives:

* **memory** -- KV bytes per token, KV tokens per replica after weights and activations, the
  largest batch at the workload's context mix, and the batch cap that keeps the mean time per
  output token within the TPOT target (:mod:`scheduler.plan.capacity`);
* **capacity** -- requests/s per replica within the SLO, measured by replaying the workload on the
  simulated replica in virtual time;
* **size** -- the replicas the workload's peak needs with the warm buffer, the TTFT/TPOT p95 the
  fleet model (:mod:`scheduler.plan.model`) predicts there, and, to check that prediction, a
  replay of the same workload on that many simulated replicas (:mod:`scheduler.plan.replay`);
* **the week** -- replicas per hour of the week (the workload's weekly shape, its busiest hour at
  the peak rate) with the warm buffer, split into reserved replicas (those needed often enough
  that reserving beats paying by the hour), on-demand hours and spot hours for batch work the
  reserved replicas' troughs cannot absorb; cost per million tokens and the break-even
  utilisation against an external API's price.

Across options: TP=n x k against k x TP=n (latency, capacity per node, capacity lost when one
GPU fails); the effect of FP8 weights, FP8 KV and each context cap; and a long-context pool for
the requests above a threshold.

Example::

    plan = make_plan(PlanRequest(model="llama-3.1-70b", gpu="h200", workload=load_workload()))
    plan.as_dict()["options"][0]["requests_per_s_at_slo"]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.replicas.sim.capacity import CapacityError, Slo
from tidal.replicas.sim.presets import Preset
from tidal.scheduler.plan.capacity import (
    CapacityMeasurement,
    batch_cap_at_slo,
    first_guess,
    kv_tokens,
    largest_batch,
    measure,
    uncached_prompt_tokens,
)
from tidal.scheduler.plan.catalog import Catalog, CatalogError, Dtype, Prices
from tidal.scheduler.plan.model import predict_fleet
from tidal.scheduler.plan.replay import LatencyStats, replay_fleet
from tidal.scheduler.plan.workload import Workload, profile_dict

__all__ = ["OptionPlan", "Plan", "PlanRequest", "WeeklyPlan", "kv_tokens_in", "make_plan"]

GIB = 1024**3
HOURS = 168


def kv_tokens_in(bytes_: float, kv_bytes_per_token: float) -> int:
    """Tokens of KV that fit in ``bytes_`` (e.g. 500 GiB of a node's free HBM)."""
    return int(bytes_ // kv_bytes_per_token)


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for (the ``tidal plan`` options)."""

    model: str
    gpu: str
    workload: Workload
    catalog: Catalog
    prices: Prices
    prices_source: str = "example prices"
    weights: Dtype = "bf16"
    kv_dtype: Dtype = "bf16"
    tps: Sequence[int] | None = None  # default: the model's default_tp
    context_caps: Mapping[str, int] = field(default_factory=dict)
    peak_rps: float | None = None  # the busiest hour's rate; default: the workload's own mean rate
    slo: Slo = field(default_factory=Slo)
    warm_buffer: float = 0.12
    long_context_threshold: int = 32768
    long_context_ttft_p95_s: float | None = None  # default: 4 x the SLO's TTFT
    batch_tokens_per_day: float = 0.0
    replay: bool = True  # check the prediction against a replay at the recommended size
    effects: bool = True
    quick: bool = False  # fewer requests per capacity replay (tests, a first look)

    @property
    def measured_requests(self) -> int:
        """Requests each capacity replay measures (the long-context pool measures half)."""
        return 250 if self.quick else 600

    @property
    def rel_tol(self) -> float:
        return 0.06 if self.quick else 0.03


@dataclass(frozen=True)
class WeeklyPlan:
    """Replicas per hour of the week and what they cost."""

    replicas_per_hour: tuple[int, ...]
    reserved_replicas: int
    on_demand_replica_hours: float
    spot_replica_hours: float
    gpu_hours: float
    cost_per_week: float
    tokens_per_week: float

    @property
    def cost_per_million_tokens(self) -> float:
        return self.cost_per_week / self.tokens_per_week * 1e6 if self.tokens_per_week else math.inf


@dataclass(frozen=True)
class OptionPlan:
    """One parallelism choice (see the module docstring)."""

    tp: int
    replicas_per_node: int
    preset: str
    weights: str
    kv_dtype: str
    kv_tokens_per_replica: int
    largest_batch: int
    error: str | None = None  # why the option cannot serve the workload within the SLO
    capacity: CapacityMeasurement | None = None
    recommended_replicas: int = 0
    predicted: LatencyStats | None = None
    replayed: LatencyStats | None = None
    weekly: WeeklyPlan | None = None
    break_even_utilisation: float | None = None
    latency_by_size: tuple[tuple[int, float, float], ...] = ()  # (replicas, TTFT p95, TPOT p95) predicted

    @property
    def feasible(self) -> bool:
        return self.error is None and self.capacity is not None

    @property
    def requests_per_s_at_slo(self) -> float:
        return self.capacity.rps if self.capacity else 0.0

    @property
    def batch_cap_at_slo(self) -> int:
        return self.capacity.batch_cap if self.capacity else 0

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "tp": self.tp,
            "gpus_per_replica": self.tp,
            "replicas_per_node": self.replicas_per_node,
            "preset": self.preset,
            "weights": self.weights,
            "kv_dtype": self.kv_dtype,
            "kv_tokens_per_replica": self.kv_tokens_per_replica,
            "largest_batch_at_context_mix": self.largest_batch,
            "batch_cap_at_slo": self.batch_cap_at_slo,
            "requests_per_s_at_slo": _r(self.requests_per_s_at_slo, 4),
            "recommended_replicas": self.recommended_replicas,
            "predicted_ttft_p95_s": _r(self.predicted.ttft_p95_s, 4) if self.predicted else None,
            "predicted_tpot_p95_s": _r(self.predicted.tpot_p95_s, 5) if self.predicted else None,
            "replay_ttft_p95_s": _r(self.replayed.ttft_p95_s, 4) if self.replayed else None,
            "replay_tpot_p95_s": _r(self.replayed.tpot_p95_s, 5) if self.replayed else None,
            "cost_per_million_tokens": _r(self.weekly.cost_per_million_tokens, 4) if self.weekly else None,
            "break_even_utilisation": _r(self.break_even_utilisation, 4)
            if self.break_even_utilisation is not None
            else None,
        }
        if self.predicted and self.replayed:
            d["prediction_error"] = {
                "ttft_p95": _r(self.predicted.ttft_p95_s / self.replayed.ttft_p95_s - 1, 4),
                "tpot_p95": _r(self.predicted.tpot_p95_s / self.replayed.tpot_p95_s - 1, 4),
            }
            d["predicted"] = self.predicted.as_dict()
            d["replay"] = self.replayed.as_dict()
        elif self.predicted:
            d["predicted"] = self.predicted.as_dict()
        if self.capacity:
            m = self.capacity.measured
            d["capacity_measurement"] = {
                "replica_gets_1_in": self.capacity.fleet_size,
                "replays": [
                    {
                        "rate_rps": _r(p.rate_rps, 4),
                        "requests": p.requests,
                        "ttft_p95_s": _r(p.ttft_p95_s, 4),
                        "tpot_p95_s": _r(p.tpot_p95_s, 5),
                        "within_slo": p.within(m.slo),
                    }
                    for p in m.points
                ],
                "saturated_tokens_per_s": _r(self.capacity.saturated_tokens_per_s, 1),
            }
        if self.weekly:
            w = self.weekly
            d["week"] = {
                "replicas_per_hour": list(w.replicas_per_hour),
                "peak_replicas": max(w.replicas_per_hour),
                "reserved_replicas": w.reserved_replicas,
                "on_demand_replica_hours": _r(w.on_demand_replica_hours, 1),
                "spot_replica_hours": _r(w.spot_replica_hours, 1),
                "gpu_hours": _r(w.gpu_hours, 1),
                "cost_per_week": _r(w.cost_per_week, 2),
                "tokens_per_week": int(w.tokens_per_week),
            }
        if self.latency_by_size:
            d["predicted_by_size"] = [
                {"replicas": n, "ttft_p95_s": _r(a, 4), "tpot_p95_s": _r(b, 5)}
                for n, a, b in self.latency_by_size
            ]
        if self.error:
            d["error"] = self.error
        return d


@dataclass(frozen=True)
class Effect:
    """One what-if against the base option: another precision, or one context cap less."""

    name: str
    description: str
    kv_tokens_per_replica: int
    largest_batch: int
    batch_cap_at_slo: int
    requests_per_s_at_slo: float
    cost_per_million_tokens: float | None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "kv_tokens_per_replica": self.kv_tokens_per_replica,
            "largest_batch_at_context_mix": self.largest_batch,
            "batch_cap_at_slo": self.batch_cap_at_slo,
            "requests_per_s_at_slo": _r(self.requests_per_s_at_slo, 4),
            "cost_per_million_tokens": _r(self.cost_per_million_tokens, 4)
            if self.cost_per_million_tokens is not None
            else None,
            **({"error": self.error} if self.error else {}),
        }


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    model: str
    gpu: str
    gpu_calibrated: bool
    kv_bytes_per_token: int
    kv_bytes_per_token_bf16: int
    kv_bytes_per_token_fp8: int
    peak_rps: float
    options: tuple[OptionPlan, ...]
    recommended_tp: int | None
    tp_comparison: dict[str, Any] | None
    effects: tuple[Effect, ...]
    effects_base_tp: int | None
    long_context: dict[str, Any] | None
    notes: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        r = self.request
        return {
            "model": self.model,
            "gpu": self.gpu,
            "weights": r.weights,
            "kv_dtype": r.kv_dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_bf16": self.kv_bytes_per_token_bf16,
            "kv_bytes_per_token_fp8": self.kv_bytes_per_token_fp8,
            "kv_tokens_in_500_gb": kv_tokens_in(500 * GIB, self.kv_bytes_per_token),
            "slo": {"ttft_p95_s": r.slo.ttft_p95_s, "tpot_p95_s": r.slo.tpot_p95_s},
            "workload": {**profile_dict(r.workload), "peak_rps": _r(self.peak_rps, 4)},
            "context_caps": dict(r.context_caps),
            "warm_buffer": r.warm_buffer,
            "prices": {
                "source": r.prices_source,
                "example": r.prices.example,
                "currency": r.prices.currency,
            },
            "options": [o.as_dict() for o in self.options],
            "recommended_tp": self.recommended_tp,
            "tp_comparison": self.tp_comparison,
            "effects": {"base_tp": self.effects_base_tp, "rows": [e.as_dict() for e in self.effects]},
            "long_context_pool": self.long_context,
            "notes": list(self.notes),
        }


def _r(x: float | None, nd: int) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, nd)


# -- the week -----------------------------------------------------------------------------------


def reserved_count(replicas_per_hour: Sequence[int], reserved_price: float, on_demand_price: float) -> int:
    """Reserve the k-th replica when it is needed in at least reserved/on-demand of the hours:
    a reserved replica costs every hour, an on-demand one only the hours it runs."""
    ratio = reserved_price / on_demand_price
    n = len(replicas_per_hour)
    k = 0
    while k < max(replicas_per_hour) and sum(1 for x in replicas_per_hour if x >= k + 1) / n >= ratio:
        k += 1
    return k


def week_plan(
    rates: Sequence[float],
    capacity_rps: float,
    *,
    tp: int,
    warm_buffer: float,
    tokens_per_request: float,
    prices: Prices,
    gpu: str,
    batch_tokens_per_day: float,
    batch_tokens_per_s: float,
) -> WeeklyPlan:
    """Replicas per hour (``ceil(rate x (1 + buffer) / capacity)``, at least one) and their cost."""
    per_hour = tuple(max(1, math.ceil(r * (1 + warm_buffer) / capacity_rps - 1e-9)) for r in rates)
    price = prices.gpu(gpu)
    reserved = reserved_count(per_hour, price.reserved, price.on_demand)
    on_demand = float(sum(max(0, n - reserved) for n in per_hour))
    # Batch work first takes reserved replicas idle in the troughs, then spot replicas.
    idle_reserved_hours = sum(max(0, reserved - n) for n in per_hour)
    batch_week = 7 * batch_tokens_per_day
    absorbed = min(batch_week, idle_reserved_hours * 3600 * batch_tokens_per_s)
    spot = (batch_week - absorbed) / (3600 * batch_tokens_per_s) if batch_tokens_per_s > 0 else 0.0
    gpu_hours = tp * (reserved * HOURS + on_demand + spot)
    cost = tp * (reserved * HOURS * price.reserved + on_demand * price.on_demand + spot * price.spot)
    tokens = sum(r * 3600 for r in rates) * tokens_per_request + batch_week
    return WeeklyPlan(per_hour, reserved, on_demand, spot, gpu_hours, cost, tokens)


def break_even(
    capacity_rps: float, tp: int, reserved_gpu_hour: float, api_cost_per_request: float
) -> float | None:
    """The utilisation at which a reserved replica's cost per request equals the API's (> 1: never)."""
    if api_cost_per_request <= 0 or capacity_rps <= 0:
        return None
    return tp * reserved_gpu_hour / (3600 * capacity_rps * api_cost_per_request)


# -- the plan -----------------------------------------------------------------------------------


def _preset(req: PlanRequest, tp: int, weights: Dtype, kv: Dtype) -> Preset:
    return req.catalog.preset(req.model, req.gpu, tp=tp, weights=weights, kv_dtype=kv)


def _fleet_guess(preset: Preset, workload: Workload, peak: float, slo: Slo, buffer: float) -> int:
    """The fleet size whose prefix locality the capacity measurement should see: the fleet
    model's estimate, iterated (a replica of a larger fleet sees fewer of a prefix's requests)."""
    k = 1
    for _ in range(3):
        k_max = max(1, len(workload.requests) // 800)
        stream = workload.every(min(k, k_max))
        cap = batch_cap_at_slo(
            preset,
            stream,
            slo.tpot_p95_s,
            uncached_tokens=uncached_prompt_tokens(preset, workload, min(k, k_max)),
        )
        if cap < 1:
            return k
        nxt = _size(peak, first_guess(preset, stream, slo, cap), buffer)
        if nxt == k:
            break
        k = nxt
    return k


def _size(peak: float, capacity: float, buffer: float) -> int:
    return max(1, math.ceil(peak * (1 + buffer) / capacity - 1e-9))


Progress = Callable[[str], None]


def _option(req: PlanRequest, tp: int, workload: Workload, peak: float, progress: Progress) -> OptionPlan:
    g = req.catalog.gpus[req.catalog.gpu_name(req.gpu)]
    per_node = max(1, g.gpus_per_node // tp)
    try:
        preset = _preset(req, tp, req.weights, req.kv_dtype)
    except CatalogError as exc:
        return OptionPlan(tp, per_node, "-", req.weights, req.kv_dtype, 0, 0, error=str(exc))
    kv = kv_tokens(preset)
    big = largest_batch(preset, workload)
    base = OptionPlan(tp, per_node, preset.name, req.weights, req.kv_dtype, kv, big)
    progress(f"TP={tp}: measuring requests/s per replica within the SLO (virtual-time replays)")
    try:
        guess = _fleet_guess(preset, workload, peak, req.slo, req.warm_buffer)
        cap = measure(
            preset,
            workload,
            req.slo,
            fleet_size=guess,
            rel_tol=req.rel_tol,
            min_requests=req.measured_requests,
        )
    except CapacityError as exc:
        return _with(base, error=str(exc))
    n = _size(peak, cap.rps, req.warm_buffer)
    at_peak = workload.scaled_to(peak)
    progress(f"TP={tp}: {cap.rps:.3g} req/s per replica; predicting {n} replicas at {peak:.3g} req/s")
    predicted = predict_fleet(preset, at_peak, n, max_num_seqs=cap.batch_cap, keep_samples=True)
    sizes = sorted({max(1, round(n * f)) for f in (0.6, 0.7, 0.8, 0.9, 1.0, 1.15, 1.3, 1.5)})
    by_size = tuple(
        (k, s.ttft_p95_s, s.tpot_p95_s)
        for k in sizes
        for s in [predicted if k == n else predict_fleet(preset, at_peak, k, max_num_seqs=cap.batch_cap)]
    )
    replayed = None
    if req.replay:
        progress(f"TP={tp}: replaying the workload on {n} simulated replicas to check the prediction")
        replayed = replay_fleet(preset, at_peak, n, max_num_seqs=cap.batch_cap, keep_samples=True)
    tokens = workload.mean_prompt_tokens + workload.mean_output_tokens
    week = week_plan(
        workload.weekly(peak),
        cap.rps,
        tp=tp,
        warm_buffer=req.warm_buffer,
        tokens_per_request=tokens,
        prices=req.prices,
        gpu=req.catalog.gpu_name(req.gpu),
        batch_tokens_per_day=req.batch_tokens_per_day,
        batch_tokens_per_s=cap.saturated_tokens_per_s,
    )
    api = req.prices.api(req.catalog.model_name(req.model))
    be = None
    if api is not None:
        per_request = (
            workload.mean_prompt_tokens * api.input + workload.mean_output_tokens * api.output
        ) / 1e6
        be = break_even(cap.rps, tp, req.prices.gpu(req.catalog.gpu_name(req.gpu)).reserved, per_request)
    return _with(
        base,
        capacity=cap,
        recommended_replicas=n,
        predicted=predicted,
        replayed=replayed,
        weekly=week,
        break_even_utilisation=be,
        latency_by_size=by_size,
    )


def _with(o: OptionPlan, **kw: Any) -> OptionPlan:
    from dataclasses import replace

    return replace(o, **kw)


def _tp_comparison(options: Sequence[OptionPlan]) -> dict[str, Any] | None:
    ok = sorted((o for o in options if o.feasible), key=lambda o: o.tp)
    if len(ok) < 2:
        return None
    small, big = ok[0], ok[-1]
    if big.tp % small.tp:
        return None
    k = big.tp // small.tp

    def side(o: OptionPlan, count: int) -> dict[str, Any]:
        cap = o.requests_per_s_at_slo
        node = cap * count
        return {
            "layout": f"{count} x TP={o.tp}",
            "replicas": count,
            "requests_per_s": _r(node, 4),
            "ttft_p95_s_at_recommended_size": _r(o.predicted.ttft_p95_s, 4) if o.predicted else None,
            "tpot_p95_s_at_recommended_size": _r(o.predicted.tpot_p95_s, 5) if o.predicted else None,
            "kv_tokens_per_replica": o.kv_tokens_per_replica,
            # One GPU failing takes its whole replica down.
            "capacity_lost_when_one_gpu_fails": _r(cap, 4),
            "share_of_node_lost_when_one_gpu_fails": _r(1.0 / count, 4),
            "share_of_fleet_lost_at_recommended_size": _r(1.0 / o.recommended_replicas, 4)
            if o.recommended_replicas
            else None,
        }

    return {
        "gpus": big.tp,
        "one_big": side(big, 1),
        "several_small": side(small, k),
        "capacity_ratio_small_over_big": _r(small.requests_per_s_at_slo * k / big.requests_per_s_at_slo, 4),
    }


def _effects(
    req: PlanRequest, base: OptionPlan, workload: Workload, peak: float, progress: Progress
) -> list[Effect]:
    out: list[Effect] = []
    variants: list[tuple[str, str, Dtype, Dtype, Workload]] = []
    other_w: Dtype = "bf16" if req.weights == "fp8" else "fp8"
    other_kv: Dtype = "bf16" if req.kv_dtype == "fp8" else "fp8"
    variants.append(
        (
            f"weights {other_w}",
            f"{other_w.upper()} weights instead of {req.weights.upper()}",
            other_w,
            req.kv_dtype,
            workload,
        )
    )
    variants.append(
        (
            f"kv {other_kv}",
            f"{other_kv.upper()} KV cache instead of {req.kv_dtype.upper()}",
            req.weights,
            other_kv,
            workload,
        )
    )
    for feature, limit in sorted(req.context_caps.items()):
        rest = {f: c for f, c in req.context_caps.items() if f != feature}
        uncapped = req.workload.capped(rest)
        variants.append(
            (
                f"without cap {feature}<={limit}",
                f"the same plan without the context cap {feature}={limit}",
                req.weights,
                req.kv_dtype,
                uncapped,
            )
        )
    for name, desc, w, kvd, wl in variants:
        progress(f"effects: {desc}")
        try:
            preset = _preset(req, base.tp, w, kvd)
        except CatalogError as exc:
            out.append(Effect(name, desc, 0, 0, 0, 0.0, None, str(exc)))
            continue
        try:
            cap = measure(
                preset,
                wl,
                req.slo,
                fleet_size=base.capacity.fleet_size if base.capacity else 1,
                # As precise as the base option's: a what-if is read as a difference from it.
                rel_tol=req.rel_tol,
                min_requests=req.measured_requests,
            )
        except CapacityError as exc:
            out.append(
                Effect(name, desc, kv_tokens(preset), largest_batch(preset, wl), 0, 0.0, None, str(exc))
            )
            continue
        week = week_plan(
            wl.weekly(peak),
            cap.rps,
            tp=base.tp,
            warm_buffer=req.warm_buffer,
            tokens_per_request=wl.mean_prompt_tokens + wl.mean_output_tokens,
            prices=req.prices,
            gpu=req.catalog.gpu_name(req.gpu),
            batch_tokens_per_day=req.batch_tokens_per_day,
            batch_tokens_per_s=cap.saturated_tokens_per_s,
        )
        out.append(
            Effect(
                name,
                desc,
                kv_tokens(preset),
                largest_batch(preset, wl),
                cap.batch_cap,
                cap.rps,
                week.cost_per_million_tokens,
            )
        )
    return out


def _long_context(
    req: PlanRequest, base: OptionPlan, workload: Workload, peak: float, progress: Progress
) -> dict[str, Any] | None:
    threshold = req.long_context_threshold
    share = workload.share_above(threshold)
    info: dict[str, Any] = {"threshold_tokens": threshold, "share_of_requests": _r(share, 4)}
    if share == 0:
        info["replicas_at_peak"] = 0
        info["note"] = "no request of the workload is above the threshold"
        return info
    short, long = workload.split(threshold)
    if long is None:
        info["note"] = "too few requests above the threshold to measure"
        return info
    ttft = req.long_context_ttft_p95_s or 4 * req.slo.ttft_p95_s
    slo = Slo(ttft, req.slo.tpot_p95_s)
    info["slo"] = {"ttft_p95_s": ttft, "tpot_p95_s": slo.tpot_p95_s}
    progress(
        f"long-context pool: measuring TP={base.tp} on the {share:.1%} of requests above {threshold} tokens"
    )
    try:
        preset = _preset(req, base.tp, req.weights, req.kv_dtype)
        cap = measure(preset, long, slo, rel_tol=2 * req.rel_tol, min_requests=req.measured_requests // 2)
    except (CapacityError, CatalogError) as exc:
        info["error"] = str(exc)
        return info
    info.update(
        {
            "tp": base.tp,
            "requests_per_s_at_slo": _r(cap.rps, 4),
            "batch_cap_at_slo": cap.batch_cap,
            "replicas_at_peak": _size(peak * share, cap.rps, req.warm_buffer),
        }
    )
    if short is not None and base.capacity:
        try:
            main = measure(
                preset,
                short,
                req.slo,
                fleet_size=base.capacity.fleet_size,
                rel_tol=2 * req.rel_tol,
                min_requests=req.measured_requests // 2,
            )
            info["main_pool_requests_per_s_at_slo"] = _r(main.rps, 4)
            info["main_pool_replicas_at_peak"] = _size(peak * (1 - share), main.rps, req.warm_buffer)
        except CapacityError as exc:
            info["main_pool_error"] = str(exc)
        info["single_pool_replicas_at_peak"] = base.recommended_replicas
    return info


def make_plan(req: PlanRequest, progress: Progress | None = None) -> Plan:
    """Make the plan (see the module docstring); ``progress`` hears what is being measured."""
    say = progress or (lambda _msg: None)
    cat = req.catalog
    model = cat.model_name(req.model)
    gpu = cat.gpu_name(req.gpu)
    entry = cat.models[model]
    tps = list(req.tps or entry.default_tp)
    workload = req.workload.capped(req.context_caps)
    peak = req.peak_rps or workload.rate_rps
    notes: list[str] = []
    if req.prices.example:
        notes.append("costs use the shipped EXAMPLE prices (scheduler/plan/prices.yaml); pass --prices FILE")
    if not cat.gpus[gpu].calibrated:
        notes.append(
            f"{gpu}'s bandwidth efficiency is a guess, not fitted to measurements: treat times as rough"
        )
    if req.prices.api(model) is None:
        notes.append(f"no external API price for {model}: no break-even")
    options = tuple(_option(req, tp, workload, peak, say) for tp in tps)
    feasible = [o for o in options if o.feasible and o.weekly]
    best = (
        min(feasible, key=lambda o: o.weekly.cost_per_million_tokens if o.weekly else math.inf)
        if feasible
        else None
    )
    effects: list[Effect] = []
    long_ctx = None
    if best is not None:
        if req.effects:
            effects = _effects(req, best, workload, peak, say)
        # Requests above the threshold go to their own pool instead of being capped: the
        # long-context pool is sized on the workload before its caps.
        long_ctx = _long_context(req, best, req.workload, peak, say)
    return Plan(
        request=req,
        model=model,
        gpu=gpu,
        gpu_calibrated=cat.gpus[gpu].calibrated,
        kv_bytes_per_token=cat.kv_bytes_per_token(model, req.kv_dtype),
        kv_bytes_per_token_bf16=cat.kv_bytes_per_token(model, "bf16"),
        kv_bytes_per_token_fp8=cat.kv_bytes_per_token(model, "fp8"),
        peak_rps=peak,
        options=options,
        recommended_tp=best.tp if best else None,
        tp_comparison=_tp_comparison(options),
        effects=tuple(effects),
        effects_base_tp=best.tp if best else None,
        long_context=long_ctx,
        notes=tuple(notes),
    )


def prices_label(path: Path, example: bool) -> str:
    return f"{path}{' (EXAMPLE prices)' if example else ''}"
