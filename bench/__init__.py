"""Benchmarks: each measures speed or scale against a baseline measured in the same run.

``tidal bench NAME [--quick]`` runs one; it prints a table and writes ``bench/results/NAME.json``.
Benchmarks register here by name; each module exposes ``run(quick: bool, out_dir: Path, **options)
-> list[dict]`` whose keyword parameters are its options (``tidal bench`` refuses any other).
"""

from __future__ import annotations

__all__ = ["BENCHMARKS"]

# name -> "module:function"
BENCHMARKS: dict[str, str] = {
    "autoscale": "bench.autoscale:run",
    "gate": "bench.gate:run",
    "routing": "bench.routing:run",
    "gateway": "bench.gateway:run",
    "batch": "bench.batch:run",
    "sim": "bench.sim:run",
    "kv-keys": "bench.kv_keys:run",
    "fairness": "bench.fairness:run",
    "router-scale": "bench.router_scale:run",
    "chaos": "bench.chaos:run",
    "soak": "bench.soak:run",
    "mixed-soak": "bench.mixed_soak:run",
}
