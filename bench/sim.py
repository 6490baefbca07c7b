"""``tidal bench sim``: how fast the simulator runs, in virtual time and in real time.

1. **Trace replay in virtual time**: the Mooncake conversation trace (or ``--trace FILE``, or
   the built-in synthetic workload when the shared traces are absent) on ``--replicas`` replicas
   of ``--preset`` (default 8 x Llama-3.1-70B FP8 on 4 x H200), requests spread round-robin.
   Reports simulated seconds per wall second, peak RSS, and what the replicas did (TTFT, TPOT,
   prefix-cache hit ratio next to the trace's ideal). The baseline, measured in the same run, is
   the same engine stepping one step at a time on the first ``--baseline-s`` seconds of the
   trace: both give the same results, so the ratio is the speed-up of applying runs of decode
   steps in closed form.
2. **Real time**: one ``tidal sim`` process serving ``--streams`` concurrent streams; its own
   step timing (actual step length over the cost model's) and what clients see.

``--quick`` replays the first 10 minutes and runs the real-time check for 10 s.
"""

from __future__ import annotations

import functools
import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.bench.traces import TraceRequest, block_hashes, ideal_hit_ratio, load_default
from tidal.replicas.sim.presets import get_preset
from tidal.replicas.sim.virtual import SimRequest, SimResult, VirtualCluster

__all__ = ["replay", "run"]


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def replay(
    requests: Sequence[TraceRequest],
    *,
    preset: str,
    replicas: int,
    until_s: float | None = None,
    fast_forward: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Replay ``requests`` (arrivals up to ``until_s``) round-robin on a virtual cluster."""
    p = get_preset(preset)
    bs = p.block_size
    cap = p.context_len
    cluster = VirtualCluster(preset, replicas, seed=seed, fast_forward=fast_forward)
    results: list[SimResult] = []
    reqs = [r for r in requests if until_s is None or r.arrival_s < until_s]
    prompt_tokens = 0

    def arrive(c: VirtualCluster, i: int, tr: TraceRequest) -> None:
        nonlocal prompt_tokens
        n = min(tr.input_length, cap - 1)
        out = max(1, min(tr.output_length, cap - n))
        prompt_tokens += n
        hashes = block_hashes(tr, bs)[: n // bs]
        c.submit(
            i % replicas,
            SimRequest(
                f"t{i}", max_tokens=out, block_hashes=hashes, num_prompt_tokens=n, on_finish=results.append
            ),
        )

    for i, tr in enumerate(reqs):
        cluster.at(tr.arrival_s, functools.partial(arrive, i=i, tr=tr))
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    cluster.run()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    sim_s = cluster.now
    ttft = [r.ttft for r in results if r.ttft is not None]
    tpot = [r.tpot for r in results if r.tpot is not None]
    snaps = [e.snapshot() for e in cluster.engines]
    hits = sum(s.prefix_cache_hits for s in snaps)
    queries = sum(s.prefix_cache_queries for s in snaps)
    steps = sum(e.num_steps for e in cluster.engines)
    busy = sum(e.busy_seconds for e in cluster.engines)
    return {
        "requests": len(results),
        "sim_seconds": round(sim_s, 1),
        "wall_seconds": round(wall, 2),
        "sim_seconds_per_wall_second": round(sim_s / wall, 1) if wall > 0 else float("inf"),
        # The machine is shared: CPU time says what the replay costs whatever else runs.
        "sim_seconds_per_cpu_second": round(sim_s / cpu, 1) if cpu > 0 else float("inf"),
        "load_avg_1m": round(max(load, os.getloadavg()[0]), 2),
        "steps": steps,
        "steps_per_wall_second": round(steps / wall) if wall > 0 else 0,
        "events": cluster.num_events,
        "gpu_busy_fraction": round(busy / (sim_s * replicas), 3) if sim_s > 0 else 0.0,
        "ttft_p50_s": round(_pct(ttft, 0.5), 4),
        "ttft_p99_s": round(_pct(ttft, 0.99), 3),
        "tpot_p50_ms": round(_pct(tpot, 0.5) * 1e3, 2),
        "tpot_p99_ms": round(_pct(tpot, 0.99) * 1e3, 2),
        "prefix_hit_ratio": round(hits / queries, 4) if queries else 0.0,
        "ideal_hit_ratio": round(ideal_hit_ratio(reqs), 4),
        "preemptions": int(sum(s.num_preemptions for s in snaps)),
        "prompt_tokens": prompt_tokens,
        "_results": results,
    }


def _peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(
    quick: bool,
    out_dir: Path,
    preset: str = "llama-3.1-70b-fp8-h200-tp4",
    replicas: str | int = 8,
    seed: str | int = 0,
    until: str | float | None = None,
    baseline_s: str | float | None = None,
    trace: str | None = None,
    no_realtime: bool = False,
    realtime_preset: str = "llama-3.1-70b-fp8-h200-tp4",
    streams: str | int = 256,
) -> list[dict[str, Any]]:
    """The benchmark entry point (``tidal bench sim [--quick] [--trace F] [--replicas N] ...``)."""
    from tidal.cli.bench import print_table

    preset = str(preset)
    replicas = int(replicas)
    seed = int(seed)
    until = float(until) if until is not None else (600.0 if quick else None)
    baseline_s = float(baseline_s) if baseline_s is not None else (60.0 if quick else 120.0)
    requests, source = load_default(
        "mooncake_conversation_trace.jsonl",
        trace=trace,
        seed=seed,
        synthetic_duration_s=600.0 if quick else 3600.0,
    )
    print(f"workload: {source}")
    rows: list[dict[str, Any]] = []

    # The baseline first: step by step on a short slice, then the same slice in closed form.
    base = replay(
        requests, preset=preset, replicas=replicas, until_s=baseline_s, fast_forward=False, seed=seed
    )
    fast = replay(
        requests, preset=preset, replicas=replicas, until_s=baseline_s, fast_forward=True, seed=seed
    )
    same = _same_results(base.pop("_results"), fast.pop("_results"))
    for name, r in (("step-by-step (baseline)", base), ("closed-form runs", fast)):
        rows.append({"check": f"replay first {baseline_s:.0f} s: {name}", **r, "same_results": same})
    ratio = fast["sim_seconds_per_wall_second"] / base["sim_seconds_per_wall_second"]

    full = replay(requests, preset=preset, replicas=replicas, until_s=until, fast_forward=True, seed=seed)
    full.pop("_results")
    span = "all" if until is None else f"first {until:.0f} s"
    rows.append(
        {
            "check": f"replay {span} of the workload",
            **full,
            "peak_rss_mb": round(_peak_rss_mb(), 1),
            "speedup_vs_baseline": round(ratio, 1),
        }
    )
    print_table(
        [
            {
                "check": r["check"],
                "requests": r["requests"],
                "sim_s": r["sim_seconds"],
                "wall_s": r["wall_seconds"],
                "sim_s/wall_s": r["sim_seconds_per_wall_second"],
                "sim_s/cpu_s": r["sim_seconds_per_cpu_second"],
                "load": r["load_avg_1m"],
                "steps/wall_s": r["steps_per_wall_second"],
                "hit": r["prefix_hit_ratio"],
                "ideal_hit": r["ideal_hit_ratio"],
                "ttft_p50": r["ttft_p50_s"],
                "tpot_p50_ms": r["tpot_p50_ms"],
            }
            for r in rows
        ]
    )
    print(
        f"\n{replicas} x {preset}: {full['sim_seconds_per_wall_second']} simulated seconds per wall "
        f"second ({full['sim_seconds_per_cpu_second']} per CPU second, load average "
        f"{full['load_avg_1m']}; {ratio:.1f}x the step-by-step baseline, same results: {same}); "
        f"peak RSS {rows[-1]['peak_rss_mb']} MB"
    )
    if not no_realtime:
        from tidal.bench.sim_realtime import realtime_check

        rt = realtime_check(
            preset=str(realtime_preset),
            streams=int(streams),
            seconds=10.0 if quick else 30.0,
        )
        rows.append(rt)
        print_table([rt])
    for r in rows:
        r["workload"] = source
    return rows


def _same_results(a: list[SimResult], b: list[SimResult]) -> bool:
    def key(r: SimResult) -> tuple[Any, ...]:
        return (
            r.request_id,
            r.replica,
            r.num_cached_tokens,
            r.num_output_tokens,
            r.num_preemptions,
            r.finish_reason,
            round(r.finish_time, 6),
            round(r.first_token_time or -1.0, 6),
        )

    return sorted(map(key, a)) == sorted(map(key, b))
