"""``tidal plan compare``: decide a quantisation by an eval run, next to capacity and cost.

Each build (e.g. BF16 weights and FP8 weights of one model) is scored with the batch tier's
``eval`` job kind (:mod:`batch_jobs.jobs.offline_eval`): straight against its replicas
(:class:`~scheduler.evals.ReplicaEvalRunner`, given by URL) or as an eval job through a gateway
pinned to its pool and group (:class:`~scheduler.evals.JobEvalRunner`). Its capacity -- requests
per second per replica within the SLO, measured by replaying the workload on the simulated
replica of that precision -- and its cost per million tokens at that capacity (reserved price)
come from the planner. The first build is the baseline; the recommendation weighs the score the
second one loses (or gains) against what it saves:

* cheaper and its score within ``max_score_drop`` of the baseline's: take it;
* cheaper but it loses more than that: keep the baseline;
* not cheaper: take it only when it scores better by more than ``max_score_drop``.

The difference's 95 % interval (Newcombe's hybrid score interval from the two Wilson intervals)
says whether the eval set is large enough to tell a drop of ``max_score_drop``.

Example::

    result = await compare_builds([BuildSpec("bf16", urls=("http://a:8000",)),
                                   BuildSpec("fp8", weights="fp8", urls=("http://b:8000",))],
                                  model="llama-3.1-70b", gpu="h200", dataset=Path("qa.jsonl"), ...)
    result["recommendation"], result["reason"]
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.replicas.sim.capacity import CapacityError, Slo
from tidal.scheduler.evals import EvalError, JobEvalRunner, ReplicaEvalRunner
from tidal.scheduler.plan.capacity import kv_tokens, measure
from tidal.scheduler.plan.catalog import Catalog, CatalogError, Dtype, Prices
from tidal.scheduler.plan.workload import Workload
from tidal.scheduler.signals import ReplicaView

__all__ = ["BuildSpec", "compare_builds", "newcombe_interval", "render_comparison"]


@dataclass(frozen=True)
class BuildSpec:
    """One build under comparison: its precision, and where its replicas are."""

    label: str
    weights: Dtype = "bf16"
    kv_dtype: Dtype = "bf16"
    urls: tuple[str, ...] = ()  # its replicas, evaluated directly
    pool: str | None = None  # or: its pool and group behind a gateway, evaluated as a job
    group: str = "stable"


class _Listing:
    def __init__(self, views: Sequence[ReplicaView]) -> None:
        self.views = list(views)

    async def replicas(self) -> list[ReplicaView]:
        return self.views


def newcombe_interval(a: tuple[float, float, float], b: tuple[float, float, float]) -> tuple[float, float]:
    """95 % interval of ``p_b - p_a`` from each proportion and its Wilson interval ``(p, lo, hi)``."""
    pa, la, ua = a
    pb, lb, ub = b
    d = pb - pa
    return (d - math.hypot(pb - lb, ua - pa), d + math.hypot(ub - pb, pa - la))


async def _score(
    build: BuildSpec,
    *,
    dataset: Path,
    served_model: str,
    eval_options: Mapping[str, Any],
    max_items: int,
    gateway: str | None,
) -> dict[str, Any]:
    if build.urls:
        key = f"compare-{build.label}"
        views = [ReplicaView(f"{key}-{i}", url, key, group=key) for i, url in enumerate(build.urls)]
        runner = ReplicaEvalRunner(
            _Listing(views), dataset, models={key: served_model}, options=eval_options, max_items=max_items
        )
        return await runner.report(key, key)
    if build.pool is None or gateway is None:
        raise EvalError(f"build {build.label}: give its replica URLs, or its pool and a gateway")
    admin_key = os.environ.get("TIDAL_ADMIN_KEY")
    if not admin_key:
        raise EvalError("eval jobs pinned to a pool need the gateway's admin key in TIDAL_ADMIN_KEY")
    job = JobEvalRunner(
        gateway, admin_key=admin_key, dataset=dataset, models={build.pool: served_model}, options=eval_options
    )
    return await job.report(build.pool, build.group)


def _capacity(
    build: BuildSpec,
    *,
    catalog: Catalog,
    model: str,
    gpu: str,
    tp: int,
    workload: Workload,
    slo: Slo,
    prices: Prices,
    quick: bool,
) -> dict[str, Any]:
    try:
        preset = catalog.preset(model, gpu, tp=tp, weights=build.weights, kv_dtype=build.kv_dtype)
        cap = measure(
            preset, workload, slo, rel_tol=0.06 if quick else 0.03, min_requests=250 if quick else 600
        )
    except (CapacityError, CatalogError) as exc:
        return {"error": str(exc)}
    tokens = workload.mean_prompt_tokens + workload.mean_output_tokens
    reserved = prices.gpu(catalog.gpu_name(gpu)).reserved
    return {
        "kv_tokens_per_replica": kv_tokens(preset),
        "batch_cap_at_slo": cap.batch_cap,
        "requests_per_s_at_slo": cap.rps,
        # A reserved replica kept busy at its capacity: the cost floor per token.
        "cost_per_million_tokens": tp * reserved / (3600 * cap.rps * tokens) * 1e6,
    }


def _recommend(
    base: dict[str, Any], cand: dict[str, Any], max_drop: float, ci: tuple[float, float]
) -> tuple[str, str]:
    diff = cand["score"] - base["score"]
    ca, cb = base.get("cost_per_million_tokens"), cand.get("cost_per_million_tokens")
    if ca is None or cb is None:
        return base["label"], "no capacity for one build, so no cost to weigh: keep the baseline"
    saving = 1 - cb / ca
    cap_ratio = cand["requests_per_s_at_slo"] / base["requests_per_s_at_slo"]
    score_txt = f"eval score {cand['score']:.3f} against {base['score']:.3f} ({diff:+.3f}; 95% interval {ci[0]:+.3f} to {ci[1]:+.3f})"
    money = f"{cap_ratio:.2f} x the requests/s per replica within the SLO, {saving:+.1%} cost per token saved"
    if cb < ca:
        if -diff <= max_drop:
            caveat = (
                ""
                if ci[0] >= -max_drop
                else f"; the eval set cannot rule out a drop larger than {max_drop:g} (its interval reaches {ci[0]:+.3f}): evaluate on more items"
            )
            return cand[
                "label"
            ], f"{cand['label']}: {score_txt}, within {max_drop:g} of the baseline, for {money}{caveat}"
        return (
            base["label"],
            f"keep {base['label']}: {cand['label']} loses {-diff:.3f} of the eval score (more than {max_drop:g}) for {money}",
        )
    if diff > max_drop:
        return cand["label"], f"{cand['label']}: better {score_txt} though not cheaper ({money})"
    return base[
        "label"
    ], f"keep {base['label']}: {cand['label']} is not cheaper ({money}) and not better ({score_txt})"


async def compare_builds(
    builds: Sequence[BuildSpec],
    *,
    model: str,
    gpu: str,
    tp: int | None,
    dataset: Path,
    served_model: str,
    eval_options: Mapping[str, Any],
    max_items: int,
    gateway: str | None,
    catalog: Catalog,
    prices: Prices,
    workload: Workload,
    slo: Slo,
    max_score_drop: float = 0.01,
    quick: bool = False,
) -> dict[str, Any]:
    """Score, capacity and cost of two builds, and which to run (see the module docstring)."""
    if len(builds) != 2:
        raise ValueError("compare exactly two builds (the baseline first)")
    model_key = catalog.model_name(model)
    size = tp or catalog.models[model_key].default_tp[0]
    rows: list[dict[str, Any]] = []
    for b in builds:
        report = await _score(
            b,
            dataset=dataset,
            served_model=served_model,
            eval_options=eval_options,
            max_items=max_items,
            gateway=gateway,
        )
        cap = _capacity(
            b,
            catalog=catalog,
            model=model_key,
            gpu=gpu,
            tp=size,
            workload=workload,
            slo=slo,
            prices=prices,
            quick=quick,
        )
        rows.append(
            {
                "label": b.label,
                "weights": b.weights,
                "kv_dtype": b.kv_dtype,
                "score": float(report["score"]),
                "ci95": list(report["ci95"]),
                "items": int(report["n"]),
                "failed": int(report["failed"]),
                **cap,
            }
        )
    base, cand = rows
    ci = newcombe_interval(
        (base["score"], *base["ci95"]),
        (cand["score"], *cand["ci95"]),
    )
    label, reason = _recommend(base, cand, max_score_drop, ci)
    out: dict[str, Any] = {
        "model": model_key,
        "gpu": catalog.gpu_name(gpu),
        "tp": size,
        "workload": workload.label,
        "slo": {"ttft_p95_s": slo.ttft_p95_s, "tpot_p95_s": slo.tpot_p95_s},
        "prices_example": prices.example,
        "builds": rows,
        "score_difference": cand["score"] - base["score"],
        "score_difference_ci95": list(ci),
        "recommendation": label,
        "reason": reason,
    }
    if "requests_per_s_at_slo" in base and "requests_per_s_at_slo" in cand:
        out["capacity_ratio"] = cand["requests_per_s_at_slo"] / base["requests_per_s_at_slo"]
        out["cost_ratio"] = cand["cost_per_million_tokens"] / base["cost_per_million_tokens"]
    return out


def render_comparison(result: Mapping[str, Any]) -> str:
    """The comparison as the terminal shows it."""
    lines = [
        f"== {result['model']} on {result['gpu']} (TP={result['tp']}); capacity on {result['workload']}",
        f"{'build':<12} {'weights':<8} {'kv':<5} {'score':>6} {'ci95':>15} {'req_s_at_slo':>13} {'cost/Mtok':>10}",
    ]
    for r in result["builds"]:
        rps = r.get("requests_per_s_at_slo")
        cost = r.get("cost_per_million_tokens")
        lines.append(
            f"{r['label']:<12} {r['weights']:<8} {r['kv_dtype']:<5} {r['score']:>6.3f} "
            f"{r['ci95'][0]:>7.3f}-{r['ci95'][1]:<7.3f} {f'{rps:.3g}' if rps else '-':>13} {f'{cost:.4g}' if cost else '-':>10}"
        )
    lo, hi = result["score_difference_ci95"]
    lines.append(f"score difference {result['score_difference']:+.3f} (95% interval {lo:+.3f} to {hi:+.3f})")
    if "capacity_ratio" in result:
        lines.append(f"capacity x{result['capacity_ratio']:.2f}, cost per token x{result['cost_ratio']:.2f}")
    lines.append(f"recommendation: {result['recommendation']} -- {result['reason']}")
    if result.get("prices_example"):
        lines.append("note: costs use the shipped EXAMPLE prices")
    return "\n".join(lines)
