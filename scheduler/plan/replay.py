"""Replays of a workload on simulated replicas in virtual time, and the latency figures they give.

:func:`replay_fleet` sends a :class:`~scheduler.plan.workload.Workload` to ``n`` replicas of
one preset on a :class:`~replicas.sim.virtual.VirtualCluster` (the simulator's engine: vLLM v1's
scheduler, paged KV with prefix caching, chunked prefill, preemption; step times from the cost
model), each request to the replica with the fewest requests in flight (ties rotate), as the
gateway's load-aware routing does without prefix affinity. Requests of the first
``warmup_fraction`` of the replay fill caches and batches and are not measured.

:class:`LatencyStats` is what the planner compares: TTFT and TPOT percentiles (TPOT per request,
as vLLM's histogram: the time after the first token over the tokens after it), the prefix-cache
hit ratio and throughput. :func:`quantile` is the nearest-rank percentile both the replay and
the fleet model (:mod:`scheduler.plan.model`) use.

Example::

    stats = replay_fleet(preset, workload.scaled_to(40.0), replicas=8, max_num_seqs=160)
    stats.ttft_p95_s, stats.tpot_p95_s
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidal.replicas.sim.presets import Preset
from tidal.replicas.sim.traces import block_hashes
from tidal.replicas.sim.virtual import SimRequest, SimResult, VirtualCluster
from tidal.scheduler.plan.workload import Workload

__all__ = ["LatencyStats", "quantile", "replay_fleet", "stats_of"]


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1]); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


@dataclass(frozen=True)
class LatencyStats:
    """Latencies of the measured requests of one run (seconds)."""

    requests: int
    ttft_p50_s: float
    ttft_p95_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    prefix_hit_ratio: float
    requests_per_s: float  # completions per second over the measured span
    tokens_per_s: float  # prompt + output tokens of those completions per second
    ttft_samples: tuple[float, ...] = ()
    tpot_samples: tuple[float, ...] = ()

    def as_dict(self) -> dict[str, float | int]:
        return {
            "requests": self.requests,
            "ttft_p50_s": round(self.ttft_p50_s, 4),
            "ttft_p95_s": round(self.ttft_p95_s, 4),
            "tpot_p50_s": round(self.tpot_p50_s, 5),
            "tpot_p95_s": round(self.tpot_p95_s, 5),
            "prefix_hit_ratio": round(self.prefix_hit_ratio, 4),
            "requests_per_s": round(self.requests_per_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 1),
        }


def stats_of(
    rows: Sequence[tuple[float, float | None, float, int, int, int]],
    start: float,
    *,
    keep_samples: bool = False,
) -> LatencyStats:
    """Figures of ``(arrival, ttft, finish, prompt, cached, output)`` rows arriving at or after ``start``."""
    measured = [r for r in rows if r[0] >= start]
    ttft = [r[1] for r in measured if r[1] is not None]
    tpot = [(r[2] - r[0] - r[1]) / (r[5] - 1) for r in measured if r[1] is not None and r[5] > 1]
    prompt = sum(r[3] for r in rows)
    cached = sum(r[4] for r in rows)
    span = (max(r[2] for r in measured) - start) if measured else 0.0
    return LatencyStats(
        requests=len(measured),
        ttft_p50_s=quantile(ttft, 0.5),
        ttft_p95_s=quantile(ttft, 0.95),
        tpot_p50_s=quantile(tpot, 0.5),
        tpot_p95_s=quantile(tpot, 0.95),
        prefix_hit_ratio=cached / prompt if prompt else 0.0,
        requests_per_s=len(measured) / span if span > 0 else 0.0,
        tokens_per_s=sum(r[3] + r[5] for r in measured) / span if span > 0 else 0.0,
        ttft_samples=tuple(ttft) if keep_samples else (),
        tpot_samples=tuple(tpot) if keep_samples else (),
    )


def replay_fleet(
    preset: Preset,
    workload: Workload,
    replicas: int,
    *,
    max_num_seqs: int | None = None,
    warmup_fraction: float = 0.1,
    keep_samples: bool = False,
    seed: int = 0,
) -> LatencyStats:
    """Replay ``workload`` at its own arrival times on ``replicas`` simulated replicas (see the
    module docstring); prompts longer than the context are cut to fit, as a client must."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    overrides: dict[str, Any] = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    cluster = VirtualCluster(preset, replicas, seed=seed, **overrides)
    bs = preset.block_size
    max_len = preset.context_len
    inflight = [0] * replicas
    turn = [0]
    rows: list[tuple[float, float | None, float, int, int, int]] = []

    def finished(res: SimResult) -> None:
        inflight[res.replica] -= 1
        rows.append(
            (
                res.arrival,
                res.ttft,
                res.finish_time,
                res.num_prompt_tokens,
                res.num_cached_tokens,
                res.num_output_tokens,
            )
        )

    def arrive(c: VirtualCluster, *, req: SimRequest) -> None:
        least = min(inflight)
        # The fewest in flight; among equals, the next after the last pick (rotating ties).
        k = turn[0]
        for j in range(replicas):
            i = (k + j) % replicas
            if inflight[i] == least:
                break
        turn[0] = i + 1
        inflight[i] += 1
        c.submit(i, req)

    reqs = workload.requests
    t0 = reqs[0].arrival_s
    for n, r in enumerate(reqs):
        prompt = min(r.input_length, max_len - 2)
        output = max(1, min(r.output_length, max_len - prompt - 1))
        hashes = block_hashes(r, bs)[: prompt // bs]
        sim = SimRequest(
            f"p{n}", max_tokens=output, block_hashes=hashes, num_prompt_tokens=prompt, on_finish=finished
        )
        cluster.at(r.arrival_s - t0, functools.partial(arrive, req=sim))
    cluster.run()
    start = warmup_fraction * (reqs[-1].arrival_s - t0)
    return stats_of(rows, start, keep_samples=keep_samples)
