"""``tidal plan``: size a fleet for a workload, and ``tidal plan compare``: decide a quantisation."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import click

__all__ = ["plan"]

_HELP = """Plan a fleet: for each tensor-parallel size of MODEL on GPU, the KV per token and per
replica, the batch cap that keeps TPOT within the target, the requests/s one replica serves
within the SLO (measured by replaying the workload on the simulated replica in virtual time),
the replicas the peak needs with the warm buffer, the TTFT/TPOT p95 the fleet model predicts
there and a replay of the same workload on that many replicas to check it, replicas per hour of
the week (reserved, on-demand, spot for batch), cost per million tokens and the break-even
utilisation against an external API; TP=8 against 2 x TP=4, the effect of FP8 weights, FP8 KV
and each context cap, and a long-context pool. Models, GPUs and prices are data
(scheduler/plan/catalog.yaml, prices.yaml: EXAMPLE prices); --catalog and --prices change them.

\b
Examples:
  tidal plan --model llama-3.1-70b --gpu h200 --json
  tidal plan --model llama-3.1-70b --gpu h200 --weights fp8 --tp 4,8 --workload mooncake --ttft-p95 4
  tidal plan --model llama-3.1-8b --gpu h100 --profile chat.yaml --context-cap rag=16384 --html plan.html
  tidal plan compare --model llama-3.1-70b --gpu h200 --dataset qa.jsonl \\
      --build bf16:weights=bf16,url=http://10.0.0.5:8000 --build fp8:weights=fp8,url=http://10.0.0.6:8000"""


def _tps(value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        tps = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise click.BadParameter(f"expected sizes like 4,8, got {value!r}") from None
    if not tps or any(t < 1 or t > 64 for t in tps):
        raise click.BadParameter("tensor-parallel sizes must be within 1..64")
    return tps


def _caps(values: tuple[str, ...]) -> dict[str, int]:
    caps: dict[str, int] = {}
    for v in values:
        feature, sep, tokens = v.partition("=")
        if not sep or not feature.strip():
            raise click.BadParameter(f"expected FEATURE=TOKENS, got {v!r}", param_hint="--context-cap")
        try:
            n = int(tokens)
        except ValueError:
            raise click.BadParameter(
                f"{v!r}: TOKENS must be an integer", param_hint="--context-cap"
            ) from None
        if n < 2:
            raise click.BadParameter(f"{v!r}: a cap of at least 2 tokens", param_hint="--context-cap")
        caps[feature.strip()] = n
    return caps


@click.group(invoke_without_command=True, help=_HELP, context_settings={"max_content_width": 100})
@click.option("--model", default=None, help="Model name or alias from the catalog (e.g. llama-3.1-70b).")
@click.option("--gpu", default=None, help="GPU name or alias from the catalog (e.g. h200).")
@click.option("--weights", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True)
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True)
@click.option(
    "--tp", "tp", default=None, help="Tensor-parallel sizes to compare, e.g. 4,8 (default: the model's)."
)
@click.option(
    "--context-cap",
    "context_caps",
    multiple=True,
    metavar="FEATURE=TOKENS",
    help="Cap a feature's context (prompt + output); '*' caps every feature. Repeatable.",
)
@click.option(
    "--workload",
    default=None,
    help="synthetic (default), mooncake, mooncake-synthetic, azure-conv, azure-code, or a trace file.",
)
@click.option(
    "--profile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A workload profile (YAML/JSON: features' length ranges, rate, weekly load) instead of a trace.",
)
@click.option(
    "--ttft-p95",
    type=click.FloatRange(min=0.001),
    default=1.0,
    show_default=True,
    help="TTFT p95 target (s).",
)
@click.option(
    "--tpot", type=click.FloatRange(min=0.0001), default=0.05, show_default=True, help="TPOT p95 target (s)."
)
@click.option(
    "--peak-rps",
    type=click.FloatRange(min=0.0001),
    default=None,
    help="Requests/s in the busiest hour (default: the workload's mean rate).",
)
@click.option("--warm-buffer", type=click.FloatRange(0.0, 1.0), default=0.12, show_default=True)
@click.option("--long-context-threshold", type=click.IntRange(min=2), default=32768, show_default=True)
@click.option(
    "--long-context-ttft-p95",
    type=click.FloatRange(min=0.001),
    default=None,
    help="TTFT p95 target of the long-context pool (default: 4 x --ttft-p95).",
)
@click.option(
    "--batch-tokens-per-day",
    type=click.FloatRange(min=0.0),
    default=0.0,
    show_default=True,
    help="Batch work to place on troughs and spot.",
)
@click.option(
    "--prices",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Prices file (default: the shipped EXAMPLE prices).",
)
@click.option(
    "--catalog",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="More models/GPUs (YAML/JSON, the catalog's layout).",
)
@click.option("--no-replay", is_flag=True, help="Skip the replay that checks the prediction.")
@click.option("--no-effects", is_flag=True, help="Skip the FP8 and context-cap what-ifs.")
@click.option("--quick", is_flag=True, help="Shorter capacity replays (noisier figures, about 3x faster).")
@click.option("--seed", default=0, show_default=True, help="Seed of the synthetic workload and trace jitter.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write an HTML report with plots.",
)
@click.pass_context
def plan(
    ctx: click.Context,
    model: str | None,
    gpu: str | None,
    weights: str,
    kv_dtype: str,
    tp: str | None,
    context_caps: tuple[str, ...],
    workload: str | None,
    profile: Path | None,
    ttft_p95: float,
    tpot: float,
    peak_rps: float | None,
    warm_buffer: float,
    long_context_threshold: int,
    long_context_ttft_p95: float | None,
    batch_tokens_per_day: float,
    prices: Path | None,
    catalog: Path | None,
    no_replay: bool,
    no_effects: bool,
    quick: bool,
    seed: int,
    as_json: bool,
    html_path: Path | None,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    if not model or not gpu:
        raise click.UsageError("--model and --gpu are required")
    from tidal.replicas.sim.capacity import Slo
    from tidal.scheduler.plan.catalog import CatalogError, load_catalog, load_prices
    from tidal.scheduler.plan.planner import PlanRequest, make_plan, prices_label
    from tidal.scheduler.plan.report import render_html, render_text
    from tidal.scheduler.plan.workload import WorkloadError, load_workload

    if html_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            click.echo("--html needs matplotlib: pip install 'tidal[bench]'", err=True)
            sys.exit(2)
    try:
        cat = load_catalog(catalog)
        price_table, price_path = load_prices(prices)
        cat.model_name(model)
        cat.gpu_name(gpu)
        wl = load_workload(workload, profile=profile, seed=seed)
    except (CatalogError, WorkloadError) as exc:
        click.echo(f"tidal plan: {exc}", err=True)
        sys.exit(2)
    req = PlanRequest(
        model=model,
        gpu=gpu,
        workload=wl,
        catalog=cat,
        prices=price_table,
        prices_source=prices_label(price_path, price_table.example),
        weights="fp8" if weights == "fp8" else "bf16",
        kv_dtype="fp8" if kv_dtype == "fp8" else "bf16",
        tps=_tps(tp),
        context_caps=_caps(context_caps),
        peak_rps=peak_rps,
        slo=Slo(ttft_p95, tpot),
        warm_buffer=warm_buffer,
        long_context_threshold=long_context_threshold,
        long_context_ttft_p95_s=long_context_ttft_p95,
        batch_tokens_per_day=batch_tokens_per_day,
        replay=not no_replay,
        effects=not no_effects,
        quick=quick,
    )
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        click.echo(f"[{time.perf_counter() - t0:6.1f} s] {msg}", err=True)

    try:
        result = make_plan(req, progress)
    except CatalogError as exc:
        click.echo(f"tidal plan: {exc}", err=True)
        sys.exit(2)
    if html_path is not None:
        html_path.write_text(render_html(result))
        progress(f"HTML report written to {html_path}")
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2))
    else:
        click.echo(render_text(result))


def _build(value: str) -> dict[str, Any]:
    label, sep, rest = value.partition(":")
    if not sep or not label:
        raise click.BadParameter(f"expected LABEL:key=value,..., got {value!r}", param_hint="--build")
    spec: dict[str, Any] = {"label": label, "urls": []}
    for part in rest.split(","):
        key, eq, val = part.partition("=")
        key = key.strip()
        if not eq or not val:
            raise click.BadParameter(f"{value!r}: {part!r} is not key=value", param_hint="--build")
        if key == "url":
            spec["urls"].append(val)
        elif (key in ("weights", "kv") and val in ("bf16", "fp8")) or key in ("pool", "group"):
            spec[key] = val
        else:
            raise click.BadParameter(f"{value!r}: unknown key or value {part!r}", param_hint="--build")
    if not spec["urls"] and "pool" not in spec:
        raise click.BadParameter(
            f"{value!r}: give url=... (replicas) or pool=... (through --gateway)", param_hint="--build"
        )
    return spec


@plan.command("compare", context_settings={"max_content_width": 100})
@click.option("--model", required=True, help="Catalog model both builds serve.")
@click.option("--gpu", required=True, help="Catalog GPU both builds run on.")
@click.option(
    "--tp",
    type=click.IntRange(1, 64),
    default=None,
    help="Tensor-parallel size (default: the model's first).",
)
@click.option(
    "--build",
    "builds",
    multiple=True,
    required=True,
    metavar="LABEL:KEY=VALUE,...",
    help="A build: weights=bf16|fp8, kv=bf16|fp8, and url=... (its replicas; repeatable) or "
    "pool=...[,group=...] (through --gateway). Give two; the first is the baseline.",
)
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="Eval set (JSONL: prompt or messages, reference).",
)
@click.option("--served-model", default=None, help="Model name the builds serve (default: --model).")
@click.option(
    "--scorer", type=click.Choice(["exact", "contains", "regex"]), default="exact", show_default=True
)
@click.option("--pattern", default=None, help="Regex for the regex scorer.")
@click.option("--max-tokens", type=click.IntRange(1, 8192), default=64, show_default=True)
@click.option("--max-items", type=click.IntRange(1, 10_000), default=1000, show_default=True)
@click.option(
    "--gateway", default=None, help="Gateway URL: builds given by pool run as eval jobs of the batch tier."
)
@click.option(
    "--max-score-drop",
    type=click.FloatRange(0.0, 1.0),
    default=0.01,
    show_default=True,
    help="Largest eval score loss worth the savings.",
)
@click.option("--workload", default=None, help="Workload for the capacity figures (as tidal plan).")
@click.option(
    "--profile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A workload profile instead of --workload (as tidal plan).",
)
@click.option("--quick", is_flag=True, help="Shorter capacity replays (noisier figures).")
@click.option("--ttft-p95", type=click.FloatRange(min=0.001), default=1.0, show_default=True)
@click.option("--tpot", type=click.FloatRange(min=0.0001), default=0.05, show_default=True)
@click.option("--prices", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--catalog", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as one JSON object.")
def compare(
    model: str,
    gpu: str,
    tp: int | None,
    builds: tuple[str, ...],
    dataset: Path,
    served_model: str | None,
    scorer: str,
    pattern: str | None,
    max_tokens: int,
    max_items: int,
    gateway: str | None,
    max_score_drop: float,
    workload: str | None,
    profile: Path | None,
    quick: bool,
    ttft_p95: float,
    tpot: float,
    prices: Path | None,
    catalog: Path | None,
    as_json: bool,
) -> None:
    """Decide a quantisation: run the `eval` job kind on two builds (e.g. BF16 and FP8) and set the
    score difference beside the capacity and cost difference, with a recommendation and its reason.

    Example: tidal plan compare --model llama-3.1-70b --gpu h200 --dataset qa.jsonl
    --build bf16:weights=bf16,url=http://10.0.0.5:8000 --build fp8:weights=fp8,url=http://10.0.0.6:8000
    """
    from tidal.replicas.sim.capacity import Slo
    from tidal.scheduler.evals import EvalError
    from tidal.scheduler.plan.catalog import CatalogError, load_catalog, load_prices
    from tidal.scheduler.plan.compare import BuildSpec, compare_builds, render_comparison
    from tidal.scheduler.plan.workload import WorkloadError, load_workload

    specs = [_build(b) for b in builds]
    if len(specs) != 2:
        raise click.UsageError("give exactly two --build options (the baseline first)")
    if any("pool" in s for s in specs) and not gateway:
        raise click.UsageError("builds given by pool need --gateway (and TIDAL_ADMIN_KEY)")
    options: dict[str, Any] = {"scorer": scorer, "max_tokens": max_tokens}
    if pattern:
        options["pattern"] = pattern
    try:
        cat = load_catalog(catalog)
        price_table, _ = load_prices(prices)
        wl = load_workload(workload, profile=profile)
        result = asyncio.run(
            compare_builds(
                [
                    BuildSpec(
                        s["label"],
                        weights=s.get("weights", "bf16"),
                        kv_dtype=s.get("kv", "bf16"),
                        urls=tuple(s["urls"]),
                        pool=s.get("pool"),
                        group=s.get("group", "stable"),
                    )
                    for s in specs
                ],
                model=model,
                gpu=gpu,
                tp=tp,
                dataset=dataset,
                served_model=served_model or model,
                eval_options=options,
                max_items=max_items,
                gateway=gateway,
                catalog=cat,
                prices=price_table,
                workload=wl,
                slo=Slo(ttft_p95, tpot),
                max_score_drop=max_score_drop,
                quick=quick,
            )
        )
    except (CatalogError, WorkloadError, EvalError, ValueError) as exc:
        click.echo(f"tidal plan compare: {exc}", err=True)
        sys.exit(1)
    click.echo(json.dumps(result, indent=2) if as_json else render_comparison(result))
