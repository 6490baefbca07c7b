"""``tidal bench chaos``: the fault matrix, as a table.

Runs the chaos suite (``tests/chaos/``: every fault injected into real processes and services
the test itself started) and prints one row per fault: requests sent, failed (the client saw an
error it can retry on), retried (by the gateway, unseen by the client), lost (cut without an
error), duplicated (answered twice), hung (past the client's timeout), and the time to recover
(interactive: from the fault to the end of the last failed request; batch: from the fault to the
first line answered after it; a fault that fails no request -- latency and loss on one replica, a
KV-event stream cut, Redis lost, a failing autoscaler actuator -- from its end until what it
broke is whole again: TTFT near baseline, the index current, every gateway rejoined, the pool at
its size). Each test also asserts its row's targets (0 lost,
0 duplicated, 0 hung, every request after recovery answered); a failed test shows in the
``passed`` column and makes the benchmark's result say so.

Options: ``--only EXPR`` (pytest ``-k`` expression, e.g. ``sigstop``). ``--quick`` runs the same
rows: each is already short (tens of seconds).

Example::

    tidal bench chaos
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["run"]

ROOT = Path(__file__).resolve().parents[1]
SUITE = "tests/chaos"


def run(quick: bool, out_dir: Path, only: str | None = None) -> dict[str, Any]:
    """The rows the suite recorded, and whether every test passed."""
    from tidal.cli.bench import print_table

    if not (ROOT / SUITE).is_dir():
        raise SystemExit(f"{SUITE} is not in this checkout: the fault matrix runs from a source tree")
    with tempfile.TemporaryDirectory(prefix="tidal-chaos-") as tmp:
        results = Path(tmp) / "rows.jsonl"
        report = Path(tmp) / "report.json"
        args = [sys.executable, "-m", "pytest", SUITE, "-q", "-p", "no:cacheprovider", "-rA"]
        if only:
            args += ["-k", only]
        env = {**os.environ, "TIDAL_CHAOS_RESULTS": str(results), "TIDAL_CHAOS_REPORT": str(report)}
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
        rows = [json.loads(ln) for ln in results.read_text().splitlines()] if results.exists() else []
        outcomes = json.loads(report.read_text()) if report.exists() else {}
    for row in rows:
        row["passed"] = outcomes.get(row["test"], "unknown")
    print_table(
        [
            {
                "tier": r["tier"],
                "fault": r["fault"],
                "requests": r["requests"],
                "failed": r["failed"],
                "retried": r["retried"],
                "lost": r["lost"],
                "duplicated": r["duplicated"],
                "hung": r["hung"],
                "recovery_s": f"{r['recovery_s']:.2f}" if r["recovery_s"] is not None else "-",
                "passed": r["passed"],
            }
            for r in rows
        ]
    )
    tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    print(f"\nsuite: {' '.join(tail) or 'no output'} (exit {proc.returncode})")
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    return {
        "rows": rows,
        "suite_passed": proc.returncode == 0,
        "lost_total": sum(r["lost"] for r in rows),
        "duplicated_total": sum(r["duplicated"] for r in rows),
        "hung_total": sum(r["hung"] for r in rows),
    }
