"""The built wheel installs one top-level package, `tidal`, with every subsystem beneath it.

The subsystems keep their top-level folders in the repository (tidal/api links to ../api); the
wheel must hold them as tidal.api, tidal.router, ... and nothing named api, router or bench at
the top of site-packages, where it would collide with other distributions. The test builds the
wheel from a copy of the sources, installs it into a fresh virtual environment (its
dependencies come from the test environment's site-packages, not from the network) and runs
`tidal --help` and one import of each part there, away from the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.test_layering import SUBSYSTEMS

ROOT = Path(__file__).resolve().parents[1]
# One module of each part that pulls in most of it.
PARTS = [
    "tidal.cli",
    "tidal.api.app",
    "tidal.router.framework",
    "tidal.priority.queues",
    "tidal.scheduler.service",
    "tidal.workers.app",
    "tidal.batch_jobs.store",
    "tidal.replicas.sim.server",
    "tidal.bench.routing",
]
# Files that are not Python but must ship (read at run time by path).
DATA = [
    "tidal/defaults/fleet.yaml",
    "tidal/replicas/vllm_site/sitecustomize.py",
    "tidal/batch_jobs/migrations/script.py.mako",
    "tidal/scheduler/plan/catalog.yaml",
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ["tidal", *SUBSYSTEMS]:
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=skip)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("tidal-*.whl")
    return built


def test_wheel_holds_tidal_alone(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"tidal"}, sorted(top)
    for part in SUBSYSTEMS:
        assert f"tidal/{part}/__init__.py" in names, f"tidal.{part} missing from the wheel"
    for data in DATA:
        assert data in names, f"{data} missing from the wheel"
    assert not any(n.startswith("tests/") or "/tests/" in n for n in names)


def test_installed_wheel_runs_without_the_repository(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # The dependencies: the test environment's site-packages, appended after the venv's own (a
    # .pth adds the directory without running the .pth files in it, so this checkout's editable
    # install stays out of sight).
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, cwd=run_dir, env=env, capture_output=True, text=True, timeout=120)

    helped = run(str(env_dir / "bin" / "tidal"), "--help")
    assert helped.returncode == 0, helped.stderr
    assert "Usage" in helped.stdout

    code = "import importlib, tidal\n"
    code += f"for m in {PARTS!r}: importlib.import_module(m)\n"
    code += "print(tidal.__file__)\n"
    imported = run(str(python), "-c", code)
    assert imported.returncode == 0, imported.stderr
    assert Path(imported.stdout.strip()).is_relative_to(purelib), imported.stdout

    for name in SUBSYSTEMS:
        leaked = run(str(python), "-c", f"import {name}")
        assert leaked.returncode != 0, f"the wheel installed a top-level {name!r}"
