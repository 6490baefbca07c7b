"""Imports flow one way: api -> router/priority/batch_jobs -> replicas; nothing imports api.

scheduler and workers use replicas, priority and batch_jobs (the scheduler also the Celery app in
workers); everyone may use the core package `tidal` (settings, fleet, clock), but only `tidal.cli`
may import the subsystems.

Each subsystem keeps its top-level folder but is a subpackage of `tidal` (tidal/api links to
../api), so every import names it as `tidal.api`, never `api`: a wheel installs `tidal` alone.
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


SUBSYSTEMS = [p for p in PACKAGES if p != "tidal"]


def _modules(path: Path) -> set[str]:
    """Every absolute module name the file imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _imports(path: Path) -> set[str]:
    """The project's packages the file imports: `tidal.router.pool` counts as `router`."""
    found: set[str] = set()
    for module in _modules(path):
        parts = module.split(".")
        if parts[0] == "tidal":
            found.add(parts[1] if len(parts) > 1 and parts[1] in SUBSYSTEMS else "tidal")
    return found


def _sources() -> list[Path]:
    """The project's modules, each once (tidal/<subsystem> links are not walked twice)."""
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))] + sorted(
        (ROOT / "tests").rglob("*.py")
    )


def test_subsystems_are_imported_through_tidal() -> None:
    for name in SUBSYSTEMS:
        link = ROOT / "tidal" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), (
            f"tidal/{name} must link to ../{name}"
        )
    bad = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _sources()
        for module in _modules(path)
        if module.split(".")[0] in SUBSYSTEMS
    ]
    assert not bad, "import these as tidal.<name>:\n" + "\n".join(bad)


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
