"""Imports flow one way: api -> router/priority/batch_jobs -> replicas; nothing imports api.

scheduler and workers use replicas, priority and batch_jobs (the scheduler also the Celery app in
workers); everyone may use the core package `tidal` (settings, fleet, clock), but only `tidal.cli`
may import the subsystems.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["tidal", "api", "router", "priority", "scheduler", "workers", "batch_jobs", "replicas", "bench"]

# package -> the packages it may import (besides itself and the core `tidal`)
ALLOWED: dict[str, set[str]] = {
    "replicas": set(),
    "priority": {"replicas"},
    "router": {"replicas", "priority"},
    "batch_jobs": {"replicas", "priority"},
    "workers": {"replicas", "priority", "batch_jobs"},
    # The scheduler pauses the shared lane through the Celery app that `workers` defines.
    "scheduler": {"replicas", "priority", "batch_jobs", "workers"},
    "api": {"router", "priority", "batch_jobs", "replicas"},
    # Benchmarks drive the same library objects the product runs; the gateway only as a process.
    "bench": set(PACKAGES) - {"bench", "api"},
    "tidal": set(),  # the core; tidal.cli is checked separately
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_flow_one_way(package: str) -> None:
    bad: list[str] = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("tidal", "cli"):
            continue  # the command line is the top layer
        for imported in _imports(path) - {package, "tidal"} - ALLOWED[package]:
            bad.append(f"{rel} imports {imported}")
    assert not bad, "\n".join(bad)


def test_nothing_imports_api() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for pkg in PACKAGES
        if pkg not in ("api", "tidal")
        for p in (ROOT / pkg).rglob("*.py")
        if "api" in _imports(p)
    ]
    assert not offenders
