"""Benchmarks: each measures speed or scale against a baseline measured in the same run.

``tidal bench NAME [--quick]`` runs one; it prints a table and writes ``bench/results/NAME.json``.
Benchmarks register here by name; each module exposes ``run(quick: bool, out_dir: Path, **options)
-> list[dict]`` whose keyword parameters are its options (``tidal bench`` refuses any other).
"""

from __future__ import annotations

__all__ = ["BENCHMARKS"]

# name -> "module:function"
BENCHMARKS: dict[str, str] = {
    "autoscale": "tidal.bench.autoscale:run",
    "gate": "tidal.bench.gate:run",
    "routing": "tidal.bench.routing:run",
    "gateway": "tidal.bench.gateway:run",
    "batch": "tidal.bench.batch:run",
    "sim": "tidal.bench.sim:run",
    "kv-keys": "tidal.bench.kv_keys:run",
    "fairness": "tidal.bench.fairness:run",
    "router-scale": "tidal.bench.router_scale:run",
    "chaos": "tidal.bench.chaos:run",
    "soak": "tidal.bench.soak:run",
    "mixed-soak": "tidal.bench.mixed_soak:run",
}
