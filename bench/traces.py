"""Workloads for benchmarks: the trace loaders and synthetic generator of :mod:`replicas.sim.traces`.

They moved there so the capacity planner (``scheduler/plan``), which may not import ``bench``,
replays the same workloads; this module keeps the benchmarks' imports working.
"""

from __future__ import annotations

from tidal.replicas.sim.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    belady_hit_ratio,
    block_hashes,
    capacity_hit_ratio,
    find_trace,
    ideal_hit_ratio,
    load_azure,
    load_default,
    load_mooncake,
    load_trace,
    prompt_text,
    synthetic_workload,
)

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "TraceRequest",
    "belady_hit_ratio",
    "block_hashes",
    "capacity_hit_ratio",
    "find_trace",
    "ideal_hit_ratio",
    "load_azure",
    "load_default",
    "load_mooncake",
    "load_trace",
    "prompt_text",
    "synthetic_workload",
]
